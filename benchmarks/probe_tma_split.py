"""Probe (H100, sm_90): two ways the separable Triton forward could issue fewer or shorter-lived atomics.

A copy of the production forward's separable VEC path (one atom per program, one warp, 8×16 (x, z) lanes),
``_fwd_probe``, with:

- MODE 0: the production row loop, a ``red.global.add.v4.f32`` per group of 4 z lanes;
- MODE 1: the tile's values for RY rows written to shared memory and added to the map by one TMA bulk
  reduce-add (``tensor_descriptor.atomic_add``, ``cp.reduce.async.bulk.tensor``) of a (BP, RY, BQ) box.
  A box that crosses the periodic edge takes the lane-wise atomics instead (a reduce-add at a negative
  coordinate is an illegal instruction on the H100, where the edge could have been two clipped boxes);
- MODE 3 / 4: MODE 0 with each atom's x tiles split over 2 / 3 programs; MODE 11-13: its (x, z) tiles,
  flattened, split over 2-4 programs (a shorter longest program, each repeating the atom's set-up).

Each variant's map is checked against ``kernels.splat_density`` and timed as a CUDA-graph replay of
``map.zero_()`` + the launch. Run on a GPU from the repository root::

    VARIANTS="[(0,1,8,1,80),(1,1,8,1,80),(3,1,8,1,80)]" python benchmarks/probe_tma_split.py OUT.json

(``(MODE, RY, BP, num_warps, maxnreg)``; maxnreg 0 leaves the compiler's choice). The result and what it
showed: ``results/tma_split_probe_h100_2026-11-26.json``, docs/performance.md ("Tried and lost").
"""

# ruff: noqa: B023  (each case's closures are called within their own loop iteration)
import json
import os
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, os.getcwd())
import kernels  # noqa
from kernels.density import triton as T
from kernels.density.triton import (  # noqa
    _plan_scalars,
    _atom_inputs,
    _cutoff_radius,
    _atom_box,
    _radial_coef,
    _vec_z_box,
    _wrap,
    _z_lanes,
    _group_r2min,
    _tile_row_walk,
    _exp2_sum,
)


@triton.jit
def _red(
    desc,
    out_ptr,
    x0,
    y0,
    z0,
    val,
    keep,
    ix3,
    iz3,
    nx,
    ny,
    nz,
    lenx,
    lenz,
    rows,
    BP: tl.constexpr,
    RY: tl.constexpr,
    BQ: tl.constexpr,
):
    if (x0 + lenx <= nx) & (y0 + RY <= ny) & (z0 + lenz <= nz):
        desc.atomic_add([x0, y0, z0], val)
    else:
        iy3 = y0 + rows
        iy3 = tl.where(iy3 >= ny, iy3 - ny, iy3)
        tl.atomic_add(out_ptr + (ix3 * (ny * nz) + iy3 * nz + iz3), val, mask=keep, sem="relaxed")


@triton.jit(do_not_specialize=("n_atoms",))
def _fwd_probe(
    xyz_ptr,
    b_iso_ptr,
    occ_ptr,
    a_ptr,
    b_ptr,
    radius_ptr,
    p_ptr,
    out_ptr,
    desc,
    n_atoms,
    BP: tl.constexpr,
    BQ: tl.constexpr,
    RY: tl.constexpr,
    MODE: tl.constexpr,
    SPLIT: tl.constexpr,
    FLAT: tl.constexpr,
):
    ATOMS: tl.constexpr = 1
    ia = tl.program_id(0) // SPLIT + tl.arange(0, ATOMS)
    part = tl.program_id(0) % SPLIT
    valid = ia < n_atoms
    nx, ny, nz, h00, h11, h22, h01, h02, h12, rx, ry, rz, radius_all, cutoff = _plan_scalars(p_ptr)
    tx, ty, tz, bx, by, bz, b_iso, occ, ok = _atom_inputs(xyz_ptr, b_iso_ptr, occ_ptr, p_ptr, ia, valid, nx, ny, nz)
    rad = _cutoff_radius(b_iso, a_ptr, b_ptr, ia, ok, cutoff, 80)
    tl.store(radius_ptr + ia, rad, mask=valid & (part == 0))
    lox, loy, loz, cntx, cnty, cntz, r2max = _atom_box(tx, ty, tz, rad, ok, rx, ry, rz)
    amp0, al0, _b0 = _radial_coef(a_ptr, b_ptr, ia, valid, b_iso, 0)
    amp1, al1, _b1 = _radial_coef(a_ptr, b_ptr, ia, valid, b_iso, 1)
    amp2, al2, _b2 = _radial_coef(a_ptr, b_ptr, ia, valid, b_iso, 2)
    amp3, al3, _b3 = _radial_coef(a_ptr, b_ptr, ia, valid, b_iso, 3)
    amp4, al4, _b4 = _radial_coef(a_ptr, b_ptr, ia, valid, b_iso, 4)
    amp0 = (amp0 * occ)[:, None, None]
    amp1 = (amp1 * occ)[:, None, None]
    amp2 = (amp2 * occ)[:, None, None]
    amp3 = (amp3 * occ)[:, None, None]
    amp4 = (amp4 * occ)[:, None, None]
    be0 = (al0 * 1.4426950408889634)[:, None, None]
    be1 = (al1 * 1.4426950408889634)[:, None, None]
    be2 = (al2 * 1.4426950408889634)[:, None, None]
    be3 = (al3 * 1.4426950408889634)[:, None, None]
    be4 = (al4 * 1.4426950408889634)[:, None, None]
    r2lim_a = r2max * 1.001
    r2lim = r2lim_a[:, None, None]
    r2max_s = tl.max(r2max, axis=0)
    r2max = r2max[:, None, None]
    nz = nz // 4 * 4
    loz, cntz = _vec_z_box(bz, loz, cntz)
    inv_h22 = 1.0 / h22
    n_pc = tl.cdiv(tl.max(cntx, axis=0), BP)
    n_qc = tl.cdiv(tl.max(cntz, axis=0), BQ)
    n_rows = tl.max(cnty, axis=0)
    x_lo = lox.to(tl.float32) - tx
    z_lo = loz.to(tl.float32) - tz
    off_y = ty - loy.to(tl.float32)
    off_ys = tl.max(off_y, axis=0)
    top_y = cnty.to(tl.float32)
    x_start = tl.max(bx + lox, axis=0)
    z_start = tl.max(bz + loz, axis=0)
    tx = tx[:, None, None]
    ty = ty[:, None, None]
    tz = tz[:, None, None]
    iy0 = _wrap(by + loy, ny)
    off_y3 = off_y[:, None, None]
    pp = tl.arange(0, BP)[None, :, None]
    qq = tl.arange(0, BQ)[None, None, :]
    rows = tl.arange(0, RY)[None, :, None]
    pc = 0 if FLAT else part
    while pc < n_pc:
        kx = pc * BP + pp
        ox = lox[:, None, None] + kx
        dx = ox.to(tl.float32) - tx
        ix = _wrap(bx[:, None, None] + ox, nx)
        in_x = kx < cntx[:, None, None]
        lz = h02 * dx
        q0x = h00 * dx * dx
        x0 = _wrap(x_start + pc * BP, nx)
        qc = 0
        while qc < n_qc:
            ozg, dz, iz, in_z = _z_lanes(
                qc, qq, loz[:, None, None], cntz[:, None, None], bz[:, None, None], tz, nz, BQ, True
            )
            in_xz = in_x & in_z
            gmin = _group_r2min(ozg, tz, lz, q0x, h22, inv_h22)
            qxz = h00 * dx * dx + 2.0 * h02 * dx * dz + h22 * dz * dz
            base_xz = ix * (ny * nz) + iz
            e0 = amp0 * tl.exp2(-be0 * qxz)
            e1 = amp1 * tl.exp2(-be1 * qxz)
            e2 = amp2 * tl.exp2(-be2 * qxz)
            e3 = amp3 * tl.exp2(-be3 * qxz)
            e4 = amp4 * tl.exp2(-be4 * qxz)
            r, r_end, iy, r_lo, r_hi = _tile_row_walk(
                pc,
                qc,
                cntx,
                cntz,
                qxz,
                qxz,
                in_xz,
                x_lo,
                z_lo,
                r2lim_a,
                h00,
                h11,
                h22,
                h02,
                off_y,
                top_y,
                iy0,
                ny,
                n_rows,
                BP,
                BQ,
                True,
            )
            if FLAT:
                if (pc * n_qc + qc) % SPLIT != part:
                    r_end = r
            if MODE != 1:
                while r < r_end:
                    dy = r.to(tl.float32) - off_y3
                    qy = h11 * dy * dy
                    r2 = qxz + qy
                    val = _exp2_sum(e0, e1, e2, e3, e4, be0, be1, be2, be3, be4, qy)
                    hit = tl.max_constancy(gmin + qy < r2lim, [1, 1, 4])
                    inside = in_xz & hit
                    val = tl.where(r2 < r2max, val, 0.0)
                    tl.atomic_add(out_ptr + (base_xz + iy * nz), val, mask=inside, sem="relaxed")
                    iy += 1
                    iy = tl.where(iy == ny, 0, iy)
                    r += 1
            else:
                z0 = _wrap(z_start + qc * BQ, nz)
                # (BP, 1, BQ) lane quantities
                qxz_t = tl.reshape(tl.where(in_xz, qxz, 3.0e38), (BP, 1, BQ))
                f0 = tl.reshape(e0, (BP, 1, BQ))
                f1 = tl.reshape(e1, (BP, 1, BQ))
                f2 = tl.reshape(e2, (BP, 1, BQ))
                f3 = tl.reshape(e3, (BP, 1, BQ))
                f4 = tl.reshape(e4, (BP, 1, BQ))
                c0 = tl.max(tl.max(tl.max(be0, axis=0), axis=0), axis=0)
                c1 = tl.max(tl.max(tl.max(be1, axis=0), axis=0), axis=0)
                c2 = tl.max(tl.max(tl.max(be2, axis=0), axis=0), axis=0)
                c3 = tl.max(tl.max(tl.max(be3, axis=0), axis=0), axis=0)
                c4 = tl.max(tl.max(tl.max(be4, axis=0), axis=0), axis=0)
                y0 = tl.max(tl.max(tl.max(iy, axis=0), axis=0), axis=0)
                ix_t = tl.reshape(ix, (BP, 1, 1))
                iz_t = tl.reshape(iz, (1, 1, BQ))
                rows_t = tl.arange(0, RY)[None, :, None]
                lenx = tl.minimum(tl.max(cntx, axis=0) - pc * BP, BP)
                lenz = tl.minimum(tl.max(cntz, axis=0) - qc * BQ, BQ)
                while r < r_end:
                    rr = r + rows  # (1, RY, 1)
                    dy = rr.to(tl.float32) - off_ys
                    qy = h11 * dy * dy
                    r2 = qxz_t + qy
                    val = (
                        f0 * tl.exp2(-c0 * qy)
                        + f1 * tl.exp2(-c1 * qy)
                        + f2 * tl.exp2(-c2 * qy)
                        + f3 * tl.exp2(-c3 * qy)
                        + f4 * tl.exp2(-c4 * qy)
                    )
                    keep = (r2 < r2max_s) & (rr < r_end)
                    val = tl.where(keep, val, 0.0)
                    _red(desc, out_ptr, x0, y0, z0, val, keep, ix_t, iz_t, nx, ny, nz, lenx, lenz, rows_t, BP, RY, BQ)
                    y0 += RY
                    y0 = tl.where(y0 >= ny, y0 - ny, y0)
                    r += RY
            qc += 1
        pc += 1 if FLAT else SPLIT


def main():
    out_json = sys.argv[1]
    from benchmarks import _eager as E
    from benchmarks import tile_sweep as S

    dev = torch.device("cuda")
    res = {"device": torch.cuda.get_device_name(), "rows": []}
    cases = []
    a, g = S.case("3wip", 2 / 3, False)
    a = a.to(dtype=torch.float32)
    cases += [("3wip-hiB", S.hib(a), g), ("3wip", a, g)]
    a1, g1 = S.case("1aki", 2 / 3, False)
    a1 = a1.to(dtype=torch.float32)
    cases.append(("1aki", a1, g1))
    for name, atoms, grid in cases:
        with torch.no_grad():
            ref = kernels.splat_density(atoms, grid)
        plan = [p for k, p in T._plans.items() if p.shape == grid.shape][0]
        xyz, b_iso, occ, A, B = (
            atoms.xyz.contiguous(),
            atoms.b_iso.contiguous(),
            atoms.occ.contiguous(),
            atoms.a.contiguous(),
            atoms.b.contiguous(),
        )
        n = xyz.shape[0]
        radii = torch.empty(n, device=dev)
        out = torch.zeros(grid.shape, device=dev)
        nx, ny, nz = grid.shape

        def prod():
            with torch.no_grad():
                return kernels.splat_density(atoms, grid)

        V = eval(os.environ.get("VARIANTS", "[(0,1,8,1,80),(1,1,8,1,80)]"))
        variants = [("prod", None)] + [
            (f"mode{m}_ry{ry}_bp{bp}_w{w}_r{mr}", (m, ry, bp, w, mr)) for (m, ry, bp, w, mr) in V
        ]
        # mode >= 2: the atomic loop with each atom's x tiles split over (mode - 1) programs
        for label, v in variants:
            try:
                if v is None:
                    fn = prod
                else:
                    m, ry, bp, w, mr = v
                    bq = plan.bq
                    desc = TensorDescriptor(out, [nx, ny, nz], [ny * nz, nz, 1], [bp, ry, bq])

                    def fn(m=m, ry=ry, bp=bp, bq=bq, desc=desc, w=w, mr=mr):
                        out.zero_()
                        _fwd_probe[(n * (m - 9 if m >= 10 else max(1, m - 1)),)](
                            xyz,
                            b_iso,
                            occ,
                            A,
                            B,
                            radii,
                            plan.params,
                            out,
                            desc,
                            n,
                            BP=bp,
                            BQ=bq,
                            RY=ry,
                            MODE=m,
                            SPLIT=(m - 9 if m >= 10 else max(1, m - 1)),
                            FLAT=m >= 10,
                            num_warps=w,
                            **({"maxnreg": mr} if mr else {}),
                        )
                        return out

                got = fn().clone()
                torch.cuda.synchronize()
                err = float((got - ref).abs().max())
                gs = E.graph_stats(fn, dev, 60)
                row = {
                    "case": name,
                    "variant": label,
                    "graph_ms": gs["median_ms"],
                    "max_abs_diff": err,
                    "ref_max": float(ref.abs().max()),
                }
            except Exception as ex:
                row = {"case": name, "variant": label, "error": repr(ex)[:400]}
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
        # prod again (drift)
        gs = E.graph_stats(prod, dev, 60)
        res["rows"].append({"case": name, "variant": "prod_again", "graph_ms": gs["median_ms"]})
        print(res["rows"][-1], flush=True)
    regs = [[c.n_regs, c.n_spills] for c in _fwd_probe.device_caches[torch.cuda.current_device()][0].values()]
    res["regs"] = regs
    print("regs", regs)
    open(out_json, "w").write(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
