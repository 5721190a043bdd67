"""RMSNorm, and RMSNorm of a residual sum, in one pass over memory.

    rms_norm(x, w):          r = 1 / sqrt(mean(x², -1) + eps)
                             n = x * r                          (fp32)
                             n = round_x(n)                     if cast_before_weight (HF Llama)
                             y = round_out(n * (w + offset))    offset 1.0: Gemma, Qwen3-Next (1 + w)
    add_rms_norm(x, res, w): h = round_x(x + res);  y = rms_norm(h, w);  returns (y, h)

over the last dim N of x [..., N], with fp32 accumulation (fp64 inputs go to
the plain-torch reference).  ``round_x`` rounds to x's dtype, ``round_out`` to
``out_dtype``.  ``cast_before_weight`` reproduces HF Llama's
``weight * hidden.to(input_dtype)``: two roundings in half precision.

The op is memory-bound: one read of x (and residual), one write of y (and h),
the weight (N elements) comes from L2.  Three kernel variants share the math:

- ``row``:    one row per program, the whole row in registers (N <= 16384);
- ``tile``:   a [BM, BN] tile of BM rows per program for short rows (N <= 1024:
              Qwen3's per-head q/k norm has N = 128 and M = tokens x heads), so
              that programs are not one-warp slivers;
- ``looped``: long rows (N > 16384, up to any N): a persistent grid, each
              program loops over rows; pass 1 accumulates the sum of squares
              over BN-wide chunks (and writes h), pass 2 re-reads x (or h) from
              L2 and normalises.  One or a few rows per SM are in flight, so the
              re-read hits L2 instead of going back to DRAM.  add+RMSNorm with
              4096..8192 columns and many rows runs it too, one program per
              row (as Inductor's looped reductions do).

Launch choices (variant, block, warps, grid, weight-first) come
from :func:`rms_norm_config`, tuned with ``benchmarks/sweep_rms_norm.py``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from fusepass.formats import KERNEL_DTYPES as _KERNEL_DTYPES
from fusepass.kernels._common import (
    Launch,
    call,
    cdiv,
    emulate_rounding,
    eps_args,
    inline_enabled,
    is_ptr,
    on_device,
    op_eps,
    pdl_begin,
    pdl_on,
    register_inline,
    round_to,
    run_kernel,
    scalar_arg,
    scalar_fp32,
    sm_count,
)
from fusepass.kernels._common import rows as _rows  # [M, N] rows: a view where one exists, else a copy
from fusepass.match import hint


@triton.jit
def _rms_norm_fwd_kernel(
    x,
    res,
    w,
    y,
    h,
    stride_x,
    stride_r,
    stride_y,
    stride_h,
    M,
    N,
    eps,
    weight_offset,
    HAS_RESIDUAL: tl.constexpr,
    CAST_BEFORE_WEIGHT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    W_FIRST: tl.constexpr,
    EPS_PTR: tl.constexpr,
    EMU_X: tl.constexpr,
    EMU_Y: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_begin(PDL)  # (a PDL launch: nothing is read before it)
    # Variants ``row`` (BM = 1) and ``tile``: BN >= N, each row is read once
    # and stays in registers between the reduction and the scaling.
    # eps: a number or a pointer to one (a runtime eps: see _common.scalar_arg).
    eps = scalar_fp32(eps, EPS_PTR)
    weight_offset = tl.cast(weight_offset, tl.float32)  # fp64 when Inductor launches the kernel
    i_m = tl.program_id(0)
    o_m = i_m * BM + tl.arange(0, BM)
    o_n = tl.arange(0, BN)
    m_m = o_m < M
    m_n = o_n < N
    m_mn = m_m[:, None] & m_n[None, :]
    # int64 row offsets: M * stride passes 2**31 at 65536 tokens x 32768.
    o_m = o_m.to(tl.int64)

    # x and res are read exactly once: evict them first, keep w (reused by
    # every program) in L2.  W_FIRST issues w's load before the row's
    # reduction (whose barrier the compiler does not move loads across), so
    # its L2 latency overlaps x's; it holds w in registers meanwhile.
    if W_FIRST:
        b_w = tl.load(w + o_n, mask=m_n, other=0.0, eviction_policy="evict_last")
    # [BM, BN]
    p_x = x + o_m[:, None] * stride_x + o_n[None, :]
    b_x = tl.load(p_x, mask=m_mn, other=0.0, eviction_policy="evict_first").to(tl.float32)
    if HAS_RESIDUAL:
        p_r = res + o_m[:, None] * stride_r + o_n[None, :]
        b_r = tl.load(p_r, mask=m_mn, other=0.0, eviction_policy="evict_first").to(tl.float32)
        # torch's x + res: an fp32 add, one rounding to x's dtype; the norm
        # sees the rounded h, as the unfused graph does.
        b_h = round_to(b_x + b_r, h.dtype.element_ty, EMU_X)
        p_h = h + o_m[:, None] * stride_h + o_n[None, :]
        tl.store(p_h, b_h, mask=m_mn)
        b_x = b_h.to(tl.float32)
    # [BM]
    b_rstd = tl.rsqrt(tl.sum(b_x * b_x, axis=1) / N + eps)
    # [BM, BN]
    b_n = b_x * b_rstd[:, None]
    if CAST_BEFORE_WEIGHT:
        b_n = round_to(b_n, x.dtype.element_ty, EMU_X).to(tl.float32)
    # [BN]
    if not W_FIRST:
        b_w = tl.load(w + o_n, mask=m_n, other=0.0, eviction_policy="evict_last")
    b_w = b_w.to(tl.float32) + weight_offset
    p_y = y + o_m[:, None] * stride_y + o_n[None, :]
    tl.store(p_y, round_to(b_n * b_w[None, :], y.dtype.element_ty, EMU_Y), mask=m_mn)


@triton.jit
def _looped_pass1_chunk(p_x, p_r, p_h, o_c, N, HAS_RESIDUAL: tl.constexpr, EMU_X: tl.constexpr):
    # One chunk of pass 1: x (or h = x + res, written here) in fp32.  What
    # pass 2 reads back (x, or h) is kept in L2 (evict_last).
    m_c = o_c < N
    if HAS_RESIDUAL:
        b_x = tl.load(p_x + o_c, mask=m_c, other=0.0, eviction_policy="evict_first").to(tl.float32)
        b_r = tl.load(p_r + o_c, mask=m_c, other=0.0, eviction_policy="evict_first").to(tl.float32)
        b_h = round_to(b_x + b_r, p_h.dtype.element_ty, EMU_X)
        tl.store(p_h + o_c, b_h, mask=m_c, eviction_policy="evict_last")
        return b_h.to(tl.float32)
    else:
        return tl.load(p_x + o_c, mask=m_c, other=0.0, eviction_policy="evict_last").to(tl.float32)


@triton.jit
def _looped_pass2_chunk(p_x, p_w, p_y, o_c, N, b_rstd, weight_offset, CAST_BEFORE_WEIGHT: tl.constexpr,
                        EMU_X: tl.constexpr, EMU_Y: tl.constexpr):
    # One chunk of pass 2: re-read x (or h) from L2, its last use; normalise.
    m_c = o_c < N
    b_x = tl.load(p_x + o_c, mask=m_c, other=0.0, eviction_policy="evict_first").to(tl.float32)
    b_n = b_x * b_rstd
    if CAST_BEFORE_WEIGHT:
        b_n = round_to(b_n, p_x.dtype.element_ty, EMU_X).to(tl.float32)
    b_w = tl.load(p_w + o_c, mask=m_c, other=0.0, eviction_policy="evict_last").to(tl.float32)
    tl.store(p_y + o_c, round_to(b_n * (b_w + weight_offset), p_y.dtype.element_ty, EMU_Y), mask=m_c)


@triton.jit
def _rms_norm_fwd_looped_kernel(
    x,
    res,
    w,
    y,
    h,
    stride_x,
    stride_r,
    stride_y,
    stride_h,
    M,
    N,
    eps,
    weight_offset,
    HAS_RESIDUAL: tl.constexpr,
    CAST_BEFORE_WEIGHT: tl.constexpr,
    BN: tl.constexpr,
    EPS_PTR: tl.constexpr,
    EMU_X: tl.constexpr,
    EMU_Y: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_begin(PDL)  # (a PDL launch: nothing is read before it)
    # Variant ``looped``: a persistent grid of a few programs per SM, each
    # walking rows i_p, i_p + grid, ...; a row is BN-wide chunks, read twice
    # (the second time from L2: the launcher sizes the grid so that the rows
    # in flight fit in about half of the 50 MB L2 of an H100/H200).
    # int64 rows: M * stride passes 2**31 at 8192 tokens x 262144.
    eps = scalar_fp32(eps, EPS_PTR)
    weight_offset = tl.cast(weight_offset, tl.float32)
    i_p = tl.program_id(0).to(tl.int64)
    o_n = tl.arange(0, BN)
    for i_m in range(i_p, M, tl.num_programs(0)):
        p_x = x + i_m * stride_x
        p_r = res + i_m * stride_r
        p_y = y + i_m * stride_y
        p_h = h + i_m * stride_h

        # Pass 1: sum of squares.
        # [BN]
        b_sq = tl.zeros([BN], dtype=tl.float32)
        for i_n in range(0, N, BN):
            b_x = _looped_pass1_chunk(p_x, p_r, p_h, i_n + o_n, N, HAS_RESIDUAL, EMU_X)
            b_sq += b_x * b_x
        b_rstd = tl.rsqrt(tl.sum(b_sq, axis=0) / N + eps)

        # Pass 2: normalise.
        if HAS_RESIDUAL:
            # Pass 2 reads h that other threads of this program may have
            # written: a block-wide barrier orders those global writes.
            tl.debug_barrier()
            p_x = p_h
        for i_n in range(0, N, BN):
            _looped_pass2_chunk(p_x, w, p_y, i_n + o_n, N, b_rstd, weight_offset, CAST_BEFORE_WEIGHT, EMU_X, EMU_Y)


# ---------------------------------------------------------------- launch ----

VARIANTS = ("row", "tile", "looped")

# 16 elements per thread: two 16-byte vectors per operand in bf16, four in
# fp32.  ptxas 12.8 (sm_90a, offline, on Triton 3.9's PTX) gives the bf16 row
# kernel 32 registers at 16 elements per thread and 64 at 32, so 16 lets
# 2048 threads per SM run: full occupancy, several rows' loads in flight.
_ELEMS_PER_THREAD = 16
# Longest row held in registers: 16384 at 32 warps (32 registers, two
# programs per SM).  65536 at 32 warps spills 184 bytes per thread (same
# ptxas); 32768 fits at 64 registers, but then one program fills the SM's
# register file and nothing overlaps its reduction with loads, so rows
# longer than 16384 loop.
_ONE_PASS_MAX_N = 16384
# Rows of at most 1024 elements share a program: a 4096-element tile (8 warps,
# 16 elements per thread), 32 rows at N = 128.
_TILE_MAX_N = 1024
_TILE_ELEMS = 4096
# Tiles shrink (while BM > 1) until the grid has four programs per SM: at
# M = 2048, N = 128 (64 tokens x 32 heads) 32-row tiles would make 64
# programs for 132 SMs; 2-row tiles make 1024.
_TILE_PROGRAMS_PER_SM = 4
# Looped variant: bytes of loads in flight per SM per chunk, split over the
# 1 to 4 resident programs.  Little's law wants about 3.35 TB/s x 1 us / 132
# SMs = 25 KB...
_LOOP_BYTES_PER_SM = 32 << 10
# ...and bytes of rows in flight that pass 2 re-reads, so the re-read is an
# L2 hit.  48 MB lets N = 65536 bf16 (128 KB rows) run two programs per SM:
# 264 x 128 KB = 34 MB of the 50 MB (H100) / 60 MB (H200) L2.  Measured on an
# H200 (Triton 3.6, CUDA graphs): 2048x65536 took 192 µs at one program per
# SM (24 MB budget, 16384-wide chunks), 178 µs at two with 8192-wide chunks,
# the best of 18 grid/chunk/warp configurations.
_LOOP_L2_BYTES = 48 << 20
# add+RMSNorm at 4096 <= N <= 8192 with many rows: the two-pass loop, one
# program per row, 2048-wide chunks (8 warps), re-reading h from L1/L2, beats
# holding x, res and h in registers.  Measured on an H200 (Triton 3.6, CUDA
# graphs): 4096x4096 35.9 vs 36.7 µs, 16384x4096 133.9 vs 139.5, 8192x8192
# 136.5 vs 137.7; at M = 32 it loses (2.6 vs 1.9 µs), hence the row floor.
# Without a residual the row kernel wins at these shapes (16.8 vs 21.4 µs at
# 4096x4096).
_RES_LOOP_MIN_N = 4096
_RES_LOOP_MAX_N = 8192
_RES_LOOP_PROGRAMS_PER_SM = 4
_RES_LOOP_BN = 2048
_RES_LOOP_WARPS = 8  # 8 elements per thread per chunk (4 warps: 36.7 µs at 4096x4096)
# Loading the weight before the reduction overlaps its L2 latency with x's
# load but holds it in registers across the reduction: a win when the grid is
# one wave or less (decode: M = 1, 32 at N = 4096 took 1.6 / 1.8 µs against
# 1.7 / 1.9), a loss at 16384 columns per program (it spills: 102 vs 69 µs).
_W_FIRST_MAX_ELEMS = 8192


@dataclass(frozen=True)
class RmsNormConfig:
    variant: str  # "row", "tile" or "looped"
    BM: int  # rows per program (row: 1; looped: rows are looped over)
    BN: int  # columns per block (row/tile: >= N; looped: the chunk)
    num_warps: int
    num_programs: int  # the grid
    w_first: bool = False  # row/tile: load the weight before the reduction


def _num_warps(elems: int) -> int:
    return max(1, min(32, elems // (32 * _ELEMS_PER_THREAD)))


def _long_row(N: int) -> bool:
    """Rows the one-pass kernels cannot hold: the persistent looped kernel's."""
    return triton.next_power_of_2(N) > _ONE_PASS_MAX_N


@functools.lru_cache(maxsize=4096)
def rms_norm_config(
    M: int,
    N: int,
    element_size: int,
    n_sm: int,
    variant: str | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_programs: int | None = None,
    w_first: bool | None = None,
    residual: bool = False,
) -> RmsNormConfig:
    """The launch for an [M, N] problem (``residual``: add+RMSNorm); the
    arguments from ``variant`` to ``w_first`` override the heuristic (tests
    force each variant at small shapes; tuning sweeps)."""
    BN = triton.next_power_of_2(N)
    if variant is None:
        if _long_row(N):
            variant = "looped"
        elif residual and _RES_LOOP_MIN_N <= BN <= _RES_LOOP_MAX_N and M >= _RES_LOOP_PROGRAMS_PER_SM * n_sm:
            variant = "looped"
        elif BN <= _TILE_MAX_N and M > 1:
            variant = "tile"
        else:
            variant = "row"
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")

    if variant == "looped":
        if not _long_row(N):
            # Rows short enough for L1/L2 to hold many at once: one program
            # per row, as Inductor's looped reductions run.
            block_n = block_n or min(BN, _RES_LOOP_BN)
            grid = num_programs or max(1, M)
            num_warps = num_warps or max(1, min(_RES_LOOP_WARPS, block_n // 256))
        else:
            # Pass 2 re-reads what pass 1 read (x) or wrote (h).  With a
            # residual a row in flight is twice the bytes (x and res read, h
            # written and kept): 2048x65536 took 283 µs at one program per SM
            # with 16384-wide chunks, 301 µs at two with 8192 (H200, Triton 3.6).
            row_bytes = N * element_size * (2 if residual else 1)
            per_sm = max(1, min(4, _LOOP_L2_BYTES // (n_sm * row_bytes)))
            if block_n is None:
                block_n = min(BN, max(256, triton.next_power_of_2(_LOOP_BYTES_PER_SM // per_sm // element_size)))
            grid = num_programs or max(1, min(M, per_sm * n_sm))
        return RmsNormConfig("looped", 1, block_n, num_warps or _num_warps(block_n), grid)

    if block_n is not None and block_n < N:
        raise ValueError(f"variant {variant!r} holds a whole row: block_n={block_n} < N={N}")
    BN = block_n or BN
    if variant == "row":
        BM = 1
    elif block_m is not None:
        BM = block_m
    else:
        BM = max(1, _TILE_ELEMS // BN)
        while BM > 1 and triton.cdiv(M, BM) < _TILE_PROGRAMS_PER_SM * n_sm:
            BM //= 2
    grid = triton.cdiv(M, BM)
    if num_programs is not None and num_programs != grid:
        raise ValueError(f"variant {variant!r} launches cdiv(M, BM) = {grid} programs")
    if w_first is None:
        w_first = grid <= n_sm and BM * BN <= _W_FIRST_MAX_ELEMS
    return RmsNormConfig(variant, BM, BN, num_warps or _num_warps(BM * BN), grid, w_first=w_first)


def _output(out: Tensor | None, like: Tensor, dtype: torch.dtype, name: str) -> Tensor:
    if out is None:
        return torch.empty(like.shape, dtype=dtype, device=like.device)
    if out.shape != like.shape or out.dtype != dtype or out.device != like.device or not out.is_contiguous():
        raise ValueError(
            f"{name} is {tuple(out.shape)} {out.dtype} {out.device} contiguous={out.is_contiguous()}, "
            f"expected contiguous {tuple(like.shape)} {dtype} {like.device}"
        )
    return out


def _check(x: Tensor, res: Tensor | None, weight: Tensor, out_dtype: torch.dtype) -> None:
    if x.dtype not in _KERNEL_DTYPES or weight.dtype not in _KERNEL_DTYPES or out_dtype not in _KERNEL_DTYPES:
        raise TypeError(f"no kernel for x {x.dtype}, weight {weight.dtype}, out {out_dtype}")
    if x.dim() == 0:
        raise ValueError("x must have a last dim")
    if weight.shape != (x.shape[-1],) or weight.device != x.device:
        raise ValueError(
            f"weight is {tuple(weight.shape)} on {weight.device}, expected ({x.shape[-1]},) on {x.device}"
        )
    if res is not None and (res.shape != x.shape or res.dtype != x.dtype or res.device != x.device):
        raise ValueError(f"residual is {tuple(res.shape)} {res.dtype}, x is {tuple(x.shape)} {x.dtype}")


_NO_OVERRIDES: dict = {}


def _row_args(t: Tensor, N: int) -> tuple[Tensor, int]:
    """A non-contiguous ``t`` as kernel arguments: [M, N] rows and their stride."""
    t2 = _rows(t, N)
    return t2, t2.stride(0)


def rms_norm_launch(x, res, weight, eps, weight_offset, cast_before_weight, y, h, overrides=_NO_OVERRIDES) -> Launch:
    """The launch writing y (and h) from checked inputs, y and h contiguous with
    x's shape: the op's CUDA body runs it, a graph gets it traced.

    The decode sizes (M = 1, 32) are launch-bound, so this path stays short:
    contiguous inputs and the outputs go to the kernel as they are (a pointer
    and a row stride of N); only other layouts are flattened by ``_rows``.
    Traced, M may be symbolic: the heuristic sees its hint, the grid stays
    symbolic for ``row``/``tile`` (one program per BM rows, whatever M is at
    run time) and fixed for ``looped`` (its programs stride over the rows).
    """
    N = x.shape[-1]
    M = x.numel() // N
    x2, sx = (x, N) if x.is_contiguous() else _row_args(x, N)
    if res is None:
        r2, sr, h, sh = x2, sx, x2, N  # not read or written without a residual
    else:
        r2, sr = (res, N) if res.is_contiguous() else _row_args(res, N)
        sh = N
    w = weight if N == 1 or weight.stride(0) == 1 else weight.contiguous()
    cfg = rms_norm_config(hint(M), N, x.element_size(), sm_count(x.device), residual=res is not None, **overrides)
    eps = scalar_arg(eps, x)
    args = dict(x=x2, res=r2, w=w, y=y, h=h, stride_x=sx, stride_r=sr, stride_y=N, stride_h=sh, M=M, N=N, eps=eps,
                weight_offset=float(weight_offset), HAS_RESIDUAL=res is not None,
                CAST_BEFORE_WEIGHT=bool(cast_before_weight), BN=cfg.BN, EPS_PTR=is_ptr(eps),
                # the interpreter's bf16 conversion truncates: rounded to nearest there as on a GPU
                EMU_X=emulate_rounding(x.dtype), EMU_Y=emulate_rounding(y.dtype), PDL=pdl_on(x))
    outputs = ("y", "h") if res is not None else ("y",)
    if cfg.variant == "looped":
        return Launch(_rms_norm_fwd_looped_kernel, (cfg.num_programs,), args, outputs, cfg.num_warps)
    return Launch(_rms_norm_fwd_kernel, (cdiv(M, cfg.BM),), {**args, "BM": cfg.BM, "W_FIRST": cfg.w_first}, outputs,
                  cfg.num_warps)


def _launch(x, res, weight, eps, weight_offset, cast_before_weight, y, h, overrides) -> None:
    """Write y (and h) from checked inputs; y and h are contiguous with x's shape."""
    if x.numel() == 0:
        return
    with on_device(x):
        rms_norm_launch(x, res, weight, eps, weight_offset, cast_before_weight, y, h, overrides).run()


def rms_norm_fwd(
    x: Tensor,
    weight: Tensor,
    eps: float | Tensor,
    weight_offset: float = 0.0,
    cast_before_weight: bool = False,
    out_dtype: torch.dtype | None = None,
    *,
    out: Tensor | None = None,
    **overrides,
) -> Tensor:
    """``rms_norm`` with the Triton kernel.  ``eps`` is a number or a 0-dim
    tensor (read when the kernel runs).  ``out`` (optional, contiguous, x's
    shape, ``out_dtype``) receives the result; ``overrides`` are
    :func:`rms_norm_config`'s ``variant``, ``block_m``, ``block_n``,
    ``num_warps``, ``num_programs``."""
    out_dtype = out_dtype or x.dtype
    _check(x, None, weight, out_dtype)
    y = _output(out, x, out_dtype, "out")
    _launch(x, None, weight, eps, weight_offset, cast_before_weight, y, None, overrides)
    return y


def add_rms_norm_fwd(
    x: Tensor,
    residual: Tensor,
    weight: Tensor,
    eps: float | Tensor,
    weight_offset: float = 0.0,
    cast_before_weight: bool = False,
    out_dtype: torch.dtype | None = None,
    *,
    out: Tensor | None = None,
    h_out: Tensor | None = None,
    **overrides,
) -> tuple[Tensor, Tensor]:
    """``add_rms_norm`` with the Triton kernel: returns (out, h = x + residual)."""
    out_dtype = out_dtype or x.dtype
    _check(x, residual, weight, out_dtype)
    y = _output(out, x, out_dtype, "out")
    h = _output(h_out, x, x.dtype, "h_out")
    _launch(x, residual, weight, eps, weight_offset, cast_before_weight, y, h, overrides)
    return y, h


# ------------------------------------------------------------------- ops ----


def rms_norm_reference(x, weight, eps, weight_offset, cast_before_weight, out_dtype):
    """The op's semantics in plain torch: the CPU implementation and the fallback."""
    xf = x.double() if x.dtype == torch.float64 else x.float()
    n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if cast_before_weight:  # HF Llama: weight * hidden.to(input_dtype)
        n = n.to(x.dtype).to(xf.dtype)
    wf = weight.double() if weight.dtype == torch.float64 else weight.float()
    return (n * (wf + weight_offset)).to(out_dtype)  # weight_offset=1.0: Gemma/Qwen3-Next (1+w)


def add_rms_norm_reference(x, residual, weight, eps, weight_offset, cast_before_weight, out_dtype):
    h = x + residual  # in x.dtype; x and residual have the same dtype and shape
    return rms_norm_reference(h, weight, eps, weight_offset, cast_before_weight, out_dtype), h


def _kernel_handles(x: Tensor, weight: Tensor, out_dtype: torch.dtype, residual: Tensor | None = None) -> bool:
    """False routes to the reference (fp64, odd shapes) instead of a wrong answer."""
    return (
        x.dtype in _KERNEL_DTYPES
        and weight.dtype in _KERNEL_DTYPES
        and out_dtype in _KERNEL_DTYPES
        and x.dim() >= 1
        and weight.shape == (x.shape[-1],)
        and weight.device == x.device
        and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype
                                  and residual.device == x.device))
    )


def _rms_norm_ref_out(x, weight, eps, weight_offset, cast_before_weight, out_dtype) -> Tensor:
    return rms_norm_reference(x, weight, eps, weight_offset, cast_before_weight, out_dtype).contiguous()


def _check_residual(x: Tensor, residual: Tensor) -> None:
    # h is x's dtype and shape (the fake says so): a promoting or broadcasting
    # add would make the real output disagree with the fake.
    torch._check(residual.dtype == x.dtype, lambda: f"residual is {residual.dtype}, x is {x.dtype}")
    torch._check(residual.shape == x.shape, lambda: f"residual is {tuple(residual.shape)}, x is {tuple(x.shape)}")


def _add_rms_norm_ref_out(x, residual, weight, eps, weight_offset, cast_before_weight, out_dtype):
    _check_residual(x, residual)
    y, h = add_rms_norm_reference(x, residual, weight, eps, weight_offset, cast_before_weight, out_dtype)
    return y.contiguous(), h.contiguous()


@torch.library.custom_op("fusepass::rms_norm", mutates_args=())
def rms_norm(
    x: Tensor,
    weight: Tensor,
    eps: float,
    weight_offset: float,
    cast_before_weight: bool,
    out_dtype: torch.dtype,
    eps_tensor: Tensor | None = None,
) -> Tensor:
    """RMSNorm over the last dim, contiguous.  ``eps_tensor`` (0-dim, any
    device), when given, is the eps instead of ``eps``, read at run time.
    This body serves CPU and every non-CUDA device."""
    eps = op_eps(eps, eps_tensor)
    return _rms_norm_ref_out(x, weight, eps, weight_offset, cast_before_weight, out_dtype)


@rms_norm.register_fake
def _rms_norm_fake(x, weight, eps, weight_offset, cast_before_weight, out_dtype, eps_tensor=None):
    op_eps(eps, eps_tensor)
    return x.new_empty(x.shape, dtype=out_dtype)


@rms_norm.register_kernel("cuda")
def _rms_norm_cuda(x, weight, eps, weight_offset, cast_before_weight, out_dtype, eps_tensor=None):
    eps = op_eps(eps, eps_tensor)
    args = (x, weight, eps, weight_offset, cast_before_weight, out_dtype)
    if not _kernel_handles(x, weight, out_dtype):
        return _rms_norm_ref_out(*args)

    def launch():
        y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
        _launch(x, None, weight, eps, weight_offset, cast_before_weight, y, None, _NO_OVERRIDES)
        return y

    return run_kernel("rms_norm", launch, lambda: _rms_norm_ref_out(*args))


@torch.library.custom_op("fusepass::add_rms_norm", mutates_args=())
def add_rms_norm(
    x: Tensor,
    residual: Tensor,
    weight: Tensor,
    eps: float,
    weight_offset: float,
    cast_before_weight: bool,
    out_dtype: torch.dtype,
    eps_tensor: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(rms_norm(x + residual), x + residual), contiguous; ``eps_tensor`` as
    for ``fusepass::rms_norm``.  This body serves CPU and every non-CUDA device."""
    eps = op_eps(eps, eps_tensor)
    return _add_rms_norm_ref_out(x, residual, weight, eps, weight_offset, cast_before_weight, out_dtype)


@add_rms_norm.register_fake
def _add_rms_norm_fake(x, residual, weight, eps, weight_offset, cast_before_weight, out_dtype, eps_tensor=None):
    _check_residual(x, residual)
    op_eps(eps, eps_tensor)
    return x.new_empty(x.shape, dtype=out_dtype), x.new_empty(x.shape)


@add_rms_norm.register_kernel("cuda")
def _add_rms_norm_cuda(x, residual, weight, eps, weight_offset, cast_before_weight, out_dtype, eps_tensor=None):
    eps = op_eps(eps, eps_tensor)
    args = (x, residual, weight, eps, weight_offset, cast_before_weight, out_dtype)
    if not _kernel_handles(x, weight, out_dtype, residual):
        return _add_rms_norm_ref_out(*args)

    def launch():
        y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
        h = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        _launch(x, residual, weight, eps, weight_offset, cast_before_weight, y, h, _NO_OVERRIDES)
        return y, h

    return run_kernel("add_rms_norm", launch, lambda: _add_rms_norm_ref_out(*args))


# ------------------------------------------------------- calls in graphs ----


def _traced(x, res, weight, eps, weight_offset, cast_before_weight, out_dtype):
    """The kernel as a node of the graph (:meth:`Launch.traced`), on contiguous rows."""
    x = x.contiguous()
    res = None if res is None else res.contiguous()
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device) if res is not None else None
    out = rms_norm_launch(x, res, weight, eps, weight_offset, cast_before_weight, y, h).traced()
    return (out["y"], out["h"]) if res is not None else out["y"]


def _inline_ok(x: Tensor, weight: Tensor, eps, out_dtype: torch.dtype, residual: Tensor | None = None) -> bool:
    # A tensor eps (what dynamic=True makes of a Python float: a 0-dim CPU
    # graph input) goes through the op, which reads it when it runs: on the
    # host for a CPU eps (no device sync), in the kernel for one on x's device.
    # Inlined, Inductor would pass a 0-dim CPU graph input to the kernel as a
    # value (codegen/triton_utils.py, should_unwrap_unspec_arg), but that
    # launch has not been run on a GPU yet.
    # Rows longer than the one-pass kernel holds (the persistent looped
    # variant) go through the op: launched from Inductor's generated code that
    # kernel measured slower than the same launch from the op (H200, Triton
    # 3.6, GPU time: 2048x65536 RMSNorm 202.5 vs 177.9 µs, add+RMSNorm 295.8
    # vs 284.8), and at such sizes the op's CPU cost hides behind the GPU's.
    return (inline_enabled(x) and not isinstance(eps, Tensor) and not _long_row(x.shape[-1])
            and _kernel_handles(x, weight, out_dtype, residual))


def _rms_norm_inline_ok(x, weight, eps, weight_offset, cast_before_weight, out_dtype, eps_tensor=None):
    return eps_tensor is None and _inline_ok(x, weight, eps, out_dtype)


def _rms_norm_inline(x, weight, eps, weight_offset, cast_before_weight, out_dtype, eps_tensor=None):
    return _traced(x, None, weight, eps, weight_offset, cast_before_weight, out_dtype)


def _add_rms_norm_inline_ok(x, residual, weight, eps, weight_offset, cast_before_weight, out_dtype,
                            eps_tensor=None):
    return eps_tensor is None and _inline_ok(x, weight, eps, out_dtype, residual)


def _add_rms_norm_inline(x, residual, weight, eps, weight_offset, cast_before_weight, out_dtype, eps_tensor=None):
    return _traced(x, residual, weight, eps, weight_offset, cast_before_weight, out_dtype)


register_inline(torch.ops.fusepass.rms_norm.default, _rms_norm_inline_ok, _rms_norm_inline)
register_inline(torch.ops.fusepass.add_rms_norm.default, _add_rms_norm_inline_ok, _add_rms_norm_inline)


def rms_norm_call(x, weight, eps, weight_offset, cast_before_weight, out_dtype):
    """What the rules put in a graph: the kernel itself when the engine inlines
    kernels for a CUDA graph, else the ``fusepass::rms_norm`` op.  ``eps`` is a
    number or a 0-dim tensor (see :func:`fusepass.match.scalar_input`)."""
    eps, eps_tensor = eps_args(eps)
    return call(torch.ops.fusepass.rms_norm.default, x, weight, eps, weight_offset, cast_before_weight, out_dtype,
                eps_tensor)


def add_rms_norm_call(x, residual, weight, eps, weight_offset, cast_before_weight, out_dtype):
    """As :func:`rms_norm_call`, for ``fusepass::add_rms_norm``."""
    eps, eps_tensor = eps_args(eps)
    return call(torch.ops.fusepass.add_rms_norm.default, x, residual, weight, eps, weight_offset, cast_before_weight,
                out_dtype, eps_tensor)
