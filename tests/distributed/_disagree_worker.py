"""Run by ``torchrun --nproc_per_node 2`` in tests/distributed/test_rank_checks.py (gloo, CPU).

``python _disagree_worker.py MODE OUT``; each rank writes what happened to ``OUT/rank<r>.txt``:

- ``frames``: rank r passes 5 + r frames (the ranks disagree on F).
- ``grid``: rank r splats on a grid of spacing 1.0 + 0.5·r (they disagree on the grid shape).
- ``omit``: rank 1 leaves ``process_group`` out; rank 0 passes it (group timeout 10 s).
- ``parent``: set up as ``workbench ensemble`` does, write this rank's pid, then sleep (the test
  kills torchrun with SIGKILL and watches the ranks end).
- ``library``: the same after one ``splat_ensemble(process_group=...)`` call, as a user's own
  script under torchrun makes it.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

import kernels


def _inputs(frames: int, spacing: float = 1.0):
    cell = kernels.Cell.from_parameters(14.0, 15.0, 13.0, 90.0, 95.0, 90.0)
    gen = torch.Generator().manual_seed(0)
    xyz0 = torch.rand((6, 3), generator=gen, dtype=torch.float64) * 12
    atoms = kernels.AtomSet.from_elements(["C", "N", "O", "C", "S", "C"], xyz0, 20.0)
    xyz = xyz0 + 0.3 * torch.randn((frames, 6, 3), generator=gen, dtype=torch.float64)
    return atoms, xyz, kernels.GridSpec.for_spacing(cell, spacing)


def main(mode: str, out: Path) -> None:
    if mode == "parent":
        from workbench.ensemble_cli import _distributed

        _, rank, _, _ = _distributed("cpu")
        (out / f"pid{rank}.txt").write_text(str(os.getpid()))
        time.sleep(600)
        return
    if mode == "library":
        dist.init_process_group("gloo")
        atoms, xyz, grid = _inputs(4)
        kernels.splat_ensemble(atoms, xyz, grid, backend="reference", process_group=dist.group.WORLD)
        (out / f"pid{dist.get_rank()}.txt").write_text(str(os.getpid()))
        time.sleep(600)
        return
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=10))
    rank = dist.get_rank()
    group = dist.group.WORLD
    frames, spacing = (5 + rank, 1.0) if mode == "frames" else (5, 1.0 + 0.5 * rank if mode == "grid" else 1.0)
    atoms, xyz, grid = _inputs(frames, spacing)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            pg = None if (mode == "omit" and rank == 1) else group
            rho = kernels.splat_ensemble(atoms, xyz, grid, backend="reference", process_group=pg)
            result = f"ok {float(rho.sum()):.6g}"
        except (ValueError, RuntimeError) as exc:
            result = f"{type(exc).__name__}: {exc}"
    notes = "".join(f"\nwarning: {w.message}" for w in caught)
    (out / f"rank{rank}.txt").write_text(result + notes)
    if mode == "omit":
        if rank == 1:
            time.sleep(15)  # stay up past rank 0's timeout, as a rank busy with its own work would
    else:
        dist.barrier()  # neither rank tears the group down under the other
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
