"""Adaptive CPU threads (`runtime.adaptive_threads`): fewer OpenMP threads while other processes busy the cores.

Why: torch's CPU kernels split every GEMM, attention and softmax over a team of OpenMP threads that meet at a
barrier after each one. When another process takes a core, the team's thread on that core runs only in the
scheduler's time slices and every barrier waits for it: on a 2-core machine a busy second core cut the paged
engine's float32 decode from 415 to 108 tokens/s with 2 threads, while 1 thread kept 226 (SmolLM2-135M, 32 rows,
`bench/engine_vs_vllm.py --busy 1` measures it against vLLM, which binds its threads). No fixed setting wins both
ways: 2 threads are 1.75x faster than 1 on idle cores.

How: at units of work (engine steps, micro-batches) at least `period` seconds apart, `ThreadGovernor.tick` reads
two kernel counters over the window since its last reading:
- *wait*: the seconds this process's threads spent runnable but not running (the second field of
  `/proc/self/task/*/schedstat`, the scheduler's `run_delay`), per second: cores our threads wanted and did not get.
  At or above `wait_down` (0.3 cores) the team shrinks by max(1, round(wait)) threads (not below 1).
- *idle*: the idle + iowait time of the cores this process may run on (`os.sched_getaffinity`, `/proc/stat`), per
  second: cores nobody used. At or above `idle_up` (0.6 cores) the team grows by max(1, round(idle)), up to the
  thread count the caller set (`torch.get_num_threads()` when the scope opened).
Neither signal reacts to the engine's own work: an idle machine shows wait ~0.01 whatever the team size, and a team as
large as the cores leaves no idle time. A reading that cannot be taken (no `/proc`) leaves the count as it is.

The count applies inside `scope()` only: the engine's `generate` and streamed `step`, and in a training job the whole
of each step (rollout, scoring passes, updates) under the trainer's governor, which the engine's decode steps and
the trainer's micro-batches both tick (`active_governor`: one decision-maker per step). On leaving, the caller's count
is put back. The choice is kept between scopes (a load that lasts keeps its count from one rollout to the next); a
window spans scopes that follow each other closely (streamed steps) and starts afresh after a pause longer than
`period` (the time between was someone else's).

Thread counts change a float reduction's order, so a rollout or a step whose count moved repeats only to rounding
(tokens can differ where two were nearly tied); jobs turn the governor off for bitwise runs (`runtime.deterministic`,
`runtime.adaptive_threads: false`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import warnings
from typing import Callable, Iterator, Optional, Tuple

import torch

__all__ = ["ThreadGovernor", "active_governor", "adaptive_threads", "cpu_readings", "governed",
           "readings_unavailable"]

log = logging.getLogger(__name__)

_open = threading.local()  # .governor: the governor whose outermost scope is open in this thread

DECISION_PERIOD = 0.5
"""Seconds of work between two decisions of a `ThreadGovernor` (a busy loop shows in one such window)."""

Readings = Tuple[float, float]
"""(wait, idle): cumulative seconds this process's threads waited runnable, and seconds its cores were idle."""


def _task_wait_seconds() -> float:
    """Sum over this process's threads of the scheduler's run_delay (seconds runnable but not running)."""
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):  # a thread that ended between the listing and the read
            continue
    return total / 1e9


def _idle_seconds(cpus: frozenset) -> float:
    """Idle + iowait seconds of the cores in `cpus` since boot (`/proc/stat`'s per-core lines)."""
    ticks = 0
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("cpu") and line[3:4].isdigit():
                fields = line.split()
                if int(fields[0][3:]) in cpus:
                    ticks += int(fields[4]) + int(fields[5])
    return ticks / os.sysconf("SC_CLK_TCK")


def active_governor() -> Optional["ThreadGovernor"]:
    """The governor whose scope is open in this thread (the innermost outermost one), or None: the engine inside a
    training step ticks the trainer's, so the decisions it takes while decoding hold for the step's scoring and
    updates too."""
    return getattr(_open, "governor", None)


def cpu_readings() -> Readings:
    """(wait, idle) now: see the module docstring. Raises OSError where `/proc` lacks them (not Linux)."""
    return _task_wait_seconds(), _idle_seconds(frozenset(os.sched_getaffinity(0)))


def readings_unavailable() -> Optional[str]:
    """Why `cpu_readings` cannot serve here (one phrase), or None when it can."""
    try:
        with open(f"/proc/self/task/{os.getpid()}/schedstat") as f:
            int(f.read().split()[1])
        _idle_seconds(frozenset(os.sched_getaffinity(0)))
    except (OSError, IndexError, ValueError, AttributeError) as err:
        return f"this system does not report scheduler waits and idle cores (/proc/self/task/*/schedstat, " \
               f"/proc/stat: {type(err).__name__})"
    return None


class ThreadGovernor:
    """The torch thread count of the work in its `scope()` (engine steps, training micro-batches) under other
    processes' CPU load.

    Args:
        period: seconds between decisions (each reads the counters once: ~0.1 ms for tens of threads); None:
            `DECISION_PERIOD`.
        wait_down: cores of wait per second (see the module docstring) at which the team shrinks.
        idle_up: idle cores per second at which it grows back.
        readings: the counters (None: `cpu_readings`).
        clock: seconds (default `time.perf_counter`).
        on_change: called with (old, new, ceiling) on every change (the engine says the first one once).

    Attributes:
        threads: the count chosen now (None until the first scope).
        ceiling: the caller's count when the last scope opened.
    """

    def __init__(self, *, period: Optional[float] = None, wait_down: float = 0.3, idle_up: float = 0.6,
                 readings: Optional[Callable[[], Readings]] = None, clock: Callable[[], float] = time.perf_counter,
                 on_change: Optional[Callable[[int, int, int], None]] = None):
        period = DECISION_PERIOD if period is None else period
        readings = readings or (lambda: cpu_readings())  # looked up at each call (tests replace the module's)
        if not period > 0 or not wait_down > 0 or not idle_up > 0:
            raise ValueError(f"ThreadGovernor: period, wait_down and idle_up must be > 0, got {period}, "
                             f"{wait_down}, {idle_up}")
        self.period, self.wait_down, self.idle_up = period, wait_down, idle_up
        self.readings, self.clock, self.on_change = readings, clock, on_change
        self.threads: Optional[int] = None
        self.ceiling = 1
        self._last: Optional[tuple[float, Readings]] = None  # (time, readings) at the window's start
        self._last_tick = 0.0
        self._depth = 0  # scopes open (only the outermost sets and restores the count)

    @contextlib.contextmanager
    def scope(self) -> Iterator["ThreadGovernor"]:
        """The governed work runs inside: the chosen count is applied on entry (at most the caller's count, the
        ceiling) and the caller's count put back on exit, whatever happens inside. A scope inside another of the
        same governor changes nothing (the trainer's step holds one around its rollout, scoring and updates)."""
        if self._depth:
            self._depth += 1
            try:
                yield self
            finally:
                self._depth -= 1
            return
        self._depth = 1
        outer, _open.governor = getattr(_open, "governor", None), self
        ceiling = torch.get_num_threads()
        self.ceiling = ceiling
        self.threads = ceiling if self.threads is None else min(self.threads, ceiling)
        if self._last is not None and self.clock() - self._last_tick > self.period:
            self._last = None  # the time since was someone else's (training): measure afresh
        if self.threads != ceiling:
            torch.set_num_threads(self.threads)
        try:
            yield self
        finally:
            self._depth, _open.governor = 0, outer
            if torch.get_num_threads() != ceiling:
                torch.set_num_threads(ceiling)

    def tick(self) -> int:
        """Called before each unit of work inside `scope()` (an engine step, a micro-batch), and after the last
        one: `period` seconds after the window opened it reads the counters and decides (the first tick after a
        pause only opens the window). Returns the count the coming unit runs with (callers average it)."""
        if self.ceiling <= 1:
            return self.threads
        now = self._last_tick = self.clock()
        if self._last is not None and now - self._last[0] < self.period:
            return self.threads
        try:
            readings = self.readings()
        except OSError:
            return self.threads
        last, self._last = self._last, (now, readings)
        if last is None:
            return self.threads
        seconds = now - last[0]
        wait = max(0.0, readings[0] - last[1][0]) / seconds
        idle = max(0.0, readings[1] - last[1][1]) / seconds
        new = self.threads
        log.debug("threads %d of %d: wait %.2f, idle %.2f cores over %.2f s", new, self.ceiling, wait, idle, seconds)
        if wait >= self.wait_down and new > 1:
            new = max(1, new - max(1, round(wait)))
        elif idle >= self.idle_up and new < self.ceiling:
            new = min(self.ceiling, new + max(1, round(idle)))
        if new != self.threads:
            old, self.threads = self.threads, new
            torch.set_num_threads(new)
            if self.on_change is not None:
                self.on_change(old, new, self.ceiling)
        return self.threads


def governed(governor: Optional[ThreadGovernor]):
    """`governor.scope()`, or a no-op context where there is no governor (adaptive threads off)."""
    return governor.scope() if governor is not None else contextlib.nullcontext()


def adaptive_threads(who: str, verb: str, metrics: str = "") -> Optional[ThreadGovernor]:
    """A `ThreadGovernor` for one user of the CPU threads (`who` "the engine" with `verb` "decodes"; "the training
    step" with "runs") whose first lowering of the count is said once as a warning (the command line writes it above
    its progress bar), naming `metrics` when given (where the mean count is logged).
    None where the system cannot report the load (`readings_unavailable`), said once as a warning when the caller
    has more than one thread: the count then stays as set."""
    reason = readings_unavailable()
    if reason is not None:
        if torch.get_num_threads() > 1:
            warnings.warn(f"runtime.adaptive_threads: {reason}; {who} keeps {torch.get_num_threads()} threads under "
                          "any load", stacklevel=3)
        return None
    said = []
    logged = f"the mean count: {metrics}; " if metrics else ""

    def say(old: int, new: int, ceiling: int) -> None:
        if new < old and not said:
            said.append(True)
            warnings.warn(f"runtime.adaptive_threads: other processes are busy on this machine's cores; {who} {verb} "
                          f"with {new} of {ceiling} threads while they are ({logged}said once)", stacklevel=2)
    return ThreadGovernor(on_change=say)
