"""Streamed ensembles: frames from an iterable or a file, chunk by chunk, equal to the tensor path.

Every backend here (reference in float64, cpu, triton under TRITON_INTERPRET on small inputs):
the streamed map equals the tensor path's map, and :func:`kernels.ensemble_gradients` equals the
autograd gradients of the tensor path, with uneven chunks, a generator and a DCD read through
:func:`kernels.frames_from`. Bad inputs are refused saying what to do; a subprocess checks that
streaming many frames keeps the peak memory bounded.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import kernels
from tests.distributed._frames import CELL, write_trajectory
from tests.helpers import assert_close, assert_kernel_close
from tests.kernels.test_ensemble import BACKENDS, _device, _system

ROOT = Path(__file__).resolve().parents[2]
UNEVEN = (3, 1, 4, 2)  # chunk sizes of the 10 frames of these tests


def _inputs(backend: str, frames: int = 10):
    dtype = torch.float64 if backend == "reference" else torch.float32
    atoms, grid, xyz, *_ = _system(dtype, frames=frames, device=_device(backend))
    upstream = torch.randn(grid.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    return atoms, grid, xyz, upstream.to(device=xyz.device, dtype=dtype)


def _close(out, ref, backend: str) -> None:
    if backend == "reference":  # float64: only the order of the chunks' sums differs
        assert_close(out, ref, atol=1e-12 * float(ref.abs().max()), rtol=1e-12)
    else:
        assert_kernel_close(out, ref)


def _uneven(xyz):
    """A generator of ``xyz`` in chunks of UNEVEN frames (on the CPU, as a reader would give them)."""
    return (c.cpu() for c in xyz.split(list(UNEVEN)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("weights", [None, 0.1])
def test_streamed_map_equals_the_tensor_map(backend, weights):
    atoms, grid, xyz, _ = _inputs(backend)
    want = kernels.splat_ensemble(
        atoms, xyz, grid, backend=backend, weights=None if weights is None else [weights] * 10
    )
    got = kernels.splat_ensemble(atoms, _uneven(xyz), grid, backend=backend, weights=weights)
    assert got.shape == tuple(grid.shape) and got.dtype == want.dtype and not got.requires_grad
    _close(got, want, backend)
    again = kernels.splat_ensemble(atoms, list(xyz.split(4)), grid, backend=backend, weights=weights, chunk=3)
    _close(again, want, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_streamed_gradients_equal_autograd_of_the_tensor_path(backend):
    atoms, grid, xyz, upstream = _inputs(backend)
    n = len(atoms)
    x = xyz.clone().requires_grad_()
    b = atoms.b_iso.expand(10, n).clone().requires_grad_()
    o = atoms.occ.expand(10, n).clone().requires_grad_()
    rho = kernels.splat_ensemble(atoms, x, grid, b_iso=b, occ=o, backend=backend)
    (rho * upstream).sum().backward()

    seen = []

    def keep(start, stop, grads):
        seen.append((start, stop, {k: v.detach().clone() for k, v in grads.items()}))

    wrt = ("xyz", "b_iso", "occ")
    assert kernels.ensemble_gradients(atoms, _uneven(xyz), grid, upstream, out=keep, wrt=wrt, backend=backend) is None
    assert [(s, e) for s, e, _ in seen] == [(0, 3), (3, 4), (4, 8), (8, 10)]
    for name, want in zip(wrt, (x.grad, b.grad, o.grad)):
        got = torch.cat([g[name] for _, _, g in seen])
        assert got.shape == want.shape and got.device == xyz.device
        _close(got, want, backend)


def test_weighted_gradients_scale_and_tensor_chunks_keep_autograd():
    atoms, grid, xyz, upstream = _inputs("cpu")
    x = xyz.clone().requires_grad_()
    rho = kernels.splat_ensemble(atoms, x, grid, weights=[0.25] * 10, backend="cpu", chunk=3)  # 4 calls, one graph
    (rho * upstream).sum().backward()
    whole = xyz.clone().requires_grad_()
    (kernels.splat_ensemble(atoms, whole, grid, weights=[0.25] * 10, backend="cpu") * upstream).sum().backward()
    assert_kernel_close(rho, kernels.splat_ensemble(atoms, xyz, grid, weights=[0.25] * 10, backend="cpu"))
    assert_kernel_close(x.grad, whole.grad)
    parts = {}
    kernels.ensemble_gradients(
        atoms, xyz, grid, upstream, out=lambda s, e, g: parts.update({s: g["xyz"]}), weights=0.25, chunk=4
    )
    assert sorted(parts) == [0, 4, 8]
    assert_kernel_close(torch.cat([parts[k] for k in sorted(parts)]), whole.grad)
    chunks = list(xyz.split(5))
    again = []
    kernels.ensemble_gradients(atoms, chunks, grid, upstream, out=lambda s, e, g: again.append(g["xyz"]), weights=0.25)
    assert not any(c.requires_grad for c in chunks)  # the caller's chunks are left as they were
    assert_kernel_close(torch.cat(again), whole.grad)


@pytest.fixture(scope="module")
def trajectory(tmp_path_factory):
    return write_trajectory(tmp_path_factory.mktemp("traj"), 7, seed=2)


def _dcd_atoms(top: Path, dtype=torch.float32) -> kernels.AtomSet:
    return kernels.read_model(top).atoms.to("cpu", dtype)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_a_dcd_streams_through_frames_from(trajectory, tmp_path, backend):
    models, top, dcd = trajectory
    dtype = torch.float64 if backend == "reference" else torch.float32
    atoms = _dcd_atoms(top, dtype)
    src = kernels.frames_from(dcd, top, chunk=3, dtype=dtype)
    assert (src.n_frames, src.n_atoms, src.chunk) == (7, 9, 3)
    chunks = list(src.chunks())
    assert [c.shape[0] for c in chunks] == [3, 3, 1] and chunks[0].dtype == dtype
    xyz = torch.cat(chunks)
    pdb = kernels.frames_from(models)  # every MODEL a frame, read by gemmi
    assert pdb.n_frames == 7 and pdb.topology is None
    assert_close(xyz, torch.cat(list(pdb.chunks())).to(dtype), atol=1e-3)  # the PDB's 3 decimals through float32
    assert_close(torch.cat(list(src.chunks(2, 5))), xyz[2:5], atol=0)

    grid = kernels.GridSpec.for_spacing(kernels.Cell.from_parameters(*CELL), 1.0)
    want = kernels.splat_ensemble(atoms, xyz, grid, backend=backend)
    _close(kernels.splat_ensemble(atoms, src, grid, backend=backend), want, backend)
    _close(kernels.splat_ensemble(atoms, src, grid, backend=backend, chunk=2, prefetch=False), want, backend)

    upstream = torch.randn(grid.shape, generator=torch.Generator().manual_seed(0), dtype=dtype)
    x = xyz.clone().requires_grad_()
    o = atoms.occ.expand(7, 9).clone().requires_grad_()
    (kernels.splat_ensemble(atoms, x, grid, occ=o, backend=backend) * upstream).sum().backward()
    path = kernels.ensemble_gradients(
        atoms, src, grid, upstream, out=tmp_path / "g.npy", wrt=("xyz", "occ"), backend=backend
    )
    assert path == tmp_path / "g.npy"
    _close(torch.from_numpy(np.load(path)), x.grad, backend)
    _close(torch.from_numpy(np.load(tmp_path / "g_occ.npy")), o.grad, backend)

    part = kernels.frames_from(dcd, top, start=2, stop=6)
    assert part.n_frames == 4 and torch.equal(torch.cat(list(part.chunks())), xyz[2:6].float())


def _mdanalysis_frames(top: Path, dcd: Path) -> np.ndarray:
    """Every frame of ``dcd`` through MDAnalysis's own reader, one Timestep at a time."""
    import warnings

    import MDAnalysis

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        u = MDAnalysis.Universe(str(top), str(dcd))
    out = np.stack([ts.positions.copy() for ts in u.trajectory])
    u.trajectory.close()
    return out


@pytest.mark.parametrize("box", [True, False], ids=["unit cell", "no unit cell"])
def test_dcd_records_read_the_same_bits_as_mdanalysis(trajectory, tmp_path, box):
    _, top, dcd = trajectory
    if not box:  # the same frames without their unit-cell records, and the header's flag for them cleared
        f = kernels.frames_from(dcd, top)._reader.universe.trajectory._file
        data = dcd.read_bytes()
        head = bytearray(data[: f._header_size])
        head[48:52] = (0).to_bytes(4, "little")  # ICNTRL(11), "a unit cell in every frame"
        frames = [data[f._header_size + k * f._framesize :][56 : f._framesize] for k in range(7)]
        dcd = tmp_path / "nobox.dcd"
        dcd.write_bytes(bytes(head) + b"".join(frames))
    src = kernels.frames_from(dcd, top, chunk=3)
    universe = src._reader.universe.trajectory._file
    assert bool(universe.is_periodic) is box and universe._framesize == (56 if box else 0) + 3 * (8 + 4 * 9)
    assert src._reader._records is not None  # read as records, not frame by frame
    want = _mdanalysis_frames(top, dcd)
    assert want.shape == (7, 9, 3)
    assert torch.equal(torch.cat(list(src.chunks())), torch.from_numpy(want))
    assert torch.equal(torch.cat(list(src.chunks(1, 6))), torch.from_numpy(want[1:6]))
    f64 = kernels.frames_from(dcd, top, dtype=torch.float64)
    assert torch.equal(torch.cat(list(f64.chunks())), torch.from_numpy(want).double())


def test_a_damaged_dcd_record_names_its_frame(trajectory, tmp_path):
    _, top, dcd = trajectory
    f = kernels.frames_from(dcd, top)._reader.universe.trajectory._file
    data = bytearray(dcd.read_bytes())
    at = f._header_size + 4 * f._framesize + 56 + 4 + 4 * 9  # frame 5's X record, its closing byte count
    data[at : at + 4] = (1234).to_bytes(4, "little")
    bad = tmp_path / "damaged.dcd"
    bad.write_bytes(bytes(data))
    src = kernels.frames_from(bad, top, chunk=2)
    assert torch.equal(torch.cat(list(src.chunks(0, 4))), torch.cat(list(kernels.frames_from(dcd, top).chunks(0, 4))))
    with pytest.raises(ValueError, match=r"damaged.dcd: frame 5 is damaged \(a record's byte count is 1234, not 36\)"):
        list(src.chunks())


def test_progress_counts_frames_and_shows_a_bar(trajectory, capsys):
    _, top, dcd = trajectory
    atoms = _dcd_atoms(top)
    grid = kernels.GridSpec.for_spacing(kernels.Cell.from_parameters(*CELL), 1.5)
    seen = []
    kernels.splat_ensemble(
        atoms, kernels.frames_from(dcd, top, chunk=2), grid, progress=lambda d, t: seen.append((d, t))
    )
    assert seen == [(2, 7), (4, 7), (6, 7), (7, 7)]
    seen.clear()
    xyz = torch.cat(list(kernels.frames_from(dcd, top).chunks()))
    kernels.splat_ensemble(atoms, xyz, grid, chunk=3, progress=lambda d, t: seen.append((d, t)))  # tensor path too
    assert seen == [(3, 7), (6, 7), (7, 7)]
    seen.clear()
    kernels.splat_ensemble(atoms, iter([xyz[:5], xyz[5:]]), grid, progress=lambda d, t: seen.append((d, t)))
    assert seen == [(5, None), (7, None)]  # an iterable's length is not known up front
    capsys.readouterr()
    kernels.splat_ensemble(atoms, kernels.frames_from(dcd, top), grid, progress=True)
    assert "7/7" in capsys.readouterr().err


def test_bad_files_and_ranges_say_what_is_wrong(trajectory, tmp_path):
    models, top, dcd = trajectory
    with pytest.raises(FileNotFoundError, match="the trajectory .*missing.dcd does not exist"):
        kernels.frames_from(tmp_path / "missing.dcd", top)
    with pytest.raises(FileNotFoundError, match="the topology .*nope.pdb does not exist"):
        kernels.frames_from(dcd, tmp_path / "nope.pdb")
    with pytest.raises(ValueError, match="needs its topology"):
        kernels.frames_from(dcd)
    cut = tmp_path / "cut.dcd"  # a run that stopped while writing its last frame
    cut.write_bytes(dcd.read_bytes()[:-50])
    with pytest.raises(ValueError, match="holds 6 whole frames and .* more bytes .* truncated"):
        kernels.frames_from(cut, top)
    short = tmp_path / "short.pdb"  # one atom fewer than the trajectory
    lines = top.read_text().splitlines()
    short.write_text("\n".join(line for i, line in enumerate(lines) if i != 3) + "\n")
    with pytest.raises(ValueError, match="(?s)MDAnalysis cannot read .*same number of atoms"):
        kernels.frames_from(dcd, short)
    for kwargs, error, match in [
        ({"chunk": 0}, ValueError, "chunk must be at least 1 frame, got 0"),
        ({"chunk": -3}, ValueError, "chunk must be at least 1 frame"),
        ({"chunk": 2.5}, TypeError, "chunk must be a whole number"),
        ({"stop": 8}, ValueError, r"start=0, stop=8 are outside .* which has 7 frames: give 0 ≤ start < stop ≤ 7"),
        ({"start": 5, "stop": 5}, ValueError, "which has 7 frames"),
        ({"start": -1}, ValueError, "which has 7 frames"),
        ({"dtype": torch.float16}, TypeError, "dtype must be torch.float32 or torch.float64"),
    ]:
        with pytest.raises(error, match=match):
            kernels.frames_from(dcd, top, **kwargs)
    src = kernels.frames_from(dcd, top)
    with pytest.raises(ValueError, match="chunk must be at least 1"):
        src.chunk = 0
    with pytest.raises(ValueError, match="start=3, stop=9 are outside"):
        next(src.chunks(3, 9))
    uneven = tmp_path / "uneven.pdb"  # model 2 lacks its last atom
    text = models.read_text().split("ENDMDL")
    text[1] = "\n".join(text[1].splitlines()[:-1]) + "\n"
    uneven.write_text("ENDMDL".join(text))
    with pytest.raises(ValueError, match=r"model 2 of 7 \(MODEL 2\) has 8 atoms but model 1 has 9"):
        kernels.frames_from(uneven)


def test_streamed_inputs_that_cannot_be_taken_are_refused(trajectory, tmp_path):
    atoms, grid, xyz, upstream = _inputs("cpu")
    _, top, dcd = trajectory
    cases = [
        ({"reduce": "none"}, ValueError, "reduce='none' needs every frame's map at once"),
        ({"b_iso": xyz[..., 0]}, ValueError, "b_iso= .* is not taken with streamed frames"),
        ({"weights": [0.1] * 10}, ValueError, "must be one number for every frame"),
        ({"chunk": 0}, ValueError, "chunk must be at least 1 frame"),
    ]
    for kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            kernels.splat_ensemble(atoms, _uneven(xyz), grid, **kwargs)
    with pytest.raises(ValueError, match=r"chunk 1 has shape \(2, 6, 3\); every chunk must be \(F_chunk, 7, 3\)"):
        kernels.splat_ensemble(atoms, iter([xyz[:2], xyz[2:4, :6]]), grid)
    with pytest.raises(ValueError, match="chunk 0 requires grad.* kernels.ensemble_gradients"):
        kernels.splat_ensemble(atoms, [xyz.clone().requires_grad_()], grid)
    with pytest.raises(ValueError, match="torch.distributed is not initialised"):
        kernels.splat_ensemble(atoms, kernels.frames_from(dcd, top), grid, process_group=object())
    with pytest.raises(ValueError, match="held no frames"):
        kernels.splat_ensemble(atoms, iter([]), grid)
    with pytest.raises(TypeError, match="torch.from_numpy"):
        kernels.splat_ensemble(atoms, xyz.numpy(), grid)
    with pytest.raises(ValueError, match="the frames have 9 atoms .* but the atoms have 7"):
        kernels.splat_ensemble(atoms, kernels.frames_from(dcd, top), grid)
    with pytest.raises(ValueError, match="needs the number of frames up front"):
        kernels.ensemble_gradients(atoms, _uneven(xyz), grid, upstream, out=tmp_path / "g.npy")
    with pytest.raises(ValueError, match="must end in .npy"):
        kernels.ensemble_gradients(atoms, xyz, grid, upstream, out=tmp_path / "g.bin")
    with pytest.raises(ValueError, match=r"map_grad must be a tensor of the grid's shape"):
        kernels.ensemble_gradients(atoms, xyz, grid, upstream[:2], out=print)
    with pytest.raises(ValueError, match="wrt must name some of"):
        kernels.ensemble_gradients(atoms, xyz, grid, upstream, out=print, wrt=("xyz", "u"))
    assert not (tmp_path / "g.npy").exists()


def test_a_failing_source_stops_the_prefetch_thread():
    atoms, grid, xyz, _ = _inputs("cpu")

    def frames():
        yield xyz[:3]
        yield xyz[3:6]
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        kernels.splat_ensemble(atoms, frames(), grid, prefetch=True)
    bad = iter([xyz[:2], xyz[2:4, :3], xyz[4:]])  # the consumer fails: the reading thread must end too
    with pytest.raises(ValueError, match="chunk 1 has shape"):
        kernels.splat_ensemble(atoms, bad, grid, prefetch=True)
    assert not [t for t in threading.enumerate() if t.name == "kernels-prefetch"]
    nan = xyz[2:4].clone()
    nan[1, 3, 0] = float("nan")
    # frame 3 of the stream (the second of its chunk): messages count the frames from the first chunk
    with pytest.raises(ValueError, match="frame 3: atom .* non-finite position") as caught:  # raised by the splat
        kernels.splat_ensemble(atoms, iter([xyz[:2], nan, xyz[4:], xyz[4:]]), grid, prefetch=True)
    assert caught.traceback  # the traceback (and the consumer's frame) is still alive here
    assert not [t for t in threading.enumerate() if t.name == "kernels-prefetch"]


_PEAK = """
import json, resource, sys, torch, kernels
m = kernels.read_model(kernels.example_structure("1aki"))
atoms = m.atoms.to("cpu", torch.float32)
grid = kernels.GridSpec.for_spacing(m.cell, 1.5)
n, frames, chunk = len(atoms), int(sys.argv[1]), int(sys.argv[2])

def gen(count):
    g = torch.Generator().manual_seed(0)
    for lo in range(0, count, chunk):
        yield atoms.xyz[None] + 0.1 * torch.randn((min(chunk, count - lo), n, 3), generator=g)

kernels.splat_ensemble(atoms, gen(20 * chunk), grid, radius=1.0)  # the buffers of a chunk, the allocator settled
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
kernels.splat_ensemble(atoms, gen(frames), grid, radius=1.0)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"before_kib": before, "after_kib": after, "n": n}))
"""


def test_streaming_many_frames_keeps_the_peak_memory_bounded():
    """2,000 frames of 1AKI (1,079 atoms) in chunks of 20: the peak grows by far less than the frames' positions."""
    frames = 2000
    proc = subprocess.run(
        [sys.executable, "-c", _PEAK, str(frames), "20"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    peak = json.loads(proc.stdout.strip().splitlines()[-1])
    held = frames * peak["n"] * 3 * 4 / 1024  # KiB of positions alone, were every frame held at once
    growth = peak["after_kib"] - peak["before_kib"]
    assert growth < 0.25 * held, (
        f"peak RSS grew by {growth} KiB streaming {frames} frames ({held:.0f} KiB of positions)"
    )


# --------------------------------------------------------------------------- files that change or end


def _big_trajectory(folder: Path, n_atoms: int = 3000, n_frames: int = 6) -> tuple[Path, Path]:
    """A topology and a DCD whose frames span several memory pages each (36 KiB a frame for 3,000 atoms)."""
    import warnings

    import MDAnalysis

    rng = np.random.default_rng(5)
    top = folder / "big.pdb"
    top.write_text(
        "CRYST1   60.000   60.000   60.000  90.00  90.00  90.00 P 1           1\n"
        + "".join(
            f"ATOM  {i + 1:5d}  C   GLY A{i // 10 + 1:4d}    {x:8.3f}{y:8.3f}{z:8.3f}  1.00 20.00           C\n"
            for i, (x, y, z) in enumerate(rng.uniform(0, 60, (n_atoms, 3)))
        )
        + "END\n"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        u = MDAnalysis.Universe(str(top))
        dcd = folder / "big.dcd"
        with MDAnalysis.Writer(str(dcd), n_atoms) as writer:
            for _ in range(n_frames):
                u.atoms.positions = rng.uniform(0, 60, (n_atoms, 3))
                u.trajectory.ts.dimensions = (60.0, 60.0, 60.0, 90.0, 90.0, 90.0)
                writer.write(u.atoms)
    return top, dcd


_CHANGING = """
import json, os, sys, shutil
import torch, kernels
top, dcd, how = sys.argv[1], sys.argv[2], sys.argv[3]
want = torch.cat(list(kernels.frames_from(dcd, top).chunks()))
src = kernels.frames_from(dcd, top, chunk=2)
reader = src._reader.universe.trajectory._file
header, frame = reader._header_size, reader._framesize
chunks = src.chunks()
got = [next(chunks)]  # frames 1-2 read, then the file changes under the reader
if how == "cut":  # a run rewriting it: the file now ends half-way through frame 4
    os.truncate(dcd, header + 3 * frame + frame // 2)
elif how == "emptied":  # truncated to nothing, as `> file` or a crashed copy leaves it
    os.truncate(dcd, 0)
elif how == "replaced":  # a new file renamed over the name (a copy finished elsewhere)
    shutil.copy(dcd, dcd + ".new")
    os.truncate(dcd + ".new", header + frame)
    os.replace(dcd + ".new", dcd)
try:
    got += list(chunks)
    print(json.dumps({"ok": bool(torch.equal(torch.cat(got), want))}))
except ValueError as exc:
    print(json.dumps({"error": str(exc)}))
"""


@pytest.mark.parametrize(
    "how, expected",
    [
        (
            "cut",
            r"big.dcd: frame 4 of 6 is no longer in the file: it is now \d+ bytes, shorter than when it was opened",
        ),
        ("emptied", r"big.dcd: frame 3 of 6 is no longer in the file: it is now 0 bytes"),
        ("replaced", None),  # the open file is read on: every frame as it was
    ],
)
def test_a_dcd_that_shrinks_or_is_replaced_while_read_is_an_error_naming_the_frame(tmp_path, how, expected):
    """A memory map of a file cut shorter ends the process with SIGBUS: a subprocess shows it does not."""
    top, dcd = _big_trajectory(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-c", _CHANGING, str(top), str(dcd), how],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, f"exit {proc.returncode} (-7 is SIGBUS): {proc.stderr[-2000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if expected is None:
        assert result == {"ok": True}
    else:
        assert re.search(expected, result["error"]), result


def test_a_closed_frame_source_says_it_is_closed(trajectory):
    models, top, dcd = trajectory
    for open_it in (lambda: kernels.frames_from(dcd, top, chunk=2), lambda: kernels.frames_from(models)):
        with open_it() as src:
            first = next(src.chunks())
            share = src.share()
        assert first.shape[0] >= 1
        for closed in (src, share):  # a share reads through the source's file
            with pytest.raises(
                ValueError, match=r"this FrameSource is closed .* open the file again with kernels.frames_from"
            ):
                next(closed.chunks())
            atoms = _dcd_atoms(top)
            grid = kernels.GridSpec.for_spacing(kernels.Cell.from_parameters(*CELL), 2.0)
            with pytest.raises(ValueError, match="this FrameSource is closed"):
                kernels.splat_ensemble(atoms, closed, grid)
        src.close()  # closing twice is harmless


def _edit_model(models: Path, out: Path, model: int, atom: int, edit) -> Path:
    """``models`` with ``edit(line)`` applied to atom ``atom`` (0-based) of model ``model`` (0-based)."""
    lines, m, i = [], -1, -1
    for line in models.read_text().splitlines():
        if line.startswith("MODEL"):
            m, i = m + 1, -1
        if line.startswith("ATOM"):
            i += 1
            if (m, i) == (model, atom):
                line = edit(line)
        lines.append(line)
    out.write_text("\n".join(lines) + "\n")
    return out


def _swap_atoms(models: Path, out: Path, model: int, a: int, b: int) -> Path:
    blocks = models.read_text().split("MODEL")
    rows = blocks[model + 1].splitlines()
    atoms = [k for k, line in enumerate(rows) if line.startswith("ATOM")]
    rows[atoms[a]], rows[atoms[b]] = rows[atoms[b]], rows[atoms[a]]
    blocks[model + 1] = "\n".join(rows) + "\n"
    out.write_text("MODEL".join(blocks))
    return out


@pytest.mark.parametrize(
    "change, expected",
    [
        # two atoms of model 2 in each other's place: the counts agree, the map would be off. An atom moved to
        # another chain or residue number comes later in gemmi's order, so model 1's atom there differs
        (
            lambda m, o: _swap_atoms(m, o, 1, 0, 1),
            r"model 2 of 7 \(MODEL 2\): atom 1 is A/ALA 1/CA \(C\) where model 1 has A/ALA 1/N \(N\)",
        ),
        (
            lambda m, o: _swap_atoms(m, o, 6, 6, 7),
            r"model 7 of 7 \(MODEL 7\): atom 7 is A/SER 2/OG \(O\) where model 1 has A/SER 2/CA",
        ),
        (
            lambda m, o: _edit_model(m, o, 2, 4, lambda s: s[:12] + " CG " + s[16:]),
            r"model 3 of 7 .*atom 5 is A/ALA 1/CG",
        ),
        (
            lambda m, o: _edit_model(m, o, 1, 2, lambda s: s[:16] + "B" + s[17:]),
            r"model 2 of 7 .*atom 3 is A/ALA 1/C altloc B \(C\) where model 1 has A/ALA 1/C \(C\)",
        ),
        (
            lambda m, o: _edit_model(m, o, 1, 3, lambda s: s[:21] + "B" + s[22:]),
            r"model 2 of 7 .*atom 4 is A/ALA 1/CB \(C\) where model 1 has A/ALA 1/O",
        ),
        (
            lambda m, o: _edit_model(m, o, 1, 5, lambda s: s[:17] + "THR" + s[20:]),
            r"model 2 of 7 .*atom 6 is A/THR 2/N",
        ),
        (
            lambda m, o: _edit_model(m, o, 1, 6, lambda s: s[:22] + "  12" + s[26:]),
            r"model 2 of 7 .*atom 7 is A/SER 2/OG \(O\) where model 1 has A/SER 2/CA",
        ),
        (lambda m, o: _edit_model(m, o, 3, 8, lambda s: s[:76] + "SE"), r"model 4 of 7 .*atom 9 is A/MET 3/SD \(Se\)"),
    ],
    ids=["swapped", "swapped-last", "name", "altloc", "chain", "residue", "number", "element"],
)
def test_every_model_must_be_model_1s_atoms_atom_for_atom(trajectory, tmp_path, change, expected):
    """frames_from and `workbench ensemble` refuse a model that is not model 1's atoms in order, with one check."""
    from workbench.ensemble_cli import EnsembleError, read_frames

    models, _, _ = trajectory
    bad = change(models, tmp_path / "bad.pdb")
    assert bad.read_text().count("ATOM") == models.read_text().count("ATOM")  # the atom counts agree
    with pytest.raises(ValueError, match=expected):
        kernels.frames_from(bad)
    with pytest.raises(EnsembleError, match=expected):
        read_frames(bad)


def test_ensemble_gradients_with_no_frames_to_read_raise_as_splat_ensemble_does(trajectory, tmp_path):
    atoms, grid, xyz, upstream = _inputs("cpu")
    gen = (c for c in xyz.split(3))
    kernels.splat_ensemble(atoms, gen, grid)  # the forward uses the generator up
    calls = []
    for frames in (gen, [], iter([]), (c for c in ())):
        with pytest.raises(ValueError, match="held no frames") as caught:
            kernels.ensemble_gradients(atoms, frames, grid, upstream, out=lambda *a: calls.append(a))
        assert "a generator the forward pass used up" in str(caught.value)
        with pytest.raises(ValueError, match="held no frames"):
            kernels.splat_ensemble(atoms, [] if isinstance(frames, list) else iter([]), grid)
    assert calls == []


def test_a_gradient_pass_that_fails_leaves_no_partial_npy(trajectory, tmp_path):
    """A damaged frame part way: no <stem>.npy, <stem>_b_iso.npy or <stem>_occ.npy with rows of zeros; old files kept."""
    _, top, dcd = trajectory
    atoms = _dcd_atoms(top)
    grid = kernels.GridSpec.for_spacing(kernels.Cell.from_parameters(*CELL), 1.5)
    upstream = torch.ones(grid.shape)
    f = kernels.frames_from(dcd, top)._reader.universe.trajectory._file
    data = bytearray(dcd.read_bytes())
    at = f._header_size + 5 * f._framesize + 56  # frame 6's X record, its opening byte count
    data[at : at + 4] = (99).to_bytes(4, "little")
    bad = tmp_path / "damaged.dcd"
    bad.write_bytes(bytes(data))
    out = tmp_path / "out"
    out.mkdir()
    (out / "g_occ.npy").write_bytes(b"an older file, kept")
    for chunk in (1, 2, 7):
        with pytest.raises(ValueError, match="frame 6 is damaged"):
            kernels.ensemble_gradients(
                atoms, kernels.frames_from(bad, top, chunk=chunk), grid, upstream, out=out / "g.npy",
                wrt=("xyz", "b_iso", "occ"),
            )  # fmt: skip
        assert sorted(p.name for p in out.iterdir()) == ["g_occ.npy"], chunk  # no temporaries either
        assert (out / "g_occ.npy").read_bytes() == b"an older file, kept"
    # a good pass puts every file in place at once, with the umask's permissions
    kernels.ensemble_gradients(
        atoms, kernels.frames_from(dcd, top, chunk=2), grid, upstream, out=out / "g.npy", wrt=("xyz", "b_iso", "occ")
    )
    assert sorted(p.name for p in out.iterdir()) == ["g.npy", "g_b_iso.npy", "g_occ.npy"]
    assert np.load(out / "g_occ.npy").shape == (7, 9) and np.abs(np.load(out / "g.npy")[-1]).sum() > 0
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(out / "g_b_iso.npy").st_mode & 0o777 == 0o666 & ~umask
    # a name that is not a regular file or a new path is refused before any frame is read
    os.mkfifo(out / "p_b_iso.npy")
    (out / "null.npy").symlink_to(os.devnull)
    for name, why in (("p.npy", r"p_b_iso.npy: a pipe \(FIFO\)"), ("null.npy", "a link to /dev/null")):
        with pytest.raises(ValueError, match=why):
            kernels.ensemble_gradients(
                atoms, kernels.frames_from(dcd, top), grid, upstream, out=out / name, wrt=("xyz", "b_iso")
            )
    assert os.readlink(out / "null.npy") == os.devnull and not list(out.glob(".*.tmp"))


def _dcd_with(dcd: Path, out: Path, *, natom=None, keep=None) -> Path:
    """``dcd`` with its header's NATOM replaced, or cut to its first ``keep`` bytes."""
    import struct

    data = bytearray(dcd.read_bytes())
    if natom is not None:
        at = 4 + 84 + 4 + 4 + struct.unpack("<i", data[92:96])[0] + 4 + 4  # after the title record and NATOM's marker
        data[at : at + 4] = struct.pack("<i", natom)
    out.write_bytes(bytes(data if keep is None else data[:keep]))
    return out


def test_a_damaged_dcd_header_or_first_frame_is_one_clear_error_naming_the_field(trajectory, tmp_path, capfd):
    _, top, dcd = trajectory
    f = kernels.frames_from(dcd, top)._reader.universe.trajectory._file
    header, frame = f._header_size, f._framesize
    cases = [
        (_dcd_with(dcd, tmp_path / "neg.dcd", natom=-7), r"neg.dcd: the DCD header gives -7 atoms \(NATOM, bytes"),
        (_dcd_with(dcd, tmp_path / "max.dcd", natom=2**31 - 1), "the DCD header gives 2147483647 atoms"),
        (_dcd_with(dcd, tmp_path / "zero.dcd", natom=0), "the DCD header gives 0 atoms"),
        (
            _dcd_with(dcd, tmp_path / "cut1.dcd", keep=header + frame // 2),
            rf"cut1.dcd: the DCD is cut inside frame 1: it holds {frame // 2} of that frame's {frame} bytes \(9 atoms\)",
        ),
        (_dcd_with(dcd, tmp_path / "header.dcd", keep=header), "cut inside frame 1: it holds 0 of"),
        (_dcd_with(dcd, tmp_path / "title.dcd", keep=120), "the DCD header is cut short"),
        # a count that fits int32 but not this file: frame 1 would need more bytes than it holds
        (_dcd_with(dcd, tmp_path / "many.dcd", natom=10**6), "the DCD is cut inside frame 1"),
    ]
    capfd.readouterr()
    for path, expected in cases:
        with pytest.raises(ValueError, match=expected) as caught:
            kernels.frames_from(path, top)
        assert "Python int too large" not in str(caught.value) and "opened empty file" not in str(caught.value)
    garbage = tmp_path / "garbage.dcd"  # not a DCD at all: MDAnalysis's own message, once
    garbage.write_bytes(b"\x00\x01" * 500)
    with pytest.raises(ValueError, match="MDAnalysis cannot read the trajectory .*garbage.dcd"):
        kernels.frames_from(garbage, top)
    import gc

    gc.collect()
    err = capfd.readouterr().err
    assert "Exception ignored" not in err and "Traceback" not in err, err


def test_a_path_given_as_frames_points_to_frames_from(trajectory, tmp_path):
    atoms, grid, xyz, upstream = _inputs("cpu")
    models, _, dcd = trajectory
    for frames in (str(dcd), dcd, str(models).encode(), models):
        with pytest.raises(TypeError, match=r"is a path \(.*\), not frames: open the file with kernels.frames_from"):
            kernels.splat_ensemble(atoms, frames, grid)
        with pytest.raises(TypeError, match="kernels.frames_from"):
            kernels.ensemble_gradients(atoms, frames, grid, upstream, out=lambda *a: None)


def test_atoms_on_the_meta_device_are_refused_when_made():
    atoms = _inputs("cpu")[0]
    with pytest.raises(ValueError, match="on the meta device, which holds shapes but no values"):
        atoms.to("meta")
    with pytest.raises(ValueError, match="meta device"):
        kernels.AtomSet(*(t.to("meta") for t in (atoms.xyz, atoms.b_iso, atoms.occ, atoms.a, atoms.b)))


@pytest.mark.parametrize("blur", [1e300, -1e300, 1e39])
def test_a_blur_beyond_the_atoms_dtype_names_the_blur_not_a_b(blur):
    atoms, grid, xyz, _ = _inputs("cpu")
    for call in (
        lambda: kernels.splat_density(atoms, grid, blur=blur),
        lambda: kernels.splat_ensemble(atoms, xyz, grid, blur=blur),
        lambda: kernels.splat_ensemble(atoms, iter([xyz]), grid, blur=blur),
    ):
        with pytest.raises(
            ValueError, match=re.escape(f"blur={blur:g} Å² is beyond the range of the atoms' torch.float32")
        ) as e:
            call()
        assert not re.search(r"atom \S+ \(index", str(e.value))  # no atom is blamed
