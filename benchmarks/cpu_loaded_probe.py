"""Where the 2-thread CPU splat loses to 1 thread with one of two cores busy: steps and slab owners.

Pinned to ``--cores`` (two logical CPUs) like ``bench_cpu_loaded.py``, quiet or (``--loaded``)
with a spinning process on the second core, for each structure and 1/2 threads, interleaved:

- ``chain``  the steps of ``bench_cpu_loaded.py``'s forward+backward timed one by one: the public
             ``splat_density`` (with grad), the caller's ``map * W`` and ``.sum()`` (torch ops,
             parallel at 2 threads), ``.backward()``, and inside it the CPU backend's backward
             alone and the C++ gather's phases (``prepare``, ``compute``);
- ``fwd``    the CPU backend's forward under ``no_grad`` with the slab times recorded
             (``_KernelOptions(slab_times=True)``): its phases, how many slabs the helper thread
             (worker 1) took, when the calling thread (worker 0) finished its last slab and when
             the helper finished its last (0 when a worker took none).

Prints medians and 90th percentiles in ms (the first two rounds left out); ``--out`` writes them
as JSON.

Usage::

    python benchmarks/cpu_loaded_probe.py --cores 0,1 --loaded --structures 1aki 5h73
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import kernels  # noqa: E402
from benchmarks._structures import STRUCTURES  # noqa: E402
from benchmarks.bench_cpu_loaded import BusyCore  # noqa: E402
from kernels.crystal import AtomSet, GridSpec  # noqa: E402
from kernels.density import cpu as density_cpu  # noqa: E402

CHAIN = ("splat", "mul", "sum", "backward", "cpu_backward", "gather_prepare", "gather_compute", "total")
FWD = ("wall", "prepare", "partition", "compute", "helper_slabs", "caller_end", "helper_end")
SKIP = 2  # rounds left out of the statistics


class _TimedBackward:
    """Wraps the CPU backend's autograd backward to record its time and the gather's phases."""

    def __init__(self):
        self.original = density_cpu._SplatFunction.backward
        self.last: dict = {}

    def __enter__(self):
        original, last = self.original, self.last

        def backward(ctx, grad_out):
            t0 = time.perf_counter()
            result = original(ctx, grad_out)
            last["cpu_backward"] = time.perf_counter() - t0
            last["gather_prepare"] = ctx.backward_info["prepare"]
            last["gather_compute"] = ctx.backward_info["compute"]
            return result

        density_cpu._SplatFunction.backward = staticmethod(backward)
        return self

    def __exit__(self, *exc):
        density_cpu._SplatFunction.backward = staticmethod(self.original)


def _summary(rows: list[list[float]], names: tuple[str, ...]) -> dict:
    a = np.asarray(rows[SKIP:], dtype=np.float64)
    return {
        n: {"p50": round(float(np.median(a[:, i])), 3), "p90": round(float(np.percentile(a[:, i], 90)), 3)}
        for i, n in enumerate(names)
    }


def probe(name: str, rounds: int, spacing: float) -> dict:
    model = kernels.read_model(STRUCTURES[name])
    grid = GridSpec.for_spacing(model.cell, spacing)
    atoms = model.atoms.to(dtype=torch.float32)
    weight = torch.randn(grid.shape, generator=torch.Generator().manual_seed(0))
    leaf = AtomSet(
        atoms.xyz.clone().requires_grad_(),
        atoms.b_iso.clone().requires_grad_(),
        atoms.occ.clone().requires_grad_(),
        atoms.a,
        atoms.b,
        _validate=False,
    )
    options = density_cpu._KernelOptions(slab_times=True)
    chain = {1: [], 2: []}
    fwd = {1: [], 2: []}
    with _TimedBackward() as timed:
        for i in range(rounds + SKIP):
            for threads in (1, 2) if i % 2 == 0 else (2, 1):  # alternate which goes first
                torch.set_num_threads(threads)
                for t in (leaf.xyz, leaf.b_iso, leaf.occ):
                    t.grad = None
                t0 = time.perf_counter()
                m = kernels.splat_density(leaf, grid)
                t1 = time.perf_counter()
                p = m * weight
                t2 = time.perf_counter()
                s = p.sum()
                t3 = time.perf_counter()
                s.backward()
                t4 = time.perf_counter()
                last = timed.last
                chain[threads].append(
                    [
                        1e3 * v
                        for v in (
                            t1 - t0,
                            t2 - t1,
                            t3 - t2,
                            t4 - t3,
                            last["cpu_backward"],
                            last["gather_prepare"],
                            last["gather_compute"],
                            t4 - t0,
                        )
                    ]
                )
                info: list = []
                with torch.no_grad():
                    t0 = time.perf_counter()
                    density_cpu._splat_cpu(atoms, grid, options=options, timings=info)
                    wall = time.perf_counter() - t0
                d = info[0]
                slabs = d["slabs"]  # (worker, start, zeroed, end), s from the compute phase's start
                helper = [s for s in slabs if s[0] == 1]
                fwd[threads].append(
                    [
                        1e3 * wall,
                        1e3 * d["prepare"],
                        1e3 * d["partition"],
                        1e3 * d["compute"],
                        float(len(helper)),
                        1e3 * max((s[3] for s in slabs if s[0] == 0), default=0.0),
                        1e3 * max((s[3] for s in helper), default=0.0),
                    ]
                )
    return {
        "structure": name,
        "chain_ms": {f"{t}t": _summary(chain[t], CHAIN) for t in (1, 2)},
        "fwd_ms": {f"{t}t": _summary(fwd[t], FWD) for t in (1, 2)},
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--structures", nargs="+", default=["1aki", "5h73"], choices=sorted(STRUCTURES))
    p.add_argument("--cores", default="0,1", help="the two logical CPUs this process runs on (default 0,1)")
    p.add_argument("--loaded", action="store_true", help="a spinning process on the second of --cores")
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--spacing", type=float, default=0.667)
    p.add_argument("--out", type=Path, default=None, help="JSON output")
    args = p.parse_args(argv)
    cores = [int(c) for c in args.cores.split(",")]
    if len(cores) != 2:
        p.error(f"--cores takes two logical CPUs, got {args.cores!r}")
    os.sched_setaffinity(0, cores)  # before any thread pool exists: its threads inherit it
    condition = "loaded" if args.loaded else "quiet"
    report = {"condition": condition, "cores": cores, "loadavg_before": os.getloadavg(), "results": []}
    if args.loaded:
        with BusyCore(cores[1]):
            rows = [probe(n, args.rounds, args.spacing) for n in args.structures]
    else:
        rows = [probe(n, args.rounds, args.spacing) for n in args.structures]
    for row in rows:
        for key, names in (("chain_ms", CHAIN), ("fwd_ms", FWD)):
            for t, stats in row[key].items():
                cells = "  ".join(f"{n} {stats[n]['p50']:.2f}/{stats[n]['p90']:.2f}" for n in names)
                print(f"{condition:6s} {row['structure']:5s} {key[:-3]:5s} {t} p50/p90: {cells}", flush=True)
    report["results"] = rows
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
