"""astrai.algos against naive Python loops and hand-computed values (docs/conventions.md section 2)."""

from __future__ import annotations

import math

import pytest
import torch

from astrai.algos import (
    KL_ESTIMATORS,
    entropy_from_logits,
    gae,
    group_advantages,
    kl_estimate,
    last_token_index,
    logprobs_from_hidden,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    ppo_token_rewards,
)

D64 = torch.float64


def right_padded_mask(lengths: list[int], T: int) -> torch.Tensor:
    return torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]


def with_garbage(x: torch.Tensor, mask: torch.Tensor, value: float = float("nan")) -> torch.Tensor:
    return torch.where(mask, x, torch.full_like(x, value))


def naive_gae(rewards, values, lengths, gamma, lam):
    """Plain-float GAE over the first `length` tokens of each row; zeros elsewhere."""
    B, T = len(rewards), len(rewards[0])
    adv = [[0.0] * T for _ in range(B)]
    ret = [[0.0] * T for _ in range(B)]
    for b in range(B):
        n = lengths[b]
        last = 0.0
        for t in reversed(range(n)):
            v_next = values[b][t + 1] if t + 1 < n else 0.0
            delta = rewards[b][t] + gamma * v_next - values[b][t]
            last = delta + gamma * lam * last
            adv[b][t] = last
            ret[b][t] = last + values[b][t]
    return torch.tensor(adv, dtype=D64), torch.tensor(ret, dtype=D64)


# ----------------------------------------------------------------------------------------------- masked


def test_masked_reductions_ignore_garbage_and_match_naive():
    g = torch.Generator().manual_seed(0)
    mask = right_padded_mask([3, 1, 5, 4], 5)
    x = torch.randn(4, 5, generator=g, dtype=D64)
    xg = with_garbage(x, mask)
    real = [x[b, t].item() for b in range(4) for t in range(5) if mask[b, t]]
    mean = sum(real) / len(real)
    assert masked_sum(xg, mask).item() == pytest.approx(sum(real))
    assert masked_mean(xg, mask).item() == pytest.approx(mean)
    var_u = sum((v - mean) ** 2 for v in real) / (len(real) - 1)
    assert masked_var(xg, mask).item() == pytest.approx(var_u)
    assert masked_var(xg, mask, unbiased=False).item() == pytest.approx(var_u * (len(real) - 1) / len(real))
    row_means = masked_mean(xg, mask, dim=1)
    for b, n in enumerate([3, 1, 5, 4]):
        assert row_means[b].item() == pytest.approx(x[b, :n].mean().item())
    assert masked_mean(xg, mask, num_tokens=100).item() == pytest.approx(sum(real) / 100)
    assert masked_mean(xg, mask, num_tokens=torch.tensor(100)).item() == pytest.approx(sum(real) / 100)


def test_masked_edge_cases():
    x = torch.randn(2, 3)
    empty = torch.zeros(2, 3, dtype=torch.bool)
    assert masked_mean(x, empty).item() == 0.0
    assert masked_var(x, empty).item() == 0.0
    with pytest.raises(ValueError):
        masked_mean(x, torch.ones(3, 2, dtype=torch.bool))
    with pytest.raises(ValueError):
        masked_mean(x, torch.ones(2, 3, dtype=torch.bool), num_tokens=0)


def test_masked_var_gradient_finite_with_nan_padding():
    mask = right_padded_mask([2, 3], 4)
    x = with_garbage(torch.randn(2, 4, dtype=D64), mask).requires_grad_(True)
    masked_var(x, mask).backward()
    assert torch.isfinite(x.grad).all()
    assert (x.grad[~mask] == 0).all()


def test_whiten_mean0_std1_over_real_tokens_masked_outputs_zero():
    g = torch.Generator().manual_seed(1)
    mask = right_padded_mask([6, 2, 4], 6)
    x = with_garbage(3.0 + 2.5 * torch.randn(3, 6, generator=g, dtype=D64), mask, 1e6)
    y = masked_whiten(x, mask)
    real = y[mask]
    assert real.mean().item() == pytest.approx(0.0, abs=1e-12)
    assert real.std(unbiased=True).item() == pytest.approx(1.0, abs=1e-6)
    assert (y[~mask] == 0).all()
    y2 = masked_whiten(x, mask, shift_mean=False)
    assert y2[mask].mean().item() == pytest.approx(x[mask].mean().item())
    assert y2[mask].std().item() == pytest.approx(1.0, abs=1e-6)
    assert (y2[~mask] == 0).all()


# --------------------------------------------------------------------------------------------- logprobs


def test_logprobs_from_logits_matches_log_softmax_gather_with_temperature():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 5, 11, generator=g) * 4
    labels = torch.randint(0, 11, (3, 5), generator=g)
    for temperature in (1.0, 0.6, 1.7):
        ref = torch.log_softmax(logits / temperature, dim=-1).gather(-1, labels[..., None]).squeeze(-1)
        for chunk_rows in (1, 4, 1024):
            out = logprobs_from_logits(logits, labels, temperature=temperature, chunk_rows=chunk_rows)
            assert out.shape == (3, 5) and out.dtype == torch.float32
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_logprobs_gradient_bf16_input_and_errors():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 4, 7, generator=g, dtype=D64, requires_grad=True)
    labels = torch.randint(0, 7, (2, 4), generator=g)
    logprobs_from_logits(logits, labels, temperature=0.8, chunk_rows=3).sum().backward()
    ref_logits = logits.detach().clone().requires_grad_(True)
    torch.log_softmax(ref_logits / 0.8, -1).gather(-1, labels[..., None]).sum().backward()
    torch.testing.assert_close(logits.grad.float(), ref_logits.grad.float(), rtol=1e-5, atol=1e-6)
    out = logprobs_from_logits(logits.detach().bfloat16(), labels)
    assert out.dtype == torch.float32
    # truncated vocabulary: -inf logits are fine while the label's logit is finite
    trunc = logits.detach().float().clone()
    trunc[..., 0] = float("-inf")
    safe_labels = labels.clamp(min=1)
    ref = torch.log_softmax(trunc, -1).gather(-1, safe_labels[..., None]).squeeze(-1)
    torch.testing.assert_close(logprobs_from_logits(trunc, safe_labels), ref)
    with pytest.raises(ValueError):
        logprobs_from_logits(logits, labels.int())
    with pytest.raises(ValueError):
        logprobs_from_logits(logits, labels[:, :3])
    with pytest.raises(ValueError):
        logprobs_from_logits(logits, labels, temperature=0.0)


def test_logprobs_from_hidden_matches_the_full_logits():
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(3, 5, 8, generator=g, requires_grad=True)
    weight = torch.randn(13, 8, generator=g, requires_grad=True)
    labels = torch.randint(0, 13, (3, 5), generator=g)
    mask = right_padded_mask([5, 2, 0], 5)
    for temperature in (1.0, 0.6, 1.7):
        full = logprobs_from_logits(torch.nn.functional.linear(hidden, weight), labels, temperature=temperature)
        for chunk_rows in (1, 4, 256):
            out = logprobs_from_hidden(hidden, weight, labels, temperature=temperature, chunk_rows=chunk_rows)
            assert out.shape == (3, 5) and out.dtype == torch.float32
            torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-5)
            masked = logprobs_from_hidden(hidden, weight, labels, temperature=temperature, chunk_rows=chunk_rows,
                                          mask=mask)
            torch.testing.assert_close(masked[mask], full[mask], rtol=1e-5, atol=1e-5)
            assert bool((masked[~mask] == 0).all())
    # gradients (through the chunks and the masked scatter) equal the full computation's
    full = logprobs_from_logits(torch.nn.functional.linear(hidden, weight), labels, temperature=0.6)
    expected = torch.autograd.grad(full[mask].sum(), (hidden, weight))
    got = torch.autograd.grad(logprobs_from_hidden(hidden, weight, labels, temperature=0.6, chunk_rows=3,
                                                   mask=mask).sum(), (hidden, weight))
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert logprobs_from_hidden(hidden, weight, labels, mask=torch.zeros(3, 5, dtype=torch.bool)).abs().sum() == 0
    with pytest.raises(ValueError):
        logprobs_from_hidden(hidden, weight[:, :7], labels)
    with pytest.raises(ValueError):
        logprobs_from_hidden(hidden, weight, labels, mask=mask[:, :4])
    with pytest.raises(ValueError):
        logprobs_from_hidden(hidden, weight, labels, chunk_rows=0)


def test_entropy_from_logits_matches_naive():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 3, 6, generator=g, dtype=D64) * 3
    for temperature in (1.0, 0.7):
        out = entropy_from_logits(logits, temperature=temperature, chunk_rows=2)
        assert out.shape == (2, 3) and out.dtype == torch.float32
        for b in range(2):
            for t in range(3):
                z = [v / temperature for v in logits[b, t].tolist()]
                norm = sum(math.exp(v) for v in z)
                ps = [math.exp(v) / norm for v in z]
                naive = -sum(p * math.log(p) for p in ps)
                assert out[b, t].item() == pytest.approx(naive, rel=1e-5)
    trunc = torch.tensor([[[0.0, 0.0, float("-inf"), float("-inf")]]])
    assert entropy_from_logits(trunc).item() == pytest.approx(math.log(2), rel=1e-6)


# -------------------------------------------------------------------------------------------------- kl


def test_kl_estimators_hand_values_and_k3_nonnegative():
    lp = torch.tensor([0.0], dtype=D64)
    ref = torch.tensor([math.log(2.0)], dtype=D64)
    d = math.log(2.0)
    assert kl_estimate(lp, ref, estimator="k1").item() == pytest.approx(-d)
    assert kl_estimate(lp, ref, estimator="k2").item() == pytest.approx(0.5 * d * d)
    assert kl_estimate(lp, ref).item() == pytest.approx(2.0 - 1.0 - d)  # k3 default
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(1000, generator=g) * 3, torch.randn(1000, generator=g) * 3
    k3 = kl_estimate(a, b, estimator="k3")
    assert (k3 >= 0).all()
    assert kl_estimate(a, a).abs().max().item() == 0.0
    assert set(KL_ESTIMATORS) == {"k1", "k2", "k3"}


def test_kl_unknown_estimator_names_choices():
    with pytest.raises(ValueError, match=r"'k4'.*k1, k2, k3"):
        kl_estimate(torch.zeros(2), torch.zeros(2), estimator="k4")


# ------------------------------------------------------------------------------------------ advantages


def test_ppo_token_rewards_score_on_last_real_token_never_padding():
    g = torch.Generator().manual_seed(6)
    lengths = [4, 1, 6, 3]
    mask = right_padded_mask(lengths, 6)
    kl = with_garbage(torch.rand(4, 6, generator=g, dtype=D64), mask)
    scores = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=D64)
    rewards = ppo_token_rewards(scores, kl, mask, kl_coef=0.1)
    assert (rewards[~mask] == 0).all()
    for b, n in enumerate(lengths):
        for t in range(n):
            expect = -0.1 * kl[b, t].item() + (scores[b].item() if t == n - 1 else 0.0)
            assert rewards[b, t].item() == pytest.approx(expect)
    # a non-contiguous mask: the score still goes to the last real token
    gap = torch.tensor([[True, False, True, False]])
    r = ppo_token_rewards(torch.tensor([5.0]), torch.zeros(1, 4), gap, kl_coef=0.1)
    assert r.tolist() == [[0.0, 0.0, 5.0, 0.0]]
    assert last_token_index(gap).tolist() == [2]


def test_ppo_token_rewards_raises_on_empty_row():
    mask = right_padded_mask([2, 0], 3)
    with pytest.raises(ValueError, match="no real token"):
        ppo_token_rewards(torch.ones(2), torch.zeros(2, 3), mask, kl_coef=0.1)


def test_gae_hand_computed_three_tokens_with_padding():
    nan = float("nan")
    rewards = torch.tensor([[0.0, 0.5, 1.0, nan, 7.0]], dtype=D64)
    values = torch.tensor([[0.5, 0.25, 1.0, 9.0, nan]], dtype=D64)
    mask = right_padded_mask([3], 5)
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # delta2 = 1 - 1 = 0; delta1 = 0.5 + 0.9*1 - 0.25 = 1.15; delta0 = 0 + 0.9*0.25 - 0.5 = -0.275
    # A2 = 0; A1 = 1.15; A0 = -0.275 + 0.72*1.15 = 0.553
    torch.testing.assert_close(adv, torch.tensor([[0.553, 1.15, 0.0, 0.0, 0.0]], dtype=D64))
    torch.testing.assert_close(ret, torch.tensor([[1.053, 1.4, 1.0, 0.0, 0.0]], dtype=D64))


def _random_gae_inputs(seed: int, lengths: list[int], T: int):
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    mask = right_padded_mask(lengths, T)
    rewards = torch.randn(B, T, generator=g, dtype=D64)
    values = torch.randn(B, T, generator=g, dtype=D64)
    return rewards, values, mask


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 0.9), (0.5, 1.0), (1.0, 1.0), (0.9, 0.0)])
def test_gae_matches_naive_loop_and_ignores_padding(gamma, lam):
    lengths = [7, 1, 4, 5, 2]
    rewards, values, mask = _random_gae_inputs(7, lengths, 7)
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
    n_adv, n_ret = naive_gae(rewards.tolist(), values.tolist(), lengths, gamma, lam)
    torch.testing.assert_close(adv, n_adv)
    torch.testing.assert_close(ret, n_ret)
    for fill in (float("nan"), float("inf"), 1e9):
        adv_g, ret_g = gae(with_garbage(rewards, mask, fill), with_garbage(values, mask, -fill), mask,
                           gamma=gamma, lam=lam)
        torch.testing.assert_close(adv_g, adv)
        torch.testing.assert_close(ret_g, ret)
        assert (adv_g[~mask] == 0).all() and (ret_g[~mask] == 0).all()


def test_gae_lambda0_is_td_error_and_lambda1_gamma1_is_reward_to_go_minus_v():
    lengths = [5, 3, 1]
    rewards, values, mask = _random_gae_inputs(8, lengths, 5)
    adv0, _ = gae(rewards, values, mask, gamma=0.9, lam=0.0)
    adv1, ret1 = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    for b, n in enumerate(lengths):
        r, v = rewards[b].tolist(), values[b].tolist()
        for t in range(n):
            v_next = v[t + 1] if t + 1 < n else 0.0
            assert adv0[b, t].item() == pytest.approx(r[t] + 0.9 * v_next - v[t])
            assert adv1[b, t].item() == pytest.approx(sum(r[t:n]) - v[t])
            assert ret1[b, t].item() == pytest.approx(sum(r[t:n]))


def test_gae_nonzero_count_equals_real_tokens_and_no_grad():
    lengths = [9, 3, 6, 1, 8]
    rewards, values, mask = _random_gae_inputs(9, lengths, 9)
    values.requires_grad_(True)
    adv, ret = gae(rewards, values, mask, gamma=0.99, lam=0.95)
    assert int((adv != 0).sum()) == sum(lengths) == int(mask.sum())
    assert not adv.requires_grad and not ret.requires_grad


def test_group_advantages_hand_values_identical_groups_and_floor():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    adv = group_advantages(scores, group_size=4)
    a = 0.5 / (math.sqrt(1.0 / 3.0) + 1e-6)
    torch.testing.assert_close(adv[:4], torch.tensor([a, -a, -a, a]))
    assert torch.isfinite(adv).all()
    torch.testing.assert_close(adv[4:], torch.zeros(4), atol=1e-6, rtol=0)
    adv2d = group_advantages(scores.reshape(2, 4), group_size=4)
    assert adv2d.shape == (2, 4)
    torch.testing.assert_close(adv2d.flatten(), adv)
    pop = group_advantages(scores, group_size=4, unbiased=False)
    assert pop[0].item() == pytest.approx(0.5 / (0.5 + 1e-6))
    near = torch.tensor([1.0, 1.0001], dtype=D64)
    floored = group_advantages(near, group_size=2, std_floor=0.1)
    assert floored.abs().max().item() < 1e-3
    assert group_advantages(torch.tensor([3.0, 4.0]), group_size=1).abs().max().item() == 0.0
    assert group_advantages(torch.tensor([1, 0]), group_size=2).dtype == torch.float32


def test_group_advantages_scale_batch_and_none_hand_values():
    """scale="batch": group mean, std of all B*G scores (Lite PPO); scale="none": group-centred only (Dr. GRPO)."""
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0], dtype=D64)
    # groups of 4: means 0.25 and 0.75; all 8 scores: mean 0.5, unbiased variance 8 * 0.25 / 7
    centered = torch.tensor([0.75, -0.25, -0.25, -0.25, 0.25, 0.25, -0.75, 0.25], dtype=D64)
    torch.testing.assert_close(group_advantages(scores, group_size=4, scale="none"), centered)
    batch_std = math.sqrt(2.0 / 7.0)
    torch.testing.assert_close(group_advantages(scores, group_size=4, scale="batch", eps=0.0), centered / batch_std)
    pop = group_advantages(scores, group_size=4, scale="batch", eps=0.0, unbiased=False)
    torch.testing.assert_close(pop, centered / 0.5)
    # the group scale divides a 1-of-4 group by its own std (sqrt(0.25)), the batch scale by the rollout's
    grouped = group_advantages(scores, group_size=4, eps=0.0)
    torch.testing.assert_close(grouped[:4], centered[:4] / 0.5)
    # std_floor bounds the batch std too; identical groups stay at 0 under every scale
    floored = group_advantages(scores, group_size=4, scale="batch", eps=0.0, std_floor=1.0)
    torch.testing.assert_close(floored, centered)
    same = torch.tensor([2.0, 2.0, 5.0, 5.0])
    for scale in ("group", "batch", "none"):
        assert group_advantages(same, group_size=2, scale=scale).abs().max().item() == 0.0
    with pytest.raises(ValueError, match="scale must be one of group, batch, none, got 'std'"):
        group_advantages(scores, group_size=4, scale="std")


def test_global_moments_hand_values_and_batch_std_override():
    """One process: the two-pass mean and variance of the real positions (Bessel or population), as masked_mean /
    masked_var; fewer than two elements give variance 0; the ranks' sums go through the given reduce. A given
    batch_std replaces the std of the scores under scale="batch" only."""
    from astrai.algos import global_moments

    def std(*args, **kwargs):
        return global_moments(*args, **kwargs)[1].sqrt()

    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=D64)  # mean 2.5, squared deviations 5
    torch.testing.assert_close(global_moments(x)[0], torch.tensor(2.5, dtype=D64))
    torch.testing.assert_close(std(x), torch.tensor(math.sqrt(5 / 3), dtype=D64))
    torch.testing.assert_close(std(x, unbiased=False), torch.tensor(math.sqrt(5 / 4), dtype=D64))
    assert std(torch.tensor([7.0])).item() == 0.0 and std(torch.tensor([7.0]), unbiased=False) == 0
    # a mask: only 1, 3 (and NaN at a masked position never reaches the arithmetic)
    garbage = torch.tensor([[1.0, float("nan")], [3.0, 5.0]], dtype=D64)
    mask = torch.tensor([[True, False], [True, False]])
    mean, var = global_moments(garbage, mask)
    assert mean.item() == 2.0 and var.item() == 2.0
    torch.testing.assert_close(var, masked_var(garbage, mask))
    calls = []

    def summed_twice(t):  # as if a second rank held an identical copy: sums double, the mean stays
        calls.append(t.shape)
        return 2 * t

    torch.testing.assert_close(std(x, all_reduce_sum=summed_twice), torch.tensor(math.sqrt(10 / 7), dtype=D64))
    assert calls == [(2,), ()]  # (sum, count), then the squared deviations
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=D64)
    given = torch.tensor(2.0, dtype=D64)
    torch.testing.assert_close(group_advantages(scores, group_size=2, scale="batch", eps=0.0, batch_std=given),
                               torch.tensor([0.25, -0.25, 0.0, 0.0], dtype=D64))
    torch.testing.assert_close(group_advantages(scores, group_size=2, batch_std=given),
                               group_advantages(scores, group_size=2))  # scale "group": ignored


def test_scale_rewards_choices_match_the_config():
    from astrai.algos import SCALE_REWARDS
    from astrai.config import GRPOSection
    from astrai.config_schema import field_specs

    _, check = field_specs(GRPOSection)["scale_rewards"]
    assert tuple(check.values) == SCALE_REWARDS


def test_group_advantages_errors():
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(6), group_size=4)
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(2, 3), group_size=4)
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(4), group_size=0)
