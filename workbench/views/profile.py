"""Line profile of the density between two atoms (tricubic samples)."""

from __future__ import annotations

import ipywidgets as widgets
import numpy as np

from workbench.views._figure import new_figure, png_bytes

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
        self.ax.set_ylabel("e/Å³")
        self.ax.legend(loc="upper right", fontsize=8)
        self.fig.tight_layout()
        self.image = widgets.Image(format="png", layout=widgets.Layout(width="420px"))
        self.image.add_class("wb-profile")
        self.caption = widgets.HTML()
        self.widget = widgets.VBox([self.image, self.caption])

    def update(self, distance, values, target=None, *, title: str = "") -> bytes:
        """Draw the profile ``values`` (n,) e/Å³ at ``distance`` (n,) Å, and ``target`` if given."""
        self.line.set_data(distance, values)
        if target is None:
            self.target.set_data([], [])
        else:
            self.target.set_data(distance, target)
        both = np.concatenate([values, target]) if target is not None else np.asarray(values)
        lo, hi = float(both.min()), float(both.max())
        self.ax.set_xlim(0, max(float(distance[-1]), 1e-6))
        self.ax.set_ylim(lo - 0.05 * (hi - lo + 1e-9), hi + 0.05 * (hi - lo + 1e-9))
        data = png_bytes(self.fig)
        with self.image.hold_sync():
            self.image.value = data
            self.caption.value = f"<small>{title}</small>"
        return data

    def unavailable(self, why: str) -> None:
        """Say why there is no profile (the old image is cleared, not left stale)."""
        with self.image.hold_sync():
            self.image.value = b""
            self.caption.value = f"<small>line profile unavailable: {why}</small>"
