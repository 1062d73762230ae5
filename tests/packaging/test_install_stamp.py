"""``scripts/_install_stamp.sh``: a second ``start.sh`` skips pip only while nothing it builds from changed.

The stamp's functions run in bash on a copy of the repository's build files and C++ sources (the
pip install itself is what they decide to skip; it is not run here). The compiled modules are
stood for by files of their names: the stamp checks only that each is there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "_install_stamp.sh"


@pytest.fixture
def tree(tmp_path) -> Path:
    for name in ("pyproject.toml", "CMakeLists.txt"):
        shutil.copy(ROOT / name, tmp_path / name)
    sources = [p for ext in ("*.cpp", "*.hpp", "*.h") for p in (ROOT / "kernels").rglob(ext)]
    assert any(p.name.startswith("_") for p in sources), "no binding kernels/**/_*.cpp found"
    for src in sources:
        dest = tmp_path / src.relative_to(ROOT)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, dest)
        if src.name.startswith("_") and src.suffix == ".cpp":
            (dest.parent / f"{src.stem}.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    return tmp_path


def stamp(
    tree: Path, *steps: str, extras: str = "", torch_spec: str = "torch==2.13.0", triton_spec: str = ""
) -> list[str]:
    """Run ``steps`` (``check``, ``record`` or ``hash``) in bash; the answers of the checks and hashes, in order."""
    script = [f"source {SCRIPT}", 'h="$(source_hash)"']
    for step in steps:
        if step == "check":
            script.append('install_is_current stamp "$h" && echo current || echo stale')
        elif step == "hash":
            script.append('echo "$h"')
        else:
            script.append('record_install stamp "$h"')
    env = dict(os.environ, PY=sys.executable, TORCH_SPEC=torch_spec, TRITON_SPEC=triton_spec, EXTRAS=extras)
    r = subprocess.run(
        ["bash", "-c", "set -euo pipefail\n" + "\n".join(script)], cwd=tree, env=env, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def test_nothing_changed_skips_and_a_change_installs_again(tree):
    assert stamp(tree, "check", "record", "check") == ["stale", "current"]
    assert stamp(tree, "check") == ["current"]  # a second start: skip
    header = next(tree.glob("kernels/*/*.hpp"))
    text = header.read_text()
    header.write_text(text + "// one more line\n")
    assert stamp(tree, "check") == ["stale"]  # a C++ header changed: build again
    header.write_text(text)
    assert stamp(tree, "check") == ["current"]
    (tree / "pyproject.toml").write_text((tree / "pyproject.toml").read_text() + "\n# edited\n")
    assert stamp(tree, "check") == ["stale"]  # the build's own description changed
    (tree / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    assert stamp(tree, "check") == ["current"]
    (tree / "CMakeLists.txt").write_text((tree / "CMakeLists.txt").read_text() + "\n# edited\n")
    assert stamp(tree, "check") == ["stale"]  # so did the CMake build's


def test_an_edit_that_was_built_and_then_reverted_installs_again(tree):
    # The modules hold the last build's code: after an edit was built, the reverted sources are not
    # what is installed, so the stamp must not call them current (the build then recompiles that edit's
    # objects only; benchmarks/bench_build.py measures it).
    source = next(tree.glob("kernels/*/[!_]*.cpp"))
    text = source.read_text()
    assert stamp(tree, "record", "check") == ["current"]
    source.write_text(text + "// an edit\n")
    assert stamp(tree, "check", "record", "check") == ["stale", "current"]
    source.write_text(text)
    assert stamp(tree, "check") == ["stale"]
    assert len((tree / "stamp").read_text().splitlines()) == 1  # one build's hash, however many edits


def test_another_torch_or_a_missing_module_installs_again(tree):
    assert stamp(tree, "record", "check") == ["current"]
    assert stamp(tree, "check", torch_spec="torch==2.11.0") == ["stale"]
    next(tree.glob("kernels/*/_*.so")).unlink()
    assert stamp(tree, "check") == ["stale"]


def test_extras_are_installed_once_and_cover_a_plain_start(tree):
    assert stamp(tree, "record", "check") == ["current"]
    assert stamp(tree, "check", extras="[test]") == ["stale"]  # test.sh after start.sh: the test tools are missing
    assert stamp(tree, "record", "check", extras="[test]") == ["current"]
    assert stamp(tree, "check") == ["current"]  # start.sh after test.sh: nothing to do
    assert len((tree / "stamp").read_text().splitlines()) == 2


def test_test_extras_and_the_tests_triton_do_not_change_what_is_built(tree):
    # start.sh (no extras, no Triton asked for) and test.sh ([test], triton==3.7.1) hash the same
    # sources alike: the install of one is the other's build, and switching compiles nothing.
    start = stamp(tree, "hash")
    assert stamp(tree, "hash", extras="[test]", triton_spec="triton==3.7.1") == start
    assert stamp(tree, "hash", torch_spec="torch==2.11.0") != start  # the hash does see what it covers
    assert stamp(tree, "record", extras="[test]", triton_spec="triton==3.7.1") == []
    assert stamp(tree, "check") == ["current"]  # start.sh after test.sh
    assert stamp(tree, "check", extras="[test]", triton_spec="triton==3.7.1") == ["current"]  # test.sh again
