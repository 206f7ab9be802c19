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
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Iterable, Optional, Union, get_args, get_origin, get_type_hints

import yaml

TRAIN_TYPES = ("online_ppo", "online_grpo", "grpo", "sft", "dpo", "seq")
"""Valid ``train.type`` values; each new train type (strategy) is added here."""
DISTRIBUTED_STRATEGIES = ("ddp",)
"""Valid ``distributed.strategy`` values."""


class ConfigError(ValueError):
    """Invalid configuration; the message is one line naming the field or file at fault."""


# ----------------------------------------------------------------------------------------- YAML 1.2 scalars
_CORE = "tag:yaml.org,2002:"


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 core-schema scalars and duplicate-key errors; PyYAML's SafeLoader is untouched."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != _CORE + "merge":
                if (key_node.tag, key_node.value) in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key_node.value!r}", key_node.start_mark)
                seen.add((key_node.tag, key_node.value))
        return super().construct_mapping(node, deep)


_Loader.yaml_implicit_resolvers = {  # a fresh dict of fresh lists: drop YAML 1.1 bool/int/float/timestamp
    first: [(tag, rx) for tag, rx in resolvers if tag[len(_CORE):] not in ("bool", "int", "float", "timestamp")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
for _tag, _rx, _first in (  # order matters: the first matching resolver wins ("1" is an int)
        ("bool", r"true|True|TRUE|false|False|FALSE", "tTfF"),
        ("int", r"[-+]?[0-9][0-9_]*|0o[0-7_]+|0x[0-9a-fA-F_]+", "-+0123456789"),
        ("float", r"[-+]?(?:\.[0-9][0-9_]*|[0-9][0-9_]*(?:\.[0-9_]*)?)(?:[eE][-+]?[0-9]+)?"
                  r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)", "-+0123456789.")):
    _Loader.add_implicit_resolver(_CORE + _tag, re.compile(rf"^(?:{_rx})$"), list(_first))


def _construct_int(loader: _Loader, node: yaml.Node) -> int:
    text = loader.construct_scalar(node).replace("_", "")
    return int(text, 0) if text[:2] in ("0o", "0x") else int(text, 10)  # "010" is ten, as in YAML 1.2


_Loader.add_constructor(_CORE + "int", _construct_int)


class _Dumper(yaml.SafeDumper):
    """SafeDumper that quotes exactly the strings `_Loader` would not read back as strings (e.g. "1e-5")."""


_Dumper.yaml_implicit_resolvers = _Loader.yaml_implicit_resolvers


# ----------------------------------------------------------------------------------------- field specs
@dataclass(frozen=True)
class _Range:
    lo: float
    hi: Optional[float] = None
    lo_open: bool = False
    hi_open: bool = False

    def ok(self, v: float) -> bool:
        above = v > self.lo if self.lo_open else v >= self.lo
        return above and (self.hi is None or (v < self.hi if self.hi_open else v <= self.hi))

    def describe(self, kind: str) -> str:
        if self.hi is None:
            return f"{kind} {'>' if self.lo_open else '>='} {self.lo:g}"
        return f"{kind} in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"


@dataclass(frozen=True)
class _Choices:
    values: tuple

    def ok(self, v: Any) -> bool:
        return v in self.values

    def describe(self, kind: str) -> str:
        return "one of " + ", ".join(map(repr, self.values))


@dataclass(frozen=True)
class _Pattern:
    regex: str
    text: str

    def ok(self, v: str) -> bool:
        return re.fullmatch(self.regex, v) is not None

    def describe(self, kind: str) -> str:
        return self.text


GT0, GE0, UNIT, BETA = _Range(0, lo_open=True), _Range(0), _Range(0, 1), _Range(0, 1, hi_open=True)


def _f(default: Any, doc: str, check: Any = None) -> Any:
    """A dataclass field carrying its one-line doc and its check (range / choices / pattern) as metadata."""
    meta = {"doc": doc, "check": check}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


class _Section:
    """Base of the section dataclasses: validates and normalises (int -> float) every field on construction."""

    section = ""  # set by the class keyword `name=`; not annotated, so not a field

    def __init_subclass__(cls, name: str = "", **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.section = name

    def __post_init__(self) -> None:
        for name, (hint, check) in _specs(type(self)).items():
            setattr(self, name, _convert(f"{self.section}.{name}", hint, check, getattr(self, name)))


# ----------------------------------------------------------------------------------------- sections
@dataclass
class ModelSection(_Section, name="model"):
    path: str = _f("smollm2-135m-instruct", "model name, Hugging Face-format directory or .gguf file")
    dtype: str = _f("float32", "parameter/compute dtype", _Choices(("float32", "bfloat16", "float16")))
    gradient_checkpointing: bool = _f(False, "recompute decoder-block activations in backward")
    moe_num_experts: int = _f(0, "routed experts per MoE feed-forward (0 = dense model as loaded)", GE0)
    moe_top_k: int = _f(2, "routed experts per token", GT0)
    moe_num_shared_experts: int = _f(0, "always-active shared experts per MoE feed-forward", GE0)
    moe_aux_loss_coef: float = _f(0.01, "weight of the load-balancing auxiliary loss", GE0)


@dataclass
class DataSection(_Section, name="data"):
    path: str = _f("builtin:math_prompts", "'builtin:<name>' dataset or a .jsonl file path")
    prompt_field: str = _f("question", "record field holding the prompt text")
    answer_field: str = _f("answer", "record field holding the reference answer (for the reward)")
    system_prompt: Optional[str] = _f(None, "system message prepended through the chat template")
    max_prompt_length: int = _f(256, "prompt tokens kept (longer prompts are truncated/skipped)", GT0)
    shuffle: bool = _f(True, "shuffle prompts each epoch (seeded by train.seed)")
    messages_field: str = _f("messages", "sft: record field holding the chat messages (role/content list)")
    text_field: str = _f("text", "seq: record field holding the raw text")
    chosen_field: str = _f("chosen", "dpo: record field holding the preferred response")
    rejected_field: str = _f("rejected", "dpo: record field holding the dispreferred response")
    responses_field: str = _f("responses", "grpo: record field holding the G sampled responses")
    rewards_field: str = _f("rewards", "grpo: record field holding the G scalar rewards")
    logprobs_field: str = _f("logprobs", "grpo: optional field with per-token behaviour log-probs")
    max_length: int = _f(512, "sft/dpo/seq/grpo: tokens per training sequence (longer are truncated)", GT0)
    packing: bool = _f(False, "sft/seq: pack several examples into each max_length row")


@dataclass
class RewardSection(_Section, name="reward"):
    name: str = _f("math_exact_match", "reward function name in the reward registry")
    format_bonus: float = _f(0.0, "reward added when the response has the expected answer format", GE0)


@dataclass
class RolloutSection(_Section, name="rollout"):
    batch_size: int = _f(8, "prompts per rollout", GT0)
    max_new_tokens: int = _f(64, "response length cap in tokens", GT0)
    temperature: float = _f(1.0, "sampling temperature (also applied when scoring log-probs)", GT0)
    top_k: int = _f(0, "keep the k most likely tokens; 0 = off", GE0)
    top_p: float = _f(1.0, "nucleus sampling mass; 1 = off", _Range(0, 1, lo_open=True))


@dataclass
class PPOSection(_Section, name="ppo"):
    epochs: int = _f(1, "passes over each rollout", GT0)
    minibatch_size: int = _f(8, "samples per policy optimizer step", GT0)
    micro_batch_size: int = _f(4, "samples per forward/backward (gradient accumulation unit)", GT0)
    clip_eps: float = _f(0.2, "PPO ratio clip: ratio kept in [1 - eps, 1 + eps]", GT0)
    value_clip: Optional[float] = _f(0.2, "value clip around rollout values; null = unclipped", GT0)
    gamma: float = _f(1.0, "discount per response token", UNIT)
    gae_lambda: float = _f(0.95, "GAE lambda", UNIT)
    vf_coef: float = _f(0.1, "value-loss scale", GT0)
    kl_coef: float = _f(0.05, "reference-KL penalty per token in the reward", GE0)
    kl_estimator: str = _f("k3", "KL estimator (Schulman 2020)", _Choices(("k1", "k2", "k3")))
    whiten_advantages: bool = _f(True, "masked mean/std normalisation of advantages per rollout")


@dataclass
class GRPOSection(_Section, name="grpo"):
    """GRPO (online_grpo, grpo): group size, clipping, reference KL in the loss XOR in the reward (Shao 2024)."""

    group_size: int = _f(4, "G: responses sampled (or stored) per prompt", _Range(2))
    epochs: int = _f(1, "passes over each batch of groups", GT0)
    minibatch_size: int = _f(8, "samples (responses) per policy optimizer step", GT0)
    micro_batch_size: int = _f(4, "samples per forward/backward (gradient accumulation unit)", GT0)
    clip_eps: float = _f(0.2, "ratio clip: ratio kept in [1 - eps, 1 + eps]", GT0)
    kl_coef: float = _f(0.04, "reference-KL (k3) weight in the loss; 0 = no reference model", GE0)
    kl_reward_coef: float = _f(0.0, "reference-KL weight subtracted from the reward instead", GE0)
    std_eps: float = _f(1e-6, "epsilon added to the group std", GT0)
    std_floor: Optional[float] = _f(None, "lower bound on the group std; null = none", GT0)


@dataclass
class DPOSection(_Section, name="dpo"):
    """DPO (Rafailov et al. 2023): inverse temperature beta and label smoothing (conservative DPO)."""

    beta: float = _f(0.1, "DPO inverse temperature on the log-ratio margins", GT0)
    label_smoothing: float = _f(0.0, "conservative DPO: assumed probability of a flipped label", _Range(0, 0.5, hi_open=True))


@dataclass
class OptimSection(_Section, name="optim"):
    learning_rate: float = _f(1e-6, "policy AdamW peak learning rate", GT0)
    critic_learning_rate: float = _f(1e-5, "critic AdamW peak learning rate", GT0)
    weight_decay: float = _f(0.0, "AdamW decoupled weight decay", GE0)
    adam_beta1: float = _f(0.9, "AdamW beta1", BETA)
    adam_beta2: float = _f(0.999, "AdamW beta2", BETA)
    adam_epsilon: float = _f(1e-8, "AdamW epsilon", GT0)
    max_grad_norm: float = _f(1.0, "global grad-norm clip (policy and critic separately)", GT0)
    lr_scheduler_type: str = _f("constant", "LR schedule after warmup",
                                _Choices(("constant", "cosine", "linear", "warmup_stable_decay")))
    warmup_steps: int = _f(0, "linear warmup in optimizer steps", GE0)
    decay_ratio: float = _f(0.1, "warmup_stable_decay: share of the post-warmup steps spent decaying", UNIT)


@dataclass
class TrainSection(_Section, name="train"):
    type: str = _f("online_ppo", "train type (strategy)", _Choices(TRAIN_TYPES))
    output_dir: str = _f("outputs/ppo", "directory for config.yaml, metrics and checkpoints")
    max_steps: int = _f(4, "policy optimizer steps to run", GT0)
    per_device_train_batch_size: int = _f(4, "sft/dpo/seq/grpo: examples per forward/backward on each rank", GT0)
    gradient_accumulation_steps: int = _f(1, "sft/dpo/seq/grpo: micro-batches per optimizer step", GT0)
    seed: int = _f(42, "seed for data order, sampling and initialisation")
    logging_steps: int = _f(1, "log metrics every N optimizer steps", GT0)
    metrics: list[str] = _f([], "extra costly metrics to compute, e.g. 'policy/entropy'")
    progress_bar: bool = _f(True, "show a progress bar on rank 0")


@dataclass
class CheckpointSection(_Section, name="checkpoint"):
    save_steps: int = _f(0, "publish a checkpoint every N optimizer steps; 0 = only at the end", GE0)
    save_at_end: bool = _f(True, "publish a checkpoint after the last step")
    keep_last: Optional[int] = _f(None, "keep only the newest N checkpoints; null = keep all", GT0)
    resume: str = _f("none", "'none' (fresh start), 'auto' (the latest complete checkpoint in output_dir, "
                             "if any) or a checkpoint directory path",
                     _Pattern(r".+", "'none', 'auto' or a checkpoint directory"))
    verify_on_load: bool = _f(False, "check every file's sha256 against the manifest when resuming")


@dataclass
class DistributedSection(_Section, name="distributed"):
    strategy: str = _f("ddp", "data-parallel strategy", _Choices(DISTRIBUTED_STRATEGIES))


@dataclass
class RuntimeSection(_Section, name="runtime"):
    device: str = _f("auto", "device for this process",
                     _Pattern(r"auto|cpu|cuda(:[0-9]+)?", "'auto', 'cpu', 'cuda' or 'cuda:N'"))
    num_threads: Optional[int] = _f(None, "torch intra-op threads; null = torch default", GT0)
    deterministic: bool = _f(False, "use deterministic torch algorithms (slower)")


@dataclass
class Config:
    """A whole job: one attribute per YAML section. Cross-field rules are checked on construction."""

    model: ModelSection = field(default_factory=ModelSection)
    """Policy weights (name, HF dir or GGUF), dtype, activation checkpointing."""
    data: DataSection = field(default_factory=DataSection)
    """Prompt dataset, record fields, system prompt, prompt length limit (tokens)."""
    reward: RewardSection = field(default_factory=RewardSection)
    """Scalar reward function by name, plus an optional format bonus."""
    rollout: RolloutSection = field(default_factory=RolloutSection)
    """Generation: prompts per rollout, response length (tokens), sampling parameters."""
    ppo: PPOSection = field(default_factory=PPOSection)
    """PPO: epochs per rollout, minibatch/micro-batch sizes (samples), clipping, GAE, KL penalty."""
    grpo: GRPOSection = field(default_factory=GRPOSection)
    """GRPO (online and offline): group size G, clipping, reference KL in the loss or in the reward."""
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
    """Device, CPU threads, determinism."""

    def __post_init__(self) -> None:
        kind = self.train.type
        if kind == "online_ppo":
            _check_divides(("ppo.minibatch_size", self.ppo.minibatch_size),
                           ("rollout.batch_size", self.rollout.batch_size))
            _check_divides(("ppo.micro_batch_size", self.ppo.micro_batch_size),
                           ("ppo.minibatch_size", self.ppo.minibatch_size))
        if kind in ("online_grpo", "grpo"):
            g = self.grpo
            _check_divides(("grpo.minibatch_size", g.minibatch_size),
                           ("rollout.batch_size * grpo.group_size", self.rollout.batch_size * g.group_size))
            _check_divides(("grpo.micro_batch_size", g.micro_batch_size), ("grpo.minibatch_size", g.minibatch_size))
        if kind in ("online_grpo", "grpo") and self.grpo.kl_coef > 0 and self.grpo.kl_reward_coef > 0:
            raise ConfigError("grpo.kl_reward_coef: KL in the reward and KL in the loss (grpo.kl_coef) are "
                              "mutually exclusive; set one of them to 0")
        m = self.model
        if m.moe_num_experts and m.moe_top_k > m.moe_num_experts:
            raise ConfigError(f"model.moe_top_k: expected <= model.moe_num_experts ({m.moe_num_experts}), "
                              f"got {m.moe_top_k}")


def _check_divides(small: tuple[str, int], big: tuple[str, int]) -> None:
    """Raise ConfigError unless `small`'s value is <= and a divisor of `big`'s value (each (name, value))."""
    (name, s), (big_name, b) = small, big
    if s > b:
        raise ConfigError(f"{name}: expected <= {big_name} ({b}), got {s}")
    if b % s:
        raise ConfigError(f"{name}: expected a divisor of {big_name} ({b}), got {s}")


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(Config)}
"""Section name -> section dataclass, in declaration order."""


# ----------------------------------------------------------------------------------------- validation
_KINDS = {int: "an integer", float: "a number", str: "a string", bool: "a boolean"}


@cache
def _specs(cls: type) -> dict[str, tuple[Any, Any]]:
    """Field name -> (resolved type hint, check or None) of a section dataclass."""
    hints = get_type_hints(cls)
    return {f.name: (hints[f.name], f.metadata["check"]) for f in dataclasses.fields(cls)}


def _split_optional(hint: Any) -> tuple[Any, bool]:
    if get_origin(hint) is Union and type(None) in get_args(hint):
        return next(a for a in get_args(hint) if a is not type(None)), True
    return hint, False


def _coerce(base: Any, v: Any) -> Any:
    """`v` as type `base`, or the sentinel `_coerce` itself when it is the wrong type (bool is never a number)."""
    if base in (int, float) and isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v) if base is float else (v if isinstance(v, int) else _coerce)
    if base in (str, bool) and isinstance(v, base):
        return v
    if get_origin(base) is list and isinstance(v, list) and all(isinstance(x, str) for x in v):
        return list(v)
    return _coerce


def _convert(name: str, hint: Any, check: Any, value: Any) -> Any:
    """`value` converted to `hint` and checked; raises ConfigError naming `name` and what was expected."""
    base, optional = _split_optional(hint)
    if optional and value is None:
        return None
    out = _coerce(base, value)
    if out is _coerce or (check is not None and not check.ok(out)):
        kind = _KINDS.get(base, "a list of strings")
        expected = check.describe(kind) if check is not None else kind
        raise ConfigError(f"{name}: expected {'null or ' if optional else ''}{expected}, got {value!r}")
    return out


def _unknown_key(section: str, name: str) -> str:
    """One-line 'unknown key' message with the closest known key (another section's field first)."""
    owners = [s for s, cls in SECTIONS.items() if name in _specs(cls)]
    close = difflib.get_close_matches(name, list(_specs(SECTIONS[section])), n=1) if section in SECTIONS else []
    guess = f"{owners[0]}.{name}" if owners else (f"{section}.{close[0]}" if close else None)
    return f"unknown key '{section}.{name}'" + (f" (did you mean '{guess}'?)" if guess else "")


def _unknown(what: str, name: str, candidates: Iterable[str]) -> str:
    candidates = list(candidates)
    close = difflib.get_close_matches(name, candidates, n=1)
    hint = f"did you mean '{close[0]}'?" if close else (f"expected one of: {', '.join(candidates)}"
                                                       if what == "section" else "")
    return f"unknown {what} '{name}'" + (f" ({hint})" if hint else "")


def _resolve_key(key: str) -> tuple[str, str]:
    """`section.key`, `section_key` or a unique bare field name -> (section, field); raises ConfigError."""
    key = key.replace("-", "_")
    if "." in key:
        section, _, name = key.partition(".")
        if section not in SECTIONS:
            raise ConfigError(_unknown("section", section, SECTIONS))
        if name not in _specs(SECTIONS[section]):
            raise ConfigError(_unknown_key(section, name))
        return section, name
    prefix, _, rest = key.partition("_")
    if prefix in SECTIONS and rest in _specs(SECTIONS[prefix]):
        return prefix, rest
    owners = [s for s, cls in SECTIONS.items() if key in _specs(cls)]
    if len(owners) == 1:
        return owners[0], key
    if owners:
        raise ConfigError(f"ambiguous key '{key}': could be " + ", ".join(f"'{s}.{key}'" for s in owners)
                          + "; use --section.key")
    if prefix in SECTIONS and rest:
        raise ConfigError(_unknown_key(prefix, rest))
    everything = [f"{s}.{n}" for s, cls in SECTIONS.items() for n in _specs(cls)]
    raise ConfigError(_unknown("key", key, everything + [n.partition(".")[2] for n in everything]))


def _parse_cli_value(section: str, name: str, text: str) -> Any:
    """Parse one override value with the YAML 1.2 loader; a str field keeps the raw text (unless null)."""
    base, optional = _split_optional(_specs(SECTIONS[section])[name][0])
    try:
        value = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError:
        if base is not str:
            raise ConfigError(f"{section}.{name}: cannot parse value {text!r}") from None
        value = text
    if base is str:
        return None if optional and value is None else text
    if get_origin(base) is list and isinstance(value, str):  # --train.metrics a,b
        value = [s.strip() for s in value.split(",") if s.strip()]
    return value


def _parse_overrides(tokens: Iterable[str]) -> list[tuple[str, str, Any]]:
    """argv leftovers -> [(section, field, value)], values parsed but not yet validated."""
    tokens, out, i = list(tokens), [], 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if not token.startswith("--") or len(token) == 2:
            raise ConfigError(f"unexpected argument {token!r}: overrides look like --section.key value")
        key, eq, text = token[2:].partition("=")
        section, name = _resolve_key(key)
        if not eq:
            if i >= len(tokens) or tokens[i].startswith("--"):
                raise ConfigError(f"{section}.{name}: missing value after {token}")
            text, i = tokens[i], i + 1
        out.append((section, name, _parse_cli_value(section, name, text)))
    return out


# ----------------------------------------------------------------------------------------- public API
def config_from_dict(data: Any, overrides: Iterable[str] = (), source: Optional[str] = None) -> Config:
    """Build a validated Config from a sectioned mapping plus CLI override tokens (CLI wins).

    `source` (a file name) prefixes errors about `data`. Raises ConfigError (one line) for a non-mapping,
    unknown sections/keys, wrong types, out-of-range values, bad overrides and failed cross-field checks.
    """
    where = f"{source}: " if source else ""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}expected a mapping of sections at the top level, got {type(data).__name__}")
    values: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    for section, body in data.items():
        if section not in SECTIONS:
            raise ConfigError(where + _unknown("section", str(section), SECTIONS))
        if not isinstance(body, (dict, type(None))):
            raise ConfigError(f"{where}{section}: expected a mapping of keys, got {type(body).__name__}")
        specs = _specs(SECTIONS[section])
        for name, value in (body or {}).items():
            if name not in specs:
                raise ConfigError(where + _unknown_key(section, str(name)))
            try:
                values[section][name] = _convert(f"{section}.{name}", *specs[name], value)
            except ConfigError as e:
                raise ConfigError(f"{where}{e}") from None
    for section, name, value in _parse_overrides(overrides):
        values[section][name] = value
    return Config(**{s: cls(**values[s]) for s, cls in SECTIONS.items()})


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
        data = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
        detail = f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark and problem else str(e)
        raise ConfigError(f"invalid YAML in config file {path}: {' '.join(detail.split())}") from None
    return config_from_dict(data, overrides, source=str(path))


def config_to_dict(config: Config) -> dict[str, dict[str, Any]]:
    """Plain nested dict ``{section: {field: value}}`` of `config` (a deep copy)."""
    return dataclasses.asdict(config)


def dump_config(config: Config) -> str:
    """Sectioned YAML with sorted keys that `load_config` reads back into an equal Config."""
    return yaml.dump(config_to_dict(config), Dumper=_Dumper, sort_keys=True, default_flow_style=False,
                     allow_unicode=True)
