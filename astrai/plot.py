"""`python -m astrai.plot RUN_DIR [RUN_DIR ...] [--x step|minutes] [--output FILE]`: a PNG of training curves from
runs' metrics.jsonl files.

One panel per quantity: held-out accuracy (`train.eval_steps`; its 95% Wilson interval as error bars), reward, KL,
the training loss of the offline train types (`train/loss`), policy loss, value loss, explained variance, response
length and learning rate (`PANELS`). A panel whose metric never appears in any run (e.g. value loss for GRPO) is
left out. The x axis is the optimizer step, or with `--x minutes` the wall time of training from
`time/elapsed_seconds` (the spans of a resumed run's sessions added up), which is how two runs that differ in speed
(a bf16 rollout copy against fp32, one engine against another) are compared. Several run directories are drawn
over each other in every panel, one colour each, named in a legend by their directory (its last part where those
differ); they need `--output`, a .png name. Needs matplotlib (`pip install 'astrai[plot]'`); drawing uses the
non-interactive Agg backend. A torn last line of metrics.jsonl (a crash or a full disk cut it) is skipped and said
once. The PNG is replaced atomically. Exit codes: 0 written, 2 bad input (no such run directory, no metrics.jsonl,
nothing to plot, no elapsed time for `--x minutes`, several runs without `--output`, an output name that is not a
.png, matplotlib missing) or a PNG that cannot be written (one line naming it and the cause, e.g. a full disk;
nothing partial is left).
"""

from __future__ import annotations

import argparse
import io
import math
import os
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
DPI_RANGE = (10, 1200)
"""`--dpi` bounds: below 10 matplotlib cannot size its text; above 1200 a figure of nine panels needs gigabytes."""


def read_records(path: str | Path, *, say=warn_line) -> list[dict]:
    """The JSON objects of a metrics.jsonl file that have a step, skipping blank and torn (crash-truncated) lines;
    what was skipped is said once through `say` (`outputs.read_jsonl`).

    Raises:
        FileNotFoundError: one line naming the file (also when it cannot be read).
    """
    path = Path(path)
    try:
        if not path.is_file():
            raise FileNotFoundError(f"no metrics file at {path} (expected a run directory written by astrai.train)")
        records = read_jsonl(path, say=say)
    except FileNotFoundError:
        raise
    except OSError as err:
        raise FileNotFoundError(f"cannot read {path}: {err.strerror or err}") from None
    return [r for r in records if _finite(r.get("step"))]


def _finite(value) -> bool:
    """A JSON number (not a bool) that is a finite float."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an integer past float's range
        return False


def save_png(fig, target: Path, dpi: int) -> None:
    """Draw `fig` as a PNG and replace `target` (a path with no symbolic link left in it: `output_target`) with it
    atomically (a hidden sibling renamed over it), so a full disk leaves the previous file or none, never half a
    PNG; the directories created for it are removed again when the write fails.

    Raises:
        OSError: the directory or the file cannot be written (the sibling and the new directories are removed).
    """
    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=dpi, format="png")
    existing = nearest_existing(target.parent)
    created = [d for d in (target.parent, *target.parent.parents)  # below the nearest existing one, deepest first
               if existing is not None and existing in d.parents]
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(target, buffer.getvalue())
    except OSError:
        for folder in created:  # deepest first; one a concurrent writer filled is left
            try:
                folder.rmdir()
            except OSError:
                pass
        raise


def output_target(output: Path, option: str) -> Path:
    """The file a PNG named `output` is written to: `output` with its symbolic links followed (a link is written
    through, the link kept), after the checks that keep a slip from damaging anything.

    Raises:
        FileNotFoundError: (one line naming `option`) a file where a directory is needed, or a directory named.
        ValueError: a name that is not .png, a link to a file that is not, or a link that does not resolve.
    """
    target = Path(os.path.realpath(output))
    if target.is_symlink():  # realpath stops at a loop
        raise ValueError(f"{option}: {output} is a symbolic link that does not resolve (a loop)")
    blocker = nearest_existing(target.parent)
    if blocker is not None and not blocker.is_dir():
        raise FileNotFoundError(f"{option}: {blocker} is a file, not a directory (needed for {output})")
    if target.is_dir():
        raise FileNotFoundError(f"{option}: {output} is a directory; give a .png file path")
    if output.suffix.lower() != ".png":  # never a run's own metrics.jsonl overwritten by a slip
        raise ValueError(f"{option}: expected a .png file name, got {str(output)!r}")
    if target.suffix.lower() != ".png":
        raise ValueError(f"{option}: {output} is a link to {target}, which is not a .png file; it would be written "
                         "through")
    return target


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
        if not _finite(value):
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
        if _finite(value):
            step = float(record["step"])
            if clock is not None and step not in clock:
                continue
            xs.append(step if clock is None else clock[step])
            values.append(float(value))
    return xs, values


def run_labels(run_dirs: Sequence[str | Path]) -> list[str]:
    """Legend names of `run_dirs`: their last parts (of the resolved path: "." is named) where those are distinct,
    else the paths as given."""
    names = [Path(d).resolve().name or str(d) for d in run_dirs]
    return names if len(set(names)) == len(names) else [str(d) for d in run_dirs]


def draw(records: Sequence[dict] | dict[str, Sequence[dict]], *, title: Optional[str] = None, x: str = "step",
         say=warn_line):
    """A matplotlib `Figure` with one panel per `PANELS` entry present in `records`: one run's records, or
    {legend name: records} for several runs drawn over each other, one colour each, in a legend above the panels.

    Each panel is titled with the `PANELS` title, x = step (or minutes of training with `x="minutes"`,
    `training_minutes`; one x range for every panel), y = the metric; held-out accuracy draws its 95% interval
    (`eval/accuracy_ci_low` / `_ci_high`) as error bars where the run logged it. A run with nothing to draw is said
    through `say` and left out of the legend. The figure is `min(n, 3) * 4` by `ceil(n / 3) * 3` inches for n
    panels (more with a legend).

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
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    curves = {label: {key: series(run, key, x) for key, _ in PANELS} for label, run in runs.items()}
    drawn = [label for label in runs if any(xs for xs, _ in curves[label].values())]
    present = [(key, name) for key, name in PANELS if any(curves[label][key][0] for label in drawn)]
    if not present:
        where = f"in {title}/metrics.jsonl" if title else "in any run's metrics.jsonl"
        what = "no step has time/elapsed_seconds and one of" if x == "minutes" else "none of"
        raise ValueError(f"nothing to plot {where}: {what} " + ", ".join(k for k, _ in PANELS))
    for label in runs:
        if label not in drawn:
            say(f"{label}: nothing to plot (none of the panels' metrics"
                f"{' at a step with time/elapsed_seconds' if x == 'minutes' else ''}); left out")
    cycle = matplotlib.rcParams["axes.prop_cycle"].by_key().get("color", [])
    palette = (cycle if len(drawn) <= len(cycle) else
               [matplotlib.colormaps["turbo"](i / max(len(drawn) - 1, 1)) for i in range(len(drawn))])
    colors = dict(zip(drawn, palette))
    cols = min(len(present), COLUMNS)
    rows = math.ceil(len(present) / cols)
    legend = len(runs) > 1
    height = rows * PANEL_INCHES[1] + (0.3 * math.ceil(len(drawn) / 3) if legend else 0)
    fig = Figure(figsize=(cols * PANEL_INCHES[0], height), layout="constrained")
    first = None
    for i, (key, name) in enumerate(present):
        ax = fig.add_subplot(rows, cols, i + 1, sharex=first)
        first = first or ax
        interval = False
        for label in drawn:
            xs, values = curves[label][key]
            if not xs:
                continue
            style = dict(color=colors[label], marker="o" if len(xs) < 30 else None, markersize=3)
            low, high = ((dict(zip(*series(runs[label], f"{key}_ci_{end}", x))) for end in ("low", "high"))
                         if key == "eval/accuracy" else ({}, {}))
            if any(at in low and at in high for at in xs):
                below = [v - low.get(at, v) if at in high else 0.0 for at, v in zip(xs, values)]
                above = [high.get(at, v) - v if at in low else 0.0 for at, v in zip(xs, values)]
                ax.errorbar(xs, values, yerr=[below, above], capsize=3, elinewidth=1, **style)
                interval = True
            else:
                ax.plot(xs, values, **style)
        ax.set_title(f"{name} (bars: 95% interval)" if interval else name)
        ax.set_xlabel("step" if x == "step" else "minutes of training")
        if x == "step":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(key, fontsize="small")
        ax.grid(True, alpha=0.3)
    if legend:
        handles = [Line2D([], [], color=colors[label], marker="o", markersize=3) for label in drawn]
        fig.legend(handles, drawn, loc="outside upper center", ncols=min(len(drawn), 3), fontsize="small")
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
    parser.add_argument("--dpi", type=int, default=100,
                        help=f"resolution, {DPI_RANGE[0]} to {DPI_RANGE[1]} (default: 100)")
    args = parser.parse_args(argv)
    run_dirs = [Path(d) for d in args.run_dirs]
    try:
        if not DPI_RANGE[0] <= args.dpi <= DPI_RANGE[1]:
            raise ValueError(f"--dpi: expected an integer in [{DPI_RANGE[0]}, {DPI_RANGE[1]}], got {args.dpi}")
        if len(run_dirs) > 1 and not args.output:
            raise ValueError(f"--output: needed with several run directories ({len(run_dirs)} given); give a .png "
                             "file path")
        seen = {}
        for run_dir in run_dirs:
            if run_dir.resolve() in seen:
                raise ValueError(f"run directories: {run_dir} is {seen[run_dir.resolve()]} again")
            seen[run_dir.resolve()] = run_dir
        output = Path(args.output) if args.output is not None else run_dirs[0] / "metrics.png"
        for run_dir in run_dirs:
            if run_dir.exists() and not run_dir.is_dir():
                raise FileNotFoundError(f"run directory expected, got a file: {run_dir}")
            if not run_dir.is_dir():
                raise FileNotFoundError(f"run directory not found: {run_dir}")
        target = output_target(output, "--output" if args.output is not None else "the default output")
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
    except OSError as err:  # a run or output directory that cannot be searched (is_dir raises it on Python 3.11)
        print(f"error: cannot read {err.filename or 'a run directory'}: {err.strerror or err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        save_png(fig, target, args.dpi)
    except OSError as err:
        print(f"error: {cannot_write(output, err)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    import warnings

    from astrai.outputs import show_warning

    warnings.showwarning = show_warning  # "warning: MESSAGE" in one line, as python -m astrai.train says them
    sys.exit(main())
