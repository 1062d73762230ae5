"""The density splat as ``torch.library`` custom ops, for ``torch.compile`` and graph tracing.

Each op is one :class:`kernels._opdef.OpDef` — launcher, backward and output shapes written once — from
which both the eager autograd Function and the custom ops are built. The definitions live beside their
launchers (``kernels.density.triton`` and ``kernels.density.cpu``, which register them when imported);
this module is the entry that calls them. ``splat_density`` calls the ops only while ``torch.compiler.is_compiling()``: an eager call applies
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
``density_cpu(xyz, b_iso, occ, a, b, cell, shape, radius, cutoff, radiation, radius_rule) -> map``
    :func:`kernels.density.cpu.splat_cpu` of an isotropic set (any radiation). Its backward is the C++
    backward alone, which solves for the row intervals an eager forward keeps in its call state (no op
    output can carry that host object), bitwise the same.
``density_cpu_aniso(xyz, u_aniso, aniso, b_iso, occ, a, b, cell, shape, radius, cutoff, radiation, radius_rule) -> map``
    The same for anisotropic sets.

``cell`` is the six cell parameters (Å, degrees) and ``shape`` the whole-cell grid's shape: plain
values a graph can hold, from which the ops rebuild the grid (:func:`grid_of`, cached).
"""

from __future__ import annotations

import torch

from kernels._util import assume_constant_result
from kernels.crystal import AtomSet
from kernels.grid import GridSpec, grid_of

__all__ = ["splat_density_op"]


# --------------------------------------------------------------------------- entry from splat_density


@assume_constant_result
def _plan_now(cell: tuple, shape: tuple, radius: float | None, cutoff: float, device: str) -> bool:
    """Make the Triton plan of this grid (its constants, on the device) while dynamo traces the call.

    The ops look their plan up at every run. Made at the first run instead, inside a CUDA graph's warm-up
    (``mode="reduce-overhead"``), its device tensor would land in the graph's private pool and outlive the
    graph's outputs, which torch refuses ("tensor(s) in the cudagraph pool not tracked as outputs").
    """
    from kernels.density import triton as tri

    tri._plan(grid_of(list(cell), list(shape)), radius, cutoff, torch.device(device))
    return True


def splat_density_op(
    atoms: AtomSet, grid: GridSpec, backend: str, radius: float | None, cutoff: float, radius_rule: str = "gemmi"
) -> torch.Tensor:
    """:func:`kernels.splat_density` through the custom ops (what it runs while compiling).

    Parameters
    ----------
    atoms : AtomSet
        CUDA tensors for ``triton``, CPU tensors for ``cpu``. Anisotropic sets take the ``…_aniso`` ops;
        so do isotropic neutron sets on ``triton`` (``u_aniso``/``aniso`` zero there).
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

        _plan_now(tuple(cell), tuple(shape), radius, cutoff, str(atoms.device))
        if aniso:
            neutron = atoms.radiation == "neutron"
            args = (cell, shape, radius, cutoff, 1, radius_rule, neutron)
            return torch.ops.kernels.density_triton_aniso(*tri._kernel_inputs_aniso(atoms), *args)[0]
        return torch.ops.kernels.density_triton(*tri._kernel_inputs(atoms), cell, shape, radius, cutoff, 1)[0]
    if backend == "cpu":
        from kernels.density import cpu  # noqa: F401 (registers the cpu ops)

        args = (cell, shape, radius, cutoff, atoms.radiation, radius_rule)
        if atoms.u_aniso is not None:
            u = (atoms.u_aniso, atoms.aniso)
            return torch.ops.kernels.density_cpu_aniso(atoms.xyz, *u, atoms.b_iso, atoms.occ, atoms.a, atoms.b, *args)
        return torch.ops.kernels.density_cpu(atoms.xyz, atoms.b_iso, atoms.occ, atoms.a, atoms.b, *args)
    raise ValueError(f"splat_density_op runs the 'cpu' and 'triton' backends, not {backend!r}")
