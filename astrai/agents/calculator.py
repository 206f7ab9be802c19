"""The built-in ``calculator`` tool: exact arithmetic on numbers with ``+ - * /`` and parentheses, nothing else.

Use it in a job as ``rollout.tools: ["astrai.agents.calculator:calculator"]`` (the tool-use recipe,
``configs/examples/grpo_tools.yaml``). The expression is parsed with `ast.parse` and evaluated by walking the tree:
only number literals, the binary operators ``+ - * /``, unary ``+ -`` and parentheses are accepted. Anything else
(names, calls, attributes, ``**``, ``//``, ``%``, comparisons, strings, ...) is refused with a `ValueError`, which
the tool machinery turns into the ``Error: ...`` text the model reads. It never calls ``eval``. There is no power
operator, so no huge exponent can be asked for; the expression's length and each literal's digits are capped, so
the largest possible result is a product of a few hundred digits, computed in microseconds.

Arithmetic is exact (`fractions.Fraction`): an integral result is written as an integer (``"20126"``), any other as
a decimal of up to 12 significant digits (``"0.333333333333"``); ``1 / 0`` is an error.
"""

from __future__ import annotations

import ast
from fractions import Fraction

__all__ = ["calculator", "evaluate_expression", "format_number", "MAX_EXPRESSION_CHARS"]

MAX_EXPRESSION_CHARS = 200
"""The longest expression accepted (characters, after stripping)."""
MAX_LITERAL_DIGITS = 30
"""The most digits one number literal may have."""
_SYMBOLS = {"×": "*", "÷": "/", "−": "-"}
"""Typographic operators a model may write, read as their ASCII forms."""
_BINARY = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.Div: lambda a, b: a / b}
_UNARY = {ast.UAdd: lambda a: a, ast.USub: lambda a: -a}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses, e.g. "347 * 58" or "(12 + 7) * 3".

    Args:
        expression: The arithmetic expression to evaluate, using numbers, + - * / and parentheses only.
    """
    return format_number(evaluate_expression(expression))


def evaluate_expression(expression: str) -> Fraction:
    """The exact value of `expression` (numbers, ``+ - * /``, unary ``+ -``, parentheses; ``×``, ``÷`` and ``−``
    read as ``*``, ``/``, ``-``; commas between digits as thousands separators are not accepted).

    Raises:
        ValueError: one line: not a string, empty, longer than `MAX_EXPRESSION_CHARS`, not parseable, anything but
            the arithmetic above (naming what), a literal of more than `MAX_LITERAL_DIGITS` digits, division by 0.
    """
    if not isinstance(expression, str):
        raise ValueError(f"expected an expression as a string, got {type(expression).__name__}")
    text = expression.strip()
    for symbol, ascii_form in _SYMBOLS.items():
        text = text.replace(symbol, ascii_form)
    if not text:
        raise ValueError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression too long ({len(text)} characters, at most {MAX_EXPRESSION_CHARS})")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ValueError(f"not an arithmetic expression: {text!r}") from None
    return _value(tree.body)


def _value(node: ast.AST) -> Fraction:
    """The value of one node of an expression tree (see `evaluate_expression`)."""
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"only numbers are allowed, got {value!r}")
        if isinstance(value, int) and len(str(abs(value))) > MAX_LITERAL_DIGITS:
            raise ValueError(f"a number has more than {MAX_LITERAL_DIGITS} digits")
        if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
            raise ValueError(f"not a finite number: {value!r}")
        return Fraction(str(value)) if isinstance(value, float) else Fraction(value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ValueError("division by zero")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    what = type(node.op).__name__ if isinstance(node, (ast.BinOp, ast.UnaryOp)) else type(node).__name__
    raise ValueError(f"only numbers, + - * / and parentheses are allowed, not {what}")


def format_number(value: Fraction) -> str:
    """`value` as the calculator writes it: an integer without a decimal point, else up to 12 significant
    digits (trailing zeros dropped)."""
    if value.denominator == 1:
        return str(value.numerator)
    return format(value.numerator / value.denominator, ".12g") if abs(value) < 10 ** 300 else \
        f"{value.numerator // value.denominator}"
