"""Every supported family exact against transformers on tiny random models built by transformers itself
(tests/family_models.py): logits over sequences past the sliding windows, greedy continuations through the paged
engine (its dense decode cache and its paged path), a contiguous KV cache and `generate`, the critic, and the HF
export loaded back by transformers as the same class."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from astrai.checkpoint import publish_checkpoint
from astrai.checkpoint.parts import Part
from astrai.models import TINY_VOCAB_SIZE, AutoRegressiveLM, KVCache, ModelConfig, ValueModel
from astrai.rollout.paged_engine import PagedGenerationEngine
from astrai.rollout.sampling import SamplingParams
from family_models import CASES, WINDOW, WINDOWED, astrai_twin, hf_model

transformers = pytest.importorskip("transformers")
FAMILIES = [name for name in CASES if name != "gemma3_gguf_shape"]
LENGTH, NEW = 192, 64


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request):
    hf = hf_model(request.param)
    return request.param, hf, astrai_twin(hf)


def _ids(rows: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, TINY_VOCAB_SIZE, (rows, length), generator=torch.Generator().manual_seed(seed))


def test_logits_equal_transformers_past_the_window(pair):
    name, hf, model = pair
    ids = _ids(2, LENGTH)
    with torch.no_grad():
        diff = (model(ids) - hf(ids).logits).abs().max().item()
    print(f"{name}: max |logits - transformers| over {LENGTH} tokens = {diff:.2e}")
    assert diff <= 1e-4


def test_left_padded_rows_equal_transformers(pair):
    """A left-padded batch (one row 40 tokens shorter) with position ids from the mask, as the trainer scores."""
    name, hf, model = pair
    ids = _ids(2, 160, seed=2)
    mask = torch.ones_like(ids)
    mask[1, :40] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ours = model(ids, attention_mask=mask, position_ids=positions)
        theirs = hf(ids, attention_mask=mask, position_ids=positions).logits
    real = mask.bool()
    assert (ours[real] - theirs[real]).abs().max().item() <= 1e-4


def test_packed_rows_equal_separate_rows(pair):
    """Padding-free packing (`seq_lengths`) of two sequences longer than the window equals each one alone."""
    _, _, model = pair
    a, b = _ids(1, 90, seed=3), _ids(1, 70, seed=4)
    positions = torch.cat([torch.arange(90), torch.arange(70)])[None]
    with torch.no_grad():
        packed = model(torch.cat([a, b], dim=1), position_ids=positions, seq_lengths=[90, 70])
        alone = torch.cat([model(a), model(b)], dim=1)
    assert (packed - alone).abs().max().item() <= 1e-4


def _kv_cache_greedy(model: AutoRegressiveLM, prompt: list[int], new: int) -> list[int]:
    cache = KVCache.allocate(model.config, 1, len(prompt) + new)
    ids, out = torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(new):
            token = int(model(ids, kv_cache=cache, logits_to_keep=1)[0, -1].argmax())
            out.append(token)
            ids = torch.tensor([[token]])
    return out


def test_greedy_continuations_equal_transformers_generate(pair):
    """64 greedy tokens after a 110-token prompt (174 > window 32): the paged engine with its dense decode cache,
    without it (paged gathers), a contiguous KV cache and transformers' `generate` agree token for token."""
    name, hf, model = pair
    prompts = [_ids(1, 110, seed=5)[0].tolist(), _ids(1, 45, seed=6)[0].tolist()]
    params = SamplingParams(max_new_tokens=NEW, temperature=1.0, top_k=1)
    runs = {}
    for dense in (True, False):
        engine = PagedGenerationEngine(model, pad_token_id=2, backend="torch", block_size=8, dense_decode=dense)
        gen = engine.generate(prompts, params, torch.Generator().manual_seed(0))
        runs[f"engine dense={dense}"] = [gen.response_ids[r][gen.action_mask[r]].tolist() for r in range(2)]
    runs["kv cache"] = [_kv_cache_greedy(model, p, NEW) for p in prompts]
    with torch.no_grad():
        runs["transformers"] = [hf.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW,
                                            do_sample=False)[0, len(p):].tolist() for p in prompts]
    reference = runs["transformers"]
    assert all(len(r) == NEW for r in reference)
    for label, rows in runs.items():
        assert rows == reference, (name, label)


def test_critic_builds_and_matches_the_policy_trunk(pair):
    _, _, model = pair
    ids = _ids(2, 80, seed=7)
    for layers in (None, 1):
        critic = ValueModel.from_policy(model, num_layers=layers)
        with torch.no_grad():
            values = critic(ids)
        assert values.shape == (2, 80) and torch.count_nonzero(values) == 0
    critic = ValueModel.from_policy(model)
    with torch.no_grad():
        torch.testing.assert_close(critic.model(ids), model.model(ids), rtol=0, atol=0)


def test_hf_export_loads_in_transformers_as_the_same_class(pair, tmp_path):
    name, hf, model = pair
    path = publish_checkpoint(tmp_path, 1, {"policy": Part(model, "hf_model")})
    loaded = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    assert type(loaded) is type(hf)
    ids = _ids(1, LENGTH, seed=8)
    with torch.no_grad():
        assert (loaded(ids).logits - hf(ids).logits).abs().max().item() <= 1e-5
    assert ModelConfig.from_hf_dict(loaded.config.to_dict()) == model.config


@pytest.mark.parametrize("name", WINDOWED)
def test_windows_are_real(name):
    """The same weights with a window longer than the sequence give other logits past the real window (and the
    same before it): the windowed parity above can fail."""
    hf = hf_model(name)
    model = astrai_twin(hf)
    config = dataclasses.replace(model.config, sliding_window=10**6)
    unwindowed = AutoRegressiveLM(config).eval()
    unwindowed.load_state_dict(model.state_dict())
    ids = _ids(1, 3 * WINDOW)
    with torch.no_grad():
        early = (unwindowed(ids)[:, :WINDOW] - model(ids)[:, :WINDOW]).abs().max().item()
        late = (unwindowed(ids)[:, WINDOW:] - model(ids)[:, WINDOW:]).abs().max().item()
    assert early <= 1e-5 and late > 0.1


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    """Qwen2.5-, Qwen3-, Llama-3.2- and Gemma-3-shaped directories as transformers saves them (+ tiny tokenizer)."""
    from astrai.models import tiny_tokenizer

    dirs = {}
    for name in ("qwen2", "qwen3", "llama3", "gemma3"):
        path = tmp_path_factory.mktemp(name)
        hf_model(name).save_pretrained(path)
        tiny_tokenizer().save(path)
        dirs[name] = path
    return dirs


def _check(path, tmp_path) -> int:
    from astrai.train import main

    return main(["--config", str(Path(__file__).resolve().parents[1] / "configs/examples/grpo_arithmetic.yaml"), "--model.path", str(path), "--train.output_dir",
                 str(tmp_path / "out"), "--data.truncation", "left", "--check"])


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "llama3", "gemma3"])
def test_train_check_accepts_each_family_directory(family_dirs, tmp_path, name, capsys):
    assert _check(family_dirs[name], tmp_path) == 0, capsys.readouterr().err
    assert "check passed" in capsys.readouterr().out


def test_train_check_refuses_an_unknown_model_type_in_one_line(family_dirs, tmp_path, capsys):
    import json
    import shutil

    path = tmp_path / "phi"
    shutil.copytree(family_dirs["qwen3"], path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "phi3"}))
    assert _check(path, tmp_path) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unsupported model_type 'phi3'" in err[0] and "config.json" in err[0], err


@pytest.mark.parametrize("change,message", [
    ({"model_type": "phi3"}, "unsupported model_type 'phi3' in config; supported: llama, mistral, qwen2, qwen3"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     "unsupported rotary scaling rope_scaling.rope_type='dynamic'; implemented: default, linear, llama3, yarn"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}, "rope_scaling": None},
     "unsupported rotary scaling rope_parameters.rope_type='longrope'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
      "rope_scaling": None}, "unsupported rope_parameters.partial_rotary_factor=0.5"),
    ({"rope_scaling": {"type": "llama3", "factor": 8.0}}, "rope_type 'llama3' needs low_freq_factor"),
    ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'; expected one of silu, gelu_pytorch_tanh"),
])
def test_refusals_are_one_line_naming_the_field(change, message):
    d = {**hf_model("qwen3").config.to_dict(), **change}
    with pytest.raises(ValueError) as e:
        ModelConfig.from_hf_dict(d)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_gemma_refusals_and_family_options_are_checked():
    d = hf_model("gemma3").config.to_dict()
    with pytest.raises(ValueError, match="use_bidirectional_attention=true"):
        ModelConfig.from_hf_dict({**d, "use_bidirectional_attention": True})
    nested = {**d["rope_parameters"], "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}
    with pytest.raises(ValueError, match="rope_parameters.sliding_attention"):
        ModelConfig.from_hf_dict({**d, "rope_parameters": nested})
    config = ModelConfig.from_hf_dict(hf_model("qwen2").config.to_dict())
    with pytest.raises(ValueError, match="model_type 'qwen2' needs qkv_bias=True, got False"):
        dataclasses.replace(config, qkv_bias=False)


def test_v4_config_forms_read_as_the_v5_ones():
    """transformers v4 keys: `rope_scaling` with `type` and a top-level `rope_theta` (Llama 3.1), Qwen2.5's
    `sliding_window` with `use_sliding_window: false` (no window), Gemma 3's `rope_local_base_freq` and
    `sliding_window_pattern`."""
    llama = ModelConfig.from_hf_dict({**hf_model("llama3").config.to_dict(), "rope_parameters": None,
                                      "rope_theta": 500000.0, "rope_scaling": {
                                          "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}})
    assert llama == astrai_twin(hf_model("llama3")).config
    qwen = ModelConfig.from_hf_dict({"model_type": "qwen2", "vocab_size": 100, "hidden_size": 64,
                                     "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                                     "num_key_value_heads": 2, "sliding_window": 32768, "use_sliding_window": False,
                                     "max_window_layers": 1, "rope_theta": 1e6})
    assert qwen.sliding_window is None and set(qwen.layer_types) == {"full_attention"} and qwen.qkv_bias
    gemma = hf_model("gemma3_gguf_shape").config.to_dict()
    v4 = {k: v for k, v in gemma.items() if k not in ("rope_parameters", "layer_types")}
    v4.update(rope_theta=1e6, rope_local_base_freq=1e4, sliding_window_pattern=6)
    assert ModelConfig.from_hf_dict(v4) == ModelConfig.from_hf_dict(gemma)
