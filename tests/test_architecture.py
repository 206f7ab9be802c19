"""Structural rules of the house that a change could silently break (docs/architecture.md)."""

import ast
from pathlib import Path

ASTRAI = Path(__file__).resolve().parents[1] / "astrai"


def _calls(path: Path) -> set[str]:
    """Attribute names called anywhere in `path` (`x.backward()` -> "backward")."""
    tree = ast.parse(path.read_text())
    return {node.func.attr for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)}


def _imports(path: Path) -> set[str]:
    """Modules imported by `path` (absolute names)."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_strategies_compute_losses_and_never_step():
    """Backward, clipping and optimizer/scheduler steps live in one seam (`Trainer.accumulate_and_step` with
    `TrainedModel`)."""
    for path in (ASTRAI / "trainer" / "strategies").glob("*.py"):
        called = _calls(path)
        assert not called & {"backward", "step", "zero_grad", "clip_grad_norm_"}, (path.name, called)


def test_layers_point_one_way():
    """models <- data <- rollout <- trainer, the job configuration (`config`, `config_schema`) beneath data;
    algos pure (imports no other astrai package); checkpoint knows no strategy (it asks the torch-free train-type
    registry, which knows only the config machinery)."""
    config = {"config", "config_schema", "deps"}  # deps: optional imports, a torch-free leaf
    allowed = {
        "algos": set(),
        "models": {"models", "deps"},
        "data": {"data", "models"} | config,
        "rollout": {"rollout", "data", "models", "algos", "kernels"} | config,
        "checkpoint": {"checkpoint", "models", "train_types"},
        "train_types": {"config_schema"},
    }
    for package, ok in allowed.items():
        for path in (ASTRAI / package).rglob("*.py"):
            used = {name.split(".")[1] for name in _imports(path) if name.startswith("astrai.")}
            assert used <= ok | {package}, (path.relative_to(ASTRAI), used - ok)


# The train-type registry (astrai/train_types): the one place besides the strategies that knows train types.
REGISTRY_OWNED = (ASTRAI / "train_types", ASTRAI / "trainer" / "strategies")


ESTIMATOR_NAMES = ("ADVANTAGE_ESTIMATORS", "advantage_estimator")
"""Config names whose values are advantage-estimator names (one of which, `grpo`, is also a train type's)."""


def _owned(path: Path) -> bool:
    return any(path.is_relative_to(owner) for owner in REGISTRY_OWNED)


def _train_type_names() -> tuple[str, ...]:
    from astrai import train_types
    return train_types.names()


def _string_constants(tree: ast.AST) -> list[ast.Constant]:
    """The str constants of a module except docstrings (which may name train types in prose) and config section
    names (`class GRPOSection(Section, name="grpo")`: the section, not the train type)."""
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            docstrings.update(id(k.value) for k in node.keywords if k.arg == "name")
        targets = (node.targets if isinstance(node, ast.Assign) else [node.target]
                   if isinstance(node, ast.AnnAssign) else [])
        if any(getattr(t, "id", None) in ESTIMATOR_NAMES for t in targets):  # "grpo" the estimator, not the type
            docstrings.update(id(c) for c in ast.walk(node) if isinstance(c, ast.Constant))
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    return [node for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docstrings]


def test_only_the_registry_names_train_types():
    """A train type's name as a value (`kind == "online_ppo"`, `("online_ppo", "online_grpo")`, a dict key) appears
    only in its record (`astrai/train_types/`) and its strategy module: everything else asks the registry. Prose
    that mentions one (a docstring, an error message) is fine."""
    names = set(_train_type_names())
    assert names >= {"online_ppo", "online_grpo", "sft"}  # the check below is not vacuous
    offenders = []
    for path in ASTRAI.rglob("*.py"):
        if _owned(path) or path.is_relative_to(ASTRAI / "algos"):  # algos imports nothing: it cannot know them
            continue
        for node in _string_constants(ast.parse(path.read_text())):
            if node.value in names:
                offenders.append(f"{path.relative_to(ASTRAI)}:{node.lineno}: {node.value!r}")
    assert not offenders, offenders


def test_algorithm_sections_are_read_by_their_train_types():
    """`config.ppo` / `config.grpo` / `config.dpo` (a train type's own section) are read only by its record, its
    strategy and the config that declares them; `distributed/` reads none and imports no registry."""
    from astrai import train_types
    sections = {t.section for t in train_types.all_train_types() if t.section is not None}
    assert sections == {"ppo", "grpo", "dpo"}
    offenders = []
    for path in ASTRAI.rglob("*.py"):
        if _owned(path) or path == ASTRAI / "config.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in sections:
                offenders.append(f"{path.relative_to(ASTRAI)}:{node.lineno}: .{node.attr}")
    assert not offenders, offenders
    for path in (ASTRAI / "distributed").rglob("*.py"):
        assert "astrai.train_types" not in _imports(path), path


def test_train_type_records_import_no_torch():
    """The records are read by the config, which the host-side tools load without torch."""
    import subprocess
    import sys
    code = ("import sys; import astrai.config, astrai.train_types; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
