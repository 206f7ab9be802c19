"""Evaluation scores with the job's reward functions: the statistics against hand-computed numbers (a stub engine
whose response lengths are chosen, rewards of those lengths), `python -m astrai.evaluate` on a job whose only reward
is a user function in a file (no answer column), a failing user reward, and in-training evaluation of a job with
`reward.functions`."""

from __future__ import annotations

import json
import textwrap
from types import SimpleNamespace

import pytest
import torch

from astrai.algos.stats import wilson_interval
from astrai.config import config_from_dict
from astrai.data.prompts import PromptRecord
from astrai.evaluation.accuracy import EvalSettings, eval_statistics, evaluate, mean_interval
from astrai.evaluation.cli import main as evaluate_main
from astrai.models import tiny_tokenizer
from astrai.rewards.build import build_rewards, evaluation_specs

USER_REWARDS = '''
def half_length(prompts, completions, completion_ids, **kwargs):
    """Half the number of response tokens."""
    return [len(ids) / 2 for ids in completion_ids]

def even(prompts, completions, completion_ids, **kwargs):
    """1 for an even number of response tokens; does not apply (None) to an odd one."""
    return [1.0 if len(ids) % 2 == 0 else None for ids in completion_ids]

def chars(prompts, completions, target_len=None, **kwargs):
    """1 - |characters - target| / 10, at least 0 (target 4 without a target_len column)."""
    targets = target_len or [4] * len(completions)
    return [max(0.0, 1.0 - abs(len(c) - t) / 10) for c, t in zip(completions, targets)]

def boom(prompts, completions, **kwargs):
    raise RuntimeError("reward server down")
'''


@pytest.fixture()
def reward_file(tmp_path):
    path = tmp_path / "user_rewards.py"
    path.write_text(USER_REWARDS)
    return path


class StubEngine:
    """Generates, for question q and sample j, `lengths[q][j]` tokens (id 40), finished; in the engine's output
    layout (B * n rows, padded)."""

    def __init__(self, lengths):
        self.lengths, self.calls = lengths, 0

    def generate(self, prompt_ids, params, generator=None, n=1):
        first, self.calls = self.calls, self.calls + len(prompt_ids)
        rows = [self.lengths[q][j] for q in range(first, first + len(prompt_ids)) for j in range(n)]
        width = max(rows)
        mask = torch.tensor([[t < length for t in range(width)] for length in rows])
        return SimpleNamespace(response_ids=torch.where(mask, 40, 0), action_mask=mask,
                               finished=torch.ones(len(rows), dtype=torch.bool))


def job(reward_file, functions, **reward):
    entries = [{"function": f"user_rewards:{name}", "path": str(reward_file), **extra} for name, extra in functions]
    return config_from_dict({"reward": {"functions": entries, "num_workers": 0, **reward}})


def test_statistics_of_a_stub_evaluation_are_the_hand_computed_ones(reward_file):
    # three questions, two samples each, of 2 1 | 1 1 | 4 2 tokens
    config = job(reward_file, [("half_length", {}), ("even", {"weight": 0.5})])
    records = [PromptRecord(prompt=f"q{i}", answer="", index=i) for i in range(3)]
    rewards = build_rewards(config, records, specs=evaluation_specs(config))
    settings = EvalSettings(max_new_tokens=8, temperature=1.0, num_samples=2, batch_size=2)

    def run(threshold):
        return evaluate(StubEngine([[2, 1], [1, 1], [4, 2]]), tiny_tokenizer(), records, rewards=rewards,
                        settings=settings, max_prompt_length=64, pass_threshold=threshold, log=lambda line: None)

    result = run(1.0)
    # half_length: 1, .5 | .5, .5 | 2, 1; even (weight .5): 1, - | -, - | 1, 1
    assert [ex["scores"] for ex in result.examples] == [[1.5, 0.5], [0.5, 0.5], [2.5, 1.5]]
    assert result.examples[0]["rewards"] == {"half_length": [1.0, 0.5], "even": [1.0, None]}
    assert [ex["correct"] for ex in result.examples] == [[True, False], [False, False], [True, True]]
    m = result.metrics()
    assert m["correct"] == 1.5 and m["accuracy"] == 0.5 and m["pass_threshold"] == 1.0
    assert (m["ci_low"], m["ci_high"]) == wilson_interval(1.5, 3)
    assert m["pass_at_k"] == {"1": 0.5, "2": pytest.approx(2 / 3)}
    # per-question means 1, .5, 2: mean 7/6, sample variance ((1/6)^2 + (2/3)^2 + (5/6)^2) / 2 = 7/12,
    # half width 1.959964 * sqrt(7/12 / 3) = 0.864263
    assert m["reward_mean"] == pytest.approx(7 / 6) and m["mean_score"] == pytest.approx(7 / 6)
    assert m["reward_mean_ci_low"] == pytest.approx(7 / 6 - 0.864263, abs=1e-6)
    assert m["reward_mean_ci_high"] == pytest.approx(7 / 6 + 0.864263, abs=1e-6)
    assert m["rewards"]["half_length"] == {"mean": pytest.approx(5.5 / 6), "applies": 1.0, "failed": 0.0}
    assert m["rewards"]["even"] == {"mean": 1.0, "applies": 0.5, "failed": 0.0}
    # another threshold: only the 2.5 passes
    stricter = run(2.0).metrics()
    assert stricter["accuracy"] == pytest.approx(1 / 6) and stricter["pass_at_k"]["2"] == pytest.approx(1 / 3)
    # the statistics from the additive sums (what training sums over ranks) are the same
    assert eval_statistics(result.sums(), result.reward_names)["reward_mean_ci_low"] == m["reward_mean_ci_low"]


def test_mean_interval_edges():
    assert mean_interval(3.0, 9.0, 1) == (3.0, 3.0)  # one question: no spread to measure
    assert mean_interval(4.0, 8.0, 2) == (2.0, 2.0)  # equal values
    low, high = mean_interval(0.0 + 2.0, 0.0 + 4.0, 2)  # values 0 and 2: s = sqrt(2), half = z * 1
    assert (low, high) == pytest.approx((1 - 1.959964, 1 + 1.959964), abs=1e-6)
    with pytest.raises(ValueError, match="n >= 1"):
        mean_interval(0.0, 0.0, 0)


def write_job(path, reward_file, functions, extra=""):
    items = "\n".join(f"    - {{function: \"user_rewards:{name}\", path: {reward_file}{opts}}}"
                      for name, opts in functions)
    path.write_text(textwrap.dedent("""\
        data: {system_prompt: "Answer briefly.", max_prompt_length: 64, truncation: left}
        rollout: {max_new_tokens: 6}
        reward:
          functions:
        """) + items + "\n" + extra)
    return path


def cli(model, data, out, *extra):
    return evaluate_main(["--model", str(model), "--data", str(data), "--output_dir", str(out), "--no_progress_bar",
                          *extra])


def test_cli_scores_with_a_user_reward_file_on_data_without_answers(tiny_model_dir, tmp_path, reward_file, capsys):
    data = tmp_path / "prompts.jsonl"
    rows = [{"question": f"Say something about {w}.", "target_len": 3 + i} for i, w in enumerate("abcdef")]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))  # no answer column at all
    config = write_job(tmp_path / "job.yaml", reward_file, [("chars", "")], "  num_workers: 1\n")
    out = tmp_path / "eval"
    assert cli(tiny_model_dir, data, out, "--config", str(config), "--limit", "4", "--pass_threshold", "0.5") == 0
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["n"] == 4 and [r["index"] for r in results] == [0, 1, 2, 3]
    assert all(r["answer"] == "" and r["extracted_answers"] == [None] for r in results)
    # the reward by hand from the written responses and the target_len column
    by_hand = [max(0.0, 1 - abs(len(r["responses"][0]) - (3 + r["index"])) / 10) for r in results]
    values = [r["rewards"]["chars"][0] for r in results]
    assert values == pytest.approx(by_hand, abs=1e-6) and [r["scores"][0] for r in results] == values
    assert summary["rewards"]["chars"]["mean"] == pytest.approx(sum(by_hand) / 4, abs=1e-6)
    assert summary["rewards"]["chars"]["applies"] == 1.0 and summary["rewards"]["chars"]["failed"] == 0
    assert summary["reward_mean"] == pytest.approx(sum(values) / 4)
    passed = sum(v >= 0.5 for v in values)
    assert summary["accuracy"] == passed / 4 and summary["pass_threshold"] == 0.5
    assert [r["correct"] for r in results] == [[v >= 0.5] for v in values]
    s = summary["settings"]
    assert s["reward"] is None and [f["name"] for f in s["reward_functions"]] == ["chars"]
    printed = capsys.readouterr().out
    assert f"chars: mean {summary['rewards']['chars']['mean']:.4f}, applies 1.00" in printed
    assert "mean reward" in printed and "(pass: total reward >= 0.5)" in printed
    # --reward NAME scores with that built-in instead: math_exact_match reads answers, which this data lacks
    assert cli(tiny_model_dir, data, tmp_path / "other", "--config", str(config), "--reward", "math_exact_match") == 2
    err = capsys.readouterr().err.strip()
    assert "missing field 'answer'" in err and len(err.splitlines()) == 1


def test_cli_failing_user_reward_is_loud_not_fatal(tiny_model_dir, tmp_path, reward_file):
    config = write_job(tmp_path / "job.yaml", reward_file, [("chars", ""), ("boom", ", weight: 3.0")],
                       "  num_workers: 0\n  max_error_fraction: 0.6\n  error_score: -1.0\n")
    out = tmp_path / "eval"
    with pytest.warns(UserWarning, match=r"reward.functions.1 \(boom\) failed on 3 of 3 samples "
                                         r"\(RuntimeError: reward server down\)") as caught:
        assert cli(tiny_model_dir, "builtin:arithmetic_test", out, "--config", str(config), "--limit", "3") == 0
    assert sum("Traceback" in str(w.message) for w in caught) == 1  # once, with its traceback (in-process)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rewards"]["boom"] == {"mean": -1.0, "applies": 1.0, "failed": 3.0}  # error_score, counted
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert all(r["scores"][0] == pytest.approx(r["rewards"]["chars"][0] - 3.0) for r in results)
    # more failures than reward.max_error_fraction over reward.error_window batches stop it, as they stop training:
    # one line, exit 2
    strict = write_job(tmp_path / "strict.yaml", reward_file, [("boom", "")], "  num_workers: 0\n  error_window: 1\n")
    assert cli(tiny_model_dir, "builtin:arithmetic_test", tmp_path / "strict", "--config", str(strict),
               "--limit", "2") == 2
    assert not (tmp_path / "strict").exists()


def test_in_training_evaluation_logs_each_reward_function(tiny_model_dir, tmp_path, reward_file):
    from astrai.train import main

    run = tmp_path / "run"
    config = tmp_path / "job.yaml"
    config.write_text(textwrap.dedent(f"""\
        train: {{type: online_grpo, max_steps: 2, eval_steps: 2, output_dir: {run}, progress_bar: false,
                report_to: [none]}}
        data: {{path: builtin:arithmetic, eval_path: builtin:arithmetic_test, eval_limit: 4, max_prompt_length: 64,
               truncation: left}}
        reward:
          functions:
            - {{function: "user_rewards:chars", path: {reward_file}}}
            - {{function: "user_rewards:even", path: {reward_file}, weight: 0.5}}
            - {{function: math_exact_match, weight: 2.0}}
          num_workers: 1
        rollout: {{batch_size: 2, max_new_tokens: 6}}
        grpo: {{group_size: 2, minibatch_size: 4, micro_batch_size: 2}}
        checkpoint: {{save_at_end: false}}
        """))
    assert main(["--config", str(config), "--model.path", str(tiny_model_dir)]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = records[-1]
    assert logged["step"] == 2 and logged["eval/num_questions"] == 4 and "eval/accuracy" not in records[0]
    written = [json.loads(line) for line in (run / "eval" / "step-00000002.jsonl").read_text().splitlines()]
    for name in ("chars", "even", "math_exact_match"):
        values = [v for ex in written for v in ex["rewards"][name] if v is not None]
        mean = sum(values) / len(values) if values else 0.0
        assert logged[f"eval/rewards/{name}/mean"] == pytest.approx(mean, abs=1e-6), name
        assert logged[f"eval/rewards/{name}/applies"] == pytest.approx(len(values) / 4), name
        assert logged[f"eval/rewards/{name}/failed"] == 0
    assert logged["eval/rewards/chars/applies"] == 1.0 and logged["eval/rewards/math_exact_match/applies"] == 1.0
    for ex in written:  # the total is the weighted sum of the values that apply
        r = ex["rewards"]
        expected = r["chars"][0] + 0.5 * (r["even"][0] or 0.0) + 2.0 * r["math_exact_match"][0]
        assert ex["scores"][0] == pytest.approx(expected, abs=1e-6)
    totals = [ex["scores"][0] for ex in written]
    assert logged["eval/reward_mean"] == pytest.approx(sum(totals) / 4, abs=1e-6)
    assert logged["eval/accuracy"] == pytest.approx(sum(t >= 1.0 for t in totals) / 4)
    assert logged["eval/reward_mean_ci_low"] <= logged["eval/reward_mean"] <= logged["eval/reward_mean_ci_high"]
