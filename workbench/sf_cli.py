"""``workbench sf MODEL``: a model's structure factors from its map, written to MTZ, and R against data.

The map is splatted with the sampling blur (``kernels.sampling_blur``), its symmetry mates added,
and transformed (``kernels.structure_factors``) to the space group's unique reflections to
--d-min; the blur is divided out again. With --data, the R-factor against the file's observed
amplitudes (overall scale and B fitted, no bulk-solvent model) is printed by shell.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from workbench._cli_shared import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, _check_out, _error, _non_negative

__all__ = ["add_parser", "DESCRIPTION"]

#: ``workbench sf --help``'s description (plain text).
DESCRIPTION = """\
Compute a model's structure factors F(hkl) from its density map by FFT: the model is splatted
(with a blur that keeps the map's sampling error small, divided out again), its symmetry mates are
added, and the map is transformed to the space group's unique reflections to --d-min. Writes
H K L FC PHIC to an MTZ file with --out; with --data, prints the R-factor against the file's
observed amplitudes (overall scale and B fitted; bulk solvent is not modelled, so R is high at
low resolution)."""


def add_parser(sub, positive) -> None:
    """Register ``sf`` on the ``workbench`` subparsers ``sub``; ``positive`` builds number types."""
    sp = sub.add_parser(
        "sf",
        help="Compute a model's structure factors from its map and write them to MTZ",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sp.add_argument("model", nargs="?", help="PDB/mmCIF file (default: the bundled 1ORC example)")
    sp.add_argument("--d-min", type=positive("--d-min", "Å"), default=2.0, help="resolution limit in Å (default 2)")
    sp.add_argument(
        "--spacing",
        type=positive("--spacing", "Å"),
        help="grid spacing in Å (default: d-min / 3, gemmi's oversampling of 1.5)",
    )
    sp.add_argument(
        "--cutoff",
        type=positive("--cutoff", "e/Å³"),
        default=1e-5,
        help="each atom's radius is where its density falls to this level in e/Å³ (default 1e-5)",
    )
    sp.add_argument(
        "--blur",
        type=_non_negative("--blur", "Å²"),
        help="B in Å² added to every atom for the map and divided out of the factors (default: the sampling "
        "blur, gemmi's refmac-compatible rule for the grid)",
    )
    sp.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="where the splat and the FFT run: cpu, or cuda for the first visible NVIDIA GPU (default cpu)",
    )
    sp.add_argument(
        "--on-bad-adp",
        default="raise",
        choices=["raise", "iso"],
        help="an ANISOU U that is not positive definite: refuse the file (raise) or use that atom's B (iso) "
        "(default raise)",
    )
    sp.add_argument("--out", help="MTZ file to write H K L FC PHIC to (default: none, print a summary only)")
    sp.add_argument(
        "--data",
        help="MTZ or structure-factor mmCIF with observed amplitudes: print the R-factor against them (default: none)",
    )
    sp.add_argument(
        "--amplitudes",
        help="the amplitude column of --data (default: FP, F, FOBS, F-obs, F_meas, FO or the only F column; "
        "F_meas_au in mmCIF)",
    )
    sp.set_defaults(func=_sf)


def _sf(args: argparse.Namespace) -> int:
    import torch

    import kernels
    from kernels._util import file_problem

    path = Path(args.model) if args.model else kernels.example_structure()
    problem = file_problem(path)
    if problem:
        return _error(f"model {path}: {problem}; give a PDB or mmCIF file", EXIT_USAGE)
    if args.out:
        problem = _check_out(Path(args.out))
        if problem:
            return _error(problem, EXIT_USAGE)
    if args.data:
        problem = file_problem(Path(args.data))
        if problem:
            return _error(f"--data {args.data}: {problem}", EXIT_USAGE)
    if args.device == "cuda" and not torch.cuda.is_available():
        return _error("--device cuda asked for, but no CUDA GPU is visible; use --device cpu", EXIT_USAGE)
    spacing = args.spacing if args.spacing else args.d_min / 3
    try:
        model = kernels.read_model(path, on_bad_adp=args.on_bad_adp)
    except kernels.ModelError as exc:
        hint = " (on this command line: --on-bad-adp iso)" if "on_bad_adp='iso'" in str(exc) else ""
        return _error(f"{exc}{hint}", EXIT_FAILURE)
    data = None
    if args.data:
        try:
            data = kernels.read_structure_factors(args.data, amplitudes=args.amplitudes)
        except ValueError as exc:
            return _error(str(exc), EXIT_FAILURE)
    try:
        grid = kernels.GridSpec.for_spacing(model.cell, spacing, model.spacegroup)
        finest = kernels.reciprocal.finest_d_min(grid)
        if args.d_min < finest:
            return _error(
                f"--d-min {args.d_min:g} Å is finer than a {spacing:g} Å grid holds ({finest:.3g} Å): "
                "use a smaller --spacing (d-min / 3) or a larger --d-min",
                EXIT_USAGE,
            )
        atoms = model.atoms.to(args.device, torch.float32)
        blur = kernels.sampling_blur(atoms, grid) if args.blur is None else args.blur
        print(f"model   {path} ({len(model)} atoms, {model.spacegroup})")
        print(
            f"grid    {grid.shape[0]}×{grid.shape[1]}×{grid.shape[2]} at ≤ {spacing:g} Å, cutoff {args.cutoff:g} e/Å³, "
            f"blur {blur:.2f} Å² (divided out)"
        )
        start = time.perf_counter()
        rho = kernels.splat_density(atoms, grid, cutoff=args.cutoff, blur=blur)
        rho = kernels.symmetrize(rho, grid, model.spacegroup)
        f = kernels.structure_factors(rho, grid, args.d_min, spacegroup=model.spacegroup, blur=blur)
        if atoms.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    except (kernels.GridError, ValueError) as exc:
        return _error(str(exc), EXIT_FAILURE)
    except MemoryError as exc:
        return _error(f"out of memory ({exc or 'no detail'}): use a larger --d-min", EXIT_FAILURE)
    print(
        f"factors {len(f)} unique reflections of {model.spacegroup} to {args.d_min:g} Å "
        f"(splat, symmetry mates, FFT: {elapsed * 1e3:.0f} ms on {atoms.device})"
    )
    if args.out:
        try:
            out = kernels.write_structure_factors(args.out, f)
        except (OSError, RuntimeError, ValueError) as exc:
            return _error(f"cannot write {args.out}: {exc}", EXIT_FAILURE)
        print(f"wrote   {out} (H K L FC PHIC)")
    if data is not None:
        for note in data.notes:
            print(f"note    {note}")
        try:
            r = kernels.r_factor(data, f)
        except ValueError as exc:
            return _error(f"--data {args.data}: {exc}", EXIT_FAILURE)
        print(f"R       {r}")
        t = r.table
        print("        d range (Å)      reflections      R    CC(|F|)")
        for lo, hi, n, rf, cc in zip(t.d_max.tolist(), t.d_min.tolist(), t.count.tolist(), t.r_factor.tolist(),
                                     t.correlation.tolist()):  # fmt: skip
            print(f"        {lo:6.2f} – {hi:5.2f}   {n:11d}   {rf:6.3f}   {cc:6.3f}")
    return EXIT_OK
