"""Anisotropic density splat on the CPU: our kernel against our isotropic one and gemmi's.

For each structure, in interleaved rounds (one call of each per round, ``--repeats`` rounds, so
background load slows all alike), at ``--threads`` threads, time

- ``aniso fwd``       :func:`kernels.density.cpu.splat_cpu` of the anisotropic model (U of every
                      atom that has one; radii, map allocation and Python included)
- ``aniso fwd+bwd``   the same plus ``backward`` of a random upstream gradient (xyz, occ, b_iso, u_aniso)
- ``iso fwd``, ``iso fwd+bwd``  the same model with ``u_aniso`` dropped (every atom at its B_iso)
- ``gemmi aniso``     gemmi ``DensityCalculatorX.add_model_density_to_grid`` with the same ANISOU
                      (only that call, on a zeroed grid; the zeroing is not timed)
- ``gemmi iso``       the same with every ANISOU zeroed

and report medians, ratios (aniso/iso, gemmi/ours) and each map's relative L2 against gemmi's map of
the same model (cutoff 1e-5). With ``--loaded`` the same rounds run twice, quiet and then with one of
the process's two CPUs kept busy by a spinning subprocess pinned to it
(:class:`benchmarks.bench_cpu_loaded.BusyCore`), and the two conditions' medians are printed and
recorded side by side. Structures: 1pfe (hexagonal, ANISOU for every atom), 3o5r (orthogonal,
ANISOU, read with ``on_bad_adp="iso"``) and 3wip (monoclinic, no ANISOU in the file: synthetic U
from :func:`kernels.testing.synthetic_anisou`, given to gemmi as well). The process pins itself to the idlest logical
CPU of each physical core, as ``bench_density.py`` does.

Usage::

    python benchmarks/bench_aniso_cpu.py --threads 2 --repeats 11 [--loaded] \\
        --out benchmarks/results/aniso_cpu_<machine>_<date>.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._structures import STRUCTURES, anisotropic_model  # noqa: E402
from benchmarks.bench_cpu_loaded import BusyCore  # noqa: E402
from benchmarks.bench_density import _cpu_name, pin_to_idle_cores  # noqa: E402
from kernels.crystal import AtomSet, GridSpec  # noqa: E402
from kernels.density.cpu import splat_cpu  # noqa: E402
from kernels.testing import gemmi_density_calculator, gemmi_structure_of_model  # noqa: E402


def _model(name: str):
    """(model, anisotropic float32 atoms, note): :func:`benchmarks._structures.anisotropic_model`.

    gemmi splats :func:`kernels.testing.gemmi_structure_of_model`: ANISOU exactly where the atoms use U
    (3O5R's atom whose U is not positive definite is at its B on both sides).
    """
    model = anisotropic_model(name)
    atoms = model.atoms
    synthetic = model.path is not None and "synthetic-anisou" in model.path.name
    note = (
        "synthetic U (kernels.testing.synthetic_anisou, max_ratio 10, seed 0)" if synthetic else "ANISOU from the file"
    )
    return model, atoms.to(dtype=torch.float32), note


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b.astype(np.float64)))


def _prepare_structure(name: str, args) -> dict:
    """The inputs, the timed calls and the finished maps' accuracy of one structure (nothing timed yet)."""
    model, aniso, note = _model(name)
    iso = aniso.replace(u_aniso=None, aniso=None)
    grid = GridSpec.for_spacing(model.cell, args.spacing, model.spacegroup)
    st_a, dc_a = gemmi_density_calculator(gemmi_structure_of_model(model), args.spacing, 1e-5, adp="auto")
    st_i, dc_i = gemmi_density_calculator(gemmi_structure_of_model(model), args.spacing, 1e-5, adp="iso")
    assert tuple(dc_a.grid.shape) == grid.shape, (dc_a.grid.shape, grid.shape)
    upstream = torch.randn(grid.shape, generator=torch.Generator().manual_seed(0))

    def leaf(atoms: AtomSet) -> tuple[AtomSet, list[torch.Tensor]]:
        names = ("xyz", "b_iso", "occ") + (("u_aniso",) if atoms.u_aniso is not None else ())
        tensors = {n: getattr(atoms, n).clone().requires_grad_() for n in names}
        fields = {n: getattr(atoms, n) for n in ("a", "b", "elements", "labels", "aniso")}
        return AtomSet(**tensors, **fields, radiation=atoms.radiation, _validate=False), list(tensors.values())

    leaf_a, params_a = leaf(aniso)
    leaf_i, params_i = leaf(iso)

    def fwd_bwd(atoms, params):
        for p in params:
            p.grad = None
        splat_cpu(atoms, grid).backward(upstream)

    def gemmi_time(st, dc):
        dc.initialize_grid()  # allocate and zero, not timed
        t0 = time.perf_counter()
        dc.add_model_density_to_grid(st[0])
        return time.perf_counter() - t0

    def timed(fn):
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    runs = {
        "aniso_fwd": lambda: timed(lambda: splat_cpu(aniso, grid)),
        "iso_fwd": lambda: timed(lambda: splat_cpu(iso, grid)),
        "aniso_fwd_bwd": lambda: timed(lambda: fwd_bwd(leaf_a, params_a)),
        "iso_fwd_bwd": lambda: timed(lambda: fwd_bwd(leaf_i, params_i)),
        "gemmi_aniso": lambda: gemmi_time(st_a, dc_a),
        "gemmi_iso": lambda: gemmi_time(st_i, dc_i),
    }
    ours_a = splat_cpu(aniso, grid).numpy()
    ours_i = splat_cpu(iso, grid).numpy()
    gemmi_time(st_a, dc_a)
    gemmi_a = np.array(dc_a.grid)
    gemmi_time(st_i, dc_i)
    gemmi_i = np.array(dc_i.grid)
    return {
        "runs": runs,
        "row": {
            "structure": name,
            "atoms": len(aniso),
            "anisotropic_atoms": int(aniso.aniso.sum()),
            "u": note,
            "cell_kind": model.cell.kind,
            "grid": list(grid.shape),
            "threads": args.threads,
            "rel_l2_vs_gemmi": {"aniso": rel_l2(ours_a, gemmi_a), "iso": rel_l2(ours_i, gemmi_i)},
        },
    }


def _time_structure(prepared: dict, args, condition: str) -> dict:
    """Interleaved rounds of every call (one warm-up round first): medians, all times and the ratios."""
    runs = prepared["runs"]
    torch.set_num_threads(args.threads)
    for run in runs.values():  # warm-up round, not recorded
        run()
    timings = {k: [] for k in runs}
    for _ in range(args.repeats):
        for k, run in runs.items():
            timings[k].append(run())
    med = {k: statistics.median(v) for k, v in timings.items()}
    row = dict(prepared["row"])
    row.update(
        condition=condition,
        median_s=med,
        all_s=timings,
        ratios={
            "aniso_fwd / iso_fwd": med["aniso_fwd"] / med["iso_fwd"],
            "aniso_fwd_bwd / iso_fwd_bwd": med["aniso_fwd_bwd"] / med["iso_fwd_bwd"],
            "gemmi_aniso / aniso_fwd": med["gemmi_aniso"] / med["aniso_fwd"],
            "gemmi_iso / iso_fwd": med["gemmi_iso"] / med["iso_fwd"],
            "gemmi_aniso / gemmi_iso": med["gemmi_aniso"] / med["gemmi_iso"],
        },
    )
    ms = {k: round(v * 1e3, 2) for k, v in med.items()}
    print(
        f"{row['structure']} ({condition}): {row['atoms']} atoms, grid {tuple(row['grid'])}, {args.threads} threads, "
        f"medians ms {ms}",
        flush=True,
    )
    print(f"  ratios { ({k: round(v, 2) for k, v in row['ratios'].items()}) }", flush=True)
    print(f"  rel L2 vs gemmi {row['rel_l2_vs_gemmi']}", flush=True)
    return row


def _side_by_side(quiet: list[dict], loaded: list[dict]) -> list[dict]:
    """Per structure and call: the quiet and the loaded median (ms) and loaded/quiet; the ratios of both."""
    table = []
    for q, lo in zip(quiet, loaded):
        entry = {"structure": q["structure"], "median_ms": {}, "ratios": {}}
        for k in q["median_s"]:
            a, b = q["median_s"][k] * 1e3, lo["median_s"][k] * 1e3
            entry["median_ms"][k] = {"quiet": a, "loaded": b, "loaded / quiet": b / a}
        for k in q["ratios"]:
            entry["ratios"][k] = {"quiet": q["ratios"][k], "loaded": lo["ratios"][k]}
        table.append(entry)
        print(f"{q['structure']}: median ms quiet | loaded (loaded/quiet)")
        for k, v in entry["median_ms"].items():
            print(f"  {k:14s} {v['quiet']:9.2f} | {v['loaded']:9.2f}  ({v['loaded / quiet']:.2f})")
        for k, v in entry["ratios"].items():
            print(f"  {k:28s} {v['quiet']:6.2f} | {v['loaded']:6.2f}")
    return table


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--structures", nargs="+", default=["1pfe", "3o5r", "3wip"], choices=sorted(STRUCTURES))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--spacing", type=float, default=2.0 / 3.0)
    parser.add_argument("--no-pin", dest="pin", action="store_false", help="leave thread placement to the OS")
    parser.add_argument(
        "--loaded",
        action="store_true",
        help="run the rounds quiet, then with the second of this process's two CPUs kept busy, side by side",
    )
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    placement = pin_to_idle_cores(args.threads) if args.pin else {"pinned": False}
    print(f"cpu placement: {placement}", flush=True)
    busy_cpu = None
    if args.loaded:
        cpus = placement["cpus"] if placement.get("pinned") else sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            parser.error("--loaded needs two CPUs to run on (one of them is kept busy)")
        busy_cpu = cpus[1]
    prepared = [_prepare_structure(name, args) for name in args.structures]
    results = [_time_structure(p, args, "quiet") for p in prepared]
    loaded = []
    if args.loaded:
        with BusyCore(busy_cpu):
            loaded = [_time_structure(p, args, f"loaded (CPU {busy_cpu} busy)") for p in prepared]
    import gemmi

    from kernels.density import _scatter

    record = {
        "device": "cpu",
        "date": datetime.date.today().isoformat(),
        "machine": {
            "cpu": _cpu_name(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "gemmi": gemmi.__version__,
            "build": _scatter.build_info(),
            "placement": placement,
        },
        "spacing": args.spacing,
        "repeats": args.repeats,
        "note": "medians of interleaved repeats; ours: kernels.density.cpu.splat_cpu (radii, effective U and "
        "Gaussian terms, map allocation and Python included); gemmi: add_model_density_to_grid only, on a "
        "zeroed grid, cutoff 1e-5",
        "results": results,
    }
    if args.loaded:
        record["loaded"] = {
            "busy_cpu": busy_cpu,
            "note": "the same rounds with a subprocess spinning on busy_cpu (benchmarks.bench_cpu_loaded.BusyCore)",
            "results": loaded,
            "side_by_side": _side_by_side(results, loaded),
        }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
