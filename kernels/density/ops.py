"""The density splat as ``torch.library`` custom ops, for ``torch.compile`` and graph tracing.

Each op is one :class:`kernels._opdef.OpDef` — launcher, backward and output shapes written once — from
which both the eager autograd Function and the custom ops are built: the Triton ops' definitions live
beside their launchers (``kernels.density.triton``, which registers them when imported), the CPU ops'
here. ``splat_density`` calls the ops only while ``torch.compiler.is_compiling()``: an eager call applies
the backend's autograd Function directly, because the dispatcher's Python kernels add host time to every
call. A compiled graph calls the ops at every run; :func:`kernels._opdef.register` keeps that cost to one
pass through the dispatcher per call.

Ops (namespace ``kernels``; each ``X`` has its backward ``X_backward(grad, *inputs, *saved, *params)``):

``density_triton(xyz, b_iso, occ, a, b, cell, shape, radius, cutoff, n_frames) -> (map, radii)``
    The Triton forward: the map (``shape``, or (n_frames, *shape)) and each atom's radius as the
    forward computed it ((N,) float32; (0,) with a fixed radius), saved for the backward.
``density_triton_aniso(xyz, u_aniso, aniso, b_iso, occ, a, b, cell, shape, radius, cutoff, n_frames, radius_rule, neutron) -> (map, radii)``
    The Triton anisotropic forward (anisotropic sets, and isotropic neutron sets with a zero ``u_aniso``
    and no atom flagged in ``aniso``, as ``triton._kernel_inputs_aniso`` gives them); radii as above.
``density_cpu(xyz, b_iso, occ, a, b, cell, shape, radius, cutoff) -> map``
    :func:`kernels.density.cpu.splat_cpu`. Its backward is the C++ backward alone, which solves for the
    row intervals the eager forward keeps (a host object no op output can carry), without running the
    forward again (``_splat_cpu(grad_of=)``).
``density_cpu_aniso(xyz, u_aniso, aniso, b_iso, occ, a, b, cell, shape, radius, cutoff, radiation, radius_rule) -> map``
    The same for anisotropic and neutron sets (``u_aniso``/``aniso`` None for an isotropic set).

``cell`` is the six cell parameters (Å, degrees) and ``shape`` the whole-cell grid's shape: plain
values a graph can hold, from which the ops rebuild the grid (:func:`grid_of`, cached).
"""

from __future__ import annotations

import torch

from kernels._opdef import OpDef, register
from kernels.crystal import AtomSet
from kernels.grid import GridSpec, grid_of

__all__ = ["splat_density_op"]


def _atoms(xyz, b_iso, occ, a, b, u_aniso=None, aniso=None, radiation="xray") -> AtomSet:
    return AtomSet(xyz, b_iso, occ, a, b, (), (), u_aniso, aniso, radiation=radiation, _validate=False)


def _no_u_grad(u_aniso, b_iso) -> torch.Tensor:
    """The U gradient output where there is none to give: (0,) for an isotropic set."""
    return torch.zeros_like(u_aniso) if u_aniso is not None else b_iso.new_zeros((0,))


# --------------------------------------------------------------------------- cpu
#
# The eager cpu backend keeps its own autograd Function (kernels.density.cpu): its forward hands the
# backward the row intervals it solved, a host object no op output can carry. The ops run the same C++
# forward and backward (the backward solves for those intervals again, bitwise the same).


def _cpu_call(inputs, params):
    cell, shape, radius, cutoff, *rest = params
    return (grid_of(cell, shape), radius, cutoff, *rest)


def _cpu_forward(call, xyz, b_iso, occ, a, b):
    from kernels.density.cpu import splat_cpu

    grid, radius, cutoff = call
    with torch.no_grad():
        return (splat_cpu(_atoms(xyz, b_iso, occ, a, b), grid, radius=radius, cutoff=cutoff),)


def _cpu_backward(call, grad, xyz, b_iso, occ, a, b):
    from kernels.density.cpu import _splat_cpu

    grid, radius, cutoff = call
    if xyz.shape[0] == 0:
        return torch.zeros_like(xyz), torch.zeros_like(b_iso), torch.zeros_like(occ)
    atoms = _atoms(*(t.detach() for t in (xyz, b_iso, occ)), a, b)
    g = _splat_cpu(atoms, grid, radius=radius, cutoff=cutoff, grad_of=grad)
    return tuple(t.to(v.dtype) for t, v in zip(g, (xyz, b_iso, occ)))


def _cpu_aniso_forward(call, xyz, u_aniso, aniso, b_iso, occ, a, b):
    from kernels.density.cpu import splat_cpu

    grid, radius, cutoff, radiation, radius_rule = call
    atoms = _atoms(xyz, b_iso, occ, a, b, u_aniso, aniso, radiation)
    with torch.no_grad():
        return (splat_cpu(atoms, grid, radius=radius, cutoff=cutoff, radius_rule=radius_rule),)


def _cpu_aniso_backward(call, grad, xyz, u_aniso, aniso, b_iso, occ, a, b):
    from kernels.density.cpu import _splat_cpu

    grid, radius, cutoff, radiation, radius_rule = call
    no_u = _no_u_grad(u_aniso, b_iso)
    if xyz.shape[0] == 0:
        return torch.zeros_like(xyz), no_u, torch.zeros_like(b_iso), torch.zeros_like(occ)
    atoms = _atoms(*(t.detach() for t in (xyz, b_iso, occ)), a, b, u_aniso, aniso, radiation)
    g = _splat_cpu(atoms, grid, radius=radius, cutoff=cutoff, radius_rule=radius_rule, grad_of=grad)
    g_xyz, g_b, g_occ = (t.to(v.dtype) for t, v in zip(g[:3], (xyz, b_iso, occ)))
    # The anisotropic kernel writes zero B gradients where atoms use U (their b_iso is not read).
    return g_xyz, no_u if u_aniso is None else g[3].to(u_aniso.dtype), g_b, g_occ


_CPU_INPUTS = ("Tensor xyz", "Tensor b_iso", "Tensor occ", "Tensor a", "Tensor b")
_CPU_PARAMS = ("float[] cell", "int[] shape", "float? radius", "float cutoff")

CPU_OP = OpDef(
    name="kernels::density_cpu",
    inputs=_CPU_INPUTS,
    params=_CPU_PARAMS,
    grads=(0, 1, 2),
    saved=0,
    call=_cpu_call,
    forward=_cpu_forward,
    backward=_cpu_backward,
    fake=lambda xyz, b_iso, occ, a, b, cell, shape, radius, cutoff: (xyz.new_empty(tuple(shape), dtype=torch.float32),),
)

CPU_ANISO_OP = OpDef(
    name="kernels::density_cpu_aniso",
    inputs=("Tensor xyz", "Tensor? u_aniso", "Tensor? aniso", *_CPU_INPUTS[1:]),
    params=(*_CPU_PARAMS, "str radiation", "str radius_rule"),
    grads=(0, 1, 3, 4),
    saved=0,
    call=_cpu_call,
    forward=_cpu_aniso_forward,
    backward=_cpu_aniso_backward,
    fake=lambda xyz, u, aniso, b_iso, occ, a, b, cell, shape, *_: (xyz.new_empty(tuple(shape), dtype=torch.float32),),
    fake_grads=lambda xyz, u, aniso, b_iso, occ, a, b, *_: (
        torch.empty_like(xyz),
        _no_u_grad(u, b_iso),
        torch.empty_like(b_iso),
        torch.empty_like(occ),
    ),
)

register(CPU_OP)
register(CPU_ANISO_OP)


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
    aniso = atoms.u_aniso is not None or atoms.radiation == "neutron"
    if backend == "triton":
        from kernels.density import triton as tri

        if aniso:
            neutron = atoms.radiation == "neutron"
            args = (cell, shape, radius, cutoff, 1, radius_rule, neutron)
            return torch.ops.kernels.density_triton_aniso(*tri._kernel_inputs_aniso(atoms), *args)[0]
        return torch.ops.kernels.density_triton(*tri._kernel_inputs(atoms), cell, shape, radius, cutoff, 1)[0]
    if backend == "cpu":
        if aniso:
            return torch.ops.kernels.density_cpu_aniso(
                atoms.xyz, atoms.u_aniso, atoms.aniso, atoms.b_iso, atoms.occ, atoms.a, atoms.b,
                cell, shape, radius, cutoff, atoms.radiation, radius_rule,
            )  # fmt: skip
        return torch.ops.kernels.density_cpu(
            atoms.xyz, atoms.b_iso, atoms.occ, atoms.a, atoms.b, cell, shape, radius, cutoff
        )
    raise ValueError(f"splat_density_op runs the 'cpu' and 'triton' backends, not {backend!r}")
