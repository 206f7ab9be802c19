"""Loading a checkpoint directory: validation, then reading and restoring its parts (`parts.Part`).

Every `.pt` file is read with `torch.load(..., weights_only=True)`; the policy with safetensors. With a
manifest, only files the manifest lists are read, each checked for size (and sha256 when `verify`).
A legacy directory (no manifest) still loads, with a `CheckpointWarning`.

Checkpoints written before parts were recorded (a manifest without "parts") still load: their rank-0 data
sampler state sits inside trainer_state.json, and the parts they need to resume are implied by their train type
(`astrai.train_types.legacy_required_files`).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Mapping

import torch

from astrai.checkpoint.layout import CheckpointWarning
from astrai.train_types import legacy_required_files
from astrai.checkpoint.manifest import (
    POLICY_FILES,
    CheckpointError,
    NotACheckpointError,
    check_files,
    declared_required_files,
    failed,
    part_files,
    read_manifest,
    safe_member,
)
from astrai.checkpoint.parts import Part
from astrai.models import state_mismatch


class LoadedCheckpoint:
    """A validated checkpoint directory; parts are read on demand.

    Attributes:
        path: the checkpoint directory.
        manifest: the parsed manifest, or None for a legacy directory.
        train_type: from the manifest (else trainer_state.json), or None when unrecorded.
    """

    def __init__(self, path: Path, manifest: dict | None):
        self.path = path
        self.manifest = manifest
        recorded = manifest.get("train_type") if manifest else None
        if recorded is None and self.has("trainer_state.json"):
            recorded = self.read_json("trainer_state.json").get("train_type")
        self.train_type: str | None = recorded

    @property
    def legacy(self) -> bool:
        """True when the directory has no manifest."""
        return self.manifest is None

    @property
    def step(self) -> int | None:
        """The step from the manifest, else from trainer_state.json (None when neither records it)."""
        if self.manifest is not None:
            return self.manifest["step"]
        state = self.read_json("trainer_state.json") if self.has("trainer_state.json") else {}
        return state.get("step", state.get("global_step"))

    @property
    def world_size(self) -> int:
        """The number of ranks that wrote the checkpoint (1 for a legacy directory)."""
        return int(self.manifest.get("world_size", 1)) if self.manifest is not None else 1

    @property
    def parts(self) -> dict[str, dict] | None:
        """The recorded parts (name -> {kind, per_rank, required}), or None for older checkpoints."""
        return self.manifest.get("parts") if self.manifest is not None else None

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
            raise CheckpointError(f"{self.path}: {self.train_type or 'astrai'} checkpoint lacks {name}")
        return path

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

    def read_json(self, name: str) -> Any:
        """The parsed JSON file `name`. Raises CheckpointError when missing or invalid."""
        path = self.file(name)
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{path}: invalid JSON ({exc})") from exc

    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        """The `hf_model` part's weights from `model.safetensors` (Hugging Face parameter names), on CPU."""
        return self.safetensors_state("model.safetensors")

    def safetensors_state(self, file: str) -> dict[str, torch.Tensor]:
        """The tensors of the checkpoint's safetensors file `file`, on CPU (CheckpointError when unreadable)."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        path = self.file(file)
        try:
            return load_file(str(path))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{path}: unreadable safetensors file ({exc})") from None

    def part_state(self, name: str, kind: str, rank: int = 0) -> Any:
        """The saved state of part `name` of `kind` for `rank` (what its `load_state_dict` takes).

        Raises:
            CheckpointError: a missing or unreadable file (named), or a kind that is not restorable.
        """
        if kind == "hf_model":
            return self.policy_state_dict()
        if kind == "peft":
            return self.safetensors_state("adapter_model.safetensors")
        (file,) = part_files(name, kind, rank)
        if kind == "torch":
            return self.load_pt(file)
        if kind != "json":
            raise CheckpointError(f"{self.path}: part {name!r} of kind {kind!r} is not restorable")
        if rank == 0 and self.parts is None and not self.has(file) and self.has("trainer_state.json"):
            legacy = self.read_json("trainer_state.json")  # older layout: rank 0's sampler inside the counters
            if name in legacy:
                return legacy[name]
        return self.read_json(file)

    def missing_files(self, parts: Mapping[str, Part], rank: int = 0) -> list[str]:
        """Files of the required, restorable `parts` (this rank's copies of per-rank ones) that the checkpoint
        lacks."""
        wanted = [f for name, p in parts.items() if p.required and p.restorable and p.obj is not None
                  for f in part_files(name, p.kind, rank if p.per_rank else 0)]
        return [f for f in wanted if not (self.has(f) or self._legacy_json(f))]

    def _legacy_json(self, file: str) -> bool:
        """Whether `file` (`<name>.json`) is stored inside trainer_state.json (checkpoints before parts)."""
        if self.parts is not None or not file.endswith(".json") or not self.has("trainer_state.json"):
            return False
        return file[: -len(".json")] in self.read_json("trainer_state.json")

    def declared_required_files(self) -> list[str]:
        """The files the checkpoint itself says it needs to resume (`manifest.declared_required_files`)."""
        if self.manifest is None:
            return list(legacy_required_files(self.train_type))
        return declared_required_files(dict(self.manifest, train_type=self.train_type))

    def restore(self, parts: Mapping[str, Part], rank: int = 0, world_size: int | None = None) -> None:
        """Load every restorable part of `parts` (this rank's copy of per-rank ones), in order.

        On a world size other than the checkpoint's (`world_size` given and != `self.world_size`), each per-rank
        part's state for this rank comes from its object's `resized_state(<every old rank's state>, rank,
        world_size)`; dcp parts are resharded by torch.distributed.checkpoint; global parts load as usual. Every
        per-rank state is read and resized before anything is loaded.

        Raises:
            CheckpointError: naming the first missing file of a required part (nothing is loaded then), a file
                that cannot be read, or, on another world size, a per-rank part that cannot be resharded (nothing
                is loaded then). A part that is not required and not in the checkpoint is skipped.
        """
        resizing = world_size is not None and world_size != self.world_size
        resized = self._resized_states(parts, rank, world_size) if resizing else {}
        if not resizing:
            self._refuse_missing(self.missing_files(parts, rank))
        for name, part in parts.items():
            if not part.restorable or part.obj is None:
                continue
            if name in resized:
                part.obj.load_state_dict(resized[name])
                continue
            own = rank if part.per_rank and not resizing else 0  # whose copy this rank reads
            if not self._present(name, part, own):
                continue
            if part.kind == "dcp":  # every rank together, into a state of the current layout (resharded)
                import torch.distributed.checkpoint as dcp

                state = part.obj.state_dict()
                dcp.load(state, checkpoint_id=str(self.path / name))
                part.obj.load_state_dict(state)
                continue
            state = self.part_state(name, part.kind, own)
            if isinstance(part.obj, torch.nn.Module):
                self._refuse_misfit(name, part.obj, state)
            part.obj.load_state_dict(state)

    def _refuse_misfit(self, name: str, module: torch.nn.Module, state: Mapping[str, Any]) -> None:
        """Raise CheckpointError when `state` does not have exactly `module`'s parameter names and shapes (a
        checkpoint written with other model settings, e.g. another `ppo.critic_layers`)."""
        own = module.state_dict(keep_vars=True)
        stored = {id(own[k]) for k in own.keys() & state.keys()}  # a tied weight is stored under one of its names
        expected = {k: v.shape for k, v in own.items() if k in state or id(v) not in stored}
        missing, unexpected, resized = state_mismatch(expected, state)
        for what, keys in (("lacks", missing), ("has extra", unexpected), ("has other shapes for", resized)):
            if keys:
                raise CheckpointError(f"{self.path}: part {name!r} does not fit the model this config builds: it "
                                      f"{what} {len(keys)} tensor(s), e.g. {keys[0]!r}; was it written with other "
                                      f"model settings?")

    def _refuse_missing(self, missing: list[str]) -> None:
        """Raise CheckpointError naming the first of `missing` (files of required parts), if any."""
        if missing:
            raise CheckpointError(f"{self.path}: {self.train_type or 'astrai'} checkpoint lacks {missing[0]}")

    def _present(self, name: str, part: Part, rank: int) -> bool:
        """Whether to load `part`: a required one always (a missing file then raises), another when its files are
        in the checkpoint."""
        return part.required or all(self.has(f) for f in part_files(name, part.kind, rank))

    def _resized_states(self, parts: Mapping[str, Part], rank: int, world_size: int) -> dict[str, Any]:
        """This rank's state of every per-rank part when resuming on `world_size` ranks (see `restore`); global
        parts' files are checked for presence.

        Raises:
            CheckpointError: a missing required file, or a per-rank part that cannot be resharded.
        """
        old = self.world_size
        self._refuse_missing(self.missing_files({n: p for n, p in parts.items() if not p.per_rank}))
        states: dict[str, Any] = {}
        for name, part in parts.items():
            if not (part.per_rank and part.restorable and part.obj is not None and self._present(name, part, 0)):
                continue
            resize = getattr(part.obj, "resized_state", None)
            if resize is None:
                what = getattr(part.obj, "checkpoint_description", f"per-rank part {name!r}")
                raise CheckpointError(
                    f"{self.path}: written by {old} ranks, this job has {world_size}: {what} cannot be resharded; "
                    f"resume with {old} processes, or start a new run from its weights (--model.path {self.path})")
            saved = [self.part_state(name, part.kind, r) for r in range(old)]
            states[name] = resize(saved, rank, world_size)
        return states


class VerificationError(CheckpointError):
    """A checkpoint whose files differ from its manifest (missing, resized or, with sha256 checked, changed)."""


class ModelFilesError(CheckpointError, ValueError):
    """A checkpoint loaded as a model whose model files differ from its manifest (a `ValueError` too, as the model
    loaders' other one-line refusals)."""


MODEL_KINDS = ("hf_model", "peft", "hf_tokenizer")
"""The part kinds a model loader reads; the other parts are training state (optimizers, counters, RNG, the job's
config.yaml, sharded `dcp` directories)."""


def model_files(manifest: dict) -> dict[str, dict]:
    """The manifest's file entries a model loader reads: all but the files of its training-state parts (every
    rank's; a `dcp` part's whole directory). A manifest that records no parts (older): all but `*.pt`."""
    files, parts = manifest["files"], manifest.get("parts")
    if parts is None:
        return {name: entry for name, entry in files.items() if not name.endswith(".pt")}
    world = manifest.get("world_size", 1)
    state, directories = set(), []
    for name, part in parts.items():
        if part["kind"] in MODEL_KINDS:
            continue
        if part["kind"] == "dcp":
            directories.append(f"{name}/")
            continue
        for rank in (range(world) if part["per_rank"] else (0,)):
            state.update(part_files(name, part["kind"], rank))
    return {name: entry for name, entry in files.items()
            if name not in state and not name.startswith(tuple(directories))}


def check_model_files(path: str | Path, *, hashes: bool = True) -> None:
    """Before a model loader (`astrai.models.load_pretrained`) reads `path` (`--model.path`, a teacher,
    `python -m astrai.evaluate --model`, `astrai.serve --checkpoint`, `astrai.checkpoint export`): when it is a
    published checkpoint (a directory holding `manifest.json`), every file a model loader reads (`model_files`:
    weights, model config, generation config, adapters, tokenizer; not the training state) present with its size
    and, with `hashes`, its sha256. Anything else (a Hugging Face model directory, a .gguf file, an alias or Hub id)
    passes unchecked; a checkpoint marked bad is checked like any other (loading one by its path stays possible).

    Raises:
        ModelFilesError: one line naming the changed, truncated or missing files, or the unreadable manifest.
    """
    path = Path(path).expanduser()
    if not (path / "manifest.json").is_file():
        return
    try:
        manifest = read_manifest(path)
    except CheckpointError as err:
        raise ModelFilesError(str(err)) from None
    bad = failed(check_files(path, dict(manifest, files=model_files(manifest)), hashes=hashes))
    if bad:
        raise ModelFilesError(f"{path}: checkpoint failed verification: "
                              + "; ".join(f"{s.name}: {s.status} ({s.detail})" for s in bad)
                              + f"; `python -m astrai.checkpoint verify {path}` lists every file")


def load_model(path: str | Path, *, hashes: bool = True, **kwargs):
    """`astrai.models.load_pretrained(path, **kwargs)` (the model and its tokenizer) after `check_model_files(path,
    hashes=hashes)`: the one way to load something that may be a published checkpoint as a model.

    Raises:
        ModelFilesError: as `check_model_files`; otherwise what `load_pretrained` raises.
    """
    from astrai.models import load_pretrained  # looked up at the call, where a test may stand in for it

    check_model_files(path, hashes=hashes)
    return load_pretrained(path, **kwargs)


def load_checkpoint(path: str | Path, *, verify: bool = False, require_complete: bool = False) -> LoadedCheckpoint:
    """Open and validate a checkpoint directory.

    Always: the manifest's format name/version and paths (nothing outside the directory, no escaping
    symlinks) and every listed file's presence and size. `verify=True` also checks every sha256.
    Without a manifest (legacy) the directory still loads, with a `CheckpointWarning`.

    Args:
        verify: check sha256 of every file (reads all bytes once).
        require_complete: fail unless every file of the parts the checkpoint declares required is present
            (`LoadedCheckpoint.declared_required_files`; for online_ppo these include the critic extras).

    Raises:
        NotACheckpointError: not a directory, or neither a manifest nor policy files.
        CheckpointError: an invalid/unsafe manifest, missing/truncated/corrupt files (named in the
            message), or, with `require_complete`, a missing required file, e.g. "<dir>: online_ppo checkpoint
            lacks value_model.pt".
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
            raise VerificationError(f"{path}: checkpoint failed verification: "
                                  + "; ".join(f"{s.name}: {s.status} ({s.detail})" for s in bad))
    loaded = LoadedCheckpoint(path, manifest)
    if require_complete:
        for name in loaded.declared_required_files():
            if not (loaded.has(name) and (path / name).is_file()) and not loaded._legacy_json(name):
                raise CheckpointError(f"{path}: {loaded.train_type or 'astrai'} checkpoint lacks {name}")
    return loaded
