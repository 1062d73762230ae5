"""Resolution tab: |F| and phase errors by shell, a comparison's FSC, and the map truncated at a resolution."""

from __future__ import annotations

import html

import ipywidgets as widgets
import numpy as np

from workbench.views._figure import encode_png, new_figure, png_bytes

__all__ = ["ResolutionView"]


_VIRIDIS = None


def section_png(section: np.ndarray, scale: int = 4) -> bytes:
    """A 2-D section as a viridis PNG, ``scale`` pixels per voxel, first axis across, second up.

    Coloured with a lookup table and encoded directly (no figure): the slider redraws it on every
    key press.
    """
    global _VIRIDIS
    if _VIRIDIS is None:
        from matplotlib import colormaps

        _VIRIDIS = (colormaps["viridis"](np.linspace(0, 1, 256))[:, :3] * 255).astype(np.uint8)
    lo, hi = float(section.min()), float(section.max())
    level = ((section - lo) * (255 / (hi - lo if hi > lo else 1.0))).astype(np.uint8)
    rgb = _VIRIDIS[level.T[::-1]]  # rows: the second axis, upwards
    return encode_png(np.repeat(np.repeat(rgb, scale, axis=0), scale, axis=1))


class ResolutionView:
    """Shell plots (``wb-resolution-plot``), a note (``wb-resolution-note``), the resolution slider
    (``wb-resolution-d``), whether the 3D view shows the truncated map (``wb-resolution-3d``) and the
    truncated synthesis's section (``wb-resolution-section``).

    Draws what :func:`workbench.compute.resolution_report` and :func:`workbench.compute.truncated_section`
    return; it computes nothing.
    """

    def __init__(self):
        self.note = widgets.HTML()
        self.note.add_class("wb-resolution-note")
        self.plot = widgets.Image(format="png", layout=widgets.Layout(width="640px"))
        self.plot.add_class("wb-resolution-plot")
        self.d = widgets.FloatSlider(
            value=3.0,
            min=1.3,
            max=6.0,
            step=0.1,
            description="d (Å)",
            continuous_update=True,
            readout_format=".1f",
        )
        self.d.add_class("wb-resolution-d")
        self.in_3d = widgets.Checkbox(value=False, description="3D view shows the map truncated at d", indent=False)
        self.in_3d.add_class("wb-resolution-3d")
        self.section = widgets.Image(format="png", layout=widgets.Layout(width="320px"))
        self.section.add_class("wb-resolution-section")
        self.caption = widgets.HTML()
        self.widget = widgets.VBox([self.note, self.plot, self.d, self.in_3d, self.section, self.caption])
        self.drawn_for = None  # the map key the plots show

    def set_range(self, finest: float, coarsest: float) -> None:
        """The slider runs from ``finest`` (twice the grid spacing, about) to ``coarsest`` Å."""
        with self.d.hold_trait_notifications():
            self.d.min, self.d.max = round(finest + 0.05, 1), coarsest
            self.d.value = min(max(self.d.value, self.d.min), self.d.max)

    def update(self, report, *, label: str) -> None:
        """Plot ``report`` (:class:`workbench.compute.ResolutionReport`) for the settings ``label`` names."""
        panels = 2 + (report.fsc is not None)
        fig = new_figure(2.7 * panels, 2.6)
        axes = fig.subplots(1, panels)
        t = report.table
        if t is not None:
            s = t.s_mid.cpu().numpy()
            rel = t.rel_error.cpu().numpy()
            amp = t.amplitude_error.cpu().numpy()
            axes[0].semilogy(s, rel, "o-", ms=3, label="‖F−F_ref‖/‖F_ref‖")
            axes[0].semilogy(s, np.maximum(amp, 1e-12), "s--", ms=3, label="|F| error")
            axes[0].set_xlabel("1/d (1/Å)", fontsize=8)
            axes[0].legend(fontsize=6)
            axes[0].set_title("error by shell", fontsize=8)
            axes[1].plot(s, t.phase_error.cpu().numpy(), "o-", ms=3)
            axes[1].set_xlabel("1/d (1/Å)", fontsize=8)
            axes[1].set_title("phase error (°)", fontsize=8)
        if report.fsc is not None:
            ax = axes[-1]
            ax.plot(report.fsc.s_mid.cpu().numpy(), report.fsc.fsc.cpu().numpy(), "o-", ms=2)
            for level in (0.5, 0.143):
                ax.axhline(level, color="grey", lw=0.8, ls=":")
                ax.text(ax.get_xlim()[0], level, f" {level}", fontsize=6, va="bottom")
            ax.set_xlabel("1/d (1/Å)", fontsize=8)
            ax.set_title("FSC of the comparison", fontsize=8)
        for ax in axes:
            ax.tick_params(labelsize=6)
        fig.tight_layout()
        self.plot.value = png_bytes(fig)
        worst = "" if t is None else f", worst shell {float(t.rel_error.max()):.1e}"
        parts = [
            f"<b>{html.escape(label)}</b>: {report.n_reflections:,} P 1 reflections to {report.d_min:.2f} Å "
            f"against {html.escape(report.reference_name or 'nothing')}{worst}"
        ]
        if report.fsc is not None:
            for level in (0.5, 0.143):
                d = report.fsc.crossing(level)
                parts.append(f"FSC {level}: {'not crossed' if d is None else f'{d:.2f} Å'}")
        if report.note:
            parts.append(f"<small>{html.escape(report.note)}</small>")
        self.note.value = "<br>".join(parts)

    def show_section(self, section: np.ndarray, *, d: float, units: str) -> None:
        """Draw the truncated synthesis's section (2-D, the map's unit) at resolution ``d`` Å."""
        self.section.value = section_png(section)
        self.caption.value = (
            f"<small>the current map's section from its factors with d ≥ {d:.1f} Å "
            f"(range {float(section.min()):.2f} to {float(section.max()):.2f} {html.escape(units)})</small>"
        )

    def unavailable(self, message: str) -> None:
        """Say why there is nothing to show (and clear what was shown)."""
        self.plot.value = b""
        self.section.value = b""
        self.caption.value = ""
        self.note.value = f"<small class='wb-stale'>{html.escape(message)}</small>"
        self.drawn_for = None
