"""Model configuration for the Llama family (Touvron et al. 2023, "LLaMA: Open and Efficient Foundation Language
Models"), with the Hugging Face `LlamaConfig` key names so a `config.json` round-trips to and from `transformers`.

What is simplified: only the plain Llama architecture is supported (SiLU-gated MLP, no biases, head_dim =
hidden_size / num_attention_heads, default rotary without scaling), optionally with astrai's mixture-of-experts
feed-forward (`astrai.models.moe`). Anything else raises `ValueError` when read.

End-of-sequence ids: Hugging Face `config.json` / `generation_config.json` may hold one `eos_token_id` or a list
(chat models often list the end-of-turn token next to the document end); `ModelConfig.eos_token_id` keeps what it
was given, a list included, and writes it back unchanged (`transformers` reads either form).

MoE models (`num_local_experts > 0`) are written with their own `model_type` (`MOE_MODEL_TYPE`) and the routing
fields under Mixtral's / DeepSeek's names (`num_local_experts`, `num_experts_per_tok`, `n_shared_experts`,
`router_aux_loss_coef`); their tensor names are astrai's (`mlp.router`, `mlp.experts.E.*`,
`mlp.shared_experts.K.*`), which no `transformers` class reads, so the distinct model type makes `transformers`
refuse the directory instead of loading a dense Llama with random MLPs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["ModelConfig", "MOE_MODEL_TYPE", "merge_eos_ids", "tiny_config"]

MOE_MODEL_TYPE = "astrai_llama_moe"
"""`model_type` of a config.json describing a Llama with astrai's MoE feed-forward."""
_MOE_FIELDS = ("num_local_experts", "num_experts_per_tok", "n_shared_experts", "router_aux_loss_coef")


@dataclass
class ModelConfig:
    """Shape and numerics of a Llama-family decoder.

    Fields use Hugging Face `LlamaConfig` names: vocab_size V, hidden_size H, intermediate_size (MLP width),
    num_hidden_layers L, num_attention_heads Nh, num_key_value_heads Nkv (grouped-query attention, Ainslie et al.
    2023; Nh must be a multiple of Nkv), rms_norm_eps, rope_theta (rotary base, Su et al. 2021),
    max_position_embeddings (size of the precomputed rotary table), tie_word_embeddings, and the special ids;
    `eos_token_id` is one id or a list of ids (all of them end a sequence; see `eos_token_ids`).
    MoE (`astrai.models.moe`): num_local_experts E routed experts per feed-forward (0 = dense), num_experts_per_tok
    (top-k), n_shared_experts, router_aux_loss_coef (weight of the load-balancing loss).
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
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    num_local_experts: int = 0
    num_experts_per_tok: int = 2
    n_shared_experts: int = 0
    router_aux_loss_coef: float = 0.01

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
        if self.num_local_experts and not 1 <= self.num_experts_per_tok <= self.num_local_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} must be in [1, num_local_experts "
                             f"{self.num_local_experts}]")
        if isinstance(self.eos_token_id, tuple):
            self.eos_token_id = list(self.eos_token_id)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every end-of-sequence id of the config, in order (empty when there is none)."""
        eos = self.eos_token_id
        if eos is None:
            return ()
        return tuple(int(t) for t in eos) if isinstance(eos, list) else (int(eos),)

    @property
    def head_dim(self) -> int:
        """D = hidden_size // num_attention_heads."""
        return self.hidden_size // self.num_attention_heads

    def to_hf_dict(self) -> dict[str, Any]:
        """Return a `config.json` dict that `transformers.LlamaConfig` (v4 and v5) reads as this model (a dense
        one; an MoE model gets `model_type` `MOE_MODEL_TYPE` and the MoE fields, see the module docstring).

        Writes `rope_theta` (v4 key) and `rope_parameters` (v5 key) with the same value, and `eos_token_id` as
        given (an int or a list).
        """
        d = dataclasses.asdict(self)
        moe = self.num_local_experts > 0
        if not moe:
            for key in _MOE_FIELDS:
                del d[key]
        d.update(
            architectures=["AstraiLlamaMoeForCausalLM" if moe else "LlamaForCausalLM"],
            model_type=MOE_MODEL_TYPE if moe else "llama",
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
        """Build from a Hugging Face Llama `config.json` dict (v4 `rope_theta` or v5 `rope_parameters`), or an
        astrai MoE one (`model_type` `MOE_MODEL_TYPE`). A list `eos_token_id` is kept whole.

        Raises `ValueError` naming the offending key for unsupported variants (other model_type, rotary scaling,
        biases, non-SiLU activation, head_dim != hidden_size / num_attention_heads).
        """
        model_type = d.get("model_type", "llama")
        if model_type not in ("llama", MOE_MODEL_TYPE):
            raise ValueError(f"unsupported model_type {model_type!r} in config; expected 'llama' or {MOE_MODEL_TYPE!r}")
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
            eos_token_id=_id_or_ids(d.get("eos_token_id")),
            pad_token_id=_single_id(d.get("pad_token_id")),
            **_moe_fields(d, model_type),
        )


def _moe_fields(d: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """The MoE fields of an astrai MoE config (none for a dense Llama config)."""
    if model_type != MOE_MODEL_TYPE:
        return {}
    if not int(d.get("num_local_experts") or 0):
        raise ValueError(f"model_type {MOE_MODEL_TYPE!r} needs num_local_experts >= 1")
    fields = {key: d[key] for key in _MOE_FIELDS if d.get(key) is not None}
    return {k: (float(v) if k == "router_aux_loss_coef" else int(v)) for k, v in fields.items()}


def _id_or_ids(value: Any) -> int | list[int] | None:
    """An eos id or list of ids as ints (a one-item list stays a list, as written)."""
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value] if value else None
    return None if value is None else int(value)


def _single_id(value: Any) -> int | None:
    """A bos/pad id; HF configs rarely hold a list here, and astrai keeps its first id."""
    if isinstance(value, (list, tuple)):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def merge_eos_ids(*sources: Any) -> int | list[int] | None:
    """One `eos_token_id` value from several sources (ints, lists or None), ids in first-seen order: an int when
    exactly one id results, else a list (None when there is none). E.g. config.json's `2` and
    generation_config.json's `[2, 0]` give `[2, 0]`."""
    ids: list[int] = []
    for source in sources:
        values = source if isinstance(source, (list, tuple)) else ([] if source is None else [source])
        for value in values:
            if int(value) not in ids:
                ids.append(int(value))
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else ids


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
