"""Float64 reference splat: plain torch, obviously correct, slow — the truth.

For every atom, every voxel lattice point within the cutoff radius of the atom — or of
any of its periodic images — receives

    occ · Σ_k a_k · (4π/B_k)^{3/2} · exp(−4π² r² / B_k),   B_k = b_k + b_iso,

with r measured through the cell's metric tensor, so non-orthogonal cells and spheres
larger than the cell are exact; an anisotropic atom receives the general Gaussian of
:mod:`kernels.adp`, occ · Σ_k amp_k · exp(−½ Δfᵀ Q_k Δf) in fractional offsets Δf.
Differentiable by autograd with respect to ``xyz``, ``b_iso``, ``occ`` and ``u_aniso``.
"""

from __future__ import annotations

import itertools
import math

import torch

from kernels._util import positive_number
from kernels.adp import effective_u, first_bad_adp, term_gaussians
from kernels.crystal import AtomSet, GridSpec
from kernels.density.positions import positions_in_cell
from kernels.density.radius import DEFAULT_CUTOFF, atom_cutoff_radii

__all__ = ["splat_reference", "splat_frames_reference", "atom_radii"]

# Entries (atoms × box voxels) handled per chunk: bounds the temporaries to a few hundred MB.
_CHUNK_ENTRIES = 1 << 22
# Peak bytes per box entry (measured on 1ORC with ru_maxrss, rounded up): the temporaries of one chunk
# (offsets, r², masks, lattice coordinates, values), and, when a gradient is wanted, what autograd
# keeps of every chunk until the backward (the exponentials, gathered coefficients and indices).
_CHUNK_BYTES_PER_ENTRY = 160
_GRAD_BYTES_PER_ENTRY = 96
# Anisotropic atoms add, per entry, the gathered quadratic forms of five terms and their products.
_ANISO_BYTES_PER_ENTRY = 5 * 6 * 8 * 3


def reference_peak_bytes(
    n_voxels: int, box_entries: int, largest_box: int, grad: bool, anisotropic: bool = False
) -> int:
    """Memory the reference splat allocates beyond its inputs, in bytes.

    The float64 map, one chunk of temporaries (``_CHUNK_ENTRIES`` entries, or one atom's whole box
    if larger) and, when a gradient is wanted, the saved tensors of every entry.

    Parameters
    ----------
    n_voxels : int
    box_entries : int
        Σ over atoms of the voxels in each atom's box.
    largest_box : int
        Voxels in the largest box.
    grad : bool
        Whether autograd records the splat.
    anisotropic : bool
        Whether the atoms carry U tensors (more temporaries per entry).
    """
    extra = _ANISO_BYTES_PER_ENTRY if anisotropic else 0
    chunk = max(min(box_entries, _CHUNK_ENTRIES), largest_box)
    saved = box_entries * (_GRAD_BYTES_PER_ENTRY + extra) if grad else 0
    return n_voxels * 8 + chunk * (_CHUNK_BYTES_PER_ENTRY + extra) + saved


def atom_radii(atoms: AtomSet, radius: float | None, cutoff: float, radius_rule: str = "gemmi") -> torch.Tensor:
    """Cutoff radius of each atom in Å, shape (N,), float64, on the atoms' device.

    ``radius`` (Å) applies to every atom; ``radius=None`` takes each atom's radius from
    the density ``cutoff`` (:func:`kernels.density.radius.atom_cutoff_radii`, with ``radius_rule``
    for anisotropic atoms).
    """
    if radius is not None:
        radius = positive_number(radius, "radius", "Å")
        return torch.full((len(atoms),), radius, dtype=torch.float64, device=atoms.device)
    return atom_cutoff_radii(atoms, cutoff, radius_rule)


def splat_reference(
    atoms: AtomSet,
    grid: GridSpec,
    *,
    radius: float | None = None,
    cutoff: float = DEFAULT_CUTOFF,
    radius_rule: str = "gemmi",
) -> torch.Tensor:
    """Electron density of ``atoms`` on ``grid`` in float64.

    Parameters
    ----------
    atoms : AtomSet
        Any floating dtype; computed in float64 on the atoms' device.
    grid : GridSpec
        A whole-cell grid (periodic) or a box grid (``origin``/``sampling``): a box
        receives every periodic image of every atom that reaches it.
    radius : float, optional
        One cutoff radius in Å for every atom; default: per atom from ``cutoff``.
    cutoff : float
        Density level in e/Å³ that sets each atom's radius when ``radius`` is None.
    radius_rule : {"gemmi", "eigen"}
        Cutoff radius of anisotropic atoms (:func:`kernels.density.radius.atom_cutoff_radii`).

    Returns
    -------
    torch.Tensor, shape grid.shape, float64
        Density in e/Å³.

    Raises
    ------
    ValueError
        An atom with a non-finite position or (anisotropic) a U that is not finite and positive
        definite (named), or a radius/cutoff that is not a positive number.
    """
    dev = atoms.device
    f64 = torch.float64
    xyz = positions_in_cell(atoms, grid.cell)  # far atoms moved into the cell in float64
    xyz, b_iso, occ = xyz.to(f64), atoms.b_iso.to(f64), atoms.occ.to(f64)
    a, b = atoms.a.to(f64), atoms.b.to(f64)
    cell = grid.cell
    m = torch.tensor(grid.sampling, dtype=f64, device=dev)
    m_int = torch.tensor(grid.sampling, dtype=torch.int64, device=dev)
    metric = cell.metric.to(dev)
    shape = grid.shape
    if len(atoms) == 0:
        return torch.zeros(shape, dtype=f64, device=dev)

    anisotropic = atoms.u_aniso is not None
    if anisotropic:
        bad = first_bad_adp(atoms.u_aniso, atoms.aniso)
        if bad is not None:
            idx, _count, what = bad
            raise ValueError(f"atom {atoms.labels[idx]} (index {idx}) {what}")
    radii = atom_radii(atoms, radius, cutoff, radius_rule).to(f64)
    recip = torch.linalg.norm(cell.frac, dim=1).to(dev)
    frac = xyz @ cell.frac.to(dev).T  # (N, 3), differentiable
    with torch.no_grad():
        centre = frac * m  # voxel units
        reach = radii[:, None] * recip * m  # half-extent of the sphere in voxels per axis
        lo = torch.floor(centre - reach).to(torch.int64)
        hi = torch.ceil(centre + reach).to(torch.int64)
        counts = (hi - lo + 1).cpu()
    boxes = counts.prod(dim=1)
    grad = torch.is_grad_enabled() and (
        xyz.requires_grad or b_iso.requires_grad or occ.requires_grad or (anisotropic and atoms.u_aniso.requires_grad)
    )
    need = reference_peak_bytes(0, int(boxes.sum()), int(boxes.max()), grad, anisotropic)
    grid.require_memory(f64, dev, copies=1, extra_bytes=need)
    out = torch.zeros(grid.n_voxels, dtype=f64, device=dev)

    if anisotropic:
        u_eff = effective_u(atoms.u_aniso.to(f64), atoms.aniso, b_iso)
        amp, q = term_gaussians(u_eff, occ, a, b, cell.orth.to(dev))  # (N, 5), (N, 5, 3, 3)
        # −½ Δfᵀ Q Δf as six coefficients of dx², dy², dz², dx·dy, dx·dz, dy·dz.
        quad = -0.5 * torch.stack(
            (q[..., 0, 0], q[..., 1, 1], q[..., 2, 2], 2 * q[..., 0, 1], 2 * q[..., 0, 2], 2 * q[..., 1, 2]), -1
        )  # (N, 5, 6)
    else:
        width = b + b_iso[:, None]  # (N, 5)
        amp = occ[:, None] * a * (4 * math.pi / width) ** 1.5
        expo = -4 * math.pi**2 / width

    order = torch.argsort(boxes)
    n = len(atoms)
    start = 0
    pieces = []
    while start < n:
        k_max = counts[order[start:]].max(dim=0).values
        per_atom = int(k_max.prod())
        size = max(1, min(n - start, _CHUNK_ENTRIES // per_atom))
        idx = order[start : start + size]
        k = counts[idx].max(dim=0).values.tolist()
        pieces.append((idx.to(dev), k))
        start += size

    origin = torch.tensor(grid.origin, dtype=torch.int64, device=dev)
    extent = torch.tensor(shape, dtype=torch.int64, device=dev)
    for idx, (kx, ky, kz) in pieces:
        u = lo[idx, 0, None] + torch.arange(kx, device=dev)  # (C, kx) voxel lattice coordinates
        v = lo[idx, 1, None] + torch.arange(ky, device=dev)
        w = lo[idx, 2, None] + torch.arange(kz, device=dev)
        du = u / m[0] - frac[idx, 0, None]  # fractional offsets (C, k*)
        dv = v / m[1] - frac[idx, 1, None]
        dw = w / m[2] - frac[idx, 2, None]
        dx, dy, dz = du[:, :, None, None], dv[:, None, :, None], dw[:, None, None, :]
        r2 = (
            metric[0, 0] * dx * dx
            + metric[1, 1] * dy * dy
            + metric[2, 2] * dz * dz
            + 2 * metric[0, 1] * dx * dy
            + 2 * metric[0, 2] * dx * dz
            + 2 * metric[1, 2] * dy * dz
        )  # (C, kx, ky, kz)
        inside = r2 < (radii[idx] ** 2)[:, None, None, None]
        r2_in = r2[inside]
        atom_of = torch.arange(len(idx), device=dev)[:, None, None, None].expand_as(r2)[inside]
        if anisotropic:
            ex, ey, ez = (t.expand_as(r2)[inside] for t in (dx, dy, dz))
            monomials = torch.stack((ex * ex, ey * ey, ez * ez, ex * ey, ex * ez, ey * ez), -1)  # (E, 6)
            exponent = (quad[idx][atom_of] * monomials[:, None, :]).sum(-1)  # (E, 5)
            values = (amp[idx][atom_of] * torch.exp(exponent)).sum(-1)
        else:
            values = (amp[idx][atom_of] * torch.exp(expo[idx][atom_of] * r2_in[:, None])).sum(-1)
        lattice = torch.stack(
            torch.broadcast_tensors(u[:, :, None, None], v[:, None, :, None], w[:, None, None, :]), dim=-1
        )[inside]  # (E, 3) voxel lattice coordinates, unwrapped
        if grid.is_whole_cell:
            cellwise = torch.remainder(lattice, m_int)
            flat = (cellwise[:, 0] * shape[1] + cellwise[:, 1]) * shape[2] + cellwise[:, 2]
            out.index_add_(0, flat, values)  # in place: one map, whatever the number of chunks
            continue
        # Box grid: place every periodic image of each lattice point that falls in the box.
        rel = lattice - origin
        lo_shift = torch.div(-rel.max(dim=0).values, m_int, rounding_mode="floor")
        hi_shift = torch.div(extent - 1 - rel.min(dim=0).values, m_int, rounding_mode="floor")
        for shift in itertools.product(*(range(int(s0), int(s1) + 1) for s0, s1 in zip(lo_shift, hi_shift))):
            p = rel + torch.tensor(shift, device=dev) * m_int
            ok = ((p >= 0) & (p < extent)).all(dim=1)
            if ok.any():
                q = p[ok]
                flat = (q[:, 0] * shape[1] + q[:, 1]) * shape[2] + q[:, 2]
                out.index_add_(0, flat, values[ok])
    return out.reshape(shape)


def splat_frames_reference(
    atoms: AtomSet,
    grid: GridSpec,
    *,
    n_frames: int,
    radius: float | None = None,
    cutoff: float = DEFAULT_CUTOFF,
    radius_rule: str = "gemmi",
) -> torch.Tensor:
    """One float64 map per frame: frame f is atoms ``f·N … (f+1)·N − 1`` of a frame-major ``atoms``.

    Parameters
    ----------
    atoms : AtomSet
        n_frames·N atoms, frame-major (atom i belongs to frame i // N); any floating dtype.
    grid : GridSpec
        Whole-cell or box grid, as for :func:`splat_reference`.
    n_frames : int
        F ≥ 1; must divide ``len(atoms)``.
    radius, cutoff, radius_rule
        As for :func:`splat_reference`.

    Returns
    -------
    torch.Tensor, shape (n_frames, *grid.shape), float64
        Map f is exactly ``splat_reference`` of frame f's atoms; differentiable by autograd with
        respect to ``atoms.xyz``, ``atoms.b_iso``, ``atoms.occ`` and ``atoms.u_aniso``.

    Raises
    ------
    ValueError
        ``n_frames`` not a positive integer dividing ``len(atoms)``, or as :func:`splat_reference`.
    """
    if isinstance(n_frames, bool) or not isinstance(n_frames, int) or n_frames < 1 or len(atoms) % n_frames:
        raise ValueError(f"n_frames must be a positive integer dividing the {len(atoms)} atoms, got {n_frames!r}")
    n = len(atoms) // n_frames
    maps = []
    for f in range(n_frames):  # the reference may loop: it is the truth, not the fast path
        s = slice(f * n, (f + 1) * n)
        frame = AtomSet(
            atoms.xyz[s],
            atoms.b_iso[s],
            atoms.occ[s],
            atoms.a[s],
            atoms.b[s],
            tuple(atoms.elements[s]),
            tuple(atoms.labels[s]),
            None if atoms.u_aniso is None else atoms.u_aniso[s],
            None if atoms.aniso is None else atoms.aniso[s],
            radiation=atoms.radiation,
            _validate=False,
        )
        maps.append(splat_reference(frame, grid, radius=radius, cutoff=cutoff, radius_rule=radius_rule))
    return torch.stack(maps)
