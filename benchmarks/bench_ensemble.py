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

Streaming (``--stream-gpu``), issue 37 (JSON per mode into ``--out-dir``, default ``$OUT``, else
``benchmarks/results``):

- one device: 10⁶ frames of 1aki and 10⁵ of 3wip from :func:`perturbed_chunks` (made on the
  device, seeded: the source costs next to nothing, timed alone beside), chunks of
  ``kernels.DEFAULT_CHUNK_BYTES`` of positions,
  ``splat_ensemble(reduce="sum")`` forward, and forward then :func:`kernels.ensemble_gradients`
  (the streamed backward, a second pass); wall clock of the whole stream, peak device memory
  (``torch.cuda.max_memory_allocated``), host RSS sampled every 5 ms beyond its level before;
  against the in-memory rate of the same run (1aki 8,192 frames, 3wip 1,024, one call); the
  streamed map and gradients against one tensor call (uneven chunks);
- under torchrun: rank 0 writes a DCD of 50,000 frames of 3wip (10.3 GB, a block of distinct
  frames repeated; then read from the page cache); rank 0 alone streams it (one GPU), then every
  rank its share, forward and forward+backward, the slowest rank's wall clock; decoding alone
  (``FrameSource.chunks`` without a splat); one all-reduce of the map (its own JSON); and the
  model T(W) = F/(W·r₁) + t_ar of ``docs/scaling.md`` against the measured time.

Writes JSON (rank 0) and prints a table. ``--smoke``: one rep of everything on tiny inputs, then
a check of the JSON's layout (nonzero exit on a problem).

Usage::

    python benchmarks/bench_ensemble.py [--out X.json]
    torchrun --nproc_per_node 2 benchmarks/bench_ensemble.py --distributed [--out X.json]
    python benchmarks/bench_ensemble.py --device cpu --smoke
    python benchmarks/bench_ensemble.py --stream-gpu [--out-dir DIR]
    torchrun --nproc_per_node 2 benchmarks/bench_ensemble.py --stream-gpu [--out-dir DIR]
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


def _structure(name: str, n_atoms: int | None):
    """(atoms on the CPU, cell) of a benchmark structure, its first ``n_atoms`` atoms when given."""
    m = model(name)
    a = m.atoms
    if n_atoms is not None:
        a = AtomSet(a.xyz[:n_atoms], a.b_iso[:n_atoms], a.occ[:n_atoms], a.a[:n_atoms], a.b[:n_atoms])
    return a, m.cell


def _setup(name: str, n_frames: int, spacing: float, device: torch.device, sigma: float, n_atoms: int | None):
    a, cell = _structure(name, n_atoms)
    grid = GridSpec.for_spacing(cell, spacing)
    atoms = a.to(device, torch.float32)
    frames = frames_of(a, n_frames, sigma).to(device)
    upstream = torch.randn(grid.shape, generator=torch.Generator().manual_seed(1)).to(device)
    return atoms, grid, frames, upstream


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.detach().double(), ref.detach().double()
    return float((x - ref).norm() / ref.norm())


def _ensemble(atoms, frames, grid, **kw):
    return kernels.splat_ensemble(atoms, frames, grid, reduce="sum", **kw)


def _fwd_and_fwd_bwd(atoms, x: torch.Tensor, grid, w, **kw):
    """(forward, forward+backward) of the ensemble of frames ``x`` (requiring grad), as callables:
    the map under ``no_grad``, and ``(map * w).sum().backward()`` into ``x.grad``."""

    def fwd():
        with torch.no_grad():
            return _ensemble(atoms, x, grid, **kw)

    def fwd_bwd():
        x.grad = None
        (_ensemble(atoms, x, grid, **kw) * w).sum().backward()

    return fwd, fwd_bwd


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

    ens_fwd, ens_fwd_bwd = _fwd_and_fwd_bwd(atoms, x, grid, w)

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


def _timed(fn, device: torch.device, dist=None) -> float:
    """Seconds of one call of ``fn`` (barrier first under torchrun; the slowest rank's time)."""
    if dist is not None:
        dist.barrier()
    E._sync(device)
    t0 = time.perf_counter()
    fn()
    E._sync(device)
    t = time.perf_counter() - t0
    if dist is not None:
        tt = torch.tensor([t], dtype=torch.float64, device=device)
        dist.all_reduce(tt, op=dist.ReduceOp.MAX)
        t = float(tt)
    return t


def _wall_stats(fn, device: torch.device, reps: int, dist=None) -> dict:
    """Per call: (barrier), wall clock to the end of the call synchronised; the slowest rank's."""
    E.warm_up(fn, device, calls=2, seconds=0.0)
    t = sorted(_timed(fn, device, dist) * 1e3 for _ in range(reps))
    return {"median_ms": statistics.median(t), "p10_ms": t[(len(t) - 1) // 10], "p90_ms": t[(9 * len(t)) // 10],
            "reps": len(t), "method": "barrier, wall clock to the synchronised end of the call, slowest rank"}  # fmt: skip


def _join_ranks(args, timeout_s: float) -> tuple[int, int, torch.device]:
    """(rank, world size, device) after joining torchrun's process group: NCCL on the GPU
    ``LOCAL_RANK`` names, gloo on CPU processes (``--device cpu`` or no GPU)."""
    import datetime as dt

    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    cuda = args.device != "cpu" and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local)
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", timeout=dt.timedelta(seconds=timeout_s),
                            device_id=device if cuda else None)  # fmt: skip
    return rank, world, device


def distributed_case(args) -> dict:
    import torch.distributed as dist

    rank, world, device = _join_ranks(args, timeout_s=180)
    cuda = device.type == "cuda"
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

        one_fwd, one_fwd_bwd = _fwd_and_fwd_bwd(atoms, x1, grid, w)
        d_fwd, d_fwd_bwd = _fwd_and_fwd_bwd(atoms, xd, grid, w, process_group=group)

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
# streaming on GPUs (issue 37): frames from a generator on one GPU, from a DCD over torchrun
# ----------------------------------------------------------------------------------------------

#: Frames streamed on one GPU from the generator (issue 37's targets), and held in memory for the
#: in-memory rate they are compared with (3wip: the 1,024 of docs/scaling.md).
STREAM_FRAMES = {"1aki": 1_000_000, "3wip": 100_000}
IN_MEMORY_FRAMES = {"1aki": 8192, "3wip": 1024}
#: Frames of 3wip in the DCD the torchrun part writes (10.3 GB; ~20 s of one GPU's forward+backward).
STREAM_DCD_FRAMES = 50_000
#: Bytes of distinct frames in that DCD (a block repeated to the length asked for).
BLOCK_BYTES = 256 << 20
STREAM_TARGETS = {"device_peak_bytes": 2 << 30, "host_beyond_bytes": 2 << 30, "vs_in_memory": 0.9}
ALL_REDUCE_REPS = 30


class _PeakRSS:
    """Host resident memory (``/proc/self/statm``) sampled every 5 ms on a thread while in the block."""

    def __enter__(self):
        import threading

        self.before = self.peak = _rss()
        self._stop = threading.Event()

        def sample():
            while not self._stop.wait(0.005):
                self.peak = max(self.peak, _rss())

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())
        return False


def _rss() -> int:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: the process's peak so far (KiB on Linux, bytes on macOS)
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def perturbed_chunks(xyz: torch.Tensor, n_frames: int, chunk: int, sigma: float, seed: int = 0):
    """Yield ``n_frames`` frames of ``xyz`` + N(0, sigma²) Å per coordinate, ``chunk`` at a time.

    Made on ``xyz``'s device by a seeded generator (the same frames every call), so the source
    costs next to nothing beside the splat.

    Yields
    ------
    torch.Tensor, shape (≤ chunk, N, 3), ``xyz``'s dtype and device
    """
    gen = torch.Generator(device=xyz.device).manual_seed(seed)
    for lo in range(0, n_frames, chunk):
        c = min(chunk, n_frames - lo)
        # in place: the source holds one chunk of its own, not three
        yield torch.randn((c, *xyz.shape), generator=gen, device=xyz.device, dtype=xyz.dtype).mul_(sigma).add_(xyz)


class _GradSink:
    """``out=`` of :func:`kernels.ensemble_gradients` that keeps a running sum (no copy, no sync)."""

    def __init__(self, device):
        self.total = torch.zeros((), dtype=torch.float64, device=device)
        self.frames = 0

    def __call__(self, start: int, stop: int, grads: dict) -> None:
        self.total += grads["xyz"].sum(dtype=torch.float64)
        self.frames += stop - start


def _stream_fwd_bwd(atoms, frames_fn, grid, w, device, **kw):
    """Forward (the summed map) then the streamed backward of ``(rho * w).sum()``: a new frames
    iterable from ``frames_fn()`` for each pass. Returns (map, gradient sink)."""
    rho = kernels.splat_ensemble(atoms, frames_fn(), grid, reduce="sum", **kw)
    sink = _GradSink(device)
    kernels.ensemble_gradients(atoms, frames_fn(), grid, w, out=sink, **kw)
    return rho, sink


def stream_check(atoms, grid, w, device, args) -> dict:
    """Streamed (uneven chunks) against one tensor call on the same frames: map and position gradients."""
    n = 9 if args.smoke else 300
    xyz = frames_of(atoms.to("cpu", torch.float64), n, args.sigma, seed=5).to(device)
    cuts = [0, n // 3, n // 3 + 1, n]
    pieces = lambda: (xyz[a:b] for a, b in zip(cuts[:-1], cuts[1:]))  # noqa: E731
    x = xyz.clone().requires_grad_()
    want = kernels.splat_ensemble(atoms, x, grid, reduce="sum")
    (want * w).sum().backward()
    got = kernels.splat_ensemble(atoms, pieces(), grid, reduce="sum")
    grads = torch.zeros_like(xyz)
    kernels.ensemble_gradients(atoms, pieces(), grid, w, out=lambda a, b, g: grads[a:b].copy_(g["xyz"]))
    return {"frames": n, "chunks": [b - a for a, b in zip(cuts[:-1], cuts[1:])],
            "map_rel_l2": _rel(got, want), "grad_rel_l2": _rel(grads, x.grad)}  # fmt: skip


def _in_memory_rates(atoms, a: AtomSet, grid, w, n_mem: int, device, args) -> dict:
    """Frames per second of ``n_mem`` frames held in memory, all in one call (as throughput_case)."""
    fwd, fwd_bwd = _fwd_and_fwd_bwd(atoms, frames_of(a, n_mem, args.sigma).to(device).requires_grad_(), grid, w)

    reps = 1 if args.smoke else 5
    stats = {"fwd": E.eager_stats(fwd, device, reps), "fwd_bwd": E.eager_stats(fwd_bwd, device, reps)}
    rates = {f"{k}_frames_per_s": n_mem / (v["median_ms"] / 1e3) for k, v in stats.items()}
    return {"frames": n_mem, **rates, "stats": stats}


def stream_one_gpu_case(name: str, device: torch.device, args) -> dict:
    """One structure on one device: in-memory rate, then F frames streamed from the generator."""
    n_frames = args.stream_frames or (60 if args.smoke else STREAM_FRAMES[name])
    n_mem = min(n_frames, 16 if args.smoke else IN_MEMORY_FRAMES[name])
    a, cell = _structure(name, args.n_atoms)
    grid = GridSpec.for_spacing(cell, args.spacing)
    atoms = a.to(device, torch.float32)
    w = torch.randn(grid.shape, generator=torch.Generator().manual_seed(1)).to(device)
    chunk = args.stream_chunk or (16 if args.smoke else max(1, kernels.DEFAULT_CHUNK_BYTES // (12 * len(atoms))))
    res: dict = {"case": f"{name}, {n_frames} frames streamed in chunks of {chunk}", "frames": n_frames,
                 "chunk": chunk, "atoms": len(atoms), "grid": list(grid.shape),
                 "source": "perturbed_chunks: xyz + N(0, sigma²) made on the device per chunk, seeded"}  # fmt: skip
    print(f"\n== stream {res['case']}, grid {grid.shape}", flush=True)
    res["check"] = stream_check(atoms, grid, w, device, args)

    res["in_memory"] = _in_memory_rates(atoms, a, grid, w, n_mem, device, args)
    if device.type == "cuda":
        torch.cuda.empty_cache()

    xyz0 = a.xyz.to(device, torch.float32)
    frames_fn = lambda: perturbed_chunks(xyz0, n_frames, chunk, args.sigma, seed=11)  # noqa: E731
    res["source_alone_s"] = _timed(lambda: [None for _ in frames_fn()], device)
    # warm-up: every kernel compiled, on two chunks
    warm = lambda: perturbed_chunks(xyz0, min(n_frames, 2 * chunk), chunk, args.sigma)  # noqa: E731
    kernels.ensemble_gradients(atoms, warm(), grid, w, out=_GradSink(device))
    kernels.splat_ensemble(atoms, warm(), grid, reduce="sum")
    for what in ("fwd", "fwd_bwd"):
        E._sync(device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        base_device = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        with _PeakRSS() as rss:
            if what == "fwd":
                seconds = _timed(lambda: kernels.splat_ensemble(atoms, frames_fn(), grid, reduce="sum"), device)
            else:
                seconds = _timed(lambda: _stream_fwd_bwd(atoms, frames_fn, grid, w, device), device)
        rec = {"seconds": seconds, "frames_per_s": n_frames / seconds,
               "host_rss_before_bytes": rss.before, "host_rss_peak_bytes": rss.peak,
               "host_beyond_bytes": rss.peak - rss.before}  # fmt: skip
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
            rec.update(
                device_peak_bytes=peak, device_base_bytes=base_device, device_beyond_base_bytes=peak - base_device
            )
        rec["vs_in_memory"] = rec["frames_per_s"] / res["in_memory"][f"{what}_frames_per_s"]
        res[f"stream_{what}"] = rec
        print(f"  stream {what}: {rec['frames_per_s']:,.0f} frames/s ({rec['vs_in_memory']:.2f} of in-memory), "
              f"host +{rec['host_beyond_bytes'] / 2**20:.0f} MiB"
              + (f", device peak {rec['device_peak_bytes'] / 2**30:.2f} GiB" if device.type == "cuda" else ""),
              flush=True)  # fmt: skip
    t = STREAM_TARGETS
    targets = {}
    for what in ("fwd", "fwd_bwd"):
        r = res[f"stream_{what}"]
        targets[f"{what}_vs_in_memory"] = {"value": r["vs_in_memory"], "target": f">= {t['vs_in_memory']}",
                                           "pass": r["vs_in_memory"] >= t["vs_in_memory"]}  # fmt: skip
        targets[f"{what}_host_beyond_bytes"] = {"value": float(r["host_beyond_bytes"]), "target": "<= 2 GiB",
                                                "pass": r["host_beyond_bytes"] <= t["host_beyond_bytes"]}  # fmt: skip
        if "device_peak_bytes" in r:
            targets[f"{what}_device_peak_bytes"] = {"value": float(r["device_peak_bytes"]), "target": "<= 2 GiB",
                                                    "pass": r["device_peak_bytes"] <= t["device_peak_bytes"]}  # fmt: skip
    for key in ("map_rel_l2", "grad_rel_l2"):
        targets[f"streamed_{key}"] = {
            "value": res["check"][key],
            "target": "<= 1e-5",
            "pass": res["check"][key] <= 1e-5,
        }
    res["targets"] = targets
    return res


def write_dcd(path: Path, topology: Path, atoms: AtomSet, cell, n_frames: int, sigma: float, seed: int = 0) -> None:
    """A DCD of ``n_frames`` frames of ``atoms.xyz`` + N(0, sigma²) Å (seeded) with the box of
    ``cell``, and a PDB topology of the same atoms (element X: the benchmark takes the atoms' own
    coefficients, not the topology's).

    MDAnalysis writes the header and the first frame; the other frames are the same records with
    new coordinates (a frame is the box record and one Fortran record per axis), a block of
    :data:`BLOCK_BYTES` of distinct frames written again and again by numpy, and the header's frame
    count is set to ``n_frames``.
    """
    import warnings

    import MDAnalysis
    import numpy as np
    from MDAnalysis.coordinates.DCD import DCDReader, DCDWriter

    n = len(atoms)
    lines = [f"CRYST1{cell.parameters[0]:9.3f}{cell.parameters[1]:9.3f}{cell.parameters[2]:9.3f}"
             f"{cell.parameters[3]:7.2f}{cell.parameters[4]:7.2f}{cell.parameters[5]:7.2f} P 1           1"]  # fmt: skip
    xyz = atoms.xyz.to("cpu", torch.float64).numpy()
    for i, (x, y, z) in enumerate(xyz):
        lines.append(
            f"ATOM  {i % 100000:5d}  C   ALA A{i // 10 % 10000:4d}    {x:8.3f}{y:8.3f}{z:8.3f}  1.00 20.00           C"
        )
    topology.write_text("\n".join(lines) + "\nEND\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        u = MDAnalysis.Universe.empty(n, trajectory=True)
        u.atoms.positions = xyz
        u.trajectory.ts.dimensions = list(cell.parameters)
        with DCDWriter(str(path), n) as writer:
            writer.write(u.atoms)
        header = DCDReader(str(path))._file._header_size
    raw = np.fromfile(path, dtype=np.int32)
    head, template = raw[: header // 4].copy(), raw[header // 4 :]
    head[2] = n_frames  # NSET, after the record marker and "CORD"
    box = 14  # int32 words of the box record (4 + 48 + 4 bytes)
    gen = torch.Generator().manual_seed(seed)
    # one block of distinct frames, written again and again: decoding and splatting cost the same
    # whatever the displacements are, and the file is written at the disk's speed
    c = max(1, min(n_frames - 1, BLOCK_BYTES // template.nbytes))
    frames = np.tile(template, (c, 1))
    base = torch.as_tensor(xyz.T.copy(), dtype=torch.float32)  # (3, N)
    pos = (base + sigma * torch.randn((c, 3, n), generator=gen)).numpy()
    coords = frames.view(np.float32)
    for k in range(3):
        off = box + k * (n + 2) + 1
        coords[:, off : off + n] = pos[:, k]
    with open(path, "wb") as fh:
        head.tofile(fh)
        template.tofile(fh)
        for lo in range(1, n_frames, c):
            frames[: min(c, n_frames - lo)].tofile(fh)


def stream_distributed_case(args) -> tuple[dict, dict]:
    """torchrun: 3wip streamed from a DCD on one GPU (rank 0 alone) and on every rank, forward and
    the streamed backward; decoding alone; one map's all-reduce. Returns (stream, all-reduce) records
    (rank 0; empty on the others)."""
    import shutil
    import tempfile

    import torch.distributed as dist

    try:  # every rank, before any collective: none may wait on a rank that failed alone
        import MDAnalysis  # noqa: F401
    except ImportError:
        raise RuntimeError("streaming from a DCD needs MDAnalysis (the [md] extra) on every rank") from None
    rank, world, device = _join_ranks(args, timeout_s=600)  # rank 0 writes the DCD while the others wait
    group = dist.group.WORLD
    folder = None
    try:
        name = "1aki" if args.smoke else "3wip"
        n_frames = args.stream_frames or (40 if args.smoke else STREAM_DCD_FRAMES)
        a, cell = _structure(name, args.n_atoms)
        grid = GridSpec.for_spacing(cell, args.spacing)
        atoms = a.to(device, torch.float32)
        w = torch.randn(grid.shape, generator=torch.Generator().manual_seed(1)).to(device)
        # one folder for all ranks (one host): rank 0 makes it and writes the files, then tells the others
        t0 = time.perf_counter()
        told = [None, None]  # (folder, why rank 0 failed)
        if rank == 0:
            try:
                folder = Path(tempfile.mkdtemp(prefix="bench_stream_", dir=args.stream_dir))
                write_dcd(folder / "frames.dcd", folder / "top.pdb", a, cell, n_frames, args.sigma)
                told = [str(folder), None]
            except Exception as exc:  # said to every rank, which all stop here
                told = [None, f"rank 0 could not write the DCD: {type(exc).__name__}: {exc}"]
        dist.broadcast_object_list(told, src=0)
        if told[1]:
            raise RuntimeError(told[1])
        folder = Path(told[0])
        dcd, top = folder / "frames.dcd", folder / "top.pdb"
        res: dict = {"case": f"{name}, {n_frames} frames from a DCD over {world} ranks", "ranks": world,
                     "frames": n_frames, "atoms": len(atoms), "grid": list(grid.shape), "backend": dist.get_backend(),
                     "dcd_bytes": dcd.stat().st_size, "dcd_write_s": time.perf_counter() - t0,
                     "file": "written just before: read from the page cache, not the disk"}  # fmt: skip
        source = kernels.frames_from(dcd, top, chunk=args.stream_chunk or (8 if args.smoke else None))
        res["chunk"] = source.chunk
        if rank == 0:
            print(f"\n== stream {res['case']} ({res['backend']}), chunk {source.chunk}, grid {grid.shape}", flush=True)
        warm = kernels.frames_from(dcd, top, chunk=source.chunk, stop=min(n_frames, 2 * source.chunk))
        _stream_fwd_bwd(atoms, lambda: warm, grid, w, device)  # compile every kernel
        _stream_fwd_bwd(atoms, lambda: warm, grid, w, device, process_group=group)

        def decode(src):
            for _ in src.chunks():
                pass

        one: dict = {}
        if rank == 0:  # one GPU: rank 0 streams every frame alone, the others wait
            one["decode_s"] = _timed(lambda: decode(source), device)
            one["fwd_s"] = _timed(lambda: kernels.splat_ensemble(atoms, source, grid, reduce="sum"), device)
            one["fwd_bwd_s"] = _timed(lambda: _stream_fwd_bwd(atoms, lambda: source, grid, w, device), device)
        dist.barrier()
        many = {
            "decode_s": _timed(lambda: decode(source.share(group)), device, dist),
            "fwd_s": _timed(
                lambda: kernels.splat_ensemble(atoms, source, grid, reduce="sum", process_group=group), device, dist
            ),  # fmt: skip
            "fwd_bwd_s": _timed(
                lambda: _stream_fwd_bwd(atoms, lambda: source, grid, w, device, process_group=group), device, dist
            ),  # fmt: skip
        }
        ar = all_reduce_case(grid, device, dist)
        source.close()
        warm.close()
        if rank != 0:
            return {}, {}
        for rec in (one, many):
            rec["fwd_frames_per_s"] = n_frames / rec["fwd_s"]
            rec["fwd_bwd_frames_per_s"] = n_frames / rec["fwd_bwd_s"]
            # every frame is read twice (forward, then the backward's pass): decoding's share of the time
            rec["decode_share_fwd_bwd"] = 2 * rec["decode_s"] / rec["fwd_bwd_s"]
            rec["decode_frames_per_s"] = n_frames / rec["decode_s"]
        res["one_device"], res[f"{world}_ranks"] = one, many
        speedup = one["fwd_bwd_s"] / many["fwd_bwd_s"]
        # the model of docs/scaling.md: T(W) = F / (W r1) + t_ar (one map all-reduced per forward)
        r1 = one["fwd_bwd_frames_per_s"]
        predicted = n_frames / (world * r1) + ar["median_ms"] / 1e3
        res["model"] = {"r1_frames_per_s": r1, "all_reduce_s": ar["median_ms"] / 1e3,
                        f"predicted_{world}_ranks_s": predicted, f"measured_{world}_ranks_s": many["fwd_bwd_s"],
                        "measured_over_predicted": many["fwd_bwd_s"] / predicted}  # fmt: skip
        res["targets"] = {f"fwd_bwd_speedup_{world}_ranks": {"value": speedup, "target": f">= {TARGET_SCALING}",
                                                              "pass": speedup >= TARGET_SCALING}}  # fmt: skip
        print(f"  one device: {r1:,.0f} frames/s fwd+bwd, decoding {one['decode_share_fwd_bwd']:.0%}; "
              f"{world} ranks: {many['fwd_bwd_frames_per_s']:,.0f} frames/s (×{speedup:.2f}), decoding "
              f"{many['decode_share_fwd_bwd']:.0%}; all-reduce {ar['median_ms']:.3f} ms", flush=True)  # fmt: skip
        return res, ar
    finally:
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()
            if rank == 0 and folder is not None:
                shutil.rmtree(folder, ignore_errors=True)


def all_reduce_case(grid: GridSpec, device: torch.device, dist) -> dict:
    """The time of one ``all_reduce`` (SUM) of a float32 map of ``grid``: barrier, then wall clock to
    its synchronised end, the slowest rank's, median over :data:`ALL_REDUCE_REPS` after 2 warm-up calls."""
    buf = torch.ones(grid.shape, dtype=torch.float32, device=device)
    stats = _wall_stats(lambda: dist.all_reduce(buf), device, ALL_REDUCE_REPS, dist)
    return {"case": f"all_reduce of one {grid.shape[0]}×{grid.shape[1]}×{grid.shape[2]} float32 map",
            "map_bytes": buf.numel() * 4, "ranks": dist.get_world_size(), "backend": dist.get_backend(), **stats}  # fmt: skip


def stream_gpu_main(args, device: torch.device) -> int:
    """``--stream-gpu``: one device (no torchrun) or every rank (under torchrun); JSON per mode to ``--out-dir``."""
    date = datetime.date.today().isoformat()
    out_dir = args.out_dir or Path(os.environ.get("OUT") or ROOT / "benchmarks" / "results")
    tag = "smoke" if args.smoke else (f"cuda_{E.gpu_tag()}" if device.type == "cuda" else "cpu")
    head = {"benchmark": "streamed kernels.splat_ensemble / kernels.ensemble_gradients (issue 37)", "date": date,
            "env": E.environment(), "device_used": str(device), "torch_threads": torch.get_num_threads(),
            "smoke": args.smoke, "spacing": args.spacing, "sigma": args.sigma,
            "fwd_bwd": "splat_ensemble(frames) then ensemble_gradients(frames, map_grad=W): a second pass"}  # fmt: skip
    written = []
    if "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        world = os.environ["WORLD_SIZE"]
        try:
            stream, ar = stream_distributed_case(args)
        except Exception as exc:  # rank 0 records it; the others end without one, not killing rank 0 first
            stream, ar = {"case": "stream from a DCD", **E.error_record(exc)}, {}
            if int(os.environ["RANK"]) != 0:
                print(f"rank {os.environ['RANK']}: {type(exc).__name__}: {exc}", file=sys.stderr)
                return 0
        if int(os.environ["RANK"]) != 0:
            return 0
        records = {f"stream_{tag}_{world}ranks_{date}.json": {**head, "cases": [stream]}}
        if ar:
            records[f"allreduce_{tag}_{world}ranks_{date}.json"] = {**head, "cases": [ar]}
    else:
        cases = []
        records = {f"stream_{tag}_1device_{date}.json": {**head, "cases": cases}}
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in args.stream_structures:
            try:
                cases.append(stream_one_gpu_case(name, device, args))
            except Exception as exc:
                cases.append({"case": name, **E.error_record(exc)})
            if device.type == "cuda":
                torch.cuda.empty_cache()
            for fname, rec in records.items():  # after every case: a run stopped later keeps it
                (out_dir / fname).write_text(json.dumps(rec, indent=2) + "\n")
    out_dir.mkdir(parents=True, exist_ok=True)
    problems = []
    for fname, rec in records.items():
        (out_dir / fname).write_text(json.dumps(rec, indent=2) + "\n")
        written.append(out_dir / fname)
        for c in rec["cases"]:
            if "error" in c:
                problems.append(f"{fname}: {c['error'][:300]}")
            for tname, t in c.get("targets", {}).items():
                verdict = {True: "pass", False: "FAIL"}[t["pass"]]
                print(f"  {c['case'][:40]:40s} {tname:32s} {t['value']:.4g} (target {t['target']}) {verdict}")
    for p in written:
        print(f"wrote {p}")
    for p in problems:
        print("ERROR:", p)
    return 1 if problems else 0


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
    ap.add_argument("--stream-gpu", action="store_true",
                    help="issue 37's streaming modes: one device (generator), or under torchrun (DCD, all-reduce)")  # fmt: skip
    ap.add_argument("--stream-structures", nargs="+", default=["3wip", "1aki"], choices=["1aki", "3wip"])
    ap.add_argument("--stream-frames", type=int, default=None, help="frames streamed (default: the issue's)")
    ap.add_argument("--stream-chunk", type=int, default=None,
                    help="frames per chunk (default: --stream-gpu kernels.DEFAULT_CHUNK_BYTES, --stream-cpu 1024)")  # fmt: skip
    ap.add_argument("--stream-dir", type=Path, default=None, help="folder for the DCD (default: the temp folder)")
    ap.add_argument("--out-dir", type=Path, default=None, help="--stream-gpu JSON folder (default $OUT, else results)")
    ap.add_argument(
        "--stream-cpu",
        type=int,
        default=None,
        metavar="F",
        help="only: F frames of 1aki streamed from a DCD on the CPU against the in-memory rate (issue 37; 10000)",
    )
    args = ap.parse_args(argv)
    if args.stream_cpu is not None:
        return stream_cpu_main(args)
    if args.smoke:
        args.reps, args.spacing = 1, 2.0
        args.n_atoms = args.n_atoms or 40
        E.WARMUP_CALLS, E.WARMUP_S = 1, 0.0
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.stream_gpu:
        return stream_gpu_main(args, device)
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
    rec = stream_cpu(args.stream_cpu, spacing, args.sigma, args.stream_chunk or 1024, threads=threads)
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
