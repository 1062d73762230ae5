"""Streaming mode over processes: ``torchrun --nproc_per_node 2`` (gloo, CPU), each rank reading its own share.

The ranks of ``_stream_worker.py`` splat one DCD as a FrameSource (each reads only its frames), as
iterables of their own uneven shares, and write the per-frame gradients into one ``.npy``; every
result equals one process's.
"""

from __future__ import annotations

import numpy as np
import torch

import kernels
from tests.distributed._frames import CELL, write_trajectory
from tests.distributed.test_torchrun import ROOT, _torchrun
from tests.helpers import assert_close, assert_kernel_close


def test_two_ranks_each_read_their_share_and_agree_with_one_process(tmp_path):
    _, top, dcd = write_trajectory(tmp_path, 7, seed=4)
    _torchrun([str(ROOT / "tests" / "distributed" / "_stream_worker.py"), str(dcd), str(top), str(tmp_path)], tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]

    atoms = kernels.read_model(top).atoms.to("cpu", torch.float32)
    grid = kernels.GridSpec.for_spacing(kernels.Cell.from_parameters(*CELL), 1.0)
    xyz = torch.cat(list(kernels.frames_from(dcd, top).chunks()))
    want = kernels.splat_ensemble(atoms, xyz, grid)
    for got in ranks:
        assert_kernel_close(got["map"], want)
        assert_kernel_close(got["map_iter"], 0.5 * want)
    # frames 0..3 on rank 0 and 4..6 on rank 1 (kernels.frame_share), read two at a time
    assert ranks[0]["read"] == [(0, 2), (2, 4)] and ranks[1]["read"] == [(4, 6), (6, 7)]
    assert ranks[0]["progress"] == [(2, 4), (4, 4)] and ranks[1]["progress"] == [(2, 3), (3, 3)]

    upstream = ranks[0]["upstream"]
    x = xyz.clone().requires_grad_()
    b = atoms.b_iso.expand(7, len(atoms)).clone().requires_grad_()
    (kernels.splat_ensemble(atoms, x, grid, b_iso=b) * upstream).sum().backward()
    assert_kernel_close(torch.from_numpy(np.load(tmp_path / "grad.npy")), x.grad)
    assert_close(torch.from_numpy(np.load(tmp_path / "grad_b_iso.npy")), b.grad, atol=1e-5 * float(b.grad.abs().max()))
