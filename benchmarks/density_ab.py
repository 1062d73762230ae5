"""Two trees' density splat side by side: eager and compiled (fullgraph), forward and forward+backward.

For a change to how the density ops are defined or launched: the code before (``--before DIR``, a
checkout of another commit) and after (``--after DIR``, default this checkout) each run in a worker
process of their own, both alive for the whole run, on the same device. After both have built their
inputs and compiled their functions (in parallel), the coordinator asks them in turn for blocks of
timed calls — before, after, after, before, … — so the host's and the GPU's drift meets both alike.
Both workers are pinned to the same cores (the last ``--threads`` of this process's), where they take
turns. The run's noise floor is the same program with one tree on both sides (``--before`` equal to
``--after``): after/before ratios of such an A/A run are what chance alone gives.

Per structure (1aki, 5h73, 3wip by default) and ADP model (``iso``: B only; ``aniso``: the
structure's U, as ``benchmarks/_structures.anisotropic_model`` gives it) on a 0.667 Å grid, float32:

- ``eager_fwd``: ``kernels.splat_density(atoms, grid)`` under ``torch.no_grad()``;
- ``eager_fwd_bwd``: ``(splat_density(atoms.replace(xyz=x, b_iso=b, occ=o), grid) * W).sum().backward()``
  with x, b, o requiring grad (U too for ``aniso``), ``.grad`` cleared before each call;
- ``compiled_fwd`` / ``compiled_fwd_bwd``: the same two functions through
  ``torch.compile(fullgraph=True)`` (inductor).

Each call is timed twice (``benchmarks/_eager.py``'s timers): ``times``, CUDA events around the call,
synchronised after it (what a user's step sees: host and GPU time; the wall clock on a CPU); and on a
GPU ``host_times``, the wall clock of the call alone with a 5 ms sleep kernel queued before it, so that
its kernels wait in the queue and only its host work is timed (the part a change to how ops are defined
or launched moves; the kernels themselves compare with ``scripts/triton_bitwise.py ptx``). The record
has the medians, p10 and p90 of ``--reps`` calls per tree and mode, the ratios after/before (target:
eager ≤ 1.1×) and compiled/eager per tree (target ≤ 1.0×) of each, the compile times, and the largest
difference between the two trees' maps and gradients.

Usage::

    python benchmarks/density_ab.py --before /path/to/before [--after .] [--structures 1aki 5h73 3wip]
        [--adp iso aniso] [--reps 50] [--out X.json]
    TRITON_INTERPRET=1 python benchmarks/density_ab.py --before DIR --smoke   # CPU check, tiny grid
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = ("eager_fwd", "eager_fwd_bwd", "compiled_fwd", "compiled_fwd_bwd")
MARK = "@@density_ab "  # a worker's reply line (anything else it prints passes through)
BLOCK = 10  # timed calls per block


# --------------------------------------------------------------------------- worker (one tree)


def _worker(tree: str) -> None:
    sys.path.insert(0, tree)
    import importlib.util

    import torch

    # The timers of this program's own tree (the trees' benchmarks/ may differ).
    spec = importlib.util.spec_from_file_location("_density_ab_timing", ROOT / "benchmarks" / "_eager.py")
    timing = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(timing)

    import kernels
    from benchmarks._structures import anisotropic_model, model
    from kernels.crystal import GridSpec

    warnings.simplefilter("ignore")
    cases: dict[str, dict] = {}

    def reply(obj) -> None:
        print(MARK + json.dumps(obj), flush=True)

    def sync(device) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def setup(cmd) -> dict:
        device = torch.device(cmd["device"])
        name, adp = cmd["structure"], cmd["adp"]
        m = anisotropic_model(name) if adp == "aniso" else model(name)
        atoms = m.atoms if adp == "aniso" else m.atoms.replace(u_aniso=None, aniso=None)
        atoms = atoms.to(device, torch.float32)
        grid = GridSpec.for_spacing(m.cell, cmd["spacing"])
        if cmd["smoke"]:
            atoms = atoms.select(torch.arange(min(len(atoms), 40), device=device))
        w = torch.randn(grid.shape, generator=torch.Generator().manual_seed(0)).to(device)
        names = ["xyz", "b_iso", "occ"] + (["u_aniso"] if atoms.u_aniso is not None else [])
        leaves = [getattr(atoms, n).detach().clone().requires_grad_(True) for n in names]

        def forward():
            return kernels.splat_density(atoms, grid)

        def loss(*values):
            return (kernels.splat_density(atoms.replace(**dict(zip(names, values))), grid) * w).sum()

        torch._dynamo.reset()
        compiled_forward = torch.compile(forward, fullgraph=True)
        compiled_loss = torch.compile(loss, fullgraph=True)

        def fwd(fn):
            def call():
                with torch.no_grad():
                    return fn()

            return call

        def fwd_bwd(fn):
            def call():
                for leaf in leaves:
                    leaf.grad = None
                fn(*leaves).backward()
                return [leaf.grad for leaf in leaves]

            return call

        calls = {
            "eager_fwd": fwd(forward),
            "eager_fwd_bwd": fwd_bwd(loss),
            "compiled_fwd": fwd(compiled_forward),
            "compiled_fwd_bwd": fwd_bwd(compiled_loss),
        }
        compile_s = {}
        for mode, call in calls.items():
            t0 = time.perf_counter()
            call()  # compiles (compiled modes), caches plans and launchers
            sync(device)
            compile_s[mode] = time.perf_counter() - t0
            for _ in range(3):
                call()
        # The host-time sleep: longer than any call's host time, so that the GPU never waits for the host.
        cases[cmd["key"]] = {"calls": calls, "device": device, "sleep": timing._sleep_cycles(device, 5.0)}
        return {"n_atoms": len(atoms), "grid": list(grid.shape), "first_call_s": compile_s}

    def results(cmd) -> str:
        """Each mode's output (map, or gradients) saved to ``cmd["path"]``, for the comparison of the trees."""
        out = {}
        for mode, call in cases[cmd["key"]]["calls"].items():
            value = call()
            sync(cases[cmd["key"]]["device"])
            out[mode] = [t.detach().cpu() for t in (value if isinstance(value, list) else [value])]
        torch.save(out, cmd["path"])
        return cmd["path"]

    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        try:
            if cmd["cmd"] == "setup":
                reply({"ok": setup(cmd)})
            elif cmd["cmd"] == "time":
                case = cases[cmd["key"]]
                call, device = case["calls"][cmd["mode"]], case["device"]
                ms = [timing.eager_call_ms(call, device) for _ in range(cmd["n"])]
                host = []
                for _ in range(cmd["n"] if device.type == "cuda" else 0):
                    host.append(timing._host_call_ms(call, device, case["sleep"]))
                    sync(device)
                reply({"ok": {"ms": ms, "host_ms": host}})
            elif cmd["cmd"] == "results":
                reply({"ok": results(cmd)})
        except Exception as exc:  # reported to the coordinator, which records it and goes on
            reply({"error": f"{type(exc).__name__}: {exc}"})


# --------------------------------------------------------------------------- coordinator


def _path_with(tree: Path) -> str:
    """``PYTHONPATH`` with ``tree`` first and no other checkout of the project (where dependencies
    come from a ``--target`` folder on the path, that folder stays)."""
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    others = [p for p in inherited if not (Path(p) / "kernels" / "__init__.py").is_file()]
    return os.pathsep.join([str(tree), *others])


def _worker_cores(threads: int) -> set[int] | None:
    """The cores both workers run on: the last ``threads`` this process may use, the same for both trees (they
    take turns), so that neither meets a core the other does not (None where affinity cannot be set)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    return set(cores[-threads:]) if len(cores) > threads else None


class _Worker:
    def __init__(self, label: str, tree: Path, threads: int):
        self.label = label
        env = dict(os.environ, PYTHONPATH=_path_with(tree), OMP_NUM_THREADS=str(threads))
        cores = _worker_cores(threads)
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", str(tree)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=str(tree),
            preexec_fn=None if cores is None else lambda: os.sched_setaffinity(0, cores),
        )

    def send(self, cmd: dict) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def receive(self):
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK) :])
            sys.stderr.write(f"[{self.label}] {line}")
        raise RuntimeError(f"the {self.label} worker ended (exit {self.proc.wait()})")

    def ask(self, cmd: dict):
        self.send(cmd)
        return self.receive()

    def close(self) -> None:
        try:
            self.send({"cmd": "quit"})
        except BrokenPipeError:
            pass
        self.proc.wait(timeout=60)


def _summary(ms: list[float]) -> dict:
    q = statistics.quantiles(ms, n=10) if len(ms) > 1 else [ms[0]] * 9
    return {"median_ms": statistics.median(ms), "p10_ms": q[0], "p90_ms": q[-1], "n": len(ms)}


def _max_diff(a, b) -> float:
    """The largest |after − before| over the tensors of one mode."""
    return max(float((x.double() - y.double()).abs().max()) if x.numel() else 0.0 for x, y in zip(a, b))


def run(args) -> dict:
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    trees = {"before": Path(args.before).resolve(), "after": Path(args.after).resolve()}
    workers = {label: _Worker(label, tree, args.threads) for label, tree in trees.items()}
    scratch = tempfile.mkdtemp(prefix="density_ab_")
    record = {
        "command": " ".join(sys.argv),
        "trees": {k: str(v) for k, v in trees.items()},
        "commits": {k: _commit(v) for k, v in trees.items()},
        "device": device,
        "torch": torch.__version__,
        "load_average_start": os.getloadavg(),
        "worker_cores": sorted(_worker_cores(args.threads) or []),
        "cases": [],
    }
    try:
        for name in args.structures:
            for adp in args.adp:
                key = f"{name}/{adp}"
                cmd = {"cmd": "setup", "key": key, "structure": name, "adp": adp, "device": device,
                       "spacing": args.spacing, "smoke": args.smoke}  # fmt: skip
                for w in workers.values():  # both build and compile at once
                    w.send(cmd)
                setups = {label: w.receive() for label, w in workers.items()}
                case = {"case": key, "setup": setups}
                if any("error" in s for s in setups.values()):
                    record["cases"].append(case)
                    print(f"{key}: setup failed {setups}", flush=True)
                    continue
                times = {label: {m: [] for m in MODES} for label in workers}
                host = {label: {m: [] for m in MODES} for label in workers}
                order = list(workers)
                for r in range(max(1, args.reps // BLOCK)):
                    for mode in MODES:
                        for label in order if r % 2 == 0 else order[::-1]:
                            got = workers[label].ask({"cmd": "time", "key": key, "mode": mode, "n": BLOCK})
                            times[label][mode].extend(got.get("ok", {}).get("ms", []))
                            host[label][mode].extend(got.get("ok", {}).get("host_ms", []))
                case["times"] = {label: {m: _summary(v) for m, v in t.items() if v} for label, t in times.items()}
                case["ratios"] = _ratios(case["times"])
                if any(v for t in host.values() for v in t.values()):
                    case["host_times"] = {label: {m: _summary(v) for m, v in t.items() if v} for label, t in host.items()}
                    case["host_ratios"] = _ratios(case["host_times"])
                paths = {label: str(Path(scratch) / f"{label}.pt") for label in workers}
                got = {
                    label: w.ask({"cmd": "results", "key": key, "path": paths[label]}) for label, w in workers.items()
                }
                if all("ok" in g for g in got.values()):
                    outs = {label: torch.load(path) for label, path in paths.items()}
                    case["max_abs_diff_after_before"] = {
                        m: _max_diff(outs["before"][m], outs["after"][m]) for m in MODES
                    }
                record["cases"].append(case)
                _print(key, case)
    finally:
        for w in workers.values():
            w.close()
    record["load_average_end"] = os.getloadavg()
    return record


def _ratios(times: dict) -> dict:
    out = {}
    for mode in MODES:
        if mode in times["before"] and mode in times["after"]:
            out[f"{mode}_after_over_before"] = times["after"][mode]["median_ms"] / times["before"][mode]["median_ms"]
    for label, t in times.items():
        for kind in ("fwd", "fwd_bwd"):
            if f"compiled_{kind}" in t and f"eager_{kind}" in t:
                out[f"{label}_compiled_over_eager_{kind}"] = (
                    t[f"compiled_{kind}"]["median_ms"] / t[f"eager_{kind}"]["median_ms"]
                )
    return out


def _print(key: str, case: dict) -> None:
    t = case["times"]
    cells = "  ".join(
        f"{m}: {t['before'][m]['median_ms']:.3f} → {t['after'][m]['median_ms']:.3f} ms"
        for m in MODES
        if m in t["before"] and m in t["after"]
    )
    print(f"{key}: {cells}", flush=True)
    h = case.get("host_times")
    if h:
        cells = "  ".join(
            f"{m}: {h['before'][m]['median_ms']:.3f} → {h['after'][m]['median_ms']:.3f} ms"
            for m in MODES
            if m in h["before"] and m in h["after"]
        )
        print(f"{key} host: {cells}", flush=True)


def _commit(tree: Path) -> str | None:
    """The tree's commit; None for a tree that is no checkout of its own (an export inside another
    checkout would otherwise report that checkout's commit)."""
    if not (Path(tree) / ".git").exists():
        return None
    try:
        return subprocess.run(
            ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", help="checkout of the code before (its kernels/ and benchmarks/)")
    ap.add_argument("--after", default=str(ROOT), help="checkout of the code after (default: this one)")
    ap.add_argument("--structures", nargs="+", default=["1aki", "5h73", "3wip"])
    ap.add_argument("--adp", nargs="+", choices=("iso", "aniso"), default=["iso", "aniso"])
    ap.add_argument("--spacing", type=float, default=2.0 / 3.0)
    ap.add_argument("--reps", type=int, default=50, help="timed calls per tree and mode (blocks of 10)")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads of each worker")
    ap.add_argument("--smoke", action="store_true", help="40 atoms per structure (a CPU check of the program)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args.worker)
        return 0
    if not args.before:
        ap.error("--before DIR is required: a checkout of the code to compare against")
    record = run(args)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1))
        print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
