"""Checkpoint publishing: the only module that writes checkpoint directories (docs/conventions.md section 5).

Protocol for `<output_dir>/checkpoints/step-XXXXXXXX` (see `layout.py` for the names):

1. rank 0 checks the weights are finite and the filesystem has room (`safety`), deletes stale staging dirs of
   this step and creates `.step-N.staging-<id>`; the ranks agree (a refusal is raised on every rank).
2. every rank writes its files of the parts (`parts.write_parts`: rank 0 every part, rank R >= 1 its copies of the
   per-rank parts) into that one directory, fsyncs them (rank 0 hashes and fsyncs each large file in
   background threads while serialising the next), then drops a `.rank-R.done` marker listing the
   files with their sha256 (or, when its writing failed, removes its files and drops `.rank-R.failed` with the
   error line). Ranks >= 1 find the staging dir by waiting for it (`timeout_s`).
3. rank 0 waits for every marker (`timeout_s`; a failed marker ends the wait), removes them, fsyncs everything,
   writes `manifest.json` (last), fsyncs it and the directory, and moves the directory into place: a plain rename
   when the step is new; on republish an atomic exchange (`renameat2(RENAME_EXCHANGE)`) with the old directory, or,
   where that is unsupported, old -> `.retired-<id>`, new -> `step-N`, delete the retired one. The parent
   is fsynced. Ranks >= 1 wait until `step-N/manifest.json` carries this publish's id.
4. rank 0 applies `keep_last` retention; the ranks agree on the outcome (every rank raises the first failure).

A crash at any point leaves the previous complete checkpoint visible (with the exchange) or recoverable
by `layout.recover` (with the retired fallback, between the two renames). No step ever blocks forever on
a rank that failed: waits are on files with `timeout_s`, and the agreements are entered by every rank that is
still alive (a rank that died ends them through the process group's timeout or its closed connection).
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
from astrai.checkpoint.layout import (CheckpointWarning, apply_retention, checkpoints_root, hidden_name,
                                     list_checkpoints, step_dirname)
from astrai.checkpoint.manifest import (HASH_THREADS, MANIFEST_NAME, CheckpointError, check_files, failed,
                                        write_manifest)
from astrai.checkpoint.parts import Part, check_parts, manifest_parts, write_parts
from astrai.checkpoint.safety import (AGREED_ERRORS, CheckpointSpaceError, NonFiniteWeightsError, checkpoint_bytes,
                                      estimate_bytes, free_bytes, nonfinite_weights, out_of_space, space_error)

POLL_S = 0.02


class DistLike(Protocol):
    """What the publisher needs from a process group (duck-typed; `DistributedContext` fits). With a
    `gather_objects(obj) -> list` as well, the ranks agree on failures: a refusal before writing (no space,
    non-finite weights) and an error while writing are raised on every rank with the same message; without it each
    rank raises its own."""

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

    Before anything is written, rank 0 checks that every weights part (`Part.holds_weights`: policy, critic) is
    finite and that the filesystem has room for the checkpoint: the size of this run's latest checkpoint, else an
    estimate (`safety.estimate_bytes`). Running out of space while writing (however the writer says it) removes the
    staging directory and becomes the same one-line `CheckpointSpaceError`; nothing partial is ever visible.

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
        CheckpointSpaceError: no room for the checkpoint (before or while writing), one line naming the
            filesystem, the size needed, the space free and the last good checkpoint.
        CheckpointError: invalid parts, non-finite weights, a rank that cannot see the staging directory or never
            delivered its part within `timeout_s`, or rank 0 abandoning the publish.
        OSError: other filesystem failures (the staging directory is removed by rank 0).
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
            _check_before_writing(output_dir, root, parts, run_id)
            staging = _create_staging(root, name)
    except Exception as exc:  # noqa: BLE001 - re-raised after the ranks agree
        error = exc
    _agree(dist, error, rank, before_writing=True)
    try:
        if rank == 0:
            fields = dict(metadata or {})
            fields.update(step=step, policy_version=int(fields.get("policy_version", 0)), world_size=world,
                          train_type=fields.get("train_type"), parts=manifest_parts(parts))
            if run_id is not None:
                fields["run_id"] = run_id
            final = _publish_rank0(root, name, staging, parts, fields, dist=dist, timeout_s=timeout_s,
                                   last_good=_last_good(output_dir, run_id))
        else:
            staging = _discover_staging(root, name, rank, timeout_s)
            _contribute(staging, rank, parts, _last_good(output_dir, run_id))
            final = _wait_published(root / name, staging, rank, timeout_s)
        if rank == 0 and keep_last is not None:
            try:
                apply_retention(output_dir, keep_last, protect=final, run_id=run_id)
            except OSError as exc:
                warnings.warn(f"keep_last={keep_last} retention failed: {exc}", CheckpointWarning, stacklevel=2)
    except Exception as exc:  # noqa: BLE001 - every rank hears of the first rank's failure
        error = exc
    _agree(dist, error, rank, before_writing=False)
    return final


def _last_good(output_dir, run_id: Optional[str]) -> Optional[Path]:
    """This run's newest complete checkpoint (any run's when `run_id` is None), or None."""
    found = list_checkpoints(output_dir, run_id=run_id)
    return found[-1][1] if found else None


def _check_before_writing(output_dir, root: Path, parts, run_id: Optional[str]) -> None:
    """Rank 0: refuse non-finite weights and a filesystem without room for the checkpoint."""
    bad = nonfinite_weights(parts)
    last = _last_good(output_dir, run_id)
    if bad:
        where = f"the last good checkpoint is {last.name}" if last is not None else "no checkpoint was published"
        raise NonFiniteWeightsError(f"non-finite weights are never published: {'; '.join(bad)} hold NaN or "
                                    f"infinite values; {where}")
    needed = (checkpoint_bytes(last) if last is not None else None) or estimate_bytes(parts)
    free = free_bytes(root)
    if free < needed:
        raise space_error(root, needed, free, last, during=False)


def _agree(dist, error: Optional[BaseException], rank: int, *, before_writing: bool) -> None:
    """Every rank raises when any rank failed: the first failure by rank order (its own error on the rank that had
    it; a `CheckpointError` with that rank's message elsewhere). Without `gather_objects`, a barrier before
    writing and each rank's own error after."""
    if dist is None:
        if error is not None:
            raise error
        return
    gather = getattr(dist, "gather_objects", None)
    if gather is None:
        if before_writing:
            dist.barrier()
        if error is not None:
            raise error
        if not before_writing:
            dist.barrier()
        return
    try:
        said = gather(None if error is None else (type(error).__name__, _one_line(error)))
    except Exception:  # noqa: BLE001 - a rank is gone: the local error (or the collective's) is all there is
        if error is not None:
            raise error
        raise
    failures = [(r, s) for r, s in enumerate(said) if s is not None]
    if not failures:
        return
    first = next(((r, s) for r, s in failures if s[0] != "_Abandoned"), failures[0])
    if error is not None and first[0] == rank:
        raise error
    kind = AGREED_ERRORS.get(first[1][0], CheckpointError)
    raise kind(first[1][1] if first[0] == 0 else f"rank {first[0]}: {first[1][1]}") from error


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


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
                   timeout_s: float, last_good: Optional[Path]) -> Path:
    """Rank 0: its files, wait for the other ranks' files, manifest, move into place. On any failure the staging
    directory is removed; running out of space becomes a `CheckpointSpaceError` (its size: what was written)."""
    pool = ThreadPoolExecutor(max_workers=HASH_THREADS)
    futures: dict[str, Future] = {}
    try:
        write_parts(staging, parts, 0,
                    on_written=lambda n: futures.setdefault(n, pool.submit(_hash_entry, staging / n)))
        known = {n: f.result() for n, f in futures.items()}
        if dist is not None and fields["world_size"] > 1:
            known.update(_collect_rank_parts(staging, fields["world_size"], timeout_s))
        fields["publish_id"] = _publish_id(staging)
        manifest = write_manifest(staging, fields, known=known)
        _check_staged(staging, name, manifest, written=known)
        final = root / name
        _move_into_place(staging, final, root)
    except BaseException as exc:
        pool.shutdown(wait=True, cancel_futures=True)
        written, free = _tree_bytes(staging), free_bytes(root)  # before the staging directory frees its space
        remove_tree(staging)
        if isinstance(exc, Exception) and not isinstance(exc, CheckpointError):
            measured = checkpoint_bytes(last_good) if last_good is not None else None
            needed = max(written, measured or estimate_bytes(parts))
            if out_of_space(exc, free=free, missing=needed - written):
                raise space_error(root, needed, free + written, last_good, during=True) from exc
        raise
    pool.shutdown()
    return final


def _check_staged(staging: Path, name: str, manifest: dict, *, written: Mapping[str, dict]) -> None:
    """Before the rename: every file written for the checkpoint (`written`: rank 0's and the collected ranks')
    is listed in `manifest` and still in `staging` with its size (another process deleting the staging
    directory meanwhile, e.g. a `recover` beside the running job, must not publish a checkpoint without them).

    Raises:
        CheckpointError: one line naming the files that vanished.
    """
    changed = {status.name for status in failed(check_files(staging, manifest, hashes=False))}
    gone = (set(written) - set(manifest["files"])) | changed
    if gone:
        raise CheckpointError(f"checkpoint {name}: {', '.join(sorted(gone)[:5])} vanished from its staging "
                              f"directory {staging} or changed while it was written (another process deleted it?); "
                              "nothing was published")


def _tree_bytes(path: Path) -> int:
    """Bytes of the regular files under `path` (0 when it is gone)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


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


def _marker(rank: int, state: str = "done") -> str:
    return f".rank-{rank:05d}.{state}"


class _Abandoned(CheckpointError):
    """Rank >= 1: rank 0 removed the staging directory (rank 0's own error says why)."""


def _contribute(staging: Path, rank: int, parts, last_good: Optional[Path]) -> None:
    """Rank >= 1: write, fsync and hash this rank's files, then publish the marker atomically. On failure, its
    files are removed (room for the marker on a full disk) and a `.rank-R.failed` marker carries the error line
    to rank 0, which then stops waiting; running out of space becomes a `CheckpointSpaceError`."""
    try:
        names = write_parts(staging, parts, rank)
        files = {}
        for name in names:
            digest, size = sha256_file(staging / name, fsync=True)
            files[name] = {"sha256": digest, "bytes": size}
    except Exception as exc:
        error = exc
        written, free = _tree_bytes(staging), free_bytes(staging)
        measured = checkpoint_bytes(last_good) if last_good is not None else None
        needed = max(written, measured or estimate_bytes(parts))
        if out_of_space(exc, free=free, missing=needed - written):
            error = space_error(staging.parent, needed, free + written, last_good, during=True)
        for path in staging.glob(f"*_rank{rank:05d}*"):
            remove_tree(path)
        try:
            (staging / _marker(rank, "failed")).write_text(f"{type(error).__name__}\n{_one_line(error)}",
                                                           encoding="utf-8")
        except OSError:
            pass
        if error is exc:
            raise
        raise error from exc
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
        for r in sorted(waiting):
            failed = staging / _marker(r, "failed")
            if failed.is_file():
                kind, _, line = failed.read_text(encoding="utf-8").partition("\n")
                error = AGREED_ERRORS.get(kind, CheckpointError)
                raise error(f"rank {r}: {line}")
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
            raise _Abandoned(f"rank {rank}: rank 0 abandoned publishing {final.name} "
                                  f"({staging.name} was removed; see rank 0's error)")
        if time.monotonic() > deadline:
            raise CheckpointError(f"rank {rank}: {final} was not published within {timeout_s:g}s")
        time.sleep(POLL_S)
