"""Loss curves of a training run, written as PNG with matplotlib's Agg backend."""
from __future__ import annotations

from pathlib import Path

import numpy as np


def smooth(values: list[float], window: int) -> np.ndarray:
    window = max(1, min(window, len(values)))
    return np.convolve(np.asarray(values), np.ones(window) / window, mode="valid")


def plot_losses(history: list[dict], evals: list[dict], path: Path, title: str = "") -> None:
    """Training loss (and its parts, smoothed) and held-out loss against tokens seen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not history:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    tokens = np.asarray([r["tokens"] for r in history]) / 1e6
    window = max(1, len(history) // 50)
    for key in ("ce", "mtp_ce", "kl", "regression"):
        if key in history[0]:
            curve = smooth([r[key] for r in history], window)
            ax.plot(tokens[window - 1:], curve, label=f"train {key}")
    if evals:
        ax.plot([e["tokens"] / 1e6 for e in evals], [e["heldout_loss"] for e in evals], "o-", label="held-out ce")
    ax.set_xlabel("tokens (M)")
    ax.set_ylabel("loss (nats)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
