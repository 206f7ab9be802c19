"""Train types: one small strategy module each; `TRAIN_TYPES` maps the config's `train.type` to a builder
`(config, dist, policy, tokenizer) -> strategy` (each strategy: `train_step(trainer)`, `checkpoint_state()`)."""

import functools

from astrai.trainer.strategies.common import apply_model_options
from astrai.trainer.strategies.dpo import DPOStrategy, build_dpo
from astrai.trainer.strategies.grpo import build_grpo
from astrai.trainer.strategies.online_grpo import GRPOStrategy, OnlineGRPOStrategy, build_online_grpo
from astrai.trainer.strategies.online_ppo import OnlinePPOStrategy, build_online_ppo
from astrai.trainer.strategies.seq import build_seq
from astrai.trainer.strategies.sft import NextTokenStrategy, build_sft



def _with_model_options(builder):
    """`builder` preceded by `common.apply_model_options` (MoE upcycling when configured)."""

    @functools.wraps(builder)
    def build(config, dist, policy, tokenizer):
        return builder(config, dist, apply_model_options(config, policy), tokenizer)

    return build


TRAIN_TYPES = {name: _with_model_options(builder) for name, builder in (
    ("online_ppo", build_online_ppo), ("online_grpo", build_online_grpo), ("grpo", build_grpo),
    ("sft", build_sft), ("dpo", build_dpo), ("seq", build_seq))}

__all__ = ["DPOStrategy", "GRPOStrategy", "NextTokenStrategy", "OnlineGRPOStrategy", "OnlinePPOStrategy",
           "TRAIN_TYPES", "build_dpo", "build_grpo", "build_online_grpo", "build_online_ppo", "build_seq",
           "build_sft"]
