"""The test format of astrai's code sandbox: parsing assert statements, and judging what the sandbox reports.

A record's tests are a list of Python ``assert`` statements, as MBPP's ``test_list``
(``["assert add(1, 2) == 3", ...]``); a single string holding several assert lines is accepted too. Every
top-level statement must be an ``assert``; each is one test. Two kinds:

- VALUE form, ``assert <expr> == <literal>`` (either side the literal; a literal is anything ``ast.literal_eval``
  reads: numbers, strings, bytes, None, booleans, tuples, lists, dicts, sets, ``set()``, negative numbers). Only
  ``<expr>`` is sent into the sandbox; its value must be plain data (None, bool, int, float, complex, str, bytes,
  list, tuple, dict, set, frozenset, nested; subclasses are read as their base type) and comes back as tagged JSON;
  the trainer decodes it (no eval) and compares it with the literal using ``==``. The expected values never enter
  the sandbox, so code cannot fake a pass without knowing them.
- ASSERT form, any other assert (``assert is_prime(7)``, ``assert math.isclose(f(1), 2.5)``): runs in the
  sandbox and passes when it raises nothing. Code that attacks the harness from inside its process can fake these.

Parsing only here; nothing is executed.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any, Sequence


@dataclass(frozen=True)
class UnitTest:
    """One test: ``kind`` "value" (``source`` is the expression, ``expected`` the literal it must equal) or
    "assert" (``source`` is the whole assert statement); ``text`` is the test as written."""

    kind: str
    source: str
    text: str
    expected: Any = None


def _segment(text: str, node: ast.AST) -> str:
    return ast.get_source_segment(text, node) or ast.unparse(node)


def _literal(node: ast.AST) -> tuple[bool, Any]:
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def _unit_test(text: str, stmt: ast.Assert) -> UnitTest:
    check = stmt.test
    if isinstance(check, ast.Compare) and len(check.ops) == 1 and isinstance(check.ops[0], ast.Eq):
        for expr, literal in ((check.left, check.comparators[0]), (check.comparators[0], check.left)):
            ok, expected = _literal(literal)
            if ok:
                return UnitTest("value", _segment(text, expr), _segment(text, stmt), expected)
    return UnitTest("assert", _segment(text, stmt), _segment(text, stmt))


def parse_tests(tests: str | Sequence[str], *, where: str = "tests") -> tuple[UnitTest, ...]:
    """Parse tests given as a list of assert statements (MBPP ``test_list``) or one string of them.

    Every top-level statement must be an ``assert``; each is one test. Parsing only: nothing is executed.

    Raises:
        ValueError: ``<where>[k]: ...`` for an entry that is not a string, does not parse, or holds a statement
            other than ``assert``; ``<where>: ...`` when ``tests`` is neither a string nor a list of strings.
    """
    items = [tests] if isinstance(tests, str) else tests
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"{where}: expected a list of assert statements, got {type(tests).__name__}")
    parsed: list[UnitTest] = []
    for k, text in enumerate(items):
        if not isinstance(text, str):
            raise ValueError(f"{where}[{k}]: expected a string holding an assert statement, got {type(text).__name__}")
        try:
            module = ast.parse(text)
        except SyntaxError as e:
            raise ValueError(f"{where}[{k}]: not valid Python ({e.msg}, line {e.lineno}): {text[:80]!r}") from None
        for stmt in module.body:
            if not isinstance(stmt, ast.Assert):
                raise ValueError(f"{where}[{k}]: expected only assert statements, got {type(stmt).__name__}: "
                                 f"{text[:80]!r}")
            parsed.append(_unit_test(text, stmt))
    return tuple(parsed)


def decode(obj: Any, depth: int = 0) -> Any:
    """The value a tagged-JSON record from the harness describes (see ``astrai.sandbox.harness.encode``); no eval.

    Raises:
        ValueError, TypeError: for anything that is not a well-formed record (including unhashable set items).
    """
    if depth > 100:
        raise ValueError("nested too deeply")
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if not (isinstance(obj, dict) and len(obj) == 1):
        raise ValueError(f"bad record {type(obj).__name__}")
    (tag, value), = obj.items()
    if tag in ("i", "f", "b") and not isinstance(value, str):
        raise TypeError(f"bad {tag!r} record")
    if tag == "i":
        return int(value)
    if tag == "f":
        return float(value)
    if tag == "b":
        return bytes.fromhex(value)
    if tag == "c" and isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value):
        return complex(float(value[0]), float(value[1]))
    if tag == "d" and isinstance(value, list):
        return {decode(k, depth + 1): decode(v, depth + 1) for k, v in value}
    kinds = {"t": tuple, "l": list, "s": set, "fs": frozenset}
    if tag in kinds and isinstance(value, list):
        return kinds[tag](decode(item, depth + 1) for item in value)
    raise ValueError(f"bad record tag {tag!r}")


def verdicts(records: list[dict], tests: Sequence[UnitTest]) -> list[str | None]:
    """Per test: None when it passed, else why not (an exception name, ``"wrong value"``, ``"not run"`` ...).

    ``records`` are the harness's result records (``{"i": n, "value": tagged}``, ``{"i": n, "ok": True}``,
    ``{"i": n, "error": name}``; others are ignored). The first record of an index counts; a record of the wrong
    kind (an "ok" for a value test) fails it."""
    verdicts: list[str | None] = ["not run"] * len(tests)
    seen: set[int] = set()
    for r in records:
        i = r.get("i")
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(tests) or i in seen:
            continue
        seen.add(i)
        if "error" in r:
            verdicts[i] = str(r["error"])[:80]
        elif tests[i].kind == "value" and "value" in r:
            try:
                verdicts[i] = None if decode(r["value"]) == tests[i].expected else "wrong value"
            except (ValueError, TypeError, RecursionError, OverflowError):
                verdicts[i] = "undecodable value"
        elif tests[i].kind == "assert" and r.get("ok") is True:
            verdicts[i] = None
        else:
            verdicts[i] = "malformed record"
    return verdicts


__all__ = ["UnitTest", "decode", "parse_tests", "verdicts"]
