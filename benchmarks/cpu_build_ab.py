"""Two or more builds of the CPU density kernel side by side, in one process, on the same inputs.

Each ``--build LABEL=PATH`` names a compiled ``_scatter`` extension (any file name: it is loaded
under the module name ``kernels.density._scatter`` from that path). The CPU forward
(``kernels.splat_density(..., backend="cpu")``, Python around the kernel included) runs with each
build in turn, interleaved with gemmi's ``add_model_density_to_grid`` (cutoff 1e-5) in every round
(the build that runs first after gemmi rotates from round to round), so the builds see the same
machine state; medians per build, each build's speed-up over gemmi in the same rounds, and the
median over rounds of each build's time over the first build's in that round. The maps of every
build are compared with the first build's (largest absolute difference; 0.0 when bitwise equal).

What it answers: whether a difference between two machines is the compiler's (the same source
compiled by each machine's compiler, timed on one machine) rather than the machine's.

Usage::

    OMP_NUM_THREADS=2 python benchmarks/cpu_build_ab.py \\
        --build here=kernels/density/_scatter.cpython-312-x86_64-linux-gnu.so \\
        --build other=/path/to/_scatter.abi3.so --structures 5h73 3wip --threads 1 2 --rounds 11 \\
        --out benchmarks/results/cpu_build_ab_<machine>_<date>.json
"""

from __future__ import annotations

import argparse
import datetime
import importlib.machinery
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import kernels  # noqa: E402
from benchmarks.bench_density import STRUCTURES, _gemmi_calculator, pin_to_idle_cores  # noqa: E402
from benchmarks.cpu_phase_probe import slab_times  # noqa: E402
from kernels.crystal import GridSpec  # noqa: E402
from kernels.density import cpu as density_cpu  # noqa: E402


def load_build(path: Path):
    """The extension module at ``path``, loaded as ``kernels.density._scatter`` (not registered)."""
    if not path.is_file():
        raise FileNotFoundError(f"no extension module at {path}")
    loader = importlib.machinery.ExtensionFileLoader("kernels.density._scatter", str(path))
    spec = importlib.util.spec_from_file_location("kernels.density._scatter", str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Recording:
    """A build whose ``splat`` keeps each call's phase timings (the rest is the build's own)."""

    def __init__(self, module):
        self._module = module
        self.phases: list[dict] = []

    def __getattr__(self, name):
        return getattr(self._module, name)

    def splat(self, *args):
        info = self._module.splat(*args)
        zeroing, splatting = slab_times(info.get("slabs", []))
        self.phases.append(
            {
                "prepare": info["prepare"],
                "partition": info["partition"],
                "compute": info["compute"],
                "zeroing": zeroing,
                "splatting": splatting,
            }
        )
        return info


def _bench(name: str, builds: dict, threads: int, rounds: int, spacing: float) -> dict:
    model = kernels.read_model(STRUCTURES[name])
    grid = GridSpec.for_spacing(model.cell, spacing)
    atoms = model.atoms.to(dtype=torch.float32)
    st, dc = _gemmi_calculator(STRUCTURES[name], spacing, 1e-5)
    torch.set_num_threads(threads)
    default = density_cpu._scatter

    def forward(module):
        density_cpu._scatter = module
        try:
            return kernels.splat_density(atoms, grid, backend="cpu")
        finally:
            density_cpu._scatter = default

    def run_gemmi():
        dc.initialize_grid()
        t0 = time.perf_counter()
        dc.add_model_density_to_grid(st[0])
        return time.perf_counter() - t0

    builds = {label: _Recording(m) for label, m in builds.items()}
    maps = {label: forward(m).numpy() for label, m in builds.items()}  # warm-up, and the maps compared
    for m in builds.values():
        m.phases.clear()
    run_gemmi()
    first = next(iter(maps.values()))
    times = {label: [] for label in builds}
    times["gemmi"] = []
    order = list(builds.items())
    for r in range(rounds):
        # rotate who runs first after gemmi: the first call of a round wakes the thread pool
        for label, module in order[r % len(order) :] + order[: r % len(order)]:
            t0 = time.perf_counter()
            forward(module)
            times[label].append(time.perf_counter() - t0)
        times["gemmi"].append(run_gemmi())
    med = {k: statistics.median(v) for k, v in times.items()}
    # per round, each build's time over the first build's: robust to a machine whose speed drifts
    base = next(iter(builds))
    paired = {k: statistics.median(t / b for t, b in zip(times[k], times[base])) for k in builds}
    row = {
        "structure": name,
        "grid": list(grid.shape),
        "threads": threads,
        "median_s": med,
        "all_s": times,
        "speedup_vs_gemmi": {k: med["gemmi"] / v for k, v in med.items() if k != "gemmi"},
        "time_over_first_paired": paired,
        # the kernel's own phases (ms, medians): prepare, partition, compute, and summed over the
        # map slabs, zeroing and splatting (CPU time of all threads)
        "phases_ms": {
            k: {ph: round(statistics.median(c[ph] for c in m.phases) * 1e3, 3) for ph in m.phases[0]}
            for k, m in builds.items()
        },
        "max_abs_diff_vs_first": {k: float(np.abs(m - first).max()) for k, m in maps.items()},
    }
    print(
        f"{name:5s} {threads}t  gemmi {med['gemmi'] * 1e3:8.1f} ms"
        + "".join(
            f"  {k} {med[k] * 1e3:7.2f} ms ({row['speedup_vs_gemmi'][k]:5.2f}x, {paired[k]:.3f} of {base} per round,"
            f" diff {row['max_abs_diff_vs_first'][k]:.1e})"
            for k in builds
        ),
        flush=True,
    )
    for k, ph in row["phases_ms"].items():
        print(f"      {k:>10s} phases (ms): " + "  ".join(f"{p} {v:.2f}" for p, v in ph.items()), flush=True)
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", action="append", required=True, metavar="LABEL=PATH", help="a build to time (2 or more)")
    p.add_argument("--structures", nargs="+", default=["5h73", "3wip"], choices=sorted(STRUCTURES))
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--spacing", type=float, default=0.667)
    p.add_argument("--out", type=Path, required=True, help="JSON output")
    args = p.parse_args(argv)
    builds = {}
    for item in args.build:
        label, sep, path = item.partition("=")
        if not sep or not label or not path:
            p.error(f"--build takes LABEL=PATH, got {item!r}")
        builds[label] = load_build(Path(path))
    placement = pin_to_idle_cores(max(args.threads))
    print(f"cpu placement: {placement}", flush=True)
    info = {label: m.build_info() for label, m in builds.items()}
    print(f"builds: {info}", flush=True)
    results = [_bench(s, builds, t, args.rounds, args.spacing) for s in args.structures for t in args.threads]
    report = {
        "date": datetime.date.today().isoformat(),
        "builds": {
            label: {"path": item.partition("=")[2], "info": info[label]} for label, item in zip(builds, args.build)
        },
        "placement": placement,
        "torch": torch.__version__,
        "rounds": args.rounds,
        "note": "medians of interleaved rounds; forward times include Python around the kernel; gemmi times "
        "add_model_density_to_grid only (cutoff 1e-5)",
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
