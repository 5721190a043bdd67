"""Attention of a few query rows over a key/value cache: ``fusepass::decode_attention``.

    out[b, t, h] = softmax(scale * q[b, h, t] . k[b, h // G]^T + bias[b, h, t]) @ v[b, h // G]

q [B, H, T, D], k [B, H_kv, L, D], v [B, H_kv, L, D_v], G = H / H_kv query heads
per key/value head (grouped-query attention; G = 1 is multi-head), bias an
additive float mask or a boolean one (True: attend) broadcastable to
[B, H, T, L], and out [B, T, H, D_v] (the layout an output projection reads).

A decode step asks attention for one query row (a few with speculative
tokens) against a cache of L positions.  The model's graph hands SDPA the
cache repeated G times (``repeat_kv``: a copy of G x the cache a layer and a
step, then SDPA reads the copy) and a mask over every slot of a static
cache, written or not; SDPA's kernels tile 64 query rows of which one is
used.  Here one program takes the G x T query rows of one key/value head
(one tile), so each cache row is read once for all heads that share it, and
skips the blocks of positions before the first and after the last that the
mask lets through (a static cache's unwritten slots) without reading their
keys or values: exact, since such a block adds exp(-inf) = 0 to every sum.

The kernel: programs (batch x key/value head, split of L).  Where a split
spans several blocks, each reads its positions' mask first (four blocks a
memory round trip) and keeps the span from the first block it lets through
to the last; then it streams that span in BL-row blocks (no branch: the
loads pipeline), each block's mask read beside its keys and values: scores
with tl.dot in fp32, the mask added, an online softmax (running max and sum
in the exp2 domain), p @ v accumulated in fp32 (p rounded to the cache's
dtype for the dot, as flash attention kernels do; fp32 caches multiply in
full fp32).  One split writes the normalised rows; more write (max, sum,
unnormalised rows) to a workspace that a second launch merges.  A row masked
everywhere gives 0, as PyTorch's math attention (its safe softmax) does;
scores holding infinities of both signs (an inf in q) give NaN, as the math
attention does (the CPU's fused SDPA kernel gives 0 there).  fp64 and more
than ``MAX_ROWS`` query rows a head go to the reference (plain torch).

The plan cuts 16-bit value heads of 128 columns into four blocks, a program
each (each computes the same scores; its p @ v and its stores are a column
block's), where the programs still fit one wave: fewer instructions and
registers a block on the sequential path (sm_90 SASS, Qwen3-30B-A3B's heads
over 256 slots: 854 at 168 registers, 727 at 108 in two blocks, 633 at 89 in
four) and four times the programs where a step has four or eight.  H200,
8 layers int4, replayed step B1, one process each: Qwen3-30B-A3B 499.5 /
496.8 µs against 500.6 with one block, Llama-3-8B 762.0 / 762.2 against 765.6.

``fusepass::decode_attention_write`` is the same launch with the step's
cache write first (one query row a head): each program of the split that
owns the slot stores the new key row and its value columns, a barrier, then
its loop reads them with the rest, so the row needs no launch of its own.

The block loop runs on the warps in 2D (scores [rows, BL]).  One sub-block a
warp instead (batched dots, the softmax inside a warp: sm_90 SASS 387
instructions a block and warp against 525) made the decode step slower on an
H200: 8 layers int4 at (128, 1, 8), Qwen3-30B-A3B 584.5 against 509.8 µs,
Llama-3-8B 852.3 against 775.4.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from fusepass.formats import KERNEL_DTYPES
from fusepass.kernels._common import Launch, call, cdiv, emulate_rounding, inline_enabled, on_device, pdl_begin, \
    pdl_on, register_inline, rne_bf16, round_to, run_all, run_kernel, scalar_fp32, sm_count, trace_all

MAX_ROWS = 64  # query rows of one key/value head (G x T) in one tile; more are a prefill (SDPA's)
MAX_DIM = 256
_LOG2E = 1.4426950408889634


@triton.jit
def _mask_block(bias, b64, h, t, ok_r, l0, end, s_bb, s_bh, s_bt, s_bl, BOOL_BIAS: tl.constexpr, BL: tl.constexpr):
    """The mask of rows x [l0, l0 + BL) as an fp32 addend in the exp2 domain (-inf: hidden)."""
    pos = l0 + tl.arange(0, BL)
    p_b = bias + b64 * s_bb + h.to(tl.int64)[:, None] * s_bh + t[:, None] * s_bt + pos.to(tl.int64)[None, :] * s_bl
    m_b = ok_r[:, None] & (pos < end)[None, :]
    if BOOL_BIAS:
        return tl.where(tl.load(p_b, mask=m_b, other=0) != 0, 0.0, float("-inf"))
    else:
        return tl.load(p_b, mask=m_b, other=float("-inf")).to(tl.float32) * 1.4426950408889634


@triton.jit
def _decode_attention_kernel(q, k, v, bias, o, ws, wml, kn, vn, slots, H, HKV, T, L, D, DV, G, SPAN,
                             s_qb, s_qh, s_qt, s_qd, s_kb, s_kh, s_kl, s_kd, s_vb, s_vh, s_vl, s_vd,
                             s_bb, s_bh, s_bt, s_bl, s_knb, s_knh, s_knd, s_vnb, s_vnh, s_vnd, qk_scale,
                             HAS_BIAS: tl.constexpr, BOOL_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                             WRITE: tl.constexpr,
                             SCAN: tl.constexpr, IEEE: tl.constexpr, EMU: tl.constexpr, BR: tl.constexpr,
                             BL: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, BW: tl.constexpr,
                             PDL: tl.constexpr = False):
    pdl_begin(PDL)  # (a PDL launch: nothing is read before it)
    pid = tl.program_id(0)  # b * HKV + key/value head
    sp = tl.program_id(1)  # split of L
    cols = tl.program_id(2)  # block of BDV value columns (of BW)
    b = pid // HKV
    kvh = pid % HKV
    r = tl.arange(0, BR)
    rep = r // T
    t = r % T
    h = kvh * G + rep
    ok_r = r < G * T
    d = tl.arange(0, BD)
    dv = cols * BDV + tl.arange(0, BDV)
    b64 = b.to(tl.int64)
    p_q = q + b64 * s_qb + h.to(tl.int64)[:, None] * s_qh + t[:, None] * s_qt + d[None, :] * s_qd
    b_q = tl.load(p_q, mask=ok_r[:, None] & (d[None, :] < D), other=0)
    k0 = k + b64 * s_kb + kvh.to(tl.int64) * s_kh
    v0 = v + b64 * s_vb + kvh.to(tl.int64) * s_vh
    qk = scalar_fp32(qk_scale, False)  # (Inductor passes it fp64: every score tile would be scaled in fp64)
    m_i = tl.full([BR], float("-inf"), tl.float32)
    l_i = tl.zeros([BR], tl.float32)
    acc = tl.zeros([BR, BDV], tl.float32)
    start = sp * SPAN
    end = tl.minimum(start + SPAN, L)
    lo = start
    hi = end
    if WRITE:
        # The step's new key / value row (T = 1) into cache slot slots[0] before any block is read:
        # each program of the split that owns the slot stores the key row (all the same values: each
        # reads it back for its scores) and its own value columns, and the barrier orders those stores
        # before its threads' loads.  A slot outside the cache writes nothing and gives NaN rows (eager
        # indexing raises there).
        slot = tl.load(slots).to(tl.int64)
        slot = tl.where(slot < 0, slot + L, slot)
        bad = (slot < 0) | (slot >= L)
        mine = (slot >= start) & (slot < end)
        b_kn = tl.load(kn + b64 * s_knb + kvh.to(tl.int64) * s_knh + d * s_knd, mask=d < D, other=0)
        b_vn = tl.load(vn + b64 * s_vnb + kvh.to(tl.int64) * s_vnh + dv * s_vnd, mask=dv < DV, other=0)
        # (the masks as a bound each: the interpreter takes no block mask & a loaded scalar)
        tl.store(k0 + slot * s_kl + d * s_kd, b_kn, mask=d < tl.where(mine, D, 0))
        tl.store(v0 + slot * s_vl + dv * s_vd, b_vn, mask=dv < tl.where(mine, DV, 0))
        tl.debug_barrier()
    if HAS_BIAS and SCAN:
        # The mask first (a few bytes a position): the positions from the first block it lets through to
        # the last.  The loop below then has no branch, so Triton pipelines its key and value loads (a
        # branch a block serialised three memory round trips a block: 8.5 µs a layer in a model, cold).
        # Four blocks' masks a step, their loads issued together: a loop without tl.dot is not
        # pipelined, so each step is one memory round trip.
        lo = end
        hi = start
        for l0 in range(start, end, 4 * BL):
            a0 = _mask_block(bias, b64, h, t, ok_r, l0, end, s_bb, s_bh, s_bt, s_bl, BOOL_BIAS, BL)
            a1 = _mask_block(bias, b64, h, t, ok_r, l0 + BL, end, s_bb, s_bh, s_bt, s_bl, BOOL_BIAS, BL)
            a2 = _mask_block(bias, b64, h, t, ok_r, l0 + 2 * BL, end, s_bb, s_bh, s_bt, s_bl, BOOL_BIAS, BL)
            a3 = _mask_block(bias, b64, h, t, ok_r, l0 + 3 * BL, end, s_bb, s_bh, s_bt, s_bl, BOOL_BIAS, BL)
            live0 = tl.max(tl.max(a0, axis=1), axis=0) > float("-inf")
            live1 = tl.max(tl.max(a1, axis=1), axis=0) > float("-inf")
            live2 = tl.max(tl.max(a2, axis=1), axis=0) > float("-inf")
            live3 = tl.max(tl.max(a3, axis=1), axis=0) > float("-inf")
            first = tl.where(live0, l0, tl.where(live1, l0 + BL,
                                                 tl.where(live2, l0 + 2 * BL, tl.where(live3, l0 + 3 * BL, end))))
            last = tl.where(live3, l0 + 4 * BL, tl.where(live2, l0 + 3 * BL,
                                                         tl.where(live1, l0 + 2 * BL, tl.where(live0, l0 + BL, start))))
            lo = tl.minimum(lo, first)
            hi = tl.maximum(hi, last)
    for l0 in range(lo, hi, BL):
        pos = l0 + tl.arange(0, BL)
        ok_l = pos < end
        b_k = tl.load(k0 + pos.to(tl.int64)[:, None] * s_kl + d[None, :] * s_kd,
                      mask=ok_l[:, None] & (d[None, :] < D), other=0)
        b_v = tl.load(v0 + pos.to(tl.int64)[:, None] * s_vl + dv[None, :] * s_vd,
                      mask=ok_l[:, None] & (dv[None, :] < DV), other=0)
        if HAS_BIAS:
            add = _mask_block(bias, b64, h, t, ok_r, l0, end, s_bb, s_bh, s_bt, s_bl, BOOL_BIAS, BL)
        else:
            add = tl.where(ok_r[:, None] & ok_l[None, :], 0.0, float("-inf"))
        if IEEE or EMU:  # (EMU: the interpreter's bf16 dot is wrong; bf16 products are exact in fp32)
            s = tl.dot(b_q.to(tl.float32), tl.trans(b_k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(b_q, tl.trans(b_k))
        s = s * qk + add  # (log2 domain)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # (a row masked so far: no NaN from -inf - -inf)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            pv = tl.dot(p, b_v.to(tl.float32), input_precision="ieee")
        elif EMU:
            pv = tl.dot(rne_bf16(p), b_v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(b_v.dtype), b_v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    if WRITE:
        acc = tl.where(bad, float("nan"), acc)
    if SPLIT:
        slot = pid * tl.num_programs(1) + sp
        tl.store(ws + (slot * BR + r)[:, None].to(tl.int64) * BW + dv[None, :], acc)
        if cols == 0:  # (every column block has the same max and sum)
            tl.store(wml + (slot * 2) * BR + r, m_i)
            tl.store(wml + (slot * 2 + 1) * BR + r, l_i)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        p_o = o + ((b64 * T + t[:, None]) * H + h[:, None]) * DV + dv[None, :]
        tl.store(p_o, round_to(out, o.dtype.element_ty, EMU), mask=ok_r[:, None] & (dv[None, :] < DV))


@triton.jit
def _decode_attention_merge_kernel(ws, wml, o, H, HKV, T, DV, G, NSPLIT, EMU: tl.constexpr, BR: tl.constexpr,
                                   BDV: tl.constexpr, BW: tl.constexpr, PDL: tl.constexpr = False):
    pdl_begin(PDL)  # (a PDL launch: nothing is read before it)
    # The splits of one (batch, key/value head) and BDV columns: rows scaled to the largest max, summed,
    # divided once.  (ws rows are BW wide; BDV <= BW columns a program.)
    pid = tl.program_id(0)
    b = pid // HKV
    kvh = pid % HKV
    r = tl.arange(0, BR)
    dv = tl.program_id(1) * BDV + tl.arange(0, BDV)
    m_all = tl.full([BR], float("-inf"), tl.float32)
    for s in range(0, NSPLIT):
        m_all = tl.maximum(m_all, tl.load(wml + ((pid * NSPLIT + s) * 2) * BR + r))
    m_use = tl.where(m_all == float("-inf"), 0.0, m_all)
    l_all = tl.zeros([BR], tl.float32)
    acc = tl.zeros([BR, BDV], tl.float32)
    for s in range(0, NSPLIT):
        slot = pid * NSPLIT + s
        w = tl.exp2(tl.load(wml + (slot * 2) * BR + r) - m_use)
        l_all += w * tl.load(wml + (slot * 2 + 1) * BR + r)
        acc += w[:, None] * tl.load(ws + (slot * BR + r)[:, None].to(tl.int64) * BW + dv[None, :])
    out = acc / tl.where(l_all == 0.0, 1.0, l_all)[:, None]
    rep = r // T
    t = r % T
    h = kvh * G + rep
    p_o = o + ((b.to(tl.int64) * T + t[:, None]) * H + h[:, None]) * DV + dv[None, :]
    tl.store(p_o, round_to(out, o.dtype.element_ty, EMU), mask=(r < G * T)[:, None] & (dv[None, :] < DV))


# ------------------------------------------------------------------ launches ----


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def plan(B: int, HKV: int, rows: int, L: int, D: int, DV: int, device: torch.device,
         half: bool = True) -> tuple[int, int, int, int]:
    """(BL, split count, warps, value-column blocks).  Measured (H200, bf16, one query row, cold L2 not
    forced): 128-position blocks beat 64 (Llama-3-8B's heads over a 4096-slot cache: 20.3 µs against 30.5
    with 64 and 33 splits), and a split costs a merge launch (~2 µs: one split of Qwen3-30B-A3B's 256
    slots 4.8 µs against 7.4 in four), so splits of at least four blocks, up to a program an SM.  Smaller
    blocks for wide heads and many rows (registers).  16-bit value heads of 128 columns are cut into four
    blocks of 32 where the programs still fit one wave (``half``: a 16-bit cache; see the module's
    docstring for the step's times)."""
    BL = 128 if max(D, DV) <= 128 and rows <= 16 else 64 if rows <= 32 else 32
    n_sm = sm_count(device) if device.type == "cuda" else 8
    blocks = max(cdiv(L, BL), 1)
    split = max(1, min(cdiv(blocks, 4), cdiv(n_sm, max(B * HKV, 1))))
    warps = 8 if max(16, _pow2(rows)) * max(D, DV) >= 8192 or BL * max(D, DV) >= 32768 else 4
    programs = B * HKV * cdiv(L, cdiv(cdiv(L, split), BL) * BL)
    cols = 4 if half and _pow2(DV) == 128 and warps == 4 and programs * 4 <= n_sm else 1
    return BL, split, warps, cols


# A split of fewer blocks than this streams all of them, each block's mask read beside its keys and
# values, with no scan of the mask first: the scan is a memory round trip before the first key (a static
# cache of prompt + new tokens, 128 + 128 in the bench, has two blocks, both live from half way).  H200,
# replayed step, 8 layers, int4, one command: Llama-3-8B 775.1 µs against 783.9 scanning, Qwen3-30B-A3B
# 534.0 against 541.2.  (Alone and warm over a half-written 256-slot cache, where the scan skips the
# second block: 5.7 µs against 4.6.)
SCAN_MIN_BLOCKS = 3
# Read once, at import: an A/B of kernels in a model's step, one process each (not per call, on the
# decode step's host path).  FUSEPASS_ATTENTION_SCAN_MIN: SCAN_MIN_BLOCKS's value (1: always scan).
# FUSEPASS_ATTENTION_CFG="BL,split,warps[,column blocks]": that plan for every call.


def _env_ints(name: str) -> tuple[int, ...] | None:
    text = os.environ.get(name)
    if not text:
        return None
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"{name}={text!r}: comma-separated integers expected") from None


_SCAN_MIN = (_env_ints("FUSEPASS_ATTENTION_SCAN_MIN") or (SCAN_MIN_BLOCKS,))[0]
_ENV_CFG = _env_ints("FUSEPASS_ATTENTION_CFG")
if _ENV_CFG is not None and len(_ENV_CFG) not in (3, 4):
    raise ValueError(f"FUSEPASS_ATTENTION_CFG={_ENV_CFG}: BL,split,warps[,column blocks] expected")


def launches(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, scale: float, out: Tensor,
             cfg: tuple[int, ...] | None = None, scan_min: int | None = None,
             write: tuple[Tensor, Tensor, Tensor] | None = None) -> tuple[list[Launch], Tensor]:
    """The kernel's launch (and the merge's, for more than one split) writing ``out`` [B, T, H, D_v]; a
    split of ``scan_min`` blocks or more scans its mask first (default: SCAN_MIN_BLOCKS).  ``cfg``:
    (BL, split, warps[, column blocks]): the value columns cut into that many blocks (a power of two,
    16 columns or more each), a program each, every one of them computing the same scores.  ``write``:
    (k_new [B, H_kv, 1, D], v_new [B, H_kv, 1, D_v], slots [1]): the kernel first stores the new rows
    into cache slot slots[0] of k and v (one query row a head: T = 1)."""
    B, H, T, D = q.shape
    HKV, L, DV = k.shape[1], k.shape[2], v.shape[3]
    G = H // HKV
    BR = max(16, _pow2(G * T))
    BL, split, warps, *rest = cfg or _ENV_CFG or plan(B, HKV, G * T, L, D, DV, q.device, q.element_size() == 2)
    BW = max(16, _pow2(DV))  # value columns, padded
    ncols = rest[0] if rest else 1
    if ncols < 1 or ncols & (ncols - 1) or BW // ncols < 16:
        raise ValueError(f"decode_attention: {DV} value columns do not cut into {ncols} blocks of 16 or more")
    span = cdiv(cdiv(L, split), BL) * BL  # positions a split owns, whole blocks
    split = max(1, cdiv(L, span))
    scan = span // BL >= (scan_min if scan_min is not None else _SCAN_MIN)
    if split > 1:
        ws = torch.empty((B * HKV * split * BR, BW), dtype=torch.float32, device=q.device)
        wml = torch.empty((B * HKV * split * 2 * BR,), dtype=torch.float32, device=q.device)
    else:  # (never touched: the kernel's SPLIT branch is compiled out)
        ws = wml = torch.empty((1,), dtype=torch.float32, device=q.device)
    bb = bias if bias is not None else q
    bs = bias.stride() if bias is not None else (0, 0, 0, 0)
    if write is not None and T != 1:
        raise ValueError(f"decode_attention: the cache write takes one query row a head, not {T}")
    kn, vn, slots = write if write is not None else (q, q, q)
    kns = (kn.stride(0), kn.stride(1), kn.stride(3)) if write is not None else (0, 0, 0)
    vns = (vn.stride(0), vn.stride(1), vn.stride(3)) if write is not None else (0, 0, 0)
    pdl = pdl_on(q)
    main = Launch(_decode_attention_kernel, (B * HKV, split, ncols), dict(
        q=q, k=k, v=v, bias=bb, o=out, ws=ws, wml=wml, kn=kn, vn=vn, slots=slots,
        H=H, HKV=HKV, T=T, L=L, D=D, DV=DV, G=G, SPAN=span,
        s_qb=q.stride(0), s_qh=q.stride(1), s_qt=q.stride(2), s_qd=q.stride(3),
        s_kb=k.stride(0), s_kh=k.stride(1), s_kl=k.stride(2), s_kd=k.stride(3),
        s_vb=v.stride(0), s_vh=v.stride(1), s_vl=v.stride(2), s_vd=v.stride(3),
        s_bb=bs[0], s_bh=bs[1], s_bt=bs[2], s_bl=bs[3], s_knb=kns[0], s_knh=kns[1], s_knd=kns[2],
        s_vnb=vns[0], s_vnh=vns[1], s_vnd=vns[2], qk_scale=float(scale) * _LOG2E,
        HAS_BIAS=bias is not None, BOOL_BIAS=bias is not None and bias.dtype == torch.bool, SPLIT=split > 1,
        WRITE=write is not None,
        SCAN=scan, IEEE=q.dtype == torch.float32, EMU=emulate_rounding(q.dtype), BR=BR, BL=BL,
        BD=max(16, _pow2(D)), BDV=BW // ncols, BW=BW,
        PDL=pdl), (("ws", "wml") if split > 1 else ("o",)) + (("k", "v") if write is not None else ()), warps, 2)
    if split == 1:
        return [main], out
    BDM = min(BW, 64)
    merge = Launch(_decode_attention_merge_kernel, (B * HKV, BW // BDM), dict(
        ws=ws, wml=wml, o=out, H=H, HKV=HKV, T=T, DV=DV, G=G, NSPLIT=split, EMU=emulate_rounding(q.dtype), BR=BR,
        BDV=BDM, BW=BW, PDL=pdl), ("o",), 4)
    return [main, merge], out


# ------------------------------------------------------------------------ op ----


def _check(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None) -> None:
    torch._check(q.dim() == 4 and k.dim() == 4 and v.dim() == 4,
                 lambda: f"q, k, v are [B, H, T, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, H, T, D = q.shape
    torch._check(k.shape[0] == B and v.shape[0] == B and k.shape[3] == D and v.shape[1] == k.shape[1]
                 and v.shape[2] == k.shape[2],
                 lambda: f"k {tuple(k.shape)} and v {tuple(v.shape)} do not fit q {tuple(q.shape)}")
    torch._check(k.shape[1] > 0 and H % k.shape[1] == 0,
                 lambda: f"{H} query heads are not a multiple of {k.shape[1]} key/value heads")
    torch._check(k.dtype == q.dtype and v.dtype == q.dtype, lambda: f"q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if bias is not None:
        torch._check(bias.dtype == torch.bool or bias.dtype == q.dtype,
                     lambda: f"the mask is {bias.dtype}: bool or {q.dtype}")
        torch._check(bias.dim() <= 4, lambda: f"the mask has {bias.dim()} dims")


def reference(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, scale: float) -> Tensor:
    """The op in plain torch ([B, T, H, D_v]), in fp32 (fp64 for fp64)."""
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    G = q.shape[1] // k.shape[1]
    kf = k.to(work).repeat_interleave(G, dim=1)
    vf = v.to(work).repeat_interleave(G, dim=1)
    s = (q.to(work) @ kf.transpose(-1, -2)) * scale
    if bias is not None:
        s = s + (torch.where(bias, 0.0, float("-inf")).to(work) if bias.dtype == torch.bool else bias.to(work))
    m = s.amax(-1, keepdim=True)
    m = torch.where(m == float("-inf"), 0.0, m)
    p = torch.exp(s - m)
    den = p.sum(-1, keepdim=True)
    out = (p @ vf) / torch.where(den == 0, 1.0, den)
    return out.to(q.dtype).transpose(1, 2).contiguous()


def _full_bias(q: Tensor, k: Tensor, bias: Tensor | None) -> Tensor | None:
    """The mask as a [B, H, T, L] view (broadcast dims at stride 0)."""
    if bias is None:
        return None
    return bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def takes(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether the kernel serves these shapes (else the reference)."""
    B, H, T, D = q.shape
    G = H // k.shape[1]
    return (q.dtype in KERNEL_DTYPES and 0 < G * T <= MAX_ROWS and 0 < D <= MAX_DIM and 0 < v.shape[3] <= MAX_DIM
            and k.shape[2] > 0 and B > 0)


def decode_attention_fwd(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, scale: float,
                         cfg: tuple[int, ...] | None = None, scan_min: int | None = None) -> Tensor:
    """The CUDA body (``cfg`` and ``scan_min`` override the plan: tests, sweeps)."""
    if not takes(q, k, v):
        return reference(q, k, v, bias, scale)
    B, H, T, _ = q.shape
    out = torch.empty((B, T, H, v.shape[3]), dtype=q.dtype, device=q.device)
    with on_device(q):
        run_all(launches(q, k, v, _full_bias(q, k, bias), scale, out, cfg, scan_min)[0])
    return out


@torch.library.custom_op("fusepass::decode_attention", mutates_args=())
def decode_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, scale: float) -> Tensor:
    """softmax(scale q k^T + bias) v per query head, k and v shared by H / H_kv heads; out [B, T, H, D_v].
    This body serves CPU."""
    _check(q, k, v, bias)
    return reference(q, k, v, bias, scale)


@decode_attention.register_fake
def _decode_attention_fake(q, k, v, bias, scale):
    _check(q, k, v, bias)
    return q.new_empty((q.shape[0], q.shape[2], q.shape[1], v.shape[3]))


@decode_attention.register_kernel("cuda")
def _decode_attention_cuda(q, k, v, bias, scale):
    _check(q, k, v, bias)
    return run_kernel("decode_attention", lambda: decode_attention_fwd(q, k, v, bias, scale),
                      lambda: reference(q, k, v, bias, scale))


# ------------------------------------------------ the op with the cache write ----


def _check_write(q: Tensor, k: Tensor, v: Tensor, k_new: Tensor, v_new: Tensor, slots: Tensor) -> None:
    B, _, T, _ = q.shape
    torch._check(tuple(k_new.shape) == (B, k.shape[1], T, k.shape[3])
                 and tuple(v_new.shape) == (B, v.shape[1], T, v.shape[3]),
                 lambda: f"new rows k {tuple(k_new.shape)}, v {tuple(v_new.shape)} do not fit the caches "
                         f"{tuple(k.shape)}, {tuple(v.shape)} and {T} query rows")
    torch._check(k_new.dtype == k.dtype and v_new.dtype == v.dtype,
                 lambda: f"new rows {k_new.dtype} / {v_new.dtype} for caches {k.dtype} / {v.dtype}")
    torch._check(slots.dim() == 1 and slots.shape[0] == T and not slots.is_floating_point()
                 and slots.dtype != torch.bool, lambda: f"slots {tuple(slots.shape)} {slots.dtype}: {T} integers")


def _write_rows(k: Tensor, v: Tensor, k_new: Tensor, v_new: Tensor, slots: Tensor) -> None:
    """The rows written as ``index_put_(cache, [None, None, slots], new)``: negative slots count from the end,
    others past it raise."""
    k[:, :, slots] = k_new
    v[:, :, slots] = v_new


def decode_attention_write_fwd(q: Tensor, k: Tensor, v: Tensor, k_new: Tensor, v_new: Tensor, slots: Tensor,
                               bias: Tensor | None, scale: float, cfg: tuple[int, ...] | None = None) -> Tensor:
    """The CUDA body of the op with the write: one launch stores the row and reads the cache at one query
    row a head (else the rows are written first, then attention)."""
    if not (takes(q, k, v) and q.shape[2] == 1):
        _write_rows(k, v, k_new, v_new, slots)
        return decode_attention_fwd(q, k, v, bias, scale, cfg)
    B, H, T, _ = q.shape
    out = torch.empty((B, T, H, v.shape[3]), dtype=q.dtype, device=q.device)
    with on_device(q):
        run_all(launches(q, k, v, _full_bias(q, k, bias), scale, out, cfg, write=(k_new, v_new, slots))[0])
    return out


@torch.library.custom_op("fusepass::decode_attention_write", mutates_args=("k", "v"))
def decode_attention_write(q: Tensor, k: Tensor, v: Tensor, k_new: Tensor, v_new: Tensor, slots: Tensor,
                           bias: Tensor | None, scale: float) -> Tensor:
    """A decode step's cache write and its attention: k[:, :, slots] = k_new, v[:, :, slots] = v_new (in
    place), then ``decode_attention(q, k, v, bias, scale)``.  This body serves CPU."""
    _check(q, k, v, bias)
    _check_write(q, k, v, k_new, v_new, slots)
    _write_rows(k, v, k_new, v_new, slots)
    return reference(q, k, v, bias, scale)


@decode_attention_write.register_fake
def _decode_attention_write_fake(q, k, v, k_new, v_new, slots, bias, scale):
    _check(q, k, v, bias)
    _check_write(q, k, v, k_new, v_new, slots)
    return q.new_empty((q.shape[0], q.shape[2], q.shape[1], v.shape[3]))


@decode_attention_write.register_kernel("cuda")
def _decode_attention_write_cuda(q, k, v, k_new, v_new, slots, bias, scale):
    _check(q, k, v, bias)
    _check_write(q, k, v, k_new, v_new, slots)

    def fallback():
        _write_rows(k, v, k_new, v_new, slots)
        return reference(q, k, v, bias, scale)

    return run_kernel("decode_attention_write", lambda: decode_attention_write_fwd(q, k, v, k_new, v_new, slots, bias,
                                                                               scale), fallback)


# ------------------------------------------------------- calls in graphs ----


def _traced(q, k, v, bias, scale):
    B, H, T, _ = q.shape
    out = torch.empty((B, T, H, v.shape[3]), dtype=q.dtype, device=q.device)
    steps, out = launches(q, k, v, _full_bias(q, k, bias), scale, out)
    return trace_all(steps)[id(out)]


def _inline_ok(q, k, v, bias, scale) -> bool:
    # The grid, the tile and the split need every size as a number.
    sizes = (*q.shape, *k.shape, *v.shape, *q.stride(), *k.stride(), *v.stride())
    if bias is not None:
        sizes += (*bias.shape, *bias.stride())
    return (inline_enabled(q) and all(isinstance(s, int) for s in sizes) and takes(q, k, v)
            and not math.isnan(scale))


register_inline(torch.ops.fusepass.decode_attention.default, _inline_ok, _traced)


def decode_attention_call(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, scale: float) -> Tensor:
    """What the rule puts in a graph ([B, T, H, D_v]): the launches themselves when the engine inlines
    kernels for a CUDA graph, else the op."""
    return call(torch.ops.fusepass.decode_attention.default, q, k, v, bias, scale)
