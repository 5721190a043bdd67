"""The chunked prefill's kernels: prep, then either the fused state-and-output
scan or the state pass followed by the output kernel."""

from __future__ import annotations

import triton
import triton.language as tl

from fusepass.kernels._common import round_to
from fusepass.kernels.gdn.tiles import (_dot, _dot_ieee, _inv16_product, _inv16x4, _kkt_block, _load_rows, _load_vec,
                                        _qk_block, _store_lower_product)


# ------------------------------------------------------------------- kernels ----
#
# Chunked prefill, per (batch b, value head h) with key head hk = h // GROUP,
# for a chunk of BT = 64 tokens (Gamma = within-chunk cumulative sum of g,
# k~ / q~ = the L2-normalised k / q when asked, q~ also scaled):
#
#   1. _gdn_prep_kernel, one program per (b, h, chunk), all on chip:
#        A = strictly_lower(beta_i k~_i.k~_j exp(Gamma_i - Gamma_j))
#        T = (I + A)^-1       (16x16 diagonal blocks, merged by block
#                              forward substitution)
#        w = T (beta exp(Gamma) k~),  u = T (beta v)      -> scratch, q's dtype
#        (AQK) Aq = causal(q~ k~^T exp(Gamma_i - Gamma_j)) -> scratch [64, 64]
#        (PRE_KD) kd = exp(Gamma_last - Gamma) k~           -> scratch
#   2a. _gdn_scan_kernel (fused output), one program per (b, h, d_v block),
#      a loop over the chunks with the state S [d_k, BV] in fp32 registers:
#        v' = u - w S
#        o  = (exp(Gamma) q~) S + Aq v'
#        S  = exp(Gamma_last) S + kd^T v'
#      Nothing per chunk goes back to memory but o: the per-chunk states
#      (d_k x d_v each, 32 KiB in bf16 at d 128, twice q's bytes) and v' stay
#      on chip.  o is off the S -> v' -> S chain, so the loop's latency is
#      that of two dots.
#   2b. _gdn_state_kernel + _gdn_output_kernel: the same loop storing S (q's
#      dtype) and v' (over u), then the output line of 2a, parallel over
#      chunks.
#
# Exponentials only ever see Gamma_i - Gamma_j with i >= j, Gamma_last -
# Gamma and Gamma, all <= 0 for g <= 0: the causal mask is applied to the
# exponent (-inf), never to exp's result.  Rows past T load g = 0, beta =
# 0, q = k = v = 0: they add nothing and leave Gamma_last unchanged.  A head
# with some g > 0 is computed again by the token loop after these kernels
# (launch._rising_heads).


@triton.jit
def _gdn_prep_kernel(
    q, k, v, g, beta, w, u, kd, aq,
    T, NT, HV, GROUP, scale,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_gb, s_gt, s_gh, s_bb, s_bt, s_bh,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    L2NORM: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr, PRE_KD: tl.constexpr,
    AQK: tl.constexpr, INV_PRODUCT: tl.constexpr, EPS: tl.constexpr,
):
    i_c = tl.program_id(0)
    i_t, i_bh = i_c % NT, i_c // NT
    i_b, i_h = i_bh // HV, i_bh % HV
    i_b64 = i_b.to(tl.int64)
    q_base = i_b64 * s_qb + (i_h // GROUP) * s_qh
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

    if AQK:
        # the output's causal matrix, one row block of queries at a time;
        # blocks above the diagonal are never stored (the scan masks them)
        a_base = i_c.to(tl.int64) * 4096 + o_c[:, None] * 64 + o_c[None, :]
        b_q = _load_rows(q, q_base, o_t0, T, s_qt, o_k, DK, L2NORM, EPS) * scale
        tl.store(aq + a_base, round_to(_qk_block(b_q, b_k0, b_G0, b_G0, True, DT, PREC, EMU), DT, EMU))
        b_q = _load_rows(q, q_base, o_t1, T, s_qt, o_k, DK, L2NORM, EPS) * scale
        tl.store(aq + a_base + 1024, round_to(_qk_block(b_q, b_k0, b_G1, b_G0, False, DT, PREC, EMU), DT, EMU))
        tl.store(aq + a_base + 1040, round_to(_qk_block(b_q, b_k1, b_G1, b_G1, True, DT, PREC, EMU), DT, EMU))
        b_q = _load_rows(q, q_base, o_t2, T, s_qt, o_k, DK, L2NORM, EPS) * scale
        tl.store(aq + a_base + 2048, round_to(_qk_block(b_q, b_k0, b_G2, b_G0, False, DT, PREC, EMU), DT, EMU))
        tl.store(aq + a_base + 2064, round_to(_qk_block(b_q, b_k1, b_G2, b_G1, False, DT, PREC, EMU), DT, EMU))
        tl.store(aq + a_base + 2080, round_to(_qk_block(b_q, b_k2, b_G2, b_G2, True, DT, PREC, EMU), DT, EMU))
        b_q = _load_rows(q, q_base, o_t3, T, s_qt, o_k, DK, L2NORM, EPS) * scale
        tl.store(aq + a_base + 3072, round_to(_qk_block(b_q, b_k0, b_G3, b_G0, False, DT, PREC, EMU), DT, EMU))
        tl.store(aq + a_base + 3088, round_to(_qk_block(b_q, b_k1, b_G3, b_G1, False, DT, PREC, EMU), DT, EMU))
        tl.store(aq + a_base + 3104, round_to(_qk_block(b_q, b_k2, b_G3, b_G2, False, DT, PREC, EMU), DT, EMU))
        tl.store(aq + a_base + 3120, round_to(_qk_block(b_q, b_k3, b_G3, b_G3, True, DT, PREC, EMU), DT, EMU))

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
    # (fp32 ieee: 16x16x16 products, a few hundred FMAs per thread in all).
    # INV_PRODUCT (half-precision inputs): the diagonal blocks as products of
    # powers rather than by forward substitution (14 dependent row steps,
    # each two cross-thread sums): the prep 14-34 µs faster at B1 T16384 H32
    # and B16 T1024 H32 (H100, bf16, the same output error).
    if INV_PRODUCT:
        b_T00, b_T11 = _inv16_product(b_A00), _inv16_product(b_A11)
        b_T22, b_T33 = _inv16_product(b_A22), _inv16_product(b_A33)
    else:
        b_T00, b_T11, b_T22, b_T33 = _inv16x4(b_A00, b_A11, b_A22, b_A33)
    b_T10 = -_dot_ieee(b_T11, _dot_ieee(b_A10, b_T00))
    b_T21 = -_dot_ieee(b_T22, _dot_ieee(b_A21, b_T11))
    b_T32 = -_dot_ieee(b_T33, _dot_ieee(b_A32, b_T22))
    b_T20 = -_dot_ieee(b_T22, _dot_ieee(b_A20, b_T00) + _dot_ieee(b_A21, b_T10))
    b_T31 = -_dot_ieee(b_T33, _dot_ieee(b_A31, b_T11) + _dot_ieee(b_A32, b_T21))
    b_T30 = -_dot_ieee(b_T33, _dot_ieee(b_A30, b_T00) + _dot_ieee(b_A31, b_T10) + _dot_ieee(b_A32, b_T20))

    # w = T (beta exp(Gamma) k~), u = T (beta v): tf32 on fp32 operands.  T and
    # the right side rounded to bf16 instead: 15-20 µs faster at B1 T16384 H32
    # (H100), relative error 4.39e-3 against 4.08e-3: not taken.
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
        tl.store(kd + w_base + o_t0[:, None] * DK + o_k[None, :],
                 round_to(b_k0 * tl.exp(b_Gl - b_G0)[:, None], DT, EMU), mask=(o_t0 < T)[:, None] & m_k)
        tl.store(kd + w_base + o_t1[:, None] * DK + o_k[None, :],
                 round_to(b_k1 * tl.exp(b_Gl - b_G1)[:, None], DT, EMU), mask=(o_t1 < T)[:, None] & m_k)
        tl.store(kd + w_base + o_t2[:, None] * DK + o_k[None, :],
                 round_to(b_k2 * tl.exp(b_Gl - b_G2)[:, None], DT, EMU), mask=(o_t2 < T)[:, None] & m_k)
        tl.store(kd + w_base + o_t3[:, None] * DK + o_k[None, :],
                 round_to(b_k3 * tl.exp(b_Gl - b_G3)[:, None], DT, EMU), mask=(o_t3 < T)[:, None] & m_k)

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
def _scan_loads(q, k, kd, w, u, aq, g, q_base, k_base, g_base, w_base, u_base, a_base, i_t, T, s_qt, s_kt, s_gt,
                o_k, o_v, DK: tl.constexpr, DV: tl.constexpr, PRE_KD: tl.constexpr):
    """One chunk's operands of the scan, as stored: g, q, k (or kd), w, u, Aq."""
    o_c = tl.arange(0, 64)
    o_t = i_t * 64 + o_c
    m_t = o_t < T
    m_tk = m_t[:, None] & (o_k < DK)[None, :]
    o_t64 = o_t.to(tl.int64)
    b_g = _load_vec(g, g_base, o_t, T, s_gt)
    b_q = tl.load(q + q_base + o_t64[:, None] * s_qt + o_k[None, :], mask=m_tk, other=0.0)
    if PRE_KD:
        b_k = tl.load(kd + w_base + o_t64[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0)
    else:
        b_k = tl.load(k + k_base + o_t64[:, None] * s_kt + o_k[None, :], mask=m_tk, other=0.0)
    b_w = tl.load(w + w_base + o_t64[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0)
    b_u = tl.load(u + u_base + o_t64[:, None] * DV + o_v[None, :], mask=m_t[:, None] & (o_v < DV)[None, :], other=0.0)
    b_a = tl.load(aq + a_base + i_t * 4096 + o_c[:, None] * 64 + o_c[None, :],
                  mask=m_t[:, None] & (o_c[:, None] >= o_c[None, :]), other=0.0)
    return b_g, b_q, b_k, b_w, b_u, b_a


@triton.jit
def _l2rows(b_x, L2NORM: tl.constexpr, EPS: tl.constexpr):
    b_x = b_x.to(tl.float32)
    if L2NORM:
        b_x = b_x * tl.rsqrt(tl.sum(b_x * b_x, 1) + EPS)[:, None]
    return b_x


@triton.jit
def _gdn_scan_kernel(
    q, k, w, u, kd, aq, g, h0, o, hT,
    T, NT, HV, GROUP, NV, scale,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_gb, s_gt, s_gh,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    L2NORM: tl.constexpr, HAS_H0: tl.constexpr, PRE_KD: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr, EPS: tl.constexpr,
):
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
        b_g, b_q, b_k, b_w, b_u, b_a = _scan_loads(q, k, kd, w, u, aq, g, q_base, k_base, g_base, w_base, u_base,
                                                   a_base, i_t, T, s_qt, s_kt, s_gt, o_k, o_v, DK, DV, PRE_KD)
        b_G = tl.cumsum(b_g, 0)
        b_Gl = tl.sum(b_g, 0)
        # [64, BV]: the chunk's new values, then its output
        b_v = b_u.to(tl.float32) - _dot(b_w, b_S, DT, PREC, EMU)
        b_q = _l2rows(b_q, L2NORM, EPS) * (scale * tl.exp(b_G))[:, None]
        b_o = _dot(b_q, b_S, DT, PREC, EMU) + _dot(b_a, b_v, DT, PREC, EMU)
        if PRE_KD:
            b_kd = b_k
        else:
            b_kd = _l2rows(b_k, L2NORM, EPS) * tl.exp(b_Gl - b_G)[:, None]
        b_S = b_S * tl.exp(b_Gl) + _dot(tl.trans(b_kd), b_v, DT, PREC, EMU)
        o_t = i_t * 64 + o_c
        p_o = o + ((i_b64 * T + o_t[:, None]) * HV + i_h) * DV + o_v[None, :]
        tl.store(p_o, round_to(b_o, o.dtype.element_ty, EMU), mask=(o_t < T)[:, None] & m_v[None, :])
    tl.store(hT + i_bh64 * DK * DV + p_S, b_S, mask=m_kv)


@triton.jit
def _gdn_state_kernel(
    k, w, u, kd, g, h0, hT, hs,
    T, NT, HV, GROUP, NV,
    s_kb, s_kt, s_kh, s_gb, s_gt, s_gh,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    L2NORM: tl.constexpr, HAS_H0: tl.constexpr, PRE_KD: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr, EPS: tl.constexpr,
):
    i_p = tl.program_id(0)
    i_v, i_bh = i_p % NV, i_p // NV
    i_b, i_h = i_bh // HV, i_bh % HV
    i_b64, i_bh64 = i_b.to(tl.int64), i_bh.to(tl.int64)
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
        # [64, BK], [64, BV]
        m_tk = m_t[:, None] & m_k[None, :]
        b_w = tl.load(w + w_base + o_t[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0)
        if PRE_KD:
            b_kd = tl.load(kd + w_base + o_t[:, None] * DK + o_k[None, :], mask=m_tk, other=0.0)
        else:
            b_G = tl.cumsum(b_g, 0)
            b_k = _load_rows(k, k_base, o_t, T, s_kt, o_k, DK, L2NORM, EPS)
            b_kd = b_k * tl.exp(b_Gl - b_G)[:, None]
        p_u = u + u_base + o_t[:, None] * DV + o_v[None, :]
        m_u = m_t[:, None] & m_v[None, :]
        b_u = tl.load(p_u, mask=m_u, other=0.0).to(tl.float32)
        b_v = b_u - _dot(b_w, b_S, DT, PREC, EMU)
        tl.store(hs + (i_bh64 * NT + i_t) * DK * DV + p_S, round_to(b_S, DT, EMU), mask=m_kv)
        tl.store(p_u, round_to(b_v, DT, EMU), mask=m_u)
        b_S = b_S * tl.exp(b_Gl) + _dot(tl.trans(b_kd), b_v, DT, PREC, EMU)
    tl.store(hT + i_bh64 * DK * DV + p_S, b_S, mask=m_kv)


@triton.jit
def _gdn_output_kernel(
    q, k, g, vn, hs, o,
    T, NT, HV, GROUP, NV, scale,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_gb, s_gt, s_gh,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    L2NORM: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr, EPS: tl.constexpr,
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
    b_o = _chunk_output(b_q, b_k, b_G, b_S, b_v, o_c, DT, PREC, EMU)
    p_o = o + ((i_b64 * T + o_t[:, None]) * HV + i_h) * DV + o_v[None, :]
    tl.store(p_o, round_to(b_o, o.dtype.element_ty, EMU), mask=m_u)
