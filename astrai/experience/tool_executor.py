"""Running the job's plain tools (`rollout.tools`) for multi-turn episodes: in worker processes with a hard timeout
(the reward workers' `RewardWorkerPool`, loading each tool by its reference) or in the trainer's process.

A tool that fails (raises, times out, kills its worker) is loud: its first failure is warned about once per tool with
the tool's traceback (from the worker, or from this process), later ones are counted
(``rollout/episodes/tool_errors/<tool>``, and on the console line). A call the model got wrong (a missing or
mistyped argument) is the model's error, not the tool's: counted, not warned about. A failing call's error text is
its result, which the model reads (TRL's convention: a tool that raises returns ``{"error": str(e)}`` to the
model), so a tool whose calls sometimes fail is normal agent training; a broken tool stops the job in one line
(`ToolFailures`): at least `MIN_BROKEN_CALLS` of its calls in a row failed, over ``reward.error_window`` rollouts or
more.

A stop request (`should_stop`: the trainer's stop signals) ends the wait for the workers within
`astrai.rewards.workers.STOP_POLL_SECONDS` (the busy workers are killed) and raises `ScoringStopped`, as in the
reward scoring: the episodes are abandoned and the trainer abandons the step. In this process a call cannot be
interrupted by the first signal: the stop is seen before the next call; a second signal interrupts a call the main
thread runs (`astrai.rewards.workers.in_process_call`)."""

from __future__ import annotations

import collections
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from astrai.agents.tool_calls import ToolCall, argument_problem, call_tool_traced, result_text
from astrai.agents.tools import Tool
from astrai.rewards.workers import (CallInterrupted, RewardFunctionSpec, RewardWorkerPool, ScoringStopped,
                                    in_process_call)

__all__ = ["MIN_BROKEN_CALLS", "ToolExecutor", "ToolFailure", "ToolFailures", "tool_references"]

MIN_BROKEN_CALLS = 8
"""The fewest failed calls in a row (`ToolFailures`) that stop the job: fewer prove little."""


class ToolFailure(ValueError):
    """A tool of `rollout.tools` failed on every call over several rollouts (`ToolFailures`); one line quoting the
    first failure."""


class ToolFailures:
    """The stop rule for broken tools: per rollout, `account` takes each tool's calls that ran and those that failed
    (raised, timed out, killed or lost their worker, returned what cannot be sent back; not a call the model got
    wrong, refused before it ran), and keeps each tool's streak of failed calls (a rollout in which one of its calls
    returned ends the streak). The job stops when a streak reaches `min_calls` calls AND spans `error_window`
    rollouts or more: the tool failed on every call, over several updates of the weights. Unlike the reward
    functions' and the environment's rule (more than ``reward.max_error_fraction`` of a window), a tool that fails on
    some calls goes on: its error text is the result the model reads and learns from (a calculator given a malformed
    expression), which is normal agent training, and one rollout's samples (the same weights, often the same prompt)
    may all call it wrongly. A tool called seldom stops the job once its streak has the calls.

    Args:
        error_window: ``reward.error_window``; min_calls: `MIN_BROKEN_CALLS`.
    """

    def __init__(self, *, error_window: int = 3, min_calls: int = MIN_BROKEN_CALLS):
        self.error_window, self.min_calls = error_window, min_calls
        self._rollouts = 0
        self._streaks: dict[str, tuple[int, int, str]] = {}  # tool -> (failed calls in a row, first rollout, text)

    def account(self, calls: Mapping[str, int], failed: Mapping[str, int], first: Mapping[str, str]) -> None:
        """Count one rollout: per tool name its calls that ran and those that failed (`first`: a tool's first
        failure's text in this rollout).

        Raises:
            ToolFailure: one line naming the tool, past the rule (class docstring).
        """
        self._rollouts += 1
        for name, ran in calls.items():
            bad = failed.get(name, 0)
            if not ran:
                continue
            if bad < ran:  # a call returned (the order within a rollout is not kept: the streak starts again)
                self._streaks.pop(name, None)
                continue
            count, since, text = self._streaks.get(name, (0, self._rollouts, first.get(name, "?")))
            count += bad
            self._streaks[name] = (count, since, text)
            span = self._rollouts - since + 1
            if count >= self.min_calls and span >= self.error_window:
                raise ToolFailure(f"rollout.tools: {name} failed on each of its last {count} calls, over "
                                  f"{span} rollout(s), none returning (a tool stops the job after at least "
                                  f"{self.min_calls} failed calls in a row over reward.error_window "
                                  f"{self.error_window} rollouts or more, not when some calls fail); its first "
                                  f"failure: {text}")


class ToolExecutor:
    """Runs tool calls: in `num_workers` worker processes with a hard `timeout_seconds` per call
    (`astrai.rewards.workers.RewardWorkerPool`, loading each tool by its reference), or with `num_workers` 0 in this
    process (no timeout). Arguments are checked against the tool's signature and schema here first. Never raises on
    a call: a bad argument, an exception, a timeout or a dead worker is the error text the model sees. One caller
    at a time (its worker pool serves one): the streaming episode loop hands it the calls of several episodes at
    once (`astrai.experience.episodes`, "On a streaming engine"), which run in parallel on the workers.

    Args:
        tools: the loaded tools (schemas, and the callables for in-process calls).
        references: per tool, the (function, path) it was loaded from, for the workers; None: in process only.
        should_stop: whether a stop was requested (the trainer's stop signals): `run` then raises `ScoringStopped`
            (module docstring); None: never.
        failures: the stop rule for broken tools (`ToolFailures`, fed by `account`); None: a default one.
    """

    def __init__(self, tools: Sequence[Tool], references: Optional[Sequence[tuple[str, Optional[str]]]] = None, *,
                 num_workers: int = 1, timeout_seconds: float = 30.0,
                 should_stop: Optional[Callable[[], bool]] = None, failures: Optional[ToolFailures] = None):
        self.tools = {tool.name: tool for tool in tools}
        self._index = {tool.name: i for i, tool in enumerate(tools)}
        self.pool = None
        self.should_stop = should_stop
        self.failures = failures or ToolFailures()
        self._warned: set[str] = set()  # tools whose first failure was warned about
        self._ran: collections.Counter = collections.Counter()  # per tool, calls that ran since the last `account`
        self._failed: collections.Counter = collections.Counter()  # ... and those that failed
        self._first: dict[str, str] = {}  # ... and the first failure's text
        if references is not None and num_workers > 0:
            specs = [RewardFunctionSpec(name=tool.name, function=function, index=i, path=path)
                     for i, (tool, (function, path)) in enumerate(zip(tools, references))]
            self.pool = RewardWorkerPool(specs, num_workers=num_workers, timeout_seconds=timeout_seconds,
                                         timeout_setting="rollout.tool_timeout_seconds", should_stop=should_stop)

    @property
    def capacity(self) -> int:
        """How many calls it runs at once: its worker processes, 1 in this process (calls run one after another)."""
        return 1 if self.pool is None else self.pool.num_workers

    def run(self, calls: Sequence[ToolCall]) -> list[tuple[str, Optional[str]]]:
        """(result text, error text or None) per call, in order. In workers, the calls (of any tools: several
        episodes' calls, the streaming loop coalesces them) run `capacity` at a time, each in one
        `RewardWorkerPool.run` over the workers; each call keeps its own timeout and its own error text (a call
        that times out or kills its worker takes only its own worker, started afresh for the next run).

        Raises:
            ScoringStopped: a stop request ended the wait for the workers (the busy ones killed), came before an
                in-process call, or a second signal interrupted one (module docstring).
        """
        if self.pool is None:
            out = []
            for c in calls:
                if self.should_stop is not None and self.should_stop():
                    raise ScoringStopped(f"a stop request interrupted the episodes' tool calls (before rollout.tools "
                                         f"{c.name}, in this process)")
                problem = argument_problem(self.tools[c.name], c.arguments)
                if problem is not None:  # the model's error: not run, not counted against the tool
                    out.append((problem, problem))
                    continue
                try:
                    with in_process_call():
                        text, error, trace = call_tool_traced(self.tools[c.name], c.arguments)
                except CallInterrupted as err:
                    raise ScoringStopped(f"{err} (rollout.tools {c.name}, rollout.tool_workers 0)") from None
                if trace is not None:
                    self._warn_once(c.name, error, trace)
                self._count(c.name, error)
                out.append((text, error))
            return out
        out: list[Optional[tuple[str, Optional[str]]]] = [None] * len(calls)
        pending: list[int] = []
        for k, c in enumerate(calls):
            problem = argument_problem(self.tools[c.name], c.arguments)
            if problem is not None:
                out[k] = (problem, problem)
            else:
                pending.append(k)
        width = self.pool.num_workers
        for start in range(0, len(pending), width):
            chunk = pending[start:start + width]
            replies = self.pool.run([self._index[calls[k].name] for k in chunk], [calls[k].arguments for k in chunk])
            stopped = [calls[k].name for k, (status, _, _) in zip(chunk, replies) if status == "stopped"]
            if stopped:
                raise ScoringStopped(f"a stop request interrupted the episodes' tool calls (rollout.tools "
                                     f"{', '.join(dict.fromkeys(stopped))} in a worker; the busy workers were killed)")
            for k, (status, value, trace) in zip(chunk, replies):
                if status == "ok":
                    out[k] = (result_text(value), None)
                else:
                    text = f"Error: {value}"
                    out[k] = (text, text)
                    self._warn_once(calls[k].name, text, trace)
                self._count(calls[k].name, out[k][1])
        return out

    def _count(self, name: str, error: Optional[str]) -> None:
        """Count a call of tool `name` that ran (`error`: its error text, None when it returned)."""
        self._ran[name] += 1
        if error is not None:
            self._failed[name] += 1
            self._first.setdefault(name, error.removeprefix("Error: "))

    def account(self) -> None:
        """Count the calls that ran since the last `account` as one rollout's (`ToolFailures.account`), then start
        the next rollout's count.

        Raises:
            ToolFailure: a tool failed on every call over several rollouts (`ToolFailures`).
        """
        ran, failed, first = self._ran, self._failed, self._first
        self._ran, self._failed, self._first = collections.Counter(), collections.Counter(), {}
        self.failures.account(ran, failed, first)

    def _warn_once(self, name: str, error: str, trace: Optional[str]) -> None:
        """Warn about the first failure of tool `name` (its error text and traceback); later ones are counted."""
        if name in self._warned:
            return
        self._warned.add(name)
        warnings.warn(f"rollout.tools: {name} failed: {error.removeprefix('Error: ')} (the call's result, which the "
                      f"model reads); later failures are counted (rollout/episodes/tool_errors/{name})"
                      + (f"\n{trace.rstrip()}" if trace else ""), stacklevel=3)

    def close(self) -> None:
        """End the worker processes (idempotent)."""
        if self.pool is not None:
            self.pool.close()


def tool_references(entries, base_dir: Optional[str] = None
                    ) -> list[tuple[Mapping[str, Any], tuple[str, Optional[str]]]]:
    """Per `rollout.tools` entry (`astrai.config.ToolEntry` records): the reference `astrai.agents.tools.load_tools`
    takes ({function, path, name}) and the (function, absolute path or None) a worker loads it by; relative paths
    from `base_dir` (default: the working directory)."""
    base = Path.cwd() if base_dir is None else Path(base_dir)
    out = []
    for entry in entries:
        path = None if entry.path is None else str((base / Path(entry.path).expanduser()).resolve())
        reference = {"function": entry.function, **({"path": path} if path else {}),
                     **({"name": entry.name} if entry.name else {})}
        out.append((reference, (entry.function, path)))
    return out
