"""Reciprocal space: structure factors from maps, statistics by resolution shell, FSC.

:func:`structure_factors` takes a map (the density kernels' output) to F(hkl) by FFT;
:func:`shells` compares two sets of factors shell by shell; :func:`fsc` compares two maps.
Backends: ``fft`` (a pruned real-to-complex ``torch.fft`` transform in the map's precision, CPU or
GPU) and ``reference`` (a full float64 complex transform, the truth the tests hold ``fft`` to).
"""

from kernels.reciprocal.factors import (
    SF_BACKENDS,
    StructureFactors,
    fourier_synthesis,
    sampling_blur,
    structure_factors,
)
from kernels.reciprocal.files import (
    ReflectionData,
    ReflectionFileError,
    RFactor,
    r_factor,
    read_structure_factors,
    write_structure_factors,
)
from kernels.reciprocal.miller import finest_d_min, inverse_d_squared
from kernels.reciprocal.shells import BINNINGS, ShellTable, fsc, shells

__all__ = [
    "BINNINGS",
    "RFactor",
    "ReflectionData",
    "ReflectionFileError",
    "SF_BACKENDS",
    "ShellTable",
    "StructureFactors",
    "finest_d_min",
    "fourier_synthesis",
    "fsc",
    "inverse_d_squared",
    "r_factor",
    "read_structure_factors",
    "sampling_blur",
    "shells",
    "structure_factors",
    "write_structure_factors",
]
