"""Launches: the chunked pipeline (three or four launches) and the recurrent kernel (one).

One builder per kernel returns a :class:`~fusepass.kernels._common.Launch`;
``gdn_chunk_fwd`` / ``gdn_recurrent_fwd`` run them (the ops' CUDA bodies),
``op.gdn_chunk_traced`` / ``op.gdn_recurrent_traced`` put the same launches
into a graph (:func:`~fusepass.kernels._common.trace_all`).  Pointers a
launch does not use are given ``g``: read by every launch, written by none.
"""

from __future__ import annotations

from typing import Callable

import torch
import triton.language as tl
from torch import Tensor

from fusepass.kernels._common import Launch, cdiv, emulate_rounding, on_device, pdl_on, run_all, sm_count
from fusepass.kernels.gdn.chunk_kernels import (_gdn_inverse_kernel, _gdn_output_kernel, _gdn_scan_kernel, _gdn_state_kernel,
                                                _gdn_wu_kernel)
from fusepass.kernels.gdn.recurrent_kernel import _gdn_recurrent_kernel
from fusepass.formats import KERNEL_DTYPES as _KERNEL_DTYPES
from fusepass.kernels.gdn.reference import CHUNK, L2NORM_EPS
from fusepass.match import hint


_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
# Widest key head held in registers: the state pass keeps up to four [64, BV]
# fp32 state blocks, the w/u and scan kernels [64, BK] tiles of k (and q, w);
# 256 covers every GDN model.  d_k a power of two only: at d_k 96 (tiles
# padded to 128) compute-sanitizer reported a dot reading shared memory out
# of bounds (H100, Triton 3.6); the op takes its plain-torch path there.
_MAX_DK = 256
# Dot tiles at least 64 wide (value columns per program of the scan, output
# and w/u kernels; the key head, padded and masked below that).  With 32 or 16
# value columns Triton 3.6's Hopper dots read shared memory out of bounds
# (compute-sanitizer: "Invalid __shared__ read of size 1024 bytes"): the fused
# scan at one pipeline stage from T 1024 (an illegal address; H200, B1 H32 d
# 128; wrong values at T 256), the earlier state pass (one [64, d_k] x [d_k,
# 32] product a step) at d_k 64 with d_v 192 or 128 (a launch failure; values
# 1.5 off), and d_k 96 padded to 128 (H100).
_MIN_TILE = 64
# The state pass alone may split d_v 32 columns a program: its products take
# the key head 64 rows at a time, and compute-sanitizer found nothing at 32
# columns (H200: T 17, 63, 256, 300, 1030, B1 T8192 H32; d_k 64 and 128; d_v
# 128 and 192, the shapes that faulted with the earlier state pass).
_STATE_MIN_BV = 32
# Programs (at 64 value columns) per SM from which the fused scan is the
# default.  H200, bf16, CUDA-graph time of the pipeline, fused against split:
# B8 T512 H32 (512 programs) 257 against 272 µs, B16 T1024 H32 (1024) 925
# against 980, B4 T4096 Hk16 Hv32 (256) 886 against 923; B2 T3000 H32 (128)
# 468 against 370.
_FUSE_MIN_WAVES = 1.5
# Tokens the chunked op hands to the recurrent kernel instead (decode, short
# speculative runs): one launch, no scratch.
RECURRENT_MAX_T = 16


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (n - 1).bit_length())


def kernel_supported(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None) -> bool:
    """Whether the Triton kernels serve these inputs (else the plain-torch reference does)."""
    return (q.dtype in _KERNEL_DTYPES and k.dtype == q.dtype and v.dtype == q.dtype
            and g.dtype in _KERNEL_DTYPES and beta.dtype in _KERNEL_DTYPES
            and (initial_state is None or initial_state.dtype in _KERNEL_DTYPES)
            and q.shape[-1] <= _MAX_DK and _pow2(q.shape[-1], 1) == q.shape[-1])


def _unit_last(t: Tensor) -> Tensor:
    """Any [B, T, H, D] view with unit stride along D is read in place (slices of
    a fused projection included); anything else is copied once."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _outputs(q: Tensor, v: Tensor, out: Tensor | None, final_state: Tensor | None) -> tuple[Tensor, Tensor]:
    B, T, _, DK = q.shape
    HV, DV = v.shape[-2:]
    if out is None:
        out = torch.empty((B, T, HV, DV), dtype=q.dtype, device=q.device)
    if final_state is None:
        final_state = torch.empty((B, HV, DK, DV), dtype=torch.float32, device=q.device)
    return out, final_state


def _empty(initial_state: Tensor | None, out: Tensor, final_state: Tensor) -> tuple[Tensor, Tensor]:
    """No tokens (or no batch): the state passes through."""
    if initial_state is None:
        final_state.zero_()
    else:
        final_state.copy_(initial_state)
    return out, final_state


def _strides(name: str, t: Tensor) -> dict[str, int]:
    """A [B, T, H, ...] operand's batch, token and head strides, as the kernels name them."""
    return {f"s_{name}b": t.stride(0), f"s_{name}t": t.stride(1), f"s_{name}h": t.stride(2)}


def _dots(dt: torch.dtype) -> dict:
    """The dots' operand dtype and precision: bf16/fp16 operands with fp32
    accumulation for half-precision inputs, ieee fp32 for fp32."""
    DT, PREC = _TL_DTYPES[dt], ("ieee" if dt == torch.float32 else "tf32")
    return dict(DT=DT, PREC=PREC, EMU=emulate_rounding(dt))


def chunk_launches(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, h0: Tensor | None, out: Tensor,
                   final_state: Tensor, use_qk_l2norm: bool, scale: float, *, fuse_output: bool | None = None,
                   block_v: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                   output_block_v: int | None = None, inverse_fp32: bool = False,
                   inverse_warps: int | None = None, wu_warps: int | None = None,
                   inverse_precision: str | None = None, scan_row_factors: bool = True,
                   output_row_factors: bool = True) -> list[Launch]:
    """The chunked pipeline's launches, in order (the inverse, w and u, then
    the fused scan or the state pass and the output kernel), with their
    scratch allocated here; q, k, v with unit last stride, h0 contiguous, B,
    T, H_v > 0.  The keywords override the launch choices (tests, sweeps)."""
    B, T, HK, DK = q.shape
    HV, DV = v.shape[-2:]
    dt = q.dtype
    dots = _dots(dt)
    BK = _pow2(DK, _MIN_TILE)
    NT = cdiv(T, CHUNK)
    n_sm = sm_count(q.device)
    programs = hint(B) * HV * cdiv(DV, _MIN_TILE)  # at 64 value columns a program
    if fuse_output is None:
        # The fused scan writes o alone where the split pass writes and the
        # output kernel reads every chunk's state and new values, but its
        # loop is longer: it wins where programs queue for the SMs and loses
        # where each has an SM of its own.
        fuse_output = programs >= _FUSE_MIN_WAVES * n_sm
    least_bv = _MIN_TILE if fuse_output else _STATE_MIN_BV
    for name, cols, least in (("block_v", block_v, least_bv), ("output_block_v", output_block_v, _MIN_TILE)):
        if cols is not None and cols < least:
            raise ValueError(f"{name} {cols}: tiles of fewer than {least} value columns read shared memory "
                             "out of bounds on Hopper")
    if block_v is None:
        # The state pass at 32 columns where 64 would leave half the SMs idle:
        # B1 T16384 H32 (64 programs at 64) 377 against 457 µs; from B2 H32
        # (128) on, 64 wins (275 against 326), fewer programs reading k and w.
        block_v = _STATE_MIN_BV if programs <= n_sm // 2 and not fuse_output else _MIN_TILE
    BV = _pow2(min(block_v, DV), least_bv)
    NV = cdiv(DV, BV)
    # The inverse T rounded to q's dtype and w = T x, u = T y as half-precision
    # products: w/u 158 against 364 µs with T in fp32 and tf32 products (B1
    # T16384 H32, H200); relative error against the fp64 form 4.07e-3, and
    # 4.08e-3 with T in fp32 in the earlier one-kernel prep (B1-16, T
    # 512-16384, H200; FLA 4.40e-3).  fp32 inputs: fp32 and ieee throughout.
    tdt = torch.float32 if inverse_fp32 or dt == torch.float32 else dt
    tdots = dict(TDT=_TL_DTYPES[tdt], TPREC="ieee" if dt == torch.float32 else "tf32", TEMU=emulate_rounding(tdt))
    mprec = inverse_precision or ("ieee" if tdt == torch.float32 else "tf32")
    w = torch.empty((B, HV, T, DK), dtype=dt, device=q.device)
    u = torch.empty((B, HV, T, DV), dtype=dt, device=q.device)
    ti = torch.empty((B, HV, T, CHUNK), dtype=tdt, device=q.device)
    aq = torch.empty((B, HV, NT, CHUNK, CHUNK), dtype=dt, device=q.device) if fuse_output else g
    f = torch.empty((B, HV, T), dtype=torch.float32, device=q.device)
    dl = torch.empty((B, HV, NT), dtype=torch.float32, device=q.device)
    # Row factors: the norms and decays multiply the products' rows (q and k
    # go into the dots as stored) rather than q and k before them: fewer
    # registers (no spill in the scan; the output kernel 128 against 215 at
    # d 128) and as accurate.  Scan 322 against 409 µs at B4 T4096 Hk16 Hv32,
    # 680 against 838 at B2 T8192 H64; output kernel 229 against 243 and 498
    # against 516 (H200, contiguous normalised inputs, 5e215f8).
    rowf = fuse_output and scan_row_factors
    fq = torch.empty((B, HV, T), dtype=torch.float32, device=q.device) if rowf else g
    h_in = g if h0 is None else h0
    sizes = dict(T=T, NT=NT, HV=HV, GROUP=HV // HK, DK=DK, L2NORM=use_qk_l2norm, EPS=L2NORM_EPS)
    # One warp: the 16x16 blocks are an MMA tile each, the substitution's row
    # sums shuffles.  126 µs against 201 at two warps and 434 at four (B1
    # T16384 H32, H200).
    inverse = Launch(_gdn_inverse_kernel, (NT * B * HV,),
                     dict(k=k, g=g, beta=beta, ti=ti, **_strides("k", k), **_strides("g", g), **_strides("b", beta),
                          **sizes, BK=_MIN_TILE, **dots, TDT=tdots["TDT"], TEMU=tdots["TEMU"], MPREC=mprec),
                     ("ti",), inverse_warps or 1)
    wu = Launch(_gdn_wu_kernel, (NT * B * HV,),
                dict(q=q, k=k, v=v, g=g, beta=beta, ti=ti, w=w, u=u, aq=aq, f=f, dl=dl, fq=fq, scale=scale,
                     **_strides("q", q), **_strides("k", k), **_strides("v", v), **_strides("g", g),
                     **_strides("b", beta), **sizes, DV=DV, BK=BK, BV=_MIN_TILE, **dots, **tdots, AQK=fuse_output,
                     ROWF=rowf),
                ("w", "u", "f", "dl") + (("aq",) if fuse_output else ()) + (("fq",) if rowf else ()), wu_warps or 4)
    qkg = {**_strides("q", q), **_strides("k", k), **_strides("g", g)}
    if fuse_output:
        # One pipeline stage: 1101 µs at B16 T1024 H32 against 1141 with
        # two and 1409 with three; 8 warps 1411 (H100, CUDA-graph time).
        scan = Launch(_gdn_scan_kernel, (NV * B * HV,),
                      dict(q=q, k=k, w=w, u=u, aq=aq, g=g, fq=fq, f=f, dl=dl, h0=h_in, o=out, hT=final_state,
                           NV=NV, scale=scale, **qkg, **sizes, DV=DV, BK=BK, BV=BV, HAS_H0=h0 is not None, **dots,
                           ROWF=rowf),
                      ("o", "hT"), num_warps or 4, num_stages or 1)
        return [inverse, wu, scan, _rising_heads(q, k, v, g, beta, h0, out, final_state, use_qk_l2norm, scale)]
    # 4 warps, 3 pipeline stages: at B1 T16384 H32 (H200) 379 µs at 32
    # columns against 531 with two stages, 377 with four, 462 at 2 warps;
    # at 64 columns 461 against 613 with two.
    hs = torch.empty((B, HV, NT, DK, DV), dtype=dt, device=q.device)
    state = Launch(_gdn_state_kernel, (NV * B * HV,),
                   dict(k=k, w=w, u=u, f=f, dl=dl, h0=h_in, hT=final_state, hs=hs, NV=NV, **_strides("k", k),
                        **{n: sizes[n] for n in ("T", "NT", "HV", "GROUP", "DK")}, DV=DV, BV=BV,
                        HAS_H0=h0 is not None, **dots),
                   ("u", "hT", "hs"), num_warps or 4, num_stages or 3)
    # 128 columns: 274 against 298 µs at B1 T16384 H32, 249 against 278 at B4
    # T4096 Hk16 Hv32, the same at B8 T512 (H200).
    BVO = _pow2(min(output_block_v or 128, DV), _MIN_TILE)
    NVO = cdiv(DV, BVO)
    output = Launch(_gdn_output_kernel, (NVO * NT * B * HV,),
                    dict(q=q, k=k, g=g, vn=u, hs=hs, o=out, NV=NVO, scale=scale, **qkg, **sizes, DV=DV, BK=BK,
                         BV=BVO, **dots, ROWF=output_row_factors),
                    ("o",), 4)
    return [inverse, wu, state, output, _rising_heads(q, k, v, g, beta, h0, out, final_state, use_qk_l2norm, scale)]


def _rising_heads(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, h0: Tensor | None, out: Tensor,
                  final_state: Tensor, use_qk_l2norm: bool, scale: float) -> Launch:
    """The token loop over again for each head with some g > 0, last of the
    chunked launches: its programs read their head's gates and return where
    all are <= 0, as models' decays are (-exp(A) softplus(..)).

    The chunked form needs g <= 0 (see chunk_kernels): with a rising Gamma,
    exp(Gamma_i - Gamma_j) > 1 makes I + A ill conditioned, and the 10 bits
    of fp16 or tf32 (8 of bf16) in the scratch and dot operands are not
    enough.  A head of a differential program, g in [-2.4, 2.3] (fp16, d 8,
    T 48, Gamma rising 7.8 within the chunk): (I + A)^-1 entries up to 7.4e4,
    u up to 5.4e4 for outputs up to 2.3e4, output 46 off the fp64 result
    (316 times the fp16 table; bf16 inputs 788 times), exp(Gamma_last -
    Gamma) k up to 1.5e5, an infinite fp16 operand and final state.  Scratch
    and operands rounded to 10 bits with fp32's range measured 132-252 times
    the table (fp64 emulation): fp32 scratch alone would not do.  The token
    loop keeps every product in fp32: 0.22 times the table, as the CPU body.
    On gates <= 0 this costs one launch whose programs read T gates each."""
    return recurrent_launch(q, k, v, g, beta, h0, out, final_state, use_qk_l2norm, scale, block_v=64,
                            rising_only=True)


def gdn_chunk_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
                  use_qk_l2norm: bool, scale: float, *, out: Tensor | None = None,
                  final_state: Tensor | None = None, **choices) -> tuple[Tensor, Tensor]:
    """The chunked pipeline: the inverse and w/u kernels, then the fused scan
    or the state pass and the output kernel (by default the scan where its
    grid fills the GPU one and a half times over), then the token loop for
    heads with some g > 0.

    ``out`` / ``final_state`` receive the results when given (tests poison
    them); ``choices`` are :func:`chunk_launches`' overrides (tests, sweeps)."""
    return _forward(q, k, v, initial_state, out, final_state,
                    lambda q, k, v, h0, o, hT: chunk_launches(q, k, v, g, beta, h0, o, hT, use_qk_l2norm, scale,
                                                             **choices))


def _forward(q: Tensor, k: Tensor, v: Tensor, initial_state: Tensor | None, out: Tensor | None,
             final_state: Tensor | None, launches: Callable[..., list[Launch]]) -> tuple[Tensor, Tensor]:
    """Both pipelines' run: the outputs made (or checked), an empty problem answered without a launch,
    then ``launches(q, k, v, h0, out, final_state)`` run on q's device with unit-stride heads."""
    B, T = q.shape[:2]
    HV = v.shape[-2]
    out, final_state = _outputs(q, v, out, final_state)
    if B == 0 or T == 0 or HV == 0:
        return _empty(initial_state, out, final_state)
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    h0 = None if initial_state is None else initial_state.contiguous()
    with on_device(q):
        run_all(launches(q, k, v, h0, out, final_state))
    return out, final_state


def _recurrent_block_v(B: int, HV: int, DV: int, n_sm: int) -> int:
    # Up to 64 columns (a [128, 64] fp32 slice: 64 registers per thread at 4
    # warps), narrower until there are 4 programs per SM: B64 H32 keeps 64
    # (4096 programs), B1 H32 goes to 16 (256).  H100, CUDA-graph time, 4
    # warps: B64 H32 94.9 µs at 64 columns, 96.4 at 32 and at 128 (the fp32
    # state read + written at copy bandwidth: 90.6); B1 H32 3.3 µs at 16,
    # 3.4 at 32, 3.9 at 64.  8 warps was slower everywhere.
    bv = min(64, _pow2(DV))
    while bv > 16 and B * HV * cdiv(DV, bv) < 4 * n_sm:
        bv //= 2
    return bv


def recurrent_launch(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, h0: Tensor | None, out: Tensor,
                     final_state: Tensor, use_qk_l2norm: bool, scale: float, block_v: int | None = None,
                     num_warps: int | None = None, rising_only: bool = False) -> Launch:
    """The token loop in one launch; operands as for :func:`chunk_launches`.
    ``rising_only``: for the heads with some g > 0 alone (:func:`_rising_heads`)."""
    B, T, HK, DK = q.shape
    HV, DV = v.shape[-2:]
    BV = min(block_v or _recurrent_block_v(hint(B), HV, DV, sm_count(q.device)), _pow2(DV))
    NV = cdiv(DV, BV)
    args = dict(q=q, k=k, v=v, g=g, beta=beta, h0=g if h0 is None else h0, o=out, hT=final_state,
                T=T, HV=HV, GROUP=HV // HK, NV=NV, scale=scale, **_strides("q", q), **_strides("k", k),
                **_strides("v", v), **_strides("g", g), **_strides("b", beta),
                DK=DK, DV=DV, BK=_pow2(DK), BV=BV, L2NORM=use_qk_l2norm, HAS_H0=h0 is not None,
                EMU=emulate_rounding(q.dtype), EPS=L2NORM_EPS, RISING_ONLY=rising_only, PDL=pdl_on(q))
    return Launch(_gdn_recurrent_kernel, (NV * B * HV,), args, ("o", "hT"), num_warps or 4)


def gdn_recurrent_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
                      use_qk_l2norm: bool, scale: float, *, out: Tensor | None = None,
                      final_state: Tensor | None = None, block_v: int | None = None,
                      num_warps: int | None = None) -> tuple[Tensor, Tensor]:
    """The token loop in one launch; arguments as :func:`gdn_chunk_fwd`."""
    return _forward(q, k, v, initial_state, out, final_state,
                    lambda q, k, v, h0, o, hT: [recurrent_launch(q, k, v, g, beta, h0, o, hT, use_qk_l2norm, scale,
                                                                 block_v, num_warps)])
