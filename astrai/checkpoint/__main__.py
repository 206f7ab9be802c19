"""Command line: `python -m astrai.checkpoint {verify,latest,recover,export,mark-bad} ...`.

    verify [--require-critic] DIR   one line per file (OK / MISMATCH / MISSING / UNSAFE / EXTRA / UNVERIFIED
                                    + name); exit 0 all match, 1 any mismatch or missing file (or, with
                                    --require-critic, a part the checkpoint needs to resume is missing, e.g.
                                    an online_ppo checkpoint without its critic extras), 2 when DIR is not a
                                    checkpoint
    latest OUTPUT_DIR               print the newest complete checkpoint; exit 1 when there is none (each
                                    checkpoint skipped on the way said in a `warning:` line), 2 when
                                    OUTPUT_DIR is not a directory
    recover OUTPUT_DIR              clean up staging/retired/deleting dirs after a crash; prints one line per
                                    action. It takes the job lock of OUTPUT_DIR (train.lock) first: while a
                                    training job holds it, it refuses (exit 2) and deletes nothing
    export [--merge] DIR OUT        write DIR's model (a LoRA checkpoint: its adapters merged into the base
                                    model, which --merge states explicitly) as a new Hugging Face model
                                    directory OUT; exit 2 on bad input
    mark-bad DIR --reason TEXT      record in DIR's manifest that it is bad: `resume auto`, `latest` and
                                    keep_last skip it from then on (its files stay; exit 2 when DIR has no manifest)
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Sequence

from astrai.checkpoint.layout import CheckpointWarning, find_latest_checkpoint, mark_bad, recover
from astrai.checkpoint.manifest import CheckpointError
from astrai.checkpoint.verify import verify_checkpoint


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m astrai.checkpoint", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    verify = commands.add_parser("verify", help="check every file of a checkpoint against its manifest")
    verify.add_argument("--require-critic", "--require-complete", dest="require_complete", action="store_true",
                        help="also require every part the checkpoint needs to resume (for online_ppo: the critic "
                             "and its optimizer, value_model.pt and value_optimizer.pt)")
    verify.add_argument("dir")
    latest = commands.add_parser("latest", help="print the newest complete checkpoint of an output dir")
    latest.add_argument("output_dir")
    latest.add_argument("--hashes", action="store_true", help="also check sha256 of every candidate")
    rec = commands.add_parser("recover", help="clean up after a crash (no training may be running)")
    rec.add_argument("output_dir")
    export = commands.add_parser("export", help="write a checkpoint's model (LoRA: merged) as a Hugging Face directory")
    export.add_argument("--merge", action="store_true",
                        help="merge LoRA adapters into the base model (W + s B A); what export always does with a "
                             "LoRA checkpoint, accepted to say so")
    export.add_argument("--base", default=None, help="the base model (default: the adapter config's)")
    export.add_argument("dir")
    export.add_argument("out")
    bad = commands.add_parser("mark-bad", help="mark a checkpoint bad: resume auto and retention skip it")
    bad.add_argument("dir")
    bad.add_argument("--reason", required=True, help="why (recorded in the manifest as 'bad')")
    args = parser.parse_args(argv)
    if args.command == "mark-bad":
        try:
            mark_bad(Path(args.dir), args.reason)
        except CheckpointError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        print(f"{args.dir}: marked bad ({args.reason}); --checkpoint.resume auto now skips it")
        return 0
    if args.command == "verify":
        report = verify_checkpoint(args.dir, require_complete=args.require_complete)
        for line in report.lines():
            print(line)
        verdict = {0: "OK", 1: "FAILED", 2: "NOT A CHECKPOINT"}[report.exit_code]
        print(f"{args.dir}: {verdict}", file=sys.stderr)
        return report.exit_code
    if args.command in ("latest", "recover") and not Path(args.output_dir).is_dir():
        print(f"error: {args.output_dir}: no such directory", file=sys.stderr)
        return 2
    if args.command == "latest":
        with warnings.catch_warnings(record=True) as skipped:
            warnings.simplefilter("always", CheckpointWarning)
            path = find_latest_checkpoint(args.output_dir, hashes=args.hashes)
        for warning in skipped:
            print(f"warning: {warning.message}", file=sys.stderr)
        if path is None:
            print(f"no complete checkpoint under {args.output_dir}/checkpoints", file=sys.stderr)
            return 1
        print(path)
        return 0
    if args.command == "export":
        from astrai.checkpoint.export import export_merged

        try:
            print(export_merged(args.dir, args.out, base=args.base))
        except (CheckpointError, FileNotFoundError, ValueError, OSError) as err:
            print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
            return 2
        return 0
    return _recover(Path(args.output_dir))


def _recover(output_dir: Path) -> int:
    """`recover` under the job lock of `output_dir` (`astrai.checkpoint.lock`), so it never deletes the staging
    directory of a checkpoint a running job is writing."""
    from astrai.outputs import OutputWriteError
    from astrai.checkpoint.lock import OutputDirLock, OutputDirLocked

    lock = OutputDirLock(output_dir)
    try:
        previous = lock.acquire(None)
    except (OutputDirLocked, OutputWriteError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if previous is not None:  # the job that crashed there: what recover cleans up after
        print(previous.replace("; this job takes over", ""))
    try:
        for action in recover(output_dir):
            print(action)
    finally:
        lock.release()
    return 0


if __name__ == "__main__":
    from astrai.outputs import show_warning

    warnings.showwarning = show_warning  # "warning: MESSAGE" in one line, as python -m astrai.train says them
    sys.exit(main())
