"""The models of a job as the trainer holds them: `TrainedModel` (a model with its optimizer and schedule, the unit
`Trainer.accumulate_and_step` steps), frozen reference copies, and the model options applied before a strategy is
built (MoE).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Optional

import torch

from astrai.checkpoint import Part
from astrai.config import ConfigError
from astrai.distributed import DistributedContext
from astrai.models.moe import collect_aux_loss, convert_to_moe
from astrai.trainer.optim import build_optimizer, build_scheduler


@dataclass
class TrainedModel:
    """A model under training: what `Trainer.accumulate_and_step` backpropagates through, clips and steps.

    Attributes:
        name: "policy" or "critic": the prefix of its metrics (`policy/grad_norm`) and the name the optimizer
            hooks receive; only "policy" steps advance `policy_version`.
        module: the model as wrapped for data parallelism (call it for training forwards).
        optimizer: its optimizer; scheduler: its learning-rate schedule (stepped once per optimizer step).
        dist: the process state (unwrapping, loss scale).
    """

    name: str
    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    dist: DistributedContext

    @property
    def model(self) -> torch.nn.Module:
        """The bare model under any data-parallel wrapper (for no-grad scoring, state dicts, weight sync)."""
        return self.dist.unwrap(self.module)

    @property
    def loss_scale(self) -> float:
        """Factor that turns a loss normalised by the GLOBAL unit count into the engine's averaged gradient
        (`DistributedContext.loss_scale`)."""
        return self.dist.loss_scale()

    def gradient_sync(self, sync: bool):
        """Context for one micro-batch's backward: gradients are all-reduced across ranks only when `sync` (the
        step's last micro-batch); a DDP module accumulates the others locally (`no_sync`)."""
        if sync or not isinstance(self.module, torch.nn.parallel.DistributedDataParallel):
            return contextlib.nullcontext()
        return self.module.no_sync()

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradient of `loss` (0-dim) into the model's parameters."""
        loss.backward()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm to `max_norm`; returns the pre-clip norm (0-dim float32, detached)."""
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm).detach().float()

    def checkpoint_parts(self, model_part: str, *, kind: str = "torch", prefix: str = "") -> dict[str, Part]:
        """Its checkpoint parts, all required: the bare model as `model_part` (`kind` "hf_model" for the policy's
        Hugging Face layout, "torch" for a state dict), `<prefix>optimizer` and `<prefix>scheduler`."""
        return {model_part: Part(self.model, kind), f"{prefix}optimizer": Part(self.optimizer),
                f"{prefix}scheduler": Part(self.scheduler)}

    def optimizer_step(self) -> torch.Tensor:
        """Step the optimizer and then the schedule, and zero the gradients.

        Returns:
            the learning rate the step applied (of the first parameter group; 0-dim float32), read before the
            schedule moves it to the next step's value.
        """
        lr = torch.tensor(float(self.optimizer.param_groups[0]["lr"]))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return lr


def build_trained_model(config, dist: DistributedContext, model: torch.nn.Module, *, name: str,
                        lr: Optional[float] = None) -> TrainedModel:
    """`model` on the device, wrapped for data parallelism, with AdamW + the LR schedule of `config.optim` (peak
    `lr`, default `optim.learning_rate`) over `config.train.max_steps` optimizer steps.

    Raises:
        ConfigError: for an engine other than ddp (`dist.strategy`), until the sharded engines exist.
    """
    if dist.strategy != "ddp":
        raise ConfigError(f"distributed.strategy: {dist.strategy} is not implemented yet (only ddp trains today)")
    o = config.optim
    model = model.to(dist.device)
    optimizer = build_optimizer(model.parameters(), lr=lr or o.learning_rate, betas=(o.adam_beta1, o.adam_beta2),
                                eps=o.adam_epsilon, weight_decay=o.weight_decay)
    scheduler = build_scheduler(optimizer, name=o.lr_scheduler_type, warmup_steps=o.warmup_steps,
                                total_steps=config.train.max_steps, decay_ratio=o.decay_ratio)
    return TrainedModel(name=name, module=dist.prepare_model(model), optimizer=optimizer, scheduler=scheduler,
                        dist=dist)


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of `model` in eval mode with every parameter frozen (the reference policy)."""
    return copy.deepcopy(model).eval().requires_grad_(False)


def apply_model_options(config, policy: torch.nn.Module) -> torch.nn.Module:
    """Model options applied before a strategy is built: MoE sparse upcycling of the dense MLPs when
    `model.moe_num_experts > 0` (`astrai.models.moe.convert_to_moe`, router seeded by `train.seed`), so the
    reference, critic and engine copies made by the builders are MoE models too. A policy loaded from an MoE
    checkpoint stays as saved. Returns `policy`.

    Raises:
        ConfigError: the loaded model is MoE with other settings than `model.moe_*`.
    """
    m = config.model
    loaded = policy.config.num_local_experts
    if m.moe_num_experts and loaded:  # an MoE checkpoint: keep it when the settings agree
        wanted = (m.moe_num_experts, m.moe_top_k, m.moe_num_shared_experts)
        have = (loaded, policy.config.num_experts_per_tok, policy.config.n_shared_experts)
        if wanted != have:
            raise ConfigError(f"model.moe_num_experts: {m.path} is already an MoE model (experts, top-k, "
                              f"shared = {have}), the config asks for {wanted}; set model.moe_num_experts 0 to "
                              f"train it as saved")
    elif m.moe_num_experts:
        convert_to_moe(policy, num_experts=m.moe_num_experts, top_k=m.moe_top_k,
                       num_shared_experts=m.moe_num_shared_experts, aux_loss_coef=m.moe_aux_loss_coef,
                       seed=config.train.seed)
    return policy


def moe_aux_loss(model: torch.nn.Module, num_micro_batches: int
                 ) -> tuple[Optional[torch.Tensor], dict[str, torch.Tensor]]:
    """The weighted MoE load-balancing loss of `model`'s latest forward divided by `num_micro_batches` (so the
    step's sum is the per-forward mean), with the metric shares `moe/aux_loss` and `moe/weighted_aux_loss`;
    `(None, {})` for a dense model. See `astrai.models.moe` (Switch/GShard auxiliary loss)."""
    found = collect_aux_loss(model)
    if found is None:
        return None, {}
    aux, weighted = (x / num_micro_batches for x in found)
    return weighted, {"moe/aux_loss": aux.detach(), "moe/weighted_aux_loss": weighted.detach()}
