"""Issue 28 part 1, preemption: SIGTERM, SIGINT and SIGUSR1 only set a flag; the ranks agree at the next step
boundary, every rank publishes the same step, the job exits with code 75; more signals during the save change
nothing; the resumed run ends bit for bit where an uninterrupted one does (CPU, fp32, deterministic)."""

import json
import os
import signal
import time

import pytest
from fault_jobs import (REPO, assert_same, checkpoint_steps, free_port, rank_pids, sft_args, steps_of, torchrun,
                        wait_for, weights, write_chats)

from astrai.checkpoint import verify_checkpoint
from astrai.train import main
from astrai.trainer import callbacks
from astrai.trainer.faults import EXIT_PREEMPTED


@pytest.fixture
def chats(tmp_path):
    return write_chats(tmp_path / "chats.jsonl")


def signal_at_step(monkeypatch, step: int, signum: int) -> None:
    """Deliver a real `signal` to this process when the metrics logger records step `step` (in that step's
    callbacks, after its boundary: the ranks agree again after the callbacks and stop at that step)."""
    logged = callbacks.MetricsLogger.on_step_end

    def on_step_end(self, trainer, metrics):
        logged(self, trainer, metrics)
        if trainer.state.global_step == step:
            os.kill(os.getpid(), signum)

    monkeypatch.setattr(callbacks.MetricsLogger, "on_step_end", on_step_end)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1])
def test_a_signal_stops_at_a_step_boundary_publishes_and_resumes_exactly(tiny_model_dir, chats, tmp_path,
                                                                         monkeypatch, capfd, signum):
    straight, split = tmp_path / "straight", tmp_path / "split"
    before = signal.getsignal(signum)  # SIG_IGN for SIGINT when the suite runs in a background job
    assert main(sft_args(tiny_model_dir, straight, chats, "--max_steps", 6)) == 0
    signal_at_step(monkeypatch, 2, signum)
    start = time.perf_counter()
    assert main(sft_args(tiny_model_dir, split, chats, "--max_steps", 6)) == EXIT_PREEMPTED
    print(f"signal -> exit: {time.perf_counter() - start:.2f} s (whole run)")
    monkeypatch.undo()
    assert checkpoint_steps(split) == [2] and steps_of(split) == [1, 2]  # not one more step (issue 42, class 5)
    state = json.loads((split / "checkpoints/step-00000002/trainer_state.json").read_text())
    assert state["stopped_by"] == signal.Signals(signum).name
    out = capfd.readouterr()
    assert f"stopped by {signal.Signals(signum).name} after 2 steps, with a checkpoint of step 2; exit code 75" \
        in out.out
    assert f"rank 0: {signal.Signals(signum).name} received: stopping at the end of this optimizer step" in out.err
    assert signal.getsignal(signum) == before  # handlers put back
    assert main(sft_args(tiny_model_dir, split, chats, "--max_steps", 6, "--checkpoint.resume", "auto")) == 0
    assert_same(weights(straight, 6), weights(split, 6))
    assert steps_of(split) == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("save_at_end", ["true", "false"])
def test_a_signal_during_the_last_step_completes_the_run_and_says_so(tiny_model_dir, chats, tmp_path, monkeypatch,
                                                                     capfd, save_at_end):
    """A user trial: SIGTERM during the last optimizer step printed "... then exiting with code 75", then "done: 5
    steps" and exited 0. The run finished its last step and publishes it (the signal's promise, even with
    checkpoint.save_at_end false), so it is complete: exit 0 (a scheduler must not requeue it, as it would on 75)
    with a line that says so, and nothing to resume."""
    out = tmp_path / "run"
    signal_at_step(monkeypatch, 3, signal.SIGTERM)
    assert main(sft_args(tiny_model_dir, out, chats, "--max_steps", 3, "--checkpoint.save_at_end", save_at_end)) == 0
    monkeypatch.undo()
    assert checkpoint_steps(out) == [3] and steps_of(out) == [1, 2, 3]
    printed = capfd.readouterr()
    assert "exiting with code 75 (0 when that step is the run's last: the run is then complete)" in printed.err
    lines = printed.out.splitlines()
    done = next(i for i, line in enumerate(lines) if line.startswith("done: 3 steps"))
    assert lines[done + 1] == (f"SIGTERM received during the last step: the run completed it (step 3 of "
                               f"train.max_steps 3) and its final checkpoint {out / 'checkpoints/step-00000003'} is "
                               "published; exit code 0, not 75: the run is complete, nothing to resume or requeue")
    assert "stopped by" not in printed.out


def test_signals_during_the_save_change_nothing(tiny_model_dir, chats, tmp_path, monkeypatch, capfd):
    """Every part the preemption save writes is preceded by a burst of real SIGTERM, SIGINT and SIGUSR1: the save
    completes, the checkpoint verifies (sha256 of every file) and the run resumes exactly."""
    from astrai.checkpoint import parts

    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main(sft_args(tiny_model_dir, straight, chats, "--max_steps", 4)) == 0
    signal_at_step(monkeypatch, 1, signal.SIGTERM)
    write_part = parts._write_part

    def noisy(directory, name, part, rank):
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            os.kill(os.getpid(), signum)
        return write_part(directory, name, part, rank)

    monkeypatch.setattr(parts, "_write_part", noisy)
    assert main(sft_args(tiny_model_dir, split, chats, "--max_steps", 4)) == EXIT_PREEMPTED
    monkeypatch.undo()
    assert "received again: already stopping" in capfd.readouterr().err
    assert checkpoint_steps(split) == [1]
    assert verify_checkpoint(split / "checkpoints/step-00000001").exit_code == 0
    assert main(sft_args(tiny_model_dir, split, chats, "--max_steps", 4, "--checkpoint.resume", "auto")) == 0
    assert_same(weights(straight, 4), weights(split, 4))


def test_sigterm_to_one_rank_stops_both_at_the_same_step(tiny_model_dir, chats, tmp_path):
    """2 gloo ranks under torchrun; only rank 1 receives SIGTERM: the all-reduced flag stops both after the same
    step, one checkpoint of that step (written by both ranks) is published, and each rank exits 75 (torchrun then
    reports the ranks' failure)."""
    out = tmp_path / "run"
    proc = torchrun(sft_args(tiny_model_dir, out, chats, "--max_steps", 400))
    try:
        ranks = rank_pids(proc.pid, 2)
        wait_for(lambda: len(steps_of(out)) >= 2, 120, "step 2", proc)
        sent = time.monotonic()
        os.kill(ranks[1], signal.SIGTERM)
        proc.wait(timeout=120)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = proc.stdout.read()
    print(f"SIGTERM to rank 1 -> torchrun exit: {took:.2f} s")
    (step,) = checkpoint_steps(out)
    assert steps_of(out)[-1] == step < 400, log[-2000:]
    manifest = json.loads((out / "checkpoints" / f"step-{step:08d}" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and "rng_state_rank00001.pt" in manifest["files"]
    assert verify_checkpoint(out / "checkpoints" / f"step-{step:08d}").exit_code == 0
    assert "rank 1: SIGTERM received" in log and "rank 0: SIGTERM received" not in log
    assert f"stopped by a signal on another rank after {step} steps" in log
    assert log.count("exitcode: 75") + log.count("exitcode  : 75") >= 1, log[-3000:]


def signal_the_launcher(cmd, out, signum, env=None):
    """Start a launcher, send `signum` to it (not to the ranks) after step 2; return (its exit code, its output,
    seconds from the signal to its exit)."""
    import subprocess

    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", "TRAIN_CHECK": "0", **(env or {})},
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        wait_for(lambda: len(steps_of(out)) >= 2, 180, "step 2", proc)
        sent = time.monotonic()
        proc.send_signal(signum)
        proc.wait(timeout=300)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, proc.stdout.read(), took


@pytest.mark.slow
@pytest.mark.parametrize("launcher, signum", [("torchrun.sh", signal.SIGTERM), ("torchrun.sh", signal.SIGUSR1),
                                              ("accelerate.sh", signal.SIGINT)])
def test_the_launcher_forwards_the_signal_to_every_rank(tiny_model_dir, chats, tmp_path, launcher, signum):
    """A signal to the launcher (a Ctrl-C, Slurm's SIGUSR1 to the task, a SIGTERM from the scheduler) reaches every
    rank: both stop after the same step with one checkpoint."""
    import sys

    from fault_jobs import LAUNCH

    out = tmp_path / "run"
    args = sft_args(tiny_model_dir, out, chats, "--max_steps", 400)[1:]
    opts = (["--nproc_per_node", "2", "--master_port", str(free_port())] if launcher == "torchrun.sh" else
            ["--num_processes", "2", "--main_process_port", str(free_port())])  # accelerate: --multi_gpu, 2 on CPU
    rc, log, took = signal_the_launcher(["bash", str(LAUNCH / launcher), *opts, *args], out, signum,
                                        env={"PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"})
    # the scripts pass SIGINT and SIGQUIT on as SIGTERM (a background launcher ignores them; launch/lib.sh)
    name = "SIGTERM" if signum == signal.SIGINT else signal.Signals(signum).name
    print(f"{signal.Signals(signum).name} to {launcher} -> exit {rc}: {took:.2f} s")
    (step,) = checkpoint_steps(out)
    assert steps_of(out)[-1] == step < 400, log[-3000:]
    assert f"rank 0: {name} received" in log and f"rank 1: {name} received" in log, log[-3000:]
    assert f"stopped by {name} after {step} steps" in log
    assert verify_checkpoint(out / "checkpoints" / f"step-{step:08d}").exit_code == 0


def test_a_signal_while_the_job_starts_stops_it_before_the_first_step(tiny_model_dir, chats, tmp_path, monkeypatch,
                                                                       capfd):
    from astrai.trainer import build

    load = build.load_model

    def load_and_signal(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # arrives while the model loads
        return load(*args, **kwargs)

    monkeypatch.setattr(build, "load_model", load_and_signal)
    out = tmp_path / "run"
    assert main(sft_args(tiny_model_dir, out, chats, "--max_steps", 4)) == EXIT_PREEMPTED
    assert checkpoint_steps(out) == [] and steps_of(out) == []
    assert "stopped by SIGTERM after 0 steps, before its first step (nothing new to checkpoint)" in capfd.readouterr().out


def test_a_signal_during_evaluation_ends_it_and_stops_at_that_step(tiny_model_dir, tmp_path, monkeypatch, capfd):
    """Issue 42, class 5: a SIGTERM that lands during in-training evaluation ends the evaluation before its next
    batch (no eval metrics, no answers file for that step) and the job stops at that step with its checkpoint,
    not after one more step and one more evaluation."""
    from astrai.trainer import evaluation_callback

    original = evaluation_callback.evaluate

    def signalled(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # arrives as the evaluation starts
        return original(*args, **kwargs)

    monkeypatch.setattr(evaluation_callback, "evaluate", signalled)
    out = tmp_path / "run"
    code = main(["--model.path", str(tiny_model_dir), "--train.type", "online_grpo", "--train.output_dir", str(out),
                 "--train.max_steps", "4", "--train.eval_steps", "1", "--data.eval_path", "builtin:arithmetic_test",
                 "--data.path", "builtin:arithmetic_test", "--data.eval_limit", "8", "--data.max_prompt_length", "128",
                 "--rollout.batch_size", "2",
                 "--rollout.max_new_tokens", "4", "--grpo.group_size", "2", "--grpo.minibatch_size", "4",
                 "--grpo.micro_batch_size", "2", "--train.progress_bar", "false", "--train.report_to", "none"])
    assert code == EXIT_PREEMPTED
    assert checkpoint_steps(out) == [1] and steps_of(out) == [1]
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert not any(key.startswith("eval/") for key in record)
    assert not (out / "eval" / "step-00000001.jsonl").exists()
    printed = capfd.readouterr().out
    assert "eval step 1: interrupted by a stop signal" in printed
    assert "stopped by SIGTERM after 1 step, with a checkpoint of step 1" in printed
