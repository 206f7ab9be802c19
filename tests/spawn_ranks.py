"""Runs a test worker on several CPU processes (spawned, one gloo rendezvous file each run) and collects what each
rank reports."""

import multiprocessing as mp
import os


def spawn_ranks(worker, tmp, world: int, *, timeout: float = 180) -> dict:
    """Start `worker(rank, tmp, results)` on `world` spawned processes; each must put `(rank, out)` on `results`
    (a dict, with "error" holding a formatted traceback when it failed). Returns {rank: out}; asserts that every
    process exited 0 and that no rank reported an error."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(worker, world, rank, tmp, results)) for rank in range(world)]
    for p in procs:
        p.start()
    outs = dict(results.get(timeout=timeout) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for rank, out in outs.items():
        assert "error" not in out, f"rank {rank}:\n{out['error']}"
    return outs


def _rank(worker, world: int, rank: int, tmp, results) -> None:
    """One spawned rank: `worker`, then `exit_process(0)` (the atexit handlers, among them multiprocessing's, which
    flush `results`, then no interpreter finalization, which a gloo worker thread can abort)."""
    from astrai.distributed.context import exit_process

    os.environ["WORLD_SIZE"] = str(world)
    worker(rank, tmp, results)
    exit_process(0)
