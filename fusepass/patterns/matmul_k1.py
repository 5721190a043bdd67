"""A matrix product over one term (K = 1) -> the broadcast multiply it is.

    mm(a [M, 1], b [1, N])             = a * b          [M, N]
    bmm(a [B, M, 1], b [B, 1, N])      = a * b          [B, M, N]

Every Hugging Face model's rotary embedding computes its angles as
``inv_freq_expanded.float() @ position_ids_expanded.float()``, a bmm of
[B, d/2, 1] by [B, 1, T].  Inductor on torch 2.11 (the H200's) keeps it a
library GEMM: an fp32 CUTLASS kernel of 3 µs in every decode step, then its
cos / sin kernel (~2 µs); a multiply, Inductor fuses into that kernel.
Inductor's own decompositions, applied while tracing and so before the
post-grad passes, already make the multiply of an mm on the CPU of at most 32
elements, and from torch 2.12 of every K = 1 bmm and of an mm off the CPU
whose M and N are not 1: the rule takes what they leave (on torch 2.13, an mm
of one row or column, a larger mm on the CPU).

Exact for every float dtype.  With K = 1 each output is one product a_i·b_j:
in fp32 and fp64 a GEMM gives round(a·b), as the multiply does; in bf16 and
fp16 the product of two 16-bit values (at most 11 + 11 significant bits) is
exact in fp32 (away from its underflow), and a GEMM and the multiply both
round it once to the output dtype.  (A GEMM at TF32 precision,
``set_float32_matmul_precision("high")``, rounds fp32 operands to 10 bits
first: the multiply is then the exact one.  In a fused 16-bit kernel Inductor
keeps the product in fp32 instead of rounding it, as for every 16-bit
pointwise op, unless ``emulate_precision_casts`` is on.)

Left alone, without a line in the report (none is a near-miss a user could
act on): ``addmm`` / ``baddbmm`` (a GEMM's fused multiply-add rounds a·b + c
once, a multiply and an add round twice), K not 1 or not known when
compiling, integer and complex dtypes, the ``out_dtype`` overloads, and a
product on a weight dequantized in the graph (computed from int8 / uint8 /
fp8: the dequantizing rules own it, and explain it in the report when they
refuse it).  Runs after every other rule: the linear rules take a K = 1
product of theirs first (``linear_one`` a 16-bit one at one row).
"""

from __future__ import annotations

import torch
import torch.fx

from fusepass.matvec import from_stored
from fusepass.patterns._linear import is_call, val
from fusepass.rule import Form, NearMiss, Region, Rule

aten = torch.ops.aten
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def search(a, b):
    return a @ b


def replace(a, b):
    return a * b


def example_inputs(dtype):
    # M + N above 32 elements: Inductor's own CPU decomposition leaves the mm to the pass.
    return [torch.randn(24, 1, dtype=dtype), torch.randn(1, 16, dtype=dtype)]


def sized_inputs(dtype, shape):
    """a [*leading, 1] (matmul folds the leading dims into M) by b [1, hidden + 33]: N is
    never 1 and M + N more than 32, so no torch's CPU decomposition takes the mm first."""
    return dict(a=torch.randn(*shape[:-1], 1, dtype=dtype), b=torch.randn(1, shape[-1] + 33, dtype=dtype))


# -- the rule's find ----------------------------------------------------------------------------


def _one_term(a: torch.fx.Node, b: torch.fx.Node, rank: int) -> bool:
    av, bv = val(a), val(b)
    if not (isinstance(av, torch.Tensor) and isinstance(bv, torch.Tensor)):
        return False
    if av.dim() != rank or bv.dim() != rank or av.dtype != bv.dtype or av.dtype not in DTYPES:
        return False
    K, K2 = av.shape[-1], bv.shape[-2]
    # (a symbolic K is never 1 here: Dynamo specialises sizes of 1)
    if not (type(K) is int and type(K2) is int and K == 1 and K2 == 1):
        return False
    return not (from_stored(a) or from_stored(b))


def find(gm: torch.fx.GraphModule):
    for node in gm.graph.nodes:
        for target, form, rank in ((aten.mm.default, "mm", 2), (aten.bmm.default, "bmm", 3)):
            if is_call(node, target) and len(node.args) == 2 and not node.kwargs \
                    and _one_term(node.args[0], node.args[1], rank):
                yield Region(form, node, [node], [node], list(node.args), replace, names=["a", "b"])


# -- near-misses ---------------------------------------------------------------------------------

def _k2(a, b):
    return torch.cat([a, a], 1) @ torch.cat([b, b], 0)


def _biased(a, b):  # nn.Linear(1, N): one rounding of a·b + c in the GEMM, two in a multiply and an add
    return torch.addmm(b[0], a, b)


def _int8_inputs(dtype):
    return [torch.randn(24, 1, dtype=dtype), torch.randint(-127, 128, (1, 16), dtype=torch.int8)]


def _dequantized_in_graph(a, q):
    return a @ q.to(a.dtype)


RULE = Rule(
    name="matmul_k1",
    # No bmm form: from torch 2.12 Inductor makes a K = 1 bmm the multiply before the pass, and a form must be
    # rewritten wherever the rule checks run (tests/test_matmul_k1.py compiles it as torch 2.11 does).
    forms=[Form("mm", search, replace)],
    example_inputs=example_inputs,
    find=find,
    dtypes=DTYPES,
    priority=-20,  # last: every rule that takes a matmul has seen it
    sized_inputs=sized_inputs,
    near_misses=[
        NearMiss("K = 2", _k2, example_inputs, ""),
        NearMiss("addmm", _biased, example_inputs, ""),
        NearMiss("weight dequantized in the graph", _dequantized_in_graph, _int8_inputs, ""),
    ],
    doc=__doc__,
)
