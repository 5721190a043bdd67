"""MoE ops (fusepass/kernels/moe/): ``fusepass::moe_router`` and
``fusepass::moe_experts`` against transformers' MoE blocks and against fp64
references; their Triton kernels under the interpreter at tiny shapes.

The op bodies are checked against transformers' own blocks (random weights):
bit for bit in bf16 against its ``grouped_mm`` and ``batched_mm`` experts
forms, within the dtype table against the per-expert ``eager`` loop (which
adds experts in x's dtype).
"""

from __future__ import annotations

import pytest
import torch

import fusepass.kernels.moe as moe
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
    """(block, router module, experts module, router kwargs, experts args, shared-experts fn) of a tiny transformers MoE block."""
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
        act = ("gpt_oss", "interleaved", True, "none", 0, cfg.swiglu_alpha, cfg.swiglu_limit)
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
