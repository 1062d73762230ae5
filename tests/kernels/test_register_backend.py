"""Users' backends: register_backend / unregister_backend, and check_backend finding classic bugs.

The kernels are in :mod:`tests.kernels.user_backends` (a module, so the first-call check can
import them in a fresh process). One small triclinic model (12 atoms, 1-Å grid of 4,096
voxels) keeps each check to a few seconds; the first-call check spawns a process and runs
only where it is the point of the test.
"""

from __future__ import annotations

import math
import re
import time
from pathlib import Path

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
    """check_backend on the small model; in this process (a child costs an interpreter start) unless isolate=True."""
    kw.setdefault("fresh_process", False)
    kw.setdefault("timing", False)
    kw.setdefault("isolate", False)
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
        (("density", "CPU", ub.correct), {}, kernels.BackendError, "differs only in case from the built-in name 'cpu'"),
        (("density", "Triton", ub.correct), {}, kernels.BackendError, "differs only in case"),
        (
            ("density", "AUTO", ub.correct),
            {},
            kernels.BackendError,
            "differs only in case from the built-in name 'auto'",
        ),
        (("planarity", "Reference", ub.correct), {}, kernels.BackendError, "differs only in case"),
        (("density", "a\nb", ub.correct), {}, ValueError, "printable"),
        (("density", 7, ub.correct), {}, ValueError, "non-empty printable string"),
        ((["density"], "x", ub.correct), {}, kernels.BackendError, "unknown op"),
        (("density", "x", ub.correct), {"devices": None}, TypeError, "devices must be"),
        (("density", "x", ub.correct), {"devices": ()}, ValueError, "non-empty subset"),
        (("density", "x", ub.correct), {"capabilities": {"anisotropic": 1}}, ValueError, "True or False"),
    ],
)
def test_register_refuses_bad_arguments_saying_what_to_do(args, kw, error, match):
    with pytest.raises(error, match=match):
        kernels.register_backend(*args, **kw)
    assert "x" not in kernels.available_backends("density", "cpu")


@pytest.mark.parametrize("field", ["gradients", "anisotropic"])
@pytest.mark.parametrize("value", ["no", "False", 0, 1, None, 1.0])
def test_capabilities_take_only_true_or_false(field, value):
    # "no" is truthy: taken as a flag it would declare gradients the backend does not have
    with pytest.raises(ValueError, match=f"True or False, got {{'{field}': {re.escape(repr(value))}}}"):
        kernels.BackendCapabilities(**{field: value})
    with pytest.raises(ValueError, match="True or False"):
        kernels.register_backend("density", "x", ub.correct, capabilities={field: value})
    assert "x" not in kernels.dispatch.registered_backends("density")


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


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda shape: torch.zeros(7), "returned a map of shape (7,); expected {shape} (the grid's shape)"),
        (
            lambda shape: torch.zeros(shape, dtype=torch.int32),
            "returned a map of dtype torch.int32; expected torch.float32",
        ),
        (lambda shape: torch.zeros(shape, dtype=torch.float16), "returned a map of dtype torch.float16"),
        (lambda shape: torch.zeros(shape, dtype=torch.bool), "returned a map of dtype torch.bool"),
        (
            lambda shape: torch.zeros(shape, device="meta"),
            "returned a map on meta; expected it on the inputs' device cpu",
        ),
        (lambda shape: torch.zeros(shape).numpy(), "returned ndarray, not a torch.Tensor"),
    ],
    ids=["shape", "int32", "float16", "bool", "meta", "numpy"],
)
def test_a_density_backends_malformed_map_is_refused_naming_the_backend_and_what_was_expected(make, message, register):
    grid = kernels.GridSpec.for_spacing(ub.example_atoms().cell, SPACING, "P 1")
    register("bad", lambda atoms, grid, *, radius, cutoff: make(grid.shape), devices=("cpu",))
    with pytest.raises(
        kernels.BackendError, match=re.escape("density backend 'bad' " + message.format(shape=grid.shape))
    ):
        kernels.splat_density(ub.example_atoms().atoms.to(dtype=torch.float32), grid, backend="bad")


def test_a_float64_map_is_accepted_as_the_reference_returns_one(register):
    model = ub.example_atoms()
    grid = kernels.GridSpec.for_spacing(model.cell, SPACING, "P 1")
    register(
        "f64", lambda atoms, grid, *, radius, cutoff: ub.correct(atoms, grid, radius=radius, cutoff=cutoff).double()
    )
    out = kernels.splat_density(model.atoms.to(dtype=torch.float32), grid, backend="f64")
    assert out.dtype == torch.float64


@pytest.fixture
def register_op():
    """register_op(op, name, fn): register a backend of any op, unregistered after the test."""
    names = []

    def add(op, name, fn):
        kernels.register_backend(op, name, fn, devices=("cpu",))
        names.append((op, name))

    yield add
    for op, name in names:
        kernels.unregister_backend(op, name)


def test_a_planarity_backends_malformed_output_is_refused(register_op):
    xyz = torch.tensor([[0.0, 0, 0], [1, 0, 0], [0, 1, 0], [1, 1, 0.1]])
    planes = kernels.PlaneSet.from_lists([[0, 1, 2, 3]], n_atoms=4)
    register_op("planarity", "vec", lambda xyz, planes: torch.zeros(len(planes), dtype=xyz.dtype))
    with pytest.raises(
        kernels.BackendError, match=re.escape("planarity backend 'vec' returned an output of shape (1,); expected ()")
    ):
        kernels.planarity_nll(xyz, planes, backend="vec")
    register_op("planarity", "half", lambda xyz, planes: torch.zeros((), dtype=torch.float16))
    with pytest.raises(kernels.BackendError, match="dtype torch.float16"):
        kernels.planarity_nll(xyz, planes, backend="half")
    register_op("planarity", "ok", lambda xyz, planes: (xyz[:, 2] ** 2).sum())
    assert kernels.planarity_nll(xyz, planes, backend="ok").shape == ()


def test_a_tricubic_backends_malformed_output_is_refused(register_op):
    model = ub.example_atoms()
    grid = kernels.GridSpec.for_spacing(model.cell, SPACING, "P 1")
    rho = torch.rand(grid.shape)
    points = torch.rand(5, 2, 3) * 10
    register_op("tricubic", "flat", lambda rho, grid, points, *rest: torch.zeros(10))
    with pytest.raises(
        kernels.BackendError,
        match=re.escape("tricubic backend 'flat' returned an output of shape (10,); expected (5, 2)"),
    ):
        kernels.tricubic_sample(rho, grid, points, backend="flat")
    register_op("tricubic", "meta", lambda rho, grid, points, *rest: torch.zeros(points.shape[:-1], device="meta"))
    with pytest.raises(kernels.BackendError, match="on meta; expected it on the inputs' device cpu"):
        kernels.tricubic_sample(rho, grid, points, backend="meta")


def test_a_density_frames_backends_map_stack_is_checked(register_op):
    model = ub.example_atoms()
    grid = kernels.GridSpec.for_spacing(model.cell, SPACING, "P 1")
    register_op("density_frames", "one", lambda atoms, grid, *, n_frames, radius, cutoff: torch.zeros(grid.shape))
    _, fn = kernels.dispatch.get_backend("density_frames", "cpu", "one")
    with pytest.raises(
        kernels.BackendError, match=re.escape(f"expected (2, {', '.join(map(str, grid.shape))}) (n_frames maps")
    ):
        fn(model.atoms.to(dtype=torch.float32), grid, n_frames=2, radius=None, cutoff=1e-5)


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


@pytest.mark.parametrize(
    "fn, failing, says",
    [
        (ub.sys_exit_zero, "runs", "SystemExit(0)"),
        (ub.generator_exit, "runs", "GeneratorExit: leaving"),
        (ub.sys_exit_in_backward, "gradients", "SystemExit(0)"),
    ],
    ids=lambda v: getattr(v, "__name__", None),
)
def test_a_kernel_raising_sys_exit_or_another_base_exception_fails_a_check_in_process(
    register, model, fn, failing, says
):
    register(fn.__name__, fn, devices=("cpu",))
    report = check(fn.__name__, model)
    assert not report.ok
    assert report.status(failing) == "fail", str(report)
    assert says in report[failing][0].summary
    assert "caller's process" in report.notes[0]


@pytest.mark.parametrize("isolate", [False, True])
def test_a_kernel_raising_keyboard_interrupt_stops_the_whole_check(register, model, isolate):
    register("ctrl_c", ub.keyboard_interrupt, devices=("cpu",))
    with pytest.raises(KeyboardInterrupt):
        check("ctrl_c", model, isolate=isolate)


@pytest.mark.parametrize(
    "fn, says",
    [
        (ub.sys_exit_zero, "SystemExit(0)"),
        (ub.os_exit_zero, "ended (exit status 0) during this check"),
        (ub.kills_itself, "ended (killed by SIGKILL) during this check"),
    ],
    ids=lambda v: getattr(v, "__name__", None),
)
def test_a_kernel_that_ends_or_kills_its_process_fails_runs_in_the_isolated_check(register, model, fn, says):
    register(fn.__name__, fn, devices=("cpu",))
    report = check(fn.__name__, model, isolate=True)
    assert not report.ok and report.status("runs") == "fail", str(report)
    assert says in report["runs"][0].summary
    assert report.notes == []  # it ran in its own process


def test_a_kernel_that_closes_stdout_and_stderr_still_passes_and_the_caller_keeps_them(register, model, capsys):
    register("closer", ub.closes_stdout, devices=("cpu",), capabilities={"gradients": False})  # maps only: quicker
    report = check("closer", model, isolate=True)
    assert report.ok, str(report)
    print("still open")
    assert "still open" in capsys.readouterr().out


@pytest.mark.parametrize("fn", [ub.os_exit_in_a_new_process, ub.sys_exit_in_a_new_process], ids=lambda f: f.__name__)
def test_a_kernel_that_exits_in_the_first_call_process_fails_first_call(register, model, fn):
    register(fn.__name__, fn, devices=("cpu",), capabilities={"gradients": False})  # maps only: quicker
    report = check(fn.__name__, model, fresh_process=True)
    assert not report.ok and report.status("first call") == "fail", str(report)
    summary = report["first call"][0].summary
    assert "SystemExit(0)" in summary if fn is ub.sys_exit_in_a_new_process else "ended (exit status 0)" in summary
    assert report.status("reference") == "pass"


def test_a_kernel_that_never_returns_fails_at_the_timeout_naming_the_check(register, model):
    register("stuck", ub.never_returns, devices=("cpu",))
    start = time.monotonic()
    report = check("stuck", model, isolate=True, timeout=10)
    assert time.monotonic() - start < 40  # the child process is stopped at the timeout
    assert not report.ok and report.status("runs") == "fail", str(report)
    assert "still running after 10 s" in report["runs"][0].summary


def test_a_timeout_in_the_first_call_check_stops_its_new_process_too(register, model, tmp_path, monkeypatch):
    pid_file = tmp_path / "pid"
    monkeypatch.setenv("USER_BACKENDS_PID_FILE", str(pid_file))
    register("stuck_fresh", ub.never_returns_in_a_new_process, devices=("cpu",), capabilities={"gradients": False})
    # the timeout leaves the child time to import and pass the reference check on a loaded 2-core machine
    report = check("stuck_fresh", model, isolate=True, fresh_process=True, timeout=30)
    assert report.status("first call") == "fail" and "still running after 30 s" in report["first call"][0].summary
    assert report.status("reference") == "pass"  # the checks before it are kept
    pid = int(pid_file.read_text())
    stat = Path(f"/proc/{pid}/stat")
    for _ in range(50):  # SIGKILL is asynchronous; gone, or a zombie left for init to reap
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                break
        except (FileNotFoundError, ProcessLookupError):
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the first-call process {pid} still runs after the check returned")


def test_progress_names_each_check_as_it_starts_in_order(register, model):
    register("correct", ub.correct, devices=("cpu",))
    seen = []
    report = check("correct", model, isolate=True, timing=True, progress=lambda c, s: seen.append(c))
    assert report.ok, str(report)
    assert seen == [
        "runs",
        "reference",
        "gemmi",
        "first call",
        "determinism",
        "gradients",
        "finite differences",
        "speed",
    ]


def test_a_meta_device_kernel_ends_in_a_report(register, model):
    register("meta", ub.meta_map, devices=("cpu",))
    report = check("meta", model, isolate=True, fresh_process=True)
    assert report.status("runs") == "fail", str(report)
    assert "returned a map on meta" in report["runs"][0].summary


@pytest.mark.parametrize(
    "kw, error, match",
    [
        ({"timeout": -1}, ValueError, "timeout must be a positive finite number of s"),
        ({"timeout": 0}, ValueError, "timeout"),
        ({"timeout": math.nan}, ValueError, "timeout"),
        ({"timeout": "10"}, ValueError, "timeout"),
        ({"spacing": 0}, ValueError, "spacing"),
        ({"spacing": True}, ValueError, "spacing"),
        ({"radius": -2.0}, ValueError, "radius"),
        ({"cutoff": math.inf}, ValueError, "cutoff"),
        ({"fresh_process": "no"}, TypeError, "fresh_process must be True or False"),
        ({"timing": 1}, TypeError, "timing must be True or False"),
        ({"isolate": None}, TypeError, "isolate must be True or False"),
        ({"device": "tpu"}, ValueError, "device 'tpu' is not a torch device"),
        ({"device": 0}, TypeError, "device must be"),
        ({"structures": 5}, TypeError, "structures must be"),
        ({"structures": [5]}, TypeError, "each structure is"),
        ({"structures": []}, ValueError, "structures is empty"),
        ({"progress": "yes"}, TypeError, "progress must be"),
    ],
)
def test_check_backend_refuses_bad_arguments_before_running_anything(kw, error, match, register):
    calls = []
    register("counted", lambda atoms, grid, *, radius, cutoff: calls.append(1))
    with pytest.raises(error, match=match):
        kernels.check_backend("density", "counted", **kw)
    assert calls == []  # refused as an argument error, never reported as a failed check


def test_check_backend_refuses_a_name_that_is_not_a_string():
    with pytest.raises(TypeError, match="name must be"):
        kernels.check_backend("density", ["cpu"])


def test_a_single_structure_string_is_one_structure_not_its_characters():
    report = kernels.check_backend(
        "density", "cpu", structures="1orc", fresh_process=False, timing=False, isolate=False
    )
    assert report.structures == ["1orc"]
    assert report.ok, str(report)


def test_a_single_model_or_path_is_one_structure(model):
    report = kernels.check_backend(
        "density", "cpu", structures=model, spacing=SPACING, fresh_process=False, timing=False, isolate=False
    )
    assert report.structures == ["<memory>"]
    path = kernels.example_structure("1orc")
    assert kernels.check_backend(
        "density", "cpu", structures=path, fresh_process=False, timing=False, isolate=False
    ).structures == [path.name]


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
