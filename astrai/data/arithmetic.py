"""Built-in arithmetic task: two-digit addition and subtraction questions in GSM8K format.

``builtin:arithmetic`` (train, 2000 questions) and ``builtin:arithmetic_test`` (held out, 200 questions) are made
here, in memory, from problems ``(operation, a, b)`` with ``a, b`` in 10..99 and a non-negative answer
(subtraction only with ``a >= b``). Each problem is phrased either as a plain question ("What is 47 - 19?") or as
a short word problem (apples, coins, pages ...), picked at random among several templates per operation.

Splits: the 8100 addition and 4095 subtraction problems are each shuffled with ``random.Random(seed)``; the first
``num_test / 2`` of each operation form the test split, the next ``num_train / 2`` the train split. So the two
splits never share an ``(operation, a, b)`` triple, both are balanced between the operations, and everything
(problems, phrasings, names, order) is a pure function of ``(seed, num_train, num_test)``.

Each record: ``question``, ``answer`` (``"47 - 19 = 28\\n#### 28"``), and the problem itself as ``operation``
(``"+"`` or ``"-"``), ``a``, ``b`` (ints; the question may mention them in either order).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

SEED = 20240517
NUM_TRAIN = 2000
NUM_TEST = 200
SPLITS = ("train", "test")
OPERATIONS = ("+", "-")

NAMES = ("Ava", "Ben", "Chloe", "Diego", "Emma", "Farid", "Grace", "Hiro", "Isla", "Jamal", "Keiko", "Liam",
         "Maya", "Noah", "Olga", "Priya", "Ravi", "Sofia", "Tariq", "Wen", "Yusuf", "Zara")

# Templates use {a}, {b} (a >= b for subtraction) and {name}. Plain questions first, then word problems.
ADDITION = (
    "What is {a} + {b}?",
    "Compute {a} + {b}.",
    "Calculate the sum of {a} and {b}.",
    "What do you get when you add {b} to {a}?",
    "{a} plus {b} equals what?",
    "Find the total of {a} and {b}.",
    "{name} has {a} apples and picks {b} more. How many apples does {name} have now?",
    "A jar holds {a} coins. {name} puts in {b} more coins. How many coins are in the jar now?",
    "{name} read {a} pages on Monday and {b} pages on Tuesday. How many pages did {name} read in all?",
    "There are {a} birds on a tree and {b} more birds land on it. How many birds are on the tree?",
    "{name} has {a} stickers. A friend gives {name} {b} stickers. How many stickers does {name} have?",
    "A shop sold {a} pencils in the morning and {b} pencils in the afternoon. How many pencils did it sell?",
)
SUBTRACTION = (
    "What is {a} - {b}?",
    "Compute {a} - {b}.",
    "What is {a} minus {b}?",
    "Subtract {b} from {a}. What is the result?",
    "What is the difference between {a} and {b}?",
    "How much more is {a} than {b}?",
    "{name} has {a} apples and gives away {b}. How many apples does {name} have left?",
    "A jar holds {a} coins. {name} takes out {b} coins. How many coins are left in the jar?",
    "A book has {a} pages. {name} has read {b} of them. How many pages are left to read?",
    "There are {a} birds on a tree and {b} of them fly away. How many birds are still on the tree?",
    "{name} had {a} stickers and used {b} of them. How many stickers does {name} have now?",
    "A shop had {a} pencils and sold {b}. How many pencils does the shop have left?",
)
TEMPLATES = {"+": ADDITION, "-": SUBTRACTION}


@dataclass(frozen=True)
class Problem:
    """One arithmetic problem: ``a <operation> b`` with two-digit operands and a non-negative answer."""

    operation: str
    a: int
    b: int

    @property
    def answer(self) -> int:
        """``a + b`` or ``a - b`` (>= 0)."""
        return self.a + self.b if self.operation == "+" else self.a - self.b


def all_problems(operation: str) -> list[Problem]:
    """Every two-digit problem of `operation` in (a, b) order: 8100 for "+", 4095 for "-" (a >= b).

    Raises:
        ValueError: for an operation other than "+" or "-".
    """
    if operation not in TEMPLATES:
        raise ValueError(f"operation: expected one of {OPERATIONS}, got {operation!r}")
    return [Problem(operation, a, b) for a in range(10, 100) for b in range(10, 100)
            if operation == "+" or a >= b]


def split_problems(seed: int = SEED, *, num_train: int = NUM_TRAIN,
                   num_test: int = NUM_TEST) -> dict[str, list[Problem]]:
    """Disjoint train and test problems, half of each split per operation, shuffled (see the module docstring).

    Raises:
        ValueError: when a size is odd, negative, or the two splits need more problems than exist.
    """
    for name, size in (("num_train", num_train), ("num_test", num_test)):
        if size < 0 or size % 2:
            raise ValueError(f"{name}: expected an even number >= 0, got {size}")
    rng = random.Random(f"astrai-arithmetic:{seed}")
    splits: dict[str, list[Problem]] = {"train": [], "test": []}
    for operation in OPERATIONS:
        pool = all_problems(operation)
        if (num_train + num_test) // 2 > len(pool):
            raise ValueError(f"num_train + num_test: {num_train + num_test} needs more than the {len(pool)} "
                             f"'{operation}' problems per operation allow")
        rng.shuffle(pool)
        splits["test"] += pool[:num_test // 2]
        splits["train"] += pool[num_test // 2:(num_train + num_test) // 2]
    for problems in splits.values():
        rng.shuffle(problems)
    return splits


def phrase(problem: Problem, rng: random.Random) -> dict:
    """A GSM8K-format record of `problem` with a template (and name) drawn from `rng`."""
    template = rng.choice(TEMPLATES[problem.operation])
    question = template.format(a=problem.a, b=problem.b, name=rng.choice(NAMES))
    solution = f"{problem.a} {problem.operation} {problem.b} = {problem.answer}"
    return {"question": question, "answer": f"{solution}\n#### {problem.answer}",
            "operation": problem.operation, "a": problem.a, "b": problem.b}


def arithmetic_records(split: str, *, seed: int = SEED, num_train: int = NUM_TRAIN,
                       num_test: int = NUM_TEST) -> list[dict]:
    """The records of one split (``"train"`` or ``"test"``), deterministic in all arguments.

    Raises:
        ValueError: for an unknown split, or sizes `split_problems` rejects.
    """
    if split not in SPLITS:
        raise ValueError(f"split: expected one of {SPLITS}, got {split!r}")
    problems = split_problems(seed, num_train=num_train, num_test=num_test)[split]
    rng = random.Random(f"astrai-arithmetic-phrasing:{seed}:{split}")
    return [phrase(problem, rng) for problem in problems]


GENERATED: dict[str, Callable[[], list[dict]]] = {
    "arithmetic": lambda: arithmetic_records("train"),
    "arithmetic_test": lambda: arithmetic_records("test"),
}
"""Built-in names (``builtin:<name>``) served by this generator instead of a file."""
