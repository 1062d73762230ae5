"""A progress bar for long loops over frames (not public API; ``progress=`` is the public face).

:func:`progress_bar` gives one object with ``update(n)`` whatever the environment has:
``tqdm.auto`` when tqdm is importable (an ipywidgets bar in a notebook, a text bar in a
terminal), else a single stderr line with the rate and an ETA, rewritten at most
:data:`REFRESH_PER_S` times a second. A user's callable ``progress(done, total)`` is called
instead, after every update.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

REFRESH_PER_S = 5.0


def _duration(seconds: float) -> str:
    """``seconds`` as ``H:MM:SS`` or ``M:SS`` (what tqdm prints)."""
    if seconds != seconds or seconds == float("inf"):
        return "?"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class _NoBar:
    """Progress turned off: ``update`` only counts."""

    def __init__(self, total: int | None):
        self.total = total
        self.n = 0

    def update(self, n: int = 1) -> None:
        self.n += int(n)

    def close(self) -> None:
        pass


class _CallbackBar(_NoBar):
    """Calls ``callback(done, total)`` after every update (``total`` may be None: unknown)."""

    def __init__(self, total: int | None, callback: Callable[[int, int | None], object]):
        super().__init__(total)
        self._callback = callback

    def update(self, n: int = 1) -> None:
        super().update(n)
        self._callback(self.n, self.total)


class _TextBar(_NoBar):
    """One stderr line, ``desc: done/total unit (pct) rate unit/s ETA m:ss``, rewritten in place."""

    def __init__(self, total: int | None, desc: str, unit: str, stream=None):
        super().__init__(total)
        self.desc, self.unit = desc, unit
        self._stream = stream if stream is not None else sys.stderr
        self._t0 = time.perf_counter()
        self._last = -1.0
        self._width = 0
        self._write(force=True)

    def line(self) -> str:
        elapsed = time.perf_counter() - self._t0
        rate = self.n / elapsed if elapsed > 0 and self.n else float("nan")
        rate_text = f"{rate:,.1f} {self.unit}/s" if rate == rate else f"? {self.unit}/s"
        if self.total:
            eta = (self.total - self.n) / rate if rate == rate and rate > 0 else float("nan")
            return (
                f"{self.desc}: {self.n:,}/{self.total:,} {self.unit} "
                f"({100.0 * self.n / self.total:.0f}%) {rate_text} ETA {_duration(eta)}"
            )
        return f"{self.desc}: {self.n:,} {self.unit} {rate_text} elapsed {_duration(elapsed)}"

    def _write(self, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self._last < 1.0 / REFRESH_PER_S:
            return
        self._last = now
        text = self.line()
        # pad with spaces so a shorter line hides the end of the longer one it replaces
        self._stream.write("\r" + text.ljust(self._width))
        self._width = len(text)
        self._stream.flush()

    def update(self, n: int = 1) -> None:
        super().update(n)
        self._write(force=self.total is not None and self.n >= self.total)

    def close(self) -> None:
        self._write(force=True)
        self._stream.write("\n")
        self._stream.flush()


class _TqdmBar(_NoBar):
    def __init__(self, total: int | None, desc: str, unit: str):
        from tqdm.auto import tqdm

        super().__init__(total)
        self._bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=False, dynamic_ncols=True)

    def update(self, n: int = 1) -> None:
        super().update(n)
        self._bar.update(int(n))

    def close(self) -> None:
        self._bar.close()


class progress_bar:  # noqa: N801 - used like a function: ``with progress_bar(...) as bar``
    """A progress display for a loop over ``total`` items, as a context manager.

    Parameters
    ----------
    total : int or None
        How many items the loop will do (None: unknown; no percentage or ETA is shown).
    desc : str
        The label before the numbers (``"splat_ensemble"``).
    unit : str
        What an item is called (``"frames"``).
    enabled : bool or callable
        False: nothing is shown (``update`` still counts in :attr:`n`). True: a bar through
        ``tqdm.auto`` if tqdm is importable, else one stderr line with items/s and an ETA,
        rewritten at most ``REFRESH_PER_S`` times a second. A callable: called as
        ``enabled(done, total)`` after every :meth:`update` and nothing is shown.
    text : bool
        Force the plain stderr line even when tqdm is importable.

    Examples
    --------
    >>> with progress_bar(10, desc="demo", enabled=False) as bar:
    ...     for _ in range(10):
    ...         bar.update(1)
    >>> bar.n
    10
    """

    def __init__(self, total: int | None, *, desc: str, unit: str = "frames", enabled=True, text: bool = False):
        total = None if total is None else int(total)
        if callable(enabled):
            self._bar = _CallbackBar(total, enabled)
        elif not enabled:
            self._bar = _NoBar(total)
        elif text or not _tqdm_importable():
            self._bar = _TextBar(total, desc, unit)
        else:
            self._bar = _TqdmBar(total, desc, unit)
        self.total = total

    @property
    def n(self) -> int:
        """Items done so far (the sum of every :meth:`update`)."""
        return self._bar.n

    def update(self, n: int = 1) -> None:
        """Count ``n`` more items done and refresh the display."""
        self._bar.update(n)

    def close(self) -> None:
        """End the display (a newline after the text line; tqdm's own close)."""
        self._bar.close()

    def __enter__(self) -> progress_bar:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _tqdm_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("tqdm") is not None
