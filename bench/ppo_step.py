"""Time the phases of online_ppo steps on the default main job (SmolLM2-135M, built-in math prompts).

    python bench/ppo_step.py [--steps 2] [any astrai.train override ...]

Prints the thread count, per-phase seconds of each step (generation, reference scoring, critic scoring,
policy update, critic update) and the total step time.
"""

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from astrai.config import load_config
from astrai.rollout import paged_engine
from astrai.rollout import runner as runner_mod
from astrai.trainer.build import build_trainer
from astrai.trainer.strategies import online_ppo

REPO = Path(__file__).resolve().parents[1]
TIMES: dict[str, float] = defaultdict(float)


def timed(name, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[name] += time.perf_counter() - start
    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2)
    args, overrides = parser.parse_known_args()
    config = load_config(str(REPO / "configs/examples/ppo.yaml"),
                         ["--train.output_dir", "/tmp/astrai-bench-ppo", "--train.progress_bar", "false",
                          "--checkpoint.save_at_end", "false", "--max_steps", str(args.steps), *overrides])
    engine_cls = paged_engine.PagedGenerationEngine
    engine_cls.generate = timed("generate", engine_cls.generate)
    engine_cls.load_weights = timed("weight_sync", engine_cls.load_weights)
    runner_mod.score_in_chunks = timed("reference_scoring", runner_mod.score_in_chunks)
    online_ppo.score_in_chunks = timed("critic_scoring", online_ppo.score_in_chunks)
    online_ppo.OnlinePPOStrategy._policy_update = timed("policy_update", online_ppo.OnlinePPOStrategy._policy_update)
    online_ppo.OnlinePPOStrategy._critic_update = timed("critic_update", online_ppo.OnlinePPOStrategy._critic_update)
    trainer = build_trainer(config)
    print(f"threads: {torch.get_num_threads()}  batch {config.rollout.batch_size}  "
          f"max_new_tokens {config.rollout.max_new_tokens}")
    strategy = trainer.strategy
    trainer.callbacks = []
    for step in range(args.steps):
        TIMES.clear()
        start = time.perf_counter()
        metrics = strategy.train_step(trainer)
        trainer.state.global_step += 1
        total = time.perf_counter() - start
        phases = "  ".join(f"{k} {v:.1f}s" for k, v in TIMES.items())
        print(f"step {step + 1}: {phases}  total {total:.1f}s  "
              f"response_length {float(metrics['rollout/response_length']):.1f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
