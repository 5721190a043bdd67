"""The GEMV kernel: one to a few rows of x against a weight stream."""

from __future__ import annotations

import triton
import triton.language as tl

from fusepass.kernels.dequant_matmul.tiles import _finish, _int8_to_f32, _nibbles_128, _pair_to_f32


@triton.jit
def _dequant_gemv_kernel(
    x, x2, w, scale, zero, bias, out, part, ctr,
    M, N, K, K_SPLIT,
    stride_xm, stride_x2m, stride_wn, stride_sn,
    FMT: tl.constexpr, G: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr, SUM_HERE: tl.constexpr, EVEN_K: tl.constexpr, ASM: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    # Program (i_n, i_s): output rows [i_n * BN, +BN) over K in [i_s * K_SPLIT, +K_SPLIT).
    # EVEN_K: the slices cover K exactly and BK divides K_SPLIT, so no load along K
    # is masked and the loads stay 16-byte vectors.
    i_n, i_s = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < N
    o_m = tl.arange(0, BM)
    k_lo = i_s * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    p_wn = w + o_n.to(tl.int64) * stride_wn
    acc = tl.zeros([BM, BN], dtype=tl.float32)

    if FMT == "int4":
        # The tile is [NCH, BN, VB]: NCH chunks of VB (4) packed bytes along K,
        # one chunk per thread per row, rows second so that a thread's registers
        # hold several rows at the same columns and convert x's columns once
        # for all of them.  Each value becomes (128 + q) - (128 + z) in one
        # FADD (_nibbles_128), goes into an FMA chain held in the thread, and
        # only the chunk's sum is scaled: nothing crosses threads inside the
        # loop.  The zero point is subtracted from each value, not folded out
        # as sum_k v x - z sum_k x: with an infinite activation the folded
        # form gives inf - inf = NaN where the dequantised matmul gives +-inf
        # (the differential tests caught it).
        GP: tl.constexpr = G // 2
        VB: tl.constexpr = 4 if GP >= 4 else GP
        NCH: tl.constexpr = BK // 2 // VB
        o_c = tl.arange(0, NCH)
        o_kp = o_c[:, None, None] * VB + tl.arange(0, VB)[None, None, :]  # [NCH, 1, VB] packed columns
        acc3 = tl.zeros([BM, NCH, BN], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BK):
            kp0 = tl.multiple_of(k0 // 2, BK // 2)  # k_lo and the step are whole tiles
            m_c = 2 * (kp0 + o_c * VB) < k_hi  # [NCH]: chunks inside the slice (a group never straddles it)
            if EVEN_K:
                b_q = tl.load(p_wn[None, :, None] + kp0 + o_kp, mask=m_n[None, :, None], other=0)
            else:
                b_q = tl.load(p_wn[None, :, None] + kp0 + o_kp, mask=m_n[None, :, None] & m_c[:, None, None], other=0)
            m_s = m_c[:, None] & m_n[None, :]
            p_s = o_n[None, :] * stride_sn + ((2 * kp0 + o_c * (2 * VB)) // G)[:, None]  # [NCH, BN]
            b_s = tl.load(scale + p_s, mask=m_s, other=0).to(tl.float32)
            b_lo, b_hi = _nibbles_128(b_q, ASM)
            if HAS_ZERO and zero.dtype.element_ty == tl.float32:
                # An fp32 zero point need not be a multiple of 2**-16: q, then q - z
                # rounded once, as the reference does.
                b_z = tl.load(zero + p_s, mask=m_s, other=0)[:, :, None]
                b_lo = (b_lo - 128.0) - b_z
                b_hi = (b_hi - 128.0) - b_z
            else:
                if HAS_ZERO:  # bf16 / fp16: 128 + z is exact for z = 0 and every z >= 2**-9 (bf16), 2**-6 (fp16)
                    b_c = 128.0 + tl.load(zero + p_s, mask=m_s, other=0).to(tl.float32)[:, :, None]
                else:
                    b_c = 136.0
                b_lo = b_lo - b_c  # q - z in one FADD
                b_hi = b_hi - b_c
            for m in tl.static_range(BM):
                # x's (even, odd) column pairs, one 32-bit word each (x2 is x viewed
                # as int32, or int64 for fp32 x), split with a shift or a mask.
                # Rows past M read row M - 1 (their sums are never stored): no row mask.
                p_x = x2 + tl.minimum(m, M - 1) * stride_x2m + kp0 + o_kp
                if EVEN_K:
                    b_x = tl.load(p_x)
                else:
                    b_x = tl.load(p_x, mask=m_c[:, None, None], other=0)
                b_xe, b_xo = _pair_to_f32(b_x, x.dtype.element_ty)
                b_d = tl.sum(b_lo * b_xe, axis=2) + tl.sum(b_hi * b_xo, axis=2)  # [NCH, BN]
                acc3 += tl.where(o_m[:, None, None] == m, (b_d * b_s)[None], 0.0)
        acc += tl.sum(acc3, axis=1)
    else:
        o_k = tl.arange(0, BK)
        if BM == 1:
            # One row of x: accumulate products elementwise and reduce across
            # the K lanes once at the end, not once per tile.
            acc1 = tl.zeros([BN, BK], dtype=tl.float32)
            for k0 in range(k_lo, k_hi, BK):
                if EVEN_K:
                    b_q = tl.load(p_wn[:, None] + (k0 + o_k)[None, :], mask=m_n[:, None], other=0)
                    b_x = tl.load(x + k0 + o_k).to(tl.float32)
                else:
                    m_k = k0 + o_k < k_hi
                    b_q = tl.load(p_wn[:, None] + (k0 + o_k)[None, :], mask=m_n[:, None] & m_k[None, :], other=0)
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
                if EVEN_K:
                    b_q = tl.load(p_wn[:, None] + (k0 + o_k)[None, :], mask=m_n[:, None], other=0)
                    b_x = tl.load(p_xm + (k0 + o_k)[None, :]).to(tl.float32)
                else:
                    m_k = k0 + o_k < k_hi
                    b_q = tl.load(p_wn[:, None] + (k0 + o_k)[None, :], mask=m_n[:, None] & m_k[None, :], other=0)
                    b_x = tl.load(p_xm + (k0 + o_k)[None, :], mask=m_k[None, :], other=0).to(tl.float32)
                if FMT == "int8":
                    b_w = _int8_to_f32(b_q)
                else:
                    b_w = b_q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
                acc3 += b_w[None, :, :] * b_x[:, None, :]
            acc += tl.sum(acc3, axis=2)
        acc *= tl.load(scale + o_n, mask=m_n, other=0).to(tl.float32)[None, :]

    m_o = (o_m[:, None] < M) & m_n[None, :]
    _finish(acc, out, part, bias + o_n[None, :], m_n[None, :], ctr + i_n, o_m[:, None] * N + o_n[None, :], m_o,
            i_s, tl.num_programs(1), M, N, HAS_BIAS, PARTIAL, SUM_HERE)
