"""GPU density benchmark: Triton splat vs a plain torch ``index_add_`` splat vs gemmi (host CPU).

Called by ``benchmarks/bench_density.py --device cuda`` through :func:`run`, or standalone::

    python -m benchmarks._density_cuda --structures 1aki 5h73 3wip --spacing 0.6667 --out results.json

Per case (structure, spacing): the Triton forward and forward+backward (median of CUDA-event
timings after warm-up, eager calls and CUDA-graph replays), the torch ``index_add_`` splat of
the same voxels (indices precomputed, values and the scatter timed), gemmi's
``DensityCalculatorX`` on the host CPU (cutoff 1e-5, wall clock), and the accuracy of each
map as relative L2 against gemmi at cutoff 1e-7. 3wip is also run at half the spacing.
``--variants`` times tile variants of the Triton kernels on 3wip against the production plan, each a plan
derived from it with ``dataclasses.replace`` (``--variants-only`` skips the cases); ``--gather`` times the
brick-gather forward experiment defined below (notes for the README).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

STRUCTURE_DEFAULT = ("1aki", "5h73", "3wip")


def _gemmi_map(name: str, spacing: float, cutoff: float, repeats: int = 1):
    """gemmi's P1 map (ANISOU zeroed) and the median wall time of ``add_model_density_to_grid`` in ms."""
    import gemmi

    from tests.helpers import STRUCTURES

    st = gemmi.read_structure(str(STRUCTURES[name]))
    for chain in st[0]:
        for res in chain:
            for atom in res:
                atom.aniso = gemmi.SMat33f(0, 0, 0, 0, 0, 0)
    dc = gemmi.DensityCalculatorX()
    dc.d_min = 2 * 1.5 * spacing
    dc.rate = 1.5
    dc.cutoff = cutoff
    dc.set_grid_cell_and_spacegroup(st)
    times = []
    for _ in range(repeats):
        dc.initialize_grid()
        t0 = time.perf_counter()
        dc.add_model_density_to_grid(st[0])
        times.append((time.perf_counter() - t0) * 1e3)
    return np.array(dc.grid, copy=True), statistics.median(times)


def _rel_l2(out: torch.Tensor, ref: np.ndarray) -> float:
    r = torch.from_numpy(ref).to(out.device, torch.float64)
    return float((out.double() - r).norm() / r.norm())


class _TorchSplat:
    """Plain torch splat of exactly the voxels the kernels touch: indices precomputed, values and scatter timed."""

    def __init__(self, atoms, grid, radii: torch.Tensor):
        dev = atoms.device
        cell = grid.cell
        n = torch.tensor(grid.shape, device=dev, dtype=torch.float64)
        frac = atoms.xyz.double() @ cell.frac.to(dev).T
        centre = frac * n
        reach = radii.double()[:, None] * torch.tensor(cell.reciprocal_lengths, device=dev, dtype=torch.float64) * n
        lo = torch.floor(centre - reach).long()
        ext = (torch.ceil(centre + reach).long() - lo + 1).amax(0).tolist()  # setup only: syncs are fine here
        h = (cell.metric.to(dev) / (n[:, None] * n[None, :])).float()
        atom_idx, flat, offs = [], [], []
        chunk = max(1, (1 << 26) // (ext[0] * ext[1] * ext[2]))
        grid_off = torch.stack(
            torch.meshgrid(*(torch.arange(e, device=dev) for e in ext), indexing="ij"), dim=-1
        ).reshape(-1, 3)
        for s in range(0, len(atoms), chunk):
            pts = lo[s : s + chunk, None, :] + grid_off[None]  # (C, K, 3) lattice points
            d = (pts.double() - centre[s : s + chunk, None, :]).float()
            r2 = torch.einsum("cki,ij,ckj->ck", d, h, d)
            inside = r2 < (radii[s : s + chunk, None].float() ** 2)
            c, k = inside.nonzero(as_tuple=True)
            wrapped = torch.remainder(pts[c, k], torch.tensor(grid.shape, device=dev))
            atom_idx.append(c + s)
            flat.append((wrapped[:, 0] * grid.shape[1] + wrapped[:, 1]) * grid.shape[2] + wrapped[:, 2])
            offs.append(d[c, k])
        self.atom = torch.cat(atom_idx)
        self.flat = torch.cat(flat)
        self.r2 = torch.einsum("ei,ij,ej->e", torch.cat(offs), h, torch.cat(offs))
        width = (atoms.b + atoms.b_iso[:, None]).float()
        self.amp = (atoms.occ[:, None] * atoms.a * (4 * math.pi / width) ** 1.5).float()
        self.expo = (-4 * math.pi**2 / width).float()
        self.n_voxels = grid.n_voxels
        self.shape = grid.shape
        self.entries = int(self.flat.numel())

    def __call__(self) -> torch.Tensor:
        amp, expo = self.amp[self.atom], self.expo[self.atom]  # (E, 5)
        values = (amp * torch.exp(expo * self.r2[:, None])).sum(-1)
        out = torch.zeros(self.n_voxels, device=values.device, dtype=torch.float32)
        return out.index_add_(0, self.flat, values).view(self.shape)


def _bench(fn, graph: bool) -> float:
    import triton.testing

    if graph:
        return float(triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median"))
    return float(triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median"))


def _case(name: str, spacing: float, with_torch: bool = True, gemmi_repeats: int = 3) -> dict:
    import kernels
    from kernels.crystal import AtomSet, GridSpec
    from kernels.density.triton import _radii_device, splat_triton
    from tests.helpers import model

    m = model(name)
    grid = GridSpec.for_spacing(m.cell, spacing)
    base = m.atoms.to("cuda", torch.float32)
    xyz = base.xyz.clone().requires_grad_()
    b_iso = base.b_iso.clone().requires_grad_()
    occ = base.occ.clone().requires_grad_()
    atoms = AtomSet(xyz, b_iso, occ, base.a, base.b, base.elements, base.labels, _validate=False)
    w = torch.randn(grid.shape, device="cuda")
    res: dict = {"structure": name, "atoms": len(m.atoms), "cell": m.cell.kind, "spacing": spacing}
    res["grid"] = list(grid.shape)

    def fwd():
        with torch.no_grad():
            return splat_triton(atoms, grid)

    def fwd_bwd():
        out = splat_triton(atoms, grid)
        return torch.autograd.grad(out, (xyz, b_iso, occ), grad_outputs=w)

    out = fwd()  # first call: compiled here, checked below against gemmi like every later call
    ref7, _ = _gemmi_map(name, spacing, 1e-7)
    if tuple(ref7.shape) != grid.shape:
        raise RuntimeError(f"{name}: gemmi grid {ref7.shape} != {grid.shape}")
    res["triton_rel_l2_vs_gemmi_1e-7"] = _rel_l2(out, ref7)
    fwd_bwd()
    res["triton_fwd_ms"] = _bench(fwd, graph=False)
    res["triton_fwd_bwd_ms"] = _bench(fwd_bwd, graph=False)
    res["triton_fwd_graph_ms"] = _bench(fwd, graph=True)
    res["triton_fwd_bwd_graph_ms"] = _bench(fwd_bwd, graph=True)
    radii = _radii_device(base.b_iso, base.a, base.b, kernels.DEFAULT_CUTOFF)
    res["radius_kernel_ms"] = _bench(lambda: _radii_device(base.b_iso, base.a, base.b, 1e-5), graph=True)
    res["zero_map_ms"] = _bench(lambda: torch.zeros(grid.n_voxels, device="cuda"), graph=True)
    res["triton_rel_l2_second_call"] = _rel_l2(fwd(), ref7)

    if with_torch:
        ts = _TorchSplat(base, grid, radii)
        res["voxel_contributions"] = ts.entries
        res["torch_index_add_fwd_ms"] = _bench(ts, graph=False)
        res["torch_rel_l2_vs_gemmi_1e-7"] = _rel_l2(ts(), ref7)
        del ts
    ref5, gemmi_ms = _gemmi_map(name, spacing, 1e-5, repeats=gemmi_repeats)
    res["gemmi_cpu_fwd_ms"] = gemmi_ms
    res["gemmi_1e-5_rel_l2_vs_gemmi_1e-7"] = float(np.linalg.norm(ref5 - ref7) / np.linalg.norm(ref7))
    res["triton_speedup_vs_torch"] = res.get("torch_index_add_fwd_ms", float("nan")) / res["triton_fwd_ms"]
    res["triton_speedup_vs_gemmi"] = gemmi_ms / res["triton_fwd_ms"]
    torch.cuda.empty_cache()
    return res


# Tile shapes still worth timing against the production plan's (fields of kernels.density.triton._Plan):
# narrower forward tiles (4x16 / 4x32; within 1 % at 0.33 Å, where the forward has the least margin) and
# the backward on 16x16 tiles (the production 8x32 at 0.33 Å, the same tile at 0.67 Å).
VARIANTS: tuple[dict, ...] = (
    {},
    {"bp": 4},
    {"bp_bwd": 16, "bq_bwd": 16},
)


def _variants(spacings=(2 / 3, 1 / 3), variants=VARIANTS) -> list[dict]:
    """Plan variants of the Triton kernels on 3wip: graph-replay medians and agreement with the first variant."""
    import kernels
    from kernels.crystal import AtomSet, GridSpec
    from kernels.density import triton as tri
    from tests.helpers import model

    m = model("3wip")
    base = m.atoms.to("cuda", torch.float32)
    rows = []
    for spacing in spacings:
        grid = GridSpec.for_spacing(m.cell, spacing)
        w = torch.randn(grid.shape, device="cuda")
        default = None
        for var in variants:
            xyz = base.xyz.clone().requires_grad_()
            atoms = AtomSet(xyz, base.b_iso, base.occ, base.a, base.b, _validate=False)
            plan = dataclasses.replace(tri._plan(grid, None, kernels.DEFAULT_CUTOFF, xyz.device), **var)

            def fwd(atoms=atoms, plan=plan):
                with torch.no_grad():
                    return tri._splat(atoms, plan)

            def fwd_bwd(atoms=atoms, xyz=xyz, plan=plan, w=w):
                return torch.autograd.grad(tri._splat(atoms, plan), xyz, grad_outputs=w)

            out = fwd()
            grad = fwd_bwd()[0].double()
            if default is None:
                default, default_grad = out.double(), grad
            rel = float((out.double() - default).norm() / default.norm())
            row = dict(spacing=spacing, variant=var, bp=plan.bp, bq=plan.bq, num_warps=plan.num_warps)
            row["separable"] = plan.separable
            row["grad_xyz_rel_vs_default"] = float((grad - default_grad).norm() / default_grad.norm())
            row["vec"] = plan.vec
            row["bwd_tile"] = [plan.bp_bwd, plan.bq_bwd]
            row["fwd_graph_ms"] = _bench(fwd, graph=True)
            row["fwd_bwd_graph_ms"] = _bench(fwd_bwd, graph=True)
            row["rel_vs_default"] = rel
            rows.append(row)
            print(
                f"variant {spacing:.3f} {var} (vec {plan.vec}, {plan.bp}x{plan.bq}, bwd {plan.bp_bwd}x{plan.bq_bwd}) -> "
                f"{row['fwd_graph_ms']:.4f} / {row['fwd_bwd_graph_ms']:.4f} ms "
                f"(map {rel:.1e}, grad {row['grad_xyz_rel_vs_default']:.1e} from the first)"
            )
    return rows


# --------------------------------------------------------------------------- gather experiment
# A brick-gather forward, measured to decide whether it can replace the atomic scatter (see the README's
# "Density, GPU (H100)"): each program owns a (BY, BX, BZ) brick of the map in registers and loops over the
# (atom, periodic image) pairs binned to it; every voxel is stored once, no memset, no atomics. The binning
# here is plain torch with host syncs (setup, not timed with the kernel); only the gather kernel is timed.
# Separable exponent of orthogonal and monoclinic cells: (x, z) factors × y factors, all ≤ 1.

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _gather_fwd_experiment(
    ftab_ptr,  # (N, 16) float32: tx, ty, tz, R², amp0..4 (·occ), β0..4 (α·log2 e)
    pairs_ptr,  # (P, 4) int32, sorted by brick: atom, origin x, y, z (voxel of the image's centre floor)
    start_ptr,  # (n_bricks + 1,) int32: pairs of brick b are [start[b], start[b + 1])
    out_ptr,  # (nx·ny·nz,) float32, every voxel written
    nx,
    ny,
    nz,
    nby,
    nbz,
    h00,
    h11,
    h22,
    h02,
    BY: tl.constexpr,
    BX: tl.constexpr,
    BZ: tl.constexpr,
):
    pid = tl.program_id(0)
    jz = pid % nbz
    jt = pid // nbz
    jy = jt % nby
    jx = jt // nby
    # y leads so that each thread holds a run of rows: the (x, z) factors are then shared by its rows.
    qy = jy * BY + tl.arange(0, BY)[:, None, None]
    qx = jx * BX + tl.arange(0, BX)[None, :, None]
    qz = jz * BZ + tl.arange(0, BZ)[None, None, :]
    acc = tl.zeros((BY, BX, BZ), dtype=tl.float32)
    i = tl.load(start_ptr + pid)
    end = tl.load(start_ptr + pid + 1)
    while i < end:
        a = tl.load(pairs_ptr + i * 4)
        ox = tl.load(pairs_ptr + i * 4 + 1)
        oy = tl.load(pairs_ptr + i * 4 + 2)
        oz = tl.load(pairs_ptr + i * 4 + 3)
        row = ftab_ptr + a * 16
        dx = (qx - ox).to(tl.float32) - tl.load(row + 0)
        dy = (qy - oy).to(tl.float32) - tl.load(row + 1)
        dz = (qz - oz).to(tl.float32) - tl.load(row + 2)
        qa = h00 * dx * dx + 2.0 * h02 * dx * dz + h22 * dz * dz  # (1, BX, BZ)
        qb = h11 * dy * dy  # (BY, 1, 1)
        b0 = tl.load(row + 9)
        b1 = tl.load(row + 10)
        b2 = tl.load(row + 11)
        b3 = tl.load(row + 12)
        b4 = tl.load(row + 13)
        val = (
            (tl.load(row + 4) * tl.exp2(-b0 * qa)) * tl.exp2(-b0 * qb)
            + (tl.load(row + 5) * tl.exp2(-b1 * qa)) * tl.exp2(-b1 * qb)
            + (tl.load(row + 6) * tl.exp2(-b2 * qa)) * tl.exp2(-b2 * qb)
            + (tl.load(row + 7) * tl.exp2(-b3 * qa)) * tl.exp2(-b3 * qb)
            + (tl.load(row + 8) * tl.exp2(-b4 * qa)) * tl.exp2(-b4 * qb)
        )
        acc += tl.where(qa + qb < tl.load(row + 3), val, 0.0)
        i += 1
    tl.store(out_ptr + (qx * ny + qy) * nz + qz, acc, mask=(qx < nx) & (qy < ny) & (qz < nz))


@triton.jit
def _gather_fwd_dot_experiment(
    ftab_ptr,  # as _gather_fwd_experiment
    pairs_ptr,
    start_ptr,
    out_ptr,
    nx,
    ny,
    nz,
    nby,
    nbz,
    h00,
    h11,
    h22,
    h02,
    BY: tl.constexpr,
    BX: tl.constexpr,
    BZ: tl.constexpr,
):
    # The separable sum Σ_k E_k(x, z)·e_k(y) of one (atom, brick) pair as a matrix product
    # (BX·BZ, 16) @ (16, BY) (the 5 Gaussians, zero-padded to tl.dot's K ≥ 16): each factor is
    # evaluated once, not once per thread that holds a voxel using it. tf32x3: ~fp32 accuracy.
    pid = tl.program_id(0)
    jz = pid % nbz
    jt = pid // nbz
    jy = jt % nby
    jx = jt // nby
    mm = tl.arange(0, BX * BZ)
    qx = (jx * BX + mm // BZ)[:, None]  # (M, 1)
    qz = (jz * BZ + mm % BZ)[:, None]
    qy = (jy * BY + tl.arange(0, BY))[None, :]  # (1, BY)
    kk = tl.arange(0, 16)
    real = kk < 5
    acc = tl.zeros((BX * BZ, BY), dtype=tl.float32)
    i = tl.load(start_ptr + pid)
    end = tl.load(start_ptr + pid + 1)
    while i < end:
        a = tl.load(pairs_ptr + i * 4)
        ox = tl.load(pairs_ptr + i * 4 + 1)
        oy = tl.load(pairs_ptr + i * 4 + 2)
        oz = tl.load(pairs_ptr + i * 4 + 3)
        row = ftab_ptr + a * 16
        amp = tl.load(row + 4 + kk, mask=real, other=0.0)
        beta = tl.load(row + 9 + kk, mask=real, other=0.0)
        dx = (qx - ox).to(tl.float32) - tl.load(row + 0)
        dy = (qy - oy).to(tl.float32) - tl.load(row + 1)
        dz = (qz - oz).to(tl.float32) - tl.load(row + 2)
        qa = h00 * dx * dx + 2.0 * h02 * dx * dz + h22 * dz * dz  # (M, 1)
        qb = h11 * dy * dy  # (1, BY)
        e_xz = amp[None, :] * tl.exp2(-beta[None, :] * qa)  # (M, 16)
        e_y = tl.exp2(-beta[:, None] * qb)  # (16, BY)
        val = tl.dot(e_xz, e_y, input_precision="tf32x3")
        acc += tl.where(qa + qb < tl.load(row + 3), val, 0.0)
        i += 1
    tl.store(out_ptr + (qx * ny + qy) * nz + qz, acc, mask=(qx < nx) & (qy < ny) & (qz < nz))


def gather_experiment_bins(atoms, grid, radii: torch.Tensor, brick: tuple[int, int, int]):
    """Pairs (atom, image) per brick for :func:`_gather_fwd_experiment`, by torch ops (host syncs: setup only).

    ``brick`` is (BY, BX, BZ). Returns (ftab, pairs, start, n_bricks, nby, nbz).
    """
    dev = atoms.xyz.device
    by_, bx_, bz_ = brick
    shape = torch.tensor(grid.shape, device=dev, dtype=torch.int64)
    bsz = torch.tensor([bx_, by_, bz_], device=dev, dtype=torch.int64)
    nb = (shape + bsz - 1) // bsz
    m = (torch.tensor(grid.shape, dtype=torch.float64)[:, None] * grid.cell.frac).to(dev)
    c = atoms.xyz.double() @ m.T  # voxel units, float64
    f = torch.floor(c)
    t = c - f
    reach = (torch.tensor(grid.cell.reciprocal_lengths, dtype=torch.float64) * torch.tensor(grid.shape)).to(dev)
    r = radii.double()[:, None]
    p0 = f.long() + torch.floor(t - r * reach).long()
    p1 = f.long() + torch.ceil(t + r * reach).long()

    def slot(p):
        mm = torch.div(p, shape, rounding_mode="floor")
        return mm * nb + (p - mm * shape) // bsz

    g0 = slot(p0)
    cnt = slot(p1) - g0 + 1  # (N, 3) bricks per axis, images included
    per_atom = cnt.prod(1)
    atom = torch.repeat_interleave(torch.arange(len(per_atom), device=dev), per_atom)
    first = torch.cumsum(per_atom, 0) - per_atom
    k = torch.arange(atom.numel(), device=dev) - first[atom]
    cy, cz = cnt[atom, 1], cnt[atom, 2]
    s = torch.stack((k // (cy * cz), (k // cz) % cy, k % cz), 1)
    g = g0[atom] + s
    mm = torch.div(g, nb, rounding_mode="floor")
    j = g - mm * nb
    origin = f.long()[atom] - mm * shape
    brick_id = (j[:, 0] * nb[1] + j[:, 1]) * nb[2] + j[:, 2]
    order = torch.argsort(brick_id, stable=True)
    pairs = torch.cat((atom[:, None], origin), 1)[order].to(torch.int32).contiguous()
    n_bricks = int(nb.prod())
    start = torch.zeros(n_bricks + 1, dtype=torch.int64, device=dev)
    start[1:] = torch.cumsum(torch.bincount(brick_id, minlength=n_bricks), 0)
    width = atoms.b.double() + atoms.b_iso.double()[:, None]
    amp = atoms.occ.double()[:, None] * atoms.a.double() * (4 * math.pi / width) ** 1.5
    beta = 4 * math.pi**2 / width * 1.4426950408889634
    ftab = torch.zeros(len(per_atom), 16, dtype=torch.float64, device=dev)
    ftab[:, 0:3] = t
    ftab[:, 3] = radii.double() ** 2
    ftab[:, 4:9] = amp
    ftab[:, 9:14] = beta
    return ftab.float().contiguous(), pairs, start.to(torch.int32), n_bricks, int(nb[1]), int(nb[2])


def gather_experiment(atoms, grid, radii, brick, num_warps, bins=None, dot=False) -> torch.Tensor:
    """One call of the experimental gather forward (``bins`` from :func:`gather_experiment_bins`).

    ``dot``: the (x, z) × y factor product as a tl.dot (:func:`_gather_fwd_dot_experiment`).
    """
    if grid.cell.kind not in ("orthogonal", "monoclinic"):
        raise ValueError("the gather experiment handles orthogonal and monoclinic cells only")
    ftab, pairs, start, n_bricks, nby, nbz = bins or gather_experiment_bins(atoms, grid, radii, brick)
    nx, ny, nz = grid.shape
    h = grid.cell.metric / (torch.tensor(grid.shape, dtype=torch.float64)[:, None] * torch.tensor(grid.shape)[None])
    out = torch.empty(grid.n_voxels, dtype=torch.float32, device=atoms.xyz.device)
    kernel = _gather_fwd_dot_experiment if dot else _gather_fwd_experiment
    kernel[(n_bricks,)](
        ftab, pairs, start, out, nx, ny, nz, nby, nbz,
        float(h[0, 0]), float(h[1, 1]), float(h[2, 2]), float(h[0, 2]),
        BY=brick[0], BX=brick[1], BZ=brick[2], num_warps=num_warps,
    )  # fmt: skip
    return out.view(grid.shape)


_GATHER_CONFIGS = (  # ((BY, BX, BZ), warps)
    ((8, 8, 16), 1),
    ((8, 8, 16), 2),
    ((8, 8, 16), 4),
    ((16, 8, 16), 2),
    ((8, 4, 32), 2),
    ((4, 8, 16), 1),
    ((8, 8, 8), 1),
    ((16, 4, 16), 1),
)
_GATHER_DOT_CONFIGS = (((16, 4, 16), 1), ((16, 4, 16), 2), ((16, 8, 8), 2), ((32, 4, 16), 4))


def _gather_variants(spacings=(2 / 3, 1 / 3), configs=_GATHER_CONFIGS, dot=False) -> list[dict]:
    """The gather experiment on 3wip: kernel time (graph replay), pairs, agreement with the Triton scatter."""
    import kernels
    from kernels.crystal import GridSpec
    from kernels.density.triton import _radii_device, splat_triton
    from tests.helpers import model

    m = model("3wip")
    base = m.atoms.to("cuda", torch.float32)
    radii = _radii_device(base.b_iso, base.a, base.b, kernels.DEFAULT_CUTOFF)
    rows = []
    for spacing in spacings:
        grid = GridSpec.for_spacing(m.cell, spacing)
        ref = splat_triton(base, grid).double()
        for brick, warps in configs:
            t0 = time.perf_counter()
            bins = gather_experiment_bins(base, grid, radii, brick)
            torch.cuda.synchronize()
            bin_ms = (time.perf_counter() - t0) * 1e3
            out = gather_experiment(base, grid, radii, brick, warps, bins, dot)
            row = dict(spacing=spacing, brick_yxz=list(brick), num_warps=warps, pairs=int(bins[1].shape[0]), dot=dot)
            row["evaluated_voxels"] = row["pairs"] * brick[0] * brick[1] * brick[2]
            row["rel_vs_scatter"] = float((out.double() - ref).norm() / ref.norm())
            call = functools.partial(gather_experiment, base, grid, radii, brick, warps, bins, dot)
            row["gather_kernel_graph_ms"] = _bench(call, graph=True)
            row["torch_binning_wall_ms"] = bin_ms
            rows.append(row)
            print(f"gather{' dot' if dot else ''} {spacing:.3f} {brick} w{warps}: {row['gather_kernel_graph_ms']:.4f} ms, "
                  f"pairs {row['pairs']}, rel {row['rel_vs_scatter']:.2e}", flush=True)  # fmt: skip
            del bins, call
        torch.cuda.empty_cache()
    return rows


def run(args) -> dict:
    """Benchmark on the current CUDA device; ``args`` has ``.structures``, ``.spacing``, ``.out``."""
    if not torch.cuda.is_available():
        raise RuntimeError("benchmarks._density_cuda needs a CUDA GPU")
    import triton

    structures = list(getattr(args, "structures", None) or STRUCTURE_DEFAULT)
    spacing = float(getattr(args, "spacing", None) or 2.0 / 3.0)
    cases = [(s, spacing) for s in structures]
    if "3wip" in structures:
        cases.append(("3wip", spacing / 2))
    if getattr(args, "variants_only", False):
        cases = []
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "host_cpu": platform.processor() or platform.machine(),
        "timing": "triton.testing.do_bench / do_bench_cudagraph, median ms after warm-up; gemmi: wall clock, median",
        "cases": [],
    }
    for name, sp in cases:
        res = _case(name, sp, with_torch=True, gemmi_repeats=3 if sp >= 0.5 else 1)
        result["cases"].append(res)
        print(json.dumps(res), flush=True)
    if getattr(args, "variants", False) or getattr(args, "variants_only", False):
        result["variants"] = _variants()
    if getattr(args, "gather", False):
        result["gather_experiment"] = _gather_variants() + _gather_variants(configs=_GATHER_DOT_CONFIGS, dot=True)
    out = getattr(args, "out", None)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2))
    _print_table(result)
    return result


def _print_table(result: dict) -> None:
    print(f"\n{result['device']}  (ms, median; graph = CUDA-graph replay)")
    head = "case                  fwd   fwd(g)  f+b   f+b(g)  torch  gemmi    relL2(tri)  relL2(torch)"
    print(head)
    for c in result["cases"]:
        tag = f"{c['structure']} {c['grid'][0]}x{c['grid'][1]}x{c['grid'][2]}"
        print(
            f"{tag:20s} {c['triton_fwd_ms']:6.3f} {c['triton_fwd_graph_ms']:6.3f} {c['triton_fwd_bwd_ms']:6.3f} "
            f"{c['triton_fwd_bwd_graph_ms']:6.3f} {c.get('torch_index_add_fwd_ms', float('nan')):6.2f} "
            f"{c['gemmi_cpu_fwd_ms']:8.1f}  {c['triton_rel_l2_vs_gemmi_1e-7']:.2e}   "
            f"{c.get('torch_rel_l2_vs_gemmi_1e-7', float('nan')):.2e}"
        )


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--structures", nargs="+", default=list(STRUCTURE_DEFAULT))
    parser.add_argument("--spacing", type=float, default=2.0 / 3.0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--variants", action="store_true", help="also time tile variants on 3wip")
    parser.add_argument("--gather", action="store_true", help="also time the brick-gather experiment on 3wip")
    parser.add_argument("--variants-only", action="store_true", help="only the variants (no cases, no gemmi)")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
