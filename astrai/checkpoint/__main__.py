"""Command line: `python -m astrai.checkpoint {verify,latest,recover,export,mark-bad} ...`.

    verify [--require-critic] DIR   one line per file (OK / MISMATCH / MISSING / UNSAFE / EXTRA / UNVERIFIED
                                    + name); exit 0 all match (a legacy checkpoint without a manifest: 0,
                                    every file UNVERIFIED), 1 any mismatch or missing file (or, with
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
                                    keep_last skip it from then on (its files stay; exit 2 when DIR has no
                                    readable manifest); `--clear` takes the mark back
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Sequence

from astrai.checkpoint.layout import CheckpointWarning, find_latest_checkpoint, mark_bad, parse_step, recover
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
    bad.add_argument("--reason", help="why (recorded in the manifest as 'bad'); required unless --clear")
    bad.add_argument("--clear", action="store_true",
                     help="take the mark back: resume auto and retention count it again")
    args = parser.parse_args(argv)
    problem = _bad_path(args)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.command == "mark-bad":
        if not args.clear and not (args.reason or "").strip():
            print("error: --reason: expected a non-empty text saying why (or --clear to take a mark back)",
                  file=sys.stderr)
            return 2
        try:
            mark_bad(Path(args.dir), None if args.clear else args.reason)
        except CheckpointError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        print(f"{args.dir}: mark taken back; --checkpoint.resume auto counts it again" if args.clear else
              f"{args.dir}: marked bad ({args.reason}); --checkpoint.resume auto now skips it")
        return 0
    if args.command == "verify":
        report = verify_checkpoint(args.dir, require_complete=args.require_complete)
        for line in report.lines():
            print(line)
        verdict = {0: "OK", 1: "FAILED", 2: "NOT A CHECKPOINT"}[report.exit_code]
        if report.kind == "legacy" and report.exit_code == 0:
            verdict = "UNVERIFIED (no manifest.json: its files cannot be checked; it loads only by its path)"
        print(f"{args.dir}: {verdict}", file=sys.stderr)
        return report.exit_code
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


def _bad_path(args: argparse.Namespace) -> str | None:
    """The one line for a path argument that is missing or of the wrong kind (a file, a checkpoint given where its
    output directory is asked for), else None."""
    given = args.output_dir if args.command in ("latest", "recover") else args.dir
    path = Path(given)
    if not path.exists():
        return f"{given}: no such directory"
    if not path.is_dir():
        return f"{given}: a file, not a directory"
    if args.command in ("latest", "recover") and (path.name == "checkpoints" or parse_step(path.name) is not None):
        run = path.parent if path.name == "checkpoints" else path.parent.parent
        return (f"{given}: a checkpoint folder; {args.command} takes the run's output directory (train.output_dir: "
                f"{run})")
    return None


def _recover(output_dir: Path) -> int:
    """`recover` under the job lock of `output_dir` (`astrai.checkpoint.lock`), so it never deletes the staging
    directory of a checkpoint a running job is writing."""
    from astrai.outputs import OutputWriteError
    from astrai.checkpoint.lock import OutputDirLock, OutputDirLocked

    lock = OutputDirLock(output_dir, when_held="wait for it to end or stop it, then run recover again")
    try:
        previous = lock.acquire(None)
    except (OutputDirLocked, OutputWriteError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if previous is not None:  # the job that crashed there: what recover cleans up after
        print(previous)
    try:
        actions = recover(output_dir)
    finally:
        lock.release()
    print("\n".join(actions) if actions else f"{output_dir}: nothing to recover")
    return 0


if __name__ == "__main__":
    from astrai.outputs import show_warning

    warnings.showwarning = show_warning  # "warning: MESSAGE" in one line, as python -m astrai.train says them
    sys.exit(main())
