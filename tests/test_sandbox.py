"""The code sandbox: right / partial / wrong code scores 1 / fraction / 0, and escape attempts are contained.

Each escape test's unit tests assert that the escape WORKED, so a contained escape scores 0; what the code saw is
checked from outside too (files not created, no process left, no connection accepted, the secret not seen).
"fallback" runs the same attempt with namespaces switched off (``SandboxLimits(namespaces=False)``): as root that
still drops to a per-run uid, so its guarantees are checked where they hold and its known gaps are asserted as such.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
import time
import tracemalloc
from pathlib import Path

import pytest

from astrai.sandbox import execute as sandbox_module
from astrai.sandbox.code_tests import decode, parse_tests
from astrai.sandbox.execute import SandboxLimits, missing_isolation, run_tests, sandbox_isolation

REPO = Path(__file__).resolve().parents[1]
FAST = SandboxLimits(timeout_s=2.0, cpu_s=2)
ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(10, 5) == 15", "assert add(0, 0) == 0"]
ISOLATION = sandbox_isolation()
NAMESPACES = bool(ISOLATION.get("pidns") and ISOLATION.get("mountns") and ISOLATION.get("netns"))
ROOT = os.geteuid() == 0
MODES = [pytest.param(True, id="namespaces", marks=pytest.mark.skipif(
             not NAMESPACES, reason=f"no user namespaces here: {'; '.join(missing_isolation(ISOLATION))}")),
         pytest.param(False, id="fallback", marks=pytest.mark.skipif(
             not ROOT, reason="the fallback's guarantees below need a root trainer (a per-run uid)"))]


def limits(namespaces: bool = True, **kw) -> SandboxLimits:
    return SandboxLimits(**{"timeout_s": 2.0, "cpu_s": 2, "namespaces": namespaces, **kw})


def survivors(run_id: str) -> list[int]:
    """Pids of live processes whose command line carries the run's id (every sandbox process does)."""
    found = []
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and run_id.encode() in Path(f"/proc/{name}/cmdline").read_bytes():
                found.append(int(name))
        except OSError:
            pass
    return found


def test_right_partial_and_wrong_code_score_one_fraction_zero():
    right = run_tests("def add(a, b):\n    return a + b\n", ADD_TESTS, limits=FAST)
    partial = run_tests("def add(a, b):\n    return a + b if a > 0 else a - b\n", ADD_TESTS, limits=FAST)
    wrong = run_tests("def add(a, b):\n    return str(a + b)\n", ADD_TESTS, limits=FAST)  # '3' != 3
    assert (right.status, right.passed, right.total, right.score) == ("ok", 4, 4, 1.0)
    assert (partial.status, partial.score) == ("ok", 0.75)
    assert partial.test_errors == (None, "wrong value", None, None)  # add(-1, 1) = -2; add(0, 0) = 0 - 0
    assert (wrong.status, wrong.score) == ("ok", 0.0) and set(wrong.test_errors) == {"wrong value"}
    assert right.duration_s < 1.0, right.duration_s


def test_values_are_compared_outside_with_python_equality():
    solution = textwrap.dedent("""
        class AlwaysEqual:
            def __eq__(self, other):
                return True
        VALUES = {"tuple": (1, 2), "list": [1, 2], "int": 1, "nan": float("nan"), "set": {3, 1}, "empty": set(),
                  "dict": {"a": [1, (2, 3)]}, "bytes": b"\\x00a", "none": None, "big": 10 ** 40,
                  "cheat": AlwaysEqual(), "complex": 1 - 2j, "frozen": frozenset({1})}
        def v(key):
            return VALUES[key]
    """)
    cases = [("tuple", "(1, 2)", True), ("tuple", "[1, 2]", False), ("list", "[1, 2]", True), ("int", "1.0", True),
             ("int", "True", True), ("nan", "0.0", False), ("set", "{1, 3}", True), ("empty", "set()", True),
             ("dict", "{'a': [1, (2, 3)]}", True), ("bytes", "b'\\x00a'", True), ("none", "None", True),
             ("big", str(10 ** 40), True), ("cheat", "1", False), ("complex", "(1-2j)", True),
             ("frozen", "frozenset()", False), ("frozen", "{1}", True)]
    tests = [f"assert v({key!r}) == {literal}" for key, literal, _ in cases]
    assert all(t.kind == "value" for t in parse_tests(tests[:-2])), "frozenset() is a call, not a literal"
    result = run_tests(solution, tests, limits=FAST)
    assert [e is None for e in result.test_errors] == [ok for _, _, ok in cases], result.test_errors
    assert result.test_errors[tests.index("assert v('cheat') == 1")] == "TypeError"  # not plain data


def test_parse_tests_kinds_and_errors():
    value, reversed_, plain = parse_tests(["assert f(1) == [2, -3]", "assert 'x' == g()", "assert h(2) > 1"])
    assert (value.kind, value.source, value.expected) == ("value", "f(1)", [2, -3])
    assert (reversed_.kind, reversed_.source, reversed_.expected) == ("value", "g()", "x")
    assert (plain.kind, plain.source) == ("assert", "assert h(2) > 1")
    assert len(parse_tests("assert f(1) == 1\nassert f(2) == 2\n")) == 2
    with pytest.raises(ValueError, match=r"tests\[1\]: expected only assert statements, got Expr"):
        parse_tests(["assert f(1) == 1", "f(2)"])
    with pytest.raises(ValueError, match=r"tests\[0\]: not valid Python"):
        parse_tests(["assert f(1 =="])
    with pytest.raises(ValueError, match=r"row 3\[0\]: expected a string"):
        parse_tests([1], where="row 3")
    with pytest.raises(ValueError, match="bad record tag"):
        decode({"x": 1})


def test_statuses_syntax_error_error_setup_and_memory():
    assert run_tests("def add(a, b:\n", ADD_TESTS, limits=FAST).status == "syntax_error"
    raised = run_tests("def add(a, b):\n    return a + b\nraise RuntimeError('boom')\n", ADD_TESTS, limits=FAST)
    assert (raised.status, raised.score, raised.detail) == ("error", 0.0, "solution: RuntimeError")
    setup = run_tests("def root(x):\n    return x ** 0.5\n", ["assert math.isclose(root(2.0), math.sqrt(2))"],
                      setup="import math", limits=FAST)
    assert (setup.status, setup.score) == ("ok", 1.0)
    big = run_tests("x = bytearray(1 << 34)\ndef add(a, b):\n    return a + b\n", ADD_TESTS, limits=FAST)
    grow = run_tests("chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 20))\n", ADD_TESTS,
                     limits=limits(memory_bytes=128 << 20))
    assert (big.status, big.score) == ("memory", 0.0) and (grow.status, grow.score) == ("memory", 0.0)


FAKES = {
    "print marker, exit 0": "print('all tests passed'); print('OK 4/4')\nimport sys\nsys.exit(0)\n",
    "os._exit(0) early": "import os\nos._exit(0)\n",
    "forged records on every fd": textwrap.dedent("""
        import json, os
        for fd in range(64):
            for i in range(4):
                try:
                    os.write(fd, (json.dumps({"t": "0" * 32, "i": i, "ok": True}) + "\\n").encode())
                    os.write(fd, b'{"done": true, "exit": 0}\\n')
                except OSError:
                    pass
    """),
    "SystemExit inside the function": "def add(a, b):\n    raise SystemExit(0)\n",
    "os._exit inside the function": "def add(a, b):\n    import os\n    os._exit(0)\n",
    "KeyboardInterrupt": "def add(a, b):\n    raise KeyboardInterrupt\n",
}


@pytest.mark.parametrize("name", list(FAKES))
def test_faked_success_scores_zero(name):
    result = run_tests(FAKES[name], ADD_TESTS + ["assert add(2, 2) > 3"], limits=FAST)
    assert result.score == 0.0, (name, result)


def test_infinite_loop_times_out_and_cpu_limit_holds():
    start = time.monotonic()
    loop = run_tests("while True:\n    pass\n", ADD_TESTS, limits=limits(timeout_s=1.0))
    assert (loop.status, loop.score, loop.detail) == ("timeout", 0.0, "wall clock")
    assert 1.0 <= time.monotonic() - start < 2.5
    cpu = run_tests("while True:\n    pass\n", ADD_TESTS, limits=limits(timeout_s=10.0, cpu_s=1))
    assert (cpu.status, cpu.detail) == ("timeout", "cpu time") and cpu.duration_s < 6.0, cpu  # 2 busy cores
    sleeper = run_tests("import time\ntime.sleep(30)\n", ADD_TESTS, limits=limits(timeout_s=0.5))
    assert (sleeper.status, sleeper.score) == ("timeout", 0.0) and not survivors(sleeper.run_id)


FORK_BOMB = textwrap.dedent("""
    import os, time
    while True:
        try:
            pid = os.fork()
        except OSError:
            time.sleep(30)
            continue
        if pid == 0:
            os.setsid()  # leave the session, as a daemon would
            os.write(1, b"p")
""")


@pytest.mark.parametrize("namespaces", MODES)
def test_fork_bomb_is_bounded_and_every_process_is_gone(namespaces):
    result = run_tests(FORK_BOMB, ADD_TESTS, limits=limits(namespaces, timeout_s=1.5, processes=16))
    assert (result.status, result.score) == ("timeout", 0.0), result
    assert 3 <= result.output.count("p") < 16, result.output  # the bomb ran into RLIMIT_NPROC
    assert survivors(result.run_id) == []


@pytest.mark.parametrize("namespaces", MODES)
def test_daemon_left_behind_is_killed(namespaces):
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\ndef add(a, b):\n    return a + b\n"
    result = run_tests(code, ADD_TESTS, limits=limits(namespaces))
    assert (result.status, result.score) == ("ok", 1.0) and result.duration_s < 1.5
    assert survivors(result.run_id) == []


def test_huge_output_is_capped_without_memory_in_the_trainer():
    tracemalloc.start()
    try:
        out = run_tests("while True:\n    print('x' * 100000, flush=True)\n", ADD_TESTS, limits=FAST)
        err = run_tests("import os\nwhile True:\n    os.write(2, b'y' * 100000)\n", ADD_TESTS, limits=FAST)
        value = run_tests("def add(a, b):\n    return 'z' * (8 << 20)\n", ADD_TESTS, limits=FAST)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    for result in (out, err, value):
        assert (result.status, result.score) == ("output_limit", 0.0), result.detail
        assert len(result.output.encode()) <= FAST.output_bytes and result.duration_s < 1.5
    assert value.detail == "result past its cap"
    assert peak < 8 << 20, peak  # the 8 MiB value and the endless prints never sat in the trainer


WRITER = textwrap.dedent("""
    import errno, os
    TARGETS = {TARGETS}
    OUTCOME = {{}}
    for name, path in TARGETS.items():
        try:
            with open(path, "w") as f:
                f.write("x")
            OUTCOME[name] = "written"
        except OSError as e:
            OUTCOME[name] = errno.errorcode[e.errno]
    try:
        with open("big.bin", "wb") as f:
            f.write(b"x" * (2 << 20))
        OUTCOME["2 MiB file"] = "written"
    except OSError as e:
        OUTCOME["2 MiB file"] = errno.errorcode[e.errno]
    print(OUTCOME)
    def wrote(name):
        return OUTCOME[name] == "written"
""")


@pytest.mark.parametrize("namespaces", MODES)
def test_writes_outside_the_working_directory(namespaces, tmp_path):
    tag = f"astrai-escape-{os.getpid()}-{int(namespaces)}"
    targets = {"test tmp_path": str(tmp_path / "outside.txt"), "trainer cwd": os.path.join(os.getcwd(), tag),
               "repo": str(REPO / tag), "/tmp": f"/tmp/{tag}", "/dev/shm": f"/dev/shm/{tag}",
               "/var/tmp": f"/var/tmp/{tag}", "home": os.path.expanduser(f"~/{tag}"), "own dir": "inside.txt"}
    names = list(targets) + ["2 MiB file"]
    try:
        result = run_tests(WRITER.format(TARGETS=repr(targets)), [f"assert wrote({n!r}) == True" for n in names],
                           limits=limits(namespaces))
        escaped = {n for n, e in zip(names, result.test_errors) if e is None}
        assert not (tmp_path / "outside.txt").exists() and not Path(targets["trainer cwd"]).exists()
        assert not (REPO / tag).exists() and not Path(targets["home"]).exists()
        if namespaces:  # read-only everything, empty read-only tmpfs over /tmp, /dev/shm ...
            assert escaped == {"own dir"}, result.output
            assert all(not Path(targets[n]).exists() for n in ("/tmp", "/dev/shm", "/var/tmp"))
        else:  # the known gap without a mount namespace: world-writable directories
            assert escaped == {"own dir", "/tmp", "/dev/shm", "/var/tmp"}, result.output
            assert all(Path(targets[n]).stat().st_size == 1 for n in ("/tmp", "/dev/shm", "/var/tmp"))
        assert "'2 MiB file': 'EFBIG'" in result.output  # RLIMIT_FSIZE (1 MiB)
    finally:
        for path in targets.values():
            if os.path.isabs(path) and os.path.exists(path):
                os.unlink(path)


SPY = textwrap.dedent("""
    import os
    SECRET = b"hf_" + b"s3cret-token-8841"
    def seen():
        places = [k for k, v in os.environ.items() if SECRET.decode() in v]
        for pid in os.listdir("/proc"):
            for leaf in ("environ", "cmdline"):
                try:
                    with open(f"/proc/{pid}/{leaf}", "rb") as f:
                        if SECRET in f.read():
                            places.append(f"/proc/{pid}/{leaf}")
                except OSError:
                    pass
        try:
            with open(os.path.expanduser("~/.cache/huggingface/token"), "rb") as f:
                places.append("token file") if SECRET in f.read() else None
        except OSError:
            pass
        for path in ("/proc/%d/environ" % TRAINER, "/proc/%d/environ" % os.getppid()):
            try:
                open(path, "rb").read()
                places.append("read " + path)
            except OSError:
                pass
        return places
    print(sorted(os.environ), seen())
""")


@pytest.mark.parametrize("namespaces", MODES)
def test_trainer_secrets_are_not_readable(namespaces, tmp_path):
    """A trainer process started with HF_TOKEN / WANDB_API_KEY in its environment and a token file in its home."""
    home = tmp_path / "home"
    (home / ".cache/huggingface").mkdir(parents=True)
    (home / ".cache/huggingface/token").write_text("hf_s3cret-token-8841")
    script = textwrap.dedent(f"""
        import json, os
        from astrai.sandbox.execute import SandboxLimits, run_tests
        code = "TRAINER = %d\\n" % os.getpid() + {SPY!r}
        r = run_tests(code, ["assert len(seen()) > 0", "assert sorted(os.environ) == ['LANG', 'PATH']"],
                      limits=SandboxLimits(namespaces={namespaces}, timeout_s=2.0))
        print(json.dumps([r.status, r.test_errors, r.output]))
    """)
    env = {**os.environ, "HF_TOKEN": "hf_s3cret-token-8841", "WANDB_API_KEY": "hf_s3cret-token-8841",
           "HOME": str(home)}
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    status, errors, output = json.loads(proc.stdout.strip().splitlines()[-1])
    assert status == "ok" and errors == ["AssertionError", None], output  # nothing seen; the environment is minimal
    assert "['LANG', 'PATH'] []" in output


@pytest.mark.parametrize("namespaces", MODES)
def test_network_connection_to_the_trainer_host_fails(namespaces):
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.3)
    port = listener.getsockname()[1]
    code = textwrap.dedent(f"""
        import socket
        def connect(host):
            s = socket.socket()
            s.settimeout(1.0)
            try:
                s.connect((host, {port}))
                return True
            except OSError as e:
                print(host, type(e).__name__, e.errno)
                return False
    """)
    with listener:
        result = run_tests(code, ["assert connect('127.0.0.1') == True"], limits=limits(namespaces))
        try:
            listener.accept()[0].close()
            accepted = True
        except socket.timeout:
            accepted = False
    if namespaces:
        assert (result.score, accepted) == (0.0, False), result.output  # ENETUNREACH: no network in the namespace
    else:  # without a network namespace the connection goes through: the test can tell the difference
        assert (result.score, accepted) == (1.0, True), result.output


@pytest.mark.parametrize("namespaces", MODES)
def test_killing_the_parent_or_the_trainer_harms_nothing(namespaces):
    code = textwrap.dedent(f"""
        import os, signal
        def attempt(what, fn):
            try:
                fn()
                print(what, "sent")
            except OSError as e:
                print(what, type(e).__name__)
        attempt("trainer SIGKILL", lambda: os.kill({os.getpid()}, signal.SIGKILL))
        attempt("trainer SIGTERM", lambda: os.kill({os.getpid()}, signal.SIGTERM))
        attempt("parent SIGKILL", lambda: os.kill(os.getppid(), signal.SIGKILL))
        attempt("group SIGKILL", lambda: os.killpg(os.getpgid(0), signal.SIGKILL))
        attempt("everyone SIGKILL", lambda: os.kill(-1, signal.SIGKILL))
    """)
    result = run_tests(code, ADD_TESTS, limits=limits(namespaces))
    assert result.score == 0.0 and result.status in ("ok", "crashed"), result
    assert survivors(result.run_id) == []
    again = run_tests("def add(a, b):\n    return a + b\n", ADD_TESTS, limits=limits(namespaces))
    assert again.score == 1.0  # this process and the sandbox still work


def test_fresh_directory_each_run_removed_afterwards(tmp_path):
    base = tmp_path / "runs"
    base.mkdir()
    lim = limits(tmp_dir=str(base))
    first = run_tests("open('marker', 'w').write('x')\nimport os\nos.mkdir('d', 0)\n", [], limits=lim)
    second = run_tests("import os\ndef leftover():\n    return sorted(os.listdir('.'))\n",
                       ["assert leftover() == []"], limits=lim)
    assert first.status == "ok" and second.score == 1.0
    assert list(base.iterdir()) == []


def test_isolation_is_reported_once(caplog, monkeypatch):
    assert set(ISOLATION) >= {"netns", "pidns", "mountns", "private_proc", "readonly_fs", "nproc_scope"}
    assert missing_isolation({"netns": True, "pidns": True, "mountns": True, "private_proc": True,
                              "readonly_fs": True}) == []
    phrases = missing_isolation({"unshare_error": "unshare: Operation not permitted"})
    assert len(phrases) == 3 and "Operation not permitted" in phrases[0]
    monkeypatch.setattr(sandbox_module, "_NOTED", [])
    with caplog.at_level(logging.WARNING, logger="astrai.sandbox"):
        for _ in range(2):
            run_tests("", [], limits=limits(False))
    lines = [r.getMessage() for r in caplog.records if r.name == "astrai.sandbox"]
    assert len(lines) == 1 and lines[0].startswith(
        "sandbox: weaker isolation (namespaces switched off): no network namespace: the code can open network")


def test_limits_are_validated():
    with pytest.raises(ValueError, match="sandbox limits: timeout_s must be a positive number"):
        SandboxLimits(timeout_s=0)
    with pytest.raises(ValueError, match="sandbox limits: memory_bytes must be a positive int"):
        SandboxLimits(memory_bytes=1.5)
    with pytest.raises(ValueError, match="sandbox limits: open_files must be at least 8"):
        SandboxLimits(open_files=4)
    with pytest.raises(ValueError, match="sandbox limits: python must be the path of an interpreter .* got ''"):
        SandboxLimits(python="")  # issue 42, class 2: was replaced by the trainer's interpreter (`python or ...`)


def _children(pid: int) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and int(Path(f"/proc/{name}/stat").read_text().rpartition(")")[2].split()[1]) == pid:
                found.append(int(name))
        except (OSError, ValueError, IndexError):
            pass
    return found


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("namespaces", MODES)
def test_a_run_dies_with_its_sigkilled_trainer_before_its_timeout(namespaces, tmp_path):
    """Issue 42, class 6: the sandbox's processes (outer supervisor and the sleeping code) end when the trainer that
    started them is SIGKILLed, instead of living on re-parented until the run's 300 s wall-clock timeout. (The
    killed trainer cannot remove its work folder: it goes under tmp_path, not /tmp.)"""
    trainer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        from astrai.sandbox.execute import SandboxLimits, run_tests
        run_tests("import time\\ntime.sleep(300)\\n", ["assert True"],
                  limits=SandboxLimits(timeout_s=300, cpu_s=300, namespaces={namespaces}, tmp_dir={str(tmp_path)!r}))
    """)], cwd=REPO)
    started: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the outer process and, under it, the inner one running the code
            started = [p for p in _children(trainer.pid) if b"astrai-sandbox" in _cmdline(p)]
            started += [c for p in started for c in _children(p)]
            if len(started) >= 2:
                break
            time.sleep(0.1)
        assert len(started) >= 2, started
        trainer.kill()
        trainer.wait()
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in started) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [p for p in started if _alive(p)] == []
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        for p in started:
            if _alive(p):
                os.kill(p, 9)
