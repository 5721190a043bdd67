"""Gated RMSNorm (the norm after every Gated DeltaNet layer) in one pass over memory.

    r = 1 / sqrt(mean(x², -1) + eps)                        fp32
    n = x * r                                                fp32
    p = w * round_x(n)        rounded to promote(w, x)       if cast_before_weight (Qwen3-Next, Qwen3.5, OLMo-hybrid)
    p = float(w) * n          fp32                           otherwise (Kimi-Linear, Bailing-hybrid, GLM-5-next)
    y = round_x(p * act(float(z)))                           act: silu or sigmoid, in fp32

over the last dim N of x and z (same shape, any leading dims), with fp32
math; fp64 inputs go to the plain-torch reference.  ``round_x`` rounds to
x's dtype, which is also y's.  The first form is HF's
``weight * hidden.to(input_dtype)`` followed by ``* silu(gate.to(float32))``:
in bf16 it rounds twice before the gate (the normalised value, then the
product with a bf16 weight -- an exact fp32 product of two bf16 values, so
one rounding of it is torch's), and once at the end.

Memory-bound: one read of x and z, one write of y; w (N elements) comes from
L2.  The rows are head_dim long (128 for Qwen3.5, 64..256 elsewhere) with M =
tokens x value heads rows, so short rows share a program: a [BM, BN] tile of
BM rows (the ``tile`` layout of :mod:`fusepass.kernels.rms_norm`).  Rows
longer than one block can hold (N > 16384, not seen in any model) loop over
BN-wide chunks twice, one program per row.
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
    rows,
    run_kernel,
    scalar_arg,
    scalar_fp32,
    sm_count,
)
from fusepass.match import hint


@triton.jit
def _act(b_z, ACT: tl.constexpr):
    # b_z fp32.  A large negative z: exp(-z) = inf, silu -0, sigmoid 0; z = -inf: silu NaN; as torch.
    if ACT == "silu":
        return b_z / (1.0 + tl.exp(-b_z))
    else:
        return 1.0 / (1.0 + tl.exp(-b_z))


@triton.jit
def _gate_and_store(b_n, b_w, p_z, p_y, mask, CAST_BEFORE_WEIGHT: tl.constexpr,
                    ROUND_PRODUCT: tl.constexpr, ACT: tl.constexpr, EMU: tl.constexpr):
    # b_n: the normalised rows in fp32; b_w: the weight in fp32, broadcast.
    # y has x's dtype: its element type is the rounding to x's dtype (three
    # roundings in a row: under the interpreter, round_to rounds to nearest
    # as the GPU does, where its bf16 conversion would truncate all three).
    if CAST_BEFORE_WEIGHT:
        b_n = round_to(b_n, p_y.dtype.element_ty, EMU).to(tl.float32)
    b_p = b_n * b_w
    if ROUND_PRODUCT:
        # weight * n.to(x.dtype) is a half-precision multiply when w has x's dtype.
        b_p = round_to(b_p, p_y.dtype.element_ty, EMU).to(tl.float32)
    b_z = tl.load(p_z, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    tl.store(p_y, round_to(b_p * _act(b_z, ACT), p_y.dtype.element_ty, EMU), mask=mask)


@triton.jit
def _rms_norm_gated_fwd_kernel(
    x,
    z,
    w,
    y,
    stride_x,
    stride_z,
    stride_y,
    M,
    N,
    eps,
    CAST_BEFORE_WEIGHT: tl.constexpr,
    ROUND_PRODUCT: tl.constexpr,
    ACT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    LOOPED: tl.constexpr,
    EPS_PTR: tl.constexpr,
    EMU: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_begin(PDL)  # (a PDL launch: nothing is read before it)
    # eps: a number or a pointer to one (a runtime eps: see _common.scalar_arg).
    eps = scalar_fp32(eps, EPS_PTR)
    i_m = tl.program_id(0)
    # int64 row offsets: M * stride passes 2**31 at 16384 tokens x 32 heads x 4096.
    o_m = (i_m * BM + tl.arange(0, BM)).to(tl.int64)
    o_n = tl.arange(0, BN)
    m_m = o_m < M
    if LOOPED:
        # BM = 1, N > BN: pass 1 sums squares over chunks, pass 2 re-reads the
        # row (an L1/L2 hit: one row per program) and writes y.
        # [BM, BN]
        b_sq = tl.zeros([BM, BN], dtype=tl.float32)
        for i_n in range(0, N, BN):
            m_mn = m_m[:, None] & (i_n + o_n < N)[None, :]
            p_x = x + o_m[:, None] * stride_x + (i_n + o_n)[None, :]
            b_x = tl.load(p_x, mask=m_mn, other=0.0, eviction_policy="evict_last").to(tl.float32)
            b_sq += b_x * b_x
        b_rstd = tl.rsqrt(tl.sum(b_sq, axis=1) / N + eps)
        for i_n in range(0, N, BN):
            m_c = (i_n + o_n) < N
            m_mn = m_m[:, None] & m_c[None, :]
            p_x = x + o_m[:, None] * stride_x + (i_n + o_n)[None, :]
            b_x = tl.load(p_x, mask=m_mn, other=0.0, eviction_policy="evict_first").to(tl.float32)
            b_w = tl.load(w + i_n + o_n, mask=m_c, other=0.0, eviction_policy="evict_last").to(tl.float32)
            _gate_and_store(b_x * b_rstd[:, None], b_w[None, :],
                            z + o_m[:, None] * stride_z + (i_n + o_n)[None, :],
                            y + o_m[:, None] * stride_y + (i_n + o_n)[None, :],
                            m_mn, CAST_BEFORE_WEIGHT, ROUND_PRODUCT, ACT, EMU)
    else:
        # BN >= N: each row is read once and stays in registers.
        m_n = o_n < N
        m_mn = m_m[:, None] & m_n[None, :]
        # [BM, BN]
        p_x = x + o_m[:, None] * stride_x + o_n[None, :]
        b_x = tl.load(p_x, mask=m_mn, other=0.0, eviction_policy="evict_first").to(tl.float32)
        # [BM]
        b_rstd = tl.rsqrt(tl.sum(b_x * b_x, axis=1) / N + eps)
        # [BN]: read by every program, kept in L2
        b_w = tl.load(w + o_n, mask=m_n, other=0.0, eviction_policy="evict_last").to(tl.float32)
        _gate_and_store(b_x * b_rstd[:, None], b_w[None, :],
                        z + o_m[:, None] * stride_z + o_n[None, :],
                        y + o_m[:, None] * stride_y + o_n[None, :],
                        m_mn, CAST_BEFORE_WEIGHT, ROUND_PRODUCT, ACT, EMU)


# ---------------------------------------------------------------- launch ----

ACTIVATIONS = ("silu", "sigmoid")
# Rows up to 16384 elements stay in registers (as fusepass::rms_norm's row
# variant); longer ones loop over 4096-wide chunks.
_ONE_PASS_MAX_N = 16384
_LOOP_BN = 4096
# A tile holds 4096 elements (16 per thread at 8 warps): 32 rows at N = 128.
# It shrinks (while BM > 1) until the grid has four programs per SM, so that
# decode-sized M (1 token x 32 heads) still spreads over SMs: those values are
# fusepass::rms_norm's tile heuristic, tuned on an H200 for the q/k norm's
# rows of 128; the gated norm reads twice the bytes per row (x and z).
_TILE_ELEMS = 4096
_TILE_PROGRAMS_PER_SM = 4
_ELEMS_PER_THREAD = 16


@dataclass(frozen=True)
class GatedNormConfig:
    BM: int
    BN: int
    num_warps: int
    num_programs: int
    looped: bool


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@functools.lru_cache(maxsize=4096)
def rms_norm_gated_config(M: int, N: int, n_sm: int, block_m: int | None = None,
                          num_warps: int | None = None) -> GatedNormConfig:
    """The launch for an [M, N] problem; ``block_m`` and ``num_warps`` override
    the heuristic (tests force several rows per tile at small shapes)."""
    BN = _next_pow2(N)
    if BN > _ONE_PASS_MAX_N:
        BN = _LOOP_BN
        return GatedNormConfig(1, BN, num_warps or 8, max(1, M), True)
    if block_m is None:
        block_m = max(1, _TILE_ELEMS // BN)
        while block_m > 1 and -(-M // block_m) < _TILE_PROGRAMS_PER_SM * n_sm:
            block_m //= 2
    warps = num_warps or max(1, min(32, block_m * BN // (32 * _ELEMS_PER_THREAD)))
    return GatedNormConfig(block_m, BN, warps, max(1, -(-M // block_m)), False)


def _flags(x: Tensor, weight: Tensor, cast_before_weight: bool, activation: str) -> dict:
    round_product = bool(cast_before_weight) and torch.promote_types(x.dtype, weight.dtype) == x.dtype \
        and x.dtype != torch.float32
    return dict(CAST_BEFORE_WEIGHT=bool(cast_before_weight), ROUND_PRODUCT=round_product, ACT=activation,
                EMU=emulate_rounding(x.dtype))


def _check(x: Tensor, gate: Tensor, weight: Tensor, activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if x.dtype not in _KERNEL_DTYPES or gate.dtype not in _KERNEL_DTYPES or weight.dtype not in _KERNEL_DTYPES:
        raise TypeError(f"no kernel for x {x.dtype}, gate {gate.dtype}, weight {weight.dtype}")
    if x.dim() == 0 or gate.shape != x.shape or gate.device != x.device:
        raise ValueError(f"gate is {tuple(gate.shape)} on {gate.device}, x is {tuple(x.shape)} on {x.device}")
    if weight.shape != (x.shape[-1],) or weight.device != x.device:
        raise ValueError(f"weight is {tuple(weight.shape)} on {weight.device}, expected ({x.shape[-1]},)")


def rms_norm_gated_launch(x: Tensor, gate: Tensor, weight: Tensor, eps: float | Tensor, cast_before_weight: bool,
                          activation: str, y: Tensor, block_m: int | None = None,
                          num_warps: int | None = None) -> Launch:
    """The launch writing y (contiguous, x's shape) from checked inputs: the op's
    CUDA body runs it, a graph gets it traced (M may be symbolic there: the
    heuristic sees its hint, the grid stays symbolic, one program per BM rows).

    Rows with any row stride (slices of the projection, every other row,
    broadcast rows) are read in place; other layouts are copied first."""
    N = x.shape[-1]
    x2, z2 = rows(x, N), rows(gate, N)
    M = x2.shape[0]
    w = weight if N == 1 or weight.stride(0) == 1 else weight.contiguous()
    cfg = rms_norm_gated_config(hint(M), N, sm_count(x.device), block_m, num_warps)
    eps = scalar_arg(eps, x)
    args = dict(x=x2, z=z2, w=w, y=y, stride_x=x2.stride(0), stride_z=z2.stride(0), stride_y=N, M=M, N=N, eps=eps,
                **_flags(x, weight, cast_before_weight, activation), BM=cfg.BM, BN=cfg.BN, LOOPED=cfg.looped,
                EPS_PTR=is_ptr(eps), PDL=pdl_on(x))
    return Launch(_rms_norm_gated_fwd_kernel, (M if cfg.looped else cdiv(M, cfg.BM),), args, ("y",), cfg.num_warps)


def rms_norm_gated_fwd(
    x: Tensor,
    gate: Tensor,
    weight: Tensor,
    eps: float | Tensor,
    cast_before_weight: bool = True,
    activation: str = "silu",
    *,
    out: Tensor | None = None,
    block_m: int | None = None,
    num_warps: int | None = None,
) -> Tensor:
    """``rms_norm_gated`` with the Triton kernel.  ``eps`` is a number or a
    0-dim tensor (read when the kernel runs).  ``out`` (optional, contiguous,
    x's shape and dtype) receives the result."""
    _check(x, gate, weight, activation)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    elif out.shape != x.shape or out.dtype != x.dtype or out.device != x.device or not out.is_contiguous():
        raise ValueError(f"out is {tuple(out.shape)} {out.dtype} {out.device}, expected contiguous like x")
    if out.numel() == 0:
        return out
    with on_device(x):
        rms_norm_gated_launch(x, gate, weight, eps, cast_before_weight, activation, out, block_m, num_warps).run()
    return out


# ------------------------------------------------------------------- ops ----


def rms_norm_gated_reference(x: Tensor, gate: Tensor, weight: Tensor, eps: float | Tensor, cast_before_weight: bool,
                             activation: str) -> Tensor:
    """The op's semantics in plain torch: the CPU implementation and the fallback.

    fp32 math as the modules do; with an fp64 operand the math is fp64 (the
    reference for the fp64 inputs the kernels do not take)."""
    wide = torch.float64 if torch.float64 in (x.dtype, gate.dtype, weight.dtype) else torch.float32
    xf = x.to(wide)
    n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if cast_before_weight:
        p = (weight * n.to(x.dtype)).to(wide)  # HF: weight * hidden.to(input_dtype), in promote(w, x)
    else:
        p = weight.to(wide) * n
    act = torch.sigmoid if activation == "sigmoid" else torch.nn.functional.silu
    return (p * act(gate.to(wide))).to(x.dtype)


def _check_op(x: Tensor, gate: Tensor, weight: Tensor, activation: str, eps: float,
              eps_tensor: Tensor | None) -> float | Tensor:
    """The op's argument checks; returns the eps to use (:func:`op_eps`)."""
    # y has x's shape (the fake says so): a broadcasting gate would make the
    # real output disagree with the fake.
    torch._check(gate.shape == x.shape, lambda: f"gate is {tuple(gate.shape)}, x is {tuple(x.shape)}")
    torch._check(activation in ACTIVATIONS, lambda: f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    return op_eps(eps, eps_tensor)


def _ref_out(x, gate, weight, eps, cast_before_weight, activation) -> Tensor:
    return rms_norm_gated_reference(x, gate, weight, eps, cast_before_weight, activation).contiguous()


def _kernel_handles(x: Tensor, gate: Tensor, weight: Tensor) -> bool:
    """False routes to the reference (fp64, odd weights) instead of a wrong answer."""
    return (
        x.dtype in _KERNEL_DTYPES
        and gate.dtype in _KERNEL_DTYPES
        and weight.dtype in _KERNEL_DTYPES
        and x.dim() >= 1
        and weight.shape == (x.shape[-1],)
        and gate.device == x.device
        and weight.device == x.device
    )


@torch.library.custom_op("fusepass::rms_norm_gated", mutates_args=())
def rms_norm_gated(x: Tensor, gate: Tensor, weight: Tensor, eps: float, cast_before_weight: bool,
                   activation: str, eps_tensor: Tensor | None = None) -> Tensor:
    """Gated RMSNorm over the last dim, in x's dtype, contiguous.  ``eps_tensor``
    (0-dim, any device), when given, is the eps instead of ``eps``, read at run
    time.  This body serves CPU and every non-CUDA device."""
    eps = _check_op(x, gate, weight, activation, eps, eps_tensor)
    return _ref_out(x, gate, weight, eps, cast_before_weight, activation)


@rms_norm_gated.register_fake
def _rms_norm_gated_fake(x, gate, weight, eps, cast_before_weight, activation, eps_tensor=None):
    _check_op(x, gate, weight, activation, eps, eps_tensor)
    return x.new_empty(x.shape)


@rms_norm_gated.register_kernel("cuda")
def _rms_norm_gated_cuda(x, gate, weight, eps, cast_before_weight, activation, eps_tensor=None):
    eps = _check_op(x, gate, weight, activation, eps, eps_tensor)
    args = (x, gate, weight, eps, cast_before_weight, activation)
    if not _kernel_handles(x, gate, weight):
        return _ref_out(*args)
    return run_kernel("rms_norm_gated", lambda: rms_norm_gated_fwd(*args), lambda: _ref_out(*args))


# ------------------------------------------------------- calls in graphs ----


def _traced(x, gate, weight, eps, cast_before_weight, activation):
    """The kernel as a node of the graph (:meth:`Launch.traced`)."""
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return rms_norm_gated_launch(x, gate, weight, eps, cast_before_weight, activation, y).traced()["y"]


def _inline_ok(x: Tensor, gate: Tensor, weight: Tensor, eps) -> bool:
    # A tensor eps goes through the op (see fusepass.kernels.rms_norm._inline_ok).
    return (inline_enabled(x) and not isinstance(eps, Tensor) and gate.shape == x.shape
            and _kernel_handles(x, gate, weight)
            and all(isinstance(s, int) for s in (*x.stride(), *gate.stride())))


def _op_inline_ok(x, gate, weight, eps, cast_before_weight, activation, eps_tensor=None):
    return eps_tensor is None and _inline_ok(x, gate, weight, eps)


def _op_inline(x, gate, weight, eps, cast_before_weight, activation, eps_tensor=None):
    return _traced(x, gate, weight, eps, cast_before_weight, activation)


register_inline(torch.ops.fusepass.rms_norm_gated.default, _op_inline_ok, _op_inline)


def rms_norm_gated_call(x, gate, weight, eps, cast_before_weight, activation):
    """What the rules put in a graph: the kernel itself when the engine inlines
    kernels for a CUDA graph, else the ``fusepass::rms_norm_gated`` op; ``eps``
    as for :func:`fusepass.kernels.rms_norm.rms_norm_call`."""
    eps, eps_tensor = eps_args(eps)
    return call(torch.ops.fusepass.rms_norm_gated.default, x, gate, weight, eps, cast_before_weight, activation,
                eps_tensor)
