"""Per-token KL divergence estimators k1, k2, k3.

Method: J. Schulman, "Approximating KL Divergence" (2020, http://joschu.net/blog/kl-approx.html). For tokens
sampled from the policy ``p`` (log-probs ``logprobs``) and a reference ``q`` (``ref_logprobs``), with
``d = log q(a) - log p(a) = ref_logprobs - logprobs``, each of the following has expectation ``KL(p || q)``
(k2 only approximately, to second order):

- ``k1 = -d``                  unbiased, high variance, can be negative;
- ``k2 = d^2 / 2``             low variance, biased, >= 0;
- ``k3 = exp(d) - 1 - d``      unbiased, low variance, >= 0 (astrai's default; docs/conventions.md section 2).

What it simplifies: the exact KL needs the full vocabulary distribution of both models at every position; the
estimators need only the two log-probs of the sampled token. Choosing an estimator by name goes through the one
explicit dict ``KL_ESTIMATORS``. Inputs are not masked here: callers mask (rewards, losses).
"""

from __future__ import annotations

from typing import Callable

import torch

from . import registry

__all__ = ["kl_k1", "kl_k2", "kl_k3", "KL_ESTIMATORS", "kl_estimate"]


def _check(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> None:
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"logprobs and ref_logprobs must have the same shape, got {tuple(logprobs.shape)} "
            f"and {tuple(ref_logprobs.shape)}"
        )


def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 estimator: ``k1 = -d = logprobs - ref_logprobs`` (Schulman 2020).

    Shapes: both (B, T) (any shape), floating. Returns the same shape and dtype. Raises ValueError on a mismatch.
    """
    _check(logprobs, ref_logprobs)
    return logprobs - ref_logprobs


def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k2 estimator: ``k2 = 0.5 * d^2`` with ``d = ref_logprobs - logprobs`` (Schulman 2020).

    Shapes: both (B, T) (any shape), floating. Returns the same shape and dtype, >= 0.
    Raises ValueError on a shape mismatch.
    """
    _check(logprobs, ref_logprobs)
    d = ref_logprobs - logprobs
    return 0.5 * d * d


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 estimator: ``k3 = exp(d) - 1 - d`` with ``d = ref_logprobs - logprobs`` (Schulman 2020).

    Shapes: both (B, T) (any shape), floating. Returns the same shape and dtype, >= 0 (``exp(d) >= 1 + d``;
    computed as ``expm1(d) - d`` for accuracy near d = 0). Raises ValueError on a shape mismatch.
    """
    _check(logprobs, ref_logprobs)
    d = ref_logprobs - logprobs
    return torch.expm1(d) - d


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
}
if tuple(KL_ESTIMATORS) != registry.KL_ESTIMATORS:
    raise ImportError(f"astrai.algos.kl: {tuple(KL_ESTIMATORS)} != registry {registry.KL_ESTIMATORS}")


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, *, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL(p || q) estimate chosen by name from ``KL_ESTIMATORS``.

    Shapes: ``logprobs`` (B, T) log p of the sampled tokens, ``ref_logprobs`` (B, T) log q of the same tokens,
    floating. Returns (B, T), same dtype, unmasked.
    Formula: ``KL_ESTIMATORS[estimator](logprobs, ref_logprobs)``, see the module docstring (Schulman 2020).
    Raises: ValueError naming the unknown estimator and the choices; ValueError on a shape mismatch.
    """
    try:
        fn = KL_ESTIMATORS[estimator]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown KL estimator {estimator!r}; choices: {', '.join(sorted(KL_ESTIMATORS))}"
        ) from None
    return fn(logprobs, ref_logprobs)
