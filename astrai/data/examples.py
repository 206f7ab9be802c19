"""Tokenised training examples for the offline train types, their packing, and batch collation.

Text from data is always encoded as text (`Tokenizer.encode_text`, `astrai.data.chat`): a message, document or
response that spells a control token (`<|im_end|>`, `<|endoftext|>`) gets ordinary ids; only the chat
template's own markers and the ends this module appends are control ids.

- sft: `chat_example` renders a `messages` list through the tokenizer's chat template and labels exactly the
  assistant turns' tokens, each through the first stop token after its content (the template's end of turn,
  e.g. `<|im_end|>`; text the template writes after it, such as a newline, is not labelled); everything else is
  -100, the ignore index of cross-entropy.
- seq: `text_example` is the raw text's tokens plus EOS, all labelled.
- packing (`pack_examples`): whole examples (never truncated first) are concatenated in order and cut into
  rows of `max_length` tokens (the "concatenate and chunk" packing of GPT-style pre-training). Each row carries
  the document index of every token: position ids restart at each document and attention stays inside it
  (a block-diagonal causal mask, `astrai.models.layers.build_attention_mask`), and the first token of each
  document in a row is not a target, so a packed row computes what its documents would compute alone.
- dpo / grpo: prompts are rendered as online rollouts render them (the chat template or raw text,
  `data.chat_template`: `astrai.data.truncation.encode_prompt`); responses are their tokens plus the end-of-turn id
  (`astrai.models.special_tokens.response_end_id`); `Sequences.from_tokens` (`astrai.data.sequences`) assembles
  prompt + response batches in the rollout layout (left-padded prompt, right-padded response), so log-probs are
  computed by the same `response_logprobs` as for rollouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from astrai.data.chat import encode_rendered, render_chat
from astrai.data.files import DataError

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
        document_ids: (B, S) int64 document index of each token in its packed row (-1 at padding), or None
            for unpacked rows; tokens attend only within their document.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    document_ids: Optional[torch.Tensor] = None

    @property
    def loss_mask(self) -> torch.Tensor:
        """(B, S - 1) bool: True where `labels[:, 1:]` carries a loss."""
        return self.labels[:, 1:] != IGNORE_INDEX


def _check_messages(messages: Any, where: str, tokenizer=None) -> list[dict]:
    """`messages` as plain {role, content} dicts. An assistant message's OpenAI ``tool_calls`` (its content may then
    be empty or null) are written back into its content as the Hermes ``<tool_call>`` blocks a rollout's turn
    samples (`astrai.agents.tool_calls.with_calls_in_text`, as `astrai.agents.chat.render` does) when the chat
    template has no tool support; a template with its own tool-call format is refused in one line (write the calls
    in the content as that format wants them)."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: messages must be a non-empty list of {{role, content}} objects")
    for i, m in enumerate(messages):
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if calls is not None and (m.get("role") != "assistant" or not isinstance(calls, list)):
            raise DataError(f"{where}: message {i}: tool_calls must be a list, on an assistant message")
        content = m.get("content") if isinstance(m, dict) else None
        if calls and content is None:
            content = ""
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(content, str):
            raise DataError(f"{where}: message {i} must be an object with string 'role' and 'content'")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: no assistant message (nothing to learn)")
    if any(m.get("tool_calls") for m in messages):
        from astrai.agents.tool_calls import template_supports_tools, with_calls_in_text

        template = getattr(tokenizer, "chat_template", None) or ""
        if template and template_supports_tools(template):
            raise DataError(f"{where}: assistant tool_calls in training messages are written back as Hermes "
                            "<tool_call> blocks only for a chat template without tool support; this template has "
                            "its own format: write each call in the message's content as the model should emit it")
        messages = with_calls_in_text([{**m, "content": m.get("content") or ""} for m in messages])
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def chat_example(messages: Any, tokenizer, *, max_length: Optional[int], stops: Sequence[int] = (),
                 where: str = "example") -> tuple[list[int], list[int]]:
    """(token ids, labels) of a chat, labels = ids on assistant-turn tokens and IGNORE_INDEX elsewhere.

    An assistant turn is the text its message adds after the generation prompt (the template rendered for the
    conversation up to it); it is labelled through the first id of `stops` (`special_tokens.stop_token_ids`)
    that the template writes after the content, or whole when there is none. Contents are encoded as text
    (`astrai.data.chat`). Truncated to the first `max_length` tokens (None: whole, for packing).

    Raises:
        DataError: malformed messages, no assistant turn, or a chat template that does not render
            incrementally (a later prefix does not extend the earlier text).
    """
    messages = _check_messages(messages, where, tokenizer)
    chat = render_chat(tokenizer, messages, add_generation_prompt=False, where=where)
    regions = []
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            head = tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True)
            turn = tokenizer.apply_chat_template(messages[:i + 1], add_generation_prompt=False)
            if not (turn.startswith(head) and chat.text.startswith(turn)):
                raise DataError(f"{where}: the chat template does not render incrementally; cannot mask turns")
            regions.append((len(head), len(turn)))
    ids, starts = encode_rendered(tokenizer, chat, cuts=[c for region in regions for c in region])
    in_content = [any(lo <= start < hi for lo, hi, _ in chat.spans) for start in starts]
    labels = [IGNORE_INDEX] * len(ids)
    for lo, hi in regions:
        turn = [k for k, start in enumerate(starts) if lo <= start < hi]
        end = next((k for k in turn if ids[k] in stops and not in_content[k]), None)
        for k in turn:
            if end is None or k <= end:
                labels[k] = ids[k]
    if max_length is not None:
        ids, labels = ids[:max_length], labels[:max_length]
    return ids, labels


def text_example(text: str, tokenizer, *, max_length: Optional[int]) -> tuple[list[int], list[int]]:
    """(ids, labels) of raw text for pre-training: its tokens (as text) + EOS, all labelled, truncated to
    `max_length` (None: whole, for packing)."""
    ids = tokenizer.encode_text(text) + [tokenizer.eos_token_id]
    ids = ids if max_length is None else ids[:max_length]
    return ids, list(ids)


def pack_examples(examples: Sequence[tuple[list[int], list[int]]], *, max_length: int
                  ) -> list[tuple[list[int], list[int], list[int]]]:
    """Concatenate whole (ids, labels) examples in order and cut the stream into rows of `max_length` tokens
    (the last row may be shorter). Returns (ids, labels, document ids) rows: document ids count 0, 1, ... the
    examples present in the row; each example's first token in a row gets label IGNORE_INDEX (it is never
    predicted from another document). Rows without any target are dropped."""
    ids = [t for example in examples for t in example[0]]
    labels = [t for example in examples for t in example[1]]
    documents = [d for d, example in enumerate(examples) for _ in example[0]]
    rows = []
    for i in range(0, len(ids), max_length):
        row_docs, row_labels = documents[i:i + max_length], labels[i:i + max_length]
        local = []
        for k, doc in enumerate(row_docs):
            first = k == 0 or doc != row_docs[k - 1]
            local.append(local[-1] + first if k else 0)
            if first:
                row_labels[k] = IGNORE_INDEX
        rows.append((ids[i:i + max_length], row_labels, local))
    return [row for row in rows if any(t != IGNORE_INDEX for t in row[1][1:])]


def collate_lm(examples: Sequence[tuple[list[int], ...]], *, pad_token_id: int,
               device: torch.device | str = "cpu") -> LMBatch:
    """Right-pad (ids, labels) or packed (ids, labels, document ids) examples into an `LMBatch` (S = the
    longest example). Position ids count from 0 along each row, or along each document of a packed row.

    Raises:
        ValueError: for an empty list, an empty example, or ids and labels of different lengths.
    """
    if not examples or any(len(e[0]) == 0 or any(len(x) != len(e[0]) for x in e[1:]) for e in examples):
        raise ValueError("collate_lm: expected non-empty examples with as many labels as ids")
    width = max(len(e[0]) for e in examples)
    input_ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    documents = torch.full((len(examples), width), -1, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.bool)
    packed = any(len(e) > 2 for e in examples)
    for row, example in enumerate(examples):
        n = len(example[0])
        input_ids[row, :n] = torch.tensor(example[0])
        labels[row, :n] = torch.tensor(example[1])
        documents[row, :n] = torch.tensor(example[2]) if len(example) > 2 else 0
        mask[row, :n] = True
    position_ids = (mask.long().cumsum(1) - 1).clamp(min=0)
    if packed:  # restart at each document: index minus the index where the token's document starts
        index = torch.arange(width).expand(len(examples), width)
        starts = torch.ones_like(mask)
        starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
        position_ids = index - torch.where(starts, index, 0).cummax(dim=1).values
    return LMBatch(input_ids=input_ids.to(device), attention_mask=mask.to(device),
                   position_ids=position_ids.to(device), labels=labels.to(device),
                   document_ids=documents.to(device) if packed else None)


def response_tokens(text: str, tokenizer, *, budget: int, end_id: int) -> list[int]:
    """Tokens of a response (encoded as text) plus `end_id` (`special_tokens.response_end_id`, the id that ends
    a turn), truncated to `budget` (>= 1) tokens."""
    return (tokenizer.encode_text(text) + [end_id])[:max(1, budget)]

