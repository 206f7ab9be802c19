"""Optional dependencies: imported on first use, and reported honestly when they cannot be.

A package that is not installed and one that is installed but fails to import (a broken build, a dependency
shadowed by a folder on `sys.path`, a CUDA library missing) need different fixes, so the message says which,
quoting the import error's own first line in the second case. Torch-free (the config reads it).
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

__all__ = ["MissingDependencyError", "import_optional", "unavailable_reason"]


class MissingDependencyError(ImportError):
    """An optional package is missing or broken; the message is one line saying which and how to fix it."""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def unavailable_reason(module: str, *, needed_by: str, install: str | None = None,
                       package: str | None = None) -> str | None:
    """None when `module` imports; else one line: ``"<needed_by> needs the <package> package, which is not
    installed (<install>)"`` or ``"<needed_by> needs the <package> package, which is installed but failed to
    import: ImportError: <first line>"``.

    Args:
        module: the import name (``"peft"``, ``"torch.utils.tensorboard"``).
        needed_by: what asks for it, as the user writes it (``"model.lora"``, ``"astrai.serve"``).
        install: the command that installs it (``"pip install 'astrai[lora]'"``), shown when it is missing.
        package: the top-level import name whose presence means "installed" and that the message shows (default:
            the module's top-level name; ``"tensorboard"`` for ``"torch.utils.tensorboard"``).
    """
    package = package or module.split(".")[0]
    if importlib.util.find_spec(package) is None:
        fix = f" ({install})" if install else ""
        return f"{needed_by} needs the {package} package, which is not installed{fix}"
    try:
        importlib.import_module(module)
    except Exception as exc:  # ImportError, or a broken build raising anything at import time
        return f"{needed_by} needs the {package} package, which is installed but failed to import: {_first_line(exc)}"
    return None


def import_optional(module: str, *, needed_by: str, install: str | None = None,
                    package: str | None = None) -> ModuleType:
    """`module`, imported; see `unavailable_reason` for the arguments.

    Raises:
        MissingDependencyError: one line saying whether the package is missing or installed but broken.
    """
    reason = unavailable_reason(module, needed_by=needed_by, install=install, package=package)
    if reason is not None:
        raise MissingDependencyError(reason)
    return importlib.import_module(module)
