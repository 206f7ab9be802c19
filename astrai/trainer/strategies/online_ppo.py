"""online_ppo: PPO with a learned critic on freshly sampled rollouts (Schulman et al. 2017; Ouyang et al. 2022).

Each rollout: sync the policy weights into the engine, sample one response per prompt, score them, compute
reference log-probs, critic values, k-estimated KL, per-token rewards and GAE once, and pin the targets on a
`RolloutResult`. Then `ppo.epochs` passes of shuffled minibatches replay those fixed targets; every
`train_step` is one minibatch: one policy optimizer step and one critic optimizer step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from astrai.algos import (explained_variance, gae, kl_estimate, masked_mean, masked_whiten,
                          ppo_policy_loss, ppo_token_rewards, value_loss)
from astrai.rollout.result import RolloutResult
from astrai.rollout.runner import RolloutRunner
from astrai.rollout.scoring import response_values, score_in_chunks
from astrai.trainer.strategies.common import (accumulate, init_rollout_state, load_rollout_state,
                                              policy_gradient_step, rollout_state, row_chunks, sync_engine, token_counts)


@dataclass(frozen=True)
class PPOSettings:
    """Scalars of the PPO update (see `astrai.config.PPOConfig` for meanings)."""

    batch_size: int
    minibatch_size: int
    micro_batch_size: int
    epochs: int
    clip_eps: float
    value_clip: Optional[float]
    gamma: float
    gae_lambda: float
    vf_coef: float
    kl_coef: float
    kl_estimator: str
    whiten_advantages: bool
    temperature: float
    log_entropy: bool = False


class OnlinePPOStrategy:
    """One `train_step` = one PPO minibatch update of the policy and of the critic.

    Args:
        policy: trainable `AutoRegressiveLM` (possibly DDP-wrapped).
        value_model: trainable `ValueModel` (possibly DDP-wrapped).
        engine: rollout engine holding an inference copy of the policy.
        runner: samples, decodes, scores and computes reference log-probs.
        next_prompts: batch_size -> (prompt token ids, reference answers).
        policy_optimizer, policy_scheduler, value_optimizer, value_scheduler: the two optimizers.
        settings: PPO scalars.
        dist: `DistributedContext`.
        seed: seeds the sampling RNG (on the device) and the minibatch-shuffling RNG (CPU).
    """

    def __init__(self, *, policy, value_model, engine, runner: RolloutRunner,
                 next_prompts: Callable[[int], tuple[list[list[int]], list[str]]],
                 policy_optimizer, policy_scheduler, value_optimizer, value_scheduler,
                 settings: PPOSettings, dist, seed: int, extras: Optional[dict] = None):
        self.policy, self.value_model = policy, value_model
        self.engine, self.runner, self.next_prompts = engine, runner, next_prompts
        self.policy_optimizer, self.policy_scheduler = policy_optimizer, policy_scheduler
        self.value_optimizer, self.value_scheduler = value_optimizer, value_scheduler
        self.settings, self.dist = settings, dist
        self.extras = extras or {}
        init_rollout_state(self, seed=seed, device=dist.device)

    # ----------------------------------------------------------------------------------------- rollout
    def sync_engine(self, policy_version: int) -> None:
        """Load the current policy weights into the engine unless it already holds `policy_version`."""
        sync_engine(self.engine, self.policy, self.dist, policy_version)

    def make_rollout(self, policy_version: int) -> RolloutResult:
        """Sample, score and compute the pinned PPO targets for one batch of prompts."""
        s = self.settings
        self.sync_engine(policy_version)
        prompt_ids, answers = self.next_prompts(s.batch_size)
        exp = self.runner.collect(prompt_ids, answers, self.generator)
        mask = exp.sequences.action_mask
        critic = self.dist.unwrap(self.value_model)
        values = score_in_chunks(lambda chunk: response_values(critic, chunk), exp.sequences,
                                 s.micro_batch_size) * mask
        with torch.no_grad():
            kl = kl_estimate(exp.old_logprobs, exp.ref_logprobs, estimator=s.kl_estimator) * mask
            rewards = ppo_token_rewards(exp.scores, kl, mask, kl_coef=s.kl_coef)
            advantages, returns = gae(rewards, values, mask, gamma=s.gamma, lam=s.gae_lambda)
            if s.whiten_advantages:
                advantages = masked_whiten(advantages, mask)
        result = RolloutResult(sequences=exp.sequences, old_logprobs=exp.old_logprobs * mask,
                               ref_logprobs=exp.ref_logprobs * mask, values=values, scores=exp.scores,
                               kl=kl, rewards=rewards, advantages=advantages, returns=returns,
                               policy_version=exp.policy_version, responses=exp.responses)
        lengths = mask.sum(-1).float()
        self._rollout_metrics = {
            "rollout/reward_mean": exp.scores.mean(),
            "rollout/reward_std": exp.scores.std(unbiased=False),
            "rollout/kl": kl.sum(-1).mean(),
            "rollout/response_length": lengths.mean(),
            "rollout/values_mean": masked_mean(values, mask),
            "rollout/returns_mean": masked_mean(returns, mask),
            "rollout/policy_version": torch.tensor(float(exp.policy_version)),
        }
        return result

    # -------------------------------------------------------------------------------------------- step
    def train_step(self, trainer) -> dict[str, torch.Tensor]:
        """One minibatch: policy loss + step, then critic loss + step. Starts a rollout when needed."""
        first_minibatch = not self._pending
        if first_minibatch:
            start = time.perf_counter()
            self.rollout = self.make_rollout(trainer.state.policy_version)
            self._rollout_metrics["time/rollout_seconds"] = torch.tensor(time.perf_counter() - start)
            self._pending = self.rollout.minibatch_indices(self.settings.minibatch_size,
                                                           self.settings.epochs, self.shuffle_generator)
            trainer.state.consumed_samples += len(self.rollout) * self.dist.world_size
        minibatch = self.rollout.select(self._pending.pop(0))
        metrics = dict(self._rollout_metrics)
        metrics.update(self._policy_update(trainer, minibatch, first_minibatch))
        metrics.update(self._critic_update(trainer, minibatch))
        return metrics

    def _micro_batches(self, minibatch: RolloutResult):
        for index in row_chunks(len(minibatch), self.settings.micro_batch_size):
            yield minibatch.select(index)

    def _policy_update(self, trainer, minibatch: RolloutResult, first_minibatch: bool):
        """Accumulate the PPO-clip loss over micro-batches (global token-mean), then step the policy
        (the shared `common.policy_gradient_step`)."""
        s = self.settings

        def loss_fn(logprobs, micro, num_tokens):
            return ppo_policy_loss(logprobs, micro.old_logprobs, micro.advantages, micro.sequences.action_mask,
                                   clip_eps=s.clip_eps, num_tokens=num_tokens)

        sums = policy_gradient_step(trainer, policy=self.policy, optimizer=self.policy_optimizer,
                                    scheduler=self.policy_scheduler, dist=self.dist, minibatch=minibatch,
                                    micro_batch_size=s.micro_batch_size, temperature=s.temperature,
                                    loss_fn=loss_fn, with_entropy=s.log_entropy)
        if first_minibatch:  # the gap is only meaningful before the rollout's first update
            self._rollout_metrics["rollout/logprob_gap"] = sums["rollout/logprob_gap"]
        sums["rollout/logprob_gap"] = self._rollout_metrics["rollout/logprob_gap"]
        return sums

    def _critic_update(self, trainer, minibatch: RolloutResult):
        """Accumulate the (clipped) value loss over micro-batches, then step the critic."""
        s = self.settings
        local_tokens, num_tokens = token_counts(minibatch.sequences.action_mask, self.dist)
        sums: dict[str, torch.Tensor] = {}
        new_values = []
        for micro in self._micro_batches(minibatch):
            mask = micro.sequences.action_mask
            values = response_values(self.value_model, micro.sequences)
            loss, m = value_loss(values, micro.values, micro.returns, mask, clip_range=s.value_clip,
                                 num_tokens=num_tokens)
            (s.vf_coef * loss * self.dist.loss_scale()).backward()
            accumulate(sums, dict(m, **{"critic/loss": loss}), weight=num_tokens / local_tokens)
            new_values.append(values.detach())
        sums["critic/explained_variance"] = explained_variance(
            torch.cat(new_values), minibatch.returns, minibatch.sequences.action_mask)
        sums["critic/grad_norm"] = trainer.optimizer_step("critic", self.dist.unwrap(self.value_model),
                                                          self.value_optimizer, self.value_scheduler)
        return sums

    # ------------------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict:
        """Exact-resume state: RNGs and the rollout in progress with its pinned targets and the minibatches
        not yet replayed (`common.rollout_state`), so a checkpoint taken mid-rollout resumes exactly."""
        return rollout_state(self)

    def load_state_dict(self, state: dict) -> None:
        """Inverse of `state_dict` (tensors are moved to this rank's device)."""
        load_rollout_state(self, state)

    def checkpoint_state(self) -> dict:
        """What a checkpoint of this train type holds (policy + critic extras)."""
        return {
            "policy": self.dist.unwrap(self.policy),
            "optimizer": self.policy_optimizer,
            "scheduler": self.policy_scheduler,
            "value_model": self.dist.unwrap(self.value_model),
            "value_optimizer": self.value_optimizer,
            "value_scheduler": self.value_scheduler,
            **self.extras,
        }


def build_online_ppo(config, dist, policy, tokenizer) -> OnlinePPOStrategy:
    """Assemble the online_ppo strategy from a validated `astrai.config.Config`.

    Builds the frozen reference model, the critic (warm-started from the policy), the rollout engine and
    runner, the prompt sampler, and one AdamW optimizer + schedule for each of policy and critic.
    """
    from astrai.models import ValueModel
    from astrai.trainer.strategies.common import build_online_parts, build_policy_optimizer, frozen_copy

    r, p, o = config.rollout, config.ppo, config.optim
    policy = policy.to(dist.device)
    ref_model = frozen_copy(policy)
    value_model = ValueModel.from_policy(policy).to(dist.device)
    engine, runner, sampler, next_prompts = build_online_parts(config, dist, policy, tokenizer,
                                                               ref_model=ref_model, chunk_size=p.micro_batch_size)
    policy_opt, policy_sched = build_policy_optimizer(config, policy)
    value_opt, value_sched = build_policy_optimizer(config, value_model, lr=o.critic_learning_rate)
    settings = PPOSettings(batch_size=r.batch_size, minibatch_size=p.minibatch_size,
                           micro_batch_size=p.micro_batch_size, epochs=p.epochs, clip_eps=p.clip_eps,
                           value_clip=p.value_clip, gamma=p.gamma, gae_lambda=p.gae_lambda,
                           vf_coef=p.vf_coef, kl_coef=p.kl_coef, kl_estimator=p.kl_estimator,
                           whiten_advantages=p.whiten_advantages, temperature=r.temperature,
                           log_entropy="policy/entropy" in config.train.metrics)
    return OnlinePPOStrategy(
        policy=dist.prepare_model(policy), value_model=dist.prepare_model(value_model), engine=engine,
        runner=runner, next_prompts=next_prompts, policy_optimizer=policy_opt, policy_scheduler=policy_sched,
        value_optimizer=value_opt, value_scheduler=value_sched, settings=settings, dist=dist,
        seed=config.train.seed + 1000 * dist.rank, extras={"tokenizer": tokenizer, "data_sampler": sampler})
