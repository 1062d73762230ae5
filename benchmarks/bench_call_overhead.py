"""Host cost of a splat call on the CPU, one source tree against another: what argument checks add.

Times ``kernels.splat_density`` and ``kernels.splat_ensemble`` (``reduce="sum"``) of valid float32
input under ``no_grad`` on the cpu backend, where the call's Python part (argument checks, host
value checks, the peak-density warning's scan) is a visible share:

- ``tiny``: 20 atoms in a 12 Å cube at 1.0 Å (the call is nearly all overhead);
- ``1orc``: the bundled 1ORC at 1.0 Å;
- ``ens``: 8 frames of 1ORC (positions + 0.1 Å noise) at 1.0 Å, with weights.

Each tree (``--tree DIR``, a checkout with the compiled ``*.so`` in place; ``git worktree`` or an
exported revision) is timed in its own child process; the trees' children alternate for
``--rounds`` rounds so the shared host's drift meets each alike. A child warms each case up
(5 calls), then times ``--reps`` calls each (wall clock per call); the program prints and writes
(``--out``) each case's median over all rounds, with p10/p90.

Usage::

    python benchmarks/bench_call_overhead.py --tree OLD_CHECKOUT --tree . [--rounds 5] [--reps 100] [--out X.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, sys, time, warnings
import torch
import kernels
warnings.simplefilter("ignore")
torch.manual_seed(0)
reps = int(sys.argv[1])
cell = kernels.Cell.from_parameters(12.0, 12.0, 12.0, 90.0, 90.0, 90.0)
tiny = kernels.AtomSet.from_elements(["C", "N", "O", "S"] * 5, torch.rand(20, 3) * 12, 20.0, dtype=torch.float32)
tiny_grid = kernels.GridSpec.for_spacing(cell, 1.0)
model = kernels.read_model(kernels.example_structure("1orc"))
atoms = model.atoms.to("cpu", torch.float32)
grid = kernels.GridSpec.for_spacing(model.cell, 1.0)
frames = (atoms.xyz + 0.1 * torch.randn(8, len(atoms), 3)).contiguous()
weights = torch.full((8,), 1 / 8)
cases = {
    "tiny": lambda: kernels.splat_density(tiny, tiny_grid),
    "1orc": lambda: kernels.splat_density(atoms, grid),
    "ens": lambda: kernels.splat_ensemble(atoms, frames, grid, weights=weights),
}
out = {}
with torch.no_grad():
    for name, call in cases.items():
        for _ in range(5):
            call()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            call()
            times.append(time.perf_counter() - t)
        out[name] = times
print(json.dumps(out))
"""


def _percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", type=Path, required=True, help="a source tree to time (repeat)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    times: dict[str, dict[str, list[float]]] = {str(t): {} for t in args.tree}
    for _ in range(args.rounds):
        for tree in args.tree:
            env = dict(os.environ, PYTHONPATH=str(tree.resolve()))
            proc = subprocess.run(
                [sys.executable, "-c", CHILD, str(args.reps)], env=env, capture_output=True, text=True, check=True
            )
            for case, values in json.loads(proc.stdout).items():
                times[str(tree)].setdefault(case, []).extend(values)
    result = {
        tree: {
            case: {q: 1e6 * _percentile(v, p) for q, p in (("p10_us", 0.1), ("median_us", 0.5), ("p90_us", 0.9))}
            for case, v in cases.items()
        }
        for tree, cases in times.items()
    }
    result["meta"] = {"rounds": args.rounds, "reps": args.reps, "threads": os.environ.get("OMP_NUM_THREADS")}
    for tree in args.tree:
        row = ", ".join(f"{c} {r['median_us']:.0f} µs" for c, r in result[str(tree)].items())
        print(f"{tree}: {row}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
