"""Log-probabilities in OpenAI's response shapes, and the text and bytes of single tokens.

The values are the engine's behaviour log-probs (docs/conventions.md section 2): `log_softmax(logits / temperature)`
of the distribution before top-p and the frequency penalty, for the sampled token and the k most likely ones.
Shapes (OpenAI API reference):
- chat: `choice.logprobs = {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}, ...]}, ...], "refusal": None}`;
- completions: `choice.logprobs = {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}, ...],
  "text_offset": [...]}`, offsets counted in characters from the start of the completion text.
A token whose bytes are not valid UTF-8 on their own (part of a multi-byte character) is spelled `bytes:\\xNN...`
as OpenAI does; `bytes` always holds its exact UTF-8 bytes.
"""

from __future__ import annotations

import re
from typing import Sequence

from astrai.models.tokenizer import byte_alphabet

__all__ = ["TokenText", "chat_logprobs", "completion_logprobs"]

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")

TokenLogprob = tuple[int, float, Sequence[tuple[int, float]]]
"""(token id, log-prob, k most likely (token id, log-prob) pairs) of one generated token."""


class TokenText:
    """Exact bytes and display text of single tokens of `tokenizer` (cached per id).

    Byte-level BPE spellings (GPT-2's byte alphabet, `astrai.models.tokenizer.byte_alphabet`) map back to their
    bytes; SentencePiece byte-fallback tokens (`<0xNN>`) to their byte; special tokens and anything else to the
    UTF-8 of `tokenizer.decode([id], skip_special_tokens=False)`.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend", None)
        self._unbyte = {char: byte for byte, char in byte_alphabet().items()}
        specials = getattr(tokenizer, "special_tokens", None)
        self._special = set(specials.values()) if isinstance(specials, dict) else set()
        self._cache: dict[int, tuple[str, bytes]] = {}

    def _bytes(self, token_id: int) -> bytes:
        spelling = self._backend.id_to_token(token_id) if self._backend is not None else None
        if spelling is not None and token_id not in self._special:
            if all(c in self._unbyte for c in spelling):
                return bytes(self._unbyte[c] for c in spelling)
            match = _BYTE_FALLBACK.fullmatch(spelling)
            if match:
                return bytes([int(match.group(1), 16)])
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8", "replace")

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        """(text, UTF-8 bytes) of one token."""
        hit = self._cache.get(token_id)
        if hit is None:
            raw = self._bytes(token_id)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            hit = self._cache[token_id] = (text, raw)
        return hit


def chat_logprobs(text_of: TokenText, tokens: Sequence[TokenLogprob]) -> dict:
    """`choice.logprobs` of a chat completion (or of one streamed chunk) for `tokens`."""
    content = []
    for token_id, logprob, top in tokens:
        text, raw = text_of(token_id)
        alternatives = []
        for alt_id, alt_logprob in top:
            alt_text, alt_raw = text_of(alt_id)
            alternatives.append({"token": alt_text, "logprob": alt_logprob, "bytes": list(alt_raw)})
        content.append({"token": text, "logprob": logprob, "bytes": list(raw), "top_logprobs": alternatives})
    return {"content": content, "refusal": None}


def completion_logprobs(text_of: TokenText, tokens: Sequence[TokenLogprob], offset: int = 0) -> tuple[dict, int]:
    """(`choice.logprobs` of a text completion or chunk for `tokens`, the text offset after them); `offset` is where
    the first token's text starts in the completion (characters)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, logprob, top in tokens:
        text = text_of(token_id)[0]
        out["tokens"].append(text)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append({text_of(alt)[0]: value for alt, value in top})
        out["text_offset"].append(offset)
        offset += len(text)
    return out, offset
