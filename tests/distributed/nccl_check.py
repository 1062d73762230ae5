"""NCCL correctness and throughput of ``splat_ensemble(process_group=...)`` on several GPUs of one host.

Run on a machine with ≥ 2 GPUs (not part of the CPU test suite)::

    torchrun --standalone --nproc_per_node 2 tests/distributed/nccl_check.py \\
        [--structure tests/data/3wip.cif.gz] [--frames 1024] [--check-frames 16] [--out result.json]

Correctness: ``--check-frames`` frames of the structure (positions jittered by 0.3 Å, per-frame
weights), ``reduce="sum"``, forward and the gradients of xyz, B, occupancy and weights summed over
the ranks (:func:`kernels.sum_gradients_over_ranks`), against rank 0 alone on one GPU, under the
float32 contract scaled to the map's and each gradient's largest value. Throughput: ``--frames``
frames, ``reduce="sum"``, forward (no grad) and forward+backward (xyz requiring grad), median of
``--repeats`` CUDA-event timings after a warm-up, first on rank 0 alone (the other ranks wait),
then on every rank with the group. Rank 0 prints one JSON object (and writes it to ``--out``).
``--cpu`` runs the same steps on CPU processes over gloo (a dry run of this script where there is
no GPU; its timings are not the GPU figures).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import kernels

ROOT = Path(__file__).resolve().parents[2]


def _frames(atoms: kernels.AtomSet, n_frames: int, device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)  # the same frames on every rank
    jitter = 0.3 * torch.randn((n_frames, len(atoms), 3), generator=gen, dtype=torch.float32)
    return (atoms.xyz.float().cpu()[None] + jitter).to(device)


def _time(fn, repeats: int, cuda: bool) -> float:
    """Median milliseconds of ``fn`` over ``repeats`` calls (CUDA events on a GPU), after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        if not cuda:
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
            continue
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _rel_contract(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got − want| / (1e-5·max|want| + 1e-5·|want|): ≤ 1 is inside the float32 contract."""
    bound = 1e-5 * want.abs().max() + 1e-5 * want.abs()
    return float(((got - want).abs() / bound.clamp_min(1e-30)).max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--structure", default=str(ROOT / "tests" / "data" / "3wip.cif.gz"))
    parser.add_argument("--spacing", type=float, default=0.667)
    parser.add_argument("--frames", type=int, default=1024)
    parser.add_argument("--check-frames", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out")
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU processes: a dry run without a GPU")
    args = parser.parse_args()

    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = not args.cpu
    if cuda:
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()

    model = kernels.read_model(args.structure)
    atoms = model.atoms.to(device, torch.float32)
    grid = kernels.GridSpec.for_spacing(model.cell, args.spacing, model.spacegroup)
    upstream = torch.rand(grid.shape, generator=torch.Generator().manual_seed(1)).to(device)

    # --- correctness against one GPU
    f = args.check_frames
    base = _frames(atoms, f, device)
    weights0 = torch.linspace(0.5, 1.5, f, device=device)
    b0 = atoms.b_iso[None].expand(f, -1).contiguous()
    o0 = atoms.occ[None].expand(f, -1).contiguous()

    def run(process_group):
        leaves = [t.clone().requires_grad_() for t in (base, b0, o0, weights0)]
        rho = kernels.splat_ensemble(
            atoms, leaves[0], grid, b_iso=leaves[1], occ=leaves[2], weights=leaves[3], process_group=process_group
        )
        (rho * upstream).sum().backward()
        if process_group is not None:
            kernels.sum_gradients_over_ranks(leaves, process_group)
        return rho.detach(), [t.grad for t in leaves]

    rho_n, grads_n = run(group)
    check = {}
    if rank == 0:
        rho_1, grads_1 = run(None)
        check["map"] = _rel_contract(rho_n, rho_1)
        for name, g_n, g_1 in zip(("xyz", "b_iso", "occ", "weights"), grads_n, grads_1):
            check[name] = _rel_contract(g_n, g_1)
    dist.barrier()

    # --- throughput
    xyz = _frames(atoms, args.frames, device)
    xyz_g = xyz.clone().requires_grad_()

    def forward(process_group):
        with torch.no_grad():
            kernels.splat_ensemble(atoms, xyz, grid, process_group=process_group)

    def forward_backward(process_group):
        xyz_g.grad = None
        rho = kernels.splat_ensemble(atoms, xyz_g, grid, process_group=process_group)
        (rho * upstream).sum().backward()

    one = {}
    if rank == 0:
        one = {"fwd_ms": _time(lambda: forward(None), args.repeats, cuda)}
        one["fwd_bwd_ms"] = _time(lambda: forward_backward(None), args.repeats, cuda)
    dist.barrier()
    many = {"fwd_ms": _time(lambda: forward(group), args.repeats, cuda)}
    many["fwd_bwd_ms"] = _time(lambda: forward_backward(group), args.repeats, cuda)
    dist.barrier()

    if rank == 0:
        result = {
            "what": "splat_ensemble reduce='sum' over NCCL vs one GPU",
            "device": torch.cuda.get_device_name(device) if cuda else "cpu (gloo dry run)",
            "gpus": world,
            "date": datetime.date.today().isoformat(),
            "torch": torch.__version__,
            "structure": Path(args.structure).name,
            "atoms": len(atoms),
            "grid": list(grid.shape),
            "correctness_frames": f,
            "correctness_vs_one_gpu": check,  # ≤ 1: inside the float32 contract
            "correctness_ok": all(v <= 1.0 for v in check.values()),
            "frames": args.frames,
            "one_gpu_fwd_ms": one["fwd_ms"],
            "one_gpu_fwd_bwd_ms": one["fwd_bwd_ms"],
            f"{world}_gpu_fwd_ms": many["fwd_ms"],
            f"{world}_gpu_fwd_bwd_ms": many["fwd_bwd_ms"],
            "speedup_fwd": one["fwd_ms"] / many["fwd_ms"],
            "speedup_fwd_bwd": one["fwd_bwd_ms"] / many["fwd_bwd_ms"],
            "frames_per_s_fwd": args.frames / many["fwd_ms"] * 1e3,
            "frames_per_s_fwd_bwd": args.frames / many["fwd_bwd_ms"] * 1e3,
        }
        text = json.dumps(result, indent=2)
        print(text, flush=True)
        if args.out:
            Path(args.out).write_text(text + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
