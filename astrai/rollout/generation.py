"""What a rollout engine returns (`Generation`) and how it takes new weights (`copy_weights`).

An engine owns an inference copy of the policy, tagged with the `policy_version` of the weights it holds
(docs/conventions.md section 4). For every sampled token it records the behaviour log-prob
`old_logprobs = log softmax(logits / temperature)[token]` of the untruncated, temperature-scaled distribution
(docs/conventions.md section 2), which is exactly what the trainer recomputes, so with unchanged weights the
importance ratio is 1. The engine is `astrai.rollout.paged_engine.PagedGenerationEngine`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence, Union

import torch

from astrai.data.sequences import Sequences


@dataclass(frozen=True)
class Generation:
    """Output of one `PagedGenerationEngine.generate` call.

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

    def sequences(self) -> Sequences:
        """The prompts and responses as model inputs (`Sequences`, the rollout layout)."""
        return Sequences.from_padded(self.prompt_ids, self.prompt_mask, self.response_ids, self.action_mask)


def concat_generations(parts: Sequence[Generation], pad_token_id: int) -> Generation:
    """The rows of `parts` in order as one `Generation` (the shares of a call split over several generation
    processes, `astrai.rollout.remote.GenerationPool`): prompts left-padded and responses right-padded to the widest
    part with `pad_token_id` (masks False, `old_logprobs` 0 there), on the first part's device.

    Raises:
        ValueError: no parts, or parts sampled by different `policy_version`s.
    """
    if not parts:
        raise ValueError("concat_generations: expected at least one part")
    versions = {part.policy_version for part in parts}
    if len(versions) > 1:
        raise ValueError(f"concat_generations: the parts were sampled by policy versions {sorted(versions)}; "
                         "expected one")
    device = parts[0].prompt_ids.device
    width = max(part.prompt_ids.shape[1] for part in parts)
    length = max(part.response_ids.shape[1] for part in parts)

    def cat(name: str, size: int, value, left: bool) -> torch.Tensor:
        padded = []
        for part in parts:
            tensor = getattr(part, name).to(device)
            missing = size - tensor.shape[1]
            padded.append(torch.nn.functional.pad(tensor, (missing, 0) if left else (0, missing), value=value))
        return torch.cat(padded)

    return Generation(prompt_ids=cat("prompt_ids", width, pad_token_id, True),
                      prompt_mask=cat("prompt_mask", width, False, True),
                      response_ids=cat("response_ids", length, pad_token_id, False),
                      action_mask=cat("action_mask", length, False, False),
                      old_logprobs=cat("old_logprobs", length, 0.0, False),
                      finished=torch.cat([part.finished.to(device) for part in parts]),
                      policy_version=versions.pop())


@torch.no_grad()
def copy_weights(model: torch.nn.Module, state_dict: Union[Mapping[str, torch.Tensor], Iterable]) -> None:
    """Copy every parameter of `model` (tied ones under each of their names) from `state_dict`.

    A mapping is checked whole (names, then shapes) before the first copy, so a bad state dict leaves the model
    untouched (no broadcasting: each tensor must have exactly its parameter's shape; dtype and device are converted).
    An iterable of (name, tensor) pairs is streamed: each tensor is checked and copied as it arrives (no full second
    copy of the weights is ever held, the way a sharded trainer hands them over one gathered parameter at a time),
    and after the last one every parameter must have been given.

    Raises:
        KeyError: naming missing or unexpected tensors (a mapping: nothing is copied then).
        ValueError: naming the first tensor that is not a floating-point tensor of the parameter's exact shape (a
            mapping: nothing is copied then).
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    if not isinstance(state_dict, Mapping):
        _copy_stream(params, state_dict)
        return
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


def _check_tensor(name: str, tensor, param: torch.Tensor) -> None:
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point() or tensor.shape != param.shape:
        got = (f"{type(tensor).__name__} of shape {tuple(tensor.shape)}, dtype {tensor.dtype}"
               if isinstance(tensor, torch.Tensor) else type(tensor).__name__)
        raise ValueError(f"load_weights: {name}: expected a floating-point tensor of shape {tuple(param.shape)}, "
                         f"got {got}")


def _copy_stream(params: dict[str, torch.Tensor], items: Iterable) -> None:
    """Copy (name, tensor) pairs into `params` as they arrive; every parameter must come (see `copy_weights`)."""
    seen = set()
    for name, tensor in items:
        if name not in params:
            raise KeyError(f"load_weights: unexpected {name!r}")
        _check_tensor(name, tensor, params[name])
        params[name].copy_(tensor)
        seen.add(name)
    missing = sorted(set(params) - seen)
    if missing:
        raise KeyError(f"load_weights: missing {missing[:3]}")
