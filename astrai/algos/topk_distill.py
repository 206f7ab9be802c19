"""Top-k logit distillation: GKD's generalised Jensen-Shannon divergence over the teacher's top-k tokens.

Method: R. Agarwal et al., "On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes" (ICLR
2024, GKD), the generalised JSD with interpolation weight ``beta`` between the teacher ``P`` and the student ``Q``::

    M = beta * P + (1 - beta) * Q
    JSD(beta)(P || Q) = beta * KL(P || M) + (1 - beta) * KL(Q || M)

and at the two ends the limits of ``JSD / beta`` and ``JSD / (1 - beta)``: ``beta = 0`` the forward KL ``KL(P || Q)``
and ``beta = 1`` the reverse KL ``KL(Q || P)`` (the unscaled JSD vanishes there; TRL's GKDTrainer uses the same two
limits).

What it simplifies: GKD (and TRL) take both distributions over the whole vocabulary at every response position,
which needs the teacher's (B, T, V) distribution next to the student's. Here the divergence is taken over the
teacher's top-k tokens only: ``topk_logprobs_from_logits`` keeps the teacher's k most likely token ids and their
log-probs per position ((B, T, k), computed chunk by chunk so no (B, T, V) teacher tensor exists), the student's
log-probs are gathered at those ids (``logprobs_at_ids``), and ``topk_jsd`` renormalises BOTH over those k tokens
(``log p_i - logsumexp_{j in top-k} log p_j``: each becomes a proper distribution on the k-token support, the
probability mass outside it dropped) before taking the divergence. With k = V it is the full-vocabulary JSD; for
a small k it is the divergence of the two distributions conditioned on the teacher's top-k set, which ignores how
much mass the student puts outside it (the student's full-vocabulary softmax still appears in its gathered
log-probs, but the renormalisation removes the total; the sampled-token on-policy signal covers the rest).
"""

from __future__ import annotations

import math

import torch

__all__ = ["logprobs_at_ids", "topk_jsd", "topk_logprobs_from_logits"]

_CHUNK_ROWS = 256  # positions per chunk: (256, V) float32 logits at a time


def _scaled(chunk: torch.Tensor, temperature: float) -> torch.Tensor:
    chunk = chunk.float()
    return chunk if temperature == 1.0 else chunk / temperature


def _check(temperature: float, chunk_rows: int) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows!r}")


def topk_logprobs_from_logits(logits: torch.Tensor, *, k: int, temperature: float = 1.0,
                              chunk_rows: int = _CHUNK_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely tokens of ``softmax(logits / temperature)`` at every position, and their log-probs.

    Shapes: ``logits`` (*, V), any floating dtype. Returns ``ids`` (*, k) int64 and ``logprobs`` (*, k) float32
    (full-vocabulary log-softmax values, not yet renormalised), in descending order of probability. Positions are
    processed ``chunk_rows`` at a time, so at most one chunk's float32 (chunk_rows, V) copy exists.
    Raises: ValueError for ``k`` outside [1, V], ``temperature <= 0`` or ``chunk_rows < 1``.
    """
    _check(temperature, chunk_rows)
    vocab = logits.shape[-1]
    if not 1 <= k <= vocab:
        raise ValueError(f"k must be in [1, V={vocab}], got {k!r}")
    flat = logits.reshape(-1, vocab)
    ids, values = [], []
    for start in range(0, flat.shape[0], chunk_rows):
        z = torch.log_softmax(_scaled(flat[start:start + chunk_rows], temperature), dim=-1)
        top = z.topk(k, dim=-1)
        ids.append(top.indices)
        values.append(top.values)
    shape = (*logits.shape[:-1], k)
    if not ids:
        return (torch.zeros(shape, dtype=torch.long, device=logits.device),
                torch.zeros(shape, dtype=torch.float32, device=logits.device))
    return torch.cat(ids).reshape(shape), torch.cat(values).reshape(shape)


def logprobs_at_ids(logits: torch.Tensor, ids: torch.Tensor, *, temperature: float = 1.0,
                    chunk_rows: int = 1024) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` gathered at ``ids`` (the teacher's top-k ids) at every position.

    Shapes: ``logits`` (*, V) any floating dtype (may carry grad); ``ids`` (*, k) int64 in [0, V). Returns (*, k)
    float32, differentiable w.r.t. ``logits``. Formula: ``z[ids] - logsumexp(z)`` with ``z = float32(logits) /
    temperature``, ``chunk_rows`` positions at a time.
    Raises: ValueError on a shape mismatch, non-int64 ids, ``temperature <= 0`` or ``chunk_rows < 1``.
    """
    _check(temperature, chunk_rows)
    if ids.dtype != torch.long or logits.dim() < 1 or logits.shape[:-1] != ids.shape[:-1]:
        raise ValueError(f"logits (*, V) and ids (*, k) int64 must agree, got {tuple(logits.shape)} and "
                         f"{tuple(ids.shape)} {ids.dtype}")
    vocab, k = logits.shape[-1], ids.shape[-1]
    flat, flat_ids = logits.reshape(-1, vocab), ids.reshape(-1, k)
    out = []
    for start in range(0, flat.shape[0], chunk_rows):
        z = _scaled(flat[start:start + chunk_rows], temperature)
        out.append(z.gather(-1, flat_ids[start:start + chunk_rows]) - torch.logsumexp(z, dim=-1, keepdim=True))
    if not out:
        return torch.zeros(ids.shape, dtype=torch.float32, device=logits.device)
    return torch.cat(out).reshape(ids.shape)


def topk_jsd(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, *, beta: float) -> torch.Tensor:
    """GKD's generalised JSD(beta) per position over the teacher's top-k support, both distributions renormalised.

    Shapes: ``student_logprobs`` (*, k) floating, the student's log-probs at the teacher's top-k ids (may carry
    grad; full-vocabulary values or any unnormalised log-weights); ``teacher_logprobs`` (*, k) the teacher's at the
    same ids (detached here: no gradient reaches the teacher). Returns (*,) float32, >= 0 up to rounding.

    Formula (module docstring), with ``q = log_softmax(student_logprobs)`` and ``p = log_softmax(teacher_logprobs)``
    over the last dim (the renormalisation onto the k tokens):
    ``beta = 0``: ``sum_i e^p_i (p_i - q_i)`` (forward KL(P || Q));
    ``beta = 1``: ``sum_i e^q_i (q_i - p_i)`` (reverse KL(Q || P));
    else ``m = logaddexp(log(beta) + p, log(1 - beta) + q)`` and
    ``beta * sum_i e^p_i (p_i - m_i) + (1 - beta) * sum_i e^q_i (q_i - m_i)``.
    Source: Agarwal et al. 2024 (GKD), the generalised JSD; the top-k support and renormalisation are astrai's.
    Raises: ValueError for ``beta`` outside [0, 1] or a shape mismatch.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta!r}")
    if student_logprobs.shape != teacher_logprobs.shape or student_logprobs.dim() < 1:
        raise ValueError(f"student_logprobs and teacher_logprobs must be (*, k) of one shape, got "
                         f"{tuple(student_logprobs.shape)} and {tuple(teacher_logprobs.shape)}")
    q = torch.log_softmax(student_logprobs.float(), dim=-1)
    p = torch.log_softmax(teacher_logprobs.detach().float(), dim=-1)
    if beta == 0.0:
        return (p.exp() * (p - q)).sum(-1)
    if beta == 1.0:
        return (q.exp() * (q - p)).sum(-1)
    m = torch.logaddexp(p + math.log(beta), q + math.log(1.0 - beta))
    return beta * (p.exp() * (p - m)).sum(-1) + (1.0 - beta) * (q.exp() * (q - m)).sum(-1)
