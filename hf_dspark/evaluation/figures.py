"""Matplotlib for the package's plots: pyplot on the headless ``Agg`` backend, and writing a finished figure to a file.
Matplotlib loads on first use, so importing this module costs nothing."""

from __future__ import annotations

from pathlib import Path


def pyplot():
    """``matplotlib.pyplot`` with the ``Agg`` backend selected (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | Path, dpi: int = 110) -> Path:
    """Lay ``fig`` out, write it to ``path`` (its folder made if missing) at ``dpi`` and close it; returns the path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
