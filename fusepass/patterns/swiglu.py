"""SiLU-gated MLP activation -> ``fusepass::swiglu``.

    y = silu(gate) * up,   silu(g) = g * sigmoid(g) = g / (1 + exp(-g))

Inductor decomposes SiLU before fusepass sees the graph: in half precision it
is upcast -> neg -> exp -> add -> div -> downcast, then the multiply; in fp32
the casts vanish.  The search function is written in plain torch and traced
per dtype, so the pattern is that decomposition.  ``up * silu(gate)`` (the
Phi-3 order) matches through the swapped variant, and gate and up may be the
two halves of one fused projection (``gate_up_proj(x).chunk(2, -1)``): the
kernel reads them in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fusepass.formats import KERNEL_DTYPES as SUPPORTED
from fusepass.kernels.gated_act import swiglu_call
from fusepass.match import MatchInfo, same, shape_str
from fusepass.rule import Form, NearMiss, Rule


def search(gate, up):
    return F.silu(gate) * up


def replace(gate, up):
    return swiglu_call(gate, up)


def example_inputs(dtype):
    return [torch.randn(4, 16, dtype=dtype), torch.randn(4, 16, dtype=dtype)]


def check_gated(m: MatchInfo) -> str | None:
    """Checks shared with geglu."""
    gate, up = m.val("gate"), m.val("up")
    if not isinstance(up, torch.Tensor) or not isinstance(gate, torch.Tensor):
        return "gate or up is a Python number, not a tensor"
    if gate.dtype != up.dtype:
        return f"gate is {gate.dtype}, up is {up.dtype}: mixed dtypes"
    if gate.dtype not in SUPPORTED:
        return f"dtype {gate.dtype} has no kernel (fp32/fp16/bf16 only)"
    if gate.dim() != up.dim() or not all(same(a, b) for a, b in zip(gate.shape, up.shape)):
        return f"gate {shape_str(gate)} and up {shape_str(up)} broadcast"
    if gate.device != up.device or gate.device.type not in ("cuda", "cpu"):
        return f"no fusepass kernel for gate on {gate.device}, up on {up.device}"
    return None


def _nm_act_reused(gate, up):
    a = F.silu(gate)
    return a * up, a.sum()


def _nm_broadcast(gate, up):
    return F.silu(gate) * up[:1]


def _nm_mixed(gate, up):
    return F.silu(gate) * up.double()


RULE = Rule(
    name="swiglu",
    forms=[Form("silu_mul", search, replace)],
    example_inputs=example_inputs,
    check=check_gated,
    commutative_root=True,
    near_misses=[
        NearMiss("activation also used", _nm_act_reused, example_inputs, "also used outside"),
        NearMiss("up broadcasts", _nm_broadcast, example_inputs, "broadcast"),
        NearMiss("mixed dtypes", _nm_mixed, example_inputs, "mixed dtypes"),
    ],
    doc=__doc__,
)
