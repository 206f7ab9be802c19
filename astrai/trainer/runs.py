"""Training runs sharing an output directory: each run has an id, recorded in its checkpoints.

A fresh start gets a new run id; a resumed run keeps the id of the checkpoint it resumes. The id goes into every
checkpoint's manifest and `trainer_state.json`, and `<output_dir>/run.json` names the run that last started in
the directory. `keep_last` retention and `--checkpoint.resume auto` only consider the current run's
checkpoints, so an older run's `step-00000010` is neither picked for resuming nor counted (or kept in place of
the new run's checkpoints) by retention. Checkpoints without a run id (written before run ids existed) belong to
no run; in a directory that holds only such checkpoints and no `run.json` (its runs all predate run ids),
`resume auto` continues the newest of them under a new run id.

A fresh start (`--checkpoint.resume none`) in a directory that already holds checkpoints is refused unless
`--overwrite_output_dir true` (the `transformers.TrainingArguments` name): the old checkpoints are then left
alone and ignored, and a step the new run publishes replaces the old directory of the same name.

A restarted job resumes itself: `run.json` also records the launch that started the run (`launch_id`: the Slurm job
id, which a requeued job keeps; else the torchrun agent that restarts its workers, by host and pid). When the launch
that starts now is the one recorded there, this start is a restart of that job (torchrun `--max-restarts`, a Slurm
requeue), and `checkpoint.resume` is taken as `auto` whatever the job file says, so the run continues from its
latest checkpoint instead of refusing (resume none) or going back to an older one (a resume path).
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Optional

from astrai.checkpoint import CheckpointError, checkpoints_root, find_latest_checkpoint, list_checkpoints, parse_step
from astrai.checkpoint.fsutil import write_atomic
from astrai.checkpoint.layout import is_complete, run_id_of
from astrai.checkpoint.manifest import read_manifest
from astrai.trainer.resume import resolve_resume

__all__ = ["RUN_FILE", "new_run_id", "current_run_id", "launch_id", "resolve_run", "record_run"]

RUN_FILE = "run.json"
"""`<output_dir>/run.json`: {"run_id": ...} of the run that last started in the directory."""


def new_run_id() -> str:
    """A fresh run id: start time (UTC, sortable) and 8 random hex digits, e.g. `20250101-120000-1a2b3c4d`."""
    return f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:8]}"


def launch_id(env=os.environ) -> Optional[str]:
    """The launch this process belongs to, stable across the restarts of one job: "slurm:<SLURM_JOB_ID>" inside a
    Slurm job (a requeued job keeps its id), "torchrun:<host>:<agent pid>:<rendezvous id>" under a torchrun (or
    `accelerate launch`) agent, which restarts its workers itself; None otherwise."""
    if env.get("SLURM_JOB_ID"):
        return f"slurm:{env['SLURM_JOB_ID']}"
    if "TORCHELASTIC_RESTART_COUNT" in env:
        return f"torchrun:{socket.gethostname()}:{os.getppid()}:{env.get('TORCHELASTIC_RUN_ID', '')}"
    return None


def _recorded_launch(output_dir: Path) -> Optional[str]:
    try:
        value = json.loads((output_dir / RUN_FILE).read_text(encoding="utf-8")).get("launch_id")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def restarted(output_dir: str | Path, env=os.environ) -> bool:
    """Whether this start is a restart of the launch recorded in `<output_dir>/run.json` (see the module docstring)."""
    current = launch_id(env)
    return current is not None and _recorded_launch(Path(output_dir)) == current


def current_run_id(output_dir: str | Path) -> Optional[str]:
    """The run id in `<output_dir>/run.json`, else that of the most recently published checkpoint that records
    one (manifest time), else None."""
    try:
        value = json.loads((Path(output_dir) / RUN_FILE).read_text(encoding="utf-8")).get("run_id")
        if isinstance(value, str) and value:
            return value
    except (OSError, ValueError, AttributeError):
        pass
    dated = [((path / "manifest.json").stat().st_mtime_ns, run_id_of(path))
             for _, path in list_checkpoints(output_dir)]
    dated = [(t, run) for t, run in dated if run is not None]
    return max(dated)[1] if dated else None


def _step_dirs(output_dir: Path) -> list[Path]:
    """Every published-looking `step-*` directory (complete or not, any run), sorted by name."""
    root = checkpoints_root(output_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if parse_step(p.name) is not None and p.is_dir())


def _write_run_file(output_dir: Path, run_id: str) -> None:
    """Atomically replace `<output_dir>/run.json` (the run id and this process's `launch_id`).

    Raises:
        OutputWriteError: it cannot be written (one line naming it; the previous run.json stays whole).
    """
    from astrai.outputs import OutputWriteError

    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(output_dir / RUN_FILE, json.dumps({"run_id": run_id, "launch_id": launch_id()}) + "\n")
    except OSError as err:
        raise OutputWriteError.of(output_dir / RUN_FILE, err) from None


def resolve_run(resume: str, output_dir: str | Path, *, overwrite: bool, dist) -> tuple[Optional[Path], str]:
    """The checkpoint to resume from (None: fresh start) and this run's id, the same on every rank.

    Reads the directory only: nothing is written, so a job that fails later while it builds (a bad data path, a
    corrupt checkpoint) leaves `run.json` naming the run that last started there. `record_run` writes it once
    the job has built. Every rank reads the directory (so a refusal is raised everywhere); the main rank's run
    id is broadcast to the others (`dist` None: this process only, as `python -m astrai.train --check` does).

    A restart of the recorded launch (`restarted`, decided by the main rank) resumes `auto` whatever `resume` says,
    and says so.

    Raises:
        CheckpointError: a fresh start in a directory holding checkpoints without `overwrite`, a `resume` path
            that is not a directory, or `resume auto` finding only damaged checkpoints that may be the run's
            (`_refuse_damaged`).
    """
    output_dir = Path(output_dir)
    again = restarted(output_dir) if dist is None or dist.is_main else False
    if dist is not None:
        again = dist.broadcast_object(again)
    if again and resume != "auto":
        if dist is None or dist.is_main:
            print(f"restart of the same job ({launch_id()}): checkpoint.resume {resume} becomes auto, so the run "
                  "continues from its latest checkpoint")
        resume = "auto"
    existing = _step_dirs(output_dir)
    if resume == "none" and existing and not overwrite:
        raise CheckpointError(f"train.output_dir {output_dir} already holds {len(existing)} checkpoint(s) (newest "
                              f"{existing[-1].name}): pass --checkpoint.resume auto to continue its run, "
                              f"--overwrite_output_dir true to start a new run there, or another --train.output_dir")
    current = current_run_id(output_dir) if resume == "auto" else None
    if resume == "auto" and current is None:
        # no run.json and no checkpoint with a run id: checkpoints written before run ids existed are the history
        # of this directory, so `resume auto` continues the newest of them (the work is never dropped)
        resume_from = find_latest_checkpoint(output_dir)
    else:
        resume_from = resolve_resume(resume, output_dir, run_id=current)
    if resume == "auto" and resume_from is None:
        _refuse_damaged(output_dir, current)
    run_id = (run_id_of(resume_from) if resume_from is not None else None) or current or new_run_id()
    return resume_from, (dist.broadcast_object(run_id) if dist is not None else run_id)


def _refuse_damaged(output_dir: Path, run_id: Optional[str]) -> None:
    """`resume auto` found no checkpoint to continue: refuse when the directory holds damaged ones that may be the
    run's own (missing or resized files of run `run_id`, or of any run when `run_id` is None; an unreadable
    manifest), instead of starting the run afresh beside them. Checkpoints marked bad (`python -m astrai.checkpoint
    mark-bad`), those whose manifest names another run or none (written before run ids) and legacy ones without a
    manifest are left out, as `resume auto` skips them.

    Raises:
        CheckpointError: one line naming the damaged checkpoints (the first three, with why) and the ways out.
    """
    damaged = []
    for path in reversed(_step_dirs(output_dir)):
        ok, reason = is_complete(path, step=parse_step(path.name))
        if ok or reason == "legacy" or reason.startswith("marked bad"):
            continue
        try:  # an unreadable manifest may be the run's own; a readable one names its run (or none: an older run)
            owner, readable = run_id_of(path), read_manifest(path) is not None
        except CheckpointError:
            owner, readable = None, False
        if run_id is None or owner == run_id or not readable:
            damaged.append(f"{path.name} ({' '.join(reason.split())})")
    if damaged:
        shown = "; ".join(damaged[:3]) + ("; ..." if len(damaged) > 3 else "")
        raise CheckpointError(
            f"checkpoint.resume auto: {output_dir} holds no intact checkpoint of run {run_id or '?'}, only "
            f"{len(damaged)} damaged: {shown}; `python -m astrai.checkpoint verify DIR` says what is wrong with one, "
            "`mark-bad DIR` makes resume auto skip one whose manifest reads (also for a restarted launch, which "
            "resumes auto; move away one whose manifest does not), "
            "--checkpoint.resume DIR resumes a repaired one, or --checkpoint.resume none --overwrite_output_dir true "
            "starts a new run beside them")


def record_run(output_dir: str | Path, run_id: str, *, resume_from: Optional[Path], resume: str, dist) -> None:
    """Name `run_id` in `<output_dir>/run.json` (main rank), once the job has built, and say what the run does
    with the checkpoints of other runs in the directory.

    Raises:
        OutputWriteError: on the main rank, run.json cannot be written.
    """
    output_dir = Path(output_dir)
    if not dist.is_main:
        return
    _write_run_file(output_dir, run_id)
    others = [p for p in _step_dirs(output_dir) if run_id_of(p) != run_id]
    if others and resume_from is None:
        why = "overwrite_output_dir" if resume == "none" else "checkpoint.resume auto: no checkpoint of the " \
                                                                "current run, starting fresh;"
        print(f"{why} run {run_id} ignores the {len(others)} checkpoint(s) of other runs in "
              f"{checkpoints_root(output_dir)} (keep_last and resume auto leave them alone; a step this run "
              f"publishes replaces the directory of the same name)")
