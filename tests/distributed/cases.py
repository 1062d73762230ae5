"""The cases the torchrun test runs on every rank and once in the test process (shared definitions)."""

from __future__ import annotations

import torch

import kernels

# name -> frames used (a prefix of the file's), backend, reduce. With 2 ranks: 5 frames split
# 3 + 2 (uneven), 1 frame leaves rank 1 without frames.
CASES = {
    "uneven-reference": {"frames": 5, "backend": "reference", "reduce": "sum"},
    "uneven-cpu": {"frames": 5, "backend": "cpu", "reduce": "sum"},
    "one-frame": {"frames": 1, "backend": "reference", "reduce": "sum"},
    "none-reference": {"frames": 5, "backend": "reference", "reduce": "none"},
}


def inputs(frames, case):
    """(leaves [atoms, xyz, b_iso, occ, weights], keyword arguments, grid) for ``case``; leaves require grad."""
    dtype = torch.float64 if case["backend"] == "reference" else torch.float32
    f = case["frames"]
    atoms = frames.atoms.to(dtype=dtype)
    xyz, b_iso, occ = (t[:f].to(dtype).clone().requires_grad_() for t in (frames.xyz, frames.b_iso, frames.occ))
    weights = torch.linspace(0.5, 1.5, f, dtype=dtype).requires_grad_()
    grid = kernels.GridSpec.for_spacing(frames.cell, 1.0)
    kwargs = {"b_iso": b_iso, "occ": occ, "weights": weights, "backend": case["backend"], "reduce": case["reduce"]}
    return [atoms, xyz, b_iso, occ, weights], kwargs, grid


def loss(rho, case):
    """A loss that weights every voxel differently (the same on every rank)."""
    gen = torch.Generator().manual_seed(7)
    w = torch.rand(rho.shape[-3:], generator=gen, dtype=torch.float64).to(rho.dtype)
    return (rho * w).sum() + (rho**2).sum()
