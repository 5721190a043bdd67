"""The tensor-core kernels: ``mm`` (x as the dot's A operand) and ``mmt`` (the
product transposed, the dequantised weight tile as the A operand)."""

from __future__ import annotations

import triton
import triton.language as tl

from fusepass.kernels.dequant_matmul.tiles import (
    _codebook_word,
    _dot,
    _finish,
    _int4_dequant,
    _int4_offset,
    _int4_pairs,
    _int8_to_f32,
    _int8_word,
    _library_tile,
    _nibble_word,
    _nibbles_to_f32,
    _word_128,
)


@triton.jit
def _dequant_mm_kernel(
    x, w, scale, zero, bias, out, part, ctr, g_idx, shifts,
    M, N, K, K_SPLIT, NG,
    stride_xm, stride_wn, stride_sn,
    FMT: tl.constexpr, G: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr, SUM_HERE: tl.constexpr, EVEN_K: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, DOT_F32: tl.constexpr,
    PERM: tl.constexpr, LIB: tl.constexpr = False,
):
    # Tiles in groups of GROUP_M row blocks, so that consecutive programs
    # share weight tiles in L2 when M spans several blocks.
    i_mn, i_s = tl.program_id(0), tl.program_id(1)
    n_m = tl.cdiv(M, BM)
    n_n = tl.cdiv(N, BN)
    width = GROUP_M * n_n
    first_m = (i_mn // width) * GROUP_M
    size_m = tl.minimum(n_m - first_m, GROUP_M)
    i_m = first_m + (i_mn % width) % size_m
    i_n = (i_mn % width) // size_m

    o_m = i_m * BM + tl.arange(0, BM)
    o_n = i_n * BN + tl.arange(0, BN)
    m_m = o_m < M
    m_n = o_n < N
    k_lo = i_s * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    p_xm = x + o_m.to(tl.int64) * stride_xm
    p_wn = w + o_n.to(tl.int64) * stride_wn
    dt = x.dtype.element_ty
    acc = tl.zeros([BM, BN], dtype=tl.float32)

    if FMT == "int4":
        # BK divides G: one scale (and zero) per output row per tile.  The
        # low nibbles multiply the even columns of x and the high nibbles the
        # odd ones: two dots of depth BK / 2, x split in registers, the
        # weight tile never interleaved.
        BKP: tl.constexpr = BK // 2
        o_kp = tl.arange(0, BKP)
        o_t = tl.arange(0, 2)
        # PERM: one dot of depth BK with the tile's K order permuted, which a
        # dot does not see: position p holds byte p % BKP, nibble p // BKP
        # (low nibbles first, then high), and x is gathered in that order.  The
        # weight bytes are read twice (the second time from L1), no registers
        # are shuffled.
        o_p = tl.arange(0, BK)
        o_pb = o_p % BKP
        o_ps = (o_p // BKP) * 4
        o_px = 2 * o_pb + o_p // BKP
        for k0 in range(k_lo, k_hi, BK):
            if PERM:
                if EVEN_K:
                    b_x = tl.load(p_xm[:, None] + (k0 + o_px)[None, :], mask=m_m[:, None], other=0)
                else:
                    b_x = tl.load(p_xm[:, None] + (k0 + o_px)[None, :],
                                  mask=m_m[:, None] & (k0 + o_px < k_hi)[None, :], other=0)
                b_q = tl.load(p_wn[None, :] + (k0 // 2 + o_pb)[:, None], mask=m_n[None, :], other=0)  # [BK, BN]
                b_v = (((b_q.to(tl.int32) >> o_ps[:, None]) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
                b_s = tl.load(scale + o_n * stride_sn + k0 // G, mask=m_n, other=0).to(tl.float32)[None, :]
                if HAS_ZERO:
                    b_z = tl.load(zero + o_n * stride_sn + k0 // G, mask=m_n, other=0).to(tl.float32)[None, :]
                else:
                    b_z = 8.0
                b_w = ((b_v - 8388608.0) * b_s - b_z * b_s).to(dt)
                acc = _dot(b_x, b_w, acc, DOT_F32)
            else:
                o_x = k0 + 2 * o_kp[None, :, None] + o_t[None, None, :]  # [1, BKP, 2]
                if EVEN_K:
                    b_x = tl.load(p_xm[:, None, None] + o_x, mask=m_m[:, None, None], other=0)
                else:
                    b_x = tl.load(p_xm[:, None, None] + o_x, mask=m_m[:, None, None] & (o_x < k_hi), other=0)
                b_xe, b_xo = tl.split(b_x)  # [BM, BKP]
                # [BKP, BN]: the transposed tile, loaded along K (unit stride).  A
                # group never straddles k_hi (G | K_SPLIT), so no K mask is needed.
                b_q = tl.load(p_wn[None, :] + (k0 // 2 + o_kp)[:, None], mask=m_n[None, :], other=0)
                b_lo, b_hi = _nibbles_to_f32(b_q)
                b_s = tl.load(scale + o_n * stride_sn + k0 // G, mask=m_n, other=0).to(tl.float32)[None, :]
                if HAS_ZERO:
                    b_z = tl.load(zero + o_n * stride_sn + k0 // G, mask=m_n, other=0).to(tl.float32)[None, :]
                else:
                    b_z = 8.0
                b_zs = b_z * b_s
                b_lo = (b_lo * b_s - b_zs).to(dt)
                b_hi = (b_hi * b_s - b_zs).to(dt)
                acc = _dot(b_xe, b_lo, acc, DOT_F32)
                acc = _dot(b_xo, b_hi, acc, DOT_F32)
    elif LIB:
        # Another library's layout: each value gathered and scaled (_library_tile),
        # the [BK, BN] tile rounded to x's dtype for the dot, as the model's own
        # dequantised weight is.
        o_k = tl.arange(0, BK)
        for k0 in range(k_lo, k_hi, BK):
            m_k = k0 + o_k < k_hi
            b_x = tl.load(p_xm[:, None] + (k0 + o_k)[None, :], mask=m_m[:, None] & m_k[None, :], other=0)
            b_w = _library_tile(w, scale, zero, g_idx, shifts, o_n[None, :], (k0 + o_k)[:, None],
                                m_n[None, :] & m_k[:, None], N, K, NG, stride_wn, stride_sn, FMT, G)
            acc = _dot(b_x, b_w.to(dt), acc, DOT_F32)
    else:
        # int8 and fp8 values are exact in bf16 and fp16: the dot is exact in
        # the weight and the per-row scale goes on the fp32 result.
        o_k = tl.arange(0, BK)
        for k0 in range(k_lo, k_hi, BK):
            if EVEN_K:
                b_x = tl.load(p_xm[:, None] + (k0 + o_k)[None, :], mask=m_m[:, None], other=0)
                b_q = tl.load(p_wn[None, :] + (k0 + o_k)[:, None], mask=m_n[None, :], other=0)
            else:
                m_k = k0 + o_k < k_hi
                b_x = tl.load(p_xm[:, None] + (k0 + o_k)[None, :], mask=m_m[:, None] & m_k[None, :], other=0)
                b_q = tl.load(p_wn[None, :] + (k0 + o_k)[:, None], mask=m_n[None, :] & m_k[:, None], other=0)
            if FMT == "int8":
                b_w = _int8_to_f32(b_q).to(dt)
            else:
                b_w = b_q.to(tl.float8e4nv, bitcast=True).to(dt)
            acc = _dot(b_x, b_w, acc, DOT_F32)
        acc *= tl.load(scale + o_n, mask=m_n, other=0).to(tl.float32)[None, :]

    m_o = m_m[:, None] & m_n[None, :]
    o_o = o_m.to(tl.int64)[:, None] * N + o_n[None, :]
    _finish(acc, out, part, bias + o_n[None, :], m_n[None, :], ctr + i_mn, o_o, m_o,
            i_s, tl.num_programs(1), M, N, HAS_BIAS, PARTIAL, SUM_HERE)


@triton.jit
def _scale_row(p_s, p_z, k0, k_hi, m_n, G: tl.constexpr, HAS_ZERO: tl.constexpr):
    """The scales and zero points (the scales again without) of the int4 tile at
    K offset ``k0`` of each row pointer; nothing is read for a tile at or past ``k_hi``."""
    m = tl.where(k0 < k_hi, m_n, False)
    b_s = tl.load(p_s + k0 // G, mask=m, other=0)
    if HAS_ZERO:
        return b_s, tl.load(p_z + k0 // G, mask=m, other=0)
    return b_s, b_s


@triton.jit
def _dequant_mmt_kernel(
    x, w, scale, zero, bias, out, part, ctr, g_idx, shifts,
    M, N, K, K_SPLIT,
    stride_xm, stride_wn, stride_sn,
    FMT: tl.constexpr, G: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
    SUM_HERE: tl.constexpr, EVEN_K: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, DOT_F32: tl.constexpr,
    ASM: tl.constexpr = False, WORDS: tl.constexpr = False, LIB: tl.constexpr = False, AHEAD: tl.constexpr = 0,
    XPERM: tl.constexpr = False,
):
    # Small M, the product transposed: out^T [BN, BM] = W [BN, BK] @ x^T [BK, BM].
    # The dequantised weight tile is the dot's A operand, used from registers,
    # and x^T the B operand as loaded (0.61-1.00x gemlite A16W4's time at M =
    # 16-64 on the H100 where the `mm` kernel, x as A, ran 1.4-2.4x; commit
    # d5c4001).  int8 / fp8 values are exact in x's 16-bit dtype and the per-row
    # scale goes on the fp32 sum.
    #
    # int4 (tiles inside one group: BK divides G): the weight is read as int32
    # words of eight codes, [BN, BK / 32, 4] per tile, word 4j + t.  Its codes
    # become the tile's columns 32j + 16h + 8u + 2t + e (byte 2h + u, nibble e),
    # which is where the tensor cores' A fragment wants them (a thread holds
    # columns 2t, 2t + 1, 2t + 8 and 2t + 9 of each 16), and x's rows are
    # gathered in the same order (pairs stay together: 4-byte loads): a dot
    # does not see the order of K.  So a thread converts the words it loaded
    # itself, one PRMT and one FMA per value and no shuffles: 4.6 instructions
    # per value in the loop at BN 128 where joining each byte's nibbles in K
    # order took 6.1 and the int-to-float conversions it replaced 6.9
    # (benchmarks/sass_dequant_matmul.py, sm_90).  A byte's two codes are
    # columns 2t and 2t + 1, one register of the fragment: with x, scales and
    # zero points of one 16-bit dtype (the model's form computes the weight in
    # it) _int4_pairs builds that register in packed 16-bit arithmetic, one
    # PRMT and two (bf16) or three (fp16) packed FMAs per pair, the tile bit
    # for bit the model's: 3.30 / 3.64 instructions per value (bf16 / fp16) at
    # BM 16 against 4.37 / 4.34 with fp32 FMAs, 3.93 / 4.27 against 4.89 /
    # 4.86 at BM 64, and 137 registers against 168 at BM 16.
    #
    # The code books (bitsandbytes' NF4 / FP4, blocks of G, a multiple of 32,
    # and K a multiple of BK) are read as int4's words, each code's value a
    # shuffle from the lane holding it (_codebook_word: the high nibble the
    # even code), times its block's absmax in fp32 and rounded to x's dtype
    # once; a tile may span blocks (one absmax per 32 codes of a row).
    #
    # HQQ's 4-bit (N even, groups of a multiple of 16, K a multiple of BK): its
    # bytes are a [N / 2, K] matrix, row n's codes in the high nibbles of byte
    # row n for n < N / 2 and in the low nibbles of row n - N / 2 beyond; read
    # as int8's words, each row's nibble shifted down, (q - z) s in fp32 (the
    # reference's rounding) and rounded to x's dtype once.
    i_n, i_m, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_n = i_n * BN + tl.arange(0, BN)
    o_m = i_m * BM + tl.arange(0, BM)
    m_n = o_n < N
    m_m = o_m < M
    o_k = tl.arange(0, BK)
    p_w = w + o_n.to(tl.int64)[:, None] * stride_wn
    p_x = x + o_m.to(tl.int64)[None, :] * stride_xm
    dt = x.dtype.element_ty
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    CODES: tl.constexpr = FMT == "nf4" or FMT == "fp4"
    HQQ: tl.constexpr = FMT == "hqq4"
    SCALED: tl.constexpr = FMT == "int4" or CODES or HQQ  # scales (and zero points) per group, along K
    ZP: tl.constexpr = HAS_ZERO or HQQ
    if HQQ:
        N2 = N // 2
        p_w = w + tl.where(o_n < N2, o_n, o_n - N2).to(tl.int64)[:, None] * stride_wn
    if (FMT == "int8" or HQQ) and WORDS:
        o_wd = (tl.arange(0, BK // 16) * 4)[None, :, None] + tl.arange(0, 4)[None, None, :]  # [1, BK / 16, 4] words
        # column c = 16j + 8h + 2t + e of the tile holds K index 16j + 4t + 2h + e
        o_pk = (o_k // 16) * 16 + ((o_k // 2) % 4) * 4 + ((o_k // 8) % 2) * 2 + o_k % 2
    if FMT == "int4":
        ZERO_F32: tl.constexpr = HAS_ZERO and zero.dtype.element_ty == tl.float32
        # 16-bit x with its scales and zero points in the same dtype: the model's
        # form computes the weight in that dtype, and so does _int4_pairs
        PAIRS: tl.constexpr = ((dt == tl.bfloat16 or dt == tl.float16) and scale.dtype.element_ty == dt
                               and (not HAS_ZERO or zero.dtype.element_ty == dt))
    if FMT == "int4" or CODES:
        o_wd = (tl.arange(0, BK // 32) * 4)[None, :, None] + tl.arange(0, 4)[None, None, :]  # [1, BK / 32, 4] words
        # column c = 32j + 16h + 8u + 2t + e of the tile holds K index 32j + 8t + 4h + 2u + e
        o_pk = (o_k // 32) * 32 + ((o_k // 2) % 4) * 8 + ((o_k // 16) % 2) * 4 + ((o_k // 8) % 2) * 2 + o_k % 2
    if XPERM:  # (word tiles only) x already in that order (launch._x_fragment_order): rows read as stored
        o_pk = o_k
    k_lo = i_s * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    if SCALED:
        # The tile's scales and zero points, AHEAD (1 or 2) tiles before their
        # use.  The weight and x go through the pipeline's asynchronous copies;
        # these 2-byte gathers cannot, and loaded in the tile that uses them
        # each K step waits for one memory round trip: at M 16 on 4096x14336
        # (H200, ncu) the warps stalled 6.0 cycles per instruction on them
        # (long scoreboard), DRAM at 20% of its peak, 33 µs for an 11 µs floor.
        # One tile ahead 26.5 against 32.2 µs there, two at M 64 42.7 against
        # 62.0 (the plans' tiles, H200); carried across steps they cost layout
        # conversions (shuffles) that AHEAD 0 does not.
        if CODES:  # [BN, BK / 32]: an absmax per 32 codes (one block when BK <= G)
            p_s = scale + o_n[:, None] * stride_sn + (tl.arange(0, BK // 32) * 32 // G)[None, :]
            p_z = p_s
            m_s = m_n[:, None]
        elif HQQ:  # [BN, BK / 16]: a scale and zero point per 16 codes
            o_g = (tl.arange(0, BK // 16) * 16 // G)[None, :]
            p_s = scale + o_n[:, None] * stride_sn + o_g
            p_z = zero + o_n[:, None] * stride_sn + o_g
            m_s = m_n[:, None]
        else:
            p_s = scale + o_n * stride_sn
            p_z = zero + o_n * stride_sn
            m_s = m_n
        b_s1, b_z1 = _scale_row(p_s, p_z, k_lo, k_hi, m_s, G, ZP)
        b_s2, b_z2 = _scale_row(p_s, p_z, k_lo + BK, k_hi, m_s, G, ZP)
    for k0 in range(k_lo, k_hi, BK):
        if SCALED:
            if AHEAD == 0:
                b_sk, b_zk = _scale_row(p_s, p_z, k0, k_hi, m_s, G, ZP)
            elif AHEAD == 1:
                b_sk, b_zk = b_s1, b_z1
                b_s1, b_z1 = _scale_row(p_s, p_z, k0 + BK, k_hi, m_s, G, ZP)
            else:
                b_sk, b_zk = b_s1, b_z1
                b_s1, b_z1 = b_s2, b_z2
                b_s2, b_z2 = _scale_row(p_s, p_z, k0 + 2 * BK, k_hi, m_s, G, ZP)
        if FMT == "int4" or CODES:
            b_wd = tl.load(p_w[:, :, None] + k0 // 8 + o_wd, mask=m_n[:, None, None], other=0)  # [BN, BK / 32, 4]
            if CODES:
                b_s = b_sk.to(tl.float32)[:, :, None]
                b_0, b_1, b_2, b_3, b_4, b_5, b_6, b_7 = _codebook_word(b_wd, zero, FMT, ASM)  # (zero: the code book)
                b_e0 = tl.join((b_0 * b_s).to(dt), (b_1 * b_s).to(dt))
                b_e1 = tl.join((b_2 * b_s).to(dt), (b_3 * b_s).to(dt))
                b_e2 = tl.join((b_4 * b_s).to(dt), (b_5 * b_s).to(dt))
                b_e3 = tl.join((b_6 * b_s).to(dt), (b_7 * b_s).to(dt))
            elif PAIRS:
                b_s = b_sk.to(tl.float32)[:, None, None, None]
                if HAS_ZERO:
                    b_z = b_zk.to(tl.float32)[:, None, None, None]
                else:
                    b_z = tl.full([BN, 1, 1, 1], 8.0, tl.float32)
                b_e0, b_e1, b_e2, b_e3 = _int4_pairs(b_wd, b_s, b_z, dt, ASM)  # [BN, BK / 32, 4, 2 (e)] each
            else:
                b_s = b_sk.to(tl.float32)[:, None, None]
                if HAS_ZERO:
                    b_z = b_zk[:, None, None]
                    if not ZERO_F32:
                        b_z = b_z.to(tl.float32)
                else:
                    b_z = 8.0
                b_0, b_1, b_2, b_3, b_4, b_5, b_6, b_7 = _word_128(b_wd, ASM)
                b_c = _int4_offset(b_z, b_s, ZERO_F32)
                b_e0 = tl.join(_int4_dequant(b_0, b_s, b_c, b_z, ZERO_F32).to(dt), _int4_dequant(b_1, b_s, b_c, b_z, ZERO_F32).to(dt))
                b_e1 = tl.join(_int4_dequant(b_2, b_s, b_c, b_z, ZERO_F32).to(dt), _int4_dequant(b_3, b_s, b_c, b_z, ZERO_F32).to(dt))
                b_e2 = tl.join(_int4_dequant(b_4, b_s, b_c, b_z, ZERO_F32).to(dt), _int4_dequant(b_5, b_s, b_c, b_z, ZERO_F32).to(dt))
                b_e3 = tl.join(_int4_dequant(b_6, b_s, b_c, b_z, ZERO_F32).to(dt), _int4_dequant(b_7, b_s, b_c, b_z, ZERO_F32).to(dt))
            b_w = tl.join(tl.join(b_e0, b_e1), tl.join(b_e2, b_e3))  # [BN, BK / 32, 4 (t), 2 (e), 2 (u), 2 (h)]
            b_w = tl.reshape(tl.permute(b_w, (0, 1, 5, 4, 2, 3)), [BN, BK])
            b_x = tl.load(p_x + (k0 + o_pk)[:, None], mask=m_m[None, :], other=0)  # [BK, BM], rows permuted
        elif WORDS:
            # int8 (and HQQ), whole tiles: int32 words of four values, [BN, BK / 16, 4] per
            # tile, word 4j + t holding K 16j + 4t + b; byte b = 2h + e goes to
            # column 16j + 8h + 2t + e, the A fragment's place, as for int4.
            b_wd = tl.load(p_w[:, :, None] + k0 // 4 + o_wd, mask=m_n[:, None, None], other=0)  # [BN, BK / 16, 4]
            if HQQ:
                b_s = b_sk.to(tl.float32)[:, :, None]
                b_z = b_zk.to(tl.float32)[:, :, None]
                # (the row's half chosen per row; with any shift of the words before
                # the conversion Triton moves the dequantised tile through shared
                # memory before the dot, sm_90 SASS, cause not found: 1.7-2.6x int4's
                # time from 16 rows, H200)
                b_hi = (i_n * BN + tl.arange(0, BN) < N2)[:, None, None]
                b_0, b_1, b_2, b_3 = _nibble_word(tl.where(b_hi, b_wd >> 4, b_wd) & 0x0F0F0F0F, ASM)
                b_0 = ((b_0 - b_z) * b_s).to(dt)
                b_1 = ((b_1 - b_z) * b_s).to(dt)
                b_2 = ((b_2 - b_z) * b_s).to(dt)
                b_3 = ((b_3 - b_z) * b_s).to(dt)
            else:
                b_0, b_1, b_2, b_3 = _int8_word(b_wd, ASM)
                b_0, b_1, b_2, b_3 = b_0.to(dt), b_1.to(dt), b_2.to(dt), b_3.to(dt)
            b_w = tl.join(tl.join(b_0, b_1), tl.join(b_2, b_3))  # [.., 4 (t), 2 (e), 2 (h)]
            b_w = tl.reshape(tl.permute(b_w, (0, 1, 4, 2, 3)), [BN, BK])
            b_x = tl.load(p_x + (k0 + o_pk)[:, None], mask=m_m[None, :], other=0)  # [BK, BM], rows permuted
        else:
            if EVEN_K:
                b_q = tl.load(p_w + (k0 + o_k)[None, :], mask=m_n[:, None], other=0)
                b_x = tl.load(p_x + (k0 + o_k)[:, None], mask=m_m[None, :], other=0)
            else:
                m_k = k0 + o_k < k_hi
                b_q = tl.load(p_w + (k0 + o_k)[None, :], mask=m_n[:, None] & m_k[None, :], other=0)
                b_x = tl.load(p_x + (k0 + o_k)[:, None], mask=m_m[None, :] & m_k[:, None], other=0)
            if FMT == "int8":
                b_w = _int8_to_f32(b_q).to(dt)
            else:
                b_w = b_q.to(tl.float8e4nv, bitcast=True).to(dt)
        acc = _dot(b_w, b_x, acc, DOT_F32)
    if FMT == "int8" or FMT == "fp8":
        acc *= tl.load(scale + o_n, mask=m_n, other=0).to(tl.float32)[:, None]
    m_o = m_n[:, None] & m_m[None, :]
    o_o = o_m.to(tl.int64)[None, :] * N + o_n[:, None]
    _finish(acc, out, part, bias + o_n[:, None], m_n[:, None], ctr + i_n * tl.num_programs(1) + i_m, o_o, m_o,
            i_s, tl.num_programs(2), M, N, HAS_BIAS, PARTIAL, SUM_HERE)
