"""What is checked before a checkpoint is published, and how a full disk is told: free space against the size the
checkpoint needs, finite weights, and the recognition of "no space left" however a writer reports it.

A writer that runs out of space does not always raise `OSError(ENOSPC)`: safetensors (Rust) raises its own error
naming "No space left on device (os error 28)", and `torch.save` only `RuntimeError: [enforce fail at
inline_container.cc:672] . unexpected pos 576 vs 534` (its C++ writer, measured on a full tmpfs). `out_of_space`
recognises the first two (and a quota, EDQUOT) by their errno or text, and any failure when the rest of the
checkpoint would not fit in what is left free, so the publisher turns each into one `CheckpointSpaceError` line.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Mapping, Optional

import torch

from astrai.checkpoint.manifest import CheckpointError, read_manifest

_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_SPACE_TEXTS = ("no space left on device", "os error 28", "disk quota exceeded", "os error 122")
ESTIMATE_FACTOR = 3
"""A first checkpoint (nothing to measure yet) is estimated at this many times its weights' bytes: the weights and
the two AdamW moments per trained model."""


class CheckpointSpaceError(CheckpointError):
    """The checkpoint directory's filesystem has no room for the checkpoint; the message is one line."""


class NonFiniteWeightsError(CheckpointError):
    """Weights about to be published hold NaN or infinite values (never published); the message is one line."""


AGREED_ERRORS = {cls.__name__: cls for cls in (CheckpointSpaceError, NonFiniteWeightsError)}
"""The publisher's refusals by name, raised with their own class on every rank (`publish._agree`)."""


def mount_point(path: Path) -> Path:
    """The mount point of the filesystem holding `path` (or of its nearest existing ancestor)."""
    place = Path(os.path.abspath(path))
    while not place.exists():
        place = place.parent
    while not os.path.ismount(place):
        place = place.parent
    return place


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on the filesystem of `path` (statvfs f_bavail * f_frsize)."""
    place = Path(os.path.abspath(path))
    while not place.exists():
        place = place.parent
    stat = os.statvfs(place)
    return stat.f_bavail * stat.f_frsize


def checkpoint_bytes(path: Path) -> Optional[int]:
    """The bytes of a published checkpoint as its manifest lists them, None when it has no readable manifest."""
    try:
        manifest = read_manifest(path)
    except CheckpointError:
        return None
    if not manifest:
        return None
    return sum(int(entry.get("bytes", 0)) for entry in manifest["files"].values())


def weight_tensors(part) -> dict[str, torch.Tensor]:
    """The tensors of a weights part (`Part.weights`): the model's state dict (empty where a sharded engine gathered
    the full state on another rank)."""
    obj = part.obj
    return {k: v for k, v in obj.state_dict().items() if isinstance(v, torch.Tensor)}


def estimate_bytes(parts: Mapping) -> int:
    """An estimate of a checkpoint's size before any was written: `ESTIMATE_FACTOR` times its weights' bytes."""
    total = 0
    for part in parts.values():
        if part.holds_weights and part.obj is not None:
            total += sum(t.numel() * t.element_size() for t in weight_tensors(part).values())
    return ESTIMATE_FACTOR * total


def nonfinite_weights(parts: Mapping) -> list[str]:
    """"<part>: <n> of <m> tensors (first: <name>)" for each weights part holding a NaN or an infinity; empty when
    every weight is finite (one reduction per tensor, read once)."""
    found = []
    for name, part in parts.items():
        if not part.holds_weights or part.obj is None:
            continue
        tensors = {k: v for k, v in weight_tensors(part).items() if v.is_floating_point()}
        if not tensors:
            continue
        finite = torch.stack([torch.isfinite(v).all() for v in tensors.values()]).cpu().tolist()
        bad = [k for k, ok in zip(tensors, finite) if not ok]
        if bad:
            found.append(f"{name}: {len(bad)} of {len(tensors)} tensors (first: {bad[0]})")
    return found


def out_of_space(exc: BaseException, *, free: Optional[int] = None, missing: int = 0) -> bool:
    """Whether `exc` (or an exception it was raised from) says the disk or the quota is full, or, given `free` (bytes
    free on the filesystem when the writer failed) and `missing` (bytes of the checkpoint not yet written), whether
    the rest would not have fit (`free < missing`): what `torch.save`'s "unexpected pos" means on a full disk."""
    if free is not None and free < missing:
        return True
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _SPACE_ERRNOS:
            return True
        text = str(exc).lower()
        if any(needle in text for needle in _SPACE_TEXTS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _size(n: float) -> str:
    """Bytes as "X.X GB" (or MB below a tenth of a GB)."""
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def space_error(root: Path, needed: int, free: int, last_good: Optional[Path], *,
                during: bool) -> CheckpointSpaceError:
    """The one-line error: "no space left on DEVICE: the checkpoint needs ~X GB, Y GB free; the last good
    checkpoint is step-N" (`during`: the writer ran out of space, `free` counted without its partial files; else
    the check before writing found `free` too little)."""
    device = mount_point(root)
    when = "while writing a checkpoint into" if during else "for a checkpoint in"
    last = f"the last good checkpoint is {last_good.name}" if last_good is not None else "no checkpoint was published"
    return CheckpointSpaceError(f"no space left on {device} {when} {root}: the checkpoint needs ~{_size(needed)}, "
                                f"{_size(free)} free; {last} (nothing partial is visible); free space "
                                "or choose another --train.output_dir, then resume with --checkpoint.resume auto")
