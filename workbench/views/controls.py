"""The control panel: one widget per state trait, two-way bound, with stable CSS classes.

A widget change is written into the :class:`~workbench.state.WorkbenchState`; a value
the state rejects (out of range, ``cuda`` with no GPU) is reported through ``on_error``
and the widget is put back, so a control never shows a value the computation is not
using. State changes made from code flow back into the widgets.
"""

from __future__ import annotations

import contextlib
import html
from collections.abc import Callable

import ipywidgets as widgets
import traitlets

from workbench.state import (
    ADP_MODES,
    B_MODES,
    EXAMPLES,
    GRADIENT_KINDS,
    MAX_CONTOURS,
    RADIATIONS,
    RANGES,
    SLICE_AXES,
    SLICE_SCALES,
    WorkbenchState,
    backend_choices,
    density_units,
    device_choices,
)

__all__ = ["Controls", "format_sigmas", "parse_sigmas"]

# Touching one of these sliders selects the mode it belongs to.
_SELECTS_MODE = {
    "b_global": ("b_mode", "global"),
    "b_offset": ("b_mode", "offset"),
    "radius": ("radius_mode", "radius"),
    "density_cutoff": ("radius_mode", "auto"),
}
_STYLE = {"description_width": "110px"}
# Toggle buttons: label and buttons on one line (ipywidgets puts the label above the
# buttons otherwise), in the panel's width.
_TOGGLE_STYLE = {"description_width": "80px"}
_TOGGLE_LAYOUT = {"display": "flex", "align_items": "center", "flex": "0 0 auto"}
_RADIATION_LABELS = {"xray": "X-ray", "electron": "electron", "neutron": "neutron"}
# Narrower than the panel less a section's padding (2 × 15 px) and border: a control as
# wide as its box (its readout at the very edge) makes the panel scroll sideways when a
# person types into the readout.
_LAYOUT = {"width": "300px"}
#: Width of the controls panel, px: a slider's track spans it (its label on the line above).
PANEL_WIDTH = 340


def _slider(cls, name: str, description: str, **kw):
    lo, hi, step = RANGES[name]
    return cls(
        min=lo, max=hi, step=step, description=description, continuous_update=True, style=_STYLE, layout=_LAYOUT, **kw
    )


def parse_sigmas(text: str) -> tuple[float, ...]:
    """Contour levels typed as numbers separated by commas or spaces ("1, 2", "-3 1.5 σ").

    Raises ValueError naming the first entry that is not a number; the range and count
    are the state's to check.
    """
    out = []
    for part in text.replace(",", " ").replace(";", " ").split():
        part = part.removesuffix("σ")
        if not part:
            continue
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"{part!r} is not a number; type σ levels like '1, 2' (empty: none)") from None
        out.append(value)
    return tuple(out)


def format_sigmas(levels) -> str:
    """The levels as the text box shows them: "1, 2"."""
    return ", ".join(f"{v:g}" for v in levels)


class Controls:
    """Every control of the workbench (see :class:`workbench.Workbench` for the CSS classes).

    Parameters
    ----------
    state : WorkbenchState
    on_error : callable(str)
        Receives the message when the state rejects a widget value.
    cuda_reason : str or None
        Why ``cuda`` cannot be chosen (None when it can).
    batch : callable returning a context manager
        Groups the state changes of one widget event into one recompute.
    """

    def __init__(
        self,
        state: WorkbenchState,
        on_error: Callable[[str], None],
        cuda_reason: str | None,
        batch: Callable = contextlib.nullcontext,
    ):
        self.state = state
        self.on_error = on_error
        self.batch = batch
        self._syncing = False
        w = widgets
        self.structure = w.Dropdown(options=[*EXAMPLES, "file"], description="structure", style=_STYLE, layout=_LAYOUT)
        self.path = w.Text(
            placeholder=".pdb/.cif[.gz] path + Enter",
            tooltip="path to a PDB or mmCIF model (optionally gzipped); press Enter to load it",
            description="path",
            style=_STYLE,
            layout=_LAYOUT,
            continuous_update=False,
        )
        self.upload = w.FileUpload(accept=".pdb,.ent,.cif,.mmcif,.gz", multiple=False, description="upload model")
        # Shown (and enabled) only for a model with ANISOU records: elsewhere both choices are one map.
        self.adp = w.ToggleButtons(
            options=ADP_MODES,
            description="ADP",
            tooltips=("atoms with ANISOU splat their U tensor", "every atom at its isotropic B"),
            style={"button_width": "95px", **_TOGGLE_STYLE},
            layout=_TOGGLE_LAYOUT,
        )
        self.radiation = w.ToggleButtons(
            options=[(_RADIATION_LABELS[r], r) for r in RADIATIONS],
            description="radiation",
            tooltips=(
                "IT92 X-ray form factors: electron density (e/Å³)",
                "electron form factors (International Tables C 4.3.2.2): electrostatic potential (Å⁻²; 1 Å⁻² = 47.88 V)",
                "neutron scattering lengths: a scattering-length density (fm/Å³; hydrogen is negative)",
            ),
            style={"button_width": "76px", "description_width": "70px"},
            layout=_TOGGLE_LAYOUT,
        )
        self.b_mode = w.ToggleButtons(
            options=B_MODES,
            description="B-factor",
            style={"button_width": "70px", **_TOGGLE_STYLE},
            layout=_TOGGLE_LAYOUT,
        )
        self.b_global = _slider(w.FloatSlider, "b_global", "global B (Å²)")
        self.b_offset = _slider(w.FloatSlider, "b_offset", "B offset (Å²)")
        self.blur = _slider(w.FloatSlider, "blur", "blur (Å²)")
        self.blur.tooltip = "extra B on every atom in the splat (U + blur/8π² on anisotropic atoms), as gemmi's blur"
        self.radius_mode = w.ToggleButtons(
            options=("auto", "radius"),
            description="cutoff",
            style={"button_width": "70px", **_TOGGLE_STYLE},
            layout=_TOGGLE_LAYOUT,
        )
        self.radius = _slider(w.FloatSlider, "radius", "radius (Å)")
        lo, hi, _ = RANGES["density_cutoff"]
        self.density_cutoff = w.FloatLogSlider(
            min=-8,
            max=-2,
            step=0.25,
            base=10,
            description=f"ρ cutoff ({density_units(state.radiation)})",
            style=_STYLE,
            layout=_LAYOUT,
            readout_format=".0e",
        )
        self.spacing = _slider(w.FloatSlider, "spacing", "spacing (Å)", readout_format=".3f")
        self.spacing.continuous_update = False  # each value is a new grid: recompute on release
        self.grid_shape = w.HTML()
        # Only what can run here is offered; the note says why the rest is not.
        self.device = w.Dropdown(options=device_choices(), description="device", style=_STYLE, layout=_LAYOUT)
        self.device_reason = w.HTML(
            f"<small>cuda not offered: {html.escape(cuda_reason)}</small>" if cuda_reason else ""
        )
        self.backend = w.Dropdown(options=("auto",), description="backend", style=_STYLE, layout=_LAYOUT)
        self.backend_reason = w.HTML()
        self._backends_for_device(state.device)
        # These two sit in one row under the section image (section_bar): narrow labels.
        self.slice_axis = w.ToggleButtons(
            options=SLICE_AXES,
            description="slice ⟂",
            style={"button_width": "34px", "description_width": "50px"},
            layout=_TOGGLE_LAYOUT,
        )
        # One step of the slider is one section of the current grid; the position it sets
        # is a depth in Å (state.slice_depths), which a new grid keeps.
        self.slice_index = w.IntSlider(
            min=0, max=0, description="index", style={"description_width": "40px"}, layout={"width": "250px"}
        )
        self.slice_depth = w.HTML()
        self.slice_scale = w.ToggleButtons(
            options=SLICE_SCALES,
            description="colour scale",
            tooltips=("this section's own range", "the whole map's range (compare sections)"),
            style={"button_width": "70px", **_TOGGLE_STYLE},
            layout=_TOGGLE_LAYOUT,
        )
        self.contour_sigmas = w.Text(
            value=format_sigmas(state.contour_sigmas),
            placeholder="none",
            tooltip=f"contour levels in σ above the map mean, e.g. '1, 2' (at most {MAX_CONTOURS}; empty: none); Enter applies",
            description="contours at σ",
            style=_STYLE,
            layout=_LAYOUT,
            continuous_update=False,
        )
        self.iso_sigma = _slider(w.FloatSlider, "iso_sigma", "iso level (σ)")
        self.distort_amplitude = _slider(w.FloatSlider, "distort_amplitude", "distort (Å)")
        self.distort_seed = w.BoundedIntText(
            min=0, max=RANGES["distort_seed"][1], description="seed", style=_STYLE, layout=_LAYOUT
        )
        self.gradient_kind = w.ToggleButtons(
            options=GRADIENT_KINDS,
            description="arrows",
            style={"button_width": "80px", **_TOGGLE_STYLE},
            layout=_TOGGLE_LAYOUT,
        )
        self.region = w.Dropdown(options=[("whole model", "")], description="3D region", style=_STYLE, layout=_LAYOUT)
        self.region_padding = _slider(w.FloatSlider, "region_padding", "region pad (Å)")
        self.ellipsoids = w.Checkbox(description="ADP ellipsoids (50 %)", indent=False)
        self.ellipsoids.tooltip = "the shown atoms' 50 % probability ellipsoids (spheres for isotropic atoms)"
        a, b = state.profile_atoms
        top = max(state.n_atoms - 1, a, b)
        self.profile_a = w.BoundedIntText(
            value=a, min=0, max=top, description="from atom", style=_STYLE, layout=_LAYOUT
        )
        self.profile_b = w.BoundedIntText(value=b, min=0, max=top, description="to atom", style=_STYLE, layout=_LAYOUT)
        self.profile_names = w.HTML()
        self.target_map = w.Text(
            placeholder="empty: undistorted model",
            tooltip="CCP4/MRC map as ρ_target of the density fit; empty: the map of the undistorted model",
            description="ρ target",
            style=_STYLE,
            layout=_LAYOUT,
            continuous_update=False,
        )
        self.table_sort = w.Dropdown(
            options=[("target/model", "ratio"), ("ρ model", "rho"), ("ρ target", "target"), ("index", "index")],
            description="sort atoms by",
            style=_STYLE,
            layout=_LAYOUT,
        )
        self.table_ascending = w.Checkbox(description="ascending", indent=False)
        # The buttons download to the browser (the person's computer, wherever the kernel
        # runs); Workbench.export_map(path) writes on the server, from Python.
        self.export_path = w.Text(
            value="workbench_map.ccp4",
            description="file name",
            tooltip="name of the downloaded map; the gradients and the model are named after it (_gradients.csv, _model.pdb)",
            style=_STYLE,
            layout=_LAYOUT,
        )
        self.export_map = w.Button(
            description="map (CCP4)", icon="download", tooltip="download the map to your browser"
        )
        self.export_gradients = w.Button(
            description="gradients (CSV)", icon="download", tooltip="download the gradients to your browser"
        )
        self.export_model = w.Button(
            description="model (PDB)",
            icon="download",
            tooltip="download the model as shown (distorted positions, ANISOU records kept) to your browser",
        )
        self.export_note = w.HTML()
        self.export_path.observe(lambda _: self._export_note(), names="value")
        self._export_note()

        css = {
            "structure": "wb-structure",
            "path": "wb-structure-path",
            "upload": "wb-structure-upload",
            "adp": "wb-adp",
            "radiation": "wb-radiation",
            "b_mode": "wb-bmode",
            "b_global": "wb-bfactor",
            "b_offset": "wb-boffset",
            "blur": "wb-blur",
            "radius_mode": "wb-radius-mode",
            "radius": "wb-radius",
            "density_cutoff": "wb-cutoff",
            "spacing": "wb-spacing",
            "grid_shape": "wb-grid-shape",
            "device": "wb-device",
            "device_reason": "wb-device-reason",
            "backend": "wb-backend",
            "backend_reason": "wb-backend-reason",
            "slice_axis": "wb-slice-axis",
            "slice_index": "wb-slice-index",
            "slice_depth": "wb-slice-depth",
            "slice_scale": "wb-slice-scale",
            "contour_sigmas": "wb-contours",
            "iso_sigma": "wb-iso",
            "distort_amplitude": "wb-distort",
            "distort_seed": "wb-distort-seed",
            "gradient_kind": "wb-gradient-kind",
            "region": "wb-region",
            "region_padding": "wb-region-padding",
            "ellipsoids": "wb-ellipsoids",
            "profile_a": "wb-profile-a",
            "profile_b": "wb-profile-b",
            "target_map": "wb-target-map",
            "table_sort": "wb-table-sort",
            "table_ascending": "wb-table-asc",
            "export_path": "wb-export-path",
            "export_map": "wb-export-map",
            "export_gradients": "wb-export-grad",
            "export_model": "wb-export-model",
            "export_note": "wb-export-note",
        }
        for attr, cls in css.items():
            getattr(self, attr).add_class(cls)

        # widget attribute -> state trait, bound both ways
        self.bound = [
            "adp",
            "radiation",
            "b_mode",
            "b_global",
            "b_offset",
            "blur",
            "radius_mode",
            "radius",
            "density_cutoff",
            "spacing",
            "device",
            "backend",
            "slice_axis",
            "slice_scale",
            "iso_sigma",
            "distort_amplitude",
            "distort_seed",
            "gradient_kind",
            "region",
            "region_padding",
            "ellipsoids",
            "target_map",
            "table_sort",
            "table_ascending",
        ]
        for name in self.bound:
            self._bind(name)
        self.profile_a.observe(self._profile_changed, names="value")
        self.profile_b.observe(self._profile_changed, names="value")
        state.observe(self._profile_from_state, names="profile_atoms")
        state.observe(self._range_from_state, names=["slice_index", "slice_index_max", "slice_plane", "n_atoms"])
        self.slice_index.observe(self._slice_changed, names="value")
        self.contour_sigmas.observe(self._contours_changed, names="value")
        state.observe(
            lambda ch: self._set_widget(self.contour_sigmas, format_sigmas(ch["new"])), names="contour_sigmas"
        )
        state.observe(lambda ch: self._backends_for_device(ch["new"]), names="device")
        state.observe(lambda _: self._adp_shown(), names="has_anisou")
        self._adp_shown()
        state.observe(self._units_from_state, names="radiation")
        self.structure.observe(self._structure_changed, names="value")
        self.path.observe(self._path_changed, names="value")
        state.observe(self._structure_from_state, names="structure")
        self._structure_from_state(None)
        self.widget = self._layout()

    # ------------------------------------------------------------------ binding

    def _bind(self, name: str) -> None:
        widget = getattr(self, name)
        if name != "region":  # no residues before the model loads (see from_state)
            widget.value = getattr(self.state, name)

        def from_widget(change):
            if self._syncing:
                return
            try:
                with self.batch():
                    if name in _SELECTS_MODE:  # moving "global B" means "use one global B"
                        setattr(self.state, *_SELECTS_MODE[name])
                    setattr(self.state, name, change["new"])
            except traitlets.TraitError as exc:
                self.on_error(str(exc))
                self._set_widget(widget, getattr(self.state, name))

        def from_state(change):
            if name == "region" and change["new"] not in {k for _, k in self.region.options}:
                return  # the residue list arrives with the model: set_regions() shows it then
            self._set_widget(widget, change["new"])

        widget.observe(from_widget, names="value")
        self.state.observe(from_state, names=name)

    def _set_widget(self, widget, value) -> None:
        if widget.value == value:
            return
        self._syncing = True
        try:
            widget.value = value
        finally:
            self._syncing = False

    def _profile_changed(self, change) -> None:
        if self._syncing:
            return
        try:
            with self.batch():
                self.state.profile_atoms = (self.profile_a.value, self.profile_b.value)
        except traitlets.TraitError as exc:
            self.on_error(str(exc))

    def _profile_from_state(self, change) -> None:
        a, b = change["new"]
        self._set_widget(self.profile_a, a)
        self._set_widget(self.profile_b, b)

    def _range_from_state(self, change) -> None:
        self._syncing = True
        try:
            # Two messages, the range first: in one message the browser's slider applied
            # the value against the old range (0 … 0) and showed 0 under a section at 28.
            self.slice_index.max = self.state.slice_index_max
            self.slice_index.value = self.state.slice_index
            top = max(self.state.n_atoms - 1, 0)
            self.profile_a.max = self.profile_b.max = top
        finally:
            self._syncing = False
        s = self.state
        if s.slice_plane > 0:
            depth = s.slice_index * s.slice_plane
            thick = (s.slice_index_max + 1) * s.slice_plane
            self.slice_depth.value = f"<small>depth {depth:.2f} Å of {thick:.2f} Å ⊥ {s.slice_axis}</small>"

    def _slice_changed(self, change) -> None:
        # The slider moves one section of the current grid; what is kept is its depth in Å.
        if self._syncing or self.state.slice_plane <= 0:
            return
        try:
            with self.batch():
                self.state.slice_depths = self.state.with_depth(change["new"] * self.state.slice_plane)
        except traitlets.TraitError as exc:
            self.on_error(str(exc))

    def _contours_changed(self, change) -> None:
        if self._syncing:
            return
        try:
            levels = parse_sigmas(change["new"])
            with self.batch():
                self.state.contour_sigmas = levels
        except (ValueError, traitlets.TraitError) as exc:
            self.on_error(f"contours at σ: {exc}")
            self._set_widget(self.contour_sigmas, format_sigmas(self.state.contour_sigmas))
            return
        # the state sorts and drops repeats: show what is drawn
        self._set_widget(self.contour_sigmas, format_sigmas(self.state.contour_sigmas))

    def _adp_shown(self) -> None:
        # Only a model with ANISOU has two ADP maps to choose between.
        has = self.state.has_anisou
        self.adp.disabled = not has
        self.adp.layout.display = "flex" if has else "none"

    def _units_from_state(self, change) -> None:
        self.density_cutoff.description = f"ρ cutoff ({density_units(change['new'])})"

    def _export_base(self) -> tuple[str, str]:
        name = self.export_path.value.strip().replace("\\", "/").rsplit("/", 1)[-1] or "workbench_map.ccp4"
        stem = name.rsplit(".", 1)[0] if "." in name else name
        return name, stem.removesuffix("_map") or stem

    def export_names(self) -> tuple[str, str]:
        """File names of the map and gradient downloads: the name box's (a folder part dropped), and
        ``<base>_gradients.csv`` with ``<base>`` its stem less a trailing ``_map`` (each file named after
        what it holds: workbench_map.ccp4, workbench_gradients.csv)."""
        name, base = self._export_base()
        return name, f"{base}_gradients.csv"

    def model_name(self) -> str:
        """File name of the model download, ``<base>_model.pdb`` (see :meth:`export_names`)."""
        return f"{self._export_base()[1]}_model.pdb"

    def _export_note(self) -> None:
        map_name, csv_name = self.export_names()
        self.export_note.value = (
            f"<small>downloads {html.escape(map_name)} / {html.escape(csv_name)} to your browser (the model: "
            f"{html.escape(self.model_name())}); <code>wb.export_map(path)</code> in Python writes on the server</small>"
        )

    def refresh_backends(self) -> None:
        """Offer the backends runnable now (after :func:`kernels.register_backend`)."""
        self._backends_for_device(self.state.device)

    def _backends_for_device(self, device: str) -> None:
        runnable, why_not = backend_choices(device)
        self._syncing = True
        try:
            self.backend.options = runnable
            self.backend.value = self.state.backend if self.state.backend in runnable else "auto"
        finally:
            self._syncing = False
        note = "; ".join(f"{name}: {why}" for name, why in why_not.items())
        self.backend.tooltip = f"not offered on {device}: {note}" if note else None
        self.backend_reason.value = f"<small>not offered on {device}: {html.escape(note)}</small>" if note else ""

    def _structure_changed(self, change) -> None:
        if self._syncing or change["new"] == "file":
            return
        self.state.structure = change["new"]

    def _path_changed(self, change) -> None:
        if self._syncing or not change["new"].strip():
            return
        self.state.structure = change["new"].strip()

    def _structure_from_state(self, change) -> None:
        value = self.state.structure
        self._syncing = True
        try:
            if value in EXAMPLES:
                self.structure.value = value
            else:
                self.structure.value = "file"
                if not value.startswith("<memory"):
                    self.path.value = value
        finally:
            self._syncing = False

    def set_regions(self, options: list[tuple[str, str]]) -> None:
        """Residues offered for the 3D region, ``(label, key)`` pairs."""
        self._syncing = True
        try:
            self.region.options = [("whole model", ""), *options]
            self.region.value = self.state.region if any(k == self.state.region for _, k in options) else ""
        finally:
            self._syncing = False

    # ------------------------------------------------------------------ layout

    def _layout(self) -> widgets.Widget:
        w = widgets
        # (title, CSS name, button label, widgets): the groups of controls, one shown at a time
        # under a row of buttons that name them (tabs in rows of four), so the panel
        # is never taller than the buttons and the tallest group, and it stands beside the views
        # on a 1366×768 laptop screen in JupyterLab with the file browser open. A new group (a
        # "relax" group, say) is one more entry here or one add_section call. The structure
        # choice stays above the groups; the slice axis and index sit under the section image
        # (:attr:`section_bar`), where a person watches what they move.
        sections = [
            ("density", "density", "density", [
                self.b_mode, self.b_global, self.b_offset, self.radius_mode, self.radius, self.density_cutoff,
                self.spacing, self.grid_shape,
            ]),
            ("model file, ADPs and radiation", "adps", "model", [
                self.path, self.upload, self.adp, self.radiation, self.blur,
            ]),
            ("section colours and contours", "section", "section", [self.slice_scale, self.contour_sigmas]),
            ("3D view and gradients", "3d", "3D", [
                self.iso_sigma, self.region, self.region_padding, self.ellipsoids, self.gradient_kind,
                self.distort_amplitude, self.distort_seed, self.target_map,
            ]),
            ("compute", "compute", "compute", [self.device, self.device_reason, self.backend, self.backend_reason]),
            ("profile and atom table", "profile", "profile", [
                self.profile_a, self.profile_b, self.profile_names, self.table_sort, self.table_ascending,
            ]),
            ("export", "export", "export", [
                self.export_path, w.HBox([self.export_map, self.export_gradients]), self.export_model,
                self.export_note,
            ]),
        ]  # fmt: skip
        # Sliders with their label on a line of its own: the track gets the panel's whole width
        # (300 px: 1 px per Å² of global B, 0.04 Å of radius), not what a label and readout leave.
        for slider in (
            self.b_global, self.b_offset, self.blur, self.radius, self.density_cutoff, self.spacing, self.iso_sigma,
            self.distort_amplitude, self.region_padding,
        ):  # fmt: skip
            slider.add_class("wb-wide")
            slider.layout = w.Layout(width="100%")
        self.sections: dict[str, widgets.VBox] = {}
        self.section_buttons: dict[str, widgets.Button] = {}
        # Every group stays in the page (hidden but the open one), so a control keeps its place and
        # state when another group is shown (a Stack would draw only the open one).
        self.stack = w.VBox(children=[])
        self.stack.add_class("wb-sections")
        self._open: str | None = None
        self.group_bar = w.GridBox(
            layout=w.Layout(grid_template_columns="repeat(4, 1fr)", grid_gap="2px", width="100%")
        )
        self.group_bar.add_class("wb-section-tabs")
        for title, css, label, items in sections:
            self._add_group(title, css, label, w.VBox(items))
        self.section_bar = w.HBox(
            [self.slice_axis, self.slice_index, self.slice_depth], layout=w.Layout(align_items="center")
        )
        self.section_bar.add_class("wb-section-bar")
        # never squeezed by the views beside it (a narrow notebook cuts the sliders otherwise)
        panel = w.VBox(
            [self.structure, self.group_bar, self.stack],
            layout=w.Layout(width=f"{PANEL_WIDTH}px", min_width=f"{PANEL_WIDTH}px", flex=f"0 0 {PANEL_WIDTH}px"),
        )
        panel.add_class("wb-controls")
        return panel

    def add_section(self, title: str, css: str, widget: widgets.Widget, *, label: str | None = None) -> None:
        """Add a group of controls: a button ``label`` (default ``title``; CSS ``wb-section-tab
        wb-section-tab-<css>``) that shows ``widget`` in the panel (in a box of CSS ``wb-section wb-section-<css>``)."""
        self._add_group(title, css, label or title, widgets.VBox([widget]))

    def _add_group(self, title: str, css: str, label: str, box: widgets.VBox) -> None:
        box.add_class("wb-section")
        box.add_class(f"wb-section-{css}")
        self.sections[title] = box
        button = widgets.Button(description=label, tooltip=title, layout=widgets.Layout(width="auto"))
        button.add_class("wb-section-tab")
        button.add_class(f"wb-section-tab-{css}")
        button.on_click(lambda _b, t=title: self.open_section(t))
        self.section_buttons[title] = button
        self.stack.children = [*self.stack.children, box]
        self.group_bar.children = [*self.group_bar.children, button]
        if self._open is None:
            self.open_section(title)
        else:
            box.layout.display = "none"

    def open_section(self, title: str) -> None:
        """Show the group of controls ``title`` (its button marked as the open one)."""
        if title not in self.sections:
            raise KeyError(f"no group of controls {title!r}; groups: {list(self.sections)}")
        self._open = title
        for name, box in self.sections.items():
            box.layout.display = None if name == title else "none"
        for name, button in self.section_buttons.items():
            button.button_style = "info" if name == title else ""
            if name == title:
                button.add_class("wb-section-open")
            else:
                button.remove_class("wb-section-open")

    @property
    def open_title(self) -> str:
        """The title of the group of controls shown."""
        return self._open
