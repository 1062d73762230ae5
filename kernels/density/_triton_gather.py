"""The binned gather forward of the isotropic Triton density splat (no float atomics, no map memset).

Launched by :func:`kernels.density.triton._forward_gather`; the design is in ``docs/performance.md``
("The binned gather forward"). Three launches after one small memset:

1. ``_gather_bin_kernel``, per atom: the cutoff radius (gemmi's rule, as the scatter computes it), the box,
   the atom's constants for the brick programs (``fprep``, ``iprep``), the bricks its box touches, and a
   count per brick (integer atomics: exact, order-free). With FIXED the fixed-point exponent as well.
2. ``torch.cumsum`` of the counts (the host launcher): each brick's first slot.
3. ``_gather_fill_kernel``, per atom: each (atom, brick) pair claims a slot of its brick's segment with an
   integer atomic and writes the atom's index there (the segment's order is the atomics' order).
4. ``_gather_brick_kernel``, per brick: walks its segment in ascending atom index (a min-selection over the
   segment, so the order of the slots does not matter), sums every atom's contribution over the brick in
   registers and writes each voxel once. The sum order per voxel is ascending atom index, fixed, so the map
   is the same bit for bit on every call; with FIXED the sums are int64 fixed point (as the deterministic
   scatter's), so also for any order of the atoms.

The key of a pair is ``frame·n_bricks + brick``, bricks numbered x-major over ``⌈n/B⌉`` per axis (the last
brick of an axis may be partial). An atom's box is a run of ``cnt`` voxels per axis from ``s = wrap(base +
lo)``; the bricks it touches are a cyclic run of ``nb ≤ ⌈n/B⌉`` bricks from ``s // B``, so a box wider than
the cell lists each brick once and the brick program adds every periodic image of the atom.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.density._triton_kernels import (
    _atom_box,
    _atom_inputs,
    _cutoff_radius,
    _exp2_sum,
    _exp2_terms,
    _fixed_exponent,
    _fixed_scale,
    _fixed_shift,
    _plan_scalars,
    _radial_coef,
    _to_fixed,
    _wrap,
)

# Per-atom constants the brick programs read, one row per atom (float32 and int32, 16 columns each).
F_COLS = 16  # tx, ty − lo_y, tz (sub-voxel offsets; y from the box's first row), R², amp_0..4 (occupancy included), α_0..4·log2 e
I_COLS = 16  # s_x, s_y, s_z, lo_x, wide (0/1), lo_z, cnt_x, cnt_y, cnt_z, pairs, sb_x, sb_y, sb_z, nb_x, nb_y, nb_z
# Larger than any atom index: the min-selection's "none left".
_NONE = tl.constexpr(2**31 - 1)

_ATOM_ARGS = ("xyz_ptr", "b_iso_ptr", "occ_ptr", "a_ptr", "b_ptr", "radius_ptr", "p_ptr")


@triton.jit
def _bricks_of_run(s, cnt, n, B: tl.constexpr):
    """Bricks of ``B`` voxels (``⌈n/B⌉`` per axis) a periodic run of ``cnt`` voxels from ``s`` ∈ [0, n) touches:
    the first brick and how many, a cyclic run, at most every brick once (0 for an empty run), and whether the
    run meets a brick twice (it wraps onto its own start: such an atom's pairs are all kept, see _pair_kept)."""
    n_b = (n + B - 1) // B
    e = s + tl.maximum(cnt, 1) - 1
    last = (e // n) * n_b + (e % n) // B  # the brick of e, counted on past the wrap
    raw = last - s // B + 1
    return s // B, tl.where(cnt > 0, tl.minimum(raw, n_b), 0), raw > n_b


@triton.jit
def _pair_key(t, sbx, sby, sbz, nbx, nby, nbz, nbax, nbay, nbaz, frame):
    """Key (frame·n_bricks + brick) of pair ``t`` ∈ [0, nbx·nby·nbz) of an atom, z fastest; nb ≥ 1."""
    kz = t % nbz
    r = t // nbz
    ky = r % nby
    kx = r // nby
    jx = (sbx + kx) % nbax
    jy = (sby + ky) % nbay
    jz = (sbz + kz) % nbaz
    return ((frame * nbax + jx) * nbay + jy) * nbaz + jz


@triton.jit
def _brick_gap8(k, sb, s, c, n, nba, B: tl.constexpr):
    """⌊8·gap⌋ (int32): the gap, in voxels, between the atom's centre and brick ``k`` of its run along one axis
    (0 when the centre's plane crosses the brick), rounded down to 1/8 voxel.

    Box offsets: the run's bricks counted on past the wrap (``sb + k``) hold box offsets [start, start + size);
    ``c`` is the centre's box offset (float32). Single float operations only (no multiply–add a compiler could
    fuse differently in two kernels): the binning and the fill launch must take the same decision.
    """
    bu = sb + k
    q = bu // nba
    j = bu - q * nba
    start = q * n + j * B - s
    size = tl.minimum(n - j * B, B)
    gap = tl.maximum(tl.maximum(start.to(tl.float32) - c, c - (start + size - 1).to(tl.float32)), 0.0)
    return tl.floor(gap * 8.0).to(tl.int32)


@triton.jit
def _pair_kept(
    t, nbx, nby, nbz, sbx, sby, sbz, sx, sy, sz, cx, cy, cz, wide, r2lim, lam, nx, ny, nz, nbax, nbay, nbaz,
    BX: tl.constexpr, BY: tl.constexpr, BZ: tl.constexpr,
):  # fmt: skip
    """Whether pair ``t`` of an atom can hold a voxel inside its sphere (else it is not listed).

    r² = dᵀ·H·d ≥ λ_min(H)·|d|² ≥ ``lam``·Σ gap², the gaps rounded down (so the bound stays below the truth) and
    summed as integers; a pair is dropped only when that bound reaches ``r2lim`` = R² widened by 0.1 % (far
    above the float32 rounding of the brick's own r²), so no voxel with r² < R² is lost. ``wide`` atoms (a run
    that meets a brick twice) keep every pair. About a third of a box's bricks lie outside its sphere.
    """
    kz = t % nbz
    r = t // nbz
    ky = r % nby
    kx = r // nby
    gx = _brick_gap8(kx, sbx, sx, cx, nx, nbax, BX)
    gy = _brick_gap8(ky, sby, sy, cy, ny, nbay, BY)
    gz = _brick_gap8(kz, sbz, sz, cz, nz, nbaz, BZ)
    s2 = gx * gx + gy * gy + gz * gz  # (8·gap)², exact in int32 for any grid below 2·10⁴ voxels an axis
    return wide | (s2.to(tl.float32) * lam < r2lim)


@triton.jit
def _load_pair_geometry(iprep_ptr, ia, valid):
    """(ATOMS,) each: first bricks, brick counts per axis (each ≥ 1 where the atom has pairs) and pairs."""
    row = iprep_ptr + ia * 16
    n_pairs = tl.load(row + 9, mask=valid, other=0)
    sbx = tl.load(row + 10, mask=valid, other=0)
    sby = tl.load(row + 11, mask=valid, other=0)
    sbz = tl.load(row + 12, mask=valid, other=0)
    nbx = tl.maximum(tl.load(row + 13, mask=valid, other=1), 1)
    nby = tl.maximum(tl.load(row + 14, mask=valid, other=1), 1)
    nbz = tl.maximum(tl.load(row + 15, mask=valid, other=1), 1)
    return sbx, sby, sbz, nbx, nby, nbz, n_pairs


@triton.jit(
    do_not_specialize=(
        *_ATOM_ARGS,
        "fprep_ptr",
        "iprep_ptr",
        "count_ptr",
        "fix_ptr",
        "n_atoms",
        "atoms_per_frame",
        "lam",
    ),
    do_not_specialize_on_alignment=_ATOM_ARGS,
)
def _gather_bin_kernel(
    xyz_ptr,  # (N, 3) float32 or float64, Å
    b_iso_ptr,  # (N,) float32, Å²
    occ_ptr,  # (N,) float32
    a_ptr,  # (N, 5) float32
    b_ptr,  # (N, 5) float32, Å²
    radius_ptr,  # (N,) float32, Å: written with each atom's cutoff radius when PER_ATOM_RADIUS
    p_ptr,  # (41,) float64, the plan's constants (layout: _Plan.build)
    fprep_ptr,  # (N, 16) float32, written: F_COLS
    iprep_ptr,  # (N, 16) int32, written: I_COLS
    count_ptr,  # (F·n_bricks + 1,) int32, zero-filled: pairs of brick key k added at k + 1
    fix_ptr,  # (2,) int64, zero-filled: [0] atomic max of the fixed-point exponents (FIXED)
    n_atoms,
    atoms_per_frame,  # atoms of one frame (read when FRAMES)
    lam,  # float32: λ_min of the voxel-unit metric over 64 (a lower bound; _pair_kept)
    BLOCK: tl.constexpr,  # atoms per program
    TCH: tl.constexpr,  # pairs per atom per loop trip
    BX: tl.constexpr,
    BY: tl.constexpr,
    BZ: tl.constexpr,
    PER_ATOM_RADIUS: tl.constexpr,
    FRAMES: tl.constexpr,
    FIXED: tl.constexpr,
):
    ia = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = ia < n_atoms
    nx, ny, nz, h00, h11, h22, h01, h02, h12, rx, ry, rz, radius_all, cutoff = _plan_scalars(p_ptr)
    tx, ty, tz, bx, by, bz, b_iso, occ, ok = _atom_inputs(xyz_ptr, b_iso_ptr, occ_ptr, p_ptr, ia, valid, nx, ny, nz)
    if PER_ATOM_RADIUS:
        # The scatter's radius (same inputs, masks and search), kept for the backward.
        rad = _cutoff_radius(b_iso, a_ptr, b_ptr, ia, ok, cutoff, 80)
        tl.store(radius_ptr + ia, rad, mask=valid)
    else:
        rad = tl.zeros_like(tx) + radius_all
    lox, loy, loz, cntx, cnty, cntz, r2max = _atom_box(tx, ty, tz, rad, ok, rx, ry, rz)
    sx = _wrap(bx + lox, nx)
    sy = _wrap(by + loy, ny)
    sz = _wrap(bz + loz, nz)
    sbx, nbx, wx = _bricks_of_run(sx, cntx, nx, BX)
    sby, nby, wy = _bricks_of_run(sy, cnty, ny, BY)
    sbz, nbz, wz = _bricks_of_run(sz, cntz, nz, BZ)
    wide = wx | wy | wz
    n_pairs = nbx * nby * nbz
    frow = fprep_ptr + ia * 16
    tl.store(frow + 0, tx, mask=valid)
    # The scatter's row offset (off_y of _walk_setup): dy = row − off_y rounds as there.
    tl.store(frow + 1, ty - loy.to(tl.float32), mask=valid)
    tl.store(frow + 2, tz, mask=valid)
    tl.store(frow + 3, r2max, mask=valid)
    peak = tl.zeros_like(b_iso)
    for k in tl.static_range(5):
        amp, al, _bk = _radial_coef(a_ptr, b_ptr, ia, valid, b_iso, k)
        # The scatter's amplitude and exponent (_fwd_term), so each contribution rounds as its does.
        tl.store(frow + 4 + k, amp * occ, mask=valid)
        tl.store(frow + 9 + k, al * 1.4426950408889634, mask=valid)
        peak += tl.abs(amp)
    irow = iprep_ptr + ia * 16
    tl.store(irow + 0, sx, mask=valid)
    tl.store(irow + 1, sy, mask=valid)
    tl.store(irow + 2, sz, mask=valid)
    tl.store(irow + 3, lox, mask=valid)
    tl.store(irow + 4, wide.to(tl.int32), mask=valid)
    tl.store(irow + 5, loz, mask=valid)
    tl.store(irow + 6, cntx, mask=valid)
    tl.store(irow + 7, cnty, mask=valid)
    tl.store(irow + 8, cntz, mask=valid)
    tl.store(irow + 9, n_pairs, mask=valid)
    tl.store(irow + 10, sbx, mask=valid)
    tl.store(irow + 11, sby, mask=valid)
    tl.store(irow + 12, sbz, mask=valid)
    tl.store(irow + 13, nbx, mask=valid)
    tl.store(irow + 14, nby, mask=valid)
    tl.store(irow + 15, nbz, mask=valid)
    if FIXED:
        # The deterministic scatter's exponent (_fixed_scale_kernel): the same S, so the same fixed-point sums.
        tl.atomic_max(fix_ptr, _fixed_exponent(tl.abs(occ) * peak, cntx, cnty, cntz, nx, ny, nz, valid), sem="relaxed")
    frame = ia // atoms_per_frame if FRAMES else ia * 0
    nbax = (nx + BX - 1) // BX
    nbay = (ny + BY - 1) // BY
    nbaz = (nz + BZ - 1) // BZ
    n_pairs = tl.where(valid, n_pairs, 0)
    # The centre's box offsets as the fill launch forms them from fprep and iprep (the same float32 values).
    cx = (tx - lox.to(tl.float32))[:, None]
    cy = (ty - loy.to(tl.float32))[:, None]
    cz = (tz - loz.to(tl.float32))[:, None]
    r2lim = (r2max * 1.001)[:, None]
    nbx = tl.maximum(nbx, 1)[:, None]
    nby = tl.maximum(nby, 1)[:, None]
    nbz = tl.maximum(nbz, 1)[:, None]
    top = tl.max(n_pairs, axis=0)
    t0 = 0
    while t0 < top:
        t = t0 + tl.arange(0, TCH)[None, :]
        m = t < n_pairs[:, None]
        key = _pair_key(t, sbx[:, None], sby[:, None], sbz[:, None], nbx, nby, nbz, nbax, nbay, nbaz, frame[:, None])
        m = m & _pair_kept(
            t, nbx, nby, nbz, sbx[:, None], sby[:, None], sbz[:, None], sx[:, None], sy[:, None], sz[:, None], cx, cy,
            cz, wide[:, None], r2lim, lam, nx, ny, nz, nbax, nbay, nbaz, BX, BY, BZ,
        )  # fmt: skip
        tl.atomic_add(count_ptr + key + 1, 1, mask=m, sem="relaxed")
        t0 += TCH


@triton.jit(
    do_not_specialize=(
        "iprep_ptr",
        "start_ptr",
        "pair_ptr",
        "fix_ptr",
        "n_atoms",
        "atoms_per_frame",
        "capacity",
        "lam",
        "fprep_ptr",
    )
)
def _gather_fill_kernel(
    p_ptr,  # (41,) float64, the plan's constants
    iprep_ptr,  # (N, 16) int32, _gather_bin_kernel's
    start_ptr,  # (F·n_bricks + 1,) int32: brick k's first slot at k; each claim adds 1, so k ends at brick k + 1's first
    pair_ptr,  # (capacity,) int32, written: the atom of each slot
    fix_ptr,  # (2,) int64: [1] set to 1 when a slot past the capacity was claimed
    n_atoms,
    atoms_per_frame,
    capacity,
    lam,  # as for _gather_bin_kernel
    fprep_ptr,  # (N, 16) float32, _gather_bin_kernel's
    BLOCK: tl.constexpr,
    TCH: tl.constexpr,
    BX: tl.constexpr,
    BY: tl.constexpr,
    BZ: tl.constexpr,
    FRAMES: tl.constexpr,
):
    ia = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = ia < n_atoms
    nx = tl.load(p_ptr + 9).to(tl.int32)
    ny = tl.load(p_ptr + 10).to(tl.int32)
    nz = tl.load(p_ptr + 11).to(tl.int32)
    nbax = (nx + BX - 1) // BX
    nbay = (ny + BY - 1) // BY
    nbaz = (nz + BZ - 1) // BZ
    sbx, sby, sbz, nbx, nby, nbz, n_pairs = _load_pair_geometry(iprep_ptr, ia, valid)
    frame = ia // atoms_per_frame if FRAMES else ia * 0
    irow = iprep_ptr + ia * 16
    frow = fprep_ptr + ia * 16
    sx = tl.load(irow + 0, mask=valid, other=0)[:, None]
    sy = tl.load(irow + 1, mask=valid, other=0)[:, None]
    sz = tl.load(irow + 2, mask=valid, other=0)[:, None]
    wide = tl.load(irow + 4, mask=valid, other=0)[:, None] != 0
    cx = (tl.load(frow + 0, mask=valid, other=0.0) - tl.load(irow + 3, mask=valid, other=0).to(tl.float32))[:, None]
    cy = tl.load(frow + 1, mask=valid, other=0.0)[:, None]
    cz = (tl.load(frow + 2, mask=valid, other=0.0) - tl.load(irow + 5, mask=valid, other=0).to(tl.float32))[:, None]
    r2lim = (tl.load(frow + 3, mask=valid, other=0.0) * 1.001)[:, None]
    top = tl.max(n_pairs, axis=0)
    t0 = 0
    while t0 < top:
        t = t0 + tl.arange(0, TCH)[None, :]
        m = t < n_pairs[:, None]
        key = _pair_key(
            t, sbx[:, None], sby[:, None], sbz[:, None], nbx[:, None], nby[:, None], nbz[:, None], nbax, nbay, nbaz,
            frame[:, None],
        )  # fmt: skip
        m = m & _pair_kept(
            t, nbx[:, None], nby[:, None], nbz[:, None], sbx[:, None], sby[:, None], sbz[:, None], sx, sy, sz, cx, cy,
            cz, wide, r2lim, lam, nx, ny, nz, nbax, nbay, nbaz, BX, BY, BZ,
        )  # fmt: skip
        slot = tl.atomic_add(start_ptr + key, 1, mask=m, sem="relaxed")
        fits = slot < capacity
        tl.store(pair_ptr + slot, ia[:, None] + t * 0, mask=m & fits)
        tl.store(fix_ptr + 1 + slot.to(tl.int64) * 0, slot.to(tl.int64) * 0 + 1, mask=m & (fits == 0))
        t0 += TCH


@triton.jit
def _next_atom(pair_ptr, begin, n_seg, last, SEG: tl.constexpr):
    """The smallest atom index above ``last`` in the segment [begin, begin + n_seg) of ``pair_ptr`` (int32)."""
    best = _NONE
    c = 0
    while c < n_seg:
        j = c + tl.arange(0, SEG)
        ids = tl.load(pair_ptr + begin + j, mask=j < n_seg, other=_NONE)
        best = tl.minimum(best, tl.min(tl.where(ids > last, ids, _NONE), axis=0))
        c += SEG
    return best


@triton.jit(do_not_specialize=("fprep_ptr", "iprep_ptr", "start_ptr", "pair_ptr", "fix_ptr", "fix_shift", "capacity"))
def _gather_brick_kernel(
    p_ptr,  # (41,) float64, the plan's constants
    fprep_ptr,  # (N, 16) float32, _gather_bin_kernel's
    iprep_ptr,  # (N, 16) int32, _gather_bin_kernel's
    start_ptr,  # (F·n_bricks + 1,) int32, after the fill: brick k's segment ends at k (begins at k − 1, 0 for k = 0)
    pair_ptr,  # (capacity,) int32, the atom of each slot
    fix_ptr,  # (2,) int64: [0] the largest exponent (FIXED), [1] overflow (the map is NaN when set)
    out_ptr,  # (F·nx·ny·nz,) float32, written once per voxel
    fix_shift,  # 62 − ⌈log2(atoms of one map)⌉ (read when FIXED)
    capacity,
    BX: tl.constexpr,
    BY: tl.constexpr,
    BZ: tl.constexpr,
    SEG: tl.constexpr,  # slots per load of the min-selection
    SEPARABLE: tl.constexpr,  # orthogonal and monoclinic: exp(−α r²) = E(x, z)·e(y); otherwise the full form
    FIXED: tl.constexpr,
):
    key = tl.program_id(0)
    nx, ny, nz, h00, h11, h22, h01, h02, h12, _rx, _ry, _rz, _radius_all, _cutoff = _plan_scalars(p_ptr)
    nbax = (nx + BX - 1) // BX
    nbay = (ny + BY - 1) // BY
    nbaz = (nz + BZ - 1) // BZ
    n_bricks = nbax * nbay * nbaz
    frame = key // n_bricks
    j = key % n_bricks
    jz = j % nbaz
    jy = (j // nbaz) % nbay
    jx = j // (nbaz * nbay)
    begin = tl.minimum(tl.where(key > 0, tl.load(start_ptr + key - 1, mask=key > 0, other=0), 0), capacity)
    n_seg = tl.minimum(tl.load(start_ptr + key), capacity) - begin
    # The brick as a (BY, BX, BZ) tensor, y the slowest axis: a program's lanes cover the (x, z) plane and each
    # thread holds several rows y of the same (x, z), so the x–z factors of the separable cells (and the z
    # factors of the hexagonal kind) are evaluated once per thread and reused down its rows.
    gy = jy * BY + tl.arange(0, BY)[:, None, None]
    gx = jx * BX + tl.arange(0, BX)[None, :, None]
    gz = jz * BZ + tl.arange(0, BZ)[None, None, :]
    if FIXED:
        acc = tl.zeros((BY, BX, BZ), dtype=tl.int64)
        scale = _fixed_scale(fix_ptr, fix_shift)
    else:
        acc = tl.zeros((BY, BX, BZ), dtype=tl.float32)
    # A segment of at most SEG slots (most: 3WIP at 0.67 Å has 24 atoms a brick on average) stays in registers,
    # so each step's selection is a reduction with no load.
    j0 = tl.arange(0, SEG)
    ids0 = tl.load(pair_ptr + begin + j0, mask=j0 < n_seg, other=_NONE)
    last = -1
    p = 0
    while p < n_seg:
        if n_seg <= SEG:
            ia = tl.min(tl.where(ids0 > last, ids0, _NONE), axis=0)
        else:
            ia = _next_atom(pair_ptr, begin, n_seg, last, SEG)
        last = ia
        frow = fprep_ptr + ia.to(tl.int64) * 16
        irow = iprep_ptr + ia.to(tl.int64) * 16
        tx = tl.load(frow + 0)
        off_y = tl.load(frow + 1)
        tz = tl.load(frow + 2)
        r2max = tl.load(frow + 3)
        amp0 = tl.load(frow + 4)
        amp1 = tl.load(frow + 5)
        amp2 = tl.load(frow + 6)
        amp3 = tl.load(frow + 7)
        amp4 = tl.load(frow + 8)
        be0 = tl.load(frow + 9)
        be1 = tl.load(frow + 10)
        be2 = tl.load(frow + 11)
        be3 = tl.load(frow + 12)
        be4 = tl.load(frow + 13)
        lox = tl.load(irow + 3)
        loz = tl.load(irow + 5)
        cntx = tl.load(irow + 6)
        cnty = tl.load(irow + 7)
        cntz = tl.load(irow + 8)
        # Box step of each lane's first periodic image; further images are n apart (a box wider than the cell).
        # (g − s) ∈ (−n, n) for the lanes inside the grid (g, s ∈ [0, n)): one select wraps it (an integer modulo
        # is ~20 instructions a lane). Lanes past the grid's end (a partial brick) are never stored.
        ux = gx - tl.load(irow + 0)
        uy = gy - tl.load(irow + 1)
        uz = gz - tl.load(irow + 2)
        ux = tl.where(ux < 0, ux + nx, ux)
        uy = tl.where(uy < 0, uy + ny, uy)
        uz = tl.where(uz < 0, uz + nz, uz)
        kx = 0
        while kx < cntx:  # images n apart: one trip per axis unless the box is wider than the cell
            in_x = kx + ux < cntx
            dx = (lox + kx + ux).to(tl.float32) - tx
            ky = 0
            while ky < cnty:
                in_y = ky + uy < cnty
                dy = (ky + uy).to(tl.float32) - off_y
                qy = h11 * dy * dy
                kz = 0
                while kz < cntz:
                    in_z = kz + uz < cntz
                    dz = (loz + kz + uz).to(tl.float32) - tz
                    # _splat_fwd_kernel's expressions (its E(x, y)·e(z) on hexagonal cells aside), so a contribution
                    # rounds as there.
                    if SEPARABLE:
                        qxz = h00 * dx * dx + 2.0 * h02 * dx * dz + h22 * dz * dz  # (1, BX, BZ)
                        e0, e1, e2, e3, e4 = _exp2_terms(amp0, amp1, amp2, amp3, amp4, be0, be1, be2, be3, be4, qxz)
                        r2 = qxz + qy
                        val = _exp2_sum(e0, e1, e2, e3, e4, be0, be1, be2, be3, be4, qy)
                    else:
                        qxz = h00 * dx * dx + 2.0 * h02 * dx * dz + h22 * dz * dz
                        lin = 2.0 * (h01 * dx + h12 * dz)
                        r2 = qxz + dy * lin + qy
                        val = _exp2_sum(amp0, amp1, amp2, amp3, amp4, be0, be1, be2, be3, be4, r2)
                    inside = in_x & in_y & in_z & (r2 < r2max)
                    if FIXED:
                        acc += tl.where(inside, _to_fixed(val, scale), 0)
                    else:
                        acc += tl.where(inside, val, 0.0)
                    kz += nz
                ky += ny
            kx += nx
        p += 1
    if FIXED:
        inv = ((1023 - _fixed_shift(fix_ptr, fix_shift)).to(tl.int64) << 52).to(tl.float64, bitcast=True)  # 2^−S
        res = (acc.to(tl.float64) * inv).to(tl.float32)
        res = tl.where(tl.load(fix_ptr) >= 2000, float("nan"), res)
    else:
        res = acc
    res = tl.where(tl.load(fix_ptr + 1) != 0, float("nan"), res)
    off = frame.to(tl.int64) * nx * ny * nz + (gx.to(tl.int64) * ny + gy) * nz + gz
    tl.store(out_ptr + off, res, mask=(gx < nx) & (gy < ny) & (gz < nz))
