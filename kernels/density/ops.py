"""The density splat as ``torch.library`` custom ops, for ``torch.compile`` and graph tracing.

``splat_density`` calls these only while ``torch.compiler.is_compiling()``: an eager call goes
straight to the backend's autograd Function, because the custom-op dispatcher (schema parsing,
the generated autograd node, fake-tensor bookkeeping) adds tens of µs of host time per call,
several times the GPU work of a small model. Inside a compiled graph that cost is paid once at
trace time, and the ops give the compiler what it needs: a schema, output shapes without running
the kernel (``register_fake``) and the backward (``register_autograd``).

Ops (namespace ``kernels``):

``density_triton(xyz, b_iso, occ, a, b, cell, shape, radius, cutoff, n_frames) -> (map, radii)``
    The Triton forward: the map (``shape``, or (n_frames, *shape)) and each atom's radius as the
    forward computed it ((N,) float32; (0,) with a fixed radius), saved for the backward.
``density_triton_backward(grad, xyz, b_iso, occ, a, b, radii, ...) -> (g_xyz, g_b_iso, g_occ)``
    The Triton backward, one launch.
``density_cpu(xyz, b_iso, occ, a, b, cell, shape, radius, cutoff) -> map``
    :func:`kernels.density.cpu.splat_cpu`, wrapped.
``density_cpu_backward(grad, xyz, b_iso, occ, a, b, cell, shape, radius, cutoff) -> (g_xyz, g_b_iso, g_occ)``
    The gradients of ``splat_cpu`` through its public autograd path: the forward is run again
    inside the op (the C++ backward needs the forward's row intervals, which cannot cross an op
    boundary), so a compiled CPU backward costs one more forward.

``cell`` is the six cell parameters (Å, degrees) and ``shape`` the whole-cell grid's shape: plain
values a graph can hold, from which the ops rebuild the grid (cached).
"""

from __future__ import annotations

import functools

import torch

from kernels.crystal import AtomSet, Cell, GridSpec

__all__ = ["splat_density_op"]


@functools.lru_cache(maxsize=64)
def _grid(cell: tuple[float, ...], shape: tuple[int, ...]) -> GridSpec:
    return GridSpec(Cell.from_parameters(*cell), shape)


def _atoms(xyz, b_iso, occ, a, b) -> AtomSet:
    return AtomSet(xyz, b_iso, occ, a, b, _validate=False)


# --------------------------------------------------------------------------- triton


@torch.library.custom_op("kernels::density_triton", mutates_args=())
def density_triton(
    xyz: torch.Tensor,
    b_iso: torch.Tensor,
    occ: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    cell: list[float],
    shape: list[int],
    radius: float | None,
    cutoff: float,
    n_frames: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    from kernels.density import triton as tri

    grid = _grid(tuple(cell), tuple(shape))
    plan = tri._plan(grid, radius, cutoff, xyz.device)
    out_shape = tuple(shape) if n_frames == 1 else (n_frames, *shape)
    n = xyz.shape[0]
    if n == 0:
        return torch.zeros(out_shape, dtype=torch.float32, device=xyz.device), _no_radii(xyz, radius)
    out, radii = tri._forward(plan, xyz, b_iso, occ, a, b, n_frames)
    # A fixed radius writes no radii (the kernel got b_iso as a placeholder): an op's outputs may not alias.
    return out.view(out_shape), radii if radius is None else _no_radii(xyz, radius)


def _no_radii(xyz: torch.Tensor, radius) -> torch.Tensor:
    return torch.zeros(xyz.shape[0] if radius is None else 0, dtype=torch.float32, device=xyz.device)


@density_triton.register_fake
def _(xyz, b_iso, occ, a, b, cell, shape, radius, cutoff, n_frames):
    out_shape = tuple(shape) if n_frames == 1 else (n_frames, *shape)
    n = xyz.shape[0] if radius is None else 0
    return xyz.new_empty(out_shape, dtype=torch.float32), xyz.new_empty((n,), dtype=torch.float32)


@torch.library.custom_op("kernels::density_triton_backward", mutates_args=())
def density_triton_backward(
    grad: torch.Tensor,
    xyz: torch.Tensor,
    b_iso: torch.Tensor,
    occ: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    radii: torch.Tensor,
    cell: list[float],
    shape: list[int],
    radius: float | None,
    cutoff: float,
    n_frames: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from kernels.density import triton as tri

    if xyz.shape[0] == 0:
        return torch.zeros_like(xyz), torch.zeros_like(b_iso), torch.zeros_like(occ)
    plan = tri._plan(_grid(tuple(cell), tuple(shape)), radius, cutoff, xyz.device)
    grad = grad.to(torch.float32).contiguous()
    return tri._backward(plan, grad, xyz, b_iso, occ, a, b, radii if radius is None else b_iso, n_frames)


@density_triton_backward.register_fake
def _(grad, xyz, b_iso, occ, a, b, radii, cell, shape, radius, cutoff, n_frames):
    return torch.empty_like(xyz), torch.empty_like(b_iso), torch.empty_like(occ)


def _triton_setup(ctx, inputs, output):
    xyz, b_iso, occ, a, b, cell, shape, radius, cutoff, n_frames = inputs
    ctx.save_for_backward(xyz, b_iso, occ, a, b, output[1])
    ctx.args = (cell, shape, radius, cutoff, n_frames)


def _triton_backward(ctx, grad, _grad_radii):
    xyz, b_iso, occ, a, b, radii = ctx.saved_tensors
    g = torch.ops.kernels.density_triton_backward(grad, xyz, b_iso, occ, a, b, radii, *ctx.args)
    return (*g, None, None, None, None, None, None, None)


density_triton.register_autograd(_triton_backward, setup_context=_triton_setup)


# --------------------------------------------------------------------------- cpu


@torch.library.custom_op("kernels::density_cpu", mutates_args=())
def density_cpu(
    xyz: torch.Tensor,
    b_iso: torch.Tensor,
    occ: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    cell: list[float],
    shape: list[int],
    radius: float | None,
    cutoff: float,
) -> torch.Tensor:
    from kernels.density.cpu import splat_cpu

    with torch.no_grad():
        return splat_cpu(_atoms(xyz, b_iso, occ, a, b), _grid(tuple(cell), tuple(shape)), radius=radius, cutoff=cutoff)


@density_cpu.register_fake
def _(xyz, b_iso, occ, a, b, cell, shape, radius, cutoff):
    return xyz.new_empty(tuple(shape), dtype=torch.float32)


def _autograd_dispatch_on():
    """Autograd recording inside an op's kernel, where the dispatcher has turned it off for the call.

    The CPU backward op differentiates ``splat_cpu`` through its own autograd Function; the keys the
    dispatcher excluded for the custom op's kernel are put back for that inner computation only.
    """
    keys = torch._C._dispatch_tls_local_exclude_set()
    for key in (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.ADInplaceOrView):
        keys = keys.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), keys)


@torch.library.custom_op("kernels::density_cpu_backward", mutates_args=())
def density_cpu_backward(
    grad: torch.Tensor,
    xyz: torch.Tensor,
    b_iso: torch.Tensor,
    occ: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    cell: list[float],
    shape: list[int],
    radius: float | None,
    cutoff: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from kernels.density.cpu import splat_cpu

    if xyz.shape[0] == 0:
        return torch.zeros_like(xyz), torch.zeros_like(b_iso), torch.zeros_like(occ)
    with _autograd_dispatch_on(), torch.enable_grad():
        leaves = [t.detach().requires_grad_(True) for t in (xyz, b_iso, occ)]
        out = splat_cpu(_atoms(*leaves, a, b), _grid(tuple(cell), tuple(shape)), radius=radius, cutoff=cutoff)
        g = torch.autograd.grad(out, leaves, grad)
    return tuple(t.detach() for t in g)


@density_cpu_backward.register_fake
def _(grad, xyz, b_iso, occ, a, b, cell, shape, radius, cutoff):
    return torch.empty_like(xyz), torch.empty_like(b_iso), torch.empty_like(occ)


def _cpu_setup(ctx, inputs, output):
    xyz, b_iso, occ, a, b, cell, shape, radius, cutoff = inputs
    ctx.save_for_backward(xyz, b_iso, occ, a, b)
    ctx.args = (cell, shape, radius, cutoff)


def _cpu_backward(ctx, grad):
    xyz, b_iso, occ, a, b = ctx.saved_tensors
    g = torch.ops.kernels.density_cpu_backward(grad, xyz, b_iso, occ, a, b, *ctx.args)
    return (*g, None, None, None, None, None, None)


density_cpu.register_autograd(_cpu_backward, setup_context=_cpu_setup)


# --------------------------------------------------------------------------- entry from splat_density


def splat_density_op(atoms: AtomSet, grid: GridSpec, backend: str, radius: float | None, cutoff: float) -> torch.Tensor:
    """:func:`kernels.splat_density` through the custom ops (what it runs while compiling).

    Parameters
    ----------
    atoms : AtomSet
        CUDA tensors for ``triton``, CPU tensors for ``cpu``.
    grid : GridSpec
        Whole-cell grid.
    backend : {"cpu", "triton"}
    radius : float or None
        Validated fixed radius in Å, or None for per-atom radii.
    cutoff : float
        Validated cutoff in e/Å³.

    Returns
    -------
    torch.Tensor, shape grid.shape, float32
        As the eager call; differentiable with respect to ``atoms.xyz``, ``atoms.b_iso``, ``atoms.occ``.
    """
    cell = list(grid.cell.parameters)
    shape = list(grid.shape)
    if backend == "triton":
        from kernels.density.triton import _as_kernel_input

        op = "splat_triton"
        xyz = atoms.xyz if atoms.xyz.dtype == torch.float64 else _as_kernel_input(atoms.xyz, op)
        args = [_as_kernel_input(t, op) for t in (atoms.b_iso, atoms.occ, atoms.a, atoms.b)]
        return torch.ops.kernels.density_triton(xyz.contiguous(), *args, cell, shape, radius, cutoff, 1)[0]
    if backend == "cpu":
        return torch.ops.kernels.density_cpu(
            atoms.xyz, atoms.b_iso, atoms.occ, atoms.a, atoms.b, cell, shape, radius, cutoff
        )
    raise ValueError(f"splat_density under torch.compile runs the 'cpu' and 'triton' backends, not {backend!r}")
