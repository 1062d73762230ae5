"""Production kernels for crystallographic electron density.

Read a model (:func:`read_model`), pick a grid (:class:`GridSpec`), splat its density
(:func:`splat_density`), add the symmetry mates (:func:`symmetrize`) and write the map
(:func:`write_map`); take its structure factors (:func:`structure_factors`) and judge them by
resolution shell (:func:`shells`, :func:`fsc`). Many frames of the same atoms (an ensemble, an MD trajectory) go through
:func:`splat_ensemble` in one call, optionally split over ``torch.distributed`` ranks; frames of
any number stream from a file (:func:`frames_from`) or an iterable, with :func:`ensemble_gradients`
for their per-frame gradients. A whole fitting step replays as one CUDA graph with
:class:`kernels.fitting.Step`. Every
function takes torch tensors; the device of the atoms picks CPU or GPU, and ``backend=`` picks
the implementation (see :mod:`kernels.dispatch`).
Your own density kernel joins them with :func:`register_backend` and is judged as ours
are with :func:`check_backend` (:mod:`kernels.checking`).
"""

from kernels import fitting
from kernels.checking import Check, CheckReport, check_backend
from kernels.crystal import (
    AtomLabel,
    AtomSet,
    Cell,
    GridError,
    GridSpec,
    Model,
    ModelError,
    example_structure,
    form_factor_coefficients,
    read_model,
)
from kernels.density import (
    DEFAULT_CUTOFF,
    VOLTS_PER_INVERSE_SQUARE_ANGSTROM,
    atom_cutoff_radii,
    check_finite,
    cutoff_radius,
    density_integral_unit,
    density_unit,
    peak_density,
    splat_density,
)
from kernels.density.ensemble import frame_share, splat_ensemble, sum_gradients_over_ranks
from kernels.density.frames import DEFAULT_CHUNK_BYTES, FrameSource, frames_from
from kernels.density.stream import ensemble_gradients
from kernels.dispatch import (
    BackendCapabilities,
    BackendError,
    available_backends,
    register_backend,
    resolve_backend,
    unregister_backend,
)
from kernels.mapio import read_map, write_map
from kernels.planarity import PlaneSet, find_planes, planarity_nll
from kernels.reciprocal import (
    ReflectionData,
    ReflectionFileError,
    RFactor,
    ShellTable,
    StructureFactors,
    fourier_synthesis,
    fsc,
    r_factor,
    read_structure_factors,
    sampling_blur,
    shells,
    structure_factors,
    write_structure_factors,
)
from kernels.symmetry import symmetrize
from kernels.tricubic import tricubic_sample

__all__ = [
    "fitting",
    "AtomLabel",
    "AtomSet",
    "BackendCapabilities",
    "BackendError",
    "Cell",
    "Check",
    "CheckReport",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_CUTOFF",
    "VOLTS_PER_INVERSE_SQUARE_ANGSTROM",
    "FrameSource",
    "GridError",
    "GridSpec",
    "Model",
    "ModelError",
    "PlaneSet",
    "RFactor",
    "ReflectionData",
    "ReflectionFileError",
    "ShellTable",
    "StructureFactors",
    "atom_cutoff_radii",
    "available_backends",
    "check_backend",
    "check_finite",
    "cutoff_radius",
    "density_integral_unit",
    "density_unit",
    "example_structure",
    "find_planes",
    "ensemble_gradients",
    "form_factor_coefficients",
    "frame_share",
    "fourier_synthesis",
    "frames_from",
    "fsc",
    "peak_density",
    "planarity_nll",
    "r_factor",
    "read_map",
    "read_model",
    "read_structure_factors",
    "register_backend",
    "resolve_backend",
    "sampling_blur",
    "shells",
    "splat_density",
    "splat_ensemble",
    "structure_factors",
    "sum_gradients_over_ranks",
    "symmetrize",
    "tricubic_sample",
    "unregister_backend",
    "write_map",
    "write_structure_factors",
]

__version__ = "0.1.0"
