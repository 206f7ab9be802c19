"""Runs an `AutoRegressiveLM` over a packed, ragged batch of tokens against the paged KV cache.

One engine step = the new tokens of several sequences packed into one (N,) stream (prefill chunks of new requests
mixed with one decode token per running request, as in continuous batching, Yu et al. 2022 "Orca"). The runner
walks the model's own modules (HF Llama attribute names: embed_tokens, layers[i].self_attn.{q,k,v,o}_proj,
input/post_attention_layernorm, mlp, norm, lm_head), so the weights are the engine's model's and any MLP (dense or
MoE) works; only attention is replaced by the paged kernels of `astrai.kernels`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from astrai.kernels import AttentionMetadata, InferenceWorkspace, apply_rotary, write_kv

__all__ = ["StepBatch", "PagedModelRunner"]


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
    """

    token_ids: list[int]
    positions: list[int]
    slots: list[int]
    qo_indptr: list[int]
    kv_lens: list[int]
    block_tables: list[list[int]]
    logit_rows: list[int]


class PagedModelRunner:
    """Forward of `model` (an `AutoRegressiveLM`, eval mode) over a `StepBatch`, reading/writing `workspace`.

    Args:
        model: the engine's inference copy.
        workspace: KV storage (L layers of (num_blocks, block_size, Nkv, D)).
        backend: an attention backend from `astrai.kernels.select_backend`.
    """

    def __init__(self, model: torch.nn.Module, workspace: InferenceWorkspace, backend):
        self.model, self.workspace, self.backend = model, workspace, backend
        cfg = model.config
        self.num_heads, self.num_kv_heads, self.head_dim = (cfg.num_attention_heads, cfg.num_key_value_heads,
                                                            cfg.head_dim)
        self.scale = self.head_dim ** -0.5

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
            max_q=max(q_lens), max_kv=max(batch.kv_lens), scale=self.scale)

    @torch.no_grad()
    def forward(self, batch: StepBatch) -> torch.Tensor:
        """Write the step's keys/values into the cache and return logits (len(logit_rows), V) in float32."""
        trunk = self.model.model
        device = trunk.embed_tokens.weight.device
        meta = self._metadata(batch, device)
        ids = torch.tensor(batch.token_ids, dtype=torch.long, device=device)
        positions = torch.tensor(batch.positions, dtype=torch.long, device=device)
        slots = torch.tensor(batch.slots, dtype=torch.long, device=device)
        h = trunk.embed_tokens(ids)  # (N, H)
        cos, sin = trunk.rotary_emb(positions[None], h.dtype)  # (1, 1, N, D)
        cos, sin = cos[0, 0, :, None], sin[0, 0, :, None]  # (N, 1, D)
        n = ids.shape[0]
        ws = self.workspace
        for layer_idx, layer in enumerate(trunk.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = apply_rotary(attn.q_proj(x).view(n, self.num_heads, self.head_dim), cos, sin)
            k = apply_rotary(attn.k_proj(x).view(n, self.num_kv_heads, self.head_dim), cos, sin)
            v = attn.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
            k_cache, v_cache = ws.k_caches[layer_idx], ws.v_caches[layer_idx]
            write_kv(k_cache, v_cache, slots, k, v)
            out = self.backend.attention(q, k_cache, v_cache, meta)
            h = h + attn.o_proj(out.reshape(n, self.num_heads * self.head_dim))
            h = h + layer.mlp(layer.post_attention_layernorm(h)[None])[0]
        rows = torch.tensor(batch.logit_rows, dtype=torch.long, device=device)
        return self.model.lm_head(trunk.norm(h[rows])).float()
