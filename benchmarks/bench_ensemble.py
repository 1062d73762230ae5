"""Ensemble splat benchmark: ``kernels.splat_ensemble`` against one frame's eager call, frames per
second, and (under ``torchrun``) the split of the frames over several GPUs or CPU processes.

Frames are a structure's positions plus independent Gaussian displacements (σ = ``--sigma`` Å,
0.1 by default; seeded, so every rank of a distributed run builds the same frames). Forward is
under ``no_grad``; forward+backward is ``(splat_ensemble(atoms, X, grid) * W).sum().backward()``
with the frames ``X`` (F, N, 3) requiring grad, ``reduce="sum"``.

Single process (``python benchmarks/bench_ensemble.py``), issue 20 part 2:

- 64 frames of 1aki, 0.667 Å: forward+backward of the ensemble against one frame's eager
  ``splat_density`` forward+backward with the same inputs requiring grad (positions; the issue's
  xyz+B+occ call beside it), target ≤ 10×; the ensemble map and three frames' gradients checked
  against single-frame splats;
- 1,024 frames of 3wip: forward and forward+backward, frames per second. All frames go in one
  call; only if that call runs out of memory are they split into chunks (the JSON says so and
  how).

Timing: CUDA events around each call, synchronised after each, median/p10/p90 after warm-up
(``benchmarks/_eager.py``); CPU (``--device cpu``, the small CPU mode: 1aki 8 frames and 3wip 4
frames, at the threads ``OMP_NUM_THREADS`` sets) by wall clock.

Distributed (``torchrun --nproc_per_node 2 benchmarks/bench_ensemble.py --distributed``), issue
23: NCCL on one GPU per rank (gloo on CPU processes with ``--device cpu``). Every rank builds the
same 1,024 frames of 3wip (CPU: 1aki, 11 frames, so the split is uneven), and

- rank 0 alone times the single-device call (the other ranks wait);
- all ranks time the call with ``process_group=torch.distributed.group.WORLD``: per call, a
  barrier, then wall clock to the end of the call synchronised on each rank, the slowest rank's
  time counting; target 2 ranks ≥ 1.8× one for forward and forward+backward;
- the distributed map and the single-device map are both float32 sums of F frames, in other
  groupings (two half sums added by the all-reduce, or one pass over all frames). Both are
  compared with the same sum accumulated in float64 (each frame's own float32 map from
  ``reduce="none"``, in chunks, added in float64): the distributed map must be no further from
  it than the single-device map is (a float32 sum of 1,024 similar frames drifts systematically,
  by ~1e-5 relative, so the two float32 sums differ from each other by about that much; their
  relative L2 and the single device's frames-reversed and call-to-call spreads are reported
  beside it); and the ranks' position gradients summed over the ranks equal the single-device
  gradient (relative L2 ≤ 1e-6).

Writes JSON (rank 0) and prints a table. ``--smoke``: one rep of everything on tiny inputs, then
a check of the JSON's layout (nonzero exit on a problem).

Usage::

    python benchmarks/bench_ensemble.py [--out X.json]
    torchrun --nproc_per_node 2 benchmarks/bench_ensemble.py --distributed [--out X.json]
    python benchmarks/bench_ensemble.py --device cpu --smoke
    OMP_NUM_THREADS=2 python benchmarks/bench_ensemble.py --stream-cpu 10000   # issue 37's CPU figure
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import kernels  # noqa: E402
from benchmarks import _eager as E  # noqa: E402
from benchmarks._structures import model  # noqa: E402
from kernels.crystal import AtomSet, GridSpec  # noqa: E402

SPACING = 2.0 / 3.0
TARGET_VS_ONE_FRAME = 10.0
TARGET_SCALING = 1.8
TOLERANCE = 1e-6
# Frames per reduce="none" call when the float64-accumulated sum is formed (bounds its memory).
TRUTH_CHUNK = 64
_OUT_OF_MEMORY = (getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError), MemoryError)
TIME_LIMITS = {"ratio": 120.0, "throughput": 180.0, "distributed": 300.0}


def frames_of(atoms: AtomSet, n_frames: int, sigma: float, seed: int = 0) -> torch.Tensor:
    """``n_frames`` copies of ``atoms.xyz`` with independent N(0, sigma²) displacements.

    Returns
    -------
    torch.Tensor, shape (n_frames, N, 3), float32, on the CPU
    """
    gen = torch.Generator().manual_seed(seed)
    xyz = atoms.xyz.to(torch.float64)
    noise = torch.randn((n_frames, *xyz.shape), generator=gen, dtype=torch.float64) * sigma
    return (xyz[None] + noise).to(torch.float32)


def _setup(name: str, n_frames: int, spacing: float, device: torch.device, sigma: float, n_atoms: int | None):
    m = model(name)
    a = m.atoms
    if n_atoms is not None:
        a = AtomSet(a.xyz[:n_atoms], a.b_iso[:n_atoms], a.occ[:n_atoms], a.a[:n_atoms], a.b[:n_atoms])
    grid = GridSpec.for_spacing(m.cell, spacing)
    atoms = a.to(device, torch.float32)
    frames = frames_of(a, n_frames, sigma).to(device)
    upstream = torch.randn(grid.shape, generator=torch.Generator().manual_seed(1)).to(device)
    return atoms, grid, frames, upstream


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.detach().double(), ref.detach().double()
    return float((x - ref).norm() / ref.norm())


def _ensemble(atoms, frames, grid, **kw):
    return kernels.splat_ensemble(atoms, frames, grid, reduce="sum", **kw)


def ratio_case(device: torch.device, args, deadline: E.Deadline) -> dict:
    """64 frames of 1aki, forward+backward, against one frame's eager forward+backward."""
    n_frames = 2 if args.smoke else (args.frames_1aki if device.type == "cuda" else args.frames_1aki_cpu)
    atoms, grid, frames, w = _setup("1aki", n_frames, args.spacing, device, args.sigma, args.n_atoms)
    res: dict = {"case": f"1aki, {n_frames} frames", "frames": n_frames, "atoms": len(atoms), "grid": list(grid.shape)}
    print(f"\n== ensemble 1aki: {n_frames} frames, grid {grid.shape}", flush=True)
    x = frames.clone().requires_grad_()
    one = frames[0].clone().requires_grad_()
    b1, o1 = atoms.b_iso.clone().requires_grad_(), atoms.occ.clone().requires_grad_()
    atoms_one = AtomSet(one, atoms.b_iso, atoms.occ, atoms.a, atoms.b, _validate=False)
    atoms_one_all = AtomSet(one, b1, o1, atoms.a, atoms.b, _validate=False)

    def ens_fwd():
        with torch.no_grad():
            return _ensemble(atoms, x, grid)

    def ens_fwd_bwd():
        x.grad = None
        (_ensemble(atoms, x, grid) * w).sum().backward()

    def one_fwd_bwd(at=atoms_one, leaves=(one,)):
        for t in leaves:
            t.grad = None
        (kernels.splat_density(at, grid) * w).sum().backward()

    # correctness: the summed map, and three frames' gradients, against single-frame splats
    with torch.no_grad():
        total = sum(kernels.splat_density(AtomSet(f, *_rest(atoms), _validate=False), grid) for f in frames)
    res["map_rel_l2_vs_sum_of_frames"] = _rel(ens_fwd(), total)
    ens_fwd_bwd()
    grads = []
    for f in sorted({0, n_frames // 2, n_frames - 1}):
        xf = frames[f].clone().requires_grad_()
        (kernels.splat_density(AtomSet(xf, *_rest(atoms), _validate=False), grid) * w).sum().backward()
        grads.append(_rel(x.grad[f], xf.grad))
    res["grad_rel_l2_vs_single_frame_max"] = max(grads)
    deadline.check()
    res["ensemble_fwd"] = E.measure(ens_fwd, device, args.reps, graph=False)
    res["ensemble_fwd_bwd"] = E.measure(ens_fwd_bwd, device, args.reps, graph=False)
    deadline.check()
    res["one_frame_fwd_bwd_xyz"] = E.measure(one_fwd_bwd, device, args.reps, graph=False)
    res["one_frame_fwd_bwd_xyz_b_occ"] = E.measure(
        lambda: one_fwd_bwd(atoms_one_all, (one, b1, o1)), device, args.reps, graph=False
    )
    ratio = _ratio(_eager_ms(res["ensemble_fwd_bwd"]), _eager_ms(res["one_frame_fwd_bwd_xyz"]))
    ratio_all = _ratio(_eager_ms(res["ensemble_fwd_bwd"]), _eager_ms(res["one_frame_fwd_bwd_xyz_b_occ"]))
    res["targets"] = {
        "fwd_bwd_over_one_frame": {
            "value": ratio,
            "target": f"<= {TARGET_VS_ONE_FRAME}",
            "pass": None if ratio is None else ratio <= TARGET_VS_ONE_FRAME,
            "one_frame": "positions requiring grad, as the ensemble's frames",
        },
        "fwd_bwd_over_one_frame_xyz_b_occ": {"value": ratio_all, "one_frame": "xyz, B and occupancy requiring grad"},
        "map_matches_sum_of_frames": {
            "value": res["map_rel_l2_vs_sum_of_frames"],
            "target": "<= 1e-5",
            "pass": res["map_rel_l2_vs_sum_of_frames"] <= 1e-5,
        },
        "grads_match_single_frames": {
            "value": res["grad_rel_l2_vs_single_frame_max"],
            "target": "<= 1e-5",
            "pass": res["grad_rel_l2_vs_single_frame_max"] <= 1e-5,
        },
    }
    return res


def _rest(atoms: AtomSet):
    return atoms.b_iso, atoms.occ, atoms.a, atoms.b


def _eager_ms(stats: dict) -> float | None:
    return stats.get("eager", {}).get("median_ms")


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def _chunked(atoms, frames, grid, chunk: int | None, **kw):
    if chunk is None or chunk >= len(frames):
        return _ensemble(atoms, frames, grid, **kw)
    out = _ensemble(atoms, frames[:chunk], grid, **kw)
    for s in range(chunk, len(frames), chunk):
        out = out + _ensemble(atoms, frames[s : s + chunk], grid, **kw)
    return out


def throughput_case(device: torch.device, args, deadline: E.Deadline) -> dict:
    """Frames per second for 3wip (1,024 frames on a GPU), forward and forward+backward."""
    n_frames = 2 if args.smoke else (args.frames_3wip if device.type == "cuda" else args.frames_3wip_cpu)
    name = "1aki" if args.smoke else "3wip"
    atoms, grid, frames, w = _setup(name, n_frames, args.spacing, device, args.sigma, args.n_atoms)
    res: dict = {
        "case": f"{name}, {n_frames} frames",
        "frames": n_frames,
        "atoms": len(atoms),
        "grid": list(grid.shape),
    }
    print(f"\n== ensemble {name}: {n_frames} frames, grid {grid.shape}", flush=True)
    x = frames.clone().requires_grad_()
    chunk = None
    reps = max(1, args.reps // 5)
    for _ in range(6):
        try:

            def fwd(chunk=chunk):
                with torch.no_grad():
                    return _chunked(atoms, x, grid, chunk)

            def fwd_bwd(chunk=chunk):
                x.grad = None
                (_chunked(atoms, x, grid, chunk) * w).sum().backward()

            fwd_bwd()
            res["fwd"] = E.eager_stats(fwd, device, reps)
            res["fwd_bwd"] = E.eager_stats(fwd_bwd, device, reps)
            break
        except _OUT_OF_MEMORY as exc:
            x.grad = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
            chunk = (chunk or n_frames) // 2
            res.setdefault("out_of_memory", []).append(str(exc)[:300])
            if chunk < 1:
                raise
        deadline.check()
    res["chunk_frames"] = chunk
    res["chunked"] = (
        "no: all frames in one call"
        if chunk is None
        else f"yes: {chunk} frames per call (all at once ran out of memory)"
    )
    for what in ("fwd", "fwd_bwd"):
        if "median_ms" in res.get(what, {}):
            res[f"{what}_frames_per_s"] = n_frames / (res[what]["median_ms"] / 1e3)
    return res


# ----------------------------------------------------------------------------------------------
# torchrun
# ----------------------------------------------------------------------------------------------


def _wall_stats(fn, device: torch.device, reps: int, dist=None) -> dict:
    """Per call: (barrier), wall clock to the end of the call synchronised; the slowest rank's."""
    E.warm_up(fn, device, calls=2, seconds=0.0)
    times = []
    for _ in range(reps):
        if dist is not None:
            dist.barrier()
        E._sync(device)
        t0 = time.perf_counter()
        fn()
        E._sync(device)
        t = torch.tensor([(time.perf_counter() - t0) * 1e3], dtype=torch.float64, device=device)
        if dist is not None:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(float(t))
    t = sorted(times)
    return {"median_ms": statistics.median(t), "p10_ms": t[(len(t) - 1) // 10], "p90_ms": t[(9 * len(t)) // 10],
            "reps": len(t), "method": "barrier, wall clock to the synchronised end of the call, slowest rank"}  # fmt: skip


def distributed_case(args) -> dict:
    import datetime as dt

    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    cuda = args.device != "cpu" and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local)
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", timeout=dt.timedelta(seconds=180),
                            device_id=device if cuda else None)  # fmt: skip
    group = dist.group.WORLD
    try:
        small = args.smoke or not cuda
        name = "1aki" if small else "3wip"
        n_frames = (3 if args.smoke else 11) if small else args.frames_3wip
        spacing = 2.0 if args.smoke else args.spacing
        atoms, grid, frames, w = _setup(name, n_frames, spacing, device, args.sigma, args.n_atoms)
        res: dict = {"case": f"{name}, {n_frames} frames over {world} ranks", "ranks": world, "frames": n_frames,
                     "backend": dist.get_backend(), "atoms": len(atoms), "grid": list(grid.shape)}  # fmt: skip
        if rank == 0:
            print(f"\n== distributed: {res['case']} ({res['backend']}), grid {grid.shape}", flush=True)
        reps = 1 if args.smoke else max(3, args.reps // 5)
        x1 = frames.clone().requires_grad_()
        xd = frames.clone().requires_grad_()

        def one_fwd():
            with torch.no_grad():
                return _ensemble(atoms, x1, grid)

        def one_fwd_bwd():
            x1.grad = None
            (_ensemble(atoms, x1, grid) * w).sum().backward()

        def d_fwd():
            with torch.no_grad():
                return _ensemble(atoms, xd, grid, process_group=group)

        def d_fwd_bwd():
            xd.grad = None
            (_ensemble(atoms, xd, grid, process_group=group) * w).sum().backward()

        # correctness first (before any timing): map and summed gradients against one device
        ref_map = one_fwd()
        res["map_rel_l2_one_device_call_to_call"] = _rel(one_fwd(), ref_map)
        with torch.no_grad():
            reversed_map = _ensemble(atoms, frames.flip(0).contiguous(), grid)
        res["map_rel_l2_one_device_frames_reversed"] = _rel(reversed_map, ref_map)
        del reversed_map
        truth = torch.zeros(grid.shape, dtype=torch.float64, device=device)
        with torch.no_grad():
            for c in range(0, n_frames, TRUTH_CHUNK):
                part = kernels.splat_ensemble(atoms, frames[c : c + TRUTH_CHUNK], grid, reduce="none")
                truth += part.sum(0, dtype=torch.float64)
                del part
        res["one_device_rel_l2_vs_float64_sum"] = _rel(ref_map, truth)
        one_fwd_bwd()
        ref_grad = x1.grad.clone()
        d_map = d_fwd()
        d_fwd_bwd()
        g = xd.grad.clone()
        dist.all_reduce(g)
        res["map_rel_l2_vs_one_device"] = _rel(d_map, ref_map)
        res["distributed_rel_l2_vs_float64_sum"] = _rel(d_map, truth)
        del truth
        bound = 1e-5 * ref_map.abs().max() + 1e-5 * ref_map.abs()
        res["map_vs_one_device_contract"] = float(((d_map - ref_map).abs() / bound.clamp_min(1e-30)).max())
        res["grad_sum_over_ranks_rel_l2_vs_one_device"] = _rel(g, ref_grad)
        own = xd.grad.abs().flatten(1).sum(1) > 0
        res["rank0_frames_with_gradient"] = int(own.sum())
        one: dict = {}
        if rank == 0:
            one["fwd"] = _wall_stats(one_fwd, device, reps)
            one["fwd_bwd"] = _wall_stats(one_fwd_bwd, device, reps)
        dist.barrier()
        many = {"fwd": _wall_stats(d_fwd, device, reps, dist), "fwd_bwd": _wall_stats(d_fwd_bwd, device, reps, dist)}
        res["one_device"], res[f"{world}_ranks"] = one, many
        if rank == 0:
            targets = {}
            for what in ("fwd", "fwd_bwd"):
                s = _ratio(one[what]["median_ms"], many[what]["median_ms"])
                targets[f"{what}_speedup_{world}_ranks"] = {"value": s, "target": f">= {TARGET_SCALING}",
                                                            "pass": None if s is None else s >= TARGET_SCALING}  # fmt: skip
                res[f"{what}_frames_per_s_one_device"] = n_frames / (one[what]["median_ms"] / 1e3)
                res[f"{what}_frames_per_s_{world}_ranks"] = n_frames / (many[what]["median_ms"] / 1e3)
            one_err = res["one_device_rel_l2_vs_float64_sum"]
            key = "distributed_rel_l2_vs_float64_sum"
            targets[key] = {"value": res[key], "target": f"<= {one_err:.3g} (one device vs the float64 sum)",
                            "pass": res[key] <= max(one_err, 1e-12)}  # fmt: skip
            key = "grad_sum_over_ranks_rel_l2_vs_one_device"
            targets[key] = {"value": res[key], "target": f"<= {TOLERANCE}", "pass": res[key] <= TOLERANCE}
            res["targets"] = targets
        return res if rank == 0 else {}
    finally:
        try:  # leave together: a rank that exits while another still talks to it aborts (gloo)
            dist.barrier()
        finally:
            dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------


def print_table(result: dict) -> None:
    print(f"\n{result['env'].get('device')} ({result['device_used']}); ms, median (p10-p90)")
    for part, rec in result["parts"].items():
        for c in rec.get("cases", []):
            print(f"\n{part}: {c.get('case')}")
            if "error" in c:
                print(f"  error: {c['error'][:200]}")
            for key, val in c.items():
                if isinstance(val, dict) and "eager" in val:
                    val = val["eager"]
                if isinstance(val, dict) and "median_ms" in val:
                    print(f"  {key:32s} {val['median_ms']:9.3f} ({val['p10_ms']:.3f}-{val['p90_ms']:.3f})")
                elif isinstance(val, dict) and (key == "one_device" or key.endswith("_ranks")):
                    for k2, v2 in val.items():
                        print(f"  {key + ' ' + k2:32s} {v2['median_ms']:9.3f} ({v2['p10_ms']:.3f}-{v2['p90_ms']:.3f})")
                elif key.endswith("frames_per_s") or "_frames_per_s_" in key:
                    print(f"  {key:32s} {val:9.1f} frames/s")
                elif key in ("chunked", "map_rel_l2_vs_sum_of_frames", "grad_rel_l2_vs_single_frame_max"):
                    print(f"  {key:32s} {val}")
            for tname, t in c.get("targets", {}).items():
                v = t.get("value")
                vs = f"{v:.3g}" if isinstance(v, float) else str(v)
                verdict = {True: "pass", False: "FAIL", None: "n/a"}[t.get("pass")]
                print(f"  {tname:40s} {vs:>10s} {('target ' + t['target']) if 'target' in t else ''} {verdict}")
        if rec.get("error"):
            print(f"  {part} stopped: {rec['error'][:200]}")


def check_schema(result: dict) -> list[str]:
    """Problems with ``result``'s layout (empty when complete): each part has cases without errors,
    timings with medians, and targets with values."""
    problems = []
    for part, rec in result.get("parts", {}).items():
        if rec.get("error"):
            problems.append(f"{part}: {rec['error']}")
        if not rec.get("cases"):
            problems.append(f"{part}: no cases")
        for c in rec.get("cases", []):
            if "error" in c:
                problems.append(f"{part}/{c.get('case')}: {c['error']}")
                continue
            need = {
                "ratio": ("ensemble_fwd", "ensemble_fwd_bwd", "one_frame_fwd_bwd_xyz", "targets"),
                "throughput": ("fwd", "fwd_bwd", "fwd_frames_per_s", "fwd_bwd_frames_per_s", "chunked"),
                "distributed": ("one_device", "targets", "map_rel_l2_vs_one_device"),
            }[part]
            problems += [f"{part}/{c.get('case')}: missing {k}" for k in need if k not in c]
            for t in c.get("targets", {}).values():
                if not isinstance(t.get("value"), float):
                    problems.append(f"{part}/{c.get('case')}: target without a value: {t}")
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", nargs="+", default=["ratio", "throughput"], choices=["ratio", "throughput"])
    ap.add_argument("--distributed", action="store_true", help="under torchrun: the multi-rank comparison only")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--frames-1aki", type=int, default=64)
    ap.add_argument("--frames-1aki-cpu", type=int, default=8)
    ap.add_argument("--frames-3wip", type=int, default=1024)
    ap.add_argument("--frames-3wip-cpu", type=int, default=4)
    ap.add_argument("--sigma", type=float, default=0.1, help="displacement of the frames, Å")
    ap.add_argument("--spacing", type=float, default=SPACING)
    ap.add_argument("--reps", type=int, default=E.REPS)
    ap.add_argument("--n-atoms", type=int, default=None, help="use only the first N atoms (tests)")
    ap.add_argument("--time-scale", type=float, default=1.0, help="multiply every part's time limit")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true", help="one rep on tiny inputs, then check the JSON")
    ap.add_argument(
        "--stream-cpu",
        type=int,
        default=None,
        metavar="F",
        help="only: F frames of 1aki streamed from a DCD on the CPU against the in-memory rate (issue 37; 10000)",
    )
    ap.add_argument("--stream-chunk", type=int, default=1024, help="frames per chunk read with --stream-cpu")
    args = ap.parse_args(argv)
    if args.stream_cpu is not None:
        return stream_cpu_main(args)
    if args.smoke:
        args.reps, args.spacing = 1, 2.0
        args.n_atoms = args.n_atoms or 40
        E.WARMUP_CALLS, E.WARMUP_S = 1, 0.0
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rank = int(os.environ.get("RANK", "0"))
    date = datetime.date.today().isoformat()
    result = {
        "benchmark": "kernels.splat_ensemble, reduce='sum'",
        "date": date,
        "env": E.environment(),
        "device_used": str(device),
        "torch_threads": torch.get_num_threads(),
        "smoke": args.smoke,
        "spacing": args.spacing,
        "frames": f"positions + N(0, {args.sigma}² Å²) per atom and frame, seeded",
        "fwd_bwd": "(splat_ensemble(atoms, X, grid) * W).sum().backward(), X (F, N, 3) requiring grad",
        "parts": {},
    }
    if args.out is None:
        tag = "smoke" if args.smoke else (f"cuda_{E.gpu_tag()}" if device.type == "cuda" else "cpu")
        if args.distributed:
            tag += f"_{os.environ.get('WORLD_SIZE', '1')}ranks"
        args.out = ROOT / "benchmarks" / "results" / f"ensemble_{tag}_{date}.json"
    parts = ["distributed"] if args.distributed else args.parts
    if not hasattr(kernels, "splat_ensemble"):
        result["parts"] = {p: {"error": "kernels.splat_ensemble does not exist in this checkout"} for p in parts}
        parts = []
    for part in parts:
        limit = TIME_LIMITS[part] * args.time_scale * (10 if args.smoke else 1)
        rec: dict = {"time_limit_s": limit, "cases": []}
        result["parts"][part] = rec
        t0 = time.perf_counter()
        try:
            if part == "distributed":
                case = distributed_case(args)  # collectives: no alarm inside (a rank must not leave one)
                if case:
                    rec["cases"].append(case)
            else:
                with E.Deadline(limit, part) as deadline:
                    fn = ratio_case if part == "ratio" else throughput_case
                    try:
                        rec["cases"].append(fn(device, args, deadline))
                    except E.PartTimeout:
                        raise
                    except Exception as exc:
                        rec["cases"].append({"case": part, **E.error_record(exc)})
        except Exception as exc:
            rec.update(E.error_record(exc))
        rec["seconds"] = time.perf_counter() - t0
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if rank != 0:
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    print(f"wrote {args.out}")
    problems = check_schema(result)
    if args.smoke:
        for p in problems:
            print("SCHEMA:", p)
        print("smoke:", "ok" if not problems else f"{len(problems)} problems")
    return 1 if problems and (args.smoke or not parts) else 0


def stream_cpu_main(args) -> int:
    """``--stream-cpu F``: :mod:`benchmarks._stream_cpu`'s measurement, written to ``ensemble_stream_cpu_<date>.json``."""
    from benchmarks._stream_cpu import print_stream, stream_cpu

    threads = int(os.environ.get("OMP_NUM_THREADS", "2"))
    spacing = 1.0 if args.smoke else args.spacing  # the CPU kernel is slow at 2 Å (few voxels per atom)
    date = datetime.date.today().isoformat()
    rec = stream_cpu(args.stream_cpu, spacing, args.sigma, args.stream_chunk, threads=threads)
    result = {
        "benchmark": "kernels.splat_ensemble of a DCD streamed on the CPU",
        "date": date,
        "env": E.environment(),
        **rec,
    }
    out = (
        args.out or ROOT / "benchmarks" / "results" / f"ensemble_stream_cpu_{'smoke_' if args.smoke else ''}{date}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print_stream(rec)
    print(f"wrote {out}")
    return 0 if rec["stream_vs_memory"] is not None else 1


if __name__ == "__main__":
    raise SystemExit(main())
