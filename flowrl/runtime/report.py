"""Pictures of a run: the reward curve (with KL and response length when present)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot_rewards(
    metrics: list[dict[str, Any]], path: Path, title: str = "", evals: list[dict[str, Any]] | None = None
) -> Path:
    """reward.png: the reward, KL and response length per step, and the evaluations' overall
    metrics (``eval/greedy``, ``eval/mean@K``, ...) when the run evaluated."""
    from flowrl.runtime.trackers import cache_dir, default_env

    default_env("MPLCONFIGDIR", cache_dir(path.parent, "matplotlib"))  # its font cache: in the run folder
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in metrics]
    panels = [("reward", "mean reward"), ("kl", "KL(actor || ref)"), ("response_length", "response tokens")]
    nll = next((k for k in metrics[0] if k.endswith("/nll")), None) if metrics else None
    if nll is not None and not any(m.get("reward") is not None for m in metrics):  # supervised: its loss
        panels.insert(0, (nll, "training NLL per token"))
    accuracy = next((k for k in metrics[0] if k.endswith("/accuracy")), None) if metrics else None
    if accuracy is not None and not any(m.get("reward") is not None for m in metrics):  # a reward model's pairs
        panels.insert(0, (accuracy, "training pair accuracy"))
    panels = [(k, label) for k, label in panels if any(m.get(k) is not None for m in metrics)]
    evals = evals or []
    # held-out loss (offline rows) and a reward model's held-out margin have panels of their own: not in [0, 1]
    losses = {"eval/loss", "eval/tokens", "eval/margin", "eval/pairs"}
    curves = sorted(
        {k for e in evals for k in e if k.startswith("eval/") and k.count("/") == 1} - {"eval/prompts"} - losses
    )
    if curves:
        panels.append(("eval", "evaluation"))
    if any("eval/loss" in e for e in evals):
        panels.append(("eval/loss", "held-out NLL per token"))
    if any("eval/margin" in e for e in evals):
        panels.append(("eval/margin", "held-out margin (r_chosen - r_rejected)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    window = max(1, len(metrics) // 25)
    for ax, (key, label) in zip(axes[0], panels):
        if key == "eval":
            for curve in curves:
                points = [(e["step"], e[curve]) for e in evals if curve in e]
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", ms=3, lw=1.4, label=curve[5:])
            ax.set_xlabel("training steps done")
            ax.set_title(label, fontsize=10)
            ax.set_ylim(-0.02, 1.02)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8, loc="lower right")
            continue
        if key in ("eval/loss", "eval/margin"):
            points = [(e["step"], e[key]) for e in evals if key in e]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", ms=3, lw=1.4, color="#d62")
            ax.set_xlabel("training steps done")
            ax.set_title(label, fontsize=10)
            ax.grid(alpha=0.3)
            continue
        ys = [float(m.get(key) or 0.0) for m in metrics]
        ax.plot(steps, ys, color="#9ab", lw=0.8, label="per step")
        ax.plot(steps, _smooth(ys, window), color="#d62", lw=1.8, label=f"mean of {window}")
        ax.set_xlabel("step")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
        if key == "reward":
            ax.set_ylim(-0.02, 1.02)
            ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
