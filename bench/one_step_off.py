"""One-step-off training in a generation process against the colocated synchronous step, on the real job.

    python bench/one_step_off.py [--steps 6] [--threads 2] [--batch-size 4] [--group-size 4]
                                 [--max-new-tokens 128] [--kl-coef 0] [--rounds 1] [--model PATH]

Runs `python -m astrai.train` on `configs/examples/grpo.yaml` (SmolLM2-135M-Instruct, the built-in math word problems
with a "think step by step" system prompt: long-tailed answers) with B = `--batch-size` prompts x G = `--group-size`
responses per rollout, one optimizer step per rollout, `--max-new-tokens` per response, and `rollout.correction
token_tis` on every side (so the training work is the same), in three placements:

- colocated: the training process's own engine, synchronous (the default), `--threads` torch threads;
- separate_sync: a generation process of its own (`rollout.placement separate`, `max_off_policy_steps` 0), which
  waits for each update; both processes `--threads` threads, as they never run at once: the cost of the placement
  itself (the weight broadcast, the process hop);
- one_step_off: the same generation process sampling rollout k + 1 while rollout k trains (`max_off_policy_steps`
  1); the threads split between the two (half each), as they run at once.

Per placement it prints the seconds per optimizer step (the mean of `time/step_seconds` over the steps after the
first, whose rollout nothing overlaps), the seconds the step waited for generation, the seconds generation took, the
seconds of training work (rescore, reference and policy update), the generated tokens per second of wall time, and
the ratios against colocated. `--rounds` > 1 repeats the three in alternating order (A B C, C B A, ...)
and quotes each. The 1-minute load average is printed before each run: compare only within one quiet run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from cli_help import DefaultsFormatter  # noqa: E402  (bench/, the script's own folder)

REPO = Path(__file__).resolve().parents[1]
PLACEMENTS = ("colocated", "separate_sync", "one_step_off")


def placement_args(name: str, threads: int) -> list[str]:
    """The command-line settings of placement `name` with `threads` cores in all."""
    if name == "colocated":
        return ["--runtime.num_threads", str(threads)]
    if name == "separate_sync":
        return ["--runtime.num_threads", str(threads), "--rollout.placement", "separate",
                "--rollout.generation_threads", str(threads)]
    half = max(1, threads // 2)
    return ["--runtime.num_threads", str(max(1, threads - half)), "--rollout.placement", "separate",
            "--rollout.generation_threads", str(half), "--rollout.max_off_policy_steps", "1"]


def run(name: str, args: argparse.Namespace, out: Path) -> dict:
    """One training run of placement `name`; its per-step means (after the first step)."""
    n = args.batch_size * args.group_size
    cmd = [sys.executable, "-m", "astrai.train", "--config", str(REPO / "configs/examples/grpo.yaml"),
           "--train.output_dir", str(out), "--max_steps", str(args.steps), "--train.progress_bar", "false",
           "--train.report_to", "none", "--train.eval_steps", "0", "--checkpoint.save_at_end", "false",
           "--rollout.batch_size", str(args.batch_size), "--grpo.group_size", str(args.group_size),
           "--grpo.minibatch_size", str(n), "--grpo.micro_batch_size", str(min(n, 8)),
           "--rollout.max_new_tokens", str(args.max_new_tokens), "--rollout.correction", "token_tis",
           "--grpo.kl_coef", str(args.kl_coef),
           *(["--model.path", args.model] if args.model else []), *placement_args(name, args.threads)]
    load = os.getloadavg()[0]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"{name}: the training run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "time/step_seconds" in r][1:]
    tokens = [r["rollout/response_length"] * n for r in rows]
    steps = [r["time/step_seconds"] for r in rows]
    return {"load": load, "wall": wall, "step": statistics.mean(steps),
            "wait": statistics.mean(r["time/generate_seconds"] for r in rows),
            "generation_process": statistics.mean(r.get("time/generation_process_seconds", r["time/generate_seconds"])
                                                  for r in rows),
            "update": statistics.mean(r["time/policy_update_seconds"] + r.get("time/rescore_seconds", 0.0)
                                      + r.get("time/reference_seconds", 0.0) for r in rows),
            "tokens_per_second": sum(tokens) / sum(steps), "staleness": max(r.get("rollout/staleness_max", 0)
                                                                          for r in rows)}


def parse_args(argv=None) -> argparse.Namespace:
    """The command line; bad values exit 2 with one line (argparse's usage error)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=DefaultsFormatter)
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run (one rollout each)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads in all (one_step_off splits them)")
    parser.add_argument("--batch-size", type=int, default=4, help="prompts per rollout (B)")
    parser.add_argument("--group-size", type=int, default=4, help="responses per prompt (G)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="response budget")
    parser.add_argument("--kl-coef", type=float, default=0.0,
                        help="grpo.kl_coef (> 0 adds the reference model's forward to every step's training side)")
    parser.add_argument("--rounds", type=int, default=1, help="repetitions, in alternating order")
    parser.add_argument("--model", default=None, help="model.path (default: the job file's, SmolLM2-135M-Instruct)")
    args = parser.parse_args(argv)
    for name in ("steps", "threads", "batch_size", "group_size", "max_new_tokens", "rounds"):
        if getattr(args, name) < (2 if name == "steps" else 1):
            parser.error(f"--{name.replace('_', '-')}: expected >= {2 if name == 'steps' else 1}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    cpu = "amx_bf16" if "amx_bf16" in Path("/proc/cpuinfo").read_text() else "no AMX"
    print(f"one-step-off bench: {args.steps} steps of B {args.batch_size} x G {args.group_size}, max_new_tokens "
          f"{args.max_new_tokens}, {args.threads} threads in all, {os.cpu_count()} CPUs ({cpu})", flush=True)
    results: dict[str, list[dict]] = {name: [] for name in PLACEMENTS}
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.rounds):
            order = PLACEMENTS if round_index % 2 == 0 else tuple(reversed(PLACEMENTS))
            for name in order:
                r = run(name, args, Path(tmp) / f"{name}-{round_index}")
                results[name].append(r)
                print(f"  {name:<14} load {r['load']:.2f}  s/step {r['step']:7.2f}  waited for generation "
                      f"{r['wait']:6.2f} s  generation {r['generation_process']:6.2f} s  training {r['update']:6.2f} s  "
                      f"{r['tokens_per_second']:6.1f} tok/s  staleness max {r['staleness']:g}", flush=True)
    base = statistics.mean(r["step"] for r in results["colocated"])
    for name in PLACEMENTS[1:]:
        step = statistics.mean(r["step"] for r in results[name])
        print(f"ratio: {name} speed-up over colocated (s/step colocated / {name}): {base / step:.2f}")


if __name__ == "__main__":
    main()
