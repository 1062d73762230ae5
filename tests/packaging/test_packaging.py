"""What an installation receives: a built wheel's contents, and environment.yml in step with pyproject.toml."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

import kernels

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# conda-forge's names where they differ from PyPI's.
CONDA_NAMES = {"torch": "pytorch", "py3dmol": "py3dmol", "matplotlib": "matplotlib-base"}


# What a checkout holds that is not source: build outputs would leak stale modules into the wheel.
_NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "*.so", "*.pyd", "artifacts", ".whl", ".gl"
)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """A wheel built from a copy of this source tree, as pip builds one (no build isolation)."""
    src = tmp_path_factory.mktemp("src") / "density-workbench"
    shutil.copytree(ROOT, src, ignore=_NOT_SOURCE)
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    (path,) = out.glob("density_workbench-*.whl")
    with zipfile.ZipFile(path) as zf:
        yield zf


def test_wheel_ships_every_notebook(wheel):
    names = set(wheel.namelist())
    notebooks = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert notebooks, "no notebooks in notebooks/"
    missing = [n for n in notebooks if f"workbench/notebooks/{n}" not in names]
    assert not missing, f"notebooks missing from the wheel: {missing}"
    for n in notebooks:
        assert wheel.read(f"workbench/notebooks/{n}") == (ROOT / "notebooks" / n).read_bytes()


def test_wheel_ships_every_cpp_source_and_its_compiled_module(wheel):
    names = set(wheel.namelist())
    sources = sorted(
        p.relative_to(ROOT).as_posix() for ext in ("*.cpp", "*.hpp", "*.h") for p in (ROOT / "kernels").rglob(ext)
    )
    assert sources, "no C++ sources found under kernels/"
    missing = [s for s in sources if s not in names]
    assert not missing, f"C++ sources missing from the wheel: {missing}"
    # setup.py compiles every kernels/**/_*.cpp into the extension module of the same name.
    modules = [s[: -len(".cpp")] for s in sources if Path(s).name.startswith("_") and s.endswith(".cpp")]
    assert modules
    for module in modules:
        assert any(n.startswith(module + ".") and n.endswith((".so", ".pyd")) for n in names), (
            f"no compiled module for {module}.cpp in the wheel"
        )


def test_wheel_metadata_version_and_licence(wheel):
    names = wheel.namelist()
    (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    text = wheel.read(metadata).decode()
    assert re.search(rf"^Version: {re.escape(kernels.__version__)}$", text, re.M), (
        "wheel version != kernels.__version__"
    )
    assert re.search(r"^License-Expression: BSD-3-Clause$", text, re.M)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), "LICENSE not in the wheel"
    # Triton is torch's to choose (its Linux GPU builds pin the one they were built with).
    requires = [line for line in text.splitlines() if line.startswith("Requires-Dist:")]
    assert requires and not [r for r in requires if re.match(r"Requires-Dist: triton\b", r)]


def _requirement_names(reqs: list[str]) -> dict[str, str]:
    """``name -> version specifier`` of PEP 508 requirement strings (markers dropped)."""
    out = {}
    for req in reqs:
        m = re.match(r"\s*([A-Za-z0-9_.\-]+)\s*([^;]*)", req)
        out[m.group(1).lower()] = m.group(2).replace(" ", "")
    return out


def test_environment_yml_lists_what_pyproject_requires():
    text = (ROOT / "environment.yml").read_text()
    conda = {}
    for line in text.splitlines():
        m = re.match(r"\s*-\s+([A-Za-z0-9_.\-]+)\s*([^#]*)", line)
        if m:
            conda[m.group(1).lower()] = m.group(2).strip().replace(" ", "")
    wanted = {
        **_requirement_names(PYPROJECT["project"]["dependencies"]),
        **_requirement_names(PYPROJECT["build-system"]["requires"]),
        **_requirement_names(PYPROJECT["project"]["optional-dependencies"]["test"]),
    }
    for name, spec in wanted.items():
        conda_name = CONDA_NAMES.get(name, name)
        assert conda_name in conda, f"environment.yml lacks {conda_name} (pyproject.toml: {name}{spec})"
        # conda writes ==X.* as "X.*"
        expected = spec[2:] if spec.startswith("==") else spec
        assert conda[conda_name] == expected, (
            f"environment.yml has {conda_name} {conda[conda_name]!r}, pyproject.toml {name}{spec}"
        )
