"""astrai.models: the Llama-family policy (`AutoRegressiveLM`), its critic (`ValueModel`), the tokenizer and loading
of pretrained weights (Hugging Face directories and GGUF files). See docs/architecture.md for the contract."""

from .cache import KVCache
from .config import ModelConfig, tiny_config
from .llama import AutoRegressiveLM, LlamaTrunk, hf_state_dict
from .loading import MODEL_ALIASES, load_pretrained, resolve_model_path, state_mismatch
from .tokenizer import TINY_VOCAB_SIZE, Tokenizer, tiny_tokenizer
from .reward_model import RewardModel, RewardModelConfig, load_reward_model
from .value_model import ValueModel

__all__ = [
    "AutoRegressiveLM",
    "KVCache",
    "LlamaTrunk",
    "MODEL_ALIASES",
    "ModelConfig",
    "TINY_VOCAB_SIZE",
    "Tokenizer",
    "RewardModel",
    "RewardModelConfig",
    "ValueModel",
    "hf_state_dict",
    "load_pretrained",
    "load_reward_model",
    "resolve_model_path",
    "state_mismatch",
    "tiny_config",
    "tiny_tokenizer",
]
