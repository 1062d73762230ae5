// The forward (splat, scatter.hpp): every (map, slab) pair is one task; a slab zeroes its planes and
// adds the atoms that reach it, in atom order (isotropic atoms through process_atom, anisotropic ones
// through their factor tables or, where those could leave double's range, an exp per voxel).
// Compiled once per variant (gaussians.hpp: KERNELS_ISA; CMakeLists.txt).
#include "slabs.hpp"
#include "variants.hpp"

#if KERNELS_ISA == 0 || defined(KERNELS_ISA_VARIANTS)

#if defined(__linux__)
#include <sys/mman.h>  // madvise
#endif

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

// The anisotropic forward of one slab: run_slab's traversal (the same segments in the same atom
// order), each atom through aniso_atom.
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

// n_maps maps of in.n_atoms / n_maps atoms each (map m: atoms [m·n, (m+1)·n), written to
// out + m·voxels). Every (map, slab) pair is one task of one parallel loop.
void splat(const Inputs& in_, float* out, int64_t n_maps, int n_threads, int slabs_per_thread, Timings& tm,
           RowIntervals* saved) {
    auto t0 = Clock::now();
    Inputs in = in_;
    std::vector<AnisoTerms> terms(in.u ? in.n_atoms : 0);
    in.terms = terms.data();
    std::vector<AtomP> atoms;
    int64_t box[3];
    prepare_all(in, atoms, n_threads, box);
    if (saved) plan_saved_rows(in.g, atoms, *saved);
    tm.prepare = seconds_since(t0);

    t0 = Clock::now();
    const int64_t per_map = n_maps > 0 ? in.n_atoms / n_maps : 0;
    // One map: slab_fractions (slabs.hpp). Several: each map is cut into equal slabs, enough that
    // there are about 16 tasks per thread in all (a whole map is already a task).
    std::vector<double> ends;
    if (n_maps <= 1 || n_threads <= 1 || slabs_per_thread > 0) {
        ends = slab_fractions(n_threads, slabs_per_thread, in.u ? 2.0 : 16.0,
                              max_slabs(in, atoms, 0, n_maps > 0 ? per_map : 0));
    } else {
        const int64_t k = std::max<int64_t>(1, (16 * n_threads + n_maps - 1) / n_maps);
        for (int64_t s = 1; s <= k; ++s) ends.push_back(static_cast<double>(s) / k);
    }
    std::vector<MapPlan> plans(n_maps);
    for (int64_t m = 0; m < n_maps; ++m) {
        plans[m].first_atom = m * per_map;
        plans[m].last_atom = (m + 1) * per_map;
        plan_map(in, atoms, ends, plans[m]);
    }
    std::vector<std::pair<int64_t, int64_t>> tasks;  // (map, slab)
    for (int64_t m = 0; m < n_maps; ++m)
        for (int64_t s = 0; s + 1 < static_cast<int64_t>(plans[m].edge.size()); ++s) tasks.push_back({m, s});
    std::vector<Scratch> scratch(n_threads);
    std::vector<std::vector<int64_t>> ids(n_threads);
    for (int w = 0; w < n_threads; ++w) {
        size_scratch(scratch[w], box[0], box[1], box[2]);
        ids[w].reserve(per_map / 4 + 16);
    }
    tm.partition = seconds_since(t0);
    tm.tasks = static_cast<int64_t>(tasks.size());

    t0 = Clock::now();
    const int64_t plane = in.g.n[1] * in.g.n[2];
    const int64_t voxels = in.g.n[0] * plane;
#if defined(MADV_HUGEPAGE)
    // A fresh map of tens of MB costs a page fault per 4 KiB on first touch (10-20 ms for
    // 3WIP); asking for transparent huge pages makes that a few hundred faults. Only a hint.
    {
        const uintptr_t huge = uintptr_t(1) << 21;
        const uintptr_t lo = (reinterpret_cast<uintptr_t>(out) + huge - 1) & ~(huge - 1);
        const uintptr_t hi = (reinterpret_cast<uintptr_t>(out) + sizeof(float) * voxels * n_maps) & ~(huge - 1);
        if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
    }
#endif
    parallel_for(tm.tasks, n_threads, [&](int64_t t, int worker) {
        const MapPlan& P = plans[tasks[t].first];
        const int64_t s = tasks[t].second;
        float* map = out + tasks[t].first * voxels;
        // each slab zeroes its own planes first (the map may arrive uninitialised): parallel
        // first touch, and the slab is warm in cache when the atoms are added
        std::memset(map + P.edge[s] * plane, 0, sizeof(float) * (P.edge[s + 1] - P.edge[s]) * plane);
        if (in.u)
            run_slab_aniso(in, atoms, P.raw, P.by_x, P.bucket, P.lmax, P.edge[s], P.edge[s + 1], map, scratch[worker],
                           ids[worker]);
        else
            run_slab(in, atoms, P.raw, P.by_x, P.bucket, P.lmax, P.edge[s], P.edge[s + 1], map, scratch[worker],
                     ids[worker], saved);
    });
    for (const Scratch& S : scratch) tm.exp_visits += S.exp_visits;
    tm.compute = seconds_since(t0);
}

}  // namespace

namespace kernels::density::detail {

template <>
Timings splat_variant<KERNELS_ISA>(const CellGeometry& cell, const int64_t shape[3],
                                   const AtomArrays& atoms, float* out, const Options& opt,
                                   RowIntervals* rows, int64_t n_maps) {
    checked_maps(atoms, n_maps);
    const Inputs in = make_inputs(cell, shape, atoms, opt.float_rows);
    if (rows && in.u) throw std::invalid_argument("row intervals are kept for isotropic atoms only");
    Timings tm;
    if (rows) std::copy(shape, shape + 3, rows->shape);
    ::splat(in, out, n_maps, std::max(1, opt.n_threads), std::clamp(opt.slabs_per_thread, 0, 64), tm, rows);
    return tm;
}

}  // namespace kernels::density::detail

#endif  // KERNELS_ISA == 0 || defined(KERNELS_ISA_VARIANTS)
