"""Built-in tool-use task: arithmetic beyond what a 135M model does in its head, to solve with a calculator tool.

Two kinds of problem, half of each split each:
- ``"product"``: ``a * b`` with ``a`` in 100..999 and ``b`` in 10..999 (products of 3-digit by 2- or 3-digit numbers);
- ``"sum4"``: ``a + b + c + d``, four numbers in 100..999.
Each is phrased as a plain question ("What is 347 * 58?") or a short word problem (boxes, crates, a shop's
takings ...), picked at random among several templates per kind.

``builtin:tool_arithmetic`` (train, 2000 questions) and ``builtin:tool_arithmetic_test`` (held out, 200) are made
here in memory; ``python -m astrai.data.tool_arithmetic --out DIR`` writes them as ``DIR/train.jsonl`` and
``DIR/test.jsonl``, and the SFT warm-up's tool-use demonstrations as ``DIR/sft_tools.jsonl`` (`demonstration`).
Problems are drawn with ``random.Random`` seeded by the seed: the test split first, then the train split from
problems not in it, so the splits never share a problem (the operands as a multiset per kind); everything is a
pure function of ``(seed, num_train, num_test)``.

Each record: ``question``, ``answer`` (GSM8K format, ``"347 * 58 = 20126\\n#### 20126"``), ``kind``, ``operands``
(list of ints) and ``expression`` (``"347 * 58"``, what a calculator call should evaluate).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from astrai.data.arithmetic import report_written

__all__ = ["ToolProblem", "KINDS", "split_problems", "tool_arithmetic_records", "demonstration", "write_files",
           "main", "GENERATED"]

SEED = 20261204
NUM_TRAIN = 2000
NUM_TEST = 200
COMMAND = "python -m astrai.data.tool_arithmetic"
"""The command line of `main` (without ``--out DIR``)."""
SFT_FILE = "sft_tools.jsonl"
"""The demonstrations' file `write_files` writes into ``--out``."""
SPLITS = ("train", "test")
KINDS = ("product", "sum4")
TOOL_NAME = "calculator"
NAMES = ("Ava", "Ben", "Chloe", "Diego", "Emma", "Farid", "Grace", "Hiro", "Isla", "Jamal", "Keiko", "Liam",
         "Maya", "Noah", "Olga", "Priya", "Ravi", "Sofia", "Tariq", "Wen", "Yusuf", "Zara")

# {a} {b} {c} {d}: the operands in order; {name}: a name.
PRODUCT = (
    "What is {a} * {b}?",
    "Compute {a} * {b}.",
    "Calculate the product of {a} and {b}.",
    "What is {a} times {b}?",
    "Multiply {a} by {b}. What is the result?",
    "A warehouse has {a} boxes with {b} items in each box. How many items are there in all?",
    "{name} plants {a} rows of trees with {b} trees in each row. How many trees does {name} plant?",
    "A factory makes {a} toys every day. How many toys does it make in {b} days?",
    "Each ticket costs {a} dollars. {name} buys {b} tickets. How many dollars does {name} pay?",
)
SUM4 = (
    "What is {a} + {b} + {c} + {d}?",
    "Compute {a} + {b} + {c} + {d}.",
    "Calculate the sum of {a}, {b}, {c} and {d}.",
    "Add {a}, {b}, {c} and {d}. What is the total?",
    "A shop took {a} dollars on Monday, {b} on Tuesday, {c} on Wednesday and {d} on Thursday. How many dollars "
    "did it take in all?",
    "{name} drove {a} km, then {b} km, then {c} km and finally {d} km. How many km did {name} drive?",
    "Four crates hold {a}, {b}, {c} and {d} apples. How many apples are there altogether?",
    "A library has {a} novels, {b} comics, {c} atlases and {d} cookbooks. How many books is that?",
)
TEMPLATES = {"product": PRODUCT, "sum4": SUM4}


@dataclass(frozen=True)
class ToolProblem:
    """One problem: `kind` ("product" or "sum4") over `operands` (2 or 4 ints)."""

    kind: str
    operands: tuple[int, ...]

    @property
    def expression(self) -> str:
        """The calculator expression, e.g. ``"347 * 58"`` or ``"101 + 202 + 303 + 404"``."""
        return (" * " if self.kind == "product" else " + ").join(str(n) for n in self.operands)

    @property
    def answer(self) -> int:
        """The value of the expression."""
        if self.kind == "product":
            return self.operands[0] * self.operands[1]
        return sum(self.operands)

    def key(self) -> tuple:
        """What two problems must not share across splits: the kind and the operands as a multiset."""
        return (self.kind, tuple(sorted(self.operands)))


def _draw(kind: str, rng: random.Random) -> ToolProblem:
    """A random problem of `kind`."""
    if kind == "product":
        return ToolProblem(kind, (rng.randint(100, 999), rng.randint(10, 999)))
    if kind == "sum4":
        return ToolProblem(kind, tuple(rng.randint(100, 999) for _ in range(4)))
    raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")


def split_problems(seed: int = SEED, *, num_train: int = NUM_TRAIN,
                   num_test: int = NUM_TEST) -> dict[str, list[ToolProblem]]:
    """Disjoint train and test problems, half of each split per kind, shuffled (see the module docstring).

    Raises:
        ValueError: when a size is odd or negative.
    """
    for name, size in (("num_train", num_train), ("num_test", num_test)):
        if size < 0 or size % 2:
            raise ValueError(f"{name}: expected an even number >= 0, got {size}")
    rng = random.Random(f"astrai-tool-arithmetic:{seed}")
    seen: set[tuple] = set()
    splits: dict[str, list[ToolProblem]] = {"test": [], "train": []}
    for split, size in (("test", num_test), ("train", num_train)):
        for kind in KINDS:
            drawn = 0
            while drawn < size // 2:
                problem = _draw(kind, rng)
                if problem.key() not in seen:
                    seen.add(problem.key())
                    splits[split].append(problem)
                    drawn += 1
        rng.shuffle(splits[split])
    return {"train": splits["train"], "test": splits["test"]}


def phrase(problem: ToolProblem, rng: random.Random) -> dict[str, Any]:
    """The record of `problem` with a template (and name) drawn from `rng`."""
    names = dict(zip("abcd", problem.operands))
    question = rng.choice(TEMPLATES[problem.kind]).format(name=rng.choice(NAMES), **names)
    return {"question": question, "answer": f"{problem.expression} = {problem.answer}\n#### {problem.answer}",
            "kind": problem.kind, "operands": list(problem.operands), "expression": problem.expression}


def tool_arithmetic_records(split: str, *, seed: int = SEED, num_train: int = NUM_TRAIN,
                            num_test: int = NUM_TEST) -> list[dict[str, Any]]:
    """The records of one split (``"train"`` or ``"test"``), deterministic in all arguments.

    Raises:
        ValueError: for an unknown split, or sizes `split_problems` rejects.
    """
    if split not in SPLITS:
        raise ValueError(f"split: expected one of {SPLITS}, got {split!r}")
    problems = split_problems(seed, num_train=num_train, num_test=num_test)[split]
    rng = random.Random(f"astrai-tool-arithmetic-phrasing:{seed}:{split}")
    return [phrase(problem, rng) for problem in problems]


def demonstration(record: dict[str, Any], tools: Sequence[Any]) -> dict[str, Any]:
    """An SFT record (``{"messages": [...]}``) showing the calculator used on `record` (a record of this module):
    the system turn listing `tools` as an episode's prompt lists them for a template without tool support
    (`astrai.agents.tool_calls.with_tools_prompt`), the question, an assistant turn that is only the Hermes
    ``<tool_call>`` block `astrai.agents.tool_calls.format_tool_call` writes (the text a rollout turn that makes
    that call samples), the tool's result as a ``tool`` message, and the final answer ``"<expression> = <value>"``.
    The calls are in the assistant text (not in ``tool_calls``), so any SFT data path renders them as sampled."""
    from astrai.agents.calculator import calculator
    from astrai.agents.tool_calls import format_tool_call, with_tools_prompt

    expression = record["expression"]
    result = calculator(expression)
    messages = with_tools_prompt([{"role": "user", "content": record["question"]}], tools)
    messages += [{"role": "assistant", "content": format_tool_call(TOOL_NAME, {"expression": expression})},
                 {"role": "tool", "content": result},
                 {"role": "assistant", "content": f"{expression} = {result}"}]
    return {"messages": messages}


def write_files(out: str | Path, *, seed: int = SEED, num_train: int = NUM_TRAIN, num_test: int = NUM_TEST,
                num_demonstrations: Optional[int] = None) -> dict[str, Path]:
    """Write ``train.jsonl``, ``test.jsonl`` and ``sft_tools.jsonl`` (demonstrations on the first
    `num_demonstrations` train records, default all) into the directory `out` (created); returns the paths by
    name (``train``, ``test``, ``sft_tools``). Needs transformers (the calculator's JSON schema)."""
    from astrai.agents.calculator import calculator
    from astrai.agents.tools import tool_from_function

    directory = Path(out).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    train = tool_arithmetic_records("train", seed=seed, num_train=num_train, num_test=num_test)
    test = tool_arithmetic_records("test", seed=seed, num_train=num_train, num_test=num_test)
    tools = [tool_from_function(calculator)]
    demos = [demonstration(r, tools) for r in train[:num_demonstrations]]
    paths = {"train": directory / "train.jsonl", "test": directory / "test.jsonl",
             "sft_tools": directory / SFT_FILE}
    for name, rows in (("train", train), ("test", test), ("sft_tools", demos)):
        with open(paths[name], "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    return paths


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m astrai.data.tool_arithmetic --out DIR [--seed N] [--num_train N] [--num_test N]
    [--num_demonstrations N]``: write the files of `write_files` and print their paths."""
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="directory for train.jsonl, test.jsonl and sft_tools.jsonl")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--num_train", type=int, default=NUM_TRAIN)
    parser.add_argument("--num_test", type=int, default=NUM_TEST)
    parser.add_argument("--num_demonstrations", type=int, default=None,
                        help="demonstrations on the first N train questions (default: all)")
    args = parser.parse_args(argv)
    return report_written(lambda: write_files(args.out, seed=args.seed, num_train=args.num_train,
                                              num_test=args.num_test, num_demonstrations=args.num_demonstrations))


GENERATED = {
    "tool_arithmetic": lambda: tool_arithmetic_records("train"),
    "tool_arithmetic_test": lambda: tool_arithmetic_records("test"),
}
"""Built-in names (``builtin:<name>``) served by this generator instead of a file."""


if __name__ == "__main__":
    sys.exit(main())
