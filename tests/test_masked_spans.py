"""A masked span inside a response (tool or environment tokens between two turns of the policy) is not an action and
not an episode end, for every estimator, aggregation mode, policy loss and rollout correction.

Two kinds of evidence: naive loops that walk each row's tokens and skip the masked ones (GAE and reward-to-go: the
next ACTION token bootstraps, gamma and lambda discount per action step: verl's `compute_gae_advantage_return`), and
invariance: inserting masked spans holding garbage (NaN included) into right-padded rows changes no output at an
action token and no loss or metric (so the single-turn results, which the other algos tests check against naive
loops, carry over to multi-turn rows).
"""

import math

import pytest
import torch

from astrai.algos import (ADVANTAGE_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES, aggregate_loss, gae, loss_units,
                          masked_mean)
from astrai.algos.rollout_correction import ROLLOUT_CORRECTIONS, correction_weights

D64 = torch.float64


def _compact(batch: int = 4, width: int = 6, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask (B, T) right-padded, every row >= 1 action token; a generator for the values)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (batch,), generator=g)
    mask = torch.arange(width)[None, :] < lengths[:, None]
    return mask, g


def _spread(mask: torch.Tensor, seed: int = 1, max_span: int = 3) -> torch.Tensor:
    """For each row of a right-padded mask, the column each action token lands in once masked spans of 0 to
    `max_span` columns are inserted before every action token but the first; returns (B, T) int64 columns (-1 at
    padding) and the width T' of the spread batch."""
    g = torch.Generator().manual_seed(seed)
    columns = torch.full(mask.shape, -1, dtype=torch.long)
    width = 0
    for b in range(mask.shape[0]):
        col = 0
        for t in range(int(mask[b].sum())):
            if t > 0:
                col += int(torch.randint(0, max_span + 1, (1,), generator=g))
            columns[b, t] = col
            col += 1
        width = max(width, col)
    return columns, width


def _place(x: torch.Tensor, mask: torch.Tensor, columns: torch.Tensor, width: int, fill=float("nan")):
    """`x` (B, T) at its action tokens moved to `columns` of a (B, width) tensor filled with `fill` elsewhere."""
    out = torch.full((x.shape[0], width), fill, dtype=x.dtype)
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            if mask[b, t]:
                out[b, columns[b, t]] = x[b, t]
    return out


def _gather(y: torch.Tensor, mask: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """The values of a spread (B, T') tensor back at the compact action positions (0 at padding)."""
    out = torch.zeros(mask.shape, dtype=y.dtype)
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if mask[b, t]:
                out[b, t] = y[b, columns[b, t]]
    return out


def _naive_gae(rewards, values, mask, gamma, lam):
    """Walk each row backwards; a masked token is skipped: it neither bootstraps nor ends the episode."""
    adv = torch.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        next_value, next_adv = 0.0, 0.0
        for t in reversed(range(rewards.shape[1])):
            if not mask[b, t]:
                continue
            delta = rewards[b, t].item() + gamma * next_value - values[b, t].item()
            next_adv = delta + gamma * lam * next_adv
            adv[b, t] = next_adv
            next_value = values[b, t].item()
    return adv, (adv + torch.where(mask, values, torch.zeros_like(values))) * mask


def test_gae_hand_values_across_a_tool_span():
    """Actions at t = 0 and 2, a tool token at t = 1 (its reward 5 and value 3 ignored): with gamma = lam = 1,
    A_2 = 2 - 1 = 1 and A_0 = 1 + 1 - 0.5 + 1 = 2.5 (reward-to-go 3 minus V_0); with gamma 0.5 the span costs no
    discount: A_0 = 1 + 0.5 * 1 - 0.5 + 0.5 * 1 = 1.5."""
    mask = torch.tensor([[True, False, True]])
    rewards = torch.tensor([[1.0, 5.0, 2.0]], dtype=D64)
    values = torch.tensor([[0.5, 3.0, 1.0]], dtype=D64)
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[2.5, 0.0, 1.0]], dtype=D64))
    torch.testing.assert_close(ret, torch.tensor([[3.0, 0.0, 2.0]], dtype=D64))
    adv, _ = gae(rewards, values, mask, gamma=0.5, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[1.5, 0.0, 1.0]], dtype=D64))


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.95), (0.5, 0.0), (1.0, 0.5)])
def test_gae_equals_the_naive_loop_on_rows_with_masked_spans(gamma, lam):
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(5, 9, generator=g) < 0.6  # spans anywhere, leading and trailing ones too
    mask[:, 0] |= mask.sum(1) == 0
    rewards, values = torch.randn(5, 9, generator=g, dtype=D64), torch.randn(5, 9, generator=g, dtype=D64)
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
    want_adv, want_ret = _naive_gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, want_adv)
    torch.testing.assert_close(ret, want_ret)


def _reinforce_pp_naive(rewards, mask, gamma):
    """Reward-to-go over each row's action tokens, whitened over all action tokens (unbiased variance)."""
    returns = torch.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        running = 0.0
        for t in reversed(range(rewards.shape[1])):
            if mask[b, t]:
                running = rewards[b, t].item() + gamma * running
                returns[b, t] = running
    real = returns[mask]
    adv = (returns - real.mean()) / math.sqrt(real.var(unbiased=True).item() + 1e-8) * mask
    return adv, returns


def test_reinforce_pp_equals_the_naive_loop_on_rows_with_masked_spans():
    g = torch.Generator().manual_seed(4)
    mask = torch.rand(4, 8, generator=g) < 0.7
    mask[:, 0] = True
    rewards = torch.randn(4, 8, generator=g, dtype=D64)
    adv, ret = ADVANTAGE_ESTIMATORS["reinforce_pp"].fn(scores=torch.zeros(4, dtype=D64), action_mask=mask,
                                                        token_rewards=rewards, gamma=0.9)
    want_adv, want_ret = _reinforce_pp_naive(rewards, mask, 0.9)
    torch.testing.assert_close(ret, want_ret)
    torch.testing.assert_close(adv, want_adv)


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_every_estimator_ignores_masked_spans(name):
    """Each estimator's advantages and returns at the action tokens are unchanged by masked spans of garbage
    (NaN) inserted between them; both are exactly 0 at the masked positions."""
    mask, g = _compact(batch=4, width=6)
    scores = torch.randn(4, generator=g, dtype=D64)
    token_rewards = torch.randn(4, 6, generator=g, dtype=D64) * mask
    values = torch.randn(4, 6, generator=g, dtype=D64)
    old, teacher = -torch.rand(4, 6, generator=g, dtype=D64), -torch.rand(4, 6, generator=g, dtype=D64)
    kwargs = dict(group_size=2, gamma=0.9, lam=0.95, whiten_advantages=True, reward_weight=0.5)
    estimator = ADVANTAGE_ESTIMATORS[name].fn
    for rewards in (None, token_rewards):
        adv, ret = estimator(scores=scores, action_mask=mask, token_rewards=rewards, values=values, old_logprobs=old,
                             teacher_logprobs=teacher, **kwargs)
        columns, width = _spread(mask)
        wide = torch.zeros(4, width, dtype=torch.bool)
        for b in range(4):
            wide[b, columns[b][columns[b] >= 0]] = True
        spread = lambda x: None if x is None else _place(x, mask, columns, width)  # noqa: E731
        adv2, ret2 = estimator(scores=scores, action_mask=wide, token_rewards=spread(rewards), values=spread(values),
                               old_logprobs=spread(old), teacher_logprobs=spread(teacher), **kwargs)
        torch.testing.assert_close(_gather(adv2, mask, columns), adv * mask)
        assert bool((adv2[~wide] == 0).all())
        if ret is not None:
            torch.testing.assert_close(_gather(ret2, mask, columns), ret * mask)
            assert bool((ret2[~wide] == 0).all())


def _spread_batch(seed: int = 0):
    mask, g = _compact(batch=4, width=5, seed=seed)
    columns, width = _spread(mask, seed=seed + 1)
    wide = torch.zeros(4, width, dtype=torch.bool)
    for b in range(4):
        wide[b, columns[b][columns[b] >= 0]] = True
    return mask, g, columns, width, wide


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_every_aggregation_mode_equals_the_naive_loop_with_masked_spans(mode):
    """Each mode over rows with masked spans equals a loop over each row's action tokens, and the unit count
    ignores the spans."""
    mask, g, columns, width, wide = _spread_batch()
    per_token = torch.randn(mask.shape, generator=g, dtype=D64)
    spread = _place(per_token, mask, columns, width)
    rows = [[per_token[b, t].item() for t in range(mask.shape[1]) if mask[b, t]] for b in range(4)]
    naive = {"token-mean": sum(map(sum, rows)) / sum(map(len, rows)),
             "seq-mean-token-mean": sum(sum(r) / len(r) for r in rows) / len(rows),
             "seq-mean-token-sum": sum(map(sum, rows)) / len(rows),
             "seq-mean-token-sum-norm": sum(map(sum, rows)) / (len(rows) * 7.0)}[mode]
    got = aggregate_loss(spread, wide, loss_agg_mode=mode, loss_scale_factor=7.0)
    assert got.item() == pytest.approx(naive, rel=1e-12)
    assert int(loss_units(wide, mode)) == int(loss_units(mask, mode))


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_every_policy_loss_ignores_masked_spans(name, mode):
    """Loss, gradient at the action tokens and every metric are those of the rows without the spans."""
    mask, g, columns, width, wide = _spread_batch(seed=5)
    old = -torch.rand(mask.shape, generator=g, dtype=D64)
    logprobs = (old + 0.2 * torch.randn(mask.shape, generator=g, dtype=D64)).requires_grad_(True)
    adv = torch.randn(mask.shape, generator=g, dtype=D64)
    fn = POLICY_LOSSES[name].fn
    kwargs = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode=mode, loss_scale_factor=7.0)
    loss, metrics = fn(logprobs, old, adv, mask, **kwargs)
    loss.backward()
    wide_lp = _place(logprobs.detach(), mask, columns, width).requires_grad_(True)
    loss2, metrics2 = fn(wide_lp, _place(old, mask, columns, width), _place(adv, mask, columns, width), wide,
                         **kwargs)
    loss2.backward()
    torch.testing.assert_close(loss2, loss)
    assert sorted(metrics2) == sorted(metrics)
    for key in metrics:
        torch.testing.assert_close(metrics2[key], metrics[key])
    torch.testing.assert_close(_gather(wide_lp.grad, mask, columns), logprobs.grad * mask)
    assert bool((wide_lp.grad[~wide] == 0).all())


@pytest.mark.parametrize("mode", sorted(ROLLOUT_CORRECTIONS))
def test_every_rollout_correction_ignores_masked_spans(mode):
    mask, g, columns, width, wide = _spread_batch(seed=7)
    train = -torch.rand(mask.shape, generator=g, dtype=D64)
    rollout = train + 0.3 * torch.randn(mask.shape, generator=g, dtype=D64)
    weights, keep, metrics = correction_weights(mode, train, rollout, mask)
    weights2, keep2, metrics2 = correction_weights(mode, _place(train, mask, columns, width),
                                                   _place(rollout, mask, columns, width), wide)
    torch.testing.assert_close(_gather(weights2, mask, columns), weights * mask)
    assert torch.equal(_gather(keep2.to(D64), mask, columns).bool(), keep & mask)
    assert not bool(keep2[~wide].any())
    for key in metrics:
        torch.testing.assert_close(metrics2[key], metrics[key])


def test_masked_means_count_action_tokens_only():
    mask, g, columns, width, wide = _spread_batch(seed=9)
    x = torch.randn(mask.shape, generator=g, dtype=D64)
    torch.testing.assert_close(masked_mean(_place(x, mask, columns, width), wide), masked_mean(x, mask))
