"""Train types: one small strategy module each; `TRAIN_TYPES` maps the config's `train.type` to a builder
`(config, dist, policy, tokenizer) -> Strategy` (see `astrai.trainer.loop.Strategy`). Model options (MoE
upcycling) are applied to the policy before the builder runs, so every copy it makes has them too."""

import functools

from astrai.trainer.models import apply_model_options
from astrai.trainer.strategies.dpo import DPOStrategy, build_dpo
from astrai.trainer.strategies.grpo import StoredGroups, build_grpo
from astrai.trainer.strategies.online_grpo import GRPOStrategy, build_online_grpo
from astrai.trainer.strategies.online_ppo import OnlinePPOStrategy, build_online_ppo
from astrai.trainer.strategies.policy_gradient import RolloutStrategy
from astrai.trainer.strategies.seq import build_seq
from astrai.trainer.strategies.sft import NextTokenStrategy, SupervisedStrategy, build_sft


def _with_model_options(builder):
    """`builder` preceded by `models.apply_model_options` (MoE upcycling when configured)."""

    @functools.wraps(builder)
    def build(config, dist, policy, tokenizer):
        return builder(config, dist, apply_model_options(config, policy), tokenizer)

    return build


TRAIN_TYPES = {name: _with_model_options(builder) for name, builder in (
    ("online_ppo", build_online_ppo), ("online_grpo", build_online_grpo), ("grpo", build_grpo),
    ("sft", build_sft), ("dpo", build_dpo), ("seq", build_seq))}

__all__ = ["DPOStrategy", "GRPOStrategy", "NextTokenStrategy", "OnlinePPOStrategy", "RolloutStrategy",
           "StoredGroups", "SupervisedStrategy", "TRAIN_TYPES"]
