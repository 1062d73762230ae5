// Python bindings of the CPU's per-shell sums (shell_sums.hpp) through nanobind.
//
// Arrays cross as typed nb::ndarray (numpy arrays through the buffer protocol) with dtype, shape, C
// order and device checked here and never converted: a mismatch raises TypeError. The GIL is released
// for the whole call, so threads that share a call's blocks run at once.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <string>

#include "shell_sums.hpp"

namespace nb = nanobind;
using namespace nb::literals;
namespace kr = kernels::reciprocal;

namespace {

using AnyVector = nb::ndarray<nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Index = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Sums = nb::ndarray<double, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

kr::Factors factors(const AnyVector& a, int n_comp, const char* name) {
    if (n_comp != 1 && n_comp != 2) throw nb::value_error("n_comp must be 1 (real amplitudes) or 2 (re, im pairs)");
    const bool is_double = a.dtype() == nb::dtype<double>();
    if (!is_double && a.dtype() != nb::dtype<float>())
        throw nb::type_error((std::string(name) + " must be float32 or float64").c_str());
    if (a.shape(0) % n_comp) throw nb::value_error((std::string(name) + " has an odd length for re, im pairs").c_str());
    return {a.data(), is_double, n_comp};
}

}  // namespace

NB_MODULE(_shells, m) {
    m.doc() = "The CPU's per-shell sums of kernels.reciprocal.shells (C++, float64).";

    m.def(
        "block_sums",
        [](AnyVector f, int f_comp, AnyVector r, int r_comp, Index which, int64_t lo, int64_t hi, Sums out) {
            const kr::Factors ff = factors(f, f_comp, "f"), rf = factors(r, r_comp, "reference");
            const int64_t m = static_cast<int64_t>(f.shape(0)) / f_comp;
            if (static_cast<int64_t>(r.shape(0)) / r_comp != m)
                throw nb::value_error("f and reference hold different numbers of reflections");
            if (static_cast<int64_t>(which.shape(0)) != m) throw nb::value_error("which must give every reflection's shell");
            if (out.shape(0) != kr::kRows) throw nb::value_error("out must have 10 rows");
            if (lo < 0 || hi < lo || hi > m) throw nb::value_error("the block [lo, hi) must lie in the set");
            const int64_t n_shells = static_cast<int64_t>(out.shape(1));
            bool in_range = true;
            {
                nb::gil_scoped_release release;  // the check too: it reads the whole block
                for (int64_t j = lo; j < hi && in_range; ++j) in_range = which.data()[j] >= 0 && which.data()[j] < n_shells;
                if (in_range) kr::block_sums(ff, rf, which.data(), lo, hi, n_shells, out.data());
            }
            if (!in_range) throw nb::value_error("a shell index is out of range");
        },
        "f"_a.noconvert(), "f_comp"_a, "reference"_a.noconvert(), "r_comp"_a, "which"_a.noconvert(), "lo"_a, "hi"_a,
        "out"_a.noconvert(),
        "Adds the ten per-reflection values of shells.py's _ROWS of reflections [lo, hi) to out (10, n_shells)\n"
        "float64 at each one's shell which[j] (M,) int64, in position order: f and reference float32 or\n"
        "float64, as (re, im) pairs (comp 2, a complex array's float view) or real amplitudes (comp 1).");
}
