"""All-reduce (sum) of a tensor-parallel partial result, the residual add, and RMSNorm.

    h = all_reduce_sum(x, group)            over the ranks of ``group_name``
    h = h + residual                        when a residual is given (in x's dtype)
    y = rms_norm(h, w, eps)                 as ``fusepass::rms_norm`` (weight_offset, cast_before_weight)
    returns (y, h)

The boundary of every tensor-parallel decoder layer: the attention output
and MLP down projections are row-parallel, each rank holds a partial sum,
and the all-reduce that joins them feeds the residual add and the next
norm.  ``h`` is both the norm's input and the next residual.

Paths:

- CPU (gloo) and every non-CUDA device: the functional collective
  (``_c10d_functional.all_reduce`` + ``wait_tensor``, what Dynamo makes of
  ``dist.all_reduce``), then the plain-torch ``add_rms_norm`` reference;
- CUDA: the same collective (NCCL), then ``fusepass::add_rms_norm``'s Triton
  kernel (or ``rms_norm``'s without a residual).  Correct for any world size.

Not here yet: one kernel that all-reduces and normalises in one pass.  For
decode-sized inputs (a few tokens x hidden: 16 KB at one bf16 token of 8192)
the collective is latency-bound, and a one-shot all-reduce over symmetric
memory (``torch.distributed._symmetric_memory``: every rank's buffer mapped
into every other's, each rank loads all peers' rows, sums them in fp32, adds
the residual, normalises and stores y and h, one launch, no NCCL) is how
such a kernel gets its speed; two-shot (reduce-scatter, normalise the own
rows, all-gather) or NCCL plus this path above a size to be measured.  It
needs a GPU machine with several cards to write and check, so the op's
signature is the hook where it will go: the rule does not change.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fusepass.kernels._common import call, eps_args, op_eps, register_inline, run_kernel
from fusepass.kernels.rms_norm import (
    _add_rms_norm_ref_out,
    _check_residual,
    _inline_ok,
    _kernel_handles,
    _traced,
    add_rms_norm_fwd,
    rms_norm_fwd,
    rms_norm_reference,
)

_c10d = torch.ops._c10d_functional


def all_reduce_sum(x: Tensor, group_name: str) -> Tensor:
    """``x`` summed over the ranks of ``group_name``, waited for; x is left as it was."""
    return _c10d.wait_tensor(_c10d.all_reduce(x.contiguous(), "sum", group_name))


# ------------------------------------------------------------------- ops ----


def _reference(h, residual, weight, eps, weight_offset, cast_before_weight, out_dtype):
    """The op after its collective, in plain torch."""
    if residual is None:
        return rms_norm_reference(h, weight, eps, weight_offset, cast_before_weight, out_dtype).contiguous(), h
    return _add_rms_norm_ref_out(h, residual, weight, eps, weight_offset, cast_before_weight, out_dtype)


@torch.library.custom_op("fusepass::all_reduce_rms_norm", mutates_args=())
def all_reduce_rms_norm(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor,
    eps: float,
    weight_offset: float,
    cast_before_weight: bool,
    out_dtype: torch.dtype,
    group_name: str,
    eps_tensor: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(rms_norm(h), h) with h = all_reduce_sum(x) (+ residual), contiguous,
    x's shape; ``eps_tensor`` as for ``fusepass::rms_norm``.  This body serves
    CPU and every non-CUDA device."""
    eps = op_eps(eps, eps_tensor)
    h = all_reduce_sum(x, group_name)
    return _reference(h, residual, weight, eps, weight_offset, cast_before_weight, out_dtype)


@all_reduce_rms_norm.register_fake
def _all_reduce_rms_norm_fake(x, residual, weight, eps, weight_offset, cast_before_weight, out_dtype, group_name,
                              eps_tensor=None):
    if residual is not None:
        _check_residual(x, residual)
    op_eps(eps, eps_tensor)
    return x.new_empty(x.shape, dtype=out_dtype), x.new_empty(x.shape)


@all_reduce_rms_norm.register_kernel("cuda")
def _all_reduce_rms_norm_cuda(x, residual, weight, eps, weight_offset, cast_before_weight, out_dtype, group_name,
                              eps_tensor=None):
    eps = op_eps(eps, eps_tensor)
    h = all_reduce_sum(x, group_name)
    args = (h, residual, weight, eps, weight_offset, cast_before_weight, out_dtype)
    if not _kernel_handles(h, weight, out_dtype, residual):
        return _reference(*args)

    def launch():
        if residual is None:
            # h is the collective's own fresh buffer: the op's second output as it is.
            return rms_norm_fwd(h, weight, eps, weight_offset, cast_before_weight, out_dtype), h
        return add_rms_norm_fwd(h, residual, weight, eps, weight_offset, cast_before_weight, out_dtype)

    # The collective has run: a failing kernel falls back to the reference on its result.
    return run_kernel("all_reduce_rms_norm", launch, lambda: _reference(*args))


# ------------------------------------------------------- calls in graphs ----
#
# Inlined, the op is the functional collective (which Inductor schedules as
# its own, as it would the model's all-reduce) followed by the norm kernel's
# launch: no dispatcher trip for the norm, the same kernel as the op's CUDA body.


def _op_inline_ok(x, residual, weight, eps, weight_offset, cast_before_weight, out_dtype, group_name,
                  eps_tensor=None):
    return eps_tensor is None and _inline_ok(x, weight, eps, out_dtype, residual)


def _op_inline(x, residual, weight, eps, weight_offset, cast_before_weight, out_dtype, group_name, eps_tensor=None):
    h = all_reduce_sum(x, group_name)
    out = _traced(h, residual, weight, eps, weight_offset, cast_before_weight, out_dtype)
    return out if residual is not None else (out, h)


register_inline(torch.ops.fusepass.all_reduce_rms_norm.default, _op_inline_ok, _op_inline)


def all_reduce_rms_norm_call(x, residual, weight, eps, weight_offset, cast_before_weight, out_dtype, group_name):
    """What the rule puts in a graph: the collective and the norm kernel's launch
    when the engine inlines kernels for a CUDA graph, else the op.  ``eps`` is a
    number or a 0-dim tensor (see :func:`fusepass.match.scalar_input`)."""
    eps, eps_tensor = eps_args(eps)
    return call(torch.ops.fusepass.all_reduce_rms_norm.default, x, residual, weight, eps, weight_offset,
                cast_before_weight, out_dtype, group_name, eps_tensor)
