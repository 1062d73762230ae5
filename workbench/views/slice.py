"""The 2-D density section, drawn in Å with the cell's true angles.

The section is resampled at display resolution by tricubic interpolation
(:func:`workbench.compute.render_section`, through :func:`kernels.tricubic_sample`) on
square pixels of the section's own Cartesian frame, so a hexagonal section is a 120°
rhombus and a monoclinic one a parallelogram (pixels outside the cell face are left
transparent), with optional contour lines at σ levels of the whole map (as Coot draws
maps) and the atoms near the plane marked by element, larger the closer they lie. The
figure, image, colour bar, contour lines and atom markers are built once; an update only
changes their data.

The face is resampled on the display's own pixels (the raster's pixel is one figure
pixel) and drawn with nearest-neighbour lookup: nothing is resampled twice. Drawing text
dominates a matplotlib redraw (~40 ms here), so the frame, ticks and labels are drawn once
per section geometry and kept as a background, and the colour bar once per colour range
and kept beside it; an update restores those pixels and draws only the image, the
contours, the outline, the atom markers and the contour ticks on the bar. The colour scale covers the shown section (default: a
section through the middle of a molecule is as bright as the densest one) or the whole
map (fixed while stepping through sections, to compare them). It snaps up to a "nice"
value (1, 1.25, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8 × 10ⁿ e/Å³) and is kept while the data
still span 75 % of it, so it rarely changes while a slider drags;
the caption states the exact minimum and maximum of the section and of the map. A
near-empty section is not stretched: its scale never drops below
:data:`MIN_SCALE_FRACTION` of the map maximum (amplifying 1e-30 e/Å³ tails into bright
noise would mislead, and such ranges overflow float32 image scaling).
"""

from __future__ import annotations

import collections

import ipywidgets as widgets
import numpy as np
from matplotlib.collections import LineCollection
from matplotlib.ticker import MaxNLocator
from matplotlib.transforms import Bbox

from workbench.compute import AtomMarks, Section, render_section
from workbench.compute.text import count
from workbench.views._caption import caption_html
from workbench.views._figure import canvas_png, new_figure

__all__ = ["AXIS_NAMES", "CONTOUR_COLOURS", "MIN_SCALE_FRACTION", "SliceView", "axis_labels", "bar_ticks"]

AXIS_NAMES = ("a", "b", "c")
# Lowest section colour scale, as a fraction of the map maximum (see the module docstring).
MIN_SCALE_FRACTION = 0.05
# A colour range is kept while the data span at least this share of it: fewer redraws of
# the colour bar during a drag, while at most a quarter of the scale goes unused.
_KEEP = 0.75
# Contour line colours, one per level in the order given: white reads on every viridis
# colour; then light pink and orange for higher levels. Below the mean (difference maps): red.
CONTOUR_COLOURS = ("#ffffff", "#ffb0ff", "#ffa040", "#80ffff")
_NEGATIVE_COLOUR = "#ff3030"
# Colour bars kept drawn, one per colour range (about 250 kB each).
_BARS_KEPT = 16
# The figure in inches at 80 dpi: 560 × 480 px, the face up to ~400 px across.
_FIGSIZE = (7.0, 6.0)


class SliceView:
    """A density section as a PNG in an ``ipywidgets.Image`` (CSS class ``wb-slice``).

    Attributes
    ----------
    image : ipywidgets.Image
        PNG bytes of the current section; replaced in place on every update.
    caption : ipywidgets.HTML
        What the section is (axis, index, depth in Å, colour range, contours, atoms marked).
    last : workbench.compute.SectionImage or None
        What was drawn last (the resampled raster and its contour lines).
    widget : ipywidgets.VBox
        The image, then ``tools`` (controls shown right under the image, e.g. the slice
        slider), then the caption.
    """

    def __init__(
        self,
        *,
        cmap: str = "viridis",
        title: str = "ρ",
        css: str = "wb-slice",
        symmetric: bool = False,
        tools: widgets.Widget | None = None,
    ):
        self.symmetric = symmetric  # a difference map: colour range centred on 0
        self.fig = new_figure(*_FIGSIZE)
        self.ax = self.fig.add_subplot()
        self.fig.subplots_adjust(left=0.11, right=0.99, bottom=0.09, top=0.98)
        self.ax.set_aspect("equal")
        import matplotlib
        import matplotlib.cm

        colours = matplotlib.colormaps[cmap].with_extremes(bad=(0, 0, 0, 0))  # outside the face: transparent
        self.im = self.ax.imshow(
            np.zeros((2, 2), np.float32),
            origin="lower",
            cmap=colours,
            interpolation="nearest",  # resampled on the display's own pixels: nothing to smooth
            extent=(-0.5, 1.5, -0.5, 1.5),
        )
        # The image's pixels are written straight into the canvas (_paint), so matplotlib
        # never draws self.im; it holds the data, extent and colour range. The bar has its
        # own mappable, given a colour range only when a bar for that range is drawn:
        # a colour bar recomputes its ticks and colours on every change of its range.
        self.im.set_visible(False)
        self._lut = colours(np.arange(colours.N), bytes=True)
        self._bar_source = matplotlib.cm.ScalarMappable(cmap=colours)
        self._bar_source.set_clim(0.0, 1.0)
        self.cbar = self.fig.colorbar(self._bar_source, ax=self.ax, shrink=0.85)
        self.title = title
        self.units = "e/Å³"
        self.cbar.set_label(f"{title} ({self.units})")
        self._level_ticks = self.cbar.ax.plot([], [], color="k", lw=1.2)[0]
        self.contours = LineCollection([], linewidths=0.8)
        self.ax.add_collection(self.contours)
        (self.outline,) = self.ax.plot([], [], color="0.3", lw=0.8)
        # Thin crosses coloured by element, half-transparent: they say where atoms are
        # without hiding the density; larger on the plane than 1 Å off it.
        self.markers = self.ax.scatter(
            np.zeros(0), np.zeros(0), s=12, marker="+", c=[(1.0, 1.0, 1.0, 0.6)], linewidths=0.9
        )
        width = int(_FIGSIZE[0] * 80)
        self.image = widgets.Image(format="png", layout=widgets.Layout(width=f"{width}px"))
        self.image.add_class(css)
        self.caption = widgets.HTML()
        self.caption.add_class(f"{css}-caption")
        # as wide as the image: a long caption wraps instead of widening the column and
        # pushing the 3D view below the slice even on a wide page
        parts = [self.image, self.caption] if tools is None else [self.image, tools, self.caption]
        self.widget = widgets.VBox(parts, layout=widgets.Layout(width=f"{width + 10}px"))
        self.n_updates = 0
        self.last = None
        self._layout_key = None
        self._background = None
        self._geometry_key = None
        self._pixel = (None, None)
        self._bars: collections.OrderedDict = collections.OrderedDict()  # colour range -> drawn bar

    def update(
        self,
        sec: Section,
        *,
        marks: AtomMarks | None = None,
        near_uv: np.ndarray | None = None,
        mean: float | None = None,
        sigma: float | None = None,
        contour_sigmas=(),
        note: str = "",
        scale: str = "section",
        units: str = "e/Å³",
    ) -> bytes:
        """Redraw for section ``sec``.

        Parameters
        ----------
        sec : Section
        marks : AtomMarks, optional
            The atoms near the plane (:func:`workbench.compute.atom_marks`).
        near_uv : numpy.ndarray, shape (M, 2), Å, optional
            Plain white marks instead, when no ``marks`` are given.
        mean, sigma : float, optional
            The whole map's mean and σ, in ``units``; needed for ``contour_sigmas``.
        contour_sigmas : sequence of float
            Contour levels in σ above the mean (empty: none).
        scale : {"section", "map"}
            Colours span this section, or the whole map's range ``sec.map_range`` (one
            scale for every section).
        units : str
            The map's unit, in the colour bar's label and the caption ("fm/Å³" for a
            neutron map, :func:`workbench.state.density_units`).
        """
        if units != self.units:
            self.units = units
            self.cbar.set_label(f"{self.title} ({units})")
            self._bars.clear()  # the kept bars carry the old label
        geometry = self._geometry(sec)
        pixel, anchor = self._pixel
        img = render_section(sec, mean=mean, sigma=sigma, contour_sigmas=contour_sigmas, pixel=pixel, anchor=anchor)
        self.last = img
        self.im.set_data(img.values)
        self.im.set_extent(img.extent)
        vmin, vmax = float(sec.values.min()), float(sec.values.max())
        mmin, mmax = sec.map_range if sec.map_range is not None else (vmin, vmax)
        if scale == "map":
            cmin, cmax = mmin, mmax
        elif scale == "section":
            floor = MIN_SCALE_FRACTION * max(abs(mmin), abs(mmax))
            cmin, cmax = min(vmin, -floor) if vmin < 0 else vmin, max(vmax, floor)
        else:
            raise ValueError(f"scale must be 'section' or 'map', got {scale!r}")
        lo, hi = self._colour_range(cmin, cmax)
        segments, colours = [], []
        for i, c in enumerate(img.contours):
            colour = _NEGATIVE_COLOUR if c.sigma < 0 else CONTOUR_COLOURS[i % len(CONTOUR_COLOURS)]
            segments += c.lines
            colours += [colour] * len(c.lines)
        self.contours.set_segments(segments)
        self.contours.set_colors(colours or ["w"])
        # the contour levels as black ticks across the colour bar (drawn over it: σ moves
        # with every B-factor step)
        ticks = [c.level for c in img.contours if lo <= c.level <= hi]
        tx = np.array([[0.0, 1.0, np.nan]] * len(ticks)).ravel()
        ty = np.repeat(ticks, 3)
        self._level_ticks.set_data(tx, ty)
        if marks is not None and len(marks.uv):
            self.markers.set_offsets(marks.uv)
            self.markers.set_sizes(marks.sizes)
            self.markers.set_edgecolors(marks.colours)
            self.markers.set_facecolors(marks.colours)
            marked = f"{count(len(marks.uv), marks.noun)} {marks.where}"
        elif near_uv is not None and len(near_uv):
            self.markers.set_offsets(near_uv)
            self.markers.set_sizes([20.0])
            self.markers.set_edgecolors([(1.0, 1.0, 1.0, 0.6)])
            self.markers.set_facecolors([(1.0, 1.0, 1.0, 0.6)])
            marked = f"{count(len(near_uv), 'atom')} within 1 Å of the plane"
        else:
            self.markers.set_offsets(np.zeros((0, 2)))
            what = (marks.noun, marks.where) if marks is not None else ("atom", "within 1 Å of the plane")
            marked = f"{count(0, what[0])} {what[1]}"
        data = self._render(geometry, (lo, hi))
        n_u, n_v = sec.values.shape
        angle = axis_labels(sec)[2]
        if scale == "section":
            span = f"this section's ρ {cmin:.3g} … {cmax:.3g}"
        else:
            span = f"the whole map's ρ {mmin:.3g} … {mmax:.3g}, fixed across sections"
        if img.contours:
            levels = ", ".join(f"{c.sigma:g} σ = {c.level:.3g}" for c in img.contours)
            contour_text = f"; contours at {levels} {units}"
        else:
            contour_text = ""
        ny, nx = img.values.shape
        self.widget.layout.display = None  # shown again after clear()
        with self.image.hold_sync():
            self.image.value = data
            self.caption.value = caption_html(
                f"⊥ {AXIS_NAMES[sec.axis]} at {sec.depth:.1f} Å (index {sec.index}): ρ {vmin:.3g} … {vmax:.3g} {units}",
                f"section ⊥ {AXIS_NAMES[sec.axis]} at index {sec.index} (depth {sec.depth:.2f} Å), "
                f"{n_u}×{n_v} voxels shown tricubic-interpolated on {nx}×{ny} pixels of {img.pixel:.3f} Å{angle}; "
                f"ρ here {vmin:.3g} … {vmax:.3g} {units}, map {mmin:.3g} … {mmax:.3g}; "
                f"colour bar {lo:.3g} … {hi:.3g} {units} (rounded out from {span}){contour_text}; "
                f"+ {marked}{note}",
            )
        self.n_updates += 1
        return data

    def clear(self) -> None:
        """Hide the section and drop its image (its result is out of date).

        Hidden rather than emptied: an ``<img>`` without data shows the browser's
        broken-image icon. :meth:`update` shows it again.
        """
        self.last = None
        self.widget.layout.display = "none"
        with self.image.hold_sync():
            self.image.value = b""
            self.caption.value = ""

    def _geometry(self, sec: Section) -> tuple:
        """Set the axes' limits and labels for ``sec``'s face; return the key of that layout.

        On a new layout also finds the drawing scale (``self._pixel``: Å per display pixel
        and a display pixel corner in Å), so the face is resampled on the display's own
        pixels and drawn without resampling.
        """
        corners = sec.corners
        pad = 0.02 * float(np.ptp(corners, axis=0).max())
        xlim = (float(corners[:, 0].min() - pad), float(corners[:, 0].max() + pad))
        ylim = (float(corners[:, 1].min() - pad), float(corners[:, 1].max() + pad))
        labels = axis_labels(sec)[:2]
        key = (xlim, ylim, labels)
        if key != self._geometry_key:
            self.ax.set_xlim(*xlim)
            self.ax.set_ylim(*ylim)
            self.ax.set_xlabel(labels[0])
            self.ax.set_ylabel(labels[1])
            self.ax.apply_aspect()  # equal aspect: the axes box shrinks to the face's shape
            to_display = self.ax.transData
            (px0, py0), (px1, _) = to_display.transform([(xlim[0], ylim[0]), (xlim[1], ylim[1])])
            anchor = to_display.inverted().transform((np.floor(px0), np.floor(py0)))
            self._pixel = ((xlim[1] - xlim[0]) / (px1 - px0), (float(anchor[0]), float(anchor[1])))
            ring = np.vstack([corners, corners[:1]])
            self.outline.set_data(ring[:, 0], ring[:, 1])
            self._geometry_key = key
        return key

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

    def _render(self, layout_key, clim) -> bytes:
        """Draw the changing artists over kept pixels of everything else; PNG bytes.

        The frame, ticks and labels (the costly text) are drawn once per layout and kept;
        the colour bar once per colour range, kept in :attr:`_bars` (a section sweep
        returns to the same few nice ranges), so a new section draws no text at all.
        """
        canvas = self.fig.canvas
        # The image lies inside the padded axis limits, so it never covers the spines.
        dynamic = [self.contours, self.markers, self.outline, self._level_ticks]
        if layout_key != self._layout_key or self._background is None:
            for artist in [*dynamic, self.cbar.ax]:
                artist.set_visible(False)
            canvas.draw()
            self._background = canvas.copy_from_bbox(self.fig.bbox)
            for artist in [*dynamic, self.cbar.ax]:
                artist.set_visible(True)
            self._layout_key = layout_key
            self._bars.clear()
        canvas.restore_region(self._background)
        bar = self._bars.get(clim)
        if bar is None:
            self._bar_source.set_clim(*clim)
            self.cbar.set_ticks(bar_ticks(*clim))
            self._level_ticks.set_visible(False)
            self.fig.draw_artist(self.cbar.ax)
            self._level_ticks.set_visible(True)
            # from just left of the bar to the figure's edge: its tick labels and title too
            box = self.cbar.ax.bbox
            region = Bbox.from_extents(box.x0 - 4, 0, self.fig.bbox.x1, self.fig.bbox.y1)
            self._bars[clim] = canvas.copy_from_bbox(region)
            while len(self._bars) > _BARS_KEPT:
                self._bars.popitem(last=False)
        else:
            self._bars.move_to_end(clim)
            canvas.restore_region(bar)
        self._paint(clim)
        for artist in dynamic:
            artist.axes.draw_artist(artist)
        return canvas_png(self.fig)

    def _paint(self, clim) -> None:
        """Write the face's colours into the canvas, one raster pixel per display pixel.

        The raster's pixel edges lie on display pixel edges (see :meth:`_geometry`), so
        this is a copy, not a resampling; colours as matplotlib maps them (``N`` bins
        over ``clim``, clipped at both ends); NaN (off the face) leaves the background.
        """
        values = self.im.get_array()
        values = np.asarray(values.filled(np.nan) if np.ma.isMaskedArray(values) else values)
        x0, _, y0, _ = self.im.get_extent()
        px, py = np.rint(self.ax.transData.transform((x0, y0))).astype(int)
        buf = np.asarray(self.fig.canvas.buffer_rgba())
        height, width = buf.shape[:2]
        ny, nx = values.shape
        # raster row r covers display row py + r, which is buffer row height - 1 - (py + r)
        top, left = height - py - ny, px
        r0, c0 = max(0, -top), max(0, -left)
        r1, c1 = min(ny, height - top), min(nx, width - left)
        if r0 >= r1 or c0 >= c1:
            return
        part = values[::-1][r0:r1, c0:c1]
        lo, hi = clim
        n = len(self._lut)
        face = np.isfinite(part)
        index = np.clip(np.nan_to_num(part - lo) * (n / (hi - lo)), 0, n - 1).astype(np.intp)
        target = buf[top + r0 : top + r1, left + c0 : left + c1]
        np.copyto(target, self._lut[index], where=face[:, :, None])


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


def bar_ticks(lo: float, hi: float) -> np.ndarray:
    """Colour bar ticks from ``lo`` to ``hi`` inclusive, evenly spaced by 1, 2, 2.5 or 5 × 10ⁿ.

    Both ends are labelled, so the bar shows the range the caption states (a bar from 0
    to 3.5 labelled up to 3.2 read as a maximum of 3.2). Ranges from :func:`_nice_up`
    always split so; any other falls back to matplotlib's choice within the range.
    """
    span = hi - lo
    if span > 0 and np.isfinite(span):
        for k in (5, 4, 6, 7, 3, 8):
            step = span / k
            mantissa = step / 10.0 ** np.floor(np.log10(step))
            if any(abs(mantissa - m) < 1e-9 for m in (1.0, 2.0, 2.5, 5.0)):
                return lo + step * np.arange(k + 1)
    return MaxNLocator(5).tick_values(lo, hi)


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
