"""The fit loop behind the workbench's "relax" control: a state → one step, no widgets.

The loss is ``benchmarks/bench_loop.py``'s (issue 33):

    L(x) = V·Σ_voxels (ρ_calc(x) − ρ_target)² + λ·NLL_planarity(x)

with V the voxel volume, ρ_calc the splat of the atoms at positions x (the workbench's radius,
cutoff, blur, device and backend), ρ_target the map the density-fit arrows use (a loaded map,
or the map of the undistorted model) and the planarity NLL of the model's planes. One step
evaluates both terms and their gradients separately (so each can be drawn and timed), adds them
as ∇L = ∇fit + λ·∇NLL, and lets Adam move x by about ``lr`` Å.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable

import torch

import kernels
from kernels import AtomSet, GridSpec
from workbench.compute.errors import WorkbenchError, sentence
from workbench.compute.maps import (
    GradientResult,
    _compute_atoms,
    _sync,
    density_at_points,
    line_profile,
    map_statistics,
)
from workbench.compute.pipeline import Result
from workbench.compute.sections import atoms_near_section, section
from workbench.state import Settings, density_units, op_backend

__all__ = [
    "AGREEMENT_D_MIN",
    "AdamUpdate",
    "FactorReference",
    "RELAX_RANGES",
    "RelaxFrame",
    "RelaxProblem",
    "Relaxation",
    "factor_agreement",
    "factor_reference",
    "frame_result",
    "relax_problem",
    "rmsd",
    "run_relaxation",
]

#: name -> (min, max, default) of the relax control's settings: steps, Adam's lr (Å), λ.
RELAX_RANGES: dict[str, tuple[float, float, float]] = {
    "steps": (1, 10000, 50),
    "lr": (0.001, 0.5, 0.05),
    # λ 0 by default: the workbench's target is the map of the undistorted model itself, so the
    # density alone points at the answer (notebook 07 compares λ 0, 0.01 and 0.1: 0 fits best).
    "lam": (0.0, 100.0, 0.0),
}


#: Resolution limit (Å) of the relax view's R-factor and correlation (or the finest the grid holds,
#: if coarser): a refinement's usual limit, where the factors still say where the atoms are.
AGREEMENT_D_MIN = 2.0


@dataclasses.dataclass(frozen=True, eq=False)
class FactorReference:
    """The factors a relax run's frames are compared with: those of ρ_target (the undistorted model's
    map, or a loaded map), to ``d_min``, in P 1 (the map of the model's own atoms).

    Attributes
    ----------
    factors : kernels.StructureFactors
        M reflections, on the compute device.
    d_min : float
        Å.
    blur : float
        Å², removed from both sets (the splat's blur).
    """

    factors: object
    d_min: float
    blur: float


def factor_reference(target: torch.Tensor, grid: GridSpec, *, blur: float = 0.0) -> FactorReference:
    """The structure factors of ``target`` (grid.shape, any device) to :data:`AGREEMENT_D_MIN` or the
    finest ``grid`` holds, made once per run (:func:`kernels.structure_factors`)."""
    from kernels.reciprocal import finest_d_min

    d_min = max(AGREEMENT_D_MIN, finest_d_min(grid))
    return FactorReference(kernels.structure_factors(target.detach(), grid, d_min, blur=blur), d_min, float(blur))


def factor_agreement(rho: torch.Tensor, grid: GridSpec, reference: FactorReference) -> tuple[float, float]:
    """R-factor Σ||F| − |F_ref|| / Σ|F_ref| (no scale) and the correlation of |F| with |F_ref| over
    every reflection of ``reference``, for the map ``rho`` (grid.shape, on the reference's device):
    one FFT and one shell of :func:`kernels.shells`."""
    f = kernels.structure_factors(rho.detach(), grid, reference.d_min, blur=reference.blur)
    table = kernels.shells(f, reference.factors, n_shells=1)
    return float(table.r_factor[0]), float(table.correlation[0])


def rmsd(xyz: torch.Tensor, reference: torch.Tensor) -> float:
    """Root-mean-square distance (Å) between positions ``xyz`` and ``reference``, both (N, 3)."""
    d = (xyz.detach().double().cpu() - reference.detach().double().cpu()).pow(2).sum(dim=-1)
    return float(d.mean().sqrt())


@dataclasses.dataclass(eq=False)
class RelaxProblem:
    """What the loop fits: start atoms, grid, target map and planes, all on the compute device.

    Attributes
    ----------
    atoms : kernels.AtomSet
        N atoms at the start positions, on ``device`` in the density backend's dtype (float64 for
        ``reference``, else float32).
    grid : kernels.GridSpec
    target : torch.Tensor, shape grid.shape
        ρ_target on ``device`` in ``atoms.dtype``.
    planes : kernels.PlaneSet
        The model's planar groups on ``device``.
    reference : torch.Tensor or None, shape (N, 3)
        Positions the RMSD is measured against (the model as read), CPU.
    radius, cutoff, blur : float or None
        :func:`kernels.splat_density`'s arguments (the workbench's settings).
    density_backend, planarity_backend : str
        Resolved backend names.
    device : torch.device
    """

    atoms: AtomSet
    grid: GridSpec
    target: torch.Tensor
    planes: object
    reference: torch.Tensor | None
    radius: float | None
    cutoff: float
    blur: float
    density_backend: str
    planarity_backend: str
    device: torch.device


def relax_problem(
    atoms: AtomSet,
    grid: GridSpec,
    target: torch.Tensor,
    planes,
    settings: Settings,
    *,
    reference: torch.Tensor | None = None,
) -> RelaxProblem:
    """A :class:`RelaxProblem` on the device and backend of ``settings``.

    Parameters
    ----------
    atoms : kernels.AtomSet
        Start (N atoms, any device and dtype), e.g. the workbench's distorted atoms.
    grid : kernels.GridSpec
    target : torch.Tensor, shape grid.shape
        ρ_target (e.g. :attr:`workbench.compute.Result.target`).
    planes : kernels.PlaneSet
        :func:`workbench.compute.find_planes` of the model.
    settings : Settings
        Device, backend, radius mode and radius, cutoff and blur of the splat.
    reference : torch.Tensor, optional, shape (N, 3)
        Positions to measure the RMSD against.

    Raises
    ------
    WorkbenchError
        The backend cannot run here, or ``target`` is not on ``grid`` or holds a non-finite voxel.
    """
    if tuple(target.shape) != tuple(grid.shape):
        raise WorkbenchError(f"ρ_target has shape {tuple(target.shape)}, the grid {tuple(grid.shape)}: recompute first")
    bad = ~torch.isfinite(target.detach())
    if bool(bad.any()):  # every step's loss would be NaN, whatever the step size: name the map, once, here
        first = tuple(int(i) for i in bad.nonzero()[0].tolist())
        raise WorkbenchError(
            f"ρ_target holds {int(bad.sum())} non-finite voxels (NaN or ±inf; the first at voxel {first}), so the "
            "fit's loss cannot be computed whatever the step size: recompute the target, or fix the map it was read from"
        )
    device = torch.device(settings.device)
    name, catoms = _compute_atoms(atoms, device, settings.backend, "density")
    try:
        p_name = kernels.resolve_backend("planarity", device, op_backend("planarity", settings.backend))
    except kernels.BackendError as exc:
        raise WorkbenchError(f"planarity backend on {device}: {sentence(exc)} Choose backend 'auto'.") from exc
    return RelaxProblem(
        atoms=catoms,
        grid=grid,
        target=target.detach().to(device, catoms.dtype),
        planes=planes.to(device),
        reference=None if reference is None else reference.detach().double().cpu(),
        radius=settings.radius_arg,
        cutoff=settings.density_cutoff,
        blur=settings.blur,
        density_backend=name,
        planarity_backend=p_name,
        device=device,
    )


class AdamUpdate:
    """Adam on one tensor, in place: the update of :class:`torch.optim.Adam` with its defaults
    (β = 0.9, 0.999, ε = 1e-8, no weight decay, no AMSGrad) and its CPU order of operations, so both
    give the same bits (tests/workbench/test_relax.py compares them), without torch.optim's import
    of torch._dynamo.

    Parameters
    ----------
    param : torch.Tensor
        The leaf tensor moved (any shape, float32 or float64).
    lr : float
        Step size.
    """

    def __init__(self, param: torch.Tensor, *, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        self.param, self.lr, self.betas, self.eps = param, float(lr), betas, float(eps)
        self.exp_avg = torch.zeros_like(param, memory_format=torch.preserve_format).detach()
        self.exp_avg_sq = torch.zeros_like(param, memory_format=torch.preserve_format).detach()
        # torch.optim.Adam counts steps in a float32 tensor and reads it back as a Python float
        self.n = torch.tensor(0.0, dtype=torch.float32)

    @torch.no_grad()
    def step(self, grad: torch.Tensor) -> None:
        """Move ``param`` by one Adam step along ``grad`` (its shape)."""
        beta1, beta2 = self.betas
        self.n += 1
        n = self.n.item()
        self.exp_avg.lerp_(grad, 1 - beta1)
        self.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step_size = self.lr / (1 - beta1**n)
        denom = (self.exp_avg_sq.sqrt() / (1 - beta2**n) ** 0.5).add_(self.eps)
        self.param.addcdiv_(self.exp_avg, denom, value=-step_size)


@dataclasses.dataclass(frozen=True, eq=False)
class RelaxFrame:
    """The loop's state at the start of one step: positions, their map, both gradients, the losses.

    Everything describes the positions ``xyz`` (the map, the gradients and the losses are theirs);
    the step's update then moved the atoms on.

    Attributes
    ----------
    step : int
        0-based index of the step.
    xyz : torch.Tensor, shape (N, 3), float64, CPU
    rho : torch.Tensor, shape grid.shape
        ρ_calc(xyz), detached, on the compute device.
    loss, fit, planarity : float
        L, V·Σ(ρ − ρ_target)² and the planarity NLL (L = fit + λ·planarity).
    rmsd : float or None
        Å to the problem's reference positions.
    density_gradient, planarity_gradient : GradientResult
        Per-atom gradients for the arrows: of ½‖ρ − ρ_target‖² (the workbench's density-fit arrows,
        = ∇fit / 2V) and of the NLL.
    timings : dict of str to float
        Seconds: ``splat forward+backward``, ``planarity forward+backward``, ``update`` (Adam) and
        ``step`` (all three, with building the atoms).
    """

    step: int
    xyz: torch.Tensor
    rho: torch.Tensor
    loss: float
    fit: float
    planarity: float
    rmsd: float | None
    density_gradient: GradientResult
    planarity_gradient: GradientResult
    timings: dict[str, float]


class Relaxation:
    """Adam over the positions of a :class:`RelaxProblem`; :meth:`step` runs one step.

    Parameters
    ----------
    problem : RelaxProblem
    lr : float
        Adam's step size, Å (its largest move per coordinate and step is about ``lr``).
    lam : float
        λ ≥ 0, the weight of the planarity NLL.

    Raises
    ------
    ValueError
        ``lr`` or ``lam`` outside :data:`RELAX_RANGES`.
    """

    def __init__(self, problem: RelaxProblem, *, lr: float = 0.05, lam: float = 0.0):
        for name, value in (("lr", lr), ("lam", lam)):
            lo, hi, _ = RELAX_RANGES[name]
            if isinstance(value, bool) or not (isinstance(value, (int, float)) and math.isfinite(value)):
                raise ValueError(f"relax {name} must be a number in [{lo:g}, {hi:g}], got {value!r}")
            if not lo <= value <= hi:
                raise ValueError(f"relax {name} must lie in [{lo:g}, {hi:g}], got {value!r}")
        self.problem = problem
        self.lr, self.lam = float(lr), float(lam)
        self.x = problem.atoms.xyz.detach().clone().requires_grad_(True)
        # On a GPU with the Triton backends the whole step is one replayed CUDA graph (kernels.fitting.Step),
        # which returns each term and its gradient; elsewhere the terms are evaluated and timed one by one,
        # and Adam is AdamUpdate: torch.optim.Adam's first construction imports torch._dynamo (3-7 s of
        # one core on a 2-core machine), which would hold the first frame of the first run.
        self._step = None
        self.optimizer = None
        if problem.device.type == "cuda" and (problem.density_backend, problem.planarity_backend) == (
            "triton",
            "triton",
        ):
            self.optimizer = torch.optim.Adam([self.x], lr=self.lr)
            self._step = self._replayed_step()
        else:
            self._adam = AdamUpdate(self.x, lr=self.lr)
        self.n_steps = 0

    @property
    def xyz(self) -> torch.Tensor:
        """The current positions (after the last update), (N, 3) float64 CPU."""
        return self.x.detach().double().cpu()

    def _replayed_step(self):
        from kernels.fitting import Step

        p, x = self.problem, self.x

        def loss_fn():
            rho = kernels.splat_density(
                p.atoms.replace(xyz=x), p.grid, radius=p.radius, cutoff=p.cutoff, backend=p.density_backend, blur=p.blur
            )
            fit = ((rho - p.target) ** 2).sum() * p.grid.voxel_volume
            nll = kernels.planarity_nll(x, p.planes, backend=p.planarity_backend)
            return {"fit": fit, "planarity": nll}, {"rho": rho}

        return Step(loss_fn, [x], self.optimizer, term_grads=True, weights={"planarity": self.lam})

    def _advance(self) -> tuple:
        """The whole work of one step, and all of it: evaluate both terms and their gradients at the
        current positions, then move them (Adam). Everything else (:meth:`step`) only reads its results.

        Returns ``(xyz, rho, fit, nll, g_fit, g_nll, seconds)``: the positions evaluated (float64 CPU,
        before the update), ρ_calc there, the two loss terms and their gradients (tensors on the device),
        and the perf-counter times at the start, after the density term, after the planarity term and
        after the update (the middle two None when the step is one replayed CUDA graph, whose terms are
        not timed apart). The device is idle when it returns: no work of this step is left queued.
        """
        p, x = self.problem, self.x
        if self._step is not None:
            xyz = x.detach().double().cpu()  # the positions this frame describes, before the update
            t0 = time.perf_counter()
            r = self._step()  # the graph's outputs: copied, as the next replay overwrites them
            out = (r.aux["rho"].clone(), r.terms["fit"].clone(), r.terms["planarity"].clone())
            g_fit, g_nll = r.grads["fit"][0].clone(), r.grads["planarity"][0].clone()
            _sync(p.device)
            t3 = time.perf_counter()
            return (xyz, *out, g_fit, g_nll, (t0, None, None, t3))
        _sync(p.device)
        t0 = time.perf_counter()
        moved = p.atoms.replace(xyz=x)  # a few µs: no value read, labels shared
        rho = kernels.splat_density(
            moved, p.grid, radius=p.radius, cutoff=p.cutoff, backend=p.density_backend, blur=p.blur
        )
        fit = ((rho - p.target) ** 2).sum() * p.grid.voxel_volume
        (g_fit,) = torch.autograd.grad(fit, x)
        _sync(p.device)
        t1 = time.perf_counter()
        nll = kernels.planarity_nll(x, p.planes, backend=p.planarity_backend)
        (g_nll,) = torch.autograd.grad(nll, x)
        _sync(p.device)
        t2 = time.perf_counter()
        xyz = x.detach().double().cpu()  # the positions this frame describes, before the update
        self._adam.step(g_fit + self.lam * g_nll)
        _sync(p.device)
        t3 = time.perf_counter()
        return xyz, rho, fit, nll, g_fit, g_nll, (t0, t1, t2, t3)

    def step(self) -> RelaxFrame:
        """Evaluate L and ∇L at the current positions, update them, and return the frame of those positions."""
        p = self.problem
        volume = p.grid.voxel_volume
        xyz, rho, fit, nll, g_fit, g_nll, (t0, t1, t2, t3) = self._advance()
        fit_v, nll_v = float(fit.detach()), float(nll.detach())
        units = density_units(p.atoms.radiation)
        replayed = t1 is None  # one CUDA graph: the terms are not timed apart
        common = dict(backend=p.density_backend, forward_s=0.0 if replayed else t1 - t0, backward_s=0.0)
        frame = RelaxFrame(
            step=self.n_steps,
            xyz=xyz,
            rho=rho.detach(),
            loss=fit_v + self.lam * nll_v,
            fit=fit_v,
            planarity=nll_v,
            rmsd=None if p.reference is None else rmsd(xyz, p.reference),
            density_gradient=GradientResult(
                kind="density",
                loss=fit_v / (2 * volume),
                grad=(g_fit / (2 * volume)).detach().to("cpu", torch.float64).numpy(),
                units=f"({units})²/Å",
                **common,
            ),
            planarity_gradient=GradientResult(
                kind="planarity",
                loss=nll_v,
                grad=g_nll.detach().to("cpu", torch.float64).numpy(),
                units="1/Å",
                backend=p.planarity_backend,
                forward_s=0.0 if replayed else t2 - t1,
                backward_s=0.0,
            ),
            timings=(
                {"step: splat, planarity and Adam replayed as one CUDA graph": t3 - t0, "step": t3 - t0}
                if replayed
                else {
                    "splat forward+backward": t1 - t0,
                    "planarity forward+backward": t2 - t1,
                    "update": t3 - t2,
                    "step": t3 - t0,
                }
            ),
        )
        self.n_steps += 1
        return frame


def run_relaxation(
    relaxation: Relaxation, n_steps: int, *, stop: threading.Event, emit: Callable[[RelaxFrame], None]
) -> int:
    """Run up to ``n_steps`` steps, handing each frame to ``emit``; return the frames handed on.

    ``stop`` is read before each step and after it: a stop set while ``emit`` handles a frame ends
    the run at that frame, and one set during a step ends it at the frame before, the step's own
    frame not handed on. So the run ends at the frame the views show when the loop receives the stop
    (drawn already: nothing new to draw), at most one step later, and no step starts after it.
    ``emit`` may block: the workbench's returns once the views show the frame, so the loop is never
    more than one step ahead of what a person sees.
    """
    done = 0
    for _ in range(int(n_steps)):
        if stop.is_set():
            break
        frame = relaxation.step()
        if stop.is_set():
            break
        done += 1
        if not math.isfinite(frame.loss):
            raise WorkbenchError(f"the fit diverged at step {frame.step} (loss {frame.loss}): lower the step size")
        emit(frame)
    return done


def frame_result(result: Result, frame: RelaxFrame, *, key: tuple) -> Result:
    """What the views draw for ``frame`` of a run started from ``result``: ``result`` with the frame's
    positions, map (its statistics, and the same section index cut from it), timings and the gradient of
    the settings' ``gradient_kind``; ``key`` (run, step) makes its ``atoms_key`` and ``map_key`` unique.

    Every value derived from the positions or the map is the frame's: ρ and ρ_target at the atoms
    (tricubic, the atom table and the picked atom's label) and the line profile between the profile
    atoms where they are now. A value that cannot be computed for the frame is dropped, never kept
    from ``result`` (the views then say it is unavailable).
    """
    s = result.settings
    rho = frame.rho.cpu()
    mean, sigma, lo, hi = map_statistics(rho)
    sec = section(rho, result.grid, s.axis, result.section.index, (lo, hi))
    unavailable = dict(result.unavailable)
    atom_rho = atom_target = profile = None
    if result.atom_rho is not None:  # the settings' result sampled them: the frame samples its own
        try:
            atom_rho = density_at_points(rho, result.grid, frame.xyz, backend=s.backend)
            atom_target = density_at_points(result.target, result.grid, frame.xyz, backend=s.backend)
            if result.profile is not None:
                i, j = s.profile_atoms
                profile = line_profile(rho, result.grid, frame.xyz[i].numpy(), frame.xyz[j].numpy(), backend=s.backend)
        except WorkbenchError as exc:
            atom_rho = atom_target = profile = None
            unavailable["tricubic"] = str(exc)
    return dataclasses.replace(
        result,
        atoms=result.atoms.replace(xyz=frame.xyz),
        rho=rho,
        mean=mean,
        sigma=sigma,
        section=sec,
        near=atoms_near_section(frame.xyz, result.grid, sec),
        gradient=frame.density_gradient if s.gradient_kind == "density" else frame.planarity_gradient,
        atom_rho=atom_rho,
        atom_target=atom_target,
        profile=profile,
        unavailable=unavailable,
        timings=frame.timings,
        atoms_key=(*result.atoms_key, "relax", *key),
        map_key=("relax", *key),
    )
