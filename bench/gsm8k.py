"""The GSM8K test split the peer benchmarks read: its default place and its first records.

`DEFAULT` is `shared/data/gsm8k/test.jsonl` in the nearest directory above the repository that has it (`../shared`
beside the checkout; a git worktree deeper down finds the one above it), else `../shared/...` (missing: the
scripts then stop with their own message).
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

from astrai.data.files import DataError, jsonl_objects

ROOT = Path(__file__).resolve().parents[1]
RELATIVE = Path("shared", "data", "gsm8k", "test.jsonl")
DEFAULT = next((p / RELATIVE for p in ROOT.parents if (p / RELATIVE).is_file()), ROOT.parent / RELATIVE)


def first_records(data: Path, count: int, needed_for: str) -> list[dict]:
    """The first `count` records (non-blank lines, parsed by astrai's own `jsonl_objects`) of the jsonl file
    `data`; exits with a one-line message naming the file when it holds fewer (`needed_for` says why that many are
    needed) or a line is not a JSON object (the line named by number)."""
    try:
        records = [obj for _, obj in itertools.islice(jsonl_objects(Path(data)), count)]
    except DataError as err:
        sys.exit(str(err))
    if len(records) < count:
        sys.exit(f"{data} holds {len(records)} records; {count} are needed ({needed_for})")
    return records
