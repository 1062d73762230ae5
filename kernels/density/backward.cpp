// The backward (gather and gather_aniso, scatter.hpp): atoms are independent tasks over the same
// voxels as the forward; each atom's sums are formed by one thread in a fixed order, so the gradients
// are bitwise the same for any number of threads.
// Compiled once per variant (gaussians.hpp: KERNELS_ISA; CMakeLists.txt).
#include "slabs.hpp"
#include "variants.hpp"

#if KERNELS_ISA == 0 || defined(KERNELS_ISA_VARIANTS)

namespace {

// ------------------------------------------------------------------ backward

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

// Gradient sums of atoms [first, last). In the x86-64-v4 variant (and on cells at least 16 voxels
// along z) the lane blocks are 16 wide: 32 vector registers hold the 15 contraction sums, and
// each lane's arithmetic is the same as with 8-lane blocks, so the gradients are too.
// wide = false keeps 8-lane blocks everywhere (Options::lanes = 8: tests compare the two).
KERNELS_HOT
void gather_atoms(const Inputs& in, const std::vector<AtomP>& atoms, int64_t first, int64_t last, const float* grad,
                  Scratch& S, bool wide, RowIntervals* saved, double* gxyz, double* gb, double* gocc) {
#if KERNELS_ISA == 4 && defined(KERNELS_LANES) && defined(KERNELS_SHUFFLEVECTOR)
    if (wide && in.g.n[2] >= 16) {
        gather_atoms_w<16>(in, atoms, first, last, grad, S, saved, gxyz, gb, gocc);
        return;
    }
#else
    (void)wide;
#endif
    gather_atoms_w<8>(in, atoms, first, last, grad, S, saved, gxyz, gb, gocc);
}

// Both backward drivers: every atom prepared, one scratch per worker sized for the largest box.
void prepare_gather(const Inputs& in, int n_threads, std::vector<AtomP>& atoms, std::vector<Scratch>& scratch) {
    int64_t box[3];
    prepare_all(in, atoms, n_threads, box);
    scratch.resize(n_threads);
    for (Scratch& S : scratch) size_scratch(S, box[0], box[1], box[2]);
}

// The atoms of each map in chunks of `per`, one task each (a chunk never spans two maps):
// fn(first, last, upstream map of the chunk's frame, worker). Sets tm.tasks.
template <class F>
void for_atom_chunks(const Inputs& in, const float* grad, int64_t n_maps, int64_t per, int n_threads, Timings& tm,
                     F&& fn) {
    const int64_t per_map = in.n_atoms / n_maps;
    const int64_t chunks = (per_map + per - 1) / per;
    const int64_t voxels = in.g.n[0] * in.g.n[1] * in.g.n[2];
    tm.tasks = chunks * n_maps;
    parallel_for(tm.tasks, n_threads, [&](int64_t t, int worker) {
        const int64_t m = t / chunks, c = t % chunks;
        const int64_t first = m * per_map + c * per;
        fn(first, std::min((m + 1) * per_map, first + per), grad + m * voxels, worker);
    });
}

// n_maps maps as in splat(): atom i reads the upstream map grad + (i / (n_atoms / n_maps))·voxels.
void gather(const Inputs& in, const float* grad, int64_t n_maps, int n_threads, bool wide,
            RowIntervals* saved, double* gxyz, double* gb, double* gocc, Timings& tm) {
    auto t0 = Clock::now();
    std::vector<AtomP> atoms;
    std::vector<Scratch> scratch;
    prepare_gather(in, n_threads, atoms, scratch);
    tm.prepare = seconds_since(t0);
    if (saved)
        for (int64_t i = 0; i < in.n_atoms; ++i) tm.rows_reused += saved->off[i] >= 0;
    t0 = Clock::now();
    for_atom_chunks(in, grad, n_maps, 32, n_threads, tm, [&](int64_t first, int64_t last, const float* g, int worker) {
        gather_atoms(in, atoms, first, last, g, scratch[worker], wide, saved, gxyz, gb, gocc);
    });
    tm.compute = seconds_since(t0);
}

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

void gather_aniso(const Inputs& in_, const float* grad, int64_t n_maps, int n_threads, double* gfrac,
                  double* gocc, double* gu, double* gb, Timings& tm) {
    auto t0 = Clock::now();
    Inputs in = in_;
    std::vector<AnisoTerms> terms(in.n_atoms);
    in.terms = terms.data();
    std::vector<AtomP> atoms;
    std::vector<Scratch> scratch;
    prepare_gather(in, n_threads, atoms, scratch);
    tm.prepare = seconds_since(t0);
    t0 = Clock::now();
    for_atom_chunks(in, grad, n_maps, 16, n_threads, tm, [&](int64_t first, int64_t last, const float* g, int worker) {
        gather_aniso_atoms(in, atoms, first, last, g, scratch[worker], gfrac, gocc, gu, gb);
    });
    tm.compute = seconds_since(t0);
}

}  // namespace

namespace kernels::density::detail {

template <>
Timings gather_variant<KERNELS_ISA>(const CellGeometry& cell, const int64_t shape[3],
                                    const AtomArrays& atoms, const float* grad, const Options& opt,
                                    RowIntervals* rows, double* gxyz, double* gb_iso, double* gocc,
                                    int64_t n_maps) {
    checked_maps(atoms, n_maps);
    const Inputs in = make_inputs(cell, shape, atoms, opt.float_rows);
    if (in.u) throw std::invalid_argument("anisotropic atoms: use gather_aniso");
    if (rows && rows->n_atoms != atoms.n)
        throw std::invalid_argument("the row intervals come from a splat of a different number of atoms");
    Timings tm;
    if (atoms.n > 0)
        ::gather(in, grad, n_maps, std::max(1, opt.n_threads), opt.lanes != 8, rows, gxyz, gb_iso, gocc, tm);
    return tm;
}

template <>
Timings gather_aniso_variant<KERNELS_ISA>(const CellGeometry& cell, const int64_t shape[3],
                                          const AtomArrays& atoms, const float* grad,
                                          const Options& opt, double* gfrac, double* gocc, double* gu,
                                          double* gb_iso, int64_t n_maps) {
    checked_maps(atoms, n_maps);
    const Inputs in = make_inputs(cell, shape, atoms, opt.float_rows);
    if (!in.u) throw std::invalid_argument("gather_aniso takes anisotropic atoms (u_aniso and aniso)");
    Timings tm;
    if (atoms.n > 0) ::gather_aniso(in, grad, n_maps, std::max(1, opt.n_threads), gfrac, gocc, gu, gb_iso, tm);
    return tm;
}

}  // namespace kernels::density::detail

#endif  // KERNELS_ISA == 0 || defined(KERNELS_ISA_VARIANTS)
