"""Triton density splat: forward (scatter) and backward (gather), float32 maps.

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
  isotropic kernels above are untouched by them. Each program forms its atoms' U as
  ``kernels.density.adp.effective_u`` does (so a mixed set is exact), and per form-factor term
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
import triton.language as tl

from kernels._launch import FastLauncher, ceil_div
from kernels._opdef import OpDef, eager_function, register
from kernels._util import positive_number, to_float32
from kernels.crystal import AtomSet, Cell, GridError, GridSpec
from kernels.density.ops import grid_of
from kernels.density.radius import DEFAULT_CUTOFF, RADIUS_RULES, cutoff_radius
from kernels.dispatch import BackendError, triton_interpreted

__all__ = ["splat_triton", "splat_frames_triton"]

_LOG2E = 1.4426950408889634
# Interpreter: atoms per program (it costs per program, not per element).
_INTERPRET_ATOMS = 64
# B (Å²) of the nominal carbon whose radius sets the tile size; larger atoms take more tiles.
_NOMINAL_B = 40.0


# --------------------------------------------------------------------------- device helpers


@triton.jit
def _density_slope(x, amp0, ex0, amp1, ex1, amp2, ex2, amp3, ex3, amp4, ex4):
    """ρ(x) and dρ/dx of the radial density Σ amp·exp(ex·x²) (ex < 0)."""
    x2 = x * x
    t0 = amp0 * tl.exp(ex0 * x2)
    t1 = amp1 * tl.exp(ex1 * x2)
    t2 = amp2 * tl.exp(ex2 * x2)
    t3 = amp3 * tl.exp(ex3 * x2)
    t4 = amp4 * tl.exp(ex4 * x2)
    y = t0 + t1 + t2 + t3 + t4
    dy = 2.0 * x * (ex0 * t0 + ex1 * t1 + ex2 * t2 + ex3 * t3 + ex4 * t4)
    return y, dy


@triton.jit
def _radial_coef(a_ptr, b_ptr, ia, valid, b_iso, k: tl.constexpr):
    """Amplitude (4π/B_k)^{3/2}·a_k (unit occupancy), α_k = 4π²/B_k and B_k of Gaussian k."""
    ak = tl.load(a_ptr + ia * 5 + k, mask=valid, other=0.0)
    bk = tl.load(b_ptr + ia * 5 + k, mask=valid, other=0.0) + b_iso
    s = 12.566370614359172 / bk
    return ak * s * tl.sqrt(s), 39.47841760435743 / bk, bk


@triton.jit
def _cutoff_radius(bb, a_ptr, b_ptr, ia, valid, cutoff, MAX_STEPS: tl.constexpr):
    """Radius in Å where each lane's atom density falls to ``cutoff`` (gemmi's estimate_radius), float32.

    Same steps as kernels.density.radius.cutoff_radius, lane-wise, each loop leaving as soon as no lane
    of the block still moves. bb: B in Å² per lane (finite; invalid lanes any positive value).
    """
    amp0, al0, _b0 = _radial_coef(a_ptr, b_ptr, ia, valid, bb, 0)
    amp1, al1, _b1 = _radial_coef(a_ptr, b_ptr, ia, valid, bb, 1)
    amp2, al2, _b2 = _radial_coef(a_ptr, b_ptr, ia, valid, bb, 2)
    amp3, al3, _b3 = _radial_coef(a_ptr, b_ptr, ia, valid, bb, 3)
    amp4, al4, _b4 = _radial_coef(a_ptr, b_ptr, ia, valid, bb, 4)
    return _radius_search(bb, amp0, -al0, amp1, -al1, amp2, -al2, amp3, -al3, amp4, -al4, valid, cutoff, MAX_STEPS)


@triton.jit
def _radius_search(bb, amp0, ex0, amp1, ex1, amp2, ex2, amp3, ex3, amp4, ex4, valid, cutoff, MAX_STEPS: tl.constexpr):
    """gemmi's step search for ρ(x) = Σ amp_k·exp(ex_k·x²) started at its guess for B = bb, float32, lane-wise.

    The search of :func:`_cutoff_radius` for any five-term radial density (the anisotropic kernels pass the
    terms along an atom's major axis for the exact-sphere rule).
    """
    x1 = (8.5 + 0.075 * bb) / (2.4 + 0.0045 * bb)
    y1, dy = _density_slope(x1, amp0, ex0, amp1, ex1, amp2, ex2, amp3, ex3, amp4, ex4)
    # Move past a maximum (only reachable with addends; kept for fidelity).
    up = valid & (dy > 0)
    it = 0
    while (tl.max(up.to(tl.int32), axis=0) > 0) & (it < MAX_STEPS):
        x1 = tl.where(up, x1 + 1.0, x1)
        y1n, dyn = _density_slope(x1, amp0, ex0, amp1, ex1, amp2, ex2, amp3, ex3, amp4, ex4)
        y1 = tl.where(up, y1n, y1)
        dy = tl.where(up, dyn, dy)
        up = valid & (dy > 0)
        it += 1
    x2 = x1
    y2 = y1
    # Case A: the guess is already below the level: walk inwards in 0.5 Å steps.
    inward = valid & (y1 < cutoff)
    active = inward
    rose = valid & (y1 != y1)  # all False
    it = 0
    while (tl.max(active.to(tl.int32), axis=0) > 0) & (it < MAX_STEPS):
        step = active & (y1 < cutoff)
        x2 = tl.where(step, x1, x2)
        y2 = tl.where(step, y1, y2)
        x1 = tl.where(step, x1 - 0.5, x1)
        y1n, dyn = _density_slope(x1, amp0, ex0, amp1, ex1, amp2, ex2, amp3, ex3, amp4, ex4)
        y1 = tl.where(step, y1n, y1)
        dy = tl.where(step, dyn, dy)
        rising = step & (dy > 0)
        rose = rose | rising
        neg = step & (dy <= 0) & (x1 < 0)
        y0, _s0 = _density_slope(x1 * 0.0, amp0, ex0, amp1, ex1, amp2, ex2, amp3, ex3, amp4, ex4)
        x1 = tl.where(neg, 0.0, x1)
        y1 = tl.where(neg, y0, y1)
        active = step & (dy <= 0) & (neg == 0) & (y1 < cutoff)
        it += 1
    # Landed left of a maximum: walk back up in 0.1 Å steps (gemmi's rule).
    for _ in range(6):
        mv = rose & (dy > 0) & (x1 + 0.1 < x2)
        x1 = tl.where(mv, x1 + 0.1, x1)
        y1n, dyn = _density_slope(x1, amp0, ex0, amp1, ex1, amp2, ex2, amp3, ex3, amp4, ex4)
        y1 = tl.where(mv, y1n, y1)
        dy = tl.where(mv, dyn, dy)
    done_early = rose & (y1 < cutoff)
    # Case B: the guess is above the level: walk outwards in 0.5 Å steps.
    active = valid & (inward == 0)
    it = 0
    while (tl.max(active.to(tl.int32), axis=0) > 0) & (it < MAX_STEPS):
        step = active & (y2 > cutoff)
        x1 = tl.where(step, x2, x1)
        y1 = tl.where(step, y2, y1)
        x2 = tl.where(step, x2 + 0.5, x2)
        y2n, _s2 = _density_slope(x2, amp0, ex0, amp1, ex1, amp2, ex2, amp3, ex3, amp4, ex4)
        y2 = tl.where(step, y2n, y2)
        active = step & (y2 > cutoff)
        it += 1
    denom = y1 - y2
    safe = tl.where(denom == 0, 1.0, denom)
    radius = tl.where(denom == 0, x1, x1 + (x1 - x2) / safe * (cutoff - y1))
    radius = tl.where(done_early, x1, radius)
    return tl.maximum(radius, 0.0)


@triton.jit
def _radius_kernel(
    b_iso_ptr,  # (N,) float32, Å²
    a_ptr,  # (N, 5) float32
    b_ptr,  # (N, 5) float32, Å²
    out_ptr,  # (N,) float32, Å (written)
    n_atoms,
    cutoff,  # float, e/Å³
    MAX_STEPS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # The splat's forward computes the same radii itself; this kernel serves tests and benchmarks.
    ia = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = ia < n_atoms
    bb = tl.load(b_iso_ptr + ia, mask=valid, other=1.0)
    tl.store(out_ptr + ia, _cutoff_radius(bb, a_ptr, b_ptr, ia, valid, cutoff, MAX_STEPS), mask=valid)


_FIX_ARGS = ("xyz_ptr", "b_iso_ptr", "occ_ptr", "a_ptr", "b_ptr", "radius_ptr", "p_ptr", "fix_ptr")


@triton.jit
def _wrap(v, n):
    """v modulo n in [0, n): integer % truncates toward zero on the GPU and in the interpreter."""
    return ((v % n) + n) % n


@triton.jit
def _plan_scalars(p_ptr):
    """The plan's constants from its packed float64 tensor (layout: ``_Plan.build``).

    Returns nx, ny, nz (int32), the voxel-unit metric h00, h11, h22, h01, h02, h12 and the reach rx, ry, rz
    (float32: voxels of box half-extent per Å of radius), the fixed radius (Å) and the cutoff (e/Å³), float32.
    """
    nx = tl.load(p_ptr + 9).to(tl.int32)
    ny = tl.load(p_ptr + 10).to(tl.int32)
    nz = tl.load(p_ptr + 11).to(tl.int32)
    h00 = tl.load(p_ptr + 12).to(tl.float32)
    h11 = tl.load(p_ptr + 13).to(tl.float32)
    h22 = tl.load(p_ptr + 14).to(tl.float32)
    h01 = tl.load(p_ptr + 15).to(tl.float32)
    h02 = tl.load(p_ptr + 16).to(tl.float32)
    h12 = tl.load(p_ptr + 17).to(tl.float32)
    rx = tl.load(p_ptr + 18).to(tl.float32)
    ry = tl.load(p_ptr + 19).to(tl.float32)
    rz = tl.load(p_ptr + 20).to(tl.float32)
    radius_all = tl.load(p_ptr + 21).to(tl.float32)
    cutoff = tl.load(p_ptr + 22).to(tl.float32)
    return nx, ny, nz, h00, h11, h22, h01, h02, h12, rx, ry, rz, radius_all, cutoff


@triton.jit
def _cell_coordinate(f, n, n_f):
    """Fractional coordinate f (float64, finite) wrapped into the cell: sub-voxel offset (float32) and voxel in [0, n).

    f − floor(f) is exact for any finite float64 f, so a lattice translation of any size changes nothing
    but rounding far below float32. (f − floor(f))·n may round up to n: that is voxel 0 at offset 0.
    """
    c = (f - tl.floor(f)) * n_f
    fl = tl.floor(c)
    v = fl.to(tl.int32)
    return (c - fl).to(tl.float32), tl.where(v >= n, v - n, v)


@triton.jit
def _atom_inputs(xyz_ptr, b_iso_ptr, occ_ptr, p_ptr, ia, valid, nx, ny, nz):
    """Per-atom centre and values, shape (ATOMS,) each: sub-voxel offsets t, base voxel b, B, occupancy, ok.

    Positions are read in their own dtype (float32 or float64) and taken to fractional coordinates in
    float64 before anything is rounded to float32. ``ok``: in range and a finite position (also after
    frac·xyz), B and occupancy; an atom that is not ok gets zero extent, B = 1 and occupancy 0, so it adds
    nothing and its gradients are exact zeros (no NaN reaches the map or a gradient).
    """
    x = tl.load(xyz_ptr + ia * 3 + 0, mask=valid, other=0.0).to(tl.float64)
    y = tl.load(xyz_ptr + ia * 3 + 1, mask=valid, other=0.0).to(tl.float64)
    z = tl.load(xyz_ptr + ia * 3 + 2, mask=valid, other=0.0).to(tl.float64)
    fx = tl.load(p_ptr + 0) * x + tl.load(p_ptr + 1) * y + tl.load(p_ptr + 2) * z
    fy = tl.load(p_ptr + 3) * x + tl.load(p_ptr + 4) * y + tl.load(p_ptr + 5) * z
    fz = tl.load(p_ptr + 6) * x + tl.load(p_ptr + 7) * y + tl.load(p_ptr + 8) * z
    b_iso = tl.load(b_iso_ptr + ia, mask=valid, other=1.0)
    occ = tl.load(occ_ptr + ia, mask=valid, other=0.0)
    # v − v == 0 exactly when v is finite (inf − inf and NaN are NaN).
    ok = valid & (fx - fx == 0) & (fy - fy == 0) & (fz - fz == 0) & (b_iso - b_iso == 0) & (occ - occ == 0)
    tx, bx = _cell_coordinate(tl.where(ok, fx, 0.0), nx, tl.load(p_ptr + 9))
    ty, by = _cell_coordinate(tl.where(ok, fy, 0.0), ny, tl.load(p_ptr + 10))
    tz, bz = _cell_coordinate(tl.where(ok, fz, 0.0), nz, tl.load(p_ptr + 11))
    return tx, ty, tz, bx, by, bz, tl.where(ok, b_iso, 1.0), tl.where(ok, occ, 0.0), ok


@triton.jit
def _atom_box(tx, ty, tz, rad, ok, rx, ry, rz):
    """Box of voxels [lo, lo + cnt) per axis around each atom (from its base voxel) and R², (ATOMS,) each.

    |offset along axis i| < R·|a*_i|·n_i for every voxel with r < R; an atom that is not ok has cnt = 0.
    """
    lox = tl.floor(tx - rad * rx)
    loy = tl.floor(ty - rad * ry)
    loz = tl.floor(tz - rad * rz)
    cntx = tl.where(ok, (-tl.floor(-(tx + rad * rx)) - lox + 1.0).to(tl.int32), 0)
    cnty = tl.where(ok, (-tl.floor(-(ty + rad * ry)) - loy + 1.0).to(tl.int32), 0)
    cntz = tl.where(ok, (-tl.floor(-(tz + rad * rz)) - loz + 1.0).to(tl.int32), 0)
    return lox.to(tl.int32), loy.to(tl.int32), loz.to(tl.int32), cntx, cnty, cntz, rad * rad


@triton.jit
def _frame_offset(ia, atoms_per_frame, nx, ny, nz, INDEX64: tl.constexpr):
    """Offset of each atom's map in a stack of frames, (ATOMS, 1, 1): (atom // atoms_per_frame)·nx·ny·nz."""
    frame = ia // atoms_per_frame
    if INDEX64:
        frame = frame.to(tl.int64)
    return (frame * (nx * ny * nz))[:, None, None]


@triton.jit
def _vec_z_box(bz, loz, cntz):
    """z box of the VEC layout: start rounded down to a multiple of 4 in absolute grid index, length to one of 4.

    With nz % 4 == 0 every group of 4 lanes from there is one aligned 16-byte run inside one row
    (a group never straddles the periodic wrap), so it can take one vector atomic or load.
    """
    sh = _wrap(bz + loz, 4)
    return loz - sh, tl.where(cntz > 0, (cntz + sh + 3) // 4 * 4, 0)


@triton.jit
def _z_lanes(qc, qq, loz, cntz, bz, tz, nz, BQ: tl.constexpr, VEC: tl.constexpr):
    """z lanes of chunk ``qc``, shapes (ATOMS, 1, BQ).

    Returns the offset from the base voxel of each lane's group (the lane's own offset
    without VEC), dz, the grid index and whether the lane (its group with VEC) is in the box.
    With VEC the group's start is wrapped and declared a multiple of 4 and the lane adds
    qq % 4, so Triton's axis analysis sees offsets contiguous and 16-byte aligned in 4s, and
    every mask built from group quantities is constant over each group of 4.
    """
    kz = qc * BQ + qq
    dz = (loz + kz).to(tl.float32) - tz
    if VEC:
        kg = qc * BQ + (qq // 4) * 4
        ozg = loz + kg
        # The wrap is written out (not _wrap): a hint on a call's result is lost when the call is inlined.
        iz = tl.multiple_of(((bz + ozg) % nz + nz) % nz, [4, 4, 4]) + qq % 4
        in_z = kg < cntz
    else:
        ozg = loz + kz
        iz = _wrap(bz + ozg, nz)
        in_z = kz < cntz
    return ozg, dz, iz, in_z


@triton.jit
def _group_r2min(ozg, tz, lin, q0, h22, inv_h22):
    """Lower bound of r² over a group's 4 voxels: min over real dz in [ozg − tz, ozg − tz + 3] of h22·dz² + 2·lin·dz + q0.

    Computed from the group's start only, so its value is the same for the 4 lanes of a group.
    """
    dzg = ozg.to(tl.float32) - tz
    d = tl.minimum(tl.maximum(-lin * inv_h22, dzg), dzg + 3.0)
    return q0 + d * (2.0 * lin + h22 * d)


@triton.jit
def _rows_of_span(lo_dy, hi_dy, off, top):
    """Box rows [r_lo, r_hi) whose offset dy = r − off lies in [lo_dy, hi_dy] widened by 1e-3 voxel, (ATOMS,) int32.

    ``off`` = ty − loy and ``top`` = the box's row count, as floats; the rows are clamped to [0, top],
    and r_hi ≤ r_lo when none is left.
    """
    r_lo = tl.minimum(tl.maximum(-tl.floor(-(lo_dy + off - 1e-3)), 0.0), top)
    r_hi = tl.minimum(tl.maximum(tl.floor(hi_dy + off + 1e-3) + 1.0, 0.0), top)
    return r_lo.to(tl.int32), r_hi.to(tl.int32)


@triton.jit
def _edge_min(u, v0, v1, huu, huv, hvv):
    """min over v in [v0, v1] of huu·u² + 2·huv·u·v + hvv·v² (hvv > 0)."""
    v = tl.minimum(tl.maximum(-huv * u / hvv, v0), v1)
    return u * (huu * u + 2.0 * huv * v) + hvv * v * v


@triton.jit
def _tile_rows_separable(kx0, kx1, kz0, kz1, x_lo, z_lo, r2lim, h00, h11, h22, h02, off, top):
    """Rows [r_lo, r_hi) of the box where a voxel of the (x, z) tile [kx0, kx1] × [kz0, kz1] (box steps,
    inclusive) can have r² = qxz + h11·dy² < r2lim on a separable cell, each (ATOMS,) int32.

    x_lo, z_lo: the box's first dx, dz (voxels from the centre); off, top: as in _rows_of_span.

    qxz = h00·dx² + 2·h02·dx·dz + h22·dz² is bounded below by its minimum over the tile's rectangle
    (0 when the centre's column is in it, else on an edge), a few scalar flops per tile; then
    |dy| ≤ √((r2lim − min qxz)/h11). r2lim is R² widened by 0.1 %, far above float32 rounding, so no row
    holding a voxel with r² < R² is dropped. Corner tiles of a box then walk a few rows instead of all
    of them (3wip at 0.67 Å: 39 % fewer row trips with 8×16 tiles).
    """
    x0 = x_lo + kx0.to(tl.float32)
    x1 = x_lo + kx1.to(tl.float32)
    z0 = z_lo + kz0.to(tl.float32)
    z1 = z_lo + kz1.to(tl.float32)
    qmin = tl.minimum(
        tl.minimum(_edge_min(x0, z0, z1, h00, h02, h22), _edge_min(x1, z0, z1, h00, h02, h22)),
        tl.minimum(_edge_min(z0, x0, x1, h22, h02, h00), _edge_min(z1, x0, x1, h22, h02, h00)),
    )
    qmin = tl.where((x0 <= 0) & (x1 >= 0) & (z0 <= 0) & (z1 >= 0), 0.0, qmin)
    room = tl.where((kx1 >= kx0) & (kz1 >= kz0), r2lim - qmin, -1.0)
    half = tl.where(room > 0, tl.sqrt(tl.maximum(room, 0.0) / h11), -2.0)
    return _rows_of_span(-half, half, off, top)


@triton.jit
def _tile_rows(qxz, lin, in_xz, r2lim, h11, off, top):
    """Rows [r_lo, r_hi) of the box where a voxel of this (x, z) tile can have r² < r2lim, each (ATOMS,) int32.

    Any cell: r² = qxz + lin·dy + h11·dy² along a lane's column (dy = loy + r − ty in voxels), so each
    lane's rows are (dy − c)² ≤ (r2lim − qxz)/h11 + c², c = −lin/(2·h11), and the tile takes their
    union (two reductions over the tile). r2lim is R² widened by 0.1 %, as for the separable span.
    """
    c = lin * (-0.5 / h11)
    disc = (r2lim[:, None, None] - qxz) / h11 + c * c
    ok = in_xz & (disc > 0)
    half = tl.sqrt(tl.maximum(disc, 0.0))
    lo_dy = tl.min(tl.min(tl.where(ok, c - half, 3.0e38), axis=2), axis=1)
    hi_dy = tl.max(tl.max(tl.where(ok, c + half, -3.0e38), axis=2), axis=1)
    return _rows_of_span(lo_dy, hi_dy, off, top)


@triton.jit
def _tile_row_walk(
    pc, qc, cntx, cntz, qxz, lin, in_xz, x_lo, z_lo, r2lim, h00, h11, h22, h02, off_y, top_y, iy0, ny, n_rows,
    BP: tl.constexpr, BQ: tl.constexpr, SEPARABLE: tl.constexpr,
):  # fmt: skip
    """The row loop of tile (pc, qc): its first row, its end, the wrapped grid row of the first, and each
    atom's own rows [r_lo, r_hi) (ATOMS, 1, 1).

    Only the rows where a voxel of the tile can lie inside the sphere (``_tile_rows_separable`` or
    ``_tile_rows``). iy0, cntx, cntz, x_lo, z_lo, off_y, top_y, r2lim: per atom, (ATOMS,); lin: not read on
    separable cells.
    """
    if SEPARABLE:
        r_lo, r_hi = _tile_rows_separable(
            pc * BP, tl.minimum(cntx, pc * BP + BP) - 1, qc * BQ, tl.minimum(cntz, qc * BQ + BQ) - 1,
            x_lo, z_lo, r2lim, h00, h11, h22, h02, off_y, top_y,
        )  # fmt: skip
    else:
        r_lo, r_hi = _tile_rows(qxz, lin, in_xz, r2lim, h11, off_y, top_y)
    r = tl.min(tl.where(r_hi > r_lo, r_lo, n_rows), axis=0)
    r_end = tl.max(r_hi, axis=0)
    iy = _wrap(iy0 + r, ny)[:, None, None]
    return r, r_end, iy, r_lo[:, None, None], r_hi[:, None, None]


@triton.jit
def _separable_row(r, off_y, h11, in_xz, gmin, r2lim, lim, VEC: tl.constexpr):
    """Box row r of a tile in the separable backward: dy, qy = h11·dy² and the lanes to load.

    With VEC the group mask (a lower bound of r² over each group of 4 z lanes: one 128-bit load per
    group on sm_90; the caller zeroes lanes outside the sphere once the load is in flight), otherwise
    the lanes with qy < lim = R² − qxz. gmin is not read without VEC.
    """
    dy = r.to(tl.float32) - off_y
    qy = h11 * dy * dy
    if VEC:
        inside = in_xz & tl.max_constancy(gmin + qy < r2lim, [1, 1, 4])
    else:
        inside = in_xz & (qy < lim)
    return dy, qy, inside


@triton.jit
def _exp2_sum(c0, c1, c2, c3, c4, be0, be1, be2, be3, be4, q):
    """Σ_k c_k·2^(−be_k·q) over the five Gaussians (be_k = α_k·log2 e), broadcast over q's and the c_k's shapes."""
    return (
        c0 * tl.exp2(-be0 * q)
        + c1 * tl.exp2(-be1 * q)
        + c2 * tl.exp2(-be2 * q)
        + c3 * tl.exp2(-be3 * q)
        + c4 * tl.exp2(-be4 * q)
    )


@triton.jit
def _row_sums(g, dy, qy, be0, be1, be2, be3, be4, t0, t1, t2, t3, t4, yd0, yd1, yd2, yd3, yd4, v0, v1, v2, v3, v4):
    """One row of the separable backward: Σ_rows g·y_k, g·y_k·dy, g·y_k·qy += this row's (15 FMAs per voxel).

    y_k = exp(−α_k·qy) of the row, and y_k·dy, y_k·qy, are per-atom scalars; g: the row's masked gradient.
    """
    y0 = tl.exp2(-be0 * qy)
    y1 = tl.exp2(-be1 * qy)
    y2 = tl.exp2(-be2 * qy)
    y3 = tl.exp2(-be3 * qy)
    y4 = tl.exp2(-be4 * qy)
    return (
        t0 + g * y0,
        t1 + g * y1,
        t2 + g * y2,
        t3 + g * y3,
        t4 + g * y4,
        yd0 + g * (y0 * dy),
        yd1 + g * (y1 * dy),
        yd2 + g * (y2 * dy),
        yd3 + g * (y3 * dy),
        yd4 + g * (y4 * dy),
        v0 + g * (y0 * qy),
        v1 + g * (y1 * qy),
        v2 + g * (y2 * qy),
        v3 + g * (y3 * qy),
        v4 + g * (y4 * qy),
    )


# --------------------------------------------------------------------------- deterministic mode
#
# With torch.use_deterministic_algorithms(True) the forward adds each contribution as a 64-bit integer,
# round(ρ·2^S), with integer atomics: integer addition is associative, so the map is the same bit for bit
# whatever the order the GPU adds in (run to run, and with the atoms permuted). S comes from the data, on
# the device: _fixed_scale_kernel takes, per atom, an exponent e with 2^e ≥ 2·(the atom's largest
# contribution, |occ|·Σ_k |amp_k|)·(the times its box wraps onto one voxel) and the largest e over the atoms
# with an integer atomic max (exact, order-free); then S = 62 − ⌈log2 N⌉ − e_max for N atoms per map, so
# |Σ| ≤ N·2^(e_max − 1)·2^S ≤ 2^61 and no sum can overflow. docs/kernels.md, "Determinism", has the scale.
# The slot holds e + 256 (e ≥ −149 for any float32 bound), so its zero fill stands below every exponent;
# 2000 marks an atom whose bound is not finite: the map then comes back NaN.


@triton.jit
def _fixed_shift(fix_ptr, fix_shift):
    """S = fix_shift − e_max (int32), clamped to float32's normal exponents [−126, 127]."""
    s = fix_shift + 256 - tl.load(fix_ptr).to(tl.int32)
    return tl.minimum(tl.maximum(s, -126), 127)


@triton.jit
def _fixed_scale(fix_ptr, fix_shift):
    """2^S (float32, exact: built from its exponent bits), the fixed-point scale of the deterministic forward."""
    return ((_fixed_shift(fix_ptr, fix_shift) + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _to_fixed(val, scale):
    """round(val·scale) as int64: val·scale is exact (a power of two), |val·scale| < 2^62."""
    return tl.floor(val * scale + 0.5).to(tl.int64)


@triton.jit
def _fixed_exponent(peak, cntx, cnty, cntz, nx, ny, nz, valid):
    """Largest over the lanes of ⌈log2(peak·wraps)⌉ + 1 + 256 (int64; 0 when every peak is 0, 2000 when one is
    not finite). wraps = ⌈cnt/n⌉ per axis: how often a box wider than the cell covers one voxel."""
    wraps = ((cntx + nx - 1) // nx) * ((cnty + ny - 1) // ny) * ((cntz + nz - 1) // nz)
    top = peak * tl.maximum(wraps, 1).to(tl.float32)
    e = tl.where(top > 0, tl.ceil(tl.log2(tl.where(top > 0, top, 1.0))) + 257.0, 0.0)
    e = tl.where(top - top == 0, e, 2000.0)  # inf and NaN
    return tl.max(tl.where(valid, e, 0.0), axis=0).to(tl.int64)


@triton.jit(do_not_specialize=(*_FIX_ARGS, "n_atoms"), do_not_specialize_on_alignment=_FIX_ARGS)
def _fixed_scale_kernel(
    xyz_ptr,  # (N, 3) float32 or float64, Å
    b_iso_ptr,  # (N,) float32, Å²
    occ_ptr,  # (N,) float32
    a_ptr,  # (N, 5) float32
    b_ptr,  # (N, 5) float32, Å²
    radius_ptr,  # (N,) float32, Å: written with each atom's cutoff radius when PER_ATOM_RADIUS
    p_ptr,  # (41,) float64, the plan's constants
    fix_ptr,  # (1,) int64, zero-filled: atomic max of the atoms' exponents
    n_atoms,
    BLOCK: tl.constexpr,
    PER_ATOM_RADIUS: tl.constexpr,
):
    """Deterministic isotropic forward, first launch: each atom's radius (as the forward computes it) and
    the largest exponent of :func:`_fixed_exponent` over the atoms."""
    ia = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = ia < n_atoms
    nx, ny, nz, h00, h11, h22, h01, h02, h12, rx, ry, rz, radius_all, cutoff = _plan_scalars(p_ptr)
    tx, ty, tz, bx, by, bz, b_iso, occ, ok = _atom_inputs(xyz_ptr, b_iso_ptr, occ_ptr, p_ptr, ia, valid, nx, ny, nz)
    if PER_ATOM_RADIUS:
        rad = _cutoff_radius(b_iso, a_ptr, b_ptr, ia, ok, cutoff, 80)
        tl.store(radius_ptr + ia, rad, mask=valid)
    else:
        rad = tl.zeros_like(tx) + radius_all
    _lx, _ly, _lz, cntx, cnty, cntz, _r2 = _atom_box(tx, ty, tz, rad, ok, rx, ry, rz)
    peak = tl.zeros_like(b_iso)
    for k in tl.static_range(5):  # |occ|·Σ_k |amp_k| bounds every contribution (each exp ≤ 1)
        amp, _al, _bk = _radial_coef(a_ptr, b_ptr, ia, valid, b_iso, k)
        peak += tl.abs(amp)
    peak = tl.abs(occ) * peak
    tl.atomic_max(fix_ptr, _fixed_exponent(peak, cntx, cnty, cntz, nx, ny, nz, valid), sem="relaxed")


@triton.jit(do_not_specialize=("n", "fix_shift"), do_not_specialize_on_alignment=("fix_ptr",))
def _fixed_to_float_kernel(
    acc_ptr,  # (n,) int64, the fixed-point sums
    fix_ptr,  # (1,) int64, e_max
    out_ptr,  # (n,) float32, written: acc·2^−S (NaN everywhere when an atom's bound was not finite)
    n,
    fix_shift,
    BLOCK: tl.constexpr,
):
    """Deterministic forward, last launch: the map from its fixed-point sums (one rounding, to float32)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    e = tl.load(fix_ptr)
    inv = ((1023 - _fixed_shift(fix_ptr, fix_shift)).to(tl.int64) << 52).to(tl.float64, bitcast=True)  # 2^−S
    v = tl.load(acc_ptr + i, mask=m, other=0).to(tl.float64) * inv
    v = tl.where(e >= 2000, float("nan"), v)
    tl.store(out_ptr + i, v.to(tl.float32), mask=m)


# --------------------------------------------------------------------------- kernels


# Per-atom pointers and integers unspecialised: one compiled kernel serves every atom count and every
# (possibly offset) view of the atoms' tensors, which the direct launch (``_launch``) relies on. The map
# keeps its 16-byte alignment specialisation (vector atomics).
_ATOM_ARGS = ("xyz_ptr", "b_iso_ptr", "occ_ptr", "a_ptr", "b_ptr", "radius_ptr", "p_ptr")


@triton.jit(
    do_not_specialize=(*_ATOM_ARGS, "fix_ptr", "n_atoms", "atoms_per_frame", "fix_shift"),
    do_not_specialize_on_alignment=(*_ATOM_ARGS, "fix_ptr"),
)
def _splat_fwd_kernel(
    xyz_ptr,  # (N, 3) float32 or float64, Å
    b_iso_ptr,  # (N,) float32, Å²
    occ_ptr,  # (N,) float32
    a_ptr,  # (N, 5) float32, IT92 amplitudes (c as the 5th)
    b_ptr,  # (N, 5) float32, IT92 widths in Å² (0 for c)
    radius_ptr,  # (N,) float32, Å: written with each atom's cutoff radius when PER_ATOM_RADIUS (the backward's)
    p_ptr,  # (41,) float64, the plan's constants (layout: _Plan.build)
    out_ptr,  # (nx·ny·nz,) float32 (FRAMES: (F·nx·ny·nz,)), zero-filled; accumulated with atomics (FIXED: int64)
    fix_ptr,  # (1,) int64, the largest atom exponent (_fixed_scale_kernel); read when FIXED
    n_atoms,
    atoms_per_frame,  # atoms of one frame (read when FRAMES)
    fix_shift,  # 62 − ⌈log2(atoms of one map)⌉ (read when FIXED)
    ATOMS: tl.constexpr,
    BP: tl.constexpr,
    BQ: tl.constexpr,
    SEPARABLE: tl.constexpr,
    PER_ATOM_RADIUS: tl.constexpr,
    INDEX64: tl.constexpr,
    VEC: tl.constexpr,
    FRAMES: tl.constexpr,
    ZSEP: tl.constexpr,  # hexagonal kind (h02 = h12 = 0): exp(−α r²) = E(x, y)·e(z); read when not SEPARABLE
    FIXED: tl.constexpr,  # deterministic mode: int64 fixed-point adds into out_ptr, radii read from radius_ptr
):
    ia = tl.program_id(0) * ATOMS + tl.arange(0, ATOMS)
    valid = ia < n_atoms
    nx, ny, nz, h00, h11, h22, h01, h02, h12, rx, ry, rz, radius_all, cutoff = _plan_scalars(p_ptr)
    tx, ty, tz, bx, by, bz, b_iso, occ, ok = _atom_inputs(xyz_ptr, b_iso_ptr, occ_ptr, p_ptr, ia, valid, nx, ny, nz)
    if PER_ATOM_RADIUS and FIXED:
        rad = tl.load(radius_ptr + ia, mask=valid, other=0.0)  # computed by _fixed_scale_kernel
    elif PER_ATOM_RADIUS:
        # Computed here (no launch of its own) and kept for the backward, which reads the same radii.
        rad = _cutoff_radius(b_iso, a_ptr, b_ptr, ia, ok, cutoff, 80)
        tl.store(radius_ptr + ia, rad, mask=valid)
    else:
        rad = tl.zeros_like(tx) + radius_all
    if FIXED:
        scale = _fixed_scale(fix_ptr, fix_shift)
    lox, loy, loz, cntx, cnty, cntz, r2max = _atom_box(tx, ty, tz, rad, ok, rx, ry, rz)
    amp0, al0, _b0 = _radial_coef(a_ptr, b_ptr, ia, valid, b_iso, 0)
    amp1, al1, _b1 = _radial_coef(a_ptr, b_ptr, ia, valid, b_iso, 1)
    amp2, al2, _b2 = _radial_coef(a_ptr, b_ptr, ia, valid, b_iso, 2)
    amp3, al3, _b3 = _radial_coef(a_ptr, b_ptr, ia, valid, b_iso, 3)
    amp4, al4, _b4 = _radial_coef(a_ptr, b_ptr, ia, valid, b_iso, 4)
    # (ATOMS, 1, 1): per-atom scalars broadcast over the tile.
    amp0 = (amp0 * occ)[:, None, None]
    amp1 = (amp1 * occ)[:, None, None]
    amp2 = (amp2 * occ)[:, None, None]
    amp3 = (amp3 * occ)[:, None, None]
    amp4 = (amp4 * occ)[:, None, None]
    be0 = (al0 * 1.4426950408889634)[:, None, None]
    be1 = (al1 * 1.4426950408889634)[:, None, None]
    be2 = (al2 * 1.4426950408889634)[:, None, None]
    be3 = (al3 * 1.4426950408889634)[:, None, None]
    be4 = (al4 * 1.4426950408889634)[:, None, None]
    # Group masks and row spans test lower bounds of r² against R² widened by 0.1 %, far above float32
    # rounding (~1e-6 relative), so a group or row holding a voxel with r² < R² is never masked off.
    r2lim_a = r2max * 1.001  # (ATOMS,)
    r2lim = r2lim_a[:, None, None]
    r2max = r2max[:, None, None]
    if VEC:
        nz = nz // 4 * 4  # the host sends nz % 4 == 0: lets the axis analysis see nz and row strides divide by 4
        loz, cntz = _vec_z_box(bz, loz, cntz)
        inv_h22 = 1.0 / h22
    if FRAMES:
        fo = _frame_offset(ia, atoms_per_frame, nx, ny, nz, INDEX64)
    n_pc = tl.cdiv(tl.max(cntx, axis=0), BP)
    n_qc = tl.cdiv(tl.max(cntz, axis=0), BQ)
    n_rows = tl.max(cnty, axis=0)
    # (ATOMS,) floats for the per-tile row spans: the box's first dx, dz, and dy = r − off_y.
    x_lo = lox.to(tl.float32) - tx
    z_lo = loz.to(tl.float32) - tz
    off_y = ty - loy.to(tl.float32)
    top_y = cnty.to(tl.float32)
    tx = tx[:, None, None]
    ty = ty[:, None, None]
    tz = tz[:, None, None]
    # Wrapped grid row of box row 0, (ATOMS,); the walk steps it by one per row trip (a modulo per row
    # would cost ~30 instructions of each trip).
    iy0 = _wrap(by + loy, ny)
    off_y3 = off_y[:, None, None]
    pp = tl.arange(0, BP)[None, :, None]
    qq = tl.arange(0, BQ)[None, None, :]
    pc = 0
    while pc < n_pc:
        kx = pc * BP + pp  # (1, BP, 1) step inside the box
        ox = lox[:, None, None] + kx
        dx = ox.to(tl.float32) - tx
        ix = _wrap(bx[:, None, None] + ox, nx)
        if INDEX64:
            ix = ix.to(tl.int64)
        in_x = kx < cntx[:, None, None]
        if VEC:
            lz = h02 * dx  # (ATOMS, BP, 1): r² = h22·dz² + 2·lz·dz + q0x (+ y terms) along the x lane
            q0x = h00 * dx * dx
        qc = 0
        while qc < n_qc:
            ozg, dz, iz, in_z = _z_lanes(
                qc, qq, loz[:, None, None], cntz[:, None, None], bz[:, None, None], tz, nz, BQ, VEC
            )
            in_xz = in_x & in_z
            if VEC and SEPARABLE:
                gmin = _group_r2min(ozg, tz, lz, q0x, h22, inv_h22)  # x–z part of the group's r² bound
            qxz = h00 * dx * dx + 2.0 * h02 * dx * dz + h22 * dz * dz  # (ATOMS, BP, BQ) Å²
            base_xz = ix * (ny * nz) + iz
            if FRAMES:
                base_xz += fo
            if SEPARABLE:
                q_lane = qxz  # E(x, z) per lane of the tile
                lin = qxz  # not read
            else:
                lin = 2.0 * (h01 * dx + h12 * dz)
                # ZSEP: e(z) per lane of the tile, (ATOMS, 1, BQ); the (x, y) part per x lane and row
                q_lane = h22 * dz * dz
                q0xy = h00 * dx * dx  # (ATOMS, BP, 1)
                lxy = 2.0 * h01 * dx
            if SEPARABLE or ZSEP:
                e0 = amp0 * tl.exp2(-be0 * q_lane)
                e1 = amp1 * tl.exp2(-be1 * q_lane)
                e2 = amp2 * tl.exp2(-be2 * q_lane)
                e3 = amp3 * tl.exp2(-be3 * q_lane)
                e4 = amp4 * tl.exp2(-be4 * q_lane)
            r, r_end, iy, r_lo, r_hi = _tile_row_walk(
                pc, qc, cntx, cntz, qxz, lin, in_xz, x_lo, z_lo, r2lim_a, h00, h11, h22, h02, off_y, top_y,
                iy0, ny, n_rows, BP, BQ, SEPARABLE,
            )  # fmt: skip
            while r < r_end:
                dy = r.to(tl.float32) - off_y3
                qy = h11 * dy * dy
                if SEPARABLE:
                    r2 = qxz + qy
                    val = _exp2_sum(e0, e1, e2, e3, e4, be0, be1, be2, be3, be4, qy)
                elif ZSEP:
                    qxy = q0xy + dy * lxy + qy  # (ATOMS, BP, 1)
                    r2 = qxy + q_lane
                    val = _exp2_sum(e0, e1, e2, e3, e4, be0, be1, be2, be3, be4, qxy)
                else:
                    r2 = qxz + dy * lin + qy
                    val = _exp2_sum(amp0, amp1, amp2, amp3, amp4, be0, be1, be2, be3, be4, r2)
                if VEC:
                    # Mask constant over each group of 4 z lanes (one v4 atomic per group on sm_90), lanes
                    # outside the sphere add an exact 0: the voxel set stays r² < R².
                    if SEPARABLE:
                        hit = gmin + qy < r2lim
                    else:
                        gmin = _group_r2min(ozg, tz, lz + h12 * dy, q0x + (2.0 * h01) * dx * dy + qy, h22, inv_h22)
                        hit = gmin < r2lim
                    # True by construction (hit is a function of the group's start only); Triton's axis
                    # analysis cannot see it through float ops, and its v4 lowering needs it.
                    hit = tl.max_constancy(hit, [1, 1, 4])
                    inside = in_xz & hit
                    val = tl.where(r2 < r2max, val, 0.0)
                else:
                    inside = in_xz & (r2 < r2max)
                if ATOMS > 1:  # one atom: the loop runs exactly its rows
                    inside = inside & (r >= r_lo) & (r < r_hi)
                if FIXED:
                    # Integer adds are scalar either way: only the voxels inside the sphere take one.
                    inside = inside & (r2 < r2max)
                    tl.atomic_add(out_ptr + (base_xz + iy * nz), _to_fixed(val, scale), mask=inside, sem="relaxed")
                else:
                    tl.atomic_add(out_ptr + (base_xz + iy * nz), val, mask=inside, sem="relaxed")
                iy += 1
                iy = tl.where(iy == ny, 0, iy)
                r += 1
            qc += 1
        pc += 1


_GRAD_ARGS = ("gxyz_ptr", "gb_ptr", "gocc_ptr")


@triton.jit(
    do_not_specialize=(*_ATOM_ARGS, *_GRAD_ARGS, "n_atoms", "atoms_per_frame"),
    do_not_specialize_on_alignment=(*_ATOM_ARGS, *_GRAD_ARGS),
)
def _splat_bwd_kernel(
    grad_ptr,  # (nx·ny·nz,) float32 (FRAMES: (F·nx·ny·nz,)), upstream gradient of the map
    xyz_ptr,  # (N, 3) float32 or float64, Å
    b_iso_ptr,  # (N,) float32, Å²
    occ_ptr,  # (N,) float32
    a_ptr,  # (N, 5) float32
    b_ptr,  # (N, 5) float32, Å²
    radius_ptr,  # (N,) float32, Å, the forward's radii (read when PER_ATOM_RADIUS)
    p_ptr,  # (41,) float64, the plan's constants (layout: _Plan.build)
    gxyz_ptr,  # (N, 3) the dtype of xyz, written: ∂L/∂xyz
    gb_ptr,  # (N,) float32, written: ∂L/∂b_iso
    gocc_ptr,  # (N,) float32, written: ∂L/∂occ
    n_atoms,
    atoms_per_frame,  # atoms of one frame (read when FRAMES)
    ATOMS: tl.constexpr,
    BP: tl.constexpr,
    BQ: tl.constexpr,
    SEPARABLE: tl.constexpr,
    PER_ATOM_RADIUS: tl.constexpr,
    INDEX64: tl.constexpr,
    VEC: tl.constexpr,
    FRAMES: tl.constexpr,
):
    ia = tl.program_id(0) * ATOMS + tl.arange(0, ATOMS)
    valid = ia < n_atoms
    nx, ny, nz, h00, h11, h22, h01, h02, h12, rx, ry, rz, radius_all, cutoff = _plan_scalars(p_ptr)
    tx, ty, tz, bx, by, bz, b_iso, occ, ok = _atom_inputs(xyz_ptr, b_iso_ptr, occ_ptr, p_ptr, ia, valid, nx, ny, nz)
    if PER_ATOM_RADIUS:
        rad = tl.load(radius_ptr + ia, mask=valid, other=0.0)
    else:
        rad = tl.zeros_like(tx) + radius_all
    lox, loy, loz, cntx, cnty, cntz, r2max = _atom_box(tx, ty, tz, rad, ok, rx, ry, rz)
    # Unit-occupancy amplitudes c_k and the weights of the three sums the gradients need:
    # u0 = Σ c_k e_k (ρ/occ), u1 = Σ c_k α_k e_k (−∂(ρ/occ)/∂r²), u2 = Σ c_k (α_k r² − 3/2)/B_k e_k (∂(ρ/occ)/∂B).
    c0, al0, w0 = _radial_coef(a_ptr, b_ptr, ia, valid, b_iso, 0)
    c1, al1, w1 = _radial_coef(a_ptr, b_ptr, ia, valid, b_iso, 1)
    c2, al2, w2 = _radial_coef(a_ptr, b_ptr, ia, valid, b_iso, 2)
    c3, al3, w3 = _radial_coef(a_ptr, b_ptr, ia, valid, b_iso, 3)
    c4, al4, w4 = _radial_coef(a_ptr, b_ptr, ia, valid, b_iso, 4)
    ca0 = (c0 * al0)[:, None, None]
    ca1 = (c1 * al1)[:, None, None]
    ca2 = (c2 * al2)[:, None, None]
    ca3 = (c3 * al3)[:, None, None]
    ca4 = (c4 * al4)[:, None, None]
    cab0 = (c0 * al0 / w0)[:, None, None]
    cab1 = (c1 * al1 / w1)[:, None, None]
    cab2 = (c2 * al2 / w2)[:, None, None]
    cab3 = (c3 * al3 / w3)[:, None, None]
    cab4 = (c4 * al4 / w4)[:, None, None]
    cb0 = (c0 * 1.5 / w0)[:, None, None]
    cb1 = (c1 * 1.5 / w1)[:, None, None]
    cb2 = (c2 * 1.5 / w2)[:, None, None]
    cb3 = (c3 * 1.5 / w3)[:, None, None]
    cb4 = (c4 * 1.5 / w4)[:, None, None]
    c0 = c0[:, None, None]
    c1 = c1[:, None, None]
    c2 = c2[:, None, None]
    c3 = c3[:, None, None]
    c4 = c4[:, None, None]
    be0 = (al0 * 1.4426950408889634)[:, None, None]
    be1 = (al1 * 1.4426950408889634)[:, None, None]
    be2 = (al2 * 1.4426950408889634)[:, None, None]
    be3 = (al3 * 1.4426950408889634)[:, None, None]
    be4 = (al4 * 1.4426950408889634)[:, None, None]
    # Group masks and row spans test lower bounds of r² against R² widened by 0.1 %, far above float32
    # rounding (~1e-6 relative), so a group or row holding a voxel with r² < R² is never masked off.
    r2lim_a = r2max * 1.001  # (ATOMS,)
    r2lim = r2lim_a[:, None, None]
    r2max = r2max[:, None, None]
    if VEC:
        nz = nz // 4 * 4  # the host sends nz % 4 == 0: lets the axis analysis see nz and row strides divide by 4
        loz, cntz = _vec_z_box(bz, loz, cntz)
        inv_h22 = 1.0 / h22
    if FRAMES:
        fo = _frame_offset(ia, atoms_per_frame, nx, ny, nz, INDEX64)
    n_pc = tl.cdiv(tl.max(cntx, axis=0), BP)
    n_qc = tl.cdiv(tl.max(cntz, axis=0), BQ)
    n_rows = tl.max(cnty, axis=0)
    # (ATOMS,) floats for the per-tile row spans: the box's first dx, dz, and dy = r − off_y.
    x_lo = lox.to(tl.float32) - tx
    z_lo = loz.to(tl.float32) - tz
    off_y = ty - loy.to(tl.float32)
    top_y = cnty.to(tl.float32)
    tx = tx[:, None, None]
    ty = ty[:, None, None]
    tz = tz[:, None, None]
    iy0 = _wrap(by + loy, ny)  # (ATOMS,) wrapped grid row of box row 0, stepped by one per row trip
    off_y3 = off_y[:, None, None]
    pp = tl.arange(0, BP)[None, :, None]
    qq = tl.arange(0, BQ)[None, None, :]
    # Separable cells: each tile's sums are folded into per-atom sums right after its row
    # loop, so no lane accumulators stay live across the row loops (which hold 15 of their own);
    # otherwise lane accumulators are summed once at the end.
    if SEPARABLE:
        acc_o = tl.zeros((ATOMS,), dtype=tl.float32)  # Σ g·u0
        acc_x = tl.zeros((ATOMS,), dtype=tl.float32)  # Σ g·u1·dx (voxel units)
        acc_y = tl.zeros((ATOMS,), dtype=tl.float32)
        acc_z = tl.zeros((ATOMS,), dtype=tl.float32)
        acc_b = tl.zeros((ATOMS,), dtype=tl.float32)  # Σ g·u2
    else:
        acc_o = tl.zeros((ATOMS, BP, BQ), dtype=tl.float32)
        acc_x = tl.zeros((ATOMS, BP, BQ), dtype=tl.float32)
        acc_y = tl.zeros((ATOMS, BP, BQ), dtype=tl.float32)
        acc_z = tl.zeros((ATOMS, BP, BQ), dtype=tl.float32)
        acc_b = tl.zeros((ATOMS, BP, BQ), dtype=tl.float32)
    pc = 0
    while pc < n_pc:
        kx = pc * BP + pp
        ox = lox[:, None, None] + kx
        dx = ox.to(tl.float32) - tx
        ix = _wrap(bx[:, None, None] + ox, nx)
        if INDEX64:
            ix = ix.to(tl.int64)
        in_x = kx < cntx[:, None, None]
        if VEC:
            lz = h02 * dx  # (ATOMS, BP, 1): r² = h22·dz² + 2·lz·dz + q0x (+ y terms) along the x lane
            q0x = h00 * dx * dx
        qc = 0
        while qc < n_qc:
            ozg, dz, iz, in_z = _z_lanes(
                qc, qq, loz[:, None, None], cntz[:, None, None], bz[:, None, None], tz, nz, BQ, VEC
            )
            in_xz = in_x & in_z
            if VEC and SEPARABLE:
                gmin = _group_r2min(ozg, tz, lz, q0x, h22, inv_h22)  # x–z part of the group's r² bound
            qxz = h00 * dx * dx + 2.0 * h02 * dx * dz + h22 * dz * dz
            base_xz = ix * (ny * nz) + iz
            if FRAMES:
                base_xz += fo
            if SEPARABLE:
                # e_k = x_k(x, z)·y_k(row): sum g·y_k (and ·dy, ·qy) over the rows first, then fold in
                # the x_k and the coefficients once per tile (20 instead of ~40 flops per voxel).
                x0 = tl.exp2(-be0 * qxz)
                x1 = tl.exp2(-be1 * qxz)
                x2 = tl.exp2(-be2 * qxz)
                x3 = tl.exp2(-be3 * qxz)
                x4 = tl.exp2(-be4 * qxz)
                t0 = tl.zeros((ATOMS, BP, BQ), dtype=tl.float32)  # Σ_rows g·y_k
                t1 = tl.zeros((ATOMS, BP, BQ), dtype=tl.float32)
                t2 = tl.zeros((ATOMS, BP, BQ), dtype=tl.float32)
                t3 = tl.zeros((ATOMS, BP, BQ), dtype=tl.float32)
                t4 = tl.zeros((ATOMS, BP, BQ), dtype=tl.float32)
                yd0 = tl.zeros((ATOMS, BP, BQ), dtype=tl.float32)  # Σ_rows g·y_k·dy
                yd1 = tl.zeros((ATOMS, BP, BQ), dtype=tl.float32)
                yd2 = tl.zeros((ATOMS, BP, BQ), dtype=tl.float32)
                yd3 = tl.zeros((ATOMS, BP, BQ), dtype=tl.float32)
                yd4 = tl.zeros((ATOMS, BP, BQ), dtype=tl.float32)
                v0 = tl.zeros((ATOMS, BP, BQ), dtype=tl.float32)  # Σ_rows g·y_k·qy
                v1 = tl.zeros((ATOMS, BP, BQ), dtype=tl.float32)
                v2 = tl.zeros((ATOMS, BP, BQ), dtype=tl.float32)
                v3 = tl.zeros((ATOMS, BP, BQ), dtype=tl.float32)
                v4 = tl.zeros((ATOMS, BP, BQ), dtype=tl.float32)
                r, r_end, iy, r_lo, r_hi = _tile_row_walk(
                    pc, qc, cntx, cntz, qxz, qxz, in_xz, x_lo, z_lo, r2lim_a, h00, h11, h22, h02, off_y, top_y,
                    iy0, ny, n_rows, BP, BQ, SEPARABLE,
                )  # fmt: skip
                lim = r2max - qxz  # a voxel is inside when qy < lim
                if not VEC:
                    gmin = lim  # not read
                while r < r_end:
                    dy, qy, inside = _separable_row(r, off_y3, h11, in_xz, gmin, r2lim, lim, VEC)
                    if ATOMS > 1:  # one atom: the loop runs exactly its rows
                        inside = inside & (r >= r_lo) & (r < r_hi)
                    g = tl.load(grad_ptr + (base_xz + iy * nz), mask=inside, other=0.0)
                    # Rows in pairs: the second row's load is issued before the first row's arithmetic (two
                    # loads in flight); the sums still run row by row, in row order.
                    iy += 1
                    iy = tl.where(iy == ny, 0, iy)
                    dy_b, qy_b, inside_b = _separable_row(r + 1, off_y3, h11, in_xz, gmin, r2lim, lim, VEC)
                    inside_b = inside_b & (r + 1 < r_end)
                    if ATOMS > 1:
                        inside_b = inside_b & (r + 1 >= r_lo) & (r + 1 < r_hi)
                    g_b = tl.load(grad_ptr + (base_xz + iy * nz), mask=inside_b, other=0.0)
                    if VEC:
                        g = tl.where(qy < lim, g, 0.0)
                    t0, t1, t2, t3, t4, yd0, yd1, yd2, yd3, yd4, v0, v1, v2, v3, v4 = _row_sums(
                        g, dy, qy, be0, be1, be2, be3, be4,
                        t0, t1, t2, t3, t4, yd0, yd1, yd2, yd3, yd4, v0, v1, v2, v3, v4,
                    )  # fmt: skip
                    if VEC:
                        g_b = tl.where(qy_b < lim, g_b, 0.0)
                    t0, t1, t2, t3, t4, yd0, yd1, yd2, yd3, yd4, v0, v1, v2, v3, v4 = _row_sums(
                        g_b, dy_b, qy_b, be0, be1, be2, be3, be4,
                        t0, t1, t2, t3, t4, yd0, yd1, yd2, yd3, yd4, v0, v1, v2, v3, v4,
                    )  # fmt: skip
                    iy += 1
                    iy = tl.where(iy == ny, 0, iy)
                    r += 2
                tile_o = c0 * x0 * t0 + c1 * x1 * t1 + c2 * x2 * t2 + c3 * x3 * t3 + c4 * x4 * t4
                hh = ca0 * x0 * t0 + ca1 * x1 * t1 + ca2 * x2 * t2 + ca3 * x3 * t3 + ca4 * x4 * t4
                tile_y = ca0 * x0 * yd0 + ca1 * x1 * yd1 + ca2 * x2 * yd2 + ca3 * x3 * yd3 + ca4 * x4 * yd4
                tile_b = (
                    x0 * (cab0 * (qxz * t0 + v0) - cb0 * t0)
                    + x1 * (cab1 * (qxz * t1 + v1) - cb1 * t1)
                    + x2 * (cab2 * (qxz * t2 + v2) - cb2 * t2)
                    + x3 * (cab3 * (qxz * t3 + v3) - cb3 * t3)
                    + x4 * (cab4 * (qxz * t4 + v4) - cb4 * t4)
                )
                acc_o += tl.sum(tl.sum(tile_o, axis=2), axis=1)
                acc_x += tl.sum(tl.sum(hh * dx, axis=2), axis=1)
                acc_z += tl.sum(tl.sum(hh * dz, axis=2), axis=1)
                acc_y += tl.sum(tl.sum(tile_y, axis=2), axis=1)
                acc_b += tl.sum(tl.sum(tile_b, axis=2), axis=1)
            else:
                lin = 2.0 * (h01 * dx + h12 * dz)
                r, r_end, iy, r_lo, r_hi = _tile_row_walk(
                    pc, qc, cntx, cntz, qxz, lin, in_xz, x_lo, z_lo, r2lim_a, h00, h11, h22, h02, off_y, top_y,
                    iy0, ny, n_rows, BP, BQ, SEPARABLE,
                )  # fmt: skip
                while r < r_end:
                    dy = r.to(tl.float32) - off_y3
                    qy = h11 * dy * dy
                    r2 = qxz + dy * lin + qy
                    e0 = tl.exp2(-be0 * r2)
                    e1 = tl.exp2(-be1 * r2)
                    e2 = tl.exp2(-be2 * r2)
                    e3 = tl.exp2(-be3 * r2)
                    e4 = tl.exp2(-be4 * r2)
                    if VEC:
                        gmin = _group_r2min(ozg, tz, lz + h12 * dy, q0x + (2.0 * h01) * dx * dy + qy, h22, inv_h22)
                        hit = tl.max_constancy(gmin < r2lim, [1, 1, 4])
                        inside = in_xz & hit
                    else:
                        inside = in_xz & (r2 < r2max)
                    if ATOMS > 1:  # one atom: the loop runs exactly its rows
                        inside = inside & (r >= r_lo) & (r < r_hi)
                    g = tl.load(grad_ptr + (base_xz + iy * nz), mask=inside, other=0.0)
                    if VEC:
                        g = tl.where(r2 < r2max, g, 0.0)
                    u0 = c0 * e0 + c1 * e1 + c2 * e2 + c3 * e3 + c4 * e4
                    u1 = ca0 * e0 + ca1 * e1 + ca2 * e2 + ca3 * e3 + ca4 * e4
                    u2 = r2 * (cab0 * e0 + cab1 * e1 + cab2 * e2 + cab3 * e3 + cab4 * e4) - (
                        cb0 * e0 + cb1 * e1 + cb2 * e2 + cb3 * e3 + cb4 * e4
                    )
                    gh = g * u1
                    acc_o += g * u0
                    acc_x += gh * dx
                    acc_y += gh * dy
                    acc_z += gh * dz
                    acc_b += g * u2
                    iy += 1
                    iy = tl.where(iy == ny, 0, iy)
                    r += 1
            qc += 1
        pc += 1
    if SEPARABLE:
        s_o = acc_o
        s_x = acc_x * occ
        s_y = acc_y * occ
        s_z = acc_z * occ
        s_b = acc_b * occ
    else:
        s_o = tl.sum(tl.sum(acc_o, axis=2), axis=1)
        s_x = tl.sum(tl.sum(acc_x, axis=2), axis=1) * occ
        s_y = tl.sum(tl.sum(acc_y, axis=2), axis=1) * occ
        s_z = tl.sum(tl.sum(acc_z, axis=2), axis=1) * occ
        s_b = tl.sum(tl.sum(acc_b, axis=2), axis=1) * occ
    # ∂ρ/∂centre = 2·H·d·Σ α c e (d = voxel − centre), then centre = m·xyz.
    gcx = 2.0 * (h00 * s_x + h01 * s_y + h02 * s_z)
    gcy = 2.0 * (h01 * s_x + h11 * s_y + h12 * s_z)
    gcz = 2.0 * (h02 * s_x + h12 * s_y + h22 * s_z)
    m00 = tl.load(p_ptr + 23).to(tl.float32)
    m01 = tl.load(p_ptr + 24).to(tl.float32)
    m02 = tl.load(p_ptr + 25).to(tl.float32)
    m10 = tl.load(p_ptr + 26).to(tl.float32)
    m11 = tl.load(p_ptr + 27).to(tl.float32)
    m12 = tl.load(p_ptr + 28).to(tl.float32)
    m20 = tl.load(p_ptr + 29).to(tl.float32)
    m21 = tl.load(p_ptr + 30).to(tl.float32)
    m22 = tl.load(p_ptr + 31).to(tl.float32)
    tl.store(gxyz_ptr + ia * 3 + 0, m00 * gcx + m10 * gcy + m20 * gcz, mask=valid)
    tl.store(gxyz_ptr + ia * 3 + 1, m01 * gcx + m11 * gcy + m21 * gcz, mask=valid)
    tl.store(gxyz_ptr + ia * 3 + 2, m02 * gcx + m12 * gcy + m22 * gcz, mask=valid)
    tl.store(gb_ptr + ia, s_b, mask=valid)
    tl.store(gocc_ptr + ia, s_o, mask=valid)


# --------------------------------------------------------------------------- anisotropic kernels
#
# Every atom as a general Gaussian per form-factor term: ρ_k(Δv) = amp_k·exp2(q_k(Δv)) for the offset Δv of a
# voxel from the atom in voxel units, q_k = −½·log2(e)·Δvᵀ·Qv_k·Δv, Qv_k = Bᵀ·M_k⁻¹·B with B = orth·diag(1/n)
# (voxel steps → Å) and M_k = U + b_k/(8π²)·I (see kernels.density.adp). The per-atom work (U from
# u_aniso/aniso/b_iso as kernels.density.adp.effective_u forms it, M_k⁻¹ and det M_k in closed form, the
# six coefficients of each q_k, the cutoff radius) is done by each program for its own atoms, so a call is
# one memset and one launch each way, as for isotropic atoms: the same work as ~50 small torch ops, whose
# launches alone would cost several times the splat of a small model.

_U_PER_B = 0.012665147955292222  # 1/(8π²): U = B/(8π²)
_B_PER_U = 78.95683520871486  # 8π²
_GAUSS_NORM = 0.06349363593424097  # (2π)^{-3/2}


@triton.jit
def _effective_u(u_ptr, flag_ptr, b_iso_ptr, ia, valid):
    """Each atom's U (Å², six components U11, U22, U33, U12, U13, U23), whether it is anisotropic, and its B.

    As :func:`kernels.density.adp.effective_u`: the atom's ``u_aniso`` row where ``aniso`` is set, else
    B/(8π²) on the diagonal. An isotropic neutron set comes with a zero U and no flag set
    (:func:`_kernel_inputs_aniso`), so these kernels have one variant.
    """
    b_iso = tl.load(b_iso_ptr + ia, mask=valid, other=1.0)
    ui = b_iso * 0.012665147955292222
    zero = tl.zeros_like(ui)
    flag = tl.load(flag_ptr + ia, mask=valid, other=0) != 0
    u11 = tl.where(flag, tl.load(u_ptr + ia * 6 + 0, mask=valid, other=1.0), ui)
    u22 = tl.where(flag, tl.load(u_ptr + ia * 6 + 1, mask=valid, other=1.0), ui)
    u33 = tl.where(flag, tl.load(u_ptr + ia * 6 + 2, mask=valid, other=1.0), ui)
    u12 = tl.where(flag, tl.load(u_ptr + ia * 6 + 3, mask=valid, other=0.0), zero)
    u13 = tl.where(flag, tl.load(u_ptr + ia * 6 + 4, mask=valid, other=0.0), zero)
    u23 = tl.where(flag, tl.load(u_ptr + ia * 6 + 5, mask=valid, other=0.0), zero)
    return u11, u22, u33, u12, u13, u23, flag, b_iso


@triton.jit
def _positive_definite(u11, u22, u33, u12, u13, u23):
    """U finite and positive definite: every leading principal minor > 0 (False for NaN)."""
    finite = (u11 - u11 == 0) & (u22 - u22 == 0) & (u33 - u33 == 0)
    finite = finite & (u12 - u12 == 0) & (u13 - u13 == 0) & (u23 - u23 == 0)
    minor2 = u11 * u22 - u12 * u12
    det = u11 * (u22 * u33 - u23 * u23) - u12 * (u12 * u33 - u23 * u13) + u13 * (u12 * u23 - u22 * u13)
    return finite & (u11 > 0) & (minor2 > 0) & (det > 0)


@triton.jit
def _aniso_atom_inputs(xyz_ptr, u_ptr, flag_ptr, b_iso_ptr, occ_ptr, p_ptr, ia, valid, nx, ny, nz):
    """Per-atom centre (as :func:`_atom_inputs`), occupancy, U, anisotropy flag, B and ok, each (ATOMS,).

    ``ok``: in range, a finite position (also after frac·xyz) and occupancy, and a finite positive-definite
    U. An atom that is not ok gets U = I, occupancy 0 and zero extent: it adds nothing and every gradient
    of it is an exact 0 (nothing non-finite enters the arithmetic).
    """
    x = tl.load(xyz_ptr + ia * 3 + 0, mask=valid, other=0.0).to(tl.float64)
    y = tl.load(xyz_ptr + ia * 3 + 1, mask=valid, other=0.0).to(tl.float64)
    z = tl.load(xyz_ptr + ia * 3 + 2, mask=valid, other=0.0).to(tl.float64)
    fx = tl.load(p_ptr + 0) * x + tl.load(p_ptr + 1) * y + tl.load(p_ptr + 2) * z
    fy = tl.load(p_ptr + 3) * x + tl.load(p_ptr + 4) * y + tl.load(p_ptr + 5) * z
    fz = tl.load(p_ptr + 6) * x + tl.load(p_ptr + 7) * y + tl.load(p_ptr + 8) * z
    occ = tl.load(occ_ptr + ia, mask=valid, other=0.0)
    u11, u22, u33, u12, u13, u23, flag, b_iso = _effective_u(u_ptr, flag_ptr, b_iso_ptr, ia, valid)
    ok = valid & (fx - fx == 0) & (fy - fy == 0) & (fz - fz == 0) & (occ - occ == 0)
    ok = ok & _positive_definite(u11, u22, u33, u12, u13, u23)
    tx, bx = _cell_coordinate(tl.where(ok, fx, 0.0), nx, tl.load(p_ptr + 9))
    ty, by = _cell_coordinate(tl.where(ok, fy, 0.0), ny, tl.load(p_ptr + 10))
    tz, bz = _cell_coordinate(tl.where(ok, fz, 0.0), nz, tl.load(p_ptr + 11))
    u11 = tl.where(ok, u11, 1.0)
    u22 = tl.where(ok, u22, 1.0)
    u33 = tl.where(ok, u33, 1.0)
    u12 = tl.where(ok, u12, 0.0)
    u13 = tl.where(ok, u13, 0.0)
    u23 = tl.where(ok, u23, 0.0)
    occ = tl.where(ok, occ, 0.0)
    b_iso = tl.where(ok, b_iso, 1.0)
    return tx, ty, tz, bx, by, bz, occ, u11, u22, u33, u12, u13, u23, flag, b_iso, ok


@triton.jit
def _aniso_term(u11, u22, u33, u12, u13, u23, a_ptr, b_ptr, ia, valid, k: tl.constexpr):
    """Term k of each atom: unit-occupancy amplitude a_k·(2π)^{-3/2}·det(M_k)^{-1/2}, det M_k, b_k/(8π²) and M_k⁻¹.

    M_k = U + b_k/(8π²)·I, inverted by its adjugate. M_k⁻¹ as six components (11, 22, 33, 12, 13, 23). A term
    whose det M_k is not positive (widths b_k < 0 only; U itself is positive definite here) gets amplitude 0
    and M⁻¹ = I.
    """
    ak = tl.load(a_ptr + ia * 5 + k, mask=valid, other=0.0)
    beta = tl.load(b_ptr + ia * 5 + k, mask=valid, other=0.0) * 0.012665147955292222
    m11 = u11 + beta
    m22 = u22 + beta
    m33 = u33 + beta
    c11 = m22 * m33 - u23 * u23
    c22 = m11 * m33 - u13 * u13
    c33 = m11 * m22 - u12 * u12
    c12 = u13 * u23 - u12 * m33
    c13 = u12 * u23 - u13 * m22
    c23 = u12 * u13 - m11 * u23
    det = m11 * c11 + u12 * c12 + u13 * c13
    good = det > 0
    inv = 1.0 / tl.where(good, det, 1.0)
    amp = tl.where(good, ak * 0.06349363593424097 * tl.sqrt(inv), 0.0)
    n11 = tl.where(good, c11 * inv, 1.0)
    n22 = tl.where(good, c22 * inv, 1.0)
    n33 = tl.where(good, c33 * inv, 1.0)
    n12 = tl.where(good, c12 * inv, 0.0)
    n13 = tl.where(good, c13 * inv, 0.0)
    n23 = tl.where(good, c23 * inv, 0.0)
    return amp, tl.where(good, det, 1.0), beta, n11, n22, n33, n12, n13, n23


@triton.jit
def _sandwich(x11, x22, x33, x12, x13, x23, p11, p12, p13, p21, p22, p23, p31, p32, p33):
    """P·X·Pᵀ for a symmetric X given as six components (11, 22, 33, 12, 13, 23); the same six of the result."""
    t11 = p11 * x11 + p12 * x12 + p13 * x13
    t12 = p11 * x12 + p12 * x22 + p13 * x23
    t13 = p11 * x13 + p12 * x23 + p13 * x33
    t21 = p21 * x11 + p22 * x12 + p23 * x13
    t22 = p21 * x12 + p22 * x22 + p23 * x23
    t23 = p21 * x13 + p22 * x23 + p23 * x33
    t31 = p31 * x11 + p32 * x12 + p33 * x13
    t32 = p31 * x12 + p32 * x22 + p33 * x23
    t33 = p31 * x13 + p32 * x23 + p33 * x33
    y11 = t11 * p11 + t12 * p12 + t13 * p13
    y22 = t21 * p21 + t22 * p22 + t23 * p23
    y33 = t31 * p31 + t32 * p32 + t33 * p33
    y12 = t11 * p21 + t12 * p22 + t13 * p23
    y13 = t11 * p31 + t12 * p32 + t13 * p33
    y23 = t21 * p31 + t22 * p32 + t23 * p33
    return y11, y22, y33, y12, y13, y23


@triton.jit
def _voxel_form(n11, n22, n33, n12, n13, n23, p_ptr):
    """Qv = Bᵀ·M⁻¹·B (B = orth·diag(1/n), params [32:41]): M⁻¹'s quadratic form in voxel steps, six components."""
    b11 = tl.load(p_ptr + 32).to(tl.float32)
    b12 = tl.load(p_ptr + 33).to(tl.float32)
    b13 = tl.load(p_ptr + 34).to(tl.float32)
    b21 = tl.load(p_ptr + 35).to(tl.float32)
    b22 = tl.load(p_ptr + 36).to(tl.float32)
    b23 = tl.load(p_ptr + 37).to(tl.float32)
    b31 = tl.load(p_ptr + 38).to(tl.float32)
    b32 = tl.load(p_ptr + 39).to(tl.float32)
    b33 = tl.load(p_ptr + 40).to(tl.float32)
    return _sandwich(n11, n22, n33, n12, n13, n23, b11, b21, b31, b12, b22, b32, b13, b23, b33)


@triton.jit
def _largest_eigenvalue(u11, u22, u33, u12, u13, u23):
    """Largest eigenvalue of each symmetric U (float32).

    U = mean·I + D with D traceless; D's eigenvalues are the roots of μ³ − p·μ − q (p = ½·tr D², q = det D),
    all real, the largest in [√(p/3), 2√(p/3)]. Newton from 2√(p/3) descends monotonically onto it (the
    cubic is convex and increasing beyond it), quadratically for a simple root and halving the error per
    step for a double one (an axially symmetric U), so 40 steps reach float32 rounding either way.
    """
    mean = (u11 + u22 + u33) * (1.0 / 3.0)
    d11 = u11 - mean
    d22 = u22 - mean
    d33 = u33 - mean
    p = 0.5 * (d11 * d11 + d22 * d22 + d33 * d33) + u12 * u12 + u13 * u13 + u23 * u23
    q = d11 * (d22 * d33 - u23 * u23) - u12 * (u12 * d33 - u23 * u13) + u13 * (u12 * u23 - d22 * u13)
    mu = 2.0 * tl.sqrt(p * (1.0 / 3.0))
    for _ in range(40):
        f = (mu * mu - p) * mu - q
        fp = 3.0 * mu * mu - p
        step = tl.where(fp > 0, f / tl.where(fp > 0, fp, 1.0), 0.0)
        mu = mu - tl.maximum(step, 0.0)
    return mean + mu


@triton.jit
def _neutron_radius(amp, ex, cutoff):
    """Radius where |amp|·exp(ex·r²) falls to ``cutoff`` (one Gaussian: gemmi's closed form); 0 below it."""
    level = tl.log(tl.maximum(tl.abs(amp), 1e-30) / cutoff)  # no log(0): a zero amplitude is below any cutoff
    return tl.where(level > 0, tl.sqrt(tl.maximum(level, 0.0) / -ex), 0.0)


@triton.jit
def _aniso_radius(
    u11, u22, u33, u12, u13, u23, flag, b_iso, a_ptr, b_ptr, ia, ok, cutoff,
    am0, de0, be0, am1, de1, be1, am2, de2, be2, am3, de3, be3, am4, de4, be4,
    RULE: tl.constexpr, NEUTRON: tl.constexpr,
):  # fmt: skip
    """Cutoff radius of each atom (Å, float32), as kernels.density.radius.atom_cutoff_radii computes it.

    RULE 1 (gemmi): the isotropic rule at B_max = 8π²·max diag U (B itself for isotropic atoms of an
    isotropic set). RULE 2 (eigen): the same search along the major axis of U, where every term's density
    falls slowest: amplitudes a_k(2π)^{-3/2}det(M_k)^{-1/2} (am_k), exponents −1/(2(λ_max + b_k/8π²)).
    NEUTRON: one Gaussian, solved in closed form with the summed amplitude (hydrogen's is negative).
    """
    if RULE == 1:
        bb = tl.where(flag, 78.95683520871486 * tl.maximum(tl.maximum(u11, u22), u33), b_iso)
        r0, al0, _w0 = _radial_coef(a_ptr, b_ptr, ia, ok, bb, 0)
        r1, al1, _w1 = _radial_coef(a_ptr, b_ptr, ia, ok, bb, 1)
        r2, al2, _w2 = _radial_coef(a_ptr, b_ptr, ia, ok, bb, 2)
        r3, al3, _w3 = _radial_coef(a_ptr, b_ptr, ia, ok, bb, 3)
        r4, al4, _w4 = _radial_coef(a_ptr, b_ptr, ia, ok, bb, 4)
        ex0, ex1, ex2, ex3, ex4 = -al0, -al1, -al2, -al3, -al4
    else:
        lam = _largest_eigenvalue(u11, u22, u33, u12, u13, u23)
        bb = 78.95683520871486 * lam
        r0, r1, r2, r3, r4 = am0, am1, am2, am3, am4
        ex0 = -0.5 / (lam + be0)
        ex1 = -0.5 / (lam + be1)
        ex2 = -0.5 / (lam + be2)
        ex3 = -0.5 / (lam + be3)
        ex4 = -0.5 / (lam + be4)
    if NEUTRON:
        rad = _neutron_radius(r0 + r1 + r2 + r3 + r4, ex0, cutoff)
    else:
        rad = _radius_search(bb, r0, ex0, r1, ex1, r2, ex2, r3, ex3, r4, ex4, ok, cutoff, 80)
    return rad


@triton.jit
def _log2_form(n11, n22, n33, n12, n13, n23, p_ptr):
    """Coefficients of q = −½·log2(e)·Δvᵀ·Qv·Δv on dx², dy², dz², dx·dy, dx·dz, dy·dz, each (ATOMS, 1, 1)."""
    q11, q22, q33, q12, q13, q23 = _voxel_form(n11, n22, n33, n12, n13, n23, p_ptr)
    h = -0.7213475204444817  # −½·log2(e)
    return (
        (h * q11)[:, None, None],
        (h * q22)[:, None, None],
        (h * q33)[:, None, None],
        (2.0 * h * q12)[:, None, None],
        (2.0 * h * q13)[:, None, None],
        (2.0 * h * q23)[:, None, None],
    )


@triton.jit
def _column(cxx, czz, cxy, cxz, cyz, dx, dz):
    """A tile's part of q that is constant along y (A) and the coefficient of dy (B): q = A + dy·(B + cyy·dy)."""
    return dx * (cxx * dx + cxz * dz) + czz * dz * dz, cxy * dx + cyz * dz


@triton.jit
def _tile_moments(t, ty, tyy, dx, dz):
    """One tile's sums of g·e·(1, Δv, Δv Δvᵀ) per atom, (ATOMS,) each, from its row sums t = Σ g·e,
    ty = Σ g·e·dy, tyy = Σ g·e·dy² (dx, dz are constant along a row)."""
    tdx = t * dx
    tdz = t * dz
    return (
        tl.sum(tl.sum(t, axis=2), axis=1),
        tl.sum(tl.sum(tdx, axis=2), axis=1),
        tl.sum(tl.sum(ty, axis=2), axis=1),
        tl.sum(tl.sum(tdz, axis=2), axis=1),
        tl.sum(tl.sum(tdx * dx, axis=2), axis=1),
        tl.sum(tl.sum(tyy, axis=2), axis=1),
        tl.sum(tl.sum(tdz * dz, axis=2), axis=1),
        tl.sum(tl.sum(ty * dx, axis=2), axis=1),
        tl.sum(tl.sum(tdx * dz, axis=2), axis=1),
        tl.sum(tl.sum(ty * dz, axis=2), axis=1),
    )


@triton.jit
def _flat(x):
    """(ATOMS, 1, 1) → (ATOMS,)."""
    return tl.sum(tl.sum(x, axis=2), axis=1)


@triton.jit
def _fold_grads(
    gcx, gcy, gcz, go, x11, x22, x33, x12, x13, x23,
    amp, au, cxx, cyy, czz, cxy, cxz, cyz, t, ty, tyy, dx, dz,
):  # fmt: skip
    """The gradient sums of one atom += one term's part from one tile, float64, (ATOMS,) each.

    ρ_k = amp·exp(−½ ΔvᵀQvΔv) with Δv = voxel − centre in voxel steps; Qv is read back from the term's
    log2-unit coefficients (cxx … cyz, (ATOMS, 1, 1)), so the gradient is that of the exponent the
    forward evaluated. From the tile's s0 = Σ g·e, s = Σ g·e·Δv and S = Σ g·e·Δv·Δvᵀ (unit amplitude):

    - ∂L/∂centre += amp·Qv·s (gcx, gcy, gcz, voxel units);
    - ∂L/∂occ += au·s0 (au: the amplitude without the occupancy);
    - X += ½·amp·(Qv·S·Qv − s0·Qv), where ∂L/∂U = mᵀ·X·m (m = diag(n)·frac; M_k⁻¹ = mᵀ·Qv·m, and
      ∂ρ_k/∂M_k = ½ρ_k(M⁻¹rrᵀM⁻¹ − M⁻¹) with r = m⁻¹·Δv), applied once per atom by the caller.

    Every gradient is linear in the tile's sums, so each tile is folded in as soon as its rows are summed:
    ten running sums per atom. The two parts of X nearly cancel for a narrow term (voxels about one
    standard deviation out contribute to both), so the sums and X are float64: in float32 the difference
    lost ~1e-5 of the gradient.
    """
    s0, sx, sy, sz, sxx, syy, szz, sxy, sxz, syz = _tile_moments(t, ty, tyy, dx, dz)
    inv = -1.3862943611198906  # 1/(−½·log2 e): Qv from the coefficients of q = −½·log2(e)·ΔvᵀQvΔv
    q11 = _flat(cxx).to(tl.float64) * inv
    q22 = _flat(cyy).to(tl.float64) * inv
    q33 = _flat(czz).to(tl.float64) * inv
    q12 = _flat(cxy).to(tl.float64) * (0.5 * inv)
    q13 = _flat(cxz).to(tl.float64) * (0.5 * inv)
    q23 = _flat(cyz).to(tl.float64) * (0.5 * inv)
    amp = amp.to(tl.float64)
    w11, w22, w33, w12, w13, w23 = _sandwich(sxx, syy, szz, sxy, sxz, syz, q11, q12, q13, q12, q22, q23, q13, q23, q33)
    half = 0.5 * amp
    return (
        gcx + amp * (q11 * sx + q12 * sy + q13 * sz),
        gcy + amp * (q12 * sx + q22 * sy + q23 * sz),
        gcz + amp * (q13 * sx + q23 * sy + q33 * sz),
        go + au.to(tl.float64) * s0,
        x11 + half * (w11 - s0 * q11),
        x22 + half * (w22 - s0 * q22),
        x33 + half * (w33 - s0 * q33),
        x12 + half * (w12 - s0 * q12),
        x13 + half * (w13 - s0 * q13),
        x23 + half * (w23 - s0 * q23),
    )


_ANISO_ARGS = ("xyz_ptr", "u_ptr", "flag_ptr", "b_iso_ptr", "occ_ptr", "a_ptr", "b_ptr", "radius_ptr", "p_ptr")


@triton.jit(
    do_not_specialize=(*_ANISO_ARGS, "fix_ptr", "n_atoms"), do_not_specialize_on_alignment=(*_ANISO_ARGS, "fix_ptr")
)
def _aniso_fixed_scale_kernel(
    xyz_ptr,  # (N, 3) float32 or float64, Å
    u_ptr,  # (N, 6) float32, Å²
    flag_ptr,  # (N,) uint8
    b_iso_ptr,  # (N,) float32, Å²
    occ_ptr,  # (N,) float32
    a_ptr,  # (N, 5) float32
    b_ptr,  # (N, 5) float32, Å²
    radius_ptr,  # (N,) float32, Å: written with each atom's cutoff radius when RULE > 0
    p_ptr,  # (41,) float64, the plan's constants
    fix_ptr,  # (1,) int64, zero-filled: atomic max of the atoms' exponents
    n_atoms,
    BLOCK: tl.constexpr,
    RULE: tl.constexpr,
    NEUTRON: tl.constexpr,
):
    """Deterministic anisotropic forward, first launch: radii and the largest exponent, as
    :func:`_fixed_scale_kernel` (amplitudes and radii as :func:`_aniso_fwd_kernel` forms them)."""
    ia = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = ia < n_atoms
    nx, ny, nz, h00, h11, h22, h01, h02, h12, rx, ry, rz, radius_all, cutoff = _plan_scalars(p_ptr)
    tx, ty, tz, bx, by, bz, occ, u11, u22, u33, u12, u13, u23, flag, b_iso, ok = _aniso_atom_inputs(
        xyz_ptr, u_ptr, flag_ptr, b_iso_ptr, occ_ptr, p_ptr, ia, valid, nx, ny, nz
    )
    am0, de0, be0, _n0, _m0, _o0, _p0, _q0, _r0 = _aniso_term(u11, u22, u33, u12, u13, u23, a_ptr, b_ptr, ia, ok, 0)
    am1, de1, be1, _n1, _m1, _o1, _p1, _q1, _r1 = _aniso_term(u11, u22, u33, u12, u13, u23, a_ptr, b_ptr, ia, ok, 1)
    am2, de2, be2, _n2, _m2, _o2, _p2, _q2, _r2 = _aniso_term(u11, u22, u33, u12, u13, u23, a_ptr, b_ptr, ia, ok, 2)
    am3, de3, be3, _n3, _m3, _o3, _p3, _q3, _r3 = _aniso_term(u11, u22, u33, u12, u13, u23, a_ptr, b_ptr, ia, ok, 3)
    am4, de4, be4, _n4, _m4, _o4, _p4, _q4, _r4 = _aniso_term(u11, u22, u33, u12, u13, u23, a_ptr, b_ptr, ia, ok, 4)
    if RULE == 0:
        rad = tl.zeros_like(tx) + radius_all
    else:
        rad = _aniso_radius(
            u11, u22, u33, u12, u13, u23, flag, b_iso, a_ptr, b_ptr, ia, ok, cutoff,
            am0, de0, be0, am1, de1, be1, am2, de2, be2, am3, de3, be3, am4, de4, be4,
            RULE, NEUTRON,
        )  # fmt: skip
        tl.store(radius_ptr + ia, rad, mask=valid)
    _lx, _ly, _lz, cntx, cnty, cntz, _r2 = _atom_box(tx, ty, tz, rad, ok, rx, ry, rz)
    peak = tl.abs(occ) * (tl.abs(am0) + tl.abs(am1) + tl.abs(am2) + tl.abs(am3) + tl.abs(am4))
    tl.atomic_max(fix_ptr, _fixed_exponent(peak, cntx, cnty, cntz, nx, ny, nz, valid), sem="relaxed")


@triton.jit(
    do_not_specialize=(*_ANISO_ARGS, "fix_ptr", "n_atoms", "atoms_per_frame", "fix_shift"),
    do_not_specialize_on_alignment=(*_ANISO_ARGS, "fix_ptr"),
)
def _aniso_fwd_kernel(
    xyz_ptr,  # (N, 3) float32 or float64, Å
    u_ptr,  # (N, 6) float32, Å², U11, U22, U33, U12, U13, U23
    flag_ptr,  # (N,) uint8, 1 where the atom uses its u_aniso row
    b_iso_ptr,  # (N,) float32, Å² (U = B/8π²·I of the isotropic atoms)
    occ_ptr,  # (N,) float32
    a_ptr,  # (N, 5) float32, form-factor amplitudes
    b_ptr,  # (N, 5) float32, widths in Å²
    radius_ptr,  # (N,) float32, Å: written with each atom's cutoff radius when RULE > 0 (the backward's)
    p_ptr,  # (41,) float64, the plan's constants (layout: _Plan.build)
    out_ptr,  # (nx·ny·nz,) float32 (FRAMES: (F·nx·ny·nz,)), zero-filled; accumulated with atomics (FIXED: int64)
    fix_ptr,  # (1,) int64, the largest atom exponent (_aniso_fixed_scale_kernel); read when FIXED
    n_atoms,
    atoms_per_frame,  # atoms of one frame (read when FRAMES)
    fix_shift,  # 62 − ⌈log2(atoms of one map)⌉ (read when FIXED)
    ATOMS: tl.constexpr,
    BP: tl.constexpr,
    BQ: tl.constexpr,
    RULE: tl.constexpr,  # 0: the plan's fixed radius; 1: gemmi's rule at B_max; 2: the exact (eigenvalue) sphere
    NEUTRON: tl.constexpr,  # one-Gaussian lengths: closed-form radius
    INDEX64: tl.constexpr,
    VEC: tl.constexpr,
    FRAMES: tl.constexpr,
    SEPARABLE: tl.constexpr,  # h01 = h12 = 0: the sphere's r² = qxz + h11·dy² (the Gaussians stay general)
    FIXED: tl.constexpr,  # deterministic mode: int64 fixed-point adds into out_ptr, radii read from radius_ptr
):
    ia = tl.program_id(0) * ATOMS + tl.arange(0, ATOMS)
    valid = ia < n_atoms
    nx, ny, nz, h00, h11, h22, h01, h02, h12, rx, ry, rz, radius_all, cutoff = _plan_scalars(p_ptr)
    tx, ty, tz, bx, by, bz, occ, u11, u22, u33, u12, u13, u23, flag, b_iso, ok = _aniso_atom_inputs(
        xyz_ptr, u_ptr, flag_ptr, b_iso_ptr, occ_ptr, p_ptr, ia, valid, nx, ny, nz
    )
    am0, de0, be0, n11_0, n22_0, n33_0, n12_0, n13_0, n23_0 = _aniso_term(
        u11, u22, u33, u12, u13, u23, a_ptr, b_ptr, ia, ok, 0
    )
    am1, de1, be1, n11_1, n22_1, n33_1, n12_1, n13_1, n23_1 = _aniso_term(
        u11, u22, u33, u12, u13, u23, a_ptr, b_ptr, ia, ok, 1
    )
    am2, de2, be2, n11_2, n22_2, n33_2, n12_2, n13_2, n23_2 = _aniso_term(
        u11, u22, u33, u12, u13, u23, a_ptr, b_ptr, ia, ok, 2
    )
    am3, de3, be3, n11_3, n22_3, n33_3, n12_3, n13_3, n23_3 = _aniso_term(
        u11, u22, u33, u12, u13, u23, a_ptr, b_ptr, ia, ok, 3
    )
    am4, de4, be4, n11_4, n22_4, n33_4, n12_4, n13_4, n23_4 = _aniso_term(
        u11, u22, u33, u12, u13, u23, a_ptr, b_ptr, ia, ok, 4
    )
    if RULE == 0:
        rad = tl.zeros_like(tx) + radius_all
    elif FIXED:
        rad = tl.load(radius_ptr + ia, mask=valid, other=0.0)  # computed by _aniso_fixed_scale_kernel
    else:
        # Computed here (no launch of its own) and kept for the backward, which reads the same radii.
        rad = _aniso_radius(
            u11, u22, u33, u12, u13, u23, flag, b_iso, a_ptr, b_ptr, ia, ok, cutoff,
            am0, de0, be0, am1, de1, be1, am2, de2, be2, am3, de3, be3, am4, de4, be4,
            RULE, NEUTRON,
        )  # fmt: skip
        tl.store(radius_ptr + ia, rad, mask=valid)
    if FIXED:
        scale = _fixed_scale(fix_ptr, fix_shift)
    lox, loy, loz, cntx, cnty, cntz, r2max = _atom_box(tx, ty, tz, rad, ok, rx, ry, rz)
    # (ATOMS, 1, 1): per-atom amplitudes (occupancy folded in) and log2-unit coefficients of each term.
    am0 = (am0 * occ)[:, None, None]
    am1 = (am1 * occ)[:, None, None]
    am2 = (am2 * occ)[:, None, None]
    am3 = (am3 * occ)[:, None, None]
    am4 = (am4 * occ)[:, None, None]
    cxx0, cyy0, czz0, cxy0, cxz0, cyz0 = _log2_form(n11_0, n22_0, n33_0, n12_0, n13_0, n23_0, p_ptr)
    cxx1, cyy1, czz1, cxy1, cxz1, cyz1 = _log2_form(n11_1, n22_1, n33_1, n12_1, n13_1, n23_1, p_ptr)
    cxx2, cyy2, czz2, cxy2, cxz2, cyz2 = _log2_form(n11_2, n22_2, n33_2, n12_2, n13_2, n23_2, p_ptr)
    cxx3, cyy3, czz3, cxy3, cxz3, cyz3 = _log2_form(n11_3, n22_3, n33_3, n12_3, n13_3, n23_3, p_ptr)
    cxx4, cyy4, czz4, cxy4, cxz4, cyz4 = _log2_form(n11_4, n22_4, n33_4, n12_4, n13_4, n23_4, p_ptr)
    # Group masks and row spans test lower bounds of r² against R² widened by 0.1 %, far above float32
    # rounding (~1e-6 relative), so a group or row holding a voxel with r² < R² is never masked off.
    r2lim_a = r2max * 1.001
    r2lim = r2lim_a[:, None, None]
    r2max = r2max[:, None, None]
    if VEC:
        nz = nz // 4 * 4  # the host sends nz % 4 == 0: lets the axis analysis see nz and row strides divide by 4
        loz, cntz = _vec_z_box(bz, loz, cntz)
        inv_h22 = 1.0 / h22
    if FRAMES:
        fo = _frame_offset(ia, atoms_per_frame, nx, ny, nz, INDEX64)
    n_pc = tl.cdiv(tl.max(cntx, axis=0), BP)
    n_qc = tl.cdiv(tl.max(cntz, axis=0), BQ)
    n_rows = tl.max(cnty, axis=0)
    x_lo = lox.to(tl.float32) - tx
    z_lo = loz.to(tl.float32) - tz
    off_y = ty - loy.to(tl.float32)
    top_y = cnty.to(tl.float32)
    tx = tx[:, None, None]
    tz = tz[:, None, None]
    iy0 = _wrap(by + loy, ny)
    off_y3 = off_y[:, None, None]
    pp = tl.arange(0, BP)[None, :, None]
    qq = tl.arange(0, BQ)[None, None, :]
    pc = 0
    while pc < n_pc:
        kx = pc * BP + pp
        ox = lox[:, None, None] + kx
        dx = ox.to(tl.float32) - tx
        ix = _wrap(bx[:, None, None] + ox, nx)
        if INDEX64:
            ix = ix.to(tl.int64)
        in_x = kx < cntx[:, None, None]
        if VEC:
            lz = h02 * dx
            q0x = h00 * dx * dx
        qc = 0
        while qc < n_qc:
            ozg, dz, iz, in_z = _z_lanes(
                qc, qq, loz[:, None, None], cntz[:, None, None], bz[:, None, None], tz, nz, BQ, VEC
            )
            in_xz = in_x & in_z
            qxz = h00 * dx * dx + 2.0 * h02 * dx * dz + h22 * dz * dz  # metric part of r², (ATOMS, BP, BQ)
            if SEPARABLE:
                lin = qxz  # not read
                if VEC:
                    gmin = _group_r2min(ozg, tz, lz, q0x, h22, inv_h22)  # x–z part of the group's r² bound
            else:
                lin = 2.0 * (h01 * dx + h12 * dz)
            base_xz = ix * (ny * nz) + iz
            if FRAMES:
                base_xz += fo
            ca0, cb0 = _column(cxx0, czz0, cxy0, cxz0, cyz0, dx, dz)
            ca1, cb1 = _column(cxx1, czz1, cxy1, cxz1, cyz1, dx, dz)
            ca2, cb2 = _column(cxx2, czz2, cxy2, cxz2, cyz2, dx, dz)
            ca3, cb3 = _column(cxx3, czz3, cxy3, cxz3, cyz3, dx, dz)
            ca4, cb4 = _column(cxx4, czz4, cxy4, cxz4, cyz4, dx, dz)
            r, r_end, iy, r_lo, r_hi = _tile_row_walk(
                pc, qc, cntx, cntz, qxz, lin, in_xz, x_lo, z_lo, r2lim_a, h00, h11, h22, h02, off_y, top_y,
                iy0, ny, n_rows, BP, BQ, SEPARABLE,
            )  # fmt: skip
            while r < r_end:
                dy = r.to(tl.float32) - off_y3
                qy = h11 * dy * dy
                if SEPARABLE:
                    r2 = qxz + qy
                else:
                    r2 = qxz + dy * lin + qy
                # Each q_k ≤ 0 (a positive-definite form), so no term overflows.
                val = (
                    am0 * tl.exp2(ca0 + dy * (cb0 + cyy0 * dy))
                    + am1 * tl.exp2(ca1 + dy * (cb1 + cyy1 * dy))
                    + am2 * tl.exp2(ca2 + dy * (cb2 + cyy2 * dy))
                    + am3 * tl.exp2(ca3 + dy * (cb3 + cyy3 * dy))
                    + am4 * tl.exp2(ca4 + dy * (cb4 + cyy4 * dy))
                )
                if VEC:
                    if SEPARABLE:
                        hit = gmin + qy < r2lim
                    else:
                        gmin = _group_r2min(ozg, tz, lz + h12 * dy, q0x + (2.0 * h01) * dx * dy + qy, h22, inv_h22)
                        hit = gmin < r2lim
                    # Constant over each group of 4 z lanes (one v4 atomic per group on sm_90); lanes outside
                    # the sphere add an exact 0, so the voxel set stays r² < R².
                    hit = tl.max_constancy(hit, [1, 1, 4])
                    inside = in_xz & hit
                    val = tl.where(r2 < r2max, val, 0.0)
                else:
                    inside = in_xz & (r2 < r2max)
                if ATOMS > 1:  # one atom: the loop runs exactly its rows
                    inside = inside & (r >= r_lo) & (r < r_hi)
                if FIXED:
                    # Integer adds are scalar either way: only the voxels inside the sphere take one.
                    inside = inside & (r2 < r2max)
                    tl.atomic_add(out_ptr + (base_xz + iy * nz), _to_fixed(val, scale), mask=inside, sem="relaxed")
                else:
                    tl.atomic_add(out_ptr + (base_xz + iy * nz), val, mask=inside, sem="relaxed")
                iy += 1
                iy = tl.where(iy == ny, 0, iy)
                r += 1
            qc += 1
        pc += 1


@triton.jit
def _row_moments(g, e, dy, t, ty, tyy):
    """Row sums of one term, float64: Σ g·e, Σ g·e·dy, Σ g·e·dy² += this row's."""
    ge = (g * e).to(tl.float64)
    gey = ge * dy
    return t + ge, ty + gey, tyy + gey * dy


_ANISO_GRAD_ARGS = ("gxyz_ptr", "gu_ptr", "gb_ptr", "gocc_ptr")


@triton.jit(
    do_not_specialize=(*_ANISO_ARGS, *_ANISO_GRAD_ARGS, "n_atoms", "atoms_per_frame"),
    do_not_specialize_on_alignment=(*_ANISO_ARGS, *_ANISO_GRAD_ARGS),
)
def _aniso_bwd_kernel(
    grad_ptr,  # (nx·ny·nz,) float32 (FRAMES: (F·nx·ny·nz,)), upstream gradient of the map
    xyz_ptr,  # (N, 3) float32 or float64, Å
    u_ptr,  # (N, 6) float32, Å²
    flag_ptr,  # (N,) uint8
    b_iso_ptr,  # (N,) float32, Å²
    occ_ptr,  # (N,) float32
    a_ptr,  # (N, 5) float32
    b_ptr,  # (N, 5) float32, Å²
    radius_ptr,  # (N,) float32, Å, the forward's radii (read when RULE > 0)
    p_ptr,  # (41,) float64, the plan's constants (layout: _Plan.build)
    gxyz_ptr,  # (N, 3) the dtype of xyz, written: ∂L/∂xyz
    gu_ptr,  # (N, 6) float32, written: ∂L/∂u_aniso (0 for isotropic atoms)
    gb_ptr,  # (N,) float32, written: ∂L/∂b_iso (0 for anisotropic atoms)
    gocc_ptr,  # (N,) float32, written: ∂L/∂occ
    n_atoms,
    atoms_per_frame,  # atoms of one frame (read when FRAMES)
    ATOMS: tl.constexpr,
    BP: tl.constexpr,
    BQ: tl.constexpr,
    RULE: tl.constexpr,
    NEUTRON: tl.constexpr,  # not read: the radii come from the forward
    INDEX64: tl.constexpr,
    VEC: tl.constexpr,
    FRAMES: tl.constexpr,
    SEPARABLE: tl.constexpr,  # as in the forward
):
    ia = tl.program_id(0) * ATOMS + tl.arange(0, ATOMS)
    valid = ia < n_atoms
    nx, ny, nz, h00, h11, h22, h01, h02, h12, rx, ry, rz, radius_all, cutoff = _plan_scalars(p_ptr)
    tx, ty, tz, bx, by, bz, occ, u11, u22, u33, u12, u13, u23, flag, b_iso, ok = _aniso_atom_inputs(
        xyz_ptr, u_ptr, flag_ptr, b_iso_ptr, occ_ptr, p_ptr, ia, valid, nx, ny, nz
    )
    au0, _d0, _e0, n11_0, n22_0, n33_0, n12_0, n13_0, n23_0 = _aniso_term(
        u11, u22, u33, u12, u13, u23, a_ptr, b_ptr, ia, ok, 0
    )
    au1, _d1, _e1, n11_1, n22_1, n33_1, n12_1, n13_1, n23_1 = _aniso_term(
        u11, u22, u33, u12, u13, u23, a_ptr, b_ptr, ia, ok, 1
    )
    au2, _d2, _e2, n11_2, n22_2, n33_2, n12_2, n13_2, n23_2 = _aniso_term(
        u11, u22, u33, u12, u13, u23, a_ptr, b_ptr, ia, ok, 2
    )
    au3, _d3, _e3, n11_3, n22_3, n33_3, n12_3, n13_3, n23_3 = _aniso_term(
        u11, u22, u33, u12, u13, u23, a_ptr, b_ptr, ia, ok, 3
    )
    au4, _d4, _e4, n11_4, n22_4, n33_4, n12_4, n13_4, n23_4 = _aniso_term(
        u11, u22, u33, u12, u13, u23, a_ptr, b_ptr, ia, ok, 4
    )
    if RULE == 0:
        rad = tl.zeros_like(tx) + radius_all
    else:
        rad = tl.load(radius_ptr + ia, mask=valid, other=0.0)
    lox, loy, loz, cntx, cnty, cntz, r2max = _atom_box(tx, ty, tz, rad, ok, rx, ry, rz)
    cxx0, cyy0, czz0, cxy0, cxz0, cyz0 = _log2_form(n11_0, n22_0, n33_0, n12_0, n13_0, n23_0, p_ptr)
    cxx1, cyy1, czz1, cxy1, cxz1, cyz1 = _log2_form(n11_1, n22_1, n33_1, n12_1, n13_1, n23_1, p_ptr)
    cxx2, cyy2, czz2, cxy2, cxz2, cyz2 = _log2_form(n11_2, n22_2, n33_2, n12_2, n13_2, n23_2, p_ptr)
    cxx3, cyy3, czz3, cxy3, cxz3, cyz3 = _log2_form(n11_3, n22_3, n33_3, n12_3, n13_3, n23_3, p_ptr)
    cxx4, cyy4, czz4, cxy4, cxz4, cyz4 = _log2_form(n11_4, n22_4, n33_4, n12_4, n13_4, n23_4, p_ptr)
    r2lim_a = r2max * 1.001
    r2lim = r2lim_a[:, None, None]
    r2max = r2max[:, None, None]
    if VEC:
        nz = nz // 4 * 4
        loz, cntz = _vec_z_box(bz, loz, cntz)
        inv_h22 = 1.0 / h22
    if FRAMES:
        fo = _frame_offset(ia, atoms_per_frame, nx, ny, nz, INDEX64)
    n_pc = tl.cdiv(tl.max(cntx, axis=0), BP)
    n_qc = tl.cdiv(tl.max(cntz, axis=0), BQ)
    n_rows = tl.max(cnty, axis=0)
    x_lo = lox.to(tl.float32) - tx
    z_lo = loz.to(tl.float32) - tz
    off_y = ty - loy.to(tl.float32)
    top_y = cnty.to(tl.float32)
    tx = tx[:, None, None]
    tz = tz[:, None, None]
    iy0 = _wrap(by + loy, ny)
    off_y3 = off_y[:, None, None]
    pp = tl.arange(0, BP)[None, :, None]
    qq = tl.arange(0, BQ)[None, None, :]
    # ∂L/∂centre (voxel units), ∂L/∂occ and the voxel-space X of ∂L/∂U per atom, float64 (see _fold_grads):
    # each tile's rows are summed in lane accumulators (unit amplitude: Σ g·e_k, Σ g·e_k·dy, Σ g·e_k·dy² per
    # term) and folded in after its row loop.
    zero = tl.zeros((ATOMS,), dtype=tl.float64)
    gcx, gcy, gcz, go, x11, x22, x33, x12, x13, x23 = zero, zero, zero, zero, zero, zero, zero, zero, zero, zero  # fmt: skip
    am0 = au0 * occ
    am1 = au1 * occ
    am2 = au2 * occ
    am3 = au3 * occ
    am4 = au4 * occ
    pc = 0
    while pc < n_pc:
        kx = pc * BP + pp
        ox = lox[:, None, None] + kx
        dx = ox.to(tl.float32) - tx
        ix = _wrap(bx[:, None, None] + ox, nx)
        if INDEX64:
            ix = ix.to(tl.int64)
        in_x = kx < cntx[:, None, None]
        if VEC:
            lz = h02 * dx
            q0x = h00 * dx * dx
        qc = 0
        while qc < n_qc:
            ozg, dz, iz, in_z = _z_lanes(
                qc, qq, loz[:, None, None], cntz[:, None, None], bz[:, None, None], tz, nz, BQ, VEC
            )
            in_xz = in_x & in_z
            qxz = h00 * dx * dx + 2.0 * h02 * dx * dz + h22 * dz * dz
            if SEPARABLE:
                lin = qxz  # not read
                if VEC:
                    gmin = _group_r2min(ozg, tz, lz, q0x, h22, inv_h22)
            else:
                lin = 2.0 * (h01 * dx + h12 * dz)
            base_xz = ix * (ny * nz) + iz
            if FRAMES:
                base_xz += fo
            ca0, cb0 = _column(cxx0, czz0, cxy0, cxz0, cyz0, dx, dz)
            ca1, cb1 = _column(cxx1, czz1, cxy1, cxz1, cyz1, dx, dz)
            ca2, cb2 = _column(cxx2, czz2, cxy2, cxz2, cyz2, dx, dz)
            ca3, cb3 = _column(cxx3, czz3, cxy3, cxz3, cyz3, dx, dz)
            ca4, cb4 = _column(cxx4, czz4, cxy4, cxz4, cyz4, dx, dz)
            tile = tl.zeros((ATOMS, BP, BQ), dtype=tl.float64)
            t0, ty0, tyy0 = tile, tile, tile
            t1, ty1, tyy1 = tile, tile, tile
            t2, ty2, tyy2 = tile, tile, tile
            t3, ty3, tyy3 = tile, tile, tile
            t4, ty4, tyy4 = tile, tile, tile
            r, r_end, iy, r_lo, r_hi = _tile_row_walk(
                pc, qc, cntx, cntz, qxz, lin, in_xz, x_lo, z_lo, r2lim_a, h00, h11, h22, h02, off_y, top_y,
                iy0, ny, n_rows, BP, BQ, SEPARABLE,
            )  # fmt: skip
            while r < r_end:
                dy = r.to(tl.float32) - off_y3
                qy = h11 * dy * dy
                if SEPARABLE:
                    r2 = qxz + qy
                else:
                    r2 = qxz + dy * lin + qy
                if VEC:
                    if SEPARABLE:
                        hit = gmin + qy < r2lim
                    else:
                        gmin = _group_r2min(ozg, tz, lz + h12 * dy, q0x + (2.0 * h01) * dx * dy + qy, h22, inv_h22)
                        hit = gmin < r2lim
                    hit = tl.max_constancy(hit, [1, 1, 4])
                    inside = in_xz & hit
                else:
                    inside = in_xz & (r2 < r2max)
                if ATOMS > 1:  # one atom: the loop runs exactly its rows
                    inside = inside & (r >= r_lo) & (r < r_hi)
                g = tl.load(grad_ptr + (base_xz + iy * nz), mask=inside, other=0.0)
                if VEC:
                    g = tl.where(r2 < r2max, g, 0.0)
                t0, ty0, tyy0 = _row_moments(g, tl.exp2(ca0 + dy * (cb0 + cyy0 * dy)), dy, t0, ty0, tyy0)
                t1, ty1, tyy1 = _row_moments(g, tl.exp2(ca1 + dy * (cb1 + cyy1 * dy)), dy, t1, ty1, tyy1)
                t2, ty2, tyy2 = _row_moments(g, tl.exp2(ca2 + dy * (cb2 + cyy2 * dy)), dy, t2, ty2, tyy2)
                t3, ty3, tyy3 = _row_moments(g, tl.exp2(ca3 + dy * (cb3 + cyy3 * dy)), dy, t3, ty3, tyy3)
                t4, ty4, tyy4 = _row_moments(g, tl.exp2(ca4 + dy * (cb4 + cyy4 * dy)), dy, t4, ty4, tyy4)
                iy += 1
                iy = tl.where(iy == ny, 0, iy)
                r += 1
            gcx, gcy, gcz, go, x11, x22, x33, x12, x13, x23 = _fold_grads(
                gcx, gcy, gcz, go, x11, x22, x33, x12, x13, x23,
                am0, au0, cxx0, cyy0, czz0, cxy0, cxz0, cyz0, t0, ty0, tyy0, dx, dz,
            )  # fmt: skip
            gcx, gcy, gcz, go, x11, x22, x33, x12, x13, x23 = _fold_grads(
                gcx, gcy, gcz, go, x11, x22, x33, x12, x13, x23,
                am1, au1, cxx1, cyy1, czz1, cxy1, cxz1, cyz1, t1, ty1, tyy1, dx, dz,
            )  # fmt: skip
            gcx, gcy, gcz, go, x11, x22, x33, x12, x13, x23 = _fold_grads(
                gcx, gcy, gcz, go, x11, x22, x33, x12, x13, x23,
                am2, au2, cxx2, cyy2, czz2, cxy2, cxz2, cyz2, t2, ty2, tyy2, dx, dz,
            )  # fmt: skip
            gcx, gcy, gcz, go, x11, x22, x33, x12, x13, x23 = _fold_grads(
                gcx, gcy, gcz, go, x11, x22, x33, x12, x13, x23,
                am3, au3, cxx3, cyy3, czz3, cxy3, cxz3, cyz3, t3, ty3, tyy3, dx, dz,
            )  # fmt: skip
            gcx, gcy, gcz, go, x11, x22, x33, x12, x13, x23 = _fold_grads(
                gcx, gcy, gcz, go, x11, x22, x33, x12, x13, x23,
                am4, au4, cxx4, cyy4, czz4, cxy4, cxz4, cyz4, t4, ty4, tyy4, dx, dz,
            )  # fmt: skip
            qc += 1
        pc += 1
    # centre = m·xyz (m = diag(n)·frac): ∂L/∂xyz = mᵀ·∂L/∂centre.
    m00 = tl.load(p_ptr + 23)
    m01 = tl.load(p_ptr + 24)
    m02 = tl.load(p_ptr + 25)
    m10 = tl.load(p_ptr + 26)
    m11 = tl.load(p_ptr + 27)
    m12 = tl.load(p_ptr + 28)
    m20 = tl.load(p_ptr + 29)
    m21 = tl.load(p_ptr + 30)
    m22 = tl.load(p_ptr + 31)
    # Stores cast to each gradient's dtype (xyz's for the positions, float32 for the rest).
    tl.store(gxyz_ptr + ia * 3 + 0, m00 * gcx + m10 * gcy + m20 * gcz, mask=valid)
    tl.store(gxyz_ptr + ia * 3 + 1, m01 * gcx + m11 * gcy + m21 * gcz, mask=valid)
    tl.store(gxyz_ptr + ia * 3 + 2, m02 * gcx + m12 * gcy + m22 * gcz, mask=valid)
    tl.store(gocc_ptr + ia, go, mask=valid)
    # ∂L/∂U = Σ_k ∂L/∂M_k = mᵀ·X·m; U12 stands for both (1, 2) and (2, 1), so its gradient is twice the entry's.
    d11, d22, d33, d12, d13, d23 = _sandwich(x11, x22, x33, x12, x13, x23, m00, m10, m20, m01, m11, m21, m02, m12, m22)
    # Isotropic atoms: U = B/(8π²)·I, so ∂L/∂B = tr(∂L/∂U)/(8π²); anisotropic atoms' B is not used.
    tl.store(gb_ptr + ia, tl.where(flag, 0.0, (d11 + d22 + d33) * 0.012665147955292222), mask=valid)
    tl.store(gu_ptr + ia * 6 + 0, tl.where(flag, d11, 0.0), mask=valid)
    tl.store(gu_ptr + ia * 6 + 1, tl.where(flag, d22, 0.0), mask=valid)
    tl.store(gu_ptr + ia * 6 + 2, tl.where(flag, d33, 0.0), mask=valid)
    tl.store(gu_ptr + ia * 6 + 3, tl.where(flag, 2.0 * d12, 0.0), mask=valid)
    tl.store(gu_ptr + ia * 6 + 4, tl.where(flag, 2.0 * d13, 0.0), mask=valid)
    tl.store(gu_ptr + ia * 6 + 5, tl.where(flag, 2.0 * d23, 0.0), mask=valid)


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


def _radii_device(b_iso: torch.Tensor, a: torch.Tensor, b: torch.Tensor, cutoff: float) -> torch.Tensor:
    """Per-atom cutoff radii in Å, shape (N,), float32, on the atoms' device (gemmi's rule)."""
    n = b_iso.shape[0]
    out = torch.empty(n, dtype=torch.float32, device=b_iso.device)
    block = 128 if not triton_interpreted() else 1024
    _radius_kernel[(ceil_div(n, block),)](b_iso, a, b, out, n, cutoff, MAX_STEPS=80, BLOCK=block, num_warps=4)
    return out


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
    n = xyz.shape[0]
    size = n_frames * plan.n_voxels
    fixed = torch.are_deterministic_algorithms_enabled()
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
        :func:`kernels.density.adp.effective_u` forms it (B/(8π²)·I for the isotropic atoms), so a
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
