"""Matplotlib figures rendered to PNG bytes, without pyplot (no global figure state)."""

from __future__ import annotations

import struct
import zlib

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

__all__ = ["new_figure", "png_bytes", "canvas_png", "encode_png"]


def new_figure(width: float, height: float, dpi: int = 80) -> Figure:
    """A figure with its own Agg canvas (never registered with pyplot, so never leaked)."""
    fig = Figure(figsize=(width, height), dpi=dpi)
    FigureCanvasAgg(fig)
    return fig


def encode_png(rgb: np.ndarray) -> bytes:
    """PNG bytes of an 8-bit RGB image, shape (height, width, 3).

    Filter "none" on every row and zlib level 1: these plots encode about 3× faster than
    with Pillow's adaptive filtering, and the image changes on every drag, so encoding
    speed beats size.
    """
    h, w, _ = rgb.shape
    rows = np.empty((h, 1 + 3 * w), dtype=np.uint8)
    rows[:, 0] = 0  # filter type 0 (none)
    rows[:, 1:] = np.ascontiguousarray(rgb, dtype=np.uint8).reshape(h, 3 * w)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)  # 8-bit, colour type 2 (RGB)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows.tobytes(), 1))
        + chunk(b"IEND", b"")
    )


def canvas_png(fig: Figure) -> bytes:
    """PNG of what the canvas holds now (no redraw): for blitted updates."""
    rgba = np.asarray(fig.canvas.buffer_rgba())
    return encode_png(rgba[:, :, :3])


def png_bytes(fig: Figure) -> bytes:
    """Draw the whole figure and return it as PNG bytes."""
    fig.canvas.draw()
    return canvas_png(fig)
