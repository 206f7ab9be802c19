"""Time the phases of online_ppo steps on the default main job (SmolLM2-135M, built-in math prompts).

    python bench/ppo_step.py [--steps 2] [any astrai.train override ...]

Prints the thread count, then per step (one minibatch) the seconds of each phase as the trainer logs them in its
`time/*_seconds` metrics: for a step that starts a rollout, weight sync, generation, reference scoring and critic
scoring; for every step, the policy update and the critic update; and the step's total.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

from astrai.config import load_config
from astrai.trainer.build import build_trainer

REPO = Path(__file__).resolve().parents[1]
ROLLOUT_PHASES = ("weight_sync", "generate", "reference", "critic_scoring")
UPDATE_PHASES = ("policy_update", "critic_update")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2)
    args, overrides = parser.parse_known_args()
    config = load_config(str(REPO / "configs/examples/ppo.yaml"),
                         ["--train.output_dir", "/tmp/astrai-bench-ppo", "--train.progress_bar", "false",
                          "--checkpoint.save_at_end", "false", "--max_steps", str(args.steps), *overrides])
    trainer = build_trainer(config)
    print(f"threads: {torch.get_num_threads()}  batch {config.rollout.batch_size}  "
          f"max_new_tokens {config.rollout.max_new_tokens}")
    learner = trainer.learner
    trainer.callbacks = []
    for step in range(args.steps):
        previous = learner.rollout
        start = time.perf_counter()
        metrics = learner.train_step(trainer)
        total = time.perf_counter() - start
        trainer.state.global_step += 1
        phases = UPDATE_PHASES if learner.rollout is previous else ROLLOUT_PHASES + UPDATE_PHASES
        shown = "  ".join(f"{name} {float(metrics[f'time/{name}_seconds']):.1f}s" for name in phases)
        print(f"step {step + 1}: {shown}  total {total:.1f}s  "
              f"response_length {float(metrics['rollout/response_length']):.1f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
