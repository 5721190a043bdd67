"""Gated DeltaNet, token by token (cached decode) -> ``fusepass::gdn_recurrent``.

The same recurrence as ``gdn_chunk`` (see there), written as
``transformers``' ``torch_recurrent_gated_delta_rule`` does: one state decay,
one delta update and one read per token, with q divided by sqrt(d_k).  A
cached decode step calls it with T = 1 and the cache's state.  Found by
dataflow around ``exp`` of the decay (or another function of it: a near-miss
to explain), with no ``bmm`` and no ``cumsum`` in
the region (those are the chunked form's), and accepted only if it equals the
op on random inputs (see :mod:`fusepass.patterns._gdn`).
"""

from __future__ import annotations

import functools

import torch

from fusepass.kernels.gdn import gdn_recurrent
from fusepass.patterns import _gdn
from fusepass.patterns.gdn_chunk import _prep, sized
from fusepass.rule import Form, NearMiss, Rule

aten = torch.ops.aten


def recurrent(q, k, v, g, beta, state=None, *, decay=torch.exp, use_beta=True, carry=True):
    dtype, T, dk = q.dtype, q.shape[1], q.shape[-1]
    (q, k), v, g, beta = _prep(q, k, v, g, beta, divide=True)
    B, H, _, dv = v.shape
    S0 = torch.zeros(B, H, dk, dv, dtype=torch.float32, device=v.device) if state is None else state.to(v)
    S, o = S0, torch.zeros_like(v)
    for t in range(T):
        S = (S if carry or t == 0 else S0) * decay(g[:, :, t])[..., None, None]
        read = (S * k[:, :, t, :, None]).sum(-2)
        delta = (v[:, :, t] - read) * (beta[:, :, t, None] if use_beta else 1.0)
        S = S + k[:, :, t, :, None] * delta[..., None, :]
        o[:, :, t] = (S * q[:, :, t, :, None]).sum(-2)
    return o.transpose(1, 2).contiguous().to(dtype), S


def search(q, k, v, g, beta, initial_state):
    return recurrent(q, k, v, g, beta, initial_state)


def replace(q, k, v, g, beta, initial_state=None):
    return gdn_recurrent(q, k, v, g, beta, initial_state, True, q.shape[-1] ** -0.5)


def example_inputs(dtype):
    return sized(dtype, T=3)


def sized_inputs(dtype, shape):
    """(*leading, hidden) as a decode shape: B from the leading dims, T = 1 or 2, D from the hidden size."""
    lead = tuple(shape[:-1])
    return sized(dtype, B=1 + (lead[0] % 3 if lead else 0), T=1 + shape[-1] % 2, D=(8, 16)[shape[-1] % 2])


def form(body: _gdn.Body) -> str | None:
    if _gdn.has(body, aten.bmm.default, aten.cumsum.default) or not _gdn.reads_gate(body, body.anchor):
        return None
    return "token_loop"


def find(gm):
    return _gdn.find(gm, anchor_op=(aten.exp.default, aten.sigmoid.default), op=torch.ops.fusepass.gdn_recurrent, form=form,
                     op_name="gdn_recurrent")


def _inputs(dtype):
    return sized(dtype, T=3)


RULE = Rule(
    name="gdn_recurrent",
    forms=[Form("token_loop", search, replace)],
    example_inputs=example_inputs,
    dtypes=(torch.float32, torch.bfloat16),
    find=find,
    check=_gdn.check,
    pretraced=(torch.ops.fusepass.gdn_recurrent.default,),
    priority=19,
    near_misses=[
        NearMiss("sigmoid decay", functools.partial(recurrent, decay=torch.sigmoid), _inputs,
                 "does not compute fusepass::gdn_recurrent"),
        NearMiss("no beta", functools.partial(recurrent, use_beta=False), _inputs, "no beta"),
        NearMiss("state not carried", functools.partial(recurrent, carry=False), _inputs,
                 "does not compute fusepass::gdn_recurrent"),
    ],
    sized_inputs=sized_inputs,
    doc=__doc__,
)
