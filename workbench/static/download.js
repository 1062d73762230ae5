// Browser downloads for the workbench (anywidget ESM module). Python sends
// {type: "download", filename, mime} with the file's bytes as the message's one buffer;
// the page saves them as a file through a Blob URL and a temporary <a download> link.
// Registered once per model (initialize), so several views never download twice.

function save(msg, buffers) {
  if (!msg || msg.type !== "download" || !buffers || !buffers.length) return;
  const view = buffers[0];
  const bytes = new Uint8Array(view.buffer, view.byteOffset, view.byteLength);
  const url = URL.createObjectURL(new Blob([bytes], { type: msg.mime || "application/octet-stream" }));
  const link = document.createElement("a");
  link.href = url;
  link.download = msg.filename || "download";
  link.style.display = "none";
  document.body.appendChild(link);
  link.click();
  link.remove();
  // the download has its own copy once started; free the Blob a little later
  setTimeout(() => URL.revokeObjectURL(url), 60_000);
}

function initialize({ model }) {
  model.on("msg:custom", save);
  return () => model.off("msg:custom", save);
}

function render({ el }) {
  el.classList.add("wb-download");
  el.style.display = "none";
}

export default { initialize, render };
