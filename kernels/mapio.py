"""Reading and writing CCP4/MRC maps through gemmi."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from kernels.crystal import Cell, GridError, GridSpec

__all__ = ["write_map", "read_map"]


def write_map(path: str | os.PathLike, rho: torch.Tensor, grid: GridSpec, spacegroup: str = "P 1") -> Path:
    """Write ``rho`` as a CCP4/MRC map (mode 2, float32), atomically.

    The map goes to a temporary file in the same folder and is renamed onto ``path``
    only once complete, so an interrupted write never leaves a half map under the final
    name. Box grids keep their origin (header words NXSTART…) and cell sampling.

    Parameters
    ----------
    path : str or path-like
        Usually ``.ccp4``, ``.map`` or ``.mrc``.
    rho : torch.Tensor, shape grid.shape
        Any floating dtype or device (written as float32).
    grid : GridSpec
    spacegroup : str
        Recorded in the header (P 1 for a map of the atoms in the file).

    Returns
    -------
    pathlib.Path
    """
    import gemmi

    path = Path(path)
    if tuple(rho.shape) != grid.shape:
        raise GridError(f"map shape {tuple(rho.shape)} does not match the grid {grid.shape}")
    if not path.parent.exists():
        raise FileNotFoundError(f"{path.parent}: no such folder to write the map into")
    data = np.ascontiguousarray(rho.detach().to("cpu", torch.float32).numpy())
    ccp4 = gemmi.Ccp4Map()
    ccp4.grid = gemmi.FloatGrid(data, grid.cell.to_gemmi(), gemmi.find_spacegroup_by_name(spacegroup))
    ccp4.update_ccp4_header(2, True)
    if not grid.is_whole_cell:
        for word, value in zip((5, 6, 7), grid.origin):
            ccp4.set_header_i32(word, value)
        for word, value in zip((8, 9, 10), grid.sampling):
            ccp4.set_header_i32(word, value)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        ccp4.write_ccp4_map(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def read_map(path: str | os.PathLike) -> tuple[torch.Tensor, GridSpec]:
    """Read a CCP4/MRC map (optionally gzipped).

    Returns
    -------
    rho : torch.Tensor, shape (nx, ny, nz), float32
        Values with axes in a, b, c order whatever the file's axis order.
    grid : GridSpec
        The cell, the map's shape, its origin and the cell sampling from the header.

    Raises
    ------
    ValueError
        The file is missing, unreadable or not a CCP4/MRC map.
    """
    import gemmi

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such map file")
    try:
        ccp4 = gemmi.read_ccp4_map(str(path), setup=False)
    except Exception as exc:
        raise ValueError(f"{path}: cannot read it as a CCP4/MRC map ({exc})") from exc
    hdr = ccp4.header_i32
    axes = [hdr(17) - 1, hdr(18) - 1, hdr(19) - 1]  # file column/row/section -> cell axis
    if sorted(axes) != [0, 1, 2]:
        raise ValueError(f"{path}: bad axis order words MAPC/MAPR/MAPS {axes}")
    raw = np.array(ccp4.grid, copy=True)  # indexed [column, row, section]
    start_file = [hdr(5), hdr(6), hdr(7)]
    sampling = (hdr(8), hdr(9), hdr(10))
    perm = [axes.index(k) for k in range(3)]  # for cell axis k, which file axis holds it
    data = np.ascontiguousarray(np.transpose(raw, perm))
    origin = tuple(start_file[p] for p in perm)
    cell = Cell.from_gemmi(ccp4.grid.unit_cell)
    if min(sampling) <= 0:
        sampling = data.shape
    grid = GridSpec(cell, data.shape, origin=origin, sampling=sampling)
    return torch.from_numpy(data), grid
