"""Triton pieces shared by the MoE experts kernels: an expert's weight tile
(plain or dequantised), the gated activation with the models' roundings, and
the down projection's epilogue.

Weights are addressed as [N, K] (out, in features) through two strides, so
one loader reads both transformers layouts: [E, N, K] (stride_n = K,
stride_k = 1) and the transposed [E, K, N] of gpt-oss (stride_n = 1,
stride_k = N).  Quantized weights are [E, N, K] only, as
``fusepass.kernels.dequant_matmul`` stores one: int8 and fp8 per output
channel (the scale multiplies the accumulator), int4 in groups of G along K
(two codes per byte, low nibble first; the scale and zero point multiply the
tile, so a tile never spans two groups: BK divides G).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusepass.kernels.dequant_matmul import _int8_to_f32, _nibbles_to_f32


@triton.jit
def _round(v, DT: tl.constexpr):
    """v rounded to the model's dtype DT and back to fp32 (a no-op for fp32)."""
    return v.to(DT).to(tl.float32)


@triton.jit
def w_tile(p_w, o_n, m_n, k0, K, stride_n, stride_k, p_s, p_z, stride_sn,
           FMT: tl.constexpr, G: tl.constexpr, HAS_ZERO: tl.constexpr, BK: tl.constexpr):
    """The weight tile W[o_n, k0 : k0 + BK] of one expert (``p_w`` its [N, K]
    base), [len(o_n), BK]: in the weight's dtype (plain), or fp32 (int8 and fp8
    unscaled, int4 dequantised with its group's scale and zero).  Elements
    past N or K read 0."""
    o_k = k0 + tl.arange(0, BK)
    m = m_n[:, None] & (o_k < K)[None, :]
    if FMT == "none":
        return tl.load(p_w + o_n[:, None] * stride_n + o_k[None, :] * stride_k, mask=m, other=0.0)
    elif FMT == "int8":
        return _int8_to_f32(tl.load(p_w + o_n[:, None] * stride_n + o_k[None, :], mask=m, other=0))
    elif FMT == "fp8":
        b_q = tl.load(p_w + o_n[:, None] * stride_n + o_k[None, :], mask=m, other=0)
        return b_q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        BKP: tl.constexpr = BK // 2
        o_kp = k0 // 2 + tl.arange(0, BKP)
        b_q = tl.load(p_w + o_n[:, None] * stride_n + o_kp[None, :], mask=m_n[:, None] & (2 * o_kp < K)[None, :],
                      other=0)
        b_lo, b_hi = _nibbles_to_f32(b_q)
        b_s = tl.load(p_s + o_n * stride_sn + k0 // G, mask=m_n, other=0).to(tl.float32)[:, None]
        if HAS_ZERO:
            b_z = tl.load(p_z + o_n * stride_sn + k0 // G, mask=m_n, other=0).to(tl.float32)[:, None]
        else:
            b_z = 8.0
        return tl.reshape(tl.join((b_lo - b_z) * b_s, (b_hi - b_z) * b_s), (o_n.shape[0], BK))


@triton.jit
def row_scale(p_s, o_n, m_n, FMT: tl.constexpr):
    """int8 / fp8: the per-channel scale of rows o_n, [len(o_n)] fp32; 1 otherwise."""
    if FMT == "int8" or FMT == "fp8":
        return tl.load(p_s + o_n, mask=m_n, other=0).to(tl.float32)
    else:
        return tl.full(o_n.shape, 1.0, tl.float32)


@triton.jit
def dot(a, b, acc, F32: tl.constexpr):
    # F32: fp32 operands ("ieee": no TF32, as eager's fp32 matmul), and the
    # interpreter, whose bf16 dot returns garbage (Triton 3.9 on CPU).
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def gated_act(b_g, b_u, DT: tl.constexpr, ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr):
    """act(gate, up) in fp32 from gate and up already rounded to DT, with
    eager's roundings to DT after each step; the result unrounded (the caller
    stores it in DT)."""
    if ACT == "silu":
        # ATen's CUDA silu: x / (1 + exp(-x)); x -> -inf gives -0.
        b_a = _round(b_g / (1.0 + tl.exp(-b_g)), DT)
        return b_a * b_u
    elif ACT == "gelu":
        b_a = _round(b_g * 0.5 * (1.0 + tl.math.erf(b_g * 0.7071067811865476)), DT)
        return b_a * b_u
    elif ACT == "gelu_tanh":
        # x/2 (1 + tanh(z)) = x / (1 + exp(-2z)), as fusepass's gated_act kernel.
        b_z = 0.7978845608028654 * (b_g + 0.044715 * b_g * b_g * b_g)
        b_a = _round(b_g / (1.0 + tl.exp(-2.0 * b_z)), DT)
        return b_a * b_u
    else:
        # gpt-oss: gate.clamp(max=limit), up.clamp(-limit, limit),
        # glu = gate * sigmoid(gate * alpha), (up + 1) * glu; each step rounds.
        b_g = tl.minimum(b_g, LIMIT)
        b_u = tl.minimum(tl.maximum(b_u, -LIMIT), LIMIT)
        b_t = _round(b_g * ALPHA, DT)
        b_sig = _round(1.0 / (1.0 + tl.exp(-b_t)), DT)
        b_glu = _round(b_g * b_sig, DT)
        return _round(b_u + 1.0, DT) * b_glu


@triton.jit
def gate_up_epilogue(acc_g, acc_u, s_g, s_u, p_b, o_g, o_u, m_n, DT: tl.constexpr, HAS_BIAS: tl.constexpr,
                     ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr):
    """[BM, BN] fp32 gate and up sums -> act in fp32 (to be stored in DT):
    per-channel scales (s_g, s_u), the projection's rounding, its bias (columns
    o_g, o_u of the expert's bias row at p_b) and its rounding, the activation."""
    b_g = _round(acc_g * s_g[None, :], DT)
    b_u = _round(acc_u * s_u[None, :], DT)
    if HAS_BIAS:
        b_g = _round(b_g + tl.load(p_b + o_g, mask=m_n, other=0).to(tl.float32)[None, :], DT)
        b_u = _round(b_u + tl.load(p_b + o_u, mask=m_n, other=0).to(tl.float32)[None, :], DT)
    return gated_act(b_g, b_u, DT, ACT, ALPHA, LIMIT)


@triton.jit
def down_epilogue(acc, s_d, p_b, o_n, m_n, b_w, DT: tl.constexpr, WDT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """[BM, BN] fp32 down sums -> the routed contribution in fp32: scale,
    rounding, bias and rounding, times the routing weight b_w [BM], rounded to
    WDT (the promoted dtype of x and the routing weights)."""
    b_d = _round(acc * s_d[None, :], DT)
    if HAS_BIAS:
        b_d = _round(b_d + tl.load(p_b + o_n, mask=m_n, other=0).to(tl.float32)[None, :], DT)
    return _round(b_d * b_w[:, None], WDT)


def workspace(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised buffer between two launches (tests poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


def cdiv_pow2(n: int) -> int:
    """The smallest power of two >= n (>= 1)."""
    return 1 << max(0, (n - 1).bit_length())

