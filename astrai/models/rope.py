"""Rotary position embedding parameters (RoFormer, Su et al. 2021) and the frequency scalings the supported
families ship, read from a Hugging Face `config.json` in either transformers form.

- default: `inv_freq_i = theta ** (-2i / D)`, i = 0 .. D/2 - 1.
- linear (position interpolation, Chen et al. 2023, "Extending Context Window of Large Language Models via
  Positional Interpolation"): `inv_freq / factor`.
- llama3 (Meta's Llama 3.1 scaling, as transformers' `_compute_llama3_parameters`): wavelengths above
  `original_max_position_embeddings / low_freq_factor` are divided by `factor`, below
  `original_max_position_embeddings / high_freq_factor` kept, and interpolated smoothly in between.
- yarn (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language Models", section 3):
  per-dimension blend of interpolated and extrapolated frequencies by a linear ramp between the correction dims of
  `beta_fast` and `beta_slow` rotations, and cos/sin scaled by the attention factor `0.1 * ln(factor) + 1`
  (or mscale / mscale_all_dim as DeepSeek writes it).

Config forms: transformers v4 writes `rope_theta` and `rope_scaling` (`{"type" | "rope_type": ..., factor ...}`);
v5 writes `rope_parameters` (`{"rope_type": ..., "rope_theta": ..., ...}`); models with two rotary tables nest it per
layer type (Gemma 3: `{"full_attention": {...}, "sliding_attention": {...}}`, read by `astrai.models.families`). What is simplified: the
dynamic, longrope and proportional types and partial rotary (`partial_rotary_factor` < 1) are refused in one line
naming the field.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

__all__ = ["ROPE_TYPES", "read_rope", "normalise_scaling", "inverse_frequencies"]

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_FLOAT_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "attention_factor", "beta_fast", "beta_slow",
               "mscale", "mscale_all_dim")
_REQUIRED = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
             "yarn": ()}


def normalise_scaling(spec: Mapping[str, Any] | None, field: str,
                      max_position_embeddings: int) -> dict[str, Any] | None:
    """A rotary scaling dict in astrai's form: `{"rope_type": kind, <its parameters>}` with floats, or None for
    default rotary. Accepts `type` or `rope_type`; `rope_theta` and `partial_rotary_factor` 1.0 are dropped.
    `original_max_position_embeddings` defaults to `max_position_embeddings` for llama3 and yarn (as transformers).

    Raises:
        ValueError: one line naming `field`, for an unimplemented rope type, partial rotary, or a missing parameter.
    """
    if not spec:
        return None
    kind = spec.get("rope_type", spec.get("type", "default")) or "default"
    if kind not in ROPE_TYPES:
        raise ValueError(f"unsupported rotary scaling {field}.rope_type={kind!r}; implemented: {', '.join(ROPE_TYPES)}")
    partial = spec.get("partial_rotary_factor")
    if partial is not None and float(partial) != 1.0:
        raise ValueError(f"unsupported {field}.partial_rotary_factor={partial}; only full rotary is implemented")
    if kind == "default":
        return None
    missing = [k for k in _REQUIRED[kind] if spec.get(k) is None]
    if missing:
        raise ValueError(f"rotary scaling {field}: rope_type {kind!r} needs {', '.join(missing)}")
    out: dict[str, Any] = {"rope_type": kind}
    for key in _FLOAT_KEYS:
        if spec.get(key) is not None:
            out[key] = float(spec[key])
    if kind in ("llama3", "yarn"):
        out["original_max_position_embeddings"] = int(spec.get("original_max_position_embeddings")
                                                      or max_position_embeddings)
    if kind == "yarn" and "truncate" in spec:
        out["truncate"] = bool(spec["truncate"])
    return out


def read_rope(d: Mapping[str, Any], *, default_theta: float = 10000.0) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling) of a flat (one rotary table) config dict, with transformers v5's precedence: the v4
    `rope_scaling` dict when present, else v5 `rope_parameters`; the base is that dict's `rope_theta`, else the
    top-level `rope_theta`, else `default_theta`. `scaling` as `normalise_scaling` returns it.

    Raises:
        ValueError: as `normalise_scaling` (naming `rope_scaling` or `rope_parameters`).
    """
    legacy, params = d.get("rope_scaling"), d.get("rope_parameters")
    spec, field = (legacy, "rope_scaling") if legacy else (params or {}, "rope_parameters")
    if not isinstance(spec, Mapping):
        raise ValueError(f"{field}: expected a mapping, got {type(spec).__name__}")
    theta = spec.get("rope_theta", d.get("rope_theta", default_theta))
    return float(theta), normalise_scaling(spec, field, int(d.get("max_position_embeddings") or 2048))


def _yarn(pos_freqs: torch.Tensor, dim: int, theta: float, s: Mapping[str, Any],
          max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """YaRN frequencies and attention factor (Peng et al. 2023, section 3; transformers' `_compute_yarn_parameters`)."""
    original = s["original_max_position_embeddings"]
    factor = s.get("factor") or max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s.get("attention_factor")
    if attention is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32.0, s.get("beta_slow") or 1.0

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(pos_freqs.device)
    extrapolation = 1 - ramp
    blended = 1.0 / (factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation
    return blended, float(attention)


def _llama3(inv_freq: torch.Tensor, s: Mapping[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling (transformers' `_compute_llama3_parameters`)."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    original = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def inverse_frequencies(head_dim: int, theta: float, scaling: Mapping[str, Any] | None,
                        max_position_embeddings: int, device: Any = None) -> tuple[torch.Tensor, float]:
    """(inv_freq (D/2,) float32 on `device`, attention factor) for head dim D, base `theta` and a scaling dict of
    `normalise_scaling` (None: default rotary). The factor multiplies cos and sin (1.0 except for yarn)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    kind = scaling["rope_type"] if scaling else "default"
    if kind == "yarn":
        return _yarn(theta ** exponents, head_dim, theta, scaling, max_position_embeddings)
    inv_freq = 1.0 / (theta ** exponents)
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    return inv_freq, 1.0
