"""Checkpoint publishing, contents, loading, verification, retention and recovery (issue 3)."""

import dataclasses
import json
import os
import random
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors import safe_open

from astrai.checkpoint import (
    CheckpointError,
    CheckpointWarning,
    GlobalRNGState,
    NotACheckpointError,
    Part,
    capture_rng_state,
    checkpoints_root,
    find_latest_checkpoint,
    fsutil,
    list_checkpoints,
    load_checkpoint,
    publish_checkpoint,
    recover,
    restore_rng_state,
    step_dirname,
    verify_checkpoint,
)
from astrai.models import AutoRegressiveLM, ValueModel, tiny_config, tiny_tokenizer
from astrai.trainer.optim import build_optimizer, build_scheduler


class FakeSampler:
    def __init__(self, position=3):
        self.position = position

    def state_dict(self):
        return {"epoch": 1, "position": self.position, "seed": 7, "shuffle": True, "num_records": 10}

    def load_state_dict(self, state):
        self.position = state["position"]


class Counters:
    """A json part holding a plain dict (as the trainer's counters)."""

    def __init__(self, state):
        self.state = dict(state)

    def state_dict(self):
        return dict(self.state)

    def load_state_dict(self, state):
        self.state = dict(state)


def make_objects(seed=0, critic=True):
    """A tiny online_ppo-like set of checkpointed objects with one optimizer step taken (non-empty moments)."""
    torch.manual_seed(seed)
    policy = AutoRegressiveLM(tiny_config())
    objects = {"policy": policy, "tokenizer": tiny_tokenizer(), "data_sampler": FakeSampler()}
    models = {"": policy}
    if critic:
        models["value_"] = ValueModel.from_policy(policy)
    for prefix, model in models.items():
        opt = build_optimizer(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
        sched = build_scheduler(opt, name="cosine", warmup_steps=1, total_steps=10)
        sum(p.float().sum() for p in model.parameters()).backward()
        opt.step()
        sched.step()
        objects.update({f"{prefix}model" if prefix else "policy": model, f"{prefix}optimizer": opt,
                        f"{prefix}scheduler": sched})
    return objects


KINDS = {"policy": "hf_model", "tokenizer": "hf_tokenizer", "data_sampler": "json"}


def state(step):
    return {"step": step, "global_step": step, "policy_version": step, "consumed_samples": 4 * step}


def parts_of(objects, step=1):
    """The objects as checkpoint parts, as a strategy and the trainer declare them (online_ppo when a critic)."""
    parts = {name: Part(obj, KINDS.get(name, "torch"), per_rank=name == "data_sampler",
                        required=name != "tokenizer") for name, obj in objects.items()}
    parts["trainer_state"] = Part(Counters(state(step)), "json")
    parts["rng_state"] = Part(GlobalRNGState(), per_rank=True)
    return parts


def publish(tmp_path, step, objects, train_type="auto", **kw):
    if train_type == "auto":
        train_type = "online_ppo" if objects.get("value_model") is not None else None
    return publish_checkpoint(tmp_path, step, parts_of(objects, step),
                              metadata={"policy_version": step, "train_type": train_type}, **kw)


@pytest.fixture(scope="module")
def objects():
    return make_objects()


def cli(*args):
    return subprocess.run([sys.executable, "-m", "astrai.checkpoint", *map(str, args)], capture_output=True,
                          text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_publish_contents_and_manifest(tmp_path, objects):
    path = publish(tmp_path, 5, objects)
    assert path == tmp_path / "checkpoints" / "step-00000005"
    names = {p.name for p in path.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "optimizer.pt",
            "scheduler.pt", "value_model.pt", "value_optimizer.pt", "value_scheduler.pt", "rng_state.pt",
            "trainer_state.json", "manifest.json"} <= names
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format"] == "astrai-checkpoint" and manifest["format_version"] == 1
    assert (manifest["step"], manifest["policy_version"], manifest["world_size"]) == (5, 5, 1)
    assert manifest["train_type"] == "online_ppo"
    assert set(manifest["files"]) == names - {"manifest.json"}
    assert all(len(e["sha256"]) == 64 and e["bytes"] > 0 for e in manifest["files"].values())
    trainer_state = json.loads((path / "trainer_state.json").read_text())
    sampler = json.loads((path / "data_sampler.json").read_text())
    assert trainer_state["consumed_samples"] == 20 and sampler["position"] == 3
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]
    modes = {p.name: p.stat().st_mode & 0o777 for p in path.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"] == modes["optimizer.pt"]  # not safetensors' 0600


def test_load_roundtrip_weights_only(tmp_path, objects):
    path = publish(tmp_path, 1, objects)
    ckpt = load_checkpoint(path, verify=True, require_complete=True)
    assert ckpt.step == 1 and ckpt.train_type == "online_ppo" and not ckpt.legacy
    policy = AutoRegressiveLM(tiny_config())
    policy.load_state_dict(ckpt.policy_state_dict(), strict=True)
    assert all(torch.equal(a, b) for a, b in zip(policy.state_dict().values(),
                                                  objects["policy"].state_dict().values()))
    for key in ("optimizer", "scheduler", "value_model", "value_optimizer", "value_scheduler"):
        loaded = ckpt.part_state(key, "torch")
        expected = objects[key].state_dict()
        assert loaded.keys() == expected.keys(), key
    moments = ckpt.part_state("value_optimizer", "torch")["state"][0]["exp_avg"]
    assert torch.equal(moments, objects["value_optimizer"].state_dict()["state"][0]["exp_avg"])
    assert ckpt.part_state("data_sampler", "json")["position"] == 3
    assert ckpt.read_json("config.json")["model_type"] == "llama"
    for name in ("optimizer.pt", "rng_state.pt", "value_model.pt"):  # all load under weights_only
        torch.load(path / name, weights_only=True)


def test_rng_state_roundtrip(tmp_path, objects):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    saved = capture_rng_state()
    path = publish(tmp_path, 1, objects)
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    restore_rng_state(load_checkpoint(path).part_state("rng_state", "torch"))
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])
    assert saved["numpy"][1].dtype == torch.int64
    with pytest.raises(CheckpointError, match="malformed rng state"):
        restore_rng_state({"python": None})


@pytest.mark.parametrize("exchange", [True, False])
def test_republish_replaces_without_leftovers(tmp_path, objects, exchange, monkeypatch):
    monkeypatch.setattr(fsutil, "EXCHANGE_SUPPORTED", None if exchange else False)
    first = publish(tmp_path, 3, objects)
    old = json.loads((first / "manifest.json").read_text())["publish_id"]
    second = publish(tmp_path, 3, make_objects(seed=1))
    assert second == first
    assert json.loads((second / "manifest.json").read_text())["publish_id"] != old
    assert verify_checkpoint(second).exit_code == 0
    assert sorted(p.name for p in checkpoints_root(tmp_path).iterdir()) == ["step-00000003"]


def test_publish_refuses_incomplete_objects(tmp_path, objects):
    no_critic = dict(objects, value_optimizer=None)  # declared required, but missing
    with pytest.raises(CheckpointError, match="value_optimizer"):
        publish(tmp_path, 1, no_critic, train_type="online_ppo")
    with pytest.raises(CheckpointError, match="unknown object"):
        publish_checkpoint(tmp_path, 1, dict(parts_of(objects), mystery=object()))
    with pytest.raises(CheckpointError, match="unknown kind 'pickle'"):
        publish_checkpoint(tmp_path, 1, dict(parts_of(objects), mystery=Part(FakeSampler(), "pickle")))
    assert list(checkpoints_root(tmp_path).glob("*")) == []  # refused before staging: nothing left behind


def test_before_publish_hook_runs_first(tmp_path, objects):
    seen = []
    publish(tmp_path, 1, objects, before_publish=lambda: seen.append(list(checkpoints_root(tmp_path).glob("*"))))
    assert seen == [[]]


def test_tokenizer_files_exclude_other_ranks_files(tmp_path):
    """Rank 0 saves the tokenizer while the other ranks write their files into the same staging directory: only the
    tokenizer's own files are recorded as its part (a listing of the directory before and after would also take a
    file another rank was writing, and hashing it fails once that rank renames it)."""
    from astrai.checkpoint.parts import write_parts

    class SavingBesideAnotherRank:
        def save(self, directory):
            tiny_tokenizer().save(directory)
            (tmp_path / ".rank-00001.done.tmp").write_text("{}")  # another rank, meanwhile

    names = write_parts(tmp_path, {"tokenizer": Part(SavingBesideAnotherRank(), "hf_tokenizer")}, 0)
    assert names == ["tokenizer.json", "tokenizer_config.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".rank-00001.done.tmp", *names]  # no private dir left


def test_a_model_part_that_does_not_fit_is_refused_with_one_line(tmp_path):
    """A checkpoint's model state with other tensor names or shapes than the model built is refused before it
    loads (torch's own error lists every key over many lines)."""
    def critic(**overrides):
        torch.manual_seed(0)
        return ValueModel(AutoRegressiveLM(tiny_config(**overrides)).model)

    path = publish_checkpoint(tmp_path, 1, {"value_model": Part(critic(num_hidden_layers=2))})
    ckpt = load_checkpoint(path)
    for model, said in ((critic(num_hidden_layers=1), "has extra 9 tensor(s), e.g. 'model.layers.1."),
                        (critic(num_hidden_layers=3), "lacks 9 tensor(s), e.g. 'model.layers.2."),
                        (critic(num_hidden_layers=2, intermediate_size=64), "has other shapes for 6 tensor(s)")):
        with pytest.raises(CheckpointError, match=rf"part 'value_model' does not fit the model this config builds: "
                                                  rf"it {re.escape(said)}[^\n]*$"):
            ckpt.restore({"value_model": Part(model)})
    ckpt.restore({"value_model": Part(critic(num_hidden_layers=2))})
    # a tied LM head is stored once (under the embedding's name): not a missing tensor
    tied = AutoRegressiveLM(tiny_config(tie_word_embeddings=True))
    path = publish_checkpoint(tmp_path, 2, {"policy": Part(tied, "hf_model")})
    load_checkpoint(path).restore({"policy": Part(AutoRegressiveLM(tiny_config(tie_word_embeddings=True)),
                                                  "hf_model")})


@pytest.mark.parametrize("tied", [False, True])
def test_policy_dir_loads_in_transformers(tmp_path, objects, tied):
    transformers = pytest.importorskip("transformers")
    if tied:
        torch.manual_seed(5)
        policy = AutoRegressiveLM(dataclasses.replace(tiny_config(), tie_word_embeddings=True))
        objects = {"policy": policy, "tokenizer": objects["tokenizer"]}
    path = publish(tmp_path, 1, objects)
    assert ("lm_head.weight" in safe_open(str(path / "model.safetensors"), "pt").keys()) is not tied
    hf = transformers.LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    ids = torch.randint(0, tiny_config().vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = objects["policy"].eval()(ids)
        theirs = hf(input_ids=ids).logits
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=0)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert tok.encode("1+1=2", add_special_tokens=False) == objects["tokenizer"].encode("1+1=2")


def test_keep_last_and_latest(tmp_path, objects):
    for step in (1, 2, 3, 4):
        publish(tmp_path, step, objects, keep_last=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 4]
    # republishing an older step keeps it (never delete the one just published) plus the newest other
    publish(tmp_path, 2, objects, keep_last=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 4]
    assert find_latest_checkpoint(tmp_path) == checkpoints_root(tmp_path) / "step-00000004"
    with pytest.raises(ValueError, match="keep_last"):
        publish(tmp_path, 5, objects, keep_last=0)
    with pytest.raises(ValueError, match="step"):
        publish(tmp_path, -1, objects)


def test_latest_skips_hidden_and_broken(tmp_path, objects):
    good = publish(tmp_path, 1, objects)
    root = checkpoints_root(tmp_path)
    broken = publish(tmp_path, 3, objects)
    with open(broken / "optimizer.pt", "r+b") as f:
        f.truncate(10)
    with pytest.raises(CheckpointError, match="optimizer.pt: MISMATCH .10 bytes"):
        load_checkpoint(broken)
    (root / ".step-00000009.staging-abc").mkdir()
    (root / ".step-00000008.retired-abc").mkdir()
    (root / step_dirname(7)).mkdir()  # no manifest, no files
    with pytest.warns(CheckpointWarning) as record:
        assert find_latest_checkpoint(tmp_path) == good
    messages = sorted(str(w.message) for w in record)
    assert len(messages) == 2 and "optimizer.pt: MISMATCH" in messages[0] and "no manifest.json" in messages[1]
    (root / step_dirname(2)).mkdir()
    (good / "manifest.json").rename(root / step_dirname(2) / "manifest.json")  # step disagrees with name
    with pytest.warns(CheckpointWarning):
        assert find_latest_checkpoint(tmp_path) is None
    assert find_latest_checkpoint(tmp_path / "nothing-here") is None


def test_recover(tmp_path, objects, monkeypatch):
    root = checkpoints_root(tmp_path)
    a = publish(tmp_path, 1, objects)
    b = publish(tmp_path, 2, objects)
    (root / ".step-00000003.staging-aa").mkdir()
    (root / ".step-00000004.deleting-bb").mkdir()
    a.rename(root / ".step-00000001.retired-cc")  # crash between the two renames of a republish
    monkeypatch.setattr(fsutil, "EXCHANGE_SUPPORTED", False)
    publish(tmp_path, 2, objects)
    (root / ".step-00000002.retired-dd").mkdir()  # crash before deleting the retired payload
    (root / "notes.txt").write_text("keep me")
    actions = recover(tmp_path)
    assert "restored .step-00000001.retired-cc -> step-00000001" in actions and len(actions) == 4
    assert sorted(p.name for p in root.iterdir()) == ["notes.txt", "step-00000001", "step-00000002"]
    assert all(verify_checkpoint(p).exit_code == 0 for p in (a, b))
    assert recover(tmp_path) == []


def test_verify_cli_and_corruption(tmp_path, objects):
    path = publish(tmp_path, 1, objects)
    result = cli("verify", "--require-critic", path)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == len(json.loads((path / "manifest.json").read_text())["files"])
    assert all(line.startswith("OK") for line in lines)
    data = bytearray((path / "value_model.pt").read_bytes())
    data[len(data) // 2] ^= 1
    (path / "value_model.pt").write_bytes(data)
    (path / "scheduler.pt").unlink()
    result = cli("verify", path)
    assert result.returncode == 1
    assert "MISMATCH   value_model.pt" in result.stdout and "MISSING    scheduler.pt" in result.stdout
    with pytest.raises(CheckpointError, match="value_model.pt: MISMATCH"):
        load_checkpoint(path, verify=True)
    with pytest.raises(CheckpointError, match="scheduler.pt: MISSING"):
        load_checkpoint(path)
    assert cli("verify", tmp_path).returncode == 2
    assert cli("verify", tmp_path / "absent").returncode == 2


def test_require_critic(tmp_path, objects):
    path = publish(tmp_path, 1, objects)
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["files"]["value_model.pt"]  # as if written by a publisher that forgot the critic
    (path / "value_model.pt").unlink()
    (path / "manifest.json").write_text(json.dumps(manifest))
    assert cli("verify", path).returncode == 0
    result = cli("verify", "--require-critic", path)
    assert result.returncode == 1 and "MISSING    value_model.pt" in result.stdout
    with pytest.raises(CheckpointError, match="online_ppo checkpoint lacks value_model.pt"):
        load_checkpoint(path, require_complete=True)
    ckpt = load_checkpoint(path)
    with pytest.raises(CheckpointError, match="online_ppo checkpoint lacks value_model.pt"):
        ckpt.part_state("value_model", "torch")
    sft = publish(tmp_path, 2, make_objects(critic=False))
    assert json.loads((sft / "manifest.json").read_text())["train_type"] is None
    assert cli("verify", "--require-critic", sft).returncode == 0


@pytest.mark.parametrize("bad", ["../x", "/etc/passwd", "a/../../x", "./model.safetensors", "a\\b", ""])
def test_manifest_paths_outside_are_rejected(tmp_path, objects, bad):
    path = publish(tmp_path, 1, objects)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"][bad] = {"sha256": "0" * 64, "bytes": 1}
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="outside|invalid path"):
        load_checkpoint(path)
    assert verify_checkpoint(path).exit_code == 1


def test_symlink_escape_is_rejected(tmp_path, objects):
    path = publish(tmp_path, 1, objects)
    secret = tmp_path / "secret.pt"
    os.replace(path / "optimizer.pt", secret)
    (path / "optimizer.pt").symlink_to(secret)  # same bytes, but outside the directory
    with pytest.raises(CheckpointError, match="resolves outside"):
        load_checkpoint(path)
    assert verify_checkpoint(path).exit_code == 1


def test_legacy_checkpoint_loads_with_warning(tmp_path, objects):
    path = publish(tmp_path, 1, objects)
    (path / "manifest.json").unlink()
    with pytest.warns(CheckpointWarning, match="legacy"):
        ckpt = load_checkpoint(path, verify=True)
    assert ckpt.legacy and ckpt.step == 1 and "exp_avg" in ckpt.part_state("optimizer", "torch")["state"][0]
    result = cli("verify", path)
    assert result.returncode == 0 and "UNVERIFIED" in result.stdout
    with pytest.warns(CheckpointWarning):
        assert find_latest_checkpoint(tmp_path) is None
    with pytest.warns(CheckpointWarning, match="legacy"):
        assert find_latest_checkpoint(tmp_path, allow_legacy=True) == path
    with pytest.raises(NotACheckpointError):
        load_checkpoint(tmp_path)


def test_newer_format_and_foreign_manifest(tmp_path, objects):
    path = publish(tmp_path, 1, objects)
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps(dict(manifest, format_version=99)))
    with pytest.raises(CheckpointError, match="newer"):
        load_checkpoint(path)
    (path / "manifest.json").write_text(json.dumps(dict(manifest, format="something-else")))
    with pytest.raises(NotACheckpointError):
        load_checkpoint(path)
    assert verify_checkpoint(path).exit_code == 2


def test_latest_and_recover_cli(tmp_path, objects):
    assert cli("latest", tmp_path).returncode == 1
    path = publish(tmp_path, 4, objects)
    (checkpoints_root(tmp_path) / ".step-00000005.staging-ab").mkdir()
    result = cli("latest", tmp_path)
    assert result.returncode == 0 and result.stdout.strip() == str(path)
    result = cli("recover", tmp_path)
    assert result.returncode == 0 and result.stdout.strip() == "deleted .step-00000005.staging-ab"
