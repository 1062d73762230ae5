"""Eager against ``torch.compile(fullgraph=True)``: the fitting loop's loss and gradient, timed interleaved.

``bench_loop.py`` times each mode in its own run of steps, minutes apart; on a shared host the load
drifts between them. Here the same loss (``splat_density`` of ``atoms.replace(xyz=x)``, the map's
squared difference, λ·``planarity_nll``) runs forward and backward eagerly and compiled, one call of
each in turn, so both meet the same load; the medians and their ratio are printed and written to
JSON.

Usage::

    python benchmarks/loop_compile_ab.py --structures 1aki --adp iso aniso --reps 40 --threads 2 --out X.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import kernels  # noqa: E402
from benchmarks._structures import anisotropic_model, model  # noqa: E402
from kernels.crystal import GridSpec  # noqa: E402


def _measure(name: str, adp: str, device: torch.device, spacing: float, reps: int) -> dict:
    m = anisotropic_model(name) if adp == "aniso" else model(name)
    atoms = m.atoms if adp == "aniso" else m.atoms.replace(u_aniso=None, aniso=None)
    atoms = atoms.to(device, torch.float32)
    grid = GridSpec.for_spacing(m.cell, spacing)
    planes = kernels.find_planes(m)
    with torch.no_grad():
        target = kernels.splat_density(atoms, grid)
    volume = grid.voxel_volume

    def loss(x):
        rho = kernels.splat_density(atoms.replace(xyz=x), grid)
        return ((rho - target) ** 2).sum() * volume + 0.1 * kernels.planarity_nll(x, planes)

    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True)
    x = (atoms.xyz + 0.1).requires_grad_(True)

    def call(fn):
        x.grad = None
        fn(x).backward()
        if device.type == "cuda":
            torch.cuda.synchronize()

    t0 = time.perf_counter()
    call(compiled)
    first = time.perf_counter() - t0
    for _ in range(3):
        call(loss)
        call(compiled)
    eager_ms, compiled_ms = [], []
    for _ in range(reps):
        for fn, out in ((loss, eager_ms), (compiled, compiled_ms)):
            t0 = time.perf_counter()
            call(fn)
            out.append((time.perf_counter() - t0) * 1e3)
    e, c = statistics.median(eager_ms), statistics.median(compiled_ms)
    return {
        "structure": name,
        "adp": adp,
        "n_atoms": len(atoms),
        "grid": list(grid.shape),
        "eager_ms": e,
        "compiled_ms": c,
        "compiled_over_eager": c / e,
        "compile_s": first,
        "reps": reps,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--structures", nargs="+", default=["1aki"])
    ap.add_argument("--adp", nargs="+", choices=("iso", "aniso"), default=["iso", "aniso"])
    ap.add_argument("--spacing", type=float, default=2.0 / 3.0)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    record = {"command": " ".join(sys.argv), "torch": torch.__version__, "load_average_start": os.getloadavg()}
    rows = []
    for name in args.structures:
        for adp in args.adp:
            row = _measure(name, adp, device, args.spacing, args.reps)
            rows.append(row)
            print(
                f"{name} {adp}: eager {row['eager_ms']:.2f} ms, compiled {row['compiled_ms']:.2f} ms "
                f"(×{row['compiled_over_eager']:.2f}; compile {row['compile_s']:.1f} s)",
                flush=True,
            )
    record.update(rows=rows, load_average_end=os.getloadavg())
    if args.out:
        args.out.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
