// What the forward and the backward share: the kernel's inputs from the public arrays, every atom's
// preparation, and the forward's partition of the map into x slabs (segments, slab schedule, plan).
// The kernel's overview is in scatter.hpp.
#pragma once

#include "aniso_tables.hpp"

namespace {

// ------------------------------------------------------------------ segments and slabs

}  // namespace

namespace kernels::density::detail {
struct Segment {
    int64_t atom;
    int64_t u0;   // first lattice x of the segment (unwrapped)
    int64_t len;  // planes; xs + len <= nx
};
}  // namespace kernels::density::detail

namespace {

using kernels::density::detail::Segment;

// The segments that reach slab [x0, x1), into `ids` in atom order: found through the x-sorted index
// (a contiguous range, since no segment is longer than lmax).
void slab_segments(int64_t nx, const std::vector<Segment>& segs, const std::vector<int64_t>& by_x,
                   const std::vector<int64_t>& bucket, int64_t lmax, int64_t x0, int64_t x1, std::vector<int64_t>& ids) {
    const int64_t first = bucket[std::max<int64_t>(0, x0 - lmax + 1)];
    const int64_t last = bucket[x1];
    ids.clear();
    for (int64_t p = first; p < last; ++p) {
        const Segment& sg = segs[by_x[p]];
        if (floor_mod(sg.u0, nx) + sg.len > x0) ids.push_back(by_x[p]);
    }
    std::sort(ids.begin(), ids.end());
}

// The planes [ia, ib] of segment sg inside slab [x0, x1), in the segment's unwrapped plane indices.
KERNELS_INLINE void segment_planes(const Segment& sg, int64_t nx, int64_t x0, int64_t x1, int64_t& ia, int64_t& ib) {
    const int64_t xs = floor_mod(sg.u0, nx);
    ia = sg.u0 + std::max<int64_t>(0, x0 - xs);
    ib = sg.u0 + std::min<int64_t>(sg.len, x1 - xs) - 1;
}

// Geometry of anisotropic atom i (position, radius from in.radii, box, occupancy): the box
// spans R·|a*_d|·m_d voxels either side of the centre, as for isotropic atoms.
void prepare_atom_aniso(const Inputs& in, int64_t i, AtomP& A) {
    const Geom& g = in.g;
    const double R = in.radii[i];
    A.R2 = R * R;
    for (int d = 0; d < 3; ++d) {
        A.f[d] = in.frac[3 * i + d];
        const double centre = A.f[d] * g.m[d];
        const double reach = R * g.recip[d] * g.m[d];
        A.lo[d] = static_cast<int64_t>(std::floor(centre - reach));
        A.hi[d] = static_cast<int64_t>(std::ceil(centre + reach));
    }
    A.occ = in.occ[i];
}

void prepare_all(const Inputs& in, std::vector<AtomP>& atoms, int n_threads, int64_t box_max[3]) {
    atoms.resize(in.n_atoms);
    const int64_t per = 256;  // a few tasks per thread even for a small protein
    const int64_t n_tasks = (in.n_atoms + per - 1) / per;
    parallel_for(n_tasks, n_threads, [&](int64_t t, int) {
        for (int64_t i = t * per; i < std::min(in.n_atoms, (t + 1) * per); ++i)
            if (in.u) {
                prepare_atom_aniso(in, i, atoms[i]);
                prepare_terms(in, i, in.terms[i]);
            } else {
                prepare_atom(in.g, in.frac, in.radii, in.cutoff, in.b_iso, in.occ, in.a, in.b, i, atoms[i]);
            }
    });
    box_max[0] = box_max[1] = box_max[2] = 1;
    for (const AtomP& A : atoms)
        for (int d = 0; d < 3; ++d) box_max[d] = std::max(box_max[d], A.hi[d] - A.lo[d] + 1);
}

// Cumulative work fractions at which the slabs of one map end (the last is 1). slabs_per_thread
// > 0: that many slabs of equal work per thread (at one thread too: benchmarks time the cost of
// the edges that way). 0: decreasing sizes, as OpenMP's guided schedule cuts its chunks: each slab
// takes 1/(2·threads) of the work left, down to a smallest slab of 1/(smallest_per_thread·threads).
// Taken in order by whichever thread is free, the first big slabs keep the number of slab edges
// small (each edge splits the atoms that cross it), and the last small ones bound how long a
// thread slowed by another process on its core can keep the others waiting. max_slabs caps the
// count (never below one slab per thread): the schedule is then the first max_slabs slabs of the
// same rule scaled to the whole map, so it still decreases and its last slab is its smallest. (A
// schedule that evens the slabs out until they fit ends on its largest: with four slabs at two
// threads, a thread at half speed on a busy core that takes the last one finishes after the caller
// has done the other three.)
// smallest_per_thread: 16; 2 for anisotropic sets, whose atoms rebuild their factor tables at
// every slab that cuts them (at two threads four slabs of a quarter each, where sixteen small ones
// cost more in tables than they save in waiting).
std::vector<double> slab_fractions(int n_threads, int slabs_per_thread, double smallest_per_thread = 16.0,
                                   int64_t max_slabs = std::numeric_limits<int64_t>::max()) {
    auto equal = [](int n) {
        std::vector<double> e;
        for (int s = 1; s <= n; ++s) e.push_back(static_cast<double>(s) / n);
        return e;
    };
    if (slabs_per_thread > 0) return equal(slabs_per_thread * n_threads);
    if (n_threads <= 1) return {1.0};
    if (max_slabs <= n_threads) return equal(n_threads);
    const double share = 1.0 / (2.0 * n_threads), smallest = 1.0 / (smallest_per_thread * n_threads);
    std::vector<double> ends;
    double done = 0;
    while (1.0 - done > 1e-9) {
        const double left = 1.0 - done;
        const double take = std::max(left * share, smallest);
        done = take >= left - 0.5 * smallest ? 1.0 : done + take;  // no sliver at the end
        ends.push_back(done);
    }
    if (static_cast<int64_t>(ends.size()) > max_slabs) {
        // slab k takes share·(1 − share)^k of the map before scaling; the first max_slabs sum to
        // 1 − (1 − share)^max_slabs
        const double kept = 1.0 - std::pow(1.0 - share, static_cast<double>(max_slabs));
        ends.clear();
        double slab = share / kept, sum = 0;
        for (int64_t k = 0; k < max_slabs; ++k, slab *= 1.0 - share) {
            sum += slab;
            ends.push_back(k + 1 == max_slabs ? 1.0 : sum);
        }
    }
    return static_cast<int64_t>(ends.size()) < n_threads ? equal(n_threads) : ends;  // never fewer slabs than threads
}

// The most slabs one map should be cut into: every slab edge splits the atoms whose boxes cross
// it, and each piece of a split atom repeats the atom's set-up (index and factor tables, row
// constants: about kSplitVoxels box voxels of work, measured on 1AKI and 3WIP at 0.667 Å, where an
// edge cost 4 % and 0.3 % of the forward). Edges are allowed while their estimated cost stays
// within kSplitBudget of the map's work: on a small map a thread slowed by another process costs
// less than the splits that would hedge against it (a 1AKI forward at two threads: two slabs), on a
// large one the decreasing schedule keeps its small last slabs (3WIP: ten).
constexpr double kSplitVoxels = 600.0;
constexpr double kSplitBudget = 0.06;

int64_t max_slabs(const Inputs& in, const std::vector<AtomP>& atoms, int64_t first, int64_t last) {
    const int64_t nx = in.g.n[0];
    double crossings = 0, work = 0;  // Σ planes an edge can fall inside; Σ box voxels
    for (int64_t i = first; i < last; ++i) {
        const AtomP& A = atoms[i];
        if (!(A.R2 > 0)) continue;
        const double planes = static_cast<double>(std::min(A.hi[0] - A.lo[0] + 1, nx));
        crossings += planes - 1;
        work += planes * static_cast<double>(A.hi[1] - A.lo[1] + 1) * static_cast<double>(A.hi[2] - A.lo[2] + 1);
    }
    if (!(work > 0)) return 1;
    const double per_edge = kSplitVoxels * crossings / static_cast<double>(nx) / work;  // fraction of the work
    return 1 + static_cast<int64_t>(std::min(1e6, kSplitBudget / std::max(per_edge, 1e-12)));
}

// One map's forward plan: its atoms' x segments counting-sorted by first plane, and its slabs.
}  // namespace

namespace kernels::density::detail {
struct MapPlan {
    int64_t first_atom = 0, last_atom = 0;  // atoms [first, last) of the atom arrays
    std::vector<Segment> raw;
    std::vector<int64_t> bucket;  // bucket[x] = first segment with xs >= x
    std::vector<int64_t> by_x;    // segment ids counting-sorted by first plane
    std::vector<int64_t> edge;    // slab s is planes [edge[s], edge[s + 1])
    int64_t lmax = 1;
};
}  // namespace kernels::density::detail

namespace {

using kernels::density::detail::MapPlan;

void plan_map(const Inputs& in, const std::vector<AtomP>& atoms, const std::vector<double>& ends, MapPlan& P) {
    const int64_t nx = in.g.n[0];
    P.raw.reserve((P.last_atom - P.first_atom) * 5 / 4 + 8);
    std::vector<int64_t> count(nx + 1, 0);
    std::vector<double> work(nx + 1, 0.0);  // per-plane cost estimate (difference array)
    for (int64_t i = P.first_atom; i < P.last_atom; ++i) {
        const AtomP& A = atoms[i];
        if (!(A.R2 > 0)) continue;
        const double area = static_cast<double>(A.hi[1] - A.lo[1] + 1) * static_cast<double>(A.hi[2] - A.lo[2] + 1);
        for (int64_t u = A.lo[0]; u <= A.hi[0];) {
            const int64_t xs = floor_mod(u, nx);
            const int64_t len = std::min(A.hi[0] - u + 1, nx - xs);
            P.raw.push_back({i, u, len});
            count[xs + 1] += 1;
            work[xs] += area;
            work[xs + len] -= area;
            P.lmax = std::max(P.lmax, len);
            u += len;
        }
    }
    P.bucket.assign(nx + 1, 0);
    for (int64_t x = 0; x < nx; ++x) P.bucket[x + 1] = P.bucket[x] + count[x + 1];
    P.by_x.resize(P.raw.size());
    {
        std::vector<int64_t> fill(P.bucket.begin(), P.bucket.end() - 1);
        for (int64_t id = 0; id < static_cast<int64_t>(P.raw.size()); ++id)
            P.by_x[fill[floor_mod(P.raw[id].u0, nx)]++] = id;
    }
    // Slab edges at the planes where the cumulative estimated work crosses each fraction.
    std::vector<double> fr = ends;
    if (static_cast<int64_t>(fr.size()) > nx) {  // at most one slab per plane
        fr.clear();
        for (int64_t s = 1; s <= nx; ++s) fr.push_back(static_cast<double>(s) / static_cast<double>(nx));
    }
    const int64_t n_slabs = static_cast<int64_t>(fr.size());
    std::vector<double> cum(nx + 1, 0.0);
    double run = 0;
    for (int64_t x = 0; x < nx; ++x) {
        run += work[x];
        cum[x + 1] = cum[x] + run + 1.0;  // +1: every plane costs something, keeps edges distinct
    }
    const double total = cum[nx];
    P.edge.assign(1, 0);
    int64_t x = 0;
    for (int64_t s = 1; s < n_slabs; ++s) {
        const double target = total * fr[s - 1];
        while (x < nx && cum[x + 1] < target) ++x;
        const int64_t e = std::max(P.edge.back() + 1, std::min(x + 1, nx - (n_slabs - s)));
        P.edge.push_back(e);
    }
    P.edge.push_back(nx);
}

// ------------------------------------------------------------------ inputs of the entry points

// The kernel's geometry from the cell and the grid shape: the metric's cross terms pre-doubled
// as the reference forms them, so r² is the reference's bit for bit.
Inputs make_inputs(const kernels::density::CellGeometry& cell, const int64_t shape[3],
                   const kernels::density::AtomArrays& atoms, bool float_rows) {
    if (cell.kind < 0 || cell.kind > 2)
        throw std::invalid_argument("cell kind must be 0 (z separable), 1 (y separable) or 2 (triclinic)");
    Inputs in;
    for (int d = 0; d < 3; ++d) {
        if (shape[d] < 1) throw std::invalid_argument("grid shape must be positive");
        in.g.n[d] = shape[d];
        in.g.m[d] = static_cast<double>(shape[d]);
        in.g.recip[d] = cell.recip[d];
    }
    const double* G = cell.metric;
    in.g.G00 = G[0];
    in.g.G11 = G[4];
    in.g.G22 = G[8];
    in.g.inv2G22 = 0.5 / G[8];
    in.g.G01x2 = 2 * G[1];
    in.g.G02x2 = 2 * G[2];
    in.g.G12x2 = 2 * G[5];
    std::copy(cell.orth, cell.orth + 9, in.g.orth);
    in.g.kind = cell.kind;
    in.g.float_rows = float_rows;
    in.n_atoms = atoms.n;
    in.frac = atoms.frac;
    in.radii = atoms.radii;
    in.cutoff = atoms.cutoff;
    in.b_iso = atoms.b_iso;
    in.occ = atoms.occ;
    in.a = atoms.a;
    in.b = atoms.b;
    in.u = atoms.u_aniso;
    in.aniso = atoms.aniso;
    if ((atoms.u_aniso == nullptr) != (atoms.aniso == nullptr))
        throw std::invalid_argument("anisotropic atoms need both u_aniso and the aniso flags");
    if (atoms.u_aniso && !atoms.radii) throw std::invalid_argument("anisotropic atoms need their cutoff radii");
    return in;
}

int64_t checked_maps(const kernels::density::AtomArrays& atoms, int64_t n_maps) {
    if (n_maps < 1) throw std::invalid_argument("the number of maps must be at least 1");
    if (atoms.n % n_maps != 0) throw std::invalid_argument("the atoms do not split into n_maps equal frames");
    return n_maps;
}

}  // namespace
