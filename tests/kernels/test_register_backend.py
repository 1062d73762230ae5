"""Users' backends: register_backend / unregister_backend, and check_backend finding classic bugs.

The kernels are in :mod:`tests.kernels.user_backends` (a module, so the first-call check can
import them in a fresh process). One small triclinic model (12 atoms, 1-Å grid of 4,096
voxels) keeps each check to a few seconds; the first-call check spawns a process and runs
only where it is the point of the test.
"""

from __future__ import annotations

import re

import pytest
import torch

import kernels
from tests.helpers import STRUCTURES, requires_cuda
from tests.kernels import user_backends as ub

SPACING = 1.0


@pytest.fixture
def register():
    """register(name, fn, **kw): register a density backend, unregistered after the test."""
    names = []

    def add(name, fn, **kw):
        kernels.register_backend("density", name, fn, **kw)
        names.append(name)
        return name

    yield add
    for name in names:
        if name in kernels.dispatch.registered_backends("density"):
            kernels.unregister_backend("density", name)


@pytest.fixture(scope="module")
def model():
    return ub.example_atoms()


def check(name, model, **kw):
    kw.setdefault("fresh_process", False)
    kw.setdefault("timing", False)
    return kernels.check_backend("density", name, structures=[model], spacing=SPACING, **kw)


# ------------------------------------------------------------------ register / unregister


def test_registered_backend_is_offered_and_used_then_removed(register, model):
    grid = kernels.GridSpec.for_spacing(model.cell, SPACING, "P 1")
    atoms = model.atoms.to(dtype=torch.float32)
    before = kernels.available_backends("density", "cpu")
    register("mine", ub.correct, devices=("cpu",))
    assert kernels.available_backends("density", "cpu") == [*before, "mine"]
    assert "mine" not in kernels.available_backends("density", "cuda")  # cpu only
    out = kernels.splat_density(atoms, grid, backend="mine")
    assert torch.equal(out, ub.correct(atoms, grid, radius=None, cutoff=kernels.DEFAULT_CUTOFF))
    assert kernels.resolve_backend("density", "cpu") != "mine"  # "auto" never picks a user's backend
    kernels.unregister_backend("density", "mine")
    assert kernels.available_backends("density", "cpu") == before
    with pytest.raises(kernels.BackendError, match="unknown backend 'mine'"):
        kernels.splat_density(atoms, grid, backend="mine")


def test_registering_again_replaces_and_dispatch_forgets_the_old_function(register, model):
    grid = kernels.GridSpec.for_spacing(model.cell, SPACING, "P 1")
    atoms = model.atoms.to(dtype=torch.float32)
    register("mine", ub.correct, devices=("cpu",))
    first = kernels.splat_density(atoms, grid, backend="mine")
    register("mine", ub.no_occupancy, devices=("cpu",))
    second = kernels.splat_density(atoms, grid, backend="mine")
    assert not torch.equal(first, second)


@pytest.mark.parametrize(
    "args, kw, error, match",
    [
        (("nosuchop", "x", ub.correct), {}, kernels.BackendError, "unknown op 'nosuchop'"),
        (("density", "cpu", ub.correct), {}, kernels.BackendError, "built-in name"),
        (("density", "auto", ub.correct), {}, kernels.BackendError, "built-in name"),
        (("density", "a:b", ub.correct), {}, ValueError, "without ':'"),
        (("density", "x", 42), {}, TypeError, "must be callable"),
        (("density", "x", ub.correct), {"devices": ("tpu",)}, ValueError, "subset of"),
        (("density", "x", ub.correct), {"capabilities": {"fast": True}}, ValueError, "unknown capabilities"),
        (("density", "x", ub.correct), {"capabilities": {"gradients": "yes"}}, ValueError, "True or False"),
        (("density", "x", ub.correct), {"capabilities": 3}, TypeError, "BackendCapabilities"),
    ],
)
def test_register_refuses_bad_arguments_saying_what_to_do(args, kw, error, match):
    with pytest.raises(error, match=match):
        kernels.register_backend(*args, **kw)
    assert "x" not in kernels.available_backends("density", "cpu")


def test_unregister_of_unknown_or_builtin_backend_raises():
    with pytest.raises(kernels.BackendError, match="no registered backend 'cpu'"):
        kernels.unregister_backend("density", "cpu")


def test_capabilities_are_recorded_and_gradients_false_refuses_inputs_needing_grad(register, model):
    register("nograd", ub.correct, devices=("cpu",), capabilities={"gradients": False})
    caps = kernels.dispatch.backend_capabilities("density", "nograd")
    assert caps == kernels.BackendCapabilities(gradients=False, anisotropic=False)
    grid = kernels.GridSpec.for_spacing(model.cell, SPACING, "P 1")
    atoms = model.atoms.to(dtype=torch.float32)
    kernels.splat_density(atoms, grid, backend="nograd")  # no grad needed: runs
    leaf = atoms.replace(xyz=atoms.xyz.clone().requires_grad_(True))
    with pytest.raises(kernels.BackendError, match="declares no gradients"):
        kernels.splat_density(leaf, grid, backend="nograd")
    report = check("nograd", model)
    assert report.ok
    assert report.status("gradients") == "skipped"


def test_malformed_output_is_named():
    grid = kernels.GridSpec.for_spacing(ub.example_atoms().cell, SPACING, "P 1")
    kernels.register_backend("density", "flat", lambda atoms, grid, *, radius, cutoff: torch.zeros(7), devices=("cpu",))
    try:
        with pytest.raises(kernels.BackendError, match=re.escape("returned a map of shape (7,)")):
            kernels.splat_density(ub.example_atoms().atoms.to(dtype=torch.float32), grid, backend="flat")
    finally:
        kernels.unregister_backend("density", "flat")


# ------------------------------------------------------------------ check_backend


def test_a_correct_user_kernel_passes_every_check_including_a_fresh_first_call(register, model):
    register("correct", ub.correct, devices=("cpu",))
    report = check("correct", model, fresh_process=True, timing=True)
    assert report.ok, str(report)
    assert {c.name: c.status for c in report.checks} == {
        "reference": "pass",
        "gemmi": "skipped",  # an in-memory model: gemmi reads files
        "first call": "pass",
        "determinism": "pass",
        "gradients": "pass",
        "finite differences": "pass",
        "speed": "info",
    }
    assert "bitwise" in report["determinism"][0].tolerance


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_our_backends_pass_every_check(backend, model):
    # Triton runs on CUDA tensors where a GPU is present (in the interpreter, on CPU tensors).
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    report = check(backend, model, device=device)
    assert report.ok, str(report)
    assert {c.status for c in report.checks} == {"pass", "skipped"}  # gemmi: no file


def test_our_cpu_backend_passes_against_gemmi_on_a_bundled_structure():
    report = kernels.check_backend("density", "cpu", structures=[STRUCTURES["1orc"]], fresh_process=False, timing=False)
    assert report.ok, str(report)
    assert report.status("gemmi") == "pass"


@pytest.mark.parametrize(
    "fn, failing, passing",
    [
        (ub.truncated_radius, "reference", ("determinism",)),
        (ub.orthogonal_wrap, "reference", ("determinism", "finite differences")),
        (ub.half_precision, "reference", ("determinism",)),
        (ub.no_occupancy, "reference", ("determinism", "finite differences")),
        (ub.wrong_sign_gradient, "gradients", ("reference", "determinism")),
    ],
    ids=lambda v: getattr(v, "__name__", None),
)
def test_classic_bugs_fail_the_right_check(register, model, fn, failing, passing):
    register(fn.__name__, fn, devices=("cpu",))
    report = check(fn.__name__, model)
    assert not report.ok
    assert report.status(failing) == "fail", str(report)
    for name in passing:
        assert report.status(name) == "pass", str(report)
    worst = report[failing][0].worst
    assert worst is not None and worst.atom  # where: a voxel and its nearest atom, or the atom itself


def test_truncated_radius_is_located_at_the_edge_of_an_atoms_sphere(register, model):
    register("truncated", ub.truncated_radius, devices=("cpu",))
    worst = check("truncated", model)["reference"][0].worst
    assert worst.got == 0.0 and worst.expected > 0  # a voxel the kernel left empty
    assert 1.0 < worst.distance < 4.0  # between 60 % and all of an atom's radius


def test_wrong_gradient_sign_is_found_by_finite_differences_too_and_named_by_component(register, model):
    register("flip", ub.wrong_sign_gradient, devices=("cpu",))
    report = check("flip", model)
    assert report.status("finite differences") == "fail"
    worst = report["gradients"][0].worst
    assert worst.index[1] == 0 and "xyz x" in worst.atom
    assert worst.got == pytest.approx(-worst.expected, rel=1e-3)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="a GPU is present: Triton takes CUDA tensors, and the CUDA variant below runs"
)
def test_first_call_garbage_of_a_triton_kernel_is_found_in_a_fresh_process(register, model):
    register("garbage", ub.triton_first_call_garbage, devices=("cpu",), capabilities={"gradients": False})
    report = check("garbage", model, fresh_process=True)
    assert not report.ok
    assert report.status("first call") == "fail", str(report)
    # later calls are right: the map checks see the steady state, only the first call is wrong
    assert report.status("reference") == "pass" and report.status("determinism") == "pass"
    first = report["first call"][0]
    assert "not finite" in first.summary and first.metrics["n_over_call1"] > 0
    assert first.metrics["n_over_call3"] == 0


def test_a_kernel_no_new_process_can_import_is_skipped_with_the_reason_and_does_not_fail(register, model):
    def notebook_kernel(atoms, grid, *, radius, cutoff):  # defined in a function: not importable
        return ub.correct(atoms, grid, radius=radius, cutoff=cutoff)

    register("cell", notebook_kernel, devices=("cpu",))
    report = check("cell", model, fresh_process=True)
    first = report["first call"][0]
    assert first.status == "skipped" and "no new" in first.summary
    assert report.ok


def test_a_kernel_that_raises_fails_runs(register, model):
    def broken(atoms, grid, *, radius, cutoff):
        raise IndexError("index 9 out of range")

    register("broken", broken, devices=("cpu",))
    report = check("broken", model)
    assert not report.ok and report.status("runs") == "fail"
    assert "IndexError: index 9" in report["runs"][0].summary


def test_report_renders_a_table_and_saves_a_self_contained_page_with_the_worst_section(register, model, tmp_path):
    register("occ", ub.no_occupancy, devices=("cpu",))
    report = check("occ", model)
    table = report._repr_html_()
    assert "<table>" in table and "reference" in table and "fail" in table
    page = report.save(tmp_path / "check.html").read_text()
    assert page.count("data:image/png;base64,") == 1  # the failed map check's section
    assert "src='http" not in page and "<script" not in page  # nothing to fetch
    assert "over tolerance" in page


def test_check_backend_refuses_other_ops_and_unrunnable_backends():
    with pytest.raises(kernels.BackendError, match="has no checks yet"):
        kernels.check_backend("planarity", "cpu")
    with pytest.raises(kernels.BackendError, match="unknown backend 'nope'"):
        kernels.check_backend("density", "nope")


@requires_cuda
def test_our_triton_backend_on_cuda_passes_every_check_with_a_fresh_first_call():
    report = kernels.check_backend("density", "triton", structures=[STRUCTURES["1aki"]], device="cuda")
    assert report.ok, str(report)
    assert report.status("first call") == "pass" and report.status("gemmi") == "pass"
    assert "GPU atomics" in report["determinism"][0].tolerance


@requires_cuda
def test_first_call_garbage_on_cuda_is_found(register, model):
    register("garbage_cuda", ub.triton_first_call_garbage, devices=("cuda",), capabilities={"gradients": False})
    report = check("garbage_cuda", model, device="cuda", fresh_process=True)
    assert report.status("first call") == "fail", str(report)
    assert report.status("reference") == "pass"
