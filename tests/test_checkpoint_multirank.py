"""Multi-rank publishing (issue 3 part 7): 2 processes, gloo on CPU, one shared staging directory."""

import json
import os
import traceback

import pytest
import torch
from spawn_ranks import spawn_ranks

WORLD = 2


class GlooDist:
    """The duck-typed `dist` the publisher needs."""

    def __init__(self, rank, world_size):
        self.rank, self.world_size = rank, world_size

    def barrier(self):
        torch.distributed.barrier()


def _worker(rank, tmp, results):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank,
                                         world_size=WORLD)
    from astrai.checkpoint import CheckpointError, GlobalRNGState, Part, publish_checkpoint
    from astrai.models import AutoRegressiveLM, tiny_config, tiny_tokenizer

    class State:
        def __init__(self, state):
            self.state = state

        def state_dict(self):
            return self.state

    torch.manual_seed(100 + rank)  # per-rank RNG differs, as in training
    parts = {"policy": Part(AutoRegressiveLM(tiny_config()), "hf_model"),
             "tokenizer": Part(tiny_tokenizer(), "hf_tokenizer", required=False),
             "data_sampler": Part(State({"epoch": 0, "position": 10 + rank}), "json", per_rank=True),
             "rng_state": Part(GlobalRNGState(), per_rank=True)}
    dist = GlooDist(rank, WORLD)
    out = {}
    try:
        paths = []
        for repeat in range(2):  # second call republishes the same step
            extra = Part(State({"rank": torch.tensor([rank, repeat])}), per_rank=True)
            paths.append(str(publish_checkpoint(tmp / "ok", 7, dict(parts, extra=extra),
                                                metadata={"policy_version": 7}, dist=dist, keep_last=1,
                                                timeout_s=30)))
        out["paths"] = paths
        # rank 1 writes to a directory rank 0 does not use: as if the filesystem were not shared
        target = tmp / ("blind" if rank == 0 else "elsewhere")
        try:
            publish_checkpoint(target, 8, parts, dist=dist, timeout_s=2)
            out["blind"] = "published"
        except CheckpointError as exc:
            out["blind"] = str(exc)
    except Exception:  # noqa: BLE001 - reported to the parent
        out["error"] = traceback.format_exc()
    results.put((rank, out))
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multirank")
    outs = spawn_ranks(_worker, tmp, WORLD)
    return tmp, outs


def test_two_ranks_publish_one_checkpoint(run):
    from astrai.checkpoint import load_checkpoint, verify_checkpoint

    tmp, outs = run
    path = tmp / "ok" / "checkpoints" / "step-00000007"
    assert outs[0]["paths"] == outs[1]["paths"] == [str(path)] * 2
    assert sorted(p.name for p in path.parent.iterdir()) == ["step-00000007"]  # no staging/retired left
    assert verify_checkpoint(path).exit_code == 0
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    assert {"rng_state.pt", "rng_state_rank00001.pt", "data_sampler_rank00001.json", "extra.pt",
            "extra_rank00001.pt", "model.safetensors"} <= set(manifest["files"])
    assert not [n for n in manifest["files"] if n.startswith(".rank-")]
    ckpt = load_checkpoint(path, verify=True)
    assert ckpt.part_state("data_sampler", "json", 0)["position"] == 10
    assert ckpt.part_state("data_sampler", "json", 1)["position"] == 11
    assert not torch.equal(ckpt.part_state("rng_state", "torch", 0)["torch"],
                           ckpt.part_state("rng_state", "torch", 1)["torch"])
    assert ckpt.load_pt("extra_rank00001.pt")["rank"].tolist() == [1, 1]  # the republished content


def test_rank_that_cannot_see_staging_fails_clearly(run):
    tmp, outs = run
    assert outs[1]["blind"].startswith("rank 1 cannot see staging dir")
    assert "after 2s" in outs[1]["blind"]
    assert "rank(s) [1] did not write their part" in outs[0]["blind"]
    root = tmp / "blind" / "checkpoints"
    assert list(root.iterdir()) == []  # rank 0 removed its staging dir, published nothing


class Holder:
    """A per-rank part object that records what it was given."""

    def __init__(self, resizable: bool):
        self.loaded = None
        if resizable:
            self.resized_state = lambda states, rank, world: {"from": list(states), "rank": rank, "world": world}

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        self.loaded = state


@pytest.mark.parametrize("world", [1, 3])
def test_resume_on_another_world_size_gives_each_rank_its_resized_state(run, world):
    """Per-rank parts ask their object for the new rank's state from every old rank's; the RNG of a rank that had a
    copy is its own, a new rank's is derived (distinct from every old rank's) and the caller's RNG is untouched."""
    from astrai.checkpoint import GlobalRNGState, Part, load_checkpoint

    tmp, _ = run
    ckpt = load_checkpoint(tmp / "ok" / "checkpoints" / "step-00000007")
    assert ckpt.world_size == 2
    saved = [ckpt.part_state("rng_state", "torch", r)["torch"] for r in (0, 1)]
    for rank in range(world):
        rng, extra = GlobalRNGState(), Holder(resizable=True)
        restored = {}
        rng.load_state_dict = lambda state, out=restored: out.update(state)
        before = torch.get_rng_state()
        ckpt.restore({"rng_state": Part(rng, per_rank=True), "extra": Part(extra, per_rank=True)}, rank, world)
        assert torch.equal(torch.get_rng_state(), before)
        assert [s["rank"].tolist() for s in extra.loaded.pop("from")] == [[0, 1], [1, 1]]
        assert extra.loaded == {"rank": rank, "world": world}
        if rank < 2:
            assert torch.equal(restored["torch"], saved[rank])
        else:
            assert not any(torch.equal(restored["torch"], s) for s in saved)


def test_per_rank_state_that_cannot_be_resharded_is_refused_before_anything_loads(run):
    from astrai.checkpoint import CheckpointError, Part, load_checkpoint

    tmp, _ = run
    path = tmp / "ok" / "checkpoints" / "step-00000007"
    first, stuck = Holder(resizable=True), Holder(resizable=False)
    stuck.checkpoint_description = "the test's partitions"
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path).restore({"data_sampler": Part(first, "json", per_rank=True),
                                       "extra": Part(stuck, per_rank=True)}, 0, 1)
    assert str(err.value) == (f"{path}: written by 2 ranks, this job has 1: the test's partitions cannot be "
                              f"resharded; resume with 2 processes, or start a new run from its weights "
                              f"(--model.path {path})")
    assert first.loaded is None and stuck.loaded is None
