"""Structure factors and shell statistics of 3WIP at 2 Å from its 0.667 Å map, CPU and CUDA.

Issue 48's targets: ``kernels.structure_factors`` of 3WIP (360×120×200 voxels, 589,004 P 1
reflections to 2 Å) ≤ 150 ms on the CPU at 2 threads and ≤ 1 ms on the GPU; ``kernels.shells``
(20 equal-count shells, every statistic against a second set) ≤ 30 ms CPU, ≤ 1 ms GPU. Also timed:
the symmetrised map's unique set (C 2, 150,271 reflections), the ``reference`` backend (float64,
full transform), ``kernels.fsc`` of two maps (structure factors of both to the grid's limit and
the shells), and the first call for a grid (which makes the index set).

The map is our CPU kernel's (float32). CPU: ``--reps`` calls per case after one warm-up call,
median and minimum (the VM is shared: the minimum is the machine's, the median what a user sees
under its load). CUDA (when visible): CUDA-event timed, median of ``--reps``. Writes
``reciprocal_<device>_<machine>_<date>.json`` to ``--out-dir`` (default ``benchmarks/results``).

Usage::

    OMP_NUM_THREADS=2 python benchmarks/bench_reciprocal.py --device cpu --machine devvm
    python benchmarks/bench_reciprocal.py --device cuda
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

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import kernels  # noqa: E402
from benchmarks._structures import model  # noqa: E402


def cpu_times(fn, reps: int) -> list[float]:
    fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def cuda_times(fn, reps: int) -> list[float]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return out


def summary(times: list[float]) -> dict:
    return {
        "median_ms": 1e3 * statistics.median(times),
        "min_ms": 1e3 * min(times),
        "max_ms": 1e3 * max(times),
        "reps": len(times),
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
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU is visible")
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
    g = kernels.structure_factors(other, grid, d_min)
    fs = kernels.structure_factors(sym, grid, d_min, spacegroup=m.spacegroup)
    kernels.fsc(rho, other, grid)

    cases = {
        "structure_factors_p1": lambda: kernels.structure_factors(rho, grid, d_min),
        "structure_factors_unique_symmetrised": lambda: kernels.structure_factors(
            sym, grid, d_min, spacegroup=m.spacegroup
        ),
        "structure_factors_reference_float64": lambda: kernels.structure_factors(rho, grid, d_min, backend="reference"),
        "shells_count_20": lambda: kernels.shells(f, g, n_shells=20),
        "shells_volume_20": lambda: kernels.shells(f, g, n_shells=20, binning="volume"),
        "shells_no_reference_20": lambda: kernels.shells(f, n_shells=20),
        "fsc_two_maps": lambda: kernels.fsc(rho, other, grid),
    }
    results = {}
    for name, fn in cases.items():
        reps = max(3, args.reps // 3) if "reference" in name or "fsc" in name else args.reps
        results[name] = summary(timer(fn, reps))
        print(
            f"{name:40s} median {results[name]['median_ms']:8.2f} ms   min {results[name]['min_ms']:8.2f} ms",
            flush=True,
        )
    print(f"{'first call (makes the index set)':40s} {first_ms:8.1f} ms")
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
        "load_average": os.getloadavg(),
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "first_call_ms": first_ms,
        "cases": results,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / f"reciprocal_{args.device}_{args.machine}_{record['date']}.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print("wrote", out)
    return record


if __name__ == "__main__":
    main()
