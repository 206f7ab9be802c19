"""Prompts longer than their token budget: the `data.truncation` policy, applied when the data is loaded.

A prompt is the chat template around an optional system turn and the record's question, ending with the
generation prompt, or, with raw text prompts (`data.chat_template`, `astrai.data.prompt_format`), the question's
text after the BOS token when the tokenizer adds one. Its budget is `data.max_prompt_length` (online rollouts),
and for dpo / offline grpo also `data.max_length - 1` (room for at least one response token). A longer prompt is handled by `data.truncation`:

- `error` (the default, as verl's `data.truncation`): stop at load time naming the file, row and lengths.
- `filter`: drop the record at load time (verl's `filter_overlong_prompts`) and print how many were dropped.
- `left`: keep the chat's structure and cut the START of the question's own tokens (the template markers, the
  system turn and the generation prompt are kept whole, as is a raw prompt's BOS token; the end of a question
  usually holds what is asked).
  A prompt whose template and system turn alone exceed the budget is an error.

A plain left cut of the token sequence (what TRL does with `truncation_side="left"`) would drop the system
turn and the `<|im_start|>` of the user turn; astrai never does that.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

from astrai.config import TRUNCATION_POLICIES
from astrai.data.chat import encode_rendered, render_chat
from astrai.data.files import DataError
from astrai.data.prompt_format import CHAT_TEMPLATE_FIELD, bos_prefix, raw_prompt_ids, refuse_system_prompt, \
    uses_chat_template

__all__ = ["TRUNCATION_POLICIES", "EncodedPrompt", "encode_prompt", "encode_prompt_records", "fit_prompt",
           "prompt_ids_and_budget", "report_dropped"]


@dataclass(frozen=True)
class EncodedPrompt:
    """A prompt ready for rollouts.

    Attributes:
        prompt_ids: the rendered prompt's token ids (P,) (chat template or raw text), within the budget.
        answer: the record's reference answer ("" when none).
        index: 0-based row of the record in its file.
        prompt: the prompt as stored (text or chat messages), what reward functions receive as `prompts`.
        columns: the record's other fields by name (`data.prompts.PromptRecord.columns`).
    """

    prompt_ids: list[int]
    answer: str
    index: int
    prompt: Any = ""
    columns: Mapping[str, Any] = field(default_factory=dict)


def prompt_messages(question, system_prompt: Optional[str]) -> list[dict]:
    """The chat of a prompt: an optional system turn, then the question as the user turn; a stored chat (a list
    of messages, the last the user's: `data.prompts.PromptRecord.prompt`) as it is, behind the system turn unless
    it starts with one of its own."""
    if isinstance(question, list):
        own = bool(question) and question[0].get("role") == "system"
        head = [{"role": "system", "content": system_prompt}] if system_prompt and not own else []
        return head + [dict(m) for m in question]
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return messages + [{"role": "user", "content": question}]


def encode_prompt(tokenizer, question, *, system_prompt: Optional[str] = None, chat_template: Optional[bool] = None,
                  where: str = "prompt") -> tuple[list[int], Optional[tuple[int, int]]]:
    """(ids, (a, b)): the ids of a rendered prompt and the token range `ids[a:b]` that holds only the question's
    text (None when the template rewrote the question, so its tokens cannot be told apart). `question` is a string
    or a chat whose last message is the user's (its content is the part `data.truncation=left` may cut).

    `chat_template` (`data.chat_template`) picks the rendering through `prompt_format.uses_chat_template`: the chat
    template (generation prompt included), or raw text (`prompt_format.raw_prompt_ids`: the BOS token when the
    tokenizer adds one, then the text; the range is the text).

    Raises:
        ConfigError: `chat_template` True without a template, or a `system_prompt` with raw text.
        DataError: naming `where`, a chat prompt with raw text (a chat needs a template), or a template that
            rewrites a content spelling a control token (`chat.render_chat`).
    """
    if not uses_chat_template(tokenizer, chat_template):
        if isinstance(question, list):
            why = "is false" if chat_template is False else "is null and the tokenizer has none"
            raise DataError(f"{where}: the prompt is a chat (a list of messages), which needs a chat template, "
                            f"but prompts are raw text ({CHAT_TEMPLATE_FIELD} {why})")
        if system_prompt:
            raise refuse_system_prompt(chat_template)
        ids = raw_prompt_ids(tokenizer, question)
        return ids, (len(bos_prefix(tokenizer)), len(ids))
    messages = prompt_messages(question, system_prompt)
    chat = render_chat(tokenizer, messages, add_generation_prompt=True, where=where)
    ids, starts = encode_rendered(tokenizer, chat)
    span = next(((s, e) for s, e, index in chat.spans if index == len(messages) - 1), None)
    if span is None:
        return ids, None
    inside = [i for i, start in enumerate(starts) if span[0] <= start < span[1]]
    return ids, ((inside[0], inside[-1] + 1) if inside else (0, 0))


def fit_prompt(ids: Sequence[int], question: Optional[tuple[int, int]], *, limit: int, limit_name: str,
               policy: str, where: str) -> Optional[list[int]]:
    """`ids` within `limit` tokens under `policy` (see the module docstring); None when `filter` drops it.

    Raises:
        DataError: `error` and the prompt is too long, or `left` and cutting the whole question is not enough
            (one line naming `where`, the lengths and `limit_name`).
        ValueError: an unknown policy.
    """
    if policy not in TRUNCATION_POLICIES:
        raise ValueError(f"data.truncation: expected one of {', '.join(TRUNCATION_POLICIES)}, got {policy!r}")
    ids = list(ids)
    excess = len(ids) - limit
    if excess <= 0:
        return ids
    if policy == "filter":
        return None
    if policy == "error":
        raise DataError(f"{where}: the prompt is {len(ids)} tokens, more than {limit_name}={limit} "
                        f"(data.truncation=error; 'filter' drops such prompts, 'left' cuts the question's start)")
    if question is None:
        raise DataError(f"{where}: the prompt is {len(ids)} tokens, more than {limit_name}={limit}, and the chat "
                        f"template rewrites the question, so data.truncation=left cannot cut it (use filter)")
    a, b = question
    if b - a <= excess:
        raise DataError(f"{where}: the prompt is {len(ids)} tokens and all but {b - a} of them are the chat "
                        f"template and system prompt (or the BOS token); cutting the question cannot fit "
                        f"{limit_name}={limit}")
    return ids[:a] + ids[a + excess:]


def encode_prompt_records(questions: Sequence, tokenizer, *, system_prompt: Optional[str], limit: int,
                          limit_name: str, policy: str, source: str, chat_template: Optional[bool] = None,
                          log: Callable[[str], None] = print) -> list[Optional[list[int]]]:
    """Encode (`encode_prompt`, rendered as `chat_template` says) and fit every question (row i of `source` is
    `questions[i]`); None marks a dropped row.

    Prints (through `log`) how many prompts `filter` dropped or `left` cut.

    Raises:
        DataError: from `encode_prompt` or `fit_prompt` (naming `source` and the 1-based row), or when `filter`
            drops every row. ConfigError: from `encode_prompt`.
    """
    out: list[Optional[list[int]]] = []
    cut = 0
    for row, question in enumerate(questions, start=1):
        where = f"{source} row {row}"
        ids, span = encode_prompt(tokenizer, question, system_prompt=system_prompt, chat_template=chat_template,
                                  where=where)
        fitted = fit_prompt(ids, span, limit=limit, limit_name=limit_name, policy=policy, where=where)
        cut += fitted is not None and len(fitted) < len(ids)
        out.append(fitted)
    dropped = sum(ids is None for ids in out)
    if dropped == len(out):
        raise DataError(f"{source}: every prompt is longer than {limit_name}={limit} tokens "
                        f"(data.truncation=filter dropped all {dropped})")
    if dropped:
        log(f"data.truncation=filter: dropped {dropped} of {len(out)} prompts of {source} longer than "
            f"{limit_name}={limit} tokens")
    if cut:
        log(f"data.truncation=left: cut the start of the question of {cut} of {len(out)} prompts of {source} "
            f"to fit {limit_name}={limit} tokens")
    return out


def prompt_ids_and_budget(prompt: str, tokenizer, data, where: str) -> Optional[tuple[list[int], int]]:
    """The ids of one stored record's `prompt` (dpo, offline grpo, rm), rendered as training renders it
    (`encode_prompt`: `data.chat_template`, system prompt applied), fitted under `data.truncation` to
    `min(data.max_prompt_length, data.max_length - 1)` tokens (room for at least one response token), and the
    number of response tokens left within `data.max_length`; None when `filter` drops it.

    Args:
        data: the `data` section of the config (`system_prompt`, `chat_template`, `max_prompt_length`,
            `max_length`, `truncation`).

    Raises:
        DataError: naming `where` (from `encode_prompt` and `fit_prompt`).
    """
    ids, question = encode_prompt(tokenizer, prompt, system_prompt=data.system_prompt,
                                  chat_template=data.chat_template, where=where)
    if data.max_prompt_length <= data.max_length - 1:
        limit, name = data.max_prompt_length, "data.max_prompt_length"
    else:
        limit, name = data.max_length - 1, "data.max_length - 1 (room for a response)"
    ids = fit_prompt(ids, question, limit=limit, limit_name=name, policy=data.truncation, where=where)
    return None if ids is None else (ids, data.max_length - len(ids))


def report_dropped(kept: int, total: int, *, source: str, log: Callable[[str], None] = print) -> None:
    """Tell (through `log`) how many stored records `data.truncation=filter` dropped for overlong prompts.

    Raises:
        DataError: when every record was dropped.
    """
    if kept == 0:
        raise DataError(f"{source}: every prompt is too long (data.truncation=filter dropped all {total})")
    if kept < total:
        log(f"data.truncation=filter: dropped {total - kept} of {total} records of {source} whose prompt is "
            f"longer than min(data.max_prompt_length, data.max_length - 1) tokens")
