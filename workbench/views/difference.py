"""The difference view: two ``device:backend`` runs on the same inputs, and how they differ."""

from __future__ import annotations

import html

import ipywidgets as widgets

from workbench.compute import Comparison, DifferenceResult, model_pdb, over_marks, over_volume
from workbench.state import compare_choices
from workbench.views.slice import SliceView
from workbench.views.view3d import View3D

# Over-tolerance voxels: black dots on the section, an orange mesh in 3D.
_OVER_COLOUR = "#000000"
_OVER_3D = "#ff7f00"

__all__ = ["DifferenceView"]


def _row(name: str, c: Comparison) -> str:
    verdict = "✓ within" if c.ok else "✗ outside"
    return (
        f"<tr><td>{name}</td><td>{c.max_abs:.3e}</td><td>{c.max_ref:.3e}</td><td>{c.rel_l2:.3e}</td>"
        f"<td>{c.n_over} / {c.n_total}</td><td>{verdict} tolerance</td></tr>"
    )


class DifferenceView:
    """Pick two runs (``wb-diff-a``, ``wb-diff-b``), press compare (``wb-diff-run``); see the
    difference section (``wb-diff-slice``) and the statistics (``wb-diff-stats``).

    Tolerance per element is docs/kernels.md's float32 contract, 1e-5·max|ref| + 1e-5·|ref|,
    with run B as the reference. Voxels of A outside it are marked: black dots on the
    section, an orange mesh around them in 3D (``wb-diff-3d``), with the model's sticks.
    Registered density backends (:func:`kernels.register_backend`) are in both lists.
    """

    def __init__(self, *, lib_path=None):
        choices = compare_choices()
        self.a = widgets.Dropdown(options=choices, value="cpu:cpu", description="run A")
        self.a.add_class("wb-diff-a")
        self.b = widgets.Dropdown(options=choices, value="cpu:reference", description="run B (ref)")
        self.b.add_class("wb-diff-b")
        self.run = widgets.Button(description="compare", icon="balance-scale", tooltip="run A and B on the same inputs")
        self.run.add_class("wb-diff-run")
        self.slice = SliceView(cmap="RdBu_r", title="A − B", css="wb-diff-slice", symmetric=True)
        self.stats = widgets.HTML("<small>press compare: both runs use the same atoms, grid and radius</small>")
        self.stats.add_class("wb-diff-stats")
        self.view3d = View3D(lib_path=lib_path, height=360, css_class="wb-diff-3d")
        self.caption3d = widgets.HTML()
        self.widget = widgets.VBox(
            [widgets.HBox([self.a, self.b, self.run]), self.stats, self.slice.widget, self.view3d, self.caption3d]
        )
        self.last: DifferenceResult | None = None
        self.n_marked = 0
        # The comparison whose pair the dropdowns no longer name (hidden; shown again if they
        # name its pair again), and the model its 3D sticks come from.
        self._hidden: DifferenceResult | None = None
        self._model = None
        self._refreshing = False
        self.a.observe(self._pair_changed, names="value")
        self.b.observe(self._pair_changed, names="value")

    @property
    def pair(self) -> tuple[str, str]:
        """The ``(run A, run B)`` the dropdowns name now."""
        return self.a.value, self.b.value

    def _pair_changed(self, _change) -> None:
        if self._refreshing:
            return
        # A result is only ever shown under the pair it compares: a dropdown moved by a person,
        # or by refresh_choices after a backend was unregistered, hides it.
        if self.last is not None and (self.last.a, self.last.b) != self.pair:
            self._hidden = self.last
            self._clear()
            self.stats.value = (
                f"<span class='wb-stale'>press compare for {html.escape(self.a.value)} vs {html.escape(self.b.value)} "
                f"(the last result, {html.escape(self._hidden.a)} vs {html.escape(self._hidden.b)}, is hidden: "
                "choose that pair again to see it)</span>"
            )
        elif self.last is None and self._hidden is not None and (self._hidden.a, self._hidden.b) == self.pair:
            self.update(self._hidden, self._model)

    def refresh_choices(self) -> None:
        """Offer the pairs runnable now (a backend registered after the view was built included)."""
        choices = compare_choices()
        self._refreshing = True  # a new options list passes the value through its first option
        try:
            for dd, fallback in ((self.a, "cpu:cpu"), (self.b, "cpu:reference")):
                if tuple(dd.options) != choices:
                    value = dd.value if dd.value in choices else fallback
                    dd.options = choices
                    dd.value = value
        finally:
            self._refreshing = False
        self._pair_changed(None)

    def update(self, diff: DifferenceResult, model=None) -> None:
        """Show ``diff``: the section of A − B, the voxels over tolerance in 3D, the statistics.

        ``model`` (the :class:`kernels.Model` compared) gives the 3D view its sticks.
        """
        self.last, self._hidden, self._model = diff, None, model
        if (diff.a, diff.b) != self.pair:
            # a compare(a, b) from code: the dropdowns name the pair shown (no run of its own)
            with self.a.hold_trait_notifications(), self.b.hold_trait_notifications():
                self.a.value, self.b.value = diff.a, diff.b
        self.show_section(diff)
        self._show_3d(diff, model)
        rows = _row(f"map ρ ({diff.units})", diff.maps)
        if diff.gradients is not None:
            rows += _row(f"{diff.gradient_kind} gradient", diff.gradients)
        note = f"<br><small>{html.escape(diff.gradient_note)}</small>" if diff.gradient_note else ""
        self.stats.value = (
            f"<b>{html.escape(diff.a)} vs {html.escape(diff.b)}</b> for {html.escape(diff.label)} (same inputs){note}"
            "<table><tr><th></th><th>max |A−B|</th><th>max |B|</th><th>‖A−B‖/‖B‖</th>"
            "<th>over tol.</th><th></th></tr>" + rows + "</table>"
            "<small>tolerance per element: 1e-5·max|B| + 1e-5·|B| (docs/kernels.md float32 contract)</small>"
        )

    def show_section(self, diff: DifferenceResult) -> None:
        """Redraw the section of ``diff`` (after the slice moved; the statistics stay), over-tolerance voxels marked.

        A comparison hidden because the dropdowns name another pair stays hidden: its new section
        is kept for when they name its pair again.
        """
        if self.last is None and self._hidden is not None:
            self._hidden = diff
            return
        marks = over_marks(diff, colour=_OVER_COLOUR)
        self.n_marked = len(marks.uv)
        over = f" (black dots; {diff.maps.n_over} in the map)"
        self.slice.update(
            diff.section, marks=marks, note=f"; A = {diff.a}, B = {diff.b}, for {diff.label}{over}", units=diff.units
        )

    def _show_3d(self, diff: DifferenceResult, model) -> None:
        n_over = diff.maps.n_over
        vol = over_volume(diff)
        self.view3d.layout.display = None  # shown again after stale()
        with self.view3d.hold_sync():
            if model is not None:
                self.view3d.model_text = model_pdb(model, diff.xyz)
            self.view3d.map_bytes = vol.ccp4 if n_over else b""
            self.view3d.iso_level = 0.5
            self.view3d.iso_color = _OVER_3D
            self.view3d.iso_style = "mesh"  # drawn in iso_color (the "surface" skin has the map's own colour)
        stride = f" (every {vol.stride}th voxel)" if vol.stride > 1 else ""
        self.caption3d.value = (
            f"<small>orange: the {n_over} voxels where {html.escape(diff.a)} is outside the tolerance around "
            f"{html.escape(diff.b)}{stride}</small>"
            if n_over
            else f"<small>no voxel of {html.escape(diff.a)} is outside the tolerance</small>"
        )

    def stale(self, label: str, now: str) -> None:
        """The shown comparison was for ``label``, the views are now for ``now``: clear it and say so."""
        self._hidden = None
        self._clear()
        self.stats.value = (
            f"<span class='wb-stale'><b>out of date:</b> the last comparison was for {html.escape(label)}; "
            f"the views now show {html.escape(now)} — press compare to recompute</span>"
        )

    def _clear(self) -> None:
        self.last = None
        self.n_marked = 0
        # Nothing of the old comparison stays on show: no section (hidden, not an empty
        # image: that is a broken-image icon), no old model or mesh in 3D.
        self.slice.clear()
        self.view3d.clear()
        self.view3d.layout.display = "none"
        self.caption3d.value = ""
