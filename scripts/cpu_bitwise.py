"""Store the CPU kernels' results in one .npz, or compare two such files bitwise.

A developer's check for changes that must not change a single bit of the C++ kernels' output
(moving code between files, reordering includes, a new build). Run it before the change and
after, and compare::

    python scripts/cpu_bitwise.py --out /tmp/cpu_before.npz
    # ... change and rebuild (bash scripts/build.sh) ...
    python scripts/cpu_bitwise.py --out /tmp/cpu_after.npz
    python scripts/cpu_bitwise.py --compare /tmp/cpu_before.npz /tmp/cpu_after.npz

It imports the kernels of the checkout it lives in (not ``PYTHONPATH``'s): to store another checkout's results,
run a copy of this script placed in that checkout's ``scripts/``.

What it stores, for 1ORC, 1AKI, 5H73 and 3WIP (``benchmarks/_structures.py`` finds them), each at
1 and 2 threads (``torch.set_num_threads``):

- density (``kernels.density.cpu.splat_cpu``) of the isotropic model and of the anisotropic one
  (the entry's ANISOU, or synthetic U, ``_structures.anisotropic_model``), with per-atom radii
  (gemmi's rule at the default cutoff) and with one fixed radius: the map and the gradients of
  ``sum(g · map)`` for a fixed random ``g``, with respect to positions, B, occupancy and (anisotropic
  sets) U;
- frames (``splat_frames_cpu``, two frames of the isotropic model, the second moved): maps and
  gradients;
- planarity (``planarity_nll_cpu``, float32 and float64 positions): the loss and its gradient;
- tricubic (``tricubic_cpu`` on the isotropic map, Catmull-Rom and Lagrange, periodic and bounded,
  float32 and float64): the samples and their gradients with respect to the map and the points.

Every array is kept whole, so ``--compare`` names the first key and element that differ (by their
bits: ``-0.0`` differs from ``0.0``, and NaNs compare by payload). Exit status 0: equal; 1: a
difference, or keys present in one file only.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STRUCTURES = ("1orc", "1aki", "5h73", "3wip")
THREADS = (1, 2)
FIXED_RADIUS = 2.5  # Å
N_POINTS = 20_000  # tricubic sample points per structure


def _structures():
    from benchmarks import _structures

    return _structures


def _grad_map(shape, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=gen, dtype=torch.float32) - 0.5


def _leaf(atoms, aniso: bool):
    """``atoms`` in float32 with positions, B, occupancy (and U) as leaves that require grad."""
    atoms = atoms.to(dtype=torch.float32)
    fields = {k: getattr(atoms, k).detach().clone().requires_grad_(True) for k in ("xyz", "b_iso", "occ")}
    if aniso:
        fields["u_aniso"] = atoms.u_aniso.detach().clone().requires_grad_(True)
    return atoms.replace(**fields), fields


def _density(out: dict, prefix: str, atoms, grid, aniso: bool, radius, seed: int) -> torch.Tensor:
    from kernels.density.cpu import splat_cpu

    leaf, fields = _leaf(atoms, aniso)
    rho = splat_cpu(leaf, grid, radius=radius)
    (rho * _grad_map(rho.shape, seed)).sum().backward()
    out[f"{prefix}/map"] = rho.detach().numpy().copy()
    for name, t in fields.items():
        out[f"{prefix}/grad_{name}"] = t.grad.numpy().copy()
    return rho.detach()


def _frames(out: dict, prefix: str, atoms, grid, seed: int) -> None:
    from kernels.density.cpu import splat_frames_cpu

    atoms = atoms.to(dtype=torch.float32)
    n = len(atoms)
    both = atoms.select(torch.cat([torch.arange(n), torch.arange(n)]))
    shift = torch.cat([torch.zeros((n, 3)), torch.tensor([0.31, -0.17, 0.05]).expand(n, 3)])
    leaf, fields = _leaf(both.replace(xyz=both.xyz + shift), aniso=False)
    maps = splat_frames_cpu(leaf, grid, n_frames=2)
    (maps * _grad_map(maps.shape, seed)).sum().backward()
    out[f"{prefix}/maps"] = maps.detach().numpy().copy()
    for name, t in fields.items():
        out[f"{prefix}/grad_{name}"] = t.grad.numpy().copy()


def _planarity(out: dict, prefix: str, model) -> None:
    from kernels.planarity import find_planes
    from kernels.planarity.cpu import planarity_nll_cpu

    planes = find_planes(model)
    for dtype in (torch.float32, torch.float64):
        xyz = model.atoms.xyz.detach().to(dtype).clone().requires_grad_(True)
        loss = planarity_nll_cpu(xyz, planes)
        loss.backward()
        key = f"{prefix}/{str(dtype).removeprefix('torch.')}"
        out[f"{key}/loss"] = loss.detach().numpy().copy()
        out[f"{key}/grad_xyz"] = xyz.grad.numpy().copy()


def _tricubic(out: dict, prefix: str, rho: torch.Tensor, grid, seed: int) -> None:
    from kernels.tricubic.cpu import tricubic_cpu

    gen = torch.Generator().manual_seed(seed)
    frac = torch.rand((N_POINTS, 3), generator=gen, dtype=torch.float64) * 1.2 - 0.1  # some outside the cell
    points = frac @ grid.cell.orth.T.to(torch.float64)
    for dtype in (torch.float32, torch.float64):
        for method in ("catmull-rom", "lagrange"):
            for mode in ("periodic", "bounded"):
                r = rho.to(dtype).clone().requires_grad_(True)
                p = points.to(dtype).clone().requires_grad_(True)
                v = tricubic_cpu(r, grid, p, method=method, mode=mode, fill_value=0.25)
                (v * torch.linspace(-1, 1, len(v), dtype=dtype)).sum().backward()
                key = f"{prefix}/{str(dtype).removeprefix('torch.')}/{method}/{mode}"
                out[f"{key}/values"] = v.detach().numpy().copy()
                out[f"{key}/grad_rho"] = r.grad.numpy().copy()
                out[f"{key}/grad_points"] = p.grad.numpy().copy()


def store(path: Path, names, threads, spacing: float) -> None:
    from kernels.crystal import GridSpec

    S = _structures()
    out: dict[str, np.ndarray] = {}
    before = torch.get_num_threads()
    try:
        for name in names:
            iso = S.model(name)
            aniso = S.anisotropic_model(name)
            grid = GridSpec.for_spacing(iso.cell, spacing)
            for t in threads:
                torch.set_num_threads(t)
                t0 = time.perf_counter()
                base = f"{name}/t{t}"
                rho = None
                for kind, m in (("iso", iso), ("aniso", aniso)):
                    for rname, radius in (("per_atom", None), ("fixed", FIXED_RADIUS)):
                        r = _density(out, f"{base}/density/{kind}/{rname}", m.atoms, grid, kind == "aniso", radius, 1)
                        if kind == "iso" and radius is None:
                            rho = r
                _frames(out, f"{base}/frames", iso.atoms, grid, 2)
                _planarity(out, f"{base}/planarity", iso)
                _tricubic(out, f"{base}/tricubic", rho, grid, 3)
                print(f"{name} at {t} thread(s): {time.perf_counter() - t0:.1f} s", flush=True)
    finally:
        torch.set_num_threads(before)
    out["meta/spacing"] = np.array(spacing)
    np.savez(path, **out)
    print(f"wrote {len(out)} arrays to {path}")


def _bits(a: np.ndarray) -> np.ndarray:
    """The array's elements as unsigned integers of the same width (bitwise comparison)."""
    a = np.ascontiguousarray(a)
    if a.dtype.kind in "fc":
        return a.view(f"u{a.dtype.itemsize}")
    return a


def compare(path_a: Path, path_b: Path) -> int:
    """Print whether two stored files are bitwise equal, else the first difference; exit status."""
    a, b = np.load(path_a), np.load(path_b)
    only_a = sorted(set(a.files) - set(b.files))
    only_b = sorted(set(b.files) - set(a.files))
    status = 0
    if only_a or only_b:
        print(f"keys only in {path_a}: {only_a[:5]}{' ...' if len(only_a) > 5 else ''}")
        print(f"keys only in {path_b}: {only_b[:5]}{' ...' if len(only_b) > 5 else ''}")
        status = 1
    for key in [k for k in a.files if k in b.files]:
        x, y = a[key], b[key]
        if x.dtype != y.dtype or x.shape != y.shape:
            print(f"first difference: {key}: {x.dtype}{x.shape} vs {y.dtype}{y.shape}")
            return 1
        diff = np.flatnonzero(_bits(x).ravel() != _bits(y).ravel())
        if diff.size:
            idx = np.unravel_index(diff[0], x.shape) if x.ndim else ()
            print(
                f"first difference: {key}[{', '.join(map(str, idx))}]: {x.ravel()[diff[0]]!r} vs {y.ravel()[diff[0]]!r}"
                f" ({diff.size} of {x.size} elements differ)"
            )
            return 1
    n = len(set(a.files) & set(b.files))
    if status == 0:
        print(f"bitwise equal: {n} arrays")
    return status


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="store the results in this .npz")
    p.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"), help="compare two stored files bitwise")
    p.add_argument("--structures", nargs="+", default=list(STRUCTURES), choices=STRUCTURES)
    p.add_argument("--threads", nargs="+", type=int, default=list(THREADS))
    p.add_argument("--spacing", type=float, default=0.8, help="grid spacing in Å (default 0.8)")
    args = p.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    if not args.out:
        p.error("give --out FILE to store, or --compare A B")
    store(args.out, args.structures, args.threads, args.spacing)
    return 0


if __name__ == "__main__":
    sys.exit(main())
