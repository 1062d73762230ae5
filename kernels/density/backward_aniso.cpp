// The backward's gather loop of anisotropic atoms (gather_aniso, scatter.hpp): atoms are independent
// tasks over the same voxels as the forward; each atom's sums are formed by one thread in a fixed
// order, so the gradients are bitwise the same for any number of threads. Its driver is in
// drivers.cpp; the isotropic one is backward.cpp.
// Compiled once per variant (gaussians.hpp: KERNELS_ISA; CMakeLists.txt).
#include "variants.hpp"

#if KERNELS_ISA == 0 || defined(KERNELS_ISA_VARIANTS)

namespace {

// Gradients of anisotropic atoms [first, last). With ρ = occ·Σ_k amp_k·exp(x_k(d)), d = voxel − atom
// (fractional), x_k = Σ_m c_km·mono_m(d) and the moments M_k = Σ g·e_k·(…) of AnisoSums:
//   ∂L/∂amp_k = occ·M_k[1];  ∂L/∂occ = Σ_k amp_k·M_k[1];  ∂L/∂c_km = occ·amp_k·M_k[mono_m];
//   ∂L/∂f = −occ·Σ_k amp_k·Σ (∂x_k/∂d)·g·e_k  (∂x_k/∂d is linear in d: a combination of first moments).
//   and on to U: with Ḡ_k = −½·P_k (P_k the symmetric matrix of ∂L/∂q_k: diagonal q0..q2, off-diagonal
//   q3..q5), ∂L/∂N_k = O·Ḡ_k·Oᵀ, ∂L/∂M_k = −N_k·(∂L/∂N_k)·N_k − ½·amp_k·(∂L/∂amp_k)·N_k
//   (amp ∝ det(M)^−½), ∂L/∂U = Σ_k ∂L/∂M_k; an off-diagonal U_ij appears twice in the symmetric U,
//   so its gradient is 2·(∂L/∂U)_ij; an isotropic atom's B gets trace(∂L/∂U)/8π².
KERNELS_HOT
void gather_aniso_atoms(const Inputs& in, const std::vector<AtomP>& atoms, int64_t first, int64_t last,
                        const float* grad, Scratch& S, double* gfrac, double* gocc, double* gu,
                        double* gb) {
    const double* O = in.g.orth;
    // each atom's moments through the factor tables where they fit (aniso_tables_fit, as the forward
    // decides), else with an exp per voxel and term
    for (int64_t i = first; i < last; ++i) {
        const AtomP& A = atoms[i];
        AnisoSums gs;
        std::memset(&gs, 0, sizeof gs);
        if (A.R2 > 0) {
            if (aniso_tables_fit(in, A, i))
                aniso_atom_tables<false>(in, A, i, A.lo[0], A.hi[0], nullptr, S, grad, &gs);
            else
                aniso_atom<false>(in, A, i, A.lo[0], A.hi[0], nullptr, grad, S, &gs);
        }
        const AnisoTerms& T = in.terms[i];
        double go = 0, gf[3] = {0, 0, 0}, GU[3][3] = {{0, 0, 0}, {0, 0, 0}, {0, 0, 0}};
        for (int k = 0; k < NG; ++k) {
            const double* m = gs.m[k];
            const double* c = T.q[k];
            go += T.amp[k] * m[0];
            const double w = A.occ * T.amp[k];
            if (w == 0) continue;
            gf[0] -= w * (2 * c[0] * m[1] + c[3] * m[2] + c[4] * m[3]);
            gf[1] -= w * (2 * c[1] * m[2] + c[3] * m[1] + c[5] * m[3]);
            gf[2] -= w * (2 * c[2] * m[3] + c[4] * m[1] + c[5] * m[2]);
            // ∂L/∂q_k: w × moments 4..9 (dx², dy², dz², dx·dy, dx·dz, dy·dz); Ḡ = −½·P
            const double P[3][3] = {{m[4], m[7], m[8]}, {m[7], m[5], m[9]}, {m[8], m[9], m[6]}};
            double GQ[3][3], GN[3][3], T1[3][3];
            for (int r = 0; r < 3; ++r)
                for (int cc = 0; cc < 3; ++cc) GQ[r][cc] = -0.5 * w * P[r][cc];
            // ∂L/∂N = O·GQ·Oᵀ
            for (int r = 0; r < 3; ++r)
                for (int cc = 0; cc < 3; ++cc) T1[r][cc] = O[3 * r] * GQ[0][cc] + O[3 * r + 1] * GQ[1][cc] + O[3 * r + 2] * GQ[2][cc];
            for (int r = 0; r < 3; ++r)
                for (int cc = 0; cc < 3; ++cc) GN[r][cc] = T1[r][0] * O[3 * cc] + T1[r][1] * O[3 * cc + 1] + T1[r][2] * O[3 * cc + 2];
            const double* n6 = T.n[k];
            const double N[3][3] = {{n6[0], n6[3], n6[4]}, {n6[3], n6[1], n6[5]}, {n6[4], n6[5], n6[2]}};
            // −N·GN·N − ½·amp·∂L/∂amp·N, ∂L/∂amp_k = occ·M_k[1]
            const double ga = -0.5 * T.amp[k] * A.occ * m[0];
            for (int r = 0; r < 3; ++r)
                for (int cc = 0; cc < 3; ++cc) T1[r][cc] = GN[r][0] * N[0][cc] + GN[r][1] * N[1][cc] + GN[r][2] * N[2][cc];
            for (int r = 0; r < 3; ++r)
                for (int cc = 0; cc < 3; ++cc)
                    GU[r][cc] += -(N[r][0] * T1[0][cc] + N[r][1] * T1[1][cc] + N[r][2] * T1[2][cc]) + ga * N[r][cc];
        }
        gocc[i] = go;
        for (int d = 0; d < 3; ++d) gfrac[3 * i + d] = gf[d];
        double* g6 = gu + 6 * i;
        if (in.aniso[i]) {
            g6[0] = GU[0][0], g6[1] = GU[1][1], g6[2] = GU[2][2];
            g6[3] = GU[0][1] + GU[1][0], g6[4] = GU[0][2] + GU[2][0], g6[5] = GU[1][2] + GU[2][1];
            gb[i] = 0.0;
        } else {
            for (int c = 0; c < 6; ++c) g6[c] = 0.0;
            gb[i] = (GU[0][0] + GU[1][1] + GU[2][2]) / U_TO_B;
        }
    }
}

}  // namespace

namespace kernels::density::detail {

template <>
void gather_aniso_chunk<KERNELS_ISA>(const Inputs& in, const std::vector<AtomP>& atoms, int64_t first,
                                     int64_t last, const float* grad, Scratch& S, double* gfrac, double* gocc,
                                     double* gu, double* gb) {
    gather_aniso_atoms(in, atoms, first, last, grad, S, gfrac, gocc, gu, gb);
}

}  // namespace kernels::density::detail

#endif  // KERNELS_ISA == 0 || defined(KERNELS_ISA_VARIANTS)
