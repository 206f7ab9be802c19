"""Building blocks of the Llama decoder (Touvron et al. 2023), with Hugging Face `LlamaForCausalLM` attribute names.

- RMSNorm: Zhang & Sennrich 2019, "Root Mean Square Layer Normalization"; computed in float32, cast back.
- Rotary position embedding: Su et al. 2021, "RoFormer"; HF "rotate_half" layout (the two halves of each head are
  the rotated pairs), cos/sin read from a precomputed float32 table.
- Grouped-query attention: Ainslie et al. 2023, "GQA"; Nkv key/value heads shared by Nh / Nkv query heads. The
  layer computes its projections and rotary embedding, then hands q/k/v to the forward's `AttentionInterface`
  (`attention.py`), which stores keys/values and attends (training, a contiguous cache, or the paged engine).
- SwiGLU MLP: Shazeer 2020, "GLU Variants Improve Transformer": down(silu(gate(x)) * up(x)).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionInterface
from .config import ModelConfig

__all__ = ["RMSNorm", "RotaryEmbedding", "Attention", "MLP", "DecoderLayer", "apply_rotary", "build_attention_mask",
           "rotate_half"]


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)); x (..., H) any float dtype, normalised in float32 and cast back to
    x's dtype before the weight multiply (as HF Llama does). Zhang & Sennrich 2019."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., H) -> (..., H), same dtype as x."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Precomputed rotary table (RoFormer, Su et al. 2021) for positions `[0, max_positions)`.

    Buffers `cos`, `sin`: (max_positions, D) float32, non-persistent (not in the state dict). The table is rebuilt in
    float32 if a dtype cast (e.g. `model.to(torch.bfloat16)`) touched it; call `reset_table(device)` after
    materialising a model built on the meta device.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.theta = head_dim, max_positions, theta
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.reset_table()

    def reset_table(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the float32 cos/sin tables on `device` (default: where the table is now)."""
        if device is None:
            device = self.cos.device
        if torch.device(device).type == "meta":
            device = "meta"
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float() / self.head_dim
        inv_freq = 1.0 / (self.theta**exponents)  # (D/2,)
        positions = torch.arange(self.max_positions, dtype=torch.int64, device=device).float()
        freqs = torch.outer(positions, inv_freq)  # (max_positions, D/2)
        angles = torch.cat((freqs, freqs), dim=-1)  # (max_positions, D), halves layout
        self.cos, self.sin = angles.cos(), angles.sin()

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids (B, S) long, each < max_positions -> (cos, sin), each (B, S, 1, D) in `dtype` (they
        broadcast over the heads of (B, S, heads, D) queries and keys)."""
        if self.cos.dtype != torch.float32 or self.cos.shape[0] != self.max_positions:
            self.reset_table(self.cos.device)
        cos = self.cos[position_ids].unsqueeze(2).to(dtype)
        sin = self.sin[position_ids].unsqueeze(2).to(dtype)
        return cos, sin


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
    """Grouped-query self-attention (Ainslie et al. 2023) with rotary q/k; `q_proj, k_proj, v_proj, o_proj` have
    no bias. Scores are scaled by 1/sqrt(D) (by the `AttentionInterface`).

    Attribute `qkv_weight` (default None): an inference copy may store q/k/v as one ((Nh + 2 Nkv) D, H) tensor
    whose row blocks ARE the three projections' weights (`astrai.rollout.model_runner.fuse_projections`); the
    forward then makes one GEMM instead of three, with the same result.
    """

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        h, d = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.qkv_weight: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention: AttentionInterface) -> torch.Tensor:
        """x (B, S, H); cos/sin (B, S, 1, D); `attention` stores keys/values and attends -> (B, S, H)."""
        b, s, _ = x.shape
        nh, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_weight is not None:
            qkv = F.linear(x, self.qkv_weight).view(b, s, nh + 2 * nkv, d)
            qk = apply_rotary(qkv[:, :, :nh + nkv], cos, sin)  # rotary over the q and k heads at once
            q, k, v = qk[:, :, :nh], qk[:, :, nh:], qkv[:, :, nh + nkv:]
        else:
            q = apply_rotary(self.q_proj(x).view(b, s, nh, d), cos, sin)
            k = apply_rotary(self.k_proj(x).view(b, s, nkv, d), cos, sin)
            v = self.v_proj(x).view(b, s, nkv, d)
        out = attention(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(b, s, nh * d))


class MLP(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020): down_proj(silu(gate_proj(x)) * up_proj(x)), no biases.

    Attribute `gate_up_weight` (default None): as `Attention.qkv_weight`, one (2 I, H) tensor over gate_proj and
    up_proj in inference copies (one GEMM instead of two).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.gate_up_weight: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, S, H) -> (B, S, H)."""
        if self.gate_up_weight is not None:
            gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm decoder block: h = x + attn(input_layernorm(x)); out = h + mlp(post_attention_layernorm(h))."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention: AttentionInterface) -> torch.Tensor:
        """x (B, S, H) -> (B, S, H); see `Attention.forward` for the other arguments."""
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, attention)
        return h + self.mlp(self.post_attention_layernorm(h))
