"""rm: reward-model training on preference pairs (Bradley-Terry; Ouyang et al. 2022, InstructGPT section 3.5).

Each record holds a prompt and a chosen and a rejected response (strings), as for dpo, and optionally a margin
(`data.margin_field`: Llama 2's margin, Touvron et al. 2023, section 3.2.2). The model is the policy's trunk with
a zero-initialised scalar `score` head (`models.RewardModel`); chosen and rejected rows of a micro-batch share one
forward in the rollout layout (`Sequences.from_tokens`: prompt rendered as dpo's + response tokens + end of turn),
each scored at its last real token. The loss (`algos.bradley_terry_loss`) is divided by the GLOBAL number of pairs of
the optimizer step. Its checkpoints hold the reward model in transformers' `...ForSequenceClassification` layout,
which `reward.model_path` of an online job (or transformers) loads.
"""

from __future__ import annotations

import math

import torch

from astrai.algos import bradley_terry_loss
from astrai.data import DataError, PromptSampler
from astrai.data.records import load_records
from astrai.data.sequences import Sequences
from astrai.models import RewardModel
from astrai.models.special_tokens import response_end_id, stop_token_ids
from astrai.trainer.models import TrainedModel, build_trained_model
from astrai.trainer.learners.dpo import preference_triples
from astrai.trainer.learners.sft import SupervisedLearner


class RewardModelLearner(SupervisedLearner):
    """One `train_step` = one optimizer step of the Bradley-Terry loss over `accumulation_steps` micro-batches of
    (prompt ids, chosen ids, rejected ids, margin) pairs.

    Args:
        policy: the trained reward model (`TrainedModel` of a `RewardModel`; the loop's "policy").
        sampler, micro_batch_size, accumulation_steps: as `SupervisedLearner`; pad_token_id: padding id.
    """

    def __init__(self, *, policy: TrainedModel, sampler, micro_batch_size: int, accumulation_steps: int,
                 pad_token_id: int):
        super().__init__(policy=policy, sampler=sampler, micro_batch_size=micro_batch_size,
                         accumulation_steps=accumulation_steps)
        self.pad_token_id = pad_token_id

    def pair_loss(self, pairs, num_pairs: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Bradley-Terry loss share of one micro-batch, with `train/loss` and the `rm/*` metrics."""
        prompts = [p[0] for p in pairs] * 2
        responses = [p[1] for p in pairs] + [p[2] for p in pairs]
        seqs = Sequences.from_tokens(prompts, responses, pad_token_id=self.pad_token_id, device=self.policy.dist.device)
        rewards = self.policy.module(seqs.input_ids, seqs.attention_mask, seqs.position_ids)
        n = len(pairs)
        margin = torch.tensor([p[3] for p in pairs], dtype=rewards.dtype, device=rewards.device)
        loss, metrics = bradley_terry_loss(rewards[:n], rewards[n:], margin=margin, num_pairs=num_pairs)
        return loss, dict(metrics, **{"train/loss": loss.detach()})

    def train_step(self, trainer) -> dict[str, torch.Tensor]:
        """Accumulate the loss over the micro-batches, then one optimizer step. Metrics: `train/loss`, `rm/accuracy`,
        `rm/margin`, `rm/chosen_reward`, `rm/rejected_reward` (this rank's pair means), `policy/grad_norm`,
        `policy/lr`."""
        device = self.policy.dist.device
        return trainer.accumulate_and_step(self.policy, self.draw(), self.pair_loss,
                                           count=lambda pairs: torch.tensor(len(pairs), device=device))


def _quiet(message: str) -> None:
    """A log that prints nothing (ranks other than the main one)."""


def rm_data(config, model_config, tokenizer, *, main: bool = True) -> list:
    """(prompt ids, chosen ids, rejected ids, margin) per record of `data.path` (prompt, chosen, rejected and the
    optional `data.margin_field`), tokenised as dpo's; the main rank reports rows the length policy dropped.

    Raises:
        DataError: bad data, or a margin that is not a finite number (naming the row).
    """
    d = config.data
    optional = {"data.margin_field": d.margin_field} if d.margin_field else {}
    rows = load_records(d.path, {"data.prompt_field": d.prompt_field, "data.chosen_field": d.chosen_field,
                                 "data.rejected_field": d.rejected_field}, optional=optional)
    margins = []
    for i, row in enumerate(rows, start=1):
        value = row.get(d.margin_field, 0.0) if d.margin_field else 0.0
        value = 0.0 if value is None else value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise DataError(f"{d.path} row {i}: field {d.margin_field!r} (data.margin_field) must be a finite number, "
                            f"got {value!r}")
        margins.append(float(value))
    end_id = response_end_id(tokenizer, stop_token_ids(model_config, tokenizer))
    triples = preference_triples(rows, tokenizer, config, end_id=end_id, keep_index=True,
                                 log=print if main else _quiet)
    return [(p, c, r, margins[i]) for i, p, c, r in triples]


def build_rm(config, dist, policy, tokenizer) -> RewardModelLearner:
    """rm from `data.path` preference records (`rm_data`): a `RewardModel` warm-started from the policy's trunk,
    its AdamW and schedule. Raises DataError for bad data."""
    pairs = rm_data(config, policy.config, tokenizer, main=dist.is_main)
    trained = build_trained_model(config, dist, RewardModel.from_policy(policy.to(dist.device)), name="policy")
    sampler = PromptSampler(pairs, seed=config.train.seed, shuffle=config.data.shuffle, rank=dist.rank,
                            world_size=dist.world_size)
    return RewardModelLearner(policy=trained, sampler=sampler, micro_batch_size=config.train.per_device_train_batch_size,
                               accumulation_steps=config.train.gradient_accumulation_steps,
                               pad_token_id=tokenizer.pad_token_id)
