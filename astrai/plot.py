"""`python -m astrai.plot RUN_DIR [RUN_DIR ...] [--x step|minutes] [--output FILE]`: a PNG of training curves from
runs' metrics.jsonl files.

One panel per quantity: held-out accuracy (`train.eval_steps`; its 95% Wilson interval shaded), reward, KL, the
training loss of the offline train types (`train/loss`), policy loss, value loss, explained variance, response
length and learning rate (`PANELS`). A panel whose metric never appears in any run (e.g. value loss for GRPO) is
left out. The x axis is the optimizer step, or with `--x minutes` the wall time of training from
`time/elapsed_seconds` (the spans of a resumed run's sessions added up), which is how two runs that differ in speed
(a bf16 rollout copy against fp32, one engine against another) are compared. Several run directories are drawn
over each other in every panel, one colour each, named in a legend by their directory (its last part where those
differ); they need `--output`. Needs matplotlib (`pip install 'astrai[plot]'`); drawing uses the non-interactive
Agg backend. A torn last line of metrics.jsonl (a crash or a full disk cut it) is skipped and said once. The PNG is
replaced atomically. Exit codes: 0 written, 2 bad input (no such run directory, no metrics.jsonl, nothing to plot,
no elapsed time for `--x minutes`, several runs without `--output`, matplotlib missing) or a PNG that cannot be
written (one line naming it and the cause, e.g. a full disk; nothing partial is left).
"""

from __future__ import annotations

import argparse
import io
import math
import sys
from pathlib import Path
from typing import Optional, Sequence

from astrai.checkpoint.fsutil import nearest_existing, write_atomic
from astrai.deps import MissingDependencyError, import_optional
from astrai.outputs import cannot_write, read_jsonl, warn_line

EXIT_BAD_INPUT = 2

PANELS: tuple[tuple[str, str], ...] = (
    ("eval/accuracy", "held-out accuracy"),
    ("rollout/reward_mean", "reward"),
    ("rollout/kl", "KL"),
    ("train/loss", "training loss"),
    ("policy/loss", "policy loss"),
    ("critic/loss", "value loss"),
    ("critic/explained_variance", "explained variance"),
    ("rollout/response_length", "response length (tokens)"),
    ("policy/lr", "learning rate"),
)
"""(metrics.jsonl key, panel title), in drawing order."""

PANEL_INCHES = (4.0, 3.0)
"""Width and height of one panel in inches; the figure has up to 3 panels per row."""
COLUMNS = 3


def read_records(path: str | Path, *, say=warn_line) -> list[dict]:
    """The JSON objects of a metrics.jsonl file that have a step, skipping blank and torn (crash-truncated) lines;
    what was skipped is said once through `say` (`outputs.read_jsonl`).

    Raises:
        FileNotFoundError: one line naming the file (also when it cannot be read).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file at {path} (expected a run directory written by astrai.train)")
    try:
        records = read_jsonl(path, say=say)
    except OSError as err:
        raise FileNotFoundError(f"cannot read {path}: {err.strerror or err}") from None
    return [r for r in records if isinstance(r.get("step"), (int, float)) and not isinstance(r.get("step"), bool)]


def save_png(fig, output: Path, dpi: int) -> None:
    """Draw `fig` as a PNG and replace `output` with it atomically (a hidden sibling renamed over it), so a full
    disk leaves the previous file or none, never half a PNG.

    Raises:
        OSError: the directory or the file cannot be written (the sibling is removed).
    """
    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=dpi, format="png")
    output.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(output, buffer.getvalue())


X_AXES = ("step", "minutes")
"""`--x` choices: the optimizer step, or minutes of training (`time/elapsed_seconds`)."""


def training_minutes(records: Sequence[dict]) -> dict[float, float]:
    """step -> minutes of training at the end of that step, from `time/elapsed_seconds` (seconds since the session
    began training). A resumed run starts that clock again: a session's first step is told by its elapsed time
    equal to its `time/step_seconds` (`StepTimer` times both from the same start), or else by a clock that went
    back; the sessions before are added on, so the minutes are those the run trained in all. Steps whose record has
    no finite elapsed time are left out."""
    minutes, offset, last = {}, 0.0, None
    for record in records:
        value = record.get("time/elapsed_seconds")
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            continue
        if last is not None and (value < last or value == record.get("time/step_seconds")):  # a new session
            offset += last
        last = float(value)
        minutes[float(record["step"])] = (offset + last) / 60.0
    return minutes


def series(records: Sequence[dict], key: str, x: str = "step") -> tuple[list[float], list[float]]:
    """(xs, values) of `key` over `records`, skipping records without it or with a non-finite value; xs are steps,
    or with `x="minutes"` minutes of training (`training_minutes`; steps without an elapsed time skipped)."""
    clock = training_minutes(records) if x == "minutes" else None
    xs, values = [], []
    for record in records:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            step = float(record["step"])
            if clock is not None and step not in clock:
                continue
            xs.append(step if clock is None else clock[step])
            values.append(float(value))
    return xs, values


def run_labels(run_dirs: Sequence[str | Path]) -> list[str]:
    """Legend names of `run_dirs`: their last parts where those are distinct, else the paths as given."""
    names = [Path(d).name or str(d) for d in run_dirs]
    return names if len(set(names)) == len(names) else [str(d) for d in run_dirs]


def draw(records: Sequence[dict] | dict[str, Sequence[dict]], *, title: Optional[str] = None, x: str = "step"):
    """A matplotlib `Figure` with one panel per `PANELS` entry present in `records`: one run's records, or
    {legend name: records} for several runs drawn over each other (a legend in the first panel).

    Each panel is titled with the `PANELS` title, x = step (or minutes of training with `x="minutes"`,
    `training_minutes`), y = the metric; held-out accuracy shades its 95% interval (`eval/accuracy_ci_low` /
    `_ci_high`) where the run logged it. The figure is `min(n, 3) * 4` by `ceil(n / 3) * 3` inches for n panels.

    Raises:
        ValueError: when no panel has any data, or `x` is not one of `X_AXES`.
        MissingDependencyError: matplotlib missing or failing to import (one line saying which).
    """
    if x not in X_AXES:
        raise ValueError(f"--x: expected one of {', '.join(X_AXES)}, got {x!r}")
    runs = dict(records) if isinstance(records, dict) else {"": records}
    matplotlib = import_optional("matplotlib", needed_by="astrai.plot", install="pip install 'astrai[plot]'")

    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    present = [(key, name) for key, name in PANELS if any(series(r, key, x)[0] for r in runs.values())]
    if not present:
        what = "has a step with time/elapsed_seconds and" if x == "minutes" else "has"
        raise ValueError(f"nothing to plot: no metrics.jsonl {what} any of " + ", ".join(k for k, _ in PANELS))
    cols = min(len(present), COLUMNS)
    rows = math.ceil(len(present) / cols)
    fig = Figure(figsize=(cols * PANEL_INCHES[0], rows * PANEL_INCHES[1]), layout="constrained")
    for i, (key, name) in enumerate(present):
        ax = fig.add_subplot(rows, cols, i + 1)
        for label, run in runs.items():
            xs, values = series(run, key, x)
            (line,) = ax.plot(xs, values, marker="o" if len(xs) < 30 else None, markersize=3, label=label or None)
            if key == "eval/accuracy":
                low, high = (dict(zip(*series(run, f"{key}_ci_{end}", x))) for end in ("low", "high"))
                band = [(at, low[at], high[at]) for at in xs if at in low and at in high]
                if band:
                    ax.fill_between(*zip(*band), color=line.get_color(), alpha=0.2, linewidth=0)
        ax.set_title(name)
        ax.set_xlabel("step" if x == "step" else "minutes of training")
        if x == "step":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(key, fontsize="small")
        ax.grid(True, alpha=0.3)
        if i == 0 and len(runs) > 1:
            ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    return fig


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command line (see the module docstring); returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m astrai.plot",
                                     description="Plot runs' metrics.jsonl (reward, KL, losses, ...) to a PNG.")
    parser.add_argument("run_dirs", nargs="+", metavar="run_dir",
                        help="a run's train.output_dir (holds metrics.jsonl); several are drawn over each other")
    parser.add_argument("--output", default=None,
                        help="PNG path (default with one run: RUN_DIR/metrics.png; needed with several)")
    parser.add_argument("--x", default="step", choices=X_AXES,
                        help="x axis: the optimizer step (default) or minutes of training")
    parser.add_argument("--dpi", type=int, default=100, help="resolution (default: 100)")
    args = parser.parse_args(argv)
    run_dirs = [Path(d) for d in args.run_dirs]
    try:
        if args.dpi < 1:
            raise ValueError(f"--dpi: expected an integer >= 1, got {args.dpi}")
        if len(run_dirs) > 1 and not args.output:
            raise ValueError(f"--output: needed with several run directories ({len(run_dirs)} given); give a .png "
                             "file path")
        if len({d.resolve() for d in run_dirs}) < len(run_dirs):
            raise ValueError("run directories: one is given twice")
        output = Path(args.output) if args.output else run_dirs[0] / "metrics.png"
        for run_dir in run_dirs:
            if run_dir.exists() and not run_dir.is_dir():
                raise FileNotFoundError(f"run directory expected, got a file: {run_dir}")
            if not run_dir.is_dir():
                raise FileNotFoundError(f"run directory not found: {run_dir}")
        blocker = nearest_existing(output.parent)
        if blocker is not None and not blocker.is_dir():
            raise FileNotFoundError(f"--output: {blocker} is a file, not a directory (needed for {output})")
        if output.is_dir():
            raise FileNotFoundError(f"--output: {output} is a directory; give a .png file path")
        runs = {label: read_records(d / "metrics.jsonl") for label, d in zip(run_labels(run_dirs), run_dirs)}
        if len(runs) == 1:
            fig = draw(next(iter(runs.values())), title=str(run_dirs[0]), x=args.x)
        else:
            fig = draw(runs, x=args.x)
    except MissingDependencyError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        save_png(fig, output, args.dpi)
    except OSError as err:
        print(f"error: {cannot_write(output, err)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
