// The forward's slab kernel of anisotropic atoms (splat, scatter.hpp): a slab adds the atoms that reach
// it, in atom order, each through its factor tables (aniso_tables.hpp) or an exp per voxel
// (anisotropic.hpp). Its driver is in drivers.cpp; the isotropic one is forward.cpp.
// Compiled once per variant (gaussians.hpp: KERNELS_ISA; CMakeLists.txt).
#include "variants.hpp"

#if KERNELS_ISA == 0 || defined(KERNELS_ISA_VARIANTS)

namespace {

// The anisotropic forward of one slab: forward.cpp's run_slab traversal (the same segments in the same
// atom order), each atom through its factor tables or, where those could leave double's range,
// aniso_atom (an exp per voxel).
KERNELS_HOT
void run_slab_aniso(const Inputs& in, const std::vector<AtomP>& atoms, const std::vector<Segment>& segs,
                    const std::vector<int64_t>& by_x, const std::vector<int64_t>& bucket, int64_t lmax, int64_t x0,
                    int64_t x1, float* out, Scratch& S, std::vector<int64_t>& ids) {
    slab_segments(in.g.n[0], segs, by_x, bucket, lmax, x0, x1, ids);
    for (const int64_t id : ids) {
        const Segment& sg = segs[id];
        int64_t ia, ib;
        segment_planes(sg, in.g.n[0], x0, x1, ia, ib);
        const AtomP& A = atoms[sg.atom];
        if (aniso_tables_fit(in, A, sg.atom)) {
            aniso_atom_tables(in, A, sg.atom, ia, ib, out, S);
        } else {
            ++S.exp_visits;
            aniso_atom<true>(in, A, sg.atom, ia, ib, out, nullptr, S, nullptr);
        }
    }
}

}  // namespace

namespace kernels::density::detail {

template <>
void splat_slab_aniso<KERNELS_ISA>(const Inputs& in, const std::vector<AtomP>& atoms, const MapPlan& P, int64_t s,
                                   float* map, Scratch& S, std::vector<int64_t>& ids) {
    run_slab_aniso(in, atoms, P.raw, P.by_x, P.bucket, P.lmax, P.edge[s], P.edge[s + 1], map, S, ids);
}

}  // namespace kernels::density::detail

#endif  // KERNELS_ISA == 0 || defined(KERNELS_ISA_VARIANTS)
