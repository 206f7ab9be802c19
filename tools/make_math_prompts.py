"""Generate astrai's built-in grade-school math prompts (``builtin:math_prompts``).

Every problem is made here from a template and small random numbers; every answer is computed by
the code that writes the problem, never typed by hand. Output is GSM8K-style jsonl, one object per
line: ``{"question": str, "answer": "<short worked solution>\\n#### <N>"}`` with an integer ``N``.

The generator is deterministic (stdlib ``random`` with a fixed seed), so rerunning it reproduces
the committed asset byte for byte; ``tests/test_data.py`` checks that.

    python tools/make_math_prompts.py                # writes astrai/data/assets/math_prompts.jsonl
    python tools/make_math_prompts.py --check        # exit 1 if the committed file is stale
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from asset_cli import asset_main, render_jsonl  # noqa: E402

SEED = 1729
NUM_PROBLEMS = 400
OUTPUT = Path(__file__).resolve().parents[1] / "astrai" / "data" / "assets" / "math_prompts.jsonl"

# (name, subject pronoun, possessive pronoun)
PEOPLE = [
    ("Ava", "she", "her"), ("Ben", "he", "his"), ("Chloe", "she", "her"), ("Diego", "he", "his"),
    ("Emma", "she", "her"), ("Farid", "he", "his"), ("Grace", "she", "her"), ("Hiro", "he", "his"),
    ("Isla", "she", "her"), ("Jamal", "he", "his"), ("Keiko", "she", "her"), ("Liam", "he", "his"),
    ("Maya", "she", "her"), ("Noah", "he", "his"), ("Olga", "she", "her"), ("Pedro", "he", "his"),
    ("Priya", "she", "her"), ("Ravi", "he", "his"), ("Sofia", "she", "her"), ("Tariq", "he", "his"),
    ("Uma", "she", "her"), ("Victor", "he", "his"), ("Wen", "she", "her"), ("Yusuf", "he", "his"),
    ("Zara", "she", "her"), ("Leo", "he", "his"), ("Nina", "she", "her"), ("Omar", "he", "his"),
    ("Hana", "she", "her"), ("Marco", "he", "his"), ("Amara", "she", "her"), ("Kofi", "he", "his"),
]
THINGS = [
    "apples", "marbles", "stickers", "pencils", "cookies", "books", "shells", "cards", "balloons",
    "stamps", "toy cars", "cupcakes", "crayons", "buttons", "beads", "seashells", "postcards",
]
CONTAINERS = ["boxes", "bags", "jars", "baskets", "packs", "crates", "trays"]
SHOP = [  # (item, plural, min price, max price) in whole dollars
    ("notebook", "notebooks", 2, 6), ("sandwich", "sandwiches", 3, 8), ("pen", "pens", 1, 3),
    ("juice box", "juice boxes", 1, 3), ("comic book", "comic books", 3, 7),
    ("plant", "plants", 4, 9), ("ball", "balls", 2, 5), ("scarf", "scarves", 5, 9),
]
VEHICLES = [("car", "drives", "it"), ("train", "travels", "it"), ("bus", "travels", "it"),
            ("cyclist", "rides", "she"), ("runner", "runs", "he")]

Problem = tuple[str, list[str], int]  # question, solution lines, integer answer


def person(rng: random.Random) -> tuple[str, str, str]:
    """A random (name, subject pronoun, possessive pronoun)."""
    return rng.choice(PEOPLE)


def two_people(rng: random.Random) -> tuple[tuple[str, str, str], tuple[str, str, str]]:
    """Two distinct random people."""
    a, b = rng.sample(PEOPLE, 2)
    return a, b


# ---------------------------------------------------------------- one-step templates


def add_more(rng: random.Random) -> Problem:
    (n, he, _), thing = person(rng), rng.choice(THINGS)
    a, b = rng.randint(3, 40), rng.randint(2, 30)
    q = f"{n} has {a} {thing}. Then {he} gets {b} more. How many {thing} does {n} have now?"
    return q, [f"{n} has {a} + {b} = {a + b} {thing}."], a + b


def give_away(rng: random.Random) -> Problem:
    (n, _, _), thing = person(rng), rng.choice(THINGS)
    a = rng.randint(10, 60)
    b = rng.randint(2, a - 1)
    q = f"{n} had {a} {thing} and gave {b} of them to a friend. How many {thing} does {n} have left?"
    return q, [f"{n} has {a} - {b} = {a - b} {thing} left."], a - b


def groups_of(rng: random.Random) -> Problem:
    thing, box = rng.choice(THINGS), rng.choice(CONTAINERS)
    a, b = rng.randint(2, 9), rng.randint(3, 12)
    q = f"There are {a} {box} with {b} {thing} in each. How many {thing} are there in all?"
    return q, [f"There are {a} * {b} = {a * b} {thing}."], a * b


def share_equally(rng: random.Random) -> Problem:
    (n, _, _), thing = person(rng), rng.choice(THINGS)
    k, each = rng.randint(2, 8), rng.randint(2, 12)
    total = k * each
    q = (f"{n} has {total} {thing} and shares them equally among {k} friends. "
         f"How many {thing} does each friend get?")
    return q, [f"Each friend gets {total} / {k} = {each} {thing}."], each


def how_many_more(rng: random.Random) -> Problem:
    (a_n, _, _), (b_n, _, _) = two_people(rng)
    thing = rng.choice(THINGS)
    a = rng.randint(15, 90)
    b = rng.randint(3, a - 2)
    q = f"{a_n} has {a} {thing} and {b_n} has {b} {thing}. How many more {thing} does {a_n} have than {b_n}?"
    return q, [f"{a_n} has {a} - {b} = {a - b} more {thing}."], a - b


def distance(rng: random.Random) -> Problem:
    vehicle, verb, it = rng.choice(VEHICLES)
    speed = {"it": rng.randint(2, 12) * 5, "she": rng.randint(8, 16), "he": rng.randint(4, 9)}[it]
    hours = rng.randint(2, 6)
    q = (f"A {vehicle} {verb} at {speed} miles per hour. "
         f"How many miles does {it} go in {hours} hours?")
    return q, [f"{it.capitalize()} goes {speed} * {hours} = {speed * hours} miles."], speed * hours


def percent_of(rng: random.Random) -> Problem:
    pct = rng.choice([10, 20, 25, 50, 75])
    total = rng.randint(2, 12) * (100 // _gcd(pct, 100))
    place, who = rng.choice([("class", "students"), ("club", "members"), ("camp", "children")])
    extra = rng.choice(["wear glasses", "play chess", "have a pet", "walk to school"])
    part = total * pct // 100
    q = f"There are {total} {who} in a {place}. {pct}% of them {extra}. How many {who} {extra}?"
    return q, [f"{pct}% of {total} is {total} * {pct} / 100 = {part}."], part


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


# ---------------------------------------------------------------- two-step templates


def shopping_change(rng: random.Random) -> Problem:
    (n, he, _), (item, items, lo, hi) = person(rng), rng.choice(SHOP)
    qty, price = rng.randint(2, 5), rng.randint(lo, hi)
    cost = qty * price
    bill = next(b for b in (10, 20, 50, 100) if b > cost)
    q = (f"{n} buys {qty} {items} that cost ${price} each. {he.capitalize()} pays with a ${bill} bill. "
         f"How much change does {he} get, in dollars?")
    sol = [f"The {items} cost {qty} * ${price} = ${cost}.", f"The change is ${bill} - ${cost} = ${bill - cost}."]
    return q, sol, bill - cost


def ages(rng: random.Random) -> Problem:
    (a_n, _, _), (b_n, _, _) = two_people(rng)
    age, diff, later = rng.randint(4, 15), rng.randint(2, 9), rng.randint(2, 10)
    q = f"{a_n} is {age} years old. {b_n} is {diff} years older than {a_n}. How old will {b_n} be in {later} years?"
    sol = [f"{b_n} is {age} + {diff} = {age + diff} years old now.",
           f"In {later} years {b_n} will be {age + diff} + {later} = {age + diff + later}."]
    return q, sol, age + diff + later


def weekly_savings(rng: random.Random) -> Problem:
    n, he, his = person(rng)
    start, per_week, weeks = rng.randint(1, 6) * 5, rng.randint(3, 15), rng.randint(3, 10)
    saved = per_week * weeks
    q = (f"{n} has ${start} in {his} piggy bank. {he.capitalize()} saves ${per_week} every week. "
         f"How much money will {he} have after {weeks} weeks?")
    sol = [f"{n} saves {per_week} * {weeks} = ${saved}.",
           f"{he.capitalize()} will have {start} + {saved} = ${start + saved}."]
    return q, sol, start + saved


def weeks_to_goal(rng: random.Random) -> Problem:
    n, he, _ = person(rng)
    goal = rng.choice(["bike", "tablet", "guitar", "telescope", "skateboard"])
    per_week, weeks = rng.randint(4, 12), rng.randint(3, 9)
    have = rng.randint(1, 4) * 5
    price = have + per_week * weeks
    q = (f"{n} wants a {goal} that costs ${price}. {he.capitalize()} already has ${have} and saves ${per_week} "
         f"each week. How many weeks does {he} need to save to buy the {goal}?")
    sol = [f"{n} still needs {price} - {have} = ${price - have}.",
           f"That takes {price - have} / {per_week} = {weeks} weeks."]
    return q, sol, weeks


def discount(rng: random.Random) -> Problem:
    n, he, _ = person(rng)
    pct = rng.choice([10, 20, 25, 50])
    price = rng.randint(1, 8) * (100 // _gcd(pct, 100)) if pct != 10 else rng.randint(2, 9) * 10
    item = rng.choice(["jacket", "lamp", "backpack", "board game", "pair of shoes", "guitar"])
    off = price * pct // 100
    q = f"A {item} costs ${price}. It is on sale for {pct}% off. How much does {n} pay for the {item}, in dollars?"
    sol = [f"The discount is {price} * {pct} / 100 = ${off}.", f"{n} pays {price} - {off} = ${price - off}."]
    return q, sol, price - off


def perimeter(rng: random.Random) -> Problem:
    length, width = rng.randint(4, 20), rng.randint(2, 12)
    thing = rng.choice(["garden", "playground", "rug", "poster", "field"])
    p = 2 * (length + width)
    q = (f"A rectangular {thing} is {length} meters long and {width} meters wide. "
         f"What is its perimeter in meters?")
    return q, [f"The perimeter is 2 * ({length} + {width}) = {p} meters."], p


def area_cost(rng: random.Random) -> Problem:
    length, width, cost = rng.randint(3, 10), rng.randint(2, 8), rng.randint(2, 6)
    room = rng.choice(["bedroom", "kitchen", "office", "hallway", "classroom"])
    area = length * width
    q = (f"A {room} floor is {length} feet by {width} feet. Tiles cost ${cost} per square foot. "
         f"How much do tiles for the whole floor cost, in dollars?")
    sol = [f"The area is {length} * {width} = {area} square feet.", f"The tiles cost {area} * {cost} = ${area * cost}."]
    return q, sol, area * cost


def reading_time(rng: random.Random) -> Problem:
    n, he, _ = person(rng)
    per_day = rng.choice([15, 20, 30, 40, 45])
    days = rng.choice([d for d in range(2, 13) if per_day * d % 60 == 0])
    hours = per_day * days // 60
    q = f"{n} practices the piano for {per_day} minutes every day. How many hours does {he} practice in {days} days?"
    sol = [f"{n} practices {per_day} * {days} = {per_day * days} minutes.",
           f"That is {per_day * days} / 60 = {hours} hours."]
    return q, sol, hours


def recipe(rng: random.Random) -> Problem:
    n, he, _ = person(rng)
    cups, servings, factor = rng.randint(2, 5), rng.randint(2, 6), rng.randint(2, 4)
    food, part = rng.choice([("pancakes", "flour"), ("muffins", "milk"), ("bread", "flour"), ("soup", "water")])
    q = (f"A recipe for {food} uses {cups} cups of {part} to make {servings} servings. "
         f"{n} wants to make {servings * factor} servings. How many cups of {part} does {he} need?")
    sol = [f"{servings * factor} servings is {servings * factor} / {servings} = {factor} times the recipe.",
           f"{he.capitalize()} needs {cups} * {factor} = {cups * factor} cups of {part}."]
    return q, sol, cups * factor


def wages(rng: random.Random) -> Problem:
    n, he, _ = person(rng)
    rate, hours, days = rng.randint(8, 15), rng.randint(2, 6), rng.randint(2, 5)
    job = rng.choice(["working at a bakery", "working at a bookshop", "walking dogs", "working at a cafe"])
    q = (f"{n} earns ${rate} an hour {job}. {he.capitalize()} works {hours} hours a day "
         f"for {days} days. How much does {he} earn in total, in dollars?")
    sol = [f"{n} works {hours} * {days} = {hours * days} hours.",
           f"{he.capitalize()} earns {hours * days} * {rate} = ${hours * days * rate}."]
    return q, sol, hours * days * rate


# ---------------------------------------------------------------- three- and four-step templates


def packs_left(rng: random.Random) -> Problem:
    n, he, his = person(rng)
    thing = rng.choice(["cookies", "granola bars", "stickers", "crayons"])
    packs, per = rng.randint(2, 6), rng.randint(4, 10)
    total = packs * per
    used = rng.randint(1, total // 3)
    given = rng.randint(1, total // 3)
    left = total - used - given
    q = (f"{n} buys {packs} packs of {thing} with {per} in each pack. {he.capitalize()} uses {used} "
         f"and gives {given} to {his} sister. How many {thing} are left?")
    sol = [f"{n} buys {packs} * {per} = {total} {thing}.",
           f"After using {used}, {total} - {used} = {total - used} remain.",
           f"After giving {given} away, {total - used} - {given} = {left} are left."]
    return q, sol, left


def fruit_total(rng: random.Random) -> Problem:
    n, he, _ = person(rng)
    apples, times = rng.randint(3, 12), rng.randint(2, 3)
    oranges = apples * times
    fewer = rng.randint(1, oranges - 1)
    bananas = oranges - fewer
    word = {2: "twice", 3: "three times"}[times]
    q = (f"{n} has {apples} apples. {he.capitalize()} has {word} as many oranges as apples, and {fewer} fewer "
         f"bananas than oranges. How many pieces of fruit does {n} have?")
    sol = [f"{n} has {apples} * {times} = {oranges} oranges.",
           f"{he.capitalize()} has {oranges} - {fewer} = {bananas} bananas.",
           f"In total {apples} + {oranges} + {bananas} = {apples + oranges + bananas} pieces of fruit."]
    return q, sol, apples + oranges + bananas


def bus_riders(rng: random.Random) -> Problem:
    start = rng.randint(12, 40)
    off1 = rng.randint(2, start // 2)
    on1 = rng.randint(2, 15)
    mid = start - off1 + on1
    off2 = rng.randint(2, mid - 1)
    end = mid - off2
    q = (f"A bus has {start} passengers. At the first stop {off1} people get off and {on1} get on. "
         f"At the second stop {off2} people get off. How many passengers are on the bus now?")
    sol = [f"After the first stop there are {start} - {off1} + {on1} = {mid} passengers.",
           f"After the second stop there are {mid} - {off2} = {end} passengers."]
    return q, sol, end


def half_then_lose(rng: random.Random) -> Problem:
    n, he, his = person(rng)
    thing = rng.choice(THINGS)
    total = rng.randint(5, 30) * 2
    half = total // 2
    lost = rng.randint(1, half - 1)
    q = (f"{n} had {total} {thing}. {he.capitalize()} gave half of them to {his} brother and then lost {lost}. "
         f"How many {thing} does {n} have now?")
    sol = [f"{n} gave away {total} / 2 = {half} and kept {half}.",
           f"After losing {lost}, {half} - {lost} = {half - lost} are left."]
    return q, sol, half - lost


def party_budget(rng: random.Random) -> Problem:
    n, he, _ = person(rng)
    guests, cake, per_bag, budget_extra = rng.randint(4, 10), rng.randint(10, 25), rng.randint(2, 5), rng.randint(5, 30)
    bags = guests * per_bag
    spent = cake + bags
    budget = spent + budget_extra
    q = (f"{n} has ${budget} for a party. A cake costs ${cake} and {he} buys a ${per_bag} gift bag for each "
         f"of {guests} guests. How much money is left, in dollars?")
    sol = [f"The gift bags cost {guests} * {per_bag} = ${bags}.",
           f"Together with the cake that is {cake} + {bags} = ${spent}.",
           f"{n} has {budget} - {spent} = ${budget - spent} left."]
    return q, sol, budget - spent


# Template -> weight. One-step templates carry more weight, so a small model gets some right.
TEMPLATES: dict[Callable[[random.Random], Problem], int] = {
    add_more: 4, give_away: 4, groups_of: 4, share_equally: 3, how_many_more: 3, distance: 3, percent_of: 2,
    shopping_change: 2, ages: 2, weekly_savings: 2, weeks_to_goal: 2, discount: 2, perimeter: 2, area_cost: 2,
    reading_time: 2, recipe: 2, wages: 2,
    packs_left: 1, fruit_total: 1, bus_riders: 1, half_then_lose: 2, party_budget: 1,
}


def generate(seed: int = SEED, n: int = NUM_PROBLEMS) -> list[dict[str, str]]:
    """Return ``n`` unique problems as GSM8K-style dicts; a pure function of ``(seed, n)``.

    Raises:
        AssertionError: if a template produced a negative answer or a solution whose last
            computed number differs from the answer (a generator bug).
    """
    rng = random.Random(seed)
    templates, weights = list(TEMPLATES), list(TEMPLATES.values())
    seen: set[str] = set()
    records: list[dict[str, str]] = []
    while len(records) < n:
        question, solution, answer = rng.choices(templates, weights)[0](rng)
        if question in seen:
            continue
        assert isinstance(answer, int) and answer >= 0, (question, answer)
        assert solution[-1].rstrip(".").split("=")[-1].strip(" $").split()[0] == str(answer), solution
        seen.add(question)
        records.append({"question": question, "answer": "\n".join(solution) + f"\n#### {answer}"})
    return records


def render(records: list[dict]) -> str:
    """Serialise records as jsonl text (one object per line, trailing newline)."""
    return render_jsonl(records)


def main(argv: list[str] | None = None) -> int:
    """CLI: write (or with ``--check`` verify) the asset. Returns the process exit code."""
    return asset_main(argv, description=__doc__.splitlines()[0], output=OUTPUT, script="make_math_prompts.py",
                      make_text=lambda: render(generate()), noun="problems")


if __name__ == "__main__":
    sys.exit(main())
