"""The 3D view: model sticks, a density isosurface, per-atom gradient arrows and ADP ellipsoids.

:class:`View3D` is an anywidget over 3Dmol.js (the engine py3Dmol drives): its scene is
traits, synced to the browser; the map goes over as the binary bytes of a CCP4 file
(``map_bytes``), the arrows and the ellipsoid mesh as float32 bytes, never as base64 text in HTML.
:class:`Scene3DView` sets those traits from a :class:`workbench.compute.Result` and what
:mod:`workbench.compute.scene` makes of it (the map box and its CCP4 bytes, the arrows,
the focus): the view chooses only when to ask again and how to draw.

3Dmol.js is loaded from its CDN (``View3D.lib_url``) unless a local file is configured
— ``View3D(lib_path=...)`` or the environment variable ``WORKBENCH_3DMOL_JS`` — for
offline use and CI; the library itself is never part of this repository.
"""

from __future__ import annotations

import html
import os
from pathlib import Path

import anywidget
import ipywidgets as widgets
import numpy as np
import traitlets

from workbench.compute import (
    ARROW_MAX_LENGTH,
    ARROW_MIN_LENGTH,
    ARROW_SCALE,
    AtomPick,
    RegionVolume,
    Result,
    WorkbenchError,
    adp_ellipsoids,
    arrow_segments,
    ellipsoid_arrays,
    ellipsoid_mesh,
    focus_selection,
    focus_sphere,
    gradient_arrows,
    model_pdb,
    position_bytes,
    region_arrows,
    region_atoms,
    region_geometry,
    region_volume,
    shown_atoms,
    volume_base64,
)
from workbench.compute.text import count, ordinal
from workbench.views._caption import caption_html

# The arrow scale and gradient_arrows live in workbench.compute (they are geometry); they
# stay importable from here, where the view that draws them is.
__all__ = [
    "ARROW_MAX_LENGTH",
    "ARROW_MIN_LENGTH",
    "ARROW_SCALE",
    "CDN_URL",
    "LIB_ENV",
    "Scene3DView",
    "View3D",
    "gradient_arrows",
]

CDN_URL = "https://cdn.jsdelivr.net/npm/3dmol@2.5.5/build/3Dmol-min.js"
LIB_ENV = "WORKBENCH_3DMOL_JS"
# Magenta: no element colour in the sticks (C grey, N blue, O red, S yellow) and not the map's blue.
ARROW_COLOR = "#e000e0"


def _iso_options(v: View3D) -> dict:
    """3Dmol addVolumetricData options for the view's isosurface style (same as view3d.js)."""
    if v.iso_style == "surface":
        return {"isoval": v.iso_level, "color": "#5a86d8", "opacity": 0.5, "wireframe": False}
    return {"isoval": v.iso_level, "color": v.iso_color, "opacity": 0.6, "wireframe": True}


def _local_library(lib_path: str | os.PathLike | None) -> str:
    path = lib_path or os.environ.get(LIB_ENV, "")
    if not path:
        return ""
    p = Path(path).expanduser()
    if not p.is_file():
        raise WorkbenchError(
            f"3Dmol.js not found at {p} (from {'lib_path' if lib_path else LIB_ENV}): fetch it with "
            "`npm pack 3dmol@2.5.5` and point there, or unset it to load from the CDN"
        )
    return p.read_text(encoding="utf-8")


class View3D(anywidget.AnyWidget):
    """3Dmol.js viewer whose scene is synced through traits (CSS class ``wb-view3d``).

    Parameters
    ----------
    lib_path : str or path-like, optional
        A local ``3Dmol-min.js`` to load instead of the CDN (default: ``$WORKBENCH_3DMOL_JS``).
    height : int
        Canvas height in pixels.

    Attributes (traits)
    -------------------
    css_class : str
        The element's CSS class, ``wb-view3d`` for the main scene (the canvas box gets
        ``<css_class>-canvas``), so a second viewer is told apart by page tests.
    model_text, model_format : str
        The model as PDB text.
    model_xyz : bytes
        float32, shape (N, 3): positions (Å) of the model's atoms by index (PDB serial − 1) that
        replace those of ``model_text`` (the same atoms moved, e.g. a relax frame's); empty: the
        text's own.
    map_bytes : bytes
        A CCP4/MRC map (whole file bytes), the region's box; empty for none.
    iso_level : float
        Isosurface level, e/Å³.
    iso_style : str
        ``"mesh"`` (a chicken-wire cage, for one residue) or ``"surface"`` (a light
        transparent skin, for a whole model: a mesh over hundreds of atoms hides them).
    iso_delay_ms : int
        How long a new map or level waits in the browser for a newer one before it is contoured
        (contouring blocks the page: a drag would queue one per step); 0 contours at once.
    arrows : bytes
        float32, shape (M, 6): start xyz, end xyz in Å.
    ellipsoid_vertices : bytes
        float32, shape (V, 6): position (Å) and unit normal per vertex of the ADP
        ellipsoids (:class:`workbench.compute.EllipsoidMesh`); empty for none.
    ellipsoid_faces : bytes
        uint32, shape (F, 3): triangle vertex indices within each chunk.
    ellipsoid_chunks : list of [v0, v1, f0, f1, colour]
        Vertex and face rows of each chunk and its colour (0xRRGGBB): one ``addCustom``
        shape each.
    focus : dict
        3Dmol selection of the chosen residue (drawn with thicker sticks).
    view_sphere : list of 4 float
        ``[cx, cy, cz, radius]`` Å: the camera is centred there and zoomed so the sphere
        fills the canvas's shorter side; re-applied when ``zoom_key`` changes.
    label_lines : list of str
        A label drawn at ``label_xyz`` (the picked atom), one entry per line; empty for none.
    label_xyz : list of 3 float
        Where the label points, Å.
    js_error : str
        Set by the browser when 3Dmol.js could not load or draw.
    n_arrows_drawn : int
        Set by the browser: arrow shapes in the scene after its last update (also the
        canvas element's ``data-arrows`` attribute, for browser tests).
    n_ellipsoid_triangles : int
        Set by the browser: triangles of the ellipsoid shapes drawn (also ``data-ellipsoid-triangles``).
    n_rendered : int
        Incremented by the browser after each render.

    Messages
    --------
    ``{"type": "pick", "serial": n}`` from the browser when an atom is clicked (its PDB
    serial, ``index + 1``); :meth:`on_pick` callbacks get the atom index.
    """

    _esm = Path(__file__).resolve().parent.parent / "static" / "view3d.js"

    css_class = traitlets.Unicode("wb-view3d", help="the viewer's CSS class (and its canvas box's, + '-canvas')").tag(
        sync=True
    )
    lib_url = traitlets.Unicode(CDN_URL).tag(sync=True)
    lib_source = traitlets.Unicode("").tag(sync=True)
    model_text = traitlets.Unicode("").tag(sync=True)
    model_format = traitlets.Unicode("pdb").tag(sync=True)
    model_xyz = traitlets.Bytes(b"").tag(sync=True)
    map_bytes = traitlets.Bytes(b"").tag(sync=True)
    iso_level = traitlets.Float(1.0).tag(sync=True)
    iso_color = traitlets.Unicode("#3060d0").tag(sync=True)
    iso_style = traitlets.Enum(("mesh", "surface"), default_value="mesh").tag(sync=True)
    iso_delay_ms = traitlets.Int(300).tag(sync=True)
    arrows = traitlets.Bytes(b"").tag(sync=True)
    arrow_color = traitlets.Unicode(ARROW_COLOR).tag(sync=True)
    ellipsoid_vertices = traitlets.Bytes(b"").tag(sync=True)
    ellipsoid_faces = traitlets.Bytes(b"").tag(sync=True)
    ellipsoid_chunks = traitlets.List(traitlets.List(traitlets.Int()), default_value=[]).tag(sync=True)
    focus = traitlets.Dict({}).tag(sync=True)
    view_sphere = traitlets.List(traitlets.Float(), default_value=[]).tag(sync=True)
    zoom_key = traitlets.Int(0).tag(sync=True)
    height = traitlets.Int(420).tag(sync=True)
    label_lines = traitlets.List(traitlets.Unicode(), default_value=[]).tag(sync=True)
    label_xyz = traitlets.List(traitlets.Float(), default_value=[]).tag(sync=True)
    js_error = traitlets.Unicode("").tag(sync=True)
    n_rendered = traitlets.Int(0).tag(sync=True)
    n_arrows_drawn = traitlets.Int(0).tag(sync=True)
    n_ellipsoid_triangles = traitlets.Int(0).tag(sync=True)

    def __init__(self, *, lib_path: str | os.PathLike | None = None, **kwargs):
        super().__init__(lib_source=_local_library(lib_path), **kwargs)
        self.add_class(self.css_class)
        self._pick_callbacks: list = []
        self.on_msg(self._message)

    def on_pick(self, callback) -> None:
        """Call ``callback(index)`` with the atom index when an atom is clicked in the browser."""
        self._pick_callbacks.append(callback)

    def _message(self, _widget, content, _buffers) -> None:
        if not isinstance(content, dict) or content.get("type") != "pick":
            return
        serial = content.get("serial")
        if not isinstance(serial, int) or serial < 1:
            return
        for callback in self._pick_callbacks:
            callback(serial - 1)

    def clear(self) -> None:
        """Empty the scene: no model, map, arrows or ellipsoids (its result is out of date)."""
        with self.hold_sync():
            self.model_text = ""
            self.model_xyz = b""
            self.map_bytes = b""
            self.arrows = b""
            self.ellipsoid_vertices = b""
            self.ellipsoid_faces = b""
            self.ellipsoid_chunks = []
            self.focus = {}
            self.label_lines = []
            self.label_xyz = []

    @property
    def arrow_array(self) -> np.ndarray:
        """``arrows`` as a float32 array of shape (M, 6)."""
        return arrow_segments(self.arrows)

    @property
    def ellipsoid_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """``ellipsoid_vertices`` as float32 (V, 6) and ``ellipsoid_faces`` as uint32 (F, 3)."""
        return ellipsoid_arrays(self.ellipsoid_vertices, self.ellipsoid_faces)


class Scene3DView:
    """Draws a Result in a :class:`View3D`: model, the region's map box, arrows, caption.

    Attributes
    ----------
    view : View3D
    caption : ipywidgets.HTML
        Region, isosurface level (σ and e/Å³) and the arrow length scale (CSS ``wb-view3d-caption``).
    arrow_scale : float
        Å of arrow per unit of gradient (0 when no arrows).
    ellipsoids : workbench.compute.Ellipsoids or None
        The ADP ellipsoids drawn (None when the ``ellipsoids`` setting is off).
    picked : ipywidgets.HTML
        The picked atom's label as text (CSS ``wb-picked-atom``); the same is drawn at the atom.
    pick : workbench.compute.AtomPick or None
        The picked atom shown.
    """

    def __init__(self, *, lib_path=None):
        self.view = View3D(lib_path=lib_path)
        self.caption = widgets.HTML()
        self.caption.add_class("wb-view3d-caption")
        self.picked = widgets.HTML()
        self.picked.add_class("wb-picked-atom")
        self.pick: AtomPick | None = None
        self.widget = widgets.VBox([self.view, self.picked, self.caption])
        self.arrow_scale = 0.0
        self.ellipsoids = None
        self._keys: dict[str, object] = {}
        self._volume: RegionVolume | None = None
        self._geometry = None  # the RegionGeometry of the last map box
        self._model = None  # (Model, positions) of the sticks shown, for to_py3dmol

    def update(self, result: Result, *, model_key, map_key, move_atoms: bool = False, geometry_key=None) -> bool:
        """Update the traits that changed (model text, map box, level, arrows, focus); True if any did
        (the browser then draws the scene again).

        ``model_key`` and ``map_key`` say when the sticks and the map box are the same as
        last time, so they are neither recomputed nor sent again. With ``move_atoms``, when the sticks
        shown are ``result.model``'s, new positions go as ``model_xyz`` (12 bytes an atom, moved in
        place in the browser, bonds kept) instead of new PDB text. ``geometry_key``
        names the map box's place and kept voxels (:func:`workbench.compute.region_geometry`): when
        it is the last one's, the box is cut there from the new map without deriving them again.
        """
        s = result.settings
        sel = region_atoms(result.model, s.region)
        xyz = result.atoms.xyz
        shown = shown_atoms(xyz, sel if s.region else None, s.region_padding)
        updates: dict[str, object] = {}
        if self._keys.get("model") != model_key:
            if move_atoms and self._model is not None and self._model[0] is result.model and self.view.model_text:
                updates["model_xyz"] = position_bytes(xyz)
            else:
                updates["model_text"] = model_pdb(result.model, xyz)
                updates["model_xyz"] = b""
            self._keys["model"] = model_key
            self._model = (result.model, xyz)
        box_key = (map_key, s.region, s.region_padding)
        if self._keys.get("box") != box_key:
            full_key = (geometry_key, result.grid.shape, s.region, s.region_padding)
            if geometry_key is None or self._keys.get("geometry") != full_key:
                self._geometry = region_geometry(result.grid, xyz[sel], s.region_padding, clip=True)
                self._keys["geometry"] = full_key
            self._volume = region_volume(result.rho, result.grid, xyz[sel], s.region_padding, geometry=self._geometry)
            updates["map_bytes"] = self._volume.ccp4
            self._keys["box"] = box_key
        updates["iso_level"] = float(result.iso_level)
        updates["iso_style"] = "mesh" if s.region else "surface"
        arrows = region_arrows(
            xyz,
            result.gradient,
            sel if s.region else None,
            s.region_padding,
            missing=result.unavailable.get("gradient", "no gradient"),
            # with a distortion set, no arrow means the groups are flat (or the fit is done)
            hint="" if s.distort_amplitude > 0 else "no distortion? drag 'distort'",
        )
        updates["arrows"] = arrows.to_bytes()
        self.arrow_scale = arrows.scale
        ell_key = (result.atoms_key, s.region, s.region_padding, s.ellipsoids)
        if self._keys.get("ellipsoids") != ell_key:
            self.ellipsoids = adp_ellipsoids(result.atoms, shown) if s.ellipsoids else None
            mesh = ellipsoid_mesh(self.ellipsoids) if self.ellipsoids is not None and len(self.ellipsoids) else None
            updates["ellipsoid_vertices"] = mesh.vertex_bytes() if mesh else b""
            updates["ellipsoid_faces"] = mesh.face_bytes() if mesh else b""
            updates["ellipsoid_chunks"] = [list(c) for c in mesh.chunks] if mesh else []
            self._keys["ellipsoids"] = ell_key
        if self._keys.get("focus") != (s.structure, s.region, s.region_padding):
            updates["focus"] = focus_selection(result.model, s.region)
            updates["view_sphere"] = focus_sphere(xyz, shown, centre_on=sel if s.region else None)
            updates["zoom_key"] = self.view.zoom_key + 1
            self._keys["focus"] = (s.structure, s.region, s.region_padding)
        changed = {name: value for name, value in updates.items() if getattr(self.view, name) != value}
        with self.view.hold_sync():
            for name, value in changed.items():
                setattr(self.view, name, value)
        region = "whole model" if not s.region else f"residue {s.region}"
        vol = self._volume
        sub = (
            f" (every {ordinal(vol.stride)} voxel: {vol.n_voxels:,} shown)"
            if vol is not None and vol.stride > 1
            else ""
        )
        sub += f", map drawn within {s.region_padding:g} Å of the {'residue' if s.region else 'atoms'}"
        n_arrows = len(arrows.segments)
        self.caption.value = caption_html(
            f"{region} · isosurface {s.iso_sigma:g} σ = {result.iso_level:.3g} {s.units} · "
            f"{count(n_arrows, 'arrow') if result.gradient is not None else 'no arrows'} · click an atom to pick it",
            f"{region}, map box ± {s.region_padding:g} Å{sub}; isosurface {s.iso_sigma:g} σ = "
            f"{result.iso_level:.3f} {s.units}; click an atom: region = its residue, profile to it from the last one "
            f"picked; {arrows.caption}{_ellipsoid_caption(self.ellipsoids)}",
        )
        return bool(changed)

    def show_pick(self, pick: AtomPick | None) -> None:
        """Label the picked atom in 3D (name, B, occupancy, ρ, |∇|) and under the view; None clears it."""
        self.pick = pick
        with self.view.hold_sync():
            self.view.label_lines = pick.lines() if pick else []
            self.view.label_xyz = list(pick.xyz) if pick else []
        self.picked.value = f"<small><b>picked:</b> {html.escape(pick.text())}</small>" if pick else ""

    def to_py3dmol(self, width: int = 640, height: int = 480):
        """A py3Dmol view of the current scene (model, isosurface, ellipsoids, arrows; for static use and export)."""
        import py3Dmol

        v = self.view
        view = py3Dmol.view(width=width, height=height)
        if v.model_text:
            # the positions drawn: the text's, or those sent after it (model_xyz)
            text = model_pdb(*self._model) if v.model_xyz and self._model is not None else v.model_text
            view.addModel(text, v.model_format)
            view.setStyle({}, {"stick": {"radius": 0.12}})
        if v.map_bytes:
            view.addVolumetricData(volume_base64(v.map_bytes), "ccp4", _iso_options(v))
        vertices, faces = v.ellipsoid_arrays
        for v0, v1, f0, f1, colour in v.ellipsoid_chunks:
            chunk = vertices[v0:v1].astype(float)
            view.addCustom(
                {
                    "vertexArr": [dict(zip("xyz", p)) for p in chunk[:, :3].tolist()],
                    "normalArr": [dict(zip("xyz", n)) for n in chunk[:, 3:6].tolist()],
                    "faceArr": faces[f0:f1].reshape(-1).tolist(),
                    "color": f"#{colour:06x}",
                }
            )
        for a in v.arrow_array:
            view.addArrow(
                {
                    "start": dict(zip("xyz", map(float, a[:3]))),
                    "end": dict(zip("xyz", map(float, a[3:]))),
                    "radius": 0.08,
                    "color": v.arrow_color,
                }
            )
        view.zoomTo(v.focus or {"model": 0})  # the atoms; {} would fit the map box too
        return view


def _ellipsoid_caption(ell) -> str:
    if ell is None:
        return ""
    n_aniso = int(ell.anisotropic.sum())
    text = (
        f"; ADP ellipsoids at 50 % probability (semi-axes {ell.scale:g}·√λ of U): {n_aniso} anisotropic, "
        f"{len(ell) - n_aniso} isotropic (spheres)"
    )
    if ell.n_dropped:
        text += f", {ell.n_dropped} more atoms not drawn (choose a residue as region)"
    return text
