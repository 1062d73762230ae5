"""The Workbench as a person (or a browser message) drives it, without a browser.

Every test sets widget values or calls ``set_state`` (the path a browser message
takes) and asserts on the state, the computed arrays, the view traits, the image bytes
and the status line.
"""

from __future__ import annotations

import dataclasses
import datetime
import gzip
import io
import re
import threading
import warnings

import ipywidgets as widgets
import numpy as np
import pytest
import torch
import traitlets

import kernels
import workbench
from tests.helpers import STRUCTURES, model, requires_cuda
from workbench.compute import WorkbenchError
from workbench.state import Settings
from workbench.views.slice import MIN_SCALE_FRACTION, axis_labels
from workbench.views.view3d import (
    ARROW_MAX_LENGTH,
    ARROW_MIN_LENGTH,
    ARROW_SCALE,
    CDN_URL,
    LIB_ENV,
    View3D,
    gradient_arrows,
)

PNG = b"\x89PNG\r\n\x1a\n"


def _png_size(data: bytes) -> tuple[int, int]:
    from PIL import Image

    img = Image.open(io.BytesIO(data))
    img.load()
    return img.size


def test_default_app_builds_every_view(make_wb):
    wb = make_wb()
    r = wb.result
    assert wb.status.level == "idle", wb.status.message
    assert wb.status.message.startswith("ready: 559 atoms")
    assert r.grid.shape == wb.state.grid_shape == (24, 30, 36)
    assert "24×30×36" in wb.controls.grid_shape.value
    assert bytes(wb.slice.image.value).startswith(PNG) and _png_size(bytes(wb.slice.image.value)) == (560, 480)
    assert bytes(wb.profile.image.value).startswith(PNG)
    assert "<table" in wb.table.html.value and "map of the undistorted model" in wb.table.html.value
    view = wb.scene.view
    assert sum(line.startswith(("ATOM", "HETATM")) for line in view.model_text.splitlines()) == 559
    assert view.map_bytes[208:212] == b"MAP "  # a CCP4 header, sent as bytes
    assert view.iso_level == pytest.approx(r.mean + 1.5 * r.sigma)
    assert r.gradient is not None and r.gradient.kind == "planarity"
    assert "planarity forward" in wb.timing.current.value
    # the CSS classes the browser tests look for
    for widget, css in [
        (wb, "wb-app"), (wb.status.label, "wb-status"), (wb.controls.b_global, "wb-bfactor"),
        (wb.slice.image, "wb-slice"), (view, "wb-view3d"), (wb.controls.distort_amplitude, "wb-distort"),
        (wb.controls.path, "wb-structure-path"),
    ]:  # fmt: skip
        assert css in widget._dom_classes


def test_b_factor_slider_recomputes_the_map_with_one_global_b(make_wb):
    wb = make_wb()
    before = bytes(wb.slice.image.value)
    wb.controls.b_global.value = 45.0  # moving the global-B slider selects global mode
    assert wb.state.b_mode == "global" and wb.controls.b_mode.value == "global"
    r = wb.result
    assert (r.atoms.b_iso == 45.0).all()
    m = model("1orc")
    expected = kernels.splat_density(
        m.atoms.replace(b_iso=torch.full_like(m.atoms.b_iso, 45.0)).to(dtype=torch.float32), r.grid
    )
    torch.testing.assert_close(r.rho, expected)
    assert bytes(wb.slice.image.value) != before
    runs = wb.scheduler.n_runs
    wb.controls.b_offset.set_state({"value": 5.0})  # browser path; selects offset mode, one recompute
    assert wb.scheduler.n_runs == runs + 1
    torch.testing.assert_close(wb.result.atoms.b_iso, m.atoms.b_iso + 5.0)


def test_slice_index_and_axis_update_the_section_in_place(make_wb):
    wb = make_wb()
    image = wb.slice.image
    before = bytes(image.value)
    wb.controls.slice_index.set_state({"value": 7})
    assert wb.state.slice_index == 7 and wb.result.section.index == 7
    np.testing.assert_array_equal(wb.result.section.values, wb.result.rho[:, :, 7].numpy())
    assert wb.slice.image is image and bytes(image.value) != before  # same widget, new bytes
    wb.controls.slice_axis.value = "a"
    assert wb.state.slice_index_max == 23 and wb.controls.slice_index.max == 23
    assert wb.result.section.values.shape == (30, 36)
    wb.controls.spacing.value = 3.0  # coarser grid: fewer sections, index clamped
    assert wb.result.grid.shape[0] - 1 == wb.state.slice_index_max
    assert wb.state.slice_index <= wb.state.slice_index_max


def test_hexagonal_section_is_not_square(make_wb):
    wb = make_wb("1pfe", spacing=1.5)
    sec = wb.result.section
    cos = np.dot(sec.e_u, sec.e_v) / np.linalg.norm(sec.e_u) / np.linalg.norm(sec.e_v)
    assert cos == pytest.approx(-0.5)
    # the image is drawn in Å: its raster spans the rhombus's bounding box (from the display
    # pixel edge at or just before its corner), NaN outside the face
    x0, x1, y0, y1 = wb.slice.im.get_extent()
    pixel = wb.slice.last.pixel
    assert sec.e_v[0] - pixel < x0 <= sec.e_v[0] + 1e-9 and -pixel < y0 <= 1e-9
    assert x1 >= sec.e_u[0] - 1e-9 and y1 >= sec.e_v[1] - 1e-9
    values = wb.slice.last.values
    assert np.isnan(values[-1, -1]) and np.isnan(values[0, 0]) and not np.isnan(values[0, values.shape[1] // 2])


def test_distortion_draws_planarity_arrows_with_a_stated_scale(make_wb):
    wb = make_wb()
    r0 = wb.result
    # The undistorted model's small residual non-planarity draws no arrows at all.
    assert len(wb.scene.view.arrow_array) == 0
    assert "0 of 559 atoms" in wb.scene.caption.value
    wb.controls.distort_amplitude.value = 0.3
    r = wb.result
    assert r.gradient.kind == "planarity" and r.gradient.loss > r0.gradient.loss
    arrows = wb.scene.view.arrow_array
    assert len(arrows) > 50
    scale = wb.scene.arrow_scale
    assert scale == ARROW_SCALE["planarity"]  # fixed: the same pull is the same length after any distortion
    assert f"1 Å of arrow = {1 / scale:.4g} 1/Å" in wb.scene.caption.value
    assert f"{len(arrows)} of 559 atoms" in wb.scene.caption.value
    # every arrow starts at an atom and points along −∇, scaled by the stated scale
    xyz = r.atoms.xyz.numpy()
    for start, end in zip(arrows[:20, :3], arrows[:20, 3:]):
        i = int(np.argmin(np.linalg.norm(xyz - start, axis=1)))
        np.testing.assert_allclose(start, xyz[i], atol=1e-4)
        np.testing.assert_allclose(end - start, -r.gradient.grad[i] * scale, rtol=1e-4, atol=1e-4)
    lengths = np.linalg.norm(arrows[:, 3:] - arrows[:, :3], axis=1)
    assert lengths.min() >= ARROW_MIN_LENGTH - 1e-5
    # a larger distortion pulls harder: more and longer arrows at the same scale
    wb.controls.distort_amplitude.value = 0.5
    more = wb.scene.view.arrow_array
    assert len(more) > len(arrows)
    assert np.linalg.norm(more[:, 3:] - more[:, :3], axis=1).max() > lengths.max()
    assert wb.scene.view.arrow_color.lower() not in ("#ff0000", "#e02020")  # not the oxygen red
    assert "wb-view3d" in wb.scene.view._dom_classes


def test_density_fit_gradient_against_the_undistorted_model(make_wb):
    wb = make_wb("1pfe", spacing=1.5, gradient_kind="density")
    assert wb.result.gradient.kind == "density"
    assert wb.result.gradient.loss == 0  # undistorted: ρ_model = ρ_target
    assert "no arrows" in wb.scene.caption.value or "zero" in wb.scene.caption.value
    wb.controls.distort_amplitude.value = 0.2
    g = wb.result.gradient
    assert g.loss > 0 and np.abs(g.grad).max() > 0 and "density backward" in wb.result.timings
    assert len(wb.scene.view.arrow_array) > 0 and "(e/Å³)²/Å" in wb.scene.caption.value
    # atoms moved away from their density: target/model ratio < 1 for the worst ones
    ratio = wb.result.atom_target / wb.result.atom_rho
    assert wb.table.order[0] == int(np.argmin(ratio)) and ratio.min() < 0.9


def test_loaded_target_map(make_wb, tmp_path):
    wb = make_wb("1pfe", spacing=1.5, gradient_kind="density")
    path = tmp_path / "target.ccp4"
    wb.export_map(path)  # the undistorted map, written by kernels.write_map
    assert b"density-workbench xray map, unit e/A^3" in path.read_bytes()[:1024]  # the unit in its label
    wb.controls.distort_amplitude.value = 0.2
    loss_default = wb.result.gradient.loss
    wb.controls.target_map.value = str(path)
    assert wb.result.target_source == "target.ccp4"
    assert wb.result.gradient.loss == pytest.approx(loss_default, rel=1e-5)
    wb.controls.spacing.value = 1.2  # a different grid: the map is resampled (tricubic)
    assert "resampled" in wb.result.target_source and wb.result.gradient.loss > 0
    wb.controls.target_map.value = str(tmp_path / "nope.ccp4")
    assert wb.status.level == "error" and "no such map file" in wb.status.message


def test_switching_backend_or_device_never_changes_the_physics(make_wb):
    wb = make_wb("1pfe", spacing=1.5)
    cpu = wb.result.rho.clone()
    wb.controls.backend.value = "reference"
    assert wb.result.backend == "reference" and wb.result.rho.dtype == torch.float64
    torch.testing.assert_close(cpu.double(), wb.result.rho, atol=1e-5 * float(cpu.max()), rtol=1e-5)
    wb.compare("cpu:cpu", "cpu:reference")
    d = wb.difference_result
    assert d.maps.ok and d.maps.n_total == cpu.numel() and d.maps.rel_l2 < 1e-5
    assert d.gradients is not None and d.gradient_kind == "planarity" and d.gradients.ok
    assert "within" in wb.difference.stats.value and bytes(wb.difference.slice.image.value).startswith(PNG)
    assert "within the float32 tolerance" in wb.status.message
    if torch.cuda.is_available():
        wb.compare("cuda:triton", "cpu:reference")
        assert wb.difference_result.maps.ok


def test_cuda_without_a_gpu_is_not_offered_and_refused_with_the_reason(make_wb):
    # Was: cuda listed but disabled, and a browser message selecting it refused. Now only
    # runnable devices are offered at all (issue 19), so a browser cannot even send it.
    wb = make_wb()
    if torch.cuda.is_available():
        wb.controls.device.value = "cuda"
        assert wb.result.settings.device == "cuda" and wb.status.level != "error"
        return
    assert wb.controls.device.options == ("cpu",)
    assert "cuda not offered" in wb.controls.device_reason.value
    with pytest.raises(traitlets.TraitError, match="device 'cuda' is not available: .*use device 'cpu'"):
        wb.state.device = "cuda"  # from code: refused with the reason
    assert wb.state.device == "cpu" and wb.controls.device.value == "cpu"


def test_only_runnable_backends_are_offered_and_the_others_say_why(make_wb, monkeypatch):
    # Was test_a_backend_that_cannot_run_reports_it: "triton" was offered on a CPU-only
    # machine, and choosing it left the dropdown on it while the CPU map stayed (issue 19).
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # as in a notebook on a machine without GPU
    wb = make_wb()  # device cpu: triton needs CUDA tensors (or the interpreter) there, GPU or not
    options = wb.controls.backend.options
    assert options[0] == "auto" and {"cpu", "reference"} <= set(options) and "triton" not in options
    note = wb.controls.backend_reason.value
    assert "triton" in note and "runs on CUDA tensors" in note, note
    assert "triton" in wb.controls.backend.tooltip
    # a script asking for it is refused with the reason and the runnable choices; nothing changes
    runs = wb.scheduler.n_runs
    with pytest.raises(traitlets.TraitError, match=r"backend 'triton' cannot run on cpu: .*CUDA.*choose one of auto, "):
        wb.state.backend = "triton"
    assert wb.state.backend == "auto" and wb.controls.backend.value == "auto" and wb.scheduler.n_runs == runs
    # what is offered runs, and the control always names what computed the map on screen
    for name in options:
        wb.controls.backend.value = name
        assert wb.status.level == "idle", (name, wb.status.message)
        assert wb.result.settings.backend == wb.controls.backend.value == name
        assert wb.result.backend == ("cpu" if name == "auto" else name)
    # the difference view offers only runnable pairs too
    assert "cpu:triton" not in wb.difference.a.options and "cpu:cpu" in wb.difference.a.options


def test_truncated_file_reports_an_error_and_keeps_the_last_result(make_wb, tmp_path):
    wb = make_wb()
    good = wb.result
    data = gzip.decompress(STRUCTURES["1pfe"].read_bytes())
    bad = tmp_path / "truncated.cif.gz"
    bad.write_bytes(gzip.compress(data)[: len(data) // 20])
    wb.controls.path.value = str(bad)
    assert wb.state.structure == str(bad) and wb.controls.structure.value == "file"
    assert wb.status.level == "error"
    assert "truncated.cif.gz" in wb.status.message and "Choose another file or a bundled example" in wb.status.message
    assert "Traceback" not in wb.status.message
    assert wb.result is good  # nothing half-computed replaced the views
    # … which say that they are not for the settings shown (issue 34: stale views)
    for caption in (wb.slice.caption.value, wb.scene.caption.value):
        assert (
            "wb-stale" in caption
            and "out of date" in caption
            and "truncated.cif.gz at 1.5 Å could not be computed" in caption
        )
    wb.controls.structure.value = "1orc"
    assert wb.status.level == "idle" and len(wb.result.model) == 559
    assert "wb-stale" not in wb.slice.caption.value and "wb-stale" not in wb.scene.caption.value


@pytest.mark.parametrize(
    "name, text, expected",
    [
        ("negative.pdb", "CRYST1  -30.000   40.000   50.000  90.00  90.00  90.00 P 1           1\n", ["CRYST1", "a = -30 Å"]),
        ("angles.pdb", "CRYST1   30.000   40.000   50.000 100.00 100.00 170.00 P 1           1\n", ["sum to 370°"]),
        ("trigonal.pdb", "CRYST1   30.000   40.000   50.000  90.00  90.00  90.00 P 31 2 1      1\n", ["P 31 2 1"]),
        ("letters.pdb", "CRYST1   30.000   40.000   50.000  90.00  90.00  90.00 P 1           1\n", ["x coordinate"]),
    ],
)  # fmt: skip
def test_bad_model_is_reported_as_a_model_problem_not_a_backend_one(make_wb, tmp_path, name, text, expected):
    wb = make_wb()
    good = wb.result
    x = "  1O.OOO" if name == "letters.pdb" else "   1.000"
    path = tmp_path / name
    path.write_text(text + f"ATOM      1  N   ALA A   1    {x}   2.000   3.000  1.00 10.00           N\n")
    wb.controls.path.value = str(path)
    assert wb.status.level == "error"
    message = wb.status.message
    assert message.startswith("error: model file problem: ") and name in message, message
    assert all(part in message for part in expected), message
    assert "backend" not in message and "unexpected" not in message and "Traceback" not in message
    assert wb.result is good


def test_model_without_a_cell_gets_a_box_and_says_so(make_wb, tmp_path):
    text = gzip.decompress(STRUCTURES["1orc"].read_bytes()).decode()
    lines = [ln for ln in text.splitlines() if not ln.startswith(("CRYST1", "SCALE", "ORIGX"))]
    path = tmp_path / "nocell.pdb"
    path.write_text("\n".join(lines) + "\n")
    wb = make_wb(path)
    assert wb.status.level == "warning"
    assert "note: no unit cell in the file: built a P 1 box" in wb.status.message
    r = wb.result
    assert r.model.spacegroup == "P 1" and float(r.rho.sum()) * r.grid.voxel_volume > 3000


def test_uploaded_file_is_read(make_wb):
    wb = make_wb()
    content = STRUCTURES["1pfe"].read_bytes()
    wb.controls.upload.value = (
        {"name": "my 1pfe.cif.gz", "type": "", "size": len(content), "content": memoryview(content),
         "last_modified": datetime.datetime.now()},
    )  # fmt: skip
    assert wb.state.structure.endswith("my_1pfe.cif.gz")
    assert len(wb.result.model) == 342 and wb.status.level == "idle"
    content = STRUCTURES["1orc"].read_bytes()  # another file under the same name
    wb.controls.upload.value = (
        {"name": "my 1pfe.cif.gz", "type": "", "size": len(content), "content": memoryview(content),
         "last_modified": datetime.datetime.now()},
    )  # fmt: skip
    assert wb.status.level == "error"  # 1orc is PDB text, not mmCIF: gemmi refuses it under a .cif name
    assert "my_1pfe.cif.gz" in wb.status.message


def test_model_object_and_exports(make_wb, tmp_path):
    m = kernels.read_model(STRUCTURES["1orc"])
    wb = make_wb(m, distort_amplitude=0.2)
    assert wb.result.model is m
    out = wb.export_map(tmp_path / "map.ccp4")
    rho, grid = kernels.read_map(out)
    assert grid.shape == wb.result.grid.shape
    np.testing.assert_array_equal(rho.numpy(), wb.result.rho.numpy())
    csv = wb.export_gradients(tmp_path / "grad.csv").read_text().splitlines()
    assert len(csv) == len(m) + 2
    gx = np.array([float(line.split(",")[9]) for line in csv[2:]])
    np.testing.assert_allclose(gx, wb.result.gradient.grad[:, 0], rtol=1e-6)
    # the buttons download to the browser: nothing is written on the server
    sent = []
    wb.download.send = lambda content, buffers=None: sent.append((content, buffers))
    wb.controls.export_path.value = str(tmp_path / "no_such_dir" / "x.ccp4")
    assert (
        "downloads x.ccp4 / x_gradients.csv to your browser (the model: x_model.pdb)" in wb.controls.export_note.value
    )
    assert wb.controls.export_names() == ("x.ccp4", "x_gradients.csv")
    wb.controls.export_path.value = "workbench_map.ccp4"  # the default: each file named after what it holds
    assert wb.controls.export_names() == ("workbench_map.ccp4", "workbench_gradients.csv")
    assert wb.controls.model_name() == "workbench_model.pdb"
    wb.controls.export_path.value = str(tmp_path / "no_such_dir" / "x.ccp4")
    wb.controls.export_map.click()
    ((content, buffers),) = sent
    assert content == {"type": "download", "filename": "x.ccp4", "mime": "application/octet-stream"}
    data = bytes(buffers[0])
    assert data[208:212] == b"MAP " and np.frombuffer(data[:12], "<i4").tolist() == list(wb.result.grid.shape)
    (tmp_path / "got.ccp4").write_bytes(data)
    rho2, grid2 = kernels.read_map(tmp_path / "got.ccp4")
    np.testing.assert_array_equal(rho2.numpy(), wb.result.rho.numpy())
    assert (
        wb.status.level == "idle"
        and "downloading x.ccp4" in wb.status.message
        and "to your browser" in wb.status.message
    )
    assert not (tmp_path / "no_such_dir").exists()
    wb.controls.export_gradients.click()
    content, buffers = sent[-1]
    assert content["filename"] == "x_gradients.csv" and content["mime"] == "text/csv"
    assert bytes(buffers[0]).decode().splitlines() == csv
    wb.set(distort_amplitude=0.0, gradient_kind="planarity")
    n = len(sent)
    wb.result.gradient = None  # nothing to export: said in the status line, nothing sent
    wb.controls.export_gradients.click()
    assert wb.status.level == "error" and "export failed: no gradient" in wb.status.message and len(sent) == n


def test_to_py3dmol_carries_the_scene(make_wb):
    wb = make_wb(distort_amplitude=0.3)
    view = wb.to_py3dmol()
    js = view.startjs
    assert "addVolumetricData" in js and "addArrow" in js and "addModel" in js


def test_3dmol_loads_from_a_configured_local_file(tmp_path, monkeypatch):
    lib = tmp_path / "3Dmol-min.js"
    lib.write_text("window.$3Dmol = {createViewer(){}};")
    monkeypatch.setenv(LIB_ENV, str(lib))
    assert View3D().lib_source == lib.read_text()
    monkeypatch.delenv(LIB_ENV)
    default = View3D()
    assert default.lib_source == "" and default.lib_url == CDN_URL
    with pytest.raises(WorkbenchError, match="3Dmol.js not found"):
        View3D(lib_path=tmp_path / "missing.js")


def test_an_old_result_never_replaces_a_newer_one(make_wb):
    wb = make_wb()
    original_step = wb.status.step
    fired = []

    def step(i, n, what):
        original_step(i, n, what)
        # While the B = 30 computation is half-way (after its section), the user moves on:
        if what.startswith("planarity") and wb.state.b_global == 30.0 and not fired:
            fired.append(True)
            wb.controls.b_global.value = 60.0  # debounce=0: computes and applies at once

    wb.status.step = step
    stale = wb.n_stale
    wb.controls.b_global.value = 30.0
    assert fired and wb.n_stale == stale + 1
    assert wb.result.settings.b_global == 60.0  # the B = 30 result came back later and was dropped
    assert (wb.result.atoms.b_iso == 60.0).all()
    np.testing.assert_array_equal(wb.result.section.values, wb.result.rho[:, :, wb.state.slice_index].numpy())


def test_cancel_stops_at_the_next_stage_and_says_so(make_wb):
    wb = make_wb()
    original_step = wb.status.step

    def step(i, n, what):
        original_step(i, n, what)
        if what.startswith("planarity"):
            wb.cancel()

    wb.status.step = step
    wb.controls.b_global.value = 25.0
    assert wb.status.level == "cancelled" and "cancelled" in wb.status.message
    assert wb.status.cancel.disabled and wb.status.progress.value == 0


def test_threaded_app_debounces_a_drag_and_keeps_the_caller_free(make_wb):
    wb = make_wb(debounce=0.05)
    wb.flush()
    threads = []
    original = wb._recompute

    def recompute(gen):
        threads.append(threading.current_thread().name)
        original(gen)

    wb.scheduler.recompute = recompute
    for i in range(40):
        wb.controls.b_global.set_state({"value": 20.0 + i})
    wb.flush()
    assert 1 <= len(threads) < 40 and set(threads) == {"workbench-recompute"}
    assert wb.result.settings.b_global == 59.0 and (wb.result.atoms.b_iso == 59.0).all()
    assert wb.status.level == "idle"


def test_fake_clock_debounce_in_the_app(make_wb):
    clock = [0.0]
    wb = make_wb(debounce=0.1, threaded=False, clock=lambda: clock[0])
    assert wb.result is None  # nothing computed until polled
    clock[0] = 0.2
    assert wb.poll() and wb.result is not None
    runs = wb.scheduler.n_runs
    for i in range(5):
        wb.controls.slice_index.value = i + 1
        clock[0] += 0.05
    assert not wb.poll() and wb.scheduler.n_runs == runs
    clock[0] += 0.1
    assert wb.poll() and wb.scheduler.n_runs == runs + 1 and wb.result.section.index == 5


def test_compare_all_backends_times_forward_and_backward(make_wb):
    wb = make_wb("1pfe", spacing=2.0)
    wb.compare_all_backends()
    rows = wb.timing.rows
    ran = {(r["op"], r["backend"]) for r in rows if not r["error"]}
    assert {("density", "cpu"), ("density", "reference"), ("planarity", "cpu"), ("planarity", "reference")} <= ran
    for r in rows:
        if not r["error"]:
            assert r["forward_ms"] > 0 and r["backward_ms"] > 0
    assert "<table>" in wb.timing.table.value and wb.status.level == "idle"


def test_opens_on_the_middle_of_the_model_and_shows_a_residue_region(make_wb):
    wb = make_wb()
    assert len(wb.result.near[0]) > 10  # the opening section cuts through the model
    whole = len(wb.scene.view.map_bytes)
    key, label = wb.controls.region.options[5][1], wb.controls.region.options[5][0]
    wb.controls.region.value = key
    assert wb.state.region == key and f"residue {key}" in wb.scene.caption.value
    assert len(wb.scene.view.map_bytes) < whole / 5
    chain, seq = key.split("/")
    assert wb.scene.view.focus == {"chain": chain, "resi": int(seq)} and label.startswith(chain)
    sel = [i for i, lab in enumerate(wb.result.model.atoms.labels) if f"{lab.chain}/{lab.seq_num}" == key]
    assert len(sel) > 0


@requires_cuda
def test_cuda_device_gives_the_cpu_physics(make_wb):
    wb = make_wb("1pfe", spacing=1.0)
    cpu = wb.result.rho.clone()
    wb.controls.device.value = "cuda"
    assert wb.result.settings.device == "cuda" and wb.result.backend == "triton", wb.status.message
    torch.testing.assert_close(wb.result.rho, cpu, atol=1e-5 * float(cpu.max()), rtol=1e-5)
    wb.compare("cuda:triton", "cpu:reference")
    assert wb.difference_result.maps.ok and wb.difference_result.gradients.ok


def test_during_a_drag_the_3d_scene_follows_at_most_once_a_second(make_wb):
    clock = [0.0]
    wb = make_wb(debounce=0.05, threaded=False, clock=lambda: clock[0])
    wb.flush()
    original_step = wb.status.step
    sent = []
    wb.scene.view.observe(lambda ch: sent.append(clock[0]), names="map_bytes")

    def step(i, n, what):  # the pointer keeps moving while each result is computed
        original_step(i, n, what)
        if what.startswith("planarity"):
            wb.controls.iso_sigma.value = round(wb.controls.iso_sigma.value + 0.1, 1)

    wb.status.step = step
    for k in range(8):  # a result every 0.3 s, each with newer settings already waiting
        wb.controls.b_global.value = 30.0 + k
        clock[0] += 0.3
        assert wb.poll()
    assert wb.n_applied >= 8
    assert 2 <= len(sent) <= 4  # ~every second, not 8 times
    wb.status.step = original_step
    clock[0] += 1.0
    wb.flush()  # settled: the scene shows the last settings
    assert wb.result.settings.b_global == 37.0 and wb.scene.view.iso_level == pytest.approx(wb.result.iso_level)


def test_gradient_arrows_scale_threshold_and_clip():
    xyz = np.zeros((4, 3), np.float32)
    grad = np.array([[100.0, 0, 0], [0, 300.0, 0], [0, 0, 2000.0], [9000.0, 0, 0]])
    arrows, caption = gradient_arrows(xyz, grad, "planarity", "1/Å")
    # 100 1/Å → 0.1 Å: under the threshold; 9000 → 9 Å: clipped to the longest length
    assert arrows.shape == (3, 6)
    lengths = np.linalg.norm(arrows[:, 3:] - arrows[:, :3], axis=1)
    np.testing.assert_allclose(lengths, [ARROW_MAX_LENGTH, 2.0, 0.3], rtol=1e-6)
    np.testing.assert_allclose(arrows[2, 3:], [0, -0.3, 0], atol=1e-6)  # along −∇
    assert "3 of 4 atoms" in caption and "1 clipped" in caption
    none, caption = gradient_arrows(xyz, grad[:1], "planarity", "1/Å")
    assert none.shape == (0, 6) and "no distortion?" in caption


def test_slice_colour_scale_follows_the_section_or_the_map(make_wb):
    wb = make_wb(slice_axis="a")
    r = wb.result
    section_max = float(r.section.values.max())
    map_max = float(r.rho.max())
    lo, hi = wb.slice.im.get_clim()
    assert lo == 0.0 and section_max <= hi <= 1.5 * section_max  # this section's range, not the map's
    # the caption states the range the bar shows, and the bar labels both its ends
    caption = wb.slice.caption.value
    assert f"colour bar {lo:.3g} … {hi:.3g} e/Å³ (rounded out from this section's ρ" in caption
    assert f"… {section_max:.3g})" in caption
    ticks = wb.slice.cbar.get_ticks()
    assert ticks[0] == pytest.approx(lo) and ticks[-1] == pytest.approx(hi)
    wb.controls.slice_scale.value = "map"
    assert wb.state.slice_scale == "map"
    lo, hi = wb.slice.im.get_clim()
    assert hi >= map_max
    assert f"colour bar {lo:.3g} … {hi:.3g} e/Å³ (rounded out from the whole map's ρ" in wb.slice.caption.value
    assert wb.slice.cbar.get_ticks()[-1] == pytest.approx(hi)
    # plain axis labels on an orthogonal cell
    assert (wb.slice.ax.get_xlabel(), wb.slice.ax.get_ylabel()) == ("b (Å)", "c (Å)")


def test_near_empty_section_is_not_stretched_and_oblique_labels_are_honest(make_wb):
    wb = make_wb("1pfe", spacing=1.5)
    sec = wb.result.section
    xlabel, ylabel, note = axis_labels(sec)
    assert xlabel == "a (Å)" and "⊥ a" in ylabel and "120.0°" in note
    empty = dataclasses.replace(sec, values=np.full_like(sec.values, 1e-38))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow in matplotlib's image scaling
        wb.slice.update(empty, scale="section")
    assert wb.slice.im.get_clim()[1] >= MIN_SCALE_FRACTION * sec.map_range[1]


def test_settings_in_the_constructor_are_applied_once_the_model_is_read(make_wb):
    wb = make_wb(region="A/3")  # the residue list is empty until the model loads
    assert wb.state.region == "A/3" and wb.controls.region.value == "A/3"
    assert "residue A/3" in wb.scene.caption.value
    wb.controls.distort_amplitude.value = 0.5
    # arrows for every atom in the residue's box (its neighbours too), not only its own 9 atoms
    in_box = int(re.search(r"of (\d+) atoms", wb.scene.caption.value).group(1))
    assert in_box > 9 and 0 < len(wb.scene.view.arrow_array) <= in_box
    bad = make_wb(region="Z/999")
    assert bad.state.region == "" and bad.controls.region.value == ""
    assert bad.status.level == "warning" and "'Z/999' is not a residue of this model" in bad.status.message


def test_a_new_model_does_not_keep_the_old_models_region(make_wb):
    # Issue 34: region "A/3" (GLN 3 of 1ORC) carried over to another model, where A/3 is
    # another residue. Each model keeps its own region, as it keeps its own sections.
    wb = make_wb("1orc", region="A/3")
    assert "residue A/3" in wb.scene.caption.value
    wb.controls.structure.value = "1aki"
    assert wb.state.region == "" and wb.controls.region.value == ""
    assert wb.result.settings.region == "" and "<summary>whole model" in wb.scene.caption.value
    assert wb.scene.view.focus == {}
    wb.controls.region.value = "A/10"
    wb.controls.structure.value = "1orc"  # back: its own residue again
    assert wb.state.region == "A/3" and wb.controls.region.value == "A/3" and "residue A/3" in wb.scene.caption.value
    wb.set(structure="1aki", region="A/12")  # a region given with the model is for that model
    assert wb.result.settings.structure == "1aki" and wb.state.region == "A/12"


def test_opening_distorted_at_1_angstrom_warns_nothing():
    # The reviewer saw "overflow encountered in multiply" in the notebook; the threaded
    # app (as a notebook opens it) must compute and draw every view without a warning.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wb = workbench.Workbench(distort_amplitude=0.3, spacing=1.0)
        try:
            wb.flush()
            assert wb.status.message.startswith("ready"), wb.status.message
        finally:
            wb.close()
    assert [str(w.message) for w in caught] == []


def test_unreadable_file_message_reads_as_sentences(make_wb, tmp_path):
    bad = tmp_path / "broken.pdb"
    bad.write_text("this is not a PDB file\nATOM  garbage\n")
    wb = make_wb()
    wb.state.structure = str(bad)
    msg = wb.status.message
    assert wb.status.level == "error" and "broken.pdb" in msg
    assert " )" not in msg and "?." not in msg and ".." not in msg and "\n" not in msg, msg
    assert msg.endswith("Choose another file or a bundled example."), msg


def test_the_app_recomputes_for_every_setting_and_for_nothing_else(make_wb):
    """Every Settings field is observed; the traits the app writes from a result are not."""
    clock = [0.0]
    wb = make_wb(debounce=0.1, threaded=False, clock=lambda: clock[0])  # nothing runs until polled
    observed = []
    for name in wb.state.trait_names():
        before = wb.scheduler.generation
        # a change notification of ``name`` (with its own value: no valid new value needed per trait)
        value = getattr(wb.state, name)
        wb.state.notify_change(traitlets.Bunch(name=name, old=value, new=value, owner=wb.state, type="change"))
        if wb.scheduler.generation > before:
            observed.append(name)
    assert sorted(observed) == sorted(f.name for f in dataclasses.fields(Settings))
    with pytest.raises(TypeError, match="unknown setting 'n_atoms'"):
        workbench.Workbench("1orc", debounce=0.1, threaded=False, clock=lambda: 0.0, n_atoms=3)


def test_the_section_keeps_its_depth_across_spacing_axis_and_model(make_wb):
    # Issue 19: at 0.667 Å, index 28 is 16.9 Å deep; spacing 2.05 Å clamped the index to 23
    # (46.3 Å, a blank section) and going back did not restore it.
    wb = make_wb(spacing=0.667)
    assert wb.result.section.index == 28  # opened on the model's middle
    wb.controls.slice_index.set_state({"value": 27})
    wb.controls.slice_index.set_state({"value": 28})  # the browser path
    depth = wb.result.section.depth
    assert wb.result.section.index == 28 and depth == pytest.approx(16.91, abs=0.01)
    assert wb.state.slice_depths[2] == pytest.approx(depth)
    assert "depth 16.91 Å" in wb.controls.slice_depth.value
    wb.controls.spacing.value = 2.05
    sec = wb.result.section
    plane = wb.state.slice_plane
    assert abs(sec.depth - depth) <= plane / 2 + 1e-9, (sec.depth, depth, plane)
    assert wb.controls.slice_index.value == wb.state.slice_index == sec.index
    assert len(wb.result.near[0]) > 0 and wb.status.level == "idle", wb.status.message
    wb.controls.spacing.value = 0.667
    assert wb.result.section.index == 28 and wb.controls.slice_index.value == 28
    wb.controls.slice_axis.value = "a"  # another axis: its own depth (the model's middle)
    assert wb.result.section.axis == 0 and len(wb.result.near[0]) > 10
    wb.controls.slice_axis.value = "c"
    assert wb.result.section.index == 28
    wb.controls.structure.value = "1aki"  # another model opens on its own middle …
    assert len(wb.result.model) != 559 and len(wb.result.near[0]) > 10
    wb.controls.structure.value = "1orc"  # … and going back goes back to where the section was
    assert wb.result.section.index == 28 and wb.result.section.depth == pytest.approx(depth)


def test_a_section_without_density_says_so_in_the_status(make_wb):
    wb = make_wb()
    rho = wb.result.rho
    peak = float(rho.max())
    plane_max = [float(rho[:, :, i].max()) for i in range(rho.shape[2])]
    empty = [i for i, m in enumerate(plane_max) if m < 0.01 * peak]
    assert empty, f"1ORC ⊥ c has no empty section at 1.5 Å: {plane_max}"
    assert wb.status.level == "idle", wb.status.message
    wb.controls.slice_index.value = empty[0]
    assert wb.result.section.index == empty[0]
    assert wb.status.level == "warning", wb.status.message
    assert "holds no density" in wb.status.message and "move the slice there" in wb.status.message
    assert wb.status.message.startswith("ready: 559 atoms")
    full = int(np.argmax(plane_max))
    wb.controls.slice_index.value = full
    assert wb.status.level == "idle" and "no density" not in wb.status.message


def test_a_new_model_marks_the_old_comparison_and_timings_stale(make_wb):
    # Issue 19: after 5h73 loaded, the difference tab still showed 1ORC's comparison as current.
    wb = make_wb()
    wb.compare("cpu:cpu", "cpu:reference")
    d = wb.difference_result
    assert d is not None and "1ORC at 1.5 Å" in wb.difference.stats.value
    wb.compare_all_backends()
    assert wb.timing.rows and "for 1ORC at 1.5 Å" in wb.timing.table.value
    # moving the slice keeps the comparison (same maps) and re-cuts its section
    image = bytes(wb.difference.slice.image.value)
    wb.controls.slice_index.value = wb.state.slice_index - 3
    assert wb.difference_result is d and d.section.index == wb.state.slice_index
    assert bytes(wb.difference.slice.image.value) != image
    np.testing.assert_allclose(d.section.values, (d.map_a.double() - d.map_b.double()).float()[:, :, d.section.index])
    wb.controls.structure.value = "1pfe"
    assert len(wb.result.model) == 342
    assert wb.difference_result is None
    # the old section and 3D scene are gone, not left on show beside the notice (issue 34):
    # the image is hidden (an empty <img> is a broken-image icon) and the 3D scene emptied
    assert bytes(wb.difference.slice.image.value) == b""
    assert wb.difference.slice.widget.layout.display == "none"
    v = wb.difference.view3d
    assert (v.model_text, v.map_bytes, v.arrows, v.focus) == ("", b"", b"", {}) and v.layout.display == "none"
    assert "wb-stale" in wb.difference.stats.value
    stats = wb.difference.stats.value
    assert "out of date" in stats and "1ORC at 1.5 Å" in stats and "1PFE at 1.5 Å" in stats and "press compare" in stats
    assert wb.timing.rows == [] and "out of date" in wb.timing.table.value
    wb.compare()  # compared again: current
    assert wb.difference_result is not None and "1PFE at 1.5 Å" in wb.difference.stats.value
    assert wb.difference.slice.widget.layout.display is None and v.layout.display is None
    assert sum(line.startswith(("ATOM", "HETATM")) for line in v.model_text.splitlines()) == 342
    # any input of the comparison counts, not only the model
    wb.controls.b_global.value = 40.0
    assert wb.difference_result is None and "B 40 Å²" in wb.difference.stats.value


def test_profile_fields_show_the_atoms_profiled(make_wb):
    # Issue 19: "profile atom 2 = 0" while the profile ran N → CA (atoms 0 and 1).
    wb = make_wb()
    assert wb.state.profile_atoms == (0, 1)
    assert (wb.controls.profile_a.value, wb.controls.profile_b.value) == (0, 1)
    names = wb.result.model.atoms.labels
    assert f"{names[0]} → {names[1]}" in wb.controls.profile_names.value
    wb.controls.profile_b.value = 5
    assert wb.result.settings.profile_atoms == (0, 5) and f"→ {names[5]}" in wb.profile.caption.value


def test_status_text_reads_as_english(make_wb):
    # "computing: done …" showed while the views were drawn (issue 19).
    wb = make_wb()
    seen = []
    wb.status.label.observe(lambda ch: seen.append(wb.status.message), names="value")
    wb.controls.b_global.value = 33.0
    assert seen and not [m for m in seen if "done" in m], seen
    assert not [
        m for m in seen if re.search(r"\b\d+(th|nd|st|rd)\b", m) and not re.search(r"\b(1st|2nd|3rd|\d*[04-9]th)\b", m)
    ]


def test_controls_sit_in_groups_shown_one_at_a_time_and_the_section_never_shrinks(make_wb):
    wb = make_wb()
    c = wb.controls
    sections = c.sections
    assert list(sections) == [
        "density", "model file, ADPs and radiation", "section colours and contours", "3D view and gradients",
        "compute", "profile and atom table", "export", "relax",
    ]  # fmt: skip
    # one group shown at a time (issue 34: open sections made the panel 1,030-1,410 px tall),
    # chosen by a row of buttons (issue 46: an accordion's eight headers pushed it past a laptop
    # screen); density open at start
    assert list(c.stack.children) == list(sections.values()) and c.open_title == "density"
    assert [b.layout.display for b in sections.values()] == [None] + ["none"] * 7
    assert c.widget.children == (c.structure, c.group_bar, c.stack)
    assert [b.tooltip for b in c.group_bar.children] == list(sections)
    c.section_buttons["relax"].click()
    assert c.open_title == "relax" and [b.layout.display for b in sections.values()] == ["none"] * 7 + [None]
    assert c.section_buttons["relax"].button_style == "info" and c.section_buttons["density"].button_style == ""
    c.open_section("density")
    # the views' tabs: one add_tab per view, in order
    assert [wb.tabs.get_title(i) for i in range(len(wb.tabs.children))] == [
        "line profile", "density at atoms", "difference", "timing", "resolution",
    ]  # fmt: skip
    extra = widgets.HTML("x")
    wb.add_tab("another view", extra)
    assert wb.tabs.children[-1] is extra and wb.tabs.get_title(5) == "another view"
    held = [w for box in sections.values() for w in box.children]
    held += [w for box in held if isinstance(box, widgets.HBox) for w in box.children]
    held += list(c.section_bar.children)  # under the section image
    for name in [
        *c.bound, "profile_a", "profile_b", "path", "upload", "slice_axis", "slice_index", "slice_depth",
        "backend_reason", "export_model", "export_map",
    ]:  # fmt: skip
        assert getattr(c, name) in held, f"{name} is in no control section"
    assert c.sections["relax"].children == (wb.relax.widget,)
    # an image with max-width 100 % in a shrinking flex item was drawn at 20×17 px (issue 19):
    # the section shrinks with its column down to 300 px, never below
    assert wb.slice.widget.layout.min_width == "300px" and wb.difference.slice.widget.layout.flex == "0 0 auto"


def test_user_visible_counts_and_ordinals_read_as_english(make_wb, monkeypatch):
    from workbench.compute.text import count, ordinal
    from workbench.views import view3d

    assert [ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 23, 101, 111)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "23rd", "101st", "111th",
    ]  # fmt: skip
    assert (count(1, "atom"), count(0, "atom"), count(1234, "atom")) == ("1 atom", "0 atoms", "1234 atoms")
    # a whole-model map box subsampled: "every 2nd voxel", never "every 2th"
    original = view3d.region_volume
    monkeypatch.setattr(view3d, "region_volume", lambda *a, **k: original(*a, **{**k, "max_voxels": 20_000}))
    wb = make_wb(spacing=0.8)
    stride = wb.scene._volume.stride
    assert stride > 1 and f"every {ordinal(stride)} voxel" in wb.scene.caption.value
    for text in (wb.scene.caption.value, wb.slice.caption.value, wb.status.message, wb.table.html.value):
        for number, suffix in re.findall(r"\b(\d+)(st|nd|rd|th)\b", text):
            assert ordinal(int(number)) == number + suffix, text
        assert not re.search(r"(?<![\d.,])1 (?:atoms|rows|voxels|residues|arrows)\b", text), text


def test_results_holding_arrays_compare_by_identity_and_value_objects_by_value(make_wb):
    import copy

    from workbench.compute import Comparison, atom_marks, region_arrows

    wb = make_wb(distort_amplitude=0.3)
    wb.compare("cpu:reference", "cpu:reference")
    wb.flush()
    r = wb.result
    arrows = region_arrows(r.atoms.xyz, r.gradient, None, 4.0, missing="none")
    objects = [
        r, r.section, r.gradient, wb.slice.last, wb.slice.last.contours[0], wb.scene._volume, arrows,
        wb.difference_result, atom_marks(r.near, r.model.atoms.elements),
    ]  # fmt: skip
    for obj in objects:
        assert obj == obj and obj != copy.copy(obj), type(obj).__name__  # no "truth value of an array"
        assert len({obj, obj}) == 1  # usable in sets and as dict keys
    c = Comparison(1.0, 2.0, 0.1, 0, 10)
    assert c == Comparison(1.0, 2.0, 0.1, 0, 10)  # scalars only: a value object


def test_contour_levels_box_sets_the_levels_and_reports_bad_input(make_wb):
    wb = make_wb()
    box = wb.controls.contour_sigmas
    assert box.value == "1" and "wb-contours" in box._dom_classes
    box.set_state({"value": "2, -1 1.5σ, 2"})  # the path a browser message takes
    assert wb.state.contour_sigmas == (-1.0, 1.5, 2.0) and box.value == "-1, 1.5, 2"
    assert [c.sigma for c in wb.slice.last.contours] == [-1.0, 1.5, 2.0]
    assert "contours at -1 σ" in wb.slice.caption.value
    n = wb.n_applied
    for bad, says in (("1, two", "'two' is not a number"), ("1 2 3 4 5 6 7", "at most 6"), ("99", "[-50, 50]")):
        box.set_state({"value": bad})
        assert wb.status.level == "error" and says in wb.status.message, wb.status.message
        assert box.value == "-1, 1.5, 2" and wb.state.contour_sigmas == (-1.0, 1.5, 2.0)  # put back
    assert wb.n_applied == n  # nothing recomputed for bad input
    box.set_state({"value": ""})
    assert wb.state.contour_sigmas == () and wb.slice.last.contours == [] and wb.status.level != "error"
    wb.state.contour_sigmas = (3.0,)  # from code: the box follows
    assert box.value == "3"
