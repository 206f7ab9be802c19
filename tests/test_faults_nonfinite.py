"""Issue 28 part 6, the non-finite guard: a non-finite loss or gradient norm skips that optimizer step on every rank
(counted in train/skipped_steps; the weights, optimizer state, schedule and policy_version stay), too many in a row
stop the job with one line, non-finite weights are never published, and `resume auto` never picks a checkpoint
marked bad."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fault_jobs import REPO, assert_same, checkpoint_steps, free_port, sft_args, steps_of, weights, write_chats
from nan_driver import poisoned

from astrai.checkpoint import CheckpointError, Part, find_latest_checkpoint, publish_checkpoint
from astrai.checkpoint.layout import mark_bad
from astrai.train import main
from astrai.trainer.loop import Trainer

DRIVER = Path(__file__).parent / "nan_driver.py"


@pytest.fixture
def chats(tmp_path):
    return write_chats(tmp_path / "chats.jsonl")


def records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_nan_loss_skips_that_step_and_training_goes_on(tiny_model_dir, chats, tmp_path, monkeypatch, capsys):
    out, clean = tmp_path / "run", tmp_path / "clean"
    assert main(sft_args(tiny_model_dir, clean, chats, "--max_steps", 1, "--checkpoint.save_steps", 1)) == 0
    monkeypatch.setattr(Trainer, "accumulate_and_step", poisoned("2@0"))
    assert main(sft_args(tiny_model_dir, out, chats, "--max_steps", 3, "--checkpoint.save_steps", 1)) == 0
    err = capsys.readouterr().err
    assert "step 2: policy optimizer step skipped on every rank (a non-finite loss or gradient norm" in err
    logged = records(out)
    assert [r["train/skipped_steps"] for r in logged] == [0, 1, 1]
    assert [r["policy_version"] for r in logged] == [1, 1, 2]
    assert logged[1]["policy/lr"] == logged[2]["policy/lr"]  # the schedule did not move either
    assert all(torch.isfinite(torch.tensor(r["train/loss"])) for r in (logged[0], logged[2]))
    assert_same(weights(out, 1), weights(out, 2))  # step 2 changed nothing: weights and AdamW moments
    assert_same(weights(out, 1), weights(clean, 1))
    state = json.loads((out / "checkpoints/step-00000003/trainer_state.json").read_text())
    assert state["skipped_steps"] == 1 and state["policy_version"] == 2 and state["global_step"] == 3


def test_too_many_nonfinite_steps_in_a_row_stop_the_job_with_one_line(tiny_model_dir, chats, tmp_path, monkeypatch,
                                                                       capsys):
    out = tmp_path / "run"
    monkeypatch.setattr(Trainer, "accumulate_and_step", poisoned("2-99@0"))
    assert main(sft_args(tiny_model_dir, out, chats, "--max_steps", 10, "--checkpoint.save_steps", 1,
                         "--train.max_nonfinite_steps", 2)) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, errors
    assert "train.max_nonfinite_steps: 2 policy optimizer steps in a row had a non-finite loss or gradient norm " \
           "(the last at step 3, gradient norm nan)" in errors[0]
    assert checkpoint_steps(out) == [1, 2]  # step 3 raised before its checkpoint; nothing non-finite published
    assert steps_of(out) == [1, 2]  # metrics flushed up to the last completed step


def test_nonfinite_weights_are_never_published(tiny_model_dir, tmp_path):
    from astrai.checkpoint.safety import NonFiniteWeightsError
    from astrai.models import load_pretrained

    policy, _ = load_pretrained(tiny_model_dir)
    publish_checkpoint(tmp_path, 1, {"policy": Part(policy, "hf_model")}, run_id="r")
    critic = torch.nn.Linear(4, 1)
    with torch.no_grad():
        policy.lm_head.weight[0, 0] = float("inf")
        critic.bias.fill_(float("nan"))
    with pytest.raises(NonFiniteWeightsError) as err:
        publish_checkpoint(tmp_path, 2, {"policy": Part(policy, "hf_model"),
                                          "value_model": Part(critic, weights=True)}, run_id="r")
    tensors = len(policy.state_dict())
    assert str(err.value) == (f"non-finite weights are never published: policy: 1 of {tensors} tensors (first: "
                              "lm_head.weight); value_model: 1 of 2 tensors (first: bias) hold NaN or infinite values; "
                              "the last good checkpoint is step-00000001")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000001"]


def test_resume_auto_never_picks_a_checkpoint_marked_bad(tiny_model_dir, chats, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(sft_args(tiny_model_dir, out, chats, "--max_steps", 2, "--checkpoint.save_steps", 1)) == 0
    from astrai.checkpoint.__main__ import main as checkpoint_cli
    assert checkpoint_cli(["mark-bad", str(out / "checkpoints/step-00000002"), "--reason", "loss spiked after it"]) == 0
    with pytest.warns(UserWarning, match="marked bad"):
        assert find_latest_checkpoint(out).name == "step-00000001"
    capsys.readouterr()
    assert main(sft_args(tiny_model_dir, out, chats, "--max_steps", 3, "--checkpoint.resume", "auto")) == 0
    assert "resuming from " + str(out / "checkpoints/step-00000001") in capsys.readouterr().out
    with pytest.raises(CheckpointError, match="no manifest.json to mark"):
        mark_bad(tmp_path, "x")


def launched_nan(model_dir, out, chats, spec, *extra, nproc=2):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(free_port()), str(DRIVER), *sft_args(model_dir, out, chats, *extra)]
    import os
    return subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", "ASTRAI_TEST_NAN": spec}, cwd=REPO,
                          capture_output=True, text=True, timeout=600)


def two_rank_skip(model_dir, chats, tmp_path, strategy):
    """A NaN in rank 1's loss at step 2 only: both ranks skip step 2 (the same decision), train steps 1 and 3."""
    out = tmp_path / strategy
    proc = launched_nan(model_dir, out, chats, "2@1", "--max_steps", 3, "--checkpoint.save_steps", 1,
                        "--distributed.strategy", strategy)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    logged = records(out)
    assert [r["train/skipped_steps"] for r in logged] == [0, 1, 1]
    assert [r["policy_version"] for r in logged] == [1, 1, 2]
    from safetensors.torch import load_file
    one, two = (load_file(str(out / f"checkpoints/step-0000000{s}/model.safetensors")) for s in (1, 2))
    assert_same(one, two)
    assert "step 2: policy optimizer step skipped on every rank" in proc.stderr


def test_two_ranks_skip_the_same_step_ddp(tiny_model_dir, chats, tmp_path):
    two_rank_skip(tiny_model_dir, chats, tmp_path, "ddp")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp2", "zero1", "zero2", "zero3"])
def test_two_ranks_skip_the_same_step_sharded(tiny_model_dir, chats, tmp_path, strategy):
    two_rank_skip(tiny_model_dir, chats, tmp_path, strategy)
