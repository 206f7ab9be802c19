"""astrai.algos advantage estimators (gae, grpo, rloo, reinforce_pp, reinforce_pp_baseline, on_policy_distill): hand
values, naive loops of the peers' formulas (verl core_algos, TRL RLOOTrainer, OpenRLHF, Thinking Machines' on-policy
distillation), padding, and global whitening over two simulated data-parallel ranks (docs/conventions.md
section 2)."""

from __future__ import annotations

import inspect
import math
import threading

import pytest
import torch

from astrai.algos import (
    ADVANTAGE_ESTIMATORS,
    advantage_estimator,
    gae,
    group_advantages,
    kl_k3,
    masked_whiten,
    ppo_token_rewards,
)

D64 = torch.float64


def right_padded_mask(lengths: list[int], T: int) -> torch.Tensor:
    return torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]


def with_garbage(x: torch.Tensor, mask: torch.Tensor, value: float = float("nan")) -> torch.Tensor:
    return torch.where(mask, x, torch.full_like(x, value))


def estimate(name: str, **kw):
    return ADVANTAGE_ESTIMATORS[name].fn(**kw)


def whiten_list(values: list[float], eps: float = 1e-8) -> list[float]:
    """verl `masked_whiten` on plain floats: unbiased variance, (x - mean) / sqrt(var + eps)."""
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return [(v - mean) / math.sqrt(var + eps) for v in values]


def unflatten(flat: list[float], lengths: list[int], T: int) -> torch.Tensor:
    out, i = torch.zeros(len(lengths), T, dtype=D64), 0
    for b, n in enumerate(lengths):
        out[b, :n] = torch.tensor(flat[i:i + n], dtype=D64)
        i += n
    return out


class TwoRanks:
    """An `all_reduce_sum` for two threads standing for two data-parallel ranks: each call blocks until both
    ranks have contributed, then returns the sum (a real all-reduce's contract)."""

    def __init__(self):
        self.barrier = threading.Barrier(2, timeout=30)
        self.slots: list = [None, None]
        self.calls = 0

    def reducer(self, rank: int):
        def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = t.clone()
            self.barrier.wait()
            total = self.slots[0] + self.slots[1]
            self.barrier.wait()
            self.calls += rank == 0
            return total
        return all_reduce_sum

    def run(self, fn0, fn1):
        out = [None, None]

        def target(rank, fn):
            out[rank] = fn(self.reducer(rank))

        threads = [threading.Thread(target=target, args=(r, f)) for r, f in enumerate((fn0, fn1))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert out[0] is not None and out[1] is not None, "a simulated rank failed"
        return out


# ------------------------------------------------------------------------------------------ hand values


def test_rloo_hand_values_and_group_of_one():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0], dtype=D64)
    mask = right_padded_mask([2, 1, 3, 2, 1, 1, 1, 1], 3)
    adv, ret = estimate("rloo", scores=scores, action_mask=mask, group_size=4)
    # group 1: r=1 vs others (0 + 0 + 1) / 3 -> 2/3; r=0 vs (1 + 0 + 1) / 3 -> -2/3; group 2 all equal -> 0
    per_row = torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0, 0], dtype=D64)
    torch.testing.assert_close(adv, per_row[:, None] * mask)
    assert ret is None and not adv.requires_grad
    alone, _ = estimate("rloo", scores=scores, action_mask=mask, group_size=1)
    assert alone.abs().max().item() == 0.0
    with pytest.raises(ValueError, match="not whole groups of group_size=3"):
        estimate("rloo", scores=scores, action_mask=mask, group_size=3)


def test_reinforce_pp_hand_values_discounted_and_whitened():
    nan = float("nan")
    token_rewards = torch.tensor([[-0.1, -0.2, 1.0], [0.5, nan, 7.0]], dtype=D64)
    mask = right_padded_mask([3, 1], 3)
    adv, ret = estimate("reinforce_pp", scores=torch.tensor([1.0, 0.5], dtype=D64), action_mask=mask,
                        token_rewards=token_rewards, gamma=0.5)
    # reward-to-go, gamma 0.5: row 0: 1.0; -0.2 + 0.5 * 1.0 = 0.3; -0.1 + 0.5 * 0.3 = 0.05; row 1: 0.5
    torch.testing.assert_close(ret, torch.tensor([[0.05, 0.3, 1.0], [0.5, 0.0, 0.0]], dtype=D64))
    # real returns 0.05, 0.3, 1.0, 0.5: mean 0.4625, squared deviations sum 0.486875, unbiased var / 3
    std = math.sqrt(0.486875 / 3 + 1e-8)
    expect = torch.tensor([[0.05, 0.3, 1.0], [0.5, 0.4625, 0.4625]], dtype=D64)
    torch.testing.assert_close(adv, (expect - 0.4625) / std * mask)
    # scores only, gamma 1: the score on every real token, tokens 1, 1, 0: mean 2/3, unbiased var 1/3
    adv2, _ = estimate("reinforce_pp", scores=torch.tensor([1.0, 0.0], dtype=D64),
                       action_mask=right_padded_mask([2, 1], 2))
    s = math.sqrt(1 / 3 + 1e-8)
    torch.testing.assert_close(adv2, torch.tensor([[1 / 3 / s, 1 / 3 / s], [-2 / 3 / s, 0.0]], dtype=D64))


def test_reinforce_pp_baseline_hand_values():
    scores = torch.tensor([1.0, 0.0, 0.5, 0.5], dtype=D64)
    mask = right_padded_mask([2, 1, 1, 2], 2)
    adv, ret = estimate("reinforce_pp_baseline", scores=scores, action_mask=mask, group_size=2)
    # group means 0.5 and 0.5 -> centred 0.5, -0.5, 0, 0 on the last token; gamma 1 spreads it over the row
    torch.testing.assert_close(ret, torch.tensor([[0.5, 0.5], [-0.5, 0.0], [0.0, 0.0], [0.0, 0.0]], dtype=D64))
    # real tokens 0.5, 0.5, -0.5, 0, 0, 0: mean 1/12; squared deviations (25 + 25 + 49 + 1 + 1 + 1) / 144; / 5
    std = math.sqrt(102 / 144 / 5 + 1e-8)
    expect = (torch.tensor([[0.5, 0.5], [-0.5, 0.0], [0.0, 0.0], [0.0, 0.0]], dtype=D64) - 1 / 12) / std
    torch.testing.assert_close(adv, expect * mask)


def test_grpo_estimator_is_group_advantages_of_the_returns_broadcast():
    g = torch.Generator().manual_seed(1)
    lengths = [3, 1, 4, 2, 4, 4]
    mask = right_padded_mask(lengths, 4)
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0], dtype=D64)
    kl = with_garbage(torch.rand(6, 4, generator=g, dtype=D64), mask)
    # KL in the reward: token rewards sum to score - coef * sum_t kl, as online_grpo's kl_reward_coef
    rewards = ppo_token_rewards(scores, kl, mask, kl_coef=0.1)
    r = scores - 0.1 * torch.where(mask, kl, torch.zeros_like(kl)).sum(-1)
    for scale in ("group", "batch", "none"):
        adv, ret = estimate("grpo", scores=scores, action_mask=mask, token_rewards=rewards, group_size=3,
                            scale=scale, std_floor=0.01)
        expect = group_advantages(r, group_size=3, scale=scale, std_floor=0.01)
        torch.testing.assert_close(adv, expect[:, None] * mask)
        assert ret is None
    plain, _ = estimate("grpo", scores=scores, action_mask=mask, group_size=3)
    torch.testing.assert_close(plain, group_advantages(scores, group_size=3)[:, None] * mask)


def test_gae_estimator_is_gae_with_optional_whitening():
    g = torch.Generator().manual_seed(2)
    lengths = [5, 2, 4]
    mask = right_padded_mask(lengths, 5)
    values = torch.randn(3, 5, generator=g, dtype=D64)
    kl = torch.rand(3, 5, generator=g, dtype=D64)
    scores = torch.tensor([1.0, -0.5, 0.25], dtype=D64)
    rewards = ppo_token_rewards(scores, kl, mask, kl_coef=0.05)
    adv, ret = estimate("gae", scores=scores, action_mask=mask, token_rewards=rewards, values=values,
                        gamma=0.99, lam=0.95)
    ref_adv, ref_ret = gae(rewards, values, mask, gamma=0.99, lam=0.95)
    torch.testing.assert_close(adv, ref_adv)
    torch.testing.assert_close(ret, ref_ret)
    white, ret_w = estimate("gae", scores=scores, action_mask=mask, token_rewards=rewards, values=values,
                            gamma=0.99, lam=0.95, whiten_advantages=True)
    torch.testing.assert_close(white, masked_whiten(ref_adv, mask))
    torch.testing.assert_close(ret_w, ref_ret)  # returns come before whitening
    # no token rewards: the score on the last real token only (kl_coef 0)
    bare, _ = estimate("gae", scores=scores, action_mask=mask, values=values, gamma=1.0, lam=1.0)
    torch.testing.assert_close(bare, gae(ppo_token_rewards(scores, torch.zeros_like(kl), mask, kl_coef=0.0),
                                         values, mask, gamma=1.0, lam=1.0)[0])
    with pytest.raises(ValueError, match="'gae' needs the critic's values"):
        estimate("gae", scores=scores, action_mask=mask)


def naive_distill(old, teacher, lengths, scores=None, G=1, weight=0.0):
    """On-policy distillation (Lu and Thinking Machines Lab 2025) token by token on plain floats: A_t = teacher_t -
    old_t on the first `lengths[b]` tokens of row b, 0 after, plus `weight` times GRPO's (r - mean_G) /
    (unbiased std_G + 1e-6) of the row's score."""
    out = []
    for b, n in enumerate(lengths):
        bonus = 0.0
        if weight:
            group = scores[(b // G) * G:(b // G + 1) * G]
            mean = sum(group) / G
            std = math.sqrt(sum((x - mean) ** 2 for x in group) / (G - 1))
            bonus = weight * (scores[b] - mean) / (std + 1e-6)
        out.append([teacher[b][t] - old[b][t] + bonus if t < n else 0.0 for t in range(len(old[b]))])
    return torch.tensor(out, dtype=D64)


def test_on_policy_distill_hand_values_and_naive_loop():
    nan = float("nan")
    old = [[-1.0, -0.5, -2.0], [-0.25, nan, nan], [-3.0, -0.1, nan], [-0.7, -0.2, -0.9]]
    teacher = [[-0.5, -1.5, -2.0], [-1.0, nan, -7.0], [-1.0, -0.1, nan], [-0.2, -0.2, -1.4]]
    lengths = [3, 1, 2, 3]
    mask = right_padded_mask(lengths, 3)
    scores = torch.tensor([1.0, 0.0, 0.0, 2.0], dtype=D64)
    kw = dict(scores=scores, action_mask=mask, old_logprobs=torch.tensor(old, dtype=D64),
              teacher_logprobs=torch.tensor(teacher, dtype=D64), group_size=2)
    adv, ret = estimate("on_policy_distill", **kw)
    # by hand: teacher - student at each real token, nothing discounted or carried over, 0 at padding (NaN there)
    torch.testing.assert_close(adv, torch.tensor([[0.5, -1.0, 0.0], [-0.75, 0.0, 0.0], [2.0, 0.0, 0.0],
                                                  [0.5, 0.0, -0.5]], dtype=D64))
    assert ret is None and not adv.requires_grad and (adv[~mask] == 0).all()
    torch.testing.assert_close(adv, naive_distill(old, teacher, lengths))
    # with the task reward: groups (1, 0) and (0, 2): std_G = sqrt(0.5) and sqrt(2), so A_grpo = +-0.7071 in both
    weighted, _ = estimate("on_policy_distill", **kw, reward_weight=0.5)
    torch.testing.assert_close(weighted, naive_distill(old, teacher, lengths, scores.tolist(), G=2, weight=0.5))
    bonus = 0.5 * 0.5 / (math.sqrt(0.5) + 1e-6)  # weight * (1 - 0.5) / std_G
    assert weighted[0, 0].item() == pytest.approx(0.5 + bonus)
    assert weighted[1, 0].item() == pytest.approx(-0.75 - bonus)
    assert (weighted[~mask] == 0).all()
    # random inputs against the loop, and the reward term is the grpo estimator's advantage, weighted
    g = torch.Generator().manual_seed(9)
    lengths = [4, 1, 3, 2, 4, 4]
    mask = right_padded_mask(lengths, 4)
    old, teacher = (-torch.rand(6, 4, generator=g, dtype=D64) * 4 for _ in range(2))
    scores = torch.randn(6, generator=g, dtype=D64)
    adv, _ = estimate("on_policy_distill", scores=scores, action_mask=mask, old_logprobs=with_garbage(old, mask),
                      teacher_logprobs=with_garbage(teacher, mask), group_size=3, reward_weight=2.0)
    torch.testing.assert_close(adv, naive_distill(old.tolist(), teacher.tolist(), lengths, scores.tolist(), G=3,
                                                  weight=2.0))
    grpo, _ = estimate("grpo", scores=scores, action_mask=mask, group_size=3)
    torch.testing.assert_close(adv, (teacher - old) * mask + 2.0 * grpo)


# ------------------------------------------------------------------------------ peers' formulas, naive


def test_rloo_matches_naive_verl_and_trl_formulas():
    g = torch.Generator().manual_seed(3)
    G, lengths = 4, [3, 1, 2, 3, 2, 2, 1, 3]
    scores = torch.randn(8, generator=g, dtype=D64)
    adv, _ = estimate("rloo", scores=scores, action_mask=right_padded_mask(lengths, 3), group_size=G)
    s = scores.tolist()
    for i in range(8):
        group = s[(i // G) * G:(i // G + 1) * G]
        mean = sum(group) / G
        verl = s[i] * G / (G - 1) - mean * G / (G - 1)  # compute_rloo_outcome_advantage
        trl = s[i] - (sum(group) - s[i]) / (G - 1)  # RLOOTrainer: rewards - (grouped_sum - rewards) / (G - 1)
        assert adv[i, 0].item() == pytest.approx(verl) == pytest.approx(trl)


def test_reinforce_pp_matches_naive_verl_loop():
    g = torch.Generator().manual_seed(4)
    lengths, T, gamma = [6, 2, 4, 1, 5], 6, 0.9
    mask = right_padded_mask(lengths, T)
    rewards = torch.randn(5, T, generator=g, dtype=D64)
    adv, ret = estimate("reinforce_pp", scores=torch.zeros(5, dtype=D64), action_mask=mask,
                        token_rewards=with_garbage(rewards, mask), gamma=gamma)
    # verl compute_reinforce_plus_plus_outcome_advantage: running return reset after EOS, then masked_whiten
    flat_ret = []
    for b, n in enumerate(lengths):
        running, row = 0.0, [0.0] * n
        for t in reversed(range(n)):
            running = rewards[b, t].item() + gamma * running
            row[t] = running
        flat_ret += row
    torch.testing.assert_close(ret, unflatten(flat_ret, lengths, T))
    torch.testing.assert_close(adv, unflatten(whiten_list(flat_ret), lengths, T))


def test_reinforce_pp_baseline_matches_verl_loop_and_openrlhf_order():
    g = torch.Generator().manual_seed(5)
    G, lengths, T = 3, [4, 2, 3, 1, 4, 2], 4
    mask = right_padded_mask(lengths, T)
    scores = torch.randn(6, generator=g, dtype=D64)
    # verl compute_reinforce_plus_plus_baseline_outcome_advantage (scores as token_level_rewards.sum): centre by
    # the group mean, broadcast to the real tokens, masked_whiten. Equal to astrai's with gamma 1 and no KL.
    s = scores.tolist()
    centred = [s[i] - sum(s[(i // G) * G:(i // G + 1) * G]) / G for i in range(6)]
    flat = [centred[b] for b, n in enumerate(lengths) for _ in range(n)]
    adv, _ = estimate("reinforce_pp_baseline", scores=scores, action_mask=mask, group_size=G)
    torch.testing.assert_close(adv, unflatten(whiten_list(flat), lengths, T))
    # OpenRLHF (reinforce_baseline): r - mean_G(r), then compute_reward adds -kl_coef * kl per token with the
    # centred score on the last token, then cumulative returns with gamma, then whitening
    kl = torch.rand(6, T, generator=g, dtype=D64)
    coef, gamma = 0.2, 0.8
    token_rewards = ppo_token_rewards(scores, kl, mask, kl_coef=coef)
    adv2, ret2 = estimate("reinforce_pp_baseline", scores=scores, action_mask=mask, group_size=G,
                          token_rewards=with_garbage(token_rewards, mask), gamma=gamma)
    flat_ret = []
    for b, n in enumerate(lengths):
        running, row = 0.0, [0.0] * n
        for t in reversed(range(n)):
            reward = -coef * kl[b, t].item() + (centred[b] if t == n - 1 else 0.0)
            running = reward + gamma * running
            row[t] = running
        flat_ret += row
    torch.testing.assert_close(ret2, unflatten(flat_ret, lengths, T))
    torch.testing.assert_close(adv2, unflatten(whiten_list(flat_ret), lengths, T))


# ------------------------------------------------------------------------------ padding and two ranks


def _inputs(seed: int, lengths: list[int], T: int):
    g = torch.Generator().manual_seed(seed)
    n = len(lengths)
    mask = right_padded_mask(lengths, T)
    scores = torch.randn(n, generator=g, dtype=D64)
    kl = kl_k3(torch.randn(n, T, generator=g, dtype=D64) * 0.1, torch.randn(n, T, generator=g, dtype=D64) * 0.1)
    token_rewards = ppo_token_rewards(scores, kl, mask, kl_coef=0.1)
    values = torch.randn(n, T, generator=g, dtype=D64)
    old = -torch.rand(n, T, generator=g, dtype=D64) * 3
    teacher = -torch.rand(n, T, generator=g, dtype=D64) * 3
    return dict(scores=scores, action_mask=mask, token_rewards=token_rewards, values=values, old_logprobs=old,
                teacher_logprobs=teacher)


COMMON = dict(group_size=2, gamma=0.95, lam=0.9, scale="batch", whiten_advantages=True, reward_weight=0.5)


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_masked_positions_even_nan_influence_nothing(name):
    clean = _inputs(6, [5, 2, 4, 1, 3, 5], 5)
    mask = clean["action_mask"]
    dirty = dict(clean, token_rewards=with_garbage(clean["token_rewards"], mask),
                 values=with_garbage(clean["values"], mask, float("inf")),
                 old_logprobs=with_garbage(clean["old_logprobs"], mask),
                 teacher_logprobs=with_garbage(clean["teacher_logprobs"], mask, float("-inf")))
    adv, ret = estimate(name, **clean, **COMMON)
    adv_d, ret_d = estimate(name, **dirty, **COMMON)
    torch.testing.assert_close(adv_d, adv)
    assert (adv[~mask] == 0).all() and torch.isfinite(adv).all()
    assert (ret is None) == (not ADVANTAGE_ESTIMATORS[name].gives_returns)
    if ret is not None:
        torch.testing.assert_close(ret_d, ret)
        assert (ret[~mask] == 0).all()


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_two_ranks_equal_one_process_holding_both_halves(name):
    """Batch statistics (reinforce_pp whitening, grpo's batch std, gae whitening) over two simulated ranks (an
    `all_reduce_sum` that sums the two halves) equal those of one process holding the whole batch."""
    whole = _inputs(7, [5, 2, 4, 1, 3, 5, 2, 4], 5)
    halves = [{k: v[:4] for k, v in whole.items()}, {k: v[4:] for k, v in whole.items()}]
    one_adv, one_ret = estimate(name, **whole, **COMMON)
    ranks = TwoRanks()
    (adv0, ret0), (adv1, ret1) = ranks.run(lambda red: estimate(name, **halves[0], **COMMON, all_reduce_sum=red),
                                           lambda red: estimate(name, **halves[1], **COMMON, all_reduce_sum=red))
    torch.testing.assert_close(torch.cat([adv0, adv1]), one_adv)
    if one_ret is not None:
        torch.testing.assert_close(torch.cat([ret0, ret1]), one_ret)
    # all but rloo (purely per group) reduce over ranks with these settings (two all-reduces: (sum, count), then
    # the squared deviations; on_policy_distill through its reward term's batch std), and for them a half alone
    # gives other numbers
    alone, _ = estimate(name, **halves[0], **COMMON)
    if name == "rloo":
        assert ranks.calls == 0 and torch.equal(alone, adv0)
    else:
        assert ranks.calls == 2 and not torch.allclose(alone, adv0)


# ------------------------------------------------------------------------------------------- registry


def test_registry_uniform_signature_records_and_errors():
    signatures = {str(inspect.signature(record.fn)) for record in ADVANTAGE_ESTIMATORS.values()}
    assert len(signatures) == 1
    assert set(ADVANTAGE_ESTIMATORS) == {"gae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline",
                                         "on_policy_distill"}
    assert [n for n, r in ADVANTAGE_ESTIMATORS.items() if r.needs_values] == ["gae"]
    assert {n for n, r in ADVANTAGE_ESTIMATORS.items() if r.needs_groups} == {"grpo", "rloo",
                                                                               "reinforce_pp_baseline",
                                                                               "on_policy_distill"}
    assert [n for n, r in ADVANTAGE_ESTIMATORS.items() if r.needs_teacher] == ["on_policy_distill"]
    assert advantage_estimator("rloo").gives_returns is False
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'ppo'; choices: gae, grpo, rloo"):
        advantage_estimator("ppo")
    mask = right_padded_mask([2, 1], 2)
    with pytest.raises(ValueError, match=r"scores must be \(2,\)"):
        estimate("grpo", scores=torch.zeros(3), action_mask=mask, group_size=1)
    with pytest.raises(ValueError, match="token_rewards must have the shape"):
        estimate("reinforce_pp", scores=torch.zeros(2), action_mask=mask, token_rewards=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="'on_policy_distill' needs old_logprobs and teacher_logprobs"):
        estimate("on_policy_distill", scores=torch.zeros(2), action_mask=mask, old_logprobs=torch.zeros(2, 2))
    with pytest.raises(ValueError, match="teacher_logprobs must have the shape"):
        estimate("on_policy_distill", scores=torch.zeros(2), action_mask=mask, old_logprobs=torch.zeros(2, 2),
                 teacher_logprobs=torch.zeros(2, 3))
