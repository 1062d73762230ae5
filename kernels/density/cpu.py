"""CPU production splat: separable per-atom tables + C++ partitioned scatter-add, with gradients.

The work happens in the C++ extension ``kernels.density._scatter`` (built at install
time; see ``_scatter.cpp`` for the algorithm). This module checks the inputs, casts them
to float32 (warning once per dtype), derives the per-atom quantities the kernel needs,
and wraps forward (scatter) and backward (gather) in a ``torch.autograd.Function``.

The result is bitwise identical run to run and for any number of threads; the thread
count follows ``torch.get_num_threads()``.
"""

from __future__ import annotations

import math

import torch

from kernels._util import to_float32
from kernels.crystal import AtomSet, GridError, GridSpec
from kernels.density.radius import DEFAULT_CUTOFF
from kernels.density.reference import atom_radii

try:
    from kernels.density import _scatter
except ImportError as exc:  # the dispatcher turns this into a BackendError with the reason
    raise ImportError(
        "the C++ extension kernels.density._scatter is not built; build it with "
        "`pip install --no-build-isolation -e .` in the source tree (needs a C++17 compiler)"
    ) from exc

__all__ = ["splat_cpu", "cutoff_radius_cpu"]

_OP = "splat_density"
# Private switch for tests: force the int64 index path on a small grid (it is otherwise
# taken only when the map has >= 2**31 voxels).
_FORCE_INT64 = False
# Private switch for tests: the forward keeps its row intervals for the backward when a
# gradient is wanted (4 bytes per row, ~10 MB on 3WIP); False makes the backward solve for
# them again, which must give bitwise the same gradients.
_KEEP_ROWS = True
# Private switch for tests: False solves the lane path's row intervals with the double pass
# only (the float pass settles every row it cannot trust in double; the maps must be
# bitwise the same either way).
_FLOAT_ROWS = True
# Private tuning switch: x slabs of the map per thread in the forward (one thread: one slab).
# More slabs balance the threads' loads; each slab edge splits the atoms that cross it (on
# 5H73, 8 slabs cost 8 % more instructions than 1). At 2 threads on the H100 host, 1, 2 and 4
# per thread came within a few % of each other in the same rounds (benchmarks/README.md).
_SLABS_PER_THREAD = 2
# Lane blocks of the backward: 0 lets the kernel pick (16 lanes on CPUs that run its AVX-512
# clone, 8 elsewhere); 8 forces 8-lane blocks. Gradients are bitwise the same either way.
_BACKWARD_LANES = 0
# Cell kinds as the C++ kernel takes them: which axis stays separable.
_KIND = {"orthogonal": 0, "hexagonal": 0, "monoclinic": 1, "triclinic": 2}


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def cutoff_radius_cpu(b_iso: torch.Tensor, a: torch.Tensor, b: torch.Tensor, cutoff: float = DEFAULT_CUTOFF):
    """Per-atom cutoff radius in Å with gemmi's rule, computed in C++ (CPU tensors).

    The same steps as :func:`kernels.density.radius.cutoff_radius` (which the reference
    uses), atom by atom in float64: the radii agree with it to rounding (~1e-15 Å). That
    vectorised torch version takes 0.3–5 s on 17k atoms because every atom runs the
    longest walk; this takes about a millisecond.

    Parameters
    ----------
    b_iso : torch.Tensor, shape (N,)
        Isotropic B in Å² (> 0), any floating dtype, CPU.
    a, b : torch.Tensor, shape (N, 5)
        IT92 coefficients, c as the fifth term with width 0.
    cutoff : float
        Density level in e/Å³ (> 0).

    Returns
    -------
    torch.Tensor, shape (N,), float64
        Not differentiable.
    """
    _check_cutoff(cutoff)
    bb = b_iso.detach().to(torch.float64).contiguous()
    aa = a.detach().to(torch.float64).contiguous()
    wb = b.detach().to(torch.float64).contiguous()
    out = torch.empty(bb.shape[0], dtype=torch.float64)
    if bb.shape[0]:
        _scatter.radii(_ptr(out), bb.shape[0], _ptr(bb), _ptr(aa), _ptr(wb), float(cutoff), torch.get_num_threads())
    return out


def _check_cutoff(cutoff) -> None:
    if not (isinstance(cutoff, (int, float)) and math.isfinite(cutoff) and cutoff > 0):
        raise ValueError(f"density cutoff must be a positive number of e/Å³, got {cutoff!r}")


def _call_args(grid: GridSpec, frac, radii, cutoff: float, b_iso, occ, a, b, force_int64: bool):
    """The kernel's atom and grid arguments: frac, radii float64; b_iso, occ, a, b float32 (all
    C-contiguous); radii None: each atom's radius from ``cutoff`` inside the kernel."""
    cell = grid.cell
    return (
        tuple(float(n) for n in grid.shape),
        frac.shape[0],
        _ptr(frac),
        None if radii is None else _ptr(radii),
        float(cutoff),
        _ptr(b_iso),
        _ptr(occ),
        _ptr(a),
        _ptr(b),
        cell.metric.reshape(-1).tolist(),
        list(cell.reciprocal_lengths),
        cell.orth.reshape(-1).tolist(),
        _KIND[cell.kind],
        torch.get_num_threads(),
        int(bool(force_int64)) | (0 if _FLOAT_ROWS else 2),  # flags for the kernel
    )


class _SplatFunction(torch.autograd.Function):
    """float32 map from float32 atoms; backward is the C++ gather (no dense graph).

    ``radii``: (N,) float64 cutoff radii in Å, or None for per-atom radii from ``cutoff``
    (gemmi's rule, computed inside the kernel as :func:`cutoff_radius_cpu` computes them).
    """

    @staticmethod
    def forward(ctx, xyz, b_iso, occ, a, b, grid, radii, cutoff, force_int64):
        # The same float64 product as the reference, so voxel membership (r² < R²) agrees
        # with it bit for bit at exact ties.
        frac = (xyz.detach().to(torch.float64) @ grid.cell.frac.T).contiguous()
        b_iso, occ, a, b = (t.detach().contiguous() for t in (b_iso, occ, a, b))  # float32, read as they are
        out = torch.empty(grid.shape, dtype=torch.float32)  # the kernel writes every voxel
        keep = _KEEP_ROWS and any(ctx.needs_input_grad[:3])
        info = _scatter.splat(
            _ptr(out), *_call_args(grid, frac, radii, cutoff, b_iso, occ, a, b, force_int64), keep, _SLABS_PER_THREAD
        )
        ctx.grid = grid
        ctx.cutoff = cutoff
        ctx.force_int64 = force_int64
        ctx.rows = info.pop("rows", None)  # opaque: the forward's row intervals, freed with ctx
        ctx.info = info
        ctx.save_for_backward(frac, radii, b_iso, occ, a, b)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        frac, radii, b_iso, occ, a, b = ctx.saved_tensors
        n = frac.shape[0]
        g = grad_out.detach().to(torch.float32).contiguous()
        gxyz = torch.zeros((n, 3), dtype=torch.float64)
        gb = torch.zeros(n, dtype=torch.float64)
        gocc = torch.zeros(n, dtype=torch.float64)
        if n:
            ctx.backward_info = _scatter.gather(
                _ptr(g),
                _ptr(gxyz),
                _ptr(gb),
                _ptr(gocc),
                *_call_args(ctx.grid, frac, radii, ctx.cutoff, b_iso, occ, a, b, ctx.force_int64),
                _BACKWARD_LANES,
                ctx.rows,
            )
        want = ctx.needs_input_grad
        f32 = torch.float32
        return (
            gxyz.to(f32) if want[0] else None,
            gb.to(f32) if want[1] else None,
            gocc.to(f32) if want[2] else None,
            None,
            None,
            None,
            None,
            None,
            None,
        )


def splat_cpu(
    atoms: AtomSet, grid: GridSpec, *, radius: float | None = None, cutoff: float = DEFAULT_CUTOFF
) -> torch.Tensor:
    """Electron density of ``atoms`` on a whole-cell ``grid``, float32, on the CPU.

    Parameters
    ----------
    atoms : AtomSet
        CPU tensors; float32 (float64 is cast, with one warning per dtype).
    grid : GridSpec
        Whole-cell grid (periodic). Any cell: orthogonal, monoclinic, hexagonal, triclinic.
    radius : float, optional
        One cutoff radius in Å for every atom; default: per atom from ``cutoff``
        (gemmi's rule, see :func:`cutoff_radius_cpu`).
    cutoff : float
        Density level in e/Å³ that sets each atom's radius when ``radius`` is None.

    Returns
    -------
    torch.Tensor, shape grid.shape, float32
        Density in e/Å³, differentiable with respect to ``atoms.xyz``, ``atoms.b_iso``
        and ``atoms.occ`` (backward is a C++ gather over the same voxels).

    Raises
    ------
    kernels.GridError
        ``grid`` is a box, not the whole cell.
    ValueError
        Atoms not on the CPU, a radius or cutoff that is not a positive number.
    """
    if not grid.is_whole_cell:
        raise GridError("the cpu density backend splats whole-cell grids only; use backend='reference' for a box")
    if atoms.device.type != "cpu":
        raise ValueError(f"splat_cpu needs CPU tensors, got {atoms.device}; use atoms.to('cpu') or backend='auto'")
    xyz = to_float32(atoms.xyz, _OP)
    b_iso = to_float32(atoms.b_iso, _OP)
    occ = to_float32(atoms.occ, _OP)
    a = to_float32(atoms.a, _OP)
    b = to_float32(atoms.b, _OP)
    if radius is not None:
        radii, cutoff = atom_radii(atoms, radius, cutoff), 0.0  # the kernel reads the radii, not the cutoff
    else:
        _check_cutoff(cutoff)
        radii = None  # the kernel derives each atom's radius from the cutoff (one pass, no extra call)
    return _SplatFunction.apply(xyz, b_iso, occ, a, b, grid, radii, float(cutoff), _FORCE_INT64)
