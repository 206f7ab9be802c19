"""Token-exact incremental rendering of a multi-turn episode (token-in, token-out).

How the multi-turn loop (a later slice) uses these functions, per episode:

1. prompt ids = the chat template applied to the first messages with the generation prompt (`render`, the tools in
   the template's ``tools`` variable or, for a template without tool support, in the system turn);
2. the policy samples a turn; its ids, through the end-of-turn token (`turn_end`), are appended VERBATIM, never
   decoded and re-encoded, with loss mask 1;
3. the turn's text is read into its assistant message (`astrai.agents.tool_calls.assistant_message`: the content
   outside the calls, the calls in ``tool_calls``, for every template), the tools run, and ALL the new
   non-assistant messages of that step (every tool result of a parallel call together, an environment's user
   turn) go to `suffix_ids` with the messages so far: its ``separator_ids`` (the template's text after the
   end-of-turn token, which the sampler never emits: ChatML's "\\n" after ``<|im_end|>``) and then its ``ids``
   (the new messages and the next generation prompt) are appended with loss mask 0;
4. repeat from 2 until no call, a cap, or the environment ends the episode; the final separator is not appended.

The suffix is the template applied to prefix + new messages minus the template applied to the prefix, as text
(a `TemplatePrefixError` when the prefix's text changes), tokenized alone: it starts at a special token, so no
BPE merge can cross the boundary. A template without tool support renders an assistant's ``tool_calls`` as the
Hermes blocks the model wrote (`render`), so the rendered prefix is the sampled text when the model wrote its calls
in the canonical form; either way the suffix only depends on what follows the prefix's end of turn. At start-up
`check_prefix_preserving` runs this loop on a fixed conversation and compares the ids with the full render
tokenized, refusing a template that rewrites earlier turns (e.g. one that strips earlier ``<think>`` blocks).

Note: `Tokenizer.apply_chat_template` takes no ``tools``; `render` renders through the same compiled template
(`astrai.models.tokenizer._compiled_template`) when tools go through the template. Contents are encoded with
`Tokenizer.encode`, so a tool result that spells a control token (``<|im_end|>``) becomes that token; keeping it
text needs `astrai.data.chat`'s content spans (a later slice).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

from astrai.agents.tool_calls import (schema_of, template_supports_tools, with_calls_in_text,
                                      with_tools_prompt)
from astrai.agents.tools import Tool
from astrai.models.tokenizer import _compiled_template

__all__ = ["TemplatePrefixError", "Suffix", "render", "turn_end", "suffix_ids", "check_prefix_preserving"]

Messages = Sequence[Mapping[str, Any]]
Tools = Optional[Sequence[Union[Tool, Mapping[str, Any]]]]
_PROBE = "\ue000astrai-agents-probe\ue001"  # private-use characters: never in a template's own text


class TemplatePrefixError(ValueError):
    """The chat template does not render a conversation as an extension of its earlier turns; the message is one
    line naming the first differing token position (and character)."""


@dataclass(frozen=True)
class Suffix:
    """What the loop appends after a sampled turn.

    Attributes:
        separator_ids: the ids of the template's text after the end-of-turn token (ChatML: ``"\\n"``; Llama 3:
            none), loss mask 0.
        ids: the ids of the new messages and the generation prompt, loss mask 0.
        text: the rendered text of `ids`.
    """

    separator_ids: list[int]
    ids: list[int]
    text: str


def render(tokenizer, messages: Messages, tools: Tools = None, add_generation_prompt: bool = True) -> str:
    """`messages` rendered by `tokenizer`'s chat template. With `tools` (Tools or schemas): through the template's
    ``tools`` variable when it reads one (as transformers' ``apply_chat_template(tools=...)``), else listed in the
    system turn (`astrai.agents.tool_calls.with_tools_prompt`, Hermes format). An assistant message's
    ``tool_calls`` (OpenAI shape) go to a template with tool support as they are; for one without they are
    written back into its content as the Hermes blocks the model was prompted to write
    (`astrai.agents.tool_calls.with_calls_in_text`), with or without `tools`.

    Raises:
        ValueError: the tokenizer has no chat template, or it is not valid Jinja2; jinja2.TemplateError: the
            template refuses the messages.
    """
    if not tokenizer.chat_template:
        raise ValueError("this tokenizer has no chat_template")
    native = template_supports_tools(tokenizer.chat_template)
    if not native:
        messages = with_calls_in_text(messages)
    if not tools:
        return tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt)
    if not native:
        return tokenizer.apply_chat_template(with_tools_prompt(messages, tools),
                                             add_generation_prompt=add_generation_prompt)
    # TODO(move): Tokenizer.apply_chat_template should take tools= (and template kwargs); then call it here
    return _compiled_template(tokenizer.chat_template).render(
        messages=[dict(m) for m in messages], tools=[schema_of(t) for t in tools],
        add_generation_prompt=add_generation_prompt, bos_token=tokenizer.bos_token or "",
        eos_token=tokenizer.eos_token or "", pad_token=tokenizer.pad_token or "", unk_token=tokenizer.unk_token or "")


def turn_end(tokenizer, tools: Tools = None) -> tuple[str, str]:
    """(end-of-turn token, separator) the template writes after an assistant message's content: the first special
    token after it (ChatML ``<|im_end|>``, the id the policy's turn must end with) and the text after that token
    (ChatML ``"\\n"``), found by rendering a probe conversation.

    Raises:
        TemplatePrefixError: the template cannot render the probe or writes no special token after the content.
    """
    probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
    try:
        text = render(tokenizer, probe, tools, add_generation_prompt=False)
    except Exception as err:  # noqa: BLE001 - templates raise what they like
        raise TemplatePrefixError(f"the chat template cannot render a user/assistant probe: {type(err).__name__}: "
                                  f"{' '.join(str(err).split())[:200]}") from None
    tail = text.partition(_PROBE)[2]
    found = [(tail.find(s), -len(s), s) for s in tokenizer.special_tokens if s in tail]
    if not found:
        raise TemplatePrefixError(f"the chat template writes no special token after an assistant message "
                                  f"(it writes {tail!r}): the end of a sampled turn cannot be located")
    start, _, token = min(found)
    return token, tail[start + len(token):]


def suffix_ids(tokenizer, prefix_messages: Messages, new_messages: Messages, tools: Tools = None,
               add_generation_prompt: bool = True) -> Suffix:
    """The ids to append after the policy's last turn (the last message of `prefix_messages`, an assistant one,
    whose sampled ids end with the end-of-turn token) for `new_messages` (a step's tool results / user turn,
    together): the separator apart, then render(prefix + new) minus render(prefix), tokenized alone.

    Raises:
        ValueError: `prefix_messages` does not end with an assistant message.
        TemplatePrefixError: render(prefix) is not a string prefix of render(prefix + new), or it does not end with
            the end of turn and separator (`turn_end`); the message names the first differing token and character.
    """
    prefix_messages, new_messages = list(prefix_messages), list(new_messages)
    if not prefix_messages or prefix_messages[-1].get("role") != "assistant":
        raise ValueError("suffix_ids: prefix_messages must end with the assistant message the policy sampled")
    head = render(tokenizer, prefix_messages, tools, add_generation_prompt=False)
    full = render(tokenizer, prefix_messages + new_messages, tools, add_generation_prompt=add_generation_prompt)
    if not full.startswith(head):
        raise TemplatePrefixError(f"the chat template renders the first {len(prefix_messages)} messages differently "
                                  f"once {len(new_messages)} more follow: {_difference(tokenizer, head, full)}")
    token, separator = turn_end(tokenizer, tools)
    if not head.endswith(token + separator):
        raise TemplatePrefixError(f"the rendered assistant turn does not end with the template's end of turn "
                                  f"{token + separator!r} but with {head[-len(token + separator) - 10:]!r}")
    text = full[len(head):]
    return Suffix(tokenizer.encode(separator) if separator else [], tokenizer.encode(text) if text else [], text)


def check_prefix_preserving(tokenizer, tools: Tools = None, *, with_user_turn: bool = False) -> None:
    """Refuse a chat template under which the loop's ids (module docstring) differ from the full conversation
    rendered and tokenized: it renders a fixed conversation (user; assistant with ``<think>`` and a tool call;
    tool result; assistant; with `with_user_turn`, another user turn and answer, as an environment injects)
    turn by turn and in full. `tools`: the job's (default: a probe calculator). Returns None when they agree.

    Raises:
        TemplatePrefixError: one line naming the first differing token position, e.g. for a template that strips
            earlier ``<think>`` blocks (Qwen3-style), or whose turns are not separated by special tokens.
    """
    tools = list(tools) if tools else [_PROBE_TOOL]
    conversation = _probe_conversation(with_user_turn)
    what = "the chat template does not preserve prefixes (the conversation rendered turn by turn vs in full)"
    try:
        ids = _incremental_ids(tokenizer, conversation, tools)
    except TemplatePrefixError as err:
        raise TemplatePrefixError(f"{what}: {err}") from None
    full = tokenizer.encode(render(tokenizer, conversation, tools, add_generation_prompt=False))
    if ids != full:
        raise TemplatePrefixError(f"{what}: the ids differ at {_id_difference(tokenizer, ids, full)}")


def _incremental_ids(tokenizer, conversation: list[dict], tools: Tools) -> list[int]:
    """The ids the loop holds after `conversation`: its prompt, each assistant turn as sampled (through the end of
    turn), then each step's separator and suffix, the last separator included."""
    starts = [i for i, m in enumerate(conversation) if m["role"] == "assistant"]
    held = render(tokenizer, conversation[:starts[0]], tools, add_generation_prompt=True)
    ids = tokenizer.encode(held)
    _, separator = turn_end(tokenizer, tools)
    for k, i in enumerate(starts):
        turn = render(tokenizer, conversation[:i + 1], tools, add_generation_prompt=False)
        if not turn.startswith(held):
            raise TemplatePrefixError(f"assistant message {i} changes the text before it: "
                                      f"{_difference(tokenizer, held, turn)}")
        ids += tokenizer.encode(turn[len(held):len(turn) - len(separator)])  # as sampled: through the end of turn
        following = starts[k + 1] if k + 1 < len(starts) else len(conversation)
        more = following < len(conversation)
        suffix = suffix_ids(tokenizer, conversation[:i + 1], conversation[i + 1:following], tools, more)
        ids += suffix.separator_ids + suffix.ids
        held = turn + suffix.text
    return ids


def _difference(tokenizer, earlier: str, later: str) -> str:
    """Where `later` stops extending `earlier`: the first differing token of their encodings, and character."""
    char = next((k for k, (a, b) in enumerate(zip(earlier, later)) if a != b), min(len(earlier), len(later)))
    return f"{_id_difference(tokenizer, tokenizer.encode(earlier), tokenizer.encode(later))} (character {char})"


def _id_difference(tokenizer, first: list[int], second: list[int]) -> str:
    """"token t: 'x' vs 'y'", t the first position where the two id lists differ (one may end there)."""
    t = next((k for k, (a, b) in enumerate(zip(first, second)) if a != b), min(len(first), len(second)))

    def shown(ids: list[int]) -> str:
        return repr(tokenizer.decode(ids[t:t + 1], skip_special_tokens=False)) if t < len(ids) else "the end"

    return f"token {t}: {shown(first)} vs {shown(second)}"


_PROBE_TOOL = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string", "description": "The expression."}},
                   "required": ["expression"]}}}


def _probe_conversation(with_user_turn: bool) -> list[dict[str, Any]]:
    """The fixed conversation of `check_prefix_preserving`: the call in the assistant message's ``tool_calls``
    (rendered by a template with tool support, else written back as Hermes text by `render`)."""
    call = {"name": "calculator", "arguments": {"expression": "12 * 34"}}
    said = "<think>\nI should use the calculator.\n</think>\n\nLet me use the calculator."
    conversation = [{"role": "user", "content": "What is 12 * 34?"},
                    {"role": "assistant", "content": said, "tool_calls": [{"type": "function", "function": call}]},
                    {"role": "tool", "name": "calculator", "content": "408"},
                    {"role": "assistant", "content": "<think>\nThe tool says 408.\n</think>\n\n12 * 34 = 408."}]
    if with_user_turn:
        conversation += [{"role": "user", "content": "And 408 + 1?"},
                         {"role": "assistant", "content": "<think>\nOne more.\n</think>\n\n409."}]
    return conversation
