"""astrai.algos: pure tensor math for RL fine-tuning of decoder-only LMs.

Functions of tensors with keyword-only scalar arguments; no config objects, no ``.item()``, no device choices,
no distributed calls. Losses return ``(loss, metrics)`` with detached 0-dim metrics. Exact definitions:
docs/conventions.md section 2. Modules: ``masked`` (masked reductions), ``logprobs`` (log-probs/entropy from
logits), ``kl`` (k1/k2/k3 estimators), ``advantages`` (PPO rewards, GAE, GRPO group advantages), ``losses``
(value loss, explained variance, entropy, log-prob gap), ``preference`` (token cross-entropy, DPO),
``stats`` (evaluation statistics of counts: Wilson interval, pass@k, exact McNemar test), ``topk_distill``
(top-k logit distillation: GKD's generalised JSD over the teacher's top-k tokens); the named registries
``estimators`` (``ADVANTAGE_ESTIMATORS``: gae, grpo, rloo, reinforce_pp, reinforce_pp_baseline, on_policy_distill),
``policy_losses`` (``POLICY_LOSSES``: ppo_clip, gspo, cispo) with ``aggregation`` (``LOSS_AGG_MODES``), and
``rollout_correction`` (``ROLLOUT_CORRECTIONS``: token_tis, seq_tis, seq_mask, icepop; mismatch metrics), whose
names and needs are written once in the torch-free ``registry``.
"""

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {name: module for module, names in {
    "advantages": ("SCALE_REWARDS", "gae", "group_advantages", "last_token_index", "ppo_token_rewards"),
    "aggregation": ("LOSS_AGG_MODES", "aggregate_loss", "loss_units", "metric_agg_mode"),
    "estimators": ("ADVANTAGE_ESTIMATORS", "AdvantageEstimator", "AdvantageEstimatorFn", "advantage_estimator"),
    "kl": ("KL_ESTIMATORS", "kl_estimate", "kl_k1", "kl_k2", "kl_k3"),
    "logprobs": ("entropy_from_logits", "logprobs_from_hidden", "logprobs_from_logits"),
    "losses": ("explained_variance", "logprob_gap", "masked_entropy", "value_loss"),
    "masked": ("global_moments", "masked_mean", "masked_sum", "masked_var", "masked_whiten"),
    "policy_losses": ("POLICY_LOSSES", "PolicyLoss", "PolicyLossFn", "cispo", "gspo", "policy_loss", "ppo_clip"),
    "preference": ("bradley_terry_loss", "dpo_loss", "token_cross_entropy"),
    "rollout_correction": ("MAX_METRICS", "ROLLOUT_CORRECTIONS", "correction_weights", "mismatch_metrics"),
    "topk_distill": ("logprobs_at_ids", "topk_jsd", "topk_logprobs_from_logits"),
}.items() for name in names}
"""Public name -> the submodule defining it. Submodules import lazily on first use (PEP 562), so the torch-free
`astrai.algos.registry` (the registries' names and needs, which the job configuration reads) is importable without
torch."""


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'astrai.algos' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = sorted(_EXPORTS)
