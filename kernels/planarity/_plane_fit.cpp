// Python bindings of the CPU planarity restraint (plane_fit.hpp) through nanobind.
//
// Every array is C-contiguous on the CPU and crosses unconverted; positions, weights and
// outputs share one dtype, float32 or float64 (one overload each), the indices are int32.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <string>

#include "plane_fit.hpp"

namespace nb = nanobind;
using namespace nb::literals;
namespace kp = kernels::planarity;

namespace {

template <class T, int64_t... Dims>
using Array = nb::ndarray<T, nb::shape<Dims...>, nb::c_contig, nb::device::cpu>;
using Index = Array<const int32_t, -1, -1>;

template <class A>
void check_planes(const Index& index, const A& arr, const char* what, size_t cols) {
    if (arr.shape(0) != index.shape(0) || arr.shape(1) != cols)
        throw nb::value_error((std::string(what) + " must have shape (" + std::to_string(index.shape(0)) + ", " +
                               std::to_string(cols) + ") for index of shape (" + std::to_string(index.shape(0)) +
                               ", " + std::to_string(index.shape(1)) + ")")
                                  .c_str());
}

template <class T>
void bind(nb::module_& m) {
    m.def(
        "fit",
        [](Array<const T, -1, 3> xyz, Index index, Array<const T, -1, -1> weight, Array<T, -1, -1> coef,
           Array<T, -1, 3> normal) {
            const size_t K = index.shape(1);
            if (K < 1) throw nb::value_error("planes need at least one slot (index of shape (P, K >= 1))");
            check_planes(index, weight, "weight", K);
            check_planes(index, coef, "coef", K);
            check_planes(index, normal, "normal", 3);
            nb::gil_scoped_release release;
            return kp::fit(xyz.data(), index.data(), weight.data(), coef.data(), normal.data(),
                           static_cast<int64_t>(index.shape(0)), static_cast<int64_t>(K));
        },
        "xyz"_a.noconvert(), "index"_a.noconvert(), "weight"_a.noconvert(), "coef"_a.noconvert(),
        "normal"_a.noconvert(),
        "Weighted fit of every plane. xyz (N, 3); index (P, K) int32, atom of each slot in [0, N) (padding\n"
        "repeats the first atom); weight (P, K) 1/σ² (0 in padding). Writes coef (P, K) = w·d and normal (P, 3)\n"
        "(both 0 for a degenerate plane); returns the data term Σ ½ w d² (float, summed in plane order).");
    m.def(
        "scatter",
        [](Index index, Array<const T, -1, -1> coef, Array<const T, -1, 3> normal, Array<T, -1, 3> grad, double g) {
            const size_t K = index.shape(1);
            check_planes(index, coef, "coef", K);
            check_planes(index, normal, "normal", 3);
            nb::gil_scoped_release release;
            kp::scatter(index.data(), coef.data(), normal.data(), grad.data(), static_cast<int64_t>(grad.shape(0)),
                        static_cast<int64_t>(index.shape(0)), static_cast<int64_t>(K), g);
        },
        "index"_a.noconvert(), "coef"_a.noconvert(), "normal"_a.noconvert(), "grad"_a.noconvert(), "g"_a,
        "Overwrites grad (N, 3) with Σ over slots of g · coef · normal, serially (deterministic). index, coef and\n"
        "normal as fit() wrote them.");
}

}  // namespace

NB_MODULE(_plane_fit, m) {
    m.doc() = "Planarity restraint: plane fit and gradient scatter (C++), private to kernels.planarity.cpu.";
    bind<float>(m);
    bind<double>(m);
}
