"""Argument building and launching: ``_launch`` runs one ``Config`` on checked operands."""

from __future__ import annotations

import torch
from torch import Tensor

from fusepass.kernels._common import cdiv, interpreting
from fusepass.kernels.dequant_matmul.config import _GROUP_M, Config, _k_split, _pow2
from fusepass.kernels.dequant_matmul.counters import _split_counters
from fusepass.kernels.dequant_matmul.dequant import _dequant_kernel
from fusepass.kernels.dequant_matmul.gemv import _dequant_gemv_kernel
from fusepass.kernels.dequant_matmul.tensor_core import _dequant_mm_kernel, _dequant_mmt_kernel
from fusepass.kernels.dequant_matmul.tiles import _splitk_reduce_kernel


def _workspace(split: int, M: int, N: int, like: Tensor) -> Tensor:
    return torch.empty((split, M, N), dtype=torch.float32, device=like.device)


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
