"""Request validation of astrai.serve over a scripted engine (no model): every refusal is an OpenAI-shaped 400 whose
one-line message starts with the field it names (`param`, OpenAI's `messages.[0].content` spelling) and says what
was expected, and nothing reaches the engine. Chat content null (except an assistant's with tool_calls), an empty
list, parts that are not text parts, a missing or unknown role; NaN and infinite numbers in any numeric field."""

import math

import pytest

from astrai.models import tiny_tokenizer
from test_serve import http
from test_serve_tools import serving

USER = {"role": "user", "content": "what is 2 + 2"}
CALLED = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": "{\"expression\": \"2+2\"}"}}]}


def refused(path, body):
    """The error object of a request the server must refuse with a 400 before anything reaches the engine."""
    with serving(tiny_tokenizer(), []) as (base, _, engine):
        status, answer = http("POST", f"{base}{path}", {"model": "agent", **body})
    assert status == 400 and engine.prompts == [], answer
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{error['param']}: ") and "\n" not in error["message"]
    return error


@pytest.mark.parametrize("messages, param, expected", [
    ([{"role": "user", "content": None}], "messages.[0].content", "got null"),
    ([{"role": "user"}], "messages.[0].content", "got null"),
    ([USER, {"role": "assistant", "content": None}], "messages.[1].content", "tool_calls"),
    ([{"role": "system", "content": None}, USER], "messages.[0].content", "got null"),
    ([USER, CALLED, {"role": "tool", "tool_call_id": "call_1", "content": None}], "messages.[2].content", "got null"),
    ([{"role": "user", "content": []}], "messages.[0].content", "non-empty list of text parts"),
    ([{"role": "user", "content": 5}], "messages.[0].content", "a string or a list of text parts, got a number"),
    ([{"role": "user", "content": ["hi"]}], "messages.[0].content.[0]", "expected a text part"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages.[0].content.[0].text", "expected a string"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "messages.[0].content.[0].text",
     "expected a string, got a number"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]}],
     "messages.[0].content.[1].type", "only text parts"),
    ([{"content": "hi"}], "messages.[0].role", "expected one of 'system', 'developer', 'user', 'assistant', 'tool'"),
    ([{"role": None, "content": "hi"}], "messages.[0].role", "expected one of"),
    ([{"role": "wizard", "content": "hi"}], "messages.[0].role", "got 'wizard'"),
    ([USER, {"role": "function", "content": "4"}], "messages.[1].role", "got 'function'"),
])
def test_chat_messages_are_checked_field_by_field(messages, param, expected):
    error = refused("/v1/chat/completions", {"messages": messages})
    assert error["param"] == param and expected in error["message"], error


def test_null_content_is_accepted_on_an_assistant_message_with_tool_calls_and_text_parts_are_joined():
    with serving(tiny_tokenizer(), ["4", "4"]) as (base, _, engine):
        messages = [USER, CALLED, {"role": "tool", "tool_call_id": "call_1", "content": "4"}]
        assert http("POST", f"{base}/v1/chat/completions", {"model": "agent", "messages": messages})[0] == 200
        parts = {"role": "user", "content": [{"type": "text", "text": "what is "}, {"type": "text", "text": "2 + 2"}]}
        assert http("POST", f"{base}/v1/chat/completions", {"model": "agent", "messages": [parts]})[0] == 200
    assert len(engine.prompts) == 2
    tok = tiny_tokenizer()
    assert engine.prompts[1] == tok.encode(tok.apply_chat_template([USER], add_generation_prompt=True))


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("field", ["temperature", "top_p", "frequency_penalty", "presence_penalty", "n", "max_tokens",
                                   "seed", "top_k"])
@pytest.mark.parametrize("value, spelled", [(math.nan, "NaN"), (math.inf, "Infinity"), (-math.inf, "-Infinity")])
def test_nan_and_infinite_numbers_are_refused_as_not_finite(path, field, value, spelled):
    """JSON's NaN / Infinity extensions (Python's parser reads them) get 'expected a finite number', not a range
    message such as 'less than or equal to 2' that the value does not break."""
    body = {"messages": [USER]} if path == "/v1/chat/completions" else {"prompt": "2 + 2"}
    error = refused(path, {**body, field: value})
    assert error["param"] == field and error["message"] == f"{field}: expected a finite number, got {spelled}"
