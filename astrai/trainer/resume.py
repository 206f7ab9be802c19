"""Resume: pick the checkpoint to continue from and restore every part of the training state from it.

The parts are the job's (`build.job_parts`): the strategy's (models, optimizers, schedules, data position, its own
RNGs and rollout in progress), the counters (`trainer_state`) and, last, the global RNGs. A required part that is
missing is an error naming its file (`CheckpointError`), never a silent re-initialisation; nothing is loaded then.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional

from astrai.checkpoint import CheckpointError, Part, find_latest_checkpoint, load_checkpoint
from astrai.distributed.launch import RESHARDABLE


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


def check_resume(path: Path, *, train_type: str, world_size: int, strategy: Optional[str], verify: bool = False,
                 critic_layers: Optional[int] = None):
    """The checkpoint at `path` opened (`load_checkpoint`), after the checks that need only its manifest: the
    train type, the engine that wrote it, a world size the engine's state cannot be resharded to, and (online_ppo)
    the critic's size against the job's `ppo.critic_layers` (`critic_layers`; None: all the policy's layers). Cheap
    with `verify=False` (file presence and sizes), so the job refuses before it loads or builds anything.

    Returns: the `LoadedCheckpoint`.
    Raises:
        CheckpointError: one line: another train type; another `distributed.strategy` than `strategy` (the
            engines keep optimizer state in different layouts); ZeRO partitions of another world size; a critic
            of another number of layers (`check_critic_layers`).
    """
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
    check_critic_layers(path, ckpt.manifest, critic_layers)
    return ckpt


def critic_metadata(critic_layers: Optional[int], policy_layers: int) -> dict[str, int]:
    """Manifest fields of an online_ppo checkpoint that say which critic it holds: `critic_layers` (its decoder
    layers: `ppo.critic_layers`, or all of the policy's) and `policy_layers`."""
    return {"critic_layers": critic_layers or policy_layers, "policy_layers": policy_layers}


def check_critic_layers(path: Path, manifest: Optional[Mapping], critic_layers: Optional[int]) -> None:
    """Refuse to resume an online_ppo checkpoint whose critic has another number of decoder layers than the job's
    `ppo.critic_layers` (None: all the policy's) would build, from its manifest alone (`critic_metadata`; a
    checkpoint without those fields is not checked here: its parts are checked when they load).

    Raises:
        CheckpointError: one line with both numbers and the option that resumes it.
    """
    held = (manifest or {}).get("critic_layers")
    if held is None:
        return
    policy_layers = (manifest or {}).get("policy_layers")
    want = critic_layers if critic_layers is not None else policy_layers
    if want != held:
        said = lambda n: f"{n} (all the policy's)" if n == policy_layers else str(n)  # noqa: E731
        raise CheckpointError(f"{path}: its critic has ppo.critic_layers {said(held)}, this job builds "
                              f"{said(want)}; resume with --ppo.critic_layers {held}")


def restore(parts: Mapping[str, Part], path: Path, *, rank: int, train_type: str, verify: bool,
            world_size: int = 1, strategy: Optional[str] = None, critic_layers: Optional[int] = None) -> Optional[str]:
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
            optimizer partitions, a rollout in progress); a critic of another size than `critic_layers` (the
            job's `ppo.critic_layers`, as `check_resume`).
    """
    ckpt = check_resume(path, train_type=train_type, world_size=world_size, strategy=strategy, verify=verify,
                        critic_layers=critic_layers)
    ckpt.restore(parts, rank, world_size)
    if ckpt.world_size == world_size:
        return None
    return (f"resharded a checkpoint of {ckpt.world_size} ranks to {world_size}: the data position carries over; "
            f"ranks {ckpt.world_size}..{world_size - 1} start their own random streams" if world_size > ckpt.world_size
            else f"resharded a checkpoint of {ckpt.world_size} ranks to {world_size}: the data position carries "
                 f"over; the random streams of ranks {world_size}..{ckpt.world_size - 1} end here")
