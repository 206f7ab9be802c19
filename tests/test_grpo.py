"""online_grpo: group advantages by hand, zero-variance groups, rollout validation, KL placement, the shared
policy-gradient helper (micro-batch invariance, equality with a direct full-batch loss), learning, end to end."""

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from reference_engine import ReferenceEngine
from toy_rl import online_experience, trained

from astrai.algos import aggregate_loss, kl_k3, ppo_clip
from astrai.config import ConfigError, GRPOSection, load_config
from astrai.data.sequences import Sequences
from astrai.models import AutoRegressiveLM, tiny_config
from astrai.experience.trajectory import Experience
from astrai.experience.runner import RolloutRunner
from astrai.rollout.sampling import SamplingParams
from astrai.forward import response_logprobs
from astrai.trainer.loop import Callback, Trainer
from astrai.experience.replay import RolloutReplay
from astrai.trainer.learners.online_grpo import (
    GRPOLearner,
    group_rollout,
    grpo_loss_fn,
    validate_group_rollout,
)

VOCAB, EOS, TARGET = 16, 2, 7


def small_model(seed=0):
    torch.manual_seed(seed)
    return AutoRegressiveLM(tiny_config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                        num_attention_heads=2, num_key_value_heads=1, eos_token_id=EOS,
                                        pad_token_id=EOS, bos_token_id=1))


def make_experience(scores, *, t=3, lengths=None, ref=True, seed=0):
    """N = len(scores) rows: prompt of 2 tokens, responses of `lengths` real tokens (default all t)."""
    n = len(scores)
    g = torch.Generator().manual_seed(seed)
    lengths = lengths or [t] * n
    action_mask = torch.tensor([[i < k for i in range(t)] for k in lengths])
    prompt = torch.randint(3, VOCAB, (n, 2), generator=g)
    response = torch.where(action_mask, torch.randint(3, VOCAB, (n, t), generator=g), EOS)
    attention = torch.cat([torch.ones(n, 2, dtype=torch.bool), action_mask], 1)
    seq = Sequences(input_ids=torch.cat([prompt, response], 1), attention_mask=attention,
                    position_ids=(attention.long().cumsum(1) - 1).clamp(min=0), prompt_length=2,
                    action_mask=action_mask)
    old = -torch.rand(n, t, generator=g) * action_mask
    ref_lp = (-torch.rand(n, t, generator=g) * action_mask) if ref else None
    return Experience(sequences=seq, old_logprobs=old, ref_logprobs=ref_lp,
                      scores=torch.tensor(scores, dtype=torch.float32), responses=tuple("x" * n),
                      policy_version=0)


def test_group_advantages_hand_computed():
    exp = make_experience([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 2.0, 2.0], lengths=[3, 2, 1, 3, 3, 3, 2, 1])
    result = group_rollout(exp, group_size=4, std_eps=0.0)
    # group 1: mean 0.5, unbiased std sqrt(4 * 0.25 / 3); group 2: mean 2, std sqrt(2 / 3)
    a = 0.5 / math.sqrt(1 / 3)
    b = 1.0 / math.sqrt(2 / 3)
    expected = torch.tensor([a, -a, -a, a, b, -b, 0.0, 0.0])
    mask = exp.sequences.action_mask
    torch.testing.assert_close(result.advantages, expected[:, None] * mask)
    assert result.values is None and result.returns is None and not result.advantages.requires_grad
    # std floor: a near-identical group is not blown up to +-0.707
    floored = group_rollout(make_experience([1.0, 1.001]), group_size=2, std_floor=0.1, std_eps=0.0)
    torch.testing.assert_close(floored.advantages[:, 0], torch.tensor([-0.0005, 0.0005]) / 0.1)


def test_scale_rewards_reaches_the_pinned_advantages():
    exp = make_experience([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0], lengths=[3, 2, 1, 3, 3, 3, 2, 1])
    mask = exp.sequences.action_mask
    centered = torch.tensor([0.75, -0.25, -0.25, -0.25, 0.25, 0.25, 0.25, -0.75])
    none = group_rollout(exp, group_size=4, std_eps=0.0, scale_rewards="none")
    torch.testing.assert_close(none.advantages, centered[:, None] * mask)
    batch = group_rollout(exp, group_size=4, std_eps=0.0, scale_rewards="batch")
    torch.testing.assert_close(batch.advantages, centered[:, None] * mask / math.sqrt(2.0 / 7.0))


def test_identical_rewards_give_zero_advantages_and_finite_loss():
    exp = make_experience([0.5] * 4)
    result = group_rollout(exp, group_size=4)
    assert torch.equal(result.advantages, torch.zeros_like(result.advantages))
    policy = small_model()
    logprobs, _ = response_logprobs(policy, result.sequences, temperature=1.0)
    loss, metrics = grpo_loss_fn(GRPOSection(clip_eps=0.2, kl_coef=0.1))(logprobs, result, torch.tensor(12))
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in metrics.values())
    assert all(torch.isfinite(p.grad).all() for p in policy.parameters() if p.grad is not None)


def test_kl_in_reward_is_subtracted_before_normalisation():
    exp = make_experience([1.0, 0.0])
    d = exp.ref_logprobs - exp.old_logprobs
    seq_kl = (torch.exp(d) - 1 - d).sum(-1)
    rewards = exp.scores - 0.5 * seq_kl
    result = group_rollout(exp, group_size=2, kl_reward_coef=0.5, std_eps=0.0)
    centered = rewards - rewards.mean()
    torch.testing.assert_close(result.advantages[:, 0], centered / centered.std())
    with pytest.raises(ValueError, match="reference"):
        group_rollout(make_experience([1.0, 0.0], ref=False), group_size=2, kl_reward_coef=0.5)


@pytest.mark.parametrize("mutate,needle", [
    (lambda e: dataclasses.replace(e, old_logprobs=e.old_logprobs[:, :2]), "old_logprobs"),
    (lambda e: dataclasses.replace(e, old_logprobs=torch.where(e.sequences.action_mask, e.old_logprobs + 1,
                                                               e.old_logprobs)), "> 0"),
    (lambda e: dataclasses.replace(e, scores=e.scores[:3]), "scores"),
    (lambda e: dataclasses.replace(e, responses=e.responses[:3]), "response texts"),
    (lambda e: dataclasses.replace(e, sequences=dataclasses.replace(
        e.sequences, action_mask=e.sequences.action_mask.flip(1))), "action_mask"),
])
def test_rollout_validation_names_the_problem(mutate, needle):
    exp = make_experience([1.0, 0.0, 0.0, 1.0], lengths=[3, 2, 1, 3])
    with pytest.raises(ValueError, match=needle):
        group_rollout(mutate(exp), group_size=4)


def test_group_size_must_divide_samples():
    result = group_rollout(make_experience([1.0, 0.0, 0.0, 1.0]), group_size=2)
    with pytest.raises(ValueError, match="group_size=3"):
        validate_group_rollout(result, group_size=3, need_ref=True)


def test_kl_in_reward_and_loss_are_mutually_exclusive():
    with pytest.raises(ConfigError, match="mutually exclusive"):
        load_config(None, ["--train.type", "online_grpo", "--grpo.kl_coef", "0.1", "--grpo.kl_reward_coef", "0.1"])
    config = load_config(None, ["--train.type", "online_grpo", "--grpo.kl_coef", "0", "--grpo.kl_reward_coef", "0.1"])
    assert config.grpo.kl_reward_coef == 0.1
    with pytest.raises(ConfigError, match="grpo.minibatch_size"):
        load_config(None, ["--train.type", "online_grpo", "--rollout.batch_size", "1", "--grpo.group_size", "3"])


class GradCapture(Callback):
    """Records the gradients the step seam is about to apply (after clipping with an unreachable norm; a zero
    learning rate keeps the weights)."""

    def __init__(self, model):
        self.model, self.grads = model, None

    def before_optimizer_step(self, trainer, name):
        self.grads = {n: p.grad.clone() for n, p in self.model.named_parameters() if p.grad is not None}


def _helper_grads(policy, rollout, micro):
    settings = GRPOSection(group_size=3, micro_batch_size=micro, clip_eps=0.2, kl_coef=0.3, kl_reward_coef=0.0,
                            std_eps=1e-6, std_floor=None)
    strategy = GRPOLearner(policy=trained(policy, lr=0.0), experience=None, settings=settings, temperature=0.7,
                            replay=RolloutReplay(minibatch_size=len(rollout), epochs=1, seed=0))
    capture = GradCapture(policy)
    trainer = Trainer(strategy, dist=strategy.policy.dist, max_steps=1, max_grad_norm=1e9, callbacks=[capture])
    metrics = strategy.update(trainer, rollout, first=True)
    return capture.grads, metrics


def test_shared_update_is_split_invariant_and_matches_the_direct_loss():
    policy = small_model()
    exp = make_experience([1.0, 0.0, 0.5, 2.0, 0.0, 0.0], t=4, lengths=[4, 1, 3, 2, 4, 1])
    rollout = group_rollout(exp, group_size=3)
    grads_1, metrics_1 = _helper_grads(policy, rollout, micro=1)
    grads_6, metrics_6 = _helper_grads(policy, rollout, micro=6)
    grads_4, _ = _helper_grads(policy, rollout, micro=4)  # uneven split: 4 + 2 rows
    # the GRPO objective written out directly on the whole batch
    mask = rollout.sequences.action_mask
    logprobs, _ = response_logprobs(policy, rollout.sequences, temperature=0.7)
    pg, _ = ppo_clip(logprobs, rollout.old_logprobs, rollout.advantages, mask, clip_ratio_low=0.2,
                     clip_ratio_high=0.2)
    kl = aggregate_loss(kl_k3(logprobs, rollout.ref_logprobs * mask), mask)
    (pg + 0.3 * kl).backward()
    for name, p in policy.named_parameters():
        for grads in (grads_1, grads_4, grads_6):
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(metrics_1["policy/loss"], (pg + 0.3 * kl).detach(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(metrics_1["policy/loss"], metrics_6["policy/loss"], rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------------------------------------ learning
def target_fraction(texts, answers, response_ids):
    return torch.tensor([sum(t == TARGET for t in ids) / max(1, len(ids)) for ids in response_ids])


def make_strategy(max_steps, *, seed=0, lr=3e-3, prompts=4, group=4, kl_coef=0.01):
    policy = small_model(seed)
    ref = small_model(seed)
    ref.load_state_dict(policy.state_dict())
    ref.eval().requires_grad_(False)
    engine = ReferenceEngine(policy, pad_token_id=EOS)
    sampling = SamplingParams(max_new_tokens=8, temperature=1.0, stop_token_ids=(EOS,))
    runner = RolloutRunner(engine, sampling, decode=lambda ids: " ".join(map(str, ids)),
                           score_fn=target_fraction, ref_model=ref, chunk_size=prompts * group)
    trained_policy = trained(policy, lr=lr, max_steps=max_steps)
    experience = online_experience(trained_policy, runner, vocab=VOCAB, batch_size=prompts, group_size=group,
                                   seed=seed)
    settings = GRPOSection(group_size=group, micro_batch_size=prompts * group // 4, clip_eps=0.2, kl_coef=kl_coef,
                            kl_reward_coef=0.0, std_eps=1e-6, std_floor=None)
    replay = RolloutReplay(minibatch_size=prompts * group // 2, epochs=1, seed=seed)
    strategy = GRPOLearner(policy=trained_policy, experience=experience, replay=replay, settings=settings,
                            temperature=1.0)
    return strategy, ref


class Record(Callback):
    def __init__(self):
        self.metrics = []

    def on_step_end(self, trainer, metrics):
        assert all(isinstance(v, torch.Tensor) and not v.requires_grad for v in metrics.values())
        self.metrics.append({k: float(v) for k, v in metrics.items()})


def test_grpo_raises_toy_reward():
    steps = 24
    strategy, ref = make_strategy(steps, lr=6e-3)
    ref_before = {k: v.clone() for k, v in ref.state_dict().items()}
    record = Record()
    state = Trainer(strategy, dist=strategy.policy.dist, max_steps=steps, max_grad_norm=1.0,
                    callbacks=[record]).fit()
    rewards = [m["rollout/reward_mean"] for m in record.metrics]
    first, last = sum(rewards[:6]) / 6, sum(rewards[-6:]) / 6
    assert last > first + 0.25, f"reward did not rise: {first:.3f} -> {last:.3f}"
    assert all(torch.equal(ref_before[k], v) for k, v in ref.state_dict().items())
    assert state.policy_version == steps
    assert max(m["rollout/logprob_gap"] for m in record.metrics) < 1e-4
    assert [m["rollout/policy_version"] for m in record.metrics[:4]] == [0.0, 0.0, 2.0, 2.0]
    assert not hasattr(strategy, "old_policy")  # old log-probs come from the sampler only


# --------------------------------------------------------------------------------------------- end to end
def test_online_grpo_end_to_end_changes_every_parameter(tiny_model_dir, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from astrai.rewards import builtins as rewards
    from astrai.train import main

    monkeypatch.setitem(rewards.BUILTIN_REWARDS, "toy_length", rewards.BuiltinReward(
        lambda prompts, completions, format_bonus=0.0, partial_credit=0.0, **_: [len(c) % 5 / 4 for c in completions],
        "toy: length mod 5"))
    out = tmp_path / "run"
    code = main(["--config", str(Path(__file__).resolve().parents[1] / "configs/examples/grpo.yaml"), "--model.path", str(tiny_model_dir),
                 "--train.output_dir", str(out), "--max_steps", "2", "--rollout.batch_size", "2",
                 "--grpo.group_size", "4", "--grpo.minibatch_size", "8", "--grpo.micro_batch_size", "4",
                 "--rollout.max_new_tokens", "6", "--reward.name", "toy_length", "--optim.learning_rate", "1e-3",
                 "--train.progress_bar", "false", "--data.truncation", "left"])
    assert code == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in records] == [1, 2]
    for key in ("rollout/reward_mean", "rollout/logprob_gap", "policy/loss", "policy/ref_kl", "policy/clipfrac"):
        assert all(key in r for r in records), key
    ckpt = out / "checkpoints" / "step-00000002"
    assert not (ckpt / "value_model.pt").exists()
    after = load_file(str(ckpt / "model.safetensors"))
    before = load_file(str(tiny_model_dir / "model.safetensors"))
    unchanged = [k for k in before if torch.equal(before[k], after[k])]
    assert not unchanged, unchanged
