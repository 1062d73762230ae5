"""``kernels._util.assume_constant_result`` leaves the mark torch's decorator leaves, without dynamo.

``import kernels`` must not import ``torch._dynamo`` (a second, with sympy and Triton); the kernels
mark their compile-time constants with this helper instead of ``torch.compiler.assume_constant_result``.
tests/notebooks/test_cli_help.py checks in a fresh interpreter that the import stays out.
"""

from __future__ import annotations

import sys

import torch

from kernels import _util


def _f():
    return 1


def _g():
    return 1


def test_the_mark_is_the_one_torch_leaves(monkeypatch):
    torch.compiler.assume_constant_result(_f)  # imports torch._dynamo in this process
    # the helper's own path, taken when dynamo is not loaded yet
    monkeypatch.delitem(sys.modules, "torch._dynamo")
    _util.assume_constant_result(_g)
    assert vars(_f) and vars(_g) == vars(_f)


def test_compiled_planarity_and_tricubic_helpers_are_marked():
    from kernels import planarity, tricubic

    torch.compiler.assume_constant_result(_f)
    for helper in (planarity._backend_name, tricubic._backend_name):
        assert {k: v for k, v in vars(helper).items() if k in vars(_f)} == vars(_f)
