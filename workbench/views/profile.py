"""Line profile of the density between two atoms (tricubic samples).

The y range snaps to a "nice" number, so while a slider drags it rarely changes: the
axes and tick labels are then kept as a blitted background and only the lines redrawn.
"""

from __future__ import annotations

import ipywidgets as widgets
import numpy as np

from workbench.views._figure import canvas_png, new_figure

__all__ = ["ProfileView"]


class ProfileView:
    """ρ model and ρ target along the segment between two atoms (CSS class ``wb-profile``).

    Attributes
    ----------
    image : ipywidgets.Image
    caption : ipywidgets.HTML
        The two atoms, their distance, or why no profile could be computed.
    """

    def __init__(self):
        self.fig = new_figure(5.2, 2.4)
        self.ax = self.fig.add_subplot()
        (self.line,) = self.ax.plot([], [], color="C0", label="ρ model")
        (self.target,) = self.ax.plot([], [], color="C1", ls="--", label="ρ target")
        self.ax.set_xlabel("Å from the first atom")
        self.units = "e/Å³"
        self.ax.set_ylabel(self.units)
        self.ax.legend(loc="upper right", fontsize=8)
        self.fig.tight_layout()
        self.image = widgets.Image(format="png", layout=widgets.Layout(width="420px"))
        self.image.add_class("wb-profile")
        self.caption = widgets.HTML()
        self.widget = widgets.VBox([self.image, self.caption])
        self._layout_key = None
        self._background = None

    def update(self, distance, values, target=None, *, title: str = "", units: str = "e/Å³") -> bytes:
        """Draw the profile ``values`` (n,) in ``units`` (fm/Å³ for neutrons) at ``distance`` (n,) Å,
        and ``target`` if given."""
        if units != self.units:
            self.units = units
            self.ax.set_ylabel(units)
            self._background = None  # the kept axes carry the old label
        self.line.set_data(distance, values)
        if target is None:
            self.target.set_data([], [])
        else:
            self.target.set_data(distance, target)
        both = np.concatenate([values, target]) if target is not None else np.asarray(values)
        lo, hi = _nice(float(min(both.min(), 0.0))), _nice(float(both.max()))
        key = (round(float(distance[-1]), 6), lo, hi)
        if key != self._layout_key or self._background is None:
            self.ax.set_xlim(0, max(float(distance[-1]), 1e-6))
            self.ax.set_ylim(lo, hi if hi > lo else lo + 1.0)
            self.line.set_visible(False)
            self.target.set_visible(False)
            self.fig.canvas.draw()
            self._background = self.fig.canvas.copy_from_bbox(self.fig.bbox)
            self.line.set_visible(True)
            self.target.set_visible(True)
            self._layout_key = key
        self.fig.canvas.restore_region(self._background)
        self.ax.draw_artist(self.line)
        self.ax.draw_artist(self.target)
        data = canvas_png(self.fig)
        with self.image.hold_sync():
            self.image.value = data
            self.caption.value = f"<small>{title}</small>"
        return data

    def unavailable(self, why: str) -> None:
        """Say why there is no profile (the old image is cleared, not left stale)."""
        with self.image.hold_sync():
            self.image.value = b""
            self.caption.value = f"<small>line profile unavailable: {why}</small>"


def _nice(x: float) -> float:
    """Round |x| up to 1, 2 or 5 × 10ⁿ (keeping the sign): a y limit that rarely changes."""
    if x == 0 or not np.isfinite(x):
        return 0.0
    mag = 10 ** np.floor(np.log10(abs(x)))
    for m in (1, 2, 5, 10):
        if abs(x) <= m * mag:
            return float(np.sign(x) * m * mag)
    return float(x)
