"""The GEMV kernel: one to a few rows of x against a weight stream.

fusepass's own layouts (int4, int8, fp8) and three of the libraries' have a loop
of their own, reading each stored byte once with wide loads: HQQ's 4-bit
(``_hqq_gemv``: the two nibbles of a byte are two output rows) and GPTQ's
(``_gptq_gemv``: words of eight codes along K, read across N); the code
books' (NF4 / FP4) go through the int4 loop, each code a shuffle from the lane
holding its value.  An HQQ weight of odd N and a code book's block that is
not whole chunks go value by value (``tiles._library_tile``)."""

from __future__ import annotations

import triton
import triton.language as tl

from fusepass.kernels._common import pdl_begin, round_to
from fusepass.kernels.dequant_matmul.tiles import (
    _block_scales,
    _chunk_sums,
    _codebook_pair,
    _finish,
    _group,
    _int4_minus_zero,
    _int8_to_f32,
    _lane_table,
    _library_tile,
    _nibbles_128,
    _pair_to_f32,
    _word_128,
)
from fusepass.kernels.gated_act import gated


@triton.jit
def _hqq_gemv(x, w, scale, zero, bias, out, part, ctr, M, N, K, K_SPLIT, stride_xm, stride_sn,
              G: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, SUM_HERE: tl.constexpr,
              EVEN_K: tl.constexpr, ASM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # HQQ (axis=1, N even): group row r = n K / G + k // G, rows r < R / 2 in the
    # high nibbles of the [R / 2, G] bytes, the others in the low ones; so with
    # the bytes read flat (the launcher gives them contiguous), output row
    # n < N / 2 has its K codes in the high nibbles of bytes [n K, +K) and row
    # n + N / 2 in the low nibbles of the same bytes.  Program (i_n, i_s) owns
    # the BN pairs of rows (i_n BN + r, i_n BN + r + N / 2): each byte is read
    # once and both its nibbles used, the bytes per value of the int4 loop,
    # which this one follows (chunks of VB bytes inside one group, one vector
    # load, spread over the threads; the rows a static loop; the zero point
    # subtracted from each value in one FADD, the scale on a chunk's sum).
    # Here a byte pairs with one value of x, not two.
    i_n, i_s = tl.program_id(0), tl.program_id(1)
    H = N // 2
    VB: tl.constexpr = 16 if G % 16 == 0 else (8 if G % 8 == 0 else (4 if G % 4 == 0 else (2 if G % 2 == 0 else 1)))
    NCH: tl.constexpr = BK // VB
    o_c = tl.arange(0, NCH)
    o_b = o_c[:, None] * VB + tl.arange(0, VB)[None, :]  # [NCH, VB]: the tile's k
    o_m = tl.arange(0, BM)
    o_r = tl.arange(0, 2 * BN)  # acc's columns: the BN rows of the high nibbles, then their partners
    ZERO_F32: tl.constexpr = zero.dtype.element_ty == tl.float32
    k_lo = i_s * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    acc3 = tl.zeros([BM, 2 * BN, NCH], dtype=tl.float32)  # chunks last: spread over the threads
    for k0 in range(k_lo, k_hi, BK):
        kb = tl.multiple_of(k0, BK)  # k_lo and the step are whole tiles
        o_k = kb + o_c * VB  # [NCH]: each chunk's first k
        m_c = o_k < k_hi  # (a chunk never straddles the slice's end: K is whole groups)
        o_g = o_k // G
        if BM == 1:
            if EVEN_K:
                b_x = tl.load(x + kb + o_b).to(tl.float32)
            else:
                b_x = tl.load(x + kb + o_b, mask=m_c[:, None], other=0).to(tl.float32)
        for r in tl.static_range(BN):
            n = tl.minimum(i_n * BN + r, H - 1)  # pairs past N / 2 read the last one (never stored)
            p_q = w + n.to(tl.int64) * K + kb + o_b
            if EVEN_K:
                b_q = tl.load(p_q)
            else:
                b_q = tl.load(p_q, mask=m_c[:, None], other=0)
            p_hi = n * stride_sn + o_g  # [NCH]: row n's scale and zero point; row n + N / 2's below
            p_lo = p_hi + H * stride_sn
            b_s_hi = tl.load(scale + p_hi, mask=m_c, other=0).to(tl.float32)
            b_s_lo = tl.load(scale + p_lo, mask=m_c, other=0).to(tl.float32)
            b_lo, b_hi = _nibbles_128(b_q, ASM)
            if ZERO_F32:  # an fp32 zero point need not be a multiple of 2**-16 (see the int4 loop)
                b_hi = (b_hi - 128.0) - tl.load(zero + p_hi, mask=m_c, other=0)[:, None]
                b_lo = (b_lo - 128.0) - tl.load(zero + p_lo, mask=m_c, other=0)[:, None]
            else:
                b_hi = b_hi - (128.0 + tl.load(zero + p_hi, mask=m_c, other=0).to(tl.float32))[:, None]
                b_lo = b_lo - (128.0 + tl.load(zero + p_lo, mask=m_c, other=0).to(tl.float32))[:, None]
            for m in tl.static_range(BM):
                if BM > 1:
                    # Rows past M read row M - 1 (their sums are never stored): no row mask.
                    p_x = x + tl.minimum(m, M - 1) * stride_xm + kb + o_b
                    if EVEN_K:
                        b_x = tl.load(p_x).to(tl.float32)
                    else:
                        b_x = tl.load(p_x, mask=m_c[:, None], other=0).to(tl.float32)
                b_dh = tl.sum(b_hi * b_x, axis=1) * b_s_hi  # [NCH]
                b_dl = tl.sum(b_lo * b_x, axis=1) * b_s_lo
                # (the wheres fold away: each register's row and column are constants)
                acc3 += tl.where((o_m[:, None, None] == m) & (o_r[None, :, None] == r), b_dh[None, None, :], 0.0)
                acc3 += tl.where((o_m[:, None, None] == m) & (o_r[None, :, None] == BN + r), b_dl[None, None, :], 0.0)
    acc = tl.sum(acc3, axis=2)
    o_p = i_n * BN + o_r % BN  # the pair of each column of acc
    o_n = o_p + (o_r // BN) * H
    m_n = o_p < H
    m_o = (o_m[:, None] < M) & m_n[None, :]
    _finish(acc, out, part, bias + o_n[None, :], m_n[None, :], ctr + i_n, o_m[:, None] * N + o_n[None, :], m_o,
            i_s, tl.num_programs(1), M, N, HAS_BIAS, PARTIAL, SUM_HERE)


@triton.jit
def _gptq_dot8(b_0, b_1, b_2, b_3, b_4, b_5, b_6, b_7, x2, row, stride_x2m, o_kw, m_k, DT: tl.constexpr,
               EVEN_K: tl.constexpr):
    """sum_j b_j x[row, 8 o_kw + j] for the eight codes b_j ([SUB, BNW, 8]) of the word
    rows o_kw ([SUB]): x's eight values of a word row read as four pairs (x2)."""
    p_x = x2 + row * stride_x2m + 4 * o_kw
    if EVEN_K:
        b_x01, b_x23, b_x45, b_x67 = tl.load(p_x), tl.load(p_x + 1), tl.load(p_x + 2), tl.load(p_x + 3)
    else:
        b_x01 = tl.load(p_x, mask=m_k, other=0)
        b_x23 = tl.load(p_x + 1, mask=m_k, other=0)
        b_x45 = tl.load(p_x + 2, mask=m_k, other=0)
        b_x67 = tl.load(p_x + 3, mask=m_k, other=0)
    # one FMUL, then a chain of FMAs (a sum of pair products costs an FADD per pair more)
    b_xa, b_xb = _pair_to_f32(b_x01, DT)
    b_d = b_0 * b_xa[:, None, None]
    b_d += b_1 * b_xb[:, None, None]
    b_xa, b_xb = _pair_to_f32(b_x23, DT)
    b_d += b_2 * b_xa[:, None, None]
    b_d += b_3 * b_xb[:, None, None]
    b_xa, b_xb = _pair_to_f32(b_x45, DT)
    b_d += b_4 * b_xa[:, None, None]
    b_d += b_5 * b_xb[:, None, None]
    b_xa, b_xb = _pair_to_f32(b_x67, DT)
    b_d += b_6 * b_xa[:, None, None]
    b_d += b_7 * b_xb[:, None, None]
    return b_d


@triton.jit
def _gptq_rows(acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, b_0, b_1, b_2, b_3, b_4, b_5, b_6, b_7, b_s,
               x2, M, stride_x2m, o_kw, m_k, DT: tl.constexpr, EVEN_K: tl.constexpr, SCALED: tl.constexpr,
               BM: tl.constexpr):
    # One sum per row of x, each its own tensor: a [BM, SUB, BNW, 8] sum
    # updated with a where per row took a layout conversion through shared
    # memory per sub-tile (Triton's 4-D default layout is not the 3-D tile's
    # with a row added; sm_90: 16 barriers per tile at M = 1).  Rows past M
    # read row M - 1 (never stored).
    b_d = _gptq_dot8(b_0, b_1, b_2, b_3, b_4, b_5, b_6, b_7, x2, 0, stride_x2m, o_kw, m_k, DT, EVEN_K)
    acc0 += b_d * b_s if SCALED else b_d
    if BM > 1:
        b_d = _gptq_dot8(b_0, b_1, b_2, b_3, b_4, b_5, b_6, b_7, x2, tl.minimum(1, M - 1), stride_x2m, o_kw, m_k,
                         DT, EVEN_K)
        acc1 += b_d * b_s if SCALED else b_d
    if BM > 2:
        b_d = _gptq_dot8(b_0, b_1, b_2, b_3, b_4, b_5, b_6, b_7, x2, tl.minimum(2, M - 1), stride_x2m, o_kw, m_k,
                         DT, EVEN_K)
        acc2 += b_d * b_s if SCALED else b_d
        b_d = _gptq_dot8(b_0, b_1, b_2, b_3, b_4, b_5, b_6, b_7, x2, tl.minimum(3, M - 1), stride_x2m, o_kw, m_k,
                         DT, EVEN_K)
        acc3 += b_d * b_s if SCALED else b_d
    if BM > 4:
        b_d = _gptq_dot8(b_0, b_1, b_2, b_3, b_4, b_5, b_6, b_7, x2, tl.minimum(4, M - 1), stride_x2m, o_kw, m_k,
                         DT, EVEN_K)
        acc4 += b_d * b_s if SCALED else b_d
        b_d = _gptq_dot8(b_0, b_1, b_2, b_3, b_4, b_5, b_6, b_7, x2, tl.minimum(5, M - 1), stride_x2m, o_kw, m_k,
                         DT, EVEN_K)
        acc5 += b_d * b_s if SCALED else b_d
        b_d = _gptq_dot8(b_0, b_1, b_2, b_3, b_4, b_5, b_6, b_7, x2, tl.minimum(6, M - 1), stride_x2m, o_kw, m_k,
                         DT, EVEN_K)
        acc6 += b_d * b_s if SCALED else b_d
        b_d = _gptq_dot8(b_0, b_1, b_2, b_3, b_4, b_5, b_6, b_7, x2, tl.minimum(7, M - 1), stride_x2m, o_kw, m_k,
                         DT, EVEN_K)
        acc7 += b_d * b_s if SCALED else b_d
    return acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7


@triton.jit
def _gptq_code(b_wd, j: tl.constexpr, g_idx, shifts, scale, zero, b_sh, o_kw, m_k, o_n, m_n, o_w, m_w, NZW, NG,
               stride_sn, V1: tl.constexpr, EVEN_K: tl.constexpr):
    """(q - z) s of code j of the words b_wd [SUB, BNW, 8], each k's own group (g_idx)."""
    if EVEN_K:
        b_g = _group(tl.load(g_idx + 8 * o_kw + j), NG)
    else:
        b_g = _group(tl.load(g_idx + 8 * o_kw + j, mask=m_k, other=0), NG)
    b_s = tl.load(scale + b_g[:, None, None] * stride_sn + o_n[None, :, :], mask=m_n[None, :, :], other=0)
    b_zw = tl.load(zero + b_g[:, None] * NZW + o_w[None, :], mask=m_w[None, :], other=0)  # [SUB, BNW]
    b_z = (b_zw[:, :, None] >> b_sh[None, None, :]) & 0xF
    b_q = (b_wd >> tl.load(shifts + j)) & 0xF
    # q - z as fp32 without a conversion: 2**23 + 16 + q - z is a float's bits
    # (16 + q - z in [1, 31]); 2**23 + 16 (+ 1: v1's zero points are stored
    # minus one) comes off in one FADD.
    OFF: tl.constexpr = 8388625.0 if V1 else 8388624.0
    return (((b_q | 0x4B000010) - b_z).to(tl.float32, bitcast=True) - OFF) * b_s.to(tl.float32)


@triton.jit
def _gptq_gemv(x, x2, w, scale, zero, g_idx, shifts, bias, out, part, ctr, M, N, K, K_SPLIT, NG,
               stride_xm, stride_x2m, stride_wn, stride_sn, V1: tl.constexpr, HAS_BIAS: tl.constexpr,
               PARTIAL: tl.constexpr, SUM_HERE: tl.constexpr, EVEN_K: tl.constexpr, ASM: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # GPTQ: int32 words [K / 8, N], word (i, n) the codes of k = 8i .. 8i + 7 of
    # column n.  Program (i_n, i_s) owns BN columns, as [BNW, 8] (the columns of
    # BNW zero-point words), over a slice of K read in sub-tiles of SUB word
    # rows: [SUB, BNW, 8] words, one row per warp at four warps and 128
    # columns, each thread four adjacent words (one 16-byte load, coalesced
    # along N).  The sums stay per sub-tile row and are added across the
    # warps once, at the end.
    #
    # Two loops.  Where each word's eight codes share a group (GPTQ without
    # act-order: g_idx[k] = k // G, any G that is a multiple of 8) and the
    # codes sit at GPTQ's own bit offsets (shifts 0, 4, ..., 28), a word row
    # has one scale row and one zero-point word: the codes become 128 + q by
    # _word_128 (one PRMT per value on the GPU), minus 128 + z in one FADD,
    # one FMA with x, and the scale goes on the word's sum.  Anything else
    # (act-order: a group per k) takes each code's group from g_idx, its
    # scale and zero point with it, and reads the codes at the offsets the
    # layer's table gives.  Which loop runs is decided here, per program, from
    # the g_idx of its slice and the table: the host cannot look at them
    # without a sync.
    i_n, i_s = tl.program_id(0), tl.program_id(1)
    SUB: tl.constexpr = 4
    RW: tl.constexpr = BK // (8 * SUB)  # sub-tiles per tile
    BNW: tl.constexpr = BN // 8
    DT: tl.constexpr = x.dtype.element_ty
    NZW = (N + 7) // 8  # zero-point words per group
    o_s = tl.arange(0, SUB)
    o_e = tl.arange(0, 8)
    o_w = i_n * BNW + tl.arange(0, BNW)
    o_n = o_w[:, None] * 8 + o_e[None, :]  # [BNW, 8]: column 8 w + e, zero point e of word w
    m_n = o_n < N
    m_w = o_w < NZW
    k_lo = i_s * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)

    # The check waits for the slice's g_idx before any weight is read: in
    # blocks of 2048 (16 per thread at four warps), one round trip for every
    # slice of the Llama-3-8B shapes' plans.
    CB: tl.constexpr = 2048 if BK < 2048 else BK
    o_kk = tl.arange(0, CB)
    b_bad = tl.zeros([CB], dtype=tl.int32)
    for k0 in range(k_lo, k_hi, CB):
        m_kk = k0 + o_kk < k_hi
        b_g = _group(tl.load(g_idx + k0 + o_kk, mask=m_kk, other=0), NG)
        b_g0 = _group(tl.load(g_idx + k0 + (o_kk // 8) * 8, mask=m_kk, other=0), NG)
        b_bad |= (b_g != b_g0).to(tl.int32)
    b_sh = tl.load(shifts + o_e)  # [8]: the bit offset of code e in a word (zero points too)
    grouped = (tl.max(b_bad, axis=0) == 0) & (tl.max((b_sh != 4 * o_e).to(tl.int32), axis=0) == 0)

    acc0 = tl.zeros([SUB, BNW, 8], dtype=tl.float32)
    acc1 = tl.zeros([SUB, BNW, 8], dtype=tl.float32)
    acc2 = tl.zeros([SUB, BNW, 8], dtype=tl.float32)
    acc3 = tl.zeros([SUB, BNW, 8], dtype=tl.float32)
    acc4 = tl.zeros([SUB, BNW, 8], dtype=tl.float32)
    acc5 = tl.zeros([SUB, BNW, 8], dtype=tl.float32)
    acc6 = tl.zeros([SUB, BNW, 8], dtype=tl.float32)
    acc7 = tl.zeros([SUB, BNW, 8], dtype=tl.float32)
    if grouped:
        for k0 in range(k_lo, k_hi, BK):
            for t in tl.static_range(RW):
                o_kw = k0 // 8 + t * SUB + o_s  # [SUB] word rows
                m_k = 8 * o_kw < k_hi
                p_wd = w + o_kw.to(tl.int64)[:, None, None] * stride_wn + o_n[None, :, :]
                if EVEN_K:
                    b_wd = tl.load(p_wd, mask=m_n[None, :, :], other=0)
                    b_g = _group(tl.load(g_idx + 8 * o_kw), NG)
                else:
                    b_wd = tl.load(p_wd, mask=m_k[:, None, None] & m_n[None, :, :], other=0)
                    b_g = _group(tl.load(g_idx + 8 * o_kw, mask=m_k, other=0), NG)
                b_s = tl.load(scale + b_g[:, None, None] * stride_sn + o_n[None, :, :], mask=m_n[None, :, :],
                              other=0).to(tl.float32)
                b_zw = tl.load(zero + b_g[:, None] * NZW + o_w[None, :], mask=m_w[None, :], other=0)  # [SUB, BNW]
                # 128 + z: the zero point placed in 128.0's mantissa, as the codes are
                b_c = ((((b_zw[:, :, None] >> b_sh[None, None, :]) & 0xF) << 16) | 0x43000000).to(
                    tl.float32, bitcast=True)
                if V1:
                    b_c += 1.0
                b_0, b_1, b_2, b_3, b_4, b_5, b_6, b_7 = _word_128(b_wd, ASM)
                acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _gptq_rows(
                    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, b_0 - b_c, b_1 - b_c, b_2 - b_c, b_3 - b_c,
                    b_4 - b_c, b_5 - b_c, b_6 - b_c, b_7 - b_c, b_s, x2, M, stride_x2m, o_kw, m_k, DT, EVEN_K,
                    True, BM)
    else:
        # Two sub-tiles per iteration, not a tile's RW: each code's scale and
        # zero-point loads are live together, and eight sub-tiles' took more
        # than 255 registers (sm_90, BN 128).
        RA: tl.constexpr = 2 if RW >= 2 else 1
        for k0 in range(k_lo, k_hi, 8 * SUB * RA):
            for t in tl.static_range(RA):
                o_kw = k0 // 8 + t * SUB + o_s
                m_k = 8 * o_kw < k_hi
                p_wd = w + o_kw.to(tl.int64)[:, None, None] * stride_wn + o_n[None, :, :]
                if EVEN_K:
                    b_wd = tl.load(p_wd, mask=m_n[None, :, :], other=0)
                else:
                    b_wd = tl.load(p_wd, mask=m_k[:, None, None] & m_n[None, :, :], other=0)
                b_0 = _gptq_code(b_wd, 0, g_idx, shifts, scale, zero, b_sh, o_kw, m_k, o_n, m_n, o_w, m_w, NZW,
                                 NG, stride_sn, V1, EVEN_K)
                b_1 = _gptq_code(b_wd, 1, g_idx, shifts, scale, zero, b_sh, o_kw, m_k, o_n, m_n, o_w, m_w, NZW,
                                 NG, stride_sn, V1, EVEN_K)
                b_2 = _gptq_code(b_wd, 2, g_idx, shifts, scale, zero, b_sh, o_kw, m_k, o_n, m_n, o_w, m_w, NZW,
                                 NG, stride_sn, V1, EVEN_K)
                b_3 = _gptq_code(b_wd, 3, g_idx, shifts, scale, zero, b_sh, o_kw, m_k, o_n, m_n, o_w, m_w, NZW,
                                 NG, stride_sn, V1, EVEN_K)
                b_4 = _gptq_code(b_wd, 4, g_idx, shifts, scale, zero, b_sh, o_kw, m_k, o_n, m_n, o_w, m_w, NZW,
                                 NG, stride_sn, V1, EVEN_K)
                b_5 = _gptq_code(b_wd, 5, g_idx, shifts, scale, zero, b_sh, o_kw, m_k, o_n, m_n, o_w, m_w, NZW,
                                 NG, stride_sn, V1, EVEN_K)
                b_6 = _gptq_code(b_wd, 6, g_idx, shifts, scale, zero, b_sh, o_kw, m_k, o_n, m_n, o_w, m_w, NZW,
                                 NG, stride_sn, V1, EVEN_K)
                b_7 = _gptq_code(b_wd, 7, g_idx, shifts, scale, zero, b_sh, o_kw, m_k, o_n, m_n, o_w, m_w, NZW,
                                 NG, stride_sn, V1, EVEN_K)
                acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _gptq_rows(
                    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, b_0, b_1, b_2, b_3, b_4, b_5, b_6, b_7, b_0,
                    x2, M, stride_x2m, o_kw, m_k, DT, EVEN_K, False, BM)

    # [BM, BNW, 8]: the rows' sums added over the sub-tile rows (across the warps), once
    o_m = tl.arange(0, BM)[:, None, None]
    acc = tl.where(o_m == 0, tl.sum(acc0, axis=0)[None, :, :], 0.0)
    if BM > 1:
        acc += tl.where(o_m == 1, tl.sum(acc1, axis=0)[None, :, :], 0.0)
    if BM > 2:
        acc += tl.where(o_m == 2, tl.sum(acc2, axis=0)[None, :, :], 0.0)
        acc += tl.where(o_m == 3, tl.sum(acc3, axis=0)[None, :, :], 0.0)
    if BM > 4:
        acc += tl.where(o_m == 4, tl.sum(acc4, axis=0)[None, :, :], 0.0)
        acc += tl.where(o_m == 5, tl.sum(acc5, axis=0)[None, :, :], 0.0)
        acc += tl.where(o_m == 6, tl.sum(acc6, axis=0)[None, :, :], 0.0)
        acc += tl.where(o_m == 7, tl.sum(acc7, axis=0)[None, :, :], 0.0)
    m_o = (o_m < M) & m_n[None, :, :]
    _finish(acc, out, part, bias + o_n[None, :, :], m_n[None, :, :], ctr + i_n, o_m * N + o_n[None, :, :], m_o,
            i_s, tl.num_programs(1), M, N, HAS_BIAS, PARTIAL, SUM_HERE)


@triton.jit
def _pick_row(w, scale, zero, nst, w_b, scale_b, zero_b, nst_b, i_n, r: tl.constexpr, N, BN: tl.constexpr,
              PAIRED: tl.constexpr):
    """Row ``r`` of the program's BN: (weight, scale, zero point and nested-absmax
    pointers, row index; rows past N read row N - 1, never stored).  PAIRED (two
    weights of N rows read side by side, dequant_matmul_gated): the first BN / 2
    rows are rows i_n BN / 2 + r of the first weight, the others the same rows
    of the second, so that a program holds the two products of each output column."""
    if PAIRED:
        n = tl.minimum(i_n * (BN // 2) + r % (BN // 2), N - 1)
        if r < BN // 2:
            return w, scale, zero, nst, n
        else:
            return w_b, scale_b, zero_b, nst_b, n
    else:
        return w, scale, zero, nst, tl.minimum(i_n * BN + r, N - 1)


@triton.jit
def _row_chunks(w, scale, nst, n, kp0, o_b, o_g, m_c, stride_wn, stride_sn, EVEN_K: tl.constexpr,
                NESTED: tl.constexpr):
    """Row n's packed bytes of the tile ([NCH, VB], one vector load a chunk; its
    K slice from byte kp0) and its chunks' scales [NCH] as fp32 (``_block_scales``)."""
    p_wr = w + n.to(tl.int64) * stride_wn + kp0
    if EVEN_K:
        b_q = tl.load(p_wr + o_b)
    else:
        b_q = tl.load(p_wr + o_b, mask=m_c[:, None], other=0)
    return b_q, _block_scales(scale, nst, n * stride_sn + o_g, m_c, NESTED)


@triton.jit
def _folded_loads(x2, w, scale, zero, w_b, scale_b, zero_b, N, k0, k_hi, i_n, stride_wn, stride_sn, o_c, o_b,
                  G: tl.constexpr, HAS_ZERO: tl.constexpr, EVEN_K: tl.constexpr, VB: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, PAIRED: tl.constexpr):
    """One K tile's loads for _int4_gemv_folded: x's pairs [NCH, VB] and per row
    (its bytes [NCH, VB], its chunks' scales [NCH], zero points [NCH] or the
    scales again where there are none), as a tuple of BN."""
    kp0 = tl.multiple_of(k0 // 2, BK // 2)
    m_c = 2 * kp0 + o_c * (2 * VB) < k_hi
    o_g = (2 * kp0 + o_c * (2 * VB)) // G
    if EVEN_K:
        b_x = tl.load(x2 + kp0 + o_b)
    else:
        b_x = tl.load(x2 + kp0 + o_b, mask=m_c[:, None], other=0)
    rows = ()
    for r in tl.static_range(BN):
        w_r, s_r, z_r, q_r, n = _pick_row(w, scale, zero, (scale, scale, scale), w_b, scale_b, zero_b,
                                          (scale, scale, scale), i_n, r, N, BN, PAIRED)
        b_q, b_s = _row_chunks(w_r, s_r, q_r, n, kp0, o_b, o_g, m_c, stride_wn, stride_sn, EVEN_K, False)
        if HAS_ZERO:
            b_z = tl.load(z_r + n * stride_sn + o_g, mask=m_c, other=0).to(tl.float32)
        else:
            b_z = b_s
        rows = rows + ((b_q, b_s, b_z),)
    return b_x, rows


@triton.jit
def _folded_sums(acc2, b_x, rows, o_r, DT: tl.constexpr, HAS_ZERO: tl.constexpr, ASM: tl.constexpr,
                 BN: tl.constexpr):
    """acc2 [BN, NCH] plus one tile's chunk sums s ((128 + q) . x - (128 + z) sum x)."""
    b_xe, b_xo = _pair_to_f32(b_x, DT)
    b_xs = tl.sum(b_xe, axis=1) + tl.sum(b_xo, axis=1)  # [NCH]
    for r in tl.static_range(BN):
        b_q, b_s, b_z = rows[r]
        if HAS_ZERO:
            b_c = 128.0 + b_z
        else:
            b_c = 136.0
        b_e, b_o = _nibbles_128(b_q, ASM)
        b_a = tl.sum(b_e * b_xe, axis=1) + tl.sum(b_o * b_xo, axis=1)
        b_d = (b_a - b_c * b_xs) * b_s
        # (the where folds away: each register's row is a constant)
        acc2 += tl.where(o_r[:, None] == r, b_d[None, :], 0.0)
    return acc2


@triton.jit
def _int4_gemv_folded(x2, w, scale, zero, w_b, scale_b, zero_b, N, k_lo, k_hi, i_n, stride_wn, stride_sn,
                      DT: tl.constexpr, G: tl.constexpr, HAS_ZERO: tl.constexpr, EVEN_K: tl.constexpr,
                      ASM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PAIRED: tl.constexpr):
    """[1, BN] int4 sums of one row of x over K in [k_lo, k_hi), the zero point
    taken off each chunk's sum: s (sum (128 + q) x - (128 + z) sum x).  Per value
    one PRMT (_nibbles_128) and one FMA in a chain, where _nibble_gemv adds an
    FADD (q - z): 3.50 sm_90 SASS instructions a code against 4.21 (BN 4, two
    warps; benchmarks/sass_dequant_matmul.py), 1.04-1.21x faster on an H200 at
    the fastest configs of six MLP shapes (bf367f9); sum x is made once per
    tile for the BN rows.  128 + q has 8 significant bits, so each
    product with a 16-bit x is exact; the cancellation against (128 + z) sum x
    costs ~2**-24 * 136 * sum |x| of a chunk, far under the output's rounding.
    16-bit x only (launch._fold): an fp32 x's products are rounded, and that
    cancellation made them 52 units of roundoff of sum |x w| off.
    Not finite where x is not (inf - inf): the caller re-does such a slice.
    The next tile's loads issued before this tile's sums (two tiles in
    flight a program, as the MoE down kernel's look-ahead) ran 20.1-87.8 µs
    against 14.3-14.6 for the best plain configs (H200, 6185afa, 4096 x 14336
    and 14336 x 4096)."""
    VB: tl.constexpr = 16 if G >= 32 else G // 2
    NCH: tl.constexpr = BK // (2 * VB)
    o_c = tl.arange(0, NCH)
    o_b = o_c[:, None] * VB + tl.arange(0, VB)[None, :]  # [NCH, VB] bytes of a row's tile = pairs of x
    o_r = tl.arange(0, BN)
    acc2 = tl.zeros([BN, NCH], dtype=tl.float32)  # chunks last: spread over the threads
    for k0 in range(k_lo, k_hi, BK):
        b_x, rows = _folded_loads(x2, w, scale, zero, w_b, scale_b, zero_b, N, k0, k_hi, i_n, stride_wn, stride_sn,
                                  o_c, o_b, G, HAS_ZERO, EVEN_K, VB, BN, BK, PAIRED)
        acc2 = _folded_sums(acc2, b_x, rows, o_r, DT, HAS_ZERO, ASM, BN)
    return tl.sum(acc2, axis=1)[None, :]


@triton.jit
def _nibble_gemv(x, x2, w, scale, zero, nst, w_b, scale_b, zero_b, nst_b, M, N, k_lo, k_hi, i_n, stride_x2m,
                 stride_wn, stride_sn, FMT: tl.constexpr, G: tl.constexpr, HAS_ZERO: tl.constexpr,
                 EVEN_K: tl.constexpr, ASM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 PAIRED: tl.constexpr, NESTED: tl.constexpr):
    """[BM, BN] sums of int4, and of the code books' whole blocks (nf4 / fp4: the
    same bytes per value, the high nibble the even k, an fp32 absmax per block,
    or NESTED its byte and double quantization's tables), over K in [k_lo,
    k_hi), value by value as the dequantised matmul."""
    # A thread owns a chunk of VB packed bytes (16: one vector load, 32 codes
    # inside one group) of each of the BN rows, and the VB matching pairs of
    # x's values (x2: x viewed as int32 pairs, or int64 for fp32 x).  Each
    # row's bytes are a tensor of the same shape as x's pairs, so Triton gives
    # both one layout (the same threads hold a byte and its pair of x: no
    # shuffles); the rows are a static loop with one sum per row and chunk.
    # Each int4 code becomes (128 + q) - (128 + z) = q - z in one FADD
    # (_nibbles_128: one PRMT per value), a code book's its value in one
    # shuffle (_codebook_pair); then one FMA; a chunk's sum is scaled once.
    # The zero point is subtracted from each value (_int4_gemv_folded takes it
    # off a chunk's sum instead, where it can).
    VB: tl.constexpr = 16 if G >= 32 else G // 2  # (the plans' G are powers of two)
    NCH: tl.constexpr = BK // (2 * VB)
    o_c = tl.arange(0, NCH)
    o_b = o_c[:, None] * VB + tl.arange(0, VB)[None, :]  # [NCH, VB] bytes of a row's tile = pairs of x
    o_r = tl.arange(0, BN)
    o_m = tl.arange(0, BM)
    ZERO_F32: tl.constexpr = HAS_ZERO and zero.dtype.element_ty == tl.float32
    tab = _lane_table(zero, tl.zeros([NCH, VB], dtype=tl.int32), ASM and FMT != "int4")  # (the code book)
    # [BM, BN, NCH]: chunks last, so that Triton spreads them over the threads
    # and keeps a thread's rows in its registers.
    acc3 = tl.zeros([BM, BN, NCH], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        kp0 = tl.multiple_of(k0 // 2, BK // 2)  # k_lo and the step are whole tiles
        m_c = 2 * kp0 + o_c * (2 * VB) < k_hi  # [NCH]: chunks inside the slice (a group never straddles it)
        o_g = (2 * kp0 + o_c * (2 * VB)) // G  # [NCH]: each chunk's group
        if BM == 1:
            if EVEN_K:
                b_x = tl.load(x2 + kp0 + o_b)
            else:
                b_x = tl.load(x2 + kp0 + o_b, mask=m_c[:, None], other=0)
            b_xe, b_xo = _pair_to_f32(b_x, x.dtype.element_ty)
        for r in tl.static_range(BN):
            # (rows past N read row N - 1, never stored: no row mask)
            w_r, s_r, z_r, q_r, n = _pick_row(w, scale, zero, nst, w_b, scale_b, zero_b, nst_b, i_n, r, N, BN,
                                              PAIRED)
            b_q, b_s = _row_chunks(w_r, s_r, q_r, n, kp0, o_b, o_g, m_c, stride_wn, stride_sn, EVEN_K, NESTED)
            if FMT != "int4":
                b_e, b_o = _codebook_pair(b_q, tab, zero, ASM)  # (zero: the code book)
            else:  # (the low nibble the even k)
                b_e, b_o = _int4_minus_zero(b_q, z_r + n * stride_sn + o_g, m_c, HAS_ZERO, ZERO_F32, ASM)
            for m in tl.static_range(BM):
                if BM > 1:
                    # Rows past M read row M - 1 (their sums are never stored): no row mask.
                    p_x = x2 + tl.minimum(m, M - 1) * stride_x2m + kp0 + o_b
                    if EVEN_K:
                        b_x = tl.load(p_x)
                    else:
                        b_x = tl.load(p_x, mask=m_c[:, None], other=0)
                    b_xe, b_xo = _pair_to_f32(b_x, x.dtype.element_ty)
                b_d = _chunk_sums(b_e, b_o, b_s, b_xe, b_xo)  # [NCH]
                # (the where folds away: each register's row and column are constants)
                acc3 += tl.where((o_m[:, None, None] == m) & (o_r[None, :, None] == r), b_d[None, None, :], 0.0)
    return tl.sum(acc3, axis=2)


@triton.jit
def _own_rows(x, x2, w, scale, zero, nst, bias, out, part, ctr, g_idx, shifts, M, N, K, K_SPLIT, NG, i_n, i_s,
              n_s, stride_xm, stride_x2m, stride_wn, stride_sn, FMT: tl.constexpr, G: tl.constexpr,
              HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, SUM_HERE: tl.constexpr,
              EVEN_K: tl.constexpr, ASM: tl.constexpr, LIB: tl.constexpr, LOOP: tl.constexpr, BM: tl.constexpr,
              BN: tl.constexpr, BK: tl.constexpr, FOLD: tl.constexpr, NESTED: tl.constexpr):
    """Output rows [i_n BN, +BN) over K slice i_s of n_s: fusepass's own formats
    (int4, int8, fp8) and the library layouts read value by value or in the int4
    loop (the code books)."""
    acc = _rows_acc(x, x2, w, scale, zero, nst, w, scale, zero, nst, g_idx, shifts, M, N, K, K_SPLIT, NG, i_n,
                    i_s, stride_xm, stride_x2m, stride_wn, stride_sn, FMT, G, HAS_ZERO, EVEN_K, ASM, LIB, LOOP, BM, BN,
                    BK, FOLD, False, NESTED)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < N
    o_m = tl.arange(0, BM)
    m_o = (o_m[:, None] < M) & m_n[None, :]
    _finish(acc, out, part, bias + o_n[None, :], m_n[None, :], ctr + i_n, o_m[:, None] * N + o_n[None, :], m_o,
            i_s, n_s, M, N, HAS_BIAS, PARTIAL, SUM_HERE)


@triton.jit
def _rows_acc(x, x2, w, scale, zero, nst, w_b, scale_b, zero_b, nst_b, g_idx, shifts, M, N, K, K_SPLIT, NG, i_n,
              i_s, stride_xm, stride_x2m, stride_wn, stride_sn, FMT: tl.constexpr, G: tl.constexpr,
              HAS_ZERO: tl.constexpr, EVEN_K: tl.constexpr, ASM: tl.constexpr, LIB: tl.constexpr, LOOP: tl.constexpr,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FOLD: tl.constexpr, PAIRED: tl.constexpr,
              NESTED: tl.constexpr):
    """The fp32 sums [BM, BN] of _own_rows' tile (PAIRED: of _pick_row's rows of two weights)."""
    o_r = tl.arange(0, BN)
    if PAIRED:
        o_n = i_n * (BN // 2) + o_r % (BN // 2)
    else:
        o_n = i_n * BN + o_r
    m_n = o_n < N
    o_m = tl.arange(0, BM)
    k_lo = i_s * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    if PAIRED:  # (int8 / fp8 rows: each row's pointer from its weight)
        p_wn = tl.where(o_r < BN // 2, w + o_n.to(tl.int64) * stride_wn, w_b + o_n.to(tl.int64) * stride_wn)
    else:
        p_wn = w + o_n.to(tl.int64) * stride_wn
    acc = tl.zeros([BM, BN], dtype=tl.float32)

    if FMT == "int4" or LOOP:
        if FMT == "int4" and FOLD and BM == 1:
            acc = _int4_gemv_folded(x2, w, scale, zero, w_b, scale_b, zero_b, N, k_lo, k_hi, i_n, stride_wn,
                                    stride_sn, x.dtype.element_ty, G, HAS_ZERO, EVEN_K, ASM, BN, BK, PAIRED)
            # The folded sums are not the dequantised matmul's where x (or a sum
            # of it) is not finite: inf - inf = NaN where the product gives +-inf.
            # Such a slice is summed again value by value (any non-finite sum
            # is re-done; a finite one is within fp32 rounding of the exact sum).
            bad = ((acc != acc) | (tl.abs(acc) == float("inf"))).to(tl.int32)
            if tl.max(tl.max(bad, axis=1), axis=0) > 0:
                acc = _nibble_gemv(x, x2, w, scale, zero, nst, w_b, scale_b, zero_b, nst_b, M, N, k_lo, k_hi, i_n,
                                   stride_x2m, stride_wn, stride_sn, FMT, G, HAS_ZERO, EVEN_K, ASM, BM, BN, BK,
                                   PAIRED, NESTED)
        else:
            acc = _nibble_gemv(x, x2, w, scale, zero, nst, w_b, scale_b, zero_b, nst_b, M, N, k_lo, k_hi, i_n,
                               stride_x2m, stride_wn, stride_sn, FMT, G, HAS_ZERO, EVEN_K, ASM, BM, BN, BK, PAIRED,
                               NESTED)
    else:
        o_k = tl.arange(0, BK)
        if BM == 1:
            # One row of x: accumulate products elementwise and reduce across
            # the K lanes once at the end, not once per tile.
            acc1 = tl.zeros([BN, BK], dtype=tl.float32)
            for k0 in range(k_lo, k_hi, BK):
                if LIB:
                    m_k = k0 + o_k < k_hi
                    b_x = tl.load(x + k0 + o_k, mask=m_k, other=0).to(tl.float32)
                    b_w = _library_tile(w, scale, zero, g_idx, shifts, o_n[:, None], (k0 + o_k)[None, :],
                                        m_n[:, None] & m_k[None, :], N, K, NG, stride_wn, stride_sn, FMT, G)
                else:
                    if EVEN_K:
                        b_q = tl.load(p_wn[:, None] + (k0 + o_k)[None, :], mask=m_n[:, None], other=0)
                        b_x = tl.load(x + k0 + o_k).to(tl.float32)
                    else:
                        m_k = k0 + o_k < k_hi
                        b_q = tl.load(p_wn[:, None] + (k0 + o_k)[None, :], mask=m_n[:, None] & m_k[None, :],
                                      other=0)
                        b_x = tl.load(x + k0 + o_k, mask=m_k, other=0).to(tl.float32)
                    if FMT == "int8":
                        b_w = _int8_to_f32(b_q)
                    else:
                        b_w = b_q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
                acc1 += b_w * b_x[None, :]
            acc += tl.sum(acc1, axis=1)[None, :]
        else:
            # A few rows of x: the same deferred sum over [BM, BN, BK] (the
            # plans keep BM * BN * BK to 64 fp32 registers per thread).  Rows
            # past M read row M - 1; their sums are never stored.
            acc3 = tl.zeros([BM, BN, BK], dtype=tl.float32)
            p_xm = x + tl.minimum(o_m, M - 1)[:, None] * stride_xm
            for k0 in range(k_lo, k_hi, BK):
                if LIB:
                    m_k = k0 + o_k < k_hi
                    b_x = tl.load(p_xm + (k0 + o_k)[None, :], mask=m_k[None, :], other=0).to(tl.float32)
                    b_w = _library_tile(w, scale, zero, g_idx, shifts, o_n[:, None], (k0 + o_k)[None, :],
                                        m_n[:, None] & m_k[None, :], N, K, NG, stride_wn, stride_sn, FMT, G)
                else:
                    if EVEN_K:
                        b_q = tl.load(p_wn[:, None] + (k0 + o_k)[None, :], mask=m_n[:, None], other=0)
                        b_x = tl.load(p_xm + (k0 + o_k)[None, :]).to(tl.float32)
                    else:
                        m_k = k0 + o_k < k_hi
                        b_q = tl.load(p_wn[:, None] + (k0 + o_k)[None, :], mask=m_n[:, None] & m_k[None, :],
                                      other=0)
                        b_x = tl.load(p_xm + (k0 + o_k)[None, :], mask=m_k[None, :], other=0).to(tl.float32)
                    if FMT == "int8":
                        b_w = _int8_to_f32(b_q)
                    else:
                        b_w = b_q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
                acc3 += b_w[None, :, :] * b_x[:, None, :]
            acc += tl.sum(acc3, axis=2)
        if not LIB:  # (library layouts scale each value: their scales change along K)
            if PAIRED:
                p_sn = tl.where(o_r < BN // 2, scale + o_n, scale_b + o_n)
            else:
                p_sn = scale + o_n
            acc *= tl.load(p_sn, mask=m_n, other=0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _dequant_gemv_kernel(
    x, x2, w, scale, zero, bias, out, part, ctr, g_idx, shifts, nest, code2, offset,
    M, N, K, K_SPLIT, NG,
    stride_xm, stride_x2m, stride_wn, stride_sn,
    FMT: tl.constexpr, G: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr, SUM_HERE: tl.constexpr, EVEN_K: tl.constexpr, ASM: tl.constexpr, LIB: tl.constexpr,
    LOOP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FOLD: tl.constexpr,
    PDL: tl.constexpr = False, NESTED: tl.constexpr = False,
):
    pdl_begin(PDL)  # (a PDL launch: nothing is read before it)
    # Program (i_n, i_s): output rows [i_n * BN, +BN) over K in [i_s * K_SPLIT, +K_SPLIT)
    # (HQQ: BN pairs of rows; GPTQ: BN columns of its [K, N] words).
    # EVEN_K: the slices cover K exactly and BK divides K_SPLIT, so no load along K
    # is masked and the loads stay 16-byte vectors.  LOOP: a library layout's loop of
    # its own, an HQQ weight of even N (_hqq_gemv) or a code book's whole blocks
    # (the int4 loop); HQQ of odd N has no pairs of rows and goes value by value.
    # NESTED: a code book's absmax as bitsandbytes' double quantization stores
    # it (nest, code2, offset: _block_scales), in the int4 loop only.
    if FMT == "hqq4" and LOOP:
        _hqq_gemv(x, w, scale, zero, bias, out, part, ctr, M, N, K, K_SPLIT, stride_xm, stride_sn, G, HAS_BIAS,
                  PARTIAL, SUM_HERE, EVEN_K, ASM, BM, BN, BK)
    elif FMT == "gptq4" or FMT == "gptq4_v1":
        _gptq_gemv(x, x2, w, scale, zero, g_idx, shifts, bias, out, part, ctr, M, N, K, K_SPLIT, NG, stride_xm,
                   stride_x2m, stride_wn, stride_sn, FMT == "gptq4_v1", HAS_BIAS, PARTIAL, SUM_HERE, EVEN_K, ASM,
                   BM, BN, BK)
    else:
        _own_rows(x, x2, w, scale, zero, (nest, code2, offset), bias, out, part, ctr, g_idx, shifts, M, N, K,
                  K_SPLIT, NG, tl.program_id(0), tl.program_id(1), tl.num_programs(1), stride_xm, stride_x2m,
                  stride_wn, stride_sn, FMT, G, HAS_ZERO, HAS_BIAS, PARTIAL, SUM_HERE, EVEN_K, ASM, LIB, LOOP, BM, BN,
                  BK, FOLD, NESTED)


@triton.jit
def _sibling_rows(x, x2, w, s, z, q, b, o, pid, M, N, K, stride_xm, stride_x2m, stride_wn, stride_sn,
                  FMT: tl.constexpr, G: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr,
                  EVEN_K: tl.constexpr, ASM: tl.constexpr, LOOP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, FOLD: tl.constexpr, NESTED: tl.constexpr):
    # Whole K, no split: part / ctr / g_idx / shifts are never read (o and s stand in).
    _own_rows(x, x2, w, s, z, q, b, o, o, o, s, s, M, N, K, K, 1, pid, 0, 1, stride_xm, stride_x2m, stride_wn,
              stride_sn, FMT, G, HAS_ZERO, HAS_BIAS, False, False, EVEN_K, ASM, False, LOOP, BM, BN, BK, FOLD, NESTED)


@triton.jit
def _dequant_gemv_siblings_kernel(
    x, x2, w0, w1, w2, s0, s1, s2, z0, z1, z2, b0, b1, b2, o0, o1, o2, q0, q1, q2, c0, c1, c2, f0, f1, f2,
    N0, N1, N2, E0, E1,
    M, K, stride_xm, stride_x2m, stride_w0, stride_w1, stride_w2, stride_s0, stride_s1, stride_s2,
    FMT: tl.constexpr, G: tl.constexpr, HAS_ZERO: tl.constexpr, HB0: tl.constexpr, HB1: tl.constexpr,
    HB2: tl.constexpr, NW: tl.constexpr, EVEN_K: tl.constexpr, ASM: tl.constexpr, LOOP: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FOLD: tl.constexpr,
    PDL: tl.constexpr = False, NESTED: tl.constexpr = False,
):
    pdl_begin(PDL)  # (a PDL launch: nothing is read before it)
    # Two or three weights of one format that read the same x (q / k / v, gate /
    # up) in one grid: program p owns BN rows of the weight whose block range
    # holds p (E0, E1: where the blocks of weights 0 and 1 end), each through its
    # own pointers, with the one-weight GEMV's loop (LOOP: a code book's, the
    # int4 loop with its table in z's place; NESTED: weight i's double
    # quantization in q_i, c_i, f_i).  A slot past NW is compiled out: its
    # stand-in pointers are neither read nor written.
    pid = tl.program_id(0)
    if pid < E0:
        _sibling_rows(x, x2, w0, s0, z0, (q0, c0, f0), b0, o0, pid, M, N0, K, stride_xm, stride_x2m, stride_w0,
                      stride_s0, FMT, G, HAS_ZERO, HB0, EVEN_K, ASM, LOOP, BM, BN, BK, FOLD, NESTED)
    else:
        if NW > 1:
            if pid < E1:
                _sibling_rows(x, x2, w1, s1, z1, (q1, c1, f1), b1, o1, pid - E0, M, N1, K, stride_xm, stride_x2m,
                              stride_w1, stride_s1, FMT, G, HAS_ZERO, HB1, EVEN_K, ASM, LOOP, BM, BN, BK, FOLD, NESTED)
            else:
                if NW > 2:
                    _sibling_rows(x, x2, w2, s2, z2, (q2, c2, f2), b2, o2, pid - E1, M, N2, K, stride_xm,
                                  stride_x2m, stride_w2, stride_s2, FMT, G, HAS_ZERO, HB2, EVEN_K, ASM, LOOP, BM, BN,
                                  BK, FOLD, NESTED)


@triton.jit
def _dequant_gemv_gated_kernel(
    x, x2, w0, w1, s0, s1, z0, z1, b0, b1, q0, q1, c0, c1, f0, f1, out, M, N, K, stride_xm, stride_x2m, stride_wn,
    stride_sn, stride_om, FMT: tl.constexpr, G: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr, ASM: tl.constexpr, LOOP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr, FOLD: tl.constexpr, ACT: tl.constexpr, EMU: tl.constexpr, PDL: tl.constexpr = False,
    NESTED: tl.constexpr = False,
):
    pdl_begin(PDL)  # (a PDL launch: nothing is read before it)
    # act(x W0^T + b0) * (x W1^T + b1) (an MLP's gate and up) in one grid, the
    # siblings' GEMV loop over the whole of K with program p's BN rows taken
    # half from each weight (_pick_row): rows [p BN / 2, +BN / 2) of both, so
    # the program holds gate and up of its BN / 2 output columns and applies
    # the activation with the model's roundings (each product rounded to x's
    # dtype, the activation rounded, the product rounded: the gated_act
    # kernel's) before one store.  No launch, no write or read of gate and up
    # between the GEMV and the activation.
    i_n = tl.program_id(0)
    acc = _rows_acc(x, x2, w0, s0, z0, (q0, c0, f0), w1, s1, z1, (q1, c1, f1), s0, s0, M, N, K, K, 1, i_n, 0,
                    stride_xm, stride_x2m, stride_wn, stride_sn, FMT, G, HAS_ZERO, EVEN_K, ASM, False, LOOP, BM, BN, BK,
                    FOLD, True, NESTED)
    H: tl.constexpr = BN // 2
    b_g, b_u = tl.split(tl.permute(tl.reshape(acc, [BM, 2, H]), (0, 2, 1)))  # [BM, H] each
    o_n = i_n * H + tl.arange(0, H)
    m_n = o_n < N
    if HAS_BIAS:
        b_g += tl.load(b0 + o_n, mask=m_n, other=0).to(tl.float32)[None, :]
        b_u += tl.load(b1 + o_n, mask=m_n, other=0).to(tl.float32)[None, :]
    DT: tl.constexpr = out.dtype.element_ty
    b_g = round_to(b_g, DT, EMU).to(tl.float32)
    b_u = round_to(b_u, DT, EMU).to(tl.float32)
    b_o = gated(b_g, b_u, DT, ACT, EMU)
    o_m = tl.arange(0, BM)
    tl.store(out + o_m[:, None] * stride_om + o_n[None, :], round_to(b_o, DT, EMU),
             mask=(o_m[:, None] < M) & m_n[None, :])

