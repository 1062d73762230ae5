"""The structures the benchmarks run on, by name: the bundled examples and the repository's test data."""

from __future__ import annotations

import functools
import tempfile
import warnings
from pathlib import Path

import kernels

_TEST_DATA = Path(__file__).resolve().parents[1] / "tests" / "data"

#: name -> model file (PDB entries; see kernels/data/README.md and tests/data/README.md).
STRUCTURES: dict[str, Path] = {
    "1orc": kernels.example_structure("1orc"),
    "1pfe": kernels.example_structure("1pfe"),
    "1aki": kernels.example_structure("1aki"),
    "3o5r": _TEST_DATA / "3o5r.cif.gz",
    "5h73": _TEST_DATA / "5h73.cif.gz",
    "3wip": _TEST_DATA / "3wip.cif.gz",
}


#: The largest B (Å²) of a structure's high-B variant (``"3wip-hiB"``): the large high-B cell of the benchmarks.
HIGH_B = 250.0


def with_high_b(atoms: kernels.AtomSet) -> tuple[kernels.AtomSet, float]:
    """``atoms`` with every B (and U) scaled so that the largest B is :data:`HIGH_B`, and the scale."""
    scale = HIGH_B / float(atoms.b_iso.max())
    u = None if atoms.u_aniso is None else atoms.u_aniso * scale
    return atoms.replace(b_iso=atoms.b_iso * scale, u_aniso=u), scale


@functools.cache
def model(name: str) -> kernels.Model:
    """The structure ``name`` read with default options, ANISOU kept (cached: do not modify).

    3O5R's one atom whose ANISOU is not positive definite is splatted at its B (``on_bad_adp="iso"``;
    the warning saying so is expected and silenced here).
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "(?s).*not positive definite", UserWarning)
        return kernels.read_model(STRUCTURES[name], on_bad_adp="iso")


@functools.cache
def anisotropic_model(name: str) -> kernels.Model:
    """``name`` with anisotropic atoms: the entry's own ANISOU, or synthetic U where it has none.

    Entries with ANISOU (1PFE, 3O5R) are :func:`model`. For the others every atom gets
    :func:`kernels.testing.synthetic_anisou` (eigenvalue ratios up to 10, seed 0), written to an mmCIF
    and read back, so the atoms and ``model.structure`` (what gemmi splats) hold the same U.
    Cached: do not modify.
    """
    from kernels.testing import synthetic_anisou

    m = model(name)
    if m.atoms.u_aniso is not None:
        return m
    st = synthetic_anisou(STRUCTURES[name], max_ratio=10.0, seed=0)
    st.setup_entities()
    path = Path(tempfile.mkdtemp(prefix="density-workbench-")) / f"{name}-synthetic-anisou.cif"
    st.make_mmcif_document().write_file(str(path))
    return kernels.read_model(path)
