"""The repository's own folders never shadow an installed package, however Python is started from its root.

transformers >= 5.25 imports the Hugging Face `kernels` package; a regular package named `kernels` at the repository
root (astrai's kernel sources) used to win over it whenever the working directory was on `sys.path` (`python -m
pytest`, `python -m astrai.train`, `accelerate launch` with DeepSpeed, which puts it on PYTHONPATH itself).
"""

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# What `kernels` resolves to, printed as "<file or None>|<a regular package?>".
PROBE = ("import importlib.util; spec = importlib.util.find_spec('kernels'); "
         "print(f'{spec.origin if spec else None}|{bool(spec and spec.loader and spec.origin)}')")

# How Python gets started from the repository root: `python -c` ('' first on sys.path), `python -m` (the working
# directory first), and PYTHONPATH set to the root (what accelerate's DeepSpeed launcher exports).
STARTS = {
    "python -c": (["-c", PROBE], {}),
    "python -m": (["-m", "_astrai_probe"], {}),
    "PYTHONPATH=root": (["-c", PROBE], {"PYTHONPATH": str(REPO)}),
}


def _top_level_names() -> dict[str, set[str]]:
    """Import names of installed distributions other than astrai -> the distributions providing them."""
    provided: dict[str, set[str]] = {}
    for name, dists in importlib.metadata.packages_distributions().items():
        others = {d for d in dists if d.lower() != "astrai"}
        if others:
            provided[name] = others
    return provided


@pytest.mark.parametrize("start", sorted(STARTS))
def test_kernels_resolves_to_the_installed_package_from_the_repository_root(start, tmp_path):
    """From the repository root, `kernels` is the Hugging Face package when it is installed (and never a regular
    package of this repository), and transformers' hub-kernels integration and peft import."""
    args, extra_env = STARTS[start]
    (tmp_path / "_astrai_probe.py").write_text(PROBE + "\n")
    env = {**os.environ, **extra_env}
    if start == "python -m":  # the probe module must be importable: put it after the root, as -m does for a package
        env["PYTHONPATH"] = str(tmp_path)
    out = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    origin, regular = out.stdout.strip().rsplit("|", 1)
    if origin != "None":
        assert not Path(origin).resolve().is_relative_to(REPO / "kernels"), f"{start}: kernels resolved to {origin}"
    try:
        dist = importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        assert regular == "False" or origin == "None", origin  # nothing installed: at most our namespace folder
        return
    assert Path(origin).resolve() == Path(dist.locate_file("kernels/__init__.py")).resolve()


def test_transformers_peft_and_kernels_import_from_the_repository_root():
    """The imports that broke on 2026-12-03 (`cannot import name 'CUDAProperties' from 'kernels'`) succeed with the
    repository root first on sys.path, as under `python -m astrai.train`."""
    import importlib.util
    missing = [name for name in ("transformers", "peft") if importlib.util.find_spec(name) is None]
    if missing:  # not importorskip: a shadowed dependency fails to import, which must fail this test
        pytest.skip(f"not installed: {missing}")
    code = ("import transformers.modeling_utils, peft, astrai.kernels, sys; "
            "import kernels; print(kernels.__name__, astrai.kernels.__name__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["kernels", "astrai.kernels"]


def test_no_top_level_folder_is_a_package_named_like_an_installed_distribution():
    """No folder at the repository root is a regular package (`__init__.py`) whose name an installed distribution
    also provides, and every name an installed distribution provides resolves outside the repository when the
    root is first on sys.path (a folder without `__init__.py` only loses to a regular package)."""
    provided = _top_level_names()
    folders = [p for p in REPO.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name.isidentifier()]
    assert {"astrai", "kernels", "tests"} <= {p.name for p in folders}  # the check below is not vacuous
    clashes = [f"{p.name} (also provided by {sorted(provided[p.name])})" for p in folders
               if p.name != "astrai" and (p / "__init__.py").exists() and p.name in provided]
    assert not clashes, clashes
    shared = sorted(p.name for p in folders if p.name in provided)
    if not shared:
        return
    code = ("import importlib.util, sys\n"
            f"for name in {shared!r}:\n"
            "    print(name, getattr(importlib.util.find_spec(name), 'origin', None), sep='|')")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for line in out.stdout.splitlines():
        name, origin = line.rsplit("|", 1)
        assert origin != "None" and not Path(origin).resolve().is_relative_to(REPO / name), (name, origin)


def test_the_kernel_sources_are_packaged_as_astrai_kernels():
    """The kernel sources stay under kernels/ and import as `astrai.kernels` (pyproject's package-dir)."""
    import astrai.kernels
    from astrai.kernels import paged_attention

    assert (REPO / "kernels" / "astrai_kernels" / "__init__.py").is_file()
    assert paged_attention.__name__ == "astrai.kernels.paged_attention" and astrai.kernels.TorchBackend
    assert not (REPO / "kernels" / "__init__.py").exists()


def test_every_package_of_the_source_tree_is_installed_by_a_wheel():
    """pyproject's explicit `packages` list names every package under astrai/ (an editable install finds a package
    missing from it; a wheel or the Docker image would not)."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "astrai").rglob("__init__.py")}
    assert on_disk - {"astrai.kernels"} <= listed, sorted(on_disk - listed)


def _setup_commands() -> list[str]:
    """The README's set-up-and-go command lines (the indented lines that make the virtual environment)."""
    return [line.strip() for line in (REPO / "README.md").read_text().splitlines()
            if line.strip().startswith("python3 -m venv .venv")]


def test_every_set_up_path_installs_from_the_committed_constraints():
    """The README's two commands and .ci/run constrain every `pip install` with constraints.txt, and .ci/run runs
    exactly the README's test command."""
    commands = _setup_commands()
    assert len(commands) == 2 and commands[0].endswith("configs/examples/ppo.yaml") and \
        commands[1].endswith("-m pytest"), commands
    for command in commands:
        installs = [part.strip() for part in command.split("&&") if " install " in part]
        assert len(installs) == 3 and all(" -c constraints.txt " in part for part in installs), installs
    ci = [line for line in (REPO / ".ci/run").read_text().splitlines() if line.startswith("python3 -m venv")]
    assert ci == [commands[1]]


def test_constraints_pin_every_dependency_within_pyproject_ranges():
    import tomllib

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from test_docker import constraints

    pins = constraints()
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    # gemma3: a model package; vllm: pins transformers below constraints.txt's, installed apart (make_vllm_venv.sh)
    wanted = project["dependencies"] + [r for name, reqs in extras.items() if name not in ("gemma3", "vllm")
                                        for r in reqs]
    for text in wanted:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is not pinned in constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), (text, pins[name])
