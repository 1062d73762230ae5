// Per-shell sums of the per-reflection values that kernels.reciprocal.shells' statistics are ratios of.
#pragma once

#include <cstdint>

namespace kernels::reciprocal {

// The values summed per shell, in this order (shells.py's _ROWS): |F|², |R|², |F|, |R|, |F|·|R|,
// |F − R|², (|F| − |R|)², ||F| − |R||, |Δφ|·|R| and Re F·R*.
constexpr int kRows = 10;

// One set of factors: n_comp 2 for (re, im) pairs, 1 for real amplitudes (phase 0); float or double.
struct Factors {
    const void* data;
    bool is_double;
    int n_comp;
};

// Adds to out[c·n_shells + which[j]] value c of reflection j, for j in [lo, hi) in order (float64): so each
// shell's sums, started from zero, are in position order. which[j] in [0, n_shells) (checked by the caller).
void block_sums(Factors f, Factors r, const int64_t* which, int64_t lo, int64_t hi, int64_t n_shells, double* out);

}  // namespace kernels::reciprocal
