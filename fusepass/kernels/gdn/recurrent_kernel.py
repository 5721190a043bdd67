"""The recurrent kernel: the token loop with the state in registers (decode, short T)."""

from __future__ import annotations

import triton
import triton.language as tl

from fusepass.kernels._common import pdl_begin, round_to, scalar_fp32


@triton.jit
def _gdn_recurrent_kernel(
    q, k, v, g, beta, h0, o, hT,
    T, HV, GROUP, NV, scale,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_gb, s_gt, s_gh, s_bb, s_bt, s_bh,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    L2NORM: tl.constexpr, HAS_H0: tl.constexpr, EMU: tl.constexpr, EPS: tl.constexpr,
    RISING_ONLY: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_begin(PDL)  # (a PDL launch: nothing is read before it)
    # One program per (b, h, d_v block): the [DK, BV] state slice is read
    # once, lives in registers across the T tokens, and is written once.
    # RISING_ONLY (after the chunked kernels): only a head with some g > 0 is
    # this launch's; the others keep what the chunked kernels wrote.
    i_p = tl.program_id(0)
    i_v, i_bh = i_p % NV, i_p // NV
    i_b, i_h = i_bh // HV, i_bh % HV
    i_b64, i_bh64 = i_b.to(tl.int64), i_bh.to(tl.int64)
    scale = scalar_fp32(scale, False)  # (Inductor passes it fp64: q's tiles would be scaled in fp64)
    p_g = g + i_b64 * s_gb + i_h * s_gh
    if RISING_ONLY:
        # 1024 gates per load: few dependent round trips at long T.
        o_t = tl.arange(0, 1024)
        b_m = tl.full([1024], float("-inf"), tl.float32)
        for t0 in range(0, T, 1024):
            b_g = tl.load(p_g + (t0 + o_t).to(tl.int64) * s_gt, mask=t0 + o_t < T, other=float("-inf"))
            b_m = tl.maximum(b_m, b_g.to(tl.float32))
        if tl.max(b_m, 0) <= 0:
            return
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
        tl.store(p_o, round_to(b_o, o.dtype.element_ty, EMU), mask=m_v)
        # pointers step in 64 bits: no T x stride product to overflow
        p_q += s_qt
        p_k += s_kt
        p_v += s_vt
        p_g += s_gt
        p_b += s_bt
        p_o += HV * DV
    tl.store(hT + i_bh64 * DK * DV + p_S, b_S, mask=m_kv)
