"""rm: reward-model training on preference pairs (learner: `trainer/learners/rm.py`); its held-out evaluation is
its own `rm/accuracy`, so `train.eval_steps` (greedy answers of a policy) does not apply."""

from astrai.config_schema import ConfigError
from astrai.train_types.spec import TrainType


def _check(config) -> None:
    if config.train.eval_steps:
        raise ConfigError("train.eval_steps: evaluates a policy's greedy answers; train.type rm trains a reward "
                          "model (its accuracy on the pairs is logged as rm/accuracy); set it to 0")


TRAIN_TYPE = TrainType(
    name="rm",
    summary="reward model: Bradley-Terry loss on chosen/rejected pairs (a ...ForSequenceClassification checkpoint)",
    builder="astrai.trainer.learners.rm:build_rm",
    data="astrai.trainer.learners.rm:rm_data",
    check=_check,
    rollout_fields=(),
    answers=False,
    data_fields=("chosen_field", "rejected_field", "margin_field"),
)
