"""The built-in calculator tool: exact arithmetic by an AST walk, refusing anything but numbers, + - * / and ( )."""

from __future__ import annotations

import time

import pytest

from astrai.agents.calculator import MAX_EXPRESSION_CHARS, calculator, evaluate_expression
from astrai.agents.tool_calls import call_tool
from astrai.agents.tools import load_tools


@pytest.mark.parametrize("expression, expected", [
    ("347 * 58", "20126"),
    ("779 * 578", "450262"),
    ("717 + 275 + 484 + 669", "2145"),
    ("(12 + 7) * 3", "57"),
    ("12 + 7 * 3", "33"),
    ("100 - 250", "-150"),
    ("-4 / 2", "-2"),
    ("1 / 3", "0.333333333333"),
    ("7 / 2", "3.5"),
    ("0.1 + 0.2", "0.3"),            # exact, not 0.30000000000000004
    ("+5 - -5", "10"),
    ("  2*(3+(4-1))  ", "12"),
    ("3 × 4 ÷ 6 − 1", "1"),          # typographic operators
    ("999999999999 * 999999999999", "999999999998000000000001"),
])
def test_hand_values(expression, expected):
    assert calculator(expression) == expected


@pytest.mark.parametrize("expression, message", [
    ("2 ** 10", "not Pow"),
    ("9 ** 9 ** 9 ** 9", "not Pow"),
    ("10 // 3", "not FloorDiv"),
    ("10 % 3", "not Mod"),
    ("1 << 100000", "not LShift"),
    ("2 ^ 3", "not BitXor"),
    ("~1", "not Invert"),
    ("__import__('os').system('echo hi')", "not Call"),
    ("open('/etc/passwd')", "not Call"),
    ("x + 1", "not Name"),
    ("(1).__class__", "not Attribute"),
    ("[1, 2]", "not List"),
    ("1 < 2", "not Compare"),
    ("'a' * 3", "only numbers"),
    ("True + 1", "only numbers"),
    ("1j * 2", "only numbers"),
    ("lambda: 1", "not Lambda"),
    ("1; 2", "not an arithmetic expression"),
    ("import os", "not an arithmetic expression"),
    ("((1)", "not an arithmetic expression"),
    ("", "empty"),
    ("1 / 0", "division by zero"),
    ("1 / (2 - 2)", "division by zero"),
    ("1e999", "not a finite number"),
    ("9" * 31, "more than 30 digits"),
    ("1" + "+1" * MAX_EXPRESSION_CHARS, "too long"),
])
def test_refuses_anything_but_arithmetic(expression, message):
    with pytest.raises(ValueError, match=message):
        calculator(expression)


def test_huge_results_are_impossible_and_cheap():
    # No power operator, at most 30 digits per literal and 200 characters: the largest product is about
    # 6 literals of 30 digits (~190 digits), computed at once.
    longest = " * ".join(["9" * 30] * 6)
    assert len(longest) <= MAX_EXPRESSION_CHARS
    start = time.perf_counter()
    value = evaluate_expression(longest)
    assert len(str(value.numerator)) == 180 and time.perf_counter() - start < 1.0
    with pytest.raises(ValueError):
        calculator("(" * 150 + "1" + ")" * 150)  # too long; deep nesting never reaches the parser's limits


def test_not_a_string_is_refused():
    with pytest.raises(ValueError, match="string"):
        evaluate_expression(12)  # type: ignore[arg-type]


def test_as_a_job_tool_its_errors_are_results():
    (tool,) = load_tools(["astrai.agents.calculator:calculator"])
    assert tool.name == "calculator" and tool.parameters["required"] == ["expression"]
    assert "+ - * /" in tool.description
    assert call_tool(tool, {"expression": "347 * 58"}) == ("20126", None)
    text, error = call_tool(tool, {"expression": "2 ** 1000000"})
    assert text == error and text.startswith("Error: ValueError: ") and "Pow" in text
    text, error = call_tool(tool, {"expression": 5})
    assert error is not None  # a wrong JSON type is refused before the call
