"""dpo: Direct Preference Optimization against a frozen reference (Rafailov et al. 2023).

Each record holds a prompt and a chosen and a rejected response (strings). The prompt is rendered like online
rollouts (the chat template or raw text, `data.chat_template`); each response is its text's tokens + the end-of-turn id
(`special_tokens.response_end_id`). Chosen and rejected rows of a micro-batch
share one forward in the rollout layout (`Sequences.from_tokens`) and are scored by the same
`response_logprobs` as RL (temperature 1); the sequence log-prob is the sum over real response tokens. The loss
(`algos.dpo_loss`) is divided by the GLOBAL number of pairs of the optimizer step (all micro-batches, all
ranks). The reference is a frozen copy of the initial policy.
"""

from __future__ import annotations

import torch

from astrai.algos import dpo_loss, masked_sum
from astrai.data import DataError, PromptSampler
from astrai.data.examples import response_tokens
from astrai.data.records import load_records, require_str
from astrai.data.sequences import Sequences
from astrai.data.truncation import prompt_ids_and_budget, report_dropped
from astrai.models.special_tokens import response_end_id, stop_token_ids
from astrai.forward import response_logprobs
from astrai.trainer.models import TrainedModel, build_trained_model, reference_model
from astrai.trainer.learners.sft import SupervisedLearner


def sequence_logps(model, prompts, responses, *, pad_token_id: int, device) -> torch.Tensor:
    """Summed response log-probs (len(prompts),) float32 of `responses` after `prompts` under `model`."""
    seqs = Sequences.from_tokens(prompts, responses, pad_token_id=pad_token_id, device=device)
    logprobs, _ = response_logprobs(model, seqs, temperature=1.0)
    return masked_sum(logprobs, seqs.action_mask, dim=-1)


class DPOLearner(SupervisedLearner):
    """One `train_step` = one DPO optimizer step over `accumulation_steps` micro-batches of pairs.

    Args:
        policy: the trained policy; ref_model: frozen reference.
        sampler: endless resumable sampler over (prompt ids, chosen ids, rejected ids) triples.
        beta, label_smoothing: DPO scalars; micro_batch_size: pairs per forward; accumulation_steps.
        pad_token_id: padding id.
    """

    def __init__(self, *, policy: TrainedModel, ref_model, sampler, beta: float, label_smoothing: float,
                 micro_batch_size: int, accumulation_steps: int, pad_token_id: int):
        super().__init__(policy=policy, sampler=sampler, micro_batch_size=micro_batch_size,
                         accumulation_steps=accumulation_steps)
        self.ref_model, self.beta, self.label_smoothing = ref_model, beta, label_smoothing
        self.pad_token_id = pad_token_id

    def pair_loss(self, triples, num_pairs: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """DPO loss share of one micro-batch of (prompt, chosen, rejected) token triples, with `train/loss`."""
        prompts = [t[0] for t in triples] * 2
        responses = [t[1] for t in triples] + [t[2] for t in triples]
        kwargs = dict(pad_token_id=self.pad_token_id, device=self.policy.dist.device)
        logps = sequence_logps(self.policy.module, prompts, responses, **kwargs)
        with torch.no_grad():
            ref = sequence_logps(self.ref_model, prompts, responses, **kwargs)
        n = len(triples)
        loss, metrics = dpo_loss(logps[:n], logps[n:], ref[:n], ref[n:], beta=self.beta,
                                 label_smoothing=self.label_smoothing, num_pairs=num_pairs)
        return loss, dict(metrics, **{"train/loss": loss.detach()})

    def train_step(self, trainer) -> dict[str, torch.Tensor]:
        """Accumulate the DPO loss over the micro-batches, then one optimizer step.

        Metrics: `train/loss`, `dpo/*` (this rank's pair means), `policy/grad_norm`, `policy/lr`.
        """
        device = self.policy.dist.device
        return trainer.accumulate_and_step(self.policy, self.draw(), self.pair_loss,
                            count=lambda triples: torch.tensor(len(triples), device=device))


def preference_triples(rows, tokenizer, config, *, end_id: int, keep_index: bool = False, log=print) -> list[tuple]:
    """(prompt ids, chosen ids, rejected ids) per record (with `keep_index`, (row index, prompt ids, chosen ids,
    rejected ids)); responses are their text's tokens plus `end_id`, truncated to fit `data.max_length`; records
    whose prompt `data.truncation=filter` drops are left out.

    A pair whose chosen and rejected tokens are identical after truncation (their difference lies beyond the
    response budget, or the texts are equal) would train on no preference at all (loss ln 2, accuracy 0): such pairs
    are counted and refused, or dropped under `data.truncation=filter`. Each dropped record is reported (through
    `log`) once, under its reason: prompt length or identical pair.

    Raises:
        DataError: a non-string field (naming the row and config key), an overlong prompt
            (`prompt_ids_and_budget`), degenerate pairs (their count and first row), or no pair left after
            `filter` (both counts).
    """
    d = config.data
    out, degenerate, too_long = [], [], 0
    for i, row in enumerate(rows):
        where = f"{d.path} row {i + 1}"
        prompt = require_str(row, d.prompt_field, "data.prompt_field", where)
        chosen = require_str(row, d.chosen_field, "data.chosen_field", where)
        rejected = require_str(row, d.rejected_field, "data.rejected_field", where)
        fitted = prompt_ids_and_budget(prompt, tokenizer, d, where)
        if fitted is None:
            too_long += 1
            continue
        ids, budget = fitted
        pair = (ids, response_tokens(chosen, tokenizer, budget=budget, end_id=end_id),
                response_tokens(rejected, tokenizer, budget=budget, end_id=end_id))
        if pair[1] == pair[2]:
            degenerate.append(i + 1)
            continue
        out.append((i, *pair) if keep_index else pair)
    if degenerate and d.truncation != "filter":
        raise DataError(f"{d.path}: {len(degenerate)} of {len(rows)} pairs have identical chosen and rejected tokens "
                        f"within data.max_length={d.max_length} (equal texts, or their difference lies beyond the "
                        f"response budget; first row {degenerate[0]}): they would train on nothing; raise "
                        "data.max_length, fix the data, or set data.truncation filter to drop them")
    report_dropped(len(rows) - too_long, len(rows), source=d.path, log=log)  # each drop counted once, by reason
    if degenerate:
        log(f"data.truncation=filter: dropped {len(degenerate)} pairs of {d.path} whose chosen and rejected tokens "
            f"are identical within data.max_length={d.max_length}")
    if not out:
        raise DataError(f"{d.path}: no pair left to train on: data.truncation=filter dropped {too_long} of "
                        f"{len(rows)} for prompt length and {len(degenerate)} with identical chosen and rejected "
                        "tokens")
    return out


def _quiet(message: str) -> None:
    """A log that prints nothing (ranks other than the main one)."""


def dpo_data(config, model_config, tokenizer, *, main: bool = True) -> list:
    """The dpo preference triples of `data.path` (prompt, chosen, rejected fields), tokenised; the main rank
    reports rows dropped by `data.truncation=filter` (`preference_triples`). Raises DataError for bad data."""
    d = config.data
    rows = load_records(d.path, {"data.prompt_field": d.prompt_field, "data.chosen_field": d.chosen_field,
                                 "data.rejected_field": d.rejected_field})
    end_id = response_end_id(tokenizer, stop_token_ids(model_config, tokenizer))
    return preference_triples(rows, tokenizer, config, end_id=end_id, log=print if main else _quiet)


def build_dpo(config, dist, policy, tokenizer) -> DPOLearner:
    """dpo from `data.path` records with prompt / chosen / rejected fields. Raises DataError for bad data."""
    triples = dpo_data(config, policy.config, tokenizer, main=dist.is_main)
    policy = policy.to(dist.device)
    ref_model = reference_model(dist, policy, config)
    trained = build_trained_model(config, dist, policy, name="policy")
    sampler = PromptSampler(triples, seed=config.train.seed, shuffle=config.data.shuffle, rank=dist.rank,
                            world_size=dist.world_size)
    return DPOLearner(policy=trained, ref_model=ref_model, sampler=sampler, beta=config.dpo.beta,
                       label_smoothing=config.dpo.label_smoothing,
                       micro_batch_size=config.train.per_device_train_batch_size,
                       accumulation_steps=config.train.gradient_accumulation_steps,
                       pad_token_id=tokenizer.pad_token_id)
