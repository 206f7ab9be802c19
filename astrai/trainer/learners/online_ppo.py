"""online_ppo: PPO with a learned critic on freshly sampled rollouts (Schulman et al. 2017; Ouyang et al. 2022).

Each rollout: sync the policy weights into the engine, sample `ppo.group_size` responses per prompt (each its own
sample; `rollout.dynamic_sampling` can drop prompts whose responses all score the same), score them, compute
reference log-probs, critic values, k-estimated KL, per-token rewards and GAE once, and pin the targets on a
`RolloutResult`. Then `ppo.epochs` passes of shuffled minibatches replay those fixed targets; every
`train_step` is one minibatch: one policy optimizer step and one critic optimizer step.

On-policy distillation (`distill.teacher`; Lu and Thinking Machines Lab 2025): the frozen teacher takes the
reference model's place (the rollout's `ref_logprobs` are the teacher's log-probs of the sampled tokens) and the
per-token reward is the negative reverse-KL estimate `teacher_logprobs - old_logprobs` on every action token, plus
`distill.reward_weight` times the score at the last one; GAE with the critic then turns it into advantages as it
does the KL-penalised reward (with `ppo.gamma` 0 each token's advantage is its own gap minus its value). With several
teachers routed by a data column (`distill.teachers`, `astrai.experience.teachers`) each sample's gap is its own
teacher's, and `distill/<route>/reverse_kl` and `distill/<route>/share` log each teacher's part. With local
teachers and `distill.jsd_top_k` > 0, GKD's generalised JSD over the teacher's top-k tokens joins the policy loss
(`topk_distill`; `distill/jsd`; routed: each row's top-k from its own teacher, `distill/<route>/jsd`).
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from astrai import train_types
from astrai.algos import advantage_estimator, explained_variance, kl_estimate, masked_mean, ppo_token_rewards, value_loss
from astrai.checkpoint import Part
from astrai.config import PPOSection
from astrai.models import ValueModel
from astrai.experience.result import RolloutResult
from astrai.experience.trajectory import Experience
from astrai.forward import response_values, score_in_chunks
from astrai.experience.sources import ExperienceSource
from astrai.experience.teachers import route_metrics
from astrai.trainer.models import (TrainedModel, build_trained_model, check_teacher_routes, reference_model,
                                   teacher_model)
from astrai.experience.replay import RolloutReplay
from astrai.trainer.learners.policy_gradient import (RolloutLearner, action_tokens, job_engine, online_experience,
                                                     text_decoder)
from astrai.trainer.learners.policy_loss import Objective, RolloutCorrection, loss_agg_mode, policy_objective
from astrai.trainer.learners.topk_distill import TopKDistillation, topk_distillation


class OnlinePPOLearner(RolloutLearner):
    """One `train_step` = one PPO minibatch update of the policy and of the critic.

    Args:
        policy, critic: the trained policy (`AutoRegressiveLM`) and critic (`ValueModel`).
        experience: the online experience source (engine, runner, prompts; G = `ppo.group_size`).
        replay: the rollout replay (`ppo.minibatch_size`, `ppo.epochs`).
        settings: the job's `ppo` section (`astrai.config.PPOSection`: clipping, policy loss, GAE, KL, value
            loss); temperature: the sampling temperature; log_entropy: log `policy/entropy`.
        objective: the policy objective (default: `policy_loss.policy_objective(settings)`).
        correction: the rollout correction, or None.
        log_completions, decode: as `RolloutLearner`'s (`train.log_completions`).
        distill: the experience's `ref_logprobs` are a teacher's (on-policy distillation, see the module
            docstring); reward_weight: then the score's weight in the rewards (`distill.reward_weight`).
        teacher_routes: the routes of `distill.teachers` (several teachers routed by a data column), each logged
            as `distill/<route>/...` (`teachers.route_metrics`); () for one teacher or none.
        topk: top-k logit distillation (`distill.jsd_top_k`), as `RolloutLearner`'s.
    """

    def __init__(self, *, policy: TrainedModel, critic: TrainedModel, experience: ExperienceSource,
                 replay: RolloutReplay, settings: PPOSection, temperature: float, log_entropy: bool = False,
                 objective: Optional[Objective] = None, correction: Optional[RolloutCorrection] = None,
                 log_completions: int = 0, decode: Optional[Callable[[list[int]], str]] = None,
                 distill: bool = False, reward_weight: float = 0.0, teacher_routes: tuple[str, ...] = (),
                 topk: Optional[TopKDistillation] = None):
        super().__init__(policy=policy, experience=experience, replay=replay,
                         micro_batch_size=settings.micro_batch_size, temperature=temperature,
                         log_entropy=log_entropy, loss_agg_mode=loss_agg_mode(settings), correction=correction,
                         log_completions=log_completions, decode=decode, topk=topk)
        self.critic, self.settings = critic, settings
        self.distill, self.reward_weight, self.teacher_routes = distill, reward_weight, tuple(teacher_routes)
        self.objective = objective or policy_objective(settings)

    @torch.no_grad()
    def pin_targets(self, exp: Experience) -> tuple[RolloutResult, dict[str, torch.Tensor]]:
        """Critic values, k-estimated KL, per-token rewards, GAE advantages (whitened when configured) and returns
        (docs/conventions.md section 2), computed once; with the rollout's metrics. Without reference log-probs
        (`ppo.kl_coef` 0: no reference model) the rewards carry no KL term and `kl`, `ref_logprobs` and the
        `rollout/kl` metric are absent. With a teacher (`distill`) `kl` is the per-token reverse-KL estimate
        `old_logprobs - teacher_logprobs` (k1), the rewards are `-kl` per token plus `reward_weight` times the score
        at the last token, and `distill/reverse_kl` (the mean of `kl` over action tokens) replaces `rollout/kl`;
        with routed teachers (`teacher_routes`) each one's `distill/<route>/reverse_kl` and `distill/<route>/share`
        over every rank's samples (`teachers.route_metrics`)."""
        s = self.settings
        mask = exp.sequences.action_mask
        start = time.perf_counter()
        critic = self.critic.module
        values = score_in_chunks(lambda chunk: response_values(critic, chunk), exp.sequences,
                                 s.micro_batch_size) * mask
        scored = time.perf_counter() - start
        if exp.ref_logprobs is None:  # kl_coef 0: no reference model, no KL term
            ref_logprobs, kl = None, None
            rewards = ppo_token_rewards(exp.scores, torch.zeros_like(exp.old_logprobs), mask, kl_coef=0.0)
        elif self.distill:  # the teacher's log-probs: the reverse-KL gap is the reward on every token
            ref_logprobs = exp.ref_logprobs * mask
            kl = (exp.old_logprobs * mask - ref_logprobs) * mask
            rewards = ppo_token_rewards(self.reward_weight * exp.scores, kl, mask, kl_coef=1.0)
        else:
            ref_logprobs = exp.ref_logprobs * mask
            kl = kl_estimate(exp.old_logprobs, exp.ref_logprobs, estimator=s.kl_estimator) * mask
            rewards = ppo_token_rewards(exp.scores, kl, mask, kl_coef=s.kl_coef)
        dist = self.policy.dist  # whitening is over the whole batch: the real tokens of every rank
        advantages, returns = advantage_estimator("gae").fn(
            scores=exp.scores, action_mask=mask, token_rewards=rewards, values=values, gamma=s.gamma,
            lam=s.gae_lambda, whiten_advantages=s.whiten_advantages,
            all_reduce_sum=dist.all_reduce_sum if dist.world_size > 1 else None)
        result = RolloutResult(sequences=exp.sequences, old_logprobs=exp.old_logprobs * mask,
                               ref_logprobs=ref_logprobs, values=values, scores=exp.scores,
                               kl=kl, rewards=rewards, advantages=advantages, returns=returns,
                               policy_version=exp.policy_version, responses=exp.responses,
                               policy_versions=exp.policy_versions, routes=exp.routes)
        metrics = {
            "rollout/reward_mean": exp.scores.mean(),
            "rollout/reward_std": exp.scores.std(unbiased=False),
            "rollout/response_length": mask.sum(-1).float().mean(),
            "rollout/values_mean": masked_mean(values, mask),
            "rollout/returns_mean": masked_mean(returns, mask),
            "rollout/policy_version": torch.tensor(float(exp.policy_version)),
            "time/critic_scoring_seconds": torch.tensor(scored),
        }
        if kl is not None and self.distill:
            metrics["distill/reverse_kl"] = masked_mean(kl, mask)
            if self.teacher_routes:
                metrics.update(route_metrics(kl, mask, exp.routes, self.teacher_routes,
                                             all_reduce_sum=dist.all_reduce_sum if dist.world_size > 1 else None))
        elif kl is not None:
            metrics["rollout/kl"] = kl.sum(-1).mean()
        return result, metrics

    def pins_from_old_logprobs(self) -> bool:
        """The token rewards read `old_logprobs` only through the reference-KL term (`kl_coef` > 0) or a teacher's
        reverse-KL signal; the values and GAE do not."""
        return self.settings.kl_coef > 0 or bool(self.distill)

    def update(self, trainer, minibatch: RolloutResult, first: bool) -> dict[str, torch.Tensor]:
        """The policy step (`ppo.policy_loss`, PPO-clip by default), then the (clipped) value-loss critic step."""
        metrics = self.policy_update(trainer, minibatch, first, self.objective)
        metrics.update(self._critic_update(trainer, minibatch))
        return metrics

    def _critic_update(self, trainer, minibatch: RolloutResult) -> dict[str, torch.Tensor]:
        """One critic optimizer step of `vf_coef` times the value loss; explained variance over the minibatch."""
        s = self.settings
        start = time.perf_counter()
        width = minibatch.sequences.action_mask.shape[1]
        seen: list[tuple[torch.Tensor, ...]] = []  # (values, returns, mask) of each micro-batch, padded to `width`

        def loss_fn(micro: RolloutResult, num_tokens: torch.Tensor):
            mask = micro.sequences.action_mask
            values = response_values(self.critic.module, micro.sequences)
            loss, metrics = value_loss(values, micro.values, micro.returns, mask,
                                       clip_range=s.value_clip, num_tokens=num_tokens)
            pad = (0, width - mask.shape[1])  # micro-batches are trimmed to their own width
            seen.append(tuple(torch.nn.functional.pad(x, pad) for x in (values.detach(), micro.returns, mask)))
            return s.vf_coef * loss, dict(metrics, **{"critic/loss": loss.detach()})

        metrics = trainer.accumulate_and_step(self.critic, minibatch.micro_batches(self.micro_batch_size), loss_fn,
                                              count=action_tokens)
        metrics["critic/explained_variance"] = explained_variance(*(torch.cat(parts) for parts in zip(*seen)))
        metrics["time/critic_update_seconds"] = torch.tensor(time.perf_counter() - start)
        return metrics

    def checkpoint_parts(self) -> dict[str, Part]:
        """The policy's parts and the critic extras, required to resume: `value_model`, `value_optimizer`,
        `value_scheduler`."""
        return {**super().checkpoint_parts(),
                **self.critic.checkpoint_parts("value_model", prefix="value_")}


def build_online_ppo(config, dist, policy, tokenizer) -> OnlinePPOLearner:
    """Assemble the online_ppo learner from a validated `astrai.config.Config`.

    Builds the frozen reference model (none when `ppo.kl_coef` is 0: nothing would use it; with `distill.teacher`
    the frozen teacher in its place, `models.teacher_model`), the critic (warm-started from the policy), one AdamW
    optimizer + schedule for each of policy and critic, the online experience source (engine, runner, prompt
    sampler) and the replay.

    Raises:
        DataError: for a missing or malformed prompt file.
        ConfigError: for a teacher with another tokenizer than the student's.
        ValueError: with `distill.teachers`, for a row that no teacher scores (`models.check_teacher_routes`).
    """
    r, p = config.rollout, config.ppo
    policy = policy.to(dist.device)
    if config.distill.distills:  # one teacher, or several routed by a data column (distill.teachers)
        ref_model = teacher_model(dist, config, tokenizer)
    else:
        held = train_types.get(config.train.type).models_held(config)  # a KL term's reference
        ref_model = reference_model(dist, policy, config) if held.reference else None
    # whole copies before the policy is sharded (split over the tensor-parallel group with rollout.tensor_parallel_size)
    engine = job_engine(config, dist, policy, tokenizer)
    critic = build_trained_model(config, dist, ValueModel.from_policy(policy, p.critic_layers), name="critic",
                                 lr=config.optim.critic_learning_rate)
    trained = build_trained_model(config, dist, policy, name="policy")
    experience = online_experience(config, dist, trained, tokenizer, engine=engine, ref_model=ref_model,
                                   chunk_size=p.micro_batch_size, group_size=p.group_size)
    check_teacher_routes(config, experience.data_sampler.dataset)  # distill.teachers: every row has a teacher
    topk = topk_distillation(config, ref_model if config.distill.jsd_top_k else None, chunk_size=p.micro_batch_size,
                             loss_agg_mode=loss_agg_mode(p), loss_scale_factor=r.max_new_tokens)
    replay = RolloutReplay(minibatch_size=p.minibatch_size, epochs=p.epochs, seed=config.train.seed + 1000 * dist.dp_rank)
    return OnlinePPOLearner(policy=trained, critic=critic, experience=experience, replay=replay, settings=p,
                             temperature=r.temperature, log_entropy="policy/entropy" in config.train.metrics,
                             objective=policy_objective(p, loss_scale_factor=r.max_new_tokens),
                             correction=RolloutCorrection.from_config(r, chunk_size=p.micro_batch_size),
                             log_completions=config.train.log_completions, decode=text_decoder(tokenizer),
                             distill=config.distill.distills, reward_weight=config.distill.reward_weight,
                             teacher_routes=tuple(config.distill.teachers), topk=topk)
