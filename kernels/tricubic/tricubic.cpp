// Tricubic interpolation of a map at arbitrary points, forward and backward, C++17 + OpenMP.
//
// Plain C++17, free of Python: entry points in tricubic.hpp, bindings in _tricubic.cpp.
// The map (nx, ny, nz) is read through its element strides, so a Fortran-ordered view (what
// numpy gives for a gemmi grid) needs no copy; C order (z fastest) is the fast layout, where the
// 4 z samples of a row are one vector load. Points are streamed one at a time: no per-point
// index buffers, so 10^7 points cost nothing beyond the input and output.
//
// Forward: each point's 4x4x4 neighbourhood is contracted with separable weights
// wx[a]·wy[b]·wz[c]; OpenMP splits the points statically.
// Backward w.r.t. points: the same contraction with one weight replaced by its derivative.
// Backward w.r.t. the map: a scatter of g·wx·wy·wz. It is deterministic and atomic-free:
// each thread owns a slab of x-planes and walks every point in order, adding only the
// planes in its slab, so every voxel receives its contributions in point order whatever
// the number of threads (a thread rejects a point after three multiply-adds).

#include "tricubic.hpp"

// The 4-lane double vectors below never cross a non-inlined call boundary (anonymous namespace),
// so GCC's note that their ABI differs without AVX does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <thread>
#include <vector>

#ifndef KERNELS_NO_OPENMP
#include <omp.h>
#endif

namespace {

using kernels::tricubic::CATMULL_ROM;
using kernels::tricubic::LAGRANGE;
enum State { INSIDE = 0, OUTSIDE = 1, NONFINITE = 2 };

struct Params {
    double frac[9];  // Cartesian -> fractional, row-major
    double m[3];     // sampling (voxels per cell edge)
    double o[3];     // origin (voxel index of the map's first voxel)
    int64_t n[3];    // map shape
    int64_t s[3];    // map strides in elements (the map gradient is always C-contiguous)
    double inv_n[3];
    bool periodic;
};

// Beyond this many voxels from the map's origin a periodic coordinate is folded through its
// fractional part first: the wrap below is exact only while |u| is far inside 2^53, and an
// int64 cast of a larger u is undefined behaviour. (The same constant and steps in every backend.)
constexpr double FAR_VOXELS = 1099511627776.0;  // 2^40

// Voxel coordinate along axis r, added in the same order as reference.voxel_coordinates. Periodic
// maps: a finite point at |u| >= 2^40 voxels takes u = (f - floor(f))·m - o (f - floor(f) is exact).
inline double voxel_coord(const Params& P, int r, double x, double y, double z) {
    const double f = P.frac[3 * r] * x + P.frac[3 * r + 1] * y + P.frac[3 * r + 2] * z;
    const double u = f * P.m[r] - P.o[r];
    if (P.periodic && !(std::fabs(u) < FAR_VOXELS)) return (f - std::floor(f)) * P.m[r] - P.o[r];
    return u;
}

// Where the 4 samples along one axis start and the offset t in [0, 1).
// Integer division is the costliest instruction here (tens of cycles, 12 per point), so
// periodic wrapping multiplies by 1/n and fixes the index up with compares instead.
inline State locate_axis(double u, int64_t n, double inv_n, bool periodic, int64_t idx[4], double& t) {
    if (!std::isfinite(u)) return NONFINITE;
    if (periodic) {
        const double nd = static_cast<double>(n);
        const double w = u - nd * std::floor(u * inv_n);  // in [0, n] up to rounding
        const double fl = std::floor(w);
        t = w - fl;
        int64_t i = static_cast<int64_t>(fl);
        if (i < 0) i += n;
        if (i >= n) i -= n;
        if (n >= 3) {  // i + a - 1 lies in [-1, n + 1]: one correction either way
            for (int a = 0; a < 4; ++a) {
                int64_t j = i + a - 1;
                j = j < 0 ? j + n : j;
                idx[a] = j >= n ? j - n : j;
            }
        } else {
            for (int a = 0; a < 4; ++a) idx[a] = (i + a - 1 + n) % n;
        }
        return INSIDE;
    }
    const double fl = std::floor(u);
    if (fl - 1 < 0 || fl + 2 > static_cast<double>(n - 1)) return OUTSIDE;
    t = u - fl;
    const int64_t i = static_cast<int64_t>(fl);
    for (int a = 0; a < 4; ++a) idx[a] = i + a - 1;
    return INSIDE;
}

template <typename T>
inline void weights(int method, T t, T w[4]) {
    const T t2 = t * t, t3 = t2 * t;
    if (method == CATMULL_ROM) {
        w[0] = T(0.5) * (-t + T(2) * t2 - t3);
        w[1] = T(1) + T(0.5) * (T(3) * t3 - T(5) * t2);
        w[2] = T(0.5) * (t + T(4) * t2 - T(3) * t3);
        w[3] = T(0.5) * (t3 - t2);
    } else {  // Lagrange through nodes -1, 0, 1, 2
        w[0] = -(t3 - T(3) * t2 + T(2) * t) / T(6);
        w[1] = (t3 - T(2) * t2 - t + T(2)) / T(2);
        w[2] = -(t3 - t2 - T(2) * t) / T(2);
        w[3] = (t3 - t) / T(6);
    }
}

template <typename T>
inline void dweights(int method, T t, T d[4]) {
    const T t2 = t * t;
    if (method == CATMULL_ROM) {
        d[0] = T(0.5) * (T(-1) + T(4) * t - T(3) * t2);
        d[1] = T(0.5) * (T(9) * t2 - T(10) * t);
        d[2] = T(0.5) * (T(1) + T(8) * t - T(9) * t2);
        d[3] = T(0.5) * (T(3) * t2 - T(2) * t);
    } else {
        d[0] = -(T(3) * t2 - T(6) * t + T(2)) / T(6);
        d[1] = (T(3) * t2 - T(4) * t - T(1)) / T(2);
        d[2] = -(T(3) * t2 - T(2) * t - T(2)) / T(2);
        d[3] = (T(3) * t2 - T(1)) / T(6);
    }
}

// Everything one point needs: flat offsets per axis (pre-multiplied by the map's strides) and t.
struct Stencil {
    int64_t ox[4], oy[4], oz[4];
    double t[3];
};

template <typename T>
inline State locate(const Params& P, const T* p, Stencil& s) {
    const double x = p[0], y = p[1], z = p[2];
    State st = INSIDE;
    for (int r = 0; r < 3; ++r) {
        int64_t* idx = r == 0 ? s.ox : (r == 1 ? s.oy : s.oz);
        State sr = locate_axis(voxel_coord(P, r, x, y, z), P.n[r], P.inv_n[r], P.periodic, idx, s.t[r]);
        if (sr == NONFINITE) return NONFINITE;
        if (sr == OUTSIDE) st = OUTSIDE;  // keep looking: a NaN on a later axis wins
    }
    if (st != INSIDE) return st;
    for (int a = 0; a < 4; ++a) {
        s.ox[a] *= P.s[0];
        s.oy[a] *= P.s[1];
        s.oz[a] *= P.s[2];
    }
    return INSIDE;
}

inline void prefetch_stencil(const void* base, size_t itemsize, const Stencil& s) {
#if defined(__GNUC__)
    const char* b = static_cast<const char*>(base);
    for (int a = 0; a < 4; ++a)
        for (int c = 0; c < 4; ++c) {
            __builtin_prefetch(b + (s.ox[a] + s.oy[c] + s.oz[0]) * itemsize);
            __builtin_prefetch(b + (s.ox[a] + s.oy[c] + s.oz[3]) * itemsize);
        }
#else
    (void)base, (void)itemsize, (void)s;
#endif
}

#if defined(__GNUC__)
// Four consecutive z samples as one vector (GCC/Clang vector extension: SSE on baseline
// x86-64, NEON on Arm): the contraction becomes 16 row loads and 16 multiply-adds instead of
// 64 scalar ones. Rows wrap across the map edge only near z = 0 or nz - 1.
template <typename T>
struct Vec4 {
    typedef T type __attribute__((vector_size(4 * sizeof(T))));
};

template <typename T>
inline typename Vec4<T>::type load_row(const T* row, const int64_t oz[4], bool contiguous) {
    typename Vec4<T>::type v;
    if (contiguous) {
        std::memcpy(&v, row + oz[0], sizeof(v));
    } else {
        v = typename Vec4<T>::type{row[oz[0]], row[oz[1]], row[oz[2]], row[oz[3]]};
    }
    return v;
}

template <typename T>
inline T contract(const T* rho, const Stencil& s, const T wx[4], const T wy[4], const T wz[4]) {
    const bool contiguous = s.oz[3] == s.oz[0] + 3;
    typename Vec4<T>::type acc = {0, 0, 0, 0};
    for (int a = 0; a < 4; ++a) {
        typename Vec4<T>::type pa = {0, 0, 0, 0};
        for (int b = 0; b < 4; ++b) pa += wy[b] * load_row(rho + s.ox[a] + s.oy[b], s.oz, contiguous);
        acc += wx[a] * pa;
    }
    return wz[0] * acc[0] + wz[1] * acc[1] + wz[2] * acc[2] + wz[3] * acc[3];
}
#else
template <typename T>
inline T contract(const T* rho, const Stencil& s, const T wx[4], const T wy[4], const T wz[4]) {
    T acc = 0;
    for (int a = 0; a < 4; ++a) {
        T pa = 0;
        for (int b = 0; b < 4; ++b) {
            const T* row = rho + s.ox[a] + s.oy[b];
            pa += wy[b] * (wz[0] * row[s.oz[0]] + wz[1] * row[s.oz[1]] + wz[2] * row[s.oz[2]] + wz[3] * row[s.oz[3]]);
        }
        acc += wx[a] * pa;
    }
    return acc;
}
#endif

int thread_count(int requested) {
    if (requested > 0) return requested;
#ifndef KERNELS_NO_OPENMP
    return omp_get_max_threads();
#else
    return std::max(1u, std::thread::hardware_concurrency());
#endif
}

// Runs body(thread_index, n_threads) on n_threads threads.
template <typename F>
void parallel(int n_threads, F body) {
#ifndef KERNELS_NO_OPENMP
#pragma omp parallel num_threads(n_threads)
    body(omp_get_thread_num(), omp_get_num_threads());
#else
    std::vector<std::thread> pool;
    for (int i = 1; i < n_threads; ++i) pool.emplace_back(body, i, n_threads);
    body(0, n_threads);
    for (auto& th : pool) th.join();
#endif
}

// Points are processed in chunks, each chunk in order of its x-plane (a stable counting
// sort): random points on a map larger than L2 are bound by cache latency (about 20 lines
// per point), while in x order the 4 planes a point needs stay in L2 for the next points.
// Buffers: two int32 per point of one chunk per thread, so 10^7 points need no more memory
// than 2^20 of them.
constexpr int64_t CHUNK = int64_t(1) << 18;

// Calls body(p, stencil, state) for every point, chunk by chunk in x-plane order. Threads take
// chunks from a shared counter (not a fixed share each): on a busy machine a descheduled
// thread then delays one chunk, not half the work.
// How many points (in sorted order) ahead the map lines are prefetched: small chunks (few
// points per plane) and maps larger than the caches leave each point latency-bound otherwise.
// Each point issues up to 32 prefetches, so a few points ahead already keep more lines in
// flight than a core has fill buffers; asking further ahead only evicts lines not yet used.
constexpr int AHEAD = 4;

template <typename T, typename F>
void for_each_sorted(const Params& P, const T* rho, const T* pts, int64_t n_points, int n_threads, F body) {
    const int64_t nx = P.n[0];
    const int64_t chunk = std::max<int64_t>(1024, std::min<int64_t>(CHUNK, n_points / (4 * n_threads) + 1));
    std::atomic<int64_t> next{0};
    parallel(n_threads, [&](int, int) {
        std::vector<int32_t> key, order;
        std::vector<int64_t> start(nx + 1);
        for (int64_t c0 = next.fetch_add(chunk); c0 < n_points; c0 = next.fetch_add(chunk)) {
            const int64_t m = std::min(chunk, n_points - c0);
            key.resize(m);
            order.resize(m);
            std::fill(start.begin(), start.end(), 0);
            for (int64_t k = 0; k < m; ++k) {
                const T* q = pts + 3 * (c0 + k);
                int64_t ix[4];
                double t;
                int64_t b = 0;
                if (locate_axis(voxel_coord(P, 0, q[0], q[1], q[2]), nx, P.inv_n[0], P.periodic, ix, t) == INSIDE)
                    b = ix[1];  // the plane at floor(u)
                key[k] = static_cast<int32_t>(b);
                ++start[b + 1];
            }
            for (int64_t b = 0; b < nx; ++b) start[b + 1] += start[b];
            for (int64_t k = 0; k < m; ++k) order[start[key[k]]++] = static_cast<int32_t>(k);
            Stencil ring[AHEAD];
            State state[AHEAD];
            auto fetch = [&](int64_t k, int slot) {
                state[slot] = locate(P, pts + 3 * (c0 + order[k]), ring[slot]);
                if (state[slot] == INSIDE) prefetch_stencil(rho, sizeof(T), ring[slot]);
            };
            for (int64_t k = 0; k < std::min<int64_t>(AHEAD, m); ++k) fetch(k, static_cast<int>(k));
            for (int64_t k = 0; k < m; ++k) {
                const int slot = static_cast<int>(k % AHEAD);
                const Stencil s = ring[slot];
                const State st = state[slot];
                if (k + AHEAD < m) fetch(k + AHEAD, slot);
                body(c0 + order[k], s, st);
            }
        }
    });
}

template <typename T>
void forward(const Params& P, const T* rho, const T* pts, int64_t n_points, T* out, int method, T fill,
             int n_threads) {
    for_each_sorted(P, rho, pts, n_points, n_threads, [&](int64_t p, const Stencil& s, State st) {
        if (st == NONFINITE) {
            out[p] = std::numeric_limits<T>::quiet_NaN();
            return;
        }
        if (st == OUTSIDE) {
            out[p] = fill;
            return;
        }
        T wx[4], wy[4], wz[4];
        weights<T>(method, T(s.t[0]), wx);
        weights<T>(method, T(s.t[1]), wy);
        weights<T>(method, T(s.t[2]), wz);
        out[p] = contract(rho, s, wx, wy, wz);
    });
}

template <typename T>
void backward_points(const Params& P, const T* rho, const T* pts, int64_t n_points, const T* grad_out,
                     T* grad_pts, int method, int n_threads) {
    // d value / d point = frac^T · (m ⊙ d value / d u)
    double J[9];
    for (int r = 0; r < 3; ++r)
        for (int k = 0; k < 3; ++k) J[3 * r + k] = P.frac[3 * r + k] * P.m[r];
    for_each_sorted(P, rho, pts, n_points, n_threads, [&](int64_t p, const Stencil& s, State st) {
        T* gp = grad_pts + 3 * p;
        if (st != INSIDE) {
            gp[0] = gp[1] = gp[2] = 0;
            return;
        }
        T wx[4], wy[4], wz[4], dx[4], dy[4], dz[4];
        weights<T>(method, T(s.t[0]), wx);
        weights<T>(method, T(s.t[1]), wy);
        weights<T>(method, T(s.t[2]), wz);
        dweights<T>(method, T(s.t[0]), dx);
        dweights<T>(method, T(s.t[1]), dy);
        dweights<T>(method, T(s.t[2]), dz);
        T gx = 0, gy = 0, gz = 0;
        for (int a = 0; a < 4; ++a) {
            T va = 0, ya = 0, za = 0;
            for (int b = 0; b < 4; ++b) {
                const T* row = rho + s.ox[a] + s.oy[b];
                T sv = 0, sd = 0;
                for (int c = 0; c < 4; ++c) {
                    const T r = row[s.oz[c]];
                    sv += wz[c] * r;
                    sd += dz[c] * r;
                }
                va += wy[b] * sv;
                ya += dy[b] * sv;
                za += wy[b] * sd;
            }
            gx += dx[a] * va;
            gy += wx[a] * ya;
            gz += wx[a] * za;
        }
        const double g = grad_out[p];
        const double gu[3] = {g * gx, g * gy, g * gz};
        for (int k = 0; k < 3; ++k) gp[k] = T(J[k] * gu[0] + J[3 + k] * gu[1] + J[6 + k] * gu[2]);
    });
}

template <typename T>
void backward_map(const Params& P, const T* pts, int64_t n_points, const T* grad_out, T* grad_rho, int method,
                  int n_threads) {
    const int64_t nx = P.n[0];
    n_threads = static_cast<int>(std::min<int64_t>(n_threads, std::max<int64_t>(nx, 1)));
    parallel(n_threads, [&](int tid, int nt) {
        // this thread owns x-planes [xlo, xhi)
        const int64_t xlo = nx * tid / nt, xhi = nx * (tid + 1) / nt;
        for (int64_t p = 0; p < n_points; ++p) {
            const T* q = pts + 3 * p;
            // cheap rejection on the x axis alone
            int64_t ix[4];
            double tx;
            if (locate_axis(voxel_coord(P, 0, q[0], q[1], q[2]), nx, P.inv_n[0], P.periodic, ix, tx) != INSIDE)
                continue;
            bool mine = false;
            for (int a = 0; a < 4; ++a) mine |= (ix[a] >= xlo && ix[a] < xhi);
            if (!mine) continue;
            Stencil s;
            if (locate(P, q, s) != INSIDE) continue;
            T wx[4], wy[4], wz[4];
            weights<T>(method, T(s.t[0]), wx);
            weights<T>(method, T(s.t[1]), wy);
            weights<T>(method, T(s.t[2]), wz);
            const T g = grad_out[p];
            for (int a = 0; a < 4; ++a) {
                if (ix[a] < xlo || ix[a] >= xhi) continue;
                const T ga = g * wx[a];
                for (int b = 0; b < 4; ++b) {
                    T* row = grad_rho + s.ox[a] + s.oy[b];
                    const T gab = ga * wy[b];
                    for (int c = 0; c < 4; ++c) row[s.oz[c]] += gab * wz[c];
                }
            }
        }
    });
}

}  // namespace

namespace kernels::tricubic {

namespace {

Params make_params(const Grid& grid, int64_t s0, int64_t s1, int64_t s2) {
    for (int r = 0; r < 3; ++r)
        if (grid.shape[r] < 1) throw std::invalid_argument("map shape must be positive");
    if (s0 < 0 || s1 < 0 || s2 < 0) throw std::invalid_argument("map strides must be non-negative");
    if (grid.method != CATMULL_ROM && grid.method != LAGRANGE)
        throw std::invalid_argument("method must be catmull-rom (0) or lagrange (1)");
    Params P;
    std::copy(grid.frac, grid.frac + 9, P.frac);
    std::copy(grid.sampling, grid.sampling + 3, P.m);
    std::copy(grid.origin, grid.origin + 3, P.o);
    std::copy(grid.shape, grid.shape + 3, P.n);
    P.s[0] = s0;
    P.s[1] = s1;
    P.s[2] = s2;
    P.periodic = grid.periodic;
    for (int r = 0; r < 3; ++r) P.inv_n[r] = 1.0 / static_cast<double>(P.n[r]);
    return P;
}

template <typename T>
void forward_t(const Grid& grid, const T* rho, const T* points, int64_t n_points, T* out, T fill, int n_threads) {
    const Params P = make_params(grid, grid.strides[0], grid.strides[1], grid.strides[2]);
    ::forward<T>(P, rho, points, n_points, out, grid.method, fill, thread_count(n_threads));
}

template <typename T>
void backward_t(const Grid& grid, const T* rho, const T* points, int64_t n_points, const T* grad_out, T* grad_points,
                T* grad_rho, int n_threads) {
    const Params P = make_params(grid, grid.strides[0], grid.strides[1], grid.strides[2]);
    // the map gradient's own (C-contiguous) strides
    const Params Pg = make_params(grid, grid.shape[1] * grid.shape[2], grid.shape[2], 1);
    const int nt = thread_count(n_threads);
    if (grad_points) backward_points<T>(P, rho, points, n_points, grad_out, grad_points, grid.method, nt);
    if (grad_rho) backward_map<T>(Pg, points, n_points, grad_out, grad_rho, grid.method, nt);
}

}  // namespace

void forward(const Grid& grid, const float* rho, const float* points, int64_t n_points, float* out, float fill,
             int n_threads) {
    forward_t(grid, rho, points, n_points, out, fill, n_threads);
}
void forward(const Grid& grid, const double* rho, const double* points, int64_t n_points, double* out, double fill,
             int n_threads) {
    forward_t(grid, rho, points, n_points, out, fill, n_threads);
}
void backward(const Grid& grid, const float* rho, const float* points, int64_t n_points, const float* grad_out,
              float* grad_points, float* grad_rho, int n_threads) {
    backward_t(grid, rho, points, n_points, grad_out, grad_points, grad_rho, n_threads);
}
void backward(const Grid& grid, const double* rho, const double* points, int64_t n_points, const double* grad_out,
              double* grad_points, double* grad_rho, int n_threads) {
    backward_t(grid, rho, points, n_points, grad_out, grad_points, grad_rho, n_threads);
}

}  // namespace kernels::tricubic
