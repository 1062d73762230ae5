"""Density splat benchmark: this package's kernels side by side with gemmi.

CPU (``--device cpu``): for each structure and thread count, in interleaved rounds (one call
of each per round, ``--repeats`` rounds, so background load slows all alike), time

- ``cpu fwd``      ``kernels.splat_density(..., backend="cpu")`` (radii, map allocation and
                   Python included)
- ``cpu fwd+bwd``  the same plus ``backward`` of a random upstream gradient (xyz, B, occ)
- ``gemmi``        gemmi ``DensityCalculatorX.add_model_density_to_grid`` (cutoff 1e-5, ANISOU
                   zeroed; only that call, not its grid zeroing)
- ``torch``        a plain torch ``index_add_`` splat of the same voxels (float32), written here
- ``cpu fwd slabs K``  with ``--slab-variants K ...`` (more than one thread): the forward with K
                   map slabs per thread (under the private plan hook
                   ``kernels.density.cpu._plan_hook(slabs_per_thread=K)``; the same maps bitwise)

and report medians with ratios to gemmi, and each map's relative L2 error against gemmi's map
at cutoff 1e-7 and against the float64 reference (``backend="reference"``) at cutoff 1e-7.
The process pins itself to the idlest logical CPU of each physical core (``--no-pin``: leave
placement to the OS) and records the placement and the kernel's build in the JSON.
``--device cuda`` runs ``benchmarks._density_cuda`` instead.

Usage::

    OMP_NUM_THREADS=2 python benchmarks/bench_density.py --device cpu --structures 1orc 1aki 5h73 3wip
        --threads 1 2 --repeats 11 --out benchmarks/results/density_cpu_<machine>_<date>.json
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
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

import kernels  # noqa: E402
from benchmarks._structures import STRUCTURES  # noqa: E402
from kernels.crystal import AtomSet, GridSpec  # noqa: E402
from kernels.density import cpu as density_cpu  # noqa: E402
from kernels.density.cpu import cutoff_radius_cpu  # noqa: E402
from kernels.testing import gemmi_density, gemmi_density_calculator  # noqa: E402


def torch_index_add_splat(atoms: AtomSet, grid: GridSpec, radii: torch.Tensor, chunk: int = 1 << 22) -> torch.Tensor:
    """Plain torch float32 splat: per atom every voxel of its box with r² < R², then index_add_.

    The same voxels and formula as the kernels, written the obvious vectorised way.
    """
    f32 = torch.float32
    shape = grid.shape
    m = torch.tensor(shape, dtype=torch.float64)
    metric = grid.cell.metric
    frac = atoms.xyz.to(torch.float64) @ grid.cell.frac.T
    recip = torch.linalg.norm(grid.cell.frac, dim=1)
    lo = torch.floor(frac * m - radii[:, None] * recip * m).long()
    hi = torch.ceil(frac * m + radii[:, None] * recip * m).long()
    k = int((hi - lo + 1).max())
    width = (atoms.b + atoms.b_iso[:, None]).to(f32)
    amp = atoms.occ.to(f32)[:, None] * atoms.a.to(f32) * (4 * math.pi / width) ** 1.5
    expo = -4 * math.pi**2 / width
    out = torch.zeros(grid.n_voxels, dtype=f32)
    steps = torch.arange(k)
    per = max(1, chunk // k**3)
    g = metric.to(f32)
    for s in range(0, len(atoms), per):
        sl = slice(s, s + per)
        u, v, w = (lo[sl, d, None] + steps for d in range(3))
        du = (u / m[0] - frac[sl, 0, None]).to(f32)[:, :, None, None]
        dv = (v / m[1] - frac[sl, 1, None]).to(f32)[:, None, :, None]
        dw = (w / m[2] - frac[sl, 2, None]).to(f32)[:, None, None, :]
        r2 = (
            g[0, 0] * du * du
            + g[1, 1] * dv * dv
            + g[2, 2] * dw * dw
            + 2 * g[0, 1] * du * dv
            + 2 * g[0, 2] * du * dw
            + 2 * g[1, 2] * dv * dw
        )
        inside = r2 < (radii[sl].to(f32) ** 2)[:, None, None, None]
        atom, i, j, kz = inside.nonzero(as_tuple=True)
        vals = (amp[sl][atom] * torch.exp(expo[sl][atom] * r2[atom, i, j, kz][:, None])).sum(-1)
        flat = (torch.remainder(u[atom, i], shape[0]) * shape[1] + torch.remainder(v[atom, j], shape[1])) * shape[
            2
        ] + torch.remainder(w[atom, kz], shape[2])
        out.index_add_(0, flat, vals)
    return out.reshape(shape)


def rel_l2(x, ref: np.ndarray) -> float:
    x = np.asarray(x, dtype=np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def _bench_structure(name: str, args) -> list[dict]:
    results = []
    path = STRUCTURES[name]
    model = kernels.read_model(path)
    grid = GridSpec.for_spacing(model.cell, args.spacing)
    atoms = model.atoms.to(dtype=torch.float32)
    exact = gemmi_density(path, args.spacing, 1e-7)
    # float64 truth: the reference at cutoff 1e-7 (a few seconds on 3wip, once per structure)
    truth = kernels.splat_density(model.atoms.to(dtype=torch.float64), grid, backend="reference", cutoff=1e-7)
    truth = truth.numpy()
    st, dc = gemmi_density_calculator(path, args.spacing, 1e-5)
    dc.initialize_grid()
    assert tuple(dc.grid.shape) == grid.shape, (dc.grid.shape, grid.shape)
    upstream = torch.randn(grid.shape, generator=torch.Generator().manual_seed(0))
    leaf_xyz = atoms.xyz.clone().requires_grad_()
    leaf_b = atoms.b_iso.clone().requires_grad_()
    leaf_occ = atoms.occ.clone().requires_grad_()
    leaf = AtomSet(leaf_xyz, leaf_b, leaf_occ, atoms.a, atoms.b, _validate=False)

    def run_fwd():
        return kernels.splat_density(atoms, grid, backend="cpu")

    def run_fwd_bwd():
        for t in (leaf_xyz, leaf_b, leaf_occ):
            t.grad = None
        out = kernels.splat_density(leaf, grid, backend="cpu")
        out.backward(upstream)
        return out

    def run_fwd_slabs(per_thread: int):
        with density_cpu._plan_hook(slabs_per_thread=per_thread):
            return density_cpu.splat_cpu(atoms, grid)

    def run_gemmi():
        dc.initialize_grid()  # not timed: allocate and zero, as in gemmi's own use
        t0 = time.perf_counter()
        dc.add_model_density_to_grid(st[0])
        return time.perf_counter() - t0

    def run_torch():
        radii = cutoff_radius_cpu(atoms.b_iso, atoms.a, atoms.b, 1e-5)
        return torch_index_add_splat(atoms, grid, radii)

    for threads in args.threads:
        torch.set_num_threads(threads)
        timings = {"cpu_fwd": [], "cpu_fwd_bwd": [], "gemmi": [], "torch_index_add": []}
        slab_variants = args.slab_variants if threads > 1 else []
        for k in slab_variants:
            timings[f"cpu_fwd_slabs{k}"] = []
        # warm-up round, not recorded (imports, first-touch allocator growth)
        run_fwd(), run_fwd_bwd(), run_gemmi()
        if not args.skip_torch:
            run_torch()
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            run_fwd()
            timings["cpu_fwd"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            run_fwd_bwd()
            timings["cpu_fwd_bwd"].append(time.perf_counter() - t0)
            timings["gemmi"].append(run_gemmi())
            for k in slab_variants:
                t0 = time.perf_counter()
                run_fwd_slabs(k)
                timings[f"cpu_fwd_slabs{k}"].append(time.perf_counter() - t0)
            if not args.skip_torch and (len(timings["torch_index_add"]) < max(1, args.repeats // 2)):
                t0 = time.perf_counter()
                run_torch()
                timings["torch_index_add"].append(time.perf_counter() - t0)
        # accuracy (relative L2 against gemmi at cutoff 1e-7)
        cpu_map = run_fwd().numpy()
        dc.initialize_grid()
        dc.add_model_density_to_grid(st[0])
        gemmi_1e5 = np.array(dc.grid)
        acc = {"cpu": rel_l2(cpu_map, exact), "gemmi": rel_l2(gemmi_1e5, exact)}
        acc64 = {"cpu": rel_l2(cpu_map, truth), "gemmi": rel_l2(gemmi_1e5, truth), "gemmi_1e-7": rel_l2(exact, truth)}
        if not args.skip_torch:
            torch_map = run_torch().numpy()
            acc["torch_index_add"] = rel_l2(torch_map, exact)
            acc64["torch_index_add"] = rel_l2(torch_map, truth)
        med = {k: statistics.median(v) for k, v in timings.items() if v}
        row = {
            "structure": name,
            "atoms": len(atoms),
            "cell_kind": model.cell.kind,
            "grid": list(grid.shape),
            "threads": threads,
            "median_s": med,
            "all_s": timings,
            "rel_l2_vs_gemmi_1e-7": acc,
            "rel_l2_vs_float64_1e-7": acc64,
            "speedup_vs_gemmi": {k: med["gemmi"] / v for k, v in med.items() if k != "gemmi"},
        }
        results.append(row)
        sp = row["speedup_vs_gemmi"]
        print(
            f"{name:5s} {threads}t  gemmi {med['gemmi'] * 1e3:8.1f} ms  cpu fwd {med['cpu_fwd'] * 1e3:7.1f} ms "
            f"({sp['cpu_fwd']:5.1f}x)  fwd+bwd {med['cpu_fwd_bwd'] * 1e3:7.1f} ms ({sp['cpu_fwd_bwd']:5.1f}x)"
            + (
                f"  torch {med['torch_index_add'] * 1e3:8.1f} ms ({sp['torch_index_add']:5.2f}x)"
                if "torch_index_add" in med
                else ""
            )
            + f"  relL2 vs gemmi 1e-7: cpu {acc['cpu']:.3e} gemmi {acc['gemmi']:.3e}"
            + f"; vs float64 1e-7: cpu {acc64['cpu']:.3e} gemmi {acc64['gemmi']:.3e}"
            + "".join(
                f"  fwd slabs {k}/thread {med[f'cpu_fwd_slabs{k}'] * 1e3:.1f} ms ({sp[f'cpu_fwd_slabs{k}']:.1f}x)"
                for k in slab_variants
            ),
            flush=True,
        )
    return results


def _physical_cores() -> dict[tuple[str, str], list[int]]:
    """Logical CPUs this process may use, grouped by physical core (Linux sysfs topology)."""
    import os

    cores: dict[tuple[str, str], list[int]] = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        base = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            key = ((base / "physical_package_id").read_text().strip(), (base / "core_id").read_text().strip())
        except OSError:
            key = ("?", str(cpu))
        cores.setdefault(key, []).append(cpu)
    return cores


def _interrupts() -> dict[int, int]:
    """Interrupts each logical CPU has served so far (/proc/interrupts; empty if unreadable)."""
    try:
        lines = open("/proc/interrupts").read().splitlines()
    except OSError:
        return {}
    cpus = [int(c[3:]) for c in lines[0].split()]
    total = dict.fromkeys(cpus, 0)
    for line in lines[1:]:
        fields = line.split()[1 : 1 + len(cpus)]
        for cpu, v in zip(cpus, fields):
            if v.isdigit():
                total[cpu] += int(v)
    return total


def _busy_fraction(seconds: float = 1.0) -> tuple[dict[int, float], dict[int, int]]:
    """Share of the last ``seconds`` each logical CPU was busy (/proc/stat), and the interrupts
    it served in that time."""

    def sample():
        out = {}
        for line in open("/proc/stat"):
            if line.startswith("cpu") and line[3].isdigit():
                name, *vals = line.split()
                vals = [int(v) for v in vals]
                out[int(name[3:])] = (sum(vals), vals[3] + vals[4])  # total, idle + iowait
        return out

    a, irq_a = sample(), _interrupts()
    time.sleep(seconds)
    b, irq_b = sample(), _interrupts()
    busy = {}
    for cpu, (tot, idle) in b.items():
        dt = tot - a.get(cpu, (tot, idle))[0]
        busy[cpu] = 1.0 - (idle - a.get(cpu, (tot, idle))[1]) / dt if dt > 0 else 0.0
    irqs = {cpu: irq_b[cpu] - irq_a.get(cpu, 0) for cpu in irq_b}
    return busy, irqs


def pin_to_idle_cores(n: int) -> dict:
    """Restrict this process to ``n`` logical CPUs on distinct, currently idlest physical cores.

    Two threads on the two hyperthreads of one core run at ~1.2x one thread, and where the OS
    puts them varies from call to call; pinning before any thread pool starts makes the
    2-thread figures comparable between runs. "Idlest": least busy over a 1 s sample, then
    fewest interrupts served in it (CPU 0 often takes the machine's interrupts). Linux only;
    elsewhere nothing changes.
    """
    import os

    if not hasattr(os, "sched_setaffinity") or not Path("/proc/stat").exists():
        return {"pinned": False}
    cores = _physical_cores()
    busy, irqs = _busy_fraction()

    def load(c: int) -> tuple:
        return (round(busy.get(c, 0.0), 2), irqs.get(c, 0), c == 0)

    best = sorted((min(cpus, key=load) for cpus in cores.values()), key=load)[:n]
    os.sched_setaffinity(0, best)
    return {
        "pinned": True,
        "cpus": best,
        "physical_cores": len(cores),
        "logical_per_core": max(len(c) for c in cores.values()),
        "busy_before": {c: round(busy.get(c, 0.0), 3) for c in best},
        "interrupts_per_s": {c: irqs.get(c, 0) for c in sorted(irqs)},
    }


def bench_cpu(args) -> dict:
    # before any OpenMP pool exists: its threads inherit this affinity
    placement = pin_to_idle_cores(max(args.threads)) if args.pin else {"pinned": False}
    print(f"cpu placement: {placement}", flush=True)
    results = []
    for name in args.structures:
        results.extend(_bench_structure(name, args))
    import gemmi

    from kernels.density import _scatter

    return {
        "device": "cpu",
        "date": datetime.date.today().isoformat(),
        "machine": {
            "cpu": _cpu_name(),
            "logical_cpus": _ncpu(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "gemmi": gemmi.__version__,
            "build": _scatter.build_info(),
            "placement": placement,
        },
        "spacing": args.spacing,
        "repeats": args.repeats,
        "note": "medians of interleaved repeats; gemmi times add_model_density_to_grid only (grid zeroing not "
        "timed); cpu times include radii, map allocation and Python overhead; accuracy against gemmi's 1e-7 "
        "map and against the float64 reference at cutoff 1e-7",
        "results": results,
    }


def _ncpu() -> int:
    import os

    return os.cpu_count() or 0


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--structures", nargs="+", default=["1orc", "1aki", "5h73", "3wip"], choices=sorted(STRUCTURES))
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    p.add_argument("--spacing", type=float, default=0.667)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--skip-torch", action="store_true", help="leave out the (slow) plain torch index_add_ splat")
    p.add_argument(
        "--no-pin",
        dest="pin",
        action="store_false",
        help="leave thread placement to the OS (default: one logical CPU per physical core, the idlest)",
    )
    p.add_argument(
        "--slab-variants",
        nargs="*",
        type=int,
        default=[],
        metavar="K",
        help="also time the forward with K map slabs per thread (at more than one thread), same rounds",
    )
    p.add_argument(
        "--out", type=Path, default=None, help="JSON output (default benchmarks/results/density_<device>_<date>.json)"
    )
    args = p.parse_args(argv)
    if args.device == "cuda":
        if importlib.util.find_spec("benchmarks._density_cuda") is None:
            sys.exit(
                "bench_density: the CUDA benchmark (benchmarks/_density_cuda.py) is not in this tree; run --device cpu"
            )
        from benchmarks import _density_cuda

        return _density_cuda.run(args)
    report = bench_cpu(args)
    out = args.out or ROOT / "benchmarks" / "results" / f"density_cpu_{report['date']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
