"""A served teacher for on-policy distillation: `distill.teacher` given as the base URL of an OpenAI-compatible
server (`http://host:8000/v1`, `astrai.config.DistillSection.served`: astrai's own `python -m astrai.serve`, or vLLM) scores the student's sampled tokens
remotely instead of a local copy of the teacher.

Each rollout's rows are sent as token-id prompts (prompt and response, the response's tool and environment tokens
included) to `/v1/completions` with `echo: true`, `max_tokens: 0` and `logprobs: 0`, the convention by which vLLM and
astrai's server return the log-probs of a prompt's own tokens; the response tokens' entries are the teacher's
`log pi_teacher(a_t)` (natural log, float32, of its raw distribution: no temperature, which is why a served teacher
needs `rollout.temperature` 1). The served model is the first of `GET /v1/models`; `OPENAI_API_KEY`, when set, is sent
as the bearer token. Only the standard library speaks HTTP here.

The teacher must share the student's tokenizer: at start-up (`ServedTeacher.check_tokenizer`) a probe text's token
ids are scored and the token strings the server echoes must spell the student's tokens; otherwise the job is refused
in one line (cross-tokenizer distillation is out of scope).
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from typing import Any, Optional

import torch

from astrai.data.sequences import Sequences

__all__ = ["ServedTeacher", "TeacherServerError"]

PROBE = "The teacher scores 12 + 35 = 47, and then: done."
"""ASCII text whose tokens the start-up check sends (no byte-level pieces that servers spell differently)."""


class TeacherServerError(ValueError):
    """The served teacher cannot be reached or answers something else than prompt log-probs; one line naming
    `distill.teacher`, the URL and the cause (exit code 2 from the trainer)."""


class ServedTeacher:
    """Scores response tokens with a teacher behind an OpenAI-compatible server (see the module docstring).

    Args:
        base_url: the server's API root, e.g. `http://127.0.0.1:8000/v1` (a trailing `/v1` is added when missing).
        timeout_seconds: per HTTP request; retries: further attempts after a connection error or a 5xx answer,
            1 s, 2 s, 4 s ... apart.
        rows_per_request: rows sent in one request.

    Raises:
        TeacherServerError: the server does not answer `GET /models` or serves no model.
    """

    def __init__(self, base_url: str, *, timeout_seconds: float = 300.0, retries: int = 3,
                 rows_per_request: int = 16):
        url = base_url.strip().rstrip("/")
        self.base_url = url if url.endswith("/v1") else url + "/v1"
        self.timeout_seconds, self.retries, self.rows_per_request = timeout_seconds, retries, rows_per_request
        models = self._call("GET", "/models").get("data") or []
        if not models or not isinstance(models[0], dict) or "id" not in models[0]:
            raise TeacherServerError(f"distill.teacher: {self.base_url}/models lists no model")
        self.model = models[0]["id"]

    def check_tokenizer(self, tokenizer) -> None:
        """Refuse a teacher whose tokenizer is not the student's (`tokenizer`, an `astrai.models.Tokenizer`): the
        server echoes the token strings of `PROBE`'s ids, which must be the student's own spellings.

        Raises:
            TeacherServerError: naming the first token that differs.
        """
        ids = tokenizer.encode(PROBE)
        echoed = self._echo([ids])[0]["tokens"]
        ours = [tokenizer.decode([i], skip_special_tokens=False) for i in ids]
        if len(echoed) != len(ids):
            raise TeacherServerError(f"distill.teacher: {self.base_url} echoed {len(echoed)} tokens for {len(ids)} "
                                     "token ids: it does not score token-id prompts as sent")
        for position, (theirs, mine) in enumerate(zip(echoed, ours)):
            if theirs != mine:
                raise TeacherServerError(
                    f"distill.teacher: {self.base_url} ({self.model}) does not share the student's tokenizer: token "
                    f"id {ids[position]} is {theirs!r} for the teacher, {mine!r} for the student; the teacher scores "
                    "the student's token ids, so cross-tokenizer distillation is not supported")

    def response_logprobs(self, sequences: Sequences) -> torch.Tensor:
        """The teacher's log-probs (B, T) float32 of `sequences`' response tokens (every real token of the
        response: `attention_mask[:, P:]`), 0 at padding; on `sequences.input_ids.device`.

        Raises:
            TeacherServerError: the server failed after the retries, or answered with the wrong number of tokens.
        """
        mask = sequences.attention_mask
        p, width = sequences.prompt_length, sequences.input_ids.shape[1] - sequences.prompt_length
        rows = [sequences.input_ids[b][mask[b]].tolist() for b in range(mask.shape[0])]
        prompt_lengths = mask[:, :p].sum(dim=1).tolist()
        out = torch.zeros(len(rows), width, dtype=torch.float32)
        for first in range(0, len(rows), self.rows_per_request):
            chunk = rows[first:first + self.rows_per_request]
            for b, (ids, logprobs) in enumerate(zip(chunk, self._echo(chunk)), start=first):
                values = logprobs["token_logprobs"]
                if len(values) != len(ids):
                    raise TeacherServerError(f"distill.teacher: {self.base_url} scored {len(values)} tokens of a "
                                             f"{len(ids)}-token row")
                response = values[prompt_lengths[b]:]
                out[b, :len(response)] = torch.tensor(response, dtype=torch.float32)
        return out.to(sequences.input_ids.device)

    def _echo(self, prompts: list[list[int]]) -> list[dict]:
        """The `logprobs` object of each prompt's echoed choice, in prompt order."""
        body = self._call("POST", "/completions", {"model": self.model, "prompt": prompts, "echo": True,
                                                   "max_tokens": 0, "logprobs": 0, "temperature": 1.0})
        choices = sorted(body.get("choices") or [], key=lambda c: c.get("index", 0))
        if len(choices) != len(prompts) or any(not isinstance(c.get("logprobs"), dict) for c in choices):
            raise TeacherServerError(f"distill.teacher: {self.base_url}/completions answered {len(choices)} choices "
                                     f"with log-probs for {len(prompts)} prompts (it needs echo with max_tokens 0)")
        return [c["logprobs"] for c in choices]

    def _call(self, method: str, path: str, payload: Optional[dict] = None) -> dict[str, Any]:
        """One JSON request with retries on connection errors and 5xx answers; TeacherServerError otherwise."""
        url = self.base_url + path
        headers = {"content-type": "application/json"}
        if os.environ.get("OPENAI_API_KEY"):
            headers["authorization"] = f"Bearer {os.environ['OPENAI_API_KEY']}"
        data = None if payload is None else json.dumps(payload).encode()
        for attempt in range(self.retries + 1):
            request = urllib.request.Request(url, data=data, method=method, headers=headers)
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_seconds) as answer:
                    return json.loads(answer.read().decode())
            except urllib.error.HTTPError as err:
                detail = _error_message(err)
                if err.code < 500 or attempt == self.retries:
                    raise TeacherServerError(f"distill.teacher: {method} {url} answered {err.code}: {detail}") from None
            except (urllib.error.URLError, OSError, json.JSONDecodeError) as err:
                if attempt == self.retries:
                    reason = getattr(err, "reason", err)
                    raise TeacherServerError(f"distill.teacher: {method} {url} failed after {self.retries + 1} "
                                             f"attempts: {reason}") from None
            time.sleep(2 ** attempt)
        raise AssertionError("unreachable")


def _error_message(err: urllib.error.HTTPError) -> str:
    """The OpenAI-shaped error's message of an HTTP error answer, else its first line."""
    try:
        text = err.read().decode(errors="replace")
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError, OSError):
        return (text.strip().splitlines() or [err.reason])[0] if "text" in locals() else str(err.reason)
