"""seq: causal-LM pre-training on raw text (learner: `trainer/learners/seq.py`); no rules of its own."""

from astrai.train_types.spec import EVALUATION_ROLLOUT_FIELDS, TrainType

TRAIN_TYPE = TrainType(
    name="seq",
    summary="pre-training: next-token cross-entropy on raw text",
    builder="astrai.trainer.learners.seq:build_seq",
    data="astrai.trainer.learners.seq:seq_data",
    packs=True,
    renders="text",
    rollout_fields=EVALUATION_ROLLOUT_FIELDS,
    data_fields=("text_field",),
)
