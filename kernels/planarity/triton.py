"""Triton planarity NLL: one launch fits every plane and scatters the analytic gradient.

Every plane of a :class:`PlaneSet` sits in one padded ``(P, K)`` table, so a single launch
of :func:`_planarity_fwd_kernel` handles all plane sizes (a program takes ``BLOCK_P``
planes × ``BLOCK_K`` slots; padding slots have weight 0). Because ∂NLL/∂x_a = (d_a/σ_a²)·n
is exact for the weighted fit, the kernel adds each atom's gradient with atomics in the
same pass when ``xyz`` requires grad; the backward is then one elementwise multiply by
the upstream gradient on the device. A separate backward kernel (recomputing or reloading
per-plane normals) measured 0.31–0.46 ms forward+backward on an H100 for 3WIP, almost all
of it host-side launch overhead; fusing removes one Triton launch and two allocations.
No host synchronisation anywhere. float32 throughout.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._util import to_float32
from kernels.dispatch import triton_interpreted
from kernels.planarity.cpu import NEWTON_STEPS
from kernels.planarity.planes import PlaneSet, check_inputs
from kernels.planarity.reference import DEGENERATE_GAP

__all__ = ["planarity_nll_triton"]


@triton.jit
def _planarity_fwd_kernel(
    xyz_ptr,  # (N, 3) float32, contiguous
    index_ptr,  # (P, K) int32: atom per slot, padding repeats the plane's first atom
    weight_ptr,  # (P, K) float32: 1/σ², 0 in padding
    loss_ptr,  # (1,) float32, zeroed: Σ ½ w d² is added here
    grad_ptr,  # (N, 3) float32, zeroed: ∂(Σ ½ w d²)/∂xyz accumulates here when WITH_GRAD
    P,
    K,
    WITH_GRAD: tl.constexpr,
    GAP: tl.constexpr,  # DEGENERATE_GAP
    NEWTON: tl.constexpr,  # NEWTON_STEPS
    BLOCK_P: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_P + tl.arange(0, BLOCK_P)
    cols = tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < P) & (cols[None, :] < K)
    offs = rows[:, None] * K + cols[None, :]
    idx = tl.load(index_ptr + offs, mask=mask, other=0)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    x = tl.load(xyz_ptr + idx * 3 + 0, mask=mask, other=0.0)
    y = tl.load(xyz_ptr + idx * 3 + 1, mask=mask, other=0.0)
    z = tl.load(xyz_ptr + idx * 3 + 2, mask=mask, other=0.0)
    # Centre on the plane's own first atom: at 100 Å a float32 coordinate carries ~1e-5 Å
    # of rounding, which the centroid and covariance would otherwise inherit.
    first = cols[None, :] == 0
    x = x - tl.sum(tl.where(first, x, 0.0), axis=1)[:, None]
    y = y - tl.sum(tl.where(first, y, 0.0), axis=1)[:, None]
    z = z - tl.sum(tl.where(first, z, 0.0), axis=1)[:, None]
    wsum = tl.sum(w, axis=1)
    has_w = wsum > 0.0
    inv_w = 1.0 / tl.where(has_w, wsum, 1.0)
    x = x - (tl.sum(w * x, axis=1) * inv_w)[:, None]
    y = y - (tl.sum(w * y, axis=1) * inv_w)[:, None]
    z = z - (tl.sum(w * z, axis=1) * inv_w)[:, None]
    c00 = tl.sum(w * x * x, axis=1)
    c01 = tl.sum(w * x * y, axis=1)
    c02 = tl.sum(w * x * z, axis=1)
    c11 = tl.sum(w * y * y, axis=1)
    c12 = tl.sum(w * y * z, axis=1)
    c22 = tl.sum(w * z * z, axis=1)

    # Closed-form smallest eigenvector (same steps as _plane_fit.cpp; see its comments).
    trace = c00 + c11 + c22
    inf = float("inf")
    finite = (tl.abs(trace) < inf) & (tl.abs(c01) < inf) & (tl.abs(c02) < inf) & (tl.abs(c12) < inf)
    good = finite & (trace > 0.0) & has_w  # NaN compares False: NaN planes are not good
    s = 1.0 / tl.where(good, trace, 1.0)
    c00 = tl.where(good, c00 * s, 0.0)
    c01 = tl.where(good, c01 * s, 0.0)
    c02 = tl.where(good, c02 * s, 0.0)
    c11 = tl.where(good, c11 * s, 0.0)
    c12 = tl.where(good, c12 * s, 0.0)
    c22 = tl.where(good, c22 * s, 0.0)
    q = (c00 + c11 + c22) / 3.0
    b00 = c00 - q
    b11 = c11 - q
    b22 = c22 - q
    p = tl.sqrt((b00 * b00 + b11 * b11 + b22 * b22 + 2.0 * (c01 * c01 + c02 * c02 + c12 * c12)) / 6.0)
    has_p = p > 0.0
    ip = 1.0 / tl.where(has_p, p, 1.0)
    e00 = b00 * ip
    e11 = b11 * ip
    e22 = b22 * ip
    e01 = c01 * ip
    e02 = c02 * ip
    e12 = c12 * ip
    det = e00 * (e11 * e22 - e12 * e12) - e01 * (e01 * e22 - e12 * e02) + e02 * (e01 * e12 - e11 * e02)
    r = tl.minimum(tl.maximum(0.5 * det, -1.0), 1.0)
    beta = tl.minimum(tl.maximum(-q * ip, -2.0), -1.0)
    for _ in tl.static_range(NEWTON):
        f = beta * (beta * beta - 3.0) - 2.0 * r
        fp = tl.maximum(3.0 * beta * beta - 3.0, 1e-30)
        beta = tl.minimum(tl.maximum(beta - f / fp, -2.0), -1.0)
    gap = p * 0.5 * (-3.0 * beta - tl.sqrt(tl.maximum(12.0 - 3.0 * beta * beta, 0.0)))
    lam = q + p * beta
    m00 = c00 - lam
    m11 = c11 - lam
    m22 = c22 - lam
    a00 = m11 * m22 - c12 * c12
    a11 = m00 * m22 - c02 * c02
    a22 = m00 * m11 - c01 * c01
    a01 = c02 * c12 - c01 * m22
    a02 = c01 * c12 - c02 * m11
    a12 = c01 * c02 - m00 * c12
    pick0 = (tl.abs(a00) >= tl.abs(a11)) & (tl.abs(a00) >= tl.abs(a22))
    pick1 = (~pick0) & (tl.abs(a11) >= tl.abs(a22))
    v0 = tl.where(pick0, a00, tl.where(pick1, a01, a02))
    v1 = tl.where(pick0, a01, tl.where(pick1, a11, a12))
    v2 = tl.where(pick0, a02, tl.where(pick1, a12, a22))
    n2 = v0 * v0 + v1 * v1 + v2 * v2
    ok1 = n2 > 0.0
    inv = 1.0 / tl.sqrt(tl.where(ok1, n2, 1.0))
    v0 = v0 * inv
    v1 = v1 * inv
    v2 = v2 * inv
    u0 = a00 * v0 + a01 * v1 + a02 * v2  # power step
    u1 = a01 * v0 + a11 * v1 + a12 * v2
    u2 = a02 * v0 + a12 * v1 + a22 * v2
    n2 = u0 * u0 + u1 * u1 + u2 * u2
    ok = good & has_p & (gap > GAP) & ok1 & (n2 > 0.0) & (n2 < inf)
    inv = 1.0 / tl.sqrt(tl.where(ok, n2, 1.0))
    nx = tl.where(ok, u0 * inv, 0.0)
    ny = tl.where(ok, u1 * inv, 0.0)
    nz = tl.where(ok, u2 * inv, 0.0)

    d = tl.where(ok[:, None], x * nx[:, None] + y * ny[:, None] + z * nz[:, None], 0.0)
    coef = w * d
    tl.atomic_add(loss_ptr, 0.5 * tl.sum(tl.sum(coef * d, axis=1), axis=0))
    if WITH_GRAD:
        # ∂NLL/∂x_a = (d_a/σ_a²)·n, exact for the weighted fit (KERNELS.md), so the
        # gradient is known here; padding and degenerate planes (coef 0) skip the atomics.
        live = mask & (coef != 0.0)
        tl.atomic_add(grad_ptr + idx * 3 + 0, coef * nx[:, None], mask=live)
        tl.atomic_add(grad_ptr + idx * 3 + 1, coef * ny[:, None], mask=live)
        tl.atomic_add(grad_ptr + idx * 3 + 2, coef * nz[:, None], mask=live)


def _blocks(k: int, block_p: int | None) -> tuple[int, int]:
    block_k = max(triton.next_power_of_2(k), 2)
    if block_p is None:
        # The interpreter costs per program, not per element: few wide programs there.
        # On a GPU, 16 planes × BLOCK_K slots per program: on an H100 with 3WIP, BLOCK_P
        # 16/32/64 measured 0.31/0.46/0.34 ms forward+backward (unfused version; the
        # benchmark keeps sweeping 32 and 64).
        block_p = 256 if triton_interpreted() else 16
    return block_p, block_k


class _PlanarityTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, xyz, index, weight, constant, block_p):
        p, k = index.shape
        n = xyz.shape[0]
        bp, bk = _blocks(k, block_p)
        with_grad = ctx.needs_input_grad[0]
        # One zeroed buffer for the gradient and the loss: one fill launch, not two.
        buf = torch.zeros(3 * n + 1 if with_grad else 1, dtype=torch.float32, device=xyz.device)
        loss = buf[-1:]
        grad = buf[: 3 * n].view(n, 3) if with_grad else buf
        _planarity_fwd_kernel[(triton.cdiv(p, bp),)](
            xyz, index, weight, loss, grad, p, k,
            WITH_GRAD=with_grad, GAP=DEGENERATE_GAP, NEWTON=NEWTON_STEPS, BLOCK_P=bp, BLOCK_K=bk,
        )  # fmt: skip
        if with_grad:
            ctx.save_for_backward(grad)
        return loss[0] + constant

    @staticmethod
    def backward(ctx, grad_out):
        (grad,) = ctx.saved_tensors
        # The analytic gradient came out of the forward kernel; scaling it by the upstream
        # gradient is one elementwise launch, with grad_out read on the device (no sync).
        return grad * grad_out.to(torch.float32), None, None, None, None


def planarity_nll_triton(xyz: torch.Tensor, planes: PlaneSet, *, block_p: int | None = None) -> torch.Tensor:
    """Planarity NLL with Triton kernels, float32, analytic backward.

    Parameters
    ----------
    xyz : torch.Tensor, shape (N, 3), float32, CUDA (or CPU under ``TRITON_INTERPRET=1``)
        Atom positions in Å; other dtypes are cast to float32 with a warning once.
    planes : PlaneSet
        Planes whose indices point into ``xyz`` (moved to ``xyz.device`` once, cached).
    block_p : int, optional
        Planes per program (a power of 2); default 16 on a GPU, 256 in the interpreter.

    Returns
    -------
    torch.Tensor, shape (), float32
        The NLL (see :func:`kernels.planarity_nll`); degenerate or non-finite planes add
        only their constant and get zero gradient.
    """
    check_inputs(xyz, planes)
    xyz = to_float32(xyz, "planarity_nll").contiguous()
    planes = planes.to(xyz.device)
    if len(planes) == 0:
        return (xyz * 0.0).sum() + planes.constant
    return _PlanarityTriton.apply(xyz, planes.index, planes.weight(torch.float32), planes.constant, block_p)
