"""The kernels in a fitting loop: a real-space fit of a model to a map, timed step by step as a user writes it.

A step is one evaluation of the loss and its gradient plus, for Adam, the update (L-BFGS reports its
evaluations). Per case:

- **target map**: the undistorted model's map (``splat_density`` of the deposited atoms, float32), or
  the map file given with ``--map`` (its grid is then the fit's grid);
- **start**: every atom moved by a seeded random shift of ``--shift`` Å RMS (0.5 by default);
- **loss**: ``Σ_voxels V·(ρ_calc − ρ_target)² + λ·planarity NLL`` (``kernels.splat_density``,
  ``kernels.planarity_nll`` on the model's planes from ``kernels.find_planes``; V the voxel volume);
- **optimiser**: Adam over xyz (lr ``--lr``), optionally B (``b``), U (``u``, anisotropic atoms) and
  occupancy (``occ``) with ``--params``, its update ``fused`` (``Adam(..., fused=True)``: one kernel, as
  docs/kernels.md writes the loop) or torch's default ``foreach`` (``--updates``, both by default, side by
  side); or L-BFGS (strong Wolfe line search, 20 evaluations a step);
- **atoms rebuilt every step**, both ways users write it: ``AtomSet(x, b, occ, a, b_coef, …)`` from
  tensors (``build=constructor``, no labels passed) and ``atoms.replace(xyz=x)`` (``build=replace``);
- **modes**: ``eager``; ``compiled`` (``torch.compile(loss, fullgraph=True)``); ``reduce-overhead``
  (``torch.compile(loss, fullgraph=True, mode="reduce-overhead")``, CUDA only: CUDA graphs; the optimiser's
  tensors marked with ``torch._dynamo.mark_static_address``, so replays do not copy them in); ``step``
  (``kernels.fitting.Step``, CUDA only: the whole step — zero_grad, loss, backward, Adam — replayed as one
  CUDA graph; reported beside it: the device time of the kernels an eager step of the same loss launches,
  and the step's ratio to it, issue 44's target ≤ 1.3);
- **structures**: 1aki, 3wip and 3wip-hiB (every B scaled to a maximum of 250 Å², as
  ``bench_eager.py`` builds it), each isotropic (``iso``) and with U (``aniso``: the entry's ANISOU or
  the synthetic U of ``benchmarks/_structures.anisotropic_model``); ``--ensemble F`` adds an F-frame
  ensemble of 1aki (every frame distorted on its own) through ``kernels.splat_ensemble`` against the
  same target, with the planarity NLL summed over frames.

Reported per case: the step time (median, p10, p90 after ``--warmup`` steps; the first step, which
compiles, apart), the host time of a step (``host_ms``: ``perf_counter`` around the step's Python call,
which returns once its work is queued; on a GPU the step's time is that when the host is the bound) beside the sum of its parts each timed alone on the same inputs (splat forward +
map loss + backward, planarity forward + backward, the optimiser's update; building the atoms is
timed too but is not a part: it is what the loop adds), their ratio (issue 33's target: ≤ 1.15), the
floor step (``floor_step``: the same step with the splat and the planarity NLL each replaced by an op of one
allocation and one memset each way, so what torch alone costs a step of this shape; Adam cases without
frames), the
RMSD to the true model and the loss after every step, and the first step at which the RMSD is below
0.1 Å. Timing: on the GPU CUDA events around each step with a synchronisation after it (so the time
includes any host gap between launches); on the CPU ``time.perf_counter``. The host's load average
is recorded: a shared CPU distorts every figure.

Usage::

    python benchmarks/bench_loop.py --device cpu --threads 2 --structures 1aki 3wip      # CPU record
    python benchmarks/bench_loop.py --device cuda                                         # everything on a GPU
    python benchmarks/bench_loop.py --smoke                                                # seconds, CPU

The JSON goes to ``benchmarks/results/loop_<device>_<date>.json`` unless ``--out`` says otherwise.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import math
import os
import platform
import pstats
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
from kernels.crystal import AtomSet, GridSpec  # noqa: E402
from kernels.fitting import Step  # noqa: E402

SPACING = 2.0 / 3.0
STRUCTURES = ("1aki", "3wip", "3wip-hiB")
BUILDS = ("constructor", "replace")
STEP_OVER_PARTS = 1.15  # issue 33's target for the step against the sum of its parts
STEP_OVER_KERNELS = 1.3  # issue 44's target for a replayed step against its kernels' device time
RMSD_GOAL = 0.1  # Å


# --------------------------------------------------------------------------- the problem


def _problem(name: str, adp: str, device: torch.device, args) -> dict:
    """True atoms, start positions, planes, grid and target map of one structure (float32 on ``device``)."""
    base = name.removesuffix("-hiB")
    m = anisotropic_model(base) if adp == "aniso" else model(base)
    atoms = m.atoms if adp == "aniso" else m.atoms.replace(u_aniso=None, aniso=None)
    if name.endswith("-hiB"):
        atoms, _ = with_high_b(atoms)
    atoms = atoms.check().to(device, torch.float32)
    if args.map:
        target, grid = kernels.read_map(args.map)
        target = target.to(device, torch.float32)
    else:
        grid = GridSpec.for_spacing(m.cell, args.spacing)
        with torch.no_grad():
            target = kernels.splat_density(atoms, grid)
    g = torch.Generator().manual_seed(args.seed)
    shift = torch.randn(atoms.xyz.shape, generator=g, dtype=torch.float64) * (args.shift / math.sqrt(3))
    start = (atoms.xyz.double().cpu() + shift).to(device, torch.float32)
    return {"atoms": atoms, "start": start, "planes": kernels.find_planes(m), "grid": grid, "target": target}


def _loss_fn(p: dict, build: str, lam: float):
    """``loss(x, b, occ, u)``: the user's loss, building the atoms from the optimiser's tensors."""
    atoms, planes, grid, target = p["atoms"], p["planes"], p["grid"], p["target"]
    volume = grid.voxel_volume

    def loss(x, b, occ, u):
        if build == "constructor":
            moved = AtomSet(x, b, occ, atoms.a, atoms.b, u_aniso=u, aniso=atoms.aniso, radiation=atoms.radiation)
        else:
            moved = atoms.replace(xyz=x, b_iso=b, occ=occ, u_aniso=u)
        rho = kernels.splat_density(moved, grid)
        return ((rho - target) ** 2).sum() * volume + lam * kernels.planarity_nll(x, planes)

    return loss


def _ensemble_loss_fn(p: dict, lam: float, n_frames: int):
    atoms, planes, grid, target = p["atoms"], p["planes"], p["grid"], p["target"]
    volume = grid.voxel_volume
    weights = torch.full((n_frames,), 1.0 / n_frames, dtype=atoms.dtype, device=atoms.device)

    def loss(x, b, occ, u):
        rho = kernels.splat_ensemble(atoms, x, grid, weights=weights)
        restraint = sum(kernels.planarity_nll(x[f], planes) for f in range(n_frames))
        return ((rho - target) ** 2).sum() * volume + lam * restraint

    return loss


def _leaves(p: dict, params: tuple[str, ...], n_frames: int | None):
    """The optimiser's tensors (x, b, occ, u), fresh leaves; those in ``params`` require grad."""
    atoms = p["atoms"]
    if n_frames:
        g = torch.Generator().manual_seed(1)
        shift = torch.randn((n_frames, *atoms.xyz.shape), generator=g) * (0.5 / math.sqrt(3))
        x = (atoms.xyz.cpu() + shift).to(atoms.device)
    else:
        x = p["start"].clone()
    b, occ = atoms.b_iso.clone(), atoms.occ.clone()
    u = None if atoms.u_aniso is None else atoms.u_aniso.clone()
    want = {"xyz": x, "b": b, "occ": occ, "u": u}
    for name in params:
        if want[name] is not None:
            want[name].requires_grad_(True)
    return x, b, occ, u


def _optimizer(kind: str, leaves, params: tuple[str, ...], lr: float, update: str = "foreach"):
    x, b, occ, u = leaves
    if kind == "lbfgs":
        return torch.optim.LBFGS(
            [t for t in leaves if t is not None and t.requires_grad],
            max_iter=20,
            history_size=20,
            line_search_fn="strong_wolfe",
        )
    groups = [{"params": [x], "lr": lr}]
    if "b" in params:
        groups.append({"params": [b], "lr": 20 * lr})  # Å² against Å
    if "occ" in params:
        groups.append({"params": [occ], "lr": 0.2 * lr})
    if "u" in params and u is not None:
        groups.append({"params": [u], "lr": 0.2 * lr})
    return torch.optim.Adam(groups, fused=update == "fused")


def _rmsd(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    d = (x.detach() - ref).pow(2).sum(dim=-1)
    return d.mean(dim=-1).sqrt().mean() if d.ndim == 2 else d.mean().sqrt()


# --------------------------------------------------------------------------- timing


def _stats(ms: list[float]) -> dict:
    if not ms:
        return {"median": None, "p10": None, "p90": None, "n": 0}
    q = statistics.quantiles(ms, n=10) if len(ms) > 1 else [ms[0]] * 9
    return {"median": statistics.median(ms), "p10": q[0], "p90": q[-1], "n": len(ms)}


def _build_us(build, batches: int = 5, calls: int = 200) -> float:
    """Median µs of one ``build()``, timed on the host over batches of calls.

    Building the atoms issues no device work and reads no value (tests/kernels/test_loop.py), so
    ``perf_counter`` over many calls measures it; a CUDA-event pair around a single call would add
    the events' own few µs to a 5 µs call.
    """
    per_call = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(calls):
            build()
        per_call.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(per_call)


def _parts(p: dict, case: dict, leaves, timer, reps: int, step) -> dict:
    """The parts of a step, each timed alone on the same inputs, interleaved with whole steps.

    Each of ``reps`` rounds times one whole ``step()`` (the case's own loop), then the splat and map
    loss forward+backward, the planarity forward+backward and the optimiser's update, one call each:
    the step and its parts meet the same host load, which on a shared host drifts by 2× within a
    minute (the H200 record of 2026-11-28 timed the parts after the steps: the same planarity call took
    0.19 ms in one case and 0.41 ms in the next). Medians in ms; ``build`` in µs (:func:`_build_us`).
    """
    atoms, planes, grid, target = p["atoms"], p["planes"], p["grid"], p["target"]
    x, b, occ, u = leaves
    volume, lam = grid.voxel_volume, case["lambda"]
    n_frames = case.get("frames")
    if n_frames:
        weights = torch.full((n_frames,), 1.0 / n_frames, dtype=atoms.dtype, device=atoms.device)

        def density():
            rho = kernels.splat_ensemble(atoms, x, grid, weights=weights)
            (((rho - target) ** 2).sum() * volume).backward()

        def planarity():
            (lam * sum(kernels.planarity_nll(x[f], planes) for f in range(n_frames))).backward()

        build = None  # the frames go to splat_ensemble as they are: nothing is built
    else:
        prebuilt = atoms.replace(xyz=x, b_iso=b, occ=occ, u_aniso=u)

        def density():
            rho = kernels.splat_density(prebuilt, grid)
            (((rho - target) ** 2).sum() * volume).backward()

        def planarity():
            (lam * kernels.planarity_nll(x, planes)).backward()

        if case["build"] == "constructor":

            def build():
                AtomSet(x, b, occ, atoms.a, atoms.b, u_aniso=u, aniso=atoms.aniso, radiation=atoms.radiation)
        else:

            def build():
                atoms.replace(xyz=x, b_iso=b, occ=occ, u_aniso=u)

    trainable = [t for t in leaves if t is not None and t.requires_grad]
    opt = _optimizer("adam", leaves, case["params"], case["lr"]) if case["optimizer"] == "adam" else None
    saved = [t.detach().clone() for t in trainable]
    unit_grads = [torch.ones_like(t) * 1e-3 for t in trainable]

    def update():
        opt.step()

    def clear():
        for t in trainable:
            t.grad = None

    def give_grads():
        for t, g in zip(trainable, unit_grads):
            t.grad = g

    timed = [("step", step, None), ("density", density, clear), ("planarity", planarity, clear)]
    if opt is not None:
        timed.append(("optimizer", update, give_grads))
        if not n_frames:
            timed.append(("floor_step", _floor_step(p, case, leaves), None))
    ms: dict[str, list[float]] = {name: [] for name, _, _ in timed}
    for r in range(3 + reps):  # 3 warm-up rounds
        for name, fn, before in timed:
            if before is not None:
                before()
            t = timer(fn)
            if r >= 3:
                ms[name].append(t)
    with torch.no_grad():
        for t, s in zip(trainable, saved):
            t.copy_(s)
    clear()
    out = {name: statistics.median(v) for name, v in ms.items()}
    out.setdefault("optimizer", 0.0)
    out["build"] = None if build is None else _build_us(build) * 1e-3  # ms, as the others
    out["sum"] = out["density"] + out["planarity"] + out["optimizer"]
    return out


class _FloorOp(torch.autograd.Function):
    """The least a GPU op of a step can cost: one allocation and one launch (a memset) each way."""

    @staticmethod
    def forward(ctx, x, shape):
        ctx.like = x
        return torch.zeros(shape, dtype=x.dtype, device=x.device)

    @staticmethod
    def backward(ctx, grad):
        return torch.zeros_like(ctx.like), None


def _floor_step(p: dict, case: dict, leaves):
    """The case's eager Adam step with the splat and the planarity NLL each replaced by :class:`_FloorOp`.

    The same user code around them (building the atoms, the map loss, λ, the sum, ``backward``, ``zero_grad``
    and Adam's update, on copies of the leaves): what torch alone costs for a step of this shape. Its time
    against the real step's is the host time the kernels' calls add.
    """
    atoms, grid, target = p["atoms"], p["grid"], p["target"]
    volume, lam = grid.voxel_volume, case["lambda"]
    copies = [None if t is None else t.detach().clone().requires_grad_(t.requires_grad) for t in leaves]
    x, b, occ, u = copies
    opt = _optimizer("adam", copies, case["params"], case["lr"], case.get("update", "foreach"))
    shape = tuple(target.shape)

    def step():
        opt.zero_grad(set_to_none=True)
        moved = atoms.replace(xyz=x, b_iso=b, occ=occ, u_aniso=u)
        rho = _FloorOp.apply(moved.xyz, shape)
        loss = ((rho - target) ** 2).sum() * volume + lam * _FloorOp.apply(x, ())
        loss.backward()
        opt.step()

    return step


# --------------------------------------------------------------------------- one case


def _run_case(p: dict, case: dict, device: torch.device, args) -> dict:
    n_frames = case.get("frames")
    if n_frames:
        fn = _ensemble_loss_fn(p, case["lambda"], n_frames)
    else:
        fn = _loss_fn(p, case["build"], case["lambda"])
    mode = case["mode"]
    if mode == "compiled":
        torch._dynamo.reset()
        fn = torch.compile(fn, fullgraph=True)
    elif mode == "reduce-overhead":
        torch._dynamo.reset()
        fn = torch.compile(fn, fullgraph=True, mode="reduce-overhead")
    leaves = _leaves(p, case["params"], n_frames)
    if mode == "reduce-overhead":  # the optimiser updates them in place: the graphs need not copy them in
        for t in leaves:
            if t is not None and t.requires_grad:
                torch._dynamo.mark_static_address(t)
    opt = _optimizer(case["optimizer"], leaves, case["params"], case["lr"], case.get("update", "foreach"))
    truth = p["atoms"].xyz
    host_ms: list[float] = []  # the Python call of each timed step, without the synchronisation after it

    def timer(fn) -> float:  # ms: CUDA events around fn() and a synchronisation after it, or wall clock
        def host_timed():
            t0 = time.perf_counter()
            fn()
            host_ms.append((time.perf_counter() - t0) * 1e3)

        return E.eager_call_ms(host_timed, device)

    evals = [0]

    def closure():
        evals[0] += 1
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        opt.zero_grad(set_to_none=True)
        loss = fn(*leaves)
        loss.backward()
        return loss

    losses, rmsd, step_ms, evals_per_step = [], [_rmsd(leaves[0], truth)], [], []

    def adam_step():
        losses.append(closure().detach().clone())  # a CUDA graph replay reuses its output
        opt.step()

    if mode == "step":  # the whole step replayed as one CUDA graph (kernels.fitting.Step)
        step = Step(lambda: fn(*leaves), [t for t in leaves if t is not None and t.requires_grad], opt)
        eager_step = adam_step  # the same loss, optimiser (now capturable) and leaves, run eagerly

        def adam_step():
            evals[0] += 1
            losses.append(step().loss.clone())  # the graph's output: the next replay overwrites it

    first_ms = None
    host_ms.clear()
    t_case = time.perf_counter()
    for i in range(case["steps"]):
        before = evals[0]
        if case["optimizer"] == "lbfgs":
            ms = timer(lambda: losses.append(opt.step(closure).detach().clone()))
        else:
            ms = timer(adam_step)
        evals_per_step.append(evals[0] - before)
        rmsd.append(_rmsd(leaves[0], truth))
        if i == 0:
            first_ms = ms
        elif i >= args.warmup:
            step_ms.append(ms)
        if time.perf_counter() - t_case > args.case_seconds and i >= args.warmup + 3:
            break
    rmsd = [float(r) for r in rmsd]
    steps_run = len(losses)
    loss_values = [float(v) for v in losses]  # the interleaved steps below append to losses
    out = dict(case)
    out.update(
        n_atoms=len(p["atoms"]),
        grid=list(p["grid"].shape),
        steps_run=steps_run,
        first_step_ms=first_ms,
        step_ms=_stats(step_ms),
        host_ms=_stats(host_ms[args.warmup :] if len(host_ms) > args.warmup else []),
        evals_per_step=evals_per_step,
        rmsd=rmsd,
        loss=loss_values,
        first_step_below_goal=next((i for i, r in enumerate(rmsd) if r < RMSD_GOAL), None),
    )
    if case["optimizer"] == "lbfgs" and step_ms:
        total_evals = sum(evals_per_step[args.warmup :]) if len(evals_per_step) > args.warmup else 0
        out["eval_ms"] = sum(step_ms) / total_evals if total_evals else None
    if mode == "eager" and case["optimizer"] == "adam":
        parts = _parts(p, case, _leaves(p, case["params"], n_frames), timer, args.reps, adam_step)
        out["parts_ms"] = parts
        out["step_over_parts"] = parts["step"] / parts["sum"] if parts["sum"] else None
        out["target_step_over_parts"] = STEP_OVER_PARTS
    if mode == "step":
        # The target: a replayed step within 1.3x the device time of the kernels one step launches, which the
        # profiler sums over eager steps of the same loss and optimiser (a replay runs those kernels, no others).
        kernels_ms = E.kernel_profile(eager_step, device, calls=20)
        out["step_mode"] = step.mode
        out["kernels_device_ms"] = None if kernels_ms is None else kernels_ms["device_ms_per_call"]
        out["step_over_kernels"] = (
            out["step_ms"]["median"] / out["kernels_device_ms"] if out["kernels_device_ms"] and step_ms else None
        )
        out["target_step_over_kernels"] = STEP_OVER_KERNELS
    if args.profile and case["optimizer"] == "adam":
        out["profile"] = _step_profile(adam_step, device)
    if mode != "eager" and args.check_grads:
        out["grad_check"] = _grad_check(p, case, fn, mode == "reduce-overhead")
    return out


def _step_profile(step, device: torch.device, steps: int = 20, top: int = 15) -> dict:
    """Where a step's time goes: the GPU's work per step against the host's (``--profile``).

    ``device``: on CUDA, :func:`benchmarks._eager.kernel_profile` of ``steps`` steps (kernels per step, their
    summed device time, the largest kernels and host-side ops). On every device, a cProfile of ``steps`` more
    steps: the ``top`` Python functions by their own time per step, and the step's wall time under the profiler.
    """
    out = {"device": E.kernel_profile(step, device, calls=steps, top=6, host_top=top)}
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    pr.disable()
    st = pstats.Stats(pr, stream=io.StringIO())
    rows = sorted(st.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]  # (cc, nc, tottime, cumtime, callers)
    out["python_top"] = [
        {"function": f"{Path(f).name}:{line}({name})", "calls_per_step": nc / steps,
         "self_ms_per_step": tt * 1e3 / steps, "cumulative_ms_per_step": ct * 1e3 / steps}
        for (f, line, name), (cc, nc, tt, ct, _) in rows
    ]  # fmt: skip
    out["python_total_ms_per_step"] = st.total_tt * 1e3 / steps
    return out


GRAD_RTOL = 1e-5  # compiled against eager, relative to the largest eager value (as tests/kernels/test_loop.py)


def _grad_check(p: dict, case: dict, compiled, cuda_graphs: bool, calls: int = 3) -> dict:
    """The compiled loss and gradients against eager's, from the start positions.

    The compiled function is called ``calls`` times after the case's steps (with reduce-overhead every
    call after the first two is a CUDA graph replay), each from the same start; the last call's
    values are compared. ``ok``: the loss within ``GRAD_RTOL`` relative, and each gradient within
    ``GRAD_RTOL`` × its largest eager element.
    """
    n_frames = case.get("frames")
    eager = _ensemble_loss_fn(p, case["lambda"], n_frames) if n_frames else _loss_fn(p, case["build"], case["lambda"])
    leaves = _leaves(p, case["params"], n_frames)
    trainable = [t for t in leaves if t is not None and t.requires_grad]

    def value_and_grads(fn, mark: bool):
        if mark:
            torch.compiler.cudagraph_mark_step_begin()
        for t in trainable:
            t.grad = None
        loss = fn(*leaves)
        loss.backward()
        return float(loss.detach()), [t.grad.detach().clone() for t in trainable]

    want_loss, want = value_and_grads(eager, False)
    for _ in range(calls):
        got_loss, got = value_and_grads(compiled, cuda_graphs)
    loss_err = abs(got_loss - want_loss) / max(abs(want_loss), 1e-30)
    grad_err = [float((g - w).abs().max()) / max(float(w.abs().max()), 1e-30) for g, w in zip(got, want)]
    ok = loss_err <= GRAD_RTOL and all(e <= GRAD_RTOL for e in grad_err)
    return {"calls": calls, "loss_rel_err": loss_err, "grad_rel_err": grad_err, "rtol": GRAD_RTOL, "ok": ok}


def _cases(args, device: torch.device) -> list[dict]:
    params = tuple(args.params)
    modes = [m for m in args.modes if m not in ("reduce-overhead", "step") or device.type == "cuda"]
    cases = []
    for name in args.structures:
        for adp in args.adp:
            for mode in modes:
                for build, update in [(b, u) for b in args.builds for u in args.updates]:
                    cases.append(
                        dict(
                            structure=name,
                            adp=adp,
                            mode=mode,
                            build=build,
                            update=update,
                            optimizer="adam",
                            steps=args.steps,
                            lr=args.lr,
                            params=params,
                            **{"lambda": args.lam},
                        )
                    )
            if "lbfgs" in args.optimizers:
                cases.append(
                    dict(
                        structure=name,
                        adp=adp,
                        mode="eager",
                        build="replace",
                        optimizer="lbfgs",
                        steps=args.lbfgs_steps,
                        lr=1.0,
                        params=params,
                        **{"lambda": args.lam},
                    )
                )
    if args.ensemble:
        for mode in [m for m in modes if m in ("eager", "step")]:
            cases.append(
                dict(
                    structure=args.ensemble_structure,
                    adp="iso",
                    mode=mode,
                    build="none",
                    update=args.updates[0],
                    optimizer="adam",
                    steps=args.steps,
                    lr=args.lr,
                    params=("xyz",),
                    frames=args.ensemble,
                    **{"lambda": args.lam},
                )
            )
    if "adam" not in args.optimizers:
        cases = [c for c in cases if c["optimizer"] != "adam"]
    return cases


def _write(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads (torch and the C++ kernels)")
    ap.add_argument("--structures", nargs="+", default=list(STRUCTURES))
    ap.add_argument("--adp", nargs="+", choices=("iso", "aniso"), default=["iso", "aniso"])
    ap.add_argument(
        "--modes",
        nargs="+",
        choices=("eager", "compiled", "reduce-overhead", "step"),
        default=["eager", "compiled", "reduce-overhead", "step"],
    )
    ap.add_argument("--builds", nargs="+", choices=BUILDS, default=list(BUILDS))
    ap.add_argument("--optimizers", nargs="+", choices=("adam", "lbfgs"), default=["adam", "lbfgs"])
    ap.add_argument(
        "--updates",
        nargs="+",
        choices=("fused", "foreach"),
        default=["fused", "foreach"],
        help="Adam's update: fused=True (one kernel) or torch's default multi-tensor one",
    )
    ap.add_argument("--params", nargs="+", choices=("xyz", "b", "occ", "u"), default=["xyz"])
    ap.add_argument("--steps", type=int, default=60, help="Adam steps per case")
    ap.add_argument("--lbfgs-steps", type=int, default=8, help="L-BFGS steps (up to 20 evaluations each)")
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the step statistics")
    ap.add_argument("--reps", type=int, default=20, help="timed calls of each part")
    ap.add_argument("--case-seconds", type=float, default=120.0, help="stop a case's steps after this long")
    ap.add_argument("--lr", type=float, default=0.02, help="Adam's step for xyz (Å)")
    ap.add_argument("--lam", type=float, default=0.1, help="λ, the planarity NLL's weight")
    ap.add_argument("--shift", type=float, default=0.5, help="RMS distortion of the start (Å)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--spacing", type=float, default=SPACING, help="grid spacing (Å) when no --map")
    ap.add_argument("--map", type=Path, default=None, help="target map file (CCP4/MRC) instead of the model's map")
    ap.add_argument("--ensemble", type=int, default=16, help="frames of the ensemble case (0: none)")
    ap.add_argument("--ensemble-structure", default="1aki")
    ap.add_argument("--smoke", action="store_true", help="1orc, 2 Å grid, few steps: a check that runs in seconds")
    ap.add_argument(
        "--check-grads",
        action="store_true",
        help="compare each compiled case's loss and gradients (the last of 3 calls: a CUDA graph replay with "
        "reduce-overhead) with eager's; a mismatch is printed as FAILED and the run exits with status 1",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="Adam cases: also profile 20 steps (GPU kernels and host ops per step; Python functions)",
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.smoke:
        args.structures, args.spacing, args.steps, args.lbfgs_steps = ["1orc"], 2.0, 5, 1
        args.reps, args.warmup, args.adp = 3, 1, ["iso"]
        args.ensemble, args.ensemble_structure = 2, "1orc"
        if "--modes" not in (argv if argv is not None else sys.argv):
            args.modes = ["eager"]
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")  # float64 → float32 casts, approximate cells: said once per run elsewhere

    date = datetime.date.today().isoformat()
    out_path = (
        args.out or ROOT / "benchmarks" / "results" / f"loop_{device.type}_{date}{'_smoke' if args.smoke else ''}.json"
    )
    record = {
        "benchmark": "bench_loop",
        "date": date,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "torch": torch.__version__,
        "command": " ".join(sys.argv),
        "load_average_start": os.getloadavg(),
        "targets": {"step_over_parts": STEP_OVER_PARTS, "rmsd_goal_A": RMSD_GOAL},
        "cases": [],
    }
    problems: dict = {}
    failed: list[str] = []
    for case in _cases(args, device):
        key = (case["structure"], case["adp"])
        label = " ".join(str(case[k]) for k in ("structure", "adp", "mode", "build", "optimizer"))
        if case["optimizer"] == "adam":
            label += f" ({case['update']})"
        if case.get("frames"):
            label += f" {case['frames']} frames"
        try:
            if key not in problems:
                problems[key] = _problem(case["structure"], case["adp"], device, args)
            result = _run_case(problems[key], case, device, args)
        except Exception as exc:  # noqa: BLE001 - a case that fails is recorded with its error, the others still run
            result = dict(case, error=f"{type(exc).__name__}: {exc}")
            print(f"{label}: FAILED {result['error']}", flush=True)
            failed.append(f"{label}: {result['error'].splitlines()[0]}")
            record["cases"].append(result)
            _write(out_path, record)
            continue
        record["cases"].append(result)
        _write(out_path, record)  # after every case: a run stopped at its time limit keeps what it measured
        s = result["step_ms"]
        line = f"{label}: {result['n_atoms']} atoms, step {s['median'] or float('nan'):.3f} ms (first {result['first_step_ms']:.1f})"
        if result["host_ms"]["median"] is not None:
            line += f", host {result['host_ms']['median']:.3f} ms"
        if "parts_ms" in result:
            pm = result["parts_ms"]
            line += (
                f"; interleaved: step {pm['step']:.3f}, parts {pm['sum']:.3f} = density {pm['density']:.3f} + planarity {pm['planarity']:.3f}"
                f" + update {pm['optimizer']:.3f}"
                + ("" if pm["build"] is None else f" (build {pm['build'] * 1e3:.1f} µs)")
                + f", ratio {result['step_over_parts']:.2f}"
                + ("" if "floor_step" not in pm else f"; torch's floor step {pm['floor_step']:.3f}")
            )
        if result.get("step_over_kernels") is not None:
            line += (
                f"; {result['step_mode']}: kernels {result['kernels_device_ms']:.3f} ms of device time a step,"
                f" step/kernels {result['step_over_kernels']:.2f} (target ≤ {STEP_OVER_KERNELS})"
            )
        if "grad_check" in result:
            gc = result["grad_check"]
            verdict = "ok" if gc["ok"] else "FAILED"
            if not gc["ok"]:
                failed.append(f"{label}: compiled gradients differ from eager's ({gc})")
            line += f", gradients vs eager {verdict} (max rel. err {max(gc['grad_rel_err'], default=0.0):.1e})"
        if "profile" in result:
            dev = result["profile"]["device"]
            if dev:
                line += (f"; profiled: {dev['device_events_per_call']:.0f} GPU events, {dev['device_ms_per_call']:.3f} ms"
                         f" on the GPU of {dev['wall_ms_per_call']:.3f} ms per step")  # fmt: skip
            line += f"; Python {result['profile']['python_total_ms_per_step']:.3f} ms per step under cProfile"
        line += f", RMSD {result['rmsd'][0]:.3f} → {result['rmsd'][-1]:.3f} Å in {result['steps_run']} steps"
        if result["first_step_below_goal"] is not None:
            line += f" (< {RMSD_GOAL} Å at step {result['first_step_below_goal']})"
        print(line, flush=True)
    record["load_average_end"] = os.getloadavg()
    record["failed"] = failed
    _write(out_path, record)
    print(f"wrote {out_path}")
    for line in failed:
        print(f"FAILED {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
