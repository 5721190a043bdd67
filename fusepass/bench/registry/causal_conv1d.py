"""The GDN layer's short convolution: transformers' ``causal_conv1d_fn`` /
``causal_conv1d_update`` (the torch path, taken without the ``causal_conv1d``
package) against ``fusepass::causal_conv1d`` / ``causal_conv1d_update``,
Qwen3.5-9B's shape: 8192 channels (q, k: 16 heads x 128; v: 32 x 128),
kernel 4, bf16, x the transpose of the [B, T, C] projection as the model
passes it.  Memory-bound: bytes = x read + out written (+ the state read and
written in decode).

    fusepass bench --ops causal_conv1d
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import fusepass.kernels.causal_conv1d as cc
from fusepass.bench.registry.common import Case, compiled, nbytes

DTYPE = torch.bfloat16
C, K = 8192, 4
PREFILL = [(1, 2048), (1, 8192), (8, 512)]  # (B, T)
DECODE = [1, 32]  # B


def _hf():
    try:
        from transformers.models.qwen3_5 import modeling_qwen3_5 as m
    except ImportError:
        return cc.causal_conv1d_reference, cc.causal_conv1d_update_reference
    unwrap = lambda f: getattr(f, "__wrapped__", f)  # noqa: E731 - the hub wrapper may route to a package
    return unwrap(m.causal_conv1d_fn), unwrap(m.causal_conv1d_update)


def _prefill_case(B, T, device) -> Case:
    hf_fn, _ = _hf()

    def make():
        x = torch.randn(B, T, C, device=device, dtype=DTYPE).transpose(1, 2)
        w = (torch.randn(C, K, device=device) * 0.5).to(DTYPE)
        return x, w

    def hf_call(x, w):
        return hf_fn(x, w, None, activation="silu")

    meta = torch.empty(B, C, T, dtype=DTYPE, device="meta")
    return Case(
        op="causal_conv1d", shape=f"B{B}-T{T}-C{C}-K{K}", dtype=DTYPE, make_inputs=make,
        reference=lambda x, w: cc.causal_conv1d_reference(x.float(), w.float(), None, "silu"),
        providers={"eager": hf_call, "inductor": compiled(hf_call),
                   "fusepass": lambda x, w: torch.ops.fusepass.causal_conv1d(x, w, None, "silu")},
        bytes_moved=nbytes(meta, meta),
    )


def _own_state(fn):
    """``fn`` on its own copy of the state, made at the first call: transformers'
    update shifts the state it is given, and every provider must start from
    the case's.  Later calls shift the copy again (the same work per call)."""
    box = []

    def call(x, state, w):
        if not box:
            box.append(state.clone())
        return fn(x, box[0], w)
    return call


def _decode_case(B, device) -> Case:
    _, hf_update = _hf()

    def make():
        x = torch.randn(B, 1, C, device=device, dtype=DTYPE).transpose(1, 2)
        state = torch.randn(B, C, K, device=device, dtype=DTYPE)
        w = (torch.randn(C, K, device=device) * 0.5).to(DTYPE)
        return x, state, w

    def hf_call(x, state, w):
        return hf_update(x, state, w, None, "silu")

    def reference(x, state, w):
        return cc.causal_conv1d_update_reference(x.float(), state.float(), w.float(), None, "silu")[0]

    meta_x = torch.empty(B, C, 1, dtype=DTYPE, device="meta")
    meta_s = torch.empty(B, C, K, dtype=DTYPE, device="meta")
    return Case(
        op="causal_conv1d", shape=f"decode-B{B}-C{C}-K{K}", dtype=DTYPE, make_inputs=make, reference=reference,
        providers={"eager": _own_state(hf_call), "inductor": _own_state(compiled(hf_call)),
                   "fusepass": lambda x, s, w: torch.ops.fusepass.causal_conv1d_update(x, s, w, None, "silu")[0]},
        bytes_moved=2 * nbytes(meta_x) + 2 * nbytes(meta_s),
    )


def cases(quick: bool = False, device: str = "cuda") -> list[Case]:
    if device != "cuda":
        global C
        C = 64  # the CPU's smoke run
        return [_prefill_case(1, 33, device), _decode_case(2, device)]
    prefill = PREFILL[:1] if quick else PREFILL
    decode = DECODE[:1] if quick else DECODE
    return [_prefill_case(B, T, device) for B, T in prefill] + [_decode_case(B, device) for B in decode]


_ = F  # torch.nn.functional: transformers' functions use it
