"""The op: ``fusepass::dequant_matmul`` with its fake, CUDA (Triton) and CPU
(plain torch) implementations, and the fp32 reference."""

from __future__ import annotations

import torch
from torch import Tensor

from fusepass.kernels._common import on_device, rows, run_kernel
from fusepass.kernels.dequant_matmul.config import Config, _valid
from fusepass.kernels.dequant_matmul.launch import _launch
from fusepass.kernels.dequant_matmul.tuner import _plan

FORMATS = ("int8", "int4", "fp8")
WEIGHT_DTYPES = {"int8": torch.int8, "int4": torch.uint8, "fp8": torch.float8_e4m3fn}
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


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
