"""The op ``fusepass::dequant_matmul_gated``: an MLP's gate and up projections,
two quantized linears of one x, and the gated activation between them, in one
GEMV launch.

    y = act(x @ dequant(W0)^T + b0) * (x @ dequant(W1)^T + b1)     act: silu, gelu, gelu (tanh)

with the model's roundings: ``fusepass::swiglu`` / ``geglu`` of two
``fusepass::dequant_matmul`` calls (each product rounded to x's dtype, the
activation rounded, the product rounded).  Where the two weights' plan as
siblings is a GEMV of an even number of rows a program (the one-token plans),
one grid reads both weights and applies the activation before its one store
(``gemv._dequant_gemv_gated_kernel``): no launch and no round trip of gate
and up between the GEMV and the activation kernel.  Elsewhere the siblings op
and the gated_act kernel run as before.  The siblings' formats: fusepass's own
(int4, int8, fp8) and bitsandbytes' code books (nf4, fp4)."""

from __future__ import annotations

import torch
from torch import Tensor

from fusepass.formats import KERNEL_DTYPES, out_features
from fusepass.kernels._common import call, inline_enabled, on_device, register_inline, run_kernel
from fusepass.kernels.dequant_matmul.launch import SIBLING_FORMATS, gated_fits, gated_launch
from fusepass.kernels.dequant_matmul.siblings import _check as _check_siblings
from fusepass.kernels.dequant_matmul.siblings import _each, _group_args, dequant_matmul_siblings_fwd
from fusepass.kernels.gated_act import gated_act_fwd, geglu_reference, swiglu_reference

# the activation's names here, and gated_act_fwd's for the same
ACTIVATIONS = {"silu": "silu", "gelu": "none", "gelu_tanh": "tanh"}


def _check(x, weights, scales, zeros, biases, fmt, group_size, activation, nested=None) -> None:
    torch._check(activation in ACTIVATIONS,
                 lambda: f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    torch._check(len(weights) == 2, lambda: f"two weights (gate, up), got {len(weights)}")
    _check_siblings(x, weights, scales, zeros, biases, fmt, group_size, nested)
    n0, n1 = (out_features(w, fmt, s) for w, s in zip(weights, scales))
    torch._check(n0 == n1, lambda: f"gate has {n0} output features, up {n1}")


def _act(gate: Tensor, up: Tensor, activation: str) -> Tensor:
    if activation == "silu":
        return swiglu_reference(gate, up)
    return geglu_reference(gate, up, ACTIVATIONS[activation])


def _reference(x, weights, scales, zeros, biases, fmt, group_size, activation, nested=None) -> Tensor:
    return _act(*_each(x, weights, scales, zeros, biases, fmt, group_size, nested), activation)


def _gated_args(x, weights, scales, zeros, biases, fmt, group_size, nested=None):
    """The siblings' one-launch arguments where the gated kernel takes them, else None."""
    got = _group_args(x, weights, scales, zeros, biases, fmt, group_size, nested)
    if got is None or not gated_fits(got[3], fmt):
        return None
    ops = got[1]
    for i in (1, 2, 3):  # one layout for the two weights: the kernel reads both with one set of strides
        a, b = ops[0][i], ops[1][i]
        if (a is None) != (b is None) or (a is not None and (a.shape != b.shape or a.stride() != b.stride())):
            return None
    return got


def _launch(x, got, fmt, activation):
    x2, ops, G, cfg, nests = got
    N = out_features(ops[0][1], fmt, ops[0][2])
    out = torch.empty((x2.shape[0], N), dtype=x.dtype, device=x.device)
    launch = gated_launch(x2, [o[1] for o in ops], [o[2] for o in ops], [o[3] for o in ops], [o[4] for o in ops],
                          out, fmt, G, cfg, activation, nests)
    return launch, out


def dequant_matmul_gated_fwd(x, weights, scales, zeros, biases, fmt, group_size, activation, nested=None) -> Tensor:
    """The op's CUDA body."""
    got = _gated_args(x, weights, scales, zeros, biases, fmt, group_size, nested)
    if got is None:
        gate, up = dequant_matmul_siblings_fwd(x, weights, scales, zeros, biases, fmt, group_size, nested)
        if gate.dtype not in KERNEL_DTYPES or gate.numel() == 0:
            return _act(gate, up, activation)
        return gated_act_fwd(gate, up, ACTIVATIONS[activation])
    launch, out = _launch(x, got, fmt, activation)
    with on_device(x):
        launch.run()
    return out.view(*x.shape[:-1], out.shape[-1])


@torch.library.custom_op("fusepass::dequant_matmul_gated", mutates_args=())
def dequant_matmul_gated(x: Tensor, weights: list[Tensor], scales: list[Tensor], zeros: list[Tensor | None],
                         biases: list[Tensor | None], fmt: str, group_size: int, activation: str,
                         nested: list[Tensor]) -> Tensor:
    """act(dequant_matmul(x, w_0, ...)) * dequant_matmul(x, w_1, ...) (``nested`` as the
    siblings op's).  This body serves CPU."""
    _check(x, weights, scales, zeros, biases, fmt, group_size, activation, nested)
    return _reference(x, weights, scales, zeros, biases, fmt, group_size, activation, nested)


@dequant_matmul_gated.register_fake
def _fake(x, weights, scales, zeros, biases, fmt, group_size, activation, nested=None):
    _check(x, weights, scales, zeros, biases, fmt, group_size, activation, nested)
    return x.new_empty((*x.shape[:-1], out_features(weights[0], fmt, scales[0])))


@dequant_matmul_gated.register_kernel("cuda")
def _cuda(x, weights, scales, zeros, biases, fmt, group_size, activation, nested=None):
    _check(x, weights, scales, zeros, biases, fmt, group_size, activation, nested)
    return run_kernel("dequant_matmul_gated",
                      lambda: dequant_matmul_gated_fwd(x, weights, scales, zeros, biases, fmt, group_size, activation,
                                                       nested),
                      lambda: _reference(x, weights, scales, zeros, biases, fmt, group_size, activation, nested))


# ------------------------------------------------------- calls in graphs ----


def _traced(x, weights, scales, zeros, biases, fmt, group_size, activation, nested=None):
    launch, out = _launch(x, _gated_args(x, weights, scales, zeros, biases, fmt, group_size, nested), fmt,
                          activation)
    return launch.traced()["out"].view(*x.shape[:-1], out.shape[-1])


def _inline_ok(x, weights, scales, zeros, biases, fmt, group_size, activation, nested=None) -> bool:
    # The plan needs M as a number; where the kernel does not take the pair the op call stays.
    return (inline_enabled(x) and fmt in SIBLING_FORMATS and activation in ACTIVATIONS
            and all(isinstance(s, int) for s in (*x.shape, *x.stride()))
            and all(isinstance(s, int) for w in weights for s in (*w.shape, *w.stride()))
            and _gated_args(x, weights, scales, zeros, biases, fmt, group_size, nested) is not None)


register_inline(torch.ops.fusepass.dequant_matmul_gated.default, _inline_ok, _traced)


def dequant_matmul_gated_call(x, weights, scales, zeros, biases, fmt, group_size, activation, nested=None):
    """What the rule puts in a graph (the engine inlines it for a CUDA graph where it can)."""
    return call(torch.ops.fusepass.dequant_matmul_gated.default, x, list(weights), list(scales), list(zeros),
                list(biases), fmt, group_size, activation, list(nested or []))
