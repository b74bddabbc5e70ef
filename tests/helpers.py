"""What several test modules share: a small run's settings, the CLI run in this process, a jsonl file.
(tests/conftest.py puts this folder on sys.path: ``from helpers import ...``.)"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

#: a run of two prompts, two samples each, two new tokens, one update a step and no progress bar
SMALL_RUN = [
    "rollout.prompts_per_step=2",
    "rollout.samples_per_prompt=2",
    "rollout.max_new_tokens=2",
    "train.mini_batches=1",
    "progress=false",
]


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def installed(name: str) -> bool:
    """Whether module ``name`` (dotted: ``verifiers.v1``) is installed, found without importing it or its
    package: collection stays quick where a package takes seconds to import (vLLM, verifiers, OpenEnv), also
    for the modules whose tests the quick lane deselects."""
    top, _, rest = name.partition(".")
    spec = importlib.util.find_spec(top)
    if spec is None:
        return False
    if not rest:
        return True
    path = rest.replace(".", "/")
    return any(
        (Path(where) / path).is_dir() or (Path(where) / f"{path}.py").is_file()
        for where in spec.submodule_search_locations or ()
    )


def needs(*names: str) -> pytest.MarkDecorator:
    """Skip where one of the modules ``names`` is not installed (`installed`: nothing is imported)."""
    missing = [n for n in names if not installed(n)]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)}")


@contextlib.contextmanager
def benchmark_module(name: str) -> Iterator[ModuleType]:
    """``benchmarks/NAME.py`` as a module. A benchmark imports its siblings by name, as a script does, so the
    folder is on sys.path while it is in use; after, it and every sibling it imported are forgotten."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(BENCHMARKS))
        try:
            yield importlib.import_module(name)
        finally:
            for key, module in list(sys.modules.items()):
                if Path(getattr(module, "__file__", None) or "/").parent == BENCHMARKS:
                    del sys.modules[key]


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Exit status, stdout and stderr (its white space folded to single spaces) of `flowrl ARGV`."""
    from flowrl.cli import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, " ".join(err.split())


def resume(capsys: pytest.CaptureFixture[str], folder: str | Path, *extra: str) -> tuple[int, str]:
    """Exit status and stderr of `flowrl run --resume FOLDER EXTRA`, which never prints a traceback."""
    code, _, err = run_cli(capsys, "run", "--resume", str(folder), *extra)
    assert "Traceback" not in err
    return code, err


def write_jsonl(path: Path, rows: list[dict]) -> str:
    """``rows`` as a jsonl file at ``path``; returns the path as a string (what a config takes)."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


#: the whole-run tests' model: a one-layer tiny model, a third faster a step than the default two layers
ONE_LAYER = "tiny_model.num_layers=1"


def curve(result, key: str = "reward") -> tuple[float, float]:
    """The mean of ``key`` over a run's first ten steps and over its last ten."""
    from statistics import mean

    values = [m[key] for m in result.metrics]
    return mean(values[:10]), mean(values[-10:])


#: A chat template that renders tools (compactly: their names) and tool messages, Hermes-style.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\ntools: "
    "{{ tools | map(attribute='function') | map(attribute='name') | join(',') }}"
    "<|im_end|>\n{% endif %}{% for message in messages %}{% if message['role'] == 'tool' %}<|im_start|>user\n"
    "<tool_response>{{ message['content'] }}</tool_response><|im_end|>\n{% else %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)


def cpu_plan(graph: str, overrides: list[str], devices: int = 2, require: tuple[str, ...] = (), **pins: Any):
    """(graph, plan) of ``graph`` for this machine cut into ``devices`` CPU devices, for the Ray executor.
    ``require``: layouts a test needs (e.g. ``actor.dp=2``: the tuner may pick pipeline stages for small
    jobs); ``pins``: the planner's other options (placement, sync)."""
    from flowrl import api
    from flowrl.planner.constraints import parse_requirements
    from flowrl.plugins.manager import registry

    overrides = [*overrides, "backend=ray", "device=cpu"]
    g, cfg = api.load(graph, overrides=overrides)
    target = api.local_target(cfg, registry(), devices=devices)
    if require:
        pins["require"] = parse_requirements(list(require), list(g.models))
    return api.plan(graph, overrides=overrides, target=target, for_backend=True, options=pins, emit=lambda s: None)


#: metrics that measure time, which no two runs share (with every ``*/seconds`` and ``*/pp_bubble``)
TIMED = ("step_seconds", "tokens_per_s", "spans")


def untimed(rows: list[dict]) -> list[dict]:
    """Metrics rows without what measures time: what two runs of one plan must agree on."""
    return [{k: v for k, v in r.items() if k not in TIMED and not k.endswith(("/seconds", "pp_bubble"))} for r in rows]


def metrics_rows(folder: Path) -> list[dict]:
    """Every row of the run folder's metrics.jsonl (steps, and events such as restarts)."""
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line]


def resumed_after_step_1(graph: Any, plan: Any, tmp_path: Path) -> tuple[Any, Any]:
    """(the whole run, the run resumed from its step-1 checkpoint) of a 4-step ``plan`` that checkpoints every
    2 steps: the whole run's folder copied without its last checkpoint, as if killed after step 1, then resumed
    (two runs, not three)."""
    import shutil

    from flowrl import api
    from flowrl.contract.plan import load_plan
    from flowrl.runtime.executor import run_dir

    whole = api.run(graph, plan, out_dir=run_dir(str(tmp_path), "whole"))
    part = tmp_path / "part"
    shutil.copytree(whole.out_dir, part)
    shutil.rmtree(part / "checkpoints" / "step-000003")
    return whole, api.run(graph, load_plan(part / "plan.yaml"), out_dir=part, resume=True)
