"""``python -m workbench …`` on bad input: one line on stderr, no traceback, exit 0/1/2.

2 is a usage error (arguments; checked before any work, nothing printed on stdout),
1 any other failure (a bad model file), 0 success. Run as a subprocess, as a person would.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CELL = "CRYST1   30.000   40.000   50.000  90.00  90.00  90.00 P 1           1\n"
ATOM = "ATOM      1  N   ALA A   1       1.000   2.000   3.000  1.00 10.00           N\n"


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), WORKBENCH_NOTEBOOK_DIR=str(cwd / "notebooks"))
    return subprocess.run(
        [sys.executable, "-m", "workbench", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.fixture
def files(tmp_path):
    (tmp_path / "negative.pdb").write_text(CELL.replace("   30.000", "  -30.000") + ATOM)
    (tmp_path / "letters.pdb").write_text(CELL + ATOM.replace("   1.000", "  1O.OOO"))
    (tmp_path / "nocell.pdb").write_text(ATOM)
    (tmp_path / "afile").write_text("x")
    (tmp_path / "empty.cif").write_text("")
    (tmp_path / "empty.pdb").write_text("")
    (tmp_path / "blank.pdb").write_text("\n\n   \n")
    os.mkfifo(tmp_path / "pipe.pdb")  # never opened: the check looks at the path only
    (tmp_path / "dangling.pdb").symlink_to("gone.pdb")
    (tmp_path / "null.ccp4").symlink_to("/dev/null")
    (tmp_path / "pipelink.ccp4").symlink_to("pipe.pdb")
    listening = socket.socket(socket.AF_UNIX)
    listening.bind(str(tmp_path / "socket.ccp4"))
    listening.close()  # the socket file stays
    (tmp_path / "narrow.pdb").write_text(CELL.replace("   30.000", "  0.00020") + ATOM)
    (tmp_path / "far.cif").write_text(
        "data_far\nloop_\n"
        + "".join(
            f"_atom_site.{c}\n"
            for c in "group_PDB id type_symbol label_atom_id label_alt_id label_comp_id label_asym_id label_seq_id "
            "Cartn_x Cartn_y Cartn_z occupancy B_iso_or_equiv".split()
        )
        + "ATOM 1 C CA . ALA A 1 3000000000.0 2.0 3.0 1.00 20.0\nATOM 2 C CB . ALA A 1 3000000001.5 2.0 3.0 1.00 20.0\n"
    )
    (tmp_path / "models.pdb").write_text(CELL + "MODEL        1\n" + ATOM + "ENDMDL\nEND\n")
    (tmp_path / "mmcif.pdb").write_text(
        "data_x\n_cell.length_a 30\nloop_\n_atom_site.group_PDB\n_atom_site.id\n"
        "ATOM   1    N N   . ALA A 1 1   ? 1.0 2.0 3.0 1.00 10.0 ? 1 ALA A N 1\n"
    )
    return tmp_path


USAGE = [
    (["splat", "--radius", "-2"], "--radius: must be a positive finite number of Å, got '-2'"),
    (["splat", "--spacing", "nan"], "--spacing: must be a positive finite number of Å, got 'nan'"),
    (["splat", "--spacing", "0.5x"], "--spacing: must be a number of Å, got '0.5x'"),
    (["splat", "--cutoff", "0"], "--cutoff: must be a positive finite number of the map's unit, got '0'"),
    (["splat", "--box-padding", "inf"], "--box-padding: must be a positive finite number of Å, got 'inf'"),
    (["splat", "nocell.pdb", "--box-padding", "1e-3"], "--box-padding 0.001 Å builds a box 0.002 Å wide along x"),
    (["splat", "nocell.pdb", "--box-padding", "0.2"], "narrower than one atom (at least 0.5 Å)"),
    (["splat", "--out", "missing/map.ccp4"], "the folder missing does not exist"),
    (["splat", "--out", "."], "--out .: a folder, not a file"),
    # an output goes only to a regular file or a new path: what it would replace otherwise is refused
    (["splat", "--out", "pipe.pdb"], "--out pipe.pdb: a pipe (FIFO), not a regular file"),
    (["splat", "--out", "/dev/null"], "--out /dev/null: the null device, not a regular file"),
    (["splat", "--out", "null.ccp4"], "--out null.ccp4: a link to /dev/null, which is the null device"),
    (["splat", "--out", "pipelink.ccp4"], "a link to pipe.pdb, which is a pipe (FIFO), not a regular file"),
    (["splat", "--out", "socket.ccp4"], "--out socket.ccp4: a socket, not a regular file"),
    (
        ["splat", "--out", "x" * 300 + ".ccp4"],
        "a name in the path is 305 bytes long, more than the 255 this file system takes",
    ),
    (["splat", "--out", "x" * 300 + "/map.ccp4"], "a name in the path is 300 bytes long"),
    (["ensemble", "--out", "/dev/null", "models.pdb"], "--out /dev/null: the null device, not a regular file"),
    (["ensemble", "--out", "pipe.pdb", "models.pdb"], "--out pipe.pdb: a pipe (FIFO), not a regular file"),
    (["splat", "--out", "afile/map.ccp4"], "the folder afile is not a folder"),
    (["splat", "absent.pdb"], "model absent.pdb: no such file"),
    (["splat", "/dev/null"], "model /dev/null: the null device (it reads as empty), not a file"),
    (["splat", "."], "model .: a folder, not a file"),
    (["splat", "pipe.pdb"], "model pipe.pdb: a pipe (FIFO), not a regular file"),
    (["splat", "dangling.pdb"], "model dangling.pdb: a link to gone.pdb, which does not exist"),
    (["splat", "afile/m.pdb"], "model afile/m.pdb: no such file (a part of its path is a file, not a folder)"),
    (["ensemble", "/dev/null"], "frames /dev/null: the null device (it reads as empty), not a file"),
    (["splat", "--bogus"], "unrecognized arguments: --bogus"),
    (["lab", "--port", "0"], "a port is a whole number in 1-65535"),
    (["app", "--port", "http"], "a port is a whole number in 1-65535"),
    (["lab", "--dir", "afile", "--no-browser"], "exists and is not a folder"),
    (["app", "--dir", "afile", "--no-browser"], "exists and is not a folder"),
]


@pytest.mark.parametrize("args, expected", USAGE, ids=[" ".join(a) for a, _ in USAGE])
def test_usage_errors_exit_2_before_any_work(files, args, expected):
    r = run(*args, cwd=files)
    assert r.returncode == 2, r.stderr
    assert expected in r.stderr and "Traceback" not in r.stderr
    assert r.stdout == ""  # nothing was computed or printed before the refusal
    assert not (files / "map.ccp4").exists()
    # what an --out named is as it was: a pipe, a link to the null device, a socket
    assert stat.S_ISFIFO(os.stat(files / "pipe.pdb").st_mode) and os.readlink(files / "null.ccp4") == "/dev/null"
    assert stat.S_ISSOCK(os.stat(files / "socket.ccp4").st_mode) and stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_port_in_use_is_a_usage_error(files):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for command in ("lab", "app"):
            r = run(command, "--port", str(port), "--no-browser", cwd=files)
            assert r.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in r.stderr, r.stderr
            assert "Traceback" not in r.stderr


FAILURES = [
    (["splat", "negative.pdb"], ["negative.pdb", "impossible unit cell in CRYST1", "a = -30 Å"]),
    (["splat", "letters.pdb"], ["letters.pdb", "line 2", "x coordinate", "'1O.OOO'"]),
    (["splat", "empty.cif"], ["empty.cif", "empty (0 bytes)"]),
    (["splat", "empty.pdb"], ["empty.pdb", "empty (0 bytes)"]),
    (["splat", "blank.pdb"], ["blank.pdb", "only whitespace"]),
    (["splat", "mmcif.pdb"], ["mmcif.pdb", "this looks like mmCIF", "rename the file to .cif"]),
    (["splat", "nocell.pdb"], ["nocell.pdb", "no unit cell", "--box-padding"]),
    (["splat", "narrow.pdb"], ["narrow.pdb", "unit cell too narrow for an atom", "b–c faces are 0.0002 Å apart"]),
    # the atoms 3·10⁹ Å from the origin: the map's origin needs more than the header's int32, said before the splat
    (["splat", "far.cif", "--box-padding", "3"], ["far.cif", "does not fit the CCP4 header's 32-bit words"]),
    (["splat", "--blur", "1e300"], ["blur=1e+300 Å² is beyond the range"]),
]


@pytest.mark.parametrize("args, expected", FAILURES, ids=[" ".join(a[1:]) for a, _ in FAILURES])
def test_bad_model_exits_1_with_one_line(files, args, expected):
    r = run(*args, cwd=files)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1
    for part in expected:
        assert part in r.stderr
    assert not (files / "map.ccp4").exists()
    if "far.cif" in args:
        assert "splat " not in r.stdout  # refused before the work


@pytest.fixture(scope="module")
def trajectories(tmp_path_factory):
    """A good DCD with its topology, and damaged copies: a bad header, a cut first frame, a damaged last frame."""
    import struct

    from tests.distributed._frames import write_trajectory

    folder = tmp_path_factory.mktemp("trajectories")
    _, top, dcd = write_trajectory(folder, 4)
    data = dcd.read_bytes()
    natom = 4 + 84 + 4 + 4 + struct.unpack("<i", data[92:96])[0] + 4 + 4
    header, frame = natom + 8, 56 + 3 * (8 + 4 * 9)
    for name, value in (("neg", -7), ("max", 2**31 - 1)):
        (folder / f"{name}.dcd").write_bytes(data[:natom] + struct.pack("<i", value) + data[natom + 4 :])
    (folder / "cut1.dcd").write_bytes(data[: header + frame // 2])
    last = bytearray(data)
    at = header + 3 * frame + 56 + 4 + 4 * 9  # frame 4's X record, its closing byte count
    last[at : at + 4] = (1234).to_bytes(4, "little")
    (folder / "lastbad.dcd").write_bytes(bytes(last))
    return folder


@pytest.mark.parametrize(
    "name, expected",
    [
        ("neg", "neg.dcd: the DCD header gives -7 atoms (NATOM, bytes"),
        ("max", "max.dcd: the DCD header gives 2147483647 atoms (NATOM"),
        ("cut1", "cut1.dcd: the DCD is cut inside frame 1: it holds 94 of that frame's 188 bytes"),
        ("lastbad", "lastbad.dcd: frame 4 of 4 cannot be read"),
    ],
)
def test_a_damaged_trajectory_is_one_line_without_mdanalysis_noise(trajectories, name, expected):
    r = run("ensemble", f"{name}.dcd", "--topology", "top.pdb", "--no-progress", cwd=trajectories)
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith(f"error: {expected}") and r.stderr.count("\n") == 1, r.stderr
    assert "Exception ignored" not in r.stderr and "Traceback" not in r.stderr
    assert not (trajectories / "map.ccp4").exists()


def test_success_exits_0_and_box_padding_reads_a_model_without_a_cell(files):
    r = run("splat", "nocell.pdb", "--box-padding", "4", "--backend", "reference", "--spacing", "1", cwd=files)
    assert r.returncode == 0, r.stderr
    assert "built a P 1 box" in r.stdout and (files / "map.ccp4").is_file()


def test_a_port_freed_a_moment_ago_is_accepted():
    """A server stopped a moment ago leaves its port's connections in TIME_WAIT; the server
    (tornado, SO_REUSEADDR) can listen there again, so ``--port`` must accept it."""
    import argparse

    from workbench.cli import _choose_port

    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the stopped server (tornado) had it
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = server.accept()
        conn.close()  # the server's side closes first: its end of the connection waits in TIME_WAIT
        client.recv(1)
        client.close()
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("127.0.0.1", port))  # the port is in TIME_WAIT (else this test checks nothing)
    assert _choose_port(argparse.Namespace(port=port, default_port=8888)) == port
