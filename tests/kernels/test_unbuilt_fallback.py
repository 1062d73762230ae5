"""A checkout whose C++ modules are not built: ``backend="auto"`` says so, once, and still computes.

The package's Python files are copied without their compiled modules into a temporary folder and run
in a fresh interpreter, as a user whose build failed would run them. ``auto`` then falls back to the
float64 reference; a log line alone would hide a 10–40× slower call, so a RuntimeWarning names the
backend that could not be imported and how to build it. The Triton modules must import without the
C++ ones (the GPU paths do not need them).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import warnings, torch
warnings.simplefilter("always")
import kernels
from kernels.crystal import GridSpec
from kernels.atoms import AtomSet
from kernels.planarity.planes import PlaneSet
from kernels import planarity
import kernels.planarity.triton, kernels.density.triton, kernels.tricubic.triton  # no C++ module needed
atoms = AtomSet.from_elements(["C", "N", "O"], torch.tensor([[1.0, 1, 1], [2, 1, 1], [1, 2, 1]]),
                              torch.tensor([10.0, 12, 14]), dtype=torch.float32)
cell = kernels.Cell.from_parameters(10.0, 10.0, 10.0)
grid = GridSpec.for_spacing(cell, 1.0)
with warnings.catch_warnings(record=True) as caught:
    maps = [kernels.splat_density(atoms, grid) for _ in range(2)]
fallback = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning) and "backend='auto'" in str(w.message)]
print("WARNINGS", len(fallback))
print("MESSAGE", fallback[0] if fallback else "")
print("FILE", [w.filename for w in caught if "backend='auto'" in str(w.message)][:1])
print("SUM", float(maps[0].sum()), maps[0].dtype)
rho = maps[0].float()
with warnings.catch_warnings(record=True) as caught:
    tables = [kernels.fsc(rho, rho * 1.1, grid, n_shells=3) for _ in range(2)]
built = [str(w.message) for w in caught if "_shells is not built" in str(w.message)]
print("SHELL_WARNINGS", len(built), "|", built[0] if built else "")
print("FSC", " ".join(f"{float(v):.12f}" for v in tables[1].fsc))
"""


def test_auto_warns_once_when_the_cpu_build_is_missing(tmp_path):
    shutil.copytree(
        ROOT / "kernels",
        tmp_path / "kernels",
        ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__", "build"),
    )
    assert not list((tmp_path / "kernels").rglob("*.so"))
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(tmp_path)
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    assert lines["WARNINGS"] == "1"  # once per op and device, not on every call
    message = lines["MESSAGE"]
    assert "density on cpu" in message and "'reference'" in message
    assert "the cpu backend for density cannot be imported" in message
    assert "scripts/build.sh" in message and "pip install" in message
    assert "user_script.py" in lines["FILE"]  # points at the caller's line, not into the package
    total, dtype = lines["SUM"].split()
    assert float(total) > 0 and dtype == "torch.float64"  # the reference's map: it still computes
    # shells and fsc: numpy's sums instead of the C++ ones, said once
    count, message = lines["SHELL_WARNINGS"].split(" | ")
    assert count == "1" and "scripts/build.sh" in message
    assert [float(v) for v in lines["FSC"].split()] == pytest.approx([1.0, 1.0, 1.0], abs=1e-12)
