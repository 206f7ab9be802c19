"""Which token ids end a response: the stop set of rollouts and the end of a training response.

A chat model may end its turns with a token other than the tokenizer's `eos_token`: e.g. a tokenizer whose
`eos_token` is `<|endoftext|>` while the chat template closes each turn with `<|im_end|>`, and `config.json` /
`generation_config.json` list `eos_token_id: [2, 0]`. `transformers`' `generate` stops on every id of the
generation config's list; astrai does the same with `stop_token_ids`, the union of

- the tokenizer's `eos_token`,
- every id of the model config's `eos_token_id` (a list is kept whole; the loaders merge
  `generation_config.json`'s list and a GGUF file's `tokenizer.ggml.eot_token_id` into it).

Used by the rollout sampling parameters, the end of labelled assistant turns (sft), the end token appended to
dpo / offline grpo responses (`response_end_id`) and the decoding of responses for the rewards.
"""

from __future__ import annotations

from typing import Optional, Sequence

__all__ = ["stop_token_ids", "turn_end_id", "response_end_id", "strip_stop"]

_PROBE = "\ue000astrai-turn-probe\ue001"  # private-use characters: never in a template's own text


def stop_token_ids(config, tokenizer) -> tuple[int, ...]:
    """The stop set: the tokenizer's EOS id first, then every id of `config.eos_token_ids` (a
    `ModelConfig`), without repeats. Empty only when neither names an id."""
    ids: list[int] = []
    for token in (tokenizer.eos_token_id, *config.eos_token_ids):
        if token is not None and int(token) not in ids:
            ids.append(int(token))
    return tuple(ids)


def turn_end_id(tokenizer, stops: Sequence[int]) -> Optional[int]:
    """The stop id the chat template writes right after an assistant message (`<|im_end|>` for ChatML), found by
    rendering a probe conversation; None when the tokenizer has no template, the template refuses the probe, or
    no id of `stops` follows the assistant content."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    except Exception:  # noqa: BLE001 - templates raise arbitrary errors for conversations they do not accept
        return None
    head, found, tail = text.partition(_PROBE)
    if not found:
        return None
    return next((t for t in tokenizer.encode(tail) if t in stops), None)


def response_end_id(tokenizer, stops: Sequence[int]) -> Optional[int]:
    """The id appended to a stored response (dpo, offline grpo): the template's end of turn when it is a stop id
    (what the policy samples to end a turn), else the tokenizer's EOS, else the first stop id."""
    end = turn_end_id(tokenizer, stops)
    if end is None:
        end = tokenizer.eos_token_id
    if end is None and stops:
        end = stops[0]
    return end


def strip_stop(ids: Sequence[int], stops: Sequence[int]) -> list[int]:
    """`ids` without its final token when that token is a stop id (the text of a finished response)."""
    ids = list(ids)
    return ids[:-1] if ids and ids[-1] in stops else ids
