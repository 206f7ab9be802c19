"""online_grpo: Group Relative Policy Optimization on freshly sampled rollouts (Shao et al. 2024, DeepSeekMath).

Each rollout: sync the policy weights into the engine, repeat each of B prompts G times (contiguously) through
the shared `RolloutRunner`, score the B*G responses, and pin group-normalised advantages
`A_i = (r_i - mean_G) / (max(std_G, std_floor) + eps)` broadcast over each response's real tokens. The loss is
the PPO-clip surrogate against the sampler-aligned `old_logprobs` of the engine (what it simplifies: no second
"old policy" model is allocated, synchronised or run) plus `kl_coef` times the k3 reference KL
(Schulman 2020) in the loss; alternatively `kl_reward_coef` subtracts the per-sequence k3 KL from the reward
before normalisation (the two are mutually exclusive). No critic. Every `train_step` is one minibatch: one
policy optimizer step; `grpo.epochs` passes of shuffled minibatches replay each rollout.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from astrai.algos import group_advantages, kl_k3, kl_penalty_loss, masked_mean, ppo_policy_loss
from astrai.rollout.result import RolloutResult
from astrai.rollout.runner import Experience
from astrai.trainer.strategies.common import (init_rollout_state, load_rollout_state, policy_gradient_step,
                                              rollout_state, sync_engine)


@dataclass(frozen=True)
class GRPOSettings:
    """Scalars of the GRPO update (see `astrai.config.GRPOSection`); sizes count samples (responses)
    except `batch_size`, which counts prompts per rollout (B); a rollout holds B * group_size samples."""

    batch_size: int
    group_size: int
    minibatch_size: int
    micro_batch_size: int
    epochs: int
    clip_eps: float
    kl_coef: float
    kl_reward_coef: float
    std_eps: float
    std_floor: Optional[float]
    temperature: float
    log_entropy: bool = False


def validate_group_rollout(rollout, *, group_size: int, need_ref: bool) -> None:
    """Check the tensors of a GRPO rollout (a `RolloutResult`, or an `Experience` before its advantages exist)
    before any target or loss is computed.

    Checks: `action_mask` is (N, T) bool with N a multiple of `group_size`; `input_ids`, `attention_mask`,
    `position_ids` are (N, P + T) and the response part of `attention_mask` equals `action_mask`; real response
    tokens form a prefix of each row; `old_logprobs`, `advantages` (and `ref_logprobs` when `need_ref`) are
    (N, T) finite at real tokens; log-probs are <= 0 (+1e-4); `scores` is (N,) finite; `responses` has N texts.

    Raises:
        ValueError: one line naming the first failed check.
    """
    seq, mask = rollout.sequences, rollout.sequences.action_mask
    if mask.dim() != 2 or mask.dtype != torch.bool:
        raise ValueError(f"rollout: action_mask must be a 2-D bool tensor, got {tuple(mask.shape)} {mask.dtype}")
    n, t = mask.shape
    if n == 0 or n % group_size:
        raise ValueError(f"rollout: {n} samples is not a positive multiple of group_size={group_size}")
    full = (n, seq.prompt_length + t)
    for name in ("input_ids", "attention_mask", "position_ids"):
        if tuple(getattr(seq, name).shape) != full:
            raise ValueError(f"rollout: {name} must be {full}, got {tuple(getattr(seq, name).shape)}")
    if not torch.equal(seq.attention_mask[:, seq.prompt_length:].bool(), mask):
        raise ValueError("rollout: attention_mask over the response differs from action_mask")
    if bool((mask[:, 1:] & ~mask[:, :-1]).any()):
        raise ValueError("rollout: action_mask has a real token after padding (responses must be right-padded)")
    names = ("old_logprobs",) + (("ref_logprobs",) if need_ref else ())
    names += ("advantages",) if getattr(rollout, "advantages", None) is not None else ()
    for name in names:
        x = getattr(rollout, name)
        if x is None or tuple(x.shape) != (n, t):
            raise ValueError(f"rollout: {name} must be ({n}, {t}), got {None if x is None else tuple(x.shape)}")
        if not bool(torch.isfinite(x[mask]).all()):
            raise ValueError(f"rollout: {name} has non-finite values at real tokens")
        if name != "advantages" and bool((x[mask] > 1e-4).any()):
            raise ValueError(f"rollout: {name} has log-probabilities > 0")
    if tuple(rollout.scores.shape) != (n,) or not bool(torch.isfinite(rollout.scores).all()):
        raise ValueError(f"rollout: scores must be ({n},) finite, got {tuple(rollout.scores.shape)}")
    if len(rollout.responses) != n:
        raise ValueError(f"rollout: {len(rollout.responses)} response texts for {n} samples")


@torch.no_grad()
def group_rollout(exp: Experience, *, group_size: int, kl_reward_coef: float = 0.0, std_eps: float = 1e-6,
                  std_floor: Optional[float] = None) -> RolloutResult:
    """Pin GRPO targets on sampled experience (the G samples of a prompt contiguous).

    Shapes: N = B * G rows, T response tokens. `kl` = k3(old_logprobs, ref_logprobs) per real token (N, T)
    when reference log-probs exist; rewards r = scores - kl_reward_coef * kl.sum(-1) (N,);
    advantages = `group_advantages(r)` (N,) broadcast to (N, T) and zeroed at padding (float32).
    `values` and `returns` are None (no critic); `rewards` holds r broadcast over real tokens.

    Raises:
        ValueError: from `validate_group_rollout`, or `kl_reward_coef > 0` without reference log-probs.
    """
    validate_group_rollout(exp, group_size=group_size, need_ref=exp.ref_logprobs is not None)
    mask = exp.sequences.action_mask
    old = exp.old_logprobs * mask
    ref = exp.ref_logprobs * mask if exp.ref_logprobs is not None else None
    kl = kl_k3(old, ref) * mask if ref is not None else None
    rewards = exp.scores.float()
    if kl_reward_coef > 0:
        if kl is None:
            raise ValueError("grpo.kl_reward_coef > 0 needs reference log-probs")
        rewards = rewards - kl_reward_coef * kl.sum(-1)
    adv = group_advantages(rewards, group_size=group_size, eps=std_eps, std_floor=std_floor)
    result = RolloutResult(sequences=exp.sequences, old_logprobs=old, ref_logprobs=ref, values=None,
                           scores=exp.scores, kl=kl, rewards=rewards[:, None] * mask,
                           advantages=adv[:, None] * mask, returns=None, policy_version=exp.policy_version,
                           responses=tuple(exp.responses))
    validate_group_rollout(result, group_size=group_size, need_ref=ref is not None)
    return result


def grpo_loss_fn(*, clip_eps: float, kl_coef: float):
    """The GRPO micro-batch loss: PPO-clip vs `old_logprobs` + `kl_coef` * k3 reference KL (both token-means
    over the step's global token count). Returns a `common.LossFn`; metrics `policy/pg_loss`, clip metrics,
    and `policy/ref_kl` when `kl_coef > 0`."""

    def loss_fn(logprobs: torch.Tensor, micro: RolloutResult, num_tokens: torch.Tensor):
        mask = micro.sequences.action_mask
        loss, metrics = ppo_policy_loss(logprobs, micro.old_logprobs, micro.advantages, mask,
                                        clip_eps=clip_eps, num_tokens=num_tokens)
        metrics["policy/pg_loss"] = loss.detach()
        if kl_coef > 0:
            kl, kl_metrics = kl_penalty_loss(logprobs, micro.ref_logprobs, mask, estimator="k3",
                                             num_tokens=num_tokens)
            loss = loss + kl_coef * kl
            metrics.update(kl_metrics)
        return loss, metrics

    return loss_fn


class GRPOStrategy:
    """One `train_step` = one GRPO minibatch update of the policy (no critic); online or offline.

    Args:
        policy: trainable `AutoRegressiveLM` (possibly DDP-wrapped).
        optimizer, scheduler: the policy's AdamW and LR schedule.
        settings: GRPO scalars.
        dist: `DistributedContext`.
        seed: seeds the sampling RNG (on the device) and the minibatch-shuffling RNG (CPU).
        engine, runner, next_prompts: online source: the rollout engine (inference copy of the policy), the
            runner (samples, decodes, scores; holds the frozen reference model when a KL term is on), and
            batch_size -> (prompt token ids, reference answers).
        experience: offline source instead: policy_version -> `Experience` of B * G rows (groups contiguous).
        extras: more checkpoint objects (tokenizer, data_sampler).
    """

    def __init__(self, *, policy, optimizer, scheduler, settings: GRPOSettings, dist, seed: int,
                 engine=None, runner=None, next_prompts: Optional[Callable] = None,
                 experience: Optional[Callable[[int], Experience]] = None, extras: Optional[dict] = None):
        if experience is None and (engine is None or runner is None or next_prompts is None):
            raise ValueError("GRPOStrategy: pass engine, runner and next_prompts, or an experience source")
        self.policy, self.engine, self.runner, self.next_prompts = policy, engine, runner, next_prompts
        self.experience = experience
        self.optimizer, self.scheduler, self.settings, self.dist = optimizer, scheduler, settings, dist
        self.extras = extras or {}
        init_rollout_state(self, seed=seed, device=dist.device)
        self.loss_fn = grpo_loss_fn(clip_eps=settings.clip_eps, kl_coef=settings.kl_coef)

    def collect(self, policy_version: int) -> Experience:
        """B * G scored samples: from the offline source, or G engine samples of each of B prompts."""
        if self.experience is not None:
            return self.experience(policy_version)
        s = self.settings
        sync_engine(self.engine, self.policy, self.dist, policy_version)
        prompt_ids, answers = self.next_prompts(s.batch_size)
        repeated = [ids for ids in prompt_ids for _ in range(s.group_size)]
        repeated_answers = [a for a in answers for _ in range(s.group_size)]
        return self.runner.collect(repeated, repeated_answers, self.generator)

    def make_rollout(self, policy_version: int) -> RolloutResult:
        """Collect B * G scored samples and pin the group advantages."""
        s = self.settings
        exp = self.collect(policy_version)
        result = group_rollout(exp, group_size=s.group_size, kl_reward_coef=s.kl_reward_coef,
                               std_eps=s.std_eps, std_floor=s.std_floor)
        mask = result.sequences.action_mask
        groups = exp.scores.reshape(-1, s.group_size)
        self._rollout_metrics = {
            "rollout/reward_mean": exp.scores.mean(),
            "rollout/reward_std": exp.scores.std(unbiased=False),
            "rollout/group_reward_std": groups.std(dim=1, unbiased=False).mean(),
            "rollout/zero_std_groups": (groups.std(dim=1, unbiased=False) == 0).float().mean(),
            "rollout/response_length": mask.sum(-1).float().mean(),
            "rollout/advantage_abs_mean": masked_mean(result.advantages.abs(), mask),
            "rollout/policy_version": torch.tensor(float(exp.policy_version)),
        }
        if result.kl is not None:
            self._rollout_metrics["rollout/kl"] = result.kl.sum(-1).mean()
        return result

    def train_step(self, trainer) -> dict[str, torch.Tensor]:
        """One minibatch: GRPO loss over its micro-batches, one policy optimizer step. Samples when needed."""
        s = self.settings
        first_minibatch = not self._pending
        if first_minibatch:
            start = time.perf_counter()
            self.rollout = self.make_rollout(trainer.state.policy_version)
            self._rollout_metrics["time/rollout_seconds"] = torch.tensor(time.perf_counter() - start)
            self._pending = self.rollout.minibatch_indices(s.minibatch_size, s.epochs, self.shuffle_generator)
            trainer.state.consumed_samples += s.batch_size * self.dist.world_size
        minibatch = self.rollout.select(self._pending.pop(0))
        metrics = dict(self._rollout_metrics)
        update = policy_gradient_step(trainer, policy=self.policy, optimizer=self.optimizer,
                                      scheduler=self.scheduler, dist=self.dist, minibatch=minibatch,
                                      micro_batch_size=s.micro_batch_size, temperature=s.temperature,
                                      loss_fn=self.loss_fn, with_entropy=s.log_entropy)
        if first_minibatch:  # the gap is only meaningful before the rollout's first update
            self._rollout_metrics["rollout/logprob_gap"] = update["rollout/logprob_gap"]
        update["rollout/logprob_gap"] = self._rollout_metrics["rollout/logprob_gap"]
        metrics.update(update)
        return metrics

    def state_dict(self) -> dict:
        """Exact-resume state: RNGs and the rollout in progress (`common.rollout_state`)."""
        return rollout_state(self)

    def load_state_dict(self, state: dict) -> None:
        """Inverse of `state_dict`."""
        load_rollout_state(self, state)

    def checkpoint_state(self) -> dict:
        """What a checkpoint of this train type holds (policy, optimizer, schedule, tokenizer, sampler)."""
        return {"policy": self.dist.unwrap(self.policy), "optimizer": self.optimizer,
                "scheduler": self.scheduler, **self.extras}


OnlineGRPOStrategy = GRPOStrategy
"""Alias: the online train type is `GRPOStrategy` with an engine source."""


def grpo_settings(config) -> GRPOSettings:
    """`GRPOSettings` from a validated `astrai.config.Config`."""
    g = config.grpo
    return GRPOSettings(batch_size=config.rollout.batch_size, group_size=g.group_size,
                        minibatch_size=g.minibatch_size, micro_batch_size=g.micro_batch_size, epochs=g.epochs,
                        clip_eps=g.clip_eps, kl_coef=g.kl_coef, kl_reward_coef=g.kl_reward_coef,
                        std_eps=g.std_eps, std_floor=g.std_floor, temperature=config.rollout.temperature,
                        log_entropy="policy/entropy" in config.train.metrics)


def build_online_grpo(config, dist, policy, tokenizer) -> GRPOStrategy:
    """Assemble online_grpo from a validated `astrai.config.Config`: frozen reference (only when a KL term is
    on), engine, runner, prompt sampler, one AdamW + schedule. Raises DataError for bad prompt files."""
    from astrai.trainer.strategies.common import build_online_parts, build_policy_optimizer, frozen_copy

    g = config.grpo
    policy = policy.to(dist.device)
    ref_model = frozen_copy(policy) if (g.kl_coef > 0 or g.kl_reward_coef > 0) else None
    engine, runner, sampler, next_prompts = build_online_parts(config, dist, policy, tokenizer,
                                                               ref_model=ref_model, chunk_size=g.micro_batch_size)
    optimizer, scheduler = build_policy_optimizer(config, policy)
    settings = grpo_settings(config)
    return GRPOStrategy(policy=dist.prepare_model(policy), engine=engine, runner=runner,
                              next_prompts=next_prompts, optimizer=optimizer, scheduler=scheduler,
                              settings=settings, dist=dist, seed=config.train.seed + 1000 * dist.rank,
                              extras={"tokenizer": tokenizer, "data_sampler": sampler})
