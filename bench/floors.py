"""Compute floors for the benchmarks: the matmul FLOPs of a Llama-family decoder's work, counted from its dimensions,
and the float32 GEMM rate of the model's own shapes measured on this machine; a phase's floor is FLOPs / rate, the
time no implementation computing the same products at that rate can go below.

    from floors import Dims, sequence_forward_flops, measure_gemm_rate
    dims = Dims.of(model.config)                     # any object with the Hugging Face config attribute names
    flops = 3 * sequence_forward_flops(dims, prompt_lengths, response_lengths)   # one training pass
    seconds = flops / measure_gemm_rate(dims, rows=256)

Counting (one multiply-add = 2 FLOPs; L layers, H hidden, I intermediate, Nh heads, Nkv KV heads, D head_dim,
V vocab; D is the config's explicit `head_dim` when it has one (Qwen3: 128 whatever H / Nh is), else H / Nh):

- linear layers, per token: 2 * L * (H*Nh*D [q] + 2*H*Nkv*D [k, v] + Nh*D*H [o] + 3*H*I [gate, up, down]);
- attention, per (query, key) pair: 2 * L * Nh * D for Q K^T plus as much for the weighted sum of V; only causal
  pairs of real tokens count (a query at position i sees i + 1 keys; in a sliding-window layer of window W,
  min(i + 1, W)), padding never does;
- LM head: 2 * H * V per token whose logits are needed (for scoring, the response positions only; in generation,
  one per sampled token); a critic's value head: 2 * H per scored token;
- backward = 2 x forward, so a training pass = 3 x its forward.

Embedding lookups, norms (the per-head q/k RMSNorm of Qwen3 and Gemma 3 too), rotary, softmax, sampling and
optimizer updates are not matmuls and are not counted. Mixture-of-experts MLPs are not modelled (the dense I is
counted).
A decode step's attention is a matmul of one query per row, bound by reading the cached keys and values rather
than by FLOPs: `decode_kv_bytes` counts those bytes, and `measure_read_bandwidth` the rate at which this machine
reads memory, for a floor of the attention's memory traffic.
`measure_gemm_rate` times every linear layer's GEMM and the LM head of one forward (weights of the model's shapes,
random, float32) for `rows` token rows at the current torch thread count: large `rows` approach the machine's
matmul peak; `rows` = the batch size gives the rate of a decode step, which streams all weights for a few rows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Dims:
    """The dimensions that set a Llama-family decoder's matmul work and its decode KV reads; `windows`: each
    layer's sliding window (None: full causal attention; empty: every layer full)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    windows: tuple[Optional[int], ...] = ()

    @classmethod
    def of(cls, config: Any) -> "Dims":
        """From a config with Hugging Face attribute names (astrai's `ModelConfig`, a transformers config): an
        explicit `head_dim` wins over H / Nh; sliding windows from `sliding_window` and `layer_types` (a layer
        kind "sliding_attention" is windowed; no `layer_types`: every layer, unless `use_sliding_window` is false,
        as Qwen2's configs say)."""
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(layers=config.num_hidden_layers, hidden=config.hidden_size,
                   intermediate=config.intermediate_size, heads=heads,
                   kv_heads=getattr(config, "num_key_value_heads", None) or heads, head_dim=head_dim,
                   vocab=config.vocab_size, windows=_layer_windows(config))

    def window(self, layer: int) -> Optional[int]:
        """Layer `layer`'s sliding window, None for full attention."""
        return self.windows[layer] if self.windows else None

    def attention_pairs(self, length: int, start: int = 0) -> int:
        """(query, key) pairs of the queries at positions start .. length - 1 of one sequence, summed over the
        layers (`causal_pairs` with each layer's window)."""
        if not any(self.windows):
            return self.layers * causal_pairs(length, start)
        return sum(causal_pairs(length, start, window=self.window(layer)) for layer in range(self.layers))

    def layer_weight_shapes(self) -> list[tuple[int, int]]:
        """(out, in) of one decoder layer's linear weights: q, k, v, o, gate, up, down."""
        h, i, q, kv = self.hidden, self.intermediate, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)]


def _layer_windows(config: Any) -> tuple[Optional[int], ...]:
    """Per-layer sliding windows of a config (see `Dims.of`); () when no layer is windowed."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return ()
    kinds = getattr(config, "layer_types", None)
    if kinds is None:
        return (int(window),) * config.num_hidden_layers
    windows = tuple(int(window) if kind == "sliding_attention" else None for kind in kinds)
    return windows if any(windows) else ()


def linear_flops_per_token(d: Dims) -> int:
    """FLOPs of every decoder layer's linear layers for one token."""
    return 2 * d.layers * sum(out * inp for out, inp in d.layer_weight_shapes())


def attention_flops(d: Dims, pairs: int, *, summed_over_layers: bool = False) -> int:
    """FLOPs of Q K^T and of the weighted sum of V over `pairs` (query, key) pairs in every layer (or, with
    `summed_over_layers`, over `pairs` pairs counted over all layers together, `Dims.attention_pairs`), all heads."""
    return 4 * (1 if summed_over_layers else d.layers) * d.heads * d.head_dim * pairs


def causal_pairs(length: int, start: int = 0, *, window: Optional[int] = None) -> int:
    """(query, key) pairs of causal attention for the queries at positions start .. length - 1 of a sequence of
    `length` real tokens (the query at position i sees keys 0 .. i, or its last `window` of them: min(i + 1, W))."""
    if not 0 <= start <= length:
        raise ValueError(f"causal_pairs: need 0 <= start ({start}) <= length ({length})")
    if window is None or window >= length:
        return (length * (length + 1) - start * (start + 1)) // 2
    ramp_end = max(min(length, window), start)  # queries start .. ramp_end - 1 see i + 1 keys, the rest W
    return (ramp_end * (ramp_end + 1) - start * (start + 1)) // 2 + window * (length - ramp_end)


def forward_flops(d: Dims, *, tokens: int, pairs: int, lm_head_tokens: int = 0, value_head_tokens: int = 0,
                  layer_pairs: Optional[int] = None) -> int:
    """FLOPs of one forward over `tokens` tokens with `pairs` attention pairs per layer (or `layer_pairs` summed
    over the layers, which then replaces it), the LM head on `lm_head_tokens` and a scalar value head on
    `value_head_tokens`."""
    attention = (attention_flops(d, layer_pairs, summed_over_layers=True) if layer_pairs is not None
                 else attention_flops(d, pairs))
    return (linear_flops_per_token(d) * tokens + attention
            + 2 * d.hidden * d.vocab * lm_head_tokens + 2 * d.hidden * value_head_tokens)


def sequence_forward_flops(d: Dims, prompt_lengths: Sequence[int], response_lengths: Sequence[int], *,
                           head: str = "lm") -> int:
    """FLOPs of one forward over prompt + response sequences (real tokens only) that scores the response tokens:
    `head="lm"` (log-probs: LM head on the R response positions) or `"value"` (a critic: value head on them)."""
    if head not in ("lm", "value"):
        raise ValueError(f"sequence_forward_flops: head must be 'lm' or 'value', got {head!r}")
    total = 0
    for p, r in zip(prompt_lengths, response_lengths, strict=True):
        heads = {"lm_head_tokens": r} if head == "lm" else {"value_head_tokens": r}
        total += forward_flops(d, tokens=p + r, pairs=0, layer_pairs=d.attention_pairs(p + r), **heads)
    return total


def generation_flops(d: Dims, prompt_lengths: Sequence[int], response_lengths: Sequence[int]) -> tuple[int, int]:
    """(prefill, decode) FLOPs of sampling `response_lengths[b]` tokens after each prompt with a KV cache: the prefill
    runs the prompt's P tokens (LM head on the last one, which samples the first response token); each of the R - 1
    decode steps runs one fed-back token at positions P .. P + R - 2 and samples the next."""
    prefill = decode = 0
    for p, r in zip(prompt_lengths, response_lengths, strict=True):
        prefill += forward_flops(d, tokens=p, pairs=0, layer_pairs=d.attention_pairs(p),
                                 lm_head_tokens=1 if r else 0)
        if r > 1:
            decode += forward_flops(d, tokens=r - 1, pairs=0, layer_pairs=d.attention_pairs(p + r - 1, p),
                                    lm_head_tokens=r - 1)
    return prefill, decode


def decode_kv_bytes(d: Dims, prompt_lengths: Sequence[int], response_lengths: Sequence[int], *,
                    element_size: int = 4) -> int:
    """Bytes of keys and values that the decode steps of `generation_flops` must read at least once: the step that
    feeds back a row's j-th response token (j = 1 .. R - 1) attends over its P + j cached positions, each holding
    a key and a value of Nkv * D elements of `element_size` bytes in every layer (a sliding-window layer reads only
    the last W of them). Real tokens only (an engine that pads a batch's rows to the longest reads more)."""
    positions = 0  # attended positions, summed over layers
    for p, r in zip(prompt_lengths, response_lengths, strict=True):
        if r > 1:
            positions += d.attention_pairs(p + r - 1, p)
    return positions * 2 * d.kv_heads * d.head_dim * element_size


def measure_read_bandwidth(nbytes: int = 256 * 2**20, *, repeats: int = 3) -> float:
    """Bytes/s of reading a float32 tensor of `nbytes` (far larger than the caches) once with `torch.sum` at the
    current torch thread count: the best of `repeats` timed passes after one untimed pass. A memory-bound kernel
    that reads that many bytes cannot run faster."""
    data = torch.ones(max(nbytes // 4, 1))
    best = float("inf")
    for attempt in range(repeats + 1):
        start = time.perf_counter()
        data.sum()
        if attempt:
            best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best


def measure_gemm_rate(d: Dims, rows: int, *, repeats: int = 3, lm_head: bool = True, seed: int = 0) -> float:
    """FLOP/s of one forward's GEMMs (each layer's q, k, v, o, gate, up, down and, with `lm_head`, the LM head) for
    `rows` token rows, float32, at the current torch thread count: the best of `repeats` timed passes after one
    untimed pass. Every layer has its own weights, so a pass streams the model's full weight size, as a forward
    does."""
    gen = torch.Generator().manual_seed(seed)
    layers = [[torch.randn(out, inp, generator=gen) for out, inp in d.layer_weight_shapes()]
              for _ in range(d.layers)]
    head = torch.randn(d.vocab, d.hidden, generator=gen) if lm_head else None
    inputs = {inp: torch.randn(rows, inp, generator=gen) for _, inp in d.layer_weight_shapes()}
    flops = linear_flops_per_token(d) * rows + (2 * d.hidden * d.vocab * rows if lm_head else 0)
    best = float("inf")
    with torch.no_grad():
        for attempt in range(repeats + 1):
            start = time.perf_counter()
            for weights in layers:
                for w in weights:
                    F.linear(inputs[w.shape[1]], w)
            if head is not None:
                F.linear(inputs[d.hidden], head)
            if attempt:
                best = min(best, time.perf_counter() - start)
    return flops / best


def floor_seconds(flops: float, rate: float) -> float:
    """Seconds of `flops` at `rate` FLOP/s."""
    return flops / rate
