"""Captions that are short by default, with the details one click away (an HTML ``<details>``)."""

from __future__ import annotations

__all__ = ["caption_html"]


def caption_html(short: str, details: str) -> str:
    """A caption: ``short`` (HTML) always shown, ``details`` (HTML) under it on a click.

    Both are inside the value, so what a caption states can be read from it whole.
    """
    return f"<details class='wb-details wb-caption-text'><summary>{short}</summary><div>{details}</div></details>"
