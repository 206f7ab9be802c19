"""Per-request sampling for the paged engine: temperature, top-k, top-p and a frequency penalty, composed per row.

Order per row: scaled = logits / temperature; the behaviour log-prob is `log_softmax(scaled)[token]`, taken BEFORE
penalties and truncation (docs/conventions.md section 2: it is what the trainer scores). The sampling distribution then
subtracts the frequency penalty (OpenAI-style `frequency_penalty`: penalty x count of each token among the
request's last `window` generated tokens), applies top-k (Fan et al. 2018) and top-p (Holtzman et al. 2020), and
draws with the request's own `torch.Generator`, so a row's samples do not depend on which other rows share its
batch. `top_k == 1` is greedy (argmax; the row still draws, and ignores, its one uniform per step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from astrai.kernels import cpu_kernels
from astrai.rollout.sampling import SamplingParams, truncation_mask

__all__ = ["FrequencyPenalty", "RowSampling", "per_prompt_settings", "sample_rows", "sample_rows_with_top",
           "request_seed", "row_base_seed", "draw_base_seed"]

_MASK64 = (1 << 64) - 1
_SEED_STEP = 0x9E3779B97F4A7C15  # splitmix64's increment: request i of a call hashes base + (i + 1) * it


@dataclass(frozen=True)
class FrequencyPenalty:
    """Subtract `penalty * count(token)` from the (temperature-scaled) logits, counting the request's last
    `window` generated tokens (0 = all of them).

    Raises:
        ValueError: for a negative window.
    """

    penalty: float
    window: int = 0

    def __post_init__(self):
        if self.window < 0:
            raise ValueError(f"FrequencyPenalty.window: expected >= 0, got {self.window}")

    def apply(self, scaled: torch.Tensor, generated: Sequence[int]) -> torch.Tensor:
        """scaled (V,) float32 -> penalised copy (V,); `generated`: the request's sampled token ids so far."""
        recent = generated[-self.window:] if self.window else generated
        if not recent or self.penalty == 0:
            return scaled
        ids = torch.tensor(list(recent), dtype=torch.long, device=scaled.device)
        counts = torch.bincount(ids, minlength=scaled.shape[0]).to(scaled.dtype)
        return scaled - self.penalty * counts


@dataclass
class RowSampling:
    """Sampling state of one request: settings, optional penalty, own RNG, tokens generated so far."""

    params: SamplingParams
    penalty: Optional[FrequencyPenalty]
    generator: torch.Generator
    generated: list[int]


def per_prompt_settings(prompts: Sequence, params, n, penalties) -> tuple[list[SamplingParams], list]:
    """The engine protocol's `generate` arguments checked and spread per prompt: (one `SamplingParams` per prompt,
    one `FrequencyPenalty` or None per prompt), from `params` (one for all, or a list with one per prompt) and
    `penalties` (None, one for all, or a list with one per prompt); `n` must be an integer >= 1.

    Raises:
        ValueError: `n` not an integer >= 1, `params` neither a `SamplingParams` nor a list of them, or lists whose
            lengths differ from the prompts'.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"generate: n must be an integer >= 1, got {n!r}")
    if isinstance(params, SamplingParams):
        per_params = [params] * len(prompts)
    elif isinstance(params, Sequence) and all(isinstance(p, SamplingParams) for p in params):
        per_params = list(params)
    else:
        raise ValueError("generate: params must be a SamplingParams or a list with one per prompt, got "
                         f"{type(params).__name__}")
    per_penalty = ([penalties] * len(prompts) if penalties is None or isinstance(penalties, FrequencyPenalty)
                   else list(penalties))
    if len(per_params) != len(prompts) or len(per_penalty) != len(prompts):
        raise ValueError(f"generate: {len(prompts)} prompts but {len(per_params)} params / "
                         f"{len(per_penalty)} penalties")
    return per_params, per_penalty


def draw_base_seed(generator: Optional[torch.Generator] = None) -> int:
    """A call's base seed: one int in [0, 2**62) drawn from `generator` (None: torch's default CPU generator), on
    the generator's device; `request_seed` derives each row's seed from it."""
    return int(torch.randint(0, 2**62, (1,), generator=generator,
                             device=generator.device if generator is not None else "cpu"))


def request_seed(base_seed: int, index: int) -> int:
    """Seed of request `index` from a call's base seed (a splitmix64 step; result in [0, 2**63))."""
    x = (base_seed + (index + 1) * _SEED_STEP) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


def row_base_seed(base_seed: int, index: int) -> int:
    """The base seed whose request 0 is seeded as request `index` of a call with `base_seed`:
    `request_seed(row_base_seed(b, i), 0) == request_seed(b, i)` (the hashed word is b + (i + 1) * step either way;
    what a caller adding rows one at a time passes to keep `generate`'s per-row seeds)."""
    return (base_seed + index * _SEED_STEP) & _MASK64


def _distribution(scaled: torch.Tensor, row: RowSampling) -> torch.Tensor | int:
    """The row's sampling probabilities (V,) float32 after penalty and truncation, or a greedy token id."""
    p = row.params
    if row.penalty is not None:
        scaled = row.penalty.apply(scaled, row.generated)
    if p.top_k == 1:
        return int(scaled.argmax())
    if p.truncates:
        keep = truncation_mask(scaled[None], top_k=p.top_k, top_p=p.top_p)[0]
        scaled = scaled.masked_fill(~keep, float("-inf"))
    return torch.softmax(scaled, dim=-1)


CDF_CHUNK = 1024  # vocabulary columns per chunk of the two-level inverse CDF in `sample_rows`


def _buffer(scratch, name: str, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A (possibly reused) buffer of `shape`: from `scratch.scratch(...)` (an `InferenceWorkspace`) or fresh."""
    numel = 1
    for size in shape:
        numel *= size
    if scratch is None:
        return torch.empty(shape, dtype=dtype, device=device)
    return scratch.scratch(name, numel, dtype).view(shape)


def sample_rows(logits: torch.Tensor, rows: Sequence[RowSampling], scratch=None) -> tuple[list[int], list[float]]:
    """Sample one token for each row of `logits` (R, V) with the matching `rows[i]`: (token ids, their behaviour
    log-probs), `sample_rows_with_top` without the most likely tokens."""
    tokens, chosen, _ = sample_rows_with_top(logits, rows, (), scratch=scratch)
    return tokens, chosen


def sample_rows_with_top(logits: torch.Tensor, rows: Sequence[RowSampling], ks: Sequence[int], scratch=None
                         ) -> tuple[list[int], list[float], list[tuple[tuple[int, float], ...]]]:
    """Sample one token for each row of `logits` (R, V) with the matching `rows[i]`, and report the `ks[i]` most
    likely tokens of the rows that ask for them.

    Each non-greedy row draws ONE uniform u from its own generator and takes the inverse CDF of its distribution:
    the first token whose cumulative probability exceeds u * total. The CDF is two-level (float64 sums of
    `CDF_CHUNK`-column chunks, then a float64 cumulative sum inside the chosen chunk only), which picks the same
    token as a full float64 cumulative sum up to float64 rounding at interval ends, at a fraction of the memory
    traffic. Rows without penalty or truncation sample `exp(logits / temperature - max)` (unnormalised) directly.

    Args:
        logits: (R, V) next-token logits, any float dtype (computed in float32); not modified.
        rows: R sampling states (settings, penalty, generator, generated tokens).
        ks: per row, how many most likely tokens to report (0: none); empty: none for any row.
        scratch: optional `astrai.kernels.InferenceWorkspace` whose named scratch buffers hold the (R, V)
            intermediates, so the hot loop does not allocate (fresh multi-MB tensors cost page faults per step).

    Returns:
        token ids (R Python ints), their behaviour log-probs (R floats, float32 precision) under
        `log_softmax(logits / temperature)` (no penalty, no truncation), and per row its `ks[i]` most likely
        (token id, log-prob) pairs under that distribution, most likely first (ties: lower id first, as
        `torch.topk`; () where none are asked). Every log-prob is `scaled[token] - logsumexp` with the one float32
        `logsumexp` of its row, so a sampled token among its row's most likely has exactly the same value in both.

    Raises:
        FloatingPointError: naming the first row whose largest scaled logit is NaN or infinite.
    """
    if not rows:
        return [], [], []
    num_rows, vocab = logits.shape
    device = logits.device
    scaled = logits.float()
    temps = [r.params.temperature for r in rows]
    if any(t != 1.0 for t in temps):
        scaled = scaled / torch.tensor(temps, dtype=torch.float32, device=device)[:, None]
    chunks = -(-vocab // CDF_CHUNK)
    probs_buf = _buffer(scratch, "sample_probs", (num_rows, chunks * CDF_CHUNK), torch.float32, device)
    probs = probs_buf[:, :vocab]
    if device.type == "cpu" and scaled.stride(-1) == 1 and cpu_kernels.supports(torch.float32):
        # one compiled pass: max, exp and the float64 chunk sums (the torch ops below cost 18 ms a step at
        # R = 128, V = 49152, two threads, mostly a float64 copy of the probabilities)
        maxes = torch.empty(num_rows, 1, dtype=torch.float32)
        chunk_mass = torch.empty(num_rows, chunks, dtype=torch.float64)
        cpu_kernels.softmax_chunks(scaled, probs_buf, chunk_mass, maxes, CDF_CHUNK)
    else:
        maxes = scaled.amax(-1, keepdim=True)  # (R, 1)
        probs_buf[:, vocab:].zero_()
        torch.sub(scaled, maxes, out=probs)
        probs.exp_()  # unnormalised probabilities of the temperature-scaled distribution
        chunk_mass = probs_buf.view(num_rows, chunks, CDF_CHUNK).sum(-1, dtype=torch.float64)  # (R, C)
    finite = torch.isfinite(maxes[:, 0])  # checked with the tokens' one transfer to the host, below
    logsumexp = maxes + chunk_mass.sum(-1, keepdim=True).log().float()  # (R, 1)
    greedy: dict[int, int] = {}
    for i, row in enumerate(rows):
        if row.penalty is not None or row.params.truncates:
            dist = _distribution(scaled[i], row)
            if isinstance(dist, int):
                greedy[i] = dist
            else:
                probs[i] = dist
                chunk_mass[i] = probs_buf[i].view(chunks, CDF_CHUNK).sum(-1, dtype=torch.float64)
    uniforms = torch.stack([torch.rand((), generator=row.generator, device=device) for row in rows])
    chunk_cdf = chunk_mass.cumsum(-1)  # (R, C)
    total = chunk_cdf[:, -1:]
    # u < 1, but u * total can round up to total; stay strictly below it so a zero-mass tail is never drawn.
    target = torch.minimum(uniforms.double()[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    chunk = torch.searchsorted(chunk_cdf, target, right=True).clamp_(max=chunks - 1)  # (R, 1)
    before = chunk_cdf.gather(-1, chunk) - chunk_mass.gather(-1, chunk)  # mass of the chunks before
    inside = probs_buf.view(num_rows, chunks, CDF_CHUNK)[torch.arange(num_rows, device=device), chunk[:, 0]]
    local_cdf = inside.double().cumsum(-1) + before  # (R, CDF_CHUNK)
    last = local_cdf[:, -1:]
    target = torch.minimum(target, torch.nextafter(last, torch.zeros_like(last)))  # same rounding guard
    offset = torch.searchsorted(local_cdf, target, right=True).clamp_(max=CDF_CHUNK - 1)
    drawn = (chunk * CDF_CHUNK + offset).squeeze(-1).clamp_(max=vocab - 1)
    *drawn_ids, all_finite = torch.cat([drawn, finite.all().long()[None]]).tolist()  # the step's one host sync
    if not all_finite:
        bad = int((~finite).nonzero()[0, 0])
        raise FloatingPointError(f"sample_rows: row {bad} has non-finite logits (max {float(maxes[bad, 0])}): "
                                 "NaN/inf weights or activations")
    tokens = [greedy.get(i, t) for i, t in enumerate(drawn_ids)]
    index = torch.tensor(tokens, dtype=torch.long, device=device)
    chosen = (scaled.gather(-1, index[:, None]) - logsumexp).squeeze(-1).tolist()
    return tokens, chosen, _top(scaled, logsumexp, ks)


def _top(scaled: torch.Tensor, logsumexp: torch.Tensor, ks: Sequence[int]) -> list[tuple[tuple[int, float], ...]]:
    """Per row, its `ks[i]` largest `scaled - logsumexp` (the same subtraction as the sampled token's log-prob)."""
    tops: list[tuple[tuple[int, float], ...]] = [()] * scaled.shape[0]
    wanted = [i for i, k in enumerate(ks) if k]
    if not wanted:
        return tops
    index = torch.tensor(wanted, dtype=torch.long, device=scaled.device)
    values, ids = scaled.index_select(0, index).topk(max(ks[i] for i in wanted), dim=-1)
    values = (values - logsumexp.index_select(0, index)).tolist()
    ids = ids.tolist()
    for j, i in enumerate(wanted):
        tops[i] = tuple(zip(ids[j][:ks[i]], values[j][:ks[i]]))
    return tops
