"""Resume: pick the checkpoint to continue from and restore every part of the training state from it.

The parts are the job's (`build.job_parts`): the strategy's (models, optimizers, schedules, data position, its own
RNGs and rollout in progress), the counters (`trainer_state`) and, last, the global RNGs. A required part that is
missing is an error naming its file (`CheckpointError`), never a silent re-initialisation; nothing is loaded then.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional

from astrai.checkpoint import CheckpointError, Part, find_latest_checkpoint, load_checkpoint


def resolve_resume(resume: str, output_dir: str | Path, *, run_id: Optional[str] = None) -> Optional[Path]:
    """The checkpoint directory to resume from, or None for a fresh start.

    Args:
        resume: "none", "auto" (latest complete checkpoint under `<output_dir>/checkpoints` of run `run_id`
            when given, None if there is none) or a directory path.

    Raises:
        CheckpointError: when a given path is not a directory.
    """
    if resume == "none":
        return None
    if resume == "auto":
        return find_latest_checkpoint(output_dir, run_id=run_id)
    path = Path(resume)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint.resume: not a checkpoint directory: {path}")
    return path


def restore(parts: Mapping[str, Part], path: Path, *, rank: int, train_type: str, verify: bool) -> None:
    """Load the checkpoint at `path` into `parts` (this rank's copies of per-rank parts), in their order.

    Raises:
        CheckpointError: on a missing file of a required part (named), a manifest/sha256 failure, or a train-type
            mismatch.
    """
    ckpt = load_checkpoint(path, verify=verify)
    if ckpt.train_type is not None and ckpt.train_type != train_type:
        raise CheckpointError(f"{path}: checkpoint of train type {ckpt.train_type!r}, job is {train_type!r}")
    ckpt.restore(parts, rank)
