"""Minutes to 90% of a teacher's accuracy: on-policy and sequence-level distillation from it against GRPO from
scratch (issue 45).

    python bench/distill_vs_grpo.py --teacher PATH [--minutes 15] [--eval-steps 20] [--threads 2]
                                    [--arms distill,seqkd,grpo] [--output-dir DIR] [--student smollm2-135m-instruct]

The teacher is the model the two-step arithmetic recipe makes (`configs/examples/sft_arithmetic.yaml`, then
`grpo_arithmetic.yaml` from its checkpoint; its commands are in `configs/examples/distill_arithmetic.yaml`). The
student, in every arm, is the untrained SmolLM2-135M-Instruct (`--student`). Each arm's run is first checked by
`python -m astrai.train --check` (a teacher with another tokenizer is refused in seconds, before any
evaluation). Then one after another, on the same threads:

1. the teacher's greedy accuracy on `builtin:arithmetic_test` (200 questions), scored by `python -m astrai.evaluate`
   (`--max_new_tokens 48`); the target is 90% of it;
2. `distill`: `configs/examples/distill_arithmetic.yaml` with `distill.teacher` = the teacher;
3. `seqkd` (sequence-level distillation, Kim and Rush 2016): the teacher answers the 2000 train questions
   (`python -m astrai.evaluate --data builtin:arithmetic --demonstrations FILE`, greedy, 48 new tokens), its right
   answers become chats, and `configs/examples/sft_arithmetic.yaml` trains the student on them (evaluated like the
   others: `--data.eval_path builtin:arithmetic_test --rollout.max_new_tokens 48`); the teacher's minutes (its
   loading included) count towards the arm's, before its first step, and leave it `--minutes` less them to train;
4. `grpo`: `configs/examples/grpo_arithmetic.yaml` as shipped (dynamic sampling, 32 new tokens).

Each arm runs for at most `--minutes` minutes of training (`train.max_minutes`; model loading not counted) and is
evaluated on the same 200 questions every `--eval-steps` optimizer steps by the trainer's evaluation (the code of
`python -m astrai.evaluate`, greedy, the arm's own `rollout.max_new_tokens`), and its final checkpoint once more by
`python -m astrai.evaluate` with 48 new tokens. The minutes of an evaluation are `time/elapsed_seconds` at its step
(training from the first step, earlier evaluations included). Prints each arm's curve, the minutes at which it first
reached the target (or that it did not within `--minutes`), per distillation arm `ratio: X.XX` (grpo's minutes /
the arm's, a lower bound when grpo did not reach it; none when the arm did not) and the same ratio at the common
level (the lower of the two arms' best accuracies), and draws accuracy against minutes to
`<output-dir>/distill_vs_grpo.png` (needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from async_learning import check_output_dir, curve, plot, run_failed  # noqa: E402  (shared with that bench)
from astrai.models.loading import resolve_model_path  # noqa: E402
from cli_help import DefaultsFormatter  # noqa: E402  (bench/, the script's own folder)

RECIPES = {"distill": REPO / "configs/examples/distill_arithmetic.yaml",
           "seqkd": REPO / "configs/examples/sft_arithmetic.yaml",
           "grpo": REPO / "configs/examples/grpo_arithmetic.yaml"}
"""Each arm's recipe."""
TEST, TRAIN = "builtin:arithmetic_test", "builtin:arithmetic"
EVAL_TOKENS = 48


def evaluate(model: str, out: Path, threads: int, *, kept: bool, data: str = TEST, extra: tuple = ()) -> dict:
    """`python -m astrai.evaluate` of `model` on `data` (the held-out set; greedy, 48 new tokens) with the options
    `extra`: its summary.json.

    Raises:
        SystemExit: the evaluation failed (its log named; its end quoted when `kept` is False, the log then being
            in a temporary directory).
    """
    log = out.with_suffix(".log")
    with open(log, "w") as f:
        code = subprocess.call([sys.executable, "-m", "astrai.evaluate", "--model", model, "--data", data,
                                "--reward", "math_exact_match", "--max_new_tokens", str(EVAL_TOKENS),
                                "--output_dir", str(out), "--no_progress_bar", *extra], cwd=REPO, stdout=f,
                               stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    if code != 0:
        sys.exit(run_failed(f"evaluation of {model}", code, log, kept=kept))
    return json.loads((out / "summary.json").read_text())


def command(arm: str, args: argparse.Namespace, out: Path, *, minutes: float | None = None,
            demonstrations: Path | None = None) -> list[str]:
    """The training command of `arm`, writing to `out`, for `minutes` (default `--minutes`); seqkd's trains on
    `demonstrations` (checked once they are written)."""
    extra = {"distill": ["--distill.teacher", args.teacher],
             "seqkd": [*(["--data.path", str(demonstrations)] if demonstrations else []), "--data.eval_path", TEST,
                       "--rollout.max_new_tokens", str(EVAL_TOKENS)]}.get(arm, [])
    return [sys.executable, "-m", "astrai.train", "--config", str(RECIPES[arm]), "--model.path", args.student,
            "--train.output_dir", str(out), "--train.max_minutes", f"{args.minutes if minutes is None else minutes:.4g}",
            "--train.eval_steps", str(args.eval_steps), "--train.progress_bar", "false", "--train.report_to", "none",
            "--runtime.num_threads", str(args.threads), *extra]


def teacher_demonstrations(args: argparse.Namespace, root: Path) -> tuple[Path, int, float]:
    """seqkd's first step: the teacher's greedy answers to the train questions, its right ones written as chats
    (`python -m astrai.evaluate --demonstrations`): (their file, their number, the minutes it took, loading
    included)."""
    start = time.perf_counter()
    path = root / "seqkd_teacher" / "demonstrations.jsonl"
    summary = evaluate(args.teacher, root / "seqkd_teacher", args.threads, kept=bool(args.output_dir), data=TRAIN,
                       extra=("--demonstrations", str(path)))
    return path, summary["demonstrations"]["rows"], (time.perf_counter() - start) / 60


def minutes_to(points: list[dict], target: float) -> float | None:
    """The minutes of the first evaluation at or above `target`, or None."""
    return next((p["minutes"] for p in points if p["accuracy"] >= target), None)


def ratio_lines(curves: dict[str, list[dict]], target: float, budget: float) -> list[str]:
    """The `ratio:` lines, for each arm but grpo (each curve non-empty, grpo's among them): grpo's minutes / the
    arm's to the target (a lower bound when grpo did not reach it within `budget` minutes; none when the arm did
    not), and to their common level, the lower of the two arms' best accuracies (which both reached)."""
    lines = []
    reached = {arm: minutes_to(points, target) for arm, points in curves.items()}
    grpo = reached["grpo"]
    for arm in (a for a in curves if a != "grpo"):
        if reached[arm] is not None:
            bound = "" if grpo is not None else " at least"
            lines.append(f"ratio:{bound} {(grpo if grpo is not None else budget) / reached[arm]:.2f} (grpo's "
                         f"minutes to {100 * target:.1f}% / {arm}'s)")
        level = min(max(p["accuracy"] for p in points) for points in (curves[arm], curves["grpo"]))
        at = {a: minutes_to(curves[a], level) for a in (arm, "grpo")}
        lines.append(f"ratio: {at['grpo'] / at[arm]:.2f} at the common level {100 * level:.1f}% (the lower arm's "
                     f"best): grpo {at['grpo']:.1f} min, {arm} {at[arm]:.1f} min")
    return lines


def check_run(arm: str, run: list[str]) -> None:
    """`python -m astrai.train ... --check` of `arm`'s command `run` (seconds).

    Raises:
        SystemExit: the check refused it (its last line quoted).
    """
    check = subprocess.run([*run, "--check"], cwd=REPO, capture_output=True, text=True)
    if check.returncode != 0:
        said = (check.stderr or check.stdout).strip().splitlines() or ["(no output)"]
        sys.exit(f"{arm}: `python -m astrai.train --check` refused the run: {said[-1]}")


def parse_args(argv=None) -> argparse.Namespace:
    """The command line; bad values exit 2 with one line (argparse's usage error)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=DefaultsFormatter)
    parser.add_argument("--teacher", required=True, help="the teacher model (a checkpoint directory)")
    parser.add_argument("--student", default="smollm2-135m-instruct", help="every arm's starting model")
    parser.add_argument("--minutes", type=float, default=15.0, help="training minutes per arm at most")
    parser.add_argument("--eval-steps", type=int, default=20, help="evaluate every this many optimizer steps")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--arms", default=",".join(RECIPES), help="comma-separated, of " + ", ".join(RECIPES))
    parser.add_argument("--output-dir", default=None, help="keep the runs here (unset: a temporary directory)")
    args = parser.parse_args(argv)
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in args.arms if a not in RECIPES]
    if unknown or not args.arms:
        parser.error(f"--arms: expected some of {', '.join(RECIPES)}, got {unknown or 'none'}")
    if not math.isfinite(args.minutes) or args.minutes <= 0:
        parser.error(f"--minutes: expected a finite number > 0, got {args.minutes}")
    for name in ("eval_steps", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: expected >= 1")
    if not Path(args.teacher).expanduser().exists():
        parser.error(f"--teacher: {args.teacher} does not exist (make it with the commands in "
                     f"{RECIPES['distill'].relative_to(REPO)})")
    for name in ("teacher", "student"):  # a model each, checked before the teacher's evaluation
        try:
            resolve_model_path(getattr(args, name))
        except (FileNotFoundError, ValueError) as err:
            parser.error(f"--{name}: {err}")
    check_output_dir(parser, args.output_dir)
    if args.output_dir:
        runs = [Path(args.output_dir) / arm for arm in args.arms]
        used = [run for run in runs if run.is_dir() and any(run.iterdir())]
        if used:
            parser.error(f"--output-dir: {used[0]} holds an earlier run; give another --output-dir or delete it")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.output_dir) if args.output_dir else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        print(f"distill vs grpo: at most {args.minutes:g} training minutes per arm, evaluated every "
              f"{args.eval_steps} steps, {args.threads} thread(s), {os.cpu_count()} CPUs, "
              f"load {os.getloadavg()[0]:.2f}", flush=True)
        for arm in args.arms:  # each arm's configuration checked in seconds before any evaluation or training
            if arm != "seqkd":  # its data, the teacher's answers, is checked once written
                check_run(arm, command(arm, args, root / arm))
        teacher = evaluate(args.teacher, root / "teacher_eval", args.threads, kept=bool(args.output_dir))
        target = 0.9 * teacher["accuracy"]
        print(f"  teacher: {100 * teacher['accuracy']:.1f}% [{100 * teacher['ci_low']:.1f}, "
              f"{100 * teacher['ci_high']:.1f}]; target (90% of it): {100 * target:.1f}%", flush=True)
        curves = {}
        for arm in args.arms:
            out, offset, run = root / arm, 0.0, command(arm, args, root / arm)
            if arm == "seqkd":
                demonstrations, rows, offset = teacher_demonstrations(args, root)
                print(f"  seqkd: the teacher answered the {TRAIN} questions in {offset:.1f} min; {rows} right answers "
                      "to train on", flush=True)
                if not rows or offset >= args.minutes:
                    print(f"  seqkd: {'no right answer' if not rows else 'no minutes left'} to train on: skipped",
                          flush=True)
                    continue
                run = command(arm, args, out, minutes=args.minutes - offset, demonstrations=demonstrations)
                check_run(arm, run)
            with open(root / f"{arm}.log", "w") as log:
                code = subprocess.call(run, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                       env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
            if code != 0:
                sys.exit(run_failed(f"{arm}: the training run", code, root / f"{arm}.log", kept=bool(args.output_dir)))
            curves[arm] = [{**p, "minutes": p["minutes"] + offset} for p in curve(out)]
            if not curves[arm]:
                print(f"  {arm}: no evaluation within {args.minutes:g} minutes (the first comes after "
                      f"{args.eval_steps} steps): raise --minutes or lower --eval-steps", flush=True)
            reached = minutes_to(curves[arm], target)
            final = evaluate(str(out), root / f"{arm}_eval", args.threads, kept=bool(args.output_dir))
            points = ", ".join(f"{100 * p['accuracy']:.1f}% at {p['step']} ({p['minutes']:.1f} min)"
                               for p in curves[arm])
            when = (f"reached {100 * target:.1f}% at {reached:.1f} min" if reached is not None
                    else f"did not reach {100 * target:.1f}% in {args.minutes:g} min")
            print(f"  {arm:<8} {points}\n           final, python -m astrai.evaluate: {100 * final['accuracy']:.1f}% "
                  f"[{100 * final['ci_low']:.1f}, {100 * final['ci_high']:.1f}]; {when}", flush=True)
        drawn = {arm: points for arm, points in curves.items() if points}
        if "grpo" in drawn and len(drawn) > 1:
            for line in ratio_lines(drawn, target, args.minutes):
                print(line)
        elif "grpo" in args.arms and len(args.arms) > 1:
            print("no ratio: grpo, or every other arm, has no evaluation")
        plot(drawn,
             (Path(args.output_dir) if args.output_dir else Path.cwd()) / "distill_vs_grpo.png", x="minutes",
             xlabel=f"minutes of training, evaluations included (seqkd: the teacher's answers too; {os.cpu_count()} "
                    f"CPUs, {args.threads} threads)",
             title=f"{Path(args.student).name} on builtin:arithmetic",
             levels=((teacher["accuracy"], f"teacher {100 * teacher['accuracy']:.1f}%", "--"),
                     (target, f"90% of it, {100 * target:.1f}%", ":")))


if __name__ == "__main__":
    main()
