"""online_grpo: Group Relative Policy Optimization on freshly sampled rollouts (Shao et al. 2024, DeepSeekMath).

Each rollout: sync the policy weights into the engine, repeat each of B prompts G times (contiguously) through
the shared `RolloutRunner`, score the B*G responses, and pin group-normalised advantages
`A_i = (r_i - mean_G) / (max(std_G, std_floor) + eps)` (`grpo.scale_rewards`: or divided by the std of the whole
rollout's rewards on all ranks, or not divided) broadcast over each response's real tokens. The loss is
the PPO-clip surrogate against the sampler-aligned `old_logprobs` of the engine (what it simplifies: no second
"old policy" model is allocated, synchronised or run) plus `kl_coef` times the k3 reference KL
(Schulman 2020) in the loss; alternatively `kl_reward_coef` subtracts the per-sequence k3 KL from the reward
before normalisation (the two are mutually exclusive). No critic. Every `train_step` is one minibatch: one
policy optimizer step; `grpo.epochs` passes of shuffled minibatches replay each rollout.

On-policy distillation (`distill.teacher` with `grpo.advantage_estimator: on_policy_distill`; Lu and Thinking
Machines Lab 2025): the frozen teacher takes the reference model's place, so the rollout's `ref_logprobs` hold the
teacher's log-probs of the sampled tokens (at the sampling temperature, as the reference's would be) and the
per-token advantage is `teacher_logprobs - old_logprobs` plus `distill.reward_weight` times the group advantage;
`distill/reverse_kl` logs the mean over action tokens of `old_logprobs - teacher_logprobs`. With several teachers
routed by a data column (`distill.teachers`, `astrai.experience.teachers`) each sample's `ref_logprobs` are its own
teacher's, and `distill/<route>/reverse_kl` and `distill/<route>/share` log each teacher's part. With local
teachers and `distill.jsd_top_k` > 0, GKD's generalised JSD over the teacher's top-k tokens joins the policy loss
(`topk_distill`; `distill/jsd`; routed: each row's top-k from its own teacher, `distill/<route>/jsd`).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from astrai import train_types
from astrai.algos import advantage_estimator, aggregate_loss, kl_k3, masked_mean, ppo_token_rewards
from astrai.config import GRPOSection
from astrai.experience.result import RolloutResult
from astrai.experience.trajectory import Experience
from astrai.experience.sources import ExperienceSource
from astrai.experience.teachers import TeacherRoutes, route_metrics
from astrai.trainer.models import (TrainedModel, build_trained_model, check_teacher_routes, reference_model,
                                   teacher_model)
from astrai.experience.replay import RolloutReplay
from astrai.trainer.learners.policy_gradient import RolloutLearner, job_engine, online_experience, text_decoder
from astrai.trainer.learners.policy_loss import RolloutCorrection, loss_agg_mode, policy_objective
from astrai.trainer.learners.topk_distill import TopKDistillation, topk_distillation


def validate_group_rollout(rollout, *, group_size: int, need_ref: bool) -> None:
    """Check the tensors of a GRPO rollout (a `RolloutResult`, or an `Experience` before its advantages exist)
    before any target or loss is computed.

    Checks: `action_mask` is (N, T) bool with N a multiple of `group_size`; `input_ids`, `attention_mask`,
    `position_ids` are (N, P + T); the real response tokens (`response_mask`) form a prefix of each row (right
    padding) and hold every action (a multi-turn row's tool tokens are real but no action); every row has an action; `old_logprobs`, `advantages` (and `ref_logprobs` when `need_ref`) are
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
    real = seq.response_mask
    if bool((mask & ~real).any()):
        raise ValueError("rollout: action_mask marks a padding token of the response (attention_mask False there)")
    if bool((real[:, 1:] & ~real[:, :-1]).any()):
        raise ValueError("rollout: attention_mask has a real response token after padding (responses must be "
                         "right-padded)")
    if not bool(mask.any(dim=1).all()):
        raise ValueError("rollout: a response without any action token (nowhere to put its score)")
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
                  std_floor: Optional[float] = None, scale_rewards: str = "group", estimator: str = "grpo",
                  gamma: float = 1.0, all_reduce_sum: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                  reward_weight: float = 0.0) -> RolloutResult:
    """Pin the targets of a critic-free estimator on sampled experience (the G samples of a prompt contiguous).

    Shapes: N = B * G rows, T response tokens. `kl` = k3(old_logprobs, ref_logprobs) per real token (N, T)
    when reference log-probs exist; per-token rewards = the score on the last real token minus
    `kl_reward_coef * kl` on every real token (`algos.ppo_token_rewards`; their row sum is GRPO's
    r = scores - kl_reward_coef * kl.sum(-1)); advantages (N, T) from `algos.ADVANTAGE_ESTIMATORS[estimator]`
    (`grpo`: `group_advantages(r, scale=scale_rewards)` broadcast over the real tokens; `rloo`, `reinforce_pp`
    with `gamma`, `reinforce_pp_baseline`), zeroed at padding (float32). `all_reduce_sum` sums a tensor over the
    data-parallel ranks for the batch statistics (`scale_rewards` batch, the REINFORCE++ whitening); None: this
    rank's N rows only. `values` and `returns` are None (no critic); `rewards` holds r broadcast over real tokens.
    An estimator that reads a teacher (`on_policy_distill`) takes `exp.ref_logprobs` as the teacher's log-probs
    (the teacher takes the reference's place), with `reward_weight` (the task reward's weight); `kl` is then None.

    Raises:
        ValueError: from `validate_group_rollout`, `kl_reward_coef > 0` without reference log-probs, or a teacher
            estimator without them.
    """
    validate_group_rollout(exp, group_size=group_size, need_ref=exp.ref_logprobs is not None)
    mask = exp.sequences.action_mask
    old = exp.old_logprobs * mask
    ref = exp.ref_logprobs * mask if exp.ref_logprobs is not None else None
    record = advantage_estimator(estimator)
    if record.needs_teacher and ref is None:
        raise ValueError(f"grpo.advantage_estimator {estimator} needs the teacher's log-probs (distill.teacher)")
    kl = kl_k3(old, ref) * mask if ref is not None and not record.needs_teacher else None
    if kl_reward_coef > 0 and kl is None:
        raise ValueError("grpo.kl_reward_coef > 0 needs reference log-probs")
    token_rewards = ppo_token_rewards(exp.scores.float(), kl if kl_reward_coef > 0 else torch.zeros_like(old), mask,
                                      kl_coef=kl_reward_coef)
    teacher = dict(old_logprobs=old, teacher_logprobs=ref, reward_weight=reward_weight) if record.needs_teacher else {}
    adv, _ = record.fn(
        scores=exp.scores, action_mask=mask, token_rewards=token_rewards, group_size=group_size, gamma=gamma,
        eps=std_eps, std_floor=std_floor, scale=scale_rewards, all_reduce_sum=all_reduce_sum, **teacher)
    rewards = token_rewards.sum(-1)
    result = RolloutResult(sequences=exp.sequences, old_logprobs=old, ref_logprobs=ref, values=None,
                           scores=exp.scores, kl=kl, rewards=rewards[:, None] * mask,
                           advantages=adv * mask, returns=None, policy_version=exp.policy_version,
                           responses=tuple(exp.responses), policy_versions=exp.policy_versions,
                           routes=exp.routes)
    validate_group_rollout(result, group_size=group_size, need_ref=ref is not None)
    return result


def grpo_loss_fn(section, *, loss_scale_factor: Optional[float] = None):
    """The GRPO micro-batch loss: the section's policy loss (`policy_loss.policy_objective`: PPO-clip against
    `old_logprobs` by default) + `kl_coef` * k3 reference KL, aggregated as the policy loss is (`loss_agg_mode`, over
    the step's global units). Returns a `policy_gradient.Objective`; metrics `policy/pg_loss`, the loss's clip
    metrics, and `policy/ref_kl` when `kl_coef > 0`."""
    base, mode = policy_objective(section, loss_scale_factor=loss_scale_factor), loss_agg_mode(section)
    kl_coef = section.kl_coef

    def loss_fn(logprobs: torch.Tensor, micro: RolloutResult, num_units: torch.Tensor):
        loss, metrics = base(logprobs, micro, num_units)
        if kl_coef > 0:
            mask = micro.sequences.action_mask
            kl = aggregate_loss(kl_k3(logprobs, micro.ref_logprobs.to(logprobs.dtype)), mask, loss_agg_mode=mode,
                                num_units=num_units, loss_scale_factor=loss_scale_factor)
            loss = loss + kl_coef * kl
            metrics["policy/ref_kl"] = kl.detach()
        return loss, metrics

    return loss_fn


class GRPOLearner(RolloutLearner):
    """One `train_step` = one GRPO minibatch update of the policy (no critic); online or offline: only the
    experience source differs (`OnlineExperience` with G samples per prompt, or `grpo.StoredGroups`).

    Args:
        policy: the trained policy.
        experience: B * G scored samples per batch, the G samples of a prompt contiguous.
        replay: the rollout replay (`grpo.minibatch_size`, `grpo.epochs`; sizes count samples).
        settings: the job's `grpo` section (`astrai.config.GRPOSection`: group size, estimator, policy loss,
            clipping, KL, reward scaling); temperature: the sampling temperature; log_entropy: log `policy/entropy`.
        reward_weight: `distill.reward_weight`, the task reward's weight for an estimator that reads a teacher.
        teacher_routes: the routes of `distill.teachers` (several teachers routed by a data column), each logged
            as `distill/<route>/...` (`teachers.route_metrics`); () for one teacher or none.
        loss_scale_factor: L of `loss_agg_mode: seq-mean-token-sum-norm` (the response-length cap).
        correction: the rollout correction, or None.
        log_completions, decode: as `RolloutLearner`'s (`train.log_completions`; online only).
        topk: top-k logit distillation (`distill.jsd_top_k`), as `RolloutLearner`'s.
    """

    def __init__(self, *, policy: TrainedModel, experience: ExperienceSource, replay: RolloutReplay,
                 settings: GRPOSection, temperature: float, log_entropy: bool = False,
                 loss_scale_factor: Optional[float] = None, correction: Optional[RolloutCorrection] = None,
                 log_completions: int = 0, decode: Optional[Callable[[list[int]], str]] = None,
                 reward_weight: float = 0.0, teacher_routes: tuple[str, ...] = (),
                 topk: Optional[TopKDistillation] = None):
        super().__init__(policy=policy, experience=experience, replay=replay,
                         micro_batch_size=settings.micro_batch_size, temperature=temperature,
                         log_entropy=log_entropy, loss_agg_mode=loss_agg_mode(settings), correction=correction,
                         log_completions=log_completions, decode=decode, topk=topk)
        self.settings, self.reward_weight, self.teacher_routes = settings, reward_weight, tuple(teacher_routes)
        self.objective = grpo_loss_fn(settings, loss_scale_factor=loss_scale_factor)

    def pin_targets(self, exp: Experience) -> tuple[RolloutResult, dict[str, torch.Tensor]]:
        """Group advantages (`group_rollout`) and the rollout's metrics; with a teacher also `distill/reverse_kl`,
        the mean over this rank's action tokens of `old_logprobs - teacher_logprobs` (the k1 estimate of
        KL(student || teacher) per token), and with routed teachers (`teacher_routes`) each one's
        `distill/<route>/reverse_kl` and `distill/<route>/share` over every rank's samples
        (`teachers.route_metrics`)."""
        s = self.settings
        result = group_rollout(exp, group_size=s.group_size, kl_reward_coef=s.kl_reward_coef,
                               std_eps=s.std_eps, std_floor=s.std_floor, scale_rewards=s.scale_rewards,
                               estimator=s.advantage_estimator, gamma=s.gamma,
                               all_reduce_sum=self.policy.dist.all_reduce_sum, reward_weight=self.reward_weight)
        mask = result.sequences.action_mask
        groups = exp.scores.reshape(-1, s.group_size)
        metrics = {
            "rollout/reward_mean": exp.scores.mean(),
            "rollout/reward_std": exp.scores.std(unbiased=False),
            "rollout/group_reward_std": groups.std(dim=1, unbiased=False).mean(),
            "rollout/zero_std_groups": (groups.std(dim=1, unbiased=False) == 0).float().mean(),
            "rollout/response_length": mask.sum(-1).float().mean(),
            "rollout/advantage_abs_mean": masked_mean(result.advantages.abs(), mask),
            "rollout/policy_version": torch.tensor(float(exp.policy_version)),
        }
        if result.kl is not None:
            metrics["rollout/kl"] = result.kl.sum(-1).mean()
        if advantage_estimator(s.advantage_estimator).needs_teacher:
            metrics["distill/reverse_kl"] = masked_mean(result.old_logprobs - result.ref_logprobs, mask)
            if self.teacher_routes:
                dist = self.policy.dist
                metrics.update(route_metrics(result.old_logprobs - result.ref_logprobs, mask, exp.routes,
                                             self.teacher_routes,
                                             all_reduce_sum=dist.all_reduce_sum if dist.world_size > 1 else None))
        return result, metrics

    def pins_from_old_logprobs(self) -> bool:
        """The group advantages read `old_logprobs` only through a KL term in the rewards (`kl_reward_coef`) or a
        teacher's per-token signal (an estimator that `needs_teacher`). The loss's KL term (`kl_coef`) reads the
        step's own log-probs; only the `rollout/kl` metric (k3 of the old log-probs against the reference's) is
        then taken against the engine's log-probs, as without a correction."""
        s = self.settings
        return bool(s.kl_reward_coef) or advantage_estimator(s.advantage_estimator).needs_teacher

    def update(self, trainer, minibatch: RolloutResult, first: bool) -> dict[str, torch.Tensor]:
        """One policy optimizer step of the GRPO loss over the minibatch."""
        return self.policy_update(trainer, minibatch, first, self.objective)


def grpo_learner(config, dist, policy: TrainedModel, experience: ExperienceSource, *,
                  online: bool = True, decode: Optional[Callable[[list[int]], str]] = None,
                  teacher: Optional[torch.nn.Module | TeacherRoutes] = None) -> GRPOLearner:
    """The GRPO learner of a validated config over `experience`: online (the response-length cap is
    `rollout.max_new_tokens`; `rollout.correction` and `train.log_completions`, with `decode` for the prompts,
    apply) or offline (the cap is `data.max_length`). With `distill.jsd_top_k` > 0, `teacher` (the local teacher,
    or the routed local teachers of `distill.teachers`, a `teachers.TeacherRoutes`) gives the top-k distillation term
    (`topk_distill.topk_distillation`; ConfigError as it raises)."""
    g, r = config.grpo, config.rollout
    cap = r.max_new_tokens if online else config.data.max_length
    topk = topk_distillation(config, teacher, chunk_size=g.micro_batch_size, loss_agg_mode=loss_agg_mode(g),
                             loss_scale_factor=cap)
    replay = RolloutReplay(minibatch_size=g.minibatch_size, epochs=g.epochs, seed=config.train.seed + 1000 * dist.dp_rank)
    return GRPOLearner(policy=policy, experience=experience, replay=replay, settings=g, temperature=r.temperature,
                        log_entropy="policy/entropy" in config.train.metrics,
                        loss_scale_factor=cap,
                        correction=RolloutCorrection.from_config(r, chunk_size=g.micro_batch_size) if online else None,
                        log_completions=config.train.log_completions if online else 0, decode=decode,
                        reward_weight=config.distill.reward_weight, teacher_routes=tuple(config.distill.teachers),
                        topk=topk)


def build_online_grpo(config, dist, policy, tokenizer) -> GRPOLearner:
    """Assemble online_grpo from a validated `astrai.config.Config`: frozen reference (only when a KL term is
    on) or, with `distill.teacher`, the frozen teacher in its place (`models.teacher_model`: the reference
    log-probs the runner scores are then the teacher's; with `distill.teachers` every teacher, each row scored by
    the one its `distill.route_field` names, the rows checked to have one: `models.check_teacher_routes`), one AdamW
    + schedule, the online experience source with G = `grpo.group_size`. Raises DataError for bad prompt files,
    ConfigError for a teacher with another tokenizer, ValueError for a row no teacher scores."""
    g = config.grpo
    policy = policy.to(dist.device)
    if config.distill.distills:
        ref_model = teacher_model(dist, config, tokenizer)
    elif train_types.get(config.train.type).models_held(config).reference:  # a KL term's reference
        ref_model = reference_model(dist, policy, config)
    else:
        ref_model = None
    # whole copies before the policy is sharded (split over the tensor-parallel group with rollout.tensor_parallel_size)
    engine = job_engine(config, dist, policy, tokenizer)
    trained = build_trained_model(config, dist, policy, name="policy")
    experience = online_experience(config, dist, trained, tokenizer, engine=engine, ref_model=ref_model,
                                   chunk_size=g.micro_batch_size, group_size=g.group_size)
    check_teacher_routes(config, experience.data_sampler.dataset)  # distill.teachers: every row has a teacher
    return grpo_learner(config, dist, trained, experience, decode=text_decoder(tokenizer),
                        teacher=ref_model if config.distill.jsd_top_k else None)
