"""Model and map files are read as a bounded stream: bad content is refused early, in little memory.

The memory cases run in a fresh process each and report its peak resident set size (VmHWM,
Linux), after importing kernels and after the read: the figures the issue measured.
The other cases run here, on small files and a small ``max_bytes``.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import kernels

ROOT = Path(__file__).resolve().parents[2]
CELL = "CRYST1   30.000   40.000   50.000  90.00  90.00  90.00 P 1           1\n"
ATOM = "ATOM      1  N   ALA A   1       1.000   2.000   3.000  1.00 10.00           N\n"
MiB = 1 << 20

PEAK = """
import json, sys, time
import kernels

def high_water_kib():
    # VmHWM: this process's peak RSS. Not ru_maxrss: Linux carries that over fork and exec, so a
    # child of a large pytest process would report the parent's size.
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))

kw = json.loads(sys.argv[2])
base = high_water_kib()
start = time.perf_counter()
try:
    kernels.read_model(sys.argv[1], **kw)
    message = None
except kernels.ModelError as exc:
    message = str(exc)
print(json.dumps(dict(message=message, seconds=time.perf_counter() - start, base_kib=base,
                      peak_kib=high_water_kib())))
"""


def read_in_fresh_process(path: Path, **kw) -> dict:
    """``read_model(path, **kw)`` in a new Python: its message and the process's peak RSS in MiB."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-c", PEAK, str(path), json.dumps(kw)], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["peak_mib"] = result["peak_kib"] / 1024
    result["growth_mib"] = (result["peak_kib"] - result["base_kib"]) / 1024
    return result


def repeated_gzip(path: Path, piece: bytes, times: int) -> None:
    """A multi-member gzip holding ``piece`` ``times`` times, written in a moment.

    Each member is the same compressed bytes, so a gigabyte of text costs a megabyte of disk and
    no compression time; its trailer records only the last member's size, as a cut-and-joined
    (or hostile) file's would.
    """
    member = gzip.compress(piece, compresslevel=9)
    with open(path, "wb") as f:
        for _ in range(times):
            f.write(member)


# --------------------------------------------------------------------------- memory (fresh processes)


def test_gzip_of_1_5_gb_of_blank_lines_is_refused_in_bounded_memory(tmp_path):
    path = tmp_path / "blank.pdb.gz"
    repeated_gzip(path, b"\n" * (16 * MiB), 90)  # 1.51 GB of newlines in 1.4 MB, the file
    assert path.stat().st_size < 1.5e6
    result = read_in_fresh_process(path)  # the default max_bytes (2 GiB): the file is below it
    assert "of blank text (spaces and newlines) in a row" in result["message"], result
    assert result["peak_mib"] < 500, result  # the target: 3.25 GB before
    assert result["growth_mib"] < 100, result


def test_sparse_3_gb_file_of_nul_bytes_named_pdb_is_refused_at_its_first_block(tmp_path):
    path = tmp_path / "zeros.pdb"
    with open(path, "wb") as f:
        f.truncate(3 * 10**9)  # sparse: no disk used
    result = read_in_fresh_process(path)
    assert "binary data, not PDB or mmCIF text (byte 0x00 at offset 0)" in result["message"], result
    assert result["peak_mib"] < 500, result  # the target: 6.5 GB before
    assert result["growth_mib"] < 100, result


def test_gzip_that_passes_max_bytes_is_refused_before_it_is_held(tmp_path):
    """Plausible text past the limit, with a trailer that understates it: refused, never held."""
    line = b"REMARK   1 THIS LINE IS TEXT AND THE FILE GOES ON FOR LONGER THAN THE LIMIT ALLOWS   \n"
    path = tmp_path / "long.pdb.gz"
    repeated_gzip(path, line * (4 * MiB // len(line)), 24)  # 96 MiB; the trailer says 4 MiB
    limit = 64 * MiB
    result = read_in_fresh_process(path, max_bytes=limit)
    assert f"more than the limit of 64.0 MiB (max_bytes={limit})" in result["message"], result
    assert "pass a larger max_bytes" in result["message"]
    assert result["growth_mib"] < 32, result  # half the limit: the text checked was not kept


# --------------------------------------------------------------------------- limits and early refusals


def write_pdb(path: Path, body_lines: int) -> bytes:
    data = (CELL + ATOM + "REMARK 999 padding\n" * body_lines + "END\n").encode()
    path.write_bytes(data)
    return data


def test_max_bytes_is_the_limit_on_text_stated_in_the_refusal(tmp_path):
    path = tmp_path / "m.pdb"
    size = len(write_pdb(path, 300_000))  # 5.7 MB: more than one block
    assert len(kernels.read_model(path, max_bytes=size)) == 1
    with pytest.raises(
        kernels.ModelError, match=rf"the file holds 5.4 MiB, more than the limit of 4.8 MiB \(max_bytes={5 * 10**6}\)"
    ):
        kernels.read_model(path, max_bytes=5 * 10**6)
    gz = tmp_path / "m.pdb.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    assert len(kernels.read_model(gz, max_bytes=size)) == 1
    with pytest.raises(
        kernels.ModelError, match=r"its gzip trailer records 5.4 MiB of text, more than the limit of 4.8 MiB"
    ):
        kernels.read_model(gz, max_bytes=5 * 10**6)
    joined = tmp_path / "joined.pdb.gz"  # two members: the trailer gives the second's size only
    joined.write_bytes(gzip.compress(path.read_bytes()) + gzip.compress(b"REMARK 999\n"))
    with pytest.raises(kernels.ModelError, match=r"the text after decompressing goes on past 4.8 MiB"):
        kernels.read_model(joined, max_bytes=5 * 10**6)
    for bad in (0, -1, 1.5, "2GB", True):
        with pytest.raises(kernels.ModelError, match="max_bytes must be a positive integer"):
            kernels.read_model(path, max_bytes=bad)


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gzip"])
def test_binary_or_blank_content_after_the_first_block_is_named_with_its_offset(tmp_path, compress):
    head = write_pdb(tmp_path / "head.pdb", 300_000)  # 5.7 MB of good text
    cases = {
        "binary.pdb": (head[:-4] + b"\x00\x01" * 10 + b"END\n", f"byte 0x00 at offset {len(head) - 4}"),
        "blank.pdb": (head[:-4] + b" \n" * (9 * MiB) + b"END\n", "more than 16.0 MiB of blank text"),
    }
    for name, (data, expected) in cases.items():
        path = tmp_path / (name + ".gz" if compress else name)
        path.write_bytes(gzip.compress(data) if compress else data)
        with pytest.raises(kernels.ModelError, match=expected):
            kernels.read_model(path)


def test_text_that_is_not_a_model_is_refused_after_its_first_mib(tmp_path):
    path = tmp_path / "notes.pdb"  # 3 MB of prose named .pdb, with an ATOM line at its end
    path.write_bytes(b"Dear colleague, here is the structure.\n" * 80_000 + CELL.encode() + ATOM.encode())
    with pytest.raises(kernels.ModelError, match=r"none of its lines in its first 1.0 MiB is a PDB record"):
        kernels.read_model(path)


def test_mmcif_saved_as_pdb_says_it_looks_like_mmcif(tmp_path):
    """Whether or not its atom_site rows start with ATOM, and however long its header is."""
    text = gzip.decompress(kernels.example_structure("1aki").read_bytes())
    for name, data in (("1aki.pdb", text), ("1aki.ent.gz", gzip.compress(text)), ("noheader.pdb", text[10:])):
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(kernels.ModelError, match=r"this looks like mmCIF.*not PDB: rename the file to \.cif"):
            kernels.read_model(path)


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda tmp: Path(os.devnull), "the null device (it reads as empty), not a file"),
        (lambda tmp: tmp, "a folder, not a file"),
        (lambda tmp: (os.mkfifo(tmp / "fifo.pdb"), tmp / "fifo.pdb")[1], "a pipe (FIFO), not a regular file"),
        (lambda tmp: ((tmp / "link.pdb").symlink_to("gone.pdb"), tmp / "link.pdb")[1],
         "a link to gone.pdb, which does not exist"),
    ],
    ids=["dev-null", "folder", "fifo", "dangling-link"],
)  # fmt: skip
def test_a_path_that_is_not_a_regular_file_says_what_it_is(tmp_path, make, expected):
    path = make(tmp_path)
    with pytest.raises(kernels.ModelError, match="^" + re.escape(f"{path}: {expected}")):
        kernels.read_model(path)
    with pytest.raises(ValueError, match="^" + re.escape(f"{path}: {expected}")):
        kernels.read_map(path)


# --------------------------------------------------------------------------- maps


def test_map_describing_more_than_max_bytes_is_refused_before_it_is_read(tmp_path):
    cell = kernels.Cell.from_parameters(30, 30, 30)
    grid = kernels.GridSpec(cell, (64, 64, 64))
    path = kernels.write_map(tmp_path / "m.ccp4", torch.ones(grid.shape), grid)
    rho, _ = kernels.read_map(path, max_bytes=64**3 * 4)
    assert rho.shape == (64, 64, 64)
    with pytest.raises(ValueError, match=r"64×64×64 values of mode 2, 1.0 MiB of data, more than the limit of 0.5 MiB"):
        kernels.read_map(path, max_bytes=2**19)
    empty = tmp_path / "empty.ccp4"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty.ccp4: the file is empty \(0 bytes\), too short for a CCP4/MRC map"):
        kernels.read_map(empty)
    with pytest.raises(ValueError, match="max_bytes must be a positive integer"):
        kernels.read_map(path, max_bytes=0)


def test_valid_files_read_the_same_at_any_block_boundary(tmp_path):
    """A structure larger than one block reads as gemmi reads it, plain or gzip."""
    import gemmi

    source = kernels.example_structure("1aki")
    st = gemmi.read_structure(str(source))
    text = st.make_pdb_string()
    text = text.replace("END", "REMARK 999 padding\n" * 250_000 + "END", 1)  # ~5 MB: two blocks
    for name, data in (("big.pdb", text.encode()), ("big.pdb.gz", gzip.compress(text.encode()))):
        path = tmp_path / name
        path.write_bytes(data)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the space group note
            model = kernels.read_model(path)
        assert len(model) == st[0].count_atom_sites()
        assert np.allclose(model.atoms.xyz.numpy(), [cra.atom.pos.tolist() for cra in st[0].all()], atol=1e-3)
