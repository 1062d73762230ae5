"""Run by ``torchrun --nproc_per_node 2`` in tests/distributed/test_torchrun.py (gloo, CPU).

Reads the frames of the multi-model file given on the command line and, for each case, splats
them with ``process_group=`` the world, differentiates one loss, and saves this rank's map, its
own gradients and the gradients summed over ranks to ``OUT/rank<r>.pt`` for the test to compare
with the single-process result.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import kernels
from tests.distributed.cases import CASES, inputs, loss
from workbench.ensemble_cli import read_frames


def main(path: str, out: str) -> None:
    dist.init_process_group("gloo")
    group = dist.group.WORLD
    frames = read_frames(path)
    results = {}
    for name, case in CASES.items():
        leaves, kwargs, grid = inputs(frames, case)
        rho = kernels.splat_ensemble(*leaves[:2], grid, **kwargs, process_group=group)
        loss(rho, case).backward()
        own = {k: t.grad.clone() for k, t in zip(("xyz", "b_iso", "occ", "weights"), leaves[1:])}
        summed = kernels.sum_gradients_over_ranks(leaves[1:], group)
        results[name] = {
            "map": rho.detach(),
            "share": kernels.frame_share(leaves[1].shape[0], group),
            "own": own,
            "summed": dict(zip(("xyz", "b_iso", "occ", "weights"), (g.clone() for g in summed))),
        }
    torch.save(results, f"{out}/rank{dist.get_rank()}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
