"""Paged attention kernels (torch reference) equal plain SDPA attention on random ragged inputs; backend selection."""

import pytest
import torch
import torch.nn.functional as F

from astrai.kernels import (AttentionMetadata, BackendUnavailableError, InferenceWorkspace, TorchBackend,
                            paged_decode_attention, paged_prefill_attention, select_backend, write_kv)


def _scatter_sequences(kv_lens, block_size, nkv, d, gen):
    """Random dense K/V per sequence, written into shuffled blocks of a paged cache."""
    need = [-(-n // block_size) for n in kv_lens]
    num_blocks = sum(need) + 3
    k_cache = torch.randn(num_blocks, block_size, nkv, d, generator=gen)  # garbage everywhere else
    v_cache = torch.randn(num_blocks, block_size, nkv, d, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(kv_lens), max(need), dtype=torch.int32)
    dense = []
    for b, n in enumerate(kv_lens):
        blocks = [order.pop() for _ in range(need[b])]
        tables[b, :need[b]] = torch.tensor(blocks)
        k, v = torch.randn(n, nkv, d, generator=gen), torch.randn(n, nkv, d, generator=gen)
        slots = torch.tensor([blocks[i // block_size] * block_size + i % block_size for i in range(n)])
        write_kv(k_cache, v_cache, slots, k, v)
        dense.append((k, v))
    return k_cache, v_cache, tables, dense


def _reference(q, k, v, scale):
    """Plain attention of q (n, Nh, D) over k/v (K, Nkv, D), causal aligned to the end of the keys."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    n, kl = q.shape[0], k.shape[0]
    mask = torch.arange(kl)[None, :] <= torch.arange(kl - n, kl)[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("nh,nkv", [(4, 4), (6, 2), (9, 3)])
def test_prefill_matches_plain_attention(block_size, nh, nkv):
    gen = torch.Generator().manual_seed(block_size * 100 + nh)
    d, kv_lens = 16, [7, 1, 33, 16, 5]
    q_lens = [7, 1, 10, 1, 3]  # full prefill, decode row, chunked prefill after a cached prefix, ...
    k_cache, v_cache, tables, dense = _scatter_sequences(kv_lens, block_size, nkv, d, gen)
    indptr = [0]
    for n in q_lens:
        indptr.append(indptr[-1] + n)
    q = torch.randn(indptr[-1], nh, d, generator=gen)
    scale = d ** -0.5
    out = paged_prefill_attention(q, k_cache, v_cache, tables, indptr, kv_lens, scale)
    for b, (k, v) in enumerate(dense):
        expected = _reference(q[indptr[b]:indptr[b + 1]], k, v, scale)
        torch.testing.assert_close(out[indptr[b]:indptr[b + 1]], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [2, 8, 32])
def test_decode_matches_plain_attention_gqa(block_size):
    gen = torch.Generator().manual_seed(block_size)
    nh, nkv, d, kv_lens = 8, 2, 32, [1, 9, 40, 17]
    k_cache, v_cache, tables, dense = _scatter_sequences(kv_lens, block_size, nkv, d, gen)
    q = torch.randn(len(kv_lens), nh, d, generator=gen)
    out = paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(kv_lens), d ** -0.5)
    for b, (k, v) in enumerate(dense):
        torch.testing.assert_close(out[b:b + 1], _reference(q[b:b + 1], k, v, d ** -0.5), atol=1e-5, rtol=1e-5)
    meta = AttentionMetadata(qo_indptr=list(range(len(kv_lens) + 1)), kv_lens=kv_lens,
                             qo_indptr_t=torch.arange(len(kv_lens) + 1, dtype=torch.int32),
                             kv_lens_t=torch.tensor(kv_lens, dtype=torch.int32), block_tables=tables,
                             max_q=1, max_kv=max(kv_lens), scale=d ** -0.5)
    assert meta.decode_only
    torch.testing.assert_close(TorchBackend().attention(q, k_cache, v_cache, meta), out)


def test_prefill_rejects_more_queries_than_keys():
    cache = torch.zeros(2, 4, 1, 8)
    with pytest.raises(ValueError, match="queries"):
        paged_prefill_attention(torch.zeros(5, 1, 8), cache, cache, torch.zeros(1, 1, dtype=torch.int32),
                                [0, 5], [3], 1.0)


def test_workspace_release_and_allocate():
    ws = InferenceWorkspace(num_layers=2, num_blocks=3, block_size=4, num_kv_heads=1, head_dim=2)
    assert ws.allocated and ws.nbytes == 2 * 2 * 3 * 4 * 2 * 4
    ws.k_caches[0][1].fill_(1.0)
    ws.copy_block(1, 2)
    assert bool((ws.k_caches[0][2] == 1).all())
    ws.release()
    assert not ws.allocated and ws.nbytes == 0
    ws.allocate()
    assert ws.k_caches[0].shape == (3, 4, 1, 2)
    with pytest.raises(ValueError):
        InferenceWorkspace(num_layers=1, num_blocks=0, block_size=4, num_kv_heads=1, head_dim=2)


def test_backend_selection(monkeypatch):
    monkeypatch.setenv("ASTR_BACKEND", "torch")
    assert select_backend(device="cpu").name == "torch"
    monkeypatch.setenv("ASTR_BACKEND", "auto")
    backend = select_backend(device="cpu")
    assert backend.name == "torch" and "CUDA" in backend.fallback_reason
    monkeypatch.setenv("ASTR_BACKEND", "flash_attn")
    with pytest.raises(BackendUnavailableError) as info:
        select_backend(device="cpu")
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="ASTR_BACKEND"):
        select_backend("cudnn", device="cpu")


def test_dense_decode_cache_matches_paged_decode_over_steps():
    """Appending steps, a row leaving, capacity overflows and NaN-filled fresh buffers: every step's attention equals
    the paged reference; rebuilds happen exactly on membership changes and overflows."""
    from astrai.kernels import DenseDecodeCache

    gen = torch.Generator().manual_seed(0)
    bs, nkv, nh, d, layers = 4, 2, 6, 8, 2
    ws = InferenceWorkspace(num_layers=layers, num_blocks=40, block_size=bs, num_kv_heads=nkv, head_dim=d)
    lengths = {10: 5, 11: 9, 12: 3}  # seq id -> cached tokens
    tables = {sid: list(range(6 * i, 6 * i + 6)) for i, sid in enumerate(lengths)}

    def write(sid, start, n):
        slots = torch.tensor([tables[sid][p // bs] * bs + p % bs for p in range(start, start + n)])
        for layer in range(layers):
            write_kv(ws.k_caches[layer], ws.v_caches[layer], slots, torch.randn(n, nkv, d, generator=gen),
                     torch.randn(n, nkv, d, generator=gen))

    for sid, n in lengths.items():
        write(sid, 0, n)
    ws.scratch("dense_k0", 4096, torch.float32).fill_(float("nan"))  # stale buffer contents must not leak
    cache = DenseDecodeCache(ws, headroom=2)
    live, rebuilds = [10, 11, 12], []
    for step in range(10):
        if step == 3:
            live = [10, 12]  # row 11 stopped
        for sid in live:
            lengths[sid] += 1
        kv_lens = [lengths[s] for s in live]
        block_tables = torch.tensor([tables[s] for s in live], dtype=torch.int32)
        assert cache.begin_step(live, kv_lens, block_tables, d ** -0.5)
        for layer in range(layers):
            k, v = torch.randn(len(live), nkv, d, generator=gen), torch.randn(len(live), nkv, d, generator=gen)
            slots = torch.tensor([tables[s][(lengths[s] - 1) // bs] * bs + (lengths[s] - 1) % bs for s in live])
            write_kv(ws.k_caches[layer], ws.v_caches[layer], slots, k, v)
            cache.append(layer, k, v)
            q = torch.randn(len(live), nh, d, generator=gen)
            expected = paged_decode_attention(q, ws.k_caches[layer], ws.v_caches[layer], block_tables,
                                              torch.tensor(kv_lens), d ** -0.5)
            torch.testing.assert_close(cache.attention(layer, q), expected, atol=1e-6, rtol=1e-5)
        rebuilds.append(cache.rebuilds)
    # step 0 builds (longest 10 + headroom 2 -> capacity 12); seq 11 leaving at step 3 rebuilds (capacity 12 again)
    assert rebuilds[0] == 1 and rebuilds[3] == rebuilds[2] + 1
    assert rebuilds[5] == rebuilds[3]  # plain appends in between
    assert rebuilds[-1] > rebuilds[5]  # seq 10 reaches 13 > 12 tokens at step 7: outgrown, rebuilt
    assert not DenseDecodeCache(ws, max_bytes=1).begin_step(live, kv_lens, block_tables, 1.0)
