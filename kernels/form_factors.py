"""Form-factor coefficients from gemmi's tables, for X-ray, electron and neutron scattering."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["RADIATIONS", "form_factor_coefficients", "it92_coefficients"]

#: The scattering a model's coefficients can describe (``AtomSet.radiation``).
RADIATIONS = ("xray", "electron", "neutron")


def form_factor_coefficients(elements: Sequence[str], radiation: str = "xray", labels: Sequence[object] | None = None):
    """Form-factor coefficients from gemmi's tables as two float64 tensors ``a (N, 5)``, ``b (N, 5)``.

    Parameters
    ----------
    elements : sequence of str, length N
    radiation : {"xray", "electron", "neutron"}
        ``xray``: IT92 (:func:`it92_coefficients`). ``electron``: the five-Gaussian fits of
        International Tables C 4.3.2.2 (gemmi's ``c4322``). ``neutron``: the coherent scattering
        length in fm (gemmi's ``neutron92``) as term 1 with width 0, terms 2–5 zero.
    labels : sequence, optional
        Names the atom in the error (its ``str``: an :class:`kernels.AtomLabel` or any name).

    Raises
    ------
    ValueError
        ``radiation`` unknown, or the first atom whose element the table does not cover (named,
        with what to do).
    """
    import gemmi

    if radiation not in RADIATIONS:
        raise ValueError(f"radiation must be one of {RADIATIONS}, got {radiation!r}")
    if radiation == "xray":
        return it92_coefficients(elements, labels)
    table: dict[str, tuple[list[float], list[float]] | None] = {}
    a = np.zeros((len(elements), 5))
    b = np.zeros((len(elements), 5))
    for i, symbol in enumerate(elements):
        if symbol not in table:
            el = gemmi.Element(symbol)
            entry = None
            if el.atomic_number > 0:
                if radiation == "electron" and el.c4322 is not None and any(el.c4322.a):
                    entry = (list(el.c4322.a), list(el.c4322.b))
                elif radiation == "neutron" and el.neutron92 is not None:
                    length = el.neutron92.get_coefs()[0]
                    if length != 0:
                        entry = ([length, 0.0, 0.0, 0.0, 0.0], [0.0] * 5)
            table[symbol] = entry
        entry = table[symbol]
        if entry is None:
            who = f"atom {labels[i]}" if labels else f"atom {i}"
            what = (
                "electron form factor (International Tables 4.3.2.2)"
                if radiation == "electron"
                else ("neutron scattering length")
            )
            raise ValueError(
                f"{who} has element {symbol!r}, which has no {what} in gemmi: fix the element column of the "
                f"file or drop the atom before splatting a {radiation} map"
            )
        a[i], b[i] = entry
    return torch.from_numpy(a), torch.from_numpy(b)


def it92_coefficients(elements: Sequence[str], labels: Sequence[object] | None = None):
    """IT92 coefficients from gemmi as two float64 tensors ``a (N, 5)``, ``b (N, 5)``.

    The constant c is the fifth term, with width 0. Raises ``ValueError`` naming the
    first atom whose element gemmi does not know or has no IT92 entry for.
    """
    import gemmi

    table: dict[str, tuple[list[float], list[float]]] = {}
    a = np.zeros((len(elements), 5))
    b = np.zeros((len(elements), 5))
    for i, symbol in enumerate(elements):
        if symbol not in table:
            el = gemmi.Element(symbol)
            coef = el.it92 if el.atomic_number > 0 else None
            if coef is None or not any(coef.a):
                who = f"atom {labels[i]}" if labels else f"atom {i}"
                raise ValueError(
                    f"{who} has element {symbol!r}, which has no IT92 form factor in gemmi: "
                    "fix the element column of the file"
                )
            table[symbol] = (list(coef.a) + [coef.c], list(coef.b) + [0.0])
        a[i], b[i] = table[symbol]
    return torch.from_numpy(a), torch.from_numpy(b)
