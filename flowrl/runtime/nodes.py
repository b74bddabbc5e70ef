"""How each node kind runs, and the metrics it reports.

A node sees only the keys it reads and returns the keys it writes plus its metrics. Metrics
belong to nodes: a generate node reports tokens, response length and a sample; a reward node
(or a forward node scoring with a reward model) reports ``reward``; registered compute
functions, losses and reward functions add their own (``kl``, ``exact``, ``clipfrac``, ...).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from flowrl.contract.data import Sequences, StepBatch, sequences_in
from flowrl.contract.protocols import GenerationEngine, TrainingEngine, TrainStep
from flowrl.errors import BackendError, FlowRLError, GraphError, reworded
from flowrl.graph.ir import Compute, Filter, Forward, Generate, Graph, Reward, Source, Train
from flowrl.runtime.dispatch import draw_seed
from flowrl.runtime.rewardpool import RewardRunner, split_result
from flowrl.specs import AlgoConfig, loss_unit


@dataclass
class NodeRuntime:
    """What running nodes needs: the graph, functions by name, engines, per-node settings."""

    graph: Graph
    functions: Mapping[str, Mapping[str, Any]]  # kind -> name -> registered object
    loss_outputs: Mapping[str, str]  # loss name -> "logprobs" | "values"
    loss_aggregates: Mapping[str, str]  # loss name -> what it is a mean over (flowrl.specs.AGGREGATES)
    task: Any
    generators: Mapping[str, GenerationEngine]  # model -> its generation engine
    trainers: Mapping[str, TrainingEngine]  # model -> its training engine
    options: Mapping[str, tuple[AlgoConfig, dict[str, Any]]]  # node -> (algo, options); train: epochs, mini_batches
    micro_batch: Mapping[str, int]  # node -> micro-batch size
    seed: int
    skip_nonfinite: bool = False  # train.skip_nonfinite: let non-finite values reach the trainer, which skips
    fused: Mapping[str, str] = field(default_factory=dict)  # forward node -> the train node computing its output
    rewards: RewardRunner = field(default_factory=RewardRunner)  # how reward functions run (reward.*)
    loss_groups: Mapping[str, int] = field(default_factory=dict)  # loss name -> rows it reads together (pairs: 2)
    state: dict[str, float] = field(default_factory=dict)  # graph state: its value after the last update
    # what source nodes tokenize the data's responses with: the models' tokenizer and pad id, and the
    # response budget the plan sized the train step by (`flowrl.runtime.offline`)
    tokenizer: Any = None
    pad_id: int = 0
    response_budget: int | None = None
    _rngs: dict[str, torch.Generator] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for decl in self.graph.states.values():
            self.state.setdefault(decl.name, decl.value)

    def rng(self, node: str) -> torch.Generator:
        """The node's own random stream (seeded from the run's seed and the node's name), so that
        what a node draws does not depend on which other nodes ran first."""
        if node not in self._rngs:
            self._rngs[node] = torch.Generator().manual_seed(self.seed + zlib.crc32(node.encode()))
        return self._rngs[node]

    def rng_states(self) -> dict[str, torch.Tensor]:
        """Every node stream's state (for checkpoints)."""
        return {name: g.get_state() for name, g in self._rngs.items()}

    def restore_rngs(self, states: Mapping[str, torch.Tensor]) -> None:
        for name, state in states.items():
            self.rng(name).set_state(state)

    def fresh_generator(self, node: str) -> torch.Generator:
        """A new generator seeded from the node's stream (one per call: it may travel to workers)."""
        return torch.Generator().manual_seed(draw_seed(self.rng(node)))


def run_node(rt: NodeRuntime, name: str, batch: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run node ``name`` on ``batch``; returns (its written keys, its metrics). An error of a function
    the node calls names the node."""
    out, metrics = _naming(name, _run, rt, name, batch)
    return out, {key: _plain(value, name, key) for key, value in metrics.items()}


def _naming(name: str, fn: Any, *args: Any) -> Any:
    """``fn(*args)``, with a flowrl error it raises prefixed by node ``name`` (once)."""
    try:
        return fn(*args)
    except FlowRLError as exc:
        if str(exc).startswith(f"node '{name}'"):
            raise
        raise reworded(exc, f"node '{name}': {exc}") from None


def _user(what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call a user's (registered) function; what it raises becomes an error naming it (the node is
    added by `run_node`), not a traceback."""
    try:
        return fn(*args, **kwargs)
    except (FlowRLError, KeyboardInterrupt):
        raise
    except SystemExit as exc:
        raise GraphError(f"{what} called sys.exit({exc.code!r})") from None
    except BaseException as exc:
        raise GraphError(f"{what} raised {type(exc).__name__}: {exc}") from exc


def _plain(value: Any, node: str, key: str) -> Any:
    """A metric as a JSON value: numbers (one-element tensors and numpy scalars too), text, bool, None."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    item = getattr(value, "item", None)  # one-element tensors and arrays, numpy scalars
    if callable(item):
        try:
            value = item()
        except (ValueError, RuntimeError):
            pass
        if isinstance(value, (bool, int, float)):
            return value
    raise BackendError(f"node '{node}': metric '{key}' is {type(value).__name__}; a metric must be a number or text.")


def _read(rt: NodeRuntime, node: Any, batch: Mapping[str, Any]) -> dict[str, Any]:
    """The keys ``node`` reads (graph state from the runtime), under their port names; not those it
    computes itself (`own_keys`)."""
    port_of = {key: port for port, key in node.ports.items()}
    own = own_keys(rt, node.name)
    return {port_of.get(k, k): rt.state[k] if k in rt.state else batch[k] for k in node.reads if k not in own}


def own_keys(rt: NodeRuntime, name: str) -> set[str]:
    """The keys train node ``name`` computes in its own forward: the outputs of the forward nodes
    the plan fuses into it (`flowrl.contract.reading.fusable`)."""
    return {rt.graph.nodes[f].writes[0] for f, t in rt.fused.items() if t == name}


def _written(node: Any, out: Mapping[str, Any]) -> dict[str, Any]:
    """A function's outputs (by port) under the graph keys the node binds them to; an unbound
    output whose name is a key another port is bound to is not that key (the bound port is)."""
    bound = set(node.ports.values())
    return {node.ports.get(port, port): value for port, value in out.items() if port in node.ports or port not in bound}


def _run(rt: NodeRuntime, name: str, batch: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    node = rt.graph.nodes[name]
    runner = RUNNERS.get(type(node))
    if runner is None:  # generate nodes run as rollouts (`flowrl.runtime.rollout`), filters inside their rounds
        raise GraphError(f"node '{name}' ({node.kind}) does not run on its own: its generate task runs it.")
    inputs = _read(rt, node, batch)
    check_rows_read(node, inputs)
    algo, options = rt.options[name]
    out, metrics = runner(rt, node, inputs, algo, options)
    missing = [k for k in node.writes if k not in out]
    if missing:
        raise GraphError(f"node '{name}' did not produce its declared key(s) {', '.join(missing)}.")
    if isinstance(node, (Compute, Forward)) and not rt.skip_nonfinite:
        for key in node.writes:
            value = out[key]
            if isinstance(value, torch.Tensor) and value.is_floating_point() and not bool(torch.isfinite(value).all()):
                what = f"compute function '{node.fn}'" if isinstance(node, Compute) else f"model '{node.model}'"
                raise GraphError(
                    f"node '{name}': {what} produced a non-finite value in '{key}' "
                    f"({int((~torch.isfinite(value)).sum())} of {value.numel()}). Set train.skip_nonfinite=true "
                    "to skip the train steps it poisons instead."
                )
    return {k: out[k] for k in node.writes}, metrics


def check_rows_read(node: Any, inputs: Mapping[str, Any]) -> None:
    """Every per-row value a node reads has as many rows as the responses it reads (or one per
    prompt they answer): rows of two generate nodes (different samples per prompt, or different
    prompts) cannot be mixed."""
    seqs = [(k, v) for k, v in inputs.items() if isinstance(v, Sequences)]
    if len(seqs) != 1:
        return
    key, value = seqs[0]
    rows = len(value)
    groups = int(value.prompt_index.max()) + 1 if rows else 0  # one value per prompt (a greedy baseline) fits too
    port_key = {port: k for port, k in node.ports.items()}
    for name, v in inputs.items():
        if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] not in (rows, groups):
            raise GraphError(
                f"node '{node.name}' reads '{port_key.get(name, name)}' with {v.shape[0]} rows and "
                f"'{port_key.get(key, key)}' with {rows} responses; they come from different generate nodes "
                "(or samples per prompt). Read keys of one generate node's rows, or reduce one of them to the "
                "other's rows with a compute node first."
            )


def _check_rows(node: Compute, inputs: Mapping[str, Any], out: Mapping[str, Any]) -> None:
    """A compute function's outputs for the rows it read: tensors with one row per sequence and,
    when per token, the responses' width; a list (e.g. new prompts) has one item per row. A
    function reading no responses answers for the rows of the lists or tensors it reads."""
    seqs = next((v for v in inputs.values() if isinstance(v, Sequences)), None)
    if seqs is None:
        return
    rows, width = len(seqs), int(seqs.response_ids.shape[1])
    lists = {len(v) for v in inputs.values() if isinstance(v, list)}  # e.g. one value per prompt it reads
    for key in node.writes:
        value = out.get(key)
        if value is None or isinstance(value, Sequences):
            continue
        what = f"node '{node.name}': compute function '{node.fn}' wrote '{key}'"
        if isinstance(value, list) and not all(isinstance(x, (int, float)) for x in value):  # prompts, texts
            if len(value) != rows:
                raise GraphError(f"{what} as a list of {len(value)} items; it reads {rows} responses: one item each.")
            continue
        if not isinstance(value, torch.Tensor):
            raise GraphError(f"{what} as {type(value).__name__}; it must be a tensor ([{rows}] or [{rows}, {width}]).")
        shape = tuple(value.shape)
        if len(shape) == 1 and shape[0] in lists and shape[0] != rows:
            continue
        if not shape or shape[0] != rows or (len(shape) == 2 and shape[1] not in (width, 1)) or len(shape) > 2:
            raise GraphError(
                f"{what} with shape {list(shape)}; it reads {rows} responses of {width} tokens, so it must be "
                f"[{rows}] (one value per response) or [{rows}, {width}] (one per token)."
            )


def _compute(
    rt: NodeRuntime, node: Compute, inputs: dict[str, Any], algo: AlgoConfig, options: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    fn = rt.functions["compute_functions"][node.fn]
    with torch.no_grad():
        out, metrics = _split(_user(f"compute function '{node.fn}'", fn, inputs, algo, **options), node.name)
    out = _written(node, out)
    _check_rows(node, inputs, out)
    metrics.update(_update_state(rt, node, out))
    return out, metrics


def _update_state(rt: NodeRuntime, node: Compute, out: Mapping[str, Any]) -> dict[str, float]:
    """The state ``node`` updates, from its outputs: clamped to the state's bounds, kept for the
    next iteration and reported as a metric under the state's name."""
    metrics = {}
    for name in node.updates:
        if name not in out:
            raise GraphError(
                f"node '{node.name}': compute function '{node.fn}' did not return state '{name}', which the node "
                "updates."
            )
        try:
            value = float(out[name])
        except (TypeError, ValueError, RuntimeError):
            raise GraphError(
                f"node '{node.name}': compute function '{node.fn}' returned {type(out[name]).__name__} for state "
                f"'{name}'; a state is one number."
            ) from None
        if value != value or value in (float("inf"), float("-inf")):
            raise GraphError(f"node '{node.name}': compute function '{node.fn}' set state '{name}' to {value}.")
        decl = rt.graph.states[name]
        value = min(
            max(value, decl.low if decl.low is not None else value), decl.high if decl.high is not None else value
        )
        rt.state[name] = value
        metrics[name] = round(value, 8)
    return metrics


def filter_groups(rt: NodeRuntime, name: str, batch: Mapping[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
    """Run filter ``name`` on ``batch``: which of the responses' groups (prompts, by
    ``prompt_index``) it keeps, as a bool tensor over prompt numbers 0..max(prompt_index); for a
    filter that keeps rows (``by_row``), which rows, one bool per response. An error of its
    function names the node."""
    return _naming(name, _filter_groups, rt, name, batch)


def _filter_groups(rt: NodeRuntime, name: str, batch: Mapping[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
    node = rt.graph.nodes[name]
    assert isinstance(node, Filter)
    inputs = _read(rt, node, batch)
    check_rows_read(node, inputs)
    seqs = sequences_in(inputs, f"node '{name}'")
    algo, options = rt.options[name]
    fn = rt.functions["filters"][node.fn]
    with torch.no_grad():
        result = _user(f"filter function '{node.fn}'", fn, inputs, algo, **options)
    groups = int(seqs.prompt_index.max()) + 1 if len(seqs) else 0
    try:
        keep = torch.as_tensor(result).flatten().bool()
    except (TypeError, ValueError, RuntimeError):
        keep = None
    if keep is None or keep.numel() not in (groups, len(seqs)):
        raise GraphError(
            f"node '{name}': filter function '{node.fn}' must return one bool per group ({groups}) or per response "
            f"({len(seqs)}); got {type(result).__name__}" + ("" if keep is None else f" of {keep.numel()}") + "."
        )
    if node.by_row:  # one bool per row (a group's verdict holds for each of its rows)
        return (keep if keep.numel() == len(seqs) else keep[seqs.prompt_index]), {}
    if keep.numel() == len(seqs) and groups != len(seqs):  # per row: a group stays when all its rows do
        per_group = torch.ones(groups, dtype=torch.bool)
        per_group[seqs.prompt_index[~keep]] = False
        keep = per_group
    return keep, {}


def _split(result: Any, node: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A function returns its outputs, or (outputs, metrics)."""
    out, metrics = result if isinstance(result, tuple) else (result, {})
    if not isinstance(out, Mapping) or not isinstance(metrics, Mapping):
        raise GraphError(
            f"node '{node}': its function must return a dict of outputs, or (outputs, metrics); got "
            f"{type(result).__name__}."
        )
    return dict(out), dict(metrics)


def generate_metrics(prompts: list[Any], seqs: Sequences) -> dict[str, Any]:
    """What a generate node reports about its responses: mean length and one sample."""
    return {
        "response_length": round(float(seqs.response_lengths.float().mean()), 3) if len(seqs) else 0.0,
        "sample": f"{prompts[int(seqs.prompt_index[0])].text}{seqs.texts[0]}" if len(seqs) else "",
    }


def _forward(
    rt: NodeRuntime, node: Forward, inputs: dict[str, Any], algo: AlgoConfig, options: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    seqs = sequences_in(inputs, f"node '{node.name}'")
    if not len(seqs):  # a filter that keeps rows kept none this step
        shape = (0,) if node.output == "scores" else (0, seqs.response_ids.shape[1])
        return {node.writes[0]: torch.zeros(shape)}, {"empty": 1}
    engine = rt.trainers[node.model]
    splits = getattr(engine, "oom_splits", 0)  # an engine that splits micro-batches out of memory counts them
    values = engine.forward(seqs, node.output, rt.micro_batch[node.name])
    metrics: dict[str, Any] = {}
    if getattr(engine, "oom_splits", 0) > splits:
        metrics["oom_splits"] = engine.oom_splits - splits
    role = rt.graph.models[node.model].role
    if node.output == "scores" and role in ("reward", "cost"):
        metrics[role] = round(float(values.float().mean()), 6)
    if node.output == "logprobs" and _generated_by(rt.graph, node.reads[0]) == node.model:
        metrics.update(logprob_gap(values, inputs[node.reads[0]], rt.trainers[node.model].version))
    return {node.writes[0]: values}, metrics


def _generated_by(graph: Graph, key: str) -> str | None:
    """The model whose generate node writes ``key``, if one does."""
    return next((n.model for n in graph.nodes.values() if isinstance(n, Generate) and key in n.writes), None)


def logprob_gap(logprobs: torch.Tensor, seqs: Sequences, version: int) -> dict[str, float]:
    """How far the training forward's log-probs are from the sampler's on the tokens the same
    weights sampled: ``logprob_gap`` (mean |difference|) and ``logprob_gap_max``. Zero in exact
    arithmetic; a large gap means the generation engine samples from a different policy than the
    one trained (numerics, a missed weight sync), which silently biases every update."""
    if seqs.logprobs is None or seqs.versions is None:
        return {}
    same = seqs.sampled_mask.bool() & (seqs.versions == version)
    if not bool(same.any()):
        return {}
    gap = (logprobs.float() - seqs.logprobs.float()).abs()[same]
    return {"logprob_gap": round(float(gap.mean()), 8), "logprob_gap_max": round(float(gap.max()), 8)}


def _reward(
    rt: NodeRuntime, node: Reward, inputs: dict[str, Any], algo: AlgoConfig, options: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    seqs = sequences_in(inputs, f"node '{node.name}'")
    prompts = next((v for v in inputs.values() if isinstance(v, list)), None)
    if prompts is None:
        raise GraphError(
            f"node '{node.name}' reads no list of prompts; a reward node scores responses against the prompts "
            "they answer."
        )
    rows = [prompts[i] for i in seqs.prompt_index.tolist()]
    fn = rt.functions["reward_functions"][node.fn]
    if rt.rewards.direct(fn):
        result = _user(f"reward function '{node.fn}'", fn, rows, seqs.reward_texts(), rt.task, **options)
        scores, metrics = split_result(result)
        metrics = {} if metrics is None else metrics
    else:
        scores, metrics = _pooled(rt, node, fn, rows, seqs, options)
    if not isinstance(metrics, Mapping):
        raise GraphError(
            f"node '{node.name}': reward function '{node.fn}' returned (scores, {type(metrics).__name__}); the "
            "second item must be a dict of metrics."
        )
    try:
        scores = torch.as_tensor(scores, dtype=torch.float32).flatten()
    except (TypeError, ValueError, RuntimeError) as exc:
        raise GraphError(
            f"node '{node.name}': reward function '{node.fn}' must return one number per response; got "
            f"{type(scores).__name__} ({exc})."
        ) from None
    if scores.numel() == len(seqs) and not bool(torch.isfinite(scores).all()):
        bad = int((~torch.isfinite(scores)).nonzero()[0])
        raise GraphError(
            f"node '{node.name}': reward function '{node.fn}' returned {float(scores[bad])} for response {bad} "
            f"({seqs.texts[bad]!r}); rewards must be finite."
        )
    if scores.numel() != len(seqs):
        raise GraphError(
            f"node '{node.name}': reward function '{node.fn}' returned {scores.numel()} scores for {len(seqs)} "
            "responses."
        )
    name = "cost" if "cost" in node.writes[0] else "reward"  # a cost node's mean is not the headline reward
    return {node.writes[0]: scores}, {name: round(float(scores.mean()), 6), **dict(metrics)}


def _pooled(
    rt: NodeRuntime, node: Reward, fn: Any, rows: list[Any], seqs: Sequences, options: dict[str, Any]
) -> tuple[list[float], dict[str, Any]]:
    """A reward function's scores from calls run by `flowrl.runtime.rewardpool`, a failed call's rows
    scored by ``reward.on_error``; the calls' numeric metrics averaged, their errors and timeouts counted."""
    runner = rt.rewards
    outcomes, cuts = runner.score(node.fn, fn, rows, seqs.reward_texts(), rt.task, options)
    scores: list[float] = [0.0] * len(rows)
    failed: list[int] = []
    errors = timeouts = 0
    parts: list[tuple[int, dict[str, Any]]] = []  # (rows, metrics) of each call that scored
    for o, cut in zip(outcomes, cuts):
        width = cut.stop - cut.start
        if o.error is None and (o.scores is None or len(o.scores) != width):
            o.error = f"returned {0 if o.scores is None else len(o.scores)} scores for {width} responses"
        if o.error is None and not all(math.isfinite(x) for x in o.scores):  # type: ignore[union-attr]
            o.error = f"returned a non-finite score ({o.scores})"
        if o.error is not None:
            errors, timeouts = errors + 1, timeouts + o.timed_out
            if runner.on_error == "fail":
                raise GraphError(
                    f"reward function '{node.fn}' {'' if o.timed_out else 'failed: '}{o.error} on responses "
                    f"{cut.start}..{cut.stop - 1} (e.g. {seqs.texts[cut.start]!r}). Set reward.on_error=zero or drop "
                    "to score such calls instead of stopping" + (", or raise reward.timeout_s." if o.timed_out else ".")
                )
            failed.extend(range(cut.start, cut.stop))
            continue
        scores[cut] = o.scores  # type: ignore[assignment]
        parts.append((width, o.metrics))
    if failed and runner.on_error == "drop":  # the prompt's other rows' mean: no group-relative advantage
        bad = set(failed)
        index = seqs.prompt_index.tolist()
        for i in failed:
            others = [scores[j] for j in range(len(rows)) if index[j] == index[i] and j not in bad]
            scores[i] = sum(others) / len(others) if others else 0.0
    return scores, {**_merged(parts), "errors": errors, "timeouts": timeouts}


def _merged(parts: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
    """The metrics of a batch scored in calls, as one call over all its rows would report them: a
    fraction or mean (a float) weighted by each call's rows, a count (an int) summed, anything else
    (text) the first call's."""
    out: dict[str, Any] = {}
    for key in dict.fromkeys(k for _, m in parts for k in m):
        have = [(n, m[key]) for n, m in parts if key in m]
        values = [v for _, v in have]
        if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            out[key] = sum(values)
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            out[key] = sum(n * v for n, v in have) / max(sum(n for n, _ in have), 1)
        else:
            out[key] = values[0]
    return out


def _checked_loss(loss: Any, name: str, options: Mapping[str, Any]) -> Any:
    """``loss`` called with the node's ``options`` (keyword arguments), returning what the engine
    backpropagates: (a scalar tensor, a dict of stats)."""

    def checked(out: Any, batch: Any, algo: Any) -> tuple[torch.Tensor, dict[str, float]]:
        result = _user(f"loss '{name}'", loss, out, batch, algo, **options)
        value, stats = result if isinstance(result, tuple) and len(result) == 2 else (result, None)
        if not isinstance(value, torch.Tensor) or value.numel() != 1 or not isinstance(stats, Mapping):
            got = (
                f"({type(value).__name__}, {type(stats).__name__})"
                if isinstance(result, tuple) and len(result) == 2
                else type(result).__name__
            )
            raise GraphError(f"loss '{name}' returned {got}; a loss returns (a one-element tensor, a dict of stats).")
        return value, dict(stats)

    return checked


def _train(
    rt: NodeRuntime, node: Train, inputs: dict[str, Any], algo: AlgoConfig, options: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    seqs_key = next(k for k, v in inputs.items() if isinstance(v, Sequences))
    port_of = {key: port for port, key in node.ports.items()}
    step = TrainStep(
        node=node.name,
        sequences_key=seqs_key,
        output=rt.loss_outputs[node.loss],
        micro_batch=rt.micro_batch[node.name],
        epochs=int(options["epochs"]),
        mini_batches=int(options["mini_batches"]),
        algo=algo,
        generator=rt.fresh_generator(node.name),
        unit=loss_unit(rt.loss_aggregates[node.loss], algo),
        own=tuple(sorted(port_of.get(k, k) for k in own_keys(rt, node.name))),
        group=rt.loss_groups.get(node.loss, 1),
    )
    trainer = rt.trainers[node.model]
    # the version the batch's proximal log-probs were computed with: tokens it sampled are on-policy
    batch = StepBatch(inputs, policy_version=trainer.version)
    loss = rt.functions["losses"][node.loss]
    loss_options = {k: v for k, v in options.items() if k not in ("epochs", "mini_batches")}
    checked = _checked_loss(loss, node.loss, loss_options)
    stats = _user(f"training with loss '{node.loss}'", trainer.train, checked, batch, step)
    stats = {k: round(v, 6) for k, v in stats.items()}
    if not len(inputs[seqs_key]):  # a filter that keeps rows kept none: the engine took a step without an update
        stats["empty"] = 1
    return ({node.writes[0]: stats} if node.writes else {}), stats


def _source(
    rt: NodeRuntime, node: Source, inputs: dict[str, Any], algo: AlgoConfig, options: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    from flowrl.runtime.offline import offline_sequences

    prompts = inputs[node.reads[0]]
    seqs, metrics = offline_sequences(
        prompts, rt.task, rt.tokenizer, rt.pad_id, rows=node.rows, budget=rt.response_budget, node=node.name
    )
    return {node.writes[0]: seqs}, metrics


#: How each kind of node runs on the controller: ``runner(rt, node, inputs, algo, options) -> (outputs, metrics)``.
RUNNERS: dict[type, Any] = {
    Source: _source,
    Forward: _forward,
    Reward: _reward,
    Compute: _compute,
    Train: _train,
}


def node_runtime(
    graph: Graph,
    plan: Any,
    registry: Any,
    task: Any,
    generators: Mapping[str, GenerationEngine],
    trainers: Mapping[str, TrainingEngine],
    fused: bool = True,
) -> NodeRuntime:
    """How the nodes of ``graph`` run as ``plan`` resolved them (functions and losses from ``registry``,
    node options, micro-batches, reward settings); ``fused``: forwards the plan fuses into a train
    node are computed there (the serial reference loop runs them as their own nodes)."""
    import msgspec

    from flowrl.plugins.manager import node_functions

    cfg = plan.config
    return NodeRuntime(
        graph=graph,
        functions=node_functions(registry),
        loss_outputs={e.name: e.meta.get("output", "logprobs") for e in registry.entries("losses")},
        loss_aggregates={e.name: e.meta.get("aggregate", "token-mean") for e in registry.entries("losses")},
        task=task,
        generators=generators,
        trainers=trainers,
        options={name: (o.algo, dict(o.options)) for name, o in plan.options.items()},
        micro_batch={n.node: n.micro_batch_size for n in plan.nodes},
        seed=cfg.seed,
        skip_nonfinite=cfg.train.skip_nonfinite,
        fused=dict(plan.fused) if fused else {},
        rewards=RewardRunner(**msgspec.structs.asdict(cfg.reward)),
        loss_groups={e.name: int(e.meta.get("group", 1)) for e in registry.entries("losses")},
    )
