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


@dataclass
class QuantizeSummary:
    """What :func:`quantize` did: converted layers, skipped ones with the reason, bytes."""

    fmt: str
    group_size: int | None
    converted: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    bytes_before: int = 0  # parameters and buffers of the converted layers, before
    bytes_after: int = 0

    @property
    def bytes_saved(self) -> int:
        return self.bytes_before - self.bytes_after

    def __str__(self) -> str:
        what = f"{self.fmt}" + (f" (group {self.group_size})" if self.fmt == "int4" else "")
        mib = 2.0 ** 20
        lines = [f"fusepass.quantize: {len(self.converted)} linear layers to {what}; "
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


# ``fusepass.quantize`` is this function once the package is imported; the
# layer classes ride on it so that ``fusepass.quantize.Int8Linear`` names them.
quantize.Int8Linear = Int8Linear  # type: ignore[attr-defined]
quantize.Int4Linear = Int4Linear  # type: ignore[attr-defined]
quantize.Fp8Linear = Fp8Linear  # type: ignore[attr-defined]
quantize.QuantizeSummary = QuantizeSummary  # type: ignore[attr-defined]
