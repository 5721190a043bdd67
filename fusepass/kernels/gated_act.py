"""Gated activations of an MLP: SwiGLU and GeGLU in one pass over memory.

    swiglu(g, u) = silu(g) * u,  silu(x) = x * sigmoid(x) = x / (1 + exp(-x))
    geglu(g, u)  = gelu(g) * u,  gelu(x) = x/2 * (1 + erf(x / sqrt(2)))            approximate="none"
                                 gelu(x) = x/2 * (1 + tanh(z)),                      approximate="tanh"
                                           z = sqrt(2/pi) * (x + 0.044715 x^3)

g and u have one shape [..., I] and one dtype.  Eager PyTorch in fp16/bf16
computes the activation in fp32, rounds it to the input dtype, then multiplies
in fp32 and rounds again; the kernel reproduces both roundings so that it
agrees with eager bit for bit up to the last-ulp differences of exp/erf.  The
product of two fp16/bf16 values is exact in fp32 (11 + 11 and 8 + 8
significand bits < 24), so one rounding of it is exactly eager's multiply.
fp32 computes in fp32; fp64 is served by the plain-torch reference.

The op is one read of g and u and one write of the output: memory-bound, 6
bytes per output element in bf16.  The real-world layout is Phi-3's
``gate_up_proj(x).chunk(2, -1)``: g and u are the two halves of one [M, 2I]
tensor, each with unit column stride and row stride 2I.  The kernel takes a
row stride per operand, so those halves (and any operand whose leading dims
flatten into rows) are read in place; only layouts without a unit column
stride are copied first.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from fusepass.formats import KERNEL_DTYPES as _KERNEL_DTYPES
from fusepass.kernels._common import (
    Launch,
    call,
    cdiv,
    emulate_rounding,
    inline_enabled,
    on_device,
    pdl_begin,
    pdl_on,
    register_inline,
    row_view,
    round_to,
    rows,
    run_kernel,
    sm_count,
)
from fusepass.match import hint


@triton.jit
def _gated_act_fwd_kernel(
    gate,
    up,
    out,
    N,
    NB,
    stride_g,
    stride_u,
    stride_o,
    ACT: tl.constexpr,
    BN: tl.constexpr,
    EMU_G: tl.constexpr,
    EMU_O: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_begin(PDL)  # (a PDL launch: nothing is read before it)
    # One flat grid of M * NB programs, column blocks fastest: consecutive
    # programs walk along a row, and M is not bound by the 65535 limit of the
    # grid's second axis (prefill batches reach M = 131072 tokens).
    i_mn = tl.program_id(0)
    i_m, i_n = i_mn // NB, i_mn % NB
    # int64 row offsets: M * row stride passes 2**31 at 37450 rows of a fused
    # [M, 2 * 28672] projection.
    i_m = i_m.to(tl.int64)

    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < N
    # [BN]
    b_g = tl.load(gate + i_m * stride_g + o_n, mask=m_n, other=0.0)
    b_u = tl.load(up + i_m * stride_u + o_n, mask=m_n, other=0.0)

    b_o = gated(b_g.to(tl.float32), b_u.to(tl.float32), b_g.dtype, ACT, EMU_G)
    tl.store(out + i_m * stride_o + o_n, round_to(b_o, out.dtype.element_ty, EMU_O), mask=m_n)


@triton.jit
def gated(b_x, b_u, DT: tl.constexpr, ACT: tl.constexpr, EMU: tl.constexpr):
    """act(g) * u in fp32 from g and u (fp32 tensors holding values of DT),
    with eager's rounding of act(g) to DT between (the caller rounds the product)."""
    if ACT == "silu":
        # The form of ATen's CUDA kernel.  x -> -inf: exp(-x) = inf, x / inf = -0.
        b_a = b_x / (1.0 + tl.exp(-b_x))
    elif ACT == "gelu":
        b_a = b_x * 0.5 * (1.0 + tl.math.erf(b_x * 0.7071067811865476))
    else:
        # x/2 * (1 + tanh(z)) = x * sigmoid(2z) = x / (1 + exp(-2z)).  No tanh
        # (libdevice's does not run under the interpreter), no overflow to NaN
        # (exp(-2z) = inf gives -0, = 0 gives x), and no cancellation in the
        # negative tail, where 1 + tanh(z) loses every bit below 6e-8.
        b_z = 0.7978845608028654 * (b_x + 0.044715 * b_x * b_x * b_x)
        b_a = b_x / (1.0 + tl.exp(-2.0 * b_z))
    # Eager's intermediate rounding to the input dtype (a no-op for fp32); to
    # nearest under the interpreter too (round_to: its bf16 conversion truncates).
    b_a = round_to(b_a, DT, EMU).to(tl.float32)
    return b_a * b_u


# ---------------------------------------------------------------- launch ----

_ACTIVATIONS = {"silu": "silu", "none": "gelu", "tanh": "gelu_tanh"}

# Elements per program when the grid is large enough to fill the GPU: 4096
# bf16 = 8 KiB per operand, 24 KiB of traffic per program.  Liger's one-row
# programs (11008 columns in a 16384-lane block, 16 warps, 32 elements per
# thread) reach 4265 GB/s on an H200 against a 4270 GB/s copy, Inductor 3057
# (DESIGN.md): we read that as bytes in flight per thread mattering more than
# idle masked lanes.  Chosen without a GPU at hand; `python -m
# fusepass.bench.registry.swiglu --sweep` times the (block, warps) grid.
_BN_MAX = 4096
# 16 elements per thread: two 16-byte vectors per operand in bf16, four in fp32.
_ELEMS_PER_THREAD = 16
# Programs wanted in flight before blocks shrink: two per SM (132 SMs on an
# H100 or H200).  M = 1, I = 14336 gets 56 programs of 256 columns instead of
# 7 of 2048; M = 32 gets 448 of 1024.
_PROGRAMS_PER_SM = 2


def _num_warps(bn: int) -> int:
    return max(1, min(8, bn // (32 * _ELEMS_PER_THREAD)))


def _launch_config(M: int, N: int, element_size: int, n_sm: int) -> int:
    """Columns per program for an [M, N] problem."""
    vec = 16 // element_size  # elements per 16-byte access
    # Of 4096 and 2048, the block that pads N less, 4096 on a tie: 14336 -> 2048
    # (7 blocks, none padded), 28672 -> 4096, 11008 -> 4096 (3 blocks, 10% padded).
    bn = _BN_MAX if cdiv(N, _BN_MAX) * 2 <= cdiv(N, _BN_MAX // 2) else _BN_MAX // 2
    # Small M: split the row into more programs so enough SMs issue loads,
    # down to one warp with one 16-byte vector per thread.
    while bn > 32 * vec and M * cdiv(N, bn) < _PROGRAMS_PER_SM * n_sm:
        bn //= 2
    # No wider than the row, rounded up to a power of two (tl.arange needs one).
    return min(bn, 1 << (N - 1).bit_length())


def _rows(t: Tensor) -> Tensor | None:
    """``t`` as an [M, I] view with unit column stride, or None if only a copy gives one."""
    return row_view(t, t.shape[-1] if t.dim() else 1)


def gated_act_launch(gate: Tensor, up: Tensor, out: Tensor, activation: str, block: int | None = None,
                     num_warps: int | None = None) -> Launch:
    """The launch writing ``out`` (rows with unit column stride) from checked
    inputs: the op's CUDA body runs it, a graph gets it traced.  The two halves
    of a fused projection stay views, read in place with their row strides;
    traced, the grid is symbolic in M (the heuristic sees its hint)."""
    o2 = _rows(out)
    M, N = o2.shape
    g2, u2 = rows(gate, N), rows(up, N)
    if block is None:
        block = _launch_config(hint(M), N, gate.element_size(), sm_count(gate.device))
    NB = cdiv(N, block)
    args = dict(gate=g2, up=u2, out=o2, N=N, NB=NB, stride_g=g2.stride(0), stride_u=u2.stride(0),
                stride_o=o2.stride(0), ACT=_ACTIVATIONS[activation], BN=block,
                EMU_G=emulate_rounding(gate.dtype), EMU_O=emulate_rounding(out.dtype), PDL=pdl_on(gate))
    return Launch(_gated_act_fwd_kernel, (M * NB,), args, ("out",), num_warps or _num_warps(block))


def gated_act_fwd(
    gate: Tensor,
    up: Tensor,
    activation: str,
    *,
    out: Tensor | None = None,
    block: int | None = None,
    num_warps: int | None = None,
) -> Tensor:
    """``act(gate) * up`` with the Triton kernel; ``activation`` is "silu", "none" or "tanh".

    ``out`` (optional) receives the result and is returned; it must have
    gate's shape and dtype and rows with unit column stride.  ``block`` and
    ``num_warps`` override the heuristic (tests, tuning sweeps).
    """
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(
            f"gate and up differ: {tuple(gate.shape)} {gate.dtype} {gate.device} "
            f"vs {tuple(up.shape)} {up.dtype} {up.device}"
        )
    if gate.dtype not in _KERNEL_DTYPES:
        raise TypeError(f"no kernel for {gate.dtype}")
    if out is None:
        out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    elif out.shape != gate.shape or out.dtype != gate.dtype or out.device != gate.device:
        raise ValueError(f"out is {tuple(out.shape)} {out.dtype} {out.device}, expected gate's")
    if out.numel() == 0:
        return out
    if _rows(out) is None:
        raise ValueError(f"out needs rows with unit column stride, has strides {out.stride()}")
    launch = gated_act_launch(gate, up, out, activation, block, num_warps)
    if launch.grid[0] >= 2**31:
        raise ValueError(f"{launch.grid[0]} programs exceed the grid")
    with on_device(gate):
        launch.run()
    return out


def swiglu_fwd(gate: Tensor, up: Tensor, **kwargs) -> Tensor:
    return gated_act_fwd(gate, up, "silu", **kwargs)


def geglu_fwd(gate: Tensor, up: Tensor, approximate: str, **kwargs) -> Tensor:
    return gated_act_fwd(gate, up, approximate, **kwargs)


# ------------------------------------------------------------------- ops ----


def swiglu_reference(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


def geglu_reference(gate: Tensor, up: Tensor, approximate: str) -> Tensor:
    return F.gelu(gate, approximate=approximate) * up


def _check(gate: Tensor, up: Tensor, approximate: str = "none", *, fake: bool = False) -> None:
    # Real tensors take the plain comparison first: three torch._check calls
    # cost ~9 µs per op call; fakes (symbolic shapes) always go through them.
    if fake or gate.dtype != up.dtype or gate.shape != up.shape or approximate not in ("none", "tanh"):
        torch._check(gate.dtype == up.dtype, lambda: f"gate is {gate.dtype}, up is {up.dtype}")
        torch._check(gate.shape == up.shape, lambda: f"gate is {tuple(gate.shape)}, up is {tuple(up.shape)}")
        torch._check(
            approximate in ("none", "tanh"), lambda: f"approximate must be 'none' or 'tanh', got {approximate!r}"
        )


@torch.library.custom_op("fusepass::swiglu", mutates_args=())
def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up, contiguous.  This body serves CPU and every non-CUDA device."""
    _check(gate, up)
    return swiglu_reference(gate, up).contiguous()


@swiglu.register_fake
def _swiglu_fake(gate: Tensor, up: Tensor) -> Tensor:
    _check(gate, up, fake=True)
    return gate.new_empty(gate.shape)


@swiglu.register_kernel("cuda")
def _swiglu_cuda(gate: Tensor, up: Tensor) -> Tensor:
    _check(gate, up)
    if gate.dtype not in _KERNEL_DTYPES:
        return swiglu_reference(gate, up).contiguous()
    return run_kernel(
        "swiglu",
        lambda: swiglu_fwd(gate, up),
        lambda: swiglu_reference(gate, up).contiguous(),
    )


@torch.library.custom_op("fusepass::geglu", mutates_args=())
def geglu(gate: Tensor, up: Tensor, approximate: str) -> Tensor:
    """gelu(gate, approximate) * up, contiguous.  This body serves CPU and every non-CUDA device."""
    _check(gate, up, approximate)
    return geglu_reference(gate, up, approximate).contiguous()


@geglu.register_fake
def _geglu_fake(gate: Tensor, up: Tensor, approximate: str) -> Tensor:
    _check(gate, up, approximate, fake=True)
    return gate.new_empty(gate.shape)


@geglu.register_kernel("cuda")
def _geglu_cuda(gate: Tensor, up: Tensor, approximate: str) -> Tensor:
    _check(gate, up, approximate)
    if gate.dtype not in _KERNEL_DTYPES:
        return geglu_reference(gate, up, approximate).contiguous()
    return run_kernel(
        "geglu",
        lambda: geglu_fwd(gate, up, approximate),
        lambda: geglu_reference(gate, up, approximate).contiguous(),
    )


# ------------------------------------------------------- calls in graphs ----


def _traced(gate: Tensor, up: Tensor, activation: str) -> Tensor:
    """The kernel as a node of the graph (:meth:`Launch.traced`)."""
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    return gated_act_launch(gate, up, out, activation).traced()["out"].view(gate.shape)


def _inline_ok(gate: Tensor, up: Tensor) -> bool:
    return (inline_enabled(gate) and gate.shape == up.shape and gate.dtype == up.dtype and gate.dtype in _KERNEL_DTYPES
            and all(isinstance(s, int) for s in (*gate.stride(), *up.stride())))


register_inline(torch.ops.fusepass.swiglu.default, _inline_ok, lambda gate, up: _traced(gate, up, "silu"))
register_inline(torch.ops.fusepass.geglu.default, lambda gate, up, approximate: _inline_ok(gate, up), _traced)


def swiglu_call(gate: Tensor, up: Tensor) -> Tensor:
    """What the rules put in a graph: the kernel itself when the engine inlines
    kernels for a CUDA graph, else the ``fusepass::swiglu`` op."""
    return call(torch.ops.fusepass.swiglu.default, gate, up)


def geglu_call(gate: Tensor, up: Tensor, approximate: str) -> Tensor:
    """As :func:`swiglu_call`, for ``fusepass::geglu``."""
    return call(torch.ops.fusepass.geglu.default, gate, up, approximate)
