"""Incremental detokenization of one choice, with stop strings and finish reasons.

Tokens arrive one at a time (streaming) or all at once; `TextStream.push` returns the text that is safe to send:
- a token that ends inside a multi-byte UTF-8 character decodes to U+FFFD; that tail waits for the next token;
- text that could be the beginning of a stop string is held back until it is known not to be one;
- a stop string ends the choice (`finish_reason` "stop"; the stop string itself is not part of the text), as
  does a stop token (EOS); reaching `max_tokens` gives "length". Tokens after the end are ignored.
"""

from __future__ import annotations

from typing import Optional, Sequence

__all__ = ["TextStream"]

_REPLACEMENT = "\ufffd"


class TextStream:
    """Text of one choice built token by token.

    Args:
        tokenizer: has `decode(ids, skip_special_tokens=True) -> str`.
        stop: stop strings (each non-empty).
        stop_token_ids: token ids that end the choice (not part of the text).
        max_tokens: the choice's token budget (the engine's max_new_tokens).

    Attributes: `text` (sent so far), `finish_reason` (None, "stop" or "length"), `num_tokens` (tokens pushed
    before the end, the stop token included).
    """

    def __init__(self, tokenizer, *, stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (),
                 max_tokens: int):
        self.tokenizer, self.stop, self.stop_token_ids = tokenizer, tuple(stop), frozenset(stop_token_ids)
        self.max_tokens = max_tokens
        self.ids: list[int] = []
        self.text = ""
        self.finish_reason: Optional[str] = None
        self.num_tokens = 0

    def push(self, token: int) -> str:
        """Add one sampled token; returns the new text to send (possibly "")."""
        if self.finish_reason is not None:
            return ""
        self.num_tokens += 1
        if token in self.stop_token_ids:
            return self._end("stop", self._cut(self._decoded(final=True)))
        self.ids.append(token)
        at_limit = len(self.ids) >= self.max_tokens
        full = self._decoded(final=at_limit)
        cut = self._find_stop(full)
        if cut is not None:
            return self._end("stop", full[:cut])
        if at_limit:
            return self._end("length", full)
        return self._send(full[:len(full) - self._held_back(full)])

    def finish(self, finished: bool) -> str:
        """End the choice when the engine says it is done (`finished`: a stop token ended it); returns the rest."""
        if self.finish_reason is not None:
            return ""
        text = self._decoded(final=True)
        cut = self._cut(text)
        return self._end("stop" if finished or cut != text else "length", cut)

    def _decoded(self, *, final: bool) -> str:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not final:
            text = text.rstrip(_REPLACEMENT)  # an unfinished UTF-8 character: wait for its next byte(s)
        return text

    def _cut(self, text: str) -> str:
        """`text` up to its first stop string (all of it when there is none)."""
        cut = self._find_stop(text)
        return text if cut is None else text[:cut]

    def _find_stop(self, text: str) -> Optional[int]:
        """Index of the earliest stop string in `text` at or after the part not yet checked, else None."""
        hits = [i for i in (text.find(s, max(0, len(self.text) - len(s))) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _held_back(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        return max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)

    def _send(self, upto: str) -> str:
        if len(upto) <= len(self.text) or not upto.startswith(self.text):
            return ""
        delta, self.text = upto[len(self.text):], upto
        return delta

    def _end(self, reason: str, text: str) -> str:
        delta = self._send(text)
        self.finish_reason = reason
        return delta
