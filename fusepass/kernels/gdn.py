"""Gated DeltaNet (GDN) linear attention: chunked prefill and recurrent decode.

Per batch and value head, with the state S in R^{d_k x d_v} kept in fp32, for
each token t (q scaled by ``scale``, q and k L2-normalised first when
``use_qk_l2norm``):

    S <- exp(g_t) S
    S <- S + beta_t k_t (v_t - S^T k_t)^T
    o_t = S^T q_t

Inputs as ``transformers``' ``torch_chunk_gated_delta_rule`` /
``torch_recurrent_gated_delta_rule`` receive them: q, k ``[B, T, H_k, d_k]``,
v ``[B, T, H_v, d_v]``, g (log decay) and beta ``[B, T, H_v]``, an optional
initial state ``[B, H_v, d_k, d_v]``.  H_v is a multiple of H_k: value head h
reads key head ``h // (H_v // H_k)`` (``repeat_interleave`` on the head dim).
Outputs: o ``[B, T, H_v, d_v]`` contiguous in q's dtype, and the final state
``[B, H_v, d_k, d_v]`` contiguous in fp32 (always returned; a caller that
does not want it drops it).

``gdn_chunk`` and ``gdn_recurrent`` compute the same function; they differ in
the algorithm their kernels use (chunked for prefill, a token loop for
decode and short T).  On CUDA, fp16/bf16/fp32 inputs with d_k <= 256:

- ``gdn_chunk``, T > 16: three launches (prep: gates, the within-chunk
  system and its inverse, w and u; the sequential state pass; the output,
  parallel over chunks), no copies of q, k, v (strided [B, T, H, D] views
  are read in place, grouped value heads index their key head);
- ``gdn_chunk`` with T <= 16, and ``gdn_recurrent``: one launch of the
  recurrent kernel (state read once, written once);
- anything else (fp64, mixed q/k/v dtypes, d_k > 256) and a kernel that
  fails: the plain-torch bodies.

Numerics: gates, the within-chunk inverse and the state in fp32; the dots on
bf16/fp16 operands with fp32 accumulation for half-precision inputs, ieee
fp32 for fp32 inputs.  H100, issue 8's shapes, bf16: relative error norm
4.1e-3 of output and state against the fp64 recurrence (FLA 0.6: 4.4e-3).
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from fusepass.kernels._common import cdiv, interpreting, on_device, run_kernel, sm_count

L2NORM_EPS = 1e-6  # transformers' l2norm(x, dim=-1, eps=1e-6), as FLA
CHUNK = 64  # tokens per chunk of the chunked form (BT in the kernels)


# ------------------------------------------------------------------- kernels ----
#
# Chunked prefill, per (batch b, value head h) with key head hk = h // GROUP,
# for a chunk of BT = 64 tokens (Gamma = within-chunk cumulative sum of g,
# k~ / q~ = the L2-normalised k / q when asked, q~ also scaled):
#
#   1. _gdn_prep_kernel, one program per (b, h, chunk), all on chip:
#        A = strictly_lower(beta_i k~_i.k~_j exp(Gamma_i - Gamma_j))
#        T = (I + A)^-1       (16x16 diagonal blocks by forward substitution,
#                              merged by block forward substitution)
#        w = T (beta exp(Gamma) k~),  u = T (beta v)     -> scratch, q's dtype
#   2. _gdn_state_kernel, one program per (b, h, d_v block), a loop over the
#      chunks with the state S [d_k, BV] in fp32 registers:
#        v' = u - w S
#        (FUSE_OUT) o = (exp(Gamma) q~) S + causal(q~ k~^T exp(Gamma_i - Gamma_j)) v'
#        (else)     store S (q's dtype) and v' (over u) for kernel 3
#        S = exp(Gamma_last) S + (exp(Gamma_last - Gamma) k~)^T v'
#   3. _gdn_output_kernel (without FUSE_OUT), one program per (b, h, chunk,
#      d_v block): the output line of step 2 from the stored S and v'.
#
# Exponentials only ever see Gamma_i - Gamma_j with i >= j, Gamma_last -
# Gamma and Gamma, all <= 0 for g <= 0: the causal mask is applied to the
# exponent (-inf), never to exp's result.  Rows past T load g = 0, beta = 0,
# k = v = 0: they add nothing and leave Gamma_last unchanged.


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
def _rne_bf16(x):
    """x rounded to the nearest bf16 (ties to even), as fp32."""
    b = x.to(tl.uint32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _to(x, DT: tl.constexpr, EMU: tl.constexpr):
    """x.to(DT) rounded to nearest.  EMU: under the interpreter, whose bf16
    conversion truncates (Triton 3.9: twice the error of the GPU's rounding)."""
    if EMU:
        return _rne_bf16(x).to(DT)
    else:
        return x.to(DT)


@triton.jit
def _dot(a, b, DT: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr):
    """a @ b with operands rounded to DT and fp32 accumulation.  EMU: the
    interpreter's bf16 dot multiplies raw bits (Triton 3.9), so the operands
    are rounded and multiplied in fp32 -- the tensor-core result, exactly."""
    if EMU:
        return tl.dot(_rne_bf16(a.to(tl.float32)), _rne_bf16(b.to(tl.float32)), input_precision="ieee")
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
    tl.store(p_out + o_t0[:, None] * N + o_c[None, :], _to(b_o, DT, EMU), mask=(o_t0 < T)[:, None] & m_c)
    b_o = tl.dot(b_T10, b_x0, input_precision=PREC) + tl.dot(b_T11, b_x1, input_precision=PREC)
    tl.store(p_out + o_t1[:, None] * N + o_c[None, :], _to(b_o, DT, EMU), mask=(o_t1 < T)[:, None] & m_c)
    b_o = (tl.dot(b_T20, b_x0, input_precision=PREC) + tl.dot(b_T21, b_x1, input_precision=PREC)
           + tl.dot(b_T22, b_x2, input_precision=PREC))
    tl.store(p_out + o_t2[:, None] * N + o_c[None, :], _to(b_o, DT, EMU), mask=(o_t2 < T)[:, None] & m_c)
    b_o = (tl.dot(b_T30, b_x0, input_precision=PREC) + tl.dot(b_T31, b_x1, input_precision=PREC)
           + tl.dot(b_T32, b_x2, input_precision=PREC) + tl.dot(b_T33, b_x3, input_precision=PREC))
    tl.store(p_out + o_t3[:, None] * N + o_c[None, :], _to(b_o, DT, EMU), mask=(o_t3 < T)[:, None] & m_c)


@triton.jit
def _gdn_prep_kernel(
    k, v, g, beta, w, u, kd,
    T, NT, HV, GROUP,
    s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_gb, s_gt, s_gh, s_bb, s_bt, s_bh,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    L2NORM: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr, PRE_KD: tl.constexpr,
    EPS: tl.constexpr,
):
    i_c = tl.program_id(0)
    i_t, i_bh = i_c % NT, i_c // NT
    i_b, i_h = i_bh // HV, i_bh % HV
    i_b64 = i_b.to(tl.int64)
    k_base = i_b64 * s_kb + (i_h // GROUP) * s_kh
    v_base = i_b64 * s_vb + i_h * s_vh
    g_base = i_b64 * s_gb + i_h * s_gh
    b_base = i_b64 * s_bb + i_h * s_bh
    o_c = tl.arange(0, 16)
    o_k = tl.arange(0, BK)
    t0 = i_t * 64
    o_t0, o_t1, o_t2, o_t3 = t0 + o_c, t0 + 16 + o_c, t0 + 32 + o_c, t0 + 48 + o_c

    # [16, BK] x 4: the chunk's keys in four row blocks
    b_k0 = _load_rows(k, k_base, o_t0, T, s_kt, o_k, DK, L2NORM, EPS)
    b_k1 = _load_rows(k, k_base, o_t1, T, s_kt, o_k, DK, L2NORM, EPS)
    b_k2 = _load_rows(k, k_base, o_t2, T, s_kt, o_k, DK, L2NORM, EPS)
    b_k3 = _load_rows(k, k_base, o_t3, T, s_kt, o_k, DK, L2NORM, EPS)
    b_b0 = _load_vec(beta, b_base, o_t0, T, s_bt)
    b_b1 = _load_vec(beta, b_base, o_t1, T, s_bt)
    b_b2 = _load_vec(beta, b_base, o_t2, T, s_bt)
    b_b3 = _load_vec(beta, b_base, o_t3, T, s_bt)
    # cumulative log gates over the chunk, fp32
    b_g0 = _load_vec(g, g_base, o_t0, T, s_gt)
    b_g1 = _load_vec(g, g_base, o_t1, T, s_gt)
    b_g2 = _load_vec(g, g_base, o_t2, T, s_gt)
    b_g3 = _load_vec(g, g_base, o_t3, T, s_gt)
    b_c1 = tl.sum(b_g0, 0)
    b_c2 = b_c1 + tl.sum(b_g1, 0)
    b_c3 = b_c2 + tl.sum(b_g2, 0)
    b_G0 = tl.cumsum(b_g0, 0)
    b_G1 = tl.cumsum(b_g1, 0) + b_c1
    b_G2 = tl.cumsum(b_g2, 0) + b_c2
    b_G3 = tl.cumsum(b_g3, 0) + b_c3

    # A in [16, 16] blocks (i >= j)
    b_A00 = _kkt_block(b_k0, b_k0, b_b0, b_G0, b_G0, True, DT, PREC, EMU)
    b_A11 = _kkt_block(b_k1, b_k1, b_b1, b_G1, b_G1, True, DT, PREC, EMU)
    b_A22 = _kkt_block(b_k2, b_k2, b_b2, b_G2, b_G2, True, DT, PREC, EMU)
    b_A33 = _kkt_block(b_k3, b_k3, b_b3, b_G3, b_G3, True, DT, PREC, EMU)
    b_A10 = _kkt_block(b_k1, b_k0, b_b1, b_G1, b_G0, False, DT, PREC, EMU)
    b_A20 = _kkt_block(b_k2, b_k0, b_b2, b_G2, b_G0, False, DT, PREC, EMU)
    b_A21 = _kkt_block(b_k2, b_k1, b_b2, b_G2, b_G1, False, DT, PREC, EMU)
    b_A30 = _kkt_block(b_k3, b_k0, b_b3, b_G3, b_G0, False, DT, PREC, EMU)
    b_A31 = _kkt_block(b_k3, b_k1, b_b3, b_G3, b_G1, False, DT, PREC, EMU)
    b_A32 = _kkt_block(b_k3, b_k2, b_b3, b_G3, b_G2, False, DT, PREC, EMU)

    # T = (I + A)^-1: diagonal blocks, then T_ij = -T_ii sum_{j <= m < i} A_im T_mj
    # (fp32 ieee: 16x16x16 products, a few hundred FMAs per thread in all)
    b_T00, b_T11, b_T22, b_T33 = _inv16x4(b_A00, b_A11, b_A22, b_A33)
    b_T10 = -_dot_ieee(b_T11, _dot_ieee(b_A10, b_T00))
    b_T21 = -_dot_ieee(b_T22, _dot_ieee(b_A21, b_T11))
    b_T32 = -_dot_ieee(b_T33, _dot_ieee(b_A32, b_T22))
    b_T20 = -_dot_ieee(b_T22, _dot_ieee(b_A20, b_T00) + _dot_ieee(b_A21, b_T10))
    b_T31 = -_dot_ieee(b_T33, _dot_ieee(b_A31, b_T11) + _dot_ieee(b_A32, b_T21))
    b_T30 = -_dot_ieee(b_T33, _dot_ieee(b_A30, b_T00) + _dot_ieee(b_A31, b_T10) + _dot_ieee(b_A32, b_T20))

    # w = T (beta exp(Gamma) k~): fp32 operands (tf32 for half-precision inputs:
    # 10 mantissa bits, finer than the bf16 scratch it is stored in)
    b_x0 = b_k0 * (b_b0 * tl.exp(b_G0))[:, None]
    b_x1 = b_k1 * (b_b1 * tl.exp(b_G1))[:, None]
    b_x2 = b_k2 * (b_b2 * tl.exp(b_G2))[:, None]
    b_x3 = b_k3 * (b_b3 * tl.exp(b_G3))[:, None]
    w_base = i_bh.to(tl.int64) * T * DK
    m_k = (o_k < DK)[None, :]
    _store_lower_product(w + w_base, DK, o_k, m_k, o_t0, o_t1, o_t2, o_t3, T,
                         b_T00, b_T10, b_T11, b_T20, b_T21, b_T22, b_T30, b_T31, b_T32, b_T33,
                         b_x0, b_x1, b_x2, b_x3, DT, PREC, EMU)
    if PRE_KD:
        # the state pass's key operand, exp(Gamma_last - Gamma) k~, off its sequential path
        b_Gl = b_c3 + tl.sum(b_g3, 0)
        tl.store(kd + w_base + o_t0[:, None] * DK + o_k[None, :], _to(b_k0 * tl.exp(b_Gl - b_G0)[:, None], DT, EMU),
                 mask=(o_t0 < T)[:, None] & m_k)
        tl.store(kd + w_base + o_t1[:, None] * DK + o_k[None, :], _to(b_k1 * tl.exp(b_Gl - b_G1)[:, None], DT, EMU),
                 mask=(o_t1 < T)[:, None] & m_k)
        tl.store(kd + w_base + o_t2[:, None] * DK + o_k[None, :], _to(b_k2 * tl.exp(b_Gl - b_G2)[:, None], DT, EMU),
                 mask=(o_t2 < T)[:, None] & m_k)
        tl.store(kd + w_base + o_t3[:, None] * DK + o_k[None, :], _to(b_k3 * tl.exp(b_Gl - b_G3)[:, None], DT, EMU),
                 mask=(o_t3 < T)[:, None] & m_k)

    # u = T (beta v), BV value columns at a time
    u_base = i_bh.to(tl.int64) * T * DV
    for i_v in range(0, tl.cdiv(DV, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = (o_v < DV)[None, :]
        b_y0 = _load_rows(v, v_base, o_t0, T, s_vt, o_v, DV, False, EPS) * b_b0[:, None]
        b_y1 = _load_rows(v, v_base, o_t1, T, s_vt, o_v, DV, False, EPS) * b_b1[:, None]
        b_y2 = _load_rows(v, v_base, o_t2, T, s_vt, o_v, DV, False, EPS) * b_b2[:, None]
        b_y3 = _load_rows(v, v_base, o_t3, T, s_vt, o_v, DV, False, EPS) * b_b3[:, None]
        _store_lower_product(u + u_base, DV, o_v, m_v, o_t0, o_t1, o_t2, o_t3, T,
                             b_T00, b_T10, b_T11, b_T20, b_T21, b_T22, b_T30, b_T31, b_T32, b_T33,
                             b_y0, b_y1, b_y2, b_y3, DT, PREC, EMU)


@triton.jit
def _chunk_output(b_q, b_k, b_G, b_S, b_v, o_t, DT: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr):
    """o = (exp(Gamma) q~) S + causal(q~ k~^T exp(Gamma_i - Gamma_j)) v' for one chunk, [BT, BV] fp32."""
    b_o = _dot(b_q * tl.exp(b_G)[:, None], b_S, DT, PREC, EMU)
    b_a = _dot(b_q, tl.trans(b_k), DT, PREC, EMU)
    b_d = tl.where(o_t[:, None] >= o_t[None, :], b_G[:, None] - b_G[None, :], float("-inf"))
    b_a = b_a * tl.exp(b_d)
    return b_o + _dot(b_a, b_v, DT, PREC, EMU)


@triton.jit
def _gdn_state_kernel(
    q, k, w, u, kd, g, h0, o, hT, hs,
    T, NT, HV, GROUP, NV, scale,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_gb, s_gt, s_gh,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    L2NORM: tl.constexpr, HAS_H0: tl.constexpr, FUSE_OUT: tl.constexpr, PRE_KD: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr, ODT: tl.constexpr, OPREC: tl.constexpr,
    OEMU: tl.constexpr, EPS: tl.constexpr,
):
    i_p = tl.program_id(0)
    i_v, i_bh = i_p % NV, i_p // NV
    i_b, i_h = i_bh // HV, i_bh % HV
    i_b64, i_bh64 = i_b.to(tl.int64), i_bh.to(tl.int64)
    q_base = i_b64 * s_qb + (i_h // GROUP) * s_qh
    k_base = i_b64 * s_kb + (i_h // GROUP) * s_kh
    g_base = i_b64 * s_gb + i_h * s_gh
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_c = tl.arange(0, 64)
    m_k, m_v = o_k < DK, o_v < DV
    m_kv = m_k[:, None] & m_v[None, :]
    p_S = o_k[:, None] * DV + o_v[None, :]  # [BK, BV] offsets in a [DK, DV] state
    if HAS_H0:
        b_S = tl.load(h0 + i_bh64 * DK * DV + p_S, mask=m_kv, other=0.0).to(tl.float32)
    else:
        b_S = tl.zeros([BK, BV], dtype=tl.float32)
    w_base = i_bh64 * T * DK
    u_base = i_bh64 * T * DV
    for i_t in range(0, NT):
        o_t = i_t * 64 + o_c
        m_t = o_t < T
        b_g = _load_vec(g, g_base, o_t, T, s_gt)
        b_Gl = tl.sum(b_g, 0)
        if FUSE_OUT or not PRE_KD:
            b_G = tl.cumsum(b_g, 0)
            b_k = _load_rows(k, k_base, o_t, T, s_kt, o_k, DK, L2NORM, EPS)
        # [64, BK], [64, BV]
        m_tk = m_t[:, None] & m_k[None, :]
        b_w = tl.load(w + w_base + o_t[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0)
        if PRE_KD:
            b_kd = tl.load(kd + w_base + o_t[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0)
        else:
            b_kd = b_k * tl.exp(b_Gl - b_G)[:, None]
        p_u = u + u_base + o_t[:, None] * DV + o_v[None, :]
        m_u = m_t[:, None] & m_v[None, :]
        b_u = tl.load(p_u, mask=m_u, other=0.0).to(tl.float32)
        b_v = b_u - _dot(b_w, b_S, DT, PREC, EMU)
        if FUSE_OUT:
            b_q = _load_rows(q, q_base, o_t, T, s_qt, o_k, DK, L2NORM, EPS) * scale
            b_o = _chunk_output(b_q, b_k, b_G, b_S, b_v, o_c, ODT, OPREC, OEMU)
            p_o = o + ((i_b64 * T + o_t[:, None]) * HV + i_h) * DV + o_v[None, :]
            tl.store(p_o, _to(b_o, o.dtype.element_ty, EMU), mask=m_u)
        else:
            tl.store(hs + (i_bh64 * NT + i_t) * DK * DV + p_S, _to(b_S, DT, EMU), mask=m_kv)
            tl.store(p_u, _to(b_v, DT, EMU), mask=m_u)
        b_S = b_S * tl.exp(b_Gl) + _dot(tl.trans(b_kd), b_v, DT, PREC, EMU)
    tl.store(hT + i_bh64 * DK * DV + p_S, b_S, mask=m_kv)


@triton.jit
def _gdn_output_kernel(
    q, k, g, vn, hs, o,
    T, NT, HV, GROUP, NV, scale,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_gb, s_gt, s_gh,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    L2NORM: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr, ODT: tl.constexpr,
    OPREC: tl.constexpr, OEMU: tl.constexpr, EPS: tl.constexpr,
):
    i_p = tl.program_id(0)
    i_v = i_p % NV
    i_t = (i_p // NV) % NT
    i_bh = i_p // (NV * NT)
    i_b, i_h = i_bh // HV, i_bh % HV
    i_b64, i_bh64 = i_b.to(tl.int64), i_bh.to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_c = tl.arange(0, 64)
    o_t = i_t * 64 + o_c
    m_k, m_v, m_t = o_k < DK, o_v < DV, o_t < T
    b_G = tl.cumsum(_load_vec(g, i_b64 * s_gb + i_h * s_gh, o_t, T, s_gt), 0)
    b_q = _load_rows(q, i_b64 * s_qb + (i_h // GROUP) * s_qh, o_t, T, s_qt, o_k, DK, L2NORM, EPS) * scale
    b_k = _load_rows(k, i_b64 * s_kb + (i_h // GROUP) * s_kh, o_t, T, s_kt, o_k, DK, L2NORM, EPS)
    b_S = tl.load(hs + (i_bh64 * NT + i_t) * DK * DV + o_k[:, None] * DV + o_v[None, :],
                  mask=m_k[:, None] & m_v[None, :], other=0.0)
    m_u = m_t[:, None] & m_v[None, :]
    b_v = tl.load(vn + i_bh64 * T * DV + o_t[:, None] * DV + o_v[None, :], mask=m_u, other=0.0)
    b_o = _chunk_output(b_q, b_k, b_G, b_S, b_v, o_c, ODT, OPREC, OEMU)
    p_o = o + ((i_b64 * T + o_t[:, None]) * HV + i_h) * DV + o_v[None, :]
    tl.store(p_o, _to(b_o, o.dtype.element_ty, EMU), mask=m_u)


@triton.jit
def _gdn_recurrent_kernel(
    q, k, v, g, beta, h0, o, hT,
    T, HV, GROUP, NV, scale,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_gb, s_gt, s_gh, s_bb, s_bt, s_bh,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    L2NORM: tl.constexpr, HAS_H0: tl.constexpr, EMU: tl.constexpr, EPS: tl.constexpr,
):
    # One program per (b, h, d_v block): the [DK, BV] state slice is read
    # once, lives in registers across the T tokens, and is written once.
    i_p = tl.program_id(0)
    i_v, i_bh = i_p % NV, i_p // NV
    i_b, i_h = i_bh // HV, i_bh % HV
    i_b64, i_bh64 = i_b.to(tl.int64), i_bh.to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < DK, o_v < DV
    m_kv = m_k[:, None] & m_v[None, :]
    p_S = o_k[:, None] * DV + o_v[None, :]
    if HAS_H0:
        b_S = tl.load(h0 + i_bh64 * DK * DV + p_S, mask=m_kv, other=0.0).to(tl.float32)
    else:
        b_S = tl.zeros([BK, BV], dtype=tl.float32)
    p_q = q + i_b64 * s_qb + (i_h // GROUP) * s_qh + o_k
    p_k = k + i_b64 * s_kb + (i_h // GROUP) * s_kh + o_k
    p_v = v + i_b64 * s_vb + i_h * s_vh + o_v
    p_g = g + i_b64 * s_gb + i_h * s_gh
    p_b = beta + i_b64 * s_bb + i_h * s_bh
    p_o = o + (i_b64 * T * HV + i_h) * DV + o_v
    for _ in range(0, T):
        b_q = tl.load(p_q, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(p_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(p_v, mask=m_v, other=0.0).to(tl.float32)
        b_g = tl.load(p_g).to(tl.float32)
        b_b = tl.load(p_b).to(tl.float32)
        if L2NORM:
            b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, 0) + EPS)
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, 0) + EPS)
        b_q = b_q * scale
        b_S = b_S * tl.exp(b_g)
        b_d = (b_v - tl.sum(b_S * b_k[:, None], 0)) * b_b
        b_S = b_S + b_k[:, None] * b_d[None, :]
        b_o = tl.sum(b_S * b_q[:, None], 0)
        tl.store(p_o, _to(b_o, o.dtype.element_ty, EMU), mask=m_v)
        # pointers step in 64 bits: no T x stride product to overflow
        p_q += s_qt
        p_k += s_kt
        p_v += s_vt
        p_g += s_gt
        p_b += s_bt
        p_o += HV * DV
    tl.store(hT + i_bh64 * DK * DV + p_S, b_S, mask=m_kv)


# ------------------------------------------------------------------ launchers ----

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
# Widest key head held in registers: the state pass keeps a [BK, BV] fp32
# state slice and [64, BK] tiles of w, k (and q); 256 covers every GDN model.
_MAX_DK = 256
# d_v columns per state-pass program: 64 where that still gives one program
# per SM, else 32.  The pass is sequential over chunks and parallel only over
# B x H_v x d_v blocks.  H100, CUDA-graph time of the whole op (Triton 3.6):
# B1 T4096 H16 (64 vs 32 programs) 371 µs at 64, 345 at 32; B4 T4096 Hv32
# 1704 at 64, 1823 at 32; B8 T512 H32 465 at 64, 491 at 32.
_STATE_BV = (64, 32)
# Tokens the chunked op hands to the recurrent kernel instead (decode, short
# speculative runs): one launch, no scratch.
RECURRENT_MAX_T = 16


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (n - 1).bit_length())


def kernel_supported(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None) -> bool:
    """Whether the Triton kernels serve these inputs (else the plain-torch reference does)."""
    return (q.dtype in _KERNEL_DTYPES and k.dtype == q.dtype and v.dtype == q.dtype
            and g.dtype in _KERNEL_DTYPES and beta.dtype in _KERNEL_DTYPES
            and (initial_state is None or initial_state.dtype in _KERNEL_DTYPES)
            and q.shape[-1] <= _MAX_DK)


def _unit_last(t: Tensor) -> Tensor:
    """Any [B, T, H, D] view with unit stride along D is read in place (slices of
    a fused projection included); anything else is copied once."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _outputs(q: Tensor, v: Tensor, out: Tensor | None, final_state: Tensor | None) -> tuple[Tensor, Tensor]:
    B, T, _, DK = q.shape
    HV, DV = v.shape[-2:]
    if out is None:
        out = torch.empty((B, T, HV, DV), dtype=q.dtype, device=q.device)
    if final_state is None:
        final_state = torch.empty((B, HV, DK, DV), dtype=torch.float32, device=q.device)
    return out, final_state


def _empty(initial_state: Tensor | None, out: Tensor, final_state: Tensor) -> tuple[Tensor, Tensor]:
    """No tokens (or no batch): the state passes through."""
    if initial_state is None:
        final_state.zero_()
    else:
        final_state.copy_(initial_state)
    return out, final_state


def gdn_chunk_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
                  use_qk_l2norm: bool, scale: float, *, out: Tensor | None = None,
                  final_state: Tensor | None = None, fuse_output: bool | None = None,
                  block_v: int | None = None, num_warps: int | None = None,
                  num_stages: int | None = None, output_tf32: bool | None = None,
                  precompute_kd: bool | None = None) -> tuple[Tensor, Tensor]:
    """The chunked pipeline: prep kernel, state pass, (output kernel).

    ``out`` / ``final_state`` receive the results when given (tests poison
    them); the keywords after them override the launch choices (tests, sweeps)."""
    B, T, HK, DK = q.shape
    HV, DV = v.shape[-2:]
    out, final_state = _outputs(q, v, out, final_state)
    if B == 0 or T == 0 or HV == 0:
        return _empty(initial_state, out, final_state)
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    h0 = None if initial_state is None else initial_state.contiguous()
    dt = q.dtype
    DT, PREC = _TL_DTYPES[dt], ("ieee" if dt == torch.float32 else "tf32")
    emu = dt == torch.bfloat16 and interpreting()
    # The output's dots in bf16/fp16 (default) or on fp32 operands in tf32
    # (output_tf32).  H100, real sizes, bf16, relative error norm against the
    # fp64 recurrence: 4.1e-3 in bf16 against 3.2e-3 in tf32 (FLA 0.6: 4.4e-3);
    # the tf32 dots cost 345 against 289 µs at B1 T4096 H16, 2153 against 1593
    # at B1 T16384 H32 (CUDA-graph time).
    out_dots = dict(ODT=DT, OPREC=PREC, OEMU=emu)
    if output_tf32:
        out_dots = dict(ODT=tl.float32, OPREC="tf32", OEMU=False)
    BK = _pow2(DK)
    NT = cdiv(T, CHUNK)
    n_sm = sm_count(q.device)
    w = torch.empty((B, HV, T, DK), dtype=dt, device=q.device)
    u = torch.empty((B, HV, T, DV), dtype=dt, device=q.device)
    if block_v is None:
        block_v = _STATE_BV[-1]
        for bv in _STATE_BV:
            if B * HV * cdiv(DV, bv) >= n_sm:
                block_v = bv
                break
    BV = min(block_v, _pow2(DV))
    NV = cdiv(DV, BV)
    if fuse_output is None:
        # The output in the state pass (one launch and the per-chunk states
        # fewer) lengthens the sequential loop: it lost at every shape of
        # issue 8 on an H100, 428 vs 289 µs at B1 T4096 H16, 368 vs 354 at
        # B8 T512 H32, 1947 vs 1593 at B1 T16384 H32 (CUDA-graph time).
        fuse_output = False
    if precompute_kd is None:
        # exp(Gamma_last - Gamma) k~ formed in the prep kernel and read by the
        # state pass, rather than normalised and decayed inside its loop:
        # 259 vs 278 µs at B1 T4096 H16, 1562 vs 1580 at B1 T16384 H32, 342
        # vs 333 at B8 T512 H32 (H100, CUDA-graph time).
        precompute_kd = not fuse_output
    kd = torch.empty_like(w) if precompute_kd else w
    hs = final_state if fuse_output else torch.empty((B, HV, NT, DK, DV), dtype=dt, device=q.device)
    strides = (*q.stride()[:3], *k.stride()[:3], *g.stride())
    with on_device(q):
        _gdn_prep_kernel[(NT * B * HV,)](
            k, v, g, beta, w, u, kd, T, NT, HV, HV // HK,
            *k.stride()[:3], *v.stride()[:3], *g.stride(), *beta.stride(),
            DK=DK, DV=DV, BK=BK, BV=min(64, _pow2(DV)), L2NORM=use_qk_l2norm, DT=DT, PREC=PREC, EMU=emu,
            PRE_KD=precompute_kd, EPS=L2NORM_EPS, num_warps=4,
        )
        # 4 warps, 2 pipeline stages (H100, CUDA-graph time): 8 warps lost at
        # every shape (B1 T4096 H16 361 vs 345 µs, B8 T512 H32 510 vs 465 with
        # tf32 output dots); 3 stages 260 vs 259 at B1 T4096 H16, 368 vs 342 at
        # B8 T512 H32.
        _gdn_state_kernel[(NV * B * HV,)](
            q, k, w, u, kd, g, final_state if h0 is None else h0, out, final_state, hs,
            T, NT, HV, HV // HK, NV, scale, *strides,
            DK=DK, DV=DV, BK=BK, BV=BV, L2NORM=use_qk_l2norm, HAS_H0=h0 is not None, FUSE_OUT=fuse_output,
            PRE_KD=precompute_kd, DT=DT, PREC=PREC, EMU=emu, **out_dots, EPS=L2NORM_EPS,
            num_warps=num_warps or 4, num_stages=num_stages or 2,
        )
        if not fuse_output:
            BVO = min(64, _pow2(DV))
            NVO = cdiv(DV, BVO)
            _gdn_output_kernel[(NVO * NT * B * HV,)](
                q, k, g, u, hs, out, T, NT, HV, HV // HK, NVO, scale, *strides,
                DK=DK, DV=DV, BK=BK, BV=BVO, L2NORM=use_qk_l2norm, DT=DT, PREC=PREC, EMU=emu, **out_dots,
                EPS=L2NORM_EPS, num_warps=4,
            )
    return out, final_state


def _recurrent_block_v(B: int, HV: int, DV: int, n_sm: int) -> int:
    # Up to 64 columns (a [128, 64] fp32 slice: 64 registers per thread at 4
    # warps), narrower until there are 4 programs per SM: B64 H32 keeps 64
    # (4096 programs), B1 H32 goes to 16 (256).  H100, CUDA-graph time, 4
    # warps: B64 H32 94.9 µs at 64 columns, 96.4 at 32 and at 128 (the fp32
    # state read + written at copy bandwidth: 90.6); B1 H32 3.3 µs at 16,
    # 3.4 at 32, 3.9 at 64.  8 warps was slower everywhere.
    bv = min(64, _pow2(DV))
    while bv > 16 and B * HV * cdiv(DV, bv) < 4 * n_sm:
        bv //= 2
    return bv


def gdn_recurrent_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
                      use_qk_l2norm: bool, scale: float, *, out: Tensor | None = None,
                      final_state: Tensor | None = None, block_v: int | None = None,
                      num_warps: int | None = None) -> tuple[Tensor, Tensor]:
    """The token loop in one launch; arguments as :func:`gdn_chunk_fwd`."""
    B, T, HK, DK = q.shape
    HV, DV = v.shape[-2:]
    out, final_state = _outputs(q, v, out, final_state)
    if B == 0 or T == 0 or HV == 0:
        return _empty(initial_state, out, final_state)
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    h0 = None if initial_state is None else initial_state.contiguous()
    BV = min(block_v or _recurrent_block_v(B, HV, DV, sm_count(q.device)), _pow2(DV))
    NV = cdiv(DV, BV)
    with on_device(q):
        _gdn_recurrent_kernel[(NV * B * HV,)](
            q, k, v, g, beta, final_state if h0 is None else h0, out, final_state,
            T, HV, HV // HK, NV, scale,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *g.stride(), *beta.stride(),
            DK=DK, DV=DV, BK=_pow2(DK), BV=BV, L2NORM=use_qk_l2norm, HAS_H0=h0 is not None,
            EMU=q.dtype == torch.bfloat16 and interpreting(), EPS=L2NORM_EPS,
            num_warps=num_warps or 4,
        )
    return out, final_state


# ---------------------------------------------------------------- references ----


def _l2norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def gdn_reference(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
                  use_qk_l2norm: bool, scale: float, compute_dtype: torch.dtype = torch.float32
                  ) -> tuple[Tensor, Tensor]:
    """The recurrence token by token in ``compute_dtype`` (fp32; fp64 for references).

    Returns o in q's dtype (``compute_dtype`` when that is fp64) and the final
    state in fp32 (fp64 likewise)."""
    out_dtype = compute_dtype if compute_dtype == torch.float64 else q.dtype
    state_dtype = compute_dtype if compute_dtype == torch.float64 else torch.float32
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    q, k, v, g, beta = (x.transpose(1, 2).to(compute_dtype) for x in (q, k, v, g, beta))
    if Hv != Hk:
        q = q.repeat_interleave(Hv // Hk, dim=1)
        k = k.repeat_interleave(Hv // Hk, dim=1)
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * scale
    if initial_state is None:
        S = torch.zeros(B, Hv, Dk, Dv, dtype=compute_dtype, device=v.device)
    else:
        S = initial_state.to(compute_dtype, copy=True)  # T = 0 returns it: never the caller's tensor
    o = torch.empty(B, Hv, T, Dv, dtype=compute_dtype, device=v.device)
    for t in range(T):
        S = S * g[:, :, t].exp()[..., None, None]
        k_t = k[:, :, t]
        delta = (v[:, :, t] - (S * k_t[..., None]).sum(-2)) * beta[:, :, t, None]
        S = S + k_t[..., None] * delta[..., None, :]
        o[:, :, t] = (S * q[:, :, t, :, None]).sum(-2)
    return o.transpose(1, 2).to(out_dtype).contiguous(), S.to(state_dtype).contiguous()


def _check(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None) -> None:
    torch._check(q.dim() == 4 and k.dim() == 4 and v.dim() == 4,
                 lambda: f"q, k, v must be [B, T, H, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    torch._check(tuple(k.shape) == tuple(q.shape), lambda: f"k {tuple(k.shape)} is not q's shape {tuple(q.shape)}")
    torch._check(v.shape[0] == B and v.shape[1] == T, lambda: f"v {tuple(v.shape)} does not match q {tuple(q.shape)}")
    torch._check(Hv % Hk == 0, lambda: f"{Hv} value heads are not a multiple of {Hk} key heads")
    torch._check(tuple(g.shape) == (B, T, Hv), lambda: f"g is {tuple(g.shape)}, not {(B, T, Hv)}")
    torch._check(tuple(beta.shape) == (B, T, Hv), lambda: f"beta is {tuple(beta.shape)}, not {(B, T, Hv)}")
    if initial_state is not None:
        torch._check(tuple(initial_state.shape) == (B, Hv, Dk, Dv),
                     lambda: f"initial_state is {tuple(initial_state.shape)}, not {(B, Hv, Dk, Dv)}")


def _fake(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None
          ) -> tuple[Tensor, Tensor]:
    _check(q, k, v, g, beta, initial_state)
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    out = v.new_empty((B, T, Hv, Dv), dtype=q.dtype)
    state = v.new_empty((B, Hv, Dk, Dv), dtype=torch.float32)
    return out, state


def _compute_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _fp32_state(result: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """The ops' final state is fp32 for every input dtype (fp64 inputs compute in fp64)."""
    o, S = result
    return o, S if S.dtype == torch.float32 else S.float()


def _unit_lower_inverse(A: Tensor, block: int = 16) -> Tensor:
    """(I + A)^-1 for strictly lower A [..., C, C], C a multiple of ``block``,
    as the prep kernel computes it: diagonal blocks by forward substitution,
    then T_ij = -T_ii sum_{j <= m < i} A_im T_mj."""
    C = A.shape[-1]
    n = C // block
    blocks = [[A[..., i * block:(i + 1) * block, j * block:(j + 1) * block] for j in range(n)] for i in range(n)]
    Tb = [[None] * n for _ in range(n)]
    eye = torch.eye(block, dtype=A.dtype, device=A.device)
    for i in range(n):
        X = -blocks[i][i].clone()
        for r in range(2, block):
            X[..., r, :] = X[..., r, :] + (X[..., r, :, None] * X).sum(-2)
        Tb[i][i] = X + eye
    for i in range(1, n):
        for j in range(i - 1, -1, -1):
            acc = sum(blocks[i][m] @ Tb[m][j] for m in range(j, i))
            Tb[i][j] = -(Tb[i][i] @ acc)
    zero = torch.zeros_like(Tb[0][0])
    return torch.cat([torch.cat([Tb[i][j] if j <= i else zero for j in range(n)], -1) for i in range(n)], -2)


def gdn_chunk_torch(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
                    use_qk_l2norm: bool, scale: float) -> tuple[Tensor, Tensor]:
    """The chunked algorithm of the kernels in plain torch (fp32; fp64 for fp64
    inputs): the CPU body of ``gdn_chunk``, and a check of the chunked form
    against the token recurrence."""
    cd = torch.float64 if q.dtype == torch.float64 else torch.float32
    out_dtype = q.dtype
    B, T, HK, DK = q.shape
    HV, DV = v.shape[-2:]
    C = CHUNK
    NT = -(-T // C)
    S = (torch.zeros(B, HV, DK, DV, dtype=cd, device=v.device) if initial_state is None
         else initial_state.to(cd).clone())
    if B == 0 or T == 0 or HV == 0:
        return v.new_empty((B, T, HV, DV), dtype=out_dtype), S.contiguous()
    q, k, v, g, beta = (x.transpose(1, 2).to(cd) for x in (q, k, v, g, beta))
    if HV != HK:
        q, k = q.repeat_interleave(HV // HK, dim=1), k.repeat_interleave(HV // HK, dim=1)
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * scale
    pad = NT * C - T
    q, k, v = (F.pad(x, (0, 0, 0, pad)).reshape(B, HV, NT, C, -1) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)).reshape(B, HV, NT, C) for x in (g, beta))
    G = g.cumsum(-1)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    # exp only of Gamma_i - Gamma_j for i >= j: the mask goes on the exponent
    D = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    A = ((k @ k.transpose(-1, -2)) * beta[..., :, None] * D).tril(-1)
    Tm = _unit_lower_inverse(A)
    w = Tm @ (k * (beta * G.exp())[..., None])
    u = Tm @ (v * beta[..., None])
    o = torch.empty(B, HV, NT, C, DV, dtype=cd, device=q.device)
    for c in range(NT):
        vn = u[:, :, c] - w[:, :, c] @ S
        o[:, :, c] = (q[:, :, c] * G[:, :, c, :, None].exp()) @ S + ((q[:, :, c] @ k[:, :, c].transpose(-1, -2))
                                                                    * D[:, :, c]) @ vn
        Gl = G[:, :, c, -1]
        S = S * Gl.exp()[..., None, None] + (k[:, :, c] * (Gl[..., None] - G[:, :, c]).exp()[..., None]
                                             ).transpose(-1, -2) @ vn
    o = o.reshape(B, HV, NT * C, DV)[:, :, :T].transpose(1, 2)
    return o.to(out_dtype).contiguous(), S.contiguous()


# ----------------------------------------------------------------------- ops ----


@torch.library.custom_op("fusepass::gdn_chunk", mutates_args=())
def gdn_chunk(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
              use_qk_l2norm: bool, scale: float) -> tuple[Tensor, Tensor]:
    """Chunked GDN prefill: (o [B, T, H_v, d_v] in q's dtype, final state fp32).

    This body (CPU and every non-CUDA device) runs the chunked algorithm in
    plain torch, 64 tokens per step instead of one."""
    _check(q, k, v, g, beta, initial_state)
    return _fp32_state(gdn_chunk_torch(q, k, v, g, beta, initial_state, use_qk_l2norm, scale))


@gdn_chunk.register_fake
def _gdn_chunk_fake(q, k, v, g, beta, initial_state, use_qk_l2norm, scale):
    return _fake(q, k, v, g, beta, initial_state)


@torch.library.custom_op("fusepass::gdn_recurrent", mutates_args=())
def gdn_recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
                  use_qk_l2norm: bool, scale: float) -> tuple[Tensor, Tensor]:
    """Recurrent GDN (decode, short T): (o [B, T, H_v, d_v] in q's dtype, final state fp32)."""
    _check(q, k, v, g, beta, initial_state)
    return _fp32_state(gdn_reference(q, k, v, g, beta, initial_state, use_qk_l2norm, scale, _compute_dtype(q)))


@gdn_recurrent.register_fake
def _gdn_recurrent_fake(q, k, v, g, beta, initial_state, use_qk_l2norm, scale):
    return _fake(q, k, v, g, beta, initial_state)


@gdn_chunk.register_kernel("cuda")
def _gdn_chunk_cuda(q, k, v, g, beta, initial_state, use_qk_l2norm, scale):
    _check(q, k, v, g, beta, initial_state)
    args = (q, k, v, g, beta, initial_state, use_qk_l2norm, scale)
    fallback = lambda: _fp32_state(gdn_chunk_torch(*args))  # noqa: E731
    if not kernel_supported(q, k, v, g, beta, initial_state):
        return fallback()  # fp64, mixed q/k/v dtypes, d_k > 256
    launch = gdn_recurrent_fwd if q.shape[1] <= RECURRENT_MAX_T else gdn_chunk_fwd
    return run_kernel("gdn_chunk", lambda: launch(*args), fallback)


@gdn_recurrent.register_kernel("cuda")
def _gdn_recurrent_cuda(q, k, v, g, beta, initial_state, use_qk_l2norm, scale):
    _check(q, k, v, g, beta, initial_state)
    args = (q, k, v, g, beta, initial_state, use_qk_l2norm, scale)
    fallback = lambda: _fp32_state(gdn_reference(*args, _compute_dtype(q)))  # noqa: E731
    if not kernel_supported(q, k, v, g, beta, initial_state):
        return fallback()
    return run_kernel("gdn_recurrent", lambda: gdn_recurrent_fwd(*args), fallback)
