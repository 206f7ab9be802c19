"""A Qwen3 and a Gemma 3 tiny model (tests/family_models.py, saved by transformers) train under FSDP2 and ZeRO-3
with 2 ranks over gloo (`torch.distributed.run`, one thread each): two SFT steps (the engines' final policies
within float rounding of each other) and two online PPO steps (rollouts through the engine with the gathered
weights, the critic, a checkpoint loading in transformers as the family's class). Slow tier (about a minute per
run, eight runs)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from family_models import hf_model
from test_sharded import REPO, torchrun, why

pytest.importorskip("deepspeed")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=["qwen3", "gemma3"])
def family_dir(request, tmp_path_factory):
    from astrai.models import tiny_tokenizer

    path = tmp_path_factory.mktemp(request.param)
    hf_model(request.param).save_pretrained(path)
    tiny_tokenizer().save(path)
    return request.param, path


def _run(engine: str, out, *args: str):
    done = torchrun(*args, "--train.output_dir", str(out), "--train.progress_bar", "false", "--distributed.strategy",
                    engine, "--runtime.deterministic", "true", "--max_steps", "2", "--checkpoint.save_steps", "2")
    assert done.returncode == 0, why(done)
    return out / "checkpoints" / "step-00000002"


@pytest.mark.slow
def test_fsdp2_and_zero3_train_steps_of_a_family_model(family_dir, tmp_path):
    """SFT: both engines move the weights and agree with each other to float rounding. Online PPO: rollouts from
    the gathered (sharded) weights score exactly as the trainer does (logprob gap ~0), and the checkpoint loads in
    transformers as the family's class."""
    name, model_dir = family_dir
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"What is {i} + {i}?"},
        {"role": "assistant", "content": f"{i} + {i} = {2 * i}."}]}) + "\n" for i in range(16)))
    policies = {}
    for engine in ("fsdp2", "zero3"):
        ckpt = _run(engine, tmp_path / f"sft-{engine}", "--config", str(REPO / "configs/examples/sft.yaml"),
                    "--model.path", str(model_dir), "--data.path", str(chats), "--data.max_length", "64",
                    "--train.per_device_train_batch_size", "2", "--optim.learning_rate", "1e-3")
        policies[engine] = load_file(str(ckpt / "model.safetensors"))
        out = tmp_path / f"ppo-{engine}"
        ckpt = _run(engine, out, "--config", str(REPO / "configs/examples/ppo.yaml"), "--model.path", str(model_dir),
                    "--rollout.batch_size", "4", "--ppo.minibatch_size", "2", "--ppo.micro_batch_size", "1",
                    "--rollout.max_new_tokens", "6", "--data.truncation", "left")
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert max(r["rollout/logprob_gap"] for r in records) < 1e-5  # the engine held the gathered weights
        loaded = transformers.AutoModelForCausalLM.from_pretrained(ckpt)
        assert type(loaded).__name__ == {"qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM"}[name]
    start = hf_model(name).state_dict()
    moved = max((policies["fsdp2"][k] - start[k]).abs().max().item() for k in policies["fsdp2"])
    gap = max((policies["fsdp2"][k] - policies["zero3"][k]).abs().max().item() for k in policies["fsdp2"])
    assert moved > 1e-4 and gap < 1e-5, (moved, gap)
    assert all(torch.isfinite(t).all() for t in policies["zero3"].values())
