"""Generate astrai's built-in function-writing tasks (``builtin:code_tasks``) for the ``code_unit_tests`` reward.

Each task comes from a template with small random parameters: a prompt asking for one Python function, a
reference solution, and unit tests whose expected values are computed here by running that reference solution
(our own code, never model output) on seeded random inputs. Output is jsonl, one object per line::

    {"question": str, "tests": ["assert f(...) == <literal>", ...], "entry_point": "f", "answer": "<solution>"}

``tests`` are MBPP-style value asserts (see astrai/sandbox/code_tests.py); the question shows the first one as
an example. No expected value repeats in more than 2 of a task's tests (3 for True/False), so no constant answer
scores above 0.6. ``answer`` is the reference solution (so a prompt set's default ``answer`` field exists and the tests
can be checked against it). Deterministic (stdlib ``random`` with a fixed seed): rerunning reproduces the
committed asset byte for byte; tests/test_code_reward.py checks that.

    python tools/make_code_tasks.py            # writes astrai/data/assets/code_tasks.jsonl
    python tools/make_code_tasks.py --check    # exit 1 if the committed file is stale
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from asset_cli import asset_main, render_jsonl  # noqa: E402

SEED = 4242
VARIANTS = 2  # tasks per template, each with its own parameters
NUM_TESTS = 5
OUTPUT = Path(__file__).resolve().parents[1] / "astrai" / "data" / "assets" / "code_tasks.jsonl"
INSTRUCTION = "Reply with the complete function in a ```python code block."

# A template returns (function name, signature, description, solution source, input maker); the input maker
# returns one tuple of arguments per call.
Template = tuple[str, str, str, str, Callable[[random.Random], tuple]]


def _ints(rng: random.Random, lo: int = -20, hi: int = 20, n: tuple[int, int] = (0, 8)) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(rng.randint(*n))]


def _word(rng: random.Random, letters: str = "abcdeilmnorst", n: tuple[int, int] = (1, 7)) -> str:
    return "".join(rng.choice(letters) for _ in range(rng.randint(*n)))


def _text(rng: random.Random) -> str:
    return " ".join(_word(rng) for _ in range(rng.randint(0, 6)))


def sum_multiples(rng):
    a, b = rng.sample([2, 3, 4, 5, 7], 2)
    return ("sum_multiples", "n", f"returns the sum of all positive integers below `n` that are divisible by {a} or {b}",
            f"def sum_multiples(n):\n    return sum(i for i in range(1, n) if i % {a} == 0 or i % {b} == 0)\n",
            lambda r: (r.randint(0, 60),))


def count_letter(rng):
    ch = rng.choice("aeiost")
    return ("count_letter", "s", f"returns how many times the letter '{ch}' occurs in the string `s`, ignoring case",
            f"def count_letter(s):\n    return s.lower().count({ch!r})\n",
            lambda r: (_word(r, "aeiostAEIOSTxy", (0, 12)),))


def shift_letters(rng):
    k = rng.randint(1, 25)
    return ("shift_letters", "s", f"shifts every lowercase letter of `s` {k} places forward in the alphabet, "
            "wrapping from 'z' to 'a', and leaves every other character unchanged",
            "def shift_letters(s):\n    return ''.join(chr((ord(c) - 97 + %d) %% 26 + 97) if 'a' <= c <= 'z' else c "
            "for c in s)\n" % k, lambda r: (_word(r, "abcxyz XYZ!", (0, 10)),))


def rotate_left(rng):
    k = rng.randint(1, 4)
    return ("rotate_left", "xs", f"returns the list `xs` rotated left by {k} positions (the rotation wraps around "
            "for short lists; an empty list stays empty)",
            f"def rotate_left(xs):\n    if not xs:\n        return []\n    k = {k} % len(xs)\n    return xs[k:] + xs[:k]\n",
            lambda r: (_ints(r, n=(0, 7)),))


def clamp_all(rng):
    lo = rng.randint(-10, 0)
    hi = lo + rng.randint(3, 15)
    return ("clamp_all", "xs", f"returns a new list where every number of `xs` below {lo} becomes {lo} and every "
            f"number above {hi} becomes {hi}",
            f"def clamp_all(xs):\n    return [min(max(x, {lo}), {hi}) for x in xs]\n", lambda r: (_ints(r),))


def fizz_words(rng):
    a, b = rng.sample([2, 3, 5, 7], 2)
    w1, w2 = rng.sample(["Fizz", "Buzz", "Pop", "Zap", "Bam"], 2)
    return ("fizz_words", "n", f"returns a list of strings for the numbers 1 to `n`: '{w1}' for multiples of {a}, "
            f"'{w2}' for multiples of {b}, '{w1}{w2}' for multiples of both, and the number itself as a string "
            "otherwise",
            f"def fizz_words(n):\n    out = []\n    for i in range(1, n + 1):\n        word = ({w1!r} if i % {a} == 0 "
            f"else '') + ({w2!r} if i % {b} == 0 else '')\n        out.append(word or str(i))\n    return out\n",
            lambda r: (r.randint(0, 16),))


def fib_mod(rng):
    m = rng.choice([7, 10, 13, 100, 1000])
    return ("fib_mod", "n", f"returns the `n`-th Fibonacci number modulo {m}, where fib(0) = 0 and fib(1) = 1",
            f"def fib_mod(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, (a + b) % {m}\n    return a\n",
            lambda r: (r.randint(0, 40),))


def dedupe(rng):
    return ("dedupe", "xs", "returns the elements of the list `xs` without repeats, each kept where it first occurs",
            "def dedupe(xs):\n    seen, out = set(), []\n    for x in xs:\n        if x not in seen:\n"
            "            seen.add(x)\n            out.append(x)\n    return out\n", lambda r: (_ints(r, 0, 5, (0, 10)),))


def second_largest(rng):
    return ("second_largest", "xs", "returns the second largest distinct value in the list `xs`, or None when it "
            "has fewer than two distinct values",
            "def second_largest(xs):\n    values = sorted(set(xs))\n    return values[-2] if len(values) >= 2 else None\n",
            lambda r: (_ints(r, -5, 9, (0, 6)),))


def digit_power_sum(rng):
    p = rng.randint(1, 3)
    return ("digit_power_sum", "n", f"returns the sum of the {p}-th powers of the decimal digits of the non-negative "
            "integer `n`", f"def digit_power_sum(n):\n    return sum(int(d) ** {p} for d in str(n))\n",
            lambda r: (r.randint(0, 99999),))


def chunk(rng):
    k = rng.randint(2, 4)
    return ("chunk", "xs", f"splits the list `xs` into consecutive pieces of {k} elements (the last piece may be "
            "shorter) and returns the list of pieces",
            f"def chunk(xs):\n    return [xs[i:i + {k}] for i in range(0, len(xs), {k})]\n",
            lambda r: (_ints(r, 0, 9, (0, 9)),))


def long_words(rng):
    k = rng.randint(2, 4)
    return ("long_words", "text", f"returns the words of `text` (split on whitespace) that have more than {k} "
            "characters, in their original order",
            f"def long_words(text):\n    return [w for w in text.split() if len(w) > {k}]\n", lambda r: (_text(r),))


def _maybe_palindrome(rng: random.Random) -> str:
    """Half of the time a palindrome with punctuation and mixed case, else a random string."""
    if rng.random() < 0.5:
        word = _word(rng, "abc", (0, 4))
        return word + rng.choice(["", " ", "!", "x"]) + word[::-1].upper()
    return _word(rng, "abc ,", (1, 6))


def is_clean_palindrome(rng):
    return ("is_clean_palindrome", "s", "returns True when `s` reads the same backwards once everything but letters "
            "and digits is removed and case is ignored, else False",
            "def is_clean_palindrome(s):\n    t = [c.lower() for c in s if c.isalnum()]\n    return t == t[::-1]\n",
            lambda r: (_maybe_palindrome(r),))


def run_length(rng):
    return ("run_length", "s", "returns the run-length encoding of the string `s` as a list of (character, count) "
            "tuples", "def run_length(s):\n    out = []\n    for c in s:\n        if out and out[-1][0] == c:\n"
            "            out[-1] = (c, out[-1][1] + 1)\n        else:\n            out.append((c, 1))\n    return out\n",
            lambda r: (_word(r, "aab", (0, 9)),))


def transpose(rng):
    return ("transpose", "m", "returns the transpose of the rectangular matrix `m`, given as a non-empty list of "
            "equally long non-empty rows", "def transpose(m):\n    return [list(col) for col in zip(*m)]\n",
            lambda r: ((lambda c: [[r.randint(0, 9) for _ in range(c)] for _ in range(r.randint(1, 3))])(
                r.randint(1, 3)),))


def count_primes(rng):
    return ("count_primes", "n", "returns how many prime numbers are less than or equal to `n`",
            "def count_primes(n):\n    return sum(1 for k in range(2, n + 1) if all(k % d for d in range(2, "
            "int(k ** 0.5) + 1)))\n", lambda r: (r.randint(0, 80),))


def running_max(rng):
    return ("running_max", "xs", "returns the list whose i-th element is the largest of the first i + 1 elements of "
            "`xs`", "def running_max(xs):\n    out = []\n    for x in xs:\n        out.append(x if not out else "
            "max(out[-1], x))\n    return out\n", lambda r: (_ints(r),))


def merge_sorted(rng):
    return ("merge_sorted", "a, b", "merges the two ascending lists `a` and `b` into one ascending list",
            "def merge_sorted(a, b):\n    return sorted(a + b)\n",
            lambda r: (sorted(_ints(r, 0, 20, (0, 5))), sorted(_ints(r, 0, 20, (0, 5)))))


def to_base(rng):
    b = rng.randint(2, 9)
    return ("to_base", "n", f"returns the non-negative integer `n` written in base {b} as a string of digits ('0' "
            "for zero)", f"def to_base(n):\n    digits = ''\n    while n:\n        digits = str(n % {b}) + digits\n"
            f"        n //= {b}\n    return digits or '0'\n", lambda r: (r.randint(0, 500),))


def pair_count(rng):
    t = rng.randint(4, 12)
    return ("pair_count", "xs", f"returns how many pairs of positions i < j there are with xs[i] + xs[j] == {t}",
            f"def pair_count(xs):\n    return sum(1 for i in range(len(xs)) for j in range(i + 1, len(xs)) "
            f"if xs[i] + xs[j] == {t})\n", lambda r: (_ints(r, 0, t, (0, 8)),))


def letter_counts(rng):
    return ("letter_counts", "s", "returns a dict mapping each letter of `s` (lower-cased; other characters "
            "ignored) to how often it occurs",
            "def letter_counts(s):\n    out = {}\n    for c in s.lower():\n        if c.isalpha():\n"
            "            out[c] = out.get(c, 0) + 1\n    return out\n", lambda r: (_word(r, "abAB c1", (0, 10)),))


def collatz_steps(rng):
    return ("collatz_steps", "n", "returns how many steps the Collatz rule (n -> n / 2 when n is even, "
            "n -> 3 * n + 1 when odd) takes to reach 1 from the positive integer `n`",
            "def collatz_steps(n):\n    steps = 0\n    while n != 1:\n        n = n // 2 if n % 2 == 0 else 3 * n + 1\n"
            "        steps += 1\n    return steps\n", lambda r: (r.randint(1, 60),))


def interleave(rng):
    return ("interleave", "a, b", "returns the elements of the lists `a` and `b` alternately, starting with `a`, "
            "and then the rest of the longer list", "def interleave(a, b):\n    out = []\n    for i in range("
            "max(len(a), len(b))):\n        out += a[i:i + 1] + b[i:i + 1]\n    return out\n",
            lambda r: (_ints(r, 0, 9, (0, 4)), _ints(r, 10, 19, (1, 4))))


def max_window_sum(rng):
    k = rng.randint(2, 3)
    return ("max_window_sum", "xs", f"returns the largest sum of {k} consecutive elements of the list `xs`, which "
            f"has at least {k} elements", f"def max_window_sum(xs):\n    return max(sum(xs[i:i + {k}]) for i in "
            f"range(len(xs) - {k} + 1))\n", lambda r: (_ints(r, -9, 9, (k, 8)),))


TEMPLATES: list[Callable[[random.Random], Template]] = [
    sum_multiples, count_letter, shift_letters, rotate_left, clamp_all, fizz_words, fib_mod, dedupe,
    second_largest, digit_power_sum, chunk, long_words, is_clean_palindrome, run_length, transpose, count_primes,
    running_max, merge_sorted, to_base, pair_count, letter_counts, collatz_steps, interleave, max_window_sum,
]


def _call(name: str, args: tuple) -> str:
    return f"{name}({', '.join(repr(a) for a in args)})"


def _task(rng: random.Random, template: Callable[[random.Random], Template]) -> dict:
    """One task: the expected values come from executing the template's own reference solution (trusted)."""
    name, signature, description, solution, make_input = template(rng)
    namespace: dict = {}
    exec(compile(solution, f"<reference {name}>", "exec"), namespace)  # our own reference code, not model output
    calls: list[tuple] = []
    counts: dict[str, int] = {}
    for _ in range(NUM_TESTS * 40):
        args = make_input(rng)
        expected = repr(namespace[name](*args))
        cap = 3 if isinstance(namespace[name](*args), bool) else 2  # no constant answer passes most tests
        if args not in calls and counts.get(expected, 0) < cap:
            calls.append(args)
            counts[expected] = counts.get(expected, 0) + 1
        if len(calls) == NUM_TESTS:
            break
    tests = [f"assert {_call(name, args)} == {namespace[name](*args)!r}" for args in calls]
    question = (f"Write a Python function `{name}({signature})` that {description}.\n"
                f"For example: `{tests[0]}`\n{INSTRUCTION}")
    return {"question": question, "tests": tests, "entry_point": name, "answer": solution}


def generate(seed: int = SEED) -> list[dict]:
    """``VARIANTS`` tasks per template (``len(TEMPLATES) * VARIANTS`` in all), a pure function of ``seed``.

    Raises:
        AssertionError: a task with fewer than ``NUM_TESTS`` distinct tests or a repeated question (a generator bug).
    """
    rng = random.Random(seed)
    tasks = [_task(rng, template) for _ in range(VARIANTS) for template in TEMPLATES]
    for task in tasks:
        assert len(task["tests"]) == NUM_TESTS, task["question"]
    assert len({t["question"] for t in tasks}) == len(tasks), "repeated question"
    return tasks


def render(records: list[dict]) -> str:
    """Serialise records as jsonl text (one object per line, trailing newline)."""
    return render_jsonl(records)


def main(argv: list[str] | None = None) -> int:
    """CLI: write (or with ``--check`` verify) the asset. Returns the process exit code."""
    return asset_main(argv, description=__doc__.splitlines()[0], output=OUTPUT, script="make_code_tasks.py",
                      make_text=lambda: render(generate()), noun="tasks")


if __name__ == "__main__":
    sys.exit(main())
