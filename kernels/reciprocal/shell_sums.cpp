// The CPU's per-shell sums (shell_sums.hpp): one pass over a block's reflections, in float64.
#include "shell_sums.hpp"

#include <algorithm>
#include <cmath>

// No product is contracted into an FMA in this file: every instruction set rounds each product and sum
// alike (the same bits from each compiled variant of values()), and F·F* has an exact zero imaginary part.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace kernels::reciprocal {
namespace {

// atan(u) for 0 <= u <= 1: two half-angle steps, atan(u) = 2·atan(u / (1 + √(1 + u²))), take u below
// tan(π/16) ≈ 0.199, where 12 terms of atan(u)/u = Σ (−u²)^k / (2k + 1) leave out less than 1e-18 of the
// sum (the same steps as the GPU kernel's _atan01).
inline double atan01(double u) {
    u = u / (1.0 + std::sqrt(1.0 + u * u));
    u = u / (1.0 + std::sqrt(1.0 + u * u));
    const double z = u * u;
    double p = 1.0 / 23;
#pragma GCC unroll 11
    for (int k = 0; k < 11; ++k) p = p * (-z) + 1.0 / (21 - 2 * k);
    return 4.0 * u * p;
}

// |atan2(y, x)| in [0, π] (0 for x = y = 0): atan2(|y|, |x|) through the half angle, whose tangent
// |y| / (r + |x|) lies in [0, 1] with no cancellation, then reflected for x < 0 (π − half, within an ulp
// or two). Branch-free, so a loop of them vectorises.
inline double abs_angle(double x, double y, double pi) {
    const double ay = std::fabs(y);
    const double r = std::sqrt(x * x + ay * ay);
    const double den = r + std::fabs(x);
    const double u = ay / std::max(den, 0x1p-1022);  // den = 0 only where ay = 0: u = 0
    const double half = 2.0 * atan01(u);
    const double flip = x < 0 ? 1.0 : 0.0;  // arithmetic, not a select: GCC vectorises it
    return half + flip * (pi - 2.0 * half);
}

// Reflections per chunk: the four components and ten values of a chunk (14 × 1 kB) stay in L1.
constexpr int kChunk = 128;

// Reflections [a, b) as float64 components (im 0 for real amplitudes).
template <int NC, class T>
inline void components(const T* p, int64_t a, int64_t b, double* re, double* im) {
    for (int64_t j = a; j < b; ++j) {
        re[j - a] = static_cast<double>(p[NC * j]);
        im[j - a] = NC == 2 ? static_cast<double>(p[NC * j + 1]) : 0.0;
    }
}

// The ten values of n reflections from their float64 components, element by element (vectorised; on
// x86-64 Linux with GCC also compiled for x86-64-v3, taken where the CPU has it: the same bits either
// way, since nothing is contracted into FMAs and each value is its own elementwise chain).
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
__attribute__((target_clones("arch=x86-64-v3", "default")))
#endif
void values(const double* fr, const double* fi, const double* rr, const double* ri, int n, double pi,
            double (*v)[kChunk]) {
    for (int t = 0; t < n; ++t) {
        const double aa = fr[t] * fr[t] + fi[t] * fi[t], bb = rr[t] * rr[t] + ri[t] * ri[t];
        const double fa = std::sqrt(aa), rb = std::sqrt(bb);
        const double cross = fr[t] * rr[t] + fi[t] * ri[t], cross_im = fi[t] * rr[t] - fr[t] * ri[t];
        const double d = fa - rb, dre = fr[t] - rr[t], dim = fi[t] - ri[t];
        v[0][t] = aa;
        v[1][t] = bb;
        v[2][t] = fa;
        v[3][t] = rb;
        v[4][t] = fa * rb;
        v[5][t] = dre * dre + dim * dim;
        v[6][t] = d * d;
        v[7][t] = std::fabs(d);
        v[8][t] = abs_angle(cross, cross_im, pi) * rb;
        v[9][t] = cross;
    }
}

template <int FC, int RC, class TF, class TR>
void block_sums_t(const TF* f, const TR* r, const int64_t* which, int64_t lo, int64_t hi, int64_t n_shells,
                  double* out) {
    const double pi = 4.0 * atan01(1.0);
    alignas(64) double fr[kChunk], fi[kChunk], rr[kChunk], ri[kChunk], v[kRows][kChunk];
    for (int64_t a = lo; a < hi; a += kChunk) {
        const int64_t b = std::min(hi, a + kChunk);
        const int n = static_cast<int>(b - a);
        components<FC>(f, a, b, fr, fi);
        components<RC>(r, a, b, rr, ri);
        values(fr, fi, rr, ri, n, pi, v);
        // each shell's sums in position order; the ten of a reflection are independent chains
        for (int q = 0; q < n; ++q) {
            double* o = out + which[a + q];
#pragma GCC unroll 10
            for (int c = 0; c < kRows; ++c) o[c * n_shells] += v[c][q];
        }
    }
}

template <int FC, class TF>
void with_reference(const TF* f, Factors r, const int64_t* which, int64_t lo, int64_t hi, int64_t n_shells,
                    double* out) {
    if (r.is_double && r.n_comp == 2)
        block_sums_t<FC, 2>(f, static_cast<const double*>(r.data), which, lo, hi, n_shells, out);
    else if (r.is_double)
        block_sums_t<FC, 1>(f, static_cast<const double*>(r.data), which, lo, hi, n_shells, out);
    else if (r.n_comp == 2)
        block_sums_t<FC, 2>(f, static_cast<const float*>(r.data), which, lo, hi, n_shells, out);
    else
        block_sums_t<FC, 1>(f, static_cast<const float*>(r.data), which, lo, hi, n_shells, out);
}

}  // namespace

void block_sums(Factors f, Factors r, const int64_t* which, int64_t lo, int64_t hi, int64_t n_shells, double* out) {
    if (f.is_double && f.n_comp == 2)
        with_reference<2>(static_cast<const double*>(f.data), r, which, lo, hi, n_shells, out);
    else if (f.is_double)
        with_reference<1>(static_cast<const double*>(f.data), r, which, lo, hi, n_shells, out);
    else if (f.n_comp == 2)
        with_reference<2>(static_cast<const float*>(f.data), r, which, lo, hi, n_shells, out);
    else
        with_reference<1>(static_cast<const float*>(f.data), r, which, lo, hi, n_shells, out);
}

}  // namespace kernels::reciprocal
