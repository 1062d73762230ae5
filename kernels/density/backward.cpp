// The backward's gather loop of isotropic atoms (gather, scatter.hpp): atoms are independent tasks over
// the same voxels as the forward; each atom's sums are formed by one thread in a fixed order, so the
// gradients are bitwise the same for any number of threads. Its driver is in drivers.cpp, the
// x86-64-v4 variant's 16-lane blocks in backward_wide.cpp, the anisotropic loop in backward_aniso.cpp.
// Compiled once per variant (gaussians.hpp: KERNELS_ISA; CMakeLists.txt).
#include "variants.hpp"

#if KERNELS_ISA == 0 || defined(KERNELS_ISA_VARIANTS)

namespace {

// Gradient sums of atoms [first, last) in 8-lane blocks: every variant's gather, and the x86-64-v4
// variant's where its 16-lane blocks do not apply (backward_wide.cpp).
KERNELS_HOT
void gather_atoms(const Inputs& in, const std::vector<AtomP>& atoms, int64_t first, int64_t last, const float* grad,
                  Scratch& S, RowIntervals* saved, double* gxyz, double* gb, double* gocc) {
    gather_atoms_w<8>(in, atoms, first, last, grad, S, saved, gxyz, gb, gocc);
}

}  // namespace

namespace kernels::density::detail {

template <>
void gather_chunk<KERNELS_ISA>(const Inputs& in, const std::vector<AtomP>& atoms, int64_t first, int64_t last,
                               const float* grad, Scratch& S, bool wide, RowIntervals* saved, double* gxyz,
                               double* gb, double* gocc) {
#if KERNELS_ISA == 4 && defined(KERNELS_WIDE_GATHER)
    if (wide && in.g.n[2] >= 16) {
        gather_chunk_wide(in, atoms, first, last, grad, S, saved, gxyz, gb, gocc);
        return;
    }
#else
    (void)wide;
#endif
    gather_atoms(in, atoms, first, last, grad, S, saved, gxyz, gb, gocc);
}

}  // namespace kernels::density::detail

#endif  // KERNELS_ISA == 0 || defined(KERNELS_ISA_VARIANTS)
