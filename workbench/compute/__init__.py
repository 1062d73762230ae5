"""Pure computations behind the workbench: settings → maps, gradients, sections, scenes, timings.

Nothing here knows a widget exists. Every function takes tensors, a :class:`kernels.Model`
or a :class:`~workbench.state.Settings` snapshot and returns plain data; the views only
draw what these return. :class:`Pipeline` chains them for one snapshot and memoises each
stage on its inputs, so moving the slice slider re-renders without re-splatting, and
changing a B-factor re-splats without re-reading the file.

One module per stage, each importing only the stages before it:

- :mod:`~workbench.compute.errors` — :class:`WorkbenchError`, :class:`Cancelled`
- :mod:`~workbench.compute.atoms` — structure → atoms (ADPs, radiation, B mode, distortion, residues)
- :mod:`~workbench.compute.maps` — atoms → maps, gradients, tricubic samples, timings
- :mod:`~workbench.compute.sections` — map → a section in Å, the atoms near it
- :mod:`~workbench.compute.render` — a section → a smooth raster in Å, σ contours, atom marks
- :mod:`~workbench.compute.pipeline` — :class:`Pipeline`, its :class:`Result`, and :data:`STAGES`
  (what each stage reads: the one declaration its cache key is made from)
- :mod:`~workbench.compute.relax` — the fit loop of the relax control (one step at a time)
- :mod:`~workbench.compute.comparison` — one backend against another
- :mod:`~workbench.compute.reciprocal` — the Resolution tab: errors by shell, FSC, truncated syntheses
- :mod:`~workbench.compute.export` — CCP4 bytes, PDB text, gradient CSV
- :mod:`~workbench.compute.scene` — the 3D view's map box, volume, arrows, ADP ellipsoids and focus
- :mod:`~workbench.compute.text` — counts and ordinals in the words of user-visible text

Every public name of these modules is importable from ``workbench.compute``.
Errors meant for a person are :class:`WorkbenchError` (the message says what is wrong
and what to do); the app shows them in its status line.
"""

from workbench.compute.atoms import (
    BOX_PADDING,
    distortion,
    load_model,
    model_atoms,
    prepare_atoms,
    region_atoms,
    residue_keys,
    save_upload,
)
from workbench.compute.comparison import (
    Comparison,
    DifferenceResult,
    compare_arrays,
    compare_backends,
    comparison_inputs,
    difference_section,
    inputs_label,
    over_marks,
    over_tolerance,
    over_uv,
    over_volume,
)
from workbench.compute.errors import Cancelled, WorkbenchError
from workbench.compute.export import gradients_csv, map_ccp4_bytes, model_pdb
from workbench.compute.maps import (
    GradientResult,
    atom_table_order,
    density_at_points,
    density_fit_gradient,
    density_map,
    find_planes,
    line_profile,
    map_statistics,
    planarity_gradient,
    time_backends,
    tricubic_sampler,
)
from workbench.compute.pipeline import APPLIES, STAGES, Pipeline, Result, Stage
from workbench.compute.reciprocal import (
    EXACT_LIMIT,
    ResolutionCache,
    ResolutionReport,
    resolution_range,
    resolution_report,
    truncated_map,
    truncated_section,
)
from workbench.compute.relax import (
    RELAX_RANGES,
    Relaxation,
    RelaxFrame,
    RelaxProblem,
    frame_result,
    relax_problem,
    rmsd,
    run_relaxation,
)
from workbench.compute.render import (
    ELEMENT_COLOURS,
    SECTION_PIXELS,
    AtomMarks,
    Contour,
    SectionImage,
    atom_marks,
    render_section,
    sample_section,
    section_contours,
    section_fractions,
)
from workbench.compute.scene import (
    ARROW_MAX_LENGTH,
    ARROW_MIN_LENGTH,
    ARROW_SCALE,
    CLIPPED,
    ELLIPSOID_SCALE,
    MAX_ARROWS,
    MAX_ELLIPSOIDS,
    MAX_VIEW_VOXELS,
    VIEW_MARGIN,
    VIEW_VOXELS,
    Arrows,
    AtomPick,
    EllipsoidMesh,
    Ellipsoids,
    RegionVolume,
    adp_ellipsoids,
    arrow_bytes,
    arrow_segments,
    atom_pick,
    atoms_within,
    element_colour,
    ellipsoid_arrays,
    ellipsoid_mesh,
    focus_selection,
    focus_sphere,
    gradient_arrows,
    near_atoms_mask,
    region_arrows,
    region_box,
    region_volume,
    residue_of_atom,
    shown_atoms,
    unit_sphere,
    volume_base64,
)
from workbench.compute.sections import (
    EMPTY_SECTION_FRACTION,
    Section,
    atoms_near_section,
    central_depth,
    central_index,
    section,
    section_depth,
    section_index,
    section_is_empty,
)
from workbench.compute.text import count, ordinal

__all__ = [
    "EXACT_LIMIT",
    "ResolutionCache",
    "ResolutionReport",
    "resolution_range",
    "resolution_report",
    "truncated_map",
    "truncated_section",
    "RELAX_RANGES",
    "RelaxFrame",
    "RelaxProblem",
    "Relaxation",
    "frame_result",
    "relax_problem",
    "rmsd",
    "run_relaxation",
    "count",
    "ordinal",
    "ARROW_MAX_LENGTH",
    "ARROW_MIN_LENGTH",
    "ARROW_SCALE",
    "BOX_PADDING",
    "EMPTY_SECTION_FRACTION",
    "CLIPPED",
    "ELLIPSOID_SCALE",
    "MAX_ELLIPSOIDS",
    "ELEMENT_COLOURS",
    "MAX_ARROWS",
    "MAX_VIEW_VOXELS",
    "SECTION_PIXELS",
    "APPLIES",
    "STAGES",
    "VIEW_MARGIN",
    "VIEW_VOXELS",
    "Arrows",
    "EllipsoidMesh",
    "Ellipsoids",
    "AtomMarks",
    "Cancelled",
    "Comparison",
    "Contour",
    "DifferenceResult",
    "GradientResult",
    "Pipeline",
    "RegionVolume",
    "Result",
    "Section",
    "SectionImage",
    "Stage",
    "WorkbenchError",
    "adp_ellipsoids",
    "arrow_bytes",
    "arrow_segments",
    "atom_marks",
    "atom_table_order",
    "atoms_near_section",
    "atoms_within",
    "central_depth",
    "central_index",
    "compare_arrays",
    "over_marks",
    "over_tolerance",
    "over_uv",
    "over_volume",
    "compare_backends",
    "comparison_inputs",
    "density_at_points",
    "density_fit_gradient",
    "density_map",
    "difference_section",
    "distortion",
    "element_colour",
    "ellipsoid_arrays",
    "ellipsoid_mesh",
    "find_planes",
    "focus_selection",
    "focus_sphere",
    "gradient_arrows",
    "gradients_csv",
    "inputs_label",
    "line_profile",
    "load_model",
    "map_ccp4_bytes",
    "map_statistics",
    "model_atoms",
    "model_pdb",
    "near_atoms_mask",
    "planarity_gradient",
    "prepare_atoms",
    "region_arrows",
    "region_atoms",
    "region_box",
    "region_volume",
    "render_section",
    "residue_keys",
    "AtomPick",
    "atom_pick",
    "residue_of_atom",
    "sample_section",
    "save_upload",
    "section",
    "section_depth",
    "section_index",
    "section_is_empty",
    "section_contours",
    "section_fractions",
    "shown_atoms",
    "time_backends",
    "tricubic_sampler",
    "unit_sphere",
    "volume_base64",
]
