"""Runs an `AutoRegressiveLM` over a packed, ragged batch of tokens against the paged KV cache.

One engine step = the new tokens of several sequences packed into one (N,) stream (prefill chunks of new requests
mixed with one decode token per running request, as in continuous batching, Yu et al. 2022 "Orca"). The runner calls
the model's own trunk (`LlamaTrunk.forward`) on that stream as one row of N tokens, with a `PagedAttention` as its
`astrai.models.AttentionInterface`: each layer's keys/values go into the paged cache and its queries read them
through the kernels of `astrai.kernels`. Every other piece (projections, rotary, norms, any MLP, dense or MoE) is
the training code itself, so a change to the model is made once.

CPU cost model (SmolLM2-135M, batch 32, one thread; see `bench/rollout.py`): a decode step is GEMM-bound, so the
engine trims what is not GEMM: `fuse_projections` stores q/k/v and gate/up weights in one tensor each (one GEMM per
group instead of three or two; the layers use them when present), rotary runs once over q and k together, and
logits land in a workspace buffer instead of a fresh multi-MB tensor per step, computed on CPU in vocabulary chunks
of `LOGITS_CHUNK` rows.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from astrai.kernels import AttentionMetadata, DenseDecodeCache, InferenceWorkspace, cpu_kernels, write_kv
from astrai.models.attention import LayerAttention, layer_attention

__all__ = ["PagedAttention", "PagedModelRunner", "StepBatch", "fuse_projections", "lm_logits", "soft_cap"]

LOGITS_CHUNK = 1024  # vocabulary rows of the LM head per GEMM

logger = logging.getLogger(__name__)
_said_no_kernel = False


def _say_without_kernel() -> None:
    """Say once per process (a warning; at debug level when ASTR_CPU_KERNELS turned it off) that CPU decode
    attention runs on the torch path, and why."""
    global _said_no_kernel
    if _said_no_kernel:
        return
    _said_no_kernel = True
    reason = cpu_kernels.unavailable_reason() or "it does not read this dtype"
    level = logging.DEBUG if "ASTR_CPU_KERNELS" in reason else logging.WARNING
    logger.log(level, "engine: the compiled CPU kernels (decode attention, norms, rotary, activations, sampling) "
               "are not used (%s); decoding takes the torch ops (measured on SmolLM2: the attention kernel is "
               "1.3x faster in bfloat16 and 1.04x in float32, the others 1.09-1.16x more; docs/kernels.md)", reason)


@dataclass
class StepBatch:
    """Host-side description of one step (Python lists; the runner makes the device tensors).

    Attributes:
        token_ids: N new token ids, packed sequence after sequence.
        positions: N absolute positions.
        slots: N flat cache slots (block * block_size + offset) where their keys/values go.
        qo_indptr: B + 1 cumulative offsets of each sequence's tokens in the packed stream.
        kv_lens: B cached lengths after this step.
        block_tables: B block-id lists (each covering kv_lens[b]).
        logit_rows: indices into the N tokens whose next-token logits are wanted.
        seq_ids: B sequence ids, distinct within one generation call (None: unknown; the dense decode cache of
            the torch backend is then not used).
    """

    token_ids: list[int]
    positions: list[int]
    slots: list[int]
    qo_indptr: list[int]
    kv_lens: list[int]
    block_tables: list[list[int]]
    logit_rows: list[int]
    seq_ids: Optional[list[int]] = None


class PagedAttention:
    """The `astrai.models.AttentionInterface` of one engine step: the N packed tokens (passed as one row, B = 1)
    write their keys/values into the paged cache at `slots` and attend through the attention `backend` (or, for
    decode-only steps of the torch backend, through the dense copies of a `DenseDecodeCache`).

    Args:
        workspace: the paged KV storage; meta: the step layout; slots: (N,) int64 flat cache slots.
        backend: an `astrai.kernels` attention backend; dense: the decode cache prepared for this step, or None.
        layers: the model's `LayerAttention` per layer (window and soft-cap reach the kernels; the scale is
            `meta.scale`, the same in every layer).
    """

    def __init__(self, workspace: InferenceWorkspace, meta: AttentionMetadata, slots: torch.Tensor, backend,
                 dense: Optional[DenseDecodeCache], layers: tuple[LayerAttention, ...]):
        self.workspace, self.meta, self.slots, self.backend, self.dense = workspace, meta, slots, backend, dense
        self.layers = layers

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (1, N, Nh, D), k/v (1, N, Nkv, D) -> (1, N, Nh, D)."""
        q, k, v = q[0], k[0], v[0]
        k_cache, v_cache = self.workspace.k_caches[layer_idx], self.workspace.v_caches[layer_idx]
        spec = self.layers[layer_idx]
        if self.dense is not None:
            self.dense.store(layer_idx, k, v, k_cache, v_cache, self.slots)
            return self.dense.attention(layer_idx, q, window=spec.window, softcap=spec.softcap)[None]
        write_kv(k_cache, v_cache, self.slots, k, v)
        return self.backend.attention(q, k_cache, v_cache, self.meta, window=spec.window,
                                      softcap=spec.softcap)[None]


class PagedModelRunner:
    """Forward of `model` (an `AutoRegressiveLM`, eval mode) over a `StepBatch`, reading/writing `workspace`.

    Args:
        model: the engine's inference copy.
        workspace: KV storage (L layers of (num_blocks, block_size, Nkv, D)).
        backend: an attention backend from `astrai.kernels.select_backend`.
        dense_decode: with the torch backend, keep a `DenseDecodeCache` so decode-only steps append to dense
            keys/values instead of gathering every sequence's blocks in every layer (same results; off for other
            backends, which read the pages in place, and with `graphs`).
        graphs: an `astrai.rollout.cuda_graphs.DecodeGraphs` over the same model and workspace, or None: the
            decode-only steps it serves run padded to a batch bucket from its static buffers (CUDA graphs on CUDA).
        flat: an `astrai.rollout.cpu_decode.FlatTrunk` of `model`, or None: the trunk's forward without module
            calls (the engine builds one for its CPU copy with the compiled kernels): bitwise the module forward,
            except its decode steps of a few rows in one compiled call, whose products sum in another order.
    """

    def __init__(self, model: torch.nn.Module, workspace: InferenceWorkspace, backend, *, dense_decode: bool = True,
                 graphs=None, flat=None):
        self.model, self.workspace, self.backend, self.graphs, self.flat = model, workspace, backend, graphs, flat
        self.decode_cache = (DenseDecodeCache(workspace) if dense_decode and backend.name == "torch"
                             and graphs is None else None)
        if self.decode_cache is not None and workspace.device.type == "cpu" and not self.decode_cache.kernel:
            _say_without_kernel()
        self.layers = layer_attention(model.config)
        self.scale = model.config.attention_scale

    def _metadata(self, batch: StepBatch, device: torch.device) -> AttentionMetadata:
        """Device tensors of the step layout (block tables padded with block 0, never read past kv_lens)."""
        width = max(len(t) for t in batch.block_tables)
        tables = [t + [0] * (width - len(t)) for t in batch.block_tables]
        q_lens = [batch.qo_indptr[i + 1] - batch.qo_indptr[i] for i in range(len(batch.kv_lens))]
        return AttentionMetadata(
            qo_indptr=batch.qo_indptr, kv_lens=batch.kv_lens,
            qo_indptr_t=torch.tensor(batch.qo_indptr, dtype=torch.int32, device=device),
            kv_lens_t=torch.tensor(batch.kv_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
            max_q=max(q_lens), max_kv=max(batch.kv_lens), scale=self.scale, scratch=self.workspace)

    def _dense_cache(self, batch: StepBatch, meta: AttentionMetadata) -> Optional[DenseDecodeCache]:
        """The decode cache, prepared for this step, when it can serve it (decode-only, known rows); else None."""
        if self.decode_cache is None:
            return None
        if meta.decode_only and batch.seq_ids is not None and self.decode_cache.begin_step(
                batch.seq_ids, batch.kv_lens, meta.block_tables, self.scale):
            return self.decode_cache
        self.decode_cache.invalidate()  # mixed or unknown steps change lengths behind the dense copy
        return None

    @torch.no_grad()
    def forward(self, batch: StepBatch) -> torch.Tensor:
        """Write the step's keys/values into the cache and return logits (len(logit_rows), V) in float32 (soft-capped
        as the model's forward does when `config.final_logit_softcapping` is set).

        The returned tensor may be a view of a workspace buffer (or of a CUDA graph's output): it is valid until the
        next `forward`.
        """
        if self.graphs is not None and self.graphs.serves(batch):
            return self.graphs.forward(batch)
        return soft_cap(self._logits(batch), self.model.config.final_logit_softcapping)

    def _logits(self, batch: StepBatch) -> torch.Tensor:
        """The LM head's float32 logits of `batch.logit_rows` (see `forward`)."""
        trunk = self.model.model
        device = trunk.embed_tokens.weight.device
        meta = self._metadata(batch, device)
        ids = torch.tensor(batch.token_ids, dtype=torch.long, device=device)
        positions = torch.tensor(batch.positions, dtype=torch.long, device=device)
        slots = torch.tensor(batch.slots, dtype=torch.long, device=device)
        attention = PagedAttention(self.workspace, meta, slots, self.backend, self._dense_cache(batch, meta),
                                   self.layers)
        if self.flat is not None:
            hidden = self.flat(ids, positions, attention)  # (N, H), final-normed
        else:
            hidden = trunk(ids[None], position_ids=positions[None], attention=attention)[0]
        rows = torch.tensor(batch.logit_rows, dtype=torch.long, device=device)
        return lm_logits(self.model, hidden.index_select(0, rows), self.workspace)


def lm_logits(model: torch.nn.Module, final: torch.Tensor, workspace: Optional[InferenceWorkspace] = None
              ) -> torch.Tensor:
    """float32 logits (R, V) of the LM head of `model` over final-normed hidden states `final` (R, H), not
    soft-capped. With `workspace`, float32 logits land in its reused "logits" buffer (valid until the next call);
    without, in a fresh tensor (what a CUDA graph capture needs: its output must not move)."""
    weight = model.lm_head.weight
    if final.dtype != torch.float32 or weight.dtype != torch.float32 or getattr(model.lm_head, "packs", None) is not None:
        return model.lm_head(final).float()  # half precision, or prepacked weights (`astrai.rollout.packed_linear`)
    num_rows, vocab = final.shape[0], weight.shape[0]
    if workspace is None:
        return torch.mm(final, weight.t())
    logits = workspace.scratch("logits", num_rows * vocab, torch.float32).view(num_rows, vocab)
    if final.device.type != "cpu":
        return torch.mm(final, weight.t(), out=logits)
    # On CPU the (V, H) head in row chunks: each chunk stays cache-resident during its GEMM, about 1.5x faster
    # than one (R, H) x (H, V) GEMM for R = 32, V = 49152 (measured with MKL, one thread).
    for start in range(0, vocab, LOGITS_CHUNK):
        stop = min(start + LOGITS_CHUNK, vocab)
        torch.mm(final, weight[start:stop].t(), out=logits[:, start:stop])
    return logits


def soft_cap(logits: torch.Tensor, cap: Optional[float]) -> torch.Tensor:
    """`cap * tanh(logits / cap)` in place (Gemma 2's final logit soft-capping); `logits` itself when `cap` is None."""
    return logits if cap is None else logits.div_(cap).tanh_().mul_(cap)


def _fuse(modules: list[torch.nn.Linear], name: str = "weight") -> torch.Tensor:
    """Concatenate the Linear parameters `name` (weights (out_i, H) or biases (out_i,)) into one tensor along dim 0
    and re-point every module's Parameter at its row block of it, so in-place copies into the Parameters fill the
    fused tensor."""
    fused = torch.cat([getattr(m, name).detach() for m in modules], dim=0)
    start = 0
    for m in modules:
        old = getattr(m, name)
        rows = old.shape[0]
        setattr(m, name, torch.nn.Parameter(fused[start:start + rows], requires_grad=old.requires_grad))
        start += rows
    return fused


@torch.no_grad()
def fuse_projections(model: torch.nn.Module) -> None:
    """Give each decoder layer of `model` (an inference-only `AutoRegressiveLM` copy) fused GEMM weights.

    Sets `self_attn.qkv_weight` ((Nh + 2 Nkv) * D, H) over q_proj/k_proj/v_proj (and `self_attn.qkv_bias` when
    all three have biases, as Qwen2's) and, for dense bias-free gated MLPs, `mlp.gate_up_weight` (2 I, H) over
    gate_proj/up_proj. The modules' Parameters become views of these tensors, so `named_parameters`, `state_dict`
    and `copy_weights` (in-place `copy_`) see and update the same memory; the layers' forwards use the fused tensors
    when set (same results, fewer GEMMs). Other layers (e.g. MoE MLPs) are left as they are. Idempotent. Do not move
    the model to another device afterwards (the views would be re-created).
    """
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        projections = [getattr(attn, name, None) for name in ("q_proj", "k_proj", "v_proj")]
        linear = all(isinstance(m, torch.nn.Linear) for m in projections)
        has_bias = {m.bias is not None for m in projections} if linear else set()
        if getattr(attn, "qkv_weight", None) is None and len(has_bias) == 1:  # all three alike
            if has_bias == {True}:
                attn.qkv_bias = _fuse(projections, "bias")
            attn.qkv_weight = _fuse(projections)
        pair = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj")]
        if getattr(mlp, "gate_up_weight", None) is None and hasattr(mlp, "down_proj") and all(
                isinstance(m, torch.nn.Linear) and m.bias is None for m in pair):
            mlp.gate_up_weight = _fuse(pair)
