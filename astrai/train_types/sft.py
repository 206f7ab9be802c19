"""sft: supervised fine-tuning on chat data (learner: `trainer/learners/sft.py`); no rules of its own."""

from astrai.train_types.spec import EVALUATION_ROLLOUT_FIELDS, TrainType

TRAIN_TYPE = TrainType(
    name="sft",
    summary="supervised fine-tuning: masked cross-entropy on the assistant turns of chats",
    builder="astrai.trainer.learners.sft:build_sft",
    data="astrai.trainer.learners.sft:sft_data",
    packs=True,
    renders="chats",
    rollout_fields=EVALUATION_ROLLOUT_FIELDS,
    data_fields=("messages_field",),
)
