"""Resume: pick the checkpoint to continue from and restore every piece of training state from it.

Everything a strategy lists in `checkpoint_state()` is restored from its file; a missing file is an error
(`CheckpointError` naming it), never a silent re-initialisation. The strategy's own state (its RNGs, the
rollout in progress) comes from `strategy_state.pt`, the counters from `trainer_state.json`, and the global
RNGs (Python, NumPy, torch) from `rng_state.pt`, restored last.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

from astrai.checkpoint import (CheckpointError, LoadedCheckpoint, find_latest_checkpoint,
                               load_checkpoint, restore_rng_state)
from astrai.checkpoint.payload import rank_file
from astrai.trainer.loop import TrainerState

STRATEGY_STATE = "strategy_state"

# checkpoint_state() key -> how to read its state dict from the checkpoint (rank given).
_READERS: dict[str, Callable[[LoadedCheckpoint, int], Any]] = {
    "policy": lambda ckpt, rank: ckpt.policy_state_dict(),
    "optimizer": lambda ckpt, rank: ckpt.optimizer_state(),
    "scheduler": lambda ckpt, rank: ckpt.scheduler_state(),
    "value_model": lambda ckpt, rank: ckpt.value_model_state(),
    "value_optimizer": lambda ckpt, rank: ckpt.value_optimizer_state(),
    "value_scheduler": lambda ckpt, rank: ckpt.value_scheduler_state(),
    "data_sampler": lambda ckpt, rank: ckpt.data_sampler_state(rank),
}
_NOT_RESTORED = {"tokenizer"}  # rebuilt from the model path; saved for export only


def strategy_state_file(rank: int) -> str:
    """Name of a rank's strategy-state file inside a checkpoint."""
    return rank_file(STRATEGY_STATE, rank, ".pt")


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


def restore(strategy, path: Path, *, rank: int, train_type: str, verify: bool) -> TrainerState:
    """Load `path` into the strategy's objects and return the restored `TrainerState`.

    Raises:
        CheckpointError: on a missing file (named), a manifest/sha256 failure, or a train-type mismatch.
    """
    ckpt = load_checkpoint(path, verify=verify, require_critic=(train_type == "online_ppo"))
    if ckpt.train_type is not None and ckpt.train_type != train_type:
        raise CheckpointError(f"{path}: checkpoint of train type {ckpt.train_type!r}, job is {train_type!r}")
    for key, obj in strategy.checkpoint_state().items():
        if key in _NOT_RESTORED or obj is None:
            continue
        if key not in _READERS:
            raise CheckpointError(f"resume: no reader for checkpoint object {key!r}")
        obj.load_state_dict(_READERS[key](ckpt, rank))
    if hasattr(strategy, "load_state_dict"):
        strategy.load_state_dict(ckpt.load_pt(strategy_state_file(rank)))
    saved = ckpt.trainer_state
    state = TrainerState(global_step=int(saved["global_step"]), policy_version=int(saved["policy_version"]),
                         consumed_samples=int(saved.get("consumed_samples", 0)))
    restore_rng_state(ckpt.rng_state(rank))
    return state
