"""Time :func:`kernels.read_model` on bundled structures (the file checks plus gemmi's read).

Each file is read ``--repeats`` times after one warm-up read; the median and the spread are
printed in milliseconds. Each mmCIF is also written decompressed and as PDB (gemmi's writer,
with its ANISOU records) in a temporary folder, so every path is timed.

    python benchmarks/bench_read_model.py --repeats 7
"""

from __future__ import annotations

import argparse
import gzip
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import gemmi

import kernels

ROOT = Path(__file__).resolve().parents[1]
FILES = tuple(ROOT / p for p in ("kernels/data/1aki.cif.gz", "tests/data/3wip.cif.gz", "tests/data/3o5r.cif.gz"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
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
            times = []
            for i in range(args.repeats + 1):
                start = time.perf_counter()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    model = kernels.read_model(path, on_bad_adp="iso")
                if i:
                    times.append((time.perf_counter() - start) * 1e3)
            print(
                f"{path.name:14s} {len(model):6d} atoms  median {statistics.median(times):7.1f} ms  "
                f"(min {min(times):.1f}, max {max(times):.1f}, {args.repeats} reads)"
            )


if __name__ == "__main__":
    main()
