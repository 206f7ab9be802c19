"""Sharded training with 2 processes over gloo on CPU (`torch.distributed.run`, one thread each): online_ppo and sft
under ddp, fsdp2, zero2 and zero3 train, checkpoint and resume; a resume (in the middle of a PPO rollout) is bitwise
exact; every engine's parameters stay within float rounding of ddp's after the same steps.

The default tier runs one sharded engine per train type (fsdp2 for sft, zero3 for online_ppo: the two that
partition parameters); the slow tier (`pytest -m slow`) runs the full engine x train-type matrix.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
ENGINES = ("ddp", "fsdp2", "zero2", "zero3")

pytest.importorskip("deepspeed")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(*args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run --nproc_per_node N -m astrai.train ARGS` with one thread per rank."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "astrai-torch-extensions"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(free_port()), "-m", "astrai.train", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    path = tmp_path_factory.mktemp("chats") / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                                                     {"role": "assistant", "content": f"{i} + {i} = {2 * i}."}]})
                            + "\n" for i in range(16)))
    return path


def sft_args(model_dir, data, out, engine, *extra):
    return ["--config", str(REPO / "configs/examples/sft.yaml"), "--model.path", str(model_dir), "--data.path",
            str(data), "--train.output_dir", str(out), "--max_steps", "4", "--train.per_device_train_batch_size", "2",
            "--data.max_length", "64", "--train.progress_bar", "false", "--distributed.strategy", engine,
            "--checkpoint.save_steps", "1", "--checkpoint.keep_last", "4", "--runtime.deterministic", "true", *extra]


def ppo_args(model_dir, out, engine, *extra):
    return ["--config", str(REPO / "configs/examples/ppo.yaml"), "--model.path", str(model_dir),
            "--train.output_dir", str(out), "--max_steps", "4", "--rollout.batch_size", "4",
            "--ppo.minibatch_size", "2", "--ppo.micro_batch_size", "1", "--rollout.max_new_tokens", "6",
            "--train.progress_bar", "false", "--data.truncation", "left", "--distributed.strategy", engine,
            "--checkpoint.save_steps", "1", "--checkpoint.keep_last", "4", "--runtime.deterministic", "true", *extra]


def final(out: Path, critic: bool) -> dict:
    ckpt = out / "checkpoints" / "step-00000004"
    state = {"policy": load_file(str(ckpt / "model.safetensors"))}
    if critic:
        state["critic"] = torch.load(ckpt / "value_model.pt", weights_only=True)
    return state


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[part][k] - b[part][k]).abs().max()) for part in a for k in a[part])


def run_and_resume(make_args, tmp_path, engine, *, critic: bool) -> tuple[dict, dict]:
    """4 steps straight; then a copy of its step-3 checkpoint resumed to step 4. Returns both final states."""
    straight, resumed = tmp_path / f"{engine}-straight", tmp_path / f"{engine}-resumed"
    done = torchrun(*make_args(straight, engine))
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = json.loads((straight / "checkpoints/step-00000003/manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["parts"]["rng_state"]["per_rank"]
    (resumed / "checkpoints").mkdir(parents=True)
    os.system(f"cp -r {straight}/checkpoints/step-00000003 {resumed}/checkpoints/")
    done = torchrun(*make_args(resumed, engine, "--checkpoint.resume", "auto"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming from" in done.stdout
    return final(straight, critic), final(resumed, critic)


@pytest.mark.parametrize("engine", ["fsdp2", pytest.param("ddp", marks=pytest.mark.slow),
                                    pytest.param("zero2", marks=pytest.mark.slow),
                                    pytest.param("zero3", marks=pytest.mark.slow)])
def test_sft_trains_checkpoints_and_resumes_exactly(tiny_model_dir, chats, tmp_path, engine):
    a, b = run_and_resume(lambda out, e, *x: sft_args(tiny_model_dir, chats, out, e, *x), tmp_path, engine,
                          critic=False)
    assert max_diff(a, b) == 0.0


@pytest.mark.parametrize("engine", ["zero3", pytest.param("ddp", marks=pytest.mark.slow),
                                    pytest.param("fsdp2", marks=pytest.mark.slow),
                                    pytest.param("zero2", marks=pytest.mark.slow)])
def test_online_ppo_resumes_mid_rollout_exactly(tiny_model_dir, tmp_path, engine):
    """Step 3 is the first minibatch of the second rollout: the checkpoint holds a rollout in flight."""
    a, b = run_and_resume(lambda out, e, *x: ppo_args(tiny_model_dir, out, e, *x), tmp_path, engine, critic=True)
    assert max_diff(a, b) == 0.0
    records = [json.loads(line) for line in (tmp_path / f"{engine}-straight" / "metrics.jsonl").read_text().splitlines()]
    assert max(r["rollout/logprob_gap"] for r in records) < 1e-5  # the engine held each step's gathered weights


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sft", "ppo"])
def test_engines_agree_with_ddp(tiny_model_dir, chats, tmp_path, kind):
    states = {}
    for engine in ENGINES:
        out = tmp_path / engine
        args = sft_args(tiny_model_dir, chats, out, engine) if kind == "sft" else ppo_args(tiny_model_dir, out, engine)
        done = torchrun(*args)
        assert done.returncode == 0, done.stderr[-3000:]
        states[engine] = final(out, critic=kind == "ppo")
    for engine in ENGINES[1:]:
        assert max_diff(states[engine], states["ddp"]) < 1e-6, engine
