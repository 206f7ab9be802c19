"""Issue 42, class 5: a stop signal that lands while a rollout's rewards are being scored is honoured without
finishing the step. The worker pool stops waiting (busy workers killed), no further reward function starts, the
ranks agree right after the scoring, the step is abandoned with the state put back, the job stops at the last
completed step with its checkpoint, and a resume ends bit for bit where an uninterrupted run does."""

import json
import os
import signal
import time
import warnings
from pathlib import Path

import pytest
import torch
from fault_jobs import assert_same, checkpoint_steps, steps_of, weights

from astrai.config import config_from_dict
from astrai.rewards.functions import RewardFunctions, ScoringStopped, resolve_specs
from astrai.rewards.workers import RewardFunctionSpec, RewardWorkerPool
from astrai.trainer.faults import EXIT_PREEMPTED

SLEEP_SECONDS = 120  # far longer than a stopped job takes; a job that waited for it fails its checks

USER_REWARDS = f'''
import os, signal, time
from pathlib import Path


def _count(name):
    """This call's number (1, 2, ...) among the calls of `name`, counted in the file $ASTRAI_TEST_CALLS.<name>
    (.<rank> added under torchrun)."""
    path = Path(os.environ["ASTRAI_TEST_CALLS"] + "." + name + ("." + os.environ["RANK"] if "RANK" in os.environ
                                                                else ""))
    number = len(path.read_text().splitlines()) + 1 if path.exists() else 1
    with path.open("a") as f:
        f.write(f"{{os.getpid()}}\\n")
    return number


def slow_length(prompts, completions, completion_ids, **kwargs):
    """In a worker: on call $ASTRAI_TEST_SIGNAL_CALL (on rank $ASTRAI_TEST_SIGNAL_RANK only, when set), SIGTERM to
    the trainer, then a long wait (a slow sandbox)."""
    rank = os.environ.get("ASTRAI_TEST_SIGNAL_RANK", os.environ.get("RANK"))
    if str(_count("slow_length")) == os.environ.get("ASTRAI_TEST_SIGNAL_CALL") and rank == os.environ.get("RANK"):
        os.kill(os.getppid(), signal.SIGTERM)
        time.sleep({SLEEP_SECONDS})
        Path(os.environ["ASTRAI_TEST_CALLS"] + ".slept").write_text("the sleep ended")
    return [(sum(ids) % 5) / 4 for ids in completion_ids]


def stopping_length(prompts, completions, completion_ids, **kwargs):
    """In the trainer's process: on call $ASTRAI_TEST_SIGNAL_CALL, SIGTERM to itself (returns normally)."""
    if str(_count("stopping_length")) == os.environ.get("ASTRAI_TEST_SIGNAL_CALL"):
        os.kill(os.getpid(), signal.SIGTERM)
    return [(sum(ids) % 5) / 4 for ids in completion_ids]


def counted(completions, **kwargs):
    """Counts its calls."""
    _count("counted")
    return [1.0 for _ in completions]


def started_then_sleeps(completions, **kwargs):
    """Says it started (the file $ASTRAI_TEST_CALLS.started holds its pid), then sleeps."""
    Path(os.environ["ASTRAI_TEST_CALLS"] + ".started").write_text(str(os.getpid()))
    time.sleep({SLEEP_SECONDS})
    return [0.0 for _ in completions]
'''


@pytest.fixture()
def reward_file(tmp_path, monkeypatch):
    path = tmp_path / "stop_rewards.py"
    path.write_text(USER_REWARDS)
    monkeypatch.setenv("ASTRAI_TEST_CALLS", str(tmp_path / "calls"))
    monkeypatch.delenv("ASTRAI_TEST_SIGNAL_CALL", raising=False)
    return path


def calls(tmp_path, name) -> int:
    path = tmp_path / f"calls.{name}"
    return len(path.read_text().splitlines()) if path.exists() else 0


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# ----------------------------------------------------------------------------------------------------- units
def test_the_worker_pool_returns_promptly_when_a_stop_is_requested(reward_file, tmp_path):
    started = tmp_path / "calls.started"
    spec = RewardFunctionSpec(name="sleeps", function="stop_rewards:started_then_sleeps", path=str(reward_file))
    # a stop "arrives" once the call runs; the timeout is far away, so only the stop can end the wait
    pool = RewardWorkerPool([spec], num_workers=1, timeout_seconds=600.0, should_stop=started.exists)
    try:
        start = time.perf_counter()
        [(status, text, trace)] = pool.run(0, [{"completions": ["a"]}])
        waited = time.perf_counter() - start
        print(f"stop -> run returned: {waited:.2f} s (worker start included)")
        assert (status, text, trace) == ("stopped", "interrupted by a stop request", None)
        assert waited < SLEEP_SECONDS
        assert not alive(int(started.read_text()))  # the busy worker was killed (and reaped) ...
        assert pool.restarts == 1
        pool.should_stop = None  # ... and a fresh one serves the next call
        spec_ok = RewardFunctionSpec(name="counted", function="stop_rewards:counted", path=str(reward_file))
        pool.specs.append(spec_ok)
        assert pool.run(1, [{"completions": ["a", "b"]}]) == [("ok", [1.0, 1.0], None)]
    finally:
        pool.close()


def test_a_stop_between_in_process_functions_starts_no_further_one(reward_file, tmp_path, monkeypatch):
    """`reward.num_workers: 0`: the function running when the stop arrives is one call and finishes; the next one
    is not called, and the scoring raises instead of returning partial scores."""
    stopped = []
    section = config_from_dict({"reward": {"num_workers": 0, "functions": [
        {"function": "stop_rewards:stopping_length", "path": str(reward_file)},
        {"function": "stop_rewards:counted", "path": str(reward_file)}]}}).reward
    fns = RewardFunctions(resolve_specs(section, answer_field="answer"), columns=(), num_workers=0,
                          should_stop=lambda: bool(stopped))
    previous = signal.signal(signal.SIGTERM, lambda *_: stopped.append(1))  # what StopSignals does: a flag
    monkeypatch.setenv("ASTRAI_TEST_SIGNAL_CALL", "1")
    try:
        with pytest.raises(ScoringStopped, match=r"before reward.functions.1 \(counted\)"):
            fns(["p", "p"], ["a", "b"], [[1], [1, 2]], {})
    finally:
        signal.signal(signal.SIGTERM, previous)
    monkeypatch.delenv("ASTRAI_TEST_SIGNAL_CALL")
    assert stopped and calls(tmp_path, "stopping_length") == 1 and calls(tmp_path, "counted") == 0
    stopped.clear()  # without a stop the same call scores everything
    scored = fns(["p", "p"], ["a", "b"], [[1], [1, 2]], {})
    assert scored.total.tolist() == pytest.approx([1 / 4 + 1, 3 / 4 + 1]) and calls(tmp_path, "counted") == 1


def test_the_ranks_agree_after_scoring_and_all_raise_when_any_was_interrupted():
    """`agreed_scoring`: a rank whose own scoring finished raises too when another rank's was interrupted (the
    flag's maximum over the ranks); with one process no collective is made."""
    from astrai.experience.build import agreed_scoring

    class Scoring:
        def __init__(self, stop):
            self.stop = stop

        def __call__(self, prompts, completions, ids, columns):
            if self.stop:
                raise ScoringStopped("interrupted here")
            return "scores"

    record = type("Record", (), {"prompt": "p", "columns": {}})()
    flags = []
    other_rank_interrupted = lambda flag: flags.append(flag) or True  # noqa: E731
    with pytest.raises(ScoringStopped, match="on another rank"):
        agreed_scoring(Scoring(False), other_rank_interrupted)(["a"], [record], [[1]])
    with pytest.raises(ScoringStopped, match="interrupted here"):
        agreed_scoring(Scoring(True), other_rank_interrupted)(["a"], [record], [[1]])
    assert flags == [False, True]  # one agreement per scoring, carrying this rank's flag
    assert agreed_scoring(Scoring(False), lambda flag: flag)(["a"], [record], [[1]]) == "scores"
    assert agreed_scoring(Scoring(False), None)(["a"], [record], [[1]]) == "scores"
    with pytest.raises(ScoringStopped, match="interrupted here"):
        agreed_scoring(Scoring(True), None)(["a"], [record], [[1]])


# ----------------------------------------------------------------------------------------------- end to end
def grpo_args(model_dir, out, reward_file, functions, workers, *extra) -> list[str]:
    """A deterministic tiny online_grpo job: 2 prompts x 2 samples per step (one optimizer step per rollout)."""
    return ["--model.path", str(model_dir), "--train.type", "online_grpo", "--train.output_dir", str(out),
            "--data.path", "builtin:arithmetic_test", "--data.max_prompt_length", "128", "--rollout.batch_size", "2",
            "--rollout.max_new_tokens", "4", "--grpo.group_size", "2", "--grpo.minibatch_size", "4",
            "--grpo.micro_batch_size", "2", "--train.progress_bar", "false", "--train.report_to", "none",
            "--runtime.deterministic", "true", "--rollout.temperature", "2.0", "--optim.learning_rate", "1e-3",
            "--reward.num_workers", str(workers), "--reward.timeout_seconds", "600",
            "--reward.functions", json.dumps([{"function": f"stop_rewards:{name}", "path": str(reward_file)}
                                              for name in functions]), *map(str, extra)]


def metric_rows(out: Path) -> list[dict]:
    volatile = ("time/", "memory/", "perf/")
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(volatile)}
            for line in (out / "metrics.jsonl").read_text().splitlines()]


PARTIAL = ["--rollout.partial", "true", "--rollout.max_off_policy_steps", "1", "--rollout.correction", "token_tis",
           "--rollout.max_new_tokens", "6"]


ONE_STEP_OFF = ["--rollout.placement", "separate", "--rollout.max_off_policy_steps", "1",
                "--rollout.correction", "token_tis"]


@pytest.mark.parametrize("extra", [[], PARTIAL, ONE_STEP_OFF], ids=["plain", "partial_rollouts", "one_step_off"])
def test_a_signal_during_worker_scoring_abandons_the_step_and_a_resume_is_exact(tiny_model_dir, reward_file,
                                                                                tmp_path, monkeypatch, capfd, extra):
    """The reward function of step 2, in a worker, sends SIGTERM to the trainer and then sleeps long (a slow
    sandbox): the job stops well before the sleep ends, with exit code 75 and the checkpoint of step 1, nothing of
    step 2 logged; the resume to 3 steps gives the metrics and weights of an uninterrupted run, bit for bit (with
    partial rollouts too: the groups in flight that step 2's collection took and advanced are put back; one step
    off, the batch step 2 took is put back and the one it sent ahead to the generation process discarded)."""
    from astrai.train import main

    straight, split = tmp_path / "straight", tmp_path / "split"
    monkeypatch.setenv("ASTRAI_TEST_CALLS", str(tmp_path / "straight_calls"))
    assert main(grpo_args(tiny_model_dir, straight, reward_file, ["slow_length"], 1, "--train.max_steps", 3,
                          *extra)) == 0
    capfd.readouterr()

    monkeypatch.setenv("ASTRAI_TEST_CALLS", str(tmp_path / "calls"))
    monkeypatch.setenv("ASTRAI_TEST_SIGNAL_CALL", "2")
    start = time.perf_counter()
    code = main(grpo_args(tiny_model_dir, split, reward_file, ["slow_length"], 1, "--train.max_steps", 3, *extra))
    took = time.perf_counter() - start
    print(f"whole interrupted run: {took:.2f} s (the reward sleeps {SLEEP_SECONDS} s)")
    assert code == EXIT_PREEMPTED
    assert not (tmp_path / "calls.slept").exists() and took < SLEEP_SECONDS  # the wait ended, not the sleep
    pids = [int(pid) for pid in (tmp_path / "calls.slow_length").read_text().split()]
    assert len(pids) == 2 and not alive(pids[1])  # the busy worker was killed
    assert checkpoint_steps(split) == [1] and steps_of(split) == [1]
    state = json.loads((split / "checkpoints/step-00000001/trainer_state.json").read_text())
    assert state["global_step"] == 1 and state["stopped_by"] == "SIGTERM"
    if extra is ONE_STEP_OFF:  # the checkpoint holds the batch step 1 sent ahead (step 2's collection took it)
        saved = torch.load(split / "checkpoints/step-00000001/strategy_state.pt", weights_only=True)
        assert saved["one_step_off"]["generation"]["policy_version"] == 0
    elif extra:  # the checkpoint holds groups in flight (those step 1 left; step 2's collection had taken them)
        saved = torch.load(split / "checkpoints/step-00000001/strategy_state.pt", weights_only=True)
        assert saved["partial_rollouts"]["groups"]
    printed = capfd.readouterr()
    assert "step 2: a stop request interrupted the reward scoring of 4 samples (while reward.functions.0 " \
           "(slow_length) ran); the step is abandoned" in printed.err
    assert "stopped by SIGTERM after 1 step, with a checkpoint of step 1; exit code 75" in printed.out

    monkeypatch.delenv("ASTRAI_TEST_SIGNAL_CALL")
    assert main(grpo_args(tiny_model_dir, split, reward_file, ["slow_length"], 1, "--train.max_steps", 3, *extra,
                          "--checkpoint.resume", "auto")) == 0
    assert steps_of(split) == [1, 2, 3]
    assert metric_rows(split) == metric_rows(straight)
    assert_same(weights(straight, 3), weights(split, 3))


def test_a_stop_during_in_process_scoring_skips_the_next_function_and_abandons_the_step(tiny_model_dir,
                                                                                         reward_file, tmp_path,
                                                                                         monkeypatch, capfd):
    """`reward.num_workers: 0`: the function running when the signal arrives (step 2's first) finishes, the next
    function is not called, and the step is abandoned: the job stops with step 1's checkpoint."""
    from astrai.train import main

    monkeypatch.setenv("ASTRAI_TEST_SIGNAL_CALL", "2")
    out = tmp_path / "run"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # counted's constant reward is said
        code = main(grpo_args(tiny_model_dir, out, reward_file, ["stopping_length", "counted"], 0,
                              "--train.max_steps", 3))
    assert code == EXIT_PREEMPTED
    assert calls(tmp_path, "stopping_length") == 2 and calls(tmp_path, "counted") == 1  # not called in step 2
    assert checkpoint_steps(out) == [1] and steps_of(out) == [1]
    state = json.loads((out / "checkpoints/step-00000001/trainer_state.json").read_text())
    assert state["global_step"] == 1 and state["stopped_by"] == "SIGTERM"
    printed = capfd.readouterr()
    assert "(before reward.functions.1 (counted)); the step is abandoned" in printed.err
    assert "stopped by SIGTERM after 1 step, with a checkpoint of step 1; exit code 75" in printed.out


def test_a_signal_during_one_ranks_scoring_abandons_the_step_on_both(tiny_model_dir, reward_file, tmp_path):
    """2 gloo ranks under torchrun: only rank 1's reward worker signals its trainer (rank 1) in step 2 and sleeps.
    Rank 0's scoring of step 2 completes, but the ranks agree right after the scoring: both abandon the step, the
    checkpoint of step 1 (written by both ranks) is published, and each rank exits 75."""
    import subprocess

    from fault_jobs import torchrun

    out = tmp_path / "run"
    env = {"ASTRAI_TEST_CALLS": str(tmp_path / "calls"), "ASTRAI_TEST_SIGNAL_CALL": "2",
           "ASTRAI_TEST_SIGNAL_RANK": "1"}
    proc = torchrun(grpo_args(tiny_model_dir, out, reward_file, ["slow_length"], 1, "--train.max_steps", 3,
                              "--runtime.num_threads", 1), env=env)
    try:
        log, _ = proc.communicate(timeout=SLEEP_SECONDS)  # a job that waited for the sleep fails here
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert not (tmp_path / "calls.slept").exists()
    assert calls(tmp_path, "slow_length.0") == 2 and calls(tmp_path, "slow_length.1") == 2  # rank 0 scored step 2
    assert checkpoint_steps(out) == [1] and steps_of(out) == [1], log[-3000:]
    manifest = json.loads((out / "checkpoints/step-00000001/manifest.json").read_text())
    assert manifest["world_size"] == 2
    assert "rank 1: SIGTERM received" in log and "rank 0: SIGTERM received" not in log
    assert "step 2: a stop request interrupted the reward scoring on another rank; the step is abandoned" in log
    assert "stopped by a signal on another rank after 1 step, with a checkpoint of step 1" in log
    assert log.count("exitcode: 75") + log.count("exitcode  : 75") >= 1, log[-3000:]
