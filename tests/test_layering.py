"""The layers import one way (DESIGN.md): a test walks every import statement, including the
ones inside functions and ``from flowrl import api`` forms, and fails when a forbidden edge comes
back. No core package imports a plugin package (flowrl_ray, flowrl_vllm, flowrl_example): plugins
reach the core through pluggy hooks only."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "flowrl"

PLUGIN_PACKAGES = ("flowrl_ray", "flowrl_vllm", "flowrl_example")

# package (relative to flowrl/) -> module prefixes it must never import
FORBIDDEN = {
    "graph": (
        "flowrl.plugins",
        "flowrl.planner",
        "flowrl.runtime",
        "flowrl.backends",
        "flowrl.algorithms",
        "flowrl.api",
        "flowrl.cli",
        "torch",
    ),
    "planner": (
        "torch",
        "transformers",
        "flowrl.backends",
        "flowrl.runtime",
        "flowrl.algorithms",
        "flowrl.api",
        "flowrl.cli",
    ),
    # the runtime reaches plugins through the registry (flowrl.plugins.manager) only: see ALLOWED
    "runtime": ("flowrl.algorithms", "flowrl.backends", "flowrl.api", "flowrl.cli", "flowrl.plugins"),
    # backends execute a plan: they may use the plan, the runtime, memory/hardware models and specs,
    # never the planning passes, the tuner, the algorithms or the user-facing entry points
    "backends": (
        "flowrl.api",
        "flowrl.cli",
        "flowrl.planner.autotune",
        "flowrl.planner.passes",
        "flowrl.algorithms",
    ),
    "algorithms": (
        "flowrl.runtime.executor",
        "flowrl.runtime.nodes",
        "flowrl.backends",
        "flowrl.planner",
        "flowrl.api",
        "flowrl.cli",
    ),
    "tasks": ("flowrl.planner", "flowrl.runtime", "flowrl.backends", "flowrl.algorithms", "flowrl.plugins"),
    "api.py": ("flowrl.backends",),
    "cli.py": ("flowrl.backends",),
    "specs.py": ("flowrl.graph", "flowrl.planner", "flowrl.runtime", "flowrl.backends", "flowrl.plugins"),
}
FORBIDDEN = {where: (*prefixes, *PLUGIN_PACKAGES) for where, prefixes in FORBIDDEN.items()}

# (package, module prefix) -> the narrower prefixes it may still import
ALLOWED = {
    ("runtime", "flowrl.plugins"): ("flowrl.plugins.manager",),  # the registry: engines, rewards, executors
}

# (file relative to the repository, module) edges that break a rule today, each with why; a new
# edge fails, and so does an entry here that the code no longer needs (remove it then)
KNOWN = {
    ("flowrl/backends/local/profile.py", "flowrl.api"): (
        "calibrating a generation engine plans a GRPO run through api.plan/api.check to build its engines"
    ),
}


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import; ``from a import b`` yields ``a`` and ``a.b`` (b may be a module)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names if a.name != "*"]
    return out


def under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def forbidden(where: str, module: str) -> bool:
    return any(
        under(module, f) and not any(under(module, ok) for ok in ALLOWED.get((where, f), ())) for f in FORBIDDEN[where]
    )


def files(where: str) -> list[Path]:
    target = ROOT / where
    return [target] if target.is_file() else sorted(target.rglob("*.py"))


def edges(where: str) -> dict[tuple[str, str], list[int]]:
    """The forbidden edges of package ``where``: (file, module) -> lines."""
    found: dict[tuple[str, str], list[int]] = {}
    for path in files(where):
        for line, module in imports(path):
            if forbidden(where, module):
                found.setdefault((str(path.relative_to(ROOT.parent)), module), []).append(line)
    return found


@pytest.mark.parametrize("where", sorted(FORBIDDEN))
def test_no_forbidden_imports(where):
    bad = [
        f"{file}:{line} imports {module}"
        for (file, module), lines in edges(where).items()
        if (file, module) not in KNOWN
        for line in lines
    ]
    assert not bad, "layering broken:\n" + "\n".join(bad)


def test_every_known_exception_is_still_needed():
    found = {edge for where in FORBIDDEN for edge in edges(where)}
    stale = sorted(set(KNOWN) - found)
    assert not stale, f"these edges are gone; remove them from KNOWN: {stale}"


def test_the_walker_sees_imports_inside_functions(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f():\n    import torch\n    from flowrl.backends.local import engine\n")
    assert [m for _, m in imports(src)] == ["torch", "flowrl.backends.local", "flowrl.backends.local.engine"]


def test_the_walker_sees_modules_imported_from_their_package(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("from flowrl import api\n")
    assert [m for _, m in imports(src)] == ["flowrl", "flowrl.api"]
    assert forbidden("backends", "flowrl.api") and not forbidden("backends", "flowrl")


def test_the_runtime_may_use_the_plugin_registry_but_nothing_else_of_flowrl_plugins():
    assert not forbidden("runtime", "flowrl.plugins.manager")
    assert not forbidden("runtime", "flowrl.plugins.manager.Registry")
    assert forbidden("runtime", "flowrl.plugins.builtin") and forbidden("runtime", "flowrl.plugins")
    assert forbidden("runtime", "flowrl_ray.executor")


def test_planning_loads_no_torch_and_no_backend():
    code = (
        "import sys\n"
        "import flowrl.planner.passes, flowrl.planner.autotune, flowrl.planner.simulate, flowrl.graph.loading, "
        "flowrl.api\n"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('flowrl.backends')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
