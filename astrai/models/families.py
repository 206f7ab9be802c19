"""The decoder families astrai reads and writes, as per-family options of one `ModelConfig` (no class per family).

Each `Family` names its transformers `model_type` and `ForCausalLM` class, the `ModelConfig` options every config
of the family has (`fixed`), the defaults transformers' config class uses for keys a `config.json` may omit, and
two small functions: `read` (family-specific `ModelConfig` fields from a `config.json` dict, v4 and v5 key forms)
and `write` (the family-specific `config.json` keys). The deltas, from transformers' modeling files:

- llama (`modeling_llama.py`): the base; optional `attention_bias` (q, k, v, o) and `mlp_bias`; rotary scaling
  (llama3, linear, yarn; `modeling_rope_utils.py`).
- mistral (`modeling_mistral.py`): a sliding window in every layer when `sliding_window` is set.
- qwen2 (`modeling_qwen2.py`): bias on q, k, v only; the window only when `use_sliding_window` is true, on the
  layers that `layer_types` (v5) or `max_window_layers` (v4) mark sliding.
- qwen3 (`modeling_qwen3.py`): per-head RMSNorm of q and k before rotary; explicit `head_dim`; windows as qwen2.
- gemma2 (`modeling_gemma2.py`): embeddings times sqrt(H), RMSNorm as (1 + w) x, tanh-GELU MLP, norms before and
  after each sublayer, `query_pre_attn_scalar`, sliding/full layers, attention and final-logit soft-capping.
- gemma3_text (`modeling_gemma3.py`): gemma2 plus q/k norms, two rotary tables (`rope_local_base_freq` for the
  sliding layers) and no soft-capping by default.

To add a family: a `Family` here (and its GGUF names in `gguf_loading.py` if llama.cpp writes it), an option in
`ModelConfig` and `layers.py` only if the family needs math that no option covers yet, and a parity test in
tests/test_families.py (docs/models.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .rope import normalise_scaling, read_rope

ModelConfig = Any
"""What a family's functions read: an `astrai.models.config.ModelConfig` (which imports this module, so it is
named here, not imported)."""

__all__ = ["Family", "FAMILIES", "FULL", "SLIDING", "family_of"]

FULL, SLIDING = "full_attention", "sliding_attention"

# ModelConfig options whose value is fixed by the family (name -> the value a plain Llama has).
OPTION_DEFAULTS: dict[str, Any] = {
    "attention_bias": False, "qkv_bias": False, "mlp_bias": False, "qk_norm": False, "norm_unit_offset": False,
    "post_sublayer_norms": False, "scale_embeddings": False, "query_pre_attn_scalar": None,
    "attn_logit_softcapping": None, "final_logit_softcapping": None, "sliding_rope_theta": None,
    "sliding_window": None,
}


@dataclass(frozen=True)
class Family:
    """One decoder family: `model_type`, its transformers class `architecture`, the options `fixed` for every
    config of it (the other options of `OPTION_DEFAULTS` are free unless listed here), `defaults` for config.json
    keys transformers' config class fills in when absent, and the family's `read`/`write` functions."""

    model_type: str
    architecture: str
    read: Callable[[Mapping[str, Any]], dict[str, Any]]
    write: Callable[[ModelConfig], dict[str, Any]]
    fixed: Mapping[str, Any] = field(default_factory=dict)
    free: tuple[str, ...] = ()
    defaults: Mapping[str, Any] = field(default_factory=dict)

    def check(self, config: ModelConfig) -> None:
        """Raise `ValueError` (one line) when `config` sets an option this family cannot express."""
        for name, plain in OPTION_DEFAULTS.items():
            if name in self.free:
                continue
            want = self.fixed.get(name, plain)
            if getattr(config, name) != want:
                raise ValueError(f"model_type {self.model_type!r} needs {name}={want!r}, got "
                                 f"{getattr(config, name)!r}")


# shared pieces ------------------------------------------------------------------------------------------------------
def _flat_rope(d: Mapping[str, Any]) -> dict[str, Any]:
    theta, scaling = read_rope(d)
    return {"rope_theta": theta, "rope_scaling": scaling}


def _write_flat_rope(c: ModelConfig) -> dict[str, Any]:
    params = {"rope_type": "default", **(c.rope_scaling or {}), "rope_theta": float(c.rope_theta)}
    return {"rope_theta": float(c.rope_theta), "rope_scaling": dict(c.rope_scaling) if c.rope_scaling else None,
            "rope_parameters": params}


def _qwen_windows(d: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen2/Qwen3 windows: only with `use_sliding_window`; sliding layers from `layer_types` (v5) or
    `max_window_layers` (v4: layer i slides when i >= max_window_layers), as transformers' config does."""
    layers = int(d["num_hidden_layers"])
    window = d.get("sliding_window") if d.get("use_sliding_window") else None
    if window is None:
        return {"sliding_window": None, "layer_types": [FULL] * layers}
    types = d.get("layer_types") or [SLIDING if i >= int(d.get("max_window_layers", 28)) else FULL
                                     for i in range(layers)]
    return {"sliding_window": int(window), "layer_types": list(types)}


def _write_qwen_windows(c: ModelConfig) -> dict[str, Any]:
    sliding = [i for i, t in enumerate(c.layer_types) if t == SLIDING]
    return {"use_sliding_window": c.sliding_window is not None, "sliding_window": c.sliding_window,
            "max_window_layers": sliding[0] if sliding else c.num_hidden_layers, "layer_types": list(c.layer_types)}


def _whole(value: float) -> int | float:
    """An integral float as int (transformers v5's strict config fields type `query_pre_attn_scalar` as int)."""
    return int(value) if float(value).is_integer() else float(value)


def _bias(d: Mapping[str, Any], *keys: str) -> dict[str, Any]:
    return {k: bool(d.get(k, False)) for k in keys}


# families -----------------------------------------------------------------------------------------------------------
def _read_llama(d: Mapping[str, Any]) -> dict[str, Any]:
    return {**_flat_rope(d), **_bias(d, "attention_bias", "mlp_bias")}


def _write_llama(c: ModelConfig) -> dict[str, Any]:
    return {**_write_flat_rope(c), "attention_bias": c.attention_bias, "mlp_bias": c.mlp_bias,
            "hidden_act": c.hidden_act}


def _read_mistral(d: Mapping[str, Any]) -> dict[str, Any]:
    window = d.get("sliding_window")
    return {**_flat_rope(d), "sliding_window": None if window is None else int(window)}


def _write_mistral(c: ModelConfig) -> dict[str, Any]:
    if len(set(c.layer_types)) > 1:
        raise ValueError("model_type 'mistral' slides in every layer or none; layer_types mixes both")
    return {**_write_flat_rope(c), "sliding_window": c.sliding_window, "hidden_act": c.hidden_act}


def _read_qwen2(d: Mapping[str, Any]) -> dict[str, Any]:
    return {**_flat_rope(d), **_qwen_windows(d), "qkv_bias": True}


def _write_qwen2(c: ModelConfig) -> dict[str, Any]:
    return {**_write_flat_rope(c), **_write_qwen_windows(c), "hidden_act": c.hidden_act}


def _read_qwen3(d: Mapping[str, Any]) -> dict[str, Any]:
    return {**_flat_rope(d), **_qwen_windows(d), **_bias(d, "attention_bias"), "qk_norm": True}


def _write_qwen3(c: ModelConfig) -> dict[str, Any]:
    return {**_write_flat_rope(c), **_write_qwen_windows(c), "attention_bias": c.attention_bias,
            "hidden_act": c.hidden_act}


def _gemma_layer_types(d: Mapping[str, Any], pattern: int) -> list[str]:
    """`layer_types`, else the v4 pattern: layer i is full when (i + 1) % pattern == 0 (as transformers)."""
    layers = int(d["num_hidden_layers"])
    pattern = int(d.get("sliding_window_pattern", pattern))
    return list(d.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(layers)])


def _read_gemma_common(d: Mapping[str, Any], pattern: int) -> dict[str, Any]:
    if d.get("use_bidirectional_attention"):
        raise ValueError("unsupported config use_bidirectional_attention=true; astrai trains causal decoders only")
    softcaps = {k: None if d.get(k) is None else float(d[k])
                for k in ("attn_logit_softcapping", "final_logit_softcapping")}
    window = d.get("sliding_window")
    types = _gemma_layer_types(d, pattern) if window is not None else [FULL] * int(d["num_hidden_layers"])
    return {"sliding_window": None if window is None else int(window), "layer_types": types,
            "query_pre_attn_scalar": float(d["query_pre_attn_scalar"]), **softcaps,
            **_bias(d, "attention_bias")}


def _write_gemma_common(c: ModelConfig) -> dict[str, Any]:
    return {"hidden_activation": c.hidden_act, "sliding_window": c.sliding_window, "layer_types": list(c.layer_types),
            "query_pre_attn_scalar": _whole(c.query_pre_attn_scalar or c.head_dim), "attn_logit_softcapping": c.attn_logit_softcapping,
            "final_logit_softcapping": c.final_logit_softcapping, "attention_bias": c.attention_bias}


def _read_gemma2(d: Mapping[str, Any]) -> dict[str, Any]:
    return {**_flat_rope(d), **_read_gemma_common(d, 2)}


def _write_gemma2(c: ModelConfig) -> dict[str, Any]:
    return {**_write_flat_rope(c), **_write_gemma_common(c)}


def _read_gemma3(d: Mapping[str, Any]) -> dict[str, Any]:
    """Gemma 3 rotary: v5 `rope_parameters` nested per layer type, or v4 `rope_theta` (full layers, with
    `rope_scaling` on top) and `rope_local_base_freq` (sliding layers), as `Gemma3TextConfig` converts them."""
    params = d.get("rope_parameters") or {}
    nested = {t: dict(params.get(t) or {}) for t in (FULL, SLIDING)} if FULL in params or SLIDING in params else {
        FULL: {}, SLIDING: {}}
    max_pos = int(d.get("max_position_embeddings") or 131072)
    full = nested[FULL]
    if d.get("rope_scaling"):
        full.update(d["rope_scaling"])
    theta = float(full.get("rope_theta", d.get("rope_theta", 1_000_000.0)))
    local = nested[SLIDING]
    if normalise_scaling(local, f"rope_parameters.{SLIDING}", max_pos) is not None:
        raise ValueError(f"unsupported rotary scaling in rope_parameters.{SLIDING}; only the full-attention layers "
                         "may scale")
    local_theta = float(local.get("rope_theta", d.get("rope_local_base_freq", 10_000.0)))
    return {**_read_gemma_common(d, 6), "rope_theta": theta,
            "rope_scaling": normalise_scaling(full, f"rope_parameters.{FULL}", max_pos),
            "sliding_rope_theta": local_theta, "qk_norm": True}


def _write_gemma3(c: ModelConfig) -> dict[str, Any]:
    if c.sliding_rope_theta is None and c.rope_scaling:
        raise ValueError("model_type 'gemma3_text' with rope_scaling needs sliding_rope_theta (the sliding layers' "
                         "unscaled rotary base)")
    full = {"rope_type": "default", **(c.rope_scaling or {}), "rope_theta": float(c.rope_theta)}
    local = {"rope_type": "default", "rope_theta": float(c.sliding_rope_theta or c.rope_theta)}
    return {**_write_gemma_common(c), "rope_theta": float(c.rope_theta), "rope_local_base_freq": local["rope_theta"],
            "rope_scaling": dict(c.rope_scaling) if c.rope_scaling else None,
            "rope_parameters": {FULL: full, SLIDING: local}, "use_bidirectional_attention": False}


_GEMMA = {"norm_unit_offset": True, "post_sublayer_norms": True, "scale_embeddings": True}
_GEMMA_DEFAULTS = {"head_dim": 256, "tie_word_embeddings": True, "sliding_window": 4096,
                   "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh"}
FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", "LlamaForCausalLM", _read_llama, _write_llama, free=("attention_bias", "mlp_bias")),
    Family("mistral", "MistralForCausalLM", _read_mistral, _write_mistral, free=("sliding_window",),
           defaults={"sliding_window": 4096}),
    Family("qwen2", "Qwen2ForCausalLM", _read_qwen2, _write_qwen2, fixed={"qkv_bias": True},
           free=("sliding_window",)),
    Family("qwen3", "Qwen3ForCausalLM", _read_qwen3, _write_qwen3, fixed={"qk_norm": True},
           free=("attention_bias", "sliding_window"), defaults={"head_dim": 128}),
    Family("gemma2", "Gemma2ForCausalLM", _read_gemma2, _write_gemma2, fixed=_GEMMA,
           free=("attention_bias", "sliding_window", "query_pre_attn_scalar", "attn_logit_softcapping",
                 "final_logit_softcapping"),
           defaults={**_GEMMA_DEFAULTS, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}),
    Family("gemma3_text", "Gemma3ForCausalLM", _read_gemma3, _write_gemma3, fixed={**_GEMMA, "qk_norm": True},
           free=("attention_bias", "sliding_window", "query_pre_attn_scalar", "attn_logit_softcapping",
                 "final_logit_softcapping", "sliding_rope_theta"),
           defaults=_GEMMA_DEFAULTS),
)}


def family_of(model_type: str) -> Family:
    """The `Family` of `model_type`. Raises `ValueError` (one line, listing the supported types) otherwise."""
    family = FAMILIES.get(model_type)
    if family is None:
        raise ValueError(f"unsupported model_type {model_type!r} in config; supported: {', '.join(FAMILIES)} "
                         "(and astrai's MoE 'astrai_llama_moe')")
    return family
