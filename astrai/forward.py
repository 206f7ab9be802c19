"""Scoring sequences with a model: response log-probs (policy, reference) and values (critic), and the two sides of
top-k logit distillation (the teacher's top-k, `response_topk`; the student's log-probs at those ids,
`response_logprobs_at`).

One implementation serves rollout-time scoring (no grad, chunked) and the training forward (with grad), so
`logprobs` and `old_logprobs` are computed by the same function and the same temperature (docs/conventions.md
section 2). Without grad, a whole `AutoRegressiveLM` is scored from its final hidden states with the LM head
applied chunk by chunk at the real response tokens only (`algos.logprobs_from_hidden`): no (B, T, V) logits.

Padding-free: an `AutoRegressiveLM` or `ValueModel` (wrapped or not) is run on the batch's real tokens packed into
one row (`Sequences.packed`, each sequence attending within itself), so no padded position costs a matmul, and the
LM head or value head sees only the positions that score a real response token; the results are put back in the
(B, T) layout with 0 at padding. Other models (and `packed=False`) get the padded batch.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from astrai.algos import (entropy_from_logits, logprobs_at_ids, logprobs_from_hidden, logprobs_from_logits,
                          topk_logprobs_from_logits)
from astrai.data.sequences import Sequences
from astrai.models.llama import AutoRegressiveLM
from astrai.models.value_model import ValueModel
from astrai.models.wrappers import bare_module


def whole_lm_head(model: torch.nn.Module) -> Optional[torch.Tensor]:
    """The LM head weight (V, H) of an unwrapped `AutoRegressiveLM` whose parameters are whole tensors, else None:
    a wrapper (DDP, a DeepSpeed engine) or FSDP2 shards (DTensors) apply their LM head only inside the forward, and a
    model with final-logit soft-capping (Gemma 2) caps its logits there."""
    if not isinstance(model, AutoRegressiveLM) or model.config.final_logit_softcapping is not None:
        return None
    weight = model.lm_head.weight
    return None if hasattr(weight, "full_tensor") else weight


def supports_packing(model: torch.nn.Module) -> bool:
    """True when `model` takes padding-free packed rows (`seq_lengths`): astrai's `AutoRegressiveLM` and
    `ValueModel`, bare or under a data-parallel wrapper (DDP, a DeepSpeed engine; unwrapped as
    `DistributedContext.unwrap` does: `models.wrappers.bare_module`), or a view declaring `packed_rows` (a LoRA run's reference,
    `trainer.lora.AdaptersOff`); FSDP2 shards in place, so its model is itself."""
    return (isinstance(bare_module(model), (AutoRegressiveLM, ValueModel))
            or getattr(model, "packed_rows", False))


def _response_logits(model: torch.nn.Module, sequences: Sequences, packed: bool, *, hidden: bool = False):
    """The logits that score the response tokens: `(logits, batch)`, with `packed` and a model that
    `supports_packing` (A, V) at the action tokens of the packed `batch` (`Sequences.packed`), else (B, T, V)
    (positions P - 1 ... S - 2 only go through the LM head) and batch None. With `hidden`, the final hidden states
    at those positions instead ((A, H) or (B, T, H): the model's `return_hidden`), for an LM head applied apart."""
    extra = {"return_hidden": True} if hidden else {}
    if packed and supports_packing(model):
        batch = sequences.packed()
        return model(batch.input_ids, position_ids=batch.position_ids, seq_lengths=batch.seq_lengths,
                     logits_at=batch.score_at, **extra), batch
    out = model(sequences.input_ids, attention_mask=sequences.attention_mask,
                position_ids=sequences.position_ids, logits_to_keep=sequences.action_mask.shape[1] + 1, **extra)
    return out[:, :-1], None


def response_logprobs(model: torch.nn.Module, sequences: Sequences, *, temperature: float,
                      with_entropy: bool = False, packed: bool = True) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs of the response tokens under `model`.

    Args:
        model: an `AutoRegressiveLM` (or a wrapper returning logits (B, S, V)).
        sequences: the batch; response token t is scored by the logits at position P - 1 + t.
        temperature: logits are divided by it before the log-softmax (> 0).
        with_entropy: also return the per-token entropy of the scaled distribution.
        packed: run a model that `supports_packing` padding-free (the default; see the module docstring).

    Returns:
        logprobs (B, T) float32 (nats; values at padding are meaningless, mask them: 0 when packed and on the
        no-grad path below), and entropy (B, T) float32 or None (0 at padding when packed).

    Without grad and without entropy, a model with a `whole_lm_head` returns its final hidden states and the
    log-probs come from `logprobs_from_hidden` at the real response tokens; otherwise from the logits. The two,
    and the packed and padded paths, agree up to matmul rounding.

    Raises:
        ValueError: what `Sequences.packed` raises.
    """
    head = None if with_entropy or torch.is_grad_enabled() else whole_lm_head(model)
    if head is not None:
        hidden, batch = _response_logits(model, sequences, packed, hidden=True)  # (A, H) packed, else (B, T, H)
        if batch is not None:
            return batch.unpack(logprobs_from_hidden(hidden, head, batch.labels, temperature=temperature)), None
        return logprobs_from_hidden(hidden, head, sequences.response_ids, temperature=temperature,
                                    mask=sequences.action_mask), None
    logits, batch = _response_logits(model, sequences, packed)
    if batch is not None:  # (A, V): the LM head only where a response token is scored
        logprobs = batch.unpack(logprobs_from_logits(logits, batch.labels, temperature=temperature))
        entropy = batch.unpack(entropy_from_logits(logits, temperature=temperature)) if with_entropy else None
        return logprobs, entropy
    logprobs = logprobs_from_logits(logits, sequences.response_ids, temperature=temperature)
    entropy = entropy_from_logits(logits, temperature=temperature) if with_entropy else None
    return logprobs, entropy


def response_values(value_model: torch.nn.Module, sequences: Sequences, *, packed: bool = True) -> torch.Tensor:
    """Critic values V(s_t) (B, T) float32 of the state before each response token (position P - 1 + t); padding-free
    for a `ValueModel` unless `packed=False` (packed: 0 at padding; padded: meaningless there, mask them).
    Raises: ValueError, what `Sequences.packed` raises."""
    if packed and supports_packing(value_model):
        batch = sequences.packed()
        values = value_model(batch.input_ids, position_ids=batch.position_ids, seq_lengths=batch.seq_lengths)
        return batch.unpack(values[batch.score_at])
    values = value_model(sequences.input_ids, attention_mask=sequences.attention_mask,
                         position_ids=sequences.position_ids)
    p = sequences.prompt_length
    return values[:, p - 1:-1].float()


@torch.no_grad()
def score_in_chunks(fn: Callable[[Sequences], torch.Tensor], sequences: Sequences, chunk_size: int):
    """Apply `fn` (Sequences -> a (b, ...) tensor, or a tuple of them) to row chunks of `chunk_size` without grad;
    concat on rows (each member of a tuple apart)."""
    rows = sequences.input_ids.shape[0]
    parts = [fn(sequences.select(torch.arange(start, min(start + chunk_size, rows))))
             for start in range(0, rows, chunk_size)]
    if parts and isinstance(parts[0], tuple):
        return tuple(torch.cat(members, dim=0) for members in zip(*parts))
    return torch.cat(parts, dim=0)


def _scatter_actions(action_mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """values (A, k) at the action tokens (row-major) -> (B, T, k) with 0 at the other positions (differentiable)."""
    full = torch.zeros((*action_mask.shape, values.shape[-1]), dtype=values.dtype, device=values.device)
    return full.masked_scatter(action_mask.bool()[..., None], values)


def response_logprobs_at(model: torch.nn.Module, sequences: Sequences, ids: torch.Tensor, *, temperature: float,
                         with_entropy: bool = False,
                         packed: bool = True) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """`response_logprobs` (the sampled tokens' log-probs and entropy, same forward, same grad) plus the log-probs
    of `ids` at every response position: the student's side of top-k logit distillation (`algos.topk_distill`).

    Args:
        ids: (B, T, k) int64, token ids per response position (the teacher's top-k, `response_topk`); read at the
            action tokens only.
        the rest: as `response_logprobs`.

    Returns:
        logprobs (B, T) float32, entropy (B, T) float32 or None, and `at` (B, T, k) float32: the full-vocabulary
        `log_softmax(logits / temperature)` at `ids` (`algos.logprobs_at_ids`), 0 outside the action mask;
        differentiable w.r.t. the model's parameters. The logits exist once, as in `response_logprobs`' grad path.

    Raises:
        ValueError: `ids` not (B, T, k) int64, or what `Sequences.packed` raises.
    """
    mask = sequences.action_mask.bool()
    if ids.dim() != 3 or ids.shape[:2] != mask.shape or ids.dtype != torch.long:
        raise ValueError(f"ids must be (B, T, k) int64 with (B, T) = {tuple(mask.shape)}, got {tuple(ids.shape)} "
                         f"{ids.dtype}")
    logits, batch = _response_logits(model, sequences, packed)  # (A, V) packed, else (B, T, V)
    if batch is not None:
        logprobs = batch.unpack(logprobs_from_logits(logits, batch.labels, temperature=temperature))
        entropy = batch.unpack(entropy_from_logits(logits, temperature=temperature)) if with_entropy else None
        at = _scatter_actions(mask, logprobs_at_ids(logits, ids[mask], temperature=temperature))
        return logprobs, entropy, at
    logprobs = logprobs_from_logits(logits, sequences.response_ids, temperature=temperature)
    entropy = entropy_from_logits(logits, temperature=temperature) if with_entropy else None
    at = logprobs_at_ids(logits, ids, temperature=temperature) * mask[..., None]
    return logprobs, entropy, at


@torch.no_grad()
def response_topk(model: torch.nn.Module, sequences: Sequences, *, k: int, temperature: float,
                  chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's side of top-k logit distillation: at every action token of `sequences`, the k most likely
    next tokens under `model` at `temperature` and their log-probs (`algos.topk_logprobs_from_logits`), without
    grad.

    Memory: `chunk_size` rows per forward; a model with a `whole_lm_head` returns hidden states and the LM head is
    applied a few hundred positions at a time, others return (A, V) logits of one row chunk's action tokens only
    (packed) or (b, T, V) (padded); so no (B, T, V) tensor of the whole batch exists, only the (B, T, k) results.

    Returns:
        ids (B, T, k) int64 and logprobs (B, T, k) float32 (full-vocabulary log-softmax values, descending), both 0
        outside the action mask.

    Raises:
        ValueError: `k` outside [1, V], `chunk_size < 1`, or what `Sequences.packed` raises.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if sequences.input_ids.shape[0] == 0:
        shape = (*sequences.action_mask.shape, k)
        device = sequences.input_ids.device
        return torch.zeros(shape, dtype=torch.long, device=device), torch.zeros(shape, device=device)
    return score_in_chunks(lambda chunk: _topk_rows(model, chunk, k=k, temperature=temperature), sequences,
                           chunk_size)


def _topk_rows(model: torch.nn.Module, sequences: Sequences, *, k: int,
               temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`response_topk` of one row chunk (one forward)."""
    mask = sequences.action_mask.bool()
    head = whole_lm_head(model)
    if head is not None and supports_packing(model):
        hidden, _ = _response_logits(model, sequences, packed=True, hidden=True)  # (A, H)
        parts = [topk_logprobs_from_logits(torch.nn.functional.linear(hidden[s:s + 256], head), k=k,
                                           temperature=temperature) for s in range(0, hidden.shape[0], 256)]
        ids = torch.cat([p[0] for p in parts]) if parts else torch.zeros(0, k, dtype=torch.long,
                                                                         device=hidden.device)
        values = torch.cat([p[1] for p in parts]) if parts else torch.zeros(0, k, device=hidden.device)
        return _scatter_actions(mask, ids), _scatter_actions(mask, values)
    logits, batch = _response_logits(model, sequences, packed=True)
    ids, values = topk_logprobs_from_logits(logits, k=k, temperature=temperature)
    if batch is not None:
        return _scatter_actions(mask, ids), _scatter_actions(mask, values)
    return ids * mask[..., None], values * mask[..., None]
