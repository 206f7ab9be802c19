"""A served teacher for on-policy distillation: `distill.teacher` given as the base URL of an OpenAI-compatible
server (`http://host:8000/v1`, `astrai.config.DistillSection.served`: astrai's own `python -m astrai.serve`, or vLLM) scores the student's sampled tokens
remotely instead of a local copy of the teacher. The URL is the API root, used as given (as OpenAI clients use
`base_url`: routes are `{url}/models` and `{url}/completions`, so it usually ends in `/v1`); a 404 on `{url}/models`
is refused in one line saying so.

Each rollout's rows are sent as token-id prompts (prompt and response, the response's tool and environment tokens
included) to `{url}/completions` with `echo: true`, `max_tokens: 0` and `logprobs: 0`, the convention by which vLLM and
astrai's server return the log-probs of a prompt's own tokens; the response tokens' entries are the teacher's
`log pi_teacher(a_t)` (natural log, float32, of its raw distribution: no temperature, which is why a served teacher
needs `rollout.temperature` 1). The served model is the first of `GET {url}/models`, its context `max_model_len` when
the server says it (vLLM and astrai's server do); `OPENAI_API_KEY`, when set, is sent as the bearer token. A row
longer than the server's context is answered 400 (`context_length_exceeded`), which stops the job in one line naming
`distill.teacher` (or the `distill.teachers.<route>` entry that names the server: several teachers routed by a data
column, `astrai.experience.teachers`). Only the standard library speaks HTTP here.

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
    the teacher's field (`distill.teacher`, or `distill.teachers.<route>`), the URL and the cause (exit code 2 from
    the trainer)."""


class ServedTeacher:
    """Scores response tokens with a teacher behind an OpenAI-compatible server (see the module docstring).

    Args:
        base_url: the server's API root as OpenAI clients take it, e.g. `http://127.0.0.1:8000/v1` (used as given:
            nothing is appended).
        timeout_seconds: per HTTP request; retries: further attempts after a connection error or a 5xx answer,
            1 s, 2 s, 4 s ... apart.
        rows_per_request: rows sent in one request.
        field: the config field that names this teacher, which every error message starts with
            (`distill.teacher`, or `distill.teachers.<route>` for one of several routed teachers).

    Attributes:
        model: the served model's id; max_model_len: its context in tokens when `/models` says it, else None.

    Raises:
        TeacherServerError: the server does not answer `GET {base_url}/models` (a 404 says the URL must be the API
            root), or serves no model.
    """

    def __init__(self, base_url: str, *, timeout_seconds: float = 300.0, retries: int = 3,
                 rows_per_request: int = 16, field: str = "distill.teacher"):
        self.field = field
        self.base_url = base_url.strip().rstrip("/")
        self.timeout_seconds, self.retries, self.rows_per_request = timeout_seconds, retries, rows_per_request
        self.model, self.max_model_len = "", None
        try:
            models = self._call("GET", "/models").get("data") or []
        except _NotFound as err:
            raise TeacherServerError(f"{err}; {self.field} must be the server's API root, where /models and "
                                     f"/completions are (e.g. http://host:8000/v1)") from None
        if not models or not isinstance(models[0], dict) or "id" not in models[0]:
            raise TeacherServerError(f"{self.field}: {self.base_url}/models lists no model")
        self.model = models[0]["id"]
        context = models[0].get("max_model_len")
        self.max_model_len = context if isinstance(context, int) and context > 0 else None

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
            raise TeacherServerError(f"{self.field}: {self.base_url} echoed {len(echoed)} tokens for {len(ids)} "
                                     "token ids: it does not score token-id prompts as sent")
        for position, (theirs, mine) in enumerate(zip(echoed, ours)):
            if theirs != mine:
                raise TeacherServerError(
                    f"{self.field}: {self.base_url} ({self.model}) does not share the student's tokenizer: token "
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
                    raise TeacherServerError(f"{self.field}: {self.base_url} scored {len(values)} tokens of a "
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
            raise TeacherServerError(f"{self.field}: {self.base_url}/completions answered {len(choices)} choices "
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
                detail, code = _error_message(err)
                if code == "context_length_exceeded" or "maximum context length" in detail:
                    raise TeacherServerError(
                        f"{self.field}: {self.base_url} ({self.model}) cannot score a row this long: {detail}; "
                        "its context must hold data.max_prompt_length + rollout.max_new_tokens tokens") from None
                if err.code < 500 or attempt == self.retries:
                    kind = _NotFound if err.code == 404 else TeacherServerError
                    raise kind(f"{self.field}: {method} {url} answered {err.code}: {detail}") from None
            except (urllib.error.URLError, OSError, json.JSONDecodeError) as err:
                if attempt == self.retries:
                    reason = getattr(err, "reason", err)
                    raise TeacherServerError(f"{self.field}: {method} {url} failed after {self.retries + 1} "
                                             f"attempts: {reason}") from None
            time.sleep(2 ** attempt)
        raise AssertionError("unreachable")


class _NotFound(TeacherServerError):
    """A 404 answer: the URL is not the API root (or the server lacks the route)."""


def _error_message(err: urllib.error.HTTPError) -> tuple[str, Optional[str]]:
    """(message, code) of the OpenAI-shaped error of an HTTP error answer, else (its first line, None); the message
    on one line."""
    text = None
    try:
        text = err.read().decode(errors="replace")
        error = json.loads(text)["error"]
        code = error.get("code")
        return " ".join(str(error["message"]).split()), code if isinstance(code, str) else None
    except (ValueError, KeyError, TypeError, AttributeError, OSError):
        lines = text.strip().splitlines() if text else []
        return str(lines[0] if lines else err.reason), None
