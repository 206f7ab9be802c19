"""Environment instances of running episodes: held in worker processes (or in the trainer's), called by episode.

An instance keeps the state of its episode across turns, so every call of an episode goes to the process that
holds its instance. `EnvironmentPool` runs ``num_workers`` processes (`astrai.rewards.workers`' machinery: fresh
interpreters in sessions of their own, ended with everything they started when the trainer dies), each holding the
instances of many episodes keyed by episode; an episode is placed on the worker holding the fewest. Requests of
one phase (reset, tool calls, steps, rewards, closes) go out together: each worker serves its own in order, the
workers in parallel.

Timeouts: in a worker, each call of user code is interrupted after ``timeout_seconds`` (an alarm raising
`EnvironmentTimeout`, a BaseException, so an ``except Exception`` in user code does not swallow it); the instance
stays, so its ``close()`` still runs. A call that does not return within twice that (C code that ignores the alarm,
a deadlock) gets the worker killed; every instance it held is lost (their episodes end, counted) and a fresh worker
takes its place on the next request. With ``num_workers`` 0 instances live in the trainer's process, without a
timeout (as ``rollout.tool_workers`` 0).

Stop requests (`should_stop`: the trainer's stop signals): the wait for the workers looks at it every
`STOP_POLL_SECONDS`; a worker still busy then is killed (its instances lost, as after a hang) and `EnvironmentPool.run`
raises `ScoringStopped`, as the reward scoring does, so the episodes are abandoned and the trainer abandons the step.
In this process a call cannot be interrupted by the first signal (the stop is seen before the next request); a
second signal interrupts a call the main thread runs (`astrai.rewards.workers.in_process_call`).

Failures: `EnvironmentFailures` counts them per rollout, warns once per kind with the first traceback, and stops the
job in one line when more than ``max_error_fraction`` of the episodes of the last ``error_window`` rollouts met one
(the reward functions' rule, `astrai.rewards.functions`). This module imports no torch (a worker runs it).
"""

from __future__ import annotations

import atexit
import collections
import copy
import signal
import subprocess
import sys
import time
import warnings
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from astrai.agents.environments import (EnvironmentSpec, ObservationError, load_environment_class,
                                        observation_messages, reset_arguments, reset_observation, reward_value)
from astrai.agents.tool_calls import result_text
from astrai.imports import one_line
from astrai.rewards.workers import (STARTUP_SECONDS, STOP_POLL_SECONDS, CallInterrupted, ScoringStopped, _Worker,
                                    call_reward, die_with_parent, in_process_call, user_traceback)

__all__ = ["EnvironmentFailure", "EnvironmentFailures", "EnvironmentPool", "EnvironmentTimeout", "Reply", "Request"]

OPS = ("reset", "call", "step", "reward", "close")
"""What a request asks of an episode's instance: create it and call reset(**row); call a tool method; call step;
call get_reward; call close and drop it."""
_ASTRAI = Path(__file__).resolve().parents[1]
"""astrai's package folder: its frames are left out of the tracebacks of user code."""


class EnvironmentTimeout(BaseException):
    """Raised inside a worker's call of user code when it runs past the timeout."""


class EnvironmentFailure(ValueError):
    """Too many episodes met an environment failure; one line quoting the first."""


@dataclass(frozen=True)
class Request:
    """One request to the instance of episode `key`.

    Attributes:
        op: one of `OPS`.
        key: the episode's key (unique in the pool).
        payload: reset: (route, row); call: (method name, keyword arguments); step: the assistant message;
            reward, close: None.
    """

    op: str
    key: int
    payload: Any = None


@dataclass(frozen=True)
class Reply:
    """The answer to a `Request`.

    Attributes:
        ok: whether the call returned (and its value was of the right kind).
        value: reset: None, a string or messages (`reset_observation`); call: the result as text; step: messages or
            None; reward: a float; close: None. When not ok: the one-line error text.
        trace: the user code's traceback when it raised, else None.
        fatal: whether the instance is gone or must not be used again (a timeout, a lost worker, a failed reset or
            step); a tool method that raises is not fatal (its error is the call's result).
    """

    ok: bool
    value: Any = None
    trace: Optional[str] = None
    fatal: bool = False


def serve(request: Request, instances: dict, classes: Mapping[Optional[str], type]) -> Reply:
    """Carry out `request` on `instances` (key -> instance, changed in place) of `classes` (route -> class), in this
    process; user exceptions become error replies (EnvironmentTimeout is let through)."""
    op, key = request.op, request.key
    try:
        if op == "reset":
            route, row = request.payload
            cls = classes[route]
            instance = instances[key] = cls()
            return Reply(True, reset_observation(call_reward(instance.reset, reset_arguments(cls, row))))
        instance = instances.get(key)
        if op == "close":
            instances.pop(key, None)
            close = getattr(instance, "close", None)
            if instance is not None and callable(close):
                call_reward(close, {})
            return Reply(True)
        if instance is None:
            return Reply(False, "the environment instance does not exist (its reset failed)", fatal=True)
        if op == "call":
            name, kwargs = request.payload
            return Reply(True, result_text(call_reward(getattr(instance, name), kwargs)))
        if op == "step":
            message = request.payload
            return Reply(True, observation_messages(call_reward(lambda: instance.step(message), {})))
        if op == "reward":
            return Reply(True, reward_value(call_reward(instance.get_reward, {})))
        raise ValueError(f"unknown environment request {op!r}")
    except ObservationError as err:
        return Reply(False, str(err), fatal=op != "call")
    except (Exception, SystemExit) as err:  # the user's code: reported, never ends the worker (or the trainer)
        return Reply(False, f"{type(err).__name__}: {one_line(err)}", user_traceback(err, _ASTRAI), fatal=op != "call")


def _worker_main(conn_in: Connection, conn_out: Connection) -> None:
    """A worker: take ``(sys.path, (specs, timeout))``, load the classes, answer ("ready", None), then serve lists
    of requests until the pipe closes, replying (index, Reply) per request in order."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the trainer, which ends the workers
    die_with_parent()
    try:
        path, (specs, timeout) = conn_in.recv()
    except (EOFError, OSError):
        return
    sys.path[:] = path
    classes, broken = {}, {}
    for spec in specs:
        try:
            classes[spec.route] = load_environment_class(spec)
        except Exception as err:  # noqa: BLE001 - reported on each request that needs it
            broken[spec.route] = f"{type(err).__name__}: {one_line(err)}"
    conn_out.send(("ready", None))

    def alarm(signum, frame):
        raise EnvironmentTimeout()

    signal.signal(signal.SIGALRM, alarm)
    instances: dict[int, Any] = {}
    while True:
        try:
            requests = conn_in.recv()
        except (EOFError, OSError):
            return
        for index, request in enumerate(requests):
            if request.op == "reset" and request.payload[0] in broken:
                reply = Reply(False, broken[request.payload[0]], fatal=True)
            else:
                try:  # an alarm that fires as the call returns still lands in this handler, never outside it
                    signal.setitimer(signal.ITIMER_REAL, timeout)
                    try:
                        reply = serve(request, instances, classes)
                    finally:
                        signal.setitimer(signal.ITIMER_REAL, 0)
                except EnvironmentTimeout:
                    reply = Reply(False, _timed_out(timeout), fatal=True)
            try:
                conn_out.send((index, reply))
            except Exception as err:  # noqa: BLE001 - e.g. an unpicklable message
                conn_out.send((index, Reply(False, f"cannot send the reply back: {type(err).__name__}: "
                                                   f"{one_line(err)}", fatal=True)))


def _timed_out(timeout: float) -> str:
    return f"timed out after {timeout:g} s (rollout.environment_timeout_seconds)"


class EnvironmentPool:
    """The instances of running episodes: in `num_workers` worker processes (module docstring), or with 0 in this
    process.

    Args:
        specs: the job's environment classes (one per route); num_workers: processes (0: in this process);
        timeout_seconds: the limit of one call of user code in a worker.
        should_stop: whether a stop was requested (module docstring, "Stop requests"); None: never.

    Raises:
        EnvironmentClassError: in-process, a class that cannot be loaded.
    """

    def __init__(self, specs: Sequence[EnvironmentSpec], *, num_workers: int = 1, timeout_seconds: float = 30.0,
                 should_stop: Optional[Callable[[], bool]] = None):
        self.specs, self.timeout_seconds, self.should_stop = list(specs), timeout_seconds, should_stop
        self.classes = {spec.route: load_environment_class(spec) for spec in self.specs} if num_workers == 0 else {}
        self._instances: dict[int, Any] = {}  # in this process
        self._workers: list[Optional[_Worker]] = [None] * num_workers
        self._placed: dict[int, int] = {}  # episode key -> worker slot
        self._lost: dict[int, str] = {}  # keys whose instance went with its worker -> why
        self._next_key = 0
        self.restarts = 0
        _POOLS.add(self)

    @property
    def num_workers(self) -> int:
        """The number of worker processes (0: in this process)."""
        return len(self._workers)

    def new_keys(self, count: int) -> list[int]:
        """`count` fresh episode keys, each placed on the worker holding the fewest instances."""
        keys = list(range(self._next_key, self._next_key + count))
        self._next_key += count
        if self._workers:
            load = collections.Counter(self._placed.values())
            for key in keys:
                slot = min(range(len(self._workers)), key=lambda s: load[s])
                self._placed[key] = slot
                load[slot] += 1
        return keys

    def lost(self, key: int) -> Optional[str]:
        """Why the instance of `key` is gone with its worker, or None."""
        return self._lost.get(key)

    def run(self, requests: Sequence[Request]) -> list[Reply]:
        """Carry out `requests` (module docstring), one `Reply` each, in order. Never raises for user code: an
        exception, a wrong return value, a timeout or a dead worker is an error reply. A close ends a key's record.

        Raises:
            ScoringStopped: a stop request ended the wait for the workers (those still busy killed, their
                instances lost), came before a request in this process (other than a close), or a second signal
                interrupted one (module docstring, "Stop requests").
        """
        if not self._workers:
            replies = []
            for request in requests:
                if request.op != "close" and self.should_stop is not None and self.should_stop():
                    raise ScoringStopped(f"a stop request interrupted the episodes' environment calls (before a "
                                         f"{request.op}, in this process)")
                if request.op == "reset":
                    request = Request("reset", request.key, (request.payload[0], copy.deepcopy(request.payload[1])))
                try:
                    with in_process_call():
                        replies.append(serve(request, self._instances, self.classes))
                except CallInterrupted as err:
                    raise ScoringStopped(f"{err} (rollout.environment {request.op}, rollout.environment_workers "
                                         "0)") from None
            return replies
        for slot in {self._placed[r.key] for r in requests if r.key not in self._lost}:
            worker = self._workers[slot]
            if worker is not None and not worker.alive():  # died since the last requests: its instances went too
                self._lose(slot, f"its worker process died (exit code {worker.process.poll()})")
        replies: list[Optional[Reply]] = [None] * len(requests)
        by_slot: dict[int, list[int]] = collections.defaultdict(list)
        for i, request in enumerate(requests):
            if request.key in self._lost:
                replies[i] = Reply(True) if request.op == "close" else Reply(False, self._lost[request.key],
                                                                            fatal=True)
            else:
                by_slot[self._placed[request.key]].append(i)
        pending: dict[Connection, tuple[int, list[int], float]] = {}
        workers = {slot: self._worker(slot) for slot in by_slot}  # new ones start in parallel
        for slot, indices in by_slot.items():
            worker = workers[slot]
            if not worker.ready():
                self._lose(slot, f"its worker process did not start within {STARTUP_SECONDS:g} s")
                continue
            try:
                worker.send_conn.send([requests[i] for i in indices])
            except Exception as err:  # noqa: BLE001 - e.g. an unpicklable row
                self._lose(slot, f"a request could not be sent to its worker process: {type(err).__name__}: "
                                 f"{one_line(err)}")
                continue
            pending[worker.conn] = (slot, indices, time.monotonic() + 2 * self.timeout_seconds)
        answered: dict[int, int] = collections.Counter()
        stopped = False
        while pending:
            now = time.monotonic()
            soonest = min(deadline for _, _, deadline in pending.values())
            left = max(0.0, soonest - now)
            ready = wait(list(pending), timeout=left if self.should_stop is None else min(left, STOP_POLL_SECONDS))
            for conn in ready:
                slot, indices, _ = pending[conn]
                try:
                    index, reply = conn.recv()
                except (EOFError, OSError):
                    del pending[conn]
                    try:
                        code = self._workers[slot].process.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        code = None
                    self._lose(slot, f"its worker process died (exit code {code})")
                    continue
                replies[indices[index]] = reply
                answered[slot] += 1
                if answered[slot] == len(indices):
                    del pending[conn]
                else:
                    pending[conn] = (slot, indices, time.monotonic() + 2 * self.timeout_seconds)
            now = time.monotonic()
            for conn, (slot, indices, deadline) in list(pending.items()):
                if deadline <= now:  # the alarm did not stop the call: the worker goes, with every instance
                    del pending[conn]
                    hung = requests[indices[answered[slot]]]
                    self._lose(slot, f"its worker process was killed: a {hung.op} of another episode did not "
                                     f"stop within {2 * self.timeout_seconds:g} s (twice "
                                     "rollout.environment_timeout_seconds)", hung=hung.key)
            if pending and self.should_stop is not None and self.should_stop():  # after one poll: a close answers
                for slot, _, _ in pending.values():
                    self._lose(slot, "its worker process was killed: a stop request interrupted its calls")
                pending.clear()
                stopped = True
        for i, request in enumerate(requests):
            if replies[i] is None:
                replies[i] = (Reply(True) if request.op == "close" else
                              Reply(False, self._lost.get(request.key, "not run"), fatal=True))
            if request.op == "close":
                self._placed.pop(request.key, None)
                self._lost.pop(request.key, None)
        if stopped and any(r.op != "close" for r in requests):
            raise ScoringStopped("a stop request interrupted the episodes' environment calls (rollout.environment "
                                 "in a worker; the busy workers were killed)")
        return replies

    def _worker(self, slot: int) -> _Worker:
        """The worker of `slot`, started when there is none (a killed or dead one was cleared by `_lose`)."""
        if self._workers[slot] is None:
            self._workers[slot] = _Worker((self.specs, self.timeout_seconds), module="astrai.experience.environments")
        return self._workers[slot]

    def _lose(self, slot: int, why: str, hung: Optional[int] = None) -> None:
        """Kill worker `slot` and mark every instance it held lost (`hung`, the key whose call hung, says so)."""
        worker = self._workers[slot]
        if worker is not None:
            worker.kill()
            self._workers[slot] = None
            self.restarts += 1
        for key, placed in self._placed.items():
            if placed == slot and key not in self._lost:
                self._lost[key] = (f"{_timed_out(self.timeout_seconds)} and did not stop within "
                                   f"{2 * self.timeout_seconds:g} s: its worker process was killed" if key == hung
                                   else f"the environment instance was lost: {why}")

    def close(self) -> None:
        """End every worker (idempotent); instances in this process are dropped without their close()."""
        for slot, worker in enumerate(self._workers):
            if worker is not None:
                worker.kill()
                self._workers[slot] = None
        self._instances.clear()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass


_POOLS: "weakref.WeakSet[EnvironmentPool]" = weakref.WeakSet()


@atexit.register
def _close_pools() -> None:
    """At interpreter exit, end every pool's workers."""
    for pool in list(_POOLS):
        pool.close()


class EnvironmentFailures:
    """The stop rule for environment failures, as the reward functions': per rollout, `account` counts the episodes
    that met one, warns once per kind (its first failure, with the user's traceback), and raises when more than
    `max_error_fraction` of the episodes of the last `error_window` rollouts failed.

    Args:
        max_error_fraction, error_window: ``reward.max_error_fraction`` and ``reward.error_window``.
    """

    def __init__(self, *, max_error_fraction: float = 0.5, error_window: int = 3):
        self.max_error_fraction = max_error_fraction
        self._recent: collections.deque = collections.deque(maxlen=error_window)
        self._warned: set[str] = set()
        self._first: Optional[str] = None

    def warn_once(self, kind: str, text: str, trace: Optional[str], counted: str) -> None:
        """Warn about the first failure of `kind` (later ones are counted under `counted`)."""
        if kind in self._warned:
            return
        self._warned.add(kind)
        warnings.warn(f"rollout.environment: {text}; later failures are counted ({counted})"
                      + (f"\n{trace.rstrip()}" if trace else ""), stacklevel=3)

    def account(self, failed: int, episodes: int, first: Optional[str]) -> None:
        """Count one rollout: `failed` of `episodes` met an environment failure (`first`: the first one's text).

        Raises:
            EnvironmentFailure: one line, past the threshold.
        """
        self._recent.append((failed, episodes))
        if failed and self._first is None:
            self._first = first
        failures, total = map(sum, zip(*self._recent))
        if failed and len(self._recent) == self._recent.maxlen and failures > self.max_error_fraction * total:
            rollouts = ("this rollout" if self._recent.maxlen == 1 else
                        f"the last {self._recent.maxlen} rollouts")
            raise EnvironmentFailure(f"rollout.environment failed in {failures} of {total} episodes of {rollouts}, "
                                     f"more than reward.max_error_fraction {self.max_error_fraction:g} "
                                     f"(reward.error_window {self._recent.maxlen}); its first failure: {self._first}")


if __name__ == "__main__":  # a worker process: python -m astrai.experience.environments IN_FD OUT_FD
    from astrai.experience.environments import _worker_main as main  # the module's own classes, not __main__'s

    main(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False))
