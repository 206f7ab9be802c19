"""Model configuration of astrai's one decoder: the Llama architecture (Touvron et al. 2023, "LLaMA: Open and
Efficient Foundation Language Models") plus the per-family options of Qwen2/2.5, Qwen3, Llama 3.x, Mistral,
Gemma 2 and Gemma 3 (text), with Hugging Face key names so a `config.json` round-trips to and from `transformers`
(`model_type` picks the family; `astrai.models.families` holds what each one reads and writes).

Options (each reaches the layers and, through `astrai.models.attention.layer_attention`, the attention seam):
q/k/v and output biases, per-head q/k RMSNorm, an explicit `head_dim`, rotary scaling (llama3, linear, yarn;
`astrai.models.rope`), per-layer attention kind (`layer_types`: full, or a sliding window of `sliding_window` keys
with its own rotary base `sliding_rope_theta`), RMSNorm as `w * x` or `(1 + w) * x`, embeddings scaled by
sqrt(H), norms after each sublayer, the MLP activation (SiLU or tanh-GELU), attention and final-logit soft-capping
(tanh), `query_pre_attn_scalar` (softmax scale 1 / sqrt of it), tied embeddings; and astrai's mixture-of-experts
feed-forward (`astrai.models.moe`). Anything else raises `ValueError` in one line naming the field when read.

End-of-sequence ids: Hugging Face `config.json` / `generation_config.json` may hold one `eos_token_id` or a list
(chat models often list the end-of-turn token next to the document end); `ModelConfig.eos_token_id` keeps what it
was given, a list included, and writes it back unchanged (`transformers` reads either form).

MoE models (`num_local_experts > 0`) are written with their own `model_type` (`MOE_MODEL_TYPE`, the dense family
under `base_model_type`) and the routing fields under Mixtral's / DeepSeek's names (`num_local_experts`,
`num_experts_per_tok`, `n_shared_experts`, `router_aux_loss_coef`); their tensor names are astrai's (`mlp.router`,
`mlp.experts.E.*`, `mlp.shared_experts.K.*`), which no `transformers` class reads, so the distinct model type makes
`transformers` refuse the directory instead of loading a dense model with random MLPs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .families import FULL, SLIDING, family_of
from .rope import normalise_scaling
from .tokenizer import TINY_VOCAB_SIZE

__all__ = ["ModelConfig", "MOE_MODEL_TYPE", "ACTIVATIONS", "merge_eos_ids", "tiny_config"]

MOE_MODEL_TYPE = "astrai_llama_moe"
"""`model_type` of a config.json describing an astrai model with the MoE feed-forward."""
_MOE_FIELDS = ("num_local_experts", "num_experts_per_tok", "n_shared_experts", "router_aux_loss_coef")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
"""MLP activations: SiLU (SwiGLU, Shazeer 2020) and the tanh approximation of GELU (GeGLU, Gemma)."""
_LAYER_KINDS = (FULL, SLIDING)


@dataclass
class ModelConfig:
    """Shape, numerics and family options of the decoder.

    Fields use Hugging Face names: vocab_size V, hidden_size H, intermediate_size (MLP width), num_hidden_layers L,
    num_attention_heads Nh, num_key_value_heads Nkv (grouped-query attention, Ainslie et al. 2023; Nh a multiple
    of Nkv), head_dim D (None: H / Nh), rms_norm_eps, rope_theta (rotary base, Su et al. 2021),
    max_position_embeddings (longest sequence the engine admits), tie_word_embeddings, the special ids
    (`eos_token_id` one id or a list, see `eos_token_ids`), and `model_type` (the family, `astrai.models.families`).
    Family options (defaults = plain Llama): attention_bias (q, k, v and o), qkv_bias (q, k, v only: Qwen2),
    mlp_bias, qk_norm (per-head RMSNorm of q and k before rotary), hidden_act (`ACTIVATIONS`), rope_scaling (a
    dict of `astrai.models.rope.normalise_scaling`; None = default rotary) for the full-attention layers,
    sliding_window W (a sliding query sees its last W keys, itself included) and layer_types (L of
    "full_attention" / "sliding_attention"; None: all sliding when W is set, else all full), sliding_rope_theta (the
    sliding layers' unscaled rotary base; None: they share the full layers' rotary), query_pre_attn_scalar (softmax
    scale 1 / sqrt of it; None: 1 / sqrt(D)), attn_logit_softcapping / final_logit_softcapping (c * tanh(x / c) on
    the attention scores / the logits; None: off), norm_unit_offset (RMSNorm applies (1 + w)), post_sublayer_norms
    (RMSNorm after attention and after the MLP too), scale_embeddings (embeddings times sqrt(H)).
    MoE (`astrai.models.moe`): num_local_experts E routed experts per feed-forward (0 = dense), num_experts_per_tok
    (top-k), n_shared_experts, router_aux_loss_coef (weight of the load-balancing loss).
    Raises `ValueError` from `__post_init__` (one line naming the field) for inconsistent shapes or options.
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
    model_type: str = "llama"
    head_dim: int | None = None
    attention_bias: bool = False
    qkv_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    rope_scaling: dict[str, Any] | None = None
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    sliding_rope_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    norm_unit_offset: bool = False
    post_sublayer_norms: bool = False
    scale_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                                 f"{self.num_attention_heads} (set head_dim explicitly)")
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")
        for name in ("num_local_experts", "num_experts_per_tok", "n_shared_experts"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if not isinstance(self.router_aux_loss_coef, (int, float)) or isinstance(self.router_aux_loss_coef, bool) \
                or not self.router_aux_loss_coef >= 0:
            raise ValueError(f"router_aux_loss_coef must be a number >= 0, got {self.router_aux_loss_coef!r}")
        if self.num_local_experts and not 1 <= self.num_experts_per_tok <= self.num_local_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} must be in [1, num_local_experts "
                             f"{self.num_local_experts}]")
        if isinstance(self.eos_token_id, tuple):
            self.eos_token_id = list(self.eos_token_id)
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; expected one of {', '.join(ACTIVATIONS)}")
        self.rope_scaling = normalise_scaling(self.rope_scaling, "rope_scaling", self.max_position_embeddings)
        self._check_layers()
        for name in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 or None, got {value!r}")
        family_of(self.model_type).check(self)

    def _check_layers(self) -> None:
        """Resolve `layer_types` (None: all sliding when a window is set, else all full) and check it."""
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool) or self.sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive integer or None, got {self.sliding_window!r}")
        if self.layer_types is None:
            kind = SLIDING if self.sliding_window is not None else FULL
            self.layer_types = [kind] * self.num_hidden_layers
        self.layer_types = list(self.layer_types)
        if len(self.layer_types) != self.num_hidden_layers or any(t not in _LAYER_KINDS for t in self.layer_types):
            raise ValueError(f"layer_types must list {self.num_hidden_layers} of {', '.join(_LAYER_KINDS)}, got "
                             f"{self.layer_types}")
        if SLIDING in self.layer_types and self.sliding_window is None:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is None")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every end-of-sequence id of the config, in order (empty when there is none)."""
        eos = self.eos_token_id
        if eos is None:
            return ()
        return tuple(int(t) for t in eos) if isinstance(eos, list) else (int(eos),)

    @property
    def attention_scale(self) -> float:
        """Softmax scale of the attention scores: query_pre_attn_scalar ** -0.5, else head_dim ** -0.5."""
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_window(self, layer_idx: int) -> int | None:
        """The sliding window of layer `layer_idx` (None: full causal attention)."""
        return self.sliding_window if self.layer_types[layer_idx] == SLIDING else None

    def generation_config_dict(self) -> dict[str, Any]:
        """A `generation_config.json` dict: the special ids transformers' and vLLM's `generate` stop and pad with
        (`eos_token_id` every id of `eos_token_ids`, as a list when there are several); only the ids that are set.
        Its sampling settings are left to the library's defaults."""
        eos = list(self.eos_token_ids)
        d: dict[str, Any] = {"bos_token_id": self.bos_token_id,
                             "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
                             "pad_token_id": self.pad_token_id}
        return {k: v for k, v in d.items() if v is not None}

    def to_hf_dict(self) -> dict[str, Any]:
        """Return a `config.json` dict that transformers' config class of `model_type` (v4 and v5) reads as this
        model; an MoE model gets `model_type` `MOE_MODEL_TYPE`, its family under `base_model_type`, and the MoE
        fields (see the module docstring). Rotary is written in both forms (v4 `rope_theta` + `rope_scaling`, v5
        `rope_parameters`), and `eos_token_id` as given (an int or a list).
        """
        family = family_of(self.model_type)
        d: dict[str, Any] = {k: getattr(self, k) for k in _COMMON_KEYS}
        moe = self.num_local_experts > 0
        if moe:
            d.update({key: getattr(self, key) for key in _MOE_FIELDS}, base_model_type=self.model_type)
        d.update(
            architectures=["AstraiLlamaMoeForCausalLM" if moe else family.architecture],
            model_type=MOE_MODEL_TYPE if moe else self.model_type,
            attention_dropout=0.0,
            initializer_range=0.02,
            use_cache=True,
        )
        d.update(family.write(self))
        return d

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face `config.json` dict of a supported `model_type` (`astrai.models.families`;
        v4 `rope_theta` / `rope_scaling` or v5 `rope_parameters`, `type` or `rope_type`), or an astrai MoE one
        (`model_type` `MOE_MODEL_TYPE`). Keys the family's transformers config class defaults are defaulted the
        same way. A list `eos_token_id` is kept whole.

        Raises `ValueError` (one line, naming the key) for an unknown model_type and unsupported variants (rotary
        types other than default/linear/llama3/yarn, partial rotary, activations other than `ACTIVATIONS`,
        bidirectional attention); `KeyError` for a missing shape key.
        """
        model_type = d.get("model_type", "llama")
        if model_type == MOE_MODEL_TYPE:
            model_type = d.get("base_model_type", "llama")
        family = family_of(model_type)
        d = {**family.defaults, **d}
        heads = d["num_attention_heads"]
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or None,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=_single_id(d.get("bos_token_id")),
            eos_token_id=_id_or_ids(d.get("eos_token_id")),
            pad_token_id=_single_id(d.get("pad_token_id")),
            model_type=model_type,
            hidden_act=d.get("hidden_activation") or d.get("hidden_act") or "silu",
            **{**family.read(d), **family.fixed},
            **_moe_fields(d),
        )


_COMMON_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
                "bos_token_id", "eos_token_id", "pad_token_id")


def _moe_fields(d: Mapping[str, Any]) -> dict[str, Any]:
    """The MoE fields of an astrai MoE config (none for a dense config)."""
    if d.get("model_type") != MOE_MODEL_TYPE:
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
