"""State: validated ranges, snapshots, the cuda rule."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import traitlets

from workbench.state import INPUTS, RANGES, Settings, WorkbenchState, cuda_unavailable_reason


@pytest.mark.parametrize("name", ["b_global", "b_offset", "radius", "spacing", "iso_sigma", "distort_amplitude"])
def test_out_of_range_values_are_refused_with_the_range(name):
    state = WorkbenchState()
    lo, hi, _ = RANGES[name]
    before = getattr(state, name)
    for bad in (hi + 1.0, lo - 1.0, float("nan")):
        with pytest.raises(traitlets.TraitError, match=rf"{name} must lie in \[{lo:g}, {hi:g}\]"):
            setattr(state, name, bad)
    assert getattr(state, name) == before
    setattr(state, name, hi)
    assert getattr(state, name) == hi


def test_keyboard_step_artefacts_are_rounded():
    state = WorkbenchState()
    state.spacing = 0.7999999999999999
    assert state.spacing == 0.8
    state.b_global = 30.000000000000004
    assert state.b_global == 30.0


def test_slice_position_is_a_depth_per_axis():
    # Was: slice_index a setting, clamped when a coarser grid had fewer sections (the
    # section then moved, issue 19). The setting is now a depth in Å per axis.
    state = WorkbenchState()
    assert state.slice_depths == (None, None, None) and state.snapshot().slice_depth is None
    state.slice_depths = state.with_depth(16.9100000001)
    assert state.slice_depths == (None, None, 16.91) and state.snapshot().slice_depth == 16.91
    state.slice_axis = "a"
    assert state.snapshot().slice_depth is None  # each axis keeps its own
    with pytest.raises(traitlets.TraitError, match="slice depth is a finite number"):
        state.slice_depths = (float("nan"), None, None)
    with pytest.raises(traitlets.TraitError, match="one depth per cell axis"):
        state.slice_depths = (1.0,)


def test_profile_atoms_must_exist():
    state = WorkbenchState(n_atoms=10)
    state.profile_atoms = (2, 9)
    with pytest.raises(traitlets.TraitError, match="profile atoms"):
        state.profile_atoms = (2, 10)


def test_cuda_is_refused_without_a_gpu_and_says_why():
    state = WorkbenchState()
    if torch.cuda.is_available():
        state.device = "cuda"
        assert state.device == "cuda" and cuda_unavailable_reason() is None
    else:
        with pytest.raises(traitlets.TraitError, match="device 'cuda' is not available: .*use device 'cpu'"):
            state.device = "cuda"
        assert state.device == "cpu"


def test_snapshot_is_immutable_and_complete():
    state = WorkbenchState(b_mode="global", b_global=42.0, radius_mode="radius", radius=2.5)
    snap = state.snapshot()
    assert snap.b_global == 42.0 and snap.radius_arg == 2.5 and snap.axis == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.b_global = 1.0
    state.b_global = 50.0
    assert snap.b_global == 42.0
    state.radius_mode = "auto"
    assert state.snapshot().radius_arg is None


def test_inputs_are_the_snapshot_fields_and_every_other_trait_is_set_by_the_app():
    fields = [f.name for f in dataclasses.fields(Settings)]
    assert list(INPUTS) == fields
    traits = WorkbenchState.class_traits()
    missing = set(fields) - set(traits)
    assert not missing, f"Settings fields without a trait: {missing}"
    by_app = {name for name, t in traits.items() if t.metadata.get("set_by_app")}
    assert by_app == {"grid_shape", "slice_index", "slice_index_max", "slice_plane", "n_atoms", "has_anisou"}
    assert not by_app & set(INPUTS)
    # a trait that is neither a setting nor tagged set_by_app would be a control the
    # computation never sees (or one whose change recomputes nothing): add it to Settings
    untagged = set(traits) - set(INPUTS) - by_app
    assert not untagged, f"traits neither in Settings nor tagged set_by_app: {untagged}"
