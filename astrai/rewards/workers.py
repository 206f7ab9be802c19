"""Loading user reward functions, and the worker processes that run them with a hard timeout.

A reward function is named by ``"package.module:function"`` (imported from `sys.path`, the job's working
directory included) or by ``"module:function"`` plus ``path`` (a ``.py`` file, loaded under a private module name,
so a file outside the package works: `astrai.imports`, the loader tools and environments share). `load_reward_function`
imports it; `RewardWorkerPool` runs calls in
``num_workers`` processes, each a fresh interpreter (``python -m astrai.rewards.workers``: no forked trainer
threads or CUDA state) in a session of its own, so a call that does not return within ``timeout_seconds`` is ended by
killing the worker's whole process group (anything it started included) and the worker is started again for the
next call. A worker that dies (a crash, an out-of-memory kill) is replaced the same way. This module imports no
torch, so a worker starts in about the time its reward module takes to import.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import inspect
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

from astrai.imports import ImportFailure, load_attribute, one_line as _one_line, split_reference

__all__ = ["CallInterrupted", "RewardFunctionError", "RewardFunctionSpec", "RewardWorkerPool", "ScoringStopped",
           "call_reward", "in_process_call", "in_process_call_waited", "interrupt_in_process_call",
           "load_reward_function"]


class RewardFunctionError(ValueError):
    """A reward function cannot be loaded or called, or returned something that is not one score per sample; the
    message is one line naming the function (`reward.functions[i]` and its name)."""


class ScoringStopped(Exception):
    """A stop request (a signal: the trainer's `should_stop`) interrupted the collection of a rollout: its reward
    scoring, or its multi-turn episodes' tool and environment calls (`astrai.experience.tool_executor`,
    `astrai.experience.environments`). No scores or episodes are returned, so nothing trains on a partial rollout
    (the trainer abandons the step: `trainer.faults.StepAbandoned`)."""


class CallInterrupted(BaseException):
    """Raised into an in-process call of user code (a tool or an environment with 0 workers) that the main thread
    waits on, by a second stop signal (`interrupt_in_process_call`). A BaseException, so that an ``except
    Exception`` in the user's code does not swallow it; the caller turns it into `ScoringStopped`."""


_IN_PROCESS_CALLS = [0]
"""How many `in_process_call` blocks the main thread is inside (a list: changed in place)."""


@contextlib.contextmanager
def in_process_call() -> Iterator[None]:
    """Mark a block of the main thread that runs (or waits on) user code in this process, which no timeout or stop
    poll can end: a second stop signal inside it raises `CallInterrupted` there (`interrupt_in_process_call`, the
    trainer's signal handler). Other threads' blocks are not marked (a signal handler runs in the main thread)."""
    main = threading.current_thread() is threading.main_thread()
    if main:
        _IN_PROCESS_CALLS[0] += 1
    try:
        yield
    finally:
        if main:
            _IN_PROCESS_CALLS[0] -= 1


def in_process_call_waited() -> bool:
    """Whether the main thread is inside an `in_process_call` block now."""
    return _IN_PROCESS_CALLS[0] > 0


def interrupt_in_process_call(signal_name: str) -> bool:
    """From a signal handler (the main thread): raise `CallInterrupted` when the main thread is inside an
    `in_process_call` block; else return False (nothing to interrupt)."""
    if _IN_PROCESS_CALLS[0] > 0:
        raise CallInterrupted(f"a second {signal_name} interrupted the in-process call of user code it waited on")
    return False


@dataclass(frozen=True)
class RewardFunctionSpec:
    """One entry of `reward.functions`, resolved.

    Attributes:
        name: its metric name (`rewards/<name>/...`): the configured name, else the function's.
        function: "module:function", or a built-in name (`astrai.rewards.builtins.BUILTIN_REWARDS`).
        index: its 0-based position in `reward.functions` (as in `--reward.functions.0.weight`), for messages;
            None for the reward model (`reward.model_path`).
        path: the absolute path of the .py file holding it, or None (imported from `sys.path`).
        weight: its weight in the total reward.
        kwargs: extra keyword arguments it is called with.
        answer_field: the column holding the reference answers (`data.answer_field`): a verl-style
            `compute_score` function's `ground_truth` when the rows have no `ground_truth` column.
    """

    name: str
    function: str
    index: Optional[int] = 0
    path: Optional[str] = None
    weight: float = 1.0
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    answer_field: Optional[str] = None

    @property
    def label(self) -> str:
        """How messages name it: ``reward.functions.0 (name)``, the dotted path of its entry."""
        where = "reward.model_path" if self.index is None else f"reward.functions.{self.index}"
        return f"{where} ({self.name})"


def load_reward_function(spec: RewardFunctionSpec) -> Callable:
    """The callable `spec` names, imported now (a built-in name is not resolved here).

    Raises:
        RewardFunctionError: no ":" in the reference, a missing file, an import that fails (with its exception's
            one-line text), no such attribute, or an attribute that is not callable.
    """
    if split_reference(spec.function, spec.path) is None:
        raise RewardFunctionError(f"{spec.label}: function {spec.function!r}: expected 'package.module:function' "
                                  "or a built-in reward name")
    try:
        fn = load_attribute(spec.function, spec.path)
    except ImportFailure as err:
        raise RewardFunctionError(f"{spec.label}: {err}") from None
    if not callable(fn):
        raise RewardFunctionError(f"{spec.label}: {spec.function} is of type {type(fn).__name__}, not a function")
    return VerlScore(fn, spec.answer_field, tuple(spec.kwargs)) if VerlScore.takes(fn) else fn


class VerlScore:
    """A verl-style reward, ``compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)``
    called once per sample and returning a number or a dict with a ``"score"`` (verl's
    `custom_reward_function`), served in TRL's batch convention: ``(completions, **columns) -> list``.

    Per sample: `solution_str` is the completion's text, `ground_truth` the row's ``ground_truth`` column, else
    ``reward_model["ground_truth"]`` (verl's parquet layout), else the `answer_field` column; `data_source` and
    `extra_info` are those columns or None. Chosen by signature (`takes`): parameters named ``solution_str`` and
    ``ground_truth``."""

    def __init__(self, fn: Callable, answer_field: Optional[str], options: Sequence[str] = ()):
        self.fn, self.answer_field, self.options = fn, answer_field, tuple(options)
        self.__name__ = getattr(fn, "__name__", "compute_score")

    @staticmethod
    def takes(fn: Callable) -> bool:
        """Whether `fn` has verl's `compute_score` parameters (`solution_str` and `ground_truth`)."""
        try:
            names = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            return False
        return "solution_str" in names and "ground_truth" in names

    def __call__(self, completions: list, **columns: Any) -> list:
        n = len(completions)
        column = lambda name: columns.get(name) or [None] * n  # noqa: E731
        truth = columns.get("ground_truth")
        if truth is None and "reward_model" in columns:
            truth = [(r or {}).get("ground_truth") if isinstance(r, Mapping) else None for r in columns["reward_model"]]
        if truth is None:
            truth = column(self.answer_field) if self.answer_field else [None] * n
        options = {k: columns[k] for k in self.options if k in columns}
        out = []
        for completion, source, gold, extra in zip(completions, column("data_source"), truth, column("extra_info")):
            text = completion[-1]["content"] if isinstance(completion, list) else completion
            score = call_reward(self.fn, {"data_source": source, "solution_str": text, "ground_truth": gold,
                                          "extra_info": extra, **options})
            out.append(score.get("score") if isinstance(score, Mapping) else score)
        return out


def call_reward(fn: Callable, kwargs: Mapping[str, Any]) -> Any:
    """`fn(**kwargs)`, awaited when it returns an awaitable (an ``async def`` reward, as TRL allows): in a fresh
    event loop, or in a helper thread's when this thread already runs one."""
    result = fn(**kwargs)
    if not inspect.isawaitable(result):
        return result
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(_awaited(result))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, _awaited(result)).result()


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def user_traceback(err: BaseException, package: Optional[Path] = None) -> str:
    """The traceback of `err` from the first frame outside `package` (a folder and its subfolders; default astrai's
    reward package) on (the user's code), as `traceback.format_exception` writes it."""
    package = _HERE if package is None else package
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None and Path(tb.tb_frame.f_code.co_filename).is_relative_to(package):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(err), err, tb))


_HERE = Path(__file__).resolve().parent


def as_list(result: Any) -> Any:
    """A reward's return value as a plain list when it is a sequence-like (list, tuple, numpy array, tensor)."""
    if hasattr(result, "tolist"):
        return result.tolist()
    if isinstance(result, tuple):
        return list(result)
    return result


def _worker_main(conn_in: Connection, conn_out: Connection) -> None:
    """A worker: take `(sys.path, specs)`, then serve `(spec index, kwargs)` calls until the pipe closes, replying
    ("ok", value, None) or ("error", one-line text, traceback text)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the trainer, which ends the workers
    die_with_parent()
    try:
        path, specs = conn_in.recv()
    except (EOFError, OSError):
        return
    sys.path[:] = path  # what the trainer can import, the worker can
    conn_out.send(("ready", None))  # the interpreter's start-up does not count against a call's timeout
    loaded: dict[int, Callable] = {}
    while True:
        try:
            index, kwargs = conn_in.recv()
        except (EOFError, OSError):
            return
        try:
            if index not in loaded:
                loaded[index] = load_reward_function(specs[index])
            reply = ("ok", as_list(call_reward(loaded[index], kwargs)), None)
        except BaseException as err:  # the user's code: anything it raises is reported, never kills the loop
            reply = ("error", f"{type(err).__name__}: {_one_line(err)}", user_traceback(err))
        try:
            conn_out.send(reply)
        except Exception as err:  # e.g. an unpicklable return value
            conn_out.send(("error", f"cannot send the result back: {type(err).__name__}: {_one_line(err)}", None))


def die_with_parent(poll_seconds: float = 0.5) -> None:
    """End this process and its whole process group (what it started) when its parent process goes away, however
    the parent ends (SIGKILL included): a daemon thread polls `os.getppid()`, which changes when the parent dies and
    the process is re-parented. For a child started in a session of its own (`start_new_session`), so the group
    is only the child and its descendants."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_seconds)
        try:
            os.killpg(os.getpgrp(), signal.SIGKILL)
        finally:
            os._exit(1)

    threading.Thread(target=watch, name="astrai-die-with-parent", daemon=True).start()


STOP_POLL_SECONDS = 0.1
"""How often `RewardWorkerPool.run` looks at its `should_stop` while it waits for the workers' replies."""

STARTUP_SECONDS = 120.0
"""How long a new worker may take to start (a fresh interpreter on a loaded machine) before it counts as dead."""


class _Worker:
    """One worker process (`python -m <module>`, default `astrai.rewards.workers`, a session of its own) and two
    pipes to it; `ready()` waits for its start-up message. A plain subprocess, not `multiprocessing`: it never
    re-imports the trainer's `__main__` module, so a user script without an `if __name__ == "__main__"` guard works
    too. The module's main takes the two pipe descriptors as arguments, receives ``(sys.path, specs)`` first and
    answers ``("ready", ...)`` (`_worker_main`'s protocol)."""

    def __init__(self, specs, module: str = "astrai.rewards.workers"):
        to_child, from_parent = os.pipe()
        from_child, to_parent = os.pipe()
        self.process = subprocess.Popen([sys.executable, "-m", module, str(to_child),
                                         str(to_parent)], pass_fds=(to_child, to_parent), start_new_session=True,
                                        stdin=subprocess.DEVNULL)
        os.close(to_child)
        os.close(to_parent)
        self.conn = Connection(from_child, writable=False)
        self.send_conn = Connection(from_parent, readable=False)
        self.send_conn.send((list(sys.path), list(specs)))
        self.started = False

    def ready(self) -> bool:
        """Wait (at most `STARTUP_SECONDS`) until the worker has started; False when it died or did not start."""
        if not self.started:
            try:
                self.started = self.conn.poll(STARTUP_SECONDS) and self.conn.recv()[0] == "ready"
            except (EOFError, OSError):
                self.started = False
        return self.started

    def alive(self) -> bool:
        """Whether the process still runs."""
        return self.process.poll() is None

    def kill(self) -> None:
        """End the worker and everything in its session, and reap it."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self.conn.close()
        self.send_conn.close()


class RewardWorkerPool:
    """`num_workers` processes that run reward calls with a hard `timeout_seconds` each.

    Args:
        specs: the functions the workers may be asked to run (by index; each worker imports one on first use).
        num_workers: processes (>= 1); timeout_seconds: the limit of one call, wall clock.
        timeout_setting: the setting that limit comes from, named in timeout messages.
        should_stop: whether a stop was requested (the trainer's stop signals); looked at every
            `STOP_POLL_SECONDS` while `run` waits, which then stops waiting (None: never).
    """

    def __init__(self, specs: Sequence[RewardFunctionSpec], *, num_workers: int, timeout_seconds: float,
                 timeout_setting: str = "reward.timeout_seconds",
                 should_stop: Optional[Callable[[], bool]] = None):
        if num_workers < 1:
            raise ValueError(f"reward.num_workers: a worker pool needs >= 1 workers, got {num_workers}")
        self.specs, self.timeout_seconds, self.timeout_setting = list(specs), timeout_seconds, timeout_setting
        self.should_stop = should_stop
        self._workers: list[Optional[_Worker]] = [None] * num_workers
        self.restarts = 0
        _POOLS.add(self)

    @property
    def num_workers(self) -> int:
        """The number of worker processes."""
        return len(self._workers)

    def _worker(self, slot: int) -> _Worker:
        if self._workers[slot] is None or not self._workers[slot].alive():
            if self._workers[slot] is not None:
                self._workers[slot].kill()
                self.restarts += 1
            self._workers[slot] = _Worker(self.specs)
        return self._workers[slot]

    def run(self, index: int | Sequence[int], calls: Sequence[Mapping[str, Any]]
            ) -> list[tuple[str, Any, Optional[str]]]:
        """Run function `index` once per kwargs of `calls` (at most `num_workers` of them, in parallel); `index` may
        also be a sequence, one function per call (calls of different functions in one run: the multi-turn
        episodes' tool calls of several episodes, `astrai.experience.tool_executor.ToolExecutor.run`).

        Returns: per call ("ok", the returned value as a list when sequence-like, None) or ("error", one-line
        text: the exception, "timed out after N s" or "the worker process died (exit code C)"; the exception's
        traceback text, or None), or ("stopped", one-line text, None) for a call still running when `should_stop`
        turned true: the wait then ends within `STOP_POLL_SECONDS`, and the workers still busy are killed (with
        what they started) and started afresh on the next call, as after a timeout.
        """
        if len(calls) > self.num_workers:
            raise ValueError(f"RewardWorkerPool.run: {len(calls)} calls for {self.num_workers} workers")
        indices = [index] * len(calls) if isinstance(index, int) else list(index)
        if len(indices) != len(calls):
            raise ValueError(f"RewardWorkerPool.run: {len(indices)} function indices for {len(calls)} calls")
        pending: dict[Connection, int] = {}
        results: list[tuple[str, Any, Optional[str]]] = [("error", "not run", None)] * len(calls)
        workers = [self._worker(slot) for slot in range(len(calls))]  # new ones start in parallel
        for slot, kwargs in enumerate(calls):
            worker = workers[slot]
            if not worker.ready():
                results[slot] = ("error", f"the worker process did not start within {STARTUP_SECONDS:g} s", None)
                worker.kill()
                self._workers[slot] = None
                continue
            try:
                worker.send_conn.send((indices[slot], dict(kwargs)))
            except Exception as err:  # an unpicklable argument
                results[slot] = ("error", f"cannot send the call: {type(err).__name__}: {_one_line(err)}", None)
                continue
            pending[worker.conn] = slot
        deadline = time.monotonic() + self.timeout_seconds
        stopped = False
        while pending:
            if self.should_stop is not None and self.should_stop():
                stopped = True
                break
            left = max(0.0, deadline - time.monotonic())
            ready = wait(list(pending), timeout=left if self.should_stop is None else min(left, STOP_POLL_SECONDS))
            if not ready:
                if time.monotonic() >= deadline:
                    break
                continue
            for conn in ready:
                slot = pending.pop(conn)
                try:
                    results[slot] = conn.recv()
                except (EOFError, OSError):
                    try:
                        code = self._workers[slot].process.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        code = None
                    results[slot] = ("error", f"the worker process died (exit code {code})", None)
                    self._workers[slot].kill()
                    self._workers[slot] = None
                    self.restarts += 1
        for slot in pending.values():  # past the deadline or stopped: kill and start afresh on the next call
            results[slot] = (("stopped", "interrupted by a stop request", None) if stopped else
                             ("error", f"timed out after {self.timeout_seconds:g} s ({self.timeout_setting})", None))
            self._workers[slot].kill()
            self._workers[slot] = None
            self.restarts += 1
        return results

    def close(self) -> None:
        """End every worker (idempotent)."""
        for slot, worker in enumerate(self._workers):
            if worker is not None:
                worker.kill()
                self._workers[slot] = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


_POOLS: "weakref.WeakSet[RewardWorkerPool]" = weakref.WeakSet()


@atexit.register
def _close_pools() -> None:
    """At interpreter exit, end every pool's workers (a worker busy in a call would not see its pipe close)."""
    for pool in list(_POOLS):
        pool.close()


if __name__ == "__main__":  # a worker process: python -m astrai.rewards.workers IN_FD OUT_FD
    _worker_main(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False))
