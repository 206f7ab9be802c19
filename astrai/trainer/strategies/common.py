"""Pieces shared by the strategies: row chunking, global token counts, metric accumulation, the accumulated
policy-gradient update over a minibatch of rollout samples (online/offline GRPO), engine weight sync, the
rollout plumbing of the online train types, the policy optimizer + schedule, the resume state of the strategies
that keep none of their own (`SamplerOnlyState`) and prompt encoding for the offline data (`prompt_ids_and_budget`).

Loss aggregation (docs/conventions.md section 2): every token-mean loss is divided by the GLOBAL number of real
tokens of the optimizer step (all micro-batches, all ranks) and multiplied by `dist.loss_scale()` before
`backward()`, so the summed gradient is the same however the step's data is split into micro-batches or ranks.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional

import torch

from astrai.algos import masked_mean
from astrai.data import PromptSampler
from astrai.rollout.result import RolloutResult
from astrai.rollout.scoring import response_logprobs

LossFn = Callable[[torch.Tensor, RolloutResult, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""(logprobs (b, T) float32 with grad, micro-batch, global token count 0-dim) -> (loss share, metric shares)."""


def row_chunks(rows: int, size: int) -> Iterator[torch.Tensor]:
    """Consecutive row-index tensors (1-D int64) of at most `size` rows covering `range(rows)`.

    Raises:
        ValueError: when `size < 1`.
    """
    if size < 1:
        raise ValueError(f"row_chunks: size must be >= 1, got {size}")
    for start in range(0, rows, size):
        yield torch.arange(start, min(rows, start + size))


def token_counts(mask: torch.Tensor, dist) -> tuple[torch.Tensor, torch.Tensor]:
    """(real tokens on this rank, real tokens over all ranks) of `mask` (any shape, bool/0-1), 0-dim int64
    tensors clamped to >= 1 (one all-reduce)."""
    local_tokens = mask.sum()
    return local_tokens.clamp(min=1), dist.all_reduce_sum(local_tokens).clamp(min=1)


def accumulate(sums: dict[str, torch.Tensor], metrics: dict[str, torch.Tensor], *, weight=1.0) -> None:
    """In place: `sums[k] += weight * metrics[k].detach()` for every key of `metrics`."""
    for key, value in metrics.items():
        sums[key] = sums.get(key, 0.0) + value.detach() * weight


def add_aux_loss(model: torch.nn.Module, loss: torch.Tensor, num_micro_batches: int,
                 loss_scale: float = 1.0) -> tuple[torch.Tensor, dict]:
    """`loss` plus the weighted MoE load-balancing loss of `model`'s latest forward (`models.moe`), if any.

    The auxiliary loss is averaged over the step's micro-batches (divided by `num_micro_batches`), so the
    step's sums are the per-forward means, and by `loss_scale` (`dist.loss_scale()`, which the caller multiplies
    the result by) so that data-parallel ranks average it. Returns `(loss, metrics)` with the shares `moe/aux_loss` and
    `moe/weighted_aux_loss` (empty metrics and `loss` unchanged for a dense model).
    """
    from astrai.models.moe import collect_aux_loss

    found = collect_aux_loss(model)
    if found is None:
        return loss, {}
    aux, weighted = (x / num_micro_batches for x in found)
    return loss + weighted.to(loss.dtype) / loss_scale, {"moe/aux_loss": aux.detach(), "moe/weighted_aux_loss": weighted.detach()}


def policy_gradient_step(trainer, *, policy, optimizer, scheduler, dist, minibatch: RolloutResult,
                         micro_batch_size: int, temperature: float, loss_fn: LossFn,
                         with_entropy: bool = False) -> dict[str, torch.Tensor]:
    """One policy optimizer step over `minibatch`, accumulated over micro-batches of `micro_batch_size` rows.

    For each micro-batch: `logprobs = response_logprobs(policy, ...)` (the one scoring function the engine's
    `old_logprobs` are aligned with), `loss_fn(logprobs, micro, num_tokens)` with `num_tokens` the global real
    token count of the step, plus the weighted MoE auxiliary loss when the policy has MoE layers,
    `backward(loss * dist.loss_scale())`. Then `trainer.optimizer_step("policy", ...)`.

    Returns:
        detached 0-dim metrics: the loss_fn metrics rescaled to this rank's token mean, `policy/grad_norm`,
        `policy/lr`, `rollout/logprob_gap` (mean |logprobs - old_logprobs| over this rank's real tokens,
        measured before the step), with `with_entropy` `policy/entropy`, and `moe/*` for MoE policies.
    """
    local_tokens, num_tokens = token_counts(minibatch.sequences.action_mask, dist)
    sums: dict[str, torch.Tensor] = {}
    chunks = list(row_chunks(len(minibatch), micro_batch_size))
    for index in chunks:
        micro = minibatch.select(index)
        mask = micro.sequences.action_mask
        logprobs, entropy = response_logprobs(policy, micro.sequences, temperature=temperature,
                                              with_entropy=with_entropy)
        loss, metrics = loss_fn(logprobs, micro, num_tokens)
        total, aux = add_aux_loss(dist.unwrap(policy), loss, len(chunks), dist.loss_scale())
        (total * dist.loss_scale()).backward()
        accumulate(sums, aux)
        # loss and metrics are shares of the global token-mean: rescale to this rank's mean.
        accumulate(sums, dict(metrics, **{"policy/loss": loss}), weight=num_tokens / local_tokens)
        local = {"rollout/logprob_gap": (logprobs.detach() - micro.old_logprobs).abs()}
        if entropy is not None:
            local["policy/entropy"] = entropy
        accumulate(sums, {k: masked_mean(v.detach(), mask, num_tokens=local_tokens) for k, v in local.items()})
    sums["policy/grad_norm"] = trainer.optimizer_step("policy", dist.unwrap(policy), optimizer, scheduler)
    sums["policy/lr"] = torch.tensor(scheduler.get_last_lr()[0])
    return sums


def sync_engine(engine, policy, dist, policy_version: int) -> None:
    """Load the current policy weights into `engine` unless it already holds `policy_version`.

    Raises:
        RuntimeError: when the engine acknowledges another version.
    """
    if engine.policy_version != policy_version:
        acknowledged = engine.load_weights(dist.unwrap(policy).state_dict(), policy_version)
        if acknowledged != policy_version:
            raise RuntimeError(f"engine acknowledged version {acknowledged}, expected {policy_version}")


def build_policy_optimizer(config, model: torch.nn.Module, *, lr: Optional[float] = None):
    """AdamW + LR schedule for `model` from `config.optim` (peak `lr`, default `optim.learning_rate`), over
    `config.train.max_steps` optimizer steps. Returns `(optimizer, scheduler)`."""
    from astrai.trainer.optim import build_optimizer, build_scheduler

    o = config.optim
    opt = build_optimizer(model.parameters(), lr=lr or o.learning_rate, betas=(o.adam_beta1, o.adam_beta2),
                          eps=o.adam_epsilon, weight_decay=o.weight_decay)
    return opt, build_scheduler(opt, name=o.lr_scheduler_type, warmup_steps=o.warmup_steps,
                                total_steps=config.train.max_steps, decay_ratio=o.decay_ratio)


def apply_model_options(config, policy: torch.nn.Module) -> torch.nn.Module:
    """Model options applied before a strategy is built: MoE sparse upcycling of the dense MLPs when
    `model.moe_num_experts > 0` (`astrai.models.moe.convert_to_moe`, router seeded by `train.seed`), so the
    reference, critic and engine copies made by the builders are MoE models too. A policy loaded from an MoE
    checkpoint stays as saved. Returns `policy`.

    Raises:
        ConfigError: the loaded model is MoE with other settings than `model.moe_*`."""
    m = config.model
    loaded = policy.config.num_local_experts
    if m.moe_num_experts and loaded:  # an MoE checkpoint: keep it when the settings agree
        wanted = (m.moe_num_experts, m.moe_top_k, m.moe_num_shared_experts)
        have = (loaded, policy.config.num_experts_per_tok, policy.config.n_shared_experts)
        if wanted != have:
            from astrai.config import ConfigError

            raise ConfigError(f"model.moe_num_experts: {config.model.path} is already an MoE model (experts, top-k, "
                              f"shared = {have}), the config asks for {wanted}; set model.moe_num_experts 0 to "
                              f"train it as saved")
    elif m.moe_num_experts:
        from astrai.models.moe import convert_to_moe

        convert_to_moe(policy, num_experts=m.moe_num_experts, top_k=m.moe_top_k,
                       num_shared_experts=m.moe_num_shared_experts, aux_loss_coef=m.moe_aux_loss_coef,
                       seed=config.train.seed)
    return policy


def init_rollout_state(strategy, *, seed: int, device: torch.device) -> None:
    """Give a rollout-replaying strategy the attributes `rollout_state` saves: a sampling RNG on `device`, a
    CPU minibatch-shuffling RNG (both seeded with `seed`), no rollout, no pending minibatches, no metrics."""
    strategy.generator = torch.Generator(device=device).manual_seed(seed)
    strategy.shuffle_generator = torch.Generator().manual_seed(seed)
    strategy.rollout = None
    strategy._pending = []
    strategy._rollout_metrics = {}


def rollout_state(strategy) -> dict:
    """Resume state of a rollout-replaying strategy (attributes `generator`, `shuffle_generator`, `_pending`,
    `rollout`, `_rollout_metrics`): RNG states and the rollout in progress with its minibatches not yet run."""
    return {"sampling_rng": strategy.generator.get_state(), "shuffle_rng": strategy.shuffle_generator.get_state(),
            "pending": [index.clone() for index in strategy._pending],
            "rollout": strategy.rollout.to_state() if strategy._pending else None,
            "rollout_metrics": dict(strategy._rollout_metrics)}


def load_rollout_state(strategy, state: dict) -> None:
    """Inverse of `rollout_state` (tensors moved to `strategy.dist.device`)."""
    strategy.generator.set_state(state["sampling_rng"])
    strategy.shuffle_generator.set_state(state["shuffle_rng"])
    strategy._pending = list(state["pending"])
    strategy.rollout = (RolloutResult.from_state(state["rollout"], strategy.dist.device)
                        if state["rollout"] is not None else None)
    strategy._rollout_metrics = dict(state["rollout_metrics"])


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of `model` in eval mode with every parameter frozen (the reference policy)."""
    import copy

    return copy.deepcopy(model).eval().requires_grad_(False)


def build_online_parts(config, dist, policy, tokenizer, *, ref_model, chunk_size: int):
    """Engine, runner, prompt sampler and `next_prompts(n) -> (prompt ids, answers)` of an online train type.

    Rollouts stop on every id of `special_tokens.stop_token_ids` (the tokenizer's EOS and the model config's
    eos list), and a final stop token is not part of the text the reward sees. The prompts are encoded once,
    at load time, under `data.truncation` (`load_online_prompts`).

    Returns:
        `(engine, runner, sampler)` and `next_prompts` as a 4-tuple.

    Raises:
        DataError: for a missing or malformed prompt file, or an overlong prompt with `data.truncation=error`.
    """
    import warnings

    from astrai.models.special_tokens import stop_token_ids, strip_stop
    from astrai.rollout.paged_engine import PagedGenerationEngine
    from astrai.rollout.rewards import get_reward
    from astrai.rollout.runner import RolloutRunner
    from astrai.rollout.sampling import SamplingParams

    r = config.rollout
    engine = PagedGenerationEngine(policy, pad_token_id=tokenizer.pad_token_id)
    stops = stop_token_ids(policy.config, tokenizer)
    sampling = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_k=r.top_k,
                              top_p=r.top_p, stop_token_ids=stops)
    if sampling.truncates:
        warnings.warn("rollout.top_k/top_p truncate the sampled distribution: the trainer scores the "
                      "untruncated one, so importance ratios are biased (docs/conventions.md section 2)")
    reward = get_reward(config.reward.name)
    runner = RolloutRunner(
        engine, sampling, decode=lambda ids: tokenizer.decode(strip_stop(ids, stops), skip_special_tokens=True),
        score_fn=lambda texts, answers, ids: reward(texts, answers, format_bonus=config.reward.format_bonus),
        ref_model=ref_model, chunk_size=chunk_size)
    prompts = load_online_prompts(config, tokenizer, main=dist.is_main)
    sampler = PromptSampler(prompts, seed=config.train.seed + dist.rank, shuffle=config.data.shuffle)

    def next_prompts(batch_size: int):
        records = sampler.next_batch(batch_size)
        return [rec.prompt_ids for rec in records], [rec.answer for rec in records]

    return engine, runner, sampler, next_prompts


def _quiet(message: str) -> None:
    """A `log` that prints nothing (ranks other than the main one)."""


def load_online_prompts(config, tokenizer, *, main: bool = True) -> list:
    """`astrai.data.truncation.EncodedPrompt`s of `data.path`: chat-templated once, overlong prompts handled by
    `data.truncation` against `data.max_prompt_length`. On the `main` rank, prints what `filter` / `left` did and
    warns (count and first rows) about reference answers the reward can never match (GSM8K answers without
    `#### N`); those rows are kept (see the README: the warning is the fix, not a silent drop).

    Raises:
        DataError: for a missing or malformed prompt file, or from `encode_prompt_records`.
    """
    import warnings

    from astrai.data import PromptDataset
    from astrai.data.truncation import EncodedPrompt, encode_prompt_records
    from astrai.rollout.rewards import unscorable_answers

    d = config.data
    dataset = PromptDataset(d.path, prompt_field=d.prompt_field, answer_field=d.answer_field)
    bad = unscorable_answers(config.reward.name, [rec.answer for rec in dataset]) if d.answer_field else []
    if bad and main:
        rows = ", ".join(str(i + 1) for i in bad[:5]) + (", ..." if len(bad) > 5 else "")
        warnings.warn(f"{dataset.path}: {len(bad)} of {len(dataset)} answers ({d.answer_field!r}) have no final "
                      f"number ('#### N' or a bare number), so {config.reward.name} scores every response to "
                      f"them 0 (rows {rows})", stacklevel=2)
    ids = encode_prompt_records([rec.prompt for rec in dataset], tokenizer, system_prompt=d.system_prompt,
                                limit=d.max_prompt_length, limit_name="data.max_prompt_length",
                                policy=d.truncation, source=str(dataset.path), log=print if main else _quiet)
    return [EncodedPrompt(prompt_ids=p, answer=rec.answer, index=rec.index)
            for p, rec in zip(ids, dataset) if p is not None]


class SamplerOnlyState:
    """Resume state of a strategy whose position lives entirely in checkpointed objects: `policy` (possibly
    DDP-wrapped), `optimizer`, `scheduler`, `sampler` (the data position) and `extras` (tokenizer). Mixed into the
    sft/seq and dpo strategies (a dpo reference model is the frozen initial policy, so it is not saved)."""

    def state_dict(self) -> dict:
        """Strategy state for resume: none beyond the checkpointed objects (the data sampler holds the position)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore (see `state_dict`)."""

    def checkpoint_state(self) -> dict:
        """Policy, optimizer, schedule, data-sampler position and the extras (tokenizer)."""
        return {"policy": self.dist.unwrap(self.policy), "optimizer": self.optimizer,
                "scheduler": self.scheduler, "data_sampler": self.sampler, **self.extras}


def prompt_ids_and_budget(prompt: str, tokenizer, data, where: str) -> Optional[tuple[list[int], int]]:
    """Chat-templated ids of one record's `prompt` (system prompt applied) fitted under `data.truncation` to
    `min(data.max_prompt_length, data.max_length - 1)` tokens (room for at least one response token), and the
    number of response tokens left within `data.max_length`; None when `data.truncation=filter` drops it.

    Raises:
        DataError: naming `where` (from `astrai.data.truncation.fit_prompt`).
    """
    from astrai.data.truncation import encode_prompt, fit_prompt

    ids, question = encode_prompt(tokenizer, prompt, system_prompt=data.system_prompt, where=where)
    if data.max_prompt_length <= data.max_length - 1:
        limit, name = data.max_prompt_length, "data.max_prompt_length"
    else:
        limit, name = data.max_length - 1, "data.max_length - 1 (room for a response)"
    ids = fit_prompt(ids, question, limit=limit, limit_name=name, policy=data.truncation, where=where)
    return None if ids is None else (ids, data.max_length - len(ids))


def report_dropped(kept: int, total: int, *, source: str, dist) -> None:
    """Print (main rank) how many records `data.truncation=filter` dropped for overlong prompts.

    Raises:
        DataError: when every record was dropped.
    """
    from astrai.data import DataError

    if kept == 0:
        raise DataError(f"{source}: every prompt is too long (data.truncation=filter dropped all {total})")
    if kept < total and dist.is_main:
        print(f"data.truncation=filter: dropped {total - kept} of {total} records of {source} whose prompt is "
              f"longer than min(data.max_prompt_length, data.max_length - 1) tokens")
