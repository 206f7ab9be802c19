"""Masked reductions over real (un-padded) tokens.

Method: sums, means, variances and whitening restricted to the positions where a mask is true, the building
blocks of every token-level RL loss (PPO, Schulman et al. 2017; GAE whitening, Schulman et al. 2016). What it
simplifies: values at masked positions never influence a result, even when they hold garbage such as NaN or inf,
because they are selected away with ``torch.where`` before any arithmetic (``x * mask`` would turn NaN into NaN).

Conventions (all functions):
- ``mask`` has the same shape as ``x``; bool or 0/1 numbers (any non-zero value counts as a real token).
- No ``.item()`` and no host synchronisation: empty masks are handled arithmetically (a count of 0 is treated as 1
  in denominators, so an empty mask gives 0 rather than NaN).
- ``num_tokens`` (where accepted) is the denominator of a token mean: a Python int >= 1 or a 0-dim tensor (clamped
  to >= 1). Passing the global count of real tokens of a whole optimizer step makes the per-micro-batch results
  add up to the full-batch result.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["masked_sum", "masked_mean", "masked_var", "masked_whiten", "global_moments"]


def _check_mask(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if x.shape != mask.shape:
        raise ValueError(f"x and mask must have the same shape, got {tuple(x.shape)} and {tuple(mask.shape)}")
    return mask.bool()


def _real(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` with masked positions replaced by 0 (so NaN/inf there cannot reach values or gradients); ``mask`` is
    bool of the same shape. Raises ValueError naming the expected shape."""
    if x.shape != mask.shape:
        raise ValueError(f"expected shape {tuple(mask.shape)} (action_mask), got {tuple(x.shape)}")
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _denominator(count: torch.Tensor, num_tokens: int | torch.Tensor | None, dtype: torch.dtype,
                 name: str = "num_tokens") -> torch.Tensor:
    if num_tokens is None:
        return count.to(dtype).clamp(min=1)
    if isinstance(num_tokens, torch.Tensor):
        return num_tokens.to(dtype).clamp(min=1)
    if isinstance(num_tokens, bool) or int(num_tokens) != num_tokens or num_tokens < 1:
        raise ValueError(f"{name} must be an integer >= 1 or a tensor, got {num_tokens!r}")
    return torch.tensor(float(num_tokens), dtype=dtype, device=count.device)


def masked_sum(x: torch.Tensor, mask: torch.Tensor, *, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` over the real positions of ``mask``.

    Shapes: ``x`` any shape, e.g. (B, T), floating; ``mask`` same shape, bool or 0/1.
    Returns: 0-dim tensor when ``dim`` is None, else ``x`` reduced over ``dim``; dtype of ``x``.
    Formula: ``sum_i x_i [mask_i]``; masked values (even NaN/inf) contribute exactly 0.
    Raises: ValueError if the shapes differ.
    """
    m = _check_mask(x, mask)
    xm = torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return xm.sum() if dim is None else xm.sum(dim=dim)


def masked_mean(
    x: torch.Tensor,
    mask: torch.Tensor,
    *,
    dim: int | None = None,
    num_tokens: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean of ``x`` over the real positions of ``mask`` (token mean).

    Shapes: ``x`` any shape, e.g. (B, T), floating; ``mask`` same shape.
    Returns: 0-dim tensor when ``dim`` is None, else ``x`` reduced over ``dim``; dtype of ``x``.
    Formula: ``masked_sum(x) / N`` with ``N = num_tokens`` if given (e.g. the global number of real tokens of the
    optimizer step, so that micro-batch means sum to the full-batch mean) else ``mask.sum(dim)``; ``N`` is
    clamped to >= 1, so an empty mask gives 0.
    Raises: ValueError if the shapes differ or ``num_tokens`` is an int < 1.
    """
    m = _check_mask(x, mask)
    total = masked_sum(x, m, dim=dim)
    count = m.sum() if dim is None else m.sum(dim=dim)
    return total / _denominator(count, num_tokens, x.dtype)


def masked_var(
    x: torch.Tensor, mask: torch.Tensor, *, dim: int | None = None, unbiased: bool = True
) -> torch.Tensor:
    """Variance of ``x`` over the real positions of ``mask``.

    Shapes: ``x`` any shape, floating; ``mask`` same shape. Returns 0-dim (``dim`` None) or reduced over ``dim``.
    Formula: with ``n`` real positions and ``mu = masked_mean(x)``,
    ``sum (x - mu)^2 [mask] / (n - 1)`` when ``unbiased`` (Bessel) else ``/ n``. Denominators are clamped to
    >= 1, so one real position (or none) gives variance 0.
    Raises: ValueError if the shapes differ.
    """
    m = _check_mask(x, mask)
    xs = torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))  # no NaN even in gradients
    mean = masked_mean(xs, m, dim=dim)
    if dim is not None:
        mean = mean.unsqueeze(dim)
    sq = masked_sum((xs - mean) ** 2, m, dim=dim)
    count = (m.sum() if dim is None else m.sum(dim=dim)).to(x.dtype)
    denom = count - 1 if unbiased else count
    return sq / denom.clamp(min=1)


def global_moments(
    x: torch.Tensor, mask: torch.Tensor | None = None, *,
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None, unbiased: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, variance), each 0-dim in x's dtype, of the real positions of ``x`` on every rank together.

    Shapes: ``x`` any shape, floating, this rank's share; ``mask`` same shape, bool or 0/1 (None: every position
    is real). ``all_reduce_sum`` sums a tensor over the data-parallel ranks (e.g.
    `astrai.distributed.DistributedContext.all_reduce_sum`; None: one process; this module makes no distributed
    call of its own). Formula: two passes, as `masked_mean` / `masked_var` on one host: the global mean from the
    summed (sum, count), then ``sum (x - mean)^2 [mask]`` summed over the ranks and divided by ``n - 1`` (Bessel)
    when ``unbiased`` else by ``n``, the denominator clamped to >= 1 (one real position, or none, gives 0). No
    rank's values are gathered: two all-reduces of one and two numbers.
    Raises: ValueError if the shapes differ.
    """
    m = torch.ones_like(x, dtype=torch.bool) if mask is None else _check_mask(x, mask)
    reduce = all_reduce_sum or (lambda t: t)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    totals = reduce(torch.stack([torch.where(m, x, zero).sum(), m.sum().to(x.dtype)]))
    mean = totals[0] / totals[1].clamp(min=1)
    squares = reduce(torch.where(m, (x - mean) ** 2, zero).sum())
    denominator = totals[1] - 1 if unbiased else totals[1]
    return mean, squares / denominator.clamp(min=1)


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, eps: float = 1e-8,
    moments: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Whiten ``x`` with the mean and standard deviation of its real positions (e.g. PPO advantages).

    Shapes: ``x`` (B, T) (any shape), floating; ``mask`` same shape. Returns the same shape and dtype.
    Formula: ``mu = masked_mean(x)``, ``var = masked_var(x, unbiased=True)``,
    ``y = (x - mu) / sqrt(var + eps)``; if not ``shift_mean`` the mean is added back (``y + mu``, scale only).
    Statistics come from real positions only; masked positions of the output are exactly 0. ``moments`` = (mean,
    var) 0-dim replaces the statistics of ``x`` (e.g. those of the whole batch over all data-parallel ranks).
    Source: advantage normalisation as in the PPO baselines (Schulman et al. 2017) and GAE (2016).
    Raises: ValueError if the shapes differ.
    """
    m = _check_mask(x, mask)
    if moments is None:
        mean, var = masked_mean(x, m), masked_var(x, m, unbiased=True)
    else:
        mean, var = (t.to(x.dtype) for t in moments)
    xm = torch.where(m, x, mean)  # garbage at masked positions never reaches the arithmetic
    y = (xm - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        y = y + mean
    return torch.where(m, y, torch.zeros((), dtype=y.dtype, device=y.device))
