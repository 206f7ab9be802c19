"""Tools: plain Python functions the policy may call, with the JSON schema a chat template shows the model.

A tool is a function with type hints and a Google-style docstring, as TRL's ``GRPOTrainer(tools=[...])`` and
``transformers``' ``apply_chat_template(tools=[...])`` take them::

    def calculator(expression: str) -> str:
        \"\"\"Evaluate an arithmetic expression.

        Args:
            expression: The expression, e.g. "12 * 34".
        \"\"\"

Its schema is ``transformers.utils.get_json_schema(fn)``, unchanged (the OpenAI function format
``{"type": "function", "function": {"name", "description", "parameters"}}``, plus ``"return"`` when the return
type is annotated), so a template renders exactly what it renders for a TRL or transformers user.

The job lists its tools as reward functions are listed (`astrai.rewards.workers`): ``"package.module:function"``
imported from ``sys.path``, or ``{function: "function", path: "tools.py"}`` (``"module:function"`` also accepted
with ``path``) loaded from a file under a private module name, through `astrai.imports`, the loader reward
functions and environment classes share. `load_tools` also accepts functions and `Tool` records already in hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, Union

from astrai.deps import import_optional
from astrai.imports import ImportFailure, load_attribute, split_reference

__all__ = ["Tool", "ToolError", "tool_from_function", "load_tools"]

ToolReference = Union[str, Mapping[str, Any], Callable, "Tool"]
"""One entry of the job's tool list: "package.module:function", {function, path[, name]}, a function or a Tool."""


class ToolError(ValueError):
    """A tool cannot be loaded or described; the message is one line naming it."""


@dataclass(frozen=True)
class Tool:
    """A tool the policy may call.

    Attributes:
        name: the name the model calls it by (``schema["function"]["name"]``).
        description: its description (the docstring's summary).
        schema: the JSON schema a chat template receives (OpenAI function format, see the module docstring).
        function: the callable, called with the arguments as keywords.
    """

    name: str
    description: str
    schema: Mapping[str, Any]
    function: Callable[..., Any]

    @property
    def parameters(self) -> Mapping[str, Any]:
        """The JSON schema of the arguments (``{"type": "object", "properties": {...}, "required": [...]}``)."""
        return self.schema["function"].get("parameters") or {"type": "object", "properties": {}}


def tool_from_function(fn: Callable, *, name: str | None = None) -> Tool:
    """The `Tool` of `fn`, its schema from its type hints and Google-style docstring (`get_json_schema`);
    `name` renames it (the schema says the new name).

    Raises:
        ToolError: one line naming the function and what is missing (a docstring, an argument's description in
            it, a type hint, a type the schema cannot express), or that it is not callable.
        astrai.deps.MissingDependencyError: transformers is not installed.
    """
    label = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    if not callable(fn):
        raise ToolError(f"tool {label!r} is of type {type(fn).__name__}, not a function")
    utils = import_optional("transformers.utils", needed_by="astrai.agents tools (their JSON schema)",
                            install="pip install 'astrai[agents]'", package="transformers")
    try:
        schema = utils.get_json_schema(fn)
    except Exception as err:  # transformers' DocstringParsingException, TypeHintParsingException, ValueError, ...
        text = " ".join(str(err).split())
        raise ToolError(f"tool {label!r}: cannot derive its JSON schema from its type hints and Google-style "
                        f"docstring: {text}") from None
    function = dict(schema["function"])
    if name is not None:
        function["name"] = name
    schema = {**schema, "function": function}
    return Tool(name=function["name"], description=function.get("description", ""), schema=schema, function=fn)


def load_tools(references: Sequence[ToolReference], base_dir: str | Path | None = None,
               where: str = "rollout.tools") -> list[Tool]:
    """The tools `references` name, in order (see the module docstring for the forms); a relative ``path`` is
    taken from `base_dir` (default: the working directory).

    Raises:
        ToolError: one line naming the entry (``rollout.tools.<i>``): a malformed reference, a missing file, an
            import that fails, no such attribute, something not callable, a schema that cannot be derived, or a
            tool name another entry already has.
    """
    base = Path.cwd() if base_dir is None else Path(base_dir)
    tools: list[Tool] = []
    taken: dict[str, int] = {}
    for i, reference in enumerate(references):
        label = f"{where}.{i}"
        try:
            tool = _load_one(reference, base)
        except ToolError as err:
            raise ToolError(f"{label}: {err}") from None
        if tool.name in taken:
            raise ToolError(f"{label}: tool name {tool.name!r} is already taken by {where}.{taken[tool.name]}; "
                            "give one of them another `name`")
        taken[tool.name] = i
        tools.append(tool)
    return tools


def _load_one(reference: ToolReference, base: Path) -> Tool:
    """One entry of `load_tools` as a Tool (ToolError without the entry's label)."""
    if isinstance(reference, Tool):
        return reference
    if isinstance(reference, str):
        return tool_from_function(_import(reference, None))
    if isinstance(reference, Mapping):
        unknown = sorted(set(reference) - {"function", "path", "name"})
        if unknown or not isinstance(reference.get("function"), str):
            raise ToolError(f"expected {{function: 'module:function' or 'function' with path, path, name}}, got "
                            f"{dict(reference)!r}")
        path = reference.get("path")
        path = None if path is None else (base / Path(path).expanduser()).resolve()
        return tool_from_function(_import(reference["function"], path), name=reference.get("name"))
    if callable(reference):
        return tool_from_function(reference)
    raise ToolError(f"expected 'package.module:function', {{function, path}}, a function or a Tool, got "
                    f"{type(reference).__name__}")


def _import(function: str, path: Path | None) -> Callable:
    """The callable `function` names: "module:attr" from sys.path, or "attr" / "module:attr" in the file `path`
    (`astrai.imports.load_attribute`)."""
    if split_reference(function, path) is None:
        raise ToolError(f"function {function!r}: expected 'package.module:function', or a `path` to its file")
    try:
        fn = load_attribute(function, path)
    except ImportFailure as err:
        raise ToolError(str(err)) from None
    if not callable(fn):
        raise ToolError(f"{function} is of type {type(fn).__name__}, not a function")
    return fn
