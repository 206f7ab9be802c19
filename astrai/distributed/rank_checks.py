"""Checks that need every rank, before the first step, and the description of a rank that stopped answering.

`check_ranks_agree` runs once the process group exists: rank 0 writes a token file into `train.output_dir`; after a
barrier every rank reads it, and one gather collects, per rank, its host, pid, astrai version, job-config hash,
world size and whether it saw rank 0's token. A rank on another filesystem (a node-local output directory), another
astrai or another job file is named in one line (`RanksDisagree`, exit code 2) on every rank, within seconds,
instead of after the whole run when the final publish waits for files it will never see. The gathered hosts and
pids stay on the context (`DistributedContext.peers`) for the messages below.

`describe_stall` turns the timeout a collective raised (gloo says "Timed out waiting ... ms") into one line naming
`distributed.timeout_seconds` and, where it can be found out, the rank: every rank that is still running reports
itself in the rendezvous store; the ranks that do not within a few seconds are the ones that stopped.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Optional, Sequence

TOKEN_PREFIX = ".rank-check-"
REPORT_SECONDS = 3.0


class RanksDisagree(ValueError):
    """The ranks of one job do not see the same job; the message is one line naming the rank and its host."""


def _version() -> str:
    """The installed astrai distribution's version ("unknown" when it is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("astrai")
    except PackageNotFoundError:
        return "unknown"


def check_ranks_agree(dist, output_dir: Path, config_hash: str) -> list[dict]:
    """Every rank sees rank 0's token in `output_dir` and runs the same astrai, job config and world size.

    Args:
        dist: the process state (`DistributedContext`: rank, world_size, is_main, barrier, broadcast_object,
            gather_objects).
        output_dir: `train.output_dir` (rank 0 creates it).
        config_hash: a hash of the resolved job config (`dump_config`), the same on every rank of one job.

    Returns:
        per rank, in rank order: {"rank", "host", "pid", "version", "config", "world_size", "sees_output_dir"}.
    Raises:
        RanksDisagree: one line, the same on every rank, naming the first rank that differs from rank 0 and its host.
        OutputWriteError: on every rank (`agreed`), when rank 0 cannot write the token file (a full disk, a read-only
            filesystem: one line naming it).
    """
    token = None
    if dist.is_main:
        token = uuid.uuid4().hex
        path = output_dir / f"{TOKEN_PREFIX}{token}"
        try:
            output_dir.mkdir(parents=True, exist_ok=True)
            path.write_text(token, encoding="utf-8")
        except OSError as err:
            from astrai.outputs import cannot_write

            try:
                path.unlink(missing_ok=True)
            except OSError:
                pass
            token = {"cannot_write": cannot_write(path, err)}  # carried to every rank by the broadcast
    token = dist.broadcast_object(token)
    if isinstance(token, dict):
        from astrai.outputs import OutputWriteError

        raise OutputWriteError.carried(token["cannot_write"])
    dist.barrier()
    path = output_dir / f"{TOKEN_PREFIX}{token}"
    try:
        seen = path.read_text(encoding="utf-8") == token
    except OSError:
        seen = False
    mine = {"rank": dist.rank, "host": socket.gethostname(), "pid": os.getpid(), "version": _version(),
            "config": config_hash, "world_size": int(os.environ.get("WORLD_SIZE", dist.world_size)),
            "sees_output_dir": seen}
    ranks = dist.gather_objects(mine)
    dist.barrier()
    if dist.is_main:
        path.unlink(missing_ok=True)
    problem = _first_problem(ranks, output_dir, dist.world_size)
    if problem is not None:
        raise RanksDisagree(problem)
    return ranks


def _first_problem(ranks: Sequence[dict], output_dir: Path, world_size: int) -> Optional[str]:
    """The first disagreement among the gathered `ranks` (rank 0's view is the reference), one line, or None."""
    first = ranks[0]
    for info in ranks:
        where = f"rank {info['rank']} on host {info['host']}"
        if not info["sees_output_dir"]:
            return (f"train.output_dir {output_dir}: {where} does not see the token file rank 0 (host "
                    f"{first['host']}) wrote there: every rank must see the same directory, on a filesystem "
                    "shared by all nodes (docs/launch.md)")
        if info["version"] != first["version"]:
            return (f"{where} runs astrai {info['version']}, rank 0 runs {first['version']}: install the same "
                    "version on every node")
        if info["config"] != first["config"]:
            return (f"{where} resolved another job config than rank 0 (hash {info['config'][:12]} vs "
                    f"{first['config'][:12]}): give every node the same job file and overrides")
        if info["world_size"] != world_size:
            return (f"{where} was started for WORLD_SIZE {info['world_size']}, the process group has {world_size} "
                    "ranks: start every node with the same process counts")
    return None


def _store():
    """The default process group's rendezvous store, or None."""
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError, ImportError):
        return None


def is_timeout(exc: BaseException) -> bool:
    """Whether `exc` is a collective or store timeout (gloo "Timed out", torch's DistBackendError on a timeout)."""
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text and "distributed" in type(exc).__module__


def describe_stall(dist, timeout_seconds: float, exc: BaseException) -> tuple[str, Optional[list[int]]]:
    """One line for a collective that timed out on this rank, and the silent ranks: the timeout, and the ranks that
    did not report in the store within `REPORT_SECONDS` (those that stopped; their hosts from `dist.peers` when
    known); None for the ranks when the store did not answer."""
    waited = f"a collective did not complete within distributed.timeout_seconds {timeout_seconds:g}"
    silent = _silent_ranks(dist)
    peers = getattr(dist, "peers", None) or []
    if silent:
        names = ", ".join(f"rank {r}" + (f" (host {peers[r]['host']}, pid {peers[r]['pid']})" if r < len(peers)
                                         else "") for r in silent)
        who = f"{names} stopped answering"
    elif silent is None:
        who = "the rank that stopped answering is unknown (the rendezvous store did not answer either: rank 0's " \
              "host may be the one)"
    else:
        who = "every rank is still running: one is stuck inside the collective"
    line = f"rank {dist.rank}: {waited}: {who}; the job stops (raise --distributed.timeout_seconds for slow phases)"
    return line, silent


def _silent_ranks(dist) -> Optional[list[int]]:
    """The ranks that did not write their key within `REPORT_SECONDS` (every running rank writes its own when its
    collective times out), or None when the store cannot be used."""
    store = _store()
    if store is None:
        return None
    prefix = "astrai/stall/"
    try:
        store.set_timeout(timedelta(seconds=REPORT_SECONDS))
        store.set(f"{prefix}{dist.rank}", socket.gethostname())
        deadline = time.monotonic() + REPORT_SECONDS
        missing = list(range(dist.world_size))
        while missing and time.monotonic() < deadline:
            missing = [r for r in missing if not store.check([f"{prefix}{r}"])]
            if missing:
                time.sleep(0.1)
        return missing
    except Exception:  # noqa: BLE001 - the store is down too
        return None
