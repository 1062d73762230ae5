"""Numbers in the words of user-visible text: ``count(1, "atom")`` is "1 atom", ``ordinal(2)`` "2nd"."""

from __future__ import annotations

__all__ = ["count", "ordinal"]


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and the noun, singular for exactly one: "1 atom", "0 atoms", "1234 atoms"."""
    word = noun if n == 1 else (plural or f"{noun}s")
    return f"{n} {word}"


def ordinal(n: int) -> str:
    """English ordinal of an integer: 1st, 2nd, 3rd, 4th, 11th, 12th, 13th, 21st, 22nd …"""
    if 10 <= abs(n) % 100 <= 20:
        suffix = "th"
    else:
        suffix = {1: "st", 2: "nd", 3: "rd"}.get(abs(n) % 10, "th")
    return f"{n}{suffix}"
