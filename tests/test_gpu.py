"""On a GPU: real model code in bf16 through the Triton kernels, with and
without CUDA graphs.  Skipped where there is no CUDA device."""

import pytest
import torch

import fusepass
from fusepass import models
from fusepass.testing import assert_close

pytestmark = pytest.mark.gpu


def _run(name, mode=None, calls=1):
    model = models.build(name, dtype=torch.bfloat16, device="cuda", size="small")
    ids = models.input_ids(model, batch=4, seq=64)
    torch._dynamo.reset()
    fusepass.reset_reports()
    compiled = torch.compile(model, backend="fusepass", mode=mode)
    with torch.no_grad():
        expected = model(ids).logits
        outs = [compiled(ids).logits.clone() for _ in range(calls)]
    return model, expected, outs, fusepass.last_report()


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma"])
def test_bf16_models_on_gpu(name):
    model, expected, (actual,), report = _run(name)
    # Qwen3's q / k norms (attention heads) are left to Inductor, with the reason.
    from fusepass.patterns.rms_norm import HEAD_NORM

    heads = [r for r in report.reasons("rms_norm") if r.startswith(HEAD_NORM)]
    assert len(heads) == (2 * model.config.num_hidden_layers if name == "qwen3" else 0), report.reasons()
    assert report.count("rms_norm") + report.count("add_rms_norm") + len(heads) == models.count_norms(model)
    # bf16 logits after 4 layers: Inductor's own result differs from eager by
    # about as much; compare both against eager.
    inductor = torch.compile(model)
    with torch.no_grad():
        ids = models.input_ids(model, batch=4, seq=64)
        ref_err = (inductor(ids).logits.float() - expected.float()).abs().max().item()
    err = (actual.float() - expected.float()).abs().max().item()
    assert err <= max(2 * ref_err, 0.05), (err, ref_err)


def test_reduce_overhead_captures_cuda_graphs():
    from torch._dynamo.utils import counters

    counters.clear()
    model, expected, outs, report = _run("llama", mode="reduce-overhead", calls=3)
    assert report.count("add_rms_norm") == 2 * model.config.num_hidden_layers
    assert not counters["inductor"].get("cudagraph_skips"), dict(counters["inductor"])
    # under CUDA graphs the ops are called (their launches' PDL, counters zeroed once), and the report says so
    assert any("not inlined" in n for g in report.graphs for n in g.notes), str(report)
    for out in outs:
        assert_close(out.float(), outs[0].float())
    err = (outs[-1].float() - expected.float()).abs().max().item()
    assert err < 0.1, err


def _hf_norm(x, w):
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return w * h.to(x.dtype)


def _res_norm_mlp(x, r, w, g, u):
    h = x + r
    return _hf_norm(h, w), h, torch.nn.functional.silu(g) * u


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "dispatcher"])
@pytest.mark.parametrize("rows", [1, 4096])
def test_inline_kernels_launch_from_inductor_code(inline, rows):
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    fusepass.reset_reports()
    x, r = (torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    gu = torch.randn(rows, 2 * 2816, device="cuda", dtype=torch.bfloat16)
    g, u = gu.chunk(2, dim=-1)  # the halves of one projection: strided views
    f = torch.compile(_res_norm_mlp, backend="fusepass", options={"inline_kernels": inline})
    out, codes = run_and_get_code(f, x, r, w, g, u)
    code = "\n".join(codes)
    report = fusepass.last_report()
    assert report.count("add_rms_norm") == 1 and report.count("swiglu") == 1, str(report)
    assert ("torch.ops.fusepass" in code) != inline, code[-3000:]
    assert not report.graphs[0].notes, report.graphs[0].notes
    expected = _res_norm_mlp(x, r, w, g, u)
    for a, e in zip(out, expected):
        assert_close(a, e)


@pytest.mark.parametrize("N", [16384, 32768], ids=lambda n: f"N{n}")
def test_long_rows_go_through_the_op(N):
    """Rows the one-pass kernel holds are inlined; longer rows (the persistent
    looped kernel) call the fusepass:: op from the compiled graph."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    fusepass.reset_reports()
    x, r = (torch.randn(8, N, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w = torch.randn(N, device="cuda", dtype=torch.bfloat16)

    def f(x, r, w):
        h = x + r
        return _hf_norm(h, w), h

    out, codes = run_and_get_code(torch.compile(f, backend="fusepass"), x, r, w)
    code = "\n".join(codes)
    assert fusepass.last_report().count("add_rms_norm") == 1
    assert ("torch.ops.fusepass.add_rms_norm" in code) == (N > 16384), code[-3000:]
    for a, e in zip(out, f(x, r, w)):
        assert_close(a, e)


def test_inline_compile_failure_recompiles_with_ops(monkeypatch):
    import fusepass.backend as backend

    real = backend._compile

    def failing(gm, example_inputs, opts, *args, **kwargs):
        if opts.inline_kernels:
            raise RuntimeError("injected: inlined kernel failed to compile")
        return real(gm, example_inputs, opts, *args, **kwargs)

    monkeypatch.setattr(backend, "_compile", failing)
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    fusepass.reset_reports()
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    out, codes = run_and_get_code(torch.compile(_hf_norm, backend="fusepass"), x, w)
    report = fusepass.last_report()
    assert report.count("rms_norm") == 1
    assert any("inline_kernels=False" in n for n in report.graphs[0].notes), report.graphs[0].notes
    assert "torch.ops.fusepass.rms_norm" in "\n".join(codes)
    assert_close(out, _hf_norm(x, w))


def test_training_on_gpu_matches_inductor_gradients():
    torch.manual_seed(0)
    model = models.build("llama", dtype=torch.float32, device="cuda", size="small").train()
    ids = models.input_ids(model, batch=4, seq=64)

    def grads(backend):
        model.zero_grad(set_to_none=True)
        torch._dynamo.reset()
        loss = torch.compile(model, backend=backend)(ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    fusepass.reset_reports()
    loss_f, g_f = grads("fusepass")
    report = fusepass.last_report()
    loss_i, g_i = grads("inductor")
    assert_close(loss_f, loss_i)
    for name in g_i:
        torch.testing.assert_close(g_f[name], g_i[name], atol=1e-4, rtol=1e-3, msg=name)
    # Training graphs keep their intermediates for backward: refused, with the reason.
    assert report.count("rms_norm") + report.count("add_rms_norm") == 0
    assert any("saved for backward" in r for r in report.reasons())


@pytest.mark.parametrize("form", ["torchao-aqt", "gpt-fast", "refused"])
def test_decode_dequant_matmul_under_coordinate_descent_tuning(form):
    """torchao's quantize_ (and gpt-fast) turn coordinate-descent tuning on, under which Inductor
    decomposes an M = 1 mm before the post-grad passes: the rule must still see the decode matmul."""
    q = torch.randint(-127, 128, (1024, 4096), dtype=torch.int8, device="cuda")
    s = (torch.rand(1024, device="cuda") / 400 + 1e-3).to(torch.bfloat16)

    def fn(x):
        if form == "torchao-aqt":  # AffineQuantizedTensor's int8 weight-only linear (torchao <= 0.17)
            return (torch.mm(x.reshape(-1, 4096), q.t().to(x.dtype)) * s).reshape(1, 1, -1)
        if form == "refused":  # an fp32 scale promotes the bf16 result: no rule takes it
            return torch.nn.functional.linear(x, q.to(x.dtype)) * s.float()
        return torch.nn.functional.linear(x, q.to(x.dtype)) * s  # gpt-fast

    x = torch.randn(1, 1, 4096, dtype=torch.bfloat16, device="cuda")
    torch._dynamo.reset()
    fusepass.reset_reports()
    with torch.no_grad(), torch._inductor.config.patch(coordinate_descent_tuning=True):
        out = torch.compile(fn, backend="fusepass")(x)
    report = fusepass.last_report()
    if form == "refused":  # Inductor's own multiply-and-sum, as without fusepass (linear_one too leaves it)
        assert not report.hits and any("decomposed" in n for g in report.graphs for n in g.notes), str(report)
    else:
        assert len(report.hits) == 1, str(report)
    # "refused" returns fp32 from a bf16 matmul: eager rounds the mm to bf16
    # before the fp32 scale, Inductor's multiply-and-sum does not (0.4% apart
    # on an H100): the bf16 tolerance.
    assert_close(out, fn(x), form, dtype=torch.bfloat16)


@pytest.mark.parametrize("M", [1, 3, 4])
def test_linear_siblings_at_real_sizes(M):
    """Qwen3-30B-A3B's q / k / v (one launch), Llama-3-8B's gate / up (past the
    measured limit: cuBLAS per weight), and alone (``linear_one``) Llama-3-8B's
    o_proj and gpt-oss-20b's (K 4096, N 2880: not a whole row tile) against the
    fp64 product, bf16."""
    from fusepass.testing import assert_close

    torch.manual_seed(M)
    for K, Ns in [(2048, [4096, 512, 512]), (4096, [14336, 14336]), (4096, [4096]), (4096, [2880])]:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        ws = [torch.randn(n, K, device="cuda", dtype=torch.bfloat16) * 0.02 for n in Ns]
        bs = [torch.randn(Ns[0], device="cuda", dtype=torch.bfloat16)] + [None] * (len(Ns) - 1)
        got = torch.ops.fusepass.linear_siblings(x, ws, bs)
        for i, (g, w) in enumerate(zip(got, ws)):
            want = x.double() @ w.double().t() + (bs[i].double() if bs[i] is not None else 0)
            assert_close(g, want.to(torch.bfloat16), f"linear_siblings K{K} N{Ns[i]} M{M}", dtype=torch.bfloat16)
