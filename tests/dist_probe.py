"""Run under a launcher (`accelerate launch`, `torchrun`) by tests/test_distributed.py: creates the process state
the way `astrai.train` does and writes, on each rank, `OUT_DIR/rank<R>.json` with what the tests check: the
resolved engine, the rank and world size, a sum over ranks, this rank's prompt sampler share of two epochs, metrics
averaged over ranks and the error for ranks whose metric names differ. (A file per rank: the ranks' stdout lines
may interleave.)

Usage: python dist_probe.py OUT_DIR [STRATEGY]   (default auto)
"""

import json
import os
import sys
from pathlib import Path

import torch

from astrai.data import PromptRecord, PromptSampler
from astrai.distributed import setup_distributed
from astrai.distributed.context import end_process_group
from astrai.trainer.loop import mean_over_ranks


def main() -> None:
    threads = len(os.listdir("/proc/self/task"))  # before the process group's
    dist = setup_distributed("cpu", sys.argv[2] if len(sys.argv) > 2 else "auto")
    rank = dist.rank
    records = [PromptRecord(prompt=f"q{i}", answer="", index=i) for i in range(10)]
    sampler = PromptSampler(records, seed=3, rank=rank, world_size=dist.world_size)
    share = [r.index for _ in range(5) for r in sampler.next_batch(2)]  # 5 x 2 x 2 ranks = two epochs
    metrics = mean_over_ranks({"a": torch.tensor(float(rank)), "b": torch.tensor(10.0 * rank + 1)}, dist)
    try:
        mean_over_ranks({f"name{rank}": torch.tensor(1.0)}, dist)
        mismatch = None
    except RuntimeError as err:
        mismatch = str(err)
    found = {"rank": rank, "world_size": dist.world_size, "strategy": dist.strategy,
             "mixed_precision": dist.mixed_precision, "sum": float(dist.all_reduce_sum(torch.tensor(rank + 1.0))),
             "share": share, "sampler_state": sampler.state_dict(), "drawn": sampler.drawn,
             "metrics": {k: float(v) for k, v in metrics.items()}, "mismatch": mismatch}
    end_process_group()  # joins gloo's threads before the interpreter finalizes (nothing else holds the group)
    found["threads_left"] = len(os.listdir("/proc/self/task")) - threads
    (Path(sys.argv[1]) / f"rank{rank}.json").write_text(json.dumps(found))


if __name__ == "__main__":
    main()
