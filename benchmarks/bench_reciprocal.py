"""Structure factors and shell statistics of 3WIP at 2 Å from its 0.667 Å map, CPU and CUDA.

Issue 48's targets: ``kernels.structure_factors`` of 3WIP (360×120×200 voxels, 589,004 P 1
reflections to 2 Å) ≤ 150 ms on the CPU at 2 threads and ≤ 1 ms on the GPU; ``kernels.shells``
(20 equal-count shells, every statistic against a second set) ≤ 30 ms CPU, ≤ 1 ms GPU. Also timed:
the symmetrised map's unique set (C 2, 150,271 reflections), the ``reference`` backend (float64,
full transform), ``kernels.fsc`` of two maps (structure factors of both to the grid's limit and
the shells), and the first call for a grid (which makes the index set).

The map is our CPU kernel's (float32). CPU: ``--reps`` calls per case after one warm-up call,
median and minimum of the wall time and the median process CPU time (the VM is shared: the minimum
is the machine's, the median what a user sees under its load, the CPU time what the call itself
costs). CUDA (when visible): CUDA-event timed, median of ``--reps``. ``--baseline REV`` also times
``kernels/reciprocal`` as it is at git revision REV (loaded from git as a package of its own, on the
same kernels otherwise), call for call interleaved with this tree's, so both see the same load.
Writes ``reciprocal_<device>_<machine>_<date>.json`` to ``--out-dir`` (default ``benchmarks/results``).

Usage::

    OMP_NUM_THREADS=2 python benchmarks/bench_reciprocal.py --device cpu --machine devvm --baseline main
    python benchmarks/bench_reciprocal.py --device cuda --out-dir DIR
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import kernels  # noqa: E402
from benchmarks._structures import model  # noqa: E402


def load_baseline(rev: str):
    """``kernels/reciprocal`` at git revision ``rev``, imported as the package ``_baseline_reciprocal``."""
    git = ["git", "-C", str(ROOT)]
    names = subprocess.run(
        [*git, "ls-tree", "--name-only", rev, "kernels/reciprocal/"], check=True, capture_output=True, text=True
    ).stdout.split()
    top = Path(tempfile.mkdtemp(prefix="bench_reciprocal_"))
    package = top / "_baseline_reciprocal"
    package.mkdir()
    for name in names:
        if name.endswith(".py"):
            text = subprocess.run([*git, "show", f"{rev}:{name}"], check=True, capture_output=True, text=True).stdout
            (package / Path(name).name).write_text(text.replace("kernels.reciprocal", "_baseline_reciprocal"))
    sys.path.insert(0, str(top))
    return importlib.import_module("_baseline_reciprocal")


def cpu_times(fns, reps: int) -> list[list[tuple[float, float]]]:
    """(wall, CPU) seconds of ``reps`` calls of each of ``fns``, interleaved call for call, after one warm-up each."""
    for fn in fns:
        fn()
    out = [[] for _ in fns]
    for _ in range(reps):
        for fn, times in zip(fns, out):
            t, c = time.perf_counter(), time.process_time()
            fn()
            times.append((time.perf_counter() - t, time.process_time() - c))
    return out


def cuda_times(fns, reps: int) -> list[list[tuple[float, float]]]:
    for fn in fns:
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    out = [[] for _ in fns]
    for _ in range(reps):
        for fn, times in zip(fns, out):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append((a.elapsed_time(b) / 1e3, float("nan")))
    return out


def summary(times: list[tuple[float, float]]) -> dict:
    wall = [w for w, _ in times]
    out = {
        "median_ms": 1e3 * statistics.median(wall),
        "min_ms": 1e3 * min(wall),
        "max_ms": 1e3 * max(wall),
        "reps": len(times),
    }
    cpu = [c for _, c in times]
    if all(c == c for c in cpu):  # no NaN: CPU times were taken
        out["cpu_median_ms"] = 1e3 * statistics.median(cpu)
    return out


def cases(k, rho, sym, other, grid, d_min: float, spacegroup: str) -> dict:
    """The timed calls, on the reciprocal package ``k`` (``kernels`` or a baseline); two warm sets for shells."""
    f = k.structure_factors(rho, grid, d_min)
    g = k.structure_factors(other, grid, d_min)
    return {
        "structure_factors_p1": lambda: k.structure_factors(rho, grid, d_min),
        "structure_factors_unique_symmetrised": lambda: k.structure_factors(sym, grid, d_min, spacegroup=spacegroup),
        "structure_factors_reference_float64": lambda: k.structure_factors(rho, grid, d_min, backend="reference"),
        "shells_count_20": lambda: k.shells(f, g, n_shells=20),
        "shells_volume_20": lambda: k.shells(f, g, n_shells=20, binning="volume"),
        "shells_no_reference_20": lambda: k.shells(f, n_shells=20),
        "fsc_two_maps": lambda: k.fsc(rho, other, grid),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--structure", default="3wip")
    parser.add_argument("--spacing", type=float, default=2 / 3)
    parser.add_argument("--d-min", type=float, default=2.0)
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--threads", type=int, default=None, help="torch threads on the CPU (default: OMP_NUM_THREADS)")
    parser.add_argument("--machine", default=platform.node() or "host", help="name in the output file")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--baseline", default=None, help="git revision whose kernels/reciprocal to time beside this")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU is visible")
    baseline = load_baseline(args.baseline) if args.baseline else None
    dev = torch.device(args.device)
    m = model(args.structure)
    grid = kernels.GridSpec.for_spacing(m.cell, args.spacing, m.spacegroup)
    rho_cpu = kernels.splat_density(m.atoms.to(dtype=torch.float32), grid, backend="cpu")
    rho = rho_cpu.to(dev)
    sym = kernels.symmetrize(rho, grid, m.spacegroup)
    other = rho * 1.01 + 1e-3
    d_min = args.d_min
    timer = cuda_times if dev.type == "cuda" else cpu_times
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    # first call for this grid: the index set is made (gemmi) and copied to the device
    t = time.perf_counter()
    f = kernels.structure_factors(rho, grid, d_min)
    sync()
    first_ms = 1e3 * (time.perf_counter() - t)
    fs = kernels.structure_factors(sym, grid, d_min, spacegroup=m.spacegroup)

    load_start = os.getloadavg()
    now = cases(kernels, rho, sym, other, grid, d_min, m.spacegroup)
    before = cases(baseline, rho, sym, other, grid, d_min, m.spacegroup) if baseline else None
    results, baseline_results = {}, {}
    for name, fn in now.items():
        reps = max(3, args.reps // 3) if "reference" in name or "fsc" in name else args.reps
        fns = [fn] + ([before[name]] if before else [])
        timed = timer(fns, reps)
        results[name] = summary(timed[0])
        line = f"{name:38s} median {results[name]['median_ms']:8.2f} ms  min {results[name]['min_ms']:8.2f} ms"
        if "cpu_median_ms" in results[name]:
            line += f"  cpu {results[name]['cpu_median_ms']:8.2f} ms"
        if before:
            baseline_results[name] = b = summary(timed[1])
            line += f"   | {args.baseline}: median {b['median_ms']:8.2f} min {b['min_ms']:8.2f}"
            if "cpu_median_ms" in b:
                line += f" cpu {b['cpu_median_ms']:8.2f}"
        print(line, flush=True)
    print(f"{'first call (makes the index set)':38s} {first_ms:8.1f} ms")
    record = {
        "what": "kernels.structure_factors / shells / fsc (issue 48)",
        "structure": args.structure,
        "grid": list(grid.shape),
        "spacing": args.spacing,
        "d_min": d_min,
        "reflections_p1": len(f),
        "reflections_unique": len(fs),
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "load_average": load_start,
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "first_call_ms": first_ms,
        "cases": results,
    }
    if baseline:
        rev = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", args.baseline], capture_output=True, text=True
        ).stdout.strip()
        record["baseline"] = {"revision": args.baseline, "commit": rev, "cases": baseline_results}
    record["load_average_end"] = os.getloadavg()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / f"reciprocal_{args.device}_{args.machine}_{record['date']}.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print("wrote", out)
    return record


if __name__ == "__main__":
    main()
