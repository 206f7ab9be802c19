"""dpo: Direct Preference Optimization (learner: `trainer/learners/dpo.py`); reads the `dpo` section."""

from astrai.train_types.spec import EVALUATION_ROLLOUT_FIELDS, ModelsHeld, TrainType

TRAIN_TYPE = TrainType(
    name="dpo",
    summary="Direct Preference Optimization on chosen/rejected pairs against a frozen reference",
    builder="astrai.trainer.learners.dpo:build_dpo",
    data="astrai.trainer.learners.dpo:dpo_data",
    section="dpo",
    models_held=lambda config: ModelsHeld(reference=True),
    rollout_fields=EVALUATION_ROLLOUT_FIELDS,
    data_fields=("chosen_field", "rejected_field"),
)
