"""Dense decode cache: per-layer contiguous copies of the decoding sequences' keys/values (torch backend, CPU).

Why: the pure-torch paged decode (`paged_decode_attention`) copies every sequence's blocks into a dense tensor in
every layer of every step before attention, so on CPU a decode step reads the KV three times (gather read, gather
write, attention read) and the gather costs about a third of a batch-32 SmolLM2 step. This cache keeps those
dense copies between steps instead: when a step decodes the same sequences as the previous one, each one token
longer, it only appends the new key/value of each row and attends over a view of the buffer (one read). When the
set of sequences changes (a row joins or stops) or a row outgrows the buffer's capacity, it rebuilds from the
paged cache, which stays the source of truth (prefix cache, copy-on-write sharing and later rebuilds read it).

Attention over the copies, on CPU: the compiled kernel of `cpu_kernels` (one call per layer, the copies in the
workspace's dtype, float32 arithmetic) where it builds; else the copies are float32 whatever the engine's dtype
(bfloat16 / float16 values convert exactly) and attention is the float32 matmul path below: for a bfloat16 engine
that was 1.7x faster than SDPA's fused bfloat16 kernel on the same values and closer to the float32 reference
(B = 32, Nkv = 3, G = 3, D = 64, 200 positions, AVX-512 BF16 CPU without AMX: 385 vs 674 us a layer with one
thread, 221 vs 383 us with two; max error against float32 attention 1.9e-3 vs 2.1e-3, the bf16 output rounding),
at twice the bytes of the half-precision copies. On other devices the copies keep the workspace dtype (SDPA).

Layout per layer: values (B, Nkv, capacity, D), row b = the step's b-th sequence, position p = its p-th token; keys
transposed, (B, Nkv, D, capacity), for the CPU kernel and in float32, else (SDPA) like the values. Head-major, so
each (row, kv head) is one contiguous matrix: attention reads it about 25% faster than the token-major paged layout
(SDPA, 30 layers at B = 32, 250 positions, one thread: 59 vs 77 ms). float32 keys are stored transposed so that the
scores are a plain (G, D) x (D, K) product with K contiguous, about 20% faster than multiplying by a transposed
(K, D) view (30 layers at B = 32, 200 positions: 15.8 vs 19.4 ms with two threads, 28.7 vs 36.0 with one).
Half-precision attention without the kernel (other devices) goes through SDPA, whose fused kernel wants D
contiguous: there keys keep the (K, D) layout, because a transposed store cost a (B, Nkv, K, D) copy per layer and
step (as long as SDPA itself: bf16, B = 32, K = 150, one thread, about 0.45 ms each) and an append that touched one
cache line per element. Buffers come from the `InferenceWorkspace` scratch space, so they are reused across steps
and released with the workspace.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from . import cpu_kernels
from .paged_attention import gather_kv, write_kv
from .workspace import InferenceWorkspace

__all__ = ["DenseDecodeCache"]

DEFAULT_MIN_BYTES = 256 * 2**20


class DenseDecodeCache:
    """Incrementally maintained dense keys/values of the sequences being decoded.

    Args:
        workspace: the paged KV storage (source of truth) whose scratch space holds the dense buffers.
        max_bytes: the dense buffers of all layers may take at most this many bytes; beyond it `begin_step`
            declines and the caller uses the paged path (None: twice the paged cache's bytes, four times for
            float32 copies of a half-precision cache, at least `DEFAULT_MIN_BYTES`).
        headroom: extra positions allocated per row on a rebuild, so that many steps append before the next one.

    Usage per decode step: `begin_step(...)`; if it returned True, for each layer `store(layer, k, v, k_pages,
    v_pages, slots)` (or `append(layer, k, v)` after the keys/values are written to the paged cache), then
    `attention(layer, q)`.
    """

    def __init__(self, workspace: InferenceWorkspace, *, max_bytes: int | None = None, headroom: int = 64):
        self.workspace = workspace
        self.max_bytes = max_bytes
        self.headroom = headroom
        self.seq_ids: list[int] | None = None
        self.kv_lens: list[int] = []
        self.capacity = 0
        self.rebuilds = 0
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []
        self._rows = self._positions = self._mask = self._bias = self._lens = self._lens_i32 = None
        self._windowed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._scale = 1.0
        # On CPU the compiled kernel (`cpu_kernels`) reads copies in the workspace's dtype; without it the copies
        # are float32 on CPU (module doc); elsewhere they keep the workspace's dtype.
        cpu = workspace.device.type == "cpu"
        self.kernel = cpu and cpu_kernels.supports(workspace.dtype)
        self.dtype = torch.float32 if cpu and not self.kernel else workspace.dtype
        # The kernel and the float32 matmul path read keys transposed, (D, K); half precision (SDPA) keeps (K, D).
        self.keys_transposed = self.kernel or self.dtype == torch.float32

    def invalidate(self) -> None:
        """Forget the cached rows (the next `begin_step` rebuilds)."""
        self.seq_ids = None

    def begin_step(self, seq_ids: Sequence[int], kv_lens: Sequence[int], block_tables: torch.Tensor,
                   scale: float) -> bool:
        """Prepare rows for a decode-only step: row b must hold sequence `seq_ids[b]`'s first `kv_lens[b] - 1`
        tokens (the step's own token is added by `append`).

        Args:
            seq_ids: B distinct sequence ids, stable across the steps of one generation call.
            kv_lens: B cached lengths INCLUDING this step's token (each >= 1).
            block_tables: (B, max_blocks) int block tables of the paged cache.
            scale: softmax scale of the attention.

        Returns:
            False when the dense buffers would exceed `max_bytes` (nothing is cached; use the paged path).
        """
        ws = self.workspace
        seq_ids, kv_lens = list(seq_ids), list(kv_lens)
        num_rows, longest = len(seq_ids), max(kv_lens)
        same_rows = (self.seq_ids == seq_ids and longest <= self.capacity
                     and all(new == old + 1 for new, old in zip(kv_lens, self.kv_lens)))
        if not same_rows:
            bs = ws.block_size
            capacity = -(-(longest + self.headroom) // bs) * bs
            per_layer = num_rows * capacity * ws.num_kv_heads * ws.head_dim
            element = torch.empty((), dtype=self.dtype).element_size()
            widening = element // torch.empty((), dtype=ws.dtype).element_size()  # 2 for float32 copies of bf16
            limit = (self.max_bytes if self.max_bytes is not None
                     else max(2 * widening * ws.nbytes, DEFAULT_MIN_BYTES))
            if 2 * ws.num_layers * per_layer * element > limit:
                self.invalidate()
                return False
            self._rebuild(num_rows, capacity, [n - 1 for n in kv_lens], block_tables)
            self.capacity = capacity
        self.seq_ids, self.kv_lens, self._scale = seq_ids, kv_lens, scale
        device = ws.device
        self._rows = torch.arange(num_rows, device=device)
        lens = torch.tensor(kv_lens, device=device)
        self._positions = lens - 1
        if self.kernel:  # the kernel reads the lengths; no mask
            self._lens_i32 = lens.to(torch.int32)
        else:
            past = torch.arange(longest, device=device)[None, :] >= lens[:, None]
            self._mask, self._bias = self._mask_and_bias(past)
        self._lens, self._windowed = lens, {}
        return True

    @staticmethod
    def _mask_and_bias(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, K) bool of keys a row must not see -> SDPA's (B, 1, 1, K) mask (True = attend) and the additive
        float32 bias (-inf where hidden)."""
        bias = torch.zeros(hidden.shape, device=hidden.device).masked_fill_(hidden, float("-inf"))
        return ~hidden[:, None, None, :], bias[:, None, None, :]

    def _masks(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's (mask, bias) for a layer with sliding `window` (None: all of each row's keys), made once per
        step and window: a row of length n sees keys [n - window, n)."""
        if window is None or window >= self._bias.shape[-1]:
            return self._mask, self._bias
        if window not in self._windowed:
            keys = torch.arange(self._bias.shape[-1], device=self._lens.device)[None, :]
            hidden = (keys >= self._lens[:, None]) | (keys < self._lens[:, None] - window)
            self._windowed[window] = self._mask_and_bias(hidden)
        return self._windowed[window]

    def _rebuild(self, num_rows: int, capacity: int, cached: list[int], block_tables: torch.Tensor) -> None:
        """Copy each row's first `cached[b]` tokens of every layer from the paged cache into fresh dense rows."""
        ws = self.workspace
        bs, nkv, d = ws.block_size, ws.num_kv_heads, ws.head_dim
        numel = num_rows * capacity * nkv * d
        keys = [ws.scratch(f"dense_k{i}", numel, self.dtype) for i in range(ws.num_layers)]
        self._keys = [k.view(num_rows, nkv, d, capacity).transpose(-1, -2) if self.keys_transposed
                      else k.view(num_rows, nkv, capacity, d) for k in keys]  # indexed (B, Nkv, cap, D) either way
        self._values = [ws.scratch(f"dense_v{i}", numel, self.dtype).view(num_rows, nkv, capacity, d)
                        for i in range(ws.num_layers)]
        cols = -(-max(cached) // bs)
        for keys, values in zip(self._keys, self._values):  # masked positions must hold finite numbers (0 * NaN)
            keys[:, :, cols * bs:].zero_()
            values[:, :, cols * bs:].zero_()
        if cols:
            staging = ws.scratch("dense_staging", num_rows * cols * bs * nkv * d, ws.dtype)
            for keys, pages in zip(self._keys, ws.k_caches):
                keys[:, :, :cols * bs].copy_(gather_kv(pages, block_tables, cols * bs, out=staging))
            for values, pages in zip(self._values, ws.v_caches):
                values[:, :, :cols * bs].copy_(gather_kv(pages, block_tables, cols * bs, out=staging))
        self.rebuilds += 1

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
              slots: torch.Tensor) -> None:
        """`write_kv(k_pages, v_pages, slots, k, v)` then `append(layer, k, v)`: this step's keys/values k, v
        (B, Nkv, D) into the paged cache and the dense copies; one compiled call where the kernel keeps the copies
        (`cpu_kernels.store_kv`, same bits)."""
        if self.kernel and k.dtype == v.dtype == self.dtype == k_pages.dtype and k.stride(-1) == v.stride(-1) == 1 \
                and k.stride(-2) == v.stride(-2) == k.shape[-1]:
            keys = self._keys[layer].transpose(-1, -2)  # (B, Nkv, D, cap), contiguous
            cpu_kernels.store_kv_nocheck(k, v, slots, k_pages, v_pages, self._positions, keys, self._values[layer])
            return
        write_kv(k_pages, v_pages, slots, k, v)
        self.append(layer, k, v)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store this step's keys/values k, v (B, Nkv, D) of every row at its position kv_lens[b] - 1."""
        keys = self._keys[layer].transpose(1, 2)  # (B, cap, Nkv, D) views
        values = self._values[layer].transpose(1, 2)
        keys.index_put_((self._rows, self._positions), k.to(keys.dtype))
        values.index_put_((self._rows, self._positions), v.to(values.dtype))

    def attention(self, layer: int, q: torch.Tensor, *, window: int | None = None,
                  softcap: float | None = None) -> torch.Tensor:
        """q (B, Nh, D), one query per row -> (B, Nh, D): softmax attention over each row's kv_lens[b] keys (its
        last `window` of them for a sliding layer; scores soft-capped as softcap * tanh(s / softcap) when given),
        grouped-query when Nh > Nkv, reading the dense buffers in place.

        In float32, two batched matmuls around a softmax (scores (B, Nkv, G, K), G = Nh / Nkv) rather than
        `scaled_dot_product_attention`: with one query per row the fused CPU kernel gains nothing from its tiling
        and was about 20% slower (30 layers at B = 32, 200 positions, two threads: 22.5 vs 17.5 ms per step).
        On CPU the copies are float32 for every engine dtype (module doc), so this path serves bfloat16 and float16
        engines too (q upcast, the output cast back to q's dtype). Half-precision copies (other devices) go through
        SDPA, which accumulates and normalises in float32 as the paged path does (a bf16 softmax would change sampled
        tokens); with a soft-cap they are upcast to the float32 path instead.

        Where the compiled CPU kernel is available (`cpu_kernels`), it does all of it in one call per layer, reading
        the copies in the workspace's dtype and computing in float32 (its module doc has the measurements)."""
        if self.kernel:
            rows, heads, dim = q.shape
            query = q if q.dtype == self.dtype and q.stride(-1) == 1 and q.stride(1) == dim else \
                q.to(self.dtype).contiguous()
            out = cpu_kernels.dense_decode_attention(query, self._keys[layer].transpose(-1, -2), self._values[layer],
                                                     self._lens_i32, self._scale, window=window, softcap=softcap)
            return out.to(q.dtype)
        mask, bias = self._masks(window)
        longest = bias.shape[-1]
        compute = self.dtype if softcap is None else torch.float32
        keys = self._keys[layer][:, :, :longest].to(compute)  # (B, Nkv, K, D) view
        values = self._values[layer][:, :, :longest].to(compute)
        rows, heads, dim = q.shape
        # The G = Nh / Nkv query heads of a kv head act as G query positions of that head (no causal mask in
        # decode), so each kv head's keys/values are read once rather than once per query head.
        grouped = q.to(compute).view(rows, keys.shape[1], heads // keys.shape[1], dim)
        if compute != torch.float32:  # half-precision keys are stored (K, D): what SDPA's fused kernel reads
            out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=self._scale)
            return out.reshape(rows, heads, dim)
        scores = torch.matmul(grouped, keys.transpose(-1, -2))  # (B, Nkv, G, K); float32 keys are stored (D, K)
        scores.mul_(self._scale)
        if softcap is not None:
            scores = scores.div_(softcap).tanh_().mul_(softcap)
        scores.add_(bias)  # -inf past each row's length (and before its window)
        out = torch.matmul(torch.softmax(scores, dim=-1), values).reshape(rows, heads, dim)
        return out.to(q.dtype)
