"""Pipeline parallelism: a model's decoder layers cut into stages over the pipeline ranks of its device
group, run by ``torch.distributed.pipelining`` (``PipelineStage`` and its GPipe, 1F1B and interleaved
1F1B schedules), as torchtitan's ``pipeline_parallel`` does.

A group of ``pp x dp x tp`` ranks puts the pipeline outermost: rank ``r`` is pipeline rank
``r // (dp x tp)``; the ranks of one pipeline rank form a (dp, tp) mesh of their own (FSDP2 over dp,
DTensor slices over tp, as without stages), and the ranks at one (dp, tp) place of every pipeline
rank form its pipeline group, which passes activations forward and their gradients back.

With ``virtual`` stages per rank (the interleaved schedule) there are ``pp x virtual`` stages; rank
``p`` holds stages ``p, p + pp, ...``. Stage ``s`` computes a contiguous run of the decoder layers
(as even as they split); the first also embeds the tokens, the last applies the final norm and the LM
head (its per-token log-probs of the sampled tokens, from tp vocabulary slices if split) or a scalar
head (values, scores). `split` cuts the model on this rank to the layers it holds, keeping every
parameter's name (a layer keeps its global index), so whole weights, checkpoints and exports name
the same tensors as the one-process model; `Stage` is one stage's computation.

Shapes: a schedule sends activations whose shapes each stage knows before the first micro-batch. Rows
of every call differ in width, so each call (a mini-batch of a train step, a forward pass) builds its
stages and schedule for its own shape: its micro-batches padded to one row count and one width
(`Pipeline.run`). In float32 the shapes are given (no metadata exchange); in bfloat16 torch infers
them at the call's first micro-batch (one forward per stage on empty tensors).

`Pipeline.times` records, per call, how long this rank computed (stage forwards and backwards) and
how long the call took; the rest is time spent waiting on other stages: the bubble
(`PipelineTimes.bubble`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from flowrl.errors import BackendError

SCHEDULES = ("gpipe", "1f1b", "interleaved")


def stages_of(pp_index: int, pp: int, virtual: int) -> list[int]:
    """The stages pipeline rank ``pp_index`` of ``pp`` holds with ``virtual`` stages per rank (looped)."""
    return [pp_index + pp * k for k in range(virtual)]


def layer_ranges(n_layers: int, n_stages: int) -> list[range]:
    """``n_layers`` decoder layers cut into ``n_stages`` contiguous runs whose sizes differ by at most one
    (the first ones larger)."""
    size, extra = divmod(n_layers, n_stages)
    out, at = [], 0
    for s in range(n_stages):
        width = size + (1 if s < extra else 0)
        out.append(range(at, at + width))
        at += width
    return out


def _base(module: nn.Module) -> nn.Module:
    """The decoder (embeddings, layers, norm, rotary embedding) of a causal LM or a `ValueModel`."""
    return getattr(module, "backbone", None) or module.base_model


def check_split(module: nn.Module, pp: int, virtual: int, schedule: str, name: str) -> None:
    """Refuse, by name, a model ``pp x virtual`` stages cannot split: fewer decoder layers than stages,
    a decoder not laid out as Llama's (embeddings, layers, norm, rotary embedding), or an unknown
    schedule. (An LM head tied to the embeddings splits: `TiedWeight`.)"""
    if schedule not in SCHEDULES:
        raise BackendError(f"model '{name}': pipeline schedule '{schedule}' is not one of {', '.join(SCHEDULES)}.")
    if virtual > 1 and schedule != "interleaved":
        raise BackendError(
            f"model '{name}': {virtual} virtual stages per rank need the 'interleaved' schedule, not '{schedule}'."
        )
    base = _base(module)
    missing = [k for k in ("embed_tokens", "layers", "norm", "rotary_emb") if not hasattr(base, k)]
    if missing:
        raise BackendError(
            f"model '{name}' ({type(base).__name__}) has no {', '.join(missing)}: the torch engine cuts only "
            "Llama-style decoders into pipeline stages. Plan it with pp=1."
        )
    n_layers, stages = len(base.layers), pp * virtual
    if n_layers < stages:
        raise BackendError(
            f"model '{name}' has {n_layers} decoder layers, fewer than its {pp} x {virtual} pipeline stages. "
            "Plan a smaller pp (or fewer virtual stages)."
        )


class StageLayers(nn.Module):
    """Some of a decoder's layers, each under its global index (``layers.7.`` stays ``layers.7.``):
    iterated and indexed in order like the ``nn.ModuleList`` it replaces."""

    decoder_stage = True  # `fsdp.decoder_layers` finds these as it finds a ModuleList

    def __init__(self, layers: dict[int, nn.Module]) -> None:
        super().__init__()
        for i, layer in sorted(layers.items()):
            self.add_module(str(i), layer)

    def __iter__(self) -> Any:
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, at: int | slice) -> Any:
        return list(self._modules.values())[at]


class Stage(nn.Module):
    """One pipeline stage of a causal LM or a `ValueModel`: its decoder layers (``layers``), and on the
    first stage the token embeddings, on the last the final norm and head. ``forward(x, attention_mask,
    position_ids, tokens, last)``: ``x`` the token ids (first stage) or the hidden states from the stage
    before; the last stage returns float32 ``output`` per `configure` -- the log-probs of ``tokens``
    (the responses, [B, R]), values [B, R], or scores at each row's ``last`` position [B]; the others
    return hidden states."""

    def __init__(self, module: nn.Module, index: int, count: int, layers: range) -> None:
        super().__init__()
        base = _base(module)
        self.index, self.count = index, count
        self.is_first, self.is_last = index == 0, index == count - 1
        self.scalar = hasattr(module, "backbone")
        self.config = module.config
        self.layers = StageLayers({i: base.layers[i] for i in layers})
        self.rotary_emb = base.rotary_emb
        if self.is_first:
            self.embed_tokens = base.embed_tokens
        if self.is_last:
            self.norm = base.norm
            self.head = module.head if self.scalar else module.lm_head
        self.configure("logprobs", 0, 1.0)

    def configure(self, output: str, start: int, temperature: float) -> None:
        """What the last stage returns for the next call: ``output`` (logprobs, values or scores), read
        from position ``start`` on (the hidden state at t predicts token t + 1), at ``temperature``."""
        self.output, self.start, self.temperature = output, start, temperature

    def forward(self, x: Tensor, attention_mask: Tensor, position_ids: Tensor, tokens: Tensor, last: Tensor) -> Tensor:
        from transformers.masking_utils import create_causal_mask

        hidden = self.embed_tokens(x) if self.is_first else x
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=attention_mask,
            past_key_values=None,
            position_ids=position_ids,
        )
        rotary = self.rotary_emb(hidden, position_ids=position_ids)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=mask, position_embeddings=rotary, position_ids=position_ids,
                           use_cache=False)  # fmt: skip
        if not self.is_last:
            return hidden
        hidden = self.norm(hidden)
        if self.scalar:
            values = self.head(hidden).squeeze(-1).float()
            if self.output == "scores":
                return values.gather(1, last[:, None]).squeeze(1)
            return values[:, self.start : -1]
        from flowrl.backends.local.parallelize.tensor import token_logprobs

        logits = self.head(hidden[:, self.start : -1])  # tensor parallel: a DTensor over the vocabulary
        return token_logprobs(logits, tokens, self.temperature)


def tied_names(module: nn.Module) -> tuple[str, str] | None:
    """The names of ``module``'s token embedding and of the LM head weight tied to it (one parameter under
    two names, as HF's ``tie_word_embeddings`` makes it), or None when the head has a weight of its own."""
    head = getattr(module, "lm_head", None)
    embedding = _base(module).embed_tokens.weight
    if head is None or head.weight is not embedding:
        return None
    names = [n for n, p in module.named_parameters(remove_duplicate=False) if p is embedding]
    head_name = next(n for n in names if n.startswith("lm_head."))
    return next(n for n in names if n != head_name), head_name


@dataclass(frozen=True)
class TiedWeight:
    """An LM head tied to the token embeddings, as Megatron splits it: the first stage holds the embedding
    (``embedding``, its one-process name), the last stage a copy of it as its head weight (``head``),
    initialised equal. After each backward the two copies' gradients are summed over ``group`` (the
    first and last pipeline ranks at one (dp, tp) place) -- both then take the same optimizer step and
    stay equal bit for bit; the gradient norm counts the shared weight once (on the first rank). A
    middle pipeline rank holds neither: ``name`` (this rank's copy) and ``group`` are None there.
    Exports name both, as the one-process state dict does; an HF file stores it once (as
    ``embedding``), which fills the head's copy when loaded."""

    embedding: str
    head: str
    name: str | None
    group: Any

    @property
    def is_copy(self) -> bool:
        """Whether this rank's parameter is the head's copy (not counted in the gradient norm)."""
        return self.name == self.head


def tie_group(pipeline_group: Any, pp: int, index: int) -> Any:
    """The process group of the first and last ranks of ``pipeline_group`` (``pp`` ranks, in stage order;
    this rank is the ``index``-th), made by those two ranks only; None on the others."""
    import torch.distributed as dist

    if pp == 2:
        return pipeline_group
    if index not in (0, pp - 1):
        return None
    ranks = dist.get_process_group_ranks(pipeline_group)
    return dist.new_group([ranks[0], ranks[-1]], use_local_synchronization=True)


def split(module: nn.Module, pp_index: int, pp: int, virtual: int) -> list[Stage]:
    """Cut ``module`` (LoRA'd, tensor-sliced) in place to what pipeline rank ``pp_index`` of ``pp`` holds
    with ``virtual`` stages per rank: its layers (under their global names), the embeddings only on the
    first rank, the final norm and head only on the last (a head tied to the embeddings: a copy of
    them, `TiedWeight`); returns its `Stage` s, in stage order."""
    base = _base(module)
    count = pp * virtual
    if tied_names(module) is not None and pp_index == pp - 1:  # the last rank's own copy, equal at the start
        weight = module.lm_head.weight
        module.lm_head.weight = nn.Parameter(weight.detach().clone(), requires_grad=weight.requires_grad)
    ranges = layer_ranges(len(base.layers), count)
    mine = stages_of(pp_index, pp, virtual)
    stages = [Stage(module, s, count, ranges[s]) for s in mine]
    held = {i for s in mine for i in ranges[s]}
    base.layers = StageLayers({i: base.layers[i] for i in held})
    if 0 not in mine:
        base.embed_tokens = None
    if count - 1 not in mine:
        base.norm = None
        if hasattr(module, "backbone"):
            module.head = None
        else:
            module.lm_head = None
    return stages


@dataclass(frozen=True)
class PipelineGroups:
    """This rank's process groups: ``pipeline`` (its place in every pipeline rank, in stage order),
    ``data`` and ``tensor`` (within its pipeline rank) -- None where that dimension is 1 -- and the
    (dp, tp) ``mesh`` of its pipeline rank's ranks (a DeviceMesh; None when dp = tp = 1)."""

    pipeline: Any
    data: Any
    tensor: Any
    stage_mesh: Any


def groups(group: Any, pp: int, dp: int, tp: int, device_type: str) -> PipelineGroups:
    """The (pp, dp, tp) process groups of ``group``'s ranks (rank ``r`` at ``r // (dp x tp)``,
    ``r // tp % dp``, ``r % tp``): each rank makes the groups it is in, pipeline first (locally
    synchronised: the other ranks take no part)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    ranks = dist.get_process_group_ranks(group)
    grid = torch.tensor(ranks).reshape(pp, dp, tp)
    me = ranks.index(dist.get_rank())
    p, d, t = me // (dp * tp), me // tp % dp, me % tp
    pipe = dist.new_group(grid[:, d, t].tolist(), use_local_synchronization=True) if dp * tp > 1 else group
    data = dist.new_group(grid[p, :, t].tolist(), use_local_synchronization=True) if dp > 1 else None
    tens = dist.new_group(grid[p, d, :].tolist(), use_local_synchronization=True) if tp > 1 else None
    if tp > 1:
        mesh = DeviceMesh.from_group(
            [data if data is not None else dist.new_group(grid[p, :, t].tolist(), use_local_synchronization=True),
             tens], device_type, mesh=grid[p], mesh_dim_names=("dp", "tp"),
        )  # fmt: skip
    elif dp > 1:
        mesh = DeviceMesh.from_group(data, device_type, mesh_dim_names=("dp",))
    else:
        mesh = None
    return PipelineGroups(pipeline=pipe, data=data, tensor=tens, stage_mesh=mesh)


@dataclass
class PipelineTimes:
    """Where one rank's time in pipelined calls went: ``compute`` (its stages' forwards and backwards,
    seconds), ``total`` (the calls' wall time); ``calls`` counted. The rest of ``total`` is waiting on
    other stages (sends, receives): the pipeline bubble, with communication."""

    compute: float = 0.0
    total: float = 0.0
    calls: int = 0

    @property
    def bubble(self) -> float:
        """The fraction of the calls' wall time this rank did not compute (0 when nothing ran)."""
        return max(0.0, 1.0 - self.compute / self.total) if self.total > 0 else 0.0

    def reset(self) -> PipelineTimes:
        """The times so far (a copy); this starts again from zero."""
        done = PipelineTimes(self.compute, self.total, self.calls)
        self.compute = self.total = 0.0
        self.calls = 0
        return done


@dataclass
class Pipeline:
    """A model's stages on this rank and how they run: over the ``group`` (the pipeline ranks' process
    group), ``pp`` ranks of ``virtual`` stages each, by ``schedule``; ``act_dtype`` the dtype of the
    hidden states between stages (None: inferred by torch at each call); ``hidden`` their width."""

    stages: list[Stage]
    group: Any
    pp: int
    index: int
    virtual: int
    schedule: str
    device: torch.device
    hidden: int
    act_dtype: torch.dtype | None
    tied: TiedWeight | None = None  # an LM head tied to the embeddings (None: none)
    times: PipelineTimes = field(default_factory=PipelineTimes)

    def __post_init__(self) -> None:
        for stage in self.stages:  # each stage's forwards count as compute
            stage.register_forward_pre_hook(self._began)
            stage.register_forward_hook(self._ended)

    def _began(self, module: nn.Module, args: Any) -> None:
        module.__dict__["_began"] = time.perf_counter()

    def _ended(self, module: nn.Module, args: Any, out: Any) -> None:
        self.times.compute += time.perf_counter() - module.__dict__.pop("_began", time.perf_counter())

    @property
    def is_last(self) -> bool:
        """Whether this rank holds the last stage (computes the outputs and the losses)."""
        return self.index == self.pp - 1

    def last_rank(self) -> int:
        """The global rank of this rank's pipeline group holding the last stage."""
        import torch.distributed as dist

        return dist.get_global_rank(self.group, self.pp - 1)

    def micro_batches(self, n: int) -> int:
        """The micro-batches a call of ``n`` must run as: 1F1B at least one per stage, interleaved a
        multiple of the pipeline ranks (torch's schedules require them; the others are empty)."""
        if self.schedule == "1f1b":
            return max(n, self.pp)
        if self.schedule == "interleaved":
            return -(-n // self.pp) * self.pp
        return n

    def run(
        self,
        inputs: dict[str, Tensor],
        n_micro: int,
        output: str,
        start: int,
        temperature: float,
        loss: Callable[[Tensor, Tensor], Tensor] | None = None,
        target: Tensor | None = None,
    ) -> Tensor | None:
        """One call over the pipeline: ``inputs`` (``ids``, ``attention_mask``, ``position_ids``,
        ``tokens``, ``last``: [n_micro x rows, ...] each, every micro-batch the same shape) cut into
        ``n_micro`` micro-batches. With ``loss`` (a train step): ``loss(out, target)`` on the last stage
        for each micro-batch (its chunk of ``target``), backpropagated through every stage; gradients
        add up (not averaged over micro-batches). Without: forward only. Returns the last stage's
        outputs, in order ([N, R] or [N]), on the rank holding it; None elsewhere."""
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        ids = inputs["ids"]
        rows, width = ids.shape[0] // n_micro, ids.shape[1]
        out_width = inputs["tokens"].shape[1]
        built = []
        for stage in self.stages:
            stage.configure(output, start, temperature)
            shapes: dict[str, Any] = {}
            if self.act_dtype is not None:  # shapes known: no metadata exchange
                act = torch.empty(rows, width, self.hidden, dtype=self.act_dtype, device="meta")
                grads = act.detach().requires_grad_(loss is not None)  # activations whose gradients go back
                first = torch.empty(rows, width, dtype=ids.dtype, device="meta")
                shapes["input_args"] = (first,) if stage.is_first else (grads,)
                out = (
                    torch.empty(
                        (rows,) if output == "scores" else (rows, out_width), dtype=torch.float32, device="meta"
                    )
                    if stage.is_last
                    else grads
                )
                shapes["output_args"] = (out,)
            built.append(PipelineStage(stage, stage.index, stage.count, self.device, group=self.group, **shapes))
        inferring = [False]  # inside torch's metadata inference (shapes not given: bfloat16)

        def micro_loss(out: Tensor, target: Tensor) -> Tensor:
            if inferring[0]:  # placeholder activations, not a micro-batch: the loss must count nothing
                return out.float().sum() * 0.0
            assert loss is not None
            return loss(out, target)

        kinds = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
        fn = micro_loss if loss is not None else None
        if self.schedule == "interleaved":
            sched = ScheduleInterleaved1F1B(built, n_micro, loss_fn=fn, scale_grads=False)
        else:
            sched = kinds[self.schedule](built[0], n_micro, loss_fn=fn, scale_grads=False)
        for b in built:
            _time_backward(b, self.times)
            _flag_inference(b, inferring)
        kwargs = {k: inputs[k] for k in ("attention_mask", "position_ids", "tokens", "last")}
        args = (ids,) if self.index == 0 else ()
        began = time.perf_counter()
        if loss is None:
            result = sched.eval(*args, **kwargs)
        else:
            result = sched.step(*args, target=target, **kwargs)
        self.times.total += time.perf_counter() - began
        self.times.calls += 1
        return result if self.is_last else None


def _flag_inference(stage: Any, inferring: list[bool]) -> None:
    """Set ``inferring[0]`` while ``stage`` (a ``PipelineStage``) infers its gradients' metadata: torch
    (2.13) then calls the schedule's loss function once on the last stage's output of placeholder
    activations (``torch.empty``) with the first micro-batch's target -- a call that, counted, added a
    garbage loss, share and statistics (``logprob_gap`` among them) to every bfloat16 train step."""
    inner = getattr(stage, "_backward_metadata_inference", None)
    if inner is None:  # a torch without it infers no metadata through the loss
        return

    def flagged(*args: Any, **kwargs: Any) -> Any:
        inferring[0] = True
        try:
            return inner(*args, **kwargs)
        finally:
            inferring[0] = False

    stage._backward_metadata_inference = flagged


def _time_backward(stage: Any, times: PipelineTimes) -> None:
    """Count ``stage``'s (a ``PipelineStage``) backward of each micro-batch as compute in ``times``."""
    inner = stage.backward_one_chunk

    def timed(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            times.compute += time.perf_counter() - began

    stage.backward_one_chunk = timed
