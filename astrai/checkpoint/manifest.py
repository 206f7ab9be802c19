"""The checkpoint manifest (`manifest.json`): format constants, validation and per-file checks.

A manifest is a JSON object::

    {"format": "astrai-checkpoint", "format_version": 1, "step": 100, "policy_version": 100,
     "world_size": 1, "train_type": "online_ppo", "publish_id": "3f2a...",
     "parts": {"policy": {"kind": "hf_model", "per_rank": false, "required": true}, ...},
     "files": {"model.safetensors": {"sha256": "<64 hex>", "bytes": 123}, ...}}

`files` lists every file of the directory except `manifest.json` itself, by POSIX path relative to the
checkpoint directory. `parts` (absent in checkpoints written before parts were recorded; readers ignore fields
they do not know, so adding it kept format version 1) names the stored parts (`parts.py`). A path that is
absolute, contains `..`, `.` or empty components, a backslash, or that resolves (through symlinks) outside the
directory is rejected.
"""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from astrai.checkpoint.fsutil import fsync_dir, fsync_file, sha256_file
from astrai.train_types import legacy_required_files

FORMAT_NAME = "astrai-checkpoint"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
POLICY_FILES = ("model.safetensors", "config.json")  # make a directory without a manifest a (legacy) checkpoint
KINDS = ("hf_model", "hf_tokenizer", "torch", "json", "yaml", "dcp", "peft")  # kinds of parts, see parts.py
HF_MODEL_FILES = POLICY_FILES
GENERATION_CONFIG = "generation_config.json"
"""Written beside a model's config.json (its stop and pad ids, for transformers' and vLLM's generate); not required:
checkpoints written before it have none."""
PEFT_FILES = ("adapter_model.safetensors", "adapter_config.json")
"""The files of a "peft" part (PEFT's adapter layout)."""
_SUFFIX = {"torch": ".pt", "json": ".json", "yaml": ".yaml"}
HASH_THREADS = min(8, os.cpu_count() or 1)
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")


def rank_file(stem: str, rank: int, suffix: str) -> str:
    """Name of a per-rank file: rank 0 -> `<stem><suffix>`, rank R -> `<stem>_rank{R:05d}<suffix>`."""
    return f"{stem}{suffix}" if rank == 0 else f"{stem}_rank{rank:05d}{suffix}"


def part_files(name: str, kind: str, rank: int = 0) -> tuple[str, ...]:
    """The files that hold part `name` of `kind` for `rank` (() for `hf_tokenizer`, whose files the tokenizer
    chooses; for `dcp`, the metadata file that rank 0 writes, which names every rank's shard files).

    Raises:
        CheckpointError: for an unknown kind.
    """
    if kind == "hf_model":
        return HF_MODEL_FILES
    if kind == "peft":
        return PEFT_FILES
    if kind == "hf_tokenizer":
        return ()
    if kind == "dcp":  # the shard files are the writer's choice; rank 0's metadata names them
        return (f"{name}/.metadata",) if rank == 0 else ()
    if kind not in _SUFFIX:
        raise CheckpointError(f"part {name!r}: unknown kind {kind!r}; known: {list(KINDS)}")
    return (rank_file(name, rank, _SUFFIX[kind]),)


def declared_required_files(manifest: dict) -> list[str]:
    """The files a checkpoint says it needs to resume: every rank's files of the parts its manifest records as
    required (when it records no parts, the files its train type's record names:
    `astrai.train_types.legacy_required_files`)."""
    parts = manifest.get("parts")
    if parts is None:
        return list(legacy_required_files(manifest.get("train_type")))
    world = manifest.get("world_size", 1)
    return [f for name, p in parts.items() if p["required"]
            for rank in (range(world) if p["per_rank"] else (0,)) for f in part_files(name, p["kind"], rank)]


class CheckpointError(Exception):
    """A checkpoint is missing, incomplete, corrupt, unsafe, or could not be published."""


class NotACheckpointError(CheckpointError):
    """The directory is not an astrai checkpoint (no manifest and no policy files, or a foreign manifest)."""


@dataclass(frozen=True)
class FileStatus:
    """Result of checking one file.

    Attributes:
        name: path relative to the checkpoint directory.
        status: "OK", "MISMATCH" (size or sha256 differs), "MISSING", "UNSAFE" (path escapes the
            directory), "EXTRA" (on disk, not in the manifest) or "UNVERIFIED" (legacy, no manifest);
            only MISMATCH, MISSING and UNSAFE are failures.
        detail: human-readable reason ("" for OK).
    """

    name: str
    status: str
    detail: str = ""

    @property
    def failed(self) -> bool:
        """True for MISMATCH, MISSING and UNSAFE."""
        return self.status in ("MISMATCH", "MISSING", "UNSAFE")


def safe_member(directory: Path, name: Any) -> Path:
    """The path of manifest entry `name` inside `directory`, after checking it cannot escape it.

    Raises:
        CheckpointError: for a non-string, absolute, `..`/`.`/empty-component or backslash path, or one
            that resolves (following symlinks) outside `directory`.
    """
    if not isinstance(name, str) or not name or "\\" in name or "\x00" in name:
        raise CheckpointError(f"{directory}: manifest names an invalid path {name!r}")
    parts = name.split("/")
    if name.startswith("/") or any(p in ("", ".", "..") for p in parts) or os.path.isabs(name):
        raise CheckpointError(f"{directory}: manifest path {name!r} is outside the checkpoint directory")
    path = directory.joinpath(*parts)
    root = directory.resolve()
    resolved = path.resolve()
    if resolved != root and root not in resolved.parents:
        raise CheckpointError(f"{directory}: {name} resolves outside the checkpoint directory "
                              f"(symlink to {resolved})")
    return path


def read_manifest(directory: Path) -> dict | None:
    """Parse and structurally validate `directory/manifest.json`; None when there is no manifest (legacy).

    Raises:
        NotACheckpointError: the manifest belongs to another format.
        CheckpointError: unreadable JSON, a newer format version, bad field types, or an unsafe path.
    """
    path = directory / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable manifest ({exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise NotACheckpointError(f"{path}: not an {FORMAT_NAME} manifest (format {found!r})")
    version = manifest.get("format_version")
    if not isinstance(version, int) or version < 1:
        raise CheckpointError(f"{path}: bad format_version {version!r}")
    if version > FORMAT_VERSION:
        raise CheckpointError(f"{path}: format_version {version} is newer than this astrai "
                              f"(supports <= {FORMAT_VERSION}); upgrade astrai to load it")
    for key in ("step", "policy_version", "world_size"):
        if not isinstance(manifest.get(key), int) or manifest[key] < 0:
            raise CheckpointError(f"{path}: field {key!r} must be a non-negative integer, "
                                  f"got {manifest.get(key)!r}")
    parts = manifest.get("parts", {})
    if not isinstance(parts, dict) or not all(
            isinstance(p, dict) and isinstance(p.get("kind"), str) and isinstance(p.get("per_rank"), bool)
            and isinstance(p.get("required"), bool) for p in parts.values()):
        raise CheckpointError(f"{path}: field 'parts' must map names to {{kind, per_rank, required}}")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise CheckpointError(f"{path}: field 'files' must be an object")
    for name, entry in files.items():
        safe_member(directory, name)
        if name == MANIFEST_NAME:
            raise CheckpointError(f"{path}: the manifest lists itself")
        if (not isinstance(entry, dict) or not isinstance(entry.get("bytes"), int) or entry["bytes"] < 0
                or not isinstance(entry.get("sha256"), str) or not _SHA_RE.match(entry["sha256"])):
            raise CheckpointError(f"{path}: bad entry for {name}: {entry!r}")
    return manifest


def check_files(directory: Path, manifest: dict, *, hashes: bool) -> list[FileStatus]:
    """Check every manifest file: present, inside the directory, right size and (`hashes`) right sha256.

    Files on disk that the manifest does not list are reported as EXTRA. Never raises for a file problem;
    the statuses say what is wrong.
    """
    statuses = []
    for name, entry in sorted(manifest["files"].items()):
        try:
            path = safe_member(directory, name)
        except CheckpointError as exc:
            statuses.append(FileStatus(name, "UNSAFE", str(exc)))
            continue
        if not path.is_file():
            statuses.append(FileStatus(name, "MISSING", "listed in the manifest, not on disk"))
            continue
        size = path.stat().st_size
        if size != entry["bytes"]:
            statuses.append(FileStatus(name, "MISMATCH", f"{size} bytes, manifest says {entry['bytes']}"))
            continue
        if hashes:
            digest, _ = sha256_file(path)
            if digest != entry["sha256"]:
                statuses.append(FileStatus(name, "MISMATCH", f"sha256 {digest[:16]}..., manifest says "
                                                             f"{entry['sha256'][:16]}..."))
                continue
        statuses.append(FileStatus(name, "OK"))
    listed = set(manifest["files"]) | {MANIFEST_NAME}
    for name in sorted(list_files(directory)):
        if name not in listed:
            statuses.append(FileStatus(name, "EXTRA", "on disk, not in the manifest (ignored)"))
    return statuses


def list_files(directory: Path) -> list[str]:
    """POSIX relative paths of every regular file (or symlink) under `directory`."""
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*")
                  if p.is_file() or p.is_symlink())


def write_manifest(directory: Path, fields: dict, *, known: dict[str, dict] | None = None) -> dict:
    """fsync and hash every file of `directory` (in `HASH_THREADS` threads), then write `manifest.json`
    (fields + per-file sha256/bytes) and fsync it and every directory under `directory`. Files in `known`
    (name -> {sha256, bytes}, e.g. computed by the rank that wrote them or by a background thread) are not
    re-hashed when their size matches.

    Raises:
        OSError: on any write/sync failure.
    """
    known = known or {}

    def entry(name: str) -> dict:
        path = directory / name
        if name in known and path.stat().st_size == known[name]["bytes"]:
            fsync_file(path)
            return dict(known[name])
        digest, size = sha256_file(path, fsync=True)
        return {"sha256": digest, "bytes": size}

    names = list_files(directory)
    with ThreadPoolExecutor(max_workers=max(1, min(HASH_THREADS, len(names)))) as pool:
        files = dict(zip(names, pool.map(entry, names)))  # hashlib and fsync release the GIL
    manifest = dict(fields, format=FORMAT_NAME, format_version=FORMAT_VERSION, files=files)
    target = directory / MANIFEST_NAME
    with open(target, "w", encoding="utf-8") as f:
        f.write(json.dumps(manifest, indent=2, sort_keys=True))
        f.flush()
        os.fsync(f.fileno())
    for sub in sorted({(directory / n).parent for n in files}, key=lambda p: len(p.parts), reverse=True):
        fsync_dir(sub)
    fsync_dir(directory)
    return manifest


def failed(statuses: Iterable[FileStatus]) -> list[FileStatus]:
    """The statuses that are failures (MISSING, MISMATCH, UNSAFE)."""
    return [s for s in statuses if s.failed]
