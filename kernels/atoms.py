"""Atoms as tensors (:class:`AtomSet`), what every kernel takes, and the labels that name them."""

from __future__ import annotations

import abc
import dataclasses
import math
import warnings
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from kernels.form_factors import RADIATIONS, form_factor_coefficients

__all__ = ["MIN_PHYSICAL_B", "AtomLabel", "AtomSet"]

#: B (Å²) below which an atom's displacement is less than zero-point motion gives any atom
#: (U < 0.006 Å²): such a B is a mistake in the data, and AtomSet warns about it.
MIN_PHYSICAL_B = 0.5


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


class _Picked(_LazySequence):
    """Items ``rows`` of ``base``, in that order: the symbols and labels of :meth:`AtomSet.select`.

    Lazy when ``base`` is: selecting from an AtomSet built without labels costs no per-atom Python work.
    A concrete ``base`` (a tuple) is indexed at once, which is as cheap as keeping the rows.
    """

    __slots__ = ("_base", "_rows")

    def __init__(self, base: Sequence, rows: list[int]):
        self._base, self._rows = base, rows

    def __len__(self) -> int:
        return len(self._rows)

    def _item(self, index: int):
        return self._base[self._rows[index]]


def _pick(base: Sequence, rows: list[int]) -> Sequence:
    """``base``'s items ``rows``: a lazy :class:`_Picked` of a lazy sequence, else a tuple."""
    return _Picked(base, rows) if isinstance(base, _LazySequence) else tuple(base[i] for i in rows)


_TENSOR_FIELDS = ("xyz", "b_iso", "occ", "a", "b")
_FIELDS = ("xyz", "b_iso", "occ", "a", "b", "elements", "labels", "u_aniso", "aniso", "radiation")


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


def thin_u(u_aniso: torch.Tensor, aniso: torch.Tensor) -> tuple[int, int, float] | None:
    """(first row, how many, its smallest eigenvalue in Å²) of the anisotropic host rows whose U's narrowest
    axis is below ``MIN_PHYSICAL_B``/8π² (positive definite ones: the others are refused elsewhere); or None.

    Gershgorin's bound (λmin ≥ min_i U_ii − Σ_j≠i |U_ij|) clears the usual atom in a few vector
    operations; only the rows it cannot clear get their eigenvalues (closed form).

    Parameters
    ----------
    u_aniso : torch.Tensor, shape (N, 6), Å², CPU
    aniso : torch.Tensor, shape (N,), bool, CPU
    """
    from kernels.adp import U_TO_B, _eigenvalues_3x3

    with torch.no_grad():
        u = u_aniso.detach()
        d, o = u[:, :3], u[:, 3:].abs()
        off = torch.stack((o[:, 0] + o[:, 1], o[:, 0] + o[:, 2], o[:, 1] + o[:, 2]), dim=1)
        unsure = aniso & ((d - off).amin(dim=1) < MIN_PHYSICAL_B / U_TO_B)
        if not bool(unsure.any()):
            return None
        rows = unsure.nonzero()[:, 0]
        lam = _eigenvalues_3x3(u[rows].to(torch.float64).numpy())[:, 0]
    thin = np.isfinite(lam) & (lam > 0) & (lam * U_TO_B < MIN_PHYSICAL_B)
    if not thin.any():
        return None
    k = int(np.flatnonzero(thin)[0])
    return int(rows[k]), int(thin.sum()), float(lam[k])


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
        if device.type == "meta":  # shapes without values: every kernel and check would fail on its first read
            raise ValueError(
                "AtomSet tensors are on the meta device, which holds shapes but no values: build the atoms on 'cpu' "
                "or 'cuda' (for shape-only tracing use torch.compile, whose fake tensors keep the real device)"
            )
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
            from kernels.adp import U_TO_B, bad_adp, first_bad_adp

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
            raise self._nonfinite_position_error(~torch.isfinite(x).all(dim=1))
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

    def _warn_tiny_u(self, stacklevel: int = 3) -> None:
        """The tiny-U rule of :meth:`check` for anisotropic host atoms (:func:`thin_u`): a warning naming the first."""
        if self.u_aniso is None or len(self) == 0:
            return
        found = thin_u(self.u_aniso, self.aniso)
        if found is not None:
            idx, count, lam = found
            _warn_too_sharp(
                self.labels,
                idx,
                count,
                f"B along its U's narrowest axis, 8π² × {lam:.3g} Å² = {lam * 8 * math.pi**2:.3g} Å²,",
                "check the U values (Å²; PDB ANISOU gives them in 10⁻⁴ Å²)",
                stacklevel=stacklevel,
            )

    def _nonfinite_position_error(self, bad: torch.Tensor) -> ValueError:
        """The error for atoms whose position is not finite: names the first of ``bad`` (N,) bool and counts the rest.

        The one wording of this error, raised by :meth:`check` and by :func:`kernels.check_finite`.
        """
        bad = bad.cpu()
        idx = int(bad.nonzero()[0, 0])
        count = int(bad.sum())
        more = f" ({count - 1} more atoms too)" if count > 1 else ""
        label = self.labels[idx] if len(self.labels) == len(self) else f"#{idx + 1}"
        return ValueError(
            f"atom {label} (index {idx}) has a non-finite position {self.xyz[idx].detach().cpu().tolist()} Å{more} "
            "(NaN or inf, or so far from the cell that its fractional coordinate overflows float64); "
            "the density kernels place every atom: fix or drop it (e.g. atoms.select(mask)) before splatting"
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
            elements=_pick(self.elements, sel),
            labels=_pick(self.labels, sel),
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
