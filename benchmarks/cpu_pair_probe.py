"""How much two CPUs of this machine slow each other down: a check on 2-thread figures.

On a virtual machine two logical CPUs that the guest sees as separate cores may share one
physical core (hyperthreads on the host). Then no 2-thread program can run at 2x one
thread. This probe times the CPU density forward on one thread, alone on a CPU and again
while a twin process runs the same work on another CPU, for a few CPU pairs, and reports
the slowdown of the shared run. It also times the kernel's 2-thread forward on each pair.

Usage::

    python benchmarks/cpu_pair_probe.py --structure 5h73 --pairs 3,6 3,11 0,1 --out probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _worker(structure: str, cpu: int, threads: int, rounds: int, start_at: float) -> list[float]:
    """Forward times (s) of the CPU kernel with ``threads`` threads; the caller has pinned the process."""
    import torch

    sys.path.insert(0, str(ROOT))
    import kernels
    from kernels.crystal import GridSpec

    torch.set_num_threads(threads)
    path = ROOT / "tests" / "data" / f"{structure}.cif.gz"
    model = kernels.read_model(path if path.exists() else kernels.example_structure(structure))
    grid = GridSpec.for_spacing(model.cell, 0.667)
    atoms = model.atoms.to(dtype=torch.float32)
    kernels.splat_density(atoms, grid, backend="cpu")  # warm-up
    while time.time() < start_at:
        time.sleep(0.001)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        kernels.splat_density(atoms, grid, backend="cpu")
        times.append(time.perf_counter() - t0)
    return times


def _spawn(structure: str, cpus: list[int], rounds: int, start_at: float) -> subprocess.Popen:
    code = (
        f"import json, os, sys; sys.path.insert(0, {str(ROOT)!r}); from benchmarks.cpu_pair_probe import _worker; "
        f"os.sched_setaffinity(0, {cpus!r}); "
        f"print(json.dumps(_worker({structure!r}, {cpus[0]}, {len(cpus)}, {rounds}, {start_at!r})))"
    )
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def _run(structure: str, groups: list[list[int]], rounds: int) -> list[float]:
    start_at = time.time() + 8.0  # all workers loaded before the first timed call
    procs = [_spawn(structure, g, rounds, start_at) for g in groups]
    medians = []
    for p in procs:
        out, _ = p.communicate()
        if p.returncode:
            raise SystemExit(f"cpu_pair_probe: worker failed ({p.returncode})")
        medians.append(statistics.median(json.loads(out.strip().splitlines()[-1])))
    return medians


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--structure", default="5h73")
    p.add_argument("--pairs", nargs="+", default=["0,1"], help="CPU pairs as a,b")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if not hasattr(os, "sched_setaffinity"):
        raise SystemExit("cpu_pair_probe: needs Linux (sched_setaffinity)")
    report = {"structure": args.structure, "rounds": args.rounds, "pairs": []}
    for pair in args.pairs:
        a, b = (int(x) for x in pair.split(","))
        alone = _run(args.structure, [[a]], args.rounds)[0]
        shared = _run(args.structure, [[a], [b]], args.rounds)
        two = _run(args.structure, [[a, b]], args.rounds)[0]
        row = {
            "cpus": [a, b],
            "one_thread_alone_ms": alone * 1e3,
            "one_thread_with_twin_ms": [t * 1e3 for t in shared],
            "twin_slowdown": max(shared) / alone,
            "two_threads_ms": two * 1e3,
            "two_thread_speedup": alone / two,
        }
        report["pairs"].append(row)
        print(
            f"cpus {a},{b}: 1 thread {alone * 1e3:.1f} ms alone, {shared[0] * 1e3:.1f}/{shared[1] * 1e3:.1f} ms "
            f"with a twin ({row['twin_slowdown']:.2f}x); 2 threads {two * 1e3:.1f} ms "
            f"({row['two_thread_speedup']:.2f}x one)",
            flush=True,
        )
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
