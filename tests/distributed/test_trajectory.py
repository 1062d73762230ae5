"""``workbench ensemble TRAJECTORY --topology TOP``: an MD trajectory read through MDAnalysis (the [md] extra).

The trajectory is a DCD written here with MDAnalysis from the multi-model file of the other tests,
so the frames are known: positions within DCD's float32 rounding, every atom at ``--md-b`` and
occupancy 1, the cell from the box.
"""

from __future__ import annotations

import torch

import kernels
from tests.distributed._frames import CELL, write_models, write_trajectory
from tests.helpers import assert_close
from workbench.cli import main as workbench_main
from workbench.ensemble_cli import read_frames


def _dcd(tmp_path):
    return write_trajectory(tmp_path, 4, seed=3)


def test_trajectory_frames_and_map(tmp_path, capsys):
    models, top, dcd = _dcd(tmp_path)
    frames = read_frames(dcd, topology=top, md_b=25.0)
    pdb = read_frames(models)
    assert frames.xyz.shape == (4, len(pdb.atoms), 3)
    assert_close(frames.xyz, pdb.xyz, atol=1e-3)  # the PDB's 3 decimals through DCD's float32
    assert bool((frames.b_iso == 25.0).all()) and bool((frames.occ == 1.0).all())
    assert frames.atoms.elements == pdb.atoms.elements
    assert all(abs(p - q) < 1e-3 for p, q in zip(frames.cell.parameters, CELL))
    assert any("B = 25 Å²" in note for note in frames.notes)

    out = tmp_path / "md.ccp4"
    args = ["ensemble", str(dcd), "--topology", str(top), "--md-b", "25", "--spacing", "1.0", "--backend", "reference"]
    assert workbench_main([*args, "--out", str(out)]) == 0
    assert "frames  4 of 9 atoms" in capsys.readouterr().out
    rho, grid = kernels.read_map(out)
    want = kernels.splat_ensemble(
        frames.atoms, frames.xyz, grid, b_iso=frames.b_iso, weights=[0.25] * 4, backend="reference"
    )
    assert_close(rho.double(), want.float().double(), atol=1e-6 * float(want.abs().max()), rtol=1e-6)


def test_trajectory_errors_say_what_to_do(tmp_path, capsys):
    _, top, dcd = _dcd(tmp_path)
    assert workbench_main(["ensemble", str(dcd), "--topology", str(tmp_path / "missing.pdb")]) == 2
    assert "topology" in capsys.readouterr().err
    short = tmp_path / "short.pdb"  # a topology with one atom fewer than the trajectory
    lines = top.read_text().splitlines()
    short.write_text("\n".join(line for i, line in enumerate(lines) if i != 3) + "\n")
    assert workbench_main(["ensemble", str(dcd), "--topology", str(short), "--out", str(tmp_path / "x.ccp4")]) == 1
    err = capsys.readouterr().err
    assert "MDAnalysis cannot read" in err, err
    assert torch.is_tensor(read_frames(dcd, topology=top).xyz)


def test_models_with_anisou_give_per_frame_u(tmp_path, capsys):
    models = write_models(tmp_path / "aniso.pdb", 3, seed=5, anisou=True)
    frames = read_frames(models)
    atoms = frames.atoms
    assert frames.u_aniso.shape == (3, len(atoms), 6)
    assert atoms.aniso.tolist() == [i % 2 == 0 for i in range(len(atoms))]
    assert not torch.equal(frames.u_aniso[0], frames.u_aniso[1])  # each model's own ANISOU
    last = frames.u_aniso[2, 2]  # no ANISOU for this atom in the last model: its B, isotropically
    torch.testing.assert_close(
        last, torch.cat([frames.b_iso[2, 2].expand(3) / (8 * torch.pi**2), torch.zeros(3, dtype=last.dtype)])
    )
    grid = kernels.GridSpec.for_spacing(frames.cell, 0.8)
    want = sum(
        kernels.splat_density(
            atoms.replace(xyz=frames.xyz[f], b_iso=frames.b_iso[f], occ=frames.occ[f], u_aniso=frames.u_aniso[f]),
            grid,
            backend="reference",
        )
        for f in range(3)
    )
    got = kernels.splat_ensemble(
        atoms, frames.xyz, grid, b_iso=frames.b_iso, occ=frames.occ, u_aniso=frames.u_aniso, backend="reference"
    )
    assert_close(got, want, atol=1e-12 * float(want.abs().max()))
    out = tmp_path / "mean.ccp4"
    assert (
        workbench_main(["ensemble", str(models), "--out", str(out), "--spacing", "0.8", "--backend", "reference"]) == 0
    )
    rho, _ = kernels.read_map(out)
    assert_close(torch.as_tensor(rho, dtype=torch.float64), want / 3, atol=1e-5 * float(want.abs().max()))
    iso = read_frames(models, adp="iso")
    assert iso.u_aniso is None and iso.atoms.u_aniso is None
