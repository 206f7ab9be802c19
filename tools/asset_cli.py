"""The command line every asset generator in tools/ shares: write the asset, or with ``--check`` verify it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable


def render_jsonl(records: list[dict]) -> str:
    """Serialise records as jsonl text (one object per line, non-ASCII kept, trailing newline)."""
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def asset_main(argv: list[str] | None, *, description: str, output: Path, script: str,
               make_text: Callable[[], str], noun: str) -> int:
    """Parse ``--output PATH`` and ``--check``; write ``make_text()`` to the output (printing how many lines of
    `noun` it wrote), or with ``--check`` compare it with the file and say it is stale (exit 1) when they differ.
    Returns the process exit code (0 or 1)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--output", type=Path, default=output)
    parser.add_argument("--check", action="store_true", help="verify the file is up to date; write nothing")
    args = parser.parse_args(argv)
    text = make_text()
    if args.check:
        current = args.output.read_text(encoding="utf-8") if args.output.exists() else None
        if current != text:
            print(f"{args.output} is stale: rerun python tools/{script}", file=sys.stderr)
            return 1
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text, encoding="utf-8")
    print(f"wrote {text.count(chr(10))} {noun} to {args.output}")
    return 0
