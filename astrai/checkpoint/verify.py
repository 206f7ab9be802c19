"""Full verification of one checkpoint directory (what `python -m astrai.checkpoint verify` runs)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from astrai.checkpoint.manifest import (
    MANIFEST_NAME,
    POLICY_FILES,
    CheckpointError,
    FileStatus,
    NotACheckpointError,
    check_files,
    declared_required_files,
    list_files,
    read_manifest,
)
from astrai.train_types import legacy_required_files

EXIT_OK, EXIT_FAILED, EXIT_NOT_A_CHECKPOINT = 0, 1, 2


@dataclass
class VerifyReport:
    """Outcome of `verify_checkpoint`.

    Attributes:
        path: the directory checked.
        kind: "manifest", "legacy" (no manifest; files listed as UNVERIFIED) or "not_checkpoint".
        statuses: one FileStatus per file (OK, MISMATCH, MISSING, UNSAFE, EXTRA, UNVERIFIED).
        error: why the directory is not a (valid) checkpoint, when it is not.
        train_type: recorded train type, when known.
    """

    path: Path
    kind: str
    statuses: list[FileStatus] = field(default_factory=list)
    error: str = ""
    train_type: str | None = None

    @property
    def exit_code(self) -> int:
        """0 all files match, 1 any failure (mismatch, missing, unsafe, invalid manifest), 2 not a checkpoint."""
        if self.kind == "not_checkpoint":
            return EXIT_NOT_A_CHECKPOINT
        if self.error or any(s.failed for s in self.statuses):
            return EXIT_FAILED
        return EXIT_OK

    def lines(self) -> list[str]:
        """One line per file: `<STATUS> <name>[  (<detail>)]`, then the error line when there is one."""
        out = [f"{s.status:<10} {s.name}" + (f"  ({s.detail})" if s.detail and s.status != "OK" else "")
               for s in self.statuses]
        if self.error:
            out.append(f"{'INVALID' if self.kind != 'not_checkpoint' else 'NOT-CKPT':<10} {self.error}")
        return out


def verify_checkpoint(path: str | Path, *, require_complete: bool = False) -> VerifyReport:
    """Check every file of a checkpoint against its manifest (size and sha256).

    With `require_complete`, every file of the parts the checkpoint needs to resume must also be listed
    (`manifest.declared_required_files`: the parts its manifest records as required; for an online_ppo
    checkpoint these include the critic extras `value_model.pt` and `value_optimizer.pt`); absent ones are
    reported as MISSING. A legacy directory (no manifest, policy files present) reports its files as UNVERIFIED
    and its missing required files as MISSING. Never raises for a bad checkpoint; the report says what is wrong.
    """
    path = Path(path)
    if not path.is_dir():
        return VerifyReport(path, "not_checkpoint", error=f"{path} is not a directory")
    try:
        manifest = read_manifest(path)
    except NotACheckpointError as exc:
        return VerifyReport(path, "not_checkpoint", error=str(exc))
    except CheckpointError as exc:
        return VerifyReport(path, "manifest", [FileStatus(MANIFEST_NAME, "MISMATCH", str(exc))], error=str(exc))
    if manifest is None:
        return _verify_legacy(path, require_complete)
    report = VerifyReport(path, "manifest", check_files(path, manifest, hashes=True),
                          train_type=manifest.get("train_type"))
    if require_complete:
        for name in declared_required_files(manifest):
            if name not in manifest["files"]:
                report.statuses.append(FileStatus(name, "MISSING", f"required by this {report.train_type or 'astrai'}"
                                                                   f" checkpoint, not in the manifest"))
    return report


def _verify_legacy(path: Path, require_complete: bool) -> VerifyReport:
    present = list_files(path)
    if not any(n in present for n in POLICY_FILES):
        return VerifyReport(path, "not_checkpoint", error=f"{path}: no {MANIFEST_NAME} and no policy files")
    train_type = None
    try:
        train_type = json.loads((path / "trainer_state.json").read_text(encoding="utf-8")).get("train_type")
    except (OSError, ValueError, AttributeError):
        pass
    statuses = [FileStatus(n, "UNVERIFIED", "legacy checkpoint: no manifest") for n in present]
    required = list(POLICY_FILES)
    if require_complete:
        required += legacy_required_files(train_type)
    statuses += [FileStatus(n, "MISSING", "required file") for n in required if n not in present]
    return VerifyReport(path, "legacy", statuses, train_type=train_type)
