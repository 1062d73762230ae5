// The x86-64-v4 variant's backward of isotropic atoms in 16-lane blocks (one AVX-512 vector; its 32
// registers hold the 15 contraction sums), which backward.cpp's gather_chunk runs on grids of at least
// 16 voxels along z. Each lane's arithmetic is that of the 8-lane blocks, so the gradients are too.
// Apart from backward.cpp, so that an edit to either compiles one instantiation of the loop in the
// x86-64-v4 unit, not two.
// Compiled once per variant (gaussians.hpp: KERNELS_ISA; CMakeLists.txt); only the x86-64-v4 unit has code.
#include "variants.hpp"

#if KERNELS_ISA == 4 && defined(KERNELS_WIDE_GATHER)

namespace {

KERNELS_HOT
void gather_atoms_wide(const Inputs& in, const std::vector<AtomP>& atoms, int64_t first, int64_t last,
                       const float* grad, Scratch& S, RowIntervals* saved, double* gxyz, double* gb, double* gocc) {
    gather_atoms_w<16>(in, atoms, first, last, grad, S, saved, gxyz, gb, gocc);
}

}  // namespace

namespace kernels::density::detail {

void gather_chunk_wide(const Inputs& in, const std::vector<AtomP>& atoms, int64_t first, int64_t last,
                       const float* grad, Scratch& S, RowIntervals* saved, double* gxyz, double* gb, double* gocc) {
    gather_atoms_wide(in, atoms, first, last, grad, S, saved, gxyz, gb, gocc);
}

}  // namespace kernels::density::detail

#endif  // KERNELS_ISA == 4 && defined(KERNELS_WIDE_GATHER)
