"""The pipeline's cache keys come from :data:`workbench.compute.pipeline.STAGES`: changing any settings
field recomputes the stages that read it, and nothing else, and the cached result is the one a
fresh pipeline computes. Real pipeline, real kernels, on 1PFE (342 atoms, with ANISOU) at 1.5 Å."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
import torch

import kernels
from tests.helpers import deterministic
from workbench.compute import Pipeline
from workbench.compute.pipeline import APPLIES, STAGES
from workbench.state import Settings, WorkbenchState, cuda_unavailable_reason

_NO_CUDA = cuda_unavailable_reason()


def _base() -> Settings:
    return WorkbenchState(structure="1pfe", spacing=1.5).snapshot()


@pytest.fixture(scope="module")
def target_file(tmp_path_factory):
    """A CCP4 map of 1PFE's cell (B + 10 Å², a finer grid: the pipeline resamples it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = kernels.read_model(kernels.example_structure("1pfe"))
    grid = kernels.GridSpec.for_spacing(model.cell, 1.2, model.spacegroup)
    rho = kernels.splat_density(model.atoms.replace(b_iso=model.atoms.b_iso + 10), grid)
    path = tmp_path_factory.mktemp("target") / "target.ccp4"
    kernels.write_map(path, rho, grid)
    return path


# field -> [(settings it starts from, the value it changes to)]. For a field of APPLIES the first case is
# one where it applies, the second one where it does not. Every Settings field is here (checked below).
def _variations(target: str) -> dict[str, list[tuple[dict, object]]]:
    return {
        "structure": [({}, "1orc")],
        "adp": [({}, "isotropic"), ({"structure": "1orc"}, "isotropic")],
        "radiation": [({}, "electron")],
        "b_mode": [({}, "global")],
        "b_global": [({"b_mode": "global"}, 35.0), ({}, 35.0)],
        "b_offset": [({"b_mode": "offset"}, 5.0), ({}, 5.0)],
        "blur": [({}, 10.0)],
        "radius_mode": [({}, "radius")],
        "radius": [({"radius_mode": "radius"}, 2.5), ({}, 2.5)],
        "density_cutoff": [({}, 1e-4), ({"radius_mode": "radius"}, 1e-4)],
        "spacing": [({}, 1.0)],
        "device": [({}, "cuda")],
        "backend": [({}, "reference")],
        "slice_axis": [({}, "a")],
        "slice_depths": [({}, (None, None, 4.0))],
        "slice_scale": [({}, "map")],
        "contour_sigmas": [({}, (1.0, 2.0))],
        "iso_sigma": [({}, 2.5)],
        "distort_amplitude": [({}, 0.2), ({"gradient_kind": "density"}, 0.2)],
        "distort_seed": [({"distort_amplitude": 0.2}, 7), ({}, 7)],
        "gradient_kind": [({}, "density")],
        "region": [({}, "A/3")],
        "region_padding": [({}, 8.0)],
        "ellipsoids": [({}, True)],
        "profile_atoms": [({}, (2, 5))],
        "target_map": [({}, target), ({"gradient_kind": "density"}, target)],
        "table_sort": [({}, "rho")],
        "table_ascending": [({}, False)],
    }


def test_every_settings_field_is_varied():
    assert set(_variations("x.ccp4")) == {f.name for f in dataclasses.fields(Settings)}


def _cases():
    for field, cases in _variations("<target>").items():
        for i in range(len(cases)):
            marks = [pytest.mark.skipif(field == "device" and _NO_CUDA is not None, reason=f"no CUDA: {_NO_CUDA}")]
            yield pytest.param(field, i, marks=marks, id=f"{field}-{i}")


def _readers(name: str, settings: Settings) -> set[str]:
    """Every settings field stage ``name`` depends on, through the stages it comes after (an upper bound)."""
    if name in ("rho", "target"):
        chooser = {"rho": "gradient_kind", "target": "target_map"}[name]
        return {chooser} | _readers(Pipeline.resolve(name, settings)[0], settings)
    stage = STAGES[name]
    found = set(stage.fields)
    for after in stage.after:
        found |= _readers(after, settings)
    return found


def _applies(field: str, settings: Settings, model) -> bool:
    return field not in APPLIES or APPLIES[field](settings, model)


def _differs(a, b, what: str = "") -> str | None:
    """Where two results differ (bitwise: the CPU kernels are deterministic, a GPU under the switch), or None when equal."""
    if isinstance(a, torch.Tensor):
        # a value now on another device differs (the device setting moved it), whatever its numbers
        same = isinstance(b, torch.Tensor) and (a.dtype, a.device) == (b.dtype, b.device) and torch.equal(a, b)
    elif isinstance(a, np.ndarray):
        same = isinstance(b, np.ndarray) and a.shape == b.shape and np.array_equal(a, b, equal_nan=True)
    elif isinstance(a, (tuple, list)):
        if type(a) is not type(b) or len(a) != len(b):
            return what
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := _differs(x, y, f"{what}[{i}]"))), None)
    elif dataclasses.is_dataclass(a) and not isinstance(a, (kernels.AtomSet, kernels.GridSpec)):
        names = [f.name for f in dataclasses.fields(a) if f.name not in ("forward_s", "backward_s")]
        return next((d for n in names if (d := _differs(getattr(a, n), getattr(b, n), f"{what}.{n}"))), None)
    else:
        same = a == b
    return None if same else what


_RESULT_FIELDS = (
    "grid", "atoms", "rho", "backend", "mean", "sigma", "target", "target_source", "section", "near", "gradient",
    "atom_rho", "atom_target", "profile", "notes", "unavailable",
)  # fmt: skip


def _stage_values(pipeline: Pipeline, settings: Settings) -> dict[str, object]:
    """Each stage's value for ``settings``, from the pipeline's caches (after a run with them)."""
    values = {name: value for name, (_, value) in pipeline._memo.items()}
    model = pipeline.model(settings.structure)
    for name in ("map", "fit"):
        values[name] = pipeline._splats.get(pipeline.key(name, settings, model))
    return values


@pytest.mark.parametrize(("field", "case"), list(_cases()))
def test_changing_a_field_recomputes_the_stages_that_read_it_and_nothing_else(field, case, target_file):
    start, value = _variations(str(target_file))[field][case]
    base = dataclasses.replace(_base(), **start)
    changed = dataclasses.replace(base, **{field: value})
    assert changed != base
    pipeline = Pipeline()
    # bitwise comparison of a cached and a fresh run: a GPU map adds with float32 atomics in any order
    # unless torch's deterministic switch is on (the kernels honour it), so it is on for a GPU run
    on_gpu = "cuda" in (base.device, changed.device)
    with warnings.catch_warnings(), deterministic(on_gpu, warn_only=True):
        warnings.simplefilter("ignore")
        pipeline.run(base)
        ran_before = set(pipeline.computed)  # the first run computes every stage it runs
        before = _stage_values(pipeline, base)
        model = pipeline.model(base.structure)
        applies = _applies(field, base, model)
        assert applies == (field not in APPLIES or case == 0), "APPLIES fields: case 0 applies, case 1 does not"
        cached = pipeline.run(changed)
        computed = set(pipeline.computed)
        after = _stage_values(pipeline, changed)
        fresh_pipeline = Pipeline()
        fresh = fresh_pipeline.run(changed)
    ran_after = set(fresh_pipeline.computed)
    stale = [d for n in _RESULT_FIELDS if (d := _differs(getattr(cached, n), getattr(fresh, n), n))]
    assert not stale, f"after changing {field}, the cached run differs from a fresh one in {stale}: a stage misses it"
    if not applies:
        assert computed == set(), f"{field} does not apply under {start}, yet {sorted(computed)} were recomputed"
        return
    # that stage: every stage that ran both times and reads the field was recomputed
    direct = {name for name, stage in STAGES.items() if field in stage.fields and name in ran_before & ran_after}
    assert direct <= computed, f"changing {field} did not recompute {sorted(direct - computed)}"
    # ... and every stage recomputed needed to be: its value changed with the field. The fields that choose
    # which stage is "rho" or "target" are the exception downstream: the density fit's forward is the
    # model map (an equal map through another stage, so another key), and it does not depend on the target.
    both = ran_before & ran_after
    checked = direct if field in ("gradient_kind", "target_map") else computed & both
    unchanged = sorted(name for name in checked if _differs(before[name], after[name]) is None)
    assert not unchanged, f"changing {field} recomputed {unchanged}, which gave the values they had"
    # and nothing else: a stage that ran both times was recomputed only if it depends on the field
    needless = {name for name in computed & both if field not in _readers(name, base) | _readers(name, changed)}
    assert not needless, f"changing {field} recomputed {sorted(needless)}, which do not read it"


def test_a_changed_target_file_is_read_again(target_file, tmp_path):
    """The target map's key holds the file's modification time: a rewritten file is loaded again."""
    path = tmp_path / "target.ccp4"
    path.write_bytes(target_file.read_bytes())
    settings = dataclasses.replace(_base(), target_map=str(path))
    pipeline = Pipeline()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = pipeline.run(settings)
        rho_t, grid_t = kernels.read_map(path)
        kernels.write_map(path, 2 * rho_t, grid_t)
        second = pipeline.run(settings)
    assert "target_map" in pipeline.computed and "planarity" not in pipeline.computed
    torch.testing.assert_close(second.target, 2 * first.target)


def test_the_target_of_an_undisplaced_model_is_its_own_map():
    """With nothing displaced ρ_target is the model map: one splat, found under one key."""
    pipeline = Pipeline()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = pipeline.run(_base())
    assert pipeline.computed.count("map") == 1
    assert torch.equal(result.rho, result.target)
