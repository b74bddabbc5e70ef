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

from flowrl.data import Prompt, Rollout, Sequences
from flowrl.plugins.hookspecs import Register, hookimpl
from flowrl.runtime.protocols import EngineContext


class HFGenerateEngine:
    """Samples with ``model.generate``; log-probs under softmax(raw logits / temperature)."""

    resumable = False

    def __init__(self, ctx: EngineContext) -> None:
        from transformers import AutoModelForCausalLM

        source = ctx.source
        self.tokenizer: Any = source.tokenizer  # shared with the training engine: used, never changed
        self.rollout = ctx.spec.sampling
        self.device = torch.device(ctx.device)
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
    ) -> Rollout:
        roll, tok = self.rollout, self.tokenizer
        limit = roll.max_new_tokens
        texts = [p.text for p in prompts for _ in range(n)]
        enc = tok(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=True)
        sampling = {} if greedy else {"temperature": roll.temperature, "top_p": roll.top_p, "top_k": 0}
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
                max_new_tokens=min(max_new_tokens or limit, limit),
                eos_token_id=None if roll.ignore_eos else tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
                output_logits=True,
                return_dict_in_generate=True,
            )
        tokens = out.sequences[:, enc["input_ids"].shape[1] :].cpu()
        logits = torch.stack(out.logits, 1).float().cpu()  # [B, R, V]: raw, before temperature and top-p
        logprobs = torch.log_softmax(logits / roll.temperature, -1).gather(-1, tokens[..., None]).squeeze(-1)
        eos = (tokens == tok.eos_token_id).long()
        # a row's tokens up to and including its first EOS (all of them when EOS is ignored)
        mask = torch.ones_like(tokens, dtype=torch.float) if roll.ignore_eos else (eos.cumsum(-1) - eos == 0).float()
        width = int(mask.sum(-1).max())
        mask, tokens = mask[:, :width], tokens[:, :width].masked_fill(mask[:, :width] == 0, tok.pad_token_id)
        logprobs = logprobs[:, :width].masked_fill(mask == 0, 0.0)
        ended = (tokens == tok.eos_token_id).any(-1) & (not roll.ignore_eos)
        seqs = Sequences(
            prompt_ids=enc["input_ids"],
            prompt_mask=enc["attention_mask"],
            response_ids=tokens,
            response_mask=mask,
            prompt_index=torch.arange(len(prompts)).repeat_interleave(n),
            texts=tuple(self._decode(tokens, mask)),
            version=self.version,
        )
        return Rollout(sequences=seqs, logprobs=logprobs, finished=ended | (mask.sum(-1) >= limit), greedy=greedy)

    def _decode(self, tokens: Tensor, mask: Tensor) -> list[str]:
        """Each response up to (not including) EOS; other special tokens stay visible."""
        eos = self.tokenizer.eos_token_id
        rows = []
        for ids, k in zip(tokens.tolist(), mask.sum(-1).long().tolist()):
            ids = ids[:k]
            rows.append(ids[:-1] if ids and ids[-1] == eos else ids)
        return self.tokenizer.batch_decode(rows, skip_special_tokens=False)


@hookimpl
def register_generation_engines(register: Register) -> None:
    register("hf_generate", HFGenerateEngine, description="transformers' own model.generate (a test plugin)")
