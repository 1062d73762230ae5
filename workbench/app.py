"""The Workbench: controls, views and the debounced recompute, assembled into one app."""

from __future__ import annotations

import html
import logging
import os
import tempfile
import threading
import time
import traceback
from pathlib import Path

import ipywidgets as widgets

import kernels
from workbench import compute
from workbench.compute import Cancelled, Pipeline, Result, WorkbenchError
from workbench.compute.text import count
from workbench.scheduler import LatestOnly, Scheduler
from workbench.state import INPUTS, WorkbenchState, backend_choices, cuda_unavailable_reason
from workbench.views import (
    AtomTableView,
    DifferenceView,
    Download,
    ProfileView,
    RelaxView,
    ResolutionView,
    Scene3DView,
    SliceView,
    StatusView,
    TimingView,
)
from workbench.views.controls import Controls

__all__ = ["Workbench"]

log = logging.getLogger("workbench")

# Traits whose change needs a recompute: the fields of a Settings snapshot (the traits
# tagged set_by_app are written by the app from a result).
_INPUTS = list(INPUTS)

# Seconds between 3D scene updates while a drag is still sending newer settings.
_SCENE_INTERVAL = 1.0
# Longest a relax frame waits for the browser to draw the one before (a page that never
# answers, or none at all, must not stall the drawing of later frames).
_RENDER_WAIT = 2.0
# Longest pause after a drawn relax frame before the next is sent (at most half its drawing time).
_FRAME_GAP = 0.25
# A new map waits this long in the browser for a newer one before it is contoured (a drag sends
# many); relax frames, which the loop sends one at a time, are contoured at once.
_ISO_QUIET_MS = 300
# Models above this many atoms open with the first residue as 3D region, not the whole model.
_WHOLE_MODEL_ATOMS = 5000


def _write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` as :func:`kernels.write_map` writes a map: complete or not at
    all, and only to a regular file or a new path (ValueError naming what else it is)."""
    from kernels.mapio import write_output

    data = text.encode("utf-8")
    return write_output(path, lambda tmp: Path(tmp).write_bytes(data))


# The app's own CSS (class names as in the Workbench docstring). A wide slider puts its label on
# a line of its own so its track spans the panel; captions are compact, with details on demand.
_STYLE = """<style>
.wb-app .widget-hslider.wb-wide {flex-wrap: wrap; height: auto !important; margin-bottom: 4px}
.wb-app .widget-hslider.wb-wide > .widget-label {order: 0; flex: 1 1 auto; width: auto !important; max-width: none;
  text-align: left; height: 18px; line-height: 18px; margin-bottom: 0}
.wb-app .widget-hslider.wb-wide > .widget-readout {order: 1; height: 18px; line-height: 18px; margin: 0 4px 0 0}
.wb-app .widget-hslider.wb-wide > .slider-container {order: 2; flex: 0 0 100%; height: 22px !important;
  display: flex; align-items: center; margin-left: 0; margin-right: 0}
.wb-app .widget-hslider.wb-wide > .slider-container > .slider {flex: 1 1 auto}
.wb-app .wb-section-bar {flex-wrap: wrap}
.wb-app .wb-section-tabs .widget-button {padding: 0 4px; height: 26px; line-height: 26px}
.wb-app .wb-caption-text {font-size: 12px; line-height: 1.35; color: #333}
.wb-app details.wb-details > summary {cursor: pointer}
.wb-app details.wb-details > div {margin-top: 2px}
</style>"""


def _scene_keys(r: Result) -> tuple:
    """The 3D view's model and map keys of what ``r`` shows: a relax frame's own (unique per run and
    step), else the model's and distortion's (the sticks do not depend on B) and the map's."""
    if "relax" in r.atoms_key:
        return r.atoms_key, r.map_key
    return (r.atoms_key[0], r.atoms_key[2]), r.map_key


def _friendly(exc: BaseException) -> str:
    """A one-line message for an unexpected error (the traceback goes to the log, not the notebook)."""
    if isinstance(exc, (kernels.BackendError, kernels.GridError, kernels.ModelError)):
        return f"{exc}"
    if isinstance(exc, MemoryError) or "out of memory" in str(exc).lower():
        return f"out of memory ({exc}): choose a coarser spacing or a smaller region"
    return f"unexpected {type(exc).__name__}: {exc} — try backend 'auto' or 'reference'; details in the 'workbench' log"


class Workbench(widgets.VBox):
    """Live controls and views on the production kernels, as one widget.

    Parameters
    ----------
    model : kernels.Model, str, path-like or None
        A model read already, a bundled example name (``"1orc"``, ``"1pfe"``, ``"1aki"``),
        or a PDB/mmCIF path. Default: the bundled 1ORC example.
    debounce : float
        Seconds of quiet after a change before recomputing (default 0.02;
        during a continuous drag a recompute still starts every 0.25 s). ``0``
        recomputes synchronously inside every change (deterministic; for tests and
        scripts).
    threaded : bool
        Recompute on a worker thread (default). With ``False`` and ``debounce > 0``
        nothing runs until :meth:`poll` or :meth:`flush` is called (tests with a fake clock).
    clock : callable
        Monotonic seconds for the debouncer (a fake clock in tests).
    lib_path : str or path-like, optional
        Local ``3Dmol-min.js`` for the 3D view; default ``$WORKBENCH_3DMOL_JS``, else the CDN.
    **settings
        Initial values of :class:`~workbench.state.WorkbenchState` traits, e.g. ``spacing=1.0``.

    Notes
    -----
    Stable CSS classes (for browser tests and styling): ``wb-app`` (the whole app),
    ``wb-status`` (status line; also ``wb-status-idle|busy|warning|error|cancelled``),
    ``wb-progress``, ``wb-cancel``; controls ``wb-structure`` (examples),
    ``wb-structure-path`` (text, Enter loads), ``wb-structure-upload``, ``wb-adp`` (anisotropic /
    isotropic; shown only for a model with ANISOU), ``wb-radiation``, ``wb-bmode``,
    ``wb-bfactor`` (global B slider; moving it selects global mode), ``wb-boffset``, ``wb-blur``,
    ``wb-radius-mode``, ``wb-radius``, ``wb-cutoff``, ``wb-spacing``, ``wb-grid-shape``,
    ``wb-device``, ``wb-device-reason``, ``wb-backend``, ``wb-backend-reason`` (why the
    backends not offered cannot run here), ``wb-slice-axis``, ``wb-slice-index`` (one step
    is one section of the current grid; the position kept is a depth in Å),
    ``wb-slice-depth``, ``wb-slice-scale``, ``wb-contours`` (σ levels, "1, 2"), ``wb-iso``, ``wb-distort`` (distortion amplitude),
    ``wb-distort-seed``, ``wb-gradient-kind``, ``wb-region``, ``wb-region-padding``, ``wb-ellipsoids``,
    ``wb-profile-a``, ``wb-profile-b``, ``wb-target-map``, ``wb-table-sort``,
    ``wb-table-asc``, ``wb-export-path`` (the downloaded file's name), ``wb-export-map``, ``wb-export-grad``,
    ``wb-export-model`` (download to the browser), ``wb-export-note``, ``wb-download`` (the download widget); views
    ``wb-slice`` (the section PNG), ``wb-slice-caption``, ``wb-view3d`` (the 3Dmol.js
    widget; its canvas sits in ``wb-view3d-canvas``), ``wb-view3d-caption`` (arrow
    scale), ``wb-picked-atom`` (the picked atom's label as text; the 3D widget's
    ``data-label`` holds the same), ``wb-profile``, ``wb-atom-table``, ``wb-diff-a``, ``wb-diff-b``,
    ``wb-diff-run``, ``wb-diff-slice``, ``wb-diff-stats``, ``wb-timing``,
    ``wb-compare-all``, ``wb-timing-all``; ``wb-stale`` marks a note that a tab's result
    is out of date. The controls below the structure choice are groups, one shown at a time
    in ``wb-sections`` (each ``wb-section``, also
    ``wb-section-density|adps|section|3d|compute|profile|export|relax``), chosen by the buttons of
    ``wb-section-tabs`` (each ``wb-section-tab`` and ``wb-section-tab-<group>``; the open one also
    ``wb-section-open``); a slider whose track spans the panel is ``wb-wide``; the slice axis, index and
    depth sit under the section image in ``wb-section-bar``. The relax section holds
    ``wb-relax-steps``, ``wb-relax-lr``, ``wb-relax-lambda``, ``wb-relax-start``, ``wb-relax-stop`` and
    ``wb-relax-progress`` (:meth:`start_relax`).

    Examples
    --------
    >>> wb = Workbench("1pfe", spacing=1.0, debounce=0)   # doctest: +SKIP
    >>> wb.controls.b_global.value = 30.0                   # recomputes; see wb.result
    """

    def __init__(
        self,
        model=None,
        *,
        debounce: float = 0.02,
        threaded: bool = True,
        clock=time.monotonic,
        lib_path=None,
        **settings,
    ):
        memory = {}
        if model is None:
            source = "1orc"
        elif isinstance(model, kernels.Model):
            name = model.path.name if model.path else "model"
            source = f"<memory:{name}>"
            memory[source] = model
        else:
            source = str(model)
        self.state = WorkbenchState(structure=source)
        self.pipeline = Pipeline(memory)
        self.cuda_reason = cuda_unavailable_reason()
        self.status = StatusView()
        self.scheduler = Scheduler(self._recompute, delay=debounce, threaded=threaded, clock=clock)
        self.controls = Controls(self.state, self._control_error, self.cuda_reason, batch=self.scheduler.batch)
        self.slice = SliceView(tools=self.controls.section_bar)
        self.profile = ProfileView()
        self.table = AtomTableView()
        self.scene = Scene3DView(lib_path=lib_path)
        self.difference = DifferenceView(lib_path=lib_path)
        self.timing = TimingView()
        self.resolution = ResolutionView()
        self._resolution_cache = compute.ResolutionCache()
        self._truncated_shown = False  # the section and 3D view show the map truncated at the resolution slider's d
        self.download = Download()
        self.relax = RelaxView()
        self.controls.add_section("relax", "relax", self.relax.widget)
        self.relax_frame = None  # the RelaxFrame the views show (None: they show the settings' result)
        self._relax_stop: threading.Event | None = None
        self._relax_runs = 0
        self._relax_reference = None  # (run, FactorReference) of the relax view's R and correlation
        self._frames = LatestOnly(self._show_frame, threaded=self.scheduler.threaded)
        self.result: Result | None = None
        self.difference_result = None
        self.n_applied = 0
        self.picked_atom: int | None = None  # the atom labelled in 3D (pick_atom)
        self.n_stale = 0
        self._applied_generation = -1
        self._upload_dir: str | None = None
        self._model_version = None
        self._scene_time = -1e9
        self._region_note = ""
        self._timing_inputs: tuple | None = None  # comparison_inputs the timing table is for
        self._timing_label = ""
        # structure -> its slice depths and 3D region: going back to a model goes back to
        # its sections and residue; a residue key ("A/3") names another residue in another model
        self._depths_by_structure: dict[str, tuple] = {}
        self._region_by_structure: dict[str, str] = {}

        # The views' tabs under the section and the 3D view: one add_tab per view.
        self.tabs = widgets.Tab()
        for title, view in (
            ("line profile", self.profile.widget),
            ("density at atoms", self.table.widget),
            ("difference", self.difference.widget),
            ("timing", self.timing.widget),
            ("resolution", self.resolution.widget),
        ):
            self.add_tab(title, view)
        # The section scales with its column (its PNG is drawn at 560 px) down to 300 px and never
        # below: an image with max-width 100 % in a shrinking flex item was drawn at 20 × 17 px.
        self.slice.widget.layout = widgets.Layout(flex="1 1 300px", min_width="300px", max_width="570px")
        self.slice.image.layout = widgets.Layout(width="100%", max_width="560px", height="auto")
        self.difference.slice.widget.layout.flex = "0 0 auto"
        # 340 + 300 + 280 px: the controls, the section and the 3D view fit the 934 px a 1366-px Lab
        # screen leaves a notebook's output with the file browser open
        self.scene.widget.layout = widgets.Layout(flex="1 1 300px", min_width="280px")
        views = widgets.HBox(
            [self.slice.widget, self.scene.widget], layout=widgets.Layout(flex="1 1 600px", min_width="580px")
        )
        # Controls in a column beside the views at every width: a person drags a slider while
        # watching the section and the 3D view it changes (never controls under the views).
        body = widgets.HBox(
            [self.controls.widget, views], layout=widgets.Layout(flex_flow="row nowrap", align_items="flex-start")
        )
        body.add_class("wb-body")
        self._style = widgets.HTML(_STYLE, layout=widgets.Layout(height="0px", margin="0"))
        super().__init__([self._style, self.status.widget, body, self.tabs, self.download])
        self.add_class("wb-app")

        self.status.cancel.on_click(lambda _: self.cancel())
        self.difference.run.on_click(lambda _: self.compare())
        self.timing.compare.on_click(lambda _: self.compare_all_backends())
        self.controls.export_map.on_click(lambda _: self._export("map"))
        self.controls.export_gradients.on_click(lambda _: self._export("gradients"))
        self.controls.export_model.on_click(lambda _: self._export("model"))
        self.controls.upload.observe(self._uploaded, names="value")
        self.relax.start.on_click(lambda _: self.start_relax())
        self.relax.stop.on_click(lambda _: self.stop_relax())
        self.scene.view.on_pick(self.pick_atom)
        self.table.on_pick(self.pick_atom)
        self.tabs.observe(lambda _: self.show_resolution(), names="selected_index")
        self.resolution.d.observe(lambda _: self._show_truncated(), names="value")

        for name, value in settings.items():
            if name not in _INPUTS:
                raise TypeError(f"Workbench got an unknown setting {name!r}; settings are {_INPUTS}")
            setattr(self.state, name, value)
        self.state.observe(self._changed, names=_INPUTS)
        self.status.set("busy", f"computing: reading {self.state.structure} …")
        self.scheduler.changed()

    # ------------------------------------------------------------------ public API

    def set(self, **values) -> None:
        """Set several state traits at once with a single recompute."""
        with self.scheduler.batch():
            if "structure" in values:
                # first, on its own: a new model resets the depths and region, and those
                # given in the same call apply to the new model
                self.state.structure = values.pop("structure")
            with self.state.hold_trait_notifications():
                for name, value in values.items():
                    setattr(self.state, name, value)

    def flush(self, timeout: float = 120.0) -> None:
        """Run any pending recompute now and wait until the app is idle (tests, scripts)."""
        self.scheduler.flush(timeout)

    def poll(self) -> bool:
        """Run a due recompute in this thread (``threaded=False``); True if one ran."""
        return self.scheduler.poll()

    def cancel(self) -> None:
        """Cancel the running computation at its next stage (the status line says so)."""
        self.scheduler.cancel()

    def close(self) -> None:
        """Stop the worker thread and close every widget of the app."""
        self.stop_relax()
        self.scheduler.close()
        self._frames.close()

        def close_tree(w):
            for child in getattr(w, "children", ()):
                close_tree(child)
            w.close()

        for child in self.children:
            close_tree(child)
        super().close()

    def start_relax(self, steps: int | None = None, lr: float | None = None, lam: float | None = None) -> None:
        """Fit the atoms shown to ρ_target on the workbench's device and backend (:mod:`workbench.compute.relax`).

        Starts from the current result's atoms (the distorted model when a distortion is set) against its
        ρ_target (the loaded target map, or the map of the undistorted model), with the splat's settings.
        Runs on the worker thread; each step's frame (positions, map, both gradients, timings) goes to the
        views, and the next step starts once they show it (drawn in the browser when one is attached), so
        every value on screen is that step's and the loop is never more than one step ahead of it.
        :meth:`stop_relax`, or a change of any setting (which recomputes from the settings), ends the run at
        the step shown or the one after. Arguments left out come from the relax control.
        """
        if self._relax_stop is not None and not self._relax_stop.is_set():
            return  # one run at a time
        for widget, value in ((self.relax.steps, steps), (self.relax.lr, lr), (self.relax.lam, lam)):
            if value is not None:
                widget.value = value
        r = self.result
        if r is None:
            self.status.set("error", "error: nothing computed yet to relax: wait for the status line to say ready")
            return
        stop = self._relax_stop = threading.Event()
        self.relax.running(True)
        args = (r, int(self.relax.steps.value), float(self.relax.lr.value), float(self.relax.lam.value), stop)
        self.scheduler.submit(lambda: self._relax_job(*args))

    def stop_relax(self) -> None:
        """End a relax run after the step it is in (the views keep its last frame)."""
        if self._relax_stop is not None:
            self._relax_stop.set()

    def add_tab(self, title: str, widget: widgets.Widget) -> None:
        """Add a view as one more tab under the section and the 3D view (after the others)."""
        self.tabs.children = [*self.tabs.children, widget]
        self.tabs.set_title(len(self.tabs.children) - 1, title)

    def refresh_backends(self) -> None:
        """Offer the backends runnable now in the backend and compare lists (after :func:`kernels.register_backend`
        or :func:`kernels.unregister_backend`); a chosen backend that is gone falls back to ``auto``."""
        if self.state.backend not in backend_choices(self.state.device)[0]:
            self.state.backend = "auto"
        self.controls.refresh_backends()
        self.difference.refresh_choices()

    def compare(self, a: str | None = None, b: str | None = None) -> None:
        """Run the difference view on ``device:backend`` pairs ``a`` and ``b`` (default: its dropdowns).

        A pair may name a backend registered with :func:`kernels.register_backend` (``"cpu:mine"``).
        """
        self.difference.refresh_choices()
        if a is not None:
            self.difference.a.value = a
        if b is not None:
            self.difference.b.value = b
        self.scheduler.submit(self._compare_job)

    def compare_all_backends(self) -> None:
        """Time forward and backward of every backend that can run here (timing panel)."""
        self.scheduler.submit(self._timing_job)

    def export_map(self, path: str | os.PathLike) -> Path:
        """Write the current model map as a CCP4/MRC file (:func:`kernels.write_map`) where
        this Python runs (the server); the export buttons download to the browser instead."""
        r = self._require_result()
        return kernels.write_map(path, r.rho, r.grid, radiation=r.settings.radiation)

    def export_gradients(self, path: str | os.PathLike) -> Path:
        """Write the current gradients (one row per atom) as CSV where this Python runs (the server)."""
        r = self._require_result()
        if r.gradient is None:
            raise WorkbenchError(f"no gradient to export: {r.unavailable.get('gradient', 'none computed')}")
        text = compute.gradients_csv(r.model, r.atoms.xyz.numpy(), r.gradient.grad, r.gradient.kind, r.gradient.units)
        return _write_text(path, text)

    def export_model(self, path: str | os.PathLike) -> Path:
        """Write the model as shown (the current, possibly distorted, positions) as PDB where this
        Python runs (the server); ANISOU records are kept as read (:func:`workbench.compute.model_pdb`)."""
        r = self._require_result()
        return _write_text(path, compute.model_pdb(r.model, r.atoms.xyz))

    def pick_atom(self, index: int) -> None:
        """Select atom ``index`` (a click on it in the 3D view or on its atom-table row): a
        label at the atom gives its name, B (B_eq), occupancy, ρ and |∇|; its residue
        becomes the 3D region, the line profile runs from the last picked endpoint to it,
        and the atom table shows its row highlighted."""
        r = self.result
        if r is None:
            return
        try:
            region = compute.residue_of_atom(r.model, index)
        except WorkbenchError as exc:
            self.status.set("error", f"error: {exc}")
            return
        last = self.state.profile_atoms[1]
        self.picked_atom = index
        # labelled at once from the result on show; the recompute for the new region and
        # profile labels it again with its own values
        self._show_pick(r)
        self.set(region=region, profile_atoms=(last, index) if last != index else self.state.profile_atoms)

    def to_py3dmol(self, width: int = 640, height: int = 480):
        """A py3Dmol view of the current 3D scene (model, isosurface, arrows)."""
        return self.scene.to_py3dmol(width, height)

    # ------------------------------------------------------------------ internals

    def _require_result(self) -> Result:
        if self.result is None:
            raise WorkbenchError("nothing computed yet: wait for the status line to say ready")
        return self.result

    def _changed(self, change) -> None:
        self.stop_relax()  # the views follow the settings again
        with self.scheduler.batch():
            if change["name"] in ("region", "structure") and change["new"]:
                self._region_note = ""  # the person chose again: the note about a bad region is old
            if change["name"] == "structure":
                # Depths are the old model's: the new one opens on its own middle (or on
                # where the person left it, if it was shown before).
                self._depths_by_structure[change["old"]] = self.state.slice_depths
                self.state.slice_depths = self._depths_by_structure.get(change["new"], (None, None, None))
                # the same for the 3D region: a residue key of the old model is not the same
                # residue of the new one (A/3 is GLN 3 in 1ORC, another residue elsewhere)
                self._region_by_structure[change["old"]] = self.state.region
                self.state.region = self._region_by_structure.get(change["new"], "")
            self.scheduler.changed()

    def _relax_job(self, r: Result, steps: int, lr: float, lam: float, stop: threading.Event) -> None:
        self.status.set("busy", f"relax: {steps} steps of Adam (lr {lr:g} Å, λ {lam:g}) on {r.settings.device} …")
        first = last = None
        self._relax_runs += 1
        run = self._relax_runs
        dropped_before = self._frames.n_dropped

        def emit(frame):
            # Paced by the views: the next step starts once this frame is on screen (drawn in the
            # browser, or by this process when none is attached), so the loop is never more than
            # one step ahead of what a person sees, and a stop ends it at the step shown.
            nonlocal first, last
            first = first or frame
            last = frame
            self._frames.put((r, steps, run, dropped_before, frame, stop))
            self._frames.wait_idle(timeout=_RENDER_WAIT + 30.0)

        try:
            if stop.is_set():
                raise compute.Cancelled()
            planes = r.planes if r.planes is not None else compute.find_planes(r.model)
            problem = compute.relax_problem(r.atoms, r.grid, r.target, planes, r.settings, reference=r.model.atoms.xyz)
            done = compute.run_relaxation(compute.Relaxation(problem, lr=lr, lam=lam), steps, stop=stop, emit=emit)
            self._frames.wait_idle()
            how = "stopped" if done < steps else "finished"
            message = f"relax {how} after {count(done, 'step')}"
            if first is not None and last.rmsd is not None:
                message += f": RMSD to the model {first.rmsd:.3f} → {last.rmsd:.3f} Å"
            if done:
                message += (
                    f", L {first.loss:.4g} → {last.loss:.4g}. The views show step {last.step + 1}; changing any "
                    "setting discards the relaxed positions and recomputes from the settings"
                )
            self.relax.done(message)
            self.status.set("idle", message)
        except compute.Cancelled:
            self.relax.done("relax stopped before its first step")
        except (WorkbenchError, ValueError) as exc:
            self.relax.done(f"relax failed: {exc}")
            self.status.set("error", f"error: relax: {exc}")
        except Exception as exc:  # noqa: BLE001 - the notebook gets a sentence, the log the traceback
            log.error("workbench relax failed:\n%s", traceback.format_exc())
            self.relax.done(f"relax failed: {_friendly(exc)}")
            self.status.set("error", f"error: relax: {_friendly(exc)}")
        finally:
            stop.set()
            self.relax.running(False)

    def _show_frame(self, item) -> None:
        """Draw one relax frame: atoms and arrows in 3D, the section, the step's timings."""
        # every frame of a run is drawn or dropped before the job ends (wait_idle), so before the
        # recompute of a changed setting, which runs on the same worker after it: none covers a newer result
        r, steps, run, dropped_before, frame, stop = item
        s = r.settings
        shown = compute.frame_result(r, frame, key=(run, frame.step))
        view = self.scene.view
        before = view.n_rendered
        # nothing newer comes until this frame is drawn (the loop waits for it): no quiet period
        view.iso_delay_ms = 0
        # The 3D scene goes first, in one message with the picked atom's label: the browser draws it
        # (its longest part) while this thread makes the section and the rest. Step 0 describes the
        # run's start, the positions and map on screen already: their keys are the start's, so the
        # sticks and the map box are not sent (and drawn) again. Later steps move the sticks shown
        # (positions only) and cut their map in the box of the settings' positions (the model and
        # distortion the run started from): the atoms move by much less than its padding
        model_key, map_key = _scene_keys(r) if frame.step == 0 else _scene_keys(shown)
        with view.hold_sync():
            redrawn = self.scene.update(
                shown,
                model_key=model_key,
                map_key=map_key,
                move_atoms=True,
                geometry_key=(r.atoms_key[0], r.atoms_key[2]),
            )
            # every value on screen is the frame's: the picked atom's label, the atom table, the profile
            label = (list(view.label_lines), list(view.label_xyz))
            self._show_pick(shown)
            redrawn = redrawn or label != (list(view.label_lines), list(view.label_xyz))
        self._draw_section(s, shown.section, shown.near, shown.mean, shown.sigma, r.model)
        self._show_tricubic(shown)
        self.timing.update_step(
            frame.timings, step=frame.step, backend=frame.density_gradient.backend, device=s.device,
            grid_shape=r.grid.shape, n_atoms=len(r.model),
        )  # fmt: skip
        self.relax.show(frame, steps, self._frames.n_dropped - dropped_before)
        self.relax_frame = frame
        self.result = shown  # export and pick see the positions shown
        # while the browser draws the frame: its factors against ρ_target's (one FFT, each frame drawn)
        self._show_agreement(r, run, frame)
        if before > 0 and redrawn:
            # a browser draws this view: one update in flight, so wait until it has drawn this one.
            # A stop ends the wait: the run ends at this frame, which the page draws without a newer one
            drawn_at = time.monotonic()
            deadline = drawn_at + _RENDER_WAIT
            while view.n_rendered == before and time.monotonic() < deadline and not stop.wait(0.005):
                pass
            # then leave the page a moment without a new frame: a page that draws back to back
            # handles a click (stop) only after the frames queued before it
            stop.wait(min(_FRAME_GAP, 0.5 * (time.monotonic() - drawn_at)))

    def _show_agreement(self, r: Result, run: int, frame) -> None:
        """Plot ``frame``'s R-factor and correlation against ρ_target's structure factors (made once a run)."""
        try:
            if self._relax_reference is None or self._relax_reference[0] != run:
                target = r.target.to(frame.rho.device, frame.rho.dtype)
                self._relax_reference = (run, compute.factor_reference(target, r.grid, blur=r.settings.blur))
            reference = self._relax_reference[1]
            rf, cc = compute.factor_agreement(frame.rho, r.grid, reference)
        except (WorkbenchError, kernels.GridError, ValueError) as exc:
            self.relax.plot.value = f"<small>no R-factor plot: {html.escape(str(exc))}</small>"
            return
        what = "a loaded map" if r.settings.target_map else "the undistorted model"
        self.relax.show_agreement(
            frame.step, rf, cc, f"|F| to {reference.d_min:.3g} Å against ρ_target's factors ({what}), each frame drawn"
        )

    def _control_error(self, message: str) -> None:
        self.status.set("error", message)

    def _uploaded(self, change) -> None:
        files = change["new"]
        if not files:
            return
        f = files[0]
        try:
            if self._upload_dir is None:
                self._upload_dir = tempfile.mkdtemp(prefix="workbench-upload-")
            # a folder per upload: the same name uploaded again is a new structure, not a cache hit
            folder = Path(tempfile.mkdtemp(dir=self._upload_dir))
            path = compute.save_upload(f["name"], f["content"], folder)
        except OSError as exc:
            self.status.set("error", f"error: cannot store the uploaded file ({exc}); give its path instead")
            return
        self.state.structure = str(path)

    def _check(self, generation: int):
        """A stage-boundary check: raise Cancelled on the cancel button, or when a newer
        result than ``generation``'s has already been shown (an old result never replaces
        a newer one). Work for settings that are merely superseded runs on: during a
        drag it is what keeps the views live, and its splat lands in the cache."""

        def check():
            if self.scheduler.cancel_requested or generation < self._applied_generation:
                raise Cancelled()

        return check

    def _recompute(self, generation: int) -> None:
        """Compute for the current settings and apply to the views unless a newer result is shown."""
        settings = self.state.snapshot()
        check = self._check(generation)
        try:

            def early(sec, near, mean, sigma):
                # The section is what a drag watches: drawn as soon as it exists, before
                # the planarity and tricubic stages and the other views.
                check()
                if self.resolution.d_min is None:  # else the map truncated at d is drawn once the result is applied
                    self._draw_section(settings, sec, near, mean, sigma, self.pipeline.model(settings.structure))

            result = self.pipeline.run(settings, check=check, progress=self.status.step, on_section=early)
            self._apply(result, generation, check)
        except Cancelled:
            if self.scheduler.cancel_requested:
                self.status.set("cancelled", "cancelled: change a control to compute again")
            else:
                self.n_stale += 1  # a newer result is already shown; nothing to report
        except WorkbenchError as exc:
            if generation == self.scheduler.generation:
                self.status.set("error", f"error: {exc}")
                self._mark_views_stale(settings)
        except Exception as exc:  # noqa: BLE001 - no traceback in the notebook: log it, say what to do
            log.error("workbench recompute failed:\n%s", traceback.format_exc())
            if generation == self.scheduler.generation:
                self.status.set("error", f"error: {_friendly(exc)}")
                self._mark_views_stale(settings)

    def _apply(self, r: Result, generation: int, check) -> None:
        check()
        s = r.settings
        self.result = r
        self.relax_frame = None
        self._applied_generation = generation
        self.n_applied += 1
        shape = "×".join(str(n) for n in r.grid.shape)
        self.controls.grid_shape.value = f"<small>grid {shape} = {r.grid.n_voxels:,} voxels</small>"
        new_model = self._model_version != r.atoms_key[0]
        if new_model:
            self._model_version = r.atoms_key[0]
            self.picked_atom = None  # an index of the old model
            n = len(r.model)
            residues = compute.residue_keys(r.model)
            self.controls.set_regions([(label, key) for key, label in residues])
            with self.state.hold_trait_notifications():
                self.state.n_atoms = n
                self.state.has_anisou = r.model.atoms.u_aniso is not None
                if self.state.region and not any(k == self.state.region for k, _ in residues):
                    # a region given before the model was read (constructor, script): checked now
                    self._region_note = (
                        f"3D region {self.state.region!r} is not a residue of this model "
                        f"(e.g. {residues[0][0]!r}): showing the whole model"
                    )
                    self.state.region = ""
                if n > _WHOLE_MODEL_ATOMS and not self.state.region:
                    self.state.region = residues[0][0]
                a, b = self.state.profile_atoms
                if not (a < n and b < n):
                    self.state.profile_atoms = (0, min(1, n - 1))
        with self.state.hold_trait_notifications():
            self.state.grid_shape = r.grid.shape
            # where the section is on this grid (the setting is its depth in Å)
            self.state.slice_plane = compute.section_depth(r.grid, s.axis, 1)
            self.state.slice_index_max = r.grid.shape[s.axis] - 1
            self.state.slice_index = r.section.index
        self._drop_stale(r)
        check()
        self._show_tricubic(r)
        check()
        # While newer settings are already waiting (a drag), the 3D scene follows at most
        # once a second: the browser re-contours and re-renders it on its main thread
        # (0.4-0.9 s per update in a software-WebGL page), which would hold up the slice.
        now = self.scheduler.debouncer.clock()
        if not self.scheduler.debouncer.pending or now - self._scene_time >= _SCENE_INTERVAL:
            self._scene_time = now
            self.scene.view.iso_delay_ms = _ISO_QUIET_MS
            model_key, map_key = _scene_keys(r)
            self.scene.update(r, model_key=model_key, map_key=map_key, geometry_key=model_key)
        self._show_pick(r)
        self.timing.update(r.timings, backend=r.backend, device=s.device, grid_shape=r.grid.shape, n_atoms=len(r.model))
        self.show_resolution()
        self._show_truncated(scene=self._scene_time == now)  # the 3D view follows as often as above
        self._report(r)

    def _show_tricubic(self, r: Result) -> None:
        """The line profile and the atom table from ``r``'s tricubic samples (or why there are none)."""
        s = r.settings
        names = r.model.atoms.labels
        if r.profile is not None:
            i, j = s.profile_atoms
            dist, values = r.profile
            target = None
            try:
                _, target = compute.line_profile(
                    r.target, r.grid, r.atoms.xyz[i].numpy(), r.atoms.xyz[j].numpy(), backend=s.backend
                )
            except WorkbenchError:
                pass
            self.profile.update(
                dist, values, target, title=f"{names[i]} → {names[j]}, {dist[-1]:.2f} Å (tricubic)", units=s.units
            )
            self.controls.profile_names.value = f"<small>{names[i]} → {names[j]}</small>"
        else:
            self.profile.unavailable(r.unavailable.get("tricubic", "not computed"))
        if r.atom_rho is not None:
            self.table.update(
                names,
                r.atom_rho,
                r.atom_target,
                sort=s.table_sort,
                ascending=s.table_ascending,
                target_source=r.target_source,
                picked=(*s.profile_atoms, *([] if self.picked_atom is None else [self.picked_atom])),
                units=s.units,
            )
        else:
            self.table.unavailable(r.unavailable.get("tricubic", "not computed"))

    def show_resolution(self) -> None:
        """Draw the Resolution tab for the current result when the tab is open (it costs an FFT and, per
        model, gemmi's exact factors), else leave it to be drawn when it is opened."""
        r = self.result
        shown = self.tabs.selected_index
        if r is None or shown is None or self.tabs.children[shown] is not self.resolution.widget:
            return
        diff = self.difference_result
        key = (r.map_key, id(diff))
        if self.resolution.drawn_for == key:
            return
        try:
            report = compute.resolution_report(r, self._resolution_cache, diff)
            self.resolution.set_range(*compute.resolution_range(r.grid))
        except (WorkbenchError, ValueError, kernels.GridError) as exc:
            self.resolution.unavailable(f"resolution view: {exc}")
            return
        self.resolution.update(report, label=compute.inputs_label(r.settings))
        self.resolution.drawn_for = key

    def _show_truncated(self, scene: bool = True) -> None:
        """The section and the 3D view (when ``scene``) at the resolution slider's d: the current map's Fourier
        synthesis to d, labelled so; back to the map itself when the slider is off."""
        r = self.result
        if r is None:
            return
        d = self.resolution.d_min
        model_key, map_key = _scene_keys(r)
        if d is None:
            self.resolution.show_truncation(None)
            if self._truncated_shown:
                self._truncated_shown = False
                self._draw_section(r.settings, r.section, r.near, r.mean, r.sigma, r.model)
                self.scene.update(r, model_key=model_key, map_key=map_key)
            return
        try:
            self.resolution.set_range(*compute.resolution_range(r.grid))
            d = self.resolution.d_min
            self._resolution_cache.map_factors(r.map_key, r.rho, r.grid, float(r.settings.blur))
            shown = compute.truncated_result(self._resolution_cache, r, d)
        except (WorkbenchError, ValueError, kernels.GridError) as exc:
            self.status.set("error", f"error: resolution slider: {exc}")
            return
        self._draw_section(shown.settings, shown.section, shown.near, shown.mean, shown.sigma, shown.model)
        if scene:
            self.scene.update(shown, model_key=model_key, map_key=(map_key, "truncated", d))
        for caption in (self.slice.caption, self.scene.caption):
            caption.value = compute.truncation_note(d) + compute.without_truncation_note(caption.value)
        self.resolution.show_truncation(d)
        self._truncated_shown = True

    def _show_pick(self, r: Result) -> None:
        """Label the picked atom with ``r``'s values (or clear the label: nothing picked)."""
        i = self.picked_atom
        pick = None
        if i is not None and i < len(r.model):
            pick = compute.atom_pick(r.atoms, i, rho=r.atom_rho, gradient=r.gradient, units=r.settings.units)
        self.scene.show_pick(pick)

    def _draw_section(self, settings, sec, near, mean: float, sigma: float, model) -> None:
        self.slice.update(
            sec,
            marks=compute.atom_marks(near, model.atoms.elements),
            mean=mean,
            sigma=sigma,
            contour_sigmas=settings.contour_sigmas,
            scale=settings.slice_scale,
            units=settings.units,
        )

    def _mark_views_stale(self, failed) -> None:
        """The settings ``failed`` could not be computed: the section and 3D view keep the
        last result (a typo in a path wipes nothing) and say that it is not for the settings shown."""
        r = self.result
        if r is None:
            return
        note = (
            f"<span class='wb-stale'><b>out of date:</b> this shows {html.escape(compute.inputs_label(r.settings))}; "
            f"{html.escape(compute.inputs_label(failed))} could not be computed (see the status line)</span><br>"
        )
        for caption in (self.slice.caption, self.scene.caption):
            if "wb-stale" not in caption.value:
                caption.value = note + caption.value

    def _drop_stale(self, r: Result) -> None:
        """Clear (and say so) the views whose result belongs to other settings than ``r``'s."""
        inputs = compute.comparison_inputs(r.settings)
        now = compute.inputs_label(r.settings)
        d = self.difference_result
        if d is not None:
            if d.inputs != inputs:
                self.difference_result = None
                self.difference.stale(d.label, now)
            elif (d.section.axis, d.section.index) != (r.section.axis, r.section.index):
                # same maps, another section: cut it from the maps already compared
                diff = (d.map_a.double() - d.map_b.double()).float()
                d.section = compute.difference_section(diff, d.grid, r.section.axis, r.section.index)
                self.difference.show_section(d)
        if self._timing_inputs is not None and self._timing_inputs != inputs:
            self._timing_inputs = None
            self.timing.stale(self._timing_label, now)

    def _report(self, r: Result) -> None:
        if self.scheduler.debouncer.pending:
            self.status.set("busy", "computing: newer settings …")
            return
        ms = 1e3 * sum(r.timings.values())
        parts = [f"ready: {count(len(r.model), 'atom')}, grid {'×'.join(map(str, r.grid.shape))}, {r.backend} on "
                 f"{r.settings.device}, {ms:.0f} ms of kernels"]  # fmt: skip
        level = "idle"
        if r.unavailable:
            level = "warning"
            parts += [f"{k} unavailable: {v}" for k, v in r.unavailable.items()]
        if r.notes:
            level = "warning"
            parts += [f"note: {n}" for n in r.notes]
        if self._region_note:
            level = "warning"
            parts.append(f"note: {self._region_note}")
        if compute.section_is_empty(r.section):
            level = "warning"
            sec = r.section
            middle = compute.central_depth(r.model.atoms.xyz, r.grid, sec.axis)
            parts.append(
                f"note: the section ⊥ {r.settings.slice_axis} at depth {sec.depth:.1f} Å holds no density "
                f"(ρ ≤ {float(sec.values.max()):.2g} {r.settings.units}): the model's middle is at depth {middle:.1f} Å, "
                "move the slice there"
            )
        self.status.set(level, " | ".join(parts))

    def _compare_job(self) -> None:
        r = self.result
        if r is None:
            self.status.set("error", "error: nothing computed yet to compare")
            return
        gen = self.scheduler.generation
        self.status.set("busy", f"comparing {self.difference.a.value} with {self.difference.b.value} …")
        try:
            planes = r.planes if r.gradient is not None and r.gradient.kind == "planarity" else None
            diff = compute.compare_backends(
                self.difference.a.value, self.difference.b.value, r.atoms, r.grid, r.settings,
                target=r.target, planes=planes, check=self._check(gen), index=r.section.index,
            )  # fmt: skip
            self.difference.update(diff, r.model)
            self.difference_result = diff
            if self.result is not r:  # the views moved on while it ran
                self._drop_stale(self.result)
                if self.difference_result is None:
                    self.status.set("warning", f"the comparison finished for {diff.label}, but the settings "
                                    "changed meanwhile: press compare again")  # fmt: skip
                    return
            verdict = "within" if diff.maps.ok else "OUTSIDE"
            self.status.set(
                "idle" if diff.maps.ok else "warning",
                f"difference {diff.a} vs {diff.b}: max |Δρ| {diff.maps.max_abs:.2e} {r.settings.units}, relative L2 "
                f"{diff.maps.rel_l2:.2e}, {verdict} the float32 tolerance",
            )
        except Cancelled:
            self.status.set("cancelled", "comparison cancelled (settings changed or cancel pressed)")
        except WorkbenchError as exc:
            self.status.set("error", f"error: {exc}")
        except Exception as exc:  # noqa: BLE001
            log.error("workbench compare failed:\n%s", traceback.format_exc())
            self.status.set("error", f"error: {_friendly(exc)}")

    def _timing_job(self) -> None:
        r = self.result
        if r is None:
            self.status.set("error", "error: nothing computed yet to time")
            return
        gen = self.scheduler.generation
        self.status.set("busy", "timing every backend …")
        try:
            rows = compute.time_backends(
                r.atoms, r.grid, r.settings, target=r.target, planes=r.planes, check=self._check(gen)
            )
            self._timing_inputs = compute.comparison_inputs(r.settings)
            self._timing_label = compute.inputs_label(r.settings)
            self.timing.update_all(rows, label=self._timing_label)
            if self.result is not r:
                self._drop_stale(self.result)
            self.status.set("idle", f"timed {len(rows)} backend runs for {self._timing_label}")
        except Cancelled:
            self.status.set("cancelled", "timing cancelled (settings changed or cancel pressed)")
        except Exception as exc:  # noqa: BLE001
            log.error("workbench timing failed:\n%s", traceback.format_exc())
            self.status.set("error", f"error: {_friendly(exc)}")

    def _export(self, what: str) -> None:
        """An export button: the file goes to the browser as a download (not the server's disk)."""
        map_name, csv_name = self.controls.export_names()
        try:
            r = self._require_result()
            if what == "map":
                name, data, mime = (
                    map_name,
                    compute.map_ccp4_bytes(r.rho, r.grid, r.settings.radiation),
                    "application/octet-stream",
                )
            elif what == "model":
                name, data, mime = (
                    self.controls.model_name(),
                    compute.model_pdb(r.model, r.atoms.xyz).encode(),
                    "chemical/x-pdb",
                )
            else:
                if r.gradient is None:
                    raise WorkbenchError(f"no gradient to export: {r.unavailable.get('gradient', 'none computed')}")
                csv = compute.gradients_csv(
                    r.model, r.atoms.xyz.numpy(), r.gradient.grad, r.gradient.kind, r.gradient.units
                )
                name, data, mime = csv_name, csv.encode(), "text/csv"
            self.download.send_file(name, data, mime)
            self.status.set("idle", f"downloading {name} ({len(data) / 1024:,.0f} kB) to your browser")
        except (WorkbenchError, OSError, ValueError) as exc:
            self.status.set("error", f"error: export failed: {exc}")
