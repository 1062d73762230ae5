"""The 2-D density section, drawn in Å with the cell's true angles.

The image is drawn in voxel-index space and mapped to the section's Cartesian frame by
an affine transform (voxel (p, q) → p/n_u·e_u + q/n_v·e_v), so a hexagonal section is a
120° rhombus and a monoclinic one a parallelogram, never a square. The figure, image,
colour bar and atom markers are built once; an update only changes their data.
"""

from __future__ import annotations

import ipywidgets as widgets
import numpy as np
from matplotlib.transforms import Affine2D

from workbench.compute import Section
from workbench.views._figure import new_figure, png_bytes

__all__ = ["SliceView", "AXIS_NAMES"]

AXIS_NAMES = ("a", "b", "c")


class SliceView:
    """A density section as a PNG in an ``ipywidgets.Image`` (CSS class ``wb-slice``).

    Attributes
    ----------
    image : ipywidgets.Image
        PNG bytes of the current section; replaced in place on every update.
    caption : ipywidgets.HTML
        What the section is (axis, index, depth in Å, colour range, atoms marked).
    widget : ipywidgets.VBox
    """

    def __init__(self, *, cmap: str = "viridis", title: str = "ρ", css: str = "wb-slice", symmetric: bool = False):
        self.symmetric = symmetric  # a difference map: colour range centred on 0
        self.fig = new_figure(5.2, 4.4)
        self.ax = self.fig.add_subplot()
        self.ax.set_aspect("equal")
        self.im = self.ax.imshow(
            np.zeros((2, 2), np.float32),
            origin="lower",
            cmap=cmap,
            interpolation="nearest",
            extent=(-0.5, 1.5, -0.5, 1.5),
        )
        self.cbar = self.fig.colorbar(self.im, ax=self.ax, shrink=0.85)
        self.cbar.set_label(f"{title} (e/Å³)")
        (self.outline,) = self.ax.plot([], [], color="0.3", lw=0.8)
        self.markers = self.ax.scatter(
            np.zeros(0), np.zeros(0), s=14, facecolors="none", edgecolors="white", linewidths=0.8
        )
        self.image = widgets.Image(format="png", layout=widgets.Layout(width="420px"))
        self.image.add_class(css)
        self.caption = widgets.HTML()
        self.caption.add_class(f"{css}-caption")
        self.widget = widgets.VBox([self.image, self.caption])
        self.n_updates = 0

    def update(self, sec: Section, *, near_uv: np.ndarray | None = None, note: str = "") -> bytes:
        """Redraw for section ``sec``; ``near_uv`` (M, 2) Å marks the atoms near its plane."""
        values = sec.values
        n_u, n_v = values.shape
        self.im.set_data(values.T)  # rows = v, columns = u (origin lower)
        self.im.set_extent((-0.5, n_u - 0.5, -0.5, n_v - 0.5))
        m = np.array([[sec.e_u[0] / n_u, sec.e_v[0] / n_v, 0.0], [sec.e_u[1] / n_u, sec.e_v[1] / n_v, 0.0], [0, 0, 1]])
        self.im.set_transform(Affine2D(m) + self.ax.transData)
        lo, hi = float(values.min()), float(values.max())
        if self.symmetric:
            hi = max(abs(lo), abs(hi), 1e-30)
            lo = -hi
        elif hi <= lo:
            hi = lo + 1e-12
        self.im.set_clim(lo, hi)
        corners = sec.corners
        ring = np.vstack([corners, corners[:1]])
        self.outline.set_data(ring[:, 0], ring[:, 1])
        self.markers.set_offsets(np.zeros((0, 2)) if near_uv is None or len(near_uv) == 0 else near_uv)
        pad = 0.02 * float(np.ptp(corners, axis=0).max())
        self.ax.set_xlim(corners[:, 0].min() - pad, corners[:, 0].max() + pad)
        self.ax.set_ylim(corners[:, 1].min() - pad, corners[:, 1].max() + pad)
        u, v = (AXIS_NAMES[k] for k in sec.in_plane)
        self.ax.set_xlabel(f"Å along {u}")
        self.ax.set_ylabel(f"Å in the {u}{v} plane, normal to {u}")
        self.ax.set_title(f"section {AXIS_NAMES[sec.axis]} = {sec.index} ({sec.depth:.2f} Å)", fontsize=10)
        data = png_bytes(self.fig)
        n_near = 0 if near_uv is None else len(near_uv)
        with self.image.hold_sync():
            self.image.value = data
            self.caption.value = (
                f"<small>{AXIS_NAMES[sec.axis]}-section {sec.index} of {values.shape} voxels, depth {sec.depth:.2f} Å; "
                f"colour {lo:.3g} … {hi:.3g} e/Å³; ○ {n_near} atoms within 1 Å of the plane{note}</small>"
            )
        self.n_updates += 1
        return data
