"""Triton paged attention against the torch reference: under Triton's CPU interpreter here, natively on CUDA.

Why subprocesses: Triton decides between compiling and interpreting when `@triton.jit` decorates a kernel, i.e.
when `astrai.kernels.triton_attention` is first imported, reading TRITON_INTERPRET at that moment. Setting the
variable inside this pytest process would depend on test order (a test that built a TritonBackend earlier has
already imported the module in compiled mode) and would leak into every later test, so each interpreter check runs
in a fresh Python with TRITON_INTERPRET=1 in its environment: `python -m astrai.kernels.parity` for the kernels
alone, and a short script that runs the engine with the triton backend. The ahead-of-time compile tests build
the kernels' GPU code in-process (no GPU needed); the gpu-marked tests run the kernels natively and skip without
CUDA.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (astrai[dev] brings it on Linux x86_64)", allow_module_level=True)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _interpreted(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `python args...` with TRITON_INTERPRET=1 (one OpenMP thread); the completed process."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", ASTR_BACKEND="")
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout)


def _parity_rows(sweep: str) -> list[dict]:
    """The JSON rows of an interpreted `astrai.kernels.parity` run (the run must exit 0: every case ok)."""
    proc = _interpreted(["-m", "astrai.kernels.parity", "--backend", "triton", "--device", "cpu", "--sweep", sweep])
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    bad = [r for r in rows if not r["ok"]]
    assert proc.returncode == 0 and not bad, (bad, proc.stderr[-2000:])
    return rows


def test_triton_kernels_match_reference_under_interpreter():
    """Decode (GQA, one and several key tiles) and ragged prefill (full, chunked and single-query rows) in
    float32 / float16 / bfloat16 (a few seconds)."""
    rows = _parity_rows("small")
    assert {(r["name"], r["dtype"]) for r in rows} == {
        (name, dtype) for name in ("decode_gqa3", "prefill_mixed_gqa3") for dtype in ("float32", "float16", "bfloat16")}
    assert all(r["max_abs_err"] < 1e-5 for r in rows if r["dtype"] == "float32")


def test_triton_kernels_window_and_softcap_match_reference_under_interpreter():
    """Sliding windows (ending mid-tile, shorter and longer than the sequences; prefill tiles whose first key tile
    holds no key of some rows) and score soft-caps, decode and ragged prefill, in all three dtypes."""
    rows = _parity_rows("families")
    assert len(rows) == 12 and all(r["max_abs_err"] < 1e-5 for r in rows if r["dtype"] == "float32")


ENGINE_SCRIPT = textwrap.dedent("""
    import json, torch
    from astrai.models import AutoRegressiveLM, tiny_config
    from astrai.rollout.paged_engine import PagedGenerationEngine
    from astrai.rollout.sampling import SamplingParams

    torch.manual_seed(0)
    model = AutoRegressiveLM(tiny_config(vocab_size=40, eos_token_id=2, pad_token_id=2, **OPTIONS)).eval()
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [11, 12], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]
    params = SamplingParams(max_new_tokens=6, top_k=1, stop_token_ids=(2,))
    out = {}
    for backend, graphs in (("torch", False), ("triton", False), ("triton", True)):
        # block size 4 and 8-token steps: chunked prefill, steps mixing prefill chunks with decode rows, decode
        # (graphs: decode steps padded to batch buckets, the padded rows on the scratch block, run eagerly)
        engine = PagedGenerationEngine(model, pad_token_id=2, backend=backend, block_size=4, max_batch_tokens=8,
                                       cuda_graphs=graphs)
        gen = engine.generate(prompts, params, torch.Generator().manual_seed(0))
        out[backend + "_graphs" * graphs] = {
            "tokens": gen.response_ids.tolist(), "logprobs": gen.old_logprobs.tolist(), "name": engine.backend.name,
            "steps": engine.last_stats["steps"], "padded": engine._graphs.replays if graphs else 0}
    print(json.dumps(out))
""")


GEMMA2_OPTIONS = ("dict(model_type='gemma2', sliding_window=5, layer_types=['sliding_attention', 'full_attention'], "
                  "query_pre_attn_scalar=12.0, attn_logit_softcapping=2.0, final_logit_softcapping=8.0, "
                  "norm_unit_offset=True, post_sublayer_norms=True, scale_embeddings=True, "
                  "hidden_act='gelu_pytorch_tanh')")


@pytest.mark.parametrize("options", ["{}", GEMMA2_OPTIONS], ids=["llama", "gemma2_window_softcap"])
def test_engine_with_triton_backend_matches_torch_backend_under_interpreter(options):
    """The engine end to end (its strided q, int32 metadata, mixed prefill/decode steps) on a tiny model, plain and
    Gemma 2-shaped (a 5-key window in one layer, attention and final soft-caps): greedy tokens identical to the
    torch backend's, behaviour log-probs equal to float32 rounding; also with `cuda_graphs` (decode steps padded to
    a bucket, run eagerly here through the code a CUDA graph records)."""
    proc = _interpreted(["-c", f"OPTIONS = {options}\n" + ENGINE_SCRIPT])
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["triton"]["name"] == "triton" and out["torch"]["name"] == "torch"
    assert out["triton"]["tokens"] == out["torch"]["tokens"]
    torch.testing.assert_close(torch.tensor(out["triton"]["logprobs"]), torch.tensor(out["torch"]["logprobs"]),
                               atol=1e-4, rtol=0)
    assert out["triton"]["steps"] > 6  # chunked prefill took several steps
    # decode steps padded to buckets (3 rows -> 4) through the Triton decode kernel: the same tokens
    assert out["triton_graphs"]["tokens"] == out["torch"]["tokens"] and out["triton_graphs"]["padded"] > 0
    torch.testing.assert_close(torch.tensor(out["triton_graphs"]["logprobs"]),
                               torch.tensor(out["torch"]["logprobs"]), atol=1e-4, rtol=0)


@pytest.mark.slow
def test_triton_kernels_match_reference_under_interpreter_full_sweep():
    """Block sizes 1..32, MHA and GQA groups of 2, 3 and 8, head dim 24 (padded), multi-tile prefill."""
    rows = _parity_rows("full")
    assert len(rows) == 18


def _compile_for():
    """`compile_for`, or a skip where this Triton cannot compile ahead of time by argument name (< 3.3)."""
    from astrai.kernels import triton_attention

    major, minor = (int(x) for x in triton_attention.triton.__version__.split(".")[:2])
    if (major, minor) < (3, 3):
        pytest.skip(f"ahead-of-time compile needs triton >= 3.3, found {triton_attention.triton.__version__}")
    if triton_attention.INTERPRETED:
        pytest.skip("TRITON_INTERPRET is set in this process")
    return triton_attention.compile_for


def test_triton_kernels_compile_for_h100_without_a_gpu():
    """The decode and prefill kernels, with the constants a bfloat16 SmolLM2 launch uses, compile to sm_90 code
    (Triton's own ptxas: no GPU needed), so the GPU path has no compile error the interpreter cannot see."""
    compile_for = _compile_for()
    for kind in ("decode", "prefill"):
        assert 0 < compile_for(90, kind, torch.bfloat16, 9, 3, 64) <= 64 * 1024


@pytest.mark.slow
@pytest.mark.parametrize("arch", [80, 90])
def test_triton_kernels_compile_in_every_dtype_within_shared_memory(arch):
    """A100 / H100 code for both kernels in float32 / float16 / bfloat16, SmolLM2 heads and Llama-style ones
    (32 heads, 8 per KV head, D = 128): each program fits in 99 KB of shared memory, the smallest per-block limit
    of CUDA GPUs since sm_80 (a kernel that does not fit fails at its first launch)."""
    compile_for = _compile_for()
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for kind in ("decode", "prefill"):
            for heads in ((9, 3, 64), (32, 4, 128)):
                assert 0 < compile_for(arch, kind, dtype, *heads) <= 99 * 1024, (dtype, kind, heads)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("sweep", ["full", "smollm2"])
def test_triton_kernels_match_reference_on_cuda(sweep):
    from astrai.kernels.parity import FULL_CASES, SMOLLM2_CASES, run_cases

    cases = FULL_CASES if sweep == "full" else SMOLLM2_CASES
    rows = run_cases("triton", cases, (torch.float32, torch.float16, torch.bfloat16), "cuda")
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
