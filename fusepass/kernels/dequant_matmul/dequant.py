"""The cuBLAS path's first pass: the weight dequantised into x's dtype."""

from __future__ import annotations

import triton
import triton.language as tl

from fusepass.kernels.dequant_matmul.tiles import _block_scales, _int8_to_f32, _library_tile, _nibbles_to_f32


@triton.jit
def _nested_absmax_kernel(a8, nest, code, offset, out, n, BLOCK: tl.constexpr):
    # bitsandbytes' double quantization expanded to the fp32 absmax [n] the
    # tensor-core and cuBLAS plans read (the one-row grids read it as stored):
    # one launch where the same in plain torch took several (at 16 rows on
    # 14336x4096 NF4 the op ran 66.2 µs against 45.1 with an fp32 absmax given,
    # H200, a6dd2c7).
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    tl.store(out + o, _block_scales(a8, (nest, code, offset), o, m, True), mask=m)


@triton.jit
def _dequant_kernel(w, scale, zero, g_idx, shifts, out, N, K, NG, stride_wn, stride_sn,
                    FMT: tl.constexpr, G: tl.constexpr, HAS_ZERO: tl.constexpr, LIB: tl.constexpr,
                    BN: tl.constexpr, BK: tl.constexpr):
    # [N, K] weight in out's dtype, for the cuBLAS path.  int4: BK divides G.
    i_n, i_k = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < N
    k0 = i_k * BK
    p_o = out + o_n.to(tl.int64)[:, None] * K
    if LIB:
        o_k = k0 + tl.arange(0, BK)
        m = m_n[:, None] & (o_k < K)[None, :]
        b_w = _library_tile(w, scale, zero, g_idx, shifts, o_n[:, None], o_k[None, :], m, N, K, NG, stride_wn, stride_sn,
                            FMT, G)
        tl.store(p_o + o_k[None, :], b_w.to(out.dtype.element_ty), mask=m)
    elif FMT == "int4":
        BKP: tl.constexpr = BK // 2
        o_kp = tl.arange(0, BKP)
        m = m_n[:, None] & (k0 + 2 * o_kp < K)[None, :]
        b_q = tl.load(w + o_n.to(tl.int64)[:, None] * stride_wn + (k0 // 2 + o_kp)[None, :], mask=m, other=0)
        b_lo, b_hi = _nibbles_to_f32(b_q)
        b_s = tl.load(scale + o_n * stride_sn + k0 // G, mask=m_n, other=0).to(tl.float32)[:, None]
        if HAS_ZERO:
            b_z = tl.load(zero + o_n * stride_sn + k0 // G, mask=m_n, other=0).to(tl.float32)[:, None]
        else:
            b_z = 8.0
        # Interleaved back into one [BN, BK] tile (column 2j low nibble, 2j + 1
        # high) and stored as whole rows: storing the [BN, BKP, 2] pairs
        # directly wrote 4 bytes at a time, 3.5x slower than the copy bandwidth
        # (int4 4096x4096: the dequant + cuBLAS plan took 79 µs at M256 where
        # Inductor's dequant form took 45, H100).
        b_w = tl.reshape(tl.join((b_lo - b_z) * b_s, (b_hi - b_z) * b_s), (BN, BK))
        o_k = k0 + tl.arange(0, BK)
        tl.store(p_o + o_k[None, :], b_w.to(out.dtype.element_ty), mask=m_n[:, None] & (o_k < K)[None, :])
    else:
        o_k = k0 + tl.arange(0, BK)
        m = m_n[:, None] & (o_k < K)[None, :]
        b_q = tl.load(w + o_n.to(tl.int64)[:, None] * stride_wn + o_k[None, :], mask=m, other=0)
        if FMT == "int8":
            b_w = _int8_to_f32(b_q)
        else:
            b_w = b_q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        b_w *= tl.load(scale + o_n, mask=m_n, other=0).to(tl.float32)[:, None]
        tl.store(p_o + o_k[None, :], b_w.to(out.dtype.element_ty), mask=m)
