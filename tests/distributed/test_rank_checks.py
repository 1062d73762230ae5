"""Ranks that do not call alike: they are told so, on every rank, instead of a wrong map or a hang.

Each case runs ``torchrun --nproc_per_node 2`` (gloo, CPU) on ``_disagree_worker.py``:
ranks passing different F or grid shapes raise a ValueError naming the values on both ranks; a
rank that leaves ``process_group`` out is found within seconds by the rank that passes it (and
finds it itself when it comes second), under the group's default 30-minute timeout; a rank that
is only late is waited for, the wait stated after 5 s; killing torchrun with SIGKILL ends its ranks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "distributed" / "_disagree_worker.py"


def _env() -> dict[str, str]:
    return dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )


def _command(mode: str, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(WORKER),
        mode,
        str(out),
    ]


def _torchrun(mode: str, out: Path) -> list[str]:
    proc = subprocess.run(_command(mode, out), cwd=out, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return [(out / f"rank{r}.txt").read_text() for r in range(2)]


@pytest.mark.parametrize(
    ("mode", "differ"),
    [("frames", "F (frames) from 5 to 6"), ("grid", "grid nx from 10 to 16")],
)
def test_ranks_that_pass_different_inputs_all_raise_naming_the_values(tmp_path, mode, differ):
    results = _torchrun(mode, tmp_path)
    for rank, text in enumerate(results):
        assert text.startswith("ValueError: splat_ensemble(process_group=...): the ranks pass different inputs"), text
        assert differ in text, text
        assert f"this rank {rank} has" in text, text


def _seconds(text: str) -> float:
    return float(text.rsplit("seconds: ", 1)[1])


@pytest.mark.parametrize("first", ["alone", "group"])
def test_a_rank_that_leaves_process_group_out_is_found_within_seconds(tmp_path, first):
    # Under the group's default 30-minute timeout: the ranks must find the mismatch themselves.
    start = time.monotonic()
    waiting, alone = _torchrun("omit-first" if first == "alone" else "omit-last", tmp_path)
    assert time.monotonic() - start < 120  # torchrun's start and two imports of torch on a loaded machine
    assert waiting.startswith("ValueError: splat_ensemble: at call 1 of this program, rank(s) 0 passed "), waiting
    assert "rank(s) 1 did not" in waiting, waiting
    assert _seconds(waiting) < 10, waiting
    if first == "alone":  # rank 1 splats alone before rank 0 comes, warned; rank 0 finds its entry
        assert alone.startswith("ok "), alone
        assert "process_group= was not given, so rank 1 splats all 5 frames alone" in alone, alone
    else:  # rank 1 comes second and finds rank 0's entry
        assert alone.startswith("ValueError: splat_ensemble: at call 1 of this program, rank(s) 0 passed "), alone
        assert _seconds(alone) < 5, alone


def test_a_late_rank_is_waited_for_and_the_wait_is_stated(tmp_path):
    waiting, late = _torchrun("late", tmp_path)
    assert waiting.startswith("ok ") and late.startswith("ok "), (waiting, late)
    assert waiting.split()[1] == late.split()[1]  # the same summed map on both ranks
    assert "rank 0 has waited 5 s for rank(s) 1 to reach call 1 with process_group=" in waiting, waiting
    assert "30 minutes by default" in waiting, waiting
    assert "warning" not in late, late


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has ended; only its parent has not reaped it
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to see the ranks")
@pytest.mark.parametrize("mode", ["parent", "library"], ids=["workbench-ensemble", "user-script"])
def test_ranks_end_when_torchrun_is_killed(tmp_path, mode):
    launcher = subprocess.Popen(
        _command(mode, tmp_path), cwd=tmp_path, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(pids) < 2:
            assert time.monotonic() < deadline and launcher.poll() is None, "the ranks did not start"
            pids = [int(p.read_text()) for p in tmp_path.glob("pid*.txt") if p.read_text()]
            time.sleep(0.1)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in pids if _alive(p)], "ranks still running 20 s after torchrun was killed"
    finally:
        for pid in pids:  # the ranks this test started, by their ids
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
