"""Residual add + RMSNorm -> ``fusepass::add_rms_norm``.

    h = x + residual
    y = rms_norm(h, w, eps)            (any form of :mod:`fusepass.patterns.rms_norm`)
    returns (y, h)

The decoder's residual stream: ``h`` is both the norm's input and the next
residual, so the kernel writes both and reads ``x`` and ``residual`` once --
one pass instead of the add's write and the norm's re-read.  It runs before
``rms_norm`` so that the add is still there when it looks.
"""

from __future__ import annotations

import torch

from fusepass.kernels.rms_norm import add_rms_norm_call
from fusepass.match import MatchInfo, same, shape_str
from fusepass.patterns import rms_norm as norm
from fusepass.rule import Form, Rule

aten = torch.ops.aten


def _form(search_norm, flags):
    offset, cast_before_weight = flags

    def search(x, residual, weight, eps):
        h = x + residual
        return search_norm(h, weight, eps), h

    def replace(x, residual, weight, eps):
        out = torch.promote_types(x.dtype, weight.dtype) if cast_before_weight else x.dtype
        return add_rms_norm_call(x, residual, weight, eps, offset, cast_before_weight, out)

    return search, replace


_FORMS = {  # same order as rms_norm's forms: most specific first
    "zero_centred": (norm.search_zero_centred, (1.0, False)),
    "torch": (norm.search_torch, (0.0, False)),
    "hf": (norm.search_hf, (0.0, True)),
    "no_upcast": (norm.search_no_upcast, (0.0, True)),
}


def example_inputs(dtype):
    return [torch.randn(4, 16, dtype=dtype), torch.randn(4, 16, dtype=dtype), torch.randn(16, dtype=dtype)]


def check(m: MatchInfo) -> str | None:
    x, r = m.val("x"), m.val("residual")
    if not isinstance(r, torch.Tensor):
        return "the residual is a Python number, not a tensor"
    if x.dtype != r.dtype:
        return f"residual add mixes {x.dtype} and {r.dtype}"
    if x.dim() != r.dim() or not all(same(a, b) for a, b in zip(x.shape, r.shape)):
        return f"residual add broadcasts {shape_str(x)} with {shape_str(r)}"
    return norm.check_norm(m, x_name="x")


RULE = Rule(
    name="add_rms_norm",
    forms=[Form(name, *_form(search, flags)) for name, (search, flags) in _FORMS.items()],
    example_inputs=example_inputs,
    check=check,
    scalars={"eps": 1e-6},
    anchor=aten.rsqrt.default,
    priority=10,
    commutative_root=True,
    doc=__doc__,
)
