"""Train types' learners: one small module each (see `astrai.trainer.loop.Learner`). Each train type's record
(`astrai.train_types`) names its builder `(config, dist, policy, tokenizer) -> Learner` and its data loader in
these modules; the trainer finds them there, never here."""

from astrai.trainer.learners.dpo import DPOLearner
from astrai.trainer.learners.grpo import StoredGroups
from astrai.trainer.learners.online_grpo import GRPOLearner
from astrai.trainer.learners.online_ppo import OnlinePPOLearner
from astrai.trainer.learners.policy_gradient import RolloutLearner
from astrai.trainer.learners.sft import NextTokenLearner, SupervisedLearner

__all__ = ["DPOLearner", "GRPOLearner", "NextTokenLearner", "OnlinePPOLearner", "RolloutLearner",
           "StoredGroups", "SupervisedLearner"]
