"""Statistics of evaluation accuracy: a confidence interval, pass@k, and a paired test for an improvement.

Pure functions of counts (Python numbers in, Python floats out):

- ``wilson_interval``: the Wilson score interval for a binomial proportion (E. B. Wilson, "Probable Inference, the
  Law of Succession, and Statistical Inference", JASA 1927). Unlike the normal ("Wald") interval
  ``p +- z sqrt(p (1 - p) / n)`` it stays inside [0, 1] and does not collapse to a point at 0 or n successes,
  which matters for the small accuracies (a few percent) and sample sizes (100-200 questions) of model
  evaluation (Brown, Cai and DasGupta, "Interval Estimation for a Binomial Proportion", Statistical Science 2001).
- ``pass_at_k``: the unbiased estimator of pass@k from n >= k samples with c correct (Chen et al. 2021,
  "Evaluating Large Language Models Trained on Code", section 2.1): ``1 - C(n - c, k) / C(n, k)``, evaluated as
  the product ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)`` that the paper gives for numerical stability.
- ``mcnemar_exact_p``: one-sided exact McNemar test (McNemar, Psychometrika 1947) for paired binary outcomes
  (the same questions scored before and after training): with ``gained`` questions wrong-then-right and ``lost``
  right-then-wrong, under the null hypothesis of no change each discordant question is equally likely to go
  either way, so ``gained ~ Binomial(gained + lost, 1/2)`` and the p-value is ``P(X >= gained)``.
"""

from __future__ import annotations

import math
from statistics import NormalDist

__all__ = ["mcnemar_exact_p", "pass_at_k", "wilson_interval"]


def wilson_interval(successes: float, n: int, *, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval ``(low, high)`` for a proportion with `successes` out of `n` trials.

    With ``p = successes / n`` and ``z`` the two-sided normal quantile of `confidence` (1.95996 for 0.95):
    ``center = (p + z^2 / (2n)) / (1 + z^2 / n)`` and
    ``half = z / (1 + z^2 / n) * sqrt(p (1 - p) / n + z^2 / (4 n^2))``; the interval is ``center -+ half``,
    clipped to [0, 1] against rounding. `successes` may be fractional (a sum of per-question accuracies in [0, 1]:
    their mean has variance at most p (1 - p) / n, so the interval is then conservative).

    Raises:
        ValueError: for n < 1, successes outside [0, n], or confidence outside (0, 1).
    """
    if n < 1:
        raise ValueError(f"wilson_interval: n must be >= 1, got {n}")
    if not 0 <= successes <= n:
        raise ValueError(f"wilson_interval: successes must be in [0, {n}], got {successes}")
    if not 0 < confidence < 1:
        raise ValueError(f"wilson_interval: confidence must be in (0, 1), got {confidence}")
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    p = successes / n
    scale = 1 + z * z / n
    center = (p + z * z / (2 * n)) / scale
    half = z / scale * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, center - half), min(1.0, center + half)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of pass@k (probability that at least one of k samples is correct) from n samples of
    which c are correct (Chen et al. 2021, section 2.1): ``1 - C(n - c, k) / C(n, k)``.

    Raises:
        ValueError: unless 0 <= c <= n and 1 <= k <= n.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def mcnemar_exact_p(gained: int, lost: int) -> float:
    """One-sided exact McNemar p-value for an improvement: ``P(X >= gained)`` with
    ``X ~ Binomial(gained + lost, 1/2)`` (1.0 when there is no discordant pair).

    Args:
        gained: paired items wrong before and right after.
        lost: paired items right before and wrong after.

    Raises:
        ValueError: for negative counts.
    """
    if gained < 0 or lost < 0:
        raise ValueError(f"mcnemar_exact_p: counts must be >= 0, got gained={gained}, lost={lost}")
    total = gained + lost
    return sum(math.comb(total, i) for i in range(gained, total + 1)) / 2 ** total
