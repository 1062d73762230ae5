"""The relax control: the fit loop (workbench.compute.relax), its stop, and frames dropped for a slow view."""

from __future__ import annotations

import html
import threading
import time

import numpy as np
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is visible here")
def test_on_a_gpu_the_step_is_one_replayed_graph_with_each_terms_gradient():
    _, problem = _problem(device="cuda", backend="auto")
    lam = 0.7
    relaxation = compute.Relaxation(problem, lr=0.01, lam=lam)
    frames = [relaxation.step() for _ in range(6)]  # warm-up steps, the capture, replays
    assert relaxation._step is not None and relaxation._step.mode == "graph"
    frame = frames[-1]
    assert "step" in frame.timings and len(frame.timings) == 2
    v = problem.grid.voxel_volume
    x = frame.xyz.clone().requires_grad_(True)
    atoms = problem.atoms.to("cpu", torch.float64)
    rho = splat_density(
        atoms.replace(xyz=x), problem.grid, radius=problem.radius, cutoff=problem.cutoff, backend="reference"
    )
    fit = ((rho - problem.target.double().cpu()) ** 2).sum() * v
    (g_fit,) = torch.autograd.grad(fit, x)
    nll = planarity_nll(x, problem.planes.to("cpu"))
    (g_nll,) = torch.autograd.grad(nll, x)
    assert frame.fit == pytest.approx(fit.item(), rel=1e-3)
    assert frame.planarity == pytest.approx(nll.item(), rel=1e-3)
    torch.testing.assert_close(
        torch.from_numpy(2 * v * frame.density_gradient.grad), g_fit, rtol=2e-3, atol=1e-3 * g_fit.abs().max().item()
    )
    torch.testing.assert_close(
        torch.from_numpy(frame.planarity_gradient.grad), g_nll, rtol=2e-3, atol=1e-3 * g_nll.abs().max().item()
    )


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


def test_a_stop_set_during_a_step_ends_the_run_at_the_frame_before():
    """The loop receives the stop during step 3: the run ends at frame 2, the one on screen, and
    frame 3 (its positions were never shown) is not handed on."""
    _, problem = _problem()
    relaxation = compute.Relaxation(problem)
    stop = threading.Event()
    step, seen = relaxation.step, []

    def step_then_stop():
        frame = step()
        if frame.step == 3:
            stop.set()
        return frame

    relaxation.step = step_then_stop
    assert compute.run_relaxation(relaxation, 100, stop=stop, emit=lambda f: seen.append(f.step)) == 3
    assert seen == [0, 1, 2] and relaxation.n_steps == 4


def _shown_step(wb) -> int:
    """The step the progress line names ("step k/N"), 0 before any."""
    import re

    m = re.search(r"step (\d+)/\d+", wb.relax.progress.value)
    return int(m[1]) if m else 0


def test_the_workbench_stops_at_the_step_on_screen(make_wb):
    """Stop pressed while the views show step k: the run ends after step k or k + 1, the views
    then show the step the run ended at, and its positions are the result's."""
    wb = make_wb(distort_amplitude=0.3, debounce=0.01)
    wb.flush()
    wb.start_relax(steps=5000)
    deadline = time.monotonic() + 60
    while _shown_step(wb) < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    on_screen = _shown_step(wb)
    wb.stop_relax()
    wb.flush()
    import re

    done = int(re.search(r"relax stopped after (\d+) step", wb.relax.progress.value)[1])
    assert on_screen >= 3 and 0 <= done - on_screen <= 1, (on_screen, done)
    assert wb._frames.n_put == done and wb._frames.n_dropped == 0  # no step ran that was not shown
    assert wb.relax_frame.step + 1 == done and f"The views show step {done};" in wb.relax.progress.value
    torch.testing.assert_close(wb.result.atoms.xyz, wb.relax_frame.xyz, rtol=0, atol=0)
    assert f"relax step {done}:" in wb.timing.current.value
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
    text_before, map_before = wb.scene.view.model_text, wb.scene.view.map_bytes
    wb.start_relax(steps=15, lr=0.05, lam=0.1)  # synchronous workbench: runs to the end here
    after = wb.result
    assert wb.relax_frame is not None and wb.relax_frame.step == 14
    ref = before.model.atoms.xyz
    assert compute.rmsd(after.atoms.xyz, ref) < compute.rmsd(before.atoms.xyz, ref) - 0.05
    assert after.gradient.kind == "density"
    assert not (after.gradient.grad == before.gradient.grad).all()
    assert "relax step 15" in wb.timing.current.value and "splat forward+backward" in wb.timing.current.value
    assert "relax finished after 15 steps" in wb.relax.progress.value
    # the sticks' text is the start's; the positions shown are the frame's, sent alone (float32 by index)
    assert wb.scene.view.model_text == text_before
    shown = np.frombuffer(wb.scene.view.model_xyz, np.float32).reshape(-1, 3)
    np.testing.assert_array_equal(shown, wb.relax_frame.xyz.float().numpy())
    assert f"{wb.relax_frame.xyz[0, 0].item():8.3f}" in wb.to_py3dmol().startjs  # a static export draws them too
    assert wb.slice.n_updates == n_sections + 15 and wb.slice.image.value != section_png  # the section follows
    # the map box is the frame's map, cut in the start's box
    assert len(wb.scene.view.map_bytes) == len(map_before) and wb.scene.view.map_bytes != map_before
    # a changed setting goes back to the settings' own result: the start's positions again
    wb.state.iso_sigma = 2.0
    assert wb.relax_frame is None
    torch.testing.assert_close(wb.result.atoms.xyz, before.atoms.xyz)
    assert wb.scene.view.model_text == text_before and wb.scene.view.model_xyz == b""


def test_relax_before_anything_is_computed_says_so():
    wb = workbench.Workbench("1orc", spacing=1.5, debounce=1.0, threaded=False)
    try:
        wb.start_relax()
        assert "nothing computed yet to relax" in wb.status.message
    finally:
        wb.close()


def test_a_slow_3d_view_paces_the_loop_one_step_at_a_time(make_wb):
    """A view far slower than the loop: every step is drawn, in order, one at a time, and while
    step k is drawn no later step has run (the loop waits for the view: at most one step ahead)."""
    wb = make_wb(distort_amplitude=0.3, debounce=0.01)
    wb.flush()
    in_flight, most, drawn, put_when_drawn = [0], [0], [], []
    update = wb.scene.update

    def slow_update(result, **keys):  # a browser that takes 0.2 s per frame
        in_flight[0] += 1
        most[0] = max(most[0], in_flight[0])
        time.sleep(0.2)
        update(result, **keys)
        drawn.append(result.atoms_key[-1])  # the step (frame_result keys each frame by run and step)
        put_when_drawn.append(wb._frames.n_put)
        in_flight[0] -= 1

    wb.scene.update = slow_update
    wb.start_relax(steps=12)
    wb.flush()
    assert most[0] == 1
    assert drawn == list(range(12)) and wb.relax_frame.step == 11
    assert put_when_drawn == list(range(1, 13))  # frame k drawn while only k + 1 frames were made
    assert wb._frames.n_dropped == 0


def test_every_value_on_screen_is_the_relax_frames(make_wb):
    """Under relax, the picked atom's label, the atom table and the line profile are those of the
    positions and map shown (not the settings' result they started from), during and after the run."""
    from workbench.compute.maps import density_at_points, line_profile

    wb = make_wb(distort_amplitude=0.3, gradient_kind="planarity", spacing=1.2)
    before = wb.result
    i = 40
    wb.pick_atom(i)  # synchronous: recomputes for the residue and labels the atom
    start_label = wb.scene.pick.text()
    seen = []
    show = wb._show_frame

    def check_each(item):
        show(item)
        r, frame = wb.result, wb.relax_frame
        rho = density_at_points(r.rho, r.grid, frame.xyz)
        grad = frame.planarity_gradient.grad
        seen.append(frame.step)
        # the label: ρ and |∇| of the picked atom where it is now
        assert wb.scene.pick.rho == pytest.approx(rho[i], rel=1e-5)
        assert wb.scene.pick.gradient_norm == pytest.approx(float(np.linalg.norm(grad[i])), rel=1e-6)
        assert wb.scene.pick.xyz == pytest.approx(tuple(frame.xyz[i].tolist()))
        # the table and the profile sample the frame's map at the frame's positions
        np.testing.assert_allclose(r.atom_rho, rho, rtol=1e-5, atol=1e-7)
        a, b = r.settings.profile_atoms
        _, values = line_profile(r.rho, r.grid, frame.xyz[a].numpy(), frame.xyz[b].numpy())
        np.testing.assert_allclose(wb.profile.line.get_ydata(), values, rtol=1e-5, atol=1e-7)
        largest = float(np.linalg.norm(grad, axis=1).max())
        assert f"largest |∇| {largest:.3g}" in wb.scene.caption.value

    wb._frames.show = check_each
    wb.start_relax(steps=8, lr=0.05, lam=1.0)
    assert seen == list(range(8))
    assert wb.scene.pick.text() != start_label and wb.result is not before
    assert html.escape(wb.scene.pick.text()) in wb.scene.picked.value  # the line under the view says the same


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_loops_adam_gives_torch_optim_adams_bits(dtype):
    g = torch.Generator().manual_seed(7)
    start = torch.randn(37, 3, generator=g, dtype=dtype)
    grads = [torch.randn(37, 3, generator=g, dtype=dtype) * 10.0**k for k in (-3, 0, 2, -1, 1, 0)]
    ours, theirs = start.clone(), start.clone().requires_grad_(True)
    adam, reference = compute.relax.AdamUpdate(ours, lr=0.05), torch.optim.Adam([theirs], lr=0.05)
    for grad in grads:
        adam.step(grad)
        theirs.grad = grad.clone()
        reference.step()
        torch.testing.assert_close(ours, theirs.detach(), rtol=0, atol=0)


def test_a_first_relax_step_imports_no_compiler():
    """The first run's first frame waits for nothing but its own step: torch.optim's first Adam imports
    torch._dynamo (seconds on a busy 2-core machine); the loop's update does not."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from workbench import compute\n"
        "from workbench.state import WorkbenchState\n"
        "s = WorkbenchState(structure='1orc', spacing=1.5, distort_amplitude=0.3).snapshot()\n"
        "r = compute.Pipeline().run(s)\n"
        "p = compute.relax_problem(r.atoms, r.grid, r.target, compute.find_planes(r.model), s)\n"
        "relaxation = compute.Relaxation(p)\n"
        "frames = [relaxation.step() for _ in range(2)]\n"
        "assert frames[1].fit < frames[0].fit, [f.fit for f in frames]\n"
        "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))\n"
    )
    import os
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_the_relax_view_plots_r_and_correlation_against_the_true_models_factors(make_wb):
    """Each frame drawn adds its R-factor and correlation of |F| (to 2 Å, or the finest the grid holds)
    against the factors of ρ_target, the undistorted model's map; fitting the map brings R down and the
    correlation up."""
    import kernels
    from kernels.reciprocal import finest_d_min

    wb = make_wb(distort_amplitude=0.3)
    wb.start_relax(steps=8, lr=0.05, lam=0.0)
    points = wb.relax.agreement
    assert [p[0] for p in points] == list(range(8))
    r, frame = wb.result, wb.relax_frame
    # the last point, by hand from kernels' factors: R = Σ||F| − |F_true|| / Σ|F_true|, Pearson CC of |F|
    d = max(2.0, finest_d_min(r.grid))
    true = kernels.structure_factors(r.target.to(frame.rho.dtype), r.grid, d, blur=r.settings.blur).amplitudes
    f = kernels.structure_factors(frame.rho, r.grid, d, blur=r.settings.blur).amplitudes
    rf = float((f - true).abs().sum() / true.sum())
    cc = float(torch.corrcoef(torch.stack([f.double(), true.double()]))[0, 1])
    assert points[-1][1] == pytest.approx(rf, rel=1e-4) and points[-1][2] == pytest.approx(cc, abs=1e-5)
    assert points[-1][1] < 0.8 * points[0][1] and points[-1][2] > points[0][2]
    assert 0.05 < points[0][1] < 1.0 and 0.5 < points[0][2] < 1.0  # the distorted start: far from both ends
    # the plot: one polyline each, a point per frame, and what it compares with
    svg = wb.relax.plot.value
    assert svg.count('data-points="8"') == 2 and 'class="wb-relax-r"' in svg and 'class="wb-relax-cc"' in svg
    assert "the undistorted model" in svg and f"to {d:.3g} Å" in svg
    # a new run starts a new plot
    wb.start_relax(steps=3)
    assert [p[0] for p in wb.relax.agreement] == [0, 1, 2] and 'data-points="3"' in wb.relax.plot.value


def test_the_true_models_factors_agree_with_themselves():
    r, problem = _problem()
    reference = compute.factor_reference(problem.target, problem.grid, blur=problem.blur)
    rf, cc = compute.factor_agreement(problem.target, problem.grid, reference)
    assert rf == 0.0 and cc == pytest.approx(1.0, abs=1e-12)
    # a coarse grid that cannot hold 2 Å: the finest it holds
    from kernels.reciprocal import finest_d_min

    assert reference.d_min == max(compute.AGREEMENT_D_MIN, finest_d_min(problem.grid))
