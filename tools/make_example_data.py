"""Write the small example data sets of the offline train types into astrai/data/assets/ (deterministic).

    python tools/make_example_data.py

sft_chat.jsonl (messages), dpo_pairs.jsonl (prompt/chosen/rejected), seq_text.jsonl (text),
grpo_groups.jsonl (prompt, 4 responses, 4 rewards: 1 for the right final number, else 0). Content is generated
arithmetic, written for astrai.
"""

import json
import random
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "astrai" / "data" / "assets"
NAMES = ["Ada", "Bo", "Cy", "Dee", "Eli", "Fay", "Gus", "Ivy"]
THINGS = ["apples", "pencils", "stamps", "marbles", "books", "shells"]


def problem(rng: random.Random) -> tuple[str, str, int]:
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(2, 40), rng.randint(2, 30)
    if rng.random() < 0.5:
        return f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?", f"{a} + {b}", a + b
    a = a + b
    return f"{name} has {a} {thing} and gives away {b}. How many {thing} are left?", f"{a} - {b}", a - b


def solution(expr: str, value: int) -> str:
    return f"We compute {expr} = {value}.\n#### {value}"


def write(name: str, rows: list[dict]) -> None:
    with open(ASSETS / name, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def main() -> None:
    rng = random.Random(2024)
    sft, dpo, seq, grpo = [], [], [], []
    for i in range(36):
        q, expr, value = problem(rng)
        messages = [{"role": "user", "content": q}, {"role": "assistant", "content": solution(expr, value)}]
        if i % 4 == 0:
            q2, expr2, value2 = problem(rng)
            messages += [{"role": "user", "content": "And this one? " + q2},
                         {"role": "assistant", "content": solution(expr2, value2)}]
        sft.append({"messages": messages})
        wrong = value + rng.choice([-3, -1, 1, 2, 10])
        dpo.append({"prompt": q, "chosen": solution(expr, value), "rejected": f"I think it is {wrong}.\n#### {wrong}"})
        seq.append({"text": f"{q} {solution(expr, value).replace(chr(10), ' ')} "
                            f"So the answer to the question is {value}."})
        guesses = [value, value + 1, value - 2, value] if i % 3 else [value] * 4
        rng.shuffle(guesses)
        grpo.append({"prompt": q, "responses": [solution(expr, g) if g == value else f"Maybe {g}.\n#### {g}"
                                                for g in guesses],
                     "rewards": [1.0 if g == value else 0.0 for g in guesses]})
    write("sft_chat.jsonl", sft)
    write("dpo_pairs.jsonl", dpo)
    write("seq_text.jsonl", seq)
    write("grpo_groups.jsonl", grpo)


if __name__ == "__main__":
    main()
