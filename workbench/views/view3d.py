"""The 3D view: model sticks, a density isosurface and per-atom gradient arrows.

:class:`View3D` is an anywidget over 3Dmol.js (the engine py3Dmol drives): its scene is
traits, synced to the browser; the map goes over as the binary bytes of a CCP4 file
(``map_bytes``) and the arrows as float32 bytes, never as base64 text in HTML.
:class:`Scene3DView` turns a :class:`workbench.compute.Result` into those traits.

3Dmol.js is loaded from its CDN (``View3D.lib_url``) unless a local file is configured
— ``View3D(lib_path=...)`` or the environment variable ``WORKBENCH_3DMOL_JS`` — for
offline use and CI; the library itself is never part of this repository.
"""

from __future__ import annotations

import base64
import os
from pathlib import Path

import anywidget
import ipywidgets as widgets
import numpy as np
import torch
import traitlets

from workbench.compute import Result, WorkbenchError, map_ccp4_bytes, model_pdb, region_atoms, region_box

__all__ = ["ARROW_SCALE", "CDN_URL", "LIB_ENV", "Scene3DView", "View3D", "gradient_arrows"]

CDN_URL = "https://cdn.jsdelivr.net/npm/3dmol@2.5.5/build/3Dmol-min.js"
LIB_ENV = "WORKBENCH_3DMOL_JS"
# Å of arrow per unit of gradient, fixed per gradient kind (stated beside the view), so
# an arrow's length means the same pull in every model and after every distortion.
# Measured on 1ORC at 1 Å spacing (max |∇| per atom): planarity 158 1/Å undistorted,
# 523 at 0.1 Å RMS distortion, 1.5e3 at 0.3 Å, 2.4e3 at 0.5 Å; density fit 0 undistorted,
# 4.7 (e/Å³)²/Å at 0.1 Å, 12 at 0.3 Å. With these scales a 0.3 Å distortion gives
# arrows up to ~1.5-2.5 Å, and the undistorted model's own small deviations draw none.
ARROW_SCALE = {"planarity": 1e-3, "density": 0.2}
# Arrows shorter than this (Å) are not drawn: a real model's residual non-planarity is
# noise, not a pull worth an arrow.
ARROW_MIN_LENGTH = 0.25
# Longer arrows are clipped to this length (Å) and the caption says how many were.
ARROW_MAX_LENGTH = 3.0
MAX_ARROWS = 800  # each is a mesh in 3Dmol.js; more slows a software-WebGL page
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


def gradient_arrows(xyz: np.ndarray, grad: np.ndarray, kind: str, units: str) -> tuple[np.ndarray, str]:
    """Arrows along −∇ at a fixed physical scale, and the caption that states it.

    Parameters
    ----------
    xyz : numpy.ndarray, shape (N, 3), Å
        Atom positions.
    grad : numpy.ndarray, shape (N, 3)
        Gradient of the loss per atom, in ``units``.
    kind : str
        ``"planarity"`` or ``"density"`` (picks :data:`ARROW_SCALE`).
    units : str

    Returns
    -------
    arrows : numpy.ndarray, shape (M, 6), float32
        Start xyz and end xyz in Å, longest first; only atoms whose arrow would be at
        least :data:`ARROW_MIN_LENGTH` Å, at most :data:`MAX_ARROWS`, each clipped to
        :data:`ARROW_MAX_LENGTH` Å.
    caption : str
    """
    scale = ARROW_SCALE[kind]
    norms = np.linalg.norm(grad, axis=1) if len(grad) else np.zeros(0)
    lengths = norms * scale
    keep = np.nonzero(lengths >= ARROW_MIN_LENGTH)[0]
    keep = keep[np.argsort(-lengths[keep], kind="stable")][:MAX_ARROWS]
    clip = np.minimum(1.0, ARROW_MAX_LENGTH / np.maximum(lengths[keep], 1e-30))
    start = xyz[keep]
    end = start - grad[keep] * (scale * clip)[:, None]  # −∇: the way the loss pulls each atom
    arrows = np.hstack([start, end]).astype(np.float32).reshape(-1, 6)
    gmax = float(norms.max()) if len(norms) else 0.0
    n_clipped = int((clip < 1.0).sum())
    text = (
        f"arrows (magenta): −∇ of the {kind} loss, 1 Å of arrow = {1 / scale:.4g} {units}; "
        f"drawn where |∇| ≥ {ARROW_MIN_LENGTH / scale:.3g} {units} ({ARROW_MIN_LENGTH:g} Å): "
        f"{len(keep)} of {len(norms)} atoms, largest |∇| {gmax:.3g} {units}"
    )
    if n_clipped:
        text += f", {n_clipped} clipped at {ARROW_MAX_LENGTH:g} Å"
    if len(norms) > 0 and len(keep) == 0:
        text += ": no arrows (no distortion? drag 'distort')"
    return arrows, text


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
    model_text, model_format : str
        The model as PDB text.
    map_bytes : bytes
        A CCP4/MRC map (whole file bytes), the region's box; empty for none.
    iso_level : float
        Isosurface level, e/Å³.
    iso_style : str
        ``"mesh"`` (a chicken-wire cage, for one residue) or ``"surface"`` (a light
        transparent skin, for a whole model: a mesh over hundreds of atoms hides them).
    arrows : bytes
        float32, shape (M, 6): start xyz, end xyz in Å.
    focus : dict
        3Dmol selection to zoom to; re-zoomed when ``zoom_key`` changes.
    js_error : str
        Set by the browser when 3Dmol.js could not load or draw.
    n_arrows_drawn : int
        Set by the browser: arrow shapes in the scene after its last update (also the
        canvas element's ``data-arrows`` attribute, for browser tests).
    n_rendered : int
        Incremented by the browser after each render.
    """

    _esm = Path(__file__).resolve().parent.parent / "static" / "view3d.js"

    lib_url = traitlets.Unicode(CDN_URL).tag(sync=True)
    lib_source = traitlets.Unicode("").tag(sync=True)
    model_text = traitlets.Unicode("").tag(sync=True)
    model_format = traitlets.Unicode("pdb").tag(sync=True)
    map_bytes = traitlets.Bytes(b"").tag(sync=True)
    iso_level = traitlets.Float(1.0).tag(sync=True)
    iso_color = traitlets.Unicode("#3060d0").tag(sync=True)
    iso_style = traitlets.Enum(("mesh", "surface"), default_value="mesh").tag(sync=True)
    arrows = traitlets.Bytes(b"").tag(sync=True)
    arrow_color = traitlets.Unicode(ARROW_COLOR).tag(sync=True)
    focus = traitlets.Dict({}).tag(sync=True)
    zoom_key = traitlets.Int(0).tag(sync=True)
    height = traitlets.Int(420).tag(sync=True)
    js_error = traitlets.Unicode("").tag(sync=True)
    n_rendered = traitlets.Int(0).tag(sync=True)
    n_arrows_drawn = traitlets.Int(0).tag(sync=True)

    def __init__(self, *, lib_path: str | os.PathLike | None = None, **kwargs):
        super().__init__(lib_source=_local_library(lib_path), **kwargs)
        self.add_class("wb-view3d")

    @property
    def arrow_array(self) -> np.ndarray:
        """``arrows`` as a float32 array of shape (M, 6)."""
        return np.frombuffer(self.arrows, dtype=np.float32).reshape(-1, 6)


class Scene3DView:
    """Fills a :class:`View3D` from a Result: model, the region's map box, arrows, caption.

    Attributes
    ----------
    view : View3D
    caption : ipywidgets.HTML
        Region, isosurface level (σ and e/Å³) and the arrow length scale (CSS ``wb-view3d-caption``).
    arrow_scale : float
        Å of arrow per unit of gradient (0 when no arrows).
    """

    def __init__(self, *, lib_path=None):
        self.view = View3D(lib_path=lib_path)
        self.caption = widgets.HTML()
        self.caption.add_class("wb-view3d-caption")
        self.widget = widgets.VBox([self.view, self.caption])
        self.arrow_scale = 0.0
        self._keys: dict[str, object] = {}
        self._box = None

    def update(self, result: Result, *, model_key, map_key) -> None:
        """Update the traits that changed (model text, map box, level, arrows, focus)."""
        s = result.settings
        sel = region_atoms(result.model, s.region)
        xyz = result.atoms.xyz
        updates: dict[str, object] = {}
        if self._keys.get("model") != model_key:
            updates["model_text"] = model_pdb(result.model, xyz)
            self._keys["model"] = model_key
        box_key = (map_key, s.region, s.region_padding)
        if self._keys.get("box") != box_key:
            box, box_grid, stride = region_box(result.rho, result.grid, xyz[torch.as_tensor(sel)], s.region_padding)
            updates["map_bytes"] = map_ccp4_bytes(box, box_grid)
            self._box = (box, box_grid, stride)
            self._keys["box"] = box_key
        updates["iso_level"] = float(result.iso_level)
        updates["iso_style"] = "mesh" if s.region else "surface"
        arrows, scale, text = self._arrows(result, sel)
        updates["arrows"] = arrows
        self.arrow_scale = scale
        if self._keys.get("focus") != (s.structure, s.region):
            lab = result.model.atoms.labels[int(sel[0])]
            updates["focus"] = {} if not s.region else {"chain": lab.chain, "resi": lab.seq_num}
            updates["zoom_key"] = self.view.zoom_key + 1
            self._keys["focus"] = (s.structure, s.region)
        with self.view.hold_sync():
            for name, value in updates.items():
                setattr(self.view, name, value)
        region = "whole model" if not s.region else f"residue {s.region}"
        stride = self._box[2] if self._box else 1
        sub = f" (every {stride}th voxel: {self._box[0].numel():,} shown)" if stride > 1 else ""
        self.caption.value = (
            f"<small>{region}, map box ± {s.region_padding:g} Å{sub}; isosurface {s.iso_sigma:g} σ = "
            f"{result.iso_level:.3f} e/Å³; {text}</small>"
        )

    def _arrows(self, result: Result, sel: np.ndarray) -> tuple[bytes, float, str]:
        g = result.gradient
        if g is None:
            why = result.unavailable.get("gradient", "no gradient")
            return b"", 0.0, f"no arrows ({why})"
        s = result.settings
        if s.region:
            # every atom inside the shown box, not only the residue's: its neighbours' pull shows too
            xyz = result.atoms.xyz
            d = torch.cdist(xyz, xyz[torch.as_tensor(sel)]).min(dim=1).values
            sel = np.nonzero((d <= s.region_padding).numpy())[0]
        arrows, text = gradient_arrows(result.atoms.xyz.numpy()[sel], g.grad[sel], g.kind, g.units)
        return arrows.tobytes(), ARROW_SCALE[g.kind], text

    def to_py3dmol(self, width: int = 640, height: int = 480):
        """A py3Dmol view of the current scene (for static use and export)."""
        import py3Dmol

        v = self.view
        view = py3Dmol.view(width=width, height=height)
        if v.model_text:
            view.addModel(v.model_text, v.model_format)
            view.setStyle({}, {"stick": {"radius": 0.12}})
        if v.map_bytes:
            # py3Dmol passes data as text: 3Dmol decodes base64 for binary formats.
            view.addVolumetricData(
                base64.b64encode(v.map_bytes).decode("ascii"),
                "ccp4",
                _iso_options(v),
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
