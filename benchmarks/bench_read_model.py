"""Time :func:`kernels.read_model` on bundled structures (the file checks plus gemmi's read).

Each mmCIF is also written decompressed and as PDB (gemmi's writer, with its ANISOU records) in
a temporary folder, so every path is timed. Each file is read ``--repeats`` times after one
warm-up read, one torch thread; the median and minimum of the process's CPU time (steadier
than wall time on a shared machine) and the median wall time are printed in milliseconds and,
with ``--json``, written to a file.

To compare two checkouts, run this script under each in turn, a few times, alternating:

    OMP_NUM_THREADS=1 PYTHONPATH=<checkout> python benchmarks/bench_read_model.py --repeats 21
"""

from __future__ import annotations

import argparse
import gzip
import json
import platform
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import gemmi
import torch

import kernels

ROOT = Path(__file__).resolve().parents[1]
FILES = tuple(ROOT / p for p in ("kernels/data/1aki.cif.gz", "tests/data/3wip.cif.gz", "tests/data/3o5r.cif.gz"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for gz in FILES:
            plain = Path(tmp) / gz.name[:-3]
            plain.write_bytes(gzip.decompress(gz.read_bytes()))
            as_pdb = Path(tmp) / (gz.name[:-7] + ".pdb")
            structure = gemmi.read_structure(str(gz))
            structure.setup_entities()
            structure.write_pdb(str(as_pdb))
            paths += [gz, plain, as_pdb]
        for path in paths:
            cpu, wall = [], []
            for i in range(args.repeats + 1):
                start_cpu, start_wall = time.process_time(), time.perf_counter()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    model = kernels.read_model(path, on_bad_adp="iso")  # 3O5R has one U not positive definite
                if i:
                    cpu.append((time.process_time() - start_cpu) * 1e3)
                    wall.append((time.perf_counter() - start_wall) * 1e3)
            row = dict(
                file=path.name,
                atoms=len(model),
                cpu_ms_median=statistics.median(cpu),
                cpu_ms_min=min(cpu),
                wall_ms_median=statistics.median(wall),
            )
            rows.append(row)
            print(
                f"{path.name:14s} {len(model):6d} atoms  CPU median {row['cpu_ms_median']:7.2f} ms "
                f"(min {row['cpu_ms_min']:.2f})  wall median {row['wall_ms_median']:7.2f} ms"
            )
    if args.json:
        args.json.write_text(
            json.dumps(dict(host=platform.node(), repeats=args.repeats, torch_threads=1, rows=rows), indent=1)
        )


if __name__ == "__main__":
    main()
