// 3D view of the workbench: 3Dmol.js driven by synced traits (anywidget ESM module).
//
// The library comes from `lib_source` (the text of a local 3Dmol-min.js, sent once by
// Python when WORKBENCH_3DMOL_JS names a file: offline use and CI) or else from
// `lib_url` (the CDN). The map arrives as binary CCP4 bytes (`map_bytes`, a DataView
// here), arrows as float32 bytes, 6 numbers (start xyz, end xyz) per arrow.

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

async function render({ model, el }) {
  el.classList.add("wb-view3d");
  const box = document.createElement("div");
  box.className = "wb-view3d-canvas";
  box.style.position = "relative";
  box.style.width = "100%";
  box.style.height = `${model.get("height")}px`;
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
  let zoomed = -1;

  // The isosurface and the arrows are separate shapes, rebuilt only when their own
  // traits change: a B-factor drag changes the map and level, not the arrows, and
  // rebuilding hundreds of arrow meshes per update held a software-WebGL page for seconds.
  let isoShapes = [];
  let arrowShapes = [];

  function drawIsosurface() {
    for (const shape of isoShapes) viewer.removeShape(shape);
    isoShapes = [];
    const map = bytesOf(model.get("map_bytes"));
    if (map) {
      const shape = viewer.addVolumetricData(map, "ccp4", {
        isoval: model.get("iso_level"),
        color: model.get("iso_color"),
        opacity: 0.85,
        wireframe: true,
      });
      if (shape) isoShapes.push(shape);
    }
  }

  function drawArrows() {
    for (const shape of arrowShapes) viewer.removeShape(shape);
    arrowShapes = [];
    const raw = bytesOf(model.get("arrows"));
    if (!raw) return;
    const a = new Float32Array(raw.slice().buffer);
    const color = model.get("arrow_color");
    for (let i = 0; i + 5 < a.length; i += 6) {
      arrowShapes.push(
        viewer.addArrow({
          start: { x: a[i], y: a[i + 1], z: a[i + 2] },
          end: { x: a[i + 3], y: a[i + 4], z: a[i + 5] },
          radius: 0.06,
          radiusRatio: 2.0,
          color,
        }),
      );
    }
  }

  function drawShapes() {
    drawIsosurface();
    drawArrows();
  }

  function drawModel() {
    viewer.removeAllModels();
    const text = model.get("model_text");
    if (text) {
      viewer.addModel(text, model.get("model_format"));
      viewer.setStyle({}, { stick: { radius: 0.12 } });
    }
  }

  function finish() {
    const zoom = model.get("zoom_key");
    if (zoom !== zoomed) {
      const sel = model.get("focus");
      viewer.zoomTo(sel && Object.keys(sel).length ? sel : {});
      zoomed = zoom;
    }
    viewer.render();
    model.set("n_rendered", model.get("n_rendered") + 1);
    model.save_changes();
  }

  try {
    drawModel();
    drawShapes();
    finish();
  } catch (err) {
    report(`3D view: ${err.message || err}`);
  }
  const guarded = (draw) => () => {
    try {
      draw();
      finish();
    } catch (err) {
      report(`3D view: ${err.message || err}`);
    }
  };
  const onModel = guarded(() => {
    drawModel();
    drawShapes();
  });
  const onIso = guarded(drawIsosurface);
  const onArrows = guarded(drawArrows);
  const onZoom = guarded(() => {});
  const handlers = [
    ["change:model_text", onModel],
    ["change:map_bytes", onIso],
    ["change:iso_level", onIso],
    ["change:arrows", onArrows],
    ["change:zoom_key", onZoom],
  ];
  for (const [event, fn] of handlers) model.on(event, fn);
  return () => {
    for (const [event, fn] of handlers) model.off(event, fn);
  };
}

export default { render };
