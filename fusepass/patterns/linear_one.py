"""A lone 16-bit linear layer at one row of x -> ``fusepass::linear_siblings`` of one weight.

    y = x @ W^T (+ b),   x one row (a decode step at batch 1), W [N, K] fp16 / bf16

At one row a linear layer is a matrix-vector product: its time is its
weight's bytes and a launch's ramp.  cuBLAS serves one row with a split-K
kernel and a second launch that adds the slices; the siblings kernel reads
the weight once in one launch (``kernels.linear_siblings``).  What is left
after ``linear_siblings`` has grouped the products that share an x (an
attention's output projection, an MLP's down projection, a gate of one
output) is found here in the post-grad graph, as ``mm(x, B)`` /
``addmm(bias, x, B)`` nodes, and replaced where it was measured faster
(``kernels.linear_siblings.takes_one``: a row count known when compiling,
one row, up to 32 MiB of weight; Llama-3-8B's 112 MiB down projection ran
level with cuBLAS and stays there).

Left alone, without a line in the report (cuBLAS serves it as well or
better, or no faster one was measured): more rows or a symbolic row count,
fp32 and fp64, a larger weight, a weight whose rows are not contiguous in
memory (B is not the transpose of a row-major weight: cuBLAS reads it in
place, the kernel would copy it every call), a weight dequantized in the
graph that no quantized rule took (Inductor fuses its dequantization into
the product), a product on another device
than CUDA or the CPU (whose body is the same ``torch.mm``).
"""

from __future__ import annotations

import torch
import torch.fx

from fusepass.kernels.linear_siblings import linear_siblings_call, takes_one
from fusepass.matvec import from_stored
from fusepass.patterns._linear import product, val
from fusepass.rule import Form, NearMiss, Region, Rule

DTYPES = (torch.float16, torch.bfloat16)


def search_one(x, w):
    return x @ w.t()


def search_biased(x, w, b):
    return torch.nn.functional.linear(x, w, b)


def replace_one(x, w):
    return linear_siblings_call(x, [w], [None])[0]


def replace_biased(x, w, b):
    return linear_siblings_call(x, [w], [b])[0]


def example_inputs(dtype):
    return [torch.randn(1, 24, dtype=dtype), torch.randn(16, 24, dtype=dtype), torch.randn(16, dtype=dtype)]


def sized_inputs(dtype, shape):
    """x [*leading, hidden] with one row at most (more are not taken), a weight over ``hidden``."""
    lead = [min(d, 1) for d in shape[:-1]]
    K = shape[-1]
    return dict(x=torch.randn(*lead, K, dtype=dtype), w=torch.randn(16, K, dtype=dtype),
                b=torch.randn(16, dtype=dtype))


# -- the rule's find ------------------------------------------------------------------------


def _takes(x, b) -> bool:
    xv, bv = val(x), val(b)
    M, (K, N) = xv.shape[0], bv.shape
    if not (isinstance(M, int) and isinstance(K, int) and isinstance(N, int)):
        return False
    if xv.dtype not in DTYPES or bv.dtype != xv.dtype or bv.device != xv.device or \
            xv.device.type not in ("cuda", "cpu"):
        return False
    # B = W^T with W's rows contiguous: unit stride along K (any stride with one row of W)
    if K > 1 and N > 1 and bv.stride(0) != 1:
        return False
    # A weight dequantized in the graph (computed from int8 / uint8 / fp8: one the
    # dequant rules refused) would be written out by Inductor every call and read
    # back here; left alone, Inductor fuses the dequantization into its own
    # product (its multiply-and-sum under coordinate-descent tuning).
    if from_stored(b):
        return False
    # (no rows: the op returns an empty output, no launch)
    return M == 0 or takes_one(M, K * N * bv.element_size())


def find(gm: torch.fx.GraphModule):
    for node in gm.graph.nodes:
        got = product(node)
        if got is None or not _takes(got[0], got[1]):
            continue
        x, b, bias = got
        if bias is None:
            yield Region("one", node, [node], [node], [x, b], lambda x, b: replace_one(x, b.t()), names=["x", "w"])
        else:
            yield Region("biased", node, [node], [node], [x, b, bias], lambda x, b, c: replace_biased(x, b.t(), c),
                         names=["x", "w", "b"])


# -- near-misses ------------------------------------------------------------------------------

def _two_inputs(dtype):
    return example_inputs(dtype)[:2]


def _prefill_rows(x, w):  # sixteen rows: a GEMM, cuBLAS's
    return torch.cat([x] * 16) @ w.t()


def _stored_transposed(x, w):  # B contiguous [K, N]: cuBLAS reads it in place
    return x @ w.t().contiguous()


def _int8_inputs(dtype):
    return [torch.randn(1, 24, dtype=dtype), torch.randint(-127, 128, (16, 24), dtype=torch.int8)]


def _dequantized_in_graph(x, q):  # a weight converted from int8 in the graph, no scale: no quantized rule's
    return x @ q.to(x.dtype).t()


RULE = Rule(
    name="linear_one",
    forms=[Form("one", search_one, replace_one), Form("biased", search_biased, replace_biased)],
    example_inputs=example_inputs,
    find=find,
    dtypes=DTYPES,
    priority=-11,  # after linear_siblings, which groups the products of one x first
    sized_inputs=sized_inputs,
    # A weight laid out otherwise is left to cuBLAS: the differential generator expects no rewrite then.
    packed_args=("w",),
    near_misses=[
        NearMiss("rows of a prefill", _prefill_rows, _two_inputs, ""),
        NearMiss("weight stored transposed", _stored_transposed, _two_inputs, ""),
        NearMiss("weight dequantized in the graph", _dequantized_in_graph, _int8_inputs, ""),
    ],
    doc=__doc__,
)
