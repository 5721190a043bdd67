"""fusepass.load_quantized: int4 checkpoints of GPTQ, AWQ, compressed-tensors and
HQQ loaded into fusepass's int4 layers without their libraries.

The GPTQ, AWQ and HQQ tensors are written here from the formats' published
descriptions (int32 words of eight codes, GPTQ's zero points stored minus
one, AWQ's 0 2 4 6 1 3 5 7 word order, g_idx; HQQ's rows of a group with
their halves in one byte's two nibbles); compressed-tensors' by its own
compressor, whose decompression is the reference, and HQQ's also by the
library's own quantizer where it is installed.  Each loaded layer must
compute the checkpoint's weight, dequantized in fp32 from the stored tensors.
"""

from __future__ import annotations

import pytest
import torch

import fusepass
from fusepass.checkpoints import AWQ_ORDER, PackedInt4Linear
from fusepass.testing import assert_close, compile_and_run
from fusepass.testing.library_layouts import gptq_tensors, grouped_int4, hqq_tensors, int32_words

N, K = 40, 256


def _awq_words(codes):
    """codes [R, 8 * C] -> int32 [R, C] in AWQ's order: nibble i holds column 8c + ORDER[i]."""
    r, c = codes.shape
    reordered = codes.reshape(r, c // 8, 8)[:, :, list(AWQ_ORDER)].reshape(r, c)
    return int32_words(reordered)


def awq_tensors(w, group):
    n, k = w.shape
    g_idx = torch.arange(k) // group
    scale, zero, q = grouped_int4(w, g_idx, k // group, sym=False)
    ref = (q - zero[g_idx]).float() * scale.float()[g_idx]
    return {"qweight": _awq_words(q), "qzeros": _awq_words(zero), "scales": scale}, ref.t()


def _load_one(tensors, fmt, bias=True, dtype=torch.float32, n=N, k=K):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(k, n, bias=bias)).to(dtype)
    sd = {f"0.{key}": value for key, value in tensors.items()}
    b = torch.randn(n).to(dtype) if bias else None
    if bias:
        sd["0.bias"] = b
    summary = fusepass.load_quantized(model, sd, fmt)
    return model, summary, b


def _check(model, ref_w, bias, dtype=torch.float32):
    x = torch.randn(3, 5, ref_w.shape[1]).to(dtype)
    expected = x.double() @ ref_w.double().t() + (bias.double() if bias is not None else 0)
    assert_close(model(x), expected.to(dtype), "loaded layer vs the checkpoint's weight")


@pytest.mark.parametrize("act_order,sym,v1,group", [
    (False, False, True, 64), (True, False, True, 64), (False, True, True, 128), (True, False, False, 32),
    (False, False, True, 256)], ids=["asym-g64", "act-order-g64", "sym-g128", "act-order-v2-g32", "g256"])
def test_gptq(act_order, sym, v1, group):
    w = torch.randn(N, K)
    tensors, ref = gptq_tensors(w, group, act_order, sym, v1, wrap=True)
    model, summary, bias = _load_one(tensors, "gptq" if v1 else "gptq_v2")
    layer = model[0]
    assert summary.converted == ["0"] and not summary.unused and not summary.missing, str(summary)
    assert isinstance(layer, PackedInt4Linear) and layer.group_size == group
    assert (layer.perm is not None) == act_order and (summary.act_order == ["0"]) == act_order
    assert (layer.zero is None) == sym  # all zero points 8: the symmetric form
    _check(model, ref, bias)


def test_gptq_per_channel_is_regrouped_and_fp16():
    k = 384  # group -1 (per channel): one scale per row over K = 384 = 3 kernel groups of 128
    w = torch.randn(N, k) / k ** 0.5  # outputs O(1): fp16's own rounding of them stays in the table
    tensors, ref = gptq_tensors(w, k, wrap=True)
    model, summary, bias = _load_one(tensors, "gptq", dtype=torch.float16, k=k)
    assert summary.regrouped == [("0", 384, 128)] and model[0].scale.shape == (N, 3)
    assert model[0].scale.dtype == torch.float16
    _check(model, ref, bias, torch.float16)


def test_awq():
    w = torch.randn(N, K)
    tensors, ref = awq_tensors(w, 64)
    model, summary, bias = _load_one(tensors, "awq", bias=False)
    assert summary.converted == ["0"] and model[0].bias is None
    _check(model, ref, None)


def _ct_tensors(w, strategy, symmetric, group=None):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy=strategy, group_size=group)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    n, k = w.shape
    g = w.reshape(n, k // group, group) if strategy == "group" else w.reshape(n, 1, k)
    scale, zp = calculate_qparams(g.amin(-1), g.amax(-1), args)
    sd = {"weight": w, "weight_scale": scale}
    if not symmetric:
        sd["weight_zero_point"] = zp
    packed = PackedQuantizationCompressor.compress(sd, scheme)
    ref = PackedQuantizationCompressor.decompress(packed, scheme)["weight"]
    return packed, ref.float()


@pytest.mark.parametrize("strategy,symmetric,group", [("group", False, 32), ("group", True, 128),
                                                      ("channel", True, None), ("channel", False, None)])
def test_compressed_tensors(strategy, symmetric, group):
    pytest.importorskip("compressed_tensors")
    w = torch.randn(N, K)
    tensors, ref = _ct_tensors(w, strategy, symmetric, group)
    model, summary, bias = _load_one(tensors, "compressed-tensors")
    assert summary.converted == ["0"], str(summary)
    assert (model[0].zero is None) == symmetric
    _check(model, ref, bias)


def test_refusals_leave_the_layer():
    w = torch.randn(N, 64)
    tensors, _ = gptq_tensors(w, 16, wrap=True)
    model, summary, _ = _load_one(tensors, "gptq", k=64)
    assert isinstance(model[0], torch.nn.Linear) and not isinstance(model[0], PackedInt4Linear)
    assert "group size 16" in dict(summary.skipped)["0"]
    assert "0.qweight" in summary.unused
    tensors, _ = gptq_tensors(torch.randn(N, K), 64, wrap=True)
    tensors["g_idx"] = torch.cat([torch.zeros(70), torch.ones(K - 70)]).to(torch.int32)  # groups of 70 and 186
    model, summary, _ = _load_one(tensors, "gptq")
    assert "no sorting of K makes whole groups" in dict(summary.skipped)["0"]
    tensors, _ = gptq_tensors(torch.randn(N, K), 64, wrap=True)
    model, summary, _ = _load_one(tensors, "gptq", n=48)
    assert "the model's linear [48, 256]" in dict(summary.skipped)["0"]
    with pytest.raises(ValueError, match="4-bit"):
        fusepass.load_quantized(model, {}, "gptq", bits=8)


# -- a transformers Llama loaded from GPTQ act-order tensors, compiled ---------------------

def test_llama_from_gptq_checkpoint_runs_fused():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=96, max_position_embeddings=64)
    torch.manual_seed(0)
    source = transformers.LlamaForCausalLM(cfg).eval()
    sd = {}
    for name, tensor in source.state_dict().items():
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and "proj" in module:
            tensors, _ = gptq_tensors(tensor.float(), 32, act_order=True, wrap=True)
            sd.update({f"{module}.{key}": value for key, value in tensors.items()})
        else:
            sd[name] = tensor
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    summary = fusepass.load_quantized(model, sd, "gptq", dtype=torch.float32)
    model.eval()
    assert len(summary.converted) == 14 and len(summary.act_order) == 14 and not summary.unused, str(summary)
    assert not summary.missing, summary.missing
    model.model.rotary_emb.inv_freq = source.model.rotary_emb.inv_freq  # a non-persistent buffer
    ids = torch.randint(0, 96, (1, 7))
    # One input's layers permuted alike share one permutation tensor (q / k / v, gate / up
    # here: the writer's one seed gives every layer of one K the same order).
    perms = {id(m.perm) for m in model.modules() if isinstance(m, PackedInt4Linear)}
    assert len(perms) == 2
    with torch.no_grad():
        expected = model(ids).logits
        out, report = compile_and_run(lambda i: model(i).logits, [ids], rules=["dequant_matmul_int4",
                                                                                "linear_siblings"])
    assert report.count("dequant_matmul_int4") == 14, str(report)
    # q / k / v and gate / up of each layer, x permuted once for each: one call each
    assert report.count("linear_siblings") == 4, str(report)
    assert_close(out, expected, "llama loaded from GPTQ tensors")


# -- HQQ: its 4-bit layout (axis 1, 4bit_u8) from its description, and from the library ------

@pytest.mark.parametrize("group,encoded", [(64, False), (64, True), (128, True), (512, False)],
                         ids=["g64", "g64-encoded", "g128-encoded", "g512-regrouped"])
def test_hqq(group, encoded):
    k = max(K, group)
    w = torch.randn(N, k)
    tensors, ref = hqq_tensors(w, group, encoded)
    model, summary, bias = _load_one(tensors, "hqq", k=k)
    assert summary.converted == ["0"] and not summary.unused, str(summary)
    assert model[0].zero is not None and model[0].group_size == min(group, 256)
    _check(model, ref, bias)


def test_hqq_refusals_say_why():
    w = torch.randn(N, K)
    for meta, words in ((dict(nbits=3), "3-bit"), (dict(axis=0), "axis 0"), (dict(quant_scale=True), "quant_scale"),
                        (dict(packing="2bit_u8"), "2bit_u8")):
        tensors, _ = hqq_tensors(w, 64, **meta)
        model, summary, _ = _load_one(tensors, "hqq")
        assert not isinstance(model[0], PackedInt4Linear), meta
        assert words in dict(summary.skipped)["0"], summary.skipped


def test_hqq_linear_in_memory_is_replaced_and_runs_fused():
    """A model quantized by HQQ in memory (its PyTorch backend), converted from its own
    state dict: the HQQLinear modules become fusepass's int4 layers, computing HQQ's
    weight, and the compiled model runs one fused int4 call per layer."""
    hqq = pytest.importorskip("hqq.core.quantize")
    hqq.HQQLinear.set_backend(hqq.HQQBackend.PYTORCH)
    torch.manual_seed(3)
    cfg = hqq.BaseQuantizeConfig(nbits=4, group_size=64, axis=1)
    layers = [torch.nn.Linear(256, 96, bias=True), torch.nn.Linear(96 * 2, 128, bias=False)]
    model = torch.nn.Sequential(
        hqq.HQQLinear(layers[0], quant_config=cfg, compute_dtype=torch.float32, device="cpu"),
        torch.nn.Unflatten(-1, (96, 1)), torch.nn.Flatten(-2), torch.nn.Identity())
    model[3] = torch.nn.Sequential(torch.nn.Linear(96, 192), torch.nn.SiLU(),
                                   hqq.HQQLinear(layers[1], quant_config=cfg, compute_dtype=torch.float32,
                                                 device="cpu"))
    model.eval()
    x = torch.randn(3, 256)
    with torch.no_grad():
        expected = model(x)
    summary = fusepass.load_quantized(model, model.state_dict(), "hqq")
    assert summary.converted == ["0", "3.2"] and not summary.unused and not summary.skipped, str(summary)
    assert isinstance(model[0], PackedInt4Linear) and isinstance(model[3][2], PackedInt4Linear)
    with torch.no_grad():
        assert_close(model(x), expected, "converted HQQ layers")
        out, report = compile_and_run(model, [x], rules=["dequant_matmul_int4"])
    assert report.count("dequant_matmul_int4") == 2, str(report)
    assert_close(out, expected, "converted HQQ layers, compiled")


def test_llama_quantized_by_hqq_runs_fused():
    """A transformers Llama quantized in memory by HQQ's own model helper, converted from
    its state dict: every linear it quantized runs fusepass's int4 op, logits as HQQ's."""
    transformers = pytest.importorskip("transformers")
    hqq = pytest.importorskip("hqq.core.quantize")
    hf = pytest.importorskip("hqq.models.hf.base")
    hqq.HQQLinear.set_backend(hqq.HQQBackend.PYTORCH)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=96, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    hf.AutoHQQHFModel.quantize_model(model, quant_config=hqq.BaseQuantizeConfig(nbits=4, group_size=32, axis=1),
                                     compute_dtype=torch.float32, device="cpu")
    ids = torch.randint(0, 96, (1, 7))
    with torch.no_grad():
        expected = model(ids).logits
    summary = fusepass.load_quantized(model, model.state_dict(), "hqq")
    assert len(summary.converted) == 14 and not summary.skipped and not summary.unused, str(summary)
    with torch.no_grad():
        out, report = compile_and_run(lambda i: model(i).logits, [ids], rules=["dequant_matmul_int4"])
    assert report.count("dequant_matmul_int4") == 14, str(report)
    assert_close(out, expected, "llama quantized by HQQ, converted, compiled")
