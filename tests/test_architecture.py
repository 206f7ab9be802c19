"""Structural rules of the house that a change could silently break (docs/architecture.md)."""

import ast
from pathlib import Path

ASTRAI = Path(__file__).resolve().parents[1] / "astrai"


def _calls(path: Path) -> set[str]:
    """Attribute names called anywhere in `path` (`x.backward()` -> "backward")."""
    tree = ast.parse(path.read_text())
    return {node.func.attr for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)}


def test_learners_compute_losses_and_never_step():
    """Backward, clipping and optimizer/scheduler steps live in one seam (`Trainer.accumulate_and_step` with
    `TrainedModel`)."""
    for path in (ASTRAI / "trainer" / "learners").glob("*.py"):
        called = _calls(path)
        assert not called & {"backward", "step", "zero_grad", "clip_grad_norm_"}, (path.name, called)


KERNELS = ASTRAI.parent / "kernels" / "astrai_kernels"
"""`astrai.kernels`, installed from the repository's kernels/ folder (pyproject's package-dir)."""


def _sources() -> dict[str, Path]:
    """Every module of the astrai package by dotted name (`astrai.rollout.engine`, `astrai.kernels.backends`)."""
    found = {}
    for root, prefix in ((ASTRAI, "astrai"), (KERNELS, "astrai.kernels")):
        for path in root.rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([prefix, *parts])] = path
    return found


SOURCES = _sources()


def _imports(path: Path, name: str) -> set[str]:
    """The astrai modules `path` (module `name`) imports, in every form: `import astrai.x`, `from astrai.x import
    y` (y a module or a name in x), `from astrai import x`, relative imports, and imports inside functions or under
    `TYPE_CHECKING`. Each resolves to the module itself (`astrai.x.y` when y is a module, else `astrai.x`)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            candidates = [f"{base}.{alias.name}" for alias in node.names]  # a module, or a name in `base`
        else:
            continue
        for candidate in candidates:
            while candidate and candidate not in SOURCES:  # astrai.x.name -> astrai.x
                candidate = candidate.rpartition(".")[0]
            if candidate.startswith("astrai.") and candidate != "astrai":
                found.add(candidate)
    return found


def _unit(module: str) -> str:
    """The package or top-level module a module belongs to: `astrai.rollout.engine` -> `rollout` ("" for the
    astrai package itself)."""
    return module.split(".")[1] if "." in module else ""


# The house, floor by floor: each unit (a package, or a module directly under astrai/) and the units it may import.
# Every import stays in its unit or points down (the map itself is checked to have no circle).
LAYERS = {
    # floor 1: leaves
    "algos": set(),                                    # pure tensor math
    "deps": set(),                                     # optional imports, torch-free
    "imports": set(),                                  # user code named in a job ("module:name", a file), stdlib
    "outputs": set(),                                  # the files written beside checkpoints: write errors, reader
    "config_schema": set(),                            # YAML 1.2 and the field machinery, torch-free
    "runtime_env": set(),
    "cpu_threads": set(),                              # torch thread counts under other processes' load (torch)
    "sandbox": set(),                                  # stdlib only
    "models": {"deps"},
    "kernels": {"deps"},
    # floor 2
    "train_types": {"config_schema", "algos"},         # torch-free records (algos: its torch-free registry)
    "agents": {"models", "deps", "imports"},           # tools, environments, tool-call format, chat rendering
    # floor 3
    "config": {"config_schema", "train_types", "algos", "deps"},
    "checkpoint": {"models", "outputs", "train_types"},   # outputs: the job lock's write errors
    # floor 4
    "data": {"agents", "config", "config_schema", "train_types", "models", "deps"},  # agents: tool-use demos
    "distributed": {"checkpoint", "deps", "models", "outputs", "runtime_env"},
    # floor 5
    "forward": {"algos", "data", "models"},            # the training forward: log-probs and values of sequences
    "rollout": {"data", "models", "kernels", "config", "cpu_threads", "deps", "outputs", "runtime_env"},  # generation engines only
    "rewards": {"data", "models", "sandbox", "deps", "imports"},
    # floor 6
    "experience": {"agents", "algos", "data", "forward", "imports", "models", "rewards", "rollout"},
    "evaluation": {"algos", "checkpoint", "config", "config_schema", "data", "models", "outputs", "rewards",
                   "rollout", "runtime_env"},
    # floor 7
    "trainer": {"algos", "checkpoint", "config", "config_schema", "cpu_threads", "data", "deps", "distributed",
                "evaluation", "experience", "forward", "models", "outputs", "rewards", "rollout", "runtime_env",
                "train_types"},
    "serve": {"agents", "checkpoint", "deps", "models", "outputs", "rollout", "runtime_env", "data"},
    # floor 8: entry points (`python -m astrai.<name>`)
    "train": {"checkpoint", "config", "data", "distributed", "kernels", "outputs", "rewards", "runtime_env",
              "train_types", "trainer"},
    "evaluate": {"evaluation", "experience", "outputs"},
    "plot": {"checkpoint", "deps", "outputs"},
}


def test_every_unit_is_fenced_and_the_fences_form_no_circle():
    """Every package and top-level module of astrai has a line in LAYERS, and the allowed imports form floors."""
    units = {_unit(m) for m in SOURCES} - {""}
    assert units == set(LAYERS), (units - set(LAYERS), set(LAYERS) - units)
    placed: list[str] = []
    while len(placed) < len(LAYERS):
        ready = [u for u in LAYERS if u not in placed and LAYERS[u] <= set(placed)]
        assert ready, f"LAYERS has a circle among {sorted(set(LAYERS) - set(placed))}"
        placed.extend(sorted(ready))


def test_imports_point_down_only():
    """Every astrai import of every module, in every form, stays within its unit or reaches an allowed lower one."""
    offenders = []
    for name, path in SOURCES.items():
        if name == "astrai":
            continue
        unit = _unit(name)
        for target in _imports(path, name):
            if _unit(target) != unit and _unit(target) not in LAYERS[unit]:
                offenders.append(f"{name} -> {target}")
    assert not offenders, offenders


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan 1972)."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in list(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_import_circle_between_modules():
    """No module reaches itself through imports (a circle hidden by an import inside a function included)."""
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the finder finds
    graph = {name: _imports(path, name) - {name} for name, path in SOURCES.items()}
    assert not _circles(graph)


def test_the_import_reader_sees_every_form(tmp_path):
    """The checks above are not vacuous: `from astrai import x`, relative imports, imports inside functions and
    `from astrai.x import module` all resolve."""
    probe = tmp_path / "probe.py"
    probe.write_text("from astrai import forward\nfrom . import engine\nfrom .sampling import SamplingParams\n"
                     "def f():\n    import astrai.rewards.builtins\n    from astrai.experience import runner\n")
    assert _imports(probe, "astrai.rollout.probe") == {
        "astrai.forward", "astrai.rollout.engine", "astrai.rollout.sampling", "astrai.rewards.builtins",
        "astrai.experience.runner"}


# The train-type registry (astrai/train_types): the one place besides the learners that knows train types.
REGISTRY_OWNED = (ASTRAI / "train_types", ASTRAI / "trainer" / "learners")


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
    only in its record (`astrai/train_types/`) and its learner module: everything else asks the registry. Prose
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
    learner and the config that declares them; `distributed/` reads none and imports no registry."""
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
    for name, path in SOURCES.items():
        if _unit(name) == "distributed":
            assert "astrai.train_types" not in _imports(path, name), path


def test_train_type_records_import_no_torch():
    """The records are read by the config, which the host-side tools load without torch."""
    import subprocess
    import sys
    code = ("import sys; import astrai.config, astrai.train_types; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
