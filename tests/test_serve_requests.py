"""Request validation of astrai.serve over a scripted engine (no model): every refusal is an OpenAI-shaped 400 whose
one-line message starts with the field it names (`param`) and says what was expected, and nothing reaches the
engine. NaN and infinite numbers in any numeric field."""

import math

import pytest

from astrai.models import tiny_tokenizer
from test_serve import http
from test_serve_tools import serving

USER = {"role": "user", "content": "what is 2 + 2"}


def refused(path, body):
    """The error object of a request the server must refuse with a 400 before anything reaches the engine."""
    with serving(tiny_tokenizer(), []) as (base, _, engine):
        status, answer = http("POST", f"{base}{path}", {"model": "agent", **body})
    assert status == 400 and engine.prompts == [], answer
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{error['param']}: ") and "\n" not in error["message"]
    return error


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
