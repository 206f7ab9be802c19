"""The policy objective of the rollout-replaying train types, chosen by name from their section, and the rollout
correction of the training-inference mismatch.

`policy_objective(section)` turns `ppo.*` / `grpo.*` (`policy_loss`, `loss_agg_mode`, `clip_ratio_low/high`,
`clip_ratio_c`, `clip_eps`) into an `Objective` over the `astrai.algos.POLICY_LOSSES` registry, with the correction
weights of the rollout multiplied in when there are any. `RolloutCorrection` rescores a rollout with the trainer's
own forward before its first update and pins the importance weights of `rollout.correction`
(`astrai.algos.ROLLOUT_CORRECTIONS`; docs/conventions.md section 7): the PPO ratio is then taken against the
trainer's own old log-probs (verl's decoupled form), and the engine's log-probs are kept as `rollout_logprobs`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional

import torch

from astrai.algos import ROLLOUT_CORRECTIONS, correction_weights, mismatch_metrics, policy_loss
from astrai.experience.result import RolloutResult
from astrai.experience.trajectory import Experience
from astrai.forward import response_logprobs, score_in_chunks

Objective = Callable[[torch.Tensor, RolloutResult, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""(logprobs (b, T) float32 with grad, micro-batch, the step's global loss units 0-dim) -> (loss share, metric
shares)."""

GSPO_CLIP = (3e-4, 4e-4)
"""GSPO's clip range (low, high) when the section leaves `clip_ratio_low/high` null (Zheng et al. 2025, section 5.1:
the ratio is a per-token geometric mean, so it moves orders of magnitude less than a token ratio)."""


def clip_range(section) -> tuple[float, float]:
    """(clip_ratio_low, clip_ratio_high) of a `ppo` / `grpo` section: the configured ones, else `clip_eps` for
    ppo_clip and cispo, `GSPO_CLIP` for gspo."""
    default = GSPO_CLIP if section.policy_loss == "gspo" else (section.clip_eps, section.clip_eps)
    low = section.clip_ratio_low if section.clip_ratio_low is not None else default[0]
    high = section.clip_ratio_high if section.clip_ratio_high is not None else default[1]
    return low, high


def loss_agg_mode(section) -> str:
    """The section's `loss_agg_mode`, else its policy loss's own (`POLICY_LOSSES[...].loss_agg_mode`)."""
    if section.loss_agg_mode is None:
        return policy_loss(section.policy_loss).loss_agg_mode
    return section.loss_agg_mode


def policy_objective(section, *, loss_scale_factor: Optional[float] = None) -> Objective:
    """The policy loss of a `ppo` / `grpo` section as an `Objective` (its `loss_agg_mode`: `loss_agg_mode`);
    `loss_scale_factor` is the L of `seq-mean-token-sum-norm` (the response-length cap). The micro-batch's
    `correction_weights`, when pinned, weight each token's loss. Metrics as the loss reports them, plus
    `policy/pg_loss`."""
    record, mode = policy_loss(section.policy_loss), loss_agg_mode(section)
    low, high = clip_range(section)

    def objective(logprobs: torch.Tensor, micro: RolloutResult, num_units: torch.Tensor):
        loss, metrics = record.fn(logprobs, micro.old_logprobs, micro.advantages, micro.sequences.action_mask,
                                  clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=section.clip_ratio_c,
                                  loss_agg_mode=mode, num_units=num_units, loss_scale_factor=loss_scale_factor,
                                  weights=micro.correction_weights)
        metrics["policy/pg_loss"] = loss.detach()
        return loss, metrics

    return objective


class RolloutCorrection:
    """Rescore a rollout with the trainer before its first update and pin `rollout.correction`'s weights.

    Args:
        mode: one of `ROLLOUT_CORRECTIONS`; token_cap, seq_cap, icepop_low, icepop_high: its thresholds.
        temperature: the sampling temperature (scoring uses it too); chunk_size: rows per no-grad forward.
    """

    def __init__(self, mode: str, *, token_cap: float, seq_cap: float, icepop_low: float, icepop_high: float,
                 temperature: float, chunk_size: int):
        if mode not in ROLLOUT_CORRECTIONS:
            raise ValueError(f"rollout.correction: expected one of {', '.join(ROLLOUT_CORRECTIONS)}, got {mode!r}")
        self.mode, self.temperature, self.chunk_size = mode, temperature, chunk_size
        self.thresholds = dict(token_cap=token_cap, seq_cap=seq_cap, icepop_low=icepop_low, icepop_high=icepop_high)

    @classmethod
    def from_config(cls, rollout_section, *, chunk_size: int) -> Optional["RolloutCorrection"]:
        """The correction of a `rollout` section, or None for `correction: none`."""
        r = rollout_section
        if r.correction == "none":
            return None
        return cls(r.correction, token_cap=r.correction_token_cap, seq_cap=r.correction_seq_cap,
                   icepop_low=r.icepop_low, icepop_high=r.icepop_high, temperature=r.temperature,
                   chunk_size=chunk_size)

    @torch.no_grad()
    def rescore(self, model: torch.nn.Module, experience: Experience
                ) -> tuple[Experience, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """(the experience with the trainer's `old_logprobs`, the engine's log-probs (B, T), the weights (B, T),
        metrics): the trainer's log-probs of the sampled tokens by the same scoring function as training, the
        mismatch metrics over every real token of the rollout (`rollout/mismatch_*`), the correction's
        (`rollout/correction_*`) and `time/rescore_seconds`."""
        start = time.perf_counter()
        mask = experience.sequences.action_mask
        train_old = score_in_chunks(lambda chunk: response_logprobs(model, chunk, temperature=self.temperature)[0],
                                    experience.sequences, self.chunk_size) * mask
        engine = experience.old_logprobs * mask
        weights, metrics = self.weigh(train_old, engine, mask)
        metrics["time/rescore_seconds"] = torch.tensor(time.perf_counter() - start)
        return dataclasses.replace(experience, old_logprobs=train_old), engine, weights, metrics

    def weigh(self, train_old: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(weights (B, T) float32, 0 at padding and dropped tokens; metrics) of `rollout.correction` for the
        trainer's old log-probs `train_old` against the engine's `engine` (both (B, T), 0 at padding) over the
        action `mask`: the correction's (`rollout/correction_*`) and the mismatch metrics (`rollout/mismatch_*`,
        `astrai.algos.mismatch_metrics`). Rows are independent: weighing a rollout's rows in parts gives the same
        weights as weighing them together."""
        weights, _, metrics = correction_weights(self.mode, train_old, engine, mask, **self.thresholds)
        metrics.update(mismatch_metrics(train_old, engine, mask))
        return weights * mask, metrics

    def in_update(self, micro: RolloutResult, logprobs: torch.Tensor) -> RolloutResult:
        """`micro` (whose `rollout_logprobs` are the engine's and whose `correction_weights` are None: a rollout
        trained in one optimizer step, `RolloutLearner.corrects_in_update`) with the trainer's old log-probs
        taken from its own forward of that step (`logprobs` (b, T'), detached here: the policy before its only
        update from this rollout, what `rescore` would compute) and the correction's weights."""
        mask = micro.sequences.action_mask
        train_old = logprobs.detach() * mask
        weights, _, _ = correction_weights(self.mode, train_old, micro.rollout_logprobs * mask, mask,
                                           **self.thresholds)
        return micro.with_fields(old_logprobs=train_old, correction_weights=weights * mask)
