"""Tile shapes of the Triton density kernels, timed on a GPU (a diagnosis for choosing ``_Plan.build``'s tiles).

For each case it builds the production plan, then patches ``bp``/``bq``/``num_warps`` (isotropic) or the
``*_aniso`` fields (anisotropic) into the plan cache one variant at a time and times the public
``kernels.splat_density`` call as a CUDA-graph replay (device time) and eagerly, forward or
forward+backward, recording each compiled kernel's registers and spills and the largest difference of
its map from the first variant's (every variant must give the same map up to atomic order). Variants
are in the lists below; each JSON row carries its own. Cases: 3WIP (synthetic U), 3O5R and 1PFE
anisotropic and isotropic at 0.67 Å, 3WIP isotropic at 0.33 Å, 3WIP with B scaled to 250 Å² at most,
5H73.

Usage::

    python benchmarks/tile_sweep.py OUT.json
"""

import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import kernels  # noqa: E402
from benchmarks import _eager as E  # noqa: E402
from benchmarks._structures import anisotropic_model  # noqa: E402
from benchmarks._structures import model as plain_model  # noqa: E402
from benchmarks.bench_aniso_gpu import _calls  # noqa: E402
from kernels.crystal import GridSpec  # noqa: E402
from kernels.density import triton as T  # noqa: E402

dev = torch.device("cuda")
res: dict = {"rows": []}


def case(name, spacing, aniso):
    m = anisotropic_model(name) if aniso else plain_model(name)
    a = m.atoms
    if a.u_aniso is not None and not aniso:
        a = a.replace(u_aniso=None, aniso=None)
    return a.to(dev), GridSpec.for_spacing(m.cell, spacing, m.spacegroup)


def regs(plan):
    """Registers and spills of every compiled density kernel (Triton's per-device caches), by kernel name."""
    r = {}
    for ker in (T._splat_fwd_kernel, T._splat_bwd_kernel, T._aniso_fwd_kernel, T._aniso_bwd_kernel):
        try:
            for compiled in ker.device_caches[torch.cuda.current_device()][0].values():
                r.setdefault(ker.fn.__name__, []).append([compiled.n_regs, compiled.n_spills])
        except Exception as e:
            r[ker.fn.__name__] = repr(e)[:120]
    return r


def time_variants(label, atoms, grid, aniso, variants, fb, reps=40):
    fn = _calls(atoms, grid, aniso, dev)["fwd_bwd" if fb else "fwd"]
    fn()
    torch.cuda.synchronize()
    keys = [k for k, p in T._plans.items() if p.shape == grid.shape]
    base = {k: T._plans[k] for k in keys}
    ref = None
    for v in variants:
        for k in keys:
            T._plans[k] = dataclasses.replace(base[k], **v)
        try:
            with torch.no_grad():
                m = kernels.splat_density(atoms, grid)
            if ref is None:
                ref = m.clone()
            err = float((m - ref).abs().max())
            g = E.graph_stats(fn, dev, reps)
            e = E.eager_stats(fn, dev, reps)
            row = {
                "case": label,
                "fb": fb,
                "variant": v,
                "graph_ms": g["median_ms"],
                "eager_ms": e["median_ms"],
                "max_diff_vs_first": err,
                "regs": regs(T._plans[keys[0]]),
            }
        except Exception as ex:
            row = {"case": label, "fb": fb, "variant": v, "error": repr(ex)[:300]}
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
    for k in keys:
        T._plans[k] = base[k]


def hib(a):
    scale = 250.0 / float(a.b_iso.max())
    return a.replace(b_iso=a.b_iso * scale)


def main() -> None:
    out_path = Path(sys.argv[1])

    res["device"] = torch.cuda.get_device_name()
    t0 = time.time()
    fwd_aniso = [{}, {"bp_aniso": 4, "bq_aniso": 16}, {"bp_aniso": 16, "bq_aniso": 8}, {"bp_aniso": 4, "bq_aniso": 8}]
    bwd_aniso = [
        {},
        {"bp_aniso_bwd": 4, "bq_aniso_bwd": 8},
        {"bp_aniso_bwd": 16, "bq_aniso_bwd": 8},
        {"bp_aniso_bwd": 4, "bq_aniso_bwd": 16},
    ]
    iso_bwd = [
        {},
        {"bp_bwd": 16, "bq_bwd": 16},
        {"bp_bwd": 8, "bq_bwd": 16},
        {"bp_bwd": 4, "bq_bwd": 32},
        {"bp_bwd": 16, "bq_bwd": 32, "num_warps_bwd": 2},
        {"bp_bwd": 32, "bq_bwd": 16, "num_warps_bwd": 2},
    ]
    iso_fwd = [
        {},
        {"bp": 8, "bq": 16, "num_warps": 1},
        {"bp": 16, "bq": 32, "num_warps": 2},
        {"bp": 16, "bq": 16, "num_warps": 1},
        {"bp": 8, "bq": 32, "num_warps": 2},
        {"bp": 32, "bq": 16, "num_warps": 2},
    ]
    for name in ("3wip", "3o5r", "1pfe"):
        a, g = case(name, 2 / 3, True)
        time_variants(f"{name} aniso fwd", a, g, True, fwd_aniso, False)
        time_variants(f"{name} aniso fwd+bwd", a, g, True, bwd_aniso, True)
        a, g = case(name, 2 / 3, False)
        time_variants(f"{name} iso fwd", a, g, False, [{}], False)
        time_variants(f"{name} iso fwd+bwd", a, g, False, [{}], True)
        print("t", time.time() - t0, flush=True)
    a, g = case("3wip", 1 / 3, False)
    time_variants("3wip iso 0.33 fwd", a, g, False, iso_fwd, False)
    time_variants("3wip iso 0.33 fwd+bwd", a, g, False, iso_bwd, True)
    a, g = case("3wip", 2 / 3, False)
    a = hib(a)
    time_variants("3wip-hiB iso fwd", a, g, False, iso_fwd, False)
    time_variants("3wip-hiB iso fwd+bwd", a, g, False, iso_bwd, True)
    a, g = case("5h73", 2 / 3, False)
    time_variants("5h73 iso fwd", a, g, False, iso_fwd, False)
    time_variants("5h73 iso fwd+bwd", a, g, False, iso_bwd, True)
    out_path.write_text(json.dumps(res, indent=1))
    print("done", time.time() - t0)


if __name__ == "__main__":
    main()
