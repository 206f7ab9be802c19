"""The files astrai writes outside the checkpoint path, how a failed write is said, and the reader of the jsonl ones.

Written beside the checkpoints of `train.output_dir`: metrics.jsonl and completions.jsonl (appended, one record per
line: `astrai.trainer.callbacks.JsonlFile`), TensorBoard event files (`trainer.reporting`), the in-training
evaluation's `eval/step-N.jsonl` (`trainer.evaluation_callback`), config.yaml, run.json (`trainer.runs`), train.lock
(`checkpoint.lock`) and the ranks' token file (`distributed.rank_checks`); elsewhere `python -m astrai.evaluate`'s
results.jsonl and summary.json, `python -m astrai.plot`'s PNG and the policy's copy that `rollout.engine: vllm` loads
from the temporary directory (`rollout.vllm_engine`).

A write that fails (a full disk, a quota, a read-only filesystem, a file-size limit, a permission) is one line
naming the file and the cause (`cannot_write`: `cannot write outputs/run/metrics.jsonl: No space left on device
[Errno 28]`); a training job stops with it on every rank (`OutputWriteError`, exit code 2). No torn
record is left for a reader: jsonl files are appended one whole record per write and cut back to the last whole
record when a write fails; the other files are replaced atomically (`checkpoint.fsutil.write_atomic`), so a reader
sees the old file or the whole new one. A torn last line that a crash still leaves (SIGKILL, a power loss, a
filesystem that fails at fsync) is skipped by every reader, which says so once (`read_jsonl`).

Torch-free: `python -m astrai.plot` reads through it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Callable, Optional

__all__ = ["EXIT_REFUSED", "OutputWriteError", "os_error_cause", "cannot_write", "read_jsonl", "skipped_lines",
           "warn_line", "TRACEBACK_HEADER", "show_warning"]

EXIT_REFUSED = 2
"""The exit code of a job that cannot go on as configured (`astrai.trainer.faults.EXIT_REFUSED`)."""


class OutputWriteError(RuntimeError):
    """A file astrai writes outside its checkpoints could not be written: one line naming the file and the cause
    (`cannot_write`), nothing torn left behind; a training job stops with `exit_code` 2, as for the other faults of
    `astrai.trainer.faults` (`JobFault`).

    A rank that meets it in a callback keeps it until the ranks agree (`Trainer.agree_faults`; the start-up writes
    are carried by a broadcast), so that every rank stops at the same point; `agreed` is then True.
    """

    exit_code = EXIT_REFUSED
    agreed = False

    @classmethod
    def of(cls, path: str | os.PathLike, err: BaseException) -> "OutputWriteError":
        """The fault of writing `path` failing with `err` (an OSError: its strerror and errno)."""
        return cls(cannot_write(path, err))

    @classmethod
    def carried(cls, line: str) -> "OutputWriteError":
        """The fault every rank raises once a collective carried one rank's `line` (`agreed`)."""
        fault = cls(line)
        fault.agreed = True
        return fault


def os_error_cause(err: BaseException) -> str:
    """The cause of an OS error in words with its number, e.g. "No space left on device [Errno 28]"; another
    exception's own first line."""
    if isinstance(err, OSError) and err.errno is not None:
        return f"{err.strerror or os.strerror(err.errno)} [Errno {err.errno}]"
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def cannot_write(path: str | os.PathLike, err: BaseException) -> str:
    """The one line of a failed write: "cannot write PATH: CAUSE [Errno N]"."""
    return f"cannot write {path}: {os_error_cause(err)}"


TRACEBACK_HEADER = "\nTraceback (most recent call last):"
"""Where a warning's text turns into a traceback (a reward function's first failure): printed line by line."""


def show_warning(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ARG001
    """`warnings.showwarning` of astrai's command lines (`python -m astrai.train`, `astrai.evaluate`, `astrai.serve`,
    `astrai.plot`, `astrai.checkpoint`): "warning: MESSAGE", one line, without the file, line number and source
    line of the code that warned (astrai's own code, which says nothing to a user); a traceback that ends the
    message (a user's reward code failing) keeps its lines below it. Written through `tqdm.write`, so a warning met
    while a progress bar is drawn starts on its own line, not after the bar."""
    from tqdm import tqdm  # tqdm.write: a progress bar on the terminal is cleared first and redrawn below

    text, header, trace = str(message).partition(TRACEBACK_HEADER)
    tqdm.write(f"warning: {' '.join(text.split())}" + (f"{header}{trace.rstrip()}" if header else ""),
               file=file or sys.stderr)


def warn_line(line: str) -> None:
    """Print `warning: LINE` to stderr (the default way a reader says what it skipped)."""
    print(f"warning: {line}", file=sys.stderr)


def read_jsonl(path: str | os.PathLike, *, say: Optional[Callable[[str], None]] = warn_line) -> list[dict]:
    """The JSON objects of a jsonl file astrai wrote (metrics.jsonl, completions.jsonl, eval answers, results),
    in order.

    Blank lines are ignored. A torn last line (cut off while it was written, by a crash or a full disk: no newline
    and not JSON) is skipped, and so is any other line that is not one JSON object (bad bytes included); what was
    skipped is said once, in one line, through `say` (None: silently).

    Raises:
        OSError: the file cannot be read (FileNotFoundError when it does not exist).
    """
    path = Path(path)
    data = path.read_bytes()
    lines = data.split(b"\n")
    records, bad, last = [], [], 0
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        last = number
        try:
            record = json.loads(raw.decode("utf-8"))
        except ValueError:  # UnicodeDecodeError is a ValueError too
            record = None
        if isinstance(record, dict):
            records.append(record)
        else:
            bad.append(number)
    if bad and say is not None:
        say(skipped_lines(path, bad, last=last))
    return records


def skipped_lines(path: Path, numbers: list[int], *, last: int) -> str:
    """The one line a reader says about the lines of `path` it skipped (`numbers`, 1-based; `last`: the number of
    the file's last non-empty line)."""
    torn = numbers[-1] == last
    others = numbers[:-1] if torn else numbers
    parts = []
    if torn:
        parts.append(f"skipped its torn last line (line {last}: cut off while it was written, by a crash or a full "
                     "disk)")
    if others:
        many = len(others) > 1
        parts.append(f"skipped {len(others)} line{'s' if many else ''} that {'are' if many else 'is'} not one JSON "
                     f"object (line{'s' if many else ''} {', '.join(map(str, others[:5]))}"
                     f"{' ...' if len(others) > 5 else ''})")
    return f"{path}: " + "; ".join(parts)
