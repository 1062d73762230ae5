"""``bench_ensemble.py --stream-cpu``: a trajectory streamed from a DCD on the CPU against the in-memory rate.

Issue 37's CPU target: on a 2-core machine, a 10⁴-frame trajectory of 1AKI streams in bounded memory
at ≥ 90 % of the in-memory rate. The frames (1AKI's positions plus seeded N(0, σ²) displacements,
as the ensemble benchmark makes them) are written to a DCD with MDAnalysis, its topology a PDB that
gemmi writes from the same file. Then, each in a fresh process at ``OMP_NUM_THREADS`` threads (2 by
default) so that its ``ru_maxrss`` is its own:

- ``decode``: the DCD read chunk by chunk through ``kernels.frames_from``, nothing splatted;
- ``memory``: the frames read whole into one (F, N, 3) tensor first, then ONE timed
  ``splat_ensemble(atoms, xyz, grid)`` (``reduce="sum"``, forward, ``no_grad``): the in-memory rate;
- ``stream``: ONE timed ``splat_ensemble(atoms, frames_from(dcd, top, chunk=C), grid)``, which
  reads, prefetches and splats chunk by chunk;
- ``memory`` again, to show how much the shared machine's load moved the rate meanwhile.

Every process first splats 20 frames untimed (the kernel's first-call costs), records its resident
memory then (``rss_setup_mib``, VmRSS) and resets its peak (``/proc/self/clear_refs``), so
``peak_rss_mib`` (VmHWM at the end) is the peak of the measured phase — for ``memory`` the frames
read into memory and the splat, for ``stream`` the streamed splat — and ``growth_mib`` what that
phase added. Frames per second are wall clock of the one call; on a shared machine its CPU time
(``cpu_s``, every thread of the process) is the steadier figure of the work done, and
``frames_per_cpu_s`` is given beside it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
TARGET = 0.9
#: The measured processes in order; in-memory and streamed alternate, so a change of the machine's load shows.
RUNS = ("decode", "memory", "stream", "memory_again", "stream_again")


def _status_mib(key: str) -> float:
    """``VmRSS`` (resident now) or ``VmHWM`` (its peak) of this process from /proc, in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024.0
    raise KeyError(key)


def _reset_peak() -> bool:
    """Set this process's peak RSS (VmHWM) back to its RSS now (Linux ≥ 4.0); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def write_trajectory(folder: Path, name: str, n_frames: int, sigma: float, per_write: int = 1000) -> tuple[Path, Path]:
    """``(topology, dcd)`` of ``n_frames`` seeded frames of structure ``name``, written ``per_write`` frames at a time."""
    import gemmi
    import MDAnalysis

    from benchmarks._structures import STRUCTURES, model

    m = model(name)
    top = folder / f"{name}.pdb"
    st = gemmi.read_structure(str(STRUCTURES[name]))
    st.setup_entities()
    st.write_pdb(str(top))
    dcd = folder / f"{name}_{n_frames}.dcd"
    n = len(m.atoms)
    u = MDAnalysis.Universe.empty(n, trajectory=True)
    gen = torch.Generator().manual_seed(0)
    xyz0 = m.atoms.xyz.to(torch.float64)
    with MDAnalysis.Writer(str(dcd), n) as writer:
        for lo in range(0, n_frames, per_write):
            count = min(per_write, n_frames - lo)
            part = (xyz0[None] + sigma * torch.randn((count, n, 3), generator=gen, dtype=torch.float64)).float()
            for frame in part.numpy():
                u.atoms.positions = frame
                u.dimensions = m.cell.parameters
                writer.write(u.atoms)
    return top, dcd


def child(mode: str, name: str, top: str, dcd: str, spacing: float, chunk: int) -> dict:
    """One measurement in this process (see the module docstring); returns its record."""
    import kernels
    from benchmarks._structures import model

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    m = model(name)
    atoms = m.atoms.to("cpu", torch.float32)
    grid = kernels.GridSpec.for_spacing(m.cell, spacing)
    src = kernels.frames_from(dcd, top, chunk=chunk)
    with torch.no_grad():
        kernels.splat_ensemble(atoms, next(kernels.frames_from(dcd, top, chunk=20).chunks()), grid)
    rec = {"mode": mode, "frames": src.n_frames, "atoms": src.n_atoms, "rss_setup_mib": _status_mib("VmRSS")}
    rec["peak_reset"] = _reset_peak()
    cpu0 = time.process_time()
    with torch.no_grad():
        if mode == "decode":
            t0 = time.perf_counter()
            count = sum(c.shape[0] for c in src.chunks())
            seconds = time.perf_counter() - t0
        elif mode == "memory":
            xyz = torch.cat(list(src.chunks()))
            rec["rss_frames_loaded_mib"] = _status_mib("VmRSS")
            t0 = time.perf_counter()
            kernels.splat_ensemble(atoms, xyz, grid)
            seconds, count = time.perf_counter() - t0, xyz.shape[0]
        else:
            t0 = time.perf_counter()
            kernels.splat_ensemble(atoms, src, grid)
            seconds, count = time.perf_counter() - t0, src.n_frames
    cpu = time.process_time() - cpu0
    rec.update(
        seconds=seconds,
        frames_per_s=count / seconds,
        cpu_s=cpu,
        frames_per_cpu_s=count / cpu,
        peak_rss_mib=_status_mib("VmHWM"),
        threads=torch.get_num_threads(),
        chunk=chunk if mode != "memory" else None,
    )
    rec["growth_mib"] = rec["peak_rss_mib"] - rec["rss_setup_mib"]
    return rec


def stream_cpu(n_frames: int, spacing: float, sigma: float, chunk: int, name: str = "1aki", threads: int = 2) -> dict:
    """The whole measurement: write the DCD, run decode/memory/stream/memory in fresh processes; the record."""
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(threads),
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    with tempfile.TemporaryDirectory(prefix="stream_cpu_") as tmp:
        t0 = time.perf_counter()
        top, dcd = write_trajectory(Path(tmp), name, n_frames, sigma)
        runs = {"write_dcd_s": time.perf_counter() - t0, "dcd_bytes": dcd.stat().st_size}
        for key in RUNS:
            mode = key.split("_")[0]
            cmd = [sys.executable, __file__, mode, name, str(top), str(dcd), str(spacing), str(chunk)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
            if proc.returncode != 0:
                runs[key] = {"error": proc.stderr[-2000:]}
                continue
            runs[key] = json.loads(proc.stdout.strip().splitlines()[-1])

    def mean(mode: str, key: str) -> float | None:
        values = [r[key] for k, r in runs.items() if k.split("_")[0] == mode and isinstance(r, dict) and key in r]
        return sum(values) / len(values) if values else None

    ratios = {}
    for key in ("frames_per_s", "frames_per_cpu_s"):
        m, s = mean("memory", key), mean("stream", key)
        ratios[key] = s / m if m and s else None
    positions_mib = n_frames * runs.get("stream", {}).get("atoms", 0) * 12 / 2**20
    return {
        "case": f"{name}, {n_frames} frames from a DCD, {threads} threads, spacing {spacing:.3f} Å, chunk {chunk}",
        "target": f"streamed ≥ {TARGET:.0%} of the in-memory rate, bounded memory",
        "positions_mib": positions_mib,
        **runs,
        "stream_vs_memory": ratios["frames_per_s"],
        "stream_vs_memory_cpu": ratios["frames_per_cpu_s"],
        "ratio_of": "mean streamed rate / mean in-memory rate over the alternating runs",
    }


def print_stream(rec: dict) -> None:
    print(rec["case"])
    for key in RUNS:
        r = rec.get(key, {})
        if "error" in r:
            print(f"  {key:13s} ERROR {r['error'][-300:]}")
            continue
        print(
            f"  {key:13s} {r['frames_per_s']:8.1f} frames/s ({r['frames_per_cpu_s']:7.1f} per CPU-s) {r['seconds']:7.1f} s"
            f"  peak RSS {r['peak_rss_mib']:6.0f} MiB (+{r['growth_mib']:.0f} MiB over setup)"
        )
    print(
        f"  positions of every frame: {rec['positions_mib']:.0f} MiB; streamed/in-memory: wall "
        f"{rec['stream_vs_memory']}, CPU time {rec['stream_vs_memory_cpu']}"
    )


if __name__ == "__main__":
    mode, name, top, dcd, spacing, chunk = sys.argv[1:7]
    print(json.dumps(child(mode, name, top, dcd, float(spacing), int(chunk))))
