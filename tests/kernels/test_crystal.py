"""Reading models (gemmi) and the errors bad input gets; cells; map files; the CLI."""

from __future__ import annotations

import gzip
import math
import shutil
import warnings

import numpy as np
import pytest
import torch

import kernels
from kernels.crystal import AtomLabel
from tests.helpers import STRUCTURES, model

PDB_ATOM = (
    "ATOM  {serial:5d} {name:<4s} {res:3s} A{seq:4d}    {x:8.3f}{y:8.3f}{z:8.3f}{occ:6.2f}{b:6.2f}          {el:>2s}\n"
)
CRYST1 = "CRYST1   30.000   40.000   50.000  90.00  90.00  90.00 P 1           1\n"


def write_pdb(path, atoms, cryst1=CRYST1):
    lines = [cryst1] if cryst1 else []
    for i, (name, el, xyz, occ, b) in enumerate(atoms, start=1):
        lines.append(
            PDB_ATOM.format(serial=i, name=name, res="ALA", seq=1, x=xyz[0], y=xyz[1], z=xyz[2], occ=occ, b=b, el=el)
        )
    lines.append("END\n")
    path.write_text("".join(lines))
    return path


GOOD = [("N", "N", (1.0, 2.0, 3.0), 1.0, 10.0), ("CA", "C", (2.4, 2.1, 3.2), 1.0, 12.0)]


def test_read_real_structures():
    m = model("1orc")
    assert len(m) == 559 and m.spacegroup == "P 21 21 21"
    assert m.atoms.xyz.dtype == torch.float64 and m.atoms.a.shape == (559, 5) and m.atoms.b.shape == (559, 5)
    assert m.cell.parameters[:3] == pytest.approx((34.77, 39.17, 48.31))
    assert len(model("3wip")) == 17146 and len(model("5h73")) == 3006 and len(model("1pfe")) == 342
    assert model("5h73").cell.kind == "hexagonal" and model("3wip").cell.kind == "monoclinic"
    assert model("1aki").cell.kind == "orthogonal"


def test_it92_coefficients_come_from_gemmi():
    import gemmi

    m = model("1pfe")
    i = m.atoms.elements.index("Cl")
    coef = gemmi.Element("Cl").it92
    assert m.atoms.a[i].tolist() == pytest.approx(list(coef.a) + [coef.c])
    assert m.atoms.b[i].tolist() == pytest.approx(list(coef.b) + [0.0])


def test_anisou_atoms_use_the_file_isotropic_b():
    import gemmi

    st = gemmi.read_structure(str(STRUCTURES["1pfe"]))
    atom = st[0][0][0][0]
    assert atom.aniso.nonzero()
    assert model("1pfe").atoms.b_iso[0].item() == pytest.approx(atom.b_iso)


def test_b_derived_from_anisou_when_the_file_has_none(tmp_path):
    path = write_pdb(tmp_path / "x.pdb", [("N", "N", (1.0, 2.0, 3.0), 1.0, 0.0), GOOD[1]])
    text = path.read_text().splitlines(keepends=True)
    anisou = "ANISOU    1  N   ALA A   1     1000   2000   3000      0      0      0       N\n"
    text.insert(2, anisou)
    path.write_text("".join(text))
    with pytest.warns(UserWarning, match="trace"):
        m = kernels.read_model(path)
    assert m.atoms.b_iso[0].item() == pytest.approx(8 * math.pi**2 * 0.6 / 3, rel=1e-6)
    assert any("ANISOU" in note for note in m.notes)


def test_filters_altlocs_water_hydrogens():
    full = model("3o5r")
    first = kernels.read_model(STRUCTURES["3o5r"], altlocs="first", adp="iso")
    only_a = kernels.read_model(STRUCTURES["3o5r"], altlocs="A", adp="iso")
    dry = kernels.read_model(STRUCTURES["3o5r"], water=False, adp="iso")
    assert len(first) < len(full) and len(only_a) < len(full)
    assert all(label.altloc in ("", "A") for label in only_a.atoms.labels)
    assert not any(label.res_name == "HOH" for label in dry.atoms.labels) and len(dry) < len(full)
    with pytest.raises(kernels.ModelError, match="altlocs"):
        kernels.read_model(STRUCTURES["3o5r"], altlocs="AB", adp="iso")


def test_missing_and_unknown_format(tmp_path):
    with pytest.raises(kernels.ModelError, match="no such file"):
        kernels.read_model(tmp_path / "absent.pdb")
    (tmp_path / "x.txt").write_text("hello")
    with pytest.raises(kernels.ModelError, match="unknown model format"):
        kernels.read_model(tmp_path / "x.txt")


def test_truncated_gzip_is_an_error_naming_the_file(tmp_path):
    data = STRUCTURES["1aki"].read_bytes()
    bad = tmp_path / "cut.cif.gz"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(kernels.ModelError, match="cut.cif.gz"):
        kernels.read_model(bad)


def test_truncated_mmcif_is_an_error(tmp_path):
    text = gzip.decompress(STRUCTURES["1aki"].read_bytes()).decode()
    bad = tmp_path / "cut.cif"
    bad.write_text(text[: int(len(text) * 0.6)])  # stops in the middle of the atom_site loop
    with pytest.raises(kernels.ModelError, match="cut.cif"):
        kernels.read_model(bad)


def test_garbage_is_an_error(tmp_path):
    bad = tmp_path / "junk.cif"
    bad.write_bytes(b"\x00\x01 not a cif at all \xff" * 10)
    with pytest.raises(kernels.ModelError, match="junk.cif"):
        kernels.read_model(bad)


def test_no_atoms(tmp_path):
    path = write_pdb(tmp_path / "empty.pdb", [])
    with pytest.raises(kernels.ModelError, match="no (atoms|models)"):
        kernels.read_model(path)


def test_no_cell_needs_box_padding(tmp_path):
    path = write_pdb(tmp_path / "nocell.pdb", GOOD, cryst1=None)
    with pytest.raises(kernels.ModelError, match="box_padding"):
        kernels.read_model(path)
    placeholder = write_pdb(
        tmp_path / "one.pdb", GOOD, cryst1="CRYST1    1.000    1.000    1.000  90.00  90.00  90.00 P 1           1\n"
    )
    with pytest.raises(kernels.ModelError, match="no unit cell"):
        kernels.read_model(placeholder)
    m = kernels.read_model(path, box_padding=5.0)
    assert m.spacegroup == "P 1"
    assert m.cell.parameters[0] == pytest.approx(1.4 + 10.0)
    assert float(m.atoms.xyz.min()) == pytest.approx(5.0) and any("box" in n for n in m.notes)


def test_unknown_element_names_the_atom(tmp_path):
    path = write_pdb(tmp_path / "x.pdb", [GOOD[0], ("QQ1", "Xx", (3.0, 3.0, 3.0), 1.0, 10.0)])
    with pytest.raises(kernels.ModelError, match=r"A/ALA 1/QQ1"):
        kernels.read_model(path)


def test_non_finite_coordinates_name_the_atom(tmp_path):
    path = write_pdb(tmp_path / "x.pdb", GOOD)
    text = path.read_text().replace("   2.400   2.100", "     nan   2.100")
    path.write_text(text)
    with pytest.raises(kernels.ModelError, match=r"ALA 1/CA.*non-finite"):
        kernels.read_model(path)


@pytest.mark.parametrize("b, occ, message", [(0.0, 1.0, "B ≤ 0"), (-5.0, 1.0, "B ≤ 0"), (10.0, 1.5, "occupancy")])
def test_bad_b_and_occupancy_name_the_atom(tmp_path, b, occ, message):
    path = write_pdb(tmp_path / "x.pdb", [GOOD[0], ("CA", "C", (2.4, 2.1, 3.2), occ, b)])
    with pytest.raises(kernels.ModelError, match=rf"ALA 1/CA.*{message}"):
        kernels.read_model(path)


def test_atomset_validation_and_conversion():
    atoms = kernels.AtomSet.from_elements(["C", "O"], [[0, 0, 0], [1, 1, 1]], [10.0, 20.0])
    assert atoms.to(dtype=torch.float32).xyz.dtype == torch.float32
    # Building reads no value (a loop builds atoms every step); check() and the CPU kernels refuse them.
    grid = kernels.GridSpec.for_spacing(kernels.Cell.from_parameters(10, 10, 10), 1.0)
    bad_values = [
        ("b_iso", [10.0, 0.0], r"atom .*2 \(index 1\) has B ≤ 0"),
        ("b_iso", [float("nan"), 10.0], "non-finite B"),
        ("occ", [1.0, float("nan")], r"index 1\) has (an occupancy outside \[0, 1\]|a non-finite occupancy): nan"),
        ("xyz", [[0, 0, 0], [1, float("inf"), 1]], r"index 1\) has a non-finite position"),
    ]
    for field, value, message in bad_values:
        bad = atoms.replace(**{field: torch.tensor(value, dtype=torch.float64)})
        with pytest.raises(ValueError, match=message):
            bad.check()
        with pytest.raises(ValueError, match=message):
            kernels.AtomSet(bad.xyz, bad.b_iso, bad.occ, bad.a, bad.b, _validate=True)
        for backend in ("cpu", "reference"):
            with pytest.raises(ValueError, match=message):
                kernels.splat_density(bad, grid, backend=backend)
    # an occupancy above 1 is a model error check() names, but a density the kernels splat (an optimiser may pass 1)
    over = atoms.replace(occ=torch.tensor([1.0, 1.5], dtype=torch.float64))
    with pytest.raises(ValueError, match=r"index 1\) has an occupancy outside \[0, 1\]: 1.5"):
        over.check()
    assert float(kernels.splat_density(over, grid).sum()) > float(kernels.splat_density(atoms, grid).sum())
    assert atoms.check() is atoms
    with pytest.raises(ValueError, match="shape"):
        atoms.replace(occ=torch.ones(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="IT92"):
        kernels.AtomSet.from_elements(["Qq"], [[0, 0, 0]], [10.0])
    assert isinstance(atoms.labels[0], AtomLabel)


def test_cell_matrices():
    cell = kernels.Cell.from_parameters(10, 12, 14, 80, 95, 105)
    assert torch.allclose(cell.orth @ cell.frac, torch.eye(3, dtype=torch.float64))
    assert cell.volume == pytest.approx(cell.to_gemmi().volume)
    assert cell.kind == "triclinic"
    with pytest.raises(ValueError):
        kernels.Cell.from_parameters(10, -1, 10)


def test_map_round_trip_whole_cell_and_box(tmp_path):
    m = model("1pfe")
    grid = kernels.GridSpec.for_spacing(m.cell, 1.0, m.spacegroup)
    rho = torch.rand(grid.shape, dtype=torch.float64)
    path = kernels.write_map(tmp_path / "m.ccp4", rho, grid)
    back, grid2 = kernels.read_map(path)
    assert grid2.shape == grid.shape and grid2.is_whole_cell
    assert torch.equal(back, rho.float())
    box = kernels.GridSpec(m.cell, (5, 6, 7), origin=(-2, 3, 40), sampling=grid.shape)
    rb = torch.rand(box.shape)
    back, grid3 = kernels.read_map(kernels.write_map(tmp_path / "b.mrc", rb, box))
    assert (grid3.shape, grid3.origin, grid3.sampling) == (box.shape, box.origin, box.sampling)
    assert torch.equal(back, rb)
    assert not list(tmp_path.glob(".*tmp")), "no temporary file left behind"


def test_map_write_is_atomic(tmp_path, monkeypatch):
    import gemmi

    m = model("1orc")
    grid = kernels.GridSpec.for_spacing(m.cell, 2.0)
    target = kernels.write_map(tmp_path / "m.ccp4", torch.ones(grid.shape), grid)
    before = target.read_bytes()

    def broken(self, path):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(gemmi.Ccp4Map, "write_ccp4_map", broken)
    with pytest.raises(OSError, match="disk full"):
        kernels.write_map(target, torch.zeros(grid.shape), grid)
    assert target.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.ccp4"]


def test_read_map_errors(tmp_path):
    with pytest.raises(ValueError, match="no such map"):
        kernels.read_map(tmp_path / "absent.ccp4")
    (tmp_path / "bad.ccp4").write_bytes(b"nope" * 10)
    with pytest.raises(ValueError, match="bad.ccp4"):
        kernels.read_map(tmp_path / "bad.ccp4")


def test_map_agrees_with_gemmi_reading_it(tmp_path):
    import gemmi

    m = model("5h73")
    grid = kernels.GridSpec.for_spacing(m.cell, 2.0, m.spacegroup)
    rho = torch.rand(grid.shape)
    kernels.write_map(tmp_path / "m.ccp4", rho, grid)
    g = gemmi.read_ccp4_map(str(tmp_path / "m.ccp4"), setup=True)
    assert np.array_equal(np.array(g.grid, copy=False), rho.numpy())
    assert g.grid.unit_cell.parameters == pytest.approx(m.cell.parameters)


def test_cli_splat_writes_a_map(tmp_path, capsys):
    from workbench.cli import main

    out = tmp_path / "out.ccp4"
    assert main(["splat", "--backend", "reference", "--spacing", "1.0", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "559 atoms" in printed and "backend reference" in printed and "wrote" in printed
    rho, grid = kernels.read_map(out)
    # Each Gaussian a·(4π/B)^{3/2}·exp(−4π²r²/B) integrates to a, so the map holds the model's
    # electrons, Σ occ·Σa, less what lies beyond the 1e-5 e/Å³ cutoff spheres (~1e-4 of it).
    atoms = model("1orc").atoms
    electrons = float((atoms.occ[:, None] * atoms.a).sum())
    assert float(rho.sum()) * grid.voxel_volume == pytest.approx(electrons, rel=5e-4)


def test_cli_reports_bad_input(tmp_path, capsys):
    from workbench.cli import main

    bad = tmp_path / "bad.pdb"
    bad.write_text("HELLO\n")
    # A file that is not a model is a failure (1), not a usage error (2): the arguments were fine.
    assert main(["splat", str(bad), "--out", str(tmp_path / "o.ccp4")]) == 1
    assert "error:" in capsys.readouterr().err
    assert main(["splat", "--device", "cuda", "--out", str(tmp_path / "o.ccp4")]) == (
        0 if torch.cuda.is_available() else 2
    )


def test_copy_of_example_structure_is_readable(tmp_path):
    dst = tmp_path / "copy.pdb.gz"
    shutil.copy(kernels.example_structure("1orc"), dst)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(kernels.read_model(dst)) == 559
