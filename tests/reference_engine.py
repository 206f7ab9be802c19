"""The naive reference engine: a contiguous KV cache, one batch, one token per step (the test oracle).

It shares nothing with `astrai.rollout.paged_engine` but the model, the sampling function and `copy_weights`, so
tests hold the paged engine's tokens and behaviour log-probs against it.
"""

from __future__ import annotations

import copy
import threading
from typing import Mapping, Sequence

import torch

from astrai.data.sequences import left_pad, position_ids_from_mask
from astrai.models import AutoRegressiveLM, KVCache
from astrai.rollout.engine import EngineCapacity, register_engine
from astrai.rollout.generation import Generation, copy_weights
from astrai.rollout.sampling import SamplingParams, sample_next_token


class ReferenceEngine:
    """Colocated rollout engine holding its own inference copy of the policy (an `astrai.rollout.engine.
    GenerationEngine`; `register()` makes it buildable as `rollout.engine: reference`).

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

    @property
    def capacity(self) -> EngineCapacity:
        """No limit of its own but the model's rotary table."""
        return EngineCapacity(max_position_embeddings=self.model.config.max_position_embeddings)

    def sleep(self) -> None:
        """Nothing to release: the contiguous cache lives only during `generate`."""

    def wake(self) -> None:
        """Nothing to take back (see `sleep`)."""

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 generator: torch.Generator | None = None, *, n: int = 1, penalties=None,
                 on_token=None) -> Generation:
        """Sample `n` responses per prompt (rows b * n + g), all rows in one batch.

        Args:
            prompts: B lists of prompt token ids (each non-empty).
            params: sampling settings; generation stops at `params.stop_token_ids` or `max_new_tokens`.
            generator: torch RNG on the engine's device, for reproducible sampling.
            n: samples per prompt; penalties: must be None (not supported here).
            on_token: optional `(row, token id) -> None` after each sampled token of a live row.

        Returns:
            A `Generation` (see its fields for shapes).

        Raises:
            ValueError: on an empty prompt list or an empty prompt.
        """
        if penalties is not None:
            raise ValueError("the reference engine samples without penalties")
        with self._lock:
            return self._generate([list(p) for p in prompts for _ in range(n)], params, generator, on_token)

    def _generate(self, prompts, params: SamplingParams, generator, on_token=None) -> Generation:
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
            if on_token is not None:
                for row in alive.nonzero().flatten().tolist():
                    on_token(row, int(token[row]))
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


def reference_engine(model, *, pad_token_id: int, policy_version: int = 0, dtype=None, attention_backend=None,
                     **options) -> ReferenceEngine:
    """The `reference` engine factory (`astrai.rollout.engine.build_engine`): fp32 SDPA over a contiguous cache,
    so it refuses another dtype, an attention backend other than torch/auto, and engine sizes."""
    if dtype not in (None, "float32", torch.float32) or attention_backend not in (None, "auto", "torch") or options:
        raise ValueError(f"the reference engine takes no dtype {dtype!r}, backend {attention_backend!r} or "
                         f"options {sorted(options)}")
    return ReferenceEngine(model, pad_token_id=pad_token_id, policy_version=policy_version)


def register() -> None:
    """Register `reference_engine` as the engine `reference`."""
    register_engine("reference", reference_engine)
