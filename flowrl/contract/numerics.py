"""How a backend holds a model, as far as memory goes: the numerics an executor declares and the
planner's memory model (`flowrl.planner.memory`) prices."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from flowrl.contract.checked import CheckedSpec, Count

Bytes = Annotated[int, Meta(ge=0, le=64)]


class Numerics(CheckedSpec, kw_only=True):
    """How a backend holds a model, as far as memory goes. Defaults: bf16 mixed precision with
    fp32 AdamW states, per-layer activation recomputation, flash attention, and generation as
    vLLM does it: continuous batching over a paged KV cache, at most 256 sequences at once per
    replica (vLLM's ``max_num_seqs``), with colocated training states moved to host memory
    while the engine generates when they would crowd out its KV cache (verl's and NeMo-RL's
    sleep mode)."""

    weight_bytes: Annotated[int, Meta(ge=1, le=64)] = 2
    grad_bytes: Bytes = 2
    optimizer_bytes: Bytes = 12  # per parameter: fp32 master weights and two moments
    activation_bytes: Annotated[int, Meta(ge=1, le=64)] = 2
    recompute: bool = True
    eager_attention: bool = False  # keeps heads x seq attention scores per token
    # at most this many sequences decode at once per replica, continuously batched over a paged KV
    # cache; None: a replica decodes all its sequences at once, as one static batch (the local engine)
    decode_batch: Count | None = 256
    # a replica decodes in static batches of at most ``decode_batch`` sequences: each batch until its longest
    # response ends, the next one after it (TensorRT-LLM as NeMo-Aligner drives it, one generate call of
    # ``rollout_micro_batch_size`` prompts at a time per data-parallel rank); False: continuously batched
    static_decode: bool = False
    offload_for_rollout: bool = True  # colocated training states may go to host memory during generation
    reserve: Annotated[float, Meta(ge=0, lt=1)] = (
        0.08  # fraction of device memory kept for the allocator, NCCL and the framework
    )
    # bytes a parameter of the lower-precision copy a model computes with, held while it computes
    # (bfloat16 autocast's casts of float32 weights in one process, FSDP2's gathered bfloat16
    # parameters); 0: it computes with the weights it holds
    compute_copy_bytes: Bytes = 0
    # the training engine samples with the weights it trains (the torch engine), so a colocated
    # rollout it generates holds no second copy of them
    generation_in_place: bool = False
    # a trainable model on several data-parallel devices shards its weights and gradients too (FSDP2,
    # ZeRO-3), gathering a layer's parameters (and holding its unsharded gradient) while it computes;
    # False: only the optimizer states are sharded (ZeRO-1)
    sharded_states: bool = False
    # a sharded model keeps all its layers gathered from a forward to the backward after it (FSDP2's
    # reshard_after_forward=False), and over a mini-batch of several micro-steps their unsharded
    # gradients, reduced once at the last (the torch engine); False: two layers gathered at a time and
    # each micro-batch's gradients reduced as its backward goes
    gather_whole: bool = False

    @property
    def static(self) -> bool:
        """Whether a replica decodes static batches (`decode_batch` None, or `static_decode`)."""
        return self.decode_batch is None or self.static_decode
