"""The GDN layer's short convolution (fusepass/kernels/causal_conv1d.py)
against transformers' own functions, for every hybrid model that has them.

The op's CPU bodies are transformers' formulas, so in fp64 they must agree to
the last bit; the Triton kernels (under TRITON_INTERPRET=1 on CPU tensors)
must agree within the dtype table, with every output element written and the
cache's state shifted exactly as transformers shifts it.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from fusepass.kernels import causal_conv1d as cc
from fusepass.kernels._common import clear_kernel_fallbacks, kernel_fallbacks, tolerance
from fusepass.testing import differential

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MODELS = ("qwen3_5", "qwen3_next", "olmo_hybrid")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _hf(model: str):
    mod = pytest.importorskip(f"transformers.models.{model}.modeling_{model}")
    unwrap = lambda f: getattr(f, "__wrapped__", f)  # noqa: E731 - the hub wrapper may route to a package
    return unwrap(mod.causal_conv1d_fn), unwrap(mod.causal_conv1d_update)


def _x(B, C, T, dtype, layout, gen):
    """x [B, C, T] as the models pass it: the transpose of a [B, T, C] projection, or contiguous."""
    if layout == "projection":
        return torch.randn(B, T, C, generator=gen).to(dtype).transpose(1, 2)
    return torch.randn(B, C, T, generator=gen).to(dtype)


def _params(C, K, dtype, bias, gen):
    w = (torch.randn(C, K, generator=gen) * 0.5).to(dtype)
    b = (torch.randn(C, generator=gen) * 0.1).to(dtype) if bias else None
    return w, b


def _close(got, want, dtype):
    tol = tolerance(dtype)
    torch.testing.assert_close(got.double(), want.double(), atol=tol.atol, rtol=tol.rtol)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_cpu_bodies_are_transformers_functions_fp64(model, bias):
    """fp64: the op bodies and transformers' functions, prefill and update, bit for bit."""
    hf_fn, hf_update = _hf(model)
    gen = torch.Generator().manual_seed(1)
    x = _x(2, 40, 37, torch.float64, "projection", gen)
    w, b = _params(40, 4, torch.float64, bias, gen)
    out = torch.ops.fusepass.causal_conv1d(x, w, b, "silu")
    assert torch.equal(out, hf_fn(x, w, b, activation="silu"))
    assert out.stride(1) == 1  # laid out [B, T, C]
    state = torch.randn(2, 40, 4, generator=gen, dtype=torch.float64)
    s_hf = state.clone()
    xt = _x(2, 40, 1, torch.float64, "projection", gen)
    o, new_state = torch.ops.fusepass.causal_conv1d_update(xt, state, w, b, "silu")
    assert torch.equal(o, hf_update(xt, s_hf, w, b, "silu")) and torch.equal(new_state, s_hf)


CONV_CASES = [  # (id, B, C, T, K, dtype, layout, bias, activation)
    ("B2-C40-T37-K4-bf16-projection-silu", 2, 40, 37, 4, "bf16", "projection", False, "silu"),
    ("B1-C200-T1-K4-fp32-contiguous-bias", 1, 200, 1, 4, "fp32", "contiguous", True, "silu"),
    ("B3-C24-T70-K3-fp16-projection-noact", 3, 24, 70, 3, "fp16", "projection", True, None),
    ("B1-C130-T33-K2-bf16-projection-bias", 1, 130, 33, 2, "bf16", "projection", True, "silu"),
]


@pytest.mark.skipif(not INTERPRET, reason="the Triton kernels under the interpreter")
@pytest.mark.parametrize("case", CONV_CASES, ids=[c[0] for c in CONV_CASES])
def test_prefill_kernel(case):
    _, B, C, T, K, dt, layout, bias, act = case
    dtype = DTYPES[dt]
    gen = torch.Generator().manual_seed(2)
    x = _x(B, C, T, dtype, layout, gen)
    w, b = _params(C, K, dtype, bias, gen)
    want = cc.causal_conv1d_reference(x.double(), w.double(), None if b is None else b.double(), act)
    out = torch.full((B, T, C), float("nan"), dtype=dtype).transpose(1, 2)
    cc.causal_conv1d_fwd(x, w, b, act, out=out)
    assert not out.isnan().any()
    _close(out, want, dtype)
    hf_fn = _hf("qwen3_5")[0]
    _close(out, hf_fn(x, w, b, activation=act), dtype)  # transformers in the same dtype


UPDATE_CASES = [  # (id, B, C, L, S, K, dtype, bias)
    ("B2-C40-L1-S4-K4-bf16", 2, 40, 1, 4, 4, "bf16", False),
    ("B3-C130-L1-S3-K4-fp32-bias", 3, 130, 1, 3, 4, "fp32", True),
    ("B1-C24-L3-S4-K4-fp16", 1, 24, 3, 4, 4, "fp16", True),
    ("B1-C16-L5-S4-K4-fp32", 1, 16, 5, 4, 4, "fp32", False),
]


@pytest.mark.skipif(not INTERPRET, reason="the Triton kernels under the interpreter")
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("case", UPDATE_CASES, ids=[c[0] for c in UPDATE_CASES])
def test_update_kernel_matches_transformers(case, model):
    """Output and the shifted state against transformers' update (which shifts its state in place)."""
    _, B, C, L, S, K, dt, bias = case
    dtype = DTYPES[dt]
    _, hf_update = _hf(model)
    gen = torch.Generator().manual_seed(3)
    x = _x(B, C, L, dtype, "projection", gen)
    w, b = _params(C, K, dtype, bias, gen)
    state = torch.randn(B, C, S, generator=gen).to(dtype)
    s_hf = state.clone()
    out = torch.full((B, C, L), float("nan"), dtype=dtype)
    new_state = torch.full((B, C, S), float("nan"), dtype=dtype)
    before = state.clone()
    cc.causal_conv1d_update_fwd(x, state, w, b, "silu", out=out, new_state=new_state)
    want = hf_update(x, s_hf, w, b, "silu")
    assert not out.isnan().any()
    _close(out, want, dtype)
    assert torch.equal(new_state, s_hf), "the conv state shifted differently"
    assert torch.equal(state, before), "the kernel wrote its input state"


@pytest.mark.skipif(not INTERPRET, reason="the CUDA implementations through the dispatcher")
def test_ops_run_kernels():
    gen = torch.Generator().manual_seed(4)
    x = _x(1, 40, 9, torch.bfloat16, "projection", gen)
    w, b = _params(40, 4, torch.bfloat16, True, gen)
    state = torch.randn(1, 40, 4, generator=gen).to(torch.bfloat16)
    clear_kernel_fallbacks()
    with differential.triton_on_cpu(["causal_conv1d", "causal_conv1d_update"]):
        out = torch.ops.fusepass.causal_conv1d(x, w, b, "silu")
        o2, s2 = torch.ops.fusepass.causal_conv1d_update(x[:, :, :1], state, w, b, "silu")
    assert not kernel_fallbacks(), kernel_fallbacks()
    _close(out, cc.causal_conv1d_reference(x, w, b, "silu"), torch.bfloat16)
    o3, s3 = cc.causal_conv1d_update_reference(x[:, :, :1], state, w, b, "silu")
    _close(o2, o3, torch.bfloat16)
    assert torch.equal(s2, s3)


def test_refuses_unknown_activation():
    x = torch.randn(1, 8, 5)
    with pytest.raises(RuntimeError, match="activation"):
        torch.ops.fusepass.causal_conv1d(x, torch.randn(8, 4), None, "gelu")


def test_fake_matches_layout():
    """The fake's strides are the real output's: [B, C, T] values laid out [B, T, C]."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(2, 16, 7).transpose(1, 2).contiguous().transpose(1, 2)
        out = torch.ops.fusepass.causal_conv1d(x, torch.empty(16, 4), None, "silu")
    real = torch.ops.fusepass.causal_conv1d(torch.randn(2, 16, 7), torch.randn(16, 4), None, "silu")
    assert out.shape == real.shape and out.stride() == real.stride()


_ = importlib  # transformers' model modules are imported through pytest.importorskip
