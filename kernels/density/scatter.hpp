// Separable Gaussian density splat on a periodic whole-cell grid (and the anisotropic one, from
// per-atom factor tables), its gradient, and gemmi's per-atom cutoff radius (CPU, C++17).
//
// Plain C++17, free of Python: the entry points are declared here, and _scatter.cpp binds them
// (shapes, dtypes and contiguity are checked there). Arrays are C-contiguous and owned by the
// caller; every function writes only its outputs.
//
// Files, by concern:
//   gaussians.hpp     build configuration, exp(x) for x <= 0, cell geometry, gemmi's cutoff radius,
//                     an atom's box and row intervals, scratch, the scalar row loops
//   isotropic.hpp     lane-blocked rows and process_atom: one isotropic atom, forward or backward
//   anisotropic.hpp   anisotropic atoms: effective U, terms, radii, the exp-per-voxel path
//   aniso_tables.hpp  anisotropic atoms through factor tables (forward and backward)
//   slabs.hpp         the inputs, every atom's preparation, the forward's slab schedule
//   thread_pool.hpp   the parallel loop (thread_pool.cpp: torch's OpenMP team or the helper pool)
//   forward.cpp       splat()'s slab kernel (isotropic atoms)   forward_aniso.cpp   anisotropic atoms
//   backward.cpp      gather()'s loop                           backward_aniso.cpp  gather_aniso()'s
//                     (these four compiled once per instruction set: gaussians.hpp, variants.hpp)
//   drivers.cpp       the public splat(), gather(), gather_aniso(): atom preparation, slab plan and
//                     parallel loop, compiled once; each task runs the variant this CPU takes
//   radii.cpp         cutoff radii, fractional(), the U check, build_info()
//   map_buffers.hpp   storage of the maps the binding hands to Python
//
// Forward (splat): every atom's density is built separably from small per-atom tables
// (docs/kernels.md): r² = dᵀGd over the fractional offset d splits into a part over one
// coupled pair of axes and a part over the remaining axis —
//   orthogonal / hexagonal (only G12 couples x,y): 2-D table over (x,y) × 1-D table over z,
//   monoclinic (only G13 couples x,z):              1-D table over y × 2-D table over (x,z),
//   triclinic (all three couple):                   the full exponent per voxel.
// Every factor is exp(−α·q) with q ≥ 0 (a positive-definite form), so nothing overflows.
// The innermost loop runs over the fastest map axis z, over exactly the voxels of the row
// inside the sphere, and adds Σ_k c_k·T_k[z] (5 Gaussians) to the map.
//
// Partitioned scatter: the map is cut into slabs along x (the slowest axis), each slab is
// one task owned by one thread, so no two threads ever write the same voxel (no atomics).
// The x-ranges of the atoms' boxes ("segments", split where they wrap around the cell) are
// counting-sorted by their first x plane; a slab walks only the segments that can reach
// it, in that one global order. Each voxel therefore receives its contributions in the
// same order whatever the number of threads or slabs: results are bitwise reproducible.
//
// Anisotropic atoms (a set with U): no per-axis tables factor a general Gaussian into factors ≤ 1;
// the forward and the backward multiply per-atom factor tables in double (aniso_tables.hpp), atoms
// whose factors could leave double's range take one exp per voxel and term of the quadratic exponent
// along the row (anisotropic.hpp); the sphere, the slabs, the atom order and so the determinism are
// the separable path's.
//
// Backward (gather): for each atom, Σ over its voxels of upstream-gradient × ∂ρ/∂parameter,
// with the same tables and the same voxel set. Atoms are independent tasks; each atom's
// sums are formed by one thread in a fixed order (deterministic for any thread count).
//
// Threads: torch's intra-op OpenMP threads where this module shares torch's OpenMP runtime
// (TorchTeam, thread_pool.cpp), else, and for a while after a team member came late, a pool of std::threads that the
// caller never waits to arrive (HelperPool). Built without OpenMP (macro KERNELS_NO_OPENMP): the
// pool only, and no simd pragmas.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

namespace kernels::density {

constexpr int kGaussians = 5;  // per atom: four IT92 terms + the constant c (width 0)

// The cell as the kernel reads it. kind says which axis stays separable:
// 0 orthogonal or hexagonal (z), 1 monoclinic (y), 2 triclinic (none: full exponent per voxel).
struct CellGeometry {
    double metric[9];  // G = orthᵀ·orth, row-major (Å²)
    double recip[3];   // |a*|, |b*|, |c*| (1/Å)
    double orth[9];    // fractional -> Cartesian, row-major (Å)
    int kind;
};

// One set of atoms. radii == nullptr: each atom's radius comes from `cutoff` (e/Å³) by gemmi's
// rule, as cutoff_radii() computes it.
struct AtomArrays {
    int64_t n = 0;
    const double* frac = nullptr;   // (n, 3) fractional positions
    const double* radii = nullptr;  // (n,) cutoff radii in Å, or nullptr
    double cutoff = 0.0;
    const float* b_iso = nullptr;  // (n,)
    const float* occ = nullptr;    // (n,)
    const float* a = nullptr;      // (n, 5) amplitudes
    const float* b = nullptr;      // (n, 5) widths (Å²)
    // Anisotropic atoms: both set (radii then required), or both nullptr. Every atom then takes the
    // anisotropic kernel with its effective U: its row of u_aniso where aniso[i], else b_iso/8π²·I.
    const float* u_aniso = nullptr;    // (n, 6) U11, U22, U33, U12, U13, U23 (Å², Cartesian)
    const uint8_t* aniso = nullptr;    // (n,) 1: the atom uses its row of u_aniso
};

// How a call runs. Every combination gives bitwise the same map and gradients; the fields past
// n_threads exist so tests can compare the fast paths with the plain ones and benchmarks can
// vary the partition.
struct Options {
    int n_threads = 1;
    int slabs_per_thread = 0;  // forward: 0 slabs of decreasing size (see splat()), k > 0: k equal slabs per thread
    bool float_rows = true;    // lane path: row intervals from the float pass, settled in double
    int lanes = 0;             // backward lane blocks: 0 picks for this CPU (16 with AVX-512), 8 forces 8
};

// What a call did: phase times (s), tasks and two counters. Every call fills it (a few
// clock reads per call, none per atom or slab); the binding returns it as a dict, which
// kernels.density.cpu._plan_hook records: the one profiling hook of the C++ kernels (README, "Development").
struct Timings {
    double prepare = 0, partition = 0, compute = 0;
    int64_t tasks = 0;
    int64_t rows_reused = 0;  // backward: atoms whose row intervals came from the forward
    int64_t exp_visits = 0;   // anisotropic forward: (atom, slab) visits that took the exp per voxel
};

// Row intervals of a forward, kept for the backward of the same inputs: the z interval
// [lo, hi] (box-relative, int16) of every row (x, y) of every lane-path atom, 4 bytes per row.
// An atom's rows start at off[atom] (-1: not kept; the backward solves for them). Every row
// of a kept atom is written by exactly one slab, and its value does not depend on which.
struct RowIntervals {
    std::vector<int64_t> off;
    std::unique_ptr<int16_t[]> lohi;  // uninitialised until the forward's slabs write it
    int64_t n_atoms = 0;
    int64_t n_values = 0;
    int64_t shape[3] = {0, 0, 0};  // the grid of the splat that filled them
    int16_t* at(int64_t i) { return off[i] < 0 ? nullptr : lohi.get() + off[i]; }
};

// Writes the density of `atoms` to `out` (shape[0] x shape[1] x shape[2] float32, C order,
// any previous content overwritten). n_maps > 1: the atoms are n_maps frames of atoms.n / n_maps
// atoms each (frame-major), and out holds n_maps maps, map m the density of frame m alone,
// bitwise what a splat of that frame gives; all maps' slabs are tasks of one parallel loop.
// rows: nullptr, or filled with the row intervals for gather() (isotropic atoms only). Throws
// std::invalid_argument on a bad shape, kind or frame count, std::bad_alloc when out of memory.
//
// An anisotropic set (atoms.u_aniso set) takes every atom through its effective U: per voxel and
// Gaussian term one multiply-add of double factors, walked down each plane's rows from per-atom
// tables (an exp per voxel and term for atoms whose factors could leave double's range; aniso_tables.hpp
// says why), over the same sphere of voxels, slabs and atom order, so it is as deterministic as the
// separable path.
//
// Slabs (x planes of one map, one task each, taken by whichever thread is free): at one
// thread one slab; otherwise, with opt.slabs_per_thread = 0, slabs of decreasing work (1/(2T) of
// what is left, down to 1/(16T) for T threads), so a thread slowed by another process holds the
// others up by at most a small slab; any partition gives bitwise the same map.
Timings splat(const CellGeometry& cell, const int64_t shape[3], const AtomArrays& atoms, float* out,
              const Options& opt, RowIntervals* rows, int64_t n_maps = 1);

// Gradient of sum(grad · splat(atoms)) with respect to xyz (n, 3), b_iso (n,) and occ (n,),
// written as float64. grad: the upstream map (shape, float32, C order; n_maps of them for
// frames as in splat(), each frame's atoms reading their own). rows: nullptr, or the row
// intervals a splat() of the same atoms, grid and n_maps filled.
Timings gather(const CellGeometry& cell, const int64_t shape[3], const AtomArrays& atoms, const float* grad,
               const Options& opt, RowIntervals* rows, double* gxyz, double* gb_iso, double* gocc,
               int64_t n_maps = 1);

// Gradient of sum(grad · splat(atoms)) for an anisotropic set (atoms.u_aniso set) with respect to the
// fractional positions gfrac (n, 3), occ (n,), u_aniso gu (n, 6; zero rows for isotropic atoms) and
// b_iso gb_iso (n,; zero for anisotropic atoms), written as float64 (sums in double). Frames as in gather().
Timings gather_aniso(const CellGeometry& cell, const int64_t shape[3], const AtomArrays& atoms, const float* grad,
                     const Options& opt, double* gfrac, double* gocc, double* gu, double* gb_iso,
                     int64_t n_maps = 1);

// Cutoff radius (Å) of every atom of an anisotropic set (kernels/density/radius.py atom_cutoff_radii):
// rule 0 "gemmi" (the isotropic rule at B_max = 8π²·max diag U), 1 "eigen" (the search along the major
// axis); neutron: one Gaussian, closed form. u_aniso (n, 6), aniso (n,), b_iso (n,), a and b (n, 5).
void cutoff_radii_aniso(int64_t n, const float* u_aniso, const uint8_t* aniso, const float* b_iso, const float* a,
                        const float* b, double cutoff, int rule, bool neutron, int n_threads, double* out);

// Index of the first atom i with aniso[i] whose U (u_aniso row i, float32, as float64) fails Sylvester's
// test — every component finite, U11 > 0, U11·U22 − U12² > 0, det U > 0, each product and difference
// rounded as torch's elementwise ops round them (no fused multiply-add) — or −1 when none does. Serial
// (a few µs per thousand atoms): the per-call check of the CPU backend runs no multi-threaded torch op.
int64_t first_non_positive_definite(int64_t n, const float* u_aniso, const uint8_t* aniso);

// Fractional positions frac·xyz of n atoms (xyz (n, 3) float32 in Å, frac (3, 3) row-major):
// out (n, 3) float64, each as ((x·F0 + y·F1) + z·F2) without fused multiply-adds (torch's float64
// matmul of these shapes rounds the same way). Serial: a few µs per thousand atoms, cheaper than
// waking another thread. Returns whether every coordinate is finite and in [lo, hi).
bool fractional(int64_t n, const float* xyz, const double frac[9], double lo, double hi, double* out);

// Per-atom cutoff radius (Å) where the atom's radial density drops to `cutoff` (e/Å³), by the
// steps of gemmi's DensityCalculator::estimate_radius: b_iso (n,), a and b (n, 5), all float64.
void cutoff_radii(int64_t n, const double* b_iso, const double* a, const double* b, double cutoff, int n_threads,
                  double* out);

// The file of the OpenMP runtime this module calls ("" when built without OpenMP or where it cannot
// be told).
const char* openmp_library();

// Whether that runtime is the one torch's CPU ops run on: only then may the parallel loops run on
// the calling thread's OpenMP team, i.e. on torch's intra-op threads (TorchTeam in thread_pool.cpp).
// Off until the caller has checked; without OpenMP it stays off.
void set_shared_openmp(bool shared);
bool shared_openmp();

// How this build runs on this CPU.
struct BuildInfo {
    const char* threads;  // "std::thread pool, OpenMP" (built with OpenMP) or "std::thread"
    bool clones;          // whether the hot loops have AVX2 / AVX-512 variants (gaussians.hpp)
    const char* forward_isa;
    const char* backward_isa;
};
BuildInfo build_info();

}  // namespace kernels::density
