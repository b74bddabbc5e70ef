"""What one RL step processes: prompts, samples, and the prompt/response length distributions.

A workload file (YAML/TOML/JSON) holds WorkloadSpec fields, e.g.::

    prompts_per_step: 512
    samples_per_prompt: 8
    prompt_length: 1024
    response_length: {kind: lognormal, median: 512, sigma: 1.0, max: 8192}

``response_length`` may also be a plain integer (a fixed length) or
``{kind: histogram, lengths: [...], weights: [...]}`` (an empirical distribution).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from flowrl.contract.checked import coerce_numbers
from flowrl.contract.workload import _KINDS, Fixed, WorkloadSpec
from flowrl.errors import ConfigError
from flowrl.specs import convert, read_document


def load_workload(path: str | Path) -> WorkloadSpec:
    """Read a workload file, or a run's plan.yaml (its workload, with the acceptance rate the run
    measured); errors name the file and the dotted field (``response_length.sigma``)."""
    path = Path(path)
    what = f"workload file '{path}'"
    data = read_document(path)
    target = data.get("target")
    if isinstance(target, dict) and isinstance(target.get("workload"), dict):  # a plan file
        data, what = target["workload"], f"workload of plan file '{path}'"
    length = data.get("response_length")
    if isinstance(length, (int, str)) and not isinstance(length, bool):
        data = {**data, "response_length": {"kind": "fixed", "value": length}}
    elif isinstance(length, dict) and length.get("kind") not in _KINDS:
        got = f"'kind: {length['kind']}'" if "kind" in length else "no 'kind'"
        raise ConfigError(
            f"{what}: field 'response_length.kind': has {got}; use one of {', '.join(_KINDS)} (or a plain "
            "integer for a fixed length)."
        )
    data = coerce_numbers(data, WorkloadSpec)
    return convert(data, WorkloadSpec, what)


def workload_from_flags(
    prompts: int | None = None,
    samples: int | None = None,
    prompt_len: int | None = None,
    response_len: int | None = None,
    base: WorkloadSpec | None = None,
) -> WorkloadSpec:
    """``base`` (default: WorkloadSpec()) with the given flags replaced; ``response_len`` makes the
    response length fixed."""
    base = base if base is not None else WorkloadSpec()
    changes: dict[str, Any] = {}
    for flag, field, value in (
        ("prompts", "prompts_per_step", prompts),
        ("samples", "samples_per_prompt", samples),
        ("prompt_len", "prompt_length", prompt_len),
        ("response_len", "response_length", response_len),
    ):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"workload flag '{flag}' (field '{field}') must be an integer >= 1, got {value!r}.")
        changes[field] = Fixed(value=value) if field == "response_length" else value
    return msgspec.structs.replace(base, **changes) if changes else base
