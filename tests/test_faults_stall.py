"""Issue 28 part 3, stalled ranks: `distributed.timeout_seconds` (alias `ddp_timeout`) is the process group's timeout;
a rank that stops answering (a real SIGSTOP) ends the job within the timeout plus a margin, with one line naming
the timeout and the rank."""

import multiprocessing as mp
import os
import signal
import time
import traceback
from datetime import timedelta

import pytest
import torch
from fault_jobs import rank_pids, sft_args, steps_of, torchrun, wait_for, write_chats

from astrai.config import ConfigError, config_from_dict, load_config

TIMEOUT_S = 3


def test_timeout_seconds_and_its_ddp_timeout_alias():
    assert config_from_dict({}).distributed.timeout_seconds == 600
    assert load_config(None, ["--ddp_timeout", "90"]).distributed.timeout_seconds == 90
    assert config_from_dict({"distributed": {"ddp_timeout": 45}}).distributed.timeout_seconds == 45
    assert load_config(None, ["--distributed.ddp_timeout", "30"]).distributed.timeout_seconds == 30
    with pytest.raises(ConfigError, match="distributed.ddp_timeout: set together with distributed.timeout_seconds"):
        config_from_dict({"distributed": {"ddp_timeout": 45, "timeout_seconds": 60}})
    with pytest.raises(ConfigError, match="distributed.timeout_seconds: expected a number > 0"):
        load_config(None, ["--ddp_timeout", "0"])


class Peers:
    """The part of `DistributedContext` that `describe_stall` reads."""

    def __init__(self, rank):
        self.rank, self.world_size = rank, 2
        self.peers = [{"host": "node-a", "pid": 100}, {"host": "node-b", "pid": 101}]


def _stall(rank, tmp, results):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=2,
                                         timeout=timedelta(seconds=TIMEOUT_S))
    from astrai.distributed.rank_checks import describe_stall, is_timeout

    torch.distributed.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # stops answering, for good
    start = time.monotonic()
    try:
        torch.distributed.all_reduce(torch.ones(3))
        results.put({"error": "the all-reduce completed"})
    except Exception as exc:  # noqa: BLE001 - what a rank sees
        try:
            waited = time.monotonic() - start
            line, silent = describe_stall(Peers(rank), TIMEOUT_S, exc)
            results.put({"timeout": is_timeout(exc), "line": line, "silent": silent, "waited": waited,
                         "total": time.monotonic() - start})
        except Exception:  # noqa: BLE001
            results.put({"error": traceback.format_exc()})


def test_a_stopped_rank_is_named_after_the_timeout():
    import tempfile

    tmp = tempfile.mkdtemp()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_stall, args=(rank, tmp, results)) for rank in range(2)]
    for p in procs:
        p.start()
    try:
        out = results.get(timeout=120)
    finally:
        for p in procs:
            p.kill()
            p.join(30)
    assert "error" not in out, out["error"]
    assert out["timeout"] and out["silent"] == [1]
    assert out["line"] == (f"rank 0: a collective did not complete within distributed.timeout_seconds {TIMEOUT_S}: "
                           "rank 1 (host node-b, pid 101) stopped answering; the job stops (raise "
                           "--distributed.timeout_seconds for slow phases)")
    assert TIMEOUT_S <= out["waited"] < TIMEOUT_S + 5 and out["total"] < TIMEOUT_S + 10
    print(f"SIGSTOP -> rank 0 knows: {out['total']:.2f} s (timeout {TIMEOUT_S} s)")


@pytest.mark.slow
def test_a_stopped_rank_ends_a_torchrun_job(tiny_model_dir, tmp_path):
    """The real job: rank 1 SIGSTOPped after step 2; rank 0 times out after distributed.timeout_seconds, says so in
    one line naming rank 1 and exits 124; torchrun then kills the stopped rank (its 30 s shutdown wait)."""
    chats = write_chats(tmp_path / "chats.jsonl")
    out = tmp_path / "run"
    timeout = 15
    proc = torchrun(sft_args(tiny_model_dir, out, chats, "--max_steps", 100000, "--distributed.timeout_seconds",
                             timeout))
    try:
        ranks = rank_pids(proc.pid, 2)
        wait_for(lambda: len(steps_of(out)) >= 2, 180, "step 2", proc)
        os.kill(ranks[1], signal.SIGSTOP)
        stopped = time.monotonic()
        log_lines = []
        rank0_error = None
        for line in proc.stdout:
            log_lines.append(line)
            if line.startswith("error:") and rank0_error is None:
                rank0_error = time.monotonic() - stopped
        proc.wait(timeout=120)
        ended = time.monotonic() - stopped
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = "".join(log_lines)
    errors = [line for line in log_lines if line.startswith("error:")]
    print(f"SIGSTOP -> rank 0's line: {rank0_error:.1f} s, -> torchrun exit: {ended:.1f} s (timeout {timeout} s)")
    assert len(errors) == 1, log[-3000:]
    assert errors[0].startswith(f"error: rank 0: a collective did not complete within distributed.timeout_seconds "
                                f"{timeout}: rank 1 (host ")
    assert "exitcode: 124" in log or "exitcode  : 124" in log, log[-3000:]
    assert timeout <= rank0_error < timeout + 15 and ended < timeout + 60
