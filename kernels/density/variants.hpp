// The entry points of the hot loops' compiled variants (gaussians.hpp: one per instruction set):
// forward.cpp defines splat_variant and backward.cpp gather_variant and gather_aniso_variant, each
// compiled once per variant (CMakeLists.txt); variants.cpp's splat(), gather() and gather_aniso()
// (scatter.hpp) run the one this CPU takes. Every variant does what the public function says.
#pragma once

#include "scatter.hpp"

namespace kernels::density::detail {

template <int Isa>
Timings splat_variant(const CellGeometry& cell, const int64_t shape[3], const AtomArrays& atoms, float* out,
                      const Options& opt, RowIntervals* rows, int64_t n_maps);

template <int Isa>
Timings gather_variant(const CellGeometry& cell, const int64_t shape[3], const AtomArrays& atoms, const float* grad,
                       const Options& opt, RowIntervals* rows, double* gxyz, double* gb_iso, double* gocc,
                       int64_t n_maps);

template <int Isa>
Timings gather_aniso_variant(const CellGeometry& cell, const int64_t shape[3], const AtomArrays& atoms,
                             const float* grad, const Options& opt, double* gfrac, double* gocc, double* gu,
                             double* gb_iso, int64_t n_maps);

// Each variant is an explicit specialisation, defined in its own translation unit.
#define KERNELS_DECLARE_VARIANT(ISA)                                                                               \
    template <>                                                                                                    \
    Timings splat_variant<ISA>(const CellGeometry&, const int64_t[3], const AtomArrays&, float*, const Options&,   \
                               RowIntervals*, int64_t);                                                            \
    template <>                                                                                                    \
    Timings gather_variant<ISA>(const CellGeometry&, const int64_t[3], const AtomArrays&, const float*,            \
                                const Options&, RowIntervals*, double*, double*, double*, int64_t);                \
    template <>                                                                                                    \
    Timings gather_aniso_variant<ISA>(const CellGeometry&, const int64_t[3], const AtomArrays&, const float*,      \
                                      const Options&, double*, double*, double*, double*, int64_t);
KERNELS_DECLARE_VARIANT(0)
KERNELS_DECLARE_VARIANT(3)
KERNELS_DECLARE_VARIANT(4)
#undef KERNELS_DECLARE_VARIANT

}  // namespace kernels::density::detail
