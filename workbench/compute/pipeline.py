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
from workbench.compute.atoms import distortion, load_model, model_atoms, prepare_atoms
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

__all__ = ["APPLIES", "STAGES", "Pipeline", "Result", "Stage"]


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
        Cache keys (:meth:`Pipeline.key`): equal keys mean equal atoms / an equal map. ``atoms_key``
        is ``(model version, key of the undistorted atoms, key of the positions, key of the model's
        atoms)``: its first item changes with the model, its third with the positions.
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


@dataclasses.dataclass(frozen=True)
class Stage:
    """One memoised step of the :class:`Pipeline`: what it reads, and so its cache key.

    Attributes
    ----------
    fields : tuple of str
        The :class:`~workbench.state.Settings` fields the step reads.
    after : tuple of str
        The stages whose results it takes (``"rho"`` and ``"target"`` name whichever stage
        gives the map and ρ_target under the settings: see :meth:`Pipeline.resolve`).
    file : str or None
        A field naming a file the step reads; the file's modification time joins the key.
    """

    fields: tuple[str, ...] = ()
    after: tuple[str, ...] = ()
    file: str | None = None


# What a density splat reads (workbench.compute.density_map and density_fit_gradient).
_SPLAT_FIELDS = ("radius_mode", "radius", "density_cutoff", "device", "backend", "blur")

#: Every stage and what it reads: the one declaration the cache keys are made from. A stage's key
#: is its name, the values of its fields and the keys of the stages it comes after, so equal keys
#: mean equal results, and changing a field recomputes exactly the stages that read it (directly
#: or through ``after``). The model is the exception: it is identified by its load, as a file read
#: again may have changed.
STAGES: dict[str, Stage] = {
    "model": Stage(("structure",)),
    "grid": Stage(("spacing",), ("model",)),
    # the model's tensors with the ADP mode and radiation's form factors
    "model_atoms": Stage(("adp", "radiation"), ("model",)),
    # the model's positions, randomly displaced
    "positions": Stage(("distort_amplitude", "distort_seed"), ("model",)),
    # the atoms with the B settings, at the model's positions (ρ_target is their map)
    "undistorted": Stage(("b_mode", "b_global", "b_offset"), ("model_atoms",)),
    "atoms": Stage((), ("undistorted", "positions")),
    # the model map (a splat), or the map and its ½‖ρ − ρ_target‖² gradient: "rho" is one of them
    "map": Stage(_SPLAT_FIELDS, ("atoms", "grid")),
    "fit": Stage(_SPLAT_FIELDS, ("atoms", "grid", "target")),
    # ρ_target from a map file ("target" is this, or "map" of the undistorted atoms)
    "target_map": Stage(("target_map", "device"), ("grid",), file="target_map"),
    "stats": Stage((), ("rho",)),
    "rho_cpu": Stage((), ("rho",)),
    # the depth of the model's middle along the slice axis (from its atoms and cell)
    "middle": Stage(("slice_axis",), ("model",)),
    "planes": Stage((), ("model",)),
    "planarity": Stage(("device", "backend"), ("positions", "planes")),
    "atom_rho": Stage(("backend",), ("rho", "target", "positions")),
    "profile": Stage(("profile_atoms", "backend"), ("rho", "positions")),
}

#: A field whose value cannot change any result under the other settings (and the model) counts as
#: None in the keys, so changing it recomputes nothing: the B of the modes that do not use it, the
#: radius rule not chosen, the seed of no displacement, the ADP mode of a model without ANISOU.
APPLIES: dict[str, Callable[[Settings, Model], bool]] = {
    "adp": lambda s, model: model.atoms.u_aniso is not None,
    "b_global": lambda s, model: s.b_mode == "global",
    "b_offset": lambda s, model: s.b_mode == "offset",
    "radius": lambda s, model: s.radius_mode == "radius",
    "density_cutoff": lambda s, model: s.radius_mode == "auto",
    "distort_seed": lambda s, model: s.distort_amplitude > 0,
}

# The stages whose results are maps: kept in a small LRU cache (a slider moved back finds its map).
_MAPS = ("map", "fit")


class Pipeline:
    """Runs the computations for a :class:`Settings` snapshot, memoising every stage.

    Stages are keyed on exactly the settings they read (:data:`STAGES`), so a change recomputes
    only what depends on it. The section and the atoms near it are cut on every run (what a
    drag changes; cheap). ``check`` is called between stages and raises :class:`Cancelled` to
    abandon work for settings that are already out of date.
    """

    def __init__(self, memory_models: dict[str, Model] | None = None, splat_cache: int = 6):
        self.memory_models = dict(memory_models or {})
        self._memo: dict[str, tuple[object, object]] = {}
        self._versions: collections.Counter = collections.Counter()
        self._splats: collections.OrderedDict = collections.OrderedDict()
        self._splat_cache = splat_cache
        #: The stages the last :meth:`run` computed, in order (the others came from the caches).
        self.computed: list[str] = []

    @staticmethod
    def resolve(name: str, settings: Settings) -> tuple[str, Settings]:
        """The stage ``name`` stands for under ``settings``, and the settings it runs with.

        ``"rho"`` is ``"fit"`` when the gradient is the density fit's, else ``"map"``; ``"target"``
        is ``"target_map"`` when a map file is given, else ``"map"`` of the undistorted atoms.
        """
        if name == "rho":
            return ("fit" if settings.gradient_kind == "density" else "map"), settings
        if name == "target":
            if settings.target_map:
                return "target_map", settings
            return "map", dataclasses.replace(settings, distort_amplitude=0.0)
        return name, settings

    def key(self, name: str, settings: Settings, model: Model) -> tuple:
        """The cache key of stage ``name`` under ``settings`` (for ``model``, the loaded one), from :data:`STAGES`."""
        name, settings = self.resolve(name, settings)
        if name == "model":
            return ("model", self._versions["model"])
        stage = STAGES[name]
        values = tuple(
            getattr(settings, f) if f not in APPLIES or APPLIES[f](settings, model) else None for f in stage.fields
        )
        if stage.file is not None:
            values += (_mtime(getattr(settings, stage.file)),)
        return (name, values, tuple(self.key(after, settings, model) for after in stage.after))

    def _stage(self, name: str, key, fn: Callable):
        if name in _MAPS:
            if key in self._splats:
                self._splats.move_to_end(key)
                return self._splats[key]
        else:
            hit = self._memo.get(name)
            if hit is not None and hit[0] == key:
                return hit[1]
        value = fn()
        self.computed.append(name)
        self._versions[name] += 1
        if name in _MAPS:
            self._splats[key] = value
            while len(self._splats) > self._splat_cache:
                self._splats.popitem(last=False)
        else:
            self._memo[name] = (key, value)
        return value

    def model(self, structure: str) -> Model:
        """The model of the ``structure`` setting (memoised)."""
        return self._stage("model", structure, lambda: load_model(self.memory_models.get(structure, structure)))

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
        self.computed = []
        progress(0, total, f"reading {settings.structure}")
        model = self.model(settings.structure)
        notes.extend(model.notes)

        def key(name: str, s: Settings = settings) -> tuple:
            return self.key(name, s, model)

        try:
            grid = self._stage(
                "grid", key("grid"), lambda: GridSpec.for_spacing(model.cell, settings.spacing, model.spacegroup)
            )
        except kernels.GridError as exc:
            raise WorkbenchError(f"{exc}; choose another spacing") from exc
        check()

        read = self._stage(
            "model_atoms", key("model_atoms"), lambda: model_atoms(model, settings.adp, settings.radiation)
        )
        undistorted = self._stage(
            "undistorted", key("undistorted"), lambda: prepare_atoms(model, settings, distorted=False, base=read)
        )
        xyz = self._stage(
            "positions",
            key("positions"),
            lambda: (
                model.atoms.xyz
                if settings.distort_amplitude == 0
                else model.atoms.xyz + distortion(len(model), settings.distort_amplitude, settings.distort_seed)
            ),
        )
        atoms = self._stage("atoms", key("atoms"), lambda: undistorted.replace(xyz=xyz))

        progress(1, total, "splatting the model map")
        want_fit = settings.gradient_kind == "density"
        gradient = None
        if want_fit:
            target, target_source = self._target(grid, undistorted, settings, key)
            check()
            gradient, rho = self._stage("fit", key("fit"), lambda: density_fit_gradient(atoms, grid, target, settings))
            backend = gradient.backend
            timings["density forward"] = gradient.forward_s
            timings["density backward"] = gradient.backward_s
        else:
            rho, backend, seconds = self._stage("map", key("map"), lambda: density_map(atoms, grid, settings))
            timings["density forward"] = seconds
        check()

        progress(2, total, "map statistics and the section")
        mean, sigma, lo, hi = self._stage("stats", key("stats"), lambda: map_statistics(rho))
        # The section is what a slider drag changes: cut it where the map lives (only the section crosses
        # to the host) and show it before the slower stages and before the whole map is copied.
        # The section is kept as a depth in Å, so a new grid cuts it at the same place.
        depth = settings.slice_depth
        if depth is None:
            # central_depth reads only the grid's cell, the model's
            depth = self._stage("middle", key("middle"), lambda: central_depth(model.atoms.xyz, grid, settings.axis))
        sec = section(rho, grid, settings.axis, section_index(grid, settings.axis, depth), (lo, hi))
        near = atoms_near_section(atoms.xyz, grid, sec)
        check()
        on_section(sec, near, mean, sigma)
        rho_cpu = self._stage("rho_cpu", key("rho_cpu"), lambda: rho.detach().cpu())
        if not want_fit:
            target, target_source = self._target(grid, undistorted, settings, key)
        check()

        progress(3, total, "planarity")
        planes = None
        if not want_fit:
            try:
                planes = self._stage("planes", key("planes"), lambda: find_planes(model))
                gradient = self._stage("planarity", key("planarity"), lambda: planarity_gradient(xyz, planes, settings))
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
                key("atom_rho"),
                lambda: (
                    density_at_points(rho, grid, xyz, backend=settings.backend),
                    density_at_points(target.to(rho.device), grid, xyz, backend=settings.backend),
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
                key("profile"),
                lambda: line_profile(rho, grid, xyz[i].numpy(), xyz[j].numpy(), backend=settings.backend),
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
            atoms_key=(self._versions["model"], key("undistorted"), key("positions"), key("model_atoms")),
            map_key=key("rho"),
        )

    def _target(self, grid, undistorted, settings, key):
        """ρ_target and where it came from: a loaded map, or the map of the undistorted atoms.

        The latter is stage ``"map"`` under the settings without displacement: the model map
        itself when nothing is displaced (one splat for both).
        """
        if settings.target_map:
            path = Path(settings.target_map).expanduser()
            return self._stage("target_map", key("target"), lambda: self._load_target(path, grid, settings.device))
        plain = self.resolve("target", settings)[1]
        rho0, _, _ = self._stage("map", key("target"), lambda: density_map(undistorted, grid, plain))
        return rho0.detach(), "map of the undistorted model"

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


def _mtime(path: str) -> float | None:
    """The modification time of the file ``path`` names (None: no path, or no such file)."""
    if not path:
        return None
    p = Path(path).expanduser()
    return p.stat().st_mtime if p.exists() else None
