"""Attention of a decode step over its key/value cache -> ``fusepass::decode_attention``.

    out = F.scaled_dot_product_attention(q, repeat_kv(k), repeat_kv(v), attn_mask=mask)

with q [B, H, T, D] of a few rows (one a step, a few with speculative
tokens; H / H_kv x T up to 64 rows a key/value head) and k, v the cache.
transformers' SDPA path repeats a grouped-query cache to H heads before
SDPA whenever it passes a mask (a static cache always does): a copy of
H / H_kv times the cache a layer and a step, which SDPA then reads again,
through kernels that tile 64 query rows.  The op reads each cache row once
for the heads that share it and skips the blocks the mask hides entirely
(a static cache's unwritten slots).  Measured on the H200: BENCHMARKS.md.

Found in the post-grad graph at the SDPA op the trace chose
(``_scaled_dot_product_{cudnn,efficient,flash}_attention`` on CUDA,
``_scaled_dot_product_flash_attention_for_cpu`` on the CPU), taking only
its output; ``repeat_kv`` (unsqueeze, expand, clone, reshape) is looked
through, so k and v go to the op as stored.  Refused with a reason:
dropout, a head wider than 256, unequal key/value grouping, an fp64 or
mixed-dtype call, a mask that does not broadcast, SDPA's log-sum-exp read.
Left alone without a line: a prompt's calls (more than 64 rows a key/value
head, or SDPA's causal flag, which transformers sets from two rows on) and
symbolic sizes.

At one query row a head, where the cache SDPA reads is the step's write as
a static cache traces it (``index_put(cache, [None, None, slots], new)`` of
a graph input that the graph's end copies back, for both caches at the same
slots, read by nothing else), the region takes the writes and the copies
back too and the op becomes ``fusepass::decode_attention_write``, which
stores the new rows in place in its own launch: Inductor's write kernel a
layer goes (H200, Qwen3-30B-A3B 8 layers int4, replayed step: 478.8 against
496.7 µs).  Only where the graph's op calls stay calls (CUDA graphs, the
CPU): inlined launches cannot mutate a graph input here, and the op call
would cost host time a layer.  ``FUSEPASS_ATTENTION_WRITE=0`` leaves the
writes to Inductor.
"""

from __future__ import annotations

import math
import operator
import os

import torch
import torch.fx
import torch.nn.functional as F

from fusepass.kernels._common import inline_planned
from fusepass.kernels.decode_attention import MAX_DIM, MAX_ROWS, decode_attention_call
from fusepass.match import arguments
from fusepass.patterns._linear import is_call, val
from fusepass.rule import Form, NearMiss, Region, Rule

aten = torch.ops.aten
DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# SDPA's backend ops: (op, the name of its mask argument or None)
SDPA = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: "attn_mask",
    aten._scaled_dot_product_efficient_attention.default: "attn_bias",
    aten._scaled_dot_product_flash_attention.default: None,
}
if hasattr(aten, "_scaled_dot_product_cudnn_attention"):
    SDPA[aten._scaled_dot_product_cudnn_attention.default] = "attn_bias"


def repeat_kv(x, n):
    """transformers' repeat_kv: [B, H_kv, L, D] -> [B, H_kv * n, L, D], each head n times in a row."""
    B, H, L, D = x.shape
    return x[:, :, None, :, :].expand(B, H, n, L, D).reshape(B, H * n, L, D)


def search_gqa(q, k, v, mask):
    n = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, repeat_kv(k, n), repeat_kv(v, n), attn_mask=mask)


def _additive(mask, dtype):
    """A boolean mask as the additive one transformers' eager masks are (the dtype's min where hidden)."""
    return torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)


def search_additive(q, k, v, mask):
    n = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, repeat_kv(k, n), repeat_kv(v, n), attn_mask=_additive(mask, q.dtype),
                                          scale=0.3)


def replace_gqa(q, k, v, mask):
    return decode_attention_call(q, k, v, mask, 1.0 / math.sqrt(q.shape[-1])).transpose(1, 2)


def replace_additive(q, k, v, mask):
    return decode_attention_call(q, k, v, _additive(mask, q.dtype), 0.3).transpose(1, 2)


def example_inputs(dtype):
    return sized_inputs(dtype, (1, 32))


def sized_inputs(dtype, shape):
    """q [B, 8, T, D] of one or two rows, a cache k, v [B, H_kv, L, D] (H_kv 2 or 8: grouped or
    multi-head) and a boolean mask [B, 1, T, L] (a static cache written up to a point, the slots after
    it hidden), from (*leading, hidden)."""
    B = 1 + (shape[0] % 2 if len(shape) > 1 else 0)
    D = max(8, min(shape[-1], 64) // 8 * 8)
    T, L, Hkv = 1 + shape[-1] % 2, 40 + shape[-1] % 29, 2 if shape[-1] % 3 else 8
    written = L - 7
    mask = torch.arange(L)[None, None, None, :] < (written - T + 1 + torch.arange(T))[None, None, :, None]
    return [torch.randn(B, 8, T, D, dtype=dtype), torch.randn(B, Hkv, L, D, dtype=dtype),
            torch.randn(B, Hkv, L, D, dtype=dtype), mask.expand(B, 1, T, L).clone()]


# -- the rule's find ------------------------------------------------------------------------


def _only_user(n: torch.fx.Node) -> bool:
    return len(n.users) == 1


def _unrepeat(n):
    """(cache, n_rep, nodes) of ``repeat_kv(cache, n_rep)`` as traced (unsqueeze(2) / slice + None ->
    expand -> clone -> reshape), or (n, 1, []) when ``n`` is not one."""
    nodes = []
    r = n
    if not (is_call(r, aten.view.default) or is_call(r, aten.reshape.default) or is_call(r, aten._unsafe_view.default)):
        return n, 1, []
    nodes.append(r)
    c = r.args[0]
    if is_call(c, aten.clone.default):
        nodes.append(c)
        c = c.args[0]
    if not is_call(c, aten.expand.default):
        return n, 1, []
    nodes.append(c)
    u = c.args[0]
    if not (is_call(u, aten.unsqueeze.default) and u.args[1] == 2):
        return n, 1, []
    nodes.append(u)
    src = u.args[0]
    sv, ev, rv = val(src), val(c), val(r)
    if not (isinstance(sv, torch.Tensor) and sv.dim() == 4 and ev.dim() == 5 and rv.dim() == 4):
        return n, 1, []
    B, Hkv, L, D = sv.shape
    rep = ev.shape[2]
    if tuple(ev.shape) != (B, Hkv, rep, L, D) or tuple(rv.shape) != (B, Hkv * rep, L, D):
        return n, 1, []
    # (intermediates with other readers stay in the graph; only the chain's own nodes go)
    chain = []
    for x in nodes:
        if not _only_user(x):
            break
        chain.append(x)
    return src, rep, chain


def _written(cache_read: torch.fx.Node, consumer: torch.fx.Node):
    """(cache, slots, new rows, copy-back node) where ``cache_read`` is the step's cache write as traced,
    ``index_put(cache, [None, None, slots], new)`` of a graph input that the graph's end copies back
    (``copy_(cache, index_put)``), read by ``consumer`` (SDPA or the head of its repeat_kv chain) and
    nothing else; else None."""
    if not is_call(cache_read, aten.index_put.default):
        return None
    cache, indices, new = cache_read.args[:3]
    accumulate = cache_read.args[3] if len(cache_read.args) > 3 else cache_read.kwargs.get("accumulate", False)
    if accumulate or not isinstance(cache, torch.fx.Node) or cache.op != "placeholder":
        return None
    if not (isinstance(indices, (list, tuple)) and len(indices) == 3 and indices[0] is None and indices[1] is None
            and isinstance(indices[2], torch.fx.Node)):
        return None
    back = [u for u in cache_read.users if is_call(u, aten.copy_.default) and u.args[0] is cache
            and u.args[1] is cache_read]
    if len(back) != 1 or set(cache_read.users) != {back[0], consumer} or set(cache.users) != {cache_read, back[0]}:
        return None
    return cache, indices[2], new, back[0]


# FUSEPASS_ATTENTION_WRITE=0 leaves the step's cache writes to Inductor (an A/B in a model's step, one
# process each; read once, at import).
_WRITE = os.environ.get("FUSEPASS_ATTENTION_WRITE", "1") != "0"


def _cache_write(node, q, k, v, kn, vn):
    """(k cache, v cache, k rows, v rows, slots, the two writes, their two copy-backs) where SDPA's key and
    value are a one-row step's writes of the same slots into two caches (see ``_written``), so that the op
    can write them itself; else None."""
    if not _WRITE or (inline_planned() and val(q).device.type == "cuda"):
        return None  # (inlined launches: a call through the dispatcher a layer would cost more host time)
    kw, vw = _written(k, kn[-1] if kn else node), _written(v, vn[-1] if vn else node)
    if kw is None or vw is None or kw[1] is not vw[1] or kw[0] is vw[0]:
        return None
    qv, slots = val(q), val(kw[1])
    if qv.shape[2] != 1 or not isinstance(slots, torch.Tensor) or tuple(slots.shape) != (1,):
        return None
    kc, vc, knew, vnew = (val(x) for x in (kw[0], vw[0], kw[2], vw[2]))
    if not (tuple(knew.shape) == (kc.shape[0], kc.shape[1], 1, kc.shape[3])
            and tuple(vnew.shape) == (vc.shape[0], vc.shape[1], 1, vc.shape[3])
            and knew.dtype == kc.dtype == qv.dtype and vnew.dtype == vc.dtype == qv.dtype
            and slots.dtype in (torch.int64, torch.int32)):
        return None
    return kw[0], vw[0], kw[2], vw[2], kw[1], [k, v], [kw[3], vw[3]]


def _refusal(node: torch.fx.Node, a: dict, q, k, v, mask_name) -> str | None:
    qv, kv_, vv = val(q), val(k), val(v)
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (qv, kv_, vv)):
        return ""
    B, H, T, D = qv.shape
    if not all(isinstance(s, int) for s in (H, T, D, kv_.shape[1], kv_.shape[2], vv.shape[3])):
        return ""  # a symbolic size: left to SDPA
    if H * T > 4096 or T > MAX_ROWS or kv_.shape[2] == 0:
        return ""  # a prefill (or an empty cache): SDPA's
    if a.get("dropout_p", 0.0) != 0.0:
        return "dropout"
    if a.get("is_causal", False):
        return ""  # SDPA's causal flag is a prompt's (transformers sets it from two rows on): not a decode step
    if a.get("return_debug_mask", False):
        return "the debug mask is asked for"
    if qv.dtype not in DTYPES or kv_.dtype != qv.dtype or vv.dtype != qv.dtype:
        return f"dtypes q {qv.dtype}, k {kv_.dtype}, v {vv.dtype}"
    if qv.device.type not in ("cuda", "cpu"):
        return f"on {qv.device.type}"
    if D > MAX_DIM or vv.shape[3] > MAX_DIM:
        return f"head dim {max(D, vv.shape[3])} (the kernel takes up to {MAX_DIM})"
    if mask_name is not None and a.get(mask_name) is not None:
        mv = val(a[mask_name])
        if not isinstance(mv, torch.Tensor) or mv.dtype not in (torch.bool, qv.dtype):
            return "a mask of another dtype"
        try:
            torch.broadcast_shapes(tuple(mv.shape), (B, H, T, kv_.shape[2]))
        except RuntimeError:
            return f"mask {tuple(mv.shape)} does not broadcast to the scores"
    return None


def find(gm: torch.fx.GraphModule):
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in SDPA:
            continue
        mask_name = SDPA[node.target]
        a = arguments(node)
        q, k, v = a["query"], a["key"], a["value"]
        reason = _refusal(node, a, q, k, v, mask_name)
        if reason == "":
            continue
        if reason:
            yield Region("sdpa", node, reason=reason)
            continue
        users = list(node.users)
        if not (all(is_call(u, operator.getitem) for u in users)
                and all(u.args[1] == 0 or not u.users for u in users)):
            yield Region("sdpa", node, reason="SDPA's log-sum-exp is read (a training graph saves it for the backward)")
            continue
        out = next((u for u in users if u.args[1] == 0), None)
        if out is None:
            continue
        k2, rk, kn = _unrepeat(k)
        v2, rv, vn = _unrepeat(v)
        qv, kv_ = val(q), val(k2)
        H = qv.shape[1]
        # (k and v as stored may also reach SDPA grouped, with enable_gqa: query head h reads key/value head
        # h // (H / H_kv) either way, as repeat_interleave gives)
        if rk != rv or val(v2).shape[1] != kv_.shape[1] or H % kv_.shape[1]:
            yield Region("sdpa", node, reason=f"keys repeated {rk}x and values {rv}x for {H} query heads")
            continue
        if (H // kv_.shape[1]) * qv.shape[2] > MAX_ROWS:
            continue  # more rows a key/value head than one tile: SDPA's
        mask = a.get(mask_name) if mask_name else None
        scale = a.get("scale")
        if scale is not None and not isinstance(scale, (int, float)):
            yield Region("sdpa", node, reason="a scale known only at run time")
            continue
        scale = 1.0 / math.sqrt(qv.shape[-1]) if scale is None else float(scale)
        ov = val(out)
        # the op writes [B, T, H, Dv]; SDPA's output here had the strides the graph's views were traced for
        bshd = ov.stride() == (ov.shape[1] * ov.shape[2] * ov.shape[3], ov.shape[3], ov.shape[1] * ov.shape[3], 1)
        # (SDPA's unread outputs go with it; the repeat_kv chains too, where nothing else reads them: listed
        # producers first, as the replacement erases the region's nodes last to first once unread)
        nodes = [*reversed(kn), *reversed(vn), node, *users]
        form = "gqa" if kv_.shape[1] < H else "mha"
        write = _cache_write(node, q, k2, v2, kn, vn)
        if write is not None:
            # The step's cache write goes into the op (a launch of Inductor's less a layer); the copy-backs
            # at the graph's end go, as the op writes the graph's cache inputs in place.
            kc, vc, knew, vnew, slots, puts, backs = write
            nodes = [*puts, *nodes, *backs]
            args = [q, kc, vc, knew, vnew, slots]
            names = ["q", "k_cache", "v_cache", "k_new", "v_new", "slots"]
            form += "+write"
        else:
            args, names = [q, k2, v2], ["q", "k", "v"]
        if mask is not None:
            args, names = args + [mask], names + ["mask"]
        yield Region(form, node, nodes, [out], args, _replace(scale, mask is not None, bshd, write is not None),
                     names=names, arguments_checked=True)


def _replace(scale: float, has_mask: bool, bshd: bool, write: bool = False):
    def masked(q, k, v, mask):
        o = decode_attention_call(q, k, v, mask, scale).transpose(1, 2)
        return o if bshd else o.contiguous()

    def unmasked(q, k, v):  # (the replacement is traced with exactly the region's arguments)
        return masked(q, k, v, None)

    def written(q, k, v, k_new, v_new, slots, mask):
        o = torch.ops.fusepass.decode_attention_write.default(q, k, v, k_new, v_new, slots, mask, scale)
        o = o.transpose(1, 2)
        return o if bshd else o.contiguous()

    def written_unmasked(q, k, v, k_new, v_new, slots):
        return written(q, k, v, k_new, v_new, slots, None)

    if write:
        return written if has_mask else written_unmasked
    return masked if has_mask else unmasked


# -- near-misses ------------------------------------------------------------------------------


def _causal(q, k, v, mask):  # SDPA's causal flag: top-left aligned, not a decode step's mask
    n = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, repeat_kv(k, n), repeat_kv(v, n), is_causal=True)


def _prefill(q, k, v, mask):  # a prompt's 80 rows a head: SDPA's
    n = q.shape[1] // k.shape[1]
    q = torch.cat([q] * 80, dim=2)[:, :, :80]
    return F.scaled_dot_product_attention(q, repeat_kv(k, n), repeat_kv(v, n))


RULE = Rule(
    name="decode_attention",
    forms=[Form("gqa", search_gqa, replace_gqa), Form("additive", search_additive, replace_additive)],
    example_inputs=example_inputs,
    find=find,
    dtypes=(torch.float32, torch.bfloat16),
    sized_inputs=sized_inputs,
    near_misses=[
        NearMiss("causal flag", _causal, example_inputs, ""),
        NearMiss("prefill rows", _prefill, example_inputs, ""),
    ],
    doc=__doc__,
)
