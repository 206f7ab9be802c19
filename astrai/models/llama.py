"""astrai's decoder-only language model: the Llama architecture (Touvron et al. 2023, "LLaMA") with the per-family
options of `ModelConfig` (Qwen2/2.5, Qwen3, Llama 3.x, Mistral, Gemma 2, Gemma 3 text), state-dict compatible with
each family's Hugging Face `ForCausalLM`: parameter names are identical, so `hf_state_dict(model)` saves to and
`load_state_dict` loads from HF safetensors 1:1.

Pieces (see `layers.py`): RMSNorm (Zhang & Sennrich 2019), rotary embeddings (Su et al. 2021, RoFormer; one table
for the full-attention layers and, for Gemma 3, one of another base for the sliding ones), grouped-query attention
(Ainslie et al. 2023) through an `AttentionInterface` (`attention.py`: training, a contiguous KV cache and the paged
rollout engine run this same module code, with each layer's `LayerAttention`: scale, window, soft-cap), gated MLP
(Shazeer 2020). Gemma: embeddings times sqrt(H) (the scale rounded to the activation dtype, as HF), final logits
soft-capped as c * tanh(logits / c) (Gemma 2).

What is simplified relative to HF: no dropout, no `padding_idx` on the embedding (HF zeroes the gradient of the pad
token's embedding row; with pad == eos, as in SmolLM2, that would freeze the EOS embedding, so astrai does not), one
explicit boolean mask instead of pluggable attention backends.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.utils.checkpoint
from torch import nn

from .attention import AttentionInterface, MaskedAttention, SegmentedCausalAttention, layer_attention
from .cache import KVCache
from .config import ModelConfig, tiny_config
from .layers import DecoderLayer, RMSNorm, RotaryEmbedding, build_attention_mask
from .moe import convert_to_moe

__all__ = ["ModelConfig", "KVCache", "LlamaTrunk", "AutoRegressiveLM", "hf_state_dict", "tiny_config"]

INIT_STD = 0.02  # HF LlamaConfig.initializer_range default


def _default_position_ids(input_ids: torch.Tensor, past_length: int) -> torch.Tensor:
    """(B, S) long: past_length, past_length + 1, ... for every row."""
    b, s = input_ids.shape
    positions = torch.arange(past_length, past_length + s, device=input_ids.device)
    return positions.unsqueeze(0).expand(b, s)


def _init_weights(module: nn.Module) -> None:
    """HF-style init: normal(0, INIT_STD) for Linear/Embedding weights, zero biases; RMSNorm keeps its identity
    weight. Skipped on the meta device (weights are assigned later)."""
    if isinstance(module, (nn.Linear, nn.Embedding)) and not module.weight.is_meta:
        with torch.no_grad():
            module.weight.normal_(0.0, INIT_STD)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()


def _non_default_attention(config: ModelConfig):
    """`layer_attention(config)`, or None when every layer attends plainly (causal, 1/sqrt(D), no soft-cap), so the
    plain Llama path stays the one it was."""
    layers = layer_attention(config)
    plain = all(a.window is None and a.softcap is None and a.scale == config.head_dim ** -0.5 for a in layers)
    return None if plain else layers


class LlamaTrunk(nn.Module):
    """Embeddings + L decoder blocks + final RMSNorm (HF `LlamaModel`, `Qwen2Model`, `Gemma3TextModel` ...):
    `embed_tokens`, `layers`, `norm`, and the non-persistent rotary frequencies `rotary_emb` (plus
    `rotary_emb_local` for the sliding layers when `config.sliding_rope_theta` is set). Weights are initialised like
    HF (see `AutoRegressiveLM`).

    Attribute `gradient_checkpointing` (default False): when True and in training mode with grad enabled, each
    block is recomputed in backward (`torch.utils.checkpoint`, `use_reentrant=False`).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # `_weight` skips nn.Embedding's own normal_ init (slow on the meta device); `_init_weights` does it.
        weight = torch.empty(config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_unit_offset)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                          config.rope_scaling)
        self.rotary_emb_local = None
        if config.sliding_rope_theta is not None:
            self.rotary_emb_local = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                                    config.sliding_rope_theta)
        self.attention_layers = _non_default_attention(config)
        self.embed_scale = float(config.hidden_size) ** 0.5 if config.scale_embeddings else None
        self.gradient_checkpointing = False
        self.apply(_init_weights)

    def reset_rotary(self, device: torch.device | str | None = None) -> None:
        """Recompute the rotary frequencies (after materialising a model built on the meta device)."""
        for rotary in (self.rotary_emb, self.rotary_emb_local):
            if rotary is not None:
                rotary.reset_table(device)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings (B, S, H), times sqrt(H) rounded to their dtype when `config.scale_embeddings`."""
        h = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            h = h * torch.tensor(self.embed_scale, dtype=h.dtype).item()
        return h

    def _rotary(self, position_ids: torch.Tensor, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin) of each layer: the sliding layers' own table when there is one."""
        full = self.rotary_emb(position_ids, dtype)
        if self.rotary_emb_local is None:
            return [full] * len(self.layers)
        local = self.rotary_emb_local(position_ids, dtype)
        return [local if self.config.layer_window(layer.self_attn.layer_idx) is not None else full
                for layer in self.layers]

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        document_ids: torch.Tensor | None = None,
        *,
        attention: AttentionInterface | None = None,
        seq_lengths: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm.

        input_ids (B, S) long; attention_mask (B, S_kv) 0/1 or bool with S_kv = cache length + S (None: no
        padding); position_ids (B, S) long, each < max_position_embeddings (None: arange from the cache length;
        with left padding pass `clamp(cumsum(attention_mask) - 1, min=0)`); kv_cache: see `KVCache` (its `length`
        advances by S here, once); document_ids (B, S) long for packed rows (attention stays within each document,
        see `build_attention_mask`; no cache). `attention`: an `AttentionInterface` that replaces the
        mask-and-cache attention (the rollout engine's paged one); it excludes `attention_mask`, `kv_cache` and
        `document_ids`, and then `position_ids` is required. `seq_lengths`: padding-free packed input, B = 1 and
        the row holds sequences of these lengths (Python ints summing to S) back to back, each attending causally
        within itself (`SegmentedCausalAttention`); `position_ids` should restart at 0 in each (default: the row's
        arange); it excludes `attention_mask`, `kv_cache`, `document_ids` and `attention`. Returns (B, S, H) in the
        parameter dtype. Raises `ValueError` for a mask of the wrong length, a cache without room, `attention` or
        `seq_lengths` combined with a mask, cache or document ids (`attention` without position_ids), or
        `seq_lengths` with B != 1 or another sum than S.
        """
        b, s = input_ids.shape
        if seq_lengths is not None:
            if attention is not None or attention_mask is not None or kv_cache is not None or document_ids is not None:
                raise ValueError("LlamaTrunk.forward: seq_lengths takes no attention_mask, kv_cache, document_ids or "
                                 "attention")
            if b != 1 or sum(seq_lengths) != s:
                raise ValueError(f"LlamaTrunk.forward: seq_lengths needs one packed row of their total length, got "
                                 f"input_ids {tuple(input_ids.shape)} and lengths summing to {sum(seq_lengths)}")
            attention = SegmentedCausalAttention(seq_lengths, layers=self.attention_layers)
            if position_ids is None:
                position_ids = _default_position_ids(input_ids, 0)
        if attention is not None:
            if attention_mask is not None or kv_cache is not None or document_ids is not None or position_ids is None:
                raise ValueError("LlamaTrunk.forward: `attention` takes position_ids and no attention_mask, kv_cache "
                                 "or document_ids")
        else:
            past = kv_cache.length if kv_cache is not None else 0
            if kv_cache is not None:
                kv_cache.check_room(b, s)
            if position_ids is None:
                position_ids = _default_position_ids(input_ids, past)
            mask = build_attention_mask(attention_mask, s, past, input_ids.device, document_ids)
            attention = MaskedAttention(mask, kv_cache, layers=self.attention_layers)
        h = self._embed(input_ids)
        rotary = self._rotary(position_ids, h.dtype)
        checkpointing = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for layer, (cos, sin) in zip(self.layers, rotary):
            if checkpointing and kv_cache is None:
                h = torch.utils.checkpoint.checkpoint(layer, h, cos, sin, attention, use_reentrant=False)
            else:
                h = layer(h, cos, sin, attention)
        if kv_cache is not None:
            kv_cache.advance(s)
        return self.norm(h)


class AutoRegressiveLM(nn.Module):
    """Causal language model (HF `*ForCausalLM` layout): `config`, `model` (LlamaTrunk), `lm_head`
    (Linear(H, V), no bias). With `config.tie_word_embeddings`, `lm_head.weight` IS `model.embed_tokens.weight`
    (one Parameter); `load_state_dict` then accepts state dicts without `lm_head.weight`. With
    `config.final_logit_softcapping` c the logits are c * tanh(lm_head(h) / c) (the hidden states of
    `return_hidden` are not: their callers must apply it, see `astrai.forward.whole_lm_head`).

    Weights are initialised like HF (normal(0, 0.02) for linear and embedding weights, ones for norms). With
    `config.num_local_experts` E > 0 every feed-forward is a `MoEFeedForward` of E experts (`convert_to_moe` of the
    initialised dense layers, router seeded by 0), as an MoE checkpoint's config.json describes it.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaTrunk(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        _init_weights(self.lm_head)
        if config.num_local_experts:  # the MoE layout the config describes (astrai.models.moe)
            convert_to_moe(self, num_experts=config.num_local_experts, top_k=config.num_experts_per_tok,
                           num_shared_experts=config.n_shared_experts, aux_loss_coef=config.router_aux_loss_coef)
        self.tie_weights()
        register = getattr(self, "register_load_state_dict_pre_hook", None)
        if register is None:  # torch < 2.5
            self._register_load_state_dict_pre_hook(_fill_tied_lm_head, with_module=True)
        else:
            register(_fill_tied_lm_head)

    def tie_weights(self) -> None:
        """Make `lm_head.weight` the embedding Parameter when `config.tie_word_embeddings` (no-op otherwise).
        Call again after anything that re-creates parameters (`to_empty`, `load_state_dict(assign=True)`)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def gradient_checkpointing(self) -> bool:
        """Proxy of `model.gradient_checkpointing`."""
        return self.model.gradient_checkpointing

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, value: bool) -> None:
        self.model.gradient_checkpointing = bool(value)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        *,
        logits_to_keep: int = 0,
        document_ids: torch.Tensor | None = None,
        return_hidden: bool = False,
        logits_at: torch.Tensor | None = None,
        seq_lengths: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Next-token logits (B, S, V) in the parameter dtype; `logits[:, i]` scores token i + 1.

        Arguments as `LlamaTrunk.forward` (`document_ids` and `seq_lengths` included). `logits_to_keep` > 0
        computes only the last that many positions, returning (B, logits_to_keep, V) (e.g. 1 for decoding).
        `logits_at` (B, S) bool computes only the positions where it is True, returning (N, V) with N =
        `logits_at.sum()`, in row-major order (`hidden[logits_at]`; e.g. the labelled positions of a supervised
        loss, or the scoring positions of a packed row). `return_hidden`: skip the
        LM head and return the final hidden states, (B, S, H) or as selected above, for callers that apply
        `lm_head.weight` themselves in chunks (`algos.logprobs_from_hidden`). Raises `ValueError` for
        `logits_at` of another shape or with `logits_to_keep`, and what `LlamaTrunk.forward` raises.
        """
        if logits_at is not None and (logits_to_keep > 0 or logits_at.shape != input_ids.shape):
            raise ValueError(f"AutoRegressiveLM.forward: logits_at must be (B, S) = {tuple(input_ids.shape)} and "
                             f"excludes logits_to_keep, got {tuple(logits_at.shape)} and {logits_to_keep}")
        hidden = self.model(input_ids, attention_mask, position_ids, kv_cache, document_ids, seq_lengths=seq_lengths)
        if logits_to_keep > 0:
            hidden = hidden[:, -logits_to_keep:]
        if logits_at is not None:
            hidden = hidden[logits_at]
        if return_hidden:
            return hidden
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


def _fill_tied_lm_head(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors) -> None:
    """load_state_dict pre-hook: a tied model accepts a state dict without `lm_head.weight` (as HF saves it)."""
    embed, head = prefix + "model.embed_tokens.weight", prefix + "lm_head.weight"
    if module.config.tie_word_embeddings and head not in state_dict and embed in state_dict:
        state_dict[head] = state_dict[embed]


def hf_state_dict(model: AutoRegressiveLM) -> dict[str, torch.Tensor]:
    """`model.state_dict()` with Hugging Face names, minus `lm_head.weight` when the embeddings are tied (as HF
    saves it; safetensors refuses shared tensors). Tensors share storage with the model (no copy). `model` is an
    `AutoRegressiveLM` or anything with its `config` and `state_dict()` (e.g. the full state gathered from a sharded
    policy). Raises `TypeError` for an object without a `ModelConfig` `config`."""
    if not isinstance(getattr(model, "config", None), ModelConfig) or not hasattr(model, "state_dict"):
        raise TypeError(f"hf_state_dict expects an AutoRegressiveLM (or its full state), got {type(model).__name__}")
    state = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state
