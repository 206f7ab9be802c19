"""Mixture-of-experts feed-forward: top-k routed SwiGLU experts plus always-active shared experts.

Methods: sparsely gated MoE (Shazeer et al. 2017) with top-k routing and renormalised gates (as in Mixtral,
Jiang et al. 2024), shared experts (DeepSeekMoE, Dai et al. 2024), the Switch/GShard load-balancing auxiliary
loss (Fedus et al. 2022; Lepikhin et al. 2021) `aux = E * sum_e f_e * P_e` with `f_e` the share of routed
token slots sent to expert e and `P_e` its mean router probability (aux = 1 when perfectly balanced), and
sparse upcycling (Komatsuzaki et al. 2023): `convert_to_moe` turns a dense model's MLPs into MoE layers whose
routed experts are copies of the dense MLP and whose shared experts start with a zero output projection, so
the converted model computes exactly the dense function at conversion.

What it simplifies: no capacity factor or token dropping (every token reaches its k experts), experts run as a
loop over the experts that received tokens (no grouped GEMM), the auxiliary loss of the latest forward is kept
on each MoE layer (`aux_loss`) and summed by `collect_aux_loss(model)`; `AutoRegressiveLM` is untouched.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MoEFeedForward", "convert_to_moe", "collect_aux_loss", "load_balancing_loss", "upcycled_config"]


def load_balancing_loss(router_probs: torch.Tensor, top_index: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch/GShard auxiliary loss `E * sum_e f_e * P_e` (0-dim, float32, differentiable through P).

    Shapes: `router_probs` (N, E) softmax router probabilities; `top_index` (N, k) int64 chosen experts.
    `f_e` = share of the N * k routed slots assigned to e (no grad), `P_e` = mean of router_probs[:, e].
    """
    counts = torch.zeros(num_experts, device=router_probs.device, dtype=torch.float32)
    counts.scatter_add_(0, top_index.reshape(-1), torch.ones(top_index.numel(), device=counts.device))
    f = counts / max(1, top_index.numel())
    p = router_probs.float().mean(dim=0)
    return num_experts * (f * p).sum()


class MoEFeedForward(nn.Module):
    """Routed + shared SwiGLU experts replacing a decoder block's MLP.

    Args:
        experts: E routed expert modules (each (.., H) -> (.., H)).
        shared: shared expert modules, applied to every token (may be empty).
        hidden_size: H; top_k: experts per token (1 <= k <= E); aux_loss_coef: weight of the auxiliary loss.

    Attributes:
        router: Linear(H, E, bias=False).
        aux_loss: 0-dim float32 load-balancing loss of the latest forward (None before the first one).

    Raises:
        ValueError: for no routed expert or top_k outside [1, E].
    """

    def __init__(self, experts: list[nn.Module], shared: list[nn.Module], *, hidden_size: int, top_k: int,
                 aux_loss_coef: float = 0.01):
        super().__init__()
        if not experts or not 1 <= top_k <= len(experts):
            raise ValueError(f"MoEFeedForward: need 1 <= top_k ({top_k}) <= experts ({len(experts)})")
        self.experts = nn.ModuleList(experts)
        self.shared_experts = nn.ModuleList(shared)
        self.router = nn.Linear(hidden_size, len(experts), bias=False)
        nn.init.normal_(self.router.weight, std=0.02)
        self.top_k, self.aux_loss_coef = top_k, aux_loss_coef
        self.aux_loss: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, S, H) -> (B, S, H): sum_shared s(x) + sum_{e in top-k} g_e(x) * expert_e(x), with g the
        router softmax renormalised over the chosen k. Sets `self.aux_loss`."""
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(tokens).float(), dim=-1)  # (N, E)
        gates, index = probs.topk(self.top_k, dim=-1)  # (N, k)
        gates = (gates / gates.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(tokens)
        for e in index.unique().tolist():
            rows, slot = (index == e).nonzero(as_tuple=True)
            out.index_add_(0, rows, self.experts[e](tokens[rows]) * gates[rows, slot, None])
        for expert in self.shared_experts:
            out = out + expert(tokens)
        self.aux_loss = load_balancing_loss(probs, index, len(self.experts))
        return out.reshape(shape)


def convert_to_moe(model: nn.Module, *, num_experts: int, top_k: int, num_shared_experts: int = 0,
                   aux_loss_coef: float = 0.01, seed: int = 0) -> nn.Module:
    """Sparse upcycling, in place: every decoder block's `mlp` becomes a `MoEFeedForward` with `num_experts`
    copies of it (routed) and `num_shared_experts` copies whose `down_proj` is zeroed (shared), so the function
    is unchanged at conversion. Works on any module whose blocks are `model.model.layers[i].mlp` (the policy)
    or `model.layers[i].mlp` (a trunk). The router is initialised from `seed`. The MoE settings are recorded in
    `model.config` (`num_local_experts`, `num_experts_per_tok`, `n_shared_experts`, `router_aux_loss_coef`), so
    a saved config.json describes the converted model. Returns `model`.

    Raises:
        ValueError: for `num_experts < 1`, `top_k` outside [1, num_experts], or no decoder layers found.
    """
    trunk = getattr(model, "model", model)
    layers = getattr(trunk, "layers", None)
    if layers is None or len(layers) == 0:
        raise ValueError("convert_to_moe: the model has no decoder layers")
    if num_experts < 1 or not 1 <= top_k <= num_experts:
        raise ValueError(f"convert_to_moe: need 1 <= top_k ({top_k}) <= num_experts ({num_experts})")
    generator_state = torch.random.get_rng_state()
    torch.random.default_generator.manual_seed(seed)  # the CPU generator only (put back below); CUDA's untouched
    try:
        for layer in layers:
            dense = layer.mlp
            shared = [copy.deepcopy(dense) for _ in range(num_shared_experts)]
            for expert in shared:
                nn.init.zeros_(expert.down_proj.weight)
            hidden = dense.down_proj.weight.shape[0]
            moe = MoEFeedForward([copy.deepcopy(dense) for _ in range(num_experts)], shared, hidden_size=hidden,
                                 top_k=top_k, aux_loss_coef=aux_loss_coef)
            layer.mlp = moe.to(device=dense.down_proj.weight.device, dtype=dense.down_proj.weight.dtype)
    finally:
        torch.random.set_rng_state(generator_state)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "num_local_experts"):  # config.json then describes the MoE model
        config.num_local_experts, config.num_experts_per_tok = num_experts, top_k
        config.n_shared_experts, config.router_aux_loss_coef = num_shared_experts, aux_loss_coef
    return model


def upcycled_config(model_config, options):
    """The config of the model a job trains: `model_config` (the checkpoint's `ModelConfig`) with the experts of
    `options` (the job's `model` section: `moe_num_experts`, `moe_top_k`, `moe_num_shared_experts`,
    `moe_aux_loss_coef`) where the job upcycles a dense checkpoint (`convert_to_moe` at start-up); `model_config`
    itself for a dense job or an MoE checkpoint. For what is sized before the conversion runs (the memory plan,
    the engine's copy)."""
    if not getattr(options, "moe_num_experts", 0) or model_config.num_local_experts:
        return model_config
    return dataclasses.replace(model_config, num_local_experts=options.moe_num_experts,
                               num_experts_per_tok=options.moe_top_k, n_shared_experts=options.moe_num_shared_experts,
                               router_aux_loss_coef=options.moe_aux_loss_coef)


def collect_aux_loss(model: nn.Module) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(mean auxiliary loss over the MoE layers, its weighted value sum_l coef_l * aux_l / L) of the latest
    forward of `model`, both 0-dim float32; None when `model` has no MoE layer or none has run."""
    layers = [m for m in model.modules() if isinstance(m, MoEFeedForward) and m.aux_loss is not None]
    if not layers:
        return None
    aux = torch.stack([m.aux_loss for m in layers]).mean()
    weighted = torch.stack([m.aux_loss_coef * m.aux_loss for m in layers]).mean()
    return aux, weighted
