"""Child side of astrai's code sandbox (the parent side, and the full description, is ``astrai/sandbox/execute.py``).

Never imported by the trainer: ``sandbox.py`` reads this file as text and runs it as
``python -I -S -B -c <this source> <run id>`` with the current directory a fresh temporary directory that holds
``job.json``. Standard library only. Everything here is trusted code up to ``_run_job``, which executes the
untrusted solution; so every isolation step happens before it:

outer process (the one the trainer started, in its own session):
    read and delete job.json; if running as root, import ``PRELOAD`` and drop to the run's unprivileged ids;
    no-new-privileges; try a new user + mount + network + pid namespace (``unshare``); fork the inner process; then
    only wait for it, killing it at the wall-clock timeout, on SIGTERM from the trainer or as soon as the process
    that started it is gone (re-parented: a SIGKILLed trainer), and report its exit.
inner process (pid 1 of the new pid namespace, so every process it starts dies with it):
    kill-on-parent-death; its own process group; in the mount namespace: a size-capped tmpfs as the working
    directory, a private /proc, empty tmpfs over ``hide`` paths, every other mount read-only; then a nested user
    namespace (giving up the capabilities that could undo those mounts); resource limits; close stray fds; write
    the isolation header; run the solution, the setup and each test, one record per test.

Records are JSON lines on the result pipe (never stdout), each carrying the run's random token:
``{"header": {...}}``, ``{"phase": "solution"|"setup", "error": name}``, ``{"i": n, "value": tagged}`` (a value-form
test's left-hand side, compared by the trainer), ``{"i": n, "ok": true}`` or ``{"i": n, "error": name}``,
``{"done": true}``, and the outer's ``{"exit": code, "timed_out": bool, "killed": bool, "cpu_s": seconds}``
(``killed``: the supervisor sent the SIGKILL; ``cpu_s``: tick-sampled, so a little under the limit at a kill).
"""

import builtins
import ctypes
import json
import os
import resource
import select
import signal
import sys

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
    1, 2, 4, 8, 32, 4096, 16384, 1 << 18)
MS_NOATIME, MS_NODIRATIME, MS_RELATIME, MS_STRICTATIME = 1024, 2048, 1 << 21, 1 << 24
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
MOUNT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
               "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}
# Imported before dropping root, for an interpreter whose library the unprivileged uid cannot read.
PRELOAD = ("abc", "array", "bisect", "cmath", "collections", "copy", "dataclasses", "datetime", "decimal",
           "encodings.idna", "enum", "fractions", "functools", "hashlib", "heapq", "io", "itertools", "math", "numbers",
           "operator", "random", "re", "socket", "statistics", "string", "struct", "textwrap", "time", "typing",
           "unicodedata")

_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc, what):
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _unshare(flags):
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def _mount(source, target, fstype, flags, data=None):
    enc = [None if s is None else s.encode() for s in (source, target, fstype, data)]
    _check(_libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]), f"mount {target}")


def _prctl(option, value):
    _check(_libc.prctl(ctypes.c_int(option), ctypes.c_ulong(value), ctypes.c_ulong(0), ctypes.c_ulong(0),
                       ctypes.c_ulong(0)), f"prctl {option}")


class Channel:
    """The result pipe: one JSON line per record, written whole with os.write, each carrying the token."""

    def __init__(self, fd, token):
        self.fd, self.token = fd, token

    def emit(self, **record):
        data = (json.dumps({"t": self.token, **record}) + "\n").encode()
        while data:
            data = data[os.write(self.fd, data):]


def _drop_privileges(job, facts):
    """As root: import PRELOAD, then become the run's own uid/gid (so RLIMIT_NPROC holds, the trainer's files and
    processes are out of reach, and what the run leaves behind can be killed by its uid)."""
    if job["ids"] is None:
        return
    for name in PRELOAD:
        __import__(name)
    uid, gid = job["ids"]
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    facts["dropped_to_uid"] = uid


def _enter_namespaces(facts):
    """New user + mount + network + pid namespaces, or user + network only, or none; facts say which and why."""
    uid, gid = os.getuid(), os.getgid()
    _prctl(PR_SET_DUMPABLE, 1)  # a uid change made this process non-dumpable: it could not write its own maps
    for flags, names in ((CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID, ("mountns", "netns", "pidns")),
                         (CLONE_NEWUSER | CLONE_NEWNET, ("netns",))):
        try:
            _unshare(flags)
        except OSError as e:
            facts.setdefault("unshare_error", str(e))
            continue
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"0 {uid} 1")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"0 {gid} 1")
        facts.update({name: True for name in ("userns",) + names})
        return


def _mounts():
    """(mount point, per-mount options) of every mount, in /proc/self/mountinfo order."""
    with open("/proc/self/mountinfo") as f:
        rows = [line.split() for line in f]
    return [(_unescape(row[4]), row[5].split(",")) for row in rows]


def _unescape(path):
    """Undo mountinfo's octal escapes (``\\040`` for a space); no codec lookup (the library may be unreadable)."""
    parts = path.split("\\")
    return parts[0] + "".join(chr(int(p[:3], 8)) + p[3:] if p[:3].isdigit() else "\\" + p for p in parts[1:])


def _hide(paths, workdir, facts):
    """Cover each existing directory in ``paths`` (not ``/``, not the working directory itself) with an empty tmpfs;
    the python prefix, when it lies inside one and this uid can reach it, is bound back inside."""
    prefix = os.path.realpath(sys.base_prefix)
    keep = os.open(prefix, os.O_PATH) if os.access(prefix, os.X_OK) else None
    for path in sorted({os.path.realpath(p) for p in paths if os.path.isdir(p)}, key=len):
        if path in ("/", workdir) or any(path.startswith(done + "/") for done in facts["hidden"]):
            continue  # the root, the working directory itself, or already under a covered directory
        _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0755")
        facts["hidden"].append(path)
        if keep is not None and prefix.startswith(path + "/"):
            os.makedirs(prefix, exist_ok=True)
            _mount(f"/proc/self/fd/{keep}", prefix, None, MS_BIND | MS_REC)
    if keep is not None:
        os.close(keep)


def _setup_mounts(job, facts):
    """Private propagation, tmpfs working directory, private /proc, hidden paths, everything else read-only."""
    workdir = os.path.realpath(os.getcwd())
    facts["hidden"], facts["writable"] = [], []
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    try:
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        facts["private_proc"] = True
    except OSError as e:
        facts["private_proc_error"] = str(e)
    _hide(job["hide"], workdir, facts)
    os.makedirs(workdir, exist_ok=True)
    _mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV, f"size={job['workdir_bytes']},mode=0700")
    os.chdir(workdir)
    for point, options in _mounts():
        if point == workdir or "ro" in options:
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for option in options:
            flags |= MOUNT_FLAGS.get(option, 0)
        try:
            _mount(None, point, None, flags)
        except OSError:
            facts["writable"].append(point)
    facts["readonly_fs"] = not facts["writable"]
    facts["tmpfs_workdir"] = True


def _user_task_count(uid):
    """Tasks (threads included, as RLIMIT_NPROC counts them) owned by ``uid``, from /proc."""
    count = 0
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and os.stat(f"/proc/{name}").st_uid == uid:
                count += len(os.listdir(f"/proc/{name}/task"))
        except OSError:
            pass
    return count


def _set_limits(job, facts):
    """RLIMIT_CORE/CPU/AS/FSIZE/NOFILE/NPROC. CPU: soft = hard, so the kernel SIGKILLs at the limit (pid 1 of a
    pid namespace would ignore the SIGXCPU of a lower soft limit). NPROC counts per user namespace when there is one (set after it is
    made, so it bounds this run alone); otherwise it counts all of the uid's tasks, so it is added to their count."""
    cpu = job["cpu_s"]
    limits = [(resource.RLIMIT_CORE, 0, 0), (resource.RLIMIT_CPU, cpu, cpu),
              (resource.RLIMIT_AS, job["memory_bytes"], job["memory_bytes"]),
              (resource.RLIMIT_FSIZE, job["file_size_bytes"], job["file_size_bytes"]),
              (resource.RLIMIT_NOFILE, job["open_files"], job["open_files"])]
    nproc = job["processes"]
    facts["nproc_scope"] = "namespace" if facts.get("userns") else "uid"
    if not facts.get("userns"):  # the uid's tasks, this one included, less the supervisor
        nproc += _user_task_count(os.getuid()) - 1
    limits.append((resource.RLIMIT_NPROC, nproc, nproc))
    for kind, soft, hard in limits:
        old_soft, old_hard = resource.getrlimit(kind)
        if old_hard != resource.RLIM_INFINITY:
            soft, hard = min(soft, old_hard), min(hard, old_hard)
        resource.setrlimit(kind, (soft, hard))


def encode(value, depth=0):
    """A plain-data value as tagged JSON (types kept: 1, 1.0 and True stay apart; tuples are not lists).

    Raises TypeError for anything that is not None, bool, int, float, complex, str, bytes, list, tuple, dict,
    set or frozenset (subclasses are read as their base type), and ValueError past 100 levels of nesting."""
    if depth > 100:
        raise ValueError("nested too deeply")
    if value is None or isinstance(value, bool):
        return None if value is None else bool(value)
    for kind, tag in ((int, "i"), (float, "f")):
        if isinstance(value, kind):
            return {tag: kind.__repr__(value)}
    if isinstance(value, complex):
        return {"c": [float.__repr__(complex(value).real), float.__repr__(complex(value).imag)]}
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, (bytes, bytearray)):
        return {"b": bytes(value).hex()}
    for kind, tag in ((tuple, "t"), (list, "l"), (frozenset, "fs"), (set, "s")):
        if isinstance(value, kind):
            return {tag: [encode(item, depth + 1) for item in kind.__iter__(value)]}
    if isinstance(value, dict):
        return {"d": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in dict.items(value)]}
    raise TypeError(f"not plain data: {type(value).__name__}")


def _error_name(exc):
    try:
        return str(type(exc).__name__)[:80]
    except BaseException:
        return "Exception"


def _run_phase(channel, name, source, namespace):
    """Compile and exec ``source`` (the solution or the setup); False, after reporting, when it raised."""
    try:
        exec(compile(source, f"<{name}>", "exec"), namespace)
        return True
    except BaseException as e:  # SystemExit and KeyboardInterrupt too: nothing may end the run as a success
        channel.emit(phase=name, error=_error_name(e))
        return False


def _run_job(job, channel):
    """Run the UNTRUSTED solution, the setup, then each test; report one record per test, then done."""
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    if _run_phase(channel, "solution", job["solution"], namespace) and \
            (not job["setup"] or _run_phase(channel, "setup", job["setup"], namespace)):
        for i, test in enumerate(job["tests"]):
            try:
                if test["kind"] == "value":
                    value = eval(compile(test["source"], f"<test {i}>", "eval"), namespace)
                    channel.emit(i=i, value=encode(value))
                else:
                    exec(compile(test["source"], f"<test {i}>", "exec"), namespace)
                    channel.emit(i=i, ok=True)
            except BaseException as e:
                channel.emit(i=i, error=_error_name(e))
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        pass
    channel.emit(done=True)


def _inner(job, channel, facts):
    """pid 1 of the new namespaces: isolate further, then run the job; never returns."""
    try:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        if facts.get("pidns"):
            os.setpgid(0, 0)  # kill(0, ...) by the code reaches only its own processes, never the outer
        if facts.get("mountns"):
            _setup_mounts(job, facts)
            _unshare(CLONE_NEWUSER)  # gives up the capabilities that could remount what was made read-only
        _set_limits(job, facts)
        _prctl(PR_SET_DUMPABLE, 0)
        os.closerange(3, channel.fd)
        os.closerange(channel.fd + 1, 1 << 16)
        channel.emit(header=facts)
    except BaseException as e:
        channel.emit(harness_error=f"{_error_name(e)}: {e}"[:300])
        os._exit(3)
    _run_job(job, channel)
    os._exit(0)


def _supervise(pid, timeout_s, channel, parent):
    """Outer: wait for the inner process (pidfd), SIGKILL it at the timeout or on SIGTERM; report; exit. When the
    process that started the sandbox (`parent`) is gone, however it ended (SIGKILL included: this process is then
    re-parented), SIGKILL the inner process and this process group at once, without waiting for the timeout."""
    import time
    killed = []

    def stop(signum, frame):
        killed.append(signum)
        os.kill(pid, signal.SIGKILL)  # not yet reaped, so ``pid`` is still ours

    signal.signal(signal.SIGTERM, stop)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # a SIGTERM that came meanwhile is handled now
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd: poll
        fd = None
    deadline = time.monotonic() + timeout_s
    while True:
        if fd is not None:
            ended = bool(select.select([fd], [], [], max(0.0, min(deadline - time.monotonic(), 0.2)))[0])
        else:
            ended = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        timed_out = not ended and time.monotonic() >= deadline
        if ended or timed_out:
            break
        if os.getppid() != parent:  # the trainer (or reward worker) that started this run is gone
            os.kill(pid, signal.SIGKILL)
            os.killpg(0, signal.SIGKILL)
        if fd is None:
            time.sleep(0.01)
    if timed_out:
        killed.append("timeout")
        os.kill(pid, signal.SIGKILL)
    _, status, usage = os.wait4(pid, 0)
    channel.emit(exit=os.waitstatus_to_exitcode(status), timed_out=timed_out, killed=bool(killed),
                 cpu_s=usage.ru_utime + usage.ru_stime)
    os._exit(0)


def main():
    """The outer process: isolate, fork the inner one, supervise it (see the module docstring); never returns."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # until the supervisor's handler is in place
    with open("job.json", encoding="utf-8") as f:
        job = json.load(f)
    os.unlink("job.json")
    channel = Channel(job["result_fd"], job.pop("token"))
    facts = {"userns": False, "netns": False, "pidns": False, "mountns": False, "private_proc": False, "readonly_fs": False,
             "tmpfs_workdir": False, "dropped_to_uid": None, "hidden": [], "writable": []}
    try:
        _drop_privileges(job, facts)
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        if job["namespaces"]:
            _enter_namespaces(facts)
        else:
            facts["namespaces_off"] = True
    except BaseException as e:
        channel.emit(harness_error=f"{_error_name(e)}: {e}"[:300])
        os._exit(3)
    pid = os.fork()
    if pid == 0:
        _inner(job, channel, facts)
    _prctl(PR_SET_DUMPABLE, 0)
    _supervise(pid, job["timeout_s"], channel, job["parent"])


if __name__ == "__main__":
    main()
