"""Launchers: the chunked pipeline (three launches) and the recurrent kernel (one)."""

from __future__ import annotations

import torch
import triton.language as tl
from torch import Tensor

from fusepass.kernels._common import cdiv, interpreting, on_device, sm_count
from fusepass.kernels.gdn.chunk_kernels import _gdn_output_kernel, _gdn_prep_kernel, _gdn_state_kernel
from fusepass.kernels.gdn.recurrent_kernel import _gdn_recurrent_kernel
from fusepass.kernels.gdn.reference import CHUNK, L2NORM_EPS


_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
# Widest key head held in registers: the state pass keeps a [BK, BV] fp32
# state slice and [64, BK] tiles of w, k (and q); 256 covers every GDN model.
_MAX_DK = 256
# d_v columns per state-pass program: 64 where that still gives one program
# per SM, else 32.  The pass is sequential over chunks and parallel only over
# B x H_v x d_v blocks.  H100, CUDA-graph time of the whole op (Triton 3.6):
# B1 T4096 H16 (64 vs 32 programs) 371 µs at 64, 345 at 32; B4 T4096 Hv32
# 1704 at 64, 1823 at 32; B8 T512 H32 465 at 64, 491 at 32.
_STATE_BV = (64, 32)
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
            and q.shape[-1] <= _MAX_DK)


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


def gdn_chunk_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
                  use_qk_l2norm: bool, scale: float, *, out: Tensor | None = None,
                  final_state: Tensor | None = None, fuse_output: bool | None = None,
                  block_v: int | None = None, num_warps: int | None = None,
                  num_stages: int | None = None, output_tf32: bool | None = None,
                  precompute_kd: bool | None = None) -> tuple[Tensor, Tensor]:
    """The chunked pipeline: prep kernel, state pass, (output kernel).

    ``out`` / ``final_state`` receive the results when given (tests poison
    them); the keywords after them override the launch choices (tests, sweeps)."""
    B, T, HK, DK = q.shape
    HV, DV = v.shape[-2:]
    out, final_state = _outputs(q, v, out, final_state)
    if B == 0 or T == 0 or HV == 0:
        return _empty(initial_state, out, final_state)
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    h0 = None if initial_state is None else initial_state.contiguous()
    dt = q.dtype
    DT, PREC = _TL_DTYPES[dt], ("ieee" if dt == torch.float32 else "tf32")
    emu = dt == torch.bfloat16 and interpreting()
    # The output's dots in bf16/fp16 (default) or on fp32 operands in tf32
    # (output_tf32).  H100, real sizes, bf16, relative error norm against the
    # fp64 recurrence: 4.1e-3 in bf16 against 3.2e-3 in tf32 (FLA 0.6: 4.4e-3);
    # the tf32 dots cost 345 against 289 µs at B1 T4096 H16, 2153 against 1593
    # at B1 T16384 H32 (CUDA-graph time).
    out_dots = dict(ODT=DT, OPREC=PREC, OEMU=emu)
    if output_tf32:
        out_dots = dict(ODT=tl.float32, OPREC="tf32", OEMU=False)
    BK = _pow2(DK)
    NT = cdiv(T, CHUNK)
    n_sm = sm_count(q.device)
    w = torch.empty((B, HV, T, DK), dtype=dt, device=q.device)
    u = torch.empty((B, HV, T, DV), dtype=dt, device=q.device)
    if block_v is None:
        block_v = _STATE_BV[-1]
        for bv in _STATE_BV:
            if B * HV * cdiv(DV, bv) >= n_sm:
                block_v = bv
                break
    BV = min(block_v, _pow2(DV))
    NV = cdiv(DV, BV)
    if fuse_output is None:
        # The output in the state pass (one launch and the per-chunk states
        # fewer) lengthens the sequential loop: it lost at every shape of
        # issue 8 on an H100, 428 vs 289 µs at B1 T4096 H16, 368 vs 354 at
        # B8 T512 H32, 1947 vs 1593 at B1 T16384 H32 (CUDA-graph time).
        fuse_output = False
    if precompute_kd is None:
        # exp(Gamma_last - Gamma) k~ formed in the prep kernel and read by the
        # state pass, rather than normalised and decayed inside its loop:
        # 259 vs 278 µs at B1 T4096 H16, 1562 vs 1580 at B1 T16384 H32, 342
        # vs 333 at B8 T512 H32 (H100, CUDA-graph time).
        precompute_kd = not fuse_output
    kd = torch.empty_like(w) if precompute_kd else w
    hs = final_state if fuse_output else torch.empty((B, HV, NT, DK, DV), dtype=dt, device=q.device)
    strides = (*q.stride()[:3], *k.stride()[:3], *g.stride())
    with on_device(q):
        _gdn_prep_kernel[(NT * B * HV,)](
            k, v, g, beta, w, u, kd, T, NT, HV, HV // HK,
            *k.stride()[:3], *v.stride()[:3], *g.stride(), *beta.stride(),
            DK=DK, DV=DV, BK=BK, BV=min(64, _pow2(DV)), L2NORM=use_qk_l2norm, DT=DT, PREC=PREC, EMU=emu,
            PRE_KD=precompute_kd, EPS=L2NORM_EPS, num_warps=4,
        )
        # 4 warps, 2 pipeline stages (H100, CUDA-graph time): 8 warps lost at
        # every shape (B1 T4096 H16 361 vs 345 µs, B8 T512 H32 510 vs 465 with
        # tf32 output dots); 3 stages 260 vs 259 at B1 T4096 H16, 368 vs 342 at
        # B8 T512 H32.
        _gdn_state_kernel[(NV * B * HV,)](
            q, k, w, u, kd, g, final_state if h0 is None else h0, out, final_state, hs,
            T, NT, HV, HV // HK, NV, scale, *strides,
            DK=DK, DV=DV, BK=BK, BV=BV, L2NORM=use_qk_l2norm, HAS_H0=h0 is not None, FUSE_OUT=fuse_output,
            PRE_KD=precompute_kd, DT=DT, PREC=PREC, EMU=emu, **out_dots, EPS=L2NORM_EPS,
            num_warps=num_warps or 4, num_stages=num_stages or 2,
        )
        if not fuse_output:
            BVO = min(64, _pow2(DV))
            NVO = cdiv(DV, BVO)
            _gdn_output_kernel[(NVO * NT * B * HV,)](
                q, k, g, u, hs, out, T, NT, HV, HV // HK, NVO, scale, *strides,
                DK=DK, DV=DV, BK=BK, BV=BVO, L2NORM=use_qk_l2norm, DT=DT, PREC=PREC, EMU=emu, **out_dots,
                EPS=L2NORM_EPS, num_warps=4,
            )
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


def gdn_recurrent_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
                      use_qk_l2norm: bool, scale: float, *, out: Tensor | None = None,
                      final_state: Tensor | None = None, block_v: int | None = None,
                      num_warps: int | None = None) -> tuple[Tensor, Tensor]:
    """The token loop in one launch; arguments as :func:`gdn_chunk_fwd`."""
    B, T, HK, DK = q.shape
    HV, DV = v.shape[-2:]
    out, final_state = _outputs(q, v, out, final_state)
    if B == 0 or T == 0 or HV == 0:
        return _empty(initial_state, out, final_state)
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    h0 = None if initial_state is None else initial_state.contiguous()
    BV = min(block_v or _recurrent_block_v(B, HV, DV, sm_count(q.device)), _pow2(DV))
    NV = cdiv(DV, BV)
    with on_device(q):
        _gdn_recurrent_kernel[(NV * B * HV,)](
            q, k, v, g, beta, final_state if h0 is None else h0, out, final_state,
            T, HV, HV // HK, NV, scale,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *g.stride(), *beta.stride(),
            DK=DK, DV=DV, BK=_pow2(DK), BV=BV, L2NORM=use_qk_l2norm, HAS_H0=h0 is not None,
            EMU=q.dtype == torch.bfloat16 and interpreting(), EPS=L2NORM_EPS,
            num_warps=num_warps or 4,
        )
    return out, final_state
