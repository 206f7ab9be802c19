"""The GSM8K test split the peer benchmarks read: its default place and its first records.

`DEFAULT` is `shared/data/gsm8k/test.jsonl` in the nearest directory above the repository that has it (`../shared`
beside the checkout; a git worktree deeper down finds the one above it), else `../shared/...` (missing: the
scripts then stop with their own message).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RELATIVE = Path("shared", "data", "gsm8k", "test.jsonl")
DEFAULT = next((p / RELATIVE for p in ROOT.parents if (p / RELATIVE).is_file()), ROOT.parent / RELATIVE)


def first_records(data: Path, count: int, needed_for: str) -> list[dict]:
    """The first `count` records (non-blank lines, parsed) of the jsonl file `data`; exits with a one-line message
    naming the file when it holds fewer (`needed_for` says why that many are needed) or a line is not JSON."""
    records = []
    with open(data, encoding="utf-8") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                sys.exit(f"{data} line {number}: invalid JSON: {err.msg}")
            if len(records) == count:
                break
    if len(records) < count:
        sys.exit(f"{data} holds {len(records)} records; {count} are needed ({needed_for})")
    return records
