"""Where the CPU forward's time goes at several threads: phases, slabs and page faults per call.

For each structure, in one process pinned like ``bench_density.py`` (idlest CPUs of distinct
physical cores), the CPU forward is called in three settings:

- ``tight``        the CPU backend's forward (``kernels.density.cpu._splat_cpu``: what
                   ``kernels.splat_density(..., backend="cpu")`` runs, with the per-slab times
                   recorded) back to back;
- ``after_gemmi``  the same, each call right after gemmi's ``add_model_density_to_grid`` (as in
                   ``bench_density.py``'s rounds: the other threads idle while gemmi runs);
- ``kernel_fresh`` / ``kernel_reused``  the C++ kernel alone (no Python around it), after gemmi as
                   well, writing into a freshly allocated map each call or into one map that is
                   reused (already faulted in): what a map that comes back warm would save.

Per call it records the wall time, the kernel's phases (prepare, partition, compute), each map
slab's worker and its start, zeroed and end times (the kernel's ``slabs``, recorded because the
probe asks for them: ``_KernelOptions(slab_times=True)``), and the minor page
faults of the process. The summary gives medians of: the wall time, the compute phase, the time
the threads spend zeroing and splatting, how late the second worker starts its first slab, and the
idle tail (compute phase minus the busiest worker's time).

Usage::

    OMP_NUM_THREADS=2 python benchmarks/cpu_phase_probe.py --structures 5h73 --threads 2 \\
        --rounds 15 --out benchmarks/results/cpu_phase_probe_<machine>_<date>.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import kernels  # noqa: E402
from benchmarks._structures import STRUCTURES  # noqa: E402
from benchmarks.bench_density import pin_to_idle_cores  # noqa: E402
from kernels.crystal import GridSpec  # noqa: E402
from kernels.density import cpu as density_cpu  # noqa: E402
from kernels.testing import gemmi_density_calculator  # noqa: E402

SETTINGS = ("tight", "after_gemmi", "kernel_fresh", "kernel_reused")


class _TimedExtension:
    """The extension module with its ``splat`` timed: each call's timing dict gets ``"kernel"``
    (s, the C++ call alone, binding included)."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        return getattr(self._module, name)

    def splat(self, *args, **kwargs):
        t0 = time.perf_counter()
        info, rows = self._module.splat(*args, **kwargs)
        info["kernel"] = time.perf_counter() - t0
        return info, rows


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def slab_times(slabs) -> tuple[float, float]:
    """Seconds the threads spent zeroing and splatting, summed over ``splat``'s (worker, start, zeroed, end) slabs."""
    return sum(z - s for _, s, z, _ in slabs), sum(e - z for _, _, z, e in slabs)


def _summary(calls: list[dict]) -> dict:
    """Medians over the calls of one setting (times in ms)."""

    def med(values):
        values = list(values)
        return round(statistics.median(values) * 1e3, 3) if values else None

    def busy(call, worker):
        return sum(e - s for w, s, _, e in call["slabs"] if w == worker)

    def late(call):
        starts = [s for w, s, _, _ in call["slabs"] if w != 0]
        return min(starts) if starts else 0.0

    workers = sorted({w for c in calls for w, *_ in c["slabs"]})
    return {
        "wall_ms": med(c["wall"] for c in calls),
        "kernel_ms": med(c["kernel"] for c in calls),
        "prepare_ms": med(c["prepare"] for c in calls),
        "compute_ms": med(c["compute"] for c in calls),
        "zeroing_ms": med(slab_times(c["slabs"])[0] for c in calls),
        "splatting_ms": med(slab_times(c["slabs"])[1] for c in calls),
        "second_worker_start_ms": med(late(c) for c in calls),
        "idle_tail_ms": med(c["compute"] - max(busy(c, w) for w in workers) for c in calls),
        "busy_per_worker_ms": {w: med(busy(c, w) for c in calls) for w in workers},
        "minor_faults": statistics.median(c["faults"] for c in calls),
    }


def probe_structure(name: str, threads: int, rounds: int) -> dict:
    path = STRUCTURES[name]
    model = kernels.read_model(path)
    grid = GridSpec.for_spacing(model.cell, 0.667)
    atoms = model.atoms.to(dtype=torch.float32)
    st, dc = gemmi_density_calculator(path, 0.667, 1e-5)
    torch.set_num_threads(threads)

    last: list[dict] = []
    options = density_cpu._KernelOptions(slab_times=True)
    extension = density_cpu._scatter
    timed = _TimedExtension(extension)

    # the C++ call alone, with its inputs prepared once (what _splat_cpu passes it)
    frac = (atoms.xyz.to(torch.float64) @ grid.cell.frac.T).contiguous()
    f32 = [t.contiguous() for t in (atoms.b_iso, atoms.occ, atoms.a, atoms.b)]
    cell = density_cpu._kernel_cell(grid)
    kernel_atoms = density_cpu._kernel_atoms(frac, None, kernels.density.DEFAULT_CUTOFF, *f32)
    reused = torch.empty(grid.shape, dtype=torch.float32)

    def kernel_only(out: torch.Tensor):
        info, _ = timed.splat(
            out,
            cell,
            kernel_atoms,
            n_threads=threads,
            slabs_per_thread=options.slabs_per_thread,
            slab_times=True,
        )
        last.append(info)

    def gemmi():
        dc.initialize_grid()
        dc.add_model_density_to_grid(st[0])

    def one_call(setting: str) -> dict:
        if setting != "tight":
            gemmi()
        f0 = _faults()
        t0 = time.perf_counter()
        if setting in ("tight", "after_gemmi"):
            density_cpu._splat_cpu(atoms, grid, options=options, timings=last)
        elif setting == "kernel_fresh":
            kernel_only(torch.empty(grid.shape, dtype=torch.float32))
        else:
            kernel_only(reused)
        wall = time.perf_counter() - t0
        faults = _faults() - f0
        info = last.pop()
        return {
            "wall": wall,
            "kernel": info["kernel"],
            "prepare": info["prepare"],
            "partition": info["partition"],
            "compute": info["compute"],
            "slabs": [list(s) for s in info["slabs"]],
            "faults": faults,
        }

    density_cpu._scatter = timed  # so the forward's own C++ call is timed too
    try:
        calls: dict[str, list[dict]] = {s: [] for s in SETTINGS}
        for s in SETTINGS:  # warm-up, not recorded
            one_call(s)
        for _ in range(rounds):  # interleaved, so slow spells of the machine hit every setting
            for s in SETTINGS:
                calls[s].append(one_call(s))
    finally:
        density_cpu._scatter = extension
    summary = {s: _summary(calls[s]) for s in SETTINGS}
    for s in SETTINGS:
        m = summary[s]
        print(
            f"{name} {threads}t {s:13s} wall {m['wall_ms']:7.2f} kernel {m['kernel_ms']:7.2f} compute "
            f"{m['compute_ms']:7.2f} zeroing {m['zeroing_ms']:6.2f} splatting {m['splatting_ms']:7.2f} "
            f"2nd worker start {m['second_worker_start_ms']:6.2f} idle tail {m['idle_tail_ms']:6.2f} "
            f"faults {m['minor_faults']:.0f}",
            flush=True,
        )
    return {"structure": name, "threads": threads, "grid": list(grid.shape), "summary": summary, "calls": calls}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--structures", nargs="+", default=["5h73"], choices=sorted(STRUCTURES))
    p.add_argument("--threads", nargs="+", type=int, default=[2])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--no-pin", dest="pin", action="store_false", help="leave thread placement to the OS")
    p.add_argument("--out", type=Path, required=True, help="JSON output")
    args = p.parse_args(argv)
    placement = pin_to_idle_cores(max(args.threads)) if args.pin else {"pinned": False}
    print(f"cpu placement: {placement}; OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}", flush=True)
    results = [probe_structure(n, t, args.rounds) for n in args.structures for t in args.threads]
    report = {
        "date": datetime.date.today().isoformat(),
        "placement": placement,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "build": density_cpu._scatter.build_info(),
        "torch": torch.__version__,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
