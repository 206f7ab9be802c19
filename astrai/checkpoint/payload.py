"""What goes into a checkpoint directory (the payload), and RNG state capture/restore.

Rank 0 (or the only process) writes:
  model.safetensors, config.json, tokenizer files      the policy, loadable by `transformers`
  optimizer.pt, scheduler.pt                           policy optimizer / LR schedule `state_dict()`s
  value_model.pt, value_optimizer.pt, value_scheduler.pt   critic extras (online_ppo)
  rng_state.pt                                         python / numpy / torch (+ CUDA) RNG of rank 0
  trainer_state.json                                   the caller's counters (step, policy_version,
                                                       consumed_samples, ...) plus "train_type" and
                                                       "data_sampler" (the sampler's plain-JSON state:
                                                       epoch, position, seed, ...)
Every other rank R writes `rng_state_rank{R:05d}.pt`, `data_sampler_rank{R:05d}.json` (when it has a
data sampler) and its `rank_files`.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch
from safetensors.torch import save_file

from astrai.checkpoint.manifest import CRITIC_FILES, CRITIC_TRAIN_TYPES, CheckpointError, safe_member

STATE_DICT_OBJECTS = ("optimizer", "scheduler", "value_model", "value_optimizer", "value_scheduler")
KNOWN_OBJECTS = ("policy", "tokenizer", "data_sampler") + STATE_DICT_OBJECTS


def rank_file(stem: str, rank: int, suffix: str) -> str:
    """Name of a per-rank file: rank 0 -> `<stem><suffix>`, rank R -> `<stem>_rank{R:05d}<suffix>`."""
    return f"{stem}{suffix}" if rank == 0 else f"{stem}_rank{rank:05d}{suffix}"


def capture_rng_state() -> dict[str, Any]:
    """Python, NumPy and torch (CPU, and every CUDA device when available) RNG states.

    Only types that `torch.load(..., weights_only=True)` accepts: the NumPy MT19937 key is stored as an
    int64 tensor inside a tuple.
    """
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state = {"python": random.getstate(),
             "numpy": (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Restore RNG states saved by `capture_rng_state` (as loaded from `rng_state.pt`).

    CUDA states are restored when present and CUDA is available (one per visible device, in order).

    Raises:
        CheckpointError: when a python/numpy/torch entry is missing or malformed.
    """
    try:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(cached)))
        torch.set_rng_state(state["torch"])
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"malformed rng state ({type(exc).__name__}: {exc})") from exc
    if "cuda" in state and torch.cuda.is_available():
        states = list(state["cuda"])[: torch.cuda.device_count()]
        torch.cuda.set_rng_state_all(states)


def resolve_train_type(train_type: str | None, objects: Mapping[str, Any],
                       trainer_state: Mapping[str, Any]) -> str | None:
    """The train type recorded in the checkpoint: the argument, else `trainer_state["train_type"]`, else
    "online_ppo" when the objects include a critic, else None."""
    if train_type is None:
        train_type = trainer_state.get("train_type")
    if train_type is None and objects.get("value_model") is not None:
        train_type = "online_ppo"
    return train_type


def check_objects(objects: Mapping[str, Any], train_type: str | None) -> None:
    """Refuse to publish state that could not be restored.

    Raises:
        CheckpointError: an unknown object key (it would be silently dropped), no policy/tokenizer, or a
            critic train type without `value_model` / `value_optimizer`.
    """
    unknown = sorted(set(objects) - set(KNOWN_OBJECTS))
    if unknown:
        raise CheckpointError(f"cannot checkpoint unknown object(s) {unknown}; known: {list(KNOWN_OBJECTS)}")
    for key in ("policy", "tokenizer"):
        if objects.get(key) is None:
            raise CheckpointError(f"checkpoint objects lack {key!r}")
    if train_type in CRITIC_TRAIN_TYPES:
        for name in CRITIC_FILES:
            if objects.get(name[:-3]) is None:
                raise CheckpointError(f"{train_type} checkpoint objects lack {name[:-3]!r} ({name})")


def _use_default_mode(path: Path) -> None:
    """Give `path` the permissions of a normally created file (0666 minus the umask): safetensors' `save_file`
    creates 0600 files, unlike every other file of the checkpoint (unreadable to a shared cluster group)."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def write_payload(directory: Path, objects: Mapping[str, Any], trainer_state: Mapping[str, Any], *,
                  train_type: str | None, on_written: Callable[[str], None] = lambda name: None) -> None:
    """Write rank 0's checkpoint files into `directory` (which must exist); see the module docstring.

    `on_written(name)` is called after each large file is complete (the publisher hashes and fsyncs it
    in the background while the next one is serialised).

    Raises:
        CheckpointError: from `check_objects`, or a trainer_state that is not JSON-serialisable.
        OSError: on write failures.
    """
    from astrai.models import hf_state_dict

    check_objects(objects, train_type)
    policy = objects["policy"]
    tensors = {k: v.detach().cpu().contiguous() for k, v in hf_state_dict(policy).items()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    _use_default_mode(directory / "model.safetensors")
    on_written("model.safetensors")
    _write_json(directory / "config.json", policy.config.to_hf_dict())
    objects["tokenizer"].save(directory)
    for key in STATE_DICT_OBJECTS:
        if objects.get(key) is not None:
            _torch_save(objects[key].state_dict(), directory / f"{key}.pt")
            on_written(f"{key}.pt")
    _torch_save(capture_rng_state(), directory / "rng_state.pt")
    state = dict(trainer_state, train_type=train_type)
    if objects.get("data_sampler") is not None:
        state["data_sampler"] = objects["data_sampler"].state_dict()
    try:
        _write_json(directory / "trainer_state.json", state)
    except TypeError as exc:
        raise CheckpointError(f"trainer_state is not JSON-serialisable: {exc}") from exc


def write_rank_payload(directory: Path, rank: int, objects: Mapping[str, Any],
                       rank_files: Mapping[str, Any] | None) -> list[str]:
    """Write the files of rank `rank` >= 1 (RNG, data sampler, `rank_files`) into `directory`.

    Args:
        rank_files: relative path -> content; `bytes` are written as they are, `str` as UTF-8 text,
            anything else with `torch.save` (load it back with `LoadedCheckpoint.load_pt`).

    Returns:
        the relative paths written.

    Raises:
        CheckpointError: a `rank_files` path that is unsafe or collides with a checkpoint file.
    """
    written = []
    if rank > 0:
        name = rank_file("rng_state", rank, ".pt")
        _torch_save(capture_rng_state(), directory / name)
        written.append(name)
        if objects.get("data_sampler") is not None:
            name = rank_file("data_sampler", rank, ".json")
            _write_json(directory / name, objects["data_sampler"].state_dict())
            written.append(name)
    for name, content in (rank_files or {}).items():
        path = safe_member(directory, name)
        if path.exists():
            raise CheckpointError(f"rank {rank}: rank file {name} collides with an existing checkpoint file")
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, (bytes, bytearray)):
            path.write_bytes(bytes(content))
        elif isinstance(content, str):
            path.write_text(content, encoding="utf-8")
        else:
            _torch_save(content, path)
        written.append(name)
    return written


def _torch_save(obj: Any, path: Path) -> None:
    torch.save(obj, str(path))


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
