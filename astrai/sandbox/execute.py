"""Run untrusted Python (a model's completion) against unit tests in a separate, resource-limited process.

The sandbox of DESIGN.md section 7 ("Rewards": model output never runs in the trainer's process) and of issue 32,
part 4; used by the ``code_unit_tests`` reward (``astrai/rewards/code.py``).

Model output is never executed in the trainer's process: ``run_tests`` starts a fresh interpreter
(``python -I -S -B``: isolated mode, no site, no user site, no bytecode files) running
``astrai/sandbox/harness.py``, in its own session, with

- a fresh temporary directory as working directory (removed afterwards) and a scrubbed environment (only
  ``PATH`` and ``LANG``: nothing of the trainer's, so no HF token or WANDB key);
- a wall-clock timeout enforced outside the code (the harness's supervisor, backed by the trainer), resource
  limits (``resource.setrlimit``: CPU seconds, address space, file size, open files, processes, no core files),
  and stdout+stderr and the result channel read up to a byte cap (the run is killed past it);
- when the trainer runs as root: a drop to an unprivileged uid of the run's own (random) first, so the process
  limit holds, the trainer's files and processes are out of reach, and leftovers can be killed by uid;
- where the kernel allows unprivileged user namespaces: new user, mount, network and pid namespaces. Then the code
  has no network (only a loopback device that is down), it is pid 1 of its own pid namespace so ALL its processes
  (forks that left the session included) die with it, it sees a private /proc (no other process's environment or
  command line), its working directory is a size-capped tmpfs, ``/tmp``, ``/var/tmp``, ``/run``, ``/dev/shm`` and
  the trainer's home directory are covered by empty tmpfs, and every other mount is read-only. Where namespaces
  are not available the run still has the limits above, and the first run says in ONE log line what is missing
  (``sandbox_isolation()`` tells which apply; docs/rewards.md lists what each missing piece exposes).

Tests: assert statements (format in ``astrai/sandbox/code_tests.py``). For ``assert <expr> == <literal>`` only
``<expr>`` enters the sandbox and the trainer compares its value with the literal, so code cannot fake a pass
without knowing the expected values. Results travel on a dedicated pipe, each record carrying a per-run random
token, never on stdout: printing "all passed" or exiting early (``sys.exit(0)``, ``os._exit(0)``) passes nothing.

Linux only (namespaces, prctl, pidfd). Stdlib only: usable without torch.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Sequence

from astrai.sandbox.code_tests import UnitTest, parse_tests, verdicts
from astrai.sandbox.process import collect, kill_marked, kill_uid, stop

LOG = logging.getLogger("astrai.sandbox")
HARNESS_SOURCE = Path(__file__).with_name("harness.py").read_text(encoding="utf-8")
DEFAULT_HIDE = ("/tmp", "/var/tmp", "/run", "/dev/shm", "~")
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
RANDOM_UID_BASE = 1 << 30
STATUSES = ("ok", "error", "syntax_error", "timeout", "memory", "output_limit", "crashed", "sandbox_error")
SYNTAX_ERRORS = ("SyntaxError", "IndentationError", "TabError")


class SandboxError(RuntimeError):
    """The sandbox itself could not run (interpreter missing, namespace set-up failed), as opposed to the code."""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandbox run. Sizes in bytes, times in seconds; the rlimits apply to EACH process.

    Attributes:
        timeout_s: wall-clock limit of the whole run (solution + all tests).
        cpu_s: RLIMIT_CPU per process, in whole seconds: the kernel kills a process at this much CPU time.
        memory_bytes: RLIMIT_AS (address space) per process; an allocation beyond it raises MemoryError.
        file_size_bytes: RLIMIT_FSIZE: the largest file the code may write.
        open_files: RLIMIT_NOFILE.
        processes: RLIMIT_NPROC: the most processes (threads count) the code may have at once, its first
            included; per run inside a user namespace, else added to the uid's current count.
        output_bytes: stdout+stderr kept; more kills the run (status ``output_limit``).
        result_bytes: cap on the result channel (a test value larger than this also means ``output_limit``).
        workdir_bytes: size of the tmpfs working directory (mount namespace only).
        hide: directories covered by an empty tmpfs (mount namespace only); ``~`` is the trainer's home.
        uid, gid: the unprivileged ids a root trainer runs the code as; None (default): a random uid of its own
            for each run, in ``[2**30, 2**30 + 2**29)`` (no account needed), so the process limit counts that run
            alone and every process left behind can be found and killed by its uid. gid None: the same as uid.
            A uid given here may be shared (e.g. 65534), so leftovers are then found by the run id instead.
        namespaces: try the user/mount/network/pid namespaces (False: the fallback, e.g. to compare).
        python: interpreter to run (default: the trainer's own, symlinks resolved); stdlib only is needed.
        tmp_dir: where the temporary working directory is made (default ``tempfile.gettempdir()``).
    """

    timeout_s: float = 5.0
    cpu_s: int = 5
    memory_bytes: int = 1 << 30
    file_size_bytes: int = 1 << 20
    open_files: int = 64
    processes: int = 32
    output_bytes: int = 64 << 10
    result_bytes: int = 1 << 20
    workdir_bytes: int = 16 << 20
    hide: tuple[str, ...] = DEFAULT_HIDE
    uid: int | None = None
    gid: int | None = None
    namespaces: bool = True
    python: str | None = None
    tmp_dir: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0:
            raise ValueError(f"sandbox limits: timeout_s must be a positive number of seconds, got {self.timeout_s!r}")
        for name in ("cpu_s", "memory_bytes", "file_size_bytes", "open_files", "processes", "output_bytes",
                     "result_bytes", "workdir_bytes", "uid", "gid"):
            value = getattr(self, name)
            if name in ("uid", "gid") and (value is None or (isinstance(value, int) and value > 0)):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"sandbox limits: {name} must be a positive int, got {value!r}")
        if self.open_files < 8:
            raise ValueError(f"sandbox limits: open_files must be at least 8, got {self.open_files}")
        if self.python is not None and (not isinstance(self.python, str) or not self.python):
            raise ValueError(f"sandbox limits: python must be the path of an interpreter (None: the trainer's own), "
                             f"got {self.python!r}")


@dataclass(frozen=True)
class SandboxResult:
    """The outcome of one run.

    Attributes:
        status: one of ``STATUSES``: ``ok`` (ran to the end, whatever the tests said), ``syntax_error``, ``error``
            (the solution or setup raised, SystemExit included), ``timeout`` (wall clock or CPU), ``memory``
            (a MemoryError was raised), ``output_limit``, ``crashed`` (ended before finishing: killed, os._exit),
            ``sandbox_error`` (the sandbox itself failed; ``detail`` says why).
        passed, total: tests passed, tests given.
        duration_s: wall-clock seconds of the run, start-up and clean-up included.
        test_errors: per test, None when it passed, else why not (``"wrong value"``, an exception name, ``"not run"``).
        output: the code's stdout and stderr, at most ``output_bytes`` (UTF-8, undecodable bytes replaced).
        isolation: what isolated this run (the harness's header: ``netns``, ``pidns``, ``mountns`` ...).
        detail: a short reason for ``error``/``sandbox_error`` (the exception name or harness message).
        run_id: the run's id (on the sandbox's command line; not a secret).
    """

    status: str
    passed: int
    total: int
    duration_s: float
    test_errors: tuple[str | None, ...] = ()
    output: str = ""
    isolation: dict = field(default_factory=dict)
    detail: str = ""
    run_id: str = ""

    @property
    def score(self) -> float:
        """passed / total in [0, 1] (0.0 when there are no tests)."""
        return self.passed / self.total if self.total else 0.0


def _run_ids(limits: SandboxLimits) -> tuple[int, int] | None:
    """(uid, gid) a root trainer drops to for one run, or None when not running as root."""
    if os.geteuid() != 0:
        return None
    uid = limits.uid if limits.uid is not None else RANDOM_UID_BASE + secrets.randbelow(RANDOM_UID_BASE // 2)
    return uid, limits.gid if limits.gid is not None else uid


def _job(solution: str, setup: str, tests: Sequence[UnitTest], limits: SandboxLimits, token: str, fd: int,
         ids: tuple[int, int] | None) -> dict:
    return {"token": token, "result_fd": fd, "solution": solution, "setup": setup,
            "tests": [{"kind": t.kind, "source": t.source} for t in tests],
            "timeout_s": float(limits.timeout_s), "cpu_s": int(limits.cpu_s), "memory_bytes": int(limits.memory_bytes),
            "file_size_bytes": int(limits.file_size_bytes), "open_files": int(limits.open_files),
            "processes": int(limits.processes), "workdir_bytes": int(limits.workdir_bytes),
            "hide": [os.path.expanduser(p) for p in limits.hide], "ids": ids,
            "namespaces": bool(limits.namespaces), "parent": os.getpid()}


def _records(raw: bytes, token: str) -> list[dict]:
    """The result lines that carry the run's token, token removed; anything else is ignored."""
    found = []
    for line in raw.splitlines():
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(record, dict) and record.pop("t", None) == token:
            found.append(record)
    return found


def _header(records: list[dict]) -> dict:
    """The isolation header: the FIRST header record (the harness writes it before the code runs), or {}."""
    header = next((r["header"] for r in records if "header" in r), {})
    return header if isinstance(header, dict) else {}


def _status(records: list[dict], overflow: str | None, backstop: bool, cpu_limit_s: float) -> tuple[str, str]:
    """(status, detail) by precedence: sandbox_error, output_limit, timeout, syntax_error, memory, error, crashed, ok.

    Only records written before the isolation header (by the trusted harness alone) can report a harness error,
    so code under test cannot fake a sandbox failure; the supervisor's exit report is its last record."""
    header_at = next((k for k, r in enumerate(records) if "header" in r), len(records))
    harness = next((r for r in records[:header_at] if "harness_error" in r), None)
    if harness is not None:
        return "sandbox_error", str(harness["harness_error"])[:300]
    if overflow:
        return "output_limit", f"{overflow} past its cap"
    trailer = next((r for r in reversed(records) if "exit" in r), {})
    cpu_s = trailer.get("cpu_s") if isinstance(trailer.get("cpu_s"), (int, float)) else 0.0
    by_kernel = trailer.get("exit") in (-signal.SIGKILL, -signal.SIGXCPU) and trailer.get("killed") is False
    if by_kernel and cpu_s >= 0.8 * cpu_limit_s:  # RLIMIT_CPU's kill (rusage is tick-sampled: a little under)
        return "timeout", "cpu time"
    if backstop or trailer.get("timed_out") is True:
        return "timeout", "wall clock"
    phase = next((r for r in records if "phase" in r), None)
    if phase is not None and str(phase.get("error")) in SYNTAX_ERRORS:
        return "syntax_error", str(phase["error"])
    if any(str(r.get("error")) == "MemoryError" for r in records):
        return "memory", "MemoryError"
    if phase is not None:
        return "error", f"{str(phase.get('phase'))[:20]}: {str(phase.get('error'))[:80]}"
    if header_at == len(records):
        return "sandbox_error", "the harness reported nothing (exit %s)" % trailer.get("exit", "unknown")
    if not any("done" in r for r in records):
        return "crashed", f"exit {trailer.get('exit', 'unknown')}"
    return "ok", ""


def _remove_tree(path: str) -> None:
    """Remove ``path`` even when the code left directories without permissions in it."""
    for root, dirs, _ in os.walk(path):
        for name in dirs:
            full = os.path.join(root, name)
            try:
                if stat.S_ISDIR(os.lstat(full).st_mode):
                    os.chmod(full, 0o700)
            except OSError:
                pass
    shutil.rmtree(path, ignore_errors=True)


def _execute(solution: str, setup: str, tests: Sequence[UnitTest], limits: SandboxLimits, workdir: str, run_id: str):
    """Start the harness in ``workdir``, collect its pipes, end it: (records, output bytes, overflow, backstop)."""
    token, ids = secrets.token_hex(16), _run_ids(limits)
    res_r, res_w = os.pipe2(os.O_CLOEXEC)
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    try:
        job_path = os.path.join(workdir, "job.json")
        with open(os.open(job_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w", encoding="utf-8") as f:
            json.dump(_job(solution, setup, tests, limits, token, res_w, ids), f)
        if ids is not None:
            os.chown(workdir, *ids)  # the harness drops to this uid before the code runs
        python = os.path.realpath(sys.executable) if limits.python is None else limits.python
        argv = [python, "-I", "-S", "-B", "-c", HARNESS_SOURCE, "astrai-sandbox", run_id]
        try:
            proc = subprocess.Popen(argv, cwd=workdir, env=dict(ENV), stdin=subprocess.DEVNULL, stdout=out_w,
                                    stderr=out_w, pass_fds=(res_w,), start_new_session=True)
        except OSError as e:
            raise SandboxError(f"sandbox: cannot start the interpreter {python}: {e}") from None
        os.close(res_w)
        os.close(out_w)
        res_w = out_w = -1
        pipes = {out_r: ("output", bytearray(), limits.output_bytes),
                 res_r: ("result", bytearray(), limits.result_bytes)}
        try:
            overflow, backstop = collect(proc, pipes, limits.timeout_s)
        finally:
            stop(proc, graceful=True)
            records = _records(bytes(pipes[res_r][1]), token)
            if not _header(records).get("pidns"):  # forks that left the process group (os.setsid)
                if ids is not None and limits.uid is None:  # the run's own random uid: nothing else has it
                    kill_uid(ids[0])
                else:
                    kill_marked(b"astrai-sandbox\0" + run_id.encode())
        return records, bytes(pipes[out_r][1][:limits.output_bytes]), overflow, backstop
    finally:
        for fd in (res_r, res_w, out_r, out_w):
            if fd >= 0:
                os.close(fd)


def run_tests(solution: str, tests: str | Sequence[str] | Sequence[UnitTest], *, setup: str = "",
              limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``solution`` (untrusted Python source), then ``setup``, then each test, in the sandbox.

    Args:
        solution: the program under test (e.g. the code extracted from a completion).
        tests: assert statements (see ``parse_tests``) or ``UnitTest`` records it made.
        setup: trusted source run after the solution and before the tests (MBPP's ``test_setup_code``; imports).
        limits: ``SandboxLimits()`` by default.

    Returns:
        A ``SandboxResult``; a failing, crashing or hostile program is a result (score 0 for what did not pass),
        never an exception in the trainer.

    Raises:
        ValueError: for malformed tests (``parse_tests``). SandboxError: the interpreter cannot be started.
    """
    limits = limits or SandboxLimits()
    parsed = tuple(tests) if tests and all(isinstance(t, UnitTest) for t in tests) else parse_tests(tests)
    start, run_id = time.monotonic(), secrets.token_hex(8)
    workdir = tempfile.mkdtemp(prefix="astrai-sandbox-", dir=limits.tmp_dir)
    try:
        records, output, overflow, backstop = _execute(solution, setup, parsed, limits, workdir, run_id)
    finally:
        _remove_tree(workdir)
    verdicts_ = verdicts(records, parsed)
    status, detail = _status(records, overflow, backstop, limits.cpu_s)
    header = _header(records)
    result = SandboxResult(status=status, passed=sum(v is None for v in verdicts_), total=len(parsed),
                           duration_s=time.monotonic() - start, test_errors=tuple(verdicts_),
                           output=output.decode("utf-8", "replace"), isolation=dict(header), detail=detail,
                           run_id=run_id)
    _note_isolation(header)
    return result


def missing_isolation(isolation: dict) -> list[str]:
    """What a run's isolation header lacks, one phrase each, saying what that exposes (empty: fully isolated)."""
    missing = []
    if not isolation.get("netns"):
        missing.append("no network namespace: the code can open network connections"
                       + (f" ({isolation['unshare_error']})" if isolation.get("unshare_error") else ""))
    if not isolation.get("pidns"):
        missing.append("no pid namespace: a fork that leaves its session can outlive the run, and other "
                       "processes of its uid are visible")
    if not isolation.get("mountns"):
        missing.append("no mount namespace: the code can write wherever its uid may (files up to the size limit), "
                       "and filesystem sockets are reachable")
    elif not isolation.get("readonly_fs"):
        missing.append(f"mounts left writable: {', '.join(isolation.get('writable', []))}")
    if isolation.get("mountns") and not isolation.get("private_proc"):
        missing.append("no private /proc: other processes of its uid are visible")
    return missing


_NOTED: list[bool] = []


def _note_isolation(header: dict) -> None:
    """Log, once per process, one line naming what isolation this machine lacks."""
    if header and not _NOTED:
        _NOTED.append(True)
        missing = missing_isolation(header)
        if missing:
            where = "namespaces switched off" if header.get("namespaces_off") else "on this machine"
            LOG.warning("sandbox: weaker isolation (%s): %s (see docs/rewards.md)", where, "; ".join(missing))


@lru_cache(maxsize=1)
def sandbox_isolation() -> dict:
    """The isolation a default sandbox run gets on this machine (its header: ``netns``, ``pidns``, ``mountns``,
    ``private_proc``, ``readonly_fs``, ``writable``, ``hidden``, ``dropped_to_uid``, ``nproc_scope`` ...), found
    by one empty run and cached.

    Raises:
        SandboxError: when that run cannot start or reports a harness failure.
    """
    result = run_tests("", [])
    if result.status == "sandbox_error" or not result.isolation:
        raise SandboxError(f"sandbox: the probe run failed: {result.detail or result.status}")
    return dict(result.isolation)


__all__ = ["DEFAULT_HIDE", "STATUSES", "SandboxError", "SandboxLimits", "SandboxResult", "missing_isolation",
           "run_tests", "sandbox_isolation"]
