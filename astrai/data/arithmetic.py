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

``builtin:arithmetic_reworded`` holds the test split's problems in other words: templates none of the train split
uses (other verbs, the operands in other orders and positions, other stories), to measure whether what a recipe
learnt holds beyond the phrasings it was trained on.

An SFT warm-up (``configs/examples/sft_arithmetic.yaml``) trains on demonstrations of the train split
(`demonstration`), which ``python -m astrai.data.arithmetic --out DIR`` writes as ``DIR/sft_arithmetic.jsonl``: each answer names
the operation in words, then works the problem out by place value, tens first (``"We need the difference between
73 and 48: 73 - 48 = 73 - 40 - 8 = 33 - 8 = 25"``), the form of the reasoning a 135M model can carry out token by
token where a bare ``"73 - 48 = 25"`` asks it for the result in one step.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

SEED = 20240517
NUM_TRAIN = 2000
NUM_TEST = 200
SPLITS = ("train", "test")
COMMAND = "python -m astrai.data.arithmetic"
"""The command line of `main` (without ``--out DIR``)."""
SFT_FILE = "sft_arithmetic.jsonl"
"""The file `write_files` writes into ``--out``."""
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

# builtin:arithmetic_reworded: templates that no train question uses (other verbs, orders, positions, stories).
REWORDED_ADDITION = (
    "Add {b} to {a}. What number do you get?",
    "{a} increased by {b} is what number?",
    "The sum of {b} and {a} is what?",
    "If you start at {a} and count up {b} more, where do you end?",
    "What number is {b} more than {a}?",
    "Work out {b} + {a}.",
    "On Saturday {name} walked {a} minutes, and on Sunday {b} minutes. How many minutes did {name} walk over the "
    "weekend?",
    "{b} people are on a bus. At the next stop {a} more get on. How many people are on the bus now?",
    "{name} saved {a} dollars in May and {b} dollars in June. How much did {name} save over the two months?",
    "A farmer plants {a} trees in one row and {b} trees in another. How many trees does the farmer plant?",
)
REWORDED_SUBTRACTION = (
    "Take {b} away from {a}. What remains?",
    "{a} decreased by {b} is what number?",
    "What number is {b} less than {a}?",
    "If you start at {a} and count down {b}, where do you end?",
    "By how much does {a} exceed {b}?",
    "Work out {a} - {b}.",
    "{name} needs {a} points to win and already has {b}. How many more points does {name} need?",
    "A bus carries {a} people. At the next stop {b} get off. How many people are still on the bus?",
    "{name} had {a} dollars and spent {b} on a book. How much money does {name} have left?",
    "A farmer had {a} sheep, and {b} were sold at the market. How many sheep does the farmer keep?",
)
REWORDED = {"+": REWORDED_ADDITION, "-": REWORDED_SUBTRACTION}


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


def phrase(problem: Problem, rng: random.Random, templates: dict = TEMPLATES) -> dict:
    """A GSM8K-format record of `problem` with a template of `templates` (and a name) drawn from `rng`."""
    template = rng.choice(templates[problem.operation])
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


def reworded_records(*, seed: int = SEED, num_train: int = NUM_TRAIN, num_test: int = NUM_TEST) -> list[dict]:
    """The test split's problems, in the same order, phrased with the `REWORDED` templates (which no train question
    uses): ``builtin:arithmetic_reworded``."""
    problems = split_problems(seed, num_train=num_train, num_test=num_test)["test"]
    rng = random.Random(f"astrai-arithmetic-reworded:{seed}")
    return [phrase(problem, rng, REWORDED) for problem in problems]


STATED = {"+": "We need the sum of {a} and {b}: ", "-": "We need the difference between {a} and {b}: "}
"""How a worked answer first names its operation in words (`worked_answer`)."""
FORMS = ("stated", "steps")
"""`worked_answer`'s forms: the operation in words then the steps (the default), or the steps alone."""


def worked_steps(operation: str, a: int, b: int) -> str:
    """``a <operation> b`` worked out by place value, the tens of `b` first:
    ``"47 + 38 = 47 + 30 + 8 = 77 + 8 = 85"``, ``"73 - 48 = 73 - 40 - 8 = 33 - 8 = 25"``; its last number is the
    result (what `astrai.rewards.builtins.math_exact_match` reads)."""
    tens, units = b - b % 10, b % 10
    middle = a + tens if operation == "+" else a - tens
    result = middle + units if operation == "+" else middle - units
    return f"{a} {operation} {b} = {a} {operation} {tens} {operation} {units} = {middle} {operation} {units} = {result}"


def worked_answer(operation: str, a: int, b: int, *, form: str = "stated") -> str:
    """The answer of a demonstration: the operation named in words, then `worked_steps`:
    ``"We need the difference between 73 and 48: 73 - 48 = 73 - 40 - 8 = 33 - 8 = 25"``. The words come first
    because the choice of operation is made at the answer's first tokens: in symbols ("73 -") it is a mapping the
    warm-up teaches per train template, which another wording of the question ("By how much does 73 exceed 48?")
    does not reach; in words it is made where the pretrained model already says "we need the difference between"
    for such questions (the untrained SmolLM2-135M-Instruct's free answers do), and it carried over to
    `builtin:arithmetic_reworded` (docs/recipes.md, "Naming the operation in words first"). `form` "steps" leaves
    the words out (`worked_steps`: the form the first SmolLM2 numbers, the distillation teacher and the Gemma 3
    recipe were measured with).

    Raises:
        ValueError: `form` is not one of `FORMS`.
    """
    if form not in FORMS:
        raise ValueError(f"form: expected one of {', '.join(FORMS)}, got {form!r}")
    return (STATED[operation].format(a=a, b=b) if form == "stated" else "") + worked_steps(operation, a, b)


def demonstration(record: dict, *, form: str = "stated") -> dict:
    """An SFT record (``{"messages": [...]}``) of a record of this module: its question as the user turn and
    `worked_answer` as the assistant's (no system turn: the chat template's own, as the recipes sample with)."""
    return {"messages": [{"role": "user", "content": record["question"]},
                         {"role": "assistant", "content": worked_answer(record["operation"], record["a"],
                                                                        record["b"], form=form)}]}


def write_files(out: str | Path, *, num_train: int = NUM_TRAIN, form: str = "stated") -> dict[str, Path]:
    """Write ``sft_arithmetic.jsonl`` (a `demonstration` in `form` per record of the train split of `num_train` questions)
    into the directory `out` (created); returns its path by name (``sft_arithmetic``). The seed and the test size
    are the built-in sets' (``builtin:arithmetic_test`` and ``builtin:arithmetic_reworded`` are made with them), so
    no demonstration shares a problem with them.

    Raises:
        ValueError: `out` is an existing file, `form` unknown, or `num_train` as `split_problems` refuses it.
    """
    if form not in FORMS:
        raise ValueError(f"--form: expected one of {', '.join(FORMS)}, got {form!r}")
    directory = Path(out).expanduser()
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"--out: {directory} is a file; expected a directory (created when missing)")
    rows = [demonstration(r, form=form) for r in arithmetic_records("train", num_train=num_train)]
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / SFT_FILE
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    return {"sft_arithmetic": path}


def report_written(write: Callable[[], dict[str, Path]]) -> int:
    """The exit code of a data generator's command line (``python -m astrai.data.arithmetic``, ``python -m
    astrai.data.tool_arithmetic``): call `write` (it writes files and returns their paths by name) and print each
    ``name: path``, 0; or, for a ValueError or OSError, its one line on stderr, 2."""
    try:
        paths = write()
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m astrai.data.arithmetic --out DIR [--num_train N] [--form stated|steps]``: write the SFT warm-up's demonstrations
    (`write_files`) and print the path."""
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="directory for sft_arithmetic.jsonl (created when missing)")
    parser.add_argument("--num_train", type=int, default=NUM_TRAIN,
                        help=f"train questions, even (default {NUM_TRAIN}, the builtin:arithmetic set); none of them "
                             "is a problem of builtin:arithmetic_test or builtin:arithmetic_reworded")
    parser.add_argument("--form", choices=FORMS, default="stated",
                        help="the answers: the operation in words, then the steps (stated, the default: "
                             "'We need the difference between 73 and 48: 73 - 48 = 73 - 40 - 8 = 33 - 8 = 25'), "
                             "or the steps alone (steps: the form the first SmolLM2 numbers, the distillation "
                             "teacher and the Gemma 3 recipe were measured with)")
    args = parser.parse_args(argv)
    return report_written(lambda: write_files(args.out, num_train=args.num_train, form=args.form))


GENERATED: dict[str, Callable[[], list[dict]]] = {
    "arithmetic": lambda: arithmetic_records("train"),
    "arithmetic_test": lambda: arithmetic_records("test"),
    "arithmetic_reworded": reworded_records,
}
"""Built-in names (``builtin:<name>``) served by this generator instead of a file."""


if __name__ == "__main__":
    sys.exit(main())
