"""Token log-probabilities and entropies from logits, sampler-aligned.

Method: ``log softmax(logits / temperature)[a_t]`` computed as ``logits[a_t]/temperature - logsumexp(logits /
temperature)``, the quantity PPO's importance ratio (Schulman et al. 2017) and GRPO (Shao et al. 2024) need; the
rollout engine and the trainer both call this function, so with unchanged weights ``logprobs - old_logprobs`` is ~0
(docs/conventions.md section 2). What it simplifies: no full (B, T, V) ``log_softmax`` tensor is materialised; rows are
processed in chunks in float32 (only one chunk's float32/temperature copy exists at a time in the forward pass),
and the label logit is gathered before the normaliser is subtracted. ``logprobs_from_hidden`` goes one step further
for scoring without grad: from the final hidden states and the LM head weight, chunk by chunk, so not even the
(B, T, V) logits exist.
"""

from __future__ import annotations

import torch

__all__ = ["logprobs_from_logits", "logprobs_from_hidden", "entropy_from_logits"]

_DEFAULT_CHUNK_ROWS = 1024
_HIDDEN_CHUNK_ROWS = 256  # positions per LM-head chunk: (256, V) logits at a time (V = 49152: 50 MB in fp32)


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")


def _check_scoring_args(temperature: float, chunk_rows: int, labels: torch.Tensor) -> None:
    """ValueError for ``temperature <= 0``, ``chunk_rows < 1`` or labels that are not int64."""
    _check_temperature(temperature)
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows!r}")
    if labels.dtype != torch.long:
        raise ValueError(f"labels must be int64 (torch.long), got {labels.dtype}")


def _scaled(chunk: torch.Tensor, temperature: float) -> torch.Tensor:
    chunk = chunk.float()
    return chunk if temperature == 1.0 else chunk / temperature


def logprobs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_rows: int = _DEFAULT_CHUNK_ROWS,
) -> torch.Tensor:
    """Log-probability of each label under ``softmax(logits / temperature)``.

    Shapes: ``logits`` (B, T, V) (any leading dims ``*``, last dim V), any floating dtype; ``labels`` (B, T)
    (the leading dims), int64. Returns (B, T) float32, differentiable w.r.t. ``logits``.
    Formula: ``z = float32(logits) / temperature``; ``logp_t = z[t, labels_t] - logsumexp_v z[t, v]``
    (equal to ``log_softmax(z)[labels]``). Rows are processed ``chunk_rows`` at a time to bound memory.
    Logits of -inf (truncated vocabulary) are allowed as long as the label's own logit is finite.
    Source: sampler-aligned behaviour log-probs, docs/conventions.md section 2.
    Raises: ValueError on a shape mismatch, non-int64 labels, ``temperature <= 0`` or ``chunk_rows < 1``.
    """
    _check_scoring_args(temperature, chunk_rows, labels)
    if logits.dim() < 1 or logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits (*, V) and labels (*) must agree, got {tuple(logits.shape)} and {tuple(labels.shape)}"
        )
    vocab = logits.shape[-1]
    flat_logits = logits.reshape(-1, vocab)
    flat_labels = labels.reshape(-1, 1)
    out = []
    for start in range(0, flat_logits.shape[0], chunk_rows):
        z = _scaled(flat_logits[start : start + chunk_rows], temperature)
        picked = z.gather(-1, flat_labels[start : start + chunk_rows]).squeeze(-1)
        out.append(picked - torch.logsumexp(z, dim=-1))
    if not out:
        return torch.zeros(labels.shape, dtype=torch.float32, device=logits.device)
    return torch.cat(out).reshape(labels.shape)


def logprobs_from_hidden(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_rows: int = _HIDDEN_CHUNK_ROWS,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``logprobs_from_logits(hidden @ lm_head_weight.T, labels)`` without the full (B, T, V) logits.

    Shapes: ``hidden`` (B, T, H) (any leading dims ``*``, last dim H), the final hidden states (after the final
    norm), any floating dtype; ``lm_head_weight`` (V, H), the LM head's weight (``nn.Linear(H, V, bias=False)``),
    the dtype of ``hidden``; ``labels`` (B, T) int64; ``mask`` (B, T) bool or None. Returns (B, T) float32,
    differentiable w.r.t. ``hidden`` and ``lm_head_weight``; 0 where ``mask`` is False.
    Formula: the positions (only those where ``mask`` is True, when given) are taken ``chunk_rows`` at a time;
    each chunk's logits ``linear(hidden_chunk, lm_head_weight)`` are computed in the input dtype, as the LM head
    computes them, and scored by ``logprobs_from_logits`` (same temperature scaling, float32 log-softmax). Equal to
    the full computation up to matmul rounding; without grad at most one chunk's (chunk_rows, V) logits exist at a
    time (with grad, autograd keeps each chunk's for backward).
    Source: sampler-aligned behaviour log-probs, docs/conventions.md section 2.
    Raises: ValueError on a shape mismatch, non-int64 labels, ``temperature <= 0`` or ``chunk_rows < 1``.
    """
    _check_scoring_args(temperature, chunk_rows, labels)
    if hidden.dim() < 1 or hidden.shape[:-1] != labels.shape or lm_head_weight.dim() != 2 or (
            lm_head_weight.shape[1] != hidden.shape[-1]):
        raise ValueError(f"hidden (*, H), lm_head_weight (V, H) and labels (*) must agree, got "
                         f"{tuple(hidden.shape)}, {tuple(lm_head_weight.shape)} and {tuple(labels.shape)}")
    if mask is not None and mask.shape != labels.shape:
        raise ValueError(f"mask must have the shape of labels {tuple(labels.shape)}, got {tuple(mask.shape)}")
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = labels.reshape(-1)
    index = None
    if mask is not None:
        index = mask.reshape(-1).nonzero().squeeze(-1)
        flat_hidden, flat_labels = flat_hidden[index], flat_labels[index]
    out = [logprobs_from_logits(torch.nn.functional.linear(flat_hidden[start : start + chunk_rows], lm_head_weight),
                                flat_labels[start : start + chunk_rows], temperature=temperature,
                                chunk_rows=chunk_rows)
           for start in range(0, flat_hidden.shape[0], chunk_rows)]
    picked = torch.cat(out) if out else torch.zeros(0, dtype=torch.float32, device=hidden.device)
    if index is None:
        return picked.reshape(labels.shape)
    full = torch.zeros(labels.numel(), dtype=torch.float32, device=hidden.device)
    return full.index_put((index,), picked).reshape(labels.shape)


def entropy_from_logits(
    logits: torch.Tensor, *, temperature: float = 1.0, chunk_rows: int = _DEFAULT_CHUNK_ROWS
) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` at every position.

    Shapes: ``logits`` (B, T, V) (any leading dims), any floating dtype. Returns (B, T) float32, differentiable.
    Formula: with ``z = float32(logits) / temperature`` and ``p = softmax(z)``,
    ``H = -sum_v p_v log p_v = logsumexp(z) - sum_v p_v z_v``; entries with ``z_v = -inf`` (p_v = 0) contribute 0.
    Raises: ValueError if ``temperature <= 0`` or ``chunk_rows < 1``.
    """
    _check_temperature(temperature)
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows!r}")
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    out = []
    for start in range(0, flat.shape[0], chunk_rows):
        z = _scaled(flat[start : start + chunk_rows], temperature)
        p = torch.softmax(z, dim=-1)
        z_finite = z.masked_fill(torch.isneginf(z), 0.0)
        out.append(torch.logsumexp(z, dim=-1) - (p * z_finite).sum(dim=-1))
    if not out:
        return torch.zeros(logits.shape[:-1], dtype=torch.float32, device=logits.device)
    return torch.cat(out).reshape(logits.shape[:-1])
