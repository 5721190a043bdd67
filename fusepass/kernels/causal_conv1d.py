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
  ``conv_state [B, C, S]`` (S >= K - 1): returns the output and the shifted
  state ``cat(conv_state, x)[..., -S:]``, which transformers' function
  writes into the cache in place (the pre-trace substitute ``copy_``s it
  back: a functional op inlines into Inductor's graph like every other, and
  the copy is 2 S bytes per channel).

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

from fusepass.formats import KERNEL_DTYPES as _KERNEL_DTYPES
from fusepass.kernels._common import Launch, cdiv, inline_enabled, on_device, pdl_begin, pdl_on, register_inline, \
    run_kernel

_ACTIVATIONS = (None, "silu", "swish")
_MAX_K = 8
_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


# ------------------------------------------------------------------- kernels ----


@triton.jit
def _causal_conv1d_kernel(
    x, w, bias, out, T, C,
    s_xb, s_xc, s_xt, s_wc, s_wk, s_bc,
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
        b_acc += tl.load(bias + o_c * s_bc, mask=m_c, other=0.0).to(WDT).to(tl.float32)[None, :]
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
def _window(state, x, idx, S, L, p_s, s_ss, p_x, s_xt, m_c):
    """[BC, BL] values at positions idx of cat(state, x) along time; positions
    past S + L (the tiles' padding lanes, never stored) are not read."""
    m = m_c[:, None] & (idx >= 0) & (idx < S + L)
    b_s = tl.load(p_s + idx * s_ss, mask=m & (idx < S), other=0.0)
    b_x = tl.load(p_x + (idx - S) * s_xt, mask=m & (idx >= S), other=0.0)
    return b_s, b_x


@triton.jit
def _causal_conv1d_update_kernel(
    x, state, w, bias, out, new_state, L, S, C,
    s_xb, s_xc, s_xt, s_sb, s_sc, s_ss, s_wc, s_wk, s_bc,
    K: tl.constexpr, BL: tl.constexpr, BS: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr, WDT: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_begin(PDL)  # (a PDL launch: nothing is read before it)
    # One program per (BC channels, batch row): the window of cat(state, x)
    # each output reads, and the shifted state, written to new_state [B, C, S].
    i_c, i_b = tl.program_id(0), tl.program_id(1)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    o_l = tl.arange(0, BL)
    o_s = tl.arange(0, BS)
    p_s = state + i_b.to(tl.int64) * s_sb + o_c[:, None].to(tl.int64) * s_sc
    p_x = x + i_b.to(tl.int64) * s_xb + o_c[:, None].to(tl.int64) * s_xc
    # the shifted state: position s of the new state is position L + s of cat(state, x)
    b_ns, b_nx = _window(state, x, L + o_s[None, :], S, L, p_s, s_ss, p_x, s_xt, m_c)
    b_new = tl.where((L + o_s[None, :]) < S, b_ns.to(WDT), b_nx.to(WDT))
    b_acc = tl.zeros([BC, BL], dtype=tl.float32)
    if HAS_BIAS:
        b_acc += tl.load(bias + o_c * s_bc, mask=m_c, other=0.0).to(WDT).to(tl.float32)[:, None]
    for j in tl.static_range(K):
        # output l reads positions S - K + 1 + l + j of cat(state, x)
        idx = S - K + 1 + o_l[None, :] + j
        b_s, b_x = _window(state, x, idx, S, L, p_s, s_ss, p_x, s_xt, m_c)
        b_v = tl.where(idx < S, b_s.to(WDT), b_x.to(WDT)).to(tl.float32)
        b_w = tl.load(w + o_c * s_wc + j * s_wk, mask=m_c, other=0.0).to(tl.float32)
        b_acc += b_v * b_w[:, None]
    if SILU:
        b_acc = b_acc * tl.sigmoid(b_acc)
    p_n = new_state + (i_b.to(tl.int64) * C + o_c[:, None]) * S + o_s[None, :]
    tl.store(p_n, b_new.to(new_state.dtype.element_ty), mask=m_c[:, None] & (o_s[None, :] < S))
    p_o = out + (i_b.to(tl.int64) * C + o_c[:, None]) * L + o_l[None, :]
    tl.store(p_o, b_acc.to(out.dtype.element_ty), mask=m_c[:, None] & (o_l[None, :] < L))


# ------------------------------------------------------------------ launches ----


def _pow2(n: int) -> int:
    return max(1, 1 << (n - 1).bit_length())


def _kernel_ok(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None) -> bool:
    return (x.dtype in _KERNEL_DTYPES and weight.dtype in _KERNEL_DTYPES and weight.shape[-1] <= _MAX_K
            and (bias is None or bias.dtype in _KERNEL_DTYPES) and activation in _ACTIVATIONS)


def _prefill_out(x: Tensor) -> Tensor:
    B, C, T = x.shape
    return x.new_empty((B, T, C)).transpose(1, 2)


def _update_outs(x: Tensor, conv_state: Tensor) -> tuple[Tensor, Tensor]:
    return (x.new_empty(x.shape), conv_state.new_empty(conv_state.shape))


def _bias_stride(bias: Tensor | None) -> int:
    """The bias's stride, which the kernels read it at: a bias sliced from a larger tensor need not be packed."""
    return 0 if bias is None else bias.stride(0)


def conv_launch(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None, out: Tensor) -> Launch:
    """The prefill kernel into ``out`` ([B, C, T], the transpose of a contiguous [B, T, C])."""
    B, C, T = x.shape
    # 32 tokens x 128 channels per program: 8 KiB of bf16 out, K loads of it in.
    BT, BC = 32, min(128, _pow2(C))
    args = dict(x=x, w=weight, bias=weight if bias is None else bias, out=out, T=T, C=C,
                s_xb=x.stride(0), s_xc=x.stride(1), s_xt=x.stride(2), s_wc=weight.stride(0), s_wk=weight.stride(1),
                s_bc=_bias_stride(bias),
                K=weight.shape[-1], BT=BT, BC=BC, HAS_BIAS=bias is not None, SILU=activation is not None,
                WDT=_TL[weight.dtype])
    return Launch(_causal_conv1d_kernel, (cdiv(T, BT), cdiv(C, BC), B), args, ("out",), 4)


def update_launch(x: Tensor, conv_state: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None,
                  out: Tensor, new_state: Tensor) -> Launch:
    """The decode kernel: ``out`` [B, C, L] and ``new_state`` [B, C, S], both contiguous."""
    B, C, L = x.shape
    S = conv_state.shape[-1]
    BC = min(128, _pow2(C))
    args = dict(x=x, state=conv_state, w=weight, bias=weight if bias is None else bias, out=out, new_state=new_state,
                L=L, S=S, C=C, s_xb=x.stride(0), s_xc=x.stride(1), s_xt=x.stride(2), s_sb=conv_state.stride(0),
                s_sc=conv_state.stride(1), s_ss=conv_state.stride(2), s_wc=weight.stride(0), s_wk=weight.stride(1),
                s_bc=_bias_stride(bias),
                K=weight.shape[-1], BL=_pow2(L), BS=_pow2(S), BC=BC, HAS_BIAS=bias is not None,
                SILU=activation is not None, WDT=_TL[weight.dtype], PDL=pdl_on(x))
    return Launch(_causal_conv1d_update_kernel, (cdiv(C, BC), B), args, ("out", "new_state"), 4)


def causal_conv1d_fwd(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None, *,
                      out: Tensor | None = None) -> Tensor:
    """The prefill kernel; ``out`` when given (tests poison it)."""
    out = _prefill_out(x) if out is None else out
    if out.numel():
        with on_device(x):
            conv_launch(x, weight, bias, activation, out).run()
    return out


def causal_conv1d_update_fwd(x: Tensor, conv_state: Tensor, weight: Tensor, bias: Tensor | None,
                             activation: str | None, *, out: Tensor | None = None,
                             new_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The decode kernel: (act(conv) of the L new tokens, the shifted state)."""
    o, n = _update_outs(x, conv_state)
    out = o if out is None else out
    new_state = n if new_state is None else new_state
    if out.numel() or new_state.numel():
        with on_device(x):
            update_launch(x, conv_state, weight, bias, activation, out, new_state).run()
    return out, new_state


# ---------------------------------------------------------- plain torch bodies ----


def _act(y: Tensor, activation: str | None) -> Tensor:
    return y if activation is None else F.silu(y)


def causal_conv1d_reference(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None) -> Tensor:
    """transformers' ``causal_conv1d_fn`` (weight [C, K])."""
    C, T = x.shape[1], x.shape[2]
    y = F.conv1d(x.to(weight.dtype), weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1, groups=C)[:, :, :T]
    return _act(y, activation).to(x.dtype)


def causal_conv1d_update_reference(x: Tensor, conv_state: Tensor, weight: Tensor, bias: Tensor | None,
                                   activation: str | None) -> tuple[Tensor, Tensor]:
    """transformers' ``causal_conv1d_update``, functional: (output, the shifted state)."""
    C, L = x.shape[1], x.shape[2]
    S = conv_state.shape[-1]
    new = torch.cat([conv_state, x], dim=-1).to(weight.dtype)
    y = F.conv1d(new, weight.unsqueeze(1), bias, padding=0, groups=C)
    out = _act(y[:, :, y.shape[-1] - L:], activation).to(x.dtype).contiguous()
    return out, new[:, :, new.shape[-1] - S:].to(conv_state.dtype).contiguous()


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


@torch.library.custom_op("fusepass::causal_conv1d_update", mutates_args=())
def causal_conv1d_update(x: Tensor, conv_state: Tensor, weight: Tensor, bias: Tensor | None,
                         activation: str | None) -> tuple[Tensor, Tensor]:
    """One decode step (L new tokens of x [B, C, L]) against conv_state [B, C, S]: (output, shifted state)."""
    _check(x, weight, bias, activation)
    return causal_conv1d_update_reference(x, conv_state, weight, bias, activation)


@causal_conv1d_update.register_fake
def _causal_conv1d_update_fake(x, conv_state, weight, bias, activation):
    _check(x, weight, bias, activation)
    return _update_outs(x, conv_state)


def _update_supported(x, conv_state, weight, bias, activation) -> bool:
    return (_kernel_ok(x, weight, bias, activation) and conv_state.dtype in _KERNEL_DTYPES
            and conv_state.dim() == 3 and conv_state.shape[:2] == x.shape[:2]
            and conv_state.shape[-1] >= weight.shape[-1] - 1)


@causal_conv1d_update.register_kernel("cuda")
def _causal_conv1d_update_cuda(x, conv_state, weight, bias, activation):
    _check(x, weight, bias, activation)
    reference = lambda: causal_conv1d_update_reference(x, conv_state, weight, bias, activation)  # noqa: E731
    if not _update_supported(x, conv_state, weight, bias, activation):
        return reference()
    return run_kernel("causal_conv1d_update",
                      lambda: causal_conv1d_update_fwd(x, conv_state, weight, bias, activation), reference)


# ------------------------------------------------------- calls in graphs ----


def _inline_ok(x, weight, bias, activation) -> bool:
    return (inline_enabled(x) and x.dim() == 3 and _kernel_ok(x, weight, bias, activation)
            and all(isinstance(s, int) for s in (*x.stride(), *weight.shape)))


def _conv_traced(x, weight, bias, activation):
    return conv_launch(x, weight, bias, activation, _prefill_out(x)).traced()["out"]


def _update_traced(x, conv_state, weight, bias, activation):
    out, new_state = _update_outs(x, conv_state)
    res = update_launch(x, conv_state, weight, bias, activation, out, new_state).traced()
    return res["out"], res["new_state"]


register_inline(torch.ops.fusepass.causal_conv1d.default, _inline_ok, _conv_traced)
register_inline(torch.ops.fusepass.causal_conv1d_update.default,
                lambda x, s, w, b, a: _inline_ok(x, w, b, a) and _update_supported(x, s, w, b, a)
                and all(isinstance(d, int) for d in s.shape), _update_traced)
