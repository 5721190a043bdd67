"""Triton pieces shared by the MoE experts kernels: an expert's weight tile
(plain or dequantised), the gated activation with the models' roundings, and
the down projection's epilogue.

Weights are addressed as rows of [N, K] (out, in features): a pointer to
each row's start and a stride along K, so one loader reads both transformers
layouts: [E, N, K] (row stride K, stride_k = 1) and the transposed [E, K, N]
of gpt-oss (row stride 1, stride_k = N), and tiles of one expert ([BN, BK])
or of several at once ([KP, BN, BK]).  Quantized weights are [E, N, K] only, as
``fusepass.kernels.dequant_matmul`` stores one: int8 and fp8 per output
channel (the scale multiplies the accumulator), int4 in groups of G along K
(two codes per byte, low nibble first; the tile is dequantised in registers
with its groups' scales and zero points).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusepass.kernels._common import Launch, interpreting, round_to
from fusepass.kernels.dequant_matmul.tiles import _dot  # noqa: F401 - the kernels' dot (its own name: see test_imports)
from fusepass.kernels.dequant_matmul.tiles import _int4_minus_loaded_zero, _int8_to_f32, _nibbles_to_f32, _pair_to_f32


# Under the interpreter a conversion to bf16 truncates (see _common.round_to);
# there the kernels round to nearest by hand, as the GPU's conversions do,
# so that the interpreted kernels compute what the GPU's compute (the
# gpt-oss activation's four roundings in a row, truncated, put an expert
# block 2.1e-2 off the model's bf16 result, against a table of 1.2e-2).
_EMU: tl.constexpr = tl.constexpr(interpreting())


@triton.jit
def _to(v, DT: tl.constexpr):
    """v.to(DT), rounded to nearest."""
    return round_to(v, DT, _EMU and DT == tl.bfloat16 and v.dtype == tl.float32)


@triton.jit
def _round(v, DT: tl.constexpr):
    """v rounded to the model's dtype DT and back to fp32 (a no-op for fp32)."""
    return _to(v, DT).to(tl.float32)


@triton.jit
def _round_if(v, DT: tl.constexpr, ROUND: tl.constexpr):
    """v rounded to DT and back where ROUND (the routed product: rounded to x's
    dtype when the routing weights are in it, left in fp32 when they are fp32)."""
    if ROUND:
        return _round(v, DT)
    else:
        return v


@triton.jit
def w_tile(p_rows, m_rows, p_srows, p_zrows, k0, K, stride_k,
           FMT: tl.constexpr, G: tl.constexpr, HAS_ZERO: tl.constexpr, BK: tl.constexpr, TRANS: tl.constexpr):
    """Weight rows from column k0 on: ``p_rows`` points at the start of each
    row (any shape, [BN] or [KP, BN]; masked by ``m_rows``), the result has a
    dim of BK more: last ([..., BN, BK]), or with TRANS (plain weights stored
    [E, K, N], a row's elements BN apart) before the rows' last dim
    ([..., BK, BN]), so that the dim contiguous in memory is the fastest of
    the tile and its loads are 16-byte vectors (Triton lays the load out as
    the arithmetic on it: a transposed tile multiplied as [BN, BK] was read
    two bytes at a time, seen in the PTX for sm90).  Values: the weight's
    dtype (plain), or fp32 (int8 and fp8 unscaled, int4 dequantised with its
    groups' scales and zeros, whose rows start at ``p_srows`` / ``p_zrows``).
    Elements past K read 0."""
    if TRANS:
        o_k = k0 + tl.arange(0, BK)
        m = tl.expand_dims(m_rows, -2) & (o_k < K)[:, None]
        return tl.load(tl.expand_dims(p_rows, -2) + o_k[:, None] * stride_k, mask=m, other=0.0)
    elif FMT == "int4":
        o_kp = tl.multiple_of(k0 // 2, BK // 2) + tl.arange(0, BK // 2)
        # o_kp < K / 2, not 2 o_kp < K: a mask constant over 16 bytes keeps the
        # loads 16-byte vectors (K is even).
        m = tl.expand_dims(m_rows, -1) & (o_kp < K // 2)
        b_q = tl.load(tl.expand_dims(p_rows, -1) + o_kp, mask=m, other=0)
        if BK <= G:  # one group per tile: a scale and zero per row
            b_s = tl.expand_dims(tl.load(p_srows + k0 // G, mask=m_rows, other=0).to(tl.float32), -1)
            if HAS_ZERO:
                b_z = tl.expand_dims(tl.load(p_zrows + k0 // G, mask=m_rows, other=0).to(tl.float32), -1)
            else:
                b_z = 8.0
            b_lo, b_hi = _nibbles_to_f32(b_q)
        else:  # NG groups per tile: codes [..., NG, G / 2] against scales [..., NG, 1]
            NG: tl.constexpr = BK // G
            o_g = k0 // G + tl.arange(0, NG)
            m_g = tl.expand_dims(m_rows, -1) & (o_g * G < K)
            b_s = tl.expand_dims(tl.load(tl.expand_dims(p_srows, -1) + o_g, mask=m_g, other=0).to(tl.float32), -1)
            if HAS_ZERO:
                b_z = tl.load(tl.expand_dims(p_zrows, -1) + o_g, mask=m_g, other=0).to(tl.float32)
                b_z = tl.expand_dims(b_z, -1)
            else:
                b_z = 8.0
            b_lo, b_hi = _nibbles_to_f32(tl.reshape(b_q, b_q.shape[:-1] + [NG, G // 2]))
        b_lo = (b_lo - b_z) * b_s
        b_hi = (b_hi - b_z) * b_s
        return tl.interleave(tl.reshape(b_lo, b_q.shape), tl.reshape(b_hi, b_q.shape))
    else:
        o_k = k0 + tl.arange(0, BK)
        m = tl.expand_dims(m_rows, -1) & (o_k < K)
        if FMT == "none":
            return tl.load(tl.expand_dims(p_rows, -1) + o_k * stride_k, mask=m, other=0.0)
        elif FMT == "int8":
            return _int8_to_f32(tl.load(tl.expand_dims(p_rows, -1) + o_k, mask=m, other=0))
        else:
            b_q = tl.load(tl.expand_dims(p_rows, -1) + o_k, mask=m, other=0)
            return b_q.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def int4_chunks(p_rows, m_rows, p_srows, p_zrows, k0, K, G: tl.constexpr, HAS_ZERO: tl.constexpr,
                ZERO_F32: tl.constexpr, VB: tl.constexpr, NCH: tl.constexpr, ASM: tl.constexpr):
    """int4 rows from column k0 on as NCH chunks of 2 VB codes, each inside one
    group: (q - z of the even columns, q - z of the odd ones) [..., NCH, VB] and
    the chunks' scales [..., NCH] (``p_rows`` etc. as in ``w_tile``, any shape).
    Each row's VB bytes of a chunk are one vector load, its codes q - z by the
    GEMV's conversion (_int4_minus_loaded_zero: one PRMT and one FADD a code on the
    GPU); the scale goes on a chunk's sum (``_chunk_sums``), not on each value."""
    b_q, b_s, b_z = int4_chunk_loads(p_rows, m_rows, p_srows, p_zrows, k0, K, G, HAS_ZERO, VB, NCH)
    # (the low nibble the even column)
    b_e, b_o = _int4_minus_loaded_zero(b_q, b_z, HAS_ZERO, ZERO_F32, ASM)
    return b_e, b_o, b_s


@triton.jit
def int4_chunk_loads(p_rows, m_rows, p_srows, p_zrows, k0, K, G: tl.constexpr, HAS_ZERO: tl.constexpr,
                     VB: tl.constexpr, NCH: tl.constexpr):
    """int4_chunks' loads: the bytes [..., NCH, VB], the scales [..., NCH] as fp32,
    the zero points [..., NCH] as stored (the scales again without them).  Every
    load is masked by its chunk's place against K, so a tile past K reads nothing."""
    o_c = tl.arange(0, NCH)
    o_b = o_c[:, None] * VB + tl.arange(0, VB)[None, :]  # [NCH, VB]: the tile's bytes
    kp0 = tl.multiple_of(k0 // 2, VB)
    # A chunk starting inside K ends inside it (2 VB divides G, G divides K):
    # one mask per chunk keeps the loads 16-byte vectors.
    m_c = kp0 + o_c * VB < K // 2
    m_q = tl.expand_dims(tl.expand_dims(m_rows, -1), -1) & m_c[:, None]
    b_q = tl.load(tl.expand_dims(tl.expand_dims(p_rows, -1), -1) + kp0 + o_b, mask=m_q, other=0)
    o_g = (k0 + o_c * (2 * VB)) // G
    m_s = tl.expand_dims(m_rows, -1) & m_c
    b_s = tl.load(tl.expand_dims(p_srows, -1) + o_g, mask=m_s, other=0).to(tl.float32)
    if HAS_ZERO:
        b_z = tl.load(tl.expand_dims(p_zrows, -1) + o_g, mask=m_s, other=0)
    else:
        b_z = b_s
    return b_q, b_s, b_z


@triton.jit
def x_pairs(p_x2, m_x, k0, K, DT: tl.constexpr, VB: tl.constexpr, NCH: tl.constexpr):
    """x's columns from k0 on, as int4_chunks lays the codes out: (even, odd)
    fp32 [..., NCH, VB].  ``p_x2`` points at each row's start in x viewed as
    pairs (int32 words of two 16-bit values, int64 of two fp32; any shape,
    masked by ``m_x``): one word per code byte, so the pairs are a tensor of the
    codes' shape and Triton gives both one layout (no shuffles)."""
    return _pair_to_f32(x_pair_words(p_x2, m_x, k0, K, VB, NCH), DT)


@triton.jit
def x_pair_words(p_x2, m_x, k0, K, VB: tl.constexpr, NCH: tl.constexpr):
    """x_pairs' load: the words [..., NCH, VB], masked past K."""
    o_b = tl.arange(0, NCH)[:, None] * VB + tl.arange(0, VB)[None, :]
    m = tl.expand_dims(tl.expand_dims(m_x, -1), -1) & (k0 + tl.arange(0, NCH) * (2 * VB) < K)[:, None]
    return tl.load(tl.expand_dims(tl.expand_dims(p_x2, -1), -1) + k0 // 2 + o_b, mask=m, other=0)


@triton.jit
def row_scale(p_srows, m_rows, FMT: tl.constexpr):
    """int8 / fp8: the per-channel scale at ``p_srows`` (fp32, the rows' shape); 1 otherwise."""
    if FMT == "int8" or FMT == "fp8":
        return tl.load(p_srows, mask=m_rows, other=0).to(tl.float32)
    else:
        return tl.full(m_rows.shape, 1.0, tl.float32)


@triton.jit
def gated_act(b_g, b_u, DT: tl.constexpr, ACT: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr):
    """act(gate, up) in fp32 from gate and up as the projection left them
    (``proj_epilogue``), with eager's roundings to DT after each step; the
    result unrounded (the caller stores it in DT)."""
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
        # NaN propagates as torch.clamp's does (tl.minimum's default returns the other
        # operand: a differential program's bf16 token with a NaN feature came out finite, -52.5..38.75).
        b_g = tl.minimum(b_g, LIMIT, propagate_nan=tl.PropagateNan.ALL)
        b_u = tl.minimum(tl.maximum(b_u, -LIMIT, propagate_nan=tl.PropagateNan.ALL), LIMIT,
                         propagate_nan=tl.PropagateNan.ALL)
        b_t = _round(b_g * ALPHA, DT)
        b_sig = _round(1.0 / (1.0 + tl.exp(-b_t)), DT)
        b_glu = _round(b_g * b_sig, DT)
        return _round(b_u + 1.0, DT) * b_glu


@triton.jit
def proj_epilogue(acc, s, p_b, m_b, DT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """A projection's fp32 sums -> its output as eager has it, in fp32: the
    per-channel scale ``s`` (broadcast), rounded to DT; plus the bias at
    ``p_b`` (masked by ``m_b``), rounded again."""
    b = _round(acc * s, DT)
    if HAS_BIAS:
        b = _round(b + tl.load(p_b, mask=m_b, other=0).to(tl.float32), DT)
    return b


@triton.jit
def split_pairs(b):
    """[..., 2 BN] with gate and up interleaved (gate first) -> (gate, up), each [..., BN]."""
    return tl.split(tl.reshape(b, b.shape[:-1] + [b.shape[-1] // 2, 2]))


def ran(launch: Launch) -> dict[str, torch.Tensor]:
    """Launch now (the op's CUDA body); the outputs are the buffers it wrote."""
    launch.run()
    return {name: launch.args[name] for name in launch.outputs}


def traced(launch: Launch) -> dict[str, torch.Tensor]:
    """The launch as a node of the graph being traced (the inlined form)."""
    return launch.traced()


def workspace(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised buffer between two launches (tests poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


def cdiv_pow2(n: int) -> int:
    """The smallest power of two >= n (>= 1)."""
    return 1 << max(0, (n - 1).bit_length())

