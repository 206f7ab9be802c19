"""The rollout engine interface (`GenerationEngine`) and the one factory every caller builds engines with.

Trainer (online rollouts, evaluation), `python -m astrai.evaluate` and `python -m astrai.serve` hold an engine only
through this protocol and build it with `build_engine(name, model, ...)`, so a second engine (a vLLM or SGLang
adapter, say) plugs in with one `register_engine` call and one config value (`rollout.engine`). The engine
contract is docs/conventions.md section 4: its own inference copy of the weights tagged with `policy_version`,
weight loading acknowledged and never interleaved with generation, KV memory released by `sleep()` and taken back
by `wake()`, behaviour log-probs as section 2 defines them.

Registered: `paged` (`paged_engine.PagedGenerationEngine`, the default) and `vllm` (`vllm_engine`: vLLM's offline
`LLM`, optional; docs/vllm.md). The tests register their dense
contiguous-cache reference engine as `reference` and run the same trainer paths through it.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, Protocol, Sequence, Union, runtime_checkable

import torch

from astrai.rollout.generation import Generation
from astrai.rollout.sampling import SamplingParams

__all__ = ["ATTENTION_BACKEND_ENV", "EngineCapacity", "GenerationEngine", "StreamingEngine", "attention_backend",
           "build_engine", "check_engine", "engine_factory", "engine_names", "register_engine", "sync_weights"]

ATTENTION_BACKEND_ENV = "ASTR_BACKEND"
"""Environment variable that, when set, overrides `rollout.attention_backend` (and the CLIs' default)."""


@dataclass(frozen=True)
class EngineCapacity:
    """What an engine can hold at once; None = no limit of its own.

    Attributes:
        max_num_seqs: concurrently decoded rows (requests).
        max_kv_tokens: KV-cache capacity in tokens (all rows together).
        max_batch_tokens: tokens one forward step takes (prefill chunks plus one per decoding row).
        max_position_embeddings: the longest prompt + response the model's rotary table allows.
    """

    max_num_seqs: Optional[int] = None
    max_kv_tokens: Optional[int] = None
    max_batch_tokens: Optional[int] = None
    max_position_embeddings: Optional[int] = None


@runtime_checkable
class GenerationEngine(Protocol):
    """A colocated rollout engine (docs/conventions.md section 4).

    Attributes:
        policy_version: the version of the weights it holds (-1 while a streamed load is incomplete).
        pad_token_id: pads prompts and finished responses in its outputs.
    """

    policy_version: int
    pad_token_id: int

    @property
    def device(self) -> torch.device:
        """Where its weights live and its outputs are returned."""

    @property
    def capacity(self) -> EngineCapacity:
        """What it can hold at once."""

    def generate(self, prompts: Sequence[Sequence[int]], params: Union[SamplingParams, Sequence[SamplingParams]],
                 generator: Optional[torch.Generator] = None, *, n: int = 1, penalties: Any = None,
                 on_token: Optional[Callable[[int, int], None]] = None) -> Generation:
        """`n` samples of each of B prompts (rows b * n + g): `Generation` with (B*n, P) left-padded prompts,
        (B*n, T) right-padded responses, `action_mask`, float32 `old_logprobs`, `finished` and `policy_version`."""

    def load_weights(self, state_dict: Union[Mapping[str, torch.Tensor], Iterable], policy_version: int) -> int:
        """Take the weights (Hugging Face names; a mapping or a stream of (name, tensor) pairs), tag them with
        `policy_version` and drop KV state of older versions; returns the acknowledged version."""

    def sleep(self) -> None:
        """Release the KV memory until `wake()` (the weights stay)."""

    def wake(self) -> None:
        """Take the KV memory back."""


@runtime_checkable
class StreamingEngine(Protocol):
    """An engine that serves requests one decode step at a time (what `astrai.serve` drives; the paged engine's
    `add_request` / `step` / `abort`, see `astrai.rollout.streaming`). Optional: training needs only
    `GenerationEngine`."""

    @property
    def has_unfinished_requests(self) -> bool:
        """True while an added request is not done."""

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams, *, n: int = 1, penalty: Any = None,
                    seed: Optional[int] = None, top_logprobs: int = 0) -> int:
        """Queue n samples of one prompt for the next `step()`; returns its request id."""

    def step(self) -> list:
        """One step over the live requests; the `StepOutput`s (request id, choice, token, logprob, top, done)."""

    def abort(self, request_id: int, choice: Optional[int] = None) -> None:
        """Stop a request (or one choice); its KV memory is free on return."""

    def stream_stats(self) -> dict:
        """Counts of running and waiting choices and KV blocks (total, free, cached)."""


EngineFactory = Callable[..., GenerationEngine]
"""`(model, *, pad_token_id, policy_version=0, dtype=None, attention_backend=None, **options) -> engine`: the
engine makes its own inference copy of `model` (before the policy is sharded)."""

_ENGINES: dict[str, Union[str, EngineFactory]] = {"paged": "astrai.rollout.paged_engine:paged_engine",
                                                   "vllm": "astrai.rollout.vllm_engine:vllm_engine"}


def register_engine(name: str, factory: Union[str, EngineFactory]) -> None:
    """Make `factory` (an `EngineFactory` or its "module:function" path, imported on first use) buildable as
    `name` (`rollout.engine`). Replaces an earlier registration of the same name."""
    _ENGINES[name] = factory


def engine_names() -> tuple[str, ...]:
    """The registered engine names."""
    return tuple(_ENGINES)


def engine_factory(name: str) -> EngineFactory:
    """The factory registered as `name`, imported now. Raises ValueError (one line) for an unknown name."""
    if name not in _ENGINES:
        raise ValueError(f"rollout.engine: unknown engine {name!r}; registered: {', '.join(_ENGINES)}")
    factory = _ENGINES[name]
    if isinstance(factory, str):
        module, _, attr = factory.partition(":")
        factory = getattr(importlib.import_module(module), attr)
    return factory


def check_engine(name: str, model_config, *, device: Union[str, torch.device],
                 dtype: Union[None, str, torch.dtype] = None, attention_backend: Optional[str] = None,
                 **options: Any) -> None:
    """What building engine `name` over a model of `model_config` on `device` would refuse (its dtype, attention
    backend or options), without building it: the factory's own `check` attribute when it has one (a callable
    taking these arguments), else only the name. For pre-flight checks (`python -m astrai.train --check`).

    Raises:
        ValueError: an unknown engine name, or the engine's refusal (one line);
        `astrai.kernels.BackendUnavailableError` for a backend that cannot serve the device or dtype.
    """
    check = getattr(engine_factory(name), "check", None)
    if check is not None:
        check(model_config, device=device, dtype=dtype, attention_backend=attention_backend, **options)


def attention_backend(configured: Optional[str]) -> Optional[str]:
    """The attention backend an engine is built with: `ASTR_BACKEND` when set (an override, e.g. for one run of
    a job file), else `configured` (`rollout.attention_backend`; None = `auto`)."""
    return os.environ.get(ATTENTION_BACKEND_ENV) or configured


def build_engine(name: str, model: torch.nn.Module, *, pad_token_id: int, policy_version: int = 0,
                 dtype: Union[None, str, torch.dtype] = None, attention_backend: Optional[str] = None,
                 **options: Any) -> GenerationEngine:
    """A rollout engine of kind `name` over an inference copy of `model`.

    Args:
        name: a registered engine (`engine_names()`; `rollout.engine`).
        model: the policy (`AutoRegressiveLM`), whole (not sharded); the engine copies it.
        pad_token_id: the tokenizer's padding id; policy_version: the tag of `model`'s weights.
        dtype: the engine copy's and KV cache's dtype (None: the model's; `rollout.dtype`).
        attention_backend: `auto`, `torch`, `triton`, `flash_attn` or None (see `astrai.kernels.select_backend`).
        options: engine-specific sizes (the paged engine's `max_num_seqs`, `max_kv_tokens`, ...).

    Raises:
        ValueError: an unknown engine name, or the engine's own refusal of a setting (one line);
        `astrai.kernels.BackendUnavailableError` for a backend that cannot serve the device or dtype.
    """
    engine = engine_factory(name)(model, pad_token_id=pad_token_id, policy_version=policy_version, dtype=dtype,
                            attention_backend=attention_backend, **options)
    if not isinstance(engine, GenerationEngine):
        raise TypeError(f"rollout.engine {name!r}: the factory returned {type(engine).__name__}, which lacks part "
                        "of the GenerationEngine interface (generate, load_weights, sleep, wake, capacity)")
    return engine


def sync_weights(engine: GenerationEngine, weights: Callable[[], Iterable[tuple[str, torch.Tensor]]],
                 policy_version: int) -> None:
    """Load `weights()` into `engine` unless it already holds `policy_version`, and check the engine's
    acknowledgement (docs/conventions.md section 4). `weights` is called only when a load is needed; it yields
    (name, full tensor) one at a time (a trained model's `full_weights`: gathered from the shards under fsdp2 /
    zero3 on every rank, LoRA adapters merged), so no second full copy is held beside the engine's.

    Raises:
        RuntimeError: when the engine acknowledges another version.
    """
    if engine.policy_version != policy_version:
        acknowledged = engine.load_weights(weights(), policy_version)
        if acknowledged != policy_version:
            raise RuntimeError(f"engine acknowledged version {acknowledged}, expected {policy_version}")
