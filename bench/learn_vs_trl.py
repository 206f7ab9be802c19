"""Learning per wall-clock minute, astrai against TRL 1.16's GRPOTrainer: both train SmolLM2-135M-Instruct on the
arithmetic task from the same weights for the same minutes, one after the other at the same thread count, then
`python -m astrai.evaluate` scores both final models on the held-out `builtin:arithmetic_test` with the same
prompts and greedy decoding.

    python bench/learn_vs_trl.py --minutes M [--threads 2] [--trl-python PATH] [--eval-limit N] [--trl-first]
                                 [--output-dir DIR] [--eval-start]

TRL runs in its own virtual environment (`--trl-python`, default the TRL_PYTHON environment variable), the one
bench/grpo_vs_trl.py uses:

    python3 -m venv /work/trl116-venv && /work/trl116-venv/bin/pip install torch==2.13.0 && \\
        /work/trl116-venv/bin/pip install trl==1.16.0 transformers gguf
    TRL_PYTHON=/work/trl116-venv/bin/python python bench/learn_vs_trl.py --minutes 20 --threads 2

The two sides:
- astrai: its recipe configs/examples/grpo_arithmetic.yaml as shipped (4 groups of 8 per rollout with DAPO dynamic
  sampling, four optimizer steps per rollout, temperature 0.8, learning rate 1e-5 on a cosine schedule over its 280
  steps, `--astrai-max-steps` to change that) through `python -m astrai.train` with `--train.max_minutes M`: it
  stops at the first optimizer step that ends after M minutes, or at its last step, whichever comes first, and
  publishes its final checkpoint. Its in-training evaluations are off (they would spend its budget).
- TRL: GRPOTrainer with its documented defaults (GRPOConfig: per_device_train_batch_size 8, so one prompt x 8
  completions per step, temperature 1.0, beta 0, epsilon 0.2, loss_type "dapo", scale_rewards "group", linear
  learning-rate decay over max_steps, which is set huge, so the rate stays at its peak) except what the task
  fixes: num_generations 8, learning_rate 1e-5 (astrai's), max_completion_length 32, the reward (astrai's
  `math_exact_match` behind TRL's reward-function signature: 1 for the right final number, else 0), the same
  2000 training questions as one-message conversations with the same chat template, seed 42, and the same float32
  weights (bench/hf_export.py). Two defaults are changed for speed on this CPU and say nothing about the method:
  bf16 off (TRL's default on; float32 like astrai, bf16 is slow on these cores) and gradient checkpointing off
  (TRL's default on; astrai's recipe has it off). A TrainerCallback stops training at the first step end after M
  minutes; the final model is saved as a Hugging Face directory.

Both clocks start when training starts (model loading and start-up are not counted) and include generation;
each side's actual training seconds and steps are printed (a side overshoots M by at most its last step). The
final evaluations are outside the budget: greedy, 32 new tokens, the recipe's prompt settings (`--config` of the
recipe for both models), `--eval-limit N` for the first N of the 200 questions. `--eval-start` also scores the
starting model.

Prints the load average at start and end, each side's training reward curve (mean reward of the steps ending in
each minute: astrai's `rollout/sampled_reward_mean`, the mean reward of every sample its dynamic sampling drew,
dropped groups included; TRL's logged `reward`, the mean over its sampled completions, every 10 steps by its
default), both accuracies with their 95% Wilson intervals, the
difference in points, and last `ratio: X.XX` = astrai's accuracy / TRL's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import grpo_vs_trl
from hf_export import export_hf
from cli_help import DefaultsFormatter  # noqa: E402  (bench/, the script's own folder)

ROOT = Path(__file__).resolve().parents[1]
RECIPE = grpo_vs_trl.RECIPE
MODEL = grpo_vs_trl.MODEL
EVAL_DATA = "builtin:arithmetic_test"


def parse_args(argv=None) -> argparse.Namespace:
    """The command line; bad values exit 2 with one line (argparse's usage error)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=DefaultsFormatter)
    parser.add_argument("--minutes", type=float, required=True, help="training wall time of each side")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of both sides and the evaluations")
    parser.add_argument("--trl-python", default=os.environ.get("TRL_PYTHON"),
                        help="python of the TRL 1.16 venv (default: $TRL_PYTHON)")
    parser.add_argument("--eval-limit", type=int, default=None, help="evaluate the first N held-out questions only")
    parser.add_argument("--astrai-max-steps", type=int, default=None,
                        help="astrai's train.max_steps (its cosine schedule's length; default: the recipe's)")
    parser.add_argument("--trl-first", action="store_true", help="train TRL before astrai")
    parser.add_argument("--eval-start", action="store_true", help="also evaluate the starting model")
    parser.add_argument("--output-dir", type=Path, default=None,
                        help="keep the runs, models and evaluations here (default: a temporary directory, removed)")
    args = parser.parse_args(argv)
    if not args.minutes > 0:
        parser.error(f"--minutes must be > 0, got {args.minutes}")
    for name in ("threads", "eval_limit", "astrai_max_steps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.output_dir is not None and args.output_dir.exists() and any(args.output_dir.iterdir()):
        parser.error(f"--output-dir {args.output_dir} is not empty")
    return args


def run_logged(command: list[str], log: Path, env: dict, what: str) -> None:
    """Run `command` with its output in `log`; exit 1 with the log's tail when it fails."""
    with open(log, "w") as fh:
        proc = subprocess.run(command, stdout=fh, stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0:
        sys.exit(f"{what} failed (exit {proc.returncode}); its output ends with:\n"
                 f"{log.read_text(errors='replace')[-4000:]}")


def astrai_env(threads: int) -> dict:
    """The environment of astrai's subprocesses: this checkout's astrai first, `threads` OpenMP threads."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")


def train_astrai(args, workdir: Path) -> dict:
    """Train astrai's recipe for `args.minutes`; (model path, training seconds, steps, curve points)."""
    out = workdir / "astrai"
    command = [sys.executable, "-m", "astrai.train", "--config", str(RECIPE), "--train.max_minutes",
               str(args.minutes), "--train.output_dir", str(out), "--train.eval_steps", "0", "--runtime.num_threads",
               str(args.threads), "--train.progress_bar", "false", "--train.report_to", "none"]
    if args.astrai_max_steps:
        command += ["--train.max_steps", str(args.astrai_max_steps)]
    run_logged(command, workdir / "astrai_train.log", astrai_env(args.threads), "astrai training")
    from astrai.outputs import read_jsonl  # a torn last line is skipped, said once

    records = read_jsonl(out / "metrics.jsonl")
    records = [r for r in records if "time/elapsed_seconds" in r]
    key = "rollout/sampled_reward_mean"  # every sample drawn; rollout/reward_mean is over the kept groups only
    curve = [{"step": r["step"], "seconds": r["time/elapsed_seconds"], "reward": r.get(key, r["rollout/reward_mean"])}
             for r in records if "rollout/reward_mean" in r]
    return {"model": str(out), "seconds": records[-1]["time/elapsed_seconds"], "steps": records[-1]["step"],
            "curve": curve}


def train_trl(args, workdir: Path, hf_dir: Path) -> dict:
    """Train TRL's GRPOTrainer for `args.minutes` in its venv; (model path, training seconds, steps, curve)."""
    import torch

    from astrai.config import load_config
    from astrai.models import load_pretrained
    from astrai.experience.prompts import load_online_prompts

    config = load_config(str(RECIPE))
    _, tokenizer = load_pretrained(MODEL, torch.float32)
    prompts = load_online_prompts(config, tokenizer)
    model_out = workdir / "trl_model"
    spec = {"mode": "learn", "hf_dir": str(hf_dir), "astrai_root": str(ROOT), "threads": args.threads,
            "minutes": args.minutes, "model_out": str(model_out), "stop_at_eos": True,
            "questions": [p.prompt for p in prompts], "answers": [p.answer for p in prompts],
            "settings": {"seed": config.train.seed, "learning_rate": config.optim.learning_rate,
                         "group_size": config.grpo.group_size, "max_new_tokens": config.rollout.max_new_tokens}}
    out = grpo_vs_trl.run_worker(args.trl_python, spec, workdir, "trl_learn")
    return {"model": str(model_out), "seconds": out["seconds"], "steps": out["steps"], "curve": out["curve"]}


def evaluate(args, model: str, workdir: Path, name: str) -> dict:
    """`python -m astrai.evaluate` of `model` on the held-out set with the recipe's prompt settings; its summary."""
    out = workdir / f"eval_{name}"
    command = [sys.executable, "-m", "astrai.evaluate", "--model", model, "--data", EVAL_DATA, "--config",
               str(RECIPE), "--num_threads", str(args.threads), "--output_dir", str(out), "--no_progress_bar"]
    if args.eval_limit:
        command += ["--limit", str(args.eval_limit)]
    run_logged(command, workdir / f"eval_{name}.log", astrai_env(args.threads), f"evaluation of {name}")
    return json.loads((out / "summary.json").read_text())


def curve_by_minute(points: list[dict]) -> list[tuple[int, float, int]]:
    """(minute m, mean reward of the points with seconds in (60 (m - 1), 60 m], their count) for each minute that
    has points, in order."""
    buckets: dict[int, list[float]] = {}
    for p in points:
        minute = max(1, -int(-p["seconds"] // 60))
        buckets.setdefault(minute, []).append(p["reward"])
    return [(m, sum(v) / len(v), len(v)) for m, v in sorted(buckets.items())]


def curve_line(name: str, points: list[dict]) -> str:
    """One line: the side's mean training reward per minute (`minute: reward`), or that it logged none."""
    rows = curve_by_minute(points)
    if not rows:
        return f"{name} training reward by minute: none logged"
    return f"{name} training reward by minute: " + "  ".join(f"{m}: {r:.3f}" for m, r, _ in rows)


def accuracy_line(name: str, summary: dict) -> str:
    """`name: accuracy A (correct/n), 95% Wilson interval [lo, hi]` from an astrai.evaluate summary."""
    return (f"{name}: accuracy {summary['accuracy']:.4f} ({summary['correct']:g}/{summary['n']}), 95% Wilson "
            f"interval [{summary['ci_low']:.4f}, {summary['ci_high']:.4f}]")


def difference_line(astrai_accuracy: float, trl_accuracy: float) -> str:
    """The accuracy difference in percentage points, astrai minus TRL."""
    return f"difference: {100 * (astrai_accuracy - trl_accuracy):+.1f} points (astrai - TRL)"


def accuracy_ratio_line(astrai_accuracy: float, trl_accuracy: float) -> str:
    """The closing line: `ratio: X.XX` = astrai's accuracy / TRL's (`ratio: inf` when only TRL scored 0,
    `ratio: n/a` when both did)."""
    if trl_accuracy > 0:
        return f"ratio: {astrai_accuracy / trl_accuracy:.2f}"
    return "ratio: inf (TRL accuracy 0)" if astrai_accuracy > 0 else "ratio: n/a (both accuracies 0)"


def main() -> None:
    """Train both sides for the same minutes, evaluate both, print the comparison."""
    args = parse_args()
    args.trl_python = grpo_vs_trl.check_trl_python(args.trl_python)
    print(f"minutes per side: {args.minutes:g}  threads: {args.threads}  held-out: {EVAL_DATA}"
          f"{f' (first {args.eval_limit})' if args.eval_limit else ''}  load average at start: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    workdir = args.output_dir or Path(tempfile.mkdtemp(prefix="astrai-learn-vs-trl-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        hf_dir = export_hf(MODEL)
        runs = {}
        for side in (("TRL", "astrai") if args.trl_first else ("astrai", "TRL")):
            print(f"training {side} for {args.minutes:g} minutes ...", flush=True)
            runs[side] = train_astrai(args, workdir) if side == "astrai" else train_trl(args, workdir, hf_dir)
            print(f"{side}: {runs[side]['steps']} optimizer steps in {runs[side]['seconds']:.0f} s of training",
                  flush=True)
        summaries = {side: evaluate(args, runs[side]["model"], workdir, side) for side in ("astrai", "TRL")}
        start = evaluate(args, MODEL, workdir, "start") if args.eval_start else None
    finally:
        if args.output_dir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    for side in ("astrai", "TRL"):
        print(curve_line(side, runs[side]["curve"]))
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"held-out accuracy on {EVAL_DATA}, greedy, {summaries['astrai']['settings']['max_new_tokens']} new tokens:")
    if start is not None:
        print(accuracy_line("start", start))
    for side in ("astrai", "TRL"):
        print(accuracy_line(side, summaries[side]))
    a, t = summaries["astrai"]["accuracy"], summaries["TRL"]["accuracy"]
    print(difference_line(a, t))
    print(accuracy_ratio_line(a, t))


if __name__ == "__main__":
    main()
