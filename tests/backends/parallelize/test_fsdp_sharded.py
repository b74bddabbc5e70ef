"""The torch engine as a sharded (FSDP2, two ranks over gloo) model: what a train step and
a forward-only pass really hold unsharded (the planner's `Numerics.gather_whole` prices it), and the
sharded export (`LocalModel._state`), which returns the tensors `get_model_state_dict` gathered
without a second host copy: none of them may share storage with the live module (weight syncs and
checkpoints mutate or keep what they get).

One two-process run (two plain processes joining a gloo group, each building the same engines)
serves every test of this module; rank 0 reports, as JSON, what FSDP2 held at each point."""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import textwrap

import msgspec
import pytest

from flowrl import api
from flowrl.specs import LoraConfig

pytestmark = pytest.mark.slow  # two processes build five engines and train each a step: ~20 s

SMALL = ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=2", "progress=false", "train.dtype=float32"]

WORKER = textwrap.dedent(
    r'''
    import json, os, pickle, sys
    import torch, torch.distributed as dist

    def fsdp_params(module):
        from torch.distributed.fsdp import FSDPModule
        out = []
        for m in module.modules():
            if isinstance(m, FSDPModule):
                group = m._get_fsdp_state()._fsdp_param_group
                if group is not None:
                    out.extend(group.fsdp_params)
        return out

    def census(module):
        """Bytes FSDP2 holds unsharded: gathered parameters, unsharded gradients (the parameter's
        .grad, or the accumulated one FSDP2 keeps in its reduce dtype), and their dtypes."""
        from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState
        out = {"gathered": 0, "grads": 0, "gathered_dtypes": set(), "grad_dtypes": set(), "grad_numel": 0}
        for fp in fsdp_params(module):
            if fp.sharded_state == ShardedState.UNSHARDED:
                u = fp._unsharded_param
                out["gathered"] += u.numel() * u.element_size()
                out["gathered_dtypes"].add(str(u.dtype))
            grads = [fp.unsharded_accumulated_grad]
            if hasattr(fp, "_unsharded_param"):
                grads.append(fp._unsharded_param.grad)
            for g in grads:
                if g is not None:
                    out["grads"] += g.numel() * g.element_size()
                    out["grad_numel"] += g.numel()
                    out["grad_dtypes"].add(str(g.dtype))
        return {k: sorted(v) if isinstance(v, set) else v for k, v in out.items()}

    def storages(module):
        """Every storage the module holds: its state dict's (local shards, buffers) and FSDP2's."""
        live = set()
        for t in module.state_dict().values():
            t = t.to_local() if hasattr(t, "to_local") else t
            live.add(t.untyped_storage().data_ptr())
        for fp in fsdp_params(module):
            live.add(fp.sharded_param.to_local().untyped_storage().data_ptr())
            if hasattr(fp, "_unsharded_param"):
                live.add(fp._unsharded_param.untyped_storage().data_ptr())
        for b in module.buffers():
            live.add(b.untyped_storage().data_ptr())
        live.discard(0)
        return live

    def whole(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    def main():
        rank = int(os.environ["RANK"])
        dist.init_process_group("gloo", rank=rank, world_size=2)
        torch.set_num_threads(1)
        from flowrl.backends.local.factories import local_model, training_engine
        from flowrl.backends.local.models import build_causal_lm, load_tokenizer, model_config
        from flowrl.contract.data import Sequences
        from flowrl.runtime.batch import StepBatch
        from flowrl.contract.protocols import EngineContext, TrainStep
        from flowrl.specs import AlgoConfig

        cases = pickle.load(open(sys.argv[1], "rb"))
        reports = {}
        for name, (decl, spec, buffer) in cases.items():
            ctx = EngineContext(decl=decl, spec=spec, device="cpu", rank=rank, world=2, group=dist.group.WORLD)
            if buffer:  # a persistent buffer: get_model_state_dict returns the module's own tensor for it
                tok = load_tokenizer(spec.checkpoint)
                cfg = model_config(spec.checkpoint, spec.tiny, tok)
                module = build_causal_lm(spec.checkpoint, cfg, spec.seed)
                module.model.register_buffer("probe", torch.arange(4.0), persistent=True)
                eng = local_model(decl, module, tok, cfg, spec, torch.device("cpu"), rank, 2, dist.group.WORLD)
            else:
                eng = training_engine(ctx)
            rep = {"sharded": eng.sharded}
            rep["params"] = sum(p.numel() for p in eng.module.parameters())
            rep["trained"] = sum(p.numel() for p in eng.module.parameters() if p.requires_grad)
            n, P, R = 8, 3, 4
            g = torch.Generator().manual_seed(0)
            vocab = eng.hf_config.vocab_size
            seqs = Sequences(
                prompt_ids=torch.randint(3, vocab, (n, P), generator=g), prompt_mask=torch.ones(n, P, dtype=torch.long),
                response_ids=torch.randint(3, vocab, (n, R), generator=g), response_mask=torch.ones(n, R),
                prompt_index=torch.arange(n), texts=("x",) * n,
            )
            output = "values" if decl.scalar_head else "logprobs"
            rep["start"] = census(eng.module)
            eng.forward(seqs, output, 4)
            rep["after_forward"] = census(eng.module)  # the pass has returned
            seen = []
            backward = torch.Tensor.backward
            def traced(self, *a, **k):
                seen.append(census(eng.module))  # before each micro-step's backward
                return backward(self, *a, **k)
            torch.Tensor.backward = traced
            try:
                step = TrainStep(node="t", sequences_key="s", output=output, micro_batch=2, epochs=1, mini_batches=1,
                                 algo=AlgoConfig(), generator=torch.Generator().manual_seed(0), unit="row-mean")
                loss = lambda o, view, algo: (o.float().pow(2).mean(), {})
                eng.train(loss, StepBatch({"s": seqs}, policy_version=0), step)
            finally:
                torch.Tensor.backward = backward
            rep["before_backward"] = seen  # 8 rows over 2 ranks in micro-batches of 2: 2 micro-steps
            rep["after_train"] = census(eng.module)
            eng.forward(seqs, output, 4)  # gathered again (reshard_after_forward=False) when it exports
            live = storages(eng.module)
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
            raw = get_model_state_dict(eng.module, options=StateDictOptions(full_state_dict=True))
            rep["raw_aliased"] = sorted(k for k, v in raw.items() if v.untyped_storage().data_ptr() in live)
            del raw
            state = eng._state()
            rep["aliased"] = sorted(k for k, v in state.items() if v.untyped_storage().data_ptr() in live)
            by_storage = {}
            for k, v in state.items():
                by_storage.setdefault(v.untyped_storage().data_ptr(), []).append(k)
            rep["shared"] = [ks for ks in by_storage.values() if len(ks) > 1]
            full = {k: whole(v).clone() for k, v in eng.module.state_dict().items()}
            rep["keys_differ"] = sorted(set(full) ^ set(state))
            rep["values_differ"] = sorted(k for k in full if k in state and not torch.equal(full[k], state[k]))
            for v in state.values():  # what a consumer may do with its copy
                if v.is_floating_point():
                    v.add_(1.0)
            after = {k: whole(v) for k, v in eng.module.state_dict().items()}
            rep["leaked"] = sorted(k for k in full if not torch.equal(full[k], after[k]))
            reports[name] = rep
        if rank == 0:
            with open(sys.argv[2], "w") as fh:
                json.dump(reports, fh)
        dist.barrier()
        dist.destroy_process_group()

    main()
    '''
)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("fsdp")
    g, plan = api.plan("ppo", overrides=SMALL, emit=lambda s: None)
    actor, critic = plan.model_run("actor"), plan.model_run("critic")
    half = msgspec.structs.replace(actor, numerics=msgspec.structs.replace(actor.numerics, dtype="bfloat16"))
    cases = {
        "fp32": (g.models["actor"], actor, False),
        "bf16": (g.models["actor"], half, False),
        "lora": (g.models["actor"], msgspec.structs.replace(actor, lora=LoraConfig(rank=4)), False),
        "critic": (g.models["critic"], critic, False),
        "buffer": (g.models["actor"], actor, True),
    }
    (tmp / "cases.pkl").write_bytes(pickle.dumps(cases))
    (tmp / "worker.py").write_text(WORKER)
    port = _port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(tmp / "worker.py"), str(tmp / "cases.pkl"), str(tmp / "out.json")],
            env={**os.environ, "RANK": str(r), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    return json.loads((tmp / "out.json").read_text())


@pytest.mark.parametrize("case", ["fp32", "bf16", "lora", "critic", "buffer"])
def test_the_sharded_export_is_the_whole_state_and_never_the_live_module(probe, case):
    """Verified sound: `_state` returns every key, equal to the gathered weights, sharing no storage
    with the module (its shards, FSDP2's gathered parameters, its buffers) nor with one another, and
    a consumer that writes into what it got leaves the module as it was -- also right after a
    forward left the model gathered, and for a persistent buffer (returned by get_model_state_dict
    as the module's own tensor: the copy the change keeps)."""
    rep = probe[case]
    assert rep["sharded"]
    assert rep["keys_differ"] == [] and rep["values_differ"] == []
    assert rep["aliased"] == [] and rep["shared"] == []
    assert rep["leaked"] == []
    # what get_model_state_dict returns as the module's own tensor (and `_state` therefore copies)
    assert rep["raw_aliased"] == (["model.probe"] if case == "buffer" else [])


def test_what_a_sharded_train_step_holds_is_what_gather_whole_prices(probe):
    """Verified: with several micro-steps FSDP2 holds every parameter gathered in the compute dtype
    (float32, or bfloat16 under the mixed-precision policy: `Numerics.compute_copy_bytes`) and, from
    the second micro-step, the whole model's unsharded gradients in float32 (reduce_dtype: the
    executor's grad_bytes 4), whatever the compute dtype."""
    for case, param_bytes in (("fp32", 4), ("bf16", 2)):
        rep = probe[case]
        first, second = rep["before_backward"]
        assert first["gathered"] == rep["params"] * param_bytes and first["grads"] == 0
        assert second["gathered"] == rep["params"] * param_bytes
        assert second["grads"] == rep["params"] * 4 and second["grad_dtypes"] == ["torch.float32"]
        assert rep["after_train"]["gathered"] == rep["after_train"]["grads"] == 0  # all resharded after the step


def test_a_lora_model_accumulates_only_its_adapters_gradients(probe):
    """Verified: sharded with LoRA, FSDP2 gathers the whole model but the gradients it accumulates over
    micro-steps are the adapters' alone (the base weights do not require gradients); the planner
    prices the whole model's."""
    rep = probe["lora"]
    first, second = rep["before_backward"]
    assert rep["trained"] < rep["params"] / 5
    assert second["gathered"] == rep["params"] * 4
    assert second["grad_numel"] == rep["trained"] and second["grads"] == rep["trained"] * 4


def test_what_a_forward_leaves_gathered_is_priced_while_the_next_train_step_runs(probe, monkeypatch):
    """Fixed: reshard_after_forward=False leaves a sharded model gathered whole after a forward-only pass returns
    (until its next backward); the memory pass priced gathered parameters only inside each node's own peak. In a
    two-rank Ray PPO plan the critic, gathered by the 'values' forward, is still whole while train_actor runs
    (or the actor, gathered by 'old_logprobs', while train_critic runs): the peak counts what the probe measured."""
    from flowrl.planner.constraints import parse_requirements
    from flowrl.plugins.manager import registry

    monkeypatch.setenv("FLOWRL_PLUGINS", "ray")
    left = {m: probe[case]["after_forward"]["gathered"] for m, case in (("actor", "fp32"), ("critic", "critic"))}
    overrides = [*SMALL, "backend=ray", "device=cpu"]
    _, cfg = api.load("ppo", overrides=overrides)
    target = api.local_target(cfg, registry(), devices=2)
    # both FSDP2-sharded over the two ranks, as the probe ran them (the planner could split them into
    # pipeline stages instead, which leaves nothing gathered)
    require = parse_requirements(["actor.dp=2", "critic.dp=2"], ["actor", "critic", "ref"])
    plan = api.plan(
        "ppo",
        overrides=overrides,
        target=target,
        for_backend=True,
        options={"placement": "colocate", "require": require},
        emit=lambda s: None,
    )[1]
    assert [plan.layout.layout(m).parallel.dp for m in ("actor", "critic")] == [2, 2]
    assert plan.target.numerics.gather_whole
    assert plan.fused == {}  # both forwards run as nodes of their own before the train steps
    (estimate,) = plan.memory
    states = sum(v for k, v in estimate.breakdown.items() if not k.startswith("peak: "))
    from flowrl.planner import memory as mem

    def train_peak(node: str, model: str) -> int:
        n = next(n for n in plan.nodes if n.node == node)
        lay = msgspec.structs.replace(plan.layout.layout(model), micro_batch=n.micro_batch_size)
        steps = mem.micro_steps(n.rows // plan.options[node].options["mini_batches"], lay, n.micro_batch_size)
        t = plan.target
        return mem.pass_bytes(
            t.spec(model),
            t.numerics,
            lay,
            plan.workload.max_sequence(),
            training=True,
            trainable=True,
            micro_steps=steps,
        )

    # whichever train step runs first, the other model is still gathered from its forward
    held = min(
        train_peak("train_actor", "actor") + left["critic"], train_peak("train_critic", "critic") + left["actor"]
    )
    assert estimate.required_bytes >= states + held
