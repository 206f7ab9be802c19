"""What a paged engine is built with, checked without building one: its dtype, its attention backend (and CUDA
graphs with it) and its block size. `PagedGenerationEngine` uses these at construction; `check_paged_engine` is the
`paged` factory's pre-flight check (`astrai.rollout.engine.check_engine`, `python -m astrai.train --check`)."""

from __future__ import annotations

import difflib
from typing import Any, Optional, Union

import torch

from astrai.kernels import select_backend
from astrai.rollout.cuda_graphs import backend_for_graphs, check_cuda_graphs

__all__ = ["ENGINE_DTYPES", "PAGED_OPTIONS", "check_paged_engine", "check_paged_options", "engine_backend",
           "resolve_dtype"]

PAGED_OPTIONS = ("max_num_seqs", "max_kv_tokens", "max_batch_tokens", "block_size", "prefix_cache", "dense_decode",
                 "cuda_graphs", "adaptive_threads")
"""The options the paged engine takes beyond the common arguments (`rollout.engine_options`, `rollout.cuda_graphs`)."""


_COUNTS = ("max_num_seqs", "max_kv_tokens", "max_batch_tokens", "block_size")
"""The paged engine's options that are positive integers (the others are booleans)."""


def check_paged_options(options) -> None:
    """ValueError (one line, naming `rollout.engine_options.<option>`) for an option the paged engine does not
    take, or a value of the wrong kind (counts: positive integers; switches: booleans)."""
    for name, value in options.items():
        if name not in PAGED_OPTIONS:
            close = difflib.get_close_matches(name, PAGED_OPTIONS, n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"options: {', '.join(PAGED_OPTIONS)}"
            raise ValueError(f"rollout.engine_options: the paged engine takes no option {name!r} ({hint})")
        count = name in _COUNTS
        if (count and (isinstance(value, bool) or not isinstance(value, int) or value < 1)) or \
                (not count and not isinstance(value, bool)):
            expected = "an integer > 0" if count else "true or false"
            raise ValueError(f"rollout.engine_options.{name}: expected {expected}, got {value!r}")


ENGINE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: Union[None, str, torch.dtype]) -> Optional[torch.dtype]:
    """None, a name of `ENGINE_DTYPES` or one of its dtypes -> the torch dtype (None stays None).

    Raises:
        ValueError: for anything else.
    """
    if dtype is None or dtype in ENGINE_DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in ENGINE_DTYPES:
        return ENGINE_DTYPES[dtype.removeprefix("torch.")]
    raise ValueError(f"PagedGenerationEngine: dtype must be one of {', '.join(ENGINE_DTYPES)}, got {dtype!r}")


def engine_backend(model_config, *, device, dtype: torch.dtype, backend: Optional[str] = None,
                   block_size: Optional[int] = None, cuda_graphs: bool = False) -> tuple[Any, int]:
    """(attention backend, block size) of a paged engine over a model of `model_config` on `device` in `dtype`:
    `backend` as `select_backend` picks it (`auto` becomes `triton` on CUDA with `cuda_graphs`), the block size
    given or the backend's default (16; 256 for flash-attn).

    Raises:
        BackendUnavailableError: a backend that cannot serve the device, dtype or block size, or CUDA graphs that
            cannot be captured with it (one line naming the field).
        ValueError: a block size that is not a multiple of the backend's.
    """
    backend = backend_for_graphs(backend, device) if cuda_graphs else backend
    chosen = select_backend(backend, device, dtype=dtype, block_size=block_size)
    if cuda_graphs:
        check_cuda_graphs(device, chosen.name, model_config)
    block_size = block_size if block_size is not None else (16 if chosen.block_size_multiple == 1 else 256)
    if block_size % chosen.block_size_multiple:
        raise ValueError(f"block_size {block_size} must be a multiple of {chosen.block_size_multiple} for the "
                         f"{chosen.name} backend")
    return chosen, block_size


def check_paged_engine(model_config, *, device, dtype=None, attention_backend: Optional[str] = None,
                       tensor_parallel_size: int = 1, **options) -> None:
    """What `paged_engine` would refuse for a model of `model_config` on `device`, without building it (the
    factory's `check`, `astrai.rollout.engine.check_engine`): the dtype (None: float32), the attention backend, CUDA
    graphs and the block size (`engine_backend`), the option names (`check_paged_options`), and a model that
    `tensor_parallel_size` ranks cannot split (`tensor_parallel.check_tensor_parallel`; CUDA graphs with it)."""
    from astrai.rollout.tensor_parallel import check_tensor_parallel

    check_tensor_parallel(model_config, tensor_parallel_size)
    if tensor_parallel_size > 1 and options.get("cuda_graphs"):
        raise ValueError("rollout.cuda_graphs: not yet supported with rollout.tensor_parallel_size > 1")
    check_paged_options(options)
    dtype = resolve_dtype(dtype) or torch.float32
    engine_backend(model_config, device=torch.device(device), dtype=dtype, backend=attention_backend,
                   block_size=options.get("block_size"), cuda_graphs=bool(options.get("cuda_graphs", False)))
