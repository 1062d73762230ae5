// Python bindings of the CPU density splat (scatter.hpp) through nanobind.
//
// Arrays cross as typed nb::ndarray (torch CPU tensors through DLPack, numpy arrays through
// the buffer protocol), with dtype, shape, C order and device checked here and never
// converted: a mismatch raises TypeError naming the expected array, where a silent copy of
// an output would lose what the kernel writes.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "map_buffers.hpp"
#include "scatter.hpp"

namespace nb = nanobind;
using namespace nb::literals;
namespace kd = kernels::density;

namespace {

template <class T, int64_t... Dims>
using Array = nb::ndarray<T, nb::shape<Dims...>, nb::c_contig, nb::device::cpu>;

using Matrix3 = Array<const double, 3, 3>;

kd::CellGeometry make_cell(const Matrix3& metric, const Matrix3& orth, const std::array<double, 3>& recip, int kind) {
    if (kind < 0 || kind > 2)
        throw nb::value_error("kind must be 0 (z separable: orthogonal, hexagonal), 1 (y separable: monoclinic) "
                              "or 2 (triclinic)");
    kd::CellGeometry c;
    std::copy(metric.data(), metric.data() + 9, c.metric);
    std::copy(orth.data(), orth.data() + 9, c.orth);
    std::copy(recip.begin(), recip.end(), c.recip);
    c.kind = kind;
    return c;
}

// An atom set as the kernel reads it. Holds its arrays (and so the tensors behind them) for
// as long as it lives, so one Atoms serves a forward and its backward.
struct Atoms {
    Array<const double, -1, 3> frac;
    Array<const float, -1> b_iso, occ;
    Array<const float, -1, kd::kGaussians> a, b;
    Array<const double, -1> radii;  // invalid (None): radii from cutoff
    double cutoff;
    Array<const float, -1, 6> u_aniso;  // invalid (None): isotropic atoms
    Array<const uint8_t, -1> aniso;     // with u_aniso

    Atoms(Array<const double, -1, 3> frac_, Array<const float, -1> b_iso_, Array<const float, -1> occ_,
          Array<const float, -1, kd::kGaussians> a_, Array<const float, -1, kd::kGaussians> b_,
          Array<const double, -1> radii_, double cutoff_, Array<const float, -1, 6> u_aniso_,
          Array<const uint8_t, -1> aniso_)
        : frac(frac_), b_iso(b_iso_), occ(occ_), a(a_), b(b_), radii(radii_), cutoff(cutoff_), u_aniso(u_aniso_),
          aniso(aniso_) {
        const size_t n = frac.shape(0);
        auto check = [n](size_t m, const char* what) {
            if (m != n)
                throw nb::value_error(
                    (std::string(what) + " has " + std::to_string(m) + " rows, frac has " + std::to_string(n)).c_str());
        };
        check(b_iso.shape(0), "b_iso");
        check(occ.shape(0), "occ");
        check(a.shape(0), "a");
        check(b.shape(0), "b");
        if (radii.is_valid()) check(radii.shape(0), "radii");
        else if (!(cutoff > 0))
            throw nb::value_error("without radii the density cutoff must be a positive number of e/Å³");
        if (u_aniso.is_valid() != aniso.is_valid())
            throw nb::value_error("anisotropic atoms need both u_aniso (N, 6) and aniso (N,)");
        if (u_aniso.is_valid()) {
            check(u_aniso.shape(0), "u_aniso");
            check(aniso.shape(0), "aniso");
            if (!radii.is_valid()) throw nb::value_error("anisotropic atoms need their radii");
        }
    }

    bool anisotropic() const { return u_aniso.is_valid(); }

    int64_t size() const { return static_cast<int64_t>(frac.shape(0)); }

    kd::AtomArrays view() const {
        kd::AtomArrays v;
        v.n = size();
        v.frac = frac.data();
        v.radii = radii.is_valid() ? radii.data() : nullptr;
        v.cutoff = cutoff;
        v.b_iso = b_iso.data();
        v.occ = occ.data();
        v.a = a.data();
        v.b = b.data();
        if (u_aniso.is_valid()) {
            v.u_aniso = u_aniso.data();
            v.aniso = aniso.data();
        }
        return v;
    }
};

nb::dict timings_dict(const kd::Timings& tm) {
    nb::dict d;
    d["prepare"] = tm.prepare;
    d["partition"] = tm.partition;
    d["compute"] = tm.compute;
    d["tasks"] = tm.tasks;
    d["rows_reused"] = tm.rows_reused;
    d["exp_visits"] = tm.exp_visits;
    return d;
}

template <class T>
using Maps = nb::ndarray<T, nb::c_contig, nb::device::cpu>;

// The grid shape of a map (nx, ny, nz) or of a stack of maps (n_maps, nx, ny, nz); returns n_maps.
template <class T>
int64_t map_shape(const Maps<T>& map, const char* what, int64_t shape[3]) {
    const size_t nd = map.ndim();
    if (nd != 3 && nd != 4)
        throw nb::value_error((std::string(what) + " must be a map (nx, ny, nz) or maps (n, nx, ny, nz), got " +
                               std::to_string(nd) + " dimensions")
                                  .c_str());
    for (size_t d = 0; d < nd; ++d)
        if (map.shape(d) < 1) throw nb::value_error((std::string(what) + ": every axis needs an entry").c_str());
    for (int d = 0; d < 3; ++d) shape[d] = int64_t(map.shape(nd - 3 + d));
    return nd == 4 ? int64_t(map.shape(0)) : 1;
}

void check_frames(const Atoms& atoms, int64_t n_maps) {
    if (atoms.size() % n_maps != 0)
        throw nb::value_error(("the " + std::to_string(atoms.size()) + " atoms do not split into " +
                               std::to_string(n_maps) + " frames of equal size")
                                  .c_str());
}

void check_rows(const Atoms& atoms, size_t n, const char* what) {
    if (static_cast<int64_t>(n) != atoms.size())
        throw nb::value_error((std::string(what) + " has " + std::to_string(n) + " rows for " +
                               std::to_string(atoms.size()) + " atoms")
                                  .c_str());
}

struct HeldMap {
    float* ptr;
    size_t bytes;
};

const char* const kModuleDoc =
    "Separable density splat and its gradient gather on the CPU (C++, a std::thread pool).\n\n"
    "Private to kernels.density.cpu: arrays are C-contiguous CPU arrays of exactly the dtypes named\n"
    "(torch tensors pass through DLPack, never copied). Every option gives bitwise the same results.";

}  // namespace

NB_MODULE(_scatter, m) {
    m.doc() = kModuleDoc;
    // A forward's Cell and RowIntervals live in torch's autograd graph, which Python does not
    // collect at interpreter exit: nanobind would report them as leaks when they are not.
    nb::set_leak_warnings(false);

    nb::class_<kd::CellGeometry>(m, "Cell",
                                 "The cell as the kernel reads it: metric G = orthᵀ·orth (3, 3) float64, orth "
                                 "(3, 3) float64 (fractional -> Cartesian), recip (|a*|, |b*|, |c*|), kind (0 "
                                 "orthogonal/hexagonal, 1 monoclinic, 2 triclinic).")
        .def(
            "__init__",
            [](kd::CellGeometry* self, const Matrix3& metric, const Matrix3& orth, const std::array<double, 3>& recip,
               int kind) { new (self) kd::CellGeometry(make_cell(metric, orth, recip, kind)); },
            "metric"_a.noconvert(), "orth"_a.noconvert(), "recip"_a, "kind"_a);

    nb::class_<Atoms>(m, "Atoms",
                      "One atom set: frac (N, 3) float64, b_iso (N,), occ (N,), a (N, 5), b (N, 5) float32; radii "
                      "(N,) float64 in Å, or None for each atom's radius from cutoff (e/Å³, gemmi's rule). "
                      "Anisotropic set: u_aniso (N, 6) float32 (U11, U22, U33, U12, U13, U23, Å²) and aniso (N,) "
                      "uint8 (1: the atom uses its U, 0: b_iso/8π²·I); radii then required. Keeps its arrays alive.")
        .def(nb::init<Array<const double, -1, 3>, Array<const float, -1>, Array<const float, -1>,
                      Array<const float, -1, kd::kGaussians>, Array<const float, -1, kd::kGaussians>,
                      Array<const double, -1>, double, Array<const float, -1, 6>, Array<const uint8_t, -1>>(),
             "frac"_a.noconvert(), "b_iso"_a.noconvert(), "occ"_a.noconvert(), "a"_a.noconvert(), "b"_a.noconvert(),
             nb::kw_only(), "radii"_a.noconvert().none() = nb::none(), "cutoff"_a = 0.0,
             "u_aniso"_a.noconvert().none() = nb::none(), "aniso"_a.noconvert().none() = nb::none())
        .def_prop_ro("anisotropic", &Atoms::anisotropic)
        .def("__len__", &Atoms::size);

    nb::class_<kd::RowIntervals>(m, "RowIntervals",
                                 "Opaque: the row intervals a splat() kept for gather() of the same atoms and grid.")
        .def_ro("n_atoms", &kd::RowIntervals::n_atoms)
        .def_prop_ro("nbytes", [](const kd::RowIntervals& r) { return r.n_values * int64_t(sizeof(int16_t)); });

    m.def(
        "splat",
        [](Maps<float> out, const kd::CellGeometry& cell, const Atoms& atoms, int n_threads, int slabs_per_thread,
           bool float_rows, bool keep_rows) {
            int64_t shape[3];
            const int64_t n_maps = map_shape(out, "out", shape);
            check_frames(atoms, n_maps);
            kd::Options opt;
            opt.n_threads = n_threads;
            opt.slabs_per_thread = slabs_per_thread;
            opt.float_rows = float_rows;
            std::unique_ptr<kd::RowIntervals> rows(keep_rows ? new kd::RowIntervals : nullptr);
            kd::Timings tm;
            {
                nb::gil_scoped_release release;
                tm = kd::splat(cell, shape, atoms.view(), out.data(), opt, rows.get(), n_maps);
            }
            nb::object kept = rows ? nb::cast(rows.release(), nb::rv_policy::take_ownership) : nb::none();
            return nb::make_tuple(timings_dict(tm), kept);
        },
        "out"_a.noconvert(), "cell"_a, "atoms"_a, nb::kw_only(), "n_threads"_a = 1, "slabs_per_thread"_a = 0,
        "float_rows"_a = true, "keep_rows"_a = false,
        "Writes the density of `atoms` to `out` (nx, ny, nz) float32, overwriting it (it may be uninitialised).\n"
        "out (n, nx, ny, nz): the atoms are n frames of equal size (frame-major), map f the density of frame f.\n\n"
        "Returns (timings, rows): a dict of phase times in s ('prepare', 'partition', 'compute'), 'tasks',\n"
        "'rows_reused' and 'exp_visits'; rows: a RowIntervals for gather() with keep_rows, else None.\n"
        "slabs_per_thread: 0 slabs of decreasing size, k (1..64) k equal slabs per thread.\n"
        "float_rows=False: the row intervals from the double pass only. All options give bitwise the same map.");

    m.def(
        "gather",
        [](Maps<const float> grad, const kd::CellGeometry& cell, const Atoms& atoms, Array<float, -1, 3> gxyz,
           Array<float, -1> gb_iso, Array<float, -1> gocc, kd::RowIntervals* rows, int n_threads,
           bool float_rows, int lanes) {
            int64_t shape[3];
            const int64_t n_maps = map_shape(grad, "grad", shape);
            check_frames(atoms, n_maps);
            check_rows(atoms, gxyz.shape(0), "gxyz");
            check_rows(atoms, gb_iso.shape(0), "gb_iso");
            check_rows(atoms, gocc.shape(0), "gocc");
            if (lanes != 0 && lanes != 8) throw nb::value_error("lanes must be 0 (picked for this CPU) or 8");
            if (rows && (rows->shape[0] != shape[0] || rows->shape[1] != shape[1] || rows->shape[2] != shape[2]))
                throw nb::value_error("rows come from a splat on a grid of another shape");
            kd::Options opt;
            opt.n_threads = n_threads;
            opt.float_rows = float_rows;
            opt.lanes = lanes;
            kd::Timings tm;
            {
                nb::gil_scoped_release release;
                // sums in double, rounded once to float32 here (on this thread: a torch cast of N×3
                // values would be a multi-threaded op, a wait for a core on a busy machine)
                const size_t n = static_cast<size_t>(atoms.size());
                std::vector<double> gx(3 * n), gb(n), go(n);
                tm = kd::gather(cell, shape, atoms.view(), grad.data(), opt, rows, gx.data(), gb.data(), go.data(),
                                n_maps);
                for (size_t i = 0; i < 3 * n; ++i) gxyz.data()[i] = static_cast<float>(gx[i]);
                for (size_t i = 0; i < n; ++i) {
                    gb_iso.data()[i] = static_cast<float>(gb[i]);
                    gocc.data()[i] = static_cast<float>(go[i]);
                }
            }
            return timings_dict(tm);
        },
        "grad"_a.noconvert(), "cell"_a, "atoms"_a, "gxyz"_a.noconvert(), "gb_iso"_a.noconvert(),
        "gocc"_a.noconvert(), nb::kw_only(), "rows"_a.none() = nb::none(), "n_threads"_a = 1, "float_rows"_a = true,
        "lanes"_a = 0,
        "Gradient of sum(grad * splat(atoms)) with respect to xyz (N, 3), b_iso (N,) and occ (N,), written to\n"
        "gxyz, gb_iso, gocc (float32; summed in float64, rounded once). grad (n, nx, ny, nz): n frames as in\n"
        "splat(), each reading its own map; grad (nx, ny, nz): one. rows: None, or the RowIntervals of splat()\n"
        "on the same atoms and grid (skips solving for the row intervals). lanes: 0 picks the lane blocks for\n"
        "this CPU (16 where it runs the x86-64-v4 clone), 8 keeps 8-lane blocks (bitwise the same gradients).\n"
        "Returns a dict of phase times as splat() does, with 'rows_reused': atoms whose rows came from rows.");

    m.def(
        "gather_aniso",
        [](Maps<const float> grad, const kd::CellGeometry& cell, const Atoms& atoms, const Matrix3& frac,
           Array<float, -1, 3> gxyz, Array<float, -1> gocc, Array<float, -1, 6> gu, Array<float, -1> gb_iso,
           int n_threads) {
            int64_t shape[3];
            const int64_t n_maps = map_shape(grad, "grad", shape);
            check_frames(atoms, n_maps);
            if (!atoms.anisotropic()) throw nb::value_error("gather_aniso takes an anisotropic set (u_aniso, aniso)");
            check_rows(atoms, gxyz.shape(0), "gxyz");
            check_rows(atoms, gocc.shape(0), "gocc");
            check_rows(atoms, gu.shape(0), "gu");
            check_rows(atoms, gb_iso.shape(0), "gb_iso");
            kd::Options opt;
            opt.n_threads = n_threads;
            kd::Timings tm;
            {
                nb::gil_scoped_release release;
                // sums in double, rounded once to float32 here (on this thread, as gather does)
                const size_t n = static_cast<size_t>(atoms.size());
                std::vector<double> gf(3 * n), go(n), g6(6 * n), gb(n);
                tm = kd::gather_aniso(cell, shape, atoms.view(), grad.data(), opt, gf.data(), go.data(), g6.data(),
                                      gb.data(), n_maps);
                // f = frac·xyz: ∂L/∂xyz_j = Σ_i ∂L/∂f_i · frac_ij
                const double* F = frac.data();
                for (size_t i = 0; i < n; ++i) {
                    for (int j = 0; j < 3; ++j)
                        gxyz.data()[3 * i + j] = static_cast<float>(gf[3 * i] * F[j] + gf[3 * i + 1] * F[3 + j] +
                                                                    gf[3 * i + 2] * F[6 + j]);
                    gocc.data()[i] = static_cast<float>(go[i]);
                    gb_iso.data()[i] = static_cast<float>(gb[i]);
                    for (int c = 0; c < 6; ++c) gu.data()[6 * i + c] = static_cast<float>(g6[6 * i + c]);
                }
            }
            return timings_dict(tm);
        },
        "grad"_a.noconvert(), "cell"_a, "atoms"_a, "frac"_a.noconvert(), "gxyz"_a.noconvert(), "gocc"_a.noconvert(),
        "gu"_a.noconvert(), "gb_iso"_a.noconvert(), nb::kw_only(), "n_threads"_a = 1,
        "Gradient of sum(grad * splat(atoms)) for an anisotropic set with respect to xyz (N, 3; frac: the cell's\n"
        "(3, 3) float64 Cartesian -> fractional matrix), occ (N,), u_aniso (N, 6; zero rows for isotropic atoms)\n"
        "and b_iso (N,; zero for anisotropic atoms), written to gxyz, gocc, gu, gb_iso (float32; summed in\n"
        "float64, rounded once). grad (n, nx, ny, nz): n frames as in splat(). Returns a dict of phase times.");

    m.def(
        "cutoff_radii_aniso",
        [](Array<double, -1> out, Array<const float, -1, 6> u_aniso, Array<const uint8_t, -1> aniso,
           Array<const float, -1> b_iso, Array<const float, -1, kd::kGaussians> a,
           Array<const float, -1, kd::kGaussians> b, double cutoff, const std::string& rule, bool neutron,
           int n_threads) {
            const size_t n = out.shape(0);
            if (u_aniso.shape(0) != n || aniso.shape(0) != n || b_iso.shape(0) != n || a.shape(0) != n ||
                b.shape(0) != n)
                throw nb::value_error("out, u_aniso, aniso, b_iso, a and b need the same number of rows");
            if (!(cutoff > 0)) throw nb::value_error("the density cutoff must be a positive number");
            if (rule != "gemmi" && rule != "eigen") throw nb::value_error("rule must be 'gemmi' or 'eigen'");
            const int r = rule == "gemmi" ? 0 : 1;
            nb::gil_scoped_release release;
            kd::cutoff_radii_aniso(static_cast<int64_t>(n), u_aniso.data(), aniso.data(), b_iso.data(), a.data(),
                                   b.data(), cutoff, r, neutron, n_threads, out.data());
        },
        "out"_a.noconvert(), "u_aniso"_a.noconvert(), "aniso"_a.noconvert(), "b_iso"_a.noconvert(), "a"_a.noconvert(),
        "b"_a.noconvert(), "cutoff"_a, "rule"_a, nb::kw_only(), "neutron"_a = false, "n_threads"_a = 1,
        "Cutoff radius (Å) of every atom of an anisotropic set, written to out (N,) float64: rule 'gemmi'\n"
        "(the isotropic rule at B_max = 8π²·max diag U) or 'eigen' (the search along the major axis);\n"
        "neutron: one Gaussian, closed form. u_aniso (N, 6), b_iso (N,), a, b (N, 5) float32, aniso (N,) uint8.");

    m.def(
        "first_non_positive_definite",
        [](Array<const float, -1, 6> u_aniso, Array<const uint8_t, -1> aniso) {
            if (u_aniso.shape(0) != aniso.shape(0))
                throw nb::value_error("u_aniso and aniso need the same number of rows");
            return kd::first_non_positive_definite(static_cast<int64_t>(aniso.shape(0)), u_aniso.data(), aniso.data());
        },
        "u_aniso"_a.noconvert(), "aniso"_a.noconvert(),
        "Index of the first atom with aniso set whose U (N, 6) float32 fails Sylvester's test (finite, U11 > 0,\n"
        "U11·U22 − U12² > 0, det U > 0, in float64 rounded as torch's elementwise ops), or -1.");

    m.def(
        "empty_maps",
        [](std::vector<size_t> shape) {
            if (shape.size() != 3 && shape.size() != 4)
                throw nb::value_error("empty_maps takes a map shape (nx, ny, nz) or (n, nx, ny, nz)");
            size_t count = 1;
            for (size_t d : shape) count *= d;
            const size_t bytes = count * sizeof(float);
            auto* held = new HeldMap{kd::take_map_buffer(bytes), bytes};
            nb::capsule owner(held, [](void* p) noexcept {
                auto* h = static_cast<HeldMap*>(p);
                kd::give_back_map_buffer(h->ptr, h->bytes);
                delete h;
            });
            return nb::ndarray<nb::pytorch, float, nb::c_contig, nb::device::cpu>(held->ptr, shape.size(), shape.data(),
                                                                                 owner);
        },
        "shape"_a,
        "An uninitialised float32 torch tensor of `shape` (C order) for splat() to fill. Its storage comes\n"
        "from the last maps of that size that were freed (already paged in) when there is one; a freed\n"
        "map's storage is kept for the next (at most two blocks, 256 MiB in all), not returned to the system.");

    m.def(
        "fractional",
        [](Array<double, -1, 3> out, Array<const float, -1, 3> xyz, const Matrix3& frac, double lo, double hi) {
            if (out.shape(0) != xyz.shape(0)) throw nb::value_error("out and xyz need the same number of rows");
            nb::gil_scoped_release release;
            return kd::fractional(static_cast<int64_t>(xyz.shape(0)), xyz.data(), frac.data(), lo, hi, out.data());
        },
        "out"_a.noconvert(), "xyz"_a.noconvert(), "frac"_a.noconvert(), "lo"_a, "hi"_a,
        "Fractional positions frac @ xyz (float64, no fused multiply-adds: torch's float64 matmul of these\n"
        "shapes rounds the same way) written to out (N, 3) float64 from xyz (N, 3) float32 and frac (3, 3)\n"
        "float64, on the calling thread. Returns whether every coordinate is finite and in [lo, hi).");

    m.def(
        "cutoff_radii",
        [](Array<double, -1> out, Array<const double, -1> b_iso, Array<const double, -1, kd::kGaussians> a,
           Array<const double, -1, kd::kGaussians> b, double cutoff, int n_threads) {
            const size_t n = out.shape(0);
            if (b_iso.shape(0) != n || a.shape(0) != n || b.shape(0) != n)
                throw nb::value_error("out, b_iso, a and b need the same number of rows");
            if (!(cutoff > 0)) throw nb::value_error("the density cutoff must be a positive number of e/Å³");
            nb::gil_scoped_release release;
            kd::cutoff_radii(static_cast<int64_t>(n), b_iso.data(), a.data(), b.data(), cutoff, n_threads, out.data());
        },
        "out"_a.noconvert(), "b_iso"_a.noconvert(), "a"_a.noconvert(), "b"_a.noconvert(), "cutoff"_a, nb::kw_only(),
        "n_threads"_a = 1,
        "Per-atom cutoff radius (Å) with gemmi's rule, written to out (N,) float64: b_iso (N,), a (N, 5),\n"
        "b (N, 5) float64.");

    m.def("set_shared_openmp", &kd::set_shared_openmp, "shared"_a,
          "Declare whether this module's OpenMP runtime (build_info()['openmp_library']) is the one torch's\n"
          "CPU ops run on. When it is, the parallel loops run on torch's intra-op threads (the caller's OpenMP\n"
          "team), falling back for a while to the kernel's own threads when a team member comes late.");

    m.def(
        "build_info",
        []() {
            const kd::BuildInfo info = kd::build_info();
            nb::dict d;
            d["threads"] = info.threads;
            d["avx2_clone"] = info.clones;
            d["forward_isa"] = info.forward_isa;
            d["backward_isa"] = info.backward_isa;
            d["openmp_library"] = kd::openmp_library();
            d["shared_openmp"] = kd::shared_openmp();
            return d;
        },
        "How this module was built and what this CPU runs: thread backend (threads), the OpenMP runtime's file\n"
        "(openmp_library) and whether it is declared torch's (shared_openmp), whether the AVX2/AVX-512\n"
        "clones exist (avx2_clone), and the instruction set of the forward and backward clones this CPU takes\n"
        "(forward_isa, backward_isa).");
}
