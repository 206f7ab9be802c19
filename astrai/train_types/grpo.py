"""grpo (offline): GRPO on stored groups of responses with their rewards (learner: `trainer/learners/grpo.py`);
the `grpo` rules of online_grpo (`online_grpo.check_grpo`)."""

from __future__ import annotations

from astrai.train_types.online_grpo import check_grpo, grpo_models_held, grpo_step_sizes, grpo_unread
from astrai.train_types.spec import EVALUATION_ROLLOUT_FIELDS, TrainType

TRAIN_TYPE = TrainType(
    name="grpo",
    summary="GRPO on stored groups of responses and rewards (offline)",
    builder="astrai.trainer.learners.grpo:build_grpo",
    data="astrai.trainer.learners.grpo:grpo_data",
    section="grpo",
    metrics=("policy/entropy",),
    step_sizes=grpo_step_sizes,
    check=check_grpo,
    unread=grpo_unread,
    models_held=grpo_models_held,
    rollout_fields=("batch_size", "temperature", *EVALUATION_ROLLOUT_FIELDS),  # its stored groups, scored at T
    data_fields=("responses_field", "rewards_field", "logprobs_field"),
)
