"""Prepacked oneDNN weights of the CPU engine (`astrai.rollout.packed_linear`: bfloat16, and float32 off Intel CPUs)
and the half-precision layout of the dense decode cache: same results as the plain paths, and weight updates reach
the packed copies."""

import pytest
import torch
import torch.nn.functional as F

import astrai.rollout.packed_linear as packed_linear
import astrai.rollout.paged_engine as paged_engine
from astrai.kernels import DenseDecodeCache, InferenceWorkspace, paged_decode_attention, write_kv
from astrai.models import AutoRegressiveLM, tiny_config
from astrai.rollout.packed_linear import PackedLinear, PrepackedWeights, prepack_available, prepack_linears
from astrai.rollout.sampling import SamplingParams

VOCAB, EOS = 32, 2
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]
HAS_BF16 = prepack_available(torch.device("cpu"), torch.bfloat16)
HAS_ONEDNN = hasattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise") and torch.backends.mkldnn.is_available()


@pytest.fixture(params=["bfloat16", "float32"])
def dtype(request, monkeypatch):
    """Each dtype the engine prepacks in; float32 as on a CPU that is not Intel's (the vendor rule forced)."""
    if request.param == "bfloat16" and not HAS_BF16:
        pytest.skip("no oneDNN bf16 support on this CPU")
    if not HAS_ONEDNN:
        pytest.skip("no oneDNN linear ops in this torch build")
    monkeypatch.setattr(packed_linear, "cpu_vendor", lambda: "AuthenticAMD")
    return getattr(torch, request.param)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return AutoRegressiveLM(tiny_config(vocab_size=VOCAB, eos_token_id=EOS, pad_token_id=EOS)).eval()


def engine_for(model, **kw):
    return paged_engine.PagedGenerationEngine(model, pad_token_id=EOS, backend="torch", block_size=4, **kw)


def rows(gen):
    return [gen.response_ids[r][gen.action_mask[r]].tolist() for r in range(gen.response_ids.shape[0])]


def test_where_weights_are_prepacked(model, monkeypatch):
    """bfloat16 where oneDNN supports it; float32 only off Intel CPUs (MKL keeps Intel's: the fp32 engine's numbers
    there are untouched); never off the CPU or in other dtypes."""
    assert not prepack_available(torch.device("meta"), torch.bfloat16)
    assert not prepack_available(torch.device("cpu"), torch.float16)
    for vendor, expected in (("GenuineIntel", False), ("", False), ("AuthenticAMD", HAS_ONEDNN)):
        monkeypatch.setattr(packed_linear, "cpu_vendor", lambda vendor=vendor: vendor)
        assert prepack_available(torch.device("cpu"), torch.float32) is expected, vendor
    monkeypatch.setattr(packed_linear, "cpu_vendor", lambda: "GenuineIntel")
    assert engine_for(model).prepacked is None


def test_cpu_vendor_reads_proc_cpuinfo():
    vendor = packed_linear.cpu_vendor()
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        text = ""
    assert vendor == "" if "vendor_id" not in text else vendor in text


@pytest.mark.parametrize("rows_", [1, 3, 32, 70])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_equals_f_linear(dtype, rows_, with_bias):
    gen = torch.Generator().manual_seed(rows_)
    weight = torch.randn(48, 40, generator=gen).to(dtype)
    bias = torch.randn(48, generator=gen).to(dtype) if with_bias else None
    x = torch.randn(2, rows_, 40, generator=gen).to(dtype)
    packs = PrepackedWeights()
    packs.add(weight)
    out = packs.linear(x, weight, bias)
    assert out.dtype == dtype and out.shape == (2, rows_, 48)
    # bf16: bitwise equal on AMX machines; float32: oneDNN rounds unlike MKL (about 1e-6 relative)
    torch.testing.assert_close(out, F.linear(x, weight, bias))
    other = torch.randn(48, 40, generator=gen).to(dtype)  # not registered: plain F.linear
    assert torch.equal(packs.linear(x, other, bias), F.linear(x, other, bias))


def test_in_place_update_reaches_the_packed_copy(dtype):
    """A weight changed in place (also through a view, as `copy_weights` writes the fused q/k/v rows) is repacked
    before its next use; `refresh` repacks exactly the stale ones."""
    gen = torch.Generator().manual_seed(0)
    fused = torch.randn(24, 16, generator=gen).to(dtype)
    x = torch.randn(5, 16, generator=gen).to(dtype)
    packs = PrepackedWeights()
    packs.add(fused)
    before = packs.linear(x, fused)
    with torch.no_grad():
        fused[8:16].copy_(torch.full((8, 16), 0.5))  # a row block, as a Parameter view of the fused tensor
    after = packs.linear(x, fused)
    torch.testing.assert_close(after, F.linear(x, fused))
    assert not torch.equal(after[:, 8:16], before[:, 8:16]) and packs.repacks == 2
    fused.mul_(2)
    assert packs.refresh() == 1 and packs.refresh() == 0 and packs.repacks == 3
    torch.testing.assert_close(packs.linear(x, fused), F.linear(x, fused))


def test_prepack_linears_keeps_parameters_and_forward(model, dtype):
    """Same parameter names and objects (ties kept), same logits as the unpacked copy."""
    from astrai.rollout.model_runner import fuse_projections

    plain = engine_for(model, dtype=dtype, prefix_cache=False)
    assert plain.prepacked is not None
    packed_model = plain.model
    reference = AutoRegressiveLM(model.config).eval()
    reference.load_state_dict(model.state_dict())
    reference.to(dtype)
    fuse_projections(reference)
    assert list(dict(packed_model.named_parameters())) == list(dict(reference.named_parameters()))
    layer = packed_model.model.layers[0]
    assert isinstance(layer.self_attn.o_proj, PackedLinear) and isinstance(layer.mlp.down_proj, PackedLinear)
    assert isinstance(packed_model.lm_head, PackedLinear)
    if model.config.tie_word_embeddings:
        assert packed_model.lm_head.weight is packed_model.model.embed_tokens.weight
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        torch.testing.assert_close(packed_model(ids), reference(ids))
    assert len(prepack_linears(reference)) == 4 * model.config.num_hidden_layers + 1


def test_engine_with_prepacked_weights_samples_the_same(model, dtype, monkeypatch):
    """Same tokens as the plain engine; log-probs bitwise in bf16 (AMX), to oneDNN's float32 rounding in float32."""
    params = SamplingParams(max_new_tokens=10, temperature=1.0, stop_token_ids=(EOS,))
    packed = engine_for(model, dtype=dtype)
    monkeypatch.setattr(paged_engine, "prepack_available", lambda *args: False)
    plain = engine_for(model, dtype=dtype)
    assert packed.prepacked is not None and plain.prepacked is None
    a = packed.generate(PROMPTS, params, torch.Generator().manual_seed(4), n=2)
    b = plain.generate(PROMPTS, params, torch.Generator().manual_seed(4), n=2)
    assert rows(a) == rows(b)
    torch.testing.assert_close(a.old_logprobs, b.old_logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("stream", [False, True])
def test_weight_sync_reaches_the_prepacked_copy(model, dtype, stream):
    """After `load_weights` the packed engine samples what a fresh engine built from the new weights samples (a
    stale packed copy would keep the old policy's tokens)."""
    params = SamplingParams(max_new_tokens=10, temperature=1.0, stop_token_ids=(EOS,))
    engine = engine_for(model, dtype=dtype)
    old = engine.generate(PROMPTS, params, torch.Generator().manual_seed(2))
    trained = AutoRegressiveLM(model.config).eval()
    trained.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    state = trained.state_dict()
    engine.load_weights(iter(state.items()) if stream else state, policy_version=1)
    assert engine.prepacked.refresh() == 0  # load_weights repacked them all already
    new = engine.generate(PROMPTS, params, torch.Generator().manual_seed(2))
    fresh = engine_for(trained, dtype=dtype).generate(PROMPTS, params, torch.Generator().manual_seed(2))
    assert rows(new) == rows(fresh) and rows(new) != rows(old)
    torch.testing.assert_close(new.old_logprobs, fresh.old_logprobs, atol=1e-6, rtol=0)


@pytest.mark.parametrize("copies", ["kernel", "float32", "bfloat16"])
@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 3.0)])
def test_bf16_dense_decode_cache_matches_paged_decode(window, softcap, copies, monkeypatch):
    """A bfloat16 cache on CPU: with the compiled kernel the dense copies stay bfloat16 (keys transposed) and each
    step equals the float32 paged reference over the same values; without it they are float32 (keys transposed,
    the matmul path), again equal to the float32 reference. Half-precision copies without the kernel (the layout
    of other devices, forced here) keep keys untransposed (what SDPA reads); appends, windows and the float32
    soft-cap path read them right: each step equals the paged reference (bfloat16; float32 for the soft-cap
    path)."""
    from astrai.kernels import cpu_kernels

    if copies == "kernel" and not cpu_kernels.supports(torch.bfloat16):
        pytest.skip(f"no CPU attention kernel here: {cpu_kernels.unavailable_reason()}")
    if copies != "kernel":
        monkeypatch.setattr(cpu_kernels, "supports", lambda dtype: False)
    gen = torch.Generator().manual_seed(1)
    bs, nkv, nh, d = 4, 2, 6, 8
    ws = InferenceWorkspace(num_layers=1, num_blocks=20, block_size=bs, num_kv_heads=nkv, head_dim=d,
                            dtype=torch.bfloat16)
    lengths = {0: 5, 1: 9}
    tables = {sid: list(range(8 * sid, 8 * sid + 8)) for sid in lengths}

    def slots(sid, positions):
        return torch.tensor([tables[sid][p // bs] * bs + p % bs for p in positions])

    for sid, n in lengths.items():
        write_kv(ws.k_caches[0], ws.v_caches[0], slots(sid, range(n)), torch.randn(n, nkv, d, generator=gen),
                 torch.randn(n, nkv, d, generator=gen))
    cache = DenseDecodeCache(ws, headroom=2)
    assert cache.keys_transposed and cache.kernel == (copies == "kernel")
    assert cache.dtype == (torch.bfloat16 if copies == "kernel" else torch.float32)  # on CPU
    if copies == "bfloat16":
        cache.dtype, cache.keys_transposed = torch.bfloat16, False
    live = [0, 1]
    block_tables = torch.tensor([tables[s] for s in live], dtype=torch.int32)
    for _ in range(5):
        for sid in live:
            lengths[sid] += 1
        kv_lens = [lengths[s] for s in live]
        assert cache.begin_step(live, kv_lens, block_tables, d ** -0.5)
        k = torch.randn(2, nkv, d, generator=gen).bfloat16()
        v = torch.randn(2, nkv, d, generator=gen).bfloat16()
        write_kv(ws.k_caches[0], ws.v_caches[0], torch.cat([slots(s, [lengths[s] - 1]) for s in live]), k, v)
        cache.append(0, k, v)
        q = torch.randn(2, nh, d, generator=gen).bfloat16()
        # with a soft-cap the dense path computes in float32 (as before): its reference is the float32 one
        compute = torch.float32 if softcap is not None or copies != "bfloat16" else torch.bfloat16
        expected = paged_decode_attention(q.to(compute), ws.k_caches[0].to(compute), ws.v_caches[0].to(compute),
                                          block_tables, torch.tensor(kv_lens), d ** -0.5, window=window,
                                          softcap=softcap).bfloat16()
        torch.testing.assert_close(cache.attention(0, q, window=window, softcap=softcap), expected)
    assert cache.rebuilds == 2  # built once, then outgrown (capacity 12) at the 4th step


@pytest.mark.parametrize("supported", [False, True])
def test_half_precision_engine_warns_on_a_cpu_that_emulates_it(model, monkeypatch, supported):
    """bf16 without AVX-512 BF16 / AMX is emulated (30x slower than float32 on an AVX2 machine): the engine says so
    in one line, naming the fix; nothing for float32, other devices, or a CPU with support."""
    import warnings

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: supported)
    monkeypatch.setattr(paged_engine, "prepack_available", lambda *args: False)  # not this test's subject
    line = packed_linear.slow_half_precision(torch.device("cpu"), torch.bfloat16)
    assert packed_linear.slow_half_precision(torch.device("cpu"), torch.float32) is None
    assert packed_linear.slow_half_precision(torch.device("meta"), torch.bfloat16) is None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine_for(model, dtype="bfloat16", prefix_cache=False)
    said = [str(w.message) for w in caught if "no native bfloat16" in str(w.message)]
    if supported:
        assert line is None and not said
    else:
        assert "\n" not in line and "rollout.dtype" in line and "float32" in line and said == [line]
