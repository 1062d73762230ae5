// Anisotropic atoms: effective U, per-term Gaussians, cutoff radii, and the path with one exp per
// voxel and term (aniso_atom) for atoms whose factor tables could leave double's range. The factor
// tables are in aniso_tables.hpp; the kernel's overview is in scatter.hpp.
#pragma once

#include "isotropic.hpp"

namespace {

// ------------------------------------------------------------------ anisotropic atoms

// An anisotropic atom's term k is amp_k·occ·exp(x_k(d)) with x_k = Σ_m c_km·mono_m(d) over the
// fractional offset d = voxel − atom, mono = (dx², dy², dz², dx·dy, dx·dz, dy·dz) (the reference's
// six coefficients of −½ dᵀQ_k d). No factorisation into per-axis tables holds for a general Q_k,
// so every voxel costs one exp per term. Along a row (dx, dy fixed) x_k is a quadratic in the
// box-relative voxel t: x_k = A_k·(t − t*_k)² + E_k with A_k < 0 and E_k ≤ 0 (Q_k positive
// definite), t*_k and E_k formed per row in double. The voxel term is evaluated in float (in base 2,
// exp2_neg) as A_k·u² + E_k with u = (t − T_k) − φ_k, T_k the integer nearest t*_k (t − T_k is
// exact): both addends are ≤ 0, so the exponent carries a few roundings relative to itself and the
// value an error ≤ ~4u·|x|·e^x ≤ 1e-7 of the term's peak. One exp per voxel and term, vectorised over
// blocks of 8 voxels of a row, is the faster form: the recurrence e(t+1) = e(t)·r(t),
// r(t+1) = r(t)·exp(2A_k) in double (two multiplies a voxel and term, three exps a row and term to
// start it) took 2.1× as long on 3O5R, being serial along rows of ~8 voxels.
constexpr double U_TO_B = 8.0 * PI * PI;

}  // namespace

namespace kernels::density::detail {
// An anisotropic atom's five Gaussians at unit occupancy: term k is amp_k·exp(Σ_m q_km·mono_m(d)),
// q_k the reference's six coefficients of −½ dᵀQ_k d, Q_k = orthᵀ·N_k·orth, N_k = M_k⁻¹,
// M_k = U + b_k/(8π²)·I; N_k is kept (symmetric: 00, 11, 22, 01, 02, 12) for the backward.
struct AnisoTerms {
    double amp[kGaussians];
    double q[kGaussians][6];
    double n[kGaussians][6];
};
}  // namespace kernels::density::detail

namespace {

using kernels::density::detail::AnisoTerms;

// Atom i's effective U (kernels/density/adp.py effective_u): its row of u where aniso, else B/8π² on
// the diagonal; as six doubles U11, U22, U33, U12, U13, U23.
KERNELS_INLINE void effective_u(const Inputs& in, int64_t i, double U[6]) {
    if (in.aniso[i]) {
        for (int c = 0; c < 6; ++c) U[c] = in.u[6 * i + c];
    } else {
        const double ui = static_cast<double>(in.b_iso[i]) / U_TO_B;
        U[0] = U[1] = U[2] = ui;
        U[3] = U[4] = U[5] = 0.0;
    }
}

// The Gaussians of atom i (kernels/density/adp.py term_gaussians at unit occupancy). A term whose
// M_k is not positive definite gets amp 0 (it adds nothing): the Python side refuses such a U
// before the kernel, naming the atom; this only keeps a map finite whatever arrives.
void prepare_terms(const Inputs& in, int64_t i, AnisoTerms& T) {
    double U[6];
    effective_u(in, i, U);
    const double* O = in.g.orth;  // row-major, fractional -> Cartesian
    for (int k = 0; k < NG; ++k) {
        const double beta = static_cast<double>(in.b[NG * i + k]) / U_TO_B;
        const double m00 = U[0] + beta, m11 = U[1] + beta, m22 = U[2] + beta, m01 = U[3], m02 = U[4], m12 = U[5];
        const double c00 = m11 * m22 - m12 * m12, c01 = m02 * m12 - m01 * m22, c02 = m01 * m12 - m02 * m11;
        const double det = m00 * c00 + m01 * c01 + m02 * c02;
        const bool pd = m00 > 0 && m00 * m11 - m01 * m01 > 0 && det > 0 && std::isfinite(det);
        if (!pd) {
            T.amp[k] = 0.0;
            for (int c = 0; c < 6; ++c) T.q[k][c] = T.n[k][c] = 0.0;
            T.q[k][0] = T.q[k][1] = T.q[k][2] = -1.0;  // a harmless shape for a term that adds 0
            continue;
        }
        const double id = 1.0 / det;
        // N = M⁻¹ (adjugate / det), symmetric
        double N[3][3];
        N[0][0] = c00 * id;
        N[0][1] = N[1][0] = c01 * id;
        N[0][2] = N[2][0] = c02 * id;
        N[1][1] = (m00 * m22 - m02 * m02) * id;
        N[1][2] = N[2][1] = (m01 * m02 - m00 * m12) * id;
        N[2][2] = (m00 * m11 - m01 * m01) * id;
        T.amp[k] = static_cast<double>(in.a[NG * i + k]) * std::pow(2.0 * PI, -1.5) / std::sqrt(det);
        // Q = Oᵀ N O
        double NO[3][3], Q[3][3];
        for (int r = 0; r < 3; ++r)
            for (int c = 0; c < 3; ++c) NO[r][c] = N[r][0] * O[c] + N[r][1] * O[3 + c] + N[r][2] * O[6 + c];
        for (int r = 0; r < 3; ++r)
            for (int c = 0; c < 3; ++c) Q[r][c] = O[r] * NO[0][c] + O[3 + r] * NO[1][c] + O[6 + r] * NO[2][c];
        T.q[k][0] = -0.5 * Q[0][0];
        T.q[k][1] = -0.5 * Q[1][1];
        T.q[k][2] = -0.5 * Q[2][2];
        T.q[k][3] = -0.5 * (2 * Q[0][1]);
        T.q[k][4] = -0.5 * (2 * Q[0][2]);
        T.q[k][5] = -0.5 * (2 * Q[1][2]);
        T.n[k][0] = N[0][0];
        T.n[k][1] = N[1][1];
        T.n[k][2] = N[2][2];
        T.n[k][3] = N[0][1];
        T.n[k][4] = N[0][2];
        T.n[k][5] = N[1][2];
    }
}

// Eigenvalues of the symmetric U (U11, U22, U33, U12, U13, U23), ascending (closed form:
// the trigonometric solution of the characteristic cubic).
void sym_eigenvalues(const double U[6], double lam[3]) {
    const double p1 = U[3] * U[3] + U[4] * U[4] + U[5] * U[5];
    if (p1 == 0) {
        lam[0] = U[0], lam[1] = U[1], lam[2] = U[2];
        std::sort(lam, lam + 3);
        return;
    }
    const double q = (U[0] + U[1] + U[2]) / 3.0;
    const double d0 = U[0] - q, d1 = U[1] - q, d2 = U[2] - q;
    const double p = std::sqrt((d0 * d0 + d1 * d1 + d2 * d2 + 2.0 * p1) / 6.0);
    // det((U − qI)/p) / 2
    const double b00 = d0 / p, b11 = d1 / p, b22 = d2 / p, b01 = U[3] / p, b02 = U[4] / p, b12 = U[5] / p;
    const double r = 0.5 * (b00 * (b11 * b22 - b12 * b12) - b01 * (b01 * b22 - b12 * b02) + b02 * (b01 * b12 - b11 * b02));
    const double phi = std::acos(std::min(1.0, std::max(-1.0, r))) / 3.0;
    const double hi = q + 2.0 * p * std::cos(phi);
    const double lo = q + 2.0 * p * std::cos(phi + 2.0 * PI / 3.0);
    lam[0] = lo;
    lam[2] = hi;
    lam[1] = 3.0 * q - hi - lo;
}

// One Gaussian's radius where |amp|·exp(expo·r²) falls to cutoff (radius.py _closed_form: neutrons).
double closed_form_radius(double amp, double expo, double cutoff) {
    const double level = std::log(std::max(std::fabs(amp), 1e-300) / cutoff);
    return level > 0 ? std::sqrt(level / -expo) : 0.0;
}

// Cutoff radius of atom i of an anisotropic set (radius.py atom_cutoff_radii): rule 0 ("gemmi"):
// the isotropic rule at B_max = 8π²·max diag(U); rule 1 ("eigen"): the search along the major axis
// of every M_k. Neutron tables (one Gaussian) in closed form.
double aniso_radius(const Inputs& in, int64_t i, int rule, bool neutron, double cutoff) {
    double U[6], ad[NG], bd[NG], amp[NG], expo[NG];
    effective_u(in, i, U);
    for (int k = 0; k < NG; ++k) {
        ad[k] = in.a[NG * i + k];
        bd[k] = in.b[NG * i + k];
    }
    double start;
    if (rule == 0) {
        start = U_TO_B * std::max(U[0], std::max(U[1], U[2]));
        if (!neutron) return cutoff_radius_one(start, ad, bd, cutoff);
        for (int k = 0; k < NG; ++k) {
            const double w = bd[k] + start;
            amp[k] = ad[k] * std::pow(4.0 * PI / w, 1.5);
            expo[k] = -4.0 * PI * PI / w;
        }
    } else {
        double lam[3];
        sym_eigenvalues(U, lam);
        for (int k = 0; k < NG; ++k) {
            const double beta = bd[k] / U_TO_B;
            const double m0 = lam[0] + beta, m1 = lam[1] + beta, m2 = lam[2] + beta;
            amp[k] = ad[k] * std::pow(2.0 * PI, -1.5) / std::sqrt(m0 * m1 * m2);
            expo[k] = -0.5 / m2;
        }
        start = U_TO_B * lam[2];
        if (!neutron) return cutoff_radius_search(start, amp, expo, cutoff);
    }
    double sum = 0;
    for (int k = 0; k < NG; ++k) sum += amp[k];
    return closed_form_radius(sum, expo[0], cutoff);
}

constexpr double kLog2e = 1.4426950408889634;  // the rows' exponents are kept in base 2 (exp2_neg)

struct AnisoRowK {
    float A[NG], base[NG], phi[NG], E[NG];
};

// Per-atom, per-plane constants of the row constants, term k in lane k of 8 (lanes 5..7 padding):
// for the row at dy, term k's exponent along the row is A_k·(t − t*)² + E_k with
// Bz = bz0 + c5·dy, h = Bz/(2·q_k2), E = cx + c1·dy² + c3x·dy − ½·Bz·h, t* = (−h − dz0)·mz.
struct AnisoPlaneK {
    alignas(64) double bz0[8], c5[8], cx[8], c1[8], c3x[8], ik[8];
};

KERNELS_INLINE void aniso_plane_consts(const double* cq, const double* inv2c2, double dx, AnisoPlaneK& P) {
    for (int k = 0; k < 8; ++k) {
        const double* c = cq + 6 * (k < NG ? k : 0);
        P.bz0[k] = c[4] * dx;
        P.c5[k] = c[5];
        P.cx[k] = c[0] * dx * dx;
        P.c1[k] = c[1];
        P.c3x[k] = c[3] * dx;
        P.ik[k] = inv2c2[k < NG ? k : 0];
    }
}

// Row constants of the row at dy whose first voxel is t_first (box-relative): base_k = t_first − T_k,
// phi_k = t*_k − T_k with T_k the integer nearest t*_k; the five terms side by side in one vector.
KERNELS_INLINE void aniso_row_consts(const AnisoPlaneK& P, const float* Af, double dy, double mz, double dz0,
                                     int64_t t_first, AnisoRowK& R) {
    double E[8], phi[8], base[8];
    const double tf = static_cast<double>(t_first);
    KERNELS_SIMD
    for (int k = 0; k < 8; ++k) {
        const double Bz = P.bz0[k] + P.c5[k] * dy;
        const double h = Bz * P.ik[k];  // −(the row's vertex in dz)
        const double e = (P.cx[k] + P.c1[k] * dy * dy + P.c3x[k] * dy) - 0.5 * Bz * h;  // C − Bz²/(4·q_k2) ≤ 0
        const double tstar = (-h - dz0) * mz;  // box-relative voxel of the row's maximum
        const double T = std::floor(tstar + 0.5);
        E[k] = (e < 0 ? e : 0.0) * kLog2e;
        phi[k] = tstar - T;
        base[k] = tf - T;
    }
    for (int k = 0; k < NG; ++k) {
        R.A[k] = Af[k];
        R.E[k] = static_cast<float>(E[k]);
        R.phi[k] = static_cast<float>(phi[k]);
        R.base[k] = static_cast<float>(base[k]);
    }
}

// 2^y for y ≤ 0 (the anisotropic rows carry their exponents in base 2): y = n + r with n the
// nearest integer (r = y − n is exact, |r| ≤ ½), 2^r = e^{r·ln 2} by its Taylor polynomial of degree 6
// (truncation < 2e-7 relative, rounding a few float ulps: within exp_neg's bound), n clamped as
// exp_neg does (results below 2^-43 are +0). The base-2 form saves exp_neg's multiply by log2(e) and
// its two-step reduction: three of the ~20 operations a voxel and term costs.
KERNELS_INLINE float exp2_neg(float y) {
    const float shifter = 12582912.0f;  // 1.5·2^23: round to nearest
    const float n = (y + shifter) - shifter;
    const float r = y - n;
    float p = 1.5403530393381609e-4f;
    p = p * r + 1.3333558146428443e-3f;
    p = p * r + 9.6181291076284772e-3f;
    p = p * r + 5.5504108664821580e-2f;
    p = p * r + 2.4022650695910071e-1f;
    p = p * r + 6.9314718055994531e-1f;
    p = p * r + 1.0f;
    int32_t ni = static_cast<int32_t>(n);
    ni = ni < -43 ? -127 : ni;  // biased exponent 0: scale = +0
    const int32_t bits = (ni + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

// One voxel of a row: Σ_k c_k·exp(A_k·u² + E_k), u = (t + base_k) − phi_k.
KERNELS_INLINE float aniso_voxel(float t, const AnisoRowK& R, const float* c) {
    float v = 0.0f;
    for (int k = 0; k < NG; ++k) {
        const float u = (t + R.base[k]) - R.phi[k];
        v += c[k] * exp2_neg(R.A[k] * u * u + R.E[k]);
    }
    return v;
}

// aniso_add_row in whole blocks of kW lanes, the lanes past the row's end adding +0.0f (their
// voxels belong to the same map row; callers check that the last block stays inside it): a row
// of ~15 voxels is one vector pass instead of a vector pass plus a scalar epilogue of 5 exps a voxel.
constexpr int64_t kAW = 8;  // lanes per block of the anisotropic rows (see aniso_add_row_w)

KERNELS_INLINE void aniso_add_row_w(float* __restrict o, int64_t n, const AnisoRowK& R, const float* c) {
    for (int64_t b = 0; b < n; b += kAW) {
        float* __restrict ob = o + b;
        const int32_t m = static_cast<int32_t>(n - b);
        const float tb = static_cast<float>(b);
        KERNELS_SIMD
        for (int32_t l = 0; l < static_cast<int32_t>(kAW); ++l) {
            const float v = aniso_voxel(tb + static_cast<float>(l), R, c);
            ob[l] += l < m ? v : 0.0f;
        }
    }
}

// o[l] += Σ_k c_k·exp(A_k·u² + E_k), u = (l + base_k) − phi_k, for l in [0, n)
KERNELS_INLINE void aniso_add_row(float* __restrict o, int64_t n, const AnisoRowK& R, const float* c) {
    const float A0 = R.A[0], A1 = R.A[1], A2 = R.A[2], A3 = R.A[3], A4 = R.A[4];
    const float b0 = R.base[0], b1 = R.base[1], b2 = R.base[2], b3 = R.base[3], b4 = R.base[4];
    const float p0 = R.phi[0], p1 = R.phi[1], p2 = R.phi[2], p3 = R.phi[3], p4 = R.phi[4];
    const float E0 = R.E[0], E1 = R.E[1], E2 = R.E[2], E3 = R.E[3], E4 = R.E[4];
    const float c0 = c[0], c1 = c[1], c2 = c[2], c3 = c[3], c4 = c[4];
    KERNELS_SIMD
    for (int32_t l = 0; l < static_cast<int32_t>(n); ++l) {
        const float t = static_cast<float>(l);
        const float u0 = (t + b0) - p0, u1 = (t + b1) - p1, u2 = (t + b2) - p2, u3 = (t + b3) - p3,
                    u4 = (t + b4) - p4;
        float v = c0 * exp2_neg(A0 * u0 * u0 + E0);
        v += c1 * exp2_neg(A1 * u1 * u1 + E1);
        v += c2 * exp2_neg(A2 * u2 * u2 + E2);
        v += c3 * exp2_neg(A3 * u3 * u3 + E3);
        v += c4 * exp2_neg(A4 * u4 * u4 + E4);
        o[l] += v;
    }
}

// Row sums for the backward: acc[k] += Σ g·e_k, acc[8 + k] += Σ g·e_k·dz, acc[16 + k] += Σ g·e_k·dz²
// over l in [0, n), e_k as in aniso_add_row, dz the fractional z offset of each voxel. Masked: whole
// blocks of kAW lanes with the upstream gradient of the lanes past the row's end taken as 0 (they
// read the same map row and the dz table's padding; callers check that the last block stays inside
// the row), so a row is one vector pass with no scalar epilogue of 5 exps and 15 sums a voxel.
template <bool Masked>
KERNELS_INLINE void aniso_gather_row(const float* __restrict gr, const float* __restrict dz, int64_t n,
                                     const AnisoRowK& R, float acc[24]) {
    const float A0 = R.A[0], A1 = R.A[1], A2 = R.A[2], A3 = R.A[3], A4 = R.A[4];
    const float b0 = R.base[0], b1 = R.base[1], b2 = R.base[2], b3 = R.base[3], b4 = R.base[4];
    const float p0 = R.phi[0], p1 = R.phi[1], p2 = R.phi[2], p3 = R.phi[3], p4 = R.phi[4];
    const float E0 = R.E[0], E1 = R.E[1], E2 = R.E[2], E3 = R.E[3], E4 = R.E[4];
    float s00 = 0, s01 = 0, s02 = 0, s10 = 0, s11 = 0, s12 = 0, s20 = 0, s21 = 0, s22 = 0, s30 = 0, s31 = 0, s32 = 0,
          s40 = 0, s41 = 0, s42 = 0;
    const int32_t nn = static_cast<int32_t>(n);
    // a constant trip count in the masked case: the vectoriser then picks 8-lane vectors, where a
    // trip count it cannot see may get 16-lane ones and leave a row of 8 to the scalar epilogue
    const int32_t step = Masked ? static_cast<int32_t>(kAW) : nn;
    for (int32_t bb = 0; bb < nn; bb += step) {
        const int32_t m = nn - bb;
        const float* __restrict gp = gr + bb;
        const float* __restrict zp = dz + bb;
#if defined(_OPENMP)
#pragma omp simd reduction(+ : s00, s01, s02, s10, s11, s12, s20, s21, s22, s30, s31, s32, s40, s41, s42)
#endif
        for (int32_t l = 0; l < (Masked ? static_cast<int32_t>(kAW) : nn); ++l) {
            const float t = static_cast<float>(bb + l);
            const float g = Masked ? (l < m ? gp[l] : 0.0f) : gp[l], z = zp[l];
            const float gz = g * z, gzz = gz * z;
            const float u0 = (t + b0) - p0, u1 = (t + b1) - p1, u2 = (t + b2) - p2, u3 = (t + b3) - p3,
                        u4 = (t + b4) - p4;
            const float e0 = exp2_neg(A0 * u0 * u0 + E0), e1 = exp2_neg(A1 * u1 * u1 + E1),
                        e2 = exp2_neg(A2 * u2 * u2 + E2), e3 = exp2_neg(A3 * u3 * u3 + E3),
                        e4 = exp2_neg(A4 * u4 * u4 + E4);
            s00 += g * e0;
            s01 += gz * e0;
            s02 += gzz * e0;
            s10 += g * e1;
            s11 += gz * e1;
            s12 += gzz * e1;
            s20 += g * e2;
            s21 += gz * e2;
            s22 += gzz * e2;
            s30 += g * e3;
            s31 += gz * e3;
            s32 += gzz * e3;
            s40 += g * e4;
            s41 += gz * e4;
            s42 += gzz * e4;
        }
    }
    acc[0] += s00, acc[1] += s10, acc[2] += s20, acc[3] += s30, acc[4] += s40;
    acc[8] += s01, acc[9] += s11, acc[10] += s21, acc[11] += s31, acc[12] += s41;
    acc[16] += s02, acc[17] += s12, acc[18] += s22, acc[19] += s32, acc[20] += s42;
}

// Per-atom moments of the backward, per term k: Σ g·e_k·{1, dx, dy, dz, dx², dy², dz², dx·dy, dx·dz, dy·dz}.
struct AnisoSums {
    double m[NG][10];
};

// Sums over the rows of one plane, per term k in lane k of 8 (lanes 5..7 stay 0): Σ r0, Σ dy·r0,
// Σ dy²·r0, Σ r1, Σ dy·r1, Σ r2 of the row sums r0 = Σ g·e_k, r1 = Σ g·e_k·dz, r2 = Σ g·e_k·dz²,
// folded with the plane's dx into AnisoSums once per plane.
struct AnisoPlaneSums {
    alignas(64) double p[6][8];
};

// Rows of anisotropic atom `atom` (prepared in A) over planes [ia, ib]: add its density to `out`
// (Forward) or its moments against `grad` to `gs`. The voxel set is the sphere r² < R² of every
// other path (plane_intervals), the row constants depend on the atom and the row only, so any
// slab partition gives bitwise the same map.
template <bool Forward>
KERNELS_INLINE void aniso_atom(const Inputs& in, const AtomP& A, int64_t atom, int64_t ia, int64_t ib, float* out,
                               const float* grad, Scratch& S, AnisoSums* gs) {
    const Geom& g = in.g;
    const int64_t nx = g.n[0], ny = g.n[1], nz = g.n[2];
    const int64_t ylo = A.lo[1], zlo = A.lo[2];
    const int64_t nyb = A.hi[1] - ylo + 1, nzb = A.hi[2] - zlo + 1;
    double* dyd = S.dyd.data();
    int64_t* jw = S.jw.data();
    int64_t* zw = S.zw.data();
    float* dzf = S.dzf.data();
    const double ylod = static_cast<double>(ylo);
    for (int32_t s = 0; s < static_cast<int32_t>(nyb); ++s) dyd[s] = (ylod + static_cast<double>(s)) / g.m[1] - A.f[1];
    for (int64_t s = 0, w = floor_mod(ylo, ny); s < nyb; ++s, w = w + 1 == ny ? 0 : w + 1) jw[s] = w;
    for (int64_t t = 0, w = floor_mod(zlo, nz); t < nzb; ++t, w = w + 1 == nz ? 0 : w + 1) {
        zw[t] = w;
        if (!Forward) dzf[t] = static_cast<float>(static_cast<double>(zlo + t) / g.m[2] - A.f[2]);
    }
    const AnisoTerms& T = in.terms[atom];
    const double* cq = T.q[0];
    const double* amp = T.amp;
    float cf[NG];
    for (int k = 0; k < NG; ++k) cf[k] = static_cast<float>(amp[k] * A.occ);
    const double dz0 = static_cast<double>(zlo) / g.m[2] - A.f[2];
    double inv2c2[NG];
    float Af[NG];
    for (int k = 0; k < NG; ++k) {
        inv2c2[k] = 1.0 / (2.0 * cq[6 * k + 2]);
        Af[k] = static_cast<float>(cq[6 * k + 2] / (g.m[2] * g.m[2]) * kLog2e);
    }
    int32_t* lo = S.rlo32.data();
    int32_t* hi = S.rhi32.data();
    AnisoRowK R;
    AnisoPlaneK P;
    // the float interval pass (rows it cannot trust settled in double): the same voxel set as the
    // double pass and the reference (see plane_intervals_f)
    RowConstF rcf{};
    float* dyf = S.dyf.data();
    if (g.float_rows) {
        rcf = row_const_f(g, A);
        const int64_t nyp = (nyb + 7) / 8 * 8;
        for (int64_t s = 0; s < nyb; ++s) dyf[s] = static_cast<float>(dyd[s]);
        for (int64_t s = nyb; s < nyp; ++s) dyf[s] = dyf[nyb - 1];
    }
    for (int64_t i = ia; i <= ib; ++i) {
        const double dx = static_cast<double>(i) / g.m[0] - A.f[0];
        const int64_t iw = floor_mod(i, nx);
        if (g.float_rows)
            plane_intervals_f(g, A, rcf, dx, nyb, dyf, dyd, S, lo, hi);
        else
            plane_intervals(g, A, dx, nyb, dyd, S, lo, hi);
        aniso_plane_consts(cq, inv2c2, dx, P);
        AnisoPlaneSums ps;
        if (!Forward) std::memset(&ps, 0, sizeof ps);
        for (int64_t s = 0; s < nyb; ++s) {
            if (lo[s] > hi[s]) continue;
            const double dy = dyd[s];
            const int64_t base = (iw * ny + jw[s]) * nz;
            float acc[24] = {};
            // pieces of the row split where it wraps around the cell along z
            for (int64_t t = lo[s]; t <= hi[s];) {
                const int64_t wz = zw[t];
                const int64_t run = std::min<int64_t>(hi[s] - t + 1, nz - wz);
                aniso_row_consts(P, Af, dy, g.m[2], dz0, t, R);
                if (Forward) {
                    if (wz + (run + kAW - 1) / kAW * kAW <= nz)
                        aniso_add_row_w(out + base + wz, run, R, cf);
                    else
                        aniso_add_row(out + base + wz, run, R, cf);
                } else if (wz + (run + kAW - 1) / kAW * kAW <= nz) {
                    aniso_gather_row<true>(grad + base + wz, dzf + t, run, R, acc);
                } else {
                    aniso_gather_row<false>(grad + base + wz, dzf + t, run, R, acc);
                }
                t += run;
            }
            if (!Forward) {
                const double dyy = dy * dy;
                KERNELS_SIMD
                for (int k = 0; k < 8; ++k) {
                    const double r0 = acc[k], r1 = acc[8 + k], r2 = acc[16 + k];
                    ps.p[0][k] += r0;
                    ps.p[1][k] += dy * r0;
                    ps.p[2][k] += dyy * r0;
                    ps.p[3][k] += r1;
                    ps.p[4][k] += dy * r1;
                    ps.p[5][k] += r2;
                }
            }
        }
        if (!Forward) {
            for (int k = 0; k < NG; ++k) {
                double* m = gs->m[k];
                const double p0 = ps.p[0][k], py = ps.p[1][k], pyy = ps.p[2][k], p1 = ps.p[3][k], py1 = ps.p[4][k],
                             p2 = ps.p[5][k];
                m[0] += p0;
                m[1] += dx * p0;
                m[2] += py;
                m[3] += p1;
                m[4] += dx * dx * p0;
                m[5] += pyy;
                m[6] += p2;
                m[7] += dx * py;
                m[8] += dx * p1;
                m[9] += py1;
            }
        }
    }
}

}  // namespace
