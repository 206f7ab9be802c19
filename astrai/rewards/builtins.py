"""The built-in rewards, one table: `BUILTIN_REWARDS`, name -> `BuiltinReward`.

Every built-in follows TRL's reward-function calling convention (``trl`` ``GRPOTrainer(reward_funcs=...)``, the
convention of `astrai.rewards.functions`)::

    fn(prompts: list, completions: list, **columns) -> list[float | None]   # one value per completion

and is chosen by name from config (``reward.name``, ``reward.functions[].function``). A record also says whether
the reward reads the reference-answer column (its ``answer_field`` option names it: the job's
``data.answer_field``), how to read the answer a response states (what the evaluator reports per response), and
which reference answers it can never match (for the load-time warning). Nothing here evaluates model text as code
(``code_unit_tests`` runs code in the sandbox of `astrai.sandbox`, imported only when that reward is used).

``math_exact_match``: 1.0 when the response's final number equals the gold final number (the reference answers
as stored: a GSM8K solution ending in ``#### N``, or a bare ``N``), else 0.0; plus ``format_bonus`` when the
response states its answer as ``#### <number>`` (the format of the GSM8K references), whether or not that answer
is right. How the final number is found is described in ``extract_final_number``. With ``partial_credit`` c > 0
a wrong number earns ``c * closeness`` (see ``closeness``), so near misses score above far ones: a dense signal
where exact answers are rare. The evaluator scores with the job's options (docs/evaluation.md).
"""

from __future__ import annotations

import re
from collections.abc import MutableMapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Iterator, Optional, Sequence, Union

from astrai.data.prompts import extract_gsm8k_answer

# One number: an optional minus (kept only when it is not a subtraction, see _is_unary_minus), an
# optional "$", then digits with comma thousands groups or plain digits, an optional decimal part
# (only when digits follow the dot, so "12." at a sentence end is 12; ".5" is 0.5) and an optional
# "/denominator" (fractions such as 1/2 are kept whole, not read as their denominator).
_NUMBER_RE = re.compile(
    r"(?P<sign>[-\u2212])?\$?"
    r"(?:(?P<int>\d{1,3}(?:,\d{3})+(?!\d|,\d)|\d+)(?P<dec>\.\d+)?(?:/(?P<den>\d+)(?![\d.]))?"
    r"|(?P<lead>\.\d+))"
)
_CLOSERS = ")]}"
_FRAC_RE = re.compile(r"\\d?frac\{\s*(-?[\d.,]+)\s*\}\{\s*([\d.,]+)\s*\}")
_BOXED = "\\boxed{"


def _numbers(text: str) -> list[str]:
    """Every number in ``text``, normalised: no commas, no "$", "-" for a minus sign."""
    found = []
    for m in _NUMBER_RE.finditer(text):
        if m["lead"] is not None:
            num = "0" + m["lead"]
        else:
            num = m["int"].replace(",", "") + (m["dec"] or "")
        if m["den"] is not None and int(m["den"]) != 0 and m["dec"] is None:
            num += "/" + m["den"]
        negative = m["sign"] is not None and _is_unary_minus(text, m.start())
        found.append(("-" if negative else "") + num)
    return found


def _is_unary_minus(text: str, start: int) -> bool:
    """Whether the minus at ``text[start]`` negates (``"is -5"``, ``"= -5"``, ``"(-5"``) rather than
    subtracts (``"10-5"``, ``"x-5"``, ``"10 - 5"``, ``"(2+3) -1"``)."""
    before = text[max(0, start - 64):start]  # a bounded look-back keeps long texts linear
    if before and (before[-1].isalnum() or before[-1] in _CLOSERS):
        return False
    before = before.rstrip()
    return not (before and (before[-1].isdigit() or before[-1] in _CLOSERS))


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (nested braces balanced), or None."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, i = 1, start + len(_BOXED)
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return text[i:]  # unclosed: take the rest


def _after_marker(text: str) -> str | None:
    """First number after the last ``####``, or None when there is no marker or no number."""
    head, sep, tail = text.rpartition("####")
    if not sep:
        return None
    found = _numbers(tail)
    return found[0] if found else None


def extract_final_number(text: str) -> str | None:
    """The final numeric answer stated in ``text``, normalised, or None when there is none.

    Preference order:
      1. the first number after the LAST ``####`` marker;
      2. else the last number inside the LAST ``\\boxed{...}`` (``\\frac{a}{b}`` read as ``a/b``);
      3. else the LAST number anywhere in the text.

    Numbers: integers, decimals and simple fractions ``a/b``; "$" and comma thousands separators
    are dropped (``"$1,234"`` -> ``"1234"``); a minus sign counts only when it is not a
    subtraction (``"is -5"`` -> ``"-5"``; ``"10-5"`` and ``"10 - 5"`` hold 10 and 5); a trailing dot is
    not a decimal point (``"12."`` -> ``"12"``). Comma grouping is trusted as written, so
    ``"100,200"`` reads as 100200. The returned string keeps its written form (``"3.50"``); compare
    values with ``numbers_equal``. Never raises for a ``str``.
    """
    marked = _after_marker(text)
    if marked is not None:
        return marked
    boxed = _last_boxed(text)
    if boxed is not None:
        found = _numbers(_FRAC_RE.sub(r"\1/\2", boxed))
        if found:
            return found[-1]
    found = _numbers(text)
    return found[-1] if found else None


def parse_number(text: str) -> Fraction | None:
    """Exact value of a normalised number string (``"-3.50"``, ``"1234"``, ``"1/2"``), or None.

    Leading "$" and commas are tolerated. Uses ``fractions.Fraction`` (a parser, not ``eval``).
    """
    cleaned = text.strip().replace(",", "").replace("$", "").replace("\u2212", "-")
    if not re.fullmatch(r"-?\s?\d+(?:\.\d+)?(?:/\d+)?|-?\.\d+", cleaned):
        return None
    try:
        return Fraction(cleaned.replace(" ", ""))
    except (ValueError, ZeroDivisionError):
        return None


def numbers_equal(predicted: str | None, gold: str) -> bool:
    """True when ``predicted`` and ``gold`` are the same number (``"5.0"`` == ``"5"``,
    ``"2.50"`` == ``"2.5"``, ``"0.5"`` == ``"1/2"``). A gold answer that is not a number is
    compared as text after stripping. ``predicted=None`` is never equal.
    """
    if predicted is None:
        return False
    gold_value = parse_number(gold)
    if gold_value is None:
        return predicted.strip() == gold.strip()
    return parse_number(predicted) == gold_value


def closeness(predicted: str | None, gold: str) -> float:
    """How near ``predicted`` is to ``gold`` on the number line, in [0, 1]:
    ``max(0, 1 - |p - g| / max(|g|, 1))`` with exact (``Fraction``) arithmetic, so 1.0 only when equal and
    0.0 once the error reaches the gold value's magnitude (e.g. gold 20: 22 -> 0.9, 97 -> 0.0; gold 119:
    129 -> 0.916). 0.0 when either side is not a number. Never raises for strings.
    """
    if predicted is None:
        return 0.0
    p, g = parse_number(predicted), parse_number(gold)
    if p is None or g is None:
        return 0.0
    return float(max(Fraction(0), 1 - abs(p - g) / max(abs(g), Fraction(1))))


def has_marked_answer(text: str) -> bool:
    """True when ``text`` states a number after its last ``####`` (the GSM8K answer format)."""
    return _after_marker(text) is not None


def completion_text(completion) -> str:
    """A completion as reward functions receive it, as text: a ``str`` as is, a list of chat messages (chat prompts)
    as its last message's ``content``.

    Raises:
        ValueError: for anything else.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, (list, tuple)) and completion and isinstance(completion[-1], dict) \
            and isinstance(completion[-1].get("content"), str):
        return completion[-1]["content"]
    raise ValueError(f"reward: a completion must be a string or a list of chat messages, got "
                     f"{type(completion).__name__}")


def reference_answers(columns: dict, answer_field: str, n: int) -> list[str]:
    """The reference answers of an answer-reading reward: the column `answer_field` of `columns` (non-strings as
    ``str``), one per completion.

    Raises:
        KeyError: naming the column when `columns` has no such column.
        ValueError: ``reward: got N responses but M answers`` when the column does not hold `n` values.
    """
    if answer_field not in columns:
        raise KeyError(f"the reward needs the reference-answer column {answer_field!r} (data.answer_field); "
                       f"the prompts have {', '.join(sorted(columns)) or 'no other columns'}")
    answers = [a if isinstance(a, str) else str(a) for a in columns[answer_field]]
    if len(answers) != n:
        raise ValueError(f"reward: got {n} responses but {len(answers)} answers")
    return answers


def math_exact_match(prompts: Sequence[Any], completions: Sequence[Any], *, answer_field: str = "answer",
                     format_bonus: float = 0.0, partial_credit: float = 0.0, **columns: Any) -> list[float]:
    """Exact-match reward for math word problems, with optional partial credit for near misses (TRL convention).

    Args:
        prompts: B prompts (unused).
        completions: B completions (text, or chat messages: the last one's ``content``).
        answer_field: the column of reference answers (GSM8K solution text or a bare number); the gold value is
            ``extract_gsm8k_answer(answer)``.
        format_bonus: added to a response's score when it contains ``#### <number>``
            (``has_marked_answer``), right or wrong.
        partial_credit: c in [0, 1): a response whose final number is wrong scores ``c * closeness(number,
            gold)`` (``closeness``), below the 1.0 of a right one. A shaped reward in the sense of Ng et al.
            1999 only loosely (not potential-based): it rewards being nearer, and the best score is still only
            for the exact answer.
        columns: the other columns of the prompt records (lists of B values), `answer_field` among them.

    Returns:
        B floats: ``1.0 * correct + partial_credit * closeness * (not correct) + format_bonus * marked``.

    Raises:
        KeyError: no `answer_field` column. ValueError: ``reward: got N responses but M answers``.
    """
    answers = reference_answers(columns, answer_field, len(completions))
    scores = []
    for completion, answer in zip(completions, answers):
        response = completion_text(completion)
        predicted, gold = extract_final_number(response), extract_gsm8k_answer(answer)
        correct = numbers_equal(predicted, gold)
        near = partial_credit * closeness(predicted, gold) if partial_credit and not correct else 0.0
        scores.append(float(correct) + near + (format_bonus if has_marked_answer(response) else 0.0))
    return scores


def _numeric_final_answer(answer: str) -> bool:
    """Whether ``math_exact_match`` can ever match the reference `answer` (its final answer is a number)."""
    return parse_number(extract_gsm8k_answer(answer)) is not None


@dataclass(frozen=True)
class BuiltinReward:
    """One built-in reward.

    Attributes:
        function: the reward in TRL's convention (module docstring), or its ``"module:function"`` import path,
            imported on first use (`load`), so a job that does not use it never imports its module.
        description: one line: what it scores.
        answer_field: whether it reads the reference-answer column; `resolve_specs` then gives it the keyword
            ``answer_field`` (the job's `data.answer_field`) and the prompts must hold answers.
        extract_answer: response text -> the answer it states (None when it finds none), what the evaluator
            reports per response; None: the reward states no such answer.
        check_answer: reference answer -> whether any response can match it (a False is warned about at load
            time, `unscorable_warning`); None: every answer can be matched.
    """

    function: Union[Callable[..., list], str]
    description: str
    answer_field: bool = False
    extract_answer: Optional[Callable[[str], Optional[str]]] = None
    check_answer: Optional[Callable[[str], bool]] = None

    def load(self) -> Callable[..., list]:
        """The reward function (imported now when given by path).

        Raises:
            ImportError / AttributeError: an import path that does not resolve (a bug in the table).
        """
        if callable(self.function):
            return self.function
        import importlib

        module, _, attr = self.function.partition(":")
        return getattr(importlib.import_module(module), attr)


BUILTIN_REWARDS: dict[str, BuiltinReward] = {
    "math_exact_match": BuiltinReward(
        math_exact_match, "1 when the response's final number equals the reference answer's (#### N), else 0; "
                          "options format_bonus, partial_credit", answer_field=True,
        extract_answer=extract_final_number, check_answer=_numeric_final_answer),
    "code_unit_tests": BuiltinReward(
        "astrai.rewards.code:code_unit_tests", "fraction of the record's unit tests (column tests) the "
                                               "completion's Python passes, run in the sandbox"),
}
"""Every built-in reward by name (`reward.name`, `reward.functions[].function`): run in the trainer's process."""


def unscorable_answers(name: str, answers: Sequence[str]) -> list[int]:
    """0-based indices of the `answers` that built-in reward `name` can never match (its `check_answer`): for
    ``math_exact_match`` an answer whose final answer (after ``####``, or the whole text) is not a number, e.g. a
    GSM8K-style solution that lost its ``#### N`` line. Such rows always score 0. Empty for a reward without a
    check or a name that is not a built-in."""
    record = BUILTIN_REWARDS.get(name)
    check = None if record is None else record.check_answer
    return [] if check is None else [i for i, answer in enumerate(answers) if not check(answer)]


def unscorable_warning(name: str, answers: Sequence[str], *, source: str, field: str) -> Optional[str]:
    """The one-line warning training and `astrai.evaluate` give when reward `name` can never match some of the
    reference `answers` (`unscorable_answers`) of the data `source` (its answer field `field`); None when all are
    scorable. Names the count and the first five 1-based rows."""
    bad = unscorable_answers(name, answers)
    if not bad:
        return None
    rows = ", ".join(str(i + 1) for i in bad[:5]) + (", ..." if len(bad) > 5 else "")
    return (f"{source}: {len(bad)} of {len(answers)} answers ({field!r}) have no final number ('#### N' or a bare "
            f"number), so {name} scores every response to them 0 (rows {rows})")


__all__ = ["BUILTIN_REWARDS", "BuiltinReward", "completion_text", "closeness", "extract_final_number",
           "has_marked_answer", "math_exact_match", "numbers_equal", "parse_number", "reference_answers",
           "unscorable_answers", "unscorable_warning"]
