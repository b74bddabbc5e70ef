"""The ``flowrl`` command: run | plan | show | plugins (and commands plugins add).

User errors (FlowRLError) print one paragraph and exit with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import errno
import math
import sys
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from flowrl.contract.reading import lora_on_fresh_weights
from flowrl.errors import ConfigError, FlowRLError
from flowrl.specs import DATA_TASK, writable

EXIT_USER_ERROR = 2


def _config_args(p: argparse.ArgumentParser, run_out: bool = True) -> None:
    p.add_argument("graph", nargs="?", help="a graph file (graphs/grpo.py) or an algorithm name (grpo)")
    p.add_argument("--config", metavar="FILE", help="YAML, TOML or JSON run config")
    p.add_argument(
        "--set",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        dest="overrides",
        help="override one config field, e.g. --set train.lr=1e-3 (repeatable)",
    )
    p.add_argument("--steps", type=int, help="training iterations")
    p.add_argument("--seed", type=int)
    p.add_argument(
        "--model",
        metavar="DIR",
        help="an HF-format model directory (default: a tiny random Llama); with plan --cluster: a preset or "
        "config.json",
    )
    p.add_argument("--task", help="a registered task (see `flowrl plugins`)")
    p.add_argument(
        "--data",
        metavar="FILE",
        action="append",
        help="train on prompts from a jsonl, json, csv or parquet file or a datasets folder (repeatable; "
        "the config's data.train)",
    )
    p.add_argument(
        "--logger",
        metavar="NAMES",
        help="send metrics to trackers too: tensorboard, wandb, mlflow, trackio (comma-separated; offline)",
    )
    if run_out:
        p.add_argument("--out", metavar="DIR", dest="run_out", help="where runs/<name> goes (default: runs)")
    p.add_argument("--name", help="run name (default: the graph's name)")
    p.add_argument("--executor", help="the executor that runs the plan (default: local; see `flowrl plugins`)")
    p.add_argument("--backend", help="the older name of --executor")


def _pin_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--placement",
        choices=["colocate", "split", "standalone", "disaggregated"],
        help="with --cluster: only plans with this placement",
    )
    p.add_argument(
        "--sync",
        choices=["reshard", "full", "bucketed", "sparse"],
        help="with --cluster: only plans with this weight-sync strategy",
    )
    p.add_argument(
        "--require",
        action="append",
        metavar="KEY=VALUE",
        help="with --cluster: only plans that satisfy it (repeatable): placement=colocate, sync=full, "
        "rollout.mode=sync, generation.tp=2, generation.devices=8 (the group that generates), actor.tp=2 "
        "(MODEL.dp/tp/pp)",
    )
    p.add_argument(
        "--objective",
        metavar="NAME",
        help="what the tuner ranks plans by: throughput (seconds per iteration, samples/s; the default) or "
        "time-to-target (predicted seconds to the target reward: seconds per iteration x the iterations the "
        "rollout policy needs, from the sample efficiency `flowrl calibrate` fitted, else a published prior)",
    )
    p.add_argument(
        "--target-steps",
        metavar="N",
        type=int,
        dest="target_steps",
        help="with --objective time-to-target: the iterations a synchronous run needs to reach the target "
        "(default: the run config's steps)",
    )


def _pins(args: argparse.Namespace) -> dict[str, Any]:
    pins = {"placement": args.placement, "weight_sync": args.sync}
    if any(pins.values()) and not args.cluster and not getattr(args, "address", None):
        raise ConfigError(
            "--placement / --sync choose among a cluster's plans; add --cluster (e.g. --cluster cpu:2) or --address."
        )
    return pins


def _objective(args: argparse.Namespace) -> dict[str, Any]:
    """``--objective`` and ``--target-steps`` as the planner's options (a bad name is a user error)."""
    from flowrl.planner.sample_efficiency import check_objective

    out: dict[str, Any] = {}
    if getattr(args, "objective", None) is not None:
        out["objective"] = check_objective(args.objective)
    steps = getattr(args, "target_steps", None)
    if steps is not None:
        if steps < 1:
            raise ConfigError(f"--target-steps is {steps}; give the iterations a synchronous run needs (>= 1).")
        out["target_steps"] = steps
    return out


def _requirements(args: argparse.Namespace) -> dict[str, Any]:
    """``--require KEY=VALUE`` as the planner's constraints (and, with --explain, a request for the
    unconstrained winner beside the constrained one)."""
    items = getattr(args, "require", None) or []
    if not items:
        return {}
    if not args.cluster and not getattr(args, "address", None):
        raise ConfigError(
            "--require chooses among a cluster's plans; add --cluster (e.g. --cluster 16xA100-80G) or --address."
        )
    from flowrl import api
    from flowrl.planner.constraints import parse_requirements

    graph, _ = api.load(_need_graph(args), **_load_kwargs(args))
    return {"require": parse_requirements(items, graph.models), "compare": bool(getattr(args, "explain", False))}


def _flags(args: argparse.Namespace) -> dict[str, Any]:
    model = args.model
    if model is not None and Path(model).is_dir():  # a folder: kept absolute in the plan, so it resumes anywhere
        model = str(Path(model).resolve())
    elif model is not None and not getattr(args, "cluster", None):
        from flowrl.planner.modelspec import MODEL_PRESETS
        from flowrl.specs import model_folders

        default, named = model_folders(model)  # NAME=DIR,...: a folder per graph model or role
        entries = {**({"": default} if default is not None and named else {}), **named}
        missing = [f"'{k}' ({v})" if k else f"'{v}'" for k, v in entries.items() if not Path(v).expanduser().is_dir()]
        paths = any(("/" in v or "\\" in v or v.startswith(("~", "."))) for v in entries.values())
        if named and not missing:  # every value a folder: kept absolute, like a single folder
            model = ",".join(
                f"{k}={Path(v).expanduser().resolve()}" if k else str(Path(v).expanduser().resolve())
                for k, v in entries.items()
            )
        elif named and (len(missing) < len(entries) or paths):  # a path, not a preset: --cluster would not help
            raise ConfigError(
                f"--model '{model}': the folder of {', '.join(missing)} does not exist; every NAME=DIR entry of a "
                "run names an HF model directory."
            )
        elif named or model.strip().lower() in {k.lower() for k in MODEL_PRESETS}:
            raise ConfigError(
                f"--model '{model}' is a planner model (a preset or per-role models): it plans for a named cluster, "
                "so add --cluster (e.g. --cluster 8xH100-80G). To run, give --model an HF model directory, or one "
                "per graph model or role (actor=DIR,reward=DIR2)."
            )
    return {
        "steps": args.steps,
        "seed": args.seed,
        "model": model,
        "task": args.task,
        "out": getattr(args, "run_out", None),
        "name": args.name,
        "executor": args.executor,
        "backend": args.backend,  # the older name of executor (specs.OLDER_NAMES)
        "save_every": getattr(args, "save_every", None),
        "max_restarts": getattr(args, "max_restarts", None),
        "replan_on_loss": True if getattr(args, "replan_on_loss", False) else None,
        "device_wait_s": getattr(args, "device_wait", None),
        "data": {"train": args.data} if getattr(args, "data", None) else None,
        "log": {"loggers": [n.strip() for n in args.logger.split(",") if n.strip()]}
        if getattr(args, "logger", None)
        else None,
        "trust_remote_code": True if getattr(args, "trust_remote_code", False) else None,
    }


def _executor_flag(args: argparse.Namespace) -> str | None:
    """--executor, or --backend (its older name)."""
    return args.executor or args.backend


def _load_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    from flowrl.specs import read_document

    return {
        "config_file": read_document(args.config) if args.config else None,
        "overrides": args.overrides,
        "flags": _flags(args),
    }


def _need_graph(args: argparse.Namespace) -> str:
    if not args.graph:
        raise ConfigError(
            "name a graph file or algorithm, e.g. `flowrl run graphs/grpo.py` (see `flowrl plugins` for "
            "algorithm names)."
        )
    return args.graph


# ------------------------------------------------------------------ commands


def _graph_of_plan(args: argparse.Namespace, plan: Any, flag: str, where: str) -> Any:
    """The graph a plan (or a run folder's plan) names. A graph *file* is code: it runs only when
    the command line names it too, so a plan someone sends cannot run a file you did not choose."""
    from flowrl import api

    source = plan.graph.source
    is_file = bool(_file_arg(plan))
    if args.graph and not is_file and args.graph != source:
        raise ConfigError(f"{flag} '{where}' was made for graph '{source}' (an algorithm), not '{args.graph}'.")
    if is_file and not args.graph:
        raise ConfigError(
            f"{flag} '{where}' would run the graph file '{source}', which is Python code; flowrl runs a graph "
            f"file only when you name it: `flowrl run {source} {flag} {where}`."
        )
    # the file named here (from any directory); it must build the graph the plan was made for
    return api.graph_for_plan(plan, source=args.graph if is_file else None)


def _file_arg(plan: Any) -> list[str]:
    """The graph file a plan names, as the command line must name it to run the plan ([] for an algorithm)."""
    source = plan.graph.source
    return [source] if source.endswith(".py") or "/" in source or "\\" in source else []


def _resume(args: argparse.Namespace) -> tuple[Any, Any, Path]:
    """The graph, plan and folder of ``--resume DIR`` (``--steps`` may extend the run)."""
    import msgspec

    from flowrl.contract.plan import load_plan

    folder = Path(args.resume)
    if args.plan:
        raise ConfigError(f"--resume continues the run in '{folder}' with its own plan; drop --plan.")
    settings = _run_settings(args, "--resume")
    if not (folder / "plan.yaml").is_file():
        what = "does not exist" if not folder.exists() else "is not a run folder (it has no plan.yaml)"
        raise ConfigError(f"--resume '{folder}' {what}; name a folder a run wrote, e.g. runs/grpo.")
    plan = _own_trust(load_plan(folder / "plan.yaml"), settings)
    if plan.config.log.loggers:  # before any worker starts: a damaged trackers.json is named now
        from flowrl.runtime.trackers import read_ids

        read_ids(folder)
    graph = _graph_of_plan(args, plan, "--resume", str(folder))
    if args.steps is not None and args.steps != plan.config.steps:
        from flowrl.runtime.checkpoint import latest

        found = latest(folder)
        done = found[0] + 1 if found else 0
        if args.steps < done:
            raise ConfigError(
                f"--steps {args.steps}: the run in '{folder}' has done {done} steps already; --steps sets the "
                "total, so give at least that many (or omit it to finish the planned run)."
            )
        plan = msgspec.structs.replace(plan, config=msgspec.structs.replace(plan.config, steps=args.steps))
        plan = msgspec.structs.replace(plan, id=plan.content_id())
    return graph, plan, folder


def _own_trust(plan: Any, settings: dict[str, Any]) -> Any:
    """``plan`` with the run settings of this command line; ``trust_remote_code`` only as this command
    line gives it: a plan file or a run folder's plan.yaml never lets a model folder's code run."""
    settings = {**settings, "trust_remote_code": bool(settings.get("trust_remote_code"))}
    if plan.config.trust_remote_code == settings["trust_remote_code"]:
        settings.pop("trust_remote_code")
    return plan.with_run_settings(settings) if settings else plan


def _check_model_code(cfg: Any) -> None:
    """Refuse, before anything loads, a --model folder with its own Python when the run does not trust it."""
    from flowrl.specs import check_remote_code, model_folders

    default, named = model_folders(cfg.model)
    for key, folder in {**({"": default} if default is not None else {}), **named}.items():
        if Path(folder).is_dir():
            check_remote_code(folder, cfg.trust_remote_code, f"--model {key + '=' if key else ''}folder")


#: What a --plan or --resume run may change besides the plan: where the run goes and how it
#: checkpoints and reports (specs.RUN_SETTINGS; --resume's folder is the run's own, and --steps extends it).
_RUN_SETTINGS_HELP = {
    "--plan": "With --plan, only where the run goes and how it checkpoints and reports may change: --out DIR, --name "
    "NAME, --save-every N, --set keep_checkpoints=N, --set progress=false, --logger NAMES, --set eval.*/log.*, "
    "--max-restarts N, --replan-on-loss, --device-wait S, --trust-remote-code.",
    "--resume": "With --resume, only --steps N (to extend it) and how the run checkpoints and reports may change: "
    "--save-every N, --set keep_checkpoints=N, --set progress=false, --logger NAMES, --set eval.*/log.*, "
    "--max-restarts N, --replan-on-loss, --device-wait S, --trust-remote-code.",
}


def _run_settings(args: argparse.Namespace, flag: str) -> dict[str, Any]:
    """The run settings given with ``--plan`` / ``--resume`` (by flags, ``--set`` or ``--config``).
    Anything else would change what was planned and is refused, naming it."""
    from flowrl.specs import RUN_SETTINGS, current_names, merge, nested, parse_override, read_document

    pinned = [f for f, v in (("--cluster", args.cluster), ("--placement", args.placement), ("--sync", args.sync)) if v]
    flags = {k: v for k, v in _flags(args).items() if v is not None and not (flag == "--resume" and k == "steps")}
    given: dict[str, Any] = {}
    for layer in [read_document(args.config)] if args.config else []:
        given = merge(given, current_names(layer))
    for text in args.overrides:
        given = merge(given, current_names(nested(*parse_override(text))))
    refused = pinned + [f"--{k.replace('_', '-')}" for k in flags if k not in RUN_SETTINGS]
    refused += [path for k, v in given.items() if k not in RUN_SETTINGS for path in _dotted(k, v)]
    if flag == "--resume":
        folder = [f"--{k}" if k in flags else k for k in ("out", "name") if k in flags or k in given]
        if folder:
            verb, them = ("choose", "them") if len(folder) > 1 else ("chooses", "it")
            raise ConfigError(
                f"--resume continues the run in its own folder '{args.resume}'; {' and '.join(folder)} {verb} where "
                f"a new run goes: drop {them}. {_RUN_SETTINGS_HELP[flag]}"
            )
    if refused:
        raise ConfigError(
            f"{flag} runs a plan exactly as planned; {', '.join(refused)} would change what was planned: put config "
            f"changes into `flowrl plan` instead (or start a new run). {_RUN_SETTINGS_HELP[flag]}"
        )
    return {k: v for k, v in merge(given, current_names(flags)).items() if k in RUN_SETTINGS}


def _dotted(key: str, value: Any) -> list[str]:
    """The dotted field paths a config mapping sets under ``key`` (``train`` -> ``train.lr``)."""
    if isinstance(value, dict) and value:
        return [path for k, v in value.items() for path in _dotted(f"{key}.{k}", v)]
    return [key]


def cmd_run(args: argparse.Namespace) -> int:
    from flowrl import api
    from flowrl.contract.plan import load_plan

    folder = None
    if args.resume:
        graph, plan, folder = _resume(args)
    elif args.plan:
        settings = _run_settings(args, "--plan")
        plan = _own_trust(load_plan(args.plan), settings)
        graph = _graph_of_plan(args, plan, "--plan", args.plan)
    else:
        kwargs = _load_kwargs(args)
        target = _cluster_target(args, kwargs, for_run=True) if args.cluster else None
        if args.address:
            target = _joined_target(args, kwargs, target)
        graph, plan = api.plan(
            _need_graph(args),
            emit=print,
            target=target,
            for_backend=True,
            options={**_pins(args), **_requirements(args), **_objective(args)},
            **kwargs,
        )
    executor = api.check(graph, plan)
    if args.address:
        if not hasattr(executor, "address"):
            raise ConfigError(
                f"--address joins an existing cluster; executor '{plan.config.executor}' runs in this process."
            )
        executor.address = args.address
    cfg = plan.config
    _check_model_code(cfg)
    doing = f"resuming {folder}" if folder is not None else "running"
    print(
        f"flowrl: {doing} {graph.name} ({plan.graph.source}) on task '{cfg.task}' for {cfg.steps} steps, plan {plan.id}"
    )
    from flowrl.planner.passes.resolve import unused_generation_settings

    for warning in [*lora_on_fresh_weights(plan), *unused_generation_settings(graph, cfg)]:
        print(f"flowrl: warning: {warning}", file=sys.stderr)
    if cfg.task == DATA_TASK:  # what was read of the user's files
        from flowrl.tasks.dataset import load as load_data

        for line in load_data(cfg).report.lines():
            print(f"flowrl: {line}")
    done = 0
    if folder is not None:
        from flowrl.runtime.checkpoint import latest

        found = latest(folder)
        done = found[0] + 1 if found else 0
    bar = _progress(cfg.steps, enabled=cfg.progress and not args.quiet, initial=done)
    try:
        result = api.run(
            graph, plan, on_step=bar.update, executor=executor, out_dir=folder, resume=folder is not None, emit=bar.say
        )
    finally:
        bar.close()
    if result.restarts:
        print(f"flowrl: restarted {len(result.restarts)} time(s) after a lost worker or node:")
        for r in result.restarts:
            print(f"  {restart_line(r)}")
    elif folder is not None and result.resumed_from == 0:
        print(f"flowrl: {folder} had no checkpoint yet; the run started over at step 0.")
    elif folder is not None and result.resumed_from is not None:
        note = "nothing left to run" if result.resumed_from >= cfg.steps else f"continued at step {result.resumed_from}"
        print(f"flowrl: resumed from the checkpoint after step {result.resumed_from - 1} ({note}).")
    summary = _summary(result.metrics)
    again = api.resume_command(plan, result.out_dir, args.address)
    if result.stopped is not None:
        print(f"flowrl: stopped after step {result.stopped}. {summary}")
        print(f"  checkpoint: {result.last_checkpoint}")
        print(f"  continue with: {again}")
        return 130
    print(f"flowrl: done. {summary}")
    if result.evals:  # the first and the last evaluation, side by side
        first, last = result.evals[0], result.evals[-1]
        counts = ("eval/prompts", "eval/pairs")
        shown = [k for k in last if k.startswith("eval/") and k.count("/") == 1 and k not in counts and k in first]
        pairs = ", ".join(f"{k[5:]} {first[k]:.3f} -> {last[k]:.3f}" for k in shown)
        print(f"  evaluation: after {first['step']} -> {last['step']} steps: {pairs}")
        samples = result.out_dir / "samples.jsonl"
        if samples.is_file() and samples.stat().st_size:  # an evaluation that generates nothing writes none
            print(f"  samples:    {samples}")
    print(f"  metrics:    {result.out_dir / 'metrics.jsonl'}")
    if result.metrics:
        print(f"  curve:      {result.out_dir / 'reward.png'}")
    for model, path in result.checkpoints.items():
        role = graph.models[model].role if model in graph.models else "actor"
        hint = f"; continue from it with --model {path}" if path.name == "checkpoint" else ""
        if role in ("reward", "cost"):  # an HF sequence-classification model: what PPO with a reward model scores with
            hint = f"; score with it: --model {role}={path}"
        print(f"  checkpoint: {path}  (model '{model}'{hint})")
    if result.last_checkpoint is not None:
        print(f"  resumable:  {result.last_checkpoint}  (extend with `{again} --steps N`)")
    if (result.out_dir / "trace.json").is_file() and plan.layout is not None and plan.layout.predicted is not None:
        calibrated = plan.target.cluster.hardware.calibration is not None
        note = "calibrated" if calibrated else "uncalibrated"
        print(
            f"  timeline:   {result.out_dir / 'timeline.png'}  (measured beside the plan's {note} prediction, "
            f"{plan.layout.predicted.iteration_s:.3f} s/iteration)"
        )
        if not calibrated:
            print(f"  calibrate:  `flowrl calibrate {result.out_dir}` fits the planner to what this run measured")
    return 0


def restart_line(record: dict[str, Any]) -> str:
    """A restart record (`flowrl.runtime.recovery`) as a line of the run's summary."""
    info = record["restart"]
    what = "re-planned, " if info["replanned"] else ""
    when = f"in iteration {info['iteration']}" if info["iteration"] is not None else "during setup"
    who = f"worker rank {info['rank']}" if info["rank"] is not None else "a worker"
    return f"restart {info['count']}: {who} lost {when}; {what}continued at step {record['step']}"


def _engine_choice(engine: str, predicted: Mapping[str, float]) -> str:
    """Why the plan generates with ``engine``: the candidates' predicted step times, when it chose."""
    if not predicted:
        return f"generation engine: {engine} (configured, or the only one calibrated here)"
    others = ", ".join(f"{name} {s:.3g} s" for name, s in sorted(predicted.items(), key=lambda kv: kv[1]))
    return f"generation engine: {engine}, the fastest predicted step of the engines calibrated here ({others})"


def _constraint_cost(require: Any, constrained: Any, free: Any) -> str:
    """The best plan under --require beside the unconstrained winner, per component."""
    a, b = constrained.ranked[0], free.ranked[0]
    ta, tb = a.result.iteration_s, b.result.iteration_s
    lines = [
        f"constrained ({require.describe()}): {ta:.2f} s/iteration  {a.plan.summary()}",
        f"unconstrained winner: {tb:.2f} s/iteration  {b.plan.summary()}",
        f"  the constraints cost {ta - tb:+.2f} s/iteration ({(ta / tb - 1) * 100:+.0f}%); per component "
        "(constrained - unconstrained, mean seconds per iteration):",
    ]
    keys = dict.fromkeys([*a.result.breakdown, *b.result.breakdown])
    diffs = {k: a.result.breakdown.get(k, 0.0) - b.result.breakdown.get(k, 0.0) for k in keys}
    for k, d in sorted(diffs.items(), key=lambda kv: -abs(kv[1])):
        if abs(d) >= 5e-4:
            lines.append(f"    {k:<22} {d:+.3f}")
    return "\n".join(lines)


def _dynamic_sampling(graph: Any, plan: Any) -> list[str]:
    """How the plan costs each filter's dynamic sampling: the rounds its acceptance rate implies."""
    workload = plan.target.workload
    out = []
    for gen, name in graph.filters().items():
        rate = workload.acceptance_rate if workload is not None else 1.0
        rounds = min(1 / rate, graph.nodes[name].max_rounds)
        source = "measured by a run" if rate < 1 else "1.0 until a run measures it (its plan.yaml)"
        out.append(
            f"dynamic sampling: filter '{name}' passes {rate:.0%} of the groups of '{gen}' (acceptance_rate, "
            f"{source}): {rounds:.2f} rounds of generation per step, at most {graph.nodes[name].max_rounds}"
        )
    return out


def _summary(metrics: list[dict[str, Any]]) -> str:
    if not metrics:
        return "no steps ran."
    k = max(1, min(10, len(metrics) // 5))
    key, what = "reward", "reward"
    nll = next((name for name in metrics[0] if name.endswith("/nll")), None)
    margin = next((name for name in metrics[0] if name.endswith("/margin")), None)
    if margin is not None and all(m.get("reward") is None for m in metrics):  # preference pairs: the margin
        key, what = margin, "preference margin"
    elif nll is not None and all(m.get("reward") is None for m in metrics):  # supervised (no reward): its loss
        key, what = nll, "training NLL"
    first = sum(m.get(key) or 0 for m in metrics[:k]) / k
    last = sum(m.get(key) or 0 for m in metrics[-k:]) / k
    secs = sorted(m["step_seconds"] for m in metrics)[len(metrics) // 2]
    text = f"{what} {first:.3f} -> {last:.3f} (mean of first/last {k} steps), median step {secs:.3f}s"
    gaps = [m["logprob_gap"] for m in metrics if isinstance(m.get("logprob_gap"), float)]
    if gaps:  # sampler vs trainer log-probs on the same weights (see runtime/nodes.py: logprob_gap)
        text += f", log-prob gap {max(gaps):.1e} (sampler vs trainer, worst step mean)"
    return text


def _report_lines(record: dict[str, Any]) -> str:
    """An evaluation's overall metrics on one line, or sample rows one per line."""
    if record["kind"] == "eval":
        shown = ", ".join(
            f"{k[5:]} {v:.3f}"
            for k, v in record.items()
            if k.startswith("eval/") and k.count("/") == 1 and k not in ("eval/prompts", "eval/pairs")
        )
        return f"eval after {record['step']} steps: {shown}"
    lines = []
    for row in record.get("rows", []):
        reward = "-" if row.get("reward") is None else f"{row['reward']:.2f}"
        prompt = " ".join(str(row["prompt"]).split())[-60:]
        response = " ".join(str(row["response"]).split())[:80]
        lines.append(f"  [{row['kind']} {row['step']}] {prompt!r} -> {response!r} (reward {reward})")
    return "\n".join(lines)


class _Progress:
    def __init__(self, total: int, enabled: bool, initial: int = 0) -> None:
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stderr)

    def update(self, record: dict[str, Any]) -> None:
        if self.bar is None:
            return
        if record.get("kind") is not None:  # an evaluation or sample rows: printed above the bar
            self.bar.write(_report_lines(record))
            return
        nll = next((k for k in record if k.endswith("/nll")), None)
        margin = next((k for k in record if k.endswith("/margin")), None)
        if record.get("reward") is None and margin is not None:  # preference pairs: margin and accuracy
            accuracy = margin.rsplit("/", 1)[0] + "/pref_accuracy"
            post = {"margin": f"{record[margin]:.3f}", "acc": f"{record.get(accuracy) or 0:.2f}"}
        elif record.get("reward") is None and nll is not None:  # supervised (no reward): its loss
            post = {"nll": f"{record[nll]:.3f}"}
        else:
            post = {"reward": f"{record['reward'] or 0:.3f}"}
        if record.get("kl") is not None:
            post["kl"] = f"{record['kl']:.3f}"
        if record.get("tokens"):  # generated tokens per second: none in a graph that generates nothing
            post["tok/s"] = f"{record['tokens_per_s']:.0f}"
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(record["step"] + 1 - self.bar.n)  # a restart does steps after its checkpoint again

    def say(self, line: str) -> None:
        """A line of the progress output (a restart): above the bar, or on stderr without one."""
        if self.bar is None:
            print(line, file=sys.stderr, flush=True)
        else:
            self.bar.write(line, file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _progress(total: int, enabled: bool, initial: int = 0) -> _Progress:
    return _Progress(total, enabled, initial)


def cmd_plan(args: argparse.Namespace) -> int:
    from flowrl import api
    from flowrl.contract.capabilities import unsupported
    from flowrl.contract.plan import dump_plan, encode_plan
    from flowrl.plugins.manager import registry

    if args.what_if:
        return _what_if(args)
    graph, plan, results, options = _planned(args)
    placed = results.place
    tune = placed.tune if placed is not None else None
    if args.explain and placed is not None and tune is not None:
        from flowrl.planner.autotune import explain

        print(explain(tune, plan.target.model, plan.target.cluster, models=plan.target.models))
        if not tune.offline:  # a train-only graph has no generation engine
            print(_engine_choice(plan.config.generation.engine, placed.engines))
        for fwd, train in plan.fused.items():
            print(
                f"fused: '{fwd}' is computed by '{train}' in its own forward (one update per batch: the old "
                "log-probs are the ones it trains on, detached); no pass of its own"
            )
        for line in _dynamic_sampling(graph, plan):
            print(line)
        if placed.unconstrained is not None:
            print(_constraint_cost(options["require"], tune, placed.unconstrained))
    if args.timeline and tune is not None:
        writable(args.timeline, args.force, "--timeline")
        writable(Path(args.timeline).with_suffix(".json"), args.force, "--timeline (its .json)")
        _timeline(args.timeline, tune, graph.name)
    if args.out:
        if args.config and Path(args.out).resolve() == Path(args.config).resolve():
            raise ConfigError(f"--out '{args.out}' is the --config file; write the plan to another file.")
        path = dump_plan(plan, writable(args.out, args.force, "--out"))
        runnable = plan.target.capabilities is not None and not unsupported(
            api.executor_entry(plan.config, registry()).obj.capabilities, plan.layout, plan.target.cluster.devices
        )
        hint = (
            f"; run it with `{' '.join(['flowrl run', *_file_arg(plan), '--plan', str(path)])}`"
            if runnable
            else f" (a forecast: executor '{plan.config.executor}' cannot run it)"
        )
        print(f"flowrl: plan {plan.id} written to {path}{hint}")
    elif not args.explain:
        print(encode_plan(plan, args.format), end="")
    return 0


def _planned(
    args: argparse.Namespace, overrides: Sequence[str] = (), edit: Any = None, print_after: Sequence[str] | None = None
) -> tuple[Any, Any, Any, dict[str, Any]]:
    """The plan `flowrl plan` makes of ``args``: (graph, plan, the passes' results, the planner options).
    ``overrides``: --set items after the command line's; ``edit(target, load_kwargs, for_backend)``: the
    target planned for instead (a what-if)."""
    from flowrl import api
    from flowrl.planner.hardware import cpu_devices
    from flowrl.planner.passes import PassResults

    target, results = None, PassResults()
    kwargs = _load_kwargs(args)
    kwargs["overrides"] = [*kwargs["overrides"], *overrides]
    if args.cluster:
        target = _cluster_target(args, kwargs)
    if args.address:
        target = _joined_target(args, kwargs, target)
    if getattr(args, "decode_batch", None):
        target = _with_decode_batch(target, args.decode_batch)
    if not args.cluster and args.workload:
        raise ConfigError(
            "--workload plans for a cluster; add --cluster (e.g. --cluster 16xA100-80G --model llama-7b)."
        )
    options = {
        "budget_s": _search_budget(args.budget),
        "seed": args.seed or 0,
        "cost_model": args.cost_model,
        **_pins(args),
        **_requirements(args),
        **_objective(args),
    }
    passes = None
    if args.extra_passes:
        from flowrl.planner.passes import PIPELINE

        passes = (*PIPELINE, *args.extra_passes)
    for_backend = (
        _executor_flag(args) is not None
        or (args.cluster is not None and cpu_devices(args.cluster) is not None)
        or bool(args.address)
    )
    if edit is not None:
        target = edit(target, kwargs, for_backend)
    graph, plan = api.plan(
        _need_graph(args),
        print_after=args.print_after if print_after is None else print_after,
        emit=print,
        target=target,
        options=options,
        results=results,
        passes=passes,
        for_backend=for_backend,
        **kwargs,
    )
    return graph, plan, results, options


def _search_budget(value: str | float) -> float:
    """``--budget``: seconds (> 0), or ``all`` (no time limit: every candidate is simulated)."""
    if isinstance(value, str) and value.strip().lower() == "all":
        return math.inf
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < math.inf:
        raise ConfigError(
            f"--budget is {value}; give the search time in seconds (> 0), e.g. --budget 8, or --budget all to "
            "simulate every candidate."
        )
    return seconds


def _with_decode_batch(target: Any, value: str) -> Any:
    """``target`` whose generation decodes as ``--decode-batch`` says: ``N`` sequences at once per replica,
    continuously batched, or ``static:N`` in static batches of N."""
    import msgspec

    if target is None or target.workload is None:
        raise ConfigError(
            f"--decode-batch {value}: it forecasts a named cluster's generation engine; add --cluster and --model "
            "(e.g. --cluster 8xH100-80G --model llama-7b)."
        )
    static, _, count = value.rpartition(":")
    if static not in ("", "static") or not count.isdigit() or int(count) < 1:
        raise ConfigError(
            f"--decode-batch {value}: give N (continuous batching, at most N sequences per replica) or static:N "
            "(static batches of N), N >= 1, e.g. --decode-batch static:8."
        )
    numerics = msgspec.structs.replace(target.numerics, decode_batch=int(count), static_decode=static == "static")
    return msgspec.structs.replace(target, numerics=numerics)


def _what_if(args: argparse.Namespace) -> int:
    """``flowrl plan --what-if KEY=VALUE ...``: the plan as given and the plan with the changes, side by side."""
    import msgspec

    from flowrl import api
    from flowrl.errors import PlanError
    from flowrl.planner import whatif
    from flowrl.planner.hardware import cpu_devices
    from flowrl.plugins.manager import registry

    given = [f for f, v in (("--out", args.out), ("--timeline", args.timeline), ("--explain", args.explain)) if v]
    given += ["--print-after"] if args.print_after else []
    if given:
        raise ConfigError(
            f"--what-if prints the current plan beside the changed one; drop {' / '.join(given)} (plan the changed "
            "target on its own, with --set or another --cluster / --workload, to write or explain it)."
        )
    what = whatif.parse_what_if(args.what_if)
    _, current, _, _ = _planned(args)
    what, staleness = whatif.staleness_note(what, current.config.rollout.mode)
    notes = [staleness] if staleness else []
    workload_given = bool(args.cluster) and cpu_devices(args.cluster) is None  # --workload's, or the default

    def edit(target: Any, kwargs: dict[str, Any], for_backend: bool) -> Any:
        if not what.edits_target:
            return target
        if target is None:  # this machine, as `api.plan` plans for it
            _, cfg = api.load(_need_graph(args), **kwargs)
            target = api.local_target(cfg, registry())
            if what.on("cluster") and not for_backend:  # more devices than the local executor runs
                target = msgspec.structs.replace(target, capabilities=None)
                notes.append(
                    f"note: executor '{cfg.executor}' runs this machine as one device; the what-if is a forecast "
                    "for any executor (`--cluster cpu:N` plans this machine as N devices on Ray)"
                )
        workload = None
        if what.on("workload") and target.workload is None:  # the run config's, as `resolve` derives it
            _, resolved = api.plan(
                _need_graph(args), target=target, passes=("resolve",), for_backend=for_backend, emit=print, **kwargs
            )
            workload = resolved.target.workload
        return whatif.edited_target(target, what, workload)

    notes += whatif.workload_notes(what, workload_given)
    try:
        _, new, _, _ = _planned(args, overrides=what.overrides, edit=edit, print_after=())
    except (ConfigError, PlanError) as exc:
        if str(exc).startswith("--what-if"):
            raise
        raise type(exc)(f"--what-if {what.describe()}: {exc}") from None
    for line in notes:
        print(line)
    print(whatif.compare(current, new, what))
    return 0


def _cluster_target(args: argparse.Namespace, load_kwargs: dict[str, Any], for_run: bool = False) -> Any:
    """The ClusterTarget of ``--cluster``. ``cpu:N`` is this machine's CPU as N devices, planned for
    the executor that runs it (default 'ray' for N > 1) with the run config's model and workload;
    a run on a named cluster trains the run config's model too. Otherwise --model names the
    planned model (and is no longer a local checkpoint) and --workload its workload."""
    from flowrl import api
    from flowrl.contract.plan import ClusterTarget
    from flowrl.contract.workload import WorkloadSpec
    from flowrl.planner.hardware import cpu_devices, parse_cluster, with_calibration
    from flowrl.planner.modelspec import DEFAULT_ROLE, load_model_specs
    from flowrl.planner.workload import load_workload
    from flowrl.plugins.manager import registry

    devices = cpu_devices(args.cluster)
    if devices is not None:
        if getattr(args, "workload", None):
            raise ConfigError("--cluster cpu:N runs the run config's workload; drop --workload (use --set rollout...).")
        if _executor_flag(args) is None and devices > 1:
            if "ray" not in {e.name for e in registry().entries("executors")}:
                raise ConfigError(
                    f"--cluster {args.cluster} runs on the Ray backend, which is not installed (`pip install -e "
                    "./plugins/flowrl-ray`, as in README's setup) or not enabled (FLOWRL_PLUGINS); or name another "
                    "executor with --executor."
                )
            args.executor = load_kwargs["flags"]["executor"] = "ray"
        load_kwargs["overrides"] = [*load_kwargs["overrides"], "device=cpu"]
        _, cfg = api.load(_need_graph(args), **load_kwargs)
        return api.local_target(cfg, registry(), devices=devices)
    presets = {e.name: e.obj for e in registry().entries("hardware")}
    cluster = with_calibration(parse_cluster(args.cluster, extra_presets=presets))
    if for_run:  # what runs is the run config's model and workload, on that cluster
        _, cfg = api.load(_need_graph(args), **load_kwargs)
        return ClusterTarget(cluster=cluster, model=api.model_spec(cfg))
    workload = load_workload(args.workload) if args.workload else WorkloadSpec()
    if args.model:
        load_kwargs["flags"]["model"] = None  # --model names the planned model, not a local checkpoint
        default, roles = load_model_specs(args.model)
        base = default or roles.get("actor") or next(iter(roles.values()))  # `resolve` sets the first actor's
        models = {**roles, DEFAULT_ROLE: default} if roles and default else roles
        return ClusterTarget(cluster=cluster, model=base, workload=workload, models=models)
    if args.cluster != "local":
        raise ConfigError(
            "--cluster needs --model: a preset (llama-7b, llama-70b, qwen2.5-7b, ...) or an HF config.json / "
            "model directory; or --cluster cpu:N for this machine."
        )
    _, cfg = api.load(_need_graph(args), **load_kwargs)  # the model this run config builds
    return ClusterTarget(cluster=cluster, model=api.model_spec(cfg), workload=workload)


def _joined_target(args: argparse.Namespace, load_kwargs: dict[str, Any], given: Any) -> Any:
    """With --address: the Ray cluster's alive nodes as the ClusterTarget (nodes x the smallest node's GPUs,
    or CPUs on a cluster without GPUs), planned for the executor that joins it (default 'ray'); with
    --cluster, ``given`` once checked against those nodes."""
    import msgspec

    from flowrl import api
    from flowrl.planner.hardware import with_calibration
    from flowrl.planner.nodes import check_cluster, joined_cluster
    from flowrl.plugins.manager import registry

    if _executor_flag(args) is None:
        if "ray" not in registry().names("executors"):
            raise ConfigError(
                "--address joins a Ray cluster, and no Ray executor is installed (pip install -e plugins/flowrl-ray); "
                "drop --address to run on this machine."
            )
        args.executor = load_kwargs["flags"]["executor"] = "ray"
    _, cfg = api.load(_need_graph(args), **load_kwargs)
    entry = api.executor_entry(cfg, registry())
    discover = entry.meta.get("nodes")
    if discover is None:
        raise ConfigError(
            f"--address joins an existing cluster; executor '{cfg.executor}' cannot (use --executor ray)."
        )
    found = discover(args.address)
    if given is not None:
        check_cluster(given.cluster, found, args.address)
        return given
    cluster = joined_cluster(found, entry.meta["machine"](cfg), args.address)
    if cluster.on_cpu:  # the cluster's CPUs, as `--cluster cpu:N` plans this machine's
        load_kwargs["overrides"] = [*load_kwargs["overrides"], "device=cpu"]
        _, cfg = api.load(_need_graph(args), **load_kwargs)
    return msgspec.structs.replace(api.local_target(cfg, registry()), cluster=with_calibration(cluster))


def _timeline(path: str, tune: Any, name: str) -> None:
    import json

    from flowrl.planner.simulate import draw_timeline, timeline_json

    best = tune.ranked[0]
    png = Path(path)
    png.parent.mkdir(parents=True, exist_ok=True)
    draw_timeline(
        best.result,
        best.plan,
        png,
        title=f"{name}: {best.result.iteration_s:.2f} s/iteration predicted  ({best.plan.summary()})",
    )
    data = png.with_suffix(".json")
    data.write_text(json.dumps({"iteration_s": best.result.iteration_s, "spans": timeline_json(best.result)}, indent=1))
    print(f"flowrl: timeline written to {png} and {data}")


def cmd_calibrate(args: argparse.Namespace) -> int:
    from flowrl.contract.hardware import save_hardware
    from flowrl.planner.calibrate import fit, read_runs
    from flowrl.planner.hardware import calibration_path, cluster_key
    from flowrl.plugins.manager import registry

    replays = read_runs(args.runs, registry(), args.graph)
    cluster = replays[0].measured.plan.target.cluster
    out = writable(args.out, args.force, "--out") if args.out else calibration_path(cluster)
    print(f"flowrl: calibrating cluster '{cluster_key(cluster)}' from {len(replays)} run(s)", flush=True)
    result = fit(replays, progress=lambda s: print(f"  {s}", flush=True))
    print("  factor                          before        after  measured by")
    for path, (before, after, runs) in result.factors.items():
        print(f"  {path:<28} {before:12.4g} {after:12.4g}  {', '.join(runs)}")
    print("  run: predicted s/iteration before -> after, measured")
    for run, measured in result.measured.items():
        before, after = result.before[run], result.after[run]
        print(
            f"  {run}: {before:.4g} ({before / measured - 1:+.0%}) -> {after:.4g} ({after / measured - 1:+.0%}), "
            f"measured {measured:.4g}"
        )
    save_hardware(result.hardware, out)
    used = "" if args.out else f"; plans for '{cluster_key(cluster)}' now use it (`flowrl plan ... --explain` says so)"
    print(f"flowrl: calibrated hardware spec written to {out}{used}")
    _calibrate_efficiency(args, [(r.measured.run, r.measured.plan) for r in replays], out if args.out else None)
    return 0


def _calibrate_efficiency(args: argparse.Namespace, runs: list[tuple[str, Any]], out: Path | None) -> None:
    """The sample efficiency fitted to the runs' reward curves (`flowrl.planner.reward_curves`): saved where
    plans read it (beside ``--out`` when given), or the prior kept, saying why."""
    from flowrl.planner.reward_curves import fit_efficiency, read_curve, report
    from flowrl.planner.sample_efficiency import efficiency_path, in_use, save_efficiency

    curves = [read_curve(run, plan) for run, plan in runs]
    fit = fit_efficiency(curves, args.target_reward)
    for line in report(fit):
        print(line)
    if fit.kept is not None:
        print(f"flowrl: sample efficiency not written; plans rank with the {in_use().source} one")
        return
    path = out.with_name(f"{out.stem}.sample_efficiency.yaml") if out is not None else efficiency_path()
    save_efficiency(fit.efficiency, writable(path, args.force, "--out (its sample efficiency)") if out else path)
    used = "" if out else "; `flowrl plan --objective time-to-target` ranks plans with it"
    print(f"flowrl: sample efficiency written to {path}{used}")


def cmd_show(args: argparse.Namespace) -> int:
    from flowrl import api
    from flowrl.graph.printer import draw_png, to_dot, to_text

    graph, _ = api.load(_need_graph(args), **_load_kwargs(args))
    for flag, out in (("--dot", args.dot), ("--png", args.png)):
        if out:
            writable(out, args.force, flag)
    print(to_text(graph), end="")
    try:
        if args.dot:
            Path(args.dot).write_text(to_dot(graph))
            print(f"flowrl: DOT written to {args.dot}")
        if args.png:
            print(f"flowrl: drawing written to {draw_png(graph, args.png)}")
    except OSError as exc:
        raise ConfigError(f"cannot write '{exc.filename or args.dot or args.png}': {exc.strerror or exc}.") from None
    return 0


def cmd_plugins(args: argparse.Namespace) -> int:
    from flowrl.plugins.manager import registry

    reg = registry()
    print("plugins:")
    for info in reg.plugins:
        print(f"  {info.name:<28} {info.source}")
    for kind in reg.kinds():
        entries = reg.entries(kind)
        if not entries:
            continue
        print(f"{kind.replace('_', ' ')}:")
        for e in entries:
            desc = e.meta.get("description", "")
            print(f"  {e.name:<16} from {e.plugin}" + (f"  - {desc}" if desc else ""))
    return 0


# ------------------------------------------------------------------ entry point


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flowrl", description="Compile and run RL dataflow graphs for LLM post-training."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("run", help="plan and run a graph (trains a real model)")
    _config_args(p)
    p.add_argument(
        "--plan",
        metavar="FILE",
        help="run a plan written by `flowrl plan --out` (a plan naming a graph file runs only if you name it too)",
    )
    p.add_argument(
        "--resume",
        metavar="DIR",
        help="continue the run in DIR (e.g. runs/grpo) from its newest checkpoint; --steps N extends it",
    )
    p.add_argument(
        "--save-every",
        metavar="N",
        type=int,
        dest="save_every",
        help="write a checkpoint every N steps (default: about ten per run; 0: only at the end)",
    )
    p.add_argument(
        "--max-restarts",
        metavar="N",
        type=int,
        dest="max_restarts",
        help="restart from the last checkpoint by itself when a worker or node is lost, at most N times "
        "(default 3; 0: stop, to be continued with --resume)",
    )
    p.add_argument(
        "--replan-on-loss",
        action="store_true",
        dest="replan_on_loss",
        help="when lost devices do not come back within --device-wait, re-plan for the devices left and go on "
        "(default: stop, printing the resume command)",
    )
    p.add_argument(
        "--device-wait",
        metavar="S",
        type=float,
        dest="device_wait",
        help="after a lost node, wait up to S seconds for its devices to come back (default 60)",
    )
    p.add_argument(
        "--cluster",
        metavar="SPEC",
        help="plan for this cluster, then run: cpu:N (this machine as N devices, on Ray), or e.g. 2x8xH100-80G "
        "with --address",
    )
    p.add_argument(
        "--address",
        metavar="ADDR",
        help="join an existing Ray cluster ('auto' or host:port) instead of starting a private one",
    )
    _pin_args(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        dest="trust_remote_code",
        help="let a --model folder run its own Python (an auto_map in config.json / tokenizer_config.json); only "
        "for folders you trust. Without it such a folder is refused. A plan or run folder never grants it.",
    )
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("plan", help="compile a graph into an execution plan")
    _config_args(p, run_out=False)
    p.add_argument("--out", metavar="FILE", help="write the plan (.yaml or .json) instead of printing it")
    p.add_argument("--format", choices=["yaml", "json"], default="yaml")
    p.add_argument(
        "--print-after",
        metavar="PASS",
        action="append",
        default=[],
        help="print the plan after this pass ('all' for every pass)",
    )
    p.add_argument(
        "--pass",
        metavar="PASS",
        dest="extra_passes",
        action="append",
        default=[],
        help="run this (plugin) pass after the built-in pipeline",
    )
    p.add_argument(
        "--cluster",
        metavar="SPEC",
        help="plan for a cluster: 16xA100-80G, 2x8xH100-80G, a cluster file, cpu:N (this machine as N devices), "
        "or 'local' (after `flowrl profile`)",
    )
    p.add_argument(
        "--workload",
        metavar="FILE",
        help="prompts per step, samples, lengths (YAML/TOML/JSON); default 1024 prompts, 1024+1024 tokens",
    )
    p.add_argument(
        "--decode-batch",
        metavar="[static:]N",
        help="with --cluster: the generation engine decodes at most N sequences at once per replica, continuously "
        "batched (vLLM's max_num_seqs; default 256), or static:N in static batches of N, each until its longest "
        "response ends (TensorRT-LLM driven by NeMo-Aligner: rollout_micro_batch_size)",
    )
    p.add_argument(
        "--explain",
        action="store_true",
        help="print the winner, the runners-up and why they lose, and the roofline bound",
    )
    p.add_argument(
        "--timeline", metavar="PNG", help="draw the winner's predicted timeline (and write the spans as JSON beside it)"
    )
    p.add_argument(
        "--address",
        metavar="ADDR",
        help="plan for the nodes of this running Ray cluster ('auto' or host:port); with --cluster, check it has them",
    )
    p.add_argument(
        "--what-if",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        dest="what_if",
        help="plan again with this change and print both plans side by side (repeatable): cluster.devices=16, "
        "hardware.inter_node_bandwidth=2x, workload.response_tail=2x, rollout.mode=async, or any --set key",
    )
    p.add_argument(
        "--budget",
        default="8",
        help="search time budget in seconds (default 8), or 'all': simulate every candidate, however long it "
        "takes (the same plan on any machine)",
    )
    p.add_argument("--cost-model", default="analytic", help="a registered cost model")
    p.add_argument("--force", action="store_true", help="replace --out / --timeline files that already exist")
    _pin_args(p)
    p.set_defaults(func=cmd_plan)
    p = sub.add_parser("calibrate", help="fit the planner's cost model to runs' traces (runs/NAME ...)")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folders (runs/NAME) of one cluster")
    p.add_argument(
        "--graph",
        metavar="FILE",
        action="append",
        default=[],
        help="a graph file a run ran, when it is not a built-in algorithm's (graph files are code: named, not found)",
    )
    p.add_argument(
        "--out",
        metavar="FILE",
        help="write the fitted hardware spec here instead (default: where plans for that cluster read it)",
    )
    p.add_argument(
        "--target-reward",
        metavar="R",
        type=float,
        dest="target_reward",
        help="the reward whose steps the sample efficiency is fitted to (default: 90%% of the way from the runs' "
        "start to the best run's final reward)",
    )
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.set_defaults(func=cmd_calibrate)
    p = sub.add_parser("show", help="print a graph (stages, edges); optionally DOT/PNG")
    _config_args(p, run_out=False)
    p.add_argument("--dot", metavar="FILE")
    p.add_argument("--png", metavar="FILE")
    p.add_argument("--force", action="store_true", help="replace --dot / --png files that already exist")
    p.set_defaults(func=cmd_show)
    p = sub.add_parser("plugins", help="list plugins and what they register")
    p.set_defaults(func=cmd_plugins)
    p = sub.add_parser("data", help="make training data: preference pairs from problems with numeric answers")
    data = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    q = data.add_parser(
        "pairs",
        help="preference pairs (prompt, chosen, rejected) from a GSM8K-format jsonl file: the worked answer "
        "chosen, the same answer with a slip in its final number rejected (for graphs/dpo.py and "
        "graphs/reward_model.py)",
    )
    q.add_argument("input", metavar="IN.jsonl", help="rows with a question and an answer 'work #### N'")
    q.add_argument("--out", metavar="FILE", required=True, help="the jsonl file of pairs to write")
    q.add_argument("--prompt-key", default="question", help="the question column (default: question)")
    q.add_argument("--answer-key", default="answer", help="the answer column (default: answer)")
    q.add_argument("--seed", type=int, default=0, help="draws the wrong numbers and slips (default: 0)")
    q.add_argument(
        "--slips",
        default="work,answer",
        help="the kinds of slip a rejected answer makes, one drawn per row (default: work,answer): 'work' a wrong "
        "result carried through the work to the answer, 'answer' the work right and the final answer wrong",
    )
    q.add_argument("--force", action="store_true", help="replace --out if it exists")
    q.set_defaults(func=cmd_data_pairs)
    return parser


def cmd_data_pairs(args: argparse.Namespace) -> int:
    from flowrl.tasks.pairs import write_pairs

    count = write_pairs(
        Path(args.input),
        Path(args.out),
        prompt_key=args.prompt_key,
        answer_key=args.answer_key,
        seed=args.seed,
        slips=tuple(k.strip() for k in args.slips.split(",") if k.strip()),
        force=args.force,
    )
    print(f"{count} preference pairs -> {args.out} (columns prompt, chosen, rejected, answer, slip)")
    return 0


def _plugin_commands(parser: argparse.ArgumentParser) -> None:
    from flowrl.plugins.manager import cli_commands

    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for entry in cli_commands():
        add_arguments = entry.obj
        p = sub.add_parser(entry.name, help=entry.meta.get("help", f"(from plugin {entry.plugin})"))
        add_arguments(p)
        p.set_defaults(func=entry.meta["run"])


#: OSError numbers that only a path the user gave causes: a name too long, a link loop
_PATH_ERRORS = (errno.ENAMETOOLONG, errno.ELOOP)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        _plugin_commands(parser)
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return EXIT_USER_ERROR
        return int(args.func(args) or 0)
    except FlowRLError as exc:
        first, _, rest = str(exc).partition("\n")
        print(
            "flowrl: error: "
            + textwrap.fill(first, width=100, subsequent_indent="  ", break_on_hyphens=False, break_long_words=False),
            file=sys.stderr,
        )
        if rest:
            print(rest, file=sys.stderr)
        return EXIT_USER_ERROR
    except OSError as exc:
        if exc.errno not in _PATH_ERRORS:
            raise
        # a path the user gave that no file system call can take (too long, a link loop): one paragraph
        name = str(exc.filename)
        shown = name if len(name) <= 200 else f"{name[:100]}...{name[-40:]} ({len(name):,} characters)"
        print(f"flowrl: error: the path '{shown}' cannot be used: {exc.strerror}; give another path.", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("flowrl: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `flowrl plugins | head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
