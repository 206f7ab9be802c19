"""`python tests/per_rank_cwd.py BASE ARGS`: `astrai.train ARGS` run from `BASE/node<RANK>`, so a relative
`train.output_dir` is a different directory on each rank, as a node-local path is on each node of a cluster."""

import os
import sys
from pathlib import Path

if __name__ == "__main__":
    here = Path(sys.argv[1]) / f"node{os.environ['RANK']}"
    here.mkdir(parents=True, exist_ok=True)
    os.chdir(here)
    from astrai.train import main

    sys.exit(main(sys.argv[2:]))
