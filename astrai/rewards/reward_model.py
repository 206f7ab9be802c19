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

import warnings
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
        self.cut = 0  # samples read cut to the position limit so far
        self._said_cut = False

    def encode(self, prompt, completion) -> tuple[list[int], list[int], bool]:
        """(prompt ids, completion ids + end of turn, whether anything was cut) with the reward model's tokenizer,
        within its position limit (the prompt's start is cut to leave one position, then the completion's end)."""
        prompt_ids, _ = encode_prompt(self.tokenizer, prompt, system_prompt=self.system_prompt,
                                      chat_template=self.chat_template, where="reward model")
        response = self.tokenizer.encode_text(completion_text(completion)) + [self.end_id]
        cut = len(prompt_ids) + len(response) > self.limit
        prompt_ids = prompt_ids[-(self.limit - 1):]
        return prompt_ids, response[:max(1, self.limit - len(prompt_ids))], cut

    @torch.no_grad()
    def __call__(self, prompts: Sequence, completions: Sequence, **columns) -> list[float]:
        """One reward per completion (floats), `batch_size` rows per forward. Samples longer than the position limit
        are scored cut (`encode`), counted in `cut` and warned about once."""
        encoded = [self.encode(p, c) for p, c in zip(prompts, completions)]
        cut = sum(was_cut for _, _, was_cut in encoded)
        self.cut += cut
        if cut and not self._said_cut:
            self._said_cut = True
            warnings.warn(f"reward model: {cut} of {len(encoded)} samples of this batch were longer than its "
                          f"{self.limit} positions and were scored cut (the prompt's start, then the completion's "
                          "end left out); a reward model with a longer context, or shorter prompts and responses, "
                          "avoid it (said once)", stacklevel=2)
        scores: list[float] = []
        for start in range(0, len(encoded), self.batch_size):
            chunk = encoded[start:start + self.batch_size]
            seqs = Sequences.from_tokens([p for p, _, _ in chunk], [r for _, r, _ in chunk], pad_token_id=self.pad_id,
                                         device=self.device)
            scores += self.model(seqs.input_ids, seqs.attention_mask, seqs.position_ids).float().cpu().tolist()
        return scores
