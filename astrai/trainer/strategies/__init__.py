"""Train types: one small strategy module each; `TRAIN_TYPES` maps the config's `train.type` to a builder
`(config, dist, policy, tokenizer) -> Strategy` (see `astrai.trainer.loop.Strategy`). Model options (MoE
upcycling) are applied to the policy before the builder runs, so every copy it makes has them too."""

import functools

from astrai.trainer.experience import load_online_prompts
from astrai.trainer.models import apply_model_options
from astrai.trainer.strategies.dpo import DPOStrategy, build_dpo, dpo_data
from astrai.trainer.strategies.grpo import StoredGroups, build_grpo, grpo_data
from astrai.trainer.strategies.online_grpo import GRPOStrategy, build_online_grpo
from astrai.trainer.strategies.online_ppo import OnlinePPOStrategy, build_online_ppo
from astrai.trainer.strategies.policy_gradient import RolloutStrategy
from astrai.trainer.strategies.seq import build_seq, seq_data
from astrai.trainer.strategies.sft import NextTokenStrategy, SupervisedStrategy, build_sft, sft_data


def _with_model_options(builder):
    """`builder` preceded by `models.apply_model_options` (MoE upcycling when configured)."""

    @functools.wraps(builder)
    def build(config, dist, policy, tokenizer):
        return builder(config, dist, apply_model_options(config, policy), tokenizer)

    return build


TRAIN_TYPES = {name: _with_model_options(builder) for name, builder in (
    ("online_ppo", build_online_ppo), ("online_grpo", build_online_grpo), ("grpo", build_grpo),
    ("sft", build_sft), ("dpo", build_dpo), ("seq", build_seq))}



def _online_data(config, model_config, tokenizer, *, main: bool = True) -> list:
    """The online prompts of `data.path`, chat-templated (`experience.load_online_prompts`)."""
    return load_online_prompts(config, tokenizer, main=main)


TRAIN_DATA = {"online_ppo": _online_data, "online_grpo": _online_data, "grpo": grpo_data, "sft": sft_data,
              "dpo": dpo_data, "seq": seq_data}
"""`train.type` -> `(config, model_config, tokenizer, *, main) -> list`: the job's data as the strategy will train
on it (what the builders call, and what `python -m astrai.train --check` loads). Raises DataError for bad data."""

__all__ = ["DPOStrategy", "GRPOStrategy", "NextTokenStrategy", "OnlinePPOStrategy", "RolloutStrategy",
           "StoredGroups", "SupervisedStrategy", "TRAIN_DATA", "TRAIN_TYPES"]
