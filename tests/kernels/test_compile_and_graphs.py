"""The density splat inside ``torch.compile`` (custom ops), inside CUDA graphs, and what an eager call launches.

``kernels.splat_density`` runs the backend's ``torch.library`` custom op while compiling
(``kernels/density/ops.py``) and the direct autograd Function eagerly; both must give the same maps
and gradients. CPU tests run in CI (the cpu backend; the triton ops under the interpreter), CUDA ones
on a GPU.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import triton
import triton.language as tl
from torch._dynamo.backends.registry import lookup_backend

import kernels
from kernels import _launch
from kernels.crystal import AtomSet, Cell, GridSpec
from kernels.density import triton as triton_splat
from tests.helpers import assert_kernel_close, model, requires_cuda

CELL = Cell.from_parameters(20.0, 24.0, 28.0, 90.0, 100.0, 90.0)
GRID = GridSpec(CELL, (20, 24, 28))


def _atoms(device="cpu") -> AtomSet:
    xyz = torch.tensor([[1.0, 2.0, 3.0], [5.0, 6.0, 7.0], [10.0, 3.0, 20.0], [19.5, 23.0, 1.0]])
    atoms = AtomSet.from_elements(["C", "N", "O", "S"], xyz, torch.tensor([20.0, 30.0, 15.0, 45.0]), torch.ones(4))
    return atoms.to(device, torch.float32)


def _loop(base: AtomSet, grid: GridSpec, w: torch.Tensor, backend: str, steps: int = 3):
    """A refinement-like loop: ``steps`` splats of moved atoms, each weighted and summed."""

    def run(xyz, b_iso, occ):
        total = xyz.new_zeros(())
        for i in range(steps):
            at = AtomSet(xyz + 0.1 * i, b_iso * (1.0 + 0.05 * i), occ, base.a, base.b, _validate=False)
            total = total + (kernels.splat_density(at, grid, backend=backend) * w).sum()
        return total

    return run


def _value_and_grads(fn, base: AtomSet):
    leaves = [t.detach().clone().requires_grad_(True) for t in (base.xyz, base.b_iso, base.occ)]
    value = fn(*leaves)
    return value, torch.autograd.grad(value, leaves)


def _check_compiled_loop(base: AtomSet, backend: str, compiler: str):
    w = torch.randn(GRID.shape, generator=torch.Generator().manual_seed(0)).to(base.device)
    run = _loop(base, GRID, w, backend)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager, eager_g = _value_and_grads(run, base)
        torch._dynamo.reset()
        graphs = []

        def recording(gm, example_inputs):
            graphs.append(str(gm.graph))
            return lookup_backend(compiler)(gm, example_inputs)

        compiled, compiled_g = _value_and_grads(torch.compile(run, fullgraph=True, backend=recording), base)
    op = "kernels.density_triton" if backend == "triton" else "kernels.density_cpu"
    assert len(graphs) == 1 and graphs[0].count(op) == 3, graphs  # one graph, the op once per step
    assert abs(float(compiled.detach()) - float(eager.detach())) <= 1e-5 * abs(float(eager.detach())) + 1e-6
    for name, g, ge in zip(("xyz", "b_iso", "occ"), compiled_g, eager_g):
        assert float(ge.abs().max()) > 0, name
        try:
            assert_kernel_close(g, ge)
        except AssertionError as exc:
            raise AssertionError(f"gradient of {name}: {exc}") from None


def test_compiled_loop_matches_eager_cpu_backend():
    # fullgraph: a graph break (a host read, an untraceable call) in splat_density fails here.
    _check_compiled_loop(_atoms("cpu"), "cpu", "inductor")


def test_compiled_loop_matches_eager_triton_ops():
    # The triton custom ops: under the interpreter here (CPU tensors; aot_eager, which traces the ops and
    # their fake and backward registrations without generating code), on the GPU with inductor.
    if torch.cuda.is_available():
        _check_compiled_loop(_atoms("cuda"), "triton", "inductor")
    else:
        _check_compiled_loop(_atoms("cpu"), "triton", "aot_eager")


def test_the_triton_plan_is_made_while_the_call_is_traced(monkeypatch):
    """The ops find their plan made before any compiled code runs: made at the first run, inside a CUDA graph's
    warm-up (``mode="reduce-overhead"``), its device tensor would land in the graph's pool and torch refuses
    the graph ("tensor(s) in the cudagraph pool not tracked as outputs"; a GPU test replays such a loss)."""
    from kernels.density import triton as tri

    device = "cuda" if torch.cuda.is_available() else "cpu"
    base = _atoms(device)
    grid = GridSpec(CELL, (20, 24, 32))  # a grid no other test plans for this device
    monkeypatch.setattr(tri, "_plans", {})
    built, seen = [], []
    real_build = tri._Plan.build
    monkeypatch.setattr(tri._Plan, "build", classmethod(lambda cls, *a: built.append(a[0].shape) or real_build(*a)))

    def backend(gm, example_inputs):
        seen.append(list(built))  # what had been planned when dynamo handed over the graph
        return gm.forward

    def loss(xyz):
        return kernels.splat_density(
            AtomSet(xyz, base.b_iso, base.occ, base.a, base.b, _validate=False), grid, backend="triton"
        ).sum()

    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.compile(loss, fullgraph=True, backend=backend)(base.xyz.clone().requires_grad_(True)).backward()
    assert seen and seen[0] == [grid.shape], (seen, built)
    assert built == [grid.shape], built  # the compiled run found it


def test_custom_ops_pass_opcheck():
    """Schema, fake (meta) implementation and autograd registration of the ops, by torch's own checker."""
    from kernels.density import cpu, ops  # noqa: F401  (register the ops)

    base = _atoms("cpu")
    args = [t.clone().requires_grad_(True) for t in (base.xyz, base.b_iso, base.occ)]
    cell, shape = list(CELL.parameters), list(GRID.shape)
    tests = ("test_schema", "test_autograd_registration", "test_faketensor")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.library.opcheck(
            torch.ops.kernels.density_cpu.default,
            (*args, base.a, base.b, cell, shape, None, 1e-5, "xray", "gemmi"),
            test_utils=tests,
        )
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        t_args = [a.detach().to(dev).requires_grad_(True) for a in args]
        for radius in (None, 2.5):
            torch.library.opcheck(
                torch.ops.kernels.density_triton.default,
                (*t_args, base.a.to(dev), base.b.to(dev), cell, shape, radius, 1e-5, 1),
                test_utils=tests,
            )


def test_compiled_op_calls_reach_the_implementation_without_torch_library_wrappers(monkeypatch):
    """A compiled graph calls its ops at every run: each call goes from the dispatcher to our implementation.

    ``torch.library.custom_op`` puts a Python autograd layer, a redispatch and a checking wrapper
    (``torch/_library``) between them, which cost host time at every call of the compiled step.
    """
    import traceback

    from kernels.density import cpu

    stacks = []

    def recording(real):
        def call(*args, **kwargs):
            stacks.append([f"{f.filename}:{f.name}".replace("\\", "/") for f in traceback.extract_stack()])
            return real(*args, **kwargs)

        return call

    for name in ("_splat", "_gather"):  # the op's forward and backward call these at run time
        monkeypatch.setattr(cpu, name, recording(getattr(cpu, name)))
    base = _atoms("cpu")
    w = torch.randn(GRID.shape, generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _value_and_grads(torch.compile(_loop(base, GRID, w, "cpu", steps=1), fullgraph=True), base)
    assert any("_opdef.py" in f for s in stacks for f in s), "the compiled step did not run the op"
    for stack in stacks:
        assert not [f for f in stack if "torch/_library/" in f], stack
        # Nor an autograd Function of the op's own: the compiled graph's autograd is the graph's.
        assert not [f for f in stack if f.endswith("_opdef.py:forward")], stack


def test_custom_op_backward_refuses_create_graph():
    """The ops are not twice differentiable: a backward with create_graph=True says so."""
    from kernels.density import cpu  # noqa: F401  (registers the ops)

    base = _atoms("cpu")
    leaves = [t.clone().requires_grad_(True) for t in (base.xyz, base.b_iso, base.occ)]
    out = torch.ops.kernels.density_cpu(
        *leaves, base.a, base.b, list(CELL.parameters), list(GRID.shape), None, 1e-5, "xray", "gemmi"
    )
    with pytest.raises(RuntimeError, match="kernels::density_cpu is not twice differentiable"):
        torch.autograd.grad(out.sum(), leaves, create_graph=True)
    # Without create_graph the same backward runs (the gradient of the map's sum is the occupancy's).
    g = torch.autograd.grad(out.sum(), leaves)
    assert float(g[2].abs().max()) > 0


def test_eager_calls_do_not_go_through_the_custom_ops(monkeypatch):
    """The ops' dispatch costs host time: eager splat_density calls the backends directly."""
    from kernels.density import ops

    def refuse(*args, **kwargs):
        raise AssertionError("an eager call went through the custom op")

    monkeypatch.setattr(ops, "splat_density_op", refuse)
    base = _atoms("cpu")
    out = kernels.splat_density(base, GRID, backend="cpu")
    assert float(out.max()) > 0


# --------------------------------------------------------------------------- CUDA


@requires_cuda
def test_cuda_graph_capture_and_replay_of_the_public_call():
    m = model("1aki")
    grid = GridSpec.for_spacing(m.cell, 2.0 / 3.0)
    base = m.atoms.to("cuda", torch.float32)
    leaves = [t.clone().requires_grad_(True) for t in (base.xyz, base.b_iso, base.occ)]
    atoms = AtomSet(*leaves, base.a, base.b, _validate=False)
    w = torch.randn(grid.shape, device="cuda")

    def step():
        out = kernels.splat_density(atoms, grid)
        return (out,) + torch.autograd.grad((out * w).sum(), leaves)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile and cache the direct launches outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    with torch.no_grad():
        leaves[0].add_(0.05 * torch.randn_like(leaves[0]))
        leaves[1].mul_(1.1)
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    for got, want in zip(captured, eager):
        assert_kernel_close(got, want)


class _CountingKernel:
    """A kernel's stand-in for its launcher that counts normal launches (``kernel[grid]``) and makes them."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.launches = 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


_LAUNCHERS = (
    triton_splat._fwd_launch,
    triton_splat._bwd_launch,
    triton_splat._aniso_fwd_launch,
    triton_splat._aniso_bwd_launch,
)


def misaligned(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` whose data pointer is 4 bytes past a 16-byte boundary (same shape, contiguous)."""
    storage = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = storage[1:].view(t.shape)
    out.copy_(t)
    assert out.data_ptr() % 16 != 0
    return out


def _splat_case(atoms: AtomSet, grid: GridSpec, grad_out: torch.Tensor, *, n_frames=None, radius=None):
    """A call returning the map and the gradients of Σ grad_out·ρ for fresh leaves of ``atoms``."""
    names = ("xyz", "b_iso", "occ") + (("u_aniso",) if atoms.u_aniso is not None else ())

    def run():
        leaves = [getattr(atoms, name).detach().clone().requires_grad_(True) for name in names]
        fields = dict(zip(names, leaves))
        at = AtomSet(
            fields["xyz"], fields["b_iso"], fields["occ"], atoms.a, atoms.b,
            u_aniso=fields.get("u_aniso"), aniso=atoms.aniso, _validate=False,
        )  # fmt: skip
        if n_frames is None:
            out = triton_splat.splat_triton(at, grid, radius=radius)
        else:
            out = triton_splat.splat_frames_triton(at, grid, n_frames=n_frames, radius=radius)
        return (out.detach(), *torch.autograd.grad(out, leaves, grad_outputs=grad_out))

    return run


def check_direct_launches(monkeypatch, launchers, cases: dict, compare) -> None:
    """Run every case with normal launches, then twice more, directly: ``compare(name, got, normal)`` each.

    ``cases`` maps a name to a call that returns its outputs. The launchers start empty; the normal pass keeps
    each specialisation's kernel, and the direct passes must launch none normally (a counting stand-in of each
    kernel says so) and none may be refused.
    """
    for launcher in launchers:
        monkeypatch.setattr(launcher, "compiled", {})
        monkeypatch.setattr(launcher, "verified", False)
    assert _launch.fast_launch_enabled()
    try:
        _launch.fast_launch_enabled(False)
        normal = {name: run() for name, run in cases.items()}  # normal launches; each keeps its kernel
    finally:
        _launch.fast_launch_enabled(True)
    assert all(launcher.compiled for launcher in launchers), "a launcher kept no compiled kernel"
    for launcher in launchers:
        monkeypatch.setattr(launcher, "kernel", _CountingKernel(launcher.kernel))
    for _ in range(2):  # the first direct call of each launcher is checked by it, the second is not
        for name, run in cases.items():
            compare(name, run(), normal[name])
    for launcher in launchers:
        assert launcher.verified and not launcher.broken, "the direct launch was refused by this Triton"
        assert launcher.kernel.launches == 0, f"{launcher.kernel.kernel.__name__} took the normal launch"


@requires_cuda
def test_direct_launch_matches_the_normal_launch(monkeypatch):
    """Each specialisation's kept kernel is launched directly afterwards and gives what the normal launch gives.

    The specialisations run one after another with the same launchers: float32 and float64 positions, one
    map and two frames, per-atom and fixed radii, isotropic and anisotropic kernels, an aligned and a
    misaligned upstream gradient. A key that missed any of them would hand a later call another call's
    kernel (float64 positions read as float32, one map's indexing for frames, aligned vector loads of a
    misaligned gradient), and its maps or gradients would differ from the normal launch's.
    """
    iso = model("1aki")
    grid = GridSpec.for_spacing(iso.cell, 2.0 / 3.0)
    base = iso.atoms.to("cuda", torch.float32)
    base = AtomSet(base.xyz, base.b_iso, base.occ, base.a, base.b, _validate=False)
    w = torch.randn(grid.shape, device="cuda")
    pair = AtomSet(
        torch.cat([base.xyz, base.xyz + 0.4]), base.b_iso.repeat(2), base.occ.repeat(2), base.a.repeat(2, 1),
        base.b.repeat(2, 1), _validate=False,
    )  # fmt: skip
    w2 = torch.randn((2, *grid.shape), device="cuda")
    # An AtomSet holds one dtype: the float64 set's positions reach the kernels as float64 (wrapped there),
    # its other fields as float32 copies.
    xyz64 = base.to(dtype=torch.float64)
    aniso_model = model("3o5r")
    agrid = GridSpec.for_spacing(aniso_model.cell, 2.0 / 3.0)
    aniso = aniso_model.atoms.to("cuda", torch.float32)
    assert aniso.u_aniso is not None and bool(aniso.aniso.any())
    wa = torch.randn(agrid.shape, device="cuda")
    cases = {
        "float32": _splat_case(base, grid, w),
        "misaligned gradient": _splat_case(base, grid, misaligned(w)),
        "float64 positions": _splat_case(xyz64, grid, w),
        "frames": _splat_case(pair, grid, w2, n_frames=2),
        "fixed radius": _splat_case(base, grid, w, radius=2.5),
        "anisotropic": _splat_case(aniso, agrid, wa),
        "anisotropic, misaligned gradient": _splat_case(aniso, agrid, misaligned(wa)),
    }

    def compare(name, got, want):
        for g, ref in zip(got, want):
            assert_kernel_close(g, ref)

    check_direct_launches(monkeypatch, _LAUNCHERS, cases, compare)


@triton.jit
def _add_one(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1.0, mask=i < n)


@requires_cuda
def test_a_device_without_index_is_the_current_device():
    """``torch.device("cuda")`` (no index) names the current device: the kept kernel is launched there.

    A caller that builds its device that way instead of taking a tensor's must get the launch, not an
    endless retry to make "device None" current.
    """
    launcher = _launch.FastLauncher(_add_one)
    x = torch.zeros(100, device="cuda")
    for _ in range(3):  # the first call keeps the kernel, the next ones launch it directly
        launcher((1, 1, 1), ("add_one",), (x, 100, 128), torch.device("cuda"), 1)
    torch.cuda.synchronize()
    assert launcher.compiled and launcher.verified
    assert torch.equal(x, torch.full_like(x, 3.0))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (a call on the non-current one)")
def test_call_on_another_device_launches_there_on_its_current_stream(monkeypatch):
    """Atoms on cuda:1 while cuda:0 is current: the kernels run on cuda:1, on cuda:1's current stream.

    The map is checked against one made with cuda:1 current. The stream check: cuda:1's current stream is a
    side stream that first sleeps, then moves the atoms; a launch on any other stream runs before the move
    and splats the old positions.
    """
    iso = model("1aki")
    grid = GridSpec.for_spacing(iso.cell, 2.0 / 3.0)
    at = iso.atoms.to("cuda:1", torch.float32)
    at = AtomSet(at.xyz.clone(), at.b_iso, at.occ, at.a, at.b, _validate=False)
    moved = at.xyz + 0.5
    w = torch.randn(grid.shape, device="cuda:1")
    previous = torch.cuda.current_device()
    side = torch.cuda.Stream(device=1)
    try:
        torch.cuda.set_device(1)
        want = _splat_case(at, grid, w)()
        want_moved = triton_splat.splat_triton(AtomSet(moved, at.b_iso, at.occ, at.a, at.b, _validate=False), grid)
        assert float((want_moved - want[0]).abs().max()) > 1e-3 * float(want[0].abs().max())
        torch.cuda.set_device(0)
        for launcher in _LAUNCHERS[:2]:
            monkeypatch.setattr(launcher, "compiled", {})
            monkeypatch.setattr(launcher, "kernel", _CountingKernel(launcher.kernel))
        for _ in range(2):  # the first keeps the kernels (compiled for cuda:1), the second launches them directly
            for got, ref in zip(_splat_case(at, grid, w)(), want):
                assert_kernel_close(got, ref)
            assert torch.cuda.current_device() == 0
        for launcher in _LAUNCHERS[:2]:
            assert [key[3] for key in launcher.compiled] == [1]
            assert launcher.kernel.launches == 1, "the second call on cuda:1 took the normal launch"
        torch.cuda.set_stream(side)  # cuda:1's current stream (this makes cuda:1 current)
        torch.cuda.set_device(0)
        assert torch.cuda.current_stream(1) == side
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)
            at.xyz.copy_(moved)
        with torch.no_grad():
            out = triton_splat.splat_triton(at, grid)
        torch.cuda.synchronize(1)
        assert_kernel_close(out, want_moved)
    finally:
        torch.cuda.set_stream(torch.cuda.default_stream(1))
        torch.cuda.set_device(previous)


def test_a_launch_hook_takes_the_normal_launch(monkeypatch):
    """A profiler's launch hook gets every launch: with one installed the direct launch (which passes no hooks)
    is not taken. On CUDA the hook is seen called by kernels kept for direct launches; everywhere the check
    itself is exercised with each kind of hook (a HookChain entry, Triton 3.6's plain callable)."""
    from triton import knobs

    assert _launch._hooks_idle()
    seen = []

    def hook(metadata):
        seen.append(metadata)

    chain = knobs.runtime.launch_enter_hook
    chain.add(hook)
    try:
        assert not _launch._hooks_idle()
        if torch.cuda.is_available():
            run = _splat_case(_atoms("cuda"), GRID, torch.randn(GRID.shape, device="cuda"))
            chain.remove(hook)
            run()  # keeps both kernels
            assert all(launcher.compiled for launcher in _LAUNCHERS[:2])
            chain.add(hook)
            run()
            assert len(seen) == 2, "a launch with a hook installed went directly"
    finally:
        chain.remove(hook)
    assert _launch._hooks_idle()
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", hook)
    assert not _launch._hooks_idle()


def test_launches_keep_a_compiled_kernel_only_on_a_gpu():
    """On CUDA a call keeps its compiled kernels for direct launches; the interpreter keeps none (it launches
    normally, and returns no compiled kernel) and does not mark the launchers refused."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    base = _atoms(device)
    for launcher in _LAUNCHERS[:2]:
        launcher.compiled.clear()
    _splat_case(base, GRID, torch.randn(GRID.shape, device=device))()
    for launcher in _LAUNCHERS[:2]:
        assert not launcher.broken
        assert bool(launcher.compiled) == (device == "cuda"), (device, list(launcher.compiled))


def test_constexprs_are_passed_in_signature_order():
    """The launches pass every argument positionally: the plan's constexpr tuples must follow the kernels'
    signatures (the names end each kernel's argument list, in this order)."""
    plan = triton_splat._plan(GRID, None, kernels.DEFAULT_CUTOFF, torch.device("cpu"))
    iso = triton_splat._CONSTEXPR_NAMES
    aniso = triton_splat._ANISO_CONSTEXPR_NAMES
    for kernel, names, values in (
        (triton_splat._splat_fwd_kernel, triton_splat._FWD_CONSTEXPR_NAMES, plan.constexprs(False, False)),
        (triton_splat._splat_bwd_kernel, iso, plan.constexprs_bwd(False, False)),
        (
            triton_splat._aniso_fwd_kernel,
            triton_splat._ANISO_FWD_CONSTEXPR_NAMES,
            plan.constexprs_aniso(False, 1, False, False, False),
        ),
        (triton_splat._aniso_bwd_kernel, aniso, plan.constexprs_aniso(True, 1, False, False, False)),
    ):
        assert len(values) == len(names)
        assert tuple(kernel.arg_names[-len(names) :]) == names, (kernel.arg_names, names)


@requires_cuda
def test_eager_call_launches_one_kernel_each_way():
    """Forward: one memset of the map and one splat launch (the radii are computed in it); backward: one launch."""
    from torch.profiler import ProfilerActivity, profile

    m = model("1aki")
    grid = GridSpec.for_spacing(m.cell, 2.0 / 3.0)
    base = m.atoms.to("cuda", torch.float32)
    xyz = base.xyz.clone().requires_grad_(True)
    atoms = AtomSet(xyz, base.b_iso, base.occ, base.a, base.b, _validate=False)
    w = torch.randn(grid.shape, device="cuda")
    for _ in range(2):  # compile, cache the plan and the direct launches
        torch.autograd.grad(kernels.splat_density(atoms, grid), xyz, grad_outputs=w)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        with torch.no_grad():
            kernels.splat_density(atoms, grid)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert sum("_splat_fwd_kernel" in n for n in names) == 1 and len(names) <= 2, names
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.autograd.grad(kernels.splat_density(atoms, grid), xyz, grad_outputs=w)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert sum("_splat_bwd_kernel" in n for n in names) == 1 and len(names) <= 3, names


def test_ceil_div_is_the_program_count_triton_computes():
    import triton

    for n in (0, 1, 2, 31, 32, 33, 1079, 17146, 2**31 + 5):
        for d in (1, 2, 4, 32, 128, 1024):
            assert _launch.ceil_div(n, d) == triton.cdiv(n, d) == -(-n // d)


@pytest.mark.parametrize("backend", ["mine", "reference"])
def test_backends_without_an_op_refuse_under_compile_saying_why(backend):
    """A registered Python backend (and the reference) has no torch.library op. Compiled without
    fullgraph, the call breaks the graph and runs eagerly; with fullgraph=True it fails with the
    kernels.BackendError naming the backend, why, and what to do (inside dynamo's own error), instead of
    tracing into the backend."""

    def mine(atoms, grid, *, radius=None, cutoff=1e-5):
        return torch.zeros(grid.shape, dtype=torch.float32)

    kernels.register_backend("density", "mine", mine, devices=("cpu",))
    try:
        base = _atoms("cpu")
        assert float(kernels.splat_density(base, GRID, backend="mine").abs().sum()) == 0  # eager: runs

        def run(xyz):
            return kernels.splat_density(base.replace(xyz=xyz), GRID, backend=backend).sum()

        torch._dynamo.reset()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compiled = torch.compile(run, backend="aot_eager")(base.xyz.clone())
            assert_kernel_close(compiled, run(base.xyz.clone()))
        torch._dynamo.reset()
        with pytest.raises(Exception) as info:
            torch.compile(run, fullgraph=True, backend="aot_eager")(base.xyz.clone())
        message = str(info.value)
        assert "BackendError" in message and "fullgraph" in message and "outside" in message, message
        assert repr(backend) in message or "reference density backend" in message, message
    finally:
        kernels.unregister_backend("density", "mine")


def test_a_second_order_backward_raises_instead_of_dropping_terms():
    """The kernels' backward is invisible to autograd: with create_graph=True it would return first-order
    gradients with no graph behind them (a Hessian-vector product of zero, silently). It raises instead."""
    base = _atoms("cuda" if torch.cuda.is_available() else "cpu")
    x = base.xyz.clone().requires_grad_(True)
    rho = kernels.splat_density(base.replace(xyz=x), GRID, backend="triton")
    with pytest.raises(RuntimeError, match="not twice differentiable"):
        torch.autograd.grad((rho * rho).sum(), x, create_graph=True)
    rho = kernels.splat_density(base.replace(xyz=x), GRID, backend="triton")
    (g,) = torch.autograd.grad((rho * rho).sum(), x)  # first order: unchanged
    assert float(g.abs().max()) > 0


def _aniso_atoms() -> AtomSet:
    base = _atoms("cpu")
    u = torch.tensor([[0.30, 0.20, 0.25, 0.05, -0.02, 0.01]]).repeat(len(base), 1)
    return base.replace(u_aniso=u, aniso=torch.tensor([True, False, True, True]))


# Every keyword of splat_density that a compiled loss may pass, each with a value other than its
# default: a host check that dynamo cannot trace (a generator, a host read) fails the fullgraph compile.
SPLAT_KEYWORDS = [
    ("radius", {"radius": 2.5}, False),
    ("cutoff", {"cutoff": 1e-4}, False),
    ("blur", {"blur": 6.0}, False),
    ("blur negative", {"blur": -5.0}, False),
    ("radius_rule eigen", {"radius_rule": "eigen"}, True),
    ("radius and U", {"radius": 2.0}, True),
    ("backend", {"backend": "cpu"}, False),
]


@pytest.mark.parametrize("kwargs,aniso", [(k, a) for _, k, a in SPLAT_KEYWORDS], ids=[n for n, _, _ in SPLAT_KEYWORDS])
def test_every_splat_keyword_compiles_with_fullgraph(kwargs, aniso):
    base = _aniso_atoms() if aniso else _atoms("cpu")
    w = torch.randn(GRID.shape, generator=torch.Generator().manual_seed(1))

    def loss(xyz):
        return (kernels.splat_density(base.replace(xyz=xyz), GRID, **kwargs) * w).sum()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        x = base.xyz.clone().requires_grad_(True)
        want = loss(x)
        (want_g,) = torch.autograd.grad(want, x)
        torch._dynamo.reset()
        x = base.xyz.clone().requires_grad_(True)
        got = torch.compile(loss, fullgraph=True, backend="aot_eager")(x)
        (got_g,) = torch.autograd.grad(got, x)
    assert abs(float(got) - float(want)) <= 1e-5 * abs(float(want)) + 1e-6
    assert float(want_g.abs().max()) > 0
    assert_kernel_close(got_g, want_g)


@pytest.mark.parametrize(
    "kwargs", [{"method": "lagrange"}, {"mode": "bounded"}, {"mode": "bounded", "fill_value": 0.5}]
)
def test_every_tricubic_keyword_compiles_with_fullgraph(kwargs):
    rho = torch.randn(GRID.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    pts = torch.rand(50, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 30.0 - 2.0

    def loss(p):
        return kernels.tricubic_sample(rho, GRID, p, **kwargs).square().sum()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = pts.clone().requires_grad_(True)
        want = loss(p)
        (want_g,) = torch.autograd.grad(want, p)
        torch._dynamo.reset()
        p = pts.clone().requires_grad_(True)
        got = torch.compile(loss, fullgraph=True, backend="aot_eager")(p)
        (got_g,) = torch.autograd.grad(got, p)
    assert abs(float(got) - float(want)) <= 1e-9 * abs(float(want)) + 1e-12
    assert_kernel_close(got_g, want_g)
