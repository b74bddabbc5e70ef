"""Hardware and cluster specs: the devices a plan is for (presets, cluster strings and profiles:
`flowrl.planner.hardware`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec

from flowrl.contract.checked import CheckedSpec, Count, Fraction, NonNegative, Positive, SpecFieldError, coerce_numbers
from flowrl.errors import ConfigError
from flowrl.specs import convert, read_document

#: Dense matmul FLOPs per token and layer, in units of hidden**2, against which attention's share is taken.
DENSE_PER_LAYER = 12.0


class EfficiencyCurve(CheckedSpec, kw_only=True):
    """Matmul efficiency as a function of the work, for one device (formula, fit and data: `efficiency.py`)."""

    e_max: Fraction  # efficiency of large dense matmuls
    k_w: NonNegative  # cost of streaming the weights once per call, per unit of ridge / tokens
    k_a: NonNegative  # cost of activation traffic, per unit of ridge * tp / hidden
    e_attn: Fraction  # efficiency of attention FLOPs
    ridge: Positive | None = None  # the device's peak FLOP/s / memory bytes/s (None: its hardware's)

    def at(self, tokens: Any, hidden: int, seq_len: Any = 0, *, tp: int = 1) -> Any:
        """Fraction of peak in (0, 1] for work of ``tokens`` per device per call (floats or numpy arrays;
        an array in gives an array out). Fewer than one token is read as one."""
        if hidden < 1 or tp < 1:
            raise ValueError(f"EfficiencyCurve.at: hidden and tp must be >= 1, got hidden={hidden}, tp={tp}")
        if self.ridge is None:
            raise ValueError("EfficiencyCurve.at: the curve has no ridge; take it from its hardware (with_ridge)")
        import numpy as np

        t = np.maximum(np.asarray(tokens, dtype=float), 1.0)
        length = np.maximum(np.asarray(seq_len, dtype=float), 0.0)
        a = length / (length + DENSE_PER_LAYER * hidden)
        dense = 1.0 / self.e_max + self.k_w * self.ridge / t + self.k_a * self.ridge * tp / hidden
        eff = 1.0 / ((1.0 - a) * dense + a / self.e_attn)
        return float(eff) if eff.ndim == 0 else eff

    def tokens_half(self, hidden: int, *, tp: int = 1) -> float:
        """Tokens per call at which a pass without attention reaches half its ceiling at this hidden."""
        ceiling = 1.0 / (1.0 / self.e_max + self.k_a * self.ridge * tp / hidden)
        return self.k_w * self.ridge * ceiling

    def with_ridge(self, ridge: float) -> EfficiencyCurve:
        """These parameters on a device with another ridge (peak FLOP/s / memory bytes/s)."""
        return msgspec.structs.replace(self, ridge=ridge)


class GenerationCalibration(CheckedSpec, kw_only=True):
    """How fast one generation engine decodes on this hardware, as `flowrl profile` measured it
    through the engine itself (the cost model's decode factors, for that engine)."""

    kernel_overhead: NonNegative  # s per layer per decode step
    matmul_efficiency: Fraction
    load_bandwidth: Positive  # bytes/s of an in-place weight load into the running engine
    head_sizes: tuple[int, ...] = ()  # attention head sizes it runs here (empty: any)


#: Seconds of host-side work per tensor-parallel module call on a GPU host (DTensor's Python dispatch).
TP_OP_OVERHEAD = 3e-5
#: Seconds of controller work per row (rule rewards, advantages, the batch's bookkeeping; ~1 ms / 512 here).
CONTROLLER_ROW_SECONDS = 2e-6


class Calibrated(CheckedSpec, kw_only=True):
    """Where a spec's factors came from: `flowrl calibrate` fitted ``factors`` (factor -> the runs whose
    measured spans constrained it) to the traces of ``runs``; the others are the spec's own."""

    runs: list[str]
    factors: dict[str, list[str]]
    when: str = ""  # ISO date of the fit
    # run -> (predicted s/iteration before, after, measured)
    fit: dict[str, tuple[float, float, float]] = msgspec.field(default_factory=dict)


class HardwareSpec(CheckedSpec, kw_only=True):
    """One accelerator (or a CPU socket) and the links around it."""

    name: str
    peak_flops_bf16: Positive  # dense FLOP/s
    peak_flops_fp32: Positive
    memory_bytes: Count  # usable device memory
    memory_bandwidth: Positive  # HBM bytes/s
    intra_node_bandwidth: Positive  # bytes/s per device, one direction (NVLink)
    intra_node_latency: NonNegative = 5e-6  # s
    inter_node_bandwidth: Positive  # bytes/s per device (its share of the IB/RoCE NICs)
    inter_node_latency: NonNegative = 1e-5  # s
    devices_per_node: Count = 8
    host_bandwidth: Positive = 25e9  # device<->host (PCIe) bytes/s, for offload
    # efficiency factors the cost model multiplies peaks by; `flowrl profile` fits them
    matmul_efficiency: Fraction = 0.55
    bandwidth_efficiency: Fraction = 0.75
    comm_efficiency: Fraction = 0.8
    kernel_overhead: NonNegative = 2e-5  # s per layer per forward step (launch/sync overhead)
    # s of host-side work per tensor-parallel module call per pass (DTensor's wrapping and redistribution
    # around each split projection, embedding and head), beside its collectives
    tp_op_overhead: NonNegative = TP_OP_OVERHEAD
    # s per weight tensor to hand new weights to a separate generation engine (IPC handle, the engine's
    # load call); 0 for an engine that shares the trainer's tensors. Presets: fitted to published refit
    # times (benchmarks/published); `flowrl profile` measures an engine's own load rate instead
    engine_tensor_overhead: NonNegative = 0.0
    # s of host-side work per task a device group runs: the controller's dispatch, moving the task's batch
    # in and out, the engine's bookkeeping around its kernels (`flowrl calibrate` fits it from a run's trace)
    task_overhead: NonNegative = 0.0
    # a generation engine's host-side work per decode step beside its kernels: per step (its scheduler, the
    # sampler's launch) and per live sequence per step (sampling, stop checks, detokenisation, bookkeeping)
    decode_step_overhead: NonNegative = 0.0
    decode_row_overhead: NonNegative = 0.0
    # s per generation call of a replica beside its steps: setting up the batch (its KV cache, the prompts'
    # padding and positions) and handing the responses back
    generate_overhead: NonNegative = 0.0
    # s of host-side work per weight tensor per optimizer step (zeroing, clipping and updating it tensor by tensor)
    optimizer_tensor_overhead: NonNegative = 0.0
    controller_row_overhead: NonNegative = CONTROLLER_ROW_SECONDS  # s per row of controller work
    # s of host-side work per weight tensor a weight sync moves (its handle, the copy call into the generation
    # layout's parameter), beside the bytes and the link's latency
    sync_tensor_overhead: NonNegative = 0.0
    # the work-dependent matmul efficiency `flowrl profile` fitted on this device (None: the curve fitted to
    # published runs of its GPU family, `efficiency.py`; on this machine's CPU, matmul_efficiency)
    efficiency: EfficiencyCurve | None = None
    # generation engines measured here by `flowrl profile` (by engine name); others decode with the factors above
    generation: dict[str, GenerationCalibration] = msgspec.field(default_factory=dict)
    calibration: Calibrated | None = None  # the factors `flowrl calibrate` fitted to runs here (None: none)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.name.strip():
            raise SpecFieldError("HardwareSpec field 'name' must not be empty")
        if self.efficiency is not None and self.efficiency.ridge is None:  # the curve's ridge is this hardware's
            ridge = self.peak_flops_bf16 / self.memory_bandwidth
            msgspec.structs.force_setattr(self, "efficiency", self.efficiency.with_ridge(ridge))


#: Devices beyond which a cluster is a typo (the largest published RL runs use a few thousand).
MAX_DEVICES = 1 << 20


class ClusterSpec(CheckedSpec, kw_only=True):
    """``nodes`` x ``devices_per_node`` identical devices."""

    nodes: Count
    devices_per_node: Count
    hardware: HardwareSpec

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.nodes * self.devices_per_node > MAX_DEVICES:
            raise SpecFieldError(
                f"the cluster has {self.nodes * self.devices_per_node:.3g} devices ({self.nodes} nodes x "
                f"{self.devices_per_node}), more than the {MAX_DEVICES:,} the planner models; check the counts for a "
                "typo"
            )

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def label(self) -> str:
        """``2x8xA100-80G``: the cluster string that names this cluster's shape (``cpu:N`` for this machine's CPU)."""
        if self.hardware.name == CPU_DEVICES:
            return f"cpu:{self.devices}"
        return f"{self.nodes}x{self.devices_per_node}x{self.hardware.name}"

    @property
    def on_cpu(self) -> bool:
        """Whether this is this machine's CPU (``cpu:N``, or the local CPU device), not accelerators."""
        return is_cpu(self.hardware)


#: The hardware name of one device of ``cpu:N``.
CPU_DEVICES = "cpu"


#: How this machine's CPU is named as one device (the local backend, `flowrl profile`).
LOCAL_CPU = "local-cpu"


#: The suffix of a local device's name when nothing has measured it (nominal speeds).
NOMINAL = "-nominal"


def is_cpu(hw: HardwareSpec) -> bool:
    """Whether ``hw`` is this machine's CPU (``cpu:N``, or the local CPU device), not an accelerator."""
    return hw.name == CPU_DEVICES or hw.name.startswith(LOCAL_CPU)


def default_profile_path() -> Path:
    """Where ``flowrl profile`` saves this machine's spec: ``$FLOWRL_HOME/hardware/local.yaml``."""
    return Path(os.environ.get("FLOWRL_HOME", Path.home() / ".flowrl")) / "hardware" / "local.yaml"


def save_hardware(spec: HardwareSpec, path: str | Path) -> Path:
    """Write ``spec`` as YAML (creating parent folders); returns the path."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(msgspec.yaml.encode(spec))
    except OSError as exc:
        raise ConfigError(f"cannot write hardware file '{path}': {exc.strerror or exc}.") from None
    return path


def load_hardware(path: str | Path) -> HardwareSpec:
    """Read a HardwareSpec from a YAML/TOML/JSON file; errors name the file and field."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"hardware file '{path}' does not exist.")
    data = read_document(path)
    return convert(coerce_numbers(data, HardwareSpec), HardwareSpec, f"hardware file '{path}'")


class ClusterNode(msgspec.Struct, frozen=True, kw_only=True):
    """One alive node of a cluster an executor joins (`flowrl run --address`), as it discovered it."""

    node_id: str  # the cluster's id of the node (Ray: its hex node id)
    ip: str  # the node manager's address: where its workers' process groups listen
    head: bool
    cpus: int
    gpus: int
    accelerator: str | None = None  # the GPUs' kind as the cluster names it (Ray: H100, A100-40G...), if any

    def devices(self, gpus: bool) -> int:
        """Devices this node offers a plan: its GPUs, or its CPUs for a plan on CPU."""
        return self.gpus if gpus else self.cpus

    def describe(self) -> str:
        return f"{'head ' if self.head else ''}node {self.node_id[:12]} ({self.ip}, {self.cpus} CPU, {self.gpus} GPU)"
