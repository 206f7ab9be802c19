"""Top-k logit distillation from a local teacher (`distill.jsd_top_k` > 0; GKD's generalised JSD, Agarwal et al. 2024):
a loss term added to the policy loss of the train types that distill (online_grpo, online_ppo).

Each micro-batch of the policy update: the frozen teacher (the one `distill.teacher` loads, which also scores the
sampled tokens for the per-token advantage) scores the student's sampled sequences without grad and keeps its top-k
token ids and log-probs at every action token (`forward.response_topk`: `chunk_size` rows per forward, the LM head
applied a few hundred positions at a time, so only (b, T, k) results are kept, never (B, T, V)); the student's
training forward, the one that gives the policy loss its log-probs, also gathers its log-probs at those ids
(`forward.response_logprobs_at`); the per-token `algos.topk_jsd` (both distributions renormalised over the k ids)
is aggregated over the action tokens as the policy loss is (`loss_agg_mode`, the step's global units) and added
times `distill.jsd_coef`. Both sides use the sampling temperature, as every scoring does (docs/conventions.md
section 2). `distill/jsd` logs the unweighted term (a token-mean share, as `policy/entropy`; each token's JSD
counted at 0 where rounding makes it slightly negative). With `distill.jsd_coef` 0 the term is computed and logged
but adds nothing to the loss (monitoring the divergence costs the teacher's top-k forward all the same).

The teacher runs once per micro-batch per epoch (with `epochs` > 1 its top-k is recomputed on every replay rather
than stored with the rollout: nothing (B, T, k) travels through the experience, the replay or a checkpoint).
"""

from __future__ import annotations

from typing import Optional

import torch

from astrai.algos import aggregate_loss, metric_agg_mode, topk_jsd
from astrai.config import ConfigError
from astrai.data.sequences import Sequences
from astrai.forward import response_logprobs_at, response_topk
from astrai.models.wrappers import bare_module

__all__ = ["TopKDistillation", "check_top_k", "topk_distillation"]


class TopKDistillation:
    """The top-k logit distillation term of the policy update (see the module docstring).

    Args:
        teacher: the frozen local teacher (a module prepared for inference like the reference model).
        top_k: k >= 1, the teacher's tokens per position (`distill.jsd_top_k`).
        beta: GKD's interpolation in [0, 1] (0 forward KL, 1 reverse KL; `distill.jsd_beta`).
        coef: the term's weight in the loss (`distill.jsd_coef`).
        temperature: the sampling temperature (both distributions are scored at it).
        chunk_size: rows per no-grad teacher forward.
        loss_agg_mode: the policy loss's aggregation (`algos.LOSS_AGG_MODES`); loss_scale_factor: its L.

    Raises:
        ValueError: `top_k < 1` or `beta` outside [0, 1].
    """

    def __init__(self, teacher: torch.nn.Module, *, top_k: int, beta: float, coef: float, temperature: float,
                 chunk_size: int, loss_agg_mode: str = "token-mean", loss_scale_factor: Optional[float] = None):
        if top_k < 1 or not 0.0 <= beta <= 1.0:
            raise ValueError(f"TopKDistillation: top_k must be >= 1 and beta in [0, 1], got {top_k} and {beta}")
        self.teacher, self.top_k, self.beta, self.coef = teacher, top_k, beta, coef
        self.temperature, self.chunk_size = temperature, chunk_size
        self.loss_agg_mode, self.loss_scale_factor = loss_agg_mode, loss_scale_factor

    def teacher_topk(self, sequences: Sequences) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's top-k ids (B, T, k) int64 and log-probs (B, T, k) float32 at the action tokens of
        `sequences` (`forward.response_topk`; 0 elsewhere)."""
        return response_topk(self.teacher, sequences, k=self.top_k, temperature=self.temperature,
                             chunk_size=self.chunk_size)

    def __call__(self, model: torch.nn.Module, sequences: Sequences, num_units: torch.Tensor, *,
                 with_entropy: bool = False):
        """The student's forward over one micro-batch with the distillation term.

        Returns:
            `(logprobs, entropy, loss, metrics)`: the sampled tokens' log-probs (B, T) float32 and entropy (or None),
            as `forward.response_logprobs` gives them (same forward); `loss`, 0-dim, `coef` times the aggregated
            per-token JSD (this micro-batch's share of the step's, over `num_units`); metrics `distill/jsd`, the
            unweighted JSD as a share of the step's token mean (detached).
        """
        ids, teacher = self.teacher_topk(sequences)
        logprobs, entropy, student = response_logprobs_at(model, sequences, ids, temperature=self.temperature,
                                                          with_entropy=with_entropy)
        mask = sequences.action_mask
        jsd = topk_jsd(student, teacher, beta=self.beta)  # (B, T)
        loss = aggregate_loss(jsd, mask, loss_agg_mode=self.loss_agg_mode, num_units=num_units,
                              loss_scale_factor=self.loss_scale_factor)
        # the metric of a divergence is >= 0: a token where the two agree can round to -1e-9, which the log shows
        share = aggregate_loss(jsd.detach().clamp_min(0.0), mask, loss_agg_mode=metric_agg_mode(self.loss_agg_mode),
                               num_units=num_units)
        return logprobs, entropy, self.coef * loss, {"distill/jsd": share}


def topk_distillation(config, teacher: Optional[torch.nn.Module], *, chunk_size: int, loss_agg_mode: str,
                      loss_scale_factor: Optional[float]) -> Optional[TopKDistillation]:
    """The top-k distillation term of a validated config (`distill.jsd_top_k`, `distill.jsd_beta`, `distill.jsd_coef`,
    `rollout.temperature`) over the loaded local `teacher`; None when `distill.jsd_top_k` is 0.

    Raises:
        ConfigError: `distill.jsd_top_k` above the teacher's vocabulary size, or a teacher that is not a local module.
    """
    d = config.distill
    if not d.jsd_top_k:
        return None
    check_top_k(config, teacher)
    return TopKDistillation(teacher, top_k=d.jsd_top_k, beta=d.jsd_beta, coef=d.jsd_coef,
                            temperature=config.rollout.temperature, chunk_size=chunk_size,
                            loss_agg_mode=loss_agg_mode, loss_scale_factor=loss_scale_factor)


def check_top_k(config, teacher) -> None:
    """Refuse `distill.jsd_top_k` > 0 for a `teacher` (as `models.load_teachers` or `models.teacher_model` give
    it) that is not a local module, or that has fewer tokens than k (its `config.vocab_size`); nothing when
    `distill.jsd_top_k` is 0.

    Raises:
        ConfigError: one line naming distill.jsd_top_k.
    """
    k = config.distill.jsd_top_k
    if not k:
        return
    if not isinstance(teacher, torch.nn.Module):
        raise ConfigError("distill.jsd_top_k: top-k logit distillation needs a local distill.teacher (a model astrai "
                          "loads), not a served one")
    vocab = getattr(getattr(bare_module(teacher), "config", None), "vocab_size", None)
    if vocab is not None and k > vocab:
        raise ConfigError(f"distill.jsd_top_k: {k} is more than the teacher's {vocab} tokens; set it <= {vocab}")
