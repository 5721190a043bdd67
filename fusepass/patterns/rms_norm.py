"""RMSNorm -> ``fusepass::rms_norm``.

    y = x / sqrt(mean(x², -1) + eps) * w          (plain)
    y = x / sqrt(mean(x², -1) + eps) * (1 + w)    (zero-centred: Gemma, Qwen3-Next, Qwen3.5)

over the last dim, any leading dims, any eps: a constant, or a 0-dim tensor
the op reads when it runs (``dynamic=True`` makes a Python float a graph
input: see :func:`fusepass.match.scalar_input`).  The forms below are the
ones real model code takes after tracing:

- ``hf``: Llama-style: upcast to fp32, normalise, cast back, then times the
  weight (``weight * h.to(input_dtype)``) -- two roundings in half precision;
- ``no_upcast``: the same written without the fp32 upcast;
- ``torch``: ``F.rms_norm`` / ``nn.RMSNorm`` (eps arrives as ``add.Scalar``
  rounded to fp32; the weight multiply happens in fp32, one rounding);
- ``zero_centred``: ``(x̂ * (1 + w.float())).type_as(x)``.

The weight multiply commutes, so each form also matches with its operands
swapped.  ``rms_norm_call`` puts the Triton kernel itself in a CUDA graph (Inductor
launches it) and the op elsewhere.  The op reproduces each form's rounding (``cast_before_weight``),
so a rewrite changes results by at most the dtype's rounding.

On CUDA a norm of attention heads (``head_norm``: the q / k norms of Qwen3,
Qwen3.5 and Qwen3-Next, rows of at most 256 taken from wider rows) is left to
Inductor with the reason: Inductor computes it inside its RoPE and cache-write kernel, where a
fusepass launch per norm came first.  Qwen3-30B-A3B-shaped, 2 layers, H200:
decode step 331.1 -> 325.7 µs, prefill T = 2048 3.40 -> 2.90 ms (Inductor
434.9 µs and 3.25 ms).
"""

from __future__ import annotations

import operator

import torch
import torch.fx
import torch.nn.functional as F

from fusepass.formats import KERNEL_DTYPES as SUPPORTED
from fusepass.kernels.rms_norm import rms_norm_call
from fusepass.match import RESHAPES, MatchInfo, same, scalar_input, shape_str, tensor_scalar_refusal
from fusepass.rule import Form, NearMiss, Rule

aten = torch.ops.aten


def _normed(x, eps, upcast):
    h = x.to(torch.float32) if upcast else x
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


def search_hf(x, weight, eps):
    return weight * _normed(x, eps, True).to(x.dtype)


def replace_hf(x, weight, eps):
    out = torch.promote_types(x.dtype, weight.dtype)
    return rms_norm_call(x, weight, eps, 0.0, True, out)


def search_no_upcast(x, weight, eps):
    return weight * _normed(x, eps, False)


def search_torch(x, weight, eps):
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def replace_torch(x, weight, eps):
    return rms_norm_call(x, weight, eps, 0.0, False, x.dtype)


def search_zero_centred(x, weight, eps):
    return (_normed(x, eps, True) * (1.0 + weight.float())).type_as(x)


def replace_zero_centred(x, weight, eps):
    return rms_norm_call(x, weight, eps, 1.0, False, x.dtype)


def example_inputs(dtype):
    return [torch.randn(4, 16, dtype=dtype), torch.randn(16, dtype=dtype)]


def check_norm(m: MatchInfo, x_name: str = "x") -> str | None:
    """Checks shared with add_rms_norm."""
    x, w = m.val(x_name), m.val("weight")
    # A number, or a 0-dim tensor read at run time (dynamic=True's unspecialised float).
    reason = m.scalar_refusal("eps", x)
    if reason:
        return reason
    if x.dtype not in SUPPORTED:
        return f"input dtype {x.dtype} has no kernel (fp32/fp16/bf16 only)"
    if w.dtype not in SUPPORTED:
        return f"weight dtype {w.dtype} has no kernel (fp32/fp16/bf16 only)"
    if x.dim() == 0:
        return "input is a scalar"
    if w.dim() != 1 or not same(w.shape[0], x.shape[-1]):
        return f"weight shape {shape_str(w)} is not (hidden,) = ({x.shape[-1]},)"
    if x.device.type not in ("cuda", "cpu"):
        return f"no fusepass kernel for device {x.device.type}"
    if x.device != w.device:
        return f"input on {x.device}, weight on {w.device}"
    return None


# Widest rows a norm of heads may have to be left to Inductor (head dims: 64-256).
HEAD_ROWS = 256
HEAD_NORM = "a norm of attention heads"  # how its refusal's reason starts


def head_norm(m: MatchInfo) -> str | None:
    """Why a norm of attention heads on CUDA (rows of at most HEAD_ROWS, x a view,
    slice or split piece of wider rows: the q / k norms of Qwen3, and of Qwen3.5
    and Qwen3-Next, whose query is half of each head's row beside its gate) is
    left to Inductor, which computes it in the kernel of the RoPE and cache
    write after it; a fusepass launch per norm cost more than it saved there
    (measured on Qwen3-30B-A3B's: the module docstring)."""
    x, xv = m.inputs.get("x"), m.val("x")
    if not isinstance(x, torch.fx.Node) or xv.device.type != "cuda" or xv.dim() < 2:
        return None
    D = xv.shape[-1]
    if not isinstance(D, int) or D > HEAD_ROWS:
        return None
    while True:
        x = _under(x)
        if x is None:
            return None
        val = x.meta.get("val")
        wide = val.shape[-1] if isinstance(val, torch.Tensor) and val.dim() else D
        if isinstance(wide, int) and wide > D and wide % D == 0:
            return (f"{HEAD_NORM} (rows of {D}, a view of rows of {wide}): left to Inductor, which "
                    f"fuses it into the kernel after it (RoPE, the cache write)")


def _under(x: torch.fx.Node) -> torch.fx.Node | None:
    """The tensor a view, a slice or a split's piece (Qwen3.5's query beside its
    gate) was taken from, or None."""
    if x.target in RESHAPES or x.target == aten.slice.Tensor:
        src = x.args[0]
    elif x.target is operator.getitem and isinstance(x.args[0], torch.fx.Node) \
            and x.args[0].target in (aten.split.Tensor, aten.split_with_sizes.default):
        src = x.args[0].args[0]
    else:
        return None
    return src if isinstance(src, torch.fx.Node) else None


def check(m: MatchInfo) -> str | None:
    return check_norm(m) or head_norm(m)


def _arg(node: torch.fx.Node, i: int):
    return node.args[i] if len(node.args) > i else None


def explain(rsqrt: torch.fx.Node) -> str | None:
    """Why an ``rsqrt(mean(x²) + eps)`` that no form took was left alone."""
    add = rsqrt.args[0]
    if not (isinstance(add, torch.fx.Node) and add.target in (aten.add.Tensor, aten.add.Scalar)):
        return None
    mean = add.args[0]
    if not (isinstance(mean, torch.fx.Node) and mean.target == aten.mean.dim):
        return None
    sq = mean.args[0]
    if not (isinstance(sq, torch.fx.Node) and sq.target in (aten.pow.Tensor_Scalar, aten.mul.Tensor)):
        return None  # not a mean of squares: not an RMSNorm attempt
    src = sq.args[0]
    while isinstance(src, torch.fx.Node) and src.target == torch.ops.prims.convert_element_type.default:
        src = src.args[0]  # the dtype the user's tensor had before the upcast
    val = src.meta.get("val") if isinstance(src, torch.fx.Node) else None
    if isinstance(val, torch.Tensor) and val.dtype not in SUPPORTED:
        return f"input dtype {val.dtype} has no kernel (fp32/fp16/bf16 only)"
    dims, keepdim = _arg(mean, 1), _arg(mean, 2)
    if dims is not None and list(dims) != [-1]:
        return f"mean over dim {list(dims)}, not the last dim"
    if not keepdim:
        return "mean with keepdim=False: the result broadcasts differently from a row norm"
    if sq.target == aten.pow.Tensor_Scalar and sq.args[1] != 2:
        return f"mean of x**{sq.args[1]}, not of x**2"
    eps = scalar_input(add.args[1])
    if isinstance(eps, torch.fx.Node) and isinstance(val, torch.Tensor):
        reason = tensor_scalar_refusal("eps", eps, val)
        if reason:
            return reason
    for n in (sq, mean, add, rsqrt):
        if len(n.users) > 1:
            users = ", ".join(u.name for u in n.users)
            return f"intermediate {n.name} is also used outside the norm (users: {users})"
    return "the normalised value is not multiplied by a (hidden,) weight in a form fusepass knows"


def _nm_var_reused(x, w):
    h = x.float()
    var = h.pow(2).mean(-1, keepdim=True)
    return w * (h * torch.rsqrt(var + 1e-6)).to(x.dtype), var


def _nm_first_dim(x, w):
    h = x.float()
    return w[:, None] * (h * torch.rsqrt(h.pow(2).mean(0, keepdim=True) + 1e-6)).to(x.dtype)


def _nm_no_keepdim(x, w):
    # Square input: mean(-1) without keepdim broadcasts along the *rows*.
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1) + 1e-6)).to(x.dtype)


def _nm_eps_per_row(x, w, eps):
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _nm_weight_2d(x, w):
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


def _sq(dtype):
    return [torch.randn(8, 8, dtype=dtype), torch.randn(8, dtype=dtype)]


RULE = Rule(
    name="rms_norm",
    forms=[
        # Most specific first: in fp32 a (1 + w) weight also fits "hf" with
        # weight := 1 + w; the zero-centred form names it right.
        Form("zero_centred", search_zero_centred, replace_zero_centred),
        Form("torch", search_torch, replace_torch),
        Form("hf", search_hf, replace_hf),
        Form("no_upcast", search_no_upcast, replace_hf),
    ],
    example_inputs=example_inputs,
    check=check,
    scalars={"eps": 1e-6},
    anchor=aten.rsqrt.default,
    explain=explain,
    commutative_root=True,
    near_misses=[
        NearMiss("variance also returned", _nm_var_reused, _sq, "also used outside"),
        NearMiss("mean over dim 0", _nm_first_dim, _sq, "not the last dim"),
        NearMiss("keepdim=False", _nm_no_keepdim, _sq, "keepdim=False"),
        NearMiss("eps per row", _nm_eps_per_row,
                 lambda dt: [*_sq(dt), torch.full((8, 1), 1e-6)], "not one number per call"),
        NearMiss("weight (1, hidden)", _nm_weight_2d,
                 lambda dt: [torch.randn(8, 8, dtype=dt), torch.randn(1, 8, dtype=dt)], "weight shape"),
    ],
    doc=__doc__,
)
