"""One job per output directory: rank 0 holds an exclusive `fcntl.flock` on `<output_dir>/train.lock` for the run.

The lock file says who holds it, as JSON: host, pid, run id (written once the run is resolved, right after the lock
is taken: `OutputDirLock.name_run`) and start time. A second job that finds the lock held
refuses in one line naming the holder (`OutputDirLocked`, exit code 2), before it touches the directory (the crash
recovery of `checkpoint.recover`, which deletes staging directories, runs after the lock is taken). The kernel drops
the lock when the holding process ends, however it ends, so a job killed with SIGKILL leaves no lock behind: its
record stays in the file and the next job says that it takes over from a job that did not end cleanly. A job that
ends (or fails to start) cleanly deletes the file while it still holds the lock; a job that locked a file deleted
meanwhile locks the new one instead. A lock that
is still held although the pid it names is not running on this host is stale in the other sense: a process that
inherited the open lock file (a worker forked by the job) keeps it; the refusal says so.

On network filesystems `flock` is what the client implements (NFSv4 maps it to a lease-backed byte-range lock; a
dead host's lock is released when its lease expires).

Within one process the lock is the process's: a job built again in the same directory (a notebook, a test building
two trainers) takes over the lock this process already holds instead of refusing itself.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import socket
import time
from pathlib import Path
from typing import Optional

LOCK_NAME = "train.lock"
_HELD: dict[str, tuple[int, "OutputDirLock"]] = {}
"""Locks this process holds: resolved lock path -> (open file descriptor, the `OutputDirLock` that owns it)."""


class OutputDirLocked(ValueError):
    """Another job holds the output directory's lock; the message is one line naming it."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _describe(holder: dict) -> str:
    """"run R (pid P on host H, since T)" from a lock record; "a job (pid ...)" while the holder has not resolved
    its run yet (the record names it from `OutputDirLock.name_run` on)."""
    since = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else "?"
    run_id = holder.get("run_id")
    who = f"run {run_id}" if run_id else "a job"
    return f"{who} (pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, since {when})"


def _read(path: Path) -> dict:
    try:
        record = json.loads(path.read_text(encoding="utf-8") or "{}")
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _write_record(fd: int, record: dict) -> None:
    """Replace the lock file's content with `record` (one JSON line), fsynced.

    Raises:
        OSError: a write failed (after a short write the next one says why: ENOSPC, EFBIG ...).
    """
    data, written = (json.dumps(record) + "\n").encode(), 0
    os.ftruncate(fd, 0)
    while written < len(data):
        written += os.pwrite(fd, data[written:], written)
    os.fsync(fd)


class OutputDirLock:
    """The exclusive lock on a job's output directory, held from `acquire` to `release` (or process exit).

    Args:
        output_dir: `train.output_dir` (created when missing).
        when_held: what the refusal advises while another job holds the lock (a training job's default; the
            checkpoint `recover` command says its own).
    """

    def __init__(self, output_dir: str | os.PathLike, *,
                 when_held: str = "wait for it to end, stop it, or choose another --train.output_dir"):
        self.path, self.when_held = Path(output_dir) / LOCK_NAME, when_held
        self._fd: Optional[int] = None
        self._record: dict = {}
        self.previous: dict = {}
        self._created: list[Path] = []

    def acquire(self, run_id: Optional[str]) -> Optional[str]:
        """Take the lock (non-blocking) and write this job's record into it.

        Returns:
            None, or one line about the previous holder when it ended without releasing the lock (killed, crashed),
            for the caller to say what it does about it.
        Raises:
            OutputDirLocked: another process holds it (naming the holder; saying when its pid is gone from this host).
            OutputWriteError: the directory or the lock file cannot be created or written (a full disk, a read-only
                filesystem: one line naming the file); nothing is held then, and no torn record is left.
        """
        from astrai.outputs import OutputWriteError

        try:
            missing = list(itertools.takewhile(lambda d: not d.exists(), (self.path.parent, *self.path.parent.parents)))
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._created = missing  # deepest first: removed again by `release` while empty
            key = str(self.path.resolve())
            if key in _HELD:  # this process holds it already: take it over
                fd, _ = _HELD[key]
                self.previous = {}
            else:
                fd = self._lock_file()
                self.previous = _read(self.path)
        except OSError as err:
            raise OutputWriteError.of(self.path, err) from None
        _HELD[key] = (fd, self)
        self._fd = fd
        self._record = {"host": socket.gethostname(), "pid": os.getpid(), "run_id": run_id, "started": time.time()}
        try:
            _write_record(fd, self._record)
        except OSError as err:
            try:
                os.ftruncate(fd, 0)  # no torn record for the next job to read
            except OSError:
                pass
            self.release()
            raise OutputWriteError.of(self.path, err) from None
        if self.previous.get("pid") is not None:
            return (f"train.lock: the previous job in {self.path.parent}, {_describe(self.previous)}, ended without "
                    "releasing its lock (killed or crashed)")
        return None

    def name_run(self, run_id: str) -> None:
        """Record `run_id` in the held lock (known only once the run is resolved, after the lock is taken: the
        crash recovery it protects runs first), so that a job refused meanwhile names the run. Best effort: the
        record only informs, so a write that fails (a full disk) puts the previous record back whole and the job
        goes on. A no-op when the lock is not held."""
        if self._fd is None or self._record.get("run_id") == run_id:
            return
        previous, self._record = self._record, {**self._record, "run_id": run_id}
        try:
            _write_record(self._fd, self._record)
        except OSError:
            self._record = previous
            try:
                _write_record(self._fd, previous)
            except OSError:
                pass

    def _lock_file(self) -> int:
        """Open and flock the lock file; retried when the file that was locked is no longer the one at the path (a
        job that ended deleted it meanwhile: locking the deleted file would lock nothing)."""
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except FileNotFoundError:  # another job that failed to start removed the directory it had made
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise OutputDirLocked(self._refusal()) from None
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                return fd
            os.close(fd)

    def _refusal(self) -> str:
        holder = _read(self.path)
        line = (f"train.output_dir {self.path.parent} is in use by another job: {_describe(holder)} holds "
                f"{self.path}; {self.when_held}")
        pid, host = holder.get("pid"), holder.get("host")
        if isinstance(pid, int) and host == socket.gethostname() and not _pid_alive(pid):
            line += (f" (stale: pid {pid} is not running on this host, so a process it started still holds the "
                     f"lock; find it with `fuser {self.path}`)")
        return line

    def release(self) -> None:
        """Delete the lock file and drop the lock (a no-op when not held, or taken over by a later job of this
        process): a job that ends cleanly leaves nothing behind, and the directories `acquire` created are removed
        again while they are empty (a job that failed before writing anything leaves no empty output directory)."""
        if self._fd is None:
            return
        key = str(self.path.resolve())
        if _HELD.get(key, (None, None))[1] is not self:
            self._fd = None
            return
        del _HELD[key]
        try:  # deleted while still held, so no job that locks the path can hold the deleted file
            self.path.unlink()
        except OSError:
            pass
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None
        for directory in self._created:  # a job that failed to start leaves no empty output directory behind
            try:
                directory.rmdir()
            except OSError:  # it holds the job's outputs (or another job's lock): kept
                break
        self._created = []

    def check_free(self) -> None:
        """Raise `OutputDirLocked` when another job holds the lock; leaves nothing held or written (for `--check`)."""
        if not self.path.is_file() or str(self.path.resolve()) in _HELD:
            return
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OutputDirLocked(self._refusal()) from None
        finally:
            os.close(fd)
