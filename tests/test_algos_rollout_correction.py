"""astrai.algos rollout correction (training-inference mismatch): mismatch metrics and the token_tis, seq_tis,
seq_mask and icepop weights against hand values and naive loops of TRL's and verl's rules (docs/conventions.md
section 7)."""

from __future__ import annotations

import math

import pytest
import torch

from astrai.algos import MAX_METRICS, ROLLOUT_CORRECTIONS, correction_weights, mismatch_metrics, ppo_clip

D64 = torch.float64
LN = math.log
NAN = float("nan")


def right_padded_mask(lengths: list[int], T: int) -> torch.Tensor:
    return torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]


def with_garbage(x: torch.Tensor, mask: torch.Tensor, value: float = NAN) -> torch.Tensor:
    return torch.where(mask, x, torch.full_like(x, value))


def test_mismatch_metrics_hand_values():
    mask = right_padded_mask([3, 0], 4)
    train = torch.tensor([[LN(2.0), LN(0.4), 0.1, NAN], [NAN] * 4], dtype=D64)
    rollout = torch.tensor([[0.0, 0.0, 0.0, 9.0], [NAN] * 4], dtype=D64)
    m = mismatch_metrics(train, rollout, mask)
    # k3 = rho - 1 - log rho: 2 - 1 - ln 2; 0.4 - 1 - ln 0.4; e^0.1 - 1.1
    k3 = [1 - LN(2.0), -0.6 - LN(0.4), math.exp(0.1) - 1.1]
    assert m["rollout/mismatch_k3_kl"].item() == pytest.approx(sum(k3) / 3)
    assert m["rollout/mismatch_max_abs_diff"].item() == pytest.approx(-LN(0.4))
    # ratio 2 is inside the closed band [0.5, 2]; 0.4 is outside; e^0.1 inside
    assert m["rollout/mismatch_outside_frac"].item() == pytest.approx(1 / 3)
    shares = mismatch_metrics(train, rollout, mask, num_tokens=6)
    assert shares["rollout/mismatch_k3_kl"].item() == pytest.approx(sum(k3) / 6)
    assert shares["rollout/mismatch_max_abs_diff"].item() == pytest.approx(-LN(0.4))  # a max, not a share
    assert MAX_METRICS == {"rollout/mismatch_max_abs_diff", "rollout/staleness_max"}  # the maxima among metrics
    for val in m.values():
        assert val.dim() == 0 and not val.requires_grad
    empty = mismatch_metrics(train, rollout, torch.zeros_like(mask))
    assert all(v.item() == 0.0 for v in empty.values())


def hand_rollout():
    """Log-ratios d: row 0 (ln 3, ln 0.25, 0): S = ln 0.75; row 1 (ln 2, ln 2): S = ln 4; row 2 (ln 6): S = ln 6."""
    mask = right_padded_mask([3, 2, 1], 3)
    d = torch.tensor([[LN(3.0), LN(0.25), 0.0], [LN(2.0), LN(2.0), 0.0], [LN(6.0), 0.0, 0.0]], dtype=D64)
    rollout = with_garbage(torch.full((3, 3), -1.5, dtype=D64), mask)
    return with_garbage(rollout + d, mask), rollout, mask


@pytest.mark.parametrize("mode,weights,kept,capped", [
    # token_tis, cap 2: min(rho_t, 2); rho = 2 exactly is not truncated
    ("token_tis", [[2, 0.25, 1], [2, 2, 0], [2, 0, 0]], 6, 2),
    # seq_tis, cap 3: min(prod rho, 3) on every token of the row
    ("seq_tis", [[0.75, 0.75, 0.75], [3, 3, 0], [3, 0, 0]], 6, 3),
    # seq_mask, cap 3: rows with prod rho > 3 dropped; kept rows weighted by prod rho
    ("seq_mask", [[0.75, 0.75, 0.75], [0, 0, 0], [0, 0, 0]], 3, 0),
    # icepop [0.5, 5]: rho_t kept inside the band, else dropped
    ("icepop", [[3, 0, 1], [2, 2, 0], [0, 0, 0]], 4, 0),
])
def test_correction_weights_hand_values(mode, weights, kept, capped):
    train, rollout, mask = hand_rollout()
    w, keep, metrics = correction_weights(mode, train, rollout, mask)
    expect = torch.tensor(weights, dtype=D64)
    torch.testing.assert_close(w, expect)
    assert keep.dtype == torch.bool and not (keep & ~mask).any()
    assert int(keep.sum()) == kept
    assert bool(((w != 0) <= keep).all())
    assert not w.requires_grad
    assert metrics["rollout/correction_kept_frac"].item() == pytest.approx(kept / 6)
    assert metrics["rollout/correction_capped_frac"].item() == pytest.approx(capped / 6)
    assert metrics["rollout/correction_weight_mean"].item() == pytest.approx(expect.sum().item() / 6)
    shares = correction_weights(mode, train, rollout, mask, num_tokens=12)[2]
    assert shares["rollout/correction_kept_frac"].item() == pytest.approx(kept / 12)


def naive_trl(mode: str, train, rollout, lengths, cap):
    """TRL 1.16 GRPOTrainer vLLM importance sampling (clip_min None): token_truncate, sequence_truncate,
    sequence_mask, per row as plain floats."""
    out = []
    for b, n in enumerate(lengths):
        diffs = [train[b][t] - rollout[b][t] for t in range(n)]
        if mode == "token_truncate":
            out.append([min(math.exp(x), cap) for x in diffs])
            continue
        ratio = math.exp(sum(diffs))
        w = min(ratio, cap) if mode == "sequence_truncate" else (0.0 if ratio > cap else ratio)
        out.append([w] * n)
    return out


@pytest.mark.parametrize("mode,trl_mode,cap", [("token_tis", "token_truncate", 2.0),
                                                ("seq_tis", "sequence_truncate", 3.0),
                                                ("seq_mask", "sequence_mask", 3.0)])
def test_weights_match_naive_trl_loop(mode, trl_mode, cap):
    g = torch.Generator().manual_seed(1)
    lengths, T = [6, 2, 5, 1, 4, 6, 3], 6
    mask = right_padded_mask(lengths, T)
    rollout = -torch.rand(7, T, generator=g, dtype=D64) * 3
    train = rollout + 0.4 * torch.randn(7, T, generator=g, dtype=D64)
    w, _, _ = correction_weights(mode, with_garbage(train, mask), with_garbage(rollout, mask, -NAN), mask,
                                 token_cap=2.0, seq_cap=3.0)
    ref = naive_trl(trl_mode, train.tolist(), rollout.tolist(), lengths, cap)
    for b, n in enumerate(lengths):
        assert w[b, :n].tolist() == pytest.approx(ref[b]), (mode, b)
        assert (w[b, n:] == 0).all()
    if mode == "seq_mask":  # both fates occur in this batch
        assert 0 < (w[:, 0] == 0).sum() < 7


def test_icepop_matches_naive_verl_rule():
    """verl rollout_is_threshold "0.5_5.0": the IS weight rho_t inside [0.5, 5], 0 outside."""
    g = torch.Generator().manual_seed(2)
    lengths, T = [5, 3, 5, 2], 5
    mask = right_padded_mask(lengths, T)
    rollout = -torch.rand(4, T, generator=g, dtype=D64) * 3
    train = rollout + 1.2 * torch.randn(4, T, generator=g, dtype=D64)
    w, keep, _ = correction_weights("icepop", with_garbage(train, mask), rollout, mask)
    for b, n in enumerate(lengths):
        for t in range(n):
            rho = math.exp(train[b, t].item() - rollout[b, t].item())
            assert w[b, t].item() == pytest.approx(rho if 0.5 <= rho <= 5.0 else 0.0)
            assert bool(keep[b, t]) == (0.5 <= rho <= 5.0)
    assert 0 < int(keep.sum()) < int(mask.sum())


def test_corrected_ppo_loss_equals_naive_reference():
    """token_tis weights in ppo_clip: token mean of min(rho_t, 2) * max(-A r, -A clip(r)) (Yao et al. 2025)."""
    g = torch.Generator().manual_seed(3)
    lengths, T = [4, 2, 3], 4
    mask = right_padded_mask(lengths, T)
    rollout = -torch.rand(3, T, generator=g, dtype=D64) * 2
    train_old = rollout + 0.8 * torch.randn(3, T, generator=g, dtype=D64)
    lp = train_old + 0.2 * torch.randn(3, T, generator=g, dtype=D64)
    adv = torch.randn(3, T, generator=g, dtype=D64)
    w, _, _ = correction_weights("token_tis", train_old, rollout, mask)
    loss, _ = ppo_clip(lp, train_old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28, weights=w)
    total = 0.0
    for b, n in enumerate(lengths):
        for t in range(n):
            rho = math.exp(train_old[b, t].item() - rollout[b, t].item())
            r = math.exp(lp[b, t].item() - train_old[b, t].item())
            a = adv[b, t].item()
            total += min(rho, 2.0) * max(-a * r, -a * min(max(r, 0.8), 1.28))
    assert loss.item() == pytest.approx(total / sum(lengths))


def test_no_overflow_and_errors():
    mask = torch.ones(1, 3, dtype=torch.bool)
    train = torch.tensor([[400.0, 300.0, -900.0]], dtype=torch.float32)
    rollout = torch.zeros(1, 3)
    for mode in ROLLOUT_CORRECTIONS:
        w, _, metrics = correction_weights(mode, train, rollout, mask)
        assert torch.isfinite(w).all() and w.dtype == torch.float32, mode
        assert all(torch.isfinite(v) for v in metrics.values()), mode
    with pytest.raises(ValueError, match=r"unknown rollout correction 'tis'; choices: token_tis, seq_tis"):
        correction_weights("tis", train, rollout, mask)
    with pytest.raises(ValueError, match="icepop_low <= icepop_high"):
        correction_weights("icepop", train, rollout, mask, icepop_low=5.0, icepop_high=0.5)
    with pytest.raises(ValueError, match="same"):
        correction_weights("seq_tis", train, rollout[:, :2], mask)
    with pytest.raises(ValueError):
        mismatch_metrics(train, rollout, mask[:, :2])
