// Planarity restraint on the CPU: the weighted fit of every plane and the scatter of the
// analytic gradient. Free of Python (bindings in _plane_fit.cpp). Arrays are C-contiguous:
//   xyz    (N, 3)  float32/float64   positions
//   index  (P, K)  int32             atom of each slot, in [0, N) (padding repeats the first atom)
//   weight (P, K)  float32/float64   1/σ², 0 in padding
//   coef   (P, K)  out               w·d (0 for a degenerate plane)
//   normal (P, 3)  out               unit normal (0 for a degenerate plane)
//   grad   (N, 3)  out               grad[a] = Σ g · coef · normal
#pragma once

#include <cstdint>

namespace kernels::planarity {

// Fits every plane in double; returns the data term Σ ½ w d² summed in plane order (the same
// result with any thread count).
double fit(const float* xyz, const int32_t* index, const float* weight, float* coef, float* normal, int64_t P,
           int64_t K);
double fit(const double* xyz, const int32_t* index, const double* weight, double* coef, double* normal, int64_t P,
           int64_t K);

// Overwrites grad with Σ over slots of g · coef · normal, serially (deterministic).
void scatter(const int32_t* index, const float* coef, const float* normal, float* grad, int64_t N, int64_t P,
             int64_t K, double g);
void scatter(const int32_t* index, const double* coef, const double* normal, double* grad, int64_t N, int64_t P,
             int64_t K, double g);

}  // namespace kernels::planarity
