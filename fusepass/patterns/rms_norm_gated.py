"""Gated RMSNorm (the norm after every Gated DeltaNet / linear-attention layer) -> ``fusepass::rms_norm_gated``.

    n = x / sqrt(mean(x², -1) + eps)                        in fp32
    y = (w * n.to(x.dtype)) * silu(z.float())  -> x.dtype  ``hf``      (Qwen3-Next, Qwen3.5, Qwen3.5-MoE,
                                                                        OLMo-hybrid, Qwen4-exp)
    y = (w.float() * n) * sigmoid(z.float())   -> x.dtype  ``fp32_weight_sigmoid`` (Kimi-Linear,
                                                                        Bailing-hybrid, GLM-5-next)

over the last dim (the head dim), any leading dims; z (the gate) has x's
shape.  Every ``...RMSNormGated`` module in transformers 5.23 is one of these
two forms, with a plain weight (initialised to ones, not ``1 + w``); the
``hf`` form's ``*`` with the bf16 weight is a bf16 multiply, the gate's
activation is computed in fp32.  The other two combinations (silu with an
fp32 weight, sigmoid with the cast) are declared as well: they cost nothing
and a model mixing the two is one edit away.

The rule runs before ``rms_norm`` and ``swiglu``: the first would take the
norm alone (leaving a separate pass over x for the gate), the second refuses
the ``silu(z.float()) * h`` multiply as mixed dtypes.

Not this rule: the Mamba-2 family's ``MambaRMSNormGated`` (Mamba-2, Bamba,
Nemotron-H, Granite-MoE-hybrid, Zamba2) gates *before* a grouped norm
(``norm(x * silu(z))`` over groups of the row), FalconH1 reshapes into groups
first; both are left to the other rules and Inductor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fusepass.formats import KERNEL_DTYPES as SUPPORTED
from fusepass.kernels.rms_norm_gated import rms_norm_gated_call
from fusepass.match import MatchInfo, same, shape_str
from fusepass.rule import Form, NearMiss, Rule

_ACTS = {"silu": F.silu, "sigmoid": torch.sigmoid}


def _normed(x, eps):
    h = x.to(torch.float32)
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


def _form(name: str, cast_before_weight: bool, activation: str) -> Form:
    act = _ACTS[activation]
    if cast_before_weight:
        def search(x, gate, weight, eps):
            h = weight * _normed(x, eps).to(x.dtype)
            return (h * act(gate.to(torch.float32))).to(x.dtype)
    else:
        def search(x, gate, weight, eps):
            h = weight.to(torch.float32) * _normed(x, eps)
            return (h * act(gate.to(torch.float32))).to(x.dtype)

    def replace(x, gate, weight, eps):
        return rms_norm_gated_call(x, gate, weight, eps, cast_before_weight, activation)

    return Form(name, search, replace)


FORMS = [
    _form("hf", True, "silu"),
    _form("fp32_weight_sigmoid", False, "sigmoid"),
    _form("fp32_weight", False, "silu"),
    _form("hf_sigmoid", True, "sigmoid"),
]


def example_inputs(dtype):
    return [torch.randn(4, 16, dtype=dtype), torch.randn(4, 16, dtype=dtype), torch.randn(16, dtype=dtype)]


def check(m: MatchInfo) -> str | None:
    x, z, w = m.val("x"), m.val("gate"), m.val("weight")
    if not all(isinstance(t, torch.Tensor) for t in (x, z, w)):
        return "x, gate or weight is a Python number, not a tensor"
    # A number, or a 0-dim tensor read at run time (dynamic=True's unspecialised float).
    reason = m.scalar_refusal("eps", x)
    if reason:
        return reason
    for name, t in (("input", x), ("gate", z), ("weight", w)):
        if t.dtype not in SUPPORTED:
            return f"{name} dtype {t.dtype} has no kernel (fp32/fp16/bf16 only)"
    # The pattern's roundings (n.to(x.dtype), the final cast) are literal
    # dtypes of the trace: x must have the traced dtype for them to be x's.
    if x.dtype != m.dtype:
        return f"input is {x.dtype}, but the matched roundings are to {m.dtype}"
    if m.dtype == torch.float32 and z.dtype != torch.float32:
        return f"gate is {z.dtype}: its activation is not computed in fp32"
    if x.dim() == 0:
        return "input is a scalar"
    if z.dim() != x.dim() or not all(same(a, b) for a, b in zip(z.shape, x.shape)):
        return f"gate {shape_str(z)} broadcasts with the input {shape_str(x)}"
    if w.dim() != 1 or not same(w.shape[0], x.shape[-1]):
        return f"weight shape {shape_str(w)} is not (head_dim,) = ({x.shape[-1]},)"
    if x.device.type not in ("cuda", "cpu"):
        return f"no fusepass kernel for device {x.device.type}"
    if z.device != x.device or w.device != x.device:
        return f"input on {x.device}, gate on {z.device}, weight on {w.device}"
    return None


# -- near-misses --------------------------------------------------------------------------


def _hf(x, z, w, eps=1e-6):
    h = w * _normed(x, eps).to(x.dtype)
    return h, F.silu(z.to(torch.float32))


def _nm_var_reused(x, z, w):
    h = x.to(torch.float32)
    var = h.pow(2).mean(-1, keepdim=True)
    n = w * (h * torch.rsqrt(var + 1e-6)).to(x.dtype)
    return (n * F.silu(z.to(torch.float32))).to(x.dtype), var


def _nm_gate_broadcast(x, z, w):
    h, _ = _hf(x, z, w)
    return (h * F.silu(z[:1].to(torch.float32))).to(x.dtype)


def _nm_gelu(x, z, w):
    h, _ = _hf(x, z, w)
    return (h * F.gelu(z.to(torch.float32))).to(x.dtype)


def _nm_gate_first(x, z, w):
    # Mamba-2's norm_before_gate=False: the gate multiplies x before the norm.
    h = x.to(torch.float32) * F.silu(z.to(torch.float32))
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


def _nm_silu_of_normed(x, z, w):
    # The activation on the normalised value, the gate plain.
    h, _ = _hf(x, z, w)
    return (F.silu(h.to(torch.float32)) * z.to(torch.float32)).to(x.dtype)


def _nm_eps_per_row(x, z, w, eps):
    h = w * _normed(x, eps).to(x.dtype)
    return (h * F.silu(z.to(torch.float32))).to(x.dtype)


def _nm_weight_2d(x, z, w):
    h, a = _hf(x, z, w)
    return (h * a).to(x.dtype)


def _nm_act_reused(x, z, w):
    h, a = _hf(x, z, w)
    return (h * a).to(x.dtype), a


def _bf16(dt):
    return example_inputs(torch.bfloat16)


def _bf16_2d_weight(dt):
    return [torch.randn(4, 16, dtype=torch.bfloat16), torch.randn(4, 16, dtype=torch.bfloat16),
            torch.randn(1, 16, dtype=torch.bfloat16)]


RULE = Rule(
    name="rms_norm_gated",
    forms=FORMS,
    example_inputs=example_inputs,
    check=check,
    scalars={"eps": 1e-6},
    # Above add_rms_norm (10), rms_norm and swiglu (0): each would take a part of it.
    priority=20,
    commutative_root=True,
    # The half-precision forms' casts make the near-misses' shapes differ from
    # fp32's: they are written in bf16, whatever dtype the caller asks for.
    near_misses=[
        NearMiss("variance also returned", _nm_var_reused, _bf16, "also used outside"),
        NearMiss("activation also returned", _nm_act_reused, _bf16, "also used outside"),
        NearMiss("gate broadcasts", _nm_gate_broadcast, _bf16, "broadcast"),
        NearMiss("gelu gate", _nm_gelu, _bf16, ""),
        NearMiss("gate before the norm", _nm_gate_first, _bf16, ""),
        NearMiss("silu of the normalised value", _nm_silu_of_normed, _bf16, ""),
        NearMiss("eps per row", _nm_eps_per_row,
                 lambda dt: [*_bf16(dt), torch.full((4, 1), 1e-6)], "not one number per call"),
        NearMiss("weight (1, head_dim)", _nm_weight_2d, _bf16_2d_weight, "weight shape"),
    ],
    doc=__doc__,
)
