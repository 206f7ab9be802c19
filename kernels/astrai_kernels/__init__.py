"""astrai.kernels: paged attention (pure-torch reference, Triton kernels and a flash-attn backend on CUDA), the
KV workspace.

See `paged_attention` (layout, PagedAttention by Kwon et al. 2023), `triton_attention` (the Triton kernels,
imported only when that backend is chosen), `backends` (`ASTR_BACKEND` selection), `workspace`
(`InferenceWorkspace`), `decode_cache` (`DenseDecodeCache`, the torch backend's CPU decode path), `cpu_kernels`
(its compiled attention, built at first use) and `parity` (a backend-vs-reference check). docs/kernels.md
describes the layouts and the backend choice.
"""

from . import cpu_kernels
from .backends import (BACKEND_NAMES, AttentionMetadata, BackendUnavailableError, FlashAttnBackend, TorchBackend,
                       TritonBackend, flash_attn_unavailable_reason, select_backend, triton_unavailable_reason)
from .decode_cache import DenseDecodeCache
from .paged_attention import gather_kv, paged_decode_attention, paged_prefill_attention, write_kv
from .workspace import InferenceWorkspace

__all__ = ["BACKEND_NAMES", "AttentionMetadata", "BackendUnavailableError", "DenseDecodeCache", "FlashAttnBackend",
           "cpu_kernels",
           "InferenceWorkspace", "TorchBackend", "TritonBackend",
           "flash_attn_unavailable_reason", "gather_kv", "paged_decode_attention",
           "paged_prefill_attention", "select_backend", "triton_unavailable_reason", "write_kv"]
