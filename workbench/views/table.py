"""Density at each atom (tricubic) as a sortable table, to spot atoms out of density."""

from __future__ import annotations

import html
from pathlib import Path

import anywidget
import numpy as np
import traitlets

from workbench.compute import atom_table_order
from workbench.compute.text import count

__all__ = ["AtomTable", "AtomTableView"]

COLUMNS = {"index": "#", "rho": "ρ model", "target": "ρ target", "ratio": "target / model"}


# Rows are buttons: the pointer says so, the picked endpoints stand out.
_STYLE = (
    "<style>.wb-atom-table-body tr[data-atom]{cursor:pointer}"
    ".wb-atom-table-body tr[data-atom]:hover{background:#e8f0ff}"
    ".wb-atom-table-body tr.wb-picked{background:#fff2c0;font-weight:bold}</style>"
)


class AtomTable(anywidget.AnyWidget):
    """HTML table whose rows can be clicked (CSS class ``wb-atom-table``).

    ``value`` is the table's HTML (escaped by the caller); rows carry ``data-atom`` with
    their atom index. A click on a row sends ``{"type": "pick", "index": i}``;
    :meth:`on_pick` callbacks get ``i`` (checked to be a row's atom).
    """

    _esm = Path(__file__).resolve().parent.parent / "static" / "table.js"
    value = traitlets.Unicode("").tag(sync=True)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_class("wb-atom-table")
        self._pick_callbacks: list = []
        self.rows: set[int] = set()
        self.on_msg(self._message)

    def on_pick(self, callback) -> None:
        """Call ``callback(index)`` when the row of atom ``index`` is clicked."""
        self._pick_callbacks.append(callback)

    def _message(self, _widget, content, _buffers) -> None:
        if not isinstance(content, dict) or content.get("type") != "pick":
            return
        index = content.get("index")
        if isinstance(index, bool) or not isinstance(index, int) or index not in self.rows:
            return  # a stale or forged message: only rows on show can be picked
        for callback in self._pick_callbacks:
            callback(index)


class AtomTableView:
    """The atoms sorted by one column, as a clickable table (CSS class ``wb-atom-table``).

    The sort column and direction are controls bound to the state (``table_sort``,
    ``table_ascending``); the default, ascending target/model ratio, puts the atoms that
    are most out of density first. Shows ``rows`` rows; clicking a row picks its atom
    (:meth:`on_pick`), like clicking the atom in the 3D view.
    """

    def __init__(self, rows: int = 25):
        self.rows = rows
        self.html = AtomTable()
        self.widget = self.html
        self.order: np.ndarray = np.zeros(0, int)

    def on_pick(self, callback) -> None:
        """Call ``callback(index)`` with the atom index when a row is clicked."""
        self.html.on_pick(callback)

    def update(
        self, labels, rho, target, *, sort: str, ascending: bool, target_source: str, picked=(), units: str = "e/Å³"
    ) -> np.ndarray:
        """Sort and draw; returns the atom indices in table order (all atoms, not only shown rows).

        ``picked`` atoms (the profile's endpoints, the atom picked last) are highlighted and
        always shown: after the first ``rows`` rows when they are not among them. The ρ columns
        are headed with ``units`` (fm/Å³ for a neutron map).
        """
        rho = np.asarray(rho, float)
        target = np.asarray(target, float)
        ratio, order = atom_table_order(rho, target, sort=sort, ascending=ascending)
        self.order = order
        names = {c: f"{name} ({units})" if c in ("rho", "target") else name for c, name in COLUMNS.items()}
        head = "".join(
            f"<th>{names[c]}{' ▲' if c == sort and ascending else ' ▼' if c == sort else ''}</th>" for c in COLUMNS
        )
        picked = [int(i) for i in dict.fromkeys(picked) if 0 <= int(i) < len(rho)]
        body = []
        shown = [int(i) for i in order[: self.rows]]
        # the picked atoms are always on show: after the first rows, in table order, if not among them
        rank = np.empty(len(order), int)
        rank[order] = np.arange(len(order))
        extra = sorted((i for i in picked if i not in shown), key=lambda i: rank[i])
        for i in shown + extra:
            if extra and i == extra[0]:
                body.append("<tr class='wb-gap'><td colspan='5'>⋯ the picked atoms:</td></tr>")
            cls = " class='wb-picked'" if i in picked else ""
            body.append(
                f"<tr data-atom='{i}'{cls}><td>{i}</td><td>{html.escape(str(labels[i]))}</td><td>{rho[i]:.3f}</td>"
                f"<td>{target[i]:.3f}</td><td>{ratio[i]:.3f}</td></tr>"
            )
        shown += extra
        head = head.replace("<th>#</th>", "<th>#</th><th>atom</th>")
        self.html.rows = set(shown)
        self.html.value = (
            f"{_STYLE}<small>density at {count(len(rho), 'atom')} (tricubic, Catmull-Rom); target: "
            f"{html.escape(target_source)}; first {count(min(self.rows, len(rho)), 'row')} sorted by "
            f"{names[sort]}{', then the picked atoms' if extra else ''}; click a row: its residue becomes the 3D region, and the line profile "
            "runs to it from the last atom picked</small>"
            f"<table class='wb-atom-table-body'><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
        )
        return order

    def unavailable(self, why: str) -> None:
        """Say why the table is empty."""
        self.order = np.zeros(0, int)
        self.html.rows = set()
        self.html.value = f"<small>density at atoms unavailable: {html.escape(why)}</small>"
