// The separable kernel's building blocks: build configuration (clones, simd, inlining), exp(x) for
// x <= 0, the cell geometry and exact r², gemmi's cutoff radius, an atom's box and row intervals,
// the per-thread scratch, and the scalar row loops (add a row's density, gather its sums).
// The kernel's overview is in scatter.hpp.
#pragma once

#include "scatter.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <math.h>  // sqrtf/ceilf/floorf: libstdc++'s std:: float overloads do not inline into the AVX2 clone
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <stdexcept>
#include <type_traits>
#include <vector>

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

// Instruction-set variants. The hot loops (the slab kernels of forward.cpp and forward_aniso.cpp, the
// gather loops of backward.cpp and backward_aniso.cpp) are compiled once per variant: CMakeLists.txt
// builds each of those files for every instruction set KERNELS_ISA (0: the x86-64 baseline,
// 3: x86-64-v3, AVX2+FMA, 4: x86-64-v4, AVX-512), one translation unit each, and the drivers
// (drivers.cpp) run the variant this CPU takes (GCC on Linux/x86-64 only; elsewhere the baseline
// alone). Wheels stay portable: no -march=native. The ISA attribute is on the hot functions
// only (KERNELS_HOT), as the target_clones clones of GCC's function multi-versioning are; the helpers
// they inline are compiled for it with them. A given machine always runs the same variant, so
// reproducibility holds.
// Voxel offsets into a map are int64_t in every variant: a map of 2^31 voxels or more runs the same
// code as any other, and on x86-64 the 64-bit offsets cost the hot loops nothing measurable against
// 32-bit ones (README, "Development").
// In the backward's AVX-512 variant the lane blocks are 16 wide (one AVX-512 vector; its 32 registers
// hold the 15 contraction sums). Each lane's arithmetic is the same in every variant, so the maps and
// gradients are bitwise the same whichever one runs.
#if !defined(KERNELS_ISA)
#define KERNELS_ISA 0
#endif
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define KERNELS_ISA_VARIANTS 1
#endif
#if defined(KERNELS_ISA_VARIANTS) && KERNELS_ISA == 4
#define KERNELS_HOT __attribute__((target("arch=x86-64-v4")))
#elif defined(KERNELS_ISA_VARIANTS) && KERNELS_ISA == 3
#define KERNELS_HOT __attribute__((target("arch=x86-64-v3")))
#else
#define KERNELS_HOT
#endif

// Nothing here reads floating-point exception flags, and GCC's default -ftrapping-math
// stops it from vectorising loops that contain ceil/floor or value selects (the per-row
// interval pass), so it is turned off in every file that includes this header.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif

#if defined(__GNUC__)
#define KERNELS_INLINE inline __attribute__((always_inline))
#else
#define KERNELS_INLINE inline
#endif

// Internal functions live in headers (see below); a translation unit that uses some of them must
// not warn about the others.
#if defined(__GNUC__)
#pragma GCC diagnostic ignored "-Wunused-function"
#endif

#include "thread_pool.hpp"

// Everything in the kernel's headers has internal linkage, so each translation unit that includes
// them has its own copy and may inline it. That matters for the results: where the compiler inlines
// a helper into the AVX2/AVX-512 clones decides where it fuses multiply-adds, and so the bits of the
// maps and gradients (scripts/cpu_bitwise.py compares them); a helper compiled once in another file
// could not be inlined there. The exceptions are the plain structs (no code of their own) that the
// once-compiled drivers (drivers.cpp) hand to the per-variant hot loops (variants.hpp): Geom, AtomP,
// Scratch, Inputs, AnisoTerms, Segment and MapPlan are in kernels::density::detail, so that both
// sides name the same types.
namespace {

using kernels::density::RowIntervals;
using kernels::density::Timings;

constexpr int NG = kernels::density::kGaussians;
constexpr double PI = 3.14159265358979323846;

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) {
    return std::chrono::duration<double>(Clock::now() - t0).count();
}

using kernels::density::detail::parallel_for;

// The instruction-set variant this CPU runs: 4 (x86-64-v4, AVX-512), 3 (x86-64-v3) or 0 (baseline).
int cpu_isa() {
#if defined(KERNELS_ISA_VARIANTS)
    static const int isa = __builtin_cpu_supports("x86-64-v4") ? 4 : __builtin_cpu_supports("x86-64-v3") ? 3 : 0;
    return isa;
#else
    return 0;
#endif
}

// ------------------------------------------------------------------ exp(x) for x <= 0

// exp of a non-positive float, vectorisable (no libm call, no branches).
// Cody–Waite reduction x = n·ln2 + r, |r| ≤ ln2/2, and a degree-7 Taylor polynomial:
// relative error < 3e-7 (a few float ulps; docs/kernels.md allows 1e-5). Results below
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

}  // namespace

namespace kernels::density::detail {
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
}  // namespace kernels::density::detail

namespace {

using kernels::density::detail::Geom;

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

}  // namespace

namespace kernels::density::detail {
struct AtomP {
    double f[3];               // fractional position
    double R2;                 // cutoff radius² (Å²)
    int64_t lo[3];             // box of lattice voxels (inclusive, unwrapped), as the reference
    int64_t hi[3];
    double amp[kGaussians];    // a_k·(4π/W_k)^{3/2}, W_k = b_k + B (unit occupancy)
    double alpha[kGaussians];  // 4π²/W_k
    double width[kGaussians];  // W_k
    double gw[4][kGaussians];  // backward weights amp_k·{1, 1/W_k, α_k, α_k/W_k}
    double occ;
};
}  // namespace kernels::density::detail

namespace {

using kernels::density::detail::AtomP;

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

}  // namespace

namespace kernels::density::detail {
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
}  // namespace kernels::density::detail

namespace {

using kernels::density::detail::Scratch;

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

// ------------------------------------------------------------------ the atoms as the kernel reads them

}  // namespace

namespace kernels::density::detail {
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
}  // namespace kernels::density::detail

namespace {

using kernels::density::detail::Inputs;

}  // namespace
