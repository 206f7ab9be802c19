"""Tensor parallelism of the paged engine's inference copy (Megatron-LM's column/row split, Shoeybi et al. 2019;
applied as a `parallelize(model, group)` step over the engine's copy, the way torchtitan parallelizes a model, so the
model classes keep no parallel code).

Each of the T ranks of one tensor-parallel group (`astrai.distributed.DistributedContext.tp_group`) holds:
- attention: its Nh / T query heads and, when T divides Nkv, its Nkv / T key/value heads; with fewer KV heads than
  ranks (T a multiple of Nkv) the KV head its query heads read, replicated on T / Nkv ranks as Megatron does.
  q/k/v (and their biases) are column-parallel (row blocks of the weights), o_proj is row-parallel (a column block)
  followed by ONE `torch.distributed.all_reduce` of the (N, H) output; the o bias is added once, after it.
- MLP: gate/up column-parallel (I / T rows each), down row-parallel with one all-reduce, its bias added after it.
- embeddings: vocabulary-parallel (rows [r V', (r + 1) V') with V' = ceil(V / T); tokens outside the slice look up
  zeros, then one all-reduce); the LM head holds the same vocabulary rows (the same Parameter when tied), its local
  logits are all-gathered into the full (R, V) logits on every rank, and every rank samples from them with the same
  per-request generators (the call's base seed is agreed on across the group), so every rank draws the same token
  and records the same behaviour log-prob, bit for bit; the tokens equal a T = 1 engine's under the same seed up to
  the summation order of the row-parallel GEMMs.
- norms (and q/k norms) replicated. Everything that reads head counts (the attention's reshape, the KV workspace,
  the kernels) reads the local ones from the weights (`local_kv_heads`), so each rank's KV cache holds its heads only.

The decode path uses plain `torch.distributed.all_reduce` / `all_gather` on the group (no DTensor: TitanRL found its
dispatch too slow per decode step). Weight sync: `TensorParallel.shard` narrows each full gathered tensor to this
rank's slice (a view), which the engine copies in; no second full copy is held. MoE feed-forwards are refused.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass
from typing import Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn

from astrai.rollout.model_runner import PagedModelRunner

__all__ = ["RowParallelLinear", "ShardSpec", "TensorParallel", "TensorParallelRunner", "VocabParallelEmbedding",
           "check_tensor_parallel", "local_kv_heads", "parallel_copy", "parallelize", "request_digest"]

FIELD = "rollout.tensor_parallel_size"


def check_tensor_parallel(config, size: int, field: str = FIELD) -> None:
    """ValueError (one line naming `field`) when a model of `config` (`astrai.models.ModelConfig`) cannot be split
    over `size` ranks: `size` not a positive integer, a mixture-of-experts feed-forward, query heads, MLP width or
    vocabulary that `size` does not divide into non-empty slices, or key/value heads that are neither a multiple nor
    a divisor of `size` (a divisor: each KV head is replicated on size / Nkv ranks)."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"{field}: expected an integer >= 1, got {size!r}")
    if size == 1:
        return
    nh, nkv = config.num_attention_heads, config.num_key_value_heads
    if getattr(config, "num_local_experts", 0):
        raise ValueError(f"{field}: {size} > 1 is not supported for mixture-of-experts models "
                         f"(num_local_experts {config.num_local_experts}); use 1")
    if nh % size:
        raise ValueError(f"{field}: {size} does not divide num_attention_heads {nh}")
    if nkv % size and size % nkv:
        raise ValueError(f"{field}: {size} is neither a divisor nor a multiple of num_key_value_heads {nkv} (the KV "
                         "heads are split, or each replicated on several ranks)")
    if config.intermediate_size % size:
        raise ValueError(f"{field}: {size} does not divide intermediate_size {config.intermediate_size}")
    if (size - 1) * -(-config.vocab_size // size) >= config.vocab_size:
        raise ValueError(f"{field}: {size} ranks leave a rank without vocabulary (vocab_size {config.vocab_size})")


def local_kv_heads(model: nn.Module) -> int:
    """Key/value heads of the first decoder layer of `model` as its weights hold them (the local count on a
    tensor-parallel rank, the config's otherwise)."""
    attn = model.model.layers[0].self_attn
    return attn.k_proj.weight.shape[0] // attn.head_dim


@dataclass(frozen=True)
class ShardSpec:
    """This rank's slice of one full parameter: `length` entries from `start` along `dim` of a tensor of shape
    `full` (a vocabulary slice may be shorter than the others' on the last rank)."""

    dim: int
    start: int
    length: int
    full: tuple[int, ...]


class RowParallelLinear(nn.Module):
    """A row-parallel linear layer (Megatron): `all_reduce(x W_r^T) + b` over `group`, with this rank's column
    block `weight` (out, in / T) and the full, replicated `bias` (out,) or None. Named `weight` / `bias` so the
    engine's parameter names stay the Hugging Face ones."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], group) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in / T) -> (..., out), the same on every rank of the group."""
        out = F.linear(x, self.weight)
        torch.distributed.all_reduce(out, group=self.group)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding rows [start, start + n) of the vocabulary (`weight` (n, H)); other ids look up zeros, and one
    all-reduce over `group` sums the ranks' lookups into the full embedding on every rank."""

    def __init__(self, weight: torch.Tensor, start: int, group) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.group = start, group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids (B, S) int64 -> (B, S, H) in the weight's dtype."""
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill_(outside[..., None], 0.0)
        torch.distributed.all_reduce(h, group=self.group)
        return h


class TensorParallel:
    """The tensor-parallel layout of one engine copy: its group, this rank's place in it, and the slice of every
    split parameter (`specs`, by Hugging Face name; a name not in it is replicated whole).

    Attributes:
        group: the torch process group of the T ranks; rank / size: this rank's index in it and T.
        vocab_size: V; vocab_chunk: V' = ceil(V / T), the rows of every rank's slice but possibly the last's.
        device: where the copy's weights live (the small tensors of `agree` go there: NCCL needs CUDA tensors).
    """

    def __init__(self, group, vocab_size: int, device: torch.device) -> None:
        self.group, self.device = group, device
        self.rank = torch.distributed.get_rank(group)
        self.size = torch.distributed.get_world_size(group)
        self.vocab_size, self.vocab_chunk = vocab_size, -(-vocab_size // self.size)
        self.specs: dict[str, ShardSpec] = {}

    def shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full tensor `tensor` of parameter `name` (a view; the tensor itself for a
        replicated parameter). Raises ValueError (one line) for a split parameter given in another full shape."""
        spec = self.specs.get(name)
        if spec is None or not isinstance(tensor, torch.Tensor):
            return tensor
        if tuple(tensor.shape) != spec.full:
            raise ValueError(f"load_weights: {name}: expected a floating-point tensor of shape {spec.full}, got "
                             f"shape {tuple(tensor.shape)}")
        return tensor.narrow(spec.dim, spec.start, spec.length)

    def shard_all(self, state_dict):
        """`shard` over a mapping (a mapping back, every tensor checked before the caller copies any) or over a
        stream of (name, full tensor) pairs (a stream back, each sliced as it arrives)."""
        if isinstance(state_dict, Mapping):
            return {name: self.shard(name, tensor) for name, tensor in state_dict.items()}
        return ((name, self.shard(name, tensor)) for name, tensor in state_dict)

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """local (R, n) float32 logits of this rank's vocabulary rows -> (R, V) float32, identical on every rank
        (one all-gather of (R, V') per rank, the last rank's slice zero-padded)."""
        rows, chunk = local.shape[0], self.vocab_chunk
        if local.shape[1] != chunk:
            padded = local.new_zeros(rows, chunk)
            padded[:, :local.shape[1]] = local
            local = padded
        parts = local.new_empty(self.size, rows, chunk)
        torch.distributed.all_gather(list(parts.unbind(0)), local.contiguous(), group=self.group)
        full = parts.permute(1, 0, 2).reshape(rows, self.size * chunk)
        return full if full.shape[1] == self.vocab_size else full[:, :self.vocab_size].contiguous()

    def agree(self, base_seed: int, request_digest: bytes) -> int:
        """The group's rank 0 `base_seed`, after checking that every rank asks for the same batch (`request_digest`
        of its prompts and settings: the ranks run each step's collectives together). One all-gather per call.

        Raises:
            ValueError: (on every rank of the group alike, one line) when the ranks' requests differ.
        """
        digest = int.from_bytes(request_digest[:7], "little")
        mine = torch.tensor([base_seed, digest], dtype=torch.int64, device=self.device)
        every = torch.empty(self.size, 2, dtype=torch.int64, device=self.device)
        torch.distributed.all_gather(list(every.unbind(0)), mine, group=self.group)
        if not bool((every[:, 1] == every[0, 1]).all()):
            bad = int((every[:, 1] != every[0, 1]).nonzero()[0, 0])
            raise ValueError(f"rollout.tensor_parallel_size: rank {bad} of a tensor-parallel group asked its engine "
                             "for other prompts or settings than the group's rank 0; every rank of a group generates "
                             "the same batch, so multi-turn tools and environments must return the same on every rank "
                             "(no randomness, clock or remote state) under tensor parallelism")
        return int(every[0, 0])


def request_digest(prompts, params, n: int, penalties) -> bytes:
    """A digest of one `generate` call's requests (prompt ids, settings, n, penalties), compared across the group."""
    return hashlib.sha256(repr((prompts, params, n, penalties)).encode()).digest()


def _narrow(tensor: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    """A fresh copy of the slice (the full tensor's storage is freed with it)."""
    return tensor.detach().narrow(dim, start, length).clone()


def parallel_copy(model: nn.Module, group) -> tuple[nn.Module, TensorParallel]:
    """The engine's copy of `model` (an `AutoRegressiveLM`, whole) split over `group`, made without a second whole
    copy: the deep copy takes empty placeholders for the 2-D weights, and `parallelize` fills them with this rank's
    slices of `model`'s own (so the peak is the model plus one rank's share). Raises what `parallelize` raises."""
    placeholders = {id(p): nn.Parameter(p.detach().new_empty(0), requires_grad=False)
                    for p in model.parameters() if p.dim() == 2}
    twin = copy.deepcopy(model, placeholders)
    tp = parallelize(twin, group, source=model)
    left = [name for name, p in twin.named_parameters() if p.numel() == 0]
    if left:  # a weight the layout does not know (a new kind of layer): never run with an empty one
        raise RuntimeError(f"tensor-parallel engine: no slice was taken of {left[:3]}")
    return twin, tp


@torch.no_grad()
def parallelize(model: nn.Module, group, source: Optional[nn.Module] = None) -> TensorParallel:
    """Split `model` (the engine's own `AutoRegressiveLM` copy, not yet fused: `fuse_projections` runs after) over
    the ranks of `group` in place, as the module docstring says, and return its `TensorParallel` layout. The full
    tensors are read from `source` (a model of the same names and shapes; None: `model` itself), so `model` may hold
    placeholders for every split weight (`parallel_copy`).

    Raises:
        ValueError: what `check_tensor_parallel` refuses (one line).
    """
    config = model.config
    full_params = dict((source if source is not None else model).named_parameters(remove_duplicate=False))
    tp = TensorParallel(group, config.vocab_size, full_params["model.embed_tokens.weight"].device)
    check_tensor_parallel(config, tp.size)
    r, t, d = tp.rank, tp.size, config.head_dim
    nh, nkv = config.num_attention_heads, config.num_key_value_heads
    nh_local = nh // t
    kv_first, nkv_local = (r * (nkv // t), nkv // t) if nkv >= t else (r // (t // nkv), 1)
    inter = config.intermediate_size // t

    def split(module: nn.Module, prefix: str, attr: str, dim: int, start: int, length: int) -> None:
        full = full_params[f"{prefix}.{attr}"]
        tp.specs[f"{prefix}.{attr}"] = ShardSpec(dim, start, length, tuple(full.shape))
        setattr(module, attr, nn.Parameter(_narrow(full, dim, start, length), requires_grad=False))

    for i, layer in enumerate(model.model.layers):
        attn, mlp, base = layer.self_attn, layer.mlp, f"model.layers.{i}"
        for name, first, count in (("q_proj", r * nh_local, nh_local), ("k_proj", kv_first, nkv_local),
                                   ("v_proj", kv_first, nkv_local)):
            for attr in ("weight", "bias"):
                if getattr(getattr(attn, name), attr) is not None:
                    split(getattr(attn, name), f"{base}.self_attn.{name}", attr, 0, first * d, count * d)
            getattr(attn, name).out_features = count * d
        attn.num_heads, attn.num_kv_heads = nh_local, nkv_local
        attn.o_proj = _row_parallel(tp, full_params, f"{base}.self_attn.o_proj", r * nh_local * d, nh_local * d)
        for name in ("gate_proj", "up_proj"):
            for attr in ("weight", "bias"):
                if getattr(getattr(mlp, name), attr) is not None:
                    split(getattr(mlp, name), f"{base}.mlp.{name}", attr, 0, r * inter, inter)
            getattr(mlp, name).out_features = inter
        mlp.down_proj = _row_parallel(tp, full_params, f"{base}.mlp.down_proj", r * inter, inter)
    start = r * tp.vocab_chunk
    rows = min(tp.vocab_chunk, config.vocab_size - start)
    embed = full_params["model.embed_tokens.weight"]
    tp.specs["model.embed_tokens.weight"] = ShardSpec(0, start, rows, tuple(embed.shape))
    model.model.embed_tokens = VocabParallelEmbedding(_narrow(embed, 0, start, rows), start, group)
    if config.tie_word_embeddings:
        model.tie_weights()
        tp.specs["lm_head.weight"] = tp.specs["model.embed_tokens.weight"]
    else:
        split(model.lm_head, "lm_head", "weight", 0, start, rows)
    model.lm_head.out_features = rows
    return tp


def _row_parallel(tp: TensorParallel, full_params: dict, name: str, start: int, length: int) -> RowParallelLinear:
    """The linear layer `name` (its full `weight` and optional `bias` in `full_params`) as a `RowParallelLinear`
    holding input columns [start, start + length) (the bias whole)."""
    weight, bias = full_params[f"{name}.weight"], full_params.get(f"{name}.bias")
    tp.specs[f"{name}.weight"] = ShardSpec(1, start, length, tuple(weight.shape))
    bias = None if bias is None else bias.detach().clone()
    return RowParallelLinear(_narrow(weight, 1, start, length), bias, tp.group)


class TensorParallelRunner(PagedModelRunner):
    """`PagedModelRunner` of a parallelized copy: the trunk's collectives run inside the layers; the LM head's
    local logits are gathered into the full (R, V) float32 logits on every rank (then soft-capped by `forward`),
    so the scheduler and sampler see what a T = 1 runner gives them."""

    def __init__(self, model, workspace, backend, tp: TensorParallel, **kwargs) -> None:
        super().__init__(model, workspace, backend, **kwargs)
        self.tp = tp

    def _logits(self, batch) -> torch.Tensor:
        """The full (len(logit_rows), V) float32 logits, the same on every rank of the group."""
        return self.tp.gather_logits(super()._logits(batch))
