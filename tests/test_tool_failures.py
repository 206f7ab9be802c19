"""A tool of rollout.tools that fails on every call stops the job in one line (as a broken reward function or
environment does), while a tool that only sometimes fails (the model's bad arguments: normal agent training, TRL
returns the error text to the model) never does (`astrai.experience.tool_executor.ToolFailures`)."""

import json

import pytest

from astrai.agents.tool_calls import ToolCall
from astrai.agents.tools import load_tools
from astrai.experience.tool_executor import ToolExecutor, ToolFailure, ToolFailures
from test_stop_during_episodes import _job

TOOLS = '''
def raising(expression: str) -> str:
    """Always raises (a broken tool).

    Args:
        expression: anything.
    """
    raise RuntimeError("boom from user tool " + expression)


def picky(expression: str) -> str:
    """Raises unless the expression is "ok".

    Args:
        expression: anything.
    """
    if expression != "ok":
        raise ValueError("bad expression " + expression)
    return "fine"
'''


@pytest.fixture()
def tool_file(tmp_path):
    path = tmp_path / "failing_tools.py"
    path.write_text(TOOLS)
    return path


def test_the_rule_trips_only_on_a_streak_of_failed_calls_over_the_window():
    rule = ToolFailures(error_window=3, min_calls=8)
    rule.account({"t": 4}, {"t": 4}, {"t": "RuntimeError: boom"})
    rule.account({"t": 4}, {"t": 4}, {"t": "RuntimeError: again"})
    with pytest.raises(ToolFailure, match=r"^rollout.tools: t failed on each of its last 12 calls, over 3 "
                                          r"rollout\(s\), none returning \(.*reward.error_window 3.*\); its first "
                                          r"failure: RuntimeError: boom$"):
        rule.account({"t": 4}, {"t": 4}, {})
    # a call that returned within the window: goes on (a tool that sometimes fails is normal agent training)
    rule = ToolFailures(error_window=3, min_calls=8)
    for ran, failed in [(4, 3), (4, 4), (4, 4)]:
        rule.account({"t": ran}, {"t": failed}, {"t": "x"})
    # many calls of one rollout (the same weights) prove nothing alone
    rule = ToolFailures(error_window=3, min_calls=8)
    rule.account({"t": 64}, {"t": 64}, {"t": "x"})
    rule.account({"t": 1, "u": 5}, {"t": 1, "u": 4}, {"t": "x"})
    # a tool called seldom: stops once its streak has the calls
    rule = ToolFailures(error_window=3, min_calls=8)
    for _ in range(7):
        rule.account({"t": 1}, {"t": 1}, {"t": "x"})
    with pytest.raises(ToolFailure, match="last 8 calls, over 8 rollout"):
        rule.account({"t": 1}, {"t": 1}, {})


def test_a_return_ends_the_streak():
    rule = ToolFailures(error_window=3, min_calls=8)
    rule.account({"t": 4}, {"t": 4}, {"t": "old"})
    rule.account({"t": 4}, {"t": 3}, {"t": "x"})  # one returned
    rule.account({"t": 4}, {"t": 4}, {"t": "new"})
    rule.account({"t": 4}, {"t": 4}, {})
    rule.account({}, {}, {})  # not called: the streak goes on
    with pytest.raises(ToolFailure, match="last 12 calls, over 4 rollout.*first failure: new$"):
        rule.account({"t": 4}, {"t": 4}, {})


@pytest.mark.parametrize("workers", [0, 1])
def test_the_executor_counts_calls_that_ran_not_the_models_bad_arguments(tool_file, workers):
    tools = load_tools([{"function": name, "path": str(tool_file)} for name in ("raising", "picky")])
    executor = ToolExecutor(tools, [(name, str(tool_file)) for name in ("raising", "picky")], num_workers=workers,
                            failures=ToolFailures(error_window=1, min_calls=3))
    try:
        bad_arguments = ToolCall(index=0, name="raising", arguments={"nope": 1})
        with pytest.warns(UserWarning):
            executor.run([bad_arguments] * 5 + [ToolCall(index=0, name="picky", arguments={"expression": "no"}),
                                                 ToolCall(index=1, name="picky", arguments={"expression": "ok"})] * 2)
        executor.account()  # raising: none ran (the model's errors); picky: 2 of 4 failed
        with pytest.warns(UserWarning, match="raising failed: RuntimeError: boom from user tool 1"):
            executor.run([ToolCall(index=0, name="raising", arguments={"expression": "1"})] * 2)
        executor.account()  # 2 calls: too few
        executor.run([ToolCall(index=0, name="raising", arguments={"expression": str(i)}) for i in range(3)])
        with pytest.raises(ToolFailure, match="raising failed on each of its last 5 calls, over 2 rollout.*its "
                                              "first failure: RuntimeError: boom from user tool 1"):
            executor.account()
    finally:
        executor.close()


def test_a_job_whose_tool_always_fails_stops_in_one_line(tiny_model_dir, tmp_path, tool_file, capfd):
    """The trial: every calculator call failed on all 4 rollouts and the job ended rc 0. Now it stops at the third
    rollout (4 calls each, all failed: 12 in a row over 3 rollouts) with exit code 2 and one line."""
    from astrai.train import main

    out, args = _job(tiny_model_dir, tmp_path, tool_file, "--rollout.tools",
                     json.dumps([{"function": "raising", "path": str(tool_file), "name": "calculator"}]),
                     "--train.max_steps", "4", "--runtime.deterministic", "true")
    assert main(args) == 2
    err = capfd.readouterr().err
    assert ("error: rollout.tools: calculator failed on each of its last 12 calls, over 3 rollout(s), none "
            "returning (") in err and "its first failure: RuntimeError: boom from user tool 12 * 34" in err
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
