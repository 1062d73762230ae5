"""GPU density benchmark: Triton splat vs a plain torch ``index_add_`` splat vs gemmi (host CPU).

Called by ``benchmarks/bench_density.py --device cuda`` through :func:`run`, or standalone::

    python -m benchmarks._density_cuda --structures 1aki 5h73 3wip --spacing 0.6667 --out results.json

Per case (structure, spacing): the Triton forward and forward+backward (median of CUDA-event
timings after warm-up, eager calls and CUDA-graph replays), the torch ``index_add_`` splat of
the same voxels (indices precomputed, values and the scatter timed), gemmi's
``DensityCalculatorX`` on the host CPU (cutoff 1e-5, wall clock), and the accuracy of each
map as relative L2 against gemmi at cutoff 1e-7. 3wip is also run at half the spacing.
``--variants`` times tile variants of the Triton kernels on 3wip against the production plan, each a plan
derived from it with ``dataclasses.replace`` (``--variants-only`` skips the cases).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks._structures import STRUCTURES, model

STRUCTURE_DEFAULT = ("1aki", "5h73", "3wip")


def _gemmi_map(name: str, spacing: float, cutoff: float, repeats: int = 1):
    """gemmi's P1 map (ANISOU zeroed) and the median wall time of ``add_model_density_to_grid`` in ms."""
    from kernels.testing import gemmi_density_calculator

    st, dc = gemmi_density_calculator(STRUCTURES[name], spacing, cutoff)
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
    from kernels.density.triton import _kernel_inputs, _plan, _radii_alone, splat_triton

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
    inputs = _kernel_inputs(base)
    radii = _radii_alone(_plan(grid, None, kernels.DEFAULT_CUTOFF, base.device), *inputs)
    plan_1e5 = _plan(grid, None, 1e-5, base.device)
    res["radius_kernel_ms"] = _bench(lambda: _radii_alone(plan_1e5, *inputs), graph=True)
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
    parser.add_argument("--variants-only", action="store_true", help="only the variants (no cases, no gemmi)")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
