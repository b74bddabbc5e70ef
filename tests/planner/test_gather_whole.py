"""`Numerics.gather_whole` and `memory.micro_steps` (a Ray plan's actor FSDP2-sharded by the torch
engine over two ranks): the micro-steps the planner prices against those the engine takes
(`LocalModel.train`: ``order.chunk(mini_batches)``, then `flowrl.runtime.dispatch.micro_batches` per
rank, every rank taking as many as the rank with the most), uneven mini-batches, token budgets, a
node's own mini-batches in the tuner, LoRA, bfloat16, the memory breakdown, and plan ids. What the
engine really holds is measured in tests/backends (a two-rank gloo run of sharded export)."""

from __future__ import annotations

import msgspec
import pytest
import torch

from flowrl import api
from flowrl.contract.data import Sequences
from flowrl.planner import memory as mem
from flowrl.planner.constraints import parse_requirements
from flowrl.planner.passes import PassResults
from flowrl.plugins.manager import registry
from flowrl.runtime.dispatch import micro_batches

BASE = ["progress=false", "train.dtype=float32", "backend=ray", "device=cpu"]
SIXTEEN = ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=4"]


@pytest.fixture(autouse=True)
def _ray_plugin(monkeypatch):
    monkeypatch.setenv("FLOWRL_PLUGINS", "ray")  # the Ray executor's plugin (plans only: Ray is not started)


def _plan(*extra: str, results: PassResults | None = None):
    overrides = [*BASE, *extra]
    _, cfg = api.load("grpo", overrides=overrides)
    target = api.local_target(cfg, registry(), devices=2)
    return api.plan(
        "grpo",
        overrides=overrides,
        target=target,
        for_backend=True,
        # the actor FSDP2-sharded over both ranks (the engine could split it into pipeline stages instead)
        options={"placement": "colocate", "require": parse_requirements(["actor.dp=2"], ["actor", "ref"])},
        results=results,
        emit=lambda s: None,
    )[1]


def _train(plan):
    return next(n for n in plan.nodes if n.node == "train_actor")


def _peak(plan) -> int:
    (estimate,) = plan.memory
    return next(v for k, v in estimate.breakdown.items() if k.startswith("peak: node train_actor"))


def _acts_and_gathered(plan, steps: int) -> tuple[int, int]:
    """The train node's activations, and what it gathers over ``steps`` micro-steps, as priced."""
    n, t = _train(plan), plan.target
    size = n.micro_batch_size
    if plan.models["actor"].max_tokens_per_micro_batch is not None:
        size = max(1, min(size, plan.models["actor"].max_tokens_per_micro_batch // plan.workload.max_sequence()))
    lay = msgspec.structs.replace(plan.layout.layout("actor"), micro_batch=size)
    acts = mem.activation_bytes(t.spec("actor"), t.numerics, lay, plan.workload.max_sequence(), training=True)
    return acts, mem.gathered_bytes(t.spec("actor"), t.numerics, lay, training=True, micro_steps=steps)


def _sequences(prompts: list[int], responses: list[int]) -> Sequences:
    n, width, reach = len(prompts), max(prompts), max(responses)
    prompt_mask = torch.zeros(n, width, dtype=torch.long)
    response_mask = torch.zeros(n, reach)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        prompt_mask[i, width - p :] = 1  # left-padded
        response_mask[i, :r] = 1
    return Sequences(
        prompt_ids=torch.full((n, width), 5),
        prompt_mask=prompt_mask,
        response_ids=torch.full((n, reach), 6),
        response_mask=response_mask,
        prompt_index=torch.arange(n),
        texts=("x",) * n,
    )


def _engine_steps(plan, seqs: Sequences | None = None) -> int:
    """The most micro-steps any rank takes for any mini-batch of the train node, as `LocalModel.train`
    cuts them (its own mini-batches, its micro-batch size, the model's token budget)."""
    n = _train(plan)
    seqs = seqs if seqs is not None else _sequences([3] * n.rows, [2] * n.rows)
    run = plan.models["actor"]
    world = plan.layout.layout("actor").parallel.dp
    order = torch.randperm(n.rows, generator=torch.Generator().manual_seed(0))
    most = 0
    for mb in order.chunk(int(plan.options["train_actor"].options["mini_batches"])):
        shares = micro_batches(seqs, mb, world, n.micro_batch_size, run.max_tokens_per_micro_batch, run.pack)
        most = max(most, max(len(p) for p in shares))
    return most


# ---------------------------------------------------------------------------- even splits, dtypes, plan content


@pytest.mark.parametrize(
    "extra",
    [
        ["train.micro_batch_size=8", "train.mini_batches=1"],  # 8 rows a rank: one micro-step
        ["train.micro_batch_size=4", "train.mini_batches=1"],  # two
        ["train.micro_batch_size=4", "train.mini_batches=2"],  # 4 rows a rank per mini-batch: one
        ["train.micro_batch_size=2", "train.mini_batches=2", "train.epochs=2"],  # epochs change nothing: two
        ["train.micro_batch_size=4", "train.mini_batches=1", "nodes.train_actor.mini_batches=2"],  # the node's own: one
        ["train.micro_batch_size=2", "train.mini_batches=4", "nodes.train_actor.mini_batches=1"],  # four
    ],
    ids=["1x8", "2x4", "mb2-1x4", "epochs2-2x2", "node-mb2", "node-mb1"],
)
def test_evenly_split_mini_batches_price_the_engines_micro_steps(extra):
    plan = _plan(*SIXTEEN, *extra)
    steps = _engine_steps(plan)
    lay = plan.layout.layout("actor")
    n = _train(plan)
    mini = int(plan.options["train_actor"].options["mini_batches"])
    assert mem.micro_steps(n.rows // mini, lay, n.micro_batch_size) == steps
    acts, gathered = _acts_and_gathered(plan, steps)
    assert _peak(plan) == acts + gathered
    spec = plan.target.spec("actor")
    whole = spec.layers * spec.layer_parameters() + spec.vocab * spec.hidden * 2 + spec.hidden
    grads = gathered - whole * 4
    assert grads == (whole * 4 if steps > 1 else spec.layer_parameters() * 4)


def test_bfloat16_gathers_in_two_bytes_and_accumulates_in_four():
    """The engine gathers bfloat16 parameters (MixedPrecisionPolicy param_dtype) and accumulates float32
    gradients (reduce_dtype), measured in tests/backends/test_sharded_export_review.py."""
    plan = _plan(*SIXTEEN, "train.dtype=bfloat16", "train.micro_batch_size=4", "train.mini_batches=1")
    numerics, spec = plan.target.numerics, plan.target.spec("actor")
    assert numerics.gather_whole and numerics.compute_copy_bytes == 2 and numerics.grad_bytes == 4
    acts, gathered = _acts_and_gathered(plan, 2)
    whole = spec.layers * spec.layer_parameters() + spec.vocab * spec.hidden * 2 + spec.hidden
    assert gathered == int(whole * 2 + whole * 4)
    assert _peak(plan) == acts + gathered


def test_gather_whole_is_plan_content_when_set():
    plan = _plan(*SIXTEEN)
    assert plan.target.numerics.gather_whole
    off = msgspec.structs.replace(
        plan,
        target=msgspec.structs.replace(
            plan.target, numerics=msgspec.structs.replace(plan.target.numerics, gather_whole=False)
        ),
    )
    assert off.content_id() != plan.content_id()


# ---------------------------------------------------------------------------- uneven splits, token budgets, known gaps


def test_uneven_mini_batches_price_the_micro_steps_the_engine_takes():
    plan = _plan("rollout.prompts_per_step=6", "rollout.samples_per_prompt=3", "train.mini_batches=4")
    steps = _engine_steps(plan)
    acts, gathered = _acts_and_gathered(plan, steps)
    assert _peak(plan) >= acts + gathered


def test_a_token_budget_prices_the_micro_steps_of_the_rank_with_the_most_rows():
    probe = _plan(*SIXTEEN, "train.mini_batches=1")
    seq_len = probe.workload.max_sequence()
    plan = _plan(
        *SIXTEEN, "train.mini_batches=1", "train.micro_batch_size=8", f"train.max_tokens_per_micro_batch={8 * seq_len}"
    )
    assert _train(plan).micro_batch_size == 8
    prompt, longest = plan.workload.prompt_length, plan.workload.max_response()
    # rows the workload allows: one of the longest, the rest short
    seqs = _sequences([prompt] + [3] * 15, [longest] + [2] * 15)
    steps = _engine_steps(plan, seqs)
    acts, gathered = _acts_and_gathered(plan, steps)
    assert _peak(plan) >= acts + gathered


def test_the_tuner_prices_a_train_nodes_own_mini_batches():
    estimates = {}
    for name, extra in (
        ("config", ["train.mini_batches=1"]),
        ("node", ["train.mini_batches=4", "nodes.train_actor.mini_batches=1"]),
    ):
        results = PassResults()
        plan = _plan(*SIXTEEN, "train.micro_batch_size=2", *extra, results=results)
        (best,) = [c for c in results.place.tune.ranked[:1]]
        assert [(m.model, m.micro_batch) for m in best.plan.models] == [
            (m.model, m.micro_batch) for m in plan.layout.models
        ]
        (estimate,) = plan.memory
        estimates[name] = (best.memory["all"], estimate.required_bytes)
    # one node plan, one memory-pass estimate: the tuner's should agree too
    assert estimates["config"][1] == estimates["node"][1]
    assert estimates["node"][0] == estimates["config"][0]


def test_lora_prices_the_adapters_accumulated_gradients_only():
    """Fixed: the whole model's accumulated gradients were priced for a LoRA model, but only the adapters
    require gradients and FSDP2 accumulates theirs alone (measured: 8192 adapter parameters x 4 bytes, not
    80448 x 4, tests/backends/parallelize/test_fsdp_sharded.py); more micro-steps add at most those."""
    rank = 4
    peaks = {}
    for size in (8, 2):  # 8 rows a rank: one micro-step; 4
        plan = _plan(*SIXTEEN, f"train.lora.rank={rank}", "train.mini_batches=1", f"train.micro_batch_size={size}")
        assert plan.models["actor"].lora is not None and plan.layout.layout("actor").parallel.dp == 2
        acts, _ = _acts_and_gathered(plan, 1)
        peaks[_engine_steps(plan)] = _peak(plan) - acts
    lora = plan.models["actor"].lora
    adapters = plan.target.spec("actor").lora_parameters(lora.rank, lora.target_modules)
    assert sorted(peaks) == [1, 4]
    assert peaks[4] - peaks[1] <= adapters * plan.target.numerics.grad_bytes


def test_the_breakdown_says_a_sharded_train_peak_holds_gathered_weights_and_gradients():
    """Fixed: a sharded train node's peak was named 'node train_actor activations' although, gathered whole,
    most of it is the model's gathered weights and accumulated gradients (643584 of 996112 bytes)."""
    plan = _plan(*SIXTEEN, "train.mini_batches=1", "train.micro_batch_size=2")
    (estimate,) = plan.memory
    (key,) = [k for k in estimate.breakdown if k.startswith("peak: node train_actor")]
    acts, gathered = _acts_and_gathered(plan, _engine_steps(plan))
    assert gathered > acts  # the weights and gradients are most of it
    assert key == "peak: node train_actor gathered weights and gradients + activations"  # the larger part first


def test_an_over_capacity_sharded_peak_is_not_advised_a_smaller_micro_batch():
    """A smaller micro-batch adds micro-steps and shrinks none of the gathered weights: verify says so."""
    from flowrl.contract import verify_plan
    from flowrl.errors import PlanError

    graph, _ = api.load("grpo", overrides=BASE)
    for extra, gathered_first in ((["train.micro_batch_size=2"], True), (["train.micro_batch_size=8"], False)):
        plan = _plan(*SIXTEEN, "train.mini_batches=1", *extra)
        (estimate,) = plan.memory
        small = msgspec.structs.replace(estimate, capacity_bytes=estimate.required_bytes - 1)
        with pytest.raises(PlanError) as err:
            verify_plan(graph, msgspec.structs.replace(plan, memory=(small,)))
        text = str(err.value)
        assert ("gathered whole" in text) == gathered_first
        assert ("a smaller train.micro_batch_size, or" in text) != gathered_first


#: a plan file as flowrl wrote it the commit before gather_whole (cc6ad49): `flowrl plan grpo --set
#: rollout.prompts_per_step=2 --set rollout.samples_per_prompt=2 --set rollout.max_new_tokens=2 --set
#: train.mini_batches=1 --set progress=false --out plan.json`, zlib-compressed and base64-encoded
OLD_PLAN = (
    "eNrtGttu47rxfb8i0FOLk13Iip1N+ivFgqAlSmYtkVqKso9PkH/vkJREDnVJDroHbYrkKZ7hZTj3Gc3Ll7u7hBfJP+6S3VPx"
    "cPy+p8+H3dMxy8rk3uAqRdsToF/gB/wUtGFmcaVaaRcArJO9ymfQkouKqVZxoQ2KPqfpwy49pOnxyHZ5lsCqV3tDLkXJK3+F"
    "pt3Z7MhlexsPMzAiW82l6MzK1wHeyILVABB9XY9LubiREe6OBOiJFwUTpON/GEIf9/cjAshjqmEFp5qN6F32NOFF35Ca3pgy"
    "92YIfGK0mEPPlwmxmxAXmdPjeLwn1ryA/k5a2XHzNMKaIysKYFznqLCLxrcqWdey1+GrWiWbVnekZYp0mrWImI42bc0c0i1E"
    "aHOxYFei5ZkJ/AzNGthEda8sN76lHiNb0kYwXgmpGGHSHFLSumOeBFgPwH/+8LeCYGIWdJrWTLCuixHyYhRIXngHzAFk+i07"
    "TMj81Iuzpz46UTHakErJvjVIzEitKBchG2tlD09Tz4JcgURyYjHo6Cvj1UmTguX05nZNqCMDNTXPHQB3gH2+D388Dz88P8C8"
    "CpLXPGYqa2V+wjrUcMHJker8xGJErqTDLKoYExUX1j5rUMM68Ww685YIY36CazaTXqFvrd1Gey39Lqo1E9pJJEIploOe9Qtn"
    "GW1zsrL6GJAcU9vS/DzbXktFA4mZq6gwy1LP34TW7cms2j1+C8GFkq2zmxTBNVUV08ZV9DXDcgPsT2Mz/0ruQ9h5AXZZgMkF"
    "WGX8yxzctwvAQl6FA0/QH8N/r0iTKzAbsFMni5c35T0JtKwl1Q9Zgg6jdSXDY4xWklpeneHdI/AJjMDBvacselqPqowkegaw"
    "ZKUTwCEEs07zhmpprCw5P3hKK9o0NDKJmjb2iGd/xKUcLwwpNFB3X7j9egIdF4QWFyo0razEteq9jvEOtilQ4VG37dEITc1V"
    "h5Am2XWEViZ6JVa9vzaMigTjwT0ayjPEbeOuDQmPaTpCGCu8RidOZRPVg3u7R8E3CHbsd5b3A/9CYScFu3AXk/O2n6LoSQ2R"
    "KTiiYY1UN1LzhmtS8SPGgrPJz610QdyzC4LLBVw++OcbXn9mrCV+UxBXTLCqlPPygXEnAiICiukF1aGtT+46iCIXWmOAi2/k"
    "zAw5w6/AY4nuCk5nwLpfgRe06cuIHZIZj72BpBofQJFm5yeqiYmWNdULntLGdkfZcpwyAa6WwqqPcVPBtae+LGsW6yis5yVn"
    "Vt5gOCdswczxxTuCQT5pnBMAbP+OaA/iYsUtpmFIOnAa5Z86PhJRVssKBVxZVS6jCmQ45iubVH8ZnaDLHZ0P97ljXvcgLhXe"
    "NeqXj5fONlwgEi4f8cgTVcWVWlYE0WZMe62NffUm5RjC6JmAS207cix3j+a41P+hmBMsLVtwwBtLB7s83rQlP8uyp3S3z572"
    "TwuLqCiuvNDGJ2cr54E1Kmrf+2eXG+UWuRHJgX19xGsGFr73yHG5P9KkXWm6C+P1hniMgGSn8XWHFQZS3fQQY8qS53y67XAI"
    "lkzHxKu+h6sgp2niBaEQzkwJVhNjzCbznx6VBWtcTAZfITqpoqXhsvCW0FXMgv3rYkIwq3tGxTVV0dcaQigNgtO8rHFlEjbt"
    "eZmzWOKEhVRUQ9nqx6hPUEhwVuByByd85nxS8Cb2mD/h7iOn0wb0+qtUZ8hsil9VIg2+G4qTymraY5Dodi2UoszjAmdx5sIW"
    "1CcO9Q8k+E3oLNyGON3MfKIXrHW1xmytVfR5ZujJbiX5M/UDzXPWaiogCKpBeMP5I2OhroXAk3chY4dCaPRPe1zSzMGmem+g"
    "OlET7imgQPOLVe2FjetFBYM0TpGwHkGBCmo055oWqgxZmhy4ICVYoy+s8fEgZKYuLKryBmKIaU9M1AYxc7JSwiGJr2k+C+Kd"
    "iTGg/lD3ut1zTYZMkx55DTUoQ0w3YXbwj0iE9p6GiUhZgFgTsYB1s8JzeLTtlESbupvIQ5WV4LiM6RBgWginduHs5JYqzaEU"
    "GG6Y5dmuOOc260GIQaPsqYggEIRh2fwq6+4IXEjr2vo9LMBAFqtrvFoOKhFTtaD7G9q/qv/bFvCGDWxZwZt2sG0J77OFNWt4"
    "0x7eZRHbNrEY47oxBro8EEJZ2Brz9uAaiYMRjFXz2BYaVWwh0QNlSeY5SZSKlFx1tq+A6PwR07lwzRinjdSlSpD2AHELFAQK"
    "/IJ6BS0mysTWOai1oAnyGqZJqBWzX9CLSW9jsdxvPEyx8qM+C0lxucWy+JyIQmBBW/OcRlE46Fi/1d4dmqXYIaN2aRp73bl/"
    "m/VQ00VPjHctNFdxpoVc9UtwINhZdXMK4Jx2EI5Fx/VtIb1oFaSNuWYoceN69BrdmFE/PfoM7Aikn02jLGoLTly0O7LdDrmw"
    "kkDpCew4TmfuHvCKq6EZPDOudFDXKMLZ/gRxhjwcekgfZmncyKyhNtjN0rZeQ8D/I1a1O6djnmnhlqhGnO2B5z/vs/1sn5Ky"
    "rE09MrEhO3gVjUqd7Ok5W+k6ugp+8sLBB5pVnY66jKt9xo1O40avcbXbuN1vXO44LvYc17qOa33Hd3Qe3+w9rnQf3+4/LnYg"
    "Q0UIP6khGcu6CE3lU3wfS3yRp/sU30cT3xCGPgX3sQSHiP0U3scSHk7kPqX3vy69oAEy63Yu9DtxM2FKWn074cvYh8HyX6nV"
    "8adR1Fw0zXZM4Nr40dsDSKsjSGtDSBtjSFuDSO8aRQoFgT9Xj+YDG8jq/EHQCVqfSTEteVeSBvxb/Ua5PJO0Od60ObK0NLS0"
    "NDkR3h82IV7njUX8kvms0eLkUDQ7hKaHlj4SLA0krY8Xrc7+zF6x3P3cYgcaD7KdyWSrjTmvaX/JpNC8vWLd3Nyowz7Vp0n/"
    "EpPGo3j/j/aMXvjxTWSKhQJ9DEIjFNZWhnaO/xA8fOkctCAYm1lukCp5xd/2FkYX96HZzkhAfYkZHaVUV9Rz/KvIQPX1f5MM"
    "fM9IQAwf70e68Z9fH+SHMxJGHf6raQiT9hkRbnTs14nhyxB6h8br3FKWbzBfc3OuN4d5QGY/e66Y/3Q4NG/f6njbSHZnGXD3"
    "t2Fi4DcT97vfJpf1d+fwv+8e0fCQ3QmqPO0z6x6y3ffnLJpZArHB4ruA2Xf+e6Uh9rBL94/7WYrtuNXSrgv8ivk0IOvL9D3O"
    "fRIcv5oFzgxNKCbTcWXfBZ8K4lYl0gjj2b68/hukHnHY"
)


def _hashed_bodies(plan) -> list:
    """What `ExecutionPlan.content_id` hashes, captured."""
    import hashlib
    import json

    from flowrl.contract import plan as plan_module

    seen = []

    class Capture:
        def __init__(self, data: bytes):
            seen.append(json.loads(data))
            self._h = hashlib.sha256(data)

        def hexdigest(self) -> str:
            return self._h.hexdigest()

    real = plan_module.hashlib
    plan_module.hashlib = type("H", (), {"sha256": staticmethod(lambda data: Capture(data))})
    try:
        plan.content_id()
    finally:
        plan_module.hashlib = real
    return seen


def _paths_of(tree, key: str, where: str = "") -> list[str]:
    if isinstance(tree, dict):
        return [
            p
            for k, v in tree.items()
            for p in ([f"{where}.{k}"] if k == key else []) + _paths_of(v, key, f"{where}.{k}")
        ]
    if isinstance(tree, list):
        return [p for i, v in enumerate(tree) for p in _paths_of(v, key, f"{where}[{i}]")]
    return []


def test_a_false_gather_whole_is_nowhere_in_what_the_plan_id_hashes(monkeypatch):
    monkeypatch.setenv("FLOWRL_PLUGINS", "")  # the local executor: gather_whole is False everywhere
    plan = api.plan(
        "grpo", overrides=["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2"], emit=lambda s: None
    )[1]
    assert not plan.target.numerics.gather_whole
    (body,) = _hashed_bodies(plan)
    assert _paths_of(body, "gather_whole") == []


def test_a_plan_file_written_before_gather_whole_loads_with_its_id(tmp_path, monkeypatch):
    import base64
    import json
    import zlib

    from flowrl.contract.plan import load_plan

    monkeypatch.setenv("FLOWRL_PLUGINS", "")
    raw = zlib.decompress(base64.b64decode("".join(OLD_PLAN)))
    document = json.loads(raw)
    assert "gather_whole" not in raw.decode() and document["target"]["capabilities"]["numerics"]
    path = tmp_path / "plan.json"
    path.write_bytes(raw)
    plan = load_plan(path)
    assert plan.id == document["id"]
