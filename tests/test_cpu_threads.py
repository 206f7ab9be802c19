"""Adaptive CPU threads (`astrai.cpu_threads`, `runtime.adaptive_threads`).

The governor's decisions against hand-made counter readings (wait and idle seconds on a fake clock), the real
counters under busy-loop processes on every core, the paged engine's scope (the caller's count back after
`generate` and `step`, the same tokens when the count never moved), the trainer's scope, the job's switch (on by
default, off when asked, under `runtime.deterministic` and for other engines), and the metrics of a job.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import warnings

import pytest
import torch

from astrai.models import AutoRegressiveLM, tiny_config
from astrai.cpu_threads import ThreadGovernor, cpu_readings, readings_unavailable
from astrai.rollout.paged_engine import PagedGenerationEngine
from astrai.rollout.sampling import SamplingParams

needs_proc = pytest.mark.skipif(readings_unavailable() is not None, reason="no /proc scheduler counters here")


class Feed:
    """A fake clock and counters: `advance(seconds, wait=cores, idle=cores)` moves both."""

    def __init__(self):
        self.now, self.wait, self.idle, self.reads = 0.0, 0.0, 0.0, 0

    def advance(self, seconds: float, *, wait: float = 0.0, idle: float = 0.0) -> None:
        self.now += seconds
        self.wait += wait * seconds
        self.idle += idle * seconds

    def readings(self):
        self.reads += 1
        return self.wait, self.idle


@pytest.fixture()
def threads():
    """Sets torch's thread count for a test and puts the suite's back after it."""
    before = torch.get_num_threads()

    def use(n: int) -> None:
        torch.set_num_threads(n)
    yield use
    torch.set_num_threads(before)


def governor(feed: Feed, **kwargs) -> ThreadGovernor:
    changes = kwargs.pop("changes", None)
    return ThreadGovernor(readings=feed.readings, clock=lambda: feed.now,
                          on_change=None if changes is None else lambda *c: changes.append(c), **kwargs)


def run_steps(gov: ThreadGovernor, feed: Feed, seconds: float, *, wait: float = 0.0, idle: float = 0.0,
              step: float = 0.1) -> list[int]:
    """Ticks every `step` seconds for `seconds` under the given load; the count after each tick (the one `tick`
    returns, checked against torch's)."""
    counts = []
    for _ in range(round(seconds / step)):
        counts.append(gov.tick())
        assert counts[-1] == torch.get_num_threads()
        feed.advance(step, wait=wait, idle=idle)
    return counts


def test_wait_shrinks_the_team_idle_grows_it_back_and_the_scope_restores_the_callers_count(threads):
    threads(2)
    feed, changes = Feed(), []
    gov = governor(feed, changes=changes)
    with gov.scope():
        assert run_steps(gov, feed, 1.0, wait=0.01) == [2] * 10  # quiet: wait ~0.01, no idle core
        counts = run_steps(gov, feed, 1.0, wait=0.7)  # a busy second core
        assert counts[-1] == 1 and gov.threads == 1
        assert run_steps(gov, feed, 2.0, wait=0.0, idle=0.0) == [1] * 20  # still busy: no idle core at 1 thread
        counts = run_steps(gov, feed, 1.0, idle=1.0)  # the other process left
        assert counts[-1] == 2
    assert changes == [(2, 1, 2), (1, 2, 2)]
    assert torch.get_num_threads() == 2


def test_the_count_moves_by_the_cores_waited_for_and_never_past_the_callers_count(threads):
    threads(8)
    feed = Feed()
    gov = governor(feed)

    def window(**load) -> int:
        """One decision over one period of `load`."""
        feed.advance(0.5, **load)
        gov.tick()
        return gov.threads
    with gov.scope():
        gov.tick()  # starts the first window
        assert window(wait=2.6) == 5  # 8 - round(2.6)
        assert window(idle=1.4) == 6  # 5 + round(1.4)
        assert window(wait=0.2, idle=0.5) == 6  # below both thresholds
        assert window(idle=7.0) == 8  # up to the caller's count, never past it
        assert window(idle=7.0) == 8
        assert window(wait=30.0) == 1  # never below one
    assert torch.get_num_threads() == 8


def test_readings_are_taken_once_per_period_and_never_with_one_thread(threads):
    threads(2)
    feed = Feed()
    gov = governor(feed, period=0.5)
    with gov.scope():
        run_steps(gov, feed, 2.0, step=0.01)  # 200 steps in 2 s: a reading at the first tick, then every 0.5 s
    assert feed.reads == 4
    threads(1)
    feed1 = Feed()
    gov1 = governor(feed1)
    with gov1.scope():
        counts = run_steps(gov1, feed1, 3.0, wait=5.0)
    assert feed1.reads == 0 and torch.get_num_threads() == 1
    assert counts == [1] * 30


def test_the_choice_lasts_between_scopes_but_a_pause_starts_a_new_window(threads):
    threads(2)
    feed = Feed()
    gov = governor(feed)
    with gov.scope():
        run_steps(gov, feed, 1.0, wait=0.8)
    assert gov.threads == 1 and torch.get_num_threads() == 2  # the caller's count outside
    feed.advance(30.0, idle=2.0)  # training ran: its idle time is not the engine's to judge
    with gov.scope():
        assert torch.get_num_threads() == 1  # the choice applies again on entry
        gov.tick()  # the first tick after the pause only starts a window
        assert gov.threads == 1
        feed.advance(0.6, idle=1.0)
        gov.tick()
        assert gov.threads == 2
    # streamed steps (one scope each) follow each other closely: one window spans them
    feed2 = Feed()
    gov2 = governor(feed2)
    for _ in range(12):
        with gov2.scope():
            gov2.tick()
        feed2.advance(0.1, wait=0.9)
    assert gov2.threads == 1


def test_the_callers_count_comes_back_after_an_error_and_a_failed_reading_changes_nothing(threads):
    threads(2)
    feed = Feed()
    gov = governor(feed)
    with pytest.raises(RuntimeError, match="inside"):
        with gov.scope():
            run_steps(gov, feed, 1.0, wait=0.9)
            assert torch.get_num_threads() == 1
            raise RuntimeError("inside")
    assert torch.get_num_threads() == 2

    def broken():
        raise OSError("no /proc")
    gov2 = ThreadGovernor(readings=broken, clock=lambda: feed.now)
    with gov2.scope():
        for _ in range(10):
            gov2.tick()
            feed.advance(1.0)
        assert gov2.threads == 2
    with pytest.raises(ValueError, match="period, wait_down and idle_up must be > 0"):
        ThreadGovernor(period=0)


def test_a_scope_inside_a_scope_of_the_same_governor_changes_nothing(threads):
    """The trainer holds a scope around its whole step; the micro-batches' own scope inside it keeps the count."""
    threads(2)
    feed = Feed()
    gov = governor(feed)
    with gov.scope():
        run_steps(gov, feed, 1.0, wait=0.8)
        assert torch.get_num_threads() == 1
        with gov.scope():
            assert torch.get_num_threads() == 1 and gov.ceiling == 2
            run_steps(gov, feed, 0.5, wait=0.8)
        assert torch.get_num_threads() == 1  # the inner exit restored nothing
    assert torch.get_num_threads() == 2
    with gov.scope():  # usable again after the outer one closed
        assert gov.ceiling == 2


def test_inside_another_governors_scope_the_engine_ticks_that_one(threads):
    """A training step holds the trainer's scope: the engine's decode steps feed its decisions (the engine's own
    governor takes no reading), and the count the trainer's governor chose holds after the engine returns."""
    from astrai.cpu_threads import active_governor

    threads(2)
    engine = tiny_engine(adaptive_threads=True)
    own_reads = []
    engine.threads.readings = lambda: own_reads.append(1) or (0.0, 0.0)
    engine.threads.period = 1e-9
    feed = Feed()
    outer = governor(feed, period=1e-9)
    feed_on_read = outer.readings

    def busy_reading():  # every reading: another 0.8 cores waited since the last
        feed.advance(1.0, wait=0.8)
        return feed_on_read()
    outer.readings = busy_reading
    assert active_governor() is None
    with outer.scope():
        assert active_governor() is outer
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=16), torch.Generator().manual_seed(0))
        assert outer.threads == 1 and torch.get_num_threads() == 1  # the engine's steps decided it
        assert engine.last_stats["threads_mean"] < 2
    assert own_reads == [] and active_governor() is None and torch.get_num_threads() == 2


@contextlib.contextmanager
def busy_loops(count: int):
    """`count` busy-loop processes (one per core saturates the machine), killed on exit."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        time.sleep(0.3)
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


@needs_proc
def test_the_real_counters_see_busy_cores(threads):
    """With a busy loop on every core, a two-thread GEMM loop waits for its cores (the signal the governor acts on)."""
    threads(2)
    a = torch.randn(256, 256)
    with busy_loops(len(os.sched_getaffinity(0))):
        wait0, _ = cpu_readings()
        start = time.perf_counter()
        while time.perf_counter() - start < 1.0:
            a @ a
        wait1, _ = cpu_readings()
    assert (wait1 - wait0) / (time.perf_counter() - start) >= 0.3


def tiny_engine(**kwargs) -> PagedGenerationEngine:
    torch.manual_seed(0)
    return PagedGenerationEngine(AutoRegressiveLM(tiny_config()), pad_token_id=0, **kwargs)


PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]


@needs_proc
def test_the_engine_decodes_with_fewer_threads_under_load_and_gives_the_count_back(threads):
    threads(2)
    engine = tiny_engine(adaptive_threads=True)
    engine.threads.period = 0.05  # the tiny model's steps are short: decide often
    params = SamplingParams(max_new_tokens=120)
    with busy_loops(len(os.sched_getaffinity(0))), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(40):  # enough decoding for several windows on any machine
            engine.generate(PROMPTS * 8, params, torch.Generator().manual_seed(0))
            assert torch.get_num_threads() == 2
            if engine.last_stats["threads_mean"] < 2:
                break
    assert engine.last_stats["threads_mean"] < 2
    assert engine.thread_steps[0] < 2 * engine.thread_steps[1]  # over all the calls
    said = [str(w.message) for w in caught if "runtime.adaptive_threads" in str(w.message)]
    assert said == ["runtime.adaptive_threads: other processes are busy on this machine's cores; the engine decodes "
                    "with 1 of 2 threads while they are (said once)"]
    # the streaming API's steps run in the same scope
    engine.add_request(PROMPTS[0], SamplingParams(max_new_tokens=8))
    while engine.has_unfinished_requests:
        engine.step()
        assert torch.get_num_threads() == 2


def test_with_one_thread_the_adaptive_engine_is_the_same_engine(threads):
    threads(1)
    params = SamplingParams(max_new_tokens=24)
    plain = tiny_engine().generate(PROMPTS, params, torch.Generator().manual_seed(3), n=2)
    adaptive_engine = tiny_engine(adaptive_threads=True)
    adaptive = adaptive_engine.generate(PROMPTS, params, torch.Generator().manual_seed(3), n=2)
    assert torch.equal(plain.response_ids, adaptive.response_ids)
    assert torch.equal(plain.old_logprobs, adaptive.old_logprobs)
    if adaptive_engine.threads is not None:
        assert adaptive_engine.last_stats["threads_mean"] == 1.0
    assert "threads_mean" not in tiny_engine().last_stats


def test_the_engine_says_once_when_the_system_cannot_report_the_load(threads, monkeypatch):
    import astrai.cpu_threads as cpu_threads

    threads(2)
    monkeypatch.setattr(cpu_threads, "readings_unavailable", lambda: "this system does not report scheduler waits")
    with pytest.warns(UserWarning, match=r"^runtime.adaptive_threads: this system does not report scheduler waits; "
                                         r"the engine keeps 2 threads under any load$"):
        engine = tiny_engine(adaptive_threads=True)
    assert engine.threads is None


def test_the_job_turns_it_on_by_default_and_off_when_asked_or_deterministic(tiny_model_dir):
    import types

    from astrai.config import load_config
    from astrai.rollout.build import _engine_options
    from astrai.trainer.build import training_threads

    def config_of(*flags):
        return load_config(None, ["--train_type", "online_grpo", "--model.path", str(tiny_model_dir), *flags])
    cpu = types.SimpleNamespace(device=torch.device("cpu"), is_main=True)
    gpu = types.SimpleNamespace(device=torch.device("cuda"), is_main=True)
    assert _engine_options(config_of())["adaptive_threads"] is True
    assert (training_threads(config_of(), cpu) is not None) == (readings_unavailable() is None)
    assert training_threads(config_of(), gpu) is None
    for flags in (["--runtime.adaptive_threads", "false"], ["--runtime.deterministic", "true"]):
        assert "adaptive_threads" not in _engine_options(config_of(*flags)), flags
        assert training_threads(config_of(*flags), cpu) is None, flags
    assert "adaptive_threads" not in _engine_options(config_of("--rollout.engine", "vllm"))
    config = config_of()
    config.rollout.engine_options = {"adaptive_threads": False}
    with pytest.raises(ValueError, match="'adaptive_threads' is set through its own field"):
        _engine_options(config)


@needs_proc
def test_a_job_logs_the_engines_and_the_trainings_thread_counts(tiny_model_dir, tmp_path):
    import json

    from test_train_e2e import tiny_args

    from astrai.train import main

    out = tmp_path / "run"
    assert main(tiny_args(tiny_model_dir, out, "--max_steps", "1")) == 0
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert record["rollout/engine_threads"] == 1.0  # the suite's one thread: nothing to lower
    assert record["policy/threads"] == 1.0 and record["critic/threads"] == 1.0


def test_a_busy_machine_lowers_the_steps_threads_and_the_job_says_so_once(tiny_model_dir, tmp_path, monkeypatch):
    """The counters replaced by a machine whose other processes take 0.8 cores all the time, decisions at every
    tick: with two threads the engine's decode steps and the training's micro-batches drop to one; the job's count
    is two again after it, the lowering is said once, and the job trains."""
    import json

    from test_train_e2e import tiny_args

    import astrai.cpu_threads as cpu_threads
    from astrai.train import main

    monkeypatch.setattr(cpu_threads, "readings_unavailable", lambda: None)
    monkeypatch.setattr(cpu_threads, "cpu_readings", lambda: (0.8 * time.perf_counter(), 0.0))
    monkeypatch.setattr(cpu_threads, "DECISION_PERIOD", 1e-9)
    before = torch.get_num_threads()
    out = tmp_path / "run"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert main(tiny_args(tiny_model_dir, out, "--max_steps", "2", "--runtime.num_threads", "2")) == 0
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2
    for record in records:
        assert 1.0 <= record["rollout/engine_threads"] < 2.0
        assert 1.0 <= record["policy/threads"] < 2.0 and 1.0 <= record["critic/threads"] < 2.0
    said = [str(w.message) for w in caught if "runtime.adaptive_threads" in str(w.message)]
    assert said == ["runtime.adaptive_threads: other processes are busy on this machine's cores; the training step "
                    "(rollout, scoring, updates) runs with 1 of 2 threads while they are (the mean count: "
                    "rollout/engine_threads and policy/threads; said once)"]  # not the engine's: it ticks the step's


def test_a_deterministic_cpu_job_with_threads_to_spare_says_its_count_stays(tiny_model_dir, threads, capsys):
    import types

    from astrai.config import load_config
    from astrai.trainer.build import training_threads

    threads(2)
    cpu = types.SimpleNamespace(device=torch.device("cpu"), is_main=True)
    config = load_config(None, ["--train_type", "online_grpo", "--model.path", str(tiny_model_dir),
                                "--runtime.deterministic", "true"])
    assert training_threads(config, cpu) is None
    assert capsys.readouterr().err == ("runtime.deterministic: the job keeps 2 threads even while other processes "
                                       "busy the cores (runtime.adaptive_threads is off in bitwise runs: a thread "
                                       "count changes float rounding)\n")


def test_evaluate_and_serve_take_the_switch_and_evaluate_reports_the_mean_count(tiny_model_dir, tmp_path,
                                                                              monkeypatch, capsys):
    import json
    import types

    from test_evaluate import EVEN_LENGTH, cli

    from astrai.evaluation.cli import mean_threads, report
    from astrai.rewards import builtins as rewards
    from astrai.serve.__main__ import build_engine, parse_args

    monkeypatch.setitem(rewards.BUILTIN_REWARDS, "even_length", EVEN_LENGTH)
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i} + 1", "answer": str(i + 1)}) + "\n" for i in range(3)))
    for flag, expected in (([], 1.0), (["--adaptive_threads", "false"], None)):
        out = tmp_path / f"out{len(flag)}"
        assert cli(tiny_model_dir, data, out, "--reward", "even_length", *flag) == 0
        settings = json.loads((out / "summary.json").read_text())["settings"]
        assert settings["threads_mean"] == (expected if readings_unavailable() is None else None), flag
    assert mean_threads(types.SimpleNamespace(thread_steps=[5, 4])) == 1.25
    assert mean_threads(types.SimpleNamespace(thread_steps=[0, 0])) is None and mean_threads(object()) is None
    summary = json.loads((tmp_path / "out0" / "summary.json").read_text())
    capsys.readouterr()
    summary["settings"].update(threads=2, threads_mean=1.25)
    report(summary, tmp_path)  # the throughput line names the mean when it was below the count
    assert "tok/s, 2 threads, 1.25 on average: other processes were busy (runtime.adaptive_threads))" in \
        capsys.readouterr().out
    summary["settings"].update(threads=2, threads_mean=2.0)
    report(summary, tmp_path)
    assert "tok/s, 2 threads)" in capsys.readouterr().out
    engine = build_engine(parse_args(["--checkpoint", str(tiny_model_dir), "--adaptive_threads", "false"]))[0]
    assert engine.threads is None
    engine = build_engine(parse_args(["--checkpoint", str(tiny_model_dir)]))[0]
    assert (engine.threads is not None) == (readings_unavailable() is None)

