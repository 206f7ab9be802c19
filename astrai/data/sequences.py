"""The prompt + response batch layout that rollouts, RL training, DPO and offline GRPO share.

Layout (docs/architecture.md): `input_ids (B, S)` = left-padded prompt (B, P) + right-padded response (B, T);
response token t is scored by the logits at position P - 1 + t. `position_ids = clamp(cumsum(mask) - 1, min=0)`,
so left padding does not shift the positions of real tokens.

Two masks over the response, one per job: the response part of `attention_mask` marks its real tokens (what the
model attends to), `action_mask` its ACTIONS, the tokens the policy sampled and is trained on (the loss mask). In a
single-turn rollout they are equal; in a multi-turn episode the tokens a tool or environment inserted between two
turns of the policy are real but no action (`action_mask` False), and every loss, estimator and metric skips them
(docs/conventions.md section 2).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["PackedSequences", "Sequences", "left_pad", "position_ids_from_mask", "right_pad"]


def left_pad(sequences: Sequence[Sequence[int]], pad_token_id: int, device: torch.device | str = "cpu"):
    """Left-pad token id lists into `(ids (B, P) int64, mask (B, P) bool)`.

    Raises:
        ValueError: if `sequences` is empty or one of them is empty.
    """
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError("left_pad: every prompt must hold at least one token")
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.bool)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq):] = torch.tensor(list(seq), dtype=torch.long)
        mask[row, width - len(seq):] = True
    return ids.to(device), mask.to(device)


def right_pad(sequences: Sequence[Sequence[int]], pad_token_id: int, device: torch.device | str = "cpu"):
    """Right-pad token id lists into `(ids (B, T) int64, mask (B, T) bool)`.

    Raises:
        ValueError: if `sequences` is empty or one of them is empty.
    """
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError("right_pad: every response must hold at least one token")
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.bool)
    for row, seq in enumerate(sequences):
        ids[row, :len(seq)] = torch.tensor(list(seq), dtype=torch.long)
        mask[row, :len(seq)] = True
    return ids.to(device), mask.to(device)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions (B, S) int64 = number of real tokens before each position (0 at left padding)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


@dataclass(frozen=True)
class Sequences:
    """Model inputs for a batch of prompt + response sequences.

    Attributes:
        input_ids: (B, S) int64, S = P + T.
        attention_mask: (B, S) bool, True on real tokens.
        position_ids: (B, S) int64.
        prompt_length: P, the padded prompt width.
        action_mask: (B, T) bool, the loss mask: True on the response tokens the policy sampled (its actions),
            False at padding and at tool / environment tokens inside a response; within `response_mask`.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    prompt_length: int
    action_mask: torch.Tensor

    @classmethod
    def from_padded(cls, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
                    action_mask: torch.Tensor, response_mask: torch.Tensor | None = None) -> "Sequences":
        """Concatenate left-padded prompts (B, P) and right-padded responses (B, T) with their masks;
        `response_mask` (B, T) bool marks the responses' real tokens (None: the actions, a single-turn rollout)."""
        attention_mask = torch.cat([prompt_mask, action_mask if response_mask is None else response_mask], dim=1)
        return cls(input_ids=torch.cat([prompt_ids, response_ids], dim=1), attention_mask=attention_mask,
                   position_ids=position_ids_from_mask(attention_mask), prompt_length=prompt_ids.shape[1],
                   action_mask=action_mask)

    @classmethod
    def from_tokens(cls, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *,
                    pad_token_id: int, device: torch.device | str = "cpu") -> "Sequences":
        """Prompt + response token lists in the layout above (prompts left-padded, responses right-padded).

        Raises:
            ValueError: when the lists differ in length or a prompt or response is empty.
        """
        if len(prompts) != len(responses):
            raise ValueError(f"Sequences.from_tokens: {len(prompts)} prompts but {len(responses)} responses")
        prompt_ids, prompt_mask = left_pad(prompts, pad_token_id, device)
        response_ids, action_mask = right_pad(responses, pad_token_id, device)
        return cls.from_padded(prompt_ids, prompt_mask, response_ids, action_mask)

    @property
    def response_ids(self) -> torch.Tensor:
        """(B, T) int64 response tokens."""
        return self.input_ids[:, self.prompt_length:]

    @property
    def response_mask(self) -> torch.Tensor:
        """(B, T) bool, the responses' real tokens (actions and tool / environment tokens): the attention mask's
        response part."""
        return self.attention_mask[:, self.prompt_length:].bool()

    def select(self, index: torch.Tensor) -> "Sequences":
        """Rows `index` (1-D int64) of every tensor; the prompt width is kept."""
        return dataclasses.replace(self, input_ids=self.input_ids[index],
                                   attention_mask=self.attention_mask[index],
                                   position_ids=self.position_ids[index],
                                   action_mask=self.action_mask[index])

    def trim_padding(self) -> tuple[slice, "Sequences"]:
        """The columns some row uses: leading columns that are padding in every row (prompt padding) and trailing
        columns that are padding in every row (response padding) are dropped. At least one prompt column and (when
        T > 0) one response column are kept, so the layout above still holds.

        Returns:
            `(columns, trimmed)`: `columns` the kept slice of the S columns, `trimmed` those columns of every
            tensor, with `prompt_length` P' = P - (leading columns dropped) and `action_mask` (B, T') its first T'
            response columns (response column t is the same token in both, so per-token (B, T) tensors are cut
            with `[:, :T']`). `position_ids` are sliced, not recomputed: a dropped column is padding in every row,
            so it adds nothing to `cumsum(attention_mask)` and the kept positions are unchanged.
        """
        p, s = self.prompt_length, self.input_ids.shape[1]
        used = self.attention_mask.any(dim=0).nonzero().squeeze(-1).tolist()  # ascending column indices
        start = min([c for c in used if c < p][:1] + [max(p - 1, 0)])
        stop = max([c + 1 for c in used if c >= p][-1:] + [min(p + 1, s)])
        columns = slice(start, stop)
        trimmed = dataclasses.replace(self, input_ids=self.input_ids[:, columns],
                                      attention_mask=self.attention_mask[:, columns],
                                      position_ids=self.position_ids[:, columns], prompt_length=p - start,
                                      action_mask=self.action_mask[:, :stop - p])
        return columns, trimmed

    @classmethod
    def concat(cls, parts: Sequence["Sequences"], pad_token_id: int) -> "Sequences":
        """The rows of `parts`, in order, in one batch: each part's prompts left-padded with `pad_token_id` to the
        widest prompt width P and its responses right-padded to the widest response width T; `position_ids` from
        the joined mask, so each real token keeps its position.

        Raises:
            ValueError: for no parts.
        """
        if not parts:
            raise ValueError("Sequences.concat: no parts")
        p = max(part.prompt_length for part in parts)
        t = max(part.action_mask.shape[1] for part in parts)

        def widen(x: torch.Tensor, part: "Sequences", value) -> torch.Tensor:
            left, right = p - part.prompt_length, t - part.action_mask.shape[1]
            return torch.nn.functional.pad(x, (left, right), value=value)

        attention_mask = torch.cat([widen(s.attention_mask, s, False) for s in parts])
        return cls(input_ids=torch.cat([widen(s.input_ids, s, pad_token_id) for s in parts]),
                   attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask), prompt_length=p,
                   action_mask=torch.cat([torch.nn.functional.pad(s.action_mask, (0, t - s.action_mask.shape[1]),
                                                                  value=False) for s in parts]))

    def packed(self) -> "PackedSequences":
        """The same batch without padding: the real tokens of every row, in row order, in one row (1, N), each row
        a segment with its own positions (`PackedSequences`). A model scores it with `seq_lengths` (each token
        attends only within its own row, causally), which gives the padded batch's outputs at every real token up
        to float rounding, and computes nothing for padding.

        Raises:
            ValueError: when a real response token follows a padding column (the position that scores it would be
                padding); never for the layout above.
        """
        mask = self.attention_mask.bool()
        p, t = self.prompt_length, self.action_mask.shape[1]
        actions = self.action_mask.bool()
        scorers = torch.zeros_like(mask)
        scorers[:, p - 1:p - 1 + t] = actions  # response token t is scored at column P - 1 + t
        if (t and p < 1) or bool((scorers & ~mask).any()):
            raise ValueError("Sequences.packed: a real response token follows a padding column")
        return PackedSequences(input_ids=self.input_ids[mask][None], position_ids=self.position_ids[mask][None],
                               seq_lengths=tuple(mask.sum(dim=1).tolist()), score_at=scorers[mask][None],
                               labels=self.response_ids[actions], action_mask=actions)

    def to(self, device: torch.device | str) -> "Sequences":
        """Every tensor moved to `device`."""
        return dataclasses.replace(self, input_ids=self.input_ids.to(device),
                                   attention_mask=self.attention_mask.to(device),
                                   position_ids=self.position_ids.to(device), action_mask=self.action_mask.to(device))


@dataclass(frozen=True)
class PackedSequences:
    """A `Sequences` batch without padding (`Sequences.packed`): N = its real tokens, A = its real response tokens.

    Attributes:
        input_ids: (1, N) int64, row 0's real tokens, then row 1's ...
        position_ids: (1, N) int64, each row's own positions (0, 1, ... for a row without holes).
        seq_lengths: (B,) Python ints, the real tokens of each row (the segments of the packed row).
        score_at: (1, N) bool, True at the A positions whose next-token logits score a real response token, in
            row-major order of the (B, T) response tokens.
        labels: (A,) int64, those response tokens (row-major).
        action_mask: (B, T) bool, the batch's, to put per-token results back in (B, T) (`unpack`).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    seq_lengths: tuple[int, ...]
    score_at: torch.Tensor
    labels: torch.Tensor
    action_mask: torch.Tensor

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """values (A,) at the real response tokens -> (B, T) float32 with 0 at padding (differentiable)."""
        full = torch.zeros(self.action_mask.shape, dtype=torch.float32, device=values.device)
        return full.masked_scatter(self.action_mask, values.float())
