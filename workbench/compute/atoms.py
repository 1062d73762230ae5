"""Structure → atoms: reading a model, the ADP and radiation settings, the B-factor mode, the
distortion, residue selections."""

from __future__ import annotations

import logging
import math
import os
import traceback
import warnings
from pathlib import Path

import numpy as np
import torch

import kernels
from kernels import AtomSet, Model
from kernels.adp import U_TO_B, adp_eigenvalues, with_blur
from kernels.atoms import MIN_PHYSICAL_B
from workbench.compute.errors import WorkbenchError, sentence
from workbench.state import EXAMPLES, Settings

__all__ = [
    "BOX_PADDING",
    "distortion",
    "load_model",
    "model_atoms",
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
    margin (the model's ``notes`` say so) rather than refused. ANISOU records are kept
    (``atoms.u_aniso``); an atom whose U is not positive definite is splatted at its
    isotropic B instead, and a note names it (a viewer shows such a file rather than
    refusing it; :func:`kernels.read_model` refuses by default).

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
        with warnings.catch_warnings():
            # every warning is also one of the model's notes, which the status line shows
            warnings.simplefilter("ignore", UserWarning)
            return kernels.read_model(path, box_padding=BOX_PADDING, on_bad_adp="iso")
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
    # file systems take 255 bytes a name: a longer one keeps its start and the suffixes that say the format
    if len(safe.encode()) > 200:
        tail = "".join(Path(safe).suffixes[-2:])[-40:]
        safe = safe[: 200 - len(tail)] + tail
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


def model_atoms(model: Model, adp: str = "anisotropic", radiation: str = "xray") -> AtomSet:
    """The model's atoms as the ADP and radiation settings read them.

    Parameters
    ----------
    model : kernels.Model
    adp : {"anisotropic", "isotropic"}
        ``isotropic`` drops the ANISOU tensors (every atom at its ``b_iso``); a model
        without ANISOU is the same either way.
    radiation : {"xray", "electron", "neutron"}
        Form factors from :func:`kernels.crystal.form_factor_coefficients`.

    Returns
    -------
    AtomSet
        float64 on the CPU, ``radiation`` set.

    Raises
    ------
    WorkbenchError
        An element the radiation's table does not cover (the atom is named).
    """
    from kernels.crystal import form_factor_coefficients

    atoms = model.atoms
    u, flag = atoms.u_aniso, atoms.aniso
    if adp == "isotropic":
        u = flag = None
    a, b = atoms.a, atoms.b
    if radiation != atoms.radiation:
        try:
            a, b = form_factor_coefficients(atoms.elements, radiation, atoms.labels)
        except ValueError as exc:
            raise WorkbenchError(f"radiation {radiation}: {sentence(exc)} Choose another radiation.") from exc
        a, b = a.to(atoms.dtype), b.to(atoms.dtype)
    return AtomSet(
        atoms.xyz, atoms.b_iso, atoms.occ, a, b, atoms.elements, atoms.labels, u, flag,
        radiation=radiation, _validate=False,
    )  # fmt: skip


def prepare_atoms(model: Model, settings: Settings, *, distorted: bool = True, base: AtomSet | None = None) -> AtomSet:
    """The model's atoms with the ADP, radiation and B-factor settings applied, and (optionally) the distortion.

    B modes: ``model`` keeps every atom's B (and U); ``global`` gives every atom the one
    isotropic B ``b_global`` (anisotropic tensors dropped: one B means one isotropic
    width); ``offset`` adds ΔB = ``b_offset`` to every ``b_iso`` and ΔB/(8π²) to the
    diagonal of every anisotropic U, as gemmi's blur widens an anisotropic atom. The
    splat's own ``blur`` is not applied here: :func:`workbench.compute.density_map` passes it.

    Parameters
    ----------
    model : kernels.Model
    settings : Settings
    distorted : bool
        Add the settings' random displacement to the positions.
    base : AtomSet, optional
        :func:`model_atoms` of the settings' ``adp`` and ``radiation``, when the caller has it already.

    Returns
    -------
    AtomSet
        float64 on the CPU (moved to the compute device by the caller).

    Raises
    ------
    WorkbenchError
        The B settings give some atom B ≤ 0, or some anisotropic U that is not positive
        definite (the message gives the lowest offset allowed).
    """
    atoms = base if base is not None else model_atoms(model, settings.adp, settings.radiation)
    b, u, flag = atoms.b_iso, atoms.u_aniso, atoms.aniso
    if settings.b_mode == "global":
        b = torch.full_like(b, settings.b_global)
        u = flag = None
    elif settings.b_mode == "offset":
        delta = settings.b_offset
        offset = with_blur(atoms, delta)  # gemmi's blur rule: B + ΔB, U + ΔB/8π²·I
        b, u = offset.b_iso, offset.u_aniso
        _check_offset(atoms, delta, b)
    xyz = atoms.xyz
    if distorted and settings.distort_amplitude > 0:
        xyz = xyz + distortion(len(atoms), settings.distort_amplitude, settings.distort_seed)
    return AtomSet(
        xyz, b, atoms.occ, atoms.a, atoms.b, atoms.elements, atoms.labels, u, flag,
        radiation=atoms.radiation, _validate=False,
    )  # fmt: skip


def _check_offset(atoms: AtomSet, delta: float, b: torch.Tensor) -> None:
    """Refuse a B offset that leaves some atom without a Gaussian: B ≤ 0 (every atom keeps an AtomSet's
    B > 0, an anisotropic one's B being informational), or a U that is not positive definite for an
    anisotropic atom (U + ΔB/8π²·I has eigenvalues λ + ΔB/8π²); and a negative offset that takes an atom
    below ``MIN_PHYSICAL_B`` (B, or 8π²·λmin), less than zero-point motion allows."""
    if atoms.aniso is not None and bool(atoms.aniso.any()):
        lam = adp_eigenvalues(atoms.u_aniso)[:, 0].cpu()
        lam = torch.where(atoms.aniso.cpu(), lam, torch.full_like(lam, math.inf))
        # a negative offset may not take an atom below zero-point motion (MIN_PHYSICAL_B): its density
        # would be a spike the grid samples at a few points, the map's integral off by orders of magnitude
        narrowest = lam * U_TO_B + delta  # 8π²·λmin after the offset, Å²
        bad_u = (narrowest <= 0) | ((narrowest < MIN_PHYSICAL_B) & (delta < 0))
        if bool(bad_u.any()):
            i = int(torch.argmin(lam))
            floor = 0.0 if bool((narrowest[bad_u] <= 0).any()) else MIN_PHYSICAL_B
            limit = floor - float(lam[i]) * U_TO_B
            what = "not positive definite" if floor == 0 else f"narrower than B = {MIN_PHYSICAL_B} Å² along some axis"
            raise WorkbenchError(
                f"B offset {delta:g} Å² makes the U of {int(bad_u.sum())} anisotropic atoms {what} "
                f"(the narrowest, {atoms.labels[i]}, has smallest U eigenvalue {float(lam[i]):.4f} Å², "
                f"8π²·λ = {float(lam[i]) * U_TO_B:.2f} Å²): set the offset above {limit:.2f} Å², or ADP 'isotropic'"
            )
    iso = torch.ones_like(b, dtype=torch.bool) if atoms.aniso is None else ~atoms.aniso.cpu()
    bad_b = ~(b > 0) | ((b < MIN_PHYSICAL_B) & iso & (delta < 0))
    if bool(bad_b.any()):
        low = float(atoms.b_iso.min())
        nonpositive = not bool((b[bad_b] > 0).all())
        floor = 0.0 if nonpositive else MIN_PHYSICAL_B
        below = "B ≤ 0" if nonpositive else f"B below {MIN_PHYSICAL_B} Å² (zero-point motion)"
        raise WorkbenchError(
            f"B offset {delta:g} Å² makes {below} for {int(bad_b.sum())} atoms (lowest model B is "
            f"{low:.2f} Å²): set the offset above {floor - low:.2f} Å²"
        )


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
