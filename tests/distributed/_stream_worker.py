"""Run by ``torchrun --nproc_per_node 2`` in tests/distributed/test_stream.py (gloo, CPU): streaming mode.

Every rank opens the DCD given on the command line and splats it with ``process_group=`` the world:
as a FrameSource (each rank reads its share), as an iterable of its own uneven share, and the
per-frame gradients into one ``.npy``. Saves the maps, the frames each rank read and its progress
counts to ``OUT/rank<r>.pt``.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import kernels
from tests.distributed._frames import CELL

SPLIT = 2  # frames of rank 0 in the iterable case; rank 1 takes the rest


def main(dcd: str, top: str, out: str) -> None:
    dist.init_process_group("gloo")
    group, rank = dist.group.WORLD, dist.get_rank()
    atoms = kernels.read_model(top).atoms.to("cpu", torch.float32)
    grid = kernels.GridSpec.for_spacing(kernels.Cell.from_parameters(*CELL), 1.0)

    src = kernels.frames_from(dcd, top, chunk=2)
    read, progress = [], []
    reader = src._reader
    original = reader.read
    reader.read = lambda lo, hi, buf, path: (read.append((lo, hi)), original(lo, hi, buf, path))[1]
    rho = kernels.splat_ensemble(atoms, src, grid, process_group=group, progress=lambda d, t: progress.append((d, t)))
    reader.read = original

    whole = kernels.frames_from(dcd, top)
    lo, hi = (0, SPLIT) if rank == 0 else (SPLIT, whole.n_frames)
    mine = kernels.frames_from(dcd, top, start=lo, stop=hi, chunk=3)
    rho_iter = kernels.splat_ensemble(atoms, iter(list(mine.chunks())), grid, process_group=group, weights=0.5)

    upstream = torch.randn(grid.shape, generator=torch.Generator().manual_seed(7))
    kernels.ensemble_gradients(
        atoms, src, grid, upstream, out=f"{out}/grad.npy", wrt=("xyz", "b_iso"), process_group=group
    )
    torch.save(
        {"map": rho, "map_iter": rho_iter, "read": read, "progress": progress, "upstream": upstream},
        f"{out}/rank{rank}.pt",
    )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
