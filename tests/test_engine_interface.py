"""The rollout engine seam (`astrai.rollout.engine`): one protocol, one factory chosen by `rollout.engine`, the
attention backend from `rollout.attention_backend` (ASTR_BACKEND overrides it). Proved by the paged engine and the
tests' dense reference engine both running the same training job through it."""

import json

import pytest
import reference_engine
import torch

from astrai.models import AutoRegressiveLM, tiny_config
from astrai.rollout.engine import (EngineCapacity, GenerationEngine, attention_backend, build_engine,
                                   engine_names)
from astrai.rollout.paged_engine import PagedGenerationEngine
from astrai.rollout.sampling import SamplingParams


@pytest.fixture()
def reference(monkeypatch):
    """The reference engine registered as `reference` for this test only."""
    from astrai.rollout import engine as engine_module

    monkeypatch.setattr(engine_module, "_ENGINES", dict(engine_module._ENGINES))
    reference_engine.register()


def test_the_factory_builds_engines_that_satisfy_the_protocol(reference):
    torch.manual_seed(0)
    model = AutoRegressiveLM(tiny_config())
    paged = build_engine("paged", model, pad_token_id=0, attention_backend="torch", max_num_seqs=7,
                         max_kv_tokens=512, policy_version=3)
    assert isinstance(paged, PagedGenerationEngine) and isinstance(paged, GenerationEngine)
    assert paged.policy_version == 3 and paged.backend.name == "torch"
    assert paged.capacity == EngineCapacity(max_num_seqs=7, max_kv_tokens=512, max_batch_tokens=2048,
                                            max_position_embeddings=model.config.max_position_embeddings)
    ref = build_engine("reference", model, pad_token_id=0)
    assert isinstance(ref, GenerationEngine) and ref.capacity.max_num_seqs is None
    params = SamplingParams(max_new_tokens=5, temperature=1e-4)  # greedy: both engines give the same tokens
    a = paged.generate([[3, 4, 5], [6, 7]], params, torch.Generator().manual_seed(0), n=2)
    b = ref.generate([[3, 4, 5], [6, 7]], params, torch.Generator().manual_seed(0), n=2)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.action_mask, b.action_mask)
    assert torch.allclose(a.old_logprobs, b.old_logprobs, atol=1e-4)
    assert set(engine_names()) >= {"paged", "reference"}


def test_unknown_engines_and_refused_settings_are_one_line(reference):
    model = AutoRegressiveLM(tiny_config())
    with pytest.raises(ValueError, match="rollout.engine: unknown engine 'sglang'; registered: paged, vllm, "
                                         "reference"):
        build_engine("sglang", model, pad_token_id=0)
    with pytest.raises(ValueError, match="the reference engine takes no dtype 'bfloat16'"):
        build_engine("reference", model, pad_token_id=0, dtype="bfloat16")


def test_astr_backend_overrides_the_configured_backend(monkeypatch):
    monkeypatch.delenv("ASTR_BACKEND", raising=False)
    assert attention_backend("triton") == "triton" and attention_backend(None) is None
    monkeypatch.setenv("ASTR_BACKEND", "torch")
    assert attention_backend("triton") == "torch"


@pytest.mark.parametrize("engine", ["paged", "reference"])
def test_an_online_job_trains_through_either_engine(engine, reference, tiny_model_dir, tmp_path):
    """online_grpo for 2 steps with `rollout.engine` paged or reference: same job code, and the engine's
    behaviour log-probs agree with the trainer's (`rollout/logprob_gap` ~0)."""
    from pathlib import Path

    from astrai.train import main

    out = tmp_path / "run"
    example = Path(__file__).resolve().parents[1] / "configs/examples/grpo.yaml"
    code = main(["--config", str(example), "--model.path", str(tiny_model_dir), "--train.output_dir", str(out),
                 "--max_steps", "2", "--rollout.batch_size", "2", "--grpo.group_size", "2",
                 "--grpo.minibatch_size", "4", "--grpo.micro_batch_size", "2", "--rollout.max_new_tokens", "6",
                 "--train.progress_bar", "false", "--data.truncation", "left", "--rollout.engine", engine,
                 "--rollout.attention_backend", "torch", "--train.report_to", "none",
                 "--checkpoint.save_at_end", "false"])
    assert code == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and records[0]["rollout/logprob_gap"] < 1e-4


def test_check_refuses_an_unknown_engine_before_the_model_loads(tiny_model_dir, tmp_path, capsys):
    from astrai.train import main

    code = main(["--check", "--model.path", str(tiny_model_dir), "--train.output_dir", str(tmp_path / "o"),
                 "--rollout.engine", "sglang"])
    assert code == 2
    assert "rollout.engine: unknown engine 'sglang'" in capsys.readouterr().err


def test_check_refuses_what_the_run_would_refuse_at_start_up(tiny_model_dir, tmp_path, capsys):
    """`--check` (the launchers' preflight) builds no engine and starts no reward worker, yet refuses in one line
    what the run refuses when it builds them: CUDA asked for without CUDA, an attention backend the run's device
    cannot serve, a reward function that cannot be called; LoRA is named on the line that passes."""
    import torch

    from astrai.train import main

    bad_reward = tmp_path / "bad.py"
    bad_reward.write_text("def f(prompts, completions, nowhere, **kw):\n    return [0.0] * len(completions)\n")
    base = ["--check", "--model.path", str(tiny_model_dir), "--train.output_dir", str(tmp_path / "o"),
            "--data.truncation", "left", "--data.max_prompt_length", "64", "--rollout.max_new_tokens", "8"]
    cases = [(["--rollout.attention_backend", "triton"],
              "rollout.attention_backend: triton backend needs a CUDA device"),
             (["--reward.functions", f"[{{function: 'bad:f', path: {bad_reward}}}]"],
              "reward.functions.0 (f): parameter 'nowhere' of bad:f is neither a column")]
    if not torch.cuda.is_available():
        cases.append((["--runtime.device", "cuda"], "runtime.device: 'cuda' requested but CUDA is not available"))
    for extra, needle in cases:
        assert main(base + extra) == 2, extra
        err = capsys.readouterr().err.strip().splitlines()
        assert needle in err[-1], (extra, err)
    assert main(base + ["--model.lora", "{r: 2}"]) == 0
    assert "; LoRA r=2 (alpha 4) on q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj: " in \
        capsys.readouterr().out
