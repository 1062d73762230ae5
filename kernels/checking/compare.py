"""How a backend's output is compared with what it should be: the tolerances, maps, gradients, finite differences.

Each comparison returns a :class:`~kernels.checking.report.Check` with the measured figures, the
tolerance in words and the worst element (for a map: the voxel, its position and the nearest atom).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kernels.checking.report import Check, Worst
from kernels.crystal import AtomSet, GridSpec

# docs/kernels.md's float32 contract: |out − ref| ≤ 1e-5·max|ref| + 1e-5·|ref|.
MAP_RTOL = 1e-5
# gemmi sums in float32 with a fast exp (docs/kernels.md, tolerances in the tests).
GEMMI_ATOL, GEMMI_RTOL = 1e-4, 1e-5
# Gradients of Σ w·ρ sum thousands of float32 voxel terms per atom: 1e-4 of the largest
# gradient (our cpu backend stays below 2e-6 on the bundled structures).
GRAD_RTOL = 1e-4
# Finite differences: central, step FD_STEP Å, of the loss summed in float64 from the float32
# map; the step's truncation error and the map's rounding stay below 1e-3 of the largest
# gradient of the atoms probed (ours: below 3e-4), while a wrong sign or a missing term is 100 %.
FD_STEP = 1e-2
FD_RTOL = 1e-2
FD_ATOMS = 3
# GPU atomics reorder float32 sums between calls: within the float32 contract, not bitwise.
GPU_REPEAT_RTOL = 1e-5


def _voxel_where(grid: GridSpec, atoms: AtomSet, index: tuple[int, int, int]) -> tuple[tuple, str, float]:
    """Position of voxel ``index`` in Å, the nearest atom (periodic images included) and its distance."""
    frac = torch.tensor([(o + i) / m for i, o, m in zip(index, grid.origin, grid.sampling)], dtype=torch.float64)
    xyz = atoms.xyz.detach().to("cpu", torch.float64)
    if len(xyz) == 0:
        pos = grid.cell.orth @ frac
        return tuple(float(v) for v in pos), "", float("nan")
    d = (xyz @ grid.cell.frac.T) - frac  # fractional differences, (N, 3)
    d = d - d.round()
    shifts = torch.tensor([(i, j, k) for i in (-1, 0, 1) for j in (-1, 0, 1) for k in (-1, 0, 1)], dtype=torch.float64)
    cart = (d[:, None, :] + shifts[None]) @ grid.cell.orth.T  # (N, 27, 3): images next to the minimum one
    dist = cart.norm(dim=-1).min(dim=1).values
    k = int(dist.argmin())
    pos = grid.cell.orth @ frac
    return tuple(float(v) for v in pos), str(atoms.labels[k]), float(dist[k])


def _compare_maps(
    out: torch.Tensor,
    ref: torch.Tensor,
    atoms: AtomSet,
    grid: GridSpec,
    atol_rel: float,
    rtol: float,
    atol: float = 0.0,
) -> tuple[dict, Worst | None, np.ndarray, np.ndarray, bool]:
    """Compare maps under ``|out − ref| ≤ atol + atol_rel·max|ref| + rtol·|ref|``."""
    o = out.detach().to("cpu", torch.float64)
    r = ref.detach().to("cpu", torch.float64)
    finite = torch.isfinite(o)
    diff = torch.where(finite, (o - r).abs(), torch.full_like(o, math.inf))
    max_ref = float(r.abs().max()) if r.numel() else 0.0
    limit = atol + atol_rel * max_ref + rtol * r.abs()
    over = diff > limit
    norm = float(torch.linalg.norm(r))
    err = torch.where(finite, o - r, torch.zeros_like(o))
    n_bad = int((~finite).sum())
    metrics = {
        "rel_l2": (float(torch.linalg.norm(err)) / norm if norm > 0 else float(torch.linalg.norm(err)))
        if n_bad == 0
        else math.inf,
        "max_abs": float(diff.max()) if diff.numel() else 0.0,
        "max_ref": max_ref,
        "n_over": int(over.sum()),
        "n_nonfinite": n_bad,
        "n_voxels": diff.numel(),
    }
    if diff.numel() == 0:
        return metrics, None, np.zeros((0, 0), np.float32), np.zeros((0, 0), bool), True
    flat = int(torch.where(over, diff, torch.zeros_like(diff)).argmax()) if bool(over.any()) else int(diff.argmax())
    index = tuple(int(i) for i in np.unravel_index(flat, tuple(o.shape)))
    pos, atom, dist = _voxel_where(grid, atoms, index)
    worst = Worst(index, float(o.reshape(-1)[flat]), float(r.reshape(-1)[flat]), pos, atom, dist)
    k = index[2]
    section = (o[:, :, k] - r[:, :, k]).numpy().astype(np.float32)
    return metrics, worst, section, over[:, :, k].numpy(), not bool(over.any())


def _map_summary(m: dict) -> str:
    if m["n_nonfinite"]:
        return f"{m['n_nonfinite']} of {m['n_voxels']} voxels not finite"
    return (
        f"rel L2 {m['rel_l2']:.2e}, max |Δ| {m['max_abs']:.2e} e/Å³ (max |ρ| {m['max_ref']:.3g}), "
        f"{m['n_over']} of {m['n_voxels']} voxels over"
    )


def _map_check(name, case, out, ref, atoms, tolerance, atol_rel, rtol, atol=0.0) -> Check:
    metrics, worst, section, over, ok = _compare_maps(out, ref, atoms, case.grid, atol_rel, rtol, atol)
    return Check(
        name, case.name, "pass" if ok else "fail", tolerance, _map_summary(metrics), metrics, worst, section, over
    )


_GRAD_FIELDS = ("xyz", "b_iso", "occ", "u_aniso")


def _leaf(atoms: AtomSet) -> AtomSet:
    u = None if atoms.u_aniso is None else atoms.u_aniso.detach().clone().requires_grad_(True)
    return AtomSet(
        atoms.xyz.detach().clone().requires_grad_(True),
        atoms.b_iso.detach().clone().requires_grad_(True),
        atoms.occ.detach().clone().requires_grad_(True),
        atoms.a,
        atoms.b,
        atoms.elements,
        atoms.labels,
        u,
        atoms.aniso,
        radiation=atoms.radiation,
        _validate=False,
    )


def _grads(leaf: AtomSet) -> tuple:
    """The gradients of the leaf's differentiable fields (``u_aniso`` only for an anisotropic set)."""
    return tuple(getattr(leaf, f).grad for f in _GRAD_FIELDS if getattr(leaf, f) is not None)


def _gradient_check(case, atoms, out_grads, ref_grads) -> Check:
    worst_val, worst, n_over, parts = -1.0, None, 0, []
    for field, g, r in zip(_GRAD_FIELDS, out_grads, ref_grads):
        if g is None:
            return Check(
                "gradients",
                case.name,
                "fail",
                f"{GRAD_RTOL:g}·max|ref| + {GRAD_RTOL:g}·|ref| per element",
                f"no gradient reached atoms.{field}: the output is not differentiable with respect to it "
                "(register with capabilities={'gradients': False} if it is not meant to be)",
            )
        g = g.detach().to("cpu", torch.float64)
        r = r.detach().to("cpu", torch.float64)
        if g.shape != r.shape:
            g = g.reshape(r.shape)
        diff = torch.where(torch.isfinite(g), (g - r).abs(), torch.full_like(g, math.inf))
        scale = float(r.abs().max()) if r.numel() else 0.0
        over = diff > GRAD_RTOL * scale + GRAD_RTOL * r.abs()
        n_over += int(over.sum())
        if diff.numel():
            rel = diff / (scale or 1.0)
            flat = int(rel.argmax())
            parts.append(f"{field} max |Δ|/max|ref| {float(rel.reshape(-1)[flat]):.1e}")
            if float(rel.reshape(-1)[flat]) > worst_val:
                worst_val = float(rel.reshape(-1)[flat])
                idx = tuple(int(i) for i in np.unravel_index(flat, tuple(r.shape)))
                comp = f" {'xyz'[idx[1]]}" if field == "xyz" else ""
                worst = Worst(
                    (idx[0],) + idx[1:],
                    float(g.reshape(-1)[flat]),
                    float(r.reshape(-1)[flat]),
                    atom=f"{atoms.labels[idx[0]]} ∂/∂{field}{comp}",
                )
    return Check(
        "gradients",
        case.name,
        "pass" if n_over == 0 else "fail",
        f"{GRAD_RTOL:g}·max|ref| + {GRAD_RTOL:g}·|ref| per element of ∂(Σ w·ρ)/∂(xyz, B, occ"
        + (", U)" if len(ref_grads) == 4 else ")"),
        ", ".join(parts) + f"; {n_over} elements over",
        {"n_over": n_over, "max_rel": worst_val},
        worst,
    )


def _fd_check(case, atoms32, grad_xyz, ref_grad_xyz, weights, call) -> Check:
    """∂(Σ w·ρ)/∂xyz of the backend's autograd against its own central differences at a few atoms."""
    strength = ref_grad_xyz.detach().norm(dim=1)
    picks = [int(i) for i in strength.argsort(descending=True)[:FD_ATOMS]]
    w = weights.to(atoms32.device, torch.float64)
    worst, worst_rel, n_over, rows = None, -1.0, 0, []
    ad = grad_xyz.detach().to("cpu", torch.float64)
    scale = float(ad[picks].abs().max()) if picks else 0.0
    for i in picks:
        for c in range(3):
            losses = []
            for sign in (1.0, -1.0):
                xyz = atoms32.xyz.detach().clone()
                xyz[i, c] += sign * FD_STEP
                with torch.no_grad():
                    rho = call(atoms32.replace(xyz=xyz))
                losses.append(float((rho.detach().to(torch.float64) * w).sum()))
            fd = (losses[0] - losses[1]) / (2 * FD_STEP)
            err = abs(fd - float(ad[i, c]))
            rel = err / (scale or 1.0)
            if not math.isfinite(fd) or not math.isfinite(float(ad[i, c])):
                rel = math.inf
            if rel > FD_RTOL:
                n_over += 1
            if rel > worst_rel:
                worst_rel = rel
                worst = Worst((i, c), float(ad[i, c]), fd, atom=f"{atoms32.labels[i]} ∂/∂{'xyz'[c]}")
            rows.append(rel)
    return Check(
        "finite differences",
        case.name,
        "pass" if n_over == 0 else "fail",
        f"|autograd − central difference (h = {FD_STEP:g} Å)| ≤ {FD_RTOL:g}·max|autograd| of the {len(picks)} atoms",
        f"{len(picks)} atoms × 3 components, worst |Δ|/max {worst_rel:.1e}; {n_over} over",
        {"n_over": n_over, "max_rel": worst_rel},
        worst,
    )
