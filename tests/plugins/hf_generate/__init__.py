"""A test plugin that supplies only a generation engine, built on transformers' own `generate`.

It goes through the public hooks alone (`register_generation_engines`): the executor builds it
from the training engine of the model that generates (``ctx.source``: tokenizer, HF config,
exported weights) and hands it new weights after every train step. Nothing in flowrl's core
knows about it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from flowrl.contract import EngineContext, Prompt, Register, Response, ResponseRules, Rollout, hookimpl, to_rollout


class HFGenerateEngine:
    """Samples with ``model.generate``; log-probs under softmax(raw logits / temperature); responses
    end and decode by flowrl's shared rules (`flowrl.contract.responses`)."""

    resumable = False

    def __init__(self, ctx: EngineContext) -> None:
        from transformers import AutoModelForCausalLM

        source = ctx.source
        self.tokenizer: Any = source.tokenizer  # shared with the training engine: used, never changed
        self.rollout = ctx.spec.sampling
        self.rules = ResponseRules.of(source.tokenizer, ctx.spec.sampling)  # how responses end, their text
        self.device = torch.device(ctx.device)
        self.context = getattr(source.hf_config, "max_position_embeddings", None)  # prompt + response, in tokens
        model = AutoModelForCausalLM.from_config(source.hf_config, attn_implementation="eager")
        self.model = model.to(self.device).requires_grad_(False).eval()
        self.version = 0
        self.load_weights(source.export_weights(), source.version)

    def load_weights(self, weights: Mapping[str, Tensor], version: int) -> None:
        self.model.load_state_dict(dict(weights))
        self.version = version

    def resume(self, rollout: Rollout, *, generator: torch.Generator, max_new_tokens: int | None = None) -> Rollout:
        raise NotImplementedError("generation engine 'hf_generate' cannot resume unfinished rows (resumable = False)")

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
        roll, tok = self.rollout, self.tokenizer
        temp = roll.temperature if temperature is None else temperature  # evaluation's own, when it differs
        texts = [p.text for p in prompts for _ in range(n)]
        enc = tok(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=True)
        lengths = enc["attention_mask"].sum(-1).tolist()
        rooms = [None if self.context is None else self.context - k for k in lengths]
        budget = max(self.rules.budget(0, max_new_tokens or None, room) for room in rooms)
        sampling = {} if greedy else {"temperature": temp, "top_p": roll.top_p, "top_k": 0}
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))  # transformers samples from the global RNG
        host = self.device.type == "cpu"
        devices, kind = ([], None) if host else ([self.device], self.device.type)
        with torch.random.fork_rng(devices=devices, device_type=kind):
            torch.manual_seed(seed)
            out = self.model.generate(
                input_ids=enc["input_ids"].to(self.device),
                attention_mask=enc["attention_mask"].to(self.device),
                do_sample=not greedy,
                **sampling,
                max_new_tokens=budget,
                eos_token_id=None if roll.ignore_eos else tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
                output_logits=True,
                return_dict_in_generate=True,
            )
        tokens = out.sequences[:, enc["input_ids"].shape[1] :].cpu()
        logits = torch.stack(out.logits, 1).float().cpu()  # [B, R, V]: raw, before temperature and top-p
        logprobs = torch.log_softmax(logits / temp, -1).gather(-1, tokens[..., None]).squeeze(-1)
        # generate pads a row after its EOS; the shared rules cut it there (and at stop strings)
        rows = [
            self.rules.extend(Response([], []), ids, lps, room)
            for ids, lps, room in zip(tokens.tolist(), logprobs.tolist(), rooms)
        ]  # fmt: skip
        index = torch.arange(len(prompts)).repeat_interleave(n)
        return to_rollout(
            enc["input_ids"], enc["attention_mask"], rows, index, version=self.version, greedy=greedy,
            pad_id=tok.pad_token_id,
        )  # fmt: skip


@hookimpl
def register_generation_engines(register: Register) -> None:
    register("hf_generate", HFGenerateEngine, description="transformers' own model.generate (a test plugin)")
