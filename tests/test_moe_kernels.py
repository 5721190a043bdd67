"""MoE ops (fusepass/kernels/moe/): ``fusepass::moe_router`` and
``fusepass::moe_experts`` against transformers' MoE blocks and against fp64
references; their Triton kernels under the interpreter at tiny shapes.

The op bodies are checked against transformers' own blocks (random weights):
bit for bit in bf16 against its ``grouped_mm`` and ``batched_mm`` experts
forms, within the dtype table against the per-expert ``eager`` loop (which
adds experts in x's dtype).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fusepass.kernels._common import TOLERANCES
from fusepass.kernels.moe import experts as ex
from fusepass.kernels.moe import router as rt

ops = torch.ops.fusepass
NO_QUANT = (None, None, None, None)


def _randomize(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        for b in module.buffers():
            if b.is_floating_point():
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)


def _block(model: str, dtype: torch.dtype):
    """(block, router module, experts module, router kwargs, experts args) of a tiny transformers MoE block."""
    if model == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
        cfg = Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=3,
                             norm_topk_prob=True)
        block = Qwen3MoeSparseMoeBlock(cfg)
        router = dict(kind="softmax", top_k=3, renormalize=True, logits_dtype=dtype, weights_dtype=dtype)
        gate, experts, act = block.gate, block.experts, ("silu", "halves", False, "none", 0, 0.0, 0.0)
    elif model == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
        cfg = MixtralConfig(hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2)
        block = MixtralSparseMoeBlock(cfg)
        router = dict(kind="softmax", top_k=2, renormalize=True, logits_dtype=dtype, weights_dtype=torch.float32)
        gate, experts, act = block.gate, block.experts, ("silu", "halves", False, "none", 0, 0.0, 0.0)
    elif model == "olmoe":
        from transformers import OlmoeConfig
        from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock
        cfg = OlmoeConfig(hidden_size=64, intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                          norm_topk_prob=False)
        block = OlmoeSparseMoeBlock(cfg)
        router = dict(kind="softmax", top_k=2, renormalize=False, logits_dtype=dtype, weights_dtype=dtype)
        gate, experts, act = block.gate, block.experts, ("silu", "halves", False, "none", 0, 0.0, 0.0)
    elif model == "gpt_oss":
        from transformers import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
        cfg = GptOssConfig(hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=4)
        block = GptOssMLP(cfg)
        router = dict(kind="topk_softmax", top_k=4, renormalize=False, logits_dtype=dtype, weights_dtype=dtype)
        gate, experts = block.router, block.experts
        # The experts module's own constants (transformers 5.17 fixes alpha there; later ones read the config).
        act = ("gpt_oss", "interleaved", True, "none", 0, float(experts.alpha), float(experts.limit))
    else:
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
        cfg = DeepseekV3Config(hidden_size=64, moe_intermediate_size=32, n_routed_experts=16, num_experts_per_tok=4,
                               n_group=4, topk_group=2, routed_scaling_factor=2.5, n_shared_experts=1)
        block = DeepseekV3MoE(cfg)
        router = dict(kind="sigmoid", top_k=4, renormalize=True, n_group=4, topk_group=2, scaling=2.5,
                      logits_dtype=torch.float32, weights_dtype=torch.float32)
        gate, experts, act = block.gate, block.experts, ("silu", "halves", False, "none", 0, 0.0, 0.0)
    _randomize(block, 0)
    block.to(dtype)
    if model == "deepseek_v3":  # its router weight and correction bias stay fp32, as the model keeps them
        gate.float()
        router["correction_bias"] = gate.e_score_correction_bias
    return block, gate, experts, router, act


def _router(x, gate, kind, top_k, renormalize, logits_dtype, weights_dtype, correction_bias=None, n_group=1,
            topk_group=1, scaling=1.0):
    return ops.moe_router(x, gate.weight, getattr(gate, "bias", None), correction_bias, kind, top_k, renormalize,
                          n_group, topk_group, scaling, logits_dtype, weights_dtype)


def _experts_op(x, ids, w, experts, act):
    return ops.moe_experts(x, ids, w, experts.gate_up_proj, experts.down_proj,
                           getattr(experts, "gate_up_proj_bias", None), getattr(experts, "down_proj_bias", None),
                           *NO_QUANT, *act)


MODELS = ["qwen3_moe", "mixtral", "olmoe", "gpt_oss", "deepseek_v3"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model", MODELS)
def test_ops_match_transformers_blocks(model, dtype):
    """Router and experts ops reproduce transformers' blocks: ids, weights
    (dtype too) and logits exactly; the block output bit for bit in bf16
    against grouped_mm and batched_mm, within the dtype table against eager."""
    block, gate, experts, router, act = _block(model, dtype)
    x = torch.randn(17, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        logits_ref, w_ref, ids_ref = gate(x)
        w, ids, logits = _router(x, gate, **router)
        assert ids.dtype == torch.int64 and w.dtype == w_ref.dtype and logits.dtype == logits_ref.dtype
        assert torch.equal(logits, logits_ref)
        # DeepSeek-V3's topk(sorted=False) leaves the order unspecified: compare as sets.
        order_ref, order = ids_ref.argsort(-1), ids.argsort(-1)
        assert torch.equal(ids.gather(1, order), ids_ref.gather(1, order_ref))
        # (Its renormalising sum then adds in another order: an ulp of fp32 apart.)
        exact = 1e-6 if model == "deepseek_v3" else 0
        torch.testing.assert_close(w.gather(1, order), w_ref.gather(1, order_ref), atol=exact, rtol=exact)
        # The experts on transformers' own routing (the order of DeepSeek-V3's ids included).
        out = _experts_op(x, ids_ref, w_ref, experts, act)
        for impl in ("grouped_mm", "batched_mm", "eager"):
            experts.config._experts_implementation = impl
            ref = experts(x, ids_ref, w_ref)
            tol = TOLERANCES[dtype]
            if impl == "eager":
                # index_add_ rounds the running sum to x's dtype after each
                # expert: errors scale with the partial sums, not with the
                # (possibly cancelled) result.
                torch.testing.assert_close(out, ref, atol=tol.rtol * ref.abs().max().item(), rtol=tol.rtol)
            elif dtype == torch.float32:
                torch.testing.assert_close(out, ref, atol=tol.atol, rtol=tol.rtol)
            else:
                assert torch.equal(out, ref), impl


def test_router_ties_go_to_the_lower_index():
    x = torch.ones(2, 4)
    weight = torch.tensor([[0.0, 0, 0, 1], [1, 0, 0, 0], [0.25, 0.25, 0.25, 0.25], [1, 0, 0, 0], [0, 0, 0, 0],
                           [0.5, 0.5, 0, 0]])
    # logits per token: [1, 1, 1, 1, 0, 1]: five equal, the top 3 are experts 0, 1, 2.
    w, ids, _ = ops.moe_router(x, weight, None, None, "softmax", 3, False, 1, 1, 1.0, torch.float32, torch.float32)
    assert ids.tolist() == [[0, 1, 2], [0, 1, 2]]
    w, ids, _ = ops.moe_router(x, weight, None, None, "topk_softmax", 5, False, 1, 1, 1.0, torch.float32,
                               torch.float32)
    assert ids.tolist() == [[0, 1, 2, 3, 5]] * 2


@pytest.mark.parametrize("T", [0, 5])
def test_ops_under_compile_with_dynamic_tokens(T):
    """The fakes give the shapes and dtypes of the bodies, with a symbolic T."""
    block, gate, experts, router, act = _block("qwen3_moe", torch.float32)

    def f(x):
        w, ids, logits = _router(x, gate, **router)
        return _experts_op(x, ids, w, experts, act), logits

    compiled = torch.compile(f, backend="eager", dynamic=True, fullgraph=True)
    for t in (T, T + 3):
        x = torch.randn(t, 64)
        out, logits = compiled(x)
        ref, ref_logits = f(x)
        assert out.shape == (t, 64) and logits.shape == (t, 8)
        torch.testing.assert_close(out, ref)


def test_experts_pairs_outside_the_experts_add_nothing():
    _, _, experts, _, act = _block("qwen3_moe", torch.float32)
    x = torch.randn(3, 64)
    ids = torch.tensor([[0, 8, 2], [-1, 5, 5], [7, 100, 1]])
    w = torch.rand(3, 3)
    out = _experts_op(x, ids, w, experts, act)
    keep = (ids >= 0) & (ids < 8)
    ref = _experts_op(x, ids.clamp(0, 7), w * keep, experts, act)
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("case,message", [
    (dict(top_k=9), "top_k = 9 outside"),
    (dict(kind="softmax_topk"), "kind must be one of"),
    (dict(kind="sigmoid", n_group=3), "do not split into 3 groups"),
    (dict(kind="sigmoid", n_group=4, topk_group=1, top_k=3), "exceeds the 2 experts"),
    (dict(correction_bias=torch.zeros(8)), "belongs to the sigmoid router"),
    (dict(n_group=2, topk_group=1), "group-limited top-k belongs to the sigmoid router"),
])
def test_router_refuses_bad_arguments(case, message):
    args = dict(kind="softmax", top_k=2, renormalize=True, n_group=1, topk_group=1, correction_bias=None)
    args.update(case)
    with pytest.raises(RuntimeError, match=message):
        ops.moe_router(torch.randn(3, 16), torch.randn(8, 16), None, args["correction_bias"], args["kind"],
                       args["top_k"], args["renormalize"], args["n_group"], args["topk_group"], 1.0, torch.float32,
                       torch.float32)


@pytest.mark.parametrize("case,message", [
    (dict(activation="relu"), "activation must be one of"),
    (dict(w_down=torch.randn(4, 16, 9)), "w_down must be"),
    (dict(w_gate_up=torch.randn(4, 16, 16, dtype=torch.bfloat16)), "x's dtype"),
    (dict(ids=torch.zeros(3, 2)), "topk_ids must be integer"),
    (dict(fmt="int4"), "int4 expert weights must be torch.uint8"),
])
def test_experts_refuse_bad_arguments(case, message):
    args = dict(w_gate_up=torch.randn(4, 16, 16), w_down=torch.randn(4, 16, 8), ids=torch.zeros(3, 2, dtype=torch.long),
                activation="silu", fmt="none")
    args.update(case)
    with pytest.raises(RuntimeError, match=message):
        ops.moe_experts(torch.randn(3, 16), args["ids"], torch.rand(3, 2), args["w_gate_up"], args["w_down"], None,
                        None, *NO_QUANT, args["activation"], "halves", False, args["fmt"], 0, 0.0, 0.0)


# ------------------------------------------------------------ the kernels ----
#
# Launched directly on CPU tensors under the interpreter (on a GPU, on CUDA
# tensors).  Workspaces and outputs are poisoned (NaN, or a huge index) so an
# element a kernel forgets to write shows.  (The Triton 3.9 interpreter
# converts fp32 to bf16 by truncation; the kernels round to nearest there by
# hand, as the GPU does: the references are the same on both.)

from fusepass.kernels.moe import _tiles, decode, prefill  # noqa: E402
from fusepass.formats import unpack_int4  # noqa: E402

INTERPRET = __import__("os").environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"


@pytest.fixture
def poisoned(monkeypatch):
    real = _tiles.workspace

    def poisoned_workspace(shape, dtype, device):
        t = real(shape, dtype, device)
        return t.fill_(float("nan") if dtype.is_floating_point else 2**30)

    monkeypatch.setattr(_tiles, "workspace", poisoned_workspace)


def _quantize(w: torch.Tensor, fmt: str, group: int, asym: bool):
    """[E, N, K] float weights -> (stored weight, scale, zero) in dequant_matmul's formats."""
    E, N, K = w.shape
    if fmt == "int8":
        s = w.abs().amax(-1) / 127
        return torch.round(w / s[..., None]).clamp(-127, 127).to(torch.int8), s, None
    if fmt == "fp8":
        s = w.abs().amax(-1) / 448
        return (w / s[..., None]).to(torch.float8_e4m3fn), s, None
    wg = w.view(E, N, K // group, group)
    if asym:
        lo, hi = wg.amin(-1), wg.amax(-1)
        s = (hi - lo) / 15
        z = torch.round(-lo / s)
    else:
        s, z = wg.abs().amax(-1) / 7, None
    q = torch.round(wg / s[..., None] + (z[..., None] if asym else 8)).clamp(0, 15).to(torch.uint8).view(E, N, K)
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous()
    assert torch.equal(unpack_int4(packed), q)
    return packed, s, z


def _experts_inputs(T, E, H, I, k, dtype, *, trans=False, bias=False, fmt="none", group=0, asym=False, twdt=None,
                    ids=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(dtype)
    if ids is None:
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]) if T else torch.zeros(0, k)
    ids = ids.long()
    tw = torch.rand(T, k, generator=gen).to(twdt or dtype)
    w1 = torch.randn(E, 2 * I, H, generator=gen) * 0.2
    w2 = torch.randn(E, H, I, generator=gen) * 0.2
    s1 = z1 = s2 = z2 = None
    if fmt != "none":
        w1, s1, z1 = _quantize(w1, fmt, group, asym)
        w2, s2, z2 = _quantize(w2, fmt, group, asym)
        s1, s2 = s1.to(dtype), s2.to(dtype)
        if asym:
            z1, z2 = z1.to(dtype), z2.to(dtype)
    else:
        w1, w2 = w1.to(dtype), w2.to(dtype)
        if trans:
            w1, w2 = w1.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()
    b1 = torch.randn(E, 2 * I, generator=gen).to(dtype) if bias else None
    b2 = torch.randn(E, H, generator=gen).to(dtype) if bias else None
    t = lambda v: None if v is None else v.to(DEVICE)  # noqa: E731
    return tuple(t(v) for v in (x, ids, tw, w1, w2, b1, b2, s1, z1, s2, z2))


def _run_experts(plan, inputs, act, layout, trans, fmt, group, cfg=None):
    alpha, limit = (1.702, 7.0) if act == "gpt_oss" else (0.0, 0.0)
    out = ex.experts_fwd(*inputs, act, layout, trans, fmt, group, alpha, limit, plan=plan, cfg=cfg)
    ref = ex.moe_experts_reference(*inputs, act, layout, trans, fmt, group, alpha, limit, torch.float64)
    return out, ref


def _assert_experts_close(out, ref, loose=False):
    assert not out.isnan().any(), "an output element was never written"
    tol = TOLERANCES[out.dtype]
    # loose: errors relative to the largest output (the sorted path's tl.dot
    # takes int4 weights dequantised and rounded to x's dtype)
    scale = 2 * ref.abs().max().item() if loose else 1.0
    torch.testing.assert_close(out.double(), ref.double(), atol=tol.atol * scale, rtol=tol.rtol)


DT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# id -> (T, E, H, I, k, dtype, activation, layout, transposed, bias, fmt, group, asym, routing weights' dtype)
EXPERT_CASES = {
    "T1-E8-k2-fp16-silu": (1, 8, 64, 32, 2, "fp16", "silu", "halves", False, False, "none", 0, False, None),
    "T3-E4-k3-fp32-gelu-interleaved-bias-H48-I40": (3, 4, 48, 40, 3, "fp32", "gelu", "interleaved", False, True,
                                                    "none", 0, False, None),
    "T3-E8-k2-bf16-gpt_oss-transposed-bias-fp32w": (3, 8, 64, 32, 2, "bf16", "gpt_oss", "interleaved", True, True,
                                                    "none", 0, False, "fp32"),
    "T3-E8-k2-fp16-gelu_tanh-transposed": (3, 8, 64, 32, 2, "fp16", "gelu_tanh", "halves", True, False, "none", 0,
                                           False, None),
    "T3-E6-k3-bf16-int4-g16-asym": (3, 6, 64, 32, 3, "bf16", "silu", "halves", False, False, "int4", 16, True, None),
    "T3-E8-k2-fp16-int4-g32-sym": (3, 8, 64, 32, 2, "fp16", "silu", "halves", False, False, "int4", 32, False, None),
    "T1-E8-k2-bf16-int4-g32-asym-H128": (1, 8, 128, 64, 2, "bf16", "silu", "halves", False, False, "int4", 32, True,
                                         None),
    # fp32 x and zero points (the int4 loop's rounding of q - z), BM 2 with an odd last row
    "T5-E4-k2-fp32-int4-g16-asym-interleaved": (5, 4, 64, 32, 2, "fp32", "gelu", "interleaved", False, False,
                                                "int4", 16, True, None),
    # a group of 6: chunks of one byte, tiles across groups
    "T2-E4-k2-bf16-int4-g6-asym-H48-I24": (2, 4, 48, 24, 2, "bf16", "silu", "halves", False, False, "int4", 6,
                                           True, None),
    "T3-E8-k2-fp16-int8": (3, 8, 64, 32, 2, "fp16", "silu", "halves", False, False, "int8", 0, False, None),
    "T3-E8-k2-bf16-fp8-interleaved": (3, 8, 64, 32, 2, "bf16", "silu", "interleaved", False, False, "fp8", 0, False,
                                      None),
    "T17-E8-k3-bf16-silu": (17, 8, 64, 32, 3, "bf16", "silu", "halves", False, False, "none", 0, False, None),
    "T5-E5-k1-fp32-odd-H37-I19": (5, 5, 37, 19, 1, "fp32", "silu", "interleaved", False, True, "none", 0, False,
                                  None),
    # one token, int4 rows interleaved, with biases, no zero point
    "T1-E6-k2-fp16-int4-g16-interleaved-bias": (1, 6, 64, 48, 2, "fp16", "silu", "interleaved", False, True, "int4",
                                                16, False, None),
    # one token, 16-bit: gate_up's whole-row tile (BK the row, masked past an odd H), interleaved with biases
    "T1-E6-k3-bf16-odd-H37-I19-interleaved-bias": (1, 6, 37, 19, 3, "bf16", "gelu", "interleaved", False, True,
                                                   "none", 0, False, None),
    "T5-E5-k1-fp16-odd-H37-I19-transposed": (5, 5, 37, 19, 1, "fp16", "gpt_oss", "halves", True, True, "none", 0,
                                             False, None),
}


@pytest.mark.parametrize("case", list(EXPERT_CASES))
@pytest.mark.parametrize("plan", ["decode", "sorted"])
def test_experts_kernels_match_reference(poisoned, plan, case):
    T, E, H, I, k, dt, act, layout, trans, bias, fmt, group, asym, twdt = EXPERT_CASES[case]
    if plan == "sorted" and T == 3 and fmt == "none" and act != "gpt_oss":
        pytest.skip("covered by the decode path; the sorted path runs the other cases")  # interpreter time
    if plan == "sorted" and group & (group - 1):
        pytest.skip("the sorted path tiles whole power-of-two groups (the op falls back to plain torch there)")
    inputs = _experts_inputs(T, E, H, I, k, DT[dt], trans=trans, bias=bias, fmt=fmt, group=group, asym=asym,
                             twdt=DT.get(twdt))
    out, ref = _run_experts(plan, inputs, act, layout, trans, fmt, group)
    _assert_experts_close(out, ref, loose=plan == "sorted" and fmt == "int4")


# (int4 at one token, g32 asymmetric and g16 interleaved with biases: the two T3 / T5
# int4 cases took 85 s of the interpreter for the same chunk loop)
@pytest.mark.parametrize("case", ["T1-E8-k2-fp16-silu", "T3-E4-k3-fp32-gelu-interleaved-bias-H48-I40",
                                  "T3-E8-k2-bf16-gpt_oss-transposed-bias-fp32w", "T3-E8-k2-fp16-int8",
                                  "T3-E8-k2-bf16-fp8-interleaved", "T5-E5-k1-fp32-odd-H37-I19",
                                  "T1-E8-k2-bf16-int4-g32-asym-H128", "T1-E6-k2-fp16-int4-g16-interleaved-bias"])
def test_decode_loads_a_tile_ahead(poisoned, case):
    """gate_up and down with the next K tile loaded before this one's products
    (``ahead`` / ``ahead2``): tiles narrower than H and I so the loop runs several
    steps and its last look-ahead falls past K (masked off).  int4: down's chunk
    loop (two chunks deep a tile: bytes, scales, zero points and h's pairs
    ahead); gate_up's int4 loops ignore the option."""
    T, E, H, I, k, dt, act, layout, trans, bias, fmt, group, asym, twdt = EXPERT_CASES[case]
    inputs = _experts_inputs(T, E, H, I, k, DT[dt], trans=trans, bias=bias, fmt=fmt, group=group, asym=asym,
                             twdt=DT.get(twdt))
    base = decode.decode_heuristic(T, k, H, I, trans, 132, group)
    BK2 = 2 * decode.chunk_bytes(group) if fmt == "int4" else 8
    assert I > BK2
    cfg = dataclasses.replace(base, BK=16, BK2=BK2, defer=True, defer2=case.startswith("T1"), dot2=False, ahead=True,
                              ahead2=True, whole2=False)
    out, ref = _run_experts("decode", inputs, act, layout, trans, fmt, group, cfg)
    _assert_experts_close(out, ref)


@pytest.mark.parametrize("case,BK2,split,ahead", [("T1-E8-k2-bf16-int4-g32-asym-H128", 32, 2, True),
                                                  ("T1-E6-k2-fp16-int4-g16-interleaved-bias", 16, 3, False),
                                                  ("T1-E6-k2-fp16-int4-g16-interleaved-bias", 16, 2, True)])
def test_decode_int4_down_split_over_k(poisoned, monkeypatch, case, BK2, split, ahead):
    """int4 down's chunk loop with K split over programs in whole chunk tiles (I
    64 in two slices of 32; I 48 in three of 16, and in 32 + 16), with and without
    the look-ahead (its last look-ahead past the slice's end masked off)."""
    T, E, H, I, k, dt, act, layout, trans, bias, fmt, group, asym, twdt = EXPERT_CASES[case]
    inputs = _experts_inputs(T, E, H, I, k, DT[dt], trans=trans, bias=bias, fmt=fmt, group=group, asym=asym,
                             twdt=DT.get(twdt))
    base = decode.decode_heuristic(T, k, H, I, trans, 132, group)
    held = torch.zeros(64, dtype=torch.int32, device=DEVICE)
    monkeypatch.setattr(decode, "_split_counters", lambda device, tiles: held[:tiles])
    cfg = dataclasses.replace(base, BK2=BK2, split2=split, ahead2=ahead, whole2=False)
    assert decode.int4_chunk(fmt, trans, group, BK2) and I > BK2
    out, ref = _run_experts("decode", inputs, act, layout, trans, fmt, group, cfg)
    _assert_experts_close(out, ref)
    assert not held.any()  # each tile's last program left its counter at zero


# (I 96 for the g32 case: its 32-code chunks tile I 64 exactly)
@pytest.mark.parametrize("case,I,BK2,split", [("T1-E8-k2-bf16-int4-g32-asym-H128", 96, 64, 1),
                                              ("T1-E6-k2-fp16-int4-g16-interleaved-bias", 48, 32, 1),
                                              ("T1-E6-k2-fp16-int4-g16-interleaved-bias", 48, 16, 2)])
def test_decode_int4_down_loads_the_whole_slice(poisoned, monkeypatch, case, I, BK2, split):
    """int4 down's chunk loop unrolled over its whole K slice (``whole2``): every
    tile's loads before the first sum, the look-ahead off, the last tile partly
    past K (masked off); with K split (slices of 32 + 16), the second slice's
    second tile wholly past it."""
    T, E, H, _, k, dt, act, layout, trans, bias, fmt, group, asym, twdt = EXPERT_CASES[case]
    inputs = _experts_inputs(T, E, H, I, k, DT[dt], trans=trans, bias=bias, fmt=fmt, group=group, asym=asym,
                             twdt=DT.get(twdt))
    base = decode.decode_heuristic(T, k, H, I, trans, 132, group)
    cfg = dataclasses.replace(base, BK2=BK2, split2=split, ahead2=True, whole2=True)
    kt = decode.cdiv(decode.cdiv(I, split), BK2)  # tiles a slice (a slice of kt * BK2 codes)
    assert decode.int4_chunk(fmt, trans, group, BK2) and I > BK2 and I % (kt * BK2)  # the last tile past I
    held = torch.zeros(64, dtype=torch.int32, device=DEVICE)
    monkeypatch.setattr(decode, "_split_counters", lambda device, tiles: held[:tiles])
    downs = []
    real = decode.Launch

    def launch(kernel, grid, args, *rest, **kw):
        if kernel is decode._moe_decode_down_kernel:
            downs.append((args["KT"], args["AHEAD"], args["SPLIT"]))
        return real(kernel, grid, args, *rest, **kw)

    monkeypatch.setattr(decode, "Launch", launch)
    out, ref = _run_experts("decode", inputs, act, layout, trans, fmt, group, cfg)
    assert downs == [(kt, False, split > 1)]
    _assert_experts_close(out, ref)
    assert not held.any()


@pytest.mark.parametrize("case", ["T3-E8-k2-bf16-gpt_oss-transposed-bias-fp32w", "T3-E8-k2-fp16-int8",
                                  "T3-E8-k2-bf16-fp8-interleaved", "T5-E5-k1-fp16-odd-H37-I19-transposed"])
@pytest.mark.parametrize("split", [2, 3])
def test_decode_down_split_over_k(poisoned, monkeypatch, case, split):
    """The down kernel with K split over programs: each tile's last program adds
    the slices and finishes (scales, bias, roundings, routing weights), and
    leaves its counter at zero for the next launch; the op's form and the
    inlined form (counters zeroed in the graph)."""
    T, E, H, I, k, dt, act, layout, trans, bias, fmt, group, asym, twdt = EXPERT_CASES[case]
    inputs = _experts_inputs(T, E, H, I, k, DT[dt], trans=trans, bias=bias, fmt=fmt, group=group, asym=asym,
                             twdt=DT.get(twdt))
    base = decode.decode_heuristic(T, k, H, I, trans, 132, group)
    cfg = dataclasses.replace(base, BN2=16, BK2=8, split2=split, defer2=split == 2, dot2=False)
    held = torch.zeros(64, dtype=torch.int32, device=DEVICE)
    monkeypatch.setattr(decode, "_split_counters", lambda device, tiles: held[:tiles])
    out, ref = _run_experts("decode", inputs, act, layout, trans, fmt, group, cfg)
    _assert_experts_close(out, ref)
    assert not held.any(), held  # every tile's counter back at zero
    monkeypatch.setattr(decode, "decode_heuristic", lambda *a, **kw: cfg)
    monkeypatch.setattr(ex, "moe_experts_plan", lambda *a, **kw: "decode")
    alpha, limit = (1.702, 7.0) if act == "gpt_oss" else (0.0, 0.0)
    traced = ex.moe_experts_traced(*inputs, act, layout, trans, fmt, group, alpha, limit)
    _assert_experts_close(traced, ref)


@pytest.mark.parametrize("case", ["T3-E8-k2-bf16-gpt_oss-transposed-bias-fp32w", "T5-E5-k1-fp16-odd-H37-I19-transposed"])
@pytest.mark.parametrize("split", [1, 3])
def test_decode_down_on_tensor_cores(poisoned, monkeypatch, case, split):
    """The down kernel's tl.dot form for [E, K, N] 16-bit weights: each expert's
    row of the padded h tile against its own weight tile (a row mixed into
    another expert's sum, or an expert's tile under another's row, shows),
    with and without the K split, odd N and K masked."""
    T, E, H, I, k, dt, act, layout, trans, bias, fmt, group, asym, twdt = EXPERT_CASES[case]
    inputs = _experts_inputs(T, E, H, I, k, DT[dt], trans=trans, bias=bias, fmt=fmt, group=group, asym=asym,
                             twdt=DT.get(twdt))
    base = decode.decode_heuristic(T, k, H, I, trans, 132, group)
    cfg = dataclasses.replace(base, BN2=16, BK2=16, split2=split, defer2=False, dot2=True, stages2=2)
    fits = []
    real = decode.dot_down_fits
    monkeypatch.setattr(decode, "dot_down_fits", lambda *a: fits.append(real(*a)) or fits[-1])
    monkeypatch.setattr(decode, "_split_counters", lambda device, tiles: torch.zeros(tiles, dtype=torch.int32))
    out, ref = _run_experts("decode", inputs, act, layout, trans, fmt, group, cfg)
    assert fits == [True]
    _assert_experts_close(out, ref)


def test_dot_down_fits_only_16_bit_transposed_weights():
    bf, f32 = torch.bfloat16, torch.float32
    assert decode.dot_down_fits(bf, bf, "none", True, 64, 64)
    assert not decode.dot_down_fits(f32, f32, "none", True, 64, 64)  # TF32 would round the products
    assert not decode.dot_down_fits(bf, torch.float16, "none", True, 64, 64)
    assert not decode.dot_down_fits(bf, bf, "none", False, 64, 64)
    assert not decode.dot_down_fits(bf, bf, "int8", True, 64, 64)
    assert not decode.dot_down_fits(bf, bf, "none", True, 8, 64)


@pytest.mark.parametrize("plan", ["decode", "sorted"])
def test_experts_shared_unused_and_outside_experts(poisoned, plan):
    """Experts chosen by several tokens (read once by the decode path), most
    experts chosen by none, ids outside [0, E) (transformers' expert-parallel
    sentinels) adding nothing, and an expert with more tokens than a block
    (BM = 16 rows: 20 tokens on expert 2)."""
    T, E = 20, 8
    ids = torch.full((T, 2), 2)
    ids[:, 1] = torch.tensor([5, 8, -1, 5, 3] * 4)
    inputs = _experts_inputs(T, E, 32, 16, 2, torch.float16, ids=ids)
    cfg = prefill.SortedConfig(BM=16, BN=16, BK=32, BN2=32, BK2=16) if plan == "sorted" else \
        decode.DecodeConfig(BM=4, BN=8, BK=32, BN2=16, BK2=16, defer=False, defer2=False)
    out, ref = _run_experts(plan, inputs, "silu", "halves", False, "none", 0, cfg)
    _assert_experts_close(out, ref)



@pytest.mark.parametrize("plan", ["decode", "sorted"])
def test_experts_kernels_keep_a_tokens_nan(poisoned, plan):
    """A token with a NaN feature comes out NaN, as eager's gpt-oss clamp keeps it (tl.minimum's default
    returned the limit: a differential program's bf16 token came out finite, -52.5..38.75)."""
    inputs = list(_experts_inputs(3, 8, 64, 32, 2, torch.float32, trans=True, bias=True))
    inputs[0][1, 5] = float("nan")
    out, ref = _run_experts(plan, inputs, "gpt_oss", "interleaved", True, "none", 0)
    assert ref[1].isnan().all() and out[1].isnan().all()
    _assert_experts_close(out[[0, 2]], ref[[0, 2]])

def test_experts_zero_tokens():
    inputs = _experts_inputs(0, 8, 32, 16, 2, torch.bfloat16)
    for plan in ("decode", "sorted"):
        out, _ = _run_experts(plan, inputs, "silu", "halves", False, "none", 0)
        assert out.shape == (0, 32)


def test_alignment_pads_every_expert_to_the_block(poisoned):
    ids = torch.tensor([[3, 1], [3, 0], [9, 3], [1, 3]], device=DEVICE)  # 9: outside the 4 experts
    a = prefill.align(ids, 4, 4)
    slots = a.sorted_slots.tolist()
    # expert 0: slot 3; expert 1: slots 1, 6; expert 3: slots 0, 2, 5, 7 -- each padded to 4 rows, in slot order
    assert slots[:12] == [3, -1, -1, -1, 1, 6, -1, -1, 0, 2, 5, 7]
    assert all(s == -1 for s in slots[12:])
    assert a.block_expert.tolist()[:3] == [0, 1, 3] and all(b == -1 for b in a.block_expert.tolist()[3:])
    assert a.expert_end.tolist() == [4, 8, 8, 12]
    assert a.pos_of_slot.tolist() == [8, 4, 9, 0, -1, 10, 5, 11]


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm missing")
@pytest.mark.parametrize("act,layout,trans,bias", [("silu", "halves", False, False),
                                                   ("gpt_oss", "interleaved", True, True)])
def test_grouped_mm_plan(poisoned, act, layout, trans, bias):
    inputs = _experts_inputs(9, 8, 64, 32, 2, torch.bfloat16, trans=trans, bias=bias)
    try:
        out, ref = _run_experts("grouped_mm", inputs, act, layout, trans, "none", 0)
    except (RuntimeError, NotImplementedError) as exc:  # a torch build without a CPU grouped_mm
        pytest.skip(f"torch._grouped_mm: {exc}")
    _assert_experts_close(out, ref)


def test_decode_tiles_of_plain_and_int4_experts():
    """The int4 chunks' tiles (one warp, rows of 1024 codes) only for int4
    (group > 0): plain bf16 experts at T = 1 once got them and ran 55x slower
    (H200, 1687 against 30.6 µs)."""
    plain = decode.decode_heuristic(1, 8, 2048, 768, False, 132, 0)
    int4 = decode.decode_heuristic(1, 8, 2048, 768, False, 132, 128)
    assert plain.defer and plain.warps == 4
    # 16-bit weights at one token: whole rows of gate / up a step (H200: 27.4 against 29.8 µs)
    rows = decode.decode_heuristic(1, 8, 2048, 768, False, 132, 0, plain16=True)
    assert (rows.BN, rows.BK, rows.defer, rows.warps) == (4, 2048, False, 4) and (rows.BN2, rows.BK2) == (
        plain.BN2, plain.BK2)
    assert rows.ahead2 and not plain.ahead2  # down's look-ahead (H200: 26.0 against 27.6 µs)
    # int4 down at one token: 4 rows of 256 codes on two warps, the whole K slice loaded before the
    # first sum (H200: 12.5-12.8 against 13.5-13.8 µs with the look-ahead's 4 x 128 on two warps);
    # the look-ahead where a slice has more tiles than whole2 holds
    assert int4.whole2 and int4.ahead2 and (int4.BN2, int4.BK2, int4.warps2) == (4, 256, 2) and not int4.ahead
    assert not decode.decode_heuristic(2, 8, 2048, 768, False, 132, 128).ahead2
    assert decode.decode_heuristic(2, 8, 2048, 768, False, 132, 0, plain16=True) == decode.decode_heuristic(
        2, 8, 2048, 768, False, 132, 0)
    assert decode.int4_chunk("int4", False, 128, int4.BK) == 16 and int4.BK // 32 >= 32 * int4.warps
    assert decode.int4_chunk("none", False, 0, 256) == 0 and decode.int4_chunk("int4", False, 7, 256) == 0


def test_plan_names():
    cuda = torch.device("cuda", 0)
    assert ex.moe_experts_plan(1, 128, 2048, 768, 8, torch.float64, device=cuda) == "reference"
    assert ex.moe_experts_plan(1, 128, 2048, 768, 8, torch.bfloat16, device="cpu") == "reference"
    assert ex.moe_experts_plan(1, 128, 2048, 768, 8, torch.bfloat16) == "decode"
    assert ex.moe_experts_plan(512, 128, 2048, 768, 8, torch.bfloat16) == "sorted"
    # eight tokens of eight experts each: the sorted path (H100: 190 µs against decode's 311)
    assert ex.moe_experts_plan(8, 128, 2048, 768, 8, torch.bfloat16) == "sorted"
    assert ex.moe_experts_plan(2, 128, 2048, 768, 8, torch.bfloat16) == "decode"


# ----------------------------------------------------------------- router ----

ROUTER_CASES = {
    # id -> (T, E, H, kind, k, renormalize, n_group, topk_group, scaling, x dtype, logits dtype, weights dtype,
    #        bias, correction bias, router weight dtype)
    "T1-E8-softmax-renorm-bf16": (1, 8, 64, "softmax", 2, True, 1, 1, 1.0, "bf16", "bf16", "bf16", False, False, None),
    "T3-E6-softmax-fp16-fp32w": (3, 6, 40, "softmax", 3, False, 1, 1, 1.0, "fp16", "fp16", "fp32", False, False, None),
    "T17-E8-softmax-fp32": (17, 8, 48, "softmax", 1, True, 1, 1, 1.0, "fp32", "fp32", "fp32", False, False, None),
    "T3-E8-topk_softmax-bias-bf16": (3, 8, 64, "topk_softmax", 4, False, 1, 1, 1.0, "bf16", "bf16", "bf16", True,
                                     False, None),
    "T17-E16-sigmoid-groups-fp32logits": (17, 16, 32, "sigmoid", 4, True, 4, 2, 2.5, "bf16", "fp32", "fp32", False,
                                          True, "fp32"),
    "T3-E12-sigmoid-nogroups-scaled": (3, 12, 32, "sigmoid", 3, False, 1, 1, 1.5, "fp16", "fp16", "fp16", False, True,
                                       None),
}
ROUTER_CONFIGS = {
    "split": lambda T: rt.RouterConfig(BT=4, BE=2, BK=16, dot=False),
    "whole": lambda T: rt.RouterConfig(BT=4, BE=32, BK=16, dot=False),
    "dot": lambda T: rt.RouterConfig(BT=16, BE=32, BK=16, dot=True),
    # the one-pass top-k (each expert's place), split and whole
    "split-rank": lambda T: rt.RouterConfig(BT=4, BE=2, BK=16, dot=False, rank=True),
    "whole-rank": lambda T: rt.RouterConfig(BT=4, BE=32, BK=16, dot=False, rank=True),
}


def _router_inputs(T, E, H, xdt, bias, cb, wdt, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(DT[xdt])
    w = (torch.randn(E, H, generator=gen) * 0.3).to(DT[wdt or xdt])
    b = torch.randn(E, generator=gen).to(DT[xdt]) if bias else None
    c = torch.randn(E, generator=gen) * 0.1 if cb else None
    return tuple(None if v is None else v.to(DEVICE) for v in (x, w, b, c))


@pytest.mark.parametrize("config", list(ROUTER_CONFIGS))
@pytest.mark.parametrize("case", list(ROUTER_CASES))
def test_router_kernel_matches_reference(poisoned, case, config):
    T, E, H, kind, k, renorm, ng, tg, sc, xdt, ldt, wdt, bias, cb, rwdt = ROUTER_CASES[case]
    x, w, b, c = _router_inputs(T, E, H, xdt, bias, cb, rwdt)
    cfg = ROUTER_CONFIGS[config](T)
    if not config.startswith("split"):
        cfg = dataclasses.replace(cfg, BE=_tiles.cdiv_pow2(E))
    assert not cfg.rank or rt.rank_fits(cfg.BT, _tiles.cdiv_pow2(E), cfg.warps)
    args = (x, w, b, c, kind, k, renorm, ng, tg, sc, DT[ldt], DT[wdt])
    tw, tid, logits = rt.router_fwd(*args, cfg=cfg)
    ref_logits = rt.moe_router_reference(*args, compute_dtype=torch.float64)[2]
    tol = TOLERANCES[DT[ldt]]
    torch.testing.assert_close(logits.double(), ref_logits.double(), atol=tol.atol, rtol=tol.rtol)
    # The selection, exactly, from the kernel's own logits.
    ref_w, ref_ids = rt.router_select_reference(logits, c, kind, k, renorm, ng, tg, sc, DT[wdt], torch.float64)
    assert torch.equal(tid, ref_ids)
    tol = TOLERANCES[DT[wdt]]
    torch.testing.assert_close(tw.double(), ref_w.double(), atol=tol.atol, rtol=tol.rtol)


@pytest.mark.parametrize("rank", [False, True])
@pytest.mark.parametrize("config", ["split", "whole"])
def test_router_kernel_ties_go_to_the_lower_index(poisoned, config, rank):
    x = torch.ones(2, 4, device=DEVICE)
    weight = torch.tensor([[0.0, 0, 0, 1], [1, 0, 0, 0], [0.25, 0.25, 0.25, 0.25], [1, 0, 0, 0], [0, 0, 0, 0],
                           [0.5, 0.5, 0, 0]], device=DEVICE)
    cfg = rt.RouterConfig(BT=2, BE=2 if config == "split" else 8, BK=4, dot=False, rank=rank)
    for kind, k, expected in (("softmax", 3, [0, 1, 2]), ("topk_softmax", 5, [0, 1, 2, 3, 5]),
                              ("sigmoid", 4, [0, 1, 2, 3])):
        _, ids, _ = rt.router_fwd(x, weight, None, None, kind, k, False, 1, 1, 1.0, torch.float32, torch.float32,
                                  cfg=cfg)
        assert ids.tolist() == [expected] * 2, kind


@pytest.mark.parametrize("layout", ["expanded", "strided"])
def test_router_kernel_reads_biases_through_their_strides(poisoned, layout):
    """A bias of stride 0 (one value expanded over the experts) or 2 (every other
    of a wider one) is read as the values it holds, not as E packed values."""
    x, w, _, _ = _router_inputs(3, 8, 32, "fp32", False, False, None)
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(16, generator=gen).to(DEVICE)
    b = wide[:1].expand(8) if layout == "expanded" else wide[::2]
    c = wide[1:2].expand(8) * 0.1 if layout == "expanded" else wide[1::2] * 0.1
    for kind, bias, cb in (("topk_softmax", b, None), ("sigmoid", None, c)):
        args = (x, w, bias, cb, kind, 3, False, 1, 1, 1.0, torch.float32, torch.float32)
        tw, tid, logits = rt.router_fwd(*args)
        ref_w, ref_ids, ref_logits = rt.moe_router_reference(*args, compute_dtype=torch.float64)
        torch.testing.assert_close(logits.double(), ref_logits.double(), atol=1e-4, rtol=1e-4)
        assert torch.equal(tid, ref_ids), kind
        torch.testing.assert_close(tw.double(), ref_w.double(), atol=1e-4, rtol=1e-4)


def test_router_kernel_zero_tokens():
    x, w, _, _ = _router_inputs(0, 8, 32, "bf16", False, False, None)
    tw, tid, logits = rt.router_fwd(x, w, None, None, "softmax", 2, True, 1, 1, 1.0, torch.bfloat16, torch.bfloat16)
    assert tw.shape == (0, 2) and tid.shape == (0, 2) and logits.shape == (0, 8)


def test_decode_kernels_compile_for_sm90_with_vector_loads():
    """The decode kernels built for an H100 without one (Triton's ptxas): no
    spills, and weights read as 16-byte vectors, not element by element
    (``python -m fusepass.bench.registry.moe --ptx``; a subprocess: the interpreter's kernels cannot be
    compiled)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError:
        pytest.skip("Triton without its NVIDIA backend")
    proc = subprocess.run([sys.executable, "-m", "fusepass.bench.registry.moe", "--ptx", "decode"], env=env,
                          cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("spill    0") >= 12, proc.stdout
    # the PDL launches: gate_up waits then releases the down kernel, which only waits
    assert "pdl wait 1 release 1" in proc.stdout and "pdl wait 1 release 0" in proc.stdout, proc.stdout


@pytest.mark.skipif(not INTERPRET, reason="the launches on CPU tensors, under the interpreter")
@pytest.mark.parametrize("plan", ["decode", "sorted", "grouped_mm"])
def test_inlined_experts_every_plan(poisoned, plan, monkeypatch):
    """The inlined form (each launch a functional graph node, buffers between
    them allocated in the graph) computes the op on every plan; the op's test
    in tests/test_ops.py takes only the plan its small cases get (decode)."""
    monkeypatch.setattr(ex, "moe_experts_plan", lambda *a, **k: plan)
    dtype = torch.bfloat16 if plan == "grouped_mm" else torch.float16
    inputs = _experts_inputs(9, 8, 64, 32, 2, dtype, bias=plan != "decode")
    args = (*inputs, "silu", "halves", False, "none", 0, 0.0, 0.0)
    try:
        out = ex.moe_experts_traced(*args)
    except (RuntimeError, NotImplementedError) as exc:  # a torch build without a CPU grouped_mm
        if plan != "grouped_mm":
            raise
        pytest.skip(f"torch._grouped_mm: {exc}")
    ref = ex.moe_experts_reference(*args, torch.float64)
    _assert_experts_close(out, ref, loose=plan == "grouped_mm")


@pytest.mark.skipif(not INTERPRET, reason="the launches on CPU tensors, under the interpreter")
@pytest.mark.parametrize("T", [3, 40])
def test_inlined_router_split_and_whole(T):
    """The router's inlined launch: split over experts with counters zeroed in the
    graph (few tokens), all experts in each program (more)."""
    x, w, b, cb = _router_inputs(T, 16, 32, "fp16", False, True, "fp32")
    args = (x, w, b, cb, "sigmoid", 4, True, 4, 2, 2.5, torch.float32, torch.float32)
    tw, tid, logits = rt.router_traced(*args)
    etw, etid, elogits = rt.moe_router_reference(*args, compute_dtype=torch.float64)
    assert torch.equal(tid, etid)
    torch.testing.assert_close(tw.double(), etw.double(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits.double(), elogits.double(), atol=1e-5, rtol=1e-5)


def test_decode_launches_take_pdl_where_measured_faster(monkeypatch):
    """The heuristic launches both decode kernels with PDL for [E, N, K]
    experts and not for gpt-oss's transposed ones (slower there, H200); the
    launch attribute is passed only where the kernel is compiled (never to the
    interpreter, which has no launch options), and never for CPU tensors."""
    from fusepass.kernels import _common

    assert decode.decode_heuristic(1, 8, 2048, 768, False, 132, 0).pdl
    assert decode.decode_heuristic(4, 8, 2048, 768, False, 132, 128).pdl
    assert not decode.decode_heuristic(1, 4, 2880, 2880, True, 132, 0).pdl
    assert not rt.router_heuristic(1, 128, 2048).release
    assert rt.router_heuristic(1, 128, 2048).pdl and not rt.router_heuristic(512, 128, 2048).pdl
    assert not _common.pdl_supported(torch.zeros(1))
    kernel = decode._moe_decode_down_kernel
    launch = _common.Launch(kernel, (1,), {**dict.fromkeys(kernel.arg_names), "PDL": True})  # (pdl: the kernel's PDL)
    monkeypatch.setattr(_common, "interpreting", lambda: True)
    assert "launch_pdl" not in launch._launch_meta()
    monkeypatch.setattr(_common, "interpreting", lambda: False)
    assert launch._launch_meta()["launch_pdl"] is True
    assert "launch_pdl" not in dataclasses.replace(launch, args={**launch.args, "PDL": False})._launch_meta()


def test_decode_heuristic_puts_transposed_16_bit_down_weights_on_the_tensor_cores():
    """gpt-oss-20b's [E, K, N] down weight: tl.dot tiles of 64 x 64, K split
    until the grid has ~2.7 programs an SM (45 column tiles a token), the
    gate_up tile summed every 512 deep; without ``dot`` the FMA loops."""
    one = decode.decode_heuristic(1, 4, 2880, 2880, True, 132, 0, dot=True)
    assert (one.dot2, one.BN2, one.BK2, one.split2, one.BK, one.defer) == (True, 64, 64, 8, 512, False)
    assert decode.decode_heuristic(4, 4, 2880, 2880, True, 132, 0, dot=True).split2 == 2
    assert decode.decode_heuristic(64, 4, 2880, 2880, True, 132, 0, dot=True).split2 == 1
    assert not decode.decode_heuristic(1, 4, 2880, 2880, True, 132, 0).dot2
    assert not decode.decode_heuristic(1, 8, 2048, 768, False, 132, 0, dot=True).dot2  # [E, N, K]: the FMA loop
