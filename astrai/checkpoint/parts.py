"""A checkpoint is a store of named parts: each piece of training state that must survive a restart is a `Part`
(the idea of torch.distributed.checkpoint's `Stateful`: an object with `state_dict()` / `load_state_dict()`),
declared by whoever owns it (the learner, the trainer). This package knows how each KIND of part is written and
read, never which parts a train type has.

Kinds and their files (rank R > 0 of a per-rank part: `<name>_rank{R:05d}<suffix>`):
    hf_model       model.safetensors + config.json        an `AutoRegressiveLM`, loadable by `transformers`
    peft           adapter_model.safetensors +            LoRA adapters in PEFT's layout (`state_dict()` with PEFT's
                   adapter_config.json                    names, `adapter_config()`): transformers + peft load them
    hf_tokenizer   tokenizer.json, tokenizer_config.json  a `Tokenizer` (written for export; not restored)
    torch          <name>.pt                               `state_dict()` through `torch.save` (read weights_only)
    json           <name>.json                             a plain-JSON `state_dict()`
    yaml           <name>.yaml                             a YAML text (the resolved job config; not restored)
    dcp            <name>/.metadata, <name>/__R_*.distcp   a sharded `state_dict()` written and read by every rank
                                                           together with torch.distributed.checkpoint (which can
                                                           reshard it to another world size)

A per-rank part is written by every rank (its own file), a dcp part by every rank together (a collective: every
rank declares the same dcp parts in the same order); any other part by rank 0 alone. `GlobalRNGState` is the
Python / NumPy / torch (+ CUDA) RNG as a part.

Resuming on another world size: global parts load as usual and dcp parts are resharded by
torch.distributed.checkpoint. A per-rank part loads only if its object can say what a rank of the new world size
should hold, given every old rank's state: `resized_state(states, rank, world_size) -> state` (raising
`CheckpointError` with the reason when it cannot, e.g. a rollout was in progress). A per-rank part without that
method (DeepSpeed ZeRO optimizer partitions) makes the resume stop with a one-line error. `derived_seed` gives the
ranks that had no copy their own random streams.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch
from safetensors.torch import save_file

from astrai.checkpoint.manifest import GENERATION_CONFIG, HF_MODEL_FILES, PEFT_FILES, CheckpointError, part_files
from astrai.models import hf_state_dict

RESTORABLE_KINDS = ("hf_model", "torch", "json", "dcp", "peft")


@dataclass(frozen=True)
class Part:
    """One named piece of state in a checkpoint.

    Attributes:
        obj: the object: for `hf_model` an `AutoRegressiveLM`; `hf_tokenizer` a `Tokenizer` (anything with
            `save(dir)`); `torch` / `json` anything with `state_dict()` and `load_state_dict(state)`; `yaml` a str.
        kind: one of `KINDS` (see the module docstring).
        per_rank: every rank saves and restores its own copy (RNG, data position, in-flight rollout).
        required: resuming refuses a checkpoint without it (a part that is not restorable is never required).
        weights: it holds a model's weights (its `state_dict()` tensors; an `hf_model` part always does): checked
            finite before every publish (`safety.nonfinite_weights`) and measured for a first size estimate.
    """

    obj: Any
    kind: str = "torch"
    per_rank: bool = False
    required: bool = True
    weights: bool = False

    @property
    def holds_weights(self) -> bool:
        """Whether the part holds model weights (`weights`, or an `hf_model` part)."""
        return self.weights or self.kind == "hf_model"

    @property
    def restorable(self) -> bool:
        """Whether resuming loads this part back (`hf_tokenizer` and `yaml` are written for export only)."""
        return self.kind in RESTORABLE_KINDS


def check_parts(parts: Mapping[str, Part]) -> None:
    """Refuse to publish parts that could not be restored.

    Raises:
        CheckpointError: a part that is not a `Part` (an unknown object), of an unknown kind, a required part
            whose object is None, a per-rank part of a kind that cannot be per rank, or more than one `hf_model`
            part.
    """
    models = []
    for name, part in parts.items():
        if not isinstance(part, Part):
            raise CheckpointError(f"checkpoint part {name!r} is an unknown object: expected a checkpoint.Part, got "
                                  f"{type(part).__name__}")
        part_files(name, part.kind)
        if part.obj is None and part.required:
            raise CheckpointError(f"checkpoint part {name!r} is required but None")
        if part.per_rank and part.kind not in ("torch", "json"):
            raise CheckpointError(f"checkpoint part {name!r}: kind {part.kind!r} cannot be per rank")
        models += [name] if part.kind in ("hf_model", "peft") else []
    if len(models) > 1:
        raise CheckpointError(f"checkpoint parts {models}: at most one hf_model or peft part (it owns the model "
                              "files)")


def manifest_parts(parts: Mapping[str, Part]) -> dict[str, dict]:
    """The manifest's description of `parts`: name -> {kind, per_rank, required}."""
    return {name: {"kind": p.kind, "per_rank": p.per_rank, "required": p.required and p.restorable}
            for name, p in parts.items() if p.obj is not None}


def write_parts(directory: Path, parts: Mapping[str, Part], rank: int, *,
                on_written: Callable[[str], None] = lambda name: None) -> list[str]:
    """Write this rank's files of `parts` into `directory` (which must exist); returns the names written.

    Rank 0 writes every part (per-rank ones as its own copy); rank R > 0 its copies of per-rank parts and its shards
    of dcp parts.
    `on_written(name)` is called after each large file is complete (the publisher hashes and fsyncs it in the
    background while the next one is serialised).

    Raises:
        CheckpointError: from `check_parts`, or a state that is not JSON-serialisable.
        OSError: on write failures.
    """
    check_parts(parts)
    written: list[str] = []
    for name, part in parts.items():
        if part.obj is None or (rank > 0 and not part.per_rank and part.kind != "dcp"):
            continue
        names = _write_part(directory, name, part, rank)
        for file in names:
            on_written(file)
        written += names
    return written


def _write_part(directory: Path, name: str, part: Part, rank: int) -> list[str]:
    if part.kind == "hf_model":
        tensors = {k: v.detach().cpu().contiguous() for k, v in hf_state_dict(part.obj).items()}
        write_safetensors(tensors, directory / "model.safetensors")
        del tensors
        write_json(directory / "config.json", part.obj.config.to_hf_dict())
        write_json(directory / GENERATION_CONFIG, part.obj.config.generation_config_dict())
        return [*HF_MODEL_FILES, GENERATION_CONFIG]
    if part.kind == "peft":
        tensors = {k: v.detach().cpu().contiguous() for k, v in part.obj.state_dict().items()}
        write_safetensors(tensors, directory / PEFT_FILES[0])
        write_json(directory / PEFT_FILES[1], part.obj.adapter_config())
        return list(PEFT_FILES)
    if part.kind == "hf_tokenizer":  # saved apart first: other ranks write into `directory` meanwhile
        private = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=directory))
        part.obj.save(private)
        names = sorted(os.listdir(private))
        for file in names:
            os.replace(private / file, directory / file)
        private.rmdir()
        return names
    if part.kind == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.save(part.obj.state_dict(), checkpoint_id=str(directory / name))
        mine = [f"{name}/{p.name}" for p in sorted((directory / name).glob(f"__{rank}_*.distcp"))]
        return ([f"{name}/.metadata"] if rank == 0 else []) + mine
    (file,) = part_files(name, part.kind, rank)
    if part.kind == "torch":
        torch.save(part.obj.state_dict(), str(directory / file))
    elif part.kind == "json":
        try:
            write_json(directory / file, part.obj.state_dict())
        except TypeError as exc:
            raise CheckpointError(f"checkpoint part {name!r} is not JSON-serialisable: {exc}") from exc
    else:
        (directory / file).write_text(str(part.obj), encoding="utf-8")
    return [file]


def write_json(path: Path, obj: Any) -> None:
    """`obj` as indented, key-sorted JSON text (raises TypeError when it is not JSON-serialisable)."""
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_safetensors(tensors: Mapping[str, torch.Tensor], path: Path) -> None:
    """`tensors` (contiguous CPU tensors) as the safetensors file `path` (metadata `format: pt`, as transformers
    writes), with the permissions of a normally created file (0666 minus the umask): safetensors' `save_file`
    creates 0600 files, unlike every other file a checkpoint or an export holds (unreadable to a shared cluster
    group)."""
    save_file(dict(tensors), str(path), metadata={"format": "pt"})
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def derived_seed(generator_state: torch.Tensor, rank: int) -> int:
    """A 63-bit seed for `rank` derived from a saved generator state (uint8 tensor, any length): the first 8 bytes
    of SHA-256(state bytes || rank). Used when a run resumes on more ranks than wrote the checkpoint, so each new
    rank gets its own random stream, determined by the checkpoint, unlike any other rank's."""
    digest = hashlib.sha256(generator_state.cpu().numpy().tobytes() + b"/rank=" + str(rank).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class GlobalRNGState:
    """The process-wide RNGs (Python, NumPy, torch CPU and every CUDA device) as a checkpoint part object."""

    def state_dict(self) -> dict[str, Any]:
        """`capture_rng_state()`."""
        return capture_rng_state()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """`restore_rng_state(state)`; raises CheckpointError on a malformed state."""
        restore_rng_state(state)

    def resized_state(self, states: list[Mapping[str, Any]], rank: int, world_size: int) -> dict[str, Any]:
        """The RNG state of `rank` when a checkpoint written by `len(states)` ranks resumes on `world_size`: its own
        saved state when it had one, else every RNG seeded with `derived_seed(<rank 0's torch state>, rank)`. The
        current process's RNGs are left as they were."""
        if rank < len(states):
            return dict(states[rank])
        seed = derived_seed(states[0]["torch"], rank)
        current = capture_rng_state()
        try:
            random.seed(seed)
            np.random.seed(seed % 2**32)
            torch.manual_seed(seed)
            return capture_rng_state()
        finally:
            restore_rng_state(current)


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
