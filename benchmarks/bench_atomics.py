"""How close the density splat comes to the GPU's limits (issue 36, part 2).

1. **Atomic reductions.** The throughput of global atomic adds issued as our forward issues them:
   each program takes one "atom's box" at a pseudo-random place of a 3-D buffer and walks its rows
   (y) as tiles of ``BP × BQ`` lanes, z the contiguous axis, one atomic add per lane per row. Kinds:

   - ``f32`` scalar, ``f32x2``, ``f32x4``: ``tl.atomic_add`` on float32 whose offsets Triton can
     prove 1-, 8- or 16-byte aligned in runs of 1, 2, 4 (sm_90 then emits ``red.global.add.f32``,
     ``.v2.f32``, ``.v4.f32``; the PTX ops actually emitted are read back from the compiled kernel
     and recorded, so a row says what it measured);
   - ``u32`` and ``u64`` integer adds (``u64``: what the deterministic forward issues, see
     docs/kernels.md, "Determinism");

   each on an L2-resident buffer (8 MiB) and an HBM-sized one (2 GiB, far beyond the 50-60 MB of L2
   of an H100/H200). Rates are element adds per second (and instructions per second: element adds
   divided by the vector width). CUDA events, median of ``--reps`` launches after a warm-up.

2. **Per structure** (1aki, 5h73, 3wip and the high-B cell 3wip-hiB of ``bench_eager.py``, 0.667 Å):

   - the forward's voxel contributions (atom, voxel) with r² < R², counted on the device as the forward
     selects them (per-atom radii from the forward's own radius kernel), and the 4-voxel z groups that
     hold them (one ``v4`` atomic each on sm_90);
   - the default forward's achieved contributions/s (eager call, CUDA events) against the measured
     ``f32x4`` element rate of the buffer class the map falls in (L2 when the map is under
     ``L2_BYTES``), and the deterministic forward's against the ``u64`` rate;
   - the backward's gather bandwidth (the 16-byte group loads: groups × 16 B per backward call, timed
     alone with ``retain_graph``) against the HBM bandwidth of a 1 GiB device copy (read + write).

Usage::

    python benchmarks/bench_atomics.py [--out X.json] [--cases 1aki 5h73 3wip 3wip-hiB] [--reps 20]
    TRITON_INTERPRET=1 python benchmarks/bench_atomics.py --smoke   # the code paths on tiny inputs, no GPU

Without a CUDA GPU and without ``TRITON_INTERPRET=1 --smoke`` it refuses (exit status 2) saying so.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import kernels  # noqa: E402
from benchmarks import _eager as E  # noqa: E402
from benchmarks.bench_eager import DENSITY_CASES, SPACING, _deterministic, _structure_atoms  # noqa: E402
from kernels.crystal import AtomSet, GridSpec  # noqa: E402
from kernels.density import triton as T  # noqa: E402

KINDS = {  # name -> (dtype, vector width the offsets are proven aligned to)
    "f32": (torch.float32, 1),
    "f32x2": (torch.float32, 2),
    "f32x4": (torch.float32, 4),
    "u32": (torch.int32, 1),
    "u64": (torch.int64, 1),
}
BUFFERS = {"l2": 8 * 2**20, "hbm": 2 * 2**30}  # bytes
L2_BYTES = 40 * 2**20  # a map below this stays in L2 (H100: 50 MB, H200: 60 MB)
BP, BQ, ROWS = 8, 16, 16  # the forward's 128-lane tile on one warp, rows per box
PROGRAMS = 1 << 16


@triton.jit
def _box_rows_kernel(buf_ptr, nx, ny, nz, plane, seed, ROWS: tl.constexpr, BP: tl.constexpr, BQ: tl.constexpr,
                     VEC: tl.constexpr, INT: tl.constexpr):  # fmt: skip
    """One box per program at a hashed place; ROWS rows of BP × BQ lanes (z contiguous), one atomic add each."""
    pid = tl.program_id(0).to(tl.int64)
    h = (pid * 2654435761 + seed) % 2147483647
    x0 = h % nx
    y0 = (h // 7) % ny
    z0 = (h // 131) % (nz - BQ + 1)
    z0 = tl.multiple_of(z0 // VEC * VEC, VEC)  # VEC-aligned start: Triton may vectorise in runs of VEC
    pp = tl.arange(0, BP)[:, None]
    qq = tl.arange(0, BQ)[None, :]
    ix = (x0 + pp) % nx
    base = ix * plane + z0 + qq
    if INT:
        val = tl.full((BP, BQ), 3, buf_ptr.dtype.element_ty)
    else:
        val = tl.full((BP, BQ), 0.25, tl.float32)
    for r in range(ROWS):
        iy = (y0 + r) % ny
        tl.atomic_add(buf_ptr + (base + iy * nz), val, sem="relaxed")


def _shape_of(nbytes: int, itemsize: int, nz: int = 128) -> tuple[int, int, int]:
    """(nx, ny, nz) of a buffer of about ``nbytes``, nz and ny × nz multiples of 16 (aligned rows)."""
    n = nbytes // itemsize
    ny = 128
    return max(BP, n // (ny * nz)), ny, nz


def _emitted_atomics(compiled) -> list[str]:
    """The PTX atomic-add ops of a compiled kernel (empty when there is no PTX: the interpreter)."""
    ptx = getattr(compiled, "asm", {}).get("ptx", "") if compiled is not None else ""
    ops = {t for line in ptx.splitlines() for t in line.split() if t.startswith(("atom.", "red.")) and ".add" in t}
    return sorted(ops)


def atomic_rates(device: torch.device, reps: int, smoke: bool) -> dict:
    """{buffer: {kind: record}} of the forward-pattern atomic throughput."""
    out: dict = {}
    programs = 4 if smoke else PROGRAMS
    for where, nbytes in BUFFERS.items():
        out[where] = {}
        for kind, (dtype, vec) in KINDS.items():
            itemsize = torch.empty((), dtype=dtype).element_size()
            nx, ny, nz = (BP, 4, BQ + 4) if smoke else _shape_of(nbytes, itemsize)
            buf = torch.zeros(nx * ny * nz, dtype=dtype, device=device)
            compiled = None

            def launch(buf=buf, nx=nx, ny=ny, nz=nz, vec=vec, dtype=dtype):
                return _box_rows_kernel[(programs,)](
                    buf, nx, ny, nz, ny * nz, 12345, ROWS=2 if smoke else ROWS, BP=BP, BQ=BQ, VEC=vec,
                    INT=dtype != torch.float32, num_warps=1,
                )  # fmt: skip

            try:
                compiled = launch()
                stats = E.eager_stats(launch, device, reps=1 if smoke else reps)
            except Exception as exc:
                out[where][kind] = E.error_record(exc)
                continue
            adds = programs * (2 if smoke else ROWS) * BP * BQ
            sec = stats["median_ms"] * 1e-3
            out[where][kind] = {
                "buffer_bytes": buf.numel() * itemsize,
                "shape": [nx, ny, nz],
                "element_adds": adds,
                "ptx_atomics": _emitted_atomics(compiled),
                "element_adds_per_s": adds / sec,
                "instructions_per_s": adds / vec / sec,
                **stats,
            }
            del buf
            if device.type == "cuda":
                torch.cuda.empty_cache()
            print(f"{where:4s} {kind:6s} {out[where][kind]['element_adds_per_s'] / 1e9:8.1f} G adds/s  "
                  f"{out[where][kind]['ptx_atomics']}", flush=True)  # fmt: skip
    return out


def hbm_bandwidth(device: torch.device, reps: int, smoke: bool) -> dict:
    """Bytes moved per second by a device copy of 1 GiB (read + write)."""
    n = (1 << 16) if smoke else (1 << 28)
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    stats = E.eager_stats(lambda: dst.copy_(src), device, reps=1 if smoke else reps)
    moved = 2 * n * 4
    return {"bytes_moved": moved, "bytes_per_s": moved / (stats["median_ms"] * 1e-3), **stats}


def count_contributions(atoms: AtomSet, grid: GridSpec, radii: torch.Tensor) -> tuple[int, int]:
    """(contributions, z groups of 4): voxels with r² < R² per atom, as the forward selects them, and the
    aligned 4-voxel runs along z (absolute grid index) holding at least one of them, summed over the atoms."""
    dev = radii.device
    shape = torch.tensor(grid.shape, dtype=torch.float64, device=dev)
    frac = atoms.xyz.to(dev, torch.float64) @ grid.cell.frac.to(dev).T
    centre = (frac - torch.floor(frac)) * shape  # voxel units, in the cell
    metric = (grid.cell.metric.to(dev) / (shape[:, None] * shape[None, :])).to(torch.float64)
    reach = torch.tensor(grid.cell.reciprocal_lengths, dtype=torch.float64, device=dev) * shape
    r = radii.to(torch.float64)
    lo = torch.floor(centre - r[:, None] * reach)
    cnt = (torch.ceil(centre + r[:, None] * reach) - lo + 1).to(torch.int64)
    contributions = groups = 0
    order = torch.argsort(cnt.prod(1))
    start, n = 0, len(r)
    while start < n:
        k = cnt[order[start:]].max(0).values
        size = max(1, min(n - start, (1 << 24) // int(k.prod())))
        idx = order[start : start + size]
        k = cnt[idx].max(0).values.tolist()
        d = [lo[idx, i, None] + torch.arange(k[i], device=dev) - centre[idx, i, None] for i in range(3)]
        dx, dy, dz = d[0][:, :, None, None], d[1][:, None, :, None], d[2][:, None, None, :]
        r2 = (metric[0, 0] * dx * dx + metric[1, 1] * dy * dy + metric[2, 2] * dz * dz + 2 * metric[0, 1] * dx * dy
              + 2 * metric[0, 2] * dx * dz + 2 * metric[1, 2] * dy * dz)  # fmt: skip
        inside = r2 < (r[idx] ** 2)[:, None, None, None]
        contributions += int(inside.sum())
        z = (lo[idx, 2, None] + torch.arange(k[2], device=dev))[:, None, None, :].expand_as(r2)
        z_lo = torch.where(inside, z, math.inf).amin(-1)
        z_hi = torch.where(inside, z, -math.inf).amax(-1)
        row = inside.any(-1)
        groups += int((torch.floor(z_hi[row] / 4) - torch.floor(z_lo[row] / 4) + 1).sum())
        start += size
    return contributions, groups


def structure_case(name: str, device: torch.device, reps: int, smoke: bool, rates: dict, hbm: dict) -> dict:
    atoms64, cell, what = _structure_atoms(name, smoke)
    grid = GridSpec.for_spacing(cell, 2.0 if smoke else SPACING)
    atoms = atoms64.to(device, torch.float32)
    radii = T._radii_alone(T._plan(grid, None, kernels.DEFAULT_CUTOFF, device), *T._kernel_inputs(atoms))
    contributions, groups = count_contributions(atoms, grid, radii)
    map_bytes = math.prod(grid.shape) * 4
    where = "l2" if map_bytes < L2_BYTES else "hbm"
    res: dict = {"case": name, "what": what, "atoms": len(atoms), "grid": list(grid.shape), "map_bytes": map_bytes,
                 "buffer_class": where, "contributions": contributions, "z_groups_of_4": groups}  # fmt: skip
    print(f"\n== {name}: {what}, grid {grid.shape}: {contributions} contributions in {groups} groups", flush=True)

    def fwd():
        with torch.no_grad():
            return kernels.splat_density(atoms, grid, backend="triton")

    n = 1 if smoke else reps
    res["fwd"] = E.eager_stats(fwd, device, reps=n)
    res["fwd_deterministic"] = E.eager_stats(_deterministic(fwd), device, reps=n)
    xyz = atoms.xyz.clone().requires_grad_()
    y = kernels.splat_density(atoms.replace(xyz=xyz, _validate=False), grid, backend="triton")
    w = torch.randn(grid.shape, generator=torch.Generator().manual_seed(0)).to(device)
    res["bwd"] = E.eager_stats(lambda: torch.autograd.grad(y, xyz, grad_outputs=w, retain_graph=True), device, reps=n)

    def frac(rate: float | None, limit: dict) -> float | None:
        lim = limit.get("element_adds_per_s") if isinstance(limit, dict) else None
        return None if rate is None or not lim else rate / lim

    fwd_rate = contributions / (res["fwd"]["median_ms"] * 1e-3)
    det_rate = contributions / (res["fwd_deterministic"]["median_ms"] * 1e-3)
    gather = groups * 16 / (res["bwd"]["median_ms"] * 1e-3)
    res["fractions"] = {
        "fwd_contributions_per_s": fwd_rate,
        "fwd_v4_instructions_per_s": groups / (res["fwd"]["median_ms"] * 1e-3),
        "fwd_vs_f32x4_limit": frac(fwd_rate, rates[where].get("f32x4")),
        "fwd_vs_f32_scalar_limit": frac(fwd_rate, rates[where].get("f32")),
        "fwd_deterministic_contributions_per_s": det_rate,
        "fwd_deterministic_vs_u64_limit": frac(det_rate, rates[where].get("u64")),
        "bwd_gather_bytes_per_s": gather,
        "bwd_gather_vs_hbm": gather / hbm["bytes_per_s"],
        "limits_from": f"{where} buffer rows of atomic_rates; HBM from a 1 GiB device copy",
    }
    print(json.dumps(res["fractions"]), flush=True)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=list(DENSITY_CASES))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny inputs, one timed call each, in the interpreter")
    args = ap.parse_args(argv)
    if torch.cuda.is_available():
        device = torch.device("cuda")
    elif args.smoke and os.environ.get("TRITON_INTERPRET") == "1":
        device = torch.device("cpu")
    else:
        print("bench_atomics.py measures a CUDA GPU and none is visible here; run it on a GPU machine, or check "
              "the script with TRITON_INTERPRET=1 python benchmarks/bench_atomics.py --smoke", file=sys.stderr)  # fmt: skip
        return 2
    if args.smoke:
        args.cases = args.cases[:1] if args.cases != list(DENSITY_CASES) else ["1aki"]
        E.WARMUP_CALLS, E.WARMUP_S = 1, 0.0
    date = datetime.date.today().isoformat()
    t0 = time.perf_counter()
    result: dict = {
        "benchmark": "atomic-add throughput in the forward's access pattern; the splat's fractions of it (issue 36)",
        "date": date, "env": E.environment(), "smoke": args.smoke,
        "pattern": {"programs": PROGRAMS, "rows": ROWS, "tile": [BP, BQ], "num_warps": 1, "buffers": BUFFERS},
    }  # fmt: skip
    result["atomics"] = atomic_rates(device, args.reps, args.smoke)
    result["hbm_copy"] = hbm_bandwidth(device, args.reps, args.smoke)
    print(f"HBM copy {result['hbm_copy']['bytes_per_s'] / 1e12:.2f} TB/s", flush=True)
    result["structures"] = []
    for name in args.cases:
        try:
            result["structures"].append(
                structure_case(name, device, args.reps, args.smoke, result["atomics"], result["hbm_copy"])
            )
        except Exception as exc:
            result["structures"].append({"case": name, **E.error_record(exc)})
            print(f"{name}: {result['structures'][-1]['error']}", flush=True)
    result["seconds"] = time.perf_counter() - t0
    if args.out is None:
        tag = "smoke" if args.smoke else E.gpu_tag()
        args.out = ROOT / "benchmarks" / "results" / f"atomics_{tag}_{date}.json"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out} ({result['seconds']:.0f} s)")
    bad = [s["case"] for s in result["structures"] if "error" in s]
    bad += [f"{w}/{k}" for w, rows in result["atomics"].items() for k, r in rows.items() if "error" in r]
    if bad:
        print("errors:", ", ".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
