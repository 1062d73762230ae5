// Separable Gaussian density splat on a periodic whole-cell grid, and its gradient (CPU).
//
// Plain C++17, free of Python: the entry points are declared in scatter.hpp, and _scatter.cpp
// binds them (shapes, dtypes and contiguity are checked there).
//
// Forward (splat): every atom's density is built separably from small per-atom tables
// (KERNELS.md): r² = dᵀGd over the fractional offset d splits into a part over one
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
// the forward and the backward multiply per-atom factor tables in double (see "anisotropic atoms:
// factor tables" below), atoms whose factors could leave double's range take one exp per voxel and
// term of the quadratic exponent along the row (see "anisotropic atoms"); the sphere, the slabs, the
// atom order and so the determinism are the separable path's.
//
// Backward (gather): for each atom, Σ over its voxels of upstream-gradient × ∂ρ/∂parameter,
// with the same tables and the same voxel set. Atoms are independent tasks; each atom's
// sums are formed by one thread in a fixed order (deterministic for any thread count).
//
// Threads: torch's intra-op OpenMP threads where this module shares torch's OpenMP runtime
// (TorchTeam), else, and for a while after a team member came late, a pool of std::threads that the
// caller never waits to arrive (HelperPool). Built without OpenMP (macro KERNELS_NO_OPENMP): the
// pool only, and no simd pragmas.

#include "scatter.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <math.h>  // sqrtf/ceilf/floorf: libstdc++'s std:: float overloads do not inline into the AVX2 clone
#include <cstdint>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <limits>
#include <memory>
#include <new>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>
#ifndef KERNELS_NO_OPENMP
#include <omp.h>
#if defined(__unix__) || defined(__APPLE__)
#include <dlfcn.h>  // dladdr: which OpenMP runtime this module calls
#endif
#endif
#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>  // pthread_atfork
#endif

#if defined(__linux__)
#include <sys/mman.h>
#endif

#if defined(_OPENMP)
#define KERNELS_SIMD _Pragma("omp simd")
#else
#define KERNELS_SIMD
#endif

// The compiler forgets what it knew of pointer p (an empty asm that may change it): keeps a pointer
// stepped in a loop as its own register instead of folded into another's index (see run_slab's blocks).
#if defined(__GNUC__)
#define KERNELS_OPAQUE(p) __asm__("" : "+r"(p))
#else
#define KERNELS_OPAQUE(p) ((void)0)
#endif

// Hot functions get an AVX2+FMA clone next to the baseline one, picked at load time by
// the CPU (GCC function multi-versioning, Linux/x86-64 only). Wheels stay portable: no
// -march=native. A given machine always runs the same clone, so reproducibility holds.
// The forward (run_slab) and the backward (gather_atoms) have an AVX-512 (x86-64-v4) clone as
// well, from the same source; in the backward's the lane blocks are 16 wide (one AVX-512 vector;
// its 32 registers hold the 15 contraction sums). Each lane's arithmetic is the same in every
// clone, so the maps and gradients are bitwise the same whichever clone runs.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define KERNELS_CLONES 1
#define KERNELS_HOT __attribute__((target_clones("arch=x86-64-v3", "default")))
#define KERNELS_HOT_V4 __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define KERNELS_HOT
#define KERNELS_HOT_V4
#endif

// Nothing here reads floating-point exception flags, and GCC's default -ftrapping-math
// stops it from vectorising loops that contain ceil/floor or value selects (the per-row
// interval pass below), so it is turned off for this file.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif

#if defined(__GNUC__)
#define KERNELS_INLINE inline __attribute__((always_inline))
#else
#define KERNELS_INLINE inline
#endif

namespace {

using kernels::density::RowIntervals;
using kernels::density::Timings;

constexpr int NG = kernels::density::kGaussians;
constexpr double PI = 3.14159265358979323846;

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) {
    return std::chrono::duration<double>(Clock::now() - t0).count();
}

// ------------------------------------------------------------------ exp(x) for x <= 0

// exp of a non-positive float, vectorisable (no libm call, no branches).
// Cody–Waite reduction x = n·ln2 + r, |r| ≤ ln2/2, and a degree-7 Taylor polynomial:
// relative error < 3e-7 (a few float ulps; KERNELS.md allows 1e-5). Results below
// 2^-43 ≈ 1e-13 are returned as 0 by clamping the integer exponent (an integer select: a
// float select here stops GCC from vectorising under the default -ftrapping-math). 1e-13
// of a term is far below float resolution of any voxel sum, and the cut keeps products
// of two or three table factors out of the slow denormal range.
KERNELS_INLINE float exp_neg(float x) {
    // round to nearest through the 1.5·2^23 trick (SSE2-vectorisable, no roundps needed)
    const float shifter = 12582912.0f;
    const float n = (x * 1.44269504088896341f + shifter) - shifter;
    const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t ni = static_cast<int32_t>(n);
    ni = ni < -43 ? -127 : ni;  // biased exponent 0: scale = +0
    const int32_t bits = (ni + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

// ------------------------------------------------------------------ geometry

enum Kind { kZSep = 0, kYSep = 1, kTriclinic = 2 };

struct Geom {
    int64_t n[3];      // grid size = sampling (whole cell)
    double m[3];       // the same as doubles
    double G00, G11, G22, G01x2, G02x2, G12x2;  // metric; cross terms pre-doubled as the reference does
    double inv2G22;    // 1 / (2·G33)
    double recip[3];   // |a*|, |b*|, |c*| (row norms of the fractional matrix)
    double orth[9];    // fractional -> Cartesian, row-major
    int kind;
    bool float_rows;   // lane path: row intervals from the float pass (false: the double pass only)
};

// r² exactly as kernels/density/reference.py evaluates it (same operations, same order,
// no fused multiply-add), so a voxel at an exact tie r² == R² lands on the same side.
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((noinline, optimize("fp-contract=off")))
#endif
double r2_exact(const Geom& g, double dx, double dy, double dz) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
    double s = g.G00 * dx * dx;
    s = s + g.G11 * dy * dy;
    s = s + g.G22 * dz * dz;
    s = s + g.G01x2 * dx * dy;
    s = s + g.G02x2 * dx * dz;
    s = s + g.G12x2 * dy * dz;
    return s;
}

// Amplitude of one Gaussian term a·exp(−4π²r²/W) in real space: a·(4π/W)^{3/2}
// (u·√u: std::pow was most of the per-atom preparation's time)
KERNELS_INLINE double term_amplitude(double a, double w) {
    const double u = 4.0 * PI / w;
    return a * (u * std::sqrt(u));
}

KERNELS_INLINE int64_t floor_mod(int64_t a, int64_t n) {
    int64_t r = a % n;
    return r < 0 ? r + n : r;
}

// ------------------------------------------------------------------ cutoff radius (gemmi's rule)

// Port of kernels/density/radius.py (gemmi's DensityCalculator::estimate_radius), one atom
// at a time: the same steps in the same order, so the radii agree to rounding.
// The search itself: ρ(r) = Σ_k amp_k·exp(expo_k·r²), started at gemmi's guess for B.
double cutoff_radius_search(double B, const double* amp, const double* expo, double cutoff);

double cutoff_radius_one(double B, const double* a, const double* b, double cutoff) {
    double amp[NG], expo[NG];
    for (int k = 0; k < NG; ++k) {
        const double w = b[k] + B;
        amp[k] = term_amplitude(a[k], w);
        expo[k] = -4.0 * PI * PI / w;
    }
    return cutoff_radius_search(B, amp, expo, cutoff);
}

double cutoff_radius_search(double B, const double* amp, const double* expo, double cutoff) {
    auto value = [&](double x) {
        double s = 0;
        for (int k = 0; k < NG; ++k) s += amp[k] * std::exp(expo[k] * (x * x));
        return s;
    };
    auto value_slope = [&](double x, double& y, double& dy) {
        y = 0;
        dy = 0;
        for (int k = 0; k < NG; ++k) {
            const double e = amp[k] * std::exp(expo[k] * (x * x));
            y += e;
            dy += 2 * x * expo[k] * e;
        }
    };
    constexpr int kMaxSteps = 80;
    double x1 = (8.5 + 0.075 * B) / (2.4 + 0.0045 * B), y1, dy;
    value_slope(x1, y1, dy);
    for (int s = 0; s < kMaxSteps && dy > 0; ++s) {
        x1 += 1.0;
        value_slope(x1, y1, dy);
    }
    double x2 = x1, y2 = y1;
    bool rose = false;
    if (y1 < cutoff) {
        for (int s = 0; s < kMaxSteps; ++s) {
            x2 = x1;
            y2 = y1;
            x1 -= 0.5;
            value_slope(x1, y1, dy);
            if (dy > 0) {
                rose = true;
                break;
            }
            if (x1 < 0) {
                x1 = 0;
                y1 = value(0.0);
                break;
            }
            if (!(y1 < cutoff)) break;
        }
        if (rose) {
            for (int s = 0; s < 6; ++s) {
                if (dy > 0 && x1 + 0.1 < x2) {
                    x1 += 0.1;
                    value_slope(x1, y1, dy);
                }
            }
            if (y1 < cutoff) return std::max(x1, 0.0);
        }
    } else {
        for (int s = 0; s < kMaxSteps && y2 > cutoff; ++s) {
            x1 = x2;
            y1 = y2;
            x2 += 0.5;
            y2 = value(x2);
        }
    }
    const double denom = y1 - y2;
    const double r = denom == 0 ? x1 : x1 + (x1 - x2) / denom * (cutoff - y1);
    return std::max(r, 0.0);
}

struct AtomP {
    double f[3];       // fractional position
    double R2;         // cutoff radius² (Å²)
    int64_t lo[3];     // box of lattice voxels (inclusive, unwrapped), as the reference
    int64_t hi[3];
    double amp[NG];    // a_k·(4π/W_k)^{3/2}, W_k = b_k + B (unit occupancy)
    double alpha[NG];  // 4π²/W_k
    double width[NG];  // W_k
    double gw[4][NG];  // backward weights amp_k·{1, 1/W_k, α_k, α_k/W_k}
    double occ;
};

// radii: per-atom cutoff radii in Å, or nullptr: each atom's radius from the cutoff level (gemmi's
// rule, cutoff_radius_one). The float32 inputs convert to double exactly.
void prepare_atom(const Geom& g, const double* frac, const double* radii, double cutoff, const float* b_iso,
                  const float* occ, const float* a, const float* b, int64_t i, AtomP& A) {
    double ad[NG], bd[NG];
    for (int k = 0; k < NG; ++k) {
        ad[k] = a[NG * i + k];
        bd[k] = b[NG * i + k];
    }
    const double B = b_iso[i];
    const double R = radii ? radii[i] : cutoff_radius_one(B, ad, bd, cutoff);
    A.R2 = R * R;
    for (int d = 0; d < 3; ++d) {
        A.f[d] = frac[3 * i + d];
        const double centre = A.f[d] * g.m[d];
        const double reach = R * g.recip[d] * g.m[d];
        A.lo[d] = static_cast<int64_t>(std::floor(centre - reach));
        A.hi[d] = static_cast<int64_t>(std::ceil(centre + reach));
    }
    for (int k = 0; k < NG; ++k) {
        const double w = bd[k] + B;
        A.width[k] = w;
        A.amp[k] = term_amplitude(ad[k], w);
        A.alpha[k] = 4.0 * PI * PI / w;
        A.gw[0][k] = A.amp[k];
        A.gw[1][k] = A.amp[k] / w;
        A.gw[2][k] = A.amp[k] * A.alpha[k];
        A.gw[3][k] = A.amp[k] * A.alpha[k] / w;
    }
    A.occ = occ[i];
}

// Grazing rows and ends close to a lattice point: settle each candidate with the exact test.
#if defined(__GNUC__)
__attribute__((noinline))
#endif
bool row_range_exact(const Geom& g, const AtomP& A, double dx, double dy, double wlo, double whi, bool fix_lo,
                     bool fix_hi, int64_t& wa, int64_t& wb) {
    const double fz = A.f[2], mz = g.m[2];
    auto inside = [&](int64_t w) { return r2_exact(g, dx, dy, static_cast<double>(w) / mz - fz) < A.R2; };
    int64_t s = std::max(A.lo[2], static_cast<int64_t>(std::floor(wlo)));
    int64_t e = std::min(A.hi[2], static_cast<int64_t>(std::ceil(whi)));
    if (fix_lo)
        while (s <= e && !inside(s)) ++s;
    if (fix_hi)
        while (e >= s && !inside(e)) --e;
    wa = s;
    wb = e;
    return s <= e;
}

// Voxels along z (lattice coordinates [wa, wb]) of row (dx, dy) with r² < R²; false if none.
// r² = Q + Lz·dz + G33·dz² is a quadratic in dz: the interval comes from its roots, and
// only an end within 1e-6 voxel of a lattice point (or a row that grazes the sphere, where
// the roots are ill-conditioned) is settled with the exact test, so the voxel set is the
// reference's, ties included.
KERNELS_INLINE bool row_range(const Geom& g, const AtomP& A, double dx, double dy, double Q, double Lz, int64_t& wa,
                              int64_t& wb) {
    constexpr double kNear = 1e-6;
    const double disc = Lz * Lz - 4.0 * g.G22 * (Q - A.R2);
    const double scale = Lz * Lz + 4.0 * g.G22 * (std::fabs(Q) + A.R2);
    if (!(disc > -1e-6 * scale)) return false;  // clearly misses the sphere (also R = 0)
    const double wc = (A.f[2] - Lz * g.inv2G22) * g.m[2];
    if (disc < 1e-6 * scale) {
        // grazing: the interval is at most ~1e-3 of the radius wide around the vertex
        const double hw = std::sqrt(std::max(disc, 0.0) + 1e-6 * scale) * g.inv2G22 * g.m[2] + 1.0;
        return row_range_exact(g, A, dx, dy, wc - hw, wc + hw, true, true, wa, wb);
    }
    const double half = std::sqrt(disc) * g.inv2G22 * g.m[2];
    const double wlo = wc - half, whi = wc + half;
    const double cs = std::ceil(wlo - kNear), ce = std::floor(whi + kNear);
    const bool fix_lo = cs - wlo < kNear, fix_hi = whi - ce < kNear;
    if (fix_lo || fix_hi) return row_range_exact(g, A, dx, dy, cs, ce, fix_lo, fix_hi, wa, wb);
    wa = std::max(A.lo[2], static_cast<int64_t>(cs));
    wb = std::min(A.hi[2], static_cast<int64_t>(ce));
    return wa <= wb;
}

// ------------------------------------------------------------------ per-thread scratch

struct Scratch {
    std::vector<float> tab_a;    // 1-D table (z for kZSep, y for kYSep), NG rows
    std::vector<float> tab_b;    // 2-D table over the coupled pair, NG planes
    std::vector<float> tab_r;    // triclinic: one row of full-exponent values, NG rows
    std::vector<double> q;       // quadratic forms before the exp
    std::vector<float> dzf;      // fractional dz per z of the box (backward)
    std::vector<float> dz2f;     // dz² (backward)
    std::vector<double> dzd;     // fractional dz per z of the box (double)
    std::vector<double> dyd;     // fractional dy per y of the box
    std::vector<int64_t> jw;     // wrapped y index per y of the box
    std::vector<int64_t> zw;     // wrapped z index per z of the box
    std::vector<double> rq, rl, rlo, rhi;  // per row of one x plane: Q, Lz, first/last z candidate
    std::vector<int64_t> rst;    // per row: 0 empty, 1 interval ready, 2 settle with the exact test
    // lane-blocked fast path (see process_atom_lanes)
    std::vector<float> lane_tab;  // NG lane tables L_k (zero outside the box), nl lanes each
    std::vector<int32_t> lane_index;  // 0, 1, 2, ...: the forward's lane vectors are loaded from it
    std::vector<float> lane_q;    // lane part of r² (backward)
    std::vector<float> lane_dz;   // fractional dz per lane (backward)
    std::vector<double> lane_dzd;  // the same in double (tables)
    std::vector<float> rowc;      // per row of a plane: 3·NG row coefficients (backward) / NG (forward)
    std::vector<float> aacc;      // 6 per-atom lane accumulators (backward)
    std::vector<int32_t> rlo32, rhi32, rows;  // per row of a plane: first/last lane, non-empty rows
    std::vector<float> dyf;       // float interval pass: dy per row (padded to whole blocks of 8)
    std::vector<int32_t> fix32;   // float interval pass: per row, settle in double
    // anisotropic factor tables (see aniso_atom_tables), double
    std::vector<double> at_l, at_w, at_y, at_r, at_d;  // see aniso_atom_tables
    int64_t exp_visits = 0;  // anisotropic forward: (atom, slab) visits past aniso_tables_fit
};

// exp tables: out[k*len + t] = exp(−alpha_k · q[t]) (vectorised over t), times amp[k] when
// amp is given (the forward's row factors carry the atom's amplitudes × occupancy)
KERNELS_INLINE void exp_table(const AtomP& A, const double* q, int64_t len, float* out, const float* amp = nullptr) {
    for (int k = 0; k < NG; ++k) {
        const double al = A.alpha[k];
        float* o = out + k * len;
        if (amp) {
            const float a = amp[k];
            KERNELS_SIMD
            for (int64_t t = 0; t < len; ++t) o[t] = exp_neg(static_cast<float>(-al * q[t])) * a;
        } else {
            KERNELS_SIMD
            for (int64_t t = 0; t < len; ++t) o[t] = exp_neg(static_cast<float>(-al * q[t]));
        }
    }
}

// o[l] += Σ_k c_k · t_k[l]
KERNELS_INLINE void add_row(float* __restrict o, int64_t n, const float* __restrict t, int64_t stride, const float* c) {
    const float c0 = c[0], c1 = c[1], c2 = c[2], c3 = c[3], c4 = c[4];
    const float* __restrict t0 = t;
    const float* __restrict t1 = t + stride;
    const float* __restrict t2 = t + 2 * stride;
    const float* __restrict t3 = t + 3 * stride;
    const float* __restrict t4 = t + 4 * stride;
    KERNELS_SIMD
    for (int64_t l = 0; l < n; ++l) o[l] += c0 * t0[l] + c1 * t1[l] + c2 * t2[l] + c3 * t3[l] + c4 * t4[l];
}

// Rows are short (a sphere of radius ~4 Å is ~13 voxels across at 0.67 Å): a loop with an
// exact trip count spends more on its epilogues and mispredicted branches than on the
// arithmetic. These versions always process whole blocks of kW lanes and mask the lanes
// past the row's end (their table entries are readable padding, their map voxels belong to
// the same row and receive +0.0f, which changes nothing), so the branch pattern does not
// depend on the row. Used when the block stays inside the row of the map.
constexpr int64_t kW = 16;

KERNELS_INLINE void add_row_w(float* __restrict o, int64_t n, const float* __restrict t, int64_t stride,
                              const float* c) {
    const float c0 = c[0], c1 = c[1], c2 = c[2], c3 = c[3], c4 = c[4];
    for (int64_t b = 0; b < n; b += kW) {
        const float* __restrict t0 = t + b;
        const float* __restrict t1 = t + b + stride;
        const float* __restrict t2 = t + b + 2 * stride;
        const float* __restrict t3 = t + b + 3 * stride;
        const float* __restrict t4 = t + b + 4 * stride;
        float* __restrict ob = o + b;
        const int64_t m = n - b;
        KERNELS_SIMD
        for (int64_t l = 0; l < kW; ++l) {
            const float v = c0 * t0[l] + c1 * t1[l] + c2 * t2[l] + c3 * t3[l] + c4 * t4[l];
            ob[l] += l < m ? v : 0.0f;
        }
    }
}

// Backward over one row: with e_k the row's Gaussian factors (row factor × table) and
// per-Gaussian weights cu[m][k] (amp_k·{1, 1/W_k, α_k, α_k/W_k}·row factor), form per voxel
// u_m = Σ_k cu[m][k]·t_k and accumulate the 7 row sums the gradients need:
// Σg·u0, Σg·u1, Σg·u2, Σg·u2·dz, Σg·u3, Σg·u3·dz, Σg·u3·dz². One pass over the row, 7
// accumulators; Masked: whole kW blocks with the lanes past the row's end zeroed.
template <bool Masked>
KERNELS_INLINE void gather_row(const float* __restrict gr, int64_t n, const float* __restrict t, int64_t stride,
                               const float* __restrict dz, const float* __restrict dz2, const float cu[4][NG],
                               float acc[7]) {
    const float* __restrict t0 = t;
    const float* __restrict t1 = t + stride;
    const float* __restrict t2 = t + 2 * stride;
    const float* __restrict t3 = t + 3 * stride;
    const float* __restrict t4 = t + 4 * stride;
    float a0 = 0, a1 = 0, a2 = 0, a3 = 0, a4 = 0, a5 = 0, a6 = 0;
    const int64_t step = Masked ? kW : n;
    for (int64_t b = 0; b < n; b += step) {
        const int64_t m = n - b;
#if defined(_OPENMP)
#pragma omp simd reduction(+ : a0, a1, a2, a3, a4, a5, a6)
#endif
        for (int64_t l = b; l < b + step; ++l) {
            const float e0 = t0[l], e1 = t1[l], e2 = t2[l], e3 = t3[l], e4 = t4[l];
            const float u0 = cu[0][0] * e0 + cu[0][1] * e1 + cu[0][2] * e2 + cu[0][3] * e3 + cu[0][4] * e4;
            const float u1 = cu[1][0] * e0 + cu[1][1] * e1 + cu[1][2] * e2 + cu[1][3] * e3 + cu[1][4] * e4;
            const float u2 = cu[2][0] * e0 + cu[2][1] * e1 + cu[2][2] * e2 + cu[2][3] * e3 + cu[2][4] * e4;
            const float u3 = cu[3][0] * e0 + cu[3][1] * e1 + cu[3][2] * e2 + cu[3][3] * e3 + cu[3][4] * e4;
            const float gl = Masked ? (l - b < m ? gr[l] : 0.0f) : gr[l];
            const float g2 = gl * u2, g3 = gl * u3;
            a0 += gl * u0;
            a1 += gl * u1;
            a2 += g2;
            a3 += g2 * dz[l];
            a4 += g3;
            a5 += g3 * dz[l];
            a6 += g3 * dz2[l];
        }
    }
    acc[0] += a0;
    acc[1] += a1;
    acc[2] += a2;
    acc[3] += a3;
    acc[4] += a4;
    acc[5] += a5;
    acc[6] += a6;
}

// ------------------------------------------------------------------ lane-blocked rows

// Rows again, the fast way (orthogonal, hexagonal and monoclinic cells, i.e. every cell
// that factors, when the atom's z-range does not wrap around the cell). The voxels of an
// atom's row are addressed as fixed lanes l = 0..nl-1 of the map row, starting at z0 (the
// same z0 for every row of the atom), in blocks of 8. Then
//   - the z-dependent factor of each Gaussian, L_k (1-D z table on orthogonal/hexagonal
//     cells, one plane of the 2-D (x,z) table on monoclinic ones), is one vector per
//     block shared by every row of the plane, and the y-dependent factor R_k is one scalar
//     per row: a voxel costs 5 vector FMAs, nothing else (no per-row table gathers, no
//     exact-length loops);
//   - the backward never reduces a row: per plane it contracts the upstream gradient over
//     the rows into 15 lane vectors Z = Σ_rows {R_k, R_k·dy, R_k·Q_row}·g (15 FMAs per voxel,
//     the only per-voxel work), then per plane folds them with L_k, dx, dz and the lane part
//     of r² into 6 per-atom lane accumulators; the horizontal sums happen once per atom.
//     This works because r² = Q_row(x,y) + q_lane(x,z) exactly on these cells (the one
//     cross term couples the row pair or the lane pair, never a row and a lane axis).
// Blocks that run past the top of the cell (boxes that wrap along z) go lane by lane.
// Lanes outside a row's voxel set are masked to +0 (forward: the map voxel gets +0.0f,
// which changes nothing; backward: the gradient lane is zeroed before any product).
#if defined(__GNUC__)
#define KERNELS_LANES 1
// The helpers below are always inlined into one translation unit: the vector-ABI note
// (-Wpsabi) about passing 32-byte vectors without AVX does not apply.
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
typedef float vf8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));
typedef float vf16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));
typedef double vd8 __attribute__((vector_size(64)));
constexpr int64_t kL = 8;  // lanes per block (and the lane tables' granularity)
// Vectors of W lanes: the backward's blocks are W = 16 lanes wide on CPUs that run the
// x86-64-v4 (AVX-512) clone, 8 (one AVX2 vector) elsewhere.
// GCC (12 and later) builds a splat {x, x, ...} of a value in a register lane by lane inside the clones
// (vmovss + 4 vinsertps + vinsertf128 for 8 floats, vmovd + 3 vpinsrd + vinserti128 for 8
// ints, 16 masked broadcasts for 16 lanes); lane 0 spread by __builtin_shufflevector (GCC 12+,
// clang) is one broadcast, or one broadcast load when the value comes from memory. The shuffle
// is written out where it is used: behind a helper template GCC expands it lane by lane again.
#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define KERNELS_SHUFFLEVECTOR 1
#endif
#endif
template <int W> struct Lanes;
template <> struct Lanes<8> {
    typedef vf8 F;
    typedef vi8 I;
    KERNELS_INLINE static F splat(float x) { return F{x, x, x, x, x, x, x, x}; }
    KERNELS_INLINE static I splat(int32_t x) { return I{x, x, x, x, x, x, x, x}; }
    KERNELS_INLINE static I iota() { return I{0, 1, 2, 3, 4, 5, 6, 7}; }
};
template <> struct Lanes<16> {
    typedef vf16 F;
    typedef vi16 I;
#if defined(KERNELS_SHUFFLEVECTOR)
    KERNELS_INLINE static F splat(float x) {
        const F v = {x};
        return __builtin_shufflevector(v, v, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    }
    KERNELS_INLINE static I splat(int32_t x) {
        const I v = {x};
        return __builtin_shufflevector(v, v, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    }
#else  // (16-lane blocks are not used then: see gather_atoms)
    KERNELS_INLINE static F splat(float x) { return F{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
    KERNELS_INLINE static I splat(int32_t x) { return I{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
#endif
    KERNELS_INLINE static I iota() { return I{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}; }
};

template <class V = vf8, class T = float>
KERNELS_INLINE V vload(const T* p) {
    V v;
    std::memcpy(&v, p, sizeof v);
    return v;
}
template <class V>
KERNELS_INLINE void vstore(float* p, V v) { std::memcpy(p, &v, sizeof v); }
// *p in every lane of 8 (float or int32), as one broadcast load (see KERNELS_SHUFFLEVECTOR)
template <class V = vf8, class T>
KERNELS_INLINE V vsplat_at(const T* p) {
    V v = {};
    std::memcpy(&v, p, sizeof(T));
#if defined(KERNELS_SHUFFLEVECTOR)
    return __builtin_shufflevector(v, v, 0, 0, 0, 0, 0, 0, 0, 0);
#else
    return __builtin_shuffle(v, vi8{});
#endif
}
// n lanes rounded up to whole blocks
KERNELS_INLINE int64_t whole_blocks(int64_t n) { return (n + kL - 1) / kL * kL; }
// lanes [la, lb] of block bb kept, the rest +0
KERNELS_INLINE vf8 vmask(vf8 v, int64_t bb, int32_t la, int32_t lb) {
    // splats written out: scalar operands of vector operators are a GCC extension clang lacks in C++
    // lane index within the block (a constant) against the row's ends moved into the block:
    // no per-call vector of lane indices to build
    const int32_t a = la - static_cast<int32_t>(bb * kL), b = lb - static_cast<int32_t>(bb * kL);
    const vi8 idx = vi8{0, 1, 2, 3, 4, 5, 6, 7};
    const vi8 m = (idx >= Lanes<8>::splat(a)) & (idx <= Lanes<8>::splat(b));
    return reinterpret_cast<vf8>(reinterpret_cast<vi8>(v) & m);
}
// Σ_k c_k · L_k over the block at lane l of the lane tables (L_k at L + k·stride)
KERNELS_INLINE vf8 lane_sum(const vf8* c, const float* L, int64_t stride, int64_t l) {
    return c[0] * vload(L + l) + c[1] * vload(L + stride + l) + c[2] * vload(L + 2 * stride + l) +
           c[3] * vload(L + 3 * stride + l) + c[4] * vload(L + 4 * stride + l);
}
KERNELS_INLINE double vsum(vf8 v) {
    double s = 0;
    for (int l = 0; l < 8; ++l) s += static_cast<double>(v[l]);
    return s;
}
#endif

// Box-relative z range [lo[s], hi[s]] of every row s of the plane at dx (lo > hi: empty):
// exactly the reference's voxel set (see row_range). One vectorised pass over the rows
// gives every interval; only the rare rows flagged there (grazing, or an end within 1e-6
// voxel of a lattice point) are settled with the exact test afterwards, so the scalar
// loop is a scan with an almost never taken branch.
KERNELS_INLINE
void plane_intervals(const Geom& g, const AtomP& A, double dx, int64_t nyb, const double* dyd,
                                    Scratch& S, int32_t* lo, int32_t* hi) {
    int64_t* fix = S.rst.data();
    double* rq = S.rq.data();
    double* rl = S.rl.data();
    const double fz = A.f[2];
    const int64_t zlo = A.lo[2], zhi = A.hi[2];
    {
        const double G00 = g.G00, G11 = g.G11, G22 = g.G22, G01x2 = g.G01x2, G02x2 = g.G02x2, G12x2 = g.G12x2;
        const double inv2 = g.inv2G22, mz = g.m[2], R2 = A.R2;
        const double zlo_d = static_cast<double>(zlo), zhi_d = static_cast<double>(zhi);
        KERNELS_SIMD
        for (int64_t s = 0; s < nyb; ++s) {
            const double dy = dyd[s];
            const double Q = G00 * dx * dx + G11 * dy * dy + G01x2 * dx * dy;
            const double Lz = G02x2 * dx + G12x2 * dy;
            const double disc = Lz * Lz - 4.0 * G22 * (Q - R2);
            const double scale = Lz * Lz + 4.0 * G22 * (std::fabs(Q) + R2);
            const double wc = (fz - Lz * inv2) * mz;
            const double half = std::sqrt(disc) * inv2 * mz;  // NaN when disc < 0: row is then empty
            const double wlo = wc - half, whi = wc + half;
            const double cs = std::ceil(wlo - 1e-6), ce = std::floor(whi + 1e-6);
            const bool hit = disc > -1e-6 * scale;
            const bool care = (disc < 1e-6 * scale) | (cs - wlo < 1e-6) | (whi - ce < 1e-6);
            const double a = cs > zlo_d ? cs : zlo_d, b = ce < zhi_d ? ce : zhi_d;
            const bool ok = hit & !care & (a <= b);
            lo[s] = static_cast<int32_t>((ok ? a : zlo_d + 1.0) - zlo_d);
            hi[s] = static_cast<int32_t>((ok ? b : zlo_d) - zlo_d);
            fix[s] = hit & care;
            rq[s] = Q;
            rl[s] = Lz;
        }
    }
    for (int64_t s = 0; s < nyb; ++s) {
        if (!fix[s]) continue;
        int64_t wa, wb;
        if (row_range(g, A, dx, dyd[s], rq[s], rl[s], wa, wb)) {
            lo[s] = static_cast<int32_t>(wa - zlo);
            hi[s] = static_cast<int32_t>(wb - zlo);
        }
    }
}

// The same intervals from a float pass: 8 rows per AVX2 vector instead of 4, box-relative
// z so the magnitudes stay ~the box size. Every row whose float result cannot be trusted
// is settled in double with row_range (the pass above's own test, then the exact r² test),
// so the voxel set is still exactly the reference's. Error bound (u = 2^-24, one float
// rounding; every per-atom bound below carries a factor ≥ 2 of slack over a first-order
// count of the roundings, FMA contraction or not):
//   - |dx| ≤ dxm, |dy| ≤ dym over the box, so the terms of Q = G00·dx² + G11·dy² + G01x2·dx·dy
//     sum in absolute value to ≤ Smax and those of Lz = G02x2·dx + G12x2·dy to ≤ Lmax; the
//     float disc = Lz² + 4G22·(R² − Q) is within Ed = 32u·(Lmax² + 4G22·(R² + Smax)) of the
//     real one (a count gives ≤ 16u·(...)).
//   - half = k·√disc (k = mz/(2·G22), voxels): |√d' − √d| ≤ |d' − d|/√d' for the computed
//     d' > 0, so half is within k²·Ed/half' + 3u·half' of the real one; Mb = 2·k²·Ed.
//   - the centre wc = c0 − Lz·k (c0 = fz·mz − zlo ∈ [reach, reach+1]) and the ends wc ± half,
//     the shifts by M and the test cs − wlo < M each add a few u of |c0| + k·Lmax + nzb:
//     Ma = 32u·(|c0| + k·Lmax + nzb + 2).
// A row end is trusted only when it lies M = Ma + Mb/half' or more from every lattice point
// (the end and the lattice point next to it then agree with the real root); a row with
// |disc'| ≤ Ed (grazing, or a miss that might be a hit) is settled too. Typical M on
// 0.667 Å grids: 1e-4..1e-3 voxel, so ~0.1 % of the rows go to the double settle.
struct RowConstF {
    float c0, k, zspan, G11, G12x2, c4, R2, Ed, Ma, Mb;
};

KERNELS_INLINE RowConstF row_const_f(const Geom& g, const AtomP& A) {
    constexpr double u = 1.0 / 16777216.0;  // 2^-24
    auto ext = [&](int d) {
        return std::max(std::fabs(static_cast<double>(A.lo[d]) / g.m[d] - A.f[d]),
                        std::fabs(static_cast<double>(A.hi[d]) / g.m[d] - A.f[d]));
    };
    const double dxm = ext(0), dym = ext(1);
    const double Smax = g.G00 * dxm * dxm + g.G11 * dym * dym + std::fabs(g.G01x2) * dxm * dym;
    const double Lmax = std::fabs(g.G02x2) * dxm + std::fabs(g.G12x2) * dym;
    const double k = g.inv2G22 * g.m[2];
    const double c0 = A.f[2] * g.m[2] - static_cast<double>(A.lo[2]);
    const double Ed = 32.0 * u * (Lmax * Lmax + 4.0 * g.G22 * (A.R2 + Smax));
    RowConstF C;
    C.c0 = static_cast<float>(c0);
    C.k = static_cast<float>(k);
    C.zspan = static_cast<float>(A.hi[2] - A.lo[2]);
    C.G11 = static_cast<float>(g.G11);
    C.G12x2 = static_cast<float>(g.G12x2);
    C.c4 = static_cast<float>(4.0 * g.G22);
    C.R2 = static_cast<float>(A.R2);
    C.Ed = static_cast<float>(Ed);
    C.Ma = static_cast<float>(32.0 * u * (std::fabs(c0) + k * Lmax + static_cast<double>(A.hi[2] - A.lo[2] + 1) + 2.0));
    C.Mb = static_cast<float>(2.0 * k * k * Ed);
    return C;
}

// Rows of the plane at dx from the float pass; dyf: dy per row, padded to a multiple of 8.
KERNELS_INLINE
void plane_intervals_f(const Geom& g, const AtomP& A, const RowConstF& C, double dx, int64_t nyb,
                                      const float* dyf, const double* dyd, Scratch& S, int32_t* lo, int32_t* hi) {
    int32_t* fix = S.fix32.data();
    const float A0 = static_cast<float>(g.G00 * dx * dx), B1 = static_cast<float>(g.G01x2 * dx),
                Lx = static_cast<float>(g.G02x2 * dx);
    const float c0 = C.c0, k = C.k, zspan = C.zspan, G11 = C.G11, G12x2 = C.G12x2, c4 = C.c4, R2 = C.R2, Ed = C.Ed,
                Ma = C.Ma, Mb = C.Mb;
    const int64_t nbk = (nyb + 7) / 8;
    for (int64_t bk = 0; bk < nbk; ++bk) {
        const float* dyb = dyf + 8 * bk;
        int32_t* lob = lo + 8 * bk;
        int32_t* hib = hi + 8 * bk;
        int32_t* fixb = fix + 8 * bk;
        KERNELS_SIMD
        for (int l = 0; l < 8; ++l) {
            const float dy = dyb[l];
            const float Q = A0 + dy * (G11 * dy + B1);
            const float Lz = Lx + G12x2 * dy;
            const float disc = Lz * Lz + c4 * (R2 - Q);
            // ternaries and the C float functions, not std::max / std::sqrt(float): those are
            // ordinary functions in libstdc++ that GCC cannot inline into the AVX2 clone
            const float half = sqrtf(disc > 0.0f ? disc : 0.0f) * k;
            const float M = Ma + Mb / (half > 1e-20f ? half : 1e-20f);
            const float wc = c0 - Lz * k;
            const float wlo = wc - half, whi = wc + half;
            const float cs = ceilf(wlo - M), ce = floorf(whi + M);
            const bool hit = disc > -Ed;
            const bool care = (disc <= Ed) | (cs - wlo < M) | (whi - ce < M);
            const float a = cs > 0.0f ? cs : 0.0f, b = ce < zspan ? ce : zspan;
            const bool ok = hit & !care & (a <= b);
            lob[l] = static_cast<int32_t>(ok ? a : 1.0f);
            hib[l] = static_cast<int32_t>(ok ? b : 0.0f);
            fixb[l] = hit & care;
        }
    }
    const int64_t zlo = A.lo[2];
    for (int64_t bk = 0; bk < nbk; ++bk) {
        const int32_t* fixb = fix + 8 * bk;
        int32_t any = 0;
        for (int l = 0; l < 8; ++l) any |= fixb[l];
        if (!any) continue;
        for (int64_t s = 8 * bk; s < std::min(nyb, 8 * bk + 8); ++s) {
            if (!fix[s]) continue;
            const double dy = dyd[s];
            const double Q = g.G00 * dx * dx + g.G11 * dy * dy + g.G01x2 * dx * dy;
            const double Lz = g.G02x2 * dx + g.G12x2 * dy;
            int64_t wa, wb;
            if (row_range(g, A, dx, dy, Q, Lz, wa, wb)) {
                lo[s] = static_cast<int32_t>(wa - zlo);
                hi[s] = static_cast<int32_t>(wb - zlo);
            }
        }
    }
}

#if defined(KERNELS_LANES)
// Lane-blocked forward or backward of atom A over planes [ia, ib]; builds its own tables
// (in lane layout) in the scratch S. z0: map z of lane 0,
// off: lane of box z index 0, nl: lanes (multiple of 8, <= nz); lane l is map z (z0 + l) mod nz.
// rows: this atom's saved row intervals (see RowIntervals) or nullptr — the forward writes
// them there, the backward reads them instead of solving for them again.
template <class Idx, bool Forward, int W>
KERNELS_INLINE void atom_lanes(const Geom& g, const AtomP& A, int64_t ia, int64_t ib, float* out, const float* grad,
                               Scratch& S, const float* ampf, int64_t z0, int64_t off, int64_t nl, int16_t* rows_saved,
                               double* sums) {
    const int64_t nx = g.n[0], ny = g.n[1], nz = g.n[2];
    const int64_t nyb = A.hi[1] - A.lo[1] + 1, nib = ib - ia + 1;
    const bool zsep = g.kind == kZSep;
    const double* dyd = S.dyd.data();
    const int64_t* jw = S.jw.data();
    float* ta = S.tab_a.data();
    float* tb = S.tab_b.data();
    double* q = S.q.data();
    float* lq = S.lane_q.data();
    float* ldz = S.lane_dz.data();
    double* dzl = S.lane_dzd.data();
    int32_t* lo = S.rlo32.data();
    int32_t* hi = S.rhi32.data();
    const int64_t nblk = nl / kL;
    typedef typename Lanes<W>::F VF;
    typedef typename Lanes<W>::I VI;
    // forward: blocks [0, btop) lie below the top of the cell, the rest wrap to z = 0, 1, ...;
    // a block crosses the top only when the wrapped lanes are not aligned to whole blocks
    const bool straddle = z0 + nl > nz && (nz % kL != 0 || z0 % kL != 0);
    // forward: box lane → lane offsets for the per-row bounds, and the lane numbers 0, 1, 2, ...
    const vi8 off_lo = Lanes<8>::splat(static_cast<int32_t>(off) - 1);
    const vi8 off_hi = Lanes<8>::splat(static_cast<int32_t>(off) + 1);
    const int32_t* lane_index = S.lane_index.data();
    const int64_t btop = z0 + nl <= nz ? nblk : (nz - z0) / kL;
    // float interval pass (when this call solves for the intervals): per-atom constants, dy in float
    const bool solve = Forward || !rows_saved;
    const bool fpass = solve && g.float_rows;
    RowConstF rcf{};
    float* dyf = S.dyf.data();
    if (fpass) {
        rcf = row_const_f(g, A);
        const int64_t nyp = (nyb + 7) / 8 * 8;
        for (int64_t s = 0; s < nyb; ++s) dyf[s] = static_cast<float>(dyd[s]);
        for (int64_t s = nyb; s < nyp; ++s) dyf[s] = dyf[nyb - 1];
    }
    // Tables straight in lane layout. Lanes outside the box get the values of their own
    // (outside) z: finite, never inside a row's interval, so they are masked everywhere.
    const int64_t zfirst = A.lo[2] - off;  // unwrapped lattice z of lane 0
    const double zfd = static_cast<double>(zfirst);  // as for dyd in process_atom: an int32 loop vectorises
    for (int32_t l = 0; l < static_cast<int32_t>(nl); ++l) dzl[l] = (zfd + static_cast<double>(l)) / g.m[2] - A.f[2];
    if (!Forward)
        for (int64_t l = 0; l < nl; ++l) ldz[l] = static_cast<float>(dzl[l]);
    const float* L;      // L_k of plane i: L + k*lstride + (i-ia)*lplane
    int64_t lstride, lplane;
    if (zsep) {
        // z factor L_k[l] (the same for every plane), row factor R_k over (x,y)
        float* Lz = S.lane_tab.data();
        for (int64_t l = 0; l < nl; ++l) q[l] = g.G22 * dzl[l] * dzl[l];
        if (!Forward)
            for (int64_t l = 0; l < nl; ++l) lq[l] = static_cast<float>(q[l]);
        exp_table(A, q, nl, Lz);
        for (int64_t i = ia; i <= ib; ++i) {
            const double dx = static_cast<double>(i) / g.m[0] - A.f[0];
            double* qi = q + (i - ia) * nyb;
            for (int64_t s = 0; s < nyb; ++s)
                qi[s] = g.G00 * dx * dx + g.G11 * dyd[s] * dyd[s] + g.G01x2 * dx * dyd[s];
        }
        exp_table(A, q, nib * nyb, tb, Forward ? ampf : nullptr);  // tb[k*nib*nyb + (i-ia)*nyb + s]
        L = Lz;
        lstride = nl;
        lplane = 0;
    } else {
        // row factor R_k over y, lane factor L_k over (x,z)
        for (int64_t s = 0; s < nyb; ++s) q[s] = g.G11 * dyd[s] * dyd[s];
        exp_table(A, q, nyb, ta, Forward ? ampf : nullptr);  // ta[k*nyb + s]
        for (int64_t i = ia; i <= ib; ++i) {
            const double dx = static_cast<double>(i) / g.m[0] - A.f[0];
            double* qi = q + (i - ia) * nl;
            for (int64_t l = 0; l < nl; ++l)
                qi[l] = g.G00 * dx * dx + g.G22 * dzl[l] * dzl[l] + g.G02x2 * dx * dzl[l];
        }
        if (!Forward)
            for (int64_t t = 0; t < nib * nl; ++t) lq[t] = static_cast<float>(q[t]);
        exp_table(A, q, nib * nl, tb);  // tb[k*nib*nl + (i-ia)*nl + l]
        L = tb;
        lstride = nib * nl;
        lplane = nl;
    }
    float w[4][NG];
    float* aacc = S.aacc.data();  // 6 accumulators × nl: occ, b1, dx, dy, dz, b3
    if (!Forward) {
        for (int m = 0; m < 4; ++m)
            for (int k = 0; k < NG; ++k) w[m][k] = static_cast<float>(A.gw[m][k]);
        std::fill(aacc, aacc + 6 * nl, 0.0f);
    }
    for (int64_t i = ia; i <= ib; ++i) {
        const double dx = static_cast<double>(i) / g.m[0] - A.f[0];
        const Idx iw = static_cast<Idx>(floor_mod(i, nx));
        int16_t* sv = rows_saved ? rows_saved + 2 * (i - A.lo[0]) * nyb : nullptr;
        if (fpass)
            plane_intervals_f(g, A, rcf, dx, nyb, dyf, dyd, S, lo, hi);
        else if (solve)
            plane_intervals(g, A, dx, nyb, dyd, S, lo, hi);
        if (sv) {
            if (Forward) {
                for (int64_t s = 0; s < nyb; ++s) {
                    sv[2 * s] = static_cast<int16_t>(lo[s]);
                    sv[2 * s + 1] = static_cast<int16_t>(hi[s]);
                }
            } else {
                for (int64_t s = 0; s < nyb; ++s) {
                    lo[s] = sv[2 * s];
                    hi[s] = sv[2 * s + 1];
                }
            }
        }
        const float* Lp = L + (i - ia) * lplane;  // this plane's L_k: Lp[k*lstride + l]
        const float* lqp = lq + (zsep ? 0 : (i - ia) * nl);
        // row factor R_k of row s: Rp[k * rstride + s] (in the forward, with amp·occ in it: see exp_table)
        const float* Rp = zsep ? tb + (i - ia) * nyb : ta;
        const int64_t rstride = zsep ? nib * nyb : nyb;
        if (Forward) {
            // The row factors already carry amp·occ: a row's 5 coefficients are broadcasts.
            // Blocks below the top of the cell are one run of the map row from lane z0; blocks
            // at or past it (boxes that wrap along z, aligned so that no block crosses the top)
            // are the same run moved down by nz.
            float* op = out + static_cast<Idx>(iw) * static_cast<Idx>(ny) * static_cast<Idx>(nz);
            for (int64_t s = 0; s < nyb; ++s) {
                if (lo[s] > hi[s]) continue;
                vf8 c[NG];
                for (int k = 0; k < NG; ++k) c[k] = vsplat_at(Rp + k * rstride + s);
                const int32_t la = static_cast<int32_t>(lo[s] + off), lb = static_cast<int32_t>(hi[s] + off);
                float* o = op + static_cast<Idx>(jw[s]) * static_cast<Idx>(nz);
                const int64_t b0 = static_cast<uint32_t>(la) / kL, b1 = static_cast<uint32_t>(lb) / kL;
                if (straddle) {  // the block that crosses the top of the cell goes lane by lane
                    for (int64_t bb = b0; bb <= b1; ++bb) {
                        const vf8 add = vmask(lane_sum(c, Lp, lstride, bb * kL), bb, la, lb);
                        const int64_t zb = z0 + bb * kL < nz ? z0 + bb * kL : z0 + bb * kL - nz;
                        if (zb + kL <= nz)
                            vstore(o + zb, vload(o + zb) + add);
                        else
                            for (int l = 0; l < kL; ++l) o[zb + l < nz ? zb + l : zb + l - nz] += add[l];
                    }
                    continue;
                }
                // la − 1 and lb + 1 in every lane (broadcast loads, see vsplat_at)
                const vi8 lo1 = vsplat_at<vi8>(lo + s) + off_lo, hi1 = vsplat_at<vi8>(hi + s) + off_hi;
                // blocks [bf, bl] of the row, the first one at map z zf
                // The map and table pointers are stepped as their own registers so the compiler keeps
                // simple addressing: folded into one index register, the map's load-add-store and the
                // five table loads would all take base + index addresses. The empty asm hides each
                // pointer's relation to the others.
                auto run = [&](int64_t bf, int64_t bl, int64_t zf) {
                    vi8 lane = vload<vi8>(lane_index + bf * kL);  // lanes bf·kL, bf·kL + 1, ...
                    float* ob = o + zf;
                    const float* lt = Lp + bf * kL;  // this block's lanes of the L_k tables
                    for (int64_t bb = bf; bb <= bl; ++bb, ob += kL, lt += kL) {
                        KERNELS_OPAQUE(lt);
                        const vf8 v = lane_sum(c, lt, lstride, 0);
                        const vi8 m = (lane > lo1) & (hi1 > lane);  // lanes [la, lb]; the rest +0
                        vstore(ob, vload(ob) + reinterpret_cast<vf8>(reinterpret_cast<vi8>(v) & m));
                        lane += vi8{kL, kL, kL, kL, kL, kL, kL, kL};
                        KERNELS_OPAQUE(ob);
                    }
                };
                if (b0 < btop) run(b0, std::min(b1, btop - 1), z0 + b0 * kL);
                if (b1 >= btop) run(std::max(b0, btop), b1, z0 + std::max(b0, btop) * kL - nz);
            }
        } else {
            // rows that have voxels, with their 15 coefficients R_k, R_k·dy, R_k·Q_row
            float* rc = S.rowc.data();
            int32_t* rows = S.rows.data();
            int64_t nr = 0;
            for (int64_t s = 0; s < nyb; ++s) {
                if (lo[s] > hi[s]) continue;
                const double dy = dyd[s];
                const double Qr = zsep ? q[(i - ia) * nyb + s] : g.G11 * dy * dy;
                float* r = rc + 3 * NG * nr;
                for (int k = 0; k < NG; ++k) {
                    const float e = Rp[k * rstride + s];
                    r[k] = e;
                    r[NG + k] = static_cast<float>(e * dy);
                    r[2 * NG + k] = static_cast<float>(e * Qr);
                }
                rows[nr++] = static_cast<int32_t>(s);
            }
            if (nr == 0) continue;
            const float dxf = static_cast<float>(dx);
            // blocks of W lanes (nl is a multiple of W here, see process_atom)
            for (int64_t bb = 0; bb < nl / W; ++bb) {
                const int64_t l0 = bb * W;  // first lane of the block
                VF z[3 * NG];
                for (int qn = 0; qn < 3 * NG; ++qn) z[qn] = Lanes<W>::splat(0.0f);
                const int64_t zb = z0 + l0 < nz ? z0 + l0 : z0 + l0 - nz;  // blocks past the top wrap
                for (int64_t r = 0; r < nr; ++r) {
                    const int64_t s = rows[r];
                    const float* gp = grad + (iw * static_cast<Idx>(ny) + static_cast<Idx>(jw[s])) *
                                                 static_cast<Idx>(nz);
                    VF graw;
                    if (zb + W <= nz) {
                        graw = vload<VF>(gp + zb);
                    } else {  // lanes past the top of the cell wrap to z = 0, 1, ...
                        for (int l = 0; l < W; ++l) graw[l] = gp[zb + l < nz ? zb + l : zb + l - nz];
                    }
                    const int32_t la = static_cast<int32_t>(lo[s] + off), lb = static_cast<int32_t>(hi[s] + off);
                    VF gv;
                    if constexpr (W == 8) {
                        gv = vmask(graw, bb, la, lb);
                    } else {
                        // lanes [la, lb] kept: outside, (lane − la) or (lb − lane) is negative, and the
                        // arithmetic shift spreads the sign of their OR (integer operations only: GCC
                        // turns 16-lane vector compares into per-lane selects)
                        const VI lane = Lanes<W>::iota() + Lanes<W>::splat(static_cast<int32_t>(l0));
                        const VI out = ((lane - Lanes<W>::splat(la)) | (Lanes<W>::splat(lb) - lane)) >> 31;
                        gv = reinterpret_cast<VF>(reinterpret_cast<VI>(graw) & ~out);
                    }
                    const float* cr = rc + 3 * NG * r;
#pragma GCC unroll 15
                    for (int qn = 0; qn < 3 * NG; ++qn) z[qn] += Lanes<W>::splat(cr[qn]) * gv;
                }
                VF ao = Lanes<W>::splat(0.0f), ab1 = ao, u2 = ao, ady = ao, ab3 = ao;
                const VF lqv = vload<VF>(lqp + l0);
                for (int k = 0; k < NG; ++k) {
                    const VF Lk = vload<VF>(Lp + k * lstride + l0);
                    const VF V = Lk * z[k];
                    ao += Lanes<W>::splat(w[0][k]) * V;
                    ab1 += Lanes<W>::splat(w[1][k]) * V;
                    u2 += Lanes<W>::splat(w[2][k]) * V;
                    ady += Lanes<W>::splat(w[2][k]) * (Lk * z[NG + k]);
                    ab3 += Lanes<W>::splat(w[3][k]) * (Lk * z[2 * NG + k] + lqv * V);
                }
                float* a = aacc + l0;
                vstore(a, vload<VF>(a) + ao);
                vstore(a + nl, vload<VF>(a + nl) + ab1);
                vstore(a + 2 * nl, vload<VF>(a + 2 * nl) + Lanes<W>::splat(dxf) * u2);
                vstore(a + 3 * nl, vload<VF>(a + 3 * nl) + ady);
                vstore(a + 4 * nl, vload<VF>(a + 4 * nl) + vload<VF>(ldz + l0) * u2);
                vstore(a + 5 * nl, vload<VF>(a + 5 * nl) + ab3);
            }
        }
    }
    if (!Forward)
        for (int m = 0; m < 6; ++m) {
            double s = 0;
            for (int64_t bb = 0; bb < nblk; ++bb) s += vsum(vload(aacc + m * nl + bb * kL));
            sums[m] = s;
        }
}
#endif

// Whether atom A takes the lane-blocked path: the cell factors and its box is not longer
// than the cell along z. A function of the atom alone, so every slab, thread count and
// the backward decide alike.
KERNELS_INLINE bool lane_path(const Geom& g, const AtomP& A) {
#if defined(KERNELS_LANES)
    const int64_t nzb = A.hi[2] - A.lo[2] + 1;
    return g.kind != kTriclinic && whole_blocks(nzb) <= g.n[2];
#else
    (void)g;
    (void)A;
    return false;
#endif
}

// Row intervals of the forward, kept for the backward (RowIntervals, scatter.hpp) when the
// caller will differentiate: about 10 MB for 3WIP at 0.667 Å. The backward then skips the
// double precision roots, which are a quarter of its time.
bool saveable(const Geom& g, const AtomP& A) {
    return A.R2 > 0 && lane_path(g, A) && A.hi[2] - A.lo[2] + 1 <= 32767;
}

void plan_saved_rows(const Geom& g, const std::vector<AtomP>& atoms, RowIntervals& sr) {
    sr.n_atoms = static_cast<int64_t>(atoms.size());
    sr.off.assign(atoms.size(), -1);
    int64_t total = 0;
    for (size_t i = 0; i < atoms.size(); ++i) {
        const AtomP& A = atoms[i];
        if (!saveable(g, A)) continue;
        sr.off[i] = total;
        total += 2 * (A.hi[0] - A.lo[0] + 1) * (A.hi[1] - A.lo[1] + 1);
    }
    sr.n_values = total;
    sr.lohi.reset(new int16_t[std::max<int64_t>(total, 1)]);
}

// Per-atom gradient sums over its voxels of g·e_k·(1, dx, dy, dz, r²), e_k = exp(−α_k r²).
// Per-atom gradient sums (double): Σg·u0 (→ occ), Σg·u1 and Σg·u3·r² (→ B), Σg·u2·d (→ xyz).
struct GradSums {
    double occ, b1, b3, d[3];
};

// Visit every row (i, j) of atom A with i in [ia, ib] (lattice), build the tables and
// either add its density to `out` (Forward) or gather gradient sums from `grad` (backward).
template <class Idx, bool Forward, int W = 8>
KERNELS_INLINE void process_atom(const Geom& g, const AtomP& A, int64_t ia, int64_t ib, float* out, const float* grad,
                  Scratch& S, GradSums* gs, int16_t* rows_saved) {
    const int64_t nx = g.n[0], ny = g.n[1], nz = g.n[2];
    const int64_t ylo = A.lo[1], zlo = A.lo[2];
    const int64_t nyb = A.hi[1] - ylo + 1, nzb = A.hi[2] - zlo + 1, nib = ib - ia + 1;
    const double fx = A.f[0], fy = A.f[1], fz = A.f[2];

    double* dyd = S.dyd.data();
    double* dzd = S.dzd.data();
    int64_t* jw = S.jw.data();
    // the same values as static_cast<double>(ylo + s) (integers, exact in double), written so the
    // loop vectorises: an int64 → double conversion needs AVX-512, an int32 one does not
    const double ylod = static_cast<double>(ylo);
    for (int32_t s = 0; s < static_cast<int32_t>(nyb); ++s) dyd[s] = (ylod + static_cast<double>(s)) / g.m[1] - fy;
    // wrapped indices by stepping (one division per atom and axis, not one per voxel index)
    for (int64_t s = 0, w = floor_mod(ylo, ny); s < nyb; ++s, w = w + 1 == ny ? 0 : w + 1) jw[s] = w;
#if defined(KERNELS_LANES)
    // Lane-blocked path when the cell factors and the atom's box is not longer than the cell
    // along z (decided per atom, so every slab and thread count takes the same path for it).
    // Lane l is map z = (z0 + l) mod nz (nl <= nz, so no two lanes of a row are the same voxel).
    {
        int64_t nl = whole_blocks(nzb);
        const int64_t zs = floor_mod(zlo, nz);  // map z of the box's first voxel
        if (lane_path(g, A)) {
            // Lane 0 at the box's first voxel; if the lanes would run past the top of the cell but
            // the box itself does not, slide them down so no block wraps. In the forward, a box that
            // wraps around the cell along z starts its lanes at a multiple of kL below it when nz is
            // one too: then every block is one aligned run of a row, below the top or wrapped whole
            // to z = 0, 1, ... (one block more at most, cheaper than a block that goes lane by lane).
            // Otherwise, and in the backward (where the extra block costs more than the wrap), the
            // block that crosses the top goes lane by lane.
            int64_t z0 = zs;
            if (zs + nzb <= nz) {
                if (zs + nl > nz) z0 = nz - nl;
            } else if (Forward && nz % kL == 0 && whole_blocks(nzb + zs % kL) <= nz) {
                z0 = zs - zs % kL;
                nl = whole_blocks(nzb + zs % kL);
            }
            double sums[6];
            float ampf[NG];
            for (int k = 0; k < NG; ++k) ampf[k] = static_cast<float>(A.amp[k] * A.occ);
            // the backward's blocks of 16 lanes: whole blocks over the box's lanes (the extra
            // lanes are outside every row, so masked; lanes past the top of the cell wrap)
            if (!Forward && W == 16) nl = (nl + 15) / 16 * 16;
            atom_lanes<Idx, Forward, W>(g, A, ia, ib, out, grad, S, ampf, z0, zs - z0, nl, rows_saved, sums);
            if (!Forward) {
                gs->occ += sums[0];
                gs->b1 += sums[1];
                gs->d[0] += sums[2];
                gs->d[1] += sums[3];
                gs->d[2] += sums[4];
                gs->b3 += sums[5];
            }
            return;
        }
    }
#endif
    int64_t* zw = S.zw.data();
    for (int64_t t = 0, w = floor_mod(zlo, nz); t < nzb; ++t, w = w + 1 == nz ? 0 : w + 1) {
        dzd[t] = static_cast<double>(zlo + t) / g.m[2] - fz;
        zw[t] = w;
    }
    if (!Forward) {
        for (int64_t t = 0; t < nzb; ++t) {
            S.dzf[t] = static_cast<float>(dzd[t]);
            S.dz2f[t] = static_cast<float>(dzd[t] * dzd[t]);
        }
    }
    float* ta = S.tab_a.data();
    float* tb = S.tab_b.data();
    double* q = S.q.data();
    // Tables. Vectorised loops run over the full box extent of their inner axis, so a
    // value never depends on where a slab boundary clips the atom (reproducibility).
    if (g.kind == kZSep) {
        for (int64_t t = 0; t < nzb; ++t) q[t] = g.G22 * dzd[t] * dzd[t];
        exp_table(A, q, nzb, ta);  // ta[k*nzb + t]
        for (int64_t i = ia; i <= ib; ++i) {
            const double dx = static_cast<double>(i) / g.m[0] - fx;
            double* qi = q + (i - ia) * nyb;
            for (int64_t s = 0; s < nyb; ++s)
                qi[s] = g.G00 * dx * dx + g.G11 * dyd[s] * dyd[s] + g.G01x2 * dx * dyd[s];
        }
        exp_table(A, q, nib * nyb, tb);  // tb[k*nib*nyb + (i-ia)*nyb + s]
    } else if (g.kind == kYSep) {
        for (int64_t s = 0; s < nyb; ++s) q[s] = g.G11 * dyd[s] * dyd[s];
        exp_table(A, q, nyb, ta);  // ta[k*nyb + s]
        for (int64_t i = ia; i <= ib; ++i) {
            const double dx = static_cast<double>(i) / g.m[0] - fx;
            double* qi = q + (i - ia) * nzb;
            for (int64_t t = 0; t < nzb; ++t)
                qi[t] = g.G00 * dx * dx + g.G22 * dzd[t] * dzd[t] + g.G02x2 * dx * dzd[t];
        }
        exp_table(A, q, nib * nzb, tb);  // tb[k*nib*nzb + (i-ia)*nzb + t]
    }

    float ampf[NG];
    for (int k = 0; k < NG; ++k) ampf[k] = static_cast<float>(A.amp[k] * A.occ);
    const int64_t plane_b = g.kind == kZSep ? nib * nyb : nib * nzb;

    for (int64_t i = ia; i <= ib; ++i) {
        const double dx = static_cast<double>(i) / g.m[0] - fx;
        const Idx iw = static_cast<Idx>(floor_mod(i, nx));
        // z-intervals of all rows of this x plane at once (vectorised over y); rows that
        // need care (grazing, an end near a lattice point) go through the exact row_range.
        double* rq = S.rq.data();
        double* rl = S.rl.data();
        double* rlo = S.rlo.data();
        double* rhi = S.rhi.data();
        int64_t* rst = S.rst.data();
        {
            const double G00 = g.G00, G11 = g.G11, G22 = g.G22, G01x2 = g.G01x2, G02x2 = g.G02x2, G12x2 = g.G12x2;
            const double inv2 = g.inv2G22, mz = g.m[2], R2 = A.R2;
            KERNELS_SIMD
            for (int64_t s = 0; s < nyb; ++s) {
                const double dy = dyd[s];
                const double Q = G00 * dx * dx + G11 * dy * dy + G01x2 * dx * dy;
                const double Lz = G02x2 * dx + G12x2 * dy;
                const double disc = Lz * Lz - 4.0 * G22 * (Q - R2);
                const double scale = Lz * Lz + 4.0 * G22 * (std::fabs(Q) + R2);
                const double wc = (fz - Lz * inv2) * mz;
                const double half = std::sqrt(disc) * inv2 * mz;  // NaN when disc < 0: row is then empty
                const double wlo = wc - half, whi = wc + half;
                const double cs = std::ceil(wlo - 1e-6), ce = std::floor(whi + 1e-6);
                const int64_t hit = disc > -1e-6 * scale;
                const int64_t care = (disc < 1e-6 * scale) | (cs - wlo < 1e-6) | (whi - ce < 1e-6);
                rq[s] = Q;
                rl[s] = Lz;
                rlo[s] = cs;
                rhi[s] = ce;
                rst[s] = hit * (1 + care);
            }
        }
        for (int64_t s = 0; s < nyb; ++s) {
            if (rst[s] == 0) continue;
            const double dy = dyd[s];
            const double Q = rq[s], Lz = rl[s];
            int64_t wa, wb;
            if (rst[s] == 2) {
                if (!row_range(g, A, dx, dy, Q, Lz, wa, wb)) continue;
            } else {
                wa = std::max(zlo, static_cast<int64_t>(rlo[s]));
                wb = std::min(A.hi[2], static_cast<int64_t>(rhi[s]));
                if (wa > wb) continue;
            }
            // row factor c_k and the z-table (base pointer at z = wa, stride between Gaussians)
            float rowf[NG];
            const float* tab;
            int64_t stride;
            if (g.kind == kZSep) {
                for (int k = 0; k < NG; ++k) rowf[k] = tb[k * plane_b + (i - ia) * nyb + s];
                tab = ta + (wa - zlo);
                stride = nzb;
            } else if (g.kind == kYSep) {
                for (int k = 0; k < NG; ++k) rowf[k] = ta[k * nyb + s];
                tab = tb + (i - ia) * nzb + (wa - zlo);
                stride = plane_b;
            } else {
                const int64_t len = wb - wa + 1;
                double* qr = q;
                const double* dz = dzd + (wa - zlo);
                for (int64_t t = 0; t < len; ++t) qr[t] = Q + Lz * dz[t] + g.G22 * dz[t] * dz[t];
                exp_table(A, qr, len, S.tab_r.data());
                for (int k = 0; k < NG; ++k) rowf[k] = 1.0f;
                tab = S.tab_r.data();
                stride = len;
            }
            const Idx base = (iw * static_cast<Idx>(ny) + static_cast<Idx>(jw[s])) * static_cast<Idx>(nz);
            if (Forward) {
                float c[NG];
                for (int k = 0; k < NG; ++k) c[k] = ampf[k] * rowf[k];
                int64_t w = wa;
                int64_t wz = zw[w - zlo];
                while (w <= wb) {  // pieces split where the row wraps around the cell along z
                    const int64_t run = std::min(wb - w + 1, nz - wz);
                    if (wz + ((run + kW - 1) / kW) * kW <= nz)
                        add_row_w(out + base + static_cast<Idx>(wz), run, tab + (w - wa), stride, c);
                    else
                        add_row(out + base + static_cast<Idx>(wz), run, tab + (w - wa), stride, c);
                    w += run;
                    wz = 0;
                }
            } else {
                float cu[4][NG];
                for (int k = 0; k < NG; ++k)
                    for (int mm = 0; mm < 4; ++mm) cu[mm][k] = static_cast<float>(A.gw[mm][k] * rowf[k]);
                float acc[7] = {0, 0, 0, 0, 0, 0, 0};
                int64_t w = wa;
                int64_t wz = zw[w - zlo];
                while (w <= wb) {
                    const int64_t run = std::min(wb - w + 1, nz - wz);
                    const float* gp = grad + base + static_cast<Idx>(wz);
                    const float* dzp = S.dzf.data() + (w - zlo);
                    const float* dz2p = S.dz2f.data() + (w - zlo);
                    if (wz + ((run + kW - 1) / kW) * kW <= nz)
                        gather_row<true>(gp, run, tab + (w - wa), stride, dzp, dz2p, cu, acc);
                    else
                        gather_row<false>(gp, run, tab + (w - wa), stride, dzp, dz2p, cu, acc);
                    w += run;
                    wz = 0;
                }
                gs->occ += acc[0];
                gs->b1 += acc[1];
                gs->b3 += Q * static_cast<double>(acc[4]) + Lz * static_cast<double>(acc[5]) +
                          g.G22 * static_cast<double>(acc[6]);
                gs->d[0] += dx * static_cast<double>(acc[2]);
                gs->d[1] += dy * static_cast<double>(acc[2]);
                gs->d[2] += acc[3];
            }
        }
    }
}

void size_scratch(Scratch& S, int64_t nxb, int64_t nyb, int64_t nzb) {
    const int64_t big = std::max(nxb * nyb, nxb * nzb);
    // + kW: the fixed-width row kernels read up to kW entries past a row's last voxel (masked out)
    S.tab_a.resize(NG * std::max(nyb, nzb) + kW);
    S.tab_b.resize(NG * big + kW);
    S.tab_r.resize(NG * nzb + kW);
    S.q.resize(std::max(big, std::max(nyb, nzb)));
    S.dzf.resize(nzb + kW);
    S.dz2f.resize(nzb + kW);
    S.dzd.resize(nzb);
    S.dyd.resize(nyb);
    S.jw.resize(nyb);
    S.zw.resize(nzb);
    for (auto* v : {&S.rq, &S.rl, &S.rlo, &S.rhi}) v->resize(nyb);
    S.rst.resize(nyb);
    const int64_t nl = ((nzb + 7) / 8) * 8 + 8;
    S.lane_tab.resize(NG * nl);
    if (static_cast<int64_t>(S.lane_index.size()) < nl) {
        S.lane_index.resize(nl);
        for (int64_t l = 0; l < nl; ++l) S.lane_index[l] = static_cast<int32_t>(l);
    }
    S.lane_q.resize(nxb * nl);
    S.lane_dz.resize(nl);
    S.lane_dzd.resize(nl);
    S.q.resize(std::max(S.q.size(), static_cast<size_t>(nxb * nl)));
    S.tab_b.resize(std::max(S.tab_b.size(), static_cast<size_t>(NG * nxb * nl)));
    S.rowc.resize(3 * NG * nyb);
    S.aacc.resize(6 * nl);
    const int64_t nyp = (nyb + 7) / 8 * 8;  // the float interval pass works in whole blocks of 8 rows
    S.rlo32.resize(nyp);
    S.rhi32.resize(nyp);
    S.dyf.resize(nyp);
    S.fix32.resize(nyp);
    S.rows.resize(nyb);
    const int64_t nzl = nzb + 16;  // kTabPad
    S.at_l.resize(NG * nzl);
    S.at_w.resize(NG * nzl);
    S.at_y.resize(NG * nzl);  // Y's first row
    S.at_r.resize(3 * NG * ((nyb + 7) / 8 * 8));  // GV, Vs, CR (rows padded to whole blocks of 8)
    S.at_d.resize(NG * nzl);
}

// ------------------------------------------------------------------ threads

// Tasks [0, n_tasks) taken by the workers of one parallel loop from one atomic counter; the first
// exception a task throws is kept for the caller to rethrow, and the loop goes on with the others.
struct TaskQueue {
    int64_t n_tasks = 0;
    std::atomic<int64_t> next{0}, done{0};
    std::mutex error_mu;
    std::exception_ptr error;

    template <class F>
    void work(F& fn, int worker) {
        for (int64_t t = next.fetch_add(1); t < n_tasks; t = next.fetch_add(1)) {
            try {
                fn(t, worker);
            } catch (...) {
                std::lock_guard<std::mutex> lock(error_mu);
                if (!error) error = std::current_exception();
            }
            done.fetch_add(1, std::memory_order_release);
        }
    }
};

// A parallel loop that never waits for a thread to arrive, only for tasks that have started.
//
// fn(task, worker) for task in [0, n_tasks): the caller (worker 0) and up to n_threads − 1
// helper threads take tasks from one atomic counter. An OpenMP region (or a fork-join of
// std::threads) ends only when every thread of its team has arrived: on a machine where another
// process keeps a core busy, a helper woken on that core may get it only after milliseconds,
// and the caller would wait for it even when it has done all the work itself. Here a helper that
// comes late finds no task left and goes back to sleep; the caller returns as soon as every
// task taken has finished. Helpers live for the process (started on first use, never joined).
// Calls from several host threads at once: one runs with the helpers, the others on their own
// thread (their results are the same: any assignment of tasks to workers is).
class HelperPool {
   public:
    static HelperPool& get() {
        static HelperPool* pool = new HelperPool;  // never destroyed: helpers may outlive static destructors
        return *pool;
    }

    template <class F>
    void run(int64_t n_tasks, int n_threads, F& fn) {
        std::unique_lock<std::mutex> busy(call_, std::try_to_lock);
        if (!busy.owns_lock() || n_threads <= 1) {
            for (int64_t t = 0; t < n_tasks; ++t) fn(t, 0);
            return;
        }
        auto job = std::make_shared<Job>();
        job->tasks.n_tasks = n_tasks;
        job->n_workers = n_threads;
        job->body = [&fn](int64_t t, int w) { fn(t, w); };
        start_helpers(n_threads - 1);
        {
            std::lock_guard<std::mutex> lock(mu_);
            job_ = job;
            ++generation_;
        }
        cv_.notify_all();
        job->work(0);
        // tasks still running on helpers: spin briefly, then yield the core
        for (int spins = 0; job->tasks.done.load(std::memory_order_acquire) < n_tasks; ++spins)
            if (spins > 2000) std::this_thread::yield();
        {
            std::lock_guard<std::mutex> lock(mu_);
            job_.reset();  // a helper that has not looked yet finds nothing
        }
        if (job->tasks.error) std::rethrow_exception(job->tasks.error);
    }

   private:
    struct Job {
        TaskQueue tasks;
        int n_workers = 1;
        std::function<void(int64_t, int)> body;
        std::atomic<int> next_worker{1};

        void work(int worker) { tasks.work(body, worker); }
    };

    void start_helpers(int n) {
        while (static_cast<int>(n_helpers_) < n) {
            std::thread(&HelperPool::helper, this).detach();
            ++n_helpers_;
        }
    }

    void helper() {
        uint64_t seen = 0;
        for (;;) {
            std::shared_ptr<Job> job;
            {
                std::unique_lock<std::mutex> lock(mu_);
                cv_.wait(lock, [&] { return generation_ != seen; });
                seen = generation_;
                job = job_;
            }
            if (!job) continue;
            // worker ids 1..n_workers−1, each at most once per job (they index per-worker scratch)
            const int id = job->next_worker.fetch_add(1);
            if (id < job->n_workers) job->work(id);
        }
    }

    std::mutex call_;  // one job at a time
    std::mutex mu_;
    std::condition_variable cv_;
    std::shared_ptr<Job> job_;
    uint64_t generation_ = 0;
    size_t n_helpers_ = 0;
};

// The same loop on the calling thread's OpenMP team, used when this module's OpenMP runtime is
// the one torch's CPU ops run on (set_shared_openmp, checked from Python). The team's workers are
// then torch's intra-op threads, which spin for a few ms after each multi-threaded torch op: a
// call that follows the caller's torch ops (every backward, and a forward inside a refinement loop)
// finds them awake on the other cores, where a pool helper would share a core with one of them and
// run at half speed. A region still ends only when every member has arrived. When a member had not
// arrived by the time the caller ran out of tasks and the caller then waited more than
// kLateWaitNs for it (its core busy with another process), calls within kHoldoffNs take the pool,
// which never waits for a thread to arrive.
class TorchTeam {
   public:
    static constexpr int64_t kLateWaitNs = 200'000;
    static constexpr int64_t kHoldoffNs = 2'000'000'000;

    // A child forked after the team ran has none of its threads, and libgomp would wait for them
    // at the child's first region: the child takes the pool.
    static void set_shared(bool shared) {
#if defined(__unix__) || defined(__APPLE__)
        static std::once_flag at_fork;
        std::call_once(at_fork, [] { pthread_atfork(nullptr, nullptr, [] { shared_.store(false); }); });
#endif
        shared_.store(shared, std::memory_order_relaxed);
    }
    static bool shared() { return shared_.load(std::memory_order_relaxed); }

    // Runs the loop and returns true, or returns false (nothing run) where the pool should.
    template <class F>
    static bool run(int64_t n_tasks, int n_threads, F& fn) {
#ifndef KERNELS_NO_OPENMP
        if (!shared() || omp_in_parallel()) return false;
        if (now_ns() < avoid_until_.load(std::memory_order_relaxed)) return false;
        TaskQueue tasks;
        tasks.n_tasks = n_tasks;
        std::atomic<int> arrived{0};
        int64_t caller_done = 0;
        bool missing = false;
#pragma omp parallel num_threads(n_threads)
        {
            arrived.fetch_add(1, std::memory_order_relaxed);
            const int worker = omp_get_thread_num();
            tasks.work(fn, worker);
            if (worker == 0) {
                missing = arrived.load(std::memory_order_relaxed) < omp_get_num_threads();
                caller_done = now_ns();
            }
        }
        if (missing && now_ns() - caller_done > kLateWaitNs)
            avoid_until_.store(now_ns() + kHoldoffNs, std::memory_order_relaxed);
        if (tasks.error) std::rethrow_exception(tasks.error);
        return true;
#else
        (void)n_tasks, (void)n_threads, (void)fn;
        return false;
#endif
    }

   private:
    static int64_t now_ns() {
        return std::chrono::duration_cast<std::chrono::nanoseconds>(
                   std::chrono::steady_clock::now().time_since_epoch())
            .count();
    }
    static inline std::atomic<bool> shared_{false};
    static inline std::atomic<int64_t> avoid_until_{0};
};

// fn(task, worker) for task in [0, n_tasks) over up to n_threads workers; worker < n_threads. On
// torch's intra-op threads where they are shared (TorchTeam), else on the kernel's pool (HelperPool).
template <class F>
void parallel_for(int64_t n_tasks, int n_threads, F&& fn) {
    n_threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(n_threads, n_tasks)));
    if (n_threads <= 1) {
        for (int64_t t = 0; t < n_tasks; ++t) fn(t, 0);
        return;
    }
    if (TorchTeam::run(n_tasks, n_threads, fn)) return;
    HelperPool::get().run(n_tasks, n_threads, fn);
}

// ------------------------------------------------------------------ forward

struct Segment {
    int64_t atom;
    int64_t u0;   // first lattice x of the segment (unwrapped)
    int64_t len;  // planes; xs + len <= nx
};

struct Inputs {
    Geom g;
    int64_t n_atoms;
    const double* frac;   // (N, 3) fractional positions, float64
    const double* radii;  // (N,) cutoff radii in Å, or nullptr: from `cutoff` (gemmi's rule)
    double cutoff;        // e/Å³, when radii is nullptr
    const float *b_iso, *occ, *a, *b;  // (N,), (N,), (N, 5), (N, 5), float32
    // anisotropic atoms (nullptr: isotropic): U (N, 6) float32 and which atoms use it (N,); the
    // others use b_iso/8π²·I. terms: per-atom Gaussians, filled by prepare_all.
    const float* u = nullptr;
    const uint8_t* aniso = nullptr;
    struct AnisoTerms* terms = nullptr;
};

// ------------------------------------------------------------------ anisotropic atoms

// An anisotropic atom's term k is amp_k·occ·exp(x_k(d)) with x_k = Σ_m c_km·mono_m(d) over the
// fractional offset d = voxel − atom, mono = (dx², dy², dz², dx·dy, dx·dz, dy·dz) (the reference's
// six coefficients of −½ dᵀQ_k d). No factorisation into per-axis tables holds for a general Q_k,
// so every voxel costs one exp per term. Along a row (dx, dy fixed) x_k is a quadratic in the
// box-relative voxel t: x_k = A_k·(t − t*_k)² + E_k with A_k < 0 and E_k ≤ 0 (Q_k positive
// definite), t*_k and E_k formed per row in double. The voxel term is evaluated in float (in base 2,
// exp2_neg) as A_k·u² + E_k with u = (t − T_k) − φ_k, T_k the integer nearest t*_k (t − T_k is
// exact): both addends are ≤ 0, so the exponent carries a few roundings relative to itself and the
// value an error ≤ ~4u·|x|·e^x ≤ 1e-7 of the term's peak. One exp per voxel and term, vectorised over
// blocks of 8 voxels of a row, is the faster form: the recurrence e(t+1) = e(t)·r(t),
// r(t+1) = r(t)·exp(2A_k) in double (two multiplies a voxel and term, three exps a row and term to
// start it) took 2.1× as long on 3O5R, being serial along rows of ~8 voxels.
constexpr double U_TO_B = 8.0 * PI * PI;

// An anisotropic atom's five Gaussians at unit occupancy: term k is amp_k·exp(Σ_m q_km·mono_m(d)),
// q_k the reference's six coefficients of −½ dᵀQ_k d, Q_k = orthᵀ·N_k·orth, N_k = M_k⁻¹,
// M_k = U + b_k/(8π²)·I; N_k is kept (symmetric: 00, 11, 22, 01, 02, 12) for the backward.
struct AnisoTerms {
    double amp[NG];
    double q[NG][6];
    double n[NG][6];
};

// Atom i's effective U (kernels/density/adp.py effective_u): its row of u where aniso, else B/8π² on
// the diagonal; as six doubles U11, U22, U33, U12, U13, U23.
KERNELS_INLINE void effective_u(const Inputs& in, int64_t i, double U[6]) {
    if (in.aniso[i]) {
        for (int c = 0; c < 6; ++c) U[c] = in.u[6 * i + c];
    } else {
        const double ui = static_cast<double>(in.b_iso[i]) / U_TO_B;
        U[0] = U[1] = U[2] = ui;
        U[3] = U[4] = U[5] = 0.0;
    }
}

// The Gaussians of atom i (kernels/density/adp.py term_gaussians at unit occupancy). A term whose
// M_k is not positive definite gets amp 0 (it adds nothing): the Python side refuses such a U
// before the kernel, naming the atom; this only keeps a map finite whatever arrives.
void prepare_terms(const Inputs& in, int64_t i, AnisoTerms& T) {
    double U[6];
    effective_u(in, i, U);
    const double* O = in.g.orth;  // row-major, fractional -> Cartesian
    for (int k = 0; k < NG; ++k) {
        const double beta = static_cast<double>(in.b[NG * i + k]) / U_TO_B;
        const double m00 = U[0] + beta, m11 = U[1] + beta, m22 = U[2] + beta, m01 = U[3], m02 = U[4], m12 = U[5];
        const double c00 = m11 * m22 - m12 * m12, c01 = m02 * m12 - m01 * m22, c02 = m01 * m12 - m02 * m11;
        const double det = m00 * c00 + m01 * c01 + m02 * c02;
        const bool pd = m00 > 0 && m00 * m11 - m01 * m01 > 0 && det > 0 && std::isfinite(det);
        if (!pd) {
            T.amp[k] = 0.0;
            for (int c = 0; c < 6; ++c) T.q[k][c] = T.n[k][c] = 0.0;
            T.q[k][0] = T.q[k][1] = T.q[k][2] = -1.0;  // a harmless shape for a term that adds 0
            continue;
        }
        const double id = 1.0 / det;
        // N = M⁻¹ (adjugate / det), symmetric
        double N[3][3];
        N[0][0] = c00 * id;
        N[0][1] = N[1][0] = c01 * id;
        N[0][2] = N[2][0] = c02 * id;
        N[1][1] = (m00 * m22 - m02 * m02) * id;
        N[1][2] = N[2][1] = (m01 * m02 - m00 * m12) * id;
        N[2][2] = (m00 * m11 - m01 * m01) * id;
        T.amp[k] = static_cast<double>(in.a[NG * i + k]) * std::pow(2.0 * PI, -1.5) / std::sqrt(det);
        // Q = Oᵀ N O
        double NO[3][3], Q[3][3];
        for (int r = 0; r < 3; ++r)
            for (int c = 0; c < 3; ++c) NO[r][c] = N[r][0] * O[c] + N[r][1] * O[3 + c] + N[r][2] * O[6 + c];
        for (int r = 0; r < 3; ++r)
            for (int c = 0; c < 3; ++c) Q[r][c] = O[r] * NO[0][c] + O[3 + r] * NO[1][c] + O[6 + r] * NO[2][c];
        T.q[k][0] = -0.5 * Q[0][0];
        T.q[k][1] = -0.5 * Q[1][1];
        T.q[k][2] = -0.5 * Q[2][2];
        T.q[k][3] = -0.5 * (2 * Q[0][1]);
        T.q[k][4] = -0.5 * (2 * Q[0][2]);
        T.q[k][5] = -0.5 * (2 * Q[1][2]);
        T.n[k][0] = N[0][0];
        T.n[k][1] = N[1][1];
        T.n[k][2] = N[2][2];
        T.n[k][3] = N[0][1];
        T.n[k][4] = N[0][2];
        T.n[k][5] = N[1][2];
    }
}

// Eigenvalues of the symmetric U (U11, U22, U33, U12, U13, U23), ascending (closed form:
// the trigonometric solution of the characteristic cubic).
void sym_eigenvalues(const double U[6], double lam[3]) {
    const double p1 = U[3] * U[3] + U[4] * U[4] + U[5] * U[5];
    if (p1 == 0) {
        lam[0] = U[0], lam[1] = U[1], lam[2] = U[2];
        std::sort(lam, lam + 3);
        return;
    }
    const double q = (U[0] + U[1] + U[2]) / 3.0;
    const double d0 = U[0] - q, d1 = U[1] - q, d2 = U[2] - q;
    const double p = std::sqrt((d0 * d0 + d1 * d1 + d2 * d2 + 2.0 * p1) / 6.0);
    // det((U − qI)/p) / 2
    const double b00 = d0 / p, b11 = d1 / p, b22 = d2 / p, b01 = U[3] / p, b02 = U[4] / p, b12 = U[5] / p;
    const double r = 0.5 * (b00 * (b11 * b22 - b12 * b12) - b01 * (b01 * b22 - b12 * b02) + b02 * (b01 * b12 - b11 * b02));
    const double phi = std::acos(std::min(1.0, std::max(-1.0, r))) / 3.0;
    const double hi = q + 2.0 * p * std::cos(phi);
    const double lo = q + 2.0 * p * std::cos(phi + 2.0 * PI / 3.0);
    lam[0] = lo;
    lam[2] = hi;
    lam[1] = 3.0 * q - hi - lo;
}

// One Gaussian's radius where |amp|·exp(expo·r²) falls to cutoff (radius.py _closed_form: neutrons).
double closed_form_radius(double amp, double expo, double cutoff) {
    const double level = std::log(std::max(std::fabs(amp), 1e-300) / cutoff);
    return level > 0 ? std::sqrt(level / -expo) : 0.0;
}

// Cutoff radius of atom i of an anisotropic set (radius.py atom_cutoff_radii): rule 0 ("gemmi"):
// the isotropic rule at B_max = 8π²·max diag(U); rule 1 ("eigen"): the search along the major axis
// of every M_k. Neutron tables (one Gaussian) in closed form.
double aniso_radius(const Inputs& in, int64_t i, int rule, bool neutron, double cutoff) {
    double U[6], ad[NG], bd[NG], amp[NG], expo[NG];
    effective_u(in, i, U);
    for (int k = 0; k < NG; ++k) {
        ad[k] = in.a[NG * i + k];
        bd[k] = in.b[NG * i + k];
    }
    double start;
    if (rule == 0) {
        start = U_TO_B * std::max(U[0], std::max(U[1], U[2]));
        if (!neutron) return cutoff_radius_one(start, ad, bd, cutoff);
        for (int k = 0; k < NG; ++k) {
            const double w = bd[k] + start;
            amp[k] = ad[k] * std::pow(4.0 * PI / w, 1.5);
            expo[k] = -4.0 * PI * PI / w;
        }
    } else {
        double lam[3];
        sym_eigenvalues(U, lam);
        for (int k = 0; k < NG; ++k) {
            const double beta = bd[k] / U_TO_B;
            const double m0 = lam[0] + beta, m1 = lam[1] + beta, m2 = lam[2] + beta;
            amp[k] = ad[k] * std::pow(2.0 * PI, -1.5) / std::sqrt(m0 * m1 * m2);
            expo[k] = -0.5 / m2;
        }
        start = U_TO_B * lam[2];
        if (!neutron) return cutoff_radius_search(start, amp, expo, cutoff);
    }
    double sum = 0;
    for (int k = 0; k < NG; ++k) sum += amp[k];
    return closed_form_radius(sum, expo[0], cutoff);
}

constexpr double kLog2e = 1.4426950408889634;  // the rows' exponents are kept in base 2 (exp2_neg)

struct AnisoRowK {
    float A[NG], base[NG], phi[NG], E[NG];
};

// Per-atom, per-plane constants of the row constants, term k in lane k of 8 (lanes 5..7 padding):
// for the row at dy, term k's exponent along the row is A_k·(t − t*)² + E_k with
// Bz = bz0 + c5·dy, h = Bz/(2·q_k2), E = cx + c1·dy² + c3x·dy − ½·Bz·h, t* = (−h − dz0)·mz.
struct AnisoPlaneK {
    alignas(64) double bz0[8], c5[8], cx[8], c1[8], c3x[8], ik[8];
};

KERNELS_INLINE void aniso_plane_consts(const double* cq, const double* inv2c2, double dx, AnisoPlaneK& P) {
    for (int k = 0; k < 8; ++k) {
        const double* c = cq + 6 * (k < NG ? k : 0);
        P.bz0[k] = c[4] * dx;
        P.c5[k] = c[5];
        P.cx[k] = c[0] * dx * dx;
        P.c1[k] = c[1];
        P.c3x[k] = c[3] * dx;
        P.ik[k] = inv2c2[k < NG ? k : 0];
    }
}

// Row constants of the row at dy whose first voxel is t_first (box-relative): base_k = t_first − T_k,
// phi_k = t*_k − T_k with T_k the integer nearest t*_k; the five terms side by side in one vector.
KERNELS_INLINE void aniso_row_consts(const AnisoPlaneK& P, const float* Af, double dy, double mz, double dz0,
                                     int64_t t_first, AnisoRowK& R) {
    double E[8], phi[8], base[8];
    const double tf = static_cast<double>(t_first);
    KERNELS_SIMD
    for (int k = 0; k < 8; ++k) {
        const double Bz = P.bz0[k] + P.c5[k] * dy;
        const double h = Bz * P.ik[k];  // −(the row's vertex in dz)
        const double e = (P.cx[k] + P.c1[k] * dy * dy + P.c3x[k] * dy) - 0.5 * Bz * h;  // C − Bz²/(4·q_k2) ≤ 0
        const double tstar = (-h - dz0) * mz;  // box-relative voxel of the row's maximum
        const double T = std::floor(tstar + 0.5);
        E[k] = (e < 0 ? e : 0.0) * kLog2e;
        phi[k] = tstar - T;
        base[k] = tf - T;
    }
    for (int k = 0; k < NG; ++k) {
        R.A[k] = Af[k];
        R.E[k] = static_cast<float>(E[k]);
        R.phi[k] = static_cast<float>(phi[k]);
        R.base[k] = static_cast<float>(base[k]);
    }
}

// 2^y for y ≤ 0 (the anisotropic rows carry their exponents in base 2): y = n + r with n the
// nearest integer (r = y − n is exact, |r| ≤ ½), 2^r = e^{r·ln 2} by its Taylor polynomial of degree 6
// (truncation < 2e-7 relative, rounding a few float ulps: within exp_neg's bound), n clamped as
// exp_neg does (results below 2^-43 are +0). The base-2 form saves exp_neg's multiply by log2(e) and
// its two-step reduction: three of the ~20 operations a voxel and term costs.
KERNELS_INLINE float exp2_neg(float y) {
    const float shifter = 12582912.0f;  // 1.5·2^23: round to nearest
    const float n = (y + shifter) - shifter;
    const float r = y - n;
    float p = 1.5403530393381609e-4f;
    p = p * r + 1.3333558146428443e-3f;
    p = p * r + 9.6181291076284772e-3f;
    p = p * r + 5.5504108664821580e-2f;
    p = p * r + 2.4022650695910071e-1f;
    p = p * r + 6.9314718055994531e-1f;
    p = p * r + 1.0f;
    int32_t ni = static_cast<int32_t>(n);
    ni = ni < -43 ? -127 : ni;  // biased exponent 0: scale = +0
    const int32_t bits = (ni + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

// One voxel of a row: Σ_k c_k·exp(A_k·u² + E_k), u = (t + base_k) − phi_k.
KERNELS_INLINE float aniso_voxel(float t, const AnisoRowK& R, const float* c) {
    float v = 0.0f;
    for (int k = 0; k < NG; ++k) {
        const float u = (t + R.base[k]) - R.phi[k];
        v += c[k] * exp2_neg(R.A[k] * u * u + R.E[k]);
    }
    return v;
}

// aniso_add_row in whole blocks of kW lanes, the lanes past the row's end adding +0.0f (their
// voxels belong to the same map row; callers check that the last block stays inside it): a row
// of ~15 voxels is one vector pass instead of a vector pass plus a scalar epilogue of 5 exps a voxel.
constexpr int64_t kAW = 8;  // lanes per block of the anisotropic rows (see aniso_add_row_w)

KERNELS_INLINE void aniso_add_row_w(float* __restrict o, int64_t n, const AnisoRowK& R, const float* c) {
    for (int64_t b = 0; b < n; b += kAW) {
        float* __restrict ob = o + b;
        const int32_t m = static_cast<int32_t>(n - b);
        const float tb = static_cast<float>(b);
        KERNELS_SIMD
        for (int32_t l = 0; l < static_cast<int32_t>(kAW); ++l) {
            const float v = aniso_voxel(tb + static_cast<float>(l), R, c);
            ob[l] += l < m ? v : 0.0f;
        }
    }
}

// o[l] += Σ_k c_k·exp(A_k·u² + E_k), u = (l + base_k) − phi_k, for l in [0, n)
KERNELS_INLINE void aniso_add_row(float* __restrict o, int64_t n, const AnisoRowK& R, const float* c) {
    const float A0 = R.A[0], A1 = R.A[1], A2 = R.A[2], A3 = R.A[3], A4 = R.A[4];
    const float b0 = R.base[0], b1 = R.base[1], b2 = R.base[2], b3 = R.base[3], b4 = R.base[4];
    const float p0 = R.phi[0], p1 = R.phi[1], p2 = R.phi[2], p3 = R.phi[3], p4 = R.phi[4];
    const float E0 = R.E[0], E1 = R.E[1], E2 = R.E[2], E3 = R.E[3], E4 = R.E[4];
    const float c0 = c[0], c1 = c[1], c2 = c[2], c3 = c[3], c4 = c[4];
    KERNELS_SIMD
    for (int32_t l = 0; l < static_cast<int32_t>(n); ++l) {
        const float t = static_cast<float>(l);
        const float u0 = (t + b0) - p0, u1 = (t + b1) - p1, u2 = (t + b2) - p2, u3 = (t + b3) - p3,
                    u4 = (t + b4) - p4;
        float v = c0 * exp2_neg(A0 * u0 * u0 + E0);
        v += c1 * exp2_neg(A1 * u1 * u1 + E1);
        v += c2 * exp2_neg(A2 * u2 * u2 + E2);
        v += c3 * exp2_neg(A3 * u3 * u3 + E3);
        v += c4 * exp2_neg(A4 * u4 * u4 + E4);
        o[l] += v;
    }
}

// Row sums for the backward: acc[k] += Σ g·e_k, acc[8 + k] += Σ g·e_k·dz, acc[16 + k] += Σ g·e_k·dz²
// over l in [0, n), e_k as in aniso_add_row, dz the fractional z offset of each voxel. Masked: whole
// blocks of kAW lanes with the upstream gradient of the lanes past the row's end taken as 0 (they
// read the same map row and the dz table's padding; callers check that the last block stays inside
// the row), so a row is one vector pass with no scalar epilogue of 5 exps and 15 sums a voxel.
template <bool Masked>
KERNELS_INLINE void aniso_gather_row(const float* __restrict gr, const float* __restrict dz, int64_t n,
                                     const AnisoRowK& R, float acc[24]) {
    const float A0 = R.A[0], A1 = R.A[1], A2 = R.A[2], A3 = R.A[3], A4 = R.A[4];
    const float b0 = R.base[0], b1 = R.base[1], b2 = R.base[2], b3 = R.base[3], b4 = R.base[4];
    const float p0 = R.phi[0], p1 = R.phi[1], p2 = R.phi[2], p3 = R.phi[3], p4 = R.phi[4];
    const float E0 = R.E[0], E1 = R.E[1], E2 = R.E[2], E3 = R.E[3], E4 = R.E[4];
    float s00 = 0, s01 = 0, s02 = 0, s10 = 0, s11 = 0, s12 = 0, s20 = 0, s21 = 0, s22 = 0, s30 = 0, s31 = 0, s32 = 0,
          s40 = 0, s41 = 0, s42 = 0;
    const int32_t nn = static_cast<int32_t>(n);
    // a constant trip count in the masked case: the vectoriser then picks 8-lane vectors, where a
    // trip count it cannot see may get 16-lane ones and leave a row of 8 to the scalar epilogue
    const int32_t step = Masked ? static_cast<int32_t>(kAW) : nn;
    for (int32_t bb = 0; bb < nn; bb += step) {
        const int32_t m = nn - bb;
        const float* __restrict gp = gr + bb;
        const float* __restrict zp = dz + bb;
#if defined(_OPENMP)
#pragma omp simd reduction(+ : s00, s01, s02, s10, s11, s12, s20, s21, s22, s30, s31, s32, s40, s41, s42)
#endif
        for (int32_t l = 0; l < (Masked ? static_cast<int32_t>(kAW) : nn); ++l) {
            const float t = static_cast<float>(bb + l);
            const float g = Masked ? (l < m ? gp[l] : 0.0f) : gp[l], z = zp[l];
            const float gz = g * z, gzz = gz * z;
            const float u0 = (t + b0) - p0, u1 = (t + b1) - p1, u2 = (t + b2) - p2, u3 = (t + b3) - p3,
                        u4 = (t + b4) - p4;
            const float e0 = exp2_neg(A0 * u0 * u0 + E0), e1 = exp2_neg(A1 * u1 * u1 + E1),
                        e2 = exp2_neg(A2 * u2 * u2 + E2), e3 = exp2_neg(A3 * u3 * u3 + E3),
                        e4 = exp2_neg(A4 * u4 * u4 + E4);
            s00 += g * e0;
            s01 += gz * e0;
            s02 += gzz * e0;
            s10 += g * e1;
            s11 += gz * e1;
            s12 += gzz * e1;
            s20 += g * e2;
            s21 += gz * e2;
            s22 += gzz * e2;
            s30 += g * e3;
            s31 += gz * e3;
            s32 += gzz * e3;
            s40 += g * e4;
            s41 += gz * e4;
            s42 += gzz * e4;
        }
    }
    acc[0] += s00, acc[1] += s10, acc[2] += s20, acc[3] += s30, acc[4] += s40;
    acc[8] += s01, acc[9] += s11, acc[10] += s21, acc[11] += s31, acc[12] += s41;
    acc[16] += s02, acc[17] += s12, acc[18] += s22, acc[19] += s32, acc[20] += s42;
}

// Per-atom moments of the backward, per term k: Σ g·e_k·{1, dx, dy, dz, dx², dy², dz², dx·dy, dx·dz, dy·dz}.
struct AnisoSums {
    double m[NG][10];
};

// Sums over the rows of one plane, per term k in lane k of 8 (lanes 5..7 stay 0): Σ r0, Σ dy·r0,
// Σ dy²·r0, Σ r1, Σ dy·r1, Σ r2 of the row sums r0 = Σ g·e_k, r1 = Σ g·e_k·dz, r2 = Σ g·e_k·dz²,
// folded with the plane's dx into AnisoSums once per plane.
struct AnisoPlaneSums {
    alignas(64) double p[6][8];
};

// Rows of anisotropic atom `atom` (prepared in A) over planes [ia, ib]: add its density to `out`
// (Forward) or its moments against `grad` to `gs`. The voxel set is the sphere r² < R² of every
// other path (plane_intervals), the row constants depend on the atom and the row only, so any
// slab partition gives bitwise the same map.
template <class Idx, bool Forward>
KERNELS_INLINE void aniso_atom(const Inputs& in, const AtomP& A, int64_t atom, int64_t ia, int64_t ib, float* out,
                               const float* grad, Scratch& S, AnisoSums* gs) {
    const Geom& g = in.g;
    const int64_t nx = g.n[0], ny = g.n[1], nz = g.n[2];
    const int64_t ylo = A.lo[1], zlo = A.lo[2];
    const int64_t nyb = A.hi[1] - ylo + 1, nzb = A.hi[2] - zlo + 1;
    double* dyd = S.dyd.data();
    int64_t* jw = S.jw.data();
    int64_t* zw = S.zw.data();
    float* dzf = S.dzf.data();
    const double ylod = static_cast<double>(ylo);
    for (int32_t s = 0; s < static_cast<int32_t>(nyb); ++s) dyd[s] = (ylod + static_cast<double>(s)) / g.m[1] - A.f[1];
    for (int64_t s = 0, w = floor_mod(ylo, ny); s < nyb; ++s, w = w + 1 == ny ? 0 : w + 1) jw[s] = w;
    for (int64_t t = 0, w = floor_mod(zlo, nz); t < nzb; ++t, w = w + 1 == nz ? 0 : w + 1) {
        zw[t] = w;
        if (!Forward) dzf[t] = static_cast<float>(static_cast<double>(zlo + t) / g.m[2] - A.f[2]);
    }
    const AnisoTerms& T = in.terms[atom];
    const double* cq = T.q[0];
    const double* amp = T.amp;
    float cf[NG];
    for (int k = 0; k < NG; ++k) cf[k] = static_cast<float>(amp[k] * A.occ);
    const double dz0 = static_cast<double>(zlo) / g.m[2] - A.f[2];
    double inv2c2[NG];
    float Af[NG];
    for (int k = 0; k < NG; ++k) {
        inv2c2[k] = 1.0 / (2.0 * cq[6 * k + 2]);
        Af[k] = static_cast<float>(cq[6 * k + 2] / (g.m[2] * g.m[2]) * kLog2e);
    }
    int32_t* lo = S.rlo32.data();
    int32_t* hi = S.rhi32.data();
    AnisoRowK R;
    AnisoPlaneK P;
    // the float interval pass (rows it cannot trust settled in double): the same voxel set as the
    // double pass and the reference (see plane_intervals_f)
    RowConstF rcf{};
    float* dyf = S.dyf.data();
    if (g.float_rows) {
        rcf = row_const_f(g, A);
        const int64_t nyp = (nyb + 7) / 8 * 8;
        for (int64_t s = 0; s < nyb; ++s) dyf[s] = static_cast<float>(dyd[s]);
        for (int64_t s = nyb; s < nyp; ++s) dyf[s] = dyf[nyb - 1];
    }
    for (int64_t i = ia; i <= ib; ++i) {
        const double dx = static_cast<double>(i) / g.m[0] - A.f[0];
        const Idx iw = static_cast<Idx>(floor_mod(i, nx));
        if (g.float_rows)
            plane_intervals_f(g, A, rcf, dx, nyb, dyf, dyd, S, lo, hi);
        else
            plane_intervals(g, A, dx, nyb, dyd, S, lo, hi);
        aniso_plane_consts(cq, inv2c2, dx, P);
        AnisoPlaneSums ps;
        if (!Forward) std::memset(&ps, 0, sizeof ps);
        for (int64_t s = 0; s < nyb; ++s) {
            if (lo[s] > hi[s]) continue;
            const double dy = dyd[s];
            const Idx base = (iw * static_cast<Idx>(ny) + static_cast<Idx>(jw[s])) * static_cast<Idx>(nz);
            float acc[24] = {};
            // pieces of the row split where it wraps around the cell along z
            for (int64_t t = lo[s]; t <= hi[s];) {
                const int64_t wz = zw[t];
                const int64_t run = std::min<int64_t>(hi[s] - t + 1, nz - wz);
                aniso_row_consts(P, Af, dy, g.m[2], dz0, t, R);
                if (Forward) {
                    if (wz + (run + kAW - 1) / kAW * kAW <= nz)
                        aniso_add_row_w(out + base + static_cast<Idx>(wz), run, R, cf);
                    else
                        aniso_add_row(out + base + static_cast<Idx>(wz), run, R, cf);
                } else if (wz + (run + kAW - 1) / kAW * kAW <= nz) {
                    aniso_gather_row<true>(grad + base + static_cast<Idx>(wz), dzf + t, run, R, acc);
                } else {
                    aniso_gather_row<false>(grad + base + static_cast<Idx>(wz), dzf + t, run, R, acc);
                }
                t += run;
            }
            if (!Forward) {
                const double dyy = dy * dy;
                KERNELS_SIMD
                for (int k = 0; k < 8; ++k) {
                    const double r0 = acc[k], r1 = acc[8 + k], r2 = acc[16 + k];
                    ps.p[0][k] += r0;
                    ps.p[1][k] += dy * r0;
                    ps.p[2][k] += dyy * r0;
                    ps.p[3][k] += r1;
                    ps.p[4][k] += dy * r1;
                    ps.p[5][k] += r2;
                }
            }
        }
        if (!Forward) {
            for (int k = 0; k < NG; ++k) {
                double* m = gs->m[k];
                const double p0 = ps.p[0][k], py = ps.p[1][k], pyy = ps.p[2][k], p1 = ps.p[3][k], py1 = ps.p[4][k],
                             p2 = ps.p[5][k];
                m[0] += p0;
                m[1] += dx * p0;
                m[2] += py;
                m[3] += p1;
                m[4] += dx * dx * p0;
                m[5] += pyy;
                m[6] += p2;
                m[7] += dx * py;
                m[8] += dx * p1;
                m[9] += py1;
            }
        }
    }
}

// ------------------------------------------------------------------ anisotropic atoms: factor tables

// The forward without an exp per voxel. Term k's exponent x_k(d) = Σ_m q_km·mono_m(d) splits over the
// voxel (plane i, row s, lane t) of the box as
//   x_k = [q0·dx² + q1·dy² + q3·dx·dy] + [q2·dz² + q4·dx·dz] + [q5·dy·dz],
// so ρ_k = C_k(i, s) · L_k(i)[t] · Y_k[s][t] with the row scalar C_k (amplitude × occupancy × the
// first bracket's exp), the plane's lane factor L_k(i) and the (row, lane) factor Y_k[s] =
// Y_k[0]·D_k^s, D_k = exp(q5·hy·dz). Each 1-D sequence exp(a(j)) of a linear or quadratic a over the
// box's lattice steps comes from two or three exps (exp_d, all seeds of an atom in one vector pass)
// and a multiplication or two per entry (exp(a(j+1)) = exp(a(j))·exp(a(j+1) − a(j)), the difference
// itself stepped likewise for a quadratic), L_k(i) from L_k(i−1) by one multiply per lane. The plane
// is walked block by block down its rows with the partial product P_k = L_k(i)·Y_k[s] in registers
// (see aniso_atom_tables): a voxel costs one multiply-add per term (8 lanes of double). Every sequence
// starts at the box's first plane, row and lane, so a voxel's value does not depend on the slab that
// computes it (determinism).
//
// Unlike the separable isotropic factors, these are not all ≤ 1: exp(q4·dx·dz) > 1 where dx·dz has
// the sign of q4, and only the product is a Gaussian. Everything is therefore in double (the five
// terms summed in double, one float rounding per voxel), and an atom takes this path only when every
// factor and every partial product that is multiplied further has |exponent| ≤ kTabBound for every
// term (aniso_tables_fit bounds them over the box): e^±680 is far from double overflow (e^709) and
// from the denormals (below e^−708), so no inf·0 and no lost digits; a voxel value that underflows is
// below any float map's resolution. Relative error of a voxel value: a few ulps of double per
// multiplication along chains of at most ~2·box-width steps (< 1e-13), then one float rounding.
// Atoms past the bound (very narrow or very anisotropic terms in a wide box) take aniso_atom's exp
// per voxel.
constexpr double kTabBound = 680.0;

// e^x in double for |x| ≤ 708, vectorisable (no libm call): x = n·ln2 + r with n the nearest integer
// (Cody–Waite with fdlibm's two-part ln2, r exact to ~1e-19), |r| ≤ ln2/2, e^r by its Taylor
// polynomial of degree 12 (truncation < 2e-16 relative), 2^n from the exponent bits. The tables need
// far less (a seed's relative error grows by at most the ~box-width steps of its progression).
KERNELS_INLINE double exp_d(double x) {
    const double shifter = 6755399441055744.0;  // 1.5·2^52: round to nearest
    const double n = (x * 1.4426950408889634 + shifter) - shifter;
    const double r = (x - n * 6.93147180369123816490e-01) - n * 1.90821492927058770002e-10;
    double p = 2.08767569878680989792e-09;  // 1/12!
    p = p * r + 2.50521083854417187751e-08;
    p = p * r + 2.75573192239858906526e-07;
    p = p * r + 2.75573192239858906526e-06;
    p = p * r + 2.48015873015873015873e-05;
    p = p * r + 1.98412698412698412698e-04;
    p = p * r + 1.38888888888888888889e-03;
    p = p * r + 8.33333333333333333333e-03;
    p = p * r + 4.16666666666666666667e-02;
    p = p * r + 1.66666666666666666667e-01;
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    const int64_t bits = (static_cast<int64_t>(n) + 1023) << 52;
    double scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

// Whether every term of atom `atom` (box A) keeps its factors and the partial products that are
// multiplied further within kTabBound (see above). Each |d| is widened by one voxel step, which covers
// the recurrences' step factors and the entry one past the box they compute (to within a step).
// Bounds on |exponent|, with m_a = max |d_a| (widened):
//   single factors exp(q_m·mono_m): |q_m|·max|mono_m| (a bilinear or square term peaks at a corner);
//   GV = exp(q1·dy² + q3·dx·dy): |q1|·m_y² + |q3|·m_x·m_y;
//   the row scalar cf·exp(P1), P1 = q0·dx² + q1·dy² + q3·dx·dy ≤ 0 (a negative-definite form):
//   |ln cf| − P1min, P1min the form's minimum over the rectangle's corners (a concave function takes
//   its minimum at a vertex);
//   the walk's partial product P = L·Y = exp(q2·dz² + q4·dx·dz + q5·dy·dz): |q2|·m_z² + |q4|·m_x·m_z +
//   |q5|·m_y·m_z.
// A voxel's term is then C·P with both factors within e^±kTabBound: neither underflows while the
// other is large.
// The voxel value itself, the last product, is ≤ the term's peak (x ≤ 0) and needs no bound: where
// it falls below the smallest double it is negligible, and no later product reads it.
// max and min that keep a NaN (a NaN bound fails the test)
KERNELS_INLINE double fmax_inl(double a, double b) { return (a > b || a != a) ? a : b; }
KERNELS_INLINE double fmin_inl(double a, double b) { return (a < b || a != a) ? a : b; }
// An upper bound on |ln |x|| from x's binary exponent (0 for x = 0 or a denormal, where every product
// with x is 0 or negligible; a non-finite x gives a bound past any limit)
KERNELS_INLINE double abs_log_bound(double x) {
    uint64_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    const int64_t e = static_cast<int64_t>((bits >> 52) & 0x7ff);
    if (e == 0) return 0.0;
    if (e == 0x7ff) return std::numeric_limits<double>::infinity();
    return static_cast<double>(std::abs(e - 1023) + 1) * 0.6931471805599453;
}
KERNELS_INLINE bool aniso_tables_fit(const Inputs& in, const AtomP& A, int64_t atom) {
    const Geom& g = in.g;
    double dlo[3], dhi[3], mx[3];
    for (int d = 0; d < 3; ++d) {
        const double h = 1.0 / g.m[d];
        dlo[d] = static_cast<double>(A.lo[d]) * h - A.f[d] - h;
        dhi[d] = static_cast<double>(A.hi[d]) * h - A.f[d] + h;
        mx[d] = fmax_inl(std::fabs(dlo[d]), std::fabs(dhi[d]));
    }
    const double mono[6] = {mx[0] * mx[0], mx[1] * mx[1], mx[2] * mx[2], mx[0] * mx[1], mx[0] * mx[2], mx[1] * mx[2]};
    const AnisoTerms& T = in.terms[atom];
    for (int k = 0; k < NG; ++k) {
        const double* q = T.q[k];
        double worst = 0;
        for (int m = 0; m < 6; ++m) worst = fmax_inl(worst, std::fabs(q[m]) * mono[m]);
        worst = fmax_inl(worst, std::fabs(q[1]) * mono[1] + std::fabs(q[3]) * mono[3]);
        worst = fmax_inl(worst, std::fabs(q[2]) * mono[2] + std::fabs(q[4]) * mono[4] + std::fabs(q[5]) * mono[5]);
        double p1min = 0;
        for (int c = 0; c < 4; ++c) {
            const double dx = c & 1 ? dhi[0] : dlo[0], dy = c & 2 ? dhi[1] : dlo[1];
            p1min = fmin_inl(p1min, q[0] * dx * dx + q[1] * dy * dy + q[3] * dx * dy);
        }
        const double cf = T.amp[k] * A.occ;
        const double lcf = abs_log_bound(cf);
        worst = fmax_inl(worst, lcf - p1min);
        if (!(worst <= kTabBound)) return false;
    }
    return true;
}

// Lanes a factor-table row is padded with past the box's last lane: the walk's blocks of a plane read
// up to 2·kAW − 1 entries past the plane's last lane (zeros: masked lanes).
constexpr int64_t kTabPad = 2 * kAW;

// One block of kAW lanes of aniso_atom_tables' walk, from lane tb: P_k = L_k·Y_k[0] of the five terms,
// stepped down one row by P_k *= D_k, so P_k holds row `row` after construction.
struct AnisoWalkBlock {
    vd8 P0, P1, P2, P3, P4;
    vd8 D0, D1, D2, D3, D4;
    KERNELS_INLINE AnisoWalkBlock(const double* L, const double* Y0, const double* D, int64_t nzl, int64_t tb,
                                  int64_t row)
        : P0(vload<vd8>(L + tb) * vload<vd8>(Y0 + tb)),
          P1(vload<vd8>(L + nzl + tb) * vload<vd8>(Y0 + nzl + tb)),
          P2(vload<vd8>(L + 2 * nzl + tb) * vload<vd8>(Y0 + 2 * nzl + tb)),
          P3(vload<vd8>(L + 3 * nzl + tb) * vload<vd8>(Y0 + 3 * nzl + tb)),
          P4(vload<vd8>(L + 4 * nzl + tb) * vload<vd8>(Y0 + 4 * nzl + tb)),
          D0(vload<vd8>(D + tb)),
          D1(vload<vd8>(D + nzl + tb)),
          D2(vload<vd8>(D + 2 * nzl + tb)),
          D3(vload<vd8>(D + 3 * nzl + tb)),
          D4(vload<vd8>(D + 4 * nzl + tb)) {
        for (int64_t s = 0; s < row; ++s) step();
    }
    KERNELS_INLINE void step() { P0 *= D0, P1 *= D1, P2 *= D2, P3 *= D3, P4 *= D4; }
};

// The forward of anisotropic atom `atom` over planes [ia, ib] through the factor tables (callers check
// aniso_tables_fit). The voxel set is aniso_atom's (plane_intervals / plane_intervals_f); each voxel
// receives one float add of its five terms summed in double, in the same atom order as every path.
// Each plane is walked block by block, blocks of kAW box lanes from the first lane a row of the plane
// reaches (a lane's arithmetic does not depend on the block it falls in): P_k(i, 0) = L_k(i)·Y_k[0]
// and P_k(i, s + 1) = P_k(i, s)·D_k stay in registers while the walk goes down the plane's rows, and
// row s adds Σ_k C_k(i, s)·P_k(i, s), masked to its interval: a
// voxel costs one multiply-add per term, a (row, block) one multiply per term to step P, and nothing
// is loaded per voxel but the map (the row scalars are broadcast loads): reading L_k and a tabulated
// Y_k per voxel instead (ten table loads a block of 8) takes ~1.3× as long.
//
// Backward (Forward false, ia and ib the whole box): the same walk with unit amplitudes, each row's
// e_k = C_k·P_k against the upstream gradient: per block, lane sums Σ_s u, Σ_s dy·u, Σ_s dy²·u of
// u = C_k(s)·g·P_k (15 vectors of double), folded with the block's dz at its end into the plane's
// six sums per term (aniso_atom's AnisoPlaneSums, kept as lane vectors), those with dx into the ten
// moments as lane vectors, summed across lanes into `gs` once per atom (double throughout). The
// lanes outside a row's interval take g = 0 (P is finite over the box).
template <class Idx, bool Forward = true>
KERNELS_INLINE void aniso_atom_tables(const Inputs& in, const AtomP& A, int64_t atom, int64_t ia, int64_t ib,
                                      float* out, Scratch& S, const float* grad = nullptr, AnisoSums* gs = nullptr) {
    const Geom& g = in.g;
    const int64_t nx = g.n[0], ny = g.n[1], nz = g.n[2];
    const int64_t xlo = A.lo[0], ylo = A.lo[1], zlo = A.lo[2];
    const int64_t nyb = A.hi[1] - ylo + 1, nzb = A.hi[2] - zlo + 1;
    const int64_t nzl = nzb + kTabPad;  // lanes per table row
    // the table loops run over whole blocks of 8 (no scalar remainder): lanes [nzb, nzr) and rows
    // [nyb, nyr) are zeros (their steps are zeros), inside the rows' padding
    const int64_t nzr = (nzb + 7) / 8 * 8, nyr = (nyb + 7) / 8 * 8;
    const double hx = 1.0 / g.m[0], hy = 1.0 / g.m[1], hz = 1.0 / g.m[2];
    const double dx0 = static_cast<double>(xlo) * hx - A.f[0];
    const double dy0 = static_cast<double>(ylo) * hy - A.f[1];
    const double dz0 = static_cast<double>(zlo) * hz - A.f[2];
    double* dyd = S.dyd.data();
    int64_t* jw = S.jw.data();
    int64_t* zw = S.zw.data();
    const double ylod = static_cast<double>(ylo);
    for (int32_t s = 0; s < static_cast<int32_t>(nyb); ++s) dyd[s] = (ylod + static_cast<double>(s)) / g.m[1] - A.f[1];
    for (int64_t s = 0, w = floor_mod(ylo, ny); s < nyb; ++s, w = w + 1 == ny ? 0 : w + 1) jw[s] = w;
    for (int64_t t = 0, w = floor_mod(zlo, nz); t < nzb; ++t, w = w + 1 == nz ? 0 : w + 1) zw[t] = w;

    const AnisoTerms& T = in.terms[atom];
    // the exponents whose exps seed the progressions, kSeeds per term, exponentiated in one vector pass
    constexpr int kSeeds = 17;
    alignas(64) double seed[NG * kSeeds + 3];
    for (int k = 0; k < NG; ++k) {
        const double* q = T.q[k];
        double* x = seed + k * kSeeds;
        // L(xlo)[t] = exp(q2·dz² + q4·dx0·dz): value, first and second difference of the exponent
        x[0] = q[2] * dz0 * dz0 + q[4] * dx0 * dz0;
        x[1] = q[2] * hz * (2.0 * dz0 + hz) + q[4] * dx0 * hz;
        x[2] = 2.0 * q[2] * hz * hz;
        // W[t] = exp(q4·hx·dz): L's step from one plane to the next
        x[3] = q[4] * hx * dz0;
        x[4] = q[4] * hx * hz;
        // Y[0][t] = exp(q5·dy0·dz), and its step from one row to the next, D[t] = exp(q5·hy·dz)
        x[5] = q[5] * dy0 * dz0;
        x[6] = q[5] * dy0 * hz;
        x[7] = q[5] * hy * dz0;
        x[8] = q[5] * hy * hz;
        // GV(xlo)[s] = exp(q1·dy² + q3·dx0·dy), and its step from one plane to the next, exp(q3·hx·dy)
        x[9] = q[1] * dy0 * dy0 + q[3] * dx0 * dy0;
        x[10] = q[1] * hy * (2.0 * dy0 + hy) + q[3] * dx0 * hy;
        x[11] = 2.0 * q[1] * hy * hy;
        x[12] = q[3] * hx * dy0;
        x[13] = q[3] * hx * hy;
        // exp(q0·dx²) along the planes
        x[14] = q[0] * dx0 * dx0;
        x[15] = q[0] * hx * (2.0 * dx0 + hx);
        x[16] = 2.0 * q[0] * hx * hx;
    }
    for (int j = NG * kSeeds; j < NG * kSeeds + 3; ++j) seed[j] = 0.0;
    KERNELS_SIMD
    for (int j = 0; j < NG * kSeeds + 3; ++j) seed[j] = exp_d(seed[j]);
    // tables, term k at k·(its length): L of the current plane, W: L's step per plane, Y0: Y's first row,
    // D: Y's step per row (NG × nzl each); per row: GV of the current plane and its step per plane Vs,
    // CR: the current plane's row scalars (NG × nyr each)
    double* L = S.at_l.data();
    double* W = S.at_w.data();
    double* Y0 = S.at_y.data();
    double* D = S.at_d.data();
    double* GV = S.at_r.data();
    double* Vs = GV + NG * nyr;
    double* CR = Vs + NG * nyr;
    double gx[NG], gr[NG], grr[NG], cf[NG];
    // The 1-D progressions, t outer and the terms inner: 4·NG independent multiply chains along z and
    // 2·NG along y run side by side instead of one after another.
    {
        double eL[NG], rL[NG], rrL[NG], eW[NG], rW[NG], eY[NG], rY[NG], eD[NG], rD[NG];
        for (int k = 0; k < NG; ++k) {
            const double* e = seed + k * kSeeds;
            eL[k] = e[0], rL[k] = e[1], rrL[k] = e[2], eW[k] = e[3], rW[k] = e[4];
            eY[k] = e[5], rY[k] = e[6], eD[k] = e[7], rD[k] = e[8];
        }
        for (int64_t t = 0; t < nzb; ++t) {
            for (int k = 0; k < NG; ++k) {
                L[k * nzl + t] = eL[k];
                W[k * nzl + t] = eW[k];
                Y0[k * nzl + t] = eY[k];
                D[k * nzl + t] = eD[k];
                eL[k] *= rL[k];
                rL[k] *= rrL[k];
                eW[k] *= rW[k];
                eY[k] *= rY[k];
                eD[k] *= rD[k];
            }
        }
    }
    {
        double eG[NG], rG[NG], rrG[NG], eV[NG], rV[NG];
        for (int k = 0; k < NG; ++k) {
            const double* e = seed + k * kSeeds;
            eG[k] = e[9], rG[k] = e[10], rrG[k] = e[11], eV[k] = e[12], rV[k] = e[13];
        }
        for (int64_t s = 0; s < nyb; ++s) {
            for (int k = 0; k < NG; ++k) {
                GV[k * nyr + s] = eG[k];
                Vs[k * nyr + s] = eV[k];
                eG[k] *= rG[k];
                rG[k] *= rrG[k];
                eV[k] *= rV[k];
            }
        }
    }
    for (int k = 0; k < NG; ++k) {
        const double* e = seed + k * kSeeds;
        cf[k] = Forward ? T.amp[k] * A.occ : 1.0;
        for (int64_t t = nzb; t < nzl; ++t) L[k * nzl + t] = W[k * nzl + t] = Y0[k * nzl + t] = D[k * nzl + t] = 0.0;
        for (int64_t s = nyb; s < nyr; ++s) GV[k * nyr + s] = Vs[k * nyr + s] = 0.0;
        gx[k] = e[14];
        gr[k] = e[15];
        grr[k] = e[16];
    }

    int32_t* lo = S.rlo32.data();
    int32_t* hi = S.rhi32.data();
    RowConstF rcf{};
    float* dyf = S.dyf.data();
    if (g.float_rows) {
        rcf = row_const_f(g, A);
        const int64_t nyp = (nyb + 7) / 8 * 8;
        for (int64_t s = 0; s < nyb; ++s) dyf[s] = static_cast<float>(dyd[s]);
        for (int64_t s = nyb; s < nyp; ++s) dyf[s] = dyf[nyb - 1];
    }
    const vi8 iota = Lanes<8>::iota();
    // backward: the ten moments of each term as lane vectors, summed across lanes once per atom
    vd8 mv[NG][10];
    if constexpr (!Forward) std::memset(mv, 0, sizeof mv);
    for (int64_t i = xlo; i <= ib; ++i) {
        if (i > xlo) {  // step the plane's factors from plane i − 1
            for (int k = 0; k < NG; ++k) {
                double* Lk = L + k * nzl;
                const double* Wk = W + k * nzl;
                KERNELS_SIMD
                for (int64_t t = 0; t < nzr; ++t) Lk[t] *= Wk[t];
                double* GVk = GV + k * nyr;
                const double* Vsk = Vs + k * nyr;
                KERNELS_SIMD
                for (int64_t s = 0; s < nyr; ++s) GVk[s] *= Vsk[s];
                gx[k] *= gr[k];
                gr[k] *= grr[k];
            }
        }
        if (i < ia) continue;
        const double dx = static_cast<double>(i) / g.m[0] - A.f[0];
        const Idx iw = static_cast<Idx>(floor_mod(i, nx));
        if (g.float_rows)
            plane_intervals_f(g, A, rcf, dx, nyb, dyf, dyd, S, lo, hi);
        else
            plane_intervals(g, A, dx, nyb, dyd, S, lo, hi);
        // the plane's non-empty rows [sf, sl] and the lanes [tlo, thi] they cover
        int64_t sf = -1, sl = -1;
        int32_t tlo = std::numeric_limits<int32_t>::max(), thi = -1;
        for (int64_t s = 0; s < nyb; ++s) {
            if (lo[s] > hi[s]) continue;
            if (sf < 0) sf = s;
            sl = s;
            tlo = std::min(tlo, lo[s]);
            thi = std::max(thi, hi[s]);
        }
        if (sf < 0) continue;
        for (int k = 0; k < NG; ++k) {
            const double ck = cf[k], gk = gx[k];
            const double* GVk = GV + k * nyr;
            double* CRk = CR + k * nyr;
            KERNELS_SIMD
            for (int64_t s = 0; s < nyr; ++s) CRk[s] = ck * (gk * GVk[s]);
        }
        const Idx plane_base = iw * static_cast<Idx>(ny);
        if constexpr (!Forward) {
            vd8 pv[NG][6];  // the plane's six sums per term as lane vectors (see aniso_atom's AnisoPlaneSums)
            std::memset(pv, 0, sizeof pv);
            for (int64_t tb = tlo; tb <= thi; tb += kAW) {
                AnisoWalkBlock B(L, Y0, D, nzl, tb, sf);
                const int64_t wz = zw[tb];
                const bool direct = wz + kAW <= nz;
                const int32_t tb32 = static_cast<int32_t>(tb);
                vd8 a0 = {}, a1 = {}, a2 = {}, a3 = {}, a4 = {};  // Σ_s u_k
                vd8 b0 = {}, b1 = {}, b2 = {}, b3 = {}, b4 = {};  // Σ_s dy·u_k
                vd8 e0 = {}, e1 = {}, e2 = {}, e3 = {}, e4 = {};  // Σ_s dy²·u_k
                for (int64_t s = sf; s <= sl; ++s) {
                    if (lo[s] <= tb32 + static_cast<int32_t>(kAW) - 1 && hi[s] >= tb32) {
                        const vi8 keep = (iota >= (vi8{} + (lo[s] - tb32))) & (iota <= (vi8{} + (hi[s] - tb32)));
                        const Idx base = (plane_base + static_cast<Idx>(jw[s])) * static_cast<Idx>(nz);
                        vf8 gf;
                        if (direct) {
                            gf = vload(grad + base + static_cast<Idx>(wz));
                        } else {
                            alignas(32) float g8[kAW] = {};
                            const int64_t te = std::min<int64_t>(hi[s], tb + kAW - 1);
                            for (int64_t t = std::max<int64_t>(lo[s], tb); t <= te; ++t)
                                g8[t - tb] = grad[base + static_cast<Idx>(zw[t])];
                            gf = vload(g8);
                        }
                        const vd8 gd = __builtin_convertvector(
                            reinterpret_cast<vf8>(reinterpret_cast<vi8>(gf) & keep), vd8);
                        const double* c = CR + s;
                        const vd8 dy = vsplat_at<vd8>(dyd + s);
                        const vd8 u0 = vsplat_at<vd8>(c) * (gd * B.P0), u1 = vsplat_at<vd8>(c + nyr) * (gd * B.P1),
                                  u2 = vsplat_at<vd8>(c + 2 * nyr) * (gd * B.P2),
                                  u3 = vsplat_at<vd8>(c + 3 * nyr) * (gd * B.P3),
                                  u4 = vsplat_at<vd8>(c + 4 * nyr) * (gd * B.P4);
                        a0 += u0, a1 += u1, a2 += u2, a3 += u3, a4 += u4;
                        const vd8 y0 = dy * u0, y1 = dy * u1, y2 = dy * u2, y3 = dy * u3, y4 = dy * u4;
                        b0 += y0, b1 += y1, b2 += y2, b3 += y3, b4 += y4;
                        e0 += dy * y0, e1 += dy * y1, e2 += dy * y2, e3 += dy * y3, e4 += dy * y4;
                    }
                    B.step();
                }
                // the block's dz per lane (lanes past the box's last z hold zero sums)
                alignas(64) double dzl[kAW];
                for (int l = 0; l < static_cast<int>(kAW); ++l)
                    dzl[l] = static_cast<double>(zlo + tb + l) / g.m[2] - A.f[2];
                const vd8 dz = vload<vd8>(dzl);
                const vd8* av[NG] = {&a0, &a1, &a2, &a3, &a4};
                const vd8* bv[NG] = {&b0, &b1, &b2, &b3, &b4};
                const vd8* ev[NG] = {&e0, &e1, &e2, &e3, &e4};
                for (int k = 0; k < NG; ++k) {
                    const vd8 az = *av[k] * dz;
                    pv[k][0] += *av[k];
                    pv[k][1] += *bv[k];
                    pv[k][2] += *ev[k];
                    pv[k][3] += az;
                    pv[k][4] += *bv[k] * dz;
                    pv[k][5] += az * dz;
                }
            }
            const vd8 dxv = vd8{} + dx, dxx = dxv * dxv;
            for (int k = 0; k < NG; ++k) {
                vd8* m = mv[k];
                m[0] += pv[k][0];
                m[1] += dxv * pv[k][0];
                m[2] += pv[k][1];
                m[3] += pv[k][3];
                m[4] += dxx * pv[k][0];
                m[5] += pv[k][2];
                m[6] += pv[k][5];
                m[7] += dxv * pv[k][1];
                m[8] += dxv * pv[k][3];
                m[9] += pv[k][4];
            }
            continue;
        }
        if (thi - tlo >= kAW && thi - tlo < 2 * kAW && zw[tlo] + 2 * kAW <= nz) {
            // the plane's rows span two blocks that lie inside the map row: walk both at once, rows outer
            // (10 partial products and their steps in registers, each row's scalars loaded once)
            const int64_t tb = tlo, tc = tlo + kAW;
            AnisoWalkBlock B(L, Y0, D, nzl, tb, sf), Bc(L, Y0, D, nzl, tc, sf);
            const int64_t wz = zw[tb];
            const int32_t tb32 = static_cast<int32_t>(tb);
            for (int64_t s = sf; s <= sl; ++s) {
                if (lo[s] <= hi[s]) {
                    const double* c = CR + s;
                    const vd8 c0 = vsplat_at<vd8>(c), c1 = vsplat_at<vd8>(c + nyr), c2 = vsplat_at<vd8>(c + 2 * nyr),
                              c3 = vsplat_at<vd8>(c + 3 * nyr), c4 = vsplat_at<vd8>(c + 4 * nyr);
                    const vd8 va = ((c0 * B.P0 + c1 * B.P1) + (c2 * B.P2 + c3 * B.P3)) + c4 * B.P4;
                    const vd8 vb = ((c0 * Bc.P0 + c1 * Bc.P1) + (c2 * Bc.P2 + c3 * Bc.P3)) + c4 * Bc.P4;
                    const vi8 la = vi8{} + (lo[s] - tb32), ha = vi8{} + (hi[s] - tb32);
                    const vi8 ka = (iota >= la) & (iota <= ha);
                    const vi8 kb = (iota + static_cast<int32_t>(kAW) >= la) & (iota + static_cast<int32_t>(kAW) <= ha);
                    const vf8 fa = reinterpret_cast<vf8>(reinterpret_cast<vi8>(__builtin_convertvector(va, vf8)) & ka);
                    const vf8 fb = reinterpret_cast<vf8>(reinterpret_cast<vi8>(__builtin_convertvector(vb, vf8)) & kb);
                    float* o = out + (plane_base + static_cast<Idx>(jw[s])) * static_cast<Idx>(nz) + static_cast<Idx>(wz);
                    vstore(o, vload(o) + fa);
                    vstore(o + kAW, vload(o + kAW) + fb);
                }
                B.step();
                Bc.step();
            }
            continue;
        }
        for (int64_t tb = tlo; tb <= thi; tb += kAW) {
            AnisoWalkBlock B(L, Y0, D, nzl, tb, sf);
            const int64_t wz = zw[tb];
            // the block's lanes inside the map row (lanes past the box's last z are masked in every row)
            const bool direct = wz + kAW <= nz;
            const int32_t tb32 = static_cast<int32_t>(tb);
            for (int64_t s = sf; s <= sl; ++s) {
                if (lo[s] <= tb32 + static_cast<int32_t>(kAW) - 1 && hi[s] >= tb32) {
                    const double* c = CR + s;
                    const vd8 v = ((vsplat_at<vd8>(c) * B.P0 + vsplat_at<vd8>(c + nyr) * B.P1) +
                                   (vsplat_at<vd8>(c + 2 * nyr) * B.P2 + vsplat_at<vd8>(c + 3 * nyr) * B.P3)) +
                                  vsplat_at<vd8>(c + 4 * nyr) * B.P4;
                    const vi8 keep = (iota >= (vi8{} + (lo[s] - tb32))) & (iota <= (vi8{} + (hi[s] - tb32)));
                    const vf8 f = reinterpret_cast<vf8>(reinterpret_cast<vi8>(__builtin_convertvector(v, vf8)) & keep);
                    const Idx base = (plane_base + static_cast<Idx>(jw[s])) * static_cast<Idx>(nz);
                    if (direct) {
                        float* o = out + base + static_cast<Idx>(wz);
                        vstore(o, vload(o) + f);
                    } else {
                        alignas(32) float f8[kAW];
                        vstore(f8, f);
                        const int64_t te = std::min<int64_t>(hi[s], tb + kAW - 1);
                        for (int64_t t = std::max<int64_t>(lo[s], tb); t <= te; ++t)
                            out[base + static_cast<Idx>(zw[t])] += f8[t - tb];
                    }
                }
                B.step();
            }
        }
    }
    if constexpr (!Forward) {
        for (int k = 0; k < NG; ++k)
            for (int j = 0; j < 10; ++j) {
                double sum = 0;
                for (int l = 0; l < static_cast<int>(kAW); ++l) sum += mv[k][j][l];
                gs->m[k][j] += sum;
            }
    }
}

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

// One slab [x0, x1) of the map: the segments that reach it are found through the x-sorted
// index (a contiguous range, since no segment is longer than lmax), then run in atom
// order — the one global order every slab uses, and the file's spatial coherence, so
// consecutive atoms touch nearby memory.
KERNELS_HOT_V4
void run_slab(const Inputs& in, const std::vector<AtomP>& atoms, const std::vector<Segment>& segs,
              const std::vector<int64_t>& by_x, const std::vector<int64_t>& bucket, int64_t lmax, int64_t x0,
              int64_t x1, float* out, Scratch& S, std::vector<int64_t>& ids, bool use64, RowIntervals* saved) {
    slab_segments(in.g.n[0], segs, by_x, bucket, lmax, x0, x1, ids);
    for (const int64_t id : ids) {
        const Segment& sg = segs[id];
        int64_t ia, ib;
        segment_planes(sg, in.g.n[0], x0, x1, ia, ib);
        int16_t* rows = saved ? saved->at(sg.atom) : nullptr;
        if (use64)
            process_atom<int64_t, true>(in.g, atoms[sg.atom], ia, ib, out, nullptr, S, nullptr, rows);
        else
            process_atom<int32_t, true>(in.g, atoms[sg.atom], ia, ib, out, nullptr, S, nullptr, rows);
    }
}

// The anisotropic forward of one slab: run_slab's traversal (the same segments in the same atom
// order), each atom through aniso_atom.
KERNELS_HOT_V4
void run_slab_aniso(const Inputs& in, const std::vector<AtomP>& atoms, const std::vector<Segment>& segs,
                    const std::vector<int64_t>& by_x, const std::vector<int64_t>& bucket, int64_t lmax, int64_t x0,
                    int64_t x1, float* out, Scratch& S, std::vector<int64_t>& ids, bool use64) {
    slab_segments(in.g.n[0], segs, by_x, bucket, lmax, x0, x1, ids);
    for (const int64_t id : ids) {
        const Segment& sg = segs[id];
        int64_t ia, ib;
        segment_planes(sg, in.g.n[0], x0, x1, ia, ib);
        const AtomP& A = atoms[sg.atom];
        if (aniso_tables_fit(in, A, sg.atom)) {
            if (use64)
                aniso_atom_tables<int64_t>(in, A, sg.atom, ia, ib, out, S);
            else
                aniso_atom_tables<int32_t>(in, A, sg.atom, ia, ib, out, S);
        } else {
            ++S.exp_visits;
            if (use64)
                aniso_atom<int64_t, true>(in, A, sg.atom, ia, ib, out, nullptr, S, nullptr);
            else
                aniso_atom<int32_t, true>(in, A, sg.atom, ia, ib, out, nullptr, S, nullptr);
        }
    }
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
struct MapPlan {
    int64_t first_atom = 0, last_atom = 0;  // atoms [first, last) of the atom arrays
    std::vector<Segment> raw;
    std::vector<int64_t> bucket;  // bucket[x] = first segment with xs >= x
    std::vector<int64_t> by_x;    // segment ids counting-sorted by first plane
    std::vector<int64_t> edge;    // slab s is planes [edge[s], edge[s + 1])
    int64_t lmax = 1;
};

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

// n_maps maps of in.n_atoms / n_maps atoms each (map m: atoms [m·n, (m+1)·n), written to
// out + m·voxels). Every (map, slab) pair is one task of one parallel loop.
void splat(const Inputs& in_, float* out, int64_t n_maps, int n_threads, int slabs_per_thread, bool use64,
           bool record_slabs, Timings& tm, RowIntervals* saved) {
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
    // One map: the slab fractions above. Several: each map is cut into equal slabs, enough that
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
    if (record_slabs) tm.slabs.assign(tm.tasks, Timings::Slab{});
    parallel_for(tm.tasks, n_threads, [&](int64_t t, int worker) {
        Timings::Slab* ts = record_slabs ? &tm.slabs[t] : nullptr;
        if (ts) {
            ts->worker = worker;
            ts->start = seconds_since(t0);
        }
        const MapPlan& P = plans[tasks[t].first];
        const int64_t s = tasks[t].second;
        float* map = out + tasks[t].first * voxels;
        // each slab zeroes its own planes first (the map may arrive uninitialised): parallel
        // first touch, and the slab is warm in cache when the atoms are added
        std::memset(map + P.edge[s] * plane, 0, sizeof(float) * (P.edge[s + 1] - P.edge[s]) * plane);
        if (ts) ts->zeroed = seconds_since(t0);
        if (in.u)
            run_slab_aniso(in, atoms, P.raw, P.by_x, P.bucket, P.lmax, P.edge[s], P.edge[s + 1], map, scratch[worker],
                           ids[worker], use64);
        else
            run_slab(in, atoms, P.raw, P.by_x, P.bucket, P.lmax, P.edge[s], P.edge[s + 1], map, scratch[worker],
                     ids[worker], use64, saved);
        if (ts) ts->end = seconds_since(t0);
    });
    for (const Scratch& S : scratch) tm.exp_visits += S.exp_visits;
    tm.compute = seconds_since(t0);
}

// ------------------------------------------------------------------ backward

template <int W>
KERNELS_INLINE void gather_atoms_w(const Inputs& in, const std::vector<AtomP>& atoms, int64_t first, int64_t last,
                                   const float* grad, Scratch& S, bool use64, RowIntervals* saved, double* gxyz,
                                   double* gb, double* gocc) {
    const Geom& g = in.g;
    for (int64_t i = first; i < last; ++i) {
        const AtomP& A = atoms[i];
        GradSums gs = {0, 0, 0, {0, 0, 0}};
        if (A.R2 > 0) {
            int16_t* rows = saved ? saved->at(i) : nullptr;
            if (use64)
                process_atom<int64_t, false, W>(g, A, A.lo[0], A.hi[0], nullptr, grad, S, &gs, rows);
            else
                process_atom<int32_t, false, W>(g, A, A.lo[0], A.hi[0], nullptr, grad, S, &gs, rows);
        }
        // ρ = occ·Σ amp_k·e_k, e_k = exp(−α_k r²), α_k = 4π²/W_k, W_k = b_k + B:
        //   ∂ρ/∂occ = Σ amp·e;  ∂ρ/∂B = occ·Σ amp·e·(−1.5 + α·r²)/W;
        //   ∂ρ/∂xyz = 2·occ·Σ amp·α·e·orth·d  (∂r²/∂xyz = −2·orth·d, d = voxel − atom, fractional)
        const double d_occ = gs.occ;
        const double d_b = -1.5 * gs.b1 + gs.b3;
        for (int r = 0; r < 3; ++r)
            gxyz[3 * i + r] = 2.0 * A.occ *
                              (g.orth[3 * r] * gs.d[0] + g.orth[3 * r + 1] * gs.d[1] + g.orth[3 * r + 2] * gs.d[2]);
        gb[i] = A.occ * d_b;
        gocc[i] = d_occ;
    }
}

// Whether this CPU runs the x86-64-v4 (AVX-512) clones; gather_atoms then uses 16-lane blocks.
bool cpu_runs_v4() {
#if defined(KERNELS_CLONES)
    static const bool v4 = __builtin_cpu_supports("x86-64-v4");
    return v4;
#else
    return false;
#endif
}

// Gradient sums of atoms [first, last). On x86-64-v4 CPUs (and cells at least 16 voxels
// along z) the lane blocks are 16 wide: 32 vector registers hold the 15 contraction sums, and
// each lane's arithmetic is the same as with 8-lane blocks, so the gradients are too.
// wide = false keeps 8-lane blocks everywhere (Options::lanes = 8: tests compare the two).
KERNELS_HOT_V4
void gather_atoms(const Inputs& in, const std::vector<AtomP>& atoms, int64_t first, int64_t last, const float* grad,
                  Scratch& S, bool use64, bool wide, RowIntervals* saved, double* gxyz, double* gb, double* gocc) {
#if defined(KERNELS_CLONES) && defined(KERNELS_LANES) && defined(KERNELS_SHUFFLEVECTOR)
    if (wide && cpu_runs_v4() && in.g.n[2] >= 16) {
        gather_atoms_w<16>(in, atoms, first, last, grad, S, use64, saved, gxyz, gb, gocc);
        return;
    }
#endif
    gather_atoms_w<8>(in, atoms, first, last, grad, S, use64, saved, gxyz, gb, gocc);
}

// n_maps maps as in splat(): atom i reads the upstream map grad + (i / (n_atoms / n_maps))·voxels.
void gather(const Inputs& in, const float* grad, int64_t n_maps, int n_threads, bool use64, bool wide,
            RowIntervals* saved, double* gxyz, double* gb, double* gocc, Timings& tm) {
    auto t0 = Clock::now();
    std::vector<AtomP> atoms;
    int64_t box[3];
    prepare_all(in, atoms, n_threads, box);
    std::vector<Scratch> scratch(n_threads);
    for (Scratch& S : scratch) size_scratch(S, box[0], box[1], box[2]);
    tm.prepare = seconds_since(t0);
    if (saved)
        for (int64_t i = 0; i < in.n_atoms; ++i) tm.rows_reused += saved->off[i] >= 0;
    t0 = Clock::now();
    const int64_t per = 32;
    const int64_t per_map = in.n_atoms / n_maps;
    const int64_t chunks = (per_map + per - 1) / per;  // tasks of one map (a task never spans two)
    const int64_t voxels = in.g.n[0] * in.g.n[1] * in.g.n[2];
    tm.tasks = chunks * n_maps;
    parallel_for(tm.tasks, n_threads, [&](int64_t t, int worker) {
        const int64_t m = t / chunks, c = t % chunks;
        const int64_t first = m * per_map + c * per;
        gather_atoms(in, atoms, first, std::min((m + 1) * per_map, first + per), grad + m * voxels, scratch[worker],
                     use64, wide, saved, gxyz, gb, gocc);
    });
    tm.compute = seconds_since(t0);
}

// Gradients of anisotropic atoms [first, last). With ρ = occ·Σ_k amp_k·exp(x_k(d)), d = voxel − atom
// (fractional), x_k = Σ_m c_km·mono_m(d) and the moments M_k = Σ g·e_k·(…) of AnisoSums:
//   ∂L/∂amp_k = occ·M_k[1];  ∂L/∂occ = Σ_k amp_k·M_k[1];  ∂L/∂c_km = occ·amp_k·M_k[mono_m];
//   ∂L/∂f = −occ·Σ_k amp_k·Σ (∂x_k/∂d)·g·e_k  (∂x_k/∂d is linear in d: a combination of first moments).
//   and on to U: with Ḡ_k = −½·P_k (P_k the symmetric matrix of ∂L/∂q_k: diagonal q0..q2, off-diagonal
//   q3..q5), ∂L/∂N_k = O·Ḡ_k·Oᵀ, ∂L/∂M_k = −N_k·(∂L/∂N_k)·N_k − ½·amp_k·(∂L/∂amp_k)·N_k
//   (amp ∝ det(M)^−½), ∂L/∂U = Σ_k ∂L/∂M_k; an off-diagonal U_ij appears twice in the symmetric U,
//   so its gradient is 2·(∂L/∂U)_ij; an isotropic atom's B gets trace(∂L/∂U)/8π².
KERNELS_HOT_V4
void gather_aniso_atoms(const Inputs& in, const std::vector<AtomP>& atoms, int64_t first, int64_t last,
                        const float* grad, Scratch& S, bool use64, double* gfrac, double* gocc, double* gu,
                        double* gb) {
    const double* O = in.g.orth;
    // each atom's moments through the factor tables where they fit (aniso_tables_fit, as the forward
    // decides), else with an exp per voxel and term
    for (int64_t i = first; i < last; ++i) {
        const AtomP& A = atoms[i];
        AnisoSums gs;
        std::memset(&gs, 0, sizeof gs);
        if (A.R2 > 0) {
            if (aniso_tables_fit(in, A, i)) {
                if (use64)
                    aniso_atom_tables<int64_t, false>(in, A, i, A.lo[0], A.hi[0], nullptr, S, grad, &gs);
                else
                    aniso_atom_tables<int32_t, false>(in, A, i, A.lo[0], A.hi[0], nullptr, S, grad, &gs);
            } else if (use64) {
                aniso_atom<int64_t, false>(in, A, i, A.lo[0], A.hi[0], nullptr, grad, S, &gs);
            } else {
                aniso_atom<int32_t, false>(in, A, i, A.lo[0], A.hi[0], nullptr, grad, S, &gs);
            }
        }
        const AnisoTerms& T = in.terms[i];
        double go = 0, gf[3] = {0, 0, 0}, GU[3][3] = {{0, 0, 0}, {0, 0, 0}, {0, 0, 0}};
        for (int k = 0; k < NG; ++k) {
            const double* m = gs.m[k];
            const double* c = T.q[k];
            go += T.amp[k] * m[0];
            const double w = A.occ * T.amp[k];
            if (w == 0) continue;
            gf[0] -= w * (2 * c[0] * m[1] + c[3] * m[2] + c[4] * m[3]);
            gf[1] -= w * (2 * c[1] * m[2] + c[3] * m[1] + c[5] * m[3]);
            gf[2] -= w * (2 * c[2] * m[3] + c[4] * m[1] + c[5] * m[2]);
            // ∂L/∂q_k: w × moments 4..9 (dx², dy², dz², dx·dy, dx·dz, dy·dz); Ḡ = −½·P
            const double P[3][3] = {{m[4], m[7], m[8]}, {m[7], m[5], m[9]}, {m[8], m[9], m[6]}};
            double GQ[3][3], GN[3][3], T1[3][3];
            for (int r = 0; r < 3; ++r)
                for (int cc = 0; cc < 3; ++cc) GQ[r][cc] = -0.5 * w * P[r][cc];
            // ∂L/∂N = O·GQ·Oᵀ
            for (int r = 0; r < 3; ++r)
                for (int cc = 0; cc < 3; ++cc) T1[r][cc] = O[3 * r] * GQ[0][cc] + O[3 * r + 1] * GQ[1][cc] + O[3 * r + 2] * GQ[2][cc];
            for (int r = 0; r < 3; ++r)
                for (int cc = 0; cc < 3; ++cc) GN[r][cc] = T1[r][0] * O[3 * cc] + T1[r][1] * O[3 * cc + 1] + T1[r][2] * O[3 * cc + 2];
            const double* n6 = T.n[k];
            const double N[3][3] = {{n6[0], n6[3], n6[4]}, {n6[3], n6[1], n6[5]}, {n6[4], n6[5], n6[2]}};
            // −N·GN·N − ½·amp·∂L/∂amp·N, ∂L/∂amp_k = occ·M_k[1]
            const double ga = -0.5 * T.amp[k] * A.occ * m[0];
            for (int r = 0; r < 3; ++r)
                for (int cc = 0; cc < 3; ++cc) T1[r][cc] = GN[r][0] * N[0][cc] + GN[r][1] * N[1][cc] + GN[r][2] * N[2][cc];
            for (int r = 0; r < 3; ++r)
                for (int cc = 0; cc < 3; ++cc)
                    GU[r][cc] += -(N[r][0] * T1[0][cc] + N[r][1] * T1[1][cc] + N[r][2] * T1[2][cc]) + ga * N[r][cc];
        }
        gocc[i] = go;
        for (int d = 0; d < 3; ++d) gfrac[3 * i + d] = gf[d];
        double* g6 = gu + 6 * i;
        if (in.aniso[i]) {
            g6[0] = GU[0][0], g6[1] = GU[1][1], g6[2] = GU[2][2];
            g6[3] = GU[0][1] + GU[1][0], g6[4] = GU[0][2] + GU[2][0], g6[5] = GU[1][2] + GU[2][1];
            gb[i] = 0.0;
        } else {
            for (int c = 0; c < 6; ++c) g6[c] = 0.0;
            gb[i] = (GU[0][0] + GU[1][1] + GU[2][2]) / U_TO_B;
        }
    }
}

void gather_aniso(const Inputs& in_, const float* grad, int64_t n_maps, int n_threads, bool use64, double* gfrac,
                  double* gocc, double* gu, double* gb, Timings& tm) {
    auto t0 = Clock::now();
    Inputs in = in_;
    std::vector<AnisoTerms> terms(in.n_atoms);
    in.terms = terms.data();
    std::vector<AtomP> atoms;
    int64_t box[3];
    prepare_all(in, atoms, n_threads, box);
    std::vector<Scratch> scratch(n_threads);
    for (Scratch& S : scratch) size_scratch(S, box[0], box[1], box[2]);
    tm.prepare = seconds_since(t0);
    t0 = Clock::now();
    const int64_t per = 16;
    const int64_t per_map = in.n_atoms / n_maps;
    const int64_t chunks = (per_map + per - 1) / per;  // tasks of one map (a task never spans two)
    const int64_t voxels = in.g.n[0] * in.g.n[1] * in.g.n[2];
    tm.tasks = chunks * n_maps;
    parallel_for(tm.tasks, n_threads, [&](int64_t t, int worker) {
        const int64_t m = t / chunks, c = t % chunks;
        const int64_t first = m * per_map + c * per;
        gather_aniso_atoms(in, atoms, first, std::min((m + 1) * per_map, first + per), grad + m * voxels,
                           scratch[worker], use64, gfrac, gocc, gu, gb);
    });
    tm.compute = seconds_since(t0);
}

// ------------------------------------------------------------------ entry points (scatter.hpp)

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

bool use_int64(const int64_t shape[3], bool force) {
    return force || shape[0] * shape[1] * shape[2] >= (int64_t(1) << 31);
}

}  // namespace

namespace kernels::density {

namespace {
int64_t checked_maps(const AtomArrays& atoms, int64_t n_maps) {
    if (n_maps < 1) throw std::invalid_argument("the number of maps must be at least 1");
    if (atoms.n % n_maps != 0) throw std::invalid_argument("the atoms do not split into n_maps equal frames");
    return n_maps;
}
}  // namespace

Timings splat(const CellGeometry& cell, const int64_t shape[3], const AtomArrays& atoms, float* out,
              const Options& opt, RowIntervals* rows, int64_t n_maps) {
    checked_maps(atoms, n_maps);
    const Inputs in = make_inputs(cell, shape, atoms, opt.float_rows);
    if (rows && in.u) throw std::invalid_argument("row intervals are kept for isotropic atoms only");
    Timings tm;
    tm.int64_index = use_int64(shape, opt.force_int64);
    if (rows) std::copy(shape, shape + 3, rows->shape);
    ::splat(in, out, n_maps, std::max(1, opt.n_threads), std::clamp(opt.slabs_per_thread, 0, 64), tm.int64_index,
            opt.slab_times, tm, rows);
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
    tm.int64_index = use_int64(shape, opt.force_int64);
    if (atoms.n > 0)
        ::gather(in, grad, n_maps, std::max(1, opt.n_threads), tm.int64_index, opt.lanes != 8, rows, gxyz, gb_iso,
                 gocc, tm);
    return tm;
}

Timings gather_aniso(const CellGeometry& cell, const int64_t shape[3], const AtomArrays& atoms, const float* grad,
                     const Options& opt, double* gfrac, double* gocc, double* gu, double* gb_iso, int64_t n_maps) {
    checked_maps(atoms, n_maps);
    const Inputs in = make_inputs(cell, shape, atoms, opt.float_rows);
    if (!in.u) throw std::invalid_argument("gather_aniso takes anisotropic atoms (u_aniso and aniso)");
    Timings tm;
    tm.int64_index = use_int64(shape, opt.force_int64);
    if (atoms.n > 0)
        ::gather_aniso(in, grad, n_maps, std::max(1, opt.n_threads), tm.int64_index, gfrac, gocc, gu, gb_iso, tm);
    return tm;
}

#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
int64_t first_non_positive_definite(int64_t n, const float* u_aniso, const uint8_t* aniso) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
    for (int64_t i = 0; i < n; ++i) {
        if (!aniso[i]) continue;
        const float* r = u_aniso + 6 * i;
        bool finite = true;
        for (int c = 0; c < 6; ++c) finite = finite && std::isfinite(r[c]);
        const double u11 = r[0], u22 = r[1], u33 = r[2], u12 = r[3], u13 = r[4], u23 = r[5];
        const double minor2 = u11 * u22 - u12 * u12;
        const double det = u11 * (u22 * u33 - u23 * u23) - u12 * (u12 * u33 - u23 * u13) + u13 * (u12 * u23 - u22 * u13);
        if (!(finite && u11 > 0 && minor2 > 0 && det > 0)) return i;
    }
    return -1;
}

void cutoff_radii_aniso(int64_t n, const float* u_aniso, const uint8_t* aniso, const float* b_iso, const float* a,
                        const float* b, double cutoff, int rule, bool neutron, int n_threads, double* out) {
    Inputs in;
    in.n_atoms = n;
    in.u = u_aniso;
    in.aniso = aniso;
    in.b_iso = b_iso;
    in.a = a;
    in.b = b;
    const int64_t per = 512;
    parallel_for((n + per - 1) / per, std::max(1, n_threads), [&](int64_t t, int) {
        for (int64_t i = t * per; i < std::min<int64_t>(n, (t + 1) * per); ++i)
            out[i] = aniso_radius(in, i, rule, neutron, cutoff);
    });
}

#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))  // no FMA: the reference rounds each product and sum
#endif
bool fractional(int64_t n, const float* xyz, const double frac[9], double lo, double hi, double* out) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
    bool near = true;
    for (int64_t i = 0; i < n; ++i) {
        const double x = xyz[3 * i], y = xyz[3 * i + 1], z = xyz[3 * i + 2];
        for (int d = 0; d < 3; ++d) {
            double f = x * frac[3 * d];
            f = f + y * frac[3 * d + 1];
            f = f + z * frac[3 * d + 2];
            out[3 * i + d] = f;
            near = near && f >= lo && f < hi;  // false for NaN
        }
    }
    return near;
}

void cutoff_radii(int64_t n, const double* b_iso, const double* a, const double* b, double cutoff, int n_threads,
                  double* out) {
    const int64_t per = 512;
    parallel_for((n + per - 1) / per, std::max(1, n_threads), [&](int64_t t, int) {
        for (int64_t i = t * per; i < std::min<int64_t>(n, (t + 1) * per); ++i)
            out[i] = cutoff_radius_one(b_iso[i], a + NG * i, b + NG * i, cutoff);
    });
}

const char* openmp_library() {
#if !defined(KERNELS_NO_OPENMP) && (defined(__unix__) || defined(__APPLE__))
    Dl_info where;
    if (dladdr(reinterpret_cast<void*>(&omp_get_max_threads), &where) && where.dli_fname) return where.dli_fname;
#endif
    return "";
}

void set_shared_openmp(bool shared) {
#ifndef KERNELS_NO_OPENMP
    TorchTeam::set_shared(shared);
#else
    (void)shared;
#endif
}

bool shared_openmp() { return TorchTeam::shared(); }

BuildInfo build_info() {
    BuildInfo info;
#ifndef KERNELS_NO_OPENMP
    info.threads = "std::thread pool, OpenMP";
#else
    info.threads = "std::thread";
#endif
#if defined(KERNELS_CLONES)
    info.clones = true;
    // the clone this CPU runs (the loader's choice follows the same test)
    info.forward_isa = cpu_runs_v4() ? "x86-64-v4" : __builtin_cpu_supports("x86-64-v3") ? "x86-64-v3" : "baseline";
#else
    info.clones = false;
    info.forward_isa = "baseline";
#endif
    info.backward_isa = info.forward_isa;  // gather_atoms has the same clones as run_slab
    return info;
}

}  // namespace kernels::density
