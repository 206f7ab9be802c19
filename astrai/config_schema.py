"""Config machinery: YAML 1.2 core-schema loading/dumping and per-field specs (type + range/choices/pattern).

`astrai.config` declares the sections with `field_spec`; this module turns a raw value into a checked one or
raises `ConfigError` with a one-line message naming the field and what was expected.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import re
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Optional, Union, get_args, get_origin, get_type_hints

import yaml


class ConfigError(ValueError):
    """Invalid configuration; the message is one line naming the field or file at fault."""


# ----------------------------------------------------------------------------------------- YAML 1.2 scalars
_CORE = "tag:yaml.org,2002:"


class YamlLoader(yaml.SafeLoader):
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


YamlLoader.yaml_implicit_resolvers = {  # a fresh dict of fresh lists: drop YAML 1.1 bool/int/float/timestamp
    first: [(tag, rx) for tag, rx in resolvers if tag[len(_CORE):] not in ("bool", "int", "float", "timestamp")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
for _tag, _rx, _first in (  # order matters: the first matching resolver wins ("1" is an int)
        ("bool", r"true|True|TRUE|false|False|FALSE", "tTfF"),
        ("int", r"[-+]?[0-9][0-9_]*|0o[0-7_]+|0x[0-9a-fA-F_]+", "-+0123456789"),
        ("float", r"[-+]?(?:\.[0-9][0-9_]*|[0-9][0-9_]*(?:\.[0-9_]*)?)(?:[eE][-+]?[0-9]+)?"
                  r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)", "-+0123456789.")):
    YamlLoader.add_implicit_resolver(_CORE + _tag, re.compile(rf"^(?:{_rx})$"), list(_first))


def _construct_int(loader: YamlLoader, node: yaml.Node) -> int:
    raw = loader.construct_scalar(node)
    text = raw.replace("_", "")
    try:
        return int(text, 0) if text[:2] in ("0o", "0x") else int(text, 10)  # "010" is ten, as in YAML 1.2
    except ValueError:  # e.g. "0x_": not a number after all; the field check reports it
        return raw


YamlLoader.add_constructor(_CORE + "int", _construct_int)


class YamlDumper(yaml.SafeDumper):
    """SafeDumper that quotes exactly the strings `YamlLoader` would not read back as strings (e.g. "1e-5")."""


YamlDumper.yaml_implicit_resolvers = YamlLoader.yaml_implicit_resolvers


# ----------------------------------------------------------------------------------------- field specs
@dataclass(frozen=True)
class Range:
    lo: float
    hi: Optional[float] = None
    lo_open: bool = False
    hi_open: bool = False

    def ok(self, v: float) -> bool:
        if not math.isfinite(v):  # inf / nan never make sense as a setting
            return False
        above = v > self.lo if self.lo_open else v >= self.lo
        return above and (self.hi is None or (v < self.hi if self.hi_open else v <= self.hi))

    def describe(self, kind: str) -> str:
        lo, hi = _number(self.lo), _number(self.hi)
        if self.hi is None:
            return f"{kind} {'>' if self.lo_open else '>='} {lo}"
        return f"{kind} in {'(' if self.lo_open else '['}{lo}, {hi}{')' if self.hi_open else ']'}"


def _number(x: Optional[float]) -> str:
    """A bound as written: integers in full (4294967295), other numbers in short form (1e-08)."""
    if x is None:
        return ""
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


@dataclass(frozen=True)
class Choices:
    values: tuple

    def ok(self, v: Any) -> bool:
        return v in self.values

    def describe(self, kind: str) -> str:
        return "one of " + ", ".join(map(repr, self.values))


@dataclass(frozen=True)
class Pattern:
    regex: str
    text: str

    def ok(self, v: str) -> bool:
        return re.fullmatch(self.regex, v) is not None

    def describe(self, kind: str) -> str:
        return self.text


@dataclass(frozen=True)
class SubsetOf:
    """A list whose items all come from `values`; `alone` items (e.g. 'none') must be the only item."""

    values: tuple
    alone: tuple = ()

    def ok(self, v: list) -> bool:
        return all(x in self.values for x in v) and not (len(v) > 1 and any(x in self.alone for x in v))

    def describe(self, kind: str) -> str:
        only = f" ({' or '.join(map(repr, self.alone))} alone)" if self.alone else ""
        return "a list of " + ", ".join(map(repr, self.values)) + only


ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
"""A portable environment variable name (POSIX shells' rule)."""


@dataclass(frozen=True)
class EnvMap:
    """A mapping of environment variable names to scalars (str, int, float, bool) or null."""

    def problem(self, v: dict) -> Optional[str]:
        """One-line description of the first bad entry of `v`, or None when every entry is fine."""
        for key, value in v.items():
            if not isinstance(key, str) or not ENV_NAME.fullmatch(key):
                return f"key {key!r} is not an environment variable name (letters, digits, '_'; not a digit first)"
            if value is not None and not isinstance(value, (str, int, float, bool)):
                return f"{key}: expected a string, number, boolean or null, got {type(value).__name__}"
        return None

    def ok(self, v: dict) -> bool:
        return self.problem(v) is None

    def describe(self, kind: str) -> str:
        return "a mapping of environment variable names to scalars or null"


@dataclass(frozen=True)
class NonEmpty:
    """A non-empty list of non-empty strings; `text` says what they are (for messages)."""

    text: str

    def ok(self, v: list) -> bool:
        return bool(v) and all(x for x in v)

    def describe(self, kind: str) -> str:
        return self.text


GT0, GE0, UNIT, BETA = Range(0, lo_open=True), Range(0), Range(0, 1), Range(0, 1, hi_open=True)


REQUIRED: Any = dataclasses.MISSING
"""The default of a record key that must be given (`field_spec(REQUIRED, ...)`)."""


def field_spec(default: Any, doc: str, check: Any = None) -> Any:
    """A dataclass field carrying its one-line doc and its check (range / choices / pattern) as metadata."""
    meta = {"doc": doc, "check": check}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


class Section:
    """Base of the section dataclasses: validates and normalises (int -> float) every field on construction."""

    section = ""  # set by the class keyword `name=`; not annotated, so not a field

    def __init_subclass__(cls, name: str = "", **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.section = name

    def __post_init__(self) -> None:
        for name, (hint, check) in field_specs(type(self)).items():
            setattr(self, name, convert_value(f"{self.section}.{name}", hint, check, getattr(self, name)))


class Record:
    """Base of the typed mappings inside a section (`model.lora`, one `reward.functions` item): a dataclass whose
    fields are declared with `field_spec` (`REQUIRED` for keys without a default). Built from a mapping by
    `convert_value`, which names the field, the item (by its dotted path, `reward.functions.0`, as overrides
    spell it) and the key in its one-line errors. `item` says what one item of a list of them is called."""

    item = "item"

    def __init_subclass__(cls, item: str = "item", **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.item = item


def is_record(hint: Any) -> bool:
    """Whether `hint` is a `Record` dataclass type."""
    return isinstance(hint, type) and issubclass(hint, Record)


def record_item(hint: Any) -> Optional[type]:
    """The `Record` type of a `list[Record]` hint, else None."""
    args = get_args(hint)
    return args[0] if get_origin(hint) is list and args and is_record(args[0]) else None


def _record(cls: type, value: Any, where: str) -> Any:
    """A `Record` of type `cls` from the mapping `value`; ConfigError `<where>...` naming the first bad key."""
    specs = field_specs(cls)
    if not isinstance(value, dict):
        raise ConfigError(f"{where}expected a mapping with keys {', '.join(specs)}, got {value!r}")
    for key in value:
        if key not in specs:
            close = difflib.get_close_matches(str(key), list(specs), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else f"; keys: {', '.join(specs)}"
            raise ConfigError(f"{where}unknown key {key!r}{hint}")
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is REQUIRED and f.default_factory is dataclasses.MISSING]
    for name in required:
        if value.get(name) is None:
            raise ConfigError(f"{where}missing key {name!r}")
    given = {k: v for k, v in value.items() if v is not None}  # null: the key's default
    converted = {name: convert_value(f"{where}{name}", *specs[name], v) for name, v in given.items()}
    return cls(**converted)


def to_raw(value: Any) -> Any:
    """The plain YAML form of a field's value: records as mappings, lists and mappings copied (an optional record
    that is off, None, stays None: `astrai.config.config_to_dict` writes it as {})."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_raw(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, list):
        return [to_raw(x) for x in value]
    if isinstance(value, dict):
        return {k: to_raw(x) for k, x in value.items()}
    return value


def check_divides(small: tuple[str, int], big: tuple[str, int]) -> None:
    """Raise ConfigError unless `small`'s value is <= and a divisor of `big`'s value (each (name, value))."""
    (name, s), (big_name, b) = small, big
    if s > b:
        raise ConfigError(f"{name}: expected <= {big_name} ({b}), got {s}")
    if b % s:
        raise ConfigError(f"{name}: expected a divisor of {big_name} ({b}), got {s}")


# ----------------------------------------------------------------------------------------- validation
_KINDS = {int: "an integer", float: "a number", str: "a string", bool: "a boolean"}


@cache
def field_specs(cls: type) -> dict[str, tuple[Any, Any]]:
    """Field name -> (resolved type hint, check or None) of a section dataclass."""
    hints = get_type_hints(cls)
    return {f.name: (hints[f.name], f.metadata["check"]) for f in dataclasses.fields(cls)}


def split_optional(hint: Any) -> tuple[Any, bool]:
    if get_origin(hint) is Union and type(None) in get_args(hint):
        return next(a for a in get_args(hint) if a is not type(None)), True
    return hint, False


def _coerce(base: Any, v: Any) -> Any:
    """`v` as type `base`, or the sentinel `_coerce` itself when it is the wrong type (bool is never a number)."""
    if base is Any:  # any YAML value: the field's check says what it accepts
        return v
    if base in (int, float) and isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v) if base is float else (v if isinstance(v, int) else _coerce)
    if base in (str, bool) and isinstance(v, base):
        return v
    if get_origin(base) is list and isinstance(v, list) and all(isinstance(x, str) for x in v):
        return list(v)
    if get_origin(base) is dict and isinstance(v, dict):
        return dict(v)
    return _coerce


def convert_value(name: str, hint: Any, check: Any, value: Any) -> Any:
    """`value` converted to `hint` and checked; raises ConfigError naming `name` and what was expected. A `Record`
    hint takes a mapping (an empty one: null for an optional record), a `list[Record]` hint a list of them."""
    base, optional = split_optional(hint)
    if is_record(base):
        if isinstance(value, base) or (optional and value in (None, {})):
            return None if value == {} else value
        return _record(base, value, f"{name}: ")
    item = record_item(base)
    if item is not None:
        if not isinstance(value, list):
            raise ConfigError(f"{name}: expected a list of mappings with keys {', '.join(field_specs(item))}, "
                              f"got {value!r}")
        out = [x if isinstance(x, item) else _record(item, x, f"{name}.{i}: ") for i, x in enumerate(value)]
        detail = getattr(check, "problem", lambda v: None)(out)
        if detail:
            raise ConfigError(f"{name}: {detail}")
        return out
    if optional and value is None:
        return None
    out = _coerce(base, value)
    detail = None if out is _coerce else getattr(check, "problem", lambda v: None)(out)
    if detail:
        raise ConfigError(f"{name}: {detail}")
    if out is _coerce or (check is not None and not check.ok(out)):
        kind = _KINDS.get(base, "a mapping" if get_origin(base) is dict else "a list of strings")
        if check is None:
            expected = kind
        elif out is _coerce and isinstance(check, Pattern):  # YAML's 7 for a "cpu or cuda:N" field: both
            expected = f"{kind}: {check.describe(kind)}"
        else:
            expected = check.describe(kind)
        raise ConfigError(f"{name}: expected {'null or ' if optional else ''}{expected}, got {value!r}")
    if base is float and not math.isfinite(out):  # YAML's .nan / .inf that a range did not refuse: never a setting
        raise ConfigError(f"{name}: expected {'null or ' if optional else ''}a finite number, got {value!r}")
    bad = _invalid_text(out)
    if bad:
        raise ConfigError(f"{name}: {bad}")
    return out


def _invalid_text(value: Any) -> Optional[str]:
    """Why `value` (a str, or a list / mapping holding strings) is not valid Unicode text, or None: a lone surrogate
    such as "\\ud800" (which YAML and JSON escapes allow) cannot be encoded as UTF-8, tokenized or written."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            return (f"not valid Unicode text (a lone surrogate, U+{ord(value[err.start]):04X}, at character "
                    f"{err.start})")
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        bad = _invalid_text(key) or _invalid_text(item)
        if bad:
            return f"{key}: {bad}" if isinstance(key, str) and isinstance(value, dict) else bad
    return None
