"""Shared figure helpers (matplotlib, Agg backend, imported on first use: matplotlib is in the ``bench`` extra)."""

from __future__ import annotations

from pathlib import Path

from kvserve.extras import require


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (no display).

    Raises:
        MissingExtraError: matplotlib is missing (the message names the extra to install).
    """
    matplotlib = require("matplotlib", "bench", "plots")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def style(ax, xlabel: str, ylabel: str) -> None:
    """Axis labels, a small legend and a light grid."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def save(plt, fig, path: Path) -> None:
    """Write ``fig`` to ``path`` (PNG, 100 dpi) and close it."""
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
