"""Tricubic interpolation: gemmi, a scalar Neville, grid nodes, gradients, modes, backends, errors."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

import kernels
from kernels.tricubic import OutsideMapWarning
from kernels.tricubic.reference import tricubic_reference
from tests.helpers import assert_close, assert_kernel_close, deterministic, gemmi_density, model, requires_cuda

METHODS = ("catmull-rom", "lagrange")
MODES = ("periodic", "bounded")
FAST = ["cpu", "triton"]  # triton runs in the interpreter on CPU tensors in CI, on CUDA tensors where a GPU is
DEVICE = {"reference": "cpu", "cpu": "cpu", "triton": "cuda" if torch.cuda.is_available() else "cpu"}


# --------------------------------------------------------------------------- fixtures


def real_map(name: str, spacing: float = 1.0):
    """gemmi's density of ``name`` (coarse spacing keeps the test fast) and its whole-cell grid."""
    rho = torch.from_numpy(gemmi_density(name, spacing))
    return rho, kernels.GridSpec(model(name).cell, tuple(rho.shape))


def random_points(cell: kernels.Cell, n: int, seed: int, lo: float = -0.5, hi: float = 1.5) -> torch.Tensor:
    """Cartesian points at fractional positions uniform in [lo, hi)³ (so some wrap), float64."""
    g = torch.Generator().manual_seed(seed)
    frac = lo + (hi - lo) * torch.rand(n, 3, generator=g, dtype=torch.float64)
    return frac @ cell.orth.T


def gemmi_grid(rho: torch.Tensor, cell: kernels.Cell):
    import gemmi

    grid = gemmi.FloatGrid(*rho.shape)
    grid.set_unit_cell(cell.to_gemmi())
    np.array(grid, copy=False)[...] = rho.numpy()
    return grid


def fast(backend: str, rho, grid, points, **kw):
    """``tricubic_sample`` on ``backend``'s device, result back on the CPU (differentiable)."""
    dev = DEVICE[backend]
    return kernels.tricubic_sample(rho.to(dev), grid, points.to(dev), backend=backend, **kw).cpu()


# --------------------------------------------------------------------------- vs gemmi


@pytest.mark.parametrize("name", ["1aki", "5h73"])  # 5h73: hexagonal (non-orthogonal) cell
def test_catmull_rom_matches_gemmi(name):
    rho, grid = real_map(name)
    pts = random_points(grid.cell, 4000, seed=1)
    expected = torch.from_numpy(gemmi_grid(rho, grid.cell).interpolate_position_array(pts.numpy(), order=3))
    ref = kernels.tricubic_sample(rho, grid, pts, backend="reference")
    # gemmi interpolates the float32 map in double and returns float32: rounding of the result only.
    assert_close(ref, expected.double(), atol=1e-6 * float(expected.abs().max()), rtol=1e-6)
    # the CPU kernel works from float32 positions: docs/kernels.md float32 contract
    assert_kernel_close(fast("cpu", rho, grid, pts.float()), expected.double())


def test_triclinic_cell_matches_gemmi():
    cell = kernels.Cell.from_parameters(17.0, 19.0, 23.0, 71.0, 83.0, 103.0)
    grid = kernels.GridSpec(cell, (18, 20, 25))
    rho = torch.randn(grid.shape, generator=torch.Generator().manual_seed(3))
    pts = random_points(cell, 2000, seed=4, lo=-2.0, hi=3.0)
    expected = torch.from_numpy(gemmi_grid(rho, cell).interpolate_position_array(pts.numpy(), order=3))
    ref = kernels.tricubic_sample(rho, grid, pts, backend="reference")
    assert_close(ref, expected.double(), atol=1e-6 * float(expected.abs().max()), rtol=1e-6)


# --------------------------------------------------------------------------- Lagrange vs scalar Neville


def neville(xs, ys, x):
    """Textbook Neville: the interpolating polynomial through (xs, ys) at x, scalar Python."""
    p = list(ys)
    n = len(xs)
    for m in range(1, n):
        for i in range(n - m):
            p[i] = ((x - xs[i + m]) * p[i] + (xs[i] - x) * p[i + 1]) / (xs[i] - xs[i + m])
    return p[0]


def scalar_lagrange(rho: np.ndarray, grid: kernels.GridSpec, point) -> float:
    """polin3 on the 4×4×4 samples floor(u)−1 … floor(u)+2, one point, plain loops (periodic)."""
    frac = grid.cell.frac.numpy() @ np.asarray(point, dtype=np.float64)
    u = [frac[r] * grid.sampling[r] - grid.origin[r] for r in range(3)]
    base = [math.floor(v) for v in u]
    n = rho.shape
    nodes = [base[r] - 1 + k for r in range(3) for k in range(4)]
    xs, ys, zs = nodes[0:4], nodes[4:8], nodes[8:12]
    plane = []
    for i in xs:
        row = []
        for j in ys:
            line = [float(rho[i % n[0], j % n[1], k % n[2]]) for k in zs]
            row.append(neville(zs, line, u[2]))
        plane.append(neville(ys, row, u[1]))
    return neville(xs, plane, u[0])


def test_lagrange_matches_scalar_neville():
    rho, grid = real_map("1aki")
    pts = random_points(grid.cell, 150, seed=5)
    expected = torch.tensor([scalar_lagrange(rho.double().numpy(), grid, p) for p in pts.numpy()])
    ref = kernels.tricubic_sample(rho, grid, pts, method="lagrange", backend="reference")
    assert_close(ref, expected, atol=1e-12 * float(expected.abs().max()), rtol=1e-12)
    for backend in ("cpu", "triton"):
        assert_kernel_close(fast(backend, rho, grid, pts.float(), method="lagrange"), expected)


# --------------------------------------------------------------------------- grid nodes


@pytest.mark.parametrize("method", METHODS)
def test_grid_points_reproduce_grid_values(method):
    rho, grid = real_map("5h73")
    g = torch.Generator().manual_seed(6)
    idx = torch.stack([torch.randint(0, n, (500,), generator=g) for n in grid.shape], dim=1)
    pts = (idx.double() / torch.tensor(grid.sampling, dtype=torch.float64)) @ grid.cell.orth.T
    want = rho[idx[:, 0], idx[:, 1], idx[:, 2]].double()
    ref = kernels.tricubic_sample(rho, grid, pts, method=method, backend="reference")
    # float64 round trip Cartesian -> fractional leaves t ~ 1e-15 away from 0 (or 1 below the next node)
    assert_close(ref, want, atol=1e-9 * float(want.abs().max()))
    cpu64 = fast("cpu", rho.double(), grid, pts, method=method)
    assert_close(cpu64, want, atol=1e-9 * float(want.abs().max()))
    for backend in FAST:
        assert_kernel_close(fast(backend, rho, grid, pts.float(), method=method), want)


# --------------------------------------------------------------------------- gradients


def off_node_points(grid: kernels.GridSpec, n: int, seed: int) -> torch.Tensor:
    """Points whose voxel offsets t stay in [0.15, 0.85] on every axis (Lagrange is only C⁰ at nodes)."""
    g = torch.Generator().manual_seed(seed)
    i = torch.stack([torch.randint(-3, m + 3, (n,), generator=g) for m in grid.shape], dim=1).double()
    t = 0.15 + 0.7 * torch.rand(n, 3, generator=g, dtype=torch.float64)
    u = i + t + torch.tensor(grid.origin, dtype=torch.float64)
    return (u / torch.tensor(grid.sampling, dtype=torch.float64)) @ grid.cell.orth.T


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("mode", MODES)
def test_gradcheck_float64(backend, method, mode):
    cell = kernels.Cell.from_parameters(9.0, 10.0, 11.0, 80.0, 95.0, 105.0)
    grid = kernels.GridSpec(cell, (7, 6, 8))
    rho = torch.randn(grid.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    pts = off_node_points(grid, 12, seed=8)
    if mode == "bounded":  # keep most points inside so the gradient is not all zeros
        pts = off_node_points(kernels.GridSpec(cell, (3, 2, 4)), 12, seed=8) + (2.0 / 7) * cell.orth[:, 0]
    rho.requires_grad_()
    pts.requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OutsideMapWarning)
        assert torch.autograd.gradcheck(
            lambda r, p: kernels.tricubic_sample(r, grid, p, method=method, mode=mode, backend=backend), (rho, pts)
        )


def test_catmull_rom_gradient_continuous_across_nodes():
    """Catmull-Rom is C¹: the analytic point gradient just below and just above a node agree."""
    rho, grid = real_map("1aki")
    node = torch.tensor([[10.0, 7.0, 5.0]], dtype=torch.float64) / torch.tensor(grid.sampling) @ grid.cell.orth.T
    step = 1e-7 * grid.cell.orth[:, 0]
    grads = []
    for p in (node - step, node + step):
        p = p.clone().requires_grad_()
        fast("cpu", rho.double(), grid, p).sum().backward()
        grads.append(p.grad)
    assert_close(grads[0], grads[1], atol=1e-4 * float(grads[0].abs().max()))


# --------------------------------------------------------------------------- every fast path vs the reference


def synthetic_cases():
    g = torch.Generator().manual_seed(9)
    tiny = kernels.GridSpec(kernels.Cell.from_parameters(3.0, 4.0, 2.5, 90, 90, 90), (2, 3, 1))  # sizes < 4 wrap twice
    tricl = kernels.GridSpec(kernels.Cell.from_parameters(11.0, 13.0, 9.0, 65.0, 100.0, 112.0), (13, 11, 17))
    mono = kernels.GridSpec(kernels.Cell.from_parameters(12.0, 9.0, 14.0, 90.0, 107.0, 90.0), (16, 12, 20))
    out = []
    for name, grid in (("tiny", tiny), ("triclinic", tricl), ("monoclinic", mono)):
        rho = torch.randn(grid.shape, generator=g)
        pts = random_points(grid.cell, 300, seed=10, lo=-1.0, hi=2.0)
        # a cell corner, exact grid nodes and a point on a face: the floor/wrap edge cases
        corners = torch.stack([torch.zeros(3, dtype=torch.float64), grid.cell.orth.sum(1), grid.cell.orth[:, 0] * 0.5])
        out.append((name, rho, grid, torch.cat([pts, corners])))
    rho, grid = real_map("1aki")
    out.append(("1aki", rho, grid, random_points(grid.cell, 3000, seed=11)))
    return out


CASES = synthetic_cases()


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_fast_paths_match_reference(case, mode, method, backend):
    _, rho, grid, pts = case
    pts32 = pts.float()
    if mode == "bounded":  # a box: the whole-cell map seen as a box, points partly outside
        grid = kernels.GridSpec(grid.cell, grid.shape, sampling=grid.sampling)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OutsideMapWarning)
        r_ref = rho.double().requires_grad_()
        p_ref = pts32.double().requires_grad_()
        ref = kernels.tricubic_sample(
            r_ref, grid, p_ref, method=method, mode=mode, fill_value=-3.0, backend="reference"
        )
        upstream = torch.linspace(-1.0, 2.0, ref.numel(), dtype=torch.float64)
        (ref * upstream).sum().backward()
        r = rho.clone().requires_grad_()
        p = pts32.clone().requires_grad_()
        out = fast(backend, r, grid, p, method=method, mode=mode, fill_value=-3.0)
        (out * upstream.float()).sum().backward()
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert_kernel_close(out, ref)
    assert_kernel_close(p.grad, p_ref.grad)
    assert_kernel_close(r.grad, r_ref.grad)


@pytest.mark.parametrize("method", METHODS)
def test_cpu_float64_matches_reference(method):
    _, rho, grid, pts = CASES[1]
    r = rho.double().requires_grad_()
    p = pts.clone().requires_grad_()
    out = fast("cpu", r, grid, p, method=method)
    (out**2).sum().backward()
    r2 = rho.double().requires_grad_()
    p2 = pts.clone().requires_grad_()
    ref = tricubic_reference(r2, grid, p2, method)
    (ref**2).sum().backward()
    assert out.dtype == torch.float64
    for a, b in ((out, ref), (p.grad, p2.grad), (r.grad, r2.grad)):
        assert_close(a, b, atol=1e-11 * float(b.detach().abs().max()), rtol=1e-11)  # float64 rounding only


@pytest.mark.parametrize("layout", ["fortran", "padded"])
def test_cpu_strided_map_read_in_place(layout):
    # numpy's view of a gemmi grid is Fortran-ordered; the kernel reads any strides instead of
    # copying the map each call. Same arithmetic in the same order, so results are bit-identical.
    rho, grid = real_map("5h73")
    if layout == "fortran":
        strided = rho.permute(2, 1, 0).contiguous().permute(2, 1, 0)
    else:  # rows padded by 3 voxels: z still contiguous, y stride nz + 3
        strided = torch.zeros(*rho.shape[:2], rho.shape[2] + 3, dtype=rho.dtype)[..., : rho.shape[2]]
        strided.copy_(rho)
    assert not strided.is_contiguous() and torch.equal(strided, rho)
    pts = random_points(grid.cell, 3000, seed=21).float()
    results = []
    for m in (rho, strided):
        r = m.clone() if m is rho else m.detach()
        r.requires_grad_()
        p = pts.clone().requires_grad_()
        out = kernels.tricubic_sample(r, grid, p, backend="cpu")
        (out**2).sum().backward()
        results.append((out, p.grad, r.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert results[0][2].abs().sum() > 0


def test_cpu_map_gradient_is_deterministic_across_threads():
    rho, grid = real_map("1aki")
    pts = random_points(grid.cell, 20000, seed=12).float()
    grads = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 2):
            torch.set_num_threads(threads)
            r = rho.clone().requires_grad_()
            fast("cpu", r, grid, pts).sum().backward()
            grads.append(r.grad)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(grads[0], grads[1]) and torch.equal(grads[1], grads[2])


def test_triton_map_gradient_honours_the_deterministic_switch():
    # Its float32 atomics have no deterministic form: with the switch on, torch's rule (an error, or a
    # warning with warn_only); the points' gradient (a gather) is deterministic and always allowed.
    rho, grid = real_map("1aki")
    pts = random_points(grid.cell, 50, seed=13).float().to(DEVICE["triton"])
    rho = rho.to(DEVICE["triton"])
    with deterministic():
        p = pts.clone().requires_grad_()
        fast("triton", rho, grid, p).sum().backward()
        assert p.grad is not None
        r = rho.clone().requires_grad_()
        with pytest.raises(RuntimeError, match="does not have a deterministic implementation.*backend='cpu'"):
            fast("triton", r, grid, pts).sum().backward()
        torch.use_deterministic_algorithms(True, warn_only=True)
        with pytest.warns(UserWarning, match="does not have a deterministic implementation"):
            fast("triton", r, grid, pts).sum().backward()
        assert r.grad is not None


def test_batch_shape_empty_and_nonfinite_points():
    rho, grid = real_map("1aki")
    pts = random_points(grid.cell, 24, seed=13).reshape(2, 3, 4, 3)
    ref = kernels.tricubic_sample(rho, grid, pts, backend="reference")
    assert ref.shape == (2, 3, 4)
    for backend in FAST:
        out = fast(backend, rho, grid, pts.float())
        assert out.shape == (2, 3, 4)
        assert_kernel_close(out, ref)
        empty = fast(backend, rho, grid, torch.zeros(0, 3))
        assert empty.shape == (0,)
        bad = torch.tensor([[float("nan"), 1.0, 2.0], [1.0, float("inf"), 0.0], [1.0, 2.0, 3.0]])
        bad.requires_grad_()
        vals = fast(backend, rho, grid, bad)
        assert torch.isnan(vals[:2]).all() and torch.isfinite(vals[2])
        vals[2].backward()
        assert torch.equal(bad.grad[:2], torch.zeros(2, 3)) and torch.isfinite(bad.grad).all()


# --------------------------------------------------------------------------- bounded mode and boxes


def count_outside_scalar(points: torch.Tensor, grid: kernels.GridSpec) -> int:
    """Plain-loop count of points whose 4×4×4 neighbourhood leaves the box."""
    frac = grid.cell.frac.numpy()
    count = 0
    for p in points.double().numpy():
        f = frac @ p
        for r in range(3):
            b = math.floor(f[r] * grid.sampling[r] - grid.origin[r])
            if b - 1 < 0 or b + 2 > grid.shape[r] - 1:
                count += 1
                break
    return count


@pytest.mark.parametrize("backend", ["reference", *FAST])
def test_bounded_mode_warns_once_with_count(backend):
    rho, grid = real_map("1aki")
    box = kernels.GridSpec(grid.cell, (20, 22, 12), origin=(10, 12, 6), sampling=grid.sampling)
    sub = rho[10:30, 12:34, 6:18].contiguous()
    # fractional positions straddling the box: some well inside, some near the edge, some far outside
    lo = torch.tensor(box.origin, dtype=torch.float64) / torch.tensor(box.sampling)
    span = torch.tensor(box.shape, dtype=torch.float64) / torch.tensor(box.sampling)
    frac = lo + span * (
        -0.3 + 1.6 * torch.rand(700, 3, generator=torch.Generator().manual_seed(14), dtype=torch.float64)
    )
    pts = (frac @ grid.cell.orth.T).float()
    expected = count_outside_scalar(pts, box)
    assert 0 < expected < len(pts)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fast(backend, sub, box, pts, mode="bounded", fill_value=-7.0)
    ours = [w for w in caught if issubclass(w.category, OutsideMapWarning)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert f"{expected} of {len(pts)} points" in str(ours[0].message)
    assert int((out == -7.0).sum()) == expected
    # silence when every point is inside
    inside = pts[out != -7.0]
    with warnings.catch_warnings():
        warnings.simplefilter("error", OutsideMapWarning)
        fast(backend, sub, box, inside, mode="bounded")


@pytest.mark.parametrize("backend", ["reference", *FAST])
@pytest.mark.parametrize("method", METHODS)
def test_box_with_origin_matches_whole_map(backend, method):
    rho, grid = real_map("5h73")
    origin, shape = (17, 5, 30), (25, 19, 22)
    box = kernels.GridSpec(grid.cell, shape, origin=origin, sampling=grid.sampling)
    sub = rho[origin[0] : origin[0] + shape[0], origin[1] : origin[1] + shape[1], origin[2] : origin[2] + shape[2]]
    g = torch.Generator().manual_seed(15)
    u = (
        torch.tensor(origin, dtype=torch.float64)
        + 1
        + (torch.tensor(shape) - 3.001) * torch.rand(500, 3, generator=g, dtype=torch.float64)
    )  # neighbourhood inside the box
    pts = ((u / torch.tensor(grid.sampling)) @ grid.cell.orth.T).float()
    whole = kernels.tricubic_sample(rho, grid, pts, method=method, backend="reference")
    with warnings.catch_warnings():
        warnings.simplefilter("error", OutsideMapWarning)
        boxed = fast(backend, sub.contiguous(), box, pts, method=method, mode="bounded")
    assert_kernel_close(boxed, whole)


def test_periodic_whole_cell_with_origin_wraps():
    """A whole-cell map rolled by an origin samples the same function."""
    rho, grid = real_map("1aki")
    shift = (5, 9, 2)
    rolled = torch.roll(rho, shifts=tuple(-s for s in shift), dims=(0, 1, 2))
    shifted = kernels.GridSpec(grid.cell, grid.shape, origin=shift, sampling=grid.sampling)
    pts = random_points(grid.cell, 1000, seed=16)
    ref = kernels.tricubic_sample(rho, grid, pts, backend="reference")
    assert_close(kernels.tricubic_sample(rolled, shifted, pts, backend="reference"), ref, atol=1e-12)
    assert_kernel_close(fast("cpu", rolled, shifted, pts.float()), ref)


# --------------------------------------------------------------------------- bad input


def test_bad_input_errors():
    rho, grid = real_map("1aki")
    pts = torch.zeros(5, 3)
    with pytest.raises(ValueError, match="unknown method"):
        kernels.tricubic_sample(rho, grid, pts, method="cubic")
    with pytest.raises(ValueError, match="unknown mode"):
        kernels.tricubic_sample(rho, grid, pts, mode="clamp")
    with pytest.raises(ValueError, match=r"shape \(\.\.\., 3\)"):
        kernels.tricubic_sample(rho, grid, torch.zeros(5, 2))
    with pytest.raises(ValueError, match="rho has shape"):
        kernels.tricubic_sample(rho[:-1], grid, pts)
    with pytest.raises(TypeError, match="floating-point"):
        kernels.tricubic_sample(rho, grid, torch.zeros(5, 3, dtype=torch.int64))
    with pytest.raises(TypeError, match="GridSpec"):
        kernels.tricubic_sample(rho, (1, 2, 3), pts)
    with pytest.raises(ValueError, match="different devices|on meta"):
        kernels.tricubic_sample(rho, grid, pts.to("meta"))
    box = kernels.GridSpec(grid.cell, (10, 10, 10), sampling=grid.sampling)
    with pytest.raises(kernels.GridError, match="mode='bounded'"):
        kernels.tricubic_sample(rho[:10, :10, :10], box, pts)
    with pytest.raises(kernels.BackendError, match="unknown backend"):
        kernels.tricubic_sample(rho, grid, pts, backend="fortran")


# --------------------------------------------------------------------------- CUDA


@requires_cuda
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("mode", MODES)
def test_cuda_matches_reference(method, mode):
    rho, grid = real_map("5h73", spacing=0.7)
    pts = random_points(grid.cell, 200_000, seed=17).float()
    if mode == "bounded":
        grid = kernels.GridSpec(grid.cell, grid.shape, sampling=grid.sampling)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OutsideMapWarning)
        r_ref, p_ref = rho.double().requires_grad_(), pts.double().requires_grad_()
        ref = tricubic_reference(r_ref, grid, p_ref, method, mode, 1.5)
        up = torch.rand(ref.shape, generator=torch.Generator().manual_seed(18), dtype=torch.float64)
        (ref * up).sum().backward()
        r, p = rho.cuda().requires_grad_(), pts.cuda().requires_grad_()
        out = kernels.tricubic_sample(r, grid, p, method=method, mode=mode, fill_value=1.5)
        (out * up.float().cuda()).sum().backward()
    assert out.is_cuda
    assert_kernel_close(out.cpu(), ref)
    assert_kernel_close(p.grad.cpu(), p_ref.grad)
    assert_kernel_close(r.grad.cpu(), r_ref.grad)


FIRST_CALL = r"""
import torch, kernels, numpy as np
from tests.helpers import gemmi_density, model, assert_kernel_close
rho = torch.from_numpy(np.random.default_rng(0).standard_normal((31, 24, 40)).astype(np.float32))
for method in ("catmull-rom", "lagrange"):
    cell = kernels.Cell.from_parameters(30.0, 25.0, 41.0, 80.0, 100.0, 95.0)
    grid = kernels.GridSpec(cell, tuple(rho.shape))
    pts = (torch.rand(5000, 3, dtype=torch.float64) * 2 - 0.5) @ cell.orth.T
    ref = kernels.tricubic_sample(rho, grid, pts, method=method, backend="reference")
    first = kernels.tricubic_sample(rho.cuda(), grid, pts.float().cuda(), method=method).cpu()
    second = kernels.tricubic_sample(rho.cuda(), grid, pts.float().cuda(), method=method).cpu()
    assert_kernel_close(first, ref)
    assert_kernel_close(second, ref)
print("first-call ok")
"""


@requires_cuda
def test_cuda_first_call_is_right(tmp_path):
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton-cache"))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run([sys.executable, "-c", FIRST_CALL], env=env, cwd=root, capture_output=True, text=True)
    assert res.returncode == 0 and "first-call ok" in res.stdout, res.stdout + res.stderr
