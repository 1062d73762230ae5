// The isotropic atom's rows: lane-blocked rows (the fast path of every cell that factors) and
// process_atom, which walks an atom's rows forward (adds its density) or backward (gathers its
// gradient sums). The kernel's overview is in scatter.hpp.
#pragma once

#include "gaussians.hpp"

namespace {

// ------------------------------------------------------------------ lane-blocked rows

// Rows again, the fast way (orthogonal, hexagonal and monoclinic cells, i.e. every cell
// that factors, when the atom's z-range does not wrap around the cell). The voxels of an
// atom's row are addressed as fixed lanes l = 0..nl-1 of the map row, starting at z0 (the
// same z0 for every row of the atom), in blocks of 8. Then
//   - the z-dependent factor of each Gaussian, L_k (1-D z table on orthogonal/hexagonal
//     cells, one plane of the 2-D (x,z) table on monoclinic ones), is one vector per
//     block shared by every row of the plane, and the y-dependent factor R_k is one scalar
//     per row: a voxel costs 5 vector FMAs, nothing else (no per-row table gathers, no
//     exact-length loops);
//   - the backward never reduces a row: per plane it contracts the upstream gradient over
//     the rows into 15 lane vectors Z = Σ_rows {R_k, R_k·dy, R_k·Q_row}·g (15 FMAs per voxel,
//     the only per-voxel work), then per plane folds them with L_k, dx, dz and the lane part
//     of r² into 6 per-atom lane accumulators; the horizontal sums happen once per atom.
//     This works because r² = Q_row(x,y) + q_lane(x,z) exactly on these cells (the one
//     cross term couples the row pair or the lane pair, never a row and a lane axis).
// Blocks that run past the top of the cell (boxes that wrap along z) go lane by lane.
// Lanes outside a row's voxel set are masked to +0 (forward: the map voxel gets +0.0f,
// which changes nothing; backward: the gradient lane is zeroed before any product).
#if defined(__GNUC__)
#define KERNELS_LANES 1
// The helpers below are always inlined, never called across translation units: the vector-ABI note
// (-Wpsabi) about passing 32-byte vectors without AVX does not apply.
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
typedef float vf8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));
typedef float vf16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));
typedef double vd8 __attribute__((vector_size(64)));
constexpr int64_t kL = 8;  // lanes per block (and the lane tables' granularity)
// Vectors of W lanes: the backward's blocks are W = 16 lanes wide on CPUs that run the
// x86-64-v4 (AVX-512) clone, 8 (one AVX2 vector) elsewhere.
// GCC (12 and later) builds a splat {x, x, ...} of a value in a register lane by lane inside the clones
// (vmovss + 4 vinsertps + vinsertf128 for 8 floats, vmovd + 3 vpinsrd + vinserti128 for 8
// ints, 16 masked broadcasts for 16 lanes); lane 0 spread by __builtin_shufflevector (GCC 12+,
// clang) is one broadcast, or one broadcast load when the value comes from memory. The shuffle
// is written out where it is used: behind a helper template GCC expands it lane by lane again.
#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define KERNELS_SHUFFLEVECTOR 1
#endif
#endif
template <int W> struct Lanes;
template <> struct Lanes<8> {
    typedef vf8 F;
    typedef vi8 I;
    KERNELS_INLINE static F splat(float x) { return F{x, x, x, x, x, x, x, x}; }
    KERNELS_INLINE static I splat(int32_t x) { return I{x, x, x, x, x, x, x, x}; }
    KERNELS_INLINE static I iota() { return I{0, 1, 2, 3, 4, 5, 6, 7}; }
};
template <> struct Lanes<16> {
    typedef vf16 F;
    typedef vi16 I;
#if defined(KERNELS_SHUFFLEVECTOR)
    KERNELS_INLINE static F splat(float x) {
        const F v = {x};
        return __builtin_shufflevector(v, v, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    }
    KERNELS_INLINE static I splat(int32_t x) {
        const I v = {x};
        return __builtin_shufflevector(v, v, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    }
#else  // (16-lane blocks are not used then: see gather_atoms)
    KERNELS_INLINE static F splat(float x) { return F{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
    KERNELS_INLINE static I splat(int32_t x) { return I{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
#endif
    KERNELS_INLINE static I iota() { return I{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}; }
};

template <class V = vf8, class T = float>
KERNELS_INLINE V vload(const T* p) {
    V v;
    std::memcpy(&v, p, sizeof v);
    return v;
}
template <class V>
KERNELS_INLINE void vstore(float* p, V v) { std::memcpy(p, &v, sizeof v); }
// *p in every lane of 8 (float or int32), as one broadcast load (see KERNELS_SHUFFLEVECTOR)
template <class V = vf8, class T>
KERNELS_INLINE V vsplat_at(const T* p) {
    V v = {};
    std::memcpy(&v, p, sizeof(T));
#if defined(KERNELS_SHUFFLEVECTOR)
    return __builtin_shufflevector(v, v, 0, 0, 0, 0, 0, 0, 0, 0);
#else
    return __builtin_shuffle(v, vi8{});
#endif
}
// n lanes rounded up to whole blocks
KERNELS_INLINE int64_t whole_blocks(int64_t n) { return (n + kL - 1) / kL * kL; }
// lanes [la, lb] of block bb kept, the rest +0
KERNELS_INLINE vf8 vmask(vf8 v, int64_t bb, int32_t la, int32_t lb) {
    // splats written out: scalar operands of vector operators are a GCC extension clang lacks in C++
    // lane index within the block (a constant) against the row's ends moved into the block:
    // no per-call vector of lane indices to build
    const int32_t a = la - static_cast<int32_t>(bb * kL), b = lb - static_cast<int32_t>(bb * kL);
    const vi8 idx = vi8{0, 1, 2, 3, 4, 5, 6, 7};
    const vi8 m = (idx >= Lanes<8>::splat(a)) & (idx <= Lanes<8>::splat(b));
    return reinterpret_cast<vf8>(reinterpret_cast<vi8>(v) & m);
}
// Σ_k c_k · L_k over the block at lane l of the lane tables (L_k at L + k·stride)
KERNELS_INLINE vf8 lane_sum(const vf8* c, const float* L, int64_t stride, int64_t l) {
    return c[0] * vload(L + l) + c[1] * vload(L + stride + l) + c[2] * vload(L + 2 * stride + l) +
           c[3] * vload(L + 3 * stride + l) + c[4] * vload(L + 4 * stride + l);
}
KERNELS_INLINE double vsum(vf8 v) {
    double s = 0;
    for (int l = 0; l < 8; ++l) s += static_cast<double>(v[l]);
    return s;
}
#endif

// Box-relative z range [lo[s], hi[s]] of every row s of the plane at dx (lo > hi: empty):
// exactly the reference's voxel set (see row_range). One vectorised pass over the rows
// gives every interval; only the rare rows flagged there (grazing, or an end within 1e-6
// voxel of a lattice point) are settled with the exact test afterwards, so the scalar
// loop is a scan with an almost never taken branch.
KERNELS_INLINE
void plane_intervals(const Geom& g, const AtomP& A, double dx, int64_t nyb, const double* dyd,
                                    Scratch& S, int32_t* lo, int32_t* hi) {
    int64_t* fix = S.rst.data();
    double* rq = S.rq.data();
    double* rl = S.rl.data();
    const double fz = A.f[2];
    const int64_t zlo = A.lo[2], zhi = A.hi[2];
    {
        const double G00 = g.G00, G11 = g.G11, G22 = g.G22, G01x2 = g.G01x2, G02x2 = g.G02x2, G12x2 = g.G12x2;
        const double inv2 = g.inv2G22, mz = g.m[2], R2 = A.R2;
        const double zlo_d = static_cast<double>(zlo), zhi_d = static_cast<double>(zhi);
        KERNELS_SIMD
        for (int64_t s = 0; s < nyb; ++s) {
            const double dy = dyd[s];
            const double Q = G00 * dx * dx + G11 * dy * dy + G01x2 * dx * dy;
            const double Lz = G02x2 * dx + G12x2 * dy;
            const double disc = Lz * Lz - 4.0 * G22 * (Q - R2);
            const double scale = Lz * Lz + 4.0 * G22 * (std::fabs(Q) + R2);
            const double wc = (fz - Lz * inv2) * mz;
            const double half = std::sqrt(disc) * inv2 * mz;  // NaN when disc < 0: row is then empty
            const double wlo = wc - half, whi = wc + half;
            const double cs = std::ceil(wlo - 1e-6), ce = std::floor(whi + 1e-6);
            const bool hit = disc > -1e-6 * scale;
            const bool care = (disc < 1e-6 * scale) | (cs - wlo < 1e-6) | (whi - ce < 1e-6);
            const double a = cs > zlo_d ? cs : zlo_d, b = ce < zhi_d ? ce : zhi_d;
            const bool ok = hit & !care & (a <= b);
            lo[s] = static_cast<int32_t>((ok ? a : zlo_d + 1.0) - zlo_d);
            hi[s] = static_cast<int32_t>((ok ? b : zlo_d) - zlo_d);
            fix[s] = hit & care;
            rq[s] = Q;
            rl[s] = Lz;
        }
    }
    for (int64_t s = 0; s < nyb; ++s) {
        if (!fix[s]) continue;
        int64_t wa, wb;
        if (row_range(g, A, dx, dyd[s], rq[s], rl[s], wa, wb)) {
            lo[s] = static_cast<int32_t>(wa - zlo);
            hi[s] = static_cast<int32_t>(wb - zlo);
        }
    }
}

// The same intervals from a float pass: 8 rows per AVX2 vector instead of 4, box-relative
// z so the magnitudes stay ~the box size. Every row whose float result cannot be trusted
// is settled in double with row_range (the pass above's own test, then the exact r² test),
// so the voxel set is still exactly the reference's. Error bound (u = 2^-24, one float
// rounding; every per-atom bound below carries a factor ≥ 2 of slack over a first-order
// count of the roundings, FMA contraction or not):
//   - |dx| ≤ dxm, |dy| ≤ dym over the box, so the terms of Q = G00·dx² + G11·dy² + G01x2·dx·dy
//     sum in absolute value to ≤ Smax and those of Lz = G02x2·dx + G12x2·dy to ≤ Lmax; the
//     float disc = Lz² + 4G22·(R² − Q) is within Ed = 32u·(Lmax² + 4G22·(R² + Smax)) of the
//     real one (a count gives ≤ 16u·(...)).
//   - half = k·√disc (k = mz/(2·G22), voxels): |√d' − √d| ≤ |d' − d|/√d' for the computed
//     d' > 0, so half is within k²·Ed/half' + 3u·half' of the real one; Mb = 2·k²·Ed.
//   - the centre wc = c0 − Lz·k (c0 = fz·mz − zlo ∈ [reach, reach+1]) and the ends wc ± half,
//     the shifts by M and the test cs − wlo < M each add a few u of |c0| + k·Lmax + nzb:
//     Ma = 32u·(|c0| + k·Lmax + nzb + 2).
// A row end is trusted only when it lies M = Ma + Mb/half' or more from every lattice point
// (the end and the lattice point next to it then agree with the real root); a row with
// |disc'| ≤ Ed (grazing, or a miss that might be a hit) is settled too. Typical M on
// 0.667 Å grids: 1e-4..1e-3 voxel, so ~0.1 % of the rows go to the double settle.
struct RowConstF {
    float c0, k, zspan, G11, G12x2, c4, R2, Ed, Ma, Mb;
};

KERNELS_INLINE RowConstF row_const_f(const Geom& g, const AtomP& A) {
    constexpr double u = 1.0 / 16777216.0;  // 2^-24
    auto ext = [&](int d) {
        return std::max(std::fabs(static_cast<double>(A.lo[d]) / g.m[d] - A.f[d]),
                        std::fabs(static_cast<double>(A.hi[d]) / g.m[d] - A.f[d]));
    };
    const double dxm = ext(0), dym = ext(1);
    const double Smax = g.G00 * dxm * dxm + g.G11 * dym * dym + std::fabs(g.G01x2) * dxm * dym;
    const double Lmax = std::fabs(g.G02x2) * dxm + std::fabs(g.G12x2) * dym;
    const double k = g.inv2G22 * g.m[2];
    const double c0 = A.f[2] * g.m[2] - static_cast<double>(A.lo[2]);
    const double Ed = 32.0 * u * (Lmax * Lmax + 4.0 * g.G22 * (A.R2 + Smax));
    RowConstF C;
    C.c0 = static_cast<float>(c0);
    C.k = static_cast<float>(k);
    C.zspan = static_cast<float>(A.hi[2] - A.lo[2]);
    C.G11 = static_cast<float>(g.G11);
    C.G12x2 = static_cast<float>(g.G12x2);
    C.c4 = static_cast<float>(4.0 * g.G22);
    C.R2 = static_cast<float>(A.R2);
    C.Ed = static_cast<float>(Ed);
    C.Ma = static_cast<float>(32.0 * u * (std::fabs(c0) + k * Lmax + static_cast<double>(A.hi[2] - A.lo[2] + 1) + 2.0));
    C.Mb = static_cast<float>(2.0 * k * k * Ed);
    return C;
}

// Rows of the plane at dx from the float pass; dyf: dy per row, padded to a multiple of 8.
KERNELS_INLINE
void plane_intervals_f(const Geom& g, const AtomP& A, const RowConstF& C, double dx, int64_t nyb,
                                      const float* dyf, const double* dyd, Scratch& S, int32_t* lo, int32_t* hi) {
    int32_t* fix = S.fix32.data();
    const float A0 = static_cast<float>(g.G00 * dx * dx), B1 = static_cast<float>(g.G01x2 * dx),
                Lx = static_cast<float>(g.G02x2 * dx);
    const float c0 = C.c0, k = C.k, zspan = C.zspan, G11 = C.G11, G12x2 = C.G12x2, c4 = C.c4, R2 = C.R2, Ed = C.Ed,
                Ma = C.Ma, Mb = C.Mb;
    const int64_t nbk = (nyb + 7) / 8;
    for (int64_t bk = 0; bk < nbk; ++bk) {
        const float* dyb = dyf + 8 * bk;
        int32_t* lob = lo + 8 * bk;
        int32_t* hib = hi + 8 * bk;
        int32_t* fixb = fix + 8 * bk;
        KERNELS_SIMD
        for (int l = 0; l < 8; ++l) {
            const float dy = dyb[l];
            const float Q = A0 + dy * (G11 * dy + B1);
            const float Lz = Lx + G12x2 * dy;
            const float disc = Lz * Lz + c4 * (R2 - Q);
            // ternaries and the C float functions, not std::max / std::sqrt(float): those are
            // ordinary functions in libstdc++ that GCC cannot inline into the AVX2 clone
            const float half = sqrtf(disc > 0.0f ? disc : 0.0f) * k;
            const float M = Ma + Mb / (half > 1e-20f ? half : 1e-20f);
            const float wc = c0 - Lz * k;
            const float wlo = wc - half, whi = wc + half;
            const float cs = ceilf(wlo - M), ce = floorf(whi + M);
            const bool hit = disc > -Ed;
            const bool care = (disc <= Ed) | (cs - wlo < M) | (whi - ce < M);
            const float a = cs > 0.0f ? cs : 0.0f, b = ce < zspan ? ce : zspan;
            const bool ok = hit & !care & (a <= b);
            lob[l] = static_cast<int32_t>(ok ? a : 1.0f);
            hib[l] = static_cast<int32_t>(ok ? b : 0.0f);
            fixb[l] = hit & care;
        }
    }
    const int64_t zlo = A.lo[2];
    for (int64_t bk = 0; bk < nbk; ++bk) {
        const int32_t* fixb = fix + 8 * bk;
        int32_t any = 0;
        for (int l = 0; l < 8; ++l) any |= fixb[l];
        if (!any) continue;
        for (int64_t s = 8 * bk; s < std::min(nyb, 8 * bk + 8); ++s) {
            if (!fix[s]) continue;
            const double dy = dyd[s];
            const double Q = g.G00 * dx * dx + g.G11 * dy * dy + g.G01x2 * dx * dy;
            const double Lz = g.G02x2 * dx + g.G12x2 * dy;
            int64_t wa, wb;
            if (row_range(g, A, dx, dy, Q, Lz, wa, wb)) {
                lo[s] = static_cast<int32_t>(wa - zlo);
                hi[s] = static_cast<int32_t>(wb - zlo);
            }
        }
    }
}

#if defined(KERNELS_LANES)
// Lane-blocked forward or backward of atom A over planes [ia, ib]; builds its own tables
// (in lane layout) in the scratch S. z0: map z of lane 0,
// off: lane of box z index 0, nl: lanes (multiple of 8, <= nz); lane l is map z (z0 + l) mod nz.
// rows: this atom's saved row intervals (see RowIntervals) or nullptr — the forward writes
// them there, the backward reads them instead of solving for them again.
template <bool Forward, int W>
KERNELS_INLINE void atom_lanes(const Geom& g, const AtomP& A, int64_t ia, int64_t ib, float* out, const float* grad,
                               Scratch& S, const float* ampf, int64_t z0, int64_t off, int64_t nl, int16_t* rows_saved,
                               double* sums) {
    const int64_t nx = g.n[0], ny = g.n[1], nz = g.n[2];
    const int64_t nyb = A.hi[1] - A.lo[1] + 1, nib = ib - ia + 1;
    const bool zsep = g.kind == kZSep;
    const double* dyd = S.dyd.data();
    const int64_t* jw = S.jw.data();
    float* ta = S.tab_a.data();
    float* tb = S.tab_b.data();
    double* q = S.q.data();
    float* lq = S.lane_q.data();
    float* ldz = S.lane_dz.data();
    double* dzl = S.lane_dzd.data();
    int32_t* lo = S.rlo32.data();
    int32_t* hi = S.rhi32.data();
    const int64_t nblk = nl / kL;
    typedef typename Lanes<W>::F VF;
    typedef typename Lanes<W>::I VI;
    // forward: blocks [0, btop) lie below the top of the cell, the rest wrap to z = 0, 1, ...;
    // a block crosses the top only when the wrapped lanes are not aligned to whole blocks
    const bool straddle = z0 + nl > nz && (nz % kL != 0 || z0 % kL != 0);
    // forward: box lane → lane offsets for the per-row bounds, and the lane numbers 0, 1, 2, ...
    const vi8 off_lo = Lanes<8>::splat(static_cast<int32_t>(off) - 1);
    const vi8 off_hi = Lanes<8>::splat(static_cast<int32_t>(off) + 1);
    const int32_t* lane_index = S.lane_index.data();
    const int64_t btop = z0 + nl <= nz ? nblk : (nz - z0) / kL;
    // float interval pass (when this call solves for the intervals): per-atom constants, dy in float
    const bool solve = Forward || !rows_saved;
    const bool fpass = solve && g.float_rows;
    RowConstF rcf{};
    float* dyf = S.dyf.data();
    if (fpass) {
        rcf = row_const_f(g, A);
        const int64_t nyp = (nyb + 7) / 8 * 8;
        for (int64_t s = 0; s < nyb; ++s) dyf[s] = static_cast<float>(dyd[s]);
        for (int64_t s = nyb; s < nyp; ++s) dyf[s] = dyf[nyb - 1];
    }
    // Tables straight in lane layout. Lanes outside the box get the values of their own
    // (outside) z: finite, never inside a row's interval, so they are masked everywhere.
    const int64_t zfirst = A.lo[2] - off;  // unwrapped lattice z of lane 0
    const double zfd = static_cast<double>(zfirst);  // as for dyd in process_atom: an int32 loop vectorises
    for (int32_t l = 0; l < static_cast<int32_t>(nl); ++l) dzl[l] = (zfd + static_cast<double>(l)) / g.m[2] - A.f[2];
    if (!Forward)
        for (int64_t l = 0; l < nl; ++l) ldz[l] = static_cast<float>(dzl[l]);
    const float* L;      // L_k of plane i: L + k*lstride + (i-ia)*lplane
    int64_t lstride, lplane;
    if (zsep) {
        // z factor L_k[l] (the same for every plane), row factor R_k over (x,y)
        float* Lz = S.lane_tab.data();
        for (int64_t l = 0; l < nl; ++l) q[l] = g.G22 * dzl[l] * dzl[l];
        if (!Forward)
            for (int64_t l = 0; l < nl; ++l) lq[l] = static_cast<float>(q[l]);
        exp_table(A, q, nl, Lz);
        for (int64_t i = ia; i <= ib; ++i) {
            const double dx = static_cast<double>(i) / g.m[0] - A.f[0];
            double* qi = q + (i - ia) * nyb;
            for (int64_t s = 0; s < nyb; ++s)
                qi[s] = g.G00 * dx * dx + g.G11 * dyd[s] * dyd[s] + g.G01x2 * dx * dyd[s];
        }
        exp_table(A, q, nib * nyb, tb, Forward ? ampf : nullptr);  // tb[k*nib*nyb + (i-ia)*nyb + s]
        L = Lz;
        lstride = nl;
        lplane = 0;
    } else {
        // row factor R_k over y, lane factor L_k over (x,z)
        for (int64_t s = 0; s < nyb; ++s) q[s] = g.G11 * dyd[s] * dyd[s];
        exp_table(A, q, nyb, ta, Forward ? ampf : nullptr);  // ta[k*nyb + s]
        for (int64_t i = ia; i <= ib; ++i) {
            const double dx = static_cast<double>(i) / g.m[0] - A.f[0];
            double* qi = q + (i - ia) * nl;
            for (int64_t l = 0; l < nl; ++l)
                qi[l] = g.G00 * dx * dx + g.G22 * dzl[l] * dzl[l] + g.G02x2 * dx * dzl[l];
        }
        if (!Forward)
            for (int64_t t = 0; t < nib * nl; ++t) lq[t] = static_cast<float>(q[t]);
        exp_table(A, q, nib * nl, tb);  // tb[k*nib*nl + (i-ia)*nl + l]
        L = tb;
        lstride = nib * nl;
        lplane = nl;
    }
    float w[4][NG];
    float* aacc = S.aacc.data();  // 6 accumulators × nl: occ, b1, dx, dy, dz, b3
    if (!Forward) {
        for (int m = 0; m < 4; ++m)
            for (int k = 0; k < NG; ++k) w[m][k] = static_cast<float>(A.gw[m][k]);
        std::fill(aacc, aacc + 6 * nl, 0.0f);
    }
    for (int64_t i = ia; i <= ib; ++i) {
        const double dx = static_cast<double>(i) / g.m[0] - A.f[0];
        const int64_t iw = floor_mod(i, nx);
        int16_t* sv = rows_saved ? rows_saved + 2 * (i - A.lo[0]) * nyb : nullptr;
        if (fpass)
            plane_intervals_f(g, A, rcf, dx, nyb, dyf, dyd, S, lo, hi);
        else if (solve)
            plane_intervals(g, A, dx, nyb, dyd, S, lo, hi);
        if (sv) {
            if (Forward) {
                for (int64_t s = 0; s < nyb; ++s) {
                    sv[2 * s] = static_cast<int16_t>(lo[s]);
                    sv[2 * s + 1] = static_cast<int16_t>(hi[s]);
                }
            } else {
                for (int64_t s = 0; s < nyb; ++s) {
                    lo[s] = sv[2 * s];
                    hi[s] = sv[2 * s + 1];
                }
            }
        }
        const float* Lp = L + (i - ia) * lplane;  // this plane's L_k: Lp[k*lstride + l]
        const float* lqp = lq + (zsep ? 0 : (i - ia) * nl);
        // row factor R_k of row s: Rp[k * rstride + s] (in the forward, with amp·occ in it: see exp_table)
        const float* Rp = zsep ? tb + (i - ia) * nyb : ta;
        const int64_t rstride = zsep ? nib * nyb : nyb;
        if (Forward) {
            // The row factors already carry amp·occ: a row's 5 coefficients are broadcasts.
            // Blocks below the top of the cell are one run of the map row from lane z0; blocks
            // at or past it (boxes that wrap along z, aligned so that no block crosses the top)
            // are the same run moved down by nz.
            float* op = out + iw * ny * nz;
            for (int64_t s = 0; s < nyb; ++s) {
                if (lo[s] > hi[s]) continue;
                vf8 c[NG];
                for (int k = 0; k < NG; ++k) c[k] = vsplat_at(Rp + k * rstride + s);
                const int32_t la = static_cast<int32_t>(lo[s] + off), lb = static_cast<int32_t>(hi[s] + off);
                float* o = op + jw[s] * nz;
                const int64_t b0 = static_cast<uint32_t>(la) / kL, b1 = static_cast<uint32_t>(lb) / kL;
                if (straddle) {  // the block that crosses the top of the cell goes lane by lane
                    for (int64_t bb = b0; bb <= b1; ++bb) {
                        const vf8 add = vmask(lane_sum(c, Lp, lstride, bb * kL), bb, la, lb);
                        const int64_t zb = z0 + bb * kL < nz ? z0 + bb * kL : z0 + bb * kL - nz;
                        if (zb + kL <= nz)
                            vstore(o + zb, vload(o + zb) + add);
                        else
                            for (int l = 0; l < kL; ++l) o[zb + l < nz ? zb + l : zb + l - nz] += add[l];
                    }
                    continue;
                }
                // la − 1 and lb + 1 in every lane (broadcast loads, see vsplat_at)
                const vi8 lo1 = vsplat_at<vi8>(lo + s) + off_lo, hi1 = vsplat_at<vi8>(hi + s) + off_hi;
                // blocks [bf, bl] of the row, the first one at map z zf
                // The map and table pointers are stepped as their own registers so the compiler keeps
                // simple addressing: folded into one index register, the map's load-add-store and the
                // five table loads would all take base + index addresses. The empty asm hides each
                // pointer's relation to the others.
                auto run = [&](int64_t bf, int64_t bl, int64_t zf) {
                    vi8 lane = vload<vi8>(lane_index + bf * kL);  // lanes bf·kL, bf·kL + 1, ...
                    float* ob = o + zf;
                    const float* lt = Lp + bf * kL;  // this block's lanes of the L_k tables
                    for (int64_t bb = bf; bb <= bl; ++bb, ob += kL, lt += kL) {
                        KERNELS_OPAQUE(lt);
                        const vf8 v = lane_sum(c, lt, lstride, 0);
                        const vi8 m = (lane > lo1) & (hi1 > lane);  // lanes [la, lb]; the rest +0
                        vstore(ob, vload(ob) + reinterpret_cast<vf8>(reinterpret_cast<vi8>(v) & m));
                        lane += vi8{kL, kL, kL, kL, kL, kL, kL, kL};
                        KERNELS_OPAQUE(ob);
                    }
                };
                if (b0 < btop) run(b0, std::min(b1, btop - 1), z0 + b0 * kL);
                if (b1 >= btop) run(std::max(b0, btop), b1, z0 + std::max(b0, btop) * kL - nz);
            }
        } else {
            // rows that have voxels, with their 15 coefficients R_k, R_k·dy, R_k·Q_row
            float* rc = S.rowc.data();
            int32_t* rows = S.rows.data();
            int64_t nr = 0;
            for (int64_t s = 0; s < nyb; ++s) {
                if (lo[s] > hi[s]) continue;
                const double dy = dyd[s];
                const double Qr = zsep ? q[(i - ia) * nyb + s] : g.G11 * dy * dy;
                float* r = rc + 3 * NG * nr;
                for (int k = 0; k < NG; ++k) {
                    const float e = Rp[k * rstride + s];
                    r[k] = e;
                    r[NG + k] = static_cast<float>(e * dy);
                    r[2 * NG + k] = static_cast<float>(e * Qr);
                }
                rows[nr++] = static_cast<int32_t>(s);
            }
            if (nr == 0) continue;
            const float dxf = static_cast<float>(dx);
            // blocks of W lanes (nl is a multiple of W here, see process_atom)
            for (int64_t bb = 0; bb < nl / W; ++bb) {
                const int64_t l0 = bb * W;  // first lane of the block
                VF z[3 * NG];
                for (int qn = 0; qn < 3 * NG; ++qn) z[qn] = Lanes<W>::splat(0.0f);
                const int64_t zb = z0 + l0 < nz ? z0 + l0 : z0 + l0 - nz;  // blocks past the top wrap
                for (int64_t r = 0; r < nr; ++r) {
                    const int64_t s = rows[r];
                    const float* gp = grad + (iw * ny + jw[s]) * nz;
                    VF graw;
                    if (zb + W <= nz) {
                        graw = vload<VF>(gp + zb);
                    } else {  // lanes past the top of the cell wrap to z = 0, 1, ...
                        for (int l = 0; l < W; ++l) graw[l] = gp[zb + l < nz ? zb + l : zb + l - nz];
                    }
                    const int32_t la = static_cast<int32_t>(lo[s] + off), lb = static_cast<int32_t>(hi[s] + off);
                    VF gv;
                    if constexpr (W == 8) {
                        gv = vmask(graw, bb, la, lb);
                    } else {
                        // lanes [la, lb] kept: outside, (lane − la) or (lb − lane) is negative, and the
                        // arithmetic shift spreads the sign of their OR (integer operations only: GCC
                        // turns 16-lane vector compares into per-lane selects)
                        const VI lane = Lanes<W>::iota() + Lanes<W>::splat(static_cast<int32_t>(l0));
                        const VI out = ((lane - Lanes<W>::splat(la)) | (Lanes<W>::splat(lb) - lane)) >> 31;
                        gv = reinterpret_cast<VF>(reinterpret_cast<VI>(graw) & ~out);
                    }
                    const float* cr = rc + 3 * NG * r;
#pragma GCC unroll 15
                    for (int qn = 0; qn < 3 * NG; ++qn) z[qn] += Lanes<W>::splat(cr[qn]) * gv;
                }
                VF ao = Lanes<W>::splat(0.0f), ab1 = ao, u2 = ao, ady = ao, ab3 = ao;
                const VF lqv = vload<VF>(lqp + l0);
                for (int k = 0; k < NG; ++k) {
                    const VF Lk = vload<VF>(Lp + k * lstride + l0);
                    const VF V = Lk * z[k];
                    ao += Lanes<W>::splat(w[0][k]) * V;
                    ab1 += Lanes<W>::splat(w[1][k]) * V;
                    u2 += Lanes<W>::splat(w[2][k]) * V;
                    ady += Lanes<W>::splat(w[2][k]) * (Lk * z[NG + k]);
                    ab3 += Lanes<W>::splat(w[3][k]) * (Lk * z[2 * NG + k] + lqv * V);
                }
                float* a = aacc + l0;
                vstore(a, vload<VF>(a) + ao);
                vstore(a + nl, vload<VF>(a + nl) + ab1);
                vstore(a + 2 * nl, vload<VF>(a + 2 * nl) + Lanes<W>::splat(dxf) * u2);
                vstore(a + 3 * nl, vload<VF>(a + 3 * nl) + ady);
                vstore(a + 4 * nl, vload<VF>(a + 4 * nl) + vload<VF>(ldz + l0) * u2);
                vstore(a + 5 * nl, vload<VF>(a + 5 * nl) + ab3);
            }
        }
    }
    if (!Forward)
        for (int m = 0; m < 6; ++m) {
            double s = 0;
            for (int64_t bb = 0; bb < nblk; ++bb) s += vsum(vload(aacc + m * nl + bb * kL));
            sums[m] = s;
        }
}
#endif

// Whether atom A takes the lane-blocked path: the cell factors and its box is not longer
// than the cell along z. A function of the atom alone, so every slab, thread count and
// the backward decide alike.
KERNELS_INLINE bool lane_path(const Geom& g, const AtomP& A) {
#if defined(KERNELS_LANES)
    const int64_t nzb = A.hi[2] - A.lo[2] + 1;
    return g.kind != kTriclinic && whole_blocks(nzb) <= g.n[2];
#else
    (void)g;
    (void)A;
    return false;
#endif
}

// Row intervals of the forward, kept for the backward (RowIntervals, scatter.hpp) when the
// caller will differentiate: about 10 MB for 3WIP at 0.667 Å. The backward then skips the
// double precision roots, which are a quarter of its time.
bool saveable(const Geom& g, const AtomP& A) {
    return A.R2 > 0 && lane_path(g, A) && A.hi[2] - A.lo[2] + 1 <= 32767;
}

void plan_saved_rows(const Geom& g, const std::vector<AtomP>& atoms, RowIntervals& sr) {
    sr.n_atoms = static_cast<int64_t>(atoms.size());
    sr.off.assign(atoms.size(), -1);
    int64_t total = 0;
    for (size_t i = 0; i < atoms.size(); ++i) {
        const AtomP& A = atoms[i];
        if (!saveable(g, A)) continue;
        sr.off[i] = total;
        total += 2 * (A.hi[0] - A.lo[0] + 1) * (A.hi[1] - A.lo[1] + 1);
    }
    sr.n_values = total;
    sr.lohi.reset(new int16_t[std::max<int64_t>(total, 1)]);
}

// Per-atom gradient sums over its voxels of g·e_k·(1, dx, dy, dz, r²), e_k = exp(−α_k r²).
// Per-atom gradient sums (double): Σg·u0 (→ occ), Σg·u1 and Σg·u3·r² (→ B), Σg·u2·d (→ xyz).
struct GradSums {
    double occ, b1, b3, d[3];
};

// Visit every row (i, j) of atom A with i in [ia, ib] (lattice), build the tables and
// either add its density to `out` (Forward) or gather gradient sums from `grad` (backward).
template <bool Forward, int W = 8>
KERNELS_INLINE void process_atom(const Geom& g, const AtomP& A, int64_t ia, int64_t ib, float* out, const float* grad,
                  Scratch& S, GradSums* gs, int16_t* rows_saved) {
    const int64_t nx = g.n[0], ny = g.n[1], nz = g.n[2];
    const int64_t ylo = A.lo[1], zlo = A.lo[2];
    const int64_t nyb = A.hi[1] - ylo + 1, nzb = A.hi[2] - zlo + 1, nib = ib - ia + 1;
    const double fx = A.f[0], fy = A.f[1], fz = A.f[2];

    double* dyd = S.dyd.data();
    double* dzd = S.dzd.data();
    int64_t* jw = S.jw.data();
    // the same values as static_cast<double>(ylo + s) (integers, exact in double), written so the
    // loop vectorises: an int64 → double conversion needs AVX-512, an int32 one does not
    const double ylod = static_cast<double>(ylo);
    for (int32_t s = 0; s < static_cast<int32_t>(nyb); ++s) dyd[s] = (ylod + static_cast<double>(s)) / g.m[1] - fy;
    // wrapped indices by stepping (one division per atom and axis, not one per voxel index)
    for (int64_t s = 0, w = floor_mod(ylo, ny); s < nyb; ++s, w = w + 1 == ny ? 0 : w + 1) jw[s] = w;
#if defined(KERNELS_LANES)
    // Lane-blocked path when the cell factors and the atom's box is not longer than the cell
    // along z (decided per atom, so every slab and thread count takes the same path for it).
    // Lane l is map z = (z0 + l) mod nz (nl <= nz, so no two lanes of a row are the same voxel).
    {
        int64_t nl = whole_blocks(nzb);
        const int64_t zs = floor_mod(zlo, nz);  // map z of the box's first voxel
        if (lane_path(g, A)) {
            // Lane 0 at the box's first voxel; if the lanes would run past the top of the cell but
            // the box itself does not, slide them down so no block wraps. In the forward, a box that
            // wraps around the cell along z starts its lanes at a multiple of kL below it when nz is
            // one too: then every block is one aligned run of a row, below the top or wrapped whole
            // to z = 0, 1, ... (one block more at most, cheaper than a block that goes lane by lane).
            // Otherwise, and in the backward (where the extra block costs more than the wrap), the
            // block that crosses the top goes lane by lane.
            int64_t z0 = zs;
            if (zs + nzb <= nz) {
                if (zs + nl > nz) z0 = nz - nl;
            } else if (Forward && nz % kL == 0 && whole_blocks(nzb + zs % kL) <= nz) {
                z0 = zs - zs % kL;
                nl = whole_blocks(nzb + zs % kL);
            }
            double sums[6];
            float ampf[NG];
            for (int k = 0; k < NG; ++k) ampf[k] = static_cast<float>(A.amp[k] * A.occ);
            // the backward's blocks of 16 lanes: whole blocks over the box's lanes (the extra
            // lanes are outside every row, so masked; lanes past the top of the cell wrap)
            if (!Forward && W == 16) nl = (nl + 15) / 16 * 16;
            atom_lanes<Forward, W>(g, A, ia, ib, out, grad, S, ampf, z0, zs - z0, nl, rows_saved, sums);
            if (!Forward) {
                gs->occ += sums[0];
                gs->b1 += sums[1];
                gs->d[0] += sums[2];
                gs->d[1] += sums[3];
                gs->d[2] += sums[4];
                gs->b3 += sums[5];
            }
            return;
        }
    }
#endif
    int64_t* zw = S.zw.data();
    for (int64_t t = 0, w = floor_mod(zlo, nz); t < nzb; ++t, w = w + 1 == nz ? 0 : w + 1) {
        dzd[t] = static_cast<double>(zlo + t) / g.m[2] - fz;
        zw[t] = w;
    }
    if (!Forward) {
        for (int64_t t = 0; t < nzb; ++t) {
            S.dzf[t] = static_cast<float>(dzd[t]);
            S.dz2f[t] = static_cast<float>(dzd[t] * dzd[t]);
        }
    }
    float* ta = S.tab_a.data();
    float* tb = S.tab_b.data();
    double* q = S.q.data();
    // Tables. Vectorised loops run over the full box extent of their inner axis, so a
    // value never depends on where a slab boundary clips the atom (reproducibility).
    if (g.kind == kZSep) {
        for (int64_t t = 0; t < nzb; ++t) q[t] = g.G22 * dzd[t] * dzd[t];
        exp_table(A, q, nzb, ta);  // ta[k*nzb + t]
        for (int64_t i = ia; i <= ib; ++i) {
            const double dx = static_cast<double>(i) / g.m[0] - fx;
            double* qi = q + (i - ia) * nyb;
            for (int64_t s = 0; s < nyb; ++s)
                qi[s] = g.G00 * dx * dx + g.G11 * dyd[s] * dyd[s] + g.G01x2 * dx * dyd[s];
        }
        exp_table(A, q, nib * nyb, tb);  // tb[k*nib*nyb + (i-ia)*nyb + s]
    } else if (g.kind == kYSep) {
        for (int64_t s = 0; s < nyb; ++s) q[s] = g.G11 * dyd[s] * dyd[s];
        exp_table(A, q, nyb, ta);  // ta[k*nyb + s]
        for (int64_t i = ia; i <= ib; ++i) {
            const double dx = static_cast<double>(i) / g.m[0] - fx;
            double* qi = q + (i - ia) * nzb;
            for (int64_t t = 0; t < nzb; ++t)
                qi[t] = g.G00 * dx * dx + g.G22 * dzd[t] * dzd[t] + g.G02x2 * dx * dzd[t];
        }
        exp_table(A, q, nib * nzb, tb);  // tb[k*nib*nzb + (i-ia)*nzb + t]
    }

    float ampf[NG];
    for (int k = 0; k < NG; ++k) ampf[k] = static_cast<float>(A.amp[k] * A.occ);
    const int64_t plane_b = g.kind == kZSep ? nib * nyb : nib * nzb;

    for (int64_t i = ia; i <= ib; ++i) {
        const double dx = static_cast<double>(i) / g.m[0] - fx;
        const int64_t iw = floor_mod(i, nx);
        // z-intervals of all rows of this x plane at once (vectorised over y); rows that
        // need care (grazing, an end near a lattice point) go through the exact row_range.
        double* rq = S.rq.data();
        double* rl = S.rl.data();
        double* rlo = S.rlo.data();
        double* rhi = S.rhi.data();
        int64_t* rst = S.rst.data();
        {
            const double G00 = g.G00, G11 = g.G11, G22 = g.G22, G01x2 = g.G01x2, G02x2 = g.G02x2, G12x2 = g.G12x2;
            const double inv2 = g.inv2G22, mz = g.m[2], R2 = A.R2;
            KERNELS_SIMD
            for (int64_t s = 0; s < nyb; ++s) {
                const double dy = dyd[s];
                const double Q = G00 * dx * dx + G11 * dy * dy + G01x2 * dx * dy;
                const double Lz = G02x2 * dx + G12x2 * dy;
                const double disc = Lz * Lz - 4.0 * G22 * (Q - R2);
                const double scale = Lz * Lz + 4.0 * G22 * (std::fabs(Q) + R2);
                const double wc = (fz - Lz * inv2) * mz;
                const double half = std::sqrt(disc) * inv2 * mz;  // NaN when disc < 0: row is then empty
                const double wlo = wc - half, whi = wc + half;
                const double cs = std::ceil(wlo - 1e-6), ce = std::floor(whi + 1e-6);
                const int64_t hit = disc > -1e-6 * scale;
                const int64_t care = (disc < 1e-6 * scale) | (cs - wlo < 1e-6) | (whi - ce < 1e-6);
                rq[s] = Q;
                rl[s] = Lz;
                rlo[s] = cs;
                rhi[s] = ce;
                rst[s] = hit * (1 + care);
            }
        }
        for (int64_t s = 0; s < nyb; ++s) {
            if (rst[s] == 0) continue;
            const double dy = dyd[s];
            const double Q = rq[s], Lz = rl[s];
            int64_t wa, wb;
            if (rst[s] == 2) {
                if (!row_range(g, A, dx, dy, Q, Lz, wa, wb)) continue;
            } else {
                wa = std::max(zlo, static_cast<int64_t>(rlo[s]));
                wb = std::min(A.hi[2], static_cast<int64_t>(rhi[s]));
                if (wa > wb) continue;
            }
            // row factor c_k and the z-table (base pointer at z = wa, stride between Gaussians)
            float rowf[NG];
            const float* tab;
            int64_t stride;
            if (g.kind == kZSep) {
                for (int k = 0; k < NG; ++k) rowf[k] = tb[k * plane_b + (i - ia) * nyb + s];
                tab = ta + (wa - zlo);
                stride = nzb;
            } else if (g.kind == kYSep) {
                for (int k = 0; k < NG; ++k) rowf[k] = ta[k * nyb + s];
                tab = tb + (i - ia) * nzb + (wa - zlo);
                stride = plane_b;
            } else {
                const int64_t len = wb - wa + 1;
                double* qr = q;
                const double* dz = dzd + (wa - zlo);
                for (int64_t t = 0; t < len; ++t) qr[t] = Q + Lz * dz[t] + g.G22 * dz[t] * dz[t];
                exp_table(A, qr, len, S.tab_r.data());
                for (int k = 0; k < NG; ++k) rowf[k] = 1.0f;
                tab = S.tab_r.data();
                stride = len;
            }
            const int64_t base = (iw * ny + jw[s]) * nz;
            if (Forward) {
                float c[NG];
                for (int k = 0; k < NG; ++k) c[k] = ampf[k] * rowf[k];
                int64_t w = wa;
                int64_t wz = zw[w - zlo];
                while (w <= wb) {  // pieces split where the row wraps around the cell along z
                    const int64_t run = std::min(wb - w + 1, nz - wz);
                    if (wz + ((run + kW - 1) / kW) * kW <= nz)
                        add_row_w(out + base + wz, run, tab + (w - wa), stride, c);
                    else
                        add_row(out + base + wz, run, tab + (w - wa), stride, c);
                    w += run;
                    wz = 0;
                }
            } else {
                float cu[4][NG];
                for (int k = 0; k < NG; ++k)
                    for (int mm = 0; mm < 4; ++mm) cu[mm][k] = static_cast<float>(A.gw[mm][k] * rowf[k]);
                float acc[7] = {0, 0, 0, 0, 0, 0, 0};
                int64_t w = wa;
                int64_t wz = zw[w - zlo];
                while (w <= wb) {
                    const int64_t run = std::min(wb - w + 1, nz - wz);
                    const float* gp = grad + base + wz;
                    const float* dzp = S.dzf.data() + (w - zlo);
                    const float* dz2p = S.dz2f.data() + (w - zlo);
                    if (wz + ((run + kW - 1) / kW) * kW <= nz)
                        gather_row<true>(gp, run, tab + (w - wa), stride, dzp, dz2p, cu, acc);
                    else
                        gather_row<false>(gp, run, tab + (w - wa), stride, dzp, dz2p, cu, acc);
                    w += run;
                    wz = 0;
                }
                gs->occ += acc[0];
                gs->b1 += acc[1];
                gs->b3 += Q * static_cast<double>(acc[4]) + Lz * static_cast<double>(acc[5]) +
                          g.G22 * static_cast<double>(acc[6]);
                gs->d[0] += dx * static_cast<double>(acc[2]);
                gs->d[1] += dy * static_cast<double>(acc[2]);
                gs->d[2] += acc[3];
            }
        }
    }
}

void size_scratch(Scratch& S, int64_t nxb, int64_t nyb, int64_t nzb) {
    const int64_t big = std::max(nxb * nyb, nxb * nzb);
    // + kW: the fixed-width row kernels read up to kW entries past a row's last voxel (masked out)
    S.tab_a.resize(NG * std::max(nyb, nzb) + kW);
    S.tab_b.resize(NG * big + kW);
    S.tab_r.resize(NG * nzb + kW);
    S.q.resize(std::max(big, std::max(nyb, nzb)));
    S.dzf.resize(nzb + kW);
    S.dz2f.resize(nzb + kW);
    S.dzd.resize(nzb);
    S.dyd.resize(nyb);
    S.jw.resize(nyb);
    S.zw.resize(nzb);
    for (auto* v : {&S.rq, &S.rl, &S.rlo, &S.rhi}) v->resize(nyb);
    S.rst.resize(nyb);
    const int64_t nl = ((nzb + 7) / 8) * 8 + 8;
    S.lane_tab.resize(NG * nl);
    if (static_cast<int64_t>(S.lane_index.size()) < nl) {
        S.lane_index.resize(nl);
        for (int64_t l = 0; l < nl; ++l) S.lane_index[l] = static_cast<int32_t>(l);
    }
    S.lane_q.resize(nxb * nl);
    S.lane_dz.resize(nl);
    S.lane_dzd.resize(nl);
    S.q.resize(std::max(S.q.size(), static_cast<size_t>(nxb * nl)));
    S.tab_b.resize(std::max(S.tab_b.size(), static_cast<size_t>(NG * nxb * nl)));
    S.rowc.resize(3 * NG * nyb);
    S.aacc.resize(6 * nl);
    const int64_t nyp = (nyb + 7) / 8 * 8;  // the float interval pass works in whole blocks of 8 rows
    S.rlo32.resize(nyp);
    S.rhi32.resize(nyp);
    S.dyf.resize(nyp);
    S.fix32.resize(nyp);
    S.rows.resize(nyb);
    const int64_t nzl = nzb + 16;  // kTabPad
    S.at_l.resize(NG * nzl);
    S.at_w.resize(NG * nzl);
    S.at_y.resize(NG * nzl);  // Y's first row
    S.at_r.resize(3 * NG * ((nyb + 7) / 8 * 8));  // GV, Vs, CR (rows padded to whole blocks of 8)
    S.at_d.resize(NG * nzl);
}

// The gradients of isotropic atoms [first, last) in W-lane blocks (backward.cpp: W = 8 in every variant;
// backward_wide.cpp: W = 16 in the x86-64-v4 one), written to gxyz (3 per atom), gb and gocc.
template <int W>
KERNELS_INLINE void gather_atoms_w(const Inputs& in, const std::vector<AtomP>& atoms, int64_t first, int64_t last,
                                   const float* grad, Scratch& S, RowIntervals* saved, double* gxyz,
                                   double* gb, double* gocc) {
    const Geom& g = in.g;
    for (int64_t i = first; i < last; ++i) {
        const AtomP& A = atoms[i];
        GradSums gs = {0, 0, 0, {0, 0, 0}};
        if (A.R2 > 0) {
            int16_t* rows = saved ? saved->at(i) : nullptr;
            process_atom<false, W>(g, A, A.lo[0], A.hi[0], nullptr, grad, S, &gs, rows);
        }
        // ρ = occ·Σ amp_k·e_k, e_k = exp(−α_k r²), α_k = 4π²/W_k, W_k = b_k + B:
        //   ∂ρ/∂occ = Σ amp·e;  ∂ρ/∂B = occ·Σ amp·e·(−1.5 + α·r²)/W;
        //   ∂ρ/∂xyz = 2·occ·Σ amp·α·e·orth·d  (∂r²/∂xyz = −2·orth·d, d = voxel − atom, fractional)
        const double d_occ = gs.occ;
        const double d_b = -1.5 * gs.b1 + gs.b3;
        for (int r = 0; r < 3; ++r)
            gxyz[3 * i + r] = 2.0 * A.occ *
                              (g.orth[3 * r] * gs.d[0] + g.orth[3 * r + 1] * gs.d[1] + g.orth[3 * r + 2] * gs.d[2]);
        gb[i] = A.occ * d_b;
        gocc[i] = d_occ;
    }
}

}  // namespace
