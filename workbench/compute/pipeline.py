"""Settings → everything the views draw: the memoised chain of stages and its :class:`Result`."""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

import kernels
from kernels import AtomSet, GridSpec, Model
from workbench.compute.atoms import load_model, model_atoms, prepare_atoms
from workbench.compute.errors import WorkbenchError, sentence
from workbench.compute.maps import (
    GradientResult,
    density_at_points,
    density_fit_gradient,
    density_map,
    find_planes,
    line_profile,
    map_statistics,
    planarity_gradient,
    tricubic_sampler,
)
from workbench.compute.sections import Section, atoms_near_section, central_depth, section, section_index
from workbench.state import Settings

__all__ = ["Pipeline", "Result"]


@dataclasses.dataclass(kw_only=True, eq=False)
class Result:
    """Everything the views draw for one :class:`Settings` snapshot.

    Tensors are on the CPU; ``rho`` is float32 or float64 (reference). ``unavailable``
    maps a feature name to why it could not be computed (a missing kernel, say): the
    views show that instead of a result. Built with keywords only (the fields are many
    and several share a type, so a positional call could swap two silently).

    Attributes
    ----------
    rho, target : torch.Tensor, shape grid.shape
        The model map and ρ_target, in ``settings.units`` (e/Å³; fm/Å³ for neutrons).
    atoms : kernels.AtomSet
        N atoms as splatted (ADP mode, radiation, B mode and distortion applied; the blur is the
        splat's), float64.
    mean, sigma : float
        Mean and standard deviation of ``rho``, in ``settings.units``.
    section : Section
        The section of ``rho`` at the settings' slice.
    near : tuple of (index (M,), uv (M, 2), distance (M,))
        :func:`~workbench.compute.atoms_near_section` of that section.
    gradient : GradientResult or None
    atom_rho, atom_target : numpy.ndarray, shape (N,), float64, or None
        Tricubic ρ and ρ_target at every atom.
    profile : (distance (n,), values (n,)) or None
        :func:`~workbench.compute.line_profile` between the settings' profile atoms.
    timings : dict of str to float
        Seconds per kernel stage.
    atoms_key, map_key : tuple
        Cache keys: equal keys mean equal atoms / an equal map. ``atoms_key`` is
        ``(model version, B key, distortion key, ADP/radiation key)``.
    """

    settings: Settings
    model: Model
    grid: GridSpec
    atoms: AtomSet
    rho: torch.Tensor
    backend: str
    mean: float
    sigma: float
    target: torch.Tensor
    target_source: str
    section: Section
    near: tuple[np.ndarray, np.ndarray, np.ndarray]
    gradient: GradientResult | None
    atom_rho: np.ndarray | None
    atom_target: np.ndarray | None
    profile: tuple[np.ndarray, np.ndarray] | None
    timings: dict[str, float]
    notes: list[str]
    unavailable: dict[str, str]
    planes: object = None
    atoms_key: tuple = ()
    map_key: tuple = ()

    @property
    def iso_level(self) -> float:
        """Isosurface level in e/Å³: mean + iso_sigma·σ of the whole-cell map."""
        return self.mean + self.settings.iso_sigma * self.sigma


class Pipeline:
    """Runs the computations for a :class:`Settings` snapshot, memoising every stage.

    Stages are keyed on exactly the settings they read, so a change recomputes only
    what depends on it. ``check`` is called between stages and raises :class:`Cancelled`
    to abandon work for settings that are already out of date.
    """

    def __init__(self, memory_models: dict[str, Model] | None = None, splat_cache: int = 6):
        self.memory_models = dict(memory_models or {})
        self._memo: dict[str, tuple[object, object]] = {}
        self._versions: collections.Counter = collections.Counter()
        self._splats: collections.OrderedDict = collections.OrderedDict()
        self._splat_cache = splat_cache

    def _stage(self, name: str, key, fn: Callable):
        hit = self._memo.get(name)
        if hit is not None and hit[0] == key:
            return hit[1]
        value = fn()
        self._memo[name] = (key, value)
        self._versions[name] += 1  # keys of later stages use this, never id() (ids are reused)
        return value

    def model(self, structure: str) -> Model:
        """The model of the ``structure`` setting (memoised)."""
        return self._stage("model", structure, lambda: load_model(self.memory_models.get(structure, structure)))

    def grid(self, model: Model, spacing: float) -> GridSpec:
        """The whole-cell grid for ``spacing`` (gemmi's sizing, compatible with the space group)."""
        try:
            return self._stage(
                "grid",
                (self._versions["model"], spacing),
                lambda: GridSpec.for_spacing(model.cell, spacing, model.spacegroup),
            )
        except kernels.GridError as exc:
            raise WorkbenchError(f"{exc}; choose another spacing") from exc

    def _splat(self, key, fn):
        if key in self._splats:
            self._splats.move_to_end(key)
            return self._splats[key]
        value = fn()
        self._splats[key] = value
        while len(self._splats) > self._splat_cache:
            self._splats.popitem(last=False)
        return value

    def clear(self) -> None:
        """Forget every memoised stage (the next run recomputes everything)."""
        self._memo.clear()
        self._splats.clear()

    def run(
        self,
        settings: Settings,
        *,
        check: Callable[[], None] = lambda: None,
        progress: Callable[[int, int, str], None] = lambda i, n, what: None,
        on_section: Callable[[Section, tuple, float, float], None] = lambda sec, near, mean, sigma: None,
    ) -> Result:
        """Compute every result for ``settings``; raise WorkbenchError or Cancelled.

        ``on_section(section, near, mean, sigma)`` is called as soon as the section exists,
        with the whole map's mean and σ (e/Å³, for σ contours), before the gradients and
        the tricubic samples: the slice view, what a drag watches, updates first.
        """
        total = 6
        notes: list[str] = []
        unavailable: dict[str, str] = {}
        timings: dict[str, float] = {}
        progress(0, total, f"reading {settings.structure}")
        model = self.model(settings.structure)
        notes.extend(model.notes)
        grid = self.grid(model, settings.spacing)
        check()

        mv = self._versions["model"]
        b_key = (
            settings.b_mode,
            settings.b_global if settings.b_mode == "global" else None,
            settings.b_offset if settings.b_mode == "offset" else None,
        )
        d_key = (settings.distort_amplitude, settings.distort_seed) if settings.distort_amplitude > 0 else None
        # ADP mode and radiation: which tensors and coefficients every later stage starts from
        a_key = (settings.adp if model.atoms.u_aniso is not None else "isotropic", settings.radiation)
        read = self._stage("model_atoms", (mv, a_key), lambda: model_atoms(model, settings.adp, settings.radiation))
        atoms = self._stage("atoms", (mv, a_key, b_key, d_key), lambda: prepare_atoms(model, settings, base=read))
        undistorted = self._stage(
            "atoms0", (mv, a_key, b_key), lambda: prepare_atoms(model, settings, distorted=False, base=read)
        )
        r_key = (settings.radius_arg, settings.density_cutoff if settings.radius_mode == "auto" else None)
        base = (mv, grid.shape, r_key, settings.device, settings.backend, a_key, b_key, settings.blur)

        progress(1, total, "splatting the model map")
        want_fit = settings.gradient_kind == "density"
        gradient = None
        if want_fit:
            target, target_source, target_key = self._target(grid, undistorted, settings, base)
            check()
            rho_key = ("fit", *base, d_key, target_key)
            gradient, rho = self._splat(rho_key, lambda: density_fit_gradient(atoms, grid, target, settings))
            backend = gradient.backend
            timings["density forward"] = gradient.forward_s
            timings["density backward"] = gradient.backward_s
        else:
            rho_key = ("rho", *base, d_key)
            rho, backend, seconds = self._splat(rho_key, lambda: density_map(atoms, grid, settings))
            timings["density forward"] = seconds
        check()

        progress(2, total, "map statistics and the section")
        mean, sigma, lo, hi = self._stage("stats", rho_key, lambda: map_statistics(rho))
        # The section is what a slider drag changes: cut it where the map lives (only the section crosses
        # to the host) and show it before the slower stages and before the whole map is copied.
        # The section is kept as a depth in Å, so a new grid cuts it at the same place.
        depth = settings.slice_depth
        if depth is None:
            depth = self._stage(
                "middle", (mv, settings.axis), lambda: central_depth(model.atoms.xyz, grid, settings.axis)
            )
        sec = section(rho, grid, settings.axis, section_index(grid, settings.axis, depth), (lo, hi))
        near = atoms_near_section(atoms.xyz, grid, sec)
        check()
        on_section(sec, near, mean, sigma)
        rho_cpu = self._stage("rho_cpu", rho_key, lambda: rho.detach().cpu())
        if not want_fit:
            target, target_source, target_key = self._target(grid, undistorted, settings, base)
        check()

        progress(3, total, "planarity")
        planes = None
        if not want_fit:
            try:
                planes = self._stage("planes", mv, lambda: find_planes(model))
                gradient = self._stage(
                    "planarity",
                    (mv, d_key, settings.device, settings.backend),
                    lambda: planarity_gradient(atoms.xyz, planes, settings),
                )
                timings["planarity forward"] = gradient.forward_s
                timings["planarity backward"] = gradient.backward_s
            except WorkbenchError as exc:
                unavailable["gradient"] = str(exc)
        check()

        progress(4, total, "density at the atoms (tricubic)")
        atom_rho = atom_target = profile = None
        try:
            start = time.perf_counter()
            atom_rho, atom_target = self._stage(
                "atom_rho",
                (rho_key, target_key),
                lambda: (
                    density_at_points(rho, grid, atoms.xyz, backend=settings.backend),
                    density_at_points(target.to(rho.device), grid, atoms.xyz, backend=settings.backend),
                ),
            )
            timings["tricubic at atoms"] = time.perf_counter() - start
            check()
            progress(5, total, "line profile (tricubic)")
            i, j = settings.profile_atoms
            n = len(model)
            if not (0 <= i < n and 0 <= j < n):
                raise WorkbenchError(f"profile atoms {i}, {j} outside [0, {n - 1}]: pick two atoms of this model")
            profile = self._stage(
                "profile",
                (rho_key, i, j),
                lambda: line_profile(rho, grid, atoms.xyz[i].numpy(), atoms.xyz[j].numpy(), backend=settings.backend),
            )
        except WorkbenchError as exc:
            unavailable["tricubic"] = str(exc)
        progress(6, total, "drawing")
        return Result(
            settings=settings,
            model=model,
            grid=grid,
            atoms=atoms,
            rho=rho_cpu,
            backend=backend,
            mean=mean,
            sigma=sigma,
            target=target.cpu(),
            target_source=target_source,
            section=sec,
            near=near,
            gradient=gradient,
            atom_rho=atom_rho,
            atom_target=atom_target,
            profile=profile,
            timings=timings,
            notes=notes,
            unavailable=unavailable,
            planes=planes,
            atoms_key=(mv, b_key, d_key, a_key),
            map_key=rho_key,
        )

    def _target(self, grid, undistorted, settings, base):
        """ρ_target, where it came from and its cache key: a loaded map or the undistorted model's map."""
        if settings.target_map:
            path = Path(settings.target_map).expanduser()
            mtime = path.stat().st_mtime if path.exists() else None
            key = ("map", str(path), mtime, grid.shape, settings.device)
            rho_t, source = self._stage("target_map", key, lambda: self._load_target(path, grid, settings.device))
            return rho_t, source, key
        key = ("rho", *base, None)
        rho0, _, _ = self._splat(key, lambda: density_map(undistorted, grid, settings))
        return rho0.detach(), "map of the undistorted model", key

    @staticmethod
    def _load_target(path: Path, grid: GridSpec, device: str):
        try:
            rho_t, tgrid = kernels.read_map(path)
        except ValueError as exc:
            raise WorkbenchError(
                f"target map: {sentence(exc)} Give a CCP4/MRC file, or clear the path to use the model"
            ) from exc
        if not np.allclose(tgrid.cell.parameters, grid.cell.parameters, rtol=1e-3):
            raise WorkbenchError(
                f"target map {path.name} has cell {tgrid.cell.parameters}, the model {grid.cell.parameters}: "
                "load a map of this crystal"
            )
        if tgrid.shape == grid.shape and tgrid.is_whole_cell:
            return rho_t.to(device), path.name
        # Resample onto the model grid (tricubic on the loaded map) so ½‖ρ − ρ_target‖² is per voxel.
        sample = tricubic_sampler()
        pts = grid.voxel_positions().reshape(-1, 3).to(rho_t.dtype)
        mode = "periodic" if tgrid.is_whole_cell else "bounded"
        vals = sample(rho_t, tgrid, pts, method="catmull-rom", mode=mode, fill_value=0.0)
        return vals.reshape(grid.shape).to(device), f"{path.name} (resampled from {tgrid.shape})"
