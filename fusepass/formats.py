"""What fusepass's quantized weights are, in one place: the formats, their
storage dtypes and group sizes, the dtypes the kernels take, and the int4
unpack and dequantize that ``quantize``, the rules, the kernels' reference and
the benchmarks share.

    fmt    stored weight                                  scale          zero
    int8   int8 [N, K]                                    [N]            -
    int4   uint8 [N, K // 2]: two 4-bit codes per byte,   [N, K // G]    [N, K // G] (asymmetric),
           low nibble the even column, high the odd                      or none: a fixed 8
    fp8    float8_e4m3fn [N, K]                           [N]            -

    W[n, k] = (q[n, k] - zero[n, k // G]) * scale[n, k // G]      int4
    W[n, k] = q[n, k] * scale[n]                                  int8, fp8

Other libraries' layouts, read as they are stored (``LIBRARY_FORMATS``; the
op takes them, ``fusepass.quantize`` does not make them):

    fmt        stored weight                                 scale             zero / g_idx
    nf4, fp4   uint8 [N, K // 2]: the high nibble the even    fp32 [N, K // G]  - (bitsandbytes' 4-bit: its
               column, the low the odd (bitsandbytes)         (absmax)            16-entry code book CODEBOOKS)
    gptq4      int32 [K // 8, N]: eight codes along K per     [groups, N]       zero int32 [groups, ceil(N / 8)],
               word, lowest bits first (stored [K, N])                          eight along N per word;
                                                                                g_idx [K]: the group of each k;
                                                                                shifts [8]: the bit offset of each
                                                                                code in a word (0, 4, ..., 28)
    gptq4_v1   as gptq4, each zero point stored minus one
    hqq4       uint8 [R / 2, G], R = N K / G group rows      [N, K // G]       zero [N, K // G], float
               (row r = n K / G + k // G): rows r < R / 2
               in the high nibbles, the rest in the low (HQQ)

bitsandbytes' double quantization (nf4 / fp4): the scale is uint8 [N, K // G],
one code a block, and absmax = code[byte] * nested[block // 256] + offset
(``bnb_absmax``; the op's nested_absmax, absmax_code and absmax_offset).

    W[n, k] = CODE[q[n, k]] * scale[n, k // G]                               nf4, fp4
    W[n, k] = (q[k, n] - z[g_idx[k], n]) * scale[g_idx[k], n]                gptq4 (z + 1 for gptq4_v1)
    W[n, k] = (q[n K / G + k // G, k % G] - zero[n, k // G]) * scale[n, k // G]      hqq4
"""

from __future__ import annotations

import torch
from torch import Tensor

FORMATS = ("int8", "int4", "fp8")
LIBRARY_FORMATS = ("nf4", "fp4", "gptq4", "gptq4_v1", "hqq4")
OP_FORMATS = FORMATS + LIBRARY_FORMATS
# The stored dtype of fusepass's own formats (one each: a dtype says its format, see the MoE rule) and of
# every format the op reads (uint8 holds int4, nf4, fp4 and hqq4 codes alike).
WEIGHT_DTYPES = {"int8": torch.int8, "int4": torch.uint8, "fp8": torch.float8_e4m3fn}
OP_WEIGHT_DTYPES = {**WEIGHT_DTYPES, "nf4": torch.uint8, "fp4": torch.uint8, "gptq4": torch.int32,
                    "gptq4_v1": torch.int32, "hqq4": torch.uint8}
# bitsandbytes' 4-bit code books (its published tables): NF4, the quantiles of a
# normal distribution scaled to [-1, 1] (QLoRA); FP4, one sign bit and the
# magnitudes 0, 1/192, 2/3, 1, 1/3, 1/2, 1/6, 1/4 in code order.
_FP4 = (0.0, 1 / 192, 2 / 3, 1.0, 1 / 3, 0.5, 1 / 6, 0.25)
CODEBOOKS = {
    "nf4": (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
            -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
            0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
            0.7229568362236023, 1.0),
    "fp4": _FP4 + tuple(-v for v in _FP4),
}
# A weight with one scale per output channel says its format by its dtype.
CHANNEL_FORMATS = {torch.int8: "int8", torch.float8_e4m3fn: "fp8"}
# int4 group sizes the kernels are built for: a group is whole tiles of K.
GROUP_SIZES = (32, 64, 128, 256)
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value

# Activations (and norms' inputs) the Triton kernels take; fp64 goes to the
# plain-torch references.
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def unpack_int4(packed: Tensor) -> Tensor:
    """uint8 [..., N, K // 2] -> [..., N, K]: low nibble the even column, high nibble the odd."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)


def dequantize_int4(packed: Tensor, scale: Tensor, zero: Tensor | None, dtype: torch.dtype) -> Tensor:
    """The [N, K] int4 weight computed in ``dtype``, as a model's forward writes
    it (``fusepass.quantize``'s layers; the form the int4 rule matches)."""
    n, groups = scale.shape
    q = unpack_int4(packed).to(dtype).reshape(n, groups, -1)
    q = q - 8 if zero is None else q - zero[..., None]
    return (q * scale[..., None]).reshape(n, -1)


def out_features(weight: Tensor, fmt: str, scale: Tensor | None = None):
    """N of a stored weight: its rows, or (gptq4, stored [K, N]) its columns, or (hqq4) its scale's rows."""
    if fmt == "hqq4":
        return scale.shape[0]
    return weight.shape[1] if fmt.startswith("gptq4") else weight.shape[0]


def in_features(weight: Tensor, fmt: str, scale: Tensor | None = None):
    """K of a stored weight."""
    if fmt == "hqq4":
        return scale.shape[1] * weight.shape[1]
    if fmt.startswith("gptq4"):
        return weight.shape[0] * 8
    return weight.shape[1] * (2 if fmt in ("int4", "nf4", "fp4") else 1)


def unpack_words(words: Tensor, dim: int, shifts: Tensor | None = None) -> Tensor:
    """int32 words of eight 4-bit codes (lowest bits first, or at ``shifts``) -> int64
    codes, each word becoming eight consecutive entries along ``dim`` (0 or 1) of a 2-D tensor."""
    if shifts is None:
        shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    shifts = shifts.reshape(-1).to(torch.int32)
    codes = ((words.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF).long()  # [R, C, 8]
    r, c = words.shape
    if dim == 1:
        return codes.reshape(r, c * 8)
    return codes.permute(0, 2, 1).reshape(r * 8, c)


def codebook(fmt: str, device: torch.device | str = "cpu") -> Tensor:
    """The 16 fp32 values of a code-book format."""
    return torch.tensor(CODEBOOKS[fmt], dtype=torch.float32, device=device)


def bnb_absmax(nested: Tensor, absmax_8bit: Tensor, code: Tensor, offset: Tensor) -> Tensor:
    """bitsandbytes' double quantization: the fp32 absmax per block, flat, from its uint8 codes
    (``code[absmax_8bit]``), one nested absmax per 256 blocks and the offset."""
    blocks = absmax_8bit.numel()
    return (code[absmax_8bit.long().flatten()] * nested.flatten().repeat_interleave(256)[:blocks]
            + offset.reshape(())).float()


def dequantize_library(weight: Tensor, scale: Tensor, zero: Tensor | None, g_idx: Tensor | None, fmt: str,
                       group_size: int, shifts: Tensor | None = None) -> Tensor:
    """The [N, K] fp32 weight of a ``LIBRARY_FORMATS`` layout (the reference)."""
    if fmt == "hqq4":
        n, k = scale.shape[0], scale.shape[1] * weight.shape[1]
        q = torch.cat([weight >> 4, weight & 0xF]).reshape(n, k // group_size, group_size).float()
        return ((q - zero.float()[..., None]) * scale.float()[..., None]).reshape(n, k)
    if fmt in ("nf4", "fp4"):
        n = weight.shape[0]
        q = torch.stack([weight >> 4, weight & 0xF], dim=-1).reshape(n, -1).long()
        return (codebook(fmt, weight.device)[q].reshape(n, scale.shape[1], -1) * scale.float()[..., None]).reshape(n, -1)
    n = weight.shape[1]
    q = unpack_words(weight, 0, shifts)  # [K, N]
    z = unpack_words(zero, 1, shifts)[:, :n] + (1 if fmt == "gptq4_v1" else 0)  # [groups, N]
    g = g_idx.long()
    return ((q - z[g]).float() * scale.float()[g]).t()


def dequantize(weight: Tensor, scale: Tensor, zero: Tensor | None, fmt: str, group_size: int,
               dtype: torch.dtype = torch.float32, g_idx: Tensor | None = None,
               shifts: Tensor | None = None) -> Tensor:
    """The [N, K] weight of any format in ``dtype``, computed in fp32 (the reference)."""
    if fmt in LIBRARY_FORMATS:
        return dequantize_library(weight, scale, zero, g_idx, fmt, group_size, shifts).to(dtype)
    if fmt == "int4":
        return dequantize_int4(weight, scale.float(), None if zero is None else zero.float(),
                               torch.float32).to(dtype)
    return (weight.to(torch.float32) * scale.to(torch.float32)[:, None]).to(dtype)
