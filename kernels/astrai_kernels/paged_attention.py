"""Pure-torch reference paged attention over a block KV cache (the CPU path and the test oracle).

The idea is PagedAttention (Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving
with PagedAttention", the vLLM paper): keys/values live in fixed-size blocks of a preallocated pool and each
sequence addresses its blocks through a block table, so sequences grow without reallocation and share prefix
blocks. This module is an independent, readable implementation on top of
`torch.nn.functional.scaled_dot_product_attention`; nothing is copied from vLLM or flash-attn.

Layout (the flash-attn paged layout, so both backends share the cache):
    k_cache, v_cache: (num_blocks, block_size, Nkv, D)
    block_tables:     (B, max_blocks) int32/int64, block ids of each sequence in order (padding entries ignored)
    kv_lens:          (B,) int, tokens in the cache of each sequence INCLUDING the ones of this step
    qo_indptr:        (B + 1,) int, cumulative query offsets into the packed queries (N = qo_indptr[-1])
Query j of sequence b (0-based within its q_len = qo_indptr[b+1] - qo_indptr[b]) has absolute position
kv_lens[b] - q_len + j and attends causally to keys [0, kv_lens[b] - q_len + j]; with a sliding `window` W only to
the last W of them (keys p with p > position - W). An optional `softcap` c replaces each score s by c * tanh(s / c)
before the mask and softmax (Gemma 2's attention soft-capping).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["write_kv", "gather_kv", "paged_decode_attention", "paged_prefill_attention"]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
            softcap: float | None) -> torch.Tensor:
    """q (B, Nh, S, D), k/v (B, Nkv, K, D), mask bool broadcastable to (B, Nh, S, K) -> (B, Nh, S, D): SDPA, or
    with `softcap` the scores `softcap * tanh(scale * q k^T / softcap)` masked and normalised by a float32 softmax.
    (The models' `astrai.models.attention.dense_attention` computes the same; this reference keeps its own so that
    it stays independent of the model code it checks.)"""
    groups = q.shape[1] // k.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=groups > 1)
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.tanh(torch.matmul(q, k.transpose(-1, -2)) * scale / softcap) * softcap
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1, dtype=torch.float32)
    return torch.matmul(probs.to(q.dtype), v)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Store new keys/values in place: token i goes to flat slot `slot_mapping[i]` = block * block_size + offset.

    Args:
        k_cache, v_cache: (num_blocks, block_size, Nkv, D).
        slot_mapping: (N,) int64 flat slots.
        k, v: (N, Nkv, D).
    """
    nkv, d = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, nkv, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, nkv, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """Dense copy of each sequence's cached tokens: (B, Nkv, max_len, D) from `cache` (num_blocks, bs, Nkv, D).

    Only the first ceil(max_len / block_size) block-table columns are read; padding positions hold whatever the
    addressed block holds and must be masked by the caller. `out`, when given, is a flat buffer of at least
    B * ceil(max_len / bs) * bs * Nkv * D elements of cache's dtype that receives the copy (a reused buffer saves
    the page faults of a fresh multi-MB tensor per call); the result is then a view of it.
    """
    bs, nkv, d = cache.shape[1], cache.shape[2], cache.shape[3]
    cols = -(-max_len // bs)
    b = block_tables.shape[0]
    index = block_tables[:, :cols].reshape(-1).long()
    # index_select on the flat block ids: several times faster on CPU than advanced indexing with a 2-D index.
    if out is None:
        dense = cache.index_select(0, index)  # (B * cols, bs, Nkv, D)
    else:
        dense = torch.index_select(cache, 0, index, out=out[:index.numel() * bs * nkv * d].view(-1, bs, nkv, d))
    dense = dense.view(b, cols * bs, nkv, d)[:, :max_len]
    return dense.transpose(1, 2)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, kv_lens: torch.Tensor, scale: float,
                           max_kv_len: int | None = None, scratch=None, *, window: int | None = None,
                           softcap: float | None = None) -> torch.Tensor:
    """One query per sequence attending over all its cached keys (grouped-query attention supported).

    Args:
        q: (B, Nh, D); Nh must be a multiple of Nkv.
        k_cache, v_cache: (num_blocks, block_size, Nkv, D).
        block_tables: (B, max_blocks) int.
        kv_lens: (B,) int64, each >= 1 (the query's own key is already written).
        scale: softmax scale, usually D ** -0.5.
        max_kv_len: max(kv_lens) if the caller knows it (avoids a device sync).
        scratch: optional `InferenceWorkspace`; the gathered keys/values then go to its reused buffers.
        window: sliding window W (the query sees its last W keys) or None; softcap: score soft-cap or None.

    Returns:
        (B, Nh, D) in q's dtype.
    """
    if max_kv_len is None:
        max_kv_len = int(kv_lens.max())
    bufs = [None, None]
    if scratch is not None:
        numel = block_tables.shape[0] * -(-max_kv_len // k_cache.shape[1]) * k_cache[0].numel()
        bufs = [scratch.scratch("decode_k", numel, k_cache.dtype), scratch.scratch("decode_v", numel, v_cache.dtype)]
    k = gather_kv(k_cache, block_tables, max_kv_len, bufs[0]).to(q.dtype)
    v = gather_kv(v_cache, block_tables, max_kv_len, bufs[1]).to(q.dtype)
    keys = torch.arange(max_kv_len, device=q.device)
    lens = kv_lens[:, None].to(q.device)
    mask = keys[None, :] < lens
    if window is not None:
        mask = mask & (keys[None, :] >= lens - window)
    out = _attend(q.unsqueeze(2), k, v, mask[:, None, None, :], scale, softcap)
    return out.squeeze(2)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, qo_indptr: list[int], kv_lens: list[int],
                            scale: float, *, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Ragged causal attention: the packed queries of B sequences, each over its own cached blocks.

    Sequences with one query (decode rows mixed into a prefill step) go through `paged_decode_attention` in one
    batch; each longer one is one SDPA call with a causal mask aligned to the end of its keys.

    Args:
        q: (N, Nh, D) packed queries, N = qo_indptr[-1].
        k_cache, v_cache: (num_blocks, block_size, Nkv, D), already holding this step's keys/values.
        block_tables: (B, max_blocks) int.
        qo_indptr: B + 1 cumulative query offsets (Python ints: the layout is host metadata).
        kv_lens: B cached lengths including this step's tokens (Python ints), kv_lens[b] >= q_len[b].
        scale: softmax scale.
        window, softcap: as `paged_decode_attention`.

    Returns:
        (N, Nh, D) in q's dtype.

    Raises:
        ValueError: when a sequence has more queries than cached keys.
    """
    out = torch.empty_like(q)
    single = [b for b in range(len(kv_lens)) if qo_indptr[b + 1] - qo_indptr[b] == 1]
    if single:
        rows = torch.tensor([qo_indptr[b] for b in single], device=q.device)
        lens = torch.tensor([kv_lens[b] for b in single], device=q.device)
        out[rows] = paged_decode_attention(q[rows], k_cache, v_cache, block_tables[single], lens, scale,
                                           max(kv_lens[b] for b in single), window=window, softcap=softcap)
    for b in range(len(kv_lens)):
        start, end, kv_len = qo_indptr[b], qo_indptr[b + 1], kv_lens[b]
        n = end - start
        if n <= 1:
            continue
        if n > kv_len:
            raise ValueError(f"sequence {b}: {n} queries but only {kv_len} cached keys")
        k = gather_kv(k_cache, block_tables[b:b + 1], kv_len).to(q.dtype)
        v = gather_kv(v_cache, block_tables[b:b + 1], kv_len).to(q.dtype)
        q_pos = torch.arange(kv_len - n, kv_len, device=q.device)[:, None]
        k_pos = torch.arange(kv_len, device=q.device)[None, :]
        mask = k_pos <= q_pos  # (n, K)
        if window is not None:
            mask = mask & (k_pos > q_pos - window)
        o = _attend(q[start:end].transpose(0, 1).unsqueeze(0), k, v, mask, scale, softcap)
        out[start:end] = o.squeeze(0).transpose(0, 1)
    return out
