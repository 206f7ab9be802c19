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

Per-layer options reach every implementation as one `LayerAttention` per layer (`layer_attention(config)`): the
softmax scale, the sliding window (a query at position i sees keys at positions j with i - W < j <= i, as
transformers' `sliding_window_overlay`) and the tanh soft-cap of the scores (Gemma 2: `c * tanh(s / c)` before the
mask and softmax). Without them (`layers=None`) an implementation attends causally at scale 1/sqrt(D).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import torch
import torch.nn.functional as F

from .cache import KVCache
from .config import ModelConfig

__all__ = ["AttentionInterface", "LayerAttention", "MaskedAttention", "SegmentedCausalAttention", "dense_attention",
           "layer_attention"]


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None, scale: float,
                    softcap: float | None = None, is_causal: bool = False) -> torch.Tensor:
    """Softmax attention of dense tensors: q (B, Nh, S, D), k/v (B, Nkv, K, D) with Nh a multiple of Nkv (query
    head h reads kv head h // (Nh / Nkv)), `mask` bool broadcastable to (B, Nh, S, K) (True = may attend) or None,
    `is_causal` (only with mask None) -> (B, Nh, S, D) in q's dtype.

    Without `softcap` this is `scaled_dot_product_attention`. With it, the scores `scale * q k^T` are computed in
    q's dtype, capped as `softcap * tanh(scores / softcap)`, masked, and normalised by a float32 softmax (as
    transformers' eager Gemma 2 attention).
    """
    groups = q.shape[1] // k.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=groups > 1)
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(k.shape[2] - q.shape[2])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


@dataclass(frozen=True)
class LayerAttention:
    """How one layer attends: softmax `scale`, sliding `window` W in keys (None: full causal) and the score
    soft-cap `softcap` c (None: none)."""

    scale: float
    window: Optional[int] = None
    softcap: Optional[float] = None


def layer_attention(config: ModelConfig) -> tuple[LayerAttention, ...]:
    """One `LayerAttention` per decoder layer of `config` (scale `config.attention_scale`, the layer's window,
    `attn_logit_softcapping`)."""
    return tuple(LayerAttention(config.attention_scale, config.layer_window(i), config.attn_logit_softcapping)
                 for i in range(config.num_hidden_layers))


def window_band(num_queries: int, num_keys: int, window: int, device: torch.device) -> torch.Tensor:
    """(S, K) bool: query i (absolute position K - S + i) may see key j when j > K - S + i - window."""
    q_pos = torch.arange(num_keys - num_queries, num_keys, device=device).unsqueeze(1)
    return torch.arange(num_keys, device=device).unsqueeze(0) > q_pos - window


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
        layers: optional per-layer `LayerAttention` (scale, window, soft-cap); a windowed layer's mask is `mask`
            (or causal) restricted to the window band, in cache positions (equal to token positions for the real
            tokens of a left- or right-padded row).
    """

    def __init__(self, mask: Optional[torch.Tensor], kv_cache: Optional[KVCache] = None, *,
                 layers: Optional[Sequence[LayerAttention]] = None):
        self.mask, self.kv_cache, self.layers = mask, kv_cache, layers
        self._windowed: dict[int, torch.Tensor] = {}

    def _mask_for(self, window: Optional[int], num_queries: int, num_keys: int, device) -> Optional[torch.Tensor]:
        """The layer's mask: `mask` itself without a window (or when no key can fall outside it)."""
        if window is None or num_keys <= window:
            return self.mask
        if window not in self._windowed:
            band = window_band(num_queries, num_keys, window, device)
            if self.mask is None:
                band = band & torch.ones(num_queries, num_keys, dtype=torch.bool, device=device).tril(
                    num_keys - num_queries)
            self._windowed[window] = band if self.mask is None else self.mask & band
        return self._windowed[window]

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
        if self.layers is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, is_causal=self.mask is None)
            return out.transpose(1, 2)
        spec = self.layers[layer_idx]
        mask = self._mask_for(spec.window, q.shape[2], k.shape[2], q.device)
        out = dense_attention(q, k, v, mask=mask, scale=spec.scale, softcap=spec.softcap, is_causal=mask is None)
        return out.transpose(1, 2)


class SegmentedCausalAttention:
    """Causal attention within each segment of packed rows: a row (B = 1) holds several sequences back to back, and
    a query sees only the keys of its own sequence up to itself (a block-diagonal causal mask), computed segment by
    segment with `scaled_dot_product_attention(is_causal=True)`, so no (S, S) mask is built and no score between two
    sequences is computed. Padding-free training and scoring use it (`Sequences.packed`).

    Args:
        seq_lengths: the segments' lengths in tokens, in order, each >= 1, summing to S (Python ints: the split
            points are needed on the host).
        layers: optional per-layer `LayerAttention`; a windowed layer masks each segment longer than its window
            with the causal window band.
    """

    def __init__(self, seq_lengths: Sequence[int], *, layers: Optional[Sequence[LayerAttention]] = None):
        self.seq_lengths = [int(n) for n in seq_lengths]
        self.layers = layers
        self._bands: dict[tuple[int, int], torch.Tensor] = {}

    def _segment(self, q, k, v, spec: Optional[LayerAttention]) -> torch.Tensor:
        """Causal (and windowed) attention of one segment (B, heads, n, D)."""
        if spec is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        n = q.shape[2]
        mask = None
        if spec.window is not None and n > spec.window:
            key = (n, spec.window)
            if key not in self._bands:
                self._bands[key] = window_band(n, n, spec.window, q.device) & torch.ones(
                    n, n, dtype=torch.bool, device=q.device).tril()
            mask = self._bands[key]
        return dense_attention(q, k, v, mask=mask, scale=spec.scale, softcap=spec.softcap, is_causal=mask is None)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """See `AttentionInterface.__call__` (no cache: the keys and values are this forward's)."""
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, S, D)
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        spec = self.layers[layer_idx] if self.layers is not None else None
        if len(self.seq_lengths) == 1:
            out = self._segment(q, k, v, spec)
        else:
            out = torch.cat([self._segment(qs, ks, vs, spec) for qs, ks, vs in
                             zip(q.split(self.seq_lengths, dim=2), k.split(self.seq_lengths, dim=2),
                                 v.split(self.seq_lengths, dim=2))], dim=2)
        return out.transpose(1, 2)
