"""Attention backends behind one interface: the pure-torch reference (any device) and flash-attn (CUDA).

`select_backend()` reads `ASTR_BACKEND` = `torch` | `flash_attn` | `auto` (default). `auto` takes flash-attn when
it is importable and the device is CUDA, else torch. Asking explicitly for a backend that cannot run raises
`BackendUnavailableError` with a one-line reason.

flash-attn (Dao et al. 2022/2023, FlashAttention-2) is imported lazily: it needs CUDA to build and is an optional
extra (`astrai[flash]`). Its paged KV cache uses the same layout as the torch reference, (num_blocks, block_size,
Nkv, D), with two constraints: the block size must be a multiple of 256 and tensors must be float16/bfloat16.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

import torch

from .paged_attention import paged_decode_attention, paged_prefill_attention

__all__ = ["AttentionMetadata", "TorchBackend", "FlashAttnBackend", "BackendUnavailableError", "select_backend",
           "flash_attn_unavailable_reason"]

FLASH_BLOCK_MULTIPLE = 256


class BackendUnavailableError(RuntimeError):
    """Raised when a requested attention backend cannot run here (message: one line naming why)."""


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
        scale: softmax scale (D ** -0.5).
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
                  meta: AttentionMetadata) -> torch.Tensor:
        """q (N, Nh, D) packed queries -> (N, Nh, D), over the paged cache (see module docstring)."""
        if meta.decode_only:
            return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.kv_lens_t, meta.scale,
                                          meta.max_kv, meta.scratch)
        return paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.qo_indptr, meta.kv_lens,
                                       meta.scale)


def flash_attn_unavailable_reason(device: torch.device | str | None) -> str | None:
    """None when the flash-attn backend can run on `device`, else a one-line reason."""
    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda":
        return f"flash_attn backend needs a CUDA device, got {device}"
    if not torch.cuda.is_available():
        return "flash_attn backend needs CUDA, but torch.cuda.is_available() is False"
    try:
        importlib.import_module("flash_attn")
    except Exception as exc:  # ImportError, or a broken CUDA build raising at import
        return f"flash_attn is not importable ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    return None


class FlashAttnBackend:
    """flash-attn paged kernels: `flash_attn_with_kvcache` (decode) and `flash_attn_varlen_func` with
    `block_table` (prefill / mixed steps). The step's keys/values are written into the cache first
    (`kernels.write_kv`), so the kernels only read it. Requires CUDA, float16/bfloat16, block size % 256 == 0.

    Raises:
        BackendUnavailableError: from the constructor when flash-attn cannot run on `device`.
    """

    name = "flash_attn"
    block_size_multiple = FLASH_BLOCK_MULTIPLE

    def __init__(self, device: torch.device | str):
        reason = flash_attn_unavailable_reason(device)
        if reason is not None:
            raise BackendUnavailableError(reason)
        flash_attn = importlib.import_module("flash_attn")
        self._varlen = flash_attn.flash_attn_varlen_func
        self._with_kvcache = flash_attn.flash_attn_with_kvcache

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata) -> torch.Tensor:
        """q (N, Nh, D) packed queries -> (N, Nh, D); see `TorchBackend.attention`.

        Raises:
            ValueError: for a block size that is not a multiple of 256 or a float32 cache.
        """
        if k_cache.shape[1] % FLASH_BLOCK_MULTIPLE:
            raise ValueError(f"flash_attn paged KV needs block_size % 256 == 0, got {k_cache.shape[1]}")
        if k_cache.dtype not in (torch.float16, torch.bfloat16) or q.dtype != k_cache.dtype:
            raise ValueError(f"flash_attn needs float16/bfloat16 q and cache, got {q.dtype}/{k_cache.dtype}")
        if meta.decode_only:
            out = self._with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.kv_lens_t,
                                     block_table=meta.block_tables, softmax_scale=meta.scale, causal=True)
            return out.squeeze(1)
        cu_k = torch.zeros(len(meta.kv_lens) + 1, dtype=torch.int32, device=q.device)
        cu_k[1:] = torch.cumsum(meta.kv_lens_t, 0)
        # causal with fewer queries than keys is aligned to the bottom-right (flash-attn >= 2.1): query j of a
        # sequence sees keys [0, kv_len - q_len + j], as the torch reference.
        return self._varlen(q, k_cache, v_cache, cu_seqlens_q=meta.qo_indptr_t, cu_seqlens_k=cu_k,
                            max_seqlen_q=meta.max_q, max_seqlen_k=meta.max_kv, softmax_scale=meta.scale,
                            causal=True, block_table=meta.block_tables)


def select_backend(name: str | None = None, device: torch.device | str | None = None):
    """Pick the attention backend.

    Args:
        name: `torch`, `flash_attn` or `auto`; None reads `ASTR_BACKEND` (default `auto`).
        device: where attention runs.

    Returns:
        A backend instance (`TorchBackend` or `FlashAttnBackend`). For `auto` falling back to torch, the
        instance's `fallback_reason` names why flash-attn was not used.

    Raises:
        ValueError: for an unknown name.
        BackendUnavailableError: when `flash_attn` is requested explicitly and cannot run (one-line reason).
    """
    name = (name or os.environ.get("ASTR_BACKEND") or "auto").strip().lower()
    if name == "torch":
        return TorchBackend()
    if name == "flash_attn":
        return FlashAttnBackend(device)
    if name != "auto":
        raise ValueError(f"ASTR_BACKEND: expected torch, flash_attn or auto, got {name!r}")
    reason = flash_attn_unavailable_reason(device)
    if reason is None:
        return FlashAttnBackend(device)
    backend = TorchBackend()
    backend.fallback_reason = reason
    return backend
