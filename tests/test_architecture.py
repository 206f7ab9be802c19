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
    algos pure (imports no other astrai package); checkpoint knows no strategy."""
    config = {"config", "config_schema"}
    allowed = {
        "algos": set(),
        "models": {"models"},
        "data": {"data", "models"} | config,
        "rollout": {"rollout", "data", "models", "algos", "kernels"} | config,
        "checkpoint": {"checkpoint", "models"},
    }
    for package, ok in allowed.items():
        for path in (ASTRAI / package).rglob("*.py"):
            used = {name.split(".")[1] for name in _imports(path) if name.startswith("astrai.")}
            assert used <= ok | {package}, (path.relative_to(ASTRAI), used - ok)
