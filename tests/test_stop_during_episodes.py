"""A stop signal that lands while a multi-turn episode waits on a tool or an environment call is honoured as one
during the reward scoring is (tests/test_stop_during_scoring.py): the wait for the workers polls the stop request
and ends within a poll (the busy workers killed), the episodes are abandoned, the step is abandoned with the state
put back, and the job publishes the checkpoint of the last completed step and exits 75. In-process calls (0
workers) cannot be interrupted by the first signal; a second one interrupts the call the main thread waits on."""

import dataclasses
import json
import os
import shutil
import signal
import threading
import time

import pytest

from astrai.agents.environments import EnvironmentSpec
from astrai.agents.tool_calls import ToolCall
from astrai.agents.tools import load_tools
from astrai.experience.environments import EnvironmentPool, Request
from astrai.experience.tool_executor import ToolExecutor
from astrai.rewards.workers import ScoringStopped
from astrai.trainer.faults import EXIT_PREEMPTED, StopSignals
from fault_jobs import checkpoint_steps, steps_of
from scripted_turns import register_calculator_engine

SLEEP_SECONDS = 120  # far longer than a stopped wait takes

USER_CODE = f'''
import os, signal, time
from pathlib import Path


def _count_and_signal():
    """Count this call in $ASTRAI_TEST_CALLS; on call number $ASTRAI_TEST_SIGNAL_CALL SIGTERM the trainer (the
    worker's parent), then sleep long."""
    path = Path(os.environ["ASTRAI_TEST_CALLS"])
    number = len(path.read_text().splitlines()) + 1 if path.exists() else 1
    with path.open("a") as f:
        f.write(f"{{os.getpid()}}\\n")
    if str(number) == os.environ.get("ASTRAI_TEST_SIGNAL_CALL"):
        os.kill(os.getppid(), signal.SIGTERM)
        time.sleep({SLEEP_SECONDS})


def hanging(expression: str) -> str:
    """Sleep long (a hung tool).

    Args:
        expression: anything.
    """
    time.sleep({SLEEP_SECONDS})
    return "never"


def stopping(expression: str) -> str:
    """On its call number $ASTRAI_TEST_SIGNAL_CALL: SIGTERM to the trainer (the worker's parent), then a long sleep.

    Args:
        expression: anything.
    """
    _count_and_signal()
    return "408"


class HangStep:
    def reset(self, **row):
        return None

    def step(self, message):
        time.sleep({SLEEP_SECONDS})


class SignalStep:
    """Its step on the first episode of rollout $ASTRAI_TEST_SIGNAL_CALL: SIGTERM to the trainer, then a long sleep."""

    def reset(self, **row):
        return None

    def step(self, message):
        _count_and_signal()
        return None
'''


@pytest.fixture()
def user_file(tmp_path):
    path = tmp_path / "stop_user.py"
    path.write_text(USER_CODE)
    return path


def _later(seconds, action):
    timer = threading.Timer(seconds, action)
    timer.start()
    return timer


def test_a_stop_ends_the_wait_for_a_hanging_tool_in_a_worker(user_file):
    flag = threading.Event()
    tools = load_tools([{"function": "hanging", "path": str(user_file)}])
    executor = ToolExecutor(tools, [("hanging", str(user_file))], num_workers=1, timeout_seconds=300,
                            should_stop=flag.is_set)
    try:
        _later(0.5, flag.set)
        start = time.perf_counter()
        with pytest.raises(ScoringStopped, match="interrupted the episodes' tool calls.*hanging in a worker"):
            executor.run([ToolCall(name="hanging", arguments={"expression": "1"}, index=0)])
        assert time.perf_counter() - start < 10  # the poll, not the 300 s timeout or the 120 s sleep
        assert executor.pool._workers[0] is None  # the busy worker was killed
    finally:
        executor.close()


def test_a_stop_ends_the_wait_for_a_hanging_environment_step_in_a_worker(user_file):
    flag = threading.Event()
    pool = EnvironmentPool([EnvironmentSpec(route=None, reference="HangStep", path=str(user_file))], num_workers=1,
                           timeout_seconds=300, should_stop=flag.is_set)
    try:
        key, other = pool.new_keys(2)
        assert all(r.ok for r in pool.run([Request("reset", k, (None, {})) for k in (key, other)]))
        _later(0.5, flag.set)
        start = time.perf_counter()
        with pytest.raises(ScoringStopped, match="interrupted the episodes' environment calls"):
            pool.run([Request("step", key, {"role": "assistant", "content": "hi"})])
        assert time.perf_counter() - start < 10
        assert pool.lost(key) and pool.lost(other)  # the worker went, with its instances
        # the abandoning close that follows answers at once (its instances are gone), never raises
        assert [r.ok for r in pool.run([Request("close", k) for k in (key, other)])] == [True, True]
    finally:
        pool.close()


def test_a_stop_comes_before_the_next_in_process_call(user_file):
    calls = []
    tools = load_tools([{"function": "hanging", "path": str(user_file)}])
    executor = ToolExecutor(tools, num_workers=0, should_stop=lambda: True)
    executor.tools["hanging"] = dataclasses.replace(tools[0], function=lambda **kw: calls.append(kw))
    with pytest.raises(ScoringStopped, match="before rollout.tools hanging, in this process"):
        executor.run([ToolCall(name="hanging", arguments={"expression": "1"}, index=0)])
    assert calls == []
    pool = EnvironmentPool([EnvironmentSpec(route=None, reference="HangStep", path=str(user_file))], num_workers=0,
                           should_stop=lambda: True)
    with pytest.raises(ScoringStopped, match="before a reset, in this process"):
        pool.run([Request("reset", pool.new_keys(1)[0], (None, {}))])
    assert pool.run([Request("close", 0)])[0].ok  # a close still runs (the abandoning one)


@pytest.mark.parametrize("where", ["tool", "environment"])
def test_a_second_signal_interrupts_a_hanging_in_process_call(user_file, where, capfd):
    """The first SIGINT only asks to stop (the in-process call cannot see it); the second raises into the call the
    main thread waits on, which the caller turns into ScoringStopped."""
    signals = StopSignals().install()
    try:
        _later(0.3, lambda: os.kill(os.getpid(), signal.SIGINT))
        _later(0.8, lambda: os.kill(os.getpid(), signal.SIGINT))
        start = time.perf_counter()
        with pytest.raises(ScoringStopped, match="a second SIGINT interrupted the in-process call"):
            if where == "tool":
                tools = load_tools([{"function": "hanging", "path": str(user_file)}])
                ToolExecutor(tools, num_workers=0).run([ToolCall(name="hanging", arguments={"expression": "1"},
                                                                 index=0)])
            else:
                pool = EnvironmentPool([EnvironmentSpec(route=None, reference="HangStep", path=str(user_file))],
                                       num_workers=0)
                key = pool.new_keys(1)[0]
                pool.run([Request("reset", key, (None, {}))])
                pool.run([Request("step", key, {"role": "assistant", "content": "hi"})])
        assert time.perf_counter() - start < 10 and signals.count == 2
    finally:
        signals.restore()
    assert "SIGINT received again: interrupting the in-process tool or environment call" in capfd.readouterr().err


def test_a_second_signal_outside_an_in_process_call_changes_nothing():
    signals = StopSignals().install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        assert signals.count == 2 and signals.received == "SIGINT"
    finally:
        signals.restore()


def test_the_ranks_agree_after_the_generation_when_a_stop_interrupted_any_ranks_episodes():
    """With several ranks, a rank whose episodes a stop interrupted and one whose episodes finished both raise
    ScoringStopped after the generation's agreement (so neither waits in the other's next collective)."""
    from astrai.experience.runner import RolloutRunner
    from astrai.rollout.sampling import SamplingParams

    def runner(other_line):
        seen = []

        def agree(line):
            seen.append(line)
            return line if line is not None else other_line
        return RolloutRunner(None, SamplingParams(max_new_tokens=1), decode=str, score_fn=None, agree=agree), seen

    def stopped():
        raise ScoringStopped("a stop request interrupted the episodes' tool calls (here)")

    here, seen = runner(None)
    with pytest.raises(ScoringStopped, match=r"^a stop request interrupted the episodes' tool calls \(here\)$"):
        here.generate_agreed(stopped)
    assert len(seen) == 1 and seen[0] is not None
    there, _ = runner("rank 1: " + seen[0])  # this rank finished; rank 1 was stopped
    with pytest.raises(ScoringStopped, match="interrupted the rollout on another rank"):
        there.generate_agreed(lambda: "episodes")
    assert runner(None)[0].generate_agreed(lambda: "episodes") == "episodes"
    with pytest.raises(FloatingPointError, match="rank 1: nan"):
        runner("rank 1: nan")[0].generate_agreed(lambda: "episodes")


# ----------------------------------------------------------------------------------------------- end to end
def _job(tiny_model_dir, tmp_path, user_file, *extra):
    """A tiny online_grpo job whose first turn of every episode calls the tool `calculator` (scripted)."""
    model_dir = tmp_path / "model"  # room for the tool schemas the character-level tokenizer spells out
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))
    register_calculator_engine("scripted_stop_test", model_dir)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is 12 * {i}?", "answer": "0"}) + "\n" for i in range(4)))
    out = tmp_path / "run"
    return out, ["--model.path", str(model_dir), "--data.path", str(data), "--train.type", "online_grpo",
                 "--train.output_dir", str(out), "--train.max_steps", "3", "--train.progress_bar", "false",
                 "--train.report_to", "none", "--data.max_prompt_length", "64", "--rollout.batch_size", "2",
                 "--rollout.max_new_tokens", "160", "--rollout.engine", "scripted_stop_test",
                 "--rollout.max_turns", "2", "--grpo.group_size", "2", "--grpo.minibatch_size", "4",
                 "--grpo.micro_batch_size", "2", "--reward.name", "math_exact_match",
                 "--checkpoint.save_at_end", "true", *map(str, extra)]


@pytest.mark.parametrize("deterministic", [True, False], ids=["synchronous", "streaming"])
def test_a_signal_while_a_tool_worker_hangs_abandons_the_step_and_publishes_a_checkpoint(
        tiny_model_dir, tmp_path, user_file, monkeypatch, capfd, deterministic):
    """The tool call of step 2's rollout (its 5th call: 4 episodes a rollout) sends SIGTERM to the trainer and
    sleeps: the job ends well before the sleep with exit code 75 and the checkpoint of step 1."""
    from astrai.train import main

    out, args = _job(tiny_model_dir, tmp_path, user_file, "--rollout.tools",
                     json.dumps([{"function": "stopping", "path": str(user_file), "name": "calculator"}]),
                     "--rollout.tool_workers", "1", "--rollout.tool_timeout_seconds", "300",
                     "--runtime.deterministic", str(deterministic).lower())
    monkeypatch.setenv("ASTRAI_TEST_CALLS", str(tmp_path / "calls"))
    monkeypatch.setenv("ASTRAI_TEST_SIGNAL_CALL", "5")
    start = time.perf_counter()
    code = main(args)
    took = time.perf_counter() - start
    assert code == EXIT_PREEMPTED and took < SLEEP_SECONDS
    assert checkpoint_steps(out) == [1] and steps_of(out) == [1]
    assert not (out / "train.lock").exists()
    printed = capfd.readouterr()
    assert "step 2: a stop request interrupted the episodes' tool calls (rollout.tools calculator in a worker" \
        in printed.err
    assert "stopped by SIGTERM after 1 step, with a checkpoint of step 1; exit code 75" in printed.out


def test_a_signal_while_an_environment_worker_hangs_abandons_the_step_and_publishes_a_checkpoint(
        tiny_model_dir, tmp_path, user_file, monkeypatch, capfd):
    """The step of step 2's first episode (the 5th step call) sends SIGTERM to the trainer and sleeps."""
    from astrai.train import main

    out, args = _job(tiny_model_dir, tmp_path, user_file, "--rollout.tools", "[]", "--rollout.environment",
                     json.dumps({"class": "SignalStep", "path": str(user_file)}),
                     "--rollout.environment_timeout_seconds", "300", "--runtime.deterministic", "true")
    monkeypatch.setenv("ASTRAI_TEST_CALLS", str(tmp_path / "calls"))
    monkeypatch.setenv("ASTRAI_TEST_SIGNAL_CALL", "5")
    start = time.perf_counter()
    code = main(args)
    assert code == EXIT_PREEMPTED and time.perf_counter() - start < SLEEP_SECONDS
    assert checkpoint_steps(out) == [1] and steps_of(out) == [1]
    printed = capfd.readouterr()
    assert "step 2: a stop request interrupted the episodes' environment calls" in printed.err
    assert "exit code 75" in printed.out
