"""Int4 checkpoints of other libraries, loaded into fusepass's own int4 layers.

    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float16)
    summary = fusepass.load_quantized(model, safetensors.torch.load_file(path), format="gptq")
    print(summary)                  # layers converted, skipped and why, keys left over
    model = torch.compile(model, backend="fusepass")

No quantization library is needed: each linear whose packed tensors are in
the state dict becomes a :class:`PackedInt4Linear` (fusepass's int4 layout:
uint8 [N, K // 2], low nibble the even column, float scale and zero per group
of K), whose forward is the form the ``dequant_matmul_int4`` rule fuses.
The codes, zero points and scales are the checkpoint's, moved: the loaded
layer computes the checkpoint's weight exactly, up to the scale's rounding
to the model's dtype (fp16 scales in a bf16 model round to bf16).

Layouts read (K = in_features, N = out_features, G = the checkpoint's group):

    format               codes                          zero points                       scales       W[n, k]
    "gptq"               qweight int32 [K / 8, N]:      qzeros int32 [K / G, N / 8],      [K / G, N]   (q - (z + 1)) * s
                         8 codes along K per word,      8 along N per word, stored
                         lowest bits first              minus one
    "gptq_v2"            as "gptq"                      as "gptq", stored as they are     [K / G, N]   (q - z) * s
    "awq"                qweight int32 [K, N / 8]:      qzeros int32 [K / G, N / 8],      [K / G, N]   (q - z) * s
                         8 codes along N per word in    same order
                         the order 0 2 4 6 1 3 5 7
    "compressed-tensors" weight_packed int32 [N, K / 8] weight_zero_point int32           [N, K / G]   (q - zp) * s,
    (pack-quantized)     along K, lowest bits first,    [ceil(N / 8), K / G] along N      or [N, 1]    q, zp signed
                         each code q + 8                (asymmetric only), each zp + 8
    "hqq" (4-bit,        W_q uint8 [R / 2, G], R =      zero [R, 1] float (not rounded)   [R, 1]       (Q - zero) * scale,
    axis 1, 4bit_u8)     N K / G: W [N, K] as R rows                                                   Q [R, G] as W [N, K]
                         of G, row r < R / 2 the high
                         nibbles, r + R / 2 the low

HQQ's state dict is HQQLinear's own (``W_q``, ``scale``, ``zero``, ``shape``
and its meta entries, safetensors-encoded or not): from a saved HQQ model
loaded into a plain one, or ``model.state_dict()`` of a model quantized in
memory (transformers' ``HqqConfig``), whose HQQLinear modules are replaced.
HQQ's PyTorch path rounds ``Q - zero`` to the compute dtype before the
scale; the loaded layer, as fusepass's int4, subtracts in fp32 (the same
weight to the dtype's last bit or two).

and GPTQ's and compressed-tensors' ``g_idx`` (the group of each input
column).  With act-order (``desc_act``, ``actorder``) the groups are not
runs of K: the loaded layer sorts K by group (its columns permuted once, at
load) and permutes x's features to match in its forward, one gather over
the activation ahead of the fused op.  A checkpoint group larger than the
kernel's (per channel, 512, ...) is re-expressed exactly as several kernel
groups of the same scale and zero (256 or the largest of 32, 64, 128, 256
that divides it; the scales then take G / 256 times the bytes, under 1% of
the codes' at G = 4096).  Refused, layer left as it is, with the reason: a
group the kernel cannot express (below 32, or not a multiple of 32), bits
other than 4, a ``g_idx`` whose groups are not all of size G, shapes that
disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .formats import GROUP_SIZES
from .formats import unpack_words as _unpack_words
from .formats import dequantize_int4 as _dequantize_int4
from .quantize import Int4Linear

FORMATS = ("gptq", "gptq_v2", "awq", "compressed-tensors", "hqq")
# AWQ keeps the 8 codes of a word in this column order (nibble i holds column ORDER[i])
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_KEYS = {"gptq": ("qweight", "qzeros", "scales"), "gptq_v2": ("qweight", "qzeros", "scales"),
         "awq": ("qweight", "qzeros", "scales"), "compressed-tensors": ("weight_packed", "weight_scale"),
         "hqq": ("W_q", "scale", "zero", "shape")}
_OPTIONAL = {"gptq": ("g_idx", "bias"), "gptq_v2": ("g_idx", "bias"), "awq": ("bias",),
             "compressed-tensors": ("weight_shape", "weight_zero_point", "weight_g_idx", "bias"),
             # HQQLinear's meta entries (the rest of its state dict is taken and left unread)
             "hqq": ("bias", "nbits", "group_size", "axis", "packing", "view_as_float", "quant_scale", "quant_zero",
                     "offload_meta", "unpack_view_dtype", "compute_dtype", "encoded_state_dict",
                     "stores_quant_config", "channel_wise", "optimize", "round_zero")}


class PackedInt4Linear(Int4Linear):
    """fusepass's int4 layer built from packed tensors (no float weight to quantize).

    ``weight`` uint8 [N, K // 2], ``scale`` and ``zero`` [N, K // group_size] in the
    layer's dtype (``zero`` None: symmetric, a fixed 8), ``perm`` (act-order) the
    order of x's features the columns were sorted into, or None."""

    def __init__(self, packed: Tensor, scale: Tensor, zero: Tensor | None, bias: Tensor | None, group_size: int,
                 perm: Tensor | None = None) -> None:
        nn.Module.__init__(self)
        self.out_features, self.in_features = packed.shape[0], 2 * packed.shape[1]
        self.group_size = group_size
        self.register_buffer("weight", packed)
        self.register_buffer("scale", scale)
        self.register_buffer("zero", zero)
        self.register_buffer("perm", perm)
        if bias is not None:
            self.bias = nn.Parameter(bias, requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: Tensor) -> Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        return F.linear(x, _dequantize_int4(self.weight, self.scale, self.zero, x.dtype), self.bias)

    def extra_repr(self) -> str:
        return super().extra_repr() + (", act_order" if self.perm is not None else "") + (
            ", symmetric" if self.zero is None else "")


@dataclass
class LoadSummary:
    """What :func:`load_quantized` did: layers converted, layers skipped with the
    reason, the state dict's other keys loaded, and keys nothing took."""

    format: str
    converted: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    loaded: list[str] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    act_order: list[str] = field(default_factory=list)
    regrouped: list[tuple[str, int, int]] = field(default_factory=list)  # (layer, checkpoint group, kernel group)

    def __str__(self) -> str:
        lines = [f"fusepass.load_quantized ({self.format}): {len(self.converted)} int4 layers, "
                 f"{len(self.loaded)} other tensors loaded"]
        if self.act_order:
            lines.append(f"  act-order (x's features permuted in the forward): {len(self.act_order)} layers")
        for name, g, kg in self.regrouped[:3]:
            lines.append(f"  {name}: checkpoint group {g} as groups of {kg}")
        lines += [f"  skipped {name}: {reason}" for name, reason in self.skipped]
        if self.unused:
            lines.append(f"  unused keys: {', '.join(self.unused[:8])}" + (" ..." if len(self.unused) > 8 else ""))
        if self.missing:
            lines.append(f"  missing (left as they were): {', '.join(self.missing[:8])}"
                         + (" ..." if len(self.missing) > 8 else ""))
        return "\n".join(lines)


# -- unpacking ----------------------------------------------------------------------

def unpack_words(words: Tensor, dim: int) -> Tensor:
    """:func:`fusepass.formats.unpack_words` as uint8 codes."""
    return _unpack_words(words, dim).to(torch.uint8)


def _awq_columns(codes: Tensor) -> Tensor:
    """Columns unpacked in AWQ's word order (nibble i of a word = column ORDER[i]) put in column order."""
    n = codes.shape[1]
    inverse = [AWQ_ORDER.index(j) for j in range(8)]
    index = (torch.arange(0, n, 8).unsqueeze(1) + torch.tensor(inverse)).reshape(-1)
    return codes[:, index.to(codes.device)]


def pack_int4(codes: Tensor) -> Tensor:
    """uint8 codes [N, K] -> fusepass's packed [N, K // 2] (low nibble the even column)."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def kernel_group(group: int) -> int | None:
    """The largest kernel group size that divides ``group`` (None: none does)."""
    return next((g for g in sorted(GROUP_SIZES, reverse=True) if group % g == 0), None)


# -- one layer ------------------------------------------------------------------------

@dataclass
class _Layer:
    """A layer's weight in the loader's common form: codes and per-group
    parameters [N, K] / [N, K / G] (zero None: 8), the group of each column."""

    codes: Tensor  # uint8 [N, K]
    scale: Tensor  # [N, groups], in the dtype the checkpoint stores
    zero: Tensor | None  # float [N, groups], or None (8)
    group: int
    g_idx: Tensor | None  # [K] or None (k // group)
    bias: Tensor | None


def _read_gptq(t: dict[str, Tensor], v1: bool) -> _Layer | str:
    qweight, qzeros, scales = t["qweight"], t["qzeros"], t["scales"]
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        return f"qweight/qzeros are {qweight.dtype}/{qzeros.dtype}, not int32 words of 4-bit codes"
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    groups = scales.shape[0]
    if scales.dim() != 2 or scales.shape[1] != n or tuple(qzeros.shape) != (groups, -(-n // 8)) or k % groups:
        return (f"shapes disagree: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
                f"scales {tuple(scales.shape)} (4-bit: qweight [K / 8, N], qzeros [K / G, N / 8], scales [K / G, N])")
    codes = unpack_words(qweight, 0).t()  # [N, K]
    zero = unpack_words(qzeros, 1)[:, :n].t().float()  # [N, groups]
    if v1:
        zero = zero + 1  # stored minus one
    g_idx = t.get("g_idx")
    return _Layer(codes, scales.t(), zero, k // groups, None if g_idx is None else g_idx.long(), t.get("bias"))


def _read_awq(t: dict[str, Tensor]) -> _Layer | str:
    qweight, qzeros, scales = t["qweight"], t["qzeros"], t["scales"]
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        return f"qweight/qzeros are {qweight.dtype}/{qzeros.dtype}, not int32 words of 4-bit codes"
    k, n = qweight.shape[0], qweight.shape[1] * 8
    groups = scales.shape[0]
    if scales.dim() != 2 or scales.shape[1] != n or tuple(qzeros.shape) != (groups, n // 8) or k % groups:
        return (f"shapes disagree: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
                f"scales {tuple(scales.shape)} (4-bit: qweight [K, N / 8], qzeros [K / G, N / 8], scales [K / G, N])")
    codes = _awq_columns(unpack_words(qweight, 1)).t()
    zero = _awq_columns(unpack_words(qzeros, 1)).t().float()
    return _Layer(codes, scales.t(), zero, k // groups, None, t.get("bias"))


def _read_compressed(t: dict[str, Tensor]) -> _Layer | str:
    packed, scale = t["weight_packed"], t["weight_scale"]
    if packed.dtype != torch.int32:
        return f"weight_packed is {packed.dtype}, not int32"
    n, k = packed.shape[0], packed.shape[1] * 8
    if "weight_shape" in t:
        n_, k_ = (int(v) for v in t["weight_shape"].tolist())
        if n_ != n or -(-k_ // 8) != packed.shape[1]:
            return f"weight_shape {(n_, k_)} does not fit weight_packed {tuple(packed.shape)} of 4-bit codes"
        k = k_
    if scale.dim() != 2 or scale.shape[0] != n or k % scale.shape[1]:
        return f"weight_scale {tuple(scale.shape)} is not [N, K / G] for N = {n}, K = {k}"
    groups = scale.shape[1]
    codes = unpack_words(packed, 1)[:, :k]  # q + 8 already: fusepass's unsigned codes
    zero = None
    if "weight_zero_point" in t:
        zp = t["weight_zero_point"]
        if zp.dtype == torch.int32 and tuple(zp.shape) == (-(-n // 8), groups):
            zp = (unpack_words(zp, 0)[:n].to(torch.int16) - 8)  # packed along N, each zp + 8
        elif tuple(zp.shape) != (n, groups):
            return f"weight_zero_point {tuple(zp.shape)} is neither packed [{-(-n // 8)}, {groups}] nor [{n}, {groups}]"
        zero = zp.float() + 8
    g_idx = t.get("weight_g_idx")
    return _Layer(codes, scale, zero, k // groups, None if g_idx is None else g_idx.long(), t.get("bias"))


def _meta(v, kind):
    """One of HQQLinear's meta entries, as stored or safetensors-encoded (a string as its
    characters' codes in uint8, a number as a one-value tensor, a shape as a tensor)."""
    if not isinstance(v, Tensor):
        return v if kind is not str or isinstance(v, str) else str(v)
    if kind is str:
        return "".join(chr(c) for c in v.reshape(-1).tolist())
    if kind is tuple:
        return tuple(int(c) for c in v.reshape(-1).tolist())
    return kind(v.item())


def _read_hqq(t: dict[str, Tensor]) -> _Layer | str:
    w_q, scale, zero = t["W_q"], t["scale"], t["zero"]
    shape = _meta(t["shape"], tuple)
    nbits = _meta(t.get("nbits", 4), int)
    axis = _meta(t.get("axis", 1), int)
    packing = _meta(t.get("packing", "4bit_u8"), str)
    for key in ("view_as_float", "quant_scale", "quant_zero", "offload_meta"):
        if key in t and _meta(t[key], bool):
            return f"HQQ's {key} is set: fusepass reads plain uint8 codes and float scales and zeros in place"
    if nbits != 4 or packing != "4bit_u8":
        return f"HQQ {nbits}-bit packed {packing!r}: fusepass's kernel reads 4-bit codes packed 4bit_u8"
    if axis != 1:
        return "HQQ groups along axis 0 (down the output features): fusepass's groups run along K (axis 1)"
    if len(shape) != 2 or w_q.dtype != torch.uint8 or w_q.dim() != 2:
        return f"W_q {w_q.dtype}{tuple(w_q.shape)} for shape {shape}: not uint8 [R / 2, G] of a 2-D weight"
    n, k = shape
    group = w_q.shape[1]
    rows = 2 * w_q.shape[0]
    if rows * group != n * k or k % group or scale.numel() != rows or zero.numel() != rows:
        return (f"shapes disagree: W_q {tuple(w_q.shape)}, scale {tuple(scale.shape)}, zero {tuple(zero.shape)} "
                f"for a [{n}, {k}] weight (4-bit HQQ: W_q [N K / G / 2, G], scale and zero [N K / G, 1])")
    codes = torch.cat([w_q >> 4, w_q & 15]).reshape(n, k)  # rows r < R / 2 high nibbles, then the low ones
    return _Layer(codes, scale.reshape(n, k // group), zero.reshape(n, k // group).float(), group, None,
                  t.get("bias"))


def _convert(layer: _Layer, dtype: torch.dtype, summary: LoadSummary, name: str) -> PackedInt4Linear | str:
    codes, scale, zero, group = layer.codes, layer.scale, layer.zero, layer.group
    n, k = codes.shape
    kg = kernel_group(group)
    if kg is None or k % kg:
        return (f"group size {group}: fusepass's int4 kernel takes groups of {', '.join(map(str, GROUP_SIZES))} "
                "or multiples of them")
    perm = None
    if layer.g_idx is not None:
        g_idx = layer.g_idx.to(codes.device)
        if g_idx.shape != (k,):
            return f"g_idx has shape {tuple(g_idx.shape)}, not ({k},)"
        natural = torch.arange(k, device=codes.device) // group
        if not torch.equal(g_idx, natural):
            order = torch.argsort(g_idx, stable=True)
            if not torch.equal(g_idx[order], natural):
                return (f"g_idx puts {torch.bincount(g_idx).tolist()[:4]}... columns in its groups, not {group} "
                        "each: no sorting of K makes whole groups")
            codes, perm = codes[:, order], order
            summary.act_order.append(name)
    if zero is not None and bool((zero == 8).all()):
        zero = None  # symmetric: the kernel's fixed offset
    if kg != group:
        scale = scale.repeat_interleave(group // kg, dim=1)
        zero = zero.repeat_interleave(group // kg, dim=1) if zero is not None else None
        summary.regrouped.append((name, group, kg))
    bias = layer.bias.to(dtype) if layer.bias is not None else None
    return PackedInt4Linear(pack_int4(codes).contiguous(), scale.to(dtype).contiguous(),
                            None if zero is None else zero.to(dtype).contiguous(), bias, kg, perm)


def _layer_dtype(module: nn.Module, dtype: torch.dtype | None, stored: torch.dtype) -> torch.dtype:
    """``dtype``, else the linear's weight's, else (a library's module, e.g. HQQLinear:
    no float weight) the dtype the checkpoint stores its scales in."""
    if dtype is not None:
        return dtype
    w = getattr(module, "weight", None)
    return w.dtype if isinstance(w, Tensor) and w.dtype.is_floating_point else stored


def load_quantized(model: nn.Module, state_dict: Mapping[str, Tensor], format: str, *, bits: int = 4,
                   dtype: torch.dtype | None = None) -> LoadSummary:
    """Load an int4 checkpoint in ``format`` (see :data:`FORMATS`) into ``model``.

    Each ``nn.Linear`` whose packed tensors are in ``state_dict`` is replaced
    in place by a :class:`PackedInt4Linear` (scales in ``dtype``, default the
    linear's dtype); the state dict's other tensors (embeddings, norms, an
    unquantized ``lm_head``) are loaded into the model as they are.  A model
    built on the meta device takes them by assignment.
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    if bits != 4:
        raise ValueError(f"fusepass loads 4-bit checkpoints (its int4 kernel), not {bits}-bit")
    summary = LoadSummary(format)
    used: set[str] = set()
    perms: list[Tensor] = []  # act-order permutations, each held once
    required, optional = _KEYS[format], _OPTIONAL[format]
    for name, module in list(model.named_modules()):
        prefix = f"{name}." if name else ""
        # (HQQ: also a model's own HQQLinear modules, from its own state dict)
        library = format == "hqq" and not isinstance(module, nn.Linear) and hasattr(module, "W_q")
        if not isinstance(module, nn.Linear) and not library:
            continue
        if not all(prefix + key in state_dict for key in required):
            continue
        tensors = {key: state_dict[prefix + key] for key in required + optional if prefix + key in state_dict}
        layer = (_read_gptq(tensors, v1=format == "gptq") if format.startswith("gptq")
                 else _read_awq(tensors) if format == "awq" else _read_hqq(tensors) if format == "hqq"
                 else _read_compressed(tensors))
        if not isinstance(layer, str) and not library:
            if tuple(layer.codes.shape) != (module.out_features, module.in_features):
                layer = (f"the checkpoint's weight is [{layer.codes.shape[0]}, {layer.codes.shape[1]}], "
                         f"the model's linear [{module.out_features}, {module.in_features}]")
            elif layer.bias is None and module.bias is not None:
                layer = "the model's linear has a bias, the checkpoint none"
        new = layer if isinstance(layer, str) else _convert(layer, _layer_dtype(module, dtype, layer.scale.dtype),
                                                             summary, name)
        if isinstance(new, str):
            summary.skipped.append((name, new))
            continue
        if new.perm is not None:
            # Layers of one input permuted alike (GPTQ's act-order follows the input's
            # statistics: q / k / v, gate / up) share one tensor, so the compiled graph
            # permutes x once and the products of that one x can go out as one launch.
            same = next((p for p in perms if p.shape == new.perm.shape and p.device == new.perm.device
                         and torch.equal(p, new.perm)), None)
            if same is None:
                perms.append(new.perm)
            else:
                new.perm = same
        used.update(prefix + key for key in tensors)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
        summary.converted.append(name)
    rest = {key: value for key, value in state_dict.items() if key not in used}
    meta = any(p.is_meta for p in model.parameters())
    result = model.load_state_dict(rest, strict=False, assign=meta)
    summary.unused = list(result.unexpected_keys)
    summary.loaded = [key for key in rest if key not in set(result.unexpected_keys)]
    converted = tuple(f"{name}." for name in summary.converted)
    summary.missing = [key for key in result.missing_keys if not key.startswith(converted)]
    return summary
