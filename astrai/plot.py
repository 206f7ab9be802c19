"""`python -m astrai.plot RUN_DIR [--output FILE]`: a PNG of a run's training curves from its metrics.jsonl.

One panel per quantity, against the optimizer step: held-out accuracy (`train.eval_steps`), reward, KL, the
training loss of the offline train types (`train/loss`), policy loss, value loss, explained variance, response
length and learning rate (`PANELS`). A panel whose metric never appears in the file (e.g. value loss for GRPO) is
left out. Needs matplotlib (`pip install 'astrai[plot]'`);
drawing uses the non-interactive Agg backend. A torn last line of metrics.jsonl (a crash or a full disk cut it) is
skipped and said once. The PNG is replaced atomically. Exit codes: 0 written, 2 bad input (no such run directory, no
metrics.jsonl, nothing to plot, matplotlib missing) or a PNG that cannot be written (one line naming it and the
cause, e.g. a full disk; nothing partial is left).
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


def series(records: Sequence[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of `key` over `records`, skipping records without it or with a non-finite value."""
    steps, values = [], []
    for record in records:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            steps.append(float(record["step"]))
            values.append(float(value))
    return steps, values


def draw(records: Sequence[dict], *, title: Optional[str] = None):
    """A matplotlib `Figure` with one panel per `PANELS` entry present in `records`.

    Each panel is titled with the `PANELS` title, x = step, y = the metric. The figure is
    `min(n, 3) * 4` by `ceil(n / 3) * 3` inches for n panels.

    Raises:
        ValueError: when no panel has any data.
        MissingDependencyError: matplotlib missing or failing to import (one line saying which).
    """
    matplotlib = import_optional("matplotlib", needed_by="astrai.plot", install="pip install 'astrai[plot]'")

    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    present = [(key, name) for key, name in PANELS if series(records, key)[0]]
    if not present:
        raise ValueError("nothing to plot: metrics.jsonl has none of " + ", ".join(k for k, _ in PANELS))
    cols = min(len(present), COLUMNS)
    rows = math.ceil(len(present) / cols)
    fig = Figure(figsize=(cols * PANEL_INCHES[0], rows * PANEL_INCHES[1]), layout="constrained")
    for i, (key, name) in enumerate(present):
        ax = fig.add_subplot(rows, cols, i + 1)
        steps, values = series(records, key)
        ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(key, fontsize="small")
        ax.grid(True, alpha=0.3)
    if title:
        fig.suptitle(title)
    return fig


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command line (see the module docstring); returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m astrai.plot",
                                     description="Plot a run's metrics.jsonl (reward, KL, losses, ...) to a PNG.")
    parser.add_argument("run_dir", help="the run's train.output_dir (holds metrics.jsonl)")
    parser.add_argument("--output", default=None, help="PNG path (default: RUN_DIR/metrics.png)")
    parser.add_argument("--dpi", type=int, default=100, help="resolution (default: 100)")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    output = Path(args.output) if args.output else run_dir / "metrics.png"
    try:
        if args.dpi < 1:
            raise ValueError(f"--dpi: expected an integer >= 1, got {args.dpi}")
        if run_dir.exists() and not run_dir.is_dir():
            raise FileNotFoundError(f"run directory expected, got a file: {run_dir}")
        if not run_dir.is_dir():
            raise FileNotFoundError(f"run directory not found: {run_dir}")
        blocker = nearest_existing(output.parent)
        if blocker is not None and not blocker.is_dir():
            raise FileNotFoundError(f"--output: {blocker} is a file, not a directory (needed for {output})")
        if output.is_dir():
            raise FileNotFoundError(f"--output: {output} is a directory; give a .png file path")
        fig = draw(read_records(run_dir / "metrics.jsonl"), title=str(run_dir))
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
