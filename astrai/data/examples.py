"""Tokenised training examples for the offline train types, their packing, and batch collation.

- sft: `chat_example` renders a `messages` list through the tokenizer's chat template turn by turn and labels
  exactly the assistant turns' tokens (everything else is -100, the ignore index of cross-entropy).
- seq: `text_example` is the raw text's tokens plus EOS, all labelled.
- packing (`pack_examples`): examples are concatenated in order and cut into rows of `max_length` tokens
  (the "concatenate and chunk" packing of GPT-style pre-training). Rows attend across example boundaries
  (no block-diagonal mask), the usual approximation of packed training without varlen attention kernels.
- dpo / grpo: prompts go through the same chat-template encoding as online rollouts
  (`astrai.rollout.prompts.encode_prompts`); responses are their tokens plus EOS; `Sequences.from_tokens`
  (`astrai.data.sequences`) assembles prompt + response batches in the rollout layout (left-padded prompt,
  right-padded response), so log-probs are computed by the same `response_logprobs` as for rollouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from astrai.data.prompts import DataError

IGNORE_INDEX = -100
"""Label of positions that carry no loss."""


@dataclass(frozen=True)
class LMBatch:
    """A right-padded causal-LM batch.

    Attributes:
        input_ids: (B, S) int64, padded with the pad token.
        attention_mask: (B, S) bool, True on real tokens.
        position_ids: (B, S) int64, 0.. along each row's real tokens.
        labels: (B, S) int64 target of each position's token, IGNORE_INDEX where no loss; the logits at
            position s score `labels[:, s + 1]`.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor

    @property
    def loss_mask(self) -> torch.Tensor:
        """(B, S - 1) bool: True where `labels[:, 1:]` carries a loss."""
        return self.labels[:, 1:] != IGNORE_INDEX


def _check_messages(messages: Any, where: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: messages must be a non-empty list of {{role, content}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: message {i} must be an object with string 'role' and 'content'")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: no assistant message (nothing to learn)")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def chat_example(messages: Any, tokenizer, *, max_length: int, where: str = "example") -> tuple[list[int], list[int]]:
    """(token ids, labels) of a chat, labels = ids on assistant-turn tokens and IGNORE_INDEX elsewhere.

    The template is rendered for each growing prefix of the conversation; the text added by an assistant turn
    (after the generation prompt, through the end-of-turn token) is labelled. Truncated to `max_length`.

    Raises:
        DataError: malformed messages, no assistant turn, or a chat template that does not render
            incrementally (a later prefix does not extend the earlier text).
    """
    messages = _check_messages(messages, where)
    ids: list[int] = []
    labels: list[int] = []
    done = ""

    def add(text: str, learn: bool) -> None:
        nonlocal done
        if not text.startswith(done):
            raise DataError(f"{where}: the chat template does not render incrementally; cannot mask turns")
        piece = tokenizer.encode(text[len(done):])
        ids.extend(piece)
        labels.extend(piece if learn else [IGNORE_INDEX] * len(piece))
        done = text

    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            add(tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True), False)
            add(tokenizer.apply_chat_template(messages[:i + 1], add_generation_prompt=False), True)
    add(tokenizer.apply_chat_template(messages, add_generation_prompt=False), False)
    return ids[:max_length], labels[:max_length]


def text_example(text: str, tokenizer, *, max_length: int) -> tuple[list[int], list[int]]:
    """(ids, labels) of raw text for pre-training: its tokens + EOS, all labelled, truncated to `max_length`."""
    ids = (tokenizer.encode(text) + [tokenizer.eos_token_id])[:max_length]
    return ids, list(ids)


def pack_examples(examples: Sequence[tuple[list[int], list[int]]], *, max_length: int
                  ) -> list[tuple[list[int], list[int]]]:
    """Concatenate (ids, labels) examples in order and cut the stream into rows of `max_length` tokens
    (the last row may be shorter). Rows without any label are dropped."""
    ids = [t for example in examples for t in example[0]]
    labels = [t for example in examples for t in example[1]]
    rows = [(ids[i:i + max_length], labels[i:i + max_length]) for i in range(0, len(ids), max_length)]
    return [row for row in rows if any(t != IGNORE_INDEX for t in row[1][1:])]


def collate_lm(examples: Sequence[tuple[list[int], list[int]]], *, pad_token_id: int,
               device: torch.device | str = "cpu") -> LMBatch:
    """Right-pad (ids, labels) examples into an `LMBatch` (S = the longest example).

    Raises:
        ValueError: for an empty list, an empty example, or ids and labels of different lengths.
    """
    if not examples or any(len(ids) == 0 or len(ids) != len(labels) for ids, labels in examples):
        raise ValueError("collate_lm: expected non-empty examples with as many labels as ids")
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.bool)
    for row, (ids, labs) in enumerate(examples):
        input_ids[row, :len(ids)] = torch.tensor(ids)
        labels[row, :len(labs)] = torch.tensor(labs)
        mask[row, :len(ids)] = True
    position_ids = (mask.long().cumsum(1) - 1).clamp(min=0)
    return LMBatch(input_ids=input_ids.to(device), attention_mask=mask.to(device),
                   position_ids=position_ids.to(device), labels=labels.to(device))


def response_tokens(text: str, tokenizer, *, budget: int) -> list[int]:
    """Tokens of a response plus EOS, truncated to `budget` (>= 1) tokens."""
    return (tokenizer.encode(text) + [tokenizer.eos_token_id])[:max(1, budget)]
