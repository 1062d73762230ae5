"""Run by ``torchrun --nproc_per_node 2`` in tests/distributed/test_rank_checks.py (gloo, CPU).

``python _disagree_worker.py MODE OUT``; each rank writes what happened to ``OUT/rank<r>.txt``:

- ``frames``: rank r passes 5 + r frames (the ranks disagree on F).
- ``grid``: rank r splats on a grid of spacing 1.0 + 0.5·r (they disagree on the grid shape).
- ``omit-first``: rank 1 leaves ``process_group`` out and calls at once; rank 0 passes it 2 s later.
- ``omit-last``: the same, rank 1 calling 2 s after rank 0. Both under the group's default timeout
  (30 minutes): the ranks must find the mismatch themselves.
- ``late``: both pass ``process_group``, rank 1 calls 7 s after rank 0 (a rank busy with its own work).
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
    omit = mode in ("omit-first", "omit-last")
    if omit or mode == "late":
        dist.init_process_group("gloo")  # the default timeout: 30 minutes
    else:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=10))
    rank = dist.get_rank()
    group = dist.group.WORLD
    frames, spacing = (5 + rank, 1.0) if mode == "frames" else (5, 1.0 + 0.5 * rank if mode == "grid" else 1.0)
    atoms, xyz, grid = _inputs(frames, spacing)
    delay = {"omit-first": (2.0, 0.0), "omit-last": (0.0, 2.0), "late": (0.0, 7.0)}.get(mode, (0.0, 0.0))
    time.sleep(delay[rank])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = time.monotonic()
        try:
            pg = None if (omit and rank == 1) else group
            rho = kernels.splat_ensemble(atoms, xyz, grid, backend="reference", process_group=pg)
            result = f"ok {float(rho.sum()):.6g}"
        except (ValueError, RuntimeError) as exc:
            result = f"{type(exc).__name__}: {exc}"
        took = time.monotonic() - start
    notes = "".join(f"\nwarning: {w.message}" for w in caught)
    (out / f"rank{rank}.txt").write_text(f"{result}{notes}\nseconds: {took:.1f}")
    if omit:
        # rank 0's agreement never completes: leave without tearing the group down under it
        sys.stdout.flush()
        os._exit(0)
    dist.barrier()  # neither rank tears the group down under the other
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
