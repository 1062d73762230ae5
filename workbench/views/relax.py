"""The "relax" control: steps, step size and λ of the fit loop, start and stop, and its progress."""

from __future__ import annotations

import html

import ipywidgets as widgets

from workbench.compute.relax import RELAX_RANGES, RelaxFrame

__all__ = ["RelaxView"]

_STYLE = {"description_width": "110px"}
_LAMBDA_HELP = (
    "weight of the planarity NLL against the density fit. Default 0: the target here is the map of the "
    "undistorted model itself, so the density alone points at the answer; notebook 07 compares λ 0, 0.01 and "
    "0.1 on this case and 0 fits best (a stiff restraint flattens the groups before the map has moved them). "
    "Raise it when the map says less than the chemistry: a coarse grid, a loaded low-resolution or noisy map"
)
_LAYOUT = {"width": "300px"}


def _box(cls, name: str, description: str, tooltip: str, **kw):
    lo, hi, default = RELAX_RANGES[name]
    return cls(
        value=default, min=lo, max=hi, description=description, tooltip=tooltip, style=_STYLE, layout=_LAYOUT, **kw
    )


class RelaxView:
    """Settings, start/stop buttons and the progress line of the fit loop (:mod:`workbench.compute.relax`).

    CSS classes: ``wb-relax-steps``, ``wb-relax-lr``, ``wb-relax-lambda``, ``wb-relax-start``,
    ``wb-relax-stop``, ``wb-relax-progress`` (step, loss and RMSD of the frame shown),
    ``wb-relax-plot`` (R-factor and correlation by step: an SVG whose ``polyline.wb-relax-r`` and
    ``polyline.wb-relax-cc`` carry ``data-points``, the steps plotted).

    Attributes
    ----------
    widget : ipywidgets.VBox
    steps, lr, lam : ipywidgets.BoundedIntText, ipywidgets.BoundedFloatText
        Ranges and defaults from :data:`workbench.compute.RELAX_RANGES`.
    start, stop : ipywidgets.Button
        Only one is enabled at a time.
    progress : ipywidgets.HTML
    plot : ipywidgets.HTML
        R and correlation of the frames' structure factors against ρ_target's, by step.
    agreement : list of (int, float, float)
        (step, R, correlation) of each frame of the run shown, in order.
    """

    def __init__(self):
        self.steps = _box(widgets.BoundedIntText, "steps", "steps", "Adam steps of one run")
        self.lr = _box(
            widgets.BoundedFloatText, "lr", "step size (Å)", "Adam's learning rate: about the largest move per step",
            step=0.01,
        )  # fmt: skip
        self.lam = _box(
            widgets.BoundedFloatText, "lam", "λ planarity", _LAMBDA_HELP, step=0.05,
        )  # fmt: skip
        self.start = widgets.Button(description="start", icon="play", layout=widgets.Layout(width="auto"))
        self.stop = widgets.Button(description="stop", icon="stop", disabled=True, layout=widgets.Layout(width="auto"))
        self.progress = widgets.HTML(
            "<small>fits the atoms shown to ρ_target (the density-fit arrows' target): "
            "L = V·Σ(ρ − ρ_target)² + λ·planarity NLL</small>"
        )
        for w, css in (
            (self.steps, "wb-relax-steps"),
            (self.lr, "wb-relax-lr"),
            (self.lam, "wb-relax-lambda"),
            (self.start, "wb-relax-start"),
            (self.stop, "wb-relax-stop"),
            (self.progress, "wb-relax-progress"),
        ):
            w.add_class(css)
        self.plot = widgets.HTML("", layout=widgets.Layout(width="300px"))
        self.plot.add_class("wb-relax-plot")
        self.agreement: list[tuple[int, float, float]] = []
        self._against = ""
        self.widget = widgets.VBox(
            [self.steps, self.lr, self.lam, widgets.HBox([self.start, self.stop]), self.progress, self.plot]
        )

    def running(self, on: bool) -> None:
        """Enable stop while a run is going, start otherwise; a new run starts a new plot."""
        if on:
            self.agreement = []
            self.plot.value = ""
        self.start.disabled = on
        self.stop.disabled = not on

    def show_agreement(self, step: int, r: float, cc: float, against: str) -> None:
        """Add frame ``step``'s R-factor and correlation (``against``: what they compare with) to the plot."""
        self.agreement.append((step, r, cc))
        self._against = against
        self.plot.value = _agreement_svg(self.agreement, against)

    def show(self, frame: RelaxFrame, n_steps: int, dropped: int) -> None:
        """Say which step the views show (``dropped``: frames the views skipped so far)."""
        rmsd = "" if frame.rmsd is None else f", RMSD to the model {frame.rmsd:.3f} Å"
        self.progress.value = (
            f"<small>step {frame.step + 1}/{n_steps}: L = {frame.loss:.4g} (fit {frame.fit:.4g} + λ·NLL "
            f"{frame.planarity:.4g}){rmsd}; {frame.timings['step'] * 1e3:.1f} ms a step"
            f"{f', {dropped} frames skipped by the views' if dropped else ''}</small>"
        )

    def done(self, message: str) -> None:
        """Put the end of a run (finished, stopped, failed) under the buttons."""
        self.progress.value = f"<small>{html.escape(message)}</small>"


_W, _H = 300, 150
_LEFT, _RIGHT, _TOP, _BOTTOM = 34, 8, 20, 22


def _agreement_svg(points: list[tuple[int, float, float]], against: str) -> str:
    """R (red) and correlation (blue) against the step shown (1-based), on a 0–1 axis (R above 1 widens it)."""
    steps = [p[0] + 1 for p in points]
    lo, hi = min(steps), max(max(steps), min(steps) + 1)
    top = max(1.0, max((p[1] for p in points), default=0.0))
    w, h = _W - _LEFT - _RIGHT, _H - _TOP - _BOTTOM

    def xy(step: int, v: float) -> str:
        return f"{_LEFT + w * (step - lo) / (hi - lo):.1f},{_TOP + h * (1 - min(max(v, 0.0), top) / top):.1f}"

    def line(css: str, colour: str, column: int) -> str:
        pts = " ".join(xy(s, p[column]) for s, p in zip(steps, points))
        return (
            f'<polyline class="{css}" data-points="{len(points)}" points="{pts}" fill="none" stroke="{colour}" '
            'stroke-width="1.5"/>'
        )

    last = points[-1]
    ticks = "".join(
        f'<text x="{_LEFT - 4}" y="{_TOP + h * (1 - v / top) + 3:.1f}" text-anchor="end">{v:g}</text>'
        f'<line x1="{_LEFT}" x2="{_LEFT + w}" y1="{_TOP + h * (1 - v / top):.1f}" y2="{_TOP + h * (1 - v / top):.1f}" '
        'stroke="#ddd"/>'
        for v in (0.0, 0.5 * top, top)
    )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" font-size="10" font-family="sans-serif">'
        f"<title>{html.escape(against)}</title>{ticks}"
        f'<text x="{_LEFT}" y="12"><tspan fill="#c02020">R {last[1]:.3f}</tspan>  '
        f'<tspan fill="#2050c0">CC {last[2]:.3f}</tspan> at step {last[0] + 1}</text>'
        f'<text x="{_LEFT}" y="{_H - 6}">{lo}</text><text x="{_LEFT + w}" y="{_H - 6}" text-anchor="end">'
        f"{hi} step</text>{line('wb-relax-r', '#c02020', 1)}{line('wb-relax-cc', '#2050c0', 2)}</svg>"
        f"<small>{html.escape(against)}</small>"
    )
