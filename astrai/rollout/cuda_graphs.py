"""Decode steps padded to batch-size buckets and replayed as CUDA graphs (`rollout.cuda_graphs`).

Why: a small model's decode step is a few hundred microseconds of HBM traffic (a 0.5B model in bfloat16 reads ~1 GB
per step: ~0.3 ms at 4.8 TB/s), while launching its ~15 kernels per layer one by one from Python costs more than
that. A CUDA graph records the step's kernels once and replays them with one launch. A graph replays fixed shapes
at fixed addresses, so:

- the decode batch of B rows is padded up to the next bucket of `decode_buckets` (1, 2, 4, 8, ..., the smallest
  power of two >= max_num_seqs); every bucket has its own graph, captured the first time a step needs it (after
  an eager warm-up run that compiles the Triton kernels), all sharing one graph memory pool;
- the step's inputs live in static buffers, sized for the largest bucket: token ids, positions, KV slots and
  lengths (one int64 (4, rows) tensor, copied from the host in one transfer per step) and the block tables
  ((rows, W) int32, W = the longest sequence's block count; only the step's current width is copied);
- padded rows (B .. bucket - 1) are token 0 at position 0 with one cached position in a scratch block that the
  block pool never hands out (the workspace has one block more than the pool): they write their key/value there
  and attend to it alone, so no real block changes, and their logits are dropped (the step returns rows :B).

Only decode-only steps (one token per sequence, every row sampling) with B <= the largest bucket are served; steps
with prefill chunks, and larger batches, run eagerly as before. On a device other than CUDA nothing is captured:
the padded batch runs eagerly through the same code (the CPU tests check its tokens against the unpadded path), so
`cuda_graphs=True` on CPU is allowed and only pads. On CUDA it needs the Triton attention backend (its decode
kernel's grid is fixed by the bucket and it reads lengths and block tables from device memory); the torch
reference sizes its gather from host-side lengths every step and is refused, flash-attn's capture is untested
here and refused, and so is a mixture-of-experts model (its routing syncs with the host).

The graphs point at the workspace's KV storage and the model's weights: `load_weights` copies into the same
tensors (the graphs stay valid); `sleep` frees the KV storage, so the engine drops its graphs there and captures
them again after `wake`, bucket by bucket as steps need them.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch

from astrai.kernels import AttentionMetadata, BackendUnavailableError, InferenceWorkspace
from astrai.models.attention import layer_attention
from astrai.rollout.model_runner import PagedAttention, StepBatch, lm_logits, soft_cap

LOG = logging.getLogger("astrai.rollout")

__all__ = ["DecodeGraphs", "backend_for_graphs", "check_cuda_graphs", "cuda_graphs_unavailable_reason",
           "decode_buckets"]


def decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Batch sizes that get a graph: 1, 2, 4, ... up to the smallest power of two >= `max_num_seqs`."""
    buckets = [1]
    while buckets[-1] < max_num_seqs:
        buckets.append(2 * buckets[-1])
    return tuple(buckets)


def cuda_graphs_unavailable_reason(device: torch.device, backend_name: str, config) -> Optional[str]:
    """None when decode steps on `device` with attention backend `backend_name` and model `config` (a
    `ModelConfig`) can be captured (any device but CUDA: nothing is captured, the padded batch runs eagerly), else
    a one-line reason naming `rollout.cuda_graphs`."""
    if getattr(config, "num_local_experts", 0):
        return "rollout.cuda_graphs: a mixture-of-experts model cannot be captured (its routing syncs with the host)"
    if torch.device(device).type != "cuda" or backend_name == "triton":
        return None
    why = ("it sizes its gather from host-side lengths every step" if backend_name == "torch"
           else "its capture is untested")
    return (f"rollout.cuda_graphs needs the triton attention backend on CUDA, got {backend_name} ({why}); set "
            "rollout.attention_backend to triton or auto")


def backend_for_graphs(requested: Optional[str], device: torch.device) -> Optional[str]:
    """The attention backend an engine with CUDA graphs asks for: `requested` (None: `ASTR_BACKEND`), except that
    `auto` on CUDA becomes `triton`, the backend whose decode kernel is captured."""
    name = (requested or os.environ.get("ASTR_BACKEND") or "auto").strip().lower()
    return "triton" if name == "auto" and torch.device(device).type == "cuda" else requested


def check_cuda_graphs(device: torch.device, backend_name: str, config) -> None:
    """Raise `BackendUnavailableError` with `cuda_graphs_unavailable_reason` when there is one."""
    reason = cuda_graphs_unavailable_reason(device, backend_name, config)
    if reason is not None:
        raise BackendUnavailableError(reason)


class DecodeGraphs:
    """Decode-only steps of one engine, padded to a bucket and run from static buffers (see the module docstring).

    Args:
        model: the engine's inference copy (`AutoRegressiveLM`, fused projections).
        workspace: its KV storage, with block `scratch_block` outside the block pool.
        backend: the attention backend (`TritonBackend` on CUDA; any on other devices).
        buckets: batch sizes, increasing (`decode_buckets`).
        scratch_block: the block padded rows write to and read.
        capture: record and replay CUDA graphs (True on CUDA); False runs the same padded step eagerly.

    `forward(batch)` returns float32 logits (B, V), soft-capped as the model's forward does: a view of the bucket's
    output, valid until the next `forward`.
    """

    def __init__(self, model: torch.nn.Module, workspace: InferenceWorkspace, backend, *, buckets: tuple[int, ...],
                 scratch_block: int, capture: bool):
        self.model, self.workspace, self.backend = model, workspace, backend
        self.buckets, self.capture, self.scratch_block = tuple(buckets), capture, scratch_block
        config = model.config
        self.config, self.scale = config, config.attention_scale
        self.layers = layer_attention(config)
        rows, device, bs = self.buckets[-1], workspace.device, workspace.block_size
        self.width = min(-(-config.max_position_embeddings // bs), workspace.num_blocks)
        self.pad_row = (0, 0, scratch_block * bs, 1)  # token, position, slot, cached length of a padded row
        pin = device.type == "cuda"
        # flat host staging, viewed contiguous at each step's size, so each transfer is one asynchronous copy
        self.host = torch.empty(4 * rows, dtype=torch.long, pin_memory=pin)
        self.host_tables = torch.empty(rows * self.width, dtype=torch.int32, pin_memory=pin)
        self.inputs = torch.tensor([self.pad_row] * rows, dtype=torch.long, device=device).t().contiguous()
        self.kv_lens = torch.ones(rows, dtype=torch.int32, device=device)
        self.qo_indptr = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self.tables = torch.full((rows, self.width), scratch_block, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.kv_address = workspace.k_caches[0].data_ptr()
        self.replays = 0
        self.capture_error: Optional[str] = None  # why capturing failed (the steps then run eagerly)

    @property
    def valid(self) -> bool:
        """False once the workspace's KV storage was released or replaced (the graphs would read freed memory)."""
        return self.workspace.allocated and self.workspace.k_caches[0].data_ptr() == self.kv_address

    def serves(self, batch: StepBatch) -> bool:
        """True for a decode-only step (one token and one sampled row per sequence) of at most the largest bucket."""
        rows = len(batch.kv_lens)
        return len(batch.token_ids) == rows == len(batch.logit_rows) and rows <= self.buckets[-1]

    def bucket(self, rows: int) -> int:
        """The smallest bucket >= `rows`."""
        return next(b for b in self.buckets if b >= rows)

    @torch.no_grad()
    def forward(self, batch: StepBatch) -> torch.Tensor:
        """Logits (B, V) float32 of a step `serves` accepted: pad to its bucket, fill the static inputs, replay the
        bucket's graph (capturing it first when new) or run the padded step eagerly."""
        rows = len(batch.kv_lens)
        bucket = self.bucket(rows)
        if self.capture and bucket not in self.graphs:
            try:
                self._capture(bucket)
            except Exception as exc:  # noqa: BLE001 - never fail a rollout over a capture: run the steps eagerly
                self.capture, self.capture_error = False, f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
                LOG.warning("rollout.cuda_graphs: capturing the decode step of batch %d failed (%s); decode steps "
                            "run eagerly from now on", bucket, self.capture_error)
        width = max(len(t) for t in batch.block_tables)
        host = self.host[:4 * bucket].view(4, bucket)
        host[:, :rows] = torch.tensor([batch.token_ids, batch.positions, batch.slots, batch.kv_lens])
        host[:, rows:] = torch.tensor(self.pad_row)[:, None]
        flat = [self.scratch_block] * (bucket * width)
        for row, table in enumerate(batch.block_tables):
            flat[row * width:row * width + len(table)] = table
        tables = self.host_tables[:bucket * width].view(bucket, width)
        tables.copy_(torch.tensor(flat, dtype=torch.int32).view(bucket, width))
        self.inputs[:, :bucket].copy_(host, non_blocking=True)
        self.tables[:bucket, :width].copy_(tables, non_blocking=True)
        if self.capture:
            graph, out = self.graphs[bucket]
            graph.replay()
        else:
            out = self._step(bucket, width, max(batch.kv_lens))
        self.replays += 1
        return out[:rows]

    def _step(self, bucket: int, width: int, max_kv: int) -> torch.Tensor:
        """The padded step on the static inputs of the first `bucket` rows: keys/values written at their slots,
        logits (bucket, V) float32 in a fresh tensor. Only device work (what a graph records); `width` and `max_kv`
        bound the block tables and lengths (the torch backend sizes its gather from them)."""
        ids, positions, slots = self.inputs[0, :bucket], self.inputs[1, :bucket], self.inputs[2, :bucket]
        kv_lens = self.kv_lens[:bucket]
        kv_lens.copy_(self.inputs[3, :bucket])
        meta = AttentionMetadata(qo_indptr=list(range(bucket + 1)), kv_lens=[1] * bucket,
                                 qo_indptr_t=self.qo_indptr[:bucket + 1], kv_lens_t=kv_lens,
                                 block_tables=self.tables[:bucket, :width], max_q=1, max_kv=max_kv, scale=self.scale,
                                 scratch=None if self.capture else self.workspace)
        attention = PagedAttention(self.workspace, meta, slots, self.backend, None, self.layers)
        hidden = self.model.model(ids[None], position_ids=positions[None], attention=attention)[0]
        return soft_cap(lm_logits(self.model, hidden), self.config.final_logit_softcapping)

    def _capture(self, bucket: int) -> None:
        """Record the graph of `bucket` after two eager warm-up runs on a side stream (Triton compiles, cuBLAS picks
        its kernels), all rows padded, so that neither writes a real block."""
        self.inputs[:, :bucket].copy_(torch.tensor(self.pad_row, device=self.inputs.device)[:, None])
        self.tables[:bucket].fill_(self.scratch_block)
        max_kv = self.width * self.workspace.block_size
        stream = torch.cuda.Stream(self.inputs.device)
        stream.wait_stream(torch.cuda.current_stream(self.inputs.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step(bucket, self.width, max_kv)
        torch.cuda.current_stream(self.inputs.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._step(bucket, self.width, max_kv)
        self.pool = graph.pool()
        self.graphs[bucket] = (graph, out)
