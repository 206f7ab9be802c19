"""Rule-based rewards for online RL, chosen by name from config (``reward.name``).

A reward function scores decoded responses against reference answers::

    fn(responses: list[str], answers: list[str], *, format_bonus: float = 0.0,
       partial_credit: float = 0.0) -> torch.Tensor  # (B,) float32

``answers`` are the dataset's reference answers as stored (a GSM8K solution ending in
``#### N``, or a bare ``N``); each function extracts what it needs. The score goes to the last real
response token (see docs/architecture.md). Nothing here evaluates model text as code.

``math_exact_match``: 1.0 when the response's final number equals the gold final number, else
0.0; plus ``format_bonus`` when the response states its answer as ``#### <number>`` (the format
of the GSM8K references), whether or not that answer is right. How the final number is found is
described in ``extract_final_number``. With ``partial_credit`` c > 0 a wrong number earns
``c * closeness`` (see ``closeness``), so near misses score above far ones: a dense signal where
exact answers are rare. Evaluation always scores with ``format_bonus = partial_credit = 0``.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Callable, Optional, Protocol, Sequence

import torch

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


def _check_lengths(responses: list[str], answers: list[str]) -> None:
    if len(responses) != len(answers):
        raise ValueError(f"reward: got {len(responses)} responses but {len(answers)} answers")


def math_exact_match(responses: list[str], answers: list[str], *, format_bonus: float = 0.0,
                     partial_credit: float = 0.0) -> torch.Tensor:
    """Exact-match reward for math word problems, with optional partial credit for near misses.

    Args:
        responses: B decoded model responses.
        answers: B reference answers (GSM8K solution text or a bare number); the gold value is
            ``extract_gsm8k_answer(answer)``.
        format_bonus: added to a response's score when it contains ``#### <number>``
            (``has_marked_answer``), right or wrong.
        partial_credit: c in [0, 1): a response whose final number is wrong scores ``c * closeness(number,
            gold)`` (``closeness``), below the 1.0 of a right one. A shaped reward in the sense of Ng et al.
            1999 only loosely (not potential-based): it rewards being nearer, and the best score is still only
            for the exact answer.

    Returns:
        ``(B,)`` float32 tensor on CPU: ``1.0 * correct + partial_credit * closeness * (not correct) +
        format_bonus * marked``.

    Raises:
        ValueError: if ``responses`` and ``answers`` differ in length.
    """
    _check_lengths(responses, answers)
    scores = []
    for response, answer in zip(responses, answers):
        predicted, gold = extract_final_number(response), extract_gsm8k_answer(answer)
        correct = numbers_equal(predicted, gold)
        near = partial_credit * closeness(predicted, gold) if partial_credit and not correct else 0.0
        scores.append(float(correct) + near + (format_bonus if has_marked_answer(response) else 0.0))
    return torch.tensor(scores, dtype=torch.float32)


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


REWARD_FUNCTIONS: dict[str, str] = {"code_unit_tests": "astrai.rewards.code:code_unit_tests"}
"""Built-in rewards written with the reward-function calling convention (`reward_functions`: ``fn(prompts,
completions, **columns) -> list[float | None]``), by name -> "module:function" (imported on first use: the code
sandbox is loaded only by a job that uses it); run in the trainer's process."""


def answer_reward_function(reward: "RewardFn") -> Callable[..., list]:
    """An answer-matching reward of `REWARDS` with the reward-function calling convention: the reference answers
    are the column `answer_field` (the job's `data.answer_field`), `format_bonus` and `partial_credit` its
    options, one float per completion.

    The returned function raises KeyError naming the column when the prompts have no such column."""

    def fn(prompts: list, completions: list, *, answer_field: str = "answer", format_bonus: float = 0.0,
           partial_credit: float = 0.0, **columns) -> list[float]:
        if answer_field not in columns:
            raise KeyError(f"the reward needs the reference-answer column {answer_field!r} (data.answer_field); "
                           f"the prompts have {', '.join(sorted(columns)) or 'no other columns'}")
        answers = [a if isinstance(a, str) else str(a) for a in columns[answer_field]]
        texts = [completion_text(c) for c in completions]
        return reward(texts, answers, format_bonus=format_bonus, partial_credit=partial_credit).tolist()

    return fn


def builtin_reward_function(name: str) -> Optional[Callable[..., list]]:
    """The built-in reward `name` with the reward-function calling convention (`REWARD_FUNCTIONS`, or an
    answer-matching `REWARDS` entry through `answer_reward_function`), or None when there is none."""
    if name in REWARD_FUNCTIONS:
        import importlib

        module, _, attr = REWARD_FUNCTIONS[name].partition(":")
        return getattr(importlib.import_module(module), attr)
    return answer_reward_function(REWARDS[name]) if name in REWARDS else None


def builtin_reward_names() -> list[str]:
    """Every built-in reward name (`reward.name`, `reward.functions[].function`)."""
    return sorted(set(REWARD_FUNCTIONS) | set(REWARDS))


class RewardFn(Protocol):
    """``(responses, answers, *, format_bonus=0.0, partial_credit=0.0) -> Tensor (B,) float32``."""

    def __call__(self, responses: list[str], answers: list[str], *, format_bonus: float = 0.0,
                 partial_credit: float = 0.0) -> torch.Tensor: ...


REWARDS: dict[str, RewardFn] = {
    "math_exact_match": math_exact_match,
}


ANSWER_EXTRACTORS: dict[str, Callable[[str], Optional[str]]] = {
    "math_exact_match": extract_final_number,
}
"""Reward name -> the function that reads the answer a response states (what the reward compares); the
evaluator reports it per response. A reward without an entry reports no extracted answer."""

ANSWER_CHECKS: dict[str, Callable[[str], bool]] = {
    "math_exact_match": lambda answer: parse_number(extract_gsm8k_answer(answer)) is not None,
}
"""Reward name -> whether a reference answer can ever be matched (rewards without an entry accept any)."""


def unscorable_answers(name: str, answers: Sequence[str]) -> list[int]:
    """0-based indices of the `answers` that reward `name` can never match: for ``math_exact_match`` an answer
    whose final answer (after ``####``, or the whole text) is not a number, e.g. a GSM8K-style solution that lost
    its ``#### N`` line. Such rows always score 0."""
    check = ANSWER_CHECKS.get(name)
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


def get_reward(name: str) -> RewardFn:
    """The reward function registered as ``name`` in ``REWARDS``.

    Raises:
        ValueError: ``reward.name: unknown reward 'x'; choices: ...`` for an unknown name.
    """
    try:
        return REWARDS[name]
    except (KeyError, TypeError):
        choices = ", ".join(sorted(REWARDS))
        raise ValueError(f"reward.name: unknown reward {name!r}; choices: {choices}") from None


__all__ = ["ANSWER_CHECKS", "ANSWER_EXTRACTORS", "REWARDS", "REWARD_FUNCTIONS", "RewardFn", "answer_reward_function",
           "builtin_reward_function", "builtin_reward_names", "completion_text", "closeness", "extract_final_number",
           "get_reward", "has_marked_answer", "math_exact_match", "numbers_equal", "parse_number",
           "unscorable_answers", "unscorable_warning"]
