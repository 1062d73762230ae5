"""Structure → atoms: reading a model, the B-factor mode, the distortion, residue selections."""

from __future__ import annotations

import logging
import os
import traceback
from pathlib import Path

import numpy as np
import torch

import kernels
from kernels import AtomSet, Model
from workbench.compute.errors import WorkbenchError, sentence
from workbench.state import EXAMPLES, Settings

__all__ = [
    "BOX_PADDING",
    "distortion",
    "load_model",
    "prepare_atoms",
    "region_atoms",
    "residue_keys",
    "save_upload",
]

log = logging.getLogger("workbench")

# Å of padding around a model whose file has no unit cell (its P 1 box); said in a note.
BOX_PADDING = 5.0


def load_model(source: str | os.PathLike | Model) -> Model:
    """Read a structure: a :class:`kernels.Model`, a bundled example name or a file path.

    A file without a unit cell is read into a P 1 box with :data:`BOX_PADDING` Å of
    margin (the model's ``notes`` say so) rather than refused.

    Raises
    ------
    WorkbenchError
        The file is missing, truncated, not a model, or holds values no map can be made
        from: "model file problem: " and :func:`kernels.read_model`'s message (file, line
        or row, atom, field, value), then what to do. Never blames a backend: nothing has
        been computed yet.
    """
    if isinstance(source, Model):
        return source
    text = str(source).strip()
    if not text:
        raise WorkbenchError(f"no structure given: choose a bundled example ({', '.join(EXAMPLES)}) or type a path")
    path = kernels.example_structure(text) if text.lower() in EXAMPLES else Path(text).expanduser()
    try:
        return kernels.read_model(path, box_padding=BOX_PADDING)
    except kernels.ModelError as exc:
        raise WorkbenchError(f"model file problem: {sentence(exc)} Choose another file or a bundled example.") from exc
    except Exception as exc:  # noqa: BLE001 - a reader failure is still about this file, not a backend
        log.error("reading %s failed:\n%s", path, traceback.format_exc())
        raise WorkbenchError(
            f"model file problem: {path} could not be read ({type(exc).__name__}: {sentence(exc)}) "
            "Choose another file or a bundled example; details in the 'workbench' log."
        ) from exc


def save_upload(name: str, content: bytes, folder: str | os.PathLike) -> Path:
    """Write an uploaded file's bytes to ``folder`` under its own (sanitised) name."""
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in Path(name).name) or "upload.pdb"
    path = Path(folder) / safe
    path.write_bytes(bytes(content))
    return path


def distortion(n_atoms: int, amplitude: float, seed: int) -> torch.Tensor:
    """Random displacements, shape (n_atoms, 3), float64, Å: N(0, amplitude²) per coordinate.

    Seeded with its own generator, so the same seed gives the same displacement on any
    device or backend (the physics must not depend on them).
    """
    gen = torch.Generator().manual_seed(int(seed))
    return torch.randn((n_atoms, 3), generator=gen, dtype=torch.float64) * float(amplitude)


def prepare_atoms(model: Model, settings: Settings, *, distorted: bool = True) -> AtomSet:
    """The model's atoms with the B-factor mode applied and (optionally) the distortion.

    Returns
    -------
    AtomSet
        float64 on the CPU (moved to the compute device by the caller).

    Raises
    ------
    WorkbenchError
        The B settings give some atom B ≤ 0.
    """
    atoms = model.atoms
    b = atoms.b_iso
    if settings.b_mode == "global":
        b = torch.full_like(b, settings.b_global)
    elif settings.b_mode == "offset":
        b = b + settings.b_offset
        if not bool((b > 0).all()):
            low = float(atoms.b_iso.min())
            raise WorkbenchError(
                f"B offset {settings.b_offset:g} Å² makes B ≤ 0 for {int((b <= 0).sum())} atoms (lowest model B is "
                f"{low:.2f} Å²): set the offset above {-low:.2f} Å²"
            )
    xyz = atoms.xyz
    if distorted and settings.distort_amplitude > 0:
        xyz = xyz + distortion(len(atoms), settings.distort_amplitude, settings.distort_seed)
    return AtomSet(xyz, b, atoms.occ, atoms.a, atoms.b, atoms.elements, atoms.labels, _validate=False)


def _residue_key(label) -> str:
    return f"{label.chain}/{label.seq_num}{label.icode.strip()}"


def residue_keys(model: Model) -> list[tuple[str, str]]:
    """``(key, label)`` of every residue, key ``"chain/seq[icode]"`` as the region trait takes."""
    seen: dict[str, str] = {}
    for lab in model.atoms.labels:
        key = _residue_key(lab)
        if key not in seen:
            seen[key] = f"{lab.chain}/{lab.res_name} {lab.seq_num}{lab.icode.strip()}"
    return list(seen.items())


def region_atoms(model: Model, region: str) -> np.ndarray:
    """Indices of the atoms of residue ``region`` (``"chain/seq"``), all atoms for ''.

    Returns
    -------
    numpy.ndarray, shape (M,), int64
        Ascending atom indices; M ≥ 1 for a residue of the model.

    Raises
    ------
    WorkbenchError
        No residue ``region`` in the model.
    """
    if not region:
        return np.arange(len(model))
    idx = [i for i, lab in enumerate(model.atoms.labels) if _residue_key(lab) == region]
    if not idx:
        raise WorkbenchError(f"no residue {region!r} in the model: pick one from the region list (chain/number)")
    return np.asarray(idx)
