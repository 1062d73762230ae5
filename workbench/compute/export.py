"""Results → files: a map as CCP4/MRC bytes, a model as PDB text, gradients as CSV."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch

import kernels
from kernels import GridSpec, Model
from workbench.compute.errors import WorkbenchError
from workbench.compute.text import count

__all__ = ["gradients_csv", "map_ccp4_bytes", "model_pdb"]


def map_ccp4_bytes(rho: torch.Tensor, grid: GridSpec, radiation: str | None = None) -> bytes:
    """A map ``rho`` (shape ``grid.shape``) as the bytes of a CCP4/MRC file (:func:`kernels.write_map`;
    ``radiation`` puts the map's unit in its label)."""
    with tempfile.TemporaryDirectory(prefix="workbench-") as tmp:
        path = kernels.write_map(Path(tmp) / "map.ccp4", rho, grid, radiation=radiation)
        return path.read_bytes()


def model_pdb(model: Model, xyz: torch.Tensor) -> str:
    """PDB text of the model with positions ``xyz`` (N, 3) Å (the distorted ones, say).

    Atom ``i`` gets serial number ``i + 1`` (TER records take none), so an atom picked in
    the 3D view is found again by its serial.
    """
    import gemmi

    st = model.structure.clone()
    pos = xyz.detach().to("cpu", torch.float64).numpy()
    i = 0
    for chain in st[0]:
        for res in chain:
            for atom in res:
                atom.pos = gemmi.Position(*pos[i])
                i += 1
                atom.serial = i
    if i != len(pos):
        raise WorkbenchError(f"the model has {count(i, 'atom')} but {count(len(pos), 'position')} were given")
    st.setup_entities()
    options = gemmi.PdbWriteOptions()
    options.preserve_serial = True
    options.numbered_ter = False
    try:
        return st.make_pdb_string(options)
    except RuntimeError:
        # Long chain names do not fit PDB columns: 3Dmol reads mmCIF too, but sticks need
        # bonds it derives the same way, so shorten names instead.
        st.shorten_chain_names()
        return st.make_pdb_string(options)


def gradients_csv(model: Model, xyz: np.ndarray, grad: np.ndarray, kind: str, units: str) -> str:
    """CSV text: one row per atom with label, position ``xyz`` (N, 3) Å and gradient ``grad`` (N, 3)."""
    lines = [f"# {kind} gradient, units {units}", "index,chain,res_name,seq,atom,altloc,x,y,z,gx,gy,gz,norm"]
    norms = np.linalg.norm(grad, axis=1)
    for i, lab in enumerate(model.atoms.labels):
        x, y, z = xyz[i]
        gx, gy, gz = grad[i]
        lines.append(
            f"{i},{lab.chain},{lab.res_name},{lab.seq_num}{lab.icode.strip()},{lab.atom_name},{lab.altloc},"
            f"{x:.4f},{y:.4f},{z:.4f},{gx:.6e},{gy:.6e},{gz:.6e},{norms[i]:.6e}"
        )
    return "\n".join(lines) + "\n"
