"""Planarity restraint: the plane finder on real structures, every backend against the
float64 reference, gradcheck of the analytic backward with unequal σ, degenerate input."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections import Counter

import gemmi
import pytest
import torch

import kernels
from kernels.planarity.cpu import planarity_nll_cpu
from kernels.planarity.planes import PlaneSet
from kernels.planarity.reference import planarity_nll_reference
from kernels.planarity.triton import planarity_nll_triton
from tests.helpers import STRUCTURES, assert_close, assert_kernel_close, model, requires_cuda

# Triton runs on the GPU when there is one, else in the interpreter on CPU tensors.
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FAST = {
    "cpu-float32": (planarity_nll_cpu, torch.float32, "cpu"),
    "cpu-float64": (planarity_nll_cpu, torch.float64, "cpu"),
    "triton": (planarity_nll_triton, torch.float32, TRITON_DEVICE),
}


def _residue_counts(name: str) -> Counter:
    return Counter(res.name for chain in model(name).structure[0] for res in chain)


# --------------------------------------------------------------------------- plane finder


def test_find_planes_1aki_counts():
    planes = kernels.find_planes(model("1aki"))
    res = _residue_counts("1aki")
    # One chain of 129 amino acids, complete, no altlocs, no cis peptide: every residue
    # with a planar side chain gives one plane and every consecutive pair one peptide.
    n_aa = sum(v for k, v in res.items() if k != "HOH")
    assert n_aa == 129
    expected = {k: res[k] for k in ("ARG", "ASN", "ASP", "GLN", "GLU", "HIS", "PHE", "TRP", "TYR")}
    expected["trans-peptide"] = n_aa - 1
    assert planes.counts() == expected
    assert planes.skipped == {}
    assert len(planes) == 178
    sizes = {}
    for kind, size in zip(planes.kinds, planes.size.tolist()):
        sizes.setdefault(kind, Counter())[size] += 1
    side = {"ASN": 4, "ASP": 4, "GLN": 4, "GLU": 4, "ARG": 5, "HIS": 6, "PHE": 7, "TYR": 8, "TRP": 10}
    assert {k: dict(v) for k, v in sizes.items() if k != "trans-peptide"} == {k: {v: res[k]} for k, v in side.items()}
    # Peptide planes: 5 atoms, 6 when residue i+1 is a proline (with its CD); no hydrogens.
    assert dict(sizes["trans-peptide"]) == {5: 128 - res["PRO"], 6: res["PRO"]}


def test_find_planes_3wip_counts_cis_breaks_altlocs():
    m = model("3wip")
    planes = kernels.find_planes(m)
    counts = planes.counts()
    assert counts == {"ARG": 143, "ASN": 82, "ASP": 157, "GLN": 91, "GLU": 123, "HIS": 31, "PHE": 60, "TRP": 52,
                      "TYR": 71, "cis-peptide": 3, "trans-peptide": 2055}  # fmt: skip
    assert len(planes) == 2868
    # 11 gaps in the chains (C–N 5–8 Å): no peptide plane there, and they are counted.
    assert planes.skipped == {"peptide: chain break": 11}
    assert all("chain break" in line for line in planes.skipped_details)
    # Cis peptides, checked against gemmi's ω.
    cis = [w for k, w in zip(planes.kinds, planes.where) if k == "cis-peptide"]
    assert cis == ["F/SER 207-F/GLU 208", "F/GLU 208-F/ILE 209", "I/ASP 160-I/ASP 161"]
    residues = {(ch.name, r.seqid.num): (ch, i) for ch in m.structure[0] for i, r in enumerate(ch)}
    for where in cis:
        chain, a, _ = where.split("/", 2)
        num = int(where.split("-")[0].split()[-1])
        ch, i = residues[(chain, num)]
        omega = math.degrees(gemmi.calculate_omega(ch[i], ch[i + 1]))
        assert abs(omega) < 30, (where, omega)
    # Altlocs: residues with two conformers give two planes, each mixing its own altloc
    # atoms with the shared no-altloc atoms, and never atoms of another conformer.
    labels = m.atoms.labels
    for row, where in enumerate(planes.where):
        idx = planes.index[row, : planes.size[row]].tolist()
        alts = {labels[i].altloc for i in idx}
        letter = where.split(" altloc ")[1] if " altloc " in where else ""
        assert alts <= {"", letter}, (where, alts)
        if letter:
            assert letter in alts
    # GLN C178 has altlocs on its whole side chain: two amide planes with no shared atom.
    # Its peptide plane with THR 177 shares CA, C, O of THR and N of GLN; only GLN CA differs.
    for prefix, n_shared in [("C/GLN 178 altloc", 0), ("C/THR 177-C/GLN 178 altloc", 4)]:
        rows = [row for row, w in enumerate(planes.where) if w.startswith(prefix)]
        assert len(rows) == 2
        a, b = (set(planes.index[r, : planes.size[r]].tolist()) for r in rows)
        assert len(a & b) == n_shared and all(labels[i].altloc == "" for i in a & b)
    n_alt_planes = sum(" altloc " in w for w in planes.where)
    assert n_alt_planes > 50


def test_find_planes_cis_proline_and_missing_atoms_3o5r():
    planes = kernels.find_planes(model("3o5r"))
    # GLU 140 is truncated at CB in the deposited model.
    assert planes.skipped == {"GLU: missing atoms": 1}
    assert planes.skipped_details == ("A/GLU 140: GLU plane skipped, missing CG CD OE1 OE2",)
    (row,) = [r for r, k in enumerate(planes.kinds) if k == "cis-peptide"]
    assert planes.where[row] == "A/LEU 119-A/PRO 120"
    names = [model("3o5r").atoms.labels[i].atom_name for i in planes.index[row, : planes.size[row]].tolist()]
    assert names == ["CA", "C", "O", "N", "CA", "CD"]  # proline CD is bonded to N: in the plane


def test_find_planes_removed_atoms_are_skipped_and_counted(tmp_path):
    st = gemmi.read_structure(str(STRUCTURES["1aki"]))
    removed = []
    for res in st[0]["A"]:
        names = [a.name for a in res]
        if res.name == "PHE" and not removed:
            removed.append(f"{res.name} {res.seqid.num}")
            del res[names.index("CZ")]
        elif res.seqid.num == 50:  # the O of residue 50 breaks the peptide plane 50-51
            del res[names.index("O")]
    path = tmp_path / "1aki_edited.cif"
    st.setup_entities()
    st.make_mmcif_document().write_file(str(path))
    planes = kernels.find_planes(kernels.read_model(path))
    assert planes.skipped == {"PHE: missing atoms": 1, "peptide: missing atoms": 1}
    assert planes.counts()["PHE"] == 2 and planes.counts()["trans-peptide"] == 127
    assert any("missing CZ" in d for d in planes.skipped_details)
    assert any(" 50-" in d and "missing O" in d for d in planes.skipped_details)


def test_find_planes_nucleic_acid_bases_1pfe():
    planes = kernels.find_planes(model("1pfe"))
    counts = planes.counts()
    assert {k: counts[k] for k in ("DA", "DC", "DG", "DT")} == {"DA": 1, "DC": 3, "DG": 3, "DT": 1}
    sizes = {k: s for k, s in zip(planes.kinds, planes.size.tolist())}
    assert sizes["DA"] == 11 and sizes["DG"] == 12 and sizes["DC"] == 9 and sizes["DT"] == 10
    labels = model("1pfe").atoms.labels
    for row, kind in enumerate(planes.kinds):
        if kind.startswith("D") and kind != "DSN":
            assert "C1'" in {labels[i].atom_name for i in planes.index[row, : planes.size[row]].tolist()}


def test_planeset_layout():
    planes = kernels.find_planes(model("1aki"))
    size = planes.size.tolist()
    assert size == sorted(size)
    groups = planes.groups()
    assert sum(s.stop - s.start for s in groups.values()) == len(planes)
    for k, s in groups.items():
        assert set(size[s]) == {k}
    assert planes.index.dtype == torch.int32 and planes.sigma.dtype == torch.float64
    for row in range(len(planes)):
        k = size[row]
        assert torch.isinf(planes.sigma[row, k:]).all() and (planes.sigma[row, :k] == 0.02).all()
        assert (planes.index[row, k:] == planes.index[row, 0]).all()
        assert (planes.weight()[row, k:] == 0).all()
    n_slots = int(planes.size.sum())
    assert planes.constant == pytest.approx(n_slots * (math.log(0.02) + 0.5 * math.log(2 * math.pi)), rel=1e-12)


def _write_monomer_library(root):
    """A minimal CCP4-layout monomer library with one entry (acetate), written here."""
    (root / "list").mkdir(parents=True)
    (root / "a").mkdir()
    (root / "list" / "mon_lib_list.cif").write_text(
        "global_\n_lib_name mon_lib\n_lib_version test\ndata_comp_list\nloop_\n_chem_comp.id\n"
        "_chem_comp.three_letter_code\nACT ACT\n"
    )
    (root / "ener_lib.cif").write_text("global_\ndata_energy\nloop_\n_lib_atom.type\n_lib_atom.weight\nC 12.0\n")
    atoms = "\n".join(f"ACT {a} {e} {t} 0" for a, e, t in [("C", "C", "C"), ("O", "O", "O"), ("OXT", "O", "OC"),
                                                          ("CH3", "C", "CH3")])  # fmt: skip
    plane = "\n".join(f"ACT plan-1 {a} 0.030" for a in ("C", "O", "OXT", "CH3"))
    (root / "a" / "ACT.cif").write_text(
        "global_\ndata_comp_list\nloop_\n_chem_comp.id\n_chem_comp.three_letter_code\n_chem_comp.name\n"
        "_chem_comp.group\nACT ACT 'ACETATE ION' non-polymer\ndata_comp_ACT\nloop_\n_chem_comp_atom.comp_id\n"
        "_chem_comp_atom.atom_id\n_chem_comp_atom.type_symbol\n_chem_comp_atom.type_energy\n"
        f"_chem_comp_atom.charge\n{atoms}\nloop_\n_chem_comp_plane_atom.comp_id\n_chem_comp_plane_atom.plane_id\n"
        f"_chem_comp_plane_atom.atom_id\n_chem_comp_plane_atom.dist_esd\n{plane}\n"
    )


def test_find_planes_monomer_library(tmp_path, monkeypatch):
    monkeypatch.delenv("CLIBD_MON", raising=False)
    m = model("5h73")
    base = kernels.find_planes(m)
    assert not any(k.startswith("ACT") for k in base.kinds)  # no library: built-in planes only, no error
    lib = tmp_path / "monomers"
    _write_monomer_library(lib)
    with_lib = kernels.find_planes(m, monomer_library=lib)
    assert with_lib.counts()["ACT plan-1"] == _residue_counts("5h73")["ACT"] == 4
    assert len(with_lib) == len(base) + 4
    rows = [r for r, k in enumerate(with_lib.kinds) if k == "ACT plan-1"]
    assert all(int(with_lib.size[r]) == 4 and (with_lib.sigma[r, :4] == 0.03).all() for r in rows)
    monkeypatch.setenv("CLIBD_MON", str(lib))
    assert kernels.find_planes(m).counts() == with_lib.counts()
    with pytest.raises(ValueError, match="monomer library"):
        kernels.find_planes(m, monomer_library=tmp_path / "nowhere")


# --------------------------------------------------------------------------- synthetic planes


def _synthetic(seed=0, n_planes=4, noise=0.1, unequal=True, offset=80.0):
    """Near-planar groups of 4–9 atoms (some atoms shared), σ from 0.01 to 0.2 Å."""
    g = torch.Generator().manual_seed(seed)
    xyz, planes, sigmas = [], [], []
    for p in range(n_planes):
        k = 4 + (p * 2) % 6
        basis = torch.linalg.qr(torch.randn(3, 3, generator=g, dtype=torch.float64))[0]
        inplane = torch.randn(k, 2, generator=g, dtype=torch.float64) * 1.5
        off = torch.randn(k, generator=g, dtype=torch.float64) * noise
        pts = inplane @ basis[:, :2].T + off[:, None] * basis[:, 2] + offset + 5 * p
        start = len(xyz)
        xyz.extend(pts)
        idx = list(range(start, start + k))
        if p > 0:
            idx[0] = planes[-1][-1]  # share one atom with the previous plane
        planes.append(idx)
        s = (0.01 + 0.19 * torch.rand(k, generator=g, dtype=torch.float64)) if unequal else torch.full((k,), 0.05)
        sigmas.append(s.tolist())
    xyz = torch.stack(xyz)
    return xyz, PlaneSet.from_lists(planes, sigmas, n_atoms=len(xyz))


def test_gradcheck_cpu_analytic_backward_unequal_sigma():
    xyz, planes = _synthetic()
    x = xyz.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda v: planarity_nll_cpu(v, planes), (x,), eps=1e-6, atol=1e-6, rtol=1e-6)
    # The test can fail: the gradient an unweighted plane fit would give is far from it.
    w = planes.weight()
    pts = xyz[planes.index.long()]
    mask = (w > 0).double()
    c = (mask[..., None] * pts).sum(1) / mask.sum(1, keepdim=True)
    y = pts - c[:, None]
    n = torch.linalg.eigh(torch.einsum("pk,pki,pkj->pij", mask, y, y)).eigenvectors[:, :, 0]
    wrong = torch.zeros_like(xyz).index_add_(
        0, planes.index.long().reshape(-1), ((w * (y * n[:, None]).sum(-1))[..., None] * n[:, None]).reshape(-1, 3)
    )
    planarity_nll_cpu(x, planes).backward()
    assert (wrong - x.grad).abs().max() > 1e-2 * x.grad.abs().max()


def test_gradcheck_reference():
    xyz, planes = _synthetic(seed=1, n_planes=3)
    x = xyz.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda v: planarity_nll_reference(v, planes), (x,), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("path", list(FAST))
@pytest.mark.parametrize("noise", [0.01, 0.3])
def test_fast_paths_match_reference_synthetic(path, noise):
    fn, dtype, device = FAST[path]
    xyz, planes = _synthetic(seed=2, n_planes=40, noise=noise)
    _check_against_reference(fn, dtype, xyz, planes, device)


# --------------------------------------------------------------------------- real structures


def _check_against_reference(fn, dtype, xyz, planes, device="cpu"):
    x_in = xyz.to(dtype)
    x_ref = x_in.detach().double().clone().requires_grad_(True)  # the same input values
    ref = planarity_nll_reference(x_ref, planes)
    ref.backward()
    x = x_in.detach().clone().to(device).requires_grad_(True)
    out = fn(x, planes)
    out.backward()
    assert out.dtype == dtype
    if dtype == torch.float64:
        # Both in float64; only the eigen-solvers differ (closed form vs LAPACK): 1e-9.
        assert_close(out, ref, atol=0, rtol=1e-9)
        assert_close(x.grad, x_ref.grad, atol=1e-9 * float(x_ref.grad.abs().max()), rtol=1e-9)
    else:
        # docs/kernels.md's float32 contract, on the loss, on the data term alone (the log σ
        # constant can dominate the loss) and on every gradient element.
        assert_kernel_close(out.cpu(), ref)
        data, ref_data = out.double().cpu() - planes.constant, ref - planes.constant
        assert_close(data, ref_data, atol=1e-5 * abs(float(ref_data)))
        assert_kernel_close(x.grad.cpu(), x_ref.grad)


@pytest.mark.parametrize("path", list(FAST))
@pytest.mark.parametrize("name", ["1aki", "3wip", "1pfe"])
def test_fast_paths_match_reference_real(path, name):
    fn, dtype, device = FAST[path]
    m = model(name)
    _check_against_reference(fn, dtype, m.atoms.xyz, kernels.find_planes(m), device)


def test_public_api_dispatch_and_errors():
    m = model("1aki")
    planes = kernels.find_planes(m)
    x = m.atoms.xyz
    ref = kernels.planarity_nll(x, planes, backend="reference")
    assert ref.dtype == torch.float64
    auto = kernels.planarity_nll(x.float(), planes)  # auto on the CPU: the C++ backend
    assert_kernel_close(auto, ref)
    with pytest.raises(ValueError, match="atoms"):
        kernels.planarity_nll(x[:-1], planes)
    with pytest.raises(ValueError, match=r"\(N, 3\)"):
        kernels.planarity_nll(x[:, :2], planes)
    with pytest.raises(TypeError, match="PlaneSet"):
        kernels.planarity_nll(x, [[0, 1, 2]])
    with pytest.raises(kernels.BackendError, match="unknown backend"):
        kernels.planarity_nll(x, planes, backend="fortran")
    with pytest.raises(ValueError, match="at least 3"):
        PlaneSet.from_lists([[0, 1]], n_atoms=3)
    with pytest.raises(ValueError, match="σ"):
        PlaneSet.from_lists([[0, 1, 2]], [[0.02, 0.0, 0.02]], n_atoms=3)


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
def test_empty_planeset(backend):
    x = torch.randn(5, 3, device=TRITON_DEVICE if backend == "triton" else "cpu", requires_grad=True)
    planes = PlaneSet.from_lists([], n_atoms=5)
    out = kernels.planarity_nll(x, planes, backend=backend)
    out.backward()
    assert float(out) == 0.0 and (x.grad == 0).all()


# --------------------------------------------------------------------------- degenerate input


def _degenerate_case():
    """Six separate planes: good, collinear, coincident, NaN, inf, good (no shared atoms)."""
    g = torch.Generator().manual_seed(5)
    base = torch.tensor([50.1, 60.2, 70.3], dtype=torch.float64)
    u = torch.tensor([0.3, 0.5, 0.81], dtype=torch.float64)
    u = u / u.norm()
    good1 = base + torch.randn(6, 3, generator=g, dtype=torch.float64) * torch.tensor([1.5, 1.5, 0.05])
    collinear = base + torch.tensor([0.0, 1.1, 2.3, 3.7, 5.2], dtype=torch.float64)[:, None] * u
    coincident = base.expand(4, 3).clone()
    nan = base + torch.randn(5, 3, generator=g, dtype=torch.float64)
    nan[2, 1] = float("nan")
    inf = base + torch.randn(4, 3, generator=g, dtype=torch.float64)
    inf[0, 0] = float("inf")
    good2 = base + 3 + torch.randn(7, 3, generator=g, dtype=torch.float64) * torch.tensor([0.05, 1.5, 1.5])
    groups = [good1, collinear, coincident, nan, inf, good2]
    xyz = torch.cat(groups)
    planes, start = [], 0
    for grp in groups:
        planes.append(list(range(start, start + len(grp))))
        start += len(grp)
    sig = [[0.02 + 0.01 * (i % 3) for i in range(len(p))] for p in planes]
    full = PlaneSet.from_lists(planes, sig, n_atoms=len(xyz))
    good = PlaneSet.from_lists([planes[0], planes[5]], [sig[0], sig[5]], n_atoms=len(xyz))
    bad_rows = torch.zeros(len(xyz), dtype=torch.bool)
    for p in planes[1:5]:
        bad_rows[p] = True
    return xyz, full, good, bad_rows


@pytest.mark.parametrize(
    "fn,dtype,device",
    [(planarity_nll_reference, torch.float64, "cpu"), *FAST.values()],
    ids=["reference", *FAST],
)
def test_degenerate_planes_finite_zero_gradient(fn, dtype, device):
    xyz, full, good, bad_rows = _degenerate_case()
    xyz, bad_rows = xyz.to(device), bad_rows.to(device)
    x = xyz.to(dtype).clone().requires_grad_(True)
    out = fn(x, full)
    out.backward()
    assert torch.isfinite(out)
    assert torch.isfinite(x.grad).all()
    assert (x.grad[bad_rows] == 0).all()
    # The good planes are unaffected: same data term and gradients as without the bad ones.
    x2 = torch.where(bad_rows[:, None], torch.zeros_like(xyz), xyz).to(dtype).clone().requires_grad_(True)
    ref = fn(x2, good)
    ref.backward()
    assert_close(out.double() - full.constant, ref.double() - good.constant, atol=1e-4 * abs(float(ref)), rtol=1e-5)
    assert_close(x.grad[~bad_rows], x2.grad[~bad_rows], atol=1e-5 * float(x2.grad.abs().max()), rtol=1e-5)
    assert out.device.type == torch.device(device).type


def test_triton_repeated_calls_bit_identical():
    # The loss is reduced by the last program through a ticket it resets, and the gradient is
    # gathered per atom (no atomics): repeated calls, with and without grad, agree bit for bit.
    m = model("1aki")
    planes = kernels.find_planes(m)
    outs, grads = [], []
    for _ in range(3):
        x = m.atoms.xyz.float().to(TRITON_DEVICE).requires_grad_(True)
        out = planarity_nll_triton(x, planes)
        out.backward()
        outs.append(out.detach())
        grads.append(x.grad)
    with torch.no_grad():
        outs.append(planarity_nll_triton(m.atoms.xyz.float().to(TRITON_DEVICE), planes))
    assert all(torch.equal(o, outs[0]) for o in outs) and all(torch.equal(g, grads[0]) for g in grads)
    in_planes = torch.zeros(len(m.atoms), dtype=torch.bool)
    in_planes[planes.index.long().flatten()] = True
    assert (grads[0].cpu()[~in_planes] == 0).all() and (grads[0].cpu()[in_planes] != 0).any()


# --------------------------------------------------------------------------- CUDA


@requires_cuda
@pytest.mark.parametrize("name", ["1aki", "3wip"])
def test_triton_cuda_matches_reference(name):
    m = model(name)
    _check_against_reference(planarity_nll_triton, torch.float32, m.atoms.xyz, kernels.find_planes(m), device="cuda")


@requires_cuda
def test_triton_cuda_no_host_sync():
    m = model("3wip")
    planes = kernels.find_planes(m)
    x = m.atoms.xyz.float().cuda().requires_grad_(True)
    kernels.planarity_nll(x, planes).backward()  # moves the planes to the GPU once (cached)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            kernels.planarity_nll(x, planes).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@requires_cuda
def test_triton_cuda_first_call_fresh_cache(tmp_path):
    # Triton's disk cache hides the first compile: run in a subprocess with an empty cache
    # and compare call 1, call 2 and the reference.
    code = (
        "import torch, kernels\n"
        "from tests.helpers import model, assert_kernel_close\n"
        "from kernels.planarity.reference import planarity_nll_reference\n"
        "m = model('1aki'); planes = kernels.find_planes(m)\n"
        "xr = m.atoms.xyz.float().double().requires_grad_(True); r = planarity_nll_reference(xr, planes); r.backward()\n"
        "for call in range(2):\n"
        "    x = m.atoms.xyz.float().cuda().requires_grad_(True)\n"
        "    out = kernels.planarity_nll(x, planes, backend='triton'); out.backward()\n"
        "    assert_kernel_close(out.cpu(), r); assert_kernel_close(x.grad.cpu(), xr.grad)\n"
        "print('ok')\n"
    )
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton-cache"))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


@requires_cuda
def test_triton_cuda_graph_replay_matches_reference():
    # A refinement loop captures its step once and replays it: forward+backward must be
    # capturable (no sync, no host-side allocation of device tables after the warm-up) and a
    # replay must follow new coordinates copied into the captured input.
    m = model("3wip")
    planes = kernels.find_planes(m)
    base = m.atoms.xyz.float()
    x = base.cuda().requires_grad_(True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compile, device tables) off the capture
        for _ in range(2):
            x.grad = None
            planarity_nll_triton(x, planes).backward()
    torch.cuda.current_stream().wait_stream(side)
    x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = planarity_nll_triton(x, planes)
        loss.backward()
    grad = x.grad
    g = torch.Generator().manual_seed(11)
    for _ in range(3):
        new = base + 0.05 * torch.randn(base.shape, generator=g)
        with torch.no_grad():
            x.copy_(new.cuda())
        graph.replay()
        torch.cuda.synchronize()
        xr = new.double().requires_grad_(True)
        ref = planarity_nll_reference(xr, planes)
        ref.backward()
        assert_kernel_close(loss.detach().cpu(), ref.detach())
        assert_close(loss.detach().double().cpu() - planes.constant, ref.detach() - planes.constant,
                     atol=1e-5 * abs(float(ref) - planes.constant))  # fmt: skip
        assert_kernel_close(grad.cpu(), xr.grad)
        assert x.grad is grad  # replays write the captured gradient in place
    # Eager calls after capture (ticket counter reset by every launch) still agree.
    x2 = new.cuda().requires_grad_(True)
    out = planarity_nll_triton(x2, planes)
    out.backward()
    assert_kernel_close(out.detach().cpu(), ref.detach())
    assert_kernel_close(x2.grad.cpu(), xr.grad)
