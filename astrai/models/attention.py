"""The attention seam of the decoder: where keys/values are stored and how queries read them.

Every decoder layer computes its projections and rotary embedding itself and then calls one
`AttentionInterface` object with the layer's rotated queries, keys and values. The object decides where the new
keys/values go and which keys each query sees, so the same module code serves

- training and scoring (`MaskedAttention` without a cache: causal self-attention over the batch, with a padding
  mask),
- incremental decoding with a contiguous cache (`MaskedAttention` over a `KVCache`: the test oracle's engine),
- padding-free training and scoring (`SegmentedCausalAttention`: several sequences packed into one row, each
  attending causally within itself),
- the rollout engine (`astrai.rollout.model_runner.PagedAttention`: a packed ragged batch against the paged KV
  cache, through the kernels of `astrai.kernels`).
"""

from __future__ import annotations

from typing import Optional, Protocol, Sequence

import torch
import torch.nn.functional as F

from .cache import KVCache

__all__ = ["AttentionInterface", "MaskedAttention", "SegmentedCausalAttention"]


class AttentionInterface(Protocol):
    """Attention of one model forward, called once per decoder layer."""

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store this forward's keys/values of layer `layer_idx` and attend.

        Args:
            q: (B, S, Nh, D) rotated queries.
            k, v: (B, S, Nkv, D) rotated keys and values (grouped-query: Nh is a multiple of Nkv).

        Returns:
            (B, S, Nh, D) attention output in q's dtype (query head h reads kv head h // (Nh / Nkv)).
        """


class MaskedAttention:
    """Softmax attention (`scaled_dot_product_attention`, scale 1/sqrt(D)) under one boolean mask.

    Args:
        mask: (B or 1, 1, S, K) bool, True = may attend (`layers.build_attention_mask`), or None for plain causal
            attention over the S new tokens (K = S; with a cache only when it is empty).
        kv_cache: optional contiguous `KVCache`: the new keys/values are written at `[length, length + S)` and the
            queries attend over `[0, length + S)` (the caller advances `length` once after all layers).
    """

    def __init__(self, mask: Optional[torch.Tensor], kv_cache: Optional[KVCache] = None):
        self.mask, self.kv_cache = mask, kv_cache

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """See `AttentionInterface.__call__`."""
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, S, D)
        if self.kv_cache is not None:
            k, v = self.kv_cache.update(layer_idx, k, v)
            k, v = k.to(q.dtype), v.to(q.dtype)
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)  # (B, Nh, K, D); head h uses kv head h // groups
            v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, is_causal=self.mask is None)
        return out.transpose(1, 2)


class SegmentedCausalAttention:
    """Causal attention within each segment of packed rows: a row (B = 1) holds several sequences back to back, and
    a query sees only the keys of its own sequence up to itself (a block-diagonal causal mask), computed segment by
    segment with `scaled_dot_product_attention(is_causal=True)`, so no (S, S) mask is built and no score between two
    sequences is computed. Padding-free training and scoring use it (`Sequences.packed`).

    Args:
        seq_lengths: the segments' lengths in tokens, in order, each >= 1, summing to S (Python ints: the split
            points are needed on the host).
    """

    def __init__(self, seq_lengths: Sequence[int]):
        self.seq_lengths = [int(n) for n in seq_lengths]

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """See `AttentionInterface.__call__` (no cache: the keys and values are this forward's)."""
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, S, D)
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        if len(self.seq_lengths) == 1:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = torch.cat([F.scaled_dot_product_attention(qs, ks, vs, is_causal=True) for qs, ks, vs in
                             zip(q.split(self.seq_lengths, dim=2), k.split(self.seq_lengths, dim=2),
                                 v.split(self.seq_lengths, dim=2))], dim=2)
        return out.transpose(1, 2)
