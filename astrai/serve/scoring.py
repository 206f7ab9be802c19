"""Prompt scoring: `/v1/completions` with `echo: true` and `max_tokens: 0` returns the log-probs of the prompt's own
tokens (vLLM's and OpenAI's legacy convention), which a served teacher of on-policy distillation answers
(`astrai.experience.served_teacher`).

Each prompt is run through the served model in one no-grad forward; token t (t >= 1) gets
`log_softmax(logits[t - 1])[ids[t]]`, float32, of the raw distribution (no temperature, as vLLM's prompt log-probs);
the first token has none (`null`), as OpenAI answers.
"""

from __future__ import annotations

import threading
from typing import Sequence

import torch

from astrai.serve.logprobs import TokenLogprob, TokenText, completion_logprobs

__all__ = ["PromptScorer"]


class PromptScorer:
    """Scores prompts with the engine's model copy (`engine.model`, an `AutoRegressiveLM` returning logits (1, S, V)),
    one prompt per forward, one scoring at a time (a lock: the HTTP handlers call it from worker threads while the
    engine loop's thread decodes)."""

    def __init__(self, engine, text_of: TokenText):
        self.model, self.device, self.text_of = engine.model, engine.device, text_of
        self._lock = threading.Lock()

    @torch.no_grad()
    def token_logprobs(self, ids: Sequence[int], k: int) -> list[TokenLogprob]:
        """(token id, log-prob, k most likely (id, log-prob)) of tokens 1 .. S - 1 of `ids` (S >= 1) under the
        model: natural log, float32; empty for a one-token prompt."""
        if len(ids) < 2:
            return []
        with self._lock:
            logits = self.model(torch.tensor([list(ids)], device=self.device))[0, :-1].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        targets = torch.tensor(ids[1:], device=logprobs.device)
        chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
        top = logprobs.topk(k, dim=-1) if k else None
        alternatives = ([list(zip(i.tolist(), v.tolist())) for v, i in zip(top.values, top.indices)] if top is not None
                        else [[] for _ in chosen])
        return list(zip(ids[1:], chosen, alternatives))

    def echo_choice(self, index: int, ids: Sequence[int], k: int) -> dict:
        """The completions `choice` of prompt `ids` echoed with its log-probs: `text` the prompt's tokens spelled
        out, `logprobs` with `null` for the first token (nothing precedes it) and `finish_reason` "length" (no token
        was generated: max_tokens 0)."""
        first = self.text_of(ids[0])[0]
        rest, _ = completion_logprobs(self.text_of, self.token_logprobs(ids, k), offset=len(first))
        logprobs = {"tokens": [first, *rest["tokens"]], "token_logprobs": [None, *rest["token_logprobs"]],
                    "top_logprobs": [None, *rest["top_logprobs"]], "text_offset": [0, *rest["text_offset"]]}
        return {"index": index, "text": "".join(logprobs["tokens"]), "logprobs": logprobs, "finish_reason": "length"}
