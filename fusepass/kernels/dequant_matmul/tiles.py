"""The Triton helpers every dequant_matmul kernel shares: integer -> float
conversions, the dot, and the store of a tile (whole K or one slice of a split K),
with the second kernel that sums split-K slices where no counters can be had."""

from __future__ import annotations

import struct

import triton
import triton.language as tl

from fusepass.formats import CODEBOOKS
from fusepass.kernels._common import rne_bf16


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
def _int4_minus_zero(b_q, p_z, m_z, HAS_ZERO: tl.constexpr, ZERO_F32: tl.constexpr, ASM: tl.constexpr):
    """int4 bytes [..., VB] -> (q - z of the low nibbles, of the high ones) as
    fp32, each run of VB bytes against the zero point at ``p_z`` [...] (masked
    by ``m_z``; 8 without one): 128 + q by _nibbles_128, then 128 + z off in
    one FADD, exact for 0 and every zero point >= 2**-9 (bf16), 2**-6 (fp16).  An fp32
    zero point need not be a multiple of 2**-16: q, then q - z rounded once,
    as the reference does."""
    if HAS_ZERO:
        b_z = tl.load(p_z, mask=m_z, other=0)
    else:
        b_z = 0.0
    return _int4_minus_loaded_zero(b_q, b_z, HAS_ZERO, ZERO_F32, ASM)


@triton.jit
def _int4_minus_loaded_zero(b_q, b_z, HAS_ZERO: tl.constexpr, ZERO_F32: tl.constexpr, ASM: tl.constexpr):
    """_int4_minus_zero with the zero points [...] already loaded (as stored; unused without them)."""
    b_e, b_o = _nibbles_128(b_q, ASM)
    # (one return: Triton's frontend also builds the code after a return inside
    # a constexpr if, there with b_z already expanded: "inconsistent return
    # types" on the GPU for fp32 zero points, the interpreter did not mind)
    if ZERO_F32:
        b_zz = tl.expand_dims(b_z, -1)
        b_lo = (b_e - 128.0) - b_zz
        b_hi = (b_o - 128.0) - b_zz
    else:
        if HAS_ZERO:
            b_c = tl.expand_dims(128.0 + b_z.to(tl.float32), -1)
        else:
            b_c = 136.0
        b_lo = b_e - b_c
        b_hi = b_o - b_c
    return b_lo, b_hi


@triton.jit
def _word_128(b_w, ASM: tl.constexpr):
    """int32 words of eight 4-bit codes (byte b holds codes 2b, low nibble, and
    2b + 1, high) -> eight fp32 tensors 128 + q_0 .. 128 + q_7, as _nibbles_128
    builds them: three bit operations per word and one PRMT per value."""
    if ASM:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 t, u, c;
            mov.b32 c, 0x43000000;
            and.b32 t, $8, 0x0F0F0F0F;
            shr.u32 u, $8, 4;
            and.b32 u, u, 0x0F0F0F0F;
            prmt.b32 $0, t, c, 0x7044;
            prmt.b32 $1, u, c, 0x7044;
            prmt.b32 $2, t, c, 0x7144;
            prmt.b32 $3, u, c, 0x7144;
            prmt.b32 $4, t, c, 0x7244;
            prmt.b32 $5, u, c, 0x7244;
            prmt.b32 $6, t, c, 0x7344;
            prmt.b32 $7, u, c, 0x7344;
            }""",
            constraints="=r,=r,=r,=r,=r,=r,=r,=r,r",
            args=[b_w], dtype=(tl.float32,) * 8, is_pure=True, pack=1)
    else:
        b_0 = (((b_w & 0xF) << 16) | 0x43000000).to(tl.float32, bitcast=True)
        b_1 = (((b_w & 0xF0) << 12) | 0x43000000).to(tl.float32, bitcast=True)
        b_2 = (((b_w & 0xF00) << 8) | 0x43000000).to(tl.float32, bitcast=True)
        b_3 = (((b_w & 0xF000) << 4) | 0x43000000).to(tl.float32, bitcast=True)
        b_4 = ((b_w & 0xF0000) | 0x43000000).to(tl.float32, bitcast=True)
        b_5 = (((b_w >> 4) & 0xF0000) | 0x43000000).to(tl.float32, bitcast=True)
        b_6 = (((b_w >> 8) & 0xF0000) | 0x43000000).to(tl.float32, bitcast=True)
        b_7 = (((b_w >> 12) & 0xF0000) | 0x43000000).to(tl.float32, bitcast=True)
        return b_0, b_1, b_2, b_3, b_4, b_5, b_6, b_7


@triton.jit
def _lane_table(code, like, ASM: tl.constexpr):
    """For _codebook_pair's shuffles: tensor ``like``'s shape, each element the code
    book's entry (lane id mod 16) of the thread holding it, as int32 bits (the 16
    values twice across a warp).  Without ASM, nothing is read (0s)."""
    if ASM:
        lane = tl.inline_asm_elementwise(asm="mov.u32 $0, %laneid;", constraints="=r,r", args=[like.to(tl.int32)],
                                         dtype=tl.int32, is_pure=True, pack=1)
        return tl.load(code + (lane & 15)).to(tl.int32, bitcast=True)
    return like.to(tl.int32) * 0


@triton.jit
def _codebook_pair(b_q, tab, code, ASM: tl.constexpr):
    """uint8 bytes of a code-book format (bitsandbytes': the high nibble the even
    value) -> (CODE[high nibble], CODE[low nibble]) as fp32.  ASM: on the GPU each
    value is one SHFL from the lane whose ``tab`` (_lane_table) holds it: shfl.idx
    reads the low five bits of the lane index, so the byte shifted to its nibble
    needs no mask (the table is in both halves of the warp); a shift and a shuffle
    per value, no address.  Elsewhere (the interpreter) a lookup in the 16 values
    at ``code`` (64 bytes, L1-resident on a GPU)."""
    if ASM:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 t;
            shr.b32 t, $8, 4;
            shfl.sync.idx.b32 $0, $9, t, 0x1f, 0xffffffff;
            shfl.sync.idx.b32 $4, $9, $8, 0x1f, 0xffffffff;
            shr.b32 t, $8, 12;
            shfl.sync.idx.b32 $1, $9, t, 0x1f, 0xffffffff;
            shr.b32 t, $8, 8;
            shfl.sync.idx.b32 $5, $9, t, 0x1f, 0xffffffff;
            shr.b32 t, $8, 20;
            shfl.sync.idx.b32 $2, $9, t, 0x1f, 0xffffffff;
            shr.b32 t, $8, 16;
            shfl.sync.idx.b32 $6, $9, t, 0x1f, 0xffffffff;
            shr.b32 t, $8, 28;
            shfl.sync.idx.b32 $3, $9, t, 0x1f, 0xffffffff;
            shr.b32 t, $8, 24;
            shfl.sync.idx.b32 $7, $9, t, 0x1f, 0xffffffff;
            }""",
            constraints="=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r",
            args=[b_q, tab], dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
    b_i = b_q.to(tl.int32)
    return tl.load(code + (b_i >> 4)), tl.load(code + (b_i & 0xF))


def _one_line(ptx: str) -> str:
    """PTX on one line.  Inductor copies a kernel's global constants into its
    generated module by repr inside a triple-quoted string: a newline escape
    there ends the constant's string literal early and the module does not
    import (every inlined tensor-core launch of a graph failed so, H200)."""
    return " ".join(ptx.split())


def _byte_asm(flip: bool) -> str:
    first = "xor.b32 t, $4, 0x80808080;" if flip else "mov.b32 t, $4;"
    return f"""{{
            .reg .b32 t, c;
            mov.b32 c, 0x4B000000;
            {first}
            prmt.b32 $0, t, c, 0x7440;
            prmt.b32 $1, t, c, 0x7441;
            prmt.b32 $2, t, c, 0x7442;
            prmt.b32 $3, t, c, 0x7443;
            }}"""


_BYTE_ASM: tl.constexpr = tl.constexpr(_one_line(_byte_asm(False)))
_BYTE_FLIP_ASM: tl.constexpr = tl.constexpr(_one_line(_byte_asm(True)))


def _codebook_asm(values) -> str:
    """_codebook_word's PTX for one code book: every lane takes entry (lane id mod 16)
    from immediates (a chain of 15 selects on the lane id, which ptxas computes
    once per K step of the loop, not per word: 0.2-0.5 instructions per value at
    tiles 128-64 deep, sm_90), then a shift and a shuffle per code."""
    imm = ["0f%08X" % struct.unpack("<I", struct.pack("<f", v))[0] for v in values]
    table = "".join(f"            setp.eq.u32 p, l, {i};\n            selp.b32 v, {imm[i]}, v, p;\n"
                    for i in range(1, 16))
    shuffles = "".join(f"            shr.b32 t, $8, {8 * b + 4};\n            shfl.sync.idx.b32 ${2 * b}, v, t, 0x1f, 0xffffffff;\n"
                       + (f"            shr.b32 t, $8, {8 * b};\n" if b else "            mov.b32 t, $8;\n")
                       + f"            shfl.sync.idx.b32 ${2 * b + 1}, v, t, 0x1f, 0xffffffff;\n" for b in range(4))
    return ("{\n            .reg .b32 t, l, v;\n            .reg .pred p;\n            mov.u32 l, %laneid;\n"
            f"            and.b32 l, l, 15;\n            mov.b32 v, {imm[0]};\n{table}{shuffles}            }}")


_NF4_ASM: tl.constexpr = tl.constexpr(_one_line(_codebook_asm(CODEBOOKS["nf4"])))
_FP4_ASM: tl.constexpr = tl.constexpr(_one_line(_codebook_asm(CODEBOOKS["fp4"])))


@triton.jit
def _codebook_word(b_w, code, FMT: tl.constexpr, ASM: tl.constexpr):
    """int32 words of eight codes of a code-book format (byte b holds codes 2b, the
    high nibble, and 2b + 1, the low: bitsandbytes' order) -> eight fp32 tensors
    CODE[q_0] .. CODE[q_7].  ASM: a shift and a shuffle per value, as
    _codebook_pair, from a table (FMT's, fusepass.formats.CODEBOOKS) every lane
    builds from immediates in the same asm.  A table held in a tensor
    (_lane_table) is bound to the layout it was built in: the tensor-core
    kernel's layout conversions moved it to other lanes (wrong sums at 32 rows
    and more, H200), and a table address as an operand made Triton convert
    the whole dequantised tile through shuffles (sm_90 SASS).  Elsewhere a
    lookup in the 16 values at ``code``."""
    if ASM:
        return tl.inline_asm_elementwise(
            asm=_NF4_ASM if FMT == "nf4" else _FP4_ASM,
            constraints="=r,=r,=r,=r,=r,=r,=r,=r,r",
            args=[b_w], dtype=(tl.float32,) * 8, is_pure=True, pack=1)
    return (tl.load(code + ((b_w >> 4) & 0xF)), tl.load(code + (b_w & 0xF)),
            tl.load(code + ((b_w >> 12) & 0xF)), tl.load(code + ((b_w >> 8) & 0xF)),
            tl.load(code + ((b_w >> 20) & 0xF)), tl.load(code + ((b_w >> 16) & 0xF)),
            tl.load(code + ((b_w >> 28) & 0xF)), tl.load(code + ((b_w >> 24) & 0xF)))


@triton.jit
def _byte_word(b_w, FLIP: tl.constexpr, ASM: tl.constexpr):
    """int32 words of four bytes -> four fp32 tensors 2**23 + byte, byte order: each
    byte (its sign bit flipped first with FLIP, once per word: int8's v + 128)
    placed in 2**23's low mantissa bits by one PRMT; the caller's FADD takes
    2**23 (+ 128) off, exactly.  int8 words (FLIP) and HQQ's nibbles, one in the
    low bits of each byte."""
    if ASM:
        return tl.inline_asm_elementwise(
            asm=_BYTE_FLIP_ASM if FLIP else _BYTE_ASM,
            constraints="=r,=r,=r,=r,r",
            args=[b_w], dtype=(tl.float32,) * 4, is_pure=True, pack=1)
    b_t = b_w ^ -2139062144 if FLIP else b_w  # 0x80808080
    b_0 = ((b_t & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True)
    b_1 = (((b_t >> 8) & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True)
    b_2 = (((b_t >> 16) & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True)
    b_3 = (((b_t >> 24) & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True)
    return b_0, b_1, b_2, b_3


@triton.jit
def _nibble_word(b_t, ASM: tl.constexpr):
    """int32 words of four nibbles, one in the low bits of each byte (the rest 0)
    -> four fp32 tensors q_0 .. q_3 in byte order, exact (_byte_word)."""
    b_0, b_1, b_2, b_3 = _byte_word(b_t, False, ASM)
    return b_0 - 8388608.0, b_1 - 8388608.0, b_2 - 8388608.0, b_3 - 8388608.0


@triton.jit
def _int8_word(b_w, ASM: tl.constexpr):
    """int32 words of four int8 values -> four fp32 tensors, byte order: each
    byte + 128 as 2**23 + byte (_byte_word), then one FADD of 2**23 + 128."""
    b_0, b_1, b_2, b_3 = _byte_word(b_w, True, ASM)
    return b_0 - 8388736.0, b_1 - 8388736.0, b_2 - 8388736.0, b_3 - 8388736.0


@triton.jit
def _int4_offset(b_z, b_s, ZERO_F32: tl.constexpr):
    """What _int4_dequant subtracts, per group: (128 + z) s (nothing yet for an
    fp32 zero point, which need not be a multiple of 2**-16)."""
    if ZERO_F32:
        return b_s * 0.0  # (unused)
    return (128.0 + b_z) * b_s


@triton.jit
def _int4_dequant(b_v, b_s, b_c, b_z, ZERO_F32: tl.constexpr):
    """(q - z) s from b_v = 128 + q (_word_128): (128 + q) s - (128 + z) s in one
    FMA.  For bf16 scales and zero points (fusepass.quantize's) the product
    (128 + z) s is exact in fp32, so this is (q - z) s rounded once, as the
    model's own dequantisation rounds it, and 0 where q = z (inf * 0 stays NaN).
    An fp32 zero point: q - z rounded once, as the reference, then the scale."""
    if ZERO_F32:
        return ((b_v - 128.0) - b_z) * b_s
    return b_v * b_s - b_c


@triton.jit
def _int4_pairs(b_wd, b_s, b_z, DT: tl.constexpr, ASM: tl.constexpr):
    """int32 words of eight 4-bit codes [..] -> four tensors [.., 2] in DT (bf16 or
    fp16), tensor b holding byte b's (low, high) nibble dequantised as the model's
    own form computes it in DT: r = q - z rounded to DT, then r s rounded to DT.
    b_s, b_z: the scale and zero point, fp32 of DT values, broadcast against [.., 2].

    ASM: one asm per word and pair of 16-bit values, both values in one register.
    t = w & 0x0F0F0F0F holds the low nibbles, u the high ones (bf16: w >> 4 masked;
    fp16: w & 0xF0F0F0F0, 16 q); a PRMT puts byte b of t in the low half and of u
    in the high half, the other bytes the sign of t's byte (0): the halves are
    subnormals, bf16 q 2**-133, fp16 q 2**-24 and 16 q 2**-24.  Then, in packed
    FMAs, rounding as the model rounds:
      bf16: d = v 2**127 - z 2**-6 = (q - z) 2**-6 rounded (bf16 has fp32's
            exponents: the scaling by 2**-6 commutes with the rounding), then
            d (64 s) = (q - z) s rounded: two FMAs a pair, exact for every zero
            point but those below 2**-120 in magnitude (nonzero).
      fp16: q 2**-9 = v (2**15, 2**11) exactly (2**24 is no fp16), q - z =
            q 2**-9 512 - z rounded, then r s rounded: three.
    (A product of two 16-bit values is exact in fp32, so the model's fp32
    product rounded to DT is the packed FMA's one rounding.)  With the 7 (bf16) or
    6 (fp16) bit operations a word this is 1.9 (2.25) instructions a value against
    2.8 for _word_128 + FFMA + F2FP.  Elsewhere (the interpreter) the same two
    roundings in plain Triton."""
    if ASM:
        b_p = tl.join(b_wd, b_wd)  # (the word in both elements of a pair: one asm per 32-bit register of output)
        if DT == tl.bfloat16:
            b_m = (b_s * 64.0).to(DT)
            b_c = (b_z * -0.015625).to(DT)
            return tl.inline_asm_elementwise(
                asm="""{
                .reg .b32 t, u, v, k, n;
                mov.b32 k, 0x7F007F00;
                mov.b32 n, 0x80008000;
                and.b32 t, $4, 0x0F0F0F0F;
                shr.u32 u, $4, 4;
                and.b32 u, u, 0x0F0F0F0F;
                prmt.b32 v, t, u, 0x8480;
                fma.rn.bf16x2 v, v, k, $7;
                fma.rn.bf16x2 $0, v, $6, n;
                prmt.b32 v, t, u, 0x9591;
                fma.rn.bf16x2 v, v, k, $7;
                fma.rn.bf16x2 $1, v, $6, n;
                prmt.b32 v, t, u, 0xA6A2;
                fma.rn.bf16x2 v, v, k, $7;
                fma.rn.bf16x2 $2, v, $6, n;
                prmt.b32 v, t, u, 0xB7B3;
                fma.rn.bf16x2 v, v, k, $7;
                fma.rn.bf16x2 $3, v, $6, n;
                }""",
                constraints="=r,=r,=r,=r,r,r,r,r",
                args=[b_p, b_m, b_c], dtype=(b_m.dtype,) * 4, is_pure=True, pack=2)
        else:
            b_m = b_s.to(DT)
            b_c = (-b_z).to(DT)
            return tl.inline_asm_elementwise(
                asm="""{
                .reg .b32 t, u, v, k, h, n;
                mov.b32 k, 0x68007800;
                mov.b32 h, 0x60006000;
                mov.b32 n, 0x80008000;
                and.b32 t, $4, 0x0F0F0F0F;
                and.b32 u, $4, 0xF0F0F0F0;
                prmt.b32 v, t, u, 0x8480;
                fma.rn.f16x2 v, v, k, n;
                fma.rn.f16x2 v, v, h, $7;
                fma.rn.f16x2 $0, v, $6, n;
                prmt.b32 v, t, u, 0x9591;
                fma.rn.f16x2 v, v, k, n;
                fma.rn.f16x2 v, v, h, $7;
                fma.rn.f16x2 $1, v, $6, n;
                prmt.b32 v, t, u, 0xA6A2;
                fma.rn.f16x2 v, v, k, n;
                fma.rn.f16x2 v, v, h, $7;
                fma.rn.f16x2 $2, v, $6, n;
                prmt.b32 v, t, u, 0xB7B3;
                fma.rn.f16x2 v, v, k, n;
                fma.rn.f16x2 v, v, h, $7;
                fma.rn.f16x2 $3, v, $6, n;
                }""",
                constraints="=r,=r,=r,=r,r,r,r,r",
                args=[b_p, b_m, b_c], dtype=(b_m.dtype,) * 4, is_pure=True, pack=2)
    else:
        b_0 = tl.join(b_wd & 0xF, (b_wd >> 4) & 0xF).to(tl.float32)
        b_1 = tl.join((b_wd >> 8) & 0xF, (b_wd >> 12) & 0xF).to(tl.float32)
        b_2 = tl.join((b_wd >> 16) & 0xF, (b_wd >> 20) & 0xF).to(tl.float32)
        b_3 = tl.join((b_wd >> 24) & 0xF, (b_wd >> 28) & 0xF).to(tl.float32)
        b_0 = _round_to(_round_to(b_0 - b_z, DT) * b_s, DT).to(DT)
        b_1 = _round_to(_round_to(b_1 - b_z, DT) * b_s, DT).to(DT)
        b_2 = _round_to(_round_to(b_2 - b_z, DT) * b_s, DT).to(DT)
        b_3 = _round_to(_round_to(b_3 - b_z, DT) * b_s, DT).to(DT)
        return b_0, b_1, b_2, b_3


@triton.jit
def _round_to(b_x, DT: tl.constexpr):
    """fp32 -> fp32 holding the nearest DT value (ties to even), for the interpreter
    too, whose fp32 -> bf16 cast truncates (Triton 3.9: 1 + 3 * 2**-8 gives 1 +
    2**-7, not 1 + 2**-6); its fp16 cast rounds to nearest (numpy's)."""
    if DT == tl.bfloat16:
        return rne_bf16(b_x)
    return b_x.to(DT).to(tl.float32)


@triton.jit
def _group(b_g, NG):
    """GPTQ's g_idx values as the rows of its NG groups the forms read: torch's
    indexing (``scales[g_idx]``) counts a negative index from the end; an index
    outside [-NG, NG) is an error there, and is clamped here so that no read
    leaves the scales and zero points."""
    b_g = tl.where(b_g < 0, b_g + NG, b_g)
    return tl.minimum(tl.maximum(b_g, 0), NG - 1)


@triton.jit
def _library_tile(w, scale, zero, g_idx, shifts, o_n, o_k, m, N, K, NG, stride_wn, stride_sn, FMT: tl.constexpr,
                  G: tl.constexpr):
    """fp32 W[o_n, o_k] of another library's layout (fusepass.formats, LIBRARY_FORMATS),
    scale applied, for offsets that broadcast to the tile (either orientation), mask m.

    Each value is gathered where it is stored: nf4 / fp4 a byte per two columns
    of a row (high nibble the even one) and a lookup in the 16-entry code book
    (``zero``: 64 bytes, L1-resident); gptq4 a word per eight values of a column
    along K, the zero point a nibble of a word per eight columns, both indexed
    by the group ``g_idx`` gives each k, each code at the bit offset ``shifts``
    holds for its place in the word (the model's own table, read, not assumed;
    ``NG`` groups, a negative g_idx counted from the end as torch indexes).  Correct in any tile shape and any
    group size, and slow: HQQ's and GPTQ's GEMVs have loops of their own (gemv._hqq_gemv, _gptq_gemv),
    this serves the other paths and layouts."""
    if FMT == "nf4" or FMT == "fp4":
        b_b = tl.load(w + o_n.to(tl.int64) * stride_wn + o_k // 2, mask=m, other=0).to(tl.int32)
        b_q = (b_b >> ((1 - o_k % 2) * 4)) & 0xF
        b_v = tl.load(zero + b_q)
        b_s = tl.load(scale + o_n.to(tl.int64) * stride_sn + o_k // G, mask=m, other=0).to(tl.float32)
        return b_v * b_s
    elif FMT == "hqq4":
        # HQQ: group row r = n K / G + k // G; the first half of the rows in the
        # high nibbles of the packed [R / 2, G] bytes, the second half in the low.
        b_r = o_n.to(tl.int64) * (K // G) + o_k // G
        half = (N * (K // G)) // 2
        b_hi = b_r < half
        b_b = tl.load(w + tl.where(b_hi, b_r, b_r - half) * stride_wn + o_k % G, mask=m, other=0).to(tl.int32)
        b_q = tl.where(b_hi, b_b >> 4, b_b & 0xF).to(tl.float32)
        p_s = o_n.to(tl.int64) * stride_sn + o_k // G
        b_z = tl.load(zero + p_s, mask=m, other=0).to(tl.float32)
        b_s = tl.load(scale + p_s, mask=m, other=0).to(tl.float32)
        return (b_q - b_z) * b_s
    else:
        b_wd = tl.load(w + (o_k // 8).to(tl.int64) * stride_wn + o_n, mask=m, other=0)
        b_q = (b_wd >> tl.load(shifts + o_k % 8)) & 0xF
        b_g = _group(tl.load(g_idx + o_k, mask=m, other=0), NG)
        b_zw = tl.load(zero + b_g.to(tl.int64) * ((N + 7) // 8) + o_n // 8, mask=m, other=0)
        b_z = (b_zw >> tl.load(shifts + o_n % 8)) & 0xF
        if FMT == "gptq4_v1":
            b_z += 1
        b_s = tl.load(scale + b_g.to(tl.int64) * stride_sn + o_n, mask=m, other=0).to(tl.float32)
        return (b_q - b_z).to(tl.float32) * b_s


@triton.jit
def _block_scales(scale, nst, o_s, m_c, NESTED: tl.constexpr):
    """The scales [NCH] at flat indices ``o_s`` as fp32.  NESTED (bitsandbytes'
    double quantization, ``nst`` = (nested absmax, absmax code, offset)): scale
    holds one byte a block, its absmax code[byte] * nested[block // 256] +
    offset, as bitsandbytes expands it; a byte and an L1-resident lookup a
    block of codes instead of the fp32 absmax written and read back each step."""
    if NESTED:
        b_a = tl.load(scale + o_s, mask=m_c, other=0).to(tl.int32)
        b_n = tl.load(nst[0] + o_s // 256, mask=m_c, other=0)
        return tl.load(nst[1] + b_a) * b_n + tl.load(nst[2])
    else:
        return tl.load(scale + o_s, mask=m_c, other=0).to(tl.float32)


@triton.jit
def _chunk_sums(b_e, b_o, b_s, b_xe, b_xo):
    """sum (e x_e + o x_o) of each chunk of values (e, o) [..., NCH, VB] against
    x's pairs (x_e, x_o), times the chunk's scale b_s [..., NCH].  Two sums of
    products, not one of pair sums: in-thread sums are chains under Triton 3.6,
    so each product is one FFMA, where a sum of pair sums costs an FMUL, an
    FFMA and an FADD a pair (sm_90 SASS)."""
    return (tl.sum(b_e * b_xe, axis=-1) + tl.sum(b_o * b_xo, axis=-1)) * b_s


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
def _splitk_reduce_kernel(part, bias, out, M, N, SPLIT, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m_o = o < M * N
    acc = tl.load(part + o, mask=m_o, other=0)
    for i_s in range(1, SPLIT):
        acc += tl.load(part + (i_s * M).to(tl.int64) * N + o, mask=m_o, other=0)
    if HAS_BIAS:
        acc += tl.load(bias + o % N, mask=m_o, other=0).to(tl.float32)
    tl.store(out + o, acc.to(out.dtype.element_ty), mask=m_o)
