"""astrai.kernels: paged attention (pure-torch reference; flash-attn backend on CUDA), rotary, KV workspace.

See `paged_attention` (layout, PagedAttention by Kwon et al. 2023), `backends` (`ASTR_BACKEND` selection) and
`workspace` (`InferenceWorkspace`) and `decode_cache` (`DenseDecodeCache`, the torch backend's CPU decode path).
"""

from .backends import (AttentionMetadata, BackendUnavailableError, FlashAttnBackend, TorchBackend,
                       flash_attn_unavailable_reason, select_backend)
from .decode_cache import DenseDecodeCache
from .paged_attention import apply_rotary, gather_kv, paged_decode_attention, paged_prefill_attention, write_kv
from .workspace import InferenceWorkspace

__all__ = ["AttentionMetadata", "BackendUnavailableError", "DenseDecodeCache", "FlashAttnBackend", "InferenceWorkspace",
           "TorchBackend",
           "apply_rotary", "flash_attn_unavailable_reason", "gather_kv", "paged_decode_attention",
           "paged_prefill_attention", "select_backend", "write_kv"]
