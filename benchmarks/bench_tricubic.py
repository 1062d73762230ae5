"""Tricubic interpolation on the 3WIP map, side by side with gemmi.

10^5 and 10^7 random points (uniform over the unit cell) on 3WIP's density at spacing
0.667 Å (360×120×200 voxels, made by gemmi's DensityCalculatorX), Catmull-Rom, periodic:

- gemmi ``FloatGrid.interpolate_position_array(order=3)`` (single-threaded);
- ``kernels.tricubic_sample`` on the CPU at each of ``--threads`` (default 2 and 1), on the map
  in C order (converted once, as our own maps are) and, at 2 threads, on numpy's
  Fortran-ordered view of gemmi's grid (read in place through its strides);
- ``kernels.tricubic_sample`` on CUDA when a GPU is visible: forward (median of 20 CUDA-event
  timed calls) and forward+backward (median of 10).

CPU timings are interleaved (gemmi, then each of ours, per round; 21 rounds at 10^5 points, 3 at
10^7) so background load slows all of them alike; medians are reported, with the largest
difference from gemmi. Prints a table and writes ``tricubic_<device>_<date>.json`` to
``--out-dir`` (default ``benchmarks/results``).

Usage::

    OMP_NUM_THREADS=2 python benchmarks/bench_tricubic.py [--out-dir DIR] [--sizes 100000 10000000]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

import kernels

ROOT = Path(__file__).resolve().parent.parent


def density_3wip(spacing: float = 0.667):
    """3WIP's density (no symmetry mates, ANISOU ignored) as gemmi computes it, and our GridSpec for it."""
    from kernels.testing import gemmi_density_calculator

    st, dc = gemmi_density_calculator(ROOT / "tests" / "data" / "3wip.cif.gz", spacing)
    dc.add_model_density_to_grid(st[0])
    rho = torch.from_numpy(np.array(dc.grid, copy=True))
    cell = kernels.Cell.from_gemmi(st.cell)
    return dc.grid, rho, kernels.GridSpec(cell, tuple(rho.shape))


def cuda_time(fn, reps: int) -> float:
    """Median seconds per call with CUDA events, after warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def cpu_rounds(fns: dict, rounds: int) -> dict:
    """Median seconds per call of each ``(threads, fn)`` in ``fns``, timed interleaved round by round."""
    times = {k: [] for k in fns}
    before = torch.get_num_threads()
    try:
        for r in range(rounds + 1):  # round 0 warms up
            for k, (threads, fn) in fns.items():
                torch.set_num_threads(threads)
                t0 = time.perf_counter()
                fn()
                if r:
                    times[k].append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return {k: statistics.median(v) for k, v in times.items()}


def bench_size(n, rng, ggrid, rho, grid, thread_counts) -> list[dict]:
    """Rows of timings for ``n`` random points: gemmi, the CPU kernel per thread count, CUDA when present."""
    rows = []
    frac = rng.random((n, 3))
    pts64 = torch.from_numpy(frac) @ grid.cell.orth.T
    pts_np = np.ascontiguousarray(pts64.numpy())
    pts32 = pts64.float().contiguous()
    rounds = 21 if n <= 10**6 else 3
    expected = torch.from_numpy(ggrid.interpolate_position_array(pts_np, order=3))
    rho_c = rho.contiguous()  # C order, converted once (rho itself is numpy's Fortran-ordered view)
    fns = {"gemmi": (1, lambda: ggrid.interpolate_position_array(pts_np, order=3))}
    for threads in thread_counts:
        fns[("C", threads)] = (threads, lambda: kernels.tricubic_sample(rho_c, grid, pts32, backend="cpu"))
    if n <= 10**6:  # the Fortran-ordered view only where a per-call copy of the map would have shown
        fns[("F", thread_counts[0])] = (
            thread_counts[0],
            lambda: kernels.tricubic_sample(rho, grid, pts32, backend="cpu"),
        )
    med = cpu_rounds(fns, rounds)
    t_gemmi = med.pop("gemmi")
    rows.append(dict(impl="gemmi", device="cpu", threads=1, points=n, seconds=t_gemmi, points_per_s=n / t_gemmi,
                     rounds=rounds))  # fmt: skip
    for (layout, threads), t in med.items():
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        out = kernels.tricubic_sample(rho_c if layout == "C" else rho, grid, pts32, backend="cpu")
        torch.set_num_threads(before)
        err = float((out.double() - expected.double()).abs().max() / expected.abs().max())
        rows.append(
            dict(impl="kernels.cpu" if layout == "C" else "kernels.cpu (F view)", device="cpu", threads=threads,
                 points=n, seconds=t, points_per_s=n / t, vs_gemmi=t_gemmi / t, max_rel_diff_vs_gemmi=err,
                 map_layout="C order" if layout == "C" else "Fortran-ordered view, read in place", rounds=rounds)
        )  # fmt: skip
    if torch.cuda.is_available():
        rho_c, pts_c = rho.contiguous().cuda(), pts32.cuda()
        t = cuda_time(lambda: kernels.tricubic_sample(rho_c, grid, pts_c), 20)
        out = kernels.tricubic_sample(rho_c, grid, pts_c).cpu()
        err = float((out.double() - expected.double()).abs().max() / expected.abs().max())
        rows.append(
            dict(impl="kernels.triton", device="cuda", threads=None, points=n, seconds=t, points_per_s=n / t,
                 vs_gemmi=t_gemmi / t, max_rel_diff_vs_gemmi=err, what="forward")
        )  # fmt: skip
        r_c = rho_c.clone().requires_grad_()
        p_c = pts_c.clone().requires_grad_()

        def fwd_bwd():
            kernels.tricubic_sample(r_c, grid, p_c).sum().backward()
            r_c.grad = None
            p_c.grad = None

        t = cuda_time(fwd_bwd, 10)
        rows.append(
            dict(impl="kernels.triton", device="cuda", threads=None, points=n, seconds=t, points_per_s=n / t,
                 what="forward+backward (points and map)")
        )  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--sizes", type=int, nargs="+", default=[10**5, 10**7])
    ap.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    args = ap.parse_args()

    ggrid, rho, grid = density_3wip()
    rows = []
    rng = np.random.default_rng(0)
    for n in args.sizes:
        rows += bench_size(n, rng, ggrid, rho, grid, args.threads)

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        tag = "cuda_" + ("h100" if "H100" in name else "h200" if "H200" in name else "gpu")
    else:
        name, tag = platform.processor() or platform.machine(), "cpu"
    date = datetime.date.today().isoformat()
    meta = dict(
        date=date, device=name, torch=torch.__version__, map="3wip, spacing 0.667 Å",
        grid=list(grid.shape), method="catmull-rom", mode="periodic", points="uniform random over the unit cell",
        host_cpus=__import__("os").cpu_count(),
    )  # fmt: skip
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"tricubic_{tag}_{date}.json"
    path.write_text(json.dumps(dict(meta=meta, results=rows), indent=2))

    print(f"\ntricubic_sample vs gemmi on 3wip {grid.shape} ({name}, {date})")
    print(f"{'impl':22s} {'dev':5s} {'thr':>3s} {'points':>9s} {'what':>12s} {'points/s':>10s} {'vs gemmi':>8s}")
    for r in rows:
        ratio = f"{r['vs_gemmi']:.2f}x" if "vs_gemmi" in r else ""
        what = "fwd+bwd" if "backward" in r.get("what", "") else "fwd"
        thr = "" if r["threads"] is None else str(r["threads"])
        print(
            f"{r['impl']:22s} {r['device']:5s} {thr:>3s} {r['points']:9d} {what:>12s} {r['points_per_s']:10.3e} {ratio:>8s}"
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
