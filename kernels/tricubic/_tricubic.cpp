// Python bindings of the CPU tricubic interpolation (tricubic.hpp) through nanobind.
//
// The map crosses with its strides (any layout, never copied: a Fortran-ordered view of a gemmi
// grid is read in place); points, outputs and gradients are C-contiguous. Map, points and
// outputs share one dtype, float32 or float64 (one overload each); nothing is converted, so a
// mismatch raises TypeError naming the arrays expected.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <string>

#include "tricubic.hpp"

namespace nb = nanobind;
using namespace nb::literals;
namespace kt = kernels::tricubic;

namespace {

template <class T>
using Map = nb::ndarray<const T, nb::shape<-1, -1, -1>, nb::device::cpu>;
template <class T, int64_t... Dims>
using Array = nb::ndarray<T, nb::shape<Dims...>, nb::c_contig, nb::device::cpu>;
using Params = Array<const double, 15>;

int method_code(const std::string& method) {
    if (method == "catmull-rom") return kt::CATMULL_ROM;
    if (method == "lagrange") return kt::LAGRANGE;
    throw nb::value_error(("method must be 'catmull-rom' or 'lagrange', got '" + method + "'").c_str());
}

template <class T>
kt::Grid make_grid(const Map<T>& rho, const Params& params, const std::string& method, bool periodic) {
    kt::Grid g;
    const double* q = params.data();
    std::copy(q, q + 9, g.frac);
    std::copy(q + 9, q + 12, g.sampling);
    std::copy(q + 12, q + 15, g.origin);
    for (int r = 0; r < 3; ++r) {
        g.shape[r] = static_cast<int64_t>(rho.shape(r));
        g.strides[r] = rho.stride(r);
    }
    g.periodic = periodic;
    g.method = method_code(method);
    return g;
}

void check_points(size_t n, size_t m, const char* what) {
    if (n != m)
        throw nb::value_error(
            (std::string(what) + " has " + std::to_string(m) + " rows for " + std::to_string(n) + " points").c_str());
}

template <class T>
void bind(nb::module_& m) {
    m.def(
        "forward",
        [](Map<T> rho, Array<const T, -1, 3> points, Array<T, -1> out, Params params, const std::string& method,
           bool periodic, double fill_value, int n_threads) {
            check_points(points.shape(0), out.shape(0), "out");
            const kt::Grid g = make_grid(rho, params, method, periodic);
            nb::gil_scoped_release release;
            kt::forward(g, rho.data(), points.data(), static_cast<int64_t>(points.shape(0)), out.data(),
                        static_cast<T>(fill_value), n_threads);
        },
        "rho"_a.noconvert(), "points"_a.noconvert(), "out"_a.noconvert(), "params"_a.noconvert(), nb::kw_only(),
        "method"_a, "periodic"_a, "fill_value"_a = 0.0, "n_threads"_a = 0,
        "Writes the map rho (nx, ny, nz; any strides) interpolated at points (N, 3) to out (N,), all float32 or\n"
        "all float64. params: (15,) float64, frac row-major (9), sampling (3), origin (3) (see\n"
        "kernels.tricubic.reference.grid_parameters). method: 'catmull-rom' or 'lagrange'. periodic=False:\n"
        "points whose neighbourhood leaves the map get fill_value. n_threads <= 0: the runtime's default.");
    m.def(
        "backward",
        [](Map<T> rho, Array<const T, -1, 3> points, Array<const T, -1> grad_out, Array<T, -1, 3> grad_points,
           Array<T, -1, -1, -1> grad_rho, Params params, const std::string& method, bool periodic, int n_threads) {
            const size_t n = points.shape(0);
            check_points(n, grad_out.shape(0), "grad_out");
            if (grad_points.is_valid()) check_points(n, grad_points.shape(0), "grad_points");
            if (grad_rho.is_valid())
                for (int r = 0; r < 3; ++r)
                    if (grad_rho.shape(r) != rho.shape(r)) throw nb::value_error("grad_rho must have rho's shape");
            const kt::Grid g = make_grid(rho, params, method, periodic);
            nb::gil_scoped_release release;
            kt::backward(g, rho.data(), points.data(), static_cast<int64_t>(n), grad_out.data(),
                         grad_points.is_valid() ? grad_points.data() : nullptr,
                         grad_rho.is_valid() ? grad_rho.data() : nullptr, n_threads);
        },
        "rho"_a.noconvert(), "points"_a.noconvert(), "grad_out"_a.noconvert(), "grad_points"_a.noconvert().none(),
        "grad_rho"_a.noconvert().none(), "params"_a.noconvert(), nb::kw_only(), "method"_a, "periodic"_a,
        "n_threads"_a = 0,
        "Gradients of sum(grad_out * forward(...)): grad_points (N, 3) is written in full; grad_rho (nx, ny, nz,\n"
        "C order whatever rho's strides) must arrive zeroed. Either may be None (not computed). Arguments as\n"
        "for forward().");
}

}  // namespace

NB_MODULE(_tricubic, m) {
    m.doc() = "Tricubic interpolation kernels (C++/OpenMP), private to kernels.tricubic.cpu.";
    bind<float>(m);
    bind<double>(m);
}
