"""InferenceWorkspace: the preallocated paged KV storage of the rollout engine (plus reusable scratch buffers).

One pool of fixed-size blocks per layer (PagedAttention, Kwon et al. 2023): `k_caches[l], v_caches[l]` of shape
(num_blocks, block_size, Nkv, D). Blocks are handed out by the engine's block pool; the workspace only owns the
memory, so `release()` (engine sleep) frees it and `allocate()` (wake) takes it back.
"""

from __future__ import annotations

import torch

__all__ = ["InferenceWorkspace"]


class InferenceWorkspace:
    """Preallocated per-layer KV block storage and named scratch buffers.

    Args:
        num_layers: L.
        num_blocks: blocks per layer (> 0).
        block_size: tokens per block (> 0; the flash-attn backend needs a multiple of 256).
        num_kv_heads: Nkv.
        head_dim: D.
        dtype: storage dtype (float32 on CPU; the flash-attn backend needs float16/bfloat16).
        device: where the storage lives.

    Raises:
        ValueError: for non-positive sizes.
    """

    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        if min(num_layers, num_blocks, block_size, num_kv_heads, head_dim) <= 0:
            raise ValueError("InferenceWorkspace: every size must be > 0, got "
                             f"L={num_layers} blocks={num_blocks} block_size={block_size} "
                             f"Nkv={num_kv_heads} D={head_dim}")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.k_caches: list[torch.Tensor] = []
        self.v_caches: list[torch.Tensor] = []
        self._scratch: dict[str, torch.Tensor] = {}
        self.allocate()

    @classmethod
    def for_model(cls, config, *, num_blocks: int, block_size: int, dtype: torch.dtype,
                  device: torch.device | str) -> "InferenceWorkspace":
        """Workspace shaped for an `astrai.models.ModelConfig` (L, Nkv, D taken from it)."""
        return cls(num_layers=config.num_hidden_layers, num_blocks=num_blocks, block_size=block_size,
                   num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim, dtype=dtype, device=device)

    @property
    def allocated(self) -> bool:
        """True while the KV storage is held."""
        return bool(self.k_caches)

    @property
    def nbytes(self) -> int:
        """Bytes of KV storage held now (0 after `release`)."""
        return sum(t.numel() * t.element_size() for t in self.k_caches + self.v_caches)

    def allocate(self) -> None:
        """(Re)allocate zeroed KV storage; a no-op while allocated."""
        if self.allocated:
            return
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.k_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.v_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]

    def release(self) -> None:
        """Free the KV storage and the scratch buffers (contents are lost)."""
        self.k_caches, self.v_caches, self._scratch = [], [], {}
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block `src` into block `dst` in every layer (copy-on-write of a shared partial block)."""
        for k, v in zip(self.k_caches, self.v_caches):
            k[dst].copy_(k[src])
            v[dst].copy_(v[src])

    def scratch(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A reusable 1-D buffer of at least `numel` elements (returned as a view of exactly `numel`)."""
        buf = self._scratch.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = torch.empty(max(numel, 1), dtype=dtype, device=self.device)
            self._scratch[name] = buf
        return buf[:numel]
