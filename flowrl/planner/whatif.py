"""``flowrl plan --what-if KEY=VALUE``: a change to what a plan is for, and the two plans side by side.

A key names one of

* the cluster: ``cluster.devices``, ``cluster.nodes``, ``cluster.devices_per_node`` (``cpu:N``: this
  machine cut into that many devices);
* a field of its devices' HardwareSpec: ``hardware.inter_node_bandwidth``, ``hardware.memory_bytes``, ...;
* a field of the workload: ``workload.prompts_per_step``, ``workload.response_length``, ... and
  ``workload.response_tail``, which stretches the response-length distribution's tail (below);
* a run config field, as ``--set`` takes it: ``rollout.mode``, ``rollout.staleness``,
  ``rollout.max_new_tokens``, ``train.micro_batch_size``, ...

A number is the new value; ``Kx`` (``2x``, ``0.5x``) multiplies the current one. For the response
lengths ``workload.response_length=N`` makes every response N tokens and ``Kx`` scales every length;
``workload.response_tail=Kx`` keeps the median and makes the 99th percentile and the longest response
K times longer (a lognormal's sigma grows by ln(K) / 2.326 and its max K times; a histogram's lengths
above its median K times). This module parses the keys, applies them to a ClusterTarget, and prints
the comparison; ``flowrl.cli`` plans both.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from flowrl.contract.checked import gib
from flowrl.contract.hardware import CPU_DEVICES, ClusterSpec, HardwareSpec, is_cpu
from flowrl.contract.layout import ClusterPlan
from flowrl.contract.plan import ClusterTarget, ExecutionPlan
from flowrl.contract.workload import Fixed, Histogram, Lengths, LogNormal, WorkloadSpec
from flowrl.errors import ConfigError, did_you_mean
from flowrl.planner.hardware import cpu_cluster, with_calibration
from flowrl.specs import OLDER_NAMES, RUN_SETTINGS, RunConfig, convert, parse_override

CLUSTER_KEYS = ("devices", "nodes", "devices_per_node")
#: The number a standard normal exceeds with probability 1%: a lognormal's p99 is median * exp(Z99 * sigma).
Z99 = 2.326
TAIL = "response_tail"
#: Run config fields that a plan's workload follows only when no workload was given (`resolve`), and the
#: workload key that changes a given workload instead.
CONFIG_WORKLOAD = {
    "rollout.max_new_tokens": "workload.response_length",
    "rollout.prompts_per_step": "workload.prompts_per_step",
    "rollout.samples_per_prompt": "workload.samples_per_prompt",
    "train.epochs": "workload.ppo_epochs",
    "train.mini_batches": "workload.mini_batches",
}


class Change(msgspec.Struct, frozen=True, kw_only=True):
    """One ``--what-if`` item on the target: ``field`` of ``part`` (cluster, hardware, workload) set to
    ``value``, or multiplied by it when ``relative``."""

    text: str  # as given
    part: str
    field: str
    value: float
    relative: bool = False

    def of(self, current: float) -> float:
        return current * self.value if self.relative else self.value


class WhatIf(msgspec.Struct, frozen=True, kw_only=True):
    """``--what-if`` items: target changes, and run config overrides (``--set`` items)."""

    items: tuple[str, ...]
    changes: tuple[Change, ...] = ()
    overrides: tuple[str, ...] = ()

    def on(self, part: str) -> list[Change]:
        return [c for c in self.changes if c.part == part]

    @property
    def edits_target(self) -> bool:
        return bool(self.changes)

    def describe(self) -> str:
        return ", ".join(self.items)


def hardware_keys() -> list[str]:
    """The HardwareSpec fields a what-if may set: its numbers."""
    return [name for name, tp in _hints(HardwareSpec).items() if _number(tp)]


def workload_keys() -> list[str]:
    return [*(name for name, tp in _hints(WorkloadSpec).items() if _number(tp) or name == "response_length"), TAIL]


def valid_keys() -> str:
    """Every key, for an error."""
    sections = [f for f in RunConfig.__struct_fields__ if f not in RUN_SETTINGS]
    return (
        f"cluster.{{{', '.join(CLUSTER_KEYS)}}}; hardware.{{{', '.join(hardware_keys())}}}; "
        f"workload.{{{', '.join(workload_keys())}}}; or a run config field as --set takes it, under "
        f"{', '.join(sections)} (e.g. rollout.mode=async, rollout.staleness=2, rollout.max_new_tokens=2048)"
    )


def parse_what_if(items: Iterable[str]) -> WhatIf:
    """``KEY=VALUE`` strings as a WhatIf; a ConfigError naming the item and listing the keys."""
    items = tuple(items)
    changes: list[Change] = []
    overrides: list[str] = []
    seen: dict[str, str] = {}
    for item in items:
        key, sep, value = (s.strip() for s in item.partition("="))
        if not sep or not key or not value:
            raise ConfigError(f"--what-if '{item}': write KEY=VALUE, e.g. cluster.devices=16 or rollout.mode=async.")
        if key in seen:
            raise ConfigError(f"--what-if names '{key}' twice ({seen[key]} and {item}); keep one.")
        seen[key] = item
        head, _, rest = key.partition(".")
        if head in ("cluster", "hardware", "workload"):
            known = {"cluster": CLUSTER_KEYS, "hardware": hardware_keys(), "workload": workload_keys()}[head]
            if rest not in known:
                raise ConfigError(
                    f"--what-if {item}: unknown key '{key}'.{did_you_mean(key, [f'{head}.{k}' for k in known])} "
                    f"Keys under {head}: {', '.join(known)}."
                )
            changes.append(_change(item, head, rest, value))
        elif OLDER_NAMES.get(head, head) in RunConfig.__struct_fields__:
            if OLDER_NAMES.get(head, head) in RUN_SETTINGS:
                raise ConfigError(
                    f"--what-if {item}: '{head}' is a run setting (where the run goes, how it checkpoints and "
                    f"reports); it does not change the plan. Keys: {valid_keys()}."
                )
            _check_config_path(item, key)
            overrides.append(f"{key}={value}")
        else:
            everything = [
                *(f"cluster.{k}" for k in CLUSTER_KEYS),
                *(f"hardware.{k}" for k in hardware_keys()),
                *(f"workload.{k}" for k in workload_keys()),
                *_config_keys(),
            ]
            raise ConfigError(
                f"--what-if {item}: unknown key '{key}'.{did_you_mean(key, everything)} Keys: {valid_keys()}."
            )
    return WhatIf(items=items, changes=tuple(changes), overrides=tuple(overrides))


def _change(item: str, part: str, field: str, text: str) -> Change:
    relative = text.lower().endswith(("x", "×"))
    number = text[:-1].strip() if relative else text
    _, parsed = parse_override(f"v={number}")
    ok = isinstance(parsed, (int, float)) and not isinstance(parsed, bool) and math.isfinite(parsed) and parsed > 0
    if not ok:
        raise ConfigError(
            f"--what-if {item}: give a number > 0 (the new value) or a factor such as 2x (times the current "
            f"value), not '{text}'."
        )
    if part == "workload" and field == TAIL and not relative:
        raise ConfigError(f"--what-if {item}: give the tail's stretch as a factor, e.g. {part}.{field}=2x.")
    return Change(text=item, part=part, field=field, value=float(parsed), relative=relative)


def _check_config_path(item: str, key: str) -> None:
    """``key`` names a run config field (a section's field; under a mapping such as ``nodes``, anything)."""
    tp: Any = RunConfig
    walked: list[str] = []
    for part in key.split("."):
        part = OLDER_NAMES.get(part, part) if not walked else part
        if not (isinstance(tp, type) and issubclass(tp, msgspec.Struct)):
            return
        if part not in tp.__struct_fields__:
            where = ".".join(walked)
            fields = [".".join([*walked, f]) for f in tp.__struct_fields__]
            raise ConfigError(
                f"--what-if {item}: unknown key '{key}'.{did_you_mean(key, fields)} "
                + (f"Fields of {where}: {', '.join(fields)}." if where else f"Keys: {valid_keys()}.")
            )
        walked.append(part)
        tp = _strip(_hints(tp)[part])
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        raise ConfigError(
            f"--what-if {item}: '{key}' is a section; name one of its fields: "
            f"{', '.join(f'{key}.{f}' for f in tp.__struct_fields__)}."
        )


def _config_keys() -> list[str]:
    out = []
    for name, tp in _hints(RunConfig).items():
        tp = _strip(tp)
        if name in RUN_SETTINGS:
            continue
        if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
            out += [f"{name}.{f}" for f in tp.__struct_fields__]
        else:
            out.append(name)
    return out


def _hints(tp: type) -> dict[str, Any]:
    return typing.get_type_hints(tp, include_extras=True)


def _strip(tp: Any) -> Any:
    """``tp`` without ``Annotated`` and ``| None``."""
    if typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is not None and len(args) == 1 and type(None) in typing.get_args(tp):
        return _strip(args[0])
    return tp


def _number(tp: Any) -> bool:
    tp = _strip(tp)
    return tp in (int, float)


def _is_int(spec: type, field: str) -> bool:
    return _strip(_hints(spec)[field]) is int


# ------------------------------------------------------------------ applying a what-if


def staleness_note(what: WhatIf, configured_mode: str | None) -> tuple[WhatIf, str | None]:
    """A staleness bound alone (``rollout.staleness=N``, no rollout.mode in the config or the what-if) does
    not pin the tuner's choice, so the what-if plans generation up to N versions ahead: rollout.mode=async
    (N = 0: sync). Returns the what-if with that mode added, and a line saying so (None: nothing added)."""
    keys = {o.partition("=")[0] for o in what.overrides}
    if "rollout.staleness" not in keys or "rollout.mode" in keys or configured_mode is not None:
        return what, None
    eta = next(o.partition("=")[2] for o in what.overrides if o.startswith("rollout.staleness="))
    mode = "sync" if str(eta).strip() in ("0", "0.0") else "async"
    note = (
        f"note: rollout.staleness alone leaves the rollout mode to the tuner; the what-if plans rollout.mode={mode} "
        f"with that staleness (add rollout.mode=... to choose another)"
    )
    return msgspec.structs.replace(what, overrides=(*what.overrides, f"rollout.mode={mode}")), note


def workload_notes(what: WhatIf, workload_given: bool) -> list[str]:
    """Run config items that do not reach a workload that was given (--workload, or the planner's default
    on a named cluster), with the key that does."""
    if not workload_given:
        return []
    out = []
    for item in what.overrides:
        key = item.partition("=")[0]
        if key in CONFIG_WORKLOAD:
            out.append(
                f"note: this plan's workload is --workload's (or the planner's default), not the run config's: "
                f"{key} does not change its lengths or batch; {CONFIG_WORKLOAD[key]}=... does"
            )
    return out


def edited_target(target: ClusterTarget, what: WhatIf, workload: WorkloadSpec | None = None) -> ClusterTarget:
    """``target`` with the what-if's cluster, hardware and workload changes; ``workload``: the one to change
    when the target has none yet (the run config's, as `resolve` derives it)."""
    cluster = resized(target.cluster, what.on("cluster"))
    cluster = with_hardware(cluster, what.on("hardware"))
    changes = what.on("workload")
    base = target.workload if target.workload is not None else workload
    if changes and base is None:
        raise ConfigError(f"--what-if {changes[0].text}: this plan has no workload to change.")
    new_workload = with_workload(base, changes) if changes else target.workload
    return msgspec.structs.replace(target, cluster=cluster, workload=new_workload)


def resized(cluster: ClusterSpec, changes: list[Change]) -> ClusterSpec:
    """``cluster`` with another node count or node size. ``cluster.devices`` keeps the node size (a count
    below it: one node of that many); on this machine's CPU (``cpu:N``, ``local``) it cuts the CPU into
    that many devices."""
    if not changes:
        return cluster
    split = cluster.nodes == 1 and (cluster.hardware.name == CPU_DEVICES or is_cpu(cluster.hardware))
    nodes, per_node = cluster.nodes, cluster.devices_per_node
    for c in changes:
        current = {"devices": cluster.devices, "nodes": nodes, "devices_per_node": per_node}[c.field]
        n = _whole(c, current)
        if c.field == "devices" and split:
            nodes, per_node = 1, n
        elif c.field == "devices":
            if n <= per_node:
                nodes, per_node = 1, n
            elif n % per_node:
                raise ConfigError(
                    f"--what-if {c.text}: {n} devices do not fill whole {per_node}-device nodes; give a multiple of "
                    f"{per_node} (e.g. {2 * per_node}), or set cluster.nodes and cluster.devices_per_node."
                )
            else:
                nodes = n // per_node
        elif c.field == "nodes":
            if split:
                raise ConfigError(
                    f"--what-if {c.text}: this cluster is this machine's CPU ({cluster.label}); give cluster.devices."
                )
            nodes = n
        else:
            per_node = n
    if split:
        machine = _whole_machine(cluster)
        return with_calibration(cpu_cluster(machine, per_node) if per_node > 1 else _one_device(machine))
    if per_node > cluster.hardware.devices_per_node:
        raise ConfigError(
            f"--what-if: a {cluster.hardware.name} node holds at most {cluster.hardware.devices_per_node} devices, "
            f"not {per_node}; set hardware.devices_per_node too if the node really is larger."
        )
    return with_calibration(_cluster(nodes, per_node, cluster.hardware))


def _cluster(nodes: int, per_node: int, hardware: HardwareSpec) -> ClusterSpec:
    return convert({"nodes": nodes, "devices_per_node": per_node, "hardware": msgspec.to_builtins(hardware)},
                   ClusterSpec, "--what-if cluster")  # fmt: skip


def _whole_machine(cluster: ClusterSpec) -> HardwareSpec:
    """The machine a ``cpu:N`` cluster cut into N devices (`cpu_cluster` divides its compute and memory)."""
    hw, n = cluster.hardware, cluster.devices
    if hw.name != CPU_DEVICES:
        return hw  # one device: the machine itself
    return msgspec.structs.replace(
        hw,
        peak_flops_bf16=hw.peak_flops_bf16 * n,
        peak_flops_fp32=hw.peak_flops_fp32 * n,
        memory_bytes=hw.memory_bytes * n,
        memory_bandwidth=hw.memory_bandwidth * n,
    )


def _one_device(machine: HardwareSpec) -> ClusterSpec:
    return ClusterSpec(nodes=1, devices_per_node=1, hardware=machine)


def _whole(c: Change, current: int) -> int:
    n = c.of(current)
    if abs(n - round(n)) > 1e-9 or round(n) < 1:
        raise ConfigError(f"--what-if {c.text}: that makes {n:g} (from {current}); it must be a whole number >= 1.")
    return int(round(n))


def with_hardware(cluster: ClusterSpec, changes: list[Change]) -> ClusterSpec:
    """``cluster`` with its devices' HardwareSpec fields changed (checked as a spec file's are)."""
    if not changes:
        return cluster
    hw = cluster.hardware
    data = msgspec.to_builtins(hw)
    for c in changes:
        current = getattr(hw, c.field)
        value = _whole(c, current) if _is_int(HardwareSpec, c.field) else c.of(current)
        data[c.field] = value
    moved = {c.field for c in changes} & {"peak_flops_bf16", "memory_bandwidth"}
    curve = hw.efficiency
    if moved and curve is not None and math.isclose(curve.ridge or 0.0, hw.peak_flops_bf16 / hw.memory_bandwidth):
        data["efficiency"]["ridge"] = None  # the curve's ridge follows the device's, as a spec file's does
    hardware = convert(data, HardwareSpec, f"--what-if {', '.join(c.text for c in changes)}")
    if cluster.devices_per_node > hardware.devices_per_node:
        raise ConfigError(
            f"--what-if: hardware.devices_per_node={hardware.devices_per_node} is below the cluster's "
            f"{cluster.devices_per_node} devices per node; set cluster.devices_per_node too."
        )
    return msgspec.structs.replace(cluster, hardware=hardware)


def with_workload(workload: WorkloadSpec, changes: list[Change]) -> WorkloadSpec:
    """``workload`` with its fields changed; ``response_length`` and ``response_tail`` as the module says."""
    data = msgspec.to_builtins(workload)
    lengths = workload.response_length
    for c in changes:
        if c.field == TAIL:
            lengths = longer_tail(lengths, c)
        elif c.field == "response_length":
            lengths = scaled_lengths(lengths, c.value) if c.relative else Fixed(value=_whole(c, 1))
        else:
            current = getattr(workload, c.field)
            if current is None and c.relative:  # an unset field (padded_to): nothing to multiply
                raise ConfigError(
                    f"--what-if {c.text}: this workload has no {c.field} to scale; give the new value, "
                    f"{c.part}.{c.field}=N."
                )
            data[c.field] = _whole(c, current) if _is_int(WorkloadSpec, c.field) else c.of(current)
    data["response_length"] = msgspec.to_builtins(lengths)
    return convert(data, WorkloadSpec, f"--what-if {', '.join(c.text for c in changes)}")


def scaled_lengths(lengths: Lengths, k: float) -> Lengths:
    """Every response ``k`` times as long (at least one token)."""
    if isinstance(lengths, Fixed):
        return Fixed(value=max(1, round(lengths.value * k)))
    if isinstance(lengths, LogNormal):
        return LogNormal(median=lengths.median * k, sigma=lengths.sigma, max=max(1, round(lengths.max * k)))
    merged: dict[int, float] = {}
    for n, w in zip(lengths.lengths, lengths.weights):
        key = max(1, round(n * k))
        merged[key] = merged.get(key, 0.0) + w
    return Histogram(lengths=sorted(merged), weights=[merged[n] for n in sorted(merged)])


def longer_tail(lengths: Lengths, c: Change) -> Lengths:
    """The same median, with the 99th percentile and the longest response ``c.value`` times as long."""
    k = c.value
    if isinstance(lengths, Fixed):
        raise ConfigError(
            f"--what-if {c.text}: the workload's responses are all {lengths.value} tokens (a fixed length has no "
            "tail); give a lognormal or histogram response_length in a --workload file, or change the length "
            "with workload.response_length=N (or Kx)."
        )
    if isinstance(lengths, LogNormal):
        sigma = lengths.sigma + math.log(k) / Z99
        if sigma < 0:
            raise ConfigError(
                f"--what-if {c.text}: the tail of lognormal(median {lengths.median:g}, sigma {lengths.sigma:g}) "
                f"cannot shrink {1 / k:g} times (its sigma would be {sigma:.3g} < 0)."
            )
        return LogNormal(median=lengths.median, sigma=min(sigma, 10.0), max=max(1, round(lengths.max * k)))
    median = _weighted_median(lengths)
    merged: dict[int, float] = {}
    for n, w in zip(lengths.lengths, lengths.weights):
        key = n if n <= median else max(median, round(n * k))
        merged[key] = merged.get(key, 0.0) + w
    return Histogram(lengths=sorted(merged), weights=[merged[n] for n in sorted(merged)])


def _weighted_median(h: Histogram) -> int:
    pairs = sorted(zip(h.lengths, h.weights))
    half, total = sum(h.weights) / 2, 0.0
    for n, w in pairs:
        total += w
        if total >= half:
            return n
    return pairs[-1][0]


# ------------------------------------------------------------------ the comparison


def compare(current: ExecutionPlan, new: ExecutionPlan, what: WhatIf) -> str:
    """The two plans side by side: the cluster and workload, the choice (placement, each model's layout,
    generation, rollout, weight sync), the predicted seconds per iteration, samples per second, steps and
    seconds to the target reward (the sample-efficiency-weighted objective, `PlanObjective`) and peak
    memory per device group, each with new/current; then a line naming what changed in the choice."""
    a, b = current.layout, new.layout
    rows: list[tuple[str, str, str, str]] = [
        ("cluster", current.target.cluster.label, new.target.cluster.label, _ratio(
            current.target.cluster.devices, new.target.cluster.devices)),
        ("workload", _workload(current.target.workload), _workload(new.target.workload), ""),
    ]  # fmt: skip
    if a is not None and b is not None:
        rows.append(("placement", a.placement, b.placement, ""))
        for model in dict.fromkeys([*(m.model for m in a.models), *(m.model for m in b.models)]):
            rows.append((model, _layout(a, model), _layout(b, model), ""))
        for gen in dict.fromkeys([*_gens(a), *_gens(b)]):
            rows.append((f"generation{f' {gen}' if gen else ''}", _gens(a).get(gen, "-"), _gens(b).get(gen, "-"), ""))
        rows += [
            ("rollout", a.rollout.describe(), b.rollout.describe(), ""),
            ("weight sync", _sync(a), _sync(b), ""),
        ]
    ta, tb = _seconds(current), _seconds(new)
    sa, sb = _samples(current, ta), _samples(new, tb)
    rows += [
        ("s/iteration", _num(ta), _num(tb), _ratio(ta, tb)),
        ("samples/s", _num(sa), _num(sb), _ratio(sa, sb)),
    ]
    oa, ob = current.objective, new.objective
    if oa is not None or ob is not None:  # the sample-efficiency-weighted time to the target reward
        steps_a, steps_b = (o.steps if o is not None else None for o in (oa, ob))
        tta, ttb = (o.time_to_target_s if o is not None else None for o in (oa, ob))
        rows += [
            ("steps to target", _num(steps_a), _num(steps_b), _ratio(steps_a, steps_b)),
            ("s to target", _num(tta), _num(ttb), _ratio(tta, ttb)),
        ]
    ma, mb = _memory(current), _memory(new)
    for group in dict.fromkeys([*ma, *mb]):
        x, y = ma.get(group), mb.get(group)
        rows.append(
            (f"memory {group}", gib(x) if x is not None else "-", gib(y) if y is not None else "-", _ratio(x, y))
        )
    head = ("", "current", "what-if", "new/current")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(4)]
    lines = [f"what if: {what.describe()}"]
    lines += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [head, *rows]]
    lines.append(changed_line(a, b))
    return "\n".join(lines)


def changed_line(a: ClusterPlan | None, b: ClusterPlan | None) -> str:
    """What the planner chose differently (the placement, a model's layout, generation, rollout, sync)."""
    if a is None or b is None:
        return "changed: (no layouts to compare)"
    diffs = []
    if a.placement != b.placement:
        diffs.append(f"placement {a.placement} -> {b.placement}")
    for model in dict.fromkeys([*(m.model for m in a.models), *(m.model for m in b.models)]):
        x, y = _layout(a, model), _layout(b, model)
        if x != y:
            diffs.append(f"{model} {x} -> {y}")
    ga, gb = _gens(a), _gens(b)
    for gen in dict.fromkeys([*ga, *gb]):
        if ga.get(gen) != gb.get(gen):
            diffs.append(f"generation{f' {gen}' if gen else ''} {ga.get(gen, '-')} -> {gb.get(gen, '-')}")
    if a.rollout.describe() != b.rollout.describe():
        diffs.append(f"rollout {a.rollout.describe()} -> {b.rollout.describe()}")
    if _sync(a) != _sync(b):
        diffs.append(f"sync {_sync(a)} -> {_sync(b)}")
    if not diffs:
        return "changed: nothing in the choice; the same plan, predicted for the new target"
    return "changed: " + "; ".join(diffs)


def _layout(plan: ClusterPlan, model: str) -> str:
    m = next((x for x in plan.models if x.model == model), None)
    if m is None:
        return "-"
    p = m.parallel
    devices = plan.group(m.group).devices
    return (
        f"dp{p.dp} tp{p.tp} pp{p.pp}{m.describe_schedule()} mb{m.micro_batch}{' off' if m.offload_optimizer else ''}"
        f" @{m.group}:{devices}"
    )


def _gens(plan: ClusterPlan) -> dict[str, str]:
    out = {"": plan.generation}
    out.update({g.model or "": g for g in plan.generations})
    return {k: f"tp{g.tp}x{g.replicas} @{g.group}:{plan.group(g.group).devices}" for k, g in out.items()}


def _sync(plan: ClusterPlan) -> str:
    s = plan.weight_sync
    return s.strategy + (f"({s.density:.0%})" if s.strategy == "sparse" else "")


def _workload(w: WorkloadSpec | None) -> str:
    if w is None:
        return "-"
    mean, longest = w.mean_response(), w.max_response()
    tail = "" if round(mean) == longest else f" (max {longest})"
    return f"{w.sequences} seq x {w.prompt_length}+{mean:.0f} tok{tail}"


def _seconds(plan: ExecutionPlan) -> float | None:
    pred = plan.layout.predicted if plan.layout is not None else None
    return pred.iteration_s if pred is not None else None


def _samples(plan: ExecutionPlan, seconds: float | None) -> float | None:
    w = plan.target.workload
    return w.sequences / seconds if seconds and w is not None else None


def _memory(plan: ExecutionPlan) -> Mapping[str, int]:
    pred = plan.layout.predicted if plan.layout is not None else None
    if pred is not None and pred.memory_bytes:
        return pred.memory_bytes
    return {m.group: m.required_bytes for m in plan.memory}


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.3g}" if x < 100 else f"{x:,.0f}"


def _ratio(x: float | None, y: float | None) -> str:
    if not x or y is None:
        return ""
    return f"{y / x:.2f}x"
