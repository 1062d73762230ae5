// The atom table of the workbench (anywidget ESM module): Python sends the table as
// escaped HTML (`value`); a click on a row sends {type: "pick", index} with the atom
// index of its data-atom attribute, and Python picks that atom (as a 3D click does).

function render({ model, el }) {
  el.classList.add("wb-atom-table");
  const draw = () => {
    el.innerHTML = model.get("value");
  };
  draw();
  model.on("change:value", draw);
  const click = (event) => {
    const row = event.target.closest("tr[data-atom]");
    if (!row || !el.contains(row)) return;
    const index = Number(row.dataset.atom);
    if (Number.isInteger(index)) model.send({ type: "pick", index });
  };
  el.addEventListener("click", click);
  return () => {
    model.off("change:value", draw);
    el.removeEventListener("click", click);
  };
}

export default { render };
