"""Job configuration: one dataclass per YAML section, YAML 1.2 loading, CLI overrides, validation, dump.

A job file is sectioned YAML (``ppo: {gamma: 1.0}``). ``load_config`` reads it, applies command-line overrides
(``--ppo.gamma 0.99``, ``--ppo.gamma=0.99``, ``--ppo_gamma 0.99``, or ``--gamma 0.99`` when the name is unique
across sections) and validates every field against the spec in its dataclass metadata (type + range/choices),
then the cross-field rules in ``Config.__post_init__``. Every problem raises ``ConfigError`` with a one-line
message naming the field (or the file). Scalars follow the YAML 1.2 core schema: ``lr: 2e-5`` is a float and
``yes`` / ``on`` / ``2024-01-01`` are strings. ``dump_config`` writes YAML that ``load_config`` reads back equal.
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Union, get_origin

import yaml

from astrai import train_types
from astrai.train_types.spec import EVALUATION_ROLLOUT_FIELDS
from astrai.algos import registry
from astrai.config_schema import (BETA, GE0, GT0, REQUIRED, UNIT, Choices, ConfigError, EnvMap, NonEmpty, Pattern,
                                  Range, Record, Section, SubsetOf, YamlDumper, YamlLoader, convert_value, field_spec,
                                  field_specs, is_record, record_item, split_optional, to_raw)

TRAIN_TYPES = train_types.names()
"""Valid ``train.type`` values: the registered train types (`astrai.train_types`)."""
DISTRIBUTED_STRATEGIES = ("auto", "ddp", "fsdp2", "zero1", "zero2", "zero3")
"""Valid ``distributed.strategy`` values ("auto": the accelerate launch config's engine, else ddp)."""
REPORT_TO = ("tensorboard", "wandb", "none")
"""Valid ``train.report_to`` items (transformers' TrainingArguments name); 'none' stands alone."""
DEFAULT_REPORT_TO = ["tensorboard"] if importlib.util.find_spec("tensorboard") is not None else []
"""TensorBoard event files by default when the `tensorboard` package is installed, nothing otherwise."""
TRUNCATION_POLICIES = ("error", "filter", "left")
"""Valid ``data.truncation`` values (see ``astrai.data.truncation``)."""
ADVANTAGE_ESTIMATORS = registry.critic_free_estimators()
"""`grpo.advantage_estimator` choices: the critic-free estimators (online_ppo uses `gae`, which needs its critic)."""
ROLLOUT_CORRECTIONS = ("none", *registry.ROLLOUT_CORRECTIONS)
"""`rollout.correction` choices: the registry's corrections, or none."""
OPTIONAL_METRICS = {name: tuple(t.name for t in train_types.all_train_types() if name in t.metrics)
                    for name in dict.fromkeys(m for t in train_types.all_train_types() for m in t.metrics)}
"""Valid ``train.metrics`` names -> the train types that compute them (`TrainType.metrics`)."""


LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""`model.lora.target_modules` by default: the attention and MLP projections of every decoder layer."""


# ----------------------------------------------------------------------------------------- records
@dataclass
class LoraConfig(Record):
    """`model.lora`: LoRA adapters (Hu et al. 2021) trained instead of the weights, through peft (docs/lora.md)."""

    r: int = field_spec(REQUIRED, "adapter rank", GT0)
    alpha: Optional[float] = field_spec(None, "scale numerator (scaling alpha / r); null = 2 r", GT0)
    dropout: float = field_spec(0.0, "dropout on the adapter's input", Range(0, 1, hi_open=True))
    target_modules: list[str] = field_spec(
        list(LORA_TARGET_MODULES), "the Linear projections given adapters (default: the attention and MLP ones)",
        NonEmpty("a non-empty list of module names (omit it for the attention and MLP projections)"))
    use_rslora: bool = field_spec(False, "rank-stabilised scaling alpha / sqrt(r) (Kalajdzievski 2023)")


@dataclass
class MixtureFile(Record, item="file"):
    """One file of `data.mixture`."""

    path: str = field_spec(REQUIRED, "a prompt file or 'builtin:<name>'", Pattern(r"\s*\S.*", "a path"))
    weight: float = field_spec(1.0, "its share of the blend (0 leaves it out)", GE0)


@dataclass
class RewardFunction(Record, item="function"):
    """One item of `reward.functions` (docs/rewards.md)."""

    function: str = field_spec(REQUIRED, "'package.module:name', a name in `path` ('module:name' or 'name'), or a "
                                         "built-in name; TRL's convention, or verl's compute_score(data_source, "
                                         "solution_str, ground_truth, extra_info) told by its parameters")
    weight: float = field_spec(1.0, "its weight in the total reward")
    name: Optional[str] = field_spec(None, "the name of its metrics; null = the function's",
                                     Pattern(r"[A-Za-z0-9_.-]+", "a metric name (letters, digits, _ . -)"))
    path: Optional[str] = field_spec(None, "a .py file holding it (relative paths from the working directory)")
    kwargs: dict[str, Any] = field_spec({}, "keyword arguments passed on every call")


@dataclass
class ToolEntry(Record, item="tool"):
    """One item of `rollout.tools` (docs/agents.md)."""

    function: str = field_spec(REQUIRED, "'package.module:name', or a name in `path` ('module:name' or 'name'); a "
                                         "function with type hints and a Google-style docstring (its JSON schema)")
    path: Optional[str] = field_spec(None, "a .py file holding it (relative paths from the working directory)")
    name: Optional[str] = field_spec(None, "the name the model calls it by; null = the function's",
                                     Pattern(r"[A-Za-z_][A-Za-z0-9_.-]*", "a tool name"))


class EnvironmentReference:
    """The check of `rollout.environment`: null, "package.module:Class", {class, path}, or a non-empty mapping of
    such entries by name (the rows' `rollout.environment_field` column picks one); a mapping with a `class` or
    `path` key is one entry (docs/agents.md)."""

    def problem(self, value: Any) -> Optional[str]:
        """One line saying what is wrong with `value`, or None."""
        if isinstance(value, dict) and not ({"class", "path"} & set(value)):
            if not value:
                return "expected a class, not an empty mapping"
            for route, entry in value.items():
                if not isinstance(route, str) or not route:
                    return f"route {route!r}: expected a non-empty string as the name of a class"
                detail = self._entry(entry)
                if detail:
                    return f"{route}: {detail}"
            return None
        return self._entry(value)

    @staticmethod
    def _entry(value: Any) -> Optional[str]:
        if isinstance(value, str):
            module, sep, name = value.rpartition(":")
            return None if sep and module.strip() and name.strip() else (
                f"expected 'package.module:Class' (or {{class: Class, path: file.py}}), got {value!r}")
        if isinstance(value, dict):
            unknown = sorted(set(map(str, value)) - {"class", "path"})
            if unknown:
                return f"unknown key {unknown[0]!r} (keys: class, path)"
            name, path = value.get("class"), value.get("path")
            if not isinstance(name, str) or not name.strip():
                return f"expected {{class: 'Class' or 'module:Class', path: file.py}}, got {value!r}"
            if path is not None and (not isinstance(path, str) or not path.strip()):
                return f"path: expected a .py file, got {path!r}"
            if path is None and ":" not in name:
                return f"class {name!r}: expected 'package.module:Class', or a `path` to its file"
            return None
        return (f"expected 'package.module:Class', {{class, path}} or a mapping of them by name, got "
                f"{type(value).__name__}")

    @staticmethod
    def routes(value: Any) -> bool:
        """Whether a valid value routes rows to several classes by name."""
        return isinstance(value, dict) and not ({"class", "path"} & set(value))

    def ok(self, value: Any) -> bool:
        return self.problem(value) is None

    def describe(self, kind: str) -> str:
        return "'package.module:Class', {class, path} or a mapping of them by name"


# ----------------------------------------------------------------------------------------- sections
@dataclass
class ModelSection(Section, name="model"):
    path: str = field_spec("smollm2-135m-instruct", "model name, Hugging Face-format directory, .gguf file, or "
                                                    "Hugging Face Hub id (org/name, org/name/<file>.gguf: from the "
                                                    "cache, downloaded when online; a local path wins)",
                           Pattern(r"\s*\S.*", "a model name or path"))
    revision: Optional[str] = field_spec(None, "model.path's Hub revision (a branch, tag or commit hash); null = "
                                               "main; TRL's model_revision",
                                         Pattern(r"\S+", "a branch, tag or commit hash"))
    dtype: str = field_spec("float32", "parameter/compute dtype", Choices(("float32", "bfloat16", "float16")))
    gradient_checkpointing: bool = field_spec(False, "recompute decoder-block activations in backward")
    moe_num_experts: int = field_spec(0, "routed experts per MoE feed-forward (0 = dense model as loaded)", GE0)
    moe_top_k: int = field_spec(2, "routed experts per token", GT0)
    moe_num_shared_experts: int = field_spec(0, "always-active shared experts per MoE feed-forward", GE0)
    moe_aux_loss_coef: float = field_spec(0.01, "weight of the load-balancing auxiliary loss", GE0)
    lora: Optional[LoraConfig] = field_spec(
        None, "LoRA adapters instead of full training (through peft): {r, alpha (default 2 r), dropout (0), "
              "target_modules (default the attention and MLP projections), use_rslora (false)}; {} = off "
              "(docs/lora.md)")


@dataclass
class DataSection(Section, name="data"):
    path: str = field_spec("builtin:math_prompts", "'builtin:<name>' dataset, a .jsonl/.json/.parquet/.csv file or "
                                                   "save_to_disk directory, or a Hugging Face dataset id "
                                                   "org/name[@revision][:config[:split]] (openai/gsm8k:main:train; "
                                                   "a local path wins)")
    prompt_field: str = field_spec("question", "record field holding the prompt text")
    answer_field: str = field_spec("answer", "record field holding the reference answer (for the reward)")
    system_prompt: Optional[str] = field_spec(None, "system message prepended through the chat template (needs "
                                                    "the template: refused with raw text prompts)")
    chat_template: Optional[bool] = field_spec(
        None, "render prompts with the tokenizer's chat template: true (refused when the tokenizer has none), false "
              "(raw text: the prompt as stored, after the BOS token when the tokenizer adds one) or null (the "
              "template when the tokenizer has one, else raw text, said at start-up)")
    max_prompt_length: int = field_spec(256, "most tokens of a rendered prompt (see data.truncation)", GT0)
    truncation: str = field_spec("error", "overlong prompts (online, dpo, grpo): 'error' stops at load time, "
                                 "'filter' drops them, 'left' cuts the question's start (template kept)",
                                 Choices(TRUNCATION_POLICIES))
    shuffle: bool = field_spec(True, "shuffle prompts each epoch (seeded by train.seed)")
    messages_field: str = field_spec("messages", "sft: record field holding the chat messages (role/content list)")
    text_field: str = field_spec("text", "seq: record field holding the raw text")
    chosen_field: str = field_spec("chosen", "dpo/rm: record field holding the preferred response")
    rejected_field: str = field_spec("rejected", "dpo/rm: record field holding the dispreferred response")
    margin_field: Optional[str] = field_spec(None, "rm: optional record field holding each pair's margin (Llama 2's "
                                                   "margin loss); null = no margin")
    responses_field: str = field_spec("responses", "grpo: record field holding the G sampled responses")
    rewards_field: str = field_spec("rewards", "grpo: record field holding the G scalar rewards")
    logprobs_field: str = field_spec("logprobs", "grpo: optional field with per-token behaviour log-probs")
    max_length: int = field_spec(512, "sft/dpo/seq/grpo: tokens per training sequence (longer are truncated)", GT0)
    packing: bool = field_spec(False, "sft/seq: pack several examples into each max_length row")
    eval_path: Optional[str] = field_spec(None, "held-out question/answer set for train.eval_steps: "
                                          "'builtin:<name>', a GSM8K-format .jsonl, or a dataset id (its test "
                                          "split unless one is named: openai/gsm8k:main:test)")
    eval_limit: Optional[int] = field_spec(None, "evaluate only the first N questions of data.eval_path", GT0)
    mixture: list[MixtureFile] = field_spec([], "online prompts blended from several files instead of data.path: "
                                                "[{path, weight}], each file contributing in proportion to its "
                                                "weight (0 leaves a file out)")


@dataclass
class RewardSection(Section, name="reward"):
    name: Optional[str] = field_spec(None, "the single built-in reward (null: math_exact_match, unless "
                                           "reward.functions, reward.model_path or an environment's get_reward "
                                           "score the job)")
    functions: list[RewardFunction] = field_spec(
        [], "reward functions, each {function: 'package.module:name' or a built-in name, weight (1), name, path "
            "(a .py file holding it), kwargs}: called as fn(prompts, completions, **columns) (TRL's convention), "
            "the total is the weighted sum (docs/rewards.md)")
    model_path: Optional[str] = field_spec(
        None, "a reward model (a ...ForSequenceClassification directory, e.g. an rm checkpoint, or its Hub id) whose "
              "score joins reward.functions in the total, or alone when there are none",
        Pattern(r"\s*\S.*", "a directory path"))
    model_weight: float = field_spec(1.0, "weight of reward.model_path's score in the total reward")
    model_batch_size: int = field_spec(8, "rows per reward-model forward", GT0)
    num_workers: int = field_spec(1, "worker processes that run the reward.functions given by import path or file "
                                     "(with reward.timeout_seconds); 0 = in the trainer's process, no timeout", GE0)
    timeout_seconds: float = field_spec(60.0, "hard limit per reward call in a worker process: a call that does not "
                                              "return in time is killed and counts as an error", GT0)
    on_error: str = field_spec("score", "a reward call that raises or times out: 'score' gives its samples "
                                        "reward.error_score, 'skip' leaves them out of that reward (as None)",
                               Choices(("score", "skip")))
    error_score: float = field_spec(0.0, "the score of a sample whose reward call failed (reward.on_error score)")
    max_error_fraction: float = field_spec(0.5, "stop the job when one reward function failed on more than this "
                                                "fraction of its samples over its last reward.error_window rollouts",
                                           UNIT)
    error_window: int = field_spec(3, "rollouts (evaluation: batches) over which each reward function's failed "
                                      "fraction is judged; 1 = every rollout on its own", GT0)
    format_bonus: float = field_spec(0.0, "reward added when the response has the expected answer format", GE0)
    partial_credit: float = field_spec(0.0, "math_exact_match, in [0, 1): a wrong answer scores this times its "
                                            "closeness max(0, 1 - |answer - gold| / max(|gold|, 1)); 0 = exact only",
                                       Range(0, 1, hi_open=True))


@dataclass
class RolloutSection(Section, name="rollout"):
    batch_size: int = field_spec(8, "prompts per rollout", GT0)
    max_new_tokens: int = field_spec(64, "response length cap in tokens", GT0)
    temperature: float = field_spec(1.0, "sampling temperature (also applied when scoring log-probs); >= 1e-4",
                                    Range(1e-4))
    top_k: int = field_spec(0, "keep the k most likely tokens; 0 = off", GE0)
    top_p: float = field_spec(1.0, "nucleus sampling mass; 1 = off", Range(0, 1, lo_open=True))
    dtype: Optional[str] = field_spec(
        None, "dtype of the rollout engine's weight copy and KV cache; null = model.dtype (bfloat16 with an fp32 "
              "policy: faster rollouts, and rollout/logprob_gap then shows the rounding drift)",
        Choices(("float32", "bfloat16", "float16")))
    engine: str = field_spec("paged", "rollout engine by registered name (astrai.rollout.engine: 'paged', the paged "
                                      "continuous-batching engine; 'vllm', vLLM's offline LLM, optional: "
                                      "docs/vllm.md)", Pattern(r"[A-Za-z_][A-Za-z0-9_.-]*", "an engine name"))
    engine_options: dict[str, Any] = field_spec(
        {}, "keyword options passed to rollout.engine's factory as given (paged: max_num_seqs, max_kv_tokens, "
            "max_batch_tokens, block_size, prefix_cache, dense_decode; astrai.rollout.paged_engine.paged_engine; "
            "vllm: astrai.rollout.vllm_engine.VLLM_OPTIONS)")
    attention_backend: str = field_spec(
        "auto", "the engine's attention kernels: torch, triton, flash_attn or auto (the fastest available); the "
                "ASTR_BACKEND environment variable overrides it (docs/kernels.md)",
        Choices(("auto", "torch", "triton", "flash_attn")))
    cuda_graphs: bool = field_spec(
        False, "pad decode steps to batch-size buckets and replay them as CUDA graphs (on CUDA: needs the triton "
               "attention backend, which auto then picks; elsewhere the padded steps run eagerly); docs/kernels.md")
    tensor_parallel_size: int = field_spec(
        1, "ranks that split the rollout engine's weight copy and KV cache (attention heads, MLP, vocabulary; "
           "docs/tensor_parallel.md); must divide the world size; every rank of one group samples the same prompts. "
           "Training stays sharded over the whole world (distributed.strategy)", GT0)
    dynamic_sampling: bool = field_spec(False, "online train types with groups: resample prompts whose "
                                               "rewards are all equal (DAPO dynamic sampling) until "
                                               "rollout.batch_size groups differ")
    correction: str = field_spec(
        "none", "training-inference mismatch correction (docs/conventions.md section 7): token_tis (weight "
                "min(rho_t, token cap)), seq_tis, seq_mask (drop sequences whose ratio exceeds the sequence cap) or "
                "icepop (drop tokens outside [icepop_low, icepop_high]); on, the trainer rescores each rollout once "
                "before its first update", Choices(ROLLOUT_CORRECTIONS))
    correction_token_cap: float = field_spec(2.0, "token_tis: the cap C of the token weight", Range(1))
    correction_seq_cap: float = field_spec(3.0, "seq_tis / seq_mask: the cap C of the sequence ratio", Range(1))
    icepop_low: float = field_spec(0.5, "icepop: the lowest ratio kept", Range(0, 1, lo_open=True))
    icepop_high: float = field_spec(5.0, "icepop: the highest ratio kept", Range(1))
    max_sampling_rounds: int = field_spec(4, "dynamic_sampling: generation rounds per rollout at most; then the "
                                             "batch is filled up with all-equal groups", GT0)
    generation_batch_size: Optional[int] = field_spec(
        None, "dynamic_sampling: prompts drawn and sampled per generation round; null = rollout.batch_size. Larger "
              "rounds decode faster per token and fill the batch in fewer rounds; surplus groups are dropped. "
              "rollout.partial: groups in flight per rollout (> rollout.batch_size); null = 2 x rollout.batch_size",
        GT0)
    partial: bool = field_spec(
        False, "partial rollouts on the colocated engine (docs/async.md): decode until rollout.batch_size groups are "
               "complete, then stop; the unfinished samples keep their tokens and continue in the next rollout under "
               "the new weights (re-prefilled); multi-turn episodes (rollout.tools / rollout.environment) mid-turn "
               "or between turns. Needs rollout.max_off_policy_steps >= 1 and rollout.correction")
    max_off_policy_steps: int = field_spec(
        0, "rollout.partial: the most policy versions (optimizer steps) a trained token may lag the weights being "
           "trained; a carried sample whose oldest token would lag more is re-generated from its prompt. "
           "rollout.placement separate: >= the optimizer steps of a rollout trains one step off. 0 = synchronous "
           "rollouts", GE0)
    placement: str = field_spec(
        "colocated", "where rollouts are generated (docs/async.md): colocated (the training process's own engine "
                     "copy) or separate (each training rank's own generation process, which only generates: with "
                     "rollout.max_off_policy_steps >= the optimizer steps of a rollout it samples the next rollout "
                     "while this one trains, one step off)", Choices(("colocated", "separate")))
    generation_processes: int = field_spec(
        1, "rollout.placement separate: generation processes per training rank; each generates an even share of "
           "every rollout's prompts at once, and every weight sync streams to all of them (docs/async.md)", GT0)
    generation_device: Optional[str] = field_spec(
        None, "rollout.placement separate: the generation process's device (cpu, cuda:N; with "
              "rollout.generation_processes N > 1 the first of N consecutive GPUs); null = cpu on CPU jobs, else the "
              "GPUs after the job's own on this node (cuda:<local world size + local rank x N + i>)",
        Pattern(r"cpu|cuda:\d+", "cpu or cuda:N"))
    generation_threads: Optional[int] = field_spec(
        None, "rollout.placement separate on CPU: each generation process's torch threads; null = one step off, "
              "the training process's split evenly between it and its N generation processes, the training process "
              "keeping the rest (when runtime.num_threads is null); synchronous, the training process's split over "
              "the N generation processes (N = rollout.generation_processes)", GT0)
    generation_restarts: Optional[int] = field_spec(
        None, "rollout.placement separate: how many times a generation process that dies (killed, out of memory) "
              "is started again, its lost batch generated again, before a death stops the job (counted over a "
              "rank's rollout.generation_processes together); null = 2 where the "
              "trained weights are whole on every rank (ddp, zero1, zero2), 0 under fsdp2 / zero3 (a restart's "
              "weight sync would need every rank), where a value > 0 is refused", GE0)
    tools: list[ToolEntry] = field_spec(
        [], "tools the policy may call, each {function, path, name}: every sample becomes a multi-turn episode "
            "(turns and tool results within rollout.max_new_tokens; docs/agents.md)")
    max_turns: int = field_spec(4, "rollout.tools: policy turns per episode at most", GT0)
    max_tool_response_tokens: int = field_spec(256, "rollout.tools: most tokens of one tool result (cut and "
                                                    "marked beyond)", GT0)
    tool_response_truncation: str = field_spec("right", "rollout.tools: a long result keeps its start ('right' cut) "
                                                        "or its end ('left')", Choices(("right", "left")))
    max_parallel_tool_calls: int = field_spec(4, "rollout.tools: calls run per turn at most (the others get an error "
                                                 "result)", GT0)
    tool_workers: int = field_spec(1, "rollout.tools: worker processes running the calls (with "
                                      "rollout.tool_timeout_seconds); 0 = in the trainer's process, no timeout", GE0)
    tool_timeout_seconds: float = field_spec(30.0, "rollout.tools: hard limit per call in a worker; a call past it "
                                                   "is killed and its result is an error", GT0)
    environment: Optional[Any] = field_spec(
        None, "an environment class, one instance per episode (TRL's environment_factory): 'package.module:Class' "
              "or {class, path}, or a mapping of them by name routing each row by its rollout.environment_field "
              "column; reset(**row), public methods as tools, optional step, get_reward, close (docs/agents.md)",
        EnvironmentReference())
    environment_field: str = field_spec("environment", "rollout.environment as a mapping: the column whose value "
                                                       "names each row's class (TRL's)",
                                        Pattern(r"\S+", "a column name"))
    environment_workers: int = field_spec(1, "rollout.environment: worker processes holding the instances (with "
                                             "rollout.environment_timeout_seconds); 0 = in the trainer's process, "
                                             "no timeout", GE0)
    environment_timeout_seconds: float = field_spec(30.0, "rollout.environment: limit per call of the environment "
                                                          "(reset, a method, step, get_reward, close); the episode "
                                                          "ends, counted; a call still running at twice it is killed "
                                                          "with its worker", GT0)


@dataclass
class PolicyLossFields:
    """The policy-loss fields of the sections of the rollout-replaying train types (`ppo`, `grpo`): the loss by
    name, its aggregation and clip range (`astrai.trainer.learners.policy_loss`)."""

    policy_loss: str = field_spec("ppo_clip", "policy loss: ppo_clip (PPO-clip, decoupled range, optional dual clip), gspo "
                                              "(sequence-level ratio, Zheng et al. 2025) or cispo (clipped IS weight, "
                                              "MiniMax-M1)", Choices(tuple(registry.POLICY_LOSSES)))
    loss_agg_mode: Optional[str] = field_spec(
        None, "how per-token losses become the step's loss (verl's names); null = the loss's own: token-mean, "
              "seq-mean-token-mean for gspo; -norm divides by rollout.max_new_tokens", Choices(registry.LOSS_AGG_MODES))
    clip_ratio_low: Optional[float] = field_spec(None, "ratio kept >= 1 - clip_ratio_low; null = clip_eps "
                                                       "(gspo: 3e-4, the paper's)", GT0)
    clip_ratio_high: Optional[float] = field_spec(None, "ratio kept <= 1 + clip_ratio_high (DAPO clip-higher: "
                                                        "0.28); null = clip_eps (gspo: 4e-4)", GT0)
    clip_ratio_c: Optional[float] = field_spec(None, "ppo_clip dual clip: for A < 0 the loss is at most -A * c "
                                                     "(Ye et al. 2020; 3 is usual); null = off", Range(1, lo_open=True))


@dataclass
class PPOSection(PolicyLossFields, Section, name="ppo"):
    group_size: int = field_spec(1, "responses sampled per prompt (each its own PPO sample); >= 2 for "
                                    "rollout.dynamic_sampling", GT0)
    epochs: int = field_spec(1, "passes over each rollout", GT0)
    minibatch_size: int = field_spec(8, "samples per policy optimizer step", GT0)
    micro_batch_size: int = field_spec(4, "samples per forward/backward (gradient accumulation unit)", GT0)
    clip_eps: float = field_spec(0.2, "PPO ratio clip: ratio kept in [1 - eps, 1 + eps]", GT0)
    value_clip: Optional[float] = field_spec(0.2, "value clip around rollout values; null = unclipped", GT0)
    gamma: float = field_spec(1.0, "discount per response token", UNIT)
    gae_lambda: float = field_spec(0.95, "GAE lambda", UNIT)
    vf_coef: float = field_spec(0.1, "value-loss scale", GT0)
    kl_coef: float = field_spec(0.05, "reference-KL penalty per token in the reward; 0 = no reference model", GE0)
    kl_estimator: str = field_spec("k3", "KL estimator (Schulman 2020)", Choices(registry.KL_ESTIMATORS))
    whiten_advantages: bool = field_spec(True, "masked mean/std normalisation of advantages per rollout")
    critic_layers: Optional[int] = field_spec(
        None, "critic = the policy's first N decoder layers + final norm + value head (a smaller, faster critic); "
              "null = all layers", GT0)


@dataclass
class GRPOSection(PolicyLossFields, Section, name="grpo"):
    """GRPO (online_grpo, grpo): group size, clipping, reference KL in the loss XOR in the reward (Shao 2024)."""

    group_size: int = field_spec(4, "G: responses sampled (or stored) per prompt", Range(2))
    epochs: int = field_spec(1, "passes over each batch of groups", GT0)
    minibatch_size: int = field_spec(8, "samples (responses) per policy optimizer step", GT0)
    micro_batch_size: int = field_spec(4, "samples per forward/backward (gradient accumulation unit)", GT0)
    clip_eps: float = field_spec(0.2, "ratio clip: ratio kept in [1 - eps, 1 + eps]", GT0)
    advantage_estimator: str = field_spec(
        "grpo", "grpo (group mean/std), rloo (leave-one-out baseline), reinforce_pp (REINFORCE++: returns whitened "
                "over the batch), reinforce_pp_baseline (group mean subtracted first) or on_policy_distill "
                "(teacher minus student log-prob per token; needs distill.teacher)", Choices(ADVANTAGE_ESTIMATORS))
    gamma: float = field_spec(1.0, "reinforce_pp / reinforce_pp_baseline: discount of the reward-to-go per token", UNIT)
    kl_coef: float = field_spec(0.04, "reference-KL (k3) weight in the loss; 0 = no reference model", GE0)
    kl_reward_coef: float = field_spec(0.0, "reference-KL weight subtracted from the reward instead", GE0)
    std_eps: float = field_spec(1e-6, "epsilon added to the group std", GT0)
    std_floor: Optional[float] = field_spec(None, "lower bound on the std the rewards are divided by; null = none", GT0)
    scale_rewards: str = field_spec(
        "group", "what the group-centred rewards are divided by: the group's std (GRPO), the std of the whole "
                 "rollout's rewards on all ranks ('batch', Lite PPO) or nothing ('none', Dr. GRPO)",
        Choices(registry.SCALE_REWARDS))


class TeacherMap:
    """The check of `distill.teachers`: a mapping of route values (non-empty strings; the key `default` takes the
    rows whose value has no teacher of its own) to teachers, each as `distill.teacher` takes one."""

    def problem(self, value: dict) -> Optional[str]:
        """One line saying what is wrong with `value`, or None."""
        for route, teacher in value.items():
            if not isinstance(route, str) or not route.strip():
                return (f"route {route!r}: expected a non-empty string (the value of distill.route_field that picks "
                        f"this teacher; quote a number: '{route}')")
            if not isinstance(teacher, str) or not teacher.strip():
                hint = ""
                if teacher is None and ":" in route:  # YAML's {a:model} is the key "a:model" with no value
                    key, _, model = route.partition(":")
                    hint = f" (YAML needs a space after the colon: {{{key}: {model}}})"
                return f"{route}: expected a model name or path, or a server URL, got {teacher!r}{hint}"
        return None

    def ok(self, value: dict) -> bool:
        return self.problem(value) is None

    def describe(self, kind: str) -> str:
        return "a mapping of route values to teachers (model names, paths or server URLs)"


def served_url(teacher: Optional[str]) -> bool:
    """Whether a teacher names a server (an http:// or https:// URL) rather than a model to load."""
    return bool(teacher) and teacher.strip().lower().startswith(("http://", "https://"))


# The strategies whose ranks hold only shards of the trained weights (and under which `prepare_reference` partitions
# a frozen model: each of its forwards runs collectives).
PARTITIONED_STRATEGIES = ("fsdp2", "zero3")


@dataclass
class DistillSection(Section, name="distill"):
    """On-policy distillation (Lu and Thinking Machines Lab 2025): a frozen teacher scores the student's sampled
    tokens; read by the train types that distill (`TrainType.distills`; docs/train_types.md). One teacher
    (`teacher`), or several routed by a data column (`teachers` with `route_field`: each prompt row is scored by the
    teacher its column's value names; TRL#6734). With local teachers, `jsd_top_k` > 0 adds top-k logit distillation
    (GKD's generalised JSD over the teacher's top-k tokens, `jsd_beta`, weighted by `jsd_coef`; with `teachers` each
    row's top-k is its own route's teacher's; docs/train_types.md)."""

    teacher: Optional[str] = field_spec(
        None, "teacher model (as model.path: a name, Hugging Face-format directory or .gguf file, or the URL of an "
              "OpenAI-compatible server, http://host:8000/v1, that echoes prompt log-probs) scoring every "
              "sampled token; it must share the student's tokenizer; null = no distillation (or distill.teachers)",
        Pattern(r"\s*\S.*", "a model name or path"))
    teachers: dict[str, str] = field_spec(
        {}, "several teachers instead of distill.teacher: {route value: teacher} (each as distill.teacher takes "
            "one), every prompt row scored by the teacher its distill.route_field column names; the key 'default' "
            "scores the rows whose value has no teacher of its own (without it such a row is refused at start-up)",
        TeacherMap())
    route_field: Optional[str] = field_spec(
        None, "distill.teachers: the data column whose value names each row's teacher",
        Pattern(r"\S+", "a column name"))
    reward_weight: float = field_spec(0.0, "weight of the task reward's advantage (online_grpo: its group "
                                           "advantage; online_ppo: the score) added to the per-token "
                                           "distillation advantage; 0 = pure distillation", GE0)
    jsd_top_k: int = field_spec(0, "top-k logit distillation (GKD's generalised JSD, Agarwal et al. 2024) with a "
                                   "local distill.teacher (or local distill.teachers, each row's own): its k most "
                                   "likely tokens at every sampled position, both distributions renormalised over "
                                   "them, a loss term beside the policy loss; 0 = off", GE0)
    jsd_beta: float = field_spec(0.5, "distill.jsd_top_k: GKD's beta of the generalised JSD, 0 = forward "
                                      "KL(teacher || student), 1 = reverse KL(student || teacher)", UNIT)
    jsd_coef: float = field_spec(1.0, "distill.jsd_top_k: the weight of the JSD term in the policy loss (0: "
                                 "distill/jsd logged only, the teacher's top-k still computed)", GE0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.jsd_top_k and not (self.teacher or self.teachers):
            raise ConfigError("distill.jsd_top_k: top-k logit distillation reads a local teacher's logits; name "
                              "it in distill.teacher (or several in distill.teachers), or set distill.jsd_top_k to 0")
        served = [route for route, teacher in self.teachers.items() if served_url(teacher)]
        if self.jsd_top_k and served:
            raise ConfigError(f"distill.jsd_top_k: distill.teachers.{served[0]} is a served teacher "
                              f"({self.teachers[served[0]].strip()}), which returns only the sampled tokens' "
                              "log-probs, not its top-k logits; load every routed teacher locally or set "
                              "distill.jsd_top_k to 0")
        if self.jsd_top_k and self.served:
            raise ConfigError("distill.jsd_top_k: a served distill.teacher returns only the sampled tokens' log-probs, "
                              "not its top-k logits; load the teacher locally or set distill.jsd_top_k to 0")
        if self.teacher and self.teachers:
            raise ConfigError("distill.teachers: set together with distill.teacher; name one teacher in "
                              "distill.teacher or several routed by a column in distill.teachers, not both")
        if self.teachers and self.route_field is None:
            raise ConfigError("distill.route_field: distill.teachers routes each prompt row by a data column; name "
                              "it (e.g. distill.route_field: topic)")

    @property
    def served(self) -> bool:
        """Whether `teacher` names a server (an http:// or https:// URL) rather than a model to load."""
        return served_url(self.teacher)

    @property
    def distills(self) -> bool:
        """Whether the job distills: `teacher` or `teachers` is set."""
        return bool(self.teacher or self.teachers)

    @property
    def teacher_field(self) -> str:
        """The field that names the job's teacher(s), for messages: `distill.teachers` or `distill.teacher`."""
        return "distill.teachers" if self.teachers else "distill.teacher"

    def named_teachers(self) -> dict[str, str]:
        """Each teacher of the job by the field that names it: {"distill.teacher": teacher}, or
        {"distill.teachers.<route>": teacher} per route in `teachers`' order; {} without distillation."""
        if self.teachers:
            return {f"distill.teachers.{route}": teacher for route, teacher in self.teachers.items()}
        return {"distill.teacher": self.teacher} if self.teacher else {}


@dataclass
class DPOSection(Section, name="dpo"):
    """DPO (Rafailov et al. 2023): inverse temperature beta and label smoothing (conservative DPO)."""

    beta: float = field_spec(0.1, "DPO inverse temperature on the log-ratio margins", GT0)
    label_smoothing: float = field_spec(0.0, "conservative DPO: assumed probability of a flipped label", Range(0, 0.5, hi_open=True))


@dataclass
class OptimSection(Section, name="optim"):
    learning_rate: float = field_spec(1e-6, "policy AdamW peak learning rate", GT0)
    critic_learning_rate: float = field_spec(1e-5, "critic AdamW peak learning rate", GT0)
    weight_decay: float = field_spec(0.0, "AdamW decoupled weight decay", GE0)
    adam_beta1: float = field_spec(0.9, "AdamW beta1", BETA)
    adam_beta2: float = field_spec(0.999, "AdamW beta2", BETA)
    adam_epsilon: float = field_spec(1e-8, "AdamW epsilon", GT0)
    max_grad_norm: float = field_spec(1.0, "global grad-norm clip (policy and critic separately)", GT0)
    lr_scheduler_type: str = field_spec("constant", "LR schedule after warmup",
                                Choices(("constant", "cosine", "linear", "warmup_stable_decay")))
    warmup_steps: int = field_spec(0, "linear warmup in optimizer steps", GE0)
    decay_ratio: float = field_spec(0.1, "warmup_stable_decay: share of the post-warmup steps spent decaying", UNIT)


@dataclass
class TrainSection(Section, name="train"):
    type: str = field_spec(train_types.DEFAULT, "train type: "
                           + ", ".join(TRAIN_TYPES), Choices(TRAIN_TYPES))
    output_dir: str = field_spec("outputs/ppo", "directory for config.yaml, metrics and checkpoints",
                                 Pattern(r"\s*\S.*", "a non-empty directory path"))
    max_steps: int = field_spec(4, "policy optimizer steps to run", GT0)
    max_minutes: Optional[float] = field_spec(
        None, "also stop at the first optimizer-step boundary after this many minutes of training in this process "
              "(rank 0's clock from the first step, agreed by every rank; model loading not counted), publish a "
              "checkpoint and exit 0; the LR schedule still runs over train.max_steps; null = no time limit", GT0)
    per_device_train_batch_size: int = field_spec(4, "sft/dpo/seq/grpo: examples per forward/backward on each rank", GT0)
    gradient_accumulation_steps: int = field_spec(1, "sft/dpo/seq/grpo: micro-batches per optimizer step", GT0)
    seed: int = field_spec(42, "seed for data order, sampling and initialisation", Range(0, 2**32 - 1))
    logging_steps: int = field_spec(1, "log metrics every N optimizer steps", GT0)
    metrics: list[str] = field_spec([], "extra costly metrics to compute: " + ", ".join(OPTIONAL_METRICS))
    progress_bar: bool = field_spec(True, "show a progress bar on rank 0")
    eval_steps: int = field_spec(0, "greedy accuracy on data.eval_path every N steps and at the end; 0 = off", GE0)
    eval_on_start: bool = field_spec(False, "train.eval_steps: also evaluate before the first step of a fresh run "
                                            "(logged as step 0: the curve starts from the starting model)")
    report_to: list[str] = field_spec(DEFAULT_REPORT_TO, "where metrics also go besides metrics.jsonl: "
                                      "'tensorboard' (event files in output_dir), 'wandb', or 'none'",
                                      SubsetOf(REPORT_TO, alone=("none",)))
    log_completions: int = field_spec(0, "online_grpo/online_ppo: write the first N samples of each rollout (prompt, "
                                         "completion, each reward, advantage) to output_dir/completions.jsonl, and "
                                         "as a table to train.report_to's TensorBoard / W&B; 0 = off", GE0)
    overwrite_output_dir: bool = field_spec(False, "start fresh in an output_dir that holds checkpoints of "
                                            "another run (they are left alone and ignored)")
    bf16: bool = field_spec(False, "bf16 mixed precision: bf16 compute, fp32 master weights and optimizer state")
    fp16: bool = field_spec(False, "fp16 mixed precision with loss scaling (CUDA only)")
    max_nonfinite_steps: int = field_spec(3, "stop the job after this many optimizer steps in a row of one model "
                                             "had a non-finite loss or gradient norm (each such step is skipped on "
                                             "every rank and counted in train/skipped_steps)", GT0)

    @property
    def mixed_precision(self) -> str:
        """The mode in accelerate's names: "bf16" (train.bf16), "fp16" (train.fp16) or "no"."""
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "no"


@dataclass
class CheckpointSection(Section, name="checkpoint"):
    save_steps: int = field_spec(0, "publish a checkpoint every N optimizer steps; 0 = only at the end", GE0)
    save_minutes: Optional[float] = field_spec(60.0, "also publish a checkpoint when this many minutes of training "
                                                     "have passed since the last one (rank 0's clock, agreed at a "
                                                     "step boundary); null = by steps only", GT0)
    save_at_end: bool = field_spec(True, "publish a checkpoint after the last step")
    keep_last: Optional[int] = field_spec(None, "keep only the newest N checkpoints; null = keep all", GT0)
    resume: str = field_spec("none", "'none' (fresh start), 'auto' (the latest complete checkpoint in output_dir, "
                             "if any) or a checkpoint directory path",
                     Pattern(r".+", "'none', 'auto' or a checkpoint directory"))
    verify_on_load: bool = field_spec(True, "check every file's sha256 against the manifest when resuming "
                                            "(about 1 s per GB)")


@dataclass
class DistributedSection(Section, name="distributed"):
    strategy: str = field_spec("auto", "engine: ddp, fsdp2, zero1, zero2, zero3, or auto (the accelerate launch "
                               "config's, else ddp); see docs/distributed.md", Choices(DISTRIBUTED_STRATEGIES))
    timeout_seconds: float = field_spec(600.0, "seconds a collective (process group) or a wait on another rank may "
                                        "take before the job stops, naming the timeout and the rank that stopped "
                                        "answering where it can; transformers' ddp_timeout is accepted as the name",
                                        GT0)
    device_memory_gib: Optional[float] = field_spec(
        None, "memory per rank the start-up memory plan checks the job against (GiB); null = the device's own (a "
              "GPU's memory, or this node's RAM shared by its ranks); set it to plan a GPU job with --check on "
              "another machine, or to leave room for other processes", GT0)


@dataclass
class RuntimeSection(Section, name="runtime"):
    device: str = field_spec("auto", "device for this process",
                     Pattern(r"auto|cpu|cuda(:[0-9]+)?", "'auto', 'cpu', 'cuda' or 'cuda:N'"))
    num_threads: Optional[int] = field_spec(None, "torch intra-op threads; null = torch default", GT0)
    adaptive_threads: bool = field_spec(
        True, "on a CPU: the rollout engine's decode steps and the training steps run with fewer torch threads while "
              "other processes busy the cores (a team of OpenMP threads stalls on a shared core), and with "
              "runtime.num_threads again when the cores are free (rollout/engine_threads, policy/threads; "
              "docs/kernels.md). Off under runtime.deterministic: a thread count changes float rounding")
    deterministic: bool = field_spec(False, "use deterministic torch algorithms (slower); multi-turn episodes "
                                            "then run turn by turn, bitwise reproducible, instead of streamed")
    environment: dict[str, Optional[Union[str, int, float, bool]]] = field_spec(
        {}, "environment variables exported in every training process before the process group is created "
            "(values as str(), null = empty string; e.g. NCCL_*, ASTR_LOG_LEVEL)", EnvMap())


@dataclass
class Config:
    """A whole job: one attribute per YAML section. Cross-field rules are checked on construction."""

    model: ModelSection = field(default_factory=ModelSection)
    """Policy weights (name, HF dir or GGUF), dtype, activation checkpointing."""
    data: DataSection = field(default_factory=DataSection)
    """Prompt dataset, record fields, system prompt, chat template or raw text, prompt length limit (tokens)."""
    reward: RewardSection = field(default_factory=RewardSection)
    """Scalar reward function by name, plus an optional format bonus."""
    rollout: RolloutSection = field(default_factory=RolloutSection)
    """Generation: prompts per rollout, response length (tokens), sampling parameters, engine dtype."""
    ppo: PPOSection = field(default_factory=PPOSection)
    """PPO: epochs per rollout, minibatch/micro-batch sizes (samples), clipping, GAE, KL penalty."""
    grpo: GRPOSection = field(default_factory=GRPOSection)
    """GRPO (online and offline): group size G, clipping, reference KL in the loss or in the reward."""
    distill: DistillSection = field(default_factory=DistillSection)
    """On-policy distillation: the teacher model and the task reward's weight."""
    dpo: DPOSection = field(default_factory=DPOSection)
    """DPO: beta, label smoothing."""
    optim: OptimSection = field(default_factory=OptimSection)
    """AdamW for policy and critic, grad clipping, LR schedule (in optimizer steps)."""
    train: TrainSection = field(default_factory=TrainSection)
    """Train type, output directory, length (policy optimizer steps), seed, logging."""
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    """When to publish checkpoints (optimizer steps) and how many to keep."""
    distributed: DistributedSection = field(default_factory=DistributedSection)
    """How policy and critic are replicated or sharded across ranks."""
    runtime: RuntimeSection = field(default_factory=RuntimeSection)
    """Device, CPU threads, determinism, per-job environment variables."""

    @property
    def tensor_parallel_size(self) -> int:
        """The tensor-parallel size the job uses: `rollout.tensor_parallel_size` for a train type that reads it (the
        online ones, whose engine it splits over the ranks' (data x tensor) mesh), else 1 (an offline job's
        evaluation engine is a whole copy on every rank; the field is said to have no effect)."""
        if train_types.get(self.train.type).reads_rollout("tensor_parallel_size"):
            return self.rollout.tensor_parallel_size
        return 1

    def _check_partial(self, kind: str, spec) -> None:
        """`rollout.partial` against the rest of the job (docs/async.md); raises ConfigError (one line)."""
        r = self.rollout
        refused = (("rollout.dynamic_sampling", r.dynamic_sampling),
                   ("rollout.tensor_parallel_size > 1", r.tensor_parallel_size > 1),
                   ("rollout.engine vllm", r.engine == "vllm"))
        for name, on in refused:
            if on:
                raise ConfigError(f"rollout.partial: not supported yet with {name}; set rollout.partial false")
        if not spec.online:
            raise ConfigError(f"rollout.partial: continues the samples of the online train types; train.type {kind} "
                              "samples none")
        if r.max_off_policy_steps < 1:
            raise ConfigError("rollout.partial: carried samples are trained on by newer weights; set "
                              "rollout.max_off_policy_steps >= 1 (the staleness bound), got 0")
        if r.correction == "none":
            raise ConfigError("rollout.partial: tokens of older policy versions need an importance-sampling "
                              "correction (decoupled PPO, Hilton et al. 2022); set rollout.correction, e.g. token_tis")
        if r.generation_batch_size is not None and r.generation_batch_size <= r.batch_size:
            raise ConfigError(f"rollout.generation_batch_size: with rollout.partial, the groups in flight must exceed "
                              f"rollout.batch_size {r.batch_size} (else every group must end), got "
                              f"{r.generation_batch_size}")
        steps = self._rollout_steps(spec)
        if r.max_off_policy_steps < steps:
            raise ConfigError(f"rollout.max_off_policy_steps: {r.max_off_policy_steps} is below the {steps} optimizer "
                              f"steps each rollout takes, so every carried sample would be re-generated; set it >= "
                              f"{steps}")

    def generation_restarts_under(self, strategy: str) -> int:
        """`rollout.generation_restarts` under the resolved distributed `strategy`: 0 unless the placement is
        separate; null = 2 where the trained weights are whole on every rank, 0 under fsdp2 / zero3, whose weight
        sync gathers the shards on every rank together (one rank's restart cannot sync alone). Read at config time
        for an explicit strategy and at launch for the resolved one (a configured `auto` is then named with it).

        Raises:
            ConfigError: a value > 0 under fsdp2 / zero3 (one line; exit code 2 from the CLI).
        """
        r = self.rollout
        if r.placement != "separate":
            return 0
        sharded = strategy in PARTITIONED_STRATEGIES
        if r.generation_restarts is None:
            return 0 if sharded else 2
        if r.generation_restarts and sharded:
            configured = self.distributed.strategy
            named = strategy if configured == strategy else f"{configured} (the launch's {strategy})"
            raise ConfigError(f"rollout.generation_restarts: {r.generation_restarts} needs the trained weights whole "
                              f"on every rank (a restarted generation process is synced by its rank alone), and "
                              f"distributed.strategy {named} shards them; set it to 0 or null")
        return r.generation_restarts

    def _rollout_steps(self, spec) -> int:
        """The policy optimizer steps one rollout takes: B x G / minibatch_size x epochs."""
        section = getattr(self, spec.group_size_field.partition(".")[0])
        return self.rollout.batch_size * spec.group_size(self) // section.minibatch_size * section.epochs

    def _check_separate(self, kind: str, spec) -> None:
        """`rollout.placement: separate` against the rest of the job (docs/async.md); raises ConfigError (one line)."""
        r = self.rollout
        if not spec.online:
            raise ConfigError(f"rollout.placement: separate generates the rollouts of the online train types; "
                              f"train.type {kind} samples none")
        refused = (("rollout.partial", r.partial), ("rollout.dynamic_sampling", r.dynamic_sampling),
                   ("rollout.tools", bool(r.tools)), ("rollout.environment", r.environment is not None),
                   ("rollout.tensor_parallel_size > 1", r.tensor_parallel_size > 1),
                   ("rollout.engine vllm", r.engine == "vllm"))
        for name, on in refused:
            if on:
                raise ConfigError(f"rollout.placement: separate is not supported yet with {name}; set "
                                  "rollout.placement colocated")
        group = spec.group_size(self) or 1
        samples = r.batch_size * group
        if r.generation_processes > samples:
            raise ConfigError(f"rollout.generation_processes: {r.generation_processes} generation processes share "
                              f"each rollout's {r.batch_size} x {group} = {samples} samples per "
                              f"training rank, so some would never generate; expected at most {samples}")
        self.generation_restarts_under(self.distributed.strategy)  # refuses restarts > 0 under fsdp2 / zero3
        if r.max_off_policy_steps == 0:
            return  # synchronous: each rollout is generated with the newest weights, as colocated
        if r.correction == "none":
            raise ConfigError("rollout.placement: one step off, every rollout is sampled by the weights before the "
                              "last rollout's updates and needs an importance-sampling correction (decoupled PPO, "
                              "Hilton et al. 2022); set rollout.correction, e.g. token_tis")
        steps = self._rollout_steps(spec)
        if r.max_off_policy_steps < steps:
            raise ConfigError(f"rollout.max_off_policy_steps: {r.max_off_policy_steps} is below the {steps} optimizer "
                              f"steps each rollout takes, which is how far one-step-off tokens lag; set it to 0 "
                              f"(synchronous) or >= {steps}")

    def __post_init__(self) -> None:
        kind = self.train.type
        spec = train_types.get(kind)
        if self.distill.distills and not spec.distills:
            distillers = " and ".join(t.name for t in train_types.all_train_types() if t.distills)
            name = self.distill.teacher_field
            raise ConfigError(f"{name}: on-policy distillation scores the tokens sampled by {distillers}; "
                              f"train.type {kind} samples none; set {name} to {'{}' if self.distill.teachers else 'null'}")
        served = [name for name, teacher in self.distill.named_teachers().items() if served_url(teacher)]
        if served and self.rollout.temperature != 1.0:
            raise ConfigError(f"{served[0]}: a served teacher returns log-probs of its raw distribution (as vLLM "
                              f"echoes prompt log-probs), which match the student's only at rollout.temperature 1, "
                              f"got {self.rollout.temperature:g}; set it to 1 or load the teacher locally")
        spec.check(self)
        if not spec.online:  # the options of sampling processes: named as what the job is not, not as a hint to
            r = self.rollout  # turn on what would be refused next
            for name, default in (("generation_device", None), ("generation_threads", None),
                                  ("generation_restarts", None), ("generation_batch_size", None),
                                  ("generation_processes", 1), ("max_off_policy_steps", 0)):
                if getattr(r, name) != default:
                    default = "null" if default is None else default
                    raise ConfigError(f"rollout.{name}: sets how the online train types sample their rollouts; "
                                      f"train.type {kind} samples none; set it to {default}")
        if self.rollout.partial:
            self._check_partial(kind, spec)
        if self.rollout.placement == "separate":
            self._check_separate(kind, spec)
        else:
            for name in ("generation_device", "generation_threads", "generation_restarts"):
                if getattr(self.rollout, name) is not None:
                    raise ConfigError(f"rollout.{name}: sets the generation process of rollout.placement separate, "
                                      "but the placement is colocated; set it to null")
            if self.rollout.generation_processes != 1:
                raise ConfigError(f"rollout.generation_processes: {self.rollout.generation_processes} generation "
                                  "processes need rollout.placement separate; set it to 1 or the placement to "
                                  "separate")
        if self.rollout.dynamic_sampling:
            if spec.group_size(self) is None or not spec.online:
                samplers = [t.name for t in train_types.all_train_types() if t.online and t.group_size_field]
                raise ConfigError(f"rollout.dynamic_sampling: only {' and '.join(samplers)} sample their groups, "
                                  f"got train.type {kind}")
            if spec.group_size(self) < 2:
                raise ConfigError(f"rollout.dynamic_sampling: {kind} needs {spec.group_size_field} >= 2 (responses "
                                  f"per prompt whose rewards can differ), got {spec.group_size(self)}")
            r = self.rollout
            per_round = r.batch_size if r.generation_batch_size is None else r.generation_batch_size
            if r.max_sampling_rounds < 2 and per_round <= r.batch_size:
                raise ConfigError("rollout.max_sampling_rounds: rollout.dynamic_sampling needs >= 2 rounds, or "
                                  "rollout.generation_batch_size > rollout.batch_size (one round of "
                                  "rollout.batch_size prompts keeps every group, as without it), got "
                                  f"{r.max_sampling_rounds}")
            if r.generation_batch_size is not None and r.generation_batch_size * r.max_sampling_rounds < r.batch_size:
                prompts = "1 prompt" if r.generation_batch_size == 1 else f"{r.generation_batch_size} prompts"
                raise ConfigError(f"rollout.generation_batch_size: {prompts} per round x "
                                  f"rollout.max_sampling_rounds {r.max_sampling_rounds} cannot fill "
                                  f"rollout.batch_size {r.batch_size}; expected at least "
                                  f"{-(-r.batch_size // r.max_sampling_rounds)}")
        elif self.rollout.generation_batch_size is not None and not self.rollout.partial:
            raise ConfigError("rollout.generation_batch_size: only used with rollout.dynamic_sampling or "
                              "rollout.partial (without them each rollout samples rollout.batch_size prompts once); "
                              "set it to null")
        if self.rollout.max_off_policy_steps and not self.rollout.partial and self.rollout.placement != "separate":
            raise ConfigError(f"rollout.max_off_policy_steps: {self.rollout.max_off_policy_steps} bounds the staleness "
                              "of partial rollouts and of one-step-off training, but rollout.partial is false and "
                              "rollout.placement colocated (rollouts are synchronous); set it to 0, rollout.partial "
                              "to true or rollout.placement to separate")
        if self.train.log_completions and not spec.online:  # asked to see what the job never writes: refused
            online = " and ".join(t.name for t in train_types.all_train_types() if t.online)
            raise ConfigError(f"train.log_completions: shows the completions the online train types sample "
                              f"({online}); train.type {kind} samples none; set it to 0")
        if self.rollout.tools and not spec.online:
            raise ConfigError(f"rollout.tools: multi-turn episodes are sampled by the online train types; train.type "
                              f"{kind} samples none")
        if self.rollout.tools and self.data.chat_template is False:
            raise ConfigError("rollout.tools: multi-turn episodes are chats and need the chat template; "
                              "data.chat_template is false")
        if self.rollout.environment is not None and not spec.online:
            raise ConfigError(f"rollout.environment: multi-turn episodes are sampled by the online train types; "
                              f"train.type {kind} samples none")
        if self.rollout.environment is not None and self.data.chat_template is False:
            raise ConfigError("rollout.environment: multi-turn episodes are chats and need the chat template; "
                              "data.chat_template is false")
        if self.rollout.correction != "none" and not spec.online:
            raise ConfigError(f"rollout.correction: corrects rollouts sampled by the engine; train.type {kind} samples "
                              "none; set it to none")
        if self.data.chat_template is False and spec.renders == "chats":
            raise ConfigError(f"data.chat_template: false, but train.type {kind} trains on chats "
                              "(data.messages_field), which need the chat template; set it to true or null")
        if self.data.chat_template is False and self.data.system_prompt and spec.renders == "prompts":
            raise ConfigError("data.system_prompt: a system message needs the chat template, but prompts are raw "
                              "text (data.chat_template is false); write the text into the prompts themselves, or "
                              "set data.chat_template to true")  # as astrai.data.prompt_format says it at start-up
        if self.data.mixture and self.data.path != DataSection().path:
            raise ConfigError(f"data.mixture: set together with data.path {self.data.path!r}; the mixture replaces "
                              "data.path, so set only one of them")
        if self.reward.model_path and not self.reward.functions and self.reward.name not in _DEFAULT_NAMES:
            raise ConfigError(f"reward.name: {self.reward.name!r} with reward.model_path: to add a built-in to the "
                              f"reward model's score, list it in reward.functions ({{function: {self.reward.name}}})")
        if self.reward.functions and self.reward.name not in _DEFAULT_NAMES:
            raise ConfigError(f"reward.name: {self.reward.name!r} is set together with reward.functions; list it "
                              f"there instead ({{function: {self.reward.name}}})")
        names = [f.name or f.function.rpartition(":")[2] for f in self.reward.functions]
        if len(set(names)) < len(names):
            twice = next(n for n in names if names.count(n) > 1)
            raise ConfigError(f"reward.functions: two functions are named {twice!r}; give each its own name "
                              "(their metrics are logged as rewards/<name>/...)")
        if self.train.bf16 and self.train.fp16:
            raise ConfigError("train.fp16: train.bf16 and train.fp16 are mutually exclusive; set one to false")
        if self.train.eval_on_start and not self.train.eval_steps:
            raise ConfigError("train.eval_on_start: needs train.eval_steps > 0 (and data.eval_path), got eval_steps 0")
        if self.train.eval_steps and self.data.eval_path is None:
            raise ConfigError("data.eval_path: train.eval_steps > 0 needs a held-out set "
                              "(e.g. builtin:arithmetic_test or a GSM8K-format .jsonl)")
        if self.data.eval_limit is not None and self.data.eval_path is None:
            raise ConfigError(f"data.eval_limit: set to {self.data.eval_limit} but there is no data.eval_path to "
                              "take questions from; set data.eval_path (and train.eval_steps) or drop eval_limit")
        for name in self.train.metrics:
            if name not in OPTIONAL_METRICS:
                raise ConfigError("train.metrics: " + _unknown("metric", name, OPTIONAL_METRICS)
                                  + f"; available: {', '.join(OPTIONAL_METRICS)}")
            if kind not in OPTIONAL_METRICS[name]:
                raise ConfigError(f"train.metrics: {name!r} is not computed by train.type {kind} (only by "
                                  f"{', '.join(OPTIONAL_METRICS[name])})")
        if self.data.mixture and not spec.online:
            raise ConfigError(f"data.mixture: blends the prompts of the train types that sample online; train.type "
                              f"{kind} reads data.path")
        if self.data.mixture and not any(f.weight > 0 for f in self.data.mixture):
            raise ConfigError("data.mixture: every file has weight 0; give at least one a weight > 0")
        m = self.model
        if m.lora and m.moe_num_experts:
            raise ConfigError("model.lora: LoRA adapters on MoE experts are not supported; set model.moe_num_experts 0 "
                              "or model.lora {}")
        if m.moe_num_experts and m.moe_top_k > m.moe_num_experts:
            raise ConfigError(f"model.moe_top_k: expected <= model.moe_num_experts ({m.moe_num_experts}), "
                              f"got {m.moe_top_k}")


def ignored_settings(config: Config) -> list[str]:
    """``section.field`` names set away from their defaults that have no effect on this job, in declaration order:
    every field of an algorithm section (a `TrainType.section`) that ``config.train.type`` does not read (e.g.
    ``ppo.critic_layers`` in an ``online_grpo`` job), and the fields of its own section that the job leaves unread
    (`TrainType.unread`: ``grpo.std_eps`` / ``grpo.std_floor`` when ``grpo.scale_rewards`` is ``none``), and
    ``reward.format_bonus`` / ``reward.partial_credit`` (options of the single ``reward.name``) when
    ``reward.functions`` or ``reward.model_path`` replace it, and the episode caps (`EPISODE_FIELDS`) without
    ``rollout.tools`` or ``rollout.environment``, the `ENVIRONMENT_FIELDS` without ``rollout.environment``
    (``environment_field`` unless it routes rows), ``distill.reward_weight`` without a teacher and
    ``distill.route_field`` without ``distill.teachers``, ``distill.jsd_beta`` / ``distill.jsd_coef`` without
    ``distill.jsd_top_k``, the ``rollout`` fields a train type that samples no rollouts of its own does not read
    (beyond `TrainType.rollout_fields`: sft, dpo and seq read their evaluations' `EVALUATION_ROLLOUT_FIELDS`,
    offline grpo those and ``batch_size`` / ``temperature``, rm none), and the correction thresholds
    (`CORRECTION_THRESHOLDS`) that ``rollout.correction`` does not use, the ``data`` fields naming another train
    type's record columns (`TrainType.data_fields`), ``data.packing`` where the train type does not pack and
    ``data.max_length`` where it samples its responses, and the held-out set (`HELD_OUT_FIELDS`) without
    ``train.eval_steps``, and the fields read only beside a setting the job lacks (the critic's learning rate, the
    decay share of another schedule, the MoE options without experts, the reward model's options without it or on
    a job that scores nothing, every reward field and ``data.answer_field`` on rm). Each name once; empty when
    there are none."""
    spec = train_types.get(config.train.type)
    sections = dict.fromkeys(t.section for t in train_types.all_train_types() if t.section is not None)
    names = []
    for section in sections:
        current, default = getattr(config, section), SECTIONS[section]()
        unread = spec.unread(config) if section == spec.section else tuple(f.name for f in dataclasses.fields(current))
        names += [f"{section}.{f.name}" for f in dataclasses.fields(current)
                  if f.name in unread and getattr(current, f.name) != getattr(default, f.name)]
    default, rollout = RolloutSection(), config.rollout
    if not rollout.tools and rollout.environment is None:  # the episode caps, without episodes
        names += [f"rollout.{f}" for f in EPISODE_FIELDS if getattr(rollout, f) != getattr(default, f)]
    elif not rollout.tools:  # an environment alone: its methods run in its own workers, under its own timeout
        names += [f"rollout.{f}" for f in TOOL_EXECUTOR_FIELDS if getattr(rollout, f) != getattr(default, f)]
    if rollout.tools and rollout.tool_workers == 0 and rollout.tool_timeout_seconds != default.tool_timeout_seconds:
        names.append("rollout.tool_timeout_seconds")
    if (rollout.environment is not None and rollout.environment_workers == 0
            and rollout.environment_timeout_seconds != default.environment_timeout_seconds):
        names.append("rollout.environment_timeout_seconds")
    env = rollout.environment
    unread = list(ENVIRONMENT_FIELDS) if env is None else [] if EnvironmentReference.routes(env) else [
        "environment_field"]
    names += [f"rollout.{f}" for f in unread if getattr(rollout, f) != getattr(default, f)]
    if spec.rollout_fields is not None:  # a train type that samples no rollouts of its own reads only these
        names += [f"rollout.{f.name}" for f in dataclasses.fields(rollout)
                  if f.name not in spec.rollout_fields and getattr(rollout, f.name) != getattr(default, f.name)]
    data, default_data = config.data, DataSection()
    others = {f for t in train_types.all_train_types() for f in t.data_fields} - set(spec.data_fields)
    names += [f"data.{f}" for f in sorted(others) if getattr(data, f) != getattr(default_data, f)]
    if data.packing and not spec.packs:
        names.append("data.packing")
    if spec.online and data.max_length != default_data.max_length:  # their rows: prompt cap + response budget
        names.append("data.max_length")
    if not config.train.eval_steps:  # the held-out set of the in-training evaluation; astrai.evaluate takes --data
        names += [f"data.{f}" for f in HELD_OUT_FIELDS if getattr(data, f) != getattr(default_data, f)]
    names += [name for name in _unread_companions(config, spec) if _is_set(config, name)]
    thresholds = CORRECTION_THRESHOLDS.get(rollout.correction)  # None: a registered mode of its own reads them all
    if thresholds is not None:
        names += [f"rollout.{f}" for f in ALL_CORRECTION_THRESHOLDS
                  if f not in thresholds and getattr(rollout, f) != getattr(default, f)]
    if not config.distill.distills and config.distill.reward_weight != DistillSection().reward_weight:
        names.append("distill.reward_weight")
    if not config.distill.teachers and config.distill.route_field is not None:
        names.append("distill.route_field")
    if not config.distill.jsd_top_k:
        names += [f"distill.{f}" for f in ("jsd_beta", "jsd_coef")
                  if getattr(config.distill, f) != getattr(DistillSection(), f)]
    if spec.online:  # transformers' batch sizes: online train types step by their section's (mini/micro) batches
        names += [f"train.{f}" for f in ONLINE_UNREAD_TRAIN_FIELDS
                  if getattr(config.train, f) != getattr(TrainSection(), f)]
    reward = config.reward  # the single reward.name and its options, replaced by reward.functions or the reward model
    if reward.functions or reward.model_path:
        names += [f"reward.{f}" for f in ("name", "format_bonus", "partial_credit") if getattr(reward, f)]
    order = {f"{section}.{f.name}": (i, j) for i, (section, kind) in enumerate(SECTIONS.items())
             for j, f in enumerate(dataclasses.fields(kind))}
    return sorted(dict.fromkeys(names), key=order.__getitem__)


def _is_set(config: Config, name: str) -> bool:
    """Whether ``section.field`` `name` differs from its default."""
    section, _, field = name.partition(".")
    return getattr(getattr(config, section), field) != getattr(SECTIONS[section](), field)


def _unread_companions(config: Config, spec) -> list[str]:
    """The fields read only beside another setting that this job lacks (`spec`: its `TrainType`): the critic's
    learning rate without a critic, ``optim.decay_ratio`` under another schedule, the MoE options without
    ``model.moe_num_experts``, the reward model's options without ``reward.model_path``, the reward model on a train
    type that samples nothing, and every reward field and the reference answers where the model answers no prompts
    (`TrainType.answers`: rm). Set or not."""
    names = [] if spec.models_held(config).critic else ["optim.critic_learning_rate"]
    if config.optim.lr_scheduler_type != "warmup_stable_decay":
        names.append("optim.decay_ratio")
    if not config.model.moe_num_experts:
        names += [f"model.{f}" for f in MOE_OPTION_FIELDS]
    if not spec.answers:  # a reward model: nothing of the job is scored
        names += [f"reward.{f.name}" for f in dataclasses.fields(RewardSection)] + ["data.answer_field"]
    elif not spec.online:  # the evaluations score with the functions alone
        names += [f"reward.{f}" for f in REWARD_MODEL_FIELDS]
    elif not config.reward.model_path:
        names += [f"reward.{f}" for f in REWARD_MODEL_FIELDS[1:]]
    return names


def why_ignored(config: Config, name: str) -> str:
    """Why setting `name` (one of `ignored_settings(config)`) has no effect on this job, as a phrase."""
    field = name.partition(".")[2]
    kind, read = config.train.type, train_types.get(config.train.type).rollout_fields
    if name.startswith("rollout.") and read is not None and field not in read:
        if not read:
            return f"train.type {kind} samples no rollouts and reads no rollout field"
        evaluation = [f for f in read if f in EVALUATION_ROLLOUT_FIELDS]
        own = [f for f in read if f not in evaluation]
        return (f"train.type {kind} samples no rollouts; of rollout it reads only "
                + (f"{', '.join(own)} and " if own else "")
                + (f"its evaluations' {', '.join(evaluation)}" if evaluation else ""))
    if name == "data.max_length":
        return (f"train.type {kind} samples its responses: its rows are data.max_prompt_length + "
                "rollout.max_new_tokens tokens long")
    answers = train_types.get(kind).answers
    if not answers and (name.startswith("reward.") or name == "data.answer_field"):
        return f"train.type {kind} trains a model that answers no prompts, so nothing is scored"
    if name.startswith("reward.") and field in REWARD_MODEL_FIELDS and not train_types.get(kind).online:
        return f"train.type {kind} samples no rollouts to score; its evaluations leave the reward model out"
    if name.startswith("reward.") and field in REWARD_MODEL_FIELDS:
        return "read only with reward.model_path"
    if name == "optim.critic_learning_rate":
        critics = " and ".join(t.name for t in train_types.all_train_types() if t.models_held(config).critic)
        return f"read only by the critic of a train type that has one: {critics}"
    if name == "optim.decay_ratio":
        return ("read only with optim.lr_scheduler_type warmup_stable_decay; this job's is "
                f"{config.optim.lr_scheduler_type}")
    if name.startswith("model.") and field in MOE_OPTION_FIELDS:
        return ("read only with model.moe_num_experts > 0, to upcycle a dense model; an MoE checkpoint keeps its own "
                "settings")
    if field in HELD_OUT_FIELDS and name.startswith("data."):
        if not answers:
            return f"train.type {kind} trains a model that answers no prompts, so nothing is evaluated"
        return ("read only by the in-training evaluation, with train.eval_steps > 0; python -m astrai.evaluate "
                "takes --data")
    if name == "data.packing":
        packers = " and ".join(t.name for t in train_types.all_train_types() if t.packs)
        return f"read only by the train types that pack: {packers}"
    owners = [t.name for t in train_types.all_train_types() if field in t.data_fields]
    if name.startswith("data.") and owners:
        possessive = " and ".join(f"{owner}'s" for owner in owners)
        return f"{possessive} record columns, which train.type {kind} does not read"
    if name.startswith("rollout.") and field in ALL_CORRECTION_THRESHOLDS:
        users = [mode for mode, fields in CORRECTION_THRESHOLDS.items() if field in fields]
        return f"read only with rollout.correction {' or '.join(users)}; this job's is {config.rollout.correction}"
    if name == "rollout.tool_timeout_seconds" and config.rollout.tools:
        return "read only with rollout.tool_workers > 0 (calls in the trainer's process have no timeout)"
    if name == "rollout.environment_timeout_seconds" and config.rollout.environment is not None:
        return "read only with rollout.environment_workers > 0 (calls in the trainer's process have no timeout)"
    if name.startswith("rollout.") and field in TOOL_EXECUTOR_FIELDS and config.rollout.environment is not None:
        return ("read only with rollout.tools (the environment's methods run in its rollout.environment_workers, "
                "under rollout.environment_timeout_seconds)")
    if name.startswith("rollout.") and field in EPISODE_FIELDS:
        return "read only with rollout.tools or rollout.environment"
    if name == "rollout.environment_field" and config.rollout.environment is not None:
        return "read only when rollout.environment is a mapping of classes routed by a column"
    if name.startswith("rollout.") and field in ENVIRONMENT_FIELDS:
        return "read only with rollout.environment"
    if name == "distill.reward_weight":
        return "read only with distill.teacher or distill.teachers"
    if name == "distill.route_field":
        return "read only with distill.teachers"
    if name in ("distill.jsd_beta", "distill.jsd_coef"):
        return "read only with distill.jsd_top_k > 0"
    if name == "reward.name":
        return (f"reward.functions / reward.model_path replace the single reward.name; to add {config.reward.name} "
                f"to them, list it in reward.functions ({{function: {config.reward.name}}})")
    if name.startswith("reward."):
        return "an option of reward.name, which reward.functions / reward.model_path replace"
    if name.startswith("train.") and field in ONLINE_UNREAD_TRAIN_FIELDS:
        section = train_types.get(config.train.type).section
        return (f"train.type {config.train.type} steps on {section}.minibatch_size samples per optimizer step, "
                f"{section}.micro_batch_size per forward/backward")
    return f"not read by train.type {config.train.type}"


ONLINE_UNREAD_TRAIN_FIELDS = ("per_device_train_batch_size", "gradient_accumulation_steps")
"""The `train` fields of the offline train types (transformers' names), which the online ones do not read."""
EPISODE_FIELDS = ("max_turns", "max_tool_response_tokens", "tool_response_truncation", "max_parallel_tool_calls",
                  "tool_workers", "tool_timeout_seconds")
"""The `rollout` fields that shape multi-turn episodes, read only with `rollout.tools` or `rollout.environment`."""
TOOL_EXECUTOR_FIELDS = ("tool_workers", "tool_timeout_seconds")
"""The `EPISODE_FIELDS` of the executor of `rollout.tools`, unread by an environment's own methods."""
CORRECTION_THRESHOLDS = {"none": (), "token_tis": ("correction_token_cap",), "seq_tis": ("correction_seq_cap",),
                         "seq_mask": ("correction_seq_cap",), "icepop": ("icepop_low", "icepop_high")}
"""`rollout.correction` mode -> the `rollout` thresholds it reads (`astrai.algos.correction_weights`)."""
ALL_CORRECTION_THRESHOLDS = tuple(dict.fromkeys(f for fields in CORRECTION_THRESHOLDS.values() for f in fields))
"""Every threshold some built-in correction reads, in `CORRECTION_THRESHOLDS`' order."""
MOE_OPTION_FIELDS = ("moe_top_k", "moe_num_shared_experts", "moe_aux_loss_coef")
"""The `model` fields of sparse upcycling beside `moe_num_experts`, read only when it is > 0."""
REWARD_MODEL_FIELDS = ("model_path", "model_weight", "model_batch_size")
"""The `reward` fields of the reward model (`model_path` first), read only by the online train types."""
_DEFAULT_NAMES = (None, "math_exact_match")
"""`reward.name` values that another reward may replace (unset, or the default built-in spelled out: said to have no
effect); any other name beside reward.functions or reward.model_path is refused."""
HELD_OUT_FIELDS = ("eval_path", "eval_limit")
"""The `data` fields of the in-training evaluation's held-out set, read only with `train.eval_steps` > 0."""
ENVIRONMENT_FIELDS = ("environment_field", "environment_workers", "environment_timeout_seconds")
"""The `rollout` fields read only with `rollout.environment` (`environment_field` only when it routes rows)."""
SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(Config)}
"""Section name -> section dataclass, in declaration order."""
ALIASES: dict[str, tuple[str, str]] = {alias: tuple(target.split(".")) for alias, target in {
    # transformers' TrainingArguments and TRL's GRPOConfig / PPOConfig / scripts
    "ddp_timeout": "distributed.timeout_seconds", "num_generations": "grpo.group_size",
    "max_completion_length": "rollout.max_new_tokens", "num_iterations": "grpo.epochs",
    "epsilon": "grpo.clip_eps", "epsilon_high": "grpo.clip_ratio_high", "cliprange": "ppo.clip_eps",
    "cliprange_value": "ppo.value_clip", "save_total_limit": "checkpoint.keep_last",
    "resume_from_checkpoint": "checkpoint.resume", "model_name_or_path": "model.path",
    "dataset_name": "data.path", "lr": "optim.learning_rate", "model_revision": "model.revision",
    "environment_factory": "rollout.environment",
    # verl and OpenRLHF
    "max_response_length": "rollout.max_new_tokens", "generate_max_len": "rollout.max_new_tokens",
    "prompt_max_len": "data.max_prompt_length", "n_samples_per_prompt": "grpo.group_size",
    "rollout_batch_size": "rollout.batch_size", "actor_learning_rate": "optim.learning_rate",
    "lambd": "ppo.gae_lambda",
}.items()}
"""Other names of fields with the same meaning, as users of transformers, TRL, verl and OpenRLHF know them: name ->
(section, field). Accepted bare (`--num_generations 8`) and inside the field's section (`grpo: {num_generations:
8}`); listed in `--help` and docs/names.md."""
REFUSED_NAMES: dict[str, str] = {
    "num_train_epochs": "astrai counts optimizer steps: set train.max_steps",
    "loss_type": ("TRL's loss_type is grpo.loss_agg_mode in verl's names (grpo: seq-mean-token-mean, bnpo and "
                  "dapo: token-mean, dr_grpo: seq-mean-token-sum-norm with grpo.scale_rewards none)"),
    "save_strategy": "checkpoints are published every checkpoint.save_steps steps or checkpoint.save_minutes",
    "eval_strategy": "held-out evaluation runs every train.eval_steps steps",
    "num_completions_to_print": "train.log_completions writes N samples of each rollout to completions.jsonl",
    "adv_estimator": "grpo.advantage_estimator (grpo, rloo, reinforce_pp, reinforce_pp_baseline, on_policy_distill; "
                     "gae is online_ppo's)",
    "dataset_config": "a dataset id names its config and split in data.path: org/name:config:split "
                      "(openai/gsm8k:main:train)",
    "dataset_train_split": "a dataset id names its split in data.path: org/name:config:split (openai/gsm8k:main:train)",
    "dataset_test_split": "data.eval_path names the held-out split: org/name:config:split (openai/gsm8k:main:test)",
    "trust_remote_code": "astrai never runs a repository's code: it implements the model families it loads "
                         "(docs/models.md); remove trust_remote_code",
    "steps_per_generation": "each rollout's rollout.batch_size x grpo.group_size samples make optimizer steps of "
                            "grpo.minibatch_size samples (ppo.minibatch_size for online_ppo)",
    "reward_weights": "each reward function has its own weight: reward.functions[i].weight",
    "importance_sampling_level": "TRL's importance_sampling_level sequence is grpo.policy_loss gspo",
    "use_vllm": "set rollout.engine vllm (docs/vllm.md); the default engine is astrai's own paged engine",
}
"""Names from TRL, verl and OpenRLHF whose meaning differs from any one astrai field: refused in one line saying what
to set instead."""
TRL_BETA = ("beta: in TRL's GRPOConfig beta is the reference-KL coefficient, grpo.kl_coef (ppo.kl_coef for "
            "online_ppo); dpo.beta is DPO's beta, which train.type {kind} does not read")
"""`--beta` means dpo.beta (TRL's DPOConfig); in a job of another train type it is refused with this line."""
HOST_SECTIONS = ("infra",)
"""Top-level sections for the host-side launch tools (launch/train.sh, docker/*_runtime.py), skipped here."""


def _unknown_key(section: str, name: str) -> str:
    """One-line 'unknown key' message with the closest known key (another section's field first)."""
    owners = [s for s, cls in SECTIONS.items() if name in field_specs(cls)]
    close = difflib.get_close_matches(name, list(field_specs(SECTIONS[section])), n=1) if section in SECTIONS else []
    guess = f"{owners[0]}.{name}" if owners else (f"{section}.{close[0]}" if close else None)
    return f"unknown key '{section}.{name}'" + (f" (did you mean '{guess}'?)" if guess else "")


def _unknown_section(name: str) -> str:
    """One-line message for a job file's unknown top-level key; a field written flat (TRL's flat config files:
    `num_generations: 8`, `train_type: sft`) is told the section it belongs in."""
    if name in REFUSED_NAMES:
        return f"{name}: {REFUSED_NAMES[name]}"
    try:
        section, field, _ = _resolve_key(name)
    except ConfigError:
        return _unknown("section", name, SECTIONS)
    trl = "; TRL's GRPOConfig beta is grpo.kl_coef" if f"{section}.{field}" == "dpo.beta" else ""
    return (f"unknown section '{name}': a job file nests each field in its section, {section}: {{{field}: ...}} "
            f"(--{name} on the command line){trl}")


def _unknown(what: str, name: str, candidates: Iterable[str]) -> str:
    candidates = list(candidates)
    close = difflib.get_close_matches(name, candidates, n=1)
    hint = f"did you mean '{close[0]}'?" if close else (f"expected one of: {', '.join(candidates)}"
                                                       if what == "section" else "")
    return f"unknown {what} '{name}'" + (f" ({hint})" if hint else "")


def _resolve_key(key: str) -> tuple[str, str, str]:
    """`section.key`, `section_key` or a unique bare field name -> (section, field, ""); `section.field.sub.path`
    (inside a record: `model.lora.r`, `reward.functions.0.weight`) -> (section, field, "sub.path"). Raises
    ConfigError."""
    key = key.replace("-", "_")
    if key in ALIASES:
        return (*ALIASES[key], "")
    if key.rpartition(".")[2] in REFUSED_NAMES:
        raise ConfigError(f"{key}: {REFUSED_NAMES[key.rpartition('.')[2]]}")
    if "." in key:
        section, _, rest = key.partition(".")
        name, _, sub = rest.partition(".")
        if section not in SECTIONS:
            raise ConfigError(_unknown("section", section, SECTIONS))
        if ALIASES.get(name, (None,))[0] == section and not sub:
            return (*ALIASES[name], "")
        if name not in field_specs(SECTIONS[section]):
            raise ConfigError(_unknown_key(section, name))
        if sub and _leaf_hint(section, name, sub) is None:
            raise ConfigError(f"{section}.{name}.{sub}: {section}.{name} has no such key (set the whole value with "
                              f"--{section}.{name} '...')")
        return section, name, sub
    prefix, _, rest = key.partition("_")
    if prefix in SECTIONS and rest in field_specs(SECTIONS[prefix]):
        return prefix, rest, ""
    owners = [s for s, cls in SECTIONS.items() if key in field_specs(cls)]
    if len(owners) == 1:
        return owners[0], key, ""
    if owners:
        raise ConfigError(f"ambiguous key '{key}': could be " + ", ".join(f"'{s}.{key}'" for s in owners)
                          + "; use --section.key")
    if prefix in SECTIONS and rest:
        raise ConfigError(_unknown_key(prefix, rest))
    everything = [f"{s}.{n}" for s, cls in SECTIONS.items() for n in field_specs(cls)]
    raise ConfigError(_unknown("key", key, everything + [n.partition(".")[2] for n in everything] + list(ALIASES)))


def _leaf_hint(section: str, name: str, sub: str) -> Any:
    """The type hint at `sub` ("r", "0.weight") inside the record-typed field `section.name`, or None when there
    is no such key (list indices are not checked against a length here)."""
    hint = field_specs(SECTIONS[section])[name][0]
    for part in sub.split("."):
        base, _ = split_optional(hint)
        if record_item(base) is not None and part.isdigit():
            hint = record_item(base)
        elif is_record(base) and part in field_specs(base):
            hint = field_specs(base)[part][0]
        elif get_origin(base) is dict:  # a plain mapping (engine_options, kwargs): any key, any YAML value
            hint = Any
        else:
            return None
    return hint


def _parse_cli_value(hint: Any, where: str, text: str) -> Any:
    """Parse one override value with the YAML 1.2 loader; a str field keeps the raw text (unless null)."""
    base, optional = split_optional(hint)
    try:
        value = yaml.load(text, Loader=YamlLoader)
    except yaml.YAMLError:
        if base is not str:
            raise ConfigError(f"{where}: cannot parse value {text!r}") from None
        value = text
    if base is str:
        return None if optional and value is None else text
    if get_origin(base) is list and record_item(base) is None and isinstance(value, str):  # --train.metrics a,b
        value = [s.strip() for s in value.split(",") if s.strip()]
    return value


def _parse_overrides(tokens: Iterable[str]) -> list[tuple[str, str, str, Any]]:
    """argv leftovers -> [(section, field, sub-path, value)], values parsed but not yet validated."""
    tokens, out, i = list(tokens), [], 0
    spelled: dict[tuple[str, str, str], str] = {}  # setting -> how the command line first named it
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if not token.startswith("--") or len(token) == 2:
            raise ConfigError(f"unexpected argument {token!r}: overrides look like --section.key value")
        key, eq, text = token[2:].partition("=")
        section, name, sub = _resolve_key(key)
        where = ".".join(p for p in (section, name, sub) if p)
        first = spelled.setdefault((section, name, sub), key)
        if first != key:  # an alias and its name (or two aliases): which was meant is not for us to guess
            raise ConfigError(f"--{key}: set together with --{first} (the same setting, {where}); keep one of them")
        if not eq:
            if i >= len(tokens) or tokens[i].startswith("--"):
                raise ConfigError(f"{where}: missing value after {token}")
            text, i = tokens[i], i + 1
        hint = _leaf_hint(section, name, sub) if sub else field_specs(SECTIONS[section])[name][0]
        out.append((section, name, sub, _parse_cli_value(hint, where, text)))
    return out


def _set_inside(raw: Any, section: str, name: str, sub: str, value: Any) -> Any:
    """`raw` (a record field's plain form: a mapping, or a list of mappings) with `value` at `sub`."""
    *parents, last = sub.split(".")
    node = raw
    for part in [*parents, last]:
        if isinstance(node, list):
            index = int(part)
            if index >= len(node):
                item = record_item(split_optional(field_specs(SECTIONS[section])[name][0])[0]).item
                raise ConfigError(f"{section}.{name}.{sub}: {section}.{name} has {len(node)} {item}(s), numbered "
                                  f"from 0; add one in the job file")
            if part == last:
                node[index] = value
            else:
                node = node[index]
        elif part == last:
            node[part] = value
        else:
            node = node.setdefault(part, {})
    return raw


# ----------------------------------------------------------------------------------------- public API
def config_from_dict(data: Any, overrides: Iterable[str] = (), source: Optional[str] = None) -> Config:
    """Build a validated Config from a sectioned mapping plus CLI override tokens (CLI wins).

    `source` (a file name) prefixes errors about `data` and ends those of cross-field checks. Raises ConfigError
    (one line) for a non-mapping, unknown sections/keys, wrong types, out-of-range values, bad overrides and failed
    cross-field checks.
    """
    where = f"{source}: " if source else ""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}expected a mapping of sections at the top level, got {type(data).__name__}")
    values: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    for section, body in data.items():
        if section in HOST_SECTIONS:
            if not isinstance(body, (dict, type(None))):
                raise ConfigError(f"{where}{section}: expected a mapping of keys, got {type(body).__name__}")
            continue
        if section not in SECTIONS:
            raise ConfigError(where + _unknown_section(str(section)))
        if not isinstance(body, (dict, type(None))):
            raise ConfigError(f"{where}{section}: expected a mapping of keys, got {type(body).__name__}")
        specs = field_specs(SECTIONS[section])
        for name, value in (body or {}).items():
            if ALIASES.get(name, (None,))[0] == section:
                alias, name = name, ALIASES[name][1]
                if name in (body or {}):
                    raise ConfigError(f"{where}{section}.{alias}: set together with {section}.{name} (the same "
                                      "setting); keep one of them")
            if name in REFUSED_NAMES and name not in specs:
                raise ConfigError(f"{where}{section}.{name}: {REFUSED_NAMES[name]}")
            if name not in specs:
                raise ConfigError(where + _unknown_key(section, str(name)))
            try:
                values[section][name] = convert_value(f"{section}.{name}", *specs[name], value)
            except ConfigError as e:
                raise ConfigError(f"{where}{e}") from None
    tokens = list(overrides)
    parsed = list(_parse_overrides(tokens))
    if any(t.startswith("--") and t[2:].split("=")[0] == "beta" for t in tokens):  # TRL's two meanings of beta
        kind = next((v for s, n, sub, v in reversed(parsed) if (s, n, sub) == ("train", "type", "")),
                    values["train"].get("type", TrainSection().type))
        if train_types.get(kind).section != DPOSection.section:
            raise ConfigError(TRL_BETA.format(kind=kind))
    for section, name, sub, value in parsed:
        if sub:  # into a record: the field's plain form, changed at `sub`, is converted with the section
            current = values[section].get(name, getattr(SECTIONS[section](), name))
            value = _set_inside(to_raw(current) if current is not None else {}, section, name, sub, value)
        values[section][name] = value
    overridden = {f"{s}.{n}" for s, n, _, _ in parsed}
    sections = {}
    for s, cls in SECTIONS.items():
        try:
            sections[s] = cls(**values[s])
        except ConfigError as e:  # a command-line value that fails its field's check: say it came from there
            named = str(e).split(":", 1)[0].split("[", 1)[0]
            if not any(named == key or named.startswith(key + ".") for key in overridden):
                raise
            raise ConfigError(f"{e} (given on the command line)") from None
    try:
        return Config(**sections)
    except ConfigError as e:  # a cross-field check: say where the values came from
        if not source:
            raise
        raise ConfigError(f"{e} (in {source}{' with the command-line overrides' if parsed else ''})") from None


def load_config(path: Optional[str], overrides: Iterable[str] = ()) -> Config:
    """Read a sectioned YAML job file (or defaults when `path` is None), apply CLI overrides, validate.

    Raises ConfigError (one line): naming the file when it is missing, a directory, unreadable, invalid YAML or
    not a mapping; naming the field (e.g. ``ppo.gamma``) for unknown keys, wrong types and out-of-range values.
    """
    if path is None:
        return config_from_dict({}, overrides)
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"config file {path} is a directory")
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config file {path}: {' '.join(str(e).split())}") from None
    try:
        data = yaml.load(text, Loader=YamlLoader)
    except yaml.YAMLError as e:
        mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
        detail = f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark and problem else str(e)
        raise ConfigError(f"invalid YAML in config file {path}: {' '.join(detail.split())}") from None
    return config_from_dict(data, overrides, source=str(path))


def config_to_dict(config: Config) -> dict[str, dict[str, Any]]:
    """Plain nested dict ``{section: {field: value}}`` of `config` (a deep copy): records as mappings, an optional
    record that is off (`model.lora`) as {}."""
    return {s: {name: _plain(getattr(section, name), hint) for name, (hint, _) in field_specs(type(section)).items()}
            for s, section in ((s, getattr(config, s)) for s in SECTIONS)}


def _plain(value: Any, hint: Any) -> Any:
    base, optional = split_optional(hint)
    return {} if value is None and optional and is_record(base) else to_raw(value)


def canonical_value(key: str, raw: Any) -> Any:
    """The plain form `config_to_dict` gives field `key` ("section.field") whose value is `raw` (e.g. a saved
    config.yaml's `model.lora: {r: 4}`, written with fewer keys by an older astrai); `raw` itself when it is not
    a valid value of the field, or the field is unknown."""
    section, _, name = key.partition(".")
    try:
        hint, check = field_specs(SECTIONS[section])[name]
        return _plain(convert_value(key, hint, check, raw), hint)
    except (KeyError, ConfigError):
        return raw


def dump_config(config: Config) -> str:
    """Sectioned YAML with sorted keys that `load_config` reads back into an equal Config."""
    return yaml.dump(config_to_dict(config), Dumper=YamlDumper, sort_keys=True, default_flow_style=False,
                     allow_unicode=True)
