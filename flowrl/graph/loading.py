"""Find a graph by file path (``graphs/grpo.py``) or registered algorithm name (``grpo``)."""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from flowrl.errors import ConfigError, GraphError, did_you_mean
from flowrl.graph.ir import Graph


@dataclass(frozen=True)
class GraphSource:
    source: str  # what the user passed (a path, or an algorithm name)
    build: Callable[[Any], Graph]
    defaults: dict[str, Any]
    # a graph file's own functions: (the file as a plugin, (kind, name, fn, meta) per function); None: a name
    file_functions: tuple[str, tuple[tuple[str, str, Any, dict[str, Any]], ...]] | None = None


class _ImportTimeout(BaseException):
    """Raised into a graph file's import that runs past the limit (a BaseException, so the file's
    own ``except Exception`` cannot swallow it)."""


def _import_timeout() -> float:
    raw = os.environ.get("FLOWRL_IMPORT_TIMEOUT", "60")
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not value >= 0 or math.isinf(value):
        raise ConfigError(f"environment variable FLOWRL_IMPORT_TIMEOUT is {raw!r}; set it to seconds (0: no limit).")
    return value


@contextlib.contextmanager
def _time_limit(limit: float) -> Iterator[None]:
    """Stop what the block runs after ``limit`` seconds (0: never; main thread only: signals)."""
    if not limit or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise _ImportTimeout

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _import_file(path: Path, registry: Any = None) -> ModuleType:
    """Import graph file ``path``; what it registers with `flowrl.register` decorators goes into
    ``registry`` (the graph file is their plugin)."""
    from flowrl.register import take_pending

    name = f"flowrl_user_graph_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise GraphError(f"graph file '{path}' cannot be imported (is it a .py file?).")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    limit = _import_timeout()
    take_pending()  # what an earlier, failed import left
    try:
        with _time_limit(limit):
            spec.loader.exec_module(module)
    except _ImportTimeout:
        raise GraphError(
            f"graph file '{path}' did not finish importing within {limit:g} s (does it loop or wait at "
            "import time?); a graph file only defines build(cfg). Raise the limit with FLOWRL_IMPORT_TIMEOUT=SECONDS."
        ) from None
    except SystemExit as exc:  # a graph file must not end the process
        raise GraphError(
            f"graph file '{path}' called sys.exit({exc.code!r}) while being imported; a graph file only defines "
            "build(cfg) (and DEFAULTS)."
        ) from None
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # Exception, and what a file may raise beyond it (GeneratorExit, its own)
        line = ""
        tb = exc.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code.co_filename == str(path):
                line = f" (line {tb.tb_lineno})"
            tb = tb.tb_next
        raise GraphError(f"graph file '{path}' failed to import{line}: {type(exc).__name__}: {exc}") from None
    registered = take_pending()
    seen: set[tuple[str, str]] = set()
    for kind, fn_name, _, _ in registered:
        if (kind, fn_name) in seen:
            from flowrl.errors import PluginError

            raise PluginError(f"graph file '{path}' registers two functions named '{fn_name}' ({kind}); rename one.")
        seen.add((kind, fn_name))
    if registered:
        _pickle_by_value(module)
    if registry is not None:
        _register_own(registry, path, registered)
    module.__dict__["__flowrl_registered__"] = (f"graph file {path}", tuple(registered))
    return module


def _register_own(registry: Any, path: Path, registered: list[tuple[str, str, Any, dict[str, Any]]]) -> None:
    """What graph file ``path`` registers goes into ``registry`` under the file as its plugin. Its own
    function wins inside this graph over a built-in's or an installed plugin's of the same name (one added
    after the file was written must not break it), with a one-line notice the first time; the entries
    another graph file shadowed are given back first."""
    plugin = f"graph file {path}"
    registry.release(plugin)
    for kind, fn_name, obj, meta in registered:
        held = registry.add_own(kind, plugin, fn_name, obj, **meta)
        if held is not None:
            whose = "the built-in" if held.plugin.startswith("flowrl.") else f"plugin '{held.plugin}''s entry"
            print(
                f"flowrl: note: {path} registers {registry.singular(kind)} '{fn_name}', which shadows {whose} "
                "of that name in this graph.",
                file=sys.stderr,
                flush=True,
            )


def _pickle_by_value(module: ModuleType) -> None:
    """Functions a graph file registers travel to other processes (Ray workers) by value: the
    file is not importable there."""
    try:
        import cloudpickle
    except ImportError:  # no multi-process backend installed
        return
    cloudpickle.register_pickle_by_value(module)


def find_graph(source: str, algorithms: Mapping[str, Callable[[Any], Graph]], registry: Any = None) -> GraphSource:
    """A graph file defines ``build(cfg) -> Graph`` and may define ``DEFAULTS`` (config overrides)
    and register its own functions (`flowrl.register`, into ``registry``); a name is looked up in
    ``algorithms`` (the registered algorithm builders)."""
    path = Path(source)
    # a bare name is an algorithm even where a folder of that name exists (runs/grpo from inside runs/)
    if path.suffix == ".py" or path.is_file() or "/" in source or (path.is_dir() and source not in algorithms):
        if path.is_dir():
            raise GraphError(f"'{source}' is a folder, not a graph file or an algorithm name.")
        if not path.is_file():
            raise GraphError(
                f"graph file '{source}' does not exist. Pass a graph file (e.g. graphs/grpo.py) or an "
                f"algorithm name ({', '.join(sorted(algorithms))})."
            )
        module = _import_file(path, registry)
        build = getattr(module, "build", None)
        if not callable(build):
            raise GraphError(f"graph file '{source}' has no build(cfg) function returning a Graph.")
        defaults = getattr(module, "DEFAULTS", {})
        file_functions = module.__dict__["__flowrl_registered__"]
    else:
        if source not in algorithms:
            raise GraphError(
                f"unknown algorithm '{source}'.{did_you_mean(source, list(algorithms))} Known: "
                f"{', '.join(sorted(algorithms))}; or pass a graph file (e.g. graphs/grpo.py)."
            )
        build = algorithms[source]
        file_functions = None
        if registry is not None:  # a registered algorithm sees the built-ins a graph file loaded before shadowed
            registry.release("")
        defaults = getattr(sys.modules.get(getattr(build, "__module__", "")), "DEFAULTS", {})
    if not isinstance(defaults, dict):
        raise GraphError(f"graph '{source}': DEFAULTS must be a dict of config overrides.")
    return GraphSource(source=source, build=build, defaults=defaults, file_functions=file_functions)


def build_graph(src: GraphSource, cfg: Any) -> Graph:
    try:
        graph = src.build(cfg)
    except GraphError:
        raise
    except KeyboardInterrupt:
        raise
    except SystemExit as exc:
        raise GraphError(
            f"graph '{src.source}': build(cfg) called sys.exit({exc.code!r}); it must return a Graph."
        ) from None
    except BaseException as exc:
        raise GraphError(f"graph '{src.source}': build(cfg) raised {type(exc).__name__}: {exc}") from None
    if not isinstance(graph, Graph):
        raise GraphError(f"graph '{src.source}': build(cfg) returned {type(graph).__name__}, not a flowrl Graph.")
    graph.file_functions = src.file_functions
    return graph.verify()
