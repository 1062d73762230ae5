// Anisotropic atoms through per-atom factor tables in double: one multiply-add per voxel and term
// (aniso_atom_tables, forward and backward). The kernel's overview is in scatter.hpp.
#pragma once

#include "anisotropic.hpp"

namespace {

// ------------------------------------------------------------------ anisotropic atoms: factor tables

// The forward without an exp per voxel. Term k's exponent x_k(d) = Σ_m q_km·mono_m(d) splits over the
// voxel (plane i, row s, lane t) of the box as
//   x_k = [q0·dx² + q1·dy² + q3·dx·dy] + [q2·dz² + q4·dx·dz] + [q5·dy·dz],
// so ρ_k = C_k(i, s) · L_k(i)[t] · Y_k[s][t] with the row scalar C_k (amplitude × occupancy × the
// first bracket's exp), the plane's lane factor L_k(i) and the (row, lane) factor Y_k[s] =
// Y_k[0]·D_k^s, D_k = exp(q5·hy·dz). Each 1-D sequence exp(a(j)) of a linear or quadratic a over the
// box's lattice steps comes from two or three exps (exp_d, all seeds of an atom in one vector pass)
// and a multiplication or two per entry (exp(a(j+1)) = exp(a(j))·exp(a(j+1) − a(j)), the difference
// itself stepped likewise for a quadratic), L_k(i) from L_k(i−1) by one multiply per lane. The plane
// is walked block by block down its rows with the partial product P_k = L_k(i)·Y_k[s] in registers
// (see aniso_atom_tables): a voxel costs one multiply-add per term (8 lanes of double). Every sequence
// starts at the box's first plane, row and lane, so a voxel's value does not depend on the slab that
// computes it (determinism).
//
// Unlike the separable isotropic factors, these are not all ≤ 1: exp(q4·dx·dz) > 1 where dx·dz has
// the sign of q4, and only the product is a Gaussian. Everything is therefore in double (the five
// terms summed in double, one float rounding per voxel), and an atom takes this path only when every
// factor and every partial product that is multiplied further has |exponent| ≤ kTabBound for every
// term (aniso_tables_fit bounds them over the box): e^±680 is far from double overflow (e^709) and
// from the denormals (below e^−708), so no inf·0 and no lost digits; a voxel value that underflows is
// below any float map's resolution. Relative error of a voxel value: a few ulps of double per
// multiplication along chains of at most ~2·box-width steps (< 1e-13), then one float rounding.
// Atoms past the bound (very narrow or very anisotropic terms in a wide box) take aniso_atom's exp
// per voxel.
constexpr double kTabBound = 680.0;

// e^x in double for |x| ≤ 708, vectorisable (no libm call): x = n·ln2 + r with n the nearest integer
// (Cody–Waite with fdlibm's two-part ln2, r exact to ~1e-19), |r| ≤ ln2/2, e^r by its Taylor
// polynomial of degree 12 (truncation < 2e-16 relative), 2^n from the exponent bits. The tables need
// far less (a seed's relative error grows by at most the ~box-width steps of its progression).
KERNELS_INLINE double exp_d(double x) {
    const double shifter = 6755399441055744.0;  // 1.5·2^52: round to nearest
    const double n = (x * 1.4426950408889634 + shifter) - shifter;
    const double r = (x - n * 6.93147180369123816490e-01) - n * 1.90821492927058770002e-10;
    double p = 2.08767569878680989792e-09;  // 1/12!
    p = p * r + 2.50521083854417187751e-08;
    p = p * r + 2.75573192239858906526e-07;
    p = p * r + 2.75573192239858906526e-06;
    p = p * r + 2.48015873015873015873e-05;
    p = p * r + 1.98412698412698412698e-04;
    p = p * r + 1.38888888888888888889e-03;
    p = p * r + 8.33333333333333333333e-03;
    p = p * r + 4.16666666666666666667e-02;
    p = p * r + 1.66666666666666666667e-01;
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    const int64_t bits = (static_cast<int64_t>(n) + 1023) << 52;
    double scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

// Whether every term of atom `atom` (box A) keeps its factors and the partial products that are
// multiplied further within kTabBound (see above). Each |d| is widened by one voxel step, which covers
// the recurrences' step factors and the entry one past the box they compute (to within a step).
// Bounds on |exponent|, with m_a = max |d_a| (widened):
//   single factors exp(q_m·mono_m): |q_m|·max|mono_m| (a bilinear or square term peaks at a corner);
//   GV = exp(q1·dy² + q3·dx·dy): |q1|·m_y² + |q3|·m_x·m_y;
//   the row scalar cf·exp(P1), P1 = q0·dx² + q1·dy² + q3·dx·dy ≤ 0 (a negative-definite form):
//   |ln cf| − P1min, P1min the form's minimum over the rectangle's corners (a concave function takes
//   its minimum at a vertex);
//   the walk's partial product P = L·Y = exp(q2·dz² + q4·dx·dz + q5·dy·dz): |q2|·m_z² + |q4|·m_x·m_z +
//   |q5|·m_y·m_z.
// A voxel's term is then C·P with both factors within e^±kTabBound: neither underflows while the
// other is large.
// The voxel value itself, the last product, is ≤ the term's peak (x ≤ 0) and needs no bound: where
// it falls below the smallest double it is negligible, and no later product reads it.
// max and min that keep a NaN (a NaN bound fails the test)
KERNELS_INLINE double fmax_inl(double a, double b) { return (a > b || a != a) ? a : b; }
KERNELS_INLINE double fmin_inl(double a, double b) { return (a < b || a != a) ? a : b; }
// An upper bound on |ln |x|| from x's binary exponent (0 for x = 0 or a denormal, where every product
// with x is 0 or negligible; a non-finite x gives a bound past any limit)
KERNELS_INLINE double abs_log_bound(double x) {
    uint64_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    const int64_t e = static_cast<int64_t>((bits >> 52) & 0x7ff);
    if (e == 0) return 0.0;
    if (e == 0x7ff) return std::numeric_limits<double>::infinity();
    return static_cast<double>(std::abs(e - 1023) + 1) * 0.6931471805599453;
}
KERNELS_INLINE bool aniso_tables_fit(const Inputs& in, const AtomP& A, int64_t atom) {
    const Geom& g = in.g;
    double dlo[3], dhi[3], mx[3];
    for (int d = 0; d < 3; ++d) {
        const double h = 1.0 / g.m[d];
        dlo[d] = static_cast<double>(A.lo[d]) * h - A.f[d] - h;
        dhi[d] = static_cast<double>(A.hi[d]) * h - A.f[d] + h;
        mx[d] = fmax_inl(std::fabs(dlo[d]), std::fabs(dhi[d]));
    }
    const double mono[6] = {mx[0] * mx[0], mx[1] * mx[1], mx[2] * mx[2], mx[0] * mx[1], mx[0] * mx[2], mx[1] * mx[2]};
    const AnisoTerms& T = in.terms[atom];
    for (int k = 0; k < NG; ++k) {
        const double* q = T.q[k];
        double worst = 0;
        for (int m = 0; m < 6; ++m) worst = fmax_inl(worst, std::fabs(q[m]) * mono[m]);
        worst = fmax_inl(worst, std::fabs(q[1]) * mono[1] + std::fabs(q[3]) * mono[3]);
        worst = fmax_inl(worst, std::fabs(q[2]) * mono[2] + std::fabs(q[4]) * mono[4] + std::fabs(q[5]) * mono[5]);
        double p1min = 0;
        for (int c = 0; c < 4; ++c) {
            const double dx = c & 1 ? dhi[0] : dlo[0], dy = c & 2 ? dhi[1] : dlo[1];
            p1min = fmin_inl(p1min, q[0] * dx * dx + q[1] * dy * dy + q[3] * dx * dy);
        }
        const double cf = T.amp[k] * A.occ;
        const double lcf = abs_log_bound(cf);
        worst = fmax_inl(worst, lcf - p1min);
        if (!(worst <= kTabBound)) return false;
    }
    return true;
}

// Lanes a factor-table row is padded with past the box's last lane: the walk's blocks of a plane read
// up to 2·kAW − 1 entries past the plane's last lane (zeros: masked lanes).
constexpr int64_t kTabPad = 2 * kAW;

// One block of kAW lanes of aniso_atom_tables' walk, from lane tb: P_k = L_k·Y_k[0] of the five terms,
// stepped down one row by P_k *= D_k, so P_k holds row `row` after construction.
struct AnisoWalkBlock {
    vd8 P0, P1, P2, P3, P4;
    vd8 D0, D1, D2, D3, D4;
    KERNELS_INLINE AnisoWalkBlock(const double* L, const double* Y0, const double* D, int64_t nzl, int64_t tb,
                                  int64_t row)
        : P0(vload<vd8>(L + tb) * vload<vd8>(Y0 + tb)),
          P1(vload<vd8>(L + nzl + tb) * vload<vd8>(Y0 + nzl + tb)),
          P2(vload<vd8>(L + 2 * nzl + tb) * vload<vd8>(Y0 + 2 * nzl + tb)),
          P3(vload<vd8>(L + 3 * nzl + tb) * vload<vd8>(Y0 + 3 * nzl + tb)),
          P4(vload<vd8>(L + 4 * nzl + tb) * vload<vd8>(Y0 + 4 * nzl + tb)),
          D0(vload<vd8>(D + tb)),
          D1(vload<vd8>(D + nzl + tb)),
          D2(vload<vd8>(D + 2 * nzl + tb)),
          D3(vload<vd8>(D + 3 * nzl + tb)),
          D4(vload<vd8>(D + 4 * nzl + tb)) {
        for (int64_t s = 0; s < row; ++s) step();
    }
    KERNELS_INLINE void step() { P0 *= D0, P1 *= D1, P2 *= D2, P3 *= D3, P4 *= D4; }
};

// The forward of anisotropic atom `atom` over planes [ia, ib] through the factor tables (callers check
// aniso_tables_fit). The voxel set is aniso_atom's (plane_intervals / plane_intervals_f); each voxel
// receives one float add of its five terms summed in double, in the same atom order as every path.
// Each plane is walked block by block, blocks of kAW box lanes from the first lane a row of the plane
// reaches (a lane's arithmetic does not depend on the block it falls in): P_k(i, 0) = L_k(i)·Y_k[0]
// and P_k(i, s + 1) = P_k(i, s)·D_k stay in registers while the walk goes down the plane's rows, and
// row s adds Σ_k C_k(i, s)·P_k(i, s), masked to its interval: a
// voxel costs one multiply-add per term, a (row, block) one multiply per term to step P, and nothing
// is loaded per voxel but the map (the row scalars are broadcast loads): reading L_k and a tabulated
// Y_k per voxel instead (ten table loads a block of 8) takes ~1.3× as long.
//
// Backward (Forward false, ia and ib the whole box): the same walk with unit amplitudes, each row's
// e_k = C_k·P_k against the upstream gradient: per block, lane sums Σ_s u, Σ_s dy·u, Σ_s dy²·u of
// u = C_k(s)·g·P_k (15 vectors of double), folded with the block's dz at its end into the plane's
// six sums per term (aniso_atom's AnisoPlaneSums, kept as lane vectors), those with dx into the ten
// moments as lane vectors, summed across lanes into `gs` once per atom (double throughout). The
// lanes outside a row's interval take g = 0 (P is finite over the box).
template <bool Forward = true>
KERNELS_INLINE void aniso_atom_tables(const Inputs& in, const AtomP& A, int64_t atom, int64_t ia, int64_t ib,
                                      float* out, Scratch& S, const float* grad = nullptr, AnisoSums* gs = nullptr) {
    const Geom& g = in.g;
    const int64_t nx = g.n[0], ny = g.n[1], nz = g.n[2];
    const int64_t xlo = A.lo[0], ylo = A.lo[1], zlo = A.lo[2];
    const int64_t nyb = A.hi[1] - ylo + 1, nzb = A.hi[2] - zlo + 1;
    const int64_t nzl = nzb + kTabPad;  // lanes per table row
    // the table loops run over whole blocks of 8 (no scalar remainder): lanes [nzb, nzr) and rows
    // [nyb, nyr) are zeros (their steps are zeros), inside the rows' padding
    const int64_t nzr = (nzb + 7) / 8 * 8, nyr = (nyb + 7) / 8 * 8;
    const double hx = 1.0 / g.m[0], hy = 1.0 / g.m[1], hz = 1.0 / g.m[2];
    const double dx0 = static_cast<double>(xlo) * hx - A.f[0];
    const double dy0 = static_cast<double>(ylo) * hy - A.f[1];
    const double dz0 = static_cast<double>(zlo) * hz - A.f[2];
    double* dyd = S.dyd.data();
    int64_t* jw = S.jw.data();
    int64_t* zw = S.zw.data();
    const double ylod = static_cast<double>(ylo);
    for (int32_t s = 0; s < static_cast<int32_t>(nyb); ++s) dyd[s] = (ylod + static_cast<double>(s)) / g.m[1] - A.f[1];
    for (int64_t s = 0, w = floor_mod(ylo, ny); s < nyb; ++s, w = w + 1 == ny ? 0 : w + 1) jw[s] = w;
    for (int64_t t = 0, w = floor_mod(zlo, nz); t < nzb; ++t, w = w + 1 == nz ? 0 : w + 1) zw[t] = w;

    const AnisoTerms& T = in.terms[atom];
    // the exponents whose exps seed the progressions, kSeeds per term, exponentiated in one vector pass
    constexpr int kSeeds = 17;
    alignas(64) double seed[NG * kSeeds + 3];
    for (int k = 0; k < NG; ++k) {
        const double* q = T.q[k];
        double* x = seed + k * kSeeds;
        // L(xlo)[t] = exp(q2·dz² + q4·dx0·dz): value, first and second difference of the exponent
        x[0] = q[2] * dz0 * dz0 + q[4] * dx0 * dz0;
        x[1] = q[2] * hz * (2.0 * dz0 + hz) + q[4] * dx0 * hz;
        x[2] = 2.0 * q[2] * hz * hz;
        // W[t] = exp(q4·hx·dz): L's step from one plane to the next
        x[3] = q[4] * hx * dz0;
        x[4] = q[4] * hx * hz;
        // Y[0][t] = exp(q5·dy0·dz), and its step from one row to the next, D[t] = exp(q5·hy·dz)
        x[5] = q[5] * dy0 * dz0;
        x[6] = q[5] * dy0 * hz;
        x[7] = q[5] * hy * dz0;
        x[8] = q[5] * hy * hz;
        // GV(xlo)[s] = exp(q1·dy² + q3·dx0·dy), and its step from one plane to the next, exp(q3·hx·dy)
        x[9] = q[1] * dy0 * dy0 + q[3] * dx0 * dy0;
        x[10] = q[1] * hy * (2.0 * dy0 + hy) + q[3] * dx0 * hy;
        x[11] = 2.0 * q[1] * hy * hy;
        x[12] = q[3] * hx * dy0;
        x[13] = q[3] * hx * hy;
        // exp(q0·dx²) along the planes
        x[14] = q[0] * dx0 * dx0;
        x[15] = q[0] * hx * (2.0 * dx0 + hx);
        x[16] = 2.0 * q[0] * hx * hx;
    }
    for (int j = NG * kSeeds; j < NG * kSeeds + 3; ++j) seed[j] = 0.0;
    KERNELS_SIMD
    for (int j = 0; j < NG * kSeeds + 3; ++j) seed[j] = exp_d(seed[j]);
    // tables, term k at k·(its length): L of the current plane, W: L's step per plane, Y0: Y's first row,
    // D: Y's step per row (NG × nzl each); per row: GV of the current plane and its step per plane Vs,
    // CR: the current plane's row scalars (NG × nyr each)
    double* L = S.at_l.data();
    double* W = S.at_w.data();
    double* Y0 = S.at_y.data();
    double* D = S.at_d.data();
    double* GV = S.at_r.data();
    double* Vs = GV + NG * nyr;
    double* CR = Vs + NG * nyr;
    double gx[NG], gr[NG], grr[NG], cf[NG];
    // The 1-D progressions, t outer and the terms inner: 4·NG independent multiply chains along z and
    // 2·NG along y run side by side instead of one after another.
    {
        double eL[NG], rL[NG], rrL[NG], eW[NG], rW[NG], eY[NG], rY[NG], eD[NG], rD[NG];
        for (int k = 0; k < NG; ++k) {
            const double* e = seed + k * kSeeds;
            eL[k] = e[0], rL[k] = e[1], rrL[k] = e[2], eW[k] = e[3], rW[k] = e[4];
            eY[k] = e[5], rY[k] = e[6], eD[k] = e[7], rD[k] = e[8];
        }
        for (int64_t t = 0; t < nzb; ++t) {
            for (int k = 0; k < NG; ++k) {
                L[k * nzl + t] = eL[k];
                W[k * nzl + t] = eW[k];
                Y0[k * nzl + t] = eY[k];
                D[k * nzl + t] = eD[k];
                eL[k] *= rL[k];
                rL[k] *= rrL[k];
                eW[k] *= rW[k];
                eY[k] *= rY[k];
                eD[k] *= rD[k];
            }
        }
    }
    {
        double eG[NG], rG[NG], rrG[NG], eV[NG], rV[NG];
        for (int k = 0; k < NG; ++k) {
            const double* e = seed + k * kSeeds;
            eG[k] = e[9], rG[k] = e[10], rrG[k] = e[11], eV[k] = e[12], rV[k] = e[13];
        }
        for (int64_t s = 0; s < nyb; ++s) {
            for (int k = 0; k < NG; ++k) {
                GV[k * nyr + s] = eG[k];
                Vs[k * nyr + s] = eV[k];
                eG[k] *= rG[k];
                rG[k] *= rrG[k];
                eV[k] *= rV[k];
            }
        }
    }
    for (int k = 0; k < NG; ++k) {
        const double* e = seed + k * kSeeds;
        cf[k] = Forward ? T.amp[k] * A.occ : 1.0;
        for (int64_t t = nzb; t < nzl; ++t) L[k * nzl + t] = W[k * nzl + t] = Y0[k * nzl + t] = D[k * nzl + t] = 0.0;
        for (int64_t s = nyb; s < nyr; ++s) GV[k * nyr + s] = Vs[k * nyr + s] = 0.0;
        gx[k] = e[14];
        gr[k] = e[15];
        grr[k] = e[16];
    }

    int32_t* lo = S.rlo32.data();
    int32_t* hi = S.rhi32.data();
    RowConstF rcf{};
    float* dyf = S.dyf.data();
    if (g.float_rows) {
        rcf = row_const_f(g, A);
        const int64_t nyp = (nyb + 7) / 8 * 8;
        for (int64_t s = 0; s < nyb; ++s) dyf[s] = static_cast<float>(dyd[s]);
        for (int64_t s = nyb; s < nyp; ++s) dyf[s] = dyf[nyb - 1];
    }
    const vi8 iota = Lanes<8>::iota();
    // backward: the ten moments of each term as lane vectors, summed across lanes once per atom
    vd8 mv[NG][10];
    if constexpr (!Forward) std::memset(mv, 0, sizeof mv);
    for (int64_t i = xlo; i <= ib; ++i) {
        if (i > xlo) {  // step the plane's factors from plane i − 1
            for (int k = 0; k < NG; ++k) {
                double* Lk = L + k * nzl;
                const double* Wk = W + k * nzl;
                KERNELS_SIMD
                for (int64_t t = 0; t < nzr; ++t) Lk[t] *= Wk[t];
                double* GVk = GV + k * nyr;
                const double* Vsk = Vs + k * nyr;
                KERNELS_SIMD
                for (int64_t s = 0; s < nyr; ++s) GVk[s] *= Vsk[s];
                gx[k] *= gr[k];
                gr[k] *= grr[k];
            }
        }
        if (i < ia) continue;
        const double dx = static_cast<double>(i) / g.m[0] - A.f[0];
        const int64_t iw = floor_mod(i, nx);
        if (g.float_rows)
            plane_intervals_f(g, A, rcf, dx, nyb, dyf, dyd, S, lo, hi);
        else
            plane_intervals(g, A, dx, nyb, dyd, S, lo, hi);
        // the plane's non-empty rows [sf, sl] and the lanes [tlo, thi] they cover
        int64_t sf = -1, sl = -1;
        int32_t tlo = std::numeric_limits<int32_t>::max(), thi = -1;
        for (int64_t s = 0; s < nyb; ++s) {
            if (lo[s] > hi[s]) continue;
            if (sf < 0) sf = s;
            sl = s;
            tlo = std::min(tlo, lo[s]);
            thi = std::max(thi, hi[s]);
        }
        if (sf < 0) continue;
        for (int k = 0; k < NG; ++k) {
            const double ck = cf[k], gk = gx[k];
            const double* GVk = GV + k * nyr;
            double* CRk = CR + k * nyr;
            KERNELS_SIMD
            for (int64_t s = 0; s < nyr; ++s) CRk[s] = ck * (gk * GVk[s]);
        }
        const int64_t plane_base = iw * ny;
        if constexpr (!Forward) {
            vd8 pv[NG][6];  // the plane's six sums per term as lane vectors (see aniso_atom's AnisoPlaneSums)
            std::memset(pv, 0, sizeof pv);
            for (int64_t tb = tlo; tb <= thi; tb += kAW) {
                AnisoWalkBlock B(L, Y0, D, nzl, tb, sf);
                const int64_t wz = zw[tb];
                const bool direct = wz + kAW <= nz;
                const int32_t tb32 = static_cast<int32_t>(tb);
                vd8 a0 = {}, a1 = {}, a2 = {}, a3 = {}, a4 = {};  // Σ_s u_k
                vd8 b0 = {}, b1 = {}, b2 = {}, b3 = {}, b4 = {};  // Σ_s dy·u_k
                vd8 e0 = {}, e1 = {}, e2 = {}, e3 = {}, e4 = {};  // Σ_s dy²·u_k
                for (int64_t s = sf; s <= sl; ++s) {
                    if (lo[s] <= tb32 + static_cast<int32_t>(kAW) - 1 && hi[s] >= tb32) {
                        const vi8 keep = (iota >= (vi8{} + (lo[s] - tb32))) & (iota <= (vi8{} + (hi[s] - tb32)));
                        const int64_t base = (plane_base + jw[s]) * nz;
                        vf8 gf;
                        if (direct) {
                            gf = vload(grad + base + wz);
                        } else {
                            alignas(32) float g8[kAW] = {};
                            const int64_t te = std::min<int64_t>(hi[s], tb + kAW - 1);
                            for (int64_t t = std::max<int64_t>(lo[s], tb); t <= te; ++t)
                                g8[t - tb] = grad[base + zw[t]];
                            gf = vload(g8);
                        }
                        const vd8 gd = __builtin_convertvector(
                            reinterpret_cast<vf8>(reinterpret_cast<vi8>(gf) & keep), vd8);
                        const double* c = CR + s;
                        const vd8 dy = vsplat_at<vd8>(dyd + s);
                        const vd8 u0 = vsplat_at<vd8>(c) * (gd * B.P0), u1 = vsplat_at<vd8>(c + nyr) * (gd * B.P1),
                                  u2 = vsplat_at<vd8>(c + 2 * nyr) * (gd * B.P2),
                                  u3 = vsplat_at<vd8>(c + 3 * nyr) * (gd * B.P3),
                                  u4 = vsplat_at<vd8>(c + 4 * nyr) * (gd * B.P4);
                        a0 += u0, a1 += u1, a2 += u2, a3 += u3, a4 += u4;
                        const vd8 y0 = dy * u0, y1 = dy * u1, y2 = dy * u2, y3 = dy * u3, y4 = dy * u4;
                        b0 += y0, b1 += y1, b2 += y2, b3 += y3, b4 += y4;
                        e0 += dy * y0, e1 += dy * y1, e2 += dy * y2, e3 += dy * y3, e4 += dy * y4;
                    }
                    B.step();
                }
                // the block's dz per lane (lanes past the box's last z hold zero sums)
                alignas(64) double dzl[kAW];
                for (int l = 0; l < static_cast<int>(kAW); ++l)
                    dzl[l] = static_cast<double>(zlo + tb + l) / g.m[2] - A.f[2];
                const vd8 dz = vload<vd8>(dzl);
                const vd8* av[NG] = {&a0, &a1, &a2, &a3, &a4};
                const vd8* bv[NG] = {&b0, &b1, &b2, &b3, &b4};
                const vd8* ev[NG] = {&e0, &e1, &e2, &e3, &e4};
                for (int k = 0; k < NG; ++k) {
                    const vd8 az = *av[k] * dz;
                    pv[k][0] += *av[k];
                    pv[k][1] += *bv[k];
                    pv[k][2] += *ev[k];
                    pv[k][3] += az;
                    pv[k][4] += *bv[k] * dz;
                    pv[k][5] += az * dz;
                }
            }
            const vd8 dxv = vd8{} + dx, dxx = dxv * dxv;
            for (int k = 0; k < NG; ++k) {
                vd8* m = mv[k];
                m[0] += pv[k][0];
                m[1] += dxv * pv[k][0];
                m[2] += pv[k][1];
                m[3] += pv[k][3];
                m[4] += dxx * pv[k][0];
                m[5] += pv[k][2];
                m[6] += pv[k][5];
                m[7] += dxv * pv[k][1];
                m[8] += dxv * pv[k][3];
                m[9] += pv[k][4];
            }
            continue;
        }
        if (thi - tlo >= kAW && thi - tlo < 2 * kAW && zw[tlo] + 2 * kAW <= nz) {
            // the plane's rows span two blocks that lie inside the map row: walk both at once, rows outer
            // (10 partial products and their steps in registers, each row's scalars loaded once)
            const int64_t tb = tlo, tc = tlo + kAW;
            AnisoWalkBlock B(L, Y0, D, nzl, tb, sf), Bc(L, Y0, D, nzl, tc, sf);
            const int64_t wz = zw[tb];
            const int32_t tb32 = static_cast<int32_t>(tb);
            for (int64_t s = sf; s <= sl; ++s) {
                if (lo[s] <= hi[s]) {
                    const double* c = CR + s;
                    const vd8 c0 = vsplat_at<vd8>(c), c1 = vsplat_at<vd8>(c + nyr), c2 = vsplat_at<vd8>(c + 2 * nyr),
                              c3 = vsplat_at<vd8>(c + 3 * nyr), c4 = vsplat_at<vd8>(c + 4 * nyr);
                    const vd8 va = ((c0 * B.P0 + c1 * B.P1) + (c2 * B.P2 + c3 * B.P3)) + c4 * B.P4;
                    const vd8 vb = ((c0 * Bc.P0 + c1 * Bc.P1) + (c2 * Bc.P2 + c3 * Bc.P3)) + c4 * Bc.P4;
                    const vi8 la = vi8{} + (lo[s] - tb32), ha = vi8{} + (hi[s] - tb32);
                    const vi8 ka = (iota >= la) & (iota <= ha);
                    const vi8 kb = (iota + static_cast<int32_t>(kAW) >= la) & (iota + static_cast<int32_t>(kAW) <= ha);
                    const vf8 fa = reinterpret_cast<vf8>(reinterpret_cast<vi8>(__builtin_convertvector(va, vf8)) & ka);
                    const vf8 fb = reinterpret_cast<vf8>(reinterpret_cast<vi8>(__builtin_convertvector(vb, vf8)) & kb);
                    float* o = out + (plane_base + jw[s]) * nz + wz;
                    vstore(o, vload(o) + fa);
                    vstore(o + kAW, vload(o + kAW) + fb);
                }
                B.step();
                Bc.step();
            }
            continue;
        }
        for (int64_t tb = tlo; tb <= thi; tb += kAW) {
            AnisoWalkBlock B(L, Y0, D, nzl, tb, sf);
            const int64_t wz = zw[tb];
            // the block's lanes inside the map row (lanes past the box's last z are masked in every row)
            const bool direct = wz + kAW <= nz;
            const int32_t tb32 = static_cast<int32_t>(tb);
            for (int64_t s = sf; s <= sl; ++s) {
                if (lo[s] <= tb32 + static_cast<int32_t>(kAW) - 1 && hi[s] >= tb32) {
                    const double* c = CR + s;
                    const vd8 v = ((vsplat_at<vd8>(c) * B.P0 + vsplat_at<vd8>(c + nyr) * B.P1) +
                                   (vsplat_at<vd8>(c + 2 * nyr) * B.P2 + vsplat_at<vd8>(c + 3 * nyr) * B.P3)) +
                                  vsplat_at<vd8>(c + 4 * nyr) * B.P4;
                    const vi8 keep = (iota >= (vi8{} + (lo[s] - tb32))) & (iota <= (vi8{} + (hi[s] - tb32)));
                    const vf8 f = reinterpret_cast<vf8>(reinterpret_cast<vi8>(__builtin_convertvector(v, vf8)) & keep);
                    const int64_t base = (plane_base + jw[s]) * nz;
                    if (direct) {
                        float* o = out + base + wz;
                        vstore(o, vload(o) + f);
                    } else {
                        alignas(32) float f8[kAW];
                        vstore(f8, f);
                        const int64_t te = std::min<int64_t>(hi[s], tb + kAW - 1);
                        for (int64_t t = std::max<int64_t>(lo[s], tb); t <= te; ++t)
                            out[base + zw[t]] += f8[t - tb];
                    }
                }
                B.step();
            }
        }
    }
    if constexpr (!Forward) {
        for (int k = 0; k < NG; ++k)
            for (int j = 0; j < 10; ++j) {
                double sum = 0;
                for (int l = 0; l < static_cast<int>(kAW); ++l) sum += mv[k][j][l];
                gs->m[k][j] += sum;
            }
    }
}

}  // namespace
