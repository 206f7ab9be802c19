"""The models of a job as the trainer holds them: trained models (`astrai.distributed.sharding.TrainedModel`: a
model with its optimizer and schedule under the run's data-parallel engine, the unit `Trainer.accumulate_and_step`
steps) built from the config, frozen reference copies, the frozen teacher(s) of on-policy distillation
(`distill.teacher`, or `distill.teachers` routed by a data column; each checked to share the student's
tokenizer), and the model options applied before a learner is built (MoE).
"""

from __future__ import annotations

import copy
import re
from typing import Optional

import torch

from astrai.config import PARTITIONED_STRATEGIES, ConfigError, served_url
from astrai.distributed.sharding import TrainedModel, prepare_reference, prepare_trained
from astrai.experience.served_teacher import ServedTeacher
from astrai.experience.teachers import TeacherRoutes, check_routes
from astrai.checkpoint import load_model
from astrai.models.moe import collect_aux_loss, convert_to_moe
from astrai.trainer.lora import AdaptersOff, LoraAdapters, lora_settings, shared_base_model
from astrai.trainer.optim import build_optimizer, build_scheduler

__all__ = ["TrainedModel", "apply_model_options", "build_trained_model", "check_teacher_routes", "frozen_copy",
           "load_teacher", "load_teachers", "local_teacher_configs", "moe_aux_loss", "reference_model", "teacher_model",
           "vocabulary_mismatch"]


def build_trained_model(config, dist, model: torch.nn.Module, *, name: str,
                        lr: Optional[float] = None) -> TrainedModel:
    """`model` under the run's engine (`dist.strategy`: ddp, fsdp2, zero1-3), with AdamW (fused where
    `optim.fused_supported`, never under DeepSpeed) and the LR schedule of
    `config.optim` (peak `lr`, default `optim.learning_rate`) over `config.train.max_steps` optimizer steps. Copies
    of the model that must stay whole (the rollout engine's, the reference) are made before this call. With
    `model.lora` the model gets its adapters here (`lora.LoraAdapters.inject`), the optimizer only the trained
    parameters, and the trained model the adapters (its `full_weights` merge them for the engine; its checkpoints
    hold only the trained tensors)."""
    o = config.optim
    # DeepSpeed steps the torch optimizer over its own flat fp32 partitions: keep torch's default implementation
    # there. Elsewhere fused AdamW where every parameter allows it (not FSDP2's DTensor shards).
    fused = False if dist.strategy.startswith("zero") else None

    def optimizer(module: torch.nn.Module) -> torch.optim.Optimizer:
        return build_optimizer([p for p in module.parameters() if p.requires_grad], lr=lr or o.learning_rate, betas=(o.adam_beta1, o.adam_beta2),
                               eps=o.adam_epsilon, weight_decay=o.weight_decay, fused=fused)

    def scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        return build_scheduler(opt, name=o.lr_scheduler_type, warmup_steps=o.warmup_steps,
                               total_steps=config.train.max_steps, decay_ratio=o.decay_ratio)

    settings = lora_settings(config)
    # adapters are injected into this model only: the engine and reference copies stay plain
    adapters = LoraAdapters.inject(model, settings) if settings is not None else None
    return prepare_trained(dist, name, model, optimizer=optimizer, scheduler=scheduler,
                           max_grad_norm=o.max_grad_norm, adapters=adapters)


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of `model` in eval mode with every parameter frozen."""
    return copy.deepcopy(model).eval().requires_grad_(False)


SHARED_BASE_STRATEGIES = ("ddp", "zero1", "zero2")
"""Engines that keep every parameter whole on each rank: a LoRA run's reference can share the policy's base."""


def reference_model(dist, policy: torch.nn.Module, config=None) -> torch.nn.Module:
    """The frozen reference policy, made before `policy` is sharded or given adapters. With LoRA (`model.lora` of
    `config`) it is the base, never a copy, since LoRA never changes it: under ddp / zero1 / zero2 a plain model of
    the policy's own frozen tensors (`lora.shared_base_model`), under fsdp2 / zero3, which partition the policy in
    place, the policy module itself called with its adapters off (`lora.AdaptersOff`). Without LoRA, a copy of
    `policy` prepared for inference only under the run's engine (`astrai.distributed.sharding.prepare_reference`: partitioned under
    fsdp2 and zero3, never given an optimizer)."""
    if config is not None and config.model.lora:
        policy = policy.to(dist.device)
        if dist.strategy in SHARED_BASE_STRATEGIES:
            return shared_base_model(policy)
        return AdaptersOff(policy)
    return prepare_reference(dist, frozen_copy(policy))


def vocabulary_mismatch(student, teacher) -> Optional[str]:
    """Why tokenizer `teacher` does not spell text as tokenizer `student` does (`astrai.models.Tokenizer`s), or None
    when they share one vocabulary: the same size and the same token -> id map (added tokens included)."""
    if student.vocab_size != teacher.vocab_size:
        return f"its tokenizer has {teacher.vocab_size} tokens, the student's {student.vocab_size}"
    ours, theirs = (t.backend.get_vocab(with_added_tokens=True) for t in (student, teacher))
    if ours != theirs:
        token = min((t for t in ours if theirs.get(t) != ours[t]), key=ours.get)
        return f"token {token!r} is id {ours[token]} for the student, {theirs.get(token)} for the teacher"
    return None


def load_teacher(config, tokenizer, *, device: torch.device | str = "cpu", path: Optional[str] = None,
                 field: str = "distill.teacher") -> torch.nn.Module | ServedTeacher:
    """The teacher of on-policy distillation: `distill.teacher` (or `path`, the teacher named by the config field
    `field`: one of `distill.teachers`) loaded as `model.path` is (`astrai.checkpoint.load_model`,
    `model.dtype`, on `device`), in eval mode with every parameter frozen, once it is checked to score the
    student's token ids: its tokenizer equals the student's `tokenizer` (`vocabulary_mismatch`; cross-tokenizer
    distillation is out of scope), its embedding holds every id of it, and its context (`max_position_embeddings`)
    holds the longest sequence the rollout makes (`data.max_prompt_length + rollout.max_new_tokens`). A URL
    (`http://host:8000/v1`, the API root as given) is a served teacher instead
    (`astrai.experience.served_teacher.ServedTeacher`), checked to spell the student's tokens and, where the server
    says its `max_model_len`, to hold that sequence too. Also what `--check` runs.

    Raises:
        ConfigError: one line naming `field`, for a URL of another scheme than http / https, another
            tokenizer, too small an embedding or too short a context; FileNotFoundError / NotADirectoryError /
            ValueError from loading, their message prefixed with `{field}: `; TeacherServerError (a
            ValueError) for a server that does not answer, or answers with another tokenizer.
    """
    path = config.distill.teacher if path is None else path
    scheme = _URL_SCHEME.match(path.strip())
    if scheme and not served_url(path):
        raise ConfigError(f"{field}: {path} is a URL of scheme {scheme.group(1)}; a served teacher is an "
                          f"http:// or https:// URL (the API root, e.g. http://host:8000/v1), a local one a model "
                          f"name, directory or .gguf file")
    if served_url(path):
        served = ServedTeacher(path, field=field)
        served.check_tokenizer(tokenizer)
        _check_teacher_context(config, served.max_model_len, "max_model_len", path, field)
        return served
    try:
        teacher, teacher_tokenizer = load_model(path, hashes=config.checkpoint.verify_on_load,
                                                dtype=getattr(torch, config.model.dtype), device=device)
    except (FileNotFoundError, NotADirectoryError) as err:
        raise type(err)(f"{field}: {err}") from None
    except ValueError as err:  # a file that is no model, a bad config.json ...: named as the teacher's
        raise ConfigError(f"{field}: {' '.join(str(err).split())}") from None
    why = vocabulary_mismatch(tokenizer, teacher_tokenizer)
    if why is not None:
        raise ConfigError(f"{field}: {path} does not share the student's tokenizer ({config.model.path}): "
                          f"{why}; the teacher scores the student's token ids, so cross-tokenizer distillation is "
                          f"not supported")
    if teacher.config.vocab_size < tokenizer.vocab_size:
        raise ConfigError(f"{field}: {path} has vocab_size={teacher.config.vocab_size} embedding rows for "
                          f"a tokenizer of {tokenizer.vocab_size} tokens")
    _check_teacher_context(config, teacher.config.max_position_embeddings, "max_position_embeddings", path, field)
    return teacher.eval().requires_grad_(False)


def load_teachers(config, tokenizer, *, device: torch.device | str = "cpu"
                  ) -> dict[str, torch.nn.Module | ServedTeacher]:
    """Every teacher of the job by route: {"": `load_teacher`} for `distill.teacher`, or one per route of
    `distill.teachers` (each checked as `load_teacher` checks one, its errors naming `distill.teachers.<route>`;
    routes naming the same teacher share one loaded copy); {} without distillation."""
    distill = config.distill
    if not distill.teachers:
        return {"": load_teacher(config, tokenizer, device=device)} if distill.teacher else {}
    loaded: dict[str, torch.nn.Module | ServedTeacher] = {}
    out = {}
    for route, path in distill.teachers.items():
        key = path.strip()
        if key not in loaded:
            loaded[key] = load_teacher(config, tokenizer, device=device, path=path, field=f"distill.teachers.{route}")
        out[route] = loaded[key]
    return out


def local_teacher_configs(teachers: dict) -> dict[str, object]:
    """The model configs of the distinct local teachers of `load_teachers`' answer, by route (the first route of a
    shared one): what the memory plan counts (served teachers hold no memory here)."""
    seen, out = set(), {}
    for route, teacher in teachers.items():
        if isinstance(teacher, torch.nn.Module) and id(teacher) not in seen:
            seen.add(id(teacher))
            out[route] = teacher.config
    return out


_URL_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
"""A URL's scheme (`ftp://...`): a teacher named so is a server, never a path."""


def _check_teacher_context(config, context: Optional[int], name: str, path: str, field: str) -> None:
    """ConfigError naming `field` (the teacher `path`'s) when the teacher's `context` (its `name`:
    `max_position_embeddings`, or a server's `max_model_len`; None: unknown, not checked) is shorter than the
    rollout's longest sequence, `data.max_prompt_length + rollout.max_new_tokens` tokens, all of which the teacher
    scores."""
    need = config.data.max_prompt_length + config.rollout.max_new_tokens
    if context is not None and context < need:
        raise ConfigError(f"{field}: {path} has {name}={context}, fewer than the "
                          f"{need} tokens it must score (data.max_prompt_length {config.data.max_prompt_length} + "
                          f"rollout.max_new_tokens {config.rollout.max_new_tokens}); use a teacher with a longer "
                          f"context or lower them")


def teacher_model(dist, config, tokenizer) -> torch.nn.Module | ServedTeacher | TeacherRoutes:
    """The frozen teacher of `distill.teacher` (`load_teacher`) prepared for inference like the reference model
    (`astrai.distributed.sharding.prepare_reference`: partitioned under fsdp2 and zero3, whole on every rank
    otherwise), or the served teacher (each rank sends its own rows). Always its own model: under LoRA too (where
    the reference is the policy's shared base), since the teacher's weights are not the student's. With
    `distill.teachers`, every teacher so (`load_teachers`: one copy per distinct teacher) behind a
    `teachers.TeacherRoutes` routing the rows by `distill.route_field`; with local teachers partitioned over several
    ranks, the ranks agree on the rows each one scores (`TeacherRoutes.agree_counts`, a max over the ranks)."""
    if not config.distill.teachers:
        teacher = load_teacher(config, tokenizer)
        return teacher if isinstance(teacher, ServedTeacher) else prepare_reference(dist, teacher)
    prepared: dict[int, torch.nn.Module | ServedTeacher] = {}
    routes = {}
    for route, teacher in load_teachers(config, tokenizer).items():
        if id(teacher) not in prepared:
            prepared[id(teacher)] = teacher if isinstance(teacher, ServedTeacher) else prepare_reference(dist, teacher)
        routes[route] = prepared[id(teacher)]
    partitioned = dist.world_size > 1 and dist.strategy in PARTITIONED_STRATEGIES
    agree = (lambda counts: dist.all_reduce_max(counts.to(dist.device)).cpu()) if partitioned else None
    return TeacherRoutes(routes, route_field=config.distill.route_field, agree_counts=agree,
                         source=_data_name(config))


def _data_name(config) -> str:
    """How messages name the job's prompt data: `data.path`, or `data.mixture` (a row's index is then its position
    in the blend)."""
    return "data.mixture" if config.data.mixture else config.data.path


def check_teacher_routes(config, records) -> None:
    """With `distill.teachers`, refuse prompt `records` (as the online train types read them) that the teachers
    cannot route (`teachers.check_routes`: the `distill.route_field` column in no row, or a row whose value names no
    teacher without a `default` one); nothing otherwise. Run at start-up and by `--check`.

    Raises:
        ValueError: one line naming the field and the data (and, for a row, its value and index).
    """
    d = config.distill
    if d.teachers:
        check_routes(records, tuple(d.teachers), d.route_field, source=_data_name(config))


def apply_model_options(config, policy: torch.nn.Module) -> torch.nn.Module:
    """Model options applied before a learner is built: MoE sparse upcycling of the dense MLPs when
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
