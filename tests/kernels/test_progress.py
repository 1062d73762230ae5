"""``kernels._progress.progress_bar``: the text line, the callback and the off switch."""

from __future__ import annotations

import io

from kernels import _progress


def test_text_line_shows_count_rate_and_eta():
    stream = io.StringIO()
    bar = _progress._TextBar(100, "splat", "frames", stream=stream)
    bar.update(40)
    bar.update(60)  # reaching the total always redraws
    bar.close()
    last = stream.getvalue().rstrip("\n").split("\r")[-1]
    assert last.startswith("splat: 100/100 frames (100%)")
    assert "frames/s" in last and "ETA 0:00" in last
    assert stream.getvalue().endswith("\n")


def test_text_line_with_unknown_total_shows_elapsed():
    stream = io.StringIO()
    bar = _progress._TextBar(None, "splat", "frames", stream=stream)
    bar.update(7)
    bar.close()
    assert stream.getvalue().rstrip("\n").split("\r")[-1].startswith("splat: 7 frames")


def test_callback_gets_done_and_total():
    seen = []
    with _progress.progress_bar(10, desc="x", enabled=lambda done, total: seen.append((done, total))) as bar:
        bar.update(3)
        bar.update(7)
    assert seen == [(3, 10), (10, 10)]
    assert bar.n == 10


def test_off_counts_and_prints_nothing(capsys):
    with _progress.progress_bar(5, desc="x", enabled=False) as bar:
        bar.update(5)
    assert bar.n == 5
    assert capsys.readouterr().err == ""


def test_text_fallback_writes_to_stderr(capsys):
    with _progress.progress_bar(4, desc="frames", enabled=True, text=True) as bar:
        bar.update(4)
    err = capsys.readouterr().err
    assert "frames: 4/4 frames (100%)" in err


def test_tqdm_bar_when_importable(capsys):
    with _progress.progress_bar(4, desc="tq", enabled=True) as bar:
        bar.update(4)
    assert isinstance(bar._bar, _progress._TqdmBar)  # tqdm comes with mdanalysis, a test extra
    assert "4/4" in capsys.readouterr().err
