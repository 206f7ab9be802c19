"""`train.log_completions` (TRL's `log_completions`, verl's `rollout_data_dir`): the first N samples of each rollout
in `<output_dir>/completions.jsonl` with every field, agreeing with metrics.jsonl and the reward functions; online_grpo
and online_ppo; the jsonl file behaviour shared with metrics.jsonl (old file kept, later steps dropped on resume);
TensorBoard text and the W&B table; refused in one line for train types that sample no rollouts."""

import importlib.machinery
import json
import shutil
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from astrai.trainer.callbacks import COMPLETION_FIELDS, CompletionsLogger, JsonlFile
from astrai.trainer.reporting import TensorBoardLogger, build_reporters, completion_table, completions_markdown

REPO = Path(__file__).resolve().parents[1]

REWARDS = '''
def length_score(completions, **kwargs):
    return [len(c) % 5 / 4 for c in completions]

def even_only(completions, **kwargs):
    return [None if len(c) % 2 else 1.0 for c in completions]
'''
QUESTIONS = [f"Say something {i}" for i in range(8)]


def grpo_job(tmp_path, *, log_completions, minibatch=4, max_steps=2, extra=""):
    """An online_grpo job of 2 prompts x 2 samples per rollout on short prompts, scored by the two functions of
    `REWARDS` (in process), written to tmp_path/job.yaml; returns (job, output_dir)."""
    (tmp_path / "lc_rewards.py").write_text(REWARDS)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": "#### 1"}) + "\n" for q in QUESTIONS))
    out = tmp_path / "run"
    job = tmp_path / "job.yaml"
    job.write_text(textwrap.dedent(f"""\
        train: {{type: online_grpo, max_steps: {max_steps}, output_dir: {out}, progress_bar: false,
                log_completions: {log_completions}}}
        data: {{path: {data}, max_prompt_length: 64}}
        reward:
          functions:
            - {{function: "lc_rewards:length_score", path: {tmp_path / 'lc_rewards.py'}}}
            - {{function: "lc_rewards:even_only", path: {tmp_path / 'lc_rewards.py'}, weight: 0.5}}
          num_workers: 0
        rollout: {{batch_size: 2, max_new_tokens: 6}}
        grpo: {{group_size: 2, minibatch_size: {minibatch}, micro_batch_size: 2}}
        runtime: {{deterministic: true}}
        """) + extra)
    return job, out


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def by_step(records):
    steps = {}
    for record in records:
        steps.setdefault(record["step"], []).append(record)
    return steps


def text_events(run_dir, tag="completions/text_summary"):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    acc.Reload()
    assert tag in acc.Tags()["tensors"], acc.Tags()
    return {e.step: e.tensor_proto.string_val[0].decode() for e in acc.Tensors(tag)}


def test_online_grpo_logs_the_whole_rollout_as_the_rewards_and_metrics_saw_it(tiny_model_dir, tmp_path):
    """N = the rollout's 4 samples: every field, each reward recomputed from the logged completion (None where it
    does not apply), the score their weighted sum, the scores' mean = rollout/reward_mean, the advantages the group
    advantages of the logged scores, lengths as rollout/response_length; TensorBoard holds the same table."""
    from astrai.algos.advantages import group_advantages
    from astrai.models import load_pretrained
    from astrai.train import main

    job, out = grpo_job(tmp_path, log_completions=4)
    assert main(["--config", str(job), "--model.path", str(tiny_model_dir), "--train.report_to", "tensorboard"]) == 0
    records, metrics = read_jsonl(out / "completions.jsonl"), read_jsonl(out / "metrics.jsonl")
    steps = by_step(records)
    assert sorted(steps) == [1, 2] and all(len(rows) == 4 for rows in steps.values())
    specials = load_pretrained(str(tiny_model_dir))[1].special_tokens
    for record in records:
        assert tuple(record) == COMPLETION_FIELDS
        text = record["completion"]
        assert record["rewards"]["length_score"] == pytest.approx(len(text) % 5 / 4)
        assert record["rewards"]["even_only"] == (None if len(text) % 2 else 1.0)
        expected = record["rewards"]["length_score"] + 0.5 * (record["rewards"]["even_only"] or 0.0)
        assert record["score"] == pytest.approx(expected, abs=1e-6)
        assert any(f"\n{q}\n" in record["prompt"] for q in QUESTIONS), record["prompt"]
        assert not any(token in record["prompt"] for token in specials), record["prompt"]
        assert isinstance(record["response_length"], int) and 1 <= record["response_length"] <= 6
    for metric in metrics:
        rows = steps[metric["step"]]
        assert [r["policy_version"] for r in rows] == [metric["rollout/policy_version"]] * 4
        scores = torch.tensor([r["score"] for r in rows])
        assert float(scores.mean()) == pytest.approx(metric["rollout/reward_mean"], abs=1e-6)
        lengths = torch.tensor([float(r["response_length"]) for r in rows])
        assert float(lengths.mean()) == pytest.approx(metric["rollout/response_length"])
        advantages = torch.tensor([r["advantage"] for r in rows])
        assert torch.allclose(advantages, group_advantages(scores, group_size=2), atol=1e-5)
        abs_mean = float((advantages.abs() * lengths).sum() / lengths.sum())  # a token mean over the rollout
        assert abs_mean == pytest.approx(metric["rollout/advantage_abs_mean"], abs=1e-5)
        assert rows[0]["prompt"] == rows[1]["prompt"] and rows[2]["prompt"] == rows[3]["prompt"]  # groups
    assert text_events(out) == {step: completions_markdown(rows) for step, rows in steps.items()}


def test_fewer_than_the_batch_are_the_first_group_logged_once_per_rollout_and_resume_drops_later_ones(
        tiny_model_dir, tmp_path):
    """N = 2 of 4 samples, 2 optimizer steps per rollout: 2 records (one group) at steps 1 and 3, tagged with the
    sampling weights' version. Resuming at step 2 (a rollout's end) drops the step-3 records and logs that rollout
    again, exactly; resuming at step 3 (mid-rollout) keeps them and logs nothing new."""
    from astrai.train import main

    job, out = grpo_job(tmp_path, log_completions=2, minibatch=2, max_steps=4, extra="checkpoint: {save_steps: 1}\n")
    assert main(["--config", str(job), "--model.path", str(tiny_model_dir), "--train.report_to", "none"]) == 0
    records = read_jsonl(out / "completions.jsonl")
    assert [(r["step"], r["policy_version"]) for r in records] == [(1, 0), (1, 0), (3, 2), (3, 2)]
    assert records[0]["prompt"] == records[1]["prompt"] and records[2]["prompt"] == records[3]["prompt"]
    straight = (out / "completions.jsonl").read_text()
    for step in (2, 3):
        again = tmp_path / f"again-{step}"
        shutil.copytree(out, again)
        checkpoint = again / "checkpoints" / f"step-{step:08d}"
        assert main(["--config", str(job), "--model.path", str(tiny_model_dir), "--train.output_dir", str(again),
                     "--train.report_to", "none", "--checkpoint.resume", str(checkpoint)]) == 0
        assert (again / "completions.jsonl").read_text() == straight, step  # 6 lines if nothing were dropped
        assert not list(again.glob("completions.*.jsonl"))


def test_online_ppo_logs_each_rollout(tiny_model_dir, tmp_path):
    """online_ppo, N = the rollout's 4 samples, 2 steps per rollout: records at steps 1 and 3 whose scores average to
    rollout/reward_mean; each advantage is its action tokens' mean, so (whitened over the rollout's tokens) their
    length-weighted mean is 0; the built-in reward is named in `rewards`. No file with log_completions 0."""
    from test_train_e2e import tiny_args

    from astrai.train import main

    out = tmp_path / "run"
    assert main(tiny_args(tiny_model_dir, out, "--max_steps", "4", "--train.log_completions", "4",
                          "--train.report_to", "none", "--checkpoint.save_at_end", "false")) == 0
    records, metrics = read_jsonl(out / "completions.jsonl"), read_jsonl(out / "metrics.jsonl")
    steps = by_step(records)
    assert sorted(steps) == [1, 3] and all(len(rows) == 4 for rows in steps.values())
    for step, rows in steps.items():
        (metric,) = [m for m in metrics if m["step"] == step]
        assert all(tuple(r) == COMPLETION_FIELDS for r in rows)
        assert all(set(r["rewards"]) == {"math_exact_match"} for r in rows)
        assert sum(r["score"] for r in rows) / 4 == pytest.approx(metric["rollout/reward_mean"], abs=1e-6)
        assert sum(r["response_length"] for r in rows) / 4 == pytest.approx(metric["rollout/response_length"])
        weighted = sum(r["advantage"] * r["response_length"] for r in rows) / sum(r["response_length"] for r in rows)
        assert weighted == pytest.approx(0.0, abs=1e-5)
        assert all(r["policy_version"] == metric["rollout/policy_version"] for r in rows)
    plain = tmp_path / "plain"
    assert main(tiny_args(tiny_model_dir, plain, "--max_steps", "1", "--train.report_to", "none",
                          "--checkpoint.save_at_end", "false")) == 0
    assert (plain / "metrics.jsonl").exists() and not (plain / "completions.jsonl").exists()


@pytest.mark.parametrize("check", [False, True])
def test_offline_train_types_refuse_it_in_one_line(tmp_path, capsys, check):
    """sft samples no rollout: the setting is refused (exit 2, one line naming it and the online train types) before
    anything loads, by the job and by --check; 0 is accepted and negative counts are refused by the config."""
    from astrai.config import ConfigError, load_config
    from astrai.train import main

    out = tmp_path / "run"
    code = main(["--train.type", "sft", "--train.log_completions", "2", "--train.output_dir", str(out),
                 "--model.path", str(tmp_path / "no-model"), *(["--check"] if check else [])])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err, err
    assert err == ("error: train.log_completions: shows the completions the online train types sample (online_ppo "
                   "and online_grpo); train.type sft samples none; set it to 0"), err
    assert not out.exists()
    assert load_config(None, ["--train.type", "sft"]).train.log_completions == 0
    with pytest.raises(ConfigError, match="train.log_completions"):
        load_config(None, ["--train.type", "online_grpo", "--train.log_completions", "-1"])


# ------------------------------------------------------------------------------------------------------ units
class FakeTrainer:
    """What the loggers read: the step, and a learner exposing samples once."""

    def __init__(self, step=0, samples=()):
        self.state = types.SimpleNamespace(global_step=step)
        self.learner = types.SimpleNamespace(pending=list(samples))
        self.learner.take_completions = lambda: [self.learner.pending.pop(0)] if self.learner.pending else []


def sample(completion="4", **rewards):
    return {"policy_version": 0, "prompt": "What is 2+2?", "completion": completion, "score": 1.0,
            "rewards": rewards or {"f": 1.0}, "advantage": 0.5, "response_length": 3}


def test_jsonl_file_keeps_an_old_run_and_cuts_a_resumed_one(tmp_path):
    path = tmp_path / "completions.jsonl"
    said = []
    lines = [json.dumps({"step": s, "x": s}) for s in (1, 2, 3)] + ['{"step": 4, "x']  # a torn last line
    path.write_text("\n".join(lines))
    resumed = JsonlFile(path, resume_step=2, printer=said.append)
    resumed.open()
    resumed.write({"step": 3, "x": 30})
    resumed.close()
    assert read_jsonl(path) == [{"step": 1, "x": 1}, {"step": 2, "x": 2}, {"step": 3, "x": 30}]
    fresh = JsonlFile(path, printer=said.append)
    fresh.open()
    fresh.close()
    (kept,) = tmp_path.glob("completions.*.jsonl")
    assert read_jsonl(kept)[-1] == {"step": 3, "x": 30} and path.read_text() == ""
    assert said == [f"{path}: skipped its torn last line (line 4: cut off while it was written, by a crash or a "
                    "full disk)", f"kept the previous run's completions as {kept}"]  # the torn line said once
    again = JsonlFile(path, printer=said.append)  # a second fresh start within the same second keeps both
    again.open()
    again.close()
    assert len(list(tmp_path.glob("completions.*.jsonl"))) == 2


def test_completions_logger_writes_each_rollout_once_and_feeds_the_reporters(tmp_path):
    seen = []
    reporter = types.SimpleNamespace(log_completions=lambda step, records: seen.append((step, records)))
    logger = CompletionsLogger(tmp_path, reporters=[reporter, object()], printer=lambda line: None)
    trainer = FakeTrainer(samples=[sample("a")])
    logger.on_train_begin(trainer)
    for step in (1, 2):
        trainer.state.global_step = step
        logger.on_step_end(trainer, {})
    logger.on_train_end(trainer)
    (record,) = read_jsonl(tmp_path / "completions.jsonl")
    assert record == {"step": 1, **sample("a")} and tuple(record) == COMPLETION_FIELDS
    assert seen == [(1, [record])]
    off = CompletionsLogger(tmp_path / "off", enabled=False)
    other = FakeTrainer(1, samples=[sample()])
    off.on_train_begin(other)
    off.on_step_end(other, {})
    off.on_train_end(other)
    assert not (tmp_path / "off").exists() and other.learner.pending == []  # taken, not written


def test_completion_table_and_markdown():
    records = [{"step": 1, **sample("x|<think>a*b</think>\nok", f=0.25, g=None)},
               {"step": 1, **sample("y", f=1.0)}]
    columns, rows = completion_table(records)
    assert columns == ["step", "policy_version", "prompt", "completion", "score", "rewards/f", "rewards/g",
                       "advantage", "response_length"]
    assert rows[0] == [1, 0, "What is 2+2?", "x|<think>a*b</think>\nok", 1.0, 0.25, None, 0.5, 3]
    assert rows[1][5:7] == [1.0, None]
    table = completions_markdown(records).splitlines()
    assert len(table) == 4 and table[1] == "|" + "---|" * 9
    assert table[2] == ("| 1 | 0 | What is 2+2? | x\\|&lt;think&gt;a\\*b&lt;/think&gt;<br>ok | 1 | 0.25 |  | 0.5 "
                        "| 3 |")


def test_tensorboard_text_and_wandb_table(tmp_path, monkeypatch):
    records = [{"step": 2, **sample("hello")}]
    board = TensorBoardLogger(tmp_path / "tb")
    board.on_train_begin(FakeTrainer())
    board.log_completions(2, records)
    board.on_train_end(FakeTrainer())
    assert text_events(tmp_path / "tb") == {2: completions_markdown(records)}

    calls = []

    class Table:
        def __init__(self, columns, data):
            self.columns, self.data = columns, data

    class Run:
        def log(self, record, step):
            calls.append((record, step))

        def finish(self):
            pass

    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.init, fake.Table = (lambda **kwargs: Run()), Table
    monkeypatch.setitem(sys.modules, "wandb", fake)
    (wandb_logger,) = build_reporters(["wandb"], tmp_path / "wb", {}, enabled=True)
    wandb_logger.on_train_begin(FakeTrainer())
    wandb_logger.log_completions(2, records)
    wandb_logger.on_train_end(FakeTrainer())
    ((logged, step),) = calls
    assert step == 2 and list(logged) == ["completions"]
    assert (logged["completions"].columns, logged["completions"].data) == completion_table(records)


def test_completion_samples_take_the_first_rows_without_padding():
    """`completion_samples` on a hand-made rollout: prompts decoded without their left padding, the advantage the
    mean over action tokens only, NaN rewards as None, at most the rows there are."""
    from astrai.data.sequences import Sequences
    from astrai.experience.result import RolloutResult
    from astrai.experience.trajectory import Experience
    from astrai.trainer.learners.policy_gradient import completion_samples

    seq = Sequences.from_tokens([[5, 6, 7], [8]], [[1, 2], [3, 4, 9]], pad_token_id=0)
    mask = seq.action_mask
    exp = Experience(sequences=seq, old_logprobs=torch.zeros(mask.shape), ref_logprobs=None,
                     scores=torch.tensor([1.0, 0.5]), responses=("ab", "cde"), policy_version=3,
                     reward_components={"f": torch.tensor([1.0, float("nan")])})
    advantages = torch.tensor([[0.5, 1.5, 99.0], [-1.0, -2.0, -3.0]]) * mask
    rollout = RolloutResult(sequences=seq, old_logprobs=exp.old_logprobs, ref_logprobs=None, values=None,
                            scores=exp.scores, kl=None, rewards=None, advantages=advantages, returns=None,
                            policy_version=3, responses=exp.responses, policy_versions=exp.policy_versions)
    decoded = []
    samples = completion_samples(exp, rollout, 5, lambda ids: decoded.append(ids) or f"p{len(ids)}")
    assert decoded == [[5, 6, 7], [8]]
    assert samples == [
        {"policy_version": 3, "prompt": "p3", "completion": "ab", "score": 1.0, "rewards": {"f": 1.0},
         "advantage": 1.0, "response_length": 2},
        {"policy_version": 3, "prompt": "p1", "completion": "cde", "score": 0.5, "rewards": {"f": None},
         "advantage": -2.0, "response_length": 3}]
    assert [s["completion"] for s in completion_samples(exp, rollout, 1, str)] == ["ab"]


def test_a_sample_continued_or_sampled_ahead_is_logged_with_the_oldest_version_that_sampled_it():
    """A trial found completions.jsonl logging the rollout's version (the one it trains at) for samples one step
    off, which older weights sampled: each record now names the oldest version among its own tokens (a partial
    rollout's continued sample spans several), and the rollout's version where it sampled nothing."""
    from astrai.data.sequences import Sequences
    from astrai.experience.result import RolloutResult
    from astrai.experience.trajectory import Experience
    from astrai.trainer.learners.policy_gradient import completion_samples

    seq = Sequences.from_tokens([[5], [6], [7]], [[1, 2], [3, 4, 9], [8]], pad_token_id=0)
    mask = seq.action_mask
    versions = torch.where(mask, torch.tensor([[4, 5, 0], [2, 2, 2], [-1, -1, -1]]), torch.tensor(-1))
    exp = Experience(sequences=seq, old_logprobs=torch.zeros(mask.shape), ref_logprobs=None,
                     scores=torch.zeros(3), responses=("a", "b", "c"), policy_version=6, policy_versions=versions)
    rollout = RolloutResult(sequences=seq, old_logprobs=exp.old_logprobs, ref_logprobs=None, values=None,
                            scores=exp.scores, kl=None, rewards=None, advantages=torch.zeros(mask.shape),
                            returns=None, policy_version=6, responses=exp.responses, policy_versions=versions)
    assert [s["policy_version"] for s in completion_samples(exp, rollout, 3, str)] == [4, 2, 6]


def test_a_resumed_jsonl_file_keeps_a_copy_when_it_drops_a_damaged_middle_line(tmp_path):
    """A resume rewrote metrics.jsonl without a line that was not JSON in the middle of it, so what that line held
    was gone (trial): the file as it was is kept beside it first, and the one line says where. A torn last line
    alone (a crash while writing) is dropped without a copy, as before."""
    path = tmp_path / "metrics.jsonl"
    said = []
    original = "\n".join([json.dumps({"step": 1}), "garbage{{", json.dumps({"step": 2}), json.dumps({"step": 3})])
    path.write_text(original + "\n")
    resumed = JsonlFile(path, resume_step=2, printer=said.append)
    resumed.open()
    resumed.close()
    (kept,) = tmp_path.glob("metrics.*.jsonl")
    assert kept.read_text() == original + "\n" and read_jsonl(path) == [{"step": 1}, {"step": 2}]
    assert said == [f"warning: {path}: skipped 1 line that is not one JSON object (line 2); the file as it was is "
                    f"kept as {kept}"]
