"""Two or more builds of the CPU density kernel side by side, on the same inputs, in interleaved rounds.

Each ``--build LABEL=PATH`` names a compiled ``_scatter`` extension (any file name). Every build runs
in its own worker process, where it is loaded as ``kernels.density._scatter`` before
``kernels.density.cpu`` imports it (two builds of one nanobind module cannot share a process: the
second would find its types already registered). The CPU forward (``kernels.density.cpu._splat_cpu``,
the public path with the per-slab times recorded, Python around the kernel included) runs with each
build in turn, interleaved with gemmi's ``add_model_density_to_grid`` (cutoff 1e-5, in this process)
in every round (the build that runs first after gemmi rotates from round to round), so the builds see
the same machine state; medians per build, each build's speed-up over gemmi in the same rounds, and the
median over rounds of each build's time over the first build's in that round. The maps of every
build are compared with the first build's (largest absolute difference; 0.0 when bitwise equal).

What it answers: whether a difference between two machines is the compiler's (the same source
compiled by each machine's compiler, timed on one machine) rather than the machine's.

Usage::

    OMP_NUM_THREADS=2 python benchmarks/cpu_build_ab.py \\
        --build here=kernels/density/_scatter.cpython-312-x86_64-linux-gnu.so \\
        --build other=/path/to/_scatter.cpython-312-x86_64-linux-gnu.so --structures 5h73 3wip \\
        --threads 1 2 --rounds 11 --out benchmarks/results/cpu_build_ab_<machine>_<date>.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import kernels  # noqa: E402
from benchmarks._structures import STRUCTURES  # noqa: E402
from benchmarks.bench_density import pin_to_idle_cores  # noqa: E402
from benchmarks.cpu_phase_probe import slab_times  # noqa: E402
from kernels.crystal import GridSpec  # noqa: E402
from kernels.testing import gemmi_density_calculator  # noqa: E402

PAUSE_S = 0.05  # between two builds' calls (see _bench)

# Run in a worker before anything imports kernels (kernels imports its CPU backend): the build at
# PATH becomes kernels.density._scatter, which kernels.density.cpu then imports.
_LOAD_BUILD = """
import importlib.machinery, importlib.util, sys
sys.path.insert(0, {root!r})
name = "kernels.density._scatter"
loader = importlib.machinery.ExtensionFileLoader(name, {path!r})
module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, {path!r}, loader=loader))
loader.exec_module(module)
sys.modules[name] = module
from benchmarks.cpu_build_ab import _worker
_worker({path!r})
"""


def _worker(path: str) -> None:
    """Serve the build at ``path`` (already loaded as ``kernels.density._scatter``, see ``_LOAD_BUILD``):
    answer JSON commands on stdin.

    ``{"setup": [structure, threads, spacing]}`` reads the structure; ``{"forward": true}`` times
    one forward and returns its phases; ``{"save": file}`` writes the forward's map (npy);
    ``{"info": true}`` returns the build's ``build_info()``.
    """
    module = sys.modules["kernels.density._scatter"]
    if module.__file__ != path:
        raise SystemExit(f"cpu_build_ab: the worker for {path} imported {module.__file__}")
    from kernels.density import cpu as density_cpu

    assert density_cpu._scatter is module
    options = density_cpu._KernelOptions(slab_times=True)
    atoms = grid = None
    for line in sys.stdin:
        cmd = json.loads(line)
        if "info" in cmd:
            reply = module.build_info()
        elif "setup" in cmd:
            structure, threads, spacing = cmd["setup"]
            model = kernels.read_model(STRUCTURES[structure])
            grid = GridSpec.for_spacing(model.cell, spacing)
            atoms = model.atoms.to(dtype=torch.float32)
            torch.set_num_threads(threads)
            density_cpu._splat_cpu(atoms, grid, options=options)  # warm-up
            reply = {}
        elif "save" in cmd:
            np.save(cmd["save"], density_cpu._splat_cpu(atoms, grid, options=options).numpy())
            reply = {}
        else:
            timings: list[dict] = []
            t0 = time.perf_counter()
            density_cpu._splat_cpu(atoms, grid, options=options, timings=timings)
            wall = time.perf_counter() - t0
            info = timings[0]
            zeroing, splatting = slab_times(info["slabs"])
            reply = {
                "wall": wall,
                "prepare": info["prepare"],
                "partition": info["partition"],
                "compute": info["compute"],
                "zeroing": zeroing,
                "splatting": splatting,
            }
        print(json.dumps(reply), flush=True)


class _Build:
    """A worker process serving one build."""

    def __init__(self, path: Path):
        if not path.is_file():
            raise FileNotFoundError(f"no extension module at {path}")
        code = _LOAD_BUILD.format(root=str(ROOT), path=str(path.resolve()))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.phases: list[dict] = []

    def ask(self, **cmd):
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"cpu_build_ab: a worker failed (exit {self.proc.wait()})")
        return json.loads(line)

    def forward(self) -> float:
        reply = self.ask(forward=True)
        self.phases.append({k: v for k, v in reply.items() if k != "wall"})
        return reply["wall"]

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def _bench(name: str, builds: dict, threads: int, rounds: int, spacing: float) -> dict:
    model = kernels.read_model(STRUCTURES[name])
    grid = GridSpec.for_spacing(model.cell, spacing)
    st, dc = gemmi_density_calculator(STRUCTURES[name], spacing, 1e-5)
    torch.set_num_threads(threads)

    def run_gemmi():
        dc.initialize_grid()
        t0 = time.perf_counter()
        dc.add_model_density_to_grid(st[0])
        return time.perf_counter() - t0

    maps = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, b in builds.items():
            b.ask(setup=[name, threads, spacing])
            b.ask(save=f"{tmp}/{label}.npy")
            maps[label] = np.load(f"{tmp}/{label}.npy")
    for b in builds.values():
        b.phases.clear()
    run_gemmi()
    first = next(iter(maps.values()))
    times = {label: [] for label in builds}
    times["gemmi"] = []
    order = list(builds.items())
    for r in range(rounds):
        # rotate who runs first after gemmi: the first call of a round wakes the thread pool
        for label, build in order[r % len(order) :] + order[: r % len(order)]:
            # After a call, the previous worker's OpenMP threads spin for a while before they
            # sleep; with as many cores as threads they would share the cores with this call.
            time.sleep(PAUSE_S)
            times[label].append(build.forward())
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
        builds[label] = Path(path)
    placement = pin_to_idle_cores(max(args.threads))  # inherited by the workers
    print(f"cpu placement: {placement}", flush=True)
    builds = {label: _Build(path) for label, path in builds.items()}
    try:
        info = {label: b.ask(info=True) for label, b in builds.items()}
        print(f"builds: {info}", flush=True)
        results = [_bench(s, builds, t, args.rounds, args.spacing) for s in args.structures for t in args.threads]
    finally:
        for b in builds.values():
            b.close()
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
