"""The compiled elementwise pieces of the engine's CPU forward (`cpu_elementwise.c` through `astrai.kernels.
cpu_kernels`; installed by `astrai.rollout.cpu_ops.use_cpu_kernels`): each against float64 loops and against the torch
ops it replaces, independent of the thread count, the fused KV store bit for bit against `write_kv` + `append`, and
the engine with and without them on every model family."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from family_models import astrai_twin, hf_model

from astrai.kernels import DenseDecodeCache, InferenceWorkspace, cpu_kernels, write_kv
from astrai.models.layers import MLP, Attention, RMSNorm, apply_rotary

needs_kernel = pytest.mark.skipif(not cpu_kernels.supports(torch.float32),
                                  reason=f"no CPU kernels here: {cpu_kernels.unavailable_reason()}")
pytestmark = needs_kernel

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ULP = {torch.float32: 2 ** -23, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}


def close_in_ulps(got: torch.Tensor, expected: torch.Tensor, ulps: float, scale=0.0) -> None:
    """|got - expected| <= ulps units in the last place of `got`'s dtype, relative to |expected| + `scale` (among
    the subnormals: that many of the dtype's smallest steps)."""
    bound = ulps * ULP[got.dtype] * (expected.double().abs() + scale + torch.finfo(got.dtype).smallest_normal)
    excess = (got.double() - expected.double()).abs() - bound
    assert excess.max().item() <= 0, f"off by more than {ulps} ulp: max excess {excess.max().item():.3g}"


def naive_rmsnorm(x, w, eps, unit_offset):
    """float64 loops: w * x / sqrt(mean(x^2) + eps), or x / sqrt(...) * (1 + w)."""
    out, w = torch.empty(x.shape, dtype=torch.float64), w.detach()
    flat, o = x.reshape(-1, x.shape[-1]), out.view(-1, x.shape[-1])
    for r in range(flat.shape[0]):
        row = [float(v) for v in flat[r]]
        inv = 1.0 / math.sqrt(sum(v * v for v in row) / len(row) + eps)
        for i, v in enumerate(row):
            o[r, i] = v * inv * (1.0 + float(w[i])) if unit_offset else float(w[i]) * v * inv
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 100])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_rmsnorm_against_loops_and_torch(dtype, hidden, unit_offset):
    """Strided rows (a view of a wider tensor), widths with and without a 16-lane tail: within a few ulp of the
    float64 loop (the dtype's rounding of the intermediate included), and the same values as `RMSNorm.forward` up
    to the order of the sum (float32: 1e-6 relative; half precision: one ulp where a rounding flips)."""
    gen = torch.Generator().manual_seed(1)
    wide = (torch.randn(2, 9, hidden + 7, generator=gen) * 3).to(dtype)
    x = wide[..., :hidden]  # rows at stride hidden + 7
    norm = RMSNorm(hidden, 1e-5, unit_offset).to(dtype)
    norm.weight.data = (1 + 0.3 * torch.randn(hidden, generator=gen)).to(dtype)
    got = cpu_kernels.rmsnorm(x, norm.weight, norm.eps, unit_offset)
    assert got.shape == x.shape and got.dtype == dtype and got.is_contiguous()
    close_in_ulps(got, naive_rmsnorm(x, norm.weight, norm.eps, unit_offset), 4 if dtype == torch.float32 else 2)
    close_in_ulps(got, norm(x), 4 if dtype == torch.float32 else 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 40])
def test_rotary_is_bitwise_the_torch_rotation_in_place(dtype, dim):
    """A q/k head slice of a fused q/k/v output (B = 2 rows of 5 tokens): rotated in place, bitwise
    `apply_rotary`'s result; the value heads beside it untouched; and the float32 rotation by hand."""
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(2, 5, 7, dim, generator=gen).to(dtype)
    a, b = qkv[:, :, :5, :dim // 2].double(), qkv[:, :, :5, dim // 2:].double()
    angles = torch.rand(2, 5, 1, dim // 2, generator=gen) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    expected, values = apply_rotary(qkv[:, :, :5], cos, sin), qkv[:, :, 5:].clone()
    got = cpu_kernels.rotary_(qkv[:, :, :5], cos, sin)
    assert got.data_ptr() == qkv.data_ptr() and torch.equal(got, expected) and torch.equal(qkv[:, :, 5:], values)
    c, s = angles.cos().double(), angles.sin().double()  # the rotation: [a, b] -> [a cos - b sin, b cos + a sin]
    by_hand = torch.cat([a * c - b * s, b * c + a * s], -1)
    torch.testing.assert_close(got.double(), by_hand, atol=4 * ULP[dtype] * 8, rtol=0)
    with pytest.raises(ValueError, match="head stride"):
        cpu_kernels.rotary_(torch.randn(2, 5, dim, 7).to(dtype).transpose(2, 3)[:, :, :5], cos, sin)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("inner", [1536, 100])
def test_gated_activation_against_loops_and_torch(dtype, gelu, inner):
    """act(gate) * up from the fused (..., 2 I) output, including arguments far out in both tails (exp clamped):
    within a few ulp of float64 (the dtype's rounding of act included), and of `MLP`'s torch ops up to their own
    error (torch's GELU loses ~1e-7 |gate| to cancellation in its negative tail)."""
    gen = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(3, 4, 2 * inner, generator=gen) * 4).to(dtype)
    gate_up[0, 0, :4] = torch.tensor([60.0, -60.0, 9.0, -9.0]).to(dtype)
    got = cpu_kernels.gated_activation(gate_up, gelu)
    gate, up = gate_up.double().chunk(2, dim=-1)
    # GELU's tanh form 0.5 g (1 + tanh(y)) = g sigmoid(2 y), written without the cancellation of 1 + tanh(y)
    act = gate * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (gate + 0.044715 * gate ** 3)) if gelu \
        else gate * torch.sigmoid(gate)
    expected = act.to(dtype).double() * up  # the dtype's rounding of act, as the torch code rounds it
    assert got.shape == (3, 4, inner) and got.dtype == dtype
    # float32: GELU's exp(-2y) carries the rounding of y times |2y| (up to ~20 where the result is not ~0)
    close_in_ulps(got, expected, (64 if gelu else 8) if dtype == torch.float32 else 2, 1e-24)  # tails: ~1e-33 for 0
    g, u = gate_up.chunk(2, dim=-1)
    torch_result = (F.gelu(g, approximate="tanh") if gelu else F.silu(g)) * u
    close_in_ulps(got, torch_result, (64 if gelu else 8) if dtype == torch.float32 else 2,
                  (gate * up).abs() if gelu else 0.0)


def test_results_do_not_depend_on_the_thread_count():
    """Above the size where the rows are split over threads, one thread and two give the same bits."""
    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(64, 576, generator=gen).bfloat16(), torch.randn(576, generator=gen).bfloat16()
    qkv, cs = torch.randn(1, 64, 15, 64, generator=gen), torch.randn(1, 64, 1, 64, generator=gen)
    gate_up = torch.randn(64, 3072, generator=gen)
    before = torch.get_num_threads()
    runs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            runs.append((cpu_kernels.rmsnorm(x, w, 1e-6), cpu_kernels.rotary_(qkv.clone()[:, :, :12], cs, cs),
                         cpu_kernels.gated_activation(gate_up)))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_is_write_kv_and_append(dtype):
    """One decode step of 3 rows (keys/values strided views of a q/k/v output): the fused store leaves the paged
    cache and the dense copies bit for bit as `write_kv` followed by `DenseDecodeCache.append` do."""
    caches = []
    for fused in (True, False):
        gen = torch.Generator().manual_seed(5)
        ws = InferenceWorkspace(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=16, dtype=dtype)
        for layer in range(2):  # three rows already hold 5, 2 and 7 tokens
            write_kv(ws.k_caches[layer], ws.v_caches[layer], torch.arange(16),
                     torch.randn(16, 2, 16, generator=gen), torch.randn(16, 2, 16, generator=gen))
        cache = DenseDecodeCache(ws)
        assert cache.kernel
        tables = torch.tensor([[0, 1, 0], [2, 0, 0], [3, 4, 0]], dtype=torch.int32)
        assert cache.begin_step([10, 11, 12], [6, 3, 8], tables, 0.25)
        slots = torch.tensor([5, 10, 19])  # block * 4 + offset of each row's new token
        qkv = torch.randn(3, 8, 16, generator=gen).to(dtype)
        k, v = qkv[:, 4:6], qkv[:, 6:]
        if fused:
            cache.store(1, k, v, ws.k_caches[1], ws.v_caches[1], slots)
        else:
            write_kv(ws.k_caches[1], ws.v_caches[1], slots, k, v)
            cache.append(1, k, v)
        caches.append((ws.k_caches[1].clone(), ws.v_caches[1].clone(), cache._keys[1].clone(),
                       cache._values[1].clone()))
    assert all(torch.equal(a, b) for a, b in zip(*caches))
    keys = caches[0][2]  # (B, Nkv, cap, D) view: row 2's new key at position 7
    assert torch.equal(keys[2, :, 7], caches[0][0].view(-1, 2, 16)[19])


def test_hooks_on_the_inference_copy_only():
    """`use_cpu_kernels` points an engine copy's norms, rotary and gated MLPs at the kernels; the model it was
    copied from keeps the torch ops (the training model never has them)."""
    from astrai.models import AutoRegressiveLM, tiny_config
    from astrai.rollout.paged_engine import PagedGenerationEngine

    model = AutoRegressiveLM(tiny_config(vocab_size=64)).eval()
    engine = PagedGenerationEngine(model, pad_token_id=0, adaptive_threads=False)
    assert engine.cpu_kernels
    copied = list(engine.model.modules())
    assert all(m.kernel is cpu_kernels.rmsnorm_nocheck for m in copied if isinstance(m, RMSNorm))
    assert all(m.rotary is cpu_kernels.rotary_nocheck_ for m in copied if isinstance(m, Attention))
    assert all(m.gated is cpu_kernels.gated_activation_nocheck for m in copied if isinstance(m, MLP))
    for m in model.modules():
        assert not isinstance(m, RMSNorm) or m.kernel is None
        assert not isinstance(m, Attention) or m.rotary is apply_rotary
        assert not isinstance(m, MLP) or m.gated is None


@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3", "mistral", "gemma2", "gemma3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_with_and_without_the_elementwise_kernels(family, dtype, monkeypatch):
    """Every family's shape (Qwen3's per-head q/k norms, Gemma's unit-offset sandwich norms and GELU, biases,
    windows): the engine decodes the same greedy tokens with the kernels as with the torch ops, log-probs within
    float32 (bfloat16) rounding, and the kernels served the steps."""
    import astrai.rollout.paged_engine as paged_engine
    from astrai.rollout.sampling import SamplingParams


    model = astrai_twin(hf_model(family)).eval()
    prompts = [[1, 5, 9, 11, 20, 31], [3, 4], list(range(3, 40))]
    params = SamplingParams(max_new_tokens=24, top_k=1)

    def generate():
        engine = paged_engine.PagedGenerationEngine(model, pad_token_id=2, dtype=dtype, prefix_cache=False,
                                                    adaptive_threads=False)
        return engine, engine.generate(prompts, params, torch.Generator().manual_seed(0))

    calls = []
    real = cpu_kernels.rmsnorm_nocheck
    monkeypatch.setattr(cpu_kernels, "rmsnorm_nocheck", lambda *a: calls.append(1) or real(*a))
    engine, with_kernels = generate()
    assert engine.cpu_kernels and calls
    monkeypatch.setattr(paged_engine, "use_cpu_kernels", lambda model, dtype: False)
    engine, without = generate()
    assert not engine.cpu_kernels
    assert torch.equal(with_kernels.response_ids, without.response_ids)
    tolerance = 1e-4 if dtype == "float32" else 5e-2
    torch.testing.assert_close(with_kernels.old_logprobs, without.old_logprobs, atol=tolerance, rtol=0)


def test_sampler_pass_against_torch_nan_and_minus_inf(monkeypatch):
    """`sample_rows` takes the same tokens and log-probs with the compiled first pass as with the torch ops (also
    under a float64 default dtype); a NaN anywhere in a row raises `FloatingPointError` naming it (as the torch
    path does); a -inf logit has probability exactly 0."""
    from astrai.rollout.row_sampling import RowSampling, sample_rows
    from astrai.rollout.sampling import SamplingParams

    def draw(logits, temperature=1.0):
        rows = [RowSampling(SamplingParams(max_new_tokens=4, temperature=temperature), None,
                            torch.Generator().manual_seed(i), []) for i in range(logits.shape[0])]
        return sample_rows(logits, rows)

    logits = torch.randn(5, 3000, generator=torch.Generator().manual_seed(6)) * 4
    default = torch.get_default_dtype()
    for temperature, default_dtype in ((1.0, default), (0.7, default), (1.0, torch.float64)):
        torch.set_default_dtype(default_dtype)
        try:
            with_kernel = draw(logits, temperature)
            with monkeypatch.context() as patch:
                patch.setattr(cpu_kernels, "supports", lambda dtype: False)
                tokens, logprobs = draw(logits, temperature)
        finally:
            torch.set_default_dtype(default)
        assert tokens == with_kernel[0]
        assert max(abs(a - b) for a, b in zip(logprobs, with_kernel[1])) < 1e-5
    for column in (7, 2999):  # a lane in the middle, one in the tail
        bad = logits.clone()
        bad[3, column] = float("nan")
        with pytest.raises(FloatingPointError, match="row 3"):
            draw(bad)
    row = logits[:1].clone()
    row[0, :100] = float("-inf")
    probs, mass, maxes = torch.empty(1, 3072), torch.empty(1, 3, dtype=torch.float64), torch.empty(1)
    cpu_kernels.softmax_chunks(row, probs, mass, maxes, 1024)
    assert probs[0, :100].eq(0).all() and probs[0, 3000:].eq(0).all() and maxes[0] == row.max()
    torch.testing.assert_close(mass, probs.view(1, 3, 1024).double().sum(-1), rtol=1e-12, atol=0)


def test_rows_of_contiguous_tensors_with_size_one_dims():
    """A contiguous tensor whose size-1 dimension has an arbitrary stride ((4, 1, H) from a transpose) is read at
    row stride H."""
    x = torch.randn(1, 4, 64).transpose(0, 1)  # shape (4, 1, 64), strides (64, 256, 1), contiguous
    assert x.is_contiguous()
    w = torch.rand(64) + 0.5
    by_hand = w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(cpu_kernels.rmsnorm(x, w, 1e-6), by_hand, rtol=1e-5, atol=1e-6)
    gate_up = torch.randn(1, 4, 64).transpose(0, 1)
    g, u = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_kernels.gated_activation(gate_up), F.silu(g) * u, rtol=1e-5, atol=1e-6)


def test_bad_arguments_are_refused_in_one_line():
    """Other dtypes, a weight of another dtype or length, cos/sin that do not match x, an odd gate/up width, and
    store_kv's index dtypes: a ValueError naming the function, before any memory is read."""
    x = torch.randn(2, 3, 64)
    cases = [
        (lambda: cpu_kernels.rmsnorm(x.double(), torch.ones(64).double(), 1e-6), "rmsnorm"),
        (lambda: cpu_kernels.rmsnorm(x.bfloat16(), torch.ones(64), 1e-6), "rmsnorm"),
        (lambda: cpu_kernels.rmsnorm(x, torch.ones(32), 1e-6), "weight"),
        (lambda: cpu_kernels.rmsnorm(x, torch.ones(64, 2)[:, 0], 1e-6), "weight"),
        (lambda: cpu_kernels.rotary_(torch.randn(4, 3, 2, 8), torch.randn(1, 3, 1, 8), torch.randn(1, 3, 1, 8)),
         "rotary_"),
        (lambda: cpu_kernels.rotary_(torch.randn(1, 3, 2, 8).bfloat16(), torch.randn(1, 3, 1, 8),
                                     torch.randn(1, 3, 1, 8)), "rotary_"),
        (lambda: cpu_kernels.gated_activation(torch.randn(3, 33)), "even"),
        (lambda: cpu_kernels.gated_activation(torch.randn(3, 32, dtype=torch.float64)), "gated_activation"),
    ]
    ws = InferenceWorkspace(num_layers=1, num_blocks=2, block_size=4, num_kv_heads=1, head_dim=8, dtype=torch.float32)
    keys, values = torch.zeros(2, 1, 8, 16), torch.zeros(2, 1, 16, 8)
    cases.append((lambda: cpu_kernels.store_kv(torch.randn(2, 1, 8), torch.randn(2, 1, 8),
                                               torch.tensor([0, 1], dtype=torch.int32), ws.k_caches[0],
                                               ws.v_caches[0], torch.tensor([0, 1]), keys, values), "store_kv"))
    for call, name in cases:
        with pytest.raises(ValueError, match=name):
            call()
