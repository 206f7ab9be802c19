"""Per-job process environment: `runtime.environment` exported for one job, and astrai's log level.

`runtime.environment` (a YAML map in the job file) is exported into `os.environ` of every training process at the
start of `python -m astrai.train`, before anything creates the process group, so NCCL / gloo / CUDA settings such
as `NCCL_P2P_DISABLE` take effect. Each value is rendered with `str()` (`1` -> "1", `true` -> "True") and `null`
exports the empty string; values are taken literally (no `$VAR` or `~` expansion). On exit the previous values
are restored, so nothing leaks into a later job run in the same Python process; child processes started during
the job (data workers) inherit the values as usual.

`ASTR_LOG_LEVEL` (from the shell or from `runtime.environment`) sets the level of the `astrai` logger: a
`logging` level name (`DEBUG`, `INFO`, `WARNING`, `ERROR`, `CRITICAL`) or number.

`announce_deepspeed_op_build` says, in one line, when DeepSpeed is about to compile an op on first use (a silent
two-minute wait otherwise) and where the build is cached.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Iterator, Mapping, Optional, Union

__all__ = ["LOG_LEVEL_VAR", "announce_deepspeed_op_build", "render_environment", "job_environment", "log_level",
           "configure_logging", "job_runtime", "usable_cpus", "checked_threads"]

LOG_LEVEL_VAR = "ASTR_LOG_LEVEL"
"""Environment variable naming the `astrai` logger's level."""
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
logger = logging.getLogger(__name__)

Scalar = Union[str, int, float, bool, None]


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the system has one, else `os.cpu_count()`)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def checked_threads(count: int, field: str) -> int:
    """`count` torch threads for the setting `field`, refused above the CPUs this process may use: OpenMP threads
    beyond the cores wait on each other at every barrier (a job given 10000 started 10000 threads on 2 cores).

    Raises:
        ValueError: one line naming `field`, the count and the CPUs.
    """
    cpus = usable_cpus()
    if count > cpus:
        raise ValueError(f"{field}: {count} threads, but this process may use {cpus} CPU(s); expected at most {cpus}")
    return count


def render_environment(environment: Mapping[str, Scalar]) -> dict[str, str]:
    """`{name: str(value)}` with None -> "" (the values a process sees); keys and order unchanged."""
    return {name: "" if value is None else str(value) for name, value in environment.items()}


@contextlib.contextmanager
def job_environment(environment: Mapping[str, Scalar]) -> Iterator[dict[str, str]]:
    """Export `environment` (rendered by `render_environment`) into `os.environ` for the block's duration.

    Yields the rendered mapping. On exit every touched variable gets its previous value back (or is removed when
    it was unset before), even when the block raises.
    """
    rendered = render_environment(environment)
    previous = {name: os.environ.get(name) for name in rendered}
    os.environ.update(rendered)
    try:
        yield rendered
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def log_level(text: Optional[str]) -> Optional[int]:
    """The `logging` level named by `text` (a level name in any case, or an integer); None for None or "".

    Raises:
        ValueError: one line naming ASTR_LOG_LEVEL and the accepted names.
    """
    if text is None or not text.strip():
        return None
    name = text.strip().upper()
    if name in _LEVELS:
        return getattr(logging, name)
    if name.lstrip("-").isdigit():
        return int(name)
    raise ValueError(f"{LOG_LEVEL_VAR}: expected one of {', '.join(_LEVELS)} or a number, got {text!r}")


class _StderrHandler(logging.StreamHandler):
    """A stream handler writing to whatever `sys.stderr` is at emit time (it may be replaced after setup), through
    `tqdm.write`: a progress bar on the terminal is cleared first and redrawn below the line, as the command line's
    warnings are written."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # logging's contract: a failing handler reports itself, never raises
            self.handleError(record)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it; the property always wins
        pass


def configure_logging(level: Optional[int]) -> None:
    """Set the `astrai` logger to `level` (None: leave it unset) and give it one stderr handler if it has none."""
    root = logging.getLogger("astrai")
    if level is not None:
        root.setLevel(level)
    if not root.handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter(_FORMAT))
        root.addHandler(handler)


@contextlib.contextmanager
def job_runtime(environment: Mapping[str, Scalar]) -> Iterator[dict[str, str]]:
    """`job_environment(environment)`, then the `astrai` log level from `ASTR_LOG_LEVEL`; both undone on exit.

    Raises:
        ValueError: for an unknown ASTR_LOG_LEVEL (nothing is left exported).
    """
    root = logging.getLogger("astrai")
    old_level = root.level
    with job_environment(environment) as rendered:
        configure_logging(log_level(os.environ.get(LOG_LEVEL_VAR)))
        if rendered:
            logger.debug("runtime.environment exported: %s", ", ".join(sorted(rendered)))
        try:
            yield rendered
        finally:
            root.setLevel(old_level)


_ANNOUNCED_OPS: set[str] = set()


def announce_deepspeed_op_build(deepspeed) -> Optional[str]:
    """Before the first `deepspeed.initialize`: when DeepSpeed is about to JIT-compile its communication op (the
    shared-memory op of the CPU accelerator, `ShareMemCommBuilder`; about 2 minutes, once per machine, cached by
    `torch.utils.cpp_extension` under TORCH_EXTENSIONS_DIR), print one line saying so and where it is cached, on
    local rank 0, once per process. Returns the line (None when nothing will be compiled: no such op on this
    accelerator, prebuilt, or already in the cache)."""
    from pathlib import Path

    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or builder.name in _ANNOUNCED_OPS or installed_ops.get(builder.name, False):
        return None
    if not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return None
    from torch.utils import cpp_extension

    try:
        directory = Path(cpp_extension._get_build_directory(builder.name, verbose=False))
    except Exception:  # noqa: BLE001 - a private helper; its parent is the documented cache root
        directory = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root(), builder.name)
    _ANNOUNCED_OPS.add(builder.name)
    if (directory / f"{builder.name}.so").is_file():
        return None
    line = (f"compiling a DeepSpeed op once ({builder.name}), ~2 min; cached in {directory} "
            "(set TORCH_EXTENSIONS_DIR to keep it elsewhere)")
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(line, flush=True)
    return line
