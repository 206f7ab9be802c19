"""Issue 28 part 2, automatic restart: a restarted job resumes itself (the launch recorded in run.json: a Slurm job id
kept across requeues, a torchrun agent across its restarts), and `launch/torchrun.sh --max_restarts N` (c10d
rendezvous, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) survives several killed ranks in a row, ending bit for bit where an
uninterrupted run ends."""

import json
import os
import signal
import subprocess
import sys

import pytest
from fault_jobs import (LAUNCH, REPO, assert_same, checkpoint_steps, free_port, rank_pids, sft_args, steps_of,
                        torchrun, wait_for, weights, write_chats)

from astrai.train import main


@pytest.fixture
def chats(tmp_path):
    return write_chats(tmp_path / "chats.jsonl")


def test_a_requeued_slurm_job_resumes_itself(tiny_model_dir, chats, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert main(sft_args(tiny_model_dir, out, chats, "--max_steps", 2)) == 0
    assert json.loads((out / "run.json").read_text())["launch_id"] == "slurm:4242"
    capsys.readouterr()
    # the same job again (requeued), its job file still saying resume none: it continues its run
    assert main(sft_args(tiny_model_dir, out, chats, "--max_steps", 4)) == 0
    printed = capsys.readouterr().out
    assert "restart of the same job (slurm:4242): checkpoint.resume none becomes auto" in printed
    assert "resuming from " + str(out / "checkpoints/step-00000002") in printed
    # another Slurm job in the same directory is a fresh start, refused as before (it would mix two runs)
    monkeypatch.setenv("SLURM_JOB_ID", "4243")
    assert main(sft_args(tiny_model_dir, out, chats, "--max_steps", 6)) == 2
    assert "already holds 2 checkpoint(s)" in capsys.readouterr().err


@pytest.mark.slow
def test_torchrun_restarts_after_killed_ranks_and_ends_exactly(tiny_model_dir, chats, tmp_path):
    straight, restarted = tmp_path / "straight", tmp_path / "restarted"
    steps = 30
    args = ("--max_steps", steps, "--checkpoint.save_steps", 1, "--checkpoint.keep_last", 2)
    proc = torchrun(sft_args(tiny_model_dir, straight, chats, *args))
    assert proc.wait(timeout=600) == 0, proc.stdout.read()[-3000:]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRAIN_CHECK": "0", "TRAIN_PYTHON": sys.executable,
           "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    job = subprocess.Popen(["bash", str(LAUNCH / "torchrun.sh"), "--nproc_per_node", "2", "--max_restarts", "3",
                            "--master_port", str(free_port()), *sft_args(tiny_model_dir, restarted, chats, *args)[1:]],
                           env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    killed = []
    try:
        for attempt in range(3):  # kill rank 1 once each attempt has published a checkpoint of its own
            seen = max(checkpoint_steps(restarted), default=0)
            ranks = rank_pids(job.pid, 2, attempt=attempt)
            wait_for(lambda: max(checkpoint_steps(restarted), default=0) > seen, 300, f"attempt {attempt}", job)
            os.kill(ranks[1], signal.SIGKILL)
            killed.append(max(checkpoint_steps(restarted)))
        rc = job.wait(timeout=600)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    log = job.stdout.read()
    print(f"killed rank 1 after checkpoints {killed}")
    assert rc == 0, log[-4000:]
    assert log.count("checkpoint.resume none becomes auto") == 3, log[-4000:]
    assert max(killed) < steps
    assert_same(weights(straight, steps), weights(restarted, steps))
    assert steps_of(restarted)[-1] == steps
