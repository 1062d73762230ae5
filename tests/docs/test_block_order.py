"""A docs block picked alone, or handed to a worker without the blocks above it, still runs.

``pytest -n N`` (pytest-xdist's default ``--dist load``) spreads one file's blocks over its workers, and a
node id or ``-k`` picks a single block; either way a block's process may not have run the blocks it
builds on. ``tests/docs/markdown_examples.py`` then runs those first. This test picks the README's last
block that runs on the CPU, alone, in a new pytest process.
"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.docs.markdown_examples import DOCS, ROOT


def test_a_late_readme_block_picked_alone_runs_after_the_blocks_above_it():
    readme = ROOT / "README.md"
    text = readme.read_text()
    blocks = [e for e in DOCS.parse(readme).examples() if isinstance(e.parsed, str)]
    runnable = [e for e in blocks if "skip:" not in text[max(0, e.start - 300) : e.start]]
    last = runnable[-1]
    earlier_names = [e for e in runnable if e.start < last.start]
    assert earlier_names, "the README's last CPU block should build on blocks above it"
    node = f"README.md::line:{last.line},column:{last.column}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-q", node],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "1 passed" in done.stdout, done.stdout[-2000:]
