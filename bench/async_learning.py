"""The learning curve at equal samples: synchronous, partial-rollout and one-step-off GRPO on the arithmetic recipe.

    python bench/async_learning.py [--steps 140] [--eval-steps 35] [--threads 1] [--parallel] [--seed 42]
                                   [--groups-per-rollout 4] [--modes sync,partial,one_step_off] [--output-dir DIR]
                                   [--model PATH]

Runs `python -m astrai.train` on `configs/examples/grpo_arithmetic.yaml` (SmolLM2-135M-Instruct learning two-digit
addition and subtraction, greedy held-out accuracy on the 200 questions of `builtin:arithmetic_test` every
`--eval-steps` optimizer steps) in each mode, with the same seed and the same samples per optimizer step (B groups
of G 8 per rollout, B = `--groups-per-rollout`, 4 as in the recipe; minibatches of 8: B optimizer steps per
rollout), so that equal steps are equal samples:

- sync: the colocated synchronous rollout (the default);
- partial: `rollout.partial` with 2B groups in flight, the unfinished ones carried into the next rollout (staleness
  bound `max_off_policy_steps` 2B: two rollouts);
- one_step_off: `rollout.placement separate` with `max_off_policy_steps` B: rollout k + 1 sampled in a generation
  process while rollout k trains (every token after the first rollout lags B optimizer steps: one with
  `--groups-per-rollout 1`, the lag of the peers' one-step-off with one optimizer step per rollout).

Every mode uses `rollout.correction token_tis` (so that only the staleness differs; with no lag the correction only
sees the kernels' rounding) and drops the recipe's dynamic sampling (which neither asynchronous mode supports yet).
`--parallel` starts the runs at once, each with `--threads` threads (the accuracy does not depend on the machine's
load; their times are then not comparable and are not quoted). It prints each evaluation's accuracy with its 95%
Wilson interval, per mode, the final difference in points against sync with `ratio: X.XX` = the mode's final
accuracy / sync's, and draws the curves to `<output-dir>/async_learning.png` (needs matplotlib).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from cli_help import DefaultsFormatter  # noqa: E402  (bench/, the script's own folder)

REPO = Path(__file__).resolve().parents[1]
MODES = ("sync", "partial", "one_step_off")


def mode_settings(mode: str, groups: int) -> list[str]:
    """The settings of `mode` on top of the common ones (`command`), with `groups` groups per rollout (each one
    optimizer step of 8 samples)."""
    return {"sync": [],
            "partial": ["--rollout.partial", "true", "--rollout.generation_batch_size", str(2 * groups),
                        "--rollout.max_off_policy_steps", str(2 * groups)],
            "one_step_off": ["--rollout.placement", "separate", "--rollout.max_off_policy_steps", str(groups)],
            }[mode]


def command(mode: str, args: argparse.Namespace, out: Path) -> list[str]:
    """The training command of `mode`, writing to `out`."""
    threads = ["--runtime.num_threads", str(args.threads)]
    if mode == "one_step_off":
        threads += ["--rollout.generation_threads", str(args.threads)]
    return [sys.executable, "-m", "astrai.train", "--config", str(REPO / "configs/examples/grpo_arithmetic.yaml"),
            "--train.output_dir", str(out), "--max_steps", str(args.steps), "--train.eval_steps",
            str(args.eval_steps), "--train.progress_bar", "false", "--train.report_to", "none",
            "--checkpoint.save_at_end", "false", "--rollout.dynamic_sampling", "false",
            "--rollout.generation_batch_size", "null", "--rollout.correction", "token_tis",
            "--rollout.batch_size", str(args.groups_per_rollout), "--train.seed", str(args.seed),
            *(["--model.path", args.model] if args.model else []), *threads,
            *mode_settings(mode, args.groups_per_rollout)]


def curve(out: Path) -> list[dict]:
    """The evaluations of the run in `out`, from metrics.jsonl: step, minutes (`time/elapsed_seconds`: training from
    the first step, earlier evaluations included), accuracy and its 95% Wilson interval, staleness (or None)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{"step": r["step"], "minutes": r["time/elapsed_seconds"] / 60, "accuracy": r["eval/accuracy"],
             "low": r["eval/accuracy_ci_low"], "high": r["eval/accuracy_ci_high"],
             "staleness": r.get("rollout/staleness_max")} for r in rows if "eval/accuracy" in r]


def plot(curves: dict[str, list[dict]], path: Path, *, x: str = "step",
         xlabel: str = "optimizer step (8 samples each)",
         title: str = "GRPO on builtin:arithmetic, SmolLM2-135M-Instruct",
         levels: tuple[tuple[float, str, str], ...] = ()) -> None:
    """The accuracy curves (`curve`'s points) with their intervals, one line per run, against the points' `x` key,
    and each of `levels` (accuracy in [0, 1], label, line style) as a gray horizontal line, to `path` (PNG)."""
    try:
        import matplotlib
    except ImportError:
        print("(no plot: matplotlib is not installed; pip install 'astrai[plot]')")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, points in curves.items():
        xs = [p[x] for p in points]
        ax.plot(xs, [100 * p["accuracy"] for p in points], marker="o", label=mode)
        ax.fill_between(xs, [100 * p["low"] for p in points], [100 * p["high"] for p in points], alpha=0.15)
    for level, label, style in levels:
        ax.axhline(100 * level, color="gray", linestyle=style, label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("held-out greedy accuracy, % (95% Wilson)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")


def check_output_dir(parser: argparse.ArgumentParser, output_dir: str | None) -> None:
    """Refuse (exit 2, one line) an `--output-dir` that exists and is not a directory."""
    if output_dir and Path(output_dir).exists() and not Path(output_dir).is_dir():
        parser.error(f"--output-dir: {output_dir} exists and is not a directory")


def run_failed(what: str, code: int, log: Path, *, kept: bool) -> str:
    """The message for a subprocess (`what`, e.g. "sync: the training run") that exited with `code`: where its log
    is, or (`kept` False: the temporary directory holding it is removed on exit) the log's last 20 lines."""
    if kept:
        return f"{what} failed (exit {code}); its log: {log}"
    tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-20:])
    return f"{what} failed (exit {code}); the end of its log:\n{tail}"


def parse_args(argv=None) -> argparse.Namespace:
    """The command line; bad values exit 2 with one line (argparse's usage error)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=DefaultsFormatter)
    parser.add_argument("--steps", type=int, default=140, help="optimizer steps per run (8 samples each)")
    parser.add_argument("--eval-steps", type=int, default=35, help="evaluate every this many steps")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--parallel", action="store_true", help="run the modes at once (accuracy only)")
    parser.add_argument("--seed", type=int, default=42, help="train.seed of every run (the recipe's: 42)")
    parser.add_argument("--groups-per-rollout", type=int, default=4,
                        help="rollout.batch_size B: B optimizer steps per rollout, the lag of one step off")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, of " + ", ".join(MODES))
    parser.add_argument("--output-dir", default=None, help="keep the runs here (unset: a temporary directory)")
    parser.add_argument("--model", default=None, help="model.path (default: the recipe's, SmolLM2-135M-Instruct)")
    args = parser.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown or not args.modes:
        parser.error(f"--modes: expected some of {', '.join(MODES)}, got {unknown or 'none'}")
    for name in ("steps", "eval_steps", "threads", "groups_per_rollout"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: expected >= 1")
    if args.eval_steps > args.steps:
        parser.error(f"--eval-steps: expected <= --steps ({args.steps}), got {args.eval_steps}")
    check_output_dir(parser, args.output_dir)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as logs:
        root = Path(args.output_dir) if args.output_dir else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        print(f"async learning bench: {args.steps} steps x 8 samples, {args.groups_per_rollout} per rollout, "
              f"evaluated every {args.eval_steps}, "
              f"{args.threads} thread(s) per process, {'at once' if args.parallel else 'one after another'}, "
              f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}", flush=True)
        procs, seconds = {}, {}
        for mode in args.modes:
            out = root / mode
            log = logs.enter_context(open(root / f"{mode}.log", "w"))  # closed when every run has ended
            started = time.perf_counter()
            procs[mode] = subprocess.Popen(command(mode, args, out), cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                           env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
            if not args.parallel:
                procs[mode].wait()
                seconds[mode] = time.perf_counter() - started  # this run alone, not the ones after it
        logs.close()
        curves = {}
        for mode, proc in procs.items():
            code = proc.wait()
            if code != 0:
                sys.exit(run_failed(f"{mode}: the training run", code, root / f"{mode}.log",
                                    kept=bool(args.output_dir)))
            curves[mode] = curve(root / mode)
            points = ", ".join(f"{100 * p['accuracy']:.1f}% [{100 * p['low']:.1f}, {100 * p['high']:.1f}] at "
                               f"{p['step']}" for p in curves[mode])
            timing = "" if args.parallel else f" ({seconds[mode] / 60:.1f} min)"
            print(f"  {mode:<13}{timing} {points}", flush=True)
        if "sync" in curves and curves["sync"]:
            base = curves["sync"][-1]["accuracy"]
            for mode in [m for m in curves if m != "sync" and curves[m]]:
                final = curves[mode][-1]["accuracy"]
                print(f"{mode}: final accuracy {100 * final:.1f}% against sync's {100 * base:.1f}%: "
                      f"{100 * (final - base):+.1f} points; ratio: {final / base if base else float('inf'):.2f}")
        plot(curves, (Path(args.output_dir) if args.output_dir else Path.cwd()) / "async_learning.png")


if __name__ == "__main__":
    main()
