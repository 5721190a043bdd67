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
"""

from __future__ import annotations

import torch
from torch import Tensor

from fusepass.kernels._common import run_kernel

FORMATS = ("int8", "int4", "fp8")
_WEIGHT_DTYPES = {"int8": torch.int8, "int4": torch.uint8, "fp8": torch.float8_e4m3fn}


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
    torch._check(weight.dtype == _WEIGHT_DTYPES[fmt], lambda: f"{fmt} weight must be {_WEIGHT_DTYPES[fmt]}, got {weight.dtype}")
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
# The CUDA implementation is the Triton kernels (issue: quantized linears);
# until they exist the CUDA path runs the reference too.


@torch.library.custom_op("fusepass::dequant_matmul", mutates_args=())
def dequant_matmul(x: Tensor, weight: Tensor, scale: Tensor, zero: Tensor | None, bias: Tensor | None, fmt: str,
                   group_size: int) -> Tensor:
    """x @ dequant(weight)^T + bias, [..., N] contiguous in x's dtype."""
    _check(x, weight, scale, zero, bias, fmt, group_size)
    return dequant_matmul_reference(x, weight, scale, zero, bias, fmt, group_size).contiguous()


@dequant_matmul.register_fake
def _dequant_matmul_fake(x, weight, scale, zero, bias, fmt, group_size):
    _check(x, weight, scale, zero, bias, fmt, group_size)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@dequant_matmul.register_kernel("cuda")
def _dequant_matmul_cuda(x, weight, scale, zero, bias, fmt, group_size):
    _check(x, weight, scale, zero, bias, fmt, group_size)
    ref = lambda: dequant_matmul_reference(x, weight, scale, zero, bias, fmt, group_size).contiguous()  # noqa: E731
    return run_kernel("dequant_matmul", ref, ref)
