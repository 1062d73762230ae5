"""The anisotropic Triton density kernels (U per atom; neutron sets), launched by :mod:`kernels.density.triton`.

Same launch shape, tiles, row spans, z groups and float64 wrap as the isotropic kernels, whose device
helpers they import (:mod:`kernels.density._triton_kernels`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.density._triton_kernels import (
    _add_row,
    _atom_box,
    _cell_coordinate,
    _fixed_exponent,
    _fixed_scale,
    _group_r2min,
    _load_row,
    _plan_scalars,
    _radial_coef,
    _radius_search,
    _row_lanes,
    _tile_row_walk,
    _walk_setup,
    _x_lanes,
    _xz_lanes,
)

# --------------------------------------------------------------------------- anisotropic kernels
#
# Every atom as a general Gaussian per form-factor term: ρ_k(Δv) = amp_k·exp2(q_k(Δv)) for the offset Δv of a
# voxel from the atom in voxel units, q_k = −½·log2(e)·Δvᵀ·Qv_k·Δv, Qv_k = Bᵀ·M_k⁻¹·B with B = orth·diag(1/n)
# (voxel steps → Å) and M_k = U + b_k/(8π²)·I (see kernels.adp). The per-atom work (U from
# u_aniso/aniso/b_iso as kernels.adp.effective_u forms it, M_k⁻¹ and det M_k in closed form, the
# six coefficients of each q_k, the cutoff radius) is done by each program for its own atoms, so a call is
# one memset and one launch each way, as for isotropic atoms: the same work as ~50 small torch ops, whose
# launches alone would cost several times the splat of a small model.

_U_PER_B = 0.012665147955292222  # 1/(8π²): U = B/(8π²)
_B_PER_U = 78.95683520871486  # 8π²
_GAUSS_NORM = 0.06349363593424097  # (2π)^{-3/2}


@triton.jit
def _effective_u(u_ptr, flag_ptr, b_iso_ptr, ia, valid):
    """Each atom's U (Å², six components U11, U22, U33, U12, U13, U23), whether it is anisotropic, and its B.

    As :func:`kernels.adp.effective_u`: the atom's ``u_aniso`` row where ``aniso`` is set, else
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
def _aniso_term_form(u11, u22, u33, u12, u13, u23, a_ptr, b_ptr, p_ptr, ia, valid, k: tl.constexpr):
    """Term k of :func:`_aniso_term` (unit amplitude, det, B_k) with its quadratic form's log2-unit
    coefficients (:func:`_log2_form`) in place of M_k⁻¹."""
    am, de, be, n11, n22, n33, n12, n13, n23 = _aniso_term(u11, u22, u33, u12, u13, u23, a_ptr, b_ptr, ia, valid, k)
    cxx, cyy, czz, cxy, cxz, cyz = _log2_form(n11, n22, n33, n12, n13, n23, p_ptr)
    return am, de, be, cxx, cyy, czz, cxy, cxz, cyz


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
    am0, de0, be0, cxx0, cyy0, czz0, cxy0, cxz0, cyz0 = _aniso_term_form(
        u11, u22, u33, u12, u13, u23, a_ptr, b_ptr, p_ptr, ia, ok, 0
    )
    am1, de1, be1, cxx1, cyy1, czz1, cxy1, cxz1, cyz1 = _aniso_term_form(
        u11, u22, u33, u12, u13, u23, a_ptr, b_ptr, p_ptr, ia, ok, 1
    )
    am2, de2, be2, cxx2, cyy2, czz2, cxy2, cxz2, cyz2 = _aniso_term_form(
        u11, u22, u33, u12, u13, u23, a_ptr, b_ptr, p_ptr, ia, ok, 2
    )
    am3, de3, be3, cxx3, cyy3, czz3, cxy3, cxz3, cyz3 = _aniso_term_form(
        u11, u22, u33, u12, u13, u23, a_ptr, b_ptr, p_ptr, ia, ok, 3
    )
    am4, de4, be4, cxx4, cyy4, czz4, cxy4, cxz4, cyz4 = _aniso_term_form(
        u11, u22, u33, u12, u13, u23, a_ptr, b_ptr, p_ptr, ia, ok, 4
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
    scale = _fixed_scale(fix_ptr, fix_shift) if FIXED else 0.0  # the fixed-point scale (FIXED)
    lox, loy, loz, cntx, cnty, cntz, r2max = _atom_box(tx, ty, tz, rad, ok, rx, ry, rz)
    # (ATOMS, 1, 1): per-atom amplitudes (occupancy folded in) and log2-unit coefficients of each term.
    am0 = (am0 * occ)[:, None, None]
    am1 = (am1 * occ)[:, None, None]
    am2 = (am2 * occ)[:, None, None]
    am3 = (am3 * occ)[:, None, None]
    am4 = (am4 * occ)[:, None, None]
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
            lin = qxz if SEPARABLE else 2.0 * (h01 * dx + h12 * dz)  # r² = qxz + dy·lin + qy (separable: lin not read)
            # x–z part of the group's r² bound (VEC, separable cells; not read otherwise)
            gmin = _group_r2min(ozg, tz, lz, q0x, h22, inv_h22) if VEC and SEPARABLE else qxz
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


@triton.jit
def _store_aniso_grads(
    gxyz_ptr, gu_ptr, gb_ptr, gocc_ptr, p_ptr, ia, valid, flag, gcx, gcy, gcz, go, x11, x22, x33, x12, x13, x23
):
    """The anisotropic backward's gradients from its float64 sums (:func:`_fold_grads`): ∂L/∂xyz, ∂L/∂occ,
    ∂L/∂U of anisotropic atoms and ∂L/∂b_iso of isotropic ones (zero elsewhere)."""
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
    # The forms after the box (not in _aniso_term_form): this order is the one whose sm_90 code was timed.
    cxx0, cyy0, czz0, cxy0, cxz0, cyz0 = _log2_form(n11_0, n22_0, n33_0, n12_0, n13_0, n23_0, p_ptr)
    cxx1, cyy1, czz1, cxy1, cxz1, cyz1 = _log2_form(n11_1, n22_1, n33_1, n12_1, n13_1, n23_1, p_ptr)
    cxx2, cyy2, czz2, cxy2, cxz2, cyz2 = _log2_form(n11_2, n22_2, n33_2, n12_2, n13_2, n23_2, p_ptr)
    cxx3, cyy3, czz3, cxy3, cxz3, cyz3 = _log2_form(n11_3, n22_3, n33_3, n12_3, n13_3, n23_3, p_ptr)
    cxx4, cyy4, czz4, cxy4, cxz4, cyz4 = _log2_form(n11_4, n22_4, n33_4, n12_4, n13_4, n23_4, p_ptr)
    (
        nz, loz, cntz, inv_h22, fo, r2lim_a, r2lim, r2max, n_pc, n_qc, n_rows, x_lo, z_lo, off_y, top_y, tx, tz,
        off_y3, iy0, pp, qq,
    ) = _walk_setup(
        ia, tx, ty, tz, by, bz, lox, loy, loz, cntx, cnty, cntz, r2max, h22, nx, ny, nz, atoms_per_frame,
        BP, BQ, VEC, FRAMES, INDEX64,
    )  # fmt: skip
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
        dx, ix, in_x, lz, q0x = _x_lanes(pc, pp, lox, bx, tx, cntx, nx, h00, h02, BP, INDEX64)
        qc = 0
        while qc < n_qc:
            ozg, dz, in_xz, qxz, base_xz = _xz_lanes(
                qc, qq, loz, cntz, bz, tz, nz, ny, dx, ix, in_x, fo, h00, h02, h22, BQ, VEC, FRAMES
            )
            lin = qxz if SEPARABLE else 2.0 * (h01 * dx + h12 * dz)  # r² = qxz + dy·lin + qy (separable: lin not read)
            # x–z part of the group's r² bound (VEC, separable cells; not read otherwise)
            gmin = _group_r2min(ozg, tz, lz, q0x, h22, inv_h22) if VEC and SEPARABLE else qxz
            ca0, cb0 = _column(cxx0, czz0, cxy0, cxz0, cyz0, dx, dz)
            ca1, cb1 = _column(cxx1, czz1, cxy1, cxz1, cyz1, dx, dz)
            ca2, cb2 = _column(cxx2, czz2, cxy2, cxz2, cyz2, dx, dz)
            ca3, cb3 = _column(cxx3, czz3, cxy3, cxz3, cyz3, dx, dz)
            ca4, cb4 = _column(cxx4, czz4, cxy4, cxz4, cyz4, dx, dz)
            tile = tl.zeros((ATOMS, BP, BQ), dtype=tl.float64)
            t0, ty0, tyy0, t1, ty1, tyy1, t2, ty2, tyy2, t3, ty3, tyy3, t4, ty4, tyy4 = (
                tile, tile, tile, tile, tile, tile, tile, tile, tile, tile, tile, tile, tile, tile, tile,
            )  # fmt: skip
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
                inside = _row_lanes(
                    r, r_lo, r_hi, r2, r2max, r2lim, in_xz, gmin, qy, ozg, tz, lz, q0x, dx, dy, h01, h12, h22, inv_h22,
                    ATOMS, VEC, SEPARABLE,
                )  # fmt: skip
                g = _load_row(grad_ptr + (base_xz + iy * nz), inside, r2, r2max, VEC)
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
    _store_aniso_grads(
        gxyz_ptr, gu_ptr, gb_ptr, gocc_ptr, p_ptr, ia, valid, flag, gcx, gcy, gcz, go, x11, x22, x33, x12, x13, x23
    )
