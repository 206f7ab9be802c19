"""Slow tier: a shortened recipe on the built-in arithmetic task must raise held-out greedy accuracy beyond noise.

What runs, per recipe (`RECIPES`, one `Recipe` each: a job YAML plus overrides, so recipes can be tuned here or
replaced by `configs/examples/*_arithmetic.yaml` files without touching the test):
1. `python -m astrai.evaluate` on the recipe's starting model: greedy responses to the held-out questions
   (`builtin:arithmetic_test`, first `eval_questions`), prompts built from the recipe's settings.
2. `python -m astrai.train` with the recipe on `builtin:arithmetic` (disjoint from the held-out questions by
   (operation, a, b)), publishing its final checkpoint.
3. The same evaluation on the run's output_dir (its latest checkpoint, the run's prompt settings).

Statistics: both evaluations score the SAME questions with deterministic greedy decoding, so the outcomes are
paired, and the honest test is McNemar's (exact, one-sided): among the discordant questions, `gained` went from
wrong to right and `lost` from right to wrong; under the null hypothesis "training did not change accuracy" each
discordant question is equally likely to go either way, so `gained ~ Binomial(gained + lost, 1/2)` and
p = P(X >= gained) (`astrai.algos.stats.mcnemar_exact_p`). The test asserts `after > before` and p < `alpha`
(0.01). It conditions on the questions asked (the noise is which questions a model happens to get right, not
sampling, which greedy decoding removes). For scale: from the measured baseline of about 7% on 200 questions, a
rise to 20% with, say, 30 gained and 4 lost gives p = 3e-6; 8 gained and 2 lost (7% -> 10%) gives p = 0.055,
not significant. A two-proportion z-test would ignore the pairing and need a larger rise.

Shortening for a quick check that the test runs (it then fails its assertion, as a few steps learn nothing):
`ASTRAI_RECIPE_MAX_STEPS=1 ASTRAI_RECIPE_EVAL_QUESTIONS=8 pytest -m slow tests/test_recipes.py`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from astrai import evaluate
from astrai.algos.stats import mcnemar_exact_p, wilson_interval
from astrai.config import Config, dump_config, load_config
from astrai.train import main as train_main

REPO = Path(__file__).resolve().parents[1]
ALPHA = 0.01


@dataclass(frozen=True)
class Recipe:
    """A training job to test: `config` (a job YAML, relative to the repository) plus CLI `overrides`.

    `eval_questions`: how many held-out questions (from the start of `builtin:arithmetic_test`) are scored.
    """

    config: str
    overrides: tuple[str, ...] = ()
    eval_questions: int = 200


# The recipe files themselves, shortened: no in-training evaluation (the test evaluates before and after itself),
# and a constant learning rate (the recipe's cosine decay is shaped for its full length; decayed over 20 steps it
# would halve the mean rate of the short run).
GRPO_ARITHMETIC = Recipe(config="configs/examples/grpo_arithmetic.yaml", overrides=(
    "--max_steps", "20", "--train.eval_steps", "0", "--runtime.num_threads", "2",
    "--optim.lr_scheduler_type", "constant"))

RECIPES = [pytest.param(GRPO_ARITHMETIC, id="grpo_arithmetic")]


def evaluate_greedy(model: str, out: Path, questions: int, config: Path | None = None) -> list[bool]:
    """Per-question greedy correctness on the first `questions` held-out questions (evaluator CLI); prompt
    settings from `config`, or from the run when `model` is a training output_dir."""
    args = ["--model", model, "--data", "builtin:arithmetic_test", "--limit", str(questions),
            "--output_dir", str(out), "--no_progress_bar"] + (["--config", str(config)] if config else [])
    assert evaluate.main(args) == 0
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return [r["correct"][0] for r in results]


def resolved_recipe(recipe: Recipe, path: Path) -> Config:
    """The recipe's config with its overrides and `ASTRAI_RECIPE_MAX_STEPS` (if set) applied, written to `path`."""
    steps = os.environ.get("ASTRAI_RECIPE_MAX_STEPS")
    config = load_config(str(REPO / recipe.config), [*recipe.overrides, *(["--max_steps", steps] if steps else [])])
    path.write_text(dump_config(config))
    return config


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_raises_held_out_accuracy(recipe: Recipe, tmp_path):
    questions = int(os.environ.get("ASTRAI_RECIPE_EVAL_QUESTIONS", recipe.eval_questions))
    job, run = tmp_path / "recipe.yaml", tmp_path / "run"
    config = resolved_recipe(recipe, job)
    before = evaluate_greedy(config.model.path, tmp_path / "before", questions, config=job)
    assert train_main(["--config", str(job), "--train.output_dir", str(run), "--train.progress_bar", "false"]) == 0
    after = evaluate_greedy(str(run), tmp_path / "after", questions)
    gained = sum(not b and a for b, a in zip(before, after))
    lost = sum(b and not a for b, a in zip(before, after))
    p_value = mcnemar_exact_p(gained, lost)
    n = len(before)
    low, high = wilson_interval(sum(after), n)
    report = (f"{config.train.type}, {config.train.max_steps} steps: held-out greedy accuracy {sum(before)}/{n} -> "
              f"{sum(after)}/{n} (95% Wilson after [{low:.3f}, {high:.3f}]); gained {gained}, lost {lost}, "
              f"one-sided exact McNemar p = {p_value:.3g} (alpha {ALPHA})")
    print(report)
    assert sum(after) > sum(before) and p_value < ALPHA, report
