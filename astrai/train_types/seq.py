"""seq: causal-LM pre-training on raw text (strategy: `trainer/strategies/seq.py`); no rules of its own."""

from astrai.train_types.spec import TrainType

TRAIN_TYPE = TrainType(
    name="seq",
    summary="pre-training: next-token cross-entropy on raw text",
    builder="astrai.trainer.strategies.seq:build_seq",
    data="astrai.trainer.strategies.seq:seq_data",
    packs=True,
)
