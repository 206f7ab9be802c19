"""Build a ready-to-fit `Trainer` from a validated config: runtime, process state, model, strategy,
callbacks. The train type's own parts come from `TRAIN_TYPES`."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import torch

from astrai.checkpoint import publish_checkpoint
from astrai.config import Config, dump_config
from astrai.distributed import setup_distributed
from astrai.models import load_pretrained
from astrai.trainer.callbacks import CheckpointCallback, MetricsLogger, ProgressBar, StepTimer
from astrai.trainer.loop import Trainer
from astrai.trainer.strategies import TRAIN_TYPES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def apply_runtime(config: Config) -> None:
    """Thread count, determinism and seeds from `config.runtime` / `config.train.seed`."""
    if config.runtime.num_threads:
        torch.set_num_threads(config.runtime.num_threads)
    if config.runtime.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    seed_everything(config.train.seed)


def build_trainer(config: Config) -> Trainer:
    """Everything `python -m astrai.train` needs, wired together.

    Writes the resolved config to `<output_dir>/config.yaml` (main process).

    Raises:
        FileNotFoundError / ValueError: from model or data loading, with one-line messages naming the path.
    """
    apply_runtime(config)
    dist = setup_distributed(config.runtime.device, config.distributed.strategy)
    output_dir = Path(config.train.output_dir)
    if dist.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "config.yaml").write_text(dump_config(config))
    policy, tokenizer = load_pretrained(config.model.path, dtype=DTYPES[config.model.dtype])
    policy.train()
    policy.gradient_checkpointing = config.model.gradient_checkpointing
    strategy = TRAIN_TYPES[config.train.type](config, dist, policy, tokenizer)
    logger = MetricsLogger(output_dir, logging_steps=config.train.logging_steps, enabled=dist.is_main)

    def save(trainer: Trainer) -> None:
        if dist.is_main:
            state = dict(trainer.state.to_dict(), step=trainer.state.global_step)
            publish_checkpoint(output_dir, trainer.state.global_step, strategy.checkpoint_state(), state,
                               world_size=dist.world_size)
        dist.barrier()

    callbacks = [
        StepTimer(), logger, ProgressBar(enabled=dist.is_main and config.train.progress_bar),
        CheckpointCallback(save, save_steps=config.checkpoint.save_steps,
                           save_at_end=config.checkpoint.save_at_end, before_save=logger.flush),
    ]
    return Trainer(strategy, dist=dist, max_steps=config.train.max_steps,
                   max_grad_norm=config.optim.max_grad_norm, callbacks=callbacks)
