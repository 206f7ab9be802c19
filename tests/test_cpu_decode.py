"""The CPU engine's flat trunk forward (`astrai.rollout.cpu_decode.FlatTrunk`), its one-call decode token
(`cpu_kernels.decode_token`) and the few-row product (`cpu_kernels.gemv`): against the module forward on every
family's test shape, and the product against float64 loops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from family_models import astrai_twin, hf_model

from astrai.kernels import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.supports(torch.float32),
                                reason=f"no CPU kernels here: {cpu_kernels.unavailable_reason()}")

FAMILIES = ["llama3", "qwen2", "qwen3", "mistral", "gemma2", "gemma3"]
ULP = {torch.float32: 2 ** -23, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}


def generate(model, dtype, prompts, max_new_tokens, *, flat=True, token_call=True):
    """Greedy generation by a fresh engine (no prefix cache: every call computes the same products), with the
    flat trunk (and its one-call token) or the module forward."""
    from astrai.rollout.paged_engine import PagedGenerationEngine
    from astrai.rollout.sampling import SamplingParams

    engine = PagedGenerationEngine(model, pad_token_id=2, dtype=dtype, prefix_cache=False, adaptive_threads=False)
    assert engine.flat is not None, "the flat trunk serves every dense family"
    if not flat:
        engine.flat = None
    else:
        engine.flat.token_call = engine.flat.token_call and token_call
    params = SamplingParams(max_new_tokens=max_new_tokens, top_k=1)
    return engine.generate(prompts, params, torch.Generator().manual_seed(0))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_flat_trunk_is_bitwise_the_module_forward(family, dtype):
    """Prefill chunks and decode steps of three rows (Qwen3's q/k norms, Gemma's sandwich norms and GELU, Qwen2's
    biases, windows): the flat loop gives the module forward's tokens and log-probs bit for bit."""
    if dtype == "float16" and not cpu_kernels.supports(torch.float16):
        pytest.skip("this compiler has no float16")
    model = astrai_twin(hf_model(family)).eval()
    prompts = [[1, 5, 9, 11, 20, 31], [3, 4], list(range(3, 40))]
    flat = generate(model, dtype, prompts, 12, token_call=False)
    modules = generate(model, dtype, prompts, 12, flat=False)
    assert torch.equal(flat.response_ids, modules.response_ids)
    assert torch.equal(flat.old_logprobs, modules.old_logprobs)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows", [1, 3, 7])
def test_one_call_decode_token_matches_the_module_forward(family, dtype, rows, monkeypatch):
    """One row (three and seven rows of other lengths: the products' register tiles of two rows and an odd one)
    decoding 90 tokens, past the dense copies' first capacity, so they are
    rebuilt and the call re-pointed: the one-call path serves every decode step and decodes the module forward's
    greedy tokens, log-probs within float32 (bfloat16) rounding of the products' sum order. In bfloat16 a flipped
    last bit can turn a near-tie of these random models' logits (the bfloat16 module forward leaves float32's
    greedy tokens after 1 to 69 tokens on these shapes), so several rows are compared over their first 24 tokens, as
    tests/test_cpu_elementwise.py compares the compiled pieces."""
    model = astrai_twin(hf_model(family)).eval()
    calls = []
    real = cpu_kernels.decode_token_nocheck
    monkeypatch.setattr(cpu_kernels, "decode_token_nocheck", lambda step, *a: calls.append(step.B) or real(step, *a))
    prompts = [[1, 5, 9, 11, 20, 31], [3, 4], list(range(3, 40)), [7] * 9, [2, 8, 6], list(range(40, 61)), [12]][:rows]
    token = generate(model, dtype, prompts, 90)
    assert calls == [rows] * 89, "every decode step after the prefill's first token"
    modules = generate(model, dtype, prompts, 90, flat=False)
    compared = 90 if dtype == "float32" or rows == 1 else 24
    assert torch.equal(token.response_ids[:, :compared], modules.response_ids[:, :compared])
    tolerance = 1e-4 if dtype == "float32" else 5e-2
    torch.testing.assert_close(token.old_logprobs[:, :compared], modules.old_logprobs[:, :compared], atol=tolerance,
                               rtol=0)


def test_rows_past_the_scratch_go_to_the_flat_loop(monkeypatch):
    """The one-call path takes at most the rows its scratch was sized for when the engine was built, even when
    `TOKEN_ROWS` is raised afterwards; `decode_token` itself refuses a scratch too small for the step."""
    import astrai.rollout.cpu_decode as cpu_decode

    model = astrai_twin(hf_model("llama3")).eval()
    calls = []
    real = cpu_kernels.decode_token_nocheck
    monkeypatch.setattr(cpu_kernels, "decode_token_nocheck", lambda step, *a: calls.append(step.B) or real(step, *a))
    from astrai.rollout.paged_engine import PagedGenerationEngine
    from astrai.rollout.sampling import SamplingParams

    monkeypatch.setattr(cpu_decode, "TOKEN_ROWS", 4)  # the scratch is sized for 4 rows
    engine = PagedGenerationEngine(model, pad_token_id=2, dtype="float32", prefix_cache=False)
    monkeypatch.setattr(cpu_decode, "TOKEN_ROWS", 16)
    prompts = [[1 + (7 * i + j) % 50 for j in range(3 + i)] for i in range(6)]
    engine.generate(prompts, SamplingParams(max_new_tokens=6, top_k=1), torch.Generator().manual_seed(0))
    assert calls == [] and engine.flat.token_rows == 4
    engine.generate(prompts[:4], SamplingParams(max_new_tokens=6, top_k=1), torch.Generator().manual_seed(0))
    assert calls == [4] * 5
    step = engine.flat._step
    step.B = 5
    with pytest.raises(ValueError, match="decode_token"):
        cpu_kernels.decode_token(step, engine.flat._layer_structs, torch.zeros(5, step.H), engine.flat._scratch)


def test_the_flat_trunk_declines_other_layers():
    """A layer the flat loop does not mirror (here: projections left unfused) keeps the module forward."""
    from astrai.models import AutoRegressiveLM, tiny_config
    from astrai.rollout.cpu_decode import FlatTrunk

    model = AutoRegressiveLM(tiny_config()).eval()
    assert FlatTrunk.build(model) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,inner,bias", [(1, 576, False), (1, 100, True), (3, 33, True), (2, 1536, False),
                                             (5, 40, True), (8, 576, False)])
def test_gemv_against_float64_loops(dtype, rows, inner, bias):
    """y = x W^T + b for widths with and without a 16/32-lane tail and output counts that are not a multiple of the
    row block: within the float32 sum's rounding (K ulps of the summed magnitudes) plus one output rounding."""
    if dtype == torch.float16 and not cpu_kernels.supports(torch.float16):
        pytest.skip("this compiler has no float16")
    torch.manual_seed(0)
    x = torch.randn(rows, inner).to(dtype)
    weight = torch.randn(37, inner).to(dtype)
    b = torch.randn(37).to(dtype) if bias else None
    got = cpu_kernels.gemv(x, weight, b)
    assert got.dtype == dtype and got.shape == (rows, 37)
    reference = torch.zeros(rows, 37, dtype=torch.float64)
    magnitude = torch.zeros(rows, 37, dtype=torch.float64)
    for r in range(rows):
        for n in range(37):
            terms = [float(x[r, k]) * float(weight[n, k]) for k in range(inner)]
            reference[r, n] = sum(terms) + (float(b[n]) if bias else 0.0)
            magnitude[r, n] = sum(abs(t) for t in terms)
    bound = inner * 2 ** -24 * magnitude + ULP[dtype] * reference.abs() + 1e-30
    assert ((got.double() - reference).abs() <= bound).all()
    torch.testing.assert_close(got.float(), F.linear(x.float(), weight.float(), None if b is None else b.float()).to(
        dtype).float(), rtol=ULP[dtype] * 4, atol=inner * 2 ** -20)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_rows_do_not_depend_on_the_rows_beside_them(dtype):
    """A row's outputs are the same bits alone (the one-row form, 12 weight rows a task) and among 2 to 9 rows (the
    register tiles of 8 weight rows times 2 input rows, an odd row alone), for widths with and without a tail and
    output counts that leave a partial block: a decode step's token does not depend on its batch."""
    torch.manual_seed(2)
    for inner, outputs in ((576, 37), (40, 13), (1536 + 3, 20)):
        weight = torch.randn(outputs, inner).to(dtype)
        bias = torch.randn(outputs).to(dtype)
        x = torch.randn(9, inner).to(dtype)
        alone = torch.cat([cpu_kernels.gemv(x[i:i + 1], weight, bias) for i in range(9)])
        for rows in range(2, 10):
            assert torch.equal(cpu_kernels.gemv(x[:rows], weight, bias), alone[:rows]), (inner, rows)


def test_gemv_threads_and_strided_rows():
    """One thread and two give the same bits (each output is summed by one thread); rows at a stride are read in
    place."""
    torch.manual_seed(1)
    weight = torch.randn(4096, 576)
    x = torch.randn(2, 1200)[:, :576]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_kernels.gemv(x, weight)
        torch.set_num_threads(2)
        two = cpu_kernels.gemv(x, weight)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    torch.testing.assert_close(one, F.linear(x, weight), rtol=1e-5, atol=1e-4)


def test_gemv_refuses_bad_arguments_in_one_line():
    """Another device (meta tensors have no memory), a bias that is not a tensor, a 0-d x, another dtype, mixed
    dtypes, a weight of another width or layout, a bias of another length, and scratch sizes below 1 or for another
    dtype: a ValueError naming the function, before any memory is read."""
    x = torch.randn(1, 64)
    cases = [
        lambda: cpu_kernels.gemv(x, torch.empty(8, 64, device="meta")),
        lambda: cpu_kernels.gemv(x, torch.randn(8, 64), torch.empty(8, device="meta")),
        lambda: cpu_kernels.gemv(x, torch.randn(8, 64), 0.0),
        lambda: cpu_kernels.gemv(torch.tensor(1.0), torch.randn(8, 1)),
        lambda: cpu_kernels.decode_scratch_bytes(-1, 64, 4, 2, 16, 128, torch.float32),
        lambda: cpu_kernels.decode_scratch_bytes(1, 64, 4, 2, 16, 128, torch.float64),
        lambda: cpu_kernels.gemv(x.double(), torch.randn(8, 64).double()),
        lambda: cpu_kernels.gemv(x.bfloat16(), torch.randn(8, 64)),
        lambda: cpu_kernels.gemv(x, torch.randn(8, 32)),
        lambda: cpu_kernels.gemv(x, torch.randn(64, 8).t()),
        lambda: cpu_kernels.gemv(x, torch.randn(8, 64), torch.randn(9)),
    ]
    for call in cases:
        with pytest.raises(ValueError, match="gemv|decode_scratch_bytes"):
            call()
    # a transposed weight or a strided bias of the right shape: the message says what is wrong with it
    with pytest.raises(ValueError, match=r"gemv: weight \(strides \(1, 8\)\) must be contiguous; pass \.contiguous"):
        cpu_kernels.gemv(x, torch.randn(64, 8).t())
    with pytest.raises(ValueError, match=r"gemv: bias \(strides \(2,\)\) must be contiguous"):
        cpu_kernels.gemv(x, torch.randn(8, 64), torch.randn(16)[::2])


def test_gemv_of_empty_sums_is_the_bias():
    """K = 0: every sum is empty, so y is the bias (zeros without one), as `F.linear` gives."""
    x, weight, bias = torch.randn(3, 0), torch.randn(5, 0), torch.randn(5)
    assert torch.equal(cpu_kernels.gemv(x, weight), torch.zeros(3, 5))
    assert torch.equal(cpu_kernels.gemv(x, weight, bias), F.linear(x, weight, bias))
