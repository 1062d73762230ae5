"""Matplotlib figures rendered to PNG bytes, without pyplot (no global figure state)."""

from __future__ import annotations

import io

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

__all__ = ["new_figure", "png_bytes"]


def new_figure(width: float, height: float, dpi: int = 80) -> Figure:
    """A figure with its own Agg canvas (never registered with pyplot, so never leaked)."""
    fig = Figure(figsize=(width, height), dpi=dpi)
    FigureCanvasAgg(fig)
    return fig


def png_bytes(fig: Figure) -> bytes:
    """The figure as PNG bytes; zlib level 1 (the image changes on every drag, speed over size)."""
    buf = io.BytesIO()
    fig.canvas.print_png(buf, pil_kwargs={"compress_level": 1})
    return buf.getvalue()
