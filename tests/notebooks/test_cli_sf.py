"""``workbench sf``: structure factors written to MTZ and checked with gemmi; R against data; one-line errors.

Run as a subprocess, as a person would.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gemmi
import numpy as np
import pytest

import kernels
import kernels.testing

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "workbench", "sf", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_writes_the_unique_factors_gemmi_computes_exactly(tmp_path):
    r = run("--d-min", "2.5", "--out", "f.mtz", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    assert "unique reflections of P 21 21 21 to 2.5 Å" in r.stdout and "wrote" in r.stdout
    mtz = gemmi.read_mtz_file(str(tmp_path / "f.mtz"))
    assert mtz.spacegroup.hm == "P 21 21 21" and mtz.column_labels() == ["H", "K", "L", "FC", "PHIC"]
    data = np.asarray(mtz.array)
    hkl = data[:, :3].astype(int)
    want = gemmi.make_miller_array(mtz.cell, mtz.spacegroup, 2.5, 0.0, True)
    assert np.array_equal(hkl, want[np.any(want != 0, axis=1)])
    f = data[:, 3] * np.exp(1j * np.deg2rad(data[:, 4]))
    m = kernels.read_model(kernels.example_structure("1orc"))
    exact = kernels.testing.gemmi_structure_factors(m, hkl, symmetry=True)
    # the sampling blur and cutoff 1e-5: 1e-4 by shell in docs/kernels.md; the file keeps float32
    assert np.linalg.norm(f - exact) / np.linalg.norm(exact) < 1e-3


def test_r_factor_against_an_mtz_of_scaled_amplitudes(tmp_path):
    m = kernels.read_model(kernels.example_structure("1orc"))
    hkl = gemmi.make_miller_array(m.cell.to_gemmi(), gemmi.SpaceGroup(m.spacegroup), 2.2, 0.0, True)
    exact = np.abs(kernels.testing.gemmi_structure_factors(m, hkl, symmetry=True))
    s2 = np.array([m.cell.to_gemmi().calculate_1_d2(h) for h in hkl.tolist()])
    obs = 0.7 * exact * np.exp(-9.0 * s2 / 4)
    mtz = gemmi.Mtz(with_base=True)
    mtz.spacegroup = gemmi.SpaceGroup(m.spacegroup)
    mtz.set_cell_for_all(m.cell.to_gemmi())
    mtz.add_dataset("obs")
    mtz.add_column("FOBS", "F")
    mtz.set_data(np.hstack([hkl.astype(np.float32), obs.astype(np.float32)[:, None]]))
    mtz.write_to_file(str(tmp_path / "obs.mtz"))
    r = run("--d-min", "2.2", "--data", "obs.mtz", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("R "))
    assert "no bulk-solvent model" in line and f"over {len(hkl)} of {len(hkl)}" in line
    assert "scale 0.7" in line and "B +9.0" in line
    assert float(line.split("R = ")[1].split()[0]) < 1e-3


@pytest.mark.parametrize(
    "args,status,message",
    [
        (["missing.pdb"], 2, "model missing.pdb: no such file"),
        (["--data", "nothing.mtz"], 2, "--data nothing.mtz: no such file"),
        (["--data", "garbage.mtz"], 1, "neither an MTZ file"),
        (["--d-min", "0.5", "--spacing", "1"], 2, "--d-min 0.5 Å is finer than a 1 Å grid holds"),
        (["--out", "nofolder/f.mtz"], 2, "the folder nofolder does not exist"),
        (["--d-min", "-1"], 2, "--d-min"),
    ],
)
def test_errors_are_one_line_without_a_traceback(tmp_path, args, status, message):
    (tmp_path / "garbage.mtz").write_text("not an MTZ\n")
    r = run(*args, cwd=tmp_path)
    assert r.returncode == status, (r.stdout, r.stderr)
    assert message in r.stderr and "Traceback" not in r.stderr
    if status == 1:
        assert len(r.stderr.strip().splitlines()) == 1
