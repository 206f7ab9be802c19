"""dpo: Direct Preference Optimization (strategy: `trainer/strategies/dpo.py`); reads the `dpo` section."""

from astrai.train_types.spec import TrainType

TRAIN_TYPE = TrainType(
    name="dpo",
    summary="Direct Preference Optimization on chosen/rejected pairs against a frozen reference",
    builder="astrai.trainer.strategies.dpo:build_dpo",
    data="astrai.trainer.strategies.dpo:dpo_data",
    section="dpo",
)
