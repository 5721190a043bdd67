"""matmul_k1: a product over one term (K = 1) becomes the multiply it is, bit for bit.

From torch 2.12 Inductor's own decompositions turn a K = 1 bmm (and, off the
CPU, an mm) into that multiply before the post-grad passes, so on this torch
the rotary embedding's bmm never reaches the rule.  The tests that need it to
run the compile as torch 2.11 does it (the H200's): with those two
decompositions left out (:func:`inductor_keeps_k1_products`).
"""

import contextlib
import glob

import pytest
import torch

import fusepass
from fusepass.backend import interpreting_after_pass

aten = torch.ops.aten
FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


@contextlib.contextmanager
def inductor_keeps_k1_products():
    """Inductor without its decompositions of mm and bmm (torch 2.11 has none for K = 1), and
    without its compile caches, which would serve a graph compiled with them."""
    from torch._inductor import decomposition

    tables = {id(t): t for t in (decomposition.decompositions, decomposition.select_decomp_table())}.values()
    saved = [(t, op, t.pop(op)) for t in tables for op in (aten.mm.default, aten.bmm.default) if op in t]
    try:
        with torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            yield
    finally:
        for t, op, fn in saved:
            t[op] = fn


class RotaryEmbedding(torch.nn.Module):
    """transformers' Llama rotary embedding (the default rope type), as every model's modelling code has it."""

    def __init__(self, head_dim=64, base=10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = 1.0

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv_freq_expanded = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1).to(x.device)
        position_ids_expanded = position_ids[:, None, :].float()
        with torch.autocast(device_type=x.device.type, enabled=False):  # Force float32
            freqs = (inv_freq_expanded.float() @ position_ids_expanded.float()).transpose(1, 2)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos = emb.cos() * self.attention_scaling
            sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def _bmms_after_pass(folder) -> int:
    return sum(open(p).read().count("aten.bmm.default") for p in glob.glob(f"{folder}/*.after.txt"))


@pytest.mark.parametrize("inductor", ["torch 2.11", "this torch"])
def test_rotary_embedding_has_no_gemm_left(inductor, device, tmp_path):
    """A prefill (B = 2, T = 7) and a decode step (B = 1, T = 1, position 4000) of a bf16 model's
    rotary embedding: bit for bit eager's cos and sin, and no bmm left after the pass -- the
    rule's multiply on torch 2.11, Inductor's own from torch 2.12."""
    rope = RotaryEmbedding().to(device)
    torch._dynamo.reset()
    fusepass.reset_reports()
    compiled = torch.compile(rope, backend="fusepass", options={"dump_graphs": str(tmp_path)})
    emulated = inductor == "torch 2.11"
    with inductor_keeps_k1_products() if emulated else contextlib.nullcontext():
        for batch, length, start in ((2, 7, 0), (1, 1, 4000)):
            x = torch.randn(batch, length, 32, dtype=torch.bfloat16, device=device)
            position_ids = torch.arange(start, start + length, device=device)[None].expand(batch, length)
            for got, want in zip(compiled(x, position_ids), rope(x, position_ids)):
                assert torch.equal(got, want), (batch, length)
    report = fusepass.last_report()
    assert _bmms_after_pass(tmp_path) == 0, str(report)
    if emulated:
        assert report.count("matmul_k1") == 2 and not report.reasons("matmul_k1"), str(report)


def _products(pairs):
    return tuple(a @ b for a, b in pairs)


def _operand(shape, dtype, device, gen):
    """Values of every magnitude and sign with full mantissas, an infinity and a NaN: products
    that round in every dtype, and an fp16 product in its subnormal range."""
    t = torch.randn(shape, generator=gen, dtype=torch.float64) * torch.exp2(torch.randint(-6, 7, shape, generator=gen))
    flat = t.view(-1)
    flat[0], flat[1], flat[2] = float("inf"), float("nan"), 3e-5
    return t.to(dtype=dtype, device=device)


def test_exact_in_every_float_dtype(device):
    """mm [40, 1] x [1, 24] and bmm [3, 40, 1] x [3, 1, 24] in fp32, fp16, bf16 and fp64, one
    graph through Inductor's code: every output the same bits as eager's GEMM (NaN where it
    is NaN), and the products really rounded (not all exact in the dtype)."""
    gen = torch.Generator().manual_seed(0)
    pairs = []
    for dtype in FLOATS:
        pairs.append((_operand((40, 1), dtype, device, gen), _operand((1, 24), dtype, device, gen)))
        pairs.append((_operand((3, 40, 1), dtype, device, gen), _operand((3, 1, 24), dtype, device, gen)))
    torch._dynamo.reset()
    fusepass.reset_reports()
    with inductor_keeps_k1_products():
        got = torch.compile(_products, backend="fusepass")(pairs)
    report = fusepass.last_report()
    assert report.count("matmul_k1") == len(pairs), str(report)
    for (a, b), g, want in zip(pairs, got, _products(pairs)):
        what = f"{a.dtype} {tuple(a.shape)}"
        assert g.dtype == want.dtype and g.shape == want.shape, what
        assert torch.equal(g.isnan(), want.isnan()), what
        assert torch.equal(g.nan_to_num(0.0), want.nan_to_num(0.0)), what
        exact = a.double() * b.double()
        finite = exact.isfinite()
        if a.dtype != torch.float64:
            assert (g.double() != exact)[finite].any(), f"{what}: no product rounded"


def _k2_bmm(a, b):
    return torch.cat([a, a], 2) @ torch.cat([b, b], 1)


def _baddbmm(a, b):
    return torch.baddbmm(b[:, :, :1].transpose(1, 2), a, b)


def _addmm(a, b):  # nn.Linear(1, N): the GEMM rounds a·b + c once, a multiply and an add twice
    return torch.addmm(b[0], a[0], b[0])


def _int64(a, b):
    return (a * 8).long() @ (b * 8).long()


@pytest.mark.parametrize("fn", [_k2_bmm, _baddbmm, _addmm, _int64], ids=["K=2", "baddbmm", "addmm", "int64"])
def test_left_alone_without_a_line(fn):
    """Products the multiply would not compute the same, or that need more terms: not
    rewritten, and nothing about them in the report."""
    a, b = torch.randn(2, 40, 1), torch.randn(2, 1, 24)
    torch._dynamo.reset()
    fusepass.reset_reports()
    with inductor_keeps_k1_products(), interpreting_after_pass():
        got = torch.compile(fn, backend="fusepass")(a, b)
    report = fusepass.last_report()
    assert report.count("matmul_k1") == 0 and not report.reasons("matmul_k1"), str(report)
    assert torch.equal(got, fn(a, b))


def test_symbolic_rows_and_columns():
    """dynamic=True: M and N symbolic, K = 1 still known (Dynamo specialises sizes of 1); one
    graph serves both calls."""
    torch._dynamo.reset()
    fusepass.reset_reports()
    fn = torch.compile(lambda a, b: a @ b, backend="fusepass", dynamic=True)
    with interpreting_after_pass():
        for m, n in ((40, 24), (56, 9)):
            a, b = torch.randn(m, 1), torch.randn(1, n)
            assert torch.equal(fn(a, b), a @ b)
    report = fusepass.last_report()
    assert len(report.graphs) == 1 and report.count("matmul_k1") == 1, str(report)
