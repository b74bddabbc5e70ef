"""Greedy rows' logits divided by the sampling temperature inside vLLM, so that their processed log-probs are
the trainer's: log_softmax(logits / T).

vLLM decodes a greedy row (``temperature=0``) from its unscaled logits and reports ``processed_logprobs`` of
those (it takes the temperature of a greedy row as 1: vllm/v1/sample/sampler.py, ``Sampler.sample``). The
trainer computes every row's log-probs at the run's temperature. This processor divides the logits of each
request whose ``SamplingParams.extra_args`` carry `GREEDY_TEMPERATURE` by it, before vLLM draws: dividing by
a positive number keeps the argmax (the greedy tokens are the same), and the processed log-probs are then
log_softmax(logits / T), exactly.

It declares itself not argmax-invariant although it is: vLLM applies argmax-invariant processors only to
sampled rows, after their temperature, and never to a batch of greedy rows alone.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

#: The ``extra_args`` key of a greedy request: the temperature its log-probs are taken at.
GREEDY_TEMPERATURE = "flowrl_greedy_temperature"

#: What `vllm.LLM` takes to load it (``logits_processors=[FQCN]``), in whichever process runs the model.
FQCN = "flowrl_vllm.tempered:GreedyTemperature"


class GreedyTemperature(LogitsProcessor):
    """Divides the logits of the requests that carry `GREEDY_TEMPERATURE` by it."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.device = device
        self.temperatures: dict[int, float] = {}  # batch row -> its temperature
        self.rows = torch.empty(0, dtype=torch.long)
        self.divisor = torch.empty(0)

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        t = (sampling_params.extra_args or {}).get(GREEDY_TEMPERATURE)
        if t is not None and not (isinstance(t, (int, float)) and t > 0):
            raise ValueError(f"extra_args['{GREEDY_TEMPERATURE}'] must be a positive temperature, got {t!r}.")

    def is_argmax_invariant(self) -> bool:
        return False  # it is, but vLLM would then skip it for greedy rows (see the module's docstring)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        def temperature(params: Any, _prompt: Any, _output: Any) -> float | None:
            t = (params.extra_args or {}).get(GREEDY_TEMPERATURE)
            return float(t) if t is not None and float(t) != 1.0 else None

        if process_dict_updates(self.temperatures, batch_update, temperature):
            rows = sorted(self.temperatures)
            self.rows = torch.tensor(rows, dtype=torch.long, device=self.device)
            self.divisor = torch.tensor([self.temperatures[r] for r in rows], device=self.device)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.temperatures:
            logits[self.rows] = logits[self.rows] / self.divisor.to(logits.dtype).unsqueeze(1)
        return logits
