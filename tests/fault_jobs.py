"""Helpers of the fault tests (test_faults_*.py): a tiny sft job, its checkpoints and metrics, and real launched jobs
(torchrun with 2 CPU ranks) whose ranks can be found and signalled."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
LAUNCH = REPO / "launch"
SFT = REPO / "configs" / "examples" / "sft.yaml"


def write_chats(path: Path, n: int = 12) -> Path:
    """`n` short chats (the tiny tokenizer spells the built-in ones in more than 64 tokens)."""
    path.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"What is {i} + {i % 5}?"},
        {"role": "assistant", "content": f"{i} + {i % 5} = {i + i % 5}." + " Yes." * (i % 3)}]}) + "\n"
        for i in range(n)))
    return path


def sft_args(model_dir, out, data, *extra) -> list[str]:
    """A deterministic tiny sft job (2 chats per rank and step)."""
    return ["--config", str(SFT), "--model.path", str(model_dir), "--train.output_dir", str(out),
            "--data.path", str(data), "--data.max_length", "64", "--train.per_device_train_batch_size", "2",
            "--train.gradient_accumulation_steps", "1", "--train.progress_bar", "false",
            "--runtime.deterministic", "true", "--optim.learning_rate", "1e-3", *map(str, extra)]


def steps_of(out: Path) -> list[int]:
    """The steps of metrics.jsonl's records."""
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def checkpoint_steps(out: Path) -> list[int]:
    root = out / "checkpoints"
    return sorted(int(p.name.split("-")[1]) for p in root.iterdir() if p.name.startswith("step-")) \
        if root.is_dir() else []


def weights(out: Path, step: int) -> dict:
    """Policy weights and optimizer state of a checkpoint."""
    from safetensors.torch import load_file

    ckpt = out / "checkpoints" / f"step-{step:08d}"
    return {"policy": load_file(str(ckpt / "model.safetensors")),
            "optimizer": torch.load(ckpt / "optimizer.pt", weights_only=True)["state"]}


def assert_same(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), where
        for key in a:
            assert_same(a[key], b[key], f"{where}/{key}")
    else:
        assert a == b, where


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(args, *, nproc=2, env=None, extra=()) -> subprocess.Popen:
    """`python -m torch.distributed.run --nproc_per_node N [extra] -m astrai.train ARGS` started in the background,
    one OpenMP thread per rank, its own new session (so a test can signal the whole group)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(free_port()), *map(str, extra), "-m", "astrai.train", *map(str, args)]
    return subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def rank_pids(agent_pid: int, world: int, timeout: float = 120, attempt: int = 0) -> dict[int, int]:
    """{rank: pid} of the workers a torchrun agent started for its `attempt` (0: the first start, k: the k-th
    restart), read from their RANK and TORCHELASTIC_RESTART_COUNT environment variables."""
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = {}
        for child in psutil.Process(agent_pid).children(recursive=True):
            try:
                env = child.environ()
            except (psutil.Error, OSError):
                continue
            if "RANK" in env and env.get("TORCHELASTIC_RESTART_COUNT") == str(attempt):
                found[int(env["RANK"])] = child.pid
        if len(found) == world:
            return found
        time.sleep(0.2)
    raise AssertionError(f"torchrun {agent_pid} did not start {world} ranks")


def wait_for(predicate, timeout: float, what: str, proc=None):
    """Poll `predicate()` until it is truthy (returned) or `timeout` seconds pass (AssertionError naming `what`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the job ended (rc {proc.returncode}) before {what}:\n{proc.stdout.read()[-3000:]}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")
