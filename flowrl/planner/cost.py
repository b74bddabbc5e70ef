"""Cost model: time of each op from FLOPs and bytes with efficiency factors (memory: `memory.py`).

All models train in bf16 with fp32 AdamW states (mixed precision), activations recomputed per
layer (the usual RLHF setting), flash attention (no seq x seq buffers).

    matmul time   = FLOPs / (devices * peak_bf16 * efficiency(tokens per device, hidden, seq_len, tp))
    stream time   = bytes / (memory_bandwidth * bandwidth_efficiency)
    ring collective of V bytes over n ranks = 2 (n-1)/n * V / (link_bw * comm_efficiency) + n * latency

The matmul efficiency is the curve `efficiency.py` fits to published GPU runs (training
micro-batches, prefills, decodes): low for a decode step of a few tokens, ~45-75% of peak for a
training micro-batch of thousands; on this machine's CPU it is `flowrl profile`'s constant.
Generation (prefill, decode steps) uses the generation engine's own factors where `flowrl
profile` measured that engine on this hardware (``HardwareSpec.generation``), and a weight sync
then also pays the engine's in-place load.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from flowrl.contract.hardware import GenerationCalibration, HardwareSpec, is_cpu
from flowrl.contract.layout import ModelLayout
from flowrl.contract.model import ModelSpec
from flowrl.planner import pipeline as pipe
from flowrl.planner.efficiency import EfficiencyCurve, curve_for

BF16 = 2
FP32 = 4
ADAM_STATE_BYTES = 12  # fp32 master weights + two moments per parameter


@dataclass(frozen=True)
class PipelineCost:
    """One pipelined pass of a layout split into stages (pp > 1): ``steps`` flushes (mini-batches) of
    ``micro_batches`` micro-batches per dp rank, each rank's seconds per micro-batch (``compute``: FLOPs,
    kernels, collectives; ``p2p``: its stage-boundary transfers)."""

    schedule: str
    pp: int
    virtual_stages: int
    micro_batches: int
    steps: int
    compute: tuple[float, ...]
    p2p: tuple[float, ...]

    @property
    def per_rank(self) -> list[float]:
        return [c + t for c, t in zip(self.compute, self.p2p)]

    @property
    def step_s(self) -> float:
        """Seconds of one flush: `pipeline.step_seconds`."""
        return pipe.step_seconds(self.per_rank, self.micro_batches, self.virtual_stages)

    @property
    def seconds(self) -> float:
        return self.steps * self.step_s

    @property
    def bubble(self) -> float:
        """The fraction of a step the slowest rank idles (`pipeline.bubble`)."""
        return pipe.bubble(self.per_rank, self.micro_batches, self.virtual_stages)

    @property
    def idle(self) -> list[float]:
        """Each rank's idle fraction of a step (neither computing nor sending)."""
        return pipe.idle(self.per_rank, self.micro_batches, self.virtual_stages)

    @property
    def not_computing(self) -> list[float]:
        """Each rank's fraction of a step spent not computing: idle, or in its sends and receives (what the
        torch engine's `Pipeline.times` measures as its bubble, with communication)."""
        step = self.step_s
        return [1 - self.micro_batches * c / step for c in self.compute]

    @property
    def imbalance(self) -> float:
        """The slowest rank's time per micro-batch over the mean rank's (1: balanced stages)."""
        per_rank = self.per_rank
        return max(per_rank) * len(per_rank) / sum(per_rank)


@dataclass(frozen=True)
class CostModel:
    """Roofline-style op costs (FLOPs and bytes with efficiency factors) and per-device memory."""

    model: ModelSpec
    hw: HardwareSpec
    engine: str | None = None  # the generation engine: its calibration (hw.generation) costs decode and loads
    captured: bool = False  # the engine replays decode steps as captured graphs (EngineCapabilities.captured_decode)

    def for_engine(self, engine: str, captured: bool = False) -> CostModel:
        """This model costing generation as ``engine`` does (the hardware's factors if it has no calibration);
        ``captured``: it decodes from captured graphs, without host work per module call on accelerators."""
        return dataclasses.replace(self, engine=engine, captured=captured)

    @property
    def calibration(self) -> GenerationCalibration | None:
        return self.hw.generation.get(self.engine) if self.engine is not None else None

    # ------------------------------------------------------------ helpers
    @property
    def params(self) -> int:
        return self.model.parameters()

    @property
    def param_bytes(self) -> int:
        return self.params * BF16

    def link(self, devices: int) -> tuple[float, float]:
        """(bandwidth, latency) of the slowest link a group of ``devices`` spans."""
        if devices <= self.hw.devices_per_node:
            return self.hw.intra_node_bandwidth * self.hw.comm_efficiency, self.hw.intra_node_latency
        return self.hw.inter_node_bandwidth * self.hw.comm_efficiency, self.hw.inter_node_latency

    def allreduce(self, nbytes: float, ranks: int, span: int | None = None) -> float:
        if ranks <= 1:
            return 0.0
        bw, lat = self.link(span or ranks)
        return 2 * (ranks - 1) / ranks * nbytes / bw + ranks * lat

    def matmul(self, flops: Any, devices: int, efficiency: Any = None) -> Any:
        """``efficiency``: the fraction of peak reached (default: the hardware's matmul_efficiency);
        numbers or arrays, elementwise."""
        eff = self.hw.matmul_efficiency if efficiency is None else efficiency
        return flops / (devices * self.hw.peak_flops_bf16 * eff)

    @cached_property
    def curve(self) -> EfficiencyCurve | None:
        """The work-dependent matmul efficiency: the one `flowrl profile` fitted on this hardware, else the
        one fitted to published runs of its GPU family (None on this machine's CPU: the profile's constant)."""
        return self.hw.efficiency or curve_for(self.hw)  # a cluster file's or profile's own curve first

    def efficiency(self, tokens: Any, seq_len: Any, tp: int) -> Any:
        """The fraction of peak a call of ``tokens`` tokens per device over ``seq_len``-token sequences
        reaches: the fitted curve (`efficiency.py`), else the hardware's constant."""
        if self.curve is None:
            return self.hw.matmul_efficiency
        return self.curve.at(tokens, self.model.hidden, seq_len, tp=tp)

    def stream(self, nbytes: float) -> float:
        return nbytes / (self.hw.memory_bandwidth * self.hw.bandwidth_efficiency)

    # ------------------------------------------------------------ generation
    def _decode_factors(self) -> tuple[float, float]:
        """(kernel overhead, matmul efficiency) of generation: the engine's calibration, else the hardware's."""
        cal = self.calibration
        if cal is None:
            return self.hw.kernel_overhead, self.hw.matmul_efficiency
        return cal.kernel_overhead, cal.matmul_efficiency

    def prefill(self, sequences: int, prompt: int, tp: int) -> float:
        """Prompt forward of one replica: compute-bound."""
        tokens = sequences * prompt
        flops = tokens * self.model.flops_per_token(prompt // 2)
        comm = self.tp_pass(tokens, tp, self.model.layers, rows=sequences)  # the last position's logits
        overhead, efficiency = self._decode_factors()
        if self.calibration is None:
            efficiency = self.efficiency(tokens, prompt, tp)
        return self.matmul(flops, tp, efficiency) + comm + self.model.layers * overhead

    def decode_step(self, batch: np.ndarray, context: np.ndarray, tp: int) -> np.ndarray:
        """Decode steps of one replica (elementwise over arrays of live batch and context):
        max(compute, weights + KV streamed) + TP all-reduces + per-layer overhead + the engine's host work
        per step and per live sequence (scheduler, sampler, detokenisation)."""
        base = self.model.flops_per_token(0)
        flops = batch * (base + (self.model.flops_per_token(1) - base) * context)  # linear in the context
        nbytes = (self.param_bytes + batch * context * self.model.kv_bytes_per_token(BF16)) / tp
        host = not (self.captured and not is_cpu(self.hw))  # a captured graph's collectives have no host work
        comm = self.tp_pass(batch, tp, self.model.layers, host=host)  # the draw reads the whole vocabulary's logits
        overhead, efficiency = self._decode_factors()
        if self.calibration is None:
            efficiency = self.efficiency(batch, 2 * context, tp)
        engine = self.hw.decode_step_overhead + batch * self.hw.decode_row_overhead  # its work around the kernels
        return (
            np.maximum(self.matmul(flops, tp, efficiency), self.stream(nbytes))
            + comm
            + self.model.layers * overhead
            + engine
        )

    def engine_load(self, nbytes: float) -> float:
        """Loading ``nbytes`` (one device's share) of new weights into the running generation engine:
        the engine's measured load rate when `flowrl profile` calibrated it; else one handle and load
        call per weight tensor (the hardware's ``engine_tensor_overhead``) plus a copy of the bytes."""
        cal = self.calibration
        if cal is not None:
            return nbytes / cal.load_bandwidth
        if not self.hw.engine_tensor_overhead:
            return 0.0
        return self.param_tensors * self.hw.engine_tensor_overhead + self.stream(nbytes)

    def offload_seconds(self, nbytes: float) -> float:
        """Moving ``nbytes`` of one device's resident states to host memory and back."""
        return 2 * nbytes / self.hw.host_bandwidth

    # ------------------------------------------------------------ training / inference
    @property
    def param_tensors(self) -> int:
        """Weight tensors of a Llama-style model: 9 per decoder layer, embeddings, final norm, head."""
        return self.model.layers * 9 + 3

    def forward(
        self,
        layout: ModelLayout,
        sequences: int,
        seq_len: int,
        *,
        backward: bool,
        sharded: bool = False,
        mini_batches: int = 1,
    ) -> float:
        """Forward (x3 with backward) of ``sequences`` on one model in its layout, in ``mini_batches`` steps.

        ``sharded`` (a trainable model over dp > 1, FSDP): every micro-batch all-gathers each layer's
        weights (and in a train step gathers them again and reduce-scatters their gradients), paying what its
        compute cannot hide (`fsdp_exposed`). Split into pipeline stages (pp > 1): `pipeline`'s steps, one per
        mini-batch.
        """
        p = layout.parallel
        if p.pp > 1:
            return self.pipeline(
                layout, sequences, seq_len, backward=backward, sharded=sharded, mini_batches=mini_batches
            ).seconds
        per_rank = max(sequences // p.dp, 1)
        micro = max(per_rank // layout.micro_batch, 1)
        flops = per_rank * seq_len * self.model.flops_per_token(seq_len // 2) * (3 if backward else 1)
        efficiency = self.efficiency(min(layout.micro_batch, per_rank) * seq_len, seq_len, p.tp)
        compute = self.matmul(flops, p.tp, efficiency)  # one dp rank's work spread over its tp devices
        tokens_mb = layout.micro_batch * seq_len
        comm = micro * self.tp_pass(tokens_mb, p.tp, self.model.layers, backward, head=True)
        overhead = micro * self.model.layers * self.hw.kernel_overhead * (2 if backward else 1)
        if sharded and p.dp > 1:  # one FSDP unit per decoder layer and the root
            busy = (compute + comm + overhead) / micro  # one micro-batch's work, which hides the prefetches
            comm += micro * self.fsdp_exposed(self.param_bytes / p.tp, self.model.layers + 1, p, busy, backward)
        return compute + comm + overhead

    def fsdp_exposed(self, held: float, units: int, p: Any, busy: float, backward: bool) -> float:
        """The seconds one micro-batch waits on the collectives of a model sharded over ``p.dp`` ranks (FSDP, one
        unit per decoder layer and the root, ``held`` bytes per rank's tp slice), ``busy`` its compute, kernels and
        tensor-parallel work. The forward all-gathers each unit; the backward gathers it again and reduce-scatters
        its gradients (``reshard_after_forward``: three unit-sized collectives per unit in a train step). They run
        on their own stream, the next unit's prefetched while the current one computes (PyTorch FSDP's
        forward/backward prefetch, FSDP2's implicit prefetch; Zhao et al., "PyTorch FSDP", VLDB 2023, sec. 3.3):
        only the first gather, and the part of each unit's collectives its compute cannot cover, stay exposed."""
        gather = self.allreduce(held / units, p.dp, span=p.size) / 2  # one unit's all-gather
        forward = busy / 3 if backward else busy  # a train step's passes: forward 1, backward 2
        exposed = gather + (units - 1) * max(gather - forward / units, 0.0)
        if backward:  # the re-gather and the reduce-scatter against the backward's compute
            exposed += units * max(2 * gather - 2 * forward / units, 0.0)
        return exposed

    def pipeline(
        self,
        layout: ModelLayout,
        sequences: int,
        seq_len: int,
        *,
        backward: bool,
        sharded: bool = False,
        mini_batches: int = 1,
    ) -> PipelineCost:
        """A pass of ``sequences`` through a model cut into ``pp`` stages (`pipeline.py`): per mini-batch, each
        dp rank's m micro-batches flow through the stages as ``layout.schedule`` orders them. Each rank pays
        per micro-batch its layers' FLOPs (the last also the LM head's, and the log-softmax's bytes), its
        kernels, its tensor-parallel collectives, its FSDP gathers and its stage-boundary sends and receives
        (``v`` times as many interleaved); the slowest rank sets the pace."""
        p, v = layout.parallel, layout.virtual_stages
        per_rank_rows = max(sequences // p.dp, 1)
        micro = max(per_rank_rows // layout.micro_batch, 1)
        steps = max(min(mini_batches, micro), 1)
        m = max(micro // steps, 1)
        tokens_mb = min(layout.micro_batch, per_rank_rows) * seq_len
        efficiency = self.efficiency(tokens_mb, seq_len, p.tp)
        passes = 3 if backward else 1
        directions = 2 if backward else 1
        layers = pipe.rank_layers(self.model, p.pp)
        bw, lat = self.link(p.tp * p.pp)
        crossing = tokens_mb * self.model.hidden * BF16 / p.tp / bw + lat  # one boundary, one direction
        compute, p2p = [], []
        for rank in range(p.pp):
            flops = tokens_mb * pipe.rank_flops_per_token(self.model, p.pp, rank, seq_len // 2) * passes
            seconds = self.matmul(flops, p.tp, efficiency)
            seconds += self.tp_pass(tokens_mb, p.tp, layers, backward, head=rank == p.pp - 1)
            seconds += layers * self.hw.kernel_overhead * (2 if backward else 1)
            if rank == p.pp - 1:  # the loss: fp32 logits read and log-probs written (and their gradients)
                seconds += self.stream(tokens_mb * self.model.outputs * FP32 * (5 if backward else 2) / p.tp)
            if sharded and p.dp > 1:  # one FSDP unit per decoder layer and the stage's root
                held = pipe.rank_parameters(self.model, p.pp, rank) * BF16 / p.tp
                seconds += self.fsdp_exposed(held, layers + 1, p, seconds, backward)
            sends = pipe.crossings(p.pp, v, rank) * directions * crossing
            compute.append(seconds)
            p2p.append(sends)
        return PipelineCost(
            schedule=layout.schedule,
            pp=p.pp,
            virtual_stages=v,
            micro_batches=m,
            steps=steps,
            compute=tuple(compute),
            p2p=tuple(p2p),
        )

    def tp_pass(
        self,
        tokens: Any,
        tp: int,
        layers: int,
        backward: bool = False,
        head: bool = False,
        rows: Any = None,
        host: bool = True,
    ) -> Any:
        """The tensor-parallel collectives and host work of one pass over ``tokens`` through ``layers`` split
        ``tp`` ways (Megatron's split, as `flowrl.backends.local.parallelize.tensor` runs it). Forward: per layer the
        attention's and the MLP's row-wise outputs all-reduced, and the embedding's; backward: per layer the
        gradients of the five column-wise inputs (q, k, v, gate, up), and the head's. ``head``: log-probs from
        the vocabulary-sharded logits (three all-reduces of [tokens]); else the logits of ``rows`` (default:
        every token) gathered for the draw. ``host``: with the host work per split module call (not for a
        captured decode graph)."""
        if tp <= 1:
            return 0.0
        act = self.allreduce(tokens * self.model.hidden * BF16, tp)
        reduces = layers * 2 + 1 + ((layers * 5 + 1) if backward else 0)
        if head:
            logits = 3 * self.allreduce(tokens * FP32, tp)
        else:  # an all-gather of the vocabulary slices: half an all-reduce's traffic
            logits = self.allreduce((tokens if rows is None else rows) * self.model.vocab * FP32 / 2, tp)
        work = (layers * 7 + 2) * self.hw.tp_op_overhead * (2 if backward else 1) if host else 0.0
        return reduces * act + logits + work

    def optimizer_step(self, layout: ModelLayout) -> float:
        """Gradient all-reduce over dp (ZeRO-1 reduce-scatter + all-gather) and the AdamW update."""
        p = layout.parallel
        shard = pipe.largest_rank_parameters(self.model, p.pp) / p.tp  # the largest stage's (pp > 1)
        units = self.model.layers // p.pp + 1  # one reduce-scatter per FSDP unit
        grads = self.allreduce(shard * BF16, p.dp, span=p.size) + (units - 1) * p.dp * self.link(p.size)[1] * (p.dp > 1)
        update = self.stream(shard / p.dp * (ADAM_STATE_BYTES * 2 + BF16 * 2))
        offload = 2 * shard / p.dp * ADAM_STATE_BYTES / self.hw.host_bandwidth if layout.offload_optimizer else 0.0
        host = self.param_tensors * self.hw.optimizer_tensor_overhead  # the step's work tensor by tensor
        return grads + update + offload + host

    def sync_volume(self) -> int:
        return self.param_bytes
