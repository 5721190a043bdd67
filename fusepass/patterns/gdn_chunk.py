"""Gated DeltaNet, chunked (prefill) -> ``fusepass::gdn_chunk``.

Per value head, state S (d_k x d_v, fp32), q scaled and, optionally, q and k
L2-normalised; for each token t:

    S <- exp(g_t) S ;  S <- S + beta_t k_t (v_t - S^T k_t)^T ;  o_t = S^T q_t

computed chunk by chunk as ``transformers``' ``torch_chunk_gated_delta_rule``
does: the within-chunk system solved with ``linalg.solve_triangular``
(5.17 and later) or with the older forward-substitution row loop (5.16 and
earlier, and ``torch.export`` traces), then one state update per chunk.
Dynamo unrolls the chunk loop, so the region is found by dataflow around the
cumulative decay (``cumsum``) and accepted only if it equals the op on random
inputs (see :mod:`fusepass.patterns._gdn`).  Calls of the known
``transformers`` functions usually never reach this rule: the pre-trace path
(:mod:`fusepass.pretrace`) routes them to the op before Dynamo traces them.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch
import torch.nn.functional as F

from fusepass.kernels.gdn import gdn_chunk
from fusepass.patterns import _gdn
from fusepass.rule import Form, NearMiss, Rule

aten = torch.ops.aten
L2_EPS = 1e-6

# The forms' (and near-misses') chunk: 16 tokens, so that the examples and the
# differential's drawn shapes (up to 48 tokens) span several chunks.  A module
# global, not a context variable: Dynamo reads a global (and guards on it).
CHUNK = 16


@contextlib.contextmanager
def forms_chunk(size: int) -> Iterator[None]:
    """Run (or trace) the forms at chunks of ``size`` tokens instead of :data:`CHUNK`.

    Fed an infinity, the chunked rule's NaNs depend on the chunking: the
    triangular matrices' zeros times it (0 * inf) reach every earlier token of
    its chunk.  The differential checker recomputes a step of these forms at
    the op's chunk (64) to know the op's answer there (see
    ``fusepass.testing.differential.check``)."""
    global CHUNK
    before, CHUNK = CHUNK, size
    try:
        yield
    finally:
        CHUNK = before


def _prep(q, k, v, g, beta, scale_keys=False, divide=False):
    """Grouped heads repeated, [B, H, T, D] in fp32, q and k L2-normalised, q (or k) scaled
    (times d^-0.5, or divided by d^0.5 as the token loop writes it)."""
    r = v.shape[2] // q.shape[2]
    if r > 1:
        q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)
    q, k, v, g, beta = (t.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                        for t in (q, k, v, g, beta))
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + L2_EPS)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + L2_EPS)
    scale = q.shape[-1] ** -0.5
    if divide:
        return (q / q.shape[-1] ** 0.5, k), v, g, beta
    return (q, k * scale) if scale_keys else (q * scale, k), v, g, beta


def chunked(q, k, v, g, beta, state=None, *, size=None, solve=True, decay=torch.exp, use_beta=True,
            carry=True, scale_keys=False, row_factor=None):
    """The chunked gated delta rule (and, through its switches, the near-misses); chunks of
    ``size`` tokens, :data:`CHUNK` by default."""
    size = CHUNK if size is None else size
    dtype, (B, T) = q.dtype, q.shape[:2]
    (q, k), v, g, beta = _prep(q, k, v, g, beta, scale_keys)
    H, dk, dv = v.shape[1], k.shape[-1], v.shape[-1]
    pad = (size - T % size) % size
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    n = (T + pad) // size
    kb, vb = (k * beta[..., None], v * beta[..., None]) if use_beta else (k, v)
    q, k, kb, vb = (t.reshape(B, H, n, size, t.shape[-1]) for t in (q, k, kb, vb))
    c = g.reshape(B, H, n, size).cumsum(-1)
    upper = torch.ones(size, size, dtype=torch.bool, device=q.device).triu(1)
    pair = decay((c[..., :, None] - c[..., None, :]).masked_fill(upper, float("-inf")))
    system = (kb @ k.transpose(-1, -2)) * pair
    attn = (q @ k.transpose(-1, -2)) * pair
    kd = kb * decay(c)[..., None]
    if solve:
        u = torch.linalg.solve_triangular(system, vb, upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(system, kd, upper=False, unitriangular=True)
    else:  # forward substitution, one row at a time: (I + strictly_lower(system))^-1
        inv = -system.tril(-1)
        for i in range(1, size):
            row, sub = inv[..., i, :i].clone(), inv[..., :i, :i].clone()
            corr = (row[..., None] * sub).sum(-2)
            inv[..., i, :i] = row + (corr * row_factor if row_factor is not None and i == 3 else corr)
        inv = inv + torch.eye(size, dtype=inv.dtype, device=inv.device)
        u, w = inv @ vb, inv @ kd
    S0 = torch.zeros(B, H, dk, dv, dtype=torch.float32, device=q.device) if state is None else state.to(u)
    S, o = S0, torch.zeros_like(u)
    qd = q * decay(c)[..., None]
    kr = k * decay(c[..., -1:] - c)[..., None]
    cd = decay(c[..., -1])[..., None, None]
    for i in range(n):
        vn = u[:, :, i] - w[:, :, i] @ S
        o[:, :, i] = qd[:, :, i] @ S + attn[:, :, i] @ vn
        nxt = S * cd[:, :, i] + kr[:, :, i].transpose(-1, -2) @ vn
        S = nxt if carry else S0
    o = o.reshape(B, H, -1, dv)[:, :, :T]
    return o.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format), (nxt if not carry else S)


def search_solve(q, k, v, g, beta, initial_state):
    return chunked(q, k, v, g, beta, initial_state)


def search_row_loop(q, k, v, g, beta, initial_state):
    return chunked(q, k, v, g, beta, initial_state, solve=False)


def replace(q, k, v, g, beta, initial_state=None):
    return gdn_chunk(q, k, v, g, beta, initial_state, True, q.shape[-1] ** -0.5)


def sized(dtype, B=1, T=20, Hk=2, Hv=4, D=8, state=True):
    """q, k, v, g (fp32 log decay), beta (sigmoid, in the model dtype)[, initial state fp32]."""
    q, k = (torch.randn(B, T, Hk, D, dtype=dtype) for _ in range(2))
    v = torch.randn(B, T, Hv, D, dtype=dtype)
    g = -(torch.rand(B, T, Hv) * 0.45 + 0.05)
    beta = torch.rand(B, T, Hv).to(dtype)
    return [q, k, v, g, beta] + ([torch.randn(B, Hv, D, D) * 0.5] if state else [])


def example_inputs(dtype):
    # T = 20 with 16-token chunks: two chunks, the second padded.
    return sized(dtype)


def sized_inputs(dtype, shape):
    """The differential generator's drawn (*leading, hidden) as a GDN shape:
    leading dims pick B and T (one to three chunks), the hidden size D."""
    lead = tuple(shape[:-1])
    T = (1 + (sum(lead) if lead else 1) % 3) * 16 - (shape[-1] % 5)
    return sized(dtype, B=1 + (lead[0] % 2 if lead else 0), T=max(T, 1), D=(8, 16)[shape[-1] % 2])


def form(body: _gdn.Body) -> str | None:
    if not (_gdn.reads_gate(body, body.anchor) and _gdn.has(body, aten.bmm.default)):
        return None
    return "solve_triangular" if _gdn.has(body, aten.linalg_solve_triangular.default) else "row_loop"


def find(gm):
    return _gdn.find(gm, anchor_op=aten.cumsum.default, op=torch.ops.fusepass.gdn_chunk, form=form,
                     op_name="gdn_chunk")


def _near_miss_inputs(dtype):
    return sized(dtype, state=False)


RULE = Rule(
    name="gdn_chunk",
    forms=[Form("solve_triangular", search_solve, replace), Form("row_loop", search_row_loop, replace)],
    example_inputs=example_inputs,
    dtypes=(torch.float32, torch.bfloat16),
    find=find,
    check=_gdn.check,
    pretraced=(torch.ops.fusepass.gdn_chunk.default,),
    # Before the norm rules: the region's L2 norms are its own.
    priority=20,
    near_misses=[
        NearMiss("sigmoid decay", functools.partial(chunked, decay=torch.sigmoid), _near_miss_inputs,
                 "does not compute fusepass::gdn_chunk"),
        NearMiss("no beta", functools.partial(chunked, use_beta=False), _near_miss_inputs, "no beta"),
        NearMiss("state not carried", functools.partial(chunked, carry=False), _near_miss_inputs,
                 "does not compute fusepass::gdn_chunk"),
        NearMiss("keys scaled", functools.partial(chunked, scale_keys=True), _near_miss_inputs,
                 "does not compute fusepass::gdn_chunk"),
        # One row of the forward substitution's correction doubled: off on that
        # row's outputs only, which the region's check must still see.
        NearMiss("one row's correction doubled", functools.partial(chunked, solve=False, row_factor=2.0),
                 _near_miss_inputs, "does not compute fusepass::gdn_chunk"),
    ],
    sized_inputs=sized_inputs,
    doc=__doc__,
)
