"""The op ``fusepass::dequant_matmul``: its fake, CUDA (Triton) and CPU (plain
torch) implementations, the fp32 reference, and its inlined form (the same
launches put into a graph)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fusepass.formats import (
    CODEBOOKS,
    KERNEL_DTYPES,
    OP_FORMATS,
    OP_WEIGHT_DTYPES,
    bnb_absmax,
    dequantize,
    in_features,
    out_features,
)
from fusepass.kernels._common import call, inline_enabled, on_device, register_inline, rows, run_kernel
from fusepass.kernels.dequant_matmul.config import Config, Problem, valid
from fusepass.kernels.dequant_matmul.launch import (
    _launch,
    dequant_launch,
    nested_absmax_launch,
    nested_fits,
    product_launch,
    splits,
    tiles,
)
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


def expand_absmax(scale: Tensor, nested: list[Tensor]) -> Tensor:
    """A code book's fp32 absmax [N, K / B] from bitsandbytes' double quantization:
    its bytes (``scale``) and (nested absmax, code, offset)."""
    return bnb_absmax(nested[0], scale, nested[1], nested[2]).reshape(scale.shape)


def dequant_matmul_fwd(x: Tensor, weight: Tensor, scale: Tensor, zero: Tensor | None, bias: Tensor | None,
                       fmt: str, group_size: int, g_idx: Tensor | None = None, shifts: Tensor | None = None,
                       nested: list[Tensor] | None = None, *, config: Config | None = None) -> Tensor:
    """The op's CUDA body: ``config`` overrides the plan (tests, sweeps)."""
    if x.dtype not in KERNEL_DTYPES:
        raise TypeError(f"no kernel for {x.dtype} activations")
    K = x.shape[-1]
    N = out_features(weight, fmt, scale)
    out = torch.empty((*x.shape[:-1], N), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    if K == 0:
        return out.copy_(bias.expand_as(out) if bias is not None else torch.zeros((), dtype=x.dtype))
    x2, weight, scale, zero, bias = _operands(x, weight, scale, zero, bias)
    M = x2.shape[0]
    G = group_size if fmt in ("int4", "nf4", "fp4", "hqq4") else 0
    cfg = config or _plan(M, N, K, fmt, G, x.dtype, x.device)
    if not valid(cfg, Problem(M, N, K, fmt, G, x.dtype, "")):
        raise ValueError(f"config {cfg.label()} cannot run M{M} K{K} {fmt} g{G} {x.dtype}")
    if nested is not None:
        nested = [t.contiguous() for t in nested]
        if not nested_fits(cfg, fmt, N, G):  # (the tensor-core and cuBLAS paths read an fp32 absmax)
            absmax = torch.empty(scale.shape, dtype=torch.float32, device=scale.device)
            with on_device(x):
                nested_absmax_launch(scale, nested, absmax).run()
            scale, nested = absmax, None
    with on_device(x):
        _launch(x2, weight, scale, zero, bias, out.view(M, N), fmt, G, cfg, g_idx=g_idx, shifts=shifts,
                nested=nested)
    return out


def dequant_matmul_reference(x: Tensor, weight: Tensor, scale: Tensor, zero: Tensor | None, bias: Tensor | None,
                             fmt: str, group_size: int, compute_dtype: torch.dtype = torch.float32,
                             g_idx: Tensor | None = None, shifts: Tensor | None = None,
                             nested: list[Tensor] | None = None) -> Tensor:
    """fp32 (or ``compute_dtype``) dequantise-then-matmul, rounded once to x's dtype
    (a double-quantized absmax expanded in fp32 first, as bitsandbytes does)."""
    if nested is not None:
        scale = expand_absmax(scale, nested)
    w = dequantize(weight, scale, zero, fmt, group_size, compute_dtype, g_idx=g_idx, shifts=shifts)
    y = x.to(compute_dtype) @ w.t()
    if bias is not None:
        y = y + bias.to(compute_dtype)
    return y.to(x.dtype if compute_dtype != torch.float64 else compute_dtype)


def _check_nested(scale: Tensor, nested: list[Tensor], blocks) -> None:
    torch._check(len(nested) == 3, lambda: f"nested is (nested absmax, code, offset), got {len(nested)} tensors")
    nest, code, offset = nested
    torch._check(scale.dtype == torch.uint8, lambda: f"a double-quantized absmax is uint8, got {scale.dtype}")
    torch._check(all(t.dtype == torch.float32 for t in nested), lambda: "nested absmax, code and offset must be fp32")
    torch._check(nest.dim() == 1 and nest.shape[0] == (blocks + 255) // 256,
                 lambda: f"nested absmax is {tuple(nest.shape)}, not one value per 256 of {blocks} blocks")
    torch._check(code.numel() == 256, lambda: f"the absmax code has {code.numel()} entries, not 256")
    torch._check(offset.numel() == 1, lambda: f"the absmax offset has {offset.numel()} values, not 1")


def _check(x: Tensor, weight: Tensor, scale: Tensor, zero: Tensor | None, bias: Tensor | None, fmt: str,
           group_size: int, g_idx: Tensor | None = None, shifts: Tensor | None = None,
           nested: list[Tensor] | None = None) -> None:
    torch._check(fmt in OP_FORMATS, lambda: f"fmt must be one of {OP_FORMATS}, got {fmt!r}")
    torch._check(weight.dtype == OP_WEIGHT_DTYPES[fmt], lambda: f"{fmt} weight must be {OP_WEIGHT_DTYPES[fmt]}, got {weight.dtype}")
    torch._check(weight.dim() == 2, lambda: f"weight must be 2-D, got {tuple(weight.shape)}")
    torch._check(nested is None or fmt in CODEBOOKS,
                 lambda: f"a nested absmax is for the code books {tuple(CODEBOOKS)}, not {fmt}")
    N = out_features(weight, fmt, scale)
    K = in_features(weight, fmt, scale)
    torch._check(x.shape[-1] == K, lambda: f"x has {x.shape[-1]} features, the weight {K}")
    torch._check((g_idx is not None) == fmt.startswith("gptq4"), lambda: "g_idx is for gptq4 only, and needed there")
    if fmt in ("nf4", "fp4"):
        torch._check(group_size > 0 and K % group_size == 0, lambda: f"K = {K} is not a multiple of block {group_size}")
        torch._check(tuple(scale.shape) == (N, K // group_size),
                     lambda: f"absmax is {tuple(scale.shape)}, not {(N, K // group_size)}")
        if nested is None:
            torch._check(scale.dtype == torch.float32, lambda: f"absmax must be fp32, got {scale.dtype}")
        else:
            _check_nested(scale, nested, N * (K // group_size))
        torch._check(zero is None, lambda: f"{fmt} takes no zero point")
    elif fmt == "hqq4":
        torch._check(group_size == weight.shape[1], lambda: f"hqq4: the group is the packed rows' {weight.shape[1]}")
        torch._check(scale.dim() == 2 and scale.shape[0] * scale.shape[1] == 2 * weight.shape[0],
                     lambda: f"scale {tuple(scale.shape)} is not [N, K / G] with N K / G = {2 * weight.shape[0]}")
        torch._check(zero is not None and tuple(zero.shape) == tuple(scale.shape),
                     lambda: "hqq4 takes a zero point of the scale's shape")
    elif fmt.startswith("gptq4"):
        torch._check(scale.dim() == 2 and scale.shape[1] == N, lambda: f"scale is {tuple(scale.shape)}, not (groups, {N})")
        torch._check(zero is not None and zero.dtype == torch.int32
                     and tuple(zero.shape) == (scale.shape[0], (N + 7) // 8),
                     lambda: f"zero must be int32 ({scale.shape[0]}, {(N + 7) // 8}) (eight per word along N)")
        torch._check(tuple(g_idx.shape) == (K,) and not g_idx.dtype.is_floating_point,
                     lambda: f"g_idx must be ({K},) integers, got {g_idx.dtype}{tuple(g_idx.shape)}")
        torch._check(shifts is None or (shifts.numel() == 8 and shifts.dtype == torch.int32),
                     lambda: "shifts must be eight int32 bit offsets")
    elif fmt == "int4":
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


def _reference_out(x, weight, scale, zero, bias, fmt, group_size, g_idx=None, shifts=None, nested=None) -> Tensor:
    return dequant_matmul_reference(x, weight, scale, zero, bias, fmt, group_size, g_idx=g_idx, shifts=shifts,
                                    nested=nested).contiguous()


def _nested(nested_absmax: Tensor | None, absmax_code: Tensor | None, absmax_offset: Tensor | None):
    """The op's three double-quantization tensors as one list, or None."""
    given = [t is not None for t in (nested_absmax, absmax_code, absmax_offset)]
    torch._check(len(set(given)) == 1, lambda: "nested_absmax, absmax_code and absmax_offset: all three or none")
    return [nested_absmax, absmax_code, absmax_offset] if given[0] else None


@torch.library.custom_op("fusepass::dequant_matmul", mutates_args=())
def dequant_matmul(x: Tensor, weight: Tensor, scale: Tensor, zero: Tensor | None, bias: Tensor | None, fmt: str,
                   group_size: int, g_idx: Tensor | None = None, shifts: Tensor | None = None,
                   nested_absmax: Tensor | None = None, absmax_code: Tensor | None = None,
                   absmax_offset: Tensor | None = None) -> Tensor:
    """x @ dequant(weight)^T + bias, [..., N] contiguous in x's dtype.  A code
    book's absmax as bitsandbytes' double quantization stores it: ``scale`` its
    bytes, absmax = absmax_code[byte] * nested_absmax[block // 256] + absmax_offset.
    This body serves CPU and every non-CUDA device."""
    nested = _nested(nested_absmax, absmax_code, absmax_offset)
    _check(x, weight, scale, zero, bias, fmt, group_size, g_idx, shifts, nested)
    return _reference_out(x, weight, scale, zero, bias, fmt, group_size, g_idx, shifts, nested)


@dequant_matmul.register_fake
def _dequant_matmul_fake(x, weight, scale, zero, bias, fmt, group_size, g_idx=None, shifts=None, nested_absmax=None,
                         absmax_code=None, absmax_offset=None):
    nested = _nested(nested_absmax, absmax_code, absmax_offset)
    _check(x, weight, scale, zero, bias, fmt, group_size, g_idx, shifts, nested)
    return x.new_empty((*x.shape[:-1], out_features(weight, fmt, scale)))


@dequant_matmul.register_kernel("cuda")
def _dequant_matmul_cuda(x, weight, scale, zero, bias, fmt, group_size, g_idx=None, shifts=None, nested_absmax=None,
                         absmax_code=None, absmax_offset=None):
    nested = _nested(nested_absmax, absmax_code, absmax_offset)
    _check(x, weight, scale, zero, bias, fmt, group_size, g_idx, shifts, nested)
    if x.dtype not in KERNEL_DTYPES:  # fp64: the reference
        return _reference_out(x, weight, scale, zero, bias, fmt, group_size, g_idx, shifts, nested)
    return run_kernel(
        "dequant_matmul",
        lambda: dequant_matmul_fwd(x, weight, scale, zero, bias, fmt, group_size, g_idx, shifts, nested),
        lambda: _reference_out(x, weight, scale, zero, bias, fmt, group_size, g_idx, shifts, nested),
    )


# ------------------------------------------------------- calls in graphs ----


def dequant_matmul_traced(x: Tensor, weight: Tensor, scale: Tensor, zero: Tensor | None, bias: Tensor | None,
                          fmt: str, group_size: int, g_idx: Tensor | None = None,
                          shifts: Tensor | None = None, nested_absmax: Tensor | None = None,
                          absmax_code: Tensor | None = None, absmax_offset: Tensor | None = None) -> Tensor:
    """The op's launches as nodes of the graph (:meth:`Launch.traced`), with the
    plan chosen now, for this M: the fused product, with a split K's slices and
    zeroed counters allocated in the graph (the tile's last program sums the
    slices and leaves the counters at zero), or the dequantising pass and the
    graph's own ``mm`` (Inductor's cuBLAS call)."""
    K = x.shape[-1]
    N = out_features(weight, fmt, scale)
    if nested_absmax is not None:  # (not inlined: _inline_ok)
        scale = expand_absmax(scale, [nested_absmax, absmax_code, absmax_offset])
    x2, weight, scale, zero, bias = _operands(x, weight, scale, zero, bias)
    M = x2.shape[0]
    G = group_size if fmt in ("int4", "nf4", "fp4", "hqq4") else 0
    cfg = _plan(M, N, K, fmt, G, x.dtype, x.device)
    w = weight.view(torch.uint8) if fmt == "fp8" else weight
    if cfg.kind == "cublas":
        wd = torch.empty((N, K), dtype=x.dtype, device=x.device)
        wd = dequant_launch(w, scale, zero, wd, fmt, G, g_idx, shifts).traced()["out"]
        y = torch.mm(x2, wd.t()) if bias is None else torch.addmm(bias.to(x.dtype), x2, wd.t())
    else:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
        split = splits(cfg, K)
        part = ctr = None
        if split > 1:
            part = torch.empty((split, M, N), dtype=torch.float32, device=x.device)
            ctr = torch.zeros(tiles(cfg, M, N), dtype=torch.int32, device=x.device)
        y = product_launch(x2, w, scale, zero, bias, out, fmt, G, cfg, part, ctr, g_idx, shifts).traced()["out"]
    return y.view(*x.shape[:-1], N)


def _static(*sizes) -> bool:
    return all(isinstance(s, int) for s in sizes)


def _inline_ok(x, weight, scale, zero, bias, fmt, group_size, g_idx=None, shifts=None, nested_absmax=None,
               absmax_code=None, absmax_offset=None) -> bool:
    # The plan depends on M (the GEMV's row count is a constexpr): a symbolic
    # M goes through the op, which plans per call.  The code-book formats
    # read their table from a tensor the op makes (no graph holds one): called.
    return (inline_enabled(x) and x.dtype in KERNEL_DTYPES and fmt in OP_FORMATS and fmt not in CODEBOOKS
            and (shifts is not None or not fmt.startswith("gptq4")) and nested_absmax is None
            and weight.dim() == 2
            and _static(*x.shape, *x.stride(), *weight.shape, *weight.stride())
            and math.prod(x.shape[:-1]) > 0 and weight.shape[0] > 0 and x.shape[-1] > 0)


register_inline(torch.ops.fusepass.dequant_matmul.default, _inline_ok, dequant_matmul_traced)


def dequant_matmul_call(x, weight, scale, zero, bias, fmt, group_size, g_idx=None, shifts=None, nested=None):
    """What the rules put in a graph: the launches themselves when the engine
    inlines kernels for a CUDA graph, else the ``fusepass::dequant_matmul`` op."""
    if nested is not None:
        return call(torch.ops.fusepass.dequant_matmul.default, x, weight, scale, zero, bias, fmt, group_size, None,
                    None, *nested)
    if g_idx is None:
        return call(torch.ops.fusepass.dequant_matmul.default, x, weight, scale, zero, bias, fmt, group_size)
    return call(torch.ops.fusepass.dequant_matmul.default, x, weight, scale, zero, bias, fmt, group_size, g_idx,
                shifts)
