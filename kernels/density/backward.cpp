// The backward's gather loop of isotropic atoms (gather, scatter.hpp): atoms are independent tasks over
// the same voxels as the forward; each atom's sums are formed by one thread in a fixed order, so the
// gradients are bitwise the same for any number of threads. Its driver is in drivers.cpp; the
// anisotropic one is backward_aniso.cpp.
// Compiled once per variant (gaussians.hpp: KERNELS_ISA; CMakeLists.txt).
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

}  // namespace

namespace kernels::density::detail {

template <>
void gather_chunk<KERNELS_ISA>(const Inputs& in, const std::vector<AtomP>& atoms, int64_t first, int64_t last,
                               const float* grad, Scratch& S, bool wide, RowIntervals* saved, double* gxyz,
                               double* gb, double* gocc) {
    gather_atoms(in, atoms, first, last, grad, S, wide, saved, gxyz, gb, gocc);
}

}  // namespace kernels::density::detail

#endif  // KERNELS_ISA == 0 || defined(KERNELS_ISA_VARIANTS)
