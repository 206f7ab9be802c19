"""The shared shape of the rollout-replaying train types (online_ppo, online_grpo, offline grpo).

`RolloutLearner.train_step` = one minibatch: when the replay is exhausted, collect experience from the
`ExperienceSource`, pin the train type's targets on it (`pin_targets`: GAE for PPO, group advantages for GRPO) and
load it into the `RolloutReplay`; then `update` the models on the next minibatch. `policy_update` is the policy
optimizer step both share: the train type's objective on log-probs computed by the one scoring function the
engine's `old_logprobs` are aligned with (`astrai.forward.response_logprobs`, docs/conventions.md section 2).
`online_experience` wires the online train types' experience source to the trained policy; `completion_samples`
are the rows of a rollout that `train.log_completions` shows (`trainer.callbacks.CompletionsLogger`).
"""

from __future__ import annotations

import math
import os
import time
import dataclasses
import warnings
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from astrai.algos import MAX_METRICS, aggregate_loss, loss_units, metric_agg_mode, mismatch_metrics
from astrai.checkpoint import CheckpointError, Part, capture_rng_state, restore_rng_state
from astrai.distributed.sharding import prepare_reference
from astrai.experience.build import build_online_experience
from astrai.experience.replay import RolloutReplay
from astrai.experience.result import RolloutResult
from astrai.experience.trajectory import Experience
from astrai.experience.sources import ExperienceSource, OnlineExperience
from astrai.forward import response_logprobs
from astrai.rewards.functions import ScoringStopped, reward_metrics
from astrai.rollout.build import build_job_engine
from astrai.rollout.engine import GenerationEngine, sync_weights
from astrai.trainer.faults import StepAbandoned, nonfinite_sampling
from astrai.trainer.models import TrainedModel
from astrai.trainer.learners.policy_loss import Objective, RolloutCorrection
from astrai.trainer.learners.topk_distill import TopKDistillation


def job_engine(config, dist, policy: torch.nn.Module, tokenizer) -> GenerationEngine:
    """The rollout engine of an online train type (`astrai.rollout.build.build_job_engine`), made from the whole
    `policy` before it is sharded: colocated (split over the tensor-parallel group with
    `rollout.tensor_parallel_size`), or with `rollout.placement` separate this rank's generation process."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return build_job_engine(config, policy, tokenizer, device=dist.device, tp_group=dist.tp_group,
                            local_rank=local_rank, local_world_size=local_world)


def online_experience(config, dist, policy: TrainedModel, tokenizer, *, engine: GenerationEngine,
                      ref_model: Optional[torch.nn.Module], chunk_size: int, group_size: int) -> OnlineExperience:
    """The online experience source of an online train type (`astrai.experience.build.build_online_experience`):
    before each batch the engine takes `policy`'s weights (`policy.full_weights`, LoRA adapters merged) unless it
    holds the version already; a reward model is prepared for inference as the reference model is (partitioned
    under fsdp2 / zero3)."""
    return build_online_experience(
        config, dist, tokenizer, engine=engine, model_config=policy.model.config,
        sync_weights=lambda version: sync_weights(engine, policy.full_weights, version), ref_model=ref_model,
        chunk_size=chunk_size, group_size=group_size, prepare_model=lambda model: prepare_reference(dist, model))


def text_decoder(tokenizer) -> Callable[[list[int]], str]:
    """Token ids -> text without special tokens (a chat-templated prompt's role markers are left out)."""
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


@torch.no_grad()
def completion_samples(experience: Experience, rollout: RolloutResult, count: int,
                       decode: Callable[[list[int]], str]) -> list[dict]:
    """The first `count` samples of a rollout (all when it has fewer; GRPO: whole groups first) as
    `completions.jsonl` records without their "step", with one host transfer for every number.

    Each record: `policy_version` (the weights that sampled the sample: the oldest version among its tokens'
    `Experience.policy_versions`, older than the rollout's own with partial rollouts or one step off; the rollout's
    `policy_version` when it has no sampled token or no per-token versions), `prompt` (the prompt's token ids decoded by
    `decode`, padding dropped), `completion` (what the reward saw: the response text, `Experience.responses`; a
    multi-turn episode's new messages, `Experience.messages`, a list of {"role", "content", ...}), `score`
    (the total reward), `rewards` (each reward function's value by name, None where it does not apply or was
    skipped), `advantage` (the mean of the pinned advantages over the sample's action tokens: GRPO's per-sample
    advantage, PPO's mean GAE advantage) and `response_length` (its action tokens, as `rollout/response_length`).

    Args:
        experience: the scored experience the rollout was pinned from (same rows).
        rollout: the rollout with its advantages.
        count: how many rows (> 0).
        decode: token ids -> text.
    """
    n = min(count, len(experience))
    seq = experience.sequences
    width = seq.prompt_length
    mask = rollout.sequences.action_mask[:n]
    lengths = mask.sum(-1)
    advantage = (rollout.advantages[:n].float() * mask).sum(-1) / lengths.clamp(min=1)
    prompts = torch.where(seq.attention_mask[:n, :width].bool(), seq.input_ids[:n, :width], -1)  # -1: padding
    names = list(experience.reward_components)
    sampled_by = torch.full((n,), experience.policy_version, dtype=torch.int64, device=lengths.device)
    if experience.policy_versions is not None:  # each sample's oldest sampling version (-1 marks no token)
        versions = experience.policy_versions[:n].to(lengths.device)
        oldest = torch.where(versions >= 0, versions, torch.iinfo(torch.int64).max).amin(-1)
        sampled_by = torch.where(versions.ge(0).any(-1), oldest, sampled_by)
    columns = ([experience.scores[:n], advantage, lengths, sampled_by]
               + [experience.reward_components[k][:n] for k in names])
    numbers = torch.stack([c.to(device=prompts.device, dtype=torch.float64) for c in columns], dim=1)
    table = torch.cat([prompts.double(), numbers], dim=1).tolist()  # ids < 2**53 are exact in float64
    samples = []
    for i, row in enumerate(table):
        score, adv, length, version, *values = row[width:]
        samples.append({
            "policy_version": int(version),
            "prompt": decode([int(x) for x in row[:width] if x >= 0]),
            "completion": (experience.responses[i] if experience.messages is None or experience.messages[i] is None
                           else [dict(m) for m in experience.messages[i]]),
            "score": score,
            "rewards": {k: None if math.isnan(v) else v for k, v in zip(names, values)},
            "advantage": adv,
            "response_length": int(length),
        })
    return samples


def action_tokens(micro: RolloutResult) -> torch.Tensor:
    """The loss units of an RL micro-batch: its real response tokens (0-dim int64)."""
    return micro.sequences.action_mask.sum()


class RolloutLearner:
    """Base of the rollout-replaying learners: one `train_step` = one minibatch of the current rollout.

    Args:
        policy: the trained policy.
        experience: where samples come from (its `data_sampler` is the learner's).
        replay: the rollout replay (minibatch size, epochs, shuffling RNG).
        micro_batch_size: rows per forward/backward; temperature: the sampling temperature (scoring uses it too).
        log_entropy: also log `policy/entropy` (an extra softmax pass over the logits).
        loss_agg_mode: how the policy objective aggregates (`algos.LOSS_AGG_MODES`): it sets the loss units the
            step counts (`algos.loss_units`: tokens, or sequences for the seq-mean modes).
        correction: the rollout correction (`policy_loss.RolloutCorrection`) or None.
        log_completions: `train.log_completions`: on the main process, keep the first N samples of each new rollout
            (`completion_samples`) for `take_completions`; 0: none (nothing is computed).
        decode: token ids -> prompt text (`text_decoder`); required when `log_completions` > 0.
        topk: top-k logit distillation (`topk_distill.TopKDistillation`, `distill.jsd_top_k` > 0): its term joins the
            policy loss of every micro-batch, from the same student forward; None: off.

    Subclasses implement `pin_targets` and `update`.
    """

    def __init__(self, *, policy: TrainedModel, experience: ExperienceSource, replay: RolloutReplay,
                 micro_batch_size: int, temperature: float, log_entropy: bool = False,
                 loss_agg_mode: str = "token-mean", correction: Optional[RolloutCorrection] = None,
                 log_completions: int = 0, decode: Optional[Callable[[list[int]], str]] = None,
                 topk: Optional[TopKDistillation] = None):
        if log_completions and decode is None:
            raise ValueError("train.log_completions: the learner needs a decode function to show prompts")
        self.policy, self.experience, self.replay = policy, experience, replay
        self.micro_batch_size, self.temperature, self.log_entropy = micro_batch_size, temperature, log_entropy
        self.loss_agg_mode, self.correction = loss_agg_mode, correction
        self.log_completions, self.decode, self.topk = log_completions, decode, topk
        self._completions: list[dict] = []

    def take_completions(self) -> list[dict]:
        """The samples of the newest rollout not taken yet (`completion_samples`, `train.log_completions` of them),
        then [] until the next rollout; always [] on other processes than the main one or with log_completions 0."""
        taken, self._completions = self._completions, []
        return taken

    @property
    def data_sampler(self):
        """The experience source's data sampler."""
        return self.experience.data_sampler

    @property
    def rollout_engine(self):
        """The experience source's engine (None for stored experience)."""
        return self.experience.engine

    @property
    def rollout(self) -> RolloutResult | None:
        """The rollout being replayed."""
        return self.replay.rollout

    def pin_targets(self, experience: Experience) -> tuple[RolloutResult, dict[str, torch.Tensor]]:
        """The rollout with its train type's targets, and its detached metrics (subclasses)."""
        raise NotImplementedError

    def update(self, trainer, minibatch: RolloutResult, first: bool) -> dict[str, torch.Tensor]:
        """The optimizer steps of one minibatch; `first` on a rollout's first minibatch (subclasses)."""
        raise NotImplementedError

    def train_step(self, trainer) -> dict[str, torch.Tensor]:
        """One minibatch: collect and pin a new rollout when the replay is exhausted, then `update`."""
        minibatch, first = self.replay.next_minibatch(lambda: self.make_rollout(trainer.state.policy_version))
        metrics = dict(self.replay.metrics)
        metrics.update(self.update(trainer, minibatch, first))
        return metrics

    def make_rollout(self, policy_version: int) -> tuple[RolloutResult, dict[str, torch.Tensor]]:
        """Collect experience of the weights of `policy_version` and pin the targets: `(rollout, metrics)`, the
        metrics with the phase timings (`time/<phase>_seconds`, `time/rollout_seconds` for the whole), the
        experience's stats (`rollout/<name>`) and each reward function's (`rewards/<name>/mean`, `std`, `applies`,
        `failed`: `reward_functions.reward_metrics`). With `log_completions`, the main process keeps the rollout's
        first samples for `take_completions`.

        Raises:
            StepAbandoned: a stop request interrupted the reward scoring on some rank (`ScoringStopped`, raised on
                every rank alike): the state the collection advanced (`collection_state`: data position, sampling
                RNG, partial rollouts in flight, global RNGs), taken at the start, is put back first, so that a
                checkpoint now is the last completed step's.
        """
        start = time.perf_counter()
        before = self.collection_state()
        try:
            experience = self.experience.collect(policy_version)
        except FloatingPointError as err:  # non-finite logits in the sampler: one line, not its traceback
            raise nonfinite_sampling("the rollout", policy_version, err) from None
        except ScoringStopped as err:  # never trained on a partial scoring: back to the last completed step
            self.load_collection_state(before)
            raise StepAbandoned(f"{err}; the step is abandoned and the state put back to the last completed "
                                "step's") from None
        engine_logprobs = weights = None
        rescore = self.correction is not None and not self.corrects_in_update(experience)
        if rescore:  # the trainer's own old log-probs, before any update from this rollout, as its forward computes
            with self.policy.autocast():  # them (train.bf16 / train.fp16 under ddp: that precision)
                experience, engine_logprobs, weights, rescored = self.correction.rescore(self.policy.module,
                                                                                         experience)
        rollout, metrics = self.pin_targets(experience)
        if rescore:
            rollout = dataclasses.replace(rollout, rollout_logprobs=engine_logprobs, correction_weights=weights)
            metrics.update(self._max_over_ranks(rescored))
        elif self.correction is not None:  # weighed in its one update (policy_update), from that step's forward
            rollout = dataclasses.replace(rollout, rollout_logprobs=rollout.old_logprobs)
        metrics["time/rollout_seconds"] = torch.tensor(time.perf_counter() - start)
        metrics.update({f"time/{phase}_seconds": torch.tensor(seconds)
                        for phase, seconds in experience.timings.items()})
        metrics.update(self._max_over_ranks({f"rollout/{name}": torch.tensor(value)
                                             for name, value in experience.stats.items()}))
        metrics.update(reward_metrics(experience.reward_components, experience.reward_failed))
        if self.log_completions and self.policy.dist.is_main:
            self._completions = completion_samples(experience, rollout, self.log_completions, self.decode)
        return rollout, metrics

    def pins_from_old_logprobs(self) -> bool:
        """Whether `pin_targets` reads the rollout's `old_logprobs` (a KL term in the rewards, a teacher's
        per-token signal), so that a rollout correction must rescore the rollout before its targets are pinned.
        True unless a subclass knows it does not."""
        return True

    def corrects_in_update(self, experience: Experience) -> bool:
        """With a rollout correction: whether this rollout is trained in exactly one optimizer step (one minibatch,
        `epochs` 1: TRL's default of one step per generation) and its targets do not read `old_logprobs`
        (`pins_from_old_logprobs`). Then the trainer's old log-probs are its own forward of that step, detached
        (the policy before its only update from the rollout: what the rescoring would compute, up to float
        rounding), and the rescoring forward is skipped (TRL does the same on-policy): `policy_update` weighs
        the tokens (`RolloutCorrection.in_update`) and reports the correction's and the mismatch metrics over the
        whole rollout, without `time/rescore_seconds`."""
        rows = experience.sequences.action_mask.shape[0]
        return (self.replay.epochs == 1 and rows == self.replay.minibatch_size
                and not self.pins_from_old_logprobs())

    def policy_update(self, trainer, minibatch: RolloutResult, first: bool,
                      objective: Objective) -> dict[str, torch.Tensor]:
        """One policy optimizer step of `objective` over `minibatch`, in micro-batches of `micro_batch_size` rows
        (`RolloutResult.micro_batches`: rows grouped by length, all-padding columns trimmed); the step counts the
        loss units of `loss_agg_mode`.

        Returns:
            detached 0-dim metrics of `Trainer.accumulate_and_step` plus `rollout/logprob_gap` (mean |logprobs -
            old_logprobs| over this rank's real tokens of the rollout's FIRST minibatch, measured before any update
            from it: ~0 unless the engine held stale weights; repeated on the rollout's later minibatches), without
            a rollout correction the mismatch metrics of that minibatch (`rollout/mismatch_*`, against the
            engine's log-probs: `algos.mismatch_metrics`; with one they cover the whole rollout, from its rescore
            or, for a rollout trained in this one step (`corrects_in_update`), from this step's forward, with the
            correction's `rollout/correction_*`),
            `policy/entropy` with `log_entropy`, `distill/jsd` with `topk` (its term added to the loss; with routed
            teachers each micro-batch row's top-k from its route's teacher, `RolloutResult.routes`, and
            `distill/<route>/jsd` per route: `TopKDistillation.route_metrics`), and `time/policy_update_seconds`.
        """
        start = time.perf_counter()
        shares = metric_agg_mode(self.loss_agg_mode)
        if self.topk is not None:
            self.topk.reset_route_metrics()
        seen: list[tuple[torch.Tensor, ...]] = []  # first minibatch: (logprobs, engine log-probs, mask), padded
        width = minibatch.sequences.action_mask.shape[1]
        # a rollout trained in this one step (corrects_in_update: the engine's log-probs kept, no weights yet) is
        # weighed from this step's own forward; one pinned without a correction (a resume that turned it on) is not
        weigh_here = (self.correction is not None and minibatch.correction_weights is None
                      and minibatch.rollout_logprobs is not None)

        def loss_fn(micro: RolloutResult, num_units: torch.Tensor):
            mask = micro.sequences.action_mask
            term = extra = None
            if self.topk is None:
                logprobs, entropy = response_logprobs(self.policy.module, micro.sequences,
                                                      temperature=self.temperature, with_entropy=self.log_entropy)
            else:  # one student forward gives the log-probs and the top-k distillation term
                logprobs, entropy, term, extra = self.topk(self.policy.module, micro.sequences, num_units,
                                                           with_entropy=self.log_entropy, routes=micro.routes)
            if weigh_here:
                micro = self.correction.in_update(micro, logprobs)
            if first and (weigh_here or self.correction is None):  # the trainer's log-probs against the engine's
                engine = micro.rollout_logprobs if weigh_here else micro.old_logprobs
                pad = (0, width - mask.shape[1])
                seen.append(tuple(F.pad(x, pad) for x in (logprobs.detach(), engine, mask)))
            loss, metrics = objective(logprobs, micro, num_units)
            if term is not None:
                loss = loss + term.to(loss.dtype)
                metrics.update(extra)
            metrics["policy/loss"] = loss.detach()
            gap = (logprobs.detach() - micro.old_logprobs).abs()
            metrics["rollout/logprob_gap"] = aggregate_loss(gap, mask, loss_agg_mode=shares, num_units=num_units)
            if entropy is not None:
                metrics["policy/entropy"] = aggregate_loss(entropy.detach(), mask, loss_agg_mode=shares,
                                                           num_units=num_units)
            return loss, metrics

        metrics = trainer.accumulate_and_step(self.policy, minibatch.micro_batches(self.micro_batch_size), loss_fn,
                                              count=lambda micro: loss_units(micro.sequences.action_mask,
                                                                             self.loss_agg_mode))
        if first:  # the gap is only meaningful before the rollout's first update
            self.replay.metrics["rollout/logprob_gap"] = metrics["rollout/logprob_gap"]
            if seen:  # weighed here: the correction's and mismatch metrics over the rollout, as a rescore gives
                trainer_engine_mask = [torch.cat(parts) for parts in zip(*seen)]
                mismatch = self._max_over_ranks(self.correction.weigh(*trainer_engine_mask)[1] if weigh_here
                                                else mismatch_metrics(*trainer_engine_mask))
                self.replay.metrics.update(mismatch)  # repeated on the rollout's later minibatches
                metrics.update(mismatch)
        metrics["rollout/logprob_gap"] = self.replay.metrics["rollout/logprob_gap"]
        if self.topk is not None:  # routed teachers: distill/<route>/jsd over every rank's tokens of the step
            dist = self.policy.dist
            metrics.update(self.topk.route_metrics(
                device=dist.device, all_reduce_sum=dist.all_reduce_sum if dist.world_size > 1 else None))
        metrics["time/policy_update_seconds"] = torch.tensor(time.perf_counter() - start)
        return metrics

    def _max_over_ranks(self, metrics: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`metrics` with those of `algos.MAX_METRICS` replaced by their maximum over the data-parallel ranks (so
        the loop's mean over ranks keeps the maximum)."""
        dist = self.policy.dist
        for name in MAX_METRICS & set(metrics):
            if dist.world_size > 1:
                metrics[name] = dist.all_reduce_max(metrics[name].reshape(()).to(dist.device))
        return metrics

    def collection_state(self) -> dict:
        """What a checkpoint holds that collecting a rollout advances: the experience source's state (sampling RNG,
        partial rollouts in flight), the data sampler's position and the process's global RNGs (copies; a source or
        sampler without a `state_dict`, which no checkpoint could hold either, is left out)."""
        source, sampler = (getattr(part, "state_dict", None) for part in (self.experience, self.data_sampler))
        return {"source": None if source is None else source(),
                "data_sampler": None if sampler is None else sampler(), "rng": capture_rng_state()}

    def load_collection_state(self, state: dict) -> None:
        """Put back a `collection_state()`."""
        if state["source"] is not None:
            self.experience.load_state_dict(state["source"])
        if state["data_sampler"] is not None:
            self.data_sampler.load_state_dict(state["data_sampler"])
        restore_rng_state(state["rng"])

    def state_dict(self) -> dict:
        """Exact-resume state: the experience source's (sampling RNG) and the replay's (shuffling RNG, the rollout
        in progress with its pinned targets and its minibatches not yet replayed)."""
        return {**self.experience.state_dict(), **self.replay.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Inverse of `state_dict` (tensors are moved to this rank's device)."""
        self.experience.load_state_dict(state)
        self.replay.load_state_dict(state, self.policy.dist.device)

    def resized_state(self, states: list[dict], rank: int, world_size: int) -> dict:
        """This rank's state when a checkpoint written by `len(states)` ranks resumes on `world_size` ranks: its own
        saved state when it had one, else the state it was built with (its RNGs seeded by train.seed and its rank).
        The groups in flight of partial rollouts (`rollout.partial`) and the batches generated ahead one step off
        (`rollout.placement` separate) saved by ranks that the smaller job lacks are dropped, with a warning (on
        rank 0) saying how many.

        Raises:
            CheckpointError: when a rollout was in progress on some rank (each rank's rollout holds its own share
                of the prompts, which cannot be dealt out again over another number of ranks).
        """
        for old_rank, state in enumerate(states):
            pending = RolloutReplay.pending_minibatches(state)
            if pending:
                raise CheckpointError(
                    f"saved in the middle of a rollout ({pending} minibatches still to replay on rank {old_rank}), "
                    f"which cannot be split over {world_size} ranks; resume with {len(states)} processes, or from a "
                    "checkpoint saved when a rollout was finished (checkpoint.save_steps a multiple of the optimizer "
                    "steps per rollout)")
        gone = sum(len(state.get("partial_rollouts", {}).get("groups", ())) for state in states[world_size:])
        if gone and rank == 0:
            warnings.warn(f"rollout.partial: the {gone} group(s) in flight on the {len(states) - world_size} rank(s) "
                          f"this job of {world_size} lacks are dropped (their prompts were drawn and are not drawn "
                          f"again; resume with {len(states)} processes to continue them)", stacklevel=2)
        ahead = sum(len((state.get("one_step_off") or {}).get("records", ())) for state in states[world_size:])
        if ahead and rank == 0:
            warnings.warn(f"rollout.placement: the {ahead} prompt(s) generated ahead on the {len(states) - world_size} "
                          f"rank(s) this job of {world_size} lacks are dropped (their prompts were drawn and are not "
                          f"drawn again; resume with {len(states)} processes to train on them)", stacklevel=2)
        return states[rank] if rank < len(states) else self.state_dict()

    def checkpoint_parts(self) -> dict[str, Part]:
        """The policy (Hugging Face layout), its optimizer and schedule, the data position (global, the same on
        every rank: written once) and this learner's own state (per rank)."""
        return {**self.policy.checkpoint_parts("policy", kind="hf_model"),
                "data_sampler": Part(self.data_sampler, "json"),
                "strategy_state": Part(self, per_rank=True)}
