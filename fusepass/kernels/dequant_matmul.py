"""Weight-only quantized linear: y = x @ dequant(W)^T (+ bias), in one op.

    x      [..., K]  fp32 / fp16 / bf16 activations
    weight            int8 [N, K]                    fmt "int8"
                      uint8 [N, K // 2]              fmt "int4": two 4-bit values per byte
                                                     along K, low nibble = even column,
                                                     high nibble = odd column
                      float8_e4m3fn [N, K]           fmt "fp8"
    scale             [N] (int8, fp8) or [N, K // group_size] (int4)
    zero              int4 only: [N, K // group_size] (asymmetric), or None for the
                      symmetric form with a fixed offset of 8
    W[n, k] = (q[n, k] - zero[n, k // G]) * scale[n, k // G]      (int4)
    W[n, k] = q[n, k] * scale[n]                                  (int8, fp8)
    y [..., N] in x's dtype

The product accumulates in fp32 with the scale applied to the fp32 result
(or to the dequantised tile), so it agrees within the dtype table with both
source forms the rules match: scale before the matmul (``x @ (q * s).T``) and
after (``(x @ q.T) * s``).

Four ways to run it on CUDA, chosen per (GPU, format, group, M bucket, N, K)
by timing them once (``dequant_matmul_plan``):

- ``gemv``: one row (two for int4, a few on small weights).  A weight
  stream: each program owns BN output rows and a slice of K, loads the weight
  tile once, dequantises in registers and multiplies it into every row of x
  with fp32 FMAs.
- ``mmt``: from two rows to a few hundred.  Tensor cores on the product
  transposed, out^T = W x^T: the dequantised weight tile is the dot's A
  operand, x^T (rows padded to 16) the B operand.
- ``mm``: the same with x as the A operand, where it measured faster.
- ``cublas``: large M, where the product is compute-bound: one Triton pass
  writes the dequantised weight in x's dtype, then ``torch.mm``.  Fused
  tensor-core kernels measured slower there on an H100 (1.24-2.1x cuBLAS's
  time at M = 1024-4096, against 1.03-1.33x for this; Triton's own bf16 dot
  reached 1.16-1.39x): ``benchmarks/sweep_dequant_matmul_large_m.py``.

Where N alone gives too few programs to fill the SMs, K is split over
several (split-K); each tile's last program to arrive sums the slices, so a
split costs no second launch (``_finish`` and the counters in the launcher).

The op receives the user's weight on every call (a functional op cannot keep
a repacked copy), so every kernel reads the layouts above as they are.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl
from torch import Tensor

from fusepass.kernels._common import cdiv, interpreting, on_device, rows, run_kernel, sm_count

log = logging.getLogger("fusepass")

FORMATS = ("int8", "int4", "fp8")
WEIGHT_DTYPES = {"int8": torch.int8, "int4": torch.uint8, "fp8": torch.float8_e4m3fn}
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ------------------------------------------------------------------ kernels ----
#
# Integer -> fp32 without I2F: an integer u in [0, 2**23) or'ed (added) into
# the bits of 2.0**23 is the float 2**23 + u, exactly; one integer op and one
# FADD instead of a conversion, which Hopper issues at 16 per clock per SM
# against 128 FADDs.  At 3 TB/s of int8 weights a GEMV converts 23 K values
# per microsecond per SM, 81% of the I2F rate: the conversion would bound it.
# int8: v + 128 in [0, 256), so bits = v + 0x4B000080 and 2**23 + 128 comes off.


@triton.jit
def _int8_to_f32(b_q):
    return (b_q.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def _nibbles_to_f32(b_q, OFFSET: tl.constexpr = 0.0):
    """uint8 bytes -> (low nibble, high nibble) as fp32 in [0, 15], minus an
    integer ``OFFSET`` in the same FADD (2^23 + OFFSET is exact in fp32)."""
    b_i = b_q.to(tl.int32)
    b_lo = ((b_i & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + OFFSET)
    b_hi = (((b_i >> 4) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + OFFSET)
    return b_lo, b_hi


@triton.jit
def _nibbles_128(b_q, ASM: tl.constexpr):
    """uint8 bytes -> (128 + low nibble, 128 + high nibble) as fp32: the nibble
    goes into bits 16-19 of 128.0's bits, where the mantissa step is 1.  Then
    (128 + q) - (128 + z) is q - z exactly for every zero point that is a
    multiple of 2**-16 (all integers, all bf16 values >= 2**-9).  ASM: on the
    GPU, one PRMT per value builds the float from a masked 32-bit word (four
    bytes at a time); elsewhere (the interpreter) shifts and masks."""
    if ASM:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 t, u, c;
            mov.b32 c, 0x43000000;
            and.b32 t, $8, 0x0F0F0F0F;
            shr.u32 u, $8, 4;
            and.b32 u, u, 0x0F0F0F0F;
            prmt.b32 $0, t, c, 0x7044;
            prmt.b32 $1, t, c, 0x7144;
            prmt.b32 $2, t, c, 0x7244;
            prmt.b32 $3, t, c, 0x7344;
            prmt.b32 $4, u, c, 0x7044;
            prmt.b32 $5, u, c, 0x7144;
            prmt.b32 $6, u, c, 0x7244;
            prmt.b32 $7, u, c, 0x7344;
            }""",
            constraints="=r,=r,=r,=r,=r,=r,=r,=r,r",
            args=[b_q], dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
    else:
        b_i = b_q.to(tl.int32)
        b_lo = (((b_i & 0xF) << 16) | 0x43000000).to(tl.float32, bitcast=True)
        b_hi = (((b_i & 0xF0) << 12) | 0x43000000).to(tl.float32, bitcast=True)
        return b_lo, b_hi


@triton.jit
def _pair_to_f32(b_x, DT: tl.constexpr):
    """Two adjacent values of x in one word (int32 for 16-bit x, int64 for fp32;
    the lower address in the low half) -> (first, second) as fp32."""
    if DT == tl.bfloat16:
        return (b_x << 16).to(tl.float32, bitcast=True), (b_x & -65536).to(tl.float32, bitcast=True)
    elif DT == tl.float16:
        b_e = (b_x & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        b_o = (b_x >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return b_e, b_o
    else:
        b_e = (b_x & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
        b_o = (b_x >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        return b_e, b_o


@triton.jit
def _dot(a, b, acc, F32: tl.constexpr):
    # F32: fp32 activations ("ieee": exact, no TF32), and the interpreter,
    # whose bf16 dot returns garbage (Triton 3.9, CPU: max error 2e10 on a
    # 16x16 product); the operands are already rounded to x's dtype, so fp32
    # products of them are what the tensor cores compute.
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _finish(acc, out, part, p_b, m_b, ctr, o_o, m_o, i_s, n_split, M, N,
            HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, SUM_HERE: tl.constexpr):
    """Store one program's fp32 tile ``acc`` (offsets ``o_o`` into out [M, N],
    mask ``m_o``; bias at ``p_b``, mask ``m_b``, broadcast against it).

    Whole K: the result, cast to out's dtype.  A slice of K (PARTIAL): the
    partial sum into ``part`` [n_split, M, N]; then, with SUM_HERE, the tile's
    last program to arrive (its count at ``ctr``) sums the slices in slice
    order, whichever program that is, and stores the result: no second kernel.
    The count is released after a barrier, so every thread's partial is in
    memory before it (the pattern of CUTLASS's split-K semaphore); the last
    program reads the slices from L2 (.cg), not from a stale L1, and sets the
    count back to zero for the next launch."""
    if PARTIAL:
        tl.store(part + i_s.to(tl.int64) * M * N + o_o, acc, mask=m_o)
        if SUM_HERE:
            tl.debug_barrier()
            if tl.atomic_add(ctr, 1) == n_split - 1:  # acq_rel, gpu scope; one thread, broadcast
                acc = tl.load(part + o_o, mask=m_o, other=0, cache_modifier=".cg")
                for s in range(1, n_split):
                    acc += tl.load(part + (s * M).to(tl.int64) * N + o_o, mask=m_o, other=0, cache_modifier=".cg")
                _store_result(acc, out, p_b, m_b, o_o, m_o, HAS_BIAS)
                tl.atomic_xchg(ctr, 0)
    else:
        _store_result(acc, out, p_b, m_b, o_o, m_o, HAS_BIAS)


@triton.jit
def _store_result(acc, out, p_b, m_b, o_o, m_o, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(p_b, mask=m_b, other=0).to(tl.float32)
    tl.store(out + o_o, acc.to(out.dtype.element_ty), mask=m_o)


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


@triton.jit
def _dequant_mm_kernel(
    x, w, scale, zero, bias, out, part, ctr,
    M, N, K, K_SPLIT,
    stride_xm, stride_wn, stride_sn,
    FMT: tl.constexpr, G: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr, SUM_HERE: tl.constexpr, EVEN_K: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, DOT_F32: tl.constexpr,
    PERM: tl.constexpr,
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
def _dequant_mmt_kernel(
    x, w, scale, zero, bias, out, part, ctr,
    M, N, K, K_SPLIT,
    stride_xm, stride_wn, stride_sn,
    FMT: tl.constexpr, G: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
    SUM_HERE: tl.constexpr, EVEN_K: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, DOT_F32: tl.constexpr,
):
    # Small M, the product transposed: out^T [BN, BM] = W [BN, BK] @ x^T [BK, BM].
    # The dequantised weight tile is the dot's A operand, used from registers,
    # and x^T the B operand as loaded.  int4: the low and high nibbles of each
    # byte are joined back into K order in place (each thread keeps its own
    # pairs), so one dot of depth BK covers the tile; on the H100 this ran
    # 0.61-1.00x gemlite A16W4's time at M = 16-64 where the `mm` kernel (x as
    # A, two half-depth dots) ran 1.4-2.4x (benchmarks/sweep_dequant_matmul_small_m.py,
    # commit d5c4001).  int4 tiles lie within one group (BK divides G, G divides
    # K); int8 / fp8 values are exact in x's 16-bit dtype and the per-row scale
    # goes on the fp32 sum.
    i_n, i_m, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_n = i_n * BN + tl.arange(0, BN)
    o_m = i_m * BM + tl.arange(0, BM)
    m_n = o_n < N
    m_m = o_m < M
    BKP: tl.constexpr = BK // 2
    o_kp = tl.arange(0, BKP)
    o_k = tl.arange(0, BK)
    p_w = w + o_n.to(tl.int64)[:, None] * stride_wn
    p_x = x + o_m.to(tl.int64)[None, :] * stride_xm
    dt = x.dtype.element_ty
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    k_lo = i_s * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    for k0 in range(k_lo, k_hi, BK):
        if FMT == "int4":
            b_q = tl.load(p_w + (k0 // 2 + o_kp)[None, :], mask=m_n[:, None], other=0)  # [BN, BK / 2] bytes
            b_s = tl.load(scale + o_n * stride_sn + k0 // G, mask=m_n, other=0).to(tl.float32)[:, None]
            if HAS_ZERO:
                b_z = tl.load(zero + o_n * stride_sn + k0 // G, mask=m_n, other=0).to(tl.float32)[:, None]
            else:
                b_z = 8.0
            b_zs = b_z * b_s
            b_lo = ((b_q & 0xF).to(tl.float32) * b_s - b_zs).to(dt)
            b_hi = ((b_q >> 4).to(tl.float32) * b_s - b_zs).to(dt)
            b_w = tl.reshape(tl.join(b_lo, b_hi), [BN, BK])  # column 2j + t: byte j's nibble t
            b_x = tl.load(p_x + (k0 + o_k)[:, None], mask=m_m[None, :], other=0)  # [BK, BM]
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
    if FMT != "int4":
        acc *= tl.load(scale + o_n, mask=m_n, other=0).to(tl.float32)[:, None]
    m_o = m_n[:, None] & m_m[None, :]
    o_o = o_m.to(tl.int64)[None, :] * N + o_n[:, None]
    _finish(acc, out, part, bias + o_n[:, None], m_n[:, None], ctr + i_n * tl.num_programs(1) + i_m, o_o, m_o,
            i_s, tl.num_programs(2), M, N, HAS_BIAS, PARTIAL, SUM_HERE)


@triton.jit
def _splitk_reduce_kernel(part, bias, out, M, N, SPLIT, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m_o = o < M * N
    acc = tl.load(part + o, mask=m_o, other=0)
    for i_s in range(1, SPLIT):
        acc += tl.load(part + (i_s * M).to(tl.int64) * N + o, mask=m_o, other=0)
    if HAS_BIAS:
        acc += tl.load(bias + o % N, mask=m_o, other=0).to(tl.float32)
    tl.store(out + o, acc.to(out.dtype.element_ty), mask=m_o)


@triton.jit
def _dequant_kernel(w, scale, zero, out, N, K, stride_wn, stride_sn,
                    FMT: tl.constexpr, G: tl.constexpr, HAS_ZERO: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # [N, K] weight in out's dtype, for the cuBLAS path.  int4: BK divides G.
    i_n, i_k = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < N
    k0 = i_k * BK
    p_o = out + o_n.to(tl.int64)[:, None] * K
    if FMT == "int4":
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


# ----------------------------------------------------------------- launch ----


@dataclass(frozen=True)
class Config:
    """One way to run the product.  kind: "gemv", "mm", "mmt" (the product
    transposed, the weight as the dot's A operand) or "cublas"."""

    kind: str
    BN: int = 0
    BK: int = 0
    BM: int = 0  # mm only; gemv takes BM = next power of two >= M
    split: int = 1  # K slices wanted (the launcher rounds to whole BK tiles)
    warps: int = 4
    stages: int = 1
    perm: int = 0  # int4 mm: one dot over a permuted K order instead of two over split x

    def label(self) -> str:
        if self.kind == "cublas":
            return "cublas"
        bm = f"BM{self.BM}-" if self.kind in ("mm", "mmt") else ""
        perm = "-perm" if self.perm else ""
        return f"{self.kind}-{bm}BN{self.BN}-BK{self.BK}-S{self.split}-W{self.warps}-st{self.stages}{perm}"


CUBLAS = Config("cublas")
# M buckets of the plan table: a plan measured at the bucket's M serves every
# M in (bucket / 2, bucket]; above the last one, M itself is the key.
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_GEMV_MAX_M = 8  # the GEMV's per-row FMA loop is unrolled M times
_GROUP_M = 8


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def m_bucket(M: int) -> int:
    for b in BUCKETS:
        if M <= b:
            return b
    return M


def _k_split(K: int, BK: int, split: int) -> tuple[int, int, bool]:
    """(K per slice, slices, whether every slice is whole BK tiles ending at K)."""
    k_split = cdiv(cdiv(K, max(1, split)), BK) * BK
    n = cdiv(K, k_split)
    return k_split, n, k_split * n == K


def _workspace(split: int, M: int, N: int, like: Tensor) -> Tensor:
    return torch.empty((split, M, N), dtype=torch.float32, device=like.device)


# -- split-K counters -------------------------------------------------------------
#
# With K split over several programs per output tile, the tile's last program
# to arrive sums the slices (_finish), counting arrivals in an int32 per tile
# that must read zero when the launch starts and that the last program sets
# back to zero.  A launch gets counters no other launch can be using at the
# same time: eager launches one region per CUDA stream (launches on a stream
# run one after another); launches captured into a CUDA graph a region of
# their own for the graph's whole life, taken from a pool zeroed before any
# capture (a capture cannot zero memory without putting the zeroing into
# every replay).  Where none can be had (a capture before any eager launch on
# the device, the pool used up, more tiles than a region), the slices are
# summed by a second kernel as before: same result, one launch more.
#
# The counters live as long as the process, so they must not come from a
# CUDA-graph memory pool: torch.compile's CUDA graphs run their warm-up calls
# eagerly with every allocation of the calling thread sent to the graphs' pool,
# and a tensor that outlives the call there fails their check ("tensor(s) in
# the cudagraph pool not tracked as outputs"; Llama-3-8B at batch 8 through
# generate, H100, 9ec0c5a).  So they are allocated and zeroed on a thread of
# their own, whose allocations go to the ordinary pool, which is waited for.

_STREAM_COUNTERS = 1 << 14  # per stream, for eager launches
_CAPTURE_COUNTERS = 1 << 20  # per device, for captured launches (4 MB)
_counters_lock = threading.Lock()
_stream_counters: dict[tuple[int, int], Tensor] = {}
_capture_pools: dict[int, list] = {}  # device index -> [pool, next free counter]


def _zeros_outside_graph_pools(n: int, device: torch.device) -> Tensor:
    """``n`` zeroed int32 on ``device``, allocated outside any CUDA-graph memory pool."""
    box: list = []

    def alloc() -> None:
        try:
            with torch.cuda.device(device):
                t = torch.zeros(n, dtype=torch.int32, device=device)
                torch.cuda.current_stream(device).synchronize()
            box.append(t)
        except BaseException as exc:  # noqa: BLE001 - raised again on the calling thread
            box.append(exc)

    thread = threading.Thread(target=alloc, name="fusepass-split-counters")
    thread.start()
    thread.join()
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


def _split_counters(device: torch.device, tiles: int) -> Tensor | None:
    """``tiles`` zeroed counters for one split-K launch on the current stream, or None."""
    if device.type != "cuda":  # the interpreter runs programs one after another
        return torch.zeros(tiles, dtype=torch.int32, device=device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _counters_lock:
        if torch.cuda.is_current_stream_capturing():
            pool = _capture_pools.get(index)
            if pool is None or pool[1] + tiles > pool[0].numel():
                log.info("fusepass: dequant_matmul split-K in a CUDA graph without free counters; "
                         "its slices are summed by a second kernel")
                return None
            start = pool[1]
            pool[1] += tiles
            return pool[0][start:start + tiles]
        if tiles > _STREAM_COUNTERS:
            return None
        dev = torch.device("cuda", index)
        if index not in _capture_pools:
            _capture_pools[index] = [_zeros_outside_graph_pools(_CAPTURE_COUNTERS, dev), 0]
        key = (index, torch.cuda.current_stream(dev).cuda_stream)
        ctr = _stream_counters.get(key)
        if ctr is None:
            ctr = _stream_counters[key] = _zeros_outside_graph_pools(_STREAM_COUNTERS, dev)
        return ctr[:tiles]


def _run(kernel, grid, warmup: bool, *args, **meta) -> None:
    if warmup:  # compile only (the tuner compiles its candidates in parallel first)
        kernel.warmup(*args, grid=grid, **meta)
    else:
        kernel[grid](*args, **meta)


def _pairs(x: Tensor) -> Tensor:
    """x [M, K] (K even, unit column stride) as [M, K / 2] words, each two adjacent
    values: int32 for 16-bit x, int64 for fp32.  A row stride or offset that is
    odd in elements cannot be viewed so and is copied."""
    if x.stride(0) % 2 or x.storage_offset() % 2:
        x = x.clone(memory_format=torch.contiguous_format)
    return x.view(torch.int64 if x.dtype == torch.float32 else torch.int32)


def _launch(x: Tensor, w: Tensor, scale: Tensor, zero: Tensor | None, bias: Tensor | None, out: Tensor,
            fmt: str, G: int, cfg: Config, warmup: bool = False, sum_here: bool = True) -> None:
    """out[M, N] = x[M, K] @ dequant(w)^T + bias with ``cfg``; all operands as the op checked them,
    x and w with unit column stride, scale / zero / bias contiguous.  A split K is
    summed by the tile's last program where counters can be had and ``sum_here``
    (the default), else by a second kernel."""
    M, K = x.shape
    N = w.shape[0]
    if fmt == "fp8":  # loaded as bytes (a masked load's fill value cannot be cast to fp8) and bitcast
        w = w.view(torch.uint8)
    if cfg.kind == "cublas":
        wd = torch.empty((N, K), dtype=x.dtype, device=x.device)
        bn, bk = (32, min(G, 256)) if fmt == "int4" else (16, 256)
        _run(_dequant_kernel, (cdiv(N, bn), cdiv(K, bk)), warmup,
             w, scale, zero if zero is not None else scale, wd, N, K, w.stride(0), scale.stride(0),
             FMT=fmt, G=max(G, 1), HAS_ZERO=zero is not None, BN=bn, BK=bk, num_warps=4)
        if warmup:
            return
        if bias is None:
            torch.mm(x, wd.t(), out=out)
        else:
            torch.addmm(bias.to(x.dtype), x, wd.t(), out=out)
        return
    k_split, split, even = _k_split(K, cfg.BK, cfg.split)
    part = _workspace(split, M, N, x) if split > 1 else out
    ctr = None
    if split > 1 and sum_here:  # (a compile-only warmup needs only the pointer's type)
        tiles = cdiv(N, cfg.BN) * (1 if cfg.kind == "gemv" else cdiv(M, cfg.BM))
        ctr = torch.empty(0, dtype=torch.int32, device=x.device) if warmup else _split_counters(x.device, tiles)
    operands = (w, scale, zero if zero is not None else scale, bias if bias is not None else scale, out, part,
                ctr if ctr is not None else part, M, N, K, k_split)
    w_strides = (w.stride(0), scale.stride(0) if fmt == "int4" else 1)
    meta = dict(FMT=fmt, G=max(G, 1), HAS_ZERO=zero is not None, HAS_BIAS=bias is not None, PARTIAL=split > 1,
                SUM_HERE=ctr is not None, EVEN_K=even,
                BN=cfg.BN, BK=cfg.BK, num_warps=cfg.warps, num_stages=cfg.stages)
    if cfg.kind == "gemv":
        # int4 reads x as value pairs; its PTX nibble path wants 4-byte chunks within a group (G >= 8).
        xp = _pairs(x) if fmt == "int4" else x
        asm = fmt == "int4" and x.is_cuda and not interpreting() and G >= 8
        _run(_dequant_gemv_kernel, (cdiv(N, cfg.BN), split), warmup, x, xp, *operands, x.stride(0), xp.stride(0),
             *w_strides, BM=_pow2(M), ASM=asm, **meta)
    elif cfg.kind == "mmt":
        _run(_dequant_mmt_kernel, (cdiv(N, cfg.BN), cdiv(M, cfg.BM), split), warmup, x, *operands, x.stride(0),
             *w_strides, BM=cfg.BM, DOT_F32=x.dtype == torch.float32 or not x.is_cuda, **meta)
    else:
        grid = (cdiv(M, cfg.BM) * cdiv(N, cfg.BN), split)
        _run(_dequant_mm_kernel, grid, warmup, x, *operands, x.stride(0), *w_strides, BM=cfg.BM, GROUP_M=_GROUP_M,
             DOT_F32=x.dtype == torch.float32 or not x.is_cuda, PERM=bool(cfg.perm) and fmt == "int4", **meta)
    if split > 1 and not meta["SUM_HERE"]:
        block = 1024
        _run(_splitk_reduce_kernel, (cdiv(M * N, block),), warmup,
             part, bias if bias is not None else part, out, M, N, split, HAS_BIAS=bias is not None, BLOCK=block,
             num_warps=4)


def _valid(cfg: Config, M: int, K: int, fmt: str, G: int, dtype: torch.dtype) -> bool:
    if cfg.kind == "cublas":
        return True
    if cfg.kind == "gemv":
        return M <= _GEMV_MAX_M and (fmt != "int4" or cfg.BK % G == 0)
    if cfg.kind == "mmt":  # 16-deep dots of 16-bit operands; int4 tiles within one group
        return dtype != torch.float32 and cfg.BK >= 32 and cfg.BM >= 16 and (fmt != "int4" or G % cfg.BK == 0)
    # mm: tensor cores need 16-deep dots of 16-bit operands (fp32 runs the
    # "ieee" dot: exact, but no faster than the cuBLAS path, which the plan
    # takes instead), and an int4 tile within one group.
    return dtype != torch.float32 and (fmt != "int4" or (G % cfg.BK == 0 and cfg.BK >= 32))


def _auto_split(programs: int, K: int, BK: int, n_sm: int) -> int:
    """K slices that bring ``programs`` to about four per SM (one slice when N alone does)."""
    want = max(1, (4 * n_sm) // max(1, programs))
    return max(1, min(want, K // BK, 16))


def _heuristic(M: int, N: int, K: int, fmt: str, G: int, dtype: torch.dtype, n_sm: int) -> Config:
    """The plan when there is no measured one (no table entry, tuning off, CUDA-graph capture, the interpreter)."""
    if M > (2 if fmt == "int4" else 1) and N >= 2048 and (fmt != "int4" or G % 32 == 0) and dtype != torch.float32:
        # A few rows on a large weight: the transposed kernel (rows padded to 16)
        # ran 0.67-0.90x the GEMV's time, cold, at int4 M = 4-8 and int8 / fp8
        # M = 2-8 on Llama-3-8B's 4096- and 14336-row shapes (H100, 33abe0c and
        # 0e2b217); the GEMV kept int4 M = 2 and the 1024-row shape.
        bk = min(128, G) if fmt == "int4" else 128
        return Config("mmt", BM=16, BN=64, BK=bk, warps=4, stages=3, split=_auto_split(cdiv(N, 64), K, bk, n_sm))
    if M <= _GEMV_MAX_M:
        bk = 1024 if fmt == "int4" else 512
        bk = max(bk, G) if fmt == "int4" else bk
        bn = 8 if fmt == "int4" or M == 1 else max(1, 8 // _pow2(M))
        return Config("gemv", BN=bn, BK=bk, split=_auto_split(cdiv(N, bn), K, bk, n_sm), warps=4)
    if dtype == torch.float32 or M > 256:
        return CUBLAS
    bm = min(64 if M <= 64 else 128, max(16, _pow2(M)))
    if fmt != "int4" or G % 32 == 0:
        # The transposed kernel won 26 of the 27 keys of int4, int8 and fp8 at
        # M = 16-64 swept on the H100 on cold weights (Llama-3-8B shapes) and 16
        # of 18 at M = 128-256, mostly with these tiles; the split is half the
        # one that brings the grid to four programs per SM.
        bk = min(128, G) if fmt == "int4" else 128
        return Config("mmt", BM=bm, BN=64, BK=bk, warps=4, stages=3,
                      split=max(1, _auto_split(cdiv(N, 64) * cdiv(M, bm), K, bk, n_sm) // 2))
    bk = min(64, G) if fmt == "int4" else 64
    bn = 64 if M <= 64 else 128
    progs = cdiv(M, bm) * cdiv(N, bn)
    return Config("mm", BM=bm, BN=bn, BK=bk, split=_auto_split(progs, K, bk, n_sm), warps=4, stages=3)


def _candidates(M: int, N: int, K: int, fmt: str, G: int, dtype: torch.dtype, n_sm: int) -> list[Config]:
    """The few configs the tuner times for one key (each a Triton compile on first use: keep it short)."""
    out: list[Config] = []

    def add(cfg: Config) -> None:
        if _valid(cfg, M, K, fmt, G, dtype) and cfg not in out:
            out.append(cfg)

    if M <= _GEMV_MAX_M:
        # Weight bytes per row per tile: 512 (int8 / fp8) is one warp of
        # 16-byte loads on one row; int4 the same bytes hold 1024 values.
        per_byte = 2 if fmt == "int4" else 1
        bm = _pow2(M)
        shapes = ((8, 512, 4), (4, 512, 4), (16, 512, 8), (8, 1024, 8), (4, 1024, 4), (16, 256, 4), (2, 1024, 4),
                  (2, 512, 4), (1, 1024, 4),
                  # Deeper tiles: more bytes in flight per thread (64-128 against 16-32),
                  # for shapes too small to fill the SMs with resident warps otherwise:
                  # at M = 1 the int8 k/v projection (1024x4096) 4.2 µs against 5.0,
                  # 4096x14336 22.9 against 24.0 (H100, cold, 3c79310).
                  (4, 2048, 8), (2, 2048, 4), (8, 2048, 8), (4, 4096, 8), (2, 4096, 4))
        if fmt == "int4":
            # One 4-byte chunk per thread per row (128 bytes per warp): a tile
            # of 128 * warps bytes keeps every thread on its own columns with
            # all BN rows in its registers (the kernel's comment says why);
            # two chunks per thread per row (256 * warps) for more bytes in flight.
            shapes = tuple((bn, chunks * 128 * warps, warps) for bn, warps, chunks in
                           ((8, 4, 1), (4, 4, 1), (16, 4, 1), (8, 8, 1), (4, 8, 1), (16, 8, 1), (8, 2, 1), (4, 2, 1),
                            (2, 4, 1), (8, 4, 2), (4, 4, 2), (4, 8, 2), (8, 8, 2)))
        for bn, kbytes, warps in shapes:
            bk = max(kbytes * per_byte, G if fmt == "int4" else 1)
            if K % bk and bk > 1024:  # a deep tile only where it divides K (a masked K breaks the 16-byte loads)
                continue
            # int8 / fp8 keep a [BM, BN, BK] fp32 sum: at most 64 registers per thread.
            if fmt != "int4" and bm * bn * bk > 64 * 32 * warps:
                continue
            if fmt == "int4" and bm * bn > 64:  # [BM, BN] sums per thread
                continue
            if M == 1 and bn < 4 and kbytes < 2048:
                continue
            auto = _auto_split(cdiv(N, bn), K, bk, n_sm)
            for split in sorted({1, auto}):
                add(Config("gemv", BN=bn, BK=bk, split=split, warps=warps))
        if M >= 4 and dtype != torch.float32:
            for bn in (64, 128):
                bk = min(64, G) if fmt == "int4" else 64
                for perm in ((0, 1) if fmt == "int4" else (0,)):
                    add(Config("mm", BM=16, BN=bn, BK=bk, split=_auto_split(cdiv(N, bn), K, bk, n_sm), stages=4,
                               perm=perm))
        if dtype != torch.float32 and (fmt != "int4" or G % 32 == 0):
            # The transposed tensor-core kernel with x's rows padded to 16: the
            # dequantisation per weight value is what a GEMV does, the products
            # go to the tensor cores instead of one FMA per value per row.
            for bn in (64, 128):
                bk = min(128, G) if fmt == "int4" else 128
                auto = _auto_split(cdiv(N, bn), K, bk, n_sm)
                for split in sorted({1, auto, max(1, auto // 2)}):
                    add(Config("mmt", BM=16, BN=bn, BK=bk, split=split, warps=4, stages=3))
        return out
    if dtype == torch.float32:
        return [CUBLAS]
    bm_small = min(64, max(16, _pow2(M)))
    shapes = [(bm_small, 64, 64, 4, 4), (bm_small, 128, 64, 4, 3), (bm_small, 64, 128, 4, 3),
              (bm_small, 128, 128, 8, 3)]
    if M >= 128:
        shapes += [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (64, 256, 64, 4, 3), (128, 128, 128, 8, 3)]
    if fmt == "int4" and M <= 64:
        # int4 at M = 16-64 ran 1.4-2.5x gemlite's A16W4 time with the tiles
        # above (H100, 6ccee15): narrower tiles (more programs, fewer registers
        # per thread for the two unpacked halves), eight warps, half the split.
        shapes += [(bm_small, 32, 128, 4, 3), (bm_small, 32, 64, 4, 4), (bm_small, 64, 64, 8, 3),
                   (bm_small, 64, 128, 8, 4)]
    for bm, bn, bk, warps, stages in shapes:
        if fmt == "int4":
            bk = min(bk, G)
        progs = cdiv(M, bm) * cdiv(N, bn)
        auto = _auto_split(progs, K, bk, n_sm)
        splits = {1, auto, max(1, auto // 2)} if fmt == "int4" and M <= 64 else {1, auto}
        for split in sorted(splits):
            for perm in ((0, 1) if fmt == "int4" else (0,)):
                add(Config("mm", BM=bm, BN=bn, BK=bk, split=split, warps=warps, stages=stages, perm=perm))
    if M <= 64:
        # The product transposed (the weight tile as the dot's A operand).
        for bn in (64, 128):
            for bk in ((64, 128) if fmt == "int4" else (128, 256)):
                for split in (1, 2, 4, 8):
                    add(Config("mmt", BM=bm_small, BN=bn, BK=min(bk, G) if fmt == "int4" else bk, split=split,
                               warps=4, stages=3))
    elif M <= 256:
        # Row blocks of 128; the winners of the H100 sweep at M = 128-256 (int4
        # 1.2-2.4x faster than dequantise + cuBLAS, int8 1.1-1.3x than `mm`).
        for bn, warps in ((64, 4), (128, 8)):
            for bk in (64, 128):
                for split in (1, 2, 4):
                    add(Config("mmt", BM=128, BN=bn, BK=min(bk, G) if fmt == "int4" else bk, split=split,
                               warps=warps, stages=3))
    if M >= 64:
        add(CUBLAS)
    return out


# -- plans: measured once per key, cached in memory and in a JSON file ----------
#
# The key is (GPU name, format, group, M bucket, N, K); fp16 and bf16 share
# it (same bytes, same instructions), fp32 has its own.  A default table
# measured on an H100 ships beside this file; plans measured on the user's
# machine go to FUSEPASS_DEQUANT_MATMUL_CACHE (default
# ~/.cache/fusepass/dequant_matmul.json, "" to keep them in memory only) and
# win over the shipped ones.  FUSEPASS_DEQUANT_MATMUL_TUNE=0 turns tuning off.

_SHIPPED = Path(__file__).with_name("dequant_matmul_plans.json")
_plans: dict[str, dict] | None = None
_plans_lock = threading.Lock()


def _cache_path() -> Path | None:
    env = os.environ.get("FUSEPASS_DEQUANT_MATMUL_CACHE")
    if env is not None:
        return Path(env) if env else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fusepass" / "dequant_matmul.json"


def _read(path: Path | None) -> dict[str, dict]:
    if path is None or not path.is_file():
        return {}
    try:
        return dict(json.loads(path.read_text()).get("plans", {}))
    except (OSError, ValueError, AttributeError) as exc:
        log.warning("fusepass: ignoring unreadable plan file %s (%s)", path, exc)
        return {}


def _load_plans() -> dict[str, dict]:
    global _plans
    with _plans_lock:
        if _plans is None:
            _plans = {**_read(_SHIPPED), **_read(_cache_path())}
        return _plans


def _save_plan(key: str, cfg: Config, us: float) -> None:
    entry = {**asdict(cfg), "us": round(us, 2)}
    with _plans_lock:
        assert _plans is not None
        _plans[key] = entry
        path = _cache_path()
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            data = _read(path)
            data[key] = entry
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"plans": dict(sorted(data.items()))}, indent=0))
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("fusepass: could not save the dequant_matmul plan to %s (%s)", path, exc)


@functools.cache
def _gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def plan_key(M: int, N: int, K: int, fmt: str, group_size: int, dtype: torch.dtype, device: torch.device) -> str:
    prec = "fp32" if dtype == torch.float32 else "16bit"
    g = f"g{group_size}" if fmt == "int4" else "gc"
    return f"{_gpu_name(device)}|{fmt}-{g}|{prec}|M{m_bucket(M)}|N{N}|K{K}"


def _tuning_allowed(device: torch.device) -> bool:
    return (device.type == "cuda" and os.environ.get("FUSEPASS_DEQUANT_MATMUL_TUNE", "1") != "0"
            and not torch.cuda.is_current_stream_capturing())


def _time_us(fn, reps: int = 10) -> float:
    """GPU time of one call: a sleep kernel first lets the host queue all the
    launches, so host overhead does not pad the small kernels' times.

    The sleep has to outlast the host's queueing.  A fixed 1M-cycle sleep
    (about 0.6 ms) can end before ten split-K calls (a workspace allocation
    and two launches each) are queued; that is the likely reason the tuner
    ranked an int4 config that runs 11.5 µs in a CUDA graph below one that
    runs 21.7 µs (H100, commit 98cc3cf).  So the sleep is timed too, and
    doubled until the host finished queueing before it ended."""
    pre, start, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    fn()
    fn()
    best = float("inf")
    cycles, tries = 1_000_000, 0
    while tries < 3:
        pre.record()
        torch.cuda._sleep(cycles)
        start.record()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        end.record()
        host_ms = (time.perf_counter() - t0) * 1e3
        end.synchronize()
        if host_ms > pre.elapsed_time(start) and cycles < 1 << 30:
            cycles *= 2  # the GPU waited for the host: not a GPU time
            continue
        tries += 1
        best = min(best, start.elapsed_time(end) * 1e3 / reps)
    return best


def _precompile(compile_one, cands: list[Config]) -> None:
    """Compile the candidates on a thread pool (the Triton compiler's C++ passes
    and ptxas run in parallel); where Triton has no asynchronous compile mode,
    the timing loop compiles them one by one instead."""
    try:
        from concurrent.futures import ThreadPoolExecutor

        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return
    try:
        with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
            with AsyncCompileMode(pool, ignore_errors=True):
                for cfg in cands:
                    try:
                        compile_one(cfg)
                    except Exception:  # noqa: BLE001 - reported by the timing loop
                        pass
    except Exception as exc:  # noqa: BLE001 - an optimisation only
        log.info("fusepass: parallel compile of dequant_matmul configs failed: %s", exc)


def cold_copies(nbytes: int, device: torch.device, limit: int = 16) -> int:
    """How many copies of ``nbytes`` of weights, called in turn, read each from
    memory and not from the L2, as a model's layers are read: three L2s' worth,
    at most ``limit`` and a quarter of the free memory (at least one).

    Timed on one weight, a weight that fits the L2 (every int4 and int8 shape
    of Llama-3-8B on an H100, 50 MB) is read from it after the first call, and
    the tuner ranked configs by that: the int4 k/v projection's plan (1024x4096,
    M = 1) ran 8.3 µs on cold weights against 3.9 for the best candidate
    (benchmarks/sweep_dequant_matmul_small_m.py, commit 1cf3eea)."""
    nbytes = max(1, nbytes)
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    free, _ = torch.cuda.mem_get_info(device)
    return max(1, min(limit, cdiv(3 * l2, nbytes), free // 4 // nbytes))


def _cold_ring(weight: Tensor, scale: Tensor, zero: Tensor | None,
               limit: int = 16) -> list[tuple[Tensor, Tensor, Tensor | None]]:
    """The weight and its copies, ``cold_copies`` in all."""
    nbytes = sum(t.numel() * t.element_size() for t in (weight, scale, zero) if t is not None)
    copies = [(weight.clone(), scale.clone(), zero.clone() if zero is not None else None)
              for _ in range(cold_copies(nbytes, weight.device, limit) - 1)]
    return [(weight, scale, zero), *copies]


def tune(M: int, N: int, K: int, fmt: str, group_size: int, dtype: torch.dtype, weight: Tensor, scale: Tensor,
         zero: Tensor | None, candidates: list[Config] | None = None) -> tuple[Config, list[tuple[Config, float]]]:
    """Time the candidate configs at M rows of random x against this weight,
    read from memory (see _cold_ring); (fastest, all times in µs per call)."""
    device = weight.device
    x = torch.randn(M, K, dtype=dtype, device=device)
    out = torch.empty(M, N, dtype=dtype, device=device)
    cands = candidates or _candidates(M, N, K, fmt, group_size, dtype, sm_count(device))
    times: list[tuple[Config, float]] = []
    with on_device(weight):
        ring = _cold_ring(weight, scale, zero)

        def calls(cfg: Config) -> None:
            for w, s, z in ring:
                _launch(x, w, s, z, None, out, fmt, group_size, cfg)

        _precompile(lambda cfg: _launch(x, weight, scale, zero, None, out, fmt, group_size, cfg, warmup=True), cands)
        for cfg in cands:
            try:
                us = _time_us(lambda: calls(cfg), reps=max(2, 16 // len(ring))) / len(ring)
            except Exception as exc:  # noqa: BLE001 - a config that does not compile or fit is skipped
                log.info("fusepass: dequant_matmul config %s failed: %s", cfg.label(), exc)
                continue
            times.append((cfg, us))
    if not times:
        raise RuntimeError(f"no dequant_matmul config ran for M{M} N{N} K{K} {fmt}")
    return min(times, key=lambda t: t[1])[0], times


def _from_entry(entry: dict) -> Config:
    return Config(**{k: v for k, v in entry.items() if k in Config.__dataclass_fields__})


def _plan(M: int, N: int, K: int, fmt: str, G: int, dtype: torch.dtype, device: torch.device,
          weight: Tensor | None = None, scale: Tensor | None = None, zero: Tensor | None = None) -> Config:
    n_sm = sm_count(device)
    if device.type != "cuda":  # the interpreter
        return _heuristic(M, N, K, fmt, G, dtype, n_sm)
    key = plan_key(M, N, K, fmt, G, dtype, device)
    entry = _load_plans().get(key)
    if entry is not None:
        cfg = _from_entry(entry)
        if _valid(cfg, M, K, fmt, G, dtype):
            return cfg
    if not _tuning_allowed(device):
        return _heuristic(M, N, K, fmt, G, dtype, n_sm)
    if weight is None:  # asked at compile time: time on a random weight of the shape
        weight, scale, zero = _random_weight(N, K, fmt, G, device)
    bucket = m_bucket(M)
    best, times = tune(bucket, N, K, fmt, G, dtype, weight, scale, zero)
    us = dict((c, t) for c, t in times)[best]
    log.info("fusepass: dequant_matmul %s -> %s (%.1f µs)", key, best.label(), us)
    _save_plan(key, best, us)
    return best


def _random_weight(N: int, K: int, fmt: str, G: int, device: torch.device):
    if fmt == "int4":
        w = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, device=device)
        s = torch.rand(N, K // G, device=device, dtype=torch.bfloat16)
        return w, s, torch.full_like(s, 8.0)
    s = torch.rand(N, device=device, dtype=torch.bfloat16)
    if fmt == "int8":
        return torch.randint(-128, 128, (N, K), dtype=torch.int8, device=device), s, None
    return torch.randn(N, K, device=device).to(torch.float8_e4m3fn), s, None


_PLAN_NAMES = {"gemv": "gemv", "mm": "tensor-core", "mmt": "tensor-core", "cublas": "dequant+cublas"}


def dequant_matmul_plan(M: int, N: int, K: int, fmt: str, group_size: int, dtype: torch.dtype,
                        device: torch.device | str) -> str:
    """How the op runs this shape: "gemv" or "tensor-core" (fused kernels),
    "dequant+cublas" (the weight dequantised, then ``torch.mm``: kept where it
    measures faster), or "reference" (fp64 and other dtypes, non-CUDA devices
    run plain torch).  Looks the plan up and, on a CUDA device with no plan
    yet, measures it (a few Triton compiles and timings, once per key)."""
    device = torch.device(device)
    if dtype not in _KERNEL_DTYPES:
        return "reference"
    if device.type != "cuda":
        return "reference"
    return _PLAN_NAMES[_plan(max(1, M), N, K, fmt, group_size, dtype, device).kind]


def dequant_matmul_fwd(x: Tensor, weight: Tensor, scale: Tensor, zero: Tensor | None, bias: Tensor | None,
                       fmt: str, group_size: int, *, config: Config | None = None) -> Tensor:
    """The op's CUDA body: ``config`` overrides the plan (tests, sweeps)."""
    if x.dtype not in _KERNEL_DTYPES:
        raise TypeError(f"no kernel for {x.dtype} activations")
    K = x.shape[-1]
    N = weight.shape[0]
    out = torch.empty((*x.shape[:-1], N), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    if K == 0:
        return out.copy_(bias.expand_as(out) if bias is not None else torch.zeros((), dtype=x.dtype))
    x2 = rows(x, K)
    if x2.stride(1) != 1:  # a broadcast row of x (stride 0): one copy
        x2 = x2.contiguous()
    # The rules refuse weights the kernels cannot read in place; any that
    # reach the op anyway are copied (correct, one extra pass over them).
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    scale = scale.contiguous()
    zero = zero.contiguous() if zero is not None else None
    bias = bias.contiguous() if bias is not None else None
    M = x2.shape[0]
    G = group_size if fmt == "int4" else 0
    cfg = config or _plan(M, N, K, fmt, G, x.dtype, x.device, weight, scale, zero)
    if not _valid(cfg, M, K, fmt, G, x.dtype):
        raise ValueError(f"config {cfg.label()} cannot run M{M} K{K} {fmt} g{G} {x.dtype}")
    with on_device(x):
        _launch(x2, weight, scale, zero, bias, out.view(M, N), fmt, G, cfg)
    return out


# --------------------------------------------------------------- reference ----


def unpack_int4(packed: Tensor) -> Tensor:
    """uint8 [N, K // 2] -> uint8 [N, K]: low nibble the even column, high nibble the odd."""
    lo = packed & 0xF
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def dequantize(weight: Tensor, scale: Tensor, zero: Tensor | None, fmt: str, group_size: int,
               dtype: torch.dtype = torch.float32) -> Tensor:
    """The [N, K] weight in ``dtype`` (computed in fp32)."""
    if fmt == "int4":
        q = unpack_int4(weight).to(torch.float32)
        N, K = q.shape
        q = q.view(N, K // group_size, group_size)
        z = zero.to(torch.float32)[..., None] if zero is not None else 8.0
        w = ((q - z) * scale.to(torch.float32)[..., None]).view(N, K)
    else:
        w = weight.to(torch.float32) * scale.to(torch.float32)[:, None]
    return w.to(dtype)


def dequant_matmul_reference(x: Tensor, weight: Tensor, scale: Tensor, zero: Tensor | None, bias: Tensor | None,
                             fmt: str, group_size: int, compute_dtype: torch.dtype = torch.float32) -> Tensor:
    """fp32 (or ``compute_dtype``) dequantise-then-matmul, rounded once to x's dtype."""
    w = dequantize(weight, scale, zero, fmt, group_size, compute_dtype)
    y = x.to(compute_dtype) @ w.t()
    if bias is not None:
        y = y + bias.to(compute_dtype)
    return y.to(x.dtype if compute_dtype != torch.float64 else compute_dtype)


def _check(x: Tensor, weight: Tensor, scale: Tensor, zero: Tensor | None, bias: Tensor | None, fmt: str,
           group_size: int) -> None:
    torch._check(fmt in FORMATS, lambda: f"fmt must be one of {FORMATS}, got {fmt!r}")
    torch._check(weight.dtype == WEIGHT_DTYPES[fmt], lambda: f"{fmt} weight must be {WEIGHT_DTYPES[fmt]}, got {weight.dtype}")
    torch._check(weight.dim() == 2, lambda: f"weight must be 2-D, got {tuple(weight.shape)}")
    N = weight.shape[0]
    K = weight.shape[1] * (2 if fmt == "int4" else 1)
    torch._check(x.shape[-1] == K, lambda: f"x has {x.shape[-1]} features, the weight {K}")
    if fmt == "int4":
        torch._check(group_size > 0 and K % group_size == 0, lambda: f"K = {K} is not a multiple of group {group_size}")
        torch._check(tuple(scale.shape) == (N, K // group_size),
                     lambda: f"scale is {tuple(scale.shape)}, not {(N, K // group_size)}")
        if zero is not None:
            torch._check(tuple(zero.shape) == (N, K // group_size),
                         lambda: f"zero is {tuple(zero.shape)}, not {(N, K // group_size)}")
    else:
        torch._check(tuple(scale.shape) == (N,), lambda: f"scale is {tuple(scale.shape)}, not ({N},)")
        torch._check(zero is None, lambda: f"{fmt} takes no zero point")
    if bias is not None:
        torch._check(tuple(bias.shape) == (N,), lambda: f"bias is {tuple(bias.shape)}, not ({N},)")


# ----------------------------------------------------------------------- op ----


def _reference_out(x, weight, scale, zero, bias, fmt, group_size) -> Tensor:
    return dequant_matmul_reference(x, weight, scale, zero, bias, fmt, group_size).contiguous()


@torch.library.custom_op("fusepass::dequant_matmul", mutates_args=())
def dequant_matmul(x: Tensor, weight: Tensor, scale: Tensor, zero: Tensor | None, bias: Tensor | None, fmt: str,
                   group_size: int) -> Tensor:
    """x @ dequant(weight)^T + bias, [..., N] contiguous in x's dtype.  This body serves CPU and every non-CUDA device."""
    _check(x, weight, scale, zero, bias, fmt, group_size)
    return _reference_out(x, weight, scale, zero, bias, fmt, group_size)


@dequant_matmul.register_fake
def _dequant_matmul_fake(x, weight, scale, zero, bias, fmt, group_size):
    _check(x, weight, scale, zero, bias, fmt, group_size)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@dequant_matmul.register_kernel("cuda")
def _dequant_matmul_cuda(x, weight, scale, zero, bias, fmt, group_size):
    _check(x, weight, scale, zero, bias, fmt, group_size)
    if x.dtype not in _KERNEL_DTYPES:  # fp64: the reference
        return _reference_out(x, weight, scale, zero, bias, fmt, group_size)
    return run_kernel(
        "dequant_matmul",
        lambda: dequant_matmul_fwd(x, weight, scale, zero, bias, fmt, group_size),
        lambda: _reference_out(x, weight, scale, zero, bias, fmt, group_size),
    )
