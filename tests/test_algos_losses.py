"""astrai.algos losses and diagnostics against hand-computed values (docs/conventions.md section 2)."""

from __future__ import annotations

import math

import pytest
import torch

from astrai.algos import (
    aggregate_loss,
    explained_variance,
    kl_estimate,
    logprob_gap,
    masked_entropy,
    masked_mean,
    ppo_clip,
    value_loss,
)

D64 = torch.float64


def right_padded_mask(lengths: list[int], T: int) -> torch.Tensor:
    return torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]


def with_garbage(x: torch.Tensor, mask: torch.Tensor, value: float = float("nan")) -> torch.Tensor:
    return torch.where(mask, x, torch.full_like(x, value))


def assert_metrics_detached(metrics: dict) -> None:
    for key, val in metrics.items():
        assert isinstance(val, torch.Tensor) and val.dim() == 0, key
        assert not val.requires_grad, key


def _hand_ppo_batch():
    """Row 0: tokens 1-3, row 1: tokens 4-5 + padding (see test_ppo_clip_hand_example)."""
    ratios = torch.tensor([[1.5, 0.5, 1.5], [0.5, 1.0, 1.0]], dtype=D64)
    adv = torch.tensor([[1.0, 1.0, -1.0], [-1.0, 2.0, 0.0]], dtype=D64)
    mask = right_padded_mask([3, 2], 3)
    old = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.5, -1.0]], dtype=D64)
    new = old + ratios.log()
    return new, old, adv, mask


def test_ppo_clip_hand_example():
    new, old, adv, mask = _hand_ppo_batch()
    new = with_garbage(new, mask).requires_grad_(True)
    adv = with_garbage(adv, mask, float("inf"))
    loss, metrics = ppo_clip(new, with_garbage(old, mask), adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    # per token (eps 0.2): A=1,r=1.5 -> -1.2 (clipped active); A=1,r=0.5 -> -0.5; A=-1,r=1.5 -> 1.5;
    # A=-1,r=0.5 -> 0.8 (clipped active); A=2,r=1 -> -2.  mean = -1.4 / 5
    assert loss.item() == pytest.approx(-0.28)
    assert metrics["policy/clipfrac"].item() == pytest.approx(0.4)
    assert metrics["policy/ratio_mean"].item() == pytest.approx(1.0)
    k3 = lambda r: 1.0 / r - 1.0 + math.log(r)  # noqa: E731  (d = old - new = -log r)
    assert metrics["policy/approx_kl"].item() == pytest.approx((2 * k3(1.5) + 2 * k3(0.5)) / 5)
    assert_metrics_detached(metrics)
    loss.backward()
    assert torch.isfinite(new.grad).all() and (new.grad[~mask] == 0).all()
    # clipped-active tokens get no gradient, the others get -A * ratio / N
    expect = torch.tensor([[0.0, -0.5, 1.5], [0.0, -2.0, 0.0]], dtype=D64) / 5
    torch.testing.assert_close(new.grad, expect)


def test_ppo_clip_ratio_one_is_minus_mean_advantage():
    g = torch.Generator().manual_seed(10)
    mask = right_padded_mask([4, 2, 5], 5)
    lp = torch.randn(3, 5, generator=g, dtype=D64)
    adv = torch.randn(3, 5, generator=g, dtype=D64)
    loss, metrics = ppo_clip(lp, lp.clone(), adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    assert loss.item() == pytest.approx(-masked_mean(adv, mask).item())
    assert metrics["policy/clipfrac"].item() == 0.0
    assert metrics["policy/approx_kl"].item() == 0.0
    assert metrics["policy/ratio_mean"].item() == pytest.approx(1.0)


def test_token_mean_invariant_to_micro_batch_split():
    g = torch.Generator().manual_seed(11)
    lengths = [6, 1, 3, 5, 2, 4]
    mask = right_padded_mask(lengths, 6)
    lp = torch.randn(6, 6, generator=g, dtype=D64)
    old = lp + 0.3 * torch.randn(6, 6, generator=g, dtype=D64)
    adv = torch.randn(6, 6, generator=g, dtype=D64)
    values = torch.randn(6, 6, generator=g, dtype=D64)
    old_values = values + 0.5 * torch.randn(6, 6, generator=g, dtype=D64)
    returns = torch.randn(6, 6, generator=g, dtype=D64)
    n_global = mask.sum()

    def run(rows, num_tokens):
        lp_leaf = lp[rows].clone().requires_grad_(True)
        v_leaf = values[rows].clone().requires_grad_(True)
        pl, pm = ppo_clip(lp_leaf, old[rows], adv[rows], mask[rows], clip_ratio_low=0.2, clip_ratio_high=0.2,
                          num_units=num_tokens)
        vl, vm = value_loss(v_leaf, old_values[rows], returns[rows], mask[rows], clip_range=0.2,
                            num_tokens=num_tokens)
        (pl + vl).backward()
        return pl.detach(), vl.detach(), {**pm, **vm}, lp_leaf.grad, v_leaf.grad

    full_pl, full_vl, full_m, full_glp, full_gv = run(slice(0, 6), None)
    glob = run(slice(0, 6), int(n_global))
    assert glob[0].item() == pytest.approx(full_pl.item()) and glob[1].item() == pytest.approx(full_vl.item())
    parts = [run(slice(i, i + 2), n_global) for i in range(0, 6, 2)]
    assert sum(p[0] for p in parts).item() == pytest.approx(full_pl.item())
    assert sum(p[1] for p in parts).item() == pytest.approx(full_vl.item())
    for key in full_m:
        assert sum(p[2][key] for p in parts).item() == pytest.approx(full_m[key].item()), key
    torch.testing.assert_close(torch.cat([p[3] for p in parts]), full_glp)
    torch.testing.assert_close(torch.cat([p[4] for p in parts]), full_gv)


def test_value_loss_hand_example_with_and_without_clip():
    mask = right_padded_mask([3], 4)
    values = torch.tensor([[1.0, 0.0, 2.0, 0.0]], dtype=D64)
    old = torch.tensor([[0.5, 0.0, 1.0, 0.0]], dtype=D64)
    returns = torch.tensor([[0.0, 1.0, 1.5, 0.0]], dtype=D64)
    v = with_garbage(values, mask).requires_grad_(True)
    loss, metrics = value_loss(v, with_garbage(old, mask), with_garbage(returns, mask), mask)
    # unclipped squared errors: 1, 1, 0.25 -> 0.5 * 2.25 / 3
    assert loss.item() == pytest.approx(0.375)
    assert metrics["critic/clipfrac"].item() == 0.0
    assert metrics["critic/values_mean"].item() == pytest.approx(1.0)
    assert_metrics_detached(metrics)
    loss.backward()
    assert torch.isfinite(v.grad).all() and v.grad[0, 3].item() == 0.0
    # clip 0.2: v_clip = 0.7, 0.0, 1.2 -> clipped sq errors 0.49, 1, 0.09; max with 1, 1, 0.25 -> unchanged
    loss_c, metrics_c = value_loss(values, old, returns, mask, clip_range=0.2)
    assert loss_c.item() == pytest.approx(0.375)
    assert metrics_c["critic/clipfrac"].item() == 0.0
    # returns beyond the clipped value: v=2 (old 1, clip 0.2 -> 1.2), return 3 -> clipped sq 3.24 > 1
    loss_c2, metrics_c2 = value_loss(values[:, 2:3], old[:, 2:3], torch.tensor([[3.0]], dtype=D64),
                                     mask[:, 2:3], clip_range=0.2)
    assert loss_c2.item() == pytest.approx(0.5 * 1.8**2)
    assert metrics_c2["critic/clipfrac"].item() == 1.0


def test_explained_variance_hand_and_zero_variance_cases():
    mask = right_padded_mask([4], 6)
    returns = with_garbage(torch.tensor([[1.0, 2.0, 3.0, 4.0, 0.0, 0.0]], dtype=D64), mask)
    values = with_garbage(torch.tensor([[1.0, 2.0, 3.0, 3.0, 0.0, 0.0]], dtype=D64), mask, 1e9)
    # residual 0,0,0,1: var 0.1875; var(returns) 1.25 -> 1 - 0.15
    ev = explained_variance(values, returns, mask)
    assert ev.dim() == 0 and not ev.requires_grad
    assert ev.item() == pytest.approx(0.85)
    const = torch.full((1, 6), 2.0, dtype=D64)
    assert explained_variance(const - 1.0, const, mask).item() == 1.0  # Var(ret) = Var(res) = 0
    wobble = torch.tensor([[1.0, 2.0, 1.0, 2.0, 0.0, 0.0]], dtype=D64)
    assert explained_variance(wobble, const, mask).item() == 0.0  # Var(ret) = 0 < Var(res)
    # returns equal up to rounding (all rewards 0, a KL term of ~1e-12): constant, not an explained variance of -1e10
    noise = torch.tensor([[1e-12, -2e-12, 3e-12], [0.0, 1e-12, 2e-12]])
    critic = torch.tensor([[0.1, -0.2, 0.3], [0.0, 0.2, -0.1]])
    assert explained_variance(critic, noise, torch.ones(2, 3)).item() == 0.0
    assert explained_variance(returns, returns, mask).item() == 1.0
    assert explained_variance(values, returns, torch.zeros_like(mask)).item() == 0.0


def test_entropy_kl_penalty_and_logprob_gap():
    mask = right_padded_mask([2, 1], 3)
    ent = with_garbage(torch.tensor([[1.0, 2.0, 0.0], [4.0, 0.0, 0.0]], dtype=D64), mask).requires_grad_(True)
    mean, metrics = masked_entropy(ent, mask)
    assert mean.item() == pytest.approx(7.0 / 3.0) and mean.requires_grad
    assert_metrics_detached(metrics)
    assert metrics["policy/entropy"].item() == pytest.approx(7.0 / 3.0)
    lp = torch.zeros(2, 3, dtype=D64, requires_grad=True)
    ref = with_garbage(torch.full((2, 3), math.log(2.0), dtype=D64), mask)
    # the GRPO loss's reference-KL term, over pinned reference log-probs (zeroed outside the mask)
    kl_loss = aggregate_loss(kl_estimate(lp, torch.where(mask, ref, 0.0), estimator="k3"), mask)
    assert kl_loss.item() == pytest.approx(1.0 - math.log(2.0))
    kl_loss.backward()
    assert torch.isfinite(lp.grad).all() and (lp.grad[~mask] == 0).all()
    gap = logprob_gap(torch.tensor([[0.0, -1.0, 5.0]]), torch.tensor([[0.5, -2.0, 0.0]]), mask[:1])
    assert gap.item() == pytest.approx(0.75)


def test_loss_input_validation():
    mask = right_padded_mask([2], 3)
    x = torch.zeros(1, 3)
    with pytest.raises(ValueError):
        ppo_clip(x, x, torch.zeros(1), mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    with pytest.raises(ValueError):
        ppo_clip(x, x, x, mask, clip_ratio_low=0.0, clip_ratio_high=0.2)
    with pytest.raises(ValueError):
        value_loss(x, x, x, mask, clip_range=-1.0)
    with pytest.raises(ValueError):
        kl_estimate(x, x, estimator="nope")
