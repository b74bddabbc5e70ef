"""Hardware and cluster specs for the planner: accelerator presets, cluster strings, profiles.

A cluster is named on the command line as one of

* ``16xA100-80G`` (or ``16x A100-80G``): 16 devices of a preset, packed into whole nodes;
* ``2x8xH100-80G``: 2 nodes x 8 devices;
* a YAML/TOML/JSON cluster file (``nodes``, ``devices_per_node``, ``hardware``);
* ``local``: the spec ``flowrl profile`` measured and saved for this machine (1 node x 1 device).

Preset numbers are public datasheet values (dense, i.e. without structured sparsity).
``memory_bytes`` is the advertised capacity read as GiB (``80 GB`` -> ``80 * 2**30``), which is
what ``nvidia-smi`` reports to within ~1% for every preset here; headroom for the CUDA context
and fragmentation is the memory model's business, not the preset's. Bandwidths are bytes/s in
one direction per device (NVLink: half the bidirectional aggregate; inter-node: the device's
share of the node's NICs).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

import msgspec

from flowrl.contract.checked import Count, GiB, coerce_numbers
from flowrl.contract.hardware import (
    CPU_DEVICES,
    NOMINAL,
    ClusterSpec,
    HardwareSpec,
    default_profile_path,
    is_cpu,
    load_hardware,
)
from flowrl.errors import ConfigError, did_you_mean
from flowrl.specs import convert, read_document


def cost_provenance(hw: HardwareSpec) -> str:
    """Where the factors the cost model uses for ``hw`` come from, and how far to trust them."""
    cal = hw.calibration
    if cal is not None:
        fit = "; ".join(
            f"{run} {before:.3g} -> {after:.3g} s/iteration (measured {measured:.3g})"
            for run, (before, after, measured) in cal.fit.items()
        )
        factors = "; ".join(f"{name} from {', '.join(runs)}" for name, runs in cal.factors.items())
        return (
            f"cost model: calibrated by `flowrl calibrate` ({cal.when}) to {len(cal.runs)} run(s): {fit}. Fitted: "
            f"{factors}; every other factor is the spec's own."
        )
    if hw.name.endswith(NOMINAL):
        return (
            "cost model: UNCALIBRATED. Nominal speeds for this machine (neither `flowrl profile` nor `flowrl "
            "calibrate` has run): predictions can be several times off. After a run, `flowrl calibrate runs/NAME` "
            "fits them to what it measured."
        )
    if is_cpu(hw):
        return (
            "cost model: uncalibrated. `flowrl profile`'s micro-benchmarks of this machine, not fitted to a run: "
            "per-task overheads (dispatch, moving batches, the engine's host work) are not in it, and a run takes "
            "longer than predicted. After a run, `flowrl calibrate runs/NAME` fits them."
        )
    return (
        f"cost model: uncalibrated for this cluster. {hw.name} datasheet peaks, the matmul efficiency fitted to "
        "published runs (flowrl/planner/data/efficiency.yaml) and default engine overheads. After a run on it, "
        "`flowrl calibrate runs/NAME` fits them to what the run measured."
    )


#: Seconds per tensor-parallel module call on this kind of CPU (measured here: the tiny model's forward
#: split tp 2 over two gloo processes took 12.1 ms against 2.3 ms whole; its 8 all-reduces 0.73 ms each,
#: the rest over its 16 split modules, ~0.25 ms each).
CPU_TP_OP_OVERHEAD = 2.5e-4
#: Bytes/s of a gloo broadcast between two local processes (FACTS.md: 40 MiB in ~12 ms).
LOOPBACK_BANDWIDTH = 3e9
#: Seconds of one small gloo collective between two busy local processes (measured here: a 4 KiB
#: all-gather 1.4 ms, an all-reduce 1.6 ms, while both cores were loaded).
LOOPBACK_LATENCY = 1e-3
_CPU_SPLIT = re.compile(r"^cpu\s*:\s*(\d+)$", re.IGNORECASE)


def cpu_devices(text: str) -> int | None:
    """N for a ``cpu:N`` cluster string, else None."""
    m = _CPU_SPLIT.match(text.strip())
    if m is None:
        return None
    if int(m.group(1)) < 1:
        raise ConfigError(f"cluster '{text}': cpu:N needs N >= 1 devices.")
    return int(m.group(1))


def cpu_cluster(machine: HardwareSpec, devices: int) -> ClusterSpec:
    """This machine's CPU as ``devices`` equal devices: each has 1/N of its compute, memory and
    memory bandwidth (workers get 1/N of the cores each), and they talk over loopback."""
    hardware = msgspec.structs.replace(
        machine,
        name=CPU_DEVICES,
        peak_flops_bf16=machine.peak_flops_bf16 / devices,
        peak_flops_fp32=machine.peak_flops_fp32 / devices,
        memory_bytes=machine.memory_bytes // devices,
        memory_bandwidth=machine.memory_bandwidth / devices,
        intra_node_bandwidth=LOOPBACK_BANDWIDTH,
        inter_node_bandwidth=LOOPBACK_BANDWIDTH,
        intra_node_latency=LOOPBACK_LATENCY,
        inter_node_latency=LOOPBACK_LATENCY,
        devices_per_node=devices,
        tp_op_overhead=CPU_TP_OP_OVERHEAD,
    )
    return ClusterSpec(nodes=1, devices_per_node=devices, hardware=hardware)


#: Seconds per weight tensor of a weight update into a vLLM engine on a GPU: fitted to NeMo-RL
#: v0.3's published refit times (Llama-3.1-8B on 8 H100: 5 s; 70B on 64 H100: 14 s;
#: benchmarks/published), after the bytes moved are costed.
ENGINE_TENSOR_SECONDS = 0.012


#: Where `benchmarks/overheads_fit.py` writes a serving engine's host work per decode step, fitted to published
#: generation phases (NeMo-RL v0.3, vLLM with CUDA graphs: 8B on 8 H100 and 70B on 64 H100).
DECODE_OVERHEADS = Path(__file__).parent / "data" / "decode_overheads.yaml"


@cache
def decode_overheads() -> dict[str, float]:
    """``decode_step_overhead`` and ``decode_row_overhead`` of a vLLM-class engine on an accelerator."""
    data = msgspec.yaml.decode(DECODE_OVERHEADS.read_bytes())
    return {k: float(data[k]) for k in ("decode_step_overhead", "decode_row_overhead")}


def _preset(name: str, **fields: Any) -> HardwareSpec:
    return HardwareSpec(name=name, engine_tensor_overhead=ENGINE_TENSOR_SECONDS, **decode_overheads(), **fields)


_A100 = dict(peak_flops_bf16=312e12, peak_flops_fp32=19.5e12, intra_node_bandwidth=300e9, inter_node_bandwidth=25e9)
_HOPPER_LINKS = dict(
    intra_node_bandwidth=450e9, inter_node_bandwidth=50e9, host_bandwidth=50e9
)  # PCIe Gen5 x16 (A100: Gen4, the 25e9 default)

HARDWARE_PRESETS: dict[str, HardwareSpec] = {
    "A100-40G": _preset("A100-40G", **_A100, memory_bytes=40 * GiB, memory_bandwidth=1.555e12),
    "A100-80G": _preset("A100-80G", **_A100, memory_bytes=80 * GiB, memory_bandwidth=2.039e12),
    "H100-80G": _preset(
        "H100-80G",
        peak_flops_bf16=989e12,
        peak_flops_fp32=67e12,
        memory_bytes=80 * GiB,
        memory_bandwidth=3.35e12,
        **_HOPPER_LINKS,
    ),
    "H200-141G": _preset(
        "H200-141G",
        peak_flops_bf16=989e12,
        peak_flops_fp32=67e12,
        memory_bytes=141 * GiB,
        memory_bandwidth=4.8e12,
        **_HOPPER_LINKS,
    ),
    "H20": _preset(
        "H20",
        peak_flops_bf16=148e12,
        peak_flops_fp32=44e12,
        memory_bytes=96 * GiB,
        memory_bandwidth=4.0e12,
        **_HOPPER_LINKS,
    ),
}


# ------------------------------------------------------------------ files


def cluster_key(cluster: ClusterSpec) -> str:
    """The name a cluster's calibration is saved under: ``local`` (this machine as one device), ``cpu-2``
    (``cpu:2``), else the cluster's label (``2x8xH100-80G``)."""
    if cluster.devices == 1 and is_cpu(cluster.hardware):
        return "local"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", cluster.label)


def calibration_path(cluster: ClusterSpec) -> Path:
    """Where ``flowrl calibrate`` saves the factors fitted for ``cluster``:
    ``$FLOWRL_HOME/hardware/calibrated/<cluster_key>.yaml``."""
    return calibration_file(cluster_key(cluster))


def calibration_file(key: str) -> Path:
    """The calibration of the cluster named ``key`` (`cluster_key`)."""
    return default_profile_path().parent / "calibrated" / f"{key}.yaml"


def with_calibration(cluster: ClusterSpec) -> ClusterSpec:
    """``cluster`` costed with the factors `flowrl calibrate` fitted for it, where it has: those factors
    replace the spec's own (every other field, its memory too, stays as given or measured now)."""
    path = calibration_path(cluster)
    if not path.is_file():
        return cluster
    fitted = load_hardware(path)
    if fitted.calibration is None:
        return cluster
    hardware = cluster.hardware
    factors = [f for f in fitted.calibration.factors if _has(hardware, f) or f.startswith("efficiency.")]
    if any(f.startswith("efficiency.") for f in factors) and hardware.efficiency is None:
        hardware = msgspec.structs.replace(hardware, efficiency=fitted.efficiency)
    hardware = with_values(hardware, {f: get(fitted, f) for f in factors if _has(fitted, f)})
    return msgspec.structs.replace(cluster, hardware=msgspec.structs.replace(hardware, calibration=fitted.calibration))


def _has(hw: HardwareSpec, path: str) -> bool:
    try:
        get(hw, path)
    except (AttributeError, KeyError, TypeError):
        return False
    return True


def get(hw: HardwareSpec, path: str) -> float:
    """The factor at ``path`` (``kernel_overhead``, ``efficiency.e_max``, ``generation.vllm.kernel_overhead``)."""
    obj: Any = hw
    for part in _parts(path):
        obj = obj[part] if isinstance(obj, dict) else getattr(obj, part)
    return float(obj)


def with_values(hw: HardwareSpec, values: dict[str, float]) -> HardwareSpec:
    """``hw`` with the factors at ``path: value`` replaced."""
    changes: dict[str, Any] = {}
    curve, engines = hw.efficiency, dict(hw.generation)
    for path, value in values.items():
        parts = _parts(path)
        if parts[0] == "efficiency":
            curve = msgspec.structs.replace(curve, **{parts[1]: value})
        elif parts[0] == "generation":
            engines[parts[1]] = msgspec.structs.replace(engines[parts[1]], **{parts[2]: value})
        else:
            changes[path] = int(value) if isinstance(getattr(hw, path), int) else value
    return msgspec.structs.replace(hw, efficiency=curve, generation=engines, **changes)


def _parts(path: str) -> list[str]:
    head, _, rest = path.partition(".")
    if head == "generation":
        engine, _, field = rest.rpartition(".")
        return [head, engine, field]
    return [head, *([rest] if rest else [])]


# ------------------------------------------------------------------ cluster strings


_NODES_X_DEVICES = re.compile(r"^(\d+)\s*[x×]\s*(\d+)\s*[x×]\s*(\S.*)$", re.IGNORECASE)
_DEVICES = re.compile(r"^(\d+)\s*[x×]\s*(\S.*)$", re.IGNORECASE)
_FILE_SUFFIXES = (".yaml", ".yml", ".toml", ".json")


def parse_cluster(
    text: str,
    *,
    extra_presets: Mapping[str, HardwareSpec] | None = None,
    local_path: Path | None = None,
) -> ClusterSpec:
    """Turn a cluster string (see the module docstring) into a ClusterSpec.

    ``extra_presets`` (e.g. from plugins) are looked up alongside, and take precedence over,
    ``HARDWARE_PRESETS``. ``local_path`` overrides where ``local`` reads its profile.
    """
    presets = {**HARDWARE_PRESETS, **(extra_presets or {})}
    spec = text.strip()
    if not spec:
        raise ConfigError("cluster: empty; give e.g. '8xA100-80G', '2x8xH100-80G', 'local' or a cluster file.")
    if spec.lower() == "local":
        path = Path(local_path) if local_path is not None else default_profile_path()
        calibrated = calibration_file("local")
        if not path.is_file() and local_path is None and calibrated.is_file():  # `flowrl calibrate` fitted it
            return ClusterSpec(nodes=1, devices_per_node=1, hardware=load_hardware(calibrated))
        if not path.is_file():
            raise ConfigError(
                f"cluster 'local': no hardware profile at '{path}'. Run `flowrl profile` first to measure this "
                "machine, "
                "or name a preset such as '1xA100-80G'."
            )
        return ClusterSpec(nodes=1, devices_per_node=1, hardware=load_hardware(path))
    path = Path(spec).expanduser()
    if path.suffix.lower() in _FILE_SUFFIXES or path.is_file():
        return _load_cluster_file(path, presets)
    if m := _NODES_X_DEVICES.match(spec):
        nodes, per_node, name = int(m.group(1)), int(m.group(2)), m.group(3).strip()
        hardware = _lookup(name, presets, f"cluster '{spec}'")
        if nodes < 1 or per_node < 1:
            raise ConfigError(f"cluster '{spec}': node and device counts must be >= 1.")
        if per_node > hardware.devices_per_node:
            raise ConfigError(
                f"cluster '{spec}': a {hardware.name} node holds at most {hardware.devices_per_node} devices, "
                f"not {per_node}; "
                "use a cluster file with an inline hardware mapping for a different node size."
            )
        return ClusterSpec(nodes=nodes, devices_per_node=per_node, hardware=hardware)
    if m := _DEVICES.match(spec):
        count, name = int(m.group(1)), m.group(2).strip()
        hardware = _lookup(name, presets, f"cluster '{spec}'")
        return _pack(count, hardware, spec)
    if _find(spec, presets) is not None:
        raise ConfigError(
            f"cluster '{spec}': give a device count, e.g. '8x{_find(spec, presets).name}' or "
            f"'2x8x{_find(spec, presets).name}'."
        )
    if path.suffix or os.sep in spec or "/" in spec:
        raise ConfigError(f"cluster file '{path}' does not exist.")
    raise ConfigError(
        f"cluster '{spec}' is not understood.{did_you_mean(spec, list(presets))} Use '<devices>x<preset>' "
        "(e.g. '16xA100-80G'), "
        f"'<nodes>x<devices>x<preset>', 'local' or a YAML/TOML/JSON cluster file. Presets: {', '.join(presets)}."
    )


def _pack(count: int, hardware: HardwareSpec, spec: str) -> ClusterSpec:
    if count < 1:
        raise ConfigError(f"cluster '{spec}': the device count must be >= 1.")
    per_node = hardware.devices_per_node
    if count <= per_node:
        return ClusterSpec(nodes=1, devices_per_node=count, hardware=hardware)
    if count % per_node:
        multiples = ", ".join(str(per_node * k) for k in (1, 2, 3))
        raise ConfigError(
            f"cluster '{spec}': {count} devices do not fill whole {per_node}-device nodes; use {multiples} ... "
            f"(or fewer than {per_node} on one node), '<nodes>x<devices>x{hardware.name}', or a cluster file."
        )
    return ClusterSpec(nodes=count // per_node, devices_per_node=per_node, hardware=hardware)


def _find(name: str, presets: Mapping[str, HardwareSpec]) -> HardwareSpec | None:
    lowered = {k.lower(): v for k, v in presets.items()}
    return lowered.get(name.strip().lower())


def _lookup(name: str, presets: Mapping[str, HardwareSpec], what: str) -> HardwareSpec:
    found = _find(name, presets)
    if found is None:
        raise ConfigError(
            f"{what}: unknown hardware preset '{name}'.{did_you_mean(name, list(presets))} Presets: "
            f"{', '.join(presets)}."
        )
    return found


class _ClusterFile(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    nodes: Count = 1
    devices_per_node: Count | None = None  # None: the hardware's
    hardware: str | dict[str, Any]


def _load_cluster_file(path: Path, presets: Mapping[str, HardwareSpec]) -> ClusterSpec:
    """``{nodes, devices_per_node, hardware}``; hardware is a preset name, a full HardwareSpec
    mapping, or ``{preset: NAME, <field>: <override>, ...}``."""
    what = f"cluster file '{path}'"
    if not path.is_file():
        raise ConfigError(f"{what} does not exist.")
    raw = read_document(path)
    head = convert(coerce_numbers(raw, _ClusterFile), _ClusterFile, what)
    hardware: dict[str, Any]
    if isinstance(head.hardware, str):
        hardware = msgspec.to_builtins(_lookup(head.hardware, presets, f"{what}, field 'hardware'"))
    else:
        hardware = dict(head.hardware)
        preset = hardware.pop("preset", None)
        if preset is not None:
            if not isinstance(preset, str):
                raise ConfigError(
                    f"{what}: field 'hardware.preset' must be a preset name, got {type(preset).__name__}."
                )
            hardware = {**msgspec.to_builtins(_lookup(preset, presets, f"{what}, field 'hardware.preset'")), **hardware}
    hardware = coerce_numbers(hardware, HardwareSpec)
    data = {"nodes": head.nodes, "devices_per_node": head.devices_per_node, "hardware": hardware}
    if data["devices_per_node"] is None:
        data["devices_per_node"] = hardware.get("devices_per_node", _default("devices_per_node"))
    cluster = convert(data, ClusterSpec, what)
    if cluster.devices_per_node > cluster.hardware.devices_per_node:
        raise ConfigError(
            f"{what}: field 'devices_per_node' is {cluster.devices_per_node} but a {cluster.hardware.name} "
            "node holds at most "
            f"{cluster.hardware.devices_per_node}; set 'hardware.devices_per_node' too if the node really is larger."
        )
    return cluster


def _default(name: str) -> Any:
    return next(f.default for f in msgspec.structs.fields(HardwareSpec) if f.name == name)
