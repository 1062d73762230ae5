"""A small multi-model PDB written by the tests: F frames of one short peptide in a small cell."""

from __future__ import annotations

from pathlib import Path

import numpy as np

CELL = (14.0, 15.0, 13.0, 90.0, 95.0, 90.0)
# (atom name, residue, residue number, element, x, y, z)
ATOMS = [
    ("N", "ALA", 1, "N", 3.0, 4.0, 5.0),
    ("CA", "ALA", 1, "C", 4.2, 4.6, 5.5),
    ("C", "ALA", 1, "C", 5.4, 3.8, 5.1),
    ("O", "ALA", 1, "O", 5.5, 2.6, 5.3),
    ("CB", "ALA", 1, "C", 4.3, 6.0, 4.9),
    ("N", "SER", 2, "N", 6.4, 4.5, 4.6),
    ("CA", "SER", 2, "C", 7.6, 3.9, 4.2),
    ("OG", "SER", 2, "O", 8.1, 4.8, 3.2),
    ("SD", "MET", 3, "S", 9.5, 6.0, 7.0),
]


def write_models(
    path: Path, n_models: int, seed: int = 0, rename: tuple[int, int, str] | None = None, anisou: bool = False
) -> Path:
    """Write ``n_models`` models (positions jittered by 0.4 Å, B and occupancy per model) to ``path``.

    ``rename=(model, atom, name)`` gives one atom of one model (0-based) another name, for the
    "frames do not share the same atoms" error. ``anisou=True`` writes an ANISOU record, different
    in every model, for every other atom (eigenvalue ratio up to 6, tilted), and none for atom 2 of
    the last model.
    """
    rng = np.random.default_rng(seed)
    lines = ["CRYST1{:9.3f}{:9.3f}{:9.3f}{:7.2f}{:7.2f}{:7.2f} P 1           1".format(*CELL)]
    for m in range(n_models):
        lines.append(f"MODEL     {m + 1:4d}")
        for i, (name, res, num, el, x, y, z) in enumerate(ATOMS):
            if rename is not None and rename[:2] == (m, i):
                name = rename[2]
            dx, dy, dz = rng.normal(0, 0.4, 3)
            occ = rng.uniform(0.6, 1.0)
            b = rng.uniform(10.0, 30.0)
            lines.append(
                f"ATOM  {i + 1:5d}  {name:<3s} {res:3s} A{num:4d}    {x + dx:8.3f}{y + dy:8.3f}{z + dz:8.3f}"
                f"{occ:6.2f}{b:6.2f}          {el:>2s}"
            )
            if anisou and i % 2 == 0 and not (m == n_models - 1 and i == 2):
                lam = np.array([1.0, rng.uniform(1, 3), rng.uniform(3, 6)])
                lam *= 3 * b / (8 * np.pi**2) / lam.sum()
                q, _ = np.linalg.qr(rng.normal(size=(3, 3)))
                u = q @ np.diag(lam) @ q.T
                ints = [round(1e4 * v) for v in (u[0, 0], u[1, 1], u[2, 2], u[0, 1], u[0, 2], u[1, 2])]
                lines.append(
                    f"ANISOU{i + 1:5d}  {name:<3s} {res:3s} A{num:4d}  "
                    + "".join(f"{v:7d}" for v in ints)
                    + f"      {el:>2s}"
                )
        lines.append("ENDMDL")
    lines.append("END")
    path.write_text("\n".join(lines) + "\n")
    return path


def write_dcd(folder: Path, n_frames: int, seed: int = 0, sigma: float = 0.4) -> tuple[Path, Path]:
    """Write ``folder/top.pdb`` (the atoms of :data:`ATOMS`, one model) and ``folder/traj.dcd``.

    The DCD holds ``n_frames`` frames of :data:`ATOMS` jittered by ``sigma`` Å (seeded), each with
    the box :data:`CELL`; MDAnalysis (the [md] extra) writes it.

    Returns
    -------
    (topology, trajectory) : tuple of Path
    """
    import MDAnalysis

    top = write_models(folder / "top.pdb", 1, seed=seed)
    u = MDAnalysis.Universe(str(top))
    rng = np.random.default_rng(seed)
    base = np.array([a[4:] for a in ATOMS], dtype=np.float64)
    dcd = folder / "traj.dcd"
    with MDAnalysis.Writer(str(dcd), len(u.atoms)) as writer:
        for _ in range(n_frames):
            u.atoms.positions = base + rng.normal(0.0, sigma, base.shape)
            u.trajectory.ts.dimensions = CELL
            writer.write(u.atoms)
    return top, dcd


def write_trajectory(folder: Path, n_models: int, seed: int = 0) -> tuple[Path, Path, Path]:
    """``(models, topology, dcd)``: :func:`write_models` in ``folder``, its first model as a topology, its frames as a DCD.

    The DCD (written with MDAnalysis, the [md] extra) holds every model's positions in float32 and
    :data:`CELL` as its box.
    """
    import MDAnalysis

    models = write_models(folder / "models.pdb", n_models, seed=seed)
    top = folder / "top.pdb"
    top.write_text(
        "".join(line + "\n" for line in models.read_text().splitlines() if not line.startswith("ENDMDL")).split(
            "MODEL        2"
        )[0]
    )
    u = MDAnalysis.Universe(str(models))  # every MODEL a frame
    dcd = folder / "traj.dcd"
    with MDAnalysis.Writer(str(dcd), len(u.atoms)) as writer:
        for ts in u.trajectory:
            ts.dimensions = CELL  # MDAnalysis reads no box from a CRYST1 outside the MODEL blocks
            writer.write(u.atoms)
    return models, top, dcd
