"""Scoring throughput of a slow Python reward function with 0, 1 and 2 reward worker processes.

    python bench/reward_workers.py [--completions 64] [--ms 20] [--workers 0,1,2] [--rounds 5] [--kind busy|sleep]

The reward is a function of TRL's signature that spends `--ms` milliseconds per completion, either computing
(`busy`: a pure-Python loop on one core, what a parser or a checker costs) or waiting (`sleep`: what a call to a
remote verifier costs). It is given to astrai as `reward.functions` would give it (a file and a function name,
through `astrai.rewards.functions.RewardFunctions`), and scores `--completions` completions per round (64 =
one online_grpo rollout of 8 prompts x 8 samples), `--rounds` rounds after one warm-up round. With
`num_workers: 0` the functions run in the trainer's process (no timeout); with N >= 1 the batch is split into N
contiguous shares run by N worker processes at once. Prints per worker count the median and minimum seconds per
round and the speed-up over one worker; ends with `ratio: X.XX` = one worker's median / the largest worker count's
median. The serial cost is completions x ms; on a machine with C free cores, `busy` cannot go faster than
min(N, C) workers allow.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from astrai.rewards.functions import RewardFunctions  # noqa: E402
from astrai.rewards.workers import RewardFunctionSpec  # noqa: E402
from cli_help import DefaultsFormatter  # noqa: E402  (bench/, the script's own folder)

REWARD_SOURCE = '''
import time

def slow_reward(prompts, completions, **kwargs):
    """1.0 per completion, after spending MS milliseconds on each (KIND)."""
    out = []
    for completion in completions:
        end = time.perf_counter() + MS / 1000.0
        if KIND == "sleep":
            time.sleep(MS / 1000.0)
        else:
            x = 0
            while time.perf_counter() < end:
                x += 1
        out.append(1.0)
    return out
'''


def write_reward(directory: Path, ms: float, kind: str) -> Path:
    """A reward file defining `slow_reward` with the given cost per completion; returns its path."""
    path = directory / "slow_rewards.py"
    path.write_text(REWARD_SOURCE.replace("MS", repr(float(ms))).replace("KIND", repr(kind)))
    return path


def time_rounds(path: Path, workers: int, completions: int, rounds: int) -> list[float]:
    """Seconds per scoring round of `completions` completions with `workers` worker processes (warm-up excluded)."""
    spec = RewardFunctionSpec(name="slow", function="slow_rewards:slow_reward", path=str(path))
    scorer = RewardFunctions([spec], columns=[], num_workers=workers, timeout_seconds=600.0)
    prompts = [f"prompt {i}" for i in range(completions)]
    outputs = [f"completion {i}" for i in range(completions)]
    ids = [[1, 2, 3]] * completions
    try:
        scored = scorer(prompts, outputs, ids, {})  # warm-up: starts the workers, imports the file
        assert float(scored.total.sum()) == completions, "the reward returned wrong values"
        seconds = []
        for _ in range(rounds):
            start = time.perf_counter()
            scorer(prompts, outputs, ids, {})
            seconds.append(time.perf_counter() - start)
        return seconds
    finally:
        scorer.close()


def parse_workers(text: str) -> list[int]:
    """'0,1,2' -> [0, 1, 2]; ValueError naming --workers (one line) on anything else."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or any(v < 0 for v in values):
        raise ValueError(f"--workers: expected comma-separated counts >= 0, got {text!r}")
    return values


def main() -> None:
    """Command line: see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=DefaultsFormatter)
    parser.add_argument("--completions", type=int, default=64, help="completions scored per round")
    parser.add_argument("--ms", type=float, default=20.0, help="milliseconds the reward spends per completion")
    parser.add_argument("--workers", default="0,1,2", help="worker counts to compare (0 = in process)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds after one warm-up round")
    parser.add_argument("--kind", choices=("busy", "sleep"), default="busy", help="compute or wait")
    args = parser.parse_args()
    for name in ("completions", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: expected >= 1, got {getattr(args, name)}")
    if args.ms <= 0:
        parser.error(f"--ms: expected > 0, got {args.ms:g}")
    try:
        workers = parse_workers(args.workers)
    except ValueError as err:
        parser.error(str(err))
    print(f"{args.completions} completions x {args.ms:g} ms ({args.kind}) per round = "
          f"{args.completions * args.ms / 1000:.2f} s serial; {os.cpu_count()} CPUs; load average "
          f"{os.getloadavg()[0]:.2f}")
    medians = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = write_reward(Path(tmp), args.ms, args.kind)
        for count in workers:
            seconds = time_rounds(path, count, args.completions, args.rounds)
            medians[count] = statistics.median(seconds)
            label = "in process" if count == 0 else f"{count} worker{'s' if count > 1 else ''}"
            print(f"{label:>12}: median {medians[count]:.3f} s, min {min(seconds):.3f} s per round")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    base_count = 1 if 1 in medians else workers[0]
    print(f"ratio: {medians[base_count] / medians[max(workers)]:.2f} (seconds per round with {base_count} "
          f"worker(s) / with {max(workers)}: the speed-up)")


if __name__ == "__main__":
    main()
