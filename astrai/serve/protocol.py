"""OpenAI API request bodies (pydantic), their validation, and the mapping to engine `SamplingParams`.

Field names, ranges and defaults follow the OpenAI API reference for `/v1/completions` and `/v1/chat/completions`.
Unknown fields are ignored (clients send many optional ones); fields the engine cannot honour
(`presence_penalty`, `logit_bias`, `best_of`, `suffix`, non-text message parts, `echo` with generated tokens)
are rejected with a 400 naming them when they ask for something, rather than silently dropped. `echo` with
`max_tokens: 0` scores the prompt instead (`astrai.serve.scoring`). `ignore_eos` is vLLM's extension
(generate exactly `max_tokens` tokens, as load benchmarks need). Text that cannot be encoded as UTF-8 (a lone
surrogate such as "\ud800", which JSON allows) is refused with a 400 naming the field, as is a NaN or infinite number
(`allow_inf_nan` off). A chat message needs a known role (`ROLES`) and content that is a string or a non-empty list
of text parts, null only on an assistant message with `tool_calls` (`message_text`). `tools`, `tool_choice` and
`parallel_tool_calls` are checked by `astrai.serve.tools`.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from astrai.rollout.sampling import MIN_TEMPERATURE, SamplingParams
from astrai.rollout.row_sampling import FrequencyPenalty

__all__ = ["APIError", "CompletionRequest", "ChatCompletionRequest", "ChatMessage", "ROLES", "check_text",
           "logprobs_k", "sampling_for", "stop_strings", "message_text"]

MAX_STOP = 4
"""Most stop strings per request (the OpenAI limit)."""
MAX_TOP_LOGPROBS = {"completions": 5, "chat": 20}
"""Largest `logprobs` (completions) and `top_logprobs` (chat) OpenAI accepts."""


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with HTTP `status`."""

    def __init__(self, message: str, *, status: int = 400, param: Optional[str] = None,
                 code: Optional[str] = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.kind = message, status, param, code, kind

    def body(self) -> dict:
        """The OpenAI-shaped JSON body."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


NO_EFFECT_FIELDS = ("metadata", "store", "service_tier")
"""OpenAI request fields that change nothing about the answer (bookkeeping on OpenAI's side): accepted and unused.
Any other field this server does not know is refused (`unsupported_parameter`), never silently ignored."""


class _Sampling(BaseModel):
    """Fields shared by both endpoints. Every number must be finite: JSON's NaN / Infinity extensions (which Python's
    parser accepts) are refused as such (`allow_inf_nan=False`), not reported as out of a field's range."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, ge=0, le=1)
    n: int = Field(1, ge=1)
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = Field(None, ge=-(2**63), lt=2**64)
    stream: bool = False
    stream_options: Optional[dict[str, Any]] = None
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    ignore_eos: bool = False
    top_k: Optional[int] = Field(None, ge=-1)  # vLLM's extension: keep the k most likely tokens; 0 or -1 = off
    response_format: Optional[dict[str, Any]] = None

    def unsupported(self) -> list[str]:
        """Names of fields that ask for something this server does not do: an option it does not implement, or a
        field it does not know (except `NO_EFFECT_FIELDS`)."""
        bad = ["presence_penalty"] if self.presence_penalty else []
        bad += ["logit_bias"] if self.logit_bias else []
        bad += ["response_format"] if self.response_format not in (None, {"type": "text"}) else []
        return bad + sorted(k for k in (self.model_extra or {}) if k not in NO_EFFECT_FIELDS)


class CompletionRequest(_Sampling):
    """`POST /v1/completions`: `prompt` is a string, a list of strings, a token-id list or a list of those."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = Field(16, ge=0)  # 0 only with echo: score the prompt (vLLM's convention)
    echo: bool = False
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS["completions"])
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported() + (["suffix"] if self.suffix else [])
        return bad + (["best_of"] if self.best_of not in (None, 1) else [])

    def scores_prompt(self) -> bool:
        """Whether this request asks for the prompt's own log-probs (`echo` with `max_tokens` 0), not a completion.

        Raises:
            APIError: `echo` with tokens to generate, `max_tokens` 0 without `echo`, or a scoring request that
                streams or asks for several choices (naming the field).
        """
        if self.echo and self.max_tokens != 0:
            raise APIError("echo: supported with max_tokens 0 (the prompt's own log-probs, vLLM's convention), not "
                           "together with generated tokens", param="echo", code="unsupported_parameter")
        if not self.echo and self.max_tokens == 0:
            raise APIError("max_tokens: 0 generates nothing; it is meant with echo true (the prompt's log-probs)",
                           param="max_tokens")
        if self.echo and (self.stream or self.n != 1):
            param = "stream" if self.stream else "n"
            raise APIError(f"{param}: not supported when scoring a prompt (echo with max_tokens 0)", param=param,
                           code="unsupported_parameter")
        return self.echo


ROLES = ("system", "developer", "user", "assistant", "tool")
"""The chat message roles this server renders (OpenAI's, `developer` rendered as `system`)."""


class ChatMessage(BaseModel):
    """One chat message: a `role` of `ROLES` and its `content`, checked by `message_text` (a string or a non-empty
    list of `{"type": "text", "text": ...}` parts; null only on an assistant message with `tool_calls`)."""

    model_config = ConfigDict(extra="allow")

    role: str = Field(None, validate_default=True)  # a missing role is refused by `_known_role` too
    content: Any = None

    @field_validator("role", mode="before")
    @classmethod
    def _known_role(cls, role: Any) -> str:
        if role not in ROLES:
            got = "none (the field is missing or null)" if role is None else repr(role)
            raise ValueError(f"expected one of {', '.join(repr(r) for r in ROLES)}, got {got}")
        return role


class ChatCompletionRequest(_Sampling):
    """`POST /v1/chat/completions`: messages rendered with the tokenizer's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS["chat"])
    tools: Optional[list[Any]] = None  # OpenAI function tools, checked by `astrai.serve.tools.tool_setup`
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None


def check_supported(request: _Sampling) -> None:
    """Raise APIError (400, naming the field) when the request asks for an unsupported feature."""
    for name in request.unsupported():
        raise APIError(f"'{name}' is not supported by this server", param=name, code="unsupported_parameter")


def logprobs_k(request: _Sampling) -> Optional[int]:
    """How many most likely tokens to report with each generated one: None = no logprobs at all (completions
    `logprobs`; chat `logprobs` + `top_logprobs`, default 0). APIError for chat `top_logprobs` without `logprobs`."""
    if isinstance(request, ChatCompletionRequest):
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError("top_logprobs: requires logprobs to be true", param="top_logprobs")
        return (request.top_logprobs or 0) if request.logprobs else None
    return getattr(request, "logprobs", None)


def check_text(text: str, param: str) -> str:
    """`text` if it encodes as UTF-8; APIError (400, naming `param`) for a lone surrogate such as "\ud800"."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise APIError(f"{param}: not valid Unicode text (a lone surrogate, U+{ord(text[err.start]):04X}, at "
                       f"character {err.start})", param=param) from None
    return text


def message_text(message: ChatMessage, index: int) -> dict[str, str]:
    """`{"role", "content"}` of `messages[index]`, list-of-parts content joined.

    Content is a string, or a non-empty list of `{"type": "text", "text": str}` parts; null (or absent) only on an
    assistant message with `tool_calls` (OpenAI's rule), rendered as "".

    Raises:
        APIError: 400 naming the field (`messages.[i].content`, or the part's `.type` / `.text`): null content
            elsewhere, an empty list, a part that is not a text part, content of another type, invalid text.
    """
    where = f"messages.[{index}].content"
    content = message.content
    if content is None:
        if message.role == "assistant" and (message.model_extra or {}).get("tool_calls"):
            return {"role": "assistant", "content": ""}
        raise APIError(f"{where}: expected a string or a list of text parts, got null (null content is allowed only "
                       "on an assistant message with tool_calls)", param=where)
    if isinstance(content, list):
        if not content:
            raise APIError(f"{where}: expected a string or a non-empty list of text parts, got an empty list",
                           param=where)
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                raise APIError(f"{where}.[{j}]: expected a text part {{\"type\": \"text\", \"text\": ...}}, got "
                               f"{_json_type(part)}", param=f"{where}.[{j}]")
            if part.get("type") != "text":
                raise APIError(f"{where}.[{j}].type: only text parts ('text') are supported, got "
                               f"{part.get('type')!r}", param=f"{where}.[{j}].type")
            if not isinstance(part.get("text"), str):
                got = _json_type(part["text"]) if "text" in part else "none (the field is missing)"
                raise APIError(f"{where}.[{j}].text: expected a string, got {got}", param=f"{where}.[{j}].text")
            texts.append(part["text"])
        content = "".join(texts)
    elif not isinstance(content, str):
        raise APIError(f"{where}: expected a string or a list of text parts, got {_json_type(content)}", param=where)
    role = "system" if message.role == "developer" else message.role
    return {"role": role, "content": check_text(content, where)}


def _json_type(value: Any) -> str:
    """The JSON type name of a parsed value, for error messages."""
    if value is None:
        return "null"
    for kind, name in ((bool, "a boolean"), ((int, float), "a number"), (str, "a string"), (list, "an array"),
                       (dict, "an object")):
        if isinstance(value, kind):
            return name
    return type(value).__name__


def stop_strings(stop: Optional[Union[str, list[str]]]) -> tuple[str, ...]:
    """The request's stop strings (at most `MAX_STOP`, non-empty); APIError otherwise."""
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > MAX_STOP:
        raise APIError(f"stop: at most {MAX_STOP} sequences, got {len(stops)}", param="stop")
    if any(not s for s in stops):
        raise APIError("stop: sequences must be non-empty strings", param="stop")
    return tuple(check_text(s, "stop") for s in stops)


def sampling_for(request: _Sampling, *, max_new_tokens: int, stop_token_ids: tuple[int, ...]
                 ) -> tuple[SamplingParams, Optional[FrequencyPenalty]]:
    """Engine `SamplingParams` (+ frequency penalty) for a validated request.

    temperature 0 (or below the engine's 1e-4 floor) or top_p 0 means greedy decoding (top_k = 1). Defaults are
    OpenAI's: temperature 1, top_p 1; `top_k` (vLLM's extension) keeps the k most likely tokens (0 or -1: off). `ignore_eos` drops `stop_token_ids`. A negative frequency_penalty raises
    APIError (the engine penalises only).
    """
    temperature = 1.0 if request.temperature is None else request.temperature
    top_p = 1.0 if request.top_p is None else request.top_p
    greedy = temperature < MIN_TEMPERATURE or top_p == 0
    top_k = 0 if request.top_k is None or request.top_k < 1 else request.top_k
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0 if greedy else temperature,
                            top_k=1 if greedy else top_k, top_p=1.0 if greedy else top_p,
                            stop_token_ids=() if request.ignore_eos else stop_token_ids)
    if request.frequency_penalty < 0:
        raise APIError("frequency_penalty: only values >= 0 are supported", param="frequency_penalty")
    penalty = FrequencyPenalty(request.frequency_penalty) if request.frequency_penalty else None
    return params, penalty
