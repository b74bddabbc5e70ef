"""Constraints a user puts on a plan (``flowrl plan ... --require KEY=VALUE``): the tuner
searches only the plans that satisfy them, and ``--explain`` shows the best constrained plan
next to the unconstrained winner.

Keys:

- ``placement=colocate|split|standalone|disaggregated``
- ``sync=reshard|full|bucketed|sparse`` (the weight-sync strategy)
- ``rollout.mode=MODE`` (as ``--set rollout.mode``: sync, one_step_off, async, partial, ...)
- ``generation.tp=N`` (tensor parallelism of each generation replica)
- ``generation.devices=N`` (the size of the device group generation runs on: all of them colocated, the actor
  group when split, the generation group when disaggregated)
- ``MODEL.dp=N``, ``MODEL.tp=N``, ``MODEL.pp=N`` (one graph model's parallel layout)
- ``MODEL.schedule=gpipe|1f1b|interleaved``, ``MODEL.virtual_stages=N`` (its pipeline schedule, pp > 1)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from flowrl.errors import ConfigError, did_you_mean
from flowrl.specs import Spec

PLACEMENTS = ("colocate", "split", "standalone", "disaggregated")
SYNCS = ("reshard", "full", "bucketed", "sparse")
PARALLEL = ("dp", "tp", "pp")
SCHEDULES = ("gpipe", "1f1b", "interleaved")


class Constraints(Spec):
    placement: str | None = None
    weight_sync: str | None = None
    rollout_mode: str | None = None
    generation_tp: int | None = None
    generation_devices: int | None = None
    parallel: dict[str, dict[str, int]] = {}  # model -> {"dp"|"tp"|"pp": size}
    # model -> {"schedule": gpipe|1f1b|interleaved, "virtual_stages": N} (pipeline stages, pp > 1)
    pipeline: dict[str, dict[str, str | int]] = {}

    def __bool__(self) -> bool:
        return any(
            (
                self.placement,
                self.weight_sync,
                self.rollout_mode,
                self.generation_tp,
                self.generation_devices,
                self.parallel,
                self.pipeline,
            )
        )

    def describe(self) -> str:
        parts = [
            f"placement={self.placement}" if self.placement else "",
            f"sync={self.weight_sync}" if self.weight_sync else "",
        ]
        parts.append(f"rollout.mode={self.rollout_mode}" if self.rollout_mode else "")
        parts.append(f"generation.tp={self.generation_tp}" if self.generation_tp else "")
        parts.append(f"generation.devices={self.generation_devices}" if self.generation_devices else "")
        parts += [f"{m}.{k}={v}" for m, dims in self.parallel.items() for k, v in dims.items()]
        parts += [f"{m}.{k}={v}" for m, dims in self.pipeline.items() for k, v in dims.items()]
        return " ".join(p for p in parts if p)

    def fits_layout(self, model: str, layout: Any) -> bool:
        """Whether ``layout`` (a `ModelLayout` of ``model``) has the required sizes, and, split into pipeline
        stages, the required schedule."""
        if not all(getattr(layout.parallel, k) == v for k, v in self.parallel.get(model, {}).items()):
            return False
        return all(getattr(layout, k) == v for k, v in self.pipeline.get(model, {}).items())


def _count(key: str, value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(f"--require {key}={value}: give a whole number >= 1.")
    return n


def parse_requirements(items: Iterable[str], models: Iterable[str]) -> Constraints:
    """``KEY=VALUE`` strings as Constraints; ``models``: the graph's models (for ``MODEL.tp``)."""
    models = list(models)
    out: dict[str, Any] = {"parallel": {}, "pipeline": {}}
    seen: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise ConfigError(f"--require '{item}': write KEY=VALUE, e.g. placement=colocate or actor.tp=2.")
        same = "sync" if key == "weight_sync" else key
        if same in seen:
            raise ConfigError(f"--require names '{key}' twice ({seen[same]} and {item}); keep one.")
        seen[same] = item
        if key == "placement":
            if value not in PLACEMENTS:
                raise ConfigError(f"--require placement={value}: one of {', '.join(PLACEMENTS)}.")
            out["placement"] = value
        elif key in ("sync", "weight_sync"):
            if value not in SYNCS:
                raise ConfigError(f"--require {key}={value}: one of {', '.join(SYNCS)}.")
            out["weight_sync"] = value
        elif key == "rollout.mode":
            out["rollout_mode"] = value
        elif key == "generation.tp":
            out["generation_tp"] = _count(key, value)
        elif key == "generation.devices":
            out["generation_devices"] = _count(key, value)
        elif "." in key and key.rsplit(".", 1)[1] in PARALLEL:
            model, dim = key.rsplit(".", 1)
            if model not in models:
                raise ConfigError(
                    f"--require {item}: the graph has no model '{model}'.{did_you_mean(model, models)} Its models: "
                    f"{', '.join(models)}."
                )
            out["parallel"].setdefault(model, {})[dim] = _count(key, value)
        elif "." in key and key.rsplit(".", 1)[1] in ("schedule", "virtual_stages"):
            model, field = key.rsplit(".", 1)
            if model not in models:
                raise ConfigError(
                    f"--require {item}: the graph has no model '{model}'.{did_you_mean(model, models)} Its models: "
                    f"{', '.join(models)}."
                )
            if field == "schedule" and value not in SCHEDULES:
                raise ConfigError(f"--require {item}: one of {', '.join(SCHEDULES)}.")
            out["pipeline"].setdefault(model, {})[field] = value if field == "schedule" else _count(key, value)
        else:
            raise ConfigError(
                f"--require {item}: unknown key '{key}'. Keys: placement, sync, rollout.mode, generation.tp, "
                "generation.devices, "
                f"MODEL.dp / MODEL.tp / MODEL.pp / MODEL.schedule / MODEL.virtual_stages (models: {', '.join(models)})."
            )
    return Constraints(**out)
