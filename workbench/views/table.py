"""Density at each atom (tricubic) as a sortable table, to spot atoms out of density."""

from __future__ import annotations

import html

import ipywidgets as widgets
import numpy as np

from workbench.compute import atom_table_order
from workbench.compute.text import count

__all__ = ["AtomTableView"]

COLUMNS = {"index": "#", "rho": "ρ model (e/Å³)", "target": "ρ target (e/Å³)", "ratio": "target / model"}


class AtomTableView:
    """An HTML table of the atoms, sorted by one column (CSS class ``wb-atom-table``).

    The sort column and direction are controls bound to the state (``table_sort``,
    ``table_ascending``); the default, ascending target/model ratio, puts the atoms that
    are most out of density first. Shows ``rows`` rows.
    """

    def __init__(self, rows: int = 25):
        self.rows = rows
        self.html = widgets.HTML()
        self.html.add_class("wb-atom-table")
        self.widget = self.html
        self.order: np.ndarray = np.zeros(0, int)

    def update(self, labels, rho, target, *, sort: str, ascending: bool, target_source: str) -> np.ndarray:
        """Sort and draw; returns the atom indices in table order (all atoms, not only shown rows)."""
        rho = np.asarray(rho, float)
        target = np.asarray(target, float)
        ratio, order = atom_table_order(rho, target, sort=sort, ascending=ascending)
        self.order = order
        head = "".join(
            f"<th>{COLUMNS[c]}{' ▲' if c == sort and ascending else ' ▼' if c == sort else ''}</th>" for c in COLUMNS
        )
        body = []
        for i in order[: self.rows]:
            body.append(
                f"<tr><td>{i}</td><td>{html.escape(str(labels[i]))}</td><td>{rho[i]:.3f}</td>"
                f"<td>{target[i]:.3f}</td><td>{ratio[i]:.3f}</td></tr>"
            )
        head = head.replace("<th>#</th>", "<th>#</th><th>atom</th>")
        self.html.value = (
            f"<small>density at {count(len(rho), 'atom')} (tricubic, Catmull-Rom); target: {html.escape(target_source)}; "
            f"first {count(min(self.rows, len(rho)), 'row')} sorted by {COLUMNS[sort]}</small>"
            f"<table class='wb-atom-table-body'><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
        )
        return order

    def unavailable(self, why: str) -> None:
        """Say why the table is empty."""
        self.order = np.zeros(0, int)
        self.html.value = f"<small>density at atoms unavailable: {html.escape(why)}</small>"
