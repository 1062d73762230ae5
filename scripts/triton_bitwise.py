"""Store the Triton density kernels' maps and gradients, and compare two stores bit for bit.

For a change that must not move a single bit (splitting or restructuring the kernels): run ``save`` under
the tree before and the tree after (each on ``PYTHONPATH``), then ``compare``. Small structures, so the
Triton interpreter runs it on a CPU in about a minute; on a GPU it checks the compiled kernels (float32
atomics: compare only with ``--deterministic``, whose maps are bitwise reproducible).

Cases: four cells (orthogonal, monoclinic, hexagonal, triclinic: each kernel path — separable,
z-separable, full exponent), isotropic and anisotropic (mixed) atoms and an isotropic neutron set,
per-atom and fixed radius, float32 and float64 atoms, one map and two frames; each stores the map
and the gradients of ``sum(w · map)`` with respect to xyz, B, occupancy and U.

``ptx`` (run without ``TRITON_INTERPRET``; no GPU needed) compiles every kernel in a set of
constexpr variants for sm_90 and stores, per variant, a hash of its PTX instructions as a multiset
(register numbers and labels normalised, debug lines dropped), their count, and a hash of the sm_90
machine code ptxas makes of it (SASS, through Triton's bundled disassembler; addresses and encodings
dropped): equal PTX multisets mean the compiler emitted the same instructions; equal SASS means the GPU
runs the same program, so a restructuring of the source kept the speed too.

Usage::

    TRITON_INTERPRET=1 PYTHONPATH=/path/to/before python scripts/triton_bitwise.py save before.pt
    TRITON_INTERPRET=1 PYTHONPATH=. python scripts/triton_bitwise.py save after.pt
    python scripts/triton_bitwise.py compare before.pt after.pt
    PYTHONPATH=/path/to/before python scripts/triton_bitwise.py ptx before.json   # and after.json
    python scripts/triton_bitwise.py compare before.json after.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import warnings

import torch

CELLS = {
    "orthogonal": (14.0, 15.0, 16.0, 90.0, 90.0, 90.0),
    "monoclinic": (14.0, 15.0, 16.0, 90.0, 104.0, 90.0),
    "hexagonal": (15.0, 15.0, 16.0, 90.0, 90.0, 120.0),
    "triclinic": (14.0, 15.0, 16.0, 80.0, 95.0, 105.0),
}
SHAPE = (20, 21, 24)  # nz % 4 == 0 takes the z-group path; 21 the lane-by-lane rows
ELEMENTS = ["C", "N", "O", "S", "C", "H"]


def _atoms(dtype: torch.dtype, aniso: bool, radiation: str = "xray"):
    from kernels.crystal import AtomSet

    g = torch.Generator().manual_seed(7)
    n = len(ELEMENTS)
    xyz = torch.rand((n, 3), generator=g, dtype=torch.float64) * 14.0
    xyz[-1] += torch.tensor([30.0, -16.0, 48.0], dtype=torch.float64)  # lattice translations away
    b_iso = 8.0 + 30.0 * torch.rand(n, generator=g, dtype=torch.float64)
    occ = 0.5 + 0.5 * torch.rand(n, generator=g, dtype=torch.float64)
    atoms = AtomSet.from_elements(ELEMENTS, xyz, b_iso, occ, radiation=radiation)
    if aniso:
        u = torch.zeros((n, 6), dtype=torch.float64)
        u[:, :3] = b_iso[:, None] / 78.95683520871486 * (1.0 + 0.3 * torch.rand((n, 3), generator=g))
        u[:, 3:] = 0.02 * (torch.rand((n, 3), generator=g) - 0.5)
        flag = torch.tensor([True, True, False, True, True, False])
        atoms = atoms.replace(u_aniso=u, aniso=flag)
    # float64 sets: positions wrapped in float64 inside the kernels, the rest cast to float32 (with a warning)
    return atoms.to("cuda" if torch.cuda.is_available() else "cpu", dtype)


def _case(name: str, atoms, grid, radius) -> dict[str, torch.Tensor]:
    from kernels.density.triton import splat_triton

    leaves = {"xyz": atoms.xyz, "b_iso": atoms.b_iso, "occ": atoms.occ}
    if atoms.u_aniso is not None:
        leaves["u_aniso"] = atoms.u_aniso
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in leaves.items()}
    rho = splat_triton(atoms.replace(**leaves), grid, radius=radius)
    w = torch.cos(torch.arange(rho.numel(), dtype=torch.float32, device=rho.device) * 0.37).reshape(rho.shape)
    grads = torch.autograd.grad((rho * w).sum(), list(leaves.values()))
    out = {f"{name}/map": rho.detach().cpu()}
    out.update({f"{name}/grad_{k}": g.detach().cpu() for k, g in zip(leaves, grads)})
    return out


def save(path: str, deterministic: bool) -> None:
    from kernels.crystal import Cell, GridSpec

    torch.use_deterministic_algorithms(deterministic)
    results: dict[str, torch.Tensor] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for cell_name, params in CELLS.items():
            grid = GridSpec(Cell.from_parameters(*params), SHAPE)
            for kind, aniso, radiation in (
                ("iso", False, "xray"),
                ("aniso", True, "xray"),
                ("neutron", False, "neutron"),
            ):
                for dtype in (torch.float32, torch.float64):
                    for radius in (None, 2.5):
                        atoms = _atoms(dtype, aniso, radiation)
                        name = f"{cell_name}/{kind}/{str(dtype)[6:]}/r{radius}"
                        results.update(_case(name, atoms, grid, radius))
            frames = _atoms(torch.float32, False)
            results.update(_frames_case(f"{cell_name}/frames", frames, grid))
    torch.save(results, path)
    print(f"{len(results)} tensors -> {path}")


def _frames_case(name: str, atoms, grid) -> dict[str, torch.Tensor]:
    """Two frames of the atoms (the second moved), through splat_frames_triton."""
    from kernels.crystal import AtomSet
    from kernels.density.triton import splat_frames_triton

    xyz = torch.cat([atoms.xyz, atoms.xyz + 0.37]).detach().requires_grad_(True)
    b_iso = torch.cat([atoms.b_iso, atoms.b_iso]).detach().requires_grad_(True)
    occ = torch.cat([atoms.occ, atoms.occ]).detach().requires_grad_(True)
    a, b = torch.cat([atoms.a, atoms.a]), torch.cat([atoms.b, atoms.b])
    both = AtomSet(xyz, b_iso, occ, a, b, _validate=False)
    rho = splat_frames_triton(both, grid, n_frames=2)
    w = torch.cos(torch.arange(rho.numel(), dtype=torch.float32, device=rho.device) * 0.37).reshape(rho.shape)
    grads = torch.autograd.grad((rho * w).sum(), [xyz, b_iso, occ])
    out = {f"{name}/map": rho.detach().cpu()}
    out.update({f"{name}/grad_{k}": g.detach().cpu() for k, g in zip(("xyz", "b_iso", "occ"), grads)})
    return out


# Pointer and scalar types of the kernels' arguments, for compiling them without a launch.
_SIGNATURE = {
    "xyz_ptr": "*fp32", "u_ptr": "*fp32", "flag_ptr": "*u8", "b_iso_ptr": "*fp32", "occ_ptr": "*fp32",
    "a_ptr": "*fp32", "b_ptr": "*fp32", "radius_ptr": "*fp32", "p_ptr": "*fp64", "n_atoms": "i32",
    "atoms_per_frame": "i32", "out_ptr": "*fp32", "grad_ptr": "*fp32", "gxyz_ptr": "*fp32", "gu_ptr": "*fp32",
    "gb_ptr": "*fp32", "gocc_ptr": "*fp32", "fix_ptr": "*i64", "fix_shift": "i32",
}  # fmt: skip


def _variants():
    """(kernel, constexprs) pairs: each kernel's cell paths, z layouts and modes."""
    from kernels.density import triton as T

    for fn in (T._splat_fwd_kernel, T._splat_bwd_kernel):
        for separable in (True, False):
            for vec in (True, False):
                const = dict(ATOMS=1, BP=16, BQ=8, SEPARABLE=separable, PER_ATOM_RADIUS=True, INDEX64=not vec,
                             VEC=vec, FRAMES=not vec)  # fmt: skip
                if "FIXED" in fn.arg_names:
                    for zsep, fixed in ((not separable, False), (False, True)):
                        yield fn, dict(const, ZSEP=zsep, FIXED=fixed)
                else:
                    yield fn, const
    for fn in (T._aniso_fwd_kernel, T._aniso_bwd_kernel):
        for rule, neutron, vec, separable in ((1, False, True, True), (2, False, False, False), (1, True, True, False)):
            const = dict(ATOMS=1, BP=8, BQ=8, RULE=rule, NEUTRON=neutron, INDEX64=rule == 2, VEC=vec,
                         FRAMES=not vec, SEPARABLE=separable)  # fmt: skip
            if "FIXED" in fn.arg_names:
                yield fn, dict(const, FIXED=False)
                if not neutron:
                    yield fn, dict(const, FIXED=True)
            else:
                yield fn, const


def ptx(path: str) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    out = {}
    for fn, const in _variants():
        sig = {n: "constexpr" if n in const else _SIGNATURE[n] for n in fn.arg_names}
        src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
        lines = [line.split("//")[0].strip() for line in kernel.asm["ptx"].splitlines()]
        lines = [line for line in lines if line and not line.startswith((".loc", ".file", "$L__tmp"))]
        start = next(i for i, line in enumerate(lines) if ".entry" in line)
        body = lines[start : start + lines[start:].index("}") + 1]
        ops = [re.sub(r"%[a-z]+\d+", "R", re.sub(r"\$L__\w+", "L", line)) for line in body]
        key = fn.__name__ + "/" + ",".join(f"{k}={int(v)}" for k, v in const.items())
        out[key] = [_sha1(sorted(ops)), len(body), _sha1(_sass(kernel.asm["cubin"]))]
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"{len(out)} kernel variants -> {path}")


def _sass(cubin: bytes) -> list[str]:
    """The machine instructions of a cubin (Triton's bundled disassembler), without addresses or encodings."""
    from triton.tools.disasm import get_sass

    lines = [re.sub(r"/\*[0-9a-f]{4,}\*/", "", line).strip() for line in get_sass(cubin).splitlines()]
    return [line for line in lines if line and not line.startswith(("/*", "//", "."))]


def _sha1(lines: list[str]) -> str:
    return hashlib.sha1("\n".join(lines).encode()).hexdigest()


def compare(before: str, after: str) -> int:
    if before.endswith(".json"):
        with open(before) as f, open(after) as g:
            a, b = json.load(f), json.load(g)
        bad = [k for k in a if a[k] != b.get(k)] + [k for k in b if k not in a]
        for k in bad:
            print(f"DIFFERS {k}: {a.get(k)} -> {b.get(k)}")
        print(f"{len(a) - len(bad)} of {len(a)} kernel variants emit the same instructions")
        return 1 if bad else 0
    a, b = torch.load(before), torch.load(after)
    if set(a) != set(b):
        print(f"different cases: only before {sorted(set(a) - set(b))}, only after {sorted(set(b) - set(a))}")
        return 1
    bad = 0
    for key in sorted(a):
        x, y = a[key], b[key]
        same = (
            x.dtype == y.dtype
            and x.shape == y.shape
            and torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8))
        )
        if not same:
            bad += 1
            diff = (x.double() - y.double()).abs()
            print(f"DIFFERS {key}: {int((diff > 0).sum())} of {x.numel()} elements, worst {float(diff.max()):.3g}")
    print(f"{len(a) - bad} of {len(a)} tensors bitwise identical")
    return 1 if bad else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("save", help="store the maps and gradients of this tree's kernels")
    s.add_argument("path")
    s.add_argument("--deterministic", action="store_true", help="the fixed-point forward (bitwise on a GPU too)")
    x = sub.add_parser("ptx", help="store each kernel variant's sm_90 instructions (hash and count) as JSON")
    x.add_argument("path")
    c = sub.add_parser("compare", help="compare two stores bit for bit (exit 1 on any difference)")
    c.add_argument("before")
    c.add_argument("after")
    args = parser.parse_args(argv)
    if args.command == "save":
        save(args.path, args.deterministic)
        return 0
    if args.command == "ptx":
        ptx(args.path)
        return 0
    return compare(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())
