// splat(), gather() and gather_aniso() (scatter.hpp): each runs the compiled variant of its hot loops
// (variants.hpp) that this CPU's instruction set takes.
#include "slabs.hpp"
#include "variants.hpp"

namespace kernels::density {

namespace {

// fn<ISA>(args...) for this CPU's ISA (gaussians.hpp: cpu_isa).
#if defined(KERNELS_ISA_VARIANTS)
#define KERNELS_RUN_VARIANT(fn, ...)                                    \
    (cpu_isa() == 4   ? detail::fn<4>(__VA_ARGS__)                      \
     : cpu_isa() == 3 ? detail::fn<3>(__VA_ARGS__)                      \
                      : detail::fn<0>(__VA_ARGS__))
#else
#define KERNELS_RUN_VARIANT(fn, ...) detail::fn<0>(__VA_ARGS__)
#endif

}  // namespace

Timings splat(const CellGeometry& cell, const int64_t shape[3], const AtomArrays& atoms, float* out,
              const Options& opt, RowIntervals* rows, int64_t n_maps) {
    return KERNELS_RUN_VARIANT(splat_variant, cell, shape, atoms, out, opt, rows, n_maps);
}

Timings gather(const CellGeometry& cell, const int64_t shape[3], const AtomArrays& atoms, const float* grad,
               const Options& opt, RowIntervals* rows, double* gxyz, double* gb_iso, double* gocc, int64_t n_maps) {
    return KERNELS_RUN_VARIANT(gather_variant, cell, shape, atoms, grad, opt, rows, gxyz, gb_iso, gocc, n_maps);
}

Timings gather_aniso(const CellGeometry& cell, const int64_t shape[3], const AtomArrays& atoms, const float* grad,
                     const Options& opt, double* gfrac, double* gocc, double* gu, double* gb_iso, int64_t n_maps) {
    return KERNELS_RUN_VARIANT(gather_aniso_variant, cell, shape, atoms, grad, opt, gfrac, gocc, gu, gb_iso, n_maps);
}

#undef KERNELS_RUN_VARIANT

}  // namespace kernels::density
