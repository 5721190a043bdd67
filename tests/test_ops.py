"""Every op under ``torch.ops.fusepass``: ``torch.library.opcheck``, the
fallback when its kernel fails, verify mode refusing a wrong rule, and a
compile after a CPU kernel registered over an op was removed again.

Op inputs come from the rules themselves (each form's ``replace`` run on its
example inputs, the op calls recorded) plus a small table of layouts and
dtypes the rules' examples do not reach.  An op that neither a rule nor the
table gives inputs for fails here: a new op needs at least one.
"""

from __future__ import annotations

import contextlib
import functools
import operator

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fusepass
from fusepass.testing import differential
from fusepass.kernels._common import clear_kernel_fallbacks, inject_failure, kernel_fallbacks, loosest
from fusepass.testing import CHECK_SCALAR, assert_close, compile_and_run, registered

OPS = differential.op_names()


class _Record(TorchDispatchMode):
    """Records every fusepass op call: (op name, args, kwargs)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple, dict]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "fusepass":
            self.calls.append((func._schema.name.split("::")[1], args, kwargs))
        return func(*args, **kwargs)


def _bound(rule, fn):
    return functools.partial(fn, **{name: CHECK_SCALAR for name in rule.scalars}) if rule.scalars else fn


@functools.cache
def rule_cases() -> dict[str, list[tuple[str, tuple, dict, tuple]]]:
    """op -> [(case id, args, kwargs, (rule, form, dtype))] from every rule's replacements."""
    out: dict[str, list] = {}
    for rule in fusepass.rules():
        for form in rule.forms:
            for dtype in rule.dtypes:
                torch.manual_seed(0)
                inputs = rule.inputs(form, dtype)
                with _Record() as rec:
                    _bound(rule, form.replace)(*inputs)
                for op, args, kwargs in rec.calls:
                    case = f"{rule.name}-{form.name}-{str(dtype).replace('torch.', '')}"
                    out.setdefault(op, []).append((case, args, kwargs, (rule.name, form.name, dtype)))
    return out


def _t(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


def _group():
    return torch.distributed.group.WORLD.group_name


def _eps64():
    """eps as dynamic=True passes it: a 0-dim fp64 CPU tensor (the ops' ``eps_tensor``)."""
    return torch.tensor(1e-5, dtype=torch.float64)


# Layouts and dtypes the rules' example inputs do not reach: leading dims,
# non-contiguous rows, fp64 (the ops serve it from the reference), empty rows.
TABLE: dict[str, list[tuple[str, callable]]] = {
    "rms_norm": [
        ("3d-bf16-offset", lambda: (_t(2, 3, 33, dtype=torch.bfloat16), _t(33, dtype=torch.bfloat16),
                                    1e-5, 1.0, False, torch.bfloat16)),
        ("transposed-fp32", lambda: (_t(7, 5).t(), _t(7), 1e-6, 0.0, False, torch.float32)),
        ("bf16-x-fp32-weight", lambda: (_t(4, 16, dtype=torch.bfloat16), _t(16), 1e-6, 0.0, True, torch.float32)),
        ("fp64", lambda: (_t(3, 9, dtype=torch.float64), _t(9, dtype=torch.float64), 1e-6, 0.0, False,
                          torch.float64)),
        ("empty-rows", lambda: (_t(0, 8), _t(8), 1e-6, 0.0, False, torch.float32)),
        ("eps-tensor-bf16", lambda: (_t(4, 16, dtype=torch.bfloat16), _t(16, dtype=torch.bfloat16), 0.0, 0.0,
                                     True, torch.bfloat16, _eps64())),
    ],
    "rms_norm_gated": [
        ("3d-bf16-cast-silu", lambda: (_t(2, 3, 33, dtype=torch.bfloat16), _t(2, 3, 33, dtype=torch.bfloat16),
                                       _t(33, dtype=torch.bfloat16), 1e-6, True, "silu")),
        ("sliced-gate-fp16-sigmoid", lambda: (_t(4, 16, dtype=torch.float16), _t(4, 19, dtype=torch.float16)[:, :16],
                                              _t(16, dtype=torch.float16), 1e-5, False, "sigmoid")),
        ("bf16-x-fp32-weight", lambda: (_t(5, 16, dtype=torch.bfloat16), _t(5, 16, dtype=torch.bfloat16), _t(16),
                                        1e-6, True, "silu")),
        ("fp64", lambda: (_t(3, 9, dtype=torch.float64), _t(3, 9, dtype=torch.float64), _t(9, dtype=torch.float64),
                          1e-6, True, "silu")),
        ("empty-rows", lambda: (_t(0, 8), _t(0, 8), _t(8), 1e-6, False, "silu")),
        ("eps-tensor-bf16", lambda: (_t(4, 16, dtype=torch.bfloat16), _t(4, 16, dtype=torch.bfloat16),
                                     _t(16, dtype=torch.bfloat16), 0.0, True, "silu", _eps64())),
    ],
    "add_rms_norm": [
        ("3d-fp16", lambda: (_t(2, 3, 33, dtype=torch.float16), _t(2, 3, 33, dtype=torch.float16),
                             _t(33, dtype=torch.float16), 1e-5, 0.0, True, torch.float16)),
        ("sliced-rows-fp32", lambda: (_t(4, 19)[:, :16], _t(4, 16), _t(16), 1e-6, 1.0, False, torch.float32)),
        ("fp64", lambda: (_t(3, 9, dtype=torch.float64), _t(3, 9, dtype=torch.float64),
                          _t(9, dtype=torch.float64), 1e-6, 0.0, False, torch.float64)),
        ("eps-tensor-bf16", lambda: (_t(4, 16, dtype=torch.bfloat16), _t(4, 16, dtype=torch.bfloat16),
                                     _t(16, dtype=torch.bfloat16), 0.0, 0.0, True, torch.bfloat16, _eps64())),
    ],
    "all_reduce_rms_norm": [  # the default group: one gloo rank (conftest), whose all-reduce is the identity
        ("3d-bf16-residual", lambda: (_t(2, 3, 33, dtype=torch.bfloat16), _t(2, 3, 33, dtype=torch.bfloat16),
                                      _t(33, dtype=torch.bfloat16), 1e-5, 0.0, True, torch.bfloat16, _group())),
        ("transposed-fp32-no-residual", lambda: (_t(7, 5).t(), None, _t(7), 1e-6, 1.0, False, torch.float32,
                                                 _group())),
        ("fp64", lambda: (_t(3, 9, dtype=torch.float64), _t(3, 9, dtype=torch.float64), _t(9, dtype=torch.float64),
                          1e-6, 0.0, False, torch.float64, _group())),
        ("empty-rows", lambda: (_t(0, 8), _t(0, 8), _t(8), 1e-6, 0.0, False, torch.float32, _group())),
        ("eps-tensor-fp16", lambda: (_t(4, 16, dtype=torch.float16), _t(4, 16, dtype=torch.float16),
                                     _t(16, dtype=torch.float16), 0.0, 0.0, True, torch.float16, _group(), _eps64())),
    ],
    "swiglu": [
        ("chunked-halves-bf16", lambda: _t(6, 2 * 33, dtype=torch.bfloat16).chunk(2, -1)),
        ("3d-fp16", lambda: (_t(2, 3, 7, dtype=torch.float16), _t(2, 3, 7, dtype=torch.float16))),
        ("fp64", lambda: (_t(5, 9, dtype=torch.float64), _t(5, 9, dtype=torch.float64))),
    ],
    "geglu": [
        ("chunked-halves-bf16-tanh", lambda: (*_t(6, 2 * 33, dtype=torch.bfloat16).chunk(2, -1), "tanh")),
        ("3d-fp16-erf", lambda: (_t(2, 3, 7, dtype=torch.float16), _t(2, 3, 7, dtype=torch.float16), "none")),
    ],
    "gdn_chunk": [
        ("B2-T19-Hk2-Hv4-dk8-dv12-state-bf16", lambda: _gdn_inputs(2, 19, 2, 4, 8, 12, torch.bfloat16, True)),
        ("B1-T5-H2-D16-fp32", lambda: _gdn_inputs(1, 5, 2, 2, 16, 16, torch.float32, False)),
        ("B1-T70-H1-D8-state-fp64", lambda: _gdn_inputs(1, 70, 1, 1, 8, 8, torch.float64, True)),
    ],
    "gdn_recurrent": [
        ("B2-T1-Hk2-Hv4-dk8-dv12-state-bf16", lambda: _gdn_inputs(2, 1, 2, 4, 8, 12, torch.bfloat16, True)),
        ("B1-T3-H2-D16-fp32", lambda: _gdn_inputs(1, 3, 2, 2, 16, 16, torch.float32, False)),
        ("B1-T2-H1-D8-state-fp64", lambda: _gdn_inputs(1, 2, 1, 1, 8, 8, torch.float64, True)),
    ],
    "causal_conv1d": [  # x [B, C, T] as the models pass it: the transpose of [B, T, C]
        ("B2-C40-T9-K4-bf16-silu", lambda: (_t(2, 9, 40, dtype=torch.bfloat16).transpose(1, 2),
                                            _t(40, 4, dtype=torch.bfloat16), None, "silu")),
        ("B1-C24-T5-K3-fp32-bias-noact", lambda: (_t(1, 24, 5), _t(24, 3), _t(24), None)),
        ("B1-C8-T4-K4-fp64", lambda: (_t(1, 4, 8, dtype=torch.float64).transpose(1, 2),
                                      _t(8, 4, dtype=torch.float64), None, "silu")),
    ],
    "causal_conv1d_update": [
        ("B2-C40-L1-S4-bf16", lambda: (_t(2, 1, 40, dtype=torch.bfloat16).transpose(1, 2),
                                       _t(2, 40, 4, dtype=torch.bfloat16), _t(40, 4, dtype=torch.bfloat16), None,
                                       "silu")),
        ("B1-C24-L2-S3-fp32-bias", lambda: (_t(1, 24, 2), _t(1, 24, 3), _t(24, 4), _t(24), "silu")),
    ],
    "moe_router": [
        ("T5-E8-softmax-renorm-bf16", lambda: (_t(5, 32, dtype=torch.bfloat16), _t(8, 32, dtype=torch.bfloat16), None,
                                               None, "softmax", 2, True, 1, 1, 1.0, torch.bfloat16, torch.bfloat16)),
        ("T3-E16-sigmoid-groups-fp32-weight", lambda: (_t(3, 32, dtype=torch.bfloat16), _t(16, 32), None,
                                                       torch.rand(16), "sigmoid", 4, True, 4, 2, 2.5, torch.float32,
                                                       torch.float32)),
        ("T4-E6-topk_softmax-bias-fp16", lambda: (_t(4, 24, dtype=torch.float16), _t(6, 24, dtype=torch.float16),
                                                  _t(6, dtype=torch.float16), None, "topk_softmax", 3, False, 1, 1,
                                                  1.0, torch.float16, torch.float16)),
        ("T0-bf16", lambda: (_t(0, 32, dtype=torch.bfloat16), _t(8, 32, dtype=torch.bfloat16), None, None, "softmax",
                             2, False, 1, 1, 1.0, torch.bfloat16, torch.float32)),
        ("fp64", lambda: (_t(3, 16, dtype=torch.float64), _t(8, 16, dtype=torch.float64), None, None, "softmax", 2,
                          True, 1, 1, 1.0, torch.float64, torch.float64)),
    ],
    "moe_experts": [
        # fp16 first (the Triton-path tests take the first entry): the
        # interpreter truncates fp32 -> bf16, and the block rounds ten times.
        ("T3-E4-k2-silu-fp16", lambda: _moe_experts_inputs(3, 4, 2, 32, 16, torch.float16)),
        ("T3-E4-k2-silu-bf16", lambda: _moe_experts_inputs(3, 4, 2, 32, 16, torch.bfloat16)),
        ("T2-E4-k2-gpt_oss-transposed-bias-fp32", lambda: _moe_experts_inputs(
            2, 4, 2, 32, 16, torch.float32, act="gpt_oss", layout="interleaved", transposed=True, bias=True)),
        ("T3-E4-k2-int8-bf16", lambda: _moe_experts_inputs(3, 4, 2, 32, 16, torch.bfloat16, fmt="int8")),
        ("T0-bf16", lambda: _moe_experts_inputs(0, 4, 2, 32, 16, torch.bfloat16)),
        ("fp64", lambda: _moe_experts_inputs(3, 4, 2, 16, 8, torch.float64)),
    ],
    "dequant_matmul": [
        ("int8-M3-N24-K32-bias-bf16", lambda: (_t(3, 32, dtype=torch.bfloat16),
                                               torch.randint(-128, 128, (24, 32), dtype=torch.int8),
                                               torch.rand(24, dtype=torch.bfloat16), None,
                                               _t(24, dtype=torch.bfloat16), "int8", 0)),
        ("int4-g32-M2x3-N16-K64-fp16", lambda: (_t(2, 3, 64, dtype=torch.float16),
                                                torch.randint(0, 256, (16, 32), dtype=torch.uint8),
                                                torch.rand(16, 2, dtype=torch.float16),
                                                torch.rand(16, 2, dtype=torch.float16) * 15, None, "int4", 32)),
        # (fp8 weights: opcheck's schema check multiplies its inputs, which CPU
        # torch 2.13 cannot do in float8_e4m3fn; tests/test_dequant_matmul_kernels.py covers fp8.)
        ("int4-sym-g16-M0-bf16", lambda: (_t(0, 32, dtype=torch.bfloat16),
                                          torch.randint(0, 256, (8, 16), dtype=torch.uint8),
                                          torch.rand(8, 2, dtype=torch.bfloat16), None, None, "int4", 16)),
        # other libraries' layouts (fusepass.formats.LIBRARY_FORMATS)
        ("nf4-b64-M3-N24-K128-bf16", lambda: (_t(3, 128, dtype=torch.bfloat16),
                                              torch.randint(0, 256, (24, 64), dtype=torch.uint8),
                                              torch.rand(24, 2), None, _t(24, dtype=torch.bfloat16), "nf4", 64)),
        ("gptq4-act-order-M2-N16-K64-fp16", lambda: (_t(2, 64, dtype=torch.float16),
                                                     torch.randint(-2**31, 2**31 - 1, (8, 16), dtype=torch.int32),
                                                     torch.rand(2, 16, dtype=torch.float16),
                                                     torch.randint(-2**31, 2**31 - 1, (2, 2), dtype=torch.int32),
                                                     None, "gptq4", 0, torch.randperm(64).to(torch.int32) % 2,
                                                     torch.arange(0, 32, 4, dtype=torch.int32))),
        ("hqq4-g32-M3-N8-K64-fp32", lambda: (_t(3, 64), torch.randint(0, 256, (8, 32), dtype=torch.uint8),
                                             torch.rand(8, 2), torch.rand(8, 2) * 15, None, "hqq4", 32)),
        # bitsandbytes' double quantization: the absmax's bytes, nested absmax, code and offset
        ("nf4-double-quantized-M1-N40-K128-bf16", lambda: _nested_nf4_one((1,), 40, torch.bfloat16)),
    ],
    "dequant_matmul_siblings": [
        ("int4-g32-M1-three-zero-bias-bf16", lambda: (*_siblings_inputs("int4", 32, (1,), (40, 8, 8), torch.bfloat16,
                                                                       zero=True, bias=(True, False, False)), [])),
        ("int8-M2x1-two-fp16", lambda: (*_siblings_inputs("int8", 0, (2, 1), (24, 16), torch.float16), [])),
        ("int4-sym-g16-M3-fp32", lambda: (*_siblings_inputs("int4", 16, (3,), (8, 9), torch.float32), [])),
        ("fp64", lambda: (*_siblings_inputs("int8", 0, (2,), (5, 3), torch.float64), [])),
        ("empty-rows", lambda: (*_siblings_inputs("int8", 0, (0,), (5, 3), torch.bfloat16), [])),
        ("nf4-double-quantized-M1-bf16", lambda: _nested_nf4_inputs((1,), (40, 24), torch.bfloat16)),
        ("nf4-M1-bf16", lambda: _plain_nf4_inputs((1,), (40, 24), torch.bfloat16)),
    ],
    "dequant_matmul_gated": [
        ("int4-g32-M1-zero-bias-bf16-silu", lambda: (*_siblings_inputs("int4", 32, (1,), (40, 40), torch.bfloat16,
                                                                      zero=True, bias=(True, True)), "silu", [])),
        ("int8-M2x1-fp16-gelu", lambda: (*_siblings_inputs("int8", 0, (2, 1), (24, 24), torch.float16), "gelu", [])),
        # (fp8: opcheck cannot multiply float8_e4m3fn on the CPU, see dequant_matmul's cases)
        ("int8-M3-fp32-gelu_tanh", lambda: (*_siblings_inputs("int8", 0, (3,), (9, 9), torch.float32), "gelu_tanh", [])),
        ("int4-sym-g16-M1-fp32-odd-N", lambda: (*_siblings_inputs("int4", 16, (1,), (33, 33), torch.float32), "silu", [])),
        ("fp64", lambda: (*_siblings_inputs("int8", 0, (2,), (5, 5), torch.float64), "silu", [])),
        ("empty-rows", lambda: (*_siblings_inputs("int8", 0, (0,), (5, 5), torch.bfloat16), "gelu", [])),
        ("nf4-double-quantized-M2-fp16-silu", lambda: _activation_before_nested(
            _nested_nf4_inputs((2,), (24, 24), torch.float16), "silu")),
        ("rows-past-the-gemv", lambda: (*_siblings_inputs("int4", 32, (12,), (16, 16), torch.bfloat16), "silu", [])),
    ],
    "decode_attention": [
        # (a static cache of 300 slots, 9 written: the kernel splits L and skips the hidden blocks)
        ("gqa-bool-mask-bf16-L300", lambda: (_t(1, 8, 1, 32, dtype=torch.bfloat16), _t(1, 2, 300, 32, dtype=torch.bfloat16),
                                             _t(1, 2, 300, 32, dtype=torch.bfloat16), _cache_mask(1, 1, 300, 9),
                                             0.2)),
        ("mha-float-mask-per-head-fp16-T2", lambda: (_t(2, 4, 2, 16, dtype=torch.float16),
                                                      _t(2, 4, 45, 16, dtype=torch.float16),
                                                      _t(2, 4, 45, 16, dtype=torch.float16),
                                                      _t(2, 4, 2, 45, dtype=torch.float16), 0.25)),
        ("no-mask-fp32-dv40-odd-dims", lambda: (_t(1, 6, 1, 24), _t(1, 3, 33, 24), _t(1, 3, 33, 40), None, 0.3)),
        ("fp64", lambda: (_t(1, 4, 1, 8, dtype=torch.float64), _t(1, 2, 9, 8, dtype=torch.float64),
                          _t(1, 2, 9, 8, dtype=torch.float64), _cache_mask(1, 1, 9, 4), 0.5)),
        ("rows-past-a-tile", lambda: (_t(1, 32, 4, 16), _t(1, 1, 20, 16), _t(1, 1, 20, 16), None, 0.25)),
        ("empty-batch", lambda: (_t(0, 4, 1, 16), _t(0, 2, 7, 16), _t(0, 2, 7, 16), None, 0.25)),
    ],
    "decode_attention_write": [
        # (the step's new rows into slot 9 of a 300-slot cache, slots 0-9 visible; a negative slot, no mask)
        ("gqa-bool-mask-bf16-L300", lambda: (_t(1, 8, 1, 32, dtype=torch.bfloat16),
                                             _t(1, 2, 300, 32, dtype=torch.bfloat16),
                                             _t(1, 2, 300, 32, dtype=torch.bfloat16),
                                             _t(1, 2, 1, 32, dtype=torch.bfloat16), _t(1, 2, 1, 32, dtype=torch.bfloat16),
                                             torch.tensor([9]), _cache_mask(1, 1, 300, 10), 0.2)),
        ("fp32-negative-slot-dv40-no-mask", lambda: (_t(2, 6, 1, 24), _t(2, 3, 33, 24), _t(2, 3, 33, 40),
                                                     _t(2, 3, 1, 24), _t(2, 3, 1, 40), torch.tensor([-4]), None, 0.3)),
    ],
    "linear_siblings": [
        ("3d-M2x1-bf16-strided-weight-bias", lambda: (_t(2, 1, 37, dtype=torch.bfloat16),
                                                      [_t(9, 40, dtype=torch.bfloat16)[:, :37],
                                                       _t(3, 37, dtype=torch.bfloat16)],
                                                      [_t(9, dtype=torch.bfloat16), None])),
        ("M4-fp16-four", lambda: (_t(4, 16, dtype=torch.float16), [_t(n, 16, dtype=torch.float16) for n in (1, 5, 8, 2)],
                                  [None] * 4)),
        # (linear_one's call; a bias of stride 2: the kernel reads N packed values)
        ("M1-bf16-one-weight-strided-bias", lambda: (_t(1, 37, dtype=torch.bfloat16),
                                                     [_t(33, 37, dtype=torch.bfloat16)],
                                                     [_t(66, dtype=torch.bfloat16)[::2]])),
        ("M6-fp32-rows-past-the-gemv", lambda: (_t(6, 16), [_t(4, 16), _t(3, 16)], [None, _t(3)])),
        ("fp64", lambda: (_t(2, 9, dtype=torch.float64), [_t(3, 9, dtype=torch.float64)] * 2, [None, None])),
        ("empty-rows", lambda: (_t(0, 8), [_t(3, 8), _t(2, 8)], [None, None])),
    ],
}


def _cache_mask(B, T, L, written):
    """A static cache's boolean mask [B, 1, T, L]: the first ``written`` slots (more for later rows)."""
    m = torch.arange(L)[None, :] < (written + torch.arange(T))[:, None]
    return m[None, None].expand(B, 1, T, L).clone()


def _siblings_inputs(fmt, group, lead, Ns, dtype, zero=False, bias=()):
    """fusepass::dequant_matmul_siblings arguments: x [*lead, 64] and one weight a row count in Ns."""
    from fusepass.quantize import quantize_rows

    K = 64
    ws, ss, zs, bs = [], [], [], []
    for i, n in enumerate(Ns):
        q, s, z = quantize_rows(torch.randn(n, K) * 0.1, fmt, group or 128)
        ws.append(q)
        ss.append(s.to(dtype) if fmt == "int4" else s)
        zs.append(z.to(dtype) if zero and z is not None else None)
        bs.append(_t(n, dtype=dtype) if i < len(bias) and bias[i] else None)
    return _t(*lead, K, dtype=dtype), ws, ss, zs, bs, fmt, group


def _nested_nf4_inputs(lead, Ns, dtype):
    """fusepass::dequant_matmul_siblings arguments for NF4 weights with double quantization."""
    K = 128
    ws, ss, nested = [], [], []
    for n in Ns:
        ws.append(torch.randint(0, 256, (n, K // 2), dtype=torch.uint8))
        ss.append(torch.randint(0, 256, (n, K // 64), dtype=torch.uint8))
        nested += [torch.rand(-(-n * K // 64 // 256)) + 0.5, torch.sort(torch.randn(256))[0], torch.rand(1)]
    return _t(*lead, K, dtype=dtype), ws, ss, [None] * len(Ns), [None] * len(Ns), "nf4", 64, nested


def _plain_nf4_inputs(lead, Ns, dtype):
    """The same weights with their absmax as fp32 (no double quantization)."""
    x, ws, ss, zs, bs, fmt, group, _ = _nested_nf4_inputs(lead, Ns, dtype)
    return x, ws, [torch.rand(s.shape) + 0.1 for s in ss], zs, bs, fmt, group, []


def _activation_before_nested(args, activation):
    """The siblings' arguments as fusepass::dequant_matmul_gated takes them (the activation before nested)."""
    return (*args[:7], activation, args[7])


def _nested_nf4_one(lead, N, dtype):
    x, (w,), (s,), _, _, fmt, group, nested = _nested_nf4_inputs(lead, (N,), dtype)
    return (x, w, s, None, None, fmt, group, None, None, *nested)


def _moe_experts_inputs(T, E, k, H, I, dtype, act="silu", layout="halves", transposed=False, bias=False,
                        fmt="none"):
    """fusepass::moe_experts arguments: T tokens routed to k of E experts (two tokens share one)."""
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]) if T else torch.zeros(0, k, dtype=torch.long)
    if T > 1:
        ids[1, 0] = ids[0, 0]
    w1, w2 = _t(E, 2 * I, H) * 0.2, _t(E, H, I) * 0.2
    s1 = s2 = None
    if fmt == "int8":
        s1, s2 = w1.abs().amax(-1) / 127, w2.abs().amax(-1) / 127
        w1 = (w1 / s1[..., None]).round().to(torch.int8)
        w2 = (w2 / s2[..., None]).round().to(torch.int8)
        s1, s2 = s1.to(dtype), s2.to(dtype)
    else:
        w1, w2 = w1.to(dtype), w2.to(dtype)
        if transposed:
            w1, w2 = w1.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()
    b1, b2 = (_t(E, 2 * I, dtype=dtype), _t(E, H, dtype=dtype)) if bias else (None, None)
    alpha, limit = (1.702, 7.0) if act == "gpt_oss" else (0.0, 0.0)
    return (_t(T, H, dtype=dtype), ids, torch.rand(T, k, dtype=dtype), w1, w2, b1, b2, s1, None, s2, None, act,
            layout, transposed, fmt, 0, alpha, limit)


def _gdn_inputs(B, T, Hk, Hv, Dk, Dv, dtype, state):
    """q, k, v, g, beta, initial state, use_qk_l2norm, scale for the GDN ops."""
    q, k = _t(B, T, Hk, Dk, dtype=dtype), _t(B, T, Hk, Dk, dtype=dtype)
    v = _t(B, T, Hv, Dv, dtype=dtype)
    g = -torch.rand(B, T, Hv)  # log decay <= 0, fp32 as the models compute it
    beta = torch.rand(B, T, Hv, dtype=dtype)
    s0 = _t(B, Hv, Dk, Dv) if state else None
    return q, k, v, g, beta, s0, True, Dk ** -0.5


def opcheck_cases():
    params = []
    for op in OPS:
        cases = [(f"{op}/{case}", args, kwargs) for case, args, kwargs, _ in rule_cases().get(op, [])]
        cases += [(f"{op}/{case}", make, {}) for case, make in TABLE.get(op, [])]
        if not cases:
            params.append(pytest.param(op, None, None, id=f"{op}/no-inputs"))
        params += [pytest.param(op, args, kwargs, id=case) for case, args, kwargs in cases]
    return params


def _clone(args):
    return tuple(a.clone() if isinstance(a, torch.Tensor) else [_clone([t])[0] for t in a] if isinstance(a, list)
                 else a for a in args)


@pytest.mark.parametrize("op,args,kwargs", opcheck_cases())
def test_opcheck(op, args, kwargs):
    assert args is not None, f"fusepass::{op} has no inputs: no rule emits it and TABLE has no entry"
    if callable(args):
        torch.manual_seed(0)
        args = args()
    torch.library.opcheck(getattr(torch.ops.fusepass, op).default, _clone(args), kwargs)


def _kernel_path(op, inputs):
    """(context, inputs) that run ``op``'s CUDA implementation: natively on a
    GPU, else on CPU tensors with its Triton kernel under the interpreter."""
    if torch.cuda.is_available():
        return contextlib.nullcontext(), [x.cuda() if isinstance(x, torch.Tensor) else x for x in inputs]
    assert differential.interpreting(), "needs TRITON_INTERPRET=1 (conftest sets it without a GPU)"
    return differential.triton_on_cpu([op]), list(inputs)


@pytest.mark.parametrize("op", OPS)
def test_opcheck_triton_path(op):
    """The CUDA implementation (the Triton launcher) passes opcheck too."""
    first = next(iter(TABLE.get(op, [])), None)
    assert first is not None, f"add a TABLE entry for fusepass::{op}"
    torch.manual_seed(0)
    path, args = _kernel_path(op, first[1]())
    clear_kernel_fallbacks()
    with path:
        torch.library.opcheck(getattr(torch.ops.fusepass, op).default, tuple(args))
    assert not kernel_fallbacks(), kernel_fallbacks()


def _numeric(t):
    return isinstance(t, torch.Tensor) and t.numel() > 0 and t.dtype != torch.bool


def _relaid(fn):
    """``fn`` applied to every non-empty numeric tensor of an op argument (and each tensor of a list)."""
    def relay(a):
        return [relay(t) for t in a] if isinstance(a, list) else fn(a) if _numeric(a) else a
    return relay


@_relaid
def _strided(a):
    """A copy of ``a``'s values at stride 2 in its last dim: a slice of a larger tensor, as a model can pass one."""
    if a.dim() == 0:
        return a
    return torch.empty(*a.shape[:-1], 2 * a.shape[-1], dtype=a.dtype, device=a.device)[..., ::2].copy_(a)


@_relaid
def _odd_offset(a):
    """A copy of ``a``'s values at its own strides, one element past the start of
    its storage: a 16-bit tensor there is not 4-byte aligned (a slice of a
    larger tensor, the second half of an odd-width chunk)."""
    assert all(st > 0 or n == 1 for n, st in zip(a.shape, a.stride())), "an overlapping view cannot be copied into"
    span = 1 + sum((n - 1) * st for n, st in zip(a.shape, a.stride()))
    return torch.empty(span + 1, dtype=a.dtype, device=a.device).as_strided(a.shape, a.stride(), 1).copy_(a)


@_relaid
def _leading_permuted(a):
    """A copy of ``a``'s values (3-D and up) with its first two dims swapped in
    storage: rows that are not evenly spaced (a [B, T, C] activation taken from
    a [T, B, C] one)."""
    return a.transpose(0, 1).contiguous().transpose(0, 1) if a.dim() >= 3 else a


@_relaid
def _column_major(a):
    """A copy of ``a``'s values (2-D and up) with unit stride in its second-last
    dim: a weight or activation handed over transposed."""
    return a.transpose(-1, -2).contiguous().transpose(-1, -2) if a.dim() >= 2 else a


def _refusal(exc: BaseException) -> bool:
    """Whether ``exc`` is an op's argument check refusing (torch._check's
    RuntimeError/ValueError), not a crash that happens to share the type."""
    if not isinstance(exc, (RuntimeError, ValueError)):
        return False
    tb = exc.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code.co_name == "_check_with"


def _check_layout(op, make, fake_cuda, relayout, layout, refusals):
    """Runs ``op`` on ``make()``'s operands and on ``relayout`` of them (same
    values, another layout), through the CUDA implementation and the inlined
    form: the same values, or a refusal by the op's argument check (then
    appended to ``refusals``).  Never a silently wrong value, a crash, or a
    kernel failure the contiguous operands did not have."""
    from fusepass.kernels._common import inline_forms, inline_kernels

    torch.manual_seed(0)
    args = make()
    path, _ = _kernel_path(op, ())
    # (the tensors in lists too; re-laid after the move, which copies a strided tensor contiguous)
    inputs = torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.cuda() if torch.cuda.is_available() else t,
                                               list(args))
    relaid = [relayout(a) for a in inputs]
    packet = getattr(torch.ops.fusepass, op)
    precision = loosest(a.dtype for a in torch.utils._pytree.tree_leaves(args)
                        if isinstance(a, torch.Tensor) and a.is_floating_point())
    clear_kernel_fallbacks()
    try:
        with path:
            expected = packet(*inputs)
            fell_back = dict(kernel_fallbacks())
            try:
                actual = packet(*relaid)
            except Exception as exc:  # noqa: BLE001 - only the op's own refusal passes
                if not _refusal(exc):
                    raise
                refusals.append(f"{op}: {exc}")
                return
        # The layout may send the op to its reference (correct), never more than the contiguous one did:
        # a new entry is a kernel that crashed on this layout.
        assert kernel_fallbacks() == fell_back, kernel_fallbacks()
    finally:
        clear_kernel_fallbacks()
    assert_close(actual, expected, f"{op} with {layout} operands", dtype=precision)
    form = inline_forms().get(packet.default)
    if differential.interpreting() and form is not None:
        _, twin = fake_cuda
        with inline_kernels(True):
            try:
                inlined = form.ok(*[twin(a) for a in relaid])
            except RuntimeError as exc:  # a CPU-only torch cannot copy a strided fake CUDA tensor: contiguous twins
                if "not linked with support for cuda" not in str(exc):
                    raise
                inlined = form.ok(*[twin(a) for a in inputs])
        if inlined:  # the launches as a graph runs them, on the CPU tensors under the interpreter
            assert_close(form.traced(*relaid), expected, f"{op}'s inlined form with {layout} operands",
                         dtype=precision)


TABLE_CASES = [pytest.param(op, make, id=f"{op}/{case}") for op in OPS for case, make in TABLE.get(op, [])]


@pytest.mark.parametrize("op,make", TABLE_CASES)
def test_strided_operands_through_the_triton_path(op, make, fake_cuda):
    """The CUDA implementation and the inlined form read every operand at its
    own strides: each tensor at stride 2 in its last dim gives what the
    contiguous one gives (a kernel reading N packed values from a strided bias
    returns every other one)."""
    refusals = []
    _check_layout(op, make, fake_cuda, _strided, "strided", refusals)
    assert not refusals, refusals


# Each case under one of the three layouts, in turn (an op with three cases or more
# meets all three; every case and layout was 109 s of the interpreter, 190 cases).
LAYOUTS = ("odd-offset", "column-major", "leading-permuted")
LAYOUT_CASES = [pytest.param(*p.values, LAYOUTS[i % 3], id=f"{p.id}-{LAYOUTS[i % 3]}")
                for i, p in enumerate(TABLE_CASES)]


@pytest.mark.parametrize("op,make,layout", LAYOUT_CASES)
def test_offset_and_transposed_operands_through_the_triton_path(op, make, layout, fake_cuda):
    """More layouts a model or the differential generator can hand an op, same
    values: every operand one element past the start of its storage (a 16-bit
    tensor there is not 4-byte aligned: an int32 view of it, which some kernels
    use to load pairs, fails), every operand of 2 dims or more column-major
    (unit stride in its second-last dim: a weight handed over transposed), and
    every operand of 3 dims or more with its first two dims swapped in storage
    (rows a reshape cannot flatten without a copy).  The op gives what the
    contiguous operands give, or its argument check refuses them."""
    refusals = []
    relayout = {"odd-offset": _odd_offset, "column-major": _column_major, "leading-permuted": _leading_permuted}
    _check_layout(op, make, fake_cuda, relayout[layout], layout, refusals)
    if refusals:
        print("refused:", *refusals)


# -- a kernel that fails at run time --------------------------------------------------------

def _model_for(op):
    """(fn, inputs, rule) of a rule's search function whose rewrite emits ``op``;
    without such a rule, a function calling the op directly."""
    cases = rule_cases().get(op)
    if cases:
        rule_name, form_name, dtype = cases[0][3]
        rule = fusepass.get_rule(rule_name)
        form = next(f for f in rule.forms if f.name == form_name)
        torch.manual_seed(0)
        return _bound(rule, form.search), rule.inputs(form, dtype), rule_name
    torch.manual_seed(0)
    args = TABLE[op][0][1]()
    packet = getattr(torch.ops.fusepass, op)
    return (lambda *a: packet(*a)), list(args), None


@pytest.mark.parametrize("op", OPS)
def test_kernel_failure_falls_back_and_is_reported(op):
    fn, inputs, rule = _model_for(op)
    path, inputs = _kernel_path(op, inputs)
    expected = fn(*inputs)
    clear_kernel_fallbacks()
    try:
        with path, torch._inductor.config.patch(fx_graph_cache=False):
            torch._dynamo.reset()
            fusepass.reset_reports()
            # The per-call fallback belongs to the op path; on CUDA the default
            # inlines the kernel into Inductor's code instead (its failure is a
            # compile-time retry, tested in test_gpu.py).
            compiled = torch.compile(fn, backend="fusepass", dynamic=False, options={"inline_kernels": False})
            # The kernel itself runs first: the fallback below is the injected failure's doing.
            # Compared at the precision of the least precise input: GDN's fp32
            # state computed from bf16 inputs carries bf16 rounding.
            precision = loosest(x.dtype for x in inputs if isinstance(x, torch.Tensor))
            assert_close(compiled(*inputs), expected, f"{op} kernel", dtype=precision)
            assert not kernel_fallbacks(), kernel_fallbacks()
            with inject_failure(op):
                out = compiled(*inputs)
        assert_close(out, expected, f"{op} after its kernel failed")
        report = fusepass.last_report()
        if rule is not None:
            assert report.count(rule) >= 1
        assert "injected failure" in kernel_fallbacks().get(op, "")
        text = str(report)
        assert "kernels that failed at run time" in text and op in text.split("kernels that failed at run time")[1]
    finally:
        clear_kernel_fallbacks()


# -- verify mode refuses a wrong rule ---------------------------------------------------------------

def _search(x, weight, eps):
    h = x.to(torch.float32)
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _replace_eps_10x(x, weight, eps):
    out = torch.promote_types(x.dtype, weight.dtype)
    return torch.ops.fusepass.rms_norm(x, weight, eps * 10, 0.0, True, out)


def _replace_no_weight(x, weight, eps):
    out = torch.promote_types(x.dtype, weight.dtype)
    return torch.ops.fusepass.rms_norm(x, torch.ones_like(weight), eps, 0.0, True, out)


def _wrong_rule(replace):
    return fusepass.Rule(
        name="wrong_rms_norm",
        forms=[fusepass.Form("hf", _search, replace)],
        example_inputs=lambda dtype: [torch.randn(4, 16, dtype=dtype), torch.randn(16, dtype=dtype)],
        scalars={"eps": 1e-6},
        commutative_root=True,
    )


# eps = 0.01 against mean(x²) ~ 1 on the random inputs verify draws: ten times
# that eps moves every output by ~4%, far outside any dtype's tolerance.
EPS = 1e-2


def _program(x, w):
    return _search(x, w, EPS)


@pytest.mark.parametrize("replace", [_replace_eps_10x, _replace_no_weight], ids=["eps-x10", "weight-dropped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_verify_refuses_a_wrong_rule(replace, dtype):
    rule = _wrong_rule(replace)
    torch.manual_seed(0)
    x, w = torch.randn(6, 32, dtype=dtype), torch.randn(32, dtype=dtype)
    expected = _program(x, w)
    # The FX graph cache off: the pass itself must run (a hit would replay its stored report).
    with registered(rule), torch._inductor.config.patch(fx_graph_cache=False):
        # Without verify the wrong rule is applied, and the answer is wrong...
        out, report = compile_and_run(_program, (x, w), rules=[rule.name])
        assert report.count(rule.name) == 1
        with pytest.raises(AssertionError):
            assert_close(out, expected)
        # ...with it, the rewrite is refused with the measured error, and the answer is right.
        out, report = compile_and_run(_program, (x, w), rules=[rule.name], verify=True)
    assert report.count(rule.name) == 0
    reasons = report.reasons(rule.name)
    assert len(reasons) == 1 and reasons[0].startswith("verification failed: max abs error"), reasons
    measured = float(reasons[0].split("max abs error ")[1].split()[0])
    assert measured > 1e-2, reasons[0]
    assert_close(out, expected, "verify-refused program")


def _exp_exp(x):
    return x.exp().exp()


def _exp_exp_doubled_saturating(x):
    return (x.float().exp().exp() * 2).clamp(max=60000).to(x.dtype)


def test_verify_refuses_a_wrong_rule_whose_search_overflows():
    """In fp16, exp(exp(x)) overflows for x > 2.41 (~1% of verify's randn
    draws), where fp64 does not: the search's own error against fp64 is
    infinite, and twice it as an atol would pass this replacement, finite
    and twice the answer everywhere."""
    rule = fusepass.Rule(name="wrong_exp_exp", forms=[fusepass.Form("f", _exp_exp, _exp_exp_doubled_saturating)],
                         example_inputs=lambda dtype: [torch.randn(64, 64, dtype=dtype)], dtypes=(torch.float16,))
    torch.manual_seed(0)
    x = torch.randn(64, 64, dtype=torch.float16)
    with registered(rule), torch._inductor.config.patch(fx_graph_cache=False):
        _, report = compile_and_run(_exp_exp, (x,), rules=[rule.name], verify=True)
    assert report.count(rule.name) == 0, str(report)
    reasons = report.reasons(rule.name)
    assert len(reasons) == 1 and reasons[0].endswith("the search's own inf"), reasons


# -- a fusepass op whose CPU kernel was overridden and restored ----------------------------


def _stale_cpu_dispatch(op: str) -> None:
    """Leave the state that crashed a compile after tests/test_ops.py: a CPU
    kernel registered over ``op`` with torch.library (here the op's Triton
    launcher, as triton_on_cpu registers it), called under the Python
    dispatcher, which caches ``CPU -> CPU`` on the op overload, then removed.
    torch does not drop that entry, and the next call on CPU tensors under
    the Python dispatcher goes to the removed kernel: a segfault."""
    from torch._dispatch.python import enable_python_dispatcher

    differential._uncache_dispatch([op])
    torch.manual_seed(0)
    args = TABLE[op][0][1]()
    with torch.library._scoped_library("fusepass", "IMPL") as lib:
        lib.impl(op, differential.cuda_impl(op), "CPU")
        with enable_python_dispatcher():
            getattr(torch.ops.fusepass, op).default(*args)
    cache = getattr(torch.ops.fusepass, op).default._dispatch_cache
    assert cache.get(torch._C.DispatchKey.CPU) == torch._C.DispatchKey.CPU, cache  # the stale entry


@pytest.mark.skipif(not differential.interpreting(), reason="CPU tensors through the Triton launcher")
@pytest.mark.parametrize("rule,options", [("gdn_chunk", {}), ("rms_norm", {"verify": True})],
                         ids=["gdn-proof", "verify-mode"])
def test_a_stale_dispatch_entry_does_not_crash_a_compile(rule, options):
    """The GDN rules' proof and verify mode run fusepass ops on random CPU
    tensors inside Inductor's pass, where the Python dispatcher is on: with
    the stale entry above the process died (SIGSEGV in the op's redispatch,
    tests/test_ops.py before tests/test_differential.py).  They run without
    that dispatcher, and the rewrite goes through."""
    fn, inputs, _ = _model_for(rule)
    _stale_cpu_dispatch(rule)
    try:
        expected = fn(*inputs)
        with torch._inductor.config.patch(fx_graph_cache=False):
            out, report = compile_and_run(fn, inputs, rules=[rule], **options)
        assert report.count(rule) == 1, report.reasons(rule)
        assert_close(out, expected, f"{rule} after a stale dispatch entry",
                     dtype=loosest(x.dtype for x in inputs if isinstance(x, torch.Tensor)))
    finally:
        differential._uncache_dispatch([rule])


@pytest.mark.skipif(not differential.interpreting(), reason="CPU tensors through the Triton launcher")
def test_triton_on_cpu_leaves_no_stale_dispatch_entry():
    """triton_on_cpu, which left that entry in tests/test_ops.py, clears the
    Python dispatcher's cache of the ops it overrides on the way in (else
    that dispatcher keeps the key it resolved before, and never sees the
    override) and on the way out."""
    from torch._dispatch.python import enable_python_dispatcher

    op = "gdn_chunk"
    packet = getattr(torch.ops.fusepass, op).default
    differential._uncache_dispatch([op])
    torch.manual_seed(0)
    args = TABLE[op][0][1]()
    with enable_python_dispatcher():
        expected = packet(*args)  # caches CPU -> CompositeExplicitAutograd (the torch body)
    clear_kernel_fallbacks()
    with differential.triton_on_cpu([op]), enable_python_dispatcher():
        packet(*args)
        assert packet._dispatch_cache.get(torch._C.DispatchKey.CPU) == torch._C.DispatchKey.CPU
    assert not kernel_fallbacks(), kernel_fallbacks()
    assert torch._C.DispatchKey.CPU not in packet._dispatch_cache, packet._dispatch_cache
    with enable_python_dispatcher():  # segfaulted with the stale entry
        out = packet(*args)
    assert_close(out, expected, op, dtype=torch.bfloat16)


# -- kernels put into graphs ----------------------------------------------------------
#
# On CUDA the ops' launches go into Inductor's graph (``Launch.traced``): a
# rule's replacement calls the inlined form, the engine replaces op nodes
# already in the graph.  Without a GPU: the graph is traced with fake CUDA
# tensors (every launch must name every kernel argument, or Inductor's
# launcher fails on the GPU), and the same launches run here under the
# interpreter, through the graph node's own implementation, against the op.


class _Props:
    multi_processor_count = 132
    L2_cache_size = 50 << 20


@pytest.fixture
def fake_cuda(monkeypatch):
    """A FakeTensorMode and a function making fake CUDA twins of CPU tensors
    (shape, strides, dtype), with an H100's name and SM count."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fusepass.kernels import _common
    from fusepass.kernels.dequant_matmul import config, plans

    if torch.cuda.is_available():  # a real GPU: its lazy init reads the properties patched below
        torch.cuda.init()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: _Props())
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    _common.sm_count.cache_clear()
    config.gpu_name.cache_clear()
    plans.reset()
    mode = FakeTensorMode()

    def twin(a):
        if isinstance(a, list):  # (an op's Tensor[] argument)
            return [twin(t) for t in a]
        if not isinstance(a, torch.Tensor):
            return a
        with mode:
            if not a.storage_offset():
                return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="cuda")
            # (the offset too: an inlined form may refuse a tensor that is not aligned)
            span = a.storage_offset() + 1 + sum((n - 1) * st for n, st in zip(a.shape, a.stride()))
            return torch.empty(span, dtype=a.dtype, device="cuda").as_strided(a.shape, a.stride(), a.storage_offset())

    yield mode, twin
    _common.sm_count.cache_clear()
    config.gpu_name.cache_clear()
    plans.reset()


# Ops still called through the dispatcher on CUDA: each should register an
# inlined form (fusepass.kernels._common.register_inline) or show, measured,
# that its launch is no slower through the op.
# Ops a rule emits only where the graph's op calls stay calls (an in-place write has no functional
# inlined form here): patterns/decode_attention.py's cache write.
NOT_INLINED: set[str] = {"decode_attention_write"}


def inline_cases():
    params = []
    for op in OPS:
        if op in NOT_INLINED:
            continue
        cases = [(f"{op}/{case}", make) for case, make in TABLE.get(op, [])]
        cases += [(f"{op}/{case}", args) for case, args, kwargs, _ in rule_cases().get(op, [])[:2] if not kwargs]
        params += [pytest.param(op, make, id=case) for case, make in cases]
    return params


def _args(make):
    torch.manual_seed(0)
    return make() if callable(make) else _clone(make)


def _functional_launches(gm):
    from torch._higher_order_ops.triton_kernel_wrap import triton_kernel_wrapper_functional

    return [n for n in gm.graph.nodes if n.target is triton_kernel_wrapper_functional]


def _assert_every_argument(node):
    """The node names every argument of its kernel (graph values and side-table constants)."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
    kernel = getattr(kernel, "fn", kernel) if not hasattr(kernel, "arg_names") else kernel
    named = set(node.kwargs["kwargs"]) | set(kernel_side_table.get_constant_args(node.kwargs["constant_args_idx"]))
    assert named == set(kernel.arg_names), (kernel.arg_names, named)
    assert len(node.kwargs["grid"][0]) == 3


def test_every_op_has_an_inlined_form():
    from fusepass.kernels._common import inline_forms

    forms = inline_forms()
    assert sorted(op for op in OPS if getattr(torch.ops.fusepass, op).default not in forms) == sorted(NOT_INLINED)


def _trace_inlined(op, make, fake_cuda):
    """(whether the op's inlined form takes the case's arguments, as fake CUDA
    tensors; the graph make_fx traces of a rule's call of the op with inlining on)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from fusepass.kernels._common import call, inline_forms, inline_kernels

    mode, twin = fake_cuda
    packet = getattr(torch.ops.fusepass, op).default

    def trace(args):
        with mode, inline_kernels(True):
            return inline_forms()[packet].ok(*args), make_fx(lambda *a: call(packet, *a))(*args)

    try:
        return trace([twin(a) for a in _args(make)])
    except RuntimeError as exc:  # a CPU-only torch cannot copy a strided fake CUDA tensor: contiguous twins
        if "not linked with support for cuda" not in str(exc):
            raise
        return trace([twin(torch.utils._pytree.tree_map_only(torch.Tensor, torch.Tensor.contiguous, a))
                      for a in _args(make)])


@pytest.mark.parametrize("op,make", inline_cases())
def test_inlined_graph_names_every_kernel_argument(op, make, fake_cuda):
    """Traced for a CUDA graph with inlining on, a rule's call of the op becomes
    launches naming every kernel argument, no op call left -- or, where the
    inlined form refuses the arguments (fp64, a run-time eps, no rows, ...),
    the op call alone."""
    packet = getattr(torch.ops.fusepass, op).default
    inlined, gm = _trace_inlined(op, make, fake_cuda)
    ops = [n for n in gm.graph.nodes if n.target is packet]
    launches = _functional_launches(gm)
    if inlined:
        assert not ops and launches, gm.graph
        for node in launches:
            _assert_every_argument(node)
    else:
        assert len(ops) == 1 and not launches, gm.graph


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty fills floating tensors with NaN: a launch that leaves part of
    its output unwritten shows."""
    real = torch.empty

    def empty(*a, **k):
        t = real(*a, **k)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", empty)


@pytest.mark.skipif(not differential.interpreting(), reason="the launches on CPU tensors, under the interpreter")
@pytest.mark.parametrize("op,make", inline_cases())
def test_inlined_launches_compute_the_op(op, make, fake_cuda, poisoned_empty):
    """The inlined form, run on CPU tensors (the graph node's own implementation
    launching each kernel under the interpreter), agrees with the op."""
    from fusepass.kernels._common import inline_forms, inline_kernels

    _, twin = fake_cuda
    packet = getattr(torch.ops.fusepass, op).default
    form = inline_forms()[packet]
    args = _args(make)
    with inline_kernels(True):
        if not form.ok(*[twin(a) for a in args]):
            pytest.skip("the op stays an op call for these arguments (the other test checks that)")
    expected = packet(*_clone(args))
    actual = form.traced(*_clone(args))
    assert_close(actual, expected, op, dtype=loosest(a.dtype for a in torch.utils._pytree.tree_leaves(args)
                                                     if isinstance(a, torch.Tensor)))


def _dequant_paths():
    from fusepass.kernels.dequant_matmul import Config

    return {"gemv": Config("gemv", BN=8, BK=64), "gemv-splitk": Config("gemv", BN=8, BK=32, split=3),
            "mm-splitk": Config("mm", BM=16, BN=16, BK=32, split=2), "mmt": Config("mmt", BM=16, BN=16, BK=32),
            "mmt-splitk": Config("mmt", BM=16, BN=16, BK=32, split=2),
            # int4's scales two steps ahead, x copied into the tile's K order as a node of the graph
            "mmt-ahead-xperm": Config("mmt", BM=16, BN=16, BK=32, split=3, ahead=2, xperm=1),
            "cublas": Config("cublas")}


def _dequant_inputs(fmt, cfg):
    """dequant_matmul's arguments for a path's plan: x [M, 96] bf16 with a bias, 24 output columns."""
    torch.manual_seed(0)
    M = 3 if cfg.kind == "gemv" else 17
    x = torch.randn(M, 96, dtype=torch.bfloat16)
    if fmt == "int4":
        w, s = torch.randint(0, 256, (24, 48), dtype=torch.uint8), torch.rand(24, 3, dtype=torch.bfloat16) / 30
        z, g = torch.rand(24, 3, dtype=torch.bfloat16) * 15, 32
    else:
        w, s, z, g = torch.randint(-128, 128, (24, 96), dtype=torch.int8), torch.rand(24, dtype=torch.bfloat16) / 300, None, 0
    return x, w, s, z, torch.randn(24, dtype=torch.bfloat16), fmt, g


@pytest.mark.skipif(not differential.interpreting(), reason="the launches on CPU tensors, under the interpreter")
@pytest.mark.parametrize("path", ["gemv", "gemv-splitk", "mm-splitk", "mmt", "mmt-splitk", "mmt-ahead-xperm", "cublas"])
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_inlined_dequant_matmul_every_path(path, fmt, monkeypatch, poisoned_empty):
    """Each of dequant_matmul's paths put into a graph computes the op: a split
    K with its slices and zeroed counters allocated in the graph, summed by
    each tile's last program; the cuBLAS path as the dequantising pass and the
    graph's own mm."""
    from fusepass.kernels.dequant_matmul import op as dm_op

    cfg = _dequant_paths()[path]
    monkeypatch.setattr(dm_op, "_plan", lambda *a: cfg)
    x, w, s, z, b, fmt, g = _dequant_inputs(fmt, cfg)
    expected = torch.ops.fusepass.dequant_matmul(x, w, s, z, b, fmt, g)
    actual = dm_op.dequant_matmul_traced(x, w, s, z, b, fmt, g)
    assert_close(actual, expected, f"dequant_matmul {path}")


@pytest.mark.parametrize("op,args", [
    ("gdn_chunk", lambda: _gdn_inputs(1, 70, 2, 2, 16, 16, torch.bfloat16, True)),  # the chunked pipeline
    ("gdn_chunk", lambda: _gdn_inputs(2, 5, 1, 2, 8, 8, torch.bfloat16, False)),  # short: the recurrent kernel
    ("gdn_recurrent", lambda: _gdn_inputs(2, 1, 2, 4, 8, 12, torch.float32, True)),
    ("dequant_matmul", TABLE["dequant_matmul"][0][1]),
    ("linear_siblings", TABLE["linear_siblings"][0][1]),  # Tensor[] arguments, a list of outputs
    ("linear_siblings", lambda: (_t(1, 37, dtype=torch.bfloat16), [_t(33, 37, dtype=torch.bfloat16)],
                                 [_t(33, dtype=torch.bfloat16)])),  # a list of one output
], ids=["gdn_chunk-T70", "gdn_chunk-T5", "gdn_recurrent-T1", "dequant_matmul", "linear_siblings",
        "linear_siblings-one"])
def test_engine_inlines_op_nodes_in_the_graph(op, args, fake_cuda):
    """Op nodes already in a CUDA graph (the pre-trace path's GDN calls) become
    their launches: the engine's generic step, for any op with an inlined form."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from fusepass.kernels._common import inline_kernels
    from fusepass.regions import inline_op_nodes

    mode, twin = fake_cuda
    packet = getattr(torch.ops.fusepass, op).default
    inputs = [twin(a) for a in _args(args)]
    with mode:
        gm = make_fx(lambda *a: packet(*a))(*inputs)
        with inline_kernels(False):
            assert inline_op_nodes(gm) == (0, [])  # inlining off: the op call stays
        with inline_kernels(True):
            done, failed = inline_op_nodes(gm)
    assert (done, failed) == (1, [])
    assert not [n for n in gm.graph.nodes if n.target is packet]
    launches = _functional_launches(gm)
    # the chunked pipeline: inverse, w/u, state pass, output, the token loop for heads with g > 0
    assert len(launches) == {"gdn_chunk-T70": 5}.get(op + f"-T{inputs[0].shape[1]}", 1)
    for node in launches:
        _assert_every_argument(node)
    outputs = torch.utils._pytree.tree_leaves(next(n for n in gm.graph.nodes if n.op == "output").args[0])
    # (o, final state) / y / one output a weight, each from a launch
    assert len(outputs) == (2 if op.startswith("gdn") else len(inputs[1]) if op == "linear_siblings" else 1)
    # Every index taken of a container (a launch's outputs), none of a tensor: Inductor's lowering refuses
    # getitem(tensor, 0), which a one-element list's op node once left behind (H200: the whole graph
    # compiled again without inlining).
    for n in gm.graph.nodes:
        if n.target is operator.getitem:
            assert not isinstance(n.args[0].meta.get("val"), torch.Tensor), gm.graph


# Kernels no inlined form launches: their ops launch them.
OP_ONLY_KERNELS = {
    "_one_shot_kernel",  # all_reduce_rms_norm's one-shot path (the op picks it when it runs)
    "_rms_norm_fwd_looped_kernel",  # rows too long for the one-pass kernels (rms_norm._inline_ok)
    "_splitk_reduce_kernel",  # a split K without counters: inlined, the tile's last program sums the slices
    "_nested_absmax_kernel",  # double quantization expanded for the tensor-core plans: code books stay op calls
}


def _more_inlined_launches():
    """Inlined launches the inline cases do not reach, so that every kernel an
    inlined form may launch is built: (case, op, make, [(object, attribute,
    value) set while tracing])."""
    from fusepass.kernels.dequant_matmul import op as dm_op
    from fusepass.kernels.gdn import launch as gdn_launch
    from fusepass.kernels.moe import experts

    bf16 = torch.bfloat16
    yield ("decode_attention/split-L1024", "decode_attention",  # two splits and their merge
           lambda: (_t(1, 8, 1, 32, dtype=bf16), _t(1, 2, 1024, 32, dtype=bf16), _t(1, 2, 1024, 32, dtype=bf16),
                    _cache_mask(1, 1, 1024, 700), 0.2), [])
    yield ("rms_norm_gated/looped-N16400", "rms_norm_gated",
           lambda: (_t(2, 16400, dtype=bf16), _t(2, 16400, dtype=bf16), _t(16400, dtype=bf16), 1e-6, True, "silu"), [])
    yield ("gdn_chunk/fused-scan", "gdn_chunk", lambda: _gdn_inputs(1, 70, 2, 2, 16, 16, bf16, True),
           [(gdn_launch, "_FUSE_MIN_WAVES", 0)])
    for plan in ("sorted", "grouped_mm"):  # (gpt_oss: the activation with a clamp, alpha and limit)
        yield (f"moe_experts/{plan}-gpt_oss", "moe_experts",
               lambda: _moe_experts_inputs(12, 4, 2, 32, 16, bf16, act="gpt_oss", layout="interleaved", bias=True),
               [(experts, "moe_experts_plan", lambda *a, plan=plan, **k: plan)])
    for path, cfg in _dequant_paths().items():
        for fmt in ("int8", "int4"):
            yield (f"dequant_matmul/{path}-{fmt}", "dequant_matmul", lambda fmt=fmt, cfg=cfg: _dequant_inputs(fmt, cfg),
                   [(dm_op, "_plan", lambda *a, cfg=cfg: cfg)])


def _inlined_kernels() -> set[str]:
    """Every fusepass kernel (a jit function named ``*_kernel``) but OP_ONLY_KERNELS."""
    import importlib
    import pkgutil

    import fusepass.kernels

    names = set()
    for info in pkgutil.walk_packages(fusepass.kernels.__path__, "fusepass.kernels."):
        for name, value in vars(importlib.import_module(info.name)).items():
            if name.endswith("_kernel") and getattr(getattr(value, "fn", None), "__module__", None) == info.name:
                names.add(name)
    return names - OP_ONLY_KERNELS


def test_inlined_kernels_stay_fp32_with_inductors_fp64_scalars(fake_cuda, monkeypatch):
    """Inductor compiles an inlined launch from its own code and types a Python-float argument fp64
    (fusepass.testing.ttir): an fp32 tile meeting it becomes fp64, every element computed in fp64, or,
    carried by a loop, fails to compile (on the GPU the graph then goes through the dispatcher).  Every
    launch of every inline case, and of paths they do not reach, built for sm_90 with Triton's frontend
    in one process without the interpreter: every kernel builds, with no fp64 tile."""
    import json
    import os
    import pickle
    import subprocess
    import sys

    from fusepass.kernels._common import Launch
    from fusepass.testing.ttir import launch_spec

    specs, case = [], None
    traced = Launch.traced

    def record(self):
        specs.append({**launch_spec(self), "case": case})
        return traced(self)

    monkeypatch.setattr(Launch, "traced", record)
    # Launches planned as on the GPU, without the interpreter's own choices (EMU's rounding, smaller tiles,
    # no inline asm): nothing is run here.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cases = [(p.id, *p.values, []) for p in inline_cases()] + list(_more_inlined_launches())
    for case, op, make, patches in cases:
        with pytest.MonkeyPatch.context() as patch:
            for obj, name, value in patches:
                patch.setattr(obj, name, value)
            _trace_inlined(op, make, fake_cuda)
    # (the child builds the kernels of the fusepass this process imported)
    root = os.path.dirname(os.path.dirname(fusepass.__file__))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    got = subprocess.run([sys.executable, "-c", "from fusepass.testing.ttir import main; main()"],
                         input=pickle.dumps(specs), capture_output=True, timeout=300, env=env)
    assert got.returncode == 0, got.stderr.decode()[-2000:]
    report = json.loads(got.stdout.splitlines()[-1])
    assert {r["kernel"] for r in report} == _inlined_kernels()
    bad = {f"{r['kernel']} ({r['case']})": {"fp64 args": r["fp64_args"], "error": r["error"], "tiles": r["tiles"][:3]}
           for r in report if r["error"] or r["tiles"]}
    assert not bad, json.dumps(bad, indent=1)


def test_a_launch_names_exactly_the_kernels_arguments():
    from fusepass.kernels._common import Launch
    from fusepass.kernels.gated_act import _gated_act_fwd_kernel

    g = torch.randn(4, 8)
    args = dict(gate=g, up=g, out=torch.empty_like(g), N=8, NB=1, stride_g=8, stride_u=8, stride_o=8, ACT="silu",
                BN=8, EMU_G=False, EMU_O=False, PDL=False)
    Launch(_gated_act_fwd_kernel, (4,), args, ("out",))
    with pytest.raises(TypeError, match=r"missing \['BN'\]"):
        Launch(_gated_act_fwd_kernel, (4,), {k: v for k, v in args.items() if k != "BN"}, ("out",))
    with pytest.raises(TypeError, match=r"unknown \['BM'\]"):
        Launch(_gated_act_fwd_kernel, (4,), {**args, "BM": 1}, ("out",))
    with pytest.raises(TypeError, match="also passed as another argument"):
        Launch(_gated_act_fwd_kernel, (4,), {**args, "up": args["out"]}, ("out",)).traced()


def test_inductors_kernel_analysis_runs_once_per_distinct_fusepass_call(monkeypatch):
    """Inductor's read/write analysis of a user-defined Triton kernel (from its
    TTIR, per call in the graph) runs once for each distinct fusepass call:
    the same kernel, argument values and dtypes get a copy of the first
    answer; another constexpr, another dtype or a kernel not fusepass's runs it."""
    import triton

    from torch._higher_order_ops import triton_kernel_wrap
    from fusepass.kernels import _common
    from fusepass.kernels.gated_act import _gated_act_fwd_kernel

    runs = []

    def analysis(kernel, kwargs, tma):
        runs.append((kernel, dict(kwargs)))
        return {"writes": ["out"], "n": len(runs)}

    monkeypatch.setattr(triton_kernel_wrap, "identify_accessed_tensors", analysis, raising=False)
    _common._memoize_kernel_analysis()
    memo = triton_kernel_wrap.identify_accessed_tensors
    assert memo is not analysis and memo.__wrapped__ is analysis

    g = torch.randn(4, 8, dtype=torch.bfloat16)
    args = dict(gate=g, up=g, out=torch.empty_like(g), N=8, NB=1, stride_g=8, stride_u=8, stride_o=8, ACT="silu",
                BN=8, EMU_G=False, EMU_O=False, PDL=False)
    first = memo(_gated_act_fwd_kernel, args, {})
    again = memo(_gated_act_fwd_kernel, {**args, "gate": torch.randn(4, 8, dtype=torch.bfloat16)}, {})
    assert len(runs) == 1 and again == first and again is not first  # a copy: callers may change it
    memo(_gated_act_fwd_kernel, {**args, "ACT": "gelu"}, {})
    memo(_gated_act_fwd_kernel, {**args, "gate": g.float()}, {})
    memo(_gated_act_fwd_kernel, {**args, "N": 16}, {})
    assert len(runs) == 4

    @triton.jit
    def not_ours(x):
        pass

    memo(not_ours, {"x": g}, {})
    memo(not_ours, {"x": g}, {})
    assert len(runs) == 6

    class Odd:  # an argument whose dtype cannot be read: no key, the analysis runs
        def get_dtype(self):
            raise NotImplementedError

    memo(_gated_act_fwd_kernel, {**args, "gate": Odd()}, {})
    memo(_gated_act_fwd_kernel, {**args, "gate": Odd()}, {})
    assert len(runs) == 8


@pytest.mark.gpu
@pytest.mark.parametrize("model,quant", [("qwen3_5", "int8"), ("qwen3_5", "int4"), ("llama", "int4"),
                                         ("qwen3_moe", "int8")])
def test_gpu_demo_models_run_every_op_from_inductors_code(model, quant):
    """On the GPU with the defaults, a demo model compiles with no fusepass op
    left to the dispatcher (quantized linears, GDN from the pre-trace path,
    norms, activations all launched from Inductor's code), for a prefill and
    one-token steps of two and one sequences, and its logits agree with eager
    as Inductor's do."""
    from torch._inductor.utils import run_and_get_code

    from fusepass import models

    m = models.build(model, dtype=torch.bfloat16, device="cuda", size="small").eval()
    fusepass.quantize(m, quant, group_size=32)
    for batch, seq in ((2, 16), (2, 1), (1, 1)):  # (one row: linear_one takes the bf16 lm_head)
        ids = models.input_ids(m, batch=batch, seq=seq).cuda()
        torch._dynamo.reset()
        fusepass.reset_reports()
        with torch.no_grad():
            expected = m(ids, use_cache=False).logits.float()
            out, codes = run_and_get_code(torch.compile(m, backend="fusepass", dynamic=False), ids, use_cache=False)
            torch._dynamo.reset()
            inductor = torch.compile(m, dynamic=False)(ids, use_cache=False).logits.float()
        code = "\n".join(codes)
        report = fusepass.last_report()
        assert report.count("dequant_matmul" if quant == "int8" else "dequant_matmul_int4") > 0, str(report)
        if model.endswith("_moe"):  # the router and the quantized experts, inlined like the rest
            assert report.count("moe_router") > 0 and report.count("moe_experts") > 0, str(report)
        assert "torch.ops.fusepass" not in code, [line for line in code.splitlines() if "torch.ops.fusepass" in line]
        assert not [n for g in report.graphs for n in g.notes if "inline" in n or "dispatcher" in n], str(report)
        err = (out.logits.float() - expected).abs().max().item()
        assert err <= 2 * (inductor - expected).abs().max().item() + 1e-2, err


def _kernel_module_texts():
    """(name, text) of what Inductor writes into its generated module for each
    fusepass kernel module's jit functions and global constants (as
    ``torch._inductor.codegen.wrapper.user_defined_triton_kernel_transitive_closure_source_code``
    writes them: sources as they are, constants as ``tl.constexpr(repr)``)."""
    import importlib
    import inspect
    import pkgutil

    import triton

    import fusepass.kernels

    for info in pkgutil.walk_packages(fusepass.kernels.__path__, "fusepass.kernels."):
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            fn = getattr(value, "fn", None)
            if callable(fn) and getattr(fn, "__module__", None) == info.name and hasattr(value, "arg_names"):
                yield f"{info.name}.{name}", inspect.getsource(fn)
            elif isinstance(value, triton.language.constexpr):
                yield f"{info.name}.{name}", f"{name} = tl.constexpr({value.value!r})"


def test_inductor_can_embed_every_kernel_source():
    """Inductor puts an inlined kernel's source, with every function and global
    constant it reaches, in its generated module inside a triple-quoted string:
    a constant whose repr carries an escape (a newline in an inline-asm string)
    ends that string early and the module does not import.  Seen on an H200:
    every graph with an inlined tensor-core dequant_matmul launch failed to
    compile and was compiled again with the ops called."""
    import ast
    import textwrap

    texts = dict(_kernel_module_texts())
    assert sum(".tiles._" in n and "ASM" in n for n in texts) >= 4 and len(texts) > 40
    for name, text in texts.items():
        module = f"SRC = '''\n{text}\n'''\n"
        ns: dict = {}
        exec(compile(module, name, "exec"), ns)
        assert ns["SRC"].strip() == text.strip()
        ast.parse(textwrap.dedent(ns["SRC"]))


def test_decode_launches_ask_for_pdl_where_supported_unless_switched_off(monkeypatch):
    """The decode path's launches (the GEMVs, the norms, the gated activation,
    attention and its merge, the GDN decode step's convolution, recurrence and
    gated norm) carry programmatic dependent launch where the device
    has it, and the kernel's PDL constexpr (its wait before any read) follows the
    launch attribute: a PDL launch without the wait could read what the kernel
    before it is still writing.  FUSEPASS_PDL=0 takes both off; on the CPU
    (no sm_90) neither is ever set."""
    from fusepass.kernels import _common
    from fusepass.kernels import decode_attention as da
    from fusepass.kernels import linear_siblings as ls
    from fusepass.kernels.dequant_matmul import launch as dl
    from fusepass.kernels.dequant_matmul.config import Config
    from fusepass.kernels.gated_act import gated_act_launch
    from fusepass.kernels.causal_conv1d import update_launch
    from fusepass.kernels.gdn.launch import recurrent_launch
    from fusepass.kernels.rms_norm import rms_norm_launch
    from fusepass.kernels.rms_norm_gated import rms_norm_gated_launch
    from fusepass.quantize import quantize_rows

    x = torch.randn(1, 64, dtype=torch.bfloat16)
    w = torch.randn(32, 64, dtype=torch.bfloat16)
    q8, s8, _ = quantize_rows(w.float(), "int8", 0)
    q4, s4, z4 = quantize_rows(w.float(), "int4", 32)
    q, kv = torch.randn(1, 4, 1, 16, dtype=torch.bfloat16), torch.randn(1, 2, 40, 16, dtype=torch.bfloat16)

    def built():
        out = torch.empty(1, 32, dtype=torch.bfloat16)
        yield dl.product_launch(x, q8, s8, None, None, out, "int8", 0, Config("gemv", BN=4, BK=64))
        yield dl.product_launch(x, q4, s4, z4, None, out, "int4", 32, Config("gemv", BN=4, BK=64))
        yield dl.siblings_launch(x, [q4, q4], [s4, s4], [z4, z4], [None, None], [out, out.clone()], "int4", 32,
                                 Config("gemv", BN=4, BK=64))
        yield ls.siblings_launch(x, [w, w], [None, None], [out, out.clone()])
        yield rms_norm_launch(x, x.clone(), x[0], 1e-6, 0.0, False, torch.empty_like(x), torch.empty_like(x))
        yield rms_norm_launch(x, None, x[0], 1e-6, 0.0, False, torch.empty_like(x), None)
        yield gated_act_launch(w, w, torch.empty_like(w), "silu")
        yield from da.launches(q, kv, kv, None, 0.25, torch.empty(1, 1, 4, 16, dtype=torch.bfloat16), (16, 2, 4))[0]
        cx, cs, cw = torch.randn(1, 8, 1), torch.randn(1, 8, 3), torch.randn(8, 4)
        yield update_launch(cx, cs, cw, None, "silu", torch.empty_like(cx), torch.empty_like(cs))
        g = torch.randn(1, 1, 2)
        qk = torch.randn(1, 1, 2, 16)
        yield recurrent_launch(qk, qk, qk, g, g.sigmoid(), None, torch.empty_like(qk), torch.empty(1, 2, 16, 16),
                               True, 0.25)
        yield rms_norm_gated_launch(w, w, w[0], 1e-6, True, "silu", torch.empty_like(w))

    names = [launch.kernel.__name__ for launch in built()]
    assert "_decode_attention_merge_kernel" in names and len(names) == 12
    for launch in built():  # the CPU: no PDL anywhere
        assert not launch.pdl and launch.args["PDL"] is False, launch.kernel.__name__
    monkeypatch.setattr(_common, "pdl_supported", lambda t: True)  # a device that has it
    for launch in built():
        assert launch.pdl and launch.args["PDL"] is True, launch.kernel.__name__
        assert launch._launch_meta().get("launch_pdl") or _common.interpreting()
    monkeypatch.setenv("FUSEPASS_PDL", "0")
    for launch in built():
        assert not launch.pdl and launch.args["PDL"] is False, launch.kernel.__name__
