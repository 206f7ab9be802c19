"""Token-level critic loss and diagnostics: the clipped value loss of PPO (Schulman et al. 2017, "Proximal Policy
Optimization Algorithms"; Ouyang et al. 2022 per response token), entropy, the engine/trainer log-prob gap, and
explained variance as the usual critic diagnostic. The policy losses (PPO-clip and its variants) are
`policy_losses`. What it simplifies: every loss is a token mean over real tokens whose denominator can be the global
token count of the optimizer step (docs/conventions.md section 2, "Loss aggregation").

Conventions: inputs are (B, T) floating tensors with an ``action_mask`` (B, T) (bool or 0/1); entries at masked
positions (even NaN/inf) influence neither the loss, nor its gradient, nor the metrics. Losses return
``(loss, metrics)``: ``loss`` a 0-dim tensor with grad, ``metrics`` a dict of detached 0-dim tensors. With
``num_tokens`` given, the loss AND every token-mean metric use it as the denominator, so each is this
micro-batch's additive share: summing over the micro-batches (and ranks) of a step gives the step's value.
"""

from __future__ import annotations

import torch

from .masked import _denominator, _real, masked_mean, masked_var

__all__ = [
    "value_loss",
    "explained_variance",
    "masked_entropy",
    "logprob_gap",
]


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    clip_range: float | None = None,
    num_tokens: int | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Critic regression loss, optionally clipped around the rollout values (PPO, Schulman et al. 2017).

    Shapes: ``values`` (B, T) float with grad (current critic); ``old_values`` (B, T) critic values at rollout
    time; ``returns`` (B, T) GAE returns; ``action_mask`` (B, T).
    Formula: ``u_t = (values_t - returns_t)^2``; without ``clip_range``: ``loss = 0.5 * masked_mean(u)``; with it,
    ``v_clip = old_values + clip(values - old_values, -clip_range, clip_range)``,
    ``c_t = (v_clip_t - returns_t)^2``, ``loss = 0.5 * masked_mean(max(u, c))``. Denominator as in
    ``masked_mean`` (``num_tokens`` if given). Scaling by ``vf_coef`` is the caller's.
    Metrics: ``critic/clipfrac`` share of real tokens where the clipped term is strictly larger (always present,
    0 without ``clip_range``); ``critic/values_mean`` masked mean of ``values``.
    Raises: ValueError on shape mismatches, ``clip_range <= 0`` or an int ``num_tokens < 1``.
    """
    if clip_range is not None and not clip_range > 0:
        raise ValueError(f"clip_range must be > 0 or None, got {clip_range!r}")
    mask = action_mask.bool()
    v = _real(values, mask)
    ret = _real(returns.to(values.dtype), mask)
    unclipped = (v - ret) ** 2
    if clip_range is None:
        per_token = unclipped
        active = torch.zeros_like(unclipped)
    else:
        old = _real(old_values.to(values.dtype), mask)
        v_clip = old + (v - old).clamp(-clip_range, clip_range)
        clipped = (v_clip - ret) ** 2
        per_token = torch.maximum(unclipped, clipped)
        active = (clipped > unclipped).to(values.dtype)
    loss = 0.5 * masked_mean(per_token, mask, num_tokens=num_tokens)
    with torch.no_grad():
        metrics = {
            "critic/clipfrac": masked_mean(active.detach(), mask, num_tokens=num_tokens),
            "critic/values_mean": masked_mean(v.detach(), mask, num_tokens=num_tokens),
        }
    return loss, metrics


@torch.no_grad()
def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Explained variance of the returns by the critic, over real tokens (a detached 0-dim tensor).

    Shapes: ``values``, ``returns`` (B, T) floating; ``mask`` (B, T). Returns 0-dim, dtype of ``returns``.
    Formula: ``ev = 1 - Var(returns - values) / Var(returns)`` (population variances over real tokens; the
    ratio is the same with Bessel's correction). 1 is a perfect critic, 0 no better than a constant, < 0 worse.
    Zero-variance case (the scikit-learn ``explained_variance_score`` convention): if ``Var(returns) == 0``, the
    result is 1.0 when ``Var(returns - values) == 0`` too (the critic matches the returns up to a constant) and
    0.0 otherwise; a variance at or below ``(eps * max(1, max|returns|))^2`` (eps of the dtype: rounding noise)
    counts as 0. A mask with no real token gives 0.0 (nothing explained).
    Raises: ValueError on shape mismatches.
    """
    m = mask.bool()
    ret = _real(returns, m)
    residual = ret - _real(values.to(returns.dtype), m)
    var_ret = masked_var(ret, m, unbiased=False)
    var_res = masked_var(residual, m, unbiased=False)
    zero = torch.zeros((), dtype=ret.dtype, device=ret.device)
    # returns that differ only by rounding (e.g. all rewards equal and a KL term of ~1e-10) count as constant:
    # otherwise their ~1e-24 variance would turn any critic error into an explained variance of -1e10
    one = torch.ones((), dtype=ret.dtype, device=ret.device)
    floor = (torch.finfo(ret.dtype).eps * torch.cat([ret.abs().flatten(), one.reshape(1)]).max()) ** 2
    spread = var_ret > floor
    degenerate = torch.where(var_res > floor, zero, one)
    ev = torch.where(spread, 1.0 - var_res / torch.where(spread, var_ret, one), degenerate)
    return torch.where(m.any(), ev, zero)


def masked_entropy(
    entropy: torch.Tensor, action_mask: torch.Tensor, *, num_tokens: int | torch.Tensor | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-mean policy entropy over real tokens (for an entropy bonus and the ``policy/entropy`` metric).

    Shapes: ``entropy`` (B, T) float (e.g. ``entropy_from_logits``, may carry grad); ``action_mask`` (B, T).
    Returns ``(mean_entropy, {"policy/entropy": detached mean})``; ``mean_entropy`` keeps the grad, so a bonus is
    ``loss = pg_loss - ent_coef * mean_entropy``. Formula: ``masked_mean(entropy, num_tokens=num_tokens)``.
    Raises: ValueError on shape mismatches or an int ``num_tokens < 1``.
    """
    mean = masked_mean(entropy, action_mask.bool(), num_tokens=num_tokens)
    return mean, {"policy/entropy": mean.detach()}


@torch.no_grad()
def logprob_gap(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    num_tokens: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """``rollout/logprob_gap = masked_mean(|logprobs - old_logprobs|)`` (docs/conventions.md section 2), detached
    0-dim.

    Shapes: (B, T) floating each, ``action_mask`` (B, T). Near 0 when the engine used the trainer's weights and the
    same temperature; a large gap flags stale engine weights or stale prefix-cache KV. ``num_tokens`` divides the
    sum instead of this batch's real-token count (a share of a larger mean, as the losses take it).
    Raises: ValueError on shape mismatches or an int ``num_tokens < 1``.
    """
    mask = action_mask.bool()
    diff = _real(logprobs, mask) - _real(old_logprobs.to(logprobs.dtype), mask)
    return masked_mean(diff.abs(), mask, num_tokens=num_tokens)
