"""astrai.algos policy losses (ppo_clip, gspo, cispo) and loss aggregation modes: hand values, naive loops of the
peers' formulas (verl core_algos), micro-batch share additivity (docs/conventions.md section 2)."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from astrai.algos import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    aggregate_loss,
    cispo,
    gspo,
    loss_units,
    policy_loss,
    ppo_clip,
)

D64 = torch.float64
LN = math.log


def right_padded_mask(lengths: list[int], T: int) -> torch.Tensor:
    return torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]


def with_garbage(x: torch.Tensor, mask: torch.Tensor, value: float = float("nan")) -> torch.Tensor:
    return torch.where(mask, x, torch.full_like(x, value))


def hand_batch():
    """Rows: 3 real tokens, 2 real tokens, none. Ratios and advantages as in test_algos_losses' PPO example."""
    ratios = torch.tensor([[1.5, 0.5, 1.5], [0.5, 1.0, 1.0], [1.0, 1.0, 1.0]], dtype=D64)
    adv = torch.tensor([[1.0, 1.0, -1.0], [-1.0, 2.0, 0.0], [0.0, 0.0, 0.0]], dtype=D64)
    mask = right_padded_mask([3, 2, 0], 3)
    old = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.5, -1.0], [-1.0, -1.0, -1.0]], dtype=D64)
    return old + ratios.log(), old, adv, mask


# ------------------------------------------------------------------------------------------- aggregation


def test_aggregation_modes_hand_values_and_units():
    _, _, _, mask = hand_batch()
    nan = float("nan")
    # per-token PPO losses with clip [0.8, 1.28] (DAPO clip-higher), see test_ppo_clip_decoupled_hand_values
    per_token = torch.tensor([[-1.28, -0.5, 1.5], [0.8, -2.0, nan], [nan, nan, nan]], dtype=D64)
    # token-mean: -1.48 / 5 tokens
    assert aggregate_loss(per_token, mask).item() == pytest.approx(-0.296)
    # seq-mean-token-mean: (-0.28 / 3 + -1.2 / 2) / 2 sequences (the empty row is no unit)
    assert aggregate_loss(per_token, mask, loss_agg_mode="seq-mean-token-mean").item() == pytest.approx(
        (-0.28 / 3 - 0.6) / 2)
    # seq-mean-token-sum: (-0.28 - 1.2) / 2
    assert aggregate_loss(per_token, mask, loss_agg_mode="seq-mean-token-sum").item() == pytest.approx(-0.74)
    # seq-mean-token-sum-norm, L = 4: -1.48 / (2 * 4)
    assert aggregate_loss(per_token, mask, loss_agg_mode="seq-mean-token-sum-norm",
                          loss_scale_factor=4).item() == pytest.approx(-0.185)
    # a given global count replaces this batch's: token-mean over 10 tokens of the step
    assert aggregate_loss(per_token, mask, num_units=10).item() == pytest.approx(-0.148)
    assert aggregate_loss(per_token, mask, loss_agg_mode="seq-mean-token-sum",
                          num_units=torch.tensor(4)).item() == pytest.approx(-0.37)
    units = {mode: loss_units(mask, mode) for mode in LOSS_AGG_MODES}
    assert units["token-mean"].item() == 5 and units["token-mean"].dtype == torch.int64
    assert all(units[m].item() == 2 for m in LOSS_AGG_MODES[1:])
    assert aggregate_loss(per_token, torch.zeros_like(mask)).item() == 0.0


def test_aggregation_errors():
    x, mask = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="loss_agg_mode must be one of token-mean"):
        aggregate_loss(x, mask, loss_agg_mode="sum")
    with pytest.raises(ValueError, match="needs loss_scale_factor"):
        aggregate_loss(x, mask, loss_agg_mode="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="num_units must be an integer >= 1"):
        aggregate_loss(x, mask, num_units=0)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        loss_units(mask, "seq-sum")
    with pytest.raises(ValueError):
        aggregate_loss(x, mask[:, :2])


# --------------------------------------------------------------------------------------- hand values


def test_ppo_clip_decoupled_hand_values_and_gradient():
    new, old, adv, mask = hand_batch()
    lp = with_garbage(new, mask).requires_grad_(True)
    loss, metrics = ppo_clip(lp, with_garbage(old, mask), with_garbage(adv, mask, float("inf")), mask,
                             clip_ratio_low=0.2, clip_ratio_high=0.28)
    # range [0.8, 1.28]: A=1,r=1.5 -> max(-1.5, -1.28) = -1.28 (clipped); A=1,r=0.5 -> max(-0.5, -0.8) = -0.5;
    # A=-1,r=1.5 -> max(1.5, 1.28) = 1.5; A=-1,r=0.5 -> max(0.5, 0.8) = 0.8 (clipped); A=2,r=1 -> -2. Sum -1.48 / 5
    assert loss.item() == pytest.approx(-0.296)
    assert metrics["policy/clipfrac"].item() == pytest.approx(0.4)
    assert metrics["policy/ratio_mean"].item() == pytest.approx(1.0)
    assert "policy/clipfrac_lower" not in metrics
    loss.backward()
    # d/dlp of -A r = -A r on unclipped tokens, 0 on clipped ones; / 5 tokens; padding gets exactly 0
    expect = torch.tensor([[0.0, -0.5, 1.5], [0.0, -2.0, 0.0], [0.0, 0.0, 0.0]], dtype=D64) / 5
    torch.testing.assert_close(lp.grad, expect)


def test_ppo_clip_dual_clip_hand_values():
    old = torch.zeros(1, 3, dtype=D64)
    lp = torch.tensor([[LN(4.0), LN(2.0), LN(4.0)]], dtype=D64, requires_grad=True)
    adv = torch.tensor([[-1.0, -1.0, 1.0]], dtype=D64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, metrics = ppo_clip(lp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0)
    # A=-1, r=4: max(4, 1.2) = 4, dual bound -A*c = 3 -> 3 (active); A=-1, r=2: max(2, 1.2) = 2 < 3 -> 2;
    # A=1, r=4: max(-4, -1.2) = -1.2 (clipped; the dual bound applies to A < 0 only). Mean (3 + 2 - 1.2) / 3
    assert loss.item() == pytest.approx(3.8 / 3)
    assert metrics["policy/clipfrac_lower"].item() == pytest.approx(1 / 3)
    assert metrics["policy/clipfrac"].item() == pytest.approx(1 / 3)
    loss.backward()
    # only the middle token is unclipped: d(-A r)/dlp = r = 2, / 3
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 2.0 / 3, 0.0]], dtype=D64))
    no_dual, _ = ppo_clip(lp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    assert no_dual.item() == pytest.approx((4 + 2 - 1.2) / 3)


def test_gspo_hand_values_sequence_ratio():
    old = torch.zeros(2, 2, dtype=D64)
    lp = torch.tensor([[LN(2.0), 0.0], [LN(2.0), 0.0]], dtype=D64, requires_grad=True)
    adv = torch.tensor([[-1.0, -1.0], [1.0, 1.0]], dtype=D64)
    mask = torch.ones(2, 2, dtype=torch.bool)
    loss, metrics = gspo(lp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28,
                         loss_agg_mode="seq-mean-token-mean")
    s = math.sqrt(2.0)  # s_i = exp((ln 2 + 0) / 2) for both rows
    # row 0, A=-1: max(s, 1.28) = s (unclipped); row 1, A=1: max(-s, -1.28) = -1.28 (clipped). Mean over 2 rows
    assert loss.item() == pytest.approx((s - 1.28) / 2)
    assert metrics["policy/clipfrac"].item() == pytest.approx(0.5)
    assert metrics["policy/ratio_mean"].item() == pytest.approx(s)
    loss.backward()
    # row 0: d(-A s_it)/dlp_t = s, / 2 tokens, / 2 rows; row 1 clipped: 0
    torch.testing.assert_close(lp.grad, torch.tensor([[s / 4, s / 4], [0.0, 0.0]], dtype=D64))


def test_cispo_hand_values_gradient_through_logprobs():
    old = torch.tensor([[-1.0, -2.0, -0.5]], dtype=D64)
    lp = (old + torch.tensor([[1.5, 0.5, 1.0]], dtype=D64).log()).requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0, 2.0]], dtype=D64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, metrics = cispo(lp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28)
    # weights sg(clip(r)): 1.5 -> 1.28, 0.5 -> 0.8, 1.0 -> 1.0; l_t = -w A lp_t
    lps = [-1.0 + LN(1.5), -2.0 + LN(0.5), -0.5]
    expect = (-1.28 * 1 * lps[0] - 0.8 * -1 * lps[1] - 1.0 * 2 * lps[2]) / 3
    assert loss.item() == pytest.approx(expect)
    assert metrics["policy/clipfrac"].item() == pytest.approx(2 / 3)
    loss.backward()
    # every token keeps a gradient -w A / 3 (the point of CISPO), even the clipped ones
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.28, 0.8, -2.0]], dtype=D64) / 3)


# ------------------------------------------------------------------------------ peers' formulas, naive


def naive_verl_agg(per_token, lengths, mode, factor=None):
    """verl `agg_loss` on one rank, plain floats."""
    rows = [per_token[b][:n] for b, n in enumerate(lengths) if n > 0]
    if mode == "token-mean":
        return sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows) / len(rows)
    total = sum(sum(r) for r in rows) / len(rows)
    return total / factor if mode == "seq-mean-token-sum-norm" else total


def naive_verl_vanilla(lp, old, a, low, high, c):
    """verl compute_policy_loss_vanilla, one token (c None: without the dual-clip branch)."""
    r = math.exp(lp - old)
    l1 = max(-a * r, -a * min(max(r, 1 - low), 1 + high))
    return min(-a * c, l1) if (c is not None and a < 0) else l1


def naive_verl_cispo(lp, old, a, low, high):
    r = math.exp(lp - old)
    return -min(max(r, 1 - low), 1 + high) * a * lp


def naive_gspo_sequence(lp, old, adv_seq, lengths, low, high):
    """GSPO's sequence form (Zheng et al. 2025, eq. 5-7): mean over rows of max(-A s, -A clip(s))."""
    losses = []
    for b, n in enumerate(lengths):
        s = torch.exp((lp[b, :n] - old[b, :n]).sum() / n)
        losses.append(torch.maximum(-adv_seq[b] * s, -adv_seq[b] * s.clamp(1 - low, 1 + high)))
    return torch.stack(losses).mean()


def random_batch(seed: int, lengths: list[int], T: int, spread: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    mask = right_padded_mask(lengths, T)
    old = -torch.rand(B, T, generator=g, dtype=D64) * 3
    lp = old + spread * torch.randn(B, T, generator=g, dtype=D64)
    adv = torch.randn(B, T, generator=g, dtype=D64)
    return lp, old, adv, mask


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("c", [None, 3.0])
def test_ppo_clip_matches_naive_verl_loop(mode, c):
    lengths = [5, 2, 4, 1, 3]
    lp, old, adv, mask = random_batch(11, lengths, 5, spread=0.6)
    lp[0, 0], adv[0, 0] = old[0, 0] + LN(5.0), -1.5  # a ratio of 5 with A < 0: the dual bound binds
    loss, _ = ppo_clip(with_garbage(lp, mask), old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28,
                       clip_ratio_c=c, loss_agg_mode=mode, loss_scale_factor=7)
    per_token = [[naive_verl_vanilla(lp[b, t].item(), old[b, t].item(), adv[b, t].item(), 0.2, 0.28, c)
                  for t in range(5)] for b in range(5)]
    assert loss.item() == pytest.approx(naive_verl_agg(per_token, lengths, mode, factor=7))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_cispo_matches_naive_verl_loop(mode):
    lengths = [4, 4, 2, 3]
    lp, old, adv, mask = random_batch(12, lengths, 4, spread=0.5)
    loss, _ = cispo(lp, with_garbage(old, mask), adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28,
                    loss_agg_mode=mode, loss_scale_factor=4)
    per_token = [[naive_verl_cispo(lp[b, t].item(), old[b, t].item(), adv[b, t].item(), 0.2, 0.28)
                  for t in range(4)] for b in range(4)]
    assert loss.item() == pytest.approx(naive_verl_agg(per_token, lengths, mode, factor=4))


def test_gspo_token_form_equals_sequence_form_value_and_gradient():
    lengths = [5, 3, 1, 4, 2, 5]
    lp, old, _, mask = random_batch(13, lengths, 5, spread=0.15)
    adv_seq = torch.tensor([1.0, -0.5, 2.0, -1.5, 0.7, -0.3], dtype=D64)
    low, high = 0.03, 0.04  # small ranges: some sequences clipped, some not
    lp_token = with_garbage(lp, mask).requires_grad_(True)
    loss, metrics = gspo(lp_token, old, adv_seq[:, None].expand(-1, 5), mask, clip_ratio_low=low,
                         clip_ratio_high=high, loss_agg_mode="seq-mean-token-mean")
    assert 0 < metrics["policy/clipfrac"].item() < 1
    lp_seq = lp.clone().requires_grad_(True)
    ref = naive_gspo_sequence(lp_seq, old, adv_seq, lengths, low, high)
    torch.testing.assert_close(loss, ref)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(lp_token.grad, torch.where(mask, lp_seq.grad, torch.zeros_like(lp)))
    assert (lp_token.grad[~mask] == 0).all()


# ----------------------------------------------------------------------------- shares and weights


def _micro_shares(fn, lp, old, adv, mask, weights, rows_list, **kw):
    """Sum of the micro-batch shares, each micro-batch trimmed to its own width, with the step's global units."""
    total, metric_sums = 0.0, {}
    units = loss_units(mask, kw["loss_agg_mode"])
    for rows in rows_list:
        idx = torch.tensor(rows)
        width = max(int(mask[idx].sum(1).max()), 1)
        cut = lambda x: None if x is None else x[idx, :width]  # noqa: E731
        loss, metrics = fn(cut(lp), cut(old), cut(adv), cut(mask), weights=cut(weights), num_units=units, **kw)
        total = total + loss
        for key, val in metrics.items():
            metric_sums[key] = metric_sums.get(key, 0.0) + val
    return total, metric_sums


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("weighted", [False, True])
def test_micro_batch_shares_sum_to_whole_batch_loss_gradient_and_metrics(name, mode, weighted):
    lengths = [5, 2, 0, 3, 4, 1]
    lp, old, adv, mask = random_batch(14, lengths, 5, spread=0.4)
    g = torch.Generator().manual_seed(15)
    weights = with_garbage(torch.rand(6, 5, generator=g, dtype=D64) * 2, mask) if weighted else None
    kw = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode=mode, loss_scale_factor=5.0)
    if POLICY_LOSSES[name].dual_clip:
        kw["clip_ratio_c"] = 3.0
    fn = POLICY_LOSSES[name].fn
    whole_lp = with_garbage(lp, mask).requires_grad_(True)
    whole, whole_metrics = fn(whole_lp, with_garbage(old, mask), with_garbage(adv, mask), mask, weights=weights,
                              **kw)
    whole.backward()
    micro_lp = with_garbage(lp, mask).requires_grad_(True)
    summed, metric_sums = _micro_shares(fn, micro_lp, with_garbage(old, mask), with_garbage(adv, mask), mask,
                                        weights, [[0, 1], [2, 3, 4], [5]], **kw)
    summed.backward()
    torch.testing.assert_close(summed, whole)
    torch.testing.assert_close(micro_lp.grad, whole_lp.grad)
    assert torch.isfinite(whole_lp.grad).all() and (whole_lp.grad[~mask] == 0).all()
    assert set(metric_sums) == set(whole_metrics)
    for key, val in whole_metrics.items():
        assert val.dim() == 0 and not val.requires_grad, key
        torch.testing.assert_close(metric_sums[key], val, msg=key)


def test_zero_weight_drops_a_token_from_loss_and_gradient():
    lengths = [4, 3]
    lp, old, adv, mask = random_batch(16, lengths, 4, spread=0.4)
    weights = torch.tensor([[1.0, 0.0, 2.0, 0.5], [0.0, 1.5, 1.0, float("nan")]], dtype=D64)  # NaN: padding
    for name, record in POLICY_LOSSES.items():
        x = lp.clone().requires_grad_(True)
        loss, _ = record.fn(x, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28, weights=weights)
        loss.backward()
        assert x.grad[0, 1].item() == 0.0 and x.grad[1, 0].item() == 0.0, name
        assert x.grad[0, 0].item() != 0.0, name
        # same as the unweighted per-token losses times the weights, over the same 7 tokens
        plain = lp.clone()
        per_token = []
        for b, n in enumerate(lengths):
            for t in range(n):
                one = torch.zeros(2, 4, dtype=torch.bool)
                one[b, t] = True
                # a one-token batch's token-mean loss is that token's per-token loss (gspo: s_i of one token
                # differs, so compare gspo through its own row below)
                if name != "gspo":
                    per_token.append(record.fn(plain, old, adv, one, clip_ratio_low=0.2,
                                               clip_ratio_high=0.28)[0].item() * weights[b, t].item())
        if name != "gspo":
            assert loss.item() == pytest.approx(sum(per_token) / 7), name


# ------------------------------------------------------------------------------------------- registry


def test_registry_uniform_signature_records_and_errors():
    signatures = {str(inspect.signature(record.fn)) for record in POLICY_LOSSES.values()}
    assert len(signatures) == 1
    assert set(POLICY_LOSSES) == {"ppo_clip", "gspo", "cispo"}
    assert policy_loss("gspo").loss_agg_mode == "seq-mean-token-mean"
    assert [n for n, r in POLICY_LOSSES.items() if r.dual_clip] == ["ppo_clip"]
    with pytest.raises(ValueError, match=r"unknown policy loss 'grpo'; choices: ppo_clip, gspo, cispo"):
        policy_loss("grpo")
    x, mask = torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="gspo: clip_ratio_c"):
        gspo(x, x, x, mask, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0)
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        ppo_clip(x, x, x, mask, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="must be > 0"):
        cispo(x, x, x, mask, clip_ratio_low=0.0, clip_ratio_high=0.2)
    with pytest.raises(ValueError):
        ppo_clip(x, x, torch.zeros(1, 3), mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
