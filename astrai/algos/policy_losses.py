"""Policy losses by name: PPO-clip (decoupled clip range, dual-clip), GSPO and CISPO, one calling convention.

Methods:
- ``ppo_clip``: PPO's clipped surrogate (Schulman et al. 2017, "Proximal Policy Optimization Algorithms") with the
  decoupled range ``[1 - clip_ratio_low, 1 + clip_ratio_high]`` (DAPO's clip-higher: Yu et al. 2025, "DAPO: An
  Open-Source LLM Reinforcement Learning System at Scale", section 3.1) and optional dual-clip (Ye et al. 2020,
  "Mastering Complex Control in MOBA Games with Deep Reinforcement Learning", section 3.2): for ``A < 0`` the
  per-token loss is bounded by ``-A * clip_ratio_c`` (c > 1), as verl's ``compute_policy_loss_vanilla``.
- ``gspo``: Group Sequence Policy Optimization (Zheng et al. 2025, section 4): the clip acts on the sequence ratio
  ``s_i = exp(mean_t (logprobs - old_logprobs))`` over the response's real tokens. Implemented in the GSPO-token
  form (section 4.3): ``s_it = sg(s_i) * exp(logprobs_t - sg(logprobs_t))``, whose value is ``s_i`` at every token
  and whose gradient is ``s_i * grad logprobs_t``, so per-token advantages are allowed; with equal token advantages
  and ``seq-mean-token-mean`` it equals the sequence form in value and gradient (tested).
- ``cispo``: CISPO (MiniMax 2025, "MiniMax-M1", section 3.1, eq. 4-5):
  ``l_t = -sg(clip(ratio_t, 1 - clip_ratio_low, 1 + clip_ratio_high)) * A_t * logprobs_t``: the importance weight
  is clipped and detached, so no token loses its gradient. Bounds as verl's ``compute_policy_loss_cispo`` (both
  sides, from the two ratios); MiniMax-M1 effectively clips only from above (a large epsilon_low), which is
  ``clip_ratio_low = 1``; TRL's ``cispo`` clips at ``max=epsilon_high`` only, an absolute bound.

Convention (every loss, `PolicyLossFn`): ``fn(logprobs, old_logprobs, advantages, action_mask, *, clip_ratio_low,
clip_ratio_high, clip_ratio_c=None, loss_agg_mode="token-mean", num_units=None, loss_scale_factor=None,
weights=None) -> (loss, metrics)``. All tensors (B, T); masked positions (even NaN) influence nothing. The per-token
loss is multiplied by ``weights`` (detached; e.g. rollout-correction weights, 0 for a dropped token, which then
adds nothing to loss or gradient) and aggregated by `aggregation.aggregate_loss`; with ``num_units`` (the step's
`loss_units`) the loss and every metric are this micro-batch's additive share. Metrics are aggregated with
`aggregation.metric_agg_mode` (token mean, or sequence mean of token means under the seq-mean modes):
``policy/clipfrac``, ``policy/approx_kl`` (k3, ``d = old_logprobs - logprobs``), ``policy/ratio_mean`` (the ratio
the surrogate uses: per token, or ``s_i`` for GSPO), and ``policy/clipfrac_lower`` (dual-clip active) when
``clip_ratio_c`` is set. Metrics ignore ``weights``. Adding a loss is one function, its `registry.POLICY_LOSSES`
entry and one `_FUNCTIONS` entry.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Protocol

import torch

from .aggregation import aggregate_loss, metric_agg_mode
from .kl import kl_estimate
from .masked import _real
from .registry import POLICY_LOSSES as POLICY_LOSS_SPECS
from .registry import PolicyLossSpec

__all__ = ["POLICY_LOSSES", "PolicyLoss", "PolicyLossFn", "cispo", "gspo", "policy_loss", "ppo_clip"]

Metrics = dict[str, torch.Tensor]


class PolicyLossFn(Protocol):
    """The uniform policy-loss signature (module docstring)."""

    def __call__(self, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                 action_mask: torch.Tensor, *, clip_ratio_low: float, clip_ratio_high: float,
                 clip_ratio_c: float | None = None, loss_agg_mode: str = "token-mean",
                 num_units: int | torch.Tensor | None = None, loss_scale_factor: float | None = None,
                 weights: torch.Tensor | None = None) -> tuple[torch.Tensor, Metrics]: ...


def _check_clip(name: str, low: float, high: float, c: float | None, dual_clip: bool) -> None:
    if not (low > 0 and high > 0):
        raise ValueError(f"{name}: clip_ratio_low and clip_ratio_high must be > 0, got {low!r} and {high!r}")
    if c is not None and not dual_clip:
        raise ValueError(f"{name}: clip_ratio_c (dual-clip) applies to ppo_clip only, got {c!r}")
    if c is not None and not c > 1:
        raise ValueError(f"{name}: clip_ratio_c must be > 1, got {c!r}")


def _inputs(logprobs, old_logprobs, advantages, action_mask, weights):
    """(mask, logprobs, old, advantages, weights) with every masked position zeroed (weights None stays None)."""
    mask = action_mask.bool()
    lp = _real(logprobs, mask)
    old = _real(old_logprobs.to(lp.dtype), mask)
    adv = _real(advantages.to(lp.dtype), mask)
    w = None if weights is None else _real(weights.detach().to(lp.dtype), mask)
    return mask, lp, old, adv, w


def _finish(per_token: torch.Tensor, weights: torch.Tensor | None, mask: torch.Tensor, per_token_metrics: Metrics,
            *, loss_agg_mode: str, num_units, loss_scale_factor) -> tuple[torch.Tensor, Metrics]:
    """Weight and aggregate the per-token loss; aggregate the (B, T) metrics as shares over the same units."""
    if weights is not None:
        per_token = per_token * weights
    loss = aggregate_loss(per_token, mask, loss_agg_mode=loss_agg_mode, num_units=num_units,
                          loss_scale_factor=loss_scale_factor)
    mode = metric_agg_mode(loss_agg_mode)
    with torch.no_grad():
        metrics = {name: aggregate_loss(value.detach().to(per_token.dtype), mask, loss_agg_mode=mode,
                                        num_units=num_units) for name, value in per_token_metrics.items()}
    return loss, metrics


def _approx_kl(lp: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    return kl_estimate(lp.detach(), old, estimator="k3")


def ppo_clip(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
             action_mask: torch.Tensor, *, clip_ratio_low: float, clip_ratio_high: float,
             clip_ratio_c: float | None = None, loss_agg_mode: str = "token-mean",
             num_units: int | torch.Tensor | None = None, loss_scale_factor: float | None = None,
             weights: torch.Tensor | None = None) -> tuple[torch.Tensor, Metrics]:
    """PPO-clip with a decoupled clip range (DAPO clip-higher) and optional dual-clip; see the module docstring.

    Shapes: ``logprobs`` (B, T) with grad; ``old_logprobs``, ``advantages`` (B, T); ``action_mask`` (B, T);
    ``weights`` (B, T) or None. Formula: ``r_t = exp(logprobs_t - old_logprobs_t)``,
    ``l_t = max(-A_t r_t, -A_t clip(r_t, 1 - clip_ratio_low, 1 + clip_ratio_high))``; with ``clip_ratio_c``:
    ``l_t = min(l_t, -A_t * clip_ratio_c)`` where ``A_t < 0`` (Ye et al. 2020). ``loss = aggregate(l * weights)``.
    With ``clip_ratio_low = clip_ratio_high = eps`` and ``token-mean`` this is the PPO paper's symmetric clip.
    Metrics: ``policy/clipfrac`` (clipped term strictly larger), ``policy/approx_kl``, ``policy/ratio_mean``, and
    with ``clip_ratio_c`` ``policy/clipfrac_lower`` (``A < 0`` and the dual bound strictly active, as verl's
    ``pg_clipfrac_lower``). Raises: ValueError for clip ratios <= 0, ``clip_ratio_c <= 1``, bad aggregation
    arguments (`aggregation.aggregate_loss`) or shape mismatches.
    """
    _check_clip("ppo_clip", clip_ratio_low, clip_ratio_high, clip_ratio_c, dual_clip=True)
    mask, lp, old, adv, w = _inputs(logprobs, old_logprobs, advantages, action_mask, weights)
    ratio = torch.exp(lp - old)  # 1 at masked positions: finite values and gradients
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    per_token = torch.maximum(unclipped, clipped)
    metrics = {"policy/clipfrac": clipped > unclipped, "policy/approx_kl": _approx_kl(lp, old),
               "policy/ratio_mean": ratio}
    if clip_ratio_c is not None:
        bound = -adv * clip_ratio_c
        negative = adv < 0
        metrics["policy/clipfrac_lower"] = negative & (per_token > bound)
        per_token = torch.where(negative, torch.minimum(per_token, bound), per_token)
    return _finish(per_token, w, mask, metrics, loss_agg_mode=loss_agg_mode, num_units=num_units,
                   loss_scale_factor=loss_scale_factor)


def gspo(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
         action_mask: torch.Tensor, *, clip_ratio_low: float, clip_ratio_high: float,
         clip_ratio_c: float | None = None, loss_agg_mode: str = "token-mean",
         num_units: int | torch.Tensor | None = None, loss_scale_factor: float | None = None,
         weights: torch.Tensor | None = None) -> tuple[torch.Tensor, Metrics]:
    """GSPO-token (Zheng et al. 2025, section 4.3): PPO-clip on the sequence-level ratio; module docstring.

    Shapes as `ppo_clip`. Formula: ``log s_i = sum_t m (logprobs - old_logprobs) / max(n_i, 1)`` (n_i real tokens
    of row i), ``s_it = exp(sg(log s_i) + logprobs_t - sg(logprobs_t))`` (value ``s_i``, gradient
    ``s_i * grad logprobs_t``), ``l_t = max(-A_t s_it, -A_t clip(s_it, 1 - clip_ratio_low, 1 + clip_ratio_high))``.
    The paper aggregates with ``seq-mean-token-mean`` (`POLICY_LOSSES["gspo"].loss_agg_mode`) and uses very small
    ranges (3e-4 / 4e-4); verl's default aggregation for it is ``token-mean``. Metrics: ``policy/clipfrac`` (tokens
    of clipped sequences), ``policy/approx_kl`` (per token), ``policy/ratio_mean`` (``s_i`` per token).
    Raises: ValueError as `ppo_clip`, and for ``clip_ratio_c`` (no dual-clip here).
    """
    _check_clip("gspo", clip_ratio_low, clip_ratio_high, clip_ratio_c, dual_clip=False)
    mask, lp, old, adv, w = _inputs(logprobs, old_logprobs, advantages, action_mask, weights)
    lengths = mask.sum(dim=1, keepdim=True).clamp(min=1).to(lp.dtype)
    log_seq_ratio = ((lp - old).sum(dim=1, keepdim=True) / lengths).detach()
    seq_ratio = torch.exp(log_seq_ratio + lp - lp.detach())
    unclipped = -adv * seq_ratio
    clipped = -adv * seq_ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    per_token = torch.maximum(unclipped, clipped)
    metrics = {"policy/clipfrac": clipped > unclipped, "policy/approx_kl": _approx_kl(lp, old),
               "policy/ratio_mean": seq_ratio}
    return _finish(per_token, w, mask, metrics, loss_agg_mode=loss_agg_mode, num_units=num_units,
                   loss_scale_factor=loss_scale_factor)


def cispo(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
          action_mask: torch.Tensor, *, clip_ratio_low: float, clip_ratio_high: float,
          clip_ratio_c: float | None = None, loss_agg_mode: str = "token-mean",
          num_units: int | torch.Tensor | None = None, loss_scale_factor: float | None = None,
          weights: torch.Tensor | None = None) -> tuple[torch.Tensor, Metrics]:
    """CISPO (MiniMax-M1 2025, eq. 4-5): REINFORCE with a clipped, detached importance weight; module docstring.

    Shapes as `ppo_clip`. Formula: ``r_t = exp(logprobs_t - old_logprobs_t)``,
    ``l_t = -sg(clip(r_t, 1 - clip_ratio_low, 1 + clip_ratio_high)) * A_t * logprobs_t`` (the loss VALUE is not a
    surrogate of the objective's value, only its gradient ``-clip(r_t) A_t grad logprobs_t`` matters). Metrics:
    ``policy/clipfrac`` (tokens whose weight was clipped, ``r_t`` outside the range, as verl), ``policy/approx_kl``,
    ``policy/ratio_mean`` (unclipped ``r_t``). Raises: ValueError as `ppo_clip`, and for ``clip_ratio_c``.
    """
    _check_clip("cispo", clip_ratio_low, clip_ratio_high, clip_ratio_c, dual_clip=False)
    mask, lp, old, adv, w = _inputs(logprobs, old_logprobs, advantages, action_mask, weights)
    ratio = torch.exp(lp - old).detach()
    is_weight = ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    per_token = -is_weight * adv * lp
    metrics = {"policy/clipfrac": is_weight != ratio, "policy/approx_kl": _approx_kl(lp, old),
               "policy/ratio_mean": ratio}
    return _finish(per_token, w, mask, metrics, loss_agg_mode=loss_agg_mode, num_units=num_units,
                   loss_scale_factor=loss_scale_factor)


@dataclass(frozen=True)
class PolicyLoss(PolicyLossSpec):
    """A registered policy loss: its `registry.PolicyLossSpec` (``dual_clip`` whether it accepts ``clip_ratio_c``,
    ``loss_agg_mode`` the aggregation its paper uses, a default a config may override, ``source``) and ``fn``, the
    loss (`PolicyLossFn`)."""

    fn: PolicyLossFn


_FUNCTIONS: dict[str, PolicyLossFn] = {"ppo_clip": ppo_clip, "gspo": gspo, "cispo": cispo}
if set(_FUNCTIONS) != set(POLICY_LOSS_SPECS):
    raise ImportError(f"astrai.algos.policy_losses: {sorted(_FUNCTIONS)} != registry {sorted(POLICY_LOSS_SPECS)}")
POLICY_LOSSES: dict[str, PolicyLoss] = {
    name: PolicyLoss(fn=_FUNCTIONS[name], **{f.name: getattr(spec, f.name) for f in fields(spec)})
    for name, spec in POLICY_LOSS_SPECS.items()}
"""Policy losses by name (`policy_loss` looks them up); every ``fn`` has the `PolicyLossFn` signature."""


def policy_loss(name: str) -> PolicyLoss:
    """The `POLICY_LOSSES` record called ``name``. Raises: ValueError naming the unknown name and the choices."""
    try:
        return POLICY_LOSSES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown policy loss {name!r}; choices: {', '.join(POLICY_LOSSES)}") from None

