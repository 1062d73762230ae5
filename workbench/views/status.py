"""The status line: what is computing, progress, cancel, and errors with what to do."""

from __future__ import annotations

import html

import ipywidgets as widgets

__all__ = ["StatusView"]

_COLOURS = {"idle": "#2a7", "busy": "#06c", "warning": "#b80", "error": "#c22", "cancelled": "#777"}


class StatusView:
    """One line of text (CSS class ``wb-status``, plus ``wb-status-<level>``), a progress bar
    (``wb-progress``) and a cancel button (``wb-cancel``).

    Attributes
    ----------
    level : str
        ``idle``, ``busy``, ``warning``, ``error`` or ``cancelled``.
    message : str
        The plain text of the line (what tests and people read).
    """

    def __init__(self):
        self.label = widgets.HTML()
        self.label.add_class("wb-status")
        self.progress = widgets.IntProgress(min=0, max=1, value=0, layout=widgets.Layout(width="160px"))
        self.progress.add_class("wb-progress")
        self.cancel = widgets.Button(description="cancel", icon="stop", disabled=True, tooltip="cancel the computation")
        self.cancel.add_class("wb-cancel")
        self.widget = widgets.HBox([self.progress, self.cancel, self.label])
        self.level = "idle"
        self.message = ""
        self.set("idle", "ready")

    def set(self, level: str, message: str) -> None:
        """Show ``message`` at ``level``."""
        old = self.level
        self.level, self.message = level, message
        with self.label.hold_sync():
            if old != level:
                self.label.remove_class(f"wb-status-{old}")
            self.label.add_class(f"wb-status-{level}")
            self.label.value = f"<span style='color:{_COLOURS.get(level, '#000')}'>{html.escape(message)}</span>"
        self.cancel.disabled = level != "busy"
        if level != "busy":
            self.progress.value = 0

    def step(self, i: int, n: int, what: str) -> None:
        """Progress: stage ``i`` of ``n``, doing ``what``."""
        with self.progress.hold_sync():
            self.progress.max = n
            self.progress.value = i
        self.set("busy", f"computing: {what} …")
