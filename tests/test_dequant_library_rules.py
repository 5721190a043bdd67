"""The quantization libraries' own graph forms: bitsandbytes 4-bit, HQQ's
plain-PyTorch backend, GPTQ's torch dequantization, per-channel checkpoint
scales.  Each through the library itself where it installs on CPU
(bitsandbytes, hqq), compiled with fusepass: one fused call per quantized
linear, eager's result within the dtype table.  The rules' forms and
near-misses also run in tests/test_rules.py (check_rule).
"""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.nn.functional as F

from fusepass.testing import assert_close, compile_and_run

LIB_RULES = ["dequant_matmul", "dequant_matmul_bnb", "dequant_matmul_gptq", "dequant_matmul_hqq"]


def _no_cpu_repack(model):
    """bitsandbytes repacks 4-bit weights for AVX512-BF16 at the first CPU forward
    (then gemv_4bit, a CPU-only layout); off, the graph holds gemm_4bit as on a GPU."""
    for m in model.modules():
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False


@pytest.fixture(scope="module")
def bnb_llama():
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("bitsandbytes")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=96, max_position_embeddings=64)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
        q = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                            bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16)
        model = transformers.LlamaForCausalLM.from_pretrained(folder, quantization_config=q, device_map="cpu",
                                                              dtype=torch.bfloat16).eval()
    _no_cpu_repack(model)
    return model


def test_bnb_nf4_llama_one_fused_call_per_linear(bnb_llama):
    ids = torch.randint(0, 96, (1, 7))
    with torch.no_grad():
        expected = bnb_llama(ids).logits
        out, report = compile_and_run(lambda i: bnb_llama(i).logits, [ids], rules=LIB_RULES)
    assert report.count("dequant_matmul_bnb") == 14 and len(report.hits) == 14, str(report)
    assert {h.form for h in report.hits} == {"nf4_nested"}
    assert_close(out, expected, "bitsandbytes NF4 (double quant) Llama")


def test_bnb_cpu_layout_is_refused_with_its_reason():
    bnb = pytest.importorskip("bitsandbytes")
    if not bnb.functional.has_avx512bf16():
        pytest.skip("this CPU has no AVX512-BF16: bitsandbytes keeps its gemm_4bit layout")
    lin = bnb.nn.Linear4bit(64, 32, compute_dtype=torch.bfloat16, quant_type="nf4")
    lin.weight = bnb.nn.Params4bit(torch.randn(32, 64), requires_grad=False, quant_type="nf4")._quantize("cpu")
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = lin.eval()(x)
        out, report = compile_and_run(lin, [x], rules=LIB_RULES)
    assert not report.hits
    assert any("gemv_4bit" in r.reason and "AVX512" in r.reason for r in report.refusals), str(report)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_hqq_linear_from_the_library(dtype):
    hqq = pytest.importorskip("hqq.core.quantize")
    hqq.HQQLinear.set_backend(hqq.HQQBackend.PYTORCH)
    torch.manual_seed(0)
    layers = []
    for k, n, group in ((128, 96, 64), (96, 40, 32)):
        lin = torch.nn.Linear(k, n, bias=n == 40)
        cfg = hqq.BaseQuantizeConfig(nbits=4, group_size=group, axis=1)
        layers.append(hqq.HQQLinear(lin, quant_config=cfg, compute_dtype=dtype, device="cpu"))
    model = torch.nn.Sequential(layers[0], torch.nn.ReLU(), layers[1])
    x = torch.randn(2, 3, 128, dtype=dtype)
    with torch.no_grad():
        expected = model(x)
        out, report = compile_and_run(model, [x], rules=LIB_RULES)
    assert report.count("dequant_matmul_hqq") == 2 and len(report.hits) == 2, str(report)
    assert_close(out, expected, "HQQLinear x2")


class GptqTorchLinear(torch.nn.Module):
    """GPTQ's 4-bit layer as its plain-torch kernel computes it (published layout:
    qweight int32 [K / 8, N] along K, qzeros [groups, N / 8] along N, g_idx)."""

    def __init__(self, qweight, qzeros, scales, g_idx, bias=None, v1=False):
        super().__init__()
        for name, t in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales), ("g_idx", g_idx)):
            self.register_buffer(name, t)
        self.register_buffer("wf", torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device).unsqueeze(0))
        self.bias, self.v1 = bias, v1

    def forward(self, x):
        z = torch.bitwise_right_shift(self.qzeros.unsqueeze(2).expand(-1, -1, 8), self.wf.unsqueeze(0))
        z = torch.bitwise_and(z.to(torch.int8), 15).reshape(self.qzeros.shape[0], -1)
        if self.v1:
            z = z + 1
        q = torch.bitwise_right_shift(self.qweight.unsqueeze(1).expand(-1, 8, -1), self.wf.unsqueeze(-1))
        q = torch.bitwise_and(q.to(torch.int8), 15).reshape(-1, self.qweight.shape[1])
        g = self.g_idx.long()
        out = torch.matmul(x, self.scales[g] * (q - z[g]))
        return out + self.bias if self.bias is not None else out


@pytest.mark.parametrize("v1,act_order", [(False, True), (True, False)], ids=["v2-act-order", "v1"])
def test_gptq_torch_form(v1, act_order):
    from fusepass.patterns.dequant_matmul_gptq import gptq_weights

    gen = torch.Generator().manual_seed(1)
    tensors = gptq_weights(40, 256, 64, torch.float16, act_order=act_order, gen=gen)[:4]
    model = GptqTorchLinear(*tensors, bias=torch.randn(40, dtype=torch.float16), v1=v1)
    x = torch.randn(2, 5, 256, dtype=torch.float16)
    with torch.no_grad():
        expected = model(x)
        out, report = compile_and_run(model, [x], rules=LIB_RULES)
    assert report.count("dequant_matmul_gptq") == 1 and len(report.hits) == 1, str(report)
    assert report.hits[0].form == ("v1" if v1 else "gptq")
    assert_close(out, expected, "GPTQ torch form")


def test_library_layouts_on_cuda(monkeypatch):
    """On CUDA the library layouts go to fusepass only at the row counts their own loops were
    measured faster at (HQQ and GPTQ to 8 rows against Inductor; NF4 / FP4 to 64 against
    bitsandbytes' kernel; HQQ at even N), refused elsewhere with the reason.  The CPU path always
    fuses."""
    import types

    from fusepass.patterns import dequant_matmul as dm
    from fusepass.patterns.dequant_matmul_gptq import gptq_weights

    def cuda(*shape):
        return types.SimpleNamespace(device=torch.device("cuda"), shape=shape)

    for fmt, most in (("hqq4", 8), ("gptq4", 8), ("nf4", 64), ("fp4", 64)):
        assert dm.check_library_device(cuda(most // 2, 2, 64), fmt, 24) is None, fmt
        reason = dm.check_library_device(cuda(most + 1, 64), fmt, 24)
        assert f"{most + 1} rows" in reason, fmt
        assert ("bitsandbytes' kernel" if fmt in ("nf4", "fp4") else "Inductor's path") in reason, fmt
        assert "dynamic" in dm.check_library_device(cuda(_Sym(), 64), fmt, 24)
    assert "odd" in dm.check_library_device(cuda(1, 64), "hqq4", 25)
    assert "load_quantized" in dm.check_library_device(cuda(16, 64), "hqq4", 24)  # the way to the int4 kernel
    # fp32 activations keep the code books' GEMV range (the tensor-core kernel takes 16-bit x)
    fp32 = types.SimpleNamespace(device=torch.device("cuda"), shape=(16, 64), dtype=torch.float32)
    assert "fp32" in dm.check_library_device(fp32, "nf4", 24)
    assert dm.check_library_device(types.SimpleNamespace(device=torch.device("cuda"), shape=(4, 64),
                                                         dtype=torch.float32), "nf4", 24) is None
    assert dm.check_library_device(cuda(1, 64), "gptq4", 25) is None
    for fmt in ("nf4", "fp4", "hqq4", "gptq4"):
        assert dm.check_library_device(torch.empty(16, 1), fmt, 25) is None
    # the rule asks for every matched linear: a CUDA activation of 16 rows is refused with that reason
    real = dm.check_library_device
    monkeypatch.setattr(dm, "check_library_device", lambda x, fmt, n=None: real(cuda(*x.shape), fmt, n))
    gen = torch.Generator().manual_seed(3)
    model = GptqTorchLinear(*gptq_weights(40, 256, 64, torch.float16, act_order=False, gen=gen)[:4])
    for rows, fused in ((16, False), (1, True)):
        x = torch.randn(rows, 256, dtype=torch.float16)
        with torch.no_grad():
            expected = model(x)
            out, report = compile_and_run(model, [x], rules=LIB_RULES)
        assert report.count("dequant_matmul_gptq") == int(fused), str(report)
        assert fused or any("16 rows" in r.reason for r in report.refusals), str(report)
        assert_close(out, expected, f"GPTQ torch form, {rows} rows")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_hqq_and_gptq_fuse_at_decode_sizes():
    """On the GPU, HQQ's library layer and GPTQ's torch form are fused at one token (their GEMV
    loops) and left to Inductor at sixteen, with the reason; both within the table of eager."""
    hqq = pytest.importorskip("hqq.core.quantize")
    from fusepass.patterns.dequant_matmul_gptq import gptq_weights

    hqq.HQQLinear.set_backend(hqq.HQQBackend.PYTORCH)
    torch.manual_seed(0)
    cfg = hqq.BaseQuantizeConfig(nbits=4, group_size=64, axis=1)
    lin = hqq.HQQLinear(torch.nn.Linear(1024, 768), quant_config=cfg, compute_dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator().manual_seed(1)
    gptq = GptqTorchLinear(*[t.cuda() for t in gptq_weights(768, 1024, 128, torch.bfloat16, act_order=True,
                                                             gen=gen)[:4]])
    for model, rule in ((lin, "dequant_matmul_hqq"), (gptq, "dequant_matmul_gptq")):
        for rows, fused in ((1, True), (16, False)):
            x = torch.randn(rows, 1024, dtype=torch.bfloat16, device="cuda")
            torch._dynamo.reset()
            with torch.no_grad():
                expected = model(x)
                out, report = compile_and_run(model, [x], rules=LIB_RULES)
            assert report.count(rule) == int(fused), str(report)
            if not fused:
                assert any("16 rows" in r.reason for r in report.refusals), str(report)
            assert_close(out, expected, f"{rule} on CUDA, {rows} rows")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bnb_4bit_fuses_at_decode_sizes():
    """On the GPU bitsandbytes' Linear4bit (NF4, FP4, NF4 with double quantization; with a bias) is
    fused at one and four tokens (the code books' GEMV loop) and sixteen (the transposed kernel) and
    left to bitsandbytes' kernel at 128, with the reason; all within the table of eager."""
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    for quant, nested in (("nf4", False), ("fp4", False), ("nf4", True)):
        lin = bnb.nn.Linear4bit(1024, 768, bias=True, compute_dtype=torch.bfloat16, quant_type=quant,
                                compress_statistics=nested)
        lin.weight = bnb.nn.Params4bit(torch.randn(768, 1024) / 32, requires_grad=False, quant_type=quant,
                                       compress_statistics=nested)
        lin = lin.cuda().eval()
        for rows, fused in ((1, True), (4, True), (16, True), (128, False)):
            x = torch.randn(rows, 1024, dtype=torch.bfloat16, device="cuda")
            torch._dynamo.reset()
            with torch.no_grad():
                expected = lin(x)
                out, report = compile_and_run(lin, [x], rules=LIB_RULES)
            assert report.count("dequant_matmul_bnb") == int(fused), (quant, nested, rows, str(report))
            if not fused:
                assert any("bitsandbytes' kernel" in r.reason for r in report.refusals), str(report)
            assert_close(out, expected, f"bitsandbytes {quant}{' nested' if nested else ''} on CUDA, {rows} rows")


class _Sym:
    """A row count that is not a number (what a dynamic shape gives)."""

    def __mul__(self, other):
        return self

    __rmul__ = __mul__


def test_gptq_under_verify_mode():
    """Verify mode runs the pattern on random inputs: GPTQ's g_idx picks a group's scale, so random
    integers index out of range; the check draws index-safe ones instead of refusing with a crash."""
    from fusepass.patterns.dequant_matmul_gptq import gptq_weights

    gen = torch.Generator().manual_seed(2)
    model = GptqTorchLinear(*gptq_weights(40, 256, 64, torch.float16, act_order=True, gen=gen)[:4], v1=False)
    x = torch.randn(3, 256, dtype=torch.float16)
    with torch.no_grad():
        expected = model(x)
        out, report = compile_and_run(model, [x], rules=LIB_RULES, verify=True)
    assert report.count("dequant_matmul_gptq") == 1 and not report.refusals, str(report)
    assert_close(out, expected, "GPTQ torch form, verified")


def test_bnb_strided_absmax_is_left_to_bitsandbytes():
    """bitsandbytes' kernel reads absmax as packed values whatever its strides (every other value of a
    wider one: it reads the first N * K / 64 instead, a result 0.5 off the dequantized weight's
    product); fusepass refuses such a call with the reason and leaves it to the library."""
    pytest.importorskip("bitsandbytes")  # registers torch.ops.bitsandbytes
    from fusepass.patterns import dequant_matmul_bnb as m

    packed, (absmax,) = m._quantized(torch.float32, "fp4")
    x, bias = torch.randn(4, m.K_EX), torch.randn(m.N_EX)
    wide = torch.stack([absmax, absmax.flip(0)], dim=1).reshape(-1)

    def fn(x, packed, wide, bias):
        return torch.ops.bitsandbytes.gemm_4bit.default(x, packed, [m.N_EX, m.K_EX], wide[::2], 64, "fp4", bias)

    with torch.no_grad():
        out, report = compile_and_run(fn, [x, packed, wide, bias], rules=LIB_RULES)
    assert not report.hits and any("absmax" in r.reason and "not contiguous" in r.reason
                                   for r in report.refusals), str(report)
    assert out.shape == (4, m.N_EX)


class ChannelInt8(torch.nn.Module):
    """int8 per channel as compressed-tensors' int8 checkpoints dequantize it: an
    [N, 1] fp32 scale, the weight dequantized in fp32, then converted."""

    def __init__(self, n, k, fp8_per_tensor=False):
        super().__init__()
        if fp8_per_tensor:
            self.register_buffer("weight", (torch.randn(n, k) * 100).to(torch.float8_e4m3fn))
            self.register_buffer("weight_scale", torch.tensor(0.5 / (100 * k ** 0.5)))
        else:
            self.register_buffer("weight", torch.randint(-127, 128, (n, k), dtype=torch.int8))
            self.register_buffer("weight_scale", (0.5 + torch.rand(n, 1)) / (73 * k ** 0.5))

    def forward(self, x):
        w = (self.weight.to(self.weight_scale.dtype) * self.weight_scale).to(x.dtype)
        return F.linear(x, w)


@pytest.mark.parametrize("fp8", [False, True], ids=["int8-col-fp32", "fp8-per-tensor"])
def test_checkpoint_channel_scales(fp8):
    model = ChannelInt8(40, 96, fp8)
    x = torch.randn(3, 96, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = model(x)
        out, report = compile_and_run(model, [x], rules=LIB_RULES)
    assert report.count("dequant_matmul") == 1 and report.hits[0].form == "dequant_fp32", str(report)
    assert_close(out, expected, "per-channel checkpoint form")


def test_other_libraries_ops_get_a_report_line():
    """An opaque kernel of a library fusepass does not read (here one registered
    under gptqmodel's namespace) stays, with a line in the report saying so."""
    @torch.library.custom_op("gptqmodel::fusepass_test_gemm", mutates_args=())
    def gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x @ w.t()

    @gemm.register_fake
    def _(x, w):
        return x.new_empty((*x.shape[:-1], w.shape[0]))

    x, w = torch.randn(3, 16), torch.randn(8, 16)
    out, report = compile_and_run(lambda a, b: gemm(a, b) + 1, [x, w])
    assert not report.hits
    reasons = report.reasons("library_ops")
    assert any("gptqmodel::fusepass_test_gemm" in r and "load_quantized" in r for r in reasons), str(report)
    assert torch.equal(out, x @ w.t() + 1)
