// The hot loops' compiled variants (gaussians.hpp: one per instruction set): forward.cpp defines
// splat_slab, forward_aniso.cpp splat_slab_aniso, backward.cpp gather_chunk (backward_wide.cpp its
// 16-lane blocks) and backward_aniso.cpp gather_aniso_chunk, each compiled once per variant
// (CMakeLists.txt). The drivers of splat(), gather() and gather_aniso() (drivers.cpp, compiled once)
// prepare the atoms, plan the tasks and run them in parallel, each task through the variant this CPU
// takes. Every variant computes the same bits.
#pragma once

#include "slabs.hpp"

namespace kernels::density::detail {

// The forward of slab s of map plan P: adds the isotropic atoms that reach planes
// [P.edge[s], P.edge[s + 1]) of `map` (already zeroed there), in atom order, keeping their row
// intervals in `saved` (or nullptr). ids: the worker's list of segment ids.
template <int Isa>
void splat_slab(const Inputs& in, const std::vector<AtomP>& atoms, const MapPlan& P, int64_t s, float* map,
                Scratch& S, std::vector<int64_t>& ids, RowIntervals* saved);

// The same for an anisotropic set (in.u).
template <int Isa>
void splat_slab_aniso(const Inputs& in, const std::vector<AtomP>& atoms, const MapPlan& P, int64_t s, float* map,
                      Scratch& S, std::vector<int64_t>& ids);

// The gradients of isotropic atoms [first, last) against the upstream map `grad`, written to rows
// first..last-1 of gxyz (3 per atom), gb, gocc. wide: 16-lane blocks where the variant has them.
template <int Isa>
void gather_chunk(const Inputs& in, const std::vector<AtomP>& atoms, int64_t first, int64_t last, const float* grad,
                  Scratch& S, bool wide, RowIntervals* saved, double* gxyz, double* gb, double* gocc);

// The x86-64-v4 variant's gather_chunk in 16-lane blocks (backward_wide.cpp), on grids of at least
// 16 voxels along z; built where the lane blocks are (GCC with __builtin_shufflevector).
#if defined(KERNELS_ISA_VARIANTS) && defined(KERNELS_LANES) && defined(KERNELS_SHUFFLEVECTOR)
#define KERNELS_WIDE_GATHER 1
void gather_chunk_wide(const Inputs& in, const std::vector<AtomP>& atoms, int64_t first, int64_t last,
                       const float* grad, Scratch& S, RowIntervals* saved, double* gxyz, double* gb, double* gocc);
#endif

// The gradients of anisotropic atoms [first, last): gfrac (3 per atom), gocc, gu (6), gb.
template <int Isa>
void gather_aniso_chunk(const Inputs& in, const std::vector<AtomP>& atoms, int64_t first, int64_t last,
                        const float* grad, Scratch& S, double* gfrac, double* gocc, double* gu, double* gb);

// Each variant is an explicit specialisation, defined in its own translation unit.
#define KERNELS_DECLARE_VARIANT(ISA)                                                                               \
    template <>                                                                                                    \
    void splat_slab<ISA>(const Inputs&, const std::vector<AtomP>&, const MapPlan&, int64_t, float*, Scratch&,      \
                         std::vector<int64_t>&, RowIntervals*);                                                    \
    template <>                                                                                                    \
    void splat_slab_aniso<ISA>(const Inputs&, const std::vector<AtomP>&, const MapPlan&, int64_t, float*,          \
                               Scratch&, std::vector<int64_t>&);                                                   \
    template <>                                                                                                    \
    void gather_chunk<ISA>(const Inputs&, const std::vector<AtomP>&, int64_t, int64_t, const float*, Scratch&,      \
                           bool, RowIntervals*, double*, double*, double*);                                        \
    template <>                                                                                                    \
    void gather_aniso_chunk<ISA>(const Inputs&, const std::vector<AtomP>&, int64_t, int64_t, const float*,         \
                                 Scratch&, double*, double*, double*, double*);
KERNELS_DECLARE_VARIANT(0)
KERNELS_DECLARE_VARIANT(3)
KERNELS_DECLARE_VARIANT(4)
#undef KERNELS_DECLARE_VARIANT

}  // namespace kernels::density::detail
