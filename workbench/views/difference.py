"""The difference view: two ``device:backend`` runs on the same inputs, and how they differ."""

from __future__ import annotations

import html

import ipywidgets as widgets

from workbench.compute import Comparison, DifferenceResult
from workbench.state import compare_choices
from workbench.views.slice import SliceView

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
    with run B as the reference.
    """

    def __init__(self):
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
        self.widget = widgets.VBox([widgets.HBox([self.a, self.b, self.run]), self.stats, self.slice.widget])
        self.last: DifferenceResult | None = None

    def update(self, diff: DifferenceResult) -> None:
        """Show ``diff``: the section of A − B and the map/gradient statistics."""
        self.last = diff
        self.show_section(diff)
        rows = _row("map ρ", diff.maps)
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
        """Redraw the section of ``diff`` (after the slice moved; the statistics stay)."""
        self.slice.update(diff.section, note=f"; A = {diff.a}, B = {diff.b}, for {diff.label}")

    def stale(self, label: str, now: str) -> None:
        """The shown comparison was for ``label``, the views are now for ``now``: clear it and say so."""
        self.last = None
        with self.slice.image.hold_sync():
            self.slice.image.value = b""
            self.slice.caption.value = ""
        self.stats.value = (
            f"<span class='wb-stale'><b>out of date:</b> the last comparison was for {html.escape(label)}; "
            f"the views now show {html.escape(now)} — press compare to recompute</span>"
        )
