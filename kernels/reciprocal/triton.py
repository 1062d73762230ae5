"""Shell statistics of structure factors on a GPU: one Triton launch per table.

:func:`shell_statistics` takes a set of factors, optionally a reference set, a gather index that lists
the reflections shell by shell, and the shells' bounds in that list. One program per shell walks its
reflections in blocks, gathers both sets through the index, forms the per-reflection values in float64
(|F|², |F_ref|², |F|, |F_ref|, |F|·|F_ref|, |F − F_ref|², (|F| − |F_ref|)², ||F| − |F_ref||,
|Δφ|·|F_ref| and Re F·F_ref*), sums them in its registers and writes the shell's finished columns: no
atomics, no intermediate arrays, nothing read back to the host, and the same sums in the same order
on every call (a torch formulation of the same table takes some fifty small launches).

|Δφ| is computed without libdevice (the interpreter has none): atan2 folded to a half-angle form whose
argument lies in [0, 1], two more half-angle reductions to below tan(π/16), and a 12-term series: a few
ulps of float64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._launch import FastLauncher

__all__ = ["shell_statistics"]

_N_ROWS = 7  # the rows of a table against a reference: kernels.reciprocal.shells.STAT_COLUMNS

_BLOCK = 256  # reflections per step of a program: ten float64 accumulators of 2 values per thread


@triton.jit
def _atan01(u):
    """atan(u) for float64 0 ≤ u ≤ 1."""
    # atan(u) = 2·atan(u / (1 + √(1 + u²))), twice: the argument falls below tan(π/16) ≈ 0.199
    u = u / (1.0 + tl.sqrt(1.0 + u * u))
    u = u / (1.0 + tl.sqrt(1.0 + u * u))
    z = u * u
    one = z * 0.0 + 1.0  # float64 ones: a float literal would be a float32 constant
    # atan(u)/u = Σ_k (−z)^k / (2k + 1), k = 0..11: the first term left out is below 1e-18 of the sum
    p = one / 23
    for kk in tl.static_range(11):
        p = p * (-z) + one / (21 - 2 * kk)
    return 4.0 * u * p


@triton.jit
def _abs_angle(x, y, pi):
    """|atan2(y, x)| in [0, π] for float64 x, y (0 for x = y = 0)."""
    ay = tl.abs(y)
    r = tl.sqrt(x * x + ay * ay)
    right = x >= 0
    den = tl.where(right, r + x, r - x)  # no cancellation: the sum of two non-negative values
    u = tl.where(den > 0, ay / tl.where(den > 0, den, 1.0), 0.0)
    half = 2.0 * _atan01(u)  # atan2(|y|, |x|)
    return tl.where(right, half, pi - half)


@triton.jit
def _load_factors(ptr, i, m, COMPLEX: tl.constexpr):
    """Real and imaginary parts (float64) of factors ``i`` (masked by ``m``): re/im pairs when COMPLEX, else
    real amplitudes with phase 0."""
    if COMPLEX:
        re = tl.load(ptr + 2 * i, mask=m, other=0.0).to(tl.float64)
        im = tl.load(ptr + 2 * i + 1, mask=m, other=0.0).to(tl.float64)
    else:
        re = tl.load(ptr + i, mask=m, other=0.0).to(tl.float64)
        im = re * 0.0
    return re, im


@triton.jit(do_not_specialize=["n_shells"])
def _shell_stats_kernel(
    f_ptr,  # (M,) real or (M, 2) re/im pairs (F_COMPLEX), float32 or float64
    r_ptr,  # the reference, laid out as f (R_COMPLEX); unused without WITH_REF
    idx_ptr,  # (L,) int64: the reflections (rows of f and r) shell by shell
    bounds_ptr,  # (n_shells + 1,) int64: shell s is idx[bounds[s]:bounds[s + 1]]
    out_ptr,  # (7, n_shells) float64 (1 row without WITH_REF): shells.STAT_COLUMNS
    n_shells,
    F_COMPLEX: tl.constexpr,
    R_COMPLEX: tl.constexpr,
    WITH_REF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    s = tl.program_id(0)
    lo = tl.load(bounds_ptr + s)
    hi = tl.load(bounds_ptr + s + 1)
    zero = tl.zeros([BLOCK], dtype=tl.float64)
    s_aa = zero
    s_bb = zero
    s_a = zero
    s_b = zero
    s_ab = zero
    s_diff2 = zero
    s_amp2 = zero
    s_amp1 = zero
    s_bphase = zero
    s_cross = zero
    pi = 4.0 * _atan01(zero + 1.0)
    for start in range(lo, hi, BLOCK):
        j = start + tl.arange(0, BLOCK)
        m = j < hi
        i = tl.load(idx_ptr + j, mask=m, other=0)
        fr, fi = _load_factors(f_ptr, i, m, F_COMPLEX)
        aa = fr * fr + fi * fi
        s_aa += aa
        if WITH_REF:
            rr, ri = _load_factors(r_ptr, i, m, R_COMPLEX)
            bb = rr * rr + ri * ri
            a = tl.sqrt(aa)
            b = tl.sqrt(bb)
            cross_re = fr * rr + fi * ri
            cross_im = fi * rr - fr * ri
            d = a - b
            dre = fr - rr
            dim = fi - ri
            s_bb += bb
            s_a += a
            s_b += b
            s_ab += a * b
            s_diff2 += dre * dre + dim * dim
            s_amp2 += d * d
            s_amp1 += tl.abs(d)
            s_bphase += _abs_angle(cross_re, cross_im, pi) * b
            s_cross += cross_re
    n = (hi - lo).to(tl.float64)
    aa_t = tl.sum(s_aa, axis=0)
    tl.store(out_ptr + s, aa_t / n)
    if WITH_REF:
        bb_t = tl.sum(s_bb, axis=0)
        a_t = tl.sum(s_a, axis=0)
        b_t = tl.sum(s_b, axis=0)
        ab_t = tl.sum(s_ab, axis=0)
        one = n * 0.0 + 1.0
        pi_t = tl.max(pi, axis=0)
        tl.store(out_ptr + n_shells + s, tl.sqrt(tl.sum(s_diff2, axis=0) / bb_t))
        tl.store(out_ptr + 2 * n_shells + s, tl.sqrt(tl.sum(s_amp2, axis=0) / bb_t))
        tl.store(out_ptr + 3 * n_shells + s, tl.sum(s_bphase, axis=0) / b_t * (180 * one / pi_t))
        tl.store(out_ptr + 4 * n_shells + s, tl.sum(s_amp1, axis=0) / b_t)
        cov = n * ab_t - a_t * b_t
        var_a = n * aa_t - a_t * a_t
        var_b = n * bb_t - b_t * b_t
        tl.store(out_ptr + 5 * n_shells + s, cov / tl.sqrt(var_a * var_b))
        tl.store(out_ptr + 6 * n_shells + s, tl.sum(s_cross, axis=0) / tl.sqrt(aa_t * bb_t))


_launch = FastLauncher(_shell_stats_kernel)


def _pairs(f: torch.Tensor) -> torch.Tensor:
    """``f`` (M,) as the kernel reads it: a complex set as (M, 2) re/im pairs, a real one as it is; contiguous."""
    f = f.detach()
    if f.is_complex():
        return torch.view_as_real(f.resolve_conj().contiguous())
    if f.dtype not in (torch.float32, torch.float64):
        f = f.to(torch.float32)
    return f.contiguous()


def shell_statistics(
    f: torch.Tensor, reference: torch.Tensor | None, index: torch.Tensor, bounds: torch.Tensor
) -> torch.Tensor:
    """Per-shell statistics of ``f`` (against ``reference``) in one launch, nothing read back.

    Parameters
    ----------
    f : torch.Tensor, shape (M,), complex64/complex128 (or float32/float64 amplitudes)
        The factors, on a CUDA device (or on the CPU under ``TRITON_INTERPRET=1``).
    reference : torch.Tensor, shape (M,), complex or real, or None
        The reference factors, same rows as ``f``, same device.
    index : torch.Tensor, shape (L,), int64
        Rows of ``f`` shell by shell (a plan's ``order``, or an FFT's flat indices in shell order).
    bounds : torch.Tensor, shape (S + 1,), int64
        Shell ``s`` is ``index[bounds[s]:bounds[s + 1]]``.

    Returns
    -------
    torch.Tensor, shape (7, S) float64 (with a reference) or (1, S)
        The rows of :data:`kernels.reciprocal.shells.STAT_COLUMNS`: ⟨|F|²⟩ unscaled, then ‖F − F_ref‖/‖F_ref‖, ‖|F| − |F_ref|‖/‖F_ref‖,
        the |F_ref|-weighted mean |Δφ| in degrees, R, the correlation of |F| and |F_ref|, and the FSC.
        An empty shell's columns are NaN.
    """
    n_shells = bounds.shape[0] - 1
    fp = _pairs(f)
    rp = fp if reference is None else _pairs(reference)
    with_ref = reference is not None
    out = torch.empty((_N_ROWS if with_ref else 1, n_shells), dtype=torch.float64, device=fp.device)
    f_complex, r_complex = fp.dim() == 2, rp.dim() == 2
    device = fp.device
    _launch(
        (n_shells, 1, 1),
        (device.index, f_complex, r_complex, with_ref, fp.dtype, rp.dtype,
         fp.data_ptr() % 16 == 0, rp.data_ptr() % 16 == 0),
        (fp, rp, index, bounds, out, n_shells, f_complex, r_complex, with_ref, _BLOCK),
        device,
    )  # fmt: skip
    return out
