"""The layers import one way (the design notes' "layers", docs/ for users): a test walks every
import statement, including the ones inside functions and ``from flowrl import api`` forms, and
fails when a forbidden edge comes back. No core package imports a plugin package (flowrl_ray,
flowrl_vllm, flowrl_example): plugins reach the core through pluggy hooks only.

The contract (``flowrl.contract``: the plan's types, the resolved specs, the engine and executor
protocols, capabilities, the typed data) sits below the planner and the runtime and imports
neither; the runtime never imports the planner (what a run reports about predictions comes
through a `Predictor` its caller passes); a generation engine plugin imports only the contract."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOT = REPO / "flowrl"

PLUGIN_PACKAGES = ("flowrl_ray", "flowrl_vllm", "flowrl_example")

# package (relative to flowrl/) -> module prefixes it must never import
FORBIDDEN = {
    # the contract imports only the standard library, msgspec, pluggy, torch and numpy (lazily), and
    # flowrl.errors, flowrl.specs and flowrl.graph: CONTRACT_MAY_IMPORT checks that allow-list
    "contract": (
        "flowrl.planner",
        "flowrl.runtime",
        "flowrl.backends",
        "flowrl.plugins",
        "flowrl.algorithms",
        "flowrl.tasks",
        "flowrl.api",
        "flowrl.cli",
        "transformers",
    ),
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
    # the runtime reaches plugins through the registry (flowrl.plugins.manager) only: see ALLOWED; it
    # reads plans through the contract and never calls the planner
    "runtime": (
        "flowrl.algorithms",
        "flowrl.backends",
        "flowrl.api",
        "flowrl.cli",
        "flowrl.plugins",
        "flowrl.planner",
    ),
    # backends execute a plan: its types, hardware and model shapes come from the contract; they never
    # import the planner, the algorithms or the user-facing entry points
    "backends": ("flowrl.api", "flowrl.cli", "flowrl.planner", "flowrl.algorithms"),
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


# what the contract may import of flowrl, and what each plugin may (first-party plugins, by folder)
CONTRACT_MAY_IMPORT = ("flowrl.contract", "flowrl.errors", "flowrl.specs", "flowrl.graph")
PLUGIN_MAY_IMPORT = {
    # a generation engine plugin imports one module of flowrl: the contract
    "plugins/flowrl-vllm": ("flowrl.contract",),
    # an executor plugin builds on the runtime (and the local backend's devices); the plan, capability
    # and protocol types it reads from the contract, never from the planner or the old homes
    "plugins/flowrl-ray": ("flowrl.contract", "flowrl.runtime", "flowrl.backends.local"),
}
PLUGIN_MUST_NOT_IMPORT = ("flowrl.runtime.batch",)  # its typed data and padding helpers are the contract's


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
@pytest.mark.slow
def test_no_forbidden_imports(where):
    bad = [
        f"{file}:{line} imports {module}"
        for (file, module), lines in edges(where).items()
        if (file, module) not in KNOWN
        for line in lines
    ]
    assert not bad, "layering broken:\n" + "\n".join(bad)


def _outside(path: Path, allowed: tuple[str, ...], banned: tuple[str, ...] = ()) -> list[str]:
    """``path``'s imports of flowrl modules outside ``allowed`` (or inside ``banned``), as messages."""
    return [
        f"{path.relative_to(REPO)}:{line} imports {module}"
        for line, module in imports(path)
        if under(module, "flowrl")
        and module != "flowrl"
        and (not any(under(module, ok) for ok in allowed) or any(under(module, no) for no in banned))
    ]


def test_the_contract_imports_only_errors_specs_and_the_graph():
    bad = [msg for path in files("contract") for msg in _outside(path, CONTRACT_MAY_IMPORT)]
    assert not bad, "the contract imports above itself:\n" + "\n".join(bad)


@pytest.mark.parametrize("plugin", sorted(PLUGIN_MAY_IMPORT))
def test_first_party_plugins_import_flowrl_through_the_contract(plugin):
    bad = [
        msg
        for path in sorted((REPO / plugin).rglob("*.py"))
        if "tests" not in path.relative_to(REPO / plugin).parts
        for msg in _outside(path, PLUGIN_MAY_IMPORT[plugin], PLUGIN_MUST_NOT_IMPORT)
    ]
    assert not bad, f"{plugin} imports flowrl outside the contract:\n" + "\n".join(bad)


def test_the_contract_loads_no_torch_planner_or_runtime():
    code = (
        "import sys\n"
        "import flowrl.contract\n"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('flowrl.planner', 'flowrl.runtime', "
        "'flowrl.backends', 'flowrl.plugins'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_plugin_hook_marker_from_the_contract_registers_like_the_hookspecs_one():
    import pluggy

    from flowrl.contract import hookimpl
    from flowrl.plugins import hookspecs

    pm = pluggy.PluginManager("flowrl")
    pm.add_hookspecs(hookspecs)

    class Plugin:
        @hookimpl
        def register_executors(self, register):
            register("x", object)

    pm.register(Plugin())
    seen = []
    pm.hook.register_executors(register=lambda name, obj, **meta: seen.append(name))
    assert seen == ["x"]


def test_the_runtime_never_imports_the_planner():
    assert forbidden("runtime", "flowrl.planner.passes") and forbidden("runtime", "flowrl.planner.hardware")
    assert not forbidden("runtime", "flowrl.contract.reading")


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
