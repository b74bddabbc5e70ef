"""Do the local and vLLM generation engines learn alike? The default job over several seeds; one JSON line.

The default job is ``flowrl run graphs/grpo.py`` (GRPO on task 'copy', its defaults), run for
each seed with ``generation.engine=local`` and ``generation.engine=vllm``, one after another
(each vLLM run in a subprocess of its own: one in-process vLLM engine per process). A run's final reward is
its mean reward over the last 10 % of its steps. Printed: each run, each engine's mean and
standard deviation of the final reward over seeds, and a last JSON line with the gap between the
engines' means against their seed-to-seed spread (``agree``: the gap is within ``--tolerance``
standard errors of a difference of means; see `agreement`). A run stopped before its steps (a signal, a
crash) is left out of the comparison and listed under ``incomplete``. ``--png`` draws both engines' curves
(mean over seeds, min-max band); ``--save`` keeps every run's curve as JSON, and ``--load a.json,b.json``
summarises the runs of several such files together (seeds run at different times). The JSON line's
``difference`` (the second engine's mean minus the first's: vllm minus local by default) and
``difference_se`` say how far apart the engines' means are, and how surely.

    python benchmarks/engines_agree.py --seeds 3 --steps 300 --png engines.png
    python benchmarks/engines_agree.py --seeds 2 --steps 60 --set rollout.prompts_per_step=16

The vLLM engine needs the plugin (plugins/flowrl-vllm); the default tiny model's heads (32) are a
size vLLM's CPU kernels run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GRAPH = str(ROOT / "graphs" / "grpo.py")


def final_reward(rewards: list[float], share: float = 0.1) -> float:
    """Mean of the last ``share`` of the steps (at least one)."""
    k = max(1, math.ceil(len(rewards) * share))
    return sum(rewards[-k:]) / k


def one_run(engine: str, seed: int, steps: int, extra: list[str], out: str) -> dict:
    """One run of the default job in this process (through flowrl.api); its reward curve."""
    from flowrl import api

    overrides = [
        f"generation.engine={engine}",
        f"seed={seed}",
        f"steps={steps}",
        "checkpoint=false",
        "progress=false",
        f"out={out}",
        *extra,
    ]
    graph, plan = api.plan(GRAPH, overrides=overrides, emit=lambda s: None)
    start = time.perf_counter()
    result = api.run(graph, plan)
    return {
        "engine": engine,
        "seed": seed,
        "steps": steps,
        "seconds": round(time.perf_counter() - start, 1),
        "reward": [round(float(m["reward"]), 5) for m in result.metrics],
        "exact": [round(float(m.get("reward/exact", math.nan)), 5) for m in result.metrics],
        "logprob_gap": max(float(m.get("logprob_gap", 0.0)) for m in result.metrics),
    }


def run_in_subprocess(engine: str, seed: int, steps: int, extra: list[str], out: str) -> dict:
    args = [sys.executable, str(Path(__file__).resolve()), "--one", engine, "--seed", str(seed), "--steps", str(steps)]
    args += ["--out", out, *[a for o in extra for a in ("--set", o)]]
    done = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=dict(os.environ))
    if done.returncode != 0:
        raise RuntimeError(f"run {engine} seed {seed} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def within_sd(rewards: list[float], share: float = 0.1) -> float:
    """Standard deviation of a run's reward over its last ``share`` of steps (its step-to-step noise)."""
    k = max(2, math.ceil(len(rewards) * share))
    return statistics.stdev(rewards[-k:])


def agreement(
    finals: dict[str, list[float]], noise: dict[str, list[float]], tolerance: float = 3.0, min_spread: float = 0.0
) -> dict:
    """Whether two engines' final rewards (one per seed) agree within their seed-to-seed spread.

    spread = the pooled standard deviation over seeds of both engines, at least the runs' own
    step-to-step noise (``noise``: `within_sd` of each run; a few seeds can agree by chance more
    closely than one run is steady) and at least ``min_spread`` (a spread measured over more seeds,
    for a test that runs only two). The engines agree when their means differ by at most
    ``tolerance`` standard errors of a difference of means: tolerance * spread * sqrt(1/n_a + 1/n_b).

    Also given: ``difference``, the second engine's mean minus the first's, and ``difference_se``, its
    standard error from each engine's own seed variance (Welch; None with fewer than two seeds of
    either): how far apart the engines are, and how sure that is."""
    (a, fa), (b, fb) = list(finals.items())[:2]
    var_a, var_b = (statistics.variance(f) if len(f) > 1 else None for f in (fa, fb))
    var = [v for v in (var_a, var_b) if v is not None]
    seed_sd = math.sqrt(statistics.fmean(var)) if var else 0.0
    run_sd = statistics.fmean(x for e in (a, b) for x in noise[e])
    spread = max(seed_sd, run_sd, min_spread)
    bound = tolerance * spread * math.sqrt(1 / len(fa) + 1 / len(fb))
    difference = statistics.fmean(fb) - statistics.fmean(fa)
    gap = abs(difference)
    se = None
    if var_a is not None and var_b is not None:
        se = math.sqrt(var_a / len(fa) + var_b / len(fb))
    return {
        "difference": round(difference, 4) + 0.0,  # + 0.0: no -0.0 for equal means
        "difference_se": None if se is None else round(se, 4),
        "gap": round(gap, 4),
        "seed_sd": round(seed_sd, 4),
        "run_sd": round(run_sd, 4),
        "bound": round(bound, 4),
        "agree": gap <= bound,
    }


def summary(runs: list[dict], engines: list[str], tolerance: float, min_spread: float = 0.0) -> dict:
    """Per engine: final rewards over seeds, their mean and standard deviation, the first steps'
    reward; the agreement of the first two engines (`agreement`)."""
    out: dict = {"benchmark": "engines_agree", "steps": runs[0]["steps"], "seeds": sorted({r["seed"] for r in runs})}
    stopped = [r for r in runs if not complete(r)]
    if stopped:  # a run stopped early (a signal, a crash) ends on an earlier reward: not comparable
        out["incomplete"] = [
            {"engine": r["engine"], "seed": r["seed"], "steps_done": len(r["reward"])} for r in stopped
        ]
        runs = [r for r in runs if complete(r)]
    finals, noise = {}, {}
    for e in engines:
        mine = [r for r in runs if r["engine"] == e]
        if not mine:
            out[e] = None
            continue
        finals[e] = [final_reward(r["reward"]) for r in mine]
        noise[e] = [within_sd(r["reward"]) for r in mine]
        out[e] = {
            "final": [round(x, 4) for x in finals[e]],
            "mean": round(statistics.fmean(finals[e]), 4),
            "std": round(statistics.stdev(finals[e]), 4) if len(mine) > 1 else 0.0,
            "exact": round(statistics.fmean(final_reward(r["exact"]) for r in mine), 4),
            "peak": round(statistics.fmean(max(smooth(r["reward"])) for r in mine), 4),
            "first": round(statistics.fmean(statistics.fmean(r["reward"][:10]) for r in mine), 4),
            "logprob_gap": max(r["logprob_gap"] for r in mine),
            "seconds": round(sum(r["seconds"] for r in mine), 1),
        }
    if len(engines) >= 2 and all(out[e] is not None for e in engines[:2]):
        out.update(agreement(finals, noise, tolerance, min_spread))
    elif len(engines) >= 2:
        out["agree"] = None  # an engine has no complete run
    return out


def load_runs(paths: Sequence[str]) -> list[dict]:
    """The runs of several ``--save`` files, as one set; ValueError (naming the file) for a file that cannot be
    read or holds no list of runs, for no runs at all, for one engine's seed in two places (counted twice it
    would shrink the standard error unseen), and for runs of different lengths (final rewards at different
    steps are not one sample)."""
    runs: list[dict] = []
    where: dict[tuple[str, int], str] = {}
    for path in paths:
        try:
            held = json.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"--load {path}: cannot read it as a --save file ({exc})") from None
        if not isinstance(held, list) or not all(_is_run(r) for r in held):
            raise ValueError(
                f"--load {path}: not a --save file (a JSON list of runs, each with an engine name, a whole-number "
                "seed and steps, and a list of finite rewards)"
            )
        for r in held:
            key = (r["engine"], r["seed"])  # a name and a whole number (_is_run)
            if key in where:
                raise ValueError(f"--load: {key[0]} seed {key[1]} is in {where[key]} and in {path}; load each run once")
            where[key] = path
        runs += held
    if not runs:
        raise ValueError(f"--load {','.join(paths)}: no runs in the file(s)")
    steps = sorted({r["steps"] for r in runs})
    if len(steps) > 1:
        raise ValueError(
            f"--load: the runs are of different lengths ({', '.join(map(str, steps))} steps): compare one length"
        )
    return runs


def _is_run(r: object) -> bool:
    """Whether ``r`` is one run as ``--save`` writes it: engine, whole-number seed and steps, finite rewards."""
    if not isinstance(r, dict) or not {"engine", "seed", "steps", "reward"} <= r.keys():
        return False
    whole = all(isinstance(r[k], int) and not isinstance(r[k], bool) for k in ("seed", "steps"))
    rewards = r["reward"]
    finite = isinstance(rewards, list) and all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in rewards
    )
    return isinstance(r["engine"], str) and whole and finite


def complete(run: dict) -> bool:
    """Whether a run took every step it was asked for."""
    return len(run["reward"]) >= run["steps"]


def smooth(curve: list[float], window: int | None = None) -> list[float]:
    """Trailing moving mean (window: a thirtieth of the run, at least 1 step)."""
    w = window or max(1, len(curve) // 30)
    return [statistics.fmean(curve[max(0, i - w + 1) : i + 1]) for i in range(len(curve))]


def plot(runs: list[dict], engines: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    window = 1
    for e, color in zip(engines, ("tab:blue", "tab:orange", "tab:green")):
        curves = [r["reward"] for r in runs if r["engine"] == e and complete(r)]  # the runs the summary compares
        if not curves:
            continue
        n = min(len(c) for c in curves)
        window = max(1, n // 30)
        smoothed = [smooth(c[:n], window) for c in curves]
        mean = [statistics.fmean(s[i] for s in smoothed) for i in range(n)]
        low = [min(s[i] for s in smoothed) for i in range(n)]
        high = [max(s[i] for s in smoothed) for i in range(n)]
        ax.plot(range(n), mean, color=color, label=f"{e} (mean of {len(curves)} seeds)")
        ax.fill_between(range(n), low, high, color=color, alpha=0.2)
    ax.set_xlabel("step")
    ax.set_ylabel(f"reward (moving mean over {window} steps)")
    ax.set_title("GRPO, task copy: local vs vLLM generation (band: min-max over seeds)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def compare(
    seeds: list[int],
    steps: int,
    engines: list[str] = ("local", "vllm"),  # type: ignore[assignment]
    extra: list[str] = (),  # type: ignore[assignment]
    tolerance: float = 3.0,
    png: str | None = None,
    save: str | None = None,
    emit=print,
    min_spread: float = 0.0,
    isolate: Sequence[str] = ("vllm",),
) -> dict:
    """Every (seed, engine) run, seeds outermost so machine noise hits the engines alike; the runs
    of the engines in ``isolate`` each in a subprocess of its own (vLLM: one in-process engine per
    process), the others in this process. The summary (see `summary`)."""
    runs = []
    with tempfile.TemporaryDirectory(prefix="flowrl-engines-") as tmp:
        for seed in seeds:
            for engine in engines:
                where = str(Path(tmp) / f"{engine}-{seed}")
                if engine in isolate:
                    run = run_in_subprocess(engine, seed, steps, list(extra), where)
                else:
                    run = one_run(engine, seed, steps, list(extra), where)
                runs.append(run)
                if save:
                    Path(save).write_text(json.dumps(runs))
                emit(
                    f"{engine:>6} seed {seed}: reward {statistics.fmean(run['reward'][:10]):.3f} -> "
                    f"{final_reward(run['reward']):.3f} (exact {final_reward(run['exact']):.3f}), "
                    f"{run['seconds']:.0f}s"
                    + ("" if complete(run) else f"; STOPPED after {len(run['reward'])} of {steps} steps: left out")
                )
    out = summary(runs, list(engines), tolerance, min_spread)
    for e in engines:
        s = out[e]
        if s is None:
            emit(f"{e:>6}: no complete run")
            continue
        emit(f"{e:>6}: final reward {s['mean']:.3f} +- {s['std']:.3f} over {len(s['final'])} seeds {s['final']}")
    if png:
        plot(runs, list(engines), png)
        out["png"] = png
    out["runs"] = [{k: r[k] for k in ("engine", "seed", "seconds")} for r in runs]
    return out


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--seeds", default="3", help="a count (seeds 0..N-1) or a comma-separated list (one seed: '1,')"
    )
    parser.add_argument("--steps", type=int, default=600, help="steps per run (the default job: 600)")
    parser.add_argument("--engines", default="local,vllm")
    parser.add_argument("--set", action="append", default=[], dest="extra", help="a run override, key=value")
    parser.add_argument("--tolerance", type=float, default=3.0, help="agreement bound, in standard errors")
    parser.add_argument("--png", default=None, help="draw both engines' curves into this file")
    parser.add_argument("--save", default=None, help="write every run's curves to this JSON file")
    parser.add_argument(
        "--load", default=None, help="summarise (and draw) the runs --save files hold (comma-separated); run none"
    )
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a single run (the subprocess)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s] if "," in args.seeds else list(range(int(args.seeds)))
    if args.one:  # one run in this process: print its curve as the last line
        print(json.dumps(one_run(args.one, args.seed, args.steps, args.extra, args.out)))
        return None
    engines = args.engines.split(",")
    if args.load:  # one or more --save files (comma-separated): their runs summarised together
        try:
            runs = load_runs([path for path in args.load.split(",") if path])
        except ValueError as exc:
            parser.error(str(exc))
        out = summary(runs, engines, args.tolerance)
        if args.png:
            plot(runs, engines, args.png)
            out["png"] = args.png
        print(json.dumps(out))
        return out
    out = compare(seeds, args.steps, engines, args.extra, args.tolerance, args.png, args.save)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
