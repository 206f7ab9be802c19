"""sft: supervised fine-tuning on chat data, masked next-token cross-entropy over the assistant tokens.

Each record holds a `messages` list (role/content); `astrai.data.examples.chat_example` labels exactly the
assistant turns through their end-of-turn stop token (everything else is ignored, -100); contents are encoded
as text. Longer chats keep their first `data.max_length` tokens; optional packing concatenates whole chats and
cuts them into `data.max_length` rows whose documents do not attend to each other. The step is shared with `seq` (pre-training): `NextTokenStrategy` draws
`gradient_accumulation_steps` micro-batches of `per_device_train_batch_size` examples, divides the summed
token cross-entropy by the GLOBAL number of labelled tokens of the step (all micro-batches, all ranks), and
makes one policy optimizer step.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from astrai.algos import logprobs_from_logits, token_cross_entropy
from astrai.data.examples import collate_lm
from astrai.trainer.strategies.common import SamplerOnlyState, accumulate, add_aux_loss, token_counts


class NextTokenStrategy(SamplerOnlyState):
    """One `train_step` = one policy optimizer step of token cross-entropy (sft and seq).

    Args:
        policy: trainable `AutoRegressiveLM` (possibly DDP-wrapped).
        sampler: endless resumable sampler over (ids, labels) examples (`PromptSampler` over a list).
        optimizer, scheduler: the policy's AdamW and LR schedule.
        micro_batch_size: examples per forward/backward; accumulation_steps: micro-batches per step.
        pad_token_id: padding id of the collated batches.
        dist: `DistributedContext`.
        extras: more checkpoint objects (tokenizer).
    """

    def __init__(self, *, policy, sampler, optimizer, scheduler, micro_batch_size: int, accumulation_steps: int,
                 pad_token_id: int, dist, extras: Optional[dict] = None):
        self.policy, self.sampler, self.dist = policy, sampler, dist
        self.optimizer, self.scheduler = optimizer, scheduler
        self.micro_batch_size, self.accumulation_steps = micro_batch_size, accumulation_steps
        self.pad_token_id = pad_token_id
        self.extras = extras or {}

    def micro_batches(self) -> list:
        """The step's `accumulation_steps` collated `LMBatch`es, on the device."""
        return [collate_lm(self.sampler.next_batch(self.micro_batch_size), pad_token_id=self.pad_token_id,
                           device=self.dist.device) for _ in range(self.accumulation_steps)]

    def train_step(self, trainer) -> dict[str, torch.Tensor]:
        """Accumulate the token-mean cross-entropy over the micro-batches, then one optimizer step.

        Metrics: `train/loss` (this rank's token mean), `train/tokens` (global labelled tokens),
        `policy/grad_norm`, `policy/lr`, and the MoE auxiliary-loss metrics when the model has them.
        """
        batches = self.micro_batches()
        local, total = token_counts(torch.stack([b.loss_mask.sum() for b in batches]), self.dist)
        sums: dict[str, torch.Tensor] = {}
        for batch in batches:
            logits = self.policy(batch.input_ids, attention_mask=batch.attention_mask,
                                 position_ids=batch.position_ids, document_ids=batch.document_ids)
            logprobs = logprobs_from_logits(logits[:, :-1], batch.labels[:, 1:].clamp(min=0))
            loss, metrics = token_cross_entropy(logprobs, batch.loss_mask, num_tokens=total)
            loss, aux = add_aux_loss(self.dist.unwrap(self.policy), loss, len(batches),
                                     self.dist.loss_scale())
            (loss * self.dist.loss_scale()).backward()
            accumulate(sums, metrics, weight=total / local)
            accumulate(sums, aux)
        sums["train/tokens"] = total.float()
        sums["policy/grad_norm"] = trainer.optimizer_step("policy", self.dist.unwrap(self.policy),
                                                          self.optimizer, self.scheduler)
        sums["policy/lr"] = torch.tensor(self.scheduler.get_last_lr()[0])
        trainer.state.consumed_samples += self.micro_batch_size * self.accumulation_steps * self.dist.world_size
        return sums


def build_examples(rows: Sequence, make, *, packing: bool, max_length: int, source: str) -> list:
    """(ids, labels) examples from `rows` via `make(row, where)` (whole examples when `packing`, which then cuts
    their concatenation into `max_length` rows with document ids); drops examples without a labelled token.
    Raises DataError when none is left."""
    from astrai.data import DataError
    from astrai.data.examples import IGNORE_INDEX, pack_examples

    examples = [make(row, f"{source} row {i + 1}") for i, row in enumerate(rows)]
    if packing:
        examples = pack_examples(examples, max_length=max_length)
    examples = [e for e in examples if any(t != IGNORE_INDEX for t in e[1][1:])]
    if not examples:
        raise DataError(f"{source}: no example keeps a labelled token within data.max_length={max_length}")
    return examples


def build_next_token(config, dist, policy, tokenizer, examples: list) -> NextTokenStrategy:
    """NextTokenStrategy over `examples` with the policy optimizer and a seeded, resumable sampler."""
    from astrai.data import PromptSampler
    from astrai.trainer.strategies.common import build_policy_optimizer

    policy = policy.to(dist.device)
    optimizer, scheduler = build_policy_optimizer(config, policy)
    sampler = PromptSampler(examples, seed=config.train.seed + dist.rank, shuffle=config.data.shuffle)
    return NextTokenStrategy(policy=dist.prepare_model(policy), sampler=sampler, optimizer=optimizer,
                             scheduler=scheduler, micro_batch_size=config.train.per_device_train_batch_size,
                             accumulation_steps=config.train.gradient_accumulation_steps,
                             pad_token_id=tokenizer.pad_token_id, dist=dist, extras={"tokenizer": tokenizer})


def build_sft(config, dist, policy, tokenizer) -> NextTokenStrategy:
    """sft from `data.path` records with a `data.messages_field` chat. Raises DataError for bad data."""
    from astrai.data.examples import chat_example
    from astrai.data.records import load_records
    from astrai.models.special_tokens import stop_token_ids

    d = config.data
    rows = load_records(d.path, {"data.messages_field": d.messages_field})
    stops = stop_token_ids(policy.config, tokenizer)
    examples = build_examples(
        rows, lambda row, where: chat_example(_with_system(row[d.messages_field], d.system_prompt), tokenizer,
                                              max_length=None if d.packing else d.max_length, stops=stops,
                                              where=where),
        packing=d.packing, max_length=d.max_length, source=d.path)
    return build_next_token(config, dist, policy, tokenizer, examples)


def _with_system(messages, system_prompt: Optional[str]):
    """Prepend `system_prompt` as a system turn unless the chat already starts with one."""
    if not system_prompt or not isinstance(messages, list) or (messages and isinstance(messages[0], dict)
                                                               and messages[0].get("role") == "system"):
        return messages
    return [{"role": "system", "content": system_prompt}] + list(messages)
