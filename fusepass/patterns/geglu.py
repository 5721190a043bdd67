"""GELU-gated MLP activation (GeGLU) -> ``fusepass::geglu``.

    y = gelu(gate) * up
    gelu(g) = g/2 * (1 + erf(g / sqrt(2)))                           approximate="none"
    gelu(g) = g/2 * (1 + tanh(sqrt(2/pi) * (g + 0.044715 g³)))       approximate="tanh" (Gemma)

Both GELU forms arrive decomposed (erf, or the tanh polynomial) in the
post-grad graph; each is traced per dtype.  Operand order and fused-projection
halves work as for :mod:`fusepass.patterns.swiglu`.
"""

from __future__ import annotations

import torch.nn.functional as F

from fusepass.kernels.gated_act import geglu_call
from fusepass.patterns.swiglu import check_gated, example_inputs
from fusepass.rule import Form, NearMiss, Rule


def _form(approximate: str) -> Form:
    def search(gate, up):
        return F.gelu(gate, approximate=approximate) * up

    def replace(gate, up):
        return geglu_call(gate, up, approximate)

    return Form("tanh" if approximate == "tanh" else "erf", search, replace)


def _nm_act_reused(gate, up):
    a = F.gelu(gate, approximate="tanh")
    return a * up, a.amax()


RULE = Rule(
    name="geglu",
    forms=[_form("tanh"), _form("none")],
    example_inputs=example_inputs,
    check=check_gated,
    commutative_root=True,
    near_misses=[
        NearMiss("activation also used", _nm_act_reused, example_inputs, "also used outside"),
        NearMiss("up broadcasts", lambda g, u: F.gelu(g) * u[:1], example_inputs, "broadcast"),
    ],
    doc=__doc__,
)
