"""The two exceptions of the compute stages, and the sentence rule for their messages."""

from __future__ import annotations

__all__ = ["Cancelled", "WorkbenchError", "sentence"]


class WorkbenchError(Exception):
    """A problem a person can fix: the message says what is wrong and what to do."""


class Cancelled(Exception):
    """The computation was cancelled, or superseded by newer settings."""


def sentence(exc: BaseException) -> str:
    """An error's text ending in exactly one full stop or question mark (messages are joined as sentences)."""
    text = " ".join(str(exc).split()).rstrip(" ;:,")
    return text if text.endswith((".", "?", "!")) else f"{text}."
