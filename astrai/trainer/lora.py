"""LoRA training (`model.lora`): adapters injected with the `peft` library into astrai's own modules, the base frozen
(Hu et al. 2022; "LoRA Without Regret", Schulman et al. 2025, for RL at low rank with a ~10x learning rate).

- `apply_lora` injects `peft` LoRA layers (`peft.inject_adapter_in_model`) into the target projections of a policy,
  critic or reward model and freezes everything but the adapters and the model's scalar head (`value_head`,
  `score`: trained whole).
- The rollout engine keeps a plain copy and receives MERGED weights at each sync (`merged_weights`: W + s B A,
  one layer at a time, streamed as `TrainedModel.full_weights` streams: no second full copy).
- The reference model is the base with the adapters off, never a copy: under ddp / zero1 / zero2 a plain model
  SHARING the policy's frozen base tensors (`shared_base_model`), under fsdp2 / zero3 (whose parameters are
  partitioned in place) the policy module itself called with its adapters switched off (`AdaptersOff`).
- Checkpoints: the policy's adapters in PEFT's format (`LoraCheckpointState`: the part kind "peft",
  `adapter_config.json` + `adapter_model.safetensors`), a critic's adapters and head as its torch part, each with
  the optimizer state of what it trains; `models.lora_merge` merges them into a plain model for serving and export.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Iterator, Mapping, Optional

import torch

from astrai.checkpoint import CheckpointError
from astrai.config import LORA_TARGET_MODULES, ConfigError
from astrai.deps import unavailable_reason
from astrai.models.lora_merge import module_name, peft_name
from astrai.models.loading import model_reference

__all__ = ["AdaptersOff", "DEFAULT_TARGET_MODULES", "LoraSettings", "LoraCheckpointState", "apply_lora",
           "lora_settings", "lora_summary", "merged_weights", "shared_base_model", "LoraAdapters"]

DEFAULT_TARGET_MODULES = LORA_TARGET_MODULES  # the config owns the default
"""The attention and MLP projections of every decoder block (the issue's and PEFT's usual "all-linear")."""
HEADS = ("value_head", "score")
"""The scalar heads of astrai's critic and reward model: trained whole under LoRA."""


@dataclasses.dataclass(frozen=True)
class LoraSettings:
    """`model.lora`, resolved: rank `r`, `alpha` (default 2 r), `dropout`, `target_modules`, `use_rslora`, and the
    base model (`model.path` as `astrai.models.loading.model_reference` records it in `adapter_config.json`'s
    `base_model_name_or_path`: a local path made absolute, an alias the absolute path of its file, a Hub id the id,
    which peft and astrai load from the Hub or its cache) and its Hub revision (`model.revision`, recorded
    as PEFT's `revision`; None = main)."""

    r: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...]
    use_rslora: bool
    base_model: str
    base_revision: Optional[str] = None

    @property
    def scaling(self) -> float:
        """s = alpha / r (alpha / sqrt(r) with rsLoRA)."""
        return self.alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def adapter_config(self, *, task_type: str = "CAUSAL_LM", modules_to_save: Optional[list[str]] = None) -> dict:
        """The `adapter_config.json` PEFT writes for these settings (`peft.LoraConfig.to_dict`)."""
        import peft

        d = peft.LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout, bias="none",
                            target_modules=list(self.target_modules), use_rslora=self.use_rslora,
                            task_type=task_type, modules_to_save=modules_to_save,
                            base_model_name_or_path=self.base_model, revision=self.base_revision,
                            inference_mode=True).to_dict()
        return {k: sorted(v) if isinstance(v, set) else v for k, v in d.items()}


def lora_settings(config) -> Optional[LoraSettings]:
    """The job's LoRA settings, or None when `model.lora` is empty.

    Raises:
        ConfigError: `model.lora` set but the `peft` package missing (one line with the install command) or
            installed but failing to import (the import error's first line).
    """
    lora = config.model.lora
    if not lora:
        return None
    reason = unavailable_reason("peft", needed_by="model.lora", install="pip install 'astrai[lora]'")
    if reason is not None:
        raise ConfigError(reason)
    return LoraSettings(r=lora.r, alpha=2.0 * lora.r if lora.alpha is None else lora.alpha, dropout=lora.dropout,
                        target_modules=tuple(lora.target_modules),
                        use_rslora=lora.use_rslora, base_model=model_reference(config.model.path),
                        base_revision=config.model.revision)


def lora_summary(config, model: torch.nn.Module) -> str:
    """"" without `model.lora`; else ``"; LoRA r=R (alpha A) on q_proj, ...: N.NNM trained parameters (P% of the
    model)"`` for `model` before its adapters are injected (each targeted Linear (in, out) trains r * (in + out)),
    as the start-up and `--check` lines show it.

    Raises:
        ConfigError: from `check_lora_fits` (so `--check` refuses what the start would).
    """
    settings = lora_settings(config)
    if settings is None:
        return ""
    trained = sum(settings.r * (m.in_features + m.out_features) for _, m in check_lora_fits(model, settings))
    total = sum(p.numel() for p in model.parameters())
    return (f"; LoRA r={settings.r} (alpha {settings.alpha:g}) on {', '.join(settings.target_modules)}: "
            f"{trained / 1e6:.2f}M trained parameters ({100 * trained / total:.1f}% of the model)")


def check_lora_fits(model: torch.nn.Module, settings: LoraSettings) -> list[tuple[str, torch.nn.Linear]]:
    """Refuse a `model.lora` that cannot train low-rank adapters on `model` (before any adapter is injected);
    returns the targeted Linears as (module name, module).

    Raises:
        ConfigError: a `target_modules` entry that names no Linear projection of the model; or `r` not below
            min(in, out) of the narrowest targeted Linear (such an adapter trains at least as many numbers as the
            weight itself: r (in + out) >= in out).
    """
    linear = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    projections = sorted({name.rpartition(".")[2] for name in linear})
    present = {name.rpartition(".")[2] for name, _ in model.named_modules()}
    for target in settings.target_modules:
        if target not in projections:
            what = "is not a Linear projection" if target in present else "names no module of the model"
            raise ConfigError(f"model.lora: target_modules entry {target!r} {what} (its projections: "
                              f"{', '.join(projections)})")
    if "lm_head" in settings.target_modules and getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        raise ConfigError("model.lora: target_modules entry 'lm_head' shares its weight with embed_tokens "
                          "(tie_word_embeddings); adapters on a tied output layer are not supported")
    targeted = [(n, m) for n, m in linear.items() if n.rpartition(".")[2] in settings.target_modules]
    name, module = min(targeted, key=lambda item: min(item[1].in_features, item[1].out_features))
    limit = min(module.in_features, module.out_features)
    if settings.r >= limit:
        raise ConfigError(f"model.lora.r: {settings.r} is not below {limit}, the smaller side of {name} "
                          f"({module.in_features} -> {module.out_features}), the narrowest targeted projection; a "
                          f"low-rank adapter needs r < {limit} (typical: 8-64)")
    return targeted


def apply_lora(model: torch.nn.Module, settings: LoraSettings) -> torch.nn.Module:
    """Inject LoRA layers into `model`'s target modules (in place; A initialised by peft's Kaiming init from torch's
    RNG, B zero, so the model's outputs are unchanged) and freeze every parameter but the adapters and the heads.
    Returns `model`.

    Raises:
        ConfigError: `check_lora_fits` refuses the settings (an entry naming no Linear projection, a tied
            lm_head, a rank not below the narrowest target's side).
    """
    import peft

    check_lora_fits(model, settings)
    config = peft.LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout, bias="none",
                             target_modules=list(settings.target_modules), use_rslora=settings.use_rslora)
    peft.inject_adapter_in_model(config, model)
    for name, param in model.named_parameters():
        param.requires_grad_(trained_by_lora(name))
    return model


def trained_by_lora(name: str) -> bool:
    """Whether the parameter `name` of a LoRA model is trained: an adapter tensor or a head's."""
    return ".lora_" in name or name.split(".")[0] in HEADS


def shared_base_model(policy: torch.nn.Module) -> torch.nn.Module:
    """A frozen, eval-mode model of `policy`'s class whose tensors ARE `policy`'s (shared storage, no copy): the
    reference of a LoRA run, since LoRA never changes the base weights. Call before the adapters are injected."""
    with torch.device("meta"):
        view = type(policy)(policy.config)
    view.load_state_dict(policy.state_dict(), assign=True)
    if hasattr(view, "tie_weights"):
        view.tie_weights()
    rotary = getattr(getattr(view, "model", None), "rotary_emb", None)
    if rotary is not None:
        rotary.reset_table(next(policy.parameters()).device)
    for param in view.parameters():
        param.requires_grad_(False)
    return view.eval()


class AdaptersOff(torch.nn.Module):
    """The reference policy of a LoRA run as a view: calling it calls `policy` (the SAME module object, so whatever
    an engine later does to it in place, FSDP2's `fully_shard` or ZeRO-3's partitioning hooks, applies) with every
    LoRA adapter switched off (peft's `BaseTunerLayer.enable_adapters(False)`, restored after the call): the base
    model's outputs, from the policy's own (partitioned) base weights, with no copy. For reference log-probs
    without grad; the policy is not registered as a submodule, so the view has no parameters of its own. Takes
    what `policy` takes (packed rows included: `packed_rows`) and returns what it returns."""

    packed_rows = True
    """`astrai.forward.supports_packing`: the policy is astrai's model, which takes padding-free packed rows."""

    def __init__(self, policy: torch.nn.Module):
        super().__init__()
        object.__setattr__(self, "policy", policy)

    def forward(self, *args, **kwargs):
        from peft.tuners.tuners_utils import BaseTunerLayer

        layers = [m for m in self.policy.modules() if isinstance(m, BaseTunerLayer)]
        for layer in layers:
            layer.enable_adapters(False)
        try:
            return self.policy(*args, **kwargs)
        finally:
            for layer in layers:
                layer.enable_adapters(True)


@torch.no_grad()
def merged_weights(named: Iterable[tuple[str, torch.Tensor]], scaling: float) -> Iterator[tuple[str, torch.Tensor]]:
    """The plain model's (name, tensor) of a LoRA model's state stream: ``<m>.base_layer.weight`` with its
    ``<m>.lora_A.default.weight`` / ``lora_B`` becomes ``<m>.weight = W + scaling * B @ A`` (float32 math, W's
    dtype), other tensors pass under their names; one module's tensors are held at a time (copied, since a stream
    may free a tensor after the next item)."""
    held: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        for part in ("base_layer", "lora_A", "lora_B"):
            marker = f".{part}."
            if marker in name:
                module, _, leaf = name.partition(marker)
                if part == "base_layer" and leaf != "weight":  # a base bias: unchanged
                    yield f"{module}.{leaf}", tensor
                    break
                held.setdefault(module, {})[part] = tensor.detach().clone()
                pieces = held[module]
                if len(pieces) == 3:
                    w, a, b = pieces["base_layer"], pieces["lora_A"], pieces["lora_B"]
                    yield f"{module}.weight", (w.float() + scaling * (b.float() @ a.float())).to(w.dtype)
                    del held[module]
                break
        else:
            if ".lora_" not in name:  # dropout modules hold no tensors; other adapter bookkeeping is skipped
                yield name, tensor


class LoraCheckpointState:
    """What a LoRA-trained model puts in a checkpoint: only its trained tensors (adapters, heads), under PEFT's names
    for the "peft" part kind and its own for a "torch" part; loading puts them back and leaves the base (rebuilt
    from `model.path`) alone.

    Args:
        obj: the engine's model part object (the module, or a sharded model's `FullModelState`: `state_dict()`,
            on rank 0 only, and `load_state_dict(state, strict=False)`); settings: the LoRA settings;
        trained: the names of the model's trained tensors (every rank knows them; a gathered state only rank 0).
        peft_names: PEFT's names; task_type, modules_to_save: recorded in `adapter_config.json`.
    """

    def __init__(self, obj: Any, settings: LoraSettings, *, trained: Iterable[str], peft_names: bool,
                 task_type: str = "CAUSAL_LM", modules_to_save: Optional[list[str]] = None):
        self.obj, self.settings, self.peft_names = obj, settings, peft_names
        self.trained = frozenset(trained)
        self.task_type, self.modules_to_save = task_type, modules_to_save
        self.config = getattr(obj, "config", None)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The trained tensors (PEFT names with `peft_names`)."""
        return {(peft_name(k) if self.peft_names else k): v for k, v in self.obj.state_dict().items()
                if trained_by_lora(k)}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Put saved trained tensors back.

        Raises:
            CheckpointError: tensors that are not this model's trained ones (another `model.lora`)."""
        own = {(module_name(k) if self.peft_names else k): v for k, v in state.items()}
        if set(own) != self.trained:
            missing, extra = sorted(self.trained - set(own)), sorted(set(own) - self.trained)
            raise CheckpointError(f"the checkpoint's adapters do not fit this model.lora (missing {missing[:3]}, "
                             f"unexpected {extra[:3]}); resume with the checkpoint's model.lora")
        self.obj.load_state_dict(own, strict=False)

    def adapter_config(self) -> dict:
        """`adapter_config.json` (the "peft" part kind writes it)."""
        return self.settings.adapter_config(task_type=self.task_type, modules_to_save=self.modules_to_save)


class LoraAdapters:
    """A trained model's LoRA adapters (`astrai.distributed.sharding.Adapters`): the weights it hands the rollout
    engine are merged (`merged_weights`), its checkpoint part holds only the trained tensors in PEFT's layout
    (`LoraCheckpointState`; a critic's as its torch part).

    Args:
        settings: the job's LoRA settings.
        trained: the names of the trained parameters (adapters, and a value or score head), after injection.
        heads: the model's heads that are trained in full (`HEADS` it has): a model with one is checkpointed as a
            sequence classifier (task type SEQ_CLS) with the head in `modules_to_save`.
    """

    def __init__(self, settings: LoraSettings, *, trained: list[str], heads: list[str]):
        self.settings, self.trained, self.heads = settings, trained, heads

    @classmethod
    def inject(cls, model: torch.nn.Module, settings: LoraSettings) -> "LoraAdapters":
        """Inject adapters into `model` (`apply_lora`) and describe them."""
        apply_lora(model, settings)
        return cls(settings, trained=[n for n, p in model.named_parameters() if p.requires_grad],
                   heads=[h for h in HEADS if hasattr(model, h)])

    def merged(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The plain model's stream: W + s B A per adapted Linear (`merged_weights`)."""
        return merged_weights(weights, self.settings.scaling)

    def checkpoint_view(self, obj, kind: str):
        """A policy's (or reward model's) adapters in PEFT's layout instead of the full model ("peft" part); a
        critic's adapters and head as its torch part."""
        if kind == "hf_model":
            task = "SEQ_CLS" if self.heads else "CAUSAL_LM"
            return LoraCheckpointState(obj, self.settings, trained=self.trained, peft_names=True, task_type=task,
                                       modules_to_save=self.heads or None), "peft"
        return LoraCheckpointState(obj, self.settings, trained=self.trained, peft_names=False), kind
