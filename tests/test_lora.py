"""LoRA (`model.lora`): adapters through peft on astrai's modules, merged weights for the engine, the reference as the
shared base, PEFT-format checkpoints (transformers + peft load them), the merged export, exact resume, and every
train type on a tiny model."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from astrai.config import config_from_dict
from astrai.models import AutoRegressiveLM, tiny_config
from astrai.models.lora_merge import merge_adapter
from astrai.trainer.lora import AdaptersOff, apply_lora, lora_settings, merged_weights, shared_base_model

REPO = Path(__file__).resolve().parents[1]
IDS = torch.tensor([[5, 9, 12, 7, 3, 30, 41], [8, 4, 6, 11, 10, 2, 17]])


def lora_model(seed=0, r=4):
    torch.manual_seed(seed)
    model = AutoRegressiveLM(tiny_config())
    settings = lora_settings(config_from_dict({"model": {"path": "x", "lora": {"r": r, "alpha": 8}}}))
    return model, settings


def randomise_adapters(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def test_adapters_train_alone_and_merge_exactly():
    model, settings = lora_model()
    base_logits = model(IDS).detach()
    view = shared_base_model(model)  # before injection: the base's own tensors
    apply_lora(model, settings)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert len(trained) == 2 * 7 * model.config.num_hidden_layers  # A and B of the 7 projections per block
    torch.testing.assert_close(model(IDS), base_logits)  # B = 0: outputs unchanged at init
    randomise_adapters(model)
    lora_logits = model(IDS).detach()
    assert not torch.allclose(lora_logits, base_logits)
    # the engine's plain copy with the streamed merged weights gives the LoRA model's logits
    plain = AutoRegressiveLM(tiny_config())
    merged = dict(merged_weights(model.state_dict().items(), settings.scaling))
    assert set(merged) == set(plain.state_dict())
    plain.load_state_dict(merged)
    torch.testing.assert_close(plain(IDS), lora_logits, rtol=1e-4, atol=1e-5)
    # ... and equals the PEFT-file merge (W + s B A) used by export
    from astrai.trainer.lora import LoraCheckpointState
    adapter = LoraCheckpointState(model, settings, trained=[], peft_names=True).state_dict()
    assert all(k.startswith("base_model.model.") and ".default." not in k for k in adapter)
    base_state = {k: v for k, v in view.state_dict().items()}
    via_file = merge_adapter(base_state, adapter, scaling=settings.scaling)
    for k, v in merged.items():
        torch.testing.assert_close(via_file[k], v)
    # the reference is the base, sharing storage with the LoRA model's frozen weights
    torch.testing.assert_close(view(IDS), base_logits)
    base_q = model.model.layers[0].self_attn.q_proj.base_layer.weight
    assert view.model.layers[0].self_attn.q_proj.weight.data_ptr() == base_q.data_ptr()


def test_adapters_off_view_is_the_base_without_a_copy():
    """fsdp2 / zero3's LoRA reference: the policy module itself with its adapters switched off for the call; the
    adapters are on again after it, and the scoring path (packed rows, no grad) gives the base's log-probs."""
    from astrai.data.sequences import Sequences
    from astrai.forward import response_logprobs, supports_packing

    model, settings = lora_model()
    base = shared_base_model(model)
    view = AdaptersOff(model)
    apply_lora(model, settings)
    randomise_adapters(model)
    assert list(view.parameters()) == [] and supports_packing(view)
    lora_logits = model(IDS).detach()
    torch.testing.assert_close(view(IDS), base(IDS))
    torch.testing.assert_close(model(IDS), lora_logits)  # adapters back on
    assert not torch.allclose(view(IDS), lora_logits)
    seqs = Sequences.from_tokens([[5, 9, 12], [8, 4]], [[7, 3, 30], [6, 11]], pad_token_id=0,
                                 device=torch.device("cpu"))
    with torch.no_grad():
        mask = seqs.action_mask
        torch.testing.assert_close(response_logprobs(view, seqs, temperature=0.7)[0] * mask,
                                   response_logprobs(base, seqs, temperature=0.7)[0] * mask, rtol=1e-5, atol=1e-6)


def test_target_modules_that_match_nothing_are_refused():
    from astrai.config import ConfigError
    model, settings = lora_model()
    import dataclasses
    with pytest.raises(ConfigError, match=r"model.lora: target_modules entry 'qkv' names no module of the model"):
        apply_lora(model, dataclasses.replace(settings, target_modules=("qkv",)))
    with pytest.raises(ConfigError, match=r"entry 'nope' names no module of the model \(its projections: "):
        apply_lora(model, dataclasses.replace(settings, target_modules=("q_proj", "nope")))  # one typo is enough
    with pytest.raises(ConfigError, match=r"entry 'embed_tokens' is not a Linear projection"):
        apply_lora(model, dataclasses.replace(settings, target_modules=("embed_tokens",)))
    tied = AutoRegressiveLM(dataclasses.replace(tiny_config(), tie_word_embeddings=True))
    with pytest.raises(ConfigError, match=r"entry 'lm_head' shares its weight with embed_tokens"):
        apply_lora(tied, dataclasses.replace(settings, target_modules=("lm_head",)))
    assert not any("lora_" in n for n, _ in model.named_parameters())
    for bad in ("{r: 4, target_modules: []}", "{r: 4, target_modules: ['']}"):
        with pytest.raises(ConfigError, match="model.lora: target_modules: expected a non-empty list"):
            config_from_dict({"model": {"path": "x", "lora": __import__("yaml").safe_load(bad)}})


def test_a_rank_not_below_a_targets_side_is_refused(tiny_model_dir, capsys):
    from astrai.config import ConfigError
    from astrai.train import main
    from astrai.trainer.lora import lora_summary
    model, settings = lora_model()
    sides = {n.rpartition(".")[2]: min(m.in_features, m.out_features) for n, m in model.named_modules()
             if isinstance(m, torch.nn.Linear) and n.endswith("_proj")}
    side = min(sides.values())
    assert max(sides.values()) > side  # the tiny model has a narrower projection than others (k_proj / v_proj)
    import dataclasses
    apply_lora(lora_model()[0], dataclasses.replace(settings, r=side - 1))  # the largest low rank is accepted
    with pytest.raises(ConfigError, match=rf"^model.lora.r: {side} is not below {side}, the smaller side of "):
        apply_lora(model, dataclasses.replace(settings, r=side))
    wide = max(sides.values())  # named by the narrowest targeted projection, not the first one failing
    with pytest.raises(ConfigError, match=rf"^model.lora.r: {wide} is not below {side}, .*the narrowest targeted"):
        apply_lora(model, dataclasses.replace(settings, r=wide))
    assert not any("lora_" in n for n, _ in model.named_parameters())  # refused before anything was injected
    config = config_from_dict({"model": {"path": "x", "lora": {"r": 4096}}})
    with pytest.raises(ConfigError, match="model.lora.r: 4096 is not below"):
        lora_summary(config, lora_model()[0])
    code = main(["--model.path", str(tiny_model_dir), "--model.lora", "{r: 4096}", "--data.max_prompt_length", "64",
                 "--rollout.max_new_tokens", "8", "--data.truncation", "left", "--check"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: model.lora.r: 4096 is not below"), err


def _run(tiny_model_dir, out, config, *extra):
    from astrai.train import main

    code = main(["--config", str(REPO / "configs/examples" / config), "--model.path", str(tiny_model_dir),
                 "--train.output_dir", str(out), "--train.progress_bar", "false", "--train.report_to", "none",
                 "--model.lora", "{r: 4, alpha: 8}", "--optim.learning_rate", "1e-2", *extra])
    assert code == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


SMALL_ONLINE = ("--rollout.batch_size", "2", "--rollout.max_new_tokens", "6", "--data.truncation", "left",
                "--reward.name", "toy_length")


@pytest.fixture(autouse=True)
def toy_reward(monkeypatch):
    """A reward the tiny model's responses vary in, so online updates move the adapters."""
    from astrai.rewards import builtins as rewards

    monkeypatch.setitem(rewards.BUILTIN_REWARDS, "toy_length", rewards.BuiltinReward(
        lambda prompts, completions, format_bonus=0.0, partial_credit=0.0, **_: [len(c) % 5 / 4 for c in completions],
        "toy: length mod 5"))


@pytest.mark.parametrize("config, extra", [
    ("sft.yaml", ("--max_steps", "2", "--data.max_length", "128")),
    ("seq.yaml", ("--max_steps", "2", "--data.max_length", "64")),
    ("dpo.yaml", ("--max_steps", "2", "--data.max_length", "128", "--data.truncation", "filter")),
    ("rm.yaml", ("--max_steps", "2", "--data.max_length", "128", "--data.truncation", "filter")),
    ("grpo_offline.yaml", ("--max_steps", "2", "--data.max_length", "256", "--data.truncation", "left",
                           "--grpo.kl_coef", "0.1")),
    ("grpo.yaml", ("--max_steps", "2", "--grpo.group_size", "2", "--grpo.minibatch_size", "4",
                   "--grpo.micro_batch_size", "2", "--grpo.kl_coef", "0.1", *SMALL_ONLINE)),
    ("ppo.yaml", ("--max_steps", "2", "--ppo.minibatch_size", "2", "--ppo.micro_batch_size", "1", *SMALL_ONLINE)),
])
def test_every_train_type_trains_adapters_and_checkpoints_only_them(tiny_model_dir, tmp_path, config, extra):
    records = _run(tiny_model_dir, tmp_path / "run", config, *extra)
    assert len(records) == 2
    ckpt = next((tmp_path / "run" / "checkpoints").glob("step-*"))
    files = {p.name for p in ckpt.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json"} <= files and "model.safetensors" not in files
    adapter = json.loads((ckpt / "adapter_config.json").read_text())
    assert adapter["peft_type"] == "LORA" and adapter["r"] == 4 and adapter["base_model_name_or_path"] == str(
        tiny_model_dir)
    if config == "rm.yaml":
        assert adapter["task_type"] == "SEQ_CLS" and adapter["modules_to_save"] == ["score"]
    if config == "ppo.yaml":  # the critic: its adapters and its head only
        critic = torch.load(ckpt / "value_model.pt", weights_only=True)
        assert critic and all(".lora_" in k or k.startswith("value_head.") for k in critic)
    from safetensors.torch import load_file
    moved = load_file(ckpt / "adapter_model.safetensors")
    assert any(".lora_B." in k and v.abs().max() > 0 for k, v in moved.items())  # the adapters trained
    if config in ("grpo.yaml", "ppo.yaml"):  # the second rollout ran on merged weights of an updated policy
        assert records[1]["rollout/policy_version"] > 0
        assert max(r["rollout/logprob_gap"] for r in records) < 1e-4


def test_peft_loads_the_adapter_and_the_merged_export_matches(tiny_model_dir, tmp_path):
    """transformers + peft load the checkpoint's adapter onto the base with the same logits as astrai's merged model;
    `python -m astrai.checkpoint export --merge` writes a model transformers loads with those logits too."""
    import peft
    import transformers

    from astrai.models import load_pretrained

    _run(tiny_model_dir, tmp_path / "run", "sft.yaml", "--max_steps", "2", "--data.max_length", "128")
    ckpt = next((tmp_path / "run" / "checkpoints").glob("step-*"))
    ours, _ = load_pretrained(str(ckpt))  # an adapter directory: the base with the adapter merged
    base = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    theirs = peft.PeftModel.from_pretrained(base, str(ckpt)).eval()
    with torch.no_grad():
        want = theirs(input_ids=IDS).logits
        torch.testing.assert_close(ours(IDS), want, rtol=1e-4, atol=1e-4)
        plain = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).eval()
        assert not torch.allclose(want, plain(input_ids=IDS).logits, atol=1e-4)  # the adapter moved the model
    out = tmp_path / "merged"
    proc = subprocess.run([sys.executable, "-m", "astrai.checkpoint", "export", "--merge", str(ckpt), str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=IDS).logits, want, rtol=1e-4, atol=1e-4)
    again = subprocess.run([sys.executable, "-m", "astrai.checkpoint", "export", "--merge", str(ckpt), str(out)],
                           capture_output=True, text=True)
    assert again.returncode == 2 and "exists" in again.stderr


def test_lora_resume_is_exact(tiny_model_dir, tmp_path):
    """online_grpo with LoRA: 2 steps, resume to 4 == 4 straight (metrics and the adapter tensors, bitwise)."""
    from safetensors.torch import load_file

    extra = ("--grpo.group_size", "2", "--grpo.minibatch_size", "2", "--grpo.micro_batch_size", "2",
             "--grpo.kl_coef", "0.1", "--runtime.deterministic", "true", *SMALL_ONLINE)
    straight = _run(tiny_model_dir, tmp_path / "a", "grpo.yaml", "--max_steps", "4", *extra)
    _run(tiny_model_dir, tmp_path / "b", "grpo.yaml", "--max_steps", "2", *extra)
    resumed = _run(tiny_model_dir, tmp_path / "b", "grpo.yaml", "--max_steps", "4", "--checkpoint.resume", "auto",
                   *extra)
    keys = [k for k in straight[-1] if not k.startswith("time/")]
    assert [{k: r[k] for k in keys} for r in straight[2:]] == [{k: r[k] for k in keys} for r in resumed[2:]]
    a = load_file(tmp_path / "a/checkpoints/step-00000004/adapter_model.safetensors")
    b = load_file(tmp_path / "b/checkpoints/step-00000004/adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(".lora_B." in k and v.abs().max() > 0 for k, v in a.items())  # not vacuous: they trained


def test_the_adapter_names_its_base_so_it_loads_from_any_folder(tiny_model_dir, tmp_path, monkeypatch):
    """Issue 41.8: a relative `model.path` is recorded absolute in adapter_config.json, so astrai and peft load the
    checkpoint from another folder; an alias is recorded as the absolute path of its file; a Hub id as the id."""
    import os
    import shutil

    import peft
    import transformers

    from astrai.models import load_pretrained
    from astrai.models.loading import model_reference, resolve_model_path

    job = tmp_path / "job"
    shutil.copytree(tiny_model_dir, job / "base")
    monkeypatch.chdir(job)
    _run("base", tmp_path / "run", "sft.yaml", "--max_steps", "1", "--data.max_length", "128")
    ckpt = next((tmp_path / "run" / "checkpoints").glob("step-*"))
    recorded = json.loads((ckpt / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert recorded == str(job / "base")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    ours, _ = load_pretrained(str(ckpt))
    theirs = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(recorded), str(ckpt))
    with torch.no_grad():
        torch.testing.assert_close(ours(IDS), theirs.eval()(input_ids=IDS).logits, rtol=1e-4, atol=1e-4)

    alias = model_reference("smollm2-135m-instruct")
    assert os.path.isabs(alias) and Path(alias) == resolve_model_path("smollm2-135m-instruct").absolute()
    assert model_reference("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert model_reference("./../elsewhere") == str(elsewhere)  # normalized
