"""Resume: pick the checkpoint to continue from and restore every part of the training state from it.

The parts are the job's (`build.job_parts`): the learner's (models, optimizers, schedules, data position, its own
RNGs and rollout in progress), the counters (`trainer_state`) and, last, the global RNGs. A required part that is
missing is an error naming its file (`CheckpointError`), never a silent re-initialisation; nothing is loaded then.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional

from astrai import train_types
from astrai.checkpoint import CheckpointError, Part, VerificationError, find_latest_checkpoint, load_checkpoint
from astrai.distributed.launch import RESHARDABLE
from astrai.trainer.resume_changes import config_changes, model_path_refusal, refusal


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


def check_resume(path: Path, *, config, world_size: int, strategy: Optional[str], verify: bool = False):
    """The checkpoint at `path` opened (`load_checkpoint`), after the checks that need only its manifest: the
    train type against the job's (`config.train.type`), the engine that wrote it, a world size the engine's state
    cannot be resharded to, and the train type's own rule (`TrainType.resume_problem`, e.g. the critic's size).
    Then the job config against the checkpoint's config.yaml: a field that cannot change on resume
    (`resume_changes.FIXED`: the seed, the data, the MoE layout) is refused, and so is another `model.path` where
    the job builds a reference model or LoRA's base weights from it (`resume_changes.model_path_refusal`). Cheap
    with `verify=False` (file presence and sizes), so the job refuses before it loads or builds anything.

    Returns: the `LoadedCheckpoint`.
    Raises:
        CheckpointError: one line: another train type; another `distributed.strategy` than `strategy` (the
            engines keep optimizer state in different layouts); ZeRO partitions of another world size; the train
            type's own refusal (e.g. a critic of another number of layers); a changed field that cannot change; a
            changed `model.path` the job would build its reference model (or LoRA base) from.
    """
    train_type = config.train.type
    ckpt = load_checkpoint(path, verify=verify)
    if ckpt.train_type is not None and ckpt.train_type != train_type:
        raise CheckpointError(f"{path}: checkpoint of train type {ckpt.train_type!r}, job is {train_type!r}")
    written = (ckpt.manifest or {}).get("distributed_strategy")
    if strategy is not None and written is not None and written != strategy:
        raise CheckpointError(f"{path}: written under distributed.strategy {written}, this job runs {strategy} (the "
                              f"engines keep optimizer state in different layouts); resume with "
                              f"--distributed.strategy {written}, or start a new run from its weights "
                              f"(--model.path {path})")
    if written is not None and written not in RESHARDABLE and ckpt.world_size != world_size:
        raise CheckpointError(f"{path}: written by {ckpt.world_size} ranks, this job has {world_size}: the DeepSpeed "
                              f"ZeRO optimizer partitions cannot be resharded; resume with {ckpt.world_size} "
                              f"processes, or start a new run from its weights (--model.path {path})")
    problem = train_types.get(train_type).resume_problem(ckpt.manifest or {}, config)
    if problem is not None:
        raise CheckpointError(f"{path}: {problem}")
    changes = config_changes(path, config)
    fixed = refusal(changes, path) or model_path_refusal(changes, path, config)
    if fixed is not None:
        raise CheckpointError(fixed)
    return ckpt


def restore(parts: Mapping[str, Part], path: Path, *, rank: int, config, verify: bool, world_size: int = 1,
            strategy: Optional[str] = None) -> Optional[str]:
    """Load the checkpoint at `path` into `parts` (this rank's copies of per-rank parts), in their order.

    A checkpoint written by another number of ranks is resharded (`LoadedCheckpoint.restore`): the data position is
    global and carries over, sharded optimizer state in dcp parts is resharded, ranks that wrote no copy of a
    per-rank part get fresh random streams; the run then continues, though not bit for bit as it would have on the
    old world size.

    Returns:
        None on the same world size, else a one-line note saying what the resize changed (for rank 0 to print).

    Raises:
        CheckpointError: on a missing file of a required part (named), a manifest/sha256 failure, a train-type
            mismatch, a checkpoint written under another `distributed.strategy` than `strategy` (the engines keep
            optimizer state in different layouts), or state that cannot be resharded to `world_size` (ZeRO
            optimizer partitions, a rollout in progress); the train type's own refusal (as `check_resume`).
    """
    try:
        ckpt = check_resume(path, config=config, world_size=world_size, strategy=strategy, verify=verify)
    except VerificationError as err:  # the ways on, as for a damaged checkpoint resume auto meets
        raise VerificationError(f"{err}; `python -m astrai.checkpoint mark-bad {path} --reason TEXT` makes "
                                "--checkpoint.resume auto take the one before it, --checkpoint.resume DIR names "
                                "another") from None
    ckpt.restore(parts, rank, world_size)
    if ckpt.world_size == world_size:
        return None
    return (f"resharded a checkpoint of {ckpt.world_size} ranks to {world_size}: the data position carries over; "
            f"ranks {ckpt.world_size}..{world_size - 1} start their own random streams" if world_size > ckpt.world_size
            else f"resharded a checkpoint of {ckpt.world_size} ranks to {world_size}: the data position carries "
                 f"over; the random streams of ranks {world_size}..{ckpt.world_size - 1} end here")
