"""The experts' decode path: few tokens, each active expert's weights streamed once.

Two launches, no routing step before them:

1. ``_moe_decode_up_kernel``, a program per (slot, block of BN intermediate
   columns), a slot being one (token, choice) pair of the T * k.  The slot
   reads all T * k expert ids (a few hundred bytes) and goes on only if it is
   the first slot of its expert: that program gathers every slot routed to
   the expert (their tokens' rows of x, BM at a time) and multiplies them into
   the expert's gate and up rows, loaded once; the others return at once.  So
   an expert chosen by several tokens is read once, and one no token chose
   costs nothing.  Epilogue: the activation with the models' roundings,
   stored per slot into h [T * k, I].
2. ``_moe_decode_down_kernel``, a program per (token, block of BN output
   columns): for each of the token's k experts, h's row times the expert's
   down rows, rounded, biased, times the routing weight, summed in fp32 in
   registers and stored once: the sum over experts is the epilogue, with no
   atomics and no third launch.  An expert shared by two tokens is read by
   two programs with adjacent ids (token is the fastest grid axis), the
   second read served from L2.

Both kernels multiply with fp32 FMAs on register tiles (a GEMV: one to a few
rows per weight tile), the products accumulated elementwise and reduced
across K once at the end, or (``defer=False``) every tile, which takes fewer
registers for deeper tiles.  Triton does not pipeline a loop without
``tl.dot``: with ``ahead`` / ``ahead2`` a program issues the next K tile's
loads before this tile's products (two tiles in flight, carried in
registers) instead of waiting a round trip a tile; with ``whole2`` the int4
down loop issues every K tile's loads before its first sum.  Weight tiles are laid out with the dim that is
contiguous in memory fastest ([BN, BK] for [E, N, K] weights, [BK, BN] for
gpt-oss's [E, K, N]), so every weight load is a 16-byte vector
(``python -m fusepass.bench.registry.moe --ptx`` checks the PTX for sm90).
int4 experts (``VB > 0``) are read a row at a time in chunks of VB bytes
inside one group (``_tiles.int4_chunks``), x's or h's values as pairs in
words of the codes' shape, so the pairs and the codes share one layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from fusepass.kernels._common import Launch, cdiv, interpreting, pdl_on, pdl_release, pdl_wait
from fusepass.kernels.dequant_matmul.counters import _split_counters
from fusepass.kernels.dequant_matmul.tiles import _chunk_sums, _int4_minus_loaded_zero, _pair_to_f32
from fusepass.kernels.moe import _tiles
from fusepass.kernels.moe._tiles import (
    _round_if,
    _to,
    cdiv_pow2,
    gated_act,
    int4_chunk_loads,
    int4_chunks,
    proj_epilogue,
    row_scale,
    split_pairs,
    w_tile,
    x_pair_words,
    x_pairs,
)


@triton.jit
def _fma(b_w, b_x, DEFER: tl.constexpr, TRANS: tl.constexpr):
    """Partial sums of one weight tile times x rows [BM, BK]: [BM, rows, BK]
    from a [rows, BK] tile, [BM, BK, rows] from a TRANS [BK, rows] one; summed
    over K to [BM, rows] unless DEFER."""
    if TRANS:
        b_p = b_w.to(tl.float32)[None, :, :] * b_x[:, :, None]
        return b_p if DEFER else tl.sum(b_p, axis=1)
    else:
        b_p = b_w.to(tl.float32)[None, :, :] * b_x[:, None, :]
        return b_p if DEFER else tl.sum(b_p, axis=2)


@triton.jit
def _up_loads(p_x, m_m, p_w, p_s, p_z, o_g, o_u, m_g, k0, K, stride_wn, stride_sn, stride_wk, FMT: tl.constexpr,
              G: tl.constexpr, HAS_ZERO: tl.constexpr, BK: tl.constexpr, TRANS: tl.constexpr, HALVES: tl.constexpr):
    """One K tile of gate_up's value-by-value loop, loaded for the look-ahead
    (AHEAD): x's rows [BM, BK] as stored, the gate rows' weight tile and the up
    rows' (the gate's again where gate and up are interleaved in one tile).
    The plain loop loads the same one tile at a time: the two tiles live at
    once took 112 -> 128 registers at its one-token tile (sm_90)."""
    o_k = k0 + tl.arange(0, BK)
    b_x = tl.load(p_x + o_k[None, :], mask=m_m[:, None] & (o_k < K)[None, :], other=0)
    b_wg = w_tile(p_w + o_g * stride_wn, m_g, p_s + o_g * stride_sn, p_z + o_g * stride_sn, k0, K, stride_wk, FMT,
                  G, HAS_ZERO, BK, TRANS)
    if HALVES:
        b_wu = w_tile(p_w + o_u * stride_wn, m_g, p_s + o_u * stride_sn, p_z + o_u * stride_sn, k0, K, stride_wk, FMT,
                      G, HAS_ZERO, BK, TRANS)
    else:
        b_wu = b_wg
    return b_x, b_wg, b_wu


@triton.jit
def _moe_decode_up_kernel(
    x, x2, ids, w, bias, scale, zero, h,
    S, E, K, I, TOPK,
    stride_xm, stride_x2m, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_be, stride_hm,
    ACT: tl.constexpr, HALVES: tl.constexpr, FMT: tl.constexpr, G: tl.constexpr,
    HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
    BS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DEFER: tl.constexpr,
    TRANS: tl.constexpr, VB: tl.constexpr = 0, ASM: tl.constexpr = False, PDL: tl.constexpr = False,
    AHEAD: tl.constexpr = False,
):
    # VB > 0: int4 read in chunks of VB bytes (_tiles.int4_chunks), x one row
    # at a time as pairs (x2: x viewed as int32 / int64 words, row stride stride_x2m).
    pdl_wait(PDL)
    pdl_release(PDL)
    DT: tl.constexpr = x.dtype.element_ty
    ZERO_F32: tl.constexpr = HAS_ZERO and zero.dtype.element_ty == tl.float32
    i_s, i_n = tl.program_id(0), tl.program_id(1)
    o_s = tl.arange(0, BS)
    m_s = o_s < S
    b_ids = tl.load(ids + o_s, mask=m_s, other=-1).to(tl.int32)
    e = tl.load(ids + i_s).to(tl.int32)
    match = (b_ids == e) & m_s
    first = tl.min(tl.where(match, o_s, BS), axis=0)
    if (e >= 0) & (e < E) & (first == i_s):
        cnt = tl.sum(match.to(tl.int32), axis=0)
        rank = tl.cumsum(match.to(tl.int32), axis=0) - 1
        e64 = e.to(tl.int64)
        p_w = w + e64 * stride_we
        p_s = scale + e64 * stride_se
        p_z = zero + e64 * stride_se
        p_b = bias + e64 * stride_be
        # Gate and up rows: two blocks of BN (halves), or 2 BN adjacent rows
        # (interleaved: one contiguous tile, split once in the epilogue).
        if HALVES:
            o_g = i_n * BN + tl.arange(0, BN)
            m_g = o_g < I
            o_u = o_g + I
        else:
            o_g = 2 * i_n * BN + tl.arange(0, 2 * BN)
            m_g = o_g < 2 * I
            o_u = o_g
        o_m = tl.arange(0, BM)
        for m0 in range(0, cnt, BM):
            # Rows m0 .. m0 + BM of this expert's slots, in slot order.
            sel = match[None, :] & (rank[None, :] == (m0 + o_m)[:, None])  # [BM, BS]
            b_slot = tl.sum(tl.where(sel, o_s[None, :], 0), axis=1)
            m_m = (m0 + o_m) < cnt
            p_x = x + (b_slot // TOPK).to(tl.int64)[:, None] * stride_xm
            # DEFER: products summed elementwise, reduced across K once at the
            # end (BM * rows * BK registers); else reduced every tile.  int4
            # chunks: one partial sum per chunk, reduced at the end.
            NCH: tl.constexpr = BK // (2 * VB) if VB > 0 else 1
            KD: tl.constexpr = NCH if VB > 0 else (BK if DEFER else 1)
            RG: tl.constexpr = o_g.shape[0]
            RU: tl.constexpr = BN if HALVES else 1
            # Summed every tile, the sums are [BM, rows]: a [BM, rows, 1]
            # accumulator's layout (K within one thread) was propagated back to
            # the product by Triton 3.6, 1024 values a thread, spilling (sm_90).
            ACC3: tl.constexpr = DEFER or VB > 0
            if ACC3:
                acc_g = tl.zeros([BM, KD, RG] if TRANS else [BM, RG, KD], dtype=tl.float32)
                acc_u = tl.zeros([BM, KD, RU] if TRANS else [BM, RU, KD], dtype=tl.float32)
            else:
                acc_g = tl.zeros([BM, RG], dtype=tl.float32)
                acc_u = tl.zeros([BM, RU], dtype=tl.float32)
            if VB > 0:
                # Rows one at a time, each a [1, NCH, VB] tile of the shape of x's
                # pairs, so Triton gives both one layout (a [rows, NCH, VB] tile
                # against x's [NCH, VB] took a shared-memory round trip and
                # shuffles per value, sm_90); the sums land in acc's (m, row)
                # registers through wheres that fold away.
                o_1 = tl.zeros([1], dtype=tl.int32)
                o_r = tl.arange(0, RG)[None, :, None]
                b_row = b_slot // TOPK
                NROWS = I if HALVES else 2 * I
                p_x1 = x2 + (tl.sum(b_row, axis=0) + o_1).to(tl.int64) * stride_x2m  # (BM 1: the one row)
                for k0 in range(0, K, BK):
                    if BM == 1:
                        b_xe, b_xo = x_pairs(p_x1, o_1 < cnt - m0, k0, K, DT, VB, NCH)
                    for r in tl.static_range(RG):
                        # rows past the projection read its last row (never stored)
                        n = tl.minimum((i_n * BN if HALVES else 2 * i_n * BN) + r, NROWS - 1) + o_1
                        b_ge, b_go, b_gs = int4_chunks(p_w + n * stride_wn, o_1 == 0, p_s + n * stride_sn,
                                                       p_z + n * stride_sn, k0, K, G, HAS_ZERO, ZERO_F32, VB, NCH, ASM)
                        if HALVES:
                            b_ue, b_uo, b_us = int4_chunks(p_w + (n + I) * stride_wn, o_1 == 0,
                                                           p_s + (n + I) * stride_sn, p_z + (n + I) * stride_sn, k0,
                                                           K, G, HAS_ZERO, ZERO_F32, VB, NCH, ASM)
                        for m in tl.static_range(BM):
                            if BM > 1:  # x's row m (rows past the expert's count are never stored)
                                r_m = tl.sum(tl.where(o_m == m, b_row, 0), axis=0) + o_1
                                b_xe, b_xo = x_pairs(x2 + r_m.to(tl.int64) * stride_x2m, o_1 < cnt - m0 - m, k0, K,
                                                     DT, VB, NCH)
                            at = (o_m[:, None, None] == m) & (o_r == r)
                            acc_g += tl.where(at, _chunk_sums(b_ge, b_go, b_gs, b_xe, b_xo)[None, :, :], 0.0)
                            if HALVES:
                                acc_u += tl.where(at, _chunk_sums(b_ue, b_uo, b_us, b_xe, b_xo)[None, :, :], 0.0)
            elif AHEAD:  # the next K tile's loads before this one's products (the down kernel's AHEAD)
                cur = _up_loads(p_x, m_m, p_w, p_s, p_z, o_g, o_u, m_g, tl.full([], 0, tl.int32), K, stride_wn,
                                stride_sn, stride_wk, FMT, G, HAS_ZERO, BK, TRANS, HALVES)
                for k0 in range(0, K, BK):
                    nxt = _up_loads(p_x, m_m, p_w, p_s, p_z, o_g, o_u, m_g, k0 + BK, K, stride_wn, stride_sn,
                                    stride_wk, FMT, G, HAS_ZERO, BK, TRANS, HALVES)
                    b_x, b_wg, b_wu = cur
                    b_x = b_x.to(tl.float32)
                    acc_g += _fma(b_wg, b_x, DEFER, TRANS)
                    if HALVES:
                        acc_u += _fma(b_wu, b_x, DEFER, TRANS)
                    cur = nxt
            else:
                for k0 in range(0, K, BK):
                    o_k = k0 + tl.arange(0, BK)
                    # [BM, BK]
                    b_x = tl.load(p_x + o_k[None, :], mask=m_m[:, None] & (o_k < K)[None, :], other=0).to(tl.float32)
                    b_w = w_tile(p_w + o_g * stride_wn, m_g, p_s + o_g * stride_sn, p_z + o_g * stride_sn, k0, K,
                                 stride_wk, FMT, G, HAS_ZERO, BK, TRANS)
                    acc_g += _fma(b_w, b_x, DEFER, TRANS)
                    if HALVES:
                        b_w = w_tile(p_w + o_u * stride_wn, m_g, p_s + o_u * stride_sn, p_z + o_u * stride_sn, k0, K,
                                     stride_wk, FMT, G, HAS_ZERO, BK, TRANS)
                        acc_u += _fma(b_w, b_x, DEFER, TRANS)
            KAX: tl.constexpr = 1 if TRANS else 2
            if ACC3:
                s_g, s_u = tl.sum(acc_g, axis=KAX), tl.sum(acc_u, axis=KAX)
            else:
                s_g, s_u = acc_g, acc_u
            b_g = proj_epilogue(s_g, row_scale(p_s + o_g * stride_sn, m_g, FMT)[None, :],
                                p_b + o_g[None, :], m_g[None, :], DT, HAS_BIAS)
            if HALVES:
                b_u = proj_epilogue(s_u, row_scale(p_s + o_u * stride_sn, m_g, FMT)[None, :],
                                    p_b + o_u[None, :], m_g[None, :], DT, HAS_BIAS)
            else:
                b_g, b_u = split_pairs(b_g)
            b_h = gated_act(b_g, b_u, DT, ACT, ALPHA, LIMIT)
            o_n = i_n * BN + tl.arange(0, BN)
            tl.store(h + b_slot.to(tl.int64)[:, None] * stride_hm + o_n[None, :], _to(b_h, DT),
                     mask=m_m[:, None] & (o_n < I)[None, :])


@triton.jit
def _down_loads(p_h, v_j, p_w, m_r, p_s, p_z, k0, k_hi, stride_wk, FMT: tl.constexpr, G: tl.constexpr,
                HAS_ZERO: tl.constexpr, BK: tl.constexpr, TRANS: tl.constexpr):
    """One K tile of the down kernel's value-by-value loop, loaded for the
    look-ahead: h's rows of the token's experts [KP, BK] as stored and their
    weight tile [KP, BN, BK] ([KP, BK, BN] with TRANS)."""
    o_k = k0 + tl.arange(0, BK)
    b_h = tl.load(p_h[:, None] + o_k[None, :], mask=v_j[:, None] & (o_k < k_hi)[None, :], other=0)
    return b_h, w_tile(p_w, m_r, p_s, p_z, k0, k_hi, stride_wk, FMT, G, HAS_ZERO, BK, TRANS)


@triton.jit
def _int4_down_loads(p_h2, v_j, p_we, p_se, p_ze, k0, K, N, i_n, stride_wn, stride_sn, G: tl.constexpr,
                     HAS_ZERO: tl.constexpr, VB: tl.constexpr, NCH: tl.constexpr, BN: tl.constexpr):
    """One K tile of the int4 down loop, loaded: h's pair words and, per output
    row, the k experts' chunks (bytes, scales, zero points) as a tuple of BN."""
    b_hw = x_pair_words(p_h2, v_j, k0, K, VB, NCH)
    rows = ()
    for r in tl.static_range(BN):
        n = tl.minimum(i_n * BN + r, N - 1)  # rows past N read row N - 1 (never stored)
        rows = rows + (int4_chunk_loads(p_we + n * stride_wn, v_j, p_se + n * stride_sn, p_ze + n * stride_sn, k0,
                                        K, G, HAS_ZERO, VB, NCH),)
    return b_hw, rows


@triton.jit
def _int4_down_sums(acc, b_hw, rows, o_r, HDT: tl.constexpr, HAS_ZERO: tl.constexpr, ZERO_F32: tl.constexpr,
                    ASM: tl.constexpr, BN: tl.constexpr):
    """acc [KP, BN, NCH] plus one loaded K tile's chunk sums (``_int4_down_loads``' h
    words and rows), row r into acc's column r."""
    b_he, b_ho = _pair_to_f32(b_hw, HDT)
    for r in tl.static_range(BN):
        b_q, b_s, b_z = rows[r]
        b_qe, b_qo = _int4_minus_loaded_zero(b_q, b_z, HAS_ZERO, ZERO_F32, ASM)
        acc += tl.where(o_r == r, _chunk_sums(b_qe, b_qo, b_s, b_he, b_ho)[:, None, :], 0.0)
    return acc


@triton.jit
def _down_finish(s, b_tw, p_s, p_b, m_r, m_n, p_o, DT: tl.constexpr, ROUND_W: tl.constexpr, FMT: tl.constexpr,
                 HAS_BIAS: tl.constexpr):
    """The k experts' sums [KP, BN] -> each rounded as the expert's output, times
    its routing weight, summed over the experts in fp32, stored once."""
    b_d = proj_epilogue(s, row_scale(p_s, m_r, FMT), p_b, m_r, DT, HAS_BIAS)
    b_y = tl.where(m_r, _round_if(b_d * b_tw[:, None], DT, ROUND_W), 0.0)
    tl.store(p_o, _to(tl.sum(b_y, axis=0), DT), mask=m_n)


@triton.jit
def _moe_decode_down_kernel(
    h, h2, ids, tw, w, bias, scale, zero, out, part, ctr,
    E, K, N, TOPK, K_SPLIT,
    stride_hm, stride_h2m, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_be, stride_om,
    ROUND_W: tl.constexpr, FMT: tl.constexpr, G: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr,
    KP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DEFER: tl.constexpr, TRANS: tl.constexpr,
    VB: tl.constexpr = 0, ASM: tl.constexpr = False, PDL: tl.constexpr = False, SPLIT: tl.constexpr = False,
    DOT: tl.constexpr = False, KE: tl.constexpr = 1, EMU: tl.constexpr = False, AHEAD: tl.constexpr = False,
    KT: tl.constexpr = 0,
):
    # The token's KP (>= k) experts at once: [KP, BN, BK] weight tiles, so
    # each program keeps k times the bytes of one expert's tile in flight.
    # PDL: the ids and the routing weights are read before the wait for the
    # gate_up kernel, which releases only after its own wait (``_common.pdl_wait``).
    # An L2 prefetch of the program's weight rows there (or of the down rows by
    # the gate_up programs) ran slower: Qwen3-30B-A3B block at T = 1, H200,
    # 38.0 and 38.5 against 37.0 µs, at T = 4 174 against 163.
    # SPLIT: program (i_t, i_n, i_s) sums K in [i_s K_SPLIT, +K_SPLIT) (whole
    # tiles of BK, so int4 chunks stay whole), its [KP, BN] fp32 sums go to
    # part [n_split, T, KP, N], and the tile's last program to arrive (its
    # count at ctr) adds the slices in slice order and finishes
    # (dequant_matmul's split-K pattern, tiles._finish): more
    # programs where one token's N / BN tiles are few (gpt-oss's [E, K, N] down
    # weight: 360 programs of 8 columns, 16 bytes of a row each, without it).
    # DOT: 16-bit [E, K, N] weights through tl.dot, whose loads Triton pipelines
    # (the FMA loop's are not): h's [KP, BK] tile, KP >= 16 rows (an MMA's least)
    # of which the first KE are the token's k experts, times each expert's
    # [BK, BN] tile with the other rows zeroed, into one [KP, BN] accumulator:
    # row j is expert j's sum, as the FMA path's.  16x the FLOPs of a GEMV,
    # still far under the tensor cores' rate at these sizes.
    # KT (int4 chunks, KT * BK >= the slice's K): the loop unrolled over KT
    # tiles, every tile's loads issued before any tile's sums, so a program's
    # whole slice is one memory round trip (tiles past K masked off).  ptxas
    # keeps that order only in part (Triton 3.6, sm_90 SASS, KP 8, K 768): at
    # 4 rows on 4 warps every weight, scale and zero load comes before the
    # first wait and h's pair words of the tiles after the first are sunk to
    # their tile's sums; 4 x 128 on 2 warps sinks the last two tiles' codes too.
    DT: tl.constexpr = out.dtype.element_ty
    i_t, i_n = tl.program_id(0), tl.program_id(1)
    if SPLIT:
        k_lo = tl.program_id(2) * K_SPLIT
        k_hi = tl.minimum(k_lo + K_SPLIT, K)
    else:
        k_lo = 0
        k_hi = K
    o_j = tl.arange(0, KP)
    o_s = i_t * TOPK + o_j
    b_e = tl.load(ids + o_s, mask=o_j < TOPK, other=-1, cache_modifier=".cg").to(tl.int32)
    v_j = (o_j < TOPK) & (b_e >= 0) & (b_e < E)
    e64 = tl.where(v_j, b_e, 0).to(tl.int64)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < N
    m_r = v_j[:, None] & m_n[None, :]  # [KP, BN]
    p_w = w + e64[:, None] * stride_we + o_n[None, :] * stride_wn
    b_tw = tl.load(tw + o_s, mask=v_j, other=0, cache_modifier=".cg").to(tl.float32)
    pdl_wait(PDL)
    p_s = scale + e64[:, None] * stride_se + o_n[None, :] * stride_sn
    p_z = zero + e64[:, None] * stride_se + o_n[None, :] * stride_sn
    p_h = h + o_s.to(tl.int64) * stride_hm
    NCH: tl.constexpr = BK // (2 * VB) if VB > 0 else 1
    KD: tl.constexpr = NCH if VB > 0 else (BK if DEFER else 1)
    KAX: tl.constexpr = 1 if TRANS else 2
    acc = tl.zeros([KP, KD, BN] if TRANS else [KP, BN, KD], dtype=tl.float32)
    if DOT:
        acc_d = tl.zeros([KP, BN], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BK):
            o_k = k0 + tl.arange(0, BK)
            m_k = o_k < k_hi
            b_h = tl.load(p_h[:, None] + o_k[None, :], mask=v_j[:, None] & m_k[None, :], other=0)
            for j in tl.static_range(KE):
                e_j = tl.sum(tl.where(o_j == j, e64, 0), axis=0)
                # N, or 0 for an id outside [0, E) (a comparison: the interpreter's
                # int1 & a reduced int1 scalar came out int32, refused as a mask)
                n_j = tl.where(tl.sum(tl.where(o_j == j, v_j.to(tl.int32), 0), axis=0) > 0, N, 0)
                b_w = tl.load(w + e_j * stride_we + o_k[:, None] * stride_wk + o_n[None, :] * stride_wn,
                              mask=m_k[:, None] & (o_n < n_j)[None, :], other=0)
                b_hj = tl.where(o_j[:, None] == j, b_h, 0)
                if EMU:  # the interpreter's bf16 dot multiplies raw bits (Triton 3.9): the same sums in fp32
                    acc_d += tl.dot(b_hj.to(tl.float32), b_w.to(tl.float32), input_precision="ieee")
                else:
                    acc_d = tl.dot(b_hj, b_w, acc_d)
        s = acc_d
    elif VB > 0:
        # int4 in chunks, as the gate_up kernel: output rows one at a time, each
        # a [KP, NCH, VB] tile of the k experts, the shape of h's pairs.
        ZERO_F32: tl.constexpr = HAS_ZERO and zero.dtype.element_ty == tl.float32
        o_r = tl.arange(0, BN)[None, :, None]
        p_we = w + e64 * stride_we
        p_se = scale + e64 * stride_se
        p_ze = zero + e64 * stride_se
        p_h2 = h2 + o_s.to(tl.int64) * stride_h2m
        if KT > 0:  # every tile's bytes loaded before the first sum (tiles carried as a tuple)
            k_0 = k_lo + tl.full([], 0, tl.int32)  # (a tensor: tl.multiple_of takes no constexpr)
            tiles = ()
            for t in tl.static_range(KT):
                tiles = tiles + (_int4_down_loads(p_h2, v_j, p_we, p_se, p_ze, k_0 + t * BK, k_hi, N, i_n, stride_wn,
                                                  stride_sn, G, HAS_ZERO, VB, NCH, BN),)
            for t in tl.static_range(KT):
                b_hw, rows = tiles[t]
                acc = _int4_down_sums(acc, b_hw, rows, o_r, h.dtype.element_ty, HAS_ZERO, ZERO_F32, ASM, BN)
        elif AHEAD:  # the next tile's bytes loaded before this tile's sums (rows carried as a tuple)
            k_0 = k_lo + tl.full([], 0, tl.int32)  # (a tensor: tl.multiple_of takes no constexpr)
            b_hw, rows = _int4_down_loads(p_h2, v_j, p_we, p_se, p_ze, k_0, k_hi, N, i_n, stride_wn, stride_sn, G,
                                          HAS_ZERO, VB, NCH, BN)
            for k0 in range(k_lo, k_hi, BK):
                b_hwn, rows_n = _int4_down_loads(p_h2, v_j, p_we, p_se, p_ze, k0 + BK, k_hi, N, i_n, stride_wn,
                                                 stride_sn, G, HAS_ZERO, VB, NCH, BN)
                acc = _int4_down_sums(acc, b_hw, rows, o_r, h.dtype.element_ty, HAS_ZERO, ZERO_F32, ASM, BN)
                b_hw, rows = b_hwn, rows_n
        else:
            for k0 in range(k_lo, k_hi, BK):
                b_he, b_ho = x_pairs(p_h2, v_j, k0, k_hi, h.dtype.element_ty, VB, NCH)
                for r in tl.static_range(BN):
                    n = tl.minimum(i_n * BN + r, N - 1)  # rows past N read row N - 1 (never stored)
                    b_qe, b_qo, b_s = int4_chunks(p_we + n * stride_wn, v_j, p_se + n * stride_sn,
                                                  p_ze + n * stride_sn, k0, k_hi, G, HAS_ZERO, ZERO_F32, VB, NCH,
                                                  ASM)
                    acc += tl.where(o_r == r, _chunk_sums(b_qe, b_qo, b_s, b_he, b_ho)[:, None, :], 0.0)
    elif AHEAD:
        # The next K tile's loads issued before this tile's products (carried
        # in registers): two tiles' bytes in flight a program instead of one
        # round trip a tile.  Past k_hi the loads are masked off.
        cur = _down_loads(p_h, v_j, p_w, m_r, p_s, p_z, k_lo + tl.full([], 0, tl.int32), k_hi, stride_wk, FMT, G,
                          HAS_ZERO, BK, TRANS)
        for k0 in range(k_lo, k_hi, BK):
            nxt = _down_loads(p_h, v_j, p_w, m_r, p_s, p_z, k0 + BK, k_hi, stride_wk, FMT, G, HAS_ZERO, BK, TRANS)
            b_h, b_w = cur
            b_h = b_h.to(tl.float32)
            b_p = b_w.to(tl.float32) * (b_h[:, :, None] if TRANS else b_h[:, None, :])
            acc += b_p if DEFER else tl.expand_dims(tl.sum(b_p, axis=KAX), KAX)
            cur = nxt
    else:
        for k0 in range(k_lo, k_hi, BK):
            o_k = k0 + tl.arange(0, BK)
            b_h = tl.load(p_h[:, None] + o_k[None, :], mask=v_j[:, None] & (o_k < k_hi)[None, :],
                          other=0).to(tl.float32)
            # [KP, BN, BK], or [KP, BK, BN] (TRANS)
            b_w = w_tile(p_w, m_r, p_s, p_z, k0, k_hi, stride_wk, FMT, G, HAS_ZERO, BK, TRANS)
            b_p = b_w.to(tl.float32) * (b_h[:, :, None] if TRANS else b_h[:, None, :])
            acc += b_p if DEFER else tl.expand_dims(tl.sum(b_p, axis=KAX), KAX)
    if not DOT:
        s = tl.sum(acc, axis=KAX)
    p_b = bias + e64[:, None] * stride_be + o_n[None, :]
    p_o = out + i_t.to(tl.int64) * stride_om + o_n
    if SPLIT:
        n_s = tl.num_programs(2)
        o_p = (i_t * KP + o_j[:, None]).to(tl.int64) * N + o_n[None, :]  # [KP, BN] in one slice's [T, KP, N]
        slice_size = (tl.num_programs(0) * KP).to(tl.int64) * N
        tl.store(part + tl.program_id(2) * slice_size + o_p, s, mask=m_r)
        tl.debug_barrier()
        p_c = ctr + i_t * tl.num_programs(1) + i_n
        if tl.atomic_add(p_c, 1) == n_s - 1:  # acq_rel, gpu scope
            s = tl.load(part + o_p, mask=m_r, other=0, cache_modifier=".cg")
            for q in range(1, n_s):
                s += tl.load(part + q * slice_size + o_p, mask=m_r, other=0, cache_modifier=".cg")
            _down_finish(s, b_tw, p_s, p_b, m_r, m_n, p_o, DT, ROUND_W, FMT, HAS_BIAS)
            tl.atomic_xchg(p_c, 0)
    else:
        _down_finish(s, b_tw, p_s, p_b, m_r, m_n, p_o, DT, ROUND_W, FMT, HAS_BIAS)


# ----------------------------------------------------------------- launch ----


@dataclass(frozen=True)
class DecodeConfig:
    """Tiles of the decode path: gate_up (BM rows, BN columns, BK deep), down (BN2, BK2)."""

    BM: int = 1
    BN: int = 16
    BK: int = 256
    warps: int = 4
    BN2: int = 16
    BK2: int = 256
    warps2: int = 4
    defer: bool = True  # gate_up: reduce across K at the end (else every tile)
    defer2: bool = True
    pdl: bool = False  # both launches with programmatic dependent launch (``_common.pdl_wait``)
    split2: int = 1  # down: K (the intermediate dim) over this many programs a tile
    dot2: bool = False  # down on the tensor cores (16-bit [E, K, N] weights only; else the FMA loop)
    stages2: int | None = None  # the down launch's pipeline stages (tl.dot's loads; Triton's default if None)
    # gate_up / down: the next K tile loaded before this one's products (plain,
    # int8 and fp8 value-by-value tiles, whose int4 form's scale loads are not
    # masked past K; int4's down chunk loop; gate_up's int4 loop has none: 22.8
    # against 14.1 µs for the experts, H200, 1fa26ad)
    ahead: bool = False
    ahead2: bool = False
    # down's int4 chunk loop unrolled over its whole K slice, every tile's loads
    # issued before the first sum (``KT``: one round trip a program, where the
    # look-ahead waits one a tile), in place of ``ahead2``; only for slices of
    # at most WHOLE_TILES tiles (else the loop as configured)
    whole2: bool = False


WHOLE_TILES = 16  # whole2's most tiles: they are all held in registers at once


DOT_TILE = 64  # the down kernel's tensor-core tile, [BK2, BN2]


def decode_heuristic(T: int, k: int, H: int, I: int, transposed: bool, n_sm: int, group: int,
                     dot: bool = False, plain16: bool = False) -> DecodeConfig:
    """Tiles for T tokens.  Products are summed elementwise and reduced across K
    once at the end (defer): on an H100 (fusepass.bench.registry.moe, commit 0890f1a,
    Qwen3-30B-A3B block at T = 1) that ran 36.4 µs in bf16 and 23.6 in int4,
    where reducing every tile (8 columns x 1024) ran 1448 and 1047 µs.  A tile
    holds 4096 fp32 partial products (BM x BN x BK; 32 registers a thread at 4
    warps).  down: the token's k experts at once, BN2 output columns, fewer
    until the grid has two programs an SM.

    Both launches with PDL for [E, N, K] weights (the down kernel's programs
    resident and its ids read while the gate_up kernel finishes): H200,
    Qwen3-30B-A3B block (benchmarks/moe_decode_launches.py, commit f70421a),
    router + experts at T = 1 / 4 35.6 / 161.7 µs against 37.0 / 162.9 in
    bf16, 22.0 / 78.0 against 23.3 / 79.0 in int4; gpt-oss-20b's transposed
    experts ran slower with it (125.2 / 331.8 against 121.8 / 330.1).

    ``dot``: the down weight is 16-bit [E, K, N] (``dot_down_fits``), read on
    the tensor cores in [64, 64] tiles, K split until the grid has ~2.7
    programs an SM, gate_up summed every 512-deep tile.  H200, gpt-oss-20b
    block at T = 1 (fusepass.bench.registry.moe, commit 9ffacd2): experts
    69.8 µs against 116.7 with the FMA loops (8 columns a down program, 16
    bytes of each row), 75.1 with gate_up deferred (the floor of their bytes
    ~72 at the copy rate, read + write counted).

    ``plain16`` (16-bit plain [E, N, K] weights) at one token: gate_up reads 4
    gate and 4 up rows whole (K up to 2048 a step, one 16-byte load per
    thread and row, 112 registers: four programs an SM with their 32 KB in
    flight), as linear_siblings' GEMV does.  H200, Qwen3-30B-A3B experts at
    T = 1 (fusepass.bench.registry.moe, 0edb38a and b938d84, two runs): 27.4
    and 27.5 µs against 29.8 for 16 x 256 tiles summed at the end; the down
    tiles tried beside it (1-4 rows, 256-1024 deep, summed each step or at
    the end) all lost to the 4 x 128 below.  That down tile loads the next
    K tile before this one's products (``ahead2``, two tiles in flight a
    program, 80 registers): 26.0 µs against 27.6 for the experts (H200,
    c8ddf0a sweep; the next-best look-ahead tiles 2 x 128 26.2, 4 x 256 on
    eight warps 26.8; gate_up's look-ahead at 512-1024 deep lost to its
    whole rows)."""
    pdl = not transposed
    BM = 1 if T == 1 else 2 if T <= 8 else 4
    if dot and transposed:
        split2 = max(1, min(8, cdiv(n_sm * 27 // 10, T * cdiv(H, DOT_TILE))))
        return DecodeConfig(BM=BM, BN=16, BK=min(512 // BM, cdiv_pow2(H)), warps=4, BN2=DOT_TILE, BK2=DOT_TILE,
                            warps2=4, defer=False, defer2=False, pdl=False, split2=split2, dot2=True, stages2=3)
    KP = cdiv_pow2(k)
    BN = 16
    BK = min(4096 // (BN * BM), cdiv_pow2(H))
    BN2 = 16
    while BN2 > 4 and T * cdiv(H, BN2) < 2 * n_sm:
        BN2 //= 2
    BK2 = min(max(16, 4096 // (KP * BN2)), cdiv_pow2(I))
    vb = chunk_bytes(group) if group and not transposed else 0
    if vb:
        # int4 in chunks of vb bytes, one per thread and row (with fewer chunks
        # than threads the loads repeat across them): 4 gate and 4 up rows of
        # 1024 codes a one-warp program; down: the k experts' 128-code chunks
        # of 2 rows (4.4 / 5.2 sm_90 SASS instructions a weight value against
        # 16 for the value-by-value tile).  H200, Qwen3-30B-A3B block at T = 1
        # (commit 9ba7c38): 16.0 µs for the experts against 21.2 with 8 + 8
        # rows and 24.3 with 8 + 8 rows of 2048 codes on two warps; down with
        # 128 codes on one warp against 256 on two, two sweeps (1714dd5,
        # 9e60a16): 15.4 and 16.1 µs against 16.5 and 16.7.
        # At one token down loads its whole K slice before its first sum
        # (whole2), 4 rows of 256-code tiles on two warps (one chunk a thread
        # and row at k = 8): H200, Qwen3-30B-A3B, the registry's int4 down
        # candidates (``sweep_int4``) three rounds in one process (2988c93):
        # 12.5-12.8 µs for the experts against 13.5-13.8 for the look-ahead's
        # 4 x 128 on two warps (the default before; 13.9 / 14.1 in earlier
        # sweeps), whole2 4 x 128 on two warps 13.1-13.2, 4 x 256 on four
        # 13.3-13.5, 2 rows 14.0-15.1.  Slices of more than WHOLE_TILES tiles
        # take the look-ahead.
        BK = min(cdiv_pow2(H), 1024)
        BK2 = min(cdiv_pow2(I), 128)
        warps = max(1, min(4, BK // (2 * vb) // 32))
        warps2 = max(1, min(4, KP * BK2 // (2 * vb) // 32))
        if T == 1:
            BK2 = min(cdiv_pow2(I), 256)
            warps2 = max(1, min(4, KP * BK2 // (2 * vb) // 32))
            return DecodeConfig(BM=1, BN=4, BK=BK, warps=warps, BN2=min(BN2, 4), BK2=BK2, warps2=warps2,
                                defer=False, defer2=False, pdl=pdl, ahead2=True, whole2=True)
        return DecodeConfig(BM=BM, BN=4, BK=BK, warps=warps, BN2=min(BN2, 2), BK2=BK2, warps2=warps2, defer=False,
                            defer2=False, pdl=pdl)
    if plain16 and T == 1 and not transposed:
        return DecodeConfig(BM=1, BN=4, BK=min(2048, cdiv_pow2(H)), warps=4, BN2=BN2, BK2=BK2, warps2=4,
                            defer=False, defer2=True, pdl=pdl, ahead2=True)
    return DecodeConfig(BM=BM, BN=BN, BK=BK, warps=4, BN2=BN2, BK2=BK2, warps2=4, defer=True, defer2=True, pdl=pdl)


def _strides(w: Tensor, transposed: bool) -> tuple[int, int]:
    """(stride_n, stride_k) of an expert's weight seen as [N, K]."""
    return (w.stride(2), w.stride(1)) if transposed else (w.stride(1), w.stride(2))


def launch_decode(x: Tensor, ids: Tensor, tw: Tensor, w1: Tensor, w2: Tensor, b1, b2, s1, z1, s2, z2,
                  activation: str, halves: bool, transposed: bool, fmt: str, group: int, alpha: float, limit: float,
                  cfg: DecodeConfig, out: Tensor, go=_tiles.ran) -> Tensor:
    """out [T, H] = the experts' sum, through the two decode kernels (``go``: run
    each launch now, or put it in the graph being traced).  Operands as the op
    checked them; ids and tw contiguous [T, k], x with unit column stride;
    quantized weights, scales and zeros contiguous."""
    T, H = x.shape
    k = ids.shape[1]
    S = T * k
    E = w1.shape[0]
    I = w1.shape[2 if transposed else 1] // 2
    h = _tiles.workspace((S, I), x.dtype, x.device)
    if fmt == "fp8":  # read as bytes and bitcast (a masked load's fill value cannot be cast to fp8)
        w1, w2 = w1.view(torch.uint8), w2.view(torch.uint8)
    dummy = x  # an unused pointer argument (never one a launch writes)
    vb1, vb2 = int4_chunk(fmt, transposed, group, cfg.BK), int4_chunk(fmt, transposed, group, cfg.BK2)
    asm = x.is_cuda and not interpreting()
    sn1, sk1 = _strides(w1, transposed)
    if vb1 and (x.stride(0) % 2 or x.storage_offset() % 2):  # (pairs need whole words)
        x = x.contiguous()
    x2 = pairs(x) if vb1 else x
    pdl = cfg.pdl and pdl_on(x)
    h = go(Launch(_moe_decode_up_kernel, (S, cdiv(I, cfg.BN)), dict(
        x=x, x2=x2, ids=ids, w=w1, bias=b1 if b1 is not None else dummy, scale=s1 if s1 is not None else dummy,
        zero=z1 if z1 is not None else dummy, h=h,
        S=S, E=E, K=H, I=I, TOPK=k,
        stride_xm=x.stride(0), stride_x2m=x2.stride(0), stride_we=w1.stride(0), stride_wn=sn1, stride_wk=sk1,
        stride_se=s1.stride(0) if s1 is not None else 0, stride_sn=s1.stride(1) if s1 is not None else 0,
        stride_be=b1.stride(0) if b1 is not None else 0, stride_hm=h.stride(0),
        ACT=activation, HALVES=halves, FMT=fmt, G=group, HAS_ZERO=z1 is not None, HAS_BIAS=b1 is not None,
        ALPHA=float(alpha), LIMIT=float(limit), BS=cdiv_pow2(S), BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, DEFER=cfg.defer,
        TRANS=transposed, VB=vb1, ASM=asm and vb1 >= 4, PDL=pdl, AHEAD=cfg.ahead and not vb1 and fmt != "int4"),
        ("h",), cfg.warps))["h"]
    sn2, sk2 = _strides(w2, transposed)
    h2 = pairs(h) if vb2 else h  # (of the launch's output: the traced form's h is a new tensor)
    dot = cfg.dot2 and dot_down_fits(x.dtype, w2.dtype, fmt, transposed, cfg.BN2, cfg.BK2)
    KP = max(16, cdiv_pow2(k)) if dot else cdiv_pow2(k)
    n_split, k_split, part, ctr = 1, I, dummy, dummy
    if cfg.split2 > 1 and I > 0:
        k_split = cdiv(cdiv(I, cfg.split2), cfg.BK2) * cfg.BK2
        n_split = cdiv(I, k_split)
    if n_split > 1:
        tiles = T * cdiv(H, cfg.BN2)
        # The traced form's counters are zeroed in the graph; the op's come from
        # the split-K pool (None in a capture without free ones: one program a tile).
        got = torch.zeros(tiles, dtype=torch.int32, device=x.device) if go is _tiles.traced else \
            _split_counters(x.device, tiles)
        if got is None:
            n_split, k_split = 1, I
        else:
            ctr, part = got, _tiles.workspace((n_split, T, KP, H), torch.float32, x.device)
    kt = cdiv(k_split, cfg.BK2) if cfg.whole2 and vb2 and not dot else 0
    kt = kt if kt <= WHOLE_TILES else 0
    return go(Launch(_moe_decode_down_kernel, (T, cdiv(H, cfg.BN2), n_split), dict(
        h=h, h2=h2, ids=ids, tw=tw, w=w2, bias=b2 if b2 is not None else dummy, scale=s2 if s2 is not None else dummy,
        zero=z2 if z2 is not None else dummy, out=out, part=part, ctr=ctr,
        E=E, K=I, N=H, TOPK=k, K_SPLIT=k_split,
        stride_hm=h.stride(0), stride_h2m=h2.stride(0), stride_we=w2.stride(0), stride_wn=sn2, stride_wk=sk2,
        stride_se=s2.stride(0) if s2 is not None else 0, stride_sn=s2.stride(1) if s2 is not None else 0,
        stride_be=b2.stride(0) if b2 is not None else 0, stride_om=out.stride(0),
        ROUND_W=round_w(x.dtype, tw.dtype), FMT=fmt, G=group, HAS_ZERO=z2 is not None, HAS_BIAS=b2 is not None,
        KP=KP, BN=cfg.BN2, BK=cfg.BK2, DEFER=cfg.defer2, TRANS=transposed, VB=vb2, ASM=asm and vb2 >= 4,
        PDL=pdl, SPLIT=n_split > 1, DOT=dot, KE=k if dot else 1, EMU=dot and interpreting(),
        AHEAD=cfg.ahead2 and not dot and not kt and (vb2 > 0 or fmt != "int4"), KT=kt), ("out",),
        cfg.warps2,
        num_stages=cfg.stages2 if dot else None))["out"]


def dot_down_fits(x_dtype: torch.dtype, w_dtype: torch.dtype, fmt: str, transposed: bool, BN: int = DOT_TILE,
                  BK: int = DOT_TILE) -> bool:
    """Whether the down kernel's tensor-core form (``DOT``) takes these operands:
    plain 16-bit weights of x's dtype stored [E, K, N] (fp32 would go through
    TF32), tiles (the heuristic's by default) of at least 16 x 16."""
    return (fmt == "none" and transposed and x_dtype == w_dtype and x_dtype in (torch.bfloat16, torch.float16)
            and BN >= 16 and BK >= 16)


def pairs(t: Tensor) -> Tensor:
    """[R, C] -> its pairs of adjacent values as one word each, [R, C / 2] (int32
    for 16-bit values, int64 for fp32): a view (C even, rows at even strides)."""
    return t.view(torch.int32 if t.element_size() == 2 else torch.int64)


def chunk_bytes(group: int) -> int:
    """Bytes per chunk of the int4 loop (``_tiles.int4_chunks``): the largest of
    16, 8, 4, 2, 1 that keeps a chunk's codes inside one group; 0 for an odd group."""
    if group % 2:
        return 0
    vb = 16
    while (group // 2) % vb:
        vb //= 2
    return vb


def int4_chunk(fmt: str, transposed: bool, group: int, BK: int) -> int:
    """``chunk_bytes`` where a launch's tile of BK codes is whole chunks of int4
    stored [E, N, K]; 0 where the tile is read value by value (``w_tile``)."""
    if fmt != "int4" or transposed:
        return 0
    vb = chunk_bytes(group)
    return vb if vb and BK % (2 * vb) == 0 else 0


def round_w(x_dtype: torch.dtype, w_dtype: torch.dtype) -> bool:
    """Whether expert output times routing weight rounds to x's dtype (the
    promoted dtype of the two is x's), or stays fp32 (Mixtral's fp32 weights)."""
    return torch.promote_types(x_dtype, w_dtype) == x_dtype
