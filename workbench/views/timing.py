"""Timing panel: forward and backward time of the current backend; compare all backends."""

from __future__ import annotations

import html

import ipywidgets as widgets

from workbench.compute.text import count

__all__ = ["TimingView"]


class TimingView:
    """Current timings (``wb-timing``) and a "compare all backends" button (``wb-compare-all``)
    with its table (``wb-timing-all``).
    """

    def __init__(self):
        self.current = widgets.HTML()
        self.current.add_class("wb-timing")
        # wide enough for its label (the default 148 px cut it to "compare all ba…")
        self.compare = widgets.Button(
            description="compare all backends", icon="clock-o", layout=widgets.Layout(width="auto")
        )
        self.compare.add_class("wb-compare-all")
        self.table = widgets.HTML()
        self.table.add_class("wb-timing-all")
        self.widget = widgets.VBox([self.current, self.compare, self.table])
        self.rows: list[dict] = []

    def update(self, timings: dict[str, float], *, backend: str, device: str, grid_shape, n_atoms: int) -> None:
        """Show the last computation's timings (seconds) of ``backend`` on ``device``."""
        cells = "".join(f"<tr><td>{html.escape(k)}</td><td>{v * 1e3:.1f} ms</td></tr>" for k, v in timings.items())
        if "density backward" not in timings:
            cells += (
                "<tr><td>density backward</td><td>— (computed with the density-fit arrows, or by "
                "“compare all backends”)</td></tr>"
            )
        shape = "×".join(str(n) for n in grid_shape)
        self.current.value = (
            f"<b>{html.escape(backend)} on {html.escape(device)}</b>, {count(n_atoms, 'atom')}, grid {shape} "
            "(last computation; first calls include compilation)"
            f"<table>{cells}</table>"
        )

    def update_step(self, timings: dict[str, float], *, step: int, backend: str, device: str, grid_shape, n_atoms: int):
        """Show one relax step's breakdown (seconds; :attr:`workbench.compute.RelaxFrame.timings`)."""
        cells = "".join(f"<tr><td>{html.escape(k)}</td><td>{v * 1e3:.2f} ms</td></tr>" for k, v in timings.items())
        shape = "×".join(str(n) for n in grid_shape)
        self.current.value = (
            f"<b>relax step {step + 1}: {html.escape(backend)} on {html.escape(device)}</b>, {count(n_atoms, 'atom')}, "
            f"grid {shape} (the step shown; the first steps include compilation)<table>{cells}</table>"
        )

    def stale(self, label: str, now: str) -> None:
        """The backend table was timed for ``label``; the views now show ``now``: clear it and say so."""
        self.rows = []
        self.table.value = (
            f"<small class='wb-stale'><b>out of date:</b> backends were timed for {html.escape(label)}; "
            f"the views now show {html.escape(now)} — press “compare all backends” to time them again</small>"
        )

    def update_all(self, rows: list[dict], label: str = "") -> None:
        """Show the rows of :func:`workbench.compute.time_backends` (timed for ``label``)."""
        self.rows = rows
        body = []
        for r in rows:
            if r["error"]:
                body.append(
                    f"<tr><td>{r['device']}</td><td>{r['backend']}</td><td>{r['op']}</td>"
                    f"<td colspan=2>{html.escape(r['error'])}</td></tr>"
                )
            else:
                body.append(
                    f"<tr><td>{r['device']}</td><td>{r['backend']}</td><td>{r['op']}</td>"
                    f"<td>{r['forward_ms']:.1f} ms</td><td>{r['backward_ms']:.1f} ms</td></tr>"
                )
        self.table.value = (
            "<table><tr><th>device</th><th>backend</th><th>op</th><th>forward</th><th>backward</th></tr>"
            + "".join(body)
            + "</table><small>"
            + (f"for {html.escape(label)}; " if label else "")
            + "best of 2 runs each; density backward is that of ½‖ρ − ρ_target‖²</small>"
        )
