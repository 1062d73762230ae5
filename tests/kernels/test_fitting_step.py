"""A whole fitting step, eager and replayed (``kernels.fitting.Step``), and the compiled step's graph inputs.

On the CPU a Step runs eagerly and must give exactly the hand-written loop's results; on a GPU it replays one
CUDA graph and must stay within what two eager runs differ by (bitwise under deterministic algorithms). The
compiled loss of ``docs/kernels.md`` ("In a loop") must trace into a graph whose tensor inputs are the
user's tensors only: a host value such as ``grid.voxel_volume`` that ran torch ops on the cell's CPU
matrices put CPU tensors into the graph, which CUDA graph trees refuse ("not allocated in pool").
"""

from __future__ import annotations

import warnings

import pytest
import torch

import kernels
import kernels.fitting
from kernels.fitting import Step, StepError, StepWarning
from tests.helpers import model, requires_cuda


def _problem(name: str, device: str, spacing: float = 1.0, seed: int = 0):
    m = model(name)
    atoms = m.atoms.replace(u_aniso=None, aniso=None).to(device, torch.float32)
    grid = kernels.GridSpec.for_spacing(m.cell, spacing)
    planes = kernels.find_planes(m)
    target = kernels.splat_density(atoms, grid)
    g = torch.Generator(device=device).manual_seed(seed)
    start = atoms.xyz + 0.3 * torch.randn(atoms.xyz.shape, generator=g, device=device)
    return atoms, grid, planes, target, start


def _loss(atoms, grid, planes, target, x, lam=0.1):
    rho = kernels.splat_density(atoms.replace(xyz=x), grid)
    fit = ((rho - target) ** 2).sum() * grid.voxel_volume
    return fit, lam * kernels.planarity_nll(x, planes), rho


# --------------------------------------------------------------------------- the CPU: eager, said once


def test_cpu_step_is_the_hand_written_loop_bit_for_bit_and_says_once_that_it_runs_eagerly(monkeypatch):
    atoms, grid, planes, target, start = _problem("1orc", "cpu")
    x_hand = start.clone().requires_grad_(True)
    opt = torch.optim.Adam([x_hand], lr=0.02)
    for _ in range(5):
        opt.zero_grad(set_to_none=True)
        fit, nll, _ = _loss(atoms, grid, planes, target, x_hand)
        (fit + nll).backward()
        opt.step()

    monkeypatch.setattr(kernels.fitting, "_said_eager_on_cpu", False)
    x = start.clone().requires_grad_(True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        step = Step(lambda: sum(_loss(atoms, grid, planes, target, x)[:2]), [x], torch.optim.Adam([x], lr=0.02))
        Step(lambda: x.sum(), [x], torch.optim.SGD([x], lr=0.1))  # a second Step: nothing more is said
    said = [w for w in seen if issubclass(w.category, StepWarning)]
    assert len(said) == 1 and "eagerly on the CPU" in str(said[0].message)
    assert said[0].filename == __file__  # at the caller's line
    for _ in range(5):
        result = step()
    assert step.mode == "eager" and step.n_steps == 5
    assert torch.equal(x.detach(), x_hand.detach())
    assert result.loss.shape == () and not result.loss.requires_grad


def test_term_gradients_add_up_to_the_step_and_a_term_without_a_parameter_gives_zeros():
    atoms, grid, planes, target, start = _problem("1orc", "cpu")
    x = start.clone().requires_grad_(True)
    b = atoms.b_iso.clone().requires_grad_(True)

    def loss_fn():
        rho = kernels.splat_density(atoms.replace(xyz=x, b_iso=b), grid)
        fit = ((rho - target) ** 2).sum() * grid.voxel_volume
        return {"fit": fit, "planarity": 0.1 * kernels.planarity_nll(x, planes)}, {"rho": rho}

    opt = torch.optim.SGD([x, b], lr=0.0)  # lr 0: the parameters stay, so the gradients can be recomputed
    result = Step(loss_fn, [x, b], opt, term_grads=True)()
    assert set(result.terms) == {"fit", "planarity"} and set(result.grads) == {"fit", "planarity"}
    assert torch.equal(result.grads["planarity"][1], torch.zeros_like(b))  # planarity does not read B
    terms, aux = loss_fn()
    gx, gb = torch.autograd.grad(terms["fit"] + terms["planarity"], [x, b])
    torch.testing.assert_close(x.grad, gx, rtol=1e-5, atol=1e-5 * float(gx.abs().max()))
    torch.testing.assert_close(b.grad, gb, rtol=1e-5, atol=1e-5 * float(gb.abs().max()))
    torch.testing.assert_close(result.loss, terms["fit"].detach() + terms["planarity"].detach())
    assert torch.equal(result.aux["rho"], aux["rho"].detach())


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda x: Step(lambda: x.sum(), [], torch.optim.SGD([x], lr=1)), "at least one parameter"),
        (lambda x: Step(lambda: x.sum(), [x.detach()], torch.optim.SGD([x], lr=1)), "requires_grad=True"),
        (lambda x: Step(lambda: x.sum(), [x * 2], torch.optim.SGD([x], lr=1)), "leaf tensor"),
        (lambda x: Step(lambda: x.sum(), [x], torch.optim.SGD([x], lr=1), capture=True), "CUDA device"),
        (lambda x: Step(lambda: x.sum(), [x], torch.optim.SGD([x], lr=1), capture="yes"), "capture must be"),
        (lambda x: Step(lambda: x.sum(), [x], torch.optim.SGD([x], lr=1), warmup=0), "warmup"),
        (lambda x: Step(lambda: x, [x], torch.optim.SGD([x], lr=1))(), "must be a 0-d tensor"),
        (lambda x: Step(lambda: {}, [x], torch.optim.SGD([x], lr=1))(), "non-empty dict"),
        (lambda x: Step(lambda: [x.sum()], [x], torch.optim.SGD([x], lr=1))(), "it returned list"),
        (lambda x: Step(lambda: {"a": torch.ones(())}, [x], torch.optim.SGD([x], lr=1))(), "does not depend"),
        (lambda x: Step(lambda: ({"a": x.sum()}, {"rho": 1.0}), [x], torch.optim.SGD([x], lr=1))(), "aux output"),
    ],
)
def test_a_step_that_cannot_run_says_why(make, message):
    x = torch.ones(4, 3, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StepWarning)
        with pytest.raises(StepError, match=message):
            make(x)


def test_ensemble_occupancy_and_u_as_parameters_step_on_the_cpu():
    m = model("1pfe")  # anisotropic atoms: U is a parameter
    atoms = m.atoms.to("cpu", torch.float32)
    grid = kernels.GridSpec.for_spacing(m.cell, 1.0)
    target = kernels.splat_density(atoms, grid)
    frames = atoms.xyz.unsqueeze(0).repeat(3, 1, 1) + 0.1 * torch.randn(3, *atoms.xyz.shape)
    xyz = frames.clone().requires_grad_(True)
    occ = atoms.occ.clone().requires_grad_(True)
    u = atoms.u_aniso.clone().requires_grad_(True)

    def loss_fn():
        moved = atoms.replace(occ=occ, u_aniso=u)
        rho = kernels.splat_ensemble(moved, xyz, grid)
        return ((rho - target) ** 2).sum() * grid.voxel_volume

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StepWarning)
        step = Step(loss_fn, [xyz, occ, u], torch.optim.Adam([xyz, occ, u], lr=1e-3))
    first = float(step().loss)
    for _ in range(4):
        last = float(step().loss)
    assert last < first


# --------------------------------------------------------------------------- the compiled loss's graph inputs


def test_the_compiled_density_loss_takes_no_tensor_of_the_cell_as_input():
    """The recipe's loss (``× grid.voxel_volume``) on a grid whose host values no eager code has read."""
    m = model("1orc")
    atoms = m.atoms.replace(u_aniso=None, aniso=None).to("cpu", torch.float32)
    cell = kernels.Cell.from_parameters(*m.cell.parameters)  # new: nothing derived from it has been read
    grid = kernels.GridSpec.for_spacing(cell, 1.3)
    target = torch.rand(grid.shape)
    x = atoms.xyz.clone().requires_grad_(True)
    inputs = []

    def backend(gm, example_inputs):
        inputs.extend(example_inputs)
        return gm.forward

    def loss_fn(x):
        rho = kernels.splat_density(atoms.replace(xyz=x), grid)
        return ((rho - target) ** 2).sum() * grid.voxel_volume

    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, fullgraph=True, backend=backend)
    compiled(x).backward()
    shapes = sorted(tuple(t.shape) for t in inputs if isinstance(t, torch.Tensor))
    n = len(atoms)
    allowed = {(n, 3), (n,), (n, 5), tuple(grid.shape)}
    assert set(shapes) <= allowed, f"graph inputs beyond the atoms and the target: {shapes}"
    torch.testing.assert_close(compiled(x), loss_fn(x), rtol=1e-6, atol=0)


# --------------------------------------------------------------------------- a GPU: one replayed graph


def _run_steps(name, capture, n=50, deterministic=False, optimizer="adam", spacing=2 / 3):
    torch.use_deterministic_algorithms(deterministic)
    try:
        atoms, grid, planes, target, start = _problem(name, "cuda", spacing)
        x = start.clone().requires_grad_(True)
        opt = torch.optim.Adam([x], lr=0.02) if optimizer == "adam" else torch.optim.SGD([x], lr=2e-4, momentum=0.5)
        step = Step(lambda: sum(_loss(atoms, grid, planes, target, x)[:2]), [x], opt, capture=capture)
        for _ in range(n):
            result = step()
        torch.cuda.synchronize()
        return x.detach().clone(), float(result.loss), step.mode
    finally:
        torch.use_deterministic_algorithms(False)


@requires_cuda
@pytest.mark.parametrize("name", ["1orc", "1aki"])
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_replayed_steps_stay_within_what_two_eager_runs_differ_by(name, optimizer):
    eager_a, loss_a, mode_a = _run_steps(name, False, optimizer=optimizer)
    eager_b, _, _ = _run_steps(name, False, optimizer=optimizer)
    graph, loss_g, mode_g = _run_steps(name, True, optimizer=optimizer)
    assert (mode_a, mode_g) == ("eager", "graph")
    spread = float((eager_a - eager_b).abs().max())
    # float32 atomics: two eager runs differ in their last bits, which 50 steps grow; the replay is one more run
    assert float((graph - eager_a).abs().max()) <= 4 * spread + 1e-5
    assert abs(loss_g - loss_a) <= 1e-3 * abs(loss_a) + 1e-3


@requires_cuda
@pytest.mark.parametrize("name", ["1orc", "1aki"])
def test_a_deterministic_replay_equals_the_eager_steps_bit_for_bit(name):
    eager, _, _ = _run_steps(name, False, n=20, deterministic=True)
    graph, _, mode = _run_steps(name, True, n=20, deterministic=True)
    assert mode == "graph"
    assert torch.equal(graph, eager)


@requires_cuda
def test_replay_sees_b_occupancy_u_and_target_changed_in_place_and_term_gradients():
    m = model("1pfe")
    atoms = m.atoms.to("cuda", torch.float32)
    grid = kernels.GridSpec.for_spacing(m.cell, 0.9)  # no eager call has planned it
    planes = kernels.find_planes(m)
    target = torch.zeros(grid.shape, device="cuda")
    x = atoms.xyz.clone().requires_grad_(True)
    b, occ, u = (t.clone().requires_grad_(True) for t in (atoms.b_iso, atoms.occ, atoms.u_aniso))

    def loss_fn():
        rho = kernels.splat_density(atoms.replace(xyz=x, b_iso=b, occ=occ, u_aniso=u), grid)
        terms = {
            "fit": ((rho - target) ** 2).sum() * grid.voxel_volume,
            "planarity": 0.1 * kernels.planarity_nll(x, planes),
        }
        return terms, {"rho": rho}

    params = [x, b, occ, u]
    step = Step(loss_fn, params, torch.optim.SGD(params, lr=0.0), term_grads=True)
    for _ in range(5):
        step()
    assert step.mode == "graph"
    with torch.no_grad():  # in place, between replays: the next replay must see every one of them
        target.copy_(kernels.splat_density(atoms, grid))
        b.mul_(1.1)
        occ.mul_(0.9)
        u.mul_(1.05)
        x.add_(0.05)
    result = step()
    terms, aux = loss_fn()
    torch.testing.assert_close(
        result.aux["rho"], aux["rho"].detach(), rtol=1e-4, atol=1e-4 * float(aux["rho"].abs().max())
    )
    for name in ("fit", "planarity"):
        torch.testing.assert_close(result.terms[name], terms[name].detach(), rtol=1e-4, atol=0)
        want = torch.autograd.grad(terms[name], params, allow_unused=True)
        for got, w, p in zip(result.grads[name], want, params):
            w = torch.zeros_like(p) if w is None else w
            scale = float(w.abs().max()) or 1.0
            torch.testing.assert_close(got, w, rtol=1e-3, atol=1e-4 * scale)


@requires_cuda
def test_replayed_ensemble_and_tricubic_terms_match_eager():
    m = model("1aki")
    atoms = m.atoms.replace(u_aniso=None, aniso=None).to("cuda", torch.float32)
    grid = kernels.GridSpec.for_spacing(m.cell, 1.0)
    target = kernels.splat_density(atoms, grid)
    g = torch.Generator(device="cuda").manual_seed(2)
    frames = atoms.xyz.unsqueeze(0) + 0.2 * torch.randn((4, *atoms.xyz.shape), generator=g, device="cuda")
    pts = atoms.xyz[:200].clone()

    def run(capture):
        xyz = frames.clone().requires_grad_(True)
        p = pts.clone().requires_grad_(True)

        def loss_fn():
            rho = kernels.splat_ensemble(atoms, xyz, grid)
            fit = ((rho - target) ** 2).sum() * grid.voxel_volume
            return {"fit": fit, "sample": -kernels.tricubic_sample(target, grid, p).sum()}

        step = Step(loss_fn, [xyz, p], torch.optim.SGD([xyz, p], lr=1e-5), capture=capture)
        for _ in range(8):
            out = step()
        torch.cuda.synchronize()
        return xyz.detach(), p.detach(), float(out.loss), step.mode

    xe, pe, le, _ = run(False)
    xg, pg, lg, mode = run(True)
    assert mode == "graph"
    torch.testing.assert_close(xg, xe, rtol=0, atol=1e-4)
    torch.testing.assert_close(pg, pe, rtol=0, atol=1e-5)
    assert abs(lg - le) <= 1e-4 * abs(le)


@requires_cuda
def test_a_replaced_parameter_is_captured_again_and_a_host_read_in_the_loss_is_refused():
    atoms, grid, planes, target, start = _problem("1orc", "cuda", 1.0)
    x = start.clone().requires_grad_(True)
    opt = torch.optim.SGD([x], lr=1e-4)
    step = Step(lambda: sum(_loss(atoms, grid, planes, target, x)[:2]), [x], opt, warmup=1)
    step(), step()
    assert step.mode == "graph"
    with torch.no_grad():
        x.data = x.data.clone()  # another address: the graph would read the old one
    with pytest.warns(StepWarning, match="captured again"):
        step()
    assert step.mode == "warming up"
    step()
    assert step.mode == "graph"

    y = start.clone().requires_grad_(True)

    def reads_the_host():
        loss = sum(_loss(atoms, grid, planes, target, y)[:2])
        if float(loss) < 0:  # a host read: cannot be captured
            raise AssertionError
        return loss

    bad = Step(reads_the_host, [y], torch.optim.SGD([y], lr=1e-4), warmup=1)
    bad()
    with pytest.raises(StepError, match="could not be captured"):
        bad()


# --------------------------------------------------------------------------- the compiled recipe: every term, any order


def test_a_compiled_ensemble_sum_matches_eager():
    m = model("1orc")
    atoms = m.atoms.replace(u_aniso=None, aniso=None).to("cpu", torch.float32)
    grid = kernels.GridSpec.for_spacing(m.cell, 1.0)
    target = kernels.splat_density(atoms, grid)
    frames = atoms.xyz + 0.2 * torch.randn((4, *atoms.xyz.shape), generator=torch.Generator().manual_seed(0))

    def loss(x, w):
        return ((kernels.splat_ensemble(atoms, x, grid, weights=w) - target) ** 2).sum() * grid.voxel_volume

    leaves = [[frames.clone().requires_grad_(), torch.full((4,), 0.25, requires_grad=True)] for _ in range(2)]
    eager = loss(*leaves[0])
    eager.backward()
    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True)(*leaves[1])
    compiled.backward()
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=0)
    for got, want in zip(leaves[1], leaves[0]):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-6 * float(want.grad.abs().max()))
    # dynamo reports the ValueError inside its own exception, with the message
    with pytest.raises(Exception, match="reduce='sum'"):
        torch._dynamo.reset()
        torch.compile(lambda x: kernels.splat_ensemble(atoms, x, grid, reduce="none").sum(), fullgraph=True)(frames)


def _reduce_overhead_fit(loss_fn, leaves, optimizer, steps=6):
    """The docs' compiled recipe on ``leaves`` (static addresses, an optimiser updating them in place); returns them."""
    for t in leaves:
        torch._dynamo.mark_static_address(t)
    step_fn = torch.compile(loss_fn, fullgraph=True, mode="reduce-overhead")
    for _ in range(steps):
        torch.compiler.cudagraph_mark_step_begin()
        optimizer.zero_grad(set_to_none=True)
        step_fn(*leaves).backward()
        optimizer.step()
    torch.cuda.synchronize()
    return [t.detach().clone() for t in leaves]


def _eager_fit(loss_fn, leaves, optimizer, steps=6):
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss_fn(*leaves).backward()
        optimizer.step()
    torch.cuda.synchronize()
    return [t.detach().clone() for t in leaves]


@requires_cuda
@pytest.mark.parametrize(
    "terms, params, optimizer",
    [
        ("density", "xyz", "adam"),
        ("density+planarity", "xyz", "adam"),
        ("density+planarity+tricubic", "xyz+b+occ", "sgd"),
        ("density+planarity", "xyz+u", "adam"),
        ("ensemble", "xyz", "sgd"),
    ],
)
def test_the_compiled_recipe_replays_every_term_and_parameter(terms, params, optimizer):
    name = "1pfe" if "u" in params.split("+") else "1aki"
    m = model(name)
    atoms = m.atoms.to("cuda", torch.float32)
    if "u" not in params.split("+"):
        atoms = atoms.replace(u_aniso=None, aniso=None)
    grid = kernels.GridSpec.for_spacing(m.cell, 0.8)  # a grid no eager call plans before the compiled one
    planes = kernels.find_planes(m)
    target = torch.rand(grid.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    names = params.split("+")
    fields = {"xyz": "xyz", "b": "b_iso", "occ": "occ", "u": "u_aniso"}
    start = [getattr(atoms, fields[p]).detach().clone() for p in names]
    if terms == "ensemble":
        start[0] = atoms.xyz.unsqueeze(0) + 0.1 * torch.randn((3, *atoms.xyz.shape), device="cuda")

    def loss_fn(*leaves):
        given = dict(zip(names, leaves))
        if terms == "ensemble":
            moved = atoms.replace(**{fields[p]: t for p, t in given.items() if p != "xyz"})
            rho = kernels.splat_ensemble(moved, given["xyz"], grid, weights=torch.full((3,), 1 / 3, device="cuda"))
        else:
            rho = kernels.splat_density(atoms.replace(**{fields[p]: t for p, t in given.items()}), grid)
        loss = ((rho - target) ** 2).sum() * grid.voxel_volume
        if "planarity" in terms:
            loss = loss + 0.1 * kernels.planarity_nll(given["xyz"], planes)
        if "tricubic" in terms:
            loss = loss - kernels.tricubic_sample(target, grid, given["xyz"]).sum()
        return loss

    def make(leaves):
        return torch.optim.Adam(leaves, lr=1e-3) if optimizer == "adam" else torch.optim.SGD(leaves, lr=1e-6)

    eager_leaves = [t.clone().requires_grad_(True) for t in start]
    want = _eager_fit(loss_fn, eager_leaves, make(eager_leaves))
    torch._dynamo.reset()
    # Any order of compiled modes: the default mode first, in the same process, then reduce-overhead.
    plain = [t.clone().requires_grad_(True) for t in start]
    torch.compile(loss_fn, fullgraph=True)(*plain).backward()
    leaves = [t.clone().requires_grad_(True) for t in start]
    got = _reduce_overhead_fit(loss_fn, leaves, make(leaves))
    for g, w, s in zip(got, want, start):  # within 5 % of how far eager moved each parameter (float32 atomics)
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5 + 0.05 * float((w - s).abs().max()))


def test_weighted_terms_are_reported_unweighted_and_a_zero_weight_term_still_shows_its_gradient():
    atoms, grid, planes, target, start = _problem("1orc", "cpu")
    x = start.clone().requires_grad_(True)

    def loss_fn():
        fit, _, rho = _loss(atoms, grid, planes, target, x)
        return {"fit": fit, "planarity": kernels.planarity_nll(x, planes)}, {"rho": rho}

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StepWarning)
        result = Step(loss_fn, [x], torch.optim.SGD([x], lr=0.0), term_grads=True, weights={"planarity": 0.0})()
        grad = x.grad.clone()
        with pytest.raises(StepError, match="weights name terms"):
            Step(loss_fn, [x], torch.optim.SGD([x], lr=0.0), weights={"nll": 1.0})()
        with pytest.raises(StepError, match="finite number"):
            Step(loss_fn, [x], torch.optim.SGD([x], lr=0.0), weights={"planarity": float("nan")})
    assert torch.equal(result.loss, result.terms["fit"])  # planarity weighs 0
    assert float(result.grads["planarity"][0].abs().max()) > 0  # but its pull is reported
    torch.testing.assert_close(grad, result.grads["fit"][0])
