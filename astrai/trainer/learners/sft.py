"""sft: supervised fine-tuning on chat data, masked next-token cross-entropy over the assistant tokens.

Each record holds a `messages` list (role/content); `astrai.data.examples.chat_example` labels exactly the
assistant turns through their end-of-turn stop token (everything else is ignored, -100); contents are encoded
as text. Longer chats keep their first `data.max_length` tokens; optional packing concatenates whole chats and
cuts them into `data.max_length` rows whose documents do not attend to each other. The step is shared with `seq`
(pre-training): `NextTokenLearner` draws `gradient_accumulation_steps` micro-batches of
`per_device_train_batch_size` examples, divides the summed token cross-entropy by the GLOBAL number of labelled
tokens of the step (all micro-batches, all ranks), and makes one policy optimizer step. The LM head runs only at
the labelled positions (`AutoRegressiveLM.forward(logits_at=...)`), which gives the same loss and gradients as the
full logits.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from astrai.algos import logprobs_from_logits, token_cross_entropy
from astrai.checkpoint import Part
from astrai.data import DataError, PromptSampler
from astrai.data.examples import IGNORE_INDEX, LMBatch, chat_example, collate_lm, pack_examples
from astrai.data.records import load_records
from astrai.models.special_tokens import stop_token_ids
from astrai.trainer.models import TrainedModel, build_trained_model


class SupervisedLearner:
    """Base of the train types whose only state besides the policy is their data position (sft, seq, dpo): each
    `train_step` draws `accumulation_steps` micro-batches of `micro_batch_size` records and makes one policy
    optimizer step.

    Args:
        policy: the trained policy.
        sampler: endless resumable sampler over the examples (`PromptSampler` over a list).
        micro_batch_size: examples per forward/backward; accumulation_steps: micro-batches per step.
    """

    def __init__(self, *, policy: TrainedModel, sampler, micro_batch_size: int, accumulation_steps: int):
        self.policy, self.data_sampler = policy, sampler
        self.micro_batch_size, self.accumulation_steps = micro_batch_size, accumulation_steps

    rollout_engine = None  # no rollouts

    def draw(self) -> list[list]:
        """The step's `accumulation_steps` lists of `micro_batch_size` records."""
        return [self.data_sampler.next_batch(self.micro_batch_size) for _ in range(self.accumulation_steps)]

    def state_dict(self) -> dict:
        """No state of its own: the data sampler (a checkpoint part) holds the position."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore (see `state_dict`)."""

    def checkpoint_parts(self) -> dict[str, Part]:
        """The policy (Hugging Face layout), its optimizer and schedule, and the data position (global, the same
        on every rank: written once). A dpo reference model is the frozen initial policy, so it is not saved."""
        return {**self.policy.checkpoint_parts("policy", kind="hf_model"),
                "data_sampler": Part(self.data_sampler, "json")}


class NextTokenLearner(SupervisedLearner):
    """One `train_step` = one policy optimizer step of token cross-entropy (sft and seq).

    Args:
        pad_token_id: padding id of the collated batches; the rest as `SupervisedLearner`.
    """

    def __init__(self, *, policy: TrainedModel, sampler, micro_batch_size: int, accumulation_steps: int,
                 pad_token_id: int):
        super().__init__(policy=policy, sampler=sampler, micro_batch_size=micro_batch_size,
                         accumulation_steps=accumulation_steps)
        self.pad_token_id = pad_token_id

    def train_step(self, trainer) -> dict[str, torch.Tensor]:
        """Accumulate the token-mean cross-entropy over the micro-batches, then one optimizer step.

        Metrics: `train/loss` (this rank's token mean), `train/tokens` (global labelled tokens),
        `policy/grad_norm`, `policy/lr`, and the MoE auxiliary-loss metrics when the model has them.
        """
        device = self.policy.dist.device
        batches = [collate_lm(records, pad_token_id=self.pad_token_id, device=device) for records in self.draw()]
        seen: dict[str, torch.Tensor] = {}

        def loss_fn(batch: LMBatch, num_tokens: torch.Tensor):
            seen["train/tokens"] = num_tokens.float()
            mask = batch.loss_mask  # (B, S - 1): the logits at position s score labels[:, s + 1]
            # the LM head only at the labelled positions: logits (N, V), N = mask.sum()
            logits = self.policy.module(batch.input_ids, attention_mask=batch.attention_mask,
                                        position_ids=batch.position_ids, document_ids=batch.document_ids,
                                        logits_at=torch.nn.functional.pad(mask, (0, 1)))
            picked = logprobs_from_logits(logits, batch.labels[:, 1:][mask])
            logprobs = torch.zeros(mask.shape, dtype=picked.dtype, device=picked.device).masked_scatter(mask, picked)
            return token_cross_entropy(logprobs, mask, num_tokens=num_tokens)

        metrics = trainer.accumulate_and_step(self.policy, batches, loss_fn,
                                              count=lambda batch: batch.loss_mask.sum())
        return dict(metrics, **seen)


def build_examples(rows: Sequence, make, *, packing: bool, max_length: int, source: str,
                   truncation: str = "error", log=print) -> list:
    """(ids, labels) examples from `rows` via `make(row, where)` (whole examples when `packing`, which then cuts
    their concatenation into `max_length` rows with document ids, and drops the rows left without a labelled
    token). Without packing, an example whose labelled tokens all lie beyond `max_length` would train on nothing:
    such examples are counted and refused, or dropped and reported (through `log`) when `truncation` is filter.

    Raises:
        DataError: examples cut to no labelled token (their count and first row, unless `truncation` is filter),
            or none left at all.
    """
    examples = [make(row, f"{source} row {i + 1}") for i, row in enumerate(rows)]
    labelled = lambda e: any(t != IGNORE_INDEX for t in e[1][1:])  # noqa: E731
    if packing:
        examples = [e for e in pack_examples(examples, max_length=max_length) if labelled(e)]
    else:
        empty = [i + 1 for i, e in enumerate(examples) if not labelled(e)]
        if empty and truncation != "filter" and len(empty) < len(examples):
            raise DataError(f"{source}: {len(empty)} of {len(examples)} examples keep no labelled token within "
                            f"data.max_length={max_length} (first row {empty[0]}): they would train on nothing; "
                            "raise data.max_length, fix the data, or set data.truncation filter to drop them")
        if empty and len(empty) < len(examples):
            log(f"data.truncation=filter: dropped {len(empty)} of {len(examples)} examples of {source} that keep no "
                f"labelled token within data.max_length={max_length}")
        examples = [e for e in examples if labelled(e)]
    if not examples:
        raise DataError(f"{source}: no example keeps a labelled token within data.max_length={max_length}")
    return examples


def build_next_token(config, dist, policy, tokenizer, examples: list) -> NextTokenLearner:
    """NextTokenLearner over `examples` with the policy optimizer and a seeded, resumable sampler."""
    trained = build_trained_model(config, dist, policy, name="policy")
    sampler = PromptSampler(examples, seed=config.train.seed, shuffle=config.data.shuffle, rank=dist.rank,
                            world_size=dist.world_size)
    return NextTokenLearner(policy=trained, sampler=sampler, micro_batch_size=config.train.per_device_train_batch_size,
                             accumulation_steps=config.train.gradient_accumulation_steps,
                             pad_token_id=tokenizer.pad_token_id)


def sft_data(config, model_config, tokenizer, *, main: bool = True) -> list:
    """The sft examples of `data.path` (records with a `data.messages_field` chat), tokenised, labelled and
    packed or cut as `data.packing` / `data.max_length` say. Raises DataError for bad data."""
    d = config.data
    rows = load_records(d.path, {"data.messages_field": d.messages_field})
    stops = stop_token_ids(model_config, tokenizer)
    return build_examples(
        rows, lambda row, where: chat_example(_with_system(row[d.messages_field], d.system_prompt), tokenizer,
                                              max_length=None if d.packing else d.max_length, stops=stops,
                                              where=where),
        packing=d.packing, max_length=d.max_length, source=d.path, truncation=d.truncation,
        log=print if main else _quiet)


def build_sft(config, dist, policy, tokenizer) -> NextTokenLearner:
    """sft from `data.path` records with a `data.messages_field` chat (`sft_data`). Raises DataError for bad
    data."""
    return build_next_token(config, dist, policy, tokenizer, sft_data(config, policy.config, tokenizer,
                                                                      main=dist.is_main))


def _with_system(messages, system_prompt: Optional[str]):
    """Prepend `system_prompt` as a system turn unless the chat already starts with one."""
    if not system_prompt or not isinstance(messages, list) or (messages and isinstance(messages[0], dict)
                                                               and messages[0].get("role") == "system"):
        return messages
    return [{"role": "system", "content": system_prompt}] + list(messages)


def _quiet(message: str) -> None:
    """A log that prints nothing (ranks other than the main one)."""
