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
"""

from __future__ import annotations

import torch
from torch import Tensor

FORMATS = ("int8", "int4", "fp8")
WEIGHT_DTYPES = {"int8": torch.int8, "int4": torch.uint8, "fp8": torch.float8_e4m3fn}
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


def dequantize(weight: Tensor, scale: Tensor, zero: Tensor | None, fmt: str, group_size: int,
               dtype: torch.dtype = torch.float32) -> Tensor:
    """The [N, K] weight of any format in ``dtype``, computed in fp32 (the reference)."""
    if fmt == "int4":
        return dequantize_int4(weight, scale.float(), None if zero is None else zero.float(),
                               torch.float32).to(dtype)
    return (weight.to(torch.float32) * scale.to(torch.float32)[:, None]).to(dtype)
