"""Model configuration for the Llama family (Touvron et al. 2023, "LLaMA: Open and Efficient Foundation Language
Models"), with the Hugging Face `LlamaConfig` key names so a `config.json` round-trips to and from `transformers`.

What is simplified: only the plain Llama architecture is supported (SiLU-gated MLP, no biases, head_dim =
hidden_size / num_attention_heads, default rotary without scaling). Anything else raises `ValueError` when read.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["ModelConfig", "tiny_config"]


@dataclass
class ModelConfig:
    """Shape and numerics of a Llama-family decoder.

    Fields use Hugging Face `LlamaConfig` names: vocab_size V, hidden_size H, intermediate_size (MLP width),
    num_hidden_layers L, num_attention_heads Nh, num_key_value_heads Nkv (grouped-query attention, Ainslie et al.
    2023; Nh must be a multiple of Nkv), rms_norm_eps, rope_theta (rotary base, Su et al. 2021),
    max_position_embeddings (size of the precomputed rotary table), tie_word_embeddings, and the special ids.
    Raises `ValueError` from `__post_init__` when the shapes are inconsistent.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads {self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        """D = hidden_size // num_attention_heads."""
        return self.hidden_size // self.num_attention_heads

    def to_hf_dict(self) -> dict[str, Any]:
        """Return a `config.json` dict that `transformers.LlamaConfig` (v4 and v5) reads as this model.

        Writes `rope_theta` (v4 key) and `rope_parameters` (v5 key) with the same value.
        """
        d = dataclasses.asdict(self)
        d.update(
            architectures=["LlamaForCausalLM"],
            model_type="llama",
            hidden_act="silu",
            head_dim=self.head_dim,
            attention_bias=False,
            mlp_bias=False,
            attention_dropout=0.0,
            initializer_range=0.02,
            rope_scaling=None,
            rope_parameters={"rope_type": "default", "rope_theta": float(self.rope_theta)},
            use_cache=True,
        )
        return d

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face Llama `config.json` dict (v4 `rope_theta` or v5 `rope_parameters`).

        Raises `ValueError` naming the offending key for unsupported variants (other model_type, rotary scaling,
        biases, non-SiLU activation, head_dim != hidden_size / num_attention_heads).
        """
        model_type = d.get("model_type", "llama")
        if model_type != "llama":
            raise ValueError(f"unsupported model_type {model_type!r} in config; expected 'llama'")
        rope = d.get("rope_parameters") or {}
        scaling = d.get("rope_scaling") or {}
        for spec in (rope, scaling):
            kind = spec.get("rope_type", spec.get("type", "default"))
            if kind not in (None, "default"):
                raise ValueError(f"unsupported rotary scaling {kind!r} in config; only default rotary is implemented")
        for key in ("attention_bias", "mlp_bias"):
            if d.get(key):
                raise ValueError(f"unsupported config {key}=true; the Llama implementation has no biases")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {d['hidden_act']!r}; expected 'silu'")
        heads = d["num_attention_heads"]
        head_dim = d.get("head_dim")
        if head_dim is not None and head_dim != d["hidden_size"] // heads:
            raise ValueError(f"unsupported head_dim {head_dim} != hidden_size / num_attention_heads")
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=_single_id(d.get("bos_token_id")),
            eos_token_id=_single_id(d.get("eos_token_id")),
            pad_token_id=_single_id(d.get("pad_token_id")),
        )


def _single_id(value: Any) -> int | None:
    """HF configs may hold a list of eos ids; astrai keeps the first."""
    if isinstance(value, (list, tuple)):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def tiny_config(vocab_size: int | None = None, **overrides: Any) -> ModelConfig:
    """A small random-init config for tests: H=64, L=2, Nh=4, Nkv=2, intermediate 128, max positions 256.

    `vocab_size` defaults to the size of `astrai.models.tiny_tokenizer()`; special ids match that tokenizer
    (bos=<|im_start|>=1, eos=pad=<|im_end|>=2). Any field can be overridden by keyword.
    """
    if vocab_size is None:
        from .tokenizer import TINY_VOCAB_SIZE

        vocab_size = TINY_VOCAB_SIZE
    fields: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    fields.update(overrides)
    return ModelConfig(**fields)
