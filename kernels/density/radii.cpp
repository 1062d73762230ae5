// The per-atom steps outside the map (scatter.hpp): cutoff radii (gemmi's rule; anisotropic rules),
// fractional positions, the positive-definiteness check of U, and how this build runs.
#include "anisotropic.hpp"

namespace kernels::density {

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

BuildInfo build_info() {
    BuildInfo info;
#ifndef KERNELS_NO_OPENMP
    info.threads = "std::thread pool, OpenMP";
#else
    info.threads = "std::thread";
#endif
#if defined(KERNELS_ISA_VARIANTS)
    info.clones = true;
#else
    info.clones = false;
#endif
    // the variant drivers.cpp runs on this CPU
    const int isa = cpu_isa();
    info.forward_isa = isa == 4 ? "x86-64-v4" : isa == 3 ? "x86-64-v3" : "baseline";
    info.backward_isa = info.forward_isa;
    return info;
}

}  // namespace kernels::density
