"""Reward model: the policy's trunk plus a scalar `score` head, pooled at the last real token (Ouyang et al. 2022,
InstructGPT section 3.5; the layout of transformers' `LlamaForSequenceClassification` with `num_labels` 1).

`RewardModel` = a trunk (embeddings + decoder blocks + final norm) and `score = Linear(H, 1, bias=False)`; the
reward of a sequence is the score of the hidden state of its LAST real token (the last position whose
`attention_mask` is 1), as transformers pools ("the last non-padding token"). Parameter names are transformers'
(`model.*`, `score.weight`), and `RewardModelConfig.to_hf_dict` writes `architectures:
["<Family>ForSequenceClassification"]` and `num_labels: 1`, so an astrai checkpoint of it loads in transformers as
that class with the same scores, and a transformers checkpoint of that class loads here (`load_reward_model`).
What it simplifies: one label (a scalar reward), no classification problem types.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from .config import ModelConfig
from .llama import AutoRegressiveLM, LlamaTrunk
from .hub import download_model, is_hub_id
from .loading import _read_hf_dir, state_mismatch
from .tokenizer import Tokenizer

__all__ = ["RewardModel", "RewardModelConfig", "load_reward_model"]


@dataclasses.dataclass
class RewardModelConfig(ModelConfig):
    """A `ModelConfig` whose `config.json` describes the sequence-classification model (one label)."""

    def to_hf_dict(self) -> dict[str, Any]:
        """The causal LM's `config.json` with `architectures` `<Family>ForSequenceClassification`, `num_labels` 1 and
        its label names (transformers reads the label count from `id2label`)."""
        d = super().to_hf_dict()
        d["architectures"] = [a.replace("ForCausalLM", "ForSequenceClassification") for a in d["architectures"]]
        d.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
        return d

    @classmethod
    def of(cls, config: ModelConfig) -> "RewardModelConfig":
        """The same model's reward-model config."""
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(ModelConfig)})


class RewardModel(nn.Module):
    """Scalar rewards r(x, y) of whole sequences.

    Attributes: `config` (`RewardModelConfig`), `model` (the trunk), `score` (Linear(H, 1), no bias).
    """

    def __init__(self, trunk: LlamaTrunk, *, score: Optional[nn.Linear] = None) -> None:
        super().__init__()
        self.config = RewardModelConfig.of(trunk.config)
        self.model = trunk
        weight = trunk.embed_tokens.weight
        self.score = score if score is not None else nn.Linear(self.config.hidden_size, 1, bias=False,
                                                               device=weight.device, dtype=weight.dtype)
        if score is None:
            with torch.no_grad():
                self.score.weight.zero_()  # every reward starts at 0; the Bradley-Terry loss moves it at once

    @classmethod
    def from_policy(cls, policy: AutoRegressiveLM) -> "RewardModel":
        """A reward model warm-started from `policy`'s trunk (deep-copied) with a zero score head.

        Raises:
            TypeError: for a policy that is not an `AutoRegressiveLM`.
        """
        if not isinstance(policy, AutoRegressiveLM):
            raise TypeError(f"RewardModel.from_policy expects an AutoRegressiveLM, got {type(policy).__name__}")
        return cls(copy.deepcopy(policy.model))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """input_ids (B, S) long, attention_mask (B, S) 0/1 (left or right padding), position_ids (B, S) ->
        rewards (B,) float32: the score at each row's last real token. Raises what the trunk raises."""
        if position_ids is None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        hidden = self.model(input_ids, attention_mask, position_ids)
        steps = torch.arange(1, attention_mask.shape[1] + 1, device=attention_mask.device)
        last = (attention_mask.long() * steps).argmax(dim=1)
        pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
        return self.score(pooled.to(self.score.weight.dtype)).squeeze(-1).float()


def load_reward_model(path: str | Path, *, dtype: torch.dtype = torch.float32,
                      device: Any = "cpu") -> tuple[RewardModel, Tokenizer]:
    """A `...ForSequenceClassification` checkpoint directory (config.json, safetensors with `model.*` and
    `score.weight`, tokenizer files), or a Hugging Face Hub id of one (`org/name`, not a local path: from the cache
    or downloaded, `astrai.models.hub.download_model`), as a `RewardModel` in eval mode, and its tokenizer.

    Raises:
        FileNotFoundError: no such directory; `astrai.models.hub.HubError` for a Hub id neither cached nor
            downloadable (naming the id and the cache). ValueError: one line naming the path for a config astrai
            does not support (or one needing trust_remote_code), a head that is not one label (`score.weight` of
            shape (1, H)), or missing/unexpected tensors.
    """
    path = Path(path)
    if not path.exists() and is_hub_id(str(path)):
        path = download_model(str(path), what="reward.model_path")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"reward.model_path: {path} is not a model directory (no config.json)")
    config, state, tokenizer = _read_hf_dir(path)
    head = state.get("score.weight")
    if head is None or tuple(head.shape) != (1, config.hidden_size):
        got = "no score.weight" if head is None else f"score.weight of shape {tuple(head.shape)}"
        raise ValueError(f"{path}: not a one-label sequence-classification model ({got}; expected "
                         f"(1, {config.hidden_size}))")
    with torch.device("meta"):
        model = RewardModel(LlamaTrunk(config))
    expected = {k: v.shape for k, v in model.state_dict().items()}
    missing, unexpected, resized = state_mismatch(expected, state)
    if missing or unexpected or resized:
        raise ValueError(f"{path}: missing tensors {missing[:5]}, unexpected {unexpected[:5]}, resized {resized[:5]}")
    model.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in state.items()}, strict=True, assign=True)
    model.model.rotary_emb.reset_table(device)
    return model.eval().requires_grad_(False), tokenizer
