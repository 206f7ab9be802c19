"""Issue 28 part 5, one job per output_dir: rank 0 holds an flock on `<output_dir>/train.lock` (host, pid, run id);
a second job, a real second process, refuses in one line naming the holder; a lock whose pid is gone but which a
forked child still holds is called stale; a job killed while holding the lock leaves a record the next job names."""

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from fault_jobs import REPO, sft_args, write_chats

from astrai.train import main
from astrai.checkpoint.lock import LOCK_NAME, OutputDirLock, OutputDirLocked

HOLD = """
import os, sys, time
from astrai.checkpoint.lock import OutputDirLock
lock = OutputDirLock(sys.argv[1])
lock.acquire(None if sys.argv[2] == "starting" else "run-held")  # starting: its run not resolved yet
if sys.argv[2] == "fork":  # a child inherits the open lock file; the parent (named in the record) exits at once
    if os.fork() == 0:
        print("child", os.getpid(), flush=True)
        time.sleep(120)
        os._exit(0)
    os._exit(0)
print("held", flush=True)
time.sleep(120)
"""


def hold(out, how="plain"):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(out), how], stdout=subprocess.PIPE, text=True, cwd=REPO)
    line = proc.stdout.readline().split()
    return proc, line


@pytest.fixture
def chats(tmp_path):
    return write_chats(tmp_path / "chats.jsonl")


def test_a_second_job_refuses_in_one_line_naming_the_holder(tiny_model_dir, chats, tmp_path, capsys):
    out = tmp_path / "run"
    holder, _ = hold(out)
    try:
        record = json.loads((out / LOCK_NAME).read_text())
        assert record["pid"] == holder.pid and record["host"] == socket.gethostname()
        assert record["run_id"] == "run-held"
        for extra in ((), ("--check",)):
            start = time.perf_counter()
            assert main([*extra, *sft_args(tiny_model_dir, out, chats, "--max_steps", 1)]) == 2
            took = time.perf_counter() - start
            (line,) = capsys.readouterr().err.strip().splitlines()
            assert line.startswith(f"error: train.output_dir {out} is in use by another job: run run-held (pid "
                                   f"{holder.pid} on host {socket.gethostname()}, since "), line
            assert "stale" not in line
        print(f"second job refused in {took:.2f} s")
        assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()
    assert main(sft_args(tiny_model_dir, out, chats, "--max_steps", 1)) == 0  # the kernel dropped the lock
    printed = capsys.readouterr().out
    assert f"the previous job in {out}, run run-held (pid {holder.pid}" in printed
    assert "ended without releasing its lock (killed or crashed); this job takes over" in printed
    assert not (out / LOCK_NAME).exists()  # released and removed at the end of the run


def test_the_lock_names_the_run_once_it_is_resolved(tiny_model_dir, chats, tmp_path, monkeypatch):
    """A user trial: train.lock held `"run_id": null` for the whole run, so a second job read `run ? (pid ...)`.
    The run id is recorded as soon as the run is resolved (a fresh start's and a resume's), before the first step."""
    from astrai.trainer import callbacks

    seen = []
    logged = callbacks.MetricsLogger.on_step_end

    def on_step_end(self, trainer, metrics):
        logged(self, trainer, metrics)
        seen.append(json.loads((out / LOCK_NAME).read_text()))

    monkeypatch.setattr(callbacks.MetricsLogger, "on_step_end", on_step_end)
    out = tmp_path / "run"
    assert main(sft_args(tiny_model_dir, out, chats, "--max_steps", 1)) == 0
    assert main(sft_args(tiny_model_dir, out, chats, "--max_steps", 2, "--checkpoint.resume", "auto")) == 0
    run_id = json.loads((out / "run.json").read_text())["run_id"]
    assert [record["run_id"] for record in seen] == [run_id, run_id] and run_id
    assert all(record["pid"] == os.getpid() for record in seen)
    assert not (out / LOCK_NAME).exists()


def test_a_holder_without_a_run_yet_is_not_called_run_question_mark(tiny_model_dir, chats, tmp_path, capsys):
    out = tmp_path / "run"
    holder, _ = hold(out, "starting")
    try:
        assert main(sft_args(tiny_model_dir, out, chats, "--max_steps", 1)) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"error: train.output_dir {out} is in use by another job: a job (pid {holder.pid} on "
                               f"host {socket.gethostname()}, since "), line
        assert "run ?" not in line
    finally:
        holder.kill()
        holder.wait()


def test_naming_the_run_on_a_full_disk_keeps_the_record_whole(tmp_path, monkeypatch):
    from astrai.checkpoint import lock as lock_module

    lock = OutputDirLock(tmp_path)
    assert lock.acquire(None) is None
    before = (tmp_path / LOCK_NAME).read_text()
    real = lock_module.os.pwrite

    def full(fd, data, offset):  # the record naming the run: part of it written, then ENOSPC
        if b"run-1" in data:
            real(fd, data[:10], offset)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data, offset)

    monkeypatch.setattr(lock_module.os, "pwrite", full)
    lock.name_run("run-1")  # best effort: the record only informs
    monkeypatch.undo()
    assert (tmp_path / LOCK_NAME).read_text() == before
    lock.name_run("run-1")
    assert json.loads((tmp_path / LOCK_NAME).read_text())["run_id"] == "run-1"
    lock.release()


def test_a_lock_held_by_a_child_of_a_dead_job_is_called_stale(tmp_path):
    out = tmp_path / "run"
    proc, (_, child) = hold(out, "fork")
    proc.wait()
    try:
        with pytest.raises(OutputDirLocked) as err:
            OutputDirLock(out).acquire("mine")
        assert f"(stale: pid {proc.pid} is not running on this host, so a process it started still holds the lock" \
               in str(err.value)
    finally:
        os.kill(int(child), signal.SIGKILL)
    time.sleep(0.2)
    lock = OutputDirLock(out)
    assert "ended without releasing its lock" in lock.acquire("mine")  # free again; the dead job's record is said
    lock.release()
