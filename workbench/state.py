"""Traitlets state of the workbench: every control's value and its valid range.

A :class:`WorkbenchState` is the single source of truth the controls write into and the
compute pipeline reads from (through an immutable :class:`Settings` snapshot, so a
computation started for one set of values never sees a later change half-way through).
Ranges are class constants so the controls, the validators and the tests share them.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import traitlets

import kernels

__all__ = [
    "ADP_MODES",
    "BACKENDS",
    "B_MODES",
    "EXAMPLES",
    "GRADIENT_KINDS",
    "INPUTS",
    "MAX_CONTOURS",
    "RADIATIONS",
    "RANGES",
    "SLICE_AXES",
    "SLICE_SCALES",
    "Settings",
    "TABLE_SORTS",
    "WorkbenchState",
    "backend_choices",
    "compare_choices",
    "cuda_unavailable_reason",
    "density_units",
    "device_choices",
    "op_backend",
    "registered_density_backends",
]

EXAMPLES = ("1orc", "1pfe", "1aki")
MAX_CONTOURS = 6  # slice contour levels; more lines than that hide the density
B_MODES = ("model", "global", "offset")
# How anisotropic atoms are splatted: with their ANISOU U, or every atom at its isotropic B.
ADP_MODES = ("anisotropic", "isotropic")
# The scattering the form factors describe (kernels.crystal.RADIATIONS; a test holds them equal).
RADIATIONS = ("xray", "electron", "neutron")
BACKENDS = ("auto", "cpu", "triton", "reference")
SLICE_AXES = ("a", "b", "c")
SLICE_SCALES = ("section", "map")
GRADIENT_KINDS = ("planarity", "density")
TABLE_SORTS = ("index", "rho", "target", "ratio")

# name -> (min, max, step); one table for the widgets, the validators and the tests.
RANGES: dict[str, tuple[float, float, float]] = {
    "b_global": (1.0, 300.0, 1.0),  # Å²; B must stay > 0 (gemmi gives NaN at B = 0)
    "b_offset": (-50.0, 200.0, 1.0),  # Å²; an offset that drives some B ≤ 0 is reported, not clipped
    "radius": (0.5, 12.0, 0.1),  # Å
    "density_cutoff": (1e-8, 1e-2, 0.0),  # e/Å³, a log slider
    "spacing": (0.25, 3.0, 0.01),  # Å
    "iso_sigma": (0.1, 10.0, 0.1),  # σ above the map mean
    "distort_amplitude": (0.0, 1.0, 0.01),  # Å, RMS of the random displacement per coordinate
    "distort_seed": (0, 2**31 - 1, 1),
    "region_padding": (1.0, 12.0, 0.5),  # Å of map shown around the chosen residue
    "blur": (0.0, 100.0, 0.5),  # Å², extra B on every atom (U + blur/8π² on anisotropic ones), as gemmi's blur
}


#: The unit of a map of a radiation: :func:`kernels.density_unit` itself (e/Å³ X-rays, Å⁻² electrons,
#: fm/Å³ neutrons), under the name the views use.
density_units = kernels.density_unit


def cuda_unavailable_reason() -> str | None:
    """None when a CUDA GPU is usable; otherwise why ``cuda`` cannot be chosen."""
    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            return "this torch build has no CUDA support (CPU-only wheel)"
        return "no CUDA GPU is visible to torch (torch.cuda.is_available() is False)"
    return None


# The kernels one computation runs: a backend is offered when it can run all of them.
_OPS = ("density", "planarity", "tricubic")


def device_choices() -> tuple[str, ...]:
    """Devices a computation can run on here (``cuda`` only with a usable GPU)."""
    return ("cpu",) if cuda_unavailable_reason() is not None else ("cpu", "cuda")


def registered_density_backends() -> tuple[str, ...]:
    """Density backends users registered with :func:`kernels.register_backend`, in registration order."""
    from kernels.dispatch import registered_backends

    return tuple(registered_backends("density"))


def op_backend(op: str, backend: str) -> str:
    """The backend that runs ``op`` when ``backend`` is chosen: a user's density backend has no
    planarity or tricubic kernel (unless registered for those too), so those ops run ``auto``."""
    from kernels.dispatch import registered_backends

    if backend in BACKENDS or backend in registered_backends(op):
        return backend
    return "auto"


def backend_choices(device: str = "cpu") -> tuple[tuple[str, ...], dict[str, str]]:
    """Backends that can run every kernel of the workbench on ``device``, and why the others cannot.

    A registered density backend (:func:`kernels.register_backend`) is offered when it can
    run density on ``device``; the planarity and tricubic kernels then run ``auto``
    (:func:`op_backend`).

    Returns
    -------
    runnable : tuple of str
        ``"auto"`` first, then the named backends in :data:`BACKENDS` order, then the
        registered ones.
    why_not : dict of str to str
        Backend name -> the reason :func:`kernels.resolve_backend` gives (with its fix).
    """
    import kernels

    runnable, why_not = ["auto"], {}
    for name in (*BACKENDS[1:], *registered_density_backends()):
        for op in _OPS if name in BACKENDS else ("density",):
            if name not in kernels.available_backends(op, device):
                try:
                    kernels.resolve_backend(op, device, name)
                except kernels.BackendError as exc:
                    why_not[name] = str(exc)
                else:  # available_backends and resolve_backend disagree: trust the refusal
                    why_not[name] = f"the {name} backend cannot run {op} on {device}"
                break
        else:
            runnable.append(name)
    return tuple(runnable), why_not


def compare_choices() -> tuple[str, ...]:
    """``device:backend`` pairs the difference view can compare on this machine (runnable ones only),
    registered density backends last."""
    order = ("reference", "cpu", "triton", *registered_density_backends())
    pairs = []
    for device in device_choices():
        runnable, _ = backend_choices(device)
        pairs += [f"{device}:{b}" for b in order if b in runnable]
    return tuple(pairs)


def _round(value: float, step: float) -> float:
    # Keyboard steps on a FloatSlider give 0.7999999999999999: snap to the step.
    if step <= 0:
        return float(value)
    digits = max(0, -int(math.floor(math.log10(step))))
    return round(float(value), digits + 2)


@dataclasses.dataclass(frozen=True)
class Settings:
    """An immutable snapshot of :class:`WorkbenchState` (what one computation sees).

    Field meanings and units are those of the traits of the same name.
    """

    structure: str
    adp: str
    radiation: str
    b_mode: str
    b_global: float
    b_offset: float
    blur: float
    radius_mode: str
    radius: float
    density_cutoff: float
    spacing: float
    device: str
    backend: str
    slice_axis: str
    slice_depths: tuple[float | None, float | None, float | None]
    slice_scale: str
    contour_sigmas: tuple[float, ...]
    iso_sigma: float
    distort_amplitude: float
    distort_seed: int
    gradient_kind: str
    region: str
    region_padding: float
    ellipsoids: bool
    profile_atoms: tuple[int, int]
    target_map: str
    table_sort: str
    table_ascending: bool

    @property
    def radius_arg(self) -> float | None:
        """``radius=`` for :func:`kernels.splat_density` (None: per-atom from the cutoff)."""
        return self.radius if self.radius_mode == "radius" else None

    @property
    def units(self) -> str:
        """Unit of the maps of these settings (:func:`density_units`)."""
        return density_units(self.radiation)

    @property
    def axis(self) -> int:
        """Slice axis as 0, 1, 2."""
        return SLICE_AXES.index(self.slice_axis)

    @property
    def slice_depth(self) -> float | None:
        """Depth in Å of the section ⊥ the slice axis; None: through the middle of the model."""
        return self.slice_depths[self.axis]


# The traits a computation depends on: exactly the fields a snapshot carries, so a
# change the app recomputes for is one the computation can see, and the reverse. Every
# other trait of WorkbenchState is tagged ``set_by_app`` (the tests hold both to it).
INPUTS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Settings))


class WorkbenchState(traitlets.HasTraits):
    """Every control of the workbench as a validated trait.

    Values outside a range raise ``traitlets.TraitError`` naming the range; the app turns
    that into a message in the status line and puts the control back. The traits named in
    :data:`INPUTS` are the settings of a computation; those tagged ``set_by_app=True``
    describe its result (grid shape, atom count) and never trigger one.
    """

    structure = traitlets.Unicode("1orc", help="bundled example name (1orc, 1pfe, 1aki) or a model file path")
    adp = traitlets.Enum(
        ADP_MODES,
        default_value="anisotropic",
        help="anisotropic: atoms with ANISOU splat their U; isotropic: every atom at its B (models without ANISOU: no effect)",
    )
    has_anisou = traitlets.Bool(False, help="the current model has ANISOU records (the ADP control is enabled)").tag(
        set_by_app=True
    )
    radiation = traitlets.Enum(
        RADIATIONS, default_value="xray", help="form factors: X-ray (IT92), electron (IT C 4.3.2.2) or neutron lengths"
    )
    b_mode = traitlets.Enum(B_MODES, default_value="model", help="model's own B / one global B / model's B + offset")
    b_global = traitlets.Float(20.0, help="Å², the B of every atom in 'global' mode")
    b_offset = traitlets.Float(
        0.0, help="Å², added to every atom's B in 'offset' mode (ΔB/8π² on the diagonal of an anisotropic U)"
    )
    blur = traitlets.Float(0.0, help="Å², extra B on every atom passed to the splat (gemmi's blur)")
    radius_mode = traitlets.Enum(("auto", "radius"), default_value="auto", help="per-atom radius from a cutoff, or one")
    radius = traitlets.Float(3.0, help="Å, one cutoff radius for every atom in 'radius' mode")
    density_cutoff = traitlets.Float(1e-5, help="e/Å³ (fm/Å³ for neutrons), sets each atom's radius in 'auto' mode")
    spacing = traitlets.Float(0.667, help="Å, requested grid spacing (an upper bound)")
    grid_shape = traitlets.Tuple((0, 0, 0), help="grid shape for the current spacing").tag(set_by_app=True)
    device = traitlets.Enum(("cpu", "cuda"), default_value="cpu")
    backend = traitlets.Unicode("auto", help="auto, a built-in backend or a registered density backend")
    slice_axis = traitlets.Enum(SLICE_AXES, default_value="c", help="the section is perpendicular to this cell axis")
    slice_depths = traitlets.Tuple(
        (None, None, None),
        help="Å, the section's depth ⊥ a, b, c (one per axis, kept across grids; None: the model's middle)",
    )
    slice_index = traitlets.Int(0, help="index of the shown section on the current grid").tag(set_by_app=True)
    slice_index_max = traitlets.Int(0, help="last section index of the current grid").tag(set_by_app=True)
    slice_plane = traitlets.Float(0.0, help="Å between two sections of the current grid").tag(set_by_app=True)
    slice_scale = traitlets.Enum(
        SLICE_SCALES, default_value="section", help="slice colour scale: the shown section's range, or the whole map's"
    )
    contour_sigmas = traitlets.Tuple(
        (1.0,), help="slice contour levels in σ above the map mean (as Coot draws maps); () for none"
    )
    iso_sigma = traitlets.Float(1.5, help="isosurface level in σ above the map mean")
    distort_amplitude = traitlets.Float(0.0, help="Å, RMS random displacement per coordinate")
    distort_seed = traitlets.Int(0)
    gradient_kind = traitlets.Enum(GRADIENT_KINDS, default_value="planarity")
    region = traitlets.Unicode("", help="residue 'chain/seq' for the isosurface, '' for the whole model")
    region_padding = traitlets.Float(5.0, help="Å of map shown around the region")
    ellipsoids = traitlets.Bool(False, help="draw the shown atoms' 50 % probability ADP ellipsoids in the 3D view")
    profile_atoms = traitlets.Tuple((0, 1), help="indices of the two atoms of the line profile")
    n_atoms = traitlets.Int(0, help="atoms in the current model").tag(set_by_app=True)
    target_map = traitlets.Unicode("", help="CCP4/MRC path of ρ_target; '' = the map of the undistorted model")
    table_sort = traitlets.Enum(TABLE_SORTS, default_value="ratio")
    table_ascending = traitlets.Bool(True)

    @traitlets.validate(*[name for name in RANGES if name != "distort_seed"])
    def _check_range(self, proposal):
        name = proposal["trait"].name
        lo, hi, step = RANGES[name]
        value = proposal["value"]
        if not (isinstance(value, (int, float)) and math.isfinite(value) and lo <= value <= hi):
            raise traitlets.TraitError(f"{name} must lie in [{lo:g}, {hi:g}], got {value!r}")
        return _round(value, step)

    @traitlets.validate("distort_seed")
    def _check_seed(self, proposal):
        lo, hi, _ = RANGES["distort_seed"]
        if not lo <= proposal["value"] <= hi:
            raise traitlets.TraitError(f"distort_seed must lie in [{lo}, {hi}], got {proposal['value']}")
        return proposal["value"]

    @traitlets.validate("contour_sigmas")
    def _check_contours(self, proposal):
        value = tuple(proposal["value"])
        if len(value) > MAX_CONTOURS:
            raise traitlets.TraitError(f"at most {MAX_CONTOURS} contour levels, got {len(value)}")
        out = []
        for v in value:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and abs(v) <= 50):
                raise traitlets.TraitError(f"contour levels are σ multiples in [-50, 50], got {v!r}")
            out.append(float(v))
        return tuple(sorted(set(out)))

    @traitlets.validate("device")
    def _check_device(self, proposal):
        if proposal["value"] == "cuda":
            why = cuda_unavailable_reason()
            if why is not None:
                raise traitlets.TraitError(f"device 'cuda' is not available: {why}; use device 'cpu'")
        return proposal["value"]

    @traitlets.validate("backend")
    def _check_backend(self, proposal):
        runnable, why_not = backend_choices(self.device)
        value = proposal["value"]
        if value not in runnable:
            why = why_not.get(value, f"unknown backend {value!r}")
            raise traitlets.TraitError(
                f"backend {value!r} cannot run on {self.device}: {why}; choose one of {', '.join(runnable)}"
            )
        return value

    @traitlets.observe("device")
    def _backend_for_device(self, change):
        # A backend picked for one device may not run on the other (cpu on cuda): fall back to auto.
        if self.backend not in backend_choices(change["new"])[0]:
            self.backend = "auto"

    @traitlets.validate("slice_depths")
    def _check_depths(self, proposal):
        value = tuple(proposal["value"])
        if len(value) != 3:
            raise traitlets.TraitError(f"slice_depths needs one depth per cell axis (a, b, c), got {value}")
        out = []
        for d in value:
            if d is not None:
                if not (isinstance(d, (int, float)) and math.isfinite(d)):
                    raise traitlets.TraitError(f"a slice depth is a finite number of Å or None, got {d!r}")
                d = round(float(d), 4)
            out.append(d)
        return tuple(out)

    def with_depth(self, depth: float | None) -> tuple[float | None, float | None, float | None]:
        """``slice_depths`` with the current axis's depth replaced by ``depth`` (Å)."""
        depths = list(self.slice_depths)
        depths[SLICE_AXES.index(self.slice_axis)] = depth
        return tuple(depths)

    @traitlets.validate("profile_atoms")
    def _check_profile(self, proposal):
        value = tuple(int(v) for v in proposal["value"])
        if len(value) != 2:
            raise traitlets.TraitError(f"profile_atoms needs two atom indices, got {value}")
        if self.n_atoms and not all(0 <= v < self.n_atoms for v in value):
            raise traitlets.TraitError(f"profile atoms must be indices in [0, {self.n_atoms - 1}], got {value}")
        return value

    def snapshot(self) -> Settings:
        """The current values as an immutable :class:`Settings`."""
        return Settings(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Settings)})
