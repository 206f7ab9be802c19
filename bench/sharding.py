"""Step time of the main job (online PPO on SmolLM2-135M) under each engine, several ranks on this machine.

    python bench/sharding.py [--engines ddp,fsdp2,zero1,zero2,zero3] [--nproc 2] [--steps 3] [--threads 1]
                            [any astrai.train override ...]

For each engine, starts the job as a user would: `accelerate launch --config_file configs/zero/<engine>.yaml
--num_processes N -m astrai.train --config configs/examples/ppo.yaml --max_steps S` (one thread per rank, no
checkpoint, no progress bar, a scratch output directory), then reads the `time/*` metrics the trainer logged
(means over ranks) from its metrics.jsonl. The first step is a warm-up (first calls allocate, DeepSpeed builds its
buffers) and is left out; the table shows the median of the others: the whole step and its phases (weight sync
into the rollout engine, generation, reference and critic scoring, policy and critic updates), the time from
launch to exit, and each engine's step time relative to ddp's. The last line, `ratio: X.XX`, is the slowest
sharded engine's step time over ddp's: what sharding costs here.

What it measures on a CPU: the engines' own overhead (gathers, partitioned optimizer steps, flat buffers) against
plain DDP at equal work; on 2 ranks over gloo, the communication runs through shared memory. It says nothing of
GPU speed. Every rank generates its own rollout batch (`rollout.batch_size` prompts per rank).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("weight_sync", "generate", "reference", "critic_scoring", "policy_update", "critic_update")


def run_engine(engine: str, nproc: int, steps: int, threads: int, overrides: list[str], scratch: Path) -> dict:
    """Launch the main job under `engine`; returns {"wall": s, "step": [s, ...], phase: [s, ...]} (steps after the
    first). Raises RuntimeError with the job's last output when it fails."""
    out = scratch / engine
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "configs/zero" / f"{engine}.yaml"), "--num_processes", str(nproc), "-m", "astrai.train",
           "--config", str(ROOT / "configs/examples/ppo.yaml"), "--train.output_dir", str(out),
           "--max_steps", str(steps), "--checkpoint.save_at_end", "false", "--checkpoint.save_steps", "0",
           "--train.progress_bar", "false", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{engine}: exit {done.returncode}\n{done.stderr[-3000:]}")
    from astrai.outputs import read_jsonl  # a torn last line is skipped, said once

    records = read_jsonl(out / "metrics.jsonl")
    measured = records[1:] or records
    result = {"wall": wall, "step": [r["time/step_seconds"] for r in measured]}
    for phase in PHASES:
        result[phase] = [r[f"time/{phase}_seconds"] for r in measured if f"time/{phase}_seconds" in r]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default="ddp,fsdp2,zero1,zero2,zero3")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per engine; the first is a warm-up")
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per rank")
    args, overrides = parser.parse_known_args()
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if "ddp" not in engines:
        engines.insert(0, "ddp")
    load = os.getloadavg()
    print(f"{args.nproc} ranks x {args.threads} thread(s), {args.steps} steps (first left out); load average "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="astrai-bench-engines-") as scratch:
        for engine in engines:
            results[engine] = run_engine(engine, args.nproc, args.steps, args.threads, overrides, Path(scratch))
            med = statistics.median(results[engine]["step"])
            print(f"  {engine}: median step {med:.1f} s, launch to exit {results[engine]['wall']:.0f} s", flush=True)
    header = f"{'engine':<7} {'step s':>7} {'vs ddp':>7} " + " ".join(f"{p:>15}" for p in PHASES) + f" {'wall s':>7}"
    print(header)
    base = statistics.median(results["ddp"]["step"])
    for engine, r in results.items():
        step = statistics.median(r["step"])
        phases = " ".join(f"{statistics.median(r[p]):>15.2f}" if r[p] else f"{'-':>15}" for p in PHASES)
        print(f"{engine:<7} {step:>7.2f} {step / base:>6.2f}x {phases} {r['wall']:>7.0f}")
    load = os.getloadavg()
    print(f"load average at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    sharded = [statistics.median(r["step"]) / base for e, r in results.items() if e != "ddp"]
    print(f"ratio: {max(sharded) if sharded else 1.0:.2f}")


if __name__ == "__main__":
    main()
