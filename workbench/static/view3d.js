// 3D view of the workbench: 3Dmol.js driven by synced traits (anywidget ESM module).
//
// The library comes from `lib_source` (the text of a local 3Dmol-min.js, sent once by
// Python when WORKBENCH_3DMOL_JS names a file: offline use and CI) or else from
// `lib_url` (the CDN). The map arrives as binary CCP4 bytes (`map_bytes`, a DataView
// here), arrows as float32 bytes, 6 numbers (start xyz, end xyz) per arrow, ADP
// ellipsoids as a triangle mesh built in Python (workbench.compute.ellipsoid_mesh):
// float32 vertices (position, normal: 6 numbers each), uint32 faces, and the one-colour
// chunks that keep each custom shape under 3Dmol's 16-bit vertex indices.

function loadLibrary(model) {
  if (window.$3Dmol) return Promise.resolve(window.$3Dmol);
  if (window.__wb3DmolLoading) return window.__wb3DmolLoading;
  window.__wb3DmolLoading = new Promise((resolve, reject) => {
    const source = model.get("lib_source");
    const url = source ? URL.createObjectURL(new Blob([source], { type: "text/javascript" })) : model.get("lib_url");
    const where = source ? "the local file (lib_source)" : url;
    // A page with an AMD loader (RequireJS) would swallow the UMD bundle: hide it while loading.
    const savedDefine = window.define;
    window.define = undefined;
    const script = document.createElement("script");
    script.src = url;
    script.onload = () => {
      window.define = savedDefine;
      if (window.$3Dmol) resolve(window.$3Dmol);
      else reject(new Error(`3Dmol.js from ${where} loaded but defined no $3Dmol`));
    };
    script.onerror = () => {
      window.define = savedDefine;
      window.__wb3DmolLoading = null;
      reject(new Error(`could not load 3Dmol.js from ${where}; offline? set WORKBENCH_3DMOL_JS=/path/3Dmol-min.js`));
    };
    document.head.appendChild(script);
  });
  return window.__wb3DmolLoading;
}

function bytesOf(view) {
  if (!view) return null;
  const u8 = new Uint8Array(view.buffer, view.byteOffset, view.byteLength);
  return u8.length ? u8 : null;
}

// Isosurface styles (the same options as Scene3DView.to_py3dmol): a mesh for one
// residue, a light transparent skin for a whole model (a mesh over hundreds of atoms
// hides every stick).
function isoOptions(model) {
  if (model.get("iso_style") === "surface") {
    return { isoval: model.get("iso_level"), color: "#5a86d8", opacity: 0.5, wireframe: false };
  }
  return { isoval: model.get("iso_level"), color: model.get("iso_color"), opacity: 0.6, wireframe: true };
}

async function render({ model, el }) {
  // One class per viewer ("wb-view3d" for the main scene): page tests find each by it.
  const css = model.get("css_class") || "wb-view3d";
  el.classList.add(css);
  const box = document.createElement("div");
  box.className = `${css}-canvas`;
  box.style.position = "relative";
  box.style.width = "100%";
  box.style.maxWidth = "100%";
  box.style.overflow = "hidden";
  box.style.height = `${model.get("height")}px`;
  // The element takes its parent's width, never its canvas's: a canvas sized once at a
  // wider layout would otherwise hold the element wide and run past the app's edge.
  el.style.width = "100%";
  el.style.minWidth = "0";
  el.style.overflow = "hidden";
  el.appendChild(box);
  const report = (msg) => {
    model.set("js_error", msg);
    model.save_changes();
  };
  let $3Dmol;
  try {
    $3Dmol = await loadLibrary(model);
  } catch (err) {
    box.textContent = String(err.message || err);
    report(String(err.message || err));
    return;
  }
  const viewer = $3Dmol.createViewer(box, { backgroundColor: "white" });
  box.wbViewer = viewer; // reachable from the page: browser tests and the console project atoms with it
  for (const c of box.querySelectorAll("canvas")) {
    c.style.position = "absolute"; // no intrinsic width: the box, not the canvas, sets the size
    c.style.left = "0";
    c.style.top = "0";
  }
  let zoomed = -1;

  // The isosurface and the arrows are separate shapes, rebuilt only when their own
  // traits change: a B-factor drag changes the map and level, not the arrows, and
  // rebuilding hundreds of arrow meshes per update held a software-WebGL page for seconds.
  let isoShapes = [];
  let arrowShapes = [];
  let ellipsoidShapes = [];
  let labels = [];

  function drawIsosurface() {
    for (const shape of isoShapes) viewer.removeShape(shape);
    isoShapes = [];
    const map = bytesOf(model.get("map_bytes"));
    if (map) {
      const shape = viewer.addVolumetricData(map, "ccp4", isoOptions(model));
      if (shape) isoShapes.push(shape);
    }
  }

  function drawArrows() {
    for (const shape of arrowShapes) viewer.removeShape(shape);
    arrowShapes = [];
    const raw = bytesOf(model.get("arrows"));
    const a = raw ? new Float32Array(raw.slice().buffer) : new Float32Array(0);
    const color = model.get("arrow_color");
    for (let i = 0; i + 5 < a.length; i += 6) {
      arrowShapes.push(
        viewer.addArrow({
          start: { x: a[i], y: a[i + 1], z: a[i + 2] },
          end: { x: a[i + 3], y: a[i + 4], z: a[i + 5] },
          radius: 0.08,
          radiusRatio: 2.0,
          mid: 0.75,
          color,
        }),
      );
    }
    el.dataset.arrows = String(arrowShapes.length);
    model.set("n_arrows_drawn", arrowShapes.length);
  }

  function drawEllipsoids() {
    for (const shape of ellipsoidShapes) viewer.removeShape(shape);
    ellipsoidShapes = [];
    const rawV = bytesOf(model.get("ellipsoid_vertices"));
    const rawF = bytesOf(model.get("ellipsoid_faces"));
    const v = rawV ? new Float32Array(rawV.slice().buffer) : new Float32Array(0);
    const f = rawF ? new Uint32Array(rawF.slice().buffer) : new Uint32Array(0);
    let triangles = 0;
    // One shape per chunk, one colour each: 3Dmol draws a custom shape's per-vertex colours black.
    for (const [v0, v1, f0, f1, colour] of model.get("ellipsoid_chunks") || []) {
      const vertexArr = [];
      const normalArr = [];
      for (let i = v0; i < v1; i++) {
        const o = 6 * i;
        vertexArr.push({ x: v[o], y: v[o + 1], z: v[o + 2] });
        normalArr.push({ x: v[o + 3], y: v[o + 4], z: v[o + 5] });
      }
      const faceArr = Array.from(f.subarray(3 * f0, 3 * f1));
      ellipsoidShapes.push(viewer.addCustom({ vertexArr, normalArr, faceArr, color: colour }));
      triangles += f1 - f0;
    }
    el.dataset.ellipsoidTriangles = String(triangles);
    model.set("n_ellipsoid_triangles", triangles);
  }

  // The picked atom's label, at the atom, in front of everything: one 3Dmol label per
  // line (a label draws one line), stacked by a screen offset, and extending towards the
  // middle of the canvas so that it is not cut at the edge.
  function drawLabel() {
    // 3Dmol's removeLabel and addLabel each render the whole scene (and rebuild moved atoms'
    // sticks): seconds a frame in a software-WebGL page for a label of four lines. The labels are
    // taken out and added without it; finish() renders once for all.
    const all = viewer.labels;
    for (const l of labels) {
      if (Array.isArray(all) && viewer.modelGroup && l.sprite) {
        const i = all.indexOf(l);
        if (i >= 0) all.splice(i, 1);
        l.dispose();
        viewer.modelGroup.remove(l.sprite);
      } else {
        viewer.removeLabel(l);
      }
    }
    labels = [];
    const lines = model.get("label_lines") || [];
    const xyz = model.get("label_xyz") || [];
    if (lines.length && xyz.length === 3) {
      const position = { x: xyz[0], y: xyz[1], z: xyz[2] };
      const screen = viewer.modelToScreen(position);
      const rect = box.getBoundingClientRect();
      const right = screen && screen.x - rect.left > rect.width / 2;
      lines.forEach((text, i) => {
        labels.push(
          viewer.addLabel(text, {
            position,
            inFront: true,
            fontSize: 11,
            fontColor: "black",
            backgroundColor: "#fffbe6",
            backgroundOpacity: 0.9,
            alignment: right ? "topRight" : "topLeft",
            screenOffset: $3Dmol.Vector2 ? new $3Dmol.Vector2(right ? -6 : 6, -6 - 17 * i) : { x: right ? -6 : 6, y: -6 - 17 * i },
          }, undefined, true),
        );
      });
    }
    el.dataset.label = lines.join(" · ");
  }

  function styleModel() {
    // Thin sticks for the context, thicker ones for the chosen residue.
    viewer.setStyle({}, { stick: { radius: 0.12 } });
    const sel = model.get("focus");
    if (sel && Object.keys(sel).length) viewer.setStyle(sel, { stick: { radius: 0.22 } });
    box.dataset.focus = JSON.stringify(sel || {});
  }

  // The sticks' atoms by index (PDB serial - 1), to move them when only positions change.
  let atomsByIndex = [];

  // New positions of the same atoms (model_xyz, float32 x y z by index): moved in place and the
  // model's geometry rebuilt at the next render, without parsing and styling the PDB text again.
  function moveAtoms() {
    const raw = bytesOf(model.get("model_xyz"));
    const m = viewer.getModel();
    if (!raw || !m) return;
    const xyz = new Float32Array(raw.slice().buffer);
    for (let i = 0; i < atomsByIndex.length && 3 * i + 2 < xyz.length; i++) {
      const atom = atomsByIndex[i];
      if (!atom) continue;
      atom.x = xyz[3 * i];
      atom.y = xyz[3 * i + 1];
      atom.z = xyz[3 * i + 2];
    }
    m.setInternalState(m.getInternalState()); // drops the built geometry: redrawn from the atoms
  }

  function drawModel() {
    viewer.removeAllModels();
    atomsByIndex = [];
    const text = model.get("model_text");
    if (text) {
      const m = viewer.addModel(text, model.get("model_format"));
      for (const atom of m.selectedAtoms({})) {
        if (Number.isInteger(atom.serial) && atom.serial > 0) atomsByIndex[atom.serial - 1] = atom;
      }
      moveAtoms();
      styleModel();
      // A click on an atom picks it (region and profile endpoint, chosen in Python):
      // the PDB serial is the atom's index + 1 (model_pdb writes them so).
      viewer.setClickable({}, true, (atom) => {
        if (atom && Number.isInteger(atom.serial)) model.send({ type: "pick", serial: atom.serial });
      });
    }
  }

  // Centre the camera on view_sphere [x, y, z, r] and zoom so the sphere fills the
  // canvas's shorter side (3Dmol's zoomTo fits atoms only: a residue's map box and its
  // neighbours ran past the canvas edge). zoomTo first, for its clipping slab.
  function zoomToSphere(sphere) {
    const sel = model.get("focus");
    const residue = sel && Object.keys(sel).length;
    viewer.zoomTo(residue ? sel : { model: 0 });
    if (!sphere || sphere.length !== 4 || !viewer.camera) return;
    const [x, y, z, r] = sphere;
    const w = box.clientWidth || 1;
    const h = box.clientHeight || 1;
    const tanHalf = Math.tan((Math.PI / 180) * viewer.camera.fov / 2) * Math.min(1, w / h);
    const view = viewer.getView();
    view[0] = -x;
    view[1] = -y;
    view[2] = -z;
    view[3] = -(r / tanHalf - viewer.CAMERA_Z);
    viewer.setView(view);
    // the clipping slab (relative to the centre) must hold the whole sphere too
    const slab = viewer.getSlab();
    viewer.setSlab(Math.min(slab.near, -r), Math.max(slab.far, r));
  }

  function fitToWidth() {
    // 3Dmol sizes its canvas once; the box can change width later (the notebook's side
    // panel, a wrapped layout): follow it, so the canvas never runs past the app's edge.
    viewer.resize();
  }

  function finish() {
    const zoom = model.get("zoom_key");
    if (zoom !== zoomed) {
      zoomToSphere(model.get("view_sphere"));
      el.dataset.zoomKey = String(zoom);
      zoomed = zoom;
    }
    viewer.render();
    model.set("n_rendered", model.get("n_rendered") + 1);
    el.dataset.rendered = String(model.get("n_rendered")); // for page tests: a frame is on the canvas
    model.save_changes();
  }

  // Several traits change in one update (map, level, style, arrows, focus): collect
  // them and redraw once, instead of contouring once per trait. A new map waits for
  // iso_delay_ms (default ISO_QUIET; 0 for relax frames, which come one at a time) without
  // a newer one: contouring runs on the page's main thread
  // (0.3-0.9 s in a software-WebGL page) and, started on every B-factor step, it held
  // up the next slice image by that much.
  const ISO_QUIET = 300;
  const dirty = new Set();
  let timer = null;
  let timerDue = 0;
  function redraw() {
    timer = null;
    const t0 = performance.now();
    const what = new Set(dirty);
    dirty.clear();
    try {
      if (what.has("model")) {
        drawModel();
        what.add("iso");
        what.add("arrows");
        what.add("ellipsoids");
      } else {
        if (what.has("coords")) moveAtoms();
        if (what.has("zoom")) styleModel();
      }
      if (what.has("iso")) drawIsosurface();
      if (what.has("arrows")) drawArrows();
      if (what.has("ellipsoids")) drawEllipsoids();
      if (what.has("label") || what.has("model")) drawLabel();
      finish();
      el.dataset.drawMs = (performance.now() - t0).toFixed(1); // page tests and benchmarks: this update's cost
    } catch (err) {
      report(`3D view: ${err.message || err}`);
    }
  }
  const mark = (what, delay = 0) => () => {
    dirty.add(what);
    const due = performance.now() + delay;
    if (delay > 0 && timer !== null && what === "iso") clearTimeout(timer); // a newer map: wait again
    else if (timer !== null && timerDue <= due) return;
    else if (timer !== null) clearTimeout(timer);
    timerDue = due;
    timer = setTimeout(redraw, delay);
  };
  fitToWidth();
  dirty.add("model");
  redraw();
  const observer = new ResizeObserver(() => {
    const w = box.clientWidth;
    if (w > 0 && w !== box.__wbWidth) {
      box.__wbWidth = w;
      fitToWidth();
      zoomed = -1; // re-centre the chosen residue in the new width
      mark("resize")();
    }
  });
  observer.observe(box);
  const handlers = [
    ["change:model_text", mark("model")],
    ["change:model_xyz", mark("coords")],
    ["change:map_bytes", (...a) => mark("iso", model.get("iso_delay_ms") ?? ISO_QUIET)(...a)],
    ["change:iso_level", (...a) => mark("iso", model.get("iso_delay_ms") ?? ISO_QUIET)(...a)],
    ["change:iso_style", mark("iso")],
    ["change:arrows", mark("arrows")],
    ["change:ellipsoid_vertices", mark("ellipsoids")],
    ["change:ellipsoid_chunks", mark("ellipsoids")],
    ["change:zoom_key", mark("zoom")],
    ["change:label_lines", mark("label")],
    ["change:label_xyz", mark("label")],
  ];
  for (const [event, fn] of handlers) model.on(event, fn);
  return () => {
    observer.disconnect();
    for (const [event, fn] of handlers) model.off(event, fn);
  };
}

export default { render };
