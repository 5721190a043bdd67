"""Weight-only quantization of a model's ``nn.Linear`` layers, in plain torch.

    summary = fusepass.quantize(model, fmt="int4", group_size=128)
    print(summary)                        # layers converted, skipped and why, bytes before/after
    model = torch.compile(model, backend="fusepass")

Each converted layer's forward is exactly a form the ``dequant_matmul`` rules
match, so a model needs no quantization library to reach the fused op:

- ``Int8Linear``: symmetric per output channel, ``scale = absmax / 127``;
  ``F.linear(x, q.to(x.dtype) * scale[:, None], bias)``;
- ``Int4Linear``: asymmetric per group of ``group_size`` along K, ``scale =
  (max - min) / 15``, ``zero = round(-min / scale)`` (kept as a float of the
  layer's dtype, exact for 0..15), codes packed two per byte (low nibble the
  even column); ``F.linear(x, ((unpack(q) - zero) * scale).view(N, K), bias)``;
- ``Fp8Linear``: ``float8_e4m3fn`` per output channel, ``scale = absmax / 448``.

Expert stacks (``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] of an MoE
block's experts module: transformers' ``@use_experts_implementation`` classes,
or any module holding such 3-D parameters) are converted too, in place: the
parameters become stored codes, scales and zeros of the same formats per
expert ([E, N, K] codes, one scale per output channel, or per group of K), and
``gate_up_proj`` / ``down_proj`` become properties that dequantise the whole
stack in plain torch (``dequantize_stack``), in the layout the module had
([E, K, N] for gpt-oss's transposed experts), so every experts implementation
(``grouped_mm``, ``batched_mm``, the eager loop) runs unchanged; the
``moe_experts`` rule and the pre-trace path hand the stored codes to
``fusepass::moe_experts`` instead.

The scales are kept in the layer's dtype (the rules match scales in the
activation's dtype).  Quantized tensors are buffers, so ``state_dict`` saves
them and a freshly quantized model loads them back.  ``lm_head`` is left
alone by default (its logits are the most sensitive to rounding), and so are
layers whose weight is shared with another module (tied embeddings) or whose
K does not split into groups.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import quantize_tp as _tp
from .formats import FORMATS, FP8_MAX
from .formats import GROUP_SIZES as INT4_GROUP_SIZES
from .formats import dequantize_int4 as _dequantize_int4
from .formats import unpack_int4


class _QuantLinear(nn.Module):
    in_features: int
    out_features: int

    def _init_bias(self, linear: nn.Linear) -> None:
        self.in_features, self.out_features = linear.in_features, linear.out_features
        if linear.bias is not None:
            self.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int8Linear(_QuantLinear):
    """int8 [N, K] weight, one scale per output channel (symmetric)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self._init_bias(linear)
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
        self.register_buffer("weight", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(linear.weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype) * self.scale[:, None], self.bias)


class Fp8Linear(_QuantLinear):
    """float8_e4m3fn [N, K] weight, one scale per output channel."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self._init_bias(linear)
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
        self.register_buffer("weight", (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn))
        self.register_buffer("scale", scale.to(linear.weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype) * self.scale[:, None], self.bias)


class Int4Linear(_QuantLinear):
    """uint8 [N, K // 2] (two 4-bit codes per byte), scale and zero [N, K // group_size]."""

    def __init__(self, linear: nn.Linear, group_size: int = 128) -> None:
        super().__init__()
        self._init_bias(linear)
        self.group_size = group_size
        n, k = linear.weight.shape
        w = linear.weight.detach().float().reshape(n, k // group_size, group_size)
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)
        scale = ((hi - lo) / 15).clamp(min=1e-12)
        zero = torch.round(-lo / scale).clamp(0, 15)
        q = torch.round(w / scale[..., None] + zero[..., None]).clamp(0, 15).to(torch.uint8).reshape(n, k)
        self.register_buffer("weight", q[:, 0::2] | (q[:, 1::2] << 4))
        self.register_buffer("scale", scale.to(linear.weight.dtype))
        self.register_buffer("zero", zero.to(linear.weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, _dequantize_int4(self.weight, self.scale, self.zero, x.dtype), self.bias)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", group_size={self.group_size}"


def quantize_rows(w: torch.Tensor, fmt: str, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """[..., N, K] float weights -> (codes, scale, zero) as the linears store one weight: int8 and fp8
    symmetric per output channel, int4 asymmetric per group of K (codes packed two per byte)."""
    w = w.detach().float()
    if fmt == "int8":
        scale = w.abs().amax(dim=-1).clamp(min=1e-12) / 127
        return torch.round(w / scale[..., None]).clamp(-127, 127).to(torch.int8), scale, None
    if fmt == "fp8":
        scale = w.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
        return (w / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale, None
    *lead, k = w.shape
    g = w.reshape(*lead, k // group_size, group_size)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    zero = torch.round(-lo / scale).clamp(0, 15)
    q = torch.round(g / scale[..., None] + zero[..., None]).clamp(0, 15).to(torch.uint8).reshape(*lead, k)
    return q[..., 0::2] | (q[..., 1::2] << 4), scale, zero


def dequantize_stack(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, fmt: str,
                     dtype: torch.dtype) -> torch.Tensor:
    """The [E, N, K] expert stack in ``dtype``, as the quantized experts' properties compute it
    (the form the ``moe_experts`` rule finds): ``q * scale``, or ``(unpack(q) - zero) * scale`` per group."""
    if fmt != "int4":
        return q.to(dtype) * scale[..., None]
    E, N, groups = scale.shape
    w = unpack_int4(q).to(dtype).reshape(E, N, groups, -1)
    w = w - 8 if zero is None else w - zero[..., None]
    return (w * scale[..., None]).reshape(E, N, -1)


class QuantizedExperts(nn.Module):
    """Mixed into an experts module's class by :func:`quantize`: its expert stacks, stored
    quantized, read back as float stacks through properties (module docstring)."""

    _fusepass_fmt: str
    _fusepass_transposed: bool

    def _stack(self, name: str) -> torch.Tensor:
        zero = getattr(self, f"{name}_zero", None)
        w = dequantize_stack(getattr(self, f"{name}_q"), getattr(self, f"{name}_scale"), zero, self._fusepass_fmt,
                             getattr(self, f"{name}_scale").dtype)
        return w.transpose(1, 2) if self._fusepass_transposed else w

    @property
    def gate_up_proj(self) -> torch.Tensor:
        return self._stack("gate_up_proj")

    @property
    def down_proj(self) -> torch.Tensor:
        return self._stack("down_proj")


_quantized_classes: dict[type, type] = {}


def _is_experts(module: nn.Module) -> bool:
    params = module._parameters
    return all(isinstance(params.get(n), torch.Tensor) and params[n].dim() == 3 for n in ("gate_up_proj", "down_proj"))


def _experts_refusal(module: nn.Module, fmt: str, group_size: int, owners: dict[int, list[str]]) -> str | None:
    w1, w2 = module.gate_up_proj, module.down_proj
    transposed = bool(getattr(module, "is_transposed", False))
    k1, k2 = (w1.shape[1], w2.shape[1]) if transposed else (w1.shape[2], w2.shape[2])
    if w1.is_meta or w2.is_meta:
        return "weight on the meta device (load the weights first)"
    if len(owners.get(id(w1), ())) > 1 or len(owners.get(id(w2), ())) > 1:
        return "expert weights shared with another module: quantizing them would change it too"
    if not w1.dtype.is_floating_point or w1.dtype == torch.float64 or w2.dtype != w1.dtype:
        return f"weight dtypes {w1.dtype}, {w2.dtype}: fusepass quantizes fp32/fp16/bf16 experts"
    if not getattr(module, "has_gate", True) or getattr(module, "has_post_expert_norm", False):
        return "experts without a gate_up projection or with a post-expert norm: not fusepass::moe_experts's"
    if _tp.is_sharded(w1) or _tp.is_sharded(w2):
        return "tensor-parallel expert stacks: not converted (each rank would quantize a shard of an expert)"
    if fmt == "int4" and (k1 % group_size or k2 % group_size):
        return f"K = {k1} (gate_up) and {k2} (down) are not both multiples of group_size {group_size}"
    return None


def _quantize_experts(module: nn.Module, fmt: str, group_size: int) -> None:
    transposed = bool(getattr(module, "is_transposed", False))
    dtype = module.gate_up_proj.dtype
    for name in ("gate_up_proj", "down_proj"):
        w = getattr(module, name)
        q, scale, zero = quantize_rows(w.transpose(1, 2) if transposed else w, fmt, group_size)
        del module._parameters[name]
        module.register_buffer(f"{name}_q", q.to(w.device))
        module.register_buffer(f"{name}_scale", scale.to(device=w.device, dtype=dtype))
        if zero is not None:
            module.register_buffer(f"{name}_zero", zero.to(device=w.device, dtype=dtype))
    cls = type(module)
    if cls not in _quantized_classes:
        _quantized_classes[cls] = type(f"Quantized{cls.__name__}", (QuantizedExperts, cls), {})
    module.__class__ = _quantized_classes[cls]
    module._fusepass_fmt = fmt
    module._fusepass_transposed = transposed
    module._fusepass_group_size = group_size if fmt == "int4" else 0


@dataclass
class QuantizeSummary:
    """What :func:`quantize` did: converted layers, skipped ones with the reason, bytes."""

    fmt: str
    group_size: int | None
    converted: list[str] = field(default_factory=list)  # linear layers and experts modules
    experts: list[str] = field(default_factory=list)  # the experts modules among them
    skipped: list[tuple[str, str]] = field(default_factory=list)
    bytes_before: int = 0  # parameters and buffers of the converted layers, before
    bytes_after: int = 0

    @property
    def bytes_saved(self) -> int:
        return self.bytes_before - self.bytes_after

    def __str__(self) -> str:
        what = f"{self.fmt}" + (f" (group {self.group_size})" if self.fmt == "int4" else "")
        mib = 2.0 ** 20
        stacks = f" (and {len(self.experts)} experts modules)" if self.experts else ""
        lines = [f"fusepass.quantize: {len(self.converted) - len(self.experts)} linear layers{stacks} to {what}; "
                 f"{self.bytes_before / mib:.2f} MiB -> {self.bytes_after / mib:.2f} MiB "
                 f"({self.bytes_saved / mib:.2f} MiB saved"
                 + (f", {self.bytes_after / self.bytes_before:.0%} of before)" if self.bytes_before else ")")]
        lines += [f"  skipped {name}: {reason}" for name, reason in self.skipped]
        return "\n".join(lines)


def _nbytes(module: nn.Module) -> int:
    return _tp.local_nbytes(module)  # a sharded layer's bytes on this rank


def _quantized(linear: nn.Linear, fmt: str, group_size: int) -> nn.Module:
    return {"int8": Int8Linear, "fp8": Fp8Linear}[fmt](linear) if fmt != "int4" else Int4Linear(linear, group_size)


def _default_filter(name: str, module: nn.Linear) -> bool:
    return name.split(".")[-1] != "lm_head"


def quantize(model: nn.Module, fmt: str = "int8", group_size: int = 128,
             filter: Callable[[str, nn.Linear], bool] | None = None) -> QuantizeSummary:
    """Replace ``model``'s ``nn.Linear`` layers in place by weight-only quantized ones.

    ``filter(name, module) -> bool`` chooses the layers (default: all but
    ``lm_head``).  Layers on the meta device, with a shared (tied) weight, or
    (int4) with K not a multiple of ``group_size`` are left as they are; the
    summary says which and why.
    """
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    if fmt == "int4" and group_size not in INT4_GROUP_SIZES:
        # A layer of another group size would convert, then every rewrite be
        # refused at compile time: the model slower than before, not faster.
        raise ValueError(f"int4 group_size must be one of {', '.join(map(str, INT4_GROUP_SIZES))} (the group "
                         f"sizes fusepass's int4 kernel has), got {group_size}")
    choose = filter or _default_filter
    summary = QuantizeSummary(fmt, group_size if fmt == "int4" else None)
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append(f"{name}.{pname}" if name else pname)
    for name, module in list(model.named_modules()):
        if _is_experts(module) and not isinstance(module, QuantizedExperts) and choose(name, module):
            reason = _experts_refusal(module, fmt, group_size, owners)
            if reason:
                summary.skipped.append((name, reason))
                continue
            before = _nbytes(module)
            with torch.no_grad():
                _quantize_experts(module, fmt, group_size)
            summary.bytes_before += before
            summary.bytes_after += _nbytes(module)
            summary.converted.append(name)
            summary.experts.append(name)
            continue
        if not isinstance(module, nn.Linear) or not choose(name, module):
            continue
        w = module.weight
        reason = None
        if w.is_meta:
            reason = "weight on the meta device (load the weights first)"
        elif len(owners.get(id(w), ())) > 1:
            others = [o for o in owners[id(w)] if o != f"{name}.weight"]
            reason = f"weight shared with {', '.join(others)} (tied): quantizing it would change them too"
        elif not w.dtype.is_floating_point or w.dtype == torch.float64:
            reason = f"weight dtype {w.dtype}: fusepass quantizes fp32/fp16/bf16 layers"
        elif _tp.is_sharded(w) and (tp_reason := _tp.refusal(module, fmt, group_size)):
            reason = f"tensor-parallel: {tp_reason}"  # see quantize_tp: each rank quantizes its own shard
        elif fmt == "int4" and module.in_features % group_size:
            reason = f"K = {module.in_features} is not a multiple of group_size {group_size}"
        if reason:
            summary.skipped.append((name, reason))
            continue
        make = functools.partial(_quantized, fmt=fmt, group_size=group_size)
        with torch.no_grad():
            new = _tp.convert(module, make) if _tp.is_sharded(w) else make(module)
        new.to(w.device)
        summary.bytes_before += _nbytes(module)
        summary.bytes_after += _nbytes(new)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
        summary.converted.append(name)
    return summary


def parallelize_module(module: nn.Module, device_mesh, parallelize_plan) -> nn.Module:
    """torch's ``parallelize_module`` for a model :func:`quantize` converted before it was sharded.

    torch's ``ColwiseParallel`` and ``RowwiseParallel`` take ``nn.Linear`` only.
    Here each quantized layer the plan names (a key may be a module path with
    ``*`` patterns, as torch reads them) is cut in place to this rank's shard
    (:func:`fusepass.quantize_tp.shard_quantized`: column-parallel by output
    channel, row-parallel by its slice of K, int4 in whole groups) with the
    style's input and output hooks, and runs as a layer quantized after
    sharding does; the rest of the plan goes to torch's own function.  Every
    rank must hold the same full quantized weights (one seed, or one
    checkpoint), as torch's function assumes of full weights.  A quantized
    layer the plan cannot shard (another style, a mesh of more than one
    dimension, int4 groups that would straddle two ranks) raises ``ValueError``
    before anything is changed.
    """
    from fnmatch import fnmatch

    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

    quantized = (Int8Linear, Int4Linear, Fp8Linear)
    single = not isinstance(parallelize_plan, dict)  # one style for ``module`` itself
    if single:
        parallelize_plan = {"": parallelize_plan}
    names = [n for n, _ in module.named_modules()]
    ours: list[tuple[str, object]] = []
    rest: dict[str, object] = {}
    for key, style in parallelize_plan.items():
        atoms = key.split(".") if key else []
        hits = [n for n in names if len(n.split(".") if n else []) == len(atoms)
                and all(fnmatch(a, p) for a, p in zip(n.split("."), atoms))]
        mine = [n for n in hits if isinstance(module.get_submodule(n), quantized)]
        ours += [(n, style) for n in mine]
        if not mine:
            rest[key] = style
        else:
            rest.update({n: style for n in hits if n not in mine})
    for name, style in ours:  # every refusal before anything changes
        reason = _tp.shard_refusal(module.get_submodule(name), style, device_mesh)
        if reason:
            raise ValueError(f"fusepass.parallelize_module: {name or type(module).__name__}: {reason}")
    if rest:
        torch_parallelize(module, device_mesh, rest[""] if single else rest)
    for name, style in ours:
        _tp.shard_quantized(module.get_submodule(name), style, device_mesh)
    return module


# ``fusepass.quantize`` is this function once the package is imported; the
# layer classes ride on it so that ``fusepass.quantize.Int8Linear`` names them.
quantize.Int8Linear = Int8Linear  # type: ignore[attr-defined]
quantize.Int4Linear = Int4Linear  # type: ignore[attr-defined]
quantize.Fp8Linear = Fp8Linear  # type: ignore[attr-defined]
quantize.QuantizeSummary = QuantizeSummary  # type: ignore[attr-defined]
quantize.QuantizedExperts = QuantizedExperts  # type: ignore[attr-defined]
