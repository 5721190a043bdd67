"""The op ``fusepass::dequant_matmul``: its fake, CUDA (Triton) and CPU (plain
torch) implementations, the fp32 reference, and its inlined form (the same
launches put into a graph)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fusepass.formats import FORMATS, KERNEL_DTYPES, WEIGHT_DTYPES, dequantize
from fusepass.kernels._common import call, inline_enabled, on_device, register_inline, rows, run_kernel
from fusepass.kernels.dequant_matmul.config import Config, Problem, valid
from fusepass.kernels.dequant_matmul.launch import _launch, dequant_launch, product_launch, splits, tiles
from fusepass.kernels.dequant_matmul.plans import lookup


def _plan(M: int, N: int, K: int, fmt: str, G: int, dtype: torch.dtype, device: torch.device) -> Config:
    return lookup(Problem.of(M, N, K, fmt, G, dtype, device))


def _operands(x: Tensor, weight: Tensor, scale: Tensor, zero: Tensor | None, bias: Tensor | None):
    """(x as [M, K] rows with unit column stride, weight, scale, zero, bias) as the kernels read them."""
    K = x.shape[-1]
    x2 = rows(x, K)
    if x2.stride(1) != 1:  # a broadcast row of x (stride 0): one copy
        x2 = x2.contiguous()
    # The rules refuse weights the kernels cannot read in place; any that
    # reach the op anyway are copied (correct, one extra pass over them).
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    return (x2, weight, scale.contiguous(), zero.contiguous() if zero is not None else None,
            bias.contiguous() if bias is not None else None)


def dequant_matmul_fwd(x: Tensor, weight: Tensor, scale: Tensor, zero: Tensor | None, bias: Tensor | None,
                       fmt: str, group_size: int, *, config: Config | None = None) -> Tensor:
    """The op's CUDA body: ``config`` overrides the plan (tests, sweeps)."""
    if x.dtype not in KERNEL_DTYPES:
        raise TypeError(f"no kernel for {x.dtype} activations")
    K = x.shape[-1]
    N = weight.shape[0]
    out = torch.empty((*x.shape[:-1], N), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    if K == 0:
        return out.copy_(bias.expand_as(out) if bias is not None else torch.zeros((), dtype=x.dtype))
    x2, weight, scale, zero, bias = _operands(x, weight, scale, zero, bias)
    M = x2.shape[0]
    G = group_size if fmt == "int4" else 0
    cfg = config or _plan(M, N, K, fmt, G, x.dtype, x.device)
    if not valid(cfg, Problem(M, N, K, fmt, G, x.dtype, "")):
        raise ValueError(f"config {cfg.label()} cannot run M{M} K{K} {fmt} g{G} {x.dtype}")
    with on_device(x):
        _launch(x2, weight, scale, zero, bias, out.view(M, N), fmt, G, cfg)
    return out


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
    if x.dtype not in KERNEL_DTYPES:  # fp64: the reference
        return _reference_out(x, weight, scale, zero, bias, fmt, group_size)
    return run_kernel(
        "dequant_matmul",
        lambda: dequant_matmul_fwd(x, weight, scale, zero, bias, fmt, group_size),
        lambda: _reference_out(x, weight, scale, zero, bias, fmt, group_size),
    )


# ------------------------------------------------------- calls in graphs ----


def dequant_matmul_traced(x: Tensor, weight: Tensor, scale: Tensor, zero: Tensor | None, bias: Tensor | None,
                          fmt: str, group_size: int) -> Tensor:
    """The op's launches as nodes of the graph (:meth:`Launch.traced`), with the
    plan chosen now, for this M: the fused product, with a split K's slices and
    zeroed counters allocated in the graph (the tile's last program sums the
    slices and leaves the counters at zero), or the dequantising pass and the
    graph's own ``mm`` (Inductor's cuBLAS call)."""
    K = x.shape[-1]
    N = weight.shape[0]
    x2, weight, scale, zero, bias = _operands(x, weight, scale, zero, bias)
    M = x2.shape[0]
    G = group_size if fmt == "int4" else 0
    cfg = _plan(M, N, K, fmt, G, x.dtype, x.device)
    w = weight.view(torch.uint8) if fmt == "fp8" else weight
    if cfg.kind == "cublas":
        wd = torch.empty((N, K), dtype=x.dtype, device=x.device)
        wd = dequant_launch(w, scale, zero, wd, fmt, G).traced()["out"]
        y = torch.mm(x2, wd.t()) if bias is None else torch.addmm(bias.to(x.dtype), x2, wd.t())
    else:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
        split = splits(cfg, K)
        part = ctr = None
        if split > 1:
            part = torch.empty((split, M, N), dtype=torch.float32, device=x.device)
            ctr = torch.zeros(tiles(cfg, M, N), dtype=torch.int32, device=x.device)
        y = product_launch(x2, w, scale, zero, bias, out, fmt, G, cfg, part, ctr).traced()["out"]
    return y.view(*x.shape[:-1], N)


def _static(*sizes) -> bool:
    return all(isinstance(s, int) for s in sizes)


def _inline_ok(x, weight, scale, zero, bias, fmt, group_size) -> bool:
    # The plan depends on M (the GEMV's row count is a constexpr): a symbolic
    # M goes through the op, which plans per call.
    return (inline_enabled(x) and x.dtype in KERNEL_DTYPES and fmt in FORMATS and weight.dim() == 2
            and _static(*x.shape, *x.stride(), *weight.shape, *weight.stride())
            and math.prod(x.shape[:-1]) > 0 and weight.shape[0] > 0 and x.shape[-1] > 0)


register_inline(torch.ops.fusepass.dequant_matmul.default, _inline_ok, dequant_matmul_traced)


def dequant_matmul_call(x, weight, scale, zero, bias, fmt, group_size):
    """What the rules put in a graph: the launches themselves when the engine
    inlines kernels for a CUDA graph, else the ``fusepass::dequant_matmul`` op."""
    return call(torch.ops.fusepass.dequant_matmul.default, x, weight, scale, zero, bias, fmt, group_size)
