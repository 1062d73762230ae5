"""The docs' GPU fitting recipes, as written, in a fresh process on two structures.

``docs/kernels.md``, "In a loop", holds three blocks: the eager loop (1AKI, 50 Adam steps), the replayed
step (``kernels.fitting.Step``) and the compiled step (``mode="reduce-overhead"``). Run in the test process
they would share its compile caches and CUDA state; a user copies them into a new one. So this test cuts
the three blocks out of the Markdown, runs them in one new Python process — the structure's name the only
change, for the second structure — and checks that each way brings the RMSD down as the eager loop does.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.docs.markdown_examples import DOCS, ROOT
from tests.helpers import requires_cuda

KERNELS_MD = ROOT / "docs" / "kernels.md"


def loop_blocks() -> list[str]:
    """The Python blocks of the "In a loop" section, in order, as Sybil parses them (list indent removed)."""
    text = KERNELS_MD.read_text()
    start = text.index("\n## In a loop")
    end = text.index("\n## ", start + 5)
    examples = DOCS.parse(KERNELS_MD).examples()
    return [str(e.parsed) for e in examples if start < e.start < end and isinstance(e.parsed, str)]


def test_the_loop_section_has_the_eager_the_replayed_and_the_compiled_recipe():
    blocks = loop_blocks()
    assert len(blocks) == 3
    assert 'example_structure("1aki")' in blocks[0] and "loss_fn(x).backward()" in blocks[0]
    assert "kernels.fitting.Step" in blocks[1]
    assert 'mode="reduce-overhead"' in blocks[2] and "mark_static_address" in blocks[2]
    assert all(not re.match(r"\s", block) for block in blocks)  # the list item's indent is not part of the code


@requires_cuda
@pytest.mark.parametrize("structure", ["1aki", "1orc"])
def test_the_docs_gpu_recipes_bring_the_rmsd_down_in_a_fresh_process(structure, tmp_path):
    eager, replayed, compiled = loop_blocks()
    eager = eager.replace('example_structure("1aki")', f'example_structure("{structure}")')
    program = "\n".join(
        [
            eager,
            "eager_rmsd = rmsd(x)",
            replayed,
            "replayed_rmsd, replayed_mode = rmsd(x), step.mode",
            compiled,
            "compiled_rmsd = rmsd(x)",
            "import json",
            "print('RESULT', json.dumps(dict(start=rmsd(start), eager=eager_rmsd, replayed=replayed_rmsd,"
            " compiled=compiled_rmsd, mode=replayed_mode)))",
        ]
    )
    script = tmp_path / "recipe.py"
    script.write_text(program)
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=900,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))},
    )  # fmt: skip
    assert done.returncode == 0, f"the recipe failed:\n{done.stderr[-6000:]}"
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    r = json.loads(line[len("RESULT ") :])
    assert r["mode"] == "graph"
    assert r["eager"] < 0.8 * r["start"], r
    for way in ("replayed", "compiled"):  # as far as eager's, within what float32 atomics let 50 steps differ
        assert r[way] < 0.8 * r["start"] and abs(r[way] - r["eager"]) < 0.05, (way, r)
