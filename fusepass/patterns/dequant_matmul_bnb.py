"""bitsandbytes 4-bit linears (NF4, FP4) -> ``fusepass::dequant_matmul`` (fmt "nf4" / "fp4").

    y = x @ W.T (+ bias),  W[n, k] = CODE[q[n, k]] * absmax[(n * K + k) // B]      B = blocksize
    absmax[i] = CODE2[absmax_8bit[i]] * nested[i // 256] + offset                  double quantization

as bitsandbytes >= 0.46 puts it in the graph: one opaque
``bitsandbytes::gemm_4bit(x, B, [N, K], absmax, blocksize, quant_type, bias,
absmax_8bit, absmax_code, absmax_offset)`` per linear, for every M, the codes
packed two per byte along the flattened weight (the high nibble first).
With K a multiple of the block size each block lies in one row, so the op
reads the bytes as uint8 [N, K / 2] and absmax as fp32 [N, K / B] where they
are; double quantization's absmax as stored too (its bytes [N, K / B], the
nested absmax, code and offset: the one-token GEMVs expand it as they read,
a byte and a table lookup per block, where an expansion in the graph wrote
and read back 4 N K / B bytes a step; other plans expand it in the op).
The op gathers each code's value from the code book
(fusepass.formats.CODEBOOKS) and rounds the product once, where
bitsandbytes rounds the dequantized weight to x's dtype first: the same
difference as every dequant_matmul form.

The rule finds the op nodes (``find``): bitsandbytes need not be installed
for a graph without them.  Refused, left to bitsandbytes, with the reason:
K not a multiple of the block size (blocks straddle rows), an activation
dtype the kernels lack, a bias of another dtype, nested absmax of another
block than 256.  Every other bitsandbytes op in the graph gets a line
saying why fusepass does not take it (``gemv_4bit`` on bitsandbytes' CPU
layout, ``dequantize_4bit``, LLM.int8's ``int8_linear_matmul``, ...).
"""

from __future__ import annotations

import torch
import torch.fx

from fusepass.match import arguments, same, shape_str
from fusepass.patterns import dequant_matmul as dm
from fusepass.rule import Form, NearMiss, Region, Rule

N_EX, K_EX = 24, 128
_OTHER_OPS = {
    "gemv_4bit": "bitsandbytes' CPU layout (weights repacked for AVX512-BF16, packing_format_for_cpu), "
                 "which fusepass's kernels do not read",
    "dequantize_4bit": "a 4-bit weight dequantized on its own (bitsandbytes < 0.46, or a weight quantized "
                       "from a [K, N] tensor): fusepass takes bitsandbytes' gemm_4bit",
    "int8_linear_matmul": "LLM.int8 (bitsandbytes 8-bit, int8 activations and outlier columns): not a "
                          "weight-only form fusepass has a kernel for",
}


def _bnb():
    return torch.ops.bitsandbytes  # resolved when called: bitsandbytes imported by then


# -- the forms: bitsandbytes' own op, as its Linear4bit calls it ------------------------------

def search(x, packed, absmax):
    return _bnb().gemm_4bit.default(x, packed, [N_EX, K_EX], absmax, 64, "nf4")


def search_fp4_bias(x, packed_fp4, absmax, bias):
    return _bnb().gemm_4bit.default(x, packed_fp4, [N_EX, K_EX], absmax, 64, "fp4", bias)


def search_nested(x, packed, nested_absmax, absmax_8bit, absmax_code, absmax_offset):
    return _bnb().gemm_4bit.default(x, packed, [N_EX, K_EX], nested_absmax, 64, "nf4", None, absmax_8bit,
                                    absmax_code, absmax_offset)


def _quantized(dtype, quant_type="nf4", nested=False, n=N_EX, k=K_EX, blocksize=64):
    """bitsandbytes' own quantization of a random [n, k] weight: (packed, absmax tensors); without the
    library, random codes and scales in its layout (what a trace of the op's fake needs)."""
    try:
        import bitsandbytes.functional as bf
    except ImportError:
        packed = torch.randint(0, 256, (n * k // 2, 1), dtype=torch.uint8)
        absmax = torch.rand(n * k // blocksize) + 0.5
        if nested:
            blocks = n * k // blocksize
            return packed, [torch.rand(-(-blocks // 256)) + 0.5, torch.randint(0, 256, (blocks,), dtype=torch.uint8),
                            torch.linspace(-1, 1, 256), torch.tensor(0.25)]
        return packed, [absmax]

    w = torch.randn(n, k) / k ** 0.5
    packed, state = bf.quantize_4bit(w, blocksize=blocksize, quant_type=quant_type, compress_statistics=nested)
    if nested:
        return packed, [state.state2.absmax, state.absmax, state.state2.code, state.offset]
    return packed, [state.absmax]


def example_inputs(dtype):
    packed, (absmax,) = _quantized(dtype)
    return [torch.randn(4, K_EX, dtype=dtype), packed, absmax]


def example_inputs_fp4(dtype):
    packed, (absmax,) = _quantized(dtype, "fp4")
    return [torch.randn(2, 3, K_EX, dtype=dtype), packed, absmax, torch.randn(N_EX, dtype=dtype)]


def example_inputs_nested(dtype):
    packed, state = _quantized(dtype, nested=True)
    return [torch.randn(1, K_EX, dtype=dtype), packed, *state]


def sized_inputs(dtype, shape):
    """x of ``shape`` with K its last dim rounded up to a multiple of 64 (whole blocks per row)."""
    k = max(64, -(-(shape[-1] if shape else 1) // 64) * 64)
    if k != K_EX:
        k = K_EX  # the forms' shapeB is fixed: the drawn leading dims, K_EX features
    packed, (absmax,) = _quantized(dtype)
    packed4, (absmax4,) = _quantized(dtype, "fp4")
    nested_packed, nested = _quantized(dtype, nested=True)
    del nested_packed
    return dict(x=torch.randn(*shape[:-1], k, dtype=dtype), packed=packed, packed_fp4=packed4, absmax=absmax,
                bias=torch.randn(N_EX, dtype=dtype), nested_absmax=nested[0], absmax_8bit=nested[1],
                absmax_code=nested[2], absmax_offset=nested[3])


# -- the region: one gemm_4bit node ------------------------------------------------------------

def _val(a):
    return a.meta.get("val") if isinstance(a, torch.fx.Node) else a


def _bnb_op(node: torch.fx.Node) -> str | None:
    """The bitsandbytes op a node calls (its name), or None."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    return target.overloadpacket.__name__ if target.namespace == "bitsandbytes" else None


def _refusal(a: dict, node: torch.fx.Node) -> str | None:
    x, packed, absmax = _val(a["A"]), _val(a["B"]), _val(a["absmax"])
    shape, blocksize, quant_type = a["shapeB"], a["blocksize"], a["quant_type"]
    if quant_type not in ("nf4", "fp4"):
        return f"quant_type {quant_type!r} is not nf4 or fp4"
    if not (isinstance(shape, (list, tuple)) and len(shape) == 2 and all(isinstance(s, int) for s in shape)):
        return f"shapeB {shape} is not a constant [N, K]"
    n, k = shape
    reason = dm.check_activation(x)
    if reason:
        return reason
    if not same(x.shape[-1], k):
        return f"activation has {x.shape[-1]} features, shapeB {k}"
    if k % blocksize or k % 2:
        return (f"K = {k} is not a multiple of the block size {blocksize}: blocks straddle rows, which the "
                "kernel's [N, K / block] absmax cannot express")
    if packed.numel() * packed.element_size() != n * k // 2 or not packed.is_contiguous():
        return f"packed weight {packed.dtype}{shape_str(packed)} is not N * K / 2 contiguous bytes"
    blocks = n * k // blocksize
    for name in ("absmax", "absmax_8bit", "absmax_code", "absmax_offset"):
        t = _val(a[name])
        if isinstance(t, torch.Tensor) and not t.is_contiguous():
            # bitsandbytes' CPU kernel reads these as packed values whatever their strides (an expanded
            # absmax gave outputs 0.53 off, measured): left to it, the program computes what it does.
            return f"{name} {t.dtype}{shape_str(t)} is not contiguous (bitsandbytes reads it as packed values)"
    bias = _val(a["bias"])
    if bias is not None and (bias.dtype != x.dtype or bias.dim() != 1 or not same(bias.shape[0], n)):
        return f"bias {bias.dtype}{shape_str(bias)} is not ({n},) in the activation's dtype {x.dtype}"
    if a["absmax_8bit"] is None:
        if absmax.dtype != torch.float32 or absmax.numel() != blocks:
            return f"absmax {absmax.dtype}{shape_str(absmax)} is not {blocks} fp32 values"
        return None
    a8, code, offset = _val(a["absmax_8bit"]), _val(a["absmax_code"]), _val(a["absmax_offset"])
    if a8.dtype != torch.uint8 or a8.numel() != blocks:
        return f"absmax_8bit {a8.dtype}{shape_str(a8)} is not {blocks} bytes"
    if code is None or code.numel() != 256 or not code.dtype.is_floating_point:
        return "absmax_code is not a 256-entry float table"
    if absmax.dim() != 1 or absmax.numel() != -(-blocks // 256) or absmax.dtype != torch.float32:
        return (f"nested absmax {absmax.dtype}{shape_str(absmax)} is not one fp32 value per 256 blocks "
                f"({-(-blocks // 256)}): another nested block size")
    if offset is None or offset.numel() != 1:
        return "absmax_offset is not one value"
    return None


def stored_absmax(nested_absmax, code, offset) -> list:
    """Double quantization's tensors as the ops take them (``nested``): fp32, the offset one value."""
    return [nested_absmax.float(), code.float(), offset.float().reshape(1)]


def _replace(n, k, blocksize, fmt, has_bias, nested):
    def call(x, packed, absmax, *rest):
        rest = list(rest)
        bias = rest.pop(0) if has_bias else None
        w = packed.view(torch.uint8).reshape(n, k // 2)
        if not nested:
            return dm._op()(x, w, absmax.reshape(n, k // blocksize), None, bias, fmt, blocksize)
        a8, code, offset = rest
        # The absmax as stored (a byte a block, the nested absmax, code and offset):
        # the GEMV expands it as it reads; other plans expand it in the op.
        return dm._op()(x, w, a8.reshape(n, k // blocksize), None, bias, fmt, blocksize,
                        nested=stored_absmax(absmax, code, offset))

    return call


def find(gm: torch.fx.GraphModule):
    for node in gm.graph.nodes:
        name = _bnb_op(node)
        if name is None:
            continue
        if name != "gemm_4bit":
            yield Region(name, node, reason=f"bitsandbytes::{name}: " + _OTHER_OPS.get(
                name, "a bitsandbytes op fusepass has no form for"))
            continue
        a = arguments(node)
        reason = _refusal(a, node) or dm.check_library_device(_val(a["A"]), a["quant_type"])
        form = a["quant_type"] if isinstance(a["quant_type"], str) else "gemm_4bit"
        if reason:
            yield Region(form, node, reason=reason)
            continue
        n, k = a["shapeB"]
        nested = a["absmax_8bit"] is not None
        has_bias = a["bias"] is not None
        args = [a["A"], a["B"], a["absmax"]] + ([a["bias"]] if has_bias else [])
        names = ["x", "packed", "absmax"] + (["bias"] if has_bias else [])
        if nested:
            args += [a["absmax_8bit"], a["absmax_code"], a["absmax_offset"]]
            names += ["absmax_8bit", "absmax_code", "absmax_offset"]
        label = f"{a['quant_type']}" + ("_nested" if nested else "") + ("_bias" if has_bias else "")
        yield Region(label, node, [node], [node], args,
                     _replace(n, k, a["blocksize"], a["quant_type"], has_bias, nested), names=names)


# -- near-misses ------------------------------------------------------------------------------

def _nm_straddle(x, packed, absmax):
    # [24, 96] in blocks of 64: blocks straddle rows
    return _bnb().gemm_4bit.default(x, packed, [24, 96], absmax, 64, "nf4")


def _inputs_straddle(dtype):
    packed, (absmax,) = _quantized(dtype, n=24, k=96)
    return [torch.randn(3, 96, dtype=dtype), packed, absmax]


def _nm_dequantize(x, packed, absmax):
    w = _bnb().dequantize_4bit.default(packed, absmax, 64, "nf4", [N_EX, K_EX], x.dtype)
    return x @ w.t()


RULE = Rule(
    name="dequant_matmul_bnb",
    forms=[Form("nf4", search, _replace(N_EX, K_EX, 64, "nf4", False, False)),
           Form("fp4_bias", search_fp4_bias, _replace(N_EX, K_EX, 64, "fp4", True, False),
                example_inputs=example_inputs_fp4),
           Form("nf4_nested", search_nested, _replace(N_EX, K_EX, 64, "nf4", False, True),
                example_inputs=example_inputs_nested)],
    example_inputs=example_inputs,
    sized_inputs=sized_inputs,
    find=find,
    packed_args=("absmax", "nested_absmax", "absmax_8bit", "absmax_code", "absmax_offset"),
    near_misses=[
        NearMiss("blocks straddle rows", _nm_straddle, _inputs_straddle, "blocks straddle rows"),
        NearMiss("dequantize_4bit", _nm_dequantize, example_inputs, "dequantized on its own"),
    ],
    doc=__doc__,
)
