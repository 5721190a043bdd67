"""The router of a sparse MoE block: logits, scores, top-k, renormalisation and
scaling in one op.

    moe_router(x [T, H], weight [E, H], bias [E]?, correction_bias [E]?, kind,
               top_k, renormalize, n_group, topk_group, scaling,
               logits_dtype, weights_dtype)
        -> topk_weights [T, top_k] (weights_dtype),
           topk_ids     [T, top_k] (int64),
           logits       [T, E]     (logits_dtype)

    logits = (x @ weight^T + bias), accumulated in fp32, rounded to logits_dtype
    s      = logits in fp32

    kind "softmax"       p = softmax(s);  ids = top-k of p;  w = p[ids]
                         renormalize: w /= sum(w)
                         (Qwen3-MoE, Qwen3.5-MoE, Qwen3-Next, OLMoE: weights in
                         x's dtype; Mixtral: renormalised, weights left in fp32)
    kind "topk_softmax"  ids = top-k of s;  w = softmax(s[ids])
                         (gpt-oss, with its router bias)
    kind "sigmoid"       p = sigmoid(s);  c = p + correction_bias;
                         with n_group > 1, only the topk_group groups of
                         E / n_group experts with the largest sum of their two
                         largest c compete;  ids = top-k of c;  w = p[ids]
                         renormalize: w /= sum(w) + 1e-20
                         (DeepSeek-V3 and its family: logits in fp32)
    then  w *= scaling;  topk_weights = w rounded to weights_dtype

Every step after the logits runs in fp32, as the models do (their softmax
takes ``dtype=torch.float`` or a ``.float()`` input; gpt-oss's softmax of
bf16 values computes in fp32 and rounds once, which is this).

Ties: the top-k here (selection and order) puts the lower expert index first
among equal scores, in the reference and in the kernel.  torch.topk does not
promise an order among ties: on CPU it picks among them arbitrarily
(``std::nth_element``; seen here: [1, 2, 2, 2, 0, 2, 3, 2] top-3 gives ids
6, 5, 1), while ATen's CUDA kernel fills the places left after the values
above the k-th with the lowest-indexed values equal to it, as this op does.  Ties
are not rare: bf16 logits have 8 significant bits, and with 128 experts two of
them near the k-th place are equal in a few percent of tokens; an equal score
at the k-th place decides which expert runs, so a comparison against eager
that must be exact on the ids sees such tokens differ (with the same weight).
DeepSeek-V3 calls ``topk(sorted=False)``, whose order is unspecified: any
order of the same ids is its answer; this op returns them in descending order.

The ``sigmoid`` kind's group scores and group choice follow DeepSeek-V3's
code: the sum of each group's two largest choice scores, the ``topk_group``
largest groups, the others masked with -inf before the final top-k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from fusepass.formats import KERNEL_DTYPES
from fusepass.kernels._common import (
    Launch,
    cdiv,
    inline_enabled,
    interpreting,
    on_device,
    pdl_on,
    pdl_release,
    pdl_wait,
    register_inline,
    run_kernel,
)
from fusepass.kernels.dequant_matmul.counters import _split_counters
from fusepass.kernels.moe import _tiles
from fusepass.kernels.moe._tiles import _dot, cdiv_pow2

ROUTER_KINDS = ("softmax", "topk_softmax", "sigmoid")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# DeepSeek-V3's guard against a zero sum of sigmoid scores.
SIGMOID_RENORM_EPS = 1e-20


# --------------------------------------------------------------- reference ----


def topk_lowest_first(scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k largest along the last dim, descending, ties in ascending index order."""
    values, ids = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[..., :k], ids[..., :k]


def moe_router_reference(x: Tensor, weight: Tensor, bias: Tensor | None, correction_bias: Tensor | None, kind: str,
                         top_k: int, renormalize: bool, n_group: int, topk_group: int, scaling: float,
                         logits_dtype: torch.dtype, weights_dtype: torch.dtype,
                         compute_dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor, Tensor]:
    """The op's semantics in plain torch.  ``compute_dtype`` (fp32, or fp64 for
    tests) is where everything between the roundings the models make runs."""
    logits = x.to(compute_dtype) @ weight.to(compute_dtype).t()
    if bias is not None:
        logits = logits + bias.to(compute_dtype)
    logits = logits.to(logits_dtype)
    w, ids = router_select_reference(logits, correction_bias, kind, top_k, renormalize, n_group, topk_group, scaling,
                                     weights_dtype, compute_dtype)
    return w, ids, logits


def router_select_reference(logits: Tensor, correction_bias: Tensor | None, kind: str, top_k: int, renormalize: bool,
                            n_group: int, topk_group: int, scaling: float, weights_dtype: torch.dtype,
                            compute_dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """(topk_weights, topk_ids) from the rounded logits [T, E]."""
    cd = compute_dtype
    E = logits.shape[1]
    s = logits.to(cd)
    if kind == "softmax":
        w, ids = topk_lowest_first(torch.softmax(s, dim=-1), top_k)
        if renormalize:
            w = w / w.sum(dim=-1, keepdim=True)
    elif kind == "topk_softmax":
        w, ids = topk_lowest_first(s, top_k)
        w = torch.softmax(w, dim=-1)
        if renormalize:
            w = w / w.sum(dim=-1, keepdim=True)
    else:
        p = torch.sigmoid(s)
        choice = p if correction_bias is None else p + correction_bias.to(cd)
        if n_group > 1:
            T, size = choice.shape[0], E // n_group
            group_scores = topk_lowest_first(choice.view(T, n_group, size), 2)[0].sum(dim=-1)
            group_ids = topk_lowest_first(group_scores, topk_group)[1]
            keep = torch.zeros(T, n_group, dtype=torch.bool, device=s.device).scatter_(1, group_ids, True)
            choice = choice.masked_fill(~keep.repeat_interleave(size, dim=1), float("-inf"))
        ids = topk_lowest_first(choice, top_k)[1]
        w = p.gather(1, ids)
        if renormalize:
            w = w / (w.sum(dim=-1, keepdim=True) + SIGMOID_RENORM_EPS)
    w = w * scaling
    return w.to(weights_dtype), ids

# ------------------------------------------------------------------ kernel ----
#
# One launch.  Program (i_t, i_e) computes the logits of BT tokens for BE
# experts (FMAs on [BT, BE, BK] register tiles for a few tokens, tl.dot for
# more) and stores them rounded to logits_dtype.  With all experts in one
# program (BE covers E) it goes on to the selection; split over experts
# (SPLIT, for a few tokens: the E x H weight is then read by many SMs at once
# instead of one), the token block's last program to arrive -- counted in
# ``ctr``, the pattern of dequant_matmul's split-K sums -- reads the rounded
# logits back and selects.  Selection: top-k by k rounds of (max, lowest
# index holding it), so ties go to the lower expert index.


@triton.jit
def _topk_rounds(c, o, valid, K: tl.constexpr, N: tl.constexpr):
    """The mask [BT, N] of the K largest of c [BT, N] among ``valid``, the lower
    index first among equals."""
    taken = ~valid
    for _ in tl.static_range(K):
        cm = tl.where(taken, float("-inf"), c)
        mx = tl.max(cm, axis=1)
        sel = tl.min(tl.where((cm == mx[:, None]) & ~taken, o[None, :], N), axis=1)
        taken = taken | (o[None, :] == sel[:, None])
    return taken & valid


@triton.jit
def _moe_router_kernel(
    x, w, bias, cbias, ctr, logits, tw, tid,
    T, E, K, stride_xm, stride_wm,
    KIND: tl.constexpr, TOP_K: tl.constexpr, RENORM: tl.constexpr, NG: tl.constexpr, TG: tl.constexpr,
    SCALING: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_CB: tl.constexpr, SPLIT: tl.constexpr,
    USE_DOT: tl.constexpr, F32: tl.constexpr,
    BT: tl.constexpr, BE: tl.constexpr, BEA: tl.constexpr, BK: tl.constexpr, KP: tl.constexpr,
    RANK: tl.constexpr = False, PDL: tl.constexpr = False, RELEASE: tl.constexpr = False,
):
    pdl_wait(PDL)
    pdl_release(RELEASE)
    i_t, i_e = tl.program_id(0), tl.program_id(1)
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    o_e = i_e * BE + tl.arange(0, BE)
    m_e = o_e < E
    p_x = x + o_t.to(tl.int64)[:, None] * stride_xm
    p_w = w + o_e.to(tl.int64)[:, None] * stride_wm
    if USE_DOT:
        acc = tl.zeros([BT, BE], dtype=tl.float32)
        for k0 in range(0, K, BK):
            o_k = k0 + tl.arange(0, BK)
            m_k = o_k < K
            b_x = tl.load(p_x + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0)
            b_w = tl.load(p_w + o_k[None, :], mask=m_e[:, None] & m_k[None, :], other=0)
            acc = _dot(b_x, tl.trans(b_w), acc, F32)
    else:
        acc3 = tl.zeros([BT, BE, BK], dtype=tl.float32)
        for k0 in range(0, K, BK):
            o_k = k0 + tl.arange(0, BK)
            m_k = o_k < K
            b_x = tl.load(p_x + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0).to(tl.float32)
            b_w = tl.load(p_w + o_k[None, :], mask=m_e[:, None] & m_k[None, :], other=0).to(tl.float32)
            acc3 += b_x[:, None, :] * b_w[None, :, :]
        acc = tl.sum(acc3, axis=2)
    if HAS_BIAS:
        acc += tl.load(bias + o_e, mask=m_e, other=0).to(tl.float32)[None, :]
    b_l = acc.to(logits.dtype.element_ty)
    p_l = logits + o_t.to(tl.int64)[:, None] * E
    tl.store(p_l + o_e[None, :], b_l, mask=m_t[:, None] & m_e[None, :])

    last = True
    if SPLIT:
        tl.debug_barrier()
        last = tl.atomic_add(ctr + i_t, 1) == tl.num_programs(1) - 1  # acq_rel, gpu scope
    if last:
        o_a = tl.arange(0, BEA)
        valid = (o_a < E)[None, :]
        if SPLIT:
            s = tl.load(p_l + o_a[None, :], mask=m_t[:, None] & valid, other=0, cache_modifier=".cg")
            s = s.to(tl.float32)
            tl.atomic_xchg(ctr + i_t, 0)
        else:
            s = b_l.to(tl.float32)
        if KIND == "softmax":
            s = tl.where(valid, s, float("-inf"))
            b_p = tl.exp(s - tl.max(s, axis=1)[:, None])
            b_p = b_p / tl.sum(b_p, axis=1)[:, None]
            choice = b_p
        elif KIND == "topk_softmax":
            b_p = s
            choice = s
        else:
            b_p = 1.0 / (1.0 + tl.exp(-s))
            choice = b_p
            if HAS_CB:
                choice = choice + tl.load(cbias + o_a, mask=o_a < E, other=0).to(tl.float32)[None, :]
        choice = tl.where(choice != choice, float("inf"), choice)  # NaN ranks first, as in torch.topk
        if NG > 1:
            # DeepSeek-V3: groups of GS experts scored by their two largest,
            # the TG best groups kept (BEA == E here: E and GS powers of two).
            GS: tl.constexpr = BEA // NG
            c3 = tl.reshape(choice, (BT, NG, GS))
            o_g = tl.arange(0, GS)[None, None, :]
            m1 = tl.max(c3, axis=2)
            i1 = tl.min(tl.where(c3 == m1[:, :, None], o_g, GS), axis=2)
            m2 = tl.max(tl.where(o_g == i1[:, :, None], float("-inf"), c3), axis=2)
            o_ng = tl.arange(0, NG)
            keep = _topk_rounds(m1 + m2, o_ng, (o_ng < NG)[None, :], TG, NG)
            choice = tl.reshape(tl.where(keep[:, :, None], c3, float("-inf")), (BT, BEA))
        # top-k, in order, into [BT, KP] tiles
        o_j = tl.arange(0, KP)[None, :]
        if RANK:
            # Each expert's place in one pass: the valid experts ahead of it (a
            # larger score, or an equal one at a lower index), [BT, BEA, BEA]
            # compares and one sum, against TOP_K dependent rounds of three
            # reductions each; the expert of place j goes to column j.
            c_i = choice[:, :, None]
            c_j = choice[:, None, :]
            o_i3 = o_a[None, :, None]
            o_j3 = o_a[None, None, :]
            ahead = ((c_j > c_i) | ((c_j == c_i) & (o_j3 < o_i3))) & (o_j3 < E)
            place = tl.where(valid, tl.sum(ahead.to(tl.int32), axis=2), BEA)  # [BT, BEA]
            hit = place[:, :, None] == o_j[:, None, :]  # [BT, BEA, KP]
            vals = tl.sum(tl.where(hit, b_p[:, :, None], 0.0), axis=1)
            idxs = tl.sum(tl.where(hit, o_i3, 0), axis=1)
        else:
            vals = tl.zeros([BT, KP], dtype=tl.float32)
            idxs = tl.zeros([BT, KP], dtype=tl.int32)
            taken = ~valid
            for j in tl.static_range(TOP_K):
                cm = tl.where(taken, float("-inf"), choice)
                mx = tl.max(cm, axis=1)
                sel = tl.min(tl.where((cm == mx[:, None]) & ~taken, o_a[None, :], BEA), axis=1)
                hit = o_a[None, :] == sel[:, None]
                taken = taken | hit
                v = tl.sum(tl.where(hit, b_p, 0.0), axis=1)
                vals = tl.where(o_j == j, v[:, None], vals)
                idxs = tl.where(o_j == j, sel[:, None], idxs)
        m_j = o_j < TOP_K
        if KIND == "topk_softmax":
            ex = tl.where(m_j, tl.exp(vals - tl.max(tl.where(m_j, vals, float("-inf")), axis=1)[:, None]), 0.0)
            vals = ex / tl.sum(ex, axis=1)[:, None]
        if RENORM:
            total = tl.sum(tl.where(m_j, vals, 0.0), axis=1)[:, None]
            if KIND == "sigmoid":
                total = total + 1e-20
            vals = vals / total
        vals = vals * SCALING
        m_o = m_t[:, None] & m_j
        o_o = o_t.to(tl.int64)[:, None] * TOP_K + o_j
        tl.store(tw + o_o, vals.to(tw.dtype.element_ty), mask=m_o)
        tl.store(tid + o_o, idxs.to(tl.int64), mask=m_o)


# ------------------------------------------------------------------ launch ----


@dataclass(frozen=True)
class RouterConfig:
    BT: int  # tokens per program
    BE: int  # experts per program (a power of two); < E: split over experts
    BK: int
    dot: bool
    warps: int = 4
    rank: bool = False  # top-k by each expert's place (one pass; BT * BEA**2 compares)
    pdl: bool = False  # launched with programmatic dependent launch (``_common.pdl_wait``)
    # Let a PDL launch after it (the experts' gate_up) start at once.  Off: at
    # T = 1 on an H200 it saved 0.1 µs before bf16 experts and cost 3.9 before
    # int4 ones (router + experts 25.9 against 22.0; moe_decode_launches.py).
    release: bool = False


def router_heuristic(T: int, E: int, H: int) -> RouterConfig:
    """Few tokens: FMAs, the experts split over up to 128 programs (at T = 1 one
    weight row of E each, read in one or two tiles: one DRAM round trip
    rather than a loop of them in a few programs); more tokens: tl.dot over
    all experts (fp32 and mixed dtypes as exact fp32 dots); fewer than 16
    experts, too few for tl.dot: FMAs over all of them, 4 tokens a program.
    Chosen without a GPU at hand."""
    BEA = cdiv_pow2(E)
    if T <= 8:
        BT = cdiv_pow2(T)
        BE = max(1, cdiv_pow2(cdiv(E, 128)))
        # One token: the one-pass top-k (H200, commit 9ba7c38: Qwen3-30B-A3B's
        # router 4.7 µs against 6.6, gpt-oss-20b's 4.1 against 4.5); at 8 tokens
        # the rounds (gpt-oss 7.1 against 8.0; Qwen3's 128 experts do not fit).
        # PDL (a wait at the start, no early release): the norm before it releases
        # at its start, so the router's programs are resident when it ends.
        return RouterConfig(BT=BT, BE=BE, BK=max(16, min(4096 // (BT * BE), cdiv_pow2(H))), dot=False,
                            rank=BT == 1, pdl=True)
    return _whole(BEA, H)


def rank_fits(BT: int, BEA: int, warps: int) -> bool:
    """Whether the one-pass top-k's [BT, BEA, BEA] compares fit 128 a thread."""
    return BT * BEA * BEA <= 128 * 32 * warps


def _whole(BEA: int, H: int) -> RouterConfig:
    """All experts in one program (no split, no counters)."""
    if BEA < 16:
        return RouterConfig(BT=4, BE=BEA, BK=max(16, min(4096 // (4 * BEA), cdiv_pow2(H))), dot=False)
    BT = 16 if BEA >= 256 else 32
    return RouterConfig(BT=BT, BE=BEA, BK=64, dot=True, warps=8 if BEA >= 256 else 4)


def _kernel_ok(x, weight, kind, n_group) -> bool:
    E = weight.shape[0]
    if x.dtype not in KERNEL_DTYPES or weight.dtype not in KERNEL_DTYPES:
        return False
    if E > 1024:  # one program holds a token's E logits
        return False
    if n_group > 1 and (E & (E - 1)):  # the group reshape needs E a power of two
        return False
    return True


def router_launch(x: Tensor, weight: Tensor, bias: Tensor | None, correction_bias: Tensor | None, kind: str,
                  top_k: int, renormalize: bool, n_group: int, topk_group: int, scaling: float, cfg: RouterConfig,
                  ctr: Tensor | None, tw: Tensor, tid: Tensor, logits: Tensor) -> Launch:
    """The router's one launch: ``cfg`` split over experts when ``ctr`` (one zeroed
    counter per token block) is given, else all experts in each program.  x and
    weight with unit column stride."""
    T, H = x.shape
    E = weight.shape[0]
    BEA = cdiv_pow2(E)
    split = ctr is not None
    pdl = pdl_on(x)
    if not split and cfg.BE < BEA:
        cfg = _whole(BEA, H)
    n_t, n_e = cdiv(T, cfg.BT), (cdiv(E, cfg.BE) if split else 1)
    f32 = x.dtype == torch.float32 or weight.dtype != x.dtype or interpreting()
    dummy = x  # unused pointers: never a tensor the launch writes
    args = dict(
        x=x, w=weight, bias=bias if bias is not None else dummy,
        cbias=correction_bias if correction_bias is not None else dummy, ctr=ctr if split else dummy,
        logits=logits, tw=tw, tid=tid, T=T, E=E, K=H, stride_xm=x.stride(0), stride_wm=weight.stride(0),
        KIND=kind, TOP_K=top_k, RENORM=bool(renormalize), NG=n_group, TG=topk_group, SCALING=float(scaling),
        HAS_BIAS=bias is not None, HAS_CB=correction_bias is not None, SPLIT=split,
        USE_DOT=cfg.dot and BEA >= 16 and cfg.BT >= 16, F32=f32,
        BT=cfg.BT, BE=cfg.BE if split else BEA, BEA=BEA, BK=cfg.BK, KP=cdiv_pow2(top_k),
        RANK=cfg.rank and rank_fits(cfg.BT, BEA, cfg.warps), PDL=cfg.pdl and pdl, RELEASE=cfg.release and pdl)
    outputs = ("logits", "tw", "tid") + (("ctr",) if split else ())
    return Launch(_moe_router_kernel, (n_t, n_e), args, outputs, cfg.warps)


def _unit_last(t: Tensor | None) -> Tensor | None:
    """``t`` at unit stride in its last dim (the kernel reads a bias as E packed values: an expanded or
    sliced one is copied, E values)."""
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def router_fwd(x: Tensor, weight: Tensor, bias: Tensor | None, correction_bias: Tensor | None, kind: str, top_k: int,
               renormalize: bool, n_group: int, topk_group: int, scaling: float, logits_dtype: torch.dtype,
               weights_dtype: torch.dtype, cfg: RouterConfig | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The router through its Triton kernel (operands as the op checked them)."""
    T, H = x.shape
    E = weight.shape[0]
    dev = x.device
    tw = _tiles.workspace((T, top_k), weights_dtype, dev)
    tid = _tiles.workspace((T, top_k), torch.int64, dev)
    logits = _tiles.workspace((T, E), logits_dtype, dev)
    if T == 0:
        return tw, tid, logits
    x, weight, bias, correction_bias = (_unit_last(t) for t in (x, weight, bias, correction_bias))
    cfg = cfg or router_heuristic(T, E, H)
    ctr = None
    if cdiv(E, cfg.BE) > 1:
        # None in a CUDA-graph capture without free counters: all experts in each program.
        ctr = _split_counters(dev, cdiv(T, cfg.BT))
    with on_device(x):
        router_launch(x, weight, bias, correction_bias, kind, top_k, renormalize, n_group, topk_group, scaling, cfg,
                      ctr, tw, tid, logits).run()
    return tw, tid, logits


def router_traced(x: Tensor, weight: Tensor, bias: Tensor | None, correction_bias: Tensor | None, kind: str,
                  top_k: int, renormalize: bool, n_group: int, topk_group: int, scaling: float,
                  logits_dtype: torch.dtype, weights_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """The router's launch as a node of the graph (the inlined form), its split
    counters zeroed in the graph (the last program of each token block leaves
    them at zero again)."""
    T, H = x.shape
    E = weight.shape[0]
    dev = x.device
    tw = torch.empty((T, top_k), dtype=weights_dtype, device=dev)
    tid = torch.empty((T, top_k), dtype=torch.int64, device=dev)
    logits = torch.empty((T, E), dtype=logits_dtype, device=dev)
    x, weight, bias, correction_bias = (_unit_last(t) for t in (x, weight, bias, correction_bias))
    cfg = router_heuristic(T, E, H)
    ctr = torch.zeros(cdiv(T, cfg.BT), dtype=torch.int32, device=dev) if cdiv(E, cfg.BE) > 1 else None
    res = router_launch(x, weight, bias, correction_bias, kind, top_k, renormalize, n_group, topk_group, scaling, cfg,
                        ctr, tw, tid, logits).traced()
    return res["tw"], res["tid"], res["logits"]


def _static(*sizes) -> bool:
    return all(isinstance(s, int) for s in sizes)


def _inline_ok(x, weight, bias, correction_bias, kind, top_k, renormalize, n_group, topk_group, scaling, logits_dtype,
               weights_dtype) -> bool:
    # The launch's tiles depend on T: a symbolic T (dynamic=True) goes through the op, which picks per call.
    try:
        _check(x, weight, bias, correction_bias, kind, top_k, n_group, topk_group, logits_dtype, weights_dtype)
    except RuntimeError:  # the op's call raises the error itself
        return False
    return (inline_enabled(x) and x.dim() == 2 and weight.dim() == 2 and _kernel_ok(x, weight, kind, n_group)
            and _static(*x.shape, *x.stride(), *weight.shape, *weight.stride()) and x.shape[0] > 0
            and x.shape[1] > 0)


# ------------------------------------------------------------------- checks ----


def _check(x: Tensor, weight: Tensor, bias: Tensor | None, correction_bias: Tensor | None, kind: str, top_k: int,
           n_group: int, topk_group: int, logits_dtype: torch.dtype, weights_dtype: torch.dtype) -> None:
    torch._check(kind in ROUTER_KINDS, lambda: f"kind must be one of {ROUTER_KINDS}, got {kind!r}")
    torch._check(x.dim() == 2, lambda: f"x must be [T, H], got {tuple(x.shape)}")
    torch._check(weight.dim() == 2 and weight.shape[1] == x.shape[1],
                 lambda: f"weight must be [E, {x.shape[1]}], got {tuple(weight.shape)}")
    for name, t in (("x", x), ("weight", weight), ("bias", bias), ("correction_bias", correction_bias)):
        torch._check(t is None or t.dtype in _FLOATS, lambda: f"{name} must be floating point, got {t.dtype}")
    torch._check(logits_dtype in _FLOATS and weights_dtype in _FLOATS,
                 lambda: f"logits_dtype and weights_dtype must be floating point, got {logits_dtype}, {weights_dtype}")
    E = weight.shape[0]
    torch._check(1 <= top_k <= E, lambda: f"top_k = {top_k} outside [1, {E} experts]")
    torch._check(bias is None or tuple(bias.shape) == (E,), lambda: f"bias must be [{E}], got {tuple(bias.shape)}")
    torch._check(correction_bias is None or kind == "sigmoid",
                 lambda: f"a correction bias belongs to the sigmoid router, not {kind!r}")
    torch._check(correction_bias is None or tuple(correction_bias.shape) == (E,),
                 lambda: f"correction_bias must be [{E}], got {tuple(correction_bias.shape)}")
    torch._check(n_group == 1 or kind == "sigmoid",
                 lambda: f"group-limited top-k belongs to the sigmoid router, not {kind!r}")
    torch._check(n_group >= 1 and E % n_group == 0, lambda: f"{E} experts do not split into {n_group} groups")
    torch._check(n_group == 1 or E // n_group >= 2,
                 lambda: "groups need two experts or more (their score is a top-2 sum)")
    torch._check(1 <= topk_group <= n_group, lambda: f"topk_group = {topk_group} outside [1, {n_group}]")
    torch._check(top_k <= topk_group * (E // n_group),
                 lambda: f"top_k = {top_k} exceeds the {topk_group * (E // n_group)} experts of the chosen groups")


# ----------------------------------------------------------------------- op ----


def _reference_out(x, weight, bias, correction_bias, kind, top_k, renormalize, n_group, topk_group, scaling,
                   logits_dtype, weights_dtype):
    cd = torch.float64 if torch.float64 in (x.dtype, weight.dtype, logits_dtype) else torch.float32
    w, ids, logits = moe_router_reference(x, weight, bias, correction_bias, kind, top_k, renormalize, n_group,
                                          topk_group, scaling, logits_dtype, weights_dtype, cd)
    return w.contiguous(), ids.contiguous(), logits.contiguous()


@torch.library.custom_op("fusepass::moe_router", mutates_args=())
def moe_router(x: Tensor, weight: Tensor, bias: Tensor | None, correction_bias: Tensor | None, kind: str, top_k: int,
               renormalize: bool, n_group: int, topk_group: int, scaling: float, logits_dtype: torch.dtype,
               weights_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """(topk_weights, topk_ids, logits) of an MoE router (module docstring).
    This body serves CPU and every non-CUDA device."""
    _check(x, weight, bias, correction_bias, kind, top_k, n_group, topk_group, logits_dtype, weights_dtype)
    return _reference_out(x, weight, bias, correction_bias, kind, top_k, renormalize, n_group, topk_group, scaling,
                          logits_dtype, weights_dtype)


@moe_router.register_fake
def _moe_router_fake(x, weight, bias, correction_bias, kind, top_k, renormalize, n_group, topk_group, scaling,
                     logits_dtype, weights_dtype):
    _check(x, weight, bias, correction_bias, kind, top_k, n_group, topk_group, logits_dtype, weights_dtype)
    T, E = x.shape[0], weight.shape[0]
    return (x.new_empty((T, top_k), dtype=weights_dtype), x.new_empty((T, top_k), dtype=torch.int64),
            x.new_empty((T, E), dtype=logits_dtype))


@moe_router.register_kernel("cuda")
def _moe_router_cuda(x, weight, bias, correction_bias, kind, top_k, renormalize, n_group, topk_group, scaling,
                     logits_dtype, weights_dtype):
    _check(x, weight, bias, correction_bias, kind, top_k, n_group, topk_group, logits_dtype, weights_dtype)
    args = (x, weight, bias, correction_bias, kind, top_k, renormalize, n_group, topk_group, scaling, logits_dtype,
            weights_dtype)
    if not _kernel_ok(x, weight, kind, n_group):  # fp64, more than 1024 experts: the reference
        return _reference_out(*args)
    return run_kernel("moe_router", lambda: router_fwd(*args), lambda: _reference_out(*args))


register_inline(torch.ops.fusepass.moe_router.default, _inline_ok, router_traced)
