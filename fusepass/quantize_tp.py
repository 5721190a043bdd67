""":func:`fusepass.quantize` on a tensor-parallel model: each rank quantizes its own shard.

A sharded ``nn.Linear`` holds its weight as a ``DTensor`` (transformers'
``tp_plan``, torch's ``parallelize_module``): ``Shard(0)`` column-parallel
(each rank a slice of the output channels), ``Shard(1)`` row-parallel (a
slice of K, partial sums joined by an all-reduce), ``Replicate`` whole on
every rank.  Each rank quantizes its local shard (``DTensor.to_local``): a
per-channel scale covers the rank's own slice of K, an int4 group lies in
one shard.  The quantized layer keeps the parallel forward the linear had:

- transformers wraps each planned module's ``forward`` (``tp_forward``, a
  closure over its parallel style and mesh).  The style is installed again
  on the new layer, which says that it computes on local tensors
  (``_hf_quantized_needs_local_tp``, transformers' flag for quantized
  layers): column-parallel layers take the replicated input and return
  their shard of the output, row-parallel ones their partial sum, which the
  style all-reduces before it adds the bias (kept as the original ``DTensor``
  parameter).
- torch's ``parallelize_module`` leaves forward hooks that turn the input
  into a ``DTensor`` and the output back; they move to the new layer, whose
  forward computes on the local shard and returns the output as the
  ``DTensor`` the linear would have (``Shard(-1)``, or the reduced sum).

Refused, with the reason: a weight sharded over a mesh of more than one
dimension or in a packed layout (``_StridedShard``), a forward wrapped by a
parallel style fusepass does not know, and (int4) shards of K that are not
whole groups: a group would straddle two ranks.

The other order, quantized first and sharded after (torch's styles take
``nn.Linear`` only): :func:`shard_quantized` cuts a quantized layer to its
rank's rows or slice of K and gives it the style's hooks, so that it runs as
the layer :func:`convert` would have made (``fusepass.parallelize_module``).
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Callable

import torch
from torch import nn

COLWISE, ROWWISE, REPLICATED = "colwise", "rowwise", "replicated"


def is_sharded(t: object) -> bool:
    """Whether ``t`` is a ``DTensor`` (a tensor-parallel parameter)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def layout(weight) -> tuple[str | None, str | None]:
    """(kind, reason): ``COLWISE``/``ROWWISE``/``REPLICATED`` for a 1-D mesh's
    plain placements, else None and why fusepass leaves the layer alone."""
    from torch.distributed.tensor import Replicate, Shard

    mesh = weight.device_mesh
    if mesh.ndim != 1:
        return None, f"weight sharded over a {mesh.ndim}-D device mesh: fusepass quantizes 1-D tensor parallelism"
    (p,) = weight.placements
    if isinstance(p, Replicate):
        return REPLICATED, None
    if type(p) is Shard and p.dim in (0, -2):
        return COLWISE, None
    if type(p) is Shard and p.dim in (1, -1):
        return ROWWISE, None
    return None, f"weight placement {p} (a packed or strided shard): fusepass quantizes Shard(0), Shard(1) or Replicate"


def shard_sizes(n: int, world: int) -> list[int]:
    """How ``Shard`` splits ``n`` over ``world`` ranks (torch.chunk: equal chunks, the last ones short or empty)."""
    chunk = -(-n // world) if n else 0
    return [max(0, min(chunk, n - r * chunk)) for r in range(world)]


def _style(module: nn.Module):
    """transformers' parallel style and mesh wrapped around ``module.forward``, or (None, None)."""
    fwd = module.__dict__.get("forward")
    if fwd is None or getattr(fwd, "__name__", "") != "tp_forward":
        return None, None
    try:
        closure = inspect.getclosurevars(fwd).nonlocals
    except (TypeError, ValueError):
        return None, None
    if closure.get("module") is not module:
        return None, None
    return closure.get("self"), closure.get("mesh")


def _has_hooks(module: nn.Module) -> bool:
    return bool(module._forward_pre_hooks or module._forward_hooks)


def refusal(module: nn.Linear, fmt: str, group_size: int) -> str | None:
    """Why ``module`` (a linear with a ``DTensor`` weight) is not quantized, or None."""
    kind, reason = layout(module.weight)
    if reason:
        return reason
    style, _ = _style(module)
    if "forward" in module.__dict__ and style is None:
        return "its forward is wrapped by something other than a transformers parallel style"
    if style is not None:
        from transformers.distributed.tensor_parallel import ColwiseParallel, RowwiseParallel

        expected = {COLWISE: ColwiseParallel, ROWWISE: RowwiseParallel}.get(kind)
        if expected is None or not isinstance(style, expected):
            return (f"parallel style {type(style).__name__} on a {kind} weight: fusepass keeps ColwiseParallel "
                    "and RowwiseParallel layers")
    if fmt == "int4":
        if kind == ROWWISE:
            return _straddle(module.in_features, module.weight.device_mesh.size(), group_size)
        if module.in_features % group_size:
            return f"K = {module.in_features} is not a multiple of group_size {group_size}"
    return None


def _straddle(k: int, world: int, group_size: int) -> str | None:
    """Why K = ``k`` cut over ``world`` ranks row-parallel breaks int4 groups, or None."""
    sizes = shard_sizes(k, world)
    if any(s % group_size for s in sizes):
        return (f"K = {k} is split over {world} ranks into shards of {sizes}: int4 groups of {group_size} "
                "would straddle a shard (each shard of K must be whole groups)")
    return None


def _local_linear(module: nn.Linear) -> nn.Linear:
    """A plain ``nn.Linear`` holding this rank's shard of ``module`` (weight and bias)."""
    w = module.weight.to_local().detach()
    b = module.bias
    b = None if b is None else (b.to_local() if is_sharded(b) else b).detach()
    local = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device="meta", dtype=w.dtype)
    local.weight = nn.Parameter(w, requires_grad=False)
    if b is not None:
        local.bias = nn.Parameter(b, requires_grad=False)
    return local


def local_nbytes(module: nn.Module) -> int:
    """Bytes of ``module``'s parameters and buffers held on this rank."""
    total = 0
    for t in (*module.parameters(), *module.buffers()):
        t = t.to_local() if is_sharded(t) else t
        total += t.numel() * t.element_size()
    return total


def convert(module: nn.Linear, make: Callable[[nn.Linear], nn.Module]) -> nn.Module:
    """The quantized layer ``make`` builds from this rank's shard of ``module``, with its parallel forward."""
    kind, _ = layout(module.weight)
    new = make(_local_linear(module))
    new.__class__ = _sharded_class(type(new))
    new.tp_kind = kind
    new.tp_mesh = module.weight.device_mesh
    # The full sizes, as the linear had them: transformers' styles rebuild an
    # output DTensor from ``out_features``.
    new.in_features, new.out_features = module.in_features, module.out_features
    if module.bias is not None:
        new._parameters["bias"] = module.bias  # the DTensor: the styles localise or add it themselves
    style, mesh = _style(module)
    if style is not None:
        new._hf_quantized_needs_local_tp = True
        style.install_forward(new, mesh)
    elif _has_hooks(module):
        _move_hooks(module, new)
    return new


def _move_hooks(src: nn.Module, dst: nn.Module) -> None:
    """``src``'s forward hooks (torch's parallel styles' input and output conversions) onto ``dst``."""
    for attr in ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                 "_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
        setattr(dst, attr, getattr(src, attr))


def shard_refusal(layer: nn.Module, style: object, mesh) -> str | None:
    """Why a layer :func:`fusepass.quantize` converted cannot be cut into ``mesh``'s
    shards by ``style``, or None (:func:`shard_quantized`)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    group_size = getattr(layer, "group_size", None)  # int4's; int8 and fp8 have none

    if is_sharded(layer.weight) or isinstance(layer, _Sharded):
        return "already sharded"
    if not isinstance(style, (ColwiseParallel, RowwiseParallel)):
        return (f"parallel style {type(style).__name__}: fusepass shards its quantized layers with "
                "ColwiseParallel or RowwiseParallel")
    if mesh.ndim != 1:
        return f"a {mesh.ndim}-D device mesh: fusepass shards for 1-D tensor parallelism"
    if isinstance(style, RowwiseParallel) and group_size:
        return _straddle(layer.in_features, mesh.size(), group_size)
    return None


def shard_quantized(layer: nn.Module, style: object, mesh) -> None:
    """Cut a quantized layer, in place, to this rank's shard, with ``style``'s parallel forward.

    Column-parallel (``ColwiseParallel``): the rows of its codes, scales, zero
    points and bias.  Row-parallel (``RowwiseParallel``): its slice of K (int4:
    whole groups, two codes a byte; the per-channel scales of int8 and fp8
    whole, as they scale each rank's partial sum alike), the bias whole, added
    once after the sum.  The style is applied to a stand-in ``nn.Linear`` on
    the meta device, whose input and output hooks move to the layer: the
    layer then runs as one :func:`convert` built from a sharded linear.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    reason = shard_refusal(layer, style, mesh)
    if reason:
        raise ValueError(f"fusepass: cannot shard {type(layer).__name__}: {reason}")
    group_size = getattr(layer, "group_size", None)
    kind = COLWISE if isinstance(style, ColwiseParallel) else ROWWISE
    n, k = layer.out_features, layer.in_features
    sizes = shard_sizes(n if kind == COLWISE else k, mesh.size())
    start, size = sum(sizes[:mesh.get_local_rank()]), sizes[mesh.get_local_rank()]
    stand_in = nn.Linear(k, n, bias=layer.bias is not None, device="meta")
    parallelize_module(stand_in, mesh, style)
    bias = layer.bias
    if kind == COLWISE:
        for name in ("weight", "scale", "zero"):
            t = getattr(layer, name, None)
            if t is not None:
                setattr(layer, name, t.narrow(0, start, size).clone())
        if bias is not None:
            bias = DTensor.from_local(bias.detach().narrow(0, start, size).clone(), mesh, [Shard(0)],
                                      run_check=False, shape=(n,), stride=(1,))
    else:
        per_byte = 2 if group_size else 1  # int4: two codes a byte, low nibble the even column
        layer.weight = layer.weight.narrow(1, start // per_byte, size // per_byte).clone()
        if group_size:
            layer.scale = layer.scale.narrow(1, start // group_size, size // group_size).clone()
            layer.zero = layer.zero.narrow(1, start // group_size, size // group_size).clone()
        if bias is not None:
            bias = DTensor.from_local(bias.detach(), mesh, [Replicate()], run_check=False)
    if bias is not None:
        layer._parameters["bias"] = nn.Parameter(bias, requires_grad=False)
    layer.__class__ = _sharded_class(type(layer))
    layer.tp_kind, layer.tp_mesh = kind, mesh
    _move_hooks(stand_in, layer)


class _Sharded:
    """Mixed in before a quantized layer's class: its forward on one rank's shard.

    A plain tensor input is the local path (transformers' styles, which
    localise or hide the bias around the call and reduce or gather the
    output): the quantized forward as it is.  A ``DTensor`` input (torch's
    ``parallelize_module`` hooks) is computed on its local tensor and the
    output made the ``DTensor`` the linear would have returned.
    """

    tp_kind: str
    tp_mesh: object

    def forward(self, x):
        if not is_sharded(x):
            return super().forward(x)
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

        bias = self._parameters.get("bias")
        local_bias = bias.to_local() if is_sharded(bias) else bias
        mesh = x.device_mesh
        if self.tp_kind == ROWWISE:
            with self._bias(None):
                y = super().forward(x.to_local())
            y = DTensor.from_local(y, mesh, [Partial()], run_check=False).redistribute(placements=[Replicate()])
            return y if bias is None else y + (bias if is_sharded(bias) else DTensor.from_local(
                bias, mesh, [Replicate()], run_check=False))
        with self._bias(local_bias):
            y = super().forward(x.to_local())
        if self.tp_kind == REPLICATED:
            return DTensor.from_local(y, mesh, [Replicate()], run_check=False)
        shape = (*y.shape[:-1], self.out_features)
        return DTensor.from_local(y, mesh, [Shard(y.dim() - 1)], run_check=False, shape=shape,
                                  stride=torch.empty(shape, device="meta").stride())

    @contextlib.contextmanager
    def _bias(self, bias):
        saved = self._parameters.get("bias")
        self._parameters["bias"] = bias
        try:
            yield
        finally:
            self._parameters["bias"] = saved


_classes: dict[type, type] = {}


def _sharded_class(cls: type) -> type:
    """``cls`` with :class:`_Sharded` mixed in (one class per quantized layer class)."""
    if cls not in _classes:
        _classes[cls] = type(f"Sharded{cls.__name__}", (_Sharded, cls), {"__module__": cls.__module__})
    return _classes[cls]
