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
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in"):
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


def stamp(tree: Path, *steps: str, extras: str = "", torch_spec: str = "torch==2.13.0") -> list[str]:
    """Run ``steps`` (``check`` or ``record``) in bash; the answers of the checks, in order."""
    script = [f"source {SCRIPT}", 'h="$(source_hash)"']
    for step in steps:
        if step == "check":
            script.append('install_is_current stamp "$h" && echo current || echo stale')
        else:
            script.append('record_install stamp "$h"')
    env = dict(os.environ, PY=sys.executable, TORCH_SPEC=torch_spec, TRITON_SPEC="", EXTRAS=extras)
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
