"""The 2-D density section, drawn in Å with the cell's true angles.

The image is drawn in voxel-index space and mapped to the section's Cartesian frame by
an affine transform (voxel (p, q) → p/n_u·e_u + q/n_v·e_v), so a hexagonal section is a
120° rhombus and a monoclinic one a parallelogram, never a square. The figure, image,
colour bar and atom markers are built once; an update only changes their data.

Drawing text dominates a matplotlib redraw (~40 ms here), so the frame, ticks, labels
and colour bar are drawn once per section geometry and colour range and kept as a
background; an update restores it and draws only the image, the outline and the atom
markers. The colour scale covers the shown section (default: a section through the
middle of a molecule is as bright as the densest one) or the whole map (to compare
sections). It snaps up to a "nice" value (1, 1.25, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8 ×
10ⁿ e/Å³) and is kept while the data still span 75 % of it, so it, and the background,
rarely change while a slider drags; the caption states the exact minimum and maximum of
the section and of the map. A near-empty section is not stretched: its scale never
drops below :data:`MIN_SCALE_FRACTION` of the map maximum (amplifying 1e-30 e/Å³ tails
into bright noise would mislead, and such ranges overflow float32 image scaling).
"""

from __future__ import annotations

import ipywidgets as widgets
import numpy as np
from matplotlib.ticker import MaxNLocator
from matplotlib.transforms import Affine2D

from workbench.compute import Section
from workbench.views._figure import canvas_png, new_figure

__all__ = ["AXIS_NAMES", "MIN_SCALE_FRACTION", "SliceView", "axis_labels"]

AXIS_NAMES = ("a", "b", "c")
# Lowest section colour scale, as a fraction of the map maximum (see the module docstring).
MIN_SCALE_FRACTION = 0.05
# A colour range is kept while the data span at least this share of it: fewer redraws of
# the colour bar during a drag, while at most a quarter of the scale goes unused.
_KEEP = 0.75


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
        self.cbar.locator = MaxNLocator(5)  # fewer tick labels: text is the costly part of a redraw
        (self.outline,) = self.ax.plot([], [], color="0.3", lw=0.8)
        # Small thin crosses, half-transparent: they say where atoms are without hiding the density.
        self.markers = self.ax.scatter(
            np.zeros(0), np.zeros(0), s=12, marker="+", c=[(1.0, 1.0, 1.0, 0.6)], linewidths=0.6
        )
        self.image = widgets.Image(format="png", layout=widgets.Layout(width="420px"))
        self.image.add_class(css)
        self.caption = widgets.HTML()
        self.caption.add_class(f"{css}-caption")
        # as wide as the image: a long caption wraps instead of widening the column and
        # pushing the 3D view below the slice even on a wide page
        self.widget = widgets.VBox([self.image, self.caption], layout=widgets.Layout(width="430px"))
        self.n_updates = 0
        self._layout_key = None
        self._background = None

    def update(
        self, sec: Section, *, near_uv: np.ndarray | None = None, note: str = "", scale: str = "section"
    ) -> bytes:
        """Redraw for section ``sec``; ``near_uv`` (M, 2) Å marks the atoms near its plane.

        ``scale`` is ``"section"`` (colours span this section) or ``"map"`` (the whole map's
        range, ``sec.map_range``, so stepping through sections keeps one scale).
        """
        values = sec.values
        n_u, n_v = values.shape
        self.im.set_data(values.T)  # rows = v, columns = u (origin lower)
        self.im.set_extent((-0.5, n_u - 0.5, -0.5, n_v - 0.5))
        self.im.set_transform(Affine2D(sec.voxel_affine) + self.ax.transData)
        vmin, vmax = float(values.min()), float(values.max())
        mmin, mmax = sec.map_range if sec.map_range is not None else (vmin, vmax)
        if scale == "map":
            cmin, cmax = mmin, mmax
        elif scale == "section":
            floor = MIN_SCALE_FRACTION * max(abs(mmin), abs(mmax))
            cmin, cmax = min(vmin, -floor) if vmin < 0 else vmin, max(vmax, floor)
        else:
            raise ValueError(f"scale must be 'section' or 'map', got {scale!r}")
        lo, hi = self._colour_range(cmin, cmax)
        corners = sec.corners
        ring = np.vstack([corners, corners[:1]])
        self.outline.set_data(ring[:, 0], ring[:, 1])
        self.markers.set_offsets(np.zeros((0, 2)) if near_uv is None or len(near_uv) == 0 else near_uv)
        pad = 0.02 * float(np.ptp(corners, axis=0).max())
        self.ax.set_xlim(corners[:, 0].min() - pad, corners[:, 0].max() + pad)
        self.ax.set_ylim(corners[:, 1].min() - pad, corners[:, 1].max() + pad)
        xlabel, ylabel, angle = axis_labels(sec)
        self.ax.set_xlabel(xlabel)
        self.ax.set_ylabel(ylabel)
        data = self._render((n_u, n_v, tuple(sec.e_u), tuple(sec.e_v), sec.axis, lo, hi))
        n_near = 0 if near_uv is None else len(near_uv)
        which = "this section" if scale == "section" else "the whole map"
        with self.image.hold_sync():
            self.image.value = data
            self.caption.value = (
                f"<small>section ⊥ {AXIS_NAMES[sec.axis]} at index {sec.index} (depth {sec.depth:.2f} Å), "
                f"{n_u}×{n_v} voxels{angle}; ρ here {vmin:.3g} … {vmax:.3g} e/Å³, map {mmin:.3g} … {mmax:.3g}; "
                f"colours span {which} ({lo:.3g} … {hi:.3g}); + {n_near} atoms within 1 Å of the plane{note}</small>"
            )
        self.n_updates += 1
        return data

    def _colour_range(self, cmin: float, cmax: float) -> tuple[float, float]:
        """A nice colour range covering [cmin, cmax], kept while it still fits well.

        Hysteresis: the current range stays while the data span at least 75 % of it, so
        a B-factor drag redraws the colour bar (a full ~50 ms redraw) only now and then.
        """
        if self.symmetric:
            top = max(abs(cmin), abs(cmax), 1e-30)
            old = self.im.get_clim()[1]
            hi = old if _KEEP * old <= top <= old else _nice_up(top)
            lo = -hi
        else:
            old_lo, old_hi = self.im.get_clim()
            lo = -_nice_up(-cmin) if cmin < 0 else 0.0
            if cmax <= 0:
                hi = lo + 1e-12
            elif lo == old_lo and _KEEP * (old_hi - lo) <= cmax - lo <= old_hi - lo:
                hi = old_hi
            else:
                hi = _nice_up(cmax)
        if (lo, hi) != tuple(self.im.get_clim()):
            self.im.set_clim(lo, hi)
        return lo, hi

    def _render(self, layout_key) -> bytes:
        canvas = self.fig.canvas
        # The image lies inside the padded axis limits, so it never covers the spines.
        dynamic = [self.im, self.markers, self.outline]
        if layout_key != self._layout_key or self._background is None:
            for artist in dynamic:
                artist.set_visible(False)
            canvas.draw()
            self._background = canvas.copy_from_bbox(self.fig.bbox)
            for artist in dynamic:
                artist.set_visible(True)
            self._layout_key = layout_key
        canvas.restore_region(self._background)
        for artist in (self.im, self.outline, self.markers):
            self.ax.draw_artist(artist)
        return canvas_png(self.fig)


def axis_labels(sec: Section) -> tuple[str, str, str]:
    """Axis labels of a section plot, and a caption note on a non-rectangular section.

    On a rectangular section the two cell axes are the plot axes: "a (Å)", "b (Å)". On an
    oblique one the plot's y is not a cell axis; the labels say what it is, and the note
    gives the angle between the in-plane cell axes.
    """
    u, v = (AXIS_NAMES[k] for k in sec.in_plane)
    if sec.is_rectangular:
        return f"{u} (Å)", f"{v} (Å)", ""
    angle = sec.in_plane_angle
    return f"{u} (Å)", f"⊥ {u}, in the {u}{v} plane (Å)", f", {u}∠{v} = {angle:.1f}° (cell drawn to scale)"


_STEPS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0)


def _nice_up(x: float) -> float:
    """The smallest value ≥ x of the form step × 10ⁿ, step in :data:`_STEPS` (x > 0)."""
    if not (x > 0 and np.isfinite(x)):
        return 1.0
    mag = 10.0 ** np.floor(np.log10(x))
    for step in _STEPS:
        if x <= step * mag * (1 + 1e-12):
            return float(step * mag)
    return float(10 * mag)
