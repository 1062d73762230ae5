"""Files handed to the browser: the export buttons download to the person's computer."""

from __future__ import annotations

from pathlib import Path

import anywidget

__all__ = ["Download"]


class Download(anywidget.AnyWidget):
    """Sends a file's bytes to the page, which saves them as a download (CSS class ``wb-download``).

    The bytes go as one binary message buffer, not as widget state: nothing stays in the
    notebook or the page after the download. ``last`` is ``(filename, mime, bytes)`` of
    the latest file sent.
    """

    _esm = Path(__file__).resolve().parent.parent / "static" / "download.js"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_class("wb-download")
        self.last: tuple[str, str, bytes] | None = None

    def send_file(self, filename: str, data: bytes, mime: str = "application/octet-stream") -> None:
        """Have the browser save ``data`` as ``filename``."""
        if not filename or "/" in filename or "\\" in filename:
            raise ValueError(f"a download needs a plain file name (no folders), got {filename!r}")
        self.last = (filename, mime, bytes(data))
        self.send({"type": "download", "filename": filename, "mime": mime}, buffers=[bytes(data)])
