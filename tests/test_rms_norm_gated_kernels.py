"""fusepass::rms_norm_gated: the kernel against an fp64 reference, and the
rule on real ``transformers`` hybrid models.

Without CUDA the launcher runs under Triton's interpreter (conftest sets
TRITON_INTERPRET=1) on CPU tensors at small shapes.  Every launch writes into
an output filled with NaN, so an element the kernel skips fails the
comparison.

The reference computes in fp64 with the op's roundings (the normalised value
to x's dtype, the product with the weight to promote(w, x), the result to
x's dtype).  Triton 3.9's interpreter truncates fp32 -> bf16 where the GPU
rounds to nearest even (see test_rms_norm_kernels.py): under the interpreter
the reference truncates its bf16 roundings the same way, so that the table's
tolerance still holds for three roundings in a row.
"""

from __future__ import annotations

import contextlib
import functools
import os

import pytest
import torch

import fusepass
from fusepass.kernels import rms_norm_gated as K
from fusepass.kernels._common import TOLERANCES, clear_kernel_fallbacks, inject_failure, kernel_fallbacks
from fusepass.testing import assert_close

from fusepass.testing import differential

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
EPS = 1e-6
HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if HAS_CUDA else "cpu"


def _round(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` (fp64) rounded to ``dtype`` to nearest, as the kernel rounds (under the
    interpreter too: round_to), back in fp64."""
    return t.to(dtype).double()


def reference64(x, z, w, cast_before_weight, activation):
    xd = x.double()
    n = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + EPS)
    if cast_before_weight:
        n = _round(n, x.dtype)
        p = n * w.double()
        p = _round(p, torch.promote_types(x.dtype, w.dtype))
    else:
        p = n * w.double()
    zd = z.double()
    a = torch.sigmoid(zd) * (zd if activation == "silu" else 1.0)
    return p * a


def make(shape, dtype, w_dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(shape, generator=g)).to(dtype)
    z = (2 * torch.randn(shape, generator=g)).to(dtype)
    w = (1 + 0.5 * torch.randn(shape[-1], generator=g)).to(w_dtype or dtype)  # a trained weight, not ones
    return x.to(DEVICE), z.to(DEVICE), w.to(DEVICE)


def run_and_check(x, z, w, cast_before_weight, activation, **overrides):
    out = torch.full(x.shape, float("nan"), dtype=x.dtype, device=x.device)
    y = K.rms_norm_gated_fwd(x, z, w, EPS, cast_before_weight, activation, out=out, **overrides)
    assert y is out
    ref = reference64(x, z, w, cast_before_weight, activation)  # on x's device: fp64 is fast on a GPU
    t = TOLERANCES[x.dtype]
    torch.testing.assert_close(y.double(), ref, atol=t.atol, rtol=t.rtol)


# ------------------------------------------------------------- semantics ----

# M7-N33 with 4-row tiles: a partial last tile, a partial (masked) row block;
# M5-N128: the model's head dim, the heuristic's tile; M3-N20000: rows longer
# than one block (the looped kernel, a partial last chunk).
SHAPES = {"M7-N33-BM4": ((7, 33), {"block_m": 4}), "M5-N128": ((5, 128), {}),
          "M3-N20000": ((3, 20000), {})}


@pytest.mark.parametrize("activation", K.ACTIVATIONS)
@pytest.mark.parametrize("cast", [True, False], ids=["cast", "fp32_weight"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_semantics(shape, dtype, cast, activation):
    if shape == "M3-N20000" and (activation == "sigmoid" or dtype == "fp16"):
        pytest.skip("the looped kernel's roundings are the tile's: one activation and two dtypes cover it")
    (s, kw) = SHAPES[shape]
    x, z, w = make(s, DTYPES[dtype])
    run_and_check(x, z, w, cast, activation, **kw)


def test_bf16_roundings_are_to_nearest():
    """Three bf16 roundings in a row (normalised value, product, output): each to nearest,
    on the GPU and under the interpreter (whose bf16 conversion truncates: outputs ran
    2-3 units low on 4097-wide rows), so the output is the reference's bf16 value in
    nearly every element and no lower on average."""
    x, z, w = make((4, 4097), torch.bfloat16)
    y = K.rms_norm_gated_fwd(x, z, w, EPS, True, "sigmoid").double()
    ref = reference64(x, z, w, True, "sigmoid")
    same = (y == _round(ref, torch.bfloat16)).double().mean().item()
    ulps = ((y - ref) / ref.abs().clamp_min(1e-30) * 128).mean().item()  # signed, in units of bf16's 2^-7
    assert same > 0.95 and abs(ulps) < 0.05, (same, ulps)


@pytest.mark.parametrize("x_dtype,w_dtype", [("bf16", "fp32"), ("fp16", "bf16"), ("fp32", "bf16")],
                         ids=["bf16-x-fp32-w", "fp16-x-bf16-w", "fp32-x-bf16-w"])
def test_mixed_weight_dtype_rounds_the_product_to_the_promoted_dtype(x_dtype, w_dtype):
    x, z, w = make((6, 40), DTYPES[x_dtype], DTYPES[w_dtype])
    run_and_check(x, z, w, True, "silu", block_m=4)


def test_gate_dtype_differs_from_x():
    # The gate is read and converted to fp32 whatever its dtype.
    x, _, w = make((6, 24), torch.bfloat16)
    _, z, _ = make((6, 24), torch.float16, seed=1)
    run_and_check(x, z, w, True, "silu")


def test_strided_rows_are_read_in_place():
    # z a slice of a wider projection (row stride 3N), x every other row of a
    # 3-d tensor, leading dims that flatten into rows.
    g = torch.Generator().manual_seed(3)
    base = torch.randn(2, 5, 3 * 48, generator=g).to(torch.bfloat16).to(DEVICE)
    z = base[..., 48:96]
    x = torch.randn(2, 10, 48, generator=g).to(torch.bfloat16).to(DEVICE)[:, ::2]
    w = torch.randn(48, generator=g).to(torch.bfloat16).to(DEVICE)
    assert K.rows(z, 48).data_ptr() == z.data_ptr()  # a view, not a copy
    run_and_check(x, z, w, True, "silu", block_m=2)


def test_transposed_and_broadcast_rows():
    x, z, w = make((16, 9), torch.float32)
    run_and_check(x.t().contiguous().t(), z[:1].expand(16, 9), w, False, "silu")  # column-major x: copied


def test_non_finite_values_stay_where_torch_puts_them():
    x, z, w = make((4, 32), torch.bfloat16)
    x[1, 3] = float("inf")  # rstd = 0: the row is 0, inf * 0 = NaN where the inf was, as torch
    z[2, 5] = float("-inf")  # silu(-inf) is NaN in torch too; the rest of row 2 is finite
    z[3, 7] = -100.0  # silu = -0, not NaN
    out = K.rms_norm_gated_fwd(x, z, w, EPS, True, "silu").cpu().double()
    ref = reference64(x.cpu(), z.cpu(), w.cpu(), True, "silu")
    assert torch.isnan(out[1, 3]) and torch.isnan(out[2, 5]) and torch.isnan(out).sum() == 2
    t = TOLERANCES[torch.bfloat16]
    torch.testing.assert_close(out, ref, atol=t.atol, rtol=t.rtol, equal_nan=True)


def test_empty_rows():
    x, z, w = make((0, 16), torch.float16)
    assert K.rms_norm_gated_fwd(x, z, w, EPS).shape == (0, 16)


def test_bad_arguments_are_clear_errors():
    x, z, w = make((4, 16), torch.bfloat16)
    with pytest.raises(ValueError, match="gate"):
        K.rms_norm_gated_fwd(x, z[:1], w, EPS)
    with pytest.raises(ValueError, match="weight"):
        K.rms_norm_gated_fwd(x, z, w[:8], EPS)
    with pytest.raises(ValueError, match="activation"):
        K.rms_norm_gated_fwd(x, z, w, EPS, True, "gelu")
    with pytest.raises(TypeError, match="no kernel"):
        K.rms_norm_gated_fwd(x.double(), z, w, EPS)


def test_config_tiles_short_rows_and_loops_long_ones():
    # Qwen3.5 at 4096 tokens: 131072 rows of 128, 32-row tiles; one token: 32
    # rows spread one per program (132 SMs).
    assert K.rms_norm_gated_config(4096 * 32, 128, 132) == K.GatedNormConfig(32, 128, 8, 4096, False)
    assert K.rms_norm_gated_config(32, 128, 132).BM == 1
    assert K.rms_norm_gated_config(3, 65537, 132).looped


# ---------------------------------------------------------------- the op ----

def _op_path():
    """The op's CUDA implementation: natively on a GPU, else its Triton kernel interpreted on CPU tensors."""
    if HAS_CUDA:
        return contextlib.nullcontext()
    return differential.triton_on_cpu(["rms_norm_gated"])


def test_op_fp64_goes_to_the_reference():
    x, z, w = (t.double() for t in make((3, 8), torch.float32))
    with _op_path():
        y = torch.ops.fusepass.rms_norm_gated(x, z, w, EPS, True, "silu")
    assert y.dtype == torch.float64
    torch.testing.assert_close(y.cpu(), reference64(x.cpu(), z.cpu(), w.cpu(), True, "silu"), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("looped", [False, True], ids=["tile", "looped"])
def test_eps_tensor_is_read_when_the_kernel_runs(looped):
    """eps as a 0-dim tensor (dynamic=True's unspecialised float) gives the
    float eps's result exactly: on x's device the kernel loads it, a CPU one
    (on a GPU) goes as its value; the op takes it as eps_tensor."""
    x, z, w = make((5, 20000 if looped else 33), torch.bfloat16)
    want = K.rms_norm_gated_fwd(x, z, w, 0.5)
    for eps in (torch.tensor(0.5, dtype=torch.float64, device=DEVICE), torch.tensor(0.5)):
        assert torch.equal(K.rms_norm_gated_fwd(x, z, w, eps), want), f"eps on {eps.device}"
    clear_kernel_fallbacks()
    with _op_path():
        y = torch.ops.fusepass.rms_norm_gated(x, z, w, EPS, True, "silu", torch.tensor(0.5))
    assert torch.equal(y, want) and not kernel_fallbacks()


def test_op_kernel_failure_falls_back():
    x, z, w = make((5, 16), torch.bfloat16)
    expected = K.rms_norm_gated_reference(x, z, w, EPS, True, "silu")
    clear_kernel_fallbacks()
    try:
        with _op_path(), inject_failure("rms_norm_gated"):
            y = torch.ops.fusepass.rms_norm_gated(x, z, w, EPS, True, "silu")
        assert torch.equal(y, expected)
        assert "injected" in kernel_fallbacks()["rms_norm_gated"]
    finally:
        clear_kernel_fallbacks()


# --------------------------------------------------------- hybrid models ----

transformers = pytest.importorskip("transformers")


def _hybrid(name: str, dtype: torch.dtype):
    """A 2-layer hybrid model, hidden 64: one Gated DeltaNet layer, one full-attention layer."""
    tf = transformers
    if not hasattr(tf, "Qwen3_5TextConfig") or not hasattr(tf, "Qwen3NextConfig"):
        pytest.skip(f"transformers {tf.__version__} has no Qwen3-Next / Qwen3.5")
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=512,
                  linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                  linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"])
    if name == "qwen3_next":
        # Dense MLPs (mlp_only_layers): the MoE block doubled the compile
        # time (25 s against 12 s on 2 cores) and has nothing to do with the norm.
        cls, config = tf.Qwen3NextForCausalLM, tf.Qwen3NextConfig(
            **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, mlp_only_layers=[0, 1])
    else:
        cls, config = tf.Qwen3_5ForCausalLM, tf.Qwen3_5TextConfig(**common)
    torch.manual_seed(0)
    model = cls(config)
    with torch.no_grad():  # random norm weights: all ones would hide a kernel that ignores them
        for module in model.modules():
            if "Norm" in type(module).__name__ and getattr(module, "weight", None) is not None:
                module.weight.normal_(1.0 if "Gated" in type(module).__name__ else 0.0, 0.5)
    return model.to(dtype).eval()


@functools.cache
def compiled_hybrid(name: str):
    model = _hybrid(name, torch.bfloat16)
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    fusepass.reset_reports()
    # emulate_precision_casts: Inductor rounds fused intermediates as eager
    # does.  Without it plain Inductor (no fusepass rule) already put 2 of the
    # bf16 logits of a Qwen3-Next with MoE layers outside the table (max error
    # 0.022); with it plain Inductor and fusepass both matched eager exactly
    # (measured).
    with torch.no_grad(), torch._inductor.config.patch(emulate_precision_casts=True):
        expected = model(ids).logits
        actual = torch.compile(model, backend="fusepass")(ids).logits
    return model, expected, actual, fusepass.last_report()


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5"])
def test_hybrid_model_gated_norm_is_one_op_per_gdn_layer(name):
    model, expected, actual, report = compiled_hybrid(name)
    gdn_layers = model.config.layer_types.count("linear_attention")
    hits = [h for h in report.hits if h.rule == "rms_norm_gated"]
    assert len(hits) == gdn_layers, str(report)
    assert all(h.form.split(" ")[0] == "hf" and "linear_attn.norm" in h.where for h in hits), hits
    # Nothing else took a part of it: no mixed-dtype refusal, no norm hit in the GDN layer.
    assert not any("mixed dtypes" in r for r in report.reasons()), report.reasons()
    # (The GDN rules own the rest of the layer: gdn_chunk is expected there.)
    assert not any("linear_attn" in h.where for h in report.hits
                   if h.rule in ("rms_norm", "add_rms_norm", "swiglu", "geglu"))
    assert_close(actual, expected, f"{name} bf16 logits")


def _hf_gated(x, z, w):
    """transformers' Qwen3_5RMSNormGated.forward, weight as an argument."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    h = w * h.to(x.dtype)
    return (h * torch.nn.functional.silu(z.to(torch.float32))).to(x.dtype)


def test_dynamic_tokens_share_one_graph():
    """dynamic=True: the global EPS is a graph input (not specialised); one graph.  Rewritten on the
    CPU; on CUDA left to Inductor with the reason (the kernel is inlined only with a constant eps)."""
    torch._dynamo.reset()
    fusepass.reset_reports()
    fn = torch.compile(_hf_gated, backend="fusepass", dynamic=True)
    t = TOLERANCES[torch.bfloat16]
    for tokens in (3, 100, 1000):
        x, z, w = make((tokens * 32, 128), torch.bfloat16, seed=tokens)
        torch.testing.assert_close(fn(x, z, w), _hf_gated(x, z, w), atol=t.atol, rtol=t.rtol)
    report = fusepass.last_report()
    assert len(report.graphs) == 1, str(report)
    if DEVICE == "cuda":
        assert report.count("rms_norm_gated") == 0, str(report)
        assert any("run-time value" in r.reason for r in report.refusals), str(report)
    else:
        assert report.count("rms_norm_gated") >= 1, str(report)


# ---------------------------------------------------------------- on a GPU ----

@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 4096, 16384], ids=lambda t: f"T{t}-H32-D128")
def test_gpu_real_sizes_kernel_and_compiled(tokens):
    """Qwen3.5-9B shapes: the op's kernel, and the kernel inlined into
    Inductor's code by a fusepass compile, against fp64 and against eager."""
    M, N = tokens * 32, 128
    x, z, w = make((M, N), torch.bfloat16)
    run_and_check(x, z, w, True, "silu")
    expected = _hf_gated(x, z, w)
    t = TOLERANCES[torch.bfloat16]
    torch.testing.assert_close(K.rms_norm_gated_fwd(x, z, w, EPS), expected, atol=t.atol, rtol=t.rtol)
    torch._dynamo.reset()
    fusepass.reset_reports()
    clear_kernel_fallbacks()
    out = torch.compile(_hf_gated, backend="fusepass", dynamic=False)(x, z, w)
    assert fusepass.last_report().count("rms_norm_gated") == 1, str(fusepass.last_report())
    torch.testing.assert_close(out, expected, atol=t.atol, rtol=t.rtol)
    assert not kernel_fallbacks()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5"])
def test_gpu_hybrid_model(name):
    model = _hybrid(name, torch.bfloat16).cuda()
    ids = torch.randint(0, 256, (4, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    torch._dynamo.reset()
    fusepass.reset_reports()
    with torch.no_grad(), torch._inductor.config.patch(emulate_precision_casts=True):
        expected = model(ids).logits
        actual = torch.compile(model, backend="fusepass")(ids).logits
    report = fusepass.last_report()
    assert report.count("rms_norm_gated") == model.config.layer_types.count("linear_attention"), str(report)
    assert_close(actual, expected, f"{name} bf16 logits on GPU")
