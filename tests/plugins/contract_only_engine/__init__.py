"""A generation engine plugin written against `flowrl.contract` alone (besides torch and transformers):
a plain sampling loop over the HF model, one token per forward, no cache. What a plugin author needs —
the context it is built from, the prompts, the rollout it returns, how a response ends, the hook
marker and the ``register`` callback's type — comes from that one module."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from flowrl.contract import (
    EngineCapabilities,
    EngineContext,
    Prompt,
    Register,
    Response,
    ResponseRules,
    Rollout,
    hookimpl,
    to_rollout,
)


class LoopEngine:
    """Samples token by token from softmax(logits / temperature); responses end by the shared rules."""

    resumable = False

    def __init__(self, ctx: EngineContext) -> None:
        from transformers import AutoModelForCausalLM

        source = ctx.source  # the training engine of the same model: tokenizer, HF config, weights
        self.tokenizer = source.tokenizer
        self.sampling = ctx.spec.sampling
        self.rules = ResponseRules.of(source.tokenizer, ctx.spec.sampling)
        model = AutoModelForCausalLM.from_config(source.hf_config, attn_implementation="eager")
        self.model = model.to(ctx.device).requires_grad_(False).eval()
        self.version = 0
        self.load_weights(source.export_weights(), source.version)

    def load_weights(self, weights: Mapping[str, Tensor], version: int) -> None:
        self.model.load_state_dict(dict(weights))
        self.version = version

    def resume(self, rollout: Rollout, *, generator: torch.Generator, max_new_tokens: int | None = None) -> Rollout:
        raise NotImplementedError("generation engine 'contract_loop' cannot resume rows (resumable = False)")

    @torch.no_grad()
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
        tok, device = self.tokenizer, self.model.device
        temp = temperature if temperature is not None else self.sampling.temperature
        enc = tok([p.text for p in prompts for _ in range(n)], return_tensors="pt", padding=True,
                  padding_side="left", add_special_tokens=True)  # fmt: skip
        ids, mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)
        new_ids, new_logprobs = [], []
        for _ in range(self.rules.budget(0, max_new_tokens or None)):
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1].float()
            logp = torch.log_softmax(logits / temp, -1).cpu()
            pick = logp.argmax(-1) if greedy else torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
            new_ids.append(pick)
            new_logprobs.append(logp.gather(-1, pick[:, None]).squeeze(-1))
            ids = torch.cat([ids, pick[:, None].to(device)], 1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        rows = [
            self.rules.extend(Response([], []), row_ids, row_lps)
            for row_ids, row_lps in zip(torch.stack(new_ids, 1).tolist(), torch.stack(new_logprobs, 1).tolist())
        ]
        index = torch.arange(len(prompts)).repeat_interleave(n)
        return to_rollout(enc["input_ids"], enc["attention_mask"], rows, index, version=self.version,
                          greedy=greedy, pad_id=tok.pad_token_id)  # fmt: skip


@hookimpl
def register_generation_engines(register: Register) -> None:
    register(
        "contract_loop",
        LoopEngine,
        description="a plain sampling loop (a test plugin importing only flowrl.contract)",
        capabilities=EngineCapabilities(),
    )
