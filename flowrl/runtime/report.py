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


def plot_rewards(metrics: list[dict[str, Any]], path: Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in metrics]
    panels = [("reward", "mean reward"), ("kl", "KL(actor || ref)"), ("response_length", "response tokens")]
    panels = [(k, label) for k, label in panels if any(m.get(k) is not None for m in metrics)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    window = max(1, len(metrics) // 25)
    for ax, (key, label) in zip(axes[0], panels):
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
