"""The kernels in a fitting loop: atoms built every step, compiled steps, a fit that converges.

An optimiser's step rebuilds the atoms from its tensors (``AtomSet(...)`` or ``atoms.replace(xyz=x)``);
building must cost no per-atom work and read no value (so no GPU synchronisation); the compiled step
must give eager's gradients; a real-space fit from a distorted start must come back to the model.
"""

from __future__ import annotations

import gc
import tracemalloc
import warnings

import pytest
import torch

import kernels
import kernels.atoms
from kernels.crystal import AtomLabel, AtomSet, GridSpec
from tests.helpers import model, requires_cuda


def _atoms(n: int) -> AtomSet:
    g = torch.Generator().manual_seed(n)
    xyz = torch.rand((n, 3), generator=g) * 30
    coef = torch.rand((n, 5), generator=g)
    return AtomSet(xyz, torch.full((n,), 20.0), torch.ones(n), coef, coef * 10)


def _python_blocks(build) -> tuple[int, int]:
    """(bytes, blocks) of Python memory the result of ``build()`` holds on to (tensor storage is not Python's)."""
    build()  # caches, first-call paths
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        kept = build()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    # Only what the AtomSet code allocates (the dataclass's generated __init__ runs as "<string>"): other
    # threads of the process (compile workers, the kernels' pools) may allocate meanwhile.
    ours = (kernels.atoms.__file__, "<string>")
    stats = [s for s in after.compare_to(before, "filename") if s.traceback[0].filename in ours]
    del kept
    return sum(s.size_diff for s in stats), sum(s.count_diff for s in stats)


@pytest.mark.parametrize("how", ["constructor", "replace"])
def test_building_atoms_does_not_grow_with_n(how):
    sizes = {}
    for n in (10, 20_000):
        base = _atoms(n)
        x = base.xyz.clone().requires_grad_(True)
        build = {
            "constructor": lambda b=base, x=x: AtomSet(x, b.b_iso, b.occ, b.a, b.b),
            "replace": lambda b=base, x=x: b.replace(xyz=x),
        }[how]
        sizes[n] = _python_blocks(build)
    (small_bytes, small_blocks), (big_bytes, big_blocks) = sizes[10], sizes[20_000]
    # One AtomSet and its lazy label and symbol sequences: the same few objects at any N
    # (one label object per atom would be ~2 MB and 40,000 blocks at 20,000 atoms).
    assert abs(big_blocks - small_blocks) <= 4 and abs(big_bytes - small_bytes) <= 1024, sizes


def test_default_labels_and_symbols_are_made_when_read_and_compare_like_tuples():
    atoms = _atoms(5)
    assert not isinstance(atoms.labels, tuple) and not isinstance(atoms.elements, tuple)  # made when read
    assert atoms.labels[3] == AtomLabel("", "", 4, "", "#4", "") and str(atoms.labels[-1]) == "/ 5/#5"
    assert list(atoms.elements) == ["?"] * 5 and atoms.elements.count("?") == 5
    assert atoms.labels == tuple(AtomLabel("", "", i + 1, "", f"#{i + 1}", "") for i in range(5))
    assert atoms.labels[1:3] == (atoms.labels[1], atoms.labels[2])
    with pytest.raises(IndexError, match="atom index 5 out of range for 5 atoms"):
        atoms.labels[5]
    named = atoms.replace(labels=tuple(atoms.labels), elements=("C",) * 5)
    assert named != atoms and named.replace(elements=atoms.elements) == atoms
    assert atoms.replace(xyz=atoms.xyz.clone()).labels is atoms.labels  # shared, never copied


def test_building_reads_no_value_and_check_names_the_bad_atom():
    atoms = _atoms(4)
    xyz = atoms.xyz.clone()
    xyz[2, 1] = float("nan")
    moved = atoms.replace(xyz=xyz, b_iso=torch.tensor([20.0, -1.0, 20.0, 20.0]))  # built: values are not read
    with pytest.raises(ValueError, match=r"atom / 3/#3 \(index 2\) has a non-finite position"):
        moved.check()
    with pytest.raises(ValueError, match=r"atom / 2/#2 \(index 1\) has B ≤ 0 or non-finite B: -1.0"):
        moved.replace(xyz=atoms.xyz).check()
    with pytest.raises(ValueError, match="non-finite position"):
        kernels.check_finite(moved)


# --------------------------------------------------------------------------- a step of the fit

SPACING = 1.0


def _problem(device: str, name: str = "1orc", shift: float = 0.5):
    """(true atoms, start positions, planes, grid, target map) on ``device``, float32."""
    m = model(name)
    atoms = m.atoms.to(device, torch.float32)
    grid = GridSpec.for_spacing(m.cell, SPACING)
    planes = kernels.find_planes(m)
    with torch.no_grad():
        target = kernels.splat_density(atoms, grid)
    g = torch.Generator().manual_seed(0)
    start = atoms.xyz + (torch.randn(atoms.xyz.shape, generator=g) * shift / 3**0.5).to(device)
    return atoms, start, planes, grid, target


def _loss(atoms: AtomSet, x: torch.Tensor, planes, grid: GridSpec, target: torch.Tensor, lam: float, build: str):
    if build == "replace":
        moved = atoms.replace(xyz=x)
    else:
        moved = AtomSet(x, atoms.b_iso, atoms.occ, atoms.a, atoms.b, u_aniso=atoms.u_aniso, aniso=atoms.aniso)
    rho = kernels.splat_density(moved, grid)
    return ((rho - target) ** 2).sum() * grid.voxel_volume + lam * kernels.planarity_nll(x, planes)


def _rmsd(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((x.detach() - ref) ** 2).sum(dim=1).mean().sqrt())


def test_fit_from_a_distorted_start_comes_back_to_the_model():
    atoms, start, planes, grid, target = _problem("cpu")
    x = start.clone().requires_grad_(True)
    opt = torch.optim.LBFGS([x], max_iter=20, history_size=20, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad(set_to_none=True)
        loss = _loss(atoms, x, planes, grid, target, 0.1, "replace")
        loss.backward()
        return loss

    first = _rmsd(x, atoms.xyz)
    rmsd = []
    for _ in range(3):  # at most 75 evaluations (20 iterations a step, 1.25 evaluations each at most)
        opt.step(closure)
        rmsd.append(_rmsd(x, atoms.xyz))
    # measured: 0.51 -> 0.19, 0.12, 0.097 Å after 25, 46, 67 evaluations (1orc, 1 Å grid, λ = 0.1)
    assert 0.45 < first < 0.55 and rmsd[0] < first and rmsd[2] < rmsd[0] and rmsd[2] < 0.15, (first, rmsd)


def _compiled_matches_eager(device: str, build: str, name: str):
    """The loss of B, occupancy and U too (1pfe: anisotropic atoms beside isotropic ones)."""
    atoms, start, planes, grid, target = _problem(device, name)

    def loss(x, b, occ, u):
        if build == "replace":
            moved = atoms.replace(xyz=x, b_iso=b, occ=occ, u_aniso=u)
        else:
            moved = AtomSet(x, b, occ, atoms.a, atoms.b, u_aniso=u, aniso=atoms.aniso)
        rho = kernels.splat_density(moved, grid)
        return ((rho - target) ** 2).sum() * grid.voxel_volume + 0.1 * kernels.planarity_nll(x, planes)

    def value_and_grads(fn):
        leaves = [start, atoms.b_iso, atoms.occ] + ([] if atoms.u_aniso is None else [atoms.u_aniso])
        leaves = [t.detach().clone().requires_grad_(True) for t in leaves]
        value = fn(*leaves, *([None] * (4 - len(leaves))))
        return value.detach(), torch.autograd.grad(value, leaves)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager = value_and_grads(loss)
        torch._dynamo.reset()
        compiled = value_and_grads(torch.compile(loss, fullgraph=True))
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=0)
    for field, got, want in zip(("xyz", "b_iso", "occ", "u_aniso"), compiled[1], eager[1]):
        scale = float(want.abs().max())
        assert scale > 0 or (field == "b_iso" and bool(atoms.aniso.all())), field  # 1pfe: every atom uses U
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * scale, msg=lambda m, f=field: f"{f}: {m}")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, requires_cuda])])
@pytest.mark.parametrize("name", ["1orc", "1pfe"])
@pytest.mark.parametrize("build", ["constructor", "replace"])
def test_compiled_step_gradients_equal_eager(build, name, device):
    _compiled_matches_eager(device, build, name)


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("name", ["1orc", "1pfe"])
@pytest.mark.parametrize("build", ["constructor", "replace"])
def test_a_cuda_step_never_synchronises(build, name):
    atoms, start, planes, grid, target = _problem("cuda", name)
    x = start.clone().requires_grad_(True)
    opt = torch.optim.Adam([x], lr=0.05)

    def step():
        opt.zero_grad(set_to_none=True)
        _loss(atoms, x, planes, grid, target, 0.1, build).backward()
        opt.step()

    step()  # first call: plans, device tables, the memory query
    torch.cuda.synchronize()
    before = x.detach().clone()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert not torch.equal(x.detach(), before)


class _CountingScatter:
    """The C++ module with its calls counted (the real kernels run)."""

    def __init__(self, module):
        self._module, self.calls = module, {}

    def __getattr__(self, name):
        fn = getattr(self._module, name)
        if name not in ("splat", "gather", "gather_aniso"):
            return fn

        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*args, **kwargs)

        return counted


@pytest.mark.parametrize("name", ["1orc", "1pfe"])
def test_a_compiled_cpu_step_runs_the_forward_once(name, monkeypatch):
    """The compiled backward is the C++ gather alone, as the eager one is: no second forward."""
    from kernels.density import cpu

    atoms, start, planes, grid, target = _problem("cpu", name)
    loss = torch.compile(_loss, fullgraph=True)
    x = start.clone().requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch._dynamo.reset()
        loss(atoms, x, planes, grid, target, 0.1, "replace").backward()  # compiles
        counting = _CountingScatter(cpu._scatter)
        monkeypatch.setattr(cpu, "_scatter", counting)
        for _ in range(2):
            loss(atoms, x, planes, grid, target, 0.1, "replace").backward()
    backward = "gather" if atoms.u_aniso is None else "gather_aniso"
    assert counting.calls == {"splat": 2, backward: 2}, counting.calls
