"""Density kernels as users write them, one correct and several with classic bugs.

They live in a module (not in the tests) so :func:`kernels.check_backend` can import them
again in a fresh process for its first-call check. Each is a plain torch splat over every
voxel and every periodic image (small cells only), with one thing done wrong.
"""

from __future__ import annotations

import itertools
import math
import os
import signal
import sys
import threading
from pathlib import Path

import torch

import kernels

_SHIFTS = torch.tensor(list(itertools.product((-1, 0, 1), repeat=3)), dtype=torch.float64)


def _splat(atoms, grid, radius, cutoff, *, metric=None, acc_dtype=None, occupancy=True, radius_scale=1.0):
    """Σ over atoms and images within the radius of occ·Σ_k a_k(4π/B_k)^{3/2}exp(−4π²r²/B_k)."""
    dtype = atoms.xyz.dtype
    dev = atoms.xyz.device
    if radius is None:
        radii = kernels.cutoff_radius(atoms.b_iso, atoms.a, atoms.b, cutoff).to(dev, dtype)
    else:
        radii = torch.full((len(atoms),), float(radius), dtype=dtype, device=dev)
    radii = radii * radius_scale
    g = (grid.cell.metric if metric is None else metric).to(dev, dtype)
    frac_vox = grid.voxel_fractional().to(dev, dtype).reshape(-1, 3)  # (V, 3)
    frac_atoms = atoms.xyz @ grid.cell.frac.to(dev, dtype).T  # (N, 3)
    bk = atoms.b + atoms.b_iso[:, None]  # (N, 5)
    amp = atoms.a * (4 * math.pi / bk) ** 1.5
    amp = amp * atoms.occ[:, None] if occupancy else amp
    d = frac_vox[None] - frac_atoms[:, None]  # (N, V, 3)
    d = d - torch.round(d).detach()
    out = torch.zeros(frac_vox.shape[0], dtype=acc_dtype or dtype, device=dev)
    for shift in _SHIFTS.to(dev, dtype):
        ds = d + shift
        r2 = ((ds @ g) * ds).sum(-1)  # (N, V)
        atom, vox = (r2 <= radii[:, None] ** 2).nonzero(as_tuple=True)
        val = (amp[atom] * torch.exp(-4 * math.pi**2 * r2[atom, vox][:, None] / bk[atom])).sum(-1)
        out = out.index_add(0, vox, val.to(out.dtype))  # in the accumulator's dtype, one term at a time
    return out.to(dtype).reshape(grid.shape)


def correct(atoms, grid, *, radius, cutoff):
    """A correct user kernel: every check passes."""
    return _splat(atoms, grid, radius, cutoff)


def truncated_radius(atoms, grid, *, radius, cutoff):
    """Bug: each atom's sphere ends at 60 % of its radius (the tails are cut off)."""
    return _splat(atoms, grid, radius, cutoff, radius_scale=0.6)


def orthogonal_wrap(atoms, grid, *, radius, cutoff):
    """Bug: distances as if the cell were orthogonal (a², b², c² on the metric's diagonal only)."""
    return _splat(atoms, grid, radius, cutoff, metric=torch.diag(torch.diagonal(grid.cell.metric)))


def half_precision(atoms, grid, *, radius, cutoff):
    """Bug: the map accumulated in float16."""
    return _splat(atoms, grid, radius, cutoff, acc_dtype=torch.float16)


def no_occupancy(atoms, grid, *, radius, cutoff):
    """Bug: occupancies ignored (every atom counted whole)."""
    return _splat(atoms, grid, radius, cutoff, occupancy=False)


class _FlipX(torch.autograd.Function):
    """Identity forward; the backward's x component of ∂/∂xyz with the wrong sign."""

    @staticmethod
    def forward(ctx, xyz):
        return xyz.view_as(xyz)

    @staticmethod
    def backward(ctx, grad):
        return grad * torch.tensor([-1.0, 1.0, 1.0], dtype=grad.dtype, device=grad.device)


def wrong_sign_gradient(atoms, grid, *, radius, cutoff):
    """Bug: the map is right, ∂/∂x of every atom has the wrong sign."""
    return _splat(atoms.replace(xyz=_FlipX.apply(atoms.xyz)), grid, radius, cutoff)


def example_atoms(triclinic: bool = True) -> kernels.Model:
    """A small model: 12 atoms (C, N, O, S) in a 13–15 Å cell, two at partial occupancy, some near the faces."""
    cell = (
        kernels.Cell.from_parameters(13.0, 14.0, 15.0, 72.0, 81.0, 104.0)
        if triclinic
        else kernels.Cell.from_parameters(13.0, 14.0, 15.0)
    )
    gen = torch.Generator().manual_seed(7)
    frac = torch.rand(12, 3, generator=gen, dtype=torch.float64)
    frac[:3] = torch.tensor([[0.02, 0.5, 0.5], [0.5, 0.98, 0.5], [0.97, 0.03, 0.99]], dtype=torch.float64)
    xyz = frac @ cell.orth.T
    elements = ["C", "N", "O", "C", "S", "C", "O", "N", "C", "C", "O", "C"]
    b = torch.linspace(8.0, 30.0, 12, dtype=torch.float64)
    occ = torch.ones(12, dtype=torch.float64)
    occ[[4, 9]] = torch.tensor([0.5, 0.3], dtype=torch.float64)
    atoms = kernels.AtomSet.from_elements(elements, xyz, b, occ)
    return kernels.Model(atoms, cell, "P 1", None, None)


# A Triton kernel with the classic first-call bug: it accumulates into a workspace it keeps
# between calls, allocated with torch.empty and zeroed only after each use, so the first call
# adds the map to whatever the new memory held. check_backend poisons uninitialised memory
# (NaN), so the first call is garbage on every machine, the Triton interpreter included.

_workspaces: dict = {}


def _add_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def add(out_ptr, src_ptr, n, BLOCK: tl.constexpr):
        # out_ptr: (n,) float32, the workspace; src_ptr: (n,) float32, this call's map
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        acc = tl.load(out_ptr + offs, mask=mask) + tl.load(src_ptr + offs, mask=mask)
        tl.store(out_ptr + offs, acc, mask=mask)

    return add


_ADD = None


def triton_first_call_garbage(atoms, grid, *, radius, cutoff):
    """Bug: the first call returns the map plus the workspace's uninitialised memory."""
    global _ADD
    if _ADD is None:
        _ADD = _add_kernel()
    key = (grid.shape, atoms.device)
    work = _workspaces.get(key)
    if work is None:
        work = _workspaces[key] = torch.empty(grid.n_voxels, dtype=torch.float32, device=atoms.device)
    with torch.no_grad():
        src = _splat(atoms, grid, radius, cutoff).to(torch.float32).reshape(-1).contiguous()
    n = src.numel()
    _ADD[((n + 255) // 256,)](work, src, n, BLOCK=256)
    out = work.clone().reshape(grid.shape)
    work.zero_()  # ready for the next call
    return out


# Kernels that try to end, kill or stall the check instead of returning a map. They are
# module-level so the check's child process (and `workbench check`) can import them.


def sys_exit_zero(atoms, grid, *, radius, cutoff):
    """Ends the process with status 0 (as a CI gate would read success)."""
    sys.exit(0)


def sys_exit_in_backward(atoms, grid, *, radius, cutoff):
    """A right map whose backward calls sys.exit(0) (from a hook on the map's gradient)."""
    rho = _splat(atoms, grid, radius, cutoff)
    if rho.requires_grad:
        rho.register_hook(_exit_zero)
    return rho


def _exit_zero(grad):
    sys.exit(0)


def generator_exit(atoms, grid, *, radius, cutoff):
    """Raises GeneratorExit, a BaseException that is not an Exception."""
    raise GeneratorExit("leaving")


def keyboard_interrupt(atoms, grid, *, radius, cutoff):
    """Raises KeyboardInterrupt: the whole check stops, as on Ctrl-C."""
    raise KeyboardInterrupt


def os_exit_zero(atoms, grid, *, radius, cutoff):
    """Ends its process at once with status 0, no exception, no cleanup."""
    os._exit(0)


def kills_itself(atoms, grid, *, radius, cutoff):
    """Sends SIGKILL to its own process."""
    os.kill(os.getpid(), signal.SIGKILL)


def os_exit_in_a_new_process(atoms, grid, *, radius, cutoff):
    """Right in the checking process; os._exit(0) in the first-call check's new process (its script is fresh.py)."""
    if Path(sys.argv[0]).name == "fresh.py":
        os._exit(0)
    return _splat(atoms, grid, radius, cutoff)


def sys_exit_in_a_new_process(atoms, grid, *, radius, cutoff):
    """Right in the checking process; sys.exit(0) in the first-call check's new process."""
    if Path(sys.argv[0]).name == "fresh.py":
        sys.exit(0)
    return _splat(atoms, grid, radius, cutoff)


def closes_stdout(atoms, grid, *, radius, cutoff):
    """A right map, after closing the process's stdout and stderr."""
    sys.stdout.close()
    sys.stderr.close()
    return _splat(atoms, grid, radius, cutoff)


def never_returns(atoms, grid, *, radius, cutoff):
    """Waits forever (a deadlock)."""
    threading.Event().wait()


def meta_map(atoms, grid, *, radius, cutoff):
    """A map of the right shape and dtype on the meta device (no data)."""
    return torch.empty(grid.shape, dtype=torch.float32, device="meta")


def int32_map(atoms, grid, *, radius, cutoff):
    """The right map rounded to int32."""
    return _splat(atoms, grid, radius, cutoff).round().to(torch.int32)


def never_returns_in_a_new_process(atoms, grid, *, radius, cutoff):
    """Right in the checking process; in the first-call check's new process it writes its pid to the file
    $USER_BACKENDS_PID_FILE names, then waits forever."""
    if Path(sys.argv[0]).name == "fresh.py":
        Path(os.environ["USER_BACKENDS_PID_FILE"]).write_text(str(os.getpid()))
        threading.Event().wait()
    return _splat(atoms, grid, radius, cutoff)
