"""Crash consistency of checkpoint publishing (issue 3 part 8).

A child process publishes checkpoints of a tiny model in a loop (every step twice, so half the publishes
replace an existing checkpoint; `keep_last=3` retention runs after each) and is SIGKILLed at a random
moment. Then: every visible `step-*` directory verifies (sha256); the newest checkpoints published
before the kill are still there (before recovery with the atomic exchange, after it with the retired
fallback); `recover()` leaves no staging/retired/deleting directory behind. Trials alternate between the
exchange protocol and the two-rename fallback, and the child pauses randomly around each rename so kills
also land between the protocol's steps. Children are forked from a forkserver that has torch
preloaded, so a trial costs well under a second.
"""

import multiprocessing as mp
import os
import random
import signal
import time
import traceback

import pytest
import torch

from astrai.checkpoint import checkpoints_root, list_checkpoints, recover, verify_checkpoint
from astrai.checkpoint.layout import parse_step

KEEP_LAST = 3
MAX_DELAY_S = 0.6


def _child(out_dir, log_path, use_exchange):
    """Publish forever: latest step again, then s+1, s+1, s+2, s+2, ... logging each completed publish."""
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        torch.set_num_threads(1)
        from astrai.checkpoint import Part, fsutil, publish_checkpoint
        from astrai.models import AutoRegressiveLM, ValueModel, tiny_config, tiny_tokenizer

        fsutil.EXCHANGE_SUPPORTED = None if use_exchange else False
        _widen_windows(fsutil)
        policy = AutoRegressiveLM(tiny_config())
        value = ValueModel.from_policy(policy)
        parts = {"policy": Part(policy, "hf_model"),
                 "tokenizer": Part(tiny_tokenizer(), "hf_tokenizer", required=False),
                 "value_model": Part(value), "optimizer": Part(torch.optim.SGD(policy.parameters(), lr=0.1)),
                 "value_optimizer": Part(torch.optim.SGD(value.parameters(), lr=0.1))}
        steps = [s for s, _ in list_checkpoints(out_dir)]
        step = steps[-1] if steps else 1
        os.write(log, b"ready\n")
        for i in range(10_000):
            with torch.no_grad():
                policy.lm_head.weight.add_(0.01)  # every publish has different content
            publish_checkpoint(out_dir, step, parts, metadata={"policy_version": step, "train_type": "online_ppo"},
                               keep_last=KEEP_LAST)
            os.write(log, f"{step}\n".encode())
            step += i % 2
    except BaseException:  # noqa: BLE001 - reported through the log
        os.write(log, ("error " + traceback.format_exc().replace("\n", " | ") + "\n").encode())
        raise


def _widen_windows(fsutil):
    """Fault injection (child only): random pauses around each rename/exchange, as on a slow filesystem,
    so that kills land between the protocol's steps more often than with microsecond-wide windows."""
    def slowed(fn):
        def wrapper(*args, **kwargs):
            time.sleep(random.uniform(0, 0.02))
            result = fn(*args, **kwargs)
            time.sleep(random.uniform(0, 0.02))
            return result
        return wrapper

    os.rename = slowed(os.rename)
    fsutil.exchange_dirs = slowed(fsutil.exchange_dirs)


def _visible(root):
    return {parse_step(p.name): p for p in root.iterdir() if parse_step(p.name) is not None} if root.is_dir() else {}


def _hidden(root):
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".")) if root.is_dir() else []


def _wait_ready(log_path, proc, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if os.path.exists(log_path) and open(log_path).read().startswith("ready"):
            return
        assert proc.is_alive(), "child died before publishing"
        time.sleep(0.005)
    raise AssertionError("child never became ready")


def _assert_consistent(root, known, *, exchange):
    """Every visible step dir verifies; the two newest known checkpoints are visible (with exchange)."""
    visible = _visible(root)
    for step, path in visible.items():
        report = verify_checkpoint(path, require_complete=True)
        assert report.exit_code == 0, f"{path} visible but broken: {report.lines()}"
    if exchange:
        assert set(known[-(KEEP_LAST - 1):]) <= set(visible), (known, sorted(visible), _hidden(root))


def _forkserver():
    """A forkserver context with torch (incl. torch._dynamo, which creating an optimizer imports), astrai
    and this module preloaded. Python 3.11's forkserver ignores the parent's sys.path, hence PYTHONPATH."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "astrai.checkpoint.publish", "astrai.checkpoint.load",
                                "astrai.models", __name__])
    here = os.path.dirname(os.path.abspath(__file__))
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, saved) if p)
    try:
        from multiprocessing import forkserver
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    return ctx


def run_trials(out_dir, n_trials, seed):
    """Run the harness; returns counts of what the kills left behind (for the report)."""
    ctx = _forkserver()
    rng = random.Random(seed)
    root = checkpoints_root(out_dir)
    stats = {"trials": 0, "publishes": 0, "left_staging": 0, "left_retired": 0, "left_deleting": 0,
             "restored": 0}
    for trial in range(n_trials):
        exchange = trial % 2 == 0
        known_before = sorted(_visible(root))
        log_path = str(out_dir / f"trial-{trial}.log")
        proc = ctx.Process(target=_child, args=(out_dir, log_path, exchange))
        proc.start()
        _wait_ready(log_path, proc)
        time.sleep(rng.uniform(0.0, MAX_DELAY_S))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        lines = open(log_path).read().split("\n")[1:]
        assert not [line for line in lines if line.startswith("error")], lines
        logged = [int(line) for line in lines if line.strip()]
        known = sorted(set(known_before) | set(logged))
        hidden = _hidden(root)
        for kind in ("staging", "retired", "deleting"):
            stats[f"left_{kind}"] += any(f".{kind}-" in h for h in hidden)
        _assert_consistent(root, known, exchange=exchange)
        actions = recover(out_dir)
        stats["restored"] += sum(a.startswith("restored") for a in actions)
        assert _hidden(root) == [], _hidden(root)
        _assert_consistent(root, known, exchange=True)
        stats["trials"] += 1
        stats["publishes"] += len(logged)
    return stats


def test_crash_consistency(tmp_path):
    stats = run_trials(tmp_path, 10, seed=0)
    print("crash harness:", stats)
    assert stats["trials"] == 10 and stats["publishes"] > 0


@pytest.mark.slow
def test_crash_consistency_many(tmp_path):
    stats = run_trials(tmp_path, 50, seed=1)
    print("crash harness:", stats)
    assert stats["trials"] == 50
    assert stats["left_staging"] > 0  # the kills do land inside the protocol
