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
    ``wb-relax-stop``, ``wb-relax-progress`` (step, loss and RMSD of the frame shown).

    Attributes
    ----------
    widget : ipywidgets.VBox
    steps, lr, lam : ipywidgets.BoundedIntText, ipywidgets.BoundedFloatText
        Ranges and defaults from :data:`workbench.compute.RELAX_RANGES`.
    start, stop : ipywidgets.Button
        Only one is enabled at a time.
    progress : ipywidgets.HTML
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
        self.widget = widgets.VBox(
            [self.steps, self.lr, self.lam, widgets.HBox([self.start, self.stop]), self.progress]
        )

    def running(self, on: bool) -> None:
        """Enable stop while a run is going, start otherwise."""
        self.start.disabled = on
        self.stop.disabled = not on

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
