"""Checking the prompts a rollout engine is given: lists of token ids inside the vocabulary (one line per error)."""

from __future__ import annotations

import operator
from typing import Sequence

import torch

__all__ = ["check_prompt_ids"]


def check_prompt_ids(prompts, vocab_size: int) -> list[list[int]]:
    """`prompts` (B lists of token ids, or 1-D tensors) as lists of Python ints, each id in [0, vocab_size).

    Raises:
        ValueError: naming the first bad prompt or token: not a list of token-id lists, no prompts, an empty prompt,
            a token that is not an integer or lies outside the vocabulary.
    """
    if isinstance(prompts, torch.Tensor) or isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise ValueError(f"generate: prompts must be a list of token-id lists (unpadded), got "
                         f"{type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("generate: no prompts given")
    checked = []
    for b, prompt in enumerate(prompts):
        if isinstance(prompt, torch.Tensor) and prompt.dim() == 1:
            prompt = prompt.tolist()
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
            raise ValueError(f"generate: prompt {b} must be a list of token ids, got {type(prompt).__name__}")
        if len(prompt) == 0:
            raise ValueError(f"generate: prompt {b} is empty; every prompt must hold at least one token")
        ids = []
        for j, token in enumerate(prompt):
            try:
                token = operator.index(token)
            except TypeError:
                raise ValueError(f"generate: prompt {b} token {j}: expected an integer token id, "
                                 f"got {token!r}") from None
            if not 0 <= token < vocab_size:
                raise ValueError(f"generate: prompt {b} token {j}: id {token} is outside the vocabulary "
                                 f"[0, {vocab_size})")
            ids.append(token)
        checked.append(ids)
    return checked
