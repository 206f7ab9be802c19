"""Encoding chats so that only the chat template's own markers become control tokens.

Text that comes from data (message contents) may spell a control token, e.g. an answer quoting `<|im_end|>`.
`tokenizers` matches special added tokens anywhere in its input, so encoding the rendered chat as one string
turns such text into a real end-of-turn id. Here the chat is rendered twice: once as it is, once with every
content replaced by a placeholder, which shows where the template put each content (a template that trims
content is handled; one that rewrites it otherwise is refused when the content spells a control token). Control
tokens are then matched only in the template's text; each stretch between two of them (template text and
content together) is encoded with `Tokenizer.encode_text`, which treats control-token spellings as text.
Without control-token text in the contents the ids equal those of encoding the whole rendered string.

`cuts` (character positions) force token boundaries, e.g. where an assistant turn starts, so that a region of
the text maps to whole tokens.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from astrai.data.files import DataError

__all__ = ["RenderedChat", "render_chat", "encode_rendered", "encode_chat"]

_SLOT = re.compile("\ue000(\\d+)\ue001")  # private-use characters: a content placeholder


@dataclass(frozen=True)
class RenderedChat:
    """A rendered chat.

    Attributes:
        text: the template's output.
        spans: (start, end, message index) character spans of the message contents in `text`, in text order;
            empty when the template rewrote content that spells no control token (then nothing needs them).
    """

    text: str
    spans: tuple[tuple[int, int, int], ...]


def render_chat(tokenizer, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool,
                where: str = "chat") -> RenderedChat:
    """Render `messages` with the chat template and locate each content in the output.

    Raises:
        DataError: naming `where` when the template rewrites a content that spells a control token (its
            position cannot be known, so its text cannot be kept apart from the template's markers).
    """
    messages = [dict(m) for m in messages]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    probe = [dict(m, content=f"\ue000{i}\ue001") for i, m in enumerate(messages)]
    skeleton = tokenizer.apply_chat_template(probe, add_generation_prompt=add_generation_prompt)
    for fill in (lambda c: c, str.strip):
        rebuilt, spans, last = [], [], 0
        for match in _SLOT.finditer(skeleton):
            rebuilt.append(skeleton[last:match.start()])
            index = int(match.group(1))
            content = fill(messages[index]["content"])
            start = sum(len(p) for p in rebuilt)
            rebuilt.append(content)
            spans.append((start, start + len(content), index))
            last = match.end()
        rebuilt.append(skeleton[last:])
        if "".join(rebuilt) == text:
            return RenderedChat(text, tuple(spans))
    specials = tokenizer.special_tokens
    if any(s in m["content"] for m in messages for s in specials):
        raise DataError(f"{where}: the chat template rewrites message contents, so text that spells a control "
                        f"token cannot be kept apart from the template's markers")
    return RenderedChat(text, ())


def encode_rendered(tokenizer, chat: RenderedChat, cuts: Sequence[int] = ()) -> tuple[list[int], list[int]]:
    """(ids, start character of each token) of `chat.text`: control tokens matched only outside the content
    spans, every other stretch encoded as text (`Tokenizer.encode_text`), a token boundary at each of `cuts`."""
    specials = tokenizer.special_tokens
    pattern = re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True))) if specials \
        else None
    text = chat.text
    outside, last = [], 0
    for start, end, _ in chat.spans:
        outside.append((last, start))
        last = end
    outside.append((last, len(text)))
    marks: list[tuple[int, int, int | None]] = [(c, c, None) for c in cuts if 0 < c < len(text)]
    if pattern is not None:
        for lo, hi in outside:
            marks.extend((m.start(), m.end(), specials[m.group(0)]) for m in pattern.finditer(text, lo, hi))
    marks.sort(key=lambda m: (m[0], m[1]))
    pieces: list[tuple[str, int, Any]] = []  # ("text", start, str) or ("id", start, id)
    position = 0
    for start, end, token in marks:
        if start > position:
            pieces.append(("text", position, text[position:start]))
        if token is not None:
            pieces.append(("id", start, token))
        position = max(position, end)
    if position < len(text):
        pieces.append(("text", position, text[position:]))
    texts = [p[2] for p in pieces if p[0] == "text"]
    encoded = iter(tokenizer.text_backend.encode_batch(texts, add_special_tokens=False) if texts else [])
    ids: list[int] = []
    starts: list[int] = []
    for kind, start, value in pieces:
        if kind == "id":
            ids.append(value)
            starts.append(start)
            continue
        enc = next(encoded)
        ids.extend(enc.ids)
        starts.extend(start + offset[0] for offset in enc.offsets)
    return ids, starts


def encode_chat(tokenizer, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                where: str = "chat") -> list[int]:
    """Token ids of a chat (see the module docstring). Raises what `render_chat` raises."""
    return encode_rendered(tokenizer, render_chat(tokenizer, messages, add_generation_prompt=add_generation_prompt,
                                                  where=where))[0]
