"""Issue 31 part 2, multi-node preflight: before the first step every rank sees rank 0's token file in
train.output_dir, and the ranks agree on the astrai version, the job config and the world size; a disagreement is
one line naming the rank and its host, exit 2, within seconds. The start-up line says when checkpoints are written."""

import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch
from fault_jobs import REPO, free_port, sft_args, write_chats
from spawn_ranks import spawn_ranks

from astrai.config import load_config
from astrai.distributed.rank_checks import RanksDisagree, check_ranks_agree
from astrai.trainer.build import checkpoint_plan


class Dist:
    """The process state `check_ranks_agree` needs, over a gloo group."""

    def __init__(self, rank):
        self.rank, self.world_size, self.is_main = rank, 2, rank == 0

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


def _agree(rank, tmp, results):
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["WORLD_SIZE"] = "2"
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=2)
    out = {}
    try:
        dist = Dist(rank)
        out["peers"] = check_ranks_agree(dist, tmp / "shared", "abc")
        for name, where, config in (("node_local", tmp / f"local{rank}", "abc"),
                                    ("config", tmp / "shared", "abc" if rank == 0 else "abd")):
            start = time.monotonic()
            try:
                check_ranks_agree(dist, where, config)
                out[name] = "agreed"
            except RanksDisagree as exc:
                out[name] = (str(exc), time.monotonic() - start)
    except Exception:  # noqa: BLE001 - reported to the parent
        out["error"] = traceback.format_exc()
    results.put((rank, out))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def test_ranks_that_see_another_directory_or_job_are_named(tmp_path):
    import socket

    outs = spawn_ranks(_agree, tmp_path, 2)
    host = socket.gethostname()
    assert [p["rank"] for p in outs[0]["peers"]] == [0, 1] and outs[0]["peers"][1]["host"] == host
    assert not list((tmp_path / "shared").iterdir())  # the token file is removed
    for rank in (0, 1):
        line, seconds = outs[rank]["node_local"]
        assert line == (f"train.output_dir {tmp_path / f'local{rank}'}: rank 1 on host {host} does not see the token "
                        f"file rank 0 (host {host}) wrote there: every rank must see the same directory, on a "
                        "filesystem shared by all nodes (docs/launch.md)")
        assert seconds < 5
        print(f"rank {rank}: node-local output dir refused {seconds:.3f} s into the check")
        assert outs[rank]["config"][0] == (f"rank 1 on host {host} resolved another job config than rank 0 (hash abd "
                                           "vs abc): give every node the same job file and overrides")


@pytest.mark.slow  # ~15 s here; the check itself is covered in the default tier above
def test_a_two_rank_run_with_node_local_output_dirs_is_refused_before_step_1(tiny_model_dir, tmp_path):
    chats = write_chats(tmp_path / "chats.jsonl")
    base = tmp_path / "nodes"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(Path(__file__).parent / "per_rank_cwd.py"), str(base),
           *sft_args(tiny_model_dir, "outputs/run", chats, "--max_steps", 2)]
    start = time.monotonic()
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    took = time.monotonic() - start
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0
    assert len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith("error: train.output_dir outputs/run: rank 1 on host ")
    assert "exitcode: 2" in proc.stderr or "exitcode  : 2" in proc.stderr, proc.stderr[-3000:]
    for rank in (0, 1):  # nothing trained, no checkpoint, no metrics on either node
        out = base / f"node{rank}" / "outputs" / "run"
        assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()
    print(f"node-local output dirs refused: {took:.1f} s for the whole torchrun job")


def test_the_start_up_line_says_when_checkpoints_are_written():
    config = load_config(None, ["--max_steps", "1000"])
    assert checkpoint_plan(config).startswith("checkpoints: every 60 minutes of training (checkpoint.save_minutes) "
                                              "and after step 1000 (the end)")
    timed = checkpoint_plan(load_config(None, ["--max_steps", "1000", "--train.max_minutes", "0.5"]))
    assert "and so does train.max_minutes 0.5 when it ends the run before step 1000" in timed
    config = load_config(None, ["--max_steps", "1000", "--checkpoint.save_minutes", "null"])
    assert checkpoint_plan(config).startswith("checkpoints: none before step 1000 (checkpoint.save_steps 0, "
                                              "checkpoint.save_minutes null) and after step 1000 (the end)")
    assert checkpoint_plan(load_config(None, ["--max_steps", "1000", "--checkpoint.save_steps", "100"])) is None


def test_checkpoints_by_time_are_published_at_step_boundaries(tiny_model_dir, tmp_path):
    """checkpoint.save_minutes: a checkpoint is due once that much time passed since the last one (here always)."""
    from fault_jobs import checkpoint_steps

    from astrai.train import main

    out = tmp_path / "run"
    chats = write_chats(tmp_path / "chats.jsonl")
    assert main(sft_args(tiny_model_dir, out, chats, "--max_steps", 3, "--checkpoint.save_minutes", 1e-9)) == 0
    assert checkpoint_steps(out) == [1, 2, 3]
    other = tmp_path / "hourly"
    assert main(sft_args(tiny_model_dir, other, chats, "--max_steps", 3)) == 0
    assert checkpoint_steps(other) == [3]
