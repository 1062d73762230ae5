"""Command line: ``python -m workbench splat …`` (and, later, ``lab`` / ``app``)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

__all__ = ["main"]


def _splat(args: argparse.Namespace) -> int:
    import torch

    import kernels

    path = Path(args.model) if args.model else kernels.example_structure()
    try:
        model = kernels.read_model(path)
    except kernels.ModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda asked for, but no CUDA GPU is visible; use --device cpu", file=sys.stderr)
        return 2
    atoms = model.atoms.to(device, torch.float64 if args.backend == "reference" else torch.float32)
    try:
        grid = kernels.GridSpec.for_spacing(model.cell, args.spacing, model.spacegroup)
        backend = kernels.resolve_backend("density", atoms.device, args.backend)
        print(f"model   {path} ({len(model)} atoms, cell {model.cell.parameters}, {model.spacegroup})")
        for note in model.notes:
            print(f"note    {note}")
        radius = f"{args.radius} Å for every atom" if args.radius else f"per atom, density cutoff {args.cutoff:g} e/Å³"
        print(f"grid    {grid.shape[0]}×{grid.shape[1]}×{grid.shape[2]} at ≤ {args.spacing} Å; radius {radius}")
        start = time.perf_counter()
        rho = kernels.splat_density(atoms, grid, radius=args.radius, cutoff=args.cutoff, backend=backend)
        if args.symmetrize:
            rho = kernels.symmetrize(rho, grid, model.spacegroup)
        if atoms.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    except (kernels.BackendError, kernels.GridError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    electrons = float(rho.sum()) * grid.voxel_volume
    print(f"splat   backend {backend} on {atoms.device}: {elapsed * 1e3:.1f} ms "
          f"({'with' if args.symmetrize else 'without'} symmetry mates)")
    print(f"map     max {float(rho.max()):.3f} e/Å³, {electrons:.1f} electrons in the cell")
    out = kernels.write_map(args.out, rho, grid, model.spacegroup if args.symmetrize else "P 1")
    print(f"wrote   {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="workbench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sp = sub.add_parser("splat", help="splat a model's density onto a grid and write a CCP4 map")
    sp.add_argument("model", nargs="?", help="PDB/mmCIF file (default: the bundled 1ORC example)")
    sp.add_argument("--spacing", type=float, default=0.667, help="grid spacing in Å (default 0.667)")
    group = sp.add_mutually_exclusive_group()
    group.add_argument("--radius", type=float, help="one cutoff radius in Å for every atom")
    group.add_argument("--cutoff", type=float, default=1e-5, help="per-atom radius from this density (e/Å³)")
    sp.add_argument("--backend", default="auto", choices=["auto", "reference", "cpu", "triton"])
    sp.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    sp.add_argument("--symmetrize", action="store_true", help="add the space group's symmetry mates")
    sp.add_argument("--out", default="map.ccp4", help="output map (default map.ccp4)")
    sp.set_defaults(func=_splat)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``workbench`` command."""
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.func(args)
