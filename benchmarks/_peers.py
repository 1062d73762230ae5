"""The torchref density splats the eager benchmark compares against, loaded from their wheels.

Both releases are the package ``torchref``; each is installed into its own directory
(``pip install --no-deps --target DIR torchref-X-py3-none-any.whl``) and loaded from there:

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
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

_SEPARABLE = "torchref/base/kernels/separable_triton_kernel.py"
_VARIABLE = "torchref.base.electron_density.kernels.cuda.variable_radius"
_RADIUS = "torchref.base.electron_density.radius_policy"


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
        for pkg in (
            "torchref",
            "torchref.base",
            "torchref.utils",
            "torchref.base.targets",
            "torchref.base.electron_density",
            "torchref.base.electron_density.kernels",
            "torchref.base.electron_density.kernels.cuda",
        ):
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
