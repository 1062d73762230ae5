"""Atoms → maps and gradients: the splat, the two losses, tricubic samples, map statistics, timings.

Every function here runs one kernel call (or a few) for a settings snapshot and says
which backend ran and how long it took; :class:`workbench.compute.Pipeline` chains them.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

import numpy as np
import torch

import kernels
from kernels import AtomSet, GridSpec, Model
from workbench.compute.errors import WorkbenchError, sentence
from workbench.state import Settings, density_units, op_backend

__all__ = [
    "GradientResult",
    "atom_table_order",
    "density_at_points",
    "density_fit_gradient",
    "density_map",
    "find_planes",
    "line_profile",
    "map_statistics",
    "planarity_gradient",
    "time_backends",
    "tricubic_sampler",
]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable, device: torch.device):
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - start


def _compute_atoms(atoms: AtomSet, device: str, backend: str, op: str) -> tuple[str, AtomSet]:
    try:
        name = kernels.resolve_backend(op, device, backend)
    except kernels.BackendError as exc:
        raise WorkbenchError(f"{op} backend {backend!r} on {device}: {sentence(exc)} Choose backend 'auto'.") from exc
    dtype = torch.float64 if name == "reference" else torch.float32
    return name, atoms.to(device, dtype)


def _with_xyz(atoms: AtomSet, xyz: torch.Tensor) -> AtomSet:
    return AtomSet(
        xyz, atoms.b_iso, atoms.occ, atoms.a, atoms.b, atoms.elements, atoms.labels, atoms.u_aniso, atoms.aniso,
        radiation=atoms.radiation, _validate=False,
    )  # fmt: skip


def _splat(atoms: AtomSet, grid: GridSpec, settings: Settings, backend: str) -> torch.Tensor:
    return kernels.splat_density(
        atoms, grid, radius=settings.radius_arg, cutoff=settings.density_cutoff, backend=backend, blur=settings.blur
    )


def density_map(atoms: AtomSet, grid: GridSpec, settings: Settings, *, backend: str | None = None, device=None):
    """Splat ``atoms`` with the settings' radius rule and blur on ``device`` with ``backend``.

    Anisotropic atoms (``atoms.u_aniso``) are splatted with their U; the map is in
    :func:`~workbench.state.density_units` of ``atoms.radiation`` (fm/Å³ for neutrons).

    Returns
    -------
    rho : torch.Tensor, shape grid.shape
        float64 (reference) or float32, on the compute device.
    name : str
        The backend that ran.
    seconds : float
        Wall time of the splat (device synchronised).
    """
    device = torch.device(device or settings.device)
    name, catoms = _compute_atoms(atoms, device, backend or settings.backend, "density")
    try:
        rho, seconds = _timed(lambda: _splat(catoms, grid, settings, name), device)
    except kernels.GridError as exc:
        raise WorkbenchError(f"{exc}") from exc
    return rho, name, seconds


@dataclasses.dataclass(eq=False)
class GradientResult:
    """A loss and its gradient with respect to every atom position.

    Attributes
    ----------
    kind : str
        ``"planarity"`` or ``"density"``.
    loss : float
    grad : numpy.ndarray, shape (N, 3), float64
        ∂loss/∂xyz per atom (zero for atoms the loss does not involve).
    units : str
    backend : str
    forward_s, backward_s : float
    """

    kind: str
    loss: float
    grad: np.ndarray
    units: str
    backend: str
    forward_s: float
    backward_s: float


def density_fit_gradient(
    atoms: AtomSet, grid: GridSpec, target: torch.Tensor, settings: Settings, *, backend=None, device=None
) -> tuple[GradientResult, torch.Tensor]:
    """½‖ρ_model(xyz) − ρ_target‖² summed over voxels, and its gradient w.r.t. xyz.

    Returns the :class:`GradientResult` and the model map (same as :func:`density_map`).
    """
    device = torch.device(device or settings.device)
    name, catoms = _compute_atoms(atoms, device, backend or settings.backend, "density")
    xyz = catoms.xyz.detach().clone().requires_grad_(True)
    leaf = _with_xyz(catoms, xyz)
    tgt = target.to(device=device, dtype=catoms.dtype)
    rho, fwd = _timed(lambda: _splat(leaf, grid, settings, name), device)

    def backward():
        loss = 0.5 * ((rho - tgt) ** 2).sum()
        loss.backward()
        return loss

    loss, bwd = _timed(backward, device)
    grad = xyz.grad.detach().to("cpu", torch.float64).numpy()
    result = GradientResult(
        kind="density",
        loss=float(loss.detach()),
        grad=grad,
        units=f"({density_units(atoms.radiation)})²/Å",
        backend=name,
        forward_s=fwd,
        backward_s=bwd,
    )
    return result, rho.detach()


def find_planes(model: Model):
    """The model's planar groups (:func:`kernels.find_planes`); raises WorkbenchError if unavailable."""
    try:
        from kernels import find_planes as _find
    except ImportError as exc:
        raise WorkbenchError("planarity is unavailable: kernels.find_planes is not in this install yet") from exc
    return _find(model, sigma=0.02)


def planarity_gradient(xyz: torch.Tensor, planes, settings: Settings, *, backend=None, device=None) -> GradientResult:
    """Planarity NLL of positions ``xyz`` (N, 3) Å and its gradient (:func:`kernels.planarity_nll`)."""
    try:
        from kernels import planarity_nll
    except ImportError as exc:
        raise WorkbenchError("planarity is unavailable: kernels.planarity_nll is not in this install yet") from exc
    device = torch.device(device or settings.device)
    try:
        name = kernels.resolve_backend("planarity", device, op_backend("planarity", backend or settings.backend))
    except kernels.BackendError as exc:
        raise WorkbenchError(f"planarity backend on {device}: {sentence(exc)} Choose backend 'auto'.") from exc
    dtype = torch.float64 if name == "reference" else torch.float32
    x = xyz.detach().to(device, dtype).clone().requires_grad_(True)
    p = planes.to(device) if hasattr(planes, "to") else planes
    nll, fwd = _timed(lambda: planarity_nll(x, p, backend=name), device)
    _, bwd = _timed(lambda: nll.backward(), device)
    grad = x.grad.detach().to("cpu", torch.float64).numpy()
    return GradientResult(
        kind="planarity",
        loss=float(nll.detach()),
        grad=grad,
        units="1/Å",
        backend=name,
        forward_s=fwd,
        backward_s=bwd,
    )


def tricubic_sampler():
    """:func:`kernels.tricubic_sample`; raises WorkbenchError if this install lacks it."""
    try:
        from kernels import tricubic_sample
    except ImportError as exc:
        raise WorkbenchError(
            "tricubic sampling is unavailable: kernels.tricubic_sample is not in this install yet"
        ) from exc
    return tricubic_sample


def density_at_points(rho: torch.Tensor, grid: GridSpec, points: torch.Tensor, *, backend: str = "auto") -> np.ndarray:
    """Tricubic (Catmull-Rom, periodic) density at Cartesian ``points`` (..., 3) Å, as float64 numpy."""
    sample = tricubic_sampler()
    pts = points.to(device=rho.device, dtype=rho.dtype)
    try:
        name = kernels.resolve_backend("tricubic", rho.device, op_backend("tricubic", backend))
    except kernels.BackendError:
        name = "auto"  # the splat backend need not exist for tricubic (e.g. none yet): let dispatch pick
    out = sample(rho, grid, pts, method="catmull-rom", mode="periodic", backend=name)
    return out.detach().to("cpu", torch.float64).numpy()


def atom_table_order(
    rho: np.ndarray, target: np.ndarray, *, sort: str, ascending: bool
) -> tuple[np.ndarray, np.ndarray]:
    """The target/model ratio per atom, and the atoms in table order.

    Parameters
    ----------
    rho, target : array-like, shape (N,)
        ρ model and ρ target at each atom, e/Å³.
    sort : str
        One of :data:`workbench.state.TABLE_SORTS`: atom index, ρ model, ρ target, ratio.
    ascending : bool

    Returns
    -------
    ratio : numpy.ndarray, shape (N,), float64
        ``target / rho``; NaN where |ρ| ≤ 1e-12 (no density to compare with).
    order : numpy.ndarray, shape (N,), int64
        Atom indices sorted by ``sort`` (stable: ties keep index order); NaN ratios go
        last when ascending and first when descending.
    """
    rho = np.asarray(rho, float)
    target = np.asarray(target, float)
    ratio = np.divide(target, rho, out=np.full_like(rho, np.nan), where=np.abs(rho) > 1e-12)
    key = {"index": np.arange(len(rho)), "rho": rho, "target": target, "ratio": ratio}[sort]
    order = np.argsort(np.where(np.isnan(key), np.inf, key), kind="stable")
    if not ascending:
        order = order[::-1]
    return ratio, order


def line_profile(
    rho: torch.Tensor, grid: GridSpec, start, end, *, n: int = 121, backend: str = "auto"
) -> tuple[np.ndarray, np.ndarray]:
    """Density along the segment start → end (Å), ``n`` tricubic samples.

    Returns
    -------
    distance : numpy.ndarray, shape (n,), Å from ``start``
    values : numpy.ndarray, shape (n,), e/Å³
    """
    p0 = torch.as_tensor(np.asarray(start, dtype=np.float64))
    p1 = torch.as_tensor(np.asarray(end, dtype=np.float64))
    t = torch.linspace(0.0, 1.0, n, dtype=torch.float64)
    points = p0 + t[:, None] * (p1 - p0)
    values = density_at_points(rho, grid, points, backend=backend)
    return (t * torch.linalg.norm(p1 - p0)).numpy(), values


def map_statistics(rho: torch.Tensor) -> tuple[float, float, float, float]:
    """Mean, standard deviation, minimum and maximum of ``rho`` in e/Å³.

    On the CPU the reductions run in numpy, single-threaded: torch's parallel
    reductions wait on each other's threads when the cores are busy with other work
    (the splat's OpenMP threads, another notebook), which costs far more than one thread
    needs for a whole-cell map. On a GPU they stay there (one transfer of four numbers).
    """
    r = rho.detach()
    if r.device.type == "cpu":
        x = r.numpy()
        return float(x.mean(dtype=np.float64)), float(x.std(dtype=np.float64)), float(x.min()), float(x.max())
    stats = torch.stack([r.mean(), r.double().std().to(r.dtype), r.min(), r.max()]).tolist()
    return tuple(float(v) for v in stats)


def time_backends(
    atoms: AtomSet,
    grid: GridSpec,
    settings: Settings,
    *,
    target: torch.Tensor,
    planes=None,
    repeats: int = 2,
    check: Callable[[], None] = lambda: None,
) -> list[dict]:
    """Forward and backward times of every backend that can run here, best of ``repeats``.

    Returns rows ``{"device", "backend", "op", "forward_ms", "backward_ms", "error"}``:
    ``density`` is the splat and the backward of ½‖ρ − ρ_target‖²; ``planarity`` the NLL
    and its backward. A backend that fails gets its error instead of times.
    """
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    rows = []
    for device in devices:
        for op in ("density", "planarity"):
            if op == "planarity" and planes is None:
                continue
            for backend in kernels.available_backends(op, device):
                if backend == "triton" and device == "cpu":
                    # Without a GPU, "triton" on CPU tensors is the Triton interpreter:
                    # seconds per call and no measure of the kernel. Say so, do not time it.
                    why = "runs in the Triton interpreter here (no GPU): not timed"
                    rows.append(dict(device=device, backend=backend, op=op, forward_ms=None, backward_ms=None,
                                     error=why))  # fmt: skip
                    continue
                fwd, bwd, err = math.inf, math.inf, ""
                for _ in range(repeats):
                    try:
                        if op == "density":
                            g, _ = density_fit_gradient(atoms, grid, target, settings, backend=backend, device=device)
                        else:
                            g = planarity_gradient(atoms.xyz, planes, settings, backend=backend, device=device)
                    except (WorkbenchError, RuntimeError, ValueError) as exc:
                        err = str(exc)
                        break
                    fwd, bwd = min(fwd, g.forward_s), min(bwd, g.backward_s)
                    check()
                rows.append(
                    {
                        "device": device,
                        "backend": backend,
                        "op": op,
                        "forward_ms": None if err else fwd * 1e3,
                        "backward_ms": None if err else bwd * 1e3,
                        "error": err,
                    }
                )
    return rows
