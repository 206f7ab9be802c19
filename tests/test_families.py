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

    return main(["--config", "configs/examples/grpo_arithmetic.yaml", "--model.path", str(path), "--train.output_dir",
                 str(tmp_path / "out"), "--data.truncation", "left", "--check"])


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "llama3", "gemma3"])
def test_train_check_accepts_each_family_directory(family_dirs, tmp_path, name, capsys, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    assert _check(family_dirs[name], tmp_path) == 0, capsys.readouterr().err
    assert "check passed" in capsys.readouterr().out


def test_train_check_refuses_an_unknown_model_type_in_one_line(family_dirs, tmp_path, capsys, monkeypatch):
    import json
    import shutil

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    path = tmp_path / "phi"
    shutil.copytree(family_dirs["qwen3"], path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "phi3"}))
    assert _check(path, tmp_path) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unsupported model_type 'phi3'" in err[0] and "config.json" in err[0], err
