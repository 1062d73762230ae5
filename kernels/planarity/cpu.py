"""CPU planarity NLL: C++ plane fit with a closed-form 3×3 eigen-solver, analytic backward.

``plane_fit.cpp`` fits every plane in one pass (weighted centroid, covariance, the normal
of its smallest eigenvalue in closed form) and scatters the analytic gradient. In torch,
a batched ``torch.linalg.eigh``, or a batched closed form (about 100 small ops plus an
``index_add_``), costs milliseconds per call on a few thousand planes, bound by per-op
overhead; one C++ loop over the planes takes a small fraction of that.
"""

from __future__ import annotations

import torch

from kernels._opdef import OpDef, eager_function, register
from kernels._util import Handles, assume_constant_result, to_float32
from kernels.planarity import _plane_fit
from kernels.planarity.planes import PlaneSet, check_inputs, live_plane_set

__all__ = ["planarity_nll_cpu", "fit_table", "scatter_table"]


def fit_table(xyz: torch.Tensor, planes: PlaneSet) -> tuple[torch.Tensor, torch.Tensor]:
    """Fit every plane: ``(loss, table)``, the table holding w·d per slot (P·K) then the normals (P·3).

    ``xyz`` is (N, 3), float32 or float64, C-contiguous, on the CPU; both outputs have its dtype.
    """
    p, k = planes.index.shape
    table = torch.empty(p * k + p * 3, dtype=xyz.dtype)
    coef, normal = table[: p * k].view(p, k), table[p * k :].view(p, 3)
    data = _plane_fit.fit(xyz.detach(), planes.index, planes.weight(xyz.dtype), coef, normal)
    return torch.tensor(data + planes.constant, dtype=xyz.dtype), table


def scatter_table(table: torch.Tensor, grad_out: torch.Tensor, planes: PlaneSet) -> torch.Tensor:
    """∂NLL/∂xyz, shape (N, 3), from :func:`fit_table`'s table, scaled by ``grad_out``."""
    p, k = planes.index.shape
    # ∂NLL/∂x_a = (d_a/σ_a²)·n: exact because the weighted fit makes the terms through
    # the centroid and the normal vanish (docs/kernels.md).
    grad = torch.empty((planes.n_atoms, 3), dtype=table.dtype)  # zero-filled by scatter
    _plane_fit.scatter(planes.index, table[: p * k].view(p, k), table[p * k :].view(p, 3), grad, float(grad_out))
    return grad


# --------------------------------------------------------------------------- the op, defined once
#
# The call state is the PlaneSet. Eager calls apply the autograd Function built from PLANARITY_CPU_OP
# with it; compiled calls run the custom op ``kernels::planarity_cpu(xyz, planes)``, ``planes`` the
# handle of the PlaneSet (``_HANDLES``, made from its token while dynamo traces the call).

_HANDLES = Handles()  # handle -> PlaneSet


@assume_constant_result
def _handle(token: str, device: str) -> int:
    """The handle of the PlaneSet ``token`` (``device`` is always the CPU: the PlaneSet itself serves)."""
    return _HANDLES.get(token, lambda: live_plane_set(token))


def _fake(xyz, handle):
    p, k = _HANDLES[handle].index.shape
    return xyz.new_empty(()), xyz.new_empty((p * k + p * 3,))


PLANARITY_CPU_OP = OpDef(
    name="kernels::planarity_cpu",
    inputs=("Tensor xyz",),
    params=("int planes",),
    grads=(0,),
    saved=1,
    call=lambda inputs, params: _HANDLES[params[0]],
    forward=lambda planes, xyz: fit_table(xyz, planes),
    backward=lambda planes, grad, xyz, table: (scatter_table(table, grad, planes),),
    fake=_fake,
)
_PlanarityCPU = eager_function(PLANARITY_CPU_OP)
register(PLANARITY_CPU_OP)


def planarity_nll_cpu(xyz: torch.Tensor, planes: PlaneSet) -> torch.Tensor:
    """Planarity NLL on the CPU in float32 or float64, with the analytic backward.

    Parameters
    ----------
    xyz : torch.Tensor, shape (N, 3), float32 or float64, CPU
        Atom positions in Å (other floating dtypes are cast to float32, with a warning once).
        Each plane is fitted in double precision either way; results are stored in the
        input's dtype.
    planes : PlaneSet
        Planes whose indices point into ``xyz``.

    Returns
    -------
    torch.Tensor, shape (), dtype of the computation
        The NLL (see :func:`kernels.planarity_nll`); degenerate or non-finite planes add
        only their constant and get zero gradient.
    """
    check_inputs(xyz, planes)
    if xyz.device.type != "cpu":
        raise ValueError(f"planarity_nll_cpu needs CPU tensors, got {xyz.device}; use .cpu() or backend='auto'")
    if xyz.dtype != torch.float64:
        xyz = to_float32(xyz, "planarity_nll")
    if len(planes) == 0:
        return (xyz * 0.0).sum() + planes.constant
    xyz = xyz.contiguous()
    if torch.compiler.is_compiling():
        return torch.ops.kernels.planarity_cpu(xyz, _handle(planes._token, "cpu"))[0]
    if not (xyz.requires_grad and torch.is_grad_enabled()):  # no autograd node
        return fit_table(xyz, planes)[0]
    return _PlanarityCPU.apply(planes, xyz)
