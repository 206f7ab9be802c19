"""The documents name only what exists: module paths and dotted names in docs/architecture.md, repository paths in
README.md and docs/benchmarks.md, the relative links of all three, and the floors of docs/architecture.md against
tests/test_architecture.py's map."""

import glob
import importlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ARCHITECTURE = REPO / "docs" / "architecture.md"
README = REPO / "README.md"
BENCHMARKS = REPO / "docs" / "benchmarks.md"

SPAN = re.compile(r"`([^`]+)`")
"""A backticked span (Markdown lets one run over a line break)."""

PLACEHOLDER = re.compile(r"<[^<>/]*>")
"""`<engine>` in `configs/zero/<engine>.yaml`: any name."""


def path_pattern(roots: tuple[str, ...]) -> re.Pattern:
    """Repository paths that start with one of `roots` (`astrai/rollout/engine.py`, `configs/zero/*.yaml`), not
    preceded by a path character (so `/x/bench/y` and `outputs/ppo` are not read as `bench/y`)."""
    return re.compile(r"(?<![\w./~-])(?:%s)/[\w./*<>-]*" % "|".join(map(re.escape, roots)))


DOTTED = re.compile(r"(?<![\w./-])astrai(?:\.\w+)+")
"""A dotted name under astrai: a module (`astrai.rollout.engine`) or a name in one (`astrai.forward.response_logprobs`,
`astrai.rollout.engine.GenerationEngine.generate`)."""


def spans(text: str) -> list[str]:
    """The backticked spans of a Markdown text."""
    return SPAN.findall(text)


def paths_in(text: str, roots: tuple[str, ...]) -> list[str]:
    """The repository paths under `roots` that the backticked spans of `text` name, in order, duplicates dropped."""
    pattern = path_pattern(roots)
    found = [p.rstrip(".,:;") for span in spans(text) for p in pattern.findall(span)]
    return list(dict.fromkeys(found))


def dotted_in(text: str) -> list[str]:
    """The dotted `astrai.` names that the backticked spans of `text` name, in order, duplicates dropped."""
    return list(dict.fromkeys(name for span in spans(text) for name in DOTTED.findall(span)))


def missing_path(path: str) -> bool:
    """Whether the repository holds nothing at `path` (a file or a folder; `*` and `<name>` match any name)."""
    pattern = PLACEHOLDER.sub("*", path)
    if "*" in pattern:
        return not glob.glob(str(REPO / pattern))
    return not (REPO / pattern.rstrip("/")).exists()


def unresolved(name: str) -> str | None:
    """Why `name` does not resolve (None when it does): the longest prefix that imports as a module, then each
    further part as an attribute. A module that needs a third-party package which is not installed counts as
    resolved when its source file exists (the attributes are then not checked)."""
    parts = name.split(".")
    for i in range(len(parts), 1, -1):
        module_name = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name and module_name.startswith(err.name) and err.name.startswith("astrai"):
                continue  # module_name (or a package above it) is no module: try a shorter prefix
            source = REPO / Path(*parts[:i])
            return None if source.with_suffix(".py").exists() or source.is_dir() else f"{name}: {err}"
        except Exception as err:  # noqa: BLE001 (a module that fails to import names nothing)
            return f"{name}: importing {module_name} failed: {type(err).__name__}: {err}"
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return f"{name}: {module_name} has no {'.'.join(parts[i:])}"
            obj = getattr(obj, attr)
        return None
    return f"{name}: no module"


ARCHITECTURE_ROOTS = ("astrai", "kernels")
README_ROOTS = ("astrai", "kernels", "bench", "tools", "configs")


def test_architecture_names_only_existing_modules():
    text = ARCHITECTURE.read_text()
    paths, names = paths_in(text, ARCHITECTURE_ROOTS), dotted_in(text)
    assert len(paths) > 50 and len(names) > 50, (len(paths), len(names))  # the readers find what the page names
    assert [p for p in paths if missing_path(p)] == []
    assert [why for why in map(unresolved, names) if why] == []


@pytest.mark.parametrize("doc", [README, BENCHMARKS], ids=lambda p: p.name)
def test_readme_and_benchmarks_name_only_existing_paths(doc):
    text = doc.read_text()
    paths = paths_in(text, README_ROOTS)
    assert len(paths) >= 5, paths
    assert [p for p in paths if missing_path(p)] == []
    assert [why for why in map(unresolved, dotted_in(text)) if why] == []


def test_the_checks_catch_a_wrong_name():
    """The readers and checks above are not vacuous: a wrong path, module or attribute is reported."""
    text = ("`astrai/rollout/engine.py` `astrai/rollout/rewards.py`, `configs/zero/<engine>.yaml` "
            "`python -m astrai.train --x` `astrai.rollout.engine.GenerationEngine.generate` `astrai.rollout.rewards` "
            "`astrai.forward.response_logprob` `outputs/ppo/bench/x.py` and an unquoted astrai/nothing.py")
    paths = paths_in(text, README_ROOTS)
    assert paths == ["astrai/rollout/engine.py", "astrai/rollout/rewards.py", "configs/zero/<engine>.yaml"]
    assert [p for p in paths if missing_path(p)] == ["astrai/rollout/rewards.py"]
    names = dotted_in(text)
    assert names == ["astrai.train", "astrai.rollout.engine.GenerationEngine.generate", "astrai.rollout.rewards",
                     "astrai.forward.response_logprob"]
    assert [n for n in names if unresolved(n)] == ["astrai.rollout.rewards", "astrai.forward.response_logprob"]
    assert missing_path("kernels/astrai_kernels/") is False and missing_path("bench/engines.py") is True


LINK = re.compile(r"\]\(([^)\s]+)\)|^\[[^\]]+\]: *(\S+)", re.M)
"""The target of an inline Markdown link `[text](target)` or a reference definition `[label]: target`."""


@pytest.mark.parametrize("doc", [README, BENCHMARKS, ARCHITECTURE], ids=lambda p: p.name)
def test_relative_links_reach_files(doc):
    """Every relative link of the page leads to a file or folder of the repository (anchors and URLs aside)."""
    targets = [a or b for a, b in LINK.findall(doc.read_text())]
    local = [t.split("#")[0] for t in targets if not t.startswith(("#", "http://", "https://"))]
    assert [t for t in local if not (doc.parent / t).exists()] == []

FLOOR_LINE = re.compile(r"^ {4}(?:floor (\d+))? +([a-z_]+) +-> *(.*)$")
CONTINUATION = re.compile(r"^ {20,}([a-z_ ]+)$")


def drawn_floors(text: str) -> dict[str, tuple[int, set[str]]]:
    """The units of the floor drawing under "## Packages on floors": unit -> (floor, the units it may import)."""
    section = text.split("\n## Packages on floors\n", 1)[1].split("\n## ", 1)[0]
    units: dict[str, tuple[int, set[str]]] = {}
    floor, last = 0, None
    for line in section.splitlines():
        match = FLOOR_LINE.match(line)
        if match:
            floor = int(match.group(1)) if match.group(1) else floor
            last = match.group(2)
            units[last] = (floor, set(match.group(3).split("(")[0].split()))
        elif last and CONTINUATION.match(line):
            units[last][1].update(CONTINUATION.match(line).group(1).split())
        elif line.strip() and not line.startswith("    "):
            last = None  # prose after the drawing
    return units


def test_the_floor_drawing_agrees_with_the_layers_map():
    """docs/architecture.md draws every unit of `LAYERS` with exactly its allowed imports, each on its floor or
    below."""
    from test_architecture import LAYERS

    units = drawn_floors(ARCHITECTURE.read_text())
    assert {unit: imports for unit, (_, imports) in units.items()} == LAYERS
    for unit, (floor, imports) in units.items():
        assert all(units[target][0] <= floor for target in imports), (unit, floor, imports)
