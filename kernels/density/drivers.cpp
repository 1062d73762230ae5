// splat(), gather() and gather_aniso() (scatter.hpp): their drivers, compiled once (baseline code: the
// atoms' preparation, the forward's slab plan, the parallel loops), each task run by the hot loops of
// the variant this CPU's instruction set takes (variants.hpp; forward.cpp, forward_aniso.cpp,
// backward.cpp, backward_aniso.cpp).
#include "variants.hpp"

#if defined(__linux__)
#include <sys/mman.h>  // madvise
#endif

namespace {

// detail::fn<ISA> for this CPU's ISA (gaussians.hpp: cpu_isa), as a function pointer.
#if defined(KERNELS_ISA_VARIANTS)
#define KERNELS_VARIANT(fn) \
    (cpu_isa() == 4 ? kernels::density::detail::fn<4> \
     : cpu_isa() == 3 ? kernels::density::detail::fn<3> : kernels::density::detail::fn<0>)
#else
#define KERNELS_VARIANT(fn) kernels::density::detail::fn<0>
#endif

// ------------------------------------------------------------------ forward

// n_maps maps of in.n_atoms / n_maps atoms each (map m: atoms [m·n, (m+1)·n), written to
// out + m·voxels). Every (map, slab) pair is one task of one parallel loop.
template <class SlabFn, class SlabAnisoFn>
void run_splat(SlabFn slab, SlabAnisoFn slab_aniso, const Inputs& in_, float* out, int64_t n_maps, int n_threads,
               int slabs_per_thread, Timings& tm, RowIntervals* saved) {
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
            slab_aniso(in, atoms, P, s, map, scratch[worker], ids[worker]);
        else
            slab(in, atoms, P, s, map, scratch[worker], ids[worker], saved);
    });
    for (const Scratch& S : scratch) tm.exp_visits += S.exp_visits;
    tm.compute = seconds_since(t0);
}

// ------------------------------------------------------------------ backward

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
template <class ChunkFn>
void run_gather(ChunkFn chunk, const Inputs& in, const float* grad, int64_t n_maps, int n_threads, bool wide,
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
        chunk(in, atoms, first, last, g, scratch[worker], wide, saved, gxyz, gb, gocc);
    });
    tm.compute = seconds_since(t0);
}

template <class ChunkFn>
void run_gather_aniso(ChunkFn chunk, const Inputs& in_, const float* grad, int64_t n_maps, int n_threads,
                      double* gfrac, double* gocc, double* gu, double* gb, Timings& tm) {
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
        chunk(in, atoms, first, last, g, scratch[worker], gfrac, gocc, gu, gb);
    });
    tm.compute = seconds_since(t0);
}

}  // namespace

namespace kernels::density {

Timings splat(const CellGeometry& cell, const int64_t shape[3], const AtomArrays& atoms, float* out,
              const Options& opt, RowIntervals* rows, int64_t n_maps) {
    checked_maps(atoms, n_maps);
    const Inputs in = make_inputs(cell, shape, atoms, opt.float_rows);
    if (rows && in.u) throw std::invalid_argument("row intervals are kept for isotropic atoms only");
    Timings tm;
    if (rows) std::copy(shape, shape + 3, rows->shape);
    run_splat(KERNELS_VARIANT(splat_slab), KERNELS_VARIANT(splat_slab_aniso), in, out, n_maps,
              std::max(1, opt.n_threads), std::clamp(opt.slabs_per_thread, 0, 64), tm, rows);
    return tm;
}

Timings gather(const CellGeometry& cell, const int64_t shape[3], const AtomArrays& atoms, const float* grad,
               const Options& opt, RowIntervals* rows, double* gxyz, double* gb_iso, double* gocc, int64_t n_maps) {
    checked_maps(atoms, n_maps);
    const Inputs in = make_inputs(cell, shape, atoms, opt.float_rows);
    if (in.u) throw std::invalid_argument("anisotropic atoms: use gather_aniso");
    if (rows && rows->n_atoms != atoms.n)
        throw std::invalid_argument("the row intervals come from a splat of a different number of atoms");
    Timings tm;
    if (atoms.n > 0)
        run_gather(KERNELS_VARIANT(gather_chunk), in, grad, n_maps, std::max(1, opt.n_threads), opt.lanes != 8, rows,
                   gxyz, gb_iso, gocc, tm);
    return tm;
}

Timings gather_aniso(const CellGeometry& cell, const int64_t shape[3], const AtomArrays& atoms, const float* grad,
                     const Options& opt, double* gfrac, double* gocc, double* gu, double* gb_iso, int64_t n_maps) {
    checked_maps(atoms, n_maps);
    const Inputs in = make_inputs(cell, shape, atoms, opt.float_rows);
    if (!in.u) throw std::invalid_argument("gather_aniso takes anisotropic atoms (u_aniso and aniso)");
    Timings tm;
    if (atoms.n > 0)
        run_gather_aniso(KERNELS_VARIANT(gather_aniso_chunk), in, grad, n_maps, std::max(1, opt.n_threads), gfrac,
                         gocc, gu, gb_iso, tm);
    return tm;
}

}  // namespace kernels::density

#undef KERNELS_VARIANT
