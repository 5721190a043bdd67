"""Weight-only quantized linear, per output channel (int8, fp8) -> ``fusepass::dequant_matmul``.

    y = x @ (q.to(x.dtype) * scale[:, None]).T (+ bias)     scale before the matmul
    y = (x @ q.to(x.dtype).T) * scale                      scale after (gpt-fast)
    q int8 [N, K] or float8_e4m3fn [N, K], scale [N], bias [N], x [..., K] fp32/fp16/bf16

The weight's dtype picks the op's format: both dequantize with one convert,
so one pattern serves both.  Forms, as the post-grad graph has them:

- ``scale_before`` / ``scale_before_bias``: ``mm`` / ``addmm(bias, x, permute(q' * s[:, None]))``
  (``F.linear``, ``x @ W.t()``, ``torch.matmul``);
- ``scale_after``: ``mm(x, permute(q')) * s`` with 2-D x; ``scale_after_nd``: the
  same between the reshapes that flatten and unflatten x's leading dims;
  ``scale_after_1d``: a 1-D x, ``squeeze(mm(unsqueeze(x), ...)) * s``;
  a bias added after the scale stays an add beside the op;
- ``*_bmm``: 3-D x whose leading dims do not flatten without a copy (a
  transposed or expanded activation): ``bmm(expand(x), expand(permute(W)))``.

Scales as checkpoints store them (compressed-tensors, fp8 and int8
per-channel checkpoints): a column ``[N, 1]`` or one per tensor (``[]``,
``[1]``, ``[1, 1]``), in the model's dtype or fp32:

- ``scale_col`` / ``scale_col_bias``: ``x @ (q' * s).T``, s ``[N, 1]`` (or one
  value) in x's dtype;
- ``scale_col_cast`` / ``scale_col_cast_bias``: the same with an fp32 scale
  converted to x's dtype first (the op is given the rounded scale);
- ``dequant_fp32`` / ``dequant_fp32_bias``: dequantized in fp32
  (``q.to(s.dtype) * s``) and the weight converted to x's dtype;
- ``scale_after_fp32``: ``((x @ q'.T).to(fp32) * s).to(x.dtype)``, s ``[N]`` or
  ``[1, N]`` fp32.

A scale of one value per tensor becomes one per channel (expanded, N
values).  Refused with the reason: a scale along the other axis (``[1, K]``
before the matmul scales input features; ``[M, 1]`` after it scales tokens),
and a zero point (``(q - z) * s``): the int8 and fp8 kernels are symmetric.

3-D and larger activations reach the scale-before forms as
``reshape -> mm -> reshape``; the reshapes stay and the op takes the 2-D
view.  Any M, dynamic M included.  The product accumulates in fp32 and
rounds once, so it agrees with both orders of rounding within the dtype table.

:mod:`fusepass.patterns.dequant_matmul_int4` (packed 4-bit groups) and
:mod:`fusepass.patterns.dequant_matmul_torchao` (torchao's int8 subclass)
share the checks below.
"""

from __future__ import annotations

import math

import torch
import torch.fx
import torch.nn.functional as F

from fusepass.formats import CHANNEL_FORMATS
from fusepass.formats import KERNEL_DTYPES as SUPPORTED
from fusepass.kernels.dequant_matmul import GEMV_MAX_M, dequant_matmul_call, dequant_matmul_plan
from fusepass.match import MatchInfo, hint, same, shape_str
from fusepass.rule import Form, NearMiss, Rule

aten = torch.ops.aten
prims = torch.ops.prims
N_EX, K_EX = 24, 40  # example sizes: N != K, so a resized K cannot be taken for N


def _op():
    return dequant_matmul_call  # the op, or its launches inlined into a CUDA graph


# -- searches and replacements ------------------------------------------------------

def _dequant(weight, scale, dtype):
    return weight.to(dtype) * scale[:, None]


def search_before(x, weight, scale):
    return x @ _dequant(weight, scale, x.dtype).t()


def search_before_bias(x, weight, scale, bias):
    return F.linear(x, _dequant(weight, scale, x.dtype), bias)


def search_after(x, weight, scale):
    return F.linear(x, weight.to(x.dtype)) * scale


def search_col(x, weight, scale_col):
    return x @ (weight.to(x.dtype) * scale_col).t()


def search_col_bias(x, weight, scale_col, bias):
    return F.linear(x, weight.to(x.dtype) * scale_col, bias)


def search_col_cast(x, weight, scale_f32):
    return x @ (weight.to(x.dtype) * scale_f32.to(x.dtype)).t()


def search_col_cast_bias(x, weight, scale_f32, bias):
    return F.linear(x, weight.to(x.dtype) * scale_f32.to(x.dtype), bias)


def search_fp32(x, weight, scale_f32):
    return x @ (weight.to(scale_f32.dtype) * scale_f32).to(x.dtype).t()


def search_fp32_bias(x, weight, scale_f32, bias):
    return F.linear(x, (weight.to(scale_f32.dtype) * scale_f32).to(x.dtype), bias)


def search_after_fp32(x, weight, scale_row):
    return (F.linear(x, weight.to(x.dtype)).to(scale_row.dtype) * scale_row).to(x.dtype)


def _per_channel(scale, n):
    """A scale of N values or of one (per tensor) as the op's [N]."""
    return scale.reshape(-1).expand(n) if scale.numel() == 1 else scale.reshape(-1)


def replace_col(x, weight, scale_col):
    return _call(x, weight, _per_channel(scale_col, weight.shape[0]))


def replace_col_bias(x, weight, scale_col, bias):
    return _call(x, weight, _per_channel(scale_col, weight.shape[0]), bias)


def replace_col_cast(x, weight, scale_f32):
    return _call(x, weight, _per_channel(scale_f32.to(x.dtype), weight.shape[0]))


def replace_col_cast_bias(x, weight, scale_f32, bias):
    return _call(x, weight, _per_channel(scale_f32.to(x.dtype), weight.shape[0]), bias)


def replace_fp32(x, weight, scale_f32):
    return _call(x, weight, _per_channel(scale_f32, weight.shape[0]))


def replace_fp32_bias(x, weight, scale_f32, bias):
    return _call(x, weight, _per_channel(scale_f32, weight.shape[0]), bias)


def replace_after_fp32(x, weight, scale_row):
    return _call(x, weight, _per_channel(scale_row, weight.shape[0]))


def _call(x, weight, scale, bias=None):
    # Per channel: one group spanning the row.  Small operands are made
    # contiguous here (a no-op when they are); the weight must be (see check).
    return _op()(x, weight, scale.reshape(-1).contiguous(), None,
                 None if bias is None else bias.reshape(-1).contiguous(), CHANNEL_FORMATS[weight.dtype], weight.shape[-1])


def replace_before(x, weight, scale):
    return _call(x, weight, scale)


def replace_before_bias(x, weight, scale, bias):
    return _call(x, weight, scale, bias)


def channel_scale(n: int, k: int, dtype=torch.float32) -> torch.Tensor:
    """Scales that make the dequantized rows' norms O(1), so x @ W.T is O(1).

    Eager rounds the dequantized weight to the activation dtype before the
    matmul, the op does not: their difference grows like sqrt(K) * |W| * ulp,
    and against outputs of size ~7 (scales of 1/64, K 40) it measured 2.3e-3
    in fp16, over the table's atol of 2e-3, on an element near zero.  With
    O(1) outputs it is about a tenth of the table.
    """
    return ((0.5 + torch.rand(n)) / (73 * max(k, 1) ** 0.5)).to(dtype)  # int8 codes: rms 73


def example_inputs(dtype):
    return [torch.randn(4, K_EX, dtype=dtype), torch.randint(-127, 128, (N_EX, K_EX), dtype=torch.int8),
            channel_scale(N_EX, K_EX, dtype), torch.randn(N_EX, dtype=dtype)]


def example_inputs_col(dtype):
    """x, weight, an [N, 1] scale in x's dtype, bias (the checkpoint forms)."""
    x, w, scale, bias = example_inputs(dtype)
    return [x, w, scale[:, None], bias]


def example_inputs_f32(dtype):
    """x, weight, an [N, 1] fp32 scale, bias."""
    x, w, scale, bias = example_inputs(dtype)
    return [x, w, scale.float()[:, None], bias]


def example_inputs_row(dtype):
    """x, weight, an [N] fp32 scale (applied after the matmul)."""
    x, w, scale, _ = example_inputs(dtype)
    return [x, w, scale.float()]


def example_inputs_nd(dtype):
    x, *rest = example_inputs(dtype)
    return [x.reshape(2, 2, K_EX), *rest]


def example_inputs_1d(dtype):
    x, *rest = example_inputs(dtype)
    return [x[0], *rest]


def example_inputs_bmm(dtype):
    """3-D x whose leading dims do not flatten without a copy (here transposed):
    ``torch.matmul`` then broadcasts the weight and calls ``bmm``."""
    x, *rest = example_inputs(dtype)
    return [x.reshape(2, 2, K_EX).transpose(0, 1), *rest]


def sized_inputs(dtype, shape):
    """x of ``shape`` (K its last dim), an int8 [N_EX, K] weight, per-channel scale and bias."""
    # K = 1 (tiny M) reaches the post-grad graph as a multiply on CPU: Inductor decomposes such an mm.
    K = max(shape[-1] if shape else 1, 2)
    shape = (*shape[:-1], K)
    scale = channel_scale(N_EX, K)
    return dict(x=torch.randn(shape or (1,), dtype=dtype), weight=torch.randint(-127, 128, (N_EX, K), dtype=torch.int8),
                scale=scale.to(dtype), bias=torch.randn(N_EX, dtype=dtype), scale_col=scale.to(dtype)[:, None],
                scale_f32=scale[:, None], scale_row=scale)


# -- checks shared by the dequant_matmul rules ---------------------------------------

def rows_contiguous(t: torch.Tensor) -> bool:
    """[N, K] stored row after row (strides (K, 1)), proved without specialising a size."""
    return t.dim() == 2 and (same(t.shape[1], 1) or same(t.stride(1), 1)) and (
        same(t.shape[0], 1) or same(t.stride(0), t.shape[1]))


def check_activation(x: torch.Tensor) -> str | None:
    if x.dtype not in SUPPORTED:
        return f"activation dtype {x.dtype} has no kernel (fp32/fp16/bf16 only)"
    if x.device.type not in ("cuda", "cpu"):
        return f"no fusepass kernel for device {x.device.type}"
    return None


# On CUDA a library layout goes to fusepass only where its loop of its own is
# faster than the library's or Inductor's path.  H200, CUDA-graph time, cold
# weights (python -m fusepass.bench.registry.dequant_library --gpu-run --ms
# 1,4,8,16, 833cfc7 + the code-book loop):
# - HQQ g64 and GPTQ g128 (05d6c3f): 8.0 / 11.1 and 9.9 / 14.7 µs at M = 1 / 4 on
#   4096x4096 against Inductor on their torch forms' 25.0 and 28.5 at M = 1;
#   beyond the GEMV's 8 rows they are read value by value (tiles._library_tile):
#   52.6 (HQQ) and 143.7 µs (GPTQ) at M = 16 against bf16 cuBLAS's 13.5.
# - NF4 / FP4, blocks of 64 (18b60b9): at M = 1 7.3-7.4 / 16.8-17.2 / 18.2-18.3
#   µs on 4096x4096 / 4096x14336 / 14336x4096 against bitsandbytes' own
#   kernel's 10.4-10.5 / 29.4-29.5 / 29.1 (1.41-1.75x), at M = 4 1.50-1.78x;
#   from 5 rows the transposed kernel: 1.43-2.68x its time at M = 8-32 and
#   1.17-1.78x at 64 (4096x4096: 24.8 against 29.1), not measured beyond.
#   Double quantization's absmax is expanded in the graph first (one
#   Inductor kernel): compiled, six layers in turn at M = 1, 20.4 / 19.9 µs
#   per layer on 14336x4096 / 4096x14336 against bitsandbytes' 29.1 / 29.8
#   (plain NF4 in the same run: 18.1 / 16.8; benchmarks/bnb_compiled.py).
_LIBRARY_ROWS = {"hqq4": GEMV_MAX_M, "gptq4": GEMV_MAX_M, "nf4": 64, "fp4": 64}  # format -> most rows on CUDA
_BNB_KERNEL = "left to bitsandbytes' kernel on CUDA: "
_INDUCTOR_PATH = "left to Inductor's path on CUDA: "


def check_library_device(x: torch.Tensor, fmt: str, n=None) -> str | None:
    """A refusal on CUDA for a library layout (``fmt`` nf4, fp4, hqq4, gptq4) where fusepass's kernel is
    slower than the library's or Inductor's path: beyond the rows it measured faster to (``_LIBRARY_ROWS``),
    and HQQ at an odd N (``n``, rows that do not pair)."""
    if x.device.type != "cuda":
        return None
    bnb = fmt in ("nf4", "fp4")
    where = _BNB_KERNEL if bnb else _INDUCTOR_PATH
    most = _LIBRARY_ROWS.get(fmt, 0)
    fp32 = bnb and getattr(x, "dtype", None) == torch.float32
    if fp32:  # the tensor-core kernel takes 16-bit x: fp32 keeps the GEMV's four rows
        most = 4
    rows = math.prod(x.shape[:-1])
    if not isinstance(rows, int):
        return where + f"the row count is dynamic ({rows}); fusepass's {fmt} kernels are faster to {most} rows"
    if rows > most:
        if fp32:
            return where + (f"{rows} rows of fp32 activations; fusepass's {fmt} GEMV is measured faster to {most} "
                            "rows (its tensor-core kernel takes 16-bit activations)")
        if bnb:
            return where + (f"{rows} rows; fusepass's {fmt} kernels are measured faster to {most} (H200, "
                            "4096x4096, M = 64: 24.8 against bitsandbytes' 29.1 µs), not beyond")
        if fmt == "hqq4":
            return where + (f"{rows} rows; beyond {most} fusepass's hqq4 kernel is slower than bf16 cuBLAS (H200, "
                            "4096x4096, M = 16: 33.0 against 13.6 µs); fusepass.load_quantized(model, "
                            "model.state_dict(), 'hqq') makes the layers fusepass's int4 (15.2 µs there)")
        return (where + f"{rows} rows; beyond {most} fusepass reads {fmt} value by value (H200, 4096x4096, "
                "M = 16: 143.7 µs against bf16 cuBLAS's 13.5)")
    if fmt == "hqq4" and isinstance(n, int) and n % 2:
        return where + f"N = {n} is odd: HQQ's rows n and n + N / 2 do not pair (fusepass would read it value by value)"
    return None


def check_weight(w: torch.Tensor, what: str = "quantized weight") -> str | None:
    if w.dim() != 2:
        return f"{what} is {w.dim()}-D {shape_str(w)}, not [N, K]"
    if not rows_contiguous(w):
        return (f"{what} {shape_str(w)} has strides {tuple(w.stride())}: not stored [N, K] row after row "
                "(a transposed or strided weight), which the kernel cannot read")
    return None


def check_vector(t: torch.Tensor | None, n, what: str) -> str | None:
    """``t`` holds one value per output channel: (N,), or (1, ..., N) broadcast along the rows."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        return f"{what} is a {type(t).__name__}, not a tensor"
    if t.dim() == 0 or not same(t.shape[-1], n) or not all(same(s, 1) for s in t.shape[:-1]):
        return f"{what} shape {shape_str(t)} is not ({n},): one value per output channel"
    if not t.dtype.is_floating_point:
        return f"{what} dtype {t.dtype} is not a float"
    return None


def check_output(m: MatchInfo, x: torch.Tensor, n) -> str | None:
    out = m.output_val
    if out.dtype != x.dtype:
        return f"the result is {out.dtype}, the activation {x.dtype} (a {out.dtype} scale or bias promotes it)"
    want = (*x.shape[:-1], n)
    if out.dim() != len(want) or not all(same(a, b) for a, b in zip(out.shape, want)):
        return f"the result {shape_str(out)} is not the activation's leading dims times N {want}"
    return None


def plan(m: MatchInfo, x: torch.Tensor, n, k, fmt: str, group_size) -> str | None:
    """Where dequantize + cuBLAS measures faster than the fused kernels at this
    shape, keep the graph's own dequantize + matmul for Inductor, and say so.

    Only for a CUDA graph whose M is static: with a dynamic M the op is taken,
    and it picks its path per call (dequantize + cuBLAS included) from the
    same plans.  The plan is looked up (``dequant_matmul_plan``: plans tuned on
    this machine, shipped for this GPU, or the heuristic), never measured
    here: ``fusepass tune`` measures.
    """
    del m
    if x.device.type != "cuda":
        return None
    sizes = (*x.shape[:-1], n, k, group_size)
    if not all(isinstance(v, int) for v in sizes):
        return None
    rows = math.prod(x.shape[:-1])
    if dequant_matmul_plan(rows, n, k, fmt, group_size, x.dtype, x.device) == "dequant+cublas":
        return f"kept dequant + cuBLAS: the plan at M={rows} N={n} K={k} ({fmt}) (faster than the fused kernels there)"
    return None


def check_stored_scale(t, n, k, before: bool) -> str | None:
    """A checkpoint's scale: one value, or N values along the axis that scales
    output channels ([N, 1] on the weight before the matmul; [N] or [1, N]
    on its result after)."""
    if not t.dtype.is_floating_point:
        return f"scale dtype {t.dtype} is not a float"
    if t.numel() == 1 and t.dim() <= 2:
        return None  # per tensor
    if before:
        if t.dim() == 2 and same(t.shape[0], n) and same(t.shape[1], 1):
            return None
        if t.dim() == 2 and same(t.shape[0], 1) and same(t.shape[1], k):
            return f"scale shape {shape_str(t)} scales the weight's K = {k} input features, not its {n} output channels"
        return f"scale shape {shape_str(t)} is not ({n}, 1) (one value per output channel) or one value"
    if t.dim() in (1, 2) and same(t.shape[-1], n) and (t.dim() == 1 or same(t.shape[0], 1)):
        return None
    return f"scale shape {shape_str(t)} is not ({n},) or (1, {n}) (one value per output channel) or one value"


def check(m: MatchInfo) -> str | None:
    x, w = m.val("x"), m.val("weight")
    if w.dtype not in CHANNEL_FORMATS:
        if w.dtype.is_floating_point:
            return (f"the scaled operand is a {w.dtype} tensor computed in the graph, not a stored int8/fp8 weight "
                    "(a zero point or another step between the stored weight and its scale)")
        return f"weight dtype {w.dtype} is not a format fusepass knows (int8, float8_e4m3fn per channel)"
    n, k = w.shape[0], w.shape[-1]
    bias = m.val("bias") if "bias" in m.inputs else None
    stored = next((name for name in ("scale_col", "scale_f32", "scale_row") if name in m.inputs), None)
    scale_reason = (check_vector(m.val("scale"), n, "scale") if stored is None
                    else check_stored_scale(m.val(stored), n, k, before=stored != "scale_row"))
    reason = (check_activation(x) or check_weight(w) or scale_reason
              or check_vector(bias, n, "bias") or check_output(m, x, n))
    if reason:
        return reason
    if not same(x.shape[-1], k):
        return f"activation has {x.shape[-1]} features, the weight {k}"
    return plan(m, x, n, k, CHANNEL_FORMATS[w.dtype], k)


# -- near-misses (the places where no form applies: explain) ---------------------------

# Ops a dequantize goes through between the stored weight and the matmul.
_DEQUANT_OPS = {aten.permute.default, aten.reshape.default, aten.view.default, aten.mul.Tensor, aten.sub.Tensor,
                aten.add.Tensor, aten.div.Tensor, aten.unsqueeze.default, aten.expand.default, aten.clone.default,
                aten.cat.default, aten.bitwise_and.Scalar, aten.__rshift__.Scalar, aten.t.default,
                aten.bitwise_right_shift.Tensor_Scalar, prims.convert_element_type.default}
_QUANTIZED = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.float8_e4m3fn, torch.float8_e5m2)


def _val(n):
    return n.meta.get("val") if isinstance(n, torch.fx.Node) else None


_UNPACK = (aten.bitwise_and.Scalar, aten.__rshift__.Scalar, aten.bitwise_right_shift.Tensor_Scalar)


def quantized_source(weight: torch.fx.Node, depth: int = 16) -> tuple[torch.fx.Node | None, bool]:
    """(the integer / fp8 tensor a matmul's float weight operand was dequantized
    from, or None; whether nibbles were unpacked on the way)."""
    todo, seen, unpacked, found = [weight], set(), False, None
    while todo and depth:
        depth -= 1
        n = todo.pop()
        if not isinstance(n, torch.fx.Node) or n in seen:
            continue
        seen.add(n)
        if n.op != "call_function" or n.target not in _DEQUANT_OPS:
            continue
        unpacked |= n.target in _UNPACK
        if n.target == prims.convert_element_type.default and found is None:
            src = _val(n.args[0])
            if isinstance(src, torch.Tensor) and src.dtype in _QUANTIZED:
                found = n.args[0]
        todo += [a for a in n.all_input_nodes]
    return found, unpacked


def explain_for(node: torch.fx.Node, packed: bool) -> str | None:
    """Why a matmul on a dequantized weight was not taken (None: not one, or
    one for the other rule: ``packed`` says which, int4 or per channel)."""
    i_x, i_w = (1, 2) if node.target == aten.addmm.default else (0, 1)
    if len(node.args) <= i_w:
        return None
    src, unpacked = quantized_source(node.args[i_w])
    if src is None or unpacked != packed:
        return None
    w = node.args[i_w]
    if w.target == prims.convert_element_type.default and w.args[0].target == aten.permute.default:
        return None  # torchao's form: fusepass.patterns.dequant_matmul_torchao explains it
    x = _val(node.args[i_x])
    if isinstance(x, torch.Tensor) and x.dtype not in SUPPORTED:
        return f"activation dtype {x.dtype} has no kernel (fp32/fp16/bf16 only)"
    if w.target != aten.permute.default:
        return (f"the dequantized weight of {src.name} {shape_str(_val(src))} reaches the matmul without a "
                "transpose: stored [K, N], which the kernel cannot read")
    chain = _chain(node.args[i_w], src)
    for n in chain:
        if len(n.users) > 1:
            return f"the dequantized weight ({n.name}) is also used outside the matmul, by " + \
                ", ".join(u.name for u in n.users)
    if not packed and any(n.target == aten.sub.Tensor for n in chain):
        return (f"a zero point subtracted from the {_val(src).dtype} weight {shape_str(_val(src))}: fusepass's "
                "int8 and fp8 kernels are symmetric (q * s), with no zero point")
    return (f"a matmul on a weight dequantized from {_val(src).dtype} {shape_str(_val(src))} in a form fusepass "
            "does not know (see fusepass.patterns.dequant_matmul)")


def _chain(start: torch.fx.Node, stop: torch.fx.Node) -> list[torch.fx.Node]:
    out, todo = [], [start]
    while todo:
        n = todo.pop()
        if not isinstance(n, torch.fx.Node) or n is stop or n in out or n.op != "call_function":
            continue
        out.append(n)
        todo += list(n.all_input_nodes)
    return out


def explain(node: torch.fx.Node) -> str | None:
    return explain_for(node, packed=False)


# -- near-misses ------------------------------------------------------------------------

def _nm_per_token_scale(x, w, s):
    return F.linear(x, w.to(x.dtype)) * s[:, :1]  # a scale per row of x, not per channel


def _nm_scale_per_feature(x, w, s):
    return x @ (w.to(x.dtype) * s[None, :]).t()  # [1, K]: one scale per input feature, not per channel


def _nm_zero_point(x, w, s):
    return x @ ((w.to(x.dtype) - s[:, None] * 1000) * s[:, None]).t()  # asymmetric: (q - z) * s


def _inputs_square3(dtype):
    return _inputs_square(dtype)[:2] + [channel_scale(16, 16, dtype)]


def _nm_weight_kn(x, w, s):
    return x @ (w.to(x.dtype) * s[:, None])  # weight stored [K, N]


def _nm_transposed_storage(x, w, s):
    return x @ (w.t().contiguous().t().to(x.dtype) * s[:, None]).t()


def _nm_dequant_reused(x, w, s):
    wd = w.to(x.dtype) * s[:, None]
    return x @ wd.t(), wd.sum()


def _nm_fp64(x, w, s):
    return x @ (w.to(x.dtype) * s[:, None]).t()


def _inputs_square(dtype):
    n = 16
    return [torch.randn(n, n, dtype=dtype), torch.randint(-127, 128, (n, n), dtype=torch.int8),
            channel_scale(n * n, n, dtype).reshape(n, n)]


def _inputs_kn(dtype):
    return [torch.randn(4, K_EX, dtype=dtype), torch.randint(-127, 128, (K_EX, N_EX), dtype=torch.int8),
            channel_scale(K_EX, N_EX, dtype)]


def _inputs_fp64(dtype):
    return example_inputs(torch.float64)[:3]


def _inputs3(dtype):
    return example_inputs(dtype)[:3]


NEAR_MISSES = [
    NearMiss("per-token scale", _nm_per_token_scale, _inputs_square, "scale shape (16, 1) is not (16,)"),
    NearMiss("scale per input feature", _nm_scale_per_feature, _inputs_square3, "scales the weight's K = 16 input"),
    NearMiss("zero point", _nm_zero_point, _inputs3, "int8 and fp8 kernels are symmetric"),
    NearMiss("weight stored [K, N]", _nm_weight_kn, _inputs_kn, "without a transpose"),
    NearMiss("transposed storage", _nm_transposed_storage, _inputs3, "not stored [N, K] row after row"),
    NearMiss("dequantized weight reused", _nm_dequant_reused, _inputs3, "also used outside"),
    NearMiss("fp64 activations", _nm_fp64, _inputs_fp64, "float64 has no kernel"),
]

RULE = Rule(
    name="dequant_matmul",
    forms=[
        Form("scale_before", search_before, replace_before),
        Form("scale_before_bias", search_before_bias, replace_before_bias),
        Form("scale_after", search_after, replace_before),
        Form("scale_after_nd", search_after, replace_before, example_inputs=example_inputs_nd),
        Form("scale_after_1d", search_after, replace_before, example_inputs=example_inputs_1d),
        Form("scale_before_bmm", search_before, replace_before, example_inputs=example_inputs_bmm),
        Form("scale_after_bmm", search_after, replace_before, example_inputs=example_inputs_bmm),
        Form("scale_col", search_col, replace_col, example_inputs=example_inputs_col),
        Form("scale_col_bias", search_col_bias, replace_col_bias, example_inputs=example_inputs_col),
        Form("scale_col_cast", search_col_cast, replace_col_cast, example_inputs=example_inputs_f32),
        Form("scale_col_cast_bias", search_col_cast_bias, replace_col_cast_bias, example_inputs=example_inputs_f32),
        Form("dequant_fp32", search_fp32, replace_fp32, example_inputs=example_inputs_f32),
        Form("dequant_fp32_bias", search_fp32_bias, replace_fp32_bias, example_inputs=example_inputs_f32),
        Form("scale_after_fp32", search_after_fp32, replace_after_fp32, example_inputs=example_inputs_row),
    ],
    example_inputs=example_inputs,
    sized_inputs=sized_inputs,
    check=check,
    anchor=(aten.mm.default, aten.addmm.default),
    explain=explain,
    commutative_root=True,
    any_reshape=True,
    near_misses=NEAR_MISSES,
    doc=__doc__,
)
