"""Train types: one small strategy module each; `TRAIN_TYPES` maps the config's `train.type` to a builder."""

from astrai.trainer.strategies.online_ppo import OnlinePPOStrategy, build_online_ppo

TRAIN_TYPES = {"online_ppo": build_online_ppo}

__all__ = ["OnlinePPOStrategy", "TRAIN_TYPES", "build_online_ppo"]
