"""Chat-formatting and tokenising of prompts for rollouts and evaluation (the one place both build prompts)."""

from __future__ import annotations

from typing import Optional, Sequence

from astrai.data import DataError


def encode_prompts(questions: Sequence[str], tokenizer, *, system_prompt: Optional[str] = None,
                   max_prompt_length: int) -> list[list[int]]:
    """Token ids of each question wrapped as a user turn of the tokenizer's chat template.

    The template is rendered with `add_generation_prompt=True`, so the ids end where the assistant's answer
    starts. A prompt longer than `max_prompt_length` tokens keeps its LAST `max_prompt_length` tokens (the
    generation prompt must survive).

    Args:
        questions: B prompt texts.
        tokenizer: an `astrai.models.Tokenizer` (or anything with `apply_chat_template` and `encode`).
        system_prompt: optional system message placed first.
        max_prompt_length: most tokens kept per prompt (> 0).

    Returns:
        B lists of int token ids.
    """
    out = []
    for question in questions:
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else [])
        messages.append({"role": "user", "content": question})
        ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        out.append(ids[-max_prompt_length:])
    return out


def prompt_ids_and_budget(prompt: str, tokenizer, *, system_prompt: Optional[str], max_prompt_length: int,
                          max_length: int, where: str) -> tuple[list[int], int]:
    """Chat-templated ids of one stored record's `prompt` (as `encode_prompts` makes them) and the number of
    response tokens left within `max_length` (`data.max_length`) for the offline train types (dpo, grpo).

    Raises:
        DataError: naming `where` when the prompt leaves no room for a response.
    """
    ids = encode_prompts([prompt], tokenizer, system_prompt=system_prompt, max_prompt_length=max_prompt_length)[0]
    budget = max_length - len(ids)
    if budget < 1:
        raise DataError(f"{where}: the prompt takes {len(ids)} tokens, no room for a response within "
                        f"data.max_length={max_length} (lower data.max_prompt_length)")
    return ids, budget


def encode_records(records: Sequence, tokenizer, *, system_prompt: Optional[str] = None,
                   max_prompt_length: int) -> tuple[list[list[int]], list[str]]:
    """Prompt token ids and reference answers of dataset records, as the online train types and the evaluator
    feed them to the engine (`encode_prompts` of each record's `prompt`).

    Args:
        records: B `astrai.data.PromptRecord` (anything with `prompt` and `answer` strings).
        tokenizer, system_prompt, max_prompt_length: as for `encode_prompts`.

    Returns:
        (B lists of int token ids, B answer strings as stored).
    """
    ids = encode_prompts([r.prompt for r in records], tokenizer, system_prompt=system_prompt,
                         max_prompt_length=max_prompt_length)
    return ids, [r.answer for r in records]
