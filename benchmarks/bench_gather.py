"""The binned gather forward against the scatter (issue 49), side by side in one process.

Per case (1aki, 3wip and 5h73 at 0.667 Å, 3wip at 0.333 Å, and the high-B cell ``3wip-hiB`` of
``bench_eager.py``), no autograd, float32 atoms on the device:

- ``scatter``: the default forward (``splat_triton``: one memset, one launch, float32 atomics);
- ``scatter_det``: the same under ``torch.use_deterministic_algorithms(True)`` (int64 fixed point, three launches);
- ``gather`` and ``gather_det``: the binned gather (``KERNELS_TRITON_FORWARD=gather``: binning, cumsum, fill,
  one program per brick), its float32 and fixed-point accumulation;
- ``gather_bin``: its binning alone (memset, per-atom launch, cumsum, fill), ``gather_bricks``: its brick launch
  alone on those buffers;
- ``gather_<shape>``: the gather with other brick shapes (``--bricks``), on the same atoms;
- ``write_bound``: ``torch.zeros_like`` of the map, one write pass of it.

Eager calls (CUDA events around each, synchronised, interleaved in blocks: ``_eager.measure_side_by_side``) and
CUDA-graph replays beside them, median of ``--reps``; the profiler's kernels per gather call with their device
time; pairs, bricks and the pair buffer; the largest |gather − scatter| over the largest |map|; the brick kernel's
registers and spills (``n_regs``, ``n_spills`` of each compiled specialisation). Prints a table of medians and
ratios and writes JSON (``--out``).

Usage::

    python benchmarks/bench_gather.py --out benchmarks/results/gather_h100_DATE.json   # ~1-2 min on an H100
    TRITON_INTERPRET=1 python benchmarks/bench_gather.py --smoke    # the code paths on 40 atoms, no GPU

Without a CUDA GPU and without ``TRITON_INTERPRET=1 --smoke`` it refuses (exit status 2) saying so.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import kernels  # noqa: E402
from benchmarks import _eager as E  # noqa: E402
from benchmarks.bench_eager import SPACING, _deterministic, _structure_atoms  # noqa: E402
from kernels.crystal import GridSpec  # noqa: E402
from kernels.density import triton as T  # noqa: E402

#: (case name, structure case of bench_eager, grid spacing in Å)
CASES = {
    "1aki": ("1aki", SPACING),
    "3wip": ("3wip", SPACING),
    "3wip@0.333": ("3wip", SPACING / 2),
    "5h73": ("5h73", SPACING),
    "3wip-hiB": ("3wip-hiB", SPACING),
}
REPS = 30
BRICKS = ("8x8x8w4", "8x8x16w1")


def _with_method(method: str, fn):
    """``fn`` called with the Triton forward routed through ``method``, the process's setting restored after."""

    def call():
        previous = T._set_forward_method(method)
        try:
            return fn()
        finally:
            T._set_forward_method(previous)

    return call


def _registers() -> list[dict]:
    """Registers and spills of every compiled specialisation of the gather's kernels (CUDA)."""
    from kernels.density import _triton_gather as G

    rows = []
    for kernel in (G._gather_brick_kernel, G._gather_bin_kernel, G._gather_fill_kernel):
        for caches in getattr(kernel, "device_caches", {}).values():
            for compiled in caches[0].values():
                meta = getattr(compiled, "metadata", None)
                rows.append({
                    "kernel": kernel.fn.__name__,
                    "n_regs": getattr(compiled, "n_regs", None),
                    "n_spills": getattr(compiled, "n_spills", None),
                    "num_warps": getattr(meta, "num_warps", None),
                    "shared_bytes": getattr(meta, "shared", None),
                })  # fmt: skip
    return rows


def _brick_shape(text: str) -> tuple[tuple[int, int, int], int]:
    """``XxYxZ`` or ``XxYxZwN`` (N warps, default 1): the brick and the warps of its program."""
    shape, _, warps = text.lower().partition("w")
    parts = tuple(int(p) for p in shape.split("x"))
    if len(parts) != 3 or any(p < 1 or p & (p - 1) for p in parts) or (warps and not warps.isdigit()):
        raise argparse.ArgumentTypeError(f"a brick is three powers of two as XxYxZ[wN], got {text!r}")
    return parts, int(warps or 1)


def case(name: str, device: torch.device, reps: int, smoke: bool, bricks: list[str]) -> dict:
    structure, spacing = CASES[name]
    atoms64, cell, what = _structure_atoms(structure, smoke)
    grid = GridSpec.for_spacing(cell, 2.0 if smoke else spacing)
    atoms = atoms64.to(device, torch.float32)
    plan = T._plan(grid, None, kernels.DEFAULT_CUTOFF, device)
    inputs = T._kernel_inputs(atoms)
    g = T._gather_plan(plan)
    res: dict = {"case": name, "what": what, "atoms": len(atoms), "grid": list(grid.shape), "cell": cell.kind,
                 "spacing": 2.0 if smoke else spacing,
                 "brick": [g.bx, g.by, g.bz], "num_warps": g.num_warps, "bricks": g.n_bricks, "pairs_per_atom_bound": g.pairs_per_atom,
                 "pair_capacity": len(atoms) * g.pairs_per_atom}  # fmt: skip

    def splat():
        with torch.no_grad():
            return T.splat_triton(atoms, grid)

    # Accuracy and the binning's figures (synchronising reads: outside the timed calls).
    sc = _with_method("scatter", splat)()
    ga, _radii, state = T._forward_gather(plan, *inputs, 1, plan.shape)
    bins = T._gather_bin(plan, g, *inputs, 1)
    scale = float(sc.abs().max())
    res["max_abs_gather_minus_scatter_over_max"] = float((ga - sc).abs().max()) / scale if scale else None
    res["overflow"] = int(state[1])
    starts = bins[3]
    res["pairs"] = int(starts[-1])
    res["pairs_per_atom_mean"] = res["pairs"] / max(len(atoms), 1)
    res["pairs_per_brick_max"] = int((starts[1:] - starts[:-1]).max()) if len(starts) > 1 else 0
    print(f"\n== {name}: {what}, grid {tuple(grid.shape)} ({cell.kind}), {res['pairs']} pairs in {g.n_bricks} bricks "
          f"(bound {res['pair_capacity']}), |gather - scatter| / max = {res['max_abs_gather_minus_scatter_over_max']:.2e}",
          flush=True)  # fmt: skip

    fns = {
        "scatter": _with_method("scatter", splat),
        "scatter_det": _deterministic(_with_method("scatter", splat)),
        "gather": _with_method("gather", splat),
        "gather_det": _deterministic(_with_method("gather", splat)),
        "gather_bin": lambda: T._gather_bin(plan, g, *inputs, 1),
        "gather_bricks": lambda: T._gather_bricks(plan, g, bins, 1, plan.shape),
        "write_bound": lambda: torch.zeros_like(sc),
    }
    for text in bricks:
        other = T._gather_plan_for(plan, *_brick_shape(text))
        fns[f"gather_{text}"] = lambda other=other: T._forward_gather(plan, *inputs, 1, plan.shape, gplan=other)[0]

    timing = E.measure_side_by_side(fns, device, reps=reps, graph=device.type == "cuda", host=False)
    res["timing"] = timing
    res["profile_gather"] = E.kernel_profile(fns["gather"], device, calls=10, top=8)
    res["profile_gather_det"] = E.kernel_profile(fns["gather_det"], device, calls=10, top=8)
    return res


def _med(stats: dict, key: str):
    v = stats.get(key, {})
    return v.get("median_ms") if isinstance(v, dict) else None


def table(results: list[dict]) -> str:
    names = ["scatter", "scatter_det", "gather", "gather_det", "gather_bin", "gather_bricks", "write_bound"]
    lines = []
    for kind in ("eager", "graph"):
        lines.append(f"\n{kind} medians (ms); ratios gather/scatter, gather_det/scatter_det, gather/write_bound")
        lines.append(f"{'case':12s}" + "".join(f"{n:>14s}" for n in names) + f"{'g/s':>7s}{'gd/sd':>7s}{'g/w':>7s}")
        for r in results:
            if "error" in r:
                lines.append(f"{r['case']:12s} error: {r['error']}")
                continue
            t = r["timing"]
            med = {n: _med(t.get(n, {}), kind) for n in names}

            def ratio(a, b, med=med):
                return f"{med[a] / med[b]:7.2f}" if med[a] and med[b] else f"{'-':>7s}"

            cells = "".join(f"{med[n]:14.4f}" if med[n] is not None else f"{'-':>14s}" for n in names)
            lines.append(f"{r['case']:12s}{cells}{ratio('gather', 'scatter')}{ratio('gather_det', 'scatter_det')}"
                         f"{ratio('gather', 'write_bound')}")  # fmt: skip
        extra = sorted({n for r in results if "timing" in r for n in r["timing"] if n not in names})
        for n in extra:
            row = [f"{r['case']}: {_med(r['timing'][n], kind):.4f}" for r in results
                   if "timing" in r and n in r["timing"] and _med(r["timing"][n], kind) is not None]  # fmt: skip
            if row:
                lines.append(f"  {n}: " + ", ".join(row))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--reps", type=int, default=REPS)
    ap.add_argument("--bricks", nargs="*", default=list(BRICKS), help="other brick shapes to time, XxYxZ[wN] (N warps)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny inputs, few timed calls, in the interpreter")
    args = ap.parse_args(argv)
    if torch.cuda.is_available():
        device = torch.device("cuda")
    elif args.smoke and os.environ.get("TRITON_INTERPRET") == "1":
        device = torch.device("cpu")
    else:
        print("bench_gather.py measures a CUDA GPU and none is visible here; run it on a GPU machine, or check "
              "the script with TRITON_INTERPRET=1 python benchmarks/bench_gather.py --smoke", file=sys.stderr)  # fmt: skip
        return 2
    if args.smoke:
        args.cases = args.cases[:1] if args.cases != list(CASES) else ["1aki"]
        args.reps = min(args.reps, 2)
        E.WARMUP_CALLS, E.WARMUP_S, E.BLOCK, E.SETTLE = 1, 0.0, 2, 0
    date = datetime.date.today().isoformat()
    t0 = time.perf_counter()
    result: dict = {
        "benchmark": "binned gather forward vs the scatter (issue 49)",
        "date": date, "env": E.environment(), "smoke": args.smoke, "reps": args.reps,
        "timing": "eager: CUDA events around each call, synchronised, interleaved (_eager.measure_side_by_side); "
                  "graph: CUDA graph replays; medians in ms",
    }  # fmt: skip
    result["cases"] = []
    for name in args.cases:
        try:
            result["cases"].append(case(name, device, args.reps, args.smoke, args.bricks))
        except Exception as exc:
            result["cases"].append({"case": name, **E.error_record(exc)})
            print(f"{name}: {result['cases'][-1]['error']}", flush=True)
    result["registers"] = _registers() if device.type == "cuda" else []
    result["seconds"] = time.perf_counter() - t0
    text = table(result["cases"])
    print(text)
    for row in result["registers"]:
        print(f"{row['kernel']}: {row['n_regs']} registers, {row['n_spills']} spills, {row['num_warps']} warps")
    if args.out is None:
        tag = "smoke" if args.smoke else E.gpu_tag()
        args.out = ROOT / "benchmarks" / "results" / f"gather_{tag}_{date}.json"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out} ({result['seconds']:.0f} s)")
    bad = [c["case"] for c in result["cases"] if "error" in c]
    if bad:
        print("errors:", ", ".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
