"""Unit cells, map grids and reading an atomic model into atom tensors: the public face.

Everything that enters a kernel passes through here: :func:`read_model` turns a PDB or
mmCIF file (read by gemmi) into a :class:`Model` whose :class:`AtomSet` holds float64
torch tensors, validated on the host; :class:`Cell` carries the fractional/Cartesian
matrices; :class:`GridSpec` says where each voxel of a map sits.

Each lives in a module of its own concern, imported from here (and from :mod:`kernels`):
:mod:`kernels.cell`, :mod:`kernels.grid`, :mod:`kernels.atoms`, :mod:`kernels.form_factors`;
reading checks the file's text in ``kernels._model_file`` and runs its steps from
``kernels._read_model``. None of those imports this module.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from kernels import _read_model as steps
from kernels._model_file import MAX_MODEL_BYTES, ModelError
from kernels._read_model import MODEL_SUFFIXES
from kernels._util import format_size as _size  # noqa: F401 (kernels.density.ensemble imports it from here)
from kernels.atoms import MIN_PHYSICAL_B, AtomLabel, AtomSet, _Tiled  # noqa: F401 (_Tiled: as _size)
from kernels.cell import Cell
from kernels.form_factors import RADIATIONS, form_factor_coefficients, it92_coefficients
from kernels.grid import GridError, GridSpec, _free_memory  # noqa: F401 (_free_memory: as _size)

__all__ = [
    "AtomLabel",
    "AtomSet",
    "Cell",
    "GridError",
    "GridSpec",
    "MAX_MODEL_BYTES",
    "MIN_PHYSICAL_B",
    "MODEL_SUFFIXES",
    "Model",
    "ModelError",
    "RADIATIONS",
    "example_structure",
    "form_factor_coefficients",
    "it92_coefficients",
    "read_model",
]

_DATA_DIR = Path(__file__).resolve().parent / "data"
_EXAMPLES = {"1orc": "1orc.pdb.gz", "1pfe": "1pfe.cif.gz", "1aki": "1aki.cif.gz"}


def example_structure(name: str = "1orc") -> Path:
    """Path of a structure bundled with the package.

    Parameters
    ----------
    name : {"1orc", "1pfe", "1aki"}
        1ORC (559 atoms, orthogonal cell, the default), 1PFE (342 atoms, hexagonal cell,
        DNA with Cl and P) or 1AKI (1,079 atoms, lysozyme).

    Returns
    -------
    pathlib.Path
        The gzip-compressed PDB or mmCIF file inside the installed package.
    """
    key = name.lower()
    if key not in _EXAMPLES:
        raise ValueError(f"no bundled example {name!r}; choose one of {sorted(_EXAMPLES)}")
    return _DATA_DIR / _EXAMPLES[key]


@dataclasses.dataclass(frozen=True, eq=False)
class Model:
    """An atomic model read from a file.

    Attributes
    ----------
    atoms : AtomSet
        float64 tensors on the CPU, one row per atom site kept.
    cell : Cell
    spacegroup : str
        Hermann–Mauguin name (``"P 1"`` for a box built with ``box_padding``).
    path : pathlib.Path or None
        The file it was read from.
    structure : gemmi.Structure
        The filtered structure, one model, atoms in the same order as ``atoms``
        (chain → residue → atom); used to find planes, write models, show residues.
    notes : tuple of str
        What reading changed or assumed (e.g. B derived from ANISOU, a padded box).
    shift : tuple of 3 float or None
        The translation in Å added to every atom of the file to place it in the box that
        ``box_padding`` built (file position = ``atoms.xyz - shift``); None when the atoms are
        at the file's coordinates.
    model_index : int
        Which model of the file this is (0 = the first).
    n_models : int
        How many models the file holds.
    """

    atoms: AtomSet
    cell: Cell
    spacegroup: str
    path: Path | None
    structure: object
    notes: tuple[str, ...] = ()
    shift: tuple[float, float, float] | None = None
    model_index: int = 0
    n_models: int = 1

    def __len__(self) -> int:
        return len(self.atoms)

    def __repr__(self) -> str:
        name = self.path.name if self.path else "<memory>"
        return f"Model({name}: {len(self.atoms)} atoms, {self.cell!r}, {self.spacegroup!r})"


def read_model(
    path: str | os.PathLike,
    *,
    model_index: int | None = None,
    altlocs: str = "all",
    water: bool = True,
    hydrogens: bool = True,
    box_padding: float | None = None,
    adp: str = "auto",
    on_bad_adp: str = "raise",
    radiation: str = "xray",
    max_bytes: int = MAX_MODEL_BYTES,
) -> Model:
    """Read a PDB or mmCIF file (optionally gzipped) into atom tensors.

    Parameters
    ----------
    path : str or path-like
        ``.pdb``, ``.ent``, ``.cif``, ``.mmcif``, each optionally ``.gz``.
    model_index : int, optional
        Which model of a multi-model file (0 = the first). Left out, the first model is read
        and, where the file holds more, a note says so and how to choose another (or to splat
        them all with :func:`kernels.splat_ensemble`).
    altlocs : str
        ``"all"`` keeps every alternative conformation (each at its own occupancy, what
        gemmi splats); ``"first"`` keeps only the first conformer of each atom; a single
        letter such as ``"A"`` keeps atoms without altloc plus that conformer.
    water : bool
        Keep waters (HOH/WAT/DOD).
    hydrogens : bool
        Keep hydrogen (and deuterium) atoms.
    box_padding : float, optional
        For a model without a unit cell (no CRYST1, or a 1×1×1 placeholder): build a
        P 1 orthogonal box around the atoms with this margin in Å, the atoms moved into it
        by ``Model.shift``. Without it such a model is an error; a model with a cell
        ignores it (``Model.shift`` is then None).
    adp : {"auto", "iso"}
        ``auto`` keeps each atom's ANISOU as a row of ``atoms.u_aniso`` (``atoms.aniso`` marks
        those atoms; the others use their B); a file without ANISOU gives an isotropic set.
        ``iso`` ignores ANISOU and splats every atom at its isotropic B.
    on_bad_adp : {"raise", "iso"}
        What to do with an atom whose U is not positive definite (no Gaussian has that shape;
        gemmi's map is NaN around it): ``raise`` a ModelError naming the atom and its eigenvalues,
        or ``iso`` to splat that atom at its B_iso (one warning naming the atoms, also in ``notes``).
        The same for an ANISOU record (or ``_atom_site_anisotrop`` row) that is not its atom's: one
        that follows another atom's record, a TER or nothing, or repeats another atom's serial,
        name, residue, chain or altloc (gemmi would give its U to the atom read last): ``raise``
        names both records, ``iso`` leaves the record out with a warning.
    radiation : {"xray", "electron", "neutron"}
        Which form-factor table gives ``atoms.a``/``atoms.b``
        (:func:`kernels.crystal.form_factor_coefficients`).
    max_bytes : int
        The most text (after decompressing) the file may hold, 2 GiB by default. The file is read
        as a stream and refused as soon as it passes this, or shows binary bytes, more than
        16 MiB of blank text in a row, or a start that is not its format, so a bad file costs
        little memory; raise it for a larger model.

    Returns
    -------
    Model

    Raises
    ------
    ModelError
        Every problem with the file, naming it and (where it applies) the line or
        ``_atom_site`` row, the atom, the field and its value: missing, empty, binary,
        not a regular file (a folder, ``/dev/null``, a pipe), not gzip although named .gz,
        truncated or corrupt gzip, larger than ``max_bytes``, the other format than its name
        says; a numeric field gemmi would read leniently (``1O.OOO``, ``12.3.4``, ``-``, a
        value cut short); a blank occupancy or B in PDB (B may be blank where an
        ANISOU record follows: it is then derived from U); an mmCIF ``_atom_site`` table
        without coordinates, element or B column; an unknown element; a cell that is not
        a cell (a length ≤ 0, angles no cell has); a space group the cell contradicts;
        no atoms; no unit cell without ``box_padding``; non-finite coordinates, B ≤ 0,
        occupancy outside [0, 1]; an ANISOU U that is not positive definite, or an ANISOU
        that is not its atom's (with ``on_bad_adp="raise"``); an mmCIF anisotrop U that is not a
        number; an element the ``radiation`` table does not cover; ``adp``,
        ``on_bad_adp`` or ``radiation`` not one of their values.

    Warns
    -----
    UserWarning
        Where the file is readable but something was assumed (also in ``notes``): an
        mmCIF without occupancies (taken as 1), a space group gemmi does not know or none
        (P 1 is used), a cell that fits its space group only within 0.1 % of its metric,
        B derived from ANISOU, anisotropic atoms splatted at B_iso or ANISOU records left out
        (``on_bad_adp="iso"``); and (not in ``notes``) a B, or a U along its narrowest axis,
        below ``MIN_PHYSICAL_B``.
    """
    path = Path(path)
    where = str(path)
    opts = steps.check_arguments(
        path,
        where,
        model_index=model_index,
        altlocs=altlocs,
        water=water,
        hydrogens=hydrogens,
        box_padding=box_padding,
        adp=adp,
        on_bad_adp=on_bad_adp,
        radiation=radiation,
        max_bytes=max_bytes,
    )
    notes: list[str] = []
    source = steps.parse(path, where, opts, notes)
    n_models = steps.select_model(source, where, opts, notes)
    columns = steps.atom_columns(source, where, opts, notes)
    cell, spacegroup, shift = steps.place_in_cell(source, columns, where, opts, notes)
    u_aniso, flags = steps.displacements(source, columns, where, opts, notes)
    atoms = steps.atom_set(columns, u_aniso, flags, where, opts.radiation)
    return Model(
        atoms,
        cell,
        spacegroup,
        path,
        source.structure,
        tuple(notes),
        shift=shift,
        model_index=opts.model_index,
        n_models=n_models,
    )
