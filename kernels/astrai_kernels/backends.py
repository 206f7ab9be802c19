"""Attention backends behind one interface: the pure-torch reference (any device), Triton kernels (CUDA) and
flash-attn (CUDA, float16/bfloat16, block size % 256 == 0).

`select_backend()` reads `ASTR_BACKEND` = `torch` | `triton` | `flash_attn` | `auto` (default). `auto` picks, for
the engine's device, dtype and block size: flash-attn when it is importable on CUDA and the dtype is float16/bfloat16
and the block size (if fixed) a multiple of 256; else Triton when it is importable on CUDA; else the torch reference.
Asking explicitly for a backend that cannot serve the configuration raises `BackendUnavailableError` with a one-line
reason, so the engine fails at construction and never mid-rollout. Every backend has `attention(q, k_cache,
v_cache, meta, *, window=None, softcap=None)` over the cache layout of `kernels.paged_attention` (docs/kernels.md):
each layer passes its sliding window and score soft-cap (the model families of `astrai.models.families`); all
three backends serve both.

flash-attn (Dao 2023, FlashAttention-2) is an optional extra (`astrai[flash]`, compiled from source against CUDA)
and Triton comes with CUDA builds of torch (and with `astrai[dev]` on Linux x86_64); both are imported only when
probed on CUDA or selected. The probes are module functions (`_cuda_available`, `_import_error`) so tests can stub
them.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

import torch

from astrai.deps import unavailable_reason

from .paged_attention import paged_decode_attention, paged_prefill_attention

__all__ = ["AttentionMetadata", "TorchBackend", "TritonBackend", "FlashAttnBackend", "BackendUnavailableError",
           "BACKEND_NAMES", "select_backend", "flash_attn_unavailable_reason", "triton_unavailable_reason"]

BACKEND_NAMES = ("auto", "torch", "triton", "flash_attn")
FLASH_BLOCK_MULTIPLE = 256
FLASH_DTYPES = (torch.float16, torch.bfloat16)
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class BackendUnavailableError(RuntimeError):
    """Raised when a requested attention backend cannot serve the configuration (message: one line naming why)."""


@dataclass
class AttentionMetadata:
    """Layout of one engine step (shared by all layers).

    Attributes:
        qo_indptr: B + 1 cumulative query offsets (Python ints).
        kv_lens: B cached lengths including this step's tokens (Python ints).
        qo_indptr_t: (B + 1,) int32 tensor of `qo_indptr` on the device.
        kv_lens_t: (B,) int32 tensor of `kv_lens` on the device.
        block_tables: (B, max_blocks) int32 on the device.
        max_q, max_kv: largest query count / cached length of the step.
        scale: softmax scale (`ModelConfig.attention_scale`: D ** -0.5, or query_pre_attn_scalar ** -0.5).
        scratch: optional `InferenceWorkspace` whose reused buffers the torch backend gathers keys/values into.
    """

    qo_indptr: list[int]
    kv_lens: list[int]
    qo_indptr_t: torch.Tensor
    kv_lens_t: torch.Tensor
    block_tables: torch.Tensor
    max_q: int
    max_kv: int
    scale: float
    scratch: object = None

    @property
    def decode_only(self) -> bool:
        """True when every sequence has exactly one query."""
        return self.max_q == 1 and len(self.kv_lens) == self.qo_indptr[-1]


class TorchBackend:
    """Pure-torch paged attention (`kernels.paged_attention`): any device, any float dtype, any block size."""

    name = "torch"
    block_size_multiple = 1

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, *, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """q (N, Nh, D) packed queries -> (N, Nh, D), over the paged cache (see module docstring); `window`: the
        layer's sliding window (None: full causal), `softcap`: its score soft-cap (None: none)."""
        if meta.decode_only:
            return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.kv_lens_t, meta.scale,
                                          meta.max_kv, meta.scratch, window=window, softcap=softcap)
        return paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.qo_indptr, meta.kv_lens,
                                       meta.scale, window=window, softcap=softcap)


def _cuda_available() -> bool:
    """torch.cuda.is_available() (a probe the tests stub)."""
    return torch.cuda.is_available()


_INSTALL = {"triton": "pip install triton", "flash_attn": "pip install 'astrai[flash]'"}


def _import_error(module: str) -> str | None:
    """None when `module` imports, else a one-line reason saying whether it is not installed or installed but
    failing to import (a broken CUDA build raises at import), with the import error's first line (a probe the tests
    stub)."""
    return unavailable_reason(module, needed_by=f"the {module} attention backend", install=_INSTALL.get(module))


def _triton_interpreter_on() -> bool:
    """True when TRITON_INTERPRET asks Triton to run kernels on CPU tensors through its interpreter."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


def _cuda_reason(name: str, device: torch.device | str | None) -> str | None:
    """None when `device` is a usable CUDA device, else a one-line reason naming backend `name`."""
    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda":
        return f"{name} backend needs a CUDA device, got {device}"
    if not _cuda_available():
        return f"{name} backend needs CUDA, but torch.cuda.is_available() is False"
    return None


def flash_attn_unavailable_reason(device: torch.device | str | None, dtype: torch.dtype | None = None,
                                  block_size: int | None = None) -> str | None:
    """None when flash-attn can serve (device, dtype, block size), else a one-line reason. None arguments are
    not checked (block_size None: the engine then picks 256)."""
    reason = _cuda_reason("flash_attn", device)
    if reason is None and dtype is not None and dtype not in FLASH_DTYPES:
        reason = (f"flash_attn backend needs float16/bfloat16, got {dtype} "
                  "(set rollout.dtype to bfloat16, or use the triton backend)")
    if reason is None and block_size is not None and block_size % FLASH_BLOCK_MULTIPLE:
        reason = f"flash_attn backend needs block_size % {FLASH_BLOCK_MULTIPLE} == 0, got {block_size}"
    return reason or _import_error("flash_attn")


def triton_unavailable_reason(device: torch.device | str | None, dtype: torch.dtype | None = None, *,
                              allow_interpreter: bool = False) -> str | None:
    """None when the Triton kernels can serve (device, dtype), else a one-line reason. With `allow_interpreter`
    a CPU device is accepted while TRITON_INTERPRET=1 (Triton's CPU interpreter: for tests, very slow)."""
    if dtype is not None and dtype not in TRITON_DTYPES:
        return f"triton backend needs float16/bfloat16/float32, got {dtype}"
    on_cpu = device is not None and torch.device(device).type == "cpu"
    if not (allow_interpreter and on_cpu and _triton_interpreter_on()):
        reason = _cuda_reason("triton", device)
        if reason is not None:
            return reason
    return _import_error("triton")


class TritonBackend:
    """Triton paged kernels (`kernels.triton_attention`): decode-only steps use the decode kernel (one program per
    sequence and KV head), other steps the ragged prefill kernel. Any block size; float16/bfloat16/float32.

    Args:
        device: where attention runs (CUDA; CPU only under TRITON_INTERPRET=1).
        dtype: the cache/query dtype to validate (None: not checked).

    Raises:
        BackendUnavailableError: from the constructor when Triton cannot serve (device, dtype).
    """

    name = "triton"
    block_size_multiple = 1

    def __init__(self, device: torch.device | str | None, dtype: torch.dtype | None = None):
        reason = triton_unavailable_reason(device, dtype, allow_interpreter=True)
        if reason is not None:
            raise BackendUnavailableError(reason)
        from . import triton_attention  # imports triton: only once the backend is chosen

        self._kernels = triton_attention

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, *, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """q (N, Nh, D) packed queries -> (N, Nh, D) in q's dtype; see `TorchBackend.attention`."""
        if meta.decode_only:
            return self._kernels.triton_paged_decode(q, k_cache, v_cache, meta.block_tables, meta.kv_lens_t,
                                                     meta.scale, window=window, softcap=softcap)
        return self._kernels.triton_paged_prefill(q, k_cache, v_cache, meta.block_tables, meta.qo_indptr_t,
                                                  meta.kv_lens_t, meta.max_q, meta.scale, window=window,
                                                  softcap=softcap)


class FlashAttnBackend:
    """flash-attn paged kernels: `flash_attn_with_kvcache` (decode) and `flash_attn_varlen_func` with
    `block_table` (prefill / mixed steps). The step's keys/values are written into the cache first
    (`kernels.write_kv`), so the kernels only read it. Requires CUDA, float16/bfloat16, block size % 256 == 0.

    Args:
        device: where attention runs.
        dtype, block_size: the engine's cache dtype and block size to validate (None: not checked).

    Raises:
        BackendUnavailableError: from the constructor when flash-attn cannot serve the configuration.
    """

    name = "flash_attn"
    block_size_multiple = FLASH_BLOCK_MULTIPLE

    def __init__(self, device: torch.device | str | None, dtype: torch.dtype | None = None,
                 block_size: int | None = None):
        reason = flash_attn_unavailable_reason(device, dtype, block_size)
        if reason is not None:
            raise BackendUnavailableError(reason)
        self._module = None

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, *, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """q (N, Nh, D) packed queries -> (N, Nh, D); see `TorchBackend.attention` (the constructor validated the
        dtype and block size of the engine's cache). A window W becomes flash-attn's `window_size=(W - 1, 0)` (the
        query and its W - 1 predecessors, as transformers passes it) and a soft-cap its `softcap` (flash-attn >=
        2.6); neither is exercised on this project's test machines (flash-attn is not installed there)."""
        if self._module is None:
            self._module = importlib.import_module("flash_attn")  # imported by the constructor's probe already
        extra = {"window_size": (window - 1, 0) if window is not None else (-1, -1),
                 "softcap": 0.0 if softcap is None else float(softcap)}
        if meta.decode_only:
            out = self._module.flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache,
                                                       cache_seqlens=meta.kv_lens_t, block_table=meta.block_tables,
                                                       softmax_scale=meta.scale, causal=True, **extra)
            return out.squeeze(1)
        cu_k = torch.zeros(len(meta.kv_lens) + 1, dtype=torch.int32, device=q.device)
        cu_k[1:] = torch.cumsum(meta.kv_lens_t, 0)
        # causal with fewer queries than keys is aligned to the bottom-right (flash-attn >= 2.1): query j of a
        # sequence sees keys [0, kv_len - q_len + j], as the torch reference.
        return self._module.flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q=meta.qo_indptr_t,
                                                   cu_seqlens_k=cu_k, max_seqlen_q=meta.max_q,
                                                   max_seqlen_k=meta.max_kv, softmax_scale=meta.scale, causal=True,
                                                   block_table=meta.block_tables, **extra)


def select_backend(name: str | None = None, device: torch.device | str | None = None, *,
                   dtype: torch.dtype | None = None, block_size: int | None = None):
    """Pick the attention backend for an engine on `device` with cache dtype `dtype` and block size `block_size`.

    Args:
        name: `torch`, `triton`, `flash_attn` or `auto`; None reads `ASTR_BACKEND` (default `auto`).
        device: where attention runs.
        dtype: the KV cache / compute dtype (None: not checked).
        block_size: tokens per KV block, or None when the engine picks it from the backend.

    Returns:
        A backend instance (`TorchBackend`, `TritonBackend` or `FlashAttnBackend`). An `auto` choice other than
        flash-attn carries `fallback_reason`, naming why the better backends were not used.

    Raises:
        ValueError: for an unknown name.
        BackendUnavailableError: when `triton` or `flash_attn` is requested explicitly and cannot serve the
            configuration (one-line reason).
    """
    name = (name or os.environ.get("ASTR_BACKEND") or "auto").strip().lower()
    if name not in BACKEND_NAMES:
        raise ValueError(f"ASTR_BACKEND: expected one of {', '.join(BACKEND_NAMES)}, got {name!r}")
    if name == "torch":
        return TorchBackend()
    if name == "triton":
        return TritonBackend(device, dtype)
    if name == "flash_attn":
        return FlashAttnBackend(device, dtype, block_size)
    flash_reason = flash_attn_unavailable_reason(device, dtype, block_size)
    if flash_reason is None:
        return FlashAttnBackend(device, dtype, block_size)
    triton_reason = triton_unavailable_reason(device, dtype)
    backend = TritonBackend(device, dtype) if triton_reason is None else TorchBackend()
    backend.fallback_reason = flash_reason if triton_reason is None else f"{flash_reason}; {triton_reason}"
    return backend
