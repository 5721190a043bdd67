"""The experts' prefill paths: (token, choice) slots sorted by expert, then
grouped GEMMs on tensor cores.

``_moe_align_kernel`` (one launch, one program per expert, no host
synchronisation): each program counts every expert's slots (a histogram over
the T * k ids), pads each count up to a multiple of BM, and from the padded
counts of the experts before its own knows where its rows start; it then
writes its slots there in slot order (stable), -1 in its padding rows, its
expert id for its blocks of BM rows, and each slot's row (pos_of_slot).
The buffers have a size fixed by T, k, E and BM -- at most T * k + min(E,
T * k) * (BM - 1) rows -- so the grid of the GEMMs after it is static;
blocks past the used rows carry expert -1 and return at once.  Slots whose
id lies outside [0, E) get no row.

Then, plan "sorted":
  ``_moe_sorted_up_kernel``   a program per (block of BM rows, BN intermediate
      columns): the rows' tokens of x gathered, times the block's expert's gate
      and up columns (tl.dot), the activation -> h [rows, I] in x's dtype;
  ``_moe_sorted_down_kernel`` a program per (block, BN output columns): h
      times the expert's down rows (tl.dot), rounded, biased, times the
      routing weight -> y [T * k, H], each slot's row;
  ``_moe_sum_kernel``         out[t] = sum over t's k slots of y, in fp32,
      rounded once.
Row blocks are the fastest grid axis: the blocks of one expert read the same
weight columns one after another, from L2 after the first.

Plan "grouped_mm" (bf16 on sm90, where cuBLAS's grouped GEMM measures
faster): the same alignment with BM = 1 gives ``torch._grouped_mm`` its
sorted rows and offsets; ``_moe_act_kernel`` applies bias and activation
between the two GEMMs and ``_moe_sum_kernel`` the down bias, the routing
weight and the sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from fusepass.kernels._common import Launch, cdiv, interpreting
from fusepass.kernels.moe import _tiles
from fusepass.kernels.moe._tiles import (
    _round,
    _to,
    _round_if,
    cdiv_pow2,
    _dot,
    gated_act,
    proj_epilogue,
    row_scale,
    split_pairs,
    w_tile,
)
from fusepass.kernels.moe.decode import _strides, round_w


@triton.jit
def _moe_align_kernel(ids, sorted_slots, pos_of_slot, block_expert, expert_end,
                      S, E, P_MAX, NBLK_MAX,
                      BM: tl.constexpr, NBINS: tl.constexpr, CH: tl.constexpr, BMP: tl.constexpr):
    e = tl.program_id(0)
    # Every expert's count; ids outside [0, E) (and lanes past S) in bin E.
    counts = tl.zeros([NBINS], dtype=tl.int32)
    for c0 in range(0, S, CH):
        o = c0 + tl.arange(0, CH)
        v = tl.load(ids + o, mask=o < S, other=-1).to(tl.int32)
        counts += tl.histogram(tl.where((v >= 0) & (v < E), v, E), NBINS)
    o_b = tl.arange(0, NBINS)
    padded = tl.where(o_b < E, (counts + BM - 1) // BM * BM, 0)
    start = tl.sum(tl.where(o_b < e, padded, 0), axis=0)
    my_pad = tl.sum(tl.where(o_b == e, padded, 0), axis=0)
    my_cnt = tl.sum(tl.where(o_b == e, counts, 0), axis=0)
    total = tl.sum(padded, axis=0)
    # This expert's slots, in slot order.
    run = start
    for c0 in range(0, S, CH):
        o = c0 + tl.arange(0, CH)
        m = o < S
        v = tl.load(ids + o, mask=m, other=-1).to(tl.int32)
        match = (v == e) & m
        p = run + tl.cumsum(match.to(tl.int32), axis=0) - 1
        tl.store(sorted_slots + p, o, mask=match)
        tl.store(pos_of_slot + o, p, mask=match)
        if e == 0:
            tl.store(pos_of_slot + o, tl.full([CH], -1, tl.int32), mask=m & ((v < 0) | (v >= E)))
        run += tl.sum(match.to(tl.int32), axis=0)
    o_p = tl.arange(0, BMP)
    tl.store(sorted_slots + start + my_cnt + o_p, tl.full([BMP], -1, tl.int32), mask=o_p < my_pad - my_cnt)
    for b0 in range(start // BM, (start + my_pad) // BM, CH):
        o = b0 + tl.arange(0, CH)
        tl.store(block_expert + o, tl.full([CH], 0, tl.int32) + e, mask=o < (start + my_pad) // BM)
    tl.store(expert_end + e, start + my_pad)
    if e == E - 1:  # the rows and blocks past the used ones
        for p0 in range(total, P_MAX, CH):
            o = p0 + tl.arange(0, CH)
            tl.store(sorted_slots + o, tl.full([CH], -1, tl.int32), mask=o < P_MAX)
        for b0 in range(total // BM, NBLK_MAX, CH):
            o = b0 + tl.arange(0, CH)
            tl.store(block_expert + o, tl.full([CH], -1, tl.int32), mask=o < NBLK_MAX)


@triton.jit
def _k_major(b_w, TRANS: tl.constexpr):
    """A weight tile as the dot's [BK, BN] operand (w_tile gives [BN, BK], or [BK, BN] with TRANS)."""
    if TRANS:
        return b_w
    else:
        return tl.trans(b_w)


@triton.jit
def _moe_sorted_up_kernel(
    x, sorted_slots, block_expert, w, bias, scale, zero, h,
    K, I, TOPK,
    stride_xm, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_be, stride_hm,
    ACT: tl.constexpr, HALVES: tl.constexpr, FMT: tl.constexpr, G: tl.constexpr,
    HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr, F32: tl.constexpr,
    TRANS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    DT: tl.constexpr = x.dtype.element_ty
    i_b, i_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(block_expert + i_b)
    if e >= 0:
        o_m = i_b * BM + tl.arange(0, BM)
        b_slot = tl.load(sorted_slots + o_m)
        m_m = b_slot >= 0
        p_x = x + (tl.where(m_m, b_slot, 0) // TOPK).to(tl.int64)[:, None] * stride_xm
        e64 = e.to(tl.int64)
        p_w = w + e64 * stride_we
        p_s = scale + e64 * stride_se
        p_z = zero + e64 * stride_se
        p_b = bias + e64 * stride_be
        # Gate and up rows: two blocks of BN (halves, two dots), or 2 BN
        # adjacent rows (interleaved: one dot, split in the epilogue).
        if HALVES:
            o_g = i_n * BN + tl.arange(0, BN)
            m_g = o_g < I
            o_u = o_g + I
        else:
            o_g = 2 * i_n * BN + tl.arange(0, 2 * BN)
            m_g = o_g < 2 * I
            o_u = o_g
        acc_g = tl.zeros([BM, o_g.shape[0]], dtype=tl.float32)
        acc_u = tl.zeros([BM, BN if HALVES else 16], dtype=tl.float32)
        for k0 in range(0, K, BK):
            o_k = k0 + tl.arange(0, BK)
            b_x = tl.load(p_x + o_k[None, :], mask=m_m[:, None] & (o_k < K)[None, :], other=0)  # [BM, BK]
            b_w = w_tile(p_w + o_g * stride_wn, m_g, p_s + o_g * stride_sn, p_z + o_g * stride_sn, k0, K, stride_wk,
                         FMT, G, HAS_ZERO, BK, TRANS)
            acc_g = _dot(b_x, _k_major(_to(b_w, DT), TRANS), acc_g, F32)
            if HALVES:
                b_w = w_tile(p_w + o_u * stride_wn, m_g, p_s + o_u * stride_sn, p_z + o_u * stride_sn, k0, K,
                             stride_wk, FMT, G, HAS_ZERO, BK, TRANS)
                acc_u = _dot(b_x, _k_major(_to(b_w, DT), TRANS), acc_u, F32)
        b_g = proj_epilogue(acc_g, row_scale(p_s + o_g * stride_sn, m_g, FMT)[None, :], p_b + o_g[None, :],
                            m_g[None, :], DT, HAS_BIAS)
        if HALVES:
            b_u = proj_epilogue(acc_u, row_scale(p_s + o_u * stride_sn, m_g, FMT)[None, :], p_b + o_u[None, :],
                                m_g[None, :], DT, HAS_BIAS)
        else:
            b_g, b_u = split_pairs(b_g)
        b_h = gated_act(b_g, b_u, DT, ACT, ALPHA, LIMIT)
        o_n = i_n * BN + tl.arange(0, BN)
        tl.store(h + o_m.to(tl.int64)[:, None] * stride_hm + o_n[None, :], _to(b_h, DT),
                 mask=m_m[:, None] & (o_n < I)[None, :])


@triton.jit
def _moe_sorted_down_kernel(
    h, sorted_slots, block_expert, tw, w, bias, scale, zero, y,
    K, N,
    stride_hm, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_be, stride_ym,
    ROUND_W: tl.constexpr, FMT: tl.constexpr, G: tl.constexpr, HAS_ZERO: tl.constexpr,
    HAS_BIAS: tl.constexpr, F32: tl.constexpr, TRANS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr,
):
    DT: tl.constexpr = h.dtype.element_ty
    i_b, i_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(block_expert + i_b)
    if e >= 0:
        o_m = i_b * BM + tl.arange(0, BM)
        b_slot = tl.load(sorted_slots + o_m)
        m_m = b_slot >= 0
        o_n = i_n * BN + tl.arange(0, BN)
        m_n = o_n < N
        e64 = e.to(tl.int64)
        p_w = w + e64 * stride_we + o_n * stride_wn
        p_s = scale + e64 * stride_se + o_n * stride_sn
        p_z = zero + e64 * stride_se + o_n * stride_sn
        p_h = h + o_m.to(tl.int64)[:, None] * stride_hm
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            o_k = k0 + tl.arange(0, BK)
            b_h = tl.load(p_h + o_k[None, :], mask=m_m[:, None] & (o_k < K)[None, :], other=0)  # [BM, BK]
            b_w = w_tile(p_w, m_n, p_s, p_z, k0, K, stride_wk, FMT, G, HAS_ZERO, BK, TRANS)
            acc = _dot(b_h, _k_major(_to(b_w, DT), TRANS), acc, F32)
        b_tw = tl.load(tw + b_slot, mask=m_m, other=0).to(tl.float32)
        b_d = proj_epilogue(acc, row_scale(p_s, m_n, FMT)[None, :], bias + e64 * stride_be + o_n[None, :],
                            m_n[None, :], DT, HAS_BIAS)
        b_y = _round_if(b_d * b_tw[:, None], DT, ROUND_W)
        tl.store(y + b_slot.to(tl.int64)[:, None] * stride_ym + o_n[None, :], b_y.to(y.dtype.element_ty),
                 mask=m_m[:, None] & m_n[None, :])


@triton.jit
def _moe_sum_kernel(y, ids, pos_of_slot, tw, bias, out, E, N, TOPK, stride_ym, stride_be, stride_om,
                    ROUND_W: tl.constexpr, EPILOGUE: tl.constexpr, HAS_BIAS: tl.constexpr,
                    KP: tl.constexpr, BN: tl.constexpr):
    # out[t] = sum over t's valid slots j of y's row.  EPILOGUE (the grouped_mm
    # plan): y's rows are the down GEMM's rounded output in sorted order, and
    # the bias, the routing weight and their roundings are applied here.
    DT: tl.constexpr = out.dtype.element_ty
    i_t, i_n = tl.program_id(0), tl.program_id(1)
    o_j = tl.arange(0, KP)
    o_s = i_t * TOPK + o_j
    m_j = o_j < TOPK
    b_e = tl.load(ids + o_s, mask=m_j, other=-1).to(tl.int32)
    v_j = m_j & (b_e >= 0) & (b_e < E)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < N
    m = v_j[:, None] & m_n[None, :]
    if EPILOGUE:
        b_row = tl.load(pos_of_slot + o_s, mask=v_j, other=0).to(tl.int64)
        b_d = tl.load(y + b_row[:, None] * stride_ym + o_n[None, :], mask=m, other=0).to(tl.float32)
        if HAS_BIAS:
            b_b = tl.load(bias + b_e.to(tl.int64)[:, None] * stride_be + o_n[None, :], mask=m, other=0)
            b_d = _round(b_d + b_b.to(tl.float32), DT)
        b_tw = tl.load(tw + o_s, mask=v_j, other=0).to(tl.float32)
        b_y = tl.where(m, _round_if(b_d * b_tw[:, None], DT, ROUND_W), 0.0)
    else:
        b_y = tl.load(y + o_s.to(tl.int64)[:, None] * stride_ym + o_n[None, :], mask=m, other=0).to(tl.float32)
    tl.store(out + i_t.to(tl.int64) * stride_om + o_n, _to(tl.sum(b_y, axis=0), DT), mask=m_n)


@triton.jit
def _moe_act_kernel(gu, sorted_slots, ids, bias, h, R, I, stride_gm, stride_be, stride_hm,
                    ACT: tl.constexpr, HALVES: tl.constexpr, HAS_BIAS: tl.constexpr,
                    ALPHA: tl.constexpr, LIMIT: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr):
    # h = act(gu (+ bias)) over rows of the gate_up GEMM's rounded output.
    DT: tl.constexpr = h.dtype.element_ty
    i_r, i_n = tl.program_id(0), tl.program_id(1)
    o_r = i_r * BR + tl.arange(0, BR)
    b_slot = tl.load(sorted_slots + o_r, mask=o_r < R, other=-1)
    m_r = b_slot >= 0
    p = gu + o_r.to(tl.int64)[:, None] * stride_gm
    if HAS_BIAS:
        b_e = tl.load(ids + tl.where(m_r, b_slot, 0), mask=m_r, other=0).to(tl.int64)
        p_b = bias + b_e[:, None] * stride_be
    else:
        p_b = bias + tl.zeros([BR, 1], dtype=tl.int64)
    if HALVES:
        o_g = i_n * BN + tl.arange(0, BN)
        m = m_r[:, None] & (o_g < I)[None, :]
        b_g = proj_epilogue(tl.load(p + o_g[None, :], mask=m, other=0).to(tl.float32), 1.0, p_b + o_g[None, :], m,
                            DT, HAS_BIAS)
        b_u = proj_epilogue(tl.load(p + I + o_g[None, :], mask=m, other=0).to(tl.float32), 1.0,
                            p_b + I + o_g[None, :], m, DT, HAS_BIAS)
    else:
        o_g = 2 * i_n * BN + tl.arange(0, 2 * BN)
        m = m_r[:, None] & (o_g < 2 * I)[None, :]
        b_g, b_u = split_pairs(proj_epilogue(tl.load(p + o_g[None, :], mask=m, other=0).to(tl.float32), 1.0,
                                             p_b + o_g[None, :], m, DT, HAS_BIAS))
    b_h = gated_act(b_g, b_u, DT, ACT, ALPHA, LIMIT)
    o_n = i_n * BN + tl.arange(0, BN)
    tl.store(h + o_r.to(tl.int64)[:, None] * stride_hm + o_n[None, :], _to(b_h, DT),
             mask=m_r[:, None] & (o_n < I)[None, :])


# ----------------------------------------------------------------- launch ----


@dataclass(frozen=True)
class SortedConfig:
    """Tiles of the sorted path: BM rows per block (the padding unit), gate_up
    (BN, BK), down (BN2, BK2)."""

    BM: int = 64
    BN: int = 64
    BK: int = 64
    warps: int = 4
    stages: int = 3
    BN2: int = 64
    BK2: int = 64
    warps2: int = 4
    stages2: int = 3


def sorted_heuristic(T: int, k: int, E: int, group: int) -> SortedConfig:
    """BM near the mean rows per expert (16 to 128): padding costs little and the
    tiles stay full.  Chosen without a GPU at hand; the benchmark's sweep times
    alternatives."""
    per_expert = T * k / E
    BM = 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64 if per_expert <= 160 else 128
    BK = 64
    warps = 8 if BM >= 128 else 4
    return SortedConfig(BM=BM, BN=64, BK=BK, warps=warps, stages=3, BN2=64, BK2=BK, warps2=warps, stages2=3)


@dataclass
class Alignment:
    sorted_slots: Tensor  # [P_MAX] int32: slot per row, -1 for padding
    pos_of_slot: Tensor  # [S] int32: row per slot, -1 for an id outside [0, E)
    block_expert: Tensor  # [NBLK_MAX] int32: expert per block of BM rows, -1 past the used ones
    expert_end: Tensor  # [E] int32: each expert's end row (padded), cumulative
    BM: int


def align(ids: Tensor, E: int, BM: int, go=_tiles.ran) -> Alignment:
    """Slots sorted by expert and padded to BM (module docstring); ``go`` runs the
    launch now or puts it in the graph being traced."""
    S = ids.numel()
    P_MAX = S + min(E, S) * (BM - 1)
    NBLK_MAX = cdiv(P_MAX, BM)
    dev = ids.device
    a = Alignment(_tiles.workspace((P_MAX,), torch.int32, dev), _tiles.workspace((S,), torch.int32, dev),
                  _tiles.workspace((NBLK_MAX,), torch.int32, dev), _tiles.workspace((E,), torch.int32, dev), BM)
    CH = 1024 if not interpreting() else 64
    res = go(Launch(_moe_align_kernel, (E,), dict(
        ids=ids, sorted_slots=a.sorted_slots, pos_of_slot=a.pos_of_slot, block_expert=a.block_expert,
        expert_end=a.expert_end, S=S, E=E, P_MAX=P_MAX, NBLK_MAX=NBLK_MAX,
        BM=BM, NBINS=cdiv_pow2(E + 1), CH=CH, BMP=cdiv_pow2(BM)), _ALIGNED, 4))
    return Alignment(*(res[n] for n in _ALIGNED), BM)


_ALIGNED = ("sorted_slots", "pos_of_slot", "block_expert", "expert_end")


def _f32_dots(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 or interpreting()


def _ptrs(t: Tensor | None, dummy: Tensor) -> Tensor:
    return t if t is not None else dummy


def launch_sorted(x: Tensor, ids: Tensor, tw: Tensor, w1: Tensor, w2: Tensor, b1, b2, s1, z1, s2, z2,
                  activation: str, halves: bool, transposed: bool, fmt: str, group: int, alpha: float, limit: float,
                  cfg: SortedConfig, out: Tensor, go=_tiles.ran) -> Tensor:
    """out [T, H] = the experts' sum through the alignment and the grouped tl.dot kernels."""
    T, H = x.shape
    k = ids.shape[1]
    E = w1.shape[0]
    I = w1.shape[2 if transposed else 1] // 2
    a = align(ids, E, cfg.BM, go)
    nblk = a.block_expert.numel()
    rw = round_w(x.dtype, tw.dtype)
    f32 = _f32_dots(x.dtype)
    if fmt == "fp8":
        w1, w2 = w1.view(torch.uint8), w2.view(torch.uint8)
    h = _tiles.workspace((a.sorted_slots.numel(), I), x.dtype, x.device)
    sn1, sk1 = _strides(w1, transposed)
    h = go(Launch(_moe_sorted_up_kernel, (nblk, cdiv(I, cfg.BN)), dict(
        x=x, sorted_slots=a.sorted_slots, block_expert=a.block_expert, w=w1, bias=_ptrs(b1, x), scale=_ptrs(s1, x),
        zero=_ptrs(z1, x), h=h,
        K=H, I=I, TOPK=k,
        stride_xm=x.stride(0), stride_we=w1.stride(0), stride_wn=sn1, stride_wk=sk1,
        stride_se=s1.stride(0) if s1 is not None else 0, stride_sn=s1.stride(1) if s1 is not None else 0,
        stride_be=b1.stride(0) if b1 is not None else 0, stride_hm=h.stride(0),
        ACT=activation, HALVES=halves, FMT=fmt, G=group, HAS_ZERO=z1 is not None, HAS_BIAS=b1 is not None,
        ALPHA=float(alpha), LIMIT=float(limit), F32=f32, TRANS=transposed, BM=cfg.BM, BN=cfg.BN, BK=cfg.BK),
        ("h",), cfg.warps, cfg.stages))["h"]
    y = _tiles.workspace((T * k, H), x.dtype if rw else torch.float32, x.device)
    sn2, sk2 = _strides(w2, transposed)
    y = go(Launch(_moe_sorted_down_kernel, (nblk, cdiv(H, cfg.BN2)), dict(
        h=h, sorted_slots=a.sorted_slots, block_expert=a.block_expert, tw=tw, w=w2, bias=_ptrs(b2, x),
        scale=_ptrs(s2, x), zero=_ptrs(z2, x), y=y,
        K=I, N=H,
        stride_hm=h.stride(0), stride_we=w2.stride(0), stride_wn=sn2, stride_wk=sk2,
        stride_se=s2.stride(0) if s2 is not None else 0, stride_sn=s2.stride(1) if s2 is not None else 0,
        stride_be=b2.stride(0) if b2 is not None else 0, stride_ym=y.stride(0),
        ROUND_W=rw, FMT=fmt, G=group, HAS_ZERO=z2 is not None, HAS_BIAS=b2 is not None, F32=f32,
        TRANS=transposed, BM=cfg.BM, BN=cfg.BN2, BK=cfg.BK2), ("y",), cfg.warps2, cfg.stages2))["y"]
    return _sum(y, ids, a.pos_of_slot, tw, None, out, E, epilogue=False, go=go)


def _sum(y: Tensor, ids: Tensor, pos_of_slot: Tensor, tw: Tensor, b2: Tensor | None, out: Tensor, E: int,
         epilogue: bool, go=_tiles.ran) -> Tensor:
    T, H = out.shape
    k = ids.shape[1]
    BN = min(1024, cdiv_pow2(H)) if not interpreting() else min(64, cdiv_pow2(H))
    return go(Launch(_moe_sum_kernel, (T, cdiv(H, BN)), dict(
        y=y, ids=ids, pos_of_slot=pos_of_slot, tw=tw, bias=_ptrs(b2, y), out=out, E=E, N=H, TOPK=k,
        stride_ym=y.stride(0), stride_be=b2.stride(0) if b2 is not None else 0, stride_om=out.stride(0),
        ROUND_W=round_w(out.dtype, tw.dtype), EPILOGUE=epilogue, HAS_BIAS=b2 is not None,
        KP=cdiv_pow2(k), BN=BN), ("out",), 4))["out"]


def launch_grouped_mm(x: Tensor, ids: Tensor, tw: Tensor, w1: Tensor, w2: Tensor, b1, b2, activation: str,
                      halves: bool, transposed: bool, alpha: float, limit: float, out: Tensor,
                      go=_tiles.ran) -> Tensor:
    """out [T, H] through ``torch._grouped_mm`` (plain weights in x's dtype)."""
    T, H = x.shape
    k = ids.shape[1]
    E = w1.shape[0]
    I = w1.shape[2 if transposed else 1] // 2
    a = align(ids, E, 1, go)
    R = a.sorted_slots.numel()
    xs = x.index_select(0, a.sorted_slots.clamp(min=0) // k)
    w1t = w1 if transposed else w1.transpose(-2, -1)
    w2t = w2 if transposed else w2.transpose(-2, -1)
    gu = torch._grouped_mm(xs, w1t, offs=a.expert_end)
    h = _tiles.workspace((R, I), x.dtype, x.device)
    BR, BN = (16, 256) if not interpreting() else (8, 32)
    h = go(Launch(_moe_act_kernel, (cdiv(R, BR), cdiv(I, BN)), dict(
        gu=gu, sorted_slots=a.sorted_slots, ids=ids, bias=_ptrs(b1, x), h=h, R=R, I=I, stride_gm=gu.stride(0),
        stride_be=b1.stride(0) if b1 is not None else 0, stride_hm=h.stride(0), ACT=activation, HALVES=halves,
        HAS_BIAS=b1 is not None, ALPHA=float(alpha), LIMIT=float(limit), BR=BR, BN=BN), ("h",), 4))["h"]
    d = torch._grouped_mm(h, w2t, offs=a.expert_end)
    return _sum(d, ids, a.pos_of_slot, tw, b2, out, E, epilogue=True, go=go)
