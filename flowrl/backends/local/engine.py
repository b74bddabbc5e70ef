"""The local torch backend: every model in this process, on one device (CPU or one GPU).

`LocalModel` is both the generation engine (batched sampling with log-probs) and the
training engine (forward log-probs / values / scores, train steps with micro-batch gradient
accumulation, grad clipping, AdamW) for one graph model.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from flowrl.backends.local.generation import sample
from flowrl.backends.local.models import ValueModel, build_causal_lm, load_tokenizer, model_config
from flowrl.errors import BackendError
from flowrl.graph.ir import Graph, ModelDecl
from flowrl.planner.plan import ExecutionPlan
from flowrl.plugins.manager import Entry
from flowrl.runtime.batch import Sequences, position_ids, select_rows, to_device
from flowrl.specs import AlgoConfig
from flowrl.tasks.builtin import Prompt


class LocalModel:
    """One graph model (actor, critic, reference, ...) held in this process."""

    def __init__(self, decl: ModelDecl, module: nn.Module, tokenizer: Any, plan: ExecutionPlan, device: torch.device) -> None:
        self.decl = decl
        self.module = module.to(device)
        self.tokenizer = tokenizer
        self.cfg = plan.config
        self.device = device
        self.version = 0
        self.micro_batch = {n.node: n.micro_batch_size for n in plan.nodes}
        # sampling draws on the model's device; a CPU generator cannot drive CUDA sampling
        self.sampler = torch.Generator(device=device).manual_seed(self.cfg.seed) if device.type != "cpu" else None
        self.optimizer: torch.optim.Optimizer | None = None
        if decl.trainable:
            lr = self.cfg.train.critic_lr if decl.scalar_head and self.cfg.train.critic_lr else self.cfg.train.lr
            self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=lr, betas=self.cfg.train.betas, weight_decay=self.cfg.train.weight_decay)
        else:
            self.module.requires_grad_(False)
        self.module.eval()

    # ------------------------------------------------------------ generation
    def generate(self, prompts: list[Prompt], *, n: int, greedy: bool, generator: torch.Generator) -> tuple[Sequences, Tensor]:
        """``n`` samples for each prompt (rows grouped by prompt); returns sequences and log-probs."""
        if self.decl.scalar_head:
            raise BackendError(f"model '{self.decl.name}' has a scalar head and cannot generate.")
        roll = self.cfg.rollout
        texts = [p.text for p in prompts for _ in range(n)]
        enc = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=True)
        prompt_ids, prompt_mask = enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device)
        max_new = roll.max_new_tokens or 16
        tokens, logprobs, mask = sample(
            self.module, prompt_ids, prompt_mask,
            max_new_tokens=max_new, eos_id=self.tokenizer.eos_token_id, pad_id=self.tokenizer.pad_token_id,
            temperature=roll.temperature, top_p=roll.top_p, greedy=greedy, ignore_eos=roll.ignore_eos, generator=self.sampler or generator,
        )
        tokens, logprobs, mask = tokens.cpu(), logprobs.cpu(), mask.cpu()  # batches live on the host between nodes
        prompt_ids, prompt_mask = prompt_ids.cpu(), prompt_mask.cpu()
        decoded = self._decode(tokens, mask)
        seqs = Sequences(
            prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=tokens, response_mask=mask,
            prompt_index=torch.arange(len(prompts)).repeat_interleave(n), texts=tuple(decoded), version=self.version,
        )
        return seqs, logprobs

    def _decode(self, tokens: Tensor, mask: Tensor) -> list[str]:
        """Response text up to EOS. Other special tokens stay visible, so a reward cannot be
        gamed by padding an answer with tokens that would otherwise decode to nothing."""
        eos = self.tokenizer.eos_token_id
        rows = []
        for ids, n in zip(tokens.tolist(), mask.sum(-1).long().tolist()):
            ids = ids[:n]
            rows.append(ids[:-1] if ids and ids[-1] == eos else ids)
        return self.tokenizer.batch_decode(rows, skip_special_tokens=False)

    # ------------------------------------------------------------ forward
    def _outputs(self, seqs: Sequences, output: str) -> Tensor:
        """Forward one micro-batch: [B,R] log-probs or values aligned with response tokens, or [B] scores."""
        ids, mask = seqs.input_ids.to(self.device), seqs.attention_mask.to(self.device)
        pos = position_ids(mask)
        start = seqs.prompt_len - 1  # hidden state at t predicts token t+1
        if self.decl.scalar_head:
            values = self.module(ids, mask, pos)[:, start:-1]
            if output == "scores":  # the value at each row's last response token
                last = seqs.response_lengths.clamp(min=1) - 1
                return values.gather(1, last[:, None].to(self.device)).squeeze(1)
            return values
        logits = self.module(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, start:-1].float()
        logp = torch.log_softmax(logits / self.cfg.rollout.temperature, dim=-1)
        return logp.gather(-1, seqs.response_ids.to(self.device)[..., None]).squeeze(-1)

    @torch.no_grad()
    def forward(self, seqs: Sequences, output: str, node: str) -> Tensor:
        micro = self.micro_batch.get(node) or len(seqs)
        parts = [self._outputs(seqs.select(slice(i, i + micro)), output) for i in range(0, len(seqs), micro)]
        return torch.cat(parts, 0).cpu()

    # ------------------------------------------------------------ training
    def train(self, loss: Entry, batch: dict[str, Any], seqs_key: str, node: str, options: dict[str, Any], algo: AlgoConfig, generator: torch.Generator) -> dict[str, float]:
        """PPO-style epochs x mini-batches; each mini-batch is one optimizer step accumulated over micro-batches."""
        if self.optimizer is None:
            raise BackendError(f"node '{node}' trains model '{self.decl.name}', which is frozen.")
        tcfg = self.cfg.train
        seqs: Sequences = batch[seqs_key]
        n_rows = len(seqs)
        micro = self.micro_batch.get(node) or n_rows
        epochs = int(options.pop("epochs", tcfg.epochs))
        mini_batches = int(options.pop("mini_batches", tcfg.mini_batches))
        if mini_batches > n_rows:
            raise BackendError(f"node '{node}': {mini_batches} mini-batches but only {n_rows} rows.")
        output = loss.meta.get("output", "logprobs")
        stats: dict[str, list[float]] = {}
        self.module.train()
        for _ in range(epochs):
            order = torch.randperm(n_rows, generator=generator)
            for mb in order.chunk(mini_batches):
                mb_tokens = max(float(seqs.response_mask[mb].sum()), 1.0)  # seqs live on the host
                self.optimizer.zero_grad(set_to_none=True)
                for part in mb.split(micro):
                    view = to_device(select_rows(batch, part, n_rows), self.device)
                    out = self._outputs(view[seqs_key], output)
                    value, step_stats = loss.obj(out, view, algo)
                    weight = float(view[seqs_key].response_mask.sum()) / mb_tokens  # exact token-mean over the mini-batch
                    (value * weight).backward()
                    for k, v in {"loss": value.item(), **step_stats}.items():
                        stats.setdefault(k, []).append(v)
                norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), tcfg.grad_clip)
                if not math.isfinite(float(norm)):
                    raise BackendError(f"node '{node}': gradient norm is {float(norm)} (diverged); lower train.lr or check the rewards.")
                stats.setdefault("grad_norm", []).append(float(norm))
                self.optimizer.step()
        self.module.eval()
        self.version += 1
        return {k: sum(v) / len(v) for k, v in stats.items()}

    # ------------------------------------------------------------ weights
    def save(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        if isinstance(self.module, ValueModel):
            self.module.save(path)
        else:
            self.module.save_pretrained(path)
        self.tokenizer.save_pretrained(path)


class LocalBackend:
    """Builds every model of a graph in this process following the plan's placement."""

    name = "local"

    def __init__(self, plan: ExecutionPlan) -> None:
        self.plan = plan

    def build(self, graph: Graph) -> dict[str, LocalModel]:
        cfg = self.plan.config
        placement = {p.model: p for p in self.plan.models}
        tokenizer = load_tokenizer(cfg.model)
        config = model_config(cfg.model, cfg.tiny_model, tokenizer)
        base = build_causal_lm(cfg.model, config, cfg.seed)
        built: dict[str, nn.Module] = {}
        for name in _init_order(graph):
            decl = graph.models[name]
            source = base if decl.init_from is None else _as_lm(built[decl.init_from])
            lm = copy.deepcopy(source)
            built[name] = ValueModel(lm) if decl.scalar_head else lm
        return {name: LocalModel(graph.models[name], built[name], tokenizer, self.plan, torch.device(placement[name].device)) for name in graph.models}


def _as_lm(module: nn.Module) -> nn.Module:
    if isinstance(module, ValueModel):
        raise BackendError("a model cannot initialise from a critic/reward model (it has no LM head).")
    return module


def _init_order(graph: Graph) -> list[str]:
    done: list[str] = []
    pending = list(graph.models)
    while pending:
        for name in pending:
            src = graph.models[name].init_from
            if src is None or src in done:
                done.append(name)
                pending.remove(name)
                break
    return done
