"""astrai.algos: pure tensor math for RL fine-tuning of decoder-only LMs.

Functions of tensors with keyword-only scalar arguments; no config objects, no ``.item()``, no device choices,
no distributed calls. Losses return ``(loss, metrics)`` with detached 0-dim metrics. Exact definitions:
docs/conventions.md section 2. Modules: ``masked`` (masked reductions), ``logprobs`` (log-probs/entropy from
logits), ``kl`` (k1/k2/k3 estimators), ``advantages`` (PPO rewards, GAE, GRPO group advantages), ``losses``
(value loss, explained variance, entropy, log-prob gap), ``preference`` (token cross-entropy, DPO),
``stats`` (evaluation statistics of counts: Wilson interval, pass@k, exact McNemar test); the named
registries ``estimators`` (``ADVANTAGE_ESTIMATORS``: gae, grpo, rloo, reinforce_pp, reinforce_pp_baseline),
``policy_losses`` (``POLICY_LOSSES``: ppo_clip, gspo, cispo) with ``aggregation`` (``LOSS_AGG_MODES``), and
``rollout_correction`` (``ROLLOUT_CORRECTIONS``: token_tis, seq_tis, seq_mask, icepop; mismatch metrics).
"""

from .aggregation import LOSS_AGG_MODES, aggregate_loss, loss_units, metric_agg_mode
from .advantages import SCALE_REWARDS, gae, group_advantages, last_token_index, ppo_token_rewards
from .kl import KL_ESTIMATORS, kl_estimate, kl_k1, kl_k2, kl_k3
from .logprobs import entropy_from_logits, logprobs_from_hidden, logprobs_from_logits
from .losses import explained_variance, logprob_gap, masked_entropy, value_loss
from .estimators import ADVANTAGE_ESTIMATORS, AdvantageEstimator, AdvantageEstimatorFn, advantage_estimator
from .masked import global_moments, masked_mean, masked_sum, masked_var, masked_whiten
from .policy_losses import POLICY_LOSSES, PolicyLoss, PolicyLossFn, cispo, gspo, policy_loss, ppo_clip
from .preference import bradley_terry_loss, dpo_loss, token_cross_entropy
from .rollout_correction import MAX_METRICS, ROLLOUT_CORRECTIONS, correction_weights, mismatch_metrics

__all__ = [
    "bradley_terry_loss",
    "ADVANTAGE_ESTIMATORS",
    "AdvantageEstimator",
    "AdvantageEstimatorFn",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "MAX_METRICS",
    "POLICY_LOSSES",
    "PolicyLoss",
    "PolicyLossFn",
    "ROLLOUT_CORRECTIONS",
    "advantage_estimator",
    "aggregate_loss",
    "cispo",
    "correction_weights",
    "gspo",
    "loss_units",
    "metric_agg_mode",
    "mismatch_metrics",
    "policy_loss",
    "ppo_clip",
    "dpo_loss",
    "entropy_from_logits",
    "explained_variance",
    "gae",
    "group_advantages",
    "global_moments",
    "SCALE_REWARDS",
    "kl_estimate",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "last_token_index",
    "logprob_gap",
    "logprobs_from_hidden",
    "logprobs_from_logits",
    "masked_entropy",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "ppo_token_rewards",
    "token_cross_entropy",
    "value_loss",
]
