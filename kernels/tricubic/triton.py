"""CUDA tricubic interpolation: Triton forward and backward kernels, float32 maps.

One program interpolates ``BLOCK`` points. Voxel coordinates are computed in float64
(from a float64 parameter tensor, never Python floats, which Triton would pass as
float32): a float32 ``u`` on a 360-voxel axis is off by up to 3e-5 voxel, which alone
would use up the float32 tolerance of docs/kernels.md on steep maps. Weights and the 64-term
contraction are float32. The map gradient is a float32 atomic scatter (order varies run
to run; compare with tolerances, never bitwise).

Per call: forward = 1 allocation + 1 launch; backward = 1 launch and an allocation per
gradient asked for (the map's is zero-filled, one memset more). The grid parameters are
made once per (grid, device), the upstream gradient is read through its stride (a
``.sum()``'s is expanded), and launches go through :class:`kernels._launch.FastLauncher`.

Runs under ``TRITON_INTERPRET=1`` (CI): no libdevice calls, integer wrap with
``((i % n) + n) % n`` semantics via compares, and large blocks there because the
interpreter costs per program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._launch import FastLauncher, ceil_div
from kernels._opdef import eager_function, register
from kernels._util import to_float32
from kernels.crystal import GridSpec
from kernels.dispatch import triton_interpreted
from kernels.tricubic import op_def, sample

__all__ = ["tricubic_triton"]

_METHOD_CODE = {"catmull-rom": 0, "lagrange": 1}


@triton.jit
def _weights(t, METHOD: tl.constexpr):
    t2 = t * t
    t3 = t2 * t
    if METHOD == 0:  # Catmull-Rom, gemmi's cubic through samples at -1, 0, 1, 2
        w0 = 0.5 * (2.0 * t2 - t - t3)
        w1 = 1.0 + 0.5 * (3.0 * t3 - 5.0 * t2)
        w2 = 0.5 * (t + 4.0 * t2 - 3.0 * t3)
        w3 = 0.5 * (t3 - t2)
    else:  # Lagrange through nodes -1, 0, 1, 2
        w0 = -(t3 - 3.0 * t2 + 2.0 * t) / 6.0
        w1 = (t3 - 2.0 * t2 - t + 2.0) / 2.0
        w2 = -(t3 - t2 - 2.0 * t) / 2.0
        w3 = (t3 - t) / 6.0
    return w0, w1, w2, w3


@triton.jit
def _dweights(t, METHOD: tl.constexpr):
    t2 = t * t
    if METHOD == 0:
        d0 = 0.5 * (4.0 * t - 1.0 - 3.0 * t2)
        d1 = 0.5 * (9.0 * t2 - 10.0 * t)
        d2 = 0.5 * (1.0 + 8.0 * t - 9.0 * t2)
        d3 = 0.5 * (3.0 * t2 - 2.0 * t)
    else:
        d0 = -(3.0 * t2 - 6.0 * t + 2.0) / 6.0
        d1 = (3.0 * t2 - 4.0 * t - 1.0) / 2.0
        d2 = -(3.0 * t2 - 2.0 * t - 2.0) / 2.0
        d3 = (3.0 * t2 - 1.0) / 6.0
    return d0, d1, d2, d3


@triton.jit
def _axis(params_ptr, r: tl.constexpr, x, y, z, n, PERIODIC: tl.constexpr, IDX64: tl.constexpr):
    """Start index (int), t (float32) and inside-flag of one axis; x, y, z float64 [BLOCK]."""
    f0 = tl.load(params_ptr + 3 * r)
    f1 = tl.load(params_ptr + 3 * r + 1)
    f2 = tl.load(params_ptr + 3 * r + 2)
    m = tl.load(params_ptr + 9 + r)
    o = tl.load(params_ptr + 12 + r)
    f = f0 * x + f1 * y + f2 * z
    u = f * m - o  # float64, same order as reference.voxel_coordinates
    if PERIODIC:  # far points fold through their fractional part (reference.FAR_VOXELS says why)
        u = tl.where(tl.abs(u) < 1099511627776.0, u, (f - tl.floor(f)) * m - o)
    finite = u == u
    finite = finite & (tl.abs(u) <= 1.7976931348623157e308)
    u = tl.where(finite, u, 0.0)  # never 0·u: that is NaN for u = ±inf
    nd = n.to(tl.float64)
    if PERIODIC:
        u = u - nd * tl.floor(u / nd)
    fl = tl.floor(u)
    t = (u - fl).to(tl.float32)
    inside = finite
    if not PERIODIC:
        inside = inside & (fl - 1.0 >= 0.0) & (fl + 2.0 <= nd - 1.0)
        fl = tl.where(inside, fl, 1.0)
    if IDX64:
        i = fl.to(tl.int64)
    else:
        i = fl.to(tl.int32)
    return i, t, inside, finite


@triton.jit
def _wrap(j, n, PERIODIC: tl.constexpr):
    if PERIODIC:
        j = ((j % n) + n) % n
    return j


@triton.jit
def _line(rho_ptr, base, z0, z1, z2, z3, w0, w1, w2, w3, mask):
    v0 = tl.load(rho_ptr + base + z0, mask=mask, other=0.0)
    v1 = tl.load(rho_ptr + base + z1, mask=mask, other=0.0)
    v2 = tl.load(rho_ptr + base + z2, mask=mask, other=0.0)
    v3 = tl.load(rho_ptr + base + z3, mask=mask, other=0.0)
    return v0, v1, v2, v3, w0 * v0 + w1 * v1 + w2 * v2 + w3 * v3


@triton.jit
def _plane(rho_ptr, base, y0, y1, y2, y3, z0, z1, z2, z3, wy0, wy1, wy2, wy3, wz0, wz1, wz2, wz3, mask):
    _, _, _, _, s0 = _line(rho_ptr, base + y0, z0, z1, z2, z3, wz0, wz1, wz2, wz3, mask)
    _, _, _, _, s1 = _line(rho_ptr, base + y1, z0, z1, z2, z3, wz0, wz1, wz2, wz3, mask)
    _, _, _, _, s2 = _line(rho_ptr, base + y2, z0, z1, z2, z3, wz0, wz1, wz2, wz3, mask)
    _, _, _, _, s3 = _line(rho_ptr, base + y3, z0, z1, z2, z3, wz0, wz1, wz2, wz3, mask)
    return wy0 * s0 + wy1 * s1 + wy2 * s2 + wy3 * s3


@triton.jit
def _line_d(rho_ptr, base, z0, z1, z2, z3, w0, w1, w2, w3, d0, d1, d2, d3, mask):
    v0, v1, v2, v3, s = _line(rho_ptr, base, z0, z1, z2, z3, w0, w1, w2, w3, mask)
    return s, d0 * v0 + d1 * v1 + d2 * v2 + d3 * v3


@triton.jit
def _plane_d(
    rho_ptr, base, y0, y1, y2, y3, z0, z1, z2, z3, wy0, wy1, wy2, wy3, dy0, dy1, dy2, dy3, wz0, wz1, wz2, wz3,
    dz0, dz1, dz2, dz3, mask,
):  # fmt: skip
    """(value, d/dy, d/dz) of one x-plane."""
    s0, e0 = _line_d(rho_ptr, base + y0, z0, z1, z2, z3, wz0, wz1, wz2, wz3, dz0, dz1, dz2, dz3, mask)
    s1, e1 = _line_d(rho_ptr, base + y1, z0, z1, z2, z3, wz0, wz1, wz2, wz3, dz0, dz1, dz2, dz3, mask)
    s2, e2 = _line_d(rho_ptr, base + y2, z0, z1, z2, z3, wz0, wz1, wz2, wz3, dz0, dz1, dz2, dz3, mask)
    s3, e3 = _line_d(rho_ptr, base + y3, z0, z1, z2, z3, wz0, wz1, wz2, wz3, dz0, dz1, dz2, dz3, mask)
    v = wy0 * s0 + wy1 * s1 + wy2 * s2 + wy3 * s3
    dv_y = dy0 * s0 + dy1 * s1 + dy2 * s2 + dy3 * s3
    dv_z = wy0 * e0 + wy1 * e1 + wy2 * e2 + wy3 * e3
    return v, dv_y, dv_z


@triton.jit
def _scatter_line(g_ptr, base, z0, z1, z2, z3, coef, w0, w1, w2, w3, mask):
    tl.atomic_add(g_ptr + base + z0, coef * w0, mask=mask)
    tl.atomic_add(g_ptr + base + z1, coef * w1, mask=mask)
    tl.atomic_add(g_ptr + base + z2, coef * w2, mask=mask)
    tl.atomic_add(g_ptr + base + z3, coef * w3, mask=mask)


@triton.jit
def _scatter_plane(g_ptr, base, y0, y1, y2, y3, z0, z1, z2, z3, coef, wy0, wy1, wy2, wy3, wz0, wz1, wz2, wz3, mask):
    _scatter_line(g_ptr, base + y0, z0, z1, z2, z3, coef * wy0, wz0, wz1, wz2, wz3, mask)
    _scatter_line(g_ptr, base + y1, z0, z1, z2, z3, coef * wy1, wz0, wz1, wz2, wz3, mask)
    _scatter_line(g_ptr, base + y2, z0, z1, z2, z3, coef * wy2, wz0, wz1, wz2, wz3, mask)
    _scatter_line(g_ptr, base + y3, z0, z1, z2, z3, coef * wy3, wz0, wz1, wz2, wz3, mask)


@triton.jit
def _stencil(params_ptr, pts_ptr, offs, n_points, nx, ny, nz, PERIODIC: tl.constexpr, IDX64: tl.constexpr):
    """Per point: flat offsets of the 4 x-planes, 4 y-rows, 4 z-samples; t per axis; flags."""
    valid = offs < n_points
    x = tl.load(pts_ptr + 3 * offs, mask=valid, other=0.0).to(tl.float64)
    y = tl.load(pts_ptr + 3 * offs + 1, mask=valid, other=0.0).to(tl.float64)
    z = tl.load(pts_ptr + 3 * offs + 2, mask=valid, other=0.0).to(tl.float64)
    ix, tx, inx, fx = _axis(params_ptr, 0, x, y, z, nx, PERIODIC, IDX64)
    iy, ty, iny, fy = _axis(params_ptr, 1, x, y, z, ny, PERIODIC, IDX64)
    iz, tz, inz, fz = _axis(params_ptr, 2, x, y, z, nz, PERIODIC, IDX64)
    finite = fx & fy & fz
    inside = inx & iny & inz & valid
    syz = ny * nz
    x0 = _wrap(ix - 1, nx, PERIODIC) * syz
    x1 = _wrap(ix, nx, PERIODIC) * syz
    x2 = _wrap(ix + 1, nx, PERIODIC) * syz
    x3 = _wrap(ix + 2, nx, PERIODIC) * syz
    y0 = _wrap(iy - 1, ny, PERIODIC) * nz
    y1 = _wrap(iy, ny, PERIODIC) * nz
    y2 = _wrap(iy + 1, ny, PERIODIC) * nz
    y3 = _wrap(iy + 2, ny, PERIODIC) * nz
    z0 = _wrap(iz - 1, nz, PERIODIC)
    z1 = _wrap(iz, nz, PERIODIC)
    z2 = _wrap(iz + 1, nz, PERIODIC)
    z3 = _wrap(iz + 2, nz, PERIODIC)
    return x0, x1, x2, x3, y0, y1, y2, y3, z0, z1, z2, z3, tx, ty, tz, inside, finite, valid


# Sizes are never specialised: Triton turns an int argument equal to 1 into a Python constant,
# and a map one voxel thick (a valid tiny cell) would then fail to compile.
@triton.jit(do_not_specialize=["n_points", "nx", "ny", "nz"])
def _tricubic_fwd_kernel(
    rho_ptr,  # (nx, ny, nz) float32, C-contiguous
    pts_ptr,  # (N, 3) float32, C-contiguous
    params_ptr,  # (15,) float64: frac row-major, sampling, origin
    out_ptr,  # (N,) float32
    fill_value,  # float32 scalar
    n_points,
    nx,
    ny,
    nz,
    METHOD: tl.constexpr,
    PERIODIC: tl.constexpr,
    IDX64: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    x0, x1, x2, x3, y0, y1, y2, y3, z0, z1, z2, z3, tx, ty, tz, inside, finite, valid = _stencil(
        params_ptr, pts_ptr, offs, n_points, nx, ny, nz, PERIODIC, IDX64
    )
    wx0, wx1, wx2, wx3 = _weights(tx, METHOD)
    wy0, wy1, wy2, wy3 = _weights(ty, METHOD)
    wz0, wz1, wz2, wz3 = _weights(tz, METHOD)
    p0 = _plane(rho_ptr, x0, y0, y1, y2, y3, z0, z1, z2, z3, wy0, wy1, wy2, wy3, wz0, wz1, wz2, wz3, inside)
    p1 = _plane(rho_ptr, x1, y0, y1, y2, y3, z0, z1, z2, z3, wy0, wy1, wy2, wy3, wz0, wz1, wz2, wz3, inside)
    p2 = _plane(rho_ptr, x2, y0, y1, y2, y3, z0, z1, z2, z3, wy0, wy1, wy2, wy3, wz0, wz1, wz2, wz3, inside)
    p3 = _plane(rho_ptr, x3, y0, y1, y2, y3, z0, z1, z2, z3, wy0, wy1, wy2, wy3, wz0, wz1, wz2, wz3, inside)
    val = wx0 * p0 + wx1 * p1 + wx2 * p2 + wx3 * p3
    val = tl.where(inside, val, fill_value)
    val = tl.where(finite, val, float("nan"))
    tl.store(out_ptr + offs, val, mask=valid)


@triton.jit(do_not_specialize=["gout_stride", "n_points", "nx", "ny", "nz"])
def _tricubic_bwd_kernel(
    rho_ptr,  # (nx, ny, nz) float32
    pts_ptr,  # (N, 3) float32
    params_ptr,  # (15,) float64
    gout_ptr,  # (N,) float32, any stride: upstream gradient (stride 0 after a .sum())
    gout_stride,
    gpts_ptr,  # (N, 3) float32: gradient w.r.t. points (written when NEED_POINTS)
    grho_ptr,  # (nx, ny, nz) float32, zeroed: gradient w.r.t. the map (atomic adds when NEED_RHO)
    n_points,
    nx,
    ny,
    nz,
    METHOD: tl.constexpr,
    PERIODIC: tl.constexpr,
    IDX64: tl.constexpr,
    NEED_POINTS: tl.constexpr,
    NEED_RHO: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    x0, x1, x2, x3, y0, y1, y2, y3, z0, z1, z2, z3, tx, ty, tz, inside, finite, valid = _stencil(
        params_ptr, pts_ptr, offs, n_points, nx, ny, nz, PERIODIC, IDX64
    )
    g = tl.load(gout_ptr + offs * gout_stride, mask=valid, other=0.0)
    g = tl.where(inside, g, 0.0)
    wx0, wx1, wx2, wx3 = _weights(tx, METHOD)
    wy0, wy1, wy2, wy3 = _weights(ty, METHOD)
    wz0, wz1, wz2, wz3 = _weights(tz, METHOD)
    if NEED_POINTS:
        dx0, dx1, dx2, dx3 = _dweights(tx, METHOD)
        dy0, dy1, dy2, dy3 = _dweights(ty, METHOD)
        dz0, dz1, dz2, dz3 = _dweights(tz, METHOD)
        v0, b0, c0 = _plane_d(rho_ptr, x0, y0, y1, y2, y3, z0, z1, z2, z3, wy0, wy1, wy2, wy3, dy0, dy1, dy2, dy3,
                              wz0, wz1, wz2, wz3, dz0, dz1, dz2, dz3, inside)  # fmt: skip
        v1, b1, c1 = _plane_d(rho_ptr, x1, y0, y1, y2, y3, z0, z1, z2, z3, wy0, wy1, wy2, wy3, dy0, dy1, dy2, dy3,
                              wz0, wz1, wz2, wz3, dz0, dz1, dz2, dz3, inside)  # fmt: skip
        v2, b2, c2 = _plane_d(rho_ptr, x2, y0, y1, y2, y3, z0, z1, z2, z3, wy0, wy1, wy2, wy3, dy0, dy1, dy2, dy3,
                              wz0, wz1, wz2, wz3, dz0, dz1, dz2, dz3, inside)  # fmt: skip
        v3, b3, c3 = _plane_d(rho_ptr, x3, y0, y1, y2, y3, z0, z1, z2, z3, wy0, wy1, wy2, wy3, dy0, dy1, dy2, dy3,
                              wz0, wz1, wz2, wz3, dz0, dz1, dz2, dz3, inside)  # fmt: skip
        gx = (dx0 * v0 + dx1 * v1 + dx2 * v2 + dx3 * v3) * g
        gy = (wx0 * b0 + wx1 * b1 + wx2 * b2 + wx3 * b3) * g
        gz = (wx0 * c0 + wx1 * c1 + wx2 * c2 + wx3 * c3) * g
        # d/dp = frac^T (m ⊙ d/du), in float64 then stored as float32
        m0 = tl.load(params_ptr + 9)
        m1 = tl.load(params_ptr + 10)
        m2 = tl.load(params_ptr + 11)
        gx64 = gx.to(tl.float64) * m0
        gy64 = gy.to(tl.float64) * m1
        gz64 = gz.to(tl.float64) * m2
        for k in tl.static_range(3):
            fk0 = tl.load(params_ptr + k)
            fk1 = tl.load(params_ptr + 3 + k)
            fk2 = tl.load(params_ptr + 6 + k)
            gk = fk0 * gx64 + fk1 * gy64 + fk2 * gz64
            tl.store(gpts_ptr + 3 * offs + k, gk.to(tl.float32), mask=valid)
    if NEED_RHO:
        _scatter_plane(grho_ptr, x0, y0, y1, y2, y3, z0, z1, z2, z3, g * wx0, wy0, wy1, wy2, wy3,
                       wz0, wz1, wz2, wz3, inside)  # fmt: skip
        _scatter_plane(grho_ptr, x1, y0, y1, y2, y3, z0, z1, z2, z3, g * wx1, wy0, wy1, wy2, wy3,
                       wz0, wz1, wz2, wz3, inside)  # fmt: skip
        _scatter_plane(grho_ptr, x2, y0, y1, y2, y3, z0, z1, z2, z3, g * wx2, wy0, wy1, wy2, wy3,
                       wz0, wz1, wz2, wz3, inside)  # fmt: skip
        _scatter_plane(grho_ptr, x3, y0, y1, y2, y3, z0, z1, z2, z3, g * wx3, wy0, wy1, wy2, wy3,
                       wz0, wz1, wz2, wz3, inside)  # fmt: skip


def _block() -> int:
    # The interpreter costs per program, so CI runs many points per program; on the GPU
    # 128 points per program keep 64 independent gathers per thread in flight.
    return 1024 if triton_interpreted() else 128


_fwd_launch = FastLauncher(_tricubic_fwd_kernel)
_bwd_launch = FastLauncher(_tricubic_bwd_kernel)


def _aligned(t: torch.Tensor) -> bool:
    """Whether Triton sees ``t``'s pointer as 16-byte aligned (part of its specialisation)."""
    return t.data_ptr() % 16 == 0


def _forward(state, rho, points) -> tuple[torch.Tensor]:
    """``(values,)`` at ``points`` (N, 3): one allocation and one launch (none for N = 0)."""
    params, method_code, periodic, fill_value, _, _ = state
    n = points.shape[0]
    out = torch.empty(n, dtype=torch.float32, device=rho.device)
    if n:
        block = _block()
        nx, ny, nz = rho.shape
        idx64 = rho.numel() >= 2**31 - 1
        _fwd_launch(
            (ceil_div(n, block), 1, 1),
            (rho.device.index, method_code, periodic, idx64, block, _aligned(rho), _aligned(points)),
            (rho, points, params, out, fill_value, n, nx, ny, nz, method_code, periodic, idx64, block),
            rho.device,
        )  # fmt: skip
    return (out,)


def _alert_map_gradient() -> None:
    """torch's rule for an op without a deterministic implementation, for the map gradient's float atomics.

    With ``torch.use_deterministic_algorithms(True)``: a RuntimeError (``warn_only=True``: a UserWarning),
    worded as torch's own alerts so that filters written for those catch it; nothing otherwise.
    """
    if not torch.are_deterministic_algorithms_enabled():
        return
    msg = (
        "tricubic_sample's Triton backward (the gradient with respect to the map) does not have a deterministic "
        "implementation, but you set 'torch.use_deterministic_algorithms(True)': it adds float32 atomics in an "
        "order that changes run to run. Use backend='cpu' (a deterministic scatter), detach the map, or pass "
        "warn_only=True if run-to-run differences in the last bits are acceptable."
    )
    if torch.is_deterministic_algorithms_warn_only_enabled():
        import warnings

        warnings.warn(msg, UserWarning, stacklevel=4)
        return
    raise RuntimeError(msg)


def _backward(state, grad_out, rho, points) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_rho, grad_points)``, each (0,) unless asked for: one launch for both."""
    params, method_code, periodic, _, need_rho, need_points = state
    if need_rho:
        _alert_map_gradient()
    # A gradient not asked for is an empty (0,) tensor: no allocation, no launch.
    grad_rho = torch.zeros(rho.shape, dtype=torch.float32, device=rho.device) if need_rho else rho.new_empty(0)
    # Every row of grad_points is written (0 outside a bounded map and at non-finite points).
    grad_points = torch.empty(points.shape, dtype=torch.float32, device=rho.device) if need_points else rho.new_empty(0)
    n = points.shape[0]
    if n and (need_rho or need_points):
        if grad_out.dtype != torch.float32:
            grad_out = grad_out.to(torch.float32)
        # Read through its stride: the gradient of a .sum() is one value expanded (stride 0),
        # which .contiguous() would copy with an allocation and a launch.
        block = _block()
        nx, ny, nz = rho.shape
        idx64 = rho.numel() >= 2**31 - 1
        _bwd_launch(
            (ceil_div(n, block), 1, 1),
            (rho.device.index, method_code, periodic, idx64, need_points, need_rho, block, _aligned(rho),
             _aligned(points), _aligned(grad_out)),
            (rho, points, params, grad_out, grad_out.stride(0),
             grad_points if need_points else points,  # unused pointer when not needed
             grad_rho if need_rho else rho,
             n, nx, ny, nz, method_code, periodic, idx64, need_points, need_rho, block),
            rho.device,
        )  # fmt: skip
    return grad_rho, grad_points


TRICUBIC_TRITON_OP = op_def("triton", _METHOD_CODE.__getitem__, _forward, _backward)
_TricubicTriton = eager_function(TRICUBIC_TRITON_OP)
register(TRICUBIC_TRITON_OP)


def _prepare(rho: torch.Tensor, points: torch.Tensor):
    """float32, C-contiguous map and (N, 3) points, without a copy where they already are."""
    if rho.dtype != torch.float32:
        rho = to_float32(rho, "tricubic_sample")
    if points.dtype != torch.float32:
        points = to_float32(points, "tricubic_sample")
    if not rho.is_contiguous():
        rho = rho.contiguous()
    if points.ndim != 2:
        points = points.reshape(-1, 3)
    if not points.is_contiguous():
        points = points.contiguous()
    return rho, points


def tricubic_triton(
    rho: torch.Tensor,
    grid: GridSpec,
    points: torch.Tensor,
    method: str = "catmull-rom",
    mode: str = "periodic",
    fill_value: float = 0.0,
) -> torch.Tensor:
    """Tricubic interpolation with Triton kernels (CUDA, or the interpreter in CI).

    Parameters
    ----------
    rho : torch.Tensor, shape grid.shape, float32 (other dtypes are cast, warning once)
    grid : GridSpec
    points : torch.Tensor, shape (..., 3), float32 (others cast, warning once), on ``rho``'s device
    method : {"catmull-rom", "lagrange"}
    mode : {"periodic", "bounded"}
    fill_value : float

    Returns
    -------
    torch.Tensor, shape points.shape[:-1], float32
        Differentiable with respect to ``rho`` and ``points`` (analytic Triton backward;
        the map gradient uses float32 atomics).
    """
    lead = points.shape[:-1]
    rho, flat = _prepare(rho, points)
    out = sample(
        torch.ops.kernels.tricubic_triton, _TricubicTriton, _forward, rho, grid, flat, method, _METHOD_CODE[method],
        mode, float(fill_value),
    )  # fmt: skip
    return out if len(lead) == 1 else out.reshape(lead)
