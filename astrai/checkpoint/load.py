"""Loading a checkpoint directory: validation, then lazy access to each part.

Every `.pt` file is read with `torch.load(..., weights_only=True)`; the policy with safetensors. With a
manifest, only files the manifest lists are read, each checked for size (and sha256 when `verify`).
A legacy directory (no manifest) still loads, with a `CheckpointWarning`.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch

from astrai.checkpoint.layout import CheckpointWarning
from astrai.checkpoint.manifest import (CRITIC_FILES, POLICY_FILES, CheckpointError, NotACheckpointError,
                                        check_files, failed, read_manifest, safe_member)
from astrai.checkpoint.payload import rank_file

REQUIRED_FILES = POLICY_FILES + ("trainer_state.json",)


class LoadedCheckpoint:
    """A validated checkpoint directory; parts are read on demand.

    Attributes:
        path: the checkpoint directory.
        manifest: the parsed manifest, or None for a legacy directory.
        trainer_state: the parsed `trainer_state.json` (step, policy_version, consumed_samples,
            train_type, data_sampler, ...).
        config: the parsed `config.json` (Hugging Face Llama config keys).
        train_type: from the manifest (else trainer_state.json), or None when unrecorded.
    """

    def __init__(self, path: Path, manifest: dict | None):
        self.path = path
        self.manifest = manifest
        self.trainer_state: dict = self._read_json("trainer_state.json")
        self.config: dict = self._read_json("config.json")
        recorded = manifest.get("train_type") if manifest else None
        self.train_type: str | None = recorded or self.trainer_state.get("train_type")

    @property
    def legacy(self) -> bool:
        """True when the directory has no manifest."""
        return self.manifest is None

    @property
    def step(self) -> int | None:
        """The step from the manifest, else from trainer_state.json (None when neither records it)."""
        if self.manifest is not None:
            return self.manifest["step"]
        return self.trainer_state.get("step", self.trainer_state.get("global_step"))

    def has(self, name: str) -> bool:
        """Whether file `name` is part of the checkpoint (listed in the manifest; on disk when legacy)."""
        if self.manifest is not None:
            return name in self.manifest["files"]
        return (self.path / name).is_file()

    def file(self, name: str) -> Path:
        """The path of checkpoint file `name`.

        Raises:
            CheckpointError: "<dir>: <train type> checkpoint lacks <name>" when it is not part of the
                checkpoint or not on disk; or an unsafe path.
        """
        path = safe_member(self.path, name)
        if not self.has(name) or not path.is_file():
            kind = self.train_type or "astrai"
            raise CheckpointError(f"{self.path}: {kind} checkpoint lacks {name}")
        return path

    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        """The policy weights from `model.safetensors` (Hugging Face parameter names), on CPU."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        path = self.file("model.safetensors")
        try:
            return load_file(str(path))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{path}: unreadable safetensors file ({exc})") from None

    def load_pt(self, name: str) -> Any:
        """`torch.load(<file>, map_location="cpu", weights_only=True)`.

        Raises:
            CheckpointError: missing file, or content that `weights_only` refuses / cannot parse.
        """
        path = self.file(name)
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - unpickling errors come in many types
            raise CheckpointError(f"{path}: cannot load with weights_only=True ({exc})") from exc

    def optimizer_state(self) -> dict:
        """Policy optimizer `state_dict()` (optimizer.pt)."""
        return self.load_pt("optimizer.pt")

    def scheduler_state(self) -> dict:
        """Policy LR scheduler `state_dict()` (scheduler.pt)."""
        return self.load_pt("scheduler.pt")

    def value_model_state(self) -> dict:
        """Critic `state_dict()` (value_model.pt)."""
        return self.load_pt("value_model.pt")

    def value_optimizer_state(self) -> dict:
        """Critic optimizer `state_dict()` (value_optimizer.pt)."""
        return self.load_pt("value_optimizer.pt")

    def value_scheduler_state(self) -> dict:
        """Critic LR scheduler `state_dict()` (value_scheduler.pt)."""
        return self.load_pt("value_scheduler.pt")

    def rng_state(self, rank: int = 0) -> dict:
        """RNG states of `rank` (rng_state.pt for rank 0, rng_state_rank{R:05d}.pt otherwise); pass it to
        `restore_rng_state`."""
        return self.load_pt(rank_file("rng_state", rank, ".pt"))

    def data_sampler_state(self, rank: int = 0) -> dict:
        """The data sampler's state of `rank` (trainer_state.json "data_sampler" for rank 0,
        data_sampler_rank{R:05d}.json otherwise).

        Raises:
            CheckpointError: when the checkpoint holds no sampler state for that rank.
        """
        if rank == 0:
            if "data_sampler" not in self.trainer_state:
                raise CheckpointError(f"{self.path}: trainer_state.json has no data_sampler state")
            return self.trainer_state["data_sampler"]
        return self._read_json(rank_file("data_sampler", rank, ".json"))

    def _read_json(self, name: str) -> dict:
        path = self.file(name)
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{path}: invalid JSON ({exc})") from exc


def load_checkpoint(path: str | Path, *, verify: bool = False, require_critic: bool = False) -> LoadedCheckpoint:
    """Open and validate a checkpoint directory.

    Always: the manifest's format name/version and paths (nothing outside the directory, no escaping
    symlinks) and every listed file's presence and size. `verify=True` also checks every sha256.
    Without a manifest (legacy) the directory still loads, with a `CheckpointWarning`.

    Args:
        verify: check sha256 of every file (reads all bytes once).
        require_critic: fail unless `value_model.pt` and `value_optimizer.pt` are present (pass True when
            resuming online_ppo).

    Raises:
        NotACheckpointError: not a directory, or neither a manifest nor policy files.
        CheckpointError: an invalid/unsafe manifest, missing/truncated/corrupt files (named in the
            message), or a missing required file, e.g. "<dir>: online_ppo checkpoint lacks value_model.pt".
    """
    path = Path(path)
    if not path.is_dir():
        raise NotACheckpointError(f"{path}: not a checkpoint directory")
    manifest = read_manifest(path)
    if manifest is None:
        if not any((path / f).is_file() for f in POLICY_FILES):
            raise NotACheckpointError(f"{path}: no manifest.json and no policy files; not a checkpoint")
        warnings.warn(f"{path}: legacy checkpoint without manifest.json; loading it unverified",
                      CheckpointWarning, stacklevel=2)
    else:
        bad = failed(check_files(path, manifest, hashes=verify))
        if bad:
            raise CheckpointError(f"{path}: checkpoint failed verification: "
                                  + "; ".join(f"{s.name}: {s.status} ({s.detail})" for s in bad))
    for name in REQUIRED_FILES:
        if not ((path / name).is_file() and (manifest is None or name in manifest["files"])):
            raise CheckpointError(f"{path}: checkpoint lacks {name}")
    loaded = LoadedCheckpoint(path, manifest)
    if require_critic:
        for name in CRITIC_FILES:
            if not (loaded.has(name) and (path / name).is_file()):
                raise CheckpointError(f"{path}: {loaded.train_type or 'online_ppo'} checkpoint lacks {name}")
    return loaded
