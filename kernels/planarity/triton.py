"""Triton planarity NLL: one launch forward, one launch backward, no host synchronisation.

Every plane of a :class:`PlaneSet` sits in one padded ``(P, K)`` table, so a single launch
of :func:`_planarity_fwd_kernel` handles all plane sizes (a program takes ``BLOCK_P``
planes × ``BLOCK_K`` slots; padding slots have weight 0). It writes each plane's normal and
the per-slot coefficients d_a/σ_a², and reduces the loss itself: every program stores its
partial sum, and the last program to finish (an atomic ticket that it resets to 0) adds the
partials in program order plus the constant, so the loss is deterministic and needs no
zero-filled buffer. Because ∂NLL/∂x_a = (d_a/σ_a²)·n is exact for the weighted fit, the
backward is one launch of :func:`_planarity_bwd_kernel`: each atom gathers its terms
through an atom → slot table built once per PlaneSet (no atomics, deterministic, every row
written, so no zero fill) and scales by the upstream gradient read on the device.

Per call: forward = 1 allocation (the loss) + 1 launch, plus the coefficient/normal table
when a gradient is wanted; backward = 1 allocation + 1 launch. Launches go through
:class:`kernels._launch.FastLauncher` (the compiled kernel's launcher called directly after
the first call). The device tables (index, weight, atom → slot) are built on the first call
for a device and cached on the PlaneSet with the launch sizes, so after one warm-up call
forward+backward can be captured in a CUDA graph (``tests/kernels/test_planarity.py`` checks
a replay after changing ``xyz``). The ticket counter and the partial sums are kept per CUDA
stream: concurrent calls with the same PlaneSet on different streams each use their own.
float32 throughout.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import triton
import triton.language as tl

from kernels._launch import FastLauncher
from kernels._opdef import OpDef, eager_function, register
from kernels._util import Handles, assume_constant_result, to_float32
from kernels.dispatch import triton_interpreted
from kernels.planarity.planes import NEWTON_STEPS, PlaneSet, check_inputs, live_plane_set
from kernels.planarity.reference import DEGENERATE_GAP

__all__ = ["planarity_nll_triton"]

_BLOCK_R = 128  # partial sums the last program adds per step
_BLOCK_A = 128  # atoms per backward program


# Ints are never specialised: the launcher (kernels._launch) keys compiled kernels on the
# constexprs, so an int equal to 1 (one plane) must not become a compile-time constant.
@triton.jit(do_not_specialize=["P", "K", "n_programs"])
def _planarity_fwd_kernel(
    xyz_ptr,  # (N, 3) float32, contiguous
    index_ptr,  # (P, K) int32: atom per slot, padding repeats the plane's first atom
    weight_ptr,  # (P, K) float32: 1/σ², 0 in padding
    partial_ptr,  # (n_programs,) float32: each program's Σ ½ w d² (scratch kept per stream)
    count_ptr,  # (1,) int32, 0 between calls: the ticket; the last program resets it
    loss_ptr,  # () float32: Σ partials + constant, written by the last program
    table_ptr,  # (P·K + P·3,) float32 when WITH_GRAD: w·d per slot (0 in padding and
    # degenerate planes), then each plane's unit normal (0 for degenerate planes)
    P,
    K,
    n_programs,
    constant,  # float32: Σ log σ + ½ log 2π over the plane atoms
    WITH_GRAD: tl.constexpr,
    GAP: tl.constexpr,  # DEGENERATE_GAP
    NEWTON: tl.constexpr,  # NEWTON_STEPS
    BLOCK_P: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    R_STEPS: tl.constexpr,  # cdiv(n_programs, BLOCK_R)
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
    tl.store(partial_ptr + pid, 0.5 * tl.sum(tl.sum(coef * d, axis=1), axis=0))
    if WITH_GRAD:
        # ∂NLL/∂x_a = (d_a/σ_a²)·n, exact for the weighted fit (docs/kernels.md): the backward
        # kernel needs only these two tables.
        tl.store(table_ptr + offs, coef, mask=mask)
        normal_ptr = table_ptr + P * K
        live = rows < P
        tl.store(normal_ptr + rows * 3 + 0, nx, mask=live)
        tl.store(normal_ptr + rows * 3 + 1, ny, mask=live)
        tl.store(normal_ptr + rows * 3 + 2, nz, mask=live)
    # Last-program reduction: the barrier orders every thread's stores before the ticket, whose
    # acquire-release atomic publishes them; the last program then reads all partials from L2
    # (volatile) and resets the ticket for the next call (or CUDA graph replay).
    tl.debug_barrier()
    # Predicated rather than branched (the interpreter's scalar atomics return a 1-element
    # array); other programs' loads are all masked off, so they skip the reduction.
    last = tl.atomic_add(count_ptr, 1, sem="acq_rel") == n_programs - 1
    r = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for step in tl.static_range(R_STEPS):
        start = step * BLOCK_R
        acc += tl.load(partial_ptr + start + r, mask=(start + r < n_programs) & last, other=0.0, volatile=True)
    tl.store(loss_ptr, tl.sum(acc, axis=0) + constant, mask=last)
    tl.atomic_xchg(count_ptr, 0, mask=last)


@triton.jit(do_not_specialize=["N", "K", "PK"])
def _planarity_bwd_kernel(
    table_ptr,  # (P·K + P·3,) float32 from the forward: coefficients, then normals
    start_ptr,  # (N + 1,) int32: atom a's slots are slots[start[a]:start[a + 1]]
    slot_ptr,  # (M,) int32: flat slot p·K + s of every real (non-padding) slot, grouped by atom
    gout_ptr,  # () float32: upstream gradient
    grad_ptr,  # (N, 3) float32 out, every row written
    N,
    K,
    PK,  # P·K: where the normals start in the table
    MAX_DEGREE: tl.constexpr,  # most planes any atom is in
    BLOCK_A: tl.constexpr,
):
    coef_ptr = table_ptr
    normal_ptr = table_ptr + PK
    atoms = tl.program_id(0) * BLOCK_A + tl.arange(0, BLOCK_A)
    am = atoms < N
    s0 = tl.load(start_ptr + atoms, mask=am, other=0)
    s1 = tl.load(start_ptr + atoms + 1, mask=am, other=0)
    gx = tl.zeros([BLOCK_A], dtype=tl.float32)
    gy = tl.zeros([BLOCK_A], dtype=tl.float32)
    gz = tl.zeros([BLOCK_A], dtype=tl.float32)
    for j in tl.static_range(MAX_DEGREE):
        live = am & (s0 + j < s1)
        slot = tl.load(slot_ptr + s0 + j, mask=live, other=0)
        c = tl.load(coef_ptr + slot, mask=live, other=0.0)
        p = slot // K
        gx += c * tl.load(normal_ptr + p * 3 + 0, mask=live, other=0.0)
        gy += c * tl.load(normal_ptr + p * 3 + 1, mask=live, other=0.0)
        gz += c * tl.load(normal_ptr + p * 3 + 2, mask=live, other=0.0)
    g = tl.load(gout_ptr)
    tl.store(grad_ptr + atoms * 3 + 0, gx * g, mask=am)
    tl.store(grad_ptr + atoms * 3 + 1, gy * g, mask=am)
    tl.store(grad_ptr + atoms * 3 + 2, gz * g, mask=am)


def _blocks(k: int, block_p: int | None) -> tuple[int, int]:
    block_k = max(triton.next_power_of_2(k), 2)
    if block_p is None:
        # The interpreter costs per program, not per element: few wide programs there.
        # On a GPU, 16 planes × BLOCK_K slots per program (BLOCK_P 16/32/64 were within the
        # run-to-run spread of host overhead on an H100 with 3WIP; the benchmark sweeps 32, 64).
        block_p = 256 if triton_interpreted() else 16
    return block_p, block_k


_fwd_launch = FastLauncher(_planarity_fwd_kernel)
_bwd_launch = FastLauncher(_planarity_bwd_kernel)


@dataclasses.dataclass(eq=False)
class _Plan:
    """Device tables and launch constants for one PlaneSet on one device (built once, cached).

    Everything a call needs besides ``xyz`` and its fresh outputs is here, so the per-call
    host work is one dict lookup, the allocations and the launch.
    """

    index: torch.Tensor  # (P, K) int32
    weight: torch.Tensor  # (P, K) float32, 1/σ², 0 in padding
    start: torch.Tensor  # (N + 1,) int32
    slots: torch.Tensor  # (M,) int32
    max_degree: int
    n_atoms: int
    p: int
    k: int
    block_p: int
    block_k: int
    n_programs: int
    constant: float
    device: torch.device
    table_size: int  # P·K + P·3: coefficients and normals saved for the backward
    fwd_grid: tuple[int, int, int]
    bwd_grid: tuple[int, int, int]
    fwd_meta: tuple  # the forward's constexprs after WITH_GRAD, in signature order
    scratch: dict  # stream handle (0 on the CPU) -> ((1,) int32 ticket, (n_programs,) float32 partials)
    # Whether each call makes its own scratch (:func:`_call_scratch`): the compiled op's plans.
    call_scratch: bool = False

    def stream_scratch(self) -> tuple[int, torch.Tensor, torch.Tensor]:
        """``(stream, ticket, partials)`` for the current stream of this plan's device.

        The ticket is 0 between calls (the last program resets it) and the partials are
        rewritten by every call, so both live as long as the plan: calls on one stream run
        in order, and each stream (or CUDA graph capture stream) has its own pair.
        """
        stream = torch._C._cuda_getCurrentRawStream(self.device.index) if self.device.type == "cuda" else 0
        hit = self.scratch.get(stream)
        if hit is None:
            hit = self.scratch[stream] = (
                torch.zeros(1, dtype=torch.int32, device=self.device),
                torch.empty(self.n_programs, dtype=torch.float32, device=self.device),
            )
        return (stream, *hit)


def _plan(planes: PlaneSet, device: torch.device, block_p: int | None) -> _Plan:
    key = ("triton_plan", device, block_p)
    plan = planes._cache.get(key)
    if plan is not None:
        return plan
    p, k = planes.index.shape
    index = planes.index.detach().cpu().numpy().astype(np.int32)
    size = planes.size.detach().cpu().numpy()
    real = np.arange(k)[None, :] < size[:, None]
    flat = np.flatnonzero(real).astype(np.int64)  # row-major p·K + s
    atoms = index.reshape(-1)[flat]
    order = np.argsort(atoms, kind="stable")
    counts = np.bincount(atoms, minlength=planes.n_atoms)
    start = np.zeros(planes.n_atoms + 1, dtype=np.int32)
    np.cumsum(counts, out=start[1:])
    bp, bk = _blocks(k, block_p)
    dev = planes.to(device)
    n_programs = triton.cdiv(p, bp)
    plan = _Plan(
        index=dev.index.to(torch.int32).contiguous(),
        weight=dev.weight(torch.float32),
        start=torch.from_numpy(start).to(device),
        slots=torch.from_numpy(flat[order].astype(np.int32)).to(device),
        max_degree=int(counts.max()) if len(counts) else 0,
        n_atoms=planes.n_atoms,
        p=p,
        k=k,
        block_p=bp,
        block_k=bk,
        n_programs=n_programs,
        constant=planes.constant,
        device=device,
        table_size=p * k + p * 3,
        fwd_grid=(n_programs, 1, 1),
        bwd_grid=(triton.cdiv(planes.n_atoms, _BLOCK_A), 1, 1),
        fwd_meta=(DEGENERATE_GAP, NEWTON_STEPS, bp, bk, _BLOCK_R, triton.cdiv(n_programs, _BLOCK_R)),
        scratch={},
    )
    planes._cache[key] = plan
    return plan


def _aligned(t: torch.Tensor) -> bool:
    """Whether Triton sees ``t``'s pointer as 16-byte aligned (part of its specialisation)."""
    return t.data_ptr() % 16 == 0


def _call_scratch(plan: _Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ticket, partials)`` made for one call: a zeroed (1,) int32 ticket and (n_programs,) float32.

    For calls inside a compiled graph: they die with the call, so nothing outlives a CUDA graph's
    warm-up or capture in its private pool, and a replay zeroes the ticket again (one memset).
    """
    return (
        torch.zeros(1, dtype=torch.int32, device=plan.device),
        torch.empty(plan.n_programs, dtype=torch.float32, device=plan.device),
    )


def _forward(plan: _Plan, xyz: torch.Tensor, with_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward launch: the loss, and the table the backward needs when ``with_grad``.

    The scratch (ticket, partials) is the plan's own for the current stream, kept between calls
    (eager calls: no allocation, no memset), or made for the call when ``plan.call_scratch``.
    """
    count, partial = _call_scratch(plan) if plan.call_scratch else plan.stream_scratch()[1:]
    loss = torch.empty((), dtype=torch.float32, device=plan.device)
    table = torch.empty(plan.table_size, dtype=torch.float32, device=plan.device) if with_grad else None
    _fwd_launch(
        plan.fwd_grid,
        (plan.device.index, with_grad, plan.fwd_meta, _aligned(xyz)),
        (xyz, plan.index, plan.weight, partial, count, loss, loss if table is None else table,
         plan.p, plan.k, plan.n_programs, plan.constant, with_grad, *plan.fwd_meta),
        plan.device,
    )  # fmt: skip
    return loss, table


def _backward(plan: _Plan, grad_out: torch.Tensor, xyz: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor]:
    """One backward launch: ``(∂NLL/∂xyz,)`` scaled by ``grad_out`` (read on the device, no sync)."""
    if grad_out.dtype != torch.float32:
        grad_out = grad_out.to(torch.float32)
    grad = torch.empty((plan.n_atoms, 3), dtype=torch.float32, device=plan.device)  # every row written
    _bwd_launch(
        plan.bwd_grid,
        (plan.device.index, plan.max_degree, _aligned(grad_out)),
        (table, plan.start, plan.slots, grad_out, grad, plan.n_atoms, plan.k, plan.p * plan.k,
         plan.max_degree, _BLOCK_A),
        plan.device,
    )  # fmt: skip
    return (grad,)


# --------------------------------------------------------------------------- the op, defined once
#
# The call state is the plan. Eager calls apply the autograd Function built from PLANARITY_TRITON_OP
# with the PlaneSet's cached plan (when a gradient is wanted; otherwise one forward launch without the
# table); compiled calls run the custom op ``kernels::planarity_triton(xyz, plan)``, ``plan`` the handle
# of a plan made while dynamo traces the call (``_HANDLES``), whose calls make their own scratch.

_HANDLES = Handles()  # handle -> _Plan with call_scratch


@assume_constant_result
def _handle(token: str, device: str) -> int:
    def make():
        plan = _plan(live_plane_set(token), torch.device(device), None)
        return dataclasses.replace(plan, scratch={}, call_scratch=True)

    return _HANDLES.get((token, device), make)


PLANARITY_TRITON_OP = OpDef(
    name="kernels::planarity_triton",
    inputs=("Tensor xyz",),
    params=("int plan",),
    grads=(0,),
    saved=1,
    call=lambda inputs, params: _HANDLES[params[0]],
    forward=lambda plan, xyz: _forward(plan, xyz, True),
    backward=_backward,
    fake=lambda xyz, handle: (
        xyz.new_empty((), dtype=torch.float32),
        xyz.new_empty((_HANDLES[handle].table_size,), dtype=torch.float32),
    ),
)
_PlanarityTriton = eager_function(PLANARITY_TRITON_OP)
register(PLANARITY_TRITON_OP)


def planarity_nll_triton(xyz: torch.Tensor, planes: PlaneSet) -> torch.Tensor:
    """Planarity NLL with Triton kernels, float32, analytic backward.

    One kernel launch forward and one backward; no host synchronisation. After a first
    (warm-up) call for a device, forward+backward can be captured in a CUDA graph.

    Parameters
    ----------
    xyz : torch.Tensor, shape (N, 3), float32, CUDA (or CPU under ``TRITON_INTERPRET=1``)
        Atom positions in Å; other dtypes are cast to float32 with a warning once.
    planes : PlaneSet
        Planes whose indices point into ``xyz``. Their device tables are built on the first
        call for a device and cached on ``planes``.

    Returns
    -------
    torch.Tensor, shape (), float32
        The NLL (see :func:`kernels.planarity_nll`); degenerate or non-finite planes add
        only their constant and get zero gradient.
    """
    return _planarity_nll_triton(xyz, planes)


def _planarity_nll_triton(xyz: torch.Tensor, planes: PlaneSet, *, block_p: int | None = None) -> torch.Tensor:
    """:func:`planarity_nll_triton` with the planes per program set by the caller.

    ``block_p`` (a power of 2; None: 16 on a GPU, 256 in the interpreter) is for benchmarks
    that time other program shapes; every value gives the same loss and gradient.
    """
    check_inputs(xyz, planes)
    if xyz.dtype != torch.float32:
        xyz = to_float32(xyz, "planarity_nll")
    if not xyz.is_contiguous():
        xyz = xyz.contiguous()
    if len(planes) == 0:
        return (xyz * 0.0).sum() + planes.constant
    if torch.compiler.is_compiling():
        return torch.ops.kernels.planarity_triton(xyz, _handle(planes._token, str(xyz.device)))[0]
    plan = _plan(planes, xyz.device, block_p)
    if not (xyz.requires_grad and torch.is_grad_enabled()):  # no table, no autograd node
        return _forward(plan, xyz, False)[0]
    return _PlanarityTriton.apply(plan, xyz)
