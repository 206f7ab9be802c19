"""Train types' strategies: one small module each (see `astrai.trainer.loop.Strategy`). Each train type's record
(`astrai.train_types`) names its builder `(config, dist, policy, tokenizer) -> Strategy` and its data loader in
these modules; the trainer finds them there, never here."""

from astrai.trainer.strategies.dpo import DPOStrategy
from astrai.trainer.strategies.grpo import StoredGroups
from astrai.trainer.strategies.online_grpo import GRPOStrategy
from astrai.trainer.strategies.online_ppo import OnlinePPOStrategy
from astrai.trainer.strategies.policy_gradient import RolloutStrategy
from astrai.trainer.strategies.sft import NextTokenStrategy, SupervisedStrategy

__all__ = ["DPOStrategy", "GRPOStrategy", "NextTokenStrategy", "OnlinePPOStrategy", "RolloutStrategy",
           "StoredGroups", "SupervisedStrategy"]
