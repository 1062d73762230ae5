"""planarity_nll and tricubic_sample outside plain eager calls: torch.compile, CUDA graphs, the
direct Triton launch, and the host work (allocations, launches) of an eager call.

The compiled loops run in CI on the CPU (the C++ backends, and Triton in the interpreter) and
on CUDA where there is a GPU; the CUDA graph, launcher and allocation tests need a GPU.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import kernels
from kernels.planarity import triton as planarity_triton
from kernels.tricubic import OutsideMapWarning
from kernels.tricubic import triton as tricubic_triton
from tests.helpers import assert_close, assert_kernel_close, model, requires_cuda
from tests.kernels.test_compile_and_graphs import check_direct_launches, misaligned

TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (backend, dtype, device); the cpu backend in float64 is checked to 1e-12 against its eager self.
CASES = [("cpu", torch.float64, "cpu"), ("triton", torch.float32, TRITON_DEVICE)]
CASE_IDS = ["cpu-float64", "triton"]


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """Compiled against eager: the same kernels, so equal up to the order of inductor's own sums."""
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    assert_close(out, ref, atol=tol * max(scale, 1.0), rtol=tol)


# --------------------------------------------------------------------------- torch.compile


def _planarity_loop(step, x0: torch.Tensor, n: int = 3):
    """``n`` gradient steps on the planarity NLL: the losses and gradients seen."""
    x = x0.clone().requires_grad_(True)
    seen = []
    for _ in range(n):
        loss = step(x)
        loss.backward()
        seen.append((loss.detach(), x.grad.clone()))
        with torch.no_grad():
            x -= 1e-5 * x.grad
        x.grad = None
    return seen


@pytest.mark.parametrize(("backend", "dtype", "device"), CASES, ids=CASE_IDS)
def test_compiled_planarity_loop_matches_eager(backend, dtype, device):
    m = model("1aki")
    planes = kernels.find_planes(m)
    x0 = m.atoms.xyz.to(device=device, dtype=dtype)

    def step(x):
        return 0.5 * kernels.planarity_nll(x, planes, backend=backend) + 1.0

    counter = CompileCounterWithBackend("inductor")
    compiled = _planarity_loop(torch.compile(step, backend=counter, fullgraph=True), x0)
    eager = _planarity_loop(step, x0)
    assert counter.frame_count == 1  # one graph for the whole loop: no recompiles as x moves
    for (lc, gc), (le, ge) in zip(compiled, eager):
        _close(lc, le, dtype)
        _close(gc, ge, dtype)
        assert gc.dtype == dtype and gc.device.type == device


def test_a_copied_or_unpickled_plane_set_names_itself_to_compiled_code():
    # Compiled code reaches a PlaneSet through its token: a copy (or a set unpickled in another
    # process, whose own counter may have made the same token) must get its own, registered.
    import copy
    import pickle

    from kernels.planarity.planes import live_plane_set

    planes = kernels.PlaneSet.from_lists([[0, 1, 2, 3], [2, 3, 4]], n_atoms=5)
    planes.weight(torch.float32)  # something in the cache, which is not carried over
    for other in (copy.deepcopy(planes), pickle.loads(pickle.dumps(planes))):
        assert other._token != planes._token and live_plane_set(other._token) is other
        assert other._cache == {} and torch.equal(other.index, planes.index)
    xyz = torch.randn(5, 3, dtype=torch.float64)
    compiled = torch.compile(lambda x, p: kernels.planarity_nll(x, p, backend="cpu"), fullgraph=True)
    other = pickle.loads(pickle.dumps(planes))
    _close(compiled(xyz, other), kernels.planarity_nll(xyz, planes, backend="cpu"), torch.float64)


def _tricubic_loop(step, rho0: torch.Tensor, pts0: torch.Tensor, n: int = 3):
    rho = rho0.clone().requires_grad_(True)
    pts = pts0.clone().requires_grad_(True)
    seen = []
    for _ in range(n):
        out = step(rho, pts)
        out.backward()
        seen.append((out.detach(), rho.grad.clone(), pts.grad.clone()))
        with torch.no_grad():
            pts -= 0.1 * pts.grad
        rho.grad = pts.grad = None
    return seen


@pytest.mark.parametrize("method", ["catmull-rom", "lagrange"])
@pytest.mark.parametrize(("backend", "dtype", "device"), CASES, ids=CASE_IDS)
def test_compiled_tricubic_loop_matches_eager(backend, dtype, device, method):
    cell = kernels.Cell.from_parameters(21.0, 25.0, 29.0, 80.0, 100.0, 95.0)
    grid = kernels.GridSpec(cell, (11, 13, 15))
    g = torch.Generator().manual_seed(3)
    rho0 = torch.randn(grid.shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
    frac = torch.rand(2, 40, 3, generator=g, dtype=torch.float64) * 2 - 0.5  # some wrap
    pts0 = (frac @ cell.orth.T).to(device=device, dtype=dtype)  # a (2, 40) batch of points
    w = torch.randn(2, 40, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)

    def step(rho, pts):
        values = kernels.tricubic_sample(rho, grid, pts, method=method, backend=backend)
        return (values * w).sum() + values.sum()  # the .sum() sends an expanded (stride 0) gradient

    counter = CompileCounterWithBackend("inductor")
    compiled = _tricubic_loop(torch.compile(step, backend=counter, fullgraph=True), rho0, pts0)
    eager = _tricubic_loop(step, rho0, pts0)
    assert counter.frame_count == 1
    for got, want in zip(compiled, eager):
        for a, b in zip(got, want):
            _close(a, b, dtype)


@pytest.mark.parametrize(("backend", "dtype", "device"), CASES, ids=CASE_IDS)
def test_one_compiled_function_samples_grids_of_several_shapes(backend, dtype, device):
    # The second grid makes dynamo trace again, and ints that changed between traces become
    # symbolic: the grid must still reach the compiled op as values it can make parameters from.
    cell = kernels.Cell.from_parameters(21.0, 25.0, 29.0, 80.0, 100.0, 95.0)
    g = torch.Generator().manual_seed(8)
    pts = (torch.rand(30, 3, generator=g, dtype=torch.float64) @ cell.orth.T).to(device=device, dtype=dtype)

    def sample(rho, grid):
        return kernels.tricubic_sample(rho, grid, pts, backend=backend)

    compiled = torch.compile(sample, fullgraph=True)
    for shape in [(11, 13, 15), (12, 14, 16), (10, 10, 10)]:
        grid = kernels.GridSpec(cell, shape)
        rho = torch.randn(shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
        _close(compiled(rho, grid), sample(rho, grid), dtype)


def _opcheck_case(backend: str):
    """The dtype and device to check ``backend``'s ops on, after importing the modules that register them."""
    import importlib

    importlib.import_module(f"kernels.planarity.{backend}")  # registers the ops
    importlib.import_module(f"kernels.tricubic.{backend}")
    dtype = torch.float64 if backend == "cpu" else torch.float32
    # Triton runs on CUDA tensors where a GPU is present (in the interpreter, on CPU tensors).
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    return dtype, device


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_planarity_ops_pass_opcheck(backend):
    # Schema, fake (meta) implementations against the real ones, autograd registration and
    # AOT dispatch, as torch.library checks them, for the op and its backward op (one gradient).
    import importlib

    dtype, device = _opcheck_case(backend)
    module = importlib.import_module(f"kernels.planarity.{backend}")
    op, op_backward = (getattr(torch.ops.kernels, f"planarity_{backend}{end}") for end in ("", "_backward"))
    planes = kernels.PlaneSet.from_lists([[0, 1, 2, 3], [2, 3, 4, 5, 6]], sigma=[[0.02] * 4, [0.03] * 5], n_atoms=8)
    g = torch.Generator().manual_seed(5)
    xyz = torch.randn(8, 3, generator=g, dtype=torch.float64).to(device, dtype).requires_grad_(True)
    handle = module._handle(planes._token, str(xyz.device))
    torch.library.opcheck(op, (xyz, handle))
    loss, table = op(xyz.detach(), handle)
    torch.library.opcheck(op_backward, (torch.full_like(loss, 0.5), xyz.detach(), table, handle))


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_tricubic_ops_pass_opcheck(backend):
    from kernels.tricubic import _compiled_grid

    dtype, device = _opcheck_case(backend)
    op, op_backward = (getattr(torch.ops.kernels, f"tricubic_{backend}{end}") for end in ("", "_backward"))
    cell = kernels.Cell.from_parameters(12.0, 13.0, 14.0)
    grid = kernels.GridSpec(cell, (6, 7, 8))
    g = torch.Generator().manual_seed(5)
    rho = torch.randn(grid.shape, generator=g, dtype=torch.float64).to(device, dtype).requires_grad_(True)
    pts = (torch.rand(9, 3, generator=g, dtype=torch.float64) * 12).to(device, dtype).requires_grad_(True)
    lattice = torch.tensor([*grid.sampling, *grid.origin], dtype=torch.float64)
    handle = _compiled_grid(cell.frac, lattice, str(rho.device))
    up = torch.randn(9, generator=g, dtype=torch.float64).to(device, dtype)
    for method, periodic in [("catmull-rom", True), ("lagrange", False)]:
        for need in [(True, True), (False, True), (True, False)]:
            # need_rho and need_points say which inputs require a gradient (kernels.tricubic.sample passes them so).
            params = (handle, method, periodic, 0.5, *need)
            inputs = [t if n else t.detach() for t, n in zip((rho, pts), need)]
            torch.library.opcheck(op, (*inputs, *params))
            torch.library.opcheck(op_backward, (up, rho.detach(), pts.detach(), *params))


@pytest.mark.parametrize("op", ["planarity", "tricubic"])
def test_a_registered_backend_refuses_fullgraph_compile_with_a_clear_error(op):
    # A registered Python backend has no torch.library op: compiled with fullgraph=True the call fails
    # with the BackendError saying why and what to do, rather than running a built-in op in its place.
    cell = kernels.Cell.from_parameters(12.0, 13.0, 14.0)
    grid = kernels.GridSpec(cell, (6, 7, 8))
    planes = kernels.PlaneSet.from_lists([[0, 1, 2, 3]], n_atoms=4)
    rho = torch.randn(grid.shape, dtype=torch.float64)
    if op == "planarity":

        def mine(xyz, planes):
            return xyz.sum() * 0.0

        def run(x):
            return kernels.planarity_nll(x, planes, backend="mine")
    else:

        def mine(rho, grid, points, method, mode, fill_value):
            return points.sum(-1) * 0.0

        def run(x):
            return kernels.tricubic_sample(rho, grid, x, backend="mine").sum()

    kernels.register_backend(op, "mine", mine, devices=("cpu",))
    try:
        x = torch.randn(4, 3, dtype=torch.float64)
        assert float(run(x)) == 0.0  # eager: the registered function runs
        torch._dynamo.reset()
        with pytest.raises(Exception) as info:
            torch.compile(run, fullgraph=True, backend="aot_eager")(x)
        message = str(info.value)
        assert "BackendError" in message and "'mine'" in message and "outside" in message, message
    finally:
        kernels.unregister_backend(op, "mine")


# --------------------------------------------------------------------------- CUDA graphs


def _capture(step, inputs, warmup: int = 2) -> tuple[torch.cuda.CUDAGraph, object]:
    """Capture ``step(*inputs)`` (forward and backward) after warm-up calls on a side stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            for t in inputs:
                t.grad = None
            step(*inputs)
    torch.cuda.current_stream().wait_stream(side)
    for t in inputs:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(*inputs)
    return graph, out


@requires_cuda
def test_cuda_graph_replay_equals_eager_planarity():
    m = model("3wip")
    planes = kernels.find_planes(m)
    base = m.atoms.xyz.float().cuda()
    x = base.clone().requires_grad_(True)

    def step(x):
        loss = kernels.planarity_nll(x, planes)
        loss.backward()
        return loss

    graph, loss = _capture(step, [x])
    grad = x.grad
    g = torch.Generator(device="cuda").manual_seed(4)
    for _ in range(3):
        new = base + 0.05 * torch.randn(base.shape, generator=g, device="cuda")
        with torch.no_grad():
            x.copy_(new)
        graph.replay()
        xe = new.clone().requires_grad_(True)
        eager = step(xe)
        torch.cuda.synchronize()
        # The same launches on the same data: the kernels are deterministic, so bit for bit.
        assert torch.equal(loss, eager.detach())
        assert torch.equal(grad, xe.grad)


@requires_cuda
def test_cuda_graph_replay_equals_eager_tricubic():
    m = model("1aki")
    grid = kernels.GridSpec.for_spacing(m.cell, 0.7)
    g = torch.Generator(device="cuda").manual_seed(6)
    rho = torch.randn(grid.shape, generator=g, device="cuda").requires_grad_(True)
    base = (torch.rand(20_000, 3, generator=g, device="cuda", dtype=torch.float64) * 1.2 - 0.1).float()
    base = base @ m.cell.orth.T.float().cuda()
    pts = base.clone().requires_grad_(True)

    def step(rho, pts):
        out = kernels.tricubic_sample(rho, grid, pts)
        out.sum().backward()
        return out

    graph, out = _capture(step, [rho, pts])
    grad_rho, grad_pts = rho.grad, pts.grad
    for _ in range(3):
        new = base + 0.3 * torch.randn(base.shape, generator=g, device="cuda")
        with torch.no_grad():
            pts.copy_(new)
        graph.replay()
        re, pe = rho.detach().clone().requires_grad_(True), new.clone().requires_grad_(True)
        eager = step(re, pe)
        torch.cuda.synchronize()
        assert torch.equal(out, eager.detach())
        assert torch.equal(grad_pts, pe.grad)
        assert_kernel_close(grad_rho.cpu(), re.grad.cpu())  # float32 atomics: order varies


def _reduce_overhead_matches_eager(loss_fn, leaves: list[torch.Tensor], calls: int = 4) -> None:
    """``torch.compile(loss_fn, mode="reduce-overhead")`` as a fitting loop calls it: the same leaves,
    moved in place between steps, ``.backward()``, and a new step marked. Warm-up, recording, then
    CUDA graph replays give eager's loss and gradients (float32: to 2e-6 of the largest)."""
    from torch._dynamo.utils import counters

    counters.clear()
    compiled = torch.compile(loss_fn, fullgraph=True, mode="reduce-overhead")
    g = torch.Generator(device="cuda").manual_seed(9)
    base = [t.detach().clone() for t in leaves]
    leaves = [t.detach().clone().requires_grad_(True) for t in leaves]
    for _ in range(calls):  # the calls after the first two replay the recorded graph
        with torch.no_grad():
            for leaf, b in zip(leaves, base):
                leaf.copy_(b + 0.05 * torch.randn(b.shape, generator=g, device="cuda"))
            eager_leaves = [leaf.detach().clone().requires_grad_(True) for leaf in leaves]
        torch.compiler.cudagraph_mark_step_begin()
        for leaf in leaves:
            leaf.grad = None
        loss = compiled(*leaves)
        loss.backward()
        got_loss, got = loss.detach().clone(), [leaf.grad.clone() for leaf in leaves]
        del loss
        eager = loss_fn(*eager_leaves)
        eager.backward()
        _close(got_loss, eager.detach(), torch.float32)
        for a, b in zip(got, eager_leaves):
            _close(a, b.grad, torch.float32)
    # Inductor runs a graph it will not capture (a CPU tensor in it, say) without CUDA graphs.
    assert counters["inductor"]["cudagraph_skips"] == 0, "the compiled step ran without CUDA graphs"


@requires_cuda
def test_reduce_overhead_replays_planarity_and_matches_eager():
    # A PlaneSet never called eagerly: its device tables are made while the compiled step is traced,
    # not during CUDA graph trees' warm-up, whose allocations land in the graph's pool (torch used to
    # refuse the graph: "Detected 2 tensor(s) in the cudagraph pool not tracked as outputs").
    m = model("1aki")
    planes = kernels.find_planes(m)
    torch._dynamo.reset()
    _reduce_overhead_matches_eager(lambda x: 0.5 * kernels.planarity_nll(x, planes), [m.atoms.xyz.float().cuda()])


@requires_cuda
def test_reduce_overhead_replays_tricubic_and_matches_eager():
    m = model("1aki")
    grid = kernels.GridSpec.for_spacing(m.cell, 0.9)  # a grid no eager call has used
    g = torch.Generator(device="cuda").manual_seed(6)
    rho = torch.randn(grid.shape, generator=g, device="cuda")
    pts = ((torch.rand(5000, 3, generator=g, device="cuda", dtype=torch.float64)) @ m.cell.orth.T.cuda()).float()
    torch._dynamo.reset()
    _reduce_overhead_matches_eager(lambda r, p: kernels.tricubic_sample(r, grid, p).square().sum(), [rho, pts])


@requires_cuda
@pytest.mark.parametrize("name, spacing, with_u", [("1orc", 1.0, False), ("1aki", 0.667, False), ("1aki", 0.8, True)])
def test_reduce_overhead_replays_the_density_loss_and_matches_eager(name, spacing, with_u):
    """The fitting step's density term as ``docs/kernels.md`` ("In a loop") writes it, on grids no eager call has
    used: the atoms rebuilt from the positions leaf, the squared difference to a target map."""
    m = model(name)
    atoms = m.atoms.replace(u_aniso=None, aniso=None).to("cuda", torch.float32)
    if with_u:  # every atom anisotropic, U = diag(1.5, 0.8, 1)·B/8π² tilted by small off-diagonal terms
        iso_u = atoms.b_iso / (8 * torch.pi**2)
        u = torch.stack([1.5 * iso_u, 0.8 * iso_u, iso_u, 0.2 * iso_u, -0.1 * iso_u, 0.05 * iso_u], dim=1)
        atoms = atoms.replace(u_aniso=u, aniso=torch.ones(len(atoms), dtype=torch.bool, device="cuda"))
    grid = kernels.GridSpec.for_spacing(m.cell, spacing)
    g = torch.Generator(device="cuda").manual_seed(3)
    target = torch.rand(grid.shape, generator=g, device="cuda")
    torch._dynamo.reset()
    _reduce_overhead_matches_eager(
        lambda x: (kernels.splat_density(atoms.replace(xyz=x), grid) - target).square().sum(), [atoms.xyz]
    )


# --------------------------------------------------------------------------- the eager path


@requires_cuda
def test_periodic_tricubic_makes_no_host_sync():
    m = model("1aki")
    grid = kernels.GridSpec.for_spacing(m.cell, 1.0)
    rho = torch.randn(grid.shape, device="cuda").requires_grad_(True)
    pts = (torch.rand(3000, 3, device="cuda") * 30).requires_grad_(True)
    for method in ("catmull-rom", "lagrange"):  # first calls: compile, grid parameters
        kernels.tricubic_sample(rho, grid, pts, method=method).sum().backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for method in ("catmull-rom", "lagrange"):
            kernels.tricubic_sample(rho, grid, pts, method=method).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@requires_cuda
def test_direct_launch_is_taken_and_equals_the_normal_launch(monkeypatch):
    """Each specialisation's kept kernel is launched directly afterwards and gives what the normal launch gives,
    bit for bit (the same kernels on the same data, deterministic but for the map gradient's atomics).

    The specialisations run one after another with the same launchers: the planarity forward with and
    without its backward table, tricubic Catmull-Rom and Lagrange, periodic and bounded, with a misaligned
    point array. A key that missed any of them would hand a later call another call's kernel, whose values
    differ.
    """
    m = model("1aki")
    planes = kernels.find_planes(m)
    cell = m.cell
    grid = kernels.GridSpec.for_spacing(cell, 1.0)
    g = torch.Generator(device="cuda").manual_seed(8)
    rho = torch.randn(grid.shape, generator=g, device="cuda")
    pts = (torch.rand(5000, 3, generator=g, device="cuda") * 1.4 - 0.2) @ cell.orth.T.float().cuda()
    shifted = misaligned(pts)

    def planarity(with_grad: bool):
        x = m.atoms.xyz.float().cuda().requires_grad_(with_grad)
        with torch.set_grad_enabled(with_grad):
            loss = kernels.planarity_nll(x, planes)
        if not with_grad:
            return (loss,)
        loss.backward()
        return loss.detach(), x.grad

    def tricubic(points: torch.Tensor, method: str, mode: str):
        r = rho.clone().requires_grad_(True)
        p = points.detach().requires_grad_(True)  # a new leaf on the same memory (alignment kept)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", OutsideMapWarning)
            values = kernels.tricubic_sample(r, grid, p, method=method, mode=mode)
        values.sum().backward()
        return values.detach(), p.grad, r.grad

    cases = {
        "planarity": lambda: planarity(True),
        "planarity, no grad": lambda: planarity(False),
        "catmull-rom": lambda: tricubic(pts, "catmull-rom", "periodic"),
        "lagrange": lambda: tricubic(pts, "lagrange", "periodic"),
        "lagrange, bounded": lambda: tricubic(pts, "lagrange", "bounded"),
        "catmull-rom, misaligned points": lambda: tricubic(shifted, "catmull-rom", "periodic"),
    }

    def compare(name, got, want):
        torch.cuda.synchronize()
        for a, b in zip(got[:2], want[:2]):
            assert torch.equal(a, b), name
        for a, b in zip(got[2:], want[2:]):
            assert_kernel_close(a, b)  # the map gradient: float32 atomics, order varies

    launchers = (planarity_triton._fwd_launch, planarity_triton._bwd_launch, tricubic_triton._fwd_launch,
                 tricubic_triton._bwd_launch)  # fmt: skip
    check_direct_launches(monkeypatch, launchers, cases, compare)


def _allocations(fn, warm: bool = True) -> tuple[int, object]:
    """Allocations of one call of ``fn``, after a first call when ``warm`` (that one compiles a new
    variant and may allocate Triton's own scratch)."""
    if warm:
        fn()
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    out = fn()
    torch.cuda.synchronize()
    return torch.cuda.memory_stats()["allocation.all.allocated"] - before, out


def _kernels(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@requires_cuda
def test_eager_calls_allocate_and_launch_only_their_outputs():
    # The host time of an eager call is its launches and allocations: forward without grad is
    # one output and one kernel; with grad the forward adds its table and the backward is one
    # allocation (the gradient) and one kernel.
    m = model("1aki")
    planes = kernels.find_planes(m)
    x = m.atoms.xyz.float().cuda().requires_grad_(True)
    seed = torch.ones((), device="cuda")
    kernels.planarity_nll(x, planes).backward(seed)  # warm-up: compile, device tables, scratch
    with torch.no_grad():
        n, _ = _allocations(lambda: kernels.planarity_nll(x, planes))
        assert n == 1, n
        assert len(_kernels(lambda: kernels.planarity_nll(x, planes))) == 1
    n, loss = _allocations(lambda: kernels.planarity_nll(x, planes))
    assert n == 2, n
    n, _ = _allocations(lambda: torch.autograd.grad(loss, x, seed), warm=False)
    assert n == 1
    names = _kernels(lambda: torch.autograd.grad(kernels.planarity_nll(x, planes), x, seed))
    assert len(names) == 2, names

    grid = kernels.GridSpec.for_spacing(m.cell, 1.0)
    rho = torch.randn(grid.shape, device="cuda")
    pts = torch.rand(1000, 3, device="cuda") * 20
    p = pts.clone().requires_grad_(True)
    kernels.tricubic_sample(rho, grid, p).sum().backward()
    with torch.no_grad():
        n, _ = _allocations(lambda: kernels.tricubic_sample(rho, grid, pts))
        assert n == 1
        assert len(_kernels(lambda: kernels.tricubic_sample(rho, grid, pts))) == 1
    up = torch.ones(1000, device="cuda")
    values = kernels.tricubic_sample(rho, grid, p)
    n, _ = _allocations(lambda: torch.autograd.grad(values, p, up), warm=False)
    assert n == 1  # the points gradient; the map's is not asked for
    names = _kernels(lambda: torch.autograd.grad(kernels.tricubic_sample(rho, grid, p), p, up))
    assert len(names) == 2, names
