"""dpo: Direct Preference Optimization against a frozen reference (Rafailov et al. 2023).

Each record holds a prompt and a chosen and a rejected response (strings). The prompt goes through the chat
template like online rollouts; each response is its text's tokens + the end-of-turn id
(`special_tokens.response_end_id`). Chosen and rejected rows of a micro-batch
share one forward in the rollout layout (`sequences_from_tokens`) and are scored by the same
`response_logprobs` as RL (temperature 1); the sequence log-prob is the sum over real response tokens. The loss
(`algos.dpo_loss`) is divided by the GLOBAL number of pairs of the optimizer step (all micro-batches, all
ranks). The reference is a frozen copy of the initial policy.
"""

from __future__ import annotations

from typing import Optional

import torch

from astrai.algos import dpo_loss, masked_sum
from astrai.data.examples import sequences_from_tokens
from astrai.rollout.scoring import response_logprobs
from astrai.trainer.strategies.common import (SamplerOnlyState, accumulate, add_aux_loss,
                                              prompt_ids_and_budget)


def sequence_logps(model, prompts, responses, *, pad_token_id: int, device) -> torch.Tensor:
    """Summed response log-probs (len(prompts),) float32 of `responses` after `prompts` under `model`."""
    seqs = sequences_from_tokens(prompts, responses, pad_token_id=pad_token_id, device=device)
    logprobs, _ = response_logprobs(model, seqs, temperature=1.0)
    return masked_sum(logprobs, seqs.action_mask, dim=-1)


class DPOStrategy(SamplerOnlyState):
    """One `train_step` = one DPO optimizer step over `accumulation_steps` micro-batches of pairs.

    Args:
        policy: trainable `AutoRegressiveLM` (possibly DDP-wrapped); ref_model: frozen reference.
        sampler: endless resumable sampler over (prompt ids, chosen ids, rejected ids) triples.
        optimizer, scheduler: the policy's AdamW and LR schedule.
        beta, label_smoothing: DPO scalars; micro_batch_size: pairs per forward; accumulation_steps.
        pad_token_id, dist, extras: padding id, `DistributedContext`, more checkpoint objects.
    """

    def __init__(self, *, policy, ref_model, sampler, optimizer, scheduler, beta: float, label_smoothing: float,
                 micro_batch_size: int, accumulation_steps: int, pad_token_id: int, dist,
                 extras: Optional[dict] = None):
        self.policy, self.ref_model, self.sampler, self.dist = policy, ref_model, sampler, dist
        self.optimizer, self.scheduler = optimizer, scheduler
        self.beta, self.label_smoothing = beta, label_smoothing
        self.micro_batch_size, self.accumulation_steps = micro_batch_size, accumulation_steps
        self.pad_token_id = pad_token_id
        self.extras = extras or {}

    def pair_loss(self, triples, num_pairs: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """DPO loss share of one micro-batch of (prompt, chosen, rejected) token triples."""
        prompts = [t[0] for t in triples] * 2
        responses = [t[1] for t in triples] + [t[2] for t in triples]
        kwargs = dict(pad_token_id=self.pad_token_id, device=self.dist.device)
        logps = sequence_logps(self.policy, prompts, responses, **kwargs)
        with torch.no_grad():
            ref = sequence_logps(self.ref_model, prompts, responses, **kwargs)
        n = len(triples)
        return dpo_loss(logps[:n], logps[n:], ref[:n], ref[n:], beta=self.beta,
                        label_smoothing=self.label_smoothing, num_pairs=num_pairs)

    def train_step(self, trainer) -> dict[str, torch.Tensor]:
        """Accumulate the DPO loss over the micro-batches, then one optimizer step.

        Metrics: `train/loss`, `dpo/*` (this rank's pair means), `policy/grad_norm`, `policy/lr`.
        """
        micro = [self.sampler.next_batch(self.micro_batch_size) for _ in range(self.accumulation_steps)]
        local = torch.tensor(self.micro_batch_size * self.accumulation_steps, device=self.dist.device)
        total = self.dist.all_reduce_sum(local)
        sums: dict[str, torch.Tensor] = {}
        for triples in micro:
            loss, metrics = self.pair_loss(triples, total)
            with_aux, aux = add_aux_loss(self.dist.unwrap(self.policy), loss, len(micro), self.dist.loss_scale())
            (with_aux * self.dist.loss_scale()).backward()
            accumulate(sums, dict(metrics, **{"train/loss": loss}), weight=total / local)
            accumulate(sums, aux)
        sums["policy/grad_norm"] = trainer.optimizer_step("policy", self.dist.unwrap(self.policy),
                                                          self.optimizer, self.scheduler)
        sums["policy/lr"] = torch.tensor(self.scheduler.get_last_lr()[0])
        trainer.state.consumed_samples += int(local) * self.dist.world_size
        return sums


def preference_triples(rows, tokenizer, config, *, end_id: int) -> list[tuple[list[int], list[int], list[int]]]:
    """(prompt ids, chosen ids, rejected ids) per record; responses are their text's tokens plus `end_id`,
    truncated to fit `data.max_length`; records whose prompt `data.truncation=filter` drops are left out.

    Raises:
        DataError: a non-string field (naming the row and config key) or an overlong prompt (`prompt_ids_and_budget`).
    """
    from astrai.data.examples import response_tokens
    from astrai.data.records import require_str

    d = config.data
    out = []
    for i, row in enumerate(rows):
        where = f"{d.path} row {i + 1}"
        prompt = require_str(row, d.prompt_field, "data.prompt_field", where)
        chosen = require_str(row, d.chosen_field, "data.chosen_field", where)
        rejected = require_str(row, d.rejected_field, "data.rejected_field", where)
        fitted = prompt_ids_and_budget(prompt, tokenizer, d, where)
        if fitted is None:
            continue
        ids, budget = fitted
        out.append((ids, response_tokens(chosen, tokenizer, budget=budget, end_id=end_id),
                    response_tokens(rejected, tokenizer, budget=budget, end_id=end_id)))
    return out


def build_dpo(config, dist, policy, tokenizer) -> DPOStrategy:
    """dpo from `data.path` records with prompt / chosen / rejected fields. Raises DataError for bad data."""
    from astrai.data import PromptSampler
    from astrai.data.records import load_records
    from astrai.models.special_tokens import response_end_id, stop_token_ids
    from astrai.trainer.strategies.common import build_policy_optimizer, frozen_copy, report_dropped

    d = config.data
    rows = load_records(d.path, {"data.prompt_field": d.prompt_field, "data.chosen_field": d.chosen_field,
                                 "data.rejected_field": d.rejected_field})
    end_id = response_end_id(tokenizer, stop_token_ids(policy.config, tokenizer))
    triples = preference_triples(rows, tokenizer, config, end_id=end_id)
    report_dropped(len(triples), len(rows), source=d.path, dist=dist)
    policy = policy.to(dist.device)
    ref_model = frozen_copy(policy)
    optimizer, scheduler = build_policy_optimizer(config, policy)
    sampler = PromptSampler(triples, seed=config.train.seed + dist.rank, shuffle=config.data.shuffle)
    return DPOStrategy(policy=dist.prepare_model(policy), ref_model=ref_model, sampler=sampler,
                       optimizer=optimizer, scheduler=scheduler, beta=config.dpo.beta,
                       label_smoothing=config.dpo.label_smoothing,
                       micro_batch_size=config.train.per_device_train_batch_size,
                       accumulation_steps=config.train.gradient_accumulation_steps,
                       pad_token_id=tokenizer.pad_token_id, dist=dist, extras={"tokenizer": tokenizer})
