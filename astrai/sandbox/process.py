"""Process plumbing of astrai's code sandbox (``astrai/sandbox/execute.py``): reading the harness's pipes up to
their caps, ending the harness and everything it started, and sweeping a run's uid. Stdlib only."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time

STARTUP_GRACE_S = 3.0  # the trainer's backstop: the run's timeout plus this, for interpreter start and set-up


def wait_exit(pid: int, timeout_s: float) -> bool:
    """Whether process ``pid`` (our child) exits within ``timeout_s``; it is NOT reaped (its pid stays ours)."""
    deadline = time.monotonic() + timeout_s
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True


def _read_some(fd: int, buf: bytearray, cap: int) -> bool:
    """Read what ``fd`` holds now into ``buf`` (never past ``cap + 1`` bytes); False at end of file."""
    while len(buf) <= cap:
        try:
            chunk = os.read(fd, min(1 << 16, cap + 1 - len(buf)))
        except BlockingIOError:
            return True
        if not chunk:
            return False
        buf += chunk
    return True


def collect(proc: subprocess.Popen, pipes: dict[int, tuple[str, bytearray, int]], timeout_s: float):
    """Read ``pipes`` (fd -> (name, buffer, cap)) until the harness exits, a pipe passes its cap, or the backstop
    deadline (``timeout_s + STARTUP_GRACE_S``) passes. Each buffer ends with at most cap + 1 bytes.

    Returns:
        (overflow, backstop): the name of a pipe past its cap, else None; whether the backstop deadline passed.
    """
    deadline = time.monotonic() + timeout_s + STARTUP_GRACE_S
    with selectors.DefaultSelector() as sel:
        for fd in pipes:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        try:
            pidfd = os.pidfd_open(proc.pid)
            sel.register(pidfd, selectors.EVENT_READ)
        except (AttributeError, OSError):
            pidfd = None
        try:
            open_fds, exited = set(pipes), False
            while open_fds and not exited:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None, True
                for key, _ in sel.select(remaining if pidfd is not None else min(remaining, 0.02)):
                    if key.fd == pidfd:
                        exited = True
                    elif not _read_some(key.fd, *pipes[key.fd][1:]):
                        open_fds.discard(key.fd)
                        sel.unregister(key.fd)
                exited = exited or (pidfd is None and wait_exit(proc.pid, 0))
                if exited:  # what is left in the pipes was written before the exit: take it
                    for fd in open_fds:
                        _read_some(fd, *pipes[fd][1:])
                for name, buf, cap in pipes.values():
                    if len(buf) > cap:
                        return name, False
            return None, False
        finally:
            if pidfd is not None:
                os.close(pidfd)


def stop(proc: subprocess.Popen, graceful: bool) -> None:
    """End the harness and everything of its process group; SIGTERM first lets its supervisor kill pid 1 of the
    namespace (ending all of it). The group is killed before the harness is reaped, so its pgid is still ours."""
    if graceful and not wait_exit(proc.pid, 0):
        os.kill(proc.pid, signal.SIGTERM)
        wait_exit(proc.pid, 1.0)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _matching(want) -> list[int]:
    """Pids of the processes for which ``want(pid_dir)`` is true (unreadable ones are skipped)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if want(f"/proc/{name}"):
                    found.append(int(name))
            except (OSError, StopIteration, ValueError, IndexError):
                pass
    return found


def _kill_until_gone(want) -> int:
    """SIGKILL the processes ``want`` selects, pass after pass until none is left; the number killed."""
    killed = 0
    for _ in range(50):
        found = _matching(want)
        if not found:
            break
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.001)
    return killed


def _real_uid(proc_dir: str) -> int:
    with open(f"{proc_dir}/status", "rb") as f:
        return int(next(line for line in f if line.startswith(b"Uid:")).split()[1])


def kill_uid(uid: int) -> int:
    """SIGKILL every process whose real uid is ``uid`` (a run's own uid, root trainers only) until none is left;
    the number killed. For runs without a pid namespace, whose forks may have left the process group."""
    return _kill_until_gone(lambda d: _real_uid(d) == uid)


def kill_marked(marker: bytes) -> int:
    """SIGKILL every process whose command line contains ``marker`` (a run's id: forks keep it) until none is
    left; the number killed. Best effort, for a non-root trainer without a pid namespace: a process that execs
    another program or rewrites its argv escapes it."""
    def marked(d: str) -> bool:
        with open(f"{d}/cmdline", "rb") as f:
            return marker in f.read()
    return _kill_until_gone(marked)


__all__ = ["STARTUP_GRACE_S", "collect", "kill_marked", "kill_uid", "stop", "wait_exit"]
