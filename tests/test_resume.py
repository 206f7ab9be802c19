"""Exact resume: 4 steps straight == 2 steps + resume + 2 steps (online_ppo, sft; CPU, fp32, deterministic)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_train_e2e import EXAMPLE, tiny_args

from astrai.train import main
from astrai.trainer.loop import Trainer


def run(model_dir, out, *extra):
    assert main(tiny_args(model_dir, out, "--runtime.deterministic", "true", "--seed", "7",
                          "--optim.lr_scheduler_type", "cosine", "--optim.warmup_steps", "1", *extra)) == 0


def interrupt_after(monkeypatch, steps):
    """Make the next job stop (and publish its end checkpoint) after `steps` steps, as if it were killed
    there, while everything else (LR schedule length, data) is built for the full `max_steps`."""
    fit = Trainer.fit

    def short_fit(self):
        self.state.max_steps = steps
        return fit(self)

    monkeypatch.setattr(Trainer, "fit", short_fit)


def final_state(out, step, critic=True):
    """Policy weights, optimizer moments (and critic + its optimizer) and counters of a checkpoint."""
    ckpt = out / "checkpoints" / f"step-{step:08d}"
    from safetensors.torch import load_file
    state = {
        "policy": load_file(str(ckpt / "model.safetensors")),
        "optimizer": torch.load(ckpt / "optimizer.pt", weights_only=True)["state"],
        "trainer_state": json.loads((ckpt / "trainer_state.json").read_text()),
    }
    if critic:
        state["value_model"] = torch.load(ckpt / "value_model.pt", weights_only=True)
        state["value_optimizer"] = torch.load(ckpt / "value_optimizer.pt", weights_only=True)["state"]
    return state


def assert_same(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), where
        for key in a:
            assert_same(a[key], b[key], f"{where}/{key}")
    else:
        assert a == b, where


@pytest.mark.parametrize("minibatch", ["2", "4"])  # 2: the checkpoint falls mid-rollout; 4: at its end
def test_online_ppo_resume_is_bitwise_exact(tiny_model_dir, tmp_path, monkeypatch, minibatch):
    straight, split = tmp_path / "straight", tmp_path / "split"
    run(tiny_model_dir, straight, "--max_steps", "4", "--ppo.minibatch_size", minibatch)
    interrupt_after(monkeypatch, 2)
    run(tiny_model_dir, split, "--max_steps", "4", "--ppo.minibatch_size", minibatch)
    monkeypatch.undo()
    run(tiny_model_dir, split, "--max_steps", "4", "--ppo.minibatch_size", minibatch,
        "--checkpoint.resume", "auto")
    a, b = final_state(straight, 4), final_state(split, 4)
    for key in ("policy", "value_model", "optimizer", "value_optimizer"):
        assert_same(a[key], b[key], key)
    assert a["trainer_state"]["policy_version"] == b["trainer_state"]["policy_version"] == 4
    steps = [json.loads(l)["step"] for l in (split / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    rewards = lambda out: [json.loads(l)["rollout/reward_mean"] for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert rewards(straight) == rewards(split)


def test_resume_without_critic_extras_fails_naming_the_file(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    run(tiny_model_dir, out, "--max_steps", "1")
    ckpt = out / "checkpoints" / "step-00000001"
    (ckpt / "value_optimizer.pt").unlink()
    code = main(tiny_args(tiny_model_dir, out, "--max_steps", "2", "--checkpoint.resume", str(ckpt)))
    err = capsys.readouterr().err
    assert code == 2 and "value_optimizer.pt" in err and len(err.strip().splitlines()) == 1


def test_resume_auto_without_checkpoint_starts_fresh_and_keeps_old_metrics(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    run(tiny_model_dir, out, "--max_steps", "1", "--checkpoint.save_at_end", "false")
    run(tiny_model_dir, out, "--max_steps", "1", "--checkpoint.resume", "auto")
    kept = list(out.glob("metrics.*.jsonl"))
    assert len(kept) == 1 and len((out / "metrics.jsonl").read_text().splitlines()) == 1


def sft_args(model_dir, out, data, *extra):
    return ["--config", str(EXAMPLE.parent / "sft.yaml"), "--model.path", str(model_dir),
            "--train.output_dir", str(out), "--data.path", str(data), "--train.per_device_train_batch_size", "2",
            "--train.gradient_accumulation_steps", "1", "--data.max_length", "64", "--train.progress_bar", "false",
            "--runtime.deterministic", "true", *extra]


@pytest.mark.parametrize("rows", [4, 6])  # 4 rows = 2 steps per epoch: the split lands on an epoch boundary
def test_sft_resume_is_bitwise_exact_including_epoch_boundary(tiny_model_dir, tmp_path, monkeypatch, rows):
    lines = [json.dumps({"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                                      {"role": "assistant", "content": f"{i} + {i} = {2 * i}."}]})
             for i in range(rows)]
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(lines) + "\n")
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main(sft_args(tiny_model_dir, straight, data, "--max_steps", "4")) == 0
    interrupt_after(monkeypatch, 2)
    assert main(sft_args(tiny_model_dir, split, data, "--max_steps", "4")) == 0
    monkeypatch.undo()
    assert main(sft_args(tiny_model_dir, split, data, "--max_steps", "4", "--checkpoint.resume", "auto")) == 0
    a, b = final_state(straight, 4, critic=False), final_state(split, 4, critic=False)
    for key in ("policy", "optimizer"):
        assert_same(a[key], b[key], key)
    steps = [json.loads(l)["step"] for l in (split / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]  # the resumed run did its two steps (the next epoch), not zero


FIXTURE = Path(__file__).parent / "fixtures" / "checkpoint_before_parts"


def test_checkpoint_written_before_parts_were_recorded_still_resumes(tiny_model_dir, tmp_path):
    """A real checkpoint of the earlier layout (made by commit fc969cb with `tiny_args(..., "--max_steps", "1",
    "--runtime.deterministic", "true", "--seed", "7")` on the same tiny model): no "parts" in its manifest, rank 0's
    data position inside trainer_state.json, the strategy state in strategy_state.pt, a rollout in flight (one of
    its two minibatches replayed). It verifies as complete and resumes: counters, data position and the rollout."""
    out = tmp_path / "run"
    shutil.copytree(FIXTURE, out / "checkpoints" / "step-00000001")
    verify = subprocess.run([sys.executable, "-m", "astrai.checkpoint", "verify", "--require-critic",
                             str(out / "checkpoints" / "step-00000001")], capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    old = json.loads(FIXTURE.with_name(FIXTURE.name + ".metrics.jsonl").read_text().splitlines()[0])
    assert main(tiny_args(tiny_model_dir, out, "--max_steps", "2", "--runtime.deterministic", "true", "--seed", "7",
                          "--checkpoint.resume", "auto")) == 0
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["step"] == 2 and record["policy_version"] == 2
    # the second minibatch of the restored rollout: same rollout (its pinned metrics), no new prompts drawn
    assert record["rollout/policy_version"] == 0.0
    for key in ("rollout/returns_mean", "rollout/kl", "rollout/response_length", "rollout/logprob_gap"):
        assert record[key] == old[key], key
    state = final_state(out, 2)["trainer_state"]
    assert state["consumed_samples"] == 4 and state["global_step"] == 2
    sampler = json.loads((out / "checkpoints" / "step-00000002" / "data_sampler.json").read_text())
    assert (sampler["epoch"], sampler["position"]) == (0, 4)


def test_learning_rate_logged_is_the_one_applied(tiny_model_dir, tmp_path):
    """With 2 warmup steps the first step applies half the peak rate; AdamW's first update moves every parameter
    with a gradient by about the learning rate (m / sqrt(v) = sign(g) after bias correction, no weight decay), so
    the weight change measures the rate the step used, and the log must show that rate, not the next step's."""
    from safetensors.torch import load_file

    lines = [json.dumps({"messages": [{"role": "user", "content": f"{i} + {i}?"},
                                      {"role": "assistant", "content": f"{2 * i}"}]}) for i in range(4)]
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(lines) + "\n")
    out = tmp_path / "run"
    assert main(sft_args(tiny_model_dir, out, data, "--max_steps", "3", "--optim.warmup_steps", "2",
                         "--optim.learning_rate", "1e-3", "--optim.weight_decay", "0", "--optim.max_grad_norm",
                         "1e9", "--checkpoint.save_steps", "1")) == 0
    logged = [json.loads(line)["policy/lr"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert logged == pytest.approx([5e-4, 1e-3, 1e-3], rel=1e-6)
    before = load_file(str(tiny_model_dir / "model.safetensors"))
    after = load_file(str(out / "checkpoints" / "step-00000001" / "model.safetensors"))
    moved = max(float((after[k] - before[k]).abs().max()) for k in before)
    assert moved == pytest.approx(5e-4, rel=0.01)


def test_resume_refusals_come_from_the_manifest_before_anything_loads(tiny_model_dir, tmp_path, monkeypatch,
                                                                      capsys):
    """`check_resume` refuses from the manifest alone (another train type, another engine, ZeRO partitions of
    another world size), so `build_trainer` and `--check` refuse before the model loads or an engine is built."""
    from astrai.checkpoint import CheckpointError, Part, publish_checkpoint
    from astrai.models import load_pretrained
    from astrai.train import main
    from astrai.trainer.resume import check_resume

    policy, tokenizer = load_pretrained(tiny_model_dir)
    parts = {"policy": Part(policy, "hf_model")}
    zero = publish_checkpoint(tmp_path / "z", 1, parts, metadata={"policy_version": 1, "train_type": "sft",
                                                                   "distributed_strategy": "zero2"})
    fsdp = publish_checkpoint(tmp_path / "f", 1, parts, metadata={"policy_version": 1, "train_type": "sft",
                                                                   "distributed_strategy": "fsdp2"})
    from astrai.config import config_from_dict
    sft, dpo = (config_from_dict({"train": {"type": kind}}) for kind in ("sft", "dpo"))
    assert check_resume(zero, config=sft, world_size=1, strategy="zero2").world_size == 1
    assert check_resume(fsdp, config=sft, world_size=2, strategy="fsdp2").world_size == 1  # reshardable
    for path, kwargs, needle in (
            (zero, dict(config=sft, world_size=2, strategy="zero2"),
             "written by 1 ranks, this job has 2: the DeepSpeed ZeRO optimizer partitions cannot be resharded"),
            (zero, dict(config=sft, world_size=1, strategy="fsdp2"), "written under distributed.strategy zero2"),
            (fsdp, dict(config=dpo, world_size=1, strategy="fsdp2"), "checkpoint of train type 'sft'")):
        with pytest.raises(CheckpointError, match=needle):
            check_resume(path, **kwargs)

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr("astrai.trainer.build.load_model", no_model)
    monkeypatch.setenv("WORLD_SIZE", "2")
    chats = tmp_path / "chats.jsonl"
    chats.write_text('{"messages": [{"role": "user", "content": "1?"}, {"role": "assistant", "content": "1"}]}\n')
    code = main(["--check", "--config", str(Path(__file__).resolve().parents[1] / "configs/examples/sft.yaml"), "--model.path", str(tiny_model_dir),
                 "--data.path", str(chats), "--distributed.strategy", "zero2", "--train.output_dir",
                 str(tmp_path / "out"), "--checkpoint.resume", str(zero)])
    assert code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "the DeepSpeed ZeRO optimizer partitions cannot be resharded" in line


def test_online_grpo_with_dynamic_sampling_resumes_bitwise_exact(tiny_model_dir, tmp_path, monkeypatch):
    """Several sampling rounds per rollout (a reward on the response's length parity, so some groups differ and
    some do not): the data position and sampling RNG after them resume exactly, mid-rollout."""
    from astrai.rewards import builtins as rewards
    monkeypatch.setitem(rewards.BUILTIN_REWARDS, "math_exact_match", rewards.BuiltinReward(
        lambda prompts, completions, format_bonus=0.0, partial_credit=0.0, **_: [float(len(c) % 2) for c in completions],
        "toy: length parity"))
    grpo = ("--max_steps", "4", "--train.type", "online_grpo", "--rollout.batch_size", "2", "--grpo.group_size", "2",
            "--grpo.minibatch_size", "2", "--grpo.micro_batch_size", "1", "--rollout.dynamic_sampling", "true",
            "--rollout.max_sampling_rounds", "3")
    straight, split = tmp_path / "straight", tmp_path / "split"
    run(tiny_model_dir, straight, *grpo)
    fit = Trainer.fit

    def short_fit(self):
        self.state.max_steps = 1
        return fit(self)

    monkeypatch.setattr(Trainer, "fit", short_fit)
    run(tiny_model_dir, split, *grpo)
    monkeypatch.setattr(Trainer, "fit", fit)
    run(tiny_model_dir, split, *grpo, "--checkpoint.resume", "auto")
    a, b = final_state(straight, 4, critic=False), final_state(split, 4, critic=False)
    for key in ("policy", "optimizer"):
        assert_same(a[key], b[key], key)
    def records(out):
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    assert [r["rollout/reward_mean"] for r in records(straight)] == [r["rollout/reward_mean"] for r in records(split)]
    rounds = [r["rollout/sampling_rounds"] for r in records(straight)]
    assert all(1 <= n <= 3 for n in rounds) and max(rounds) > 1, rounds


def test_resume_at_max_steps_says_there_is_nothing_to_train(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    run(tiny_model_dir, out, "--max_steps", "1")
    before = (out / "metrics.jsonl").read_text()
    manifest = (out / "checkpoints" / "step-00000001" / "manifest.json").read_text()
    capsys.readouterr()
    run(tiny_model_dir, out, "--max_steps", "1", "--checkpoint.resume", "auto")
    printed = capsys.readouterr().out
    assert "nothing to train: the checkpoint is at step 1 and train.max_steps is 1" in printed
    assert (out / "metrics.jsonl").read_text() == before
    # the checkpoint it resumed from is not published again
    assert (out / "checkpoints" / "step-00000001" / "manifest.json").read_text() == manifest
