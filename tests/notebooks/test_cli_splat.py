"""``workbench splat`` on the cases a new user meets first, run as a subprocess as a person would.

A model without a cell (``--box-padding``: the map must lie over the input model), a file of many
models (``--model N``), a warning (once, one line), and the map's unit for every radiation.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import gemmi
import numpy as np
import pytest
import torch

import kernels

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"
# Two carbon atoms 30.516 Å apart along x: a 5 Å padding makes the box edge 2.3 + … = 40.516000000000005
# in floating point, which the command must print as 40.516.
NO_CELL = (
    "ATOM      1  CA  ALA A   1       2.300  -4.000   7.000  1.00 15.00           C\n"
    "ATOM      2  CB  ALA A   1      32.816  12.000  -3.000  1.00 15.00           C\n"
    "ATOM      3  SG  CYS A   2      12.000   3.000   1.000  1.00 15.00           S\n"
)


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "workbench", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def _read_block(path: Path):
    """The map as stored (no periodic extension, as ChimeraX draws it): data, origin voxel, spacing."""
    ccp4 = gemmi.read_ccp4_map(str(path))  # no setup(): the block in the file
    origin = np.array([ccp4.header_i32(w) for w in (5, 6, 7)])
    sampling = np.array([ccp4.header_i32(w) for w in (8, 9, 10)])
    assert [ccp4.header_i32(w) for w in (17, 18, 19)] == [1, 2, 3]  # x, y, z are the file's columns, rows, sections
    data = np.array(ccp4.grid, copy=True)
    spacing = np.array(ccp4.grid.unit_cell.parameters[:3]) / sampling
    return data, origin, spacing, ccp4


def test_box_padding_map_lies_over_the_input_model(tmp_path):
    (tmp_path / "nocell.pdb").write_text(NO_CELL)
    r = run("splat", "nocell.pdb", "--box-padding", "5", "--spacing", "0.5", "--out", "box.ccp4", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "cell 40.516 " in r.stdout and "0000000" not in r.stdout, r.stdout
    data, origin, spacing, _ = _read_block(tmp_path / "box.ccp4")
    xyz = np.array([[2.3, -4.0, 7.0], [32.816, 12.0, -3.0], [12.0, 3.0, 1.0]])
    # the stored block starts at the box's corner: 5 Å below the lowest atom, within a voxel
    corner = origin * spacing
    assert np.all(np.abs(corner - (xyz.min(axis=0) - 5.0)) <= spacing), (corner, xyz.min(axis=0))
    # each input atom's voxel, inside the stored block, holds density (a carbon at B 15 peaks near
    # 3 e/Å³; a voxel's centre is at most 0.43 Å off), and a voxel 4 Å away holds almost none
    for p in xyz:
        i, j, k = np.round(p / spacing).astype(int) - origin
        assert 0 <= i < data.shape[0] and 0 <= j < data.shape[1] and 0 <= k < data.shape[2]
        assert data[i, j, k] > 1.0, (p, data[i, j, k])
        far = np.round((p + [0, 0, 4.0]) / spacing).astype(int) - origin
        assert data[tuple(far % data.shape)] < 0.01
    # and gemmi, extending the map over its cell, reads the same density at the input atoms
    ccp4 = gemmi.read_ccp4_map(str(tmp_path / "box.ccp4"))
    ccp4.setup(float("nan"))
    at_atoms = [ccp4.grid.interpolate_value(gemmi.Position(*p)) for p in xyz]
    assert min(at_atoms) > 1.0, at_atoms


def test_box_padding_on_a_model_with_a_cell_is_refused_with_the_reason(tmp_path):
    r = run("splat", "--box-padding", "5", cwd=tmp_path)
    assert r.returncode == 2 and r.stdout == "" and not (tmp_path / "map.ccp4").exists()
    assert "has a unit cell (34.77 39.17 48.31 Å, 90 90 90°, P 21 21 21)" in r.stderr
    assert "leave it out" in r.stderr and r.stderr.count("\n") == 1


@pytest.fixture(scope="module")
def twenty_models(tmp_path_factory) -> Path:
    """A 20-model PDB made from the bundled 1ORC: model k is model 1 moved by k·0.7 Å along x."""
    st = gemmi.read_structure(str(kernels.example_structure("1orc")))
    st.setup_entities()
    first = st[0].clone()  # a copy: add_model may move the models, and st[0] with them
    for k in range(1, 20):
        model = first.clone()
        model.num = k + 1
        for chain in model:
            for res in chain:
                for atom in res:
                    atom.pos = gemmi.Position(atom.pos.x + 0.7 * k, atom.pos.y, atom.pos.z)
        st.add_model(model)
    path = tmp_path_factory.mktemp("models") / "twenty.pdb"
    st.write_pdb(str(path))
    return path


def test_a_multi_model_file_says_which_model_and_how_to_choose(twenty_models, tmp_path):
    r = run("splat", str(twenty_models), "--spacing", "1.5", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "model 1 of 20" in r.stdout and "--model N" in r.stdout and "workbench ensemble" in r.stdout, r.stdout
    r = run("splat", str(twenty_models), "--model", "7", "--spacing", "1.5", "--backend", "reference", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "model 7 of 20" in r.stdout and "--model N" not in r.stdout  # chosen: no advice needed
    rho, _ = kernels.read_map(tmp_path / "map.ccp4")
    seventh = kernels.read_model(twenty_models, model_index=6)
    grid = kernels.GridSpec.for_spacing(seventh.cell, 1.5, seventh.spacegroup)
    expected = kernels.splat_density(seventh.atoms, grid, backend="reference")
    torch.testing.assert_close(rho.double(), expected, rtol=1e-6, atol=1e-6)
    first = kernels.splat_density(kernels.read_model(twenty_models, model_index=0).atoms, grid, backend="reference")
    assert (first - expected).abs().max() > 0.5  # model 7 is not model 1


@pytest.mark.parametrize("number, message", [("21", "holds 20 models; choose --model 1 to 20"), ("0", "from 1")])
def test_a_model_number_out_of_range_is_a_usage_error(twenty_models, tmp_path, number, message):
    r = run("splat", str(twenty_models), "--model", number, cwd=tmp_path)
    assert r.returncode == 2 and message in r.stderr and r.stdout == "", (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and not (tmp_path / "map.ccp4").exists()


def test_the_workbench_says_which_model_it_shows(twenty_models):
    import workbench

    wb = workbench.Workbench(str(twenty_models), spacing=1.5, debounce=0)
    try:
        assert (wb.result.model.model_index, wb.result.model.n_models) == (0, 20)
        message = wb.status.message  # the status line under the controls
        assert "holds 20 models; model 1 (MODEL 1) was read" in message and "model_index=" in message, message
        assert "kernels.splat_ensemble" in message, message
    finally:
        wb.close()


@pytest.mark.parametrize(
    "args, text",
    [
        ([str(DATA / "3o5r.cif.gz"), "--on-bad-adp", "iso"], "not positive definite"),
        (["--cutoff", "3.5"], "is below the grid spacing"),
    ],
    ids=["on-bad-adp-iso", "cutoff-above-peaks"],
)
def test_a_warning_is_said_once_in_one_line_without_a_source_path(tmp_path, args, text):
    r = run("splat", *args, "--spacing", "2", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    said = [line for line in (r.stdout + r.stderr).splitlines() if text in line]
    assert len(said) == 1 and said[0].startswith("warning: "), r.stdout + r.stderr
    assert not re.search(r"\.py:\d+", r.stderr) and "Warning:" not in r.stderr, r.stderr


@pytest.mark.parametrize(
    "radiation, unit, total",
    [("xray", "e/Å³", "electrons"), ("electron", "Å⁻²", "Å of Σ f_e(0)"), ("neutron", "fm/Å³", "fm of scattering")],
)
def test_the_map_is_reported_and_labelled_in_its_unit(tmp_path, radiation, unit, total):
    r = run("splat", "--radiation", radiation, "--spacing", "1.5", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("map "))
    assert f" {unit}" in line and total in line, line
    assert "model's own 559 atoms only (--symmetrize adds the symmetry mates)" in line, line
    if radiation == "electron":  # 1 Å⁻² is 47.878 V of potential
        peak, volts = re.search(r"max ([\d.]+) Å⁻² \(([\d.]+) V\)", line).groups()
        assert float(volts) == pytest.approx(47.878 * float(peak), abs=0.1)
    else:
        assert "e/Å³" not in line or radiation == "xray"
    ccp4 = gemmi.read_ccp4_map(str(tmp_path / "map.ccp4"))
    label = f"density-workbench {radiation} map, unit {kernels.density_unit(radiation, ascii=True)}"
    assert ccp4.header_str(57, 80).strip() == label
    r = run("splat", "--radiation", radiation, "--spacing", "1.5", "--symmetrize", cwd=tmp_path)
    assert "from the model and its symmetry mates (P 21 21 21)" in r.stdout, r.stdout


def test_one_function_names_the_units():
    assert [kernels.density_unit(r) for r in ("xray", "electron", "neutron")] == ["e/Å³", "Å⁻²", "fm/Å³"]
    assert [kernels.density_unit(r, ascii=True) for r in ("xray", "electron", "neutron")] == [
        "e/A^3",
        "A^-2",
        "fm/A^3",
    ]
    with pytest.raises(ValueError, match="radiation must be one of"):
        kernels.density_unit("proton")
