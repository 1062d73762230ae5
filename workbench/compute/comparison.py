"""Backend against backend: the same splat and gradient as two ``device:backend`` runs, and how they differ."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch

from kernels import AtomSet, GridSpec
from workbench.compute.errors import WorkbenchError
from workbench.compute.maps import density_fit_gradient, density_map, planarity_gradient
from workbench.compute.render import AtomMarks
from workbench.compute.scene import RegionVolume, region_volume
from workbench.compute.sections import Section, central_depth, section, section_index
from workbench.state import EXAMPLES, Settings, registered_density_backends

__all__ = [
    "Comparison",
    "DifferenceResult",
    "compare_arrays",
    "compare_backends",
    "comparison_inputs",
    "difference_section",
    "inputs_label",
    "over_marks",
    "over_tolerance",
    "over_uv",
    "over_volume",
]


@dataclasses.dataclass
class Comparison:
    """How far ``out`` is from ``ref`` under docs/kernels.md's float32 contract.

    ``tolerance`` per element is ``1e-5·max|ref| + 1e-5·|ref|``.
    """

    max_abs: float
    max_ref: float
    rel_l2: float
    n_over: int
    n_total: int

    @property
    def ok(self) -> bool:
        return self.n_over == 0


def over_tolerance(out, ref) -> torch.Tensor:
    """Elements of ``out`` outside the float32 contract around ``ref`` (bool, CPU, their shape);
    a non-finite element of ``out`` is always outside."""
    o = torch.as_tensor(out).detach().to("cpu", torch.float64)
    r = torch.as_tensor(ref).detach().to("cpu", torch.float64)
    max_ref = float(r.abs().max()) if r.numel() else 0.0
    return ~((o - r).abs() <= 1e-5 * max_ref + 1e-5 * r.abs())


def over_uv(over: torch.Tensor, sec: Section) -> np.ndarray:
    """Where the voxels of ``over`` (grid-shaped bool) on section ``sec`` lie, Å in the section frame.

    Returns
    -------
    numpy.ndarray, shape (M, 2), float64
    """
    plane = over.select(sec.axis, sec.index).numpy()
    p, q = np.nonzero(plane)
    pts = np.stack([p, q, np.ones_like(p)]).astype(np.float64)
    return (sec.voxel_affine @ pts)[:2].T


def over_marks(diff: DifferenceResult, size: float = 6.0, colour: str = "#000000") -> AtomMarks:
    """Marks of the over-tolerance voxels on ``diff.section`` for the slice view (dots of ``size`` points²)."""
    uv = over_uv(diff.over, diff.section)
    return AtomMarks(
        uv=uv, sizes=np.full(len(uv), size), colours=[colour] * len(uv), noun="voxel", where="over tolerance here"
    )


def over_volume(diff: DifferenceResult, padding: float = 3.0) -> RegionVolume:
    """The over-tolerance voxels as a 0/1 map box around the atoms (CCP4 bytes) for the 3D view's isosurface at 0.5."""
    return region_volume(diff.over.to(torch.float32), diff.grid, diff.xyz, padding, clip=False)


def compare_arrays(out, ref) -> Comparison:
    """Max |out − ref|, relative L2 ‖out − ref‖/‖ref‖ and the elements over tolerance.

    ``out`` and ``ref`` are tensors or arrays of one shape, any dtype and device; the
    comparison runs in float64 on the CPU.
    """
    o = torch.as_tensor(out).detach().to("cpu", torch.float64)
    r = torch.as_tensor(ref).detach().to("cpu", torch.float64)
    if o.shape != r.shape:
        raise WorkbenchError(f"cannot compare shapes {tuple(o.shape)} and {tuple(r.shape)}")
    diff = (o - r).abs()
    max_ref = float(r.abs().max()) if r.numel() else 0.0
    norm = float(torch.linalg.norm(r))
    over = diff > 1e-5 * max_ref + 1e-5 * r.abs()
    return Comparison(
        max_abs=float(diff.max()) if diff.numel() else 0.0,
        max_ref=max_ref,
        rel_l2=float(torch.linalg.norm(o - r)) / norm if norm > 0 else float(torch.linalg.norm(o - r)),
        n_over=int(over.sum()),
        n_total=diff.numel(),
    )


@dataclasses.dataclass(eq=False)
class DifferenceResult:
    """Two ``device:backend`` runs on the same inputs and how they differ.

    Attributes
    ----------
    a, b : str
        The two ``device:backend`` pairs; ``b`` is the reference of the comparisons.
    map_a, map_b : torch.Tensor, shape grid.shape, CPU
        The two maps, each in its backend's dtype.
    maps, gradients : Comparison
        ``gradients`` is None when no gradient was compared (``gradient_note`` says why).
    gradient_kind, gradient_note : str
    section : Section
        The section of ``map_a − map_b`` (float32) at the settings' slice.
    over : torch.Tensor, shape grid.shape, bool, CPU
        Voxels of ``map_a`` outside the float32 contract around ``map_b``.
    xyz : torch.Tensor, shape (N, 3), float64, CPU
        The atom positions both runs splatted.
    inputs : tuple
        :func:`comparison_inputs` of the settings compared: a result for other inputs
        is not this comparison's (the app then drops it).
    label : str
        :func:`inputs_label` of those settings ("1ORC at 0.667 Å").
    grid : kernels.GridSpec
    units : str
        The maps' unit (e/Å³; fm/Å³ for neutrons).
    """

    inputs: tuple
    label: str
    grid: GridSpec
    a: str
    b: str
    map_a: torch.Tensor
    map_b: torch.Tensor
    maps: Comparison
    gradients: Comparison | None
    gradient_kind: str
    gradient_note: str
    section: Section
    over: torch.Tensor
    xyz: torch.Tensor
    units: str = "e/Å³"


def comparison_inputs(settings: Settings) -> tuple:
    """The settings a comparison depends on, as a key: equal keys, equal maps and gradients.

    Only what reaches the two runs' inputs counts (structure, ADPs, radiation, blur, B, radius, grid, distortion,
    gradient and its target); the main view's own device/backend, the slice, the 3D view
    and the table do not.
    """
    s = settings
    return (
        s.structure,
        s.adp,
        s.radiation,
        s.blur,
        s.b_mode,
        s.b_global if s.b_mode == "global" else None,
        s.b_offset if s.b_mode == "offset" else None,
        s.radius_arg,
        s.density_cutoff if s.radius_mode == "auto" else None,
        s.spacing,
        (s.distort_amplitude, s.distort_seed) if s.distort_amplitude > 0 else None,
        s.gradient_kind,
        s.target_map if s.gradient_kind == "density" else "",
    )


def inputs_label(settings: Settings) -> str:
    """A short name of what was computed: "1ORC at 0.667 Å" (plus B, radius or distortion when not the default)."""
    s = settings
    name = s.structure.upper() if s.structure in EXAMPLES else s.structure.rsplit("/", 1)[-1]
    if name.startswith("<memory:"):
        name = name[len("<memory:") : -1]
    parts = [f"{name} at {s.spacing:g} Å"]
    if s.radiation != "xray":
        parts.append(s.radiation)
    if s.adp == "isotropic":
        parts.append("isotropic ADPs")
    if s.b_mode == "global":
        parts.append(f"B {s.b_global:g} Å²")
    elif s.b_mode == "offset":
        parts.append(f"B + {s.b_offset:g} Å²")
    if s.blur:
        parts.append(f"blur {s.blur:g} Å²")
    if s.radius_mode == "radius":
        parts.append(f"radius {s.radius:g} Å")
    if s.distort_amplitude > 0:
        parts.append(f"distorted {s.distort_amplitude:g} Å (seed {s.distort_seed})")
    return ", ".join(parts)


def difference_section(diff: torch.Tensor, grid: GridSpec, axis: int, index: int) -> Section:
    """The section ``index`` ⊥ ``axis`` of a difference map, with its own range as the map range."""
    return section(diff, grid, axis, index, (float(diff.min()), float(diff.max())))


def _split(pair: str) -> tuple[str, str]:
    device, _, backend = pair.partition(":")
    return device, backend


def compare_backends(
    a: str,
    b: str,
    atoms: AtomSet,
    grid: GridSpec,
    settings: Settings,
    *,
    target: torch.Tensor | None = None,
    planes=None,
    check: Callable[[], None] = lambda: None,
    index: int | None = None,
) -> DifferenceResult:
    """Run the same splat (and gradient) as ``device:backend`` pairs ``a`` and ``b``; compare.

    ``target`` is ρ_target of the density-fit gradient; ``planes`` the planes of the
    planarity gradient. The section is of ``map_a − map_b`` at section ``index`` ⊥ the
    settings' axis (default: the settings' depth, or the middle of the atoms).
    When a float32 backend takes part, both runs get the atoms rounded to float32 first
    (the same input values, as the kernel tests compare them): otherwise the rounding
    of 40 Å coordinates alone (~2e-6 Å) moves a planarity gradient of d/σ² by ~5e-3,
    far above the float32 contract, and the view would blame the kernel for its input.
    """
    pairs = [_split(p) for p in (a, b)]
    registered = registered_density_backends()
    no_planarity = [p for p, (_, backend) in zip((a, b), pairs) if backend in registered]
    if planes and settings.gradient_kind != "density" and no_planarity:
        planes = None
        note = f"no gradient compared: {', '.join(no_planarity)} is a density backend; choose gradient 'density'"
    else:
        note = "no gradient compared (planarity unavailable)"
    if any(backend != "reference" for _, backend in pairs):
        atoms = atoms.to(dtype=torch.float32).to(dtype=torch.float64)
        target = target.float().double() if target is not None else None
    runs = []
    for device, backend in pairs:
        if settings.gradient_kind == "density" and target is not None:
            g, rho = density_fit_gradient(atoms, grid, target, settings, backend=backend, device=device)
        else:
            rho, _, _ = density_map(atoms, grid, settings, backend=backend, device=device)
            g = planarity_gradient(atoms.xyz, planes, settings, backend=backend, device=device) if planes else None
        runs.append((rho.detach().cpu(), g))
        check()
    (ra, ga), (rb, gb) = runs
    maps = compare_arrays(ra, rb)
    grads = compare_arrays(ga.grad, gb.grad) if ga is not None and gb is not None else None
    note = "" if grads is not None else note
    diff = (ra.double() - rb.double()).float()
    if index is None:
        depth = settings.slice_depth
        index = section_index(
            grid, settings.axis, central_depth(atoms.xyz, grid, settings.axis) if depth is None else depth
        )
    sec = difference_section(diff, grid, settings.axis, index)
    return DifferenceResult(
        inputs=comparison_inputs(settings),
        label=inputs_label(settings),
        grid=grid,
        a=a,
        b=b,
        map_a=ra,
        map_b=rb,
        maps=maps,
        gradients=grads,
        gradient_kind=ga.kind if ga else "",
        gradient_note=note,
        section=sec,
        over=over_tolerance(ra, rb),
        xyz=atoms.xyz.detach().to("cpu", torch.float64),
        units=settings.units,
    )
