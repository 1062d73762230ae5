"""What the ``workbench`` subcommands share: exit statuses, error lines, number types, options.

``workbench.cli`` (the parser and ``splat``) and the modules of the other subcommands
(``workbench.ensemble_cli``) import these from here; nothing here imports a subcommand.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

#: Exit statuses: 0 success, 2 a usage error (arguments; nothing was computed), 1 any other failure.
EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


def _error(message: str, status: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return status


def _positive(what: str, unit: str):
    """An argparse type: one finite number > 0 in ``unit`` (``nan``, ``inf``, ``0``, ``-2`` are usage errors).

    Validated here, locally, because the command line sees only strings. The parser carries
    ``unit``, which the option's help must name (tests/notebooks/test_cli_help.py checks it).
    """

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number of {unit}, got {text!r}") from None
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"must be a positive finite number of {unit}, got {text!r}")
        return value

    parse.__name__ = what  # argparse names the type in its messages
    parse.unit = unit
    return parse


def _non_negative(what: str, unit: str):
    """An argparse type: one finite number ≥ 0 in ``unit`` (``nan``, ``inf``, ``-2`` are usage errors)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number of {unit}, got {text!r}") from None
        if not (math.isfinite(value) and value >= 0):
            raise argparse.ArgumentTypeError(f"must be a finite number ≥ 0 of {unit}, got {text!r}")
        return value

    parse.__name__ = what
    parse.unit = unit
    return parse


def _check_out(out: Path, option: str = "--out") -> str | None:
    """Why the output cannot be written to ``out`` (checked before any work), or None.

    The rule of :func:`kernels.write_map` (:func:`kernels._util.output_problem`): a regular file,
    which is replaced, or a new path in an existing folder.
    """
    from kernels._util import output_problem

    problem = output_problem(out)
    if problem is None:
        return None
    return f"{option} {out}: {problem}"


def _map_summary(rho, grid, radiation: str) -> str:
    """Maximum and integral of a map in its unit (and the potential in V for electrons)."""
    import kernels

    unit = kernels.density_unit(radiation)
    peak = float(rho.max())
    volts = f" ({peak * kernels.VOLTS_PER_INVERSE_SQUARE_ANGSTROM:.1f} V)" if radiation == "electron" else ""
    total = float(rho.sum()) * grid.voxel_volume
    return f"max {peak:.3f} {unit}{volts}, {total:.1f} {kernels.density_integral_unit(radiation)}"


#: What the maps' numbers mean, in every subcommand's description that writes a map.
_UNITS_TEXT = (
    "Map units: e/Å³ for X-rays; Å⁻² for electrons (electron form factors are lengths\n"
    "in Å; 1 Å⁻² is 47.88 V of electrostatic potential); fm/Å³ for neutrons."
)
_BACKENDS = ["auto", "reference", "cpu", "triton"]


def add_grid_options(parser: argparse.ArgumentParser) -> None:
    """--spacing and --radius | --cutoff, as ``splat`` and ``ensemble`` take them."""
    parser.add_argument(
        "--spacing", type=_positive("--spacing", "Å"), default=0.667, help="grid spacing in Å (default 0.667)"
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--radius",
        type=_positive("--radius", "Å"),
        help="one cutoff radius in Å for every atom (default: each atom's own radius, from --cutoff)",
    )
    group.add_argument(
        "--cutoff",
        type=_positive("--cutoff", "the map's unit"),
        default=1e-5,
        help="each atom's radius is where its density falls to this level, in the map's unit: e/Å³ X-rays, "
        "Å⁻² electrons, fm/Å³ neutrons (default 1e-5)",
    )


def add_radiation_options(parser: argparse.ArgumentParser) -> None:
    """--radiation, --blur, --backend and --device, as ``splat`` and ``ensemble`` take them."""
    parser.add_argument(
        "--radiation",
        default="xray",
        choices=["xray", "electron", "neutron"],
        help="form factors: X-ray (IT92; map in e/Å³), electron (IT C 4.3.2.2; map in Å⁻²) or neutron "
        "scattering lengths (map in fm/Å³) (default xray)",
    )
    parser.add_argument(
        "--blur",
        type=_non_negative("--blur", "Å²"),
        default=0.0,
        help="extra B in Å² on every atom, U + blur/8π² on anisotropic ones, as gemmi's blur (default 0)",
    )
    parser.add_argument(
        "--backend",
        default="auto",
        choices=_BACKENDS,
        help="density kernel: reference (float64 torch, slow, the truth), cpu (C++/OpenMP), triton (CUDA GPU); "
        "auto takes cpu on --device cpu and triton on --device cuda (default auto)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="where the kernel runs: cpu, or cuda for the first visible NVIDIA GPU (default cpu)",
    )
