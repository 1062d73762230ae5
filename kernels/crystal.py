"""Unit cells, map grids and reading an atomic model into atom tensors.

Everything that enters a kernel passes through here: :func:`read_model` turns a PDB or
mmCIF file (read by gemmi) into a :class:`Model` whose :class:`AtomSet` holds float64
torch tensors, validated on the host; :class:`Cell` carries the fractional/Cartesian
matrices; :class:`GridSpec` says where each voxel of a map sits.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import math
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from kernels._util import file_problem, positive_number, real_number

#: B (Å²) below which an atom's displacement is less than zero-point motion gives any atom
#: (U < 0.006 Å²): such a B is a mistake in the data, and AtomSet warns about it.
MIN_PHYSICAL_B = 0.5

#: The most text (bytes after decompressing) :func:`read_model` reads unless ``max_bytes`` says more.
MAX_MODEL_BYTES = 2 * 2**30

__all__ = [
    "AtomLabel",
    "AtomSet",
    "Cell",
    "GridError",
    "GridSpec",
    "Model",
    "ModelError",
    "example_structure",
    "read_model",
]

MODEL_SUFFIXES = (".pdb", ".ent", ".cif", ".mmcif")
_DATA_DIR = Path(__file__).resolve().parent / "data"
_EXAMPLES = {"1orc": "1orc.pdb.gz", "1pfe": "1pfe.cif.gz", "1aki": "1aki.cif.gz"}


class ModelError(ValueError):
    """A model file cannot be turned into atoms: the message names the file and the problem."""


class GridError(ValueError):
    """A grid is malformed, or its map would not fit in the memory of the device asked for."""


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


# --------------------------------------------------------------------------- cells


def _cell_problem(params: Sequence[float]) -> str | None:
    """Why six cell parameters make no unit cell, or None when they make one."""
    names = ("a", "b", "c", "α", "β", "γ")
    for name, p in zip(names, params):
        if not math.isfinite(p):
            return f"{name} = {p} is not a finite number"
    for name, p in zip(names[:3], params[:3]):
        if p <= 0:
            return f"the cell length {name} = {p:g} Å must be positive"
    for name, p in zip(names[3:], params[3:]):
        if not 0 < p < 180:
            return f"the angle {name} = {p:g}° must lie strictly between 0° and 180°"
    # Three unit vectors with these pairwise angles exist iff the angles sum to less than
    # 360° and each is less than the sum of the other two (the volume factor is then > 0).
    al, be, ga = params[3:]
    if al + be + ga >= 360:
        return f"the angles sum to {al + be + ga:g}° (must be < 360°), so no cell has them"
    for name, x, y, z in (("α", al, be, ga), ("β", be, al, ga), ("γ", ga, al, be)):
        if x >= y + z:
            return (
                f"the angle {name} = {x:g}° is not less than the sum of the other two ({y + z:g}°), so no cell has them"
            )
    ca, cb, cg = (math.cos(math.radians(t)) for t in (al, be, ga))
    if 1 - ca * ca - cb * cb - cg * cg + 2 * ca * cb * cg < 1e-9:
        return "the angles make a flat cell (volume ≈ 0)"
    return None


def _format_cell(params: Sequence[float]) -> str:
    a, b, c, al, be, ga = params
    return f"a={a:g} b={b:g} c={c:g} Å, α={al:g} β={be:g} γ={ga:g}°"


@dataclasses.dataclass(frozen=True, eq=False)
class Cell:
    """A unit cell: six parameters and the matrices kernels use.

    Two cells are equal when their parameters and matrices are equal (a value, like a
    tuple); the hash is that of the parameters, so equal cells hash alike.

    Attributes
    ----------
    parameters : tuple of 6 float
        a, b, c in Å and α, β, γ in degrees.
    orth : torch.Tensor, shape (3, 3), float64
        Fractional → Cartesian; its columns are the cell vectors a, b, c (gemmi's
        convention: upper triangular, a along x).
    frac : torch.Tensor, shape (3, 3), float64
        Cartesian → fractional, ``orth⁻¹``.
    metric : torch.Tensor, shape (3, 3), float64
        ``G = orthᵀ·orth``: squared length of a fractional difference d is ``dᵀ G d``.
    """

    parameters: tuple[float, float, float, float, float, float]
    orth: torch.Tensor
    frac: torch.Tensor
    metric: torch.Tensor

    @classmethod
    def from_parameters(
        cls, a: float, b: float, c: float, alpha: float = 90.0, beta: float = 90.0, gamma: float = 90.0
    ) -> Cell:
        """Cell from lengths (Å) and angles (degrees), in gemmi's orientation convention.

        Parameters
        ----------
        a, b, c : float
            Cell lengths in Å, finite and positive (Python, numpy or 0-d torch real scalars).
        alpha, beta, gamma : float
            Angles in degrees, each in (0°, 180°), summing to < 360°, each less than the
            sum of the other two (otherwise no cell has them).

        Raises
        ------
        ValueError
            Saying which parameter is wrong and why, with all six values.
        """
        import gemmi

        names = ("a", "b", "c", "alpha", "beta", "gamma")
        params = tuple(real_number(v, f"cell {n}") for n, v in zip(names, (a, b, c, alpha, beta, gamma)))
        problem = _cell_problem(params)
        if problem:
            raise ValueError(f"impossible unit cell ({_format_cell(params)}): {problem}")
        return cls.from_gemmi(gemmi.UnitCell(*params))

    @classmethod
    def from_gemmi(cls, unit_cell) -> Cell:
        """Cell from a ``gemmi.UnitCell`` (its parameters are checked as in :meth:`from_parameters`)."""
        params = tuple(float(p) for p in unit_cell.parameters)
        problem = _cell_problem(params)
        if problem:
            raise ValueError(f"impossible unit cell ({_format_cell(params)}): {problem}")
        orth = torch.tensor(unit_cell.orth.mat.tolist(), dtype=torch.float64)
        if not torch.isfinite(orth).all() or abs(float(torch.linalg.det(orth))) < 1e-6:
            raise ValueError(f"degenerate unit cell ({_format_cell(params)}): its matrices are singular")
        frac = torch.linalg.inv(orth)
        return cls(params, orth, frac, orth.T @ orth)

    def __eq__(self, other) -> bool:
        if not isinstance(other, Cell):
            return NotImplemented
        return self.parameters == other.parameters and torch.equal(self.orth, other.orth)

    def __hash__(self) -> int:
        return hash(self.parameters)

    def to_gemmi(self):
        """The same cell as a ``gemmi.UnitCell``."""
        import gemmi

        return gemmi.UnitCell(*self.parameters)

    @property
    def volume(self) -> float:
        """Cell volume in Å³."""
        return abs(float(torch.linalg.det(self.orth)))

    # Derived once per cell (the fast kernels ask on every call); a Cell is immutable.
    @functools.cached_property
    def reciprocal_lengths(self) -> tuple[float, float, float]:
        """|a*|, |b*|, |c*| in 1/Å: the inverse spacings of the lattice planes."""
        return tuple(float(v) for v in torch.linalg.norm(self.frac, dim=1))

    @functools.cached_property
    def kind(self) -> str:
        """Which metric cross terms the cell has, as the separable kernels see it.

        ``"orthogonal"`` (G diagonal), ``"monoclinic"`` (only G13, the a–c pair couples),
        ``"hexagonal"`` (only G12, the a–b pair couples) or ``"triclinic"`` (anything else).
        """
        g = self.metric
        scale = float(g.diagonal().max())
        off = [abs(float(g[i, j])) > 1e-9 * scale for i, j in ((0, 1), (0, 2), (1, 2))]
        if not any(off):
            return "orthogonal"
        if off == [False, True, False]:
            return "monoclinic"
        if off == [True, False, False]:
            return "hexagonal"
        return "triclinic"

    def __repr__(self) -> str:
        a, b, c, al, be, ga = self.parameters
        return f"Cell({a:g}, {b:g}, {c:g}, {al:g}, {be:g}, {ga:g})"


# --------------------------------------------------------------------------- grids


def _has_small_factors(n: int) -> bool:
    for p in (2, 3, 5):
        while n % p == 0:
            n //= p
    return n == 1


@dataclasses.dataclass(frozen=True)
class GridSpec:
    """Where each voxel of a map sits in a unit cell.

    The cell is sampled ``sampling = (mx, my, mz)`` times along a, b, c. A map on this
    grid has ``shape = (nx, ny, nz)`` voxels starting at voxel ``origin``; voxel
    (i, j, k) of the map sits at fractional position
    ``((origin[0] + i) / mx, (origin[1] + j) / my, (origin[2] + k) / mz)``.
    With the default origin (0, 0, 0) and ``sampling = shape`` the map covers the whole
    cell, which is what crystal maps and the periodic kernels use; a box map (a region
    inside or across cells, as bounded interpolation needs) has its own shape and origin.

    Parameters
    ----------
    cell : Cell
    shape : tuple of 3 int
        Voxels of the map along a, b, c.
    origin : tuple of 3 int, optional
        Voxel index (in the cell's sampling) of the map's first voxel.
    sampling : tuple of 3 int, optional
        Voxels per cell edge; defaults to ``shape``.

    Grids compare and hash by value (cell, shape, origin, sampling).
    """

    cell: Cell
    shape: tuple[int, int, int]
    origin: tuple[int, int, int] = (0, 0, 0)
    sampling: tuple[int, int, int] | None = None

    def __post_init__(self):
        shape = tuple(int(n) for n in self.shape)
        origin = tuple(int(o) for o in self.origin)
        sampling = shape if self.sampling is None else tuple(int(m) for m in self.sampling)
        if len(shape) != 3 or len(origin) != 3 or len(sampling) != 3:
            raise GridError(f"shape, origin and sampling need 3 values each, got {shape}, {origin}, {sampling}")
        if min(shape) < 1 or min(sampling) < 1:
            raise GridError(f"grid shape and sampling must be positive, got shape {shape}, sampling {sampling}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "origin", origin)
        object.__setattr__(self, "sampling", sampling)

    @classmethod
    def for_spacing(cls, cell: Cell, spacing: float, spacegroup: str | None = None) -> GridSpec:
        """The whole-cell grid gemmi picks for a requested spacing.

        Follows gemmi's rule (``Grid.set_size_from_spacing`` rounding up): along each
        axis at least ``edge / spacing`` voxels, rounded up to an even multiple of the
        space group's grid factor times a product of 2, 3 and 5, with symmetry-related
        (or nearly equal) axes sharing a size. So a map made here lines up voxel for
        voxel with gemmi's ``DensityCalculatorX`` at ``spacing = d_min / (2·rate)``.

        Parameters
        ----------
        cell : Cell
        spacing : float
            Requested voxel spacing in Å (an upper bound: the grid is at least this fine).
        spacegroup : str, optional
            Hermann–Mauguin name; the grid is then compatible with its operators
            (needed by :func:`kernels.symmetrize`). P 1 when omitted.
        """
        import gemmi

        try:
            spacing = positive_number(spacing, "spacing", "Å")
        except ValueError as exc:
            raise GridError(f"grid {exc}") from None
        if spacegroup is None:
            ops = gemmi.find_spacegroup_by_name("P 1").operations()
        else:
            sg = gemmi.find_spacegroup_by_name(spacegroup)
            if sg is None:
                raise GridError(f"unknown space group {spacegroup!r}")
            ops = sg.operations()
        factors = list(ops.find_grid_factors())
        limits = [edge / spacing for edge in cell.parameters[:3]]
        if max(limits) > 1e6:
            raise GridError(f"spacing {spacing} Å on cell {cell} asks for over a million voxels per axis")
        # Symmetry-related axes must share a size; nearly equal ones share it for looks.
        same_as = [None, None, None]
        for i in range(1, 3):
            for j in range(i):
                if _directions_related(ops, i, j) or (abs(limits[i] - limits[j]) < 0.5 and factors[i] == factors[j]):
                    limits[j] = max(limits[i], limits[j])
                    same_as[i] = j
                    factors[i] = -1 - j
        sizes = [0, 0, 0]
        for i in range(3):
            if same_as[i] is not None:
                sizes[i] = sizes[same_as[i]]
                continue
            f = factors[i] if factors[i] % 2 == 0 else 2 * factors[i]
            n = max(int(math.ceil(limits[i] / f)), 1)
            while not _has_small_factors(n):
                n += 1
            sizes[i] = n * f
        return cls(cell, tuple(sizes))

    @property
    def n_voxels(self) -> int:
        """Number of voxels in the map, ``nx·ny·nz``."""
        nx, ny, nz = self.shape
        return nx * ny * nz

    @property
    def is_whole_cell(self) -> bool:
        """True when the map covers the cell exactly once (origin 0, shape = sampling)."""
        return self.origin == (0, 0, 0) and self.shape == self.sampling

    @property
    def spacing(self) -> tuple[float, float, float]:
        """Distance between voxel planes along each axis in Å (gemmi's ``Grid.spacing``)."""
        return tuple(1.0 / (m * r) for m, r in zip(self.sampling, self.cell.reciprocal_lengths))

    @property
    def voxel_volume(self) -> float:
        """Volume of one voxel in Å³ (a map's sum times this is its number of electrons)."""
        mx, my, mz = self.sampling
        return self.cell.volume / (mx * my * mz)

    def voxel_fractional(self) -> torch.Tensor:
        """Fractional coordinates of every voxel, shape (nx, ny, nz, 3), float64."""
        axes = [
            (torch.arange(n, dtype=torch.float64) + o) / m for n, o, m in zip(self.shape, self.origin, self.sampling)
        ]
        return torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1)

    def voxel_positions(self) -> torch.Tensor:
        """Cartesian coordinates of every voxel in Å, shape (nx, ny, nz, 3), float64."""
        return self.voxel_fractional() @ self.cell.orth.T

    def require_memory(
        self,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        copies: int = 1,
        extra_bytes: int = 0,
    ):
        """Raise :class:`GridError` if ``copies`` maps of this grid plus ``extra_bytes`` would not fit on ``device``.

        Called before any map is allocated, so a grid that is too fine fails with a
        message instead of taking the machine down. Each operation passes what it really
        allocates at its peak (maps and temporaries; see docs/kernels.md, "Memory").
        """
        itemsize = torch.empty((), dtype=dtype).element_size()
        need = self.n_voxels * itemsize * copies + int(extra_bytes)
        free = _free_memory(torch.device(device))
        if need > 0.8 * free:
            what = f"{copies} cop{'y' if copies == 1 else 'ies'}" if copies else "output and temporaries"
            if copies and extra_bytes:
                what += f" and {_size(extra_bytes)} of temporaries"
            raise GridError(
                f"a {self.shape[0]}×{self.shape[1]}×{self.shape[2]} map in {dtype} needs {_size(need)} ({what}) "
                f"but only {_size(free)} is free on {device}: use a coarser grid spacing"
            )

    def __repr__(self) -> str:
        extra = "" if self.is_whole_cell else f", origin={self.origin}, sampling={self.sampling}"
        return f"GridSpec({self.cell!r}, shape={self.shape}{extra})"


def _size(n_bytes: float) -> str:
    """A byte count for a message: GiB from 1 GiB, MiB below."""
    return f"{n_bytes / 2**30:.2f} GiB" if n_bytes >= 2**30 else f"{n_bytes / 2**20:.1f} MiB"


def _directions_related(ops, i: int, j: int) -> bool:
    """True when a rotation of the space group maps axis i onto axis j (e.g. a and b in P 3)."""
    for op in ops.sym_ops:
        rot = op.rot
        # column i of the rotation is the image of axis i
        col = [rot[k][i] for k in range(3)]
        if all((k == j) == (col[k] != 0) for k in range(3)):
            return True
    return False


def _free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 1 << 40


# --------------------------------------------------------------------------- atoms


class AtomLabel(NamedTuple):
    """Where an atom comes from in the model file."""

    chain: str
    res_name: str
    seq_num: int
    icode: str
    atom_name: str
    altloc: str

    def __str__(self) -> str:
        alt = f" altloc {self.altloc}" if self.altloc else ""
        icode = self.icode.strip()
        return f"{self.chain}/{self.res_name} {self.seq_num}{icode}/{self.atom_name}{alt}"


class _LazySequence(Sequence):
    """A read-only sequence whose items are made when asked for, never all at once.

    An AtomSet built from tensors in a loop must not cost per-atom Python work: its default labels
    and element symbols, and the F·N labels of a flattened ensemble, are sequences of this kind. They
    compare equal to any sequence with the same items, as a tuple would.
    """

    __slots__ = ()

    @abc.abstractmethod
    def _item(self, index: int):
        """Item ``index`` (0 ≤ index < len), made on demand."""

    def __getitem__(self, index):
        if isinstance(index, slice):
            return tuple(self._item(i) for i in range(*index.indices(len(self))))
        index = int(index)
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"atom index {index} out of range for {n} atoms")
        return self._item(index)

    def __eq__(self, other) -> bool:
        if self is other:
            return True
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        if type(other) is type(self) and self._key() == other._key():
            return True
        return len(self) == len(other) and all(x == y for x, y in zip(self, other))

    __hash__ = None

    def _key(self) -> tuple:
        return (id(self),)

    def __repr__(self) -> str:
        n = len(self)
        head = ", ".join(repr(self._item(i)) for i in range(min(n, 3)))
        return f"<{n} items: {head}{', …' if n > 3 else ''}>"


class _Tiled(_LazySequence):
    """``base`` repeated ``times`` times, without building the ``len(base)·times``-long tuple.

    The element symbols ``("?",)`` of an AtomSet built without them, and the symbols and labels of
    a flattened ensemble (a tuple of 17 million labels, 1,024 frames of 3WIP, would cost more host
    time than the splat).
    """

    __slots__ = ("_base", "_n", "_times")

    def __init__(self, base: Sequence, times: int):
        self._base = base
        self._n = len(base)
        self._times = int(times)

    def __len__(self) -> int:
        return self._n * self._times

    def _item(self, index: int):
        return self._base[index % self._n]

    def _key(self) -> tuple:
        return (id(self._base), self._times) if isinstance(self._base, _LazySequence) else (self._base, self._times)


class _NumberedLabels(_LazySequence):
    """The labels of an AtomSet built without them: atom i is ``AtomLabel("", "", i + 1, "", "#i+1", "")``."""

    __slots__ = ("_n",)

    def __init__(self, n: int):
        self._n = int(n)

    def __len__(self) -> int:
        return self._n

    def _item(self, index: int) -> AtomLabel:
        return AtomLabel("", "", index + 1, "", f"#{index + 1}", "")

    def _key(self) -> tuple:
        return (self._n,)


_TENSOR_FIELDS = ("xyz", "b_iso", "occ", "a", "b")


def _warn_too_sharp(labels, idx: int, count: int, what: str, fix: str, stacklevel: int) -> None:
    """The warning for atoms displaced less than zero-point motion allows (B below ``MIN_PHYSICAL_B``)."""
    more = f" and {count - 1} more atoms" if count > 1 else ""
    warnings.warn(
        f"atom {labels[idx]} (index {idx}){more}: {what} is below {MIN_PHYSICAL_B} Å², less than zero-point "
        f"motion allows; its density is a spike narrower than any map voxel, so the map will not show it "
        f"faithfully ({fix})",
        UserWarning,
        stacklevel=stacklevel + 1,
    )


@dataclasses.dataclass(frozen=True, eq=False)
class AtomSet:
    """Atoms as tensors: what every kernel takes.

    Attributes
    ----------
    xyz : torch.Tensor, shape (N, 3)
        Cartesian positions in Å.
    b_iso : torch.Tensor, shape (N,)
        Isotropic B-factors in Å², all > 0.
    occ : torch.Tensor, shape (N,)
        Occupancies in [0, 1].
    a, b : torch.Tensor, shape (N, 5)
        Form-factor coefficients from gemmi for ``radiation``, as five Gaussians
        ρ(r) ∝ a_k·exp(−b_k s²/4): X-ray IT92 (the four Gaussians and the constant c as a fifth
        term with width 0), electron (the five Gaussians of International Tables C 4.3.2.2)
        or neutron (the coherent scattering length in fm as the first term with width 0, the
        others 0; hydrogen's length is negative).
    elements : sequence of str, length N
        Element symbols (``"?"`` for every atom when not given).
    labels : sequence of AtomLabel, length N
        Chain / residue / atom name / altloc of each atom (``#1``, ``#2``, … when not given).
    u_aniso : torch.Tensor or None, shape (N, 6)
        Anisotropic displacement tensors U11, U22, U33, U12, U13, U23 in Å², Cartesian
        (gemmi's and the ANISOU convention). Used for the atoms where ``aniso`` is True; the rows
        of the other atoms are ignored (they use ``b_iso``). ``None`` for an isotropic set.
    aniso : torch.Tensor or None, shape (N,), bool
        Which atoms use ``u_aniso`` (their ``b_iso`` is then informational only). ``None``
        exactly when ``u_aniso`` is.
    radiation : {"xray", "electron", "neutron"}
        Which scattering the coefficients describe; it sets the cutoff-radius rule (neutron
        lengths are one Gaussian, solved in closed form as gemmi does).

    Constructing an AtomSet (and :meth:`replace`, :meth:`to`) checks only what costs no
    per-atom work and reads no tensor value: shapes, one device and dtype, ``radiation``, the
    lengths of ``elements`` and ``labels``. It is a few µs whatever N, on any device, and
    never synchronises with a GPU, so an optimisation loop may build atoms on every step.
    Labels and symbols not given are made only when one is read (an error message).

    The values (finite positions, B > 0, occupancy in [0, 1], finite coefficients, finite and
    positive-definite U of the anisotropic atoms) are checked where the host reads them
    anyway, or when asked: :func:`read_model` and :meth:`from_elements` check them, the
    CPU density kernels check the atoms they splat, and :meth:`check` checks any set (one
    host synchronisation on a GPU). Each raises ``ValueError`` naming the first bad atom.
    ``AtomSet(..., _validate=True)`` runs :meth:`check` on construction.

    Two AtomSets are equal when their tensors (same dtype and device, equal values),
    elements and labels are; an AtomSet is unhashable, as its tensors can change in place.
    """

    xyz: torch.Tensor
    b_iso: torch.Tensor
    occ: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    elements: Sequence[str] = ()
    labels: Sequence[AtomLabel] = ()
    u_aniso: torch.Tensor | None = None
    aniso: torch.Tensor | None = None
    radiation: str = "xray"
    _validate: dataclasses.InitVar[bool] = False

    def __post_init__(self, _validate: bool):
        # Metadata only (no tensor value is read): this runs on every step of a fitting loop.
        xyz = self.xyz
        if not isinstance(xyz, torch.Tensor) or xyz.ndim != 2:
            self._shape_error("xyz", -1)
        n = xyz.shape[0]
        device, dtype = xyz.device, xyz.dtype
        for name, shape in (("xyz", (n, 3)), ("b_iso", (n,)), ("occ", (n,)), ("a", (n, 5)), ("b", (n, 5))):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.shape != shape:
                self._shape_error(name, n)
            if t.device != device or t.dtype != dtype:
                tensors = [getattr(self, f) for f in _TENSOR_FIELDS]
                raise ValueError(
                    f"AtomSet tensors must share one device and dtype, got { ({t.device for t in tensors}) } "
                    f"and { ({t.dtype for t in tensors}) }"
                )
        if not dtype.is_floating_point:
            raise ValueError(f"AtomSet tensors must be floating point, got {dtype}")
        if self.radiation not in RADIATIONS:
            raise ValueError(f"AtomSet.radiation must be one of {RADIATIONS}, got {self.radiation!r}")
        if (self.u_aniso is None) != (self.aniso is None):
            raise ValueError("AtomSet.u_aniso and AtomSet.aniso are given together or not at all")
        if self.u_aniso is not None:
            u, flag = self.u_aniso, self.aniso
            if not isinstance(u, torch.Tensor) or tuple(u.shape) != (n, 6):
                got = tuple(u.shape) if isinstance(u, torch.Tensor) else type(u).__name__
                raise ValueError(f"AtomSet.u_aniso must be a tensor of shape {(n, 6)} (N = {n}), got {got}")
            if not isinstance(flag, torch.Tensor) or tuple(flag.shape) != (n,) or flag.dtype != torch.bool:
                got = f"{tuple(flag.shape)} {flag.dtype}" if isinstance(flag, torch.Tensor) else type(flag).__name__
                raise ValueError(f"AtomSet.aniso must be a bool tensor of shape {(n,)} (N = {n}), got {got}")
            if u.device != device or u.dtype != dtype or flag.device != device:
                raise ValueError(
                    "AtomSet.u_aniso must share the device and dtype of the other tensors, and aniso their device"
                )
        if not len(self.elements):
            object.__setattr__(self, "elements", _Tiled(("?",), n))
        if not len(self.labels):
            object.__setattr__(self, "labels", _NumberedLabels(n))
        if len(self.elements) != n or len(self.labels) != n:
            raise ValueError(
                f"AtomSet needs {n} element symbols and labels, got {len(self.elements)} and {len(self.labels)}"
            )
        if _validate:
            self.check()

    def _shape_error(self, name: str, n: int):
        t = getattr(self, name)
        shape = {"xyz": (n, 3), "b_iso": (n,), "occ": (n,), "a": (n, 5), "b": (n, 5)}[name]
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"AtomSet.{name} must be a tensor of shape {shape} (N = {n}), got {got}")

    def check(self, *, warn: bool = True) -> AtomSet:
        """Check the values: raise ``ValueError`` naming the first bad atom; return ``self``.

        Refused: a non-finite position (the error of :func:`kernels.check_finite`), B ≤ 0 or
        non-finite, an occupancy outside [0, 1], non-finite form-factor coefficients or a
        negative width, an anisotropic atom whose U is not finite and positive definite.
        With ``warn``, a B below ``MIN_PHYSICAL_B`` (less than zero-point motion allows)
        gives a ``UserWarning`` naming the atom.

        The usual case costs a few reductions and one read of their results: a few µs for
        10⁴ CPU atoms; on a GPU, one host synchronisation (call it where the loop
        synchronises anyway, or once before it). The atom is found only when a check fails.

        Returns
        -------
        AtomSet
            ``self``, so that ``atoms = AtomSet(...).check()`` reads as one step.
        """
        self._check_values(warn)
        if self.u_aniso is not None and len(self):
            from kernels.density.adp import U_TO_B, bad_adp, first_bad_adp

            found = bad_adp(self.u_aniso, self.aniso)
            bad = first_bad_adp(self.u_aniso, self.aniso, found)
            if bad is not None:
                idx, count, what = bad
                more = f" ({count - 1} more atoms too)" if count > 1 else ""
                raise ValueError(
                    f"atom {self.labels[idx]} (index {idx}) {what}{more}; read the model with adp='iso', or "
                    "on_bad_adp='iso' to fall back to B_iso for such atoms"
                )
            if warn:
                # An anisotropic atom's density follows U (its b_iso is informational): the same floor
                # applies to U's narrowest direction, B = 8π²·λmin.
                thin = self.aniso.detach().cpu().numpy() & (found[2][:, 0].numpy() * U_TO_B < MIN_PHYSICAL_B)
                if thin.any():
                    idx = int(np.flatnonzero(thin)[0])
                    lam = float(found[2][idx, 0])
                    _warn_too_sharp(
                        self.labels,
                        idx,
                        int(thin.sum()),
                        f"B along its U's narrowest axis, 8π² × {lam:.3g} Å² = {lam * U_TO_B:.3g} Å²,",
                        "check the U values (Å²; PDB ANISOU gives them in 10⁻⁴ Å²)",
                        stacklevel=2,
                    )
        return self

    def _check_values(self, warn: bool = False, *, physical: bool = True) -> None:
        """:meth:`check` but for the anisotropic U, which the density backends check in their own way.

        ``physical=False`` is what the density kernels need to splat, as they check CPU atoms on
        every call: finite positions, coefficients and occupancies, and B > 0 where an atom is
        splatted at its B. It lets an optimiser's occupancy pass 1 (a Gaussian scaled by 1.0001 is a
        density) and ignores the informational B of anisotropic atoms.
        """
        if len(self) == 0:
            return
        with torch.no_grad():
            x, b, o = self.xyz.detach(), self.b_iso.detach(), self.occ.detach()
            ca, cb = self.a.detach(), self.b.detach()
            b_used = b if physical or self.aniso is None else b.masked_fill(self.aniso, 1.0)
            # Reductions whose results say "all good" (NaN fails every comparison below), read at once.
            summary = torch.stack(
                [
                    x.abs().amax(),
                    b_used.amin(),
                    b_used.amax(),
                    o.amin(),
                    o.amax(),
                    ca.abs().amax(),
                    cb.amin(),
                    cb.amax(),
                ]
            ).tolist()
        x_max, b_min, b_max, o_min, o_max, a_max, w_min, w_max = summary
        if not x_max < math.inf:
            from kernels.density.positions import check_finite

            check_finite(self)
        if not (0 < b_min and b_max < math.inf):
            bad = ~(torch.isfinite(b_used) & (b_used > 0))
            self._raise_first(bad, "has B ≤ 0 or non-finite B", lambda i: float(b[i]))
        if physical and not (0 <= o_min and o_max <= 1):
            bad = ~(torch.isfinite(o) & (o >= 0) & (o <= 1))
            self._raise_first(bad, "has an occupancy outside [0, 1]", lambda i: float(o[i]))
        if not physical and not (-math.inf < o_min and o_max < math.inf):
            self._raise_first(~torch.isfinite(o), "has a non-finite occupancy", lambda i: float(o[i]))
        if not (a_max < math.inf and 0 <= w_min and w_max < math.inf):
            raise ValueError("form-factor coefficients must be finite with widths b ≥ 0")
        if warn and b_min < MIN_PHYSICAL_B:
            tiny = b < MIN_PHYSICAL_B
            if self.aniso is not None:
                tiny &= ~self.aniso
            tiny = tiny.cpu()
            if tiny.any():
                idx = int(tiny.nonzero()[0, 0])
                _warn_too_sharp(
                    self.labels,
                    idx,
                    int(tiny.sum()),
                    f"B = {float(b[idx]):.3g} Å²",
                    "check the B column or the B offset",
                    stacklevel=3,
                )

    def _raise_first(self, bad: torch.Tensor, what: str, value) -> None:
        bad = bad.cpu()
        idx = int(bad.nonzero()[0, 0])
        count = int(bad.sum())
        more = f" ({count - 1} more atoms too)" if count > 1 else ""
        raise ValueError(f"atom {self.labels[idx]} (index {idx}) {what}: {value(idx)}{more}")

    def __len__(self) -> int:
        return self.xyz.shape[0]

    def __eq__(self, other) -> bool:
        if not isinstance(other, AtomSet):
            return NotImplemented
        names = ("xyz", "b_iso", "occ", "a", "b")
        if (self.u_aniso is None) != (other.u_aniso is None):
            return False
        if self.u_aniso is not None:
            names += ("u_aniso", "aniso")
        return (
            self.elements == other.elements
            and self.labels == other.labels
            and self.radiation == other.radiation
            and self.dtype == other.dtype
            and self.device == other.device
            and all(torch.equal(getattr(self, n), getattr(other, n)) for n in names)
        )

    __hash__ = None

    @property
    def device(self) -> torch.device:
        """The device all the tensors live on (picks CPU or GPU kernels)."""
        return self.xyz.device

    @property
    def dtype(self) -> torch.dtype:
        """The floating dtype of all the tensors."""
        return self.xyz.dtype

    def to(self, device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> AtomSet:
        """Copy to another device and/or floating dtype (no re-validation: values are unchanged)."""
        kw = {}
        if device is not None:
            kw["device"] = device
        if dtype is not None:
            kw["dtype"] = dtype
        moved = {name: getattr(self, name).to(**kw) for name in ("xyz", "b_iso", "occ", "a", "b")}
        if self.u_aniso is not None:
            moved["u_aniso"] = self.u_aniso.to(**kw)
            moved["aniso"] = self.aniso.to(device=kw.get("device", self.aniso.device))
        return AtomSet(**moved, elements=self.elements, labels=self.labels, radiation=self.radiation, _validate=False)

    def replace(self, **changes) -> AtomSet:
        """A new AtomSet with some fields replaced, e.g. ``replace(xyz=x)`` in a fitting loop.

        As cheap as the constructor (no value is read; the labels and symbols are shared, not
        copied); call :meth:`check` on the result, or pass ``_validate=True``, to check the values.

        ``replace(u_aniso=None, aniso=None)`` gives the isotropic set (every atom at its ``b_iso``).
        """
        fields = {name: getattr(self, name) for name in _FIELDS}
        fields.update(changes)
        return AtomSet(**fields)

    @property
    def is_anisotropic(self) -> bool:
        """Whether the set carries anisotropic displacement tensors (``u_aniso`` is not None)."""
        return self.u_aniso is not None

    def select(self, index: torch.Tensor | Sequence[int]) -> AtomSet:
        """The atoms at ``index`` (integer indices or a boolean mask), in that order."""
        idx = torch.as_tensor(index, device="cpu")
        if idx.numel() == 0:
            idx = idx.to(torch.int64)
        if idx.dtype == torch.bool:
            idx = idx.nonzero().flatten()
        sel = idx.tolist()
        dev_idx = idx.to(self.device)
        names = ("xyz", "b_iso", "occ", "a", "b") + (("u_aniso", "aniso") if self.u_aniso is not None else ())
        tensors = {name: getattr(self, name)[dev_idx] for name in names}
        return AtomSet(
            **tensors,
            elements=tuple(self.elements[i] for i in sel),
            labels=tuple(self.labels[i] for i in sel),
            radiation=self.radiation,
            _validate=False,
        )

    @classmethod
    def from_elements(
        cls,
        elements: Sequence[str],
        xyz,
        b_iso,
        occ=None,
        *,
        labels: Sequence[AtomLabel] | None = None,
        dtype: torch.dtype = torch.float64,
        radiation: str = "xray",
        u_aniso=None,
    ) -> AtomSet:
        """Build atoms from element symbols, taking the form-factor coefficients from gemmi.

        Parameters
        ----------
        elements : sequence of str, length N
        xyz : array-like, shape (N, 3), Å
        b_iso : array-like, shape (N,) or scalar, Å²
        occ : array-like, shape (N,) or scalar, optional (default 1)
        labels : sequence of AtomLabel, optional
        dtype : torch.dtype
        radiation : {"xray", "electron", "neutron"}
            Which table the coefficients come from (:func:`form_factor_coefficients`).
        u_aniso : array-like, shape (N, 6), optional
            U11, U22, U33, U12, U13, U23 in Å² (Cartesian); a row of NaN marks an isotropic atom.
            Given, every other atom is anisotropic.

        Raises
        ------
        ValueError
            An element the table does not cover (named), or values :meth:`check` refuses (the
            values are host arrays here, so they are always checked).
        """
        n = len(elements)
        xyz = torch.as_tensor(np.asarray(xyz, dtype=np.float64).reshape(n, 3), dtype=dtype)
        b_iso = torch.as_tensor(np.broadcast_to(np.asarray(b_iso, dtype=np.float64), (n,)).copy(), dtype=dtype)
        occ = torch.as_tensor(
            np.broadcast_to(np.asarray(1.0 if occ is None else occ, dtype=np.float64), (n,)).copy(), dtype=dtype
        )
        labels = (
            tuple(labels)
            if labels is not None
            else tuple(AtomLabel("", "", i + 1, "", f"{el}{i + 1}", "") for i, el in enumerate(elements))
        )
        a, b = form_factor_coefficients(elements, radiation, labels)
        u = flag = None
        if u_aniso is not None:
            u_np = np.asarray(u_aniso, dtype=np.float64).reshape(n, 6)
            flag_np = ~np.isnan(u_np).all(axis=1)
            u = torch.as_tensor(np.where(flag_np[:, None], u_np, 0.0), dtype=dtype)
            flag = torch.as_tensor(flag_np)
        atoms = cls(xyz, b_iso, occ, a.to(dtype), b.to(dtype), tuple(elements), labels, u, flag, radiation=radiation)
        return atoms.check()


#: The scattering a model's coefficients can describe (``AtomSet.radiation``).
RADIATIONS = ("xray", "electron", "neutron")
_FIELDS = ("xyz", "b_iso", "occ", "a", "b", "elements", "labels", "u_aniso", "aniso", "radiation")


def form_factor_coefficients(
    elements: Sequence[str], radiation: str = "xray", labels: Sequence[AtomLabel] | None = None
):
    """Form-factor coefficients from gemmi's tables as two float64 tensors ``a (N, 5)``, ``b (N, 5)``.

    Parameters
    ----------
    elements : sequence of str, length N
    radiation : {"xray", "electron", "neutron"}
        ``xray``: IT92 (:func:`it92_coefficients`). ``electron``: the five-Gaussian fits of
        International Tables C 4.3.2.2 (gemmi's ``c4322``). ``neutron``: the coherent scattering
        length in fm (gemmi's ``neutron92``) as term 1 with width 0, terms 2–5 zero.
    labels : sequence of AtomLabel, optional
        Names the atom in the error.

    Raises
    ------
    ValueError
        ``radiation`` unknown, or the first atom whose element the table does not cover (named,
        with what to do).
    """
    import gemmi

    if radiation not in RADIATIONS:
        raise ValueError(f"radiation must be one of {RADIATIONS}, got {radiation!r}")
    if radiation == "xray":
        return it92_coefficients(elements, labels)
    table: dict[str, tuple[list[float], list[float]] | None] = {}
    a = np.zeros((len(elements), 5))
    b = np.zeros((len(elements), 5))
    for i, symbol in enumerate(elements):
        if symbol not in table:
            el = gemmi.Element(symbol)
            entry = None
            if el.atomic_number > 0:
                if radiation == "electron" and el.c4322 is not None and any(el.c4322.a):
                    entry = (list(el.c4322.a), list(el.c4322.b))
                elif radiation == "neutron" and el.neutron92 is not None:
                    length = el.neutron92.get_coefs()[0]
                    if length != 0:
                        entry = ([length, 0.0, 0.0, 0.0, 0.0], [0.0] * 5)
            table[symbol] = entry
        entry = table[symbol]
        if entry is None:
            who = f"atom {labels[i]}" if labels else f"atom {i}"
            what = (
                "electron form factor (International Tables 4.3.2.2)"
                if radiation == "electron"
                else ("neutron scattering length")
            )
            raise ValueError(
                f"{who} has element {symbol!r}, which has no {what} in gemmi: fix the element column of the "
                f"file or drop the atom before splatting a {radiation} map"
            )
        a[i], b[i] = entry
    return torch.from_numpy(a), torch.from_numpy(b)


def it92_coefficients(elements: Sequence[str], labels: Sequence[AtomLabel] | None = None):
    """IT92 coefficients from gemmi as two float64 tensors ``a (N, 5)``, ``b (N, 5)``.

    The constant c is the fifth term, with width 0. Raises ``ValueError`` naming the
    first atom whose element gemmi does not know or has no IT92 entry for.
    """
    import gemmi

    table: dict[str, tuple[list[float], list[float]]] = {}
    a = np.zeros((len(elements), 5))
    b = np.zeros((len(elements), 5))
    for i, symbol in enumerate(elements):
        if symbol not in table:
            el = gemmi.Element(symbol)
            coef = el.it92 if el.atomic_number > 0 else None
            if coef is None or not any(coef.a):
                who = f"atom {labels[i]}" if labels else f"atom {i}"
                raise ValueError(
                    f"{who} has element {symbol!r}, which has no IT92 form factor in gemmi: "
                    "fix the element column of the file"
                )
            table[symbol] = (list(coef.a) + [coef.c], list(coef.b) + [0.0])
        a[i], b[i] = table[symbol]
    return torch.from_numpy(a), torch.from_numpy(b)


# --------------------------------------------------------------------------- models


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
    import gemmi

    from kernels import _model_file

    path = Path(path)
    where = str(path)
    for name, value, allowed in (
        ("adp", adp, ("auto", "iso")),
        ("on_bad_adp", on_bad_adp, ("raise", "iso")),
        ("radiation", radiation, RADIATIONS),
    ):
        if value not in allowed:
            raise ModelError(f"{where}: {name} must be one of {allowed}, got {value!r}")
    problem = file_problem(path)
    if problem:
        raise ModelError(f"{where}: {problem}")
    name = path.name.lower()
    stem = name[:-3] if name.endswith(".gz") else name
    if not stem.endswith(MODEL_SUFFIXES):
        raise ModelError(f"{where}: unknown model format; expected one of {', '.join(MODEL_SUFFIXES)} (optionally .gz)")
    if not isinstance(altlocs, str) or (
        altlocs not in ("all", "first") and not (len(altlocs) == 1 and altlocs.isalnum())
    ):
        raise ModelError(f"{where}: altlocs must be 'all', 'first' or one altloc letter, got {altlocs!r}")
    index_given = model_index is not None
    model_index = 0 if model_index is None else model_index
    if isinstance(model_index, (bool, np.bool_)) or not isinstance(model_index, (int, np.integer)):
        raise ModelError(f"{where}: model_index must be an integer (0 = the first model), got {model_index!r}")
    if isinstance(max_bytes, (bool, np.bool_)) or not isinstance(max_bytes, (int, np.integer)) or max_bytes < 1:
        raise ModelError(f"{where}: max_bytes must be a positive integer (bytes of text), got {max_bytes!r}")
    if box_padding is not None:
        try:
            box_padding = positive_number(box_padding, "box_padding", "Å")
        except ValueError as exc:
            raise ModelError(f"{where}: {exc}") from None

    notes: list[str] = []
    is_cif = stem.endswith((".cif", ".mmcif"))
    data, compressed = _model_file.read_model_bytes(path, where, is_cif, max_bytes)
    cif_scan = None
    if is_cif:
        doc = _gemmi_read(where, gemmi.cif.read_string, data)
        blocks = [b for b in doc if b.find_mmcif_category("_atom_site.")]
        block = blocks[0] if blocks else doc[0]
        cif_scan = _model_file.scan_mmcif(block, where)
        raw_cell = _model_file.cif_cell_values(block, where)
        cell_source = "_cell"
    else:
        data = _model_file.unix_newlines(data)
        pdb_scan = _model_file.scan_pdb(data, where)
        if pdb_scan.stray_anisou:
            _stray_anisou([m for _, _, m in pdb_scan.stray_anisou], where, on_bad_adp, notes)
            data = _model_file.drop_records(data, pdb_scan.stray_anisou)
        raw_cell = pdb_scan.cell
        cell_source = "CRYST1"
    # A cell no crystal has is refused before gemmi sees it (gemmi stops at some, not others).
    if raw_cell is not None and raw_cell[:3] != (1.0, 1.0, 1.0):
        problem = _cell_problem(raw_cell)
        if problem:
            raise ModelError(
                f"{where}: impossible unit cell in {cell_source} ({_format_cell(raw_cell)}): {problem}. Fix "
                f"{cell_source}; for a model without a cell remove it and pass box_padding=<Å> (--box-padding) "
                "for a P 1 box"
            )
    if is_cif:
        st = _gemmi_read(where, gemmi.make_structure_from_block, block)
        if cif_scan.stray_anisou:
            _stray_anisou([m for _, m in cif_scan.stray_anisou], where, on_bad_adp, notes)
            _clear_aniso(st, {i for i, _ in cif_scan.stray_anisou if i is not None})
    else:
        if pdb_scan.pad_short_lines:
            data = _model_file.pad_short_atom_lines(data)
        st = _gemmi_read(where, gemmi.read_pdb_string, data)
    st.merge_chain_parts()
    if len(st) == 0:
        rows = f" from the {cif_scan.n_rows} rows of its _atom_site table" if cif_scan else ""
        raise ModelError(f"{where}: gemmi read no atoms{rows}: the file has no models")
    if not 0 <= model_index < len(st):
        raise ModelError(
            f"{where}: model_index {model_index} out of range; the file has {len(st)} model(s) "
            f"(model_index 0 to {len(st) - 1})"
        )
    n_models = len(st)
    if n_models > 1 and not index_given:
        notes.append(
            f"the file holds {n_models} models; model 1 (MODEL {st[0].num}) was read. Choose another with "
            f"model_index= (0-based; --model N, 1-based, on the command line), or splat all {n_models} as one "
            "ensemble map with kernels.splat_ensemble (workbench ensemble on the command line)"
        )
    for i in range(len(st) - 1, -1, -1):
        if i != model_index:
            del st[i]
    n_read = sum(len(res) for chain in st[0] for res in chain)
    if not water:
        st.remove_waters()
    if not hydrogens:
        st.remove_hydrogens()
    if altlocs == "first":
        st.remove_alternative_conformations()
    elif altlocs != "all":
        _keep_altloc(st, altlocs)
    st.remove_empty_chains()

    rows = []
    for chain in st[0]:
        for res in chain:
            for atom in res:
                rows.append((chain.name, res, atom))
    if not rows:
        if n_read == 0:
            raise ModelError(f"{where}: model {model_index} of the file has no atoms")
        raise ModelError(
            f"{where}: none of the {n_read} atoms of model {model_index} is left after the filters "
            f"(water={water}, hydrogens={hydrogens}, altlocs={altlocs!r}): relax them"
        )

    labels = tuple(
        AtomLabel(ch, res.name, res.seqid.num, res.seqid.icode, atom.name, atom.altloc if atom.altloc != "\0" else "")
        for ch, res, atom in rows
    )
    elements = tuple(atom.element.name for _, _, atom in rows)
    for i, (_, _, atom) in enumerate(rows):
        if atom.element.atomic_number == 0:
            # Unknown symbols written in the file were reported by the field checks; what is
            # left is a PDB atom with blank element columns whose name gemmi cannot read.
            raise ModelError(
                f"{where}: atom {labels[i]} has no element: columns 77-78 are blank and gemmi cannot tell the "
                f"element from its name {atom.name!r}; write its element symbol in columns 77-78"
            )
    xyz = np.array([atom.pos.tolist() for _, _, atom in rows], dtype=np.float64)
    occ = np.array([atom.occ for _, _, atom in rows], dtype=np.float64)
    b_iso = np.array([atom.b_iso for _, _, atom in rows], dtype=np.float64)
    if cif_scan is not None and cif_scan.occupancy_defaulted:
        n_def = cif_scan.occupancy_defaulted
        first = "" if n_def == cif_scan.n_rows else f", first {cif_scan.occupancy_first}"
        what = "no _atom_site.occupancy column" if n_def == cif_scan.n_rows else "occupancy ? or ."
        msg = f"{n_def} atom(s) have no occupancy ({what}{first}); taken as 1"
        warnings.warn(f"{where}: {msg}", stacklevel=2)
        notes.append(msg)
    # ANISOU atoms: splat the file's isotropic B (gemmi's b_iso); derive it from U only
    # where the file gives none.
    derived = 0
    for i, (_, _, atom) in enumerate(rows):
        if not b_iso[i] > 0 and atom.aniso.nonzero():
            u = atom.aniso
            b_iso[i] = 8 * math.pi**2 * (u.u11 + u.u22 + u.u33) / 3
            derived += 1
    if derived:
        msg = f"{derived} atom(s) had no isotropic B; used 8π²·trace(U)/3 from their ANISOU"
        warnings.warn(f"{where}: {msg}", stacklevel=2)
        notes.append(msg)

    shift = None
    cell_ok = raw_cell is not None and raw_cell[:3] != (1.0, 1.0, 1.0)
    if cell_ok:
        if tuple(st.cell.parameters) != tuple(raw_cell):
            st.cell = gemmi.UnitCell(*raw_cell)
        try:
            cell = Cell.from_gemmi(st.cell)
        except ValueError as exc:
            raise ModelError(f"{where}: {exc}") from exc
        spacegroup = _spacegroup(st, cell, where, cell_source, notes)
    elif box_padding is not None:
        finite = np.isfinite(xyz).all(axis=1)
        if not finite.any():
            raise ModelError(f"{where}: no atom has finite coordinates, so no box can be built around them")
        lo, hi = xyz[finite].min(axis=0), xyz[finite].max(axis=0)
        edges = hi - lo + 2 * box_padding
        cell = Cell.from_parameters(*edges)
        shift = box_padding - lo
        xyz = xyz + shift
        st.cell = cell.to_gemmi()
        st.spacegroup_hm = "P 1"
        for (_, _, atom), p in zip(rows, xyz):
            atom.pos = gemmi.Position(*p)
        spacegroup = "P 1"
        notes.append(
            f"no unit cell in the file: built a P 1 box {edges[0]:.2f}×{edges[1]:.2f}×{edges[2]:.2f} Å "
            f"with {box_padding:g} Å padding (atoms shifted by {shift.round(3).tolist()} Å)"
        )
    else:
        raise ModelError(
            f"{where}: the file has no unit cell ({cell_source} missing or 1×1×1): pass box_padding=<Å> "
            "(--box-padding on the command line) to build a P 1 box around the atoms"
        )

    u_aniso = flags = None
    if adp == "auto":
        flags = np.array([atom.aniso.nonzero() for _, _, atom in rows], dtype=bool)
        if flags.any():
            u_aniso = np.zeros((len(rows), 6))
            for i in np.flatnonzero(flags):
                u = rows[i][2].aniso
                u_aniso[i] = (u.u11, u.u22, u.u33, u.u12, u.u13, u.u23)
            if is_cif and not np.isfinite(u_aniso[flags]).all():
                _model_file.check_anisotrop_values(block, where)  # gemmi's NaN for a value that is no number
            _check_adp(u_aniso, flags, labels, where, on_bad_adp, notes)
        else:
            flags = None
    try:
        a, b = form_factor_coefficients(elements, radiation, labels)
        atoms = AtomSet(
            torch.from_numpy(xyz),
            torch.from_numpy(b_iso),
            torch.from_numpy(occ),
            a,
            b,
            elements,
            labels,
            None if u_aniso is None else torch.from_numpy(u_aniso),
            None if flags is None else torch.from_numpy(flags),
            radiation=radiation,
        ).check()
    except ValueError as exc:
        raise ModelError(f"{where}: {exc}") from exc
    return Model(
        atoms,
        cell,
        spacegroup,
        path,
        st,
        tuple(notes),
        shift=None if shift is None else tuple(float(v) for v in shift),
        model_index=int(model_index),
        n_models=n_models,
    )


def _check_adp(u_aniso: np.ndarray, flags: np.ndarray, labels, where: str, on_bad_adp: str, notes: list[str]) -> None:
    """Refuse, or (``on_bad_adp="iso"``) turn isotropic in place, the atoms whose U is not positive definite."""
    from kernels.density.adp import bad_adp, rounding_margin

    bad, _finite, lam = bad_adp(torch.from_numpy(u_aniso), torch.from_numpy(flags))
    if not bad.any():
        return
    idx = bad.nonzero().flatten().tolist()
    lam = lam.numpy()
    described = [f"{labels[i]} (eigenvalues {', '.join(f'{v:.4g}' for v in lam[i])} Å²)" for i in idx[:5]]
    # gemmi keeps U in float32: values positive definite in the file can be singular once rounded.
    rounded = [
        i
        for i in idx
        if np.isfinite(lam[i]).all() and abs(lam[i][0]) <= rounding_margin(torch.float32) * abs(lam[i]).max()
    ]
    note = (
        f"; of these, {len(rounded)} ({labels[rounded[0]]} first) are singular within float32 rounding: gemmi "
        "stores U in float32, and that cast makes a U this close to singular lose positive definiteness even "
        "where the file's values have it"
        if rounded
        else ""
    )
    more = f" and {len(idx) - 5} more" if len(idx) > 5 else ""
    what = f"{len(idx)} atom(s) have an ANISOU U that is not positive definite: {'; '.join(described)}{more}{note}"
    if on_bad_adp == "raise":
        raise ModelError(
            f"{where}: {what}. No Gaussian has that shape. Read with on_bad_adp='iso' to splat these atoms at "
            "their isotropic B (the others stay anisotropic), or adp='iso' for an isotropic model"
        )
    flags[idx] = False
    u_aniso[idx] = 0.0
    msg = f"{what}; splatted at their isotropic B instead"
    warnings.warn(f"{where}: {msg}", stacklevel=3)
    notes.append(msg)


def _stray_anisou(messages: list[str], where: str, on_bad_adp: str, notes: list[str]) -> None:
    """Refuse ANISOU records (or ``_atom_site_anisotrop`` rows) that are not their atom's, or warn.

    With ``on_bad_adp="iso"`` the caller leaves them out: no atom takes their U, and the atom
    gemmi would have given it stays isotropic at its B.
    """
    more = f" ({len(messages) - 1} more such ANISOU records)" if len(messages) > 1 else ""
    if on_bad_adp == "raise":
        raise ModelError(
            f"{where}: {messages[0]}{more}. Give each atom its own ANISOU record (in PDB right after its "
            "ATOM/HETATM record, with the same serial, name, residue, chain and altloc), or remove the record; "
            "or read with on_bad_adp='iso' to leave such records out"
        )
    msg = (
        f"{messages[0]}{more}; left out: no atom takes its U (the atom it would have gone to stays isotropic at its B)"
    )
    warnings.warn(f"{where}: {msg}", stacklevel=3)
    notes.append(msg)


def _clear_aniso(st, serials: set[str]) -> None:
    """Make the atoms with these ``_atom_site.id`` values isotropic (U all zero, as gemmi marks it)."""
    if not serials:
        return
    for model in st:
        for chain in model:
            for res in chain:
                for atom in res:
                    if str(atom.serial) in serials:
                        atom.aniso = type(atom.aniso)(0, 0, 0, 0, 0, 0)


def _gemmi_read(where: str, fn, *args):
    """``fn(*args)`` with gemmi's parse errors turned into a ModelError naming the file."""
    try:
        return fn(*args)
    except (RuntimeError, ValueError, OSError) as exc:
        # gemmi's text can span lines and end in a newline or a full stop: one clean sentence.
        detail = " ".join(str(exc).split()).rstrip(".;: ")
        raise ModelError(
            f"{where}: cannot read the file: {detail}. Is it complete and in PDB or mmCIF format?"
        ) from exc


# Crystal system -> the cell metric its space groups need (said when a cell contradicts one).
_SYSTEM_RULES = {
    "monoclinic": "two of the angles 90°",
    "orthorhombic": "α = β = γ = 90°",
    "tetragonal": "a = b and α = β = γ = 90°",
    "trigonal": "a = b, α = β = 90°, γ = 120° (hexagonal axes) or a = b = c, α = β = γ (rhombohedral axes)",
    "hexagonal": "a = b, α = β = 90°, γ = 120°",
    "cubic": "a = b = c and α = β = γ = 90°",
}


def _spacegroup(st, cell: Cell, where: str, source: str, notes: list[str]) -> str:
    """The model's space group name, checked against its cell.

    Unknown or missing group: P 1 with a warning (the asymmetric-unit map is still right;
    only symmetry mates are lost, and the user may mean P 1). A group whose symmetry the
    cell's metric breaks by more than 0.1 % of its largest term (~0.05 % in a length,
    ~0.06° in an angle): ModelError, as symmetry mates and the grid would be wrong. Within
    that but beyond gemmi's own 10⁻³ Å² test: a warning (rounded or unconstrained cells).
    """
    import gemmi

    hm = st.spacegroup_hm.strip()
    sg = st.find_spacegroup()
    if sg is None:
        msg = (
            f"space group {hm!r} is not one gemmi knows; using P 1 (no symmetry mates)"
            if hm
            else "the file gives no space group; using P 1 (no symmetry mates)"
        )
        warnings.warn(
            f"{where}: {msg}: fix the space group in {'CRYST1 columns 56-66' if source == 'CRYST1' else 'the file'}",
            stacklevel=3,
        )
        notes.append(msg)
        return "P 1"
    unit_cell = gemmi.UnitCell(*cell.parameters)
    if not unit_cell.is_compatible_with_spacegroup(sg):
        scale = max(cell.parameters[:3]) ** 2
        system = sg.crystal_system_str()
        if not unit_cell.is_compatible_with_spacegroup(sg, 1e-3 * scale):
            rule = _SYSTEM_RULES.get(system, "a cell its symmetry maps onto itself")
            raise ModelError(
                f"{where}: the space group {sg.hm} ({system}) does not fit the cell in {source} "
                f"({_format_cell(cell.parameters)}): a {system} group needs {rule}. Fix the cell or the space "
                "group (P 1 fits any cell)"
            )
        msg = (
            f"the cell ({_format_cell(cell.parameters)}) fits {sg.hm} ({system}) only approximately "
            "(within 0.1 % of its metric); symmetry mates are placed with the group's exact operators"
        )
        warnings.warn(f"{where}: {msg}", stacklevel=3)
        notes.append(msg)
    return sg.hm


def _keep_altloc(st, letter: str):
    for chain in st[0]:
        for res in chain:
            for i in range(len(res) - 1, -1, -1):
                alt = res[i].altloc
                if alt not in ("\0", " ", "", letter):
                    del res[i]
