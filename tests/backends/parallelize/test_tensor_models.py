"""Tensor parallelism on models beyond the policy: a critic split tp 2 over two
gloo processes computes the one-process values, with no stray LM-head plan; a LoRA model split tp 2 is
refused by name."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SMALL = ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=2", "progress=false", "checkpoint=false"]


# ------------------------------------------------------------ the torch engine split over two processes

_SPLITS = textwrap.dedent(
    """
    import json, random, sys, traceback, warnings
    import torch
    import torch.distributed as dist

    rank, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from flowrl import api
    from flowrl.backends.local.factories import training_engine
    from flowrl.contract.protocols import EngineContext
    from flowrl.tasks.builtin import Copy

    OV = ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=2", "progress=false", "checkpoint=false",
          "device=cpu", "train.dtype=float32"]
    TP = dict(rank=rank, world=2, group=dist.group.WORLD, tp=2)
    res = {}

    def engine(graph, plan, name, **kw):
        run = plan.model_run(name)
        torch.manual_seed(run.seed)
        return training_engine(EngineContext(decl=graph.models[name], spec=run, device="cpu", **kw))

    # a critic (scalar head) split tp 2; the default tiny model: 2 heads, one key/value head (held whole)
    graph, plan = api.plan("ppo", overrides=OV, emit=lambda s: None)
    whole = engine(graph, plan, "critic")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        split = engine(graph, plan, "critic", **TP)
    res["critic_warnings"] = [str(w.message)[:160] for w in caught if "could not be resolved" in str(w.message)]
    actor = engine(graph, plan, "actor")
    prompts = Copy().prompts(random.Random(0), 4)
    seqs = actor.generate(prompts, n=2, greedy=False, generator=torch.Generator().manual_seed(0)).sequences
    res["critic_values"] = float((whole.forward(seqs, "values", 0) - split.forward(seqs, "values", 0)).abs().max())

    # a LoRA-trained actor split tp 2 (the planner plans it: --require actor.tp=2 --set train.lora.rank=4)
    graph, plan = api.plan("grpo", overrides=OV + ["train.lora.rank=4"], emit=lambda s: None)
    try:
        lora = engine(graph, plan, "actor", **TP)
        seqs = lora.generate(prompts, n=2, greedy=True, generator=torch.Generator().manual_seed(0)).sequences
        res["lora"] = {"ok": True, "rows": len(seqs)}
    except Exception as exc:
        res["lora"] = {"ok": False, "type": type(exc).__name__, "message": str(exc)[:400]}

    if rank == 0:
        with open(out, "w") as fh:
            json.dump(res, fh)
    dist.destroy_process_group()
    """
)


@pytest.fixture(scope="module")
def splits(tmp_path_factory):
    """The two-process comparisons of `_SPLITS` (gloo, one thread each), run once for the module."""
    folder = tmp_path_factory.mktemp("tp-models")
    script, out = folder / "splits.py", folder / "result.json"
    script.write_text(_SPLITS)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), str(port), str(out)], env=env, stderr=subprocess.PIPE, cwd=REPO
        )
        for rank in range(2)
    ]
    errors = [p.communicate(timeout=180)[1].decode()[-3000:] for p in procs]
    assert all(p.returncode == 0 for p in procs), errors
    return json.loads(out.read_text())


@pytest.mark.slow
def test_a_critic_split_tp2_computes_the_one_process_values(splits):
    assert splits["critic_values"] < 1e-5


@pytest.mark.slow
def test_a_critic_with_a_shared_key_value_head_is_split_without_a_stray_lm_head_plan(splits):
    assert splits["critic_warnings"] == []


@pytest.mark.slow
def test_a_lora_model_split_tp2_builds_or_is_refused_by_name(splits):
    lora = splits["lora"]
    if not lora["ok"]:
        assert lora["type"] in ("BackendError", "PlanError", "ConfigError"), lora
        assert "actor" in lora["message"] and "lora" in lora["message"].lower(), lora
    else:
        assert lora["rows"] == 8
