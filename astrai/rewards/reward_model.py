"""A reward model as a reward function: r(prompt, completion) from a `models.RewardModel`, in batches.

`RewardModelScorer` has the reward-function calling convention (`reward_functions`), so `reward.model_path` joins
`reward.functions` in the weighted total (as `rewards/reward_model/...`). Each completion is scored the way the `rm`
train type trained the model: the prompt chat-templated with the REWARD MODEL's tokenizer (a stored chat as it is,
else the question as the user turn behind `data.system_prompt`), followed by the completion's tokens and the end of
turn, so a reward model with another tokenizer than the policy's works too. A sequence longer than the reward
model's position limit keeps its prompt and the start of its completion. Inference only, no grad; under fsdp2 /
zero3 the model is partitioned like the reference model, so every rank scores its own rollout with the same number
of forwards (one per `batch_size` rows).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from astrai.data.sequences import Sequences
from astrai.data.truncation import encode_prompt
from astrai.models.special_tokens import response_end_id, stop_token_ids
from astrai.rewards.builtins import completion_text

__all__ = ["RewardModelScorer"]


class RewardModelScorer:
    """Rewards of completions by a reward model.

    Args:
        model: a `RewardModel` (possibly wrapped for inference: called as `model(input_ids, attention_mask,
            position_ids) -> (B,)`); config: its `ModelConfig` (position limit, eos ids).
        tokenizer: the reward model's tokenizer; batch_size: rows per forward; device: where its inputs go.
        system_prompt: the job's `data.system_prompt` (used for prompts stored as plain text).
        chat_template: the job's `data.chat_template` (`astrai.data.prompt_format`), applied to the reward model's
            tokenizer, so its prompts are rendered as the policy's are.
    """

    def __init__(self, model, config, tokenizer, *, batch_size: int, device, system_prompt: Optional[str] = None,
                 chat_template: Optional[bool] = None):
        self.model, self.tokenizer, self.batch_size, self.device = model, tokenizer, batch_size, device
        self.system_prompt, self.limit = system_prompt, config.max_position_embeddings
        self.chat_template = chat_template
        self.end_id = response_end_id(tokenizer, stop_token_ids(config, tokenizer))
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def encode(self, prompt, completion) -> tuple[list[int], list[int]]:
        """(prompt ids, completion ids + end of turn) with the reward model's tokenizer, within its position
        limit (the completion is cut first, to at least one token)."""
        prompt_ids, _ = encode_prompt(self.tokenizer, prompt, system_prompt=self.system_prompt,
                                      chat_template=self.chat_template, where="reward model")
        prompt_ids = prompt_ids[-(self.limit - 1):]
        response = self.tokenizer.encode_text(completion_text(completion)) + [self.end_id]
        return prompt_ids, response[:max(1, self.limit - len(prompt_ids))]

    @torch.no_grad()
    def __call__(self, prompts: Sequence, completions: Sequence, **columns) -> list[float]:
        """One reward per completion (floats), `batch_size` rows per forward."""
        encoded = [self.encode(p, c) for p, c in zip(prompts, completions)]
        scores: list[float] = []
        for start in range(0, len(encoded), self.batch_size):
            chunk = encoded[start:start + self.batch_size]
            seqs = Sequences.from_tokens([p for p, _ in chunk], [r for _, r in chunk], pad_token_id=self.pad_id,
                                         device=self.device)
            scores += self.model(seqs.input_ids, seqs.attention_mask, seqs.position_ids).float().cpu().tolist()
        return scores
