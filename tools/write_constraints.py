"""Write constraints.txt (the pinned set every set-up path installs with) from a virtual environment that passed.

    python tools/write_constraints.py VENV_PYTHON [--output constraints.txt] [--note "1033 passed, ..."]
    python tools/write_constraints.py VENV_PYTHON --diff     # only print what differs from the file

Reads `VENV_PYTHON -m pip freeze --all --exclude-editable` and writes one NAME==VERSION line per package, sorted,
under a header saying where the set came from. Local version labels are dropped (`torch==2.13.0+cpu` is written
`torch==2.13.0`, which the CPU and the CUDA builds both satisfy). The hand-pinned packages (`HAND_PINNED`) keep
the line they have in the current file: the script cannot test them here. tools/check_newest_deps.sh --write calls
this after the test suite passed in that environment; docs/install.md says when to run it.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HAND_PINNED = {
    "torch": "the README installs it first; bump it by hand with docker/Dockerfile's TORCH_VERSION",
    "triton": "torch's CUDA wheel pins it exactly (2.13.0: triton==3.7.1); moves with torch",
    "flash-attn": "sources only, builds only with CUDA (the Docker image's optional INSTALL_FLASH_ATTN)",
}
"""Packages whose pin this script keeps from the current file, with why."""


def canonical(name: str) -> str:
    """PEP 503 normalised name (`Jinja2` -> `jinja2`, `pydantic_core` -> `pydantic-core`)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: Path) -> dict[str, str]:
    """{canonical name: the file's NAME==VERSION line} of a constraints file (comments and blanks skipped)."""
    pins = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                pins[canonical(line.split("==", 1)[0])] = line
    return pins


def frozen(python: str) -> dict[str, str]:
    """{canonical name: NAME==VERSION} installed in the environment of `python` (local labels dropped)."""
    out = subprocess.run([python, "-m", "pip", "freeze", "--all", "--exclude-editable"], check=True,
                         capture_output=True, text=True).stdout
    pins = {}
    for line in out.splitlines():
        if "==" not in line or line.startswith(("#", "-e")):
            continue
        name, version = line.split("==", 1)
        pins[canonical(name)] = f"{name}=={version.split('+', 1)[0]}"
    return pins


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("python", help="the python of the environment that passed the tests")
    parser.add_argument("--output", type=Path, default=REPO / "constraints.txt")
    parser.add_argument("--note", default="", help="the test run's outcome, written into the header")
    parser.add_argument("--diff", action="store_true", help="print the packages whose version differs; write nothing")
    args = parser.parse_args(argv)
    current = read_pins(args.output)
    pins = frozen(args.python)
    pins.pop("astrai", None)
    if args.diff:
        version = lambda pins, name: pins[name].split("==", 1)[1] if name in pins else "-"  # noqa: E731
        moved = [f"  {name}: {version(current, name)} -> {version(pins, name)}" for name in sorted(set(current) | set(pins))
                 if version(current, name) != version(pins, name) and not (name in HAND_PINNED and name not in pins)]
        print("\n".join(moved) if moved else "  none")
        return 0
    for name in HAND_PINNED:
        if name in current:
            pins[name] = current[name]
    version = subprocess.run([args.python, "-c", "import platform; print(platform.python_version())"],
                             check=True, capture_output=True, text=True).stdout.strip()
    header = [
        "# Every dependency of astrai, pinned to versions that passed the test suite together. The README's two",
        "# commands, .ci/run and docker/Dockerfile install with it (pip install -c constraints.txt ...);",
        "# pyproject.toml keeps the ranges a user's own environment may satisfy. Refresh: docs/install.md.",
        f"# Written by tools/write_constraints.py on {datetime.date.today()} from Python {version} on "
        f"{platform.system()} {platform.machine()}" + (f"; tests: {args.note}" if args.note else "") + ".",
        "# Hand-pinned, kept as they are on every refresh:",
        *[f"#   {name}: {why}" for name, why in HAND_PINNED.items()],
    ]
    body = [pins[name] for name in sorted(pins)]
    args.output.write_text("\n".join(header + body) + "\n")
    print(f"wrote {args.output}: {len(body)} pins")
    return 0


if __name__ == "__main__":
    sys.exit(main())
