"""What the agents import lazily: an optional package (an error naming the extra that installs it), and a
user's object named ``module:attr`` or ``path/to/file.py:attr`` (imported, never evaluated)."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from flowrl.errors import AgentError


def require(module: str, extra: str, agent: str) -> ModuleType:
    """Import ``module`` for agent ``agent``; refused, naming the extra to install, when it is missing."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise AgentError(
            f"agent {agent!r} needs the '{module.split('.')[0]}' package, which is not installed "
            f"({exc}): pip install 'flowrl[{extra}]'."
        ) from None


def file_module(path: Path, what: str) -> ModuleType:
    """The Python file ``path`` imported as a module of its own (once per file: a second import returns it)."""
    resolved = path.resolve()
    digest = hashlib.sha256(str(resolved).encode()).hexdigest()[:12]
    name = f"flowrl_user_{resolved.stem.lower().replace('-', '_')}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise AgentError(f"{what}: '{path}' cannot be imported as a Python file.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise AgentError(f"{what}: importing '{path}' failed: {type(exc).__name__}: {exc}") from exc
    return module


def load_object(spec: str, what: str) -> Any:
    """The object ``module:attr`` or ``path/file.py:attr`` names."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise AgentError(f"{what}: {spec!r} must be 'package.module:Name' or 'path/to/file.py:Name'.")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            where = "" if path.is_absolute() else f" (a relative path is read from the current directory, {Path.cwd()})"
            raise AgentError(f"{what}: the file '{target}' does not exist{where}.")
        module = file_module(path, what)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise AgentError(f"{what}: the module '{target}' cannot be imported ({exc}).") from None
        except Exception as exc:
            raise AgentError(f"{what}: importing '{target}' failed: {type(exc).__name__}: {exc}") from exc
    if not hasattr(module, attr):
        raise AgentError(f"{what}: '{target}' has no attribute {attr!r}.")
    return getattr(module, attr)
