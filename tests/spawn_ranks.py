"""Runs a test worker on several CPU processes (spawned, one gloo rendezvous file each run) and collects what each
rank reports."""

import multiprocessing as mp


def spawn_ranks(worker, tmp, world: int, *, timeout: float = 180) -> dict:
    """Start `worker(rank, tmp, results)` on `world` spawned processes; each must put `(rank, out)` on `results`
    (a dict, with "error" holding a formatted traceback when it failed). Returns {rank: out}; asserts that every
    process exited 0 and that no rank reported an error."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(rank, tmp, results)) for rank in range(world)]
    for p in procs:
        p.start()
    outs = dict(results.get(timeout=timeout) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for rank, out in outs.items():
        assert "error" not in out, f"rank {rank}:\n{out['error']}"
    return outs
