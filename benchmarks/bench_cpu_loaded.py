"""The CPU density splat at 1 and 2 threads on a quiet machine and with one core busy (issue 20 part 3).

The process pins itself to ``--cores`` (two logical CPUs, e.g. ``0,1``) before any thread pool
starts, so the run means the same on a 2-core VM and on a 16-core host restricted to two cores.
For each condition (``quiet``; ``loaded``: a spinning subprocess pinned to ``--busy-core``, by
default the second of ``--cores``) and structure, ``--calls`` rounds each time, interleaved:

- ``fwd 1t`` / ``fwd 2t``          ``kernels.splat_density(atoms, grid)`` under ``no_grad`` after
                                   ``torch.set_num_threads(1)`` / ``(2)`` (how a user picks threads:
                                   the CPU backend follows ``torch.get_num_threads()``);
- ``fwd+bwd 1t`` / ``fwd+bwd 2t``  ``(splat_density(leaf, grid) * W).sum().backward()``, xyz, B and
                                   occupancy requiring grad (W a fixed random map);
- ``gemmi``                        gemmi's ``add_model_density_to_grid`` on the same grid (cutoff
                                   1e-5, ANISOU zeroed, as ``kernels.testing`` sets it up; its grid
                                   zeroing not timed; gemmi runs on one thread);
- ``fwd 2t own`` / ``fwd+bwd 2t own`` with ``--own-threads``: the 2-thread calls again with the
                                   kernel's loops on its own helper threads instead of torch's
                                   OpenMP threads (the default where the build shares torch's
                                   runtime, ``build_info()["shared_openmp"]``), for comparison.

Each call's wall time and the process's minor page faults during it are recorded. The table gives
10/50/90th percentiles (ms) and the targets of issue 20 part 3: quiet, 2-thread forward p90 ≤ 0.8×
the 1-thread median and gemmi's median ≥ 10× our 2-thread forward median (≥ 4× forward+backward);
loaded, the 2-thread median ≤ 1.05× and p90 ≤ 1.1× the 1-thread ones (forward and forward+backward).
The JSON (``--out``) holds every call, the machine, the load average before and after each
condition and the other CPUs' busy share (this benchmark cannot make a shared machine quiet:
``quiet_enough`` says whether the pinned cores were idle before the quiet run).

Usage::

    python benchmarks/bench_cpu_loaded.py --cores 0,1 --calls 21 \\
        --out benchmarks/results/cpu_loaded_<machine>_<date>.json
    # issue 46: the 3WIP forward in 10 separate runs, quiet and one core busy
    python benchmarks/bench_cpu_loaded.py --structures 3wip --ops fwd --calls 21 --runs 10 \\
        --out benchmarks/results/cpu_loaded_<machine>_<date>_runs.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import signal
import subprocess
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
from benchmarks.bench_density import _busy_fraction, _cpu_name  # noqa: E402
from kernels.crystal import AtomSet, GridSpec  # noqa: E402
from kernels.density import _scatter  # noqa: E402
from kernels.testing import gemmi_density_calculator  # noqa: E402

# A pinned core counts as idle when it was busy less than this share of the second before the run.
QUIET_BUSY = 0.1

_SPIN = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"


class BusyCore:
    """A subprocess spinning on one logical CPU for as long as the ``with`` block runs."""

    def __init__(self, cpu: int):
        self.cpu = cpu
        self.proc: subprocess.Popen | None = None

    def __enter__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", _SPIN, str(self.cpu)])
        time.sleep(0.5)  # let it reach its core
        if self.proc.poll() is not None:
            raise RuntimeError(f"the busy process for CPU {self.cpu} exited with {self.proc.returncode}")
        return self

    def __exit__(self, *exc):
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=10)


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def percentiles(values) -> dict:
    """10/50/90th percentiles of ``values`` (s) in ms."""
    p10, p50, p90 = np.percentile(np.asarray(values, dtype=np.float64) * 1e3, [10, 50, 90])
    return {"p10": round(float(p10), 3), "p50": round(float(p50), 3), "p90": round(float(p90), 3)}


def targets(condition: str, stats: dict) -> dict:
    """Issue 20 part 3's ratios for one structure and condition (value, limit, met)."""

    def ratio(value, limit, below: bool):
        return {"value": round(value, 3), "limit": limit, "met": value <= limit if below else value >= limit}

    if condition == "quiet":
        out = {}
        if "fwd_2t" in stats:
            out["fwd_2t_p90_over_fwd_1t_p50"] = ratio(stats["fwd_2t"]["p90"] / stats["fwd_1t"]["p50"], 0.8, True)
        for op, limit in (("fwd", 10.0), ("fwd_bwd", 4.0)):
            if "gemmi" in stats and f"{op}_2t" in stats:
                out[f"gemmi_p50_over_{op}_2t_p50"] = ratio(
                    stats["gemmi"]["p50"] / stats[f"{op}_2t"]["p50"], limit, False
                )
        return out
    out = {}
    for op in [o for o in ("fwd", "fwd_bwd") if f"{o}_2t" in stats]:
        one, two = stats[f"{op}_1t"], stats[f"{op}_2t"]
        out[f"{op}_2t_p50_over_1t_p50"] = ratio(two["p50"] / one["p50"], 1.05, True)
        out[f"{op}_2t_p90_over_1t_p90"] = ratio(two["p90"] / one["p90"], 1.1, True)
    return out


def bench_structure(
    name: str, calls: int, spacing: float, own_threads: bool = False, ops: tuple[str, ...] = ("fwd", "fwd_bwd", "gemmi")
) -> dict:
    """Times of one structure; ``own_threads`` adds 2-thread series on the kernel's own threads
    (``fwd_2t_own``, ``fwd_bwd_2t_own``), interleaved with the default ones; ``ops`` the series
    timed (``fwd``, ``fwd_bwd``, ``gemmi``)."""
    path = STRUCTURES[name]
    model = kernels.read_model(path)
    grid = GridSpec.for_spacing(model.cell, spacing)
    atoms = model.atoms.to(dtype=torch.float32)
    st, dc = gemmi_density_calculator(path, spacing, 1e-5)
    dc.initialize_grid()
    if tuple(dc.grid.shape) != grid.shape:
        raise RuntimeError(f"{name}: gemmi's grid {tuple(dc.grid.shape)} is not ours {grid.shape}")
    weight = torch.randn(grid.shape, generator=torch.Generator().manual_seed(0))
    leaf = AtomSet(
        atoms.xyz.clone().requires_grad_(),
        atoms.b_iso.clone().requires_grad_(),
        atoms.occ.clone().requires_grad_(),
        atoms.a,
        atoms.b,
        _validate=False,
    )

    def fwd():
        with torch.no_grad():
            kernels.splat_density(atoms, grid)

    def fwd_bwd():
        for t in (leaf.xyz, leaf.b_iso, leaf.occ):
            t.grad = None
        (kernels.splat_density(leaf, grid) * weight).sum().backward()

    def gemmi():
        dc.initialize_grid()  # not timed, as in bench_density.py
        t0 = time.perf_counter()
        dc.add_model_density_to_grid(st[0])
        return time.perf_counter() - t0

    def timed(fn, threads: int) -> tuple[float, int]:
        torch.set_num_threads(threads)
        f0 = _faults()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0, _faults() - f0

    kernel_ops = [(op, fn) for op, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)) if op in ops]
    for threads in (1, 2):  # warm-up, not recorded
        for _, fn in kernel_ops:
            timed(fn, threads)
    if "gemmi" in ops:
        gemmi()
    shared = _scatter.build_info()["shared_openmp"]
    variants = [(1, ""), (2, "")] + ([(2, "_own")] if own_threads else [])
    series = [f"{op}_{t}t{v}" for op, _ in kernel_ops for t, v in variants] + (["gemmi"] if "gemmi" in ops else [])
    times = {s: [] for s in series}
    faults = {s: [] for s in series if s != "gemmi"}
    try:
        for i in range(calls):
            # rotate which variant goes first, so a slow spell does not favour one of them
            order = variants[i % len(variants) :] + variants[: i % len(variants)]
            for op, fn in kernel_ops:
                for threads, variant in order:
                    _scatter.set_shared_openmp(shared and variant != "_own")
                    t, f = timed(fn, threads)
                    times[f"{op}_{threads}t{variant}"].append(t)
                    faults[f"{op}_{threads}t{variant}"].append(f)
            if "gemmi" in ops:
                times["gemmi"].append(gemmi())
    finally:
        _scatter.set_shared_openmp(shared)
    stats = {s: percentiles(v) for s, v in times.items()}
    return {
        "structure": name,
        "atoms": len(atoms),
        "grid": list(grid.shape),
        "stats_ms": stats,
        "minor_faults_median": {s: float(np.median(v)) for s, v in faults.items()},
        "calls_s": times,
        "minor_faults": faults,
    }


def _print_table(condition: str, row: dict, checks: dict) -> None:
    s = row["stats_ms"]
    cells = "  ".join(f"{k} {v['p10']:.1f}/{v['p50']:.1f}/{v['p90']:.1f}" for k, v in s.items())
    print(f"{condition:6s} {row['structure']:5s} p10/p50/p90 ms: {cells}", flush=True)
    print(
        "       targets: "
        + "  ".join(
            f"{k} {v['value']:.3f} ({'ok' if v['met'] else 'MISSED'}, limit {v['limit']})" for k, v in checks.items()
        ),
        flush=True,
    )


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--structures", nargs="+", default=["1aki", "5h73", "3wip"], choices=sorted(STRUCTURES))
    p.add_argument("--cores", default="0,1", help="the two logical CPUs this process runs on (default 0,1)")
    p.add_argument(
        "--busy-core", type=int, default=None, help="CPU the busy process spins on (default: 2nd of --cores)"
    )
    p.add_argument("--conditions", nargs="+", default=["quiet", "loaded"], choices=["quiet", "loaded"])
    p.add_argument("--calls", type=int, default=21, help="interleaved rounds per structure and condition (≥ 21)")
    p.add_argument("--spacing", type=float, default=0.667)
    p.add_argument(
        "--own-threads",
        action="store_true",
        help="add 2-thread series on the kernel's own helper threads (fwd_2t_own, fwd_bwd_2t_own), interleaved "
        "with the default ones, which run on torch's OpenMP threads where build_info()['shared_openmp']",
    )
    p.add_argument(
        "--ops", nargs="+", default=["fwd", "fwd_bwd", "gemmi"], choices=["fwd", "fwd_bwd", "gemmi"],
        help="the series timed (default all three)",
    )  # fmt: skip
    p.add_argument(
        "--runs", type=int, default=1,
        help="separate runs, each a fresh process of this program with the other arguments (its own thread "
        "pools and OpenMP team), one after another; the JSON holds every run, the load before each, and how "
        "many met every target",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=None, help="JSON output")
    args = p.parse_args(argv)
    if args.runs > 1:
        return _separate_runs(args, argv if argv is not None else sys.argv[1:])
    cores = [int(c) for c in args.cores.split(",")]
    if len(cores) != 2:
        p.error(f"--cores takes two logical CPUs, got {args.cores!r}")
    busy_core = cores[1] if args.busy_core is None else args.busy_core
    # before any OpenMP pool exists: its threads inherit this affinity
    os.sched_setaffinity(0, cores)
    import gemmi

    report = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            "host": platform.node(),
            "cpu": _cpu_name(),
            "logical_cpus": os.cpu_count(),
            "cores_used": cores,
            "busy_core": busy_core,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "gemmi": gemmi.__version__,
            "build": _scatter.build_info(),
        },
        "spacing": args.spacing,
        "calls": args.calls,
        "note": "interleaved 1-thread/2-thread calls of the public kernels.splat_density (threads set with "
        "torch.set_num_threads); fwd under no_grad, fwd_bwd = (map * W).sum().backward() with xyz, B, occ "
        "requiring grad; gemmi = add_model_density_to_grid alone; percentiles in ms",
        "conditions": {},
    }
    for condition in args.conditions:
        busy, _ = _busy_fraction()
        entry = {
            "loadavg_before": os.getloadavg(),
            "busy_before": {c: round(b, 3) for c, b in busy.items()},
            "quiet_enough": all(busy.get(c, 0.0) < QUIET_BUSY for c in cores),
            "results": [],
        }
        print(f"{condition}: load average {entry['loadavg_before']}, cores busy {entry['busy_before']}", flush=True)
        if condition == "loaded":
            with BusyCore(busy_core):
                rows = [
                    bench_structure(n, args.calls, args.spacing, args.own_threads, tuple(args.ops))
                    for n in args.structures
                ]
        else:
            rows = [
                bench_structure(n, args.calls, args.spacing, args.own_threads, tuple(args.ops)) for n in args.structures
            ]
        for row in rows:
            row["targets"] = targets(condition, row["stats_ms"])
            _print_table(condition, row, row["targets"])
        entry["results"] = rows
        entry["loadavg_after"] = os.getloadavg()
        report["conditions"][condition] = entry
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")
    return report


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _separate_runs(args: argparse.Namespace, argv: list[str]) -> dict:
    """``--runs N``: this program N times, each in a fresh process, and one JSON of them all."""
    import tempfile

    rest, skip = [], False
    for a in argv:  # the same arguments, less --runs and --out
        if skip:
            skip = False
            continue
        if a in ("--runs", "--out"):
            skip = True
            continue
        if a.startswith(("--runs=", "--out=")):
            continue
        rest.append(a)
    runs, failed = [], None
    with tempfile.TemporaryDirectory(prefix="bench-cpu-loaded-") as tmp:
        for i in range(args.runs):
            out = Path(tmp) / f"run{i}.json"
            before = {"uptime": _uptime(), "loadavg": os.getloadavg()}
            print(f"run {i + 1}/{args.runs}: {before['uptime']}", flush=True)
            done = subprocess.run([sys.executable, __file__, *rest, "--out", str(out)], check=False)
            if done.returncode != 0:  # the runs so far are kept and written; the record says which failed
                failed = f"run {i + 1} exited with status {done.returncode}"
                print(failed, flush=True)
                break
            report = json.loads(out.read_text())
            report["before"] = before
            runs.append(report)
    if not runs:
        raise SystemExit(f"bench_cpu_loaded: no run finished ({failed})")
    met = [
        all(t["met"] for c in r["conditions"].values() for row in c["results"] for t in row["targets"].values())
        for r in runs
    ]
    combined = {
        "date": runs[0]["date"],
        "machine": runs[0]["machine"],
        "arguments": rest,
        "runs_met_every_target": f"{sum(met)} of {len(met)}",
        "stopped_early": failed,
        "met_per_run": met,
        "runs": runs,
    }
    print(f"every target met in {sum(met)} of {len(met)} runs", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(combined, indent=1))
        print(f"wrote {args.out}")
    return combined


if __name__ == "__main__":
    main()
