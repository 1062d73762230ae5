"""Triton density splat: forward (scatter) and backward (gather), float32 maps.

This module holds the plans, launchers and op definitions; the kernels are in
``kernels.density._triton_kernels`` (isotropic, and the device helpers both sets share) and
``kernels.density._triton_aniso_kernels``. Each op is one :class:`kernels._opdef.OpDef`, from which
the eager autograd Function here and the ``torch.library`` op ``torch.compile`` traces are built.

Design (see ``docs/performance.md``, "Density on the GPU (Triton)", for what was measured):

- One program per atom on a GPU (``ATOMS`` atoms per program, a constexpr: the
  interpreter pays per program, so CI packs many atoms into one). The program walks its
  atom's box of voxels as 2-D tiles over the (x, z) plane, ``BP × BQ`` voxels (z is the
  contiguous axis, so the atomics of a tile row hit consecutive addresses), and loops over
  y rows. Tiles past ``BP``/``BQ`` are chunked in a loop, so an atom of any radius — a
  sphere larger than the cell included — is splatted exactly; the host's tile size is a
  performance choice only and never needs the atoms' values (no host sync).
- Separable exponent where the cell allows it: orthogonal and monoclinic cells (gemmi's
  upper-triangular ``orth`` couples only a–c) factor exp(−α r²) = E(x, z)·e(y) with
  E = exp(−α(H00 dx² + 2 H02 dx dz + H22 dz²)) computed once per tile and e(y) once per
  row: every factor ≤ 1, so nothing overflows. The forward on hexagonal-kind cells (only a–b
  couples) factors exp(−α r²) = E(x, y)·e(z) with e(z) once per tile and E(x, y) once per x lane
  and row (``ZSEP``); their backward and triclinic cells evaluate the full exponent per voxel
  (r² ≥ 0, so exp(−α r²) ≤ 1 as well).
- Each (x, z) tile walks only the rows where one of its voxels can lie inside the sphere: on
  separable cells from the minimum of the (x, z) part of r² over the tile's rectangle (a few
  scalar flops per tile), otherwise from the union of the lanes' row intervals; bounds are widened
  so that no row with a voxel inside is dropped. Corner tiles then skip most of the box's rows.
- The separable backward folds each tile's sums into per-atom sums after its row loop (no lane
  accumulators live across row loops) and walks the rows in pairs, the second row's gradient load
  issued before the first row's arithmetic (the backward is bound by load latency at the
  occupancy its ~220 registers allow).
- z lanes in aligned groups of 4 (``VEC``, when nz % 4 == 0): the lanes start at the box's first z
  rounded down to a multiple of 4 in absolute grid index, each group's start is wrapped and
  declared a multiple of 4, and the masks are constant over each group (a lower bound of r² over
  the group against a slightly widened R²; lanes outside the sphere add or read an exact 0). On
  sm_90 Triton then emits one ``red.global.add.v4.f32`` per group in the forward (instead of 4
  scalar atomics) and one ``ld.global.v4`` in the backward. Same code in the interpreter, so CI
  runs it; nz % 4 != 0 keeps the lane-by-lane path.
- Per-atom tables live in registers (tensors of the program), never in a global scratch
  buffer: a public kernel of this design that wrote tables to global memory and read them
  back without a barrier returned wrong maps on the first call after each compile.
- Per-atom radii are computed by the forward kernel itself (``_cutoff_radius``, a port of gemmi's
  ``estimate_radius`` rule: the same steps as :func:`kernels.density.radius.cutoff_radius`, in
  float32, with early exit) and stored for the backward: no launch of their own, no
  ``.item()``/``.cpu()`` anywhere in forward or backward, so a training step can be captured in
  a CUDA graph.
- Positions are loaded in their own dtype (float32 or float64) and wrapped into the cell in
  float64 in both kernels: f = frac·xyz, then f − floor(f) (exact for any finite f) times the
  grid shape, rounded to float32 only as the sub-voxel offset. An atom translated by lattice
  vectors of any size lands where its float64 fractional coordinate says, and float32 would lose
  ~2e-5 Å in a 240 Å cell, which at B = 2 Å² moves the density of N by more than the 1e-5
  contract. An atom with a non-finite position, B or occupancy gets an empty box and zero
  gradients, without a host check.
- Anisotropic sets (``u_aniso``) and neutron sets take their own pair of kernels (``_aniso_fwd_kernel``,
  ``_aniso_bwd_kernel``) with the same launch shape, tiles, row spans, z groups and float64 wrap; the
  isotropic kernels are untouched by them. Each program forms its atoms' U as
  ``kernels.adp.effective_u`` does (so a mixed set is exact), and per form-factor term
  M_k = U + b_k/8π²·I, det M_k and M_k⁻¹ (adjugate), the quadratic form in voxel steps and the cutoff
  radius (gemmi's rule at B_max, the exact sphere along U's major axis, or the neutron closed form).
  Per (x, z) tile each term's exponent is A_k + dy·(B_k + c_k·dy) in log2 units, so a voxel costs five
  exp2 and ten FMAs. The backward sums g·e_k·(1, dy, dy²) per lane over a tile's rows in float64 and
  folds each tile into ∂L/∂centre, ∂L/∂occ and ∂L/∂U of its atom (linear in the tile's moments), then
  ∂L/∂u_aniso for anisotropic atoms and ∂L/∂b_iso = tr(∂L/∂U)/8π² for isotropic ones: no atomics.
  An atom whose U is not finite and positive definite is treated like one with a non-finite position.
- With ``torch.use_deterministic_algorithms(True)`` (read on the host per call) the forwards add int64
  fixed-point values with integer atomics instead of float32 ones, so maps are bitwise reproducible and
  independent of the atoms' order: a first launch finds each atom's radius and a bound of its
  contributions (the scale, on the device), the splat adds, a last launch converts to float32
  (docs/kernels.md, "Determinism"). The backwards have no atomics either way.
- An opt-in second isotropic forward, a binned gather (``kernels.density._triton_gather``): the map cut into
  bricks, each atom's pairs with the bricks its sphere reaches counted and placed by integer atomics (a
  counting sort, sizes from the plan), one program per brick summing its atoms in ascending index in registers
  and writing each voxel once (int64 fixed point in deterministic mode). ``KERNELS_TRITON_FORWARD`` chooses it
  (docs/kernels.md, "Choosing the forward"); the scatter above is the default.
- Host side (an eager call is host time, not GPU time): every plan constant is in one float64
  device tensor, the forward is one memset and one launch, the backward one launch, and after a
  plan's first call its compiled kernels are launched directly (:class:`kernels._launch.FastLauncher`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import triton

from kernels._launch import FastLauncher, ceil_div
from kernels._opdef import OpDef, eager_function, register
from kernels._util import positive_number, to_float32
from kernels.crystal import AtomSet, Cell, GridError, GridSpec
from kernels.density._triton_aniso_kernels import (
    _aniso_bwd_kernel,
    _aniso_fixed_scale_kernel,
    _aniso_fwd_kernel,
)
from kernels.density._triton_gather import _gather_bin_kernel, _gather_brick_kernel, _gather_fill_kernel
from kernels.density._triton_kernels import (
    _fixed_scale_kernel,
    _fixed_to_float_kernel,
    _splat_bwd_kernel,
    _splat_fwd_kernel,
)
from kernels.density.radius import DEFAULT_CUTOFF, RADIUS_RULES, cutoff_radius
from kernels.dispatch import BackendError, triton_interpreted
from kernels.grid import grid_of

__all__ = ["splat_triton", "splat_frames_triton"]

# Interpreter: atoms per program (it costs per program, not per element).
_INTERPRET_ATOMS = 64
# B (Å²) of the nominal carbon whose radius sets the tile size; larger atoms take more tiles.
_NOMINAL_B = 40.0


# --------------------------------------------------------------------------- host launchers


@dataclasses.dataclass(frozen=True, eq=False)
class _Plan:
    """Host constants and launch shape of one (cell, grid, radius setting, device).

    :meth:`build` makes the production plan (cached by :func:`_plan`); a test or benchmark that needs
    another tile, launch shape or z layout derives a plan from it with ``dataclasses.replace`` and passes
    it to :func:`_splat`. Every field value gives the same voxels and sums (up to atomic order on a GPU).
    """

    shape: tuple[int, int, int]
    cell: Cell
    n_voxels: int
    # (41,) float64 on the device, every constant the kernels read (one pointer instead of ~20 scalar
    # arguments, each of which costs host time per launch): [0:9] frac row-major, [9:12] the grid shape,
    # [12:18] the voxel-unit metric h00, h11, h22, h01, h02, h12, [18:21] the reach |a*_i|·n_i,
    # [21] the fixed radius (Å, 0 when per_atom), [22] the cutoff, [23:32] m = diag(n)·frac row-major,
    # [32:41] m⁻¹ = orth·diag(1/n) row-major (voxel steps → Å; the anisotropic kernels' quadratic forms).
    params: torch.Tensor
    separable: bool  # exp(−α r²) = E(x, z)·e(y): orthogonal and monoclinic cells only
    zsep: bool  # exp(−α r²) = E(x, y)·e(z) in the forward: hexagonal-kind cells (only the a–b pair couples)
    per_atom: bool  # per-atom radii from the cutoff (else ``radius`` for every atom)
    radius: float  # Å, 0 when per_atom
    cutoff: float  # e/Å³
    index64: bool
    bp: int  # forward (x, z) tile, BP × BQ lanes
    bq: int
    bp_bwd: int  # backward tile
    bq_bwd: int
    vec: bool  # z lanes in aligned groups of 4, both kernels: needs nz % 4 == 0 and bq, bq_bwd ≥ 4
    atoms_per_program: int
    num_warps: int
    num_warps_bwd: int
    # Register cap of the isotropic forward (None: the compiler's choice). The one-warp 128-lane forward
    # compiles to 111 registers; capped at 80 (two spilled) more programs fit an SM and the scatter, bound
    # by its atomics' issue rate at that occupancy, gains 7 % on 3WIP (docs/performance.md).
    maxnreg: int | None
    # Anisotropic kernels' tiles: 8 × 8 lanes on one warp each way, the fastest of the shapes timed on an
    # H200 (docs/performance.md, "Anisotropic atoms"). The forward holds two per-term arrays per lane
    # (10 in all: ~150 registers at 64 lanes, ~205 at 128); the backward fifteen float64 row accumulators.
    bp_aniso: int
    bq_aniso: int
    num_warps_aniso: int
    bp_aniso_bwd: int
    bq_aniso_bwd: int
    num_warps_aniso_bwd: int

    @classmethod
    def build(cls, grid: GridSpec, radius: float | None, cutoff: float, device: torch.device) -> _Plan:
        cell = grid.cell
        nx, ny, nz = grid.shape
        n = torch.tensor([nx, ny, nz], dtype=torch.float64)
        m = n[:, None] * cell.frac  # Cartesian → voxel units
        h = cell.metric / (n[:, None] * n[None, :])
        reach = tuple(float(r * k) for r, k in zip(cell.reciprocal_lengths, (nx, ny, nz)))
        radius_all = 0.0 if radius is None else float(radius)
        # Tile: the box of a nominal atom (the given radius, or carbon at B = 40 Å²), rounded up
        # to a power of two; atoms with larger boxes take more tiles, never a wrong answer.
        nominal = radius_all if radius is not None else _nominal_radius(float(cutoff))
        ext_x = 2 * math.ceil(nominal * reach[0]) + 1
        ext_z = 2 * math.ceil(nominal * reach[2]) + 1
        # Forward: 128 lanes on one warp up to 16-wide z; wider z (fine grids) 512 lanes on two warps, as
        # 256 lanes on one warp need ~220 registers a thread (3WIP at 0.33 Å on an H200: 0.46 ms against
        # 0.74 ms). The backward: 256 lanes, the forward's z width (docs/performance.md).
        bq = max(min(triton.next_power_of_2(ext_z), 64), 4)
        interpret = triton_interpreted() and device.type != "cuda"
        # The interpreter pays per loop trip, not per element: wide tiles there.
        lanes, num_warps = (128, 1) if bq <= 16 else (512, 2)
        cap = 16 if interpret else max(1, lanes // bq)
        bp = max(1, min(triton.next_power_of_2(ext_x), cap))
        bq_bwd = bq
        cap = 16 if interpret else max(1, 256 // bq_bwd)
        bp_bwd = max(1, min(triton.next_power_of_2(ext_x), cap))
        hv = [h[0, 0], h[1, 1], h[2, 2], h[0, 1], h[0, 2], h[1, 2]]
        params = torch.cat(
            [
                cell.frac.reshape(-1),
                n,
                torch.stack(hv),
                torch.tensor([*reach, radius_all, float(cutoff)], dtype=torch.float64),
                m.reshape(-1),
                torch.linalg.inv(m).reshape(-1),
            ]
        ).to(torch.float64)
        return cls(
            shape=(nx, ny, nz),
            cell=cell,
            n_voxels=nx * ny * nz,
            params=params.contiguous().to(device),
            separable=cell.kind in ("orthogonal", "monoclinic"),
            zsep=cell.kind == "hexagonal",
            per_atom=radius is None,
            radius=radius_all,
            cutoff=float(cutoff),
            index64=nx * ny * nz >= 2**31 - 1,
            bp=bp,
            bq=bq,
            bp_bwd=bp_bwd,
            bq_bwd=bq_bwd,
            # z lanes in aligned groups of 4 (nz % 4 == 0: no group straddles the periodic wrap). The same
            # code runs in the interpreter, so CI tests it; sm_90's code generation turns each group into one
            # vector atomic (forward) or one 128-bit load (backward).
            vec=nz % 4 == 0,
            # The interpreter costs per program: many atoms per program there. On a GPU one atom per
            # program and one warp each: the scatter is bound by the atomics' issue rate, and more,
            # smaller programs keep more atoms' rows in flight.
            atoms_per_program=_INTERPRET_ATOMS if interpret else 1,
            num_warps=num_warps,
            num_warps_bwd=1,
            maxnreg=80 if lanes == 128 and not interpret else None,
            bp_aniso=bp if interpret else min(triton.next_power_of_2(ext_x), 64 // min(bq, 8)),
            bq_aniso=bq if interpret else min(bq, 8),
            num_warps_aniso=1,
            bp_aniso_bwd=bp_bwd if interpret else min(triton.next_power_of_2(ext_x), 64 // min(bq_bwd, 8)),
            bq_aniso_bwd=bq_bwd if interpret else min(bq_bwd, 8),
            num_warps_aniso_bwd=1,
        )

    def constexprs(self, frames: bool, index64: bool, fixed: bool = False) -> tuple:
        """Forward constexprs in signature order (``_FWD_CONSTEXPR_NAMES``); ``fixed``: deterministic mode."""
        return (
            self.atoms_per_program, self.bp, self.bq, self.separable, self.per_atom, index64, self.vec, frames,
            self.zsep, fixed,
        )  # fmt: skip

    def constexprs_bwd(self, frames: bool, index64: bool) -> tuple:
        """The backward's: its own tile."""
        return (
            self.atoms_per_program,
            self.bp_bwd,
            self.bq_bwd,
            self.separable,
            self.per_atom,
            index64,
            self.vec,
            frames,
        )

    def constexprs_aniso(self, backward: bool, rule: int, neutron: bool, frames: bool, index64: bool, fixed=False):
        """The anisotropic kernels' constexprs in signature order (``_ANISO_CONSTEXPR_NAMES``; the forward's end
        with ``fixed``, deterministic mode: ``_ANISO_FWD_CONSTEXPR_NAMES``)."""
        if backward:
            return (self.atoms_per_program, self.bp_aniso_bwd, self.bq_aniso_bwd, rule, neutron, index64, self.vec,
                    frames, self.separable)  # fmt: skip
        return (self.atoms_per_program, self.bp_aniso, self.bq_aniso, rule, neutron, index64, self.vec, frames,
                self.separable, fixed)  # fmt: skip


_CONSTEXPR_NAMES = ("ATOMS", "BP", "BQ", "SEPARABLE", "PER_ATOM_RADIUS", "INDEX64", "VEC", "FRAMES")
_FWD_CONSTEXPR_NAMES = (*_CONSTEXPR_NAMES, "ZSEP", "FIXED")
_ANISO_CONSTEXPR_NAMES = ("ATOMS", "BP", "BQ", "RULE", "NEUTRON", "INDEX64", "VEC", "FRAMES", "SEPARABLE")
_ANISO_FWD_CONSTEXPR_NAMES = (*_ANISO_CONSTEXPR_NAMES, "FIXED")


@functools.lru_cache(maxsize=8)
def _nominal_radius(cutoff: float) -> float:
    from kernels.crystal import it92_coefficients

    a, b = it92_coefficients(["C"])
    r = cutoff_radius(torch.tensor([_NOMINAL_B], dtype=torch.float64), a, b, cutoff)
    return float(r[0])


_plans: dict[tuple, _Plan] = {}


def _plan(grid: GridSpec, radius: float | None, cutoff: float, device: torch.device) -> _Plan:
    # The interpreter setting only changes plans for CPU tensors (reading it is an environment lookup).
    key = (
        grid.cell.parameters,
        grid.shape,
        radius,
        cutoff if radius is None else None,
        device,
        device.type == "cpu" and triton_interpreted(),
    )
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) > 64:
            _plans.clear()
        plan = _plans[key] = _Plan.build(grid, radius, cutoff, device)
    return plan


# One launcher per kernel (kernels._launch): after the first call of a specialisation its compiled kernel
# is launched directly. The key of every launch below is (constexprs, num_warps[, maxnreg], xyz dtype, device
# index[, 16-byte alignment of the upstream gradient]): the constexprs hold the plan's tile and layout, frames,
# 64-bit indices and the anisotropic rule and radiation; the per-atom pointers and counts are compiled
# without specialisation (``do_not_specialize``, ``do_not_specialize_on_alignment``) and the map is
# allocated here (aligned), so the user's gradient is the one pointer whose alignment Triton specialises on
# that the key must add. Triton's pointer specialisation is that one bit (data_ptr % 16 == 0), so a
# misaligned gradient gets, under its own key, the kernel Triton itself compiles for it.
_fwd_launch = FastLauncher(_splat_fwd_kernel)
_bwd_launch = FastLauncher(_splat_bwd_kernel)
_aniso_fwd_launch = FastLauncher(_aniso_fwd_kernel)
_aniso_bwd_launch = FastLauncher(_aniso_bwd_kernel)
_fixed_scale_launch = FastLauncher(_fixed_scale_kernel)
_aniso_fixed_scale_launch = FastLauncher(_aniso_fixed_scale_kernel)
_fixed_to_float_launch = FastLauncher(_fixed_to_float_kernel)


def _fixed_shift_of(n_atoms: int, n_frames: int) -> int:
    """62 − ⌈log2(atoms of one map)⌉: the kernels' S is this minus the largest atom exponent."""
    return 62 - (max(n_atoms // n_frames, 1) - 1).bit_length()


def _fixed_accumulators(size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(size,) int64 zeros for the fixed-point sums and the (1,) int64 exponent slot after them: one memset."""
    acc = torch.zeros(size + 1, dtype=torch.int64, device=device)
    return acc, acc[size:]


def _fixed_map(acc: torch.Tensor, fix: torch.Tensor, size: int, shift: int, shape: tuple) -> torch.Tensor:
    """The float32 map of ``shape`` from the fixed-point sums (one launch)."""
    out = torch.empty(shape, dtype=torch.float32, device=acc.device)
    block = 1 << 16 if triton_interpreted() and acc.device.type != "cuda" else 1024
    _fixed_to_float_launch(
        (ceil_div(size, block), 1, 1), (block, acc.device.index), (acc, fix, out, size, shift, block), acc.device, 4
    )
    return out


def _scale_block(device: torch.device) -> int:
    """Atoms per program of the exponent kernels (the interpreter pays per program)."""
    return 1024 if triton_interpreted() and device.type != "cuda" else 128


def _forward(plan: _Plan, xyz, b_iso, occ, a, b, n_frames: int, shape: tuple):
    """Zero-filled map of ``shape`` (one memset) and one forward launch; returns the map and the radii written.

    ``shape``: the grid's, or (n_frames, *grid) — the result's own shape, so no view of it is made per call.
    With ``torch.are_deterministic_algorithms_enabled()``: the fixed-point forward instead (one memset, three
    launches; the map is the same bit for bit on every call and for any order of the atoms).
    """
    fixed = torch.are_deterministic_algorithms_enabled()
    if _forward_method != "scatter" and _use_gather(fixed):
        return _forward_gather(plan, xyz, b_iso, occ, a, b, n_frames, shape)[:2]
    n = xyz.shape[0]
    size = n_frames * plan.n_voxels
    device = xyz.device
    if fixed:
        out, fix = _fixed_accumulators(size, device)
    else:
        out = torch.zeros(shape, dtype=torch.float32, device=device)
        fix = out
    # Per-atom radii: written by the forward, read by the backward. A fixed radius: nothing is written
    # and any float32 pointer will do.
    radii = torch.empty(n, dtype=torch.float32, device=device) if plan.per_atom else b_iso
    frames = n_frames > 1
    index64 = plan.index64 or size >= 2**31 - 1
    shift = _fixed_shift_of(n, n_frames) if fixed else 0
    if fixed:
        block = _scale_block(device)
        _fixed_scale_launch(
            (ceil_div(n, block), 1, 1), (block, plan.per_atom, xyz.dtype, device.index),
            (xyz, b_iso, occ, a, b, radii, plan.params, fix, n, block, plan.per_atom), device, 4,
        )  # fmt: skip
    c = plan.constexprs(frames, index64, fixed)
    _fwd_launch(
        (ceil_div(n, plan.atoms_per_program), 1, 1),
        (c, plan.num_warps, plan.maxnreg, xyz.dtype, device.index),
        (xyz, b_iso, occ, a, b, radii, plan.params, out, fix, n, n // n_frames, shift, *c),
        device, plan.num_warps, plan.maxnreg,
    )  # fmt: skip
    if fixed:
        out = _fixed_map(out, fix, size, shift, shape)
    return out, radii


# --------------------------------------------------------------------------- the binned gather forward
#
# The isotropic forward as a gather over bricks of the map (kernels.density._triton_gather: design there and in
# docs/performance.md). Chosen per process by KERNELS_TRITON_FORWARD (docs/kernels.md, "Choosing the forward"):
# "scatter" (the default), "gather" (every isotropic forward, the deterministic one included) or
# "gather-deterministic" (only under torch.use_deterministic_algorithms(True)).

_FORWARD_METHODS = ("scatter", "gather", "gather-deterministic")
# B (Å²) and elements of the widest atom the pair buffer is sized for under per-atom radii: an atom wider than
# all of them (B above 250 Å² for these) may find the buffer full; the map is then NaN everywhere (and the
# overflow slot set), never silently short.
_GATHER_BOUND_B = 250.0
_GATHER_BOUND_ELEMENTS = ("C", "O", "S", "Fe", "Zn", "Se", "Hg", "U")


def _forward_method_from_env() -> str:
    import os

    method = os.environ.get("KERNELS_TRITON_FORWARD", "scatter").strip() or "scatter"
    if method not in _FORWARD_METHODS:
        raise ValueError(f"KERNELS_TRITON_FORWARD must be one of {_FORWARD_METHODS}, got {method!r}")
    return method


_forward_method = _forward_method_from_env()


def _set_forward_method(method: str) -> str:
    """Route the isotropic Triton forward through ``method`` (one of ``_FORWARD_METHODS``); returns the previous one.

    For A/B runs in one process (tests, benchmarks); a process's default comes from ``KERNELS_TRITON_FORWARD``.
    """
    global _forward_method
    if method not in _FORWARD_METHODS:
        raise ValueError(f"the Triton forward must be one of {_FORWARD_METHODS}, got {method!r}")
    previous, _forward_method = _forward_method, method
    return previous


def _use_gather(fixed: bool) -> bool:
    """Whether this isotropic forward takes the gather (``fixed``: deterministic mode on)."""
    return _forward_method == "gather" or (fixed and _forward_method == "gather-deterministic")


@dataclasses.dataclass(frozen=True, eq=False)
class _GatherPlan:
    """Brick shape and launch shape of the gather forward of one :class:`_Plan` (:func:`_gather_plan`).

    ``pairs_per_atom`` bounds the bricks one atom's box touches (the pair buffer holds N times it): exact for a
    fixed radius, for per-atom radii the box of the widest atom of ``_GATHER_BOUND_ELEMENTS`` at
    ``_GATHER_BOUND_B``. Tests and benchmarks derive others with ``dataclasses.replace``.
    """

    bx: int  # brick, x × y × z voxels (z contiguous)
    by: int
    bz: int
    n_bricks: int  # bricks of one map, ⌈nx/bx⌉·⌈ny/by⌉·⌈nz/bz⌉
    pairs_per_atom: int
    block: int  # atoms per program of the per-atom launches
    tch: int  # pairs per atom per loop trip of the per-atom launches
    seg: int  # slots per load of the brick program's min-selection
    num_warps: int  # brick program
    # λ_min of the voxel-unit metric over 64, rounded down: the binning drops a pair whose brick lies outside the
    # atom's sphere by r² ≥ λ_min·|d|² (d in voxels; the kernels sum (8·gap)² as integers).
    lam: float


@functools.lru_cache(maxsize=8)
def _gather_bound_radius(cutoff: float) -> float:
    """Å: the largest cutoff radius of ``_GATHER_BOUND_ELEMENTS`` at B = ``_GATHER_BOUND_B``."""
    from kernels.crystal import it92_coefficients

    a, b = it92_coefficients(list(_GATHER_BOUND_ELEMENTS))
    bb = torch.full((len(_GATHER_BOUND_ELEMENTS),), _GATHER_BOUND_B, dtype=torch.float64)
    return float(cutoff_radius(bb, a, b, cutoff).max())


@functools.lru_cache(maxsize=64)
def _gather_plan(plan: _Plan) -> _GatherPlan:
    """The production gather plan of ``plan``.

    On a GPU 8 × 4 × 16 bricks (x, y, z) on one warp: each thread then holds 4 rows y of 4 (x, z) lanes, so on
    separable cells a voxel costs 2.5 exp2 (5 per (x, z) lane and per row, shared), against 6.25 for 8 × 8 × 8 on
    four warps (counted in the sm_90 SASS; docs/performance.md). 16 × 16 × 16 in the interpreter, which pays per
    program and per loop trip.
    """
    interpret = triton_interpreted() and plan.params.device.type != "cuda"
    return _gather_plan_for(plan, (16, 16, 16) if interpret else (8, 4, 16), 4 if interpret else 1)


def _gather_plan_for(plan: _Plan, brick: tuple[int, int, int], num_warps: int) -> _GatherPlan:
    """A gather plan of ``plan`` with bricks of ``brick`` voxels (powers of two, x, y, z) on ``num_warps`` warps."""
    interpret = triton_interpreted() and plan.params.device.type != "cuda"
    radius = plan.radius if not plan.per_atom else _gather_bound_radius(plan.cutoff)
    reach = [float(r * k) for r, k in zip(plan.cell.reciprocal_lengths, plan.shape)]
    per_axis = []
    for n, size, rc in zip(plan.shape, brick, reach):
        # _atom_box's run is at most 2·⌈R·reach⌉ + 2 voxels (+1 for float32 rounding); a run touches at most
        # ⌈(cnt − 1)/B⌉ + 1 bricks, +1 where it crosses an axis's partial last brick; never more than the axis has.
        cnt = 2 * math.ceil(radius * rc) + 3
        per_axis.append(min(ceil_div(n, size), ceil_div(cnt - 1, size) + 2))
    bx, by, bz = brick
    return _GatherPlan(
        bx=bx,
        by=by,
        bz=bz,
        n_bricks=ceil_div(plan.shape[0], bx) * ceil_div(plan.shape[1], by) * ceil_div(plan.shape[2], bz),
        pairs_per_atom=math.prod(per_axis),
        block=1024 if interpret else 128,
        tch=64 if interpret else 16,
        seg=256 if interpret else 128,  # covers most bricks' lists (3WIP at 0.67 Å: 24 a brick on average, 180 at most)
        num_warps=num_warps,
        lam=_metric_floor(plan),
    )


def _metric_floor(plan: _Plan) -> float:
    """λ_min(H)/64 (H = the voxel-unit metric), made a float32 a little below the truth (a lower bound)."""
    n = torch.tensor(plan.shape, dtype=torch.float64)
    h = plan.cell.metric.to(torch.float64) / (n[:, None] * n[None, :])
    lam = float(torch.linalg.eigvalsh(h).min()) / 64.0 * (1.0 - 1e-4)
    return float(torch.tensor(lam, dtype=torch.float32)) if lam > 0 else 0.0


_gather_bin_launch = FastLauncher(_gather_bin_kernel)
_gather_fill_launch = FastLauncher(_gather_fill_kernel)
_gather_brick_launch = FastLauncher(_gather_brick_kernel)


def _forward_gather(plan: _Plan, xyz, b_iso, occ, a, b, n_frames: int, shape: tuple, gplan: _GatherPlan | None = None):
    """The isotropic forward as a binned gather: (map, radii, state).

    One memset (the brick counts and two int64 slots) and four launches: per atom its radius, constants and
    bricks (counted per brick), the counts' cumulative sum (each brick's first slot), per atom the slots of its
    pairs (:func:`_gather_bin`), per brick the map (:func:`_gather_bricks`). ``state``: (2,) int64, [0] the
    fixed-point exponent (deterministic mode), [1] 1 when the pair buffer overflowed (the map is then NaN).
    Sizes come from the plan alone: no host synchronisation.
    """
    g = gplan or _gather_plan(plan)
    bins = _gather_bin(plan, g, xyz, b_iso, occ, a, b, n_frames)
    return _gather_bricks(plan, g, bins, n_frames, shape), bins[0], bins[-1]


def _gather_bin(plan: _Plan, g: _GatherPlan, xyz, b_iso, occ, a, b, n_frames: int):
    """The gather's binning: (radii, fprep, iprep, starts, pairs, capacity, fixed, state), starts as the bricks read them."""
    n = xyz.shape[0]
    device = xyz.device
    fixed = torch.are_deterministic_algorithms_enabled()
    keys = n_frames * g.n_bricks
    capacity = n * g.pairs_per_atom
    if capacity >= 2**31 - 1 or keys >= 2**31 - 1:
        raise ValueError(f"the gather forward's pair buffer ({capacity} slots) needs 32-bit slot indices")
    # One zero fill: [0] exponent, [1] overflow, then the (keys + 1) int32 counts.
    state = torch.zeros(2 + (keys + 2) // 2, dtype=torch.int64, device=device)
    counts = state[2:].view(torch.int32)[: keys + 1]
    fix = state[:2]
    radii = torch.empty(n, dtype=torch.float32, device=device) if plan.per_atom else b_iso
    fprep = torch.empty((n, 16), dtype=torch.float32, device=device)
    iprep = torch.empty((n, 16), dtype=torch.int32, device=device)
    pairs = torch.empty(capacity, dtype=torch.int32, device=device)
    frames = n_frames > 1
    apf = n // n_frames
    c = (g.block, g.tch, g.bx, g.by, g.bz, plan.per_atom, frames, fixed)
    _gather_bin_launch(
        (ceil_div(n, g.block), 1, 1), (c, xyz.dtype, device.index),
        (xyz, b_iso, occ, a, b, radii, plan.params, fprep, iprep, counts, fix, n, apf, g.lam, *c), device, 4,
    )  # fmt: skip
    starts = counts.cumsum_(0)  # brick k's first slot at k (counts of k were added at k + 1)
    c = (g.block, g.tch, g.bx, g.by, g.bz, frames)
    _gather_fill_launch(
        (ceil_div(n, g.block), 1, 1), (c, device.index),
        (plan.params, iprep, starts, pairs, fix, n, apf, capacity, g.lam, fprep, *c), device, 4,
    )  # fmt: skip
    return radii, fprep, iprep, starts, pairs, capacity, fixed, fix


def _gather_bricks(plan: _Plan, g: _GatherPlan, bins: tuple, n_frames: int, shape: tuple) -> torch.Tensor:
    """The gather's brick launch on :func:`_gather_bin`'s buffers: the map of ``shape``, every voxel written once."""
    _radii, fprep, iprep, starts, pairs, capacity, fixed, fix = bins
    n = fprep.shape[0]
    device = fprep.device
    out = torch.empty(shape, dtype=torch.float32, device=device)
    shift = _fixed_shift_of(n, n_frames) if fixed else 0
    # Hexagonal-kind cells take the full quadratic form: E(x, y)·e(z) shares nothing down a thread's rows y here
    # and compiled to 214 registers against 112 (sm_90, 8 × 4 × 16 on one warp).
    c = (g.bx, g.by, g.bz, g.seg, plan.separable, fixed)
    _gather_brick_launch(
        (n_frames * g.n_bricks, 1, 1), (c, g.num_warps, device.index),
        (plan.params, fprep, iprep, starts, pairs, fix, out, shift, capacity, *c), device, g.num_warps,
    )  # fmt: skip
    return out


def _backward(plan: _Plan, grad, xyz, b_iso, occ, a, b, radii, n_frames: int):
    """∂L/∂xyz (xyz's dtype), ∂L/∂b_iso, ∂L/∂occ (float32) from the flat float32 ``grad``: one launch."""
    n = xyz.shape[0]
    g_xyz = torch.empty_like(xyz)
    g_b = torch.empty_like(b_iso)
    g_occ = torch.empty_like(occ)
    frames = n_frames > 1
    index64 = plan.index64 or n_frames * plan.n_voxels >= 2**31 - 1
    device = xyz.device
    c = plan.constexprs_bwd(frames, index64)
    _bwd_launch(
        (ceil_div(n, plan.atoms_per_program), 1, 1),
        (c, plan.num_warps_bwd, xyz.dtype, device.index, grad.data_ptr() % 16 == 0),
        (grad, xyz, b_iso, occ, a, b, radii, plan.params, g_xyz, g_b, g_occ, n, n // n_frames, *c),
        device, plan.num_warps_bwd,
    )  # fmt: skip
    return g_xyz, g_b, g_occ


def _float32_contiguous(grad: torch.Tensor) -> torch.Tensor:
    """The upstream map gradient as the backward kernels read it, without a call when it already is."""
    if grad.dtype != torch.float32:
        grad = grad.to(torch.float32)
    if not grad.is_contiguous():
        grad = grad.contiguous()
    return grad


# --------------------------------------------------------------------------- the ops, defined once
#
# Each OpDef below is the whole op: launcher, backward and output shapes. The eager autograd Function and
# the torch.library op (kernels.density.ops registers it, for torch.compile) are both built from it. The call
# state is (plan, n_frames, shape) — shape the result's, grid.shape or (n_frames, *grid.shape) — and for the
# anisotropic op also (rule, neutron).


def _iso_call(inputs, params):
    cell, shape, radius, cutoff, n_frames = params
    plan = _plan(grid_of(cell, shape), radius, cutoff, inputs[0].device)
    return plan, n_frames, plan.shape if n_frames == 1 else (n_frames, *plan.shape)


def _iso_forward(call, xyz, b_iso, occ, a, b):
    plan, n_frames, shape = call
    if xyz.shape[0] == 0:
        return torch.zeros(shape, dtype=torch.float32, device=xyz.device), b_iso
    # A fixed radius writes no radii: b_iso is passed as the (unwritten) pointer and returned in their place.
    return _forward(plan, xyz, b_iso, occ, a, b, n_frames, shape)


def _iso_backward(call, grad, xyz, b_iso, occ, a, b, radii):
    plan, n_frames, _ = call
    if xyz.shape[0] == 0:
        return torch.zeros_like(xyz), torch.zeros_like(b_iso), torch.zeros_like(occ)
    radii = radii if plan.per_atom else b_iso
    return _backward(plan, _float32_contiguous(grad), xyz, b_iso, occ, a, b, radii, n_frames)


def _map_fake(xyz, shape, n_frames, radius):
    """The map and radii of a forward, as empty tensors: (shape or (n_frames, *shape)), (N,) or (0,)."""
    out_shape = tuple(shape) if n_frames == 1 else (n_frames, *shape)
    n = xyz.shape[0] if radius is None else 0
    return xyz.new_empty(out_shape, dtype=torch.float32), xyz.new_empty((n,), dtype=torch.float32)


SPLAT_OP = OpDef(
    name="kernels::density_triton",
    inputs=("Tensor xyz", "Tensor b_iso", "Tensor occ", "Tensor a", "Tensor b"),
    params=("float[] cell", "int[] shape", "float? radius", "float cutoff", "int n_frames"),
    grads=(0, 1, 2),
    saved=1,
    call=_iso_call,
    forward=_iso_forward,
    backward=_iso_backward,
    fake=lambda xyz, b_iso, occ, a, b, cell, shape, radius, cutoff, n_frames: _map_fake(xyz, shape, n_frames, radius),
)
_SplatTriton = eager_function(SPLAT_OP)
register(SPLAT_OP)


def _aniso_rule(plan: _Plan, radius_rule: str) -> int:
    """The anisotropic kernels' RULE: 0 a fixed radius, 1 gemmi's rule, 2 the exact (eigenvalue) sphere.

    On an isotropic atom (U = B/8π²·I) both rules give the same sphere: its major axis is any axis.
    """
    if not plan.per_atom:
        return 0
    return 2 if radius_rule == "eigen" else 1


def _forward_aniso(plan: _Plan, xyz, u, aniso, b_iso, occ, a, b, n_frames: int, rule: int, neutron: bool, shape: tuple):
    """Zero-filled map of ``shape`` and one anisotropic forward launch; returns the map and the radii written.

    ``u`` (N, 6) float32 and ``aniso`` (N,) bool, contiguous (:func:`_kernel_inputs_aniso`); ``shape`` as
    for :func:`_forward`.
    """
    n = xyz.shape[0]
    size = n_frames * plan.n_voxels
    fixed = torch.are_deterministic_algorithms_enabled()
    device = xyz.device
    if fixed:
        out, fix = _fixed_accumulators(size, device)
    else:
        out = torch.zeros(shape, dtype=torch.float32, device=device)
        fix = out
    radii = torch.empty(n, dtype=torch.float32, device=device) if rule else b_iso
    # The kernels read the flags as bytes (a bool pointer is not the same type in every Triton).
    flag = aniso.view(torch.uint8)
    frames = n_frames > 1
    index64 = plan.index64 or size >= 2**31 - 1
    shift = _fixed_shift_of(n, n_frames) if fixed else 0
    if fixed:
        block = _scale_block(device)
        _aniso_fixed_scale_launch(
            (ceil_div(n, block), 1, 1), (block, rule, neutron, xyz.dtype, device.index),
            (xyz, u, flag, b_iso, occ, a, b, radii, plan.params, fix, n, block, rule, neutron), device, 4,
        )  # fmt: skip
    c = plan.constexprs_aniso(False, rule, neutron, frames, index64, fixed)
    _aniso_fwd_launch(
        (ceil_div(n, plan.atoms_per_program), 1, 1),
        (c, plan.num_warps_aniso, xyz.dtype, device.index),
        (xyz, u, flag, b_iso, occ, a, b, radii, plan.params, out, fix, n, n // n_frames, shift, *c),
        device, plan.num_warps_aniso,
    )  # fmt: skip
    if fixed:
        out = _fixed_map(out, fix, size, shift, shape)
    return out, radii


def _backward_aniso(plan: _Plan, grad, xyz, u, aniso, b_iso, occ, a, b, radii, n_frames: int, rule: int, neutron: bool):
    """∂L/∂xyz (xyz's dtype), ∂L/∂u (float32), ∂L/∂b_iso, ∂L/∂occ: one launch."""
    n = xyz.shape[0]
    flag = aniso.view(torch.uint8)
    g_xyz = torch.empty_like(xyz)
    g_u = torch.empty_like(u)
    g_b = torch.empty_like(b_iso)
    g_occ = torch.empty_like(occ)
    frames = n_frames > 1
    index64 = plan.index64 or n_frames * plan.n_voxels >= 2**31 - 1
    device = xyz.device
    c = plan.constexprs_aniso(True, rule, neutron, frames, index64)
    _aniso_bwd_launch(
        (ceil_div(n, plan.atoms_per_program), 1, 1),
        (c, plan.num_warps_aniso_bwd, xyz.dtype, device.index, grad.data_ptr() % 16 == 0),
        (grad, xyz, u, flag, b_iso, occ, a, b, radii, plan.params, g_xyz, g_u, g_b, g_occ, n, n // n_frames, *c),
        device, plan.num_warps_aniso_bwd,
    )  # fmt: skip
    return g_xyz, g_u, g_b, g_occ


def _aniso_call(inputs, params):
    cell, shape, radius, cutoff, n_frames, radius_rule, neutron = params
    plan, n_frames, shape = _iso_call(inputs, (cell, shape, radius, cutoff, n_frames))
    return plan, n_frames, shape, _aniso_rule(plan, radius_rule), neutron


def _aniso_forward(call, xyz, u, aniso, b_iso, occ, a, b):
    plan, n_frames, shape, rule, neutron = call
    if xyz.shape[0] == 0:
        return torch.zeros(shape, dtype=torch.float32, device=xyz.device), b_iso
    return _forward_aniso(plan, xyz, u, aniso, b_iso, occ, a, b, n_frames, rule, neutron, shape)


def _aniso_backward(call, grad, xyz, u, aniso, b_iso, occ, a, b, radii):
    plan, n_frames, _, rule, neutron = call
    if xyz.shape[0] == 0:
        return torch.zeros_like(xyz), torch.zeros_like(u), torch.zeros_like(b_iso), torch.zeros_like(occ)
    radii = radii if rule else b_iso
    grad = _float32_contiguous(grad)
    return _backward_aniso(plan, grad, xyz, u, aniso, b_iso, occ, a, b, radii, n_frames, rule, neutron)


#: The anisotropic kernels (anisotropic sets, and isotropic neutron sets with a zero ``u`` and no atom
#: flagged in ``aniso``, as :func:`_kernel_inputs_aniso` gives them).
SPLAT_ANISO_OP = OpDef(
    name="kernels::density_triton_aniso",
    inputs=("Tensor xyz", "Tensor u_aniso", "Tensor aniso", "Tensor b_iso", "Tensor occ", "Tensor a", "Tensor b"),
    params=SPLAT_OP.params + ("str radius_rule", "bool neutron"),
    grads=(0, 1, 3, 4),
    saved=1,
    call=_aniso_call,
    forward=_aniso_forward,
    backward=_aniso_backward,
    fake=lambda xyz, u, aniso, b_iso, occ, a, b, cell, shape, radius, cutoff, n_frames, rule, neutron: _map_fake(
        xyz, shape, n_frames, radius
    ),
)
_SplatAnisoTriton = eager_function(SPLAT_ANISO_OP)
register(SPLAT_ANISO_OP)


# --------------------------------------------------------------------------- public


def _check_call(atoms: AtomSet, grid: GridSpec, radius, cutoff, op: str, radius_rule: str = "gemmi"):
    """The device, radius (None or Å) and cutoff of a call, checked."""
    if radius_rule != "gemmi" and radius_rule not in RADIUS_RULES:
        raise ValueError(f"radius_rule must be one of {RADIUS_RULES}, got {radius_rule!r}")
    device = atoms.device
    if device.type != "cuda" and not triton_interpreted():
        raise BackendError(
            f"{op} runs on CUDA tensors; move the atoms to a GPU with atoms.to('cuda') "
            "(or set TRITON_INTERPRET=1 before importing kernels to run it slowly in the interpreter)"
        )
    if not grid.is_whole_cell:
        raise GridError(f"{op} splats whole-cell grids only; use backend='reference' for a box")
    if radius is not None:
        radius = _positive(radius, "radius", "Å")
    return device, radius, _positive(cutoff, "cutoff", "the map's unit")


def _positive(value, name: str, unit: str) -> float:
    """:func:`positive_number`, without its call for the usual argument (a positive finite float)."""
    if type(value) is float and 0.0 < value < math.inf:
        return value
    return positive_number(value, name, unit)


def splat_triton(
    atoms: AtomSet,
    grid: GridSpec,
    *,
    radius: float | None = None,
    cutoff: float = DEFAULT_CUTOFF,
    radius_rule: str = "gemmi",
) -> torch.Tensor:
    """Electron density of ``atoms`` on a whole-cell ``grid``, by Triton kernels.

    Parameters
    ----------
    atoms : AtomSet
        CUDA tensors (CPU tensors only under ``TRITON_INTERPRET=1``); float32 or float64.
        float64 positions are wrapped into the cell in float64 inside the kernels (their
        gradient is float64); float64 B, occupancies, U and coefficients are cast to float32 with
        one warning per dtype. An atom with a non-finite position, B or occupancy adds nothing
        and gets zero gradients (no host check; see :func:`kernels.check_finite`).
        Isotropic X-ray and electron sets take the isotropic kernels. Anisotropic sets
        (``atoms.u_aniso`` not None) take the anisotropic kernels for every atom, with U as
        :func:`kernels.adp.effective_u` forms it (B/(8π²)·I for the isotropic atoms), so a
        mixed set is exact; so do neutron sets, isotropic or not (their radii are the closed form of
        :func:`kernels.density.radius.atom_cutoff_radii`). An atom whose U is not finite and positive
        definite (unvalidated input: the kernels do not read values back to raise) adds nothing and
        gets zero gradients, as a non-finite position does.
    grid : GridSpec
        Whole-cell grid (periodic); any cell, orthogonal or not.
    radius : float, optional
        One cutoff radius in Å for every atom. Default: per atom, where its density falls
        to ``cutoff`` (gemmi's rule), computed on the device.
    cutoff : float
        Density level in e/Å³ (fm/Å³ for neutrons) for the per-atom radius (default 1e-5).
    radius_rule : {"gemmi", "eigen"}
        Per-atom radius of anisotropic atoms (:func:`kernels.density.radius.atom_cutoff_radii`):
        gemmi's rule at B_max = 8π²·max diag U, or the exact sphere along U's major axis.

    Returns
    -------
    torch.Tensor, shape grid.shape, float32
        Density in e/Å³ on the atoms' device; differentiable with respect to
        ``atoms.xyz``, ``atoms.b_iso``, ``atoms.occ`` and ``atoms.u_aniso`` (the rows of the
        anisotropic atoms; ``b_iso`` carries the gradient of the isotropic ones). No host
        synchronisation, so forward and backward can be captured in a CUDA graph.

    Raises
    ------
    kernels.BackendError
        CPU tensors without ``TRITON_INTERPRET=1``.
    kernels.GridError
        A box grid (not the whole cell).
    ValueError
        ``radius`` or ``cutoff`` not a positive finite number, ``radius_rule`` not one of
        ``"gemmi"``, ``"eigen"``.
    """
    device, radius, cutoff = _check_call(atoms, grid, radius, cutoff, "splat_triton", radius_rule)
    return _splat(atoms, _plan(grid, radius, cutoff, device), radius_rule=radius_rule)


def _as_kernel_input(t: torch.Tensor, op: str) -> torch.Tensor:
    """``t`` as a contiguous float32 tensor, without a call when it already is one."""
    if t.dtype != torch.float32:
        t = to_float32(t, op)
    if not t.is_contiguous():
        t = t.contiguous()
    return t


def _splat(atoms: AtomSet, plan: _Plan, n_frames: int | None = None, radius_rule: str = "gemmi") -> torch.Tensor:
    """The splat of :func:`splat_triton` (inputs already validated) with an explicit ``plan``.

    ``splat_triton`` passes the cached production plan; tests and benchmarks pass one derived from it
    with ``dataclasses.replace`` to run another tile, launch shape or z layout of the same kernels.
    With ``n_frames``, ``atoms`` are that many frames, frame-major, and the result is (n_frames, *grid shape).
    """
    if atoms.u_aniso is not None or atoms.radiation == "neutron":
        return _splat_aniso(atoms, plan, n_frames, radius_rule)
    xyz, b_iso, occ, a, b = _kernel_inputs(atoms)
    shape = plan.shape if n_frames is None else (n_frames, *plan.shape)
    n_frames = n_frames or 1
    call = (plan, n_frames, shape)
    if torch.is_grad_enabled() and (xyz.requires_grad or b_iso.requires_grad or occ.requires_grad):
        return _SplatTriton.apply(call, xyz, b_iso, occ, a, b)
    # no autograd node to build (its apply alone costs ~15 µs of host time)
    return _iso_forward(call, xyz, b_iso, occ, a, b)[0]


def _kernel_xyz(atoms: AtomSet) -> torch.Tensor:
    """Positions as the kernels read them: float64 positions as they are (contiguous), the rest float32.

    The kernels wrap float64 positions into the cell in float64, so the float32 offsets they work with are
    exact, and mask non-finite atoms, within the splat launch.
    """
    xyz = atoms.xyz
    if xyz.dtype != torch.float64:
        return _as_kernel_input(xyz, "splat_triton")
    return xyz if xyz.is_contiguous() else xyz.contiguous()


def _kernel_inputs(atoms: AtomSet):
    """(xyz, b_iso, occ, a, b) as the isotropic kernels read them (:func:`_kernel_xyz`; the rest float32)."""
    op = "splat_triton"
    b_iso = _as_kernel_input(atoms.b_iso, op)
    occ = _as_kernel_input(atoms.occ, op)
    return _kernel_xyz(atoms), b_iso, occ, _as_kernel_input(atoms.a, op), _as_kernel_input(atoms.b, op)


def _kernel_inputs_aniso(atoms: AtomSet):
    """(xyz, u, aniso, b_iso, occ, a, b) as the anisotropic kernels read them.

    xyz keeps float64 (wrapped in the kernels), aniso stays bool, the rest float32; all contiguous. An
    isotropic set (neutrons) gets a zero U with no atom flagged: every atom then takes U = B/(8π²)·I in
    the kernel and its gradient goes to b_iso, as for the isotropic atoms of a mixed set.
    """
    op = "splat_triton"
    xyz = _kernel_xyz(atoms)
    if atoms.u_aniso is not None:
        u = _as_kernel_input(atoms.u_aniso, op)
        aniso = atoms.aniso if atoms.aniso.is_contiguous() else atoms.aniso.contiguous()
    else:
        u = torch.zeros((len(atoms), 6), dtype=torch.float32, device=xyz.device)
        aniso = torch.zeros(len(atoms), dtype=torch.bool, device=xyz.device)
    rest = (_as_kernel_input(t, op) for t in (atoms.b_iso, atoms.occ, atoms.a, atoms.b))
    return (xyz, u, aniso, *rest)


def _splat_aniso(atoms: AtomSet, plan: _Plan, n_frames: int | None, radius_rule: str) -> torch.Tensor:
    """:func:`_splat` for anisotropic and neutron sets: the anisotropic kernels, one launch each way."""
    xyz, u, aniso, b_iso, occ, a, b = _kernel_inputs_aniso(atoms)
    shape = plan.shape if n_frames is None else (n_frames, *plan.shape)
    n_frames = n_frames or 1
    call = (plan, n_frames, shape, _aniso_rule(plan, radius_rule), atoms.radiation == "neutron")
    wants = xyz.requires_grad or b_iso.requires_grad or occ.requires_grad or u.requires_grad
    if torch.is_grad_enabled() and wants:
        return _SplatAnisoTriton.apply(call, xyz, u, aniso, b_iso, occ, a, b)
    return _aniso_forward(call, xyz, u, aniso, b_iso, occ, a, b)[0]


def splat_frames_triton(
    atoms: AtomSet,
    grid: GridSpec,
    *,
    n_frames: int,
    radius: float | None = None,
    cutoff: float = DEFAULT_CUTOFF,
    radius_rule: str = "gemmi",
) -> torch.Tensor:
    """Density maps of ``n_frames`` frames of the same atoms, one forward and one backward launch.

    Parameters
    ----------
    atoms : AtomSet
        ``n_frames``·N atoms, frame-major (atom i belongs to frame i // N); tensors as for
        :func:`splat_triton`.
    grid : GridSpec
        Whole-cell grid.
    n_frames : int
        Number of frames F (≥ 1, dividing ``len(atoms)``).
    radius, cutoff, radius_rule
        As for :func:`splat_triton`.

    Returns
    -------
    torch.Tensor, shape (n_frames, *grid.shape), float32
        Map f is what :func:`splat_triton` gives for frame f's atoms; differentiable with respect to
        ``atoms.xyz``, ``atoms.b_iso``, ``atoms.occ`` and ``atoms.u_aniso`` (the backward reads frame f's
        slice of the incoming gradient for frame f's atoms).

    Raises
    ------
    ValueError
        ``n_frames`` not a positive integer dividing the number of atoms; ``radius``/``cutoff`` as for
        :func:`splat_triton`.
    """
    if isinstance(n_frames, bool) or not isinstance(n_frames, int) or n_frames < 1 or len(atoms) % n_frames:
        raise ValueError(
            f"n_frames must be a positive integer dividing the {len(atoms)} atoms (frame-major), got {n_frames!r}"
        )
    device, radius, cutoff = _check_call(atoms, grid, radius, cutoff, "splat_frames_triton", radius_rule)
    return _splat(atoms, _plan(grid, radius, cutoff, device), n_frames=n_frames, radius_rule=radius_rule)


# --------------------------------------------------------------------------- the backward alone


def map_vjp_triton(
    atoms: AtomSet,
    grid: GridSpec,
    grad: torch.Tensor,
    *,
    radius: float | None = None,
    cutoff: float = DEFAULT_CUTOFF,
    radius_rule: str = "gemmi",
):
    """Gradients of ``(grad · splat_triton(atoms, grid)).sum()`` without the forward splat.

    The backward kernel needs of the forward only each atom's cutoff radius: a fixed ``radius`` is the
    plan's, per-atom radii come from a launch that computes them as the forward kernel does (for
    anisotropic and neutron sets: the first launch of the deterministic forward, which computes them
    by the same device function as the splat). So the result is bit for bit what
    ``torch.autograd.grad`` of a forward gives, at the cost of the backward alone (and one cheap
    per-atom launch).

    Parameters
    ----------
    atoms : AtomSet
        As for :func:`splat_triton` (their ``requires_grad`` is not read).
    grid : GridSpec
        Whole-cell grid.
    grad : torch.Tensor, shape grid.shape
        ∂L/∂map, on the atoms' device (read as float32).
    radius, cutoff, radius_rule
        As for :func:`splat_triton`.

    Returns
    -------
    tuple of torch.Tensor
        ``(g_xyz, g_b_iso, g_occ, g_u_aniso)``: (N, 3) in xyz's dtype (float64 stays float64), (N,),
        (N,), and (N, 6) for an anisotropic or neutron set (None for an isotropic X-ray or electron
        set), float32, on the atoms' device; as :func:`splat_triton`'s backward gives them.
    """
    device, radius, cutoff = _check_call(atoms, grid, radius, cutoff, "map_vjp_triton", radius_rule)
    plan = _plan(grid, radius, cutoff, device)
    g = _float32_contiguous(grad.detach())
    if atoms.u_aniso is not None or atoms.radiation == "neutron":
        xyz, u, aniso, b_iso, occ, a, b = (t.detach() for t in _kernel_inputs_aniso(atoms))
        call = (plan, 1, plan.shape, _aniso_rule(plan, radius_rule), atoms.radiation == "neutron")
        radii = _aniso_radii_alone(plan, xyz, u, aniso, b_iso, occ, a, b, call[3], call[4])
        g_xyz, g_u, g_b, g_occ = _aniso_backward(call, g, xyz, u, aniso, b_iso, occ, a, b, radii)
        return g_xyz, g_b, g_occ, g_u
    xyz, b_iso, occ, a, b = (t.detach() for t in _kernel_inputs(atoms))
    radii = _radii_alone(plan, xyz, b_iso, occ, a, b) if plan.per_atom else b_iso
    return (*_iso_backward((plan, 1, plan.shape), g, xyz, b_iso, occ, a, b, radii), None)


def _radii_alone(plan: _Plan, xyz, b_iso, occ, a, b) -> torch.Tensor:
    """(N,) float32 per-atom radii as the isotropic forward writes them (``_splat_radii_kernel``).

    The inputs as :func:`_kernel_inputs` gives them; the plan's cutoff (``_plan(grid, None, cutoff, device)``).
    """
    from kernels.density._triton_kernels import _splat_radii_kernel

    n = xyz.shape[0]
    out = torch.empty(n, dtype=torch.float32, device=xyz.device)
    if n:
        block = _scale_block(xyz.device)
        _splat_radii_kernel[(ceil_div(n, block),)](xyz, b_iso, occ, a, b, out, plan.params, n, BLOCK=block, num_warps=4)
    return out


def _aniso_radii_alone(plan: _Plan, xyz, u, aniso, b_iso, occ, a, b, rule: int, neutron: bool) -> torch.Tensor:
    """(N,) float32 radii as the anisotropic forward writes them: the deterministic forward's first launch
    (its exponent goes to a scratch slot); ``b_iso`` itself under a fixed radius (rule 0: not read)."""
    n = xyz.shape[0]
    if not rule or not n:
        return b_iso
    device = xyz.device
    radii = torch.empty(n, dtype=torch.float32, device=device)
    fix = torch.zeros(1, dtype=torch.int64, device=device)
    block = _scale_block(device)
    _aniso_fixed_scale_launch(
        (ceil_div(n, block), 1, 1), (block, rule, neutron, xyz.dtype, device.index),
        (xyz, u, aniso.view(torch.uint8), b_iso, occ, a, b, radii, plan.params, fix, n, block, rule, neutron),
        device, 4,
    )  # fmt: skip
    return radii
