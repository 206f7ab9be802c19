"""In-training evaluation (`train.eval_steps`, `data.eval_path`): logged at the right steps, equal to what
`python -m astrai.evaluate` measures on the published checkpoint, and invisible to training itself."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from astrai import evaluate
from astrai.config import load_config
from astrai.rewards.builtins import BUILTIN_REWARDS, BuiltinReward
from astrai.train import main
from astrai.trainer.build import build_trainer
from astrai.trainer.evaluation_callback import EvaluationCallback
from test_resume import sft_args
from test_train_e2e import EXAMPLE, tiny_args

EVAL = ("--train.eval_steps", "2", "--data.eval_path", "builtin:arithmetic_test", "--data.eval_limit", "5")
KEYS = ("eval/accuracy", "eval/accuracy_ci_low", "eval/accuracy_ci_high", "eval/reward_mean", "eval/reward_mean_ci_low",
        "eval/reward_mean_ci_high", "eval/num_questions", "eval/truncated_fraction", "time/eval_seconds")


def reward_keys(name):
    return {f"eval/rewards/{name}/{key}" for key in ("mean", "applies", "failed")}


def even_length(prompts, completions, *, format_bonus=0.0, partial_credit=0.0, **columns):
    """Stub reward with mixed outcomes on a random tiny model: 1 for an even number of characters (the example
    job's reward.format_bonus is given to it, and ignored)."""
    return [float(len(c) % 2 == 0) for c in completions]


EVEN_LENGTH = BuiltinReward(even_length, "stub: 1 for an even number of characters")


def records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_eval_logged_at_steps_and_end_matches_cli_and_leaves_training_bitwise_equal(
        tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(BUILTIN_REWARDS, "even_length", EVEN_LENGTH)
    common = ("--runtime.deterministic", "true", "--reward.name", "even_length", "--data.path", "builtin:arithmetic")
    plain, with_eval = tmp_path / "plain", tmp_path / "eval"
    assert main(tiny_args(tiny_model_dir, plain, *common)) == 0
    assert main(tiny_args(tiny_model_dir, with_eval, *common, *EVAL)) == 0
    logged = records(with_eval)
    assert [all(k in r for k in KEYS) for r in logged] == [False, True, True]  # step 2 (eval_steps) and 3 (end)
    assert not any(k.startswith("eval/") for k in records(plain)[0])
    for r in logged[1:]:
        assert r["eval/num_questions"] == 5 and r["eval/accuracy_ci_low"] <= r["eval/accuracy"] <= \
            r["eval/accuracy_ci_high"]
    # training did not notice: same rewards, same weights, same global and strategy RNG states (evaluation draws
    # from its own generator)
    assert [r["rollout/reward_mean"] for r in logged] == [r["rollout/reward_mean"] for r in records(plain)]
    ckpt = "checkpoints/step-00000003"
    a, b = (load_file(str(run / ckpt / "model.safetensors")) for run in (plain, with_eval))
    assert all(torch.equal(a[k], b[k]) for k in a)
    for name, key in (("rng_state.pt", "torch"), ("strategy_state.pt", "sampling_rng")):
        a, b = (torch.load(run / ckpt / name, weights_only=True)[key] for run in (plain, with_eval))
        assert torch.equal(a, b), name
    # the evaluator on the run's output_dir (latest checkpoint, the run's prompt settings) measures the same
    out = tmp_path / "cli"
    assert evaluate.main(["--model", str(with_eval), "--data", "builtin:arithmetic_test", "--limit", "5",
                          "--output_dir", str(out), "--no_progress_bar"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model_path"].endswith("checkpoints/step-00000003")
    assert summary["settings"]["config"] == str(with_eval / "config.yaml")
    assert summary["settings"]["system_prompt"] == load_config(str(EXAMPLE)).data.system_prompt
    assert summary["settings"]["reward"] == "even_length" and summary["settings"]["max_new_tokens"] == 6
    assert summary["accuracy"] == pytest.approx(logged[-1]["eval/accuracy"])
    assert (summary["ci_low"], summary["ci_high"]) == pytest.approx(
        (logged[-1]["eval/accuracy_ci_low"], logged[-1]["eval/accuracy_ci_high"]))
    # the per-question results of each evaluation sit beside the metrics, equal to the evaluator's
    assert sorted(p.name for p in (with_eval / "eval").iterdir()) == ["step-00000002.jsonl", "step-00000003.jsonl"]
    written = [json.loads(line) for line in (with_eval / "eval" / "step-00000003.jsonl").read_text().splitlines()]
    cli = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    cut = [not f for ex in written for f in ex["finished"]]  # samples max_new_tokens (6) cut, counted (issue 42)
    assert any(cut) and logged[-1]["eval/truncated_fraction"] == pytest.approx(sum(cut) / len(cut))
    assert summary["truncated_fraction"] == pytest.approx(sum(cut) / len(cut))
    assert written == cli and sum(ex["num_correct"] for ex in written) == logged[-1]["eval/accuracy"] * 5


def test_eval_on_start_logs_the_starting_model_at_step_0_once(tiny_model_dir, tmp_path, monkeypatch):
    """train.eval_on_start: a step-0 record (metrics.jsonl, TensorBoard) and answers of the starting model, equal to
    the evaluator's on the model the run started from; training unchanged; a resume does not evaluate step 0 again."""
    from test_reporting import read_events

    monkeypatch.setitem(BUILTIN_REWARDS, "even_length", EVEN_LENGTH)
    common = ("--runtime.deterministic", "true", "--reward.name", "even_length", "--data.path", "builtin:arithmetic",
              *EVAL)
    plain, start = tmp_path / "plain", tmp_path / "start"
    assert main(tiny_args(tiny_model_dir, plain, *common)) == 0
    assert main(tiny_args(tiny_model_dir, start, *common, "--train.eval_on_start", "true")) == 0
    logged = records(start)
    assert [r["step"] for r in logged] == [0, 1, 2, 3]
    assert [all(k in r for k in KEYS) for r in logged] == [True, False, True, True]
    assert set(logged[0]) == {"step", "policy_version", *KEYS, *reward_keys("even_length")}
    assert logged[0]["policy_version"] == 0
    assert [r["rollout/reward_mean"] for r in logged[1:]] == [r["rollout/reward_mean"] for r in records(plain)]
    assert read_events(start)["eval/accuracy"][0] == pytest.approx(logged[0]["eval/accuracy"])
    out = tmp_path / "cli"
    assert evaluate.main(["--model", str(tiny_model_dir), "--config", str(start / "config.yaml"), "--data",
                          "builtin:arithmetic_test", "--limit", "5", "--output_dir", str(out),
                          "--no_progress_bar"]) == 0
    written = [json.loads(line) for line in (start / "eval" / "step-00000000.jsonl").read_text().splitlines()]
    cli = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert written == cli
    assert json.loads((out / "summary.json").read_text())["accuracy"] == pytest.approx(logged[0]["eval/accuracy"])
    assert main(tiny_args(tiny_model_dir, start, *common, "--train.eval_on_start", "true", "--max_steps", "4",
                          "--checkpoint.resume", "auto")) == 0
    assert [r["step"] for r in records(start)] == [0, 1, 2, 3, 4]
    assert sorted(p.name for p in (start / "eval").iterdir()) == [f"step-{s:08d}.jsonl" for s in (0, 2, 3, 4)]
    # a fresh run in the same folder keeps the earlier run's answers (as it keeps its metrics.jsonl)
    earlier = {p.name: p.read_text() for p in (start / "eval").iterdir()}
    assert main(tiny_args(tiny_model_dir, start, *common, "--max_steps", "2",
                          "--train.overwrite_output_dir", "true")) == 0
    kept = [p for p in start.iterdir() if p.name.startswith("eval.")]
    assert len(kept) == 1 and {p.name: p.read_text() for p in kept[0].iterdir()} == earlier
    assert sorted(p.name for p in (start / "eval").iterdir()) == ["step-00000002.jsonl"]


def test_offline_train_type_evaluates_with_its_own_synced_engine(tiny_model_dir, tmp_path):
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"{i} + {i}?"},
                                                     {"role": "assistant", "content": f"{2 * i}"}]}) + "\n"
                            for i in range(4)))
    out = tmp_path / "sft"
    args = sft_args(tiny_model_dir, out, data, "--max_steps", "3", "--rollout.max_new_tokens", "4", *EVAL)
    config = load_config(args[1], args[2:])
    trainer = build_trainer(config)
    callback = next(c for c in trainer.callbacks if isinstance(c, EvaluationCallback))
    trainer.fit()
    assert [all(k in r for k in KEYS) for r in records(out)] == [False, True, True]
    engine = callback._own_engine
    assert engine is not None and engine.policy_version == trainer.state.policy_version == 3
    policy = trainer.learner.policy.model.state_dict()
    engine_weights = engine.model.state_dict()
    assert all(torch.equal(policy[k], engine_weights[k]) for k in ("model.embed_tokens.weight", "lm_head.weight",
                                                                    "model.layers.1.mlp.down_proj.weight"))


@pytest.mark.parametrize("extra,needle", [
    (("--train.eval_steps", "2"), "data.eval_path"),
    (("--train.eval_steps", "2", "--data.eval_path", "/nonexistent/eval.jsonl"), "data.eval_path: file not found"),
    (("--data.eval_limit", "0"), "data.eval_limit"),
    (("--data.eval_limit", "5"), "data.eval_limit: set to 5 but there is no data.eval_path"),
    (EVAL, "eval is a file, not a directory"),
    (("--train.eval_on_start", "true"), "train.eval_on_start: needs train.eval_steps > 0"),
])
@pytest.mark.parametrize("check", [False, True], ids=["run", "check"])
def test_bad_eval_settings_exit_2(tiny_model_dir, tmp_path, capsys, extra, needle, check):
    """Refused at start-up in one line, by the run and by --check alike (an `eval` file where the job writes its
    eval/ directory included), with nothing written."""
    run = tmp_path / "run"
    run.mkdir()
    in_the_way = needle.startswith("eval is a file")
    if in_the_way:
        (run / "eval").write_text("not a directory")
    assert main(tiny_args(tiny_model_dir, run, *extra) + (["--check"] if check else [])) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err
    assert sorted(p.name for p in run.iterdir()) == (["eval"] if in_the_way else [])


def test_in_training_evaluation_reports_the_rewards_extracted_answers(tiny_model_dir, tmp_path):
    from astrai.rewards.builtins import extract_final_number
    args = tiny_args(tiny_model_dir, tmp_path / "run", "--max_steps", "1", *EVAL)
    callback = next(c for c in build_trainer(load_config(args[1], args[2:])).callbacks
                    if isinstance(c, EvaluationCallback))
    assert callback.extract_answer is extract_final_number


@pytest.mark.parametrize("check", [False, True], ids=["run", "check"])
def test_an_offline_jobs_evaluation_engine_is_refused_at_start(tiny_model_dir, tmp_path, capsys, check):
    """sft with train.eval_steps and an attention backend its evaluation engine cannot use passed --check and failed
    only at the first evaluation, after training steps; now both refuse it at start in one line, nothing written."""
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "1 + 1?"},
                                             {"role": "assistant", "content": "2"}]}) + "\n")
    out = tmp_path / "run"
    args = sft_args(tiny_model_dir, out, data, *EVAL, "--rollout.attention_backend", "flash_attn",
                    "--runtime.device", "cpu")  # flash_attn needs CUDA
    assert main(args + (["--check"] if check else [])) == 2
    err = capsys.readouterr().err.strip()
    assert "rollout.attention_backend: flash_attn" in err and len(err.splitlines()) == 1, err
    assert not out.exists() or not any(out.iterdir())
