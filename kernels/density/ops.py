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
``density_triton_aniso(xyz, u_aniso, aniso, b_iso, occ, a, b, cell, shape, radius, cutoff, n_frames, radius_rule, neutron) -> (map, radii)``
    The Triton anisotropic forward (anisotropic sets, and isotropic neutron sets with a zero ``u_aniso``
    and no atom flagged in ``aniso``, as ``triton._kernel_inputs_aniso`` gives them); radii as for
    ``density_triton``.
``density_triton_aniso_backward(grad, xyz, u_aniso, aniso, b_iso, occ, a, b, radii, ...) -> (g_xyz, g_u_aniso, g_b_iso, g_occ)``
    Its backward, one launch.
``density_cpu(xyz, b_iso, occ, a, b, cell, shape, radius, cutoff) -> map``
    :func:`kernels.density.cpu.splat_cpu`, wrapped.
``density_cpu_backward(grad, xyz, b_iso, occ, a, b, cell, shape, radius, cutoff) -> (g_xyz, g_b_iso, g_occ)``
    The gradients of ``splat_cpu``: its C++ backward alone, which solves for the row intervals the
    eager forward would have kept (they cannot cross an op boundary), without running the forward
    again (``_splat_cpu(grad_of=)``).

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


def _atoms(xyz, b_iso, occ, a, b, u_aniso=None, aniso=None, radiation="xray") -> AtomSet:
    return AtomSet(xyz, b_iso, occ, a, b, (), (), u_aniso, aniso, radiation=radiation, _validate=False)


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
    out, radii = tri._forward(plan, xyz, b_iso, occ, a, b, n_frames, out_shape)
    # A fixed radius writes no radii (the kernel got b_iso as a placeholder): an op's outputs may not alias.
    return out, radii if radius is None else _no_radii(xyz, radius)


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


@torch.library.custom_op("kernels::density_triton_aniso", mutates_args=())
def density_triton_aniso(
    xyz: torch.Tensor,
    u_aniso: torch.Tensor,
    aniso: torch.Tensor,
    b_iso: torch.Tensor,
    occ: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    cell: list[float],
    shape: list[int],
    radius: float | None,
    cutoff: float,
    n_frames: int,
    radius_rule: str,
    neutron: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    from kernels.density import triton as tri

    plan = tri._plan(_grid(tuple(cell), tuple(shape)), radius, cutoff, xyz.device)
    out_shape = tuple(shape) if n_frames == 1 else (n_frames, *shape)
    if xyz.shape[0] == 0:
        return torch.zeros(out_shape, dtype=torch.float32, device=xyz.device), _no_radii(xyz, radius)
    rule = tri._aniso_rule(plan, radius_rule)
    out, radii = tri._forward_aniso(plan, xyz, u_aniso, aniso, b_iso, occ, a, b, n_frames, rule, neutron, out_shape)
    # A fixed radius writes no radii (the kernel got b_iso as a placeholder): an op's outputs may not alias.
    return out, radii if radius is None else _no_radii(xyz, radius)


@density_triton_aniso.register_fake
def _(xyz, u_aniso, aniso, b_iso, occ, a, b, cell, shape, radius, cutoff, n_frames, radius_rule, neutron):
    out_shape = tuple(shape) if n_frames == 1 else (n_frames, *shape)
    n = xyz.shape[0] if radius is None else 0
    return xyz.new_empty(out_shape, dtype=torch.float32), xyz.new_empty((n,), dtype=torch.float32)


@torch.library.custom_op("kernels::density_triton_aniso_backward", mutates_args=())
def density_triton_aniso_backward(
    grad: torch.Tensor,
    xyz: torch.Tensor,
    u_aniso: torch.Tensor,
    aniso: torch.Tensor,
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
    radius_rule: str,
    neutron: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from kernels.density import triton as tri

    if xyz.shape[0] == 0:
        return torch.zeros_like(xyz), torch.zeros_like(u_aniso), torch.zeros_like(b_iso), torch.zeros_like(occ)
    plan = tri._plan(_grid(tuple(cell), tuple(shape)), radius, cutoff, xyz.device)
    rule = tri._aniso_rule(plan, radius_rule)
    grad = grad.to(torch.float32).contiguous()
    g_xyz, g_u, g_b, g_occ = tri._backward_aniso(
        plan, grad, xyz, u_aniso, aniso, b_iso, occ, a, b, radii if rule else b_iso, n_frames, rule, neutron
    )
    return g_xyz, g_u, g_b, g_occ


def _no_u_grad(u_aniso, b_iso) -> torch.Tensor:
    """The U gradient output where there is none to give: zeros like ``u_aniso``, or (0,) for an isotropic set."""
    return torch.zeros_like(u_aniso) if u_aniso is not None else b_iso.new_zeros((0,))


@density_triton_aniso_backward.register_fake
def _(grad, xyz, u_aniso, aniso, b_iso, occ, a, b, radii, cell, shape, radius, cutoff, n_frames, radius_rule, neutron):
    return torch.empty_like(xyz), torch.empty_like(u_aniso), torch.empty_like(b_iso), torch.empty_like(occ)


def _triton_aniso_setup(ctx, inputs, output):
    xyz, u_aniso, aniso, b_iso, occ, a, b, *args = inputs
    ctx.save_for_backward(xyz, u_aniso, aniso, b_iso, occ, a, b, output[1])
    ctx.args = tuple(args)


def _triton_aniso_backward(ctx, grad, _grad_radii):
    xyz, u_aniso, aniso, b_iso, occ, a, b, radii = ctx.saved_tensors
    g_xyz, g_u, g_b, g_occ = torch.ops.kernels.density_triton_aniso_backward(
        grad, xyz, u_aniso, aniso, b_iso, occ, a, b, radii, *ctx.args
    )
    return (g_xyz, g_u, None, g_b, g_occ) + (None,) * 9


density_triton_aniso.register_autograd(_triton_aniso_backward, setup_context=_triton_aniso_setup)


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
    from kernels.density.cpu import _splat_cpu

    if xyz.shape[0] == 0:
        return torch.zeros_like(xyz), torch.zeros_like(b_iso), torch.zeros_like(occ)
    atoms = _atoms(*(t.detach() for t in (xyz, b_iso, occ)), a, b)
    g = _splat_cpu(atoms, _grid(tuple(cell), tuple(shape)), radius=radius, cutoff=cutoff, grad_of=grad)
    return tuple(t.to(v.dtype) for t, v in zip(g, (xyz, b_iso, occ)))


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


@torch.library.custom_op("kernels::density_cpu_aniso", mutates_args=())
def density_cpu_aniso(
    xyz: torch.Tensor,
    u_aniso: torch.Tensor | None,
    aniso: torch.Tensor | None,
    b_iso: torch.Tensor,
    occ: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    cell: list[float],
    shape: list[int],
    radius: float | None,
    cutoff: float,
    radiation: str,
    radius_rule: str,
) -> torch.Tensor:
    from kernels.density.cpu import splat_cpu

    atoms = _atoms(xyz, b_iso, occ, a, b, u_aniso, aniso, radiation)
    with torch.no_grad():
        return splat_cpu(atoms, _grid(tuple(cell), tuple(shape)), radius=radius, cutoff=cutoff, radius_rule=radius_rule)


@density_cpu_aniso.register_fake
def _(xyz, u_aniso, aniso, b_iso, occ, a, b, cell, shape, radius, cutoff, radiation, radius_rule):
    return xyz.new_empty(tuple(shape), dtype=torch.float32)


@torch.library.custom_op("kernels::density_cpu_aniso_backward", mutates_args=())
def density_cpu_aniso_backward(
    grad: torch.Tensor,
    xyz: torch.Tensor,
    u_aniso: torch.Tensor | None,
    aniso: torch.Tensor | None,
    b_iso: torch.Tensor,
    occ: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    cell: list[float],
    shape: list[int],
    radius: float | None,
    cutoff: float,
    radiation: str,
    radius_rule: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from kernels.density.cpu import _splat_cpu

    no_u = _no_u_grad(u_aniso, b_iso)
    if xyz.shape[0] == 0:
        return torch.zeros_like(xyz), no_u, torch.zeros_like(b_iso), torch.zeros_like(occ)
    atoms = _atoms(*(t.detach() for t in (xyz, b_iso, occ)), a, b, u_aniso, aniso, radiation)
    grid = _grid(tuple(cell), tuple(shape))
    g = _splat_cpu(atoms, grid, radius=radius, cutoff=cutoff, radius_rule=radius_rule, grad_of=grad)
    g_xyz, g_b, g_occ = (t.to(v.dtype) for t, v in zip(g[:3], (xyz, b_iso, occ)))
    # The anisotropic kernel writes zero B gradients where atoms use U (their b_iso is not read).
    return g_xyz, no_u if u_aniso is None else g[3].to(u_aniso.dtype), g_b, g_occ


@density_cpu_aniso_backward.register_fake
def _(grad, xyz, u_aniso, aniso, b_iso, occ, a, b, cell, shape, radius, cutoff, radiation, radius_rule):
    return torch.empty_like(xyz), _no_u_grad(u_aniso, b_iso), torch.empty_like(b_iso), torch.empty_like(occ)


def _cpu_aniso_setup(ctx, inputs, output):
    xyz, u_aniso, aniso, b_iso, occ, a, b, *args = inputs
    ctx.save_for_backward(xyz, u_aniso, aniso, b_iso, occ, a, b)
    ctx.args = tuple(args)


def _cpu_aniso_backward(ctx, grad):
    xyz, u_aniso, aniso, b_iso, occ, a, b = ctx.saved_tensors
    g_xyz, g_u, g_b, g_occ = torch.ops.kernels.density_cpu_aniso_backward(
        grad, xyz, u_aniso, aniso, b_iso, occ, a, b, *ctx.args
    )
    return (g_xyz, g_u if u_aniso is not None else None, None, g_b, g_occ) + (None,) * 8


density_cpu_aniso.register_autograd(_cpu_aniso_backward, setup_context=_cpu_aniso_setup)


# --------------------------------------------------------------------------- entry from splat_density


def splat_density_op(
    atoms: AtomSet, grid: GridSpec, backend: str, radius: float | None, cutoff: float, radius_rule: str = "gemmi"
) -> torch.Tensor:
    """:func:`kernels.splat_density` through the custom ops (what it runs while compiling).

    Parameters
    ----------
    atoms : AtomSet
        CUDA tensors for ``triton``, CPU tensors for ``cpu``. Anisotropic and neutron sets take the
        ``…_aniso`` ops, which carry ``u_aniso``/``aniso`` (None for an isotropic set) and the radiation.
    grid : GridSpec
        Whole-cell grid.
    backend : {"cpu", "triton"}
    radius : float or None
        Validated fixed radius in Å, or None for per-atom radii.
    cutoff : float
        Validated cutoff in e/Å³.
    radius_rule : {"gemmi", "eigen"}
        Per-atom radius rule of anisotropic atoms.

    Returns
    -------
    torch.Tensor, shape grid.shape, float32
        As the eager call; differentiable with respect to ``atoms.xyz``, ``atoms.b_iso``, ``atoms.occ``
        and ``atoms.u_aniso``.
    """
    cell = list(grid.cell.parameters)
    shape = list(grid.shape)
    if atoms.u_aniso is not None or atoms.radiation == "neutron":
        return _splat_aniso_op(atoms, backend, cell, shape, radius, cutoff, radius_rule)
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


def _splat_aniso_op(atoms: AtomSet, backend: str, cell, shape, radius, cutoff, radius_rule: str) -> torch.Tensor:
    """:func:`splat_density_op` for anisotropic and neutron sets."""
    if backend == "triton":
        from kernels.density.triton import _kernel_inputs_aniso

        xyz, u, aniso, b_iso, occ, a, b = _kernel_inputs_aniso(atoms)
        neutron = atoms.radiation == "neutron"
        args = (cell, shape, radius, cutoff, 1, radius_rule, neutron)
        return torch.ops.kernels.density_triton_aniso(xyz, u, aniso, b_iso, occ, a, b, *args)[0]
    if backend == "cpu":
        return torch.ops.kernels.density_cpu_aniso(
            atoms.xyz, atoms.u_aniso, atoms.aniso, atoms.b_iso, atoms.occ, atoms.a, atoms.b,
            cell, shape, radius, cutoff, atoms.radiation, radius_rule,
        )  # fmt: skip
    raise ValueError(f"splat_density under torch.compile runs the 'cpu' and 'triton' backends, not {backend!r}")
