"""The relax control: the fit loop (workbench.compute.relax), its stop, and frames dropped for a slow view."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import workbench
from kernels import planarity_nll, splat_density
from workbench import compute
from workbench.scheduler import LatestOnly
from workbench.state import WorkbenchState


def _problem(**settings):
    settings = {"structure": "1orc", "spacing": 1.5, "distort_amplitude": 0.3, **settings}
    s = WorkbenchState(**settings).snapshot()
    r = compute.Pipeline().run(s)
    planes = compute.find_planes(r.model)
    return r, compute.relax_problem(r.atoms, r.grid, r.target, planes, s, reference=r.model.atoms.xyz)


def test_relax_reduces_the_rmsd_on_1orc():
    r, problem = _problem()
    relaxation = compute.Relaxation(problem, lr=0.05, lam=0.1)
    frames = [relaxation.step() for _ in range(30)]
    start, end = frames[0].rmsd, compute.rmsd(relaxation.xyz, r.model.atoms.xyz)
    assert start == pytest.approx(0.3 * 3**0.5, rel=0.1)  # the workbench's distortion: 0.3 Å per coordinate
    # measured: 0.51 → 0.27 Å after 30 steps (1.5 Å grid, lr 0.05 Å, λ 0.1)
    assert end < 0.7 * start
    assert [f.step for f in frames] == list(range(30))
    assert frames[-1].fit < 0.1 * frames[0].fit
    assert set(frames[0].timings) == {"splat forward+backward", "planarity forward+backward", "update", "step"}


def test_a_step_adds_the_density_and_lambda_times_the_planarity_gradient():
    _, problem = _problem()
    lam = 0.7
    relaxation = compute.Relaxation(problem, lr=0.01, lam=lam)
    frame = relaxation.step()
    v = problem.grid.voxel_volume
    total = 2 * v * frame.density_gradient.grad + lam * frame.planarity_gradient.grad
    # the same L by autograd in float64 on the frame's positions
    x = frame.xyz.clone().requires_grad_(True)
    atoms = problem.atoms.to("cpu", torch.float64)
    rho = splat_density(
        atoms.replace(xyz=x), problem.grid, radius=problem.radius, cutoff=problem.cutoff, backend="reference"
    )
    loss = ((rho - problem.target.double()) ** 2).sum() * v + lam * planarity_nll(x, problem.planes)
    loss.backward()
    assert loss.item() == pytest.approx(frame.loss, rel=1e-3)
    torch.testing.assert_close(torch.from_numpy(total), x.grad, rtol=2e-3, atol=1e-3 * x.grad.abs().max().item())


def test_bad_settings_are_refused_with_their_range():
    _, problem = _problem()
    with pytest.raises(ValueError, match=r"relax lr must lie in \[0.001, 0.5\], got -1"):
        compute.Relaxation(problem, lr=-1)
    with pytest.raises(ValueError, match="relax lam must be a number"):
        compute.Relaxation(problem, lam=float("nan"))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_target_with_a_non_finite_voxel_is_named_not_the_step_size(value):
    r, _ = _problem()
    planes = compute.find_planes(r.model)
    target = r.target.clone()
    target[3, 4, 5] = value
    target[7, 1, 2] = value
    s = WorkbenchState(structure="1orc", spacing=1.5).snapshot()
    with pytest.raises(
        compute.WorkbenchError, match=r"ρ_target holds 2 non-finite voxels .*first at voxel \(3, 4, 5\)"
    ) as e:
        compute.relax_problem(r.atoms, r.grid, target, planes, s)
    assert "step size" in str(e.value) and "whatever the step size" in str(e.value)


def test_a_stop_set_during_a_step_ends_the_run_after_that_step():
    _, problem = _problem()
    relaxation = compute.Relaxation(problem)
    stop = threading.Event()
    seen = []

    def emit(frame):
        seen.append(frame.step)
        if frame.step == 4:
            stop.set()

    assert compute.run_relaxation(relaxation, 100, stop=stop, emit=emit) == 5
    assert seen == [0, 1, 2, 3, 4]


def test_the_workbench_stops_within_one_step(make_wb):
    wb = make_wb(distort_amplitude=0.3, debounce=0.01)
    wb.flush()
    wb.start_relax(steps=5000)
    deadline = time.monotonic() + 60
    while wb._frames.n_put < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    wb.stop_relax()
    at_stop = wb._frames.n_put
    wb.flush()
    assert at_stop >= 3
    assert wb._frames.n_put <= at_stop + 1
    assert "relax stopped after" in wb.relax.progress.value
    assert not wb.relax.start.disabled and wb.relax.stop.disabled


def test_a_slow_view_gets_the_latest_frame_and_no_queue():
    _, problem = _problem()
    relaxation = compute.Relaxation(problem)
    in_flight, most, shown = [0], [0], []
    lock = threading.Lock()

    def slow_show(frame):  # a browser far slower than the loop
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        time.sleep(0.1)
        shown.append(frame.step)
        with lock:
            in_flight[0] -= 1

    mailbox = LatestOnly(slow_show)
    try:
        start = time.perf_counter()
        n = compute.run_relaxation(relaxation, 40, stop=threading.Event(), emit=mailbox.put)
        loop_s = time.perf_counter() - start
        assert mailbox.wait_idle(10)
    finally:
        mailbox.close()
    assert n == 40
    assert most[0] == 1  # one update in flight
    assert shown[-1] == 39  # the newest state is the one left on screen
    assert shown == sorted(shown) and len(shown) < 40
    assert mailbox.n_shown + mailbox.n_dropped == mailbox.n_put == 40
    assert loop_s < 0.1 * len(shown)  # the loop never waited for the view


def test_relax_moves_the_atoms_the_views_show(make_wb):
    wb = make_wb(distort_amplitude=0.3, gradient_kind="density")
    before = wb.result
    section_png, n_sections = wb.slice.image.value, wb.slice.n_updates
    wb.start_relax(steps=15, lr=0.05, lam=0.1)  # synchronous workbench: runs to the end here
    after = wb.result
    assert wb.relax_frame is not None and wb.relax_frame.step == 14
    ref = before.model.atoms.xyz
    assert compute.rmsd(after.atoms.xyz, ref) < compute.rmsd(before.atoms.xyz, ref) - 0.05
    assert after.gradient.kind == "density"
    assert not (after.gradient.grad == before.gradient.grad).all()
    assert "relax step 15" in wb.timing.current.value and "splat forward+backward" in wb.timing.current.value
    assert "relax finished after 15 steps" in wb.relax.progress.value
    assert wb.scene.view.model_text != ""  # the sticks were sent again with the new positions
    assert wb.slice.n_updates == n_sections + 15 and wb.slice.image.value != section_png  # the section follows
    # a changed setting goes back to the settings' own result
    wb.state.iso_sigma = 2.0
    assert wb.relax_frame is None
    torch.testing.assert_close(wb.result.atoms.xyz, before.atoms.xyz)


def test_relax_before_anything_is_computed_says_so():
    wb = workbench.Workbench("1orc", spacing=1.5, debounce=1.0, threaded=False)
    try:
        wb.start_relax()
        assert "nothing computed yet to relax" in wb.status.message
    finally:
        wb.close()


def test_a_slow_3d_view_in_the_workbench_draws_the_newest_step_one_at_a_time(make_wb):
    wb = make_wb(distort_amplitude=0.3, debounce=0.01)
    wb.flush()
    in_flight, most, drawn = [0], [0], []
    update = wb.scene.update

    def slow_update(result, **keys):  # a browser that takes 0.2 s per frame
        in_flight[0] += 1
        most[0] = max(most[0], in_flight[0])
        time.sleep(0.2)
        update(result, **keys)
        drawn.append(keys["model_key"][-1])
        in_flight[0] -= 1

    wb.scene.update = slow_update
    wb.start_relax(steps=60)
    wb.flush()
    assert most[0] == 1
    assert drawn[-1] == 59 and wb.relax_frame.step == 59  # the last step is what stays on screen
    assert len(drawn) < 60 and drawn == sorted(drawn)
    assert wb._frames.n_dropped == 60 - len(drawn)
