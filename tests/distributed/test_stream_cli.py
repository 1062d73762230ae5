"""``workbench ensemble TRAJECTORY --topology TOP`` streams: chunks, progress, Ctrl-C, torchrun.

The trajectories are DCDs written here (:func:`tests.distributed._frames.write_dcd`), so the
frames are known; the streamed map is checked against the same frames read whole
(:func:`workbench.ensemble_cli.read_frames`) and splatted in one call. Ctrl-C is a real SIGINT to
a real ``python -m workbench`` process once its progress has started.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

import kernels
from tests.distributed._frames import write_dcd, write_models
from tests.distributed.test_torchrun import ROOT, _close, _torchrun
from tests.signals import default_action
from workbench.cli import main as workbench_main
from workbench.ensemble_cli import read_frames


def _in_memory_mean(top: Path, dcd: Path, grid) -> object:
    frames = read_frames(dcd, topology=top)
    f, f32 = len(frames.xyz), torch.float32
    atoms = frames.atoms.to(dtype=f32)
    return kernels.splat_ensemble(atoms, frames.xyz.to(f32), grid, b_iso=frames.b_iso.to(f32), weights=[1.0 / f] * f)


def test_streamed_map_frames_used_and_plain_progress(tmp_path, capsys):
    top, dcd = write_dcd(tmp_path, 40, seed=7)
    out = tmp_path / "mean.ccp4"
    args = ["ensemble", str(dcd), "--topology", str(top), "--spacing", "1.0", "--chunk", "7", "--out", str(out)]
    assert workbench_main(args) == 0
    captured = capsys.readouterr()
    assert "frames  40 of 9 atoms from" in captured.out and "frames 0–39 (streamed in chunks of ≤ 7 frames)" in (
        captured.out
    ), captured.out
    assert "splat   40 frames (mean)" in captured.out, captured.out
    # stderr is not a terminal here: a few plain lines, the first after one chunk, the last at 40/40
    lines = [line for line in captured.err.splitlines() if line.startswith("progress  ")]
    assert 2 <= len(lines) <= 12, captured.err
    assert lines[0].startswith("progress  7/40 frames (18 %), "), lines
    assert lines[-1].startswith("progress  40/40 frames (100 %), ") and "frames/s" in lines[-1], lines
    assert "\r" not in captured.err and "DCDReader" not in captured.err, captured.err
    rho, grid = kernels.read_map(out)
    _close(rho.double(), _in_memory_mean(top, dcd, grid).double(), "streamed mean vs frames read whole")

    summed = tmp_path / "sum.ccp4"
    assert workbench_main([*args[:-1], str(summed), "--sum", "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert "progress" not in captured.err, captured.err
    rho_sum, _ = kernels.read_map(summed)
    _close(rho_sum.double(), 40 * rho.double(), "--sum is 40 × the mean")


def _reader(stream, lines: queue.Queue) -> None:
    for line in iter(stream.readline, ""):
        lines.put(line)
    lines.put(None)


def test_ctrl_c_exits_130_and_leaves_no_map(tmp_path):
    # 20,000 one-frame chunks at 0.4 Å: tens of seconds of work, so the SIGINT lands mid-splat
    top, dcd = write_dcd(tmp_path, 20_000, seed=2)
    out = tmp_path / "map.ccp4"
    out.write_bytes(b"an earlier map")  # an interrupted run must leave it as it was
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    cmd = [sys.executable, "-m", "workbench", "ensemble", str(dcd), "--topology", str(top), "--chunk", "1"]
    proc = subprocess.Popen(
        [*cmd, "--spacing", "0.4", "--backend", "cpu", "--out", str(out)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_action(signal.SIGINT),  # a background job's SIGINT is ignored
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(proc.stderr, lines), daemon=True).start()
    err = []
    try:
        deadline = time.monotonic() + 120
        while not any(line.startswith("progress  ") for line in err):
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None, f"ended before any progress ({proc.wait()}):\n{''.join(err)}"
            err.append(line)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)  # stderr is the reader thread's; stdout is a few lines, read below
        stdout = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    while (line := lines.get(timeout=10)) is not None:
        err.append(line)
    err = "".join(err)
    assert proc.returncode == 130, f"{proc.returncode}\n{stdout}\n{err}"
    assert "Traceback" not in err, err
    assert f"interrupted: nothing was written to {out}" in err, err
    assert "progress  20000/20000" not in err and "wrote" not in stdout, (stdout, err)
    assert out.read_bytes() == b"an earlier map"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["map.ccp4", "top.pdb", "traj.dcd"]  # no temporary file


def test_streamed_under_torchrun_each_rank_reads_its_share(tmp_path):
    top, dcd = write_dcd(tmp_path, 11, seed=4)
    out = tmp_path / "ranks.ccp4"
    args = ["-m", "workbench", "ensemble", str(dcd), "--topology", str(top), "--chunk", "2", "--spacing", "1.0"]
    proc = _torchrun([*args, "--out", str(out)], cwd=tmp_path)
    assert proc.stdout.count("ranks   2 (gloo); rank 0 reads and splats frames 0–5") == 1, proc.stdout
    assert proc.stdout.count("wrote   ") == 1, proc.stdout
    # rank 0 alone shows progress, of its own share (6 of the 11 frames)
    assert proc.stderr.count("progress  6/6 frames of rank 0's share (100 %)") == 1, proc.stderr
    assert "/5 frames" not in proc.stderr and "DCDReader" not in proc.stderr, proc.stderr
    rho, grid = kernels.read_map(out)
    _close(rho.double(), _in_memory_mean(top, dcd, grid).double(), "map streamed by 2 ranks vs one process")


def test_multi_model_file_read_whole_with_progress(tmp_path, capsys):
    models = write_models(tmp_path / "models.pdb", 5, seed=1)
    out = tmp_path / "models.ccp4"
    assert workbench_main(["ensemble", str(models), "--spacing", "1.0", "--chunk", "2", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "frames 0–4 (read whole" in captured.out, captured.out
    lines = [line for line in captured.err.splitlines() if line.startswith("progress  ")]
    assert lines[0].startswith("progress  2/5 frames (40 %)") and lines[-1].startswith("progress  5/5 frames (100 %)")
    frames = read_frames(models)  # each model's own B and occupancy
    rho, grid = kernels.read_map(out)
    want = kernels.splat_ensemble(
        frames.atoms.to(dtype=torch.float32), frames.xyz.float(), grid, b_iso=frames.b_iso.float(),
        occ=frames.occ.float(), weights=[0.2] * 5,
    )  # fmt: skip
    _close(rho.double(), want.double(), "multi-model mean in chunks of 2")


def test_truncated_trajectory_is_one_line_and_no_map(tmp_path, capsys):
    top, dcd = write_dcd(tmp_path, 12, seed=3)
    dcd.write_bytes(dcd.read_bytes()[:-50])  # the last frame cut off, as by a run that stopped writing
    out = tmp_path / "cut.ccp4"
    assert workbench_main(["ensemble", str(dcd), "--topology", str(top), "--spacing", "1.0", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "error: " in err and "truncated" in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["top.pdb", "traj.dcd"]
