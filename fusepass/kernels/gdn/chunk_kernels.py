"""The chunked prefill's kernels: the within-chunk inverse, w and u, then
either the fused state-and-output scan or the state pass followed by the
output kernel."""

from __future__ import annotations

import triton
import triton.language as tl

from fusepass.kernels._common import round_to, scalar_fp32
from fusepass.kernels.gdn.tiles import (_dot, _dot_acc, _gate_block, _inv16x4, _l2rows, _load_rows, _load_vec, _mm, _rnorm,
                                        _row_rnorm, _rows, _store_block)


# ------------------------------------------------------------------- kernels ----
#
# Chunked prefill, per (batch b, value head h) with key head hk = h // GROUP,
# for a chunk of BT = 64 tokens (Gamma = within-chunk cumulative sum of g,
# k~ / q~ = the L2-normalised k / q when asked, q~ also scaled):
#
#   1. _gdn_inverse_kernel, one program (one warp) per (b, h, chunk):
#        A = strictly_lower(beta_i k~_i.k~_j exp(Gamma_i - Gamma_j))
#        T = (I + A)^-1       (16x16 diagonal blocks, merged by block
#                              forward substitution)            -> scratch [64, 64]
#   2. _gdn_wu_kernel, one program per (b, h, chunk), 64-row dots:
#        w = T (beta exp(Gamma) k~),  u = T (beta v)              -> scratch, q's dtype
#        f = exp(Gamma_last - Gamma) / |k|, exp(Gamma_last)        -> scratch, fp32
#        (AQK) Aq = causal(q~ k~^T exp(Gamma_i - Gamma_j))         -> scratch [64, 64]
#   3a. _gdn_scan_kernel (fused output), one program per (b, h, d_v block),
#      a loop over the chunks with the state S [d_k, BV] in fp32 registers:
#        v' = u - w S
#        o  = (exp(Gamma) q~) S + Aq v'
#        S  = exp(Gamma_last) S + k~^T (exp(Gamma_last - Gamma) v')
#      Nothing per chunk goes back to memory but o.  (The state pass of 3b
#      takes k as stored and f's row factors on v' instead.)
#   3b. _gdn_state_kernel + _gdn_output_kernel: the same loop storing S (q's
#      dtype) and v' (over u), then the output line of 3a, parallel over
#      chunks.
#
# The within-chunk system is two kernels because its two halves want
# different shapes: the 16x16 blocks of A and of the inverse fill one warp's
# MMA tiles and nothing more (at 4 warps, with w and u in the same program,
# the prep took 255 registers and 578 µs at B1 T16384 H32, H200), while w
# and u are [64, 64] x [64, d] products for a warpgroup.
#
# Exponentials only ever see Gamma_i - Gamma_j with i >= j, Gamma_last -
# Gamma and Gamma, all <= 0 for g <= 0: the causal mask is applied to the
# exponent (-inf), never to exp's result.  Rows past T load g = 0, beta =
# 0, q = k = v = 0: they add nothing and leave Gamma_last unchanged.  A head
# with some g > 0 is computed again by the token loop after these kernels
# (launch._rising_heads).


@triton.jit
def _diag16(b_a):
    """The diagonal of a [16, 16] block, [16]."""
    o_c = tl.arange(0, 16)
    return tl.sum(tl.where(o_c[:, None] == o_c[None, :], b_a, 0.0), 1)


@triton.jit
def _gdn_inverse_kernel(
    k, g, beta, ti,
    T, NT, HV, GROUP,
    s_kb, s_kt, s_kh, s_gb, s_gt, s_gh, s_bb, s_bt, s_bh,
    DK: tl.constexpr, BK: tl.constexpr, L2NORM: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
    EMU: tl.constexpr, TDT: tl.constexpr, TEMU: tl.constexpr, MPREC: tl.constexpr, EPS: tl.constexpr,
):
    i_c = tl.program_id(0)
    i_t, i_bh = i_c % NT, i_c // NT
    i_b, i_h = i_bh // HV, i_bh % HV
    i_b64 = i_b.to(tl.int64)
    k_base = i_b64 * s_kb + (i_h // GROUP) * s_kh
    g_base = i_b64 * s_gb + i_h * s_gh
    b_base = i_b64 * s_bb + i_h * s_bh
    o_c = tl.arange(0, 16)
    t0 = i_t * 64
    o_t0, o_t1, o_t2, o_t3 = t0 + o_c, t0 + 16 + o_c, t0 + 32 + o_c, t0 + 48 + o_c

    # k_i.k_j in [16, 16] blocks (i >= j), BK key columns at a time; the
    # norm, applied to the sums, from the diagonal blocks' diagonals (a sum
    # of squares of its own cost 145 µs of 395 at B1 T16384 H32, H200)
    b_A00 = tl.zeros([16, 16], dtype=tl.float32)
    b_A11, b_A22, b_A33 = b_A00, b_A00, b_A00
    b_A10, b_A20, b_A21, b_A30, b_A31, b_A32 = b_A00, b_A00, b_A00, b_A00, b_A00, b_A00
    for i_k in range(0, tl.cdiv(DK, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        b_k0 = _load_rows(k, k_base, o_t0, T, s_kt, o_k, DK, False, EPS)
        b_k1 = _load_rows(k, k_base, o_t1, T, s_kt, o_k, DK, False, EPS)
        b_k2 = _load_rows(k, k_base, o_t2, T, s_kt, o_k, DK, False, EPS)
        b_k3 = _load_rows(k, k_base, o_t3, T, s_kt, o_k, DK, False, EPS)
        b_A00 += _dot(b_k0, tl.trans(b_k0), DT, PREC, EMU)
        b_A11 += _dot(b_k1, tl.trans(b_k1), DT, PREC, EMU)
        b_A22 += _dot(b_k2, tl.trans(b_k2), DT, PREC, EMU)
        b_A33 += _dot(b_k3, tl.trans(b_k3), DT, PREC, EMU)
        b_A10 += _dot(b_k1, tl.trans(b_k0), DT, PREC, EMU)
        b_A20 += _dot(b_k2, tl.trans(b_k0), DT, PREC, EMU)
        b_A21 += _dot(b_k2, tl.trans(b_k1), DT, PREC, EMU)
        b_A30 += _dot(b_k3, tl.trans(b_k0), DT, PREC, EMU)
        b_A31 += _dot(b_k3, tl.trans(b_k1), DT, PREC, EMU)
        b_A32 += _dot(b_k3, tl.trans(b_k2), DT, PREC, EMU)
    b_r0, b_r1 = _rnorm(_diag16(b_A00), L2NORM, EPS), _rnorm(_diag16(b_A11), L2NORM, EPS)
    b_r2, b_r3 = _rnorm(_diag16(b_A22), L2NORM, EPS), _rnorm(_diag16(b_A33), L2NORM, EPS)
    # cumulative log gates over the chunk, fp32; beta folded into the rows
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
    b_br0 = _load_vec(beta, b_base, o_t0, T, s_bt) * b_r0
    b_br1 = _load_vec(beta, b_base, o_t1, T, s_bt) * b_r1
    b_br2 = _load_vec(beta, b_base, o_t2, T, s_bt) * b_r2
    b_br3 = _load_vec(beta, b_base, o_t3, T, s_bt) * b_r3
    b_A00 = _gate_block(b_A00, b_br0, b_r0, b_G0, b_G0, True)
    b_A11 = _gate_block(b_A11, b_br1, b_r1, b_G1, b_G1, True)
    b_A22 = _gate_block(b_A22, b_br2, b_r2, b_G2, b_G2, True)
    b_A33 = _gate_block(b_A33, b_br3, b_r3, b_G3, b_G3, True)
    b_A10 = _gate_block(b_A10, b_br1, b_r0, b_G1, b_G0, False)
    b_A20 = _gate_block(b_A20, b_br2, b_r0, b_G2, b_G0, False)
    b_A21 = _gate_block(b_A21, b_br2, b_r1, b_G2, b_G1, False)
    b_A30 = _gate_block(b_A30, b_br3, b_r0, b_G3, b_G0, False)
    b_A31 = _gate_block(b_A31, b_br3, b_r1, b_G3, b_G1, False)
    b_A32 = _gate_block(b_A32, b_br3, b_r2, b_G3, b_G2, False)

    # T = (I + A)^-1: diagonal blocks, then T_ij = -T_ii sum_{j <= m < i} A_im T_mj
    # (16x16x16 products at MPREC: tf32 where T is rounded to half precision
    # after).  The diagonal blocks by forward substitution, on one warp its
    # row sums are shuffles: 126 µs at B1 T16384 H32 against 215 as products
    # of powers (I - N)(I + N^2)(I + N^4)(I + N^8), which won at 4 warps, and
    # 207 with ieee merges (H200, bf16).
    b_T00, b_T11, b_T22, b_T33 = _inv16x4(b_A00, b_A11, b_A22, b_A33)
    b_T10 = -_mm(b_T11, _mm(b_A10, b_T00, MPREC), MPREC)
    b_T21 = -_mm(b_T22, _mm(b_A21, b_T11, MPREC), MPREC)
    b_T32 = -_mm(b_T33, _mm(b_A32, b_T22, MPREC), MPREC)
    b_T20 = -_mm(b_T22, _mm(b_A20, b_T00, MPREC) + _mm(b_A21, b_T10, MPREC), MPREC)
    b_T31 = -_mm(b_T33, _mm(b_A31, b_T11, MPREC) + _mm(b_A32, b_T21, MPREC), MPREC)
    b_T30 = -_mm(b_T33, _mm(b_A30, b_T00, MPREC) + _mm(b_A31, b_T10, MPREC) + _mm(b_A32, b_T20, MPREC), MPREC)

    # the lower blocks into rows t0.. of a [T, 64] slice (the blocks above
    # the diagonal are never stored: the w/u kernel masks them)
    t_base = i_bh.to(tl.int64) * T * 64
    _store_block(ti, t_base, o_t0, 0, o_c, T, b_T00, TDT, TEMU)
    _store_block(ti, t_base, o_t1, 0, o_c, T, b_T10, TDT, TEMU)
    _store_block(ti, t_base, o_t1, 16, o_c, T, b_T11, TDT, TEMU)
    _store_block(ti, t_base, o_t2, 0, o_c, T, b_T20, TDT, TEMU)
    _store_block(ti, t_base, o_t2, 16, o_c, T, b_T21, TDT, TEMU)
    _store_block(ti, t_base, o_t2, 32, o_c, T, b_T22, TDT, TEMU)
    _store_block(ti, t_base, o_t3, 0, o_c, T, b_T30, TDT, TEMU)
    _store_block(ti, t_base, o_t3, 16, o_c, T, b_T31, TDT, TEMU)
    _store_block(ti, t_base, o_t3, 32, o_c, T, b_T32, TDT, TEMU)
    _store_block(ti, t_base, o_t3, 48, o_c, T, b_T33, TDT, TEMU)


@triton.jit
def _gdn_wu_kernel(
    q, k, v, g, beta, ti, w, u, aq, f, dl, fq,
    T, NT, HV, GROUP, scale,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_gb, s_gt, s_gh, s_bb, s_bt, s_bh,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    L2NORM: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr,
    TDT: tl.constexpr, TPREC: tl.constexpr, TEMU: tl.constexpr, AQK: tl.constexpr, EPS: tl.constexpr,
    ROWF: tl.constexpr,
):
    i_c = tl.program_id(0)
    i_t, i_bh = i_c % NT, i_c // NT
    i_b, i_h = i_bh // HV, i_bh % HV
    i_b64, i_bh64 = i_b.to(tl.int64), i_bh.to(tl.int64)
    scale = scalar_fp32(scale, False)  # (Inductor passes it fp64: q's tiles would be scaled in fp64)
    k_base = i_b64 * s_kb + (i_h // GROUP) * s_kh
    v_base = i_b64 * s_vb + i_h * s_vh
    o_c = tl.arange(0, 64)
    o_t = i_t * 64 + o_c
    m_t = o_t < T
    o_k = tl.arange(0, BK)
    b_g = _load_vec(g, i_b64 * s_gb + i_h * s_gh, o_t, T, s_gt)
    b_G = tl.cumsum(b_g, 0)
    b_Gl = tl.sum(b_g, 0)
    b_b = _load_vec(beta, i_b64 * s_bb + i_h * s_bh, o_t, T, s_bt)
    b_T = tl.load(ti + i_bh64 * T * 64 + o_t.to(tl.int64)[:, None] * 64 + o_c[None, :],
                  mask=m_t[:, None] & (o_c[:, None] >= o_c[None, :]), other=0.0)
    b_k = _load_rows(k, k_base, o_t, T, s_kt, o_k, DK, False, EPS)
    b_r = _row_rnorm(b_k, L2NORM, EPS)
    b_k = b_k * b_r[:, None]
    # the state pass's row factors, off its sequential path: v' is scaled by
    # exp(Gamma_last - Gamma) / |k| before k^T v', and S by exp(Gamma_last)
    tl.store(f + i_bh64 * T + o_t, tl.exp(b_Gl - b_G) * b_r, mask=m_t)
    tl.store(dl + i_c, tl.exp(b_Gl))
    # w = T (beta exp(Gamma) k~), u = T (beta v): one [64, 64] x [64, d] product each
    b_w = _dot(b_T, b_k * (b_b * tl.exp(b_G))[:, None], TDT, TPREC, TEMU)
    w_base = i_bh64 * T * DK
    tl.store(w + w_base + o_t.to(tl.int64)[:, None] * DK + o_k[None, :], round_to(b_w, DT, EMU),
             mask=m_t[:, None] & (o_k < DK)[None, :])
    u_base = i_bh64 * T * DV
    for i_v in range(0, tl.cdiv(DV, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        b_y = _load_rows(v, v_base, o_t, T, s_vt, o_v, DV, False, EPS) * b_b[:, None]
        tl.store(u + u_base + o_t.to(tl.int64)[:, None] * DV + o_v[None, :],
                 round_to(_dot(b_T, b_y, TDT, TPREC, TEMU), DT, EMU), mask=m_t[:, None] & (o_v < DV)[None, :])
    if AQK:
        # the fused scan's causal matrix (entries above the diagonal are 0)
        if ROWF:  # and the scan's row factor on q S: q~ S = diag(r_q scale exp(Gamma)) (q S)
            b_q = _load_rows(q, i_b64 * s_qb + (i_h // GROUP) * s_qh, o_t, T, s_qt, o_k, DK, False, EPS)
            b_rq = _row_rnorm(b_q, L2NORM, EPS) * scale
            b_q = b_q * b_rq[:, None]
            tl.store(fq + i_bh64 * T + o_t, b_rq * tl.exp(b_G), mask=m_t)
        else:
            b_q = _load_rows(q, i_b64 * s_qb + (i_h // GROUP) * s_qh, o_t, T, s_qt, o_k, DK, L2NORM, EPS) * scale
        b_d = tl.where(o_c[:, None] >= o_c[None, :], b_G[:, None] - b_G[None, :], float("-inf"))
        b_a = _dot(b_q, tl.trans(b_k), DT, PREC, EMU) * tl.exp(b_d)
        tl.store(aq + i_c.to(tl.int64) * 4096 + o_c[:, None] * 64 + o_c[None, :], round_to(b_a, DT, EMU))


@triton.jit
def _chunk_output(b_q, b_k, b_G, b_S, b_v, o_t, DT: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr):
    """o = (exp(Gamma) q~) S + causal(q~ k~^T exp(Gamma_i - Gamma_j)) v' for one chunk, [BT, BV] fp32."""
    b_o = _dot(b_q * tl.exp(b_G)[:, None], b_S, DT, PREC, EMU)
    b_a = _dot(b_q, tl.trans(b_k), DT, PREC, EMU)
    b_d = tl.where(o_t[:, None] >= o_t[None, :], b_G[:, None] - b_G[None, :], float("-inf"))
    b_a = b_a * tl.exp(b_d)
    return b_o + _dot(b_a, b_v, DT, PREC, EMU)


@triton.jit
def _scan_loads(q, k, w, u, aq, g, q_base, k_base, g_base, w_base, u_base, a_base, i_t, T, s_qt, s_kt, s_gt,
                o_k, o_v, DK: tl.constexpr, DV: tl.constexpr):
    """One chunk's operands of the scan, as stored: g, q, k, w, u, Aq."""
    o_c = tl.arange(0, 64)
    o_t = i_t * 64 + o_c
    m_t = o_t < T
    m_tk = m_t[:, None] & (o_k < DK)[None, :]
    o_t64 = o_t.to(tl.int64)
    b_g = _load_vec(g, g_base, o_t, T, s_gt)
    b_q = tl.load(q + q_base + o_t64[:, None] * s_qt + o_k[None, :], mask=m_tk, other=0.0)
    b_k = tl.load(k + k_base + o_t64[:, None] * s_kt + o_k[None, :], mask=m_tk, other=0.0)
    b_w = tl.load(w + w_base + o_t64[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0)
    b_u = tl.load(u + u_base + o_t64[:, None] * DV + o_v[None, :], mask=m_t[:, None] & (o_v < DV)[None, :], other=0.0)
    b_a = tl.load(aq + a_base + i_t * 4096 + o_c[:, None] * 64 + o_c[None, :],
                  mask=m_t[:, None] & (o_c[:, None] >= o_c[None, :]), other=0.0)
    return b_g, b_q, b_k, b_w, b_u, b_a


@triton.jit
def _gdn_scan_kernel(
    q, k, w, u, aq, g, fq, f, dl, h0, o, hT,
    T, NT, HV, GROUP, NV, scale,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_gb, s_gt, s_gh,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    L2NORM: tl.constexpr, HAS_H0: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr, EPS: tl.constexpr, ROWF: tl.constexpr,
):
    """ROWF: the norms and decays as row factors from the w/u kernel (fq on
    q S, f on v' before k^T v', dl on S), q and k as stored straight into
    the products, as the state pass takes them; else normalised and decayed
    here."""
    scale = scalar_fp32(scale, False)  # (Inductor passes it fp64: q's tiles would be scaled in fp64)
    i_p = tl.program_id(0)
    i_v, i_bh = i_p % NV, i_p // NV
    i_b, i_h = i_bh // HV, i_bh % HV
    i_b64, i_bh64 = i_b.to(tl.int64), i_bh.to(tl.int64)
    q_base = i_b64 * s_qb + (i_h // GROUP) * s_qh
    k_base = i_b64 * s_kb + (i_h // GROUP) * s_kh
    g_base = i_b64 * s_gb + i_h * s_gh
    w_base, u_base, a_base = i_bh64 * T * DK, i_bh64 * T * DV, i_bh64 * NT * 4096
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
    for i_t in range(0, NT):
        b_g, b_q, b_k, b_w, b_u, b_a = _scan_loads(q, k, w, u, aq, g, q_base, k_base, g_base, w_base, u_base,
                                                   a_base, i_t, T, s_qt, s_kt, s_gt, o_k, o_v, DK, DV)
        o_t = i_t * 64 + o_c
        # [64, BV]: the chunk's new values, then its output
        b_v = b_u.to(tl.float32) - _dot(b_w, b_S, DT, PREC, EMU)
        if ROWF:
            b_fq, b_f = _load_vec(fq, i_bh64 * T, o_t, T, 1), _load_vec(f, i_bh64 * T, o_t, T, 1)
            b_o = _dot(b_q, b_S, DT, PREC, EMU) * b_fq[:, None] + _dot(b_a, b_v, DT, PREC, EMU)
            b_S = _dot_acc(tl.trans(b_k), b_v * b_f[:, None], b_S * tl.load(dl + i_bh64 * NT + i_t), DT, PREC, EMU)
        else:
            b_G = tl.cumsum(b_g, 0)
            b_Gl = tl.sum(b_g, 0)
            b_q = _l2rows(b_q, L2NORM, EPS) * (scale * tl.exp(b_G))[:, None]
            b_o = _dot(b_q, b_S, DT, PREC, EMU) + _dot(b_a, b_v, DT, PREC, EMU)
            b_kd = _l2rows(b_k, L2NORM, EPS) * tl.exp(b_Gl - b_G)[:, None]
            b_S = b_S * tl.exp(b_Gl) + _dot(tl.trans(b_kd), b_v, DT, PREC, EMU)
        p_o = o + ((i_b64 * T + o_t[:, None]) * HV + i_h) * DV + o_v[None, :]
        tl.store(p_o, round_to(b_o, o.dtype.element_ty, EMU), mask=(o_t < T)[:, None] & m_v[None, :])
    tl.store(hT + i_bh64 * DK * DV + p_S, b_S, mask=m_kv)


@triton.jit
def _state_rows(h0, base, o_r, o_v, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr):
    """Rows o_r (64 of the key head) of the initial state, fp32 [64, BV]."""
    if HAS_H0:
        return tl.load(h0 + base + o_r[:, None] * DV + o_v[None, :],
                       mask=(o_r < DK)[:, None] & (o_v < DV)[None, :], other=0.0).to(tl.float32)
    else:
        return tl.zeros([64, BV], dtype=tl.float32)


@triton.jit
def _state_put(p, base, b_S, o_r, o_v, DK: tl.constexpr, DV: tl.constexpr, DT: tl.constexpr, EMU: tl.constexpr):
    """Rows o_r of a [DK, DV] state out, rounded to DT."""
    tl.store(p + base + o_r[:, None] * DV + o_v[None, :], round_to(b_S, DT, EMU),
             mask=(o_r < DK)[:, None] & (o_v < DV)[None, :])


@triton.jit
def _w_times_state(w, base, o_t, m_t, o_r, b_S, acc, DK: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
                   EMU: tl.constexpr):
    """acc + w[:, o_r] S[o_r, :] for one 64-row block of the key head."""
    b_w = tl.load(w + base + o_t.to(tl.int64)[:, None] * DK + o_r[None, :],
                  mask=m_t[:, None] & (o_r < DK)[None, :], other=0.0)
    return _dot_acc(b_w, b_S, acc, DT, PREC, EMU)


@triton.jit
def _keys_t(k, base, o_t, m_t, s_kt, o_r, DK: tl.constexpr):
    """k[o_t, o_r] loaded transposed, [64 key rows, 64 tokens], as stored."""
    return tl.load(k + base + o_t.to(tl.int64)[None, :] * s_kt + o_r[:, None],
                   mask=(o_r < DK)[:, None] & m_t[None, :], other=0.0)


@triton.jit
def _gdn_state_kernel(
    k, w, u, f, dl, h0, hT, hs,
    T, NT, HV, GROUP, NV,
    s_kb, s_kt, s_kh,
    DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr,
):
    """The sequential pass: S in 64-row blocks of the key head (one to four),
    each a [64, BV] fp32 accumulator that both products of a step use as it
    is, per chunk

        v' = u - w S                       (stored over u, in q's dtype)
        S  = exp(Gamma_last) S + k^T (v' exp(Gamma_last - Gamma) / |k|)

    The decay and the keys' L2 norm scale v''s rows (f and dl, from the w/u
    kernel) rather than the keys, so the keys are read as stored, transposed,
    straight into the product: nothing in the loop but the two products
    waits on anything but loads."""
    i_p = tl.program_id(0)
    i_v, i_bh = i_p % NV, i_p // NV
    i_b, i_h = i_bh // HV, i_bh % HV
    i_b64, i_bh64 = i_b.to(tl.int64), i_bh.to(tl.int64)
    k_base = i_b64 * s_kb + (i_h // GROUP) * s_kh
    s_base = i_bh64 * DK * DV
    w_base = i_bh64 * T * DK
    u_base = i_bh64 * T * DV
    o_r = tl.arange(0, 64)
    o_v = i_v * BV + tl.arange(0, BV)
    o_c = tl.arange(0, 64)
    m_v = o_v < DV
    b_S0 = _state_rows(h0, s_base, o_r, o_v, DK, DV, BV, HAS_H0)
    if DK > 64:
        b_S1 = _state_rows(h0, s_base, o_r + 64, o_v, DK, DV, BV, HAS_H0)
    if DK > 128:
        b_S2 = _state_rows(h0, s_base, o_r + 128, o_v, DK, DV, BV, HAS_H0)
        b_S3 = _state_rows(h0, s_base, o_r + 192, o_v, DK, DV, BV, HAS_H0)
    for i_t in range(0, NT):
        o_t = i_t * 64 + o_c
        m_t = o_t < T
        h_base = (i_bh64 * NT + i_t) * DK * DV
        # the state entering the chunk, for the output kernel; then w S
        _state_put(hs, h_base, b_S0, o_r, o_v, DK, DV, DT, EMU)
        b_ws = _w_times_state(w, w_base, o_t, m_t, o_r, b_S0, tl.zeros([64, BV], dtype=tl.float32), DK, DT, PREC, EMU)
        if DK > 64:
            _state_put(hs, h_base, b_S1, o_r + 64, o_v, DK, DV, DT, EMU)
            b_ws = _w_times_state(w, w_base, o_t, m_t, o_r + 64, b_S1, b_ws, DK, DT, PREC, EMU)
        if DK > 128:
            _state_put(hs, h_base, b_S2, o_r + 128, o_v, DK, DV, DT, EMU)
            _state_put(hs, h_base, b_S3, o_r + 192, o_v, DK, DV, DT, EMU)
            b_ws = _w_times_state(w, w_base, o_t, m_t, o_r + 128, b_S2, b_ws, DK, DT, PREC, EMU)
            b_ws = _w_times_state(w, w_base, o_t, m_t, o_r + 192, b_S3, b_ws, DK, DT, PREC, EMU)
        p_u = u + u_base + o_t.to(tl.int64)[:, None] * DV + o_v[None, :]
        m_u = m_t[:, None] & m_v[None, :]
        b_v = tl.load(p_u, mask=m_u, other=0.0).to(tl.float32) - b_ws
        tl.store(p_u, round_to(b_v, DT, EMU), mask=m_u)
        b_vd = b_v * tl.load(f + i_bh64 * T + o_t, mask=m_t, other=0.0)[:, None]
        b_d = tl.load(dl + i_bh64 * NT + i_t)
        b_S0 = _dot_acc(_keys_t(k, k_base, o_t, m_t, s_kt, o_r, DK), b_vd, b_S0 * b_d, DT, PREC, EMU)
        if DK > 64:
            b_S1 = _dot_acc(_keys_t(k, k_base, o_t, m_t, s_kt, o_r + 64, DK), b_vd, b_S1 * b_d, DT, PREC, EMU)
        if DK > 128:
            b_S2 = _dot_acc(_keys_t(k, k_base, o_t, m_t, s_kt, o_r + 128, DK), b_vd, b_S2 * b_d, DT, PREC, EMU)
            b_S3 = _dot_acc(_keys_t(k, k_base, o_t, m_t, s_kt, o_r + 192, DK), b_vd, b_S3 * b_d, DT, PREC, EMU)
    _state_put(hT, s_base, b_S0, o_r, o_v, DK, DV, tl.float32, False)
    if DK > 64:
        _state_put(hT, s_base, b_S1, o_r + 64, o_v, DK, DV, tl.float32, False)
    if DK > 128:
        _state_put(hT, s_base, b_S2, o_r + 128, o_v, DK, DV, tl.float32, False)
        _state_put(hT, s_base, b_S3, o_r + 192, o_v, DK, DV, tl.float32, False)


@triton.jit
def _gdn_output_kernel(
    q, k, g, vn, hs, o,
    T, NT, HV, GROUP, NV, scale,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_gb, s_gt, s_gh,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    L2NORM: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr, EPS: tl.constexpr,
    ROWF: tl.constexpr,
):
    i_p = tl.program_id(0)
    i_v = i_p % NV
    i_t = (i_p // NV) % NT
    i_bh = i_p // (NV * NT)
    i_b, i_h = i_bh // HV, i_bh % HV
    i_b64, i_bh64 = i_b.to(tl.int64), i_bh.to(tl.int64)
    scale = scalar_fp32(scale, False)  # (Inductor passes it fp64: q's tiles would be scaled in fp64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_c = tl.arange(0, 64)
    o_t = i_t * 64 + o_c
    m_k, m_v, m_t = o_k < DK, o_v < DV, o_t < T
    b_G = tl.cumsum(_load_vec(g, i_b64 * s_gb + i_h * s_gh, o_t, T, s_gt), 0)
    b_S = tl.load(hs + (i_bh64 * NT + i_t) * DK * DV + o_k[:, None] * DV + o_v[None, :],
                  mask=m_k[:, None] & m_v[None, :], other=0.0)
    m_u = m_t[:, None] & m_v[None, :]
    b_v = tl.load(vn + i_bh64 * T * DV + o_t[:, None] * DV + o_v[None, :], mask=m_u, other=0.0)
    if ROWF:
        # q and k as stored into the products, their norms and decays on the results
        b_q = _rows(q, i_b64 * s_qb + (i_h // GROUP) * s_qh, o_t, T, s_qt, o_k, DK)
        b_k = _rows(k, i_b64 * s_kb + (i_h // GROUP) * s_kh, o_t, T, s_kt, o_k, DK)
        b_rq, b_rk = _row_rnorm(b_q, L2NORM, EPS) * scale, _row_rnorm(b_k, L2NORM, EPS)
        b_d = tl.where(o_c[:, None] >= o_c[None, :], b_G[:, None] - b_G[None, :], float("-inf"))
        b_a = _dot(b_q, tl.trans(b_k), DT, PREC, EMU) * (b_rq[:, None] * b_rk[None, :]) * tl.exp(b_d)
        b_o = _dot(b_q, b_S, DT, PREC, EMU) * (b_rq * tl.exp(b_G))[:, None] + _dot(b_a, b_v, DT, PREC, EMU)
    else:
        b_q = _load_rows(q, i_b64 * s_qb + (i_h // GROUP) * s_qh, o_t, T, s_qt, o_k, DK, L2NORM, EPS) * scale
        b_k = _load_rows(k, i_b64 * s_kb + (i_h // GROUP) * s_kh, o_t, T, s_kt, o_k, DK, L2NORM, EPS)
        b_o = _chunk_output(b_q, b_k, b_G, b_S, b_v, o_c, DT, PREC, EMU)
    p_o = o + ((i_b64 * T + o_t[:, None]) * HV + i_h) * DV + o_v[None, :]
    tl.store(p_o, round_to(b_o, o.dtype.element_ty, EMU), mask=m_u)
