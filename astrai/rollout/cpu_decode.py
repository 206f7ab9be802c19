"""The CPU engine's trunk forward without module calls (`FlatTrunk`), and the decode steps of a few rows in one
compiled call.

Why: at a decode step of one row, SmolLM2-135M's 121 GEMMs stream its weights from memory and everything else is
glue: 30 layers of `nn.Module.__call__` (seven modules a layer), views, slices, allocations and the ctypes calls of
the compiled pieces, whose code and data the streamed weights keep evicting from the caches. On a 2-core AMD EPYC
(bfloat16, 2 threads) that glue made a 21.5 ms step where the products alone take about 13 ms (measured by
stubbing them out: the rest ran in 3.3 ms, and cost 5-8 ms beside them); vLLM's CPU build compiles it away
(inductor), which is where its batch-1 lead came from (issue 44).

`FlatTrunk` runs the computation of `LlamaTrunk.forward` over the layers of the engine's inference copy:

- every step (prefill chunks, decode of any batch): one flat Python loop over each layer's tensors, looked up once
  (weights are updated in place by `load_weights`, so the references stay valid), calling the GEMMs
  (`PrepackedWeights.linear`) and the compiled pieces of `astrai.kernels.cpu_kernels` directly. It mirrors
  `astrai.models.layers` (`DecoderLayer`, `Attention`, `MLP`) operation by operation: bitwise the module forward.
- a decode step of at most `TOKEN_ROWS` rows served by the dense decode cache: `cpu_kernels.decode_token`, every
  layer in one C call (`cpu_decode.c`: the same pieces in the same order and rounding, its products by
  `cpu_gemv.c`, which streams each weight row once and is faster than oneDNN's products at one and two rows). The
  results differ from the module forward only by the products' sum order (float32: about 1e-5 in a log-prob;
  bfloat16 and float16: the rounding of an intermediate now and then flips a last bit, which the layers carry on,
  as the compiled pieces already did: up to 0.05 in a log-prob on the test models, and a near-tie of greedy tokens
  can go the other way).

It serves the copies `use_cpu_kernels` set up (CPU, compiled kernels, fused q/k/v and gate/up weights); any other
layer kind (MoE MLPs, unfused projections, tensor-parallel shards) keeps the module forward (`FlatTrunk.build`
returns None). A change to the layers of `astrai.models.layers` must be made here and in `cpu_decode.c` too:
tests/test_cpu_decode.py compares both paths with the module forward on every family's test shape in float32 and
bfloat16, and fails until it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from astrai.kernels import cpu_kernels
from astrai.models.layers import MLP, Attention, DecoderLayer, RMSNorm

__all__ = ["FlatTrunk", "TOKEN_ROWS"]

TOKEN_ROWS = 8
"""Decode steps of at most this many rows go through the one compiled call (`cpu_kernels.decode_token`): measured on
SmolLM2-135M (2-core AMD EPYC, 2 threads, 128 tokens a row, the same engine switched call by call) it was 1.4-1.5x
the flat loop at 1 and 2 rows, 1.1-1.2x at 3 and 4, and with the register tiles of `cpu_gemv.c` 1.00-1.06x at 8
rows in bfloat16 and 1.02-1.08x in float32 (medians of two and four calls a side), from 12 rows even or behind in one
dtype or the other (docs/kernels.md)."""


@dataclass(frozen=True)
class _Norm:
    """One RMSNorm's weight (a view of the copy's Parameter), epsilon and form (Gemma's unit offset)."""

    weight: torch.Tensor
    eps: float
    unit_offset: bool

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., H) -> (..., H), as `RMSNorm.forward` with the compiled kernel."""
        return cpu_kernels.rmsnorm_nocheck(x, self.weight, self.eps, self.unit_offset)


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's tensors and sizes (views of the engine copy's Parameters)."""

    index: int
    input_norm: _Norm
    post_attention_norm: _Norm
    pre_feedforward_norm: Optional[_Norm]  # sandwich norms (Gemma 2/3) or None
    post_feedforward_norm: Optional[_Norm]
    q_norm: Optional[_Norm]
    k_norm: Optional[_Norm]
    qkv_weight: torch.Tensor
    qkv_bias: Optional[torch.Tensor]
    o_weight: torch.Tensor
    o_bias: Optional[torch.Tensor]
    gate_up_weight: torch.Tensor
    down_weight: torch.Tensor
    down_bias: Optional[torch.Tensor]
    heads: int
    kv_heads: int
    head_dim: int
    gelu: bool
    local_rotary: bool  # a sliding layer with its own rotary table (Gemma 3)


def _norm(module: RMSNorm) -> _Norm:
    """The `_Norm` of an RMSNorm module."""
    return _Norm(module.weight, float(module.eps), bool(module.unit_offset))


class FlatTrunk:
    """`LlamaTrunk.forward(ids[None], position_ids=positions[None], attention=attention)[0]` for the engine's CPU
    inference copy, without module calls (module doc).

    Build with `FlatTrunk.build(model, linear)`; call with ids (N,) long, positions (N,) long and the step's
    `AttentionInterface` (`PagedAttention`), returning the final-normed hidden states (N, H) in the copy's dtype.
    """

    def __init__(self, model: torch.nn.Module, layers: list[_Layer], linear: Callable):
        """Use `build` (it checks the layers); this sets up the one-call path's structs and scratch for
        `TOKEN_ROWS` rows where the layers allow it."""
        self.trunk = model.model
        self.layers = layers
        self.final_norm = _norm(self.trunk.norm)
        self.linear = linear
        self.local = any(layer.local_rotary for layer in layers)
        config, first = model.config, layers[0]
        norms = [n for layer in layers for n in (layer.input_norm, layer.post_attention_norm,
                                                  layer.pre_feedforward_norm, layer.post_feedforward_norm,
                                                  layer.q_norm, layer.k_norm) if n is not None]
        dtype = first.qkv_weight.dtype
        # One token through every layer in one compiled call (`cpu_kernels.decode_token`) where the layers agree on
        # the sizes and norm options the call takes once.
        self.token_call = (all(n.eps == norms[0].eps and n.unit_offset == norms[0].unit_offset for n in norms)
                           and len({(la.heads, la.kv_heads, la.head_dim, la.gate_up_weight.shape[0]) for la in layers})
                           == 1 and all(t.is_contiguous() for la in layers for t in (
                               la.qkv_weight, la.o_weight, la.gate_up_weight, la.down_weight)))
        self._step = self._layer_structs = self._scratch = None
        self.token_rows = TOKEN_ROWS  # the scratch is sized for this many rows
        if self.token_call:
            intermediate = first.gate_up_weight.shape[0] // 2
            self._step = cpu_kernels.DecodeStep(
                layers=len(layers), H=config.hidden_size, Nh=first.heads, Nkv=first.kv_heads, D=first.head_dim,
                I=intermediate, dtype=cpu_kernels.DTYPE_CODES[dtype], unit_offset=int(norms[0].unit_offset),
                eps=norms[0].eps, scale=config.attention_scale)
            self._scratch = torch.empty(cpu_kernels.decode_scratch_bytes(
                self.token_rows, config.hidden_size, first.heads, first.kv_heads, first.head_dim, intermediate,
                dtype), dtype=torch.uint8)
            self._layer_structs = (cpu_kernels.DecodeLayer * len(layers))()
            address = lambda t: None if t is None else t.data_ptr()  # noqa: E731
            for struct, la in zip(self._layer_structs, layers):
                for field, norm in (("input_norm", la.input_norm), ("post_attention_norm", la.post_attention_norm),
                                    ("pre_feedforward_norm", la.pre_feedforward_norm),
                                    ("post_feedforward_norm", la.post_feedforward_norm), ("q_norm", la.q_norm),
                                    ("k_norm", la.k_norm)):
                    setattr(struct, field, None if norm is None else norm.weight.data_ptr())
                for field in ("qkv_weight", "qkv_bias", "o_weight", "o_bias", "gate_up_weight", "down_weight",
                              "down_bias"):
                    setattr(struct, field, address(getattr(la, field)))
                spec = config.layer_window(la.index), config.attn_logit_softcapping
                struct.window, struct.softcap = spec[0] or 0, spec[1] or 0.0
                struct.local_rotary, struct.gelu = int(la.local_rotary), int(la.gelu)

    @classmethod
    def build(cls, model: torch.nn.Module, linear: Optional[Callable] = None) -> Optional["FlatTrunk"]:
        """The flat forward of `model` (an `AutoRegressiveLM` inference copy after `fuse_projections` and
        `use_cpu_kernels`), or None where a layer is of another kind (the module forward then stays).

        Args:
            linear: `F.linear`'s signature and result (the engine's `PrepackedWeights.linear`; default `F.linear`).
        """
        trunk = getattr(model, "model", None)
        if trunk is None or not all(type(layer) is DecoderLayer for layer in getattr(trunk, "layers", ())):
            return None
        if type(trunk.norm) is not RMSNorm or trunk.norm.kernel is None:
            return None
        config = model.config
        layers = []
        for i, layer in enumerate(trunk.layers):
            attn, mlp = layer.self_attn, layer.mlp
            norms = [layer.input_layernorm, layer.post_attention_layernorm]
            if layer.sandwich:
                norms += [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm]
            if attn.q_norm is not None:
                norms += [attn.q_norm, attn.k_norm]
            usable = (type(attn) is Attention and type(mlp) is MLP and attn.qkv_weight is not None
                      and attn.rotary is cpu_kernels.rotary_nocheck_ and mlp.gate_up_weight is not None
                      and mlp.gated is not None and isinstance(attn.o_proj, torch.nn.Linear)
                      and isinstance(mlp.down_proj, torch.nn.Linear)
                      and all(type(n) is RMSNorm and n.kernel is not None for n in norms))
            if not usable:
                return None
            layers.append(_Layer(
                index=attn.layer_idx, input_norm=_norm(layer.input_layernorm),
                post_attention_norm=_norm(layer.post_attention_layernorm),
                pre_feedforward_norm=_norm(layer.pre_feedforward_layernorm) if layer.sandwich else None,
                post_feedforward_norm=_norm(layer.post_feedforward_layernorm) if layer.sandwich else None,
                q_norm=_norm(attn.q_norm) if attn.q_norm is not None else None,
                k_norm=_norm(attn.k_norm) if attn.k_norm is not None else None,
                qkv_weight=attn.qkv_weight, qkv_bias=attn.qkv_bias,
                o_weight=attn.o_proj.weight, o_bias=attn.o_proj.bias,
                gate_up_weight=mlp.gate_up_weight, down_weight=mlp.down_proj.weight, down_bias=mlp.down_proj.bias,
                heads=attn.num_heads, kv_heads=attn.num_kv_heads, head_dim=attn.head_dim, gelu=mlp.gelu,
                local_rotary=trunk.rotary_emb_local is not None and config.layer_window(i) is not None))
        if not layers:
            return None
        return cls(model, layers, linear or F.linear)

    def _bind(self, attention) -> None:
        """Point the layer structs at this step's caches: every step (about 20 us for 30 layers), since the dense
        copies move on a rebuild and the pages when the workspace is released and taken back."""
        dense, workspace = attention.dense, attention.workspace
        for struct, layer in zip(self._layer_structs, self.layers):
            struct.k_pages = workspace.k_caches[layer.index].data_ptr()
            struct.v_pages = workspace.v_caches[layer.index].data_ptr()
            struct.dense_keys = dense._keys[layer.index].data_ptr()
            struct.dense_values = dense._values[layer.index].data_ptr()
        self._step.cap = dense.capacity

    def _token(self, ids: torch.Tensor, positions: torch.Tensor, attention) -> torch.Tensor:
        """One decode token of each of B rows through the compiled call -> (B, H) final-normed."""
        trunk, step, dense = self.trunk, self._step, attention.dense
        h = trunk._embed(ids[None])[0].contiguous()  # (B, H)
        full = trunk.rotary_emb(positions[None], h.dtype)  # (1, B, 1, D) each, contiguous
        local = trunk.rotary_emb_local(positions[None], h.dtype) if self.local else full
        self._bind(attention)
        step.B = ids.shape[0]
        step.slots, step.positions, step.lens = (attention.slots.data_ptr(), dense._positions.data_ptr(),
                                                 dense._lens_i32.data_ptr())
        step.cos, step.sin = full[0].data_ptr(), full[1].data_ptr()
        step.cos_local, step.sin_local = local[0].data_ptr(), local[1].data_ptr()
        step.num_threads = torch.get_num_threads()
        cpu_kernels.decode_token_nocheck(step, self._layer_structs, h, self._scratch)
        return self.final_norm(h)

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, attention) -> torch.Tensor:
        """ids (N,) long, positions (N,) long, `attention` an `AttentionInterface` -> (N, H) final-normed."""
        if (self.token_call and self._step is not None and ids.shape[0] <= self.token_rows
                and getattr(attention, "dense", None) is not None and attention.dense.kernel):
            return self._token(ids, positions, attention)
        trunk, linear = self.trunk, self.linear
        rotary, gated = cpu_kernels.rotary_nocheck_, cpu_kernels.gated_activation_nocheck
        h = trunk._embed(ids[None])  # (1, N, H)
        n = ids.shape[0]
        full = trunk.rotary_emb(positions[None], h.dtype)
        local = trunk.rotary_emb_local(positions[None], h.dtype) if self.local else None
        for layer in self.layers:
            cos, sin = local if layer.local_rotary else full
            nh, nkv, d = layer.heads, layer.kv_heads, layer.head_dim
            x = layer.input_norm(h)
            qkv = linear(x, layer.qkv_weight, layer.qkv_bias).view(1, n, nh + 2 * nkv, d)
            v = qkv[:, :, nh + nkv:]
            if layer.q_norm is None:
                qk = rotary(qkv[:, :, :nh + nkv], cos, sin)
                q, k = qk[:, :, :nh], qk[:, :, nh:]
            else:
                q = rotary(layer.q_norm(qkv[:, :, :nh]), cos, sin)
                k = rotary(layer.k_norm(qkv[:, :, nh:nh + nkv]), cos, sin)
            out = attention(layer.index, q, k, v).reshape(1, n, nh * d)
            out = linear(out, layer.o_weight, layer.o_bias)
            if layer.pre_feedforward_norm is not None:
                h = h + layer.post_attention_norm(out)
                x = layer.pre_feedforward_norm(h)
            else:
                h = h + out
                x = layer.post_attention_norm(h)
            x = linear(gated(linear(x, layer.gate_up_weight), layer.gelu), layer.down_weight, layer.down_bias)
            if layer.post_feedforward_norm is not None:
                x = layer.post_feedforward_norm(x)
            h = h + x
        return self.final_norm(h)[0]
