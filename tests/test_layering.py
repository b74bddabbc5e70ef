"""The layers import one way (DESIGN.md): a test walks every import statement, including the
ones inside functions, and fails when a forbidden edge comes back."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "flowrl"

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
    "runtime": ("flowrl.algorithms", "flowrl.backends", "flowrl.api", "flowrl.cli"),
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


def imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
    return out


def files(where: str) -> list[Path]:
    target = ROOT / where
    return [target] if target.is_file() else sorted(target.rglob("*.py"))


@pytest.mark.parametrize("where", sorted(FORBIDDEN))
def test_no_forbidden_imports(where):
    bad = []
    for path in files(where):
        for line, module in imports(path):
            if any(module == f or module.startswith(f + ".") for f in FORBIDDEN[where]):
                bad.append(f"{path.relative_to(ROOT.parent)}:{line} imports {module}")
    assert not bad, "layering broken:\n" + "\n".join(bad)


def test_the_walker_sees_imports_inside_functions(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f():\n    import torch\n    from flowrl.backends.local import engine\n")
    assert [m for _, m in imports(src)] == ["torch", "flowrl.backends.local"]


def test_planning_loads_no_torch_and_no_backend():
    code = (
        "import sys\n"
        "import flowrl.planner.passes, flowrl.planner.autotune, flowrl.planner.simulate, flowrl.graph.loading, "
        "flowrl.api\n"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('flowrl.backends')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
