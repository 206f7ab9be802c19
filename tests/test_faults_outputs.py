"""Issue 42 class 7, the files astrai writes outside the checkpoint path: a write that fails (a full disk, a file-size
limit, a path in the way) is one line naming the file and the cause with exit code 2, at one process and at two
ranks under the launch scripts (whose output ends with that line, with no `ChildFailedError` report); no torn record
is left, and the readers skip a torn last line, saying so once; bad text in data (a lone surrogate in valid JSON) is
refused in one line naming the file and the row.

Real failures where they are cheap: a file-size limit (`RLIMIT_FSIZE`, in a child process: the kernel writes part of
a record, then refuses with EFBIG, as a filling disk does with ENOSPC) and a directory where a file should go
(EISDIR). The in-process ones raise ENOSPC from the write that reaches the file (os.write, os.fsync, TensorBoard's
file system)."""

import errno
import json
import os
import resource
import subprocess
import sys
import time
import types

import pytest
import torch
from fault_jobs import LAUNCH, REPO, free_port, sft_args, steps_of, write_chats
from spawn_ranks import spawn_ranks

from astrai import outputs
from astrai.data import DataError
from astrai.outputs import OutputWriteError, read_jsonl
from astrai.train import main

ENOSPC = "No space left on device [Errno 28]"
EFBIG = "File too large [Errno 27]"
EISDIR = "Is a directory [Errno 21]"


@pytest.fixture
def chats(tmp_path):
    return write_chats(tmp_path / "chats.jsonl")


def one_error_line(err: str) -> str:
    """The job's single `error:` line, asserting that there is one and no traceback."""
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err and "Exception in thread" not in err, err[-3000:]
    return lines[0]


def assert_whole_records(path):
    """Every line of a jsonl file is one whole JSON object and the file ends with a newline (or is empty)."""
    data = path.read_bytes()
    assert data == b"" or data.endswith(b"\n"), data[-200:]
    for line in data.decode().splitlines():
        assert isinstance(json.loads(line), dict)


def limited(limit: int):
    """A `preexec_fn` giving the child a file-size limit of `limit` bytes (EFBIG past it; Python ignores SIGXFSZ)."""
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


# ------------------------------------------------------------------------------------------------- metrics.jsonl
def test_a_full_disk_while_appending_metrics_is_one_line_and_no_torn_record(tiny_model_dir, chats, tmp_path):
    """config.yaml (~3 KB) fits under a 4000-byte limit, metrics.jsonl (~280 bytes a record) meets it at about step
    14: the kernel writes part of that record, then refuses; the job ends in one line, exit 2, the file whole."""
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "astrai.train", *sft_args(
        tiny_model_dir, out, chats, "--max_steps", 40, "--train.report_to", "none", "--checkpoint.save_at_end",
        "false")], cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=300, preexec_fn=limited(4000))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert one_error_line(proc.stderr) == f"error: cannot write {out / 'metrics.jsonl'}: {EFBIG}"
    assert_whole_records(out / "metrics.jsonl")
    steps = steps_of(out)
    assert steps == list(range(1, len(steps) + 1)) and 5 < len(steps) < 40
    assert not (out / "train.lock").exists()  # released: the next job starts


def test_the_jsonl_file_cuts_a_record_the_disk_refused_back_and_takes_no_more(tmp_path):
    """`JsonlFile` itself under a file-size limit (a child process): the record that crosses it is written in part by
    the kernel and cut back; the fault names the file; later writes are no-ops."""
    script = f"""
import json, resource, sys
from astrai.trainer.callbacks import JsonlFile
from astrai.outputs import OutputWriteError
f = JsonlFile({str(tmp_path / 'completions.jsonl')!r}, printer=print)
f.open()
resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))
for step in range(1, 100):
    try:
        f.write({{"step": step, "completion": "x" * 150}})
    except OutputWriteError as err:
        print("FAULT", step, err)
        break
f.write({{"step": 999}})
f.close()
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"FAULT 6 cannot write {tmp_path / 'completions.jsonl'}: {EFBIG}"
    assert_whole_records(tmp_path / "completions.jsonl")
    assert [r["step"] for r in read_jsonl(tmp_path / "completions.jsonl")] == [1, 2, 3, 4, 5]


def full_disk_for(monkeypatch, name: str, *, after: int = 1) -> None:
    """`os.write` to the file called `name` fills the disk: `after` writes go through, the next writes half of its
    bytes, then every write fails with ENOSPC."""
    real = os.write
    count = [0]

    def write(fd, data):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if os.path.basename(target) != name:
            return real(fd, data)
        count[0] += 1
        if count[0] <= after:
            return real(fd, data)
        if count[0] == after + 1 and len(data) > 1:
            return real(fd, bytes(data[:len(data) // 2]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", write)


def test_a_full_disk_while_logging_completions_is_one_line(tiny_model_dir, tmp_path, monkeypatch, capfd):
    from test_completions_log import grpo_job

    job, out = grpo_job(tmp_path, log_completions=2, max_steps=3)
    full_disk_for(monkeypatch, "completions.jsonl", after=2)
    assert main(["--config", str(job), "--model.path", str(tiny_model_dir), "--train.report_to", "none"]) == 2
    assert one_error_line(capfd.readouterr().err) == f"error: cannot write {out / 'completions.jsonl'}: {ENOSPC}"
    assert_whole_records(out / "completions.jsonl")
    assert [r["step"] for r in read_jsonl(out / "completions.jsonl")] == [1, 1]
    assert not (out / "train.lock").exists()


# ------------------------------------------------------------------------------------------- TensorBoard events
def test_a_full_disk_for_the_tensorboard_events_is_one_line(tiny_model_dir, chats, tmp_path, monkeypatch, capfd):
    """TensorBoard writes in a thread of its own: its failure is said once, by the step that finds it, naming the
    event file; the thread prints no traceback."""
    pytest.importorskip("tensorboard")
    from tensorboard.compat.tensorflow_stub.io import gfile

    out = tmp_path / "run"
    real = gfile.LocalFileSystem.append
    calls = [0]

    def append(self, filename, file_content, binary_mode=False):
        calls[0] += 1
        if calls[0] > 20:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, filename, file_content, binary_mode)

    monkeypatch.setattr(gfile.LocalFileSystem, "append", append)
    assert main(sft_args(tiny_model_dir, out, chats, "--max_steps", 10, "--train.report_to", "tensorboard")) == 2
    line = one_error_line(capfd.readouterr().err)
    (events,) = out.glob("events.out.tfevents.*")
    assert line == f"error: cannot write {events}: {ENOSPC}"
    assert_whole_records(out / "metrics.jsonl")


# -------------------------------------------------------------- files written once: config.yaml, run.json, lock
@pytest.mark.parametrize("name", ["config.yaml", "run.json", "train.lock"])
def test_a_path_in_the_way_of_a_run_file_is_one_line(tiny_model_dir, chats, tmp_path, capfd, name):
    """A directory where the job writes config.yaml, run.json or the lock (EISDIR, as a read-only filesystem or a
    full disk would refuse the write): one line naming it, exit 2, the lock released, no hidden temporary file."""
    out = tmp_path / "run"
    (out / name).mkdir(parents=True)
    assert main(sft_args(tiny_model_dir, out, chats, "--max_steps", 2, "--train.report_to", "none")) == 2
    assert one_error_line(capfd.readouterr().err) == f"error: cannot write {out / name}: {EISDIR}"
    left = {p.name for p in out.iterdir()} - {name}
    assert not [n for n in left if n.startswith(".")] and "train.lock" not in left, left
    assert not (out / "metrics.jsonl").exists()


@pytest.mark.parametrize("where", ["output_dir", "ancestor", "checkpoints"])
def test_a_symbolic_link_to_a_missing_path_is_refused_by_check_and_run_alike(tiny_model_dir, chats, tmp_path, capfd,
                                                                           where):
    """A user trial: `train.output_dir` a dangling link passed --check ("starts fresh in ...") and the run then
    failed on train.lock with `File exists [Errno 17]`. Refused alike by both, in one line naming the link and its
    missing target (exit 2), and nothing is created through it (its target is often an unmounted filesystem)."""
    target = tmp_path / "nowhere"
    link = tmp_path / "dangling"
    link.symlink_to(target)
    out = {"output_dir": link, "ancestor": link / "run"}.get(where, tmp_path / "run")
    if where == "checkpoints":
        out.mkdir()
        link = out / "checkpoints"
        link.symlink_to(target)
    for check in (("--check",), ()):
        assert main([*check, *sft_args(tiny_model_dir, out, chats, "--max_steps", 1)]) == 2
        assert one_error_line(capfd.readouterr().err) == (
            f"error: train.output_dir: {link} is a symbolic link to {target}, which does not exist; create it "
            f"(mkdir -p {target}) or choose another --train.output_dir")
        assert not target.exists() and link.is_symlink()
    target.mkdir()  # the link's target created: the run goes through the link
    assert main(sft_args(tiny_model_dir, out, chats, "--max_steps", 1)) == 0
    written = {"output_dir": target / "checkpoints", "ancestor": target / "run" / "checkpoints"}.get(where, target)
    assert (written / "step-00000001").is_dir()


def test_the_lock_record_that_meets_a_full_disk_leaves_nothing_held(tmp_path, monkeypatch):
    from astrai.checkpoint import lock as lock_module
    from astrai.checkpoint.lock import OutputDirLock

    monkeypatch.setattr(lock_module.os, "pwrite", lambda fd, data, offset: (_ for _ in ()).throw(
        OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))))
    with pytest.raises(OutputWriteError, match=f"^cannot write {tmp_path / 'train.lock'}: No space left"):
        OutputDirLock(tmp_path).acquire("r")
    monkeypatch.undo()
    assert not (tmp_path / "train.lock").exists() and not lock_module._HELD
    held = OutputDirLock(tmp_path)
    assert held.acquire("r") is None  # nothing torn for the next job to read
    held.release()


# --------------------------------------------------------------------------------------- evaluation answers
def fsync_full_under(monkeypatch, folder: str) -> None:
    """`os.fsync` of a file whose path has `folder` in it fails with ENOSPC (as a full disk says it when the data
    reaches it)."""
    real = os.fsync

    def fsync(fd):
        if f"/{folder}/" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def test_answers_of_the_in_training_evaluation_that_cannot_be_written_are_one_line(tiny_model_dir, chats, tmp_path,
                                                                                    monkeypatch, capfd):
    from test_train_evaluation import EVAL  # every 2 steps

    out = tmp_path / "run"
    fsync_full_under(monkeypatch, "eval")
    assert main(sft_args(tiny_model_dir, out, chats, "--max_steps", 3, "--rollout.max_new_tokens", 4,
                         "--train.report_to", "none", *EVAL)) == 2
    line = one_error_line(capfd.readouterr().err)
    assert line == f"error: cannot write {out / 'eval' / 'step-00000002.jsonl'}: {ENOSPC}"
    assert list((out / "eval").iterdir()) == []  # nothing of it, no temporary file
    assert steps_of(out) == [1] and not (out / "checkpoints").exists()  # stopped at step 2, before its checkpoint


def test_an_earlier_runs_answers_are_kept_beside_one_kept_in_the_same_second(tmp_path, monkeypatch):
    """A fresh run keeps the `eval/` folder it finds as `eval.<timestamp>`; a second fresh start within the same
    second does not fail on the first one's folder (the rename used to meet a non-empty directory)."""
    from astrai.trainer import evaluation_callback
    from astrai.trainer.evaluation_callback import EvaluationCallback

    monkeypatch.setattr(evaluation_callback.time, "strftime", lambda fmt: "20260101-000000")
    said = []
    callback = types.SimpleNamespace(output_dir=tmp_path, dist=types.SimpleNamespace(is_main=True),
                                     printer=said.append)
    trainer = types.SimpleNamespace(state=types.SimpleNamespace(global_step=0))
    for run in (1, 2):
        (tmp_path / "eval").mkdir()
        (tmp_path / "eval" / "step-00000001.jsonl").write_text(json.dumps({"run": run}) + "\n")
        EvaluationCallback.on_train_begin(callback, trainer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval.20260101-000000", "eval.20260101-000000-1"]
    assert said[-1] == f"kept the previous run's evaluation answers in {tmp_path / 'eval.20260101-000000-1'}"


@pytest.mark.parametrize("name", ["results.jsonl", "summary.json"])
def test_evaluate_results_that_cannot_be_written_are_one_line(tiny_model_dir, tmp_path, capsys, name):
    from test_evaluate import cli

    out = tmp_path / "eval"
    (out / name).mkdir(parents=True)
    assert cli(tiny_model_dir, "builtin:arithmetic_test", out, "--limit", "2") == 2
    assert one_error_line(capsys.readouterr().err) == f"error: cannot write {out / name}: {EISDIR}"
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


def test_a_plot_that_cannot_be_written_is_one_line_and_leaves_no_partial_png(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    from astrai import plot

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "rollout/reward_mean": s / 10}) + "\n"
                                                    for s in (1, 2)))
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))))
    assert plot.main([str(tmp_path), "--output", str(tmp_path / "p.png")]) == 2
    assert one_error_line(capsys.readouterr().err) == f"error: cannot write {tmp_path / 'p.png'}: {ENOSPC}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


# ------------------------------------------------------------------------------------------------------- readers
def test_readers_skip_a_torn_last_line_and_say_it_once(tmp_path, capsys):
    from astrai import plot

    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "rollout/reward_mean": 0.5}\n\n{"step": 2, "rollout/reward_mean": 0.7}\n'
                     b'{"step": 3, "rollout/rew\xc3')  # cut inside a record and inside a UTF-8 character
    said = []
    assert [r["step"] for r in read_jsonl(path, say=said.append)] == [1, 2]
    assert said == [f"{path}: skipped its torn last line (line 4: cut off while it was written, by a crash or a "
                    "full disk)"]
    assert [r["step"] for r in plot.read_records(path)] == [1, 2]
    assert capsys.readouterr().err == f"warning: {said[0]}\n"  # said once
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    assert [r["step"] for r in read_jsonl(path, say=said.append)] == [1, 2]
    assert said[-1] == f"{path}: skipped 1 line that is not one JSON object (line 2)"


def test_a_resumed_run_repairs_its_torn_metrics_line_and_says_so(tiny_model_dir, chats, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(sft_args(tiny_model_dir, out, chats, "--max_steps", 2, "--train.report_to", "none")) == 0
    with open(out / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 3, "train/lo')  # a crash while step 3 was logged
    assert main(sft_args(tiny_model_dir, out, chats, "--max_steps", 3, "--train.report_to", "none",
                         "--checkpoint.resume", "auto")) == 0
    assert steps_of(out) == [1, 2, 3]
    assert_whole_records(out / "metrics.jsonl")
    assert capsys.readouterr().out.count("skipped its torn last line (line 3") == 1


# --------------------------------------------------------------------------------------------- bad text in data
def test_a_lone_surrogate_in_a_prompt_file_is_refused_in_one_line(tiny_model_dir, tmp_path, capfd):
    from test_completions_log import grpo_job

    job, out = grpo_job(tmp_path, log_completions=0)
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"question": "What is 1 + 1?", "answer": "#### 2"}\n'
                    '{"question": "bad \\ud800 text", "answer": "#### 3"}\n')  # valid JSON, no valid text
    assert main(["--config", str(job), "--model.path", str(tiny_model_dir), "--data.path", str(data)]) == 2
    assert one_error_line(capfd.readouterr().err) == (
        f"error: {data} line 2: field 'question' holds a lone surrogate \\ud800 at character 4 (half of a UTF-16 "
        "pair, not text): the file was written from broken text; fix or drop this row")
    assert not out.exists() or not (out / "metrics.jsonl").exists()


def test_a_lone_surrogate_is_refused_in_chats_and_json_files(tmp_path):
    from astrai.data.files import jsonl_objects
    from astrai.data.records import read_rows

    chats = tmp_path / "chats.jsonl"
    chats.write_text('{"messages": [{"role": "user", "content": "hi \\ud83d\\ude00"}]}\n'  # a pair: a character
                     '{"messages": [{"role": "user", "content": "x\\udc00"}]}\n')
    with pytest.raises(DataError, match=rf"^{chats} line 2: field 'messages'\[0\]\['content'\] holds a lone "
                                        r"surrogate \\udc00 at character 1"):
        list(jsonl_objects(chats))
    array = tmp_path / "prompts.json"  # datasets would turn it into U+FFFD without a word
    array.write_text('[{"question": "ok", "answer": "1"}, {"question": "bad \\ud800", "answer": "2"}]')
    with pytest.raises(DataError, match=rf"^{array} row 2: field 'question' holds a lone surrogate"):
        read_rows(array)


# ------------------------------------------------------------------------------- several ranks: one line, agreed
class GatherDist:
    """What `Trainer.agree_faults` and `check_ranks_agree` need of a process group, over gloo."""

    def __init__(self, rank):
        self.rank, self.world_size, self.is_main, self.device = rank, 2, rank == 0, torch.device("cpu")

    def all_reduce_max(self, tensor):
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
        return tensor

    def barrier(self):
        torch.distributed.barrier()

    def broadcast_object(self, obj):
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def gather_objects(self, obj):
        box = [None] * 2
        torch.distributed.all_gather_object(box, obj)
        return box

    from astrai.distributed.context import DistributedContext
    first_failure = DistributedContext.first_failure  # the agreement itself, over these collectives


def _agree(rank, tmp, results):
    import traceback
    import uuid

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=2)
    from astrai.distributed.rank_checks import check_ranks_agree
    from astrai.trainer.loop import Trainer

    out = {}
    try:
        dist = GatherDist(rank)
        trainer = Trainer(None, dist=dist, max_steps=1, max_grad_norm=1.0)
        trainer.agree_faults()  # nothing kept anywhere: returns on both
        if rank == 0:  # rank 0's metrics.jsonl meets a full disk; rank 1's callbacks run on
            trainer.keep_fault(OutputWriteError(f"cannot write {tmp}/metrics.jsonl: {ENOSPC}"))
        start = time.monotonic()
        try:
            trainer.agree_faults()
        except OutputWriteError as err:
            out["loop"] = (str(err), err.agreed, time.monotonic() - start)
        uuid.uuid4 = lambda: types.SimpleNamespace(hex="fixed")  # rank 0's token file: a directory is in the way
        (tmp / "out" / ".rank-check-fixed").mkdir(parents=True, exist_ok=True)
        try:
            check_ranks_agree(dist, tmp / "out", "abc")
        except OutputWriteError as err:
            out["token"] = (str(err), err.agreed)
    except Exception:  # noqa: BLE001 - reported to the parent
        out["error"] = traceback.format_exc()
    results.put((rank, out))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def test_a_write_fault_of_one_rank_stops_both_ranks_with_the_same_line(tmp_path):
    outs = spawn_ranks(_agree, tmp_path, 2)
    line = f"cannot write {tmp_path}/metrics.jsonl: {ENOSPC}"
    assert outs[0]["loop"][:2] == outs[1]["loop"][:2] == (line, True)
    assert max(outs[0]["loop"][2], outs[1]["loop"][2]) < 10
    token = f"cannot write {tmp_path / 'out' / '.rank-check-fixed'}: {EISDIR}"
    assert outs[0]["token"] == outs[1]["token"] == (token, True)


SITE = """
import os
if os.environ.get("RANK") is not None and os.environ.get("RANK") == os.environ.get("FSIZE_RANK"):
    import resource
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(os.environ["FSIZE_LIMIT"]),) * 2)
"""


def launched(launcher, tiny_model_dir, chats, tmp_path, opts):
    """`launch/LAUNCHER OPTS sft.yaml ...` with 2 gloo ranks, rank 0 under a 4000-byte file-size limit (a
    sitecustomize on PYTHONPATH): its metrics.jsonl meets the limit after about 14 steps."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITE)
    out = tmp_path / "run"
    args = sft_args(tiny_model_dir, out, chats, "--max_steps", 60, "--train.report_to", "none",
                    "--checkpoint.save_at_end", "false")[1:]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRAIN_CHECK": "0", "FSIZE_RANK": "0", "FSIZE_LIMIT": "4000",
           "PYTHONPATH": f"{site}:{os.environ.get('PYTHONPATH', '')}",
           "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", str(LAUNCH / launcher), *opts, *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    return proc, out


def assert_ends_with_the_line(proc, out):
    line = f"error: cannot write {out / 'metrics.jsonl'}: {EFBIG}"
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text[-3000:]
    assert proc.stderr.rstrip("\n").splitlines()[-1] == line, proc.stderr[-3000:]
    assert text.count(line) == 1 and "ChildFailedError" not in text and "Traceback" not in text, text[-3000:]
    assert_whole_records(out / "metrics.jsonl")
    assert 5 < len(steps_of(out)) < 60


def test_two_ranks_under_torchrun_sh_end_with_the_one_line(tiny_model_dir, chats, tmp_path):
    """Rank 0's write fault is agreed by both ranks, which exit 0 after handing the code and the line to the script:
    torchrun reports no failure, the script exits 2 and its output ends with the line."""
    start = time.monotonic()
    proc, out = launched("torchrun.sh", tiny_model_dir, chats, tmp_path,
                         ["--nproc_per_node", "2", "--master_port", str(free_port())])
    print(f"2 ranks under torchrun.sh, metrics.jsonl refused: {time.monotonic() - start:.1f} s in all")
    assert_ends_with_the_line(proc, out)


@pytest.mark.slow
def test_two_ranks_under_accelerate_sh_end_with_the_one_line(tiny_model_dir, chats, tmp_path):
    proc, out = launched("accelerate.sh", tiny_model_dir, chats, tmp_path,
                         ["--num_processes", "2", "--main_process_port", str(free_port())])
    assert_ends_with_the_line(proc, out)


# --------------------------------------------------------------------------- the hand-over to the launch scripts
@pytest.mark.parametrize("env, handed_over", [
    ({"WORLD_SIZE": "1"}, True),  # one process: it ends, whatever it ends with
    ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}, False),  # a config error is not agreed among nodes
    ({"WORLD_SIZE": "1", "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "1"}, False),  # restart
])
def test_the_job_code_and_line_go_to_the_script_and_the_process_exits_0_only_when_safe(tmp_path, env, handed_over):
    exit_file = tmp_path / "code"
    proc = subprocess.run([sys.executable, "-m", "astrai.train", "--max_steps", "0"], cwd=REPO, timeout=120,
                          env={**os.environ, "ASTRAI_EXIT_FILE": str(exit_file), **env}, capture_output=True,
                          text=True)
    line = "error: train.max_steps: expected an integer > 0, got 0 (given on the command line)"
    assert exit_file.read_text() == f"2\n{line}\n"
    assert proc.returncode == (0 if handed_over else 2)
    assert (line in proc.stderr) is not handed_over  # handed over: the script prints it, last


@pytest.mark.parametrize("launcher_code", [0, 1])
def test_the_script_exits_with_the_job_code_and_ends_with_its_line(tmp_path, launcher_code):
    """Whether the launcher succeeded (ranks that handed over) or failed with its own report, the script's output
    ends with the job's line and its code is the job's."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "torchrun"
    fake.write_text("#!/usr/bin/env bash\nprintf '2\\nerror: cannot write x: disk full\\n' >\"$ASTRAI_EXIT_FILE\"\n"
                    f"echo 'ChildFailedError banner' >&2\nexit {launcher_code}\n")
    fake.chmod(0o755)
    job = tmp_path / "job.yaml"
    job.write_text("train: {type: sft}\n")
    proc = subprocess.run(["bash", str(LAUNCH / "torchrun.sh"), str(job)], capture_output=True, text=True,
                          env={**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "TRAIN_CHECK": "0"},
                          timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1] == "error: cannot write x: disk full"


def test_cannot_write_names_the_file_and_the_cause():
    assert outputs.cannot_write("outputs/run/metrics.jsonl", OSError(errno.ENOSPC, "No space left on device")) == \
        "cannot write outputs/run/metrics.jsonl: No space left on device [Errno 28]"
    assert OutputWriteError.of("x", OSError(errno.EROFS, os.strerror(errno.EROFS))).exit_code == 2
