"""Building blocks of the decoder (Llama, Touvron et al. 2023, and the family options of `ModelConfig`), with the
Hugging Face attribute names of each family's `ForCausalLM` (so state dicts load 1:1).

- RMSNorm: Zhang & Sennrich 2019, "Root Mean Square Layer Normalization"; computed in float32, cast back; the weight
  applies as `w * x` (Llama, Qwen, Mistral) or `(1 + w) * x` in float32 (Gemma, `norm_unit_offset`).
- Rotary position embedding: Su et al. 2021, "RoFormer"; HF "rotate_half" layout (the two halves of each head are
  the rotated pairs); cos/sin computed in float32 from the positions and the inverse frequencies of
  `astrai.models.rope` (default, linear, llama3 or yarn), times yarn's attention factor.
- Grouped-query attention: Ainslie et al. 2023, "GQA"; Nkv key/value heads shared by Nh / Nkv query heads, optional
  biases (Qwen2: q/k/v; Llama's `attention_bias`: q/k/v/o) and per-head q/k RMSNorm before rotary (Qwen3, Gemma 3).
  The layer computes its projections and rotary embedding, then hands q/k/v to the forward's `AttentionInterface`
  (`attention.py`), which stores keys/values and attends (training, a contiguous cache, or the paged engine).
- Gated MLP: Shazeer 2020, "GLU Variants Improve Transformer": down(act(gate(x)) * up(x)), act = SiLU (SwiGLU) or
  tanh-approximated GELU (GeGLU, Gemma).
- Decoder block: pre-norm residual; Gemma 2/3 also normalise each sublayer's output before the residual add.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionInterface
from .config import ModelConfig
from .rope import inverse_frequencies

__all__ = ["RMSNorm", "RotaryEmbedding", "Attention", "MLP", "DecoderLayer", "apply_rotary", "build_attention_mask",
           "rotate_half"]


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)); x (..., H) any float dtype, normalised in float32 and cast back to
    x's dtype before the weight multiply (as HF Llama does). Zhang & Sennrich 2019. With `unit_offset` (Gemma):
    y = (x / sqrt(mean(x^2) + eps)) * (1 + weight), all in float32, then cast (as HF Gemma); the weight then starts
    at 0 (the identity scale).

    Attribute `kernel` (default None): an inference copy may set it to a callable `kernel(x, weight, eps,
    unit_offset)` with the same result, to rounding (`astrai.rollout.cpu_ops`: one compiled call on CPU)."""

    kernel = None

    def __init__(self, hidden_size: int, eps: float = 1e-6, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size) if unit_offset else torch.ones(hidden_size))
        self.eps, self.unit_offset = eps, unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., H) -> (..., H), same dtype as x."""
        if self.kernel is not None:
            return self.kernel(x, self.weight, self.eps, self.unit_offset)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (h * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * h.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotary angles (RoFormer, Su et al. 2021) of base `theta` with an optional frequency `scaling`
    (`astrai.models.rope`), computed from the positions in float32 (as HF does), so any position is served and no
    (positions, D) table is held.

    Buffer `inv_freq`: (D/2,) float32, non-persistent (not in the state dict); recomputed in float32 if a dtype cast
    (e.g. `model.to(torch.bfloat16)`) touched it; call `reset_table(device)` after materialising a model built on
    the meta device. `attention_factor` multiplies cos and sin (yarn; 1.0 otherwise).
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None = None) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        self.attention_factor = 1.0
        self.register_buffer("inv_freq", torch.empty(0), persistent=False)
        self.reset_table()

    def reset_table(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the float32 inverse frequencies on `device` (default: where they are now)."""
        if device is None:
            device = self.inv_freq.device
        if torch.device(device).type == "meta":
            device = "meta"
        self.inv_freq, self.attention_factor = inverse_frequencies(self.head_dim, self.theta, self.scaling,
                                                                   self.max_positions, device)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids (B, S) long -> (cos, sin), each (B, S, 1, D) in `dtype` (they broadcast over the heads of
        (B, S, heads, D) queries and keys)."""
        if self.inv_freq.dtype != torch.float32 or self.inv_freq.shape[0] != self.head_dim // 2:
            self.reset_table(self.inv_freq.device)
        freqs = position_ids.unsqueeze(-1).float() * self.inv_freq  # (B, S, D/2)
        angles = torch.cat((freqs, freqs), dim=-1).unsqueeze(2)  # (B, S, 1, D), halves layout
        cos, sin = angles.cos(), angles.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(..., D) -> (..., D): [x1, x2] -> [-x2, x1] with x1, x2 the two halves of the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (RoFormer, Su et al. 2021): x (B, S, heads, D), cos/sin (B, S, 1, D) -> (B, S, heads, D),
    `x * cos + rotate_half(x) * sin`."""
    return x * cos + rotate_half(x) * sin


def build_attention_mask(
    attention_mask: torch.Tensor | None, num_new: int, past_length: int, device: torch.device,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Boolean attention mask (B or 1, 1, S, K) with K = past_length + S, True = may attend; None = plain causal.

    Query i (absolute position past_length + i) sees key j if j <= past_length + i and `attention_mask[b, j]` is
    set. Every query may also see its own key, so rows of padding queries (left padding) are never fully masked
    (SDPA returns NaN for those); their outputs are meaningless but finite. `attention_mask`: (B, K) of 0/1 or bool.
    `document_ids` (B, S) int (packed rows, no cache): query i sees key j only when both belong to the same
    document (a block-diagonal causal mask). Raises `ValueError` if a length is not K, or for `document_ids`
    with a cache.
    """
    total = past_length + num_new
    if attention_mask is None and past_length == 0 and document_ids is None:
        return None
    q_pos = torch.arange(past_length, total, device=device).unsqueeze(1)  # (S, 1)
    k_pos = torch.arange(total, device=device).unsqueeze(0)  # (1, K)
    allowed = (k_pos <= q_pos).unsqueeze(0)  # (1, S, K)
    if attention_mask is not None:
        if attention_mask.dim() != 2 or attention_mask.shape[1] != total:
            raise ValueError(
                f"attention_mask must be (B, {total}) = cached {past_length} + new {num_new} tokens, "
                f"got {tuple(attention_mask.shape)}"
            )
        allowed = allowed & attention_mask.to(device=device, dtype=torch.bool).unsqueeze(1)
        allowed = allowed | (k_pos == q_pos).unsqueeze(0)
    if document_ids is not None:
        if past_length or document_ids.shape[-1] != num_new:
            raise ValueError(f"document_ids must be (B, {num_new}) without a cache, got {tuple(document_ids.shape)} "
                             f"with {past_length} cached tokens")
        documents = document_ids.to(device)
        allowed = allowed & (documents.unsqueeze(2) == documents.unsqueeze(1))
    return allowed.unsqueeze(1)


class Attention(nn.Module):
    """Grouped-query self-attention (Ainslie et al. 2023) with rotary q/k: `q_proj, k_proj, v_proj, o_proj`, with
    biases on q/k/v when `config.qkv_bias` or `config.attention_bias` (and on o with `attention_bias`), and
    `q_norm`, `k_norm` (RMSNorm over D, per head, before rotary) when `config.qk_norm`. Scale, window and soft-cap
    are applied by the `AttentionInterface` (`attention.layer_attention`).

    Attributes `qkv_weight` / `qkv_bias` (default None): an inference copy may store q/k/v as one
    ((Nh + 2 Nkv) D, H) tensor (and bias) whose row blocks ARE the three projections' parameters
    (`astrai.rollout.model_runner.fuse_projections`); the forward then makes one GEMM instead of three, with the
    same result. `linear` (default `F.linear`) computes that fused GEMM; an inference copy may set it to a callable
    of the same signature and result (`astrai.rollout.packed_linear`: prepacked oneDNN weights on CPU). `rotary`
    (default `apply_rotary`) likewise; an inference copy may rotate in place (`astrai.rollout.cpu_ops`), so its
    input must be a fresh tensor or a view of one (here: of the q/k/v projection's output).
    """

    linear = staticmethod(F.linear)
    rotary = staticmethod(apply_rotary)

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        h, d = config.hidden_size, config.head_dim
        qkv_bias = config.qkv_bias or config.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=config.attention_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps, config.norm_unit_offset)
            self.k_norm = RMSNorm(d, config.rms_norm_eps, config.norm_unit_offset)
        else:
            self.q_norm = self.k_norm = None
        self.qkv_weight: torch.Tensor | None = None
        self.qkv_bias: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention: AttentionInterface) -> torch.Tensor:
        """x (B, S, H); cos/sin (B, S, 1, D); `attention` stores keys/values and attends -> (B, S, H)."""
        b, s, _ = x.shape
        nh, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_weight is not None:
            qkv = self.linear(x, self.qkv_weight, self.qkv_bias).view(b, s, nh + 2 * nkv, d)
            q, k, v = qkv[:, :, :nh], qkv[:, :, nh:nh + nkv], qkv[:, :, nh + nkv:]
            if self.q_norm is None:
                qk = self.rotary(qkv[:, :, :nh + nkv], cos, sin)  # rotary over the q and k heads at once
                q, k = qk[:, :, :nh], qk[:, :, nh:]
            else:
                q = self.rotary(self.q_norm(q), cos, sin)
                k = self.rotary(self.k_norm(k), cos, sin)
        else:
            q = self.q_proj(x).view(b, s, nh, d)
            k = self.k_proj(x).view(b, s, nkv, d)
            v = self.v_proj(x).view(b, s, nkv, d)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary(q, cos, sin), self.rotary(k, cos, sin)
        out = attention(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(b, s, nh * d))


class MLP(nn.Module):
    """Gated feed-forward (Shazeer 2020): down_proj(act(gate_proj(x)) * up_proj(x)), act = SiLU (SwiGLU) or
    `gelu_pytorch_tanh` (GeGLU), biases when `config.mlp_bias`.

    Attribute `gate_up_weight` (default None): as `Attention.qkv_weight`, one (2 I, H) tensor over gate_proj and
    up_proj in inference copies (one GEMM instead of two; bias-free MLPs only), computed by `linear` (as
    `Attention.linear`). `gated` (default None): with `gate_up_weight`, an inference copy may set it to a callable
    `gated(gate_up, gelu)` -> act(gate) * up from the fused (..., 2 I) output, the same result to rounding
    (`astrai.rollout.cpu_ops`).
    """

    linear = staticmethod(F.linear)
    gated = None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        bias = config.mlp_bias
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"
        self.gate_up_weight: torch.Tensor | None = None

    def _act(self, gate: torch.Tensor) -> torch.Tensor:
        return F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, S, H) -> (B, S, H)."""
        if self.gate_up_weight is not None:
            gate_up = self.linear(x, self.gate_up_weight)
            if self.gated is not None:
                return self.down_proj(self.gated(gate_up, self.gelu))
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj(self._act(gate) * up)
        return self.down_proj(self._act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm decoder block: h = x + attn(input_layernorm(x)); out = h + mlp(post_attention_layernorm(h)).

    With `config.post_sublayer_norms` (Gemma 2/3, HF names): h = x + post_attention_layernorm(attn(
    input_layernorm(x))); out = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h))).
    """

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        eps, offset = config.rms_norm_eps, config.norm_unit_offset
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps, offset)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, offset)
        self.sandwich = config.post_sublayer_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps, offset)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps, offset)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention: AttentionInterface) -> torch.Tensor:
        """x (B, S, H) -> (B, S, H); see `Attention.forward` for the other arguments."""
        if self.sandwich:
            h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, attention))
            return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, attention)
        return h + self.mlp(self.post_attention_layernorm(h))
