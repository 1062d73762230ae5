"""kernels.splat_ensemble: F frames of the same atoms, summed or one map per frame, on every backend.

The truth is the sum (or stack) of single-frame :func:`kernels.splat_density` calls. Tolerances:
float32 backends against the float64 reference use docs/kernels.md's float32 contract
(``assert_kernel_close``: 1e-5·max|ref| + 1e-5·|ref|), for maps and every gradient; the reference
ensemble against the reference's own single-frame splats is a float64 sum in another order
(1e-12 relative). Cells, grids and atom counts are small so the Triton interpreter is quick.
"""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.crystal import AtomSet, Cell, GridError, GridSpec
from tests.helpers import assert_close, assert_kernel_close, requires_cuda

BACKENDS = ["reference", "cpu", "triton"]
F, N = 3, 7
# Triton runs on the GPU where there is one, else on CPU tensors in the interpreter (conftest.py).
TRITON_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _device(backend: str) -> torch.device:
    return TRITON_DEVICE if backend == "triton" else torch.device("cpu")


def _system(dtype=torch.float64, frames: int = F, seed: int = 0, device="cpu"):
    """A small triclinic cell, N atoms of mixed elements, and F perturbed frames of them."""
    gen = torch.Generator().manual_seed(seed)
    cell = Cell.from_parameters(11.0, 12.0, 10.0, 84.0, 96.0, 101.0)
    grid = GridSpec.for_spacing(cell, 1.0)
    elements = ["C", "N", "O", "S", "C", "O", "H"][:N]
    frac = torch.rand((N, 3), generator=gen, dtype=torch.float64)
    frac[0] = torch.tensor([0.01, 0.99, 0.5], dtype=torch.float64)  # near cell faces: images wrap
    xyz0 = frac @ cell.orth.T
    b = 8.0 + 30.0 * torch.rand(N, generator=gen, dtype=torch.float64)
    occ = 0.5 + 0.5 * torch.rand(N, generator=gen, dtype=torch.float64)
    atoms = AtomSet.from_elements(elements, xyz0, b, occ, dtype=dtype)
    xyz = (xyz0 + 0.6 * torch.randn((frames, N, 3), generator=gen, dtype=torch.float64)).to(dtype)
    b_f = (b + 10.0 * torch.rand((frames, N), generator=gen, dtype=torch.float64)).to(dtype)
    occ_f = (0.3 + 0.7 * torch.rand((frames, N), generator=gen, dtype=torch.float64)).to(dtype)
    weights = (0.2 + torch.rand(frames, generator=gen, dtype=torch.float64)).to(dtype)
    return atoms.to(device), grid, xyz.to(device), b_f.to(device), occ_f.to(device), weights.to(device)


def _frame(atoms: AtomSet, xyz, b_iso=None, occ=None) -> AtomSet:
    return AtomSet(
        xyz,
        atoms.b_iso if b_iso is None else b_iso,
        atoms.occ if occ is None else occ,
        atoms.a,
        atoms.b,
        atoms.elements,
        atoms.labels,
        _validate=False,
    )


def _per_frame_maps(atoms, grid, xyz, b_iso, occ, weights, backend, radius=None):
    """(F, *grid.shape): weights[f] · splat_density of frame f, one call per frame."""
    maps = []
    for f in range(xyz.shape[0]):
        frame = _frame(atoms, xyz[f], None if b_iso is None else b_iso[f], None if occ is None else occ[f])
        rho = kernels.splat_density(frame, grid, radius=radius, backend=backend)
        maps.append(rho if weights is None else weights[f] * rho)
    return torch.stack(maps)


def _dtype(backend):
    return torch.float64 if backend == "reference" else torch.float32


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("per_frame", [False, True], ids=["shared-B-occ", "per-frame-B-occ"])
def test_sum_equals_the_sum_of_single_frame_splats(backend, per_frame):
    atoms, grid, xyz, b_f, occ_f, w = _system(_dtype(backend), device=_device(backend))
    b_iso, occ = (b_f, occ_f) if per_frame else (None, None)
    out = kernels.splat_ensemble(atoms, xyz, grid, weights=w, b_iso=b_iso, occ=occ, backend=backend)
    assert out.shape == grid.shape and out.dtype == _dtype(backend)
    # The truth: float64 reference splats of the same (dtype-rounded) values, one per frame.
    a64 = atoms.to(dtype=torch.float64)
    d = {k: (None if v is None else v.to(torch.float64)) for k, v in dict(b=b_iso, o=occ).items()}
    want = _per_frame_maps(a64, grid, xyz.double(), d["b"], d["o"], w.double(), "reference").sum(0)
    if backend == "reference":
        assert_close(out, want, atol=1e-12 * float(want.abs().max()), rtol=1e-12)
    else:
        assert_kernel_close(out, want)
        own = _per_frame_maps(atoms, grid, xyz, b_iso, occ, w, backend).sum(0)  # its own single splats
        assert_kernel_close(out, own.double())
    assert float(out.abs().max()) > 0.1  # the frames put density on the grid


@pytest.mark.parametrize("backend", BACKENDS)
def test_none_equals_the_stack_of_single_frame_splats(backend):
    atoms, grid, xyz, b_f, occ_f, w = _system(_dtype(backend), device=_device(backend))
    out = kernels.splat_ensemble(atoms, xyz, grid, weights=w, b_iso=b_f, occ=occ_f, reduce="none", backend=backend)
    assert out.shape == (F, *grid.shape) and out.dtype == _dtype(backend)
    want = _per_frame_maps(
        atoms.to(dtype=torch.float64), grid, xyz.double(), b_f.double(), occ_f.double(), w.double(), "reference"
    )
    for f in range(F):
        assert_kernel_close(out[f], want[f])


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_frame_equals_splat_density(backend):
    atoms, grid, xyz, *_ = _system(_dtype(backend), frames=1, device=_device(backend))
    single = kernels.splat_density(_frame(atoms, xyz[0]), grid, backend=backend)
    out = kernels.splat_ensemble(atoms, xyz, grid, backend=backend)
    if backend == "triton":  # float32 atomics: the order of additions differs run to run
        assert_kernel_close(out, single.double())
    else:  # the same atoms in the same order through the same deterministic kernel
        assert torch.equal(out, single)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduce", ["sum", "none"])
def test_gradients_of_every_input_match_the_reference(backend, reduce):
    """Gradients w.r.t. every frame's xyz, B, occupancy and the weights, against autograd through
    per-frame float64 reference splats of the same values."""
    atoms, grid, xyz, b_f, occ_f, w = _system(_dtype(backend), device=_device(backend))
    gen = torch.Generator().manual_seed(1)
    shape = grid.shape if reduce == "sum" else (F, *grid.shape)
    upstream = torch.randn(shape, generator=gen, dtype=torch.float64).to(_device(backend))

    leaves = [t.detach().clone().requires_grad_() for t in (xyz, b_f, occ_f, w)]
    out = kernels.splat_ensemble(
        atoms, leaves[0], grid, b_iso=leaves[1], occ=leaves[2], weights=leaves[3], reduce=reduce, backend=backend
    )
    out.backward(upstream.to(dtype=out.dtype))

    ref = [t.detach().double().clone().requires_grad_() for t in (xyz, b_f, occ_f, w)]
    maps = _per_frame_maps(atoms.to(dtype=torch.float64), grid, *ref, "reference")
    (maps.sum(0) if reduce == "sum" else maps).backward(upstream)
    for name, got, want in zip(("xyz", "b_iso", "occ", "weights"), leaves, ref):
        assert got.grad is not None, f"no gradient for {name}"
        assert float(want.grad.abs().max()) > 0, f"{name}: the test's upstream gives a zero gradient"
        try:
            assert_kernel_close(got.grad, want.grad)
        except AssertionError as exc:
            raise AssertionError(f"{backend} {reduce}: gradient of {name}: {exc}") from None


def test_gradients_reach_the_shared_b_and_occupancy_of_the_atoms():
    """Without per-frame b_iso/occ, the atoms' own B and occupancy get the sum over frames."""
    atoms, grid, xyz, _, _, w = _system()
    shared = _frame(atoms, atoms.xyz, atoms.b_iso.clone().requires_grad_(), atoms.occ.clone().requires_grad_())
    out = kernels.splat_ensemble(shared, xyz, grid, weights=w, backend="reference")
    upstream = torch.randn(grid.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    out.backward(upstream)
    b = atoms.b_iso.clone().requires_grad_()
    o = atoms.occ.clone().requires_grad_()
    maps = _per_frame_maps(atoms, grid, xyz, b.expand(F, N), o.expand(F, N), w, "reference")
    maps.sum(0).backward(upstream)
    assert_close(shared.b_iso.grad, b.grad, atol=1e-12 * float(b.grad.abs().max()), rtol=1e-10)
    assert_close(shared.occ.grad, o.grad, atol=1e-12 * float(o.grad.abs().max()), rtol=1e-10)


@pytest.mark.parametrize("reduce", ["sum", "none"])
def test_reference_gradcheck(reduce):
    """Finite differences in float64 on a tiny case: xyz, per-frame B and occupancy, weights."""
    cell = Cell.from_parameters(7.0, 8.0, 7.5, 90, 97, 90)
    grid = GridSpec(cell, (7, 8, 7))
    atoms = AtomSet.from_elements(["C", "O"], [[1.1, 2.3, 3.7], [4.2, 5.1, 6.3]], [12.0, 20.0], [0.9, 0.6])
    gen = torch.Generator().manual_seed(3)
    xyz = (atoms.xyz + 0.3 * torch.randn((2, 2, 3), generator=gen, dtype=torch.float64)).requires_grad_()
    b_iso = torch.tensor([[12.0, 20.0], [15.0, 18.0]], dtype=torch.float64, requires_grad=True)
    occ = torch.tensor([[0.9, 0.6], [0.7, 0.95]], dtype=torch.float64, requires_grad=True)
    weights = torch.tensor([0.4, 1.3], dtype=torch.float64, requires_grad=True)
    shape = grid.shape if reduce == "sum" else (2, *grid.shape)
    upstream = torch.rand(shape, dtype=torch.float64, generator=gen)

    def loss(x, b, o, w):
        out = kernels.splat_ensemble(
            atoms, x, grid, b_iso=b, occ=o, weights=w, reduce=reduce, radius=2.5, backend="reference"
        )
        return (out * upstream).sum()

    assert torch.autograd.gradcheck(loss, (xyz, b_iso, occ, weights), eps=1e-6, atol=1e-6)


def test_weights_may_be_a_sequence_and_default_to_one():
    atoms, grid, xyz, *_ = _system(torch.float32)
    ones = kernels.splat_ensemble(atoms, xyz, grid, backend="cpu")
    listed = kernels.splat_ensemble(atoms, xyz, grid, weights=[1.0, 1.0, 1.0], backend="cpu")
    assert torch.equal(ones, listed)
    halves = kernels.splat_ensemble(atoms, xyz, grid, weights=(0.5, 0.5, 0.5), backend="cpu")
    assert_kernel_close(halves, 0.5 * ones.double())


def test_box_grid_on_the_reference_and_refused_by_the_fast_backends():
    atoms, grid, xyz, *_ = _system()
    box = GridSpec(grid.cell, (5, 6, 4), origin=(2, -3, 1), sampling=grid.shape)
    out = kernels.splat_ensemble(atoms, xyz, box, backend="reference")
    whole = kernels.splat_ensemble(atoms, xyz, grid, backend="reference")
    idx = [torch.arange(o, o + s) % m for o, s, m in zip(box.origin, box.shape, grid.shape)]
    assert_close(out, whole[idx[0]][:, idx[1]][:, :, idx[2]], atol=1e-12, rtol=1e-12)
    with pytest.raises(GridError, match="whole-cell grids only"):
        kernels.splat_ensemble(atoms.to(dtype=torch.float32), xyz.float(), box, backend="cpu")


def test_reduce_none_refuses_more_maps_than_memory_holds():
    atoms, grid, *_ = _system(torch.float32)
    # 10^9 frames of a broadcast view: no memory for the inputs, ~10 PB for the maps
    many = atoms.xyz[None].expand(10**9, N, 3)
    with pytest.raises(GridError, match=r"reduce='none' returns 1000000000 maps .* use reduce='sum'.*frames per call"):
        kernels.splat_ensemble(atoms, many, grid, reduce="none", backend="reference")


def _bad_calls():
    atoms, grid, xyz, b_f, occ_f, w = _system()
    f32 = atoms.to(dtype=torch.float32)
    nan_w = w.clone()
    nan_w[1] = float("nan")
    nan_xyz = xyz.clone()
    nan_xyz[2, 4, 1] = float("inf")
    neg_b = b_f.clone()
    neg_b[1, 3] = -1.0
    big_occ = occ_f.clone()
    big_occ[0, 5] = 1.5
    return [
        ("not-atoms", (xyz, xyz, grid), {}, TypeError, "atoms must be a kernels.AtomSet"),
        ("xyz-2d", (atoms, xyz[0], grid), {}, ValueError, r"shape \(F, 7, 3\).*one frame is xyz\[None\]"),
        ("xyz-n", (atoms, xyz[:, :5], grid), {}, ValueError, "the atoms have 7, so the frames must too"),
        ("no-frames", (atoms, xyz[:0], grid), {}, ValueError, "holds no frames"),
        ("xyz-dtype", (f32, xyz, grid), {}, ValueError, r"xyz is torch.float64 .* atoms are torch.float32"),
        ("xyz-list", (atoms, xyz.tolist(), grid), {}, TypeError, "chunk 0 is a list, not a torch.Tensor"),
        ("b-shape", (atoms, xyz, grid), {"b_iso": b_f[0]}, ValueError, r"b_iso must have shape \(3, 7\)"),
        ("occ-dtype", (atoms, xyz, grid), {"occ": occ_f.float()}, ValueError, "occ is torch.float32"),
        ("w-shape", (atoms, xyz, grid), {"weights": w[:2]}, ValueError, r"weights must have shape \(3,\)"),
        ("w-list-shape", (atoms, xyz, grid), {"weights": [1.0, 2.0]}, ValueError, r"weights must have shape \(3,\)"),
        ("w-text", (atoms, xyz, grid), {"weights": "abc"}, (TypeError, ValueError), "weights must"),
        ("w-nan", (atoms, xyz, grid), {"weights": nan_w}, ValueError, "frame 1 has weight nan"),
        ("w-inf-list", (atoms, xyz, grid), {"weights": [1, float("inf"), 1]}, ValueError, "frame 1 has weight inf"),
        ("reduce", (atoms, xyz, grid), {"reduce": "mean"}, ValueError, "reduce must be 'sum'.*got 'mean'"),
        ("xyz-inf", (atoms, nan_xyz, grid), {}, ValueError, r"frame 2: atom .* \(index 4\) has a non-finite position"),
        ("b-neg", (atoms, xyz, grid), {"b_iso": neg_b}, ValueError, r"frame 1: atom .* \(index 3\) has B ≤ 0"),
        ("occ-big", (atoms, xyz, grid), {"occ": big_occ}, ValueError, r"frame 0: atom .*\(index 5\).*outside \[0, 1\]"),
        ("radius", (atoms, xyz, grid), {"radius": -1.0}, ValueError, "radius must be a positive finite number"),
        ("cutoff", (atoms, xyz, grid), {"cutoff": float("nan")}, ValueError, "cutoff must be a positive"),
        ("group", (atoms, xyz, grid), {"process_group": object()}, ValueError, "torch.distributed is not initialised"),
        ("backend", (atoms, xyz, grid), {"backend": "gpu"}, kernels.BackendError, "unknown backend 'gpu'"),
    ]


@pytest.mark.parametrize("args, kwargs, error, match", [c[1:] for c in _bad_calls()], ids=[c[0] for c in _bad_calls()])
def test_bad_inputs_are_refused_with_what_to_do(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        kernels.splat_ensemble(*args, **kwargs)


@pytest.mark.parametrize(
    "n_frames, world, shares",
    [
        (5, 2, [(0, 3), (3, 5)]),
        (6, 3, [(0, 2), (2, 4), (4, 6)]),
        (1, 2, [(0, 1), (1, 1)]),
        (7, 4, [(0, 2), (2, 4), (4, 6), (6, 7)]),
    ],
)
def test_frame_shares_are_contiguous_uneven_and_may_be_empty(n_frames, world, shares):
    from kernels.density.frames import _share

    assert [_share(n_frames, r, world) for r in range(world)] == shares
    assert kernels.frame_share(n_frames) == (0, n_frames)  # no group: every frame here


def test_an_initialised_process_group_alone_changes_nothing(tmp_path):
    """DDP users are not surprised: without process_group= every frame is splatted here."""
    import torch.distributed as dist

    atoms, grid, xyz, *_ = _system()
    want = kernels.splat_ensemble(atoms, xyz, grid, backend="reference")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        got = kernels.splat_ensemble(atoms, xyz, grid, backend="reference")
        assert torch.equal(got, want)
        # With the group of one rank given: the same map through the collective, and every frame here.
        group = dist.group.WORLD
        assert kernels.frame_share(5, group) == (0, 5)
        x = xyz.clone().requires_grad_()
        out = kernels.splat_ensemble(atoms, x, grid, backend="reference", process_group=group)
        assert_close(out, want, atol=0, rtol=0)
        out.sum().backward()
        before = x.grad.clone()
        (summed,) = kernels.sum_gradients_over_ranks([x], group)
        assert torch.equal(summed, before)
    finally:
        dist.destroy_process_group()


@requires_cuda
def test_sum_on_cuda_makes_no_host_synchronisation():
    """The triton path of reduce="sum" reads nothing back (so it can be captured in a CUDA graph)."""
    atoms, grid, xyz, b_f, occ_f, w = _system(torch.float32, device="cuda")
    kwargs = {"b_iso": b_f, "occ": occ_f, "weights": w, "backend": "triton"}
    want = kernels.splat_ensemble(atoms, xyz, grid, **kwargs)  # first call per grid: memory query
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = kernels.splat_ensemble(atoms, xyz, grid, **kwargs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_kernel_close(got, want.double())
