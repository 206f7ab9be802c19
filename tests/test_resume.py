"""Exact resume: 4 steps straight == 2 steps + resume + 2 steps (online_ppo, sft; CPU, fp32, deterministic)."""

import json
import shutil

import pytest
import torch

from astrai.checkpoint import CheckpointError
from astrai.train import main
from astrai.trainer.loop import Trainer
from test_train_e2e import EXAMPLE, tiny_args


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
