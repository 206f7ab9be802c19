"""Attention backend choice with the CUDA / import probes stubbed, errors at engine construction, and the engine's
`dtype` (a bfloat16 rollout copy of a float32 policy)."""

import importlib.util
from pathlib import Path

import pytest
import torch
from astrai.kernels import BackendUnavailableError, backends, select_backend

from astrai.config import load_config
from astrai.models import AutoRegressiveLM, tiny_config
from astrai.rollout.paged_engine import PagedGenerationEngine
from astrai.rollout.sampling import SamplingParams
from astrai.forward import response_logprobs

ROOT = Path(__file__).resolve().parents[1]
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (astrai[dev] brings it on Linux "
                                                         "x86_64)")
EOS = 2


@pytest.fixture
def probes(monkeypatch):
    """Stub the probes: `state["cuda"]` and the set `state["importable"]` decide what a CUDA machine would have.
    (The Triton backend still imports the real triton module once chosen, hence `needs_triton`.)"""
    state = {"cuda": True, "importable": {"triton", "flash_attn"}}
    monkeypatch.setattr(backends, "_cuda_available", lambda: state["cuda"])
    monkeypatch.setattr(backends, "_import_error", lambda module: None if module in state["importable"]
                        else f"the {module} attention backend needs the {module} package, which is not installed")
    monkeypatch.delenv("ASTR_BACKEND", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return state


@needs_triton
def test_shipped_fp32_config_on_cuda_with_flash_attn_picks_triton(probes):
    config = load_config(str(ROOT / "configs" / "examples" / "ppo.yaml"), [])
    dtype = getattr(torch, config.rollout.dtype or config.model.dtype)
    assert dtype == torch.float32
    backend = select_backend(None, "cuda", dtype=dtype)
    assert backend.name == "triton"
    assert "float16/bfloat16" in backend.fallback_reason


@needs_triton
@pytest.mark.parametrize("dtype,block_size,importable,expected", [
    (torch.bfloat16, None, {"triton", "flash_attn"}, "flash_attn"),
    (torch.float16, 512, {"triton", "flash_attn"}, "flash_attn"),
    (torch.bfloat16, 16, {"triton", "flash_attn"}, "triton"),  # block size flash-attn cannot page
    (torch.bfloat16, None, {"triton"}, "triton"),  # flash-attn missing
    (torch.float32, None, {"flash_attn"}, "torch"),  # neither serves fp32 without triton
    (torch.bfloat16, None, set(), "torch"),
])
def test_auto_choice_on_cuda(probes, dtype, block_size, importable, expected):
    probes["importable"] = importable
    backend = select_backend("auto", "cuda", dtype=dtype, block_size=block_size)
    assert backend.name == expected
    if expected != "flash_attn":
        assert backend.fallback_reason and "\n" not in backend.fallback_reason
    if expected == "torch":
        assert "triton" in backend.fallback_reason and "flash_attn" in backend.fallback_reason


def test_auto_on_cpu_is_torch_even_with_everything_importable(probes):
    backend = select_backend("auto", "cpu", dtype=torch.float32)
    assert backend.name == "torch" and "CUDA device" in backend.fallback_reason
    probes["cuda"] = False
    assert select_backend("auto", "cuda", dtype=torch.bfloat16).name == "torch"


@pytest.mark.parametrize("name,device,dtype,block_size,match", [
    ("flash_attn", "cuda", torch.float32, None, "needs float16/bfloat16"),
    ("flash_attn", "cuda", torch.bfloat16, 16, "block_size % 256"),
    ("flash_attn", "cpu", torch.bfloat16, None, "needs a CUDA device"),
    ("triton", "cpu", torch.float32, None, "needs a CUDA device"),
    ("triton", "cuda", torch.float64, None, "float16/bfloat16/float32"),
])
def test_explicit_backend_that_cannot_serve_is_a_one_line_error(probes, name, device, dtype, block_size, match):
    with pytest.raises(BackendUnavailableError, match=match) as info:
        select_backend(name, device, dtype=dtype, block_size=block_size)
    assert "\n" not in str(info.value)


def test_explicit_backend_missing_package(probes):
    probes["importable"] = set()
    for name in ("triton", "flash_attn"):
        with pytest.raises(BackendUnavailableError, match=f"needs the {name} package, which is not installed"):
            select_backend(name, "cuda", dtype=torch.float16)


def test_unknown_backend_name(monkeypatch):
    monkeypatch.setenv("ASTR_BACKEND", "cudnn")
    with pytest.raises(ValueError, match="ASTR_BACKEND: expected one of auto, torch, triton, flash_attn"):
        select_backend(device="cpu")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return AutoRegressiveLM(tiny_config(vocab_size=48, eos_token_id=EOS, pad_token_id=EOS)).eval()


@pytest.mark.parametrize("env,kwargs,match", [("flash_attn", {}, "flash_attn backend needs a CUDA device"),
                                              ("triton", {}, "triton backend needs a CUDA device"),
                                              (None, {"backend": "triton", "dtype": "bfloat16"},
                                               "triton backend needs a CUDA device")])
def test_engine_construction_fails_for_a_backend_that_cannot_serve(model, monkeypatch, env, kwargs, match):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if env:
        monkeypatch.setenv("ASTR_BACKEND", env)
    with pytest.raises(BackendUnavailableError, match=match):
        PagedGenerationEngine(model, pad_token_id=EOS, **kwargs)


def test_engine_rejects_unknown_dtype(model):
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16, float16"):
        PagedGenerationEngine(model, pad_token_id=EOS, backend="torch", dtype="fp8")


def test_bf16_engine_generates_and_its_logprob_gap_to_fp32_scoring_is_small(model):
    """An fp32 policy rolled out from a bf16 copy: tokens come out, old_logprobs are float32, the copy (and its
    KV cache) is bf16, weight updates are cast in, and the gap to fp32 scoring is rounding-sized but not zero."""
    engine = PagedGenerationEngine(model, pad_token_id=EOS, backend="torch", dtype=torch.bfloat16, block_size=4)
    assert engine.dtype == torch.bfloat16 and next(model.parameters()).dtype == torch.float32
    params = SamplingParams(max_new_tokens=6, temperature=1.0, stop_token_ids=(EOS,))
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    gen = engine.generate(prompts, params, torch.Generator().manual_seed(0), n=2)
    assert engine.workspace.k_caches[0].dtype == torch.bfloat16
    assert gen.old_logprobs.dtype == torch.float32 and int(gen.action_mask.sum()) > 4
    with torch.no_grad():
        logprobs, _ = response_logprobs(model, gen.sequences(), temperature=1.0)
    gap = float((logprobs - gen.old_logprobs).abs()[gen.action_mask].mean())
    assert 1e-5 < gap < 0.05, gap
    state = {k: v + 0.01 for k, v in model.state_dict().items()}
    assert engine.load_weights(state, policy_version=1) == 1
    expected = state["model.layers.0.self_attn.q_proj.weight"].to(torch.bfloat16)
    assert torch.equal(engine.model.model.layers[0].self_attn.q_proj.weight, expected)


def test_flash_attn_backend_passes_window_and_softcap(probes):
    """flash-attn is not installed here: a recording stand-in shows what the backend passes it. A window W is
    flash-attn's `window_size=(W - 1, 0)` (the query and its W - 1 predecessors), none is (-1, -1); a soft-cap is
    `softcap` (0.0 = off), in decode and in prefill steps."""
    calls = []

    class Recorder:
        def flash_attn_with_kvcache(self, q, *args, **kwargs):
            calls.append(("decode", kwargs["window_size"], kwargs["softcap"]))
            return q

        def flash_attn_varlen_func(self, q, *args, **kwargs):
            calls.append(("prefill", kwargs["window_size"], kwargs["softcap"]))
            return q

    backend = backends.FlashAttnBackend("cuda", torch.bfloat16, 256)
    backend._module = Recorder()
    q = torch.zeros(3, 4, 8)
    for q_lens in ((1, 1, 1), (2, 1)):
        indptr = [0]
        for n in q_lens:
            indptr.append(indptr[-1] + n)
        meta = backends.AttentionMetadata(indptr, [5] * len(q_lens), torch.tensor(indptr), torch.tensor(
            [5] * len(q_lens)), torch.zeros(len(q_lens), 1, dtype=torch.int32), max(q_lens), 5, 0.125)
        backend.attention(q, None, None, meta, window=32, softcap=50.0)
        backend.attention(q, None, None, meta)
    assert calls == [("decode", (31, 0), 50.0), ("decode", (-1, -1), 0.0),
                     ("prefill", (31, 0), 50.0), ("prefill", (-1, -1), 0.0)]
