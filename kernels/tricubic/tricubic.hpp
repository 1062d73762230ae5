// Tricubic interpolation of a map at arbitrary points, forward and backward (CPU, C++17,
// OpenMP or std::thread). Free of Python: the bindings live in _tricubic.cpp, the algorithm
// in tricubic.cpp (its header comment says how it works).
#pragma once

#include <cstdint>

namespace kernels::tricubic {

enum Method { CATMULL_ROM = 0, LAGRANGE = 1 };

// Where the map sits and how it is read. Voxel coordinate of a Cartesian point p along axis r:
// sampling[r] · (frac[r, :] · p) − origin[r].
struct Grid {
    double frac[9];      // Cartesian -> fractional, row-major
    double sampling[3];  // voxels per cell edge
    double origin[3];    // voxel index (in the cell's sampling) of the map's first voxel
    int64_t shape[3];    // map shape
    int64_t strides[3];  // map strides in elements (>= 0; any layout, C order is the fast one)
    bool periodic;       // false: a point whose neighbourhood leaves the map gets the fill value
    int method;          // Method
};

// out[p] = the map interpolated at points[p] (points (n, 3), C order); NaN for a non-finite
// point, `fill` outside a bounded map. n_threads <= 0: the runtime's default.
void forward(const Grid& grid, const float* rho, const float* points, int64_t n_points, float* out, float fill,
             int n_threads);
void forward(const Grid& grid, const double* rho, const double* points, int64_t n_points, double* out, double fill,
             int n_threads);

// Gradients of Σ grad_out · forward. grad_points (n, 3) is written in full (0 where a point is
// outside or non-finite); grad_rho (shape, C order whatever the map's strides) must arrive
// zeroed and is added to deterministically. Either may be nullptr (not computed).
void backward(const Grid& grid, const float* rho, const float* points, int64_t n_points, const float* grad_out,
              float* grad_points, float* grad_rho, int n_threads);
void backward(const Grid& grid, const double* rho, const double* points, int64_t n_points, const double* grad_out,
              double* grad_points, double* grad_rho, int n_threads);

}  // namespace kernels::tricubic
