"""The main job end to end on a tiny model: CLI, metrics.jsonl, checkpoint, resolved config, exit codes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from astrai.train import main

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "configs/examples/ppo.yaml"
REQUIRED = ("rollout/reward_mean", "rollout/kl", "rollout/logprob_gap", "policy/loss", "policy/clipfrac",
            "critic/loss", "critic/explained_variance", "policy_version")


def tiny_args(model_dir, out, *extra):
    return ["--config", str(EXAMPLE), "--model.path", str(model_dir), "--train.output_dir", str(out),
            "--max_steps", "3", "--rollout.batch_size", "4", "--ppo.minibatch_size", "2",
            "--ppo.micro_batch_size", "1", "--rollout.max_new_tokens", "6", "--train.progress_bar", "false",
            "--data.truncation", "left", *extra]  # the tiny tokenizer spells the example prompts in more tokens


def test_main_job_on_tiny_model(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(tiny_args(tiny_model_dir, out, "--ppo_gamma", "0.99", "--ppo_gae_lambda", "0.9",
                          "--ppo_vf_coef", "0.5")) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        missing = [k for k in REQUIRED if k not in record]
        assert not missing, missing
    assert [r["policy_version"] for r in records] == [1, 2, 3]
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert resolved["ppo"]["gamma"] == 0.99 and resolved["ppo"]["gae_lambda"] == 0.9
    assert resolved["ppo"]["vf_coef"] == 0.5
    ckpt = out / "checkpoints" / "step-00000003"
    for name in ("model.safetensors", "config.json", "tokenizer.json", "optimizer.pt", "scheduler.pt",
                 "value_model.pt", "value_optimizer.pt", "trainer_state.json", "rng_state.pt", "manifest.json"):
        assert (ckpt / name).is_file(), name
    assert json.loads((ckpt / "trainer_state.json").read_text())["policy_version"] == 3
    assert "model.embed_tokens.weight" in load_file(str(ckpt / "model.safetensors"))
    # the checkpoint holds the resolved job config, and its manifest the parts online_ppo needs to resume
    assert (ckpt / "config.yaml").read_text() == (out / "config.yaml").read_text()
    parts = json.loads((ckpt / "manifest.json").read_text())["parts"]
    required = {name for name, part in parts.items() if part["required"]}
    assert {"policy", "optimizer", "scheduler", "value_model", "value_optimizer", "value_scheduler", "data_sampler",
            "strategy_state", "trainer_state", "rng_state"} == required
    assert not parts["tokenizer"]["required"] and not parts["config"]["required"]
    printed = capsys.readouterr()
    assert "step 3/3" in printed.out + printed.err and "reward" in printed.out + printed.err


@pytest.mark.parametrize("args,needle", [
    (["--ppo_gamma", "1.5"], "ppo.gamma"),
    (["--ppo.gama", "0.9"], "ppo.gama"),
    (["--data.path", "/nonexistent/prompts.jsonl"], "/nonexistent/prompts.jsonl"),
    (["--model.path", "/nonexistent/model"], "/nonexistent/model"),
    (["--optim.learning_rate", ".inf"], "optim.learning_rate"),
    (["--max_steps", "0x_"], "train.max_steps"),
    (["--seed", "-1"], "train.seed"),
    (["--train.output_dir="], "train.output_dir"),
])
def test_bad_input_exits_2_with_one_line(tiny_model_dir, tmp_path, capsys, args, needle):
    out = tmp_path / "run"
    code = main(tiny_args(tiny_model_dir, out, *args))
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert needle in err and len(err.splitlines()) == 1, err


def test_accelerate_launch_one_cpu_process(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", ACCELERATE_USE_CPU="true")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--cpu",
           "-m", "astrai.train", *tiny_args(tiny_model_dir, out, "--max_steps", "1")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1
    assert (out / "checkpoints" / "step-00000001" / "value_model.pt").is_file()


def test_output_dir_that_is_a_file_exits_2_untouched(tiny_model_dir, tmp_path, capsys):
    target = tmp_path / "a-file"
    target.write_text("keep me")
    code = main(tiny_args(tiny_model_dir, target))
    err = capsys.readouterr().err.strip()
    assert code == 2 and "train.output_dir" in err and len(err.splitlines()) == 1, err
    assert target.read_text() == "keep me"


def test_resume_from_checkpoint_with_corrupt_header_exits_2(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(tiny_args(tiny_model_dir, out, "--max_steps", "1")) == 0
    weights = out / "checkpoints" / "step-00000001" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[20] ^= 0xFF  # inside the JSON header
    weights.write_bytes(bytes(data))
    capsys.readouterr()
    for verify in ("true", "false"):
        code = main(tiny_args(tiny_model_dir, out, "--max_steps", "2", "--checkpoint.resume", "auto",
                              "--checkpoint.verify_on_load", verify))
        err = capsys.readouterr().err.strip()
        assert code == 2 and "model.safetensors" in err and len(err.splitlines()) == 1, err


def test_help_lists_every_config_field(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    for flag in ("--config", "--ppo.gamma", "--ppo.gae_lambda", "--ppo.vf_coef", "--train.output_dir",
                 "--checkpoint.resume", "--optim.learning_rate"):
        assert flag in out, flag
