"""The torch engine: a graph model on one device (CPU or one GPU) of one worker.

`LocalModel` is a training engine (forward log-probs / values / scores, train steps: `training`;
weights and checkpoints: `weights`) and, for models that generate, the generation engine too:
sampling then uses the trained weights in place. It runs over whatever module it is handed, made
ready by `flowrl.backends.local.parallelize` (tensor parallelism, FSDP2, recomputation, precision,
LoRA, offload); `flowrl.backends.local.factories` builds engines from an `EngineContext`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from flowrl.backends.local.generation import last_logits_only, sample
from flowrl.backends.local.packing import pack, response_logprobs, response_values, score_index
from flowrl.backends.local.parallelize import Parallelized, precision
from flowrl.backends.local.parallelize.lora import MergedCopy, adapters_off, merge_lora
from flowrl.backends.local.parallelize.tensor import token_logprobs
from flowrl.backends.local.staged import Staged
from flowrl.backends.local.threads import _computes, _locked
from flowrl.backends.local.training import Training, adamw
from flowrl.backends.local.weights import Weights
from flowrl.contract.data import Prompt, Rollout, Sequences, adds_special_tokens
from flowrl.contract.protocols import DataRank
from flowrl.contract.resolved import ModelRun
from flowrl.contract.responses import Response, ResponseRules, prompt_rows, responses_of, to_rollout
from flowrl.errors import BackendError
from flowrl.graph.ir import ModelDecl
from flowrl.runtime.batch import position_ids, ragged, trim
from flowrl.runtime.dispatch import draw_seed, micro_batches


def on_device(generator: torch.Generator | None, device: torch.device) -> torch.Generator | None:
    """What sampling on ``device`` draws from: the caller's host ``generator`` on the CPU; elsewhere a
    generator on the device (a host generator cannot drive device sampling) seeded from it, so that the
    caller's seed decides the draws there too -- each generation replica draws its own numbers (its seed
    differs), and a resumed run draws what the uninterrupted one did."""
    if generator is None or device.type == "cpu":
        return generator
    return torch.Generator(device=device).manual_seed(draw_seed(generator))


class LocalModel(Training, Weights, Staged):
    """One graph model (actor, critic, reference, ...) held in this process."""

    resumable = True
    # a scalar-head model with a tokenizer of its own: the tokenizer of the rows it receives (None: its own)
    text_tokenizer: Any = None

    def __init__(
        self, decl: ModelDecl, model: Parallelized, tokenizer: Any, hf_config: Any, spec: ModelRun, device: torch.device
    ) -> None:
        """``model``: the module as `flowrl.backends.local.parallelize.parallelize` made it ready (split,
        sharded, adapted) and what the engine does around it; see `factories` for how one is built."""
        self.decl = decl
        self.dims = model.dims
        self.rank, self.world = model.dims.rank, model.dims.world
        self.lock = threading.RLock()
        self.module = model.module
        # LoRA: only the adapters (and a value head) train; the base weights stay as loaded
        self.lora = model.spec.lora
        self.sharded = model.sharded
        self.distributed = model.distributed  # its weights are DTensors: whole state dicts are gathered
        # optimizer states in host memory between steps (FSDP2's shards live there; one process moves them)
        self.offload, self.host_optimizer = model.spec.offload, model.host_optimizer
        self.autocast = model.autocast  # one process computing in bfloat16: forward passes under autocast
        self.pipeline = model.pipeline  # pipeline stages on this rank (`Staged` runs passes over them)
        self.merged: MergedCopy | None = None  # what a LoRA model under autocast samples from (`_sampling_module`)
        self.tokenizer = tokenizer
        self.hf_config = hf_config
        self.spec = spec
        self.sampling = spec.sampling
        # how responses end and what text rewards see: the rules every generation engine shares
        self.rules = ResponseRules.of(tokenizer, spec.sampling)
        self.context = int(getattr(hf_config, "max_position_embeddings", None) or 1 << 30)  # prompt + response
        self.device = device
        self.version = 0
        self.restores = 0  # checkpoints loaded (`Weights._restore`)
        self.oom_splits, self.warned_oom = 0, False  # micro-batches split after running out of memory
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

    @property
    def tp(self) -> int:
        """The ranks the model is split over tensor-parallel."""
        return self.dims.tensor

    @property
    def dp(self) -> int:
        """The data-parallel ranks (rows of ``tp`` ranks) the group's rows split over."""
        return self.dims.data

    def data_rank(self) -> DataRank:
        """Which share of a call's rows this rank computes: its data-parallel row (the ranks of a row,
        split tensor-parallel, compute the same rows)."""
        return DataRank(index=self.dims.data_index, count=self.dims.data)

    def shard_layout(self) -> str | None:
        """How `export_local_shards` cuts the weights: the torch engine's tensor-parallel slices (`parallelize.tensor`)
        over ``tp`` ranks; None when the model is whole on each rank or trains LoRA adapters (merged whole)."""
        return (
            f"torch-tp{self.dims.tensor}"
            if self.dims.tensor > 1 and self.lora is None and self.dims.pipeline == 1
            else None
        )

    def __getstate__(self) -> dict[str, Any]:  # a copy (deepcopy) takes a lock of its own
        return {k: v for k, v in vars(self).items() if k != "lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        vars(self).update(state)
        self.lock = threading.RLock()

    def _compute(self) -> Any:
        """The precision forward passes run in (`parallelize.precision.autocast`)."""
        return precision.autocast(self.autocast, self.device)

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
        `flowrl.contract.responses` (EOS, stop strings, budget, the model's context)."""
        if self.decl.scalar_head:
            raise BackendError(f"model '{self.decl.name}' has a scalar head and cannot generate.")
        if self.pipeline is not None:
            raise BackendError(
                f"model '{self.decl.name}' is split into pipeline stages (pp {self.dims.pipeline}) and never samples "
                "in place; it generates on its plan's generation layout, from its exported weights."
            )
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
                    self._sampling_module(),
                    ids.to(self.device),
                    mask.to(self.device),
                    max_new_tokens=max(budgets[i] for i in todo),  # each row is cut at its own budget
                    eos_id=self.tokenizer.eos_token_id,
                    pad_id=self.tokenizer.pad_token_id,
                    temperature=temperature or roll.temperature,
                    top_p=roll.top_p,
                    greedy=greedy,
                    ignore_eos=roll.ignore_eos,
                    generator=on_device(generator, self.device),
                )
            # batches live on the host between nodes
            lengths = alive.sum(-1).long().tolist()
            tokens, logprobs = tokens.cpu().tolist(), logprobs.cpu().tolist()
            for j, i in enumerate(todo):
                k = lengths[j]
                responses[i] = rules.extend(responses[i], tokens[j][:k], logprobs[j][:k], rooms[i])
        pad = self.tokenizer.pad_token_id
        return to_rollout(prompt_ids, prompt_mask, responses, index, version=self.version, greedy=greedy, pad_id=pad)

    def _sampling_module(self) -> nn.Module:
        """What generation samples from: the module, or for a LoRA model computing under bfloat16 autocast in
        one process its `MergedCopy` (made at the first generation, merged again only after the weights
        changed), whose linear weights autocast does not cast again at every decode step."""
        if self.lora is None or not self.autocast or self.sharded or self.distributed or self.decl.scalar_head:
            return self.module
        if self.merged is None:
            self.merged = MergedCopy(self.module, torch.bfloat16)
        # the weights change only by a train step (the version counts them) or a checkpoint load (`restores`)
        return self.merged.refresh(self.lora.alpha / self.lora.rank, (self.version, self.restores))

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
            if output == "scores":  # at each row's last token that is not padding, having read it (as HF pools)
                last = score_index(ids, mask, self.tokenizer.pad_token_id)
                return values.gather(1, last[:, None]).squeeze(1)
            return values[:, start:-1]  # V(s_t): the state before response token t
        # the LM head on the response positions only (the last of them predicts nothing)
        keep = last_logits_only(self.module, seqs.response_ids.shape[1] + 1)
        logits = self.module(input_ids=ids, attention_mask=mask, position_ids=pos, **keep).logits
        logits = logits[:, :-1] if keep else logits[:, start:-1]  # tensor parallel: sharded over the vocabulary
        return token_logprobs(logits, seqs.response_ids.to(self.device), self.sampling.temperature)

    def _forward_packed(self, seqs: Sequences, output: str) -> Tensor:
        """`_forward` on the rows packed into one row without padding (`flowrl.backends.local.packing`)."""
        packed = pack(seqs, self.tokenizer.pad_token_id if self.decl.scalar_head else None)
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
        return values.gather(1, score_index(ids, mask, self.tokenizer.pad_token_id)[:, None]).squeeze(1)

    @_locked
    @torch.no_grad()
    def forward(self, seqs: Sequences, output: str, micro_batch: int) -> Tensor:
        """Micro-batches of rows of similar response length, each without the padding it does not
        need; results in the rows' order, [B, R] right-padded with 0 (or [B] scores)."""
        if self.decl.scalar_head and self.text_tokenizer is None:
            _check_ids(self, seqs)
        micro = micro_batch or len(seqs)
        if self.pipeline is not None:
            return self._forward_staged(seqs, output, micro)
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

    def _micro_batches(
        self, seqs: Sequences, rows: Tensor, world: int, micro: int, group: int = 1
    ) -> list[list[Tensor]]:
        """`flowrl.runtime.dispatch.micro_batches` under this model's token budget and packing (``group``
        consecutive rows kept together: a loss over pairs)."""
        spec = self.spec
        return micro_batches(seqs, rows, world, micro, spec.max_tokens_per_micro_batch, spec.pack, group)


class LoraBase(LocalModel):
    """A frozen model that is a LoRA-trained model's base -- a reference policy initialised from it, in
    one process: the trained model's own module with its adapters switched off for each pass, so the
    base weights are held once. Both engines take the module's lock for each pass."""

    def __init__(self, decl: ModelDecl, source: LocalModel, spec: ModelRun) -> None:
        vars(self).update(vars(source))  # the module, tokenizer, device and lock are the trained model's
        self.decl, self.spec, self.sampling = decl, spec, spec.sampling
        self.rules = ResponseRules.of(self.tokenizer, spec.sampling)
        self.lora, self.optimizer, self.version, self.trained = None, None, 0, source
        self.merged = None  # it samples from the module itself, its adapters off

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
