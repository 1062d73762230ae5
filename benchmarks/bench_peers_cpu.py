"""The CPU density splat against torchref's CPU path (the Rust package ``torchref-kernels``), side by side.

Issue 36 part 3. One process pinned to ``--cores`` (two logical CPUs) before any thread pool starts; for
each condition (``quiet``; ``loaded``: a spinning subprocess pinned to the second of ``--cores``, as in
``bench_cpu_loaded.py``) and structure, ``--calls`` rounds, every implementation and thread count
interleaved in an order rotated each round, so a shared machine's drift meets each alike:

- ``ours``                  ``kernels.splat_density(atoms, grid)`` (float32, ``backend="auto"``: the C++ CPU
                            kernel);
- ``torchref 0.8``          torchref at 26e407e (its repository's "0.8.x"): ``add_isotropic_cpu_sphere_var``,
                            i.e. ``SplatIso`` over the ``torch.ops.torchref.splat_iso_{fwd,bwd}`` operators,
                            whose CPU kernel is ``torchref-kernels`` 0.1.0 (``--peer08 DIR``);
- ``torchref 0.7.0``        0.7.0's ``add_isotropic_cpu_sphere_var``: the same Rust entry points without the
                            operator layer (``--peer070 DIR``), at its default only;

each as forward under ``no_grad`` and forward+backward ``(map * W).sum().backward()`` with xyz, B and
occupancy requiring grad, at 1 and 2 threads (``torch.set_num_threads``: our kernel and theirs both
follow it). torchref's radii (its ``radius_policy`` at ``n_sigma`` σ) are computed once outside the timed
call, which favours it.

Each peer runs at its default (3σ, ``torchref.sigma_cutoff_ed``) and at **equal accuracy**: the smallest
σ of ``_peers.TORCHREF_SIGMAS`` whose map's relative L2 distance from gemmi's (cutoff 1e-7, the same
grid) is at most ours; where none reaches it, the most accurate one (the JSON says which). The ratios
(their median over ours, > 1: ours faster) are reported per structure, condition and thread count; issue
36's target is ≥ 1.5× at 2 threads on 3wip.

Usage::

    python benchmarks/bench_peers_cpu.py --peer08 DIR08 --peer070 DIR070 --cores 0,1 --calls 9 \\
        --out benchmarks/results/peers_cpu_<machine>_<date>.json
    python benchmarks/bench_peers_cpu.py --smoke --peer08 DIR08      # 1aki, 1 call, quiet only

``DIR08`` is ``pip install --no-deps --target DIR08`` of the torchref 0.8 wheel and of
``torchref_kernels-0.1.0-…whl`` (``DIR070`` likewise with 0.7.0's).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import kernels  # noqa: E402
from benchmarks import _peers  # noqa: E402
from benchmarks._eager import error_record  # noqa: E402
from benchmarks._structures import STRUCTURES, model  # noqa: E402
from benchmarks.bench_cpu_loaded import QUIET_BUSY, BusyCore, percentiles  # noqa: E402
from benchmarks.bench_density import _busy_fraction, _cpu_name  # noqa: E402
from kernels.crystal import AtomSet, GridSpec  # noqa: E402
from kernels.testing import gemmi_density  # noqa: E402

#: Issue 36: ours at 2 threads at least this much faster than their CPU path on 3wip.
TARGET_2T = 1.5


def _rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.detach().to(torch.float64) - ref).norm() / ref.norm())


def _leaves(atoms: AtomSet) -> list[torch.Tensor]:
    return [atoms.xyz.clone().requires_grad_(), atoms.b_iso.clone().requires_grad_(),
            atoms.occ.clone().requires_grad_()]  # fmt: skip


def _pair(op, atoms: AtomSet, weight: torch.Tensor):
    """(fwd, fwd_bwd) callables of ``op(xyz, b, occ) -> map``."""
    leaves = _leaves(atoms)

    def fwd():
        with torch.no_grad():
            op(atoms.xyz, atoms.b_iso, atoms.occ)

    def fwd_bwd():
        for t in leaves:
            t.grad = None
        (op(*leaves) * weight).sum().backward()

    return fwd, fwd_bwd


def setup_structure(name: str, peers: dict, spacing: float) -> dict:
    """Atoms, grid, the gemmi reference, ours and every peer's callables and the equal-accuracy search."""
    m = model(name)
    grid = GridSpec.for_spacing(m.cell, spacing)
    atoms = m.atoms.to(dtype=torch.float32)
    ref = torch.from_numpy(gemmi_density(STRUCTURES[name], spacing, 1e-7)).to(torch.float64)
    if tuple(ref.shape) != grid.shape:
        raise RuntimeError(f"{name}: gemmi's grid {tuple(ref.shape)} is not ours {grid.shape}")
    weight = torch.randn(grid.shape, generator=torch.Generator().manual_seed(0))

    def ours(xyz, b, occ):
        return kernels.splat_density(AtomSet(xyz, b, occ, atoms.a, atoms.b, _validate=False), grid)

    with torch.no_grad():
        ours_acc = _rel_l2(ours(atoms.xyz, atoms.b_iso, atoms.occ), ref)
    impls = {"ours": _pair(ours, atoms, weight)}
    info: dict = {"ours": {"rel_l2_vs_gemmi_1e-7": ours_acc}, "peers": {}}
    for pname, peer in peers.items():
        if "error" in peer:
            info["peers"][pname] = {"error": peer["error"]}
            continue
        splat, policy = peer["cpu"], peer["radius_policy"]
        try:

            def make(s, splat=splat, policy=policy):
                fn, _ = _peers.torchref_call(splat, policy, atoms, grid, n_sigma=s, aniso=False)
                with torch.no_grad():
                    return fn(atoms.xyz, atoms.b_iso, atoms.occ)

            settings = {"default": _peers.TORCHREF_SIGMA_DEFAULT}
            if peer.get("search", True):
                search = _peers.equal_accuracy_search(make, _peers.TORCHREF_SIGMAS, lambda x: _rel_l2(x, ref), ours_acc)
                settings["equal_accuracy"] = search["setting"]
            else:
                search = None
            for label, s in settings.items():
                fn, what = _peers.torchref_call(splat, policy, atoms, grid, n_sigma=s, aniso=False)
                key = f"{pname} {label}"
                impls[key] = _pair(fn, atoms, weight)
                acc = _rel_l2(make(s), ref) if label == "default" else search["accuracy"]
                info["peers"][key] = {"n_sigma": s, "radius": what, "rel_l2_vs_gemmi_1e-7": acc}
            if search is not None:
                info["peers"][f"{pname} equal_accuracy"]["search"] = search
        except Exception as exc:  # a peer that fails is a result
            info["peers"][pname] = error_record(exc)
    return {"name": name, "atoms": len(atoms), "grid": list(grid.shape), "impls": impls, "info": info}


def run_condition(setups: list[dict], calls: int) -> list[dict]:
    """Interleaved timings of every implementation, op and thread count of each structure.

    Each round sets one thread count at a time (in an order rotated each round) and times every
    implementation and op at it (rotated too). ``torchref-kernels`` rebuilds its thread pool when the
    count changes, so one untimed call of ours and of the first peer follows each switch: neither
    pays for a pool start inside a timed call.
    """
    rows = []
    for s in setups:
        impls = s["impls"]
        pairs = [(impl, op) for impl in impls for op in (0, 1)]
        first_peer = next((k for k in impls if k != "ours"), None)

        def switch(t, impls=impls, first_peer=first_peer):
            torch.set_num_threads(t)
            impls["ours"][0]()
            if first_peer is not None:
                impls[first_peer][0]()

        for t in (1, 2):  # warm-up, not recorded
            switch(t)
            for impl, op in pairs:
                impls[impl][op]()
        times: dict = {f"{impl} {('fwd', 'fwd_bwd')[op]} {t}t": [] for impl, op in pairs for t in (1, 2)}
        for i in range(calls):
            for t in ((1, 2), (2, 1))[i % 2]:
                switch(t)
                k = i % len(pairs)
                for impl, op in pairs[k:] + pairs[:k]:
                    t0 = time.perf_counter()
                    impls[impl][op]()
                    times[f"{impl} {('fwd', 'fwd_bwd')[op]} {t}t"].append(time.perf_counter() - t0)
        stats = {key: percentiles(v) for key, v in times.items()}
        ratios = {}
        for pname in s["info"]["peers"]:
            if "error" in s["info"]["peers"][pname]:
                continue
            for op in ("fwd", "fwd_bwd"):
                for t in (1, 2):
                    ratios[f"{pname} {op} {t}t"] = round(stats[f"{pname} {op} {t}t"]["p50"] /
                                                         stats[f"ours {op} {t}t"]["p50"], 3)  # fmt: skip
        rows.append({"structure": s["name"], "atoms": s["atoms"], "grid": s["grid"], **s["info"],
                     "stats_ms": stats, "peer_over_ours_p50": ratios, "calls_s": times})  # fmt: skip
    return rows


def _targets(rows: list[dict]) -> dict:
    """Issue 36: ours ≥ 1.5× their CPU path at 2 threads on 3wip (each peer setting, op, condition)."""
    out = {}
    for row in rows:
        if row["structure"] != "3wip":
            continue
        for key, v in row["peer_over_ours_p50"].items():
            if key.endswith(" 2t"):
                out[key] = {"value": v, "target": f">= {TARGET_2T}", "pass": v >= TARGET_2T}
    return out


def load(args) -> dict:
    peers: dict = {}
    if args.peer070:
        try:
            _peers.load_torchref_070(args.peer070)
            cpu = _peers.load_torchref_070_cpu(args.peer070)
            policy = sys.modules[_peers._RADIUS]
            peers["torchref 0.7.0"] = {"cpu": cpu, "radius_policy": policy, "search": False}
        except Exception as exc:
            peers["torchref 0.7.0"] = error_record(exc)
        _peers.park_torchref("070")
    if args.peer08:
        try:
            p = _peers.load_torchref_08(args.peer08)
            if p["cpu_error"]:
                raise RuntimeError(p["cpu_error"])
            peers["torchref 0.8"] = {**p, "search": True}
        except Exception as exc:
            peers["torchref 0.8"] = error_record(exc)
    return peers


def _print(condition: str, row: dict) -> None:
    print(f"\n{condition} {row['structure']} {row['grid']}: ours rel. L2 {row['ours']['rel_l2_vs_gemmi_1e-7']:.2e}")
    for key, st in row["stats_ms"].items():
        print(f"  {key:42s} p10/p50/p90 {st['p10']:9.1f} {st['p50']:9.1f} {st['p90']:9.1f} ms")
    for key, p in row["peers"].items():
        if "error" in p:
            print(f"  {key}: error {p['error'][:120]}")
        else:
            print(f"  {key}: n_sigma {p['n_sigma']}, rel. L2 {p['rel_l2_vs_gemmi_1e-7']:.2e}")
    for key, r in row["peer_over_ours_p50"].items():
        print(f"  {key:42s} theirs / ours (p50) {r:6.2f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--structures", nargs="+", default=["1aki", "5h73", "3wip"], choices=sorted(STRUCTURES))
    p.add_argument("--cores", default="0,1", help="the two logical CPUs this process runs on (default 0,1)")
    p.add_argument("--conditions", nargs="+", default=["quiet", "loaded"], choices=["quiet", "loaded"])
    p.add_argument("--calls", type=int, default=9, help="interleaved rounds per structure and condition")
    p.add_argument("--spacing", type=float, default=0.667)
    p.add_argument("--peer08", default=None, help="pip --target dir of torchref 0.8 (26e407e) + torchref_kernels")
    p.add_argument("--peer070", default=None, help="pip --target dir of torchref 0.7.0 + torchref_kernels")
    p.add_argument("--smoke", action="store_true", help="1aki, 1 call, quiet only (checks the setup and the JSON)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.smoke:
        args.structures, args.calls, args.conditions = ["1aki"], 1, ["quiet"]
    cores = [int(c) for c in args.cores.split(",")]
    if len(cores) != 2:
        p.error(f"--cores takes two logical CPUs, got {args.cores!r}")
    os.sched_setaffinity(0, cores)  # before any thread pool exists: its threads inherit this affinity
    peers = load(args)
    date = datetime.datetime.now(datetime.UTC)
    report: dict = {
        "benchmark": "CPU splat: ours against torchref's CPU path (torchref-kernels), 1 and 2 threads, quiet and loaded",
        "date": date.isoformat(timespec="seconds"),
        "machine": {
            "host": platform.node(),
            "cpu": _cpu_name(),
            "logical_cpus": os.cpu_count(),
            "cores_used": cores,
            "busy_core": cores[1],
            "python": platform.python_version(),
            "torch": torch.__version__,
        },  # fmt: skip
        "peers": {
            k: {kk: vv for kk, vv in v.items() if kk in ("torchref_kernels", "error", "cpu_error")}
            for k, v in peers.items()
        },  # fmt: skip
        "spacing": args.spacing,
        "calls": args.calls,
        "smoke": args.smoke,
        "note": "medians (p50) of interleaved calls; ratios are theirs / ours (> 1: ours faster); torchref's radii "
        "computed outside the timed call; equal accuracy: relative L2 against gemmi at cutoff 1e-7 at most ours",
        "conditions": {},
    }
    if args.out is None:
        tag = "smoke" if args.smoke else "devvm"
        args.out = ROOT / "benchmarks" / "results" / f"peers_cpu_{tag}_{date.date()}.json"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    setups = []
    for name in args.structures:
        try:
            setups.append(setup_structure(name, peers, args.spacing))
        except Exception as exc:
            report.setdefault("errors", {})[name] = error_record(exc)
    for condition in args.conditions:
        busy, _ = _busy_fraction()
        entry = {"loadavg_before": os.getloadavg(), "busy_before": {c: round(b, 3) for c, b in busy.items()},
                 "quiet_enough": all(busy.get(c, 0.0) < QUIET_BUSY for c in cores)}  # fmt: skip
        print(f"{condition}: load average {entry['loadavg_before']}, cores busy {entry['busy_before']}", flush=True)
        if condition == "loaded":
            with BusyCore(cores[1]):
                rows = run_condition(setups, args.calls)
        else:
            rows = run_condition(setups, args.calls)
        entry["loadavg_after"] = os.getloadavg()
        entry["results"] = rows
        entry["targets"] = _targets(rows)
        report["conditions"][condition] = entry
        for row in rows:
            _print(condition, row)
        for key, t in entry["targets"].items():
            print(f"  target 3wip {key}: {t['value']:.2f} ({t['target']}) {'pass' if t['pass'] else 'FAIL'}")
        args.out.write_text(json.dumps(report, indent=1) + "\n")  # after each condition: a long run keeps what it has
        print(f"wrote {args.out}", flush=True)
    if args.smoke:
        ok = all(r["peer_over_ours_p50"] for c in report["conditions"].values() for r in c["results"])
        print("smoke:", "ok" if ok and "errors" not in report else "FAILED")
        return 0 if ok and "errors" not in report else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
