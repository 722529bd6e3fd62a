"""Training-curve plots (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path


def save_curves(
    series: dict[str, tuple[list[float], list[float]]], xlabel: str, ylabel: str, title: str, path: str | Path
) -> None:
    """One line per ``label -> (xs, ys)`` in a 7 x 4 inch PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
