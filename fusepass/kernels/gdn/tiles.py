"""Triton helpers of the GDN kernels: row loads, the within-chunk blocks and
their inverse, rounding and dots that the interpreter runs as the GPU does."""

from __future__ import annotations

import triton
import triton.language as tl

from fusepass.kernels._common import rne_bf16, round_to


@triton.jit
def _load_rows(ptr, base, o_t, T, stride_t, o_d, D: tl.constexpr, L2NORM: tl.constexpr, EPS: tl.constexpr):
    """Rows o_t of a [T, D] slice (unit column stride) as fp32, L2-normalised when asked."""
    return _l2rows(_rows(ptr, base, o_t, T, stride_t, o_d, D), L2NORM, EPS)


@triton.jit
def _rows(ptr, base, o_t, T, stride_t, o_d, D: tl.constexpr):
    """Rows o_t of a [T, D] slice (unit column stride) as stored."""
    m = (o_t < T)[:, None] & (o_d < D)[None, :]
    return tl.load(ptr + base + o_t.to(tl.int64)[:, None] * stride_t + o_d[None, :], mask=m, other=0.0)


@triton.jit
def _l2rows(b_x, L2NORM: tl.constexpr, EPS: tl.constexpr):
    """A tile's rows as fp32, L2-normalised when asked."""
    b_x = b_x.to(tl.float32)
    if L2NORM:
        b_x = b_x * _row_rnorm(b_x, L2NORM, EPS)[:, None]
    return b_x


@triton.jit
def _row_rnorm(b_x, L2NORM: tl.constexpr, EPS: tl.constexpr):
    """A tile's rows' L2 factors, [rows] fp32 (ones without the norm)."""
    b_x = b_x.to(tl.float32)
    return _rnorm(tl.sum(b_x * b_x, 1), L2NORM, EPS)


@triton.jit
def _rnorm(b_n, L2NORM: tl.constexpr, EPS: tl.constexpr):
    """The L2 norm's row factor from a row's sum of squares (1 without the norm)."""
    if L2NORM:
        return tl.rsqrt(b_n + EPS)
    else:
        return tl.full(b_n.shape, 1.0, tl.float32)


@triton.jit
def _load_vec(ptr, base, o_t, T, stride_t):
    return tl.load(ptr + base + o_t.to(tl.int64) * stride_t, mask=o_t < T, other=0.0).to(tl.float32)


@triton.jit
def _gate_block(b_a, b_bri, b_rj, b_Gi, b_Gj, DIAG: tl.constexpr):
    """[16, 16] block of A from k_i.k_j: times beta_i r_i r_j exp(Gamma_i - Gamma_j)
    (r the rows' L2 factors), strictly lower on the diagonal."""
    b_d = b_Gi[:, None] - b_Gj[None, :]
    if DIAG:
        o_c = tl.arange(0, 16)
        b_d = tl.where(o_c[:, None] > o_c[None, :], b_d, float("-inf"))
    return b_a * b_bri[:, None] * b_rj[None, :] * tl.exp(b_d)


@triton.jit
def _inv16x4(b_A0, b_A1, b_A2, b_A3):
    """(I + A)^-1 of four strictly lower [16, 16] blocks, by forward substitution.

    X = (I + N)^-1 row by row: X[r, :r] = -N[r, :r] - sum_j N[r, j] X[j, :r];
    rows 0 and 1 are -N already.  The four independent blocks share the loop."""
    o_c = tl.arange(0, 16)
    b_X0, b_X1, b_X2, b_X3 = -b_A0, -b_A1, -b_A2, -b_A3
    for r in range(2, 16):
        m_r = (o_c == r)[:, None]
        b_a0 = tl.sum(tl.where(m_r, b_X0, 0.0), 0)
        b_a1 = tl.sum(tl.where(m_r, b_X1, 0.0), 0)
        b_a2 = tl.sum(tl.where(m_r, b_X2, 0.0), 0)
        b_a3 = tl.sum(tl.where(m_r, b_X3, 0.0), 0)
        b_a0 += tl.sum(b_a0[:, None] * b_X0, 0)
        b_a1 += tl.sum(b_a1[:, None] * b_X1, 0)
        b_a2 += tl.sum(b_a2[:, None] * b_X2, 0)
        b_a3 += tl.sum(b_a3[:, None] * b_X3, 0)
        b_X0 = tl.where(m_r, b_a0[None, :], b_X0)
        b_X1 = tl.where(m_r, b_a1[None, :], b_X1)
        b_X2 = tl.where(m_r, b_a2[None, :], b_X2)
        b_X3 = tl.where(m_r, b_a3[None, :], b_X3)
    b_I = (o_c[:, None] == o_c[None, :]).to(tl.float32)
    return b_X0 + b_I, b_X1 + b_I, b_X2 + b_I, b_X3 + b_I


@triton.jit
def _dot(a, b, DT: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr):
    """a @ b with operands rounded to DT and fp32 accumulation.  EMU: the
    interpreter's bf16 dot multiplies raw bits (Triton 3.9), so the operands
    are rounded and multiplied in fp32 -- the tensor-core result, exactly."""
    if EMU:
        return tl.dot(rne_bf16(a.to(tl.float32)), rne_bf16(b.to(tl.float32)), input_precision="ieee")
    else:
        return tl.dot(a.to(DT), b.to(DT), input_precision=PREC)


@triton.jit
def _dot_acc(a, b, acc, DT: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr):
    """acc + a @ b as :func:`_dot`, accumulated in the product itself on the GPU."""
    if EMU:
        return acc + tl.dot(rne_bf16(a.to(tl.float32)), rne_bf16(b.to(tl.float32)), input_precision="ieee")
    else:
        return tl.dot(a.to(DT), b.to(DT), acc, input_precision=PREC)


@triton.jit
def _mm(a, b, PREC: tl.constexpr):
    """fp32 a @ b at PREC ("ieee", or "tf32" where the result is rounded to half precision anyway)."""
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _store_block(p, base, o_t, col, o_c, T, b_x, DT: tl.constexpr, EMU: tl.constexpr):
    """A [16, 16] block into rows o_t, columns col.. of a [T, 64] slice."""
    tl.store(p + base + o_t.to(tl.int64)[:, None] * 64 + col + o_c[None, :], round_to(b_x, DT, EMU),
             mask=(o_t < T)[:, None])
