// Weighted plane fit of every plane and the scatter of its analytic gradient (CPU).
//
// Plain C++17, free of Python: entry points in plane_fit.hpp (arrays and their shapes
// described there), bindings in _plane_fit.cpp.
// Each plane is fitted in double whatever the storage dtype (scalar double costs the same
// as float here, and the fit is then as good as the float64 reference on the same input).

#include "plane_fit.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

// Must match kernels.planarity.reference.DEGENERATE_GAP and the Triton kernel.
constexpr double kDegenerateGap = 1e-5;
// Must match kernels.planarity.planes.NEWTON_STEPS (see there for why 6).
constexpr int kNewtonSteps = 6;

// Unit eigenvector of the smallest eigenvalue of the symmetric PSD matrix c (upper
// triangle c00 c01 c02 c11 c12 c22). Returns false (n = 0) when there is no unique one.
bool smallest_eigenvector(double c00, double c01, double c02, double c11, double c12, double c22, double n[3]) {
    n[0] = n[1] = n[2] = 0.0;
    const double trace = c00 + c11 + c22;
    if (!(std::isfinite(trace) && std::isfinite(c01) && std::isfinite(c02) && std::isfinite(c12)) || !(trace > 0.0))
        return false;
    // Trace-normalised: eigenvalues in [0, 1], so the adjugate products cannot overflow.
    const double s = 1.0 / trace;
    c00 *= s; c01 *= s; c02 *= s; c11 *= s; c12 *= s; c22 *= s;
    const double q = (c00 + c11 + c22) / 3.0;
    const double b00 = c00 - q, b11 = c11 - q, b22 = c22 - q;
    const double p = std::sqrt((b00 * b00 + b11 * b11 + b22 * b22 + 2.0 * (c01 * c01 + c02 * c02 + c12 * c12)) / 6.0);
    if (!(p > 0.0)) return false;  // isotropic: every direction is an eigenvector
    const double ip = 1.0 / p;
    const double e00 = b00 * ip, e11 = b11 * ip, e22 = b22 * ip, e01 = c01 * ip, e02 = c02 * ip, e12 = c12 * ip;
    const double det = e00 * (e11 * e22 - e12 * e12) - e01 * (e01 * e22 - e12 * e02) + e02 * (e01 * e12 - e11 * e02);
    const double r = std::fmin(1.0, std::fmax(-1.0, 0.5 * det));
    // Smallest root of β³ − 3β − 2r in [−2, −1]; λ0 ≥ 0 gives the lower bound −q/p.
    double beta = std::fmin(-1.0, std::fmax(-2.0, -q * ip));
    for (int it = 0; it < kNewtonSteps; ++it) {
        const double f = beta * (beta * beta - 3.0) - 2.0 * r;
        const double fp = std::fmax(3.0 * beta * beta - 3.0, 1e-30);
        beta = std::fmin(-1.0, std::fmax(-2.0, beta - f / fp));
    }
    const double gap = p * 0.5 * (-3.0 * beta - std::sqrt(std::fmax(12.0 - 3.0 * beta * beta, 0.0)));
    if (!(gap > kDegenerateGap)) return false;
    const double lam = q + p * beta;
    const double m00 = c00 - lam, m11 = c11 - lam, m22 = c22 - lam;
    // adj(C − λI): each column is ∝ the eigenvector; take the largest, then one power step.
    const double a00 = m11 * m22 - c12 * c12, a11 = m00 * m22 - c02 * c02, a22 = m00 * m11 - c01 * c01;
    const double a01 = c02 * c12 - c01 * m22, a02 = c01 * c12 - c02 * m11, a12 = c01 * c02 - m00 * c12;
    double v0, v1, v2;
    if (std::fabs(a00) >= std::fabs(a11) && std::fabs(a00) >= std::fabs(a22)) {
        v0 = a00; v1 = a01; v2 = a02;
    } else if (std::fabs(a11) >= std::fabs(a22)) {
        v0 = a01; v1 = a11; v2 = a12;
    } else {
        v0 = a02; v1 = a12; v2 = a22;
    }
    double norm2 = v0 * v0 + v1 * v1 + v2 * v2;
    if (!(norm2 > 0.0) || !std::isfinite(norm2)) return false;
    double inv = 1.0 / std::sqrt(norm2);
    v0 *= inv; v1 *= inv; v2 *= inv;
    const double w0 = a00 * v0 + a01 * v1 + a02 * v2;
    const double w1 = a01 * v0 + a11 * v1 + a12 * v2;
    const double w2 = a02 * v0 + a12 * v1 + a22 * v2;
    norm2 = w0 * w0 + w1 * w1 + w2 * w2;
    if (!(norm2 > 0.0) || !std::isfinite(norm2)) return false;
    inv = 1.0 / std::sqrt(norm2);
    n[0] = w0 * inv; n[1] = w1 * inv; n[2] = w2 * inv;
    return true;
}

template <typename T>
double fit(const T* xyz, const int32_t* index, const T* weight, T* coef, T* normal, int64_t P, int64_t K) {
    std::vector<double> part(static_cast<size_t>(P), 0.0);
    // Thousands of planes take tens of µs: threads only pay off for very large models.
#pragma omp parallel for schedule(static) if (P >= 32768)
    for (int64_t p = 0; p < P; ++p) {
        const int32_t* id = index + p * K;
        const T* w = weight + p * K;
        // Centre on the plane's first atom (float32 storage at 100 Å keeps its 1e-5 Å
        // rounding out of the centroid and covariance this way in any dtype).
        const double ox = xyz[3 * int64_t(id[0])], oy = xyz[3 * int64_t(id[0]) + 1], oz = xyz[3 * int64_t(id[0]) + 2];
        double sw = 0.0, cx = 0.0, cy = 0.0, cz = 0.0;
        for (int64_t k = 0; k < K; ++k) {
            const double wk = w[k];
            const T* a = xyz + 3 * int64_t(id[k]);
            sw += wk; cx += wk * (a[0] - ox); cy += wk * (a[1] - oy); cz += wk * (a[2] - oz);
        }
        double n[3] = {0.0, 0.0, 0.0};
        bool ok = sw > 0.0;
        if (ok) {
            cx /= sw; cy /= sw; cz /= sw;
            double c00 = 0, c01 = 0, c02 = 0, c11 = 0, c12 = 0, c22 = 0;
            for (int64_t k = 0; k < K; ++k) {
                const double wk = w[k];
                const T* a = xyz + 3 * int64_t(id[k]);
                const double yx = a[0] - ox - cx, yy = a[1] - oy - cy, yz = a[2] - oz - cz;
                c00 += wk * yx * yx; c01 += wk * yx * yy; c02 += wk * yx * yz;
                c11 += wk * yy * yy; c12 += wk * yy * yz; c22 += wk * yz * yz;
            }
            ok = smallest_eigenvector(c00, c01, c02, c11, c12, c22, n);
        }
        double acc = 0.0;
        for (int64_t k = 0; k < K; ++k) {
            double ck = 0.0;
            if (ok) {
                const T* a = xyz + 3 * int64_t(id[k]);
                const double d = (a[0] - ox - cx) * n[0] + (a[1] - oy - cy) * n[1] + (a[2] - oz - cz) * n[2];
                ck = double(w[k]) * d;
                acc += ck * d;
            }
            coef[p * K + k] = T(ck);
        }
        normal[3 * p] = T(n[0]); normal[3 * p + 1] = T(n[1]); normal[3 * p + 2] = T(n[2]);
        part[static_cast<size_t>(p)] = 0.5 * acc;
    }
    double total = 0.0;  // summed in plane order: the same result with any thread count
    for (double v : part) total += v;
    return total;
}

template <typename T>
void scatter(const int32_t* index, const T* coef, const T* normal, T* grad, int64_t N, int64_t P, int64_t K, double g) {
    // Zeroed here, serially: torch.zeros of 50k elements splits the fill over OpenMP
    // threads and then waits for a busy core, which costs far more than the fill itself.
    std::fill(grad, grad + 3 * N, T(0));
    for (int64_t p = 0; p < P; ++p) {
        const double n0 = normal[3 * p], n1 = normal[3 * p + 1], n2 = normal[3 * p + 2];
        for (int64_t k = 0; k < K; ++k) {
            const double c = coef[p * K + k];
            if (c == 0.0) continue;  // padding and degenerate planes
            T* out = grad + 3 * int64_t(index[p * K + k]);
            const double gc = g * c;
            out[0] += T(gc * n0); out[1] += T(gc * n1); out[2] += T(gc * n2);
        }
    }
}

}  // namespace

namespace kernels::planarity {

double fit(const float* xyz, const int32_t* index, const float* weight, float* coef, float* normal, int64_t P,
           int64_t K) {
    return ::fit<float>(xyz, index, weight, coef, normal, P, K);
}
double fit(const double* xyz, const int32_t* index, const double* weight, double* coef, double* normal, int64_t P,
           int64_t K) {
    return ::fit<double>(xyz, index, weight, coef, normal, P, K);
}
void scatter(const int32_t* index, const float* coef, const float* normal, float* grad, int64_t N, int64_t P,
             int64_t K, double g) {
    ::scatter<float>(index, coef, normal, grad, N, P, K, g);
}
void scatter(const int32_t* index, const double* coef, const double* normal, double* grad, int64_t N, int64_t P,
             int64_t K, double g) {
    ::scatter<double>(index, coef, normal, grad, N, P, K, g);
}

}  // namespace kernels::planarity
