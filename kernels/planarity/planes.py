"""Planar groups of a model: which atoms must lie in a plane, and how tightly.

:func:`find_planes` walks a :class:`~kernels.crystal.Model`'s gemmi structure and returns
a :class:`PlaneSet`: one padded ``(P, K)`` table of atom indices and σ for all planes, the
layout that lets one kernel launch handle every plane whatever its size.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
import weakref
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from kernels._util import positive_number, warn_once

__all__ = ["PlaneSet", "find_planes", "check_inputs", "PLANE_DEFINITIONS", "DEFAULT_SIGMA", "NEWTON_STEPS"]

DEFAULT_SIGMA = 0.02
"""Default σ (Å) of an atom's distance from its plane."""

NEWTON_STEPS = 6
"""Newton steps (in ``plane_fit.cpp`` and the Triton kernel) for the smallest root of the
characteristic cubic of the trace-normalised covariance. The start, max(−2, −q/p), is a
lower bound within λ0/p of the root for a near-planar group, so 2–3 steps reach machine
precision; 6 also cover groups far from planar (start at −2, quadratic convergence from
the left). The power step that follows squares what error is left."""

# A C(i)–N(i+1) distance up to this (Å) counts as a peptide bond (1.33 Å ideal; 2.0 Å
# keeps badly refined links and rejects chain breaks, which are ≥ 2.5 Å apart).
PEPTIDE_BOND_MAX = 2.0

# residue name -> (required atoms, optional atoms). Heavy atoms are required; the
# hydrogens that lie in the plane are taken when the model has them. Rings include the
# atom that carries them (CB, C1'); ASP/GLU/ASN/GLN/ARG are the sp2 group plus the carbon
# bonded to it.
_RING_PHE = ("CB", "CG", "CD1", "CD2", "CE1", "CE2", "CZ")
_PURINE = ("C1'", "N9", "C8", "N7", "C5", "C6", "N1", "C2", "N3", "C4")
_PYRIMIDINE = ("C1'", "N1", "C2", "O2", "N3", "C4", "C5", "C6")
_A = (_PURINE + ("N6",), ("H2", "H8", "H61", "H62"))
_G = (_PURINE + ("O6", "N2"), ("H1", "H8", "H21", "H22"))
_C = (_PYRIMIDINE + ("N4",), ("H41", "H42", "H5", "H6"))
_T = (_PYRIMIDINE + ("O4", "C7"), ("H3", "H6"))
_U = (_PYRIMIDINE + ("O4",), ("H3", "H5", "H6"))
PLANE_DEFINITIONS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "PHE": (_RING_PHE, ("HD1", "HD2", "HE1", "HE2", "HZ")),
    "TYR": (_RING_PHE + ("OH",), ("HD1", "HD2", "HE1", "HE2")),
    "TRP": (
        ("CB", "CG", "CD1", "CD2", "NE1", "CE2", "CE3", "CZ2", "CZ3", "CH2"),
        ("HD1", "HE1", "HE3", "HZ2", "HZ3", "HH2"),
    ),
    "HIS": (("CB", "CG", "ND1", "CD2", "CE1", "NE2"), ("HD1", "HD2", "HE1", "HE2")),
    "ARG": (("CD", "NE", "CZ", "NH1", "NH2"), ("HE", "HH11", "HH12", "HH21", "HH22")),
    "ASN": (("CB", "CG", "OD1", "ND2"), ("HD21", "HD22")),
    "GLN": (("CG", "CD", "OE1", "NE2"), ("HE21", "HE22")),
    "ASP": (("CB", "CG", "OD1", "OD2"), ()),
    "GLU": (("CG", "CD", "OE1", "OE2"), ()),
    "DA": _A, "A": _A,
    "DG": _G, "G": _G,
    "DC": _C, "C": _C,
    "DT": _T,
    "DU": _U, "U": _U,
}  # fmt: skip
"""Built-in planar groups: residue name -> (required atom names, optional atom names)."""

_WATER = frozenset({"HOH", "WAT", "DOD", "H2O"})

_tokens = itertools.count()
# token -> the PlaneSet that holds it, while it lives: how a compiled graph, which can hold only
# plain values, names a PlaneSet (kernels.planarity's torch.compile path).
_live: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


@dataclasses.dataclass(frozen=True, eq=False)
class PlaneSet:
    """Planar groups of atoms, padded into one table for the kernels.

    Plane ``p`` has ``size[p]`` atoms: ``index[p, :size[p]]`` with σ ``sigma[p, :size[p]]``.
    Planes are sorted by size (ties keep the model's order), so the planes of one size
    form the contiguous slice :meth:`groups` gives; the whole table is padded to the
    largest size ``K`` so that one kernel launch handles all planes. Padding slots repeat
    the plane's first atom with weight 0 (σ = inf), so a kernel may read them without a
    mask and they add nothing.

    Attributes
    ----------
    index : torch.Tensor, shape (P, K), int32
        Atom indices into the model's atoms (rows of ``xyz``).
    sigma : torch.Tensor, shape (P, K), float64
        σ in Å of each atom's distance from its plane; ``inf`` in padding slots.
    size : torch.Tensor, shape (P,), int32
        Number of atoms of each plane (≥ 3).
    kinds : tuple of str, length P
        What each plane is: ``"trans-peptide"``, ``"cis-peptide"``, a residue name for
        the built-in side-chain and base planes (``"PHE"``, ``"DG"`` …), or
        ``"<RES> <plane id>"`` for a plane read from a monomer library.
    where : tuple of str, length P
        The residue(s) and altloc of each plane, e.g. ``"A/PHE 12"``, ``"A/GLY 12-A/ALA 13 altloc B"``.
    n_atoms : int
        Number of atoms of the model the indices point into.
    skipped : dict of str to int
        Planes not made, by reason (missing atoms, chain breaks …).
    skipped_details : tuple of str
        One line per skipped plane, naming the residue and what was missing.
    """

    index: torch.Tensor
    sigma: torch.Tensor
    size: torch.Tensor
    kinds: tuple[str, ...]
    where: tuple[str, ...]
    n_atoms: int
    skipped: dict[str, int] = dataclasses.field(default_factory=dict)
    skipped_details: tuple[str, ...] = ()
    _cache: dict = dataclasses.field(default_factory=dict, repr=False)
    # Unique for the process (never reused, unlike id()); a copy made by dataclasses.replace gets its own.
    # A str: torch.compile keeps strings as constants, where an int that differs between two traces of
    # one function would become a symbolic input.
    _token: str = dataclasses.field(default_factory=lambda: f"planes{next(_tokens)}", init=False, repr=False)

    def __post_init__(self):
        p = len(self.kinds)
        if self.index.ndim != 2 or self.index.shape[0] != p or self.sigma.shape != self.index.shape:
            raise ValueError(
                f"PlaneSet needs index and sigma of shape (P, K) with P = {p} planes, "
                f"got {tuple(self.index.shape)} and {tuple(self.sigma.shape)}"
            )
        if tuple(self.size.shape) != (p,) or len(self.where) != p:
            raise ValueError(f"PlaneSet needs size (P,) and where of length P = {p}")
        _live[self._token] = self

    @classmethod
    def from_lists(
        cls,
        planes: Sequence[Sequence[int]],
        sigma: float | Sequence[Sequence[float]] = DEFAULT_SIGMA,
        *,
        n_atoms: int,
        kinds: Sequence[str] | None = None,
        where: Sequence[str] | None = None,
        skipped: dict[str, int] | None = None,
        skipped_details: Sequence[str] = (),
    ) -> PlaneSet:
        """Build a PlaneSet from lists of atom indices.

        Parameters
        ----------
        planes : sequence of sequences of int
            Each plane's atom indices (3 or more distinct atoms, each in ``[0, n_atoms)``).
        sigma : float or sequence of sequences of float
            One σ (Å) for every atom, or one per atom of each plane (same shape as ``planes``).
        n_atoms : int
            Number of atoms the indices point into.
        kinds, where : sequence of str, optional
            Labels per plane (default ``"plane"`` and the plane's number).
        skipped, skipped_details
            Bookkeeping of planes not made (see the class attributes).

        Raises
        ------
        ValueError
            A plane with fewer than 3 atoms, a repeated or out-of-range index, or a σ that
            is not a positive finite number.
        """
        planes = [list(map(int, p)) for p in planes]
        n = len(planes)
        # one number (any real scalar, checked below) or ragged per-plane lists (never given to numpy whole)
        if not isinstance(sigma, (list, tuple)) and np.ndim(sigma) == 0:
            sigma = positive_number(sigma, "sigma", "Å")
            sigmas = [[sigma] * len(p) for p in planes]
        else:
            sigmas = [list(map(float, s)) for s in sigma]
            if len(sigmas) != n or any(len(s) != len(p) for s, p in zip(sigmas, planes)):
                raise ValueError("sigma must be one number or one value per atom of each plane (same shape as planes)")
        for i, (p, s) in enumerate(zip(planes, sigmas)):
            if len(p) < 3:
                raise ValueError(f"plane {i} has {len(p)} atoms; a plane needs at least 3")
            if len(set(p)) != len(p):
                raise ValueError(f"plane {i} repeats an atom: {p}")
            if min(p) < 0 or max(p) >= n_atoms:
                raise ValueError(f"plane {i} has an atom index outside [0, {n_atoms}): {p}")
            if not all(math.isfinite(v) and v > 0 for v in s):
                raise ValueError(f"plane {i} has a σ that is not a positive finite number: {s}")
        kinds = tuple(kinds) if kinds is not None else ("plane",) * n
        where = tuple(where) if where is not None else tuple(f"plane {i}" for i in range(n))
        if len(kinds) != n or len(where) != n:
            raise ValueError(f"kinds and where need one entry per plane ({n})")
        order = sorted(range(n), key=lambda i: len(planes[i]))
        width = max((len(p) for p in planes), default=3)
        index = np.zeros((n, width), dtype=np.int32)
        sig = np.full((n, width), np.inf)
        for row, i in enumerate(order):
            p = planes[i]
            index[row, :] = p[0]
            index[row, : len(p)] = p
            sig[row, : len(p)] = sigmas[i]
        return cls(
            index=torch.from_numpy(index),
            sigma=torch.from_numpy(sig),
            size=torch.tensor([len(planes[i]) for i in order], dtype=torch.int32),
            kinds=tuple(kinds[i] for i in order),
            where=tuple(where[i] for i in order),
            n_atoms=int(n_atoms),
            skipped=dict(skipped or {}),
            skipped_details=tuple(skipped_details),
        )

    def __getstate__(self) -> dict:
        # The token and the cached device tables belong to this process: a copy or an unpickled set
        # gets its own token (another process's counter may have given the same one to another set).
        state = dict(self.__dict__)
        del state["_token"]
        state["_cache"] = {}
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _token=f"planes{next(_tokens)}")
        _live[self._token] = self

    def __len__(self) -> int:
        return len(self.kinds)

    @property
    def width(self) -> int:
        """K, the padded number of atoms per plane."""
        return int(self.index.shape[1])

    @property
    def device(self) -> torch.device:
        return self.index.device

    @property
    def constant(self) -> float:
        """Σ over plane atoms of ``log σ + ½ log 2π`` (the part of the NLL that does not move)."""
        if "constant" not in self._cache:
            s = self.sigma.detach().cpu()
            finite = torch.isfinite(s)
            self._cache["constant"] = float((torch.log(s[finite]) + 0.5 * math.log(2 * math.pi)).sum())
        return self._cache["constant"]

    def counts(self) -> dict[str, int]:
        """Number of planes of each kind."""
        return dict(Counter(self.kinds))

    def groups(self) -> dict[int, slice]:
        """Plane size -> the slice of rows with planes of that size."""
        sizes = self.size.tolist()
        out: dict[int, slice] = {}
        for row, k in enumerate(sizes):
            s = out.get(k)
            out[k] = slice(row if s is None else s.start, row + 1)
        return out

    def to(self, device: str | torch.device) -> PlaneSet:
        """The same planes with their tensors on ``device`` (cached: repeated calls are free)."""
        device = torch.device(device)
        if self.index.device == device:
            return self
        key = ("to", str(device))
        if key not in self._cache:
            self._cache[key] = dataclasses.replace(
                self, index=self.index.to(device), sigma=self.sigma.to(device), size=self.size.to(device), _cache={}
            )
        return self._cache[key]

    def weight(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """``1/σ²`` as a ``(P, K)`` tensor of ``dtype`` on this set's device, 0 in padding (cached)."""
        key = ("weight", dtype)
        if key not in self._cache:
            self._cache[key] = (1.0 / self.sigma**2).to(dtype).contiguous()
        return self._cache[key]

    def __repr__(self) -> str:
        kinds = ", ".join(f"{k}: {v}" for k, v in sorted(self.counts().items()))
        skipped = sum(self.skipped.values())
        return f"PlaneSet({len(self)} planes, up to {self.width} atoms; {kinds}; {skipped} skipped)"


# --------------------------------------------------------------------------- finder


class _Residue:
    """One residue (all gemmi Residue objects sharing a seqid, so microheterogeneity and
    altlocs are merged): atom name -> [(altloc, model index, position)]."""

    def __init__(self, chain: str, seqid: str):
        self.chain = chain
        self.seqid = seqid
        self.names: list[str] = []
        self.atoms: dict[str, list[tuple[str, int, tuple[float, float, float]]]] = {}

    def add(self, res_name: str, atom, index: int):
        if res_name not in self.names:
            self.names.append(res_name)
        alt = atom.altloc if atom.altloc != "\0" else ""
        self.atoms.setdefault(atom.name, []).append((alt, index, tuple(atom.pos.tolist())))

    @property
    def label(self) -> str:
        return f"{self.chain}/{'/'.join(self.names)} {self.seqid}"


def _conformers(parts: list[tuple[_Residue, Sequence[str], Sequence[str]]]):
    """Yield ``(altloc, atoms, missing)`` for each conformer of one plane.

    ``parts`` lists (residue, required names, optional names). One plane is made per
    altloc letter found on any of the plane's atoms (``""`` when there is none); each
    takes that letter's atom where an atom has altlocs and the no-altloc atom otherwise.
    ``atoms`` is a list of (index, position); ``missing`` the required names not found.
    """
    letters = sorted(
        {alt for res, req, opt in parts for n in (*req, *opt) for alt, _, _ in res.atoms.get(n, ()) if alt}
    )
    for letter in letters or [""]:
        atoms, missing = [], []
        for res, req, opt in parts:
            for name, required in [(n, True) for n in req] + [(n, False) for n in opt]:
                candidates = res.atoms.get(name, ())
                pick = next((a for a in candidates if a[0] == letter), None)
                if pick is None:
                    pick = next((a for a in candidates if a[0] == ""), None)
                if pick is None:
                    if required:
                        missing.append(name)
                    continue
                atoms.append((pick[1], pick[2]))
        yield letter, atoms, missing


def _omega(ca1, c1, n2, ca2) -> float:
    """The CA-C-N-CA dihedral in degrees."""
    b0, b1, b2 = np.subtract(c1, ca1), np.subtract(n2, c1), np.subtract(ca2, n2)
    n1, n2_ = np.cross(b0, b1), np.cross(b1, b2)
    m1 = np.cross(n1, b1 / np.linalg.norm(b1))
    return math.degrees(math.atan2(float(np.dot(m1, n2_)), float(np.dot(n1, n2_))))


@functools.cache
def _is_amino_acid(name: str) -> bool:
    import gemmi

    info = gemmi.find_tabulated_residue(name)
    return info is not None and info.is_amino_acid()


def find_planes(model, *, sigma: float = DEFAULT_SIGMA, monomer_library: str | os.PathLike | None = None) -> PlaneSet:
    """Find the planar groups of a model's standard residues.

    Planes found:

    - peptide planes between consecutive amino acids of a chain whose C(i)–N(i+1)
      distance is ≤ 2.0 Å: CA(i), C(i), O(i), N(i+1), CA(i+1), plus H(i+1) when present
      and CD(i+1) when residue i+1 is a proline (its CD is bonded to N). The plane is
      ``"cis-peptide"`` when |ω(CA-C-N-CA)| < 30°, else ``"trans-peptide"``;
    - the rings of PHE, TYR (with OH), TRP and HIS, each with CB; the ARG guanidinium
      (CD, NE, CZ, NH1, NH2); the ASN/GLN amide and ASP/GLU carboxylate groups with the
      carbon they hang on; the bases of DA/DC/DG/DT/DU/A/C/G/U with C1' (see
      :data:`PLANE_DEFINITIONS`). Hydrogens that lie in a plane are added when present;
    - for any other residue (not water), the plane restraints of its chem_comp in a CCP4
      monomer library, when one is given (``monomer_library=`` or ``$CLIBD_MON``), with
      the library's σ. Without a library, only the built-in planes.

    Alternative conformations: one plane is made for each altloc letter present on any
    of the plane's atoms; it uses that conformer's atom where an atom has altlocs and
    the shared no-altloc atom otherwise (so shared atoms are restrained once per
    conformer's plane). A plane with no altloc atoms is made once. Residues with the
    same sequence number (microheterogeneity) are merged before this, by atom name.

    A plane with a required atom missing (in a conformer) is not made; it is counted in
    :attr:`PlaneSet.skipped` under ``"<kind>: missing atoms"`` and listed in
    :attr:`PlaneSet.skipped_details`. Consecutive amino acids that are not bonded count
    under ``"peptide: chain break"``.

    Parameters
    ----------
    model : kernels.Model
        A model from :func:`kernels.read_model`; its ``structure`` lists atoms in the
        order of ``model.atoms``.
    sigma : float
        σ (Å) of every atom of the built-in planes.
    monomer_library : str or path-like, optional
        A CCP4 monomer library directory (with ``list/mon_lib_list.cif``); default
        ``$CLIBD_MON`` if set, else none.

    Returns
    -------
    PlaneSet
        Indices into ``model.atoms`` (int32) and σ (float64), padded to the largest plane.

    Raises
    ------
    ValueError
        ``sigma`` is not a positive number, or ``monomer_library`` was given and cannot be
        read (the message says what gemmi reported).
    """
    sigma = positive_number(sigma, "sigma", "Å")
    st = model.structure
    n_atoms = len(model.atoms)

    # Merge residues by (chain, seqid), keeping chain order; indices follow model.atoms.
    chains: list[list[_Residue]] = []
    index = 0
    for chain in st[0]:
        residues: dict[str, _Residue] = {}
        for res in chain:
            key = str(res.seqid)
            if key not in residues:
                residues[key] = _Residue(chain.name, key)
            for atom in res:
                residues[key].add(res.name, atom, index)
                index += 1
        chains.append(list(residues.values()))
    if index != n_atoms:
        raise ValueError(
            f"model.structure has {index} atoms but model.atoms has {n_atoms}: pass a Model from kernels.read_model"
        )

    planes: list[list[int]] = []
    sigmas: list[list[float]] = []
    kinds: list[str] = []
    where: list[str] = []
    skipped: Counter = Counter()
    details: list[str] = []

    def add(kind, label, letter, atoms, missing, sig, reason_kind=None):
        alt = f" altloc {letter}" if letter else ""
        if missing:
            reason = f"{reason_kind or kind}: missing atoms"
            skipped[reason] += 1
            details.append(f"{label}{alt}: {kind} plane skipped, missing {' '.join(missing)}")
            return
        idx = [a[0] for a in atoms]
        if len(idx) < 3:
            return
        planes.append(idx)
        sigmas.append([sig] * len(idx) if isinstance(sig, float) else list(sig))
        kinds.append(kind)
        where.append(f"{label}{alt}")

    # Peptide planes.
    for residues in chains:
        for r1, r2 in zip(residues, residues[1:]):
            if not (any(_is_amino_acid(n) for n in r1.names) and any(_is_amino_acid(n) for n in r2.names)):
                continue
            opt2 = ("H", "CD") if "PRO" in r2.names else ("H",)
            label = f"{r1.label}-{r2.label}"
            for letter, atoms, missing in _conformers([(r1, ("CA", "C", "O"), ()), (r2, ("N", "CA"), opt2)]):
                if not missing:
                    ca1, c1, _, n2, ca2 = (a[1] for a in atoms[:5])
                    if math.dist(c1, n2) > PEPTIDE_BOND_MAX:
                        skipped["peptide: chain break"] += 1
                        details.append(f"{label}: no peptide plane, C-N {math.dist(c1, n2):.2f} Å (chain break)")
                        continue
                    kind = "cis-peptide" if abs(_omega(ca1, c1, n2, ca2)) < 30.0 else "trans-peptide"
                    # Proline CD belongs to the plane only when it is bonded to N (it always is).
                    add(kind, label, letter, atoms, missing, float(sigma))
                else:
                    add("peptide", label, letter, atoms, missing, float(sigma))

    # Side chains and bases; other residues from the monomer library.
    others: dict[str, list[_Residue]] = {}
    for residues in chains:
        for res in residues:
            for name in res.names:
                if name in PLANE_DEFINITIONS:
                    req, opt = PLANE_DEFINITIONS[name]
                    for letter, atoms, missing in _conformers([(res, req, opt)]):
                        add(name, res.label, letter, atoms, missing, float(sigma))
                elif name not in _WATER:
                    others.setdefault(name, []).append(res)

    library = _read_monomer_library(monomer_library, sorted(others))
    if library is not None:
        for name, residues in others.items():
            mon = library.monomers[name] if name in library.monomers else None
            if mon is None:
                continue
            for plane in mon.rt.planes:
                names = [i.atom for i in plane.ids if i.comp == 1]
                if len(names) < 3:
                    continue
                esd = float(plane.esd) if plane.esd > 0 else float(sigma)
                for res in residues:
                    for letter, atoms, missing in _conformers([(res, names, ())]):
                        add(f"{name} {plane.label}", res.label, letter, atoms, missing, esd, reason_kind=name)

    return PlaneSet.from_lists(
        planes, sigmas, n_atoms=n_atoms, kinds=kinds, where=where, skipped=dict(skipped), skipped_details=details
    )


def _read_monomer_library(path, names: list[str]):
    """gemmi.MonLib with ``names`` (those it has), or None when no library is configured."""
    explicit = path is not None
    if path is None:
        path = os.environ.get("CLIBD_MON")
    if not path or not names:
        return None
    import gemmi

    path = Path(path)
    try:
        return gemmi.read_monomer_lib(str(path), names, ignore_missing=True)
    except Exception as exc:  # gemmi raises OSError/RuntimeError with its own message
        where = "monomer_library" if explicit else "$CLIBD_MON"
        message = (
            f"{where} = {str(path)!r} cannot be read as a CCP4 monomer library ({exc}); point it at the "
            "directory that holds list/mon_lib_list.cif and ener_lib.cif"
        )
        if explicit:
            raise ValueError(message) from exc
        # An environment variable left over from another setup should not stop plane finding.
        warn_once(("planarity-monlib", str(path)), message + ", or unset it; using the built-in planes only")
        return None


def live_plane_set(token: str) -> PlaneSet:
    """The live PlaneSet whose ``_token`` is ``token`` (KeyError when it is gone)."""
    return _live[token]


def check_inputs(xyz, planes) -> None:
    """Raise ``ValueError``/``TypeError`` unless ``xyz`` is an (N, 3) floating tensor and
    ``planes`` a PlaneSet found on N atoms (host-side shape checks only, no device sync)."""
    if not isinstance(planes, PlaneSet):
        raise TypeError(f"planes must be a kernels.PlaneSet (from kernels.find_planes), got {type(planes).__name__}")
    if not isinstance(xyz, torch.Tensor) or xyz.ndim != 2 or xyz.shape[1] != 3 or not xyz.dtype.is_floating_point:
        got = f"{tuple(xyz.shape)} {xyz.dtype}" if isinstance(xyz, torch.Tensor) else type(xyz).__name__
        raise ValueError(f"xyz must be a floating tensor of shape (N, 3), got {got}")
    if xyz.shape[0] != planes.n_atoms:
        raise ValueError(
            f"xyz has {xyz.shape[0]} atoms but the planes were found on a model with {planes.n_atoms}: "
            "pass the positions of that model's atoms (model.atoms.xyz), in the same order"
        )
