"""Durable-filesystem helpers for the checkpoint publisher (fsync, hashing, atomic directory exchange) and for the
small files written beside checkpoints (atomic text writes)."""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import shutil
from pathlib import Path
from typing import Optional

HASH_CHUNK_BYTES = 4 << 20

# Set to False to force the two-rename (retired sibling) republish protocol, e.g. in tests or on
# filesystems where `renameat2(RENAME_EXCHANGE)` misbehaves. Probed lazily otherwise.
EXCHANGE_SUPPORTED: bool | None = None

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_libc = None


def fsync_file(path: Path) -> None:
    """fsync the data of the regular file at `path`.

    Raises:
        OSError: when the file cannot be opened or synced.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str | bytes) -> None:
    """Write `text` (a str as UTF-8, or bytes as they are) to a hidden sibling of `path`, fsync it and rename it over
    `path`, so a reader sees the old file or the whole new one, never half of it.

    Raises:
        OSError: when the sibling cannot be written or renamed (the parent directory must exist); the sibling is
            removed then (a full disk leaves nothing behind).
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(text.encode("utf-8") if isinstance(text, str) else text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise


def nearest_existing(path: Path) -> Optional[Path]:
    """`path` itself if it exists, else its nearest existing ancestor, else None: the place that decides whether
    `path` can be created as a directory (it can when that place is a directory)."""
    return next((place for place in (path, *path.parents) if place.exists()), None)


def fsync_dir(path: Path) -> None:
    """fsync a directory, making the creations/renames of its entries durable.

    Raises:
        OSError: when the directory cannot be opened or synced.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path, *, fsync: bool = False) -> tuple[str, int]:
    """Hex sha256 and byte count of a file, reading it once; `fsync=True` also syncs its data.

    Raises:
        OSError: when the file cannot be read.
    """
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb", buffering=0) as f:
        buffer = bytearray(HASH_CHUNK_BYTES)
        view = memoryview(buffer)
        while n := f.readinto(buffer):
            digest.update(view[:n])
            size += n
        if fsync:
            os.fsync(f.fileno())
    return digest.hexdigest(), size


def remove_tree(path: Path) -> None:
    """Delete a directory tree (or a file/symlink); a path that is already gone is fine."""
    try:
        if path.is_symlink() or path.is_file():
            path.unlink()
        else:
            shutil.rmtree(path)
    except FileNotFoundError:
        pass


def exchange_dirs(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths (Linux `renameat2(RENAME_EXCHANGE)`).

    Returns:
        True when swapped; False when the platform or filesystem does not support the exchange (nothing
        was changed), after which `EXCHANGE_SUPPORTED` is False for the rest of the process.

    Raises:
        OSError: on any other failure (e.g. a path is missing).
    """
    global EXCHANGE_SUPPORTED, _libc
    if EXCHANGE_SUPPORTED is False:
        return False
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.renameat2  # noqa: B018 - probe the symbol
        except (OSError, AttributeError):
            EXCHANGE_SUPPORTED = False
            return False
    result = _libc.renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if result == 0:
        EXCHANGE_SUPPORTED = True
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        EXCHANGE_SUPPORTED = False
        return False
    raise OSError(err, f"renameat2(RENAME_EXCHANGE) {a} <-> {b}: {os.strerror(err)}")
