"""The experts of a sparse MoE block: every token through its top-k experts'
gated MLPs, weighted by the router and summed, in one op.

    moe_experts(x [T, H], topk_ids [T, k], topk_weights [T, k],
                w_gate_up, w_down, bias_gate_up [E, 2I]?, bias_down [E, H]?,
                scale_gate_up?, zero_gate_up?, scale_down?, zero_down?,
                activation, gate_layout, transposed, fmt, group_size, alpha, limit)
        -> out [T, H] in x's dtype

    out[t] = sum_j  topk_weights[t, j] * down_e(act(gate_up_e(x[t]))),   e = topk_ids[t, j]

Weights, per expert e (transformers' experts layouts):

    transposed = False   w_gate_up [E, 2I, H], w_down [E, H, I]   (gate_up_e(v) = W[e] v)
    transposed = True    w_gate_up [E, H, 2I], w_down [E, I, H]   (gate_up_e(v) = v W[e]; gpt-oss)
    gate_layout "halves"       gate = columns [0, I), up = [I, 2I)   (``chunk(2, -1)``)
                "interleaved"  gate = even columns, up = odd ones    (gpt-oss)
    activation "silu"       act = silu(gate) * up
               "gelu"       act = gelu(gate) * up            (erf form)
               "gelu_tanh"  act = gelu_tanh(gate) * up
               "gpt_oss"    g = min(gate, limit);  u = clamp(up, -limit, limit)
                            act = (u + 1) * (g * sigmoid(alpha g))

Quantized experts (``fmt`` "int8", "int4", "fp8"; "none" for plain weights in
x's dtype) store each expert as fusepass's quantized linears store one weight
(``fusepass.kernels.dequant_matmul``), [N, K] = [out features, in features]
(``transposed`` False only): w_gate_up [E, 2I, H] int8 with scale_gate_up
[E, 2I]; [E, 2I, H // 2] uint8 (two 4-bit codes per byte along H, low nibble
first) with scale and optional zero point [E, 2I, H // group_size]; or
[E, 2I, H] float8_e4m3fn with scale [E, 2I].  w_down likewise with N = H,
K = I.  An expert's linear is then x @ dequant(W)^T accumulated in fp32.

Roundings (what transformers' ``grouped_mm`` and ``batched_mm`` experts forms
compute in x's dtype, reproduced so that the op agrees with them to the last
bit up to accumulation order): each projection accumulates in fp32 and rounds
to x's dtype, its bias is added and rounded again; silu/gelu round, the
product with up rounds; gpt-oss's activation rounds after each of its
elementwise steps, as eager does; the expert output times the routing weight
rounds to the promoted dtype of x and topk_weights (x's dtype for bf16
weights; none for Mixtral's fp32 weights); the sum over the k experts
accumulates in fp32 and rounds once to x's dtype.  transformers' per-expert
``eager`` loop instead adds each expert into a zeroed output with
``index_add_`` in x's dtype: k roundings instead of one, a difference of at
most a few units in the last place of bf16 (inside the dtype table for the
models' k <= 8 with weights summing to about 1).

A pair whose id lies outside [0, E) contributes nothing, as transformers'
expert-parallel sentinels do in ``grouped_mm``.  T = 0 gives an empty output;
an expert no token chose costs nothing.

On CUDA (fp16, bf16, fp32) the op takes one of three paths, chosen per token
count by ``moe_experts_plan`` (measured plans in ``plans.py``, else a
heuristic): "decode" (few tokens, ``decode.py``: two launches, each active
expert's weights read once, no routing step), "sorted" (``prefill.py``: the
(token, choice) pairs sorted by expert on the device, grouped tl.dot GEMMs)
and "grouped_mm" (the same sort, ``torch._grouped_mm`` for the GEMMs; bf16 on
sm90).  None synchronises with the host or has a shape that depends on the
routing, so the op runs under CUDA graphs and with dynamic T.  fp64 and a
kernel that fails take the plain-torch body (which reads the ids on the
host).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from fusepass.formats import FORMATS, WEIGHT_DTYPES, dequantize
from fusepass.formats import KERNEL_DTYPES as _KERNEL_DTYPES
from fusepass.kernels._common import inline_enabled, on_device, register_inline, run_kernel, sm_count
from fusepass.kernels.moe import _tiles, decode, plans, prefill

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "gpt_oss")
GATE_LAYOUTS = ("halves", "interleaved")
EXPERT_FORMATS = ("none", *FORMATS)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# --------------------------------------------------------------- reference ----


def _expert_weight(w: Tensor, scale: Tensor | None, zero: Tensor | None, e: int, fmt: str, group_size: int,
                   transposed: bool, cd: torch.dtype) -> Tensor:
    """Expert e's weight as [N, K] (out, in features) in ``cd``."""
    if fmt != "none":
        return dequantize(w[e], scale[e], None if zero is None else zero[e], fmt, group_size, torch.float32).to(cd)
    return (w[e].t() if transposed else w[e]).to(cd)


def _activation(gu: Tensor, activation: str, gate_layout: str, alpha: float, limit: float, r) -> Tensor:
    """act(gate_up) with eager's roundings (``r`` rounds to x's dtype and back)."""
    if gate_layout == "halves":
        gate, up = gu.chunk(2, dim=-1)
    else:
        gate, up = gu[..., ::2], gu[..., 1::2]
    if activation == "silu":
        return r(r(F.silu(gate)) * up)
    if activation == "gelu":
        return r(r(F.gelu(gate)) * up)
    if activation == "gelu_tanh":
        return r(r(F.gelu(gate, approximate="tanh")) * up)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    glu = r(gate * r(torch.sigmoid(r(gate * alpha))))
    return r(r(up + 1) * glu)


def _rounder(dtype: torch.dtype, cd: torch.dtype):
    """t -> t rounded to ``dtype`` and back to ``cd`` (tests under the Triton
    interpreter swap in its fp32 -> bf16 truncation)."""
    return lambda t: t.to(dtype).to(cd)


def moe_experts_reference(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w_gate_up: Tensor, w_down: Tensor,
                          bias_gate_up: Tensor | None, bias_down: Tensor | None, scale_gate_up: Tensor | None,
                          zero_gate_up: Tensor | None, scale_down: Tensor | None, zero_down: Tensor | None,
                          activation: str, gate_layout: str, transposed: bool, fmt: str, group_size: int,
                          alpha: float, limit: float, compute_dtype: torch.dtype = torch.float32) -> Tensor:
    """The op's semantics in plain torch, one expert at a time (the ids are read
    on the host: this form serves CPU, and CUDA only as a fallback).
    ``compute_dtype`` (fp32, or fp64 for tests) is where everything between
    the roundings to x's dtype runs."""
    cd = compute_dtype
    T, H = x.shape
    k = topk_ids.shape[1]
    E = w_gate_up.shape[0]
    dt = x.dtype
    wdt = torch.promote_types(dt, topk_weights.dtype)

    r = _rounder(dt, cd)
    r_w = _rounder(wdt, cd)

    out = torch.zeros(T, H, dtype=cd, device=x.device)
    ids = topk_ids.reshape(-1).long()
    valid = (ids >= 0) & (ids < E)
    pairs = torch.arange(T * k, device=x.device)[valid]
    ids = ids[valid]
    order = torch.argsort(ids, stable=True)
    pairs, ids = pairs[order], ids[order]
    counts = torch.bincount(ids, minlength=E).tolist()
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        p = pairs[start:start + n]
        start += n
        tok = p // k
        w1 = _expert_weight(w_gate_up, scale_gate_up, zero_gate_up, e, fmt, group_size, transposed, cd)
        gu = r(x[tok].to(cd) @ w1.t())
        if bias_gate_up is not None:
            gu = r(gu + bias_gate_up[e].to(cd))
        h = _activation(gu, activation, gate_layout, alpha, limit, r)
        w2 = _expert_weight(w_down, scale_down, zero_down, e, fmt, group_size, transposed, cd)
        d = r(h @ w2.t())
        if bias_down is not None:
            d = r(d + bias_down[e].to(cd))
        y = r_w(d * topk_weights.reshape(-1)[p].to(cd)[:, None])
        out.index_add_(0, tok, y)
    return r(out).to(dt)


def _check(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w_gate_up: Tensor, w_down: Tensor,
           bias_gate_up: Tensor | None, bias_down: Tensor | None, scale_gate_up: Tensor | None,
           zero_gate_up: Tensor | None, scale_down: Tensor | None, zero_down: Tensor | None, activation: str,
           gate_layout: str, transposed: bool, fmt: str, group_size: int) -> None:
    torch._check(activation in ACTIVATIONS, lambda: f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    torch._check(gate_layout in GATE_LAYOUTS, lambda: f"gate_layout must be one of {GATE_LAYOUTS}, got {gate_layout!r}")
    torch._check(fmt in EXPERT_FORMATS, lambda: f"fmt must be one of {EXPERT_FORMATS}, got {fmt!r}")
    torch._check(x.dim() == 2 and x.dtype in _FLOATS,
                 lambda: f"x must be a floating [T, H], got {tuple(x.shape)} {x.dtype}")
    T, H = x.shape
    torch._check(topk_ids.dim() == 2 and topk_ids.shape[0] == T and not topk_ids.is_floating_point()
                 and topk_ids.dtype != torch.bool,
                 lambda: f"topk_ids must be integer [{T}, k], got {tuple(topk_ids.shape)} {topk_ids.dtype}")
    k = topk_ids.shape[1]
    torch._check(tuple(topk_weights.shape) == (T, k) and topk_weights.dtype in _FLOATS,
                 lambda: f"topk_weights must be floating [{T}, {k}], "
                         f"got {tuple(topk_weights.shape)} {topk_weights.dtype}")
    torch._check(w_gate_up.dim() == 3 and w_down.dim() == 3,
                 lambda: f"expert weights must be 3-D, got {tuple(w_gate_up.shape)} and {tuple(w_down.shape)}")
    E = w_gate_up.shape[0]
    torch._check(w_down.shape[0] == E, lambda: f"w_gate_up has {E} experts, w_down {w_down.shape[0]}")
    if fmt == "none":
        torch._check(w_gate_up.dtype == x.dtype and w_down.dtype == x.dtype,
                     lambda: f"expert weights must be in x's dtype {x.dtype}, got {w_gate_up.dtype}, {w_down.dtype}")
        torch._check(scale_gate_up is None and zero_gate_up is None and scale_down is None and zero_down is None,
                     lambda: "plain expert weights take no scales or zero points")
        if transposed:
            torch._check(w_gate_up.shape[1] == H,
                         lambda: f"w_gate_up must be [E, {H}, 2I], got {tuple(w_gate_up.shape)}")
            I2 = w_gate_up.shape[2]
            torch._check(tuple(w_down.shape[1:]) == (I2 // 2, H),
                         lambda: f"w_down must be [E, {I2 // 2}, {H}], got {tuple(w_down.shape)}")
        else:
            torch._check(w_gate_up.shape[2] == H,
                         lambda: f"w_gate_up must be [E, 2I, {H}], got {tuple(w_gate_up.shape)}")
            I2 = w_gate_up.shape[1]
            torch._check(tuple(w_down.shape[1:]) == (H, I2 // 2),
                         lambda: f"w_down must be [E, {H}, {I2 // 2}], got {tuple(w_down.shape)}")
    else:
        torch._check(not transposed, lambda: "quantized experts are stored [E, N, K] (transposed=False)")
        wdt = WEIGHT_DTYPES[fmt]
        torch._check(w_gate_up.dtype == wdt and w_down.dtype == wdt,
                     lambda: f"{fmt} expert weights must be {wdt}, got {w_gate_up.dtype}, {w_down.dtype}")
        pack = 2 if fmt == "int4" else 1
        I2 = w_gate_up.shape[1]
        torch._check(w_gate_up.shape[2] * pack == H,
                     lambda: f"w_gate_up holds {w_gate_up.shape[2] * pack} features, x {H}")
        torch._check(w_down.shape[1] == H and w_down.shape[2] * pack == I2 // 2,
                     lambda: f"w_down must hold [E, {H}, {I2 // 2}], got {tuple(w_down.shape)} ({fmt})")
        for name, s, z, N, K in (("gate_up", scale_gate_up, zero_gate_up, I2, H),
                                 ("down", scale_down, zero_down, H, I2 // 2)):
            torch._check(s is not None and s.dtype in _FLOATS, lambda: f"{fmt} experts need a floating scale_{name}")
            if fmt == "int4":
                torch._check(group_size > 0 and K % group_size == 0,
                             lambda: f"{K} features are not a multiple of group {group_size}")
                torch._check(tuple(s.shape) == (E, N, K // group_size),
                             lambda: f"scale_{name} must be {(E, N, K // group_size)}, got {tuple(s.shape)}")
                torch._check(z is None or tuple(z.shape) == tuple(s.shape),
                             lambda: f"zero_{name} must be {tuple(s.shape)}, got {tuple(z.shape)}")
            else:
                torch._check(tuple(s.shape) == (E, N), lambda: f"scale_{name} must be {(E, N)}, got {tuple(s.shape)}")
                torch._check(z is None, lambda: f"{fmt} takes no zero point")
    torch._check(I2 % 2 == 0, lambda: f"the gate_up projection has an odd width {I2}")
    torch._check(bias_gate_up is None or tuple(bias_gate_up.shape) == (E, I2),
                 lambda: f"bias_gate_up must be [{E}, {I2}], got {tuple(bias_gate_up.shape)}")
    torch._check(bias_down is None or tuple(bias_down.shape) == (E, H),
                 lambda: f"bias_down must be [{E}, {H}], got {tuple(bias_down.shape)}")


# --------------------------------------------------------------------- plan ----

PLANS = ("decode", "sorted", "grouped_mm", "reference")
# The decode kernels read each chosen expert once per token that chose it;
# the sorted path reads it once per BM tokens.  H100, CUDA-graph time of the
# experts op: at T = 8 the sorted path took 190 µs against decode's 311
# (Qwen3-30B-A3B, 64 slots) and 297 against 610 (gpt-oss-20b, 32 slots);
# at one token decode is the fast path (36 µs).  Between 9 and 31 slots is
# not measured.  plans.PLANS holds the measured choices per GPU and model.
DECODE_MAX_SLOTS = 16


def _grouped_mm_ok(dtype: torch.dtype, fmt: str, device: torch.device | None) -> bool:
    if dtype != torch.bfloat16 or fmt != "none" or not hasattr(torch, "_grouped_mm"):
        return False
    if device is None or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def moe_experts_plan(T: int, E: int, H: int, I: int, k: int, dtype: torch.dtype, fmt: str = "none",
                     device: torch.device | str | None = None) -> str:
    """The path ``fusepass::moe_experts`` takes on CUDA for T tokens: "decode"
    (few tokens: the two decode kernels, no routing step), "sorted" (slots
    sorted by expert, grouped tl.dot kernels), "grouped_mm" (the same sort,
    ``torch._grouped_mm`` for the two GEMMs) or "reference" (plain torch:
    fp64, or a device without the kernels).  Measured plans for the GPU
    (``plans.PLANS``) first, else a heuristic."""
    if device is not None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
    if dtype not in _KERNEL_DTYPES or (device is not None and device.type != "cuda"):
        return "reference"
    measured = plans.lookup(T, E, H, I, k, dtype, fmt, device)
    if measured is not None and (measured != "grouped_mm" or _grouped_mm_ok(dtype, fmt, device)):
        return measured
    if T * k <= DECODE_MAX_SLOTS:
        return "decode"
    if T * k >= 16384 and _grouped_mm_ok(dtype, fmt, device):
        return "grouped_mm"
    return "sorted"


def experts_fwd(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w_gate_up: Tensor, w_down: Tensor,
                bias_gate_up: Tensor | None, bias_down: Tensor | None, scale_gate_up: Tensor | None,
                zero_gate_up: Tensor | None, scale_down: Tensor | None, zero_down: Tensor | None, activation: str,
                gate_layout: str, transposed: bool, fmt: str, group_size: int, alpha: float, limit: float,
                plan: str | None = None, cfg=None) -> Tensor:
    """The experts through the Triton kernels (operands as the op checked them).
    ``plan`` and ``cfg`` override the plan and its tiles (tests, sweeps)."""
    T, H = x.shape
    out = _tiles.workspace((T, H), x.dtype, x.device)
    if T == 0 or topk_ids.shape[1] == 0:
        return out.zero_()
    with on_device(x):
        return _launches(x, topk_ids, topk_weights, w_gate_up, w_down, bias_gate_up, bias_down, scale_gate_up,
                         zero_gate_up, scale_down, zero_down, activation, gate_layout, transposed, fmt, group_size,
                         alpha, limit, plan, cfg, out, _tiles.ran)


def _launches(x, topk_ids, topk_weights, w_gate_up, w_down, bias_gate_up, bias_down, scale_gate_up, zero_gate_up,
              scale_down, zero_down, activation, gate_layout, transposed, fmt, group_size, alpha, limit, plan, cfg,
              out, go) -> Tensor:
    """The plan's launches, each run now or put in the graph being traced (``go``)."""
    T, H = x.shape
    k = topk_ids.shape[1]
    E = w_gate_up.shape[0]
    I = w_gate_up.shape[2 if transposed else 1] // 2
    if x.stride(-1) != 1:
        x = x.contiguous()
    ids, tw = topk_ids.contiguous(), topk_weights.contiguous()
    b1 = None if bias_gate_up is None else bias_gate_up.contiguous()
    b2 = None if bias_down is None else bias_down.contiguous()
    if fmt != "none":  # packed weights, scales and zeros are read with unit inner strides
        w_gate_up, w_down = w_gate_up.contiguous(), w_down.contiguous()
        scale_gate_up, scale_down = scale_gate_up.contiguous(), scale_down.contiguous()
        zero_gate_up = None if zero_gate_up is None else zero_gate_up.contiguous()
        zero_down = None if zero_down is None else zero_down.contiguous()
    group = group_size if fmt == "int4" else 0
    # (CPU tensors reach the kernels only under the interpreter: plan as for a GPU.)
    plan = plan or moe_experts_plan(T, E, H, I, k, x.dtype, fmt, x.device if x.is_cuda else None)
    halves = gate_layout == "halves"
    args = (x, ids, tw, w_gate_up, w_down, b1, b2, scale_gate_up, zero_gate_up, scale_down, zero_down, activation,
            halves, transposed, fmt, group, alpha, limit)
    if plan == "decode":
        cfg = cfg or decode.decode_heuristic(T, k, H, I, transposed, sm_count(x.device), group,
                                             dot=decode.dot_down_fits(x.dtype, w_down.dtype, fmt, transposed),
                                             plain16=fmt == "none" and w_gate_up.element_size() == 2)
        return decode.launch_decode(*args, cfg, out, go)
    if plan == "sorted":
        return prefill.launch_sorted(*args, cfg or prefill.sorted_heuristic(T, k, E, group), out, go)
    if plan == "grouped_mm":
        return prefill.launch_grouped_mm(x, ids, tw, w_gate_up, w_down, b1, b2, activation, halves, transposed,
                                         alpha, limit, out, go)
    raise ValueError(f"unknown plan {plan!r}; one of {PLANS}")


def moe_experts_traced(x, topk_ids, topk_weights, w_gate_up, w_down, bias_gate_up, bias_down, scale_gate_up,
                       zero_gate_up, scale_down, zero_down, activation, gate_layout, transposed, fmt, group_size,
                       alpha, limit) -> Tensor:
    """The op's launches as nodes of the graph (the inlined form), planned now for
    this token count; buffers between launches are allocated in the graph."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return _launches(x, topk_ids, topk_weights, w_gate_up, w_down, bias_gate_up, bias_down, scale_gate_up,
                     zero_gate_up, scale_down, zero_down, activation, gate_layout, transposed, fmt, group_size, alpha,
                     limit, None, None, out, _tiles.traced)


def _inline_ok(x, topk_ids, topk_weights, w_gate_up, w_down, bias_gate_up, bias_down, scale_gate_up, zero_gate_up,
               scale_down, zero_down, activation, gate_layout, transposed, fmt, group_size, alpha, limit) -> bool:
    # The plan and its tiles depend on T: a symbolic T (dynamic=True) goes
    # through the op, which plans per call.
    tensors = [t for t in (x, topk_ids, topk_weights, w_gate_up, w_down, bias_gate_up, bias_down, scale_gate_up,
                           zero_gate_up, scale_down, zero_down) if t is not None]
    try:
        _check(x, topk_ids, topk_weights, w_gate_up, w_down, bias_gate_up, bias_down, scale_gate_up, zero_gate_up,
               scale_down, zero_down, activation, gate_layout, transposed, fmt, group_size)
    except RuntimeError:  # the op's call raises the error itself
        return False
    return (inline_enabled(x) and x.dtype in _KERNEL_DTYPES and topk_ids.shape[1] > 0 and x.shape[0] != 0
            and all(isinstance(s, int) for t in tensors for s in (*t.shape, *t.stride())))


# ----------------------------------------------------------------------- op ----


def _reference_out(x, topk_ids, topk_weights, w_gate_up, w_down, bias_gate_up, bias_down, scale_gate_up,
                   zero_gate_up, scale_down, zero_down, activation, gate_layout, transposed, fmt, group_size, alpha,
                   limit) -> Tensor:
    cd = torch.float64 if x.dtype == torch.float64 else torch.float32
    return moe_experts_reference(x, topk_ids, topk_weights, w_gate_up, w_down, bias_gate_up, bias_down,
                                 scale_gate_up, zero_gate_up, scale_down, zero_down, activation, gate_layout,
                                 transposed, fmt, group_size, alpha, limit, cd).contiguous()


@torch.library.custom_op("fusepass::moe_experts", mutates_args=())
def moe_experts(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w_gate_up: Tensor, w_down: Tensor,
                bias_gate_up: Tensor | None, bias_down: Tensor | None, scale_gate_up: Tensor | None,
                zero_gate_up: Tensor | None, scale_down: Tensor | None, zero_down: Tensor | None, activation: str,
                gate_layout: str, transposed: bool, fmt: str, group_size: int, alpha: float, limit: float) -> Tensor:
    """sum_j topk_weights[:, j] * expert_{topk_ids[:, j]}(x), [T, H] contiguous in x's dtype (module docstring).
    This body serves CPU and every non-CUDA device."""
    _check(x, topk_ids, topk_weights, w_gate_up, w_down, bias_gate_up, bias_down, scale_gate_up, zero_gate_up,
           scale_down, zero_down, activation, gate_layout, transposed, fmt, group_size)
    return _reference_out(x, topk_ids, topk_weights, w_gate_up, w_down, bias_gate_up, bias_down, scale_gate_up,
                          zero_gate_up, scale_down, zero_down, activation, gate_layout, transposed, fmt, group_size,
                          alpha, limit)


@moe_experts.register_fake
def _moe_experts_fake(x, topk_ids, topk_weights, w_gate_up, w_down, bias_gate_up, bias_down, scale_gate_up,
                      zero_gate_up, scale_down, zero_down, activation, gate_layout, transposed, fmt, group_size, alpha,
                      limit):
    _check(x, topk_ids, topk_weights, w_gate_up, w_down, bias_gate_up, bias_down, scale_gate_up, zero_gate_up,
           scale_down, zero_down, activation, gate_layout, transposed, fmt, group_size)
    return x.new_empty(x.shape)


@moe_experts.register_kernel("cuda")
def _moe_experts_cuda(x, topk_ids, topk_weights, w_gate_up, w_down, bias_gate_up, bias_down, scale_gate_up,
                      zero_gate_up, scale_down, zero_down, activation, gate_layout, transposed, fmt, group_size, alpha,
                      limit):
    args = (x, topk_ids, topk_weights, w_gate_up, w_down, bias_gate_up, bias_down, scale_gate_up, zero_gate_up,
            scale_down, zero_down, activation, gate_layout, transposed, fmt, group_size)
    _check(*args)
    if x.dtype not in _KERNEL_DTYPES:  # fp64: the reference
        return _reference_out(*args, alpha, limit)
    return run_kernel("moe_experts", lambda: experts_fwd(*args, alpha, limit),
                      lambda: _reference_out(*args, alpha, limit))


register_inline(torch.ops.fusepass.moe_experts.default, _inline_ok, moe_experts_traced)
