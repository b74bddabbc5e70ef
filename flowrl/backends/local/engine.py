"""The torch engines: a graph model on one device (CPU or one GPU) of one worker.

`LocalModel` is a training engine (forward log-probs / values / scores, train steps with
micro-batch gradient accumulation, grad clipping, AdamW) and, for models that generate, the
generation engine too: sampling then uses the trained weights in place.

On a device group of several ranks (``EngineContext.world > 1``) a trainable model is sharded
with FSDP2 (`fully_shard` per decoder layer and at the root, over the group's process group):
every rank takes its strided share of each mini-batch, all ranks take the same number of
micro-steps, and the averaged gradients equal the one-process gradient of the whole
mini-batch. Frozen models keep a full replica per rank and score their shard of the rows.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch
from torch import Tensor, nn

from flowrl.backends.local import tensor_parallel
from flowrl.backends.local.generation import last_logits_only, sample
from flowrl.backends.local.models import (
    ADAPTER_FILE,
    VALUE_HEAD_FILE,
    ValueModel,
    adapters_off,
    add_lora,
    apply_numerics,
    build_causal_lm,
    build_model,
    load_tokenizer,
    merge_lora,
    model_config,
    same_tokenizer,
    save_hf,
)
from flowrl.backends.local.packing import pack, response_logprobs, response_values
from flowrl.backends.local.tensor_parallel import token_logprobs
from flowrl.data import Prompt, Rollout, Sequences, StepBatch, adds_special_tokens
from flowrl.errors import BackendError
from flowrl.graph.ir import ModelDecl
from flowrl.planner.plan import ModelRun
from flowrl.runtime.batch import position_ids, ragged, select_rows, to_device, trim
from flowrl.runtime.compute import on_compute_thread
from flowrl.runtime.dispatch import micro_batches, padding
from flowrl.runtime.nodes import logprob_gap
from flowrl.runtime.protocols import EngineContext, LossFn, TrainStep
from flowrl.runtime.responses import Response, ResponseRules, prompt_rows, responses_of, to_rollout


def _locked(method: Any) -> Any:
    """``method`` on the process's compute thread (`flowrl.backends.local.compute`), holding the
    engine's lock: one pass at a time over a module that two engines share (a LoRA policy and its
    base, `LoraBase`), from the backward's recomputation to the last token."""

    def locked(self: LocalModel, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            return method(self, *args, **kwargs)

    @functools.wraps(method)
    def run(self: LocalModel, *args: Any, **kwargs: Any) -> Any:
        return on_compute_thread(locked, self, *args, **kwargs)

    return run


def _computes(method: Any) -> Any:
    """``method`` on the process's compute thread (`flowrl.runtime.compute`), without the lock: weight
    copies and checkpoint I/O, which may call one another."""

    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        return on_compute_thread(method, *args, **kwargs)

    return run


class LocalModel:
    """One graph model (actor, critic, reference, ...) held in this process."""

    resumable = True
    # a scalar-head model with a tokenizer of its own: the tokenizer of the rows it receives (None: its own)
    text_tokenizer: Any = None

    def __init__(
        self,
        decl: ModelDecl,
        module: nn.Module,
        tokenizer: Any,
        hf_config: Any,
        spec: ModelRun,
        device: torch.device,
        rank: int = 0,
        world: int = 1,
        group: Any = None,
        offload: bool = False,
        tp: int = 1,
    ) -> None:
        self.decl = decl
        self.rank, self.world = rank, world
        # a dp x tp group: the tp ranks of a row hold one copy between them and compute the same rows
        self.tp, self.dp = tp, world // tp
        self.lock = threading.RLock()
        self.module = module.to(device)
        # LoRA: only the adapters (and a value head) train; the base weights stay as loaded
        self.lora = spec.lora if decl.trainable else None
        if self.lora is not None and tp > 1:
            raise BackendError(
                f"model '{decl.name}' trains LoRA adapters, which the torch engine does not split tensor-parallel "
                f"(its layout has tp {tp}). Plan it with --require {decl.name}.tp=1, or train it without LoRA "
                "(train.lora.rank=0)."
            )
        if self.lora is not None:
            add_lora(self.module, self.lora, spec.seed, decl.name)
        numerics = spec.numerics
        apply_numerics(self.module, numerics.attention, numerics.recompute and decl.trainable, decl.name)
        half = numerics.dtype == "bfloat16"
        self.sharded = self.dp > 1 and decl.trainable
        self.distributed = self.sharded or tp > 1  # its weights are DTensors: whole state dicts are gathered
        # optimizer states in host memory between steps: FSDP2 keeps the shards there (parameters,
        # gradients and states; the step runs on the host), one process moves the states there and back
        self.offload = offload and decl.trainable
        dp_mesh = None
        if tp > 1:
            tensor_parallel.check_splits(hf_config, tp, decl.name)
            grid = tensor_parallel.mesh(group, tp, device.type)
            tensor_parallel.parallelize(self.module, grid["tp"])
            dp_mesh = grid["dp"]
        if self.sharded:  # FSDP2 computes in bfloat16 from float32 shards, and reduces gradients in float32
            _fully_shard(self.module, group, device, half, self.offload, dp_mesh)
        # one process: float32 weights, computed in bfloat16 under autocast (float32 where autocast keeps it)
        self.autocast = half and not self.sharded
        self.tokenizer = tokenizer
        self.hf_config = hf_config
        self.spec = spec
        self.sampling = spec.sampling
        # how responses end and what text rewards see: the rules every generation engine shares
        self.rules = ResponseRules.of(tokenizer, spec.sampling)
        self.context = int(getattr(hf_config, "max_position_embeddings", None) or 1 << 30)  # prompt + response
        self.device = device
        self.version = 0
        self.oom_splits, self.warned_oom = 0, False  # micro-batches split after running out of memory
        # sampling draws on the model's device; a CPU generator cannot drive CUDA sampling
        self.sampler = torch.Generator(device=device).manual_seed(spec.seed) if device.type != "cpu" else None
        self.optimizer: torch.optim.Optimizer | None = None
        opt = spec.optimizer
        if decl.trainable:
            if opt is None:
                raise BackendError(f"model '{decl.name}' is trainable, but its resolved spec has no optimizer.")
            if self.lora is None:
                self.module.requires_grad_(True)  # a copy of a frozen model is trainable here
            trained = [p for p in self.module.parameters() if p.requires_grad]
            self.optimizer = adamw(trained, opt)
        else:
            self.module.requires_grad_(False)
        self.module.eval()

    def __getstate__(self) -> dict[str, Any]:  # a copy (deepcopy) takes a lock of its own
        return {k: v for k, v in vars(self).items() if k != "lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        vars(self).update(state)
        self.lock = threading.RLock()

    def _compute(self) -> Any:
        """The precision forward passes run in: bfloat16 autocast when the model computes in bfloat16
        in one process (FSDP2's mixed-precision policy casts a sharded one), else as the weights are."""
        if self.autocast:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # ------------------------------------------------------------ generation
    def generate(
        self,
        prompts: Sequence[Prompt],
        *,
        n: int,
        greedy: bool,
        generator: torch.Generator,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
    ) -> Rollout:
        """``n`` samples for each prompt (rows grouped by prompt), with their log-probs; ``temperature``
        (evaluation's) instead of the run's sampling temperature."""
        texts = [p.text for p in prompts for _ in range(n)]
        enc = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=adds_special_tokens(prompts))
        index = torch.arange(len(prompts)).repeat_interleave(n)
        start = [Response([], []) for _ in texts]
        return self._continue(
            enc["input_ids"], enc["attention_mask"], index, start, greedy, generator, max_new_tokens, temperature
        )

    def resume(self, rollout: Rollout, *, generator: torch.Generator, max_new_tokens: int | None = None) -> Rollout:
        """Continue the unfinished rows from their prompt and the tokens generated so far."""
        seqs = rollout.sequences
        rows = responses_of(rollout, self.rules)
        return self._continue(
            seqs.prompt_ids, seqs.prompt_mask, seqs.prompt_index, rows, rollout.greedy, generator, max_new_tokens
        )

    @_locked
    def _continue(
        self,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        index: Tensor,
        responses: list[Response],
        greedy: bool,
        generator: torch.Generator,
        chunk: int | None,
        temperature: float | None = None,
    ) -> Rollout:
        """Sample the unfinished rows on, each within its own budget, and end them by the rules of
        `flowrl.runtime.responses` (EOS, stop strings, budget, the model's context)."""
        if self.decl.scalar_head:
            raise BackendError(f"model '{self.decl.name}' has a scalar head and cannot generate.")
        rules, roll = self.rules, self.sampling
        prompts = prompt_rows(prompt_ids, prompt_mask)
        rooms = [self.context - len(p) - len(r.ids) for p, r in zip(prompts, responses)]
        budgets = [rules.budget(len(r.ids), chunk or None, room) for r, room in zip(responses, rooms)]
        todo = [i for i, r in enumerate(responses) if not r.finished and budgets[i] > 0]
        for i, r in enumerate(responses):
            if not r.finished and budgets[i] == 0:  # at its budget or the context's end
                responses[i] = rules.extend(r, [], [], rooms[i])
        if todo:
            rows = [prompts[i] + responses[i].ids for i in todo]
            width = max(len(r) for r in rows)
            ids = ragged(rows, width, self.tokenizer.pad_token_id, torch.long, left=True)
            mask = ragged([[1] * len(r) for r in rows], width, 0, torch.long, left=True)
            with self._compute():
                tokens, logprobs, alive = sample(
                    self.module,
                    ids.to(self.device),
                    mask.to(self.device),
                    max_new_tokens=max(budgets[i] for i in todo),  # each row is cut at its own budget
                    eos_id=self.tokenizer.eos_token_id,
                    pad_id=self.tokenizer.pad_token_id,
                    temperature=temperature or roll.temperature,
                    top_p=roll.top_p,
                    greedy=greedy,
                    ignore_eos=roll.ignore_eos,
                    generator=self.sampler or generator,
                )
            # batches live on the host between nodes
            lengths = alive.sum(-1).long().tolist()
            tokens, logprobs = tokens.cpu().tolist(), logprobs.cpu().tolist()
            for j, i in enumerate(todo):
                k = lengths[j]
                responses[i] = rules.extend(responses[i], tokens[j][:k], logprobs[j][:k], rooms[i])
        pad = self.tokenizer.pad_token_id
        return to_rollout(prompt_ids, prompt_mask, responses, index, version=self.version, greedy=greedy, pad_id=pad)

    @_locked
    def load_weights(self, weights: Mapping[str, Tensor], version: int) -> None:
        self.import_weights(weights)
        self.version = version

    # ------------------------------------------------------------ forward
    def _outputs(self, seqs: Sequences, output: str) -> Tensor:
        """Forward one micro-batch: [B,R] log-probs or values aligned with response tokens, or [B] scores
        (float32, whatever the model computes in)."""
        with self._compute():
            return self._forward(seqs, output).float()

    def _forward(self, seqs: Sequences, output: str) -> Tensor:
        if self.spec.pack and (self.text_tokenizer is None or not self.decl.scalar_head):
            return self._forward_packed(seqs, output)
        ids, mask = seqs.input_ids.to(self.device), seqs.attention_mask.to(self.device)
        pos = position_ids(mask)
        start = seqs.prompt_len - 1  # hidden state at t predicts token t+1
        if self.decl.scalar_head:
            if self.text_tokenizer is not None:
                return self._text_scores(seqs, output)
            values = self.module(ids, mask, pos)
            if output == "scores":  # at each row's last response token, having read it (as HF classifiers pool)
                last = seqs.prompt_len - 1 + seqs.response_lengths
                return values.gather(1, last[:, None].to(self.device)).squeeze(1)
            return values[:, start:-1]  # V(s_t): the state before response token t
        # the LM head on the response positions only (the last of them predicts nothing)
        keep = last_logits_only(self.module, seqs.response_ids.shape[1] + 1)
        logits = self.module(input_ids=ids, attention_mask=mask, position_ids=pos, **keep).logits
        logits = logits[:, :-1] if keep else logits[:, start:-1]  # tensor parallel: sharded over the vocabulary
        return token_logprobs(logits, seqs.response_ids.to(self.device), self.sampling.temperature)

    def _forward_packed(self, seqs: Sequences, output: str) -> Tensor:
        """`_forward` on the rows packed into one row without padding (`flowrl.backends.local.packing`)."""
        packed = pack(seqs)
        ids, pos = packed.input_ids.to(self.device), packed.position_ids.to(self.device)
        if self.decl.scalar_head:
            values = self.module(ids, None, pos)[0]  # [T]
            return values[packed.last.to(self.device)] if output == "scores" else response_values(values, packed)
        # no attention mask and no cache: transformers masks attention within each packed row
        logits = self.module(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
        return response_logprobs(logits, packed, seqs.response_ids, self.sampling.temperature)

    def _text_scores(self, seqs: Sequences, output: str) -> Tensor:
        """[B] scores of rows written by another tokenizer: each row's decoded prompt text plus its
        response text, re-tokenised with this model's tokenizer, scored at its last real token."""
        if output != "scores":
            raise BackendError(
                f"model '{self.decl.name}' has a tokenizer unlike the one that wrote the responses, so it gives "
                f"one score per response (output 'scores'), not per-token {output}; give it a folder with the "
                "actor's tokenizer."
            )
        ids, mask = retokenized(seqs, self.text_tokenizer, self.tokenizer)
        ids, mask = ids.to(self.device), mask.to(self.device)
        values = self.module(ids, mask, position_ids(mask))
        return values.gather(1, last_real(mask)[:, None]).squeeze(1)

    @_locked
    @torch.no_grad()
    def forward(self, seqs: Sequences, output: str, micro_batch: int) -> Tensor:
        """Micro-batches of rows of similar response length, each without the padding it does not
        need; results in the rows' order, [B, R] right-padded with 0 (or [B] scores)."""
        if self.decl.scalar_head and self.text_tokenizer is None:
            _check_ids(self, seqs)
        micro = micro_batch or len(seqs)
        parts = self._micro_batches(seqs, torch.arange(len(seqs)), 1, micro)[0]
        width = seqs.response_ids.shape[1]
        out: Tensor | None = None
        while parts:
            rows = parts.pop(0)
            try:
                part = self._outputs(trim({"s": seqs.select(rows)}, "s")["s"], output).cpu()
            except RuntimeError as err:  # out of memory: the micro-batch again, as two halves
                parts[:0] = self._split(err, rows, f"model '{self.decl.name}' computing {output}")
                continue
            if out is None:
                out = torch.zeros((len(seqs), width) if part.dim() == 2 else (len(seqs),), dtype=part.dtype)
            if part.dim() == 2:
                out[rows, : part.shape[1]] = part
            else:
                out[rows] = part
        assert out is not None
        return out

    def _micro_batches(self, seqs: Sequences, rows: Tensor, world: int, micro: int) -> list[list[Tensor]]:
        """`flowrl.runtime.dispatch.micro_batches` under this model's token budget and packing."""
        return micro_batches(seqs, rows, world, micro, self.spec.max_tokens_per_micro_batch, self.spec.pack)

    # ------------------------------------------------------------ training
    @_locked
    def train(self, loss: LossFn, batch: StepBatch, step: TrainStep) -> dict[str, float]:
        """PPO-style epochs x mini-batches; each mini-batch is one optimizer step accumulated over micro-batches."""
        opt = self.spec.optimizer
        if self.optimizer is None or opt is None:
            raise BackendError(f"node '{step.node}' trains model '{self.decl.name}', which is frozen.")
        seqs: Sequences = batch[step.sequences_key]
        n_rows = len(seqs)
        if n_rows == 0:  # a filter kept no row: a step without an update (the version still counts it)
            self.version += 1
            return {}
        micro = step.micro_batch or n_rows
        stats: dict[str, list[float]] = {}
        skipped, splits_before = 0, self.oom_splits  # optimizer steps skipped for a non-finite gradient
        computed = useful = 0  # tokens the micro-batches computed, and how many of them were not padding
        self.module.train()
        for _ in range(step.epochs):
            order = torch.randperm(n_rows, generator=step.generator)  # the same on every rank
            for mb in order.chunk(step.mini_batches):
                # every rank's micro-batches (similar lengths together): all ranks take as many micro-steps
                shares = self._micro_batches(seqs, mb, self.dp, micro)  # a tp row's ranks take the same rows
                parts, steps = shares[self.rank // self.tp], max(len(p) for p in shares)
                while True:  # a micro-batch whose backward ran out of memory: the mini-batch again, split
                    try:
                        acc = self._accumulate(loss, batch, step, mb, parts, steps)
                        break
                    except _SplitAndRestart as again:
                        parts[again.index : again.index + 1] = again.halves
                if self.tp > 1:  # DTensor slices over the tp mesh beside FSDP shards and whole tensors
                    norm = tensor_parallel.clip_grad_norm(list(self.module.parameters()), opt.grad_clip)
                else:
                    norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), opt.grad_clip)
                norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
                if not math.isfinite(float(norm)):  # the same on every rank: the norm is global
                    if not opt.skip_nonfinite:
                        raise BackendError(
                            f"node '{step.node}': the loss ({acc.loss()}) or its gradient (norm {float(norm)}) is not "
                            f"finite, so model '{self.decl.name}' was not updated. Lower train.lr, check the rewards "
                            "and advantages, or set train.skip_nonfinite=true to skip such steps."
                        )
                    self.optimizer.zero_grad(set_to_none=True)
                    skipped += 1
                    continue
                computed, useful = computed + acc.computed, useful + acc.useful
                for k, v in acc.stats.items():
                    stats.setdefault(k, []).extend(v)
                stats.setdefault("grad_norm", []).append(float(norm))
                # the mini-batch's loss (of this rank's rows, on several ranks); a sum's is its whole
                stats.setdefault("loss", []).append(acc.total if step.unit == "sum" else acc.loss())
                self._optimizer_step()
        self.module.eval()
        self.version += 1
        finite = {k: [x for x in v if math.isfinite(x)] for k, v in stats.items()}  # a skipped step's loss is not
        # over the micro-batches: a mean, a maximum's the largest
        out = {k: max(v) if k.endswith("_max") else sum(v) / len(v) for k, v in finite.items() if v}
        if opt.skip_nonfinite:
            out["skipped"] = float(skipped)
        if self.oom_splits > splits_before:  # micro-batches split after running out of memory
            out["oom_splits"] = float(self.oom_splits - splits_before)
        out["pad_frac"] = 1.0 - useful / computed if computed else 0.0  # padding among the tokens computed
        return out

    def _optimizer_step(self) -> None:
        """AdamW's step; with ``offload`` on a one-process accelerator, its states come from host memory
        for the step and go back after it (FSDP2 steps on the host shards itself)."""
        assert self.optimizer is not None
        host = self.offload and not self.sharded and self.device.type != "cpu"
        if host:
            _move_states(self.optimizer, self.device)
        self.optimizer.step()
        if host:
            _move_states(self.optimizer, torch.device("cpu"))

    def _accumulate(
        self, loss: LossFn, batch: StepBatch, step: TrainStep, mb: Tensor, parts: list[Tensor], steps: int
    ) -> _Accumulated:
        """One mini-batch ``mb``'s gradient, accumulated over this rank's micro-batches ``parts`` (``steps``:
        as many as the rank with the most takes). A micro-batch whose forward runs out of memory is
        split in two where it stands (``parts`` changes); one whose backward does raises
        `_SplitAndRestart` (part of its gradient is already added in)."""
        seqs: Sequences = batch[step.sequences_key]
        whole = share_of(seqs, mb, step.unit)  # seqs live on the host
        self.optimizer.zero_grad(set_to_none=True)
        acc = _Accumulated()
        # FSDP averages gradients over its data-parallel ranks: scale by them so they sum, as one process would
        scale = float(self.dp if self.sharded else 1)
        i = 0
        while i < max(steps, len(parts)):  # one rank splits only unsharded: its step count is its own
            if self.sharded:  # accumulate locally; reduce-scatter once, at the last micro-step
                self.module.set_requires_gradient_sync(i == steps - 1)
            part, weight_on = (parts[i], 1.0) if i < len(parts) else (mb[:1], 0.0)  # a short rank idles
            view = to_device(trim(select_rows(batch, part, len(seqs)), step.sequences_key), self.device)
            where = f"node '{step.node}' training model '{self.decl.name}'"
            try:
                out = self._outputs(view[step.sequences_key], step.output)
                gap: dict[str, float] = {}
                if step.own:  # what the step computes itself: its own outputs, detached
                    view = view.with_columns({**view.columns, **{k: out.detach() for k in step.own}})
                    # the forward it replaces reported how far the sampler's log-probs are from these
                    gap = logprob_gap(out.detach().cpu(), view[step.sequences_key].to("cpu"), self.version)
                value, step_stats = loss(out, view, step.algo)
                step_stats = {**step_stats, **gap}
            except RuntimeError as err:
                parts[i : i + 1] = self._split(err, part, where)
                continue
            # the micro-batch's share of the mini-batch, in what the loss is a mean over: the
            # gradients add up to the whole mini-batch's loss's, for any split
            share = share_of(view[step.sequences_key], None, step.unit) / whole
            try:
                (value * (weight_on * scale * share)).backward()
            except RuntimeError as err:
                halves = self._split(err, part, where)
                self.optimizer.zero_grad(set_to_none=True)
                raise _SplitAndRestart(i, halves) from None
            if weight_on:
                padded, real = padding(view[step.sequences_key], self.spec.pack)
                acc.computed, acc.useful = acc.computed + padded, acc.useful + real
                acc.total, acc.share = acc.total + value.item() * share, acc.share + share
                for k, v in step_stats.items():
                    acc.stats.setdefault(k, []).append(v)
            i += 1
        return acc

    def _split(self, err: RuntimeError, rows: Tensor, where: str) -> list[Tensor]:
        """``rows`` as two halves, to compute again, when ``err`` is an allocation that failed (the
        device's memory, or the host's) -- said once per model on stderr, and counted by the caller;
        ``err`` itself otherwise, or where halves cannot help (one row; a sharded model, whose ranks
        compute their micro-batches in step)."""
        if not out_of_memory(err):
            raise err
        if len(rows) < 2 or self.distributed:
            why = "a single row" if len(rows) < 2 else "one rank of a sharded model (its ranks compute in step)"
            raise BackendError(
                f"{where}: a micro-batch of {len(rows)} row(s) ran out of memory, and it cannot be split "
                f"further ({why}): {str(err).splitlines()[0]}. Lower train.max_tokens_per_micro_batch or "
                "rollout.max_new_tokens, or give the model more memory."
            ) from None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if not self.warned_oom:
            self.warned_oom = True
            print(
                f"flowrl: {where}: a micro-batch of {len(rows)} rows ran out of memory; it is computed again as "
                "two halves (the same result; counted as oom_splits in the node's metrics; said once). "
                "train.max_tokens_per_micro_batch caps micro-batches by tokens.",
                file=sys.stderr,
                flush=True,
            )
        self.oom_splits += 1
        half = (len(rows) + 1) // 2
        return [rows[:half], rows[half:]]

    # ------------------------------------------------------------ weights and state
    @_computes
    def export_weights(self) -> dict[str, Tensor]:
        """A copy of the full weights (a sharded model all-gathers them: every rank of the group calls
        this); a LoRA model's merged into the plain model's (what generation engines load)."""
        state = self._state()
        if self.lora is not None:
            return merge_lora(state, self.lora.alpha / self.lora.rank)
        return state

    def _state(self) -> dict[str, Tensor]:
        """The module's whole state dict on the host, as it is (LoRA adapters apart)."""
        if self.distributed:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            full = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True))
            # gathered tensors are copies already: on the host they are returned as they are (a second copy
            # of the whole model was the weight sync's peak); a tensor the module holds is copied
            held = {tensor_parallel.local(t).untyped_storage().data_ptr() for t in self.module.state_dict().values()}
            return {k: v.detach().to("cpu", copy=v.untyped_storage().data_ptr() in held) for k, v in full.items()}
        return {k: v.detach().to("cpu", copy=True) for k, v in self.module.state_dict().items()}

    @_computes
    def export_local_shards(self) -> dict[str, Tensor]:
        """This rank's tensor-parallel slices of the weights (`tensor_parallel.local_shards`: gathered over
        data parallel, never over tp); every rank of the group calls this."""
        if self.lora is not None:
            raise BackendError(f"model '{self.decl.name}' trains LoRA adapters; it exports whole merged weights.")
        return tensor_parallel.local_shards(self.module)

    @_locked
    def load_local_shards(self, shards: Mapping[str, Tensor], version: int) -> None:
        """Take `export_local_shards` of a model split the same way over the same tp ranks, in place."""
        tensor_parallel.load_local_shards(self.module, dict(shards))
        self.version = version

    @_computes
    def import_weights(self, weights: Mapping[str, Tensor]) -> None:
        if self.lora is not None:
            raise BackendError(
                f"model '{self.decl.name}' trains LoRA adapters; its weights are its base model's plus them, and "
                "cannot be replaced by full weights."
            )
        if self.distributed:  # each rank keeps its pieces (tp slices, FSDP2 shards) of the whole weights
            missing = _untied_keys(self.module) - set(weights)
            if missing:
                raise BackendError(f"weights for model '{self.decl.name}' lack {sorted(missing)[:3]}.")
            tensor_parallel.load_whole(self.module, dict(weights))
            return
        self.module.load_state_dict(dict(weights))

    @_computes
    def save_state(self, path: Path) -> None:
        """Everything to resume this model into ``path`` (every rank calls this; the first writes):
        the HF checkpoint, the optimizer state (safetensors + JSON) and the version."""
        from flowrl.runtime.checkpoint import save_tree

        weights = self.export_weights()
        bad = [k for k, v in weights.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
        if bad:
            raise BackendError(
                f"model '{self.decl.name}' holds non-finite weights ({bad[0]}"
                f"{f' and {len(bad) - 1} more' if len(bad) > 1 else ''}); no checkpoint is written from them."
            )
        optimizer = self._optimizer_state()
        trained = self._trained_state() if self.lora is not None else None
        self.save(path, weights)
        if self.rank != 0:
            return
        if trained is not None:  # what resuming needs: the base comes from its own folder (or seed)
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in trained.items()}, str(path / ADAPTER_FILE))
        if optimizer is not None:
            save_tree(path / "optimizer", optimizer)
        (path / "engine.json").write_text(msgspec.json.encode({"version": self.version}).decode())

    @_computes
    def load_state(self, path: Path) -> int:
        """Restore what `save_state` wrote (each rank keeps its shard); returns the version."""
        from safetensors.torch import load_file

        if self.lora is not None:
            return self._load_adapter_state(path)
        try:
            version = int(msgspec.json.decode((path / "engine.json").read_bytes())["version"])
            weights = load_file(str(path / "model.safetensors"))
            if isinstance(self.module, ValueModel):
                weights = {f"backbone.{k}": v for k, v in weights.items()}
                weights |= {f"head.{k}": v for k, v in load_file(str(path / VALUE_HEAD_FILE)).items()}
        except Exception as exc:
            raise BackendError(
                f"checkpoint of model '{self.decl.name}' in '{path}' is unreadable: {type(exc).__name__}: {exc}."
            ) from None
        expected = _untied_keys(self.module)
        missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - set(self.module.state_dict()))
        if missing or unexpected:
            raise BackendError(
                f"checkpoint of model '{self.decl.name}' in '{path}' does not fit the model: missing "
                f"{missing[:3]}, unexpected {unexpected[:3]}."
            )
        return self._restore(weights, path, version)

    def _trained_names(self) -> set[str]:
        """The parameters a LoRA model trains: its adapters, and a value head."""
        return {n for n, p in self.module.named_parameters() if p.requires_grad}

    def _trained_state(self) -> dict[str, Tensor]:
        """What a LoRA model trains, full on every rank."""
        names = self._trained_names()
        return {k: v for k, v in self._state().items() if k in names}

    def _load_adapter_state(self, path: Path) -> int:
        """Restore a LoRA model's adapters (its base is rebuilt as at the start) and optimizer state."""
        from safetensors.torch import load_file

        try:
            version = int(msgspec.json.decode((path / "engine.json").read_bytes())["version"])
            adapter = load_file(str(path / ADAPTER_FILE))
        except Exception as exc:
            raise BackendError(
                f"checkpoint of model '{self.decl.name}' in '{path}' has no readable LoRA adapters "
                f"({ADAPTER_FILE}): {type(exc).__name__}: {exc}. Was it written with train.lora.rank=0?"
            ) from None
        names = self._trained_names()
        if set(adapter) != names:
            raise BackendError(
                f"the LoRA adapters in '{path / ADAPTER_FILE}' do not fit model '{self.decl.name}' as configured "
                f"(train.lora rank / target_modules): missing {sorted(names - set(adapter))[:3]}, unexpected "
                f"{sorted(set(adapter) - names)[:3]}."
            )
        return self._restore(adapter, path, version)

    def _restore(self, weights: Mapping[str, Tensor], path: Path, version: int) -> int:
        """Load ``weights`` (all or part of the module's, full on every rank) and the optimizer state in
        ``path``; the engine is at ``version`` again."""
        from flowrl.runtime.checkpoint import load_tree

        if self.distributed:
            tensor_parallel.load_whole(self.module, dict(weights))
        else:
            self.module.load_state_dict(weights, strict=False)
        if self.optimizer is not None:  # a trainable model's checkpoint always holds its optimizer state
            self._load_optimizer_state(load_tree(path / "optimizer"))
        self.version = version
        return version

    def _optimizer_state(self) -> dict[str, Any] | None:
        if self.optimizer is None:
            return None
        if self.distributed:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

            return get_optimizer_state_dict(self.module, self.optimizer, options=StateDictOptions(full_state_dict=True))
        return self.optimizer.state_dict()

    def _load_optimizer_state(self, state: dict[str, Any]) -> None:
        assert self.optimizer is not None
        if self.distributed:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            sharded = tensor_parallel.sharded_optimizer_state(self.module, state)
            set_optimizer_state_dict(
                self.module, self.optimizer, sharded, options=StateDictOptions(full_state_dict=False)
            )
        else:
            self.optimizer.load_state_dict(state)

    @_computes
    def save(self, path: Path, weights: Mapping[str, Tensor] | None = None) -> None:
        """An HF checkpoint, written by the group's first rank (every rank calls this)."""
        if weights is None and (self.distributed or self.lora is not None):
            weights = self.export_weights()
        if self.rank != 0:
            return
        path.mkdir(parents=True, exist_ok=True)
        module = self.module
        if self.distributed or self.lora is not None:  # a plain copy holding the full (merged) weights
            assert weights is not None
            module = _unsharded_copy(self, weights)
        if isinstance(module, ValueModel):
            module.save(path)
        else:
            save_hf(module, path)
        self.tokenizer.save_pretrained(path)


class LoraBase(LocalModel):
    """A frozen model that is a LoRA-trained model's base -- a reference policy initialised from it, in
    one process: the trained model's own module with its adapters switched off for each pass, so the
    base weights are held once. Both engines take the module's lock for each pass."""

    def __init__(self, decl: ModelDecl, source: LocalModel, spec: ModelRun) -> None:
        vars(self).update(vars(source))  # the module, tokenizer, device and lock are the trained model's
        self.decl, self.spec, self.sampling = decl, spec, spec.sampling
        self.rules = ResponseRules.of(self.tokenizer, spec.sampling)
        self.lora, self.optimizer, self.version, self.trained = None, None, 0, source

    def _compute(self) -> Any:
        stack = contextlib.ExitStack()
        stack.enter_context(adapters_off(self.module))
        stack.enter_context(super()._compute())
        return stack

    @_computes
    def export_weights(self) -> dict[str, Tensor]:
        return merge_lora(self.trained._state(), 0.0)  # the base: the adapters count nothing

    @_computes
    def import_weights(self, weights: Mapping[str, Tensor]) -> None:
        raise BackendError(
            f"model '{self.decl.name}' is the base of LoRA-trained model '{self.trained.decl.name}' (their weights "
            "are held once); it takes no other weights."
        )


class _Accumulated:
    """What one mini-batch's micro-steps on this rank added up: the loss weighed by each micro-batch's
    share (``total``) and the shares, the loss's own stats, and the tokens computed / not padding."""

    def __init__(self) -> None:
        self.total = self.share = 0.0
        self.computed = self.useful = 0
        self.stats: dict[str, list[float]] = {}

    def loss(self) -> float:
        return self.total / (self.share or 1.0)


class _SplitAndRestart(Exception):
    """A micro-batch's backward ran out of memory: take the mini-batch again with it as ``halves``."""

    def __init__(self, index: int, halves: list[Tensor]) -> None:
        super().__init__(index)
        self.index, self.halves = index, halves


def out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is a failed allocation: the GPU's (``torch.OutOfMemoryError``) or the host
    allocator's (``DefaultCPUAllocator: can't allocate memory``, under a memory limit)."""
    text = str(err)
    return isinstance(err, torch.OutOfMemoryError) or "can't allocate memory" in text or "out of memory" in text


def share_of(seqs: Sequences, rows: Tensor | None, unit: str) -> float:
    """How much of a loss ``rows`` of ``seqs`` (None: all) make, in ``unit`` (flowrl.specs.LOSS_UNITS):
    their sampled tokens (a token mean), their number (a mean over rows), or 1 (a sum); at least 1."""
    if unit == "sum":
        return 1.0
    if unit == "seq-mean":
        return float(len(seqs) if rows is None else len(rows)) or 1.0
    mask = seqs.sampled_mask if rows is None else seqs.sampled_mask[rows]
    return max(float(mask.sum()), 1.0)


def retokenized(seqs: Sequences, source: Any, tokenizer: Any) -> tuple[Tensor, Tensor]:
    """``tokenizer``'s ids and attention mask of each row's text: its prompt decoded by ``source``
    (the tokenizer that wrote the rows; special tokens dropped) followed by its response text
    (``seqs.texts``, what rewards see), with ``tokenizer``'s own special tokens (BOS)."""
    prompts = [
        source.decode(row[m.bool()].tolist(), skip_special_tokens=True)
        for row, m in zip(seqs.prompt_ids, seqs.prompt_mask)
    ]
    enc = tokenizer([p + t for p, t in zip(prompts, seqs.texts)], return_tensors="pt", padding=True)
    return enc["input_ids"], enc["attention_mask"]


def last_real(mask: Tensor) -> Tensor:
    """[B] the index of each row's last real (mask 1) token, for left or right padding."""
    positions = torch.arange(mask.shape[1], device=mask.device)
    return (positions * mask.long()).argmax(-1)


def _check_ids(engine: LocalModel, seqs: Sequences) -> None:
    """A scalar-head model refuses ids beyond its vocabulary (rows another tokenizer wrote) by name."""
    vocab = getattr(engine.hf_config, "vocab_size", None)
    top = max((int(t.max()) for t in (seqs.prompt_ids, seqs.response_ids) if t.numel()), default=-1)
    if isinstance(vocab, int) and top >= vocab:
        raise BackendError(
            f"model '{engine.decl.name}' received token id {top}, beyond its vocabulary ({vocab}): the "
            "responses come from a model with another tokenizer. Declare it init_from that model in the graph "
            "(g.model(..., init_from='actor')) so it re-tokenises their text, or give it the actor's tokenizer."
        )


def _untied_keys(module: nn.Module) -> set[str]:
    """State-dict keys, less those sharing storage with an earlier key (tied weights, stored once)."""
    keys, seen = set(), set()
    for key, value in module.state_dict().items():
        local = tensor_parallel.local(value)
        if local.numel() and local.data_ptr() in seen:
            continue
        seen.add(local.data_ptr())
        keys.add(key)
    return keys


def adamw(params: list[nn.Parameter], opt: Any) -> torch.optim.AdamW:
    """AdamW over ``params`` with the spec's settings: torch's fused kernel where the parameters allow it
    (CPU and CUDA, plain or FSDP2-sharded) -- on CPU 6-8x faster than the per-tensor loop torch picks by
    default, the same update within rounding -- else that loop."""
    settings = {"lr": opt.lr, "betas": opt.betas, "weight_decay": opt.weight_decay}
    groups = _by_mesh(params)
    try:
        return torch.optim.AdamW(groups, **settings, fused=True)
    except (RuntimeError, ValueError):  # a device or dtype the fused kernel does not take
        return torch.optim.AdamW(groups, **settings)


def _by_mesh(params: list[nn.Parameter]) -> list[dict[str, Any]]:
    """``params`` as optimizer parameter groups of one kind each -- the DTensors of one device mesh
    (tensor-parallel slices, FSDP2 shards), the plain tensors -- which a fused or foreach kernel takes
    at once; a single group (as before) when all are of one kind."""
    groups: dict[Any, list[nn.Parameter]] = {}
    for p in params:
        groups.setdefault(getattr(p, "device_mesh", None), []).append(p)
    return [{"params": ps} for ps in groups.values()]


def _move_states(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Every tensor of ``optimizer``'s state onto ``device`` (the step counts stay where they are)."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, Tensor) and key != "step":
                state[key] = value.to(device, non_blocking=True)


def _fully_shard(
    module: nn.Module, group: Any, device: torch.device, half: bool = False, offload: bool = False, mesh: Any = None
) -> None:
    """FSDP2 over ``group`` (or over ``mesh``, the data-parallel dimension of a tensor-parallel group):
    each decoder layer one unit, the rest (embeddings, head) the root; with ``half``, float32 shards
    computed in bfloat16 and gradients reduced in float32; with ``offload``, the shards (and so the
    gradients and optimizer states) kept in host memory (`CPUOffloadPolicy`)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    mesh = mesh if mesh is not None else DeviceMesh.from_group(group, device.type)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if half else None
    kwargs: dict[str, Any] = {"mp_policy": policy} if policy is not None else {}
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
        module.to("cpu")
    layers = next((m for n, m in module.named_modules() if n.endswith("layers") and isinstance(m, nn.ModuleList)), ())
    # parameters stay gathered from a forward until the backward after it: a forward-only loop (scoring)
    # gathers once, and a train step gathers once per mini-batch (gradients are reduced at its last micro-step)
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=False, **kwargs)
    fully_shard(module, mesh=mesh, reshard_after_forward=False, **kwargs)


def _unsharded_copy(engine: LocalModel, weights: Mapping[str, Tensor]) -> nn.Module:
    lm = build_causal_lm(None, engine.hf_config, engine.spec.seed)
    module = ValueModel(lm) if engine.decl.scalar_head else lm
    module.load_state_dict(dict(weights))
    return module


# ------------------------------------------------------------ factories (registered as engine "local")


@_computes
def training_engine(ctx: EngineContext) -> LocalModel:
    """A graph model in this process: its checkpoint folder (or a fresh tiny model), or a copy of
    the model it initialises from when that starts from the same folder, with a scalar head for
    critic/reward/cost roles (`build_model`: a trained head when the folder has one). A scalar-head
    model whose folder's tokenizer differs from its source's re-tokenises the rows' text."""
    spec, source = ctx.spec, ctx.source
    writer = None  # the tokenizer of the rows this model reads, when it is not the model's own
    if source is not None and getattr(getattr(source, "spec", None), "checkpoint", None) != spec.checkpoint:
        writer, source = source.tokenizer, None  # a folder of its own (--model NAME=DIR)
    if source is None:
        tokenizer = load_tokenizer(spec.checkpoint)
        hf_config = model_config(spec.checkpoint, spec.tiny, tokenizer)
        module = build_model(spec.checkpoint, hf_config, spec.seed, ctx.decl.scalar_head, ctx.decl.name)
    elif _is_lora_base(ctx, source):
        return LoraBase(ctx.decl, source, spec)
    else:
        tokenizer, hf_config = source.tokenizer, source.hf_config
        lm = _lm_copy(source)
        module = ValueModel(lm) if ctx.decl.scalar_head else lm
    engine = LocalModel(
        ctx.decl, module, tokenizer, hf_config, spec, torch.device(ctx.device), ctx.rank, ctx.world, ctx.group,
        offload=ctx.offload, tp=ctx.tp,
    )  # fmt: skip
    if writer is not None and not same_tokenizer(writer, tokenizer):
        if not ctx.decl.scalar_head or ctx.decl.role == "critic":
            raise BackendError(
                f"model '{ctx.decl.name}' (role {ctx.decl.role}): the tokenizer in '{spec.checkpoint}' differs from "
                f"that of '{ctx.decl.init_from}', whose tokens it reads; its per-token outputs would not line up with "
                "them. Give it a folder with the same tokenizer (a reward or cost model may differ: it re-tokenises "
                "the text)."
            )
        engine.text_tokenizer = writer
    return engine


@_computes
def generation_engine(ctx: EngineContext) -> LocalModel:
    """Generation on a separate local copy of the training engine's model (when another
    training engine trains it, or it samples in another layout); weights arrive through
    `load_weights` after each step. With ``ctx.tp`` > 1 the copy is split tensor-parallel over the
    ``ctx.world`` ranks of ``ctx.group`` (one generation replica), each rank its slice of the weights."""
    source = ctx.source
    module = build_causal_lm(None, source.hf_config, ctx.spec.seed)
    engine = LocalModel(
        msgspec.structs.replace(ctx.decl, trainable=False),
        module,
        source.tokenizer,
        source.hf_config,
        msgspec.structs.replace(ctx.spec, optimizer=None),
        torch.device(ctx.device),
        ctx.rank,
        ctx.world,
        ctx.group,
        tp=ctx.tp,
    )
    engine.load_weights(source.export_weights(), source.version)
    return engine


def _is_lora_base(ctx: EngineContext, source: Any) -> bool:
    """Whether the model is a frozen LM initialised from a LoRA-trained model of this process (one rank):
    the trained model's base, held once (`LoraBase`)."""
    return (
        isinstance(source, LocalModel)
        and source.lora is not None
        and not ctx.decl.trainable
        and not ctx.decl.scalar_head
        and ctx.world == 1
        and source.world == 1
        and torch.device(ctx.device) == source.device
    )


def _lm_copy(source: Any) -> nn.Module:
    """A copy of ``source``'s causal LM: a LoRA-trained one as a plain model holding its merged weights."""
    module = getattr(source, "module", None)
    if not isinstance(module, nn.Module):
        raise BackendError(
            f"model '{source.decl.name}' is held by another engine; the local training engine copies only local models."
        )
    if isinstance(module, ValueModel):
        raise BackendError("a model cannot initialise from a critic/reward model (it has no LM head).")
    if getattr(source, "lora", None) is not None:
        plain = build_causal_lm(None, source.hf_config, source.spec.seed)
        plain.load_state_dict(source.export_weights())
        return plain.to(source.device)
    return copy.deepcopy(module)
