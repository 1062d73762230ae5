"""The torchref density splats the benchmarks compare against, loaded from their wheels.

Every release is the package ``torchref``; each is installed into its own directory
(``pip install --no-deps --target DIR torchref-X-py3-none-any.whl``, with
``torchref_kernels-0.1.0-…whl`` beside 0.7.0 and 0.8 for their CPU path) and loaded from there:

- 0.5.3.3: ``torchref/base/kernels/separable_triton_kernel.py`` imports only torch and triton;
  it is loaded as a stand-alone module under a private name, so it never enters
  ``sys.modules["torchref…"]``.
- 0.7.0: ``torchref/base/electron_density/kernels/cuda/variable_radius.py`` and
  ``…/electron_density/radius_policy.py`` import ``torchref.base.targets._dispatch``,
  ``torchref.base.targets.adp`` (+ ``_common``) and ``torchref.utils.backends`` (stdlib, torch,
  numpy). The package ``__init__`` files import I/O libraries (pandas, gemmi,
  reciprocalspaceship, …) the kernels never use, so the parent packages are created from their
  specs without executing their ``__init__`` (the modules themselves run unchanged), and Python
  imports the kernel modules through them as usual, under the name ``torchref``.

Units and conventions (read from the wheels' sources): positions in Å, ``b`` the isotropic B in
Å², ``A``/``B`` the five IT92 amplitudes and widths (N, 5), ``occ`` (N,); the map is
``density_map + splat`` (the input map is cloned, not modified) with axes (a, b, c) like ours;
``inv_frac_matrix`` is Cartesian → fractional (our ``cell.frac``) and ``frac_matrix`` fractional
→ Cartesian (our ``cell.orth``). 0.5.3.3 splats every atom to one radius in Å; 0.7.0 to a
per-atom radius ``clamp(ceil_0.25(n_sigma · sqrt((max_k B_k + b) / 8π²)), 2, 7)`` Å from
``radius_policy.per_atom_radius_iso``.

- 0.8 ("0.8.x", the repository's main at 26e407e; not on the registry, so the benchmarks are handed a
  wheel of it): the same radius policy and Triton kernels as 0.7.0, behind the ``torch.library``
  operators ``torch.ops.torchref.splat_{iso,aniso}_{fwd,bwd}``, whose CPU kernel is the Rust package
  ``torchref-kernels``; see :func:`load_torchref_08`. Anisotropic atoms carry U (N, 6) as
  U11, U22, U33, U12, U13, U23 in Å², Cartesian, as ours do.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import torch

_SEPARABLE = "torchref/base/kernels/separable_triton_kernel.py"
_VARIABLE = "torchref.base.electron_density.kernels.cuda.variable_radius"
_RADIUS = "torchref.base.electron_density.radius_policy"
#: The packages above the kernel modules, created without running their ``__init__``.
_PACKAGES = (
    "torchref",
    "torchref.base",
    "torchref.utils",
    "torchref.base.targets",
    "torchref.base.electron_density",
    "torchref.base.electron_density.kernels",
    "torchref.base.electron_density.kernels.cuda",
)


def _root(directory: str | Path, version: str) -> Path:
    root = Path(directory).expanduser().resolve()
    if not (root / "torchref").is_dir():
        raise FileNotFoundError(
            f"torchref {version}: no torchref/ package in {root}; install the wheel there with "
            f"`pip install --no-deps --target {root} torchref-{version}-py3-none-any.whl`"
        )
    return root


def load_torchref_053(directory: str | Path):
    """torchref 0.5.3.3's ``separable_density_gpu`` from ``directory`` (a ``pip --target`` dir).

    Returns
    -------
    module
        The kernel module, loaded as ``_peer_torchref_0533_separable``; its
        ``separable_density_gpu(density_map, xyz, b, inv_frac_matrix, frac_matrix, A, B, occ,
        radius_angstrom)`` returns ``density_map + splat``.
    """
    path = _root(directory, "0.5.3.3") / _SEPARABLE
    name = "_peer_torchref_0533_separable"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # Triton's JIT looks the module up by name
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[name]
        raise
    return mod


def _stub_package(name: str, root: Path):
    """Package ``name`` created from its spec with its ``__init__`` not executed."""
    d = root / name.replace(".", "/")
    spec = importlib.util.spec_from_file_location(name, d / "__init__.py", submodule_search_locations=[str(d)])
    if spec is None:
        raise ImportError(f"no package {name} in {root}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, mod)
    return mod


def load_torchref_070(directory: str | Path):
    """torchref 0.7.0's variable-radius Triton splat and its radius policy from ``directory``.

    Returns
    -------
    (module, module, list of str)
        ``variable_radius`` (``add_isotropic_cuda_var(density_map, xyz, adp, occ, A, B,
        inv_frac_matrix, frac_matrix, radius_per_atom)``), ``radius_policy``
        (``per_atom_radius_iso(adp, B_widths, *, n_sigma)``), and the top-level modules the
        load imported that were not imported before (their dependencies beyond this process's).

    Raises
    ------
    ImportError
        Another ``torchref`` is already imported in this process (its modules would clash).
    """
    root = _root(directory, "0.7.0")
    if "torchref" in sys.modules:
        mod = sys.modules["torchref"]
        if Path(getattr(mod, "__file__", "") or "").resolve().parent.parent == root:
            return sys.modules[_VARIABLE], sys.modules[_RADIUS], []
        raise ImportError(f"a torchref is already imported from {getattr(mod, '__file__', '?')}")
    before = {m.partition(".")[0] for m in sys.modules}
    added = []
    try:
        for pkg in _PACKAGES:
            _stub_package(pkg, root)
            added.append(pkg)
        variable = importlib.import_module(_VARIABLE)
        radius = importlib.import_module(_RADIUS)
    except BaseException:
        for name in [m for m in sys.modules if m == "torchref" or m.startswith("torchref.")]:
            del sys.modules[name]
        raise
    new = sorted({m.partition(".")[0] for m in sys.modules} - before - {"torchref"})
    if not getattr(variable, "_HAVE_TRITON", True):
        raise ImportError("torchref 0.7.0's variable_radius could not import triton")
    return variable, radius, new


# ----------------------------------------------------------------------------------------------
# The newest torchref (its repository's main at 26e407e, "0.8.x") and its CPU path, torchref-kernels
# ----------------------------------------------------------------------------------------------
#
# At 26e407e the splat is four ``torch.library`` operators, ``torch.ops.torchref.splat_{iso,aniso}_{fwd,bwd}``
# (``torchref/base/electron_density/ops.py``), one kernel per device: Triton on CUDA
# (``kernels/cuda/variable_radius.py``), the Rust package ``torchref-kernels`` on the CPU
# (``kernels/cpu/sphere_splat.py`` through ``torchref/utils/native.py``), with one autograd Function per
# family around them. The operators resolve their kernels by module name on every call, so this release
# must own the name ``torchref`` in ``sys.modules`` while it runs: an older release loaded in the same
# process is moved aside first (:func:`park_torchref`), its functions keep working from the module
# objects they already hold (Triton keys its JIT on the function, not on ``sys.modules``).

_CPU_SPLAT = "torchref.base.electron_density.kernels.cpu.sphere_splat"
_OPS = "torchref.base.electron_density.ops"
_PACKAGES_08 = (*_PACKAGES, "torchref.base.electron_density.kernels.cpu")


def park_torchref(tag: str) -> list[str]:
    """Move every ``torchref`` module out of the way, to ``_peer_<tag>:<name>`` in ``sys.modules``.

    Returns the names moved. The module objects (and every function already taken from them) keep
    working; only a later ``import torchref…`` finds nothing and loads afresh.
    """
    names = [m for m in sys.modules if m == "torchref" or m.startswith("torchref.")]
    for name in names:
        sys.modules[f"_peer_{tag}:{name}"] = sys.modules.pop(name)
    return names


def _kernels_on_path(root: Path) -> str | None:
    """Put ``root`` on ``sys.path`` when ``torchref_kernels`` is installed there; its version or None."""
    if (root / "torchref_kernels").is_dir() and str(root) not in sys.path:
        sys.path.append(str(root))
    try:
        import torchref_kernels
    except ImportError:
        return None
    return torchref_kernels.build_info()["version"]


def load_torchref_08(directory: str | Path) -> dict:
    """torchref at 26e407e ("0.8.x") from ``directory`` (a ``pip install --no-deps --target`` dir).

    ``torchref_kernels`` is imported from ``directory`` when it was installed there too
    (``pip install --no-deps --target DIR torchref_kernels-0.1.0-….whl``), else from the path.

    Returns
    -------
    dict
        ``cuda`` (``kernels/cuda/variable_radius``: ``add_isotropic_cuda_var`` and
        ``add_anisotropic_cuda_var(density_map, xyz, adp_or_u, occ, A, B, inv_frac_matrix, frac_matrix,
        radius_per_atom)``), ``cpu`` (``kernels/cpu/sphere_splat``: ``add_isotropic_cpu_sphere_var``,
        ``add_anisotropic_cpu_sphere_var``, same signature), ``radius_policy``, ``ops`` (the operator
        module), ``torchref_kernels`` (its version, or None) and ``cpu_error`` (why the CPU path cannot
        run, or None).

    Raises
    ------
    ImportError
        Another ``torchref`` owns the name (call :func:`park_torchref` first), or Triton is missing.
    """
    root = _root(directory, "0.8 (26e407e)")
    if "torchref" in sys.modules:
        mod = sys.modules["torchref"]
        raise ImportError(
            f"a torchref is already imported from {getattr(mod, '__file__', '?')}; park it first "
            "(benchmarks._peers.park_torchref)"
        )
    if not (root / _OPS.replace(".", "/")).with_suffix(".py").is_file():
        raise ImportError(f"{root} holds no {_OPS}: not the 26e407e tree (0.8.x) but an older torchref")
    kernels_version = _kernels_on_path(root)
    try:
        for pkg in _PACKAGES_08:
            _stub_package(pkg, root)
        ops = importlib.import_module(_OPS)
        cuda = importlib.import_module(_VARIABLE)
        cpu = importlib.import_module(_CPU_SPLAT)
        radius = importlib.import_module(_RADIUS)
    except BaseException:
        park_torchref("failed_08")
        raise
    if not getattr(cuda, "_HAVE_TRITON", True):
        raise ImportError("torchref 0.8's variable_radius could not import triton")
    return {
        "cuda": cuda,
        "cpu": cpu,
        "radius_policy": radius,
        "ops": ops,
        "torchref_kernels": kernels_version,
        "cpu_error": cpu.why_unavailable(),
    }


def load_torchref_070_cpu(directory: str | Path):
    """torchref 0.7.0's CPU splat module (``kernels/cpu/sphere_splat``, the same ``torchref-kernels``
    entry points called without the operator layer), loaded into the 0.7.0 packages that
    :func:`load_torchref_070` created; call before :func:`park_torchref`."""
    root = _root(directory, "0.7.0")
    _kernels_on_path(root)
    if "torchref.base.electron_density.kernels.cpu" not in sys.modules:
        _stub_package("torchref.base.electron_density.kernels.cpu", root)
    return importlib.import_module(_CPU_SPLAT)


# ----------------------------------------------------------------------------------------------
# One peer call on given atoms, and the search for the setting that matches our accuracy
# ----------------------------------------------------------------------------------------------

#: torchref's default truncation (``torchref.sigma_cutoff_ed``, 3σ in 0.7.0 and at 26e407e) and the
#: values the equal-accuracy search tries, cheapest first. The radius policy clamps every radius to
#: 2–7 Å whatever ``n_sigma`` (``R_HI`` is not a user setting), which bounds the accuracy reachable.
TORCHREF_SIGMA_DEFAULT = 3.0
TORCHREF_SIGMAS = (3.0, 3.5, 4.0, 4.5, 5.0, 5.5, 6.0, 7.0, 8.0)
#: torchref 0.5.3.3's one radius for every atom (Å): the default the benchmarks use, and the search.
TORCHREF053_RADIUS_DEFAULT = 4.0
TORCHREF053_RADII = (4.0, 5.0, 6.0, 7.0, 8.0)


def torchref_call(splat, policy, atoms, grid, *, n_sigma: float, aniso: bool, radii_per_call: bool = False):
    """``fn(xyz, adp, occ) -> map`` calling a torchref variable-radius splat as its own code does.

    Parameters
    ----------
    splat : module
        Holds ``add_isotropic_*_var`` / ``add_anisotropic_*_var`` (torchref's CUDA ``variable_radius``
        or CPU ``sphere_splat``).
    policy : module
        torchref's ``radius_policy``.
    atoms : kernels.crystal.AtomSet
        float32 atoms on the device (A, B coefficients and, for ``aniso``, ``u_aniso`` are read).
    grid : kernels.crystal.GridSpec
        The map; its ``cell.frac`` (Cartesian → fractional, their ``inv_frac_matrix``) and ``cell.orth``
        (their ``frac_matrix``) are handed over as float32.
    n_sigma : float
        The truncation in σ of each atom's broadest Gaussian (their ``sigma_cutoff_ed``).
    aniso : bool
        Splat ``adp`` as U (N, 6) with the anisotropic kernel and radii from the largest eigenvalue.
    radii_per_call : bool
        Recompute the radii from the ``adp`` given to every call (as a refinement loop must); else
        they are computed once here from ``atoms``, outside the timed call.

    Returns
    -------
    (callable, str)
        The call (a zero map allocated once is the ``density_map`` it adds to) and how its radii were made.
    """
    dev, f32 = atoms.xyz.device, torch.float32
    frac = grid.cell.frac.to(dev, f32).contiguous()
    orth = grid.cell.orth.to(dev, f32).contiguous()
    zero = torch.zeros(grid.shape, dtype=f32, device=dev)
    a, bcoef = atoms.a.contiguous(), atoms.b.contiguous()
    kind = "cuda" if hasattr(splat, "add_isotropic_cuda_var") else "cpu_sphere"
    add = getattr(splat, f"add_{'anisotropic' if aniso else 'isotropic'}_{kind}_var")

    def radii_of(adp):
        if aniso:
            return policy.per_atom_radius_aniso(bcoef, adp.detach(), n_sigma=n_sigma).contiguous()
        return policy.per_atom_radius_iso(adp.detach(), bcoef, n_sigma=n_sigma).contiguous()

    if radii_per_call:

        def fn(xyz, adp, occ):
            return add(zero, xyz, adp, occ, a, bcoef, frac, orth, radii_of(adp))

        return fn, f"per atom at {n_sigma} sigma, computed inside every call from the current ADPs"
    adp0 = atoms.u_aniso if aniso else atoms.b_iso
    radii = radii_of(adp0)

    def fn(xyz, adp, occ):
        return add(zero, xyz, adp, occ, a, bcoef, frac, orth, radii)

    what = f"per atom at {n_sigma} sigma, {float(radii.min()):.2f}-{float(radii.max()):.2f} Å, computed once"
    return fn, what


def torchref053_call(module, atoms, grid, *, radius: float):
    """``fn(xyz, b, occ) -> map`` of torchref 0.5.3.3's ``separable_density_gpu`` at one ``radius`` (Å)."""
    dev, f32 = atoms.xyz.device, torch.float32
    frac = grid.cell.frac.to(dev, f32).contiguous()
    orth_cpu = grid.cell.orth.to(f32).contiguous()  # it keys a cache on the values, read with .cpu()
    zero = torch.zeros(grid.shape, dtype=f32, device=dev)
    a, bcoef = atoms.a.contiguous(), atoms.b.contiguous()

    def fn(xyz, b, occ):
        return module.separable_density_gpu(zero, xyz, b, frac, orth_cpu, a, bcoef, occ, radius)

    return fn, f"{radius} Å for every atom"


def equal_accuracy_search(make, settings, accuracy, target: float) -> dict:
    """The cheapest setting whose map is as accurate as ``target``, else the most accurate one.

    Parameters
    ----------
    make : callable
        ``make(setting) -> map`` (a forward call at that setting).
    settings : sequence
        Settings in order of increasing cost (radius or σ).
    accuracy : callable
        ``accuracy(map) -> float``, the relative L2 distance from the reference.
    target : float
        Our accuracy on the same structure and reference.

    Returns
    -------
    dict
        ``tried`` ([setting, accuracy] pairs, in order, stopping at the first that reaches ``target``),
        ``failed`` ([setting, error] of those that raised), ``setting`` (the chosen one), ``accuracy``
        (its), ``reached`` (whether it is ≤ ``target``), ``target``.

    Raises
    ------
    RuntimeError
        No setting ran.
    """
    tried, failed = [], []
    for s in settings:
        try:
            err = float(accuracy(make(s)))
        except Exception as exc:  # a setting the peer cannot run is recorded; the others still count
            failed.append([s, f"{type(exc).__name__}: {exc}"[:300]])
            continue
        tried.append([s, err])
        if err <= target:
            return {"tried": tried, "failed": failed, "setting": s, "accuracy": err, "reached": True, "target": target}
    if not tried:
        raise RuntimeError(f"no setting of {list(settings)} ran: {failed}")
    s, err = min(tried, key=lambda t: t[1])
    return {"tried": tried, "failed": failed, "setting": s, "accuracy": err, "reached": False, "target": target}
