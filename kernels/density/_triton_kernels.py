"""The isotropic Triton density kernels and the device helpers the anisotropic ones share.

Launched by :mod:`kernels.density.triton`, whose docstring gives the design (tiles, row spans, z groups,
the float64 wrap, the deterministic fixed-point forward).
"""

from __future__ import annotations

import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


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
def _walk_setup(
    ia, tx, ty, tz, by, bz, lox, loy, loz, cntx, cnty, cntz, r2max, h22, nx, ny, nz, atoms_per_frame,
    BP: tl.constexpr, BQ: tl.constexpr, VEC: tl.constexpr, FRAMES: tl.constexpr, INDEX64: tl.constexpr,
):  # fmt: skip
    """What every splat kernel's walk over its atoms' boxes needs, from the boxes (:func:`_atom_box`).

    Returns, in order:

    - ``nz, loz, cntz``: the grid's z size and the z boxes, in groups of 4 with VEC (nz % 4 == 0, written
      so that the axis analysis sees nz and the row strides divide by 4; :func:`_vec_z_box`);
    - ``inv_h22`` (VEC; h22 otherwise, not read) and ``fo``, each atom's frame offset (FRAMES; 0 otherwise);
    - ``r2lim_a`` (ATOMS,), ``r2lim`` and ``r2max`` (ATOMS, 1, 1): R² widened by 0.1 % for the group masks
      and row spans (far above float32 rounding, ~1e-6 relative, so a group or row holding a voxel with
      r² < R² is never masked off), and R²;
    - ``n_pc, n_qc, n_rows``: x and z chunks and rows of the largest box;
    - ``x_lo, z_lo, off_y, top_y`` (ATOMS,): the box's first dx and dz, and the row offset and count, for
      the per-tile row spans (dy = r − off_y);
    - ``tx, tz, off_y`` as (ATOMS, 1, 1) and ``iy0``, the wrapped grid row of box row 0 (ATOMS,), which the
      walk steps by one per row trip (a modulo per row would cost ~30 instructions a trip);
    - ``pp`` (1, BP, 1) and ``qq`` (1, 1, BQ): the lanes of a tile.
    """
    r2lim_a = r2max * 1.001
    if VEC:
        nz = nz // 4 * 4
        loz, cntz = _vec_z_box(bz, loz, cntz)
        inv_h22 = 1.0 / h22
    else:
        inv_h22 = h22
    if FRAMES:
        fo = _frame_offset(ia, atoms_per_frame, nx, ny, nz, INDEX64)
    else:
        fo = 0
    n_pc = tl.cdiv(tl.max(cntx, axis=0), BP)
    n_qc = tl.cdiv(tl.max(cntz, axis=0), BQ)
    n_rows = tl.max(cnty, axis=0)
    x_lo = lox.to(tl.float32) - tx
    z_lo = loz.to(tl.float32) - tz
    off_y = ty - loy.to(tl.float32)
    top_y = cnty.to(tl.float32)
    iy0 = _wrap(by + loy, ny)
    return (
        nz, loz, cntz, inv_h22, fo, r2lim_a, r2lim_a[:, None, None], r2max[:, None, None], n_pc, n_qc, n_rows,
        x_lo, z_lo, off_y, top_y, tx[:, None, None], tz[:, None, None], off_y[:, None, None], iy0,
        tl.arange(0, BP)[None, :, None], tl.arange(0, BQ)[None, None, :],
    )  # fmt: skip


@triton.jit
def _x_lanes(pc, pp, lox, bx, tx, cntx, nx, h00, h02, BP: tl.constexpr, INDEX64: tl.constexpr):
    """x lanes of chunk ``pc``, (ATOMS, BP, 1): dx, the grid index, whether the lane is in the box, and the
    x parts of the VEC group bound (r² = h22·dz² + 2·lz·dz + q0x + y terms along the lane; not read without VEC)."""
    kx = pc * BP + pp
    ox = lox[:, None, None] + kx
    dx = ox.to(tl.float32) - tx
    ix = _wrap(bx[:, None, None] + ox, nx)
    if INDEX64:
        ix = ix.to(tl.int64)
    return dx, ix, kx < cntx[:, None, None], h02 * dx, h00 * dx * dx


@triton.jit
def _xz_lanes(
    qc, qq, loz, cntz, bz, tz, nz, ny, dx, ix, in_x, fo, h00, h02, h22,
    BQ: tl.constexpr, VEC: tl.constexpr, FRAMES: tl.constexpr,
):  # fmt: skip
    """The tile of x lanes (:func:`_x_lanes`) and the z lanes of chunk ``qc``, (ATOMS, BP, BQ): each lane's
    group offset (:func:`_z_lanes`), dz, whether it is in the box, the metric's x–z part of r² (Å²) and the
    flat index of its voxel in box row 0 less the row (plus its frame's offset)."""
    ozg, dz, iz, in_z = _z_lanes(qc, qq, loz[:, None, None], cntz[:, None, None], bz[:, None, None], tz, nz, BQ, VEC)
    qxz = h00 * dx * dx + 2.0 * h02 * dx * dz + h22 * dz * dz
    base_xz = ix * (ny * nz) + iz
    if FRAMES:
        base_xz += fo
    return ozg, dz, in_x & in_z, qxz, base_xz


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
def _row_lanes(
    r, r_lo, r_hi, r2, r2max, r2lim, in_xz, gmin, qy, ozg, tz, lz, q0x, dx, dy, h01, h12, h22, inv_h22,
    ATOMS: tl.constexpr, VEC: tl.constexpr, SEPARABLE: tl.constexpr,
):  # fmt: skip
    """The lanes of row ``r`` of a tile to touch, (ATOMS, BP, BQ) bool.

    Without VEC the lanes in the box and inside the sphere (r² < R²). With VEC every lane of a group of 4 z
    lanes that may hold a voxel inside (the group's lower bound of r², :func:`_group_r2min`, below the widened
    R²; from ``gmin`` plus the row's ``qy`` on separable cells): the mask is constant over each group, so sm_90
    takes one vector atomic or load per group, and the caller zeroes the values of the lanes outside the sphere
    (``r2 < r2max``), so the voxel set stays r² < R². With more than one atom a program, only the atom's rows.
    """
    if VEC:
        if SEPARABLE:
            hit = gmin + qy < r2lim
        else:
            hit = _group_r2min(ozg, tz, lz + h12 * dy, q0x + (2.0 * h01) * dx * dy + qy, h22, inv_h22) < r2lim
        # True by construction (hit is a function of the group's start only); Triton's axis analysis cannot see
        # it through float ops, and its v4 lowering needs it.
        inside = in_xz & tl.max_constancy(hit, [1, 1, 4])
    else:
        inside = in_xz & (r2 < r2max)
    if ATOMS > 1:  # one atom: the loop runs exactly its rows
        inside = inside & (r >= r_lo) & (r < r_hi)
    return inside


@triton.jit
def _load_row(ptr, inside, r2, r2max, VEC: tl.constexpr):
    """A backward's row of the upstream gradient at ``ptr`` where ``inside`` (:func:`_row_lanes`) says, 0 elsewhere
    (the VEC lanes outside the sphere too)."""
    g = tl.load(ptr, mask=inside, other=0.0)
    if VEC:
        g = tl.where(r2 < r2max, g, 0.0)
    return g


@triton.jit
def _add_row(ptr, val, inside, r2, r2max, scale, VEC: tl.constexpr, FIXED: tl.constexpr):
    """Add a forward's row of values to the map at ``ptr`` where ``inside`` (:func:`_row_lanes`) says, the VEC
    lanes outside the sphere an exact 0: float32 atomics, or with FIXED (deterministic mode) int64 fixed-point
    adds at ``scale``, which are scalar either way, so only the voxels inside the sphere take one."""
    if VEC:
        val = tl.where(r2 < r2max, val, 0.0)
    if FIXED:
        tl.atomic_add(ptr, _to_fixed(val, scale), mask=inside & (r2 < r2max), sem="relaxed")
    else:
        tl.atomic_add(ptr, val, mask=inside, sem="relaxed")


@triton.jit
def _fwd_term(a_ptr, b_ptr, ia, valid, b_iso, occ, k: tl.constexpr):
    """Gaussian k's amplitude at the atom's occupancy and its exponent in log2 units, (ATOMS, 1, 1)."""
    amp, al, _bk = _radial_coef(a_ptr, b_ptr, ia, valid, b_iso, k)
    return (amp * occ)[:, None, None], (al * 1.4426950408889634)[:, None, None]


@triton.jit
def _bwd_term(a_ptr, b_ptr, ia, valid, b_iso, k: tl.constexpr):
    """Gaussian k's weights in the backward's sums, (ATOMS, 1, 1) each: c (unit-occupancy amplitude),
    c·α, c·α/B_k, 1.5·c/B_k, and the exponent α in log2 units."""
    c, al, w = _radial_coef(a_ptr, b_ptr, ia, valid, b_iso, k)
    ca = (c * al)[:, None, None]
    cab = (c * al / w)[:, None, None]
    cb = (c * 1.5 / w)[:, None, None]
    return c[:, None, None], ca, cab, cb, (al * 1.4426950408889634)[:, None, None]


@triton.jit
def _exp2_each(be0, be1, be2, be3, be4, q):
    """2^(−be_k·q) for each Gaussian k."""
    return tl.exp2(-be0 * q), tl.exp2(-be1 * q), tl.exp2(-be2 * q), tl.exp2(-be3 * q), tl.exp2(-be4 * q)


@triton.jit
def _exp2_terms(c0, c1, c2, c3, c4, be0, be1, be2, be3, be4, q):
    """c_k·2^(−be_k·q) for each Gaussian k."""
    return (
        c0 * tl.exp2(-be0 * q),
        c1 * tl.exp2(-be1 * q),
        c2 * tl.exp2(-be2 * q),
        c3 * tl.exp2(-be3 * q),
        c4 * tl.exp2(-be4 * q),
    )


@triton.jit
def _sum_of_products(a0, a1, a2, a3, a4, b0, b1, b2, b3, b4, c0, c1, c2, c3, c4):
    """Σ_k a_k·b_k·c_k over the five Gaussians."""
    return a0 * b0 * c0 + a1 * b1 * c1 + a2 * b2 * c2 + a3 * b3 * c3 + a4 * b4 * c4


@triton.jit
def _dot5(a0, a1, a2, a3, a4, b0, b1, b2, b3, b4):
    """Σ_k a_k·b_k over the five Gaussians."""
    return a0 * b0 + a1 * b1 + a2 * b2 + a3 * b3 + a4 * b4


@triton.jit
def _store_position_grad(gxyz_ptr, p_ptr, ia, valid, gcx, gcy, gcz, TO32: tl.constexpr):
    """∂L/∂xyz = mᵀ·∂L/∂centre (centre = m·xyz, m = diag(n)·frac), stored in the gradient's dtype.

    ``TO32``: m rounded to float32 before the products (the isotropic backward's float32 sums).
    """
    m00 = tl.load(p_ptr + 23)
    m01 = tl.load(p_ptr + 24)
    m02 = tl.load(p_ptr + 25)
    m10 = tl.load(p_ptr + 26)
    m11 = tl.load(p_ptr + 27)
    m12 = tl.load(p_ptr + 28)
    m20 = tl.load(p_ptr + 29)
    m21 = tl.load(p_ptr + 30)
    m22 = tl.load(p_ptr + 31)
    if TO32:
        m00, m01, m02 = m00.to(tl.float32), m01.to(tl.float32), m02.to(tl.float32)
        m10, m11, m12 = m10.to(tl.float32), m11.to(tl.float32), m12.to(tl.float32)
        m20, m21, m22 = m20.to(tl.float32), m21.to(tl.float32), m22.to(tl.float32)
    tl.store(gxyz_ptr + ia * 3 + 0, m00 * gcx + m10 * gcy + m20 * gcz, mask=valid)
    tl.store(gxyz_ptr + ia * 3 + 1, m01 * gcx + m11 * gcy + m21 * gcz, mask=valid)
    tl.store(gxyz_ptr + ia * 3 + 2, m02 * gcx + m12 * gcy + m22 * gcz, mask=valid)


@triton.jit
def _iso_accumulators(ATOMS: tl.constexpr, BP: tl.constexpr, BQ: tl.constexpr, SEPARABLE: tl.constexpr):
    """The isotropic backward's five float32 sums, zero: per atom (ATOMS,) on separable cells, whose tiles
    fold their sums in right after their row loops (no lane accumulators stay live across the row loops,
    which hold 15 of their own); otherwise per lane (ATOMS, BP, BQ), summed once at the end."""
    if SEPARABLE:
        z = tl.zeros((ATOMS,), dtype=tl.float32)
    else:
        z = tl.zeros((ATOMS, BP, BQ), dtype=tl.float32)
    return z, z, z, z, z


@triton.jit
def _store_iso_grads(
    gxyz_ptr, gb_ptr, gocc_ptr, p_ptr, ia, valid, occ, acc_o, acc_x, acc_y, acc_z, acc_b,
    h00, h11, h22, h01, h02, h12, SEPARABLE: tl.constexpr,
):  # fmt: skip
    """The isotropic backward's gradients from its sums (:func:`_iso_accumulators`): ∂L/∂xyz, ∂L/∂b_iso, ∂L/∂occ."""
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
    _store_position_grad(gxyz_ptr, p_ptr, ia, valid, gcx, gcy, gcz, True)
    tl.store(gb_ptr + ia, s_b, mask=valid)
    tl.store(gocc_ptr + ia, s_o, mask=valid)


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
    scale = _fixed_scale(fix_ptr, fix_shift) if FIXED else 0.0  # the fixed-point scale (FIXED)
    lox, loy, loz, cntx, cnty, cntz, r2max = _atom_box(tx, ty, tz, rad, ok, rx, ry, rz)
    amp0, be0 = _fwd_term(a_ptr, b_ptr, ia, valid, b_iso, occ, 0)
    amp1, be1 = _fwd_term(a_ptr, b_ptr, ia, valid, b_iso, occ, 1)
    amp2, be2 = _fwd_term(a_ptr, b_ptr, ia, valid, b_iso, occ, 2)
    amp3, be3 = _fwd_term(a_ptr, b_ptr, ia, valid, b_iso, occ, 3)
    amp4, be4 = _fwd_term(a_ptr, b_ptr, ia, valid, b_iso, occ, 4)
    (
        nz, loz, cntz, inv_h22, fo, r2lim_a, r2lim, r2max, n_pc, n_qc, n_rows, x_lo, z_lo, off_y, top_y, tx, tz,
        off_y3, iy0, pp, qq,
    ) = _walk_setup(
        ia, tx, ty, tz, by, bz, lox, loy, loz, cntx, cnty, cntz, r2max, h22, nx, ny, nz, atoms_per_frame,
        BP, BQ, VEC, FRAMES, INDEX64,
    )  # fmt: skip
    pc = 0
    while pc < n_pc:
        dx, ix, in_x, lz, q0x = _x_lanes(pc, pp, lox, bx, tx, cntx, nx, h00, h02, BP, INDEX64)
        qc = 0
        while qc < n_qc:
            ozg, dz, in_xz, qxz, base_xz = _xz_lanes(
                qc, qq, loz, cntz, bz, tz, nz, ny, dx, ix, in_x, fo, h00, h02, h22, BQ, VEC, FRAMES
            )
            # x–z part of the group's r² bound (VEC, separable cells; not read otherwise)
            gmin = _group_r2min(ozg, tz, lz, q0x, h22, inv_h22) if VEC and SEPARABLE else qxz
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
                e0, e1, e2, e3, e4 = _exp2_terms(amp0, amp1, amp2, amp3, amp4, be0, be1, be2, be3, be4, q_lane)
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
                inside = _row_lanes(
                    r, r_lo, r_hi, r2, r2max, r2lim, in_xz, gmin, qy, ozg, tz, lz, q0x, dx, dy, h01, h12, h22, inv_h22,
                    ATOMS, VEC, SEPARABLE,
                )  # fmt: skip
                _add_row(out_ptr + (base_xz + iy * nz), val, inside, r2, r2max, scale, VEC, FIXED)
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
    c0, ca0, cab0, cb0, be0 = _bwd_term(a_ptr, b_ptr, ia, valid, b_iso, 0)
    c1, ca1, cab1, cb1, be1 = _bwd_term(a_ptr, b_ptr, ia, valid, b_iso, 1)
    c2, ca2, cab2, cb2, be2 = _bwd_term(a_ptr, b_ptr, ia, valid, b_iso, 2)
    c3, ca3, cab3, cb3, be3 = _bwd_term(a_ptr, b_ptr, ia, valid, b_iso, 3)
    c4, ca4, cab4, cb4, be4 = _bwd_term(a_ptr, b_ptr, ia, valid, b_iso, 4)
    (
        nz, loz, cntz, inv_h22, fo, r2lim_a, r2lim, r2max, n_pc, n_qc, n_rows, x_lo, z_lo, off_y, top_y, tx, tz,
        off_y3, iy0, pp, qq,
    ) = _walk_setup(
        ia, tx, ty, tz, by, bz, lox, loy, loz, cntx, cnty, cntz, r2max, h22, nx, ny, nz, atoms_per_frame,
        BP, BQ, VEC, FRAMES, INDEX64,
    )  # fmt: skip
    # Σ g·u0, Σ g·u1·d (voxel units, x y z), Σ g·u2
    acc_o, acc_x, acc_y, acc_z, acc_b = _iso_accumulators(ATOMS, BP, BQ, SEPARABLE)
    pc = 0
    while pc < n_pc:
        dx, ix, in_x, lz, q0x = _x_lanes(pc, pp, lox, bx, tx, cntx, nx, h00, h02, BP, INDEX64)
        qc = 0
        while qc < n_qc:
            ozg, dz, in_xz, qxz, base_xz = _xz_lanes(
                qc, qq, loz, cntz, bz, tz, nz, ny, dx, ix, in_x, fo, h00, h02, h22, BQ, VEC, FRAMES
            )
            # x–z part of the group's r² bound (VEC, separable cells; not read otherwise)
            gmin = _group_r2min(ozg, tz, lz, q0x, h22, inv_h22) if VEC and SEPARABLE else qxz
            if SEPARABLE:
                # e_k = x_k(x, z)·y_k(row): sum g·y_k (and ·dy, ·qy) over the rows first, then fold in
                # the x_k and the coefficients once per tile (20 instead of ~40 flops per voxel).
                x0, x1, x2, x3, x4 = _exp2_each(be0, be1, be2, be3, be4, qxz)
                # Σ_rows g·y_k (t_k), g·y_k·dy (yd_k) and g·y_k·qy (v_k), per lane
                z = tl.zeros((ATOMS, BP, BQ), dtype=tl.float32)
                t0, t1, t2, t3, t4, yd0, yd1, yd2, yd3, yd4, v0, v1, v2, v3, v4 = (
                    z, z, z, z, z, z, z, z, z, z, z, z, z, z, z,
                )  # fmt: skip
                r, r_end, iy, r_lo, r_hi = _tile_row_walk(
                    pc, qc, cntx, cntz, qxz, qxz, in_xz, x_lo, z_lo, r2lim_a, h00, h11, h22, h02, off_y, top_y,
                    iy0, ny, n_rows, BP, BQ, SEPARABLE,
                )  # fmt: skip
                lim = r2max - qxz  # a voxel is inside when qy < lim
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
                tile_o = _sum_of_products(c0, c1, c2, c3, c4, x0, x1, x2, x3, x4, t0, t1, t2, t3, t4)
                hh = _sum_of_products(ca0, ca1, ca2, ca3, ca4, x0, x1, x2, x3, x4, t0, t1, t2, t3, t4)
                tile_y = _sum_of_products(ca0, ca1, ca2, ca3, ca4, x0, x1, x2, x3, x4, yd0, yd1, yd2, yd3, yd4)
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
                    e0, e1, e2, e3, e4 = _exp2_each(be0, be1, be2, be3, be4, r2)
                    inside = _row_lanes(
                        r, r_lo, r_hi, r2, r2max, r2lim, in_xz, gmin, qy, ozg, tz, lz, q0x, dx, dy, h01, h12, h22,
                        inv_h22, ATOMS, VEC, False,
                    )  # fmt: skip
                    g = _load_row(grad_ptr + (base_xz + iy * nz), inside, r2, r2max, VEC)
                    u0 = _dot5(c0, c1, c2, c3, c4, e0, e1, e2, e3, e4)
                    u1 = _dot5(ca0, ca1, ca2, ca3, ca4, e0, e1, e2, e3, e4)
                    u2 = r2 * _dot5(cab0, cab1, cab2, cab3, cab4, e0, e1, e2, e3, e4) - _dot5(
                        cb0, cb1, cb2, cb3, cb4, e0, e1, e2, e3, e4
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
    _store_iso_grads(
        gxyz_ptr, gb_ptr, gocc_ptr, p_ptr, ia, valid, occ, acc_o, acc_x, acc_y, acc_z, acc_b,
        h00, h11, h22, h01, h02, h12, SEPARABLE,
    )  # fmt: skip


@triton.jit(do_not_specialize=("n_atoms",))
def _splat_radii_kernel(
    xyz_ptr,  # (N, 3) float32 or float64, Å
    b_iso_ptr,  # (N,) float32, Å²
    occ_ptr,  # (N,) float32
    a_ptr,  # (N, 5) float32
    b_ptr,  # (N, 5) float32, Å²
    radius_ptr,  # (N,) float32, Å (written)
    p_ptr,  # (41,) float64, the plan's constants
    n_atoms,
    BLOCK: tl.constexpr,
):
    """Each atom's cutoff radius exactly as :func:`_splat_fwd_kernel` computes and stores it for the backward.

    The same inputs, masks (``ok``) and search per lane, so a backward launched on these radii gives the
    gradients of a forward+backward bit for bit, without the splat (the streamed ensemble's second pass).
    """
    ia = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = ia < n_atoms
    nx, ny, nz, _h00, _h11, _h22, _h01, _h02, _h12, _rx, _ry, _rz, _radius_all, cutoff = _plan_scalars(p_ptr)
    _tx, _ty, _tz, _bx, _by, _bz, b_iso, _occ, ok = _atom_inputs(
        xyz_ptr, b_iso_ptr, occ_ptr, p_ptr, ia, valid, nx, ny, nz
    )
    tl.store(radius_ptr + ia, _cutoff_radius(b_iso, a_ptr, b_ptr, ia, ok, cutoff, 80), mask=valid)
