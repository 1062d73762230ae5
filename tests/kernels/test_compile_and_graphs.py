"""The density splat inside ``torch.compile`` (custom ops), inside CUDA graphs, and what an eager call launches.

``kernels.splat_density`` runs the backend's ``torch.library`` custom op while compiling
(``kernels/density/ops.py``) and the direct autograd Function eagerly; both must give the same maps
and gradients. CPU tests run in CI (the cpu backend; the triton ops under the interpreter), CUDA ones
on a GPU.
"""

from __future__ import annotations

import warnings

import torch
from torch._dynamo.backends.registry import lookup_backend

import kernels
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


def test_custom_ops_pass_opcheck():
    """Schema, fake (meta) implementation and autograd registration of the ops, by torch's own checker."""
    from kernels.density import ops  # noqa: F401  (registers the ops)

    base = _atoms("cpu")
    args = [t.clone().requires_grad_(True) for t in (base.xyz, base.b_iso, base.occ)]
    cell, shape = list(CELL.parameters), list(GRID.shape)
    tests = ("test_schema", "test_autograd_registration", "test_faketensor")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.library.opcheck(
            torch.ops.kernels.density_cpu.default, (*args, base.a, base.b, cell, shape, None, 1e-5), test_utils=tests
        )
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        t_args = [a.detach().to(dev).requires_grad_(True) for a in args]
        for radius in (None, 2.5):
            torch.library.opcheck(
                torch.ops.kernels.density_triton.default,
                (*t_args, base.a.to(dev), base.b.to(dev), cell, shape, radius, 1e-5, 1),
                test_utils=tests,
            )


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


@requires_cuda
def test_direct_launch_matches_the_normal_launch(monkeypatch):
    """After the first call a plan launches its compiled kernels directly; the normal launch gives the same."""
    m = model("1aki")
    grid = GridSpec.for_spacing(m.cell, 2.0 / 3.0)
    base = m.atoms.to("cuda", torch.float32)
    plan = triton_splat._plan(grid, None, kernels.DEFAULT_CUTOFF, base.device)
    plan.compiled.clear()
    w = torch.randn(grid.shape, device="cuda")

    def run():
        leaves = [t.clone().requires_grad_(True) for t in (base.xyz, base.b_iso, base.occ)]
        out = triton_splat.splat_triton(AtomSet(*leaves, base.a, base.b, _validate=False), grid)
        return (out,) + torch.autograd.grad(out, leaves, grad_outputs=w)

    run()
    assert {key[0] for key in plan.compiled} == {"fwd", "bwd"}, "no compiled kernel was kept for the direct launch"
    direct = run()
    assert triton_splat._direct_launch, "the direct launch failed on this Triton and was switched off"
    monkeypatch.setattr(triton_splat, "_direct_launch", False)
    normal = run()
    for got, want in zip(direct, normal):
        assert_kernel_close(got, want)
    # A gradient that is not 16-byte aligned takes the normal launch (the compiled kernel assumes alignment).
    monkeypatch.setattr(triton_splat, "_direct_launch", True)
    leaves = [t.clone().requires_grad_(True) for t in (base.xyz, base.b_iso, base.occ)]
    out = triton_splat.splat_triton(AtomSet(*leaves, base.a, base.b, _validate=False), grid)
    storage = torch.empty(w.numel() + 1, device="cuda")
    shifted = storage[1:].view(w.shape)
    shifted.copy_(w)
    g = torch.autograd.grad(out, leaves, grad_outputs=shifted)
    for got, want in zip(g, normal[1:]):
        assert_kernel_close(got, want)


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
