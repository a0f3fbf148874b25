"""Matplotlib, headless, with the two conventions every figure of the library shares: rounds are
counted in whole numbers on the x axis, and a figure is saved tight at one resolution."""
from __future__ import annotations

from pathlib import Path


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def round_axis(ax, label: str = "round") -> None:
    """Label ``ax``'s x axis and tick it at whole rounds only (no 1.5, 2.5 on a 4-round run)."""
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel(label)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def save(fig, out: Path) -> Path:
    """Write ``fig`` to ``out`` (parents made) and close it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(png(fig))
    return out


def png(fig) -> bytes:
    """``fig`` as PNG bytes, tight at the library's one resolution; the figure is closed (a run
    folder writes them relative to its open folder, :class:`flower_apps.results.RunFolder`)."""
    import io

    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, dpi=110, format="png")
    pyplot().close(fig)
    return buf.getvalue()
