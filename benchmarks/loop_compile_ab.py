"""The fitting loop's whole step, eager against compiled, timed interleaved on the same host load.

``bench_loop.py`` times each mode in its own run of steps, minutes apart; on a shared host the load
drifts between them by more than the difference asked about. Here every way of running the step has
its own copy of the start positions and its own Adam, and one step of each runs in turn, round after
round, so all meet the same load. A step is what a user's loop does: ``opt.zero_grad()``, the loss
(``splat_density`` of ``atoms.replace(xyz=x)``, the map's squared difference, λ·``planarity_nll``),
``loss.backward()``, ``opt.step()``. The ways (``--modes``):

- ``eager``: as written;
- ``compiled``: the loss under ``torch.compile(fullgraph=True)``, the rest eager;
- ``compiled-step``: the same, and the optimiser's step under ``torch.compile`` too (PyTorch's advice for
  a compiled loop: the eager Adam's host time is a large part of a small model's step);
- ``compiled-autograd``: the whole step (loss, ``backward()``, ``opt.step()``) in one ``torch.compile`` function
  with ``torch._dynamo.config.compiled_autograd`` on, so the backward is compiled by dynamo too (the step's
  gradient reset stays outside: dynamo does not trace ``Optimizer.zero_grad``);
- ``reduce-overhead``: the loss under ``torch.compile(fullgraph=True, mode="reduce-overhead")`` (CUDA
  graphs; CUDA only), the positions marked with ``torch._dynamo.mark_static_address`` (Adam updates them
  in place, so their address never changes and the graph need not copy them in on every replay).

Timing: on the GPU CUDA events around each step and a synchronisation after it, so host gaps between
launches count; on the CPU ``time.perf_counter``. Medians, p10 and p90 after warm-up, and each mode's
median over eager's (issue 33: compiled ≤ 1, reduce-overhead < 1 on the GPU). The positions after the
timed steps are compared with eager's, which took the same number of steps from the same start.

Usage::

    python benchmarks/loop_compile_ab.py --device cuda --structures 1aki 3wip --adp iso aniso --out X.json
    python benchmarks/loop_compile_ab.py --device cpu --threads 2 --structures 1aki --out X.json
"""

from __future__ import annotations

import argparse
import datetime
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
from benchmarks import _eager as E  # noqa: E402
from benchmarks._structures import anisotropic_model, model, with_high_b  # noqa: E402
from kernels.crystal import GridSpec  # noqa: E402

MODES = ("eager", "compiled", "compiled-step", "compiled-autograd", "reduce-overhead")
LAMBDA = 0.1
LR = 0.02  # Å, Adam's step
SHIFT = 0.5  # Å RMS distortion of the start


def _problem(name: str, adp: str, device: torch.device, spacing: float):
    base = name.removesuffix("-hiB")
    m = anisotropic_model(base) if adp == "aniso" else model(base)
    atoms = m.atoms if adp == "aniso" else m.atoms.replace(u_aniso=None, aniso=None)
    if name.endswith("-hiB"):
        atoms, _ = with_high_b(atoms)
    atoms = atoms.to(device, torch.float32)
    grid = GridSpec.for_spacing(m.cell, spacing)
    planes = kernels.find_planes(m)
    with torch.no_grad():
        target = kernels.splat_density(atoms, grid)
    g = torch.Generator().manual_seed(0)
    shift = torch.randn(atoms.xyz.shape, generator=g, dtype=torch.float64) * (SHIFT / 3**0.5)
    start = (atoms.xyz.double().cpu() + shift).to(device, torch.float32)
    volume = grid.voxel_volume

    def loss(x):
        rho = kernels.splat_density(atoms.replace(xyz=x), grid)
        return ((rho - target) ** 2).sum() * volume + LAMBDA * kernels.planarity_nll(x, planes)

    return atoms, grid, start, loss


def _stepper(mode: str, loss, start: torch.Tensor):
    """(step, x): one step of the loop run the way ``mode`` says, and its positions (a fresh leaf)."""
    x = start.clone().requires_grad_(True)
    opt = torch.optim.Adam([x], lr=LR)
    update = opt.step
    if mode == "eager":
        fn = loss
    elif mode in ("compiled", "compiled-step"):
        fn = torch.compile(loss, fullgraph=True)
        if mode == "compiled-step":
            update = torch.compile(opt.step)
    elif mode == "compiled-autograd":

        def whole():
            loss(x).backward()
            opt.step()

        whole_step = torch.compile(whole)

        def step():
            x.grad = None
            with torch._dynamo.config.patch(compiled_autograd=True):
                whole_step()

        return step, x
    elif mode == "reduce-overhead":
        torch._dynamo.mark_static_address(x)
        fn = torch.compile(loss, fullgraph=True, mode="reduce-overhead")
    else:
        raise ValueError(f"unknown mode {mode!r}; one of {MODES}")
    cuda_graphs = mode == "reduce-overhead"

    def step():
        if cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        opt.zero_grad(set_to_none=True)
        fn(x).backward()
        update()

    return step, x


def _stats(ms: list[float]) -> dict:
    q = statistics.quantiles(ms, n=10)
    return {"median": statistics.median(ms), "p10": q[0], "p90": q[-1], "n": len(ms)}


def measure(name: str, adp: str, device: torch.device, modes, spacing: float, reps: int, warmup: int) -> dict:
    """One structure: every mode's step, interleaved; see the module docstring."""
    atoms, grid, start, loss = _problem(name, adp, device, spacing)
    torch._dynamo.reset()
    steppers, first_s = {}, {}
    for mode in modes:
        step, x = _stepper(mode, loss, start)
        t0 = time.perf_counter()
        step()  # compiles
        if device.type == "cuda":
            torch.cuda.synchronize()
        first_s[mode] = time.perf_counter() - t0
        steppers[mode] = (step, x)
    times: dict = {mode: [] for mode in modes}
    for r in range(warmup + reps):
        order = modes[r % len(modes) :] + modes[: r % len(modes)]  # who goes first rotates
        for mode in order:
            t = E.eager_call_ms(steppers[mode][0], device)
            if r >= warmup:
                times[mode].append(t)
    row = {"structure": name, "adp": adp, "n_atoms": len(atoms), "grid": list(grid.shape), "reps": reps}
    row["step_ms"] = {mode: _stats(v) for mode, v in times.items()}
    row["first_step_s"] = first_s
    eager = row["step_ms"].get("eager", {}).get("median")
    row["over_eager"] = {m: s["median"] / eager for m, s in row["step_ms"].items() if eager and m != "eager"}
    if "eager" in steppers:
        ref = steppers["eager"][1].detach()
        row["positions_vs_eager_max_abs_A"] = {
            m: float((x.detach() - ref).abs().max()) for m, (_, x) in steppers.items() if m != "eager"
        }
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--structures", nargs="+", default=["1aki"])
    ap.add_argument("--adp", nargs="+", choices=("iso", "aniso"), default=["iso", "aniso"])
    ap.add_argument("--modes", nargs="+", choices=MODES, default=None, help="default: all (reduce-overhead: CUDA)")
    ap.add_argument("--spacing", type=float, default=2.0 / 3.0)
    ap.add_argument("--reps", type=int, default=40, help="timed steps of each mode")
    ap.add_argument("--warmup", type=int, default=5, help="untimed rounds after the first (compiling) step")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    modes = list(args.modes or [m for m in MODES if m != "reduce-overhead" or device.type == "cuda"])
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    record = {
        "benchmark": "loop_compile_ab",
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "torch": torch.__version__,
        "command": " ".join(sys.argv),
        "load_average_start": os.getloadavg(),
        "rows": [],
    }
    for name in args.structures:
        for adp in args.adp:
            row = measure(name, adp, device, modes, args.spacing, args.reps, args.warmup)
            record["rows"].append(row)
            cells = ", ".join(
                f"{m} {s['median']:.3f} ms" + (f" (×{row['over_eager'][m]:.2f})" if m in row["over_eager"] else "")
                for m, s in row["step_ms"].items()
            )
            print(f"{name} {adp}: {cells}", flush=True)
            if args.out:
                args.out.write_text(json.dumps(record, indent=1))
    record["load_average_end"] = os.getloadavg()
    if args.out:
        args.out.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
