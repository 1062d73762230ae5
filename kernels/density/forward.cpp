// The forward's slab kernel of isotropic atoms (splat, scatter.hpp): a slab adds the atoms that reach
// it, in atom order, each through process_atom. Its driver is in drivers.cpp; the anisotropic one is
// forward_aniso.cpp.
// Compiled once per variant (gaussians.hpp: KERNELS_ISA; CMakeLists.txt).
#include "variants.hpp"

#if KERNELS_ISA == 0 || defined(KERNELS_ISA_VARIANTS)

namespace {

// One slab [x0, x1) of the map: the segments that reach it are found through the x-sorted
// index (a contiguous range, since no segment is longer than lmax), then run in atom
// order — the one global order every slab uses, and the file's spatial coherence, so
// consecutive atoms touch nearby memory.
KERNELS_HOT
void run_slab(const Inputs& in, const std::vector<AtomP>& atoms, const std::vector<Segment>& segs,
              const std::vector<int64_t>& by_x, const std::vector<int64_t>& bucket, int64_t lmax, int64_t x0,
              int64_t x1, float* out, Scratch& S, std::vector<int64_t>& ids, RowIntervals* saved) {
    slab_segments(in.g.n[0], segs, by_x, bucket, lmax, x0, x1, ids);
    for (const int64_t id : ids) {
        const Segment& sg = segs[id];
        int64_t ia, ib;
        segment_planes(sg, in.g.n[0], x0, x1, ia, ib);
        int16_t* rows = saved ? saved->at(sg.atom) : nullptr;
        process_atom<true>(in.g, atoms[sg.atom], ia, ib, out, nullptr, S, nullptr, rows);
    }
}

}  // namespace

namespace kernels::density::detail {

template <>
void splat_slab<KERNELS_ISA>(const Inputs& in, const std::vector<AtomP>& atoms, const MapPlan& P, int64_t s,
                             float* map, Scratch& S, std::vector<int64_t>& ids, RowIntervals* saved) {
    run_slab(in, atoms, P.raw, P.by_x, P.bucket, P.lmax, P.edge[s], P.edge[s + 1], map, S, ids, saved);
}

}  // namespace kernels::density::detail

#endif  // KERNELS_ISA == 0 || defined(KERNELS_ISA_VARIANTS)
