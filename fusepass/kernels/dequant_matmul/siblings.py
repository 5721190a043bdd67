"""The op ``fusepass::dequant_matmul_siblings``: two or three quantized linears
of one format that read the same x (q / k / v, gate / up), in one GEMV launch.

    y_i = x @ dequant(W_i)^T (+ b_i)

Where the plan for the group (its rows laid end to end, one weight of
sum N_i rows) is the GEMV, one grid reads every weight through its own
pointers (``gemv._dequant_gemv_siblings_kernel``, the one-weight GEMV's loop
over the whole of K): one launch's ramp instead of one a weight, which at one
token is most of a small weight's time (Llama-3-8B's k / v, 2 MB of int4:
3.6 µs a launch for 0.8 µs of bytes on an H200).  Elsewhere (more rows, a
plan that is not the GEMV) each weight goes through ``dequant_matmul`` as
before.  fusepass's own formats (int4, int8, fp8) and bitsandbytes' code books
(nf4, fp4: the absmax of each block as int4's scale, the table in the zero
point's place, no zero point; with double quantization each weight's absmax
bytes as its scale and its three tables in ``nested``, laid end to end)."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from fusepass.formats import CODEBOOKS, KERNEL_DTYPES, out_features
from fusepass.kernels._common import call, inline_enabled, on_device, register_inline, run_kernel
from fusepass.kernels.dequant_matmul.config import Config
from fusepass.kernels.dequant_matmul.launch import MAX_SIBLINGS, SIBLING_FORMATS, sibling_fits, siblings_launch
from fusepass.kernels.dequant_matmul.op import _check as _check_one
from fusepass.kernels.dequant_matmul.op import _operands, _plan, _reference_out, dequant_matmul_fwd


def group_plan(M: int, Ns: list[int], K: int, fmt: str, group_size: int, dtype: torch.dtype,
               device: torch.device) -> Config | None:
    """The GEMV config for the group (the plan of one weight of sum N_i rows, over
    the whole of K), or None where that plan is not a GEMV the grid runs (``sibling_fits``)."""
    G = _kernel_group(fmt, group_size)
    cfg = _plan(M, sum(Ns), K, fmt, G, dtype, device)
    if not sibling_fits(cfg, fmt, G):
        return None
    return dataclasses.replace(cfg, split=1)


def _kernel_group(fmt: str, group_size: int) -> int:
    return group_size if fmt == "int4" or fmt in CODEBOOKS else 0  # (int8 / fp8: per channel)


def per_weight(nested: list[Tensor] | None, n: int) -> list[list[Tensor] | None]:
    """The flat ``nested`` (three tensors a weight, or None) cut per weight."""
    return [None] * n if not nested else [list(nested[3 * i:3 * i + 3]) for i in range(n)]


def _check(x, weights, scales, zeros, biases, fmt, group_size, nested=None) -> None:
    torch._check(fmt in SIBLING_FORMATS, lambda: f"fmt must be one of {SIBLING_FORMATS}, got {fmt!r}")
    torch._check(2 <= len(weights) <= MAX_SIBLINGS, lambda: f"2 to {MAX_SIBLINGS} weights, got {len(weights)}")
    torch._check(len(scales) == len(zeros) == len(biases) == len(weights),
                 lambda: "one scale, zero (or None) and bias (or None) per weight")
    torch._check(len({z is None for z in zeros}) == 1, lambda: "zero points on every weight or on none")
    torch._check(not nested or len(nested) == 3 * len(weights),
                 lambda: "nested: (nested absmax, code, offset) for every weight, end to end")
    for w, s, z, b, q in zip(weights, scales, zeros, biases, per_weight(nested, len(weights))):
        _check_one(x, w, s, z, b, fmt, group_size, nested=q)


def _each(x, weights, scales, zeros, biases, fmt, group_size, nested=None) -> list[Tensor]:
    return [_reference_out(x, w, s, z, b, fmt, group_size, nested=q)
            for w, s, z, b, q in zip(weights, scales, zeros, biases, per_weight(nested, len(weights)))]


def _group_args(x, weights, scales, zeros, biases, fmt, group_size, nested=None):
    """(x2, operands per weight, G, cfg, nested per weight or None) for one launch, or None where the
    group goes weight by weight."""
    K = x.shape[-1]
    M = x.numel() // K if K else 0
    G = _kernel_group(fmt, group_size)
    if x.dtype not in KERNEL_DTYPES or M == 0 or K == 0:
        return None
    Ns = [out_features(w, fmt, s) for w, s in zip(weights, scales)]
    cfg = group_plan(M, Ns, K, fmt, group_size, x.dtype, x.device)
    if cfg is None:
        return None
    ops = [_operands(x, w, s, z, b) for w, s, z, b in zip(weights, scales, zeros, biases)]
    nests = None if not nested else [[t.contiguous() for t in q] for q in per_weight(nested, len(weights))]
    return ops[0][0], ops, G, cfg, nests


def _group_launch(x, got, fmt):
    """(the group's launch, its outputs [M, N_i]) from ``_group_args``'s answer."""
    x2, ops, G, cfg, nests = got
    outs = [torch.empty((x2.shape[0], out_features(o[1], fmt, o[2])), dtype=x.dtype, device=x.device) for o in ops]
    launch = siblings_launch(x2, [o[1] for o in ops], [o[2] for o in ops], [o[3] for o in ops],
                             [o[4] for o in ops], outs, fmt, G, cfg, nests)
    return launch, outs


def dequant_matmul_siblings_fwd(x, weights, scales, zeros, biases, fmt, group_size, nested=None) -> list[Tensor]:
    """The op's CUDA body."""
    got = _group_args(x, weights, scales, zeros, biases, fmt, group_size, nested)
    if got is None:
        return [dequant_matmul_fwd(x, w, s, z, b, fmt, group_size, nested=q) if x.dtype in KERNEL_DTYPES
                else _reference_out(x, w, s, z, b, fmt, group_size, nested=q)
                for w, s, z, b, q in zip(weights, scales, zeros, biases, per_weight(nested, len(weights)))]
    launch, outs = _group_launch(x, got, fmt)
    with on_device(x):
        launch.run()
    return [y.view(*x.shape[:-1], y.shape[-1]) for y in outs]


@torch.library.custom_op("fusepass::dequant_matmul_siblings", mutates_args=())
def dequant_matmul_siblings(x: Tensor, weights: list[Tensor], scales: list[Tensor], zeros: list[Tensor | None],
                            biases: list[Tensor | None], fmt: str, group_size: int,
                            nested: list[Tensor]) -> list[Tensor]:
    """[dequant_matmul(x, w_i, s_i, z_i, b_i, fmt, group_size, *nested[3 i:3 i + 3]) for each
    weight]; ``nested`` empty, or each weight's double quantization (nested absmax,
    code, offset) end to end.  This body serves CPU."""
    _check(x, weights, scales, zeros, biases, fmt, group_size, nested)
    return _each(x, weights, scales, zeros, biases, fmt, group_size, nested)


@dequant_matmul_siblings.register_fake
def _fake(x, weights, scales, zeros, biases, fmt, group_size, nested=None):
    _check(x, weights, scales, zeros, biases, fmt, group_size, nested)
    return [x.new_empty((*x.shape[:-1], out_features(w, fmt, s))) for w, s in zip(weights, scales)]


@dequant_matmul_siblings.register_kernel("cuda")
def _cuda(x, weights, scales, zeros, biases, fmt, group_size, nested=None):
    _check(x, weights, scales, zeros, biases, fmt, group_size, nested)
    return run_kernel("dequant_matmul_siblings",
                      lambda: dequant_matmul_siblings_fwd(x, weights, scales, zeros, biases, fmt, group_size, nested),
                      lambda: _each(x, weights, scales, zeros, biases, fmt, group_size, nested))


# ------------------------------------------------------- calls in graphs ----


def _traced(x, weights, scales, zeros, biases, fmt, group_size, nested=None):
    launch, outs = _group_launch(x, _group_args(x, weights, scales, zeros, biases, fmt, group_size, nested), fmt)
    got = launch.traced()
    return [got[f"o{i}"].view(*x.shape[:-1], y.shape[-1]) for i, y in enumerate(outs)]


def _inline_ok(x, weights, scales, zeros, biases, fmt, group_size, nested=None) -> bool:
    # The plan needs M as a number; a group whose plan is not the GEMV stays an op call.
    return (inline_enabled(x) and x.dtype in KERNEL_DTYPES and fmt in SIBLING_FORMATS
            and all(isinstance(s, int) for s in (*x.shape, *x.stride()))
            and all(isinstance(s, int) for w in weights for s in (*w.shape, *w.stride()))
            and _group_args(x, weights, scales, zeros, biases, fmt, group_size, nested) is not None)


register_inline(torch.ops.fusepass.dequant_matmul_siblings.default, _inline_ok, _traced)


def dequant_matmul_siblings_call(x, weights, scales, zeros, biases, fmt, group_size, nested=None):
    """What the rule puts in a graph (the engine inlines it for a CUDA graph where it can)."""
    return call(torch.ops.fusepass.dequant_matmul_siblings.default, x, list(weights), list(scales), list(zeros),
                list(biases), fmt, group_size, list(nested or []))
