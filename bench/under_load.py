"""The main job under a busy core: seconds per step with and without adaptive threads (`runtime.adaptive_threads`).

    .venv/bin/python bench/under_load.py [--config configs/examples/ppo.yaml] [--steps 2] [--repeats 2] [--busy 1]
                                         [--threads 2]

Runs `python -m astrai.train --config CONFIG --max_steps STEPS --runtime.num_threads THREADS` (the README's main job:
online PPO on SmolLM2-135M-Instruct) in four ways: adaptive threads on (the default) or off, each on quiet cores and
with `--busy` busy-loop processes (`while True: pass`) running from before the job's start to its end. The four
alternate in each repeat (the order reversed on odd repeats). From each job's metrics.jsonl it reads the mean over
its steps of `time/step_seconds` (the first step included: both sides pay the same start) and of the phases
`time/generate_seconds` (the engine) and `time/policy_update_seconds` + `time/critic_update_seconds` (the
forward/backward passes), and `rollout/engine_threads`, `policy/threads` where logged.

Prints the machine (CPU model, load average before and after), every job, the median per way, and
`slowed: adaptive A.AAx, fixed F.FFx` (busy / quiet seconds per step) with the speed-up under load
(`under load: fixed / adaptive seconds per step = X.XX`) and the quiet cost (`quiet: adaptive / fixed = Q.QQ`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from engine_vs_vllm import machine, run_beside_busy_loops  # noqa: E402
from cli_help import DefaultsFormatter  # noqa: E402  (bench/, the script's own folder)

PHASES = {"step": ("time/step_seconds",), "generate": ("time/generate_seconds",),
          "update": ("time/policy_update_seconds", "time/critic_update_seconds")}


def run_job(args, adaptive: bool, busy: int, out: Path) -> dict:
    """One training job; its per-step means of the PHASES and the logged thread counts."""
    cmd = [sys.executable, "-m", "astrai.train", "--config", args.config, "--max_steps", str(args.steps),
           "--runtime.num_threads", str(args.threads), "--runtime.adaptive_threads", str(adaptive).lower(),
           "--train.output_dir", str(out), "--train.progress_bar", "false", "--checkpoint.save_at_end", "false"]
    proc = run_beside_busy_loops(cmd, busy, cwd=ROOT)
    if proc.returncode != 0:
        sys.exit(f"the job failed (exit {proc.returncode}):\n" + "\n".join(proc.stderr.strip().splitlines()[-5:]))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    result = {name: statistics.mean(sum(r.get(k, 0.0) for k in keys) for r in records)
              for name, keys in PHASES.items()}
    for key in ("rollout/engine_threads", "policy/threads"):
        values = [r[key] for r in records if key in r]
        result[key] = statistics.mean(values) if values else None
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=DefaultsFormatter)
    parser.add_argument("--config", default="configs/examples/ppo.yaml", help="the job file")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per job")
    parser.add_argument("--repeats", type=int, default=2, help="jobs per way")
    parser.add_argument("--busy", type=int, default=1, help="busy-loop processes of the loaded jobs")
    parser.add_argument("--threads", type=int, default=2, help="runtime.num_threads of every job")
    args = parser.parse_args()
    if min(args.steps, args.repeats, args.busy, args.threads) < 1:
        parser.error("--steps, --repeats, --busy and --threads must be >= 1")
    before = os.getloadavg()
    print(f"machine: {machine()}; load average {before[0]:.2f} {before[1]:.2f} {before[2]:.2f}")
    print(f"{args.config}, {args.steps} steps per job, {args.threads} threads, {args.repeats} alternating repeats, "
          f"quiet and with {args.busy} busy-loop process(es)")
    ways = [(adaptive, busy) for adaptive in (True, False) for busy in (0, args.busy)]
    results: dict[tuple[bool, int], list[dict]] = {way: [] for way in ways}
    with tempfile.TemporaryDirectory(prefix="astrai_under_load_") as tmp:
        for repeat in range(args.repeats):
            for index, (adaptive, busy) in enumerate(ways if repeat % 2 == 0 else ways[::-1]):
                result = run_job(args, adaptive, busy, Path(tmp) / f"r{repeat}_{index}")
                results[adaptive, busy].append(result)
                print(f"repeat {repeat} {'adaptive' if adaptive else 'fixed   '} busy {busy}: "
                      f"{result['step']:6.1f} s/step (generate {result['generate']:5.1f} s, update "
                      f"{result['update']:5.1f} s); engine threads {result['rollout/engine_threads']}, "
                      f"training threads {result['policy/threads']}", flush=True)
    median = {way: {name: statistics.median(r[name] for r in runs) for name in PHASES}
              for way, runs in results.items()}
    for (adaptive, busy), m in median.items():
        print(f"median {'adaptive' if adaptive else 'fixed   '} busy {busy}: {m['step']:.1f} s/step, generate "
              f"{m['generate']:.1f} s, update {m['update']:.1f} s")
    after = os.getloadavg()
    print(f"load average after: {after[0]:.2f} {after[1]:.2f} {after[2]:.2f}")
    a = {name: median[True, args.busy][name] / median[True, 0][name] for name in PHASES}
    f = {name: median[False, args.busy][name] / median[False, 0][name] for name in PHASES}
    print("slowed: " + ", ".join(f"{name} adaptive {a[name]:.2f}x, fixed {f[name]:.2f}x" for name in PHASES))
    print(f"under load: fixed / adaptive seconds per step = "
          f"{median[False, args.busy]['step'] / median[True, args.busy]['step']:.2f}")
    print(f"quiet: adaptive / fixed seconds per step = {median[True, 0]['step'] / median[False, 0]['step']:.2f}")


if __name__ == "__main__":
    main()
