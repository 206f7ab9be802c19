"""Where checkpoints live and housekeeping: naming, finding the latest complete one, start-up recovery
and `keep_last` retention.

    <output_dir>/checkpoints/step-XXXXXXXX/                    published, complete, immutable
    <output_dir>/checkpoints/.step-XXXXXXXX.staging-<id>/      being written (deleted by `recover`)
    <output_dir>/checkpoints/.step-XXXXXXXX.retired-<id>/      old payload being replaced on republish
    <output_dir>/checkpoints/.step-XXXXXXXX.deleting-<id>/     being removed by retention
"""

from __future__ import annotations

import json
import re
import uuid
import warnings
from pathlib import Path

from astrai.checkpoint.fsutil import fsync_dir, remove_tree, write_atomic
from astrai.checkpoint.manifest import (MANIFEST_NAME, POLICY_FILES, CheckpointError, check_files, failed,
                                        read_manifest)

CHECKPOINTS_DIRNAME = "checkpoints"
_STEP_RE = re.compile(r"^step-(\d{8,})$")
_HIDDEN_RE = re.compile(r"^\.(step-\d{8,})\.(staging|retired|deleting)-([0-9a-f]+)$")


class CheckpointWarning(UserWarning):
    """A checkpoint directory was skipped, is legacy (no manifest), or housekeeping could not finish."""


def step_dirname(step: int) -> str:
    """`step-XXXXXXXX` (at least 8 digits, zero-padded).

    Raises:
        ValueError: for a negative step.
    """
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    return f"step-{step:08d}"


def parse_step(name: str) -> int | None:
    """The step of a published checkpoint directory name (`step-00000100` -> 100), None otherwise."""
    match = _STEP_RE.match(name)
    return int(match.group(1)) if match else None


def checkpoints_root(output_dir: str | Path) -> Path:
    """`<output_dir>/checkpoints`."""
    return Path(output_dir) / CHECKPOINTS_DIRNAME


def hidden_name(step_name: str, kind: str) -> str:
    """A fresh hidden sibling name `.step-N.<kind>-<id>` (kind: staging, retired or deleting)."""
    return f".{step_name}.{kind}-{uuid.uuid4().hex[:12]}"


def run_id_of(path: Path) -> str | None:
    """The run id recorded in a checkpoint's manifest; None for a legacy checkpoint, one written before run ids
    existed, or an unreadable manifest (such checkpoints belong to no current run)."""
    try:
        manifest = read_manifest(path)
    except CheckpointError:
        return None
    value = manifest.get("run_id") if manifest else None
    return value if isinstance(value, str) and value else None


def _of_run(path: Path, run_id: str | None) -> bool:
    """Whether `path` passes the run filter (`run_id` None: every checkpoint does)."""
    return run_id is None or run_id_of(path) == run_id


def is_complete(path: Path, *, hashes: bool = False, step: int | None = None) -> tuple[bool, str]:
    """Whether `path` is a complete checkpoint: a valid manifest whose files are all present with the
    listed sizes (and sha256 when `hashes`), and whose step equals `step` when given.

    Returns:
        (ok, reason); reason is "legacy" for a directory without a manifest.
    """
    try:
        manifest = read_manifest(path)
    except CheckpointError as exc:
        return False, str(exc)
    if manifest is None:
        return False, "legacy"
    if manifest.get("bad"):
        return False, f"marked bad ({manifest['bad']})"
    if step is not None and manifest["step"] != step:
        return False, f"manifest step {manifest['step']} does not match the directory name"
    bad = failed(check_files(path, manifest, hashes=hashes))
    if bad:
        return False, "; ".join(f"{s.name}: {s.status} ({s.detail})" for s in bad)
    return True, ""


def mark_bad(path: Path, reason: str | None) -> None:
    """Mark the published checkpoint at `path` bad (its manifest records `"bad": reason`, rewritten atomically):
    `list_checkpoints`, `find_latest_checkpoint` (so `--checkpoint.resume auto`) and retention then skip it; its files
    stay for inspection, and resuming from its path explicitly is still possible. `reason` None takes a mark back.

    Raises:
        CheckpointError: `path` has no valid manifest.
    """
    manifest = read_manifest(path)
    if manifest is None:
        raise CheckpointError(f"{path}: no manifest.json to mark (legacy checkpoints cannot be marked)")
    if reason is None:
        manifest.pop("bad", None)
    else:
        manifest["bad"] = str(reason) or "marked bad"
    write_atomic(path / MANIFEST_NAME, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    fsync_dir(path)


def list_checkpoints(output_dir: str | Path, *, hashes: bool = False,
                     run_id: str | None = None) -> list[tuple[int, Path]]:
    """Complete published checkpoints under `<output_dir>/checkpoints`, as (step, path) sorted by step; with
    `run_id`, only those whose manifest records that run id.

    Hidden (staging/retired/deleting) and incomplete directories are never listed.
    """
    root = checkpoints_root(output_dir)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        step = parse_step(path.name)
        if step is not None and path.is_dir() and is_complete(path, hashes=hashes, step=step)[0] \
                and _of_run(path, run_id):
            found.append((step, path))
    return sorted(found)


def find_latest_checkpoint(output_dir: str | Path, *, hashes: bool = False, allow_legacy: bool = False,
                           run_id: str | None = None) -> Path | None:
    """The newest complete checkpoint under `<output_dir>/checkpoints`, or None; with `run_id`, the newest of
    that run (checkpoints of other runs, and legacy ones, are not considered).

    Never returns a staging, retired or deleting directory, nor a `step-*` directory whose manifest is
    missing, invalid, or disagrees with the files on disk (sizes; sha256 too when `hashes`). Skipped
    directories are reported with a `CheckpointWarning`. Legacy directories (no manifest, but
    `model.safetensors` + `config.json`) are only returned when `allow_legacy`.
    """
    root = checkpoints_root(output_dir)
    if not root.is_dir():
        return None
    candidates = sorted(((parse_step(p.name), p) for p in root.iterdir()
                         if parse_step(p.name) is not None and p.is_dir() and _of_run(p, run_id)), reverse=True)
    for step, path in candidates:
        ok, reason = is_complete(path, hashes=hashes, step=step)
        if ok:
            return path
        if reason == "legacy" and allow_legacy and all((path / f).is_file() for f in POLICY_FILES):
            warnings.warn(f"{path}: legacy checkpoint without {'manifest.json'}; its files cannot be "
                          f"verified", CheckpointWarning, stacklevel=2)
            return path
        if reason == "legacy":
            reason = ("no manifest.json, so its files cannot be checked; resume it by its path "
                      "(--checkpoint.resume DIR) if it is whole")
        warnings.warn(f"skipping {path}: {reason}", CheckpointWarning, stacklevel=2)
    return None


def recover(output_dir: str | Path) -> list[str]:
    """Clean up after a crash; call once at start-up (rank 0, before other ranks publish).

    Stale staging and deleting directories are deleted. A retired directory whose replacement `step-N`
    is missing is renamed back to `step-N` (the newest complete or legacy one when there are several); one
    whose replacement exists is deleted. Unrelated files are left alone.

    Returns:
        one line per action taken, e.g. "deleted .step-00000002.staging-ab12".

    Raises:
        OSError: when a rename or deletion fails.
    """
    root = checkpoints_root(output_dir)
    if not root.is_dir():
        return []
    actions: list[str] = []
    retired: dict[str, list[Path]] = {}
    for path in sorted(root.iterdir()):
        match = _HIDDEN_RE.match(path.name)
        if match is None:
            continue
        if match.group(2) == "retired":
            retired.setdefault(match.group(1), []).append(path)
        else:
            remove_tree(path)
            actions.append(f"deleted {path.name}")
    for step_name, paths in sorted(retired.items()):
        final = root / step_name
        if not final.exists():
            restorable = [p for p in paths if _restorable(p, parse_step(step_name))]
            if restorable:
                newest = max(restorable, key=_written_ns)
                newest.rename(final)
                fsync_dir(root)
                actions.append(f"restored {newest.name} -> {step_name}")
                paths = [p for p in paths if p != newest]
        for path in paths:
            remove_tree(path)
            actions.append(f"deleted {path.name}")
    if actions:
        fsync_dir(root)
    return actions


def _restorable(path: Path, step: int | None) -> bool:
    """A retired directory can go back: complete, or a legacy one (it replaced nothing verifiable)."""
    ok, reason = is_complete(path, step=step)
    return ok or (reason == "legacy" and all((path / f).is_file() for f in POLICY_FILES))


def _written_ns(path: Path) -> int:
    """When a checkpoint directory was finished: its manifest's mtime (the directory's when legacy)."""
    manifest = path / "manifest.json"
    return (manifest if manifest.is_file() else path).stat().st_mtime_ns


def apply_retention(output_dir: str | Path, keep_last: int, *, protect: Path,
                    run_id: str | None = None) -> list[Path]:
    """Delete the oldest complete checkpoints so that `keep_last` remain, always keeping `protect` (the
    one just published) and otherwise the newest by step; with `run_id`, only that run's checkpoints count and
    are deleted (another run's are left alone). Each victim is first renamed to a hidden `.deleting-` sibling
    so a crash never leaves a partly deleted `step-*` directory visible.

    Returns:
        the published paths that were removed.

    Raises:
        ValueError: keep_last < 1.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    root = checkpoints_root(output_dir)
    others = [path for _, path in list_checkpoints(output_dir, run_id=run_id)
              if path.resolve() != protect.resolve()]
    victims = others[: max(0, len(others) - (keep_last - 1))]
    for path in victims:
        hidden = root / hidden_name(path.name, "deleting")
        path.rename(hidden)
        fsync_dir(root)
        remove_tree(hidden)
    return victims
