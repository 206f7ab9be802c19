"""Token log-probabilities and entropies from logits, sampler-aligned.

Method: ``log softmax(logits / temperature)[a_t]`` computed as ``logits[a_t]/temperature - logsumexp(logits /
temperature)``, the quantity PPO's importance ratio (Schulman et al. 2017) and GRPO (Shao et al. 2024) need; the
rollout engine and the trainer both call this function, so with unchanged weights ``logprobs - old_logprobs`` is ~0
(docs/conventions.md section 2). What it simplifies: no full (B, T, V) ``log_softmax`` tensor is materialised; rows are
processed in chunks in float32 (only one chunk's float32/temperature copy exists at a time in the forward pass),
and the label logit is gathered before the normaliser is subtracted.
"""

from __future__ import annotations

import torch

__all__ = ["logprobs_from_logits", "entropy_from_logits"]

_DEFAULT_CHUNK_ROWS = 1024


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")


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
    _check_temperature(temperature)
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows!r}")
    if labels.dtype != torch.long:
        raise ValueError(f"labels must be int64 (torch.long), got {labels.dtype}")
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
