"""Triton helpers of the GDN kernels: row loads, the within-chunk blocks and
their inverse, rounding and dots that the interpreter runs as the GPU does."""

from __future__ import annotations

import triton
import triton.language as tl

from fusepass.kernels._common import rne_bf16, round_to


@triton.jit
def _load_rows(ptr, base, o_t, T, stride_t, o_d, D: tl.constexpr, L2NORM: tl.constexpr, EPS: tl.constexpr):
    """Rows o_t of a [T, D] slice (unit column stride) as fp32, L2-normalised when asked."""
    m = (o_t < T)[:, None] & (o_d < D)[None, :]
    b_x = tl.load(ptr + base + o_t.to(tl.int64)[:, None] * stride_t + o_d[None, :], mask=m, other=0.0)
    b_x = b_x.to(tl.float32)
    if L2NORM:
        b_x = b_x * tl.rsqrt(tl.sum(b_x * b_x, 1) + EPS)[:, None]
    return b_x


@triton.jit
def _load_vec(ptr, base, o_t, T, stride_t):
    return tl.load(ptr + base + o_t.to(tl.int64) * stride_t, mask=o_t < T, other=0.0).to(tl.float32)


@triton.jit
def _kkt_block(b_ki, b_kj, b_bi, b_Gi, b_Gj, DIAG: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
               EMU: tl.constexpr):
    """[16, 16] block of A: beta_i k~_i.k~_j exp(Gamma_i - Gamma_j), strictly lower on the diagonal."""
    b_a = _dot(b_ki, tl.trans(b_kj), DT, PREC, EMU)
    b_d = b_Gi[:, None] - b_Gj[None, :]
    if DIAG:
        o_c = tl.arange(0, 16)
        b_d = tl.where(o_c[:, None] > o_c[None, :], b_d, float("-inf"))
    return b_a * b_bi[:, None] * tl.exp(b_d)


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
def _inv16_product(b_A):
    """(I + N)^-1 of a strictly lower [16, 16] N as (I - N)(I + N^2)(I + N^4)(I + N^8)
    (N^16 = 0): six 16x16x16 ieee dots instead of fourteen dependent row steps.

    The powers grow before they cancel: on keys with correlation 0.99 and
    beta up to 2, relative error 3.3e-4 in fp32 where forward substitution
    keeps 2.6e-7 (fp64 reference, 2000 blocks).  Below bf16's rounding, not
    below fp32's: for half-precision inputs only."""
    o_c = tl.arange(0, 16)
    b_I = (o_c[:, None] == o_c[None, :]).to(tl.float32)
    b_N2 = _dot_ieee(b_A, b_A)
    b_N4 = _dot_ieee(b_N2, b_N2)
    b_N8 = _dot_ieee(b_N4, b_N4)
    b_X = _dot_ieee(b_I - b_A, b_I + b_N2)
    b_X = b_X + _dot_ieee(b_X, b_N4)
    return b_X + _dot_ieee(b_X, b_N8)


@triton.jit
def _qk_block(b_qi, b_kj, b_Gi, b_Gj, DIAG: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr):
    """[16, 16] block of the output's causal matrix: q~_i.k~_j exp(Gamma_i - Gamma_j), j <= i."""
    b_a = _dot(b_qi, tl.trans(b_kj), DT, PREC, EMU)
    b_d = b_Gi[:, None] - b_Gj[None, :]
    if DIAG:
        o_c = tl.arange(0, 16)
        b_d = tl.where(o_c[:, None] >= o_c[None, :], b_d, float("-inf"))
    return b_a * tl.exp(b_d)


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
def _dot_ieee(a, b):
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _store_lower_product(p_out, N, o_c, m_c, o_t0, o_t1, o_t2, o_t3, T,
                         b_T00, b_T10, b_T11, b_T20, b_T21, b_T22, b_T30, b_T31, b_T32, b_T33,
                         b_x0, b_x1, b_x2, b_x3, DT: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr):
    """Store rows i of (T X) for a block-lower-triangular T of 4 x 4 blocks of
    16 rows (w = T (beta e^G k), u = T (beta v)): row block i sums T_ij X_j, j <= i."""
    b_o = tl.dot(b_T00, b_x0, input_precision=PREC)
    tl.store(p_out + o_t0[:, None] * N + o_c[None, :], round_to(b_o, DT, EMU), mask=(o_t0 < T)[:, None] & m_c)
    b_o = tl.dot(b_T10, b_x0, input_precision=PREC) + tl.dot(b_T11, b_x1, input_precision=PREC)
    tl.store(p_out + o_t1[:, None] * N + o_c[None, :], round_to(b_o, DT, EMU), mask=(o_t1 < T)[:, None] & m_c)
    b_o = (tl.dot(b_T20, b_x0, input_precision=PREC) + tl.dot(b_T21, b_x1, input_precision=PREC)
           + tl.dot(b_T22, b_x2, input_precision=PREC))
    tl.store(p_out + o_t2[:, None] * N + o_c[None, :], round_to(b_o, DT, EMU), mask=(o_t2 < T)[:, None] & m_c)
    b_o = (tl.dot(b_T30, b_x0, input_precision=PREC) + tl.dot(b_T31, b_x1, input_precision=PREC)
           + tl.dot(b_T32, b_x2, input_precision=PREC) + tl.dot(b_T33, b_x3, input_precision=PREC))
    tl.store(p_out + o_t3[:, None] * N + o_c[None, :], round_to(b_o, DT, EMU), mask=(o_t3 < T)[:, None] & m_c)
