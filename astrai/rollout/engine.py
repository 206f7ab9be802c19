"""Generation engine: batched autoregressive sampling with a KV cache and sampler-aligned log-probs.

The engine owns an inference copy of the policy, tagged with the `policy_version` of the weights it holds
(docs/conventions.md section 4). For every sampled token it records the behaviour log-prob
`old_logprobs = log softmax(logits / temperature)[token]` of the untruncated, temperature-scaled
distribution (docs/conventions.md section 2), which is exactly what the trainer recomputes, so with unchanged weights
the importance ratio is 1.

This is the simple contiguous-cache engine; the paged, continuously batched engine serves the same
interface (`load_weights`, `generate`, `policy_version`).
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from astrai.models import AutoRegressiveLM, KVCache
from astrai.rollout.sampling import SamplingParams, sample_next_token


@dataclass(frozen=True)
class Generation:
    """Output of one `GenerationEngine.generate` call.

    Attributes:
        prompt_ids: (B, P) int64, prompts left-padded with the pad token.
        prompt_mask: (B, P) bool, True on real prompt tokens.
        response_ids: (B, T) int64, sampled tokens right-padded with the pad token (T <= max_new_tokens).
        action_mask: (B, T) bool, True on real response tokens (the stop token included when sampled).
        old_logprobs: (B, T) float32, sampler-aligned behaviour log-probs (nats); 0 at padding.
        finished: (B,) bool, True where the response ended with a stop token.
        policy_version: the version of the weights that sampled every token.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    action_mask: torch.Tensor
    old_logprobs: torch.Tensor
    finished: torch.Tensor
    policy_version: int


def left_pad(sequences: Sequence[Sequence[int]], pad_token_id: int, device: torch.device):
    """Left-pad token id lists into `(ids (B, P) int64, mask (B, P) bool)`.

    Raises:
        ValueError: if `sequences` is empty or one of them is empty.
    """
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError("left_pad: every prompt must hold at least one token")
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.bool)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq):] = torch.tensor(list(seq), dtype=torch.long)
        mask[row, width - len(seq):] = True
    return ids.to(device), mask.to(device)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions (B, S) int64 = number of real tokens before each position (0 at left padding)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def copy_weights(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Copy every parameter of `model` (tied ones under each of their names) from `state_dict`.

    All names and shapes are checked before the first copy, so a bad state dict leaves the model untouched (no
    broadcasting: each tensor must have exactly its parameter's shape; dtype and device are converted).

    Raises:
        KeyError: naming missing or unexpected tensors; nothing is copied then.
        ValueError: naming the first tensor that is not a floating-point tensor of the parameter's exact shape;
            nothing is copied then.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = sorted(set(params) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(params))
    if missing or unexpected:
        raise KeyError(f"load_weights: missing {missing[:3]} unexpected {unexpected[:3]}")
    for name, param in params.items():
        tensor = state_dict[name]
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point() or tensor.shape != param.shape:
            got = (f"{type(tensor).__name__} of shape {tuple(tensor.shape)}, dtype {tensor.dtype}"
                   if isinstance(tensor, torch.Tensor) else type(tensor).__name__)
            raise ValueError(f"load_weights: {name}: expected a floating-point tensor of shape "
                             f"{tuple(param.shape)}, got {got}; nothing was copied")
    for name, param in params.items():
        param.copy_(state_dict[name])


class GenerationEngine:
    """Colocated rollout engine holding its own inference copy of the policy.

    Args:
        model: the policy; the engine deep-copies it (eval mode, no gradients), so training steps never
            change the engine's weights until `load_weights` is called.
        pad_token_id: id used to pad prompts and finished responses.
        policy_version: version tag of the initial weights.

    Generation and weight loading hold the same lock, so they never interleave.
    """

    def __init__(self, model: AutoRegressiveLM, *, pad_token_id: int, policy_version: int = 0):
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        self.pad_token_id = pad_token_id
        self.policy_version = policy_version
        self._lock = threading.Lock()

    @property
    def device(self) -> torch.device:
        """Device of the engine's weights (and of the tensors `generate` returns)."""
        return next(self.model.parameters()).device

    @torch.no_grad()
    def load_weights(self, state_dict: Mapping[str, torch.Tensor], policy_version: int) -> int:
        """Copy `state_dict` (HF parameter names, any device) into the engine and tag it.

        Returns the acknowledged `policy_version`. Raises KeyError naming a missing or unexpected tensor.
        """
        with self._lock:
            copy_weights(self.model, state_dict)
            self.policy_version = policy_version
            return self.policy_version

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 generator: torch.Generator | None = None) -> Generation:
        """Sample one response per prompt.

        Args:
            prompts: B lists of prompt token ids (each non-empty).
            params: sampling settings; generation stops at `params.stop_token_ids` or `max_new_tokens`.
            generator: torch RNG on the engine's device, for reproducible sampling.

        Returns:
            A `Generation` (see its fields for shapes).

        Raises:
            ValueError: on an empty prompt list or an empty prompt.
        """
        with self._lock:
            return self._generate(prompts, params, generator)

    def _generate(self, prompts, params: SamplingParams, generator) -> Generation:
        device = self.device
        prompt_ids, prompt_mask = left_pad(prompts, self.pad_token_id, device)
        batch, prompt_len = prompt_ids.shape
        cache = KVCache.allocate(self.model.config, batch, prompt_len + params.max_new_tokens,
                                 device, next(self.model.parameters()).dtype)
        stop = torch.tensor(sorted(params.stop_token_ids), dtype=torch.long, device=device)
        attn = prompt_mask.clone()
        positions = position_ids_from_mask(prompt_mask)
        logits = self.model(prompt_ids, attention_mask=attn, position_ids=positions, kv_cache=cache,
                            logits_to_keep=1)[:, -1]
        next_pos = positions[:, -1:] + 1
        tokens, logprobs, alive_steps = [], [], []
        alive = torch.ones(batch, dtype=torch.bool, device=device)
        finished = torch.zeros(batch, dtype=torch.bool, device=device)
        for _ in range(params.max_new_tokens):
            token, logprob = sample_next_token(logits, params, generator)
            token = torch.where(alive, token, torch.full_like(token, self.pad_token_id))
            tokens.append(token)
            logprobs.append(torch.where(alive, logprob, torch.zeros_like(logprob)))
            alive_steps.append(alive.clone())
            hit_stop = torch.isin(token, stop) & alive
            finished |= hit_stop
            alive &= ~hit_stop
            if not bool(alive.any()) or len(tokens) == params.max_new_tokens:
                break
            attn = torch.cat([attn, torch.ones_like(alive)[:, None]], dim=1)
            logits = self.model(token[:, None], attention_mask=attn, position_ids=next_pos,
                                kv_cache=cache, logits_to_keep=1)[:, -1]
            next_pos = next_pos + 1
        return Generation(
            prompt_ids=prompt_ids, prompt_mask=prompt_mask,
            response_ids=torch.stack(tokens, dim=1), action_mask=torch.stack(alive_steps, dim=1),
            old_logprobs=torch.stack(logprobs, dim=1).float(), finished=finished,
            policy_version=self.policy_version)
