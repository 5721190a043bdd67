"""Causal depthwise conv1d with SiLU: the short convolution in front of a
Gated DeltaNet (or Mamba) layer, for prefill and for the one-step cache update.

    out[b, c, t] = act(bias[c] + sum_{j < K} w[c, j] x[b, c, t - K + 1 + j]),   x[b, c, t < 0] = 0

with act SiLU (``"silu"`` / ``"swish"``) or none.  Arguments as
``transformers``' ``causal_conv1d_fn`` / ``causal_conv1d_update`` take them
(Qwen3.5, Qwen3-Next, OLMo-hybrid, when the ``causal_conv1d`` package is not
installed): x ``[B, C, T]`` (in the models, the transpose of the ``[B, T, C]``
projection: unit stride along C), the weight ``[C, K]``, an optional bias
``[C]``.

- ``causal_conv1d(x, weight, bias, activation)``: the prefill.  The output
  holds ``[B, C, T]`` values laid out ``[B, T, C]`` (it is the transpose of a
  contiguous ``[B, T, C]`` tensor): the model transposes it back and splits
  q, k, v off the channels, which then have unit stride along the head dim
  and go to the GDN kernels without a copy.  transformers' ``F.conv1d``
  returns ``[B, C, T]`` contiguous, whose q, k, v views have stride T along
  the head dim.
- ``causal_conv1d_update(x, conv_state, weight, bias, activation)``: decode
  (x ``[B, C, L]``, L new tokens, usually 1) against the cached last inputs
  ``conv_state [B, C, S]`` (S >= K - 1), which it shifts in place:
  ``conv_state <- cat(conv_state, x)[..., -S:]``.

Numerics: transformers casts x to the weight's dtype, convolves there and
applies the activation there (bf16 in, bf16 out: two roundings).  The
kernels cast x to the weight's dtype too, then accumulate and apply the
activation in fp32 and round once to x's dtype.  On CUDA, float inputs of
fp16/bf16/fp32 with K <= 8; the rest (fp64, other activations) runs the
plain-torch bodies, which are transformers' functions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from fusepass.kernels._common import cdiv, on_device, run_kernel

_ACTIVATIONS = (None, "silu", "swish")
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_K = 8
_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


# ------------------------------------------------------------------- kernels ----


@triton.jit
def _causal_conv1d_kernel(
    x, w, bias, out, T, C,
    s_xb, s_xc, s_xt, s_wc, s_wk,
    K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    WDT: tl.constexpr,
):
    # One program per (BT tokens, BC channels, batch row): K shifted [BT, BC]
    # loads of x (the overlap is served by L1), fp32 sums, one store.
    i_t, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_t = i_t * BT + tl.arange(0, BT)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    p_x = x + i_b.to(tl.int64) * s_xb + o_c[None, :].to(tl.int64) * s_xc
    b_acc = tl.zeros([BT, BC], dtype=tl.float32)
    if HAS_BIAS:
        b_acc += tl.load(bias + o_c, mask=m_c, other=0.0).to(WDT).to(tl.float32)[None, :]
    for j in tl.static_range(K):
        o_s = o_t - (K - 1) + j
        m = ((o_s >= 0) & (o_s < T))[:, None] & m_c[None, :]
        b_x = tl.load(p_x + o_s.to(tl.int64)[:, None] * s_xt, mask=m, other=0.0).to(WDT).to(tl.float32)
        b_w = tl.load(w + o_c * s_wc + j * s_wk, mask=m_c, other=0.0).to(tl.float32)
        b_acc += b_x * b_w[None, :]
    if SILU:
        b_acc = b_acc * tl.sigmoid(b_acc)
    p_o = out + (i_b.to(tl.int64) * T + o_t.to(tl.int64))[:, None] * C + o_c[None, :]
    tl.store(p_o, b_acc.to(out.dtype.element_ty), mask=(o_t < T)[:, None] & m_c[None, :])


@triton.jit
def _window(state, x, idx, S, p_s, s_ss, p_x, s_xt, m_c):
    """[BC, BL] values at positions idx of cat(state, x) along time."""
    m = m_c[:, None] & (idx >= 0)
    b_s = tl.load(p_s + idx * s_ss, mask=m & (idx < S), other=0.0)
    b_x = tl.load(p_x + (idx - S) * s_xt, mask=m & (idx >= S), other=0.0)
    return b_s, b_x


@triton.jit
def _causal_conv1d_update_kernel(
    x, state, w, bias, out, L, S, C,
    s_xb, s_xc, s_xt, s_sb, s_sc, s_ss, s_wc, s_wk, s_ob, s_oc, s_ot,
    K: tl.constexpr, BL: tl.constexpr, BS: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr, WDT: tl.constexpr,
):
    # One program per (BC channels, batch row); every load before the barrier,
    # every store after it: the state is read and shifted in place.
    i_c, i_b = tl.program_id(0), tl.program_id(1)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    o_l = tl.arange(0, BL)
    o_s = tl.arange(0, BS)
    p_s = state + i_b.to(tl.int64) * s_sb + o_c[:, None].to(tl.int64) * s_sc
    p_x = x + i_b.to(tl.int64) * s_xb + o_c[:, None].to(tl.int64) * s_xc
    # the shifted state: position s of the new state is position L + s of cat(state, x)
    b_ns, b_nx = _window(state, x, L + o_s[None, :], S, p_s, s_ss, p_x, s_xt, m_c)
    b_new = tl.where((L + o_s[None, :]) < S, b_ns.to(WDT), b_nx.to(WDT))
    b_acc = tl.zeros([BC, BL], dtype=tl.float32)
    if HAS_BIAS:
        b_acc += tl.load(bias + o_c, mask=m_c, other=0.0).to(WDT).to(tl.float32)[:, None]
    for j in tl.static_range(K):
        # output l reads positions S - K + 1 + l + j of cat(state, x)
        idx = S - K + 1 + o_l[None, :] + j
        b_s, b_x = _window(state, x, idx, S, p_s, s_ss, p_x, s_xt, m_c)
        b_v = tl.where(idx < S, b_s.to(WDT), b_x.to(WDT)).to(tl.float32)
        b_w = tl.load(w + o_c * s_wc + j * s_wk, mask=m_c, other=0.0).to(tl.float32)
        b_acc += b_v * b_w[:, None]
    if SILU:
        b_acc = b_acc * tl.sigmoid(b_acc)
    tl.debug_barrier()
    tl.store(p_s + o_s[None, :] * s_ss, b_new.to(state.dtype.element_ty), mask=m_c[:, None] & (o_s[None, :] < S))
    p_o = out + i_b.to(tl.int64) * s_ob + o_c[:, None].to(tl.int64) * s_oc + o_l[None, :] * s_ot
    tl.store(p_o, b_acc.to(out.dtype.element_ty), mask=m_c[:, None] & (o_l[None, :] < L))


# ------------------------------------------------------------------ launchers ----


def _pow2(n: int) -> int:
    return max(1, 1 << (n - 1).bit_length())


def _kernel_ok(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None) -> bool:
    return (x.dtype in _KERNEL_DTYPES and weight.dtype in _KERNEL_DTYPES and weight.shape[-1] <= _MAX_K
            and (bias is None or bias.dtype in _KERNEL_DTYPES) and activation in _ACTIVATIONS)


def _prefill_out(x: Tensor) -> Tensor:
    B, C, T = x.shape
    return x.new_empty((B, T, C)).transpose(1, 2)


def causal_conv1d_fwd(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None, *,
                      out: Tensor | None = None) -> Tensor:
    """The prefill kernel; ``out`` ([B, C, T], the transpose of a contiguous [B, T, C]) when given."""
    B, C, T = x.shape
    out = _prefill_out(x) if out is None else out
    if out.numel() == 0:
        return out
    K = weight.shape[-1]
    # 32 tokens x 128 channels per program: 8 KiB of bf16 out, K loads of it in.
    BT, BC = 32, min(128, _pow2(C))
    with on_device(x):
        _causal_conv1d_kernel[(cdiv(T, BT), cdiv(C, BC), B)](
            x, weight, weight if bias is None else bias, out, T, C, *x.stride(), *weight.stride(),
            K=K, BT=BT, BC=BC, HAS_BIAS=bias is not None, SILU=activation is not None, WDT=_TL[weight.dtype],
            num_warps=4,
        )
    return out


def causal_conv1d_update_fwd(x: Tensor, conv_state: Tensor, weight: Tensor, bias: Tensor | None,
                             activation: str | None, *, out: Tensor | None = None) -> Tensor:
    """The decode kernel: returns act(conv) of the L new tokens, shifts ``conv_state`` in place."""
    B, C, L = x.shape
    S = conv_state.shape[-1]
    out = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
    if B == 0 or C == 0 or (L == 0 and S == 0):
        return out
    BC = min(128, _pow2(C))
    with on_device(x):
        _causal_conv1d_update_kernel[(cdiv(C, BC), B)](
            x, conv_state, weight, weight if bias is None else bias, out, L, S, C,
            *x.stride(), *conv_state.stride(), *weight.stride(), *out.stride(),
            K=weight.shape[-1], BL=_pow2(L), BS=_pow2(S), BC=BC, HAS_BIAS=bias is not None,
            SILU=activation is not None, WDT=_TL[weight.dtype], num_warps=4,
        )
    return out


# ---------------------------------------------------------- plain torch bodies ----


def _act(y: Tensor, activation: str | None) -> Tensor:
    return y if activation is None else F.silu(y)


def causal_conv1d_reference(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None) -> Tensor:
    """transformers' ``causal_conv1d_fn`` (weight [C, K])."""
    C, T = x.shape[1], x.shape[2]
    y = F.conv1d(x.to(weight.dtype), weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1, groups=C)[:, :, :T]
    return _act(y, activation).to(x.dtype)


def causal_conv1d_update_reference(x: Tensor, conv_state: Tensor, weight: Tensor, bias: Tensor | None,
                                   activation: str | None) -> Tensor:
    """transformers' ``causal_conv1d_update``: shifts ``conv_state`` in place."""
    C, L = x.shape[1], x.shape[2]
    S = conv_state.shape[-1]
    new = torch.cat([conv_state, x], dim=-1).to(weight.dtype)
    conv_state.copy_(new[:, :, new.shape[-1] - S:])
    y = F.conv1d(new, weight.unsqueeze(1), bias, padding=0, groups=C)
    return _act(y[:, :, y.shape[-1] - L:], activation).to(x.dtype)


# ----------------------------------------------------------------------- ops ----


def _check(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None) -> None:
    torch._check(x.dim() == 3, lambda: f"x must be [B, C, T], got {tuple(x.shape)}")
    torch._check(weight.dim() == 2 and weight.shape[0] == x.shape[1],
                 lambda: f"weight must be [C, K] with C = {x.shape[1]}, got {tuple(weight.shape)}")
    torch._check(bias is None or tuple(bias.shape) == (x.shape[1],), lambda: "bias must be [C]")
    torch._check(activation in _ACTIVATIONS, lambda: f"activation {activation!r} is not one of {_ACTIVATIONS}")


@torch.library.custom_op("fusepass::causal_conv1d", mutates_args=())
def causal_conv1d(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None) -> Tensor:
    """Causal depthwise conv1d (+ SiLU) of x [B, C, T]: [B, C, T] values laid out [B, T, C]."""
    _check(x, weight, bias, activation)
    return _prefill_out(x).copy_(causal_conv1d_reference(x, weight, bias, activation))


@causal_conv1d.register_fake
def _causal_conv1d_fake(x, weight, bias, activation):
    _check(x, weight, bias, activation)
    return _prefill_out(x)


@causal_conv1d.register_kernel("cuda")
def _causal_conv1d_cuda(x, weight, bias, activation):
    _check(x, weight, bias, activation)
    reference = lambda: _prefill_out(x).copy_(causal_conv1d_reference(x, weight, bias, activation))  # noqa: E731
    if not _kernel_ok(x, weight, bias, activation):
        return reference()
    return run_kernel("causal_conv1d", lambda: causal_conv1d_fwd(x, weight, bias, activation), reference)


@torch.library.custom_op("fusepass::causal_conv1d_update", mutates_args=("conv_state",))
def causal_conv1d_update(x: Tensor, conv_state: Tensor, weight: Tensor, bias: Tensor | None,
                         activation: str | None) -> Tensor:
    """One decode step (L new tokens of x [B, C, L]) against conv_state [B, C, S], shifted in place."""
    _check(x, weight, bias, activation)
    return causal_conv1d_update_reference(x, conv_state, weight, bias, activation).contiguous()


@causal_conv1d_update.register_fake
def _causal_conv1d_update_fake(x, conv_state, weight, bias, activation):
    _check(x, weight, bias, activation)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@causal_conv1d_update.register_kernel("cuda")
def _causal_conv1d_update_cuda(x, conv_state, weight, bias, activation):
    _check(x, weight, bias, activation)
    reference = lambda: causal_conv1d_update_reference(  # noqa: E731
        x, conv_state, weight, bias, activation).contiguous()
    if not (_kernel_ok(x, weight, bias, activation) and conv_state.dtype in _KERNEL_DTYPES
            and conv_state.shape[-1] >= weight.shape[-1] - 1):
        return reference()
    # A kernel that fails before its stores leaves the state untouched, so the
    # fallback shifts it once.
    return run_kernel("causal_conv1d_update",
                      lambda: causal_conv1d_update_fwd(x, conv_state, weight, bias, activation), reference)
