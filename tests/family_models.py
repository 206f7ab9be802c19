"""Tiny random-weight models of every supported family, built by `transformers` itself (its config class and
`ForCausalLM`, float32, eager attention), and the astrai model holding the same weights.

Windows are 32 keys, so the parity tests' 160+ token sequences run far past them; Gemma 3 also scales its full
layers' rotary (linear, factor 2) and uses a query_pre_attn_scalar unlike head_dim; Qwen3 and Mistral have a head_dim
unlike hidden / heads; the Llama cases scale rotary as Llama 3.1 (llama3, with a short original context so the
scaling moves real frequencies), yarn and linear (with attention and MLP biases). Weights are redrawn at a scale
(std 0.15, norms 1 +- 0.2) where the logits are O(5), so a wrong detail shows as a difference of order 1.
"""

from __future__ import annotations

import pytest
import torch

from astrai.models import TINY_VOCAB_SIZE, AutoRegressiveLM, ModelConfig

WINDOW = 32
BASE = dict(vocab_size=TINY_VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
            pad_token_id=2, rms_norm_eps=1e-6)
SLIDING, FULL = "sliding_attention", "full_attention"
CASES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(tie_word_embeddings=True, use_sliding_window=False, sliding_window=WINDOW)),  # Qwen2.5: no window
    "qwen2_window": ("Qwen2Config", "Qwen2ForCausalLM",
                     dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, rope_theta=1e6, tie_word_embeddings=True)),
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64, "rope_theta": 500000.0})),
    "llama_yarn": ("LlamaConfig", "LlamaForCausalLM", dict(max_position_embeddings=256, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0})),
    "llama_linear_bias": ("LlamaConfig", "LlamaForCausalLM", dict(attention_bias=True, mlp_bias=True, rope_parameters={
        "rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW, head_dim=32)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=3, num_key_value_heads=1, head_dim=32, sliding_window=WINDOW,
        layer_types=[SLIDING, SLIDING, FULL], query_pre_attn_scalar=24,
        rope_parameters={FULL: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                         SLIDING: {"rope_type": "default", "rope_theta": 1e4}})),
    "gemma3_gguf_shape": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(  # what llama.cpp assumes for Gemma 3
        num_hidden_layers=6, num_key_value_heads=1, head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=32,
        rope_parameters={FULL: {"rope_type": "default", "rope_theta": 1e6},
                         SLIDING: {"rope_type": "default", "rope_theta": 1e4}})),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
        final_logit_softcapping=30.0)),
}
"""name -> (transformers config class, ForCausalLM class, config overrides on `BASE`)."""
WINDOWED = ("qwen2_window", "mistral", "gemma3", "gemma2")


def hf_model(name: str, seed: int = 0):
    """The transformers model of case `name` (eval, float32, eager attention, weights redrawn from `seed`)."""
    transformers = pytest.importorskip("transformers")
    config_class, model_class, overrides = CASES[name]
    config = getattr(transformers, config_class)(**{**BASE, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).eval()
    gemma = name.startswith("gemma")
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:  # Gemma's weights are offsets from 1
                param.copy_((0.0 if gemma else 1.0) + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.15)
    model.generation_config.eos_token_id = None  # greedy continuations run their full length
    return model


def astrai_twin(hf) -> AutoRegressiveLM:
    """astrai's model of `hf`'s config.json dict, holding `hf`'s weights (eval)."""
    model = AutoRegressiveLM(ModelConfig.from_hf_dict(hf.config.to_dict())).eval()
    model.load_state_dict(hf.state_dict(), strict=True)
    return model
