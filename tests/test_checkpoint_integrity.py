"""A run's checkpoints are never silently damaged, skipped or used damaged (trial findings of 2026-12-06):
`recover` beside a running job, a publish whose staged files vanished, `resume auto` over damaged checkpoints
only, and loaders (`export`, `evaluate`, `serve`, `model.path`) of a checkpoint whose files changed."""

import json
import os
import stat
import subprocess
import sys

import pytest

from astrai.checkpoint import CheckpointError, checkpoints_root, publish_checkpoint
from astrai.checkpoint import publish as publish_module
from astrai.checkpoint.layout import mark_bad
from astrai.checkpoint.lock import OutputDirLock
from astrai.trainer.runs import resolve_run
from test_checkpoint import make_objects, parts_of


@pytest.fixture(scope="module")
def objects():
    return make_objects(critic=False)


def publish(output_dir, step, objects, run_id="run-a"):
    return publish_checkpoint(output_dir, step, parts_of(objects, step), metadata={"policy_version": step},
                              run_id=run_id)


def cli(*args):
    return subprocess.run([sys.executable, "-m", "astrai.checkpoint", *map(str, args)], capture_output=True,
                          text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))


def flip_byte(path, offset=-100):
    with open(path, "r+b") as f:
        f.seek(offset, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_recover_refuses_while_a_job_holds_the_output_dir(tmp_path):
    """`python -m astrai.checkpoint recover` deleted the staging directory of a running job's checkpoint (the job
    then published a checkpoint of its manifest alone): it now takes the job's lock first and refuses while a job
    holds it, deleting nothing."""
    staging = checkpoints_root(tmp_path) / ".step-00000003.staging-abc"
    staging.mkdir(parents=True)
    lock = OutputDirLock(tmp_path)
    lock.acquire("run-a")
    try:
        result = cli("recover", tmp_path)
    finally:
        lock.release()
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("error: train.output_dir ") and "in use by another job" in result.stderr
    assert len(result.stderr.splitlines()) == 1 and staging.is_dir() and result.stdout == ""
    (tmp_path / "train.lock").write_text(json.dumps({"host": "h", "pid": 999999, "run_id": "run-a"}))  # a kill
    result = cli("recover", tmp_path)
    assert result.returncode == 0, result.stderr
    said, deleted = result.stdout.splitlines()
    assert said.startswith(f"train.lock: the previous job in {tmp_path}, run run-a (pid 999999 on host h") and \
        said.endswith("ended without releasing its lock (killed or crashed)")
    assert deleted == "deleted .step-00000003.staging-abc"
    assert not staging.exists() and not (tmp_path / "train.lock").exists()  # the lock taken and released


def test_checkpoint_commands_name_a_missing_output_dir_and_warn_in_one_line(tmp_path, objects):
    missing = tmp_path / "nope"
    for command in ("recover", "latest"):
        result = cli(command, missing)
        assert result.returncode == 2, (command, result.stderr)
        assert result.stderr == f"error: {missing}: no such directory\n", command
    assert not missing.exists()
    path = publish(tmp_path, 1, objects)
    mark_bad(path, "diverged")
    result = cli("latest", tmp_path)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [f"warning: skipping {path}: marked bad (diverged)",
                                          f"no complete checkpoint under {checkpoints_root(tmp_path)}"]


def test_a_publish_whose_staged_files_vanish_is_refused(tmp_path, objects, monkeypatch):
    """Files deleted from the staging directory while the checkpoint was written (another process) were published
    as a checkpoint whose manifest lists them: the publish now checks the staged files first and fails in one line
    naming them, and nothing is published."""
    real = publish_module.write_manifest

    def deleting(directory, fields, *, known=None):
        (directory / "optimizer.pt").unlink()
        return real(directory, fields, known=known)

    monkeypatch.setattr(publish_module, "write_manifest", deleting)
    with pytest.raises(CheckpointError, match=r"optimizer.pt.*vanished from its staging directory"):
        publish(tmp_path, 2, objects)
    assert sorted(p.name for p in checkpoints_root(tmp_path).iterdir()) == []


def test_resume_auto_refuses_when_every_checkpoint_of_the_run_is_damaged(tmp_path, objects):
    """With its only checkpoint truncated (sizes) or its manifest unreadable, `resume auto` started the run afresh
    (the checkpoint warned about, or counted as another run's); a changed byte (sha256) was refused at load. Both
    are refused now, in one line naming the checkpoints and the way out; an intact earlier checkpoint is still
    resumed, and a checkpoint marked bad is skipped as documented."""
    (tmp_path / "run.json").write_text(json.dumps({"run_id": "run-a"}))
    first = publish(tmp_path, 1, objects)
    second = publish(tmp_path, 2, objects)
    with open(second / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    with pytest.warns(UserWarning, match="skipping"):
        assert resolve_run("auto", tmp_path, overwrite=False, dist=None) == (first, "run-a")
    (first / "manifest.json").write_text("{not json")
    with pytest.warns(UserWarning, match="skipping"), pytest.raises(CheckpointError) as err:
        resolve_run("auto", tmp_path, overwrite=False, dist=None)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"checkpoint.resume auto: {tmp_path} holds no intact "
                                                      "checkpoint of run run-a, only 2 damaged")
    assert "step-00000002 (model.safetensors: MISMATCH" in message and "step-00000001 (" in message
    assert "python -m astrai.checkpoint verify" in message and "--checkpoint.resume none --overwrite_output_dir true" \
        in message
    assert resolve_run("none", tmp_path, overwrite=True, dist=None)[0] is None  # the way out it names
    for path in (first, second):  # nothing was changed on disk
        assert path.is_dir()
    (tmp_path / "other").mkdir()
    other = publish(tmp_path / "other", 1, objects, run_id="run-b")  # another run's damaged checkpoint: not ours
    with open(other / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    (tmp_path / "other" / "run.json").write_text(json.dumps({"run_id": "run-c"}))
    assert resolve_run("auto", tmp_path / "other", overwrite=False, dist=None)[0] is None


def test_resume_auto_leaves_out_a_damaged_checkpoint_of_an_older_run(tmp_path, objects):
    """A damaged checkpoint whose manifest names no run (written before run ids) is no more the current run's than
    an intact one (resume auto skips both): a restarted launch, which resumes auto, is not refused for it (review)."""
    (tmp_path / "run.json").write_text(json.dumps({"run_id": "run-a"}))
    old = publish(tmp_path, 5, objects, run_id=None)
    with open(old / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    assert resolve_run("auto", tmp_path, overwrite=False, dist=None) == (None, "run-a")


def test_resume_auto_skips_a_checkpoint_marked_bad(tmp_path, objects):
    (tmp_path / "run.json").write_text(json.dumps({"run_id": "run-a"}))
    mark_bad(publish(tmp_path, 1, objects), "diverged")
    with pytest.warns(UserWarning, match="marked bad"):
        assert resolve_run("auto", tmp_path, overwrite=False, dist=None)[0] is None


def test_loading_a_checkpoint_whose_model_files_changed_is_refused(tmp_path, objects):
    """export, evaluate and serve loaded the weights of a checkpoint with a changed byte (resume refused it): what
    loads a checkpoint as a model checks the files it reads against the manifest first (sha256), one line naming
    the file; the training state (*.pt) is not read, so a missing optimizer does not stop an export."""
    from astrai.checkpoint import ModelFilesError, check_model_files

    path = publish(tmp_path, 1, objects)
    (path / "optimizer.pt").unlink()
    check_model_files(path)  # the model files are intact
    check_model_files(tmp_path / "no-such-dir")  # not a checkpoint: nothing to check (the loader says the rest)
    flip_byte(path / "model.safetensors")
    with pytest.raises(ModelFilesError) as err:
        check_model_files(path)
    assert isinstance(err.value, ValueError)  # caught where the loaders' other one-line refusals are
    assert str(err.value).startswith(f"{path}: checkpoint failed verification: model.safetensors: MISMATCH (sha256")
    assert "python -m astrai.checkpoint verify" in str(err.value) and "\n" not in str(err.value)
    result = cli("export", path, tmp_path / "out")
    assert result.returncode == 2 and "model.safetensors: MISMATCH" in result.stderr
    assert not (tmp_path / "out").exists()
    evaluated = subprocess.run([sys.executable, "-m", "astrai.evaluate", "--model", str(path), "--data",
                                "builtin:arithmetic_test", "--limit", "1", "--output_dir", str(tmp_path / "eval")],
                               capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert evaluated.returncode == 2 and evaluated.stderr.splitlines()[-1].startswith(
        f"error: {path}: checkpoint failed verification: model.safetensors: MISMATCH"), evaluated.stderr
    (path / "manifest.json").write_text("{not json")
    with pytest.raises(ModelFilesError, match="manifest"):
        check_model_files(path)


def test_only_the_files_a_model_loader_reads_are_checked(tmp_path, objects):
    """The training state (optimizer, counters, RNG, the job's config; a sharded optimizer's directory) is not what
    a model loader reads: a changed byte there does not stop evaluate / serve / export (review); the tokenizer is.
    Without `hashes` (every rank of a job without checkpoint.verify_on_load, --check) sizes are compared only."""
    from astrai.checkpoint import ModelFilesError, check_model_files
    from astrai.checkpoint.load import model_files
    from astrai.checkpoint.manifest import read_manifest

    path = publish(tmp_path, 1, objects)
    listed = model_files(read_manifest(path))
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(listed)
    assert not {"optimizer.pt", "trainer_state.json", "rng_state.pt"} & set(listed)
    for name in ("optimizer.pt", "trainer_state.json"):
        flip_byte(path / name, offset=-2)
    check_model_files(path)
    flip_byte(path / "tokenizer.json", offset=-2)
    check_model_files(path, hashes=False)  # same size: only the sha256 tells
    with pytest.raises(ModelFilesError, match="tokenizer.json: MISMATCH .sha256"):
        check_model_files(path)
    with open(path / "model.safetensors", "r+b") as f:
        f.truncate(100)
    with pytest.raises(ModelFilesError, match="model.safetensors: MISMATCH .100 bytes"):
        check_model_files(path, hashes=False)
    manifest = read_manifest(path)
    manifest["parts"]["optimizer"] = {"kind": "dcp", "per_rank": False, "required": True}
    manifest["files"]["optimizer/__0_0.distcp"] = {"sha256": "0" * 64, "bytes": 1}
    assert "optimizer/__0_0.distcp" not in model_files(manifest)


def test_export_writes_readable_files_and_names_a_blocking_file(tmp_path, objects):
    path = publish(tmp_path, 1, objects)
    old = os.umask(0o022)
    try:
        result = cli("export", path, tmp_path / "exported")
    finally:
        os.umask(old)
    assert result.returncode == 0, result.stderr
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "exported").iterdir()}
    assert modes["model.safetensors"] == 0o644 and set(modes.values()) == {0o644}, modes
    (tmp_path / "afile").write_text("x")
    result = cli("export", path, tmp_path / "afile" / "out")
    assert result.returncode == 2
    assert result.stderr == (f"error: export: {tmp_path / 'afile'} is a file, not a directory; name an output "
                             f"directory whose parents are directories\n")


def test_checkpoint_commands_name_wrong_paths_and_take_a_mark_back(tmp_path, objects):
    """Trial (helper-57): a file or a checkpoint folder given where an output directory is asked for, a missing
    directory to mark or export, an empty reason, no way to take a mark back, `recover` silent on a clean
    directory, and a legacy checkpoint called OK by verify."""
    path = publish(tmp_path, 1, objects)
    for args, line in [(("latest", path / "config.json"), f"{path / 'config.json'}: a file, not a directory"),
                       (("latest", path), f"{path}: a checkpoint folder; latest takes the run's output directory "
                                          f"(train.output_dir: {tmp_path})"),
                       (("recover", checkpoints_root(tmp_path)), f"{checkpoints_root(tmp_path)}: a checkpoint folder; "
                                                                 f"recover takes the run's output directory "
                                                                 f"(train.output_dir: {tmp_path})"),
                       (("mark-bad", tmp_path / "nope", "--reason", "x"), f"{tmp_path / 'nope'}: no such directory"),
                       (("export", tmp_path / "nope", tmp_path / "out"), f"{tmp_path / 'nope'}: no such directory"),
                       (("mark-bad", path, "--reason", " "), "--reason: expected a non-empty text saying why (or "
                                                             "--clear to take a mark back)")]:
        result = cli(*args)
        assert (result.returncode, result.stderr) == (2, f"error: {line}\n"), args
    assert cli("recover", tmp_path).stdout == f"{tmp_path}: nothing to recover\n"
    assert cli("mark-bad", path, "--reason", "diverged").returncode == 0
    assert cli("latest", tmp_path).returncode == 1
    result = cli("mark-bad", path, "--clear")
    assert result.returncode == 0 and "mark taken back" in result.stdout
    assert cli("latest", tmp_path).stdout.strip() == str(path)
    (path / "manifest.json").unlink()
    result = cli("verify", path)
    assert result.returncode == 0 and result.stderr.strip().endswith("UNVERIFIED (no manifest.json: its files cannot "
                                                                     "be checked; it loads only by its path)")
