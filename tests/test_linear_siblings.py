"""``fusepass::linear_siblings``: projections of one x in one launch, and the rule that finds them."""

from __future__ import annotations

import copy

import pytest
import torch

import fusepass
from fusepass.kernels import linear_siblings as ls
from fusepass.testing import assert_close
from fusepass.testing import differential

interpreted = pytest.mark.skipif(not differential.interpreting(), reason="the Triton kernel under the interpreter")


def _reference(x, ws, bs):
    return [x.double() @ w.double().t() + (b.double() if b is not None else 0) for w, b in zip(ws, bs)]


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M,K,cfg", [(1, 37, (1, 16, 4)), (2, 64, (2, 32, 4)), (3, 100, (4, 64, 4)),
                                     (4, 48, (8, 16, 1)), (1, 300, None)])
def test_kernel_matches_fp64_on_every_row(dtype, M, K, cfg):
    """Odd N (1, 5, 33), K not a whole tile, a weight of strided rows, x of strided
    rows, biases on some weights, each rows-a-program tile: every output element
    written (the buffers are NaN first) and within the dtype's tolerance of fp64."""
    torch.manual_seed(M * K)
    x = torch.randn(M, K + 5, dtype=dtype)[:, :K]
    ws = [torch.randn(33, K, dtype=dtype), torch.randn(5, K + 3, dtype=dtype)[:, :K], torch.randn(1, K, dtype=dtype)]
    bs = [torch.randn(33, dtype=dtype), None, torch.randn(1, dtype=dtype)]
    outs = [torch.full((M, w.shape[0]), float("nan"), dtype=dtype) for w in ws]
    ls.siblings_launch(x, ws, bs, outs, cfg).run()
    for got, want in zip(outs, _reference(x, ws, bs)):
        assert torch.isfinite(got).all()
        assert_close(got, want.to(dtype), "linear_siblings", dtype=dtype)


@interpreted
def test_four_weights_and_the_op_through_its_cuda_body():
    torch.manual_seed(1)
    x = torch.randn(2, 1, 40, dtype=torch.bfloat16)
    ws = [torch.randn(n, 40, dtype=torch.bfloat16) for n in (7, 1, 16, 3)]
    bs = [None, torch.randn(1, dtype=torch.bfloat16), None, torch.randn(6, dtype=torch.bfloat16)[::2]]  # (strided)
    with differential.triton_on_cpu(["linear_siblings"]):
        got = torch.ops.fusepass.linear_siblings(x, ws, bs)
    for g, w in zip(got, _reference(x, ws, bs)):
        assert g.shape == (2, 1, w.shape[-1])
        assert_close(g, w.to(torch.bfloat16), "linear_siblings", dtype=torch.bfloat16)


def test_takes_what_was_measured_faster():
    assert ls.takes(1, 48 << 20) and not ls.takes(1, 224 << 20)
    assert ls.takes(4, 20 << 20) and not ls.takes(4, 48 << 20)
    assert not ls.takes(5, 1 << 20) and not ls.takes(0, 1 << 20)


class _Attention(torch.nn.Module):
    def __init__(self, K=64, bias=False, n=3):
        super().__init__()
        self.proj = torch.nn.ModuleList(torch.nn.Linear(K, N, bias=bias) for N in (64, 16, 16, 8, 8)[:n])
        self.o = torch.nn.Linear(64, K, bias=False)

    def forward(self, x):
        ys = [p(x) for p in self.proj]
        h = ys[0]
        for y in ys[1:]:
            h = h * y.sum(-1, keepdim=True).sigmoid()
        return self.o(h)


def _compile(model, x, **kw):
    torch._dynamo.reset()
    fusepass.reset_reports()
    with torch.no_grad():
        got = torch.compile(model, backend="fusepass", **kw)(x)
        want = model(x)
    return got, want, fusepass.last_report()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rule_takes_a_decode_steps_projections(bias, dtype):
    model = _Attention(bias=bias).to(dtype).eval()
    got, want, report = _compile(model, torch.randn(2, 1, 64, dtype=dtype))
    hits = [h for h in report.hits if h.rule == "linear_siblings"]
    assert [h.form for h in hits] == ["three"]
    assert_close(got, want, "linear_siblings model", dtype=dtype)


def test_zero_width_x_is_rewritten_and_gives_the_biases():
    """x with no features (K = 0): the products are zeros plus the biases, in the
    op and its CPU body (its rows were once reshaped with -1, which a
    zero-size row cannot take: a crash inside the compiled program, found by
    the long differential run)."""
    from fusepass.kernels._common import rows

    assert rows(torch.empty(3, 2, 0), 0).shape == (6, 0)
    x = torch.empty(2, 1, 0)
    ws, bs = [torch.randn(4, 0), torch.randn(3, 0)], [torch.randn(4), None]
    got = torch.ops.fusepass.linear_siblings(x, ws, bs)
    assert [tuple(y.shape) for y in got] == [(2, 1, 4), (2, 1, 3)]
    torch.testing.assert_close(got[0], bs[0].expand(2, 1, 4))
    assert not got[1].any()

    class Zero(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(0, 8), torch.nn.Linear(0, 4, bias=False)

        def forward(self, x):
            return self.a(x).sum(-1, keepdim=True) * 2 + self.b(x)

    got, want, report = _compile(Zero().eval(), torch.empty(2, 1, 0))
    assert [h.form for h in report.hits if h.rule == "linear_siblings"] == ["two"]
    torch.testing.assert_close(got, want)


def test_five_siblings_are_a_call_of_four_and_one_left():
    model = _Attention(n=5).eval()
    got, want, report = _compile(model, torch.randn(1, 64))
    assert [h.form for h in report.hits if h.rule == "linear_siblings"] == ["four"]
    assert_close(got, want, "linear_siblings five", dtype=torch.float32)


def test_prefill_and_large_groups_stay_with_cublas(monkeypatch):
    model = _Attention().eval()
    _, _, report = _compile(model, torch.randn(1, 16, 64))  # sixteen rows: a GEMM
    assert not [h for h in report.hits if h.rule == "linear_siblings"] and not report.refusals
    monkeypatch.setattr(ls, "MAX_BYTES", {1: 1000})  # the group's 12 KB measured as not worth a launch
    _, _, report = _compile(model, torch.randn(1, 64))
    assert not [h for h in report.hits if h.rule == "linear_siblings"]


def test_dynamic_rows_go_to_the_op_which_decides_per_call():
    model = _Attention().eval()
    torch._dynamo.reset()
    fusepass.reset_reports()
    compiled = torch.compile(model, backend="fusepass", dynamic=True)
    with torch.no_grad():
        for rows in (1, 3, 9):
            x = torch.randn(rows, 64)
            assert_close(compiled(x), model(x), f"linear_siblings rows {rows}", dtype=torch.float32)
    assert [h.form for h in fusepass.last_report().hits if h.rule == "linear_siblings"] == ["three"]


# -- quantized linears: fusepass::dequant_matmul_siblings ---------------------------------------


def _quantized_attention(fmt, group=32):
    model = _Attention(K=128).to(torch.bfloat16).eval()
    fusepass.quantize(model, fmt, group_size=group)
    return model


@pytest.mark.parametrize("fmt", ["int4", "int8", "fp8"])
def test_rule_groups_quantized_projections_of_one_x(fmt):
    """q / k / v quantized by fusepass.quantize: the dequant rules take each
    linear, then linear_siblings puts the three calls in one; the Triton kernel
    (interpreted) and the CPU body both match eager."""
    _rewritten_both_ways(_quantized_attention(fmt), torch.randn(1, 1, 128, dtype=torch.bfloat16), "linear_siblings",
                         f"{fmt} three")


def _rewritten_both_ways(model, x, rule, form):
    """``rule`` rewrites ``model`` once, as ``form``; the CPU bodies and (interpreted)
    the Triton kernels both match eager."""
    got, want, report = _compile(model, x)
    assert [h.form for h in report.hits if h.rule == rule] == [form]
    assert_close(got, want, form, dtype=torch.bfloat16)
    if differential.interpreting():
        torch._dynamo.reset()
        with differential.triton_on_cpu(), torch.no_grad():
            got = torch.compile(model, backend="fusepass")(x)
        assert_close(got, want, f"{form} (Triton)", dtype=torch.bfloat16)


class _Permuted(torch.nn.Module):
    """q / k / v reading x's features in a permuted order (GPTQ's act-order layers
    as fusepass.load_quantized makes them), each gathering x itself."""

    def __init__(self, perms):
        super().__init__()
        self.proj = torch.nn.ModuleList(torch.nn.Linear(64, n, bias=False) for n in (32, 16, 16))
        for p, perm in zip(self.proj, perms):
            p.register_buffer("perm", perm)

    def forward(self, x):
        ys = [p(x.index_select(-1, p.perm)) for p in self.proj]
        return ys[0] * (ys[1].sum(-1, keepdim=True) + ys[2].sum(-1, keepdim=True)).sigmoid()


class _Crossed(torch.nn.Module):
    """Two pairs of products of two inputs, each pair's second weight made from
    the other pair's first product: grouping both pairs would make each group's
    call wait on the other's (a cycle the engine's topological sort cannot
    order)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(16, 32)) for _ in range(4))

    def forward(self, x1, x2):
        a1 = x1 @ self.w[0].t()
        b1 = x2 @ self.w[1].t()
        a2 = x1 @ (self.w[2] + b1.sum()).t()
        b2 = x2 @ (self.w[3] + a1.sum()).t()
        return a1 + a2, b1 + b2


def test_weights_made_from_another_groups_products_stay_apart():
    torch.manual_seed(2)
    model = _Crossed().eval()
    x1, x2 = torch.randn(1, 32), torch.randn(1, 32)
    torch._dynamo.reset()
    fusepass.reset_reports()
    with torch.no_grad():
        got = torch.compile(model, backend="fusepass")(x1, x2)
        want = model(x1, x2)
    # (the second pair joins: its weight reads a product made before the pair; the first stays apart)
    assert [h.form for h in fusepass.last_report().hits if h.rule == "linear_siblings"] == ["two"]
    for g, w in zip(got, want):
        assert_close(g, w, "crossed pairs", dtype=torch.float32)


def test_one_permutation_of_x_taken_alike_is_one_x():
    """Products of x gathered by one shared index tensor are one x (one call of
    three); gathered by equal but separate index tensors, or by different ones,
    they stay apart (no values compared at compile time)."""
    torch.manual_seed(3)
    perm, other = torch.randperm(64), torch.randperm(64)
    x = torch.randn(1, 1, 64)
    for perms, forms in (([perm] * 3, ["three"]), ([perm, perm.clone(), other], [])):
        model = _Permuted(perms).eval()
        got, want, report = _compile(model, x)
        assert [h.form for h in report.hits if h.rule == "linear_siblings"] == forms
        assert_close(got, want, "linear_siblings permuted x", dtype=torch.float32)


def test_quantized_prefill_rows_stay_apart():
    model = _quantized_attention("int4")
    _, _, report = _compile(model, torch.randn(1, 12, 128, dtype=torch.bfloat16))
    assert not [h for h in report.hits if h.rule == "linear_siblings"]


def test_quantized_group_whose_plan_is_not_the_gemv_stays_apart(monkeypatch):
    """On CUDA with the rows known, a group whose plan is not the GEMV is left
    as separate calls (the op would run them one by one from the dispatcher);
    on the CPU, and where the plan is the GEMV, the group is made."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fusepass.patterns import linear_siblings as rule

    g = torch.fx.Graph()
    calls = []
    for device in ("cuda", "cpu"):
        with FakeTensorMode():
            x = torch.empty(2, 256, device=device, dtype=torch.bfloat16)
            ws = [torch.empty(n, 128, device=device, dtype=torch.uint8) for n in (256, 64)]
            ss = [torch.empty(n, 8, device=device, dtype=torch.bfloat16) for n in (256, 64)]
        nodes = []
        for i, val in enumerate([x, *ws, *ss]):
            nodes.append(g.placeholder(f"a{i}_{device}"))
            nodes[-1].meta["val"] = val
        xn, w0, w1, s0, s1 = nodes
        calls.append([g.call_function(rule._DEQUANT, (xn, w, s, None, None, "int4", 32))
                      for w, s in ((w0, s0), (w1, s1))])
    seen = []

    def plan(M, Ns, K, fmt, G, dtype, device):
        seen.append((M, tuple(Ns), K, fmt, G, device.type))
        return None

    monkeypatch.setattr(rule, "group_plan", plan)
    assert rule._another_plan(calls[0], "int4", 32)
    assert seen == [(2, (256, 64), 256, "int4", 32, "cuda")]
    assert not rule._another_plan(calls[1], "int4", 32)  # CPU: the op's body is plain torch either way
    monkeypatch.setattr(rule, "group_plan", lambda *a: object())
    assert not rule._another_plan(calls[0], "int4", 32)


@interpreted
@pytest.mark.parametrize("fmt,group", [("int4", 32), ("int4", 128), ("int8", 0), ("fp8", 0)])
@pytest.mark.parametrize("M", [1, 3])
def test_siblings_kernel_matches_each_weights_op(fmt, group, M):
    """Every config shape of the GEMV (rows a program, K tile, the folded int4
    loop) over three weights of odd row counts, K not a whole tile, zero
    points and a bias: the same values as dequant_matmul weight by weight
    (outputs NaN first: every element written)."""
    from fusepass.kernels.dequant_matmul import Config
    from fusepass.kernels.dequant_matmul.launch import siblings_launch

    from fusepass.quantize import quantize_rows

    torch.manual_seed(M)
    K = 160  # five groups of 32, one of 128 and a part: not a whole K tile of 64 or 128
    K = 256 if group == 128 else K
    ws, ss, zs = [], [], []
    for n in (33, 5, 1):
        q, s, z = quantize_rows(torch.randn(n, K) * 0.1, fmt, group or 128)
        ws.append(q)
        ss.append(s.to(torch.bfloat16) if fmt == "int4" else s)
        zs.append(z.to(torch.bfloat16) if z is not None else None)
    x, bs = torch.randn(M, K, dtype=torch.bfloat16), [None, torch.randn(5, dtype=torch.bfloat16), None]
    want = [torch.ops.fusepass.dequant_matmul(x, w, s, z, b, fmt, group) for w, s, z, b in zip(ws, ss, zs, bs)]
    for cfg in (Config("gemv", BN=4, BK=64), Config("gemv", BN=8, BK=32, fold=1), Config("gemv", BN=1, BK=128)):
        outs = [torch.full((M, w.shape[0]), float("nan"), dtype=torch.bfloat16) for w in ws]
        siblings_launch(x, ws, ss, zs, bs, outs, fmt, group if fmt == "int4" else 0, cfg).run()
        for g, w in zip(outs, want):
            assert torch.isfinite(g).all()
            assert_close(g, w, f"{fmt} {cfg.label()}", dtype=torch.bfloat16)


@interpreted
@pytest.mark.parametrize("fmt,dtype", [("nf4", torch.bfloat16)])  # (fp4: the same loop, another table)
def test_codebook_siblings_and_gated_kernels_match_each_weights_op(fmt, dtype):
    """bitsandbytes' code books (absmax per block of 64, no zero point) through
    the siblings grid and the gated grid (the int4 loop with the code book in
    the zero point's place): three weights of odd row counts and a bias, one
    and three rows, K not a whole tile; the gated launch's pair through the
    activation.  The same values as dequant_matmul weight by weight (outputs
    NaN first: every element written); a tile that splits a chunk is no plan
    for the grid."""
    from fusepass.kernels.dequant_matmul import Config
    from fusepass.kernels.dequant_matmul import gated as gm
    from fusepass.kernels.dequant_matmul.launch import gated_launch, sibling_fits, siblings_launch
    from fusepass.testing.library_layouts import library_inputs

    K = 192  # three blocks: a tile of 128 is masked in its second step
    for M, cfg in ((1, Config("gemv", BN=4, BK=64)), (3, Config("gemv", BN=2, BK=128, warps=2))):
        ws, ss = [], []
        for i, n in enumerate((33, 5, 33)):
            x, w, s, _, _, _ = library_inputs(fmt, M, n, K, dtype, seed=10 * M + i)
            ws.append(w)
            ss.append(s)
        bs = [None, torch.randn(5, dtype=dtype), torch.randn(33, dtype=dtype)]
        want = [torch.ops.fusepass.dequant_matmul(x, w, s, None, b, fmt, 64) for w, s, b in zip(ws, ss, bs)]
        assert sibling_fits(cfg, fmt, 64)
        outs = [torch.full((M, w.shape[0]), float("nan"), dtype=dtype) for w in ws]
        siblings_launch(x, ws, ss, [None] * 3, bs, outs, fmt, 64, cfg).run()
        for g, w in zip(outs, want):
            assert torch.isfinite(g).all()
            assert_close(g, w, f"{fmt} siblings {cfg.label()}", dtype=dtype)
        out = torch.full((M, 33), float("nan"), dtype=dtype)
        gated_launch(x, [ws[0], ws[2]], [ss[0], ss[2]], [None, None], [bs[2], bs[2]], out, fmt, 64, cfg,
                     "silu").run()
        ref = gm._reference(x, [ws[0], ws[2]], [ss[0], ss[2]], [None, None], [bs[2], bs[2]], fmt, 64, "silu")
        assert torch.isfinite(out).all()
        assert_close(out, ref, f"{fmt} gated {cfg.label()}", dtype=dtype)
    assert not sibling_fits(Config("gemv", BN=4, BK=48), fmt, 64)  # 1.5 chunks a tile: value by value only


def _double_quantized(n, k, seed):
    """bitsandbytes' double quantization of an [n, k] NF4 weight's absmax, in its
    layout: a byte a block of 64, one nested absmax per 256 blocks (values far
    apart, so a block read against its neighbour's shows), a 256-entry code
    and an offset."""
    g = torch.Generator().manual_seed(seed)
    blocks = n * k // 64
    a8 = torch.randint(0, 256, (n, k // 64), dtype=torch.uint8, generator=g)
    nest = torch.rand(-(-blocks // 256), generator=g) * 4 + 0.25
    code = torch.sort(torch.rand(256, generator=g) * 2 - 1)[0]
    return a8, [nest, code, torch.rand(1, generator=g) * 0.1 + 0.05]


@interpreted
def test_double_quantized_absmax_read_in_the_gemv_grids():
    """A code book's absmax as double quantization stores it (a byte a block,
    nested absmax per 256 blocks, code, offset), read by the one-weight,
    siblings and gated GEMV grids as they go (12 blocks a row: block 256 lies
    inside row 21; one row with whole K tiles, two with a masked last one),
    and expanded in the op where the plan is the tensor-core kernel (five
    rows): every output as the op (or, at five rows, the same kernel) on the
    expanded fp32 absmax (outputs NaN first)."""
    from fusepass.kernels.dequant_matmul import Config, dequant_matmul_fwd
    from fusepass.kernels.dequant_matmul import gated as gm
    from fusepass.kernels.dequant_matmul.launch import gated_launch, product_launch, siblings_launch
    from fusepass.kernels.dequant_matmul.op import expand_absmax

    dtype, K, N = torch.bfloat16, 768, 24
    for M, cfg in ((1, Config("gemv", BN=4, BK=256)), (2, Config("gemv", BN=2, BK=512, warps=2))):
        g = torch.Generator().manual_seed(M)
        x = torch.randn(M, K, dtype=dtype, generator=g)
        ws = [torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=g) for _ in range(2)]
        st = [_double_quantized(N, K, 10 * M + i) for i in range(2)]
        fp32 = [expand_absmax(a8, q) for a8, q in st]
        want = [torch.ops.fusepass.dequant_matmul(x, w, s, None, None, "nf4", 64) for w, s in zip(ws, fp32)]
        for i, (w, (a8, q)) in enumerate(zip(ws, st)):
            assert_close(torch.ops.fusepass.dequant_matmul(x, w, a8, None, None, "nf4", 64, None, None, *q),
                         want[i], "op, CPU body", dtype=dtype)
            out = torch.full((M, N), float("nan"), dtype=dtype)
            product_launch(x, w, a8, None, None, out, "nf4", 64, cfg, nested=q).run()
            assert_close(out, want[i], f"one weight {cfg.label()}", dtype=dtype)
        outs = [torch.full((M, N), float("nan"), dtype=dtype) for _ in ws]
        siblings_launch(x, ws, [a for a, _ in st], [None] * 2, [None] * 2, outs, "nf4", 64, cfg,
                        [q for _, q in st]).run()
        for got, w in zip(outs, want):
            assert_close(got, w, f"siblings {cfg.label()}", dtype=dtype)
        out = torch.full((M, N), float("nan"), dtype=dtype)
        gated_launch(x, ws, [a for a, _ in st], [None] * 2, [None] * 2, out, "nf4", 64, cfg, "silu",
                     [q for _, q in st]).run()
        assert_close(out, gm._reference(x, ws, fp32, [None] * 2, [None] * 2, "nf4", 64, "silu"), "gated",
                     dtype=dtype)
    x = torch.randn(5, K, dtype=dtype)  # the tensor-core plan: the op expands the absmax first
    got = dequant_matmul_fwd(x, ws[0], st[0][0], None, None, "nf4", 64, nested=st[0][1])
    assert_close(got, dequant_matmul_fwd(x, ws[0], fp32[0], None, None, "nf4", 64), "five rows", dtype=dtype)


class _Bnb(torch.nn.Module):
    """q / k / v and an MLP's gate / up / down as bitsandbytes 4-bit linears
    (blocks of 64, ``nested``: double quantization), quantized on the CPU."""

    def __init__(self, quant_type, K=128, nested=False):
        super().__init__()
        import bitsandbytes as bnb

        def linear(k, n):
            lin = bnb.nn.Linear4bit(k, n, bias=False, compute_dtype=torch.bfloat16, quant_type=quant_type,
                                    compress_statistics=nested)
            lin.weight = bnb.nn.Params4bit(torch.randn(n, k) * 0.1, requires_grad=False, quant_type=quant_type,
                                           compress_statistics=nested)._quantize("cpu")
            lin.support_avx512bf16_for_cpu = False  # (the GPU's gemm_4bit layout, not the CPU's repack)
            return lin

        self.q, self.k, self.v = linear(K, 64), linear(K, 32), linear(K, 32)
        self.gate, self.up, self.down = linear(K, 128), linear(K, 128), linear(128, K)

    def forward(self, x):
        h = self.q(x) * (self.k(x).sum(-1, keepdim=True) + self.v(x).sum(-1, keepdim=True)).sigmoid()
        return h, self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


@pytest.mark.parametrize("quant_type,nested", [("nf4", False), ("fp4", False), ("nf4", True)])
def test_bnb_projections_of_one_x_are_one_launch(quant_type, nested):
    """bitsandbytes' NF4 / FP4 linears at one token: the library rule takes each,
    then q / k / v become one siblings call and gate / up with SiLU one gated
    call, with double quantization too (each weight's absmax bytes and tables
    passed as stored, nothing computed beside the calls); the CPU bodies and
    the Triton kernels (interpreted, on the double-quantized model: its
    absmax read in the grids) match eager."""
    pytest.importorskip("bitsandbytes")
    torch.manual_seed(5)
    model = _Bnb(quant_type, nested=nested).eval()
    x = torch.randn(1, 1, 128, dtype=torch.bfloat16)
    got, want, report = _compile(model, x)
    kind = f"{quant_type} nested" if nested else quant_type
    assert sorted(h.form for h in report.hits if h.rule == "linear_siblings") == [f"{kind} three", f"{kind} two"]
    assert [h.form for h in report.hits if h.rule == "dequant_matmul_gated"] == [f"{quant_type}_silu"]
    for g, w in zip(got, want):
        assert_close(g, w, f"bnb {quant_type}", dtype=torch.bfloat16)
    if differential.interpreting() and quant_type == "nf4" and nested:
        torch._dynamo.reset()
        with differential.triton_on_cpu(), torch.no_grad():
            got = torch.compile(model, backend="fusepass")(x)
        for g, w in zip(got, want):
            assert_close(g, w, "bnb nf4 (Triton)", dtype=torch.bfloat16)


# -- one weight alone at one row: linear_one ----------------------------------------------------


class _Step(torch.nn.Module):
    """q / k grouped by linear_siblings; o (biased) and the head each alone."""

    def __init__(self, K=64, vocab=100):
        super().__init__()
        self.q, self.k = torch.nn.Linear(K, 64, bias=False), torch.nn.Linear(K, 16, bias=False)
        self.o, self.head = torch.nn.Linear(64, K), torch.nn.Linear(K, vocab, bias=False)

    def forward(self, x):
        h = self.q(x) * self.k(x).sum(-1, keepdim=True).sigmoid()
        return self.head(torch.relu(self.o(h)))


def _ones(report):
    return sorted(h.form for h in report.hits if h.rule == "linear_one")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_linear_one_takes_the_lone_products_of_a_decode_step(dtype):
    model = _Step().to(dtype).eval()
    got, want, report = _compile(model, torch.randn(1, 1, 64, dtype=dtype))
    assert _ones(report) == ["biased", "one"]
    assert [h.form for h in report.hits if h.rule == "linear_siblings"] == ["two"]
    assert_close(got, want, "linear_one model", dtype=dtype)
    assert not report.refusals


def test_linear_one_leaves_what_cublas_serves_as_well(monkeypatch):
    """More rows, fp32, a symbolic row count (Dynamo specializes a count of 1), a
    weight stored [K, N], and a weight over the measured bound stay mm, without a
    line in the report."""
    bf16 = torch.bfloat16
    for model, x, kw in ((_Step().to(bf16).eval(), torch.randn(1, 2, 64, dtype=bf16), {}),
                         (_Step().eval(), torch.randn(1, 1, 64), {}),
                         (_Step().to(bf16).eval(), torch.randn(1, 3, 64, dtype=bf16), {"dynamic": True})):
        got, want, report = _compile(model, x, **kw)
        assert not _ones(report) and not report.refusals, str(report)
        assert_close(got, want, "linear_one left", dtype=x.dtype)

    class Stored(torch.nn.Module):  # x @ W with W [K, N] (a Conv1D-style weight)
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(64, 48, dtype=bf16))

        def forward(self, x):
            return x @ self.w

    got, want, report = _compile(Stored().eval(), torch.randn(1, 64, dtype=bf16))
    assert not _ones(report)
    assert_close(got, want, "linear_one stored [K, N]", dtype=bf16)

    class Dequantized(torch.nn.Module):  # an int8 weight converted in the graph, an fp32 scale after the product
        def __init__(self):
            super().__init__()
            self.register_buffer("q", torch.randint(-127, 128, (48, 64), dtype=torch.int8))
            self.register_buffer("s", torch.rand(48) / 100)

        def forward(self, x):
            return torch.nn.functional.linear(x, self.q.to(x.dtype)) * self.s

    got, want, report = _compile(Dequantized().eval(), torch.randn(1, 64, dtype=bf16))
    assert not _ones(report), str(report)  # Inductor fuses the conversion into its own product
    assert_close(got, want, "linear_one dequantized weight", dtype=bf16)
    monkeypatch.setattr(ls, "MAX_BYTES_ONE", 100 * 64 * 2 - 1)  # the head's 12.5 KB over the bound, o's 8 KB under
    with torch._inductor.config.patch(fx_graph_cache=False):  # (the bound is no part of its key)
        _, _, report = _compile(_Step().to(bf16).eval(), torch.randn(1, 64, dtype=bf16))
    assert _ones(report) == ["biased"]


@pytest.mark.parametrize("shape", [(0, 64), (1, 0), (0, 0)], ids=["no-rows", "no-features", "neither"])
def test_linear_one_on_empty_operands(shape):
    """No rows (an empty output) or no features (the bias alone): rewritten, as eager."""
    model = _Step(K=shape[-1]).to(torch.bfloat16).eval()
    got, want, report = _compile(model, torch.randn(*shape, dtype=torch.bfloat16))
    assert _ones(report) == ["biased", "one"]
    torch.testing.assert_close(got, want)


def test_linear_one_sizes_follow_the_measurements():
    assert ls.takes_one(1, 32 << 20) and not ls.takes_one(1, (32 << 20) + 1)
    assert not ls.takes_one(2, 1 << 20) and not ls.takes_one(0, 1 << 20)


@interpreted
def test_linear_one_through_the_kernel_matches_eager():
    """The compiled step with the op's CUDA body (the interpreted kernel, one weight a launch)."""
    torch.manual_seed(3)
    model = _Step(K=40, vocab=33).to(torch.bfloat16).eval()
    x = torch.randn(1, 1, 40, dtype=torch.bfloat16)
    torch._dynamo.reset()
    fusepass.reset_reports()
    with differential.triton_on_cpu(["linear_siblings"]), torch.no_grad():
        got = torch.compile(model, backend="fusepass")(x)
    assert _ones(fusepass.last_report()) == ["biased", "one"]
    with torch.no_grad():
        want = copy.deepcopy(model).float()(x.float())
    assert_close(got, want.bfloat16(), "linear_one (Triton)", dtype=torch.bfloat16)


# -- a quantized MLP's gate, up and activation: fusepass::dequant_matmul_gated -----------------

class _MLP(torch.nn.Module):
    """down(act(gate(x)) * up(x)); ``also`` returns gate's output too; ``order`` "up"
    writes the product up * act(gate)."""

    def __init__(self, act="silu", H=64, I=96, bias=False, also=False, order="gate"):
        super().__init__()
        self.gate = torch.nn.Linear(H, I, bias=bias)
        self.up = torch.nn.Linear(H, I, bias=bias)
        self.down = torch.nn.Linear(I, H, bias=False)
        self.act, self.also, self.order = act, also, order

    def forward(self, x):
        g = self.gate(x)
        a = torch.nn.functional.silu(g) if self.act == "silu" else torch.nn.functional.gelu(g, approximate=self.act)
        h = a * self.up(x) if self.order == "gate" else self.up(x) * a
        return (self.down(h), g) if self.also else self.down(h)


def _quantized_mlp(fmt, act="silu", dtype=torch.bfloat16, seed=0, **kw):
    torch.manual_seed(seed)
    model = _MLP(act, **kw).to(dtype).eval()
    fusepass.quantize(model, fmt, group_size=32)
    return model


_ACT_FORM = {"silu": "silu", "none": "gelu", "tanh": "gelu_tanh"}


@pytest.mark.parametrize("fmt,act", [("int4", "silu"), ("int8", "none"), ("fp8", "tanh"), ("int4", "tanh")])
def test_gated_rule_takes_a_quantized_mlp_at_one_token(fmt, act):
    """gate and up quantized by fusepass.quantize, one token: one gated call in
    place of the siblings and the activation (either product order, with
    biases); the CPU body and the Triton kernel (interpreted) match eager."""
    model = _quantized_mlp(fmt, act, bias=fmt == "int8", order="up" if fmt == "fp8" else "gate")
    _rewritten_both_ways(model, torch.randn(1, 1, 64, dtype=torch.bfloat16), "dequant_matmul_gated",
                         f"{fmt}_{_ACT_FORM[act]}")


def test_gated_rule_leaves_a_gate_read_elsewhere_and_prefill_rows():
    model = _quantized_mlp("int4", also=True)
    got, want, report = _compile(model, torch.randn(1, 1, 64, dtype=torch.bfloat16))
    assert not [h for h in report.hits if h.rule == "dequant_matmul_gated"]
    assert any("also read outside the activation" in r for r in report.reasons())
    for g, w in zip(got, want):
        assert_close(g, w, "gate read elsewhere", dtype=torch.bfloat16)
    _, _, report = _compile(_quantized_mlp("int4"), torch.randn(1, 12, 64, dtype=torch.bfloat16))
    assert not [h for h in report.hits if h.rule in ("dequant_matmul_gated", "linear_siblings")]


@interpreted
@pytest.mark.parametrize("fmt", ["int4", "int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
def test_gated_kernel_is_the_siblings_then_the_activation(fmt, dtype, monkeypatch):
    """The one launch against its two-launch form (the siblings kernel, then the
    gated_act kernel) on the same inputs: equal to the bit in fp16 and fp32
    (each output column's sums are the siblings loop's); in bf16, where the
    interpreter's conversion truncates the siblings' stores and the gated
    kernel rounds, within the tolerance of eager's own result.  N odd and not
    a whole tile, one to three rows, biases, every output element written."""
    from fusepass.kernels.dequant_matmul import gated as gm
    from fusepass.kernels.dequant_matmul.launch import gated_launch
    from fusepass.quantize import quantize_rows

    fusepass.kernels._common.clear_kernel_fallbacks()
    launched = []
    monkeypatch.setattr(gm, "gated_launch", lambda *a, **k: launched.append(1) or gated_launch(*a, **k))
    torch.manual_seed(7)
    K, N = 256, 37
    ops = ["dequant_matmul_gated", "dequant_matmul_siblings", "swiglu", "geglu"]
    for M, act, bias in ((1, "silu", True), (3, "gelu", False), (2, "gelu_tanh", True)):
        q = [quantize_rows(torch.randn(N, K) * 0.1, fmt, 32) for _ in range(2)]
        ws = [t[0] for t in q]
        ss = [t[1].to(dtype) if fmt == "int4" else t[1] for t in q]
        zs = [t[2].to(dtype) if t[2] is not None else None for t in q]
        bs = [torch.randn(N, dtype=dtype) if bias else None for _ in range(2)]
        x = torch.randn(M, K, dtype=dtype)
        before = len(launched)
        with differential.triton_on_cpu(ops):
            got = torch.ops.fusepass.dequant_matmul_gated(x, ws, ss, zs, bs, fmt, 32, act, [])
            g, u = torch.ops.fusepass.dequant_matmul_siblings(x, ws, ss, zs, bs, fmt, 32, [])
            two = torch.ops.fusepass.swiglu(g, u) if act == "silu" else \
                torch.ops.fusepass.geglu(g, u, gm.ACTIVATIONS[act])
        assert len(launched) == before + 1 and got.shape == (M, N) and torch.isfinite(got).all()
        if dtype == torch.bfloat16:
            assert_close(got, gm._reference(x, ws, ss, zs, bs, fmt, 32, act), f"{fmt} gated", dtype=dtype)
        else:
            assert torch.equal(got, two), (fmt, dtype, M, act)
    assert not fusepass.kernels._common.kernel_fallbacks()
