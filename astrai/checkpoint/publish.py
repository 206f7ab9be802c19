"""Checkpoint publishing: the only module that writes checkpoint directories (docs/conventions.md section 5).

Protocol for `<output_dir>/checkpoints/step-XXXXXXXX` (see `layout.py` for the names):

1. rank 0 deletes stale staging dirs of this step and creates `.step-N.staging-<id>`; barrier.
2. every rank writes its files of the parts (`parts.write_parts`: rank 0 every part, rank R >= 1 its copies of the
   per-rank parts) into that one directory, fsyncs them (rank 0 hashes and fsyncs each large file in
   background threads while serialising the next), then drops a `.rank-R.done` marker listing the
   files with their sha256. Ranks >= 1 find the staging dir by waiting for it (`timeout_s`).
3. rank 0 waits for every marker (`timeout_s`), removes them, fsyncs everything, writes `manifest.json`
   (last), fsyncs it and the directory, and moves the directory into place: a plain rename when the step
   is new; on republish an atomic exchange (`renameat2(RENAME_EXCHANGE)`) with the old directory, or,
   where that is unsupported, old -> `.retired-<id>`, new -> `step-N`, delete the retired one. The parent
   is fsynced. Ranks >= 1 wait until `step-N/manifest.json` carries this publish's id; barrier.
4. rank 0 applies `keep_last` retention.

A crash at any point leaves the previous complete checkpoint visible (with the exchange) or recoverable
by `layout.recover` (with the retired fallback, between the two renames). No step ever blocks forever on
a rank that failed: waits are on files with `timeout_s`, and barriers are only entered by ranks that
have nothing left to fail.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Protocol

from astrai.checkpoint import fsutil
from astrai.checkpoint.fsutil import fsync_dir, remove_tree, sha256_file
from astrai.checkpoint.layout import CheckpointWarning, apply_retention, checkpoints_root, hidden_name, step_dirname
from astrai.checkpoint.manifest import HASH_THREADS, MANIFEST_NAME, CheckpointError, write_manifest
from astrai.checkpoint.parts import Part, check_parts, manifest_parts, write_parts

POLL_S = 0.02


class DistLike(Protocol):
    """What the publisher needs from a process group (duck-typed; `DistributedContext` fits)."""

    rank: int
    world_size: int

    def barrier(self) -> None:
        """Block until every rank has called it."""


def publish_checkpoint(output_dir: str | os.PathLike, step: int, parts: Mapping[str, Part], *,
                       metadata: Optional[Mapping[str, Any]] = None, world_size: int = 1,
                       dist: Optional[DistLike] = None, keep_last: Optional[int] = None,
                       before_publish: Optional[Callable[[], None]] = None, timeout_s: float = 300.0,
                       run_id: Optional[str] = None) -> Path:
    """Atomically publish `<output_dir>/checkpoints/step-XXXXXXXX` (replacing an existing one).

    Single process: call it with `dist=None`. Several ranks: every rank calls it with the same `step`, the same
    part names and a `dist` (rank, world_size, barrier()); rank 0 writes every part, the other ranks their own
    copies of the per-rank parts.

    Args:
        parts: name -> `Part` (see `astrai.checkpoint.parts`), declared by the owners of the state.
        metadata: recorded in the manifest: `policy_version` (int, default 0), `train_type` (str or None) and any
            other JSON-serialisable fields (names other than the manifest's own).
        world_size: recorded in the manifest when `dist` is None (else `dist.world_size`).
        dist: process group for the multi-rank protocol.
        keep_last: after publishing, keep only the newest N complete checkpoints (never deleting this one); with
            `run_id`, only the newest N of that run (other runs' checkpoints are left alone).
        before_publish: called first on every rank (e.g. flush + fsync metrics.jsonl).
        timeout_s: seconds to wait for the staging directory, for other ranks' parts, and for rank 0's
            rename (each wait separately).
        run_id: the training run this checkpoint belongs to, recorded in the manifest (`layout.run_id_of`).

    Returns:
        the published directory (same on every rank).

    Raises:
        CheckpointError: invalid parts, a rank that cannot see the staging directory or never delivered its part
            within `timeout_s`, or rank 0 abandoning the publish.
        OSError: filesystem failures (the staging directory is removed by rank 0).
        ValueError: a negative step, keep_last < 1, or world_size disagreeing with `dist`.
    """
    rank, world = (int(dist.rank), int(dist.world_size)) if dist is not None else (0, int(world_size))
    if dist is not None and world_size not in (1, world):
        raise ValueError(f"world_size={world_size} disagrees with dist.world_size={world}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (or None to keep all), got {keep_last}")
    root = checkpoints_root(output_dir)
    name = step_dirname(step)
    staging, error = None, None
    try:  # a failure here must not leave the other ranks blocked in the barrier
        check_parts(parts)
        if before_publish is not None:
            before_publish()
        if rank == 0:
            staging = _create_staging(root, name)
    except Exception as exc:  # noqa: BLE001 - re-raised after the barrier
        error = exc
    if dist is not None:
        dist.barrier()
    if error is not None:
        raise error
    if rank == 0:
        fields = dict(metadata or {})
        fields.update(step=step, policy_version=int(fields.get("policy_version", 0)), world_size=world,
                      train_type=fields.get("train_type"), parts=manifest_parts(parts))
        if run_id is not None:
            fields["run_id"] = run_id
        final = _publish_rank0(root, name, staging, parts, fields, dist=dist, timeout_s=timeout_s)
    else:
        staging = _discover_staging(root, name, rank, timeout_s)
        _contribute(staging, rank, parts)
        final = _wait_published(root / name, staging, rank, timeout_s)
    if rank == 0 and keep_last is not None:
        try:
            apply_retention(output_dir, keep_last, protect=final, run_id=run_id)
        except OSError as exc:
            warnings.warn(f"keep_last={keep_last} retention failed: {exc}", CheckpointWarning, stacklevel=2)
    if dist is not None:
        dist.barrier()
    return final


def _create_staging(root: Path, name: str) -> Path:
    """Rank 0: (re)create the checkpoints root, delete stale staging dirs of this step, make a fresh one."""
    if not root.is_dir():
        root.mkdir(parents=True, exist_ok=True)
        fsync_dir(root.parent)
    for stale in root.glob(f".{name}.staging-*"):
        remove_tree(stale)
    staging = root / hidden_name(name, "staging")
    staging.mkdir()
    return staging


def _publish_rank0(root: Path, name: str, staging: Path, parts, fields: dict, *, dist,
                   timeout_s: float) -> Path:
    """Rank 0: its files, wait for the other ranks' files, manifest, move into place."""
    pool = ThreadPoolExecutor(max_workers=HASH_THREADS)
    futures: dict[str, Future] = {}
    try:
        write_parts(staging, parts, 0,
                    on_written=lambda n: futures.setdefault(n, pool.submit(_hash_entry, staging / n)))
        known = {n: f.result() for n, f in futures.items()}
        if dist is not None and fields["world_size"] > 1:
            known.update(_collect_rank_parts(staging, fields["world_size"], timeout_s))
        fields["publish_id"] = _publish_id(staging)
        write_manifest(staging, fields, known=known)
        final = root / name
        _move_into_place(staging, final, root)
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        remove_tree(staging)
        raise
    pool.shutdown()
    return final


def _hash_entry(path: Path) -> dict:
    """fsync + sha256 of one finished file (runs in a worker thread; hashlib/fsync release the GIL)."""
    digest, size = sha256_file(path, fsync=True)
    return {"sha256": digest, "bytes": size}


def _publish_id(staging: Path) -> str:
    return staging.name.rsplit("-", 1)[1]


def _move_into_place(staging: Path, final: Path, root: Path) -> None:
    """Rename the finished staging dir to `final`, replacing an existing checkpoint atomically."""
    if not (final.exists() or final.is_symlink()):
        os.rename(staging, final)
        fsync_dir(root)
        return
    if fsutil.exchange_dirs(staging, final):
        fsync_dir(root)
        remove_tree(staging)  # now holds the old payload; recover() deletes it after a crash
        return
    retired = root / hidden_name(final.name, "retired")
    os.rename(final, retired)
    os.rename(staging, final)
    fsync_dir(root)
    remove_tree(retired)


def _marker(rank: int) -> str:
    return f".rank-{rank:05d}.done"


def _contribute(staging: Path, rank: int, parts) -> None:
    """Rank >= 1: write, fsync and hash this rank's files, then publish the marker atomically."""
    names = write_parts(staging, parts, rank)
    files = {}
    for name in names:
        digest, size = sha256_file(staging / name, fsync=True)
        files[name] = {"sha256": digest, "bytes": size}
    tmp = staging / f"{_marker(rank)}.tmp"
    tmp.write_text(json.dumps({"rank": rank, "files": files}), encoding="utf-8")
    os.rename(tmp, staging / _marker(rank))
    fsync_dir(staging)


def _collect_rank_parts(staging: Path, world: int, timeout_s: float) -> dict[str, dict]:
    """Rank 0: wait for every other rank's marker, check its files are visible, remove the markers.

    Raises:
        CheckpointError: ranks missing after `timeout_s`, or a marker naming files rank 0 cannot see.
    """
    waiting = set(range(1, world))
    deadline = time.monotonic() + timeout_s
    while waiting:
        waiting = {r for r in waiting if not (staging / _marker(r)).is_file()}
        if waiting and time.monotonic() > deadline:
            raise CheckpointError(f"rank 0: rank(s) {sorted(waiting)} did not write their part into "
                                  f"{staging} within {timeout_s:g}s")
        if waiting:
            time.sleep(POLL_S)
    known: dict[str, dict] = {}
    for r in range(1, world):
        marker = staging / _marker(r)
        part = json.loads(marker.read_text(encoding="utf-8"))
        for fname, entry in part["files"].items():
            path = staging / fname
            if not path.is_file() or path.stat().st_size != entry["bytes"]:
                raise CheckpointError(f"rank 0 cannot see rank {r}'s file {fname} ({entry['bytes']} bytes) "
                                      f"in {staging}; is it on a filesystem shared by all ranks?")
            known[fname] = entry
        marker.unlink()
    return known


def _discover_staging(root: Path, name: str, rank: int, timeout_s: float) -> Path:
    """Rank >= 1: the single `.step-N.staging-*` directory rank 0 created (waiting up to `timeout_s`).

    Raises:
        CheckpointError: "rank R cannot see staging dir ..." when none (or several) appear in time.
    """
    deadline = time.monotonic() + timeout_s
    pattern = f".{name}.staging-*"
    while True:
        found = sorted(root.glob(pattern)) if root.is_dir() else []
        if len(found) == 1:
            return found[0]
        if time.monotonic() > deadline:
            seen = f" (found {len(found)}: {[p.name for p in found]})" if found else ""
            raise CheckpointError(f"rank {rank} cannot see staging dir {root / pattern} after {timeout_s:g}s"
                                  f"{seen}; the checkpoint directory must be on a filesystem shared "
                                  f"by all ranks")
        time.sleep(POLL_S)


def _wait_published(final: Path, staging: Path, rank: int, timeout_s: float) -> Path:
    """Rank >= 1: wait until `final/manifest.json` carries this publish's id.

    Raises:
        CheckpointError: rank 0 removed the staging dir without publishing it, or `timeout_s` passed.
    """
    publish_id = _publish_id(staging)
    deadline = time.monotonic() + timeout_s
    while True:
        gone = not staging.exists()
        try:
            manifest = json.loads((final / MANIFEST_NAME).read_text(encoding="utf-8"))
            if manifest.get("publish_id") == publish_id:
                return final
        except (OSError, ValueError):
            pass
        if gone:
            raise CheckpointError(f"rank {rank}: rank 0 abandoned publishing {final.name} "
                                  f"({staging.name} was removed; see rank 0's error)")
        if time.monotonic() > deadline:
            raise CheckpointError(f"rank {rank}: {final} was not published within {timeout_s:g}s")
        time.sleep(POLL_S)
