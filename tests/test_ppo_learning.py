"""PPO learns: a tiny random-init model raises a toy reward within a few dozen steps on CPU."""

import torch
from toy_rl import online_experience, trained

from astrai.distributed import setup_distributed
from astrai.models import AutoRegressiveLM, ValueModel, tiny_config
from astrai.rollout.paged_engine import PagedGenerationEngine
from astrai.experience.runner import RolloutRunner
from astrai.rollout.sampling import SamplingParams
from astrai.trainer.loop import Callback, Trainer
from astrai.experience.replay import RolloutReplay
from astrai.config import PPOSection
from astrai.trainer.learners.online_ppo import OnlinePPOLearner

VOCAB, EOS, TARGET = 16, 2, 7


class Record(Callback):
    def __init__(self):
        self.metrics, self.hooks = [], []

    def before_optimizer_step(self, trainer, name):
        self.hooks.append(("before", name, trainer.state.policy_version))

    def after_optimizer_step(self, trainer, name):
        self.hooks.append(("after", name, trainer.state.policy_version))

    def on_step_end(self, trainer, metrics):
        assert all(isinstance(v, torch.Tensor) and not v.requires_grad for v in metrics.values())
        self.metrics.append({k: float(v) for k, v in metrics.items()})


def target_fraction(texts, answers, response_ids):
    """Toy reward: the fraction of response tokens equal to TARGET."""
    return torch.tensor([sum(t == TARGET for t in ids) / max(1, len(ids)) for ids in response_ids])


def make_strategy(max_steps, *, seed=0, lr=3e-3, batch=16):
    torch.manual_seed(seed)
    config = tiny_config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                         num_key_value_heads=1, eos_token_id=EOS, pad_token_id=EOS, bos_token_id=1)
    policy = AutoRegressiveLM(config)
    ref = AutoRegressiveLM(config)
    ref.load_state_dict(policy.state_dict())
    ref.eval().requires_grad_(False)
    critic = ValueModel.from_policy(policy)
    engine = PagedGenerationEngine(policy, pad_token_id=EOS)
    sampling = SamplingParams(max_new_tokens=8, temperature=1.0, stop_token_ids=(EOS,))
    runner = RolloutRunner(engine, sampling, decode=lambda ids: " ".join(map(str, ids)),
                           score_fn=target_fraction, ref_model=ref, chunk_size=batch)
    dist = setup_distributed("cpu")
    trained_policy = trained(policy, lr=lr, max_steps=max_steps, dist=dist)
    trained_critic = trained(critic, name="critic", lr=lr, max_steps=max_steps, dist=dist)
    settings = PPOSection(micro_batch_size=batch // 4, clip_eps=0.2, value_clip=0.2, gamma=1.0, gae_lambda=0.95,
                           vf_coef=0.5, kl_coef=0.01, kl_estimator="k3", whiten_advantages=True)
    strategy = OnlinePPOLearner(policy=trained_policy, critic=trained_critic,
                                 experience=online_experience(trained_policy, runner, vocab=VOCAB, batch_size=batch,
                                                              seed=seed),
                                 replay=RolloutReplay(minibatch_size=batch // 2, epochs=1, seed=seed),
                                 settings=settings, temperature=1.0)
    return strategy, dist, ref


def test_ppo_raises_toy_reward():
    steps = 40
    strategy, dist, ref = make_strategy(steps)
    ref_before = {k: v.clone() for k, v in ref.state_dict().items()}
    record = Record()
    trainer = Trainer(strategy, dist=dist, max_steps=steps, max_grad_norm=1.0, callbacks=[record])
    state = trainer.fit()
    rewards = [m["rollout/reward_mean"] for m in record.metrics]
    first, last = sum(rewards[:6]) / 6, sum(rewards[-6:]) / 6
    assert last > first + 0.25, f"reward did not rise: {first:.3f} -> {last:.3f}"
    # the reference model is frozen
    assert all(torch.equal(ref_before[k], v) for k, v in ref.state_dict().items())
    # one policy and one critic step per loop iteration; the version counts policy steps only
    assert state.policy_version == steps == state.global_step
    policy_hooks = [h for h in record.hooks if h[1] == "policy"]
    assert policy_hooks[:2] == [("before", "policy", 0), ("after", "policy", 1)]
    critic_hooks = [h for h in record.hooks if h[1] == "critic"]
    assert critic_hooks[:2] == [("before", "critic", 1), ("after", "critic", 1)]
    # two minibatches per rollout: the gap on a rollout's first minibatch is ~0 (engine weights in sync)
    assert max(m["rollout/logprob_gap"] for m in record.metrics) < 1e-4
    assert [m["rollout/policy_version"] for m in record.metrics[:4]] == [0.0, 0.0, 2.0, 2.0]


def test_targets_are_pinned_across_minibatches():
    strategy, dist, _ = make_strategy(2)
    trainer = Trainer(strategy, dist=dist, max_steps=1, max_grad_norm=1.0)
    trainer.fit()
    rollout = strategy.rollout
    adv, ret = rollout.advantages.clone(), rollout.returns.clone()
    trainer.state.max_steps = 2
    trainer.fit()  # the second minibatch of the same rollout
    assert strategy.rollout is rollout
    assert torch.equal(rollout.advantages, adv) and torch.equal(rollout.returns, ret)
    assert not rollout.advantages.requires_grad
