"""Host cost of a splat call on the CPU, one source tree against another: argument checks, custom ops.

Times ``kernels.splat_density`` and ``kernels.splat_ensemble`` (``reduce="sum"``) of valid float32
input under ``no_grad`` on the cpu backend, where the call's Python part (argument checks, host
value checks, the peak-density warning's scan) is a visible share:

- ``tiny``: 20 atoms in a 12 Å cube at 1.0 Å (the call is nearly all overhead);
- ``1orc``: the bundled 1ORC at 1.0 Å;
- ``ens``: 8 frames of 1ORC (positions + 0.1 Å noise) at 1.0 Å, with weights.

With ``--compiled-ops`` it times instead the per-call host cost of the ``torch.library`` ops that
``kernels._opdef.register`` builds, inside ``torch.compile(fullgraph=True)`` graphs (inductor), against
the eager autograd Function of the same op. That cost is host-side Python, the same on every device:

- ``scale``: an op of trivial work (``x * w`` on 8 floats, backward ``grad * w, grad * x``), the density
  ops' plain arguments (cell, shape, radius, cutoff), defined by an ``OpDef`` and registered as the
  density ops are; ``scale1`` calls it once, ``scale8`` eight times in a chain (their difference / 7 is
  the cost of one more op call in a graph);
- ``tiny``: ``kernels.splat_density`` (cpu backend) of 20 atoms in a 12 Å cube at 1.0 Å, summed with
  weights (the loss of a fitting step), its atoms built from the leaves with ``_validate=False``.

Each case runs forward under ``no_grad`` (``fwd``) and forward + ``backward()`` (``grad``), each
``eager`` (the autograd Function; ``splat_density`` as called), ``dispatch`` (the op through the
dispatcher without compiling; ``scale`` only) and ``compiled``.

Each tree (``--tree DIR``, a checkout with the compiled ``*.so`` in place; ``git worktree`` or an
exported revision) is timed in its own child process; the trees' children alternate for
``--rounds`` rounds so the shared host's drift meets each alike. A child warms each case up
(5 calls), then times ``--reps`` calls each (wall clock per call); the program prints and writes
(``--out``) each case's median over all rounds, with p10/p90.

Usage::

    python benchmarks/bench_call_overhead.py --tree OLD_CHECKOUT --tree . [--rounds 5] [--reps 100] [--out X.json]
    python benchmarks/bench_call_overhead.py --compiled-ops --tree OLD_CHECKOUT --tree . [--out X.json]
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

CHILD_OPS = r"""
import json, sys, time, warnings
import torch
import kernels
from kernels._opdef import OpDef, eager_function, register
warnings.simplefilter("ignore")
torch.manual_seed(0)
reps = int(sys.argv[1])

SCALE = OpDef(
    name="bench_overhead::scale",
    inputs=("Tensor x", "Tensor w"),
    params=("float[] cell", "int[] shape", "float? radius", "float cutoff"),
    grads=(0, 1),
    saved=0,
    call=lambda inputs, params: params,
    forward=lambda state, x, w: (x * w,),
    backward=lambda state, grad, x, w: (grad * w, grad * x),
    fake=lambda x, w, *params: (torch.empty_like(x),),
)
register(SCALE)
Scale = eager_function(SCALE)
scale_op = torch.ops.bench_overhead.scale.default
cell_p, shape_p = [12.0, 12.0, 12.0, 90.0, 90.0, 90.0], [12, 12, 12]
state = (cell_p, shape_p, None, 1e-5)


def chain(k, call):
    def run(x, w):
        for _ in range(k):
            x = call(x, w)
        return x.sum()

    return run


by_op = lambda x, w: scale_op(x, w, cell_p, shape_p, None, 1e-5)
by_fn = lambda x, w: Scale.apply(state, x, w)

cell = kernels.Cell.from_parameters(12.0, 12.0, 12.0, 90.0, 90.0, 90.0)
tiny = kernels.AtomSet.from_elements(["C", "N", "O", "S"] * 5, torch.rand(20, 3) * 12, 20.0, dtype=torch.float32)
grid = kernels.GridSpec.for_spacing(cell, 1.0)
weight = torch.randn(grid.shape)


def tiny_loss(xyz, b_iso, occ):
    atoms = kernels.AtomSet(xyz, b_iso, occ, tiny.a, tiny.b, _validate=False)
    return (kernels.splat_density(atoms, grid, backend="cpu") * weight).sum()


scale_leaves = [torch.randn(8).requires_grad_(True) for _ in range(2)]
tiny_leaves = [t.clone().requires_grad_(True) for t in (tiny.xyz, tiny.b_iso, tiny.occ)]
cases = {}
for k in (1, 8):
    cases[f"scale{k}"] = scale_leaves, {
        "eager": chain(k, by_fn),
        "dispatch": chain(k, by_op),
        "compiled": torch.compile(chain(k, by_op), fullgraph=True),
    }
cases["tiny"] = tiny_leaves, {"eager": tiny_loss, "compiled": torch.compile(tiny_loss, fullgraph=True)}


def once(fn, leaves, grad):
    if grad:
        fn(*leaves).backward()
    else:
        with torch.no_grad():
            fn(*leaves)


out = {}
for case, (leaves, fns) in cases.items():
    for grad in (False, True):
        # Warm up (compiles) each, then time the variants in turn, call by call, so drift meets each alike.
        for fn in fns.values():
            for _ in range(10):
                once(fn, leaves, grad)
        times = {name: [] for name in fns}
        for _ in range(reps):
            for name, fn in fns.items():
                t = time.perf_counter()
                once(fn, leaves, grad)
                times[name].append(time.perf_counter() - t)
        for name, values in times.items():
            out[f"{case} {'grad' if grad else 'fwd'} {name}"] = values
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
    ap.add_argument("--compiled-ops", action="store_true", help="time the custom ops in compiled graphs (see above)")
    args = ap.parse_args()
    child = CHILD_OPS if args.compiled_ops else CHILD
    times: dict[str, dict[str, list[float]]] = {str(t): {} for t in args.tree}
    for _ in range(args.rounds):
        for tree in args.tree:
            env = dict(os.environ, PYTHONPATH=str(tree.resolve()))
            # Run in the tree: ``python -c`` puts the working directory first on sys.path, ahead of PYTHONPATH.
            proc = subprocess.run(
                [sys.executable, "-c", child, str(args.reps)],
                env=env, cwd=tree, capture_output=True, text=True, check=True,
            )  # fmt: skip
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
    trees = [str(t) for t in args.tree]
    if args.compiled_ops:
        # One more op call in a compiled graph: the chain of eight against the single call, per op.
        for tree in trees:
            for mode in ("fwd", "grad"):
                for variant in ("eager", "dispatch", "compiled"):
                    one, eight = (result[tree][f"scale{k} {mode} {variant}"]["median_us"] for k in (1, 8))
                    result[tree][f"per op {mode} {variant}"] = {"median_us": (eight - one) / 7}
    print("median µs per call; " + "; ".join(f"[{i}] {t}" for i, t in enumerate(trees)))
    for case in result[trees[0]]:
        values = [result[t][case]["median_us"] for t in trees]
        ratio = f"   [{len(trees) - 1}]/[0] {values[-1] / values[0]:.2f}" if len(trees) > 1 and values[0] > 0 else ""
        print(f"{case:<26}" + "".join(f"{v:10.1f}" for v in values) + ratio)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
