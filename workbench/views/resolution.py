"""Resolution tab: |F| and phase errors by shell, a comparison's FSC, and the map truncated at a resolution."""

from __future__ import annotations

import html
import math

import ipywidgets as widgets
import numpy as np

from workbench.views._figure import new_figure, png_bytes

__all__ = ["ResolutionView"]


#: The resolution slider's value for "off": the views show the map itself (a d_min of 0 keeps every coefficient).
OFF = 0.0


def slider_options(finest: float, coarsest: float) -> list[tuple[str, float]]:
    """The resolution slider's stops: ``coarsest`` down to ``finest`` (rounded up to 0.1 Å) by 0.1 Å, then off."""
    top = round(coarsest, 1)
    low = math.ceil(round(finest * 10, 6)) / 10
    n = max(0, round((top - low) * 10))
    stops = [round(top - 0.1 * i, 1) for i in range(n + 1)]
    return [(f"{d:.1f} Å", d) for d in stops] + [("off", OFF)]


class ResolutionView:
    """Shell plots (``wb-resolution-plot``), a note (``wb-resolution-note``), and the resolution slider
    (``wb-resolution-d``) with its caption (``wb-resolution-caption``).

    The slider truncates what the main section and the 3D view show: at a stop d they draw the map's
    Fourier synthesis to d, at ``off`` the map itself. Draws what :func:`workbench.compute.resolution_report`
    returns; it computes nothing.
    """

    def __init__(self):
        self.note = widgets.HTML()
        self.note.add_class("wb-resolution-note")
        self.plot = widgets.Image(format="png", layout=widgets.Layout(width="640px"))
        self.plot.add_class("wb-resolution-plot")
        self.d = widgets.SelectionSlider(
            options=slider_options(1.4, 6.0),
            value=OFF,
            description="truncate at",
            continuous_update=True,
            style={"description_width": "initial"},
            layout=widgets.Layout(width="420px"),
        )
        self.d.add_class("wb-resolution-d")
        self.caption = widgets.HTML()
        self.caption.add_class("wb-resolution-caption")
        self.widget = widgets.VBox([self.note, self.plot, self.d, self.caption])
        self.drawn_for = None  # the map key the plots show
        self.show_truncation(OFF)

    @property
    def d_min(self) -> float | None:
        """The resolution the views are truncated at, in Å; None: off (the map itself)."""
        d = float(self.d.value)
        return None if d == OFF else d

    def set_range(self, finest: float, coarsest: float) -> None:
        """The slider runs from ``coarsest`` to ``finest`` Å (twice the grid spacing, about), then off; a stop
        outside the new range moves to the nearest one (off stays off)."""
        options = slider_options(finest, coarsest)
        if [v for _, v in options] == list(self.d._options_values):
            return
        d = float(self.d.value)
        stops = [v for _, v in options[:-1]]
        keep = OFF if d == OFF else min(stops, key=lambda v: abs(v - d))
        with self.d.hold_trait_notifications():
            self.d.options = options
            self.d.value = keep

    def show_truncation(self, d: float | None) -> None:
        """Say under the slider what the section and the 3D view show."""
        if d is None or d == OFF:
            text = "the section and the 3D view show the map itself (off); move the slider to see it at a resolution"
        else:
            text = (
                f"<b>the section and the 3D view show the map truncated at d = {d:.1f} Å</b>: the Fourier "
                "synthesis of its factors with d ≥ "
                + f"{d:.1f} Å (what data to {d:.1f} Å would show); off: the map itself"
            )
        self.caption.value = f"<small>{text}</small>"

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

    def unavailable(self, message: str) -> None:
        """Say why there is nothing to show (and clear what was shown)."""
        self.plot.value = b""
        self.note.value = f"<small class='wb-stale'>{html.escape(message)}</small>"
        self.drawn_for = None
