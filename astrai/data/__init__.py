"""astrai data: prompt datasets and samplers for online RL (see ``astrai.data.prompts``)."""

from astrai.data.files import DataError
from astrai.data.prompts import (
    PromptDataset,
    PromptRecord,
    PromptSampler,
    extract_gsm8k_answer,
)

__all__ = ["DataError", "PromptDataset", "PromptRecord", "PromptSampler", "extract_gsm8k_answer"]
