"""MoE blocks in real model code: random-weight ``transformers`` MoE models and
blocks compiled with fusepass under each experts implementation
(``grouped_mm``, ``batched_mm``, the per-expert ``eager`` loop through the
pre-trace path): one ``moe_router`` and one ``moe_experts`` rewrite per sparse
block, results as eager's.  The rules' forms and near-misses are checked by
``tests/test_rules.py`` (every registered rule), the ops and kernels by
``tests/test_moe_kernels.py``.

Compiles are what this file costs (2-core CPU): the blocks of five model
families share one compile per implementation; each model is compiled once
(``dynamic=True``) and serves a prefill at two lengths and a cached decode
step.
"""

from __future__ import annotations

import functools

import pytest
import torch

import fusepass
from fusepass import models
from fusepass.backend import interpreting_after_pass
from fusepass.testing import assert_close

pytest.importorskip("transformers")

FAMILIES = ("qwen3_moe", "mixtral", "olmoe", "gpt_oss", "deepseek_v3")


def _rel(a: torch.Tensor, e: torch.Tensor) -> float:
    return ((a.double() - e.double()).norm() / e.double().norm()).item()


def _block(family: str, impl: str) -> torch.nn.Module:
    """One sparse block of ``family`` (hidden 64, 8 or 16 experts), weights drawn at random."""
    import transformers as tf

    if family == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as B
        cfg = tf.Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=3,
                                norm_topk_prob=True)
    elif family == "mixtral":  # routing weights left in fp32
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as B
        cfg = tf.MixtralConfig(hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2)
    elif family == "olmoe":  # not renormalised
        from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock as B
        cfg = tf.OlmoeConfig(hidden_size=64, intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                             norm_topk_prob=False)
    elif family == "gpt_oss":  # top-k then softmax, biases, transposed and interleaved, clamped activation
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP as B
        cfg = tf.GptOssConfig(hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=4)
    else:  # sigmoid scores, correction bias, 2 of 4 groups, scaling 2.5
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE as B
        cfg = tf.DeepseekV3Config(hidden_size=64, moe_intermediate_size=32, n_routed_experts=16,
                                  num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                  n_shared_experts=1)
    cfg._experts_implementation = impl
    block = B(cfg)
    gen = torch.Generator().manual_seed(FAMILIES.index(family))
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        for b in block.buffers():
            if b.is_floating_point():
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
    return block


class Blocks(torch.nn.Module):
    """The five families' blocks side by side: one graph, one compile."""

    def __init__(self, impl: str, dtype: torch.dtype, quantize: str | None = None) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_block(f, impl) for f in FAMILIES)
        self.to(dtype)
        self.blocks[FAMILIES.index("deepseek_v3")].gate.float()  # its router stays fp32, as the model keeps it
        if quantize:
            fusepass.quantize(self, quantize, group_size=32)

    def forward(self, x):
        outs = [b(x) for b in self.blocks]
        return tuple(o[0] if isinstance(o, tuple) else o for o in outs)  # gpt-oss also returns its scores


@functools.cache
def blocks_run(impl: str, dtype: torch.dtype = torch.bfloat16, quantize: str | None = None):
    """(compiled outputs, eager outputs, report) of the five blocks on 5 tokens."""
    model = Blocks(impl, dtype, quantize).eval()
    x = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(9)).to(dtype)
    torch._dynamo.reset()
    fusepass.reset_reports()
    with torch.no_grad():
        expected = model(x)
        actual = torch.compile(model, backend="fusepass", options={"cpp.simdlen": 1})(x)
    return actual, expected, fusepass.last_report()


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm", "eager"])
def test_every_familys_block_is_one_router_and_one_experts_call(impl):
    actual, expected, report = blocks_run(impl)
    routers = [h for h in report.hits if h.rule == "moe_router"]
    experts = [h for h in report.hits if h.rule == "moe_experts"]
    assert len(routers) == len(experts) == len(FAMILIES), str(report)
    assert sorted(h.form for h in routers) == sorted(["softmax"] * 3 + ["topk_softmax", "sigmoid"])
    assert {h.form for h in experts} == {"pretrace" if impl == "eager" else impl}
    assert all(h.where.endswith(("gate", "router")) for h in routers), [h.where for h in routers]
    assert all(h.where.endswith("experts") for h in experts), [h.where for h in experts]
    assert not [r for r in report.refusals if r.rule.startswith("moe")], str(report)
    assert len(report.graphs) == 1  # the eager loop routed to the op: no graph break at nonzero
    for family, a, e in zip(FAMILIES, actual, expected):
        if impl == "eager":  # the loop adds each expert in bf16 (k roundings), the op sums in fp32
            assert_close(a, e, f"{family} {impl}")
        else:  # the op rounds where the grouped and batched forms round
            assert torch.equal(a, e), f"{family} {impl}: {(a.float() - e.float()).abs().max().item()}"


@pytest.mark.parametrize("impl", ["batched_mm", "grouped_mm"])
def test_expert_parallel_sentinel_handling_is_still_one_experts_call(impl):
    """transformers' experts under expert parallelism clamp the ids into [0, E)
    before gathering and zero the sentinels' weights (transformers 5.17's
    batched_mm clamped always): a clamp of ids is not gpt-oss's activation
    clamp.  Every family's block is still one router and one experts call, and
    equal to eager (ids are never sentinels here: the op and the masks agree)."""
    model = Blocks(impl, torch.bfloat16).eval()
    for block in model.blocks:
        block.experts._is_expert_parallel = True
    x = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    torch._dynamo.reset()
    fusepass.reset_reports()
    with torch.no_grad():
        expected = model(x)
        actual = torch.compile(model, backend="fusepass", options={"cpp.simdlen": 1})(x)
    report = fusepass.last_report()
    experts = [h for h in report.hits if h.rule == "moe_experts"]
    assert len(experts) == len(FAMILIES), str(report)
    assert not [r for r in report.refusals if r.rule.startswith("moe")], str(report)
    for family, a, e in zip(FAMILIES, actual, expected):
        assert torch.equal(a, e), f"{family} {impl}: {(a.float() - e.float()).abs().max().item()}"


@pytest.mark.parametrize("impl,fmt", [("grouped_mm", "int4"), ("batched_mm", "int8"), ("eager", "fp8")])
def test_quantized_expert_stacks_reach_the_op_packed(impl, fmt):
    """``fusepass.quantize`` stores the stacks as codes; the rule finds their
    dequantisation (gpt-oss's transposed stacks too) and hands the codes to the
    op, and the pre-trace path passes them straight."""
    actual, expected, report = blocks_run(impl, torch.bfloat16, fmt)
    experts = [h for h in report.hits if h.rule == "moe_experts"]
    form = "pretrace" if impl == "eager" else f"{impl}+{fmt}"
    assert [h.form for h in experts] == [form] * len(FAMILIES), str(report)
    assert report.count("moe_router") == len(FAMILIES)
    for family, a, e in zip(FAMILIES, actual, expected):
        # The model dequantises to bf16 before its GEMMs, the op in fp32: 5e-3 relative measured.
        assert _rel(a, e) < 2e-2, (family, _rel(a, e))


def test_quantize_converts_expert_stacks_in_place():
    block = _block("gpt_oss", "batched_mm")
    w1 = block.experts.gate_up_proj.detach().clone()
    summary = fusepass.quantize(block, "int4", group_size=32)
    assert summary.experts == ["experts"] and "experts modules" in str(summary)
    e = block.experts
    assert isinstance(e, fusepass.quantize.QuantizedExperts) and "gate_up_proj" not in dict(e.named_parameters())
    assert e.gate_up_proj_q.shape == (8, 64, 32) and e.gate_up_proj_q.dtype == torch.uint8  # [E, N, K / 2]
    assert e.gate_up_proj.shape == w1.shape  # read back in the module's own [E, K, N] layout
    assert _rel(e.gate_up_proj, w1) < 0.1  # 4-bit groups of 32
    sd = block.state_dict()
    assert "experts.gate_up_proj_q" in sd and "experts.gate_up_proj_zero" in sd


# -- models: prefill at two lengths and a cached decode step ---------------------------------------

# (model, experts implementation, dtype) -> steps run.  grouped_mm in bf16 is aten._grouped_mm, in fp32
# transformers' opaque fallback op; batched_mm is what generate runs for GPU decode.
CASES = {("qwen3_moe", "grouped_mm", torch.bfloat16): ("prefill8", "prefill20", "decode"),
         ("qwen3_moe", "batched_mm", torch.float32): ("prefill8", "decode"),
         ("qwen3_moe", "eager", torch.float32): ("prefill8",),
         ("qwen3_5_moe", "grouped_mm", torch.float32): ("prefill8", "decode"),
         ("qwen3_5_moe", "eager", torch.bfloat16): ("prefill8",)}
# Logits against eager, relative error norm: fp32 measured 1e-6; bf16 up to 1.2e-2
# (Inductor alone on the same model: 8e-3).
REL_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


@functools.cache
def runs(name: str, impl: str, dtype: torch.dtype) -> dict[str, tuple[float, fusepass.RewriteReport]]:
    """step -> (logits' relative error against eager, the report of the graphs compiled for it)."""
    model = models.build(name, dtype=dtype)
    model.set_experts_implementation(impl)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusepass", dynamic=True, options={"cpp.simdlen": 1})
    steps = CASES[name, impl, dtype]
    out: dict[str, tuple[float, fusepass.RewriteReport]] = {}
    # The graphs after the pass run by the FX interpreter: the rewrites are the same, without
    # Inductor's C++ build of each model's graphs (the five cases: 93 s with it, 70 s without).
    with torch.no_grad(), interpreting_after_pass():
        for step in [s for s in steps if s.startswith("prefill")]:
            ids = models.input_ids(model, batch=2, seq=int(step[len("prefill"):]))
            fusepass.reset_reports()
            eager, mine = model(ids, use_cache=True), compiled(ids, use_cache=True)
            out[step] = (_rel(mine.logits, eager.logits), fusepass.last_report())
        if "decode" in steps:
            step = models.input_ids(model, batch=2, seq=1, seed=7)
            fusepass.reset_reports()
            e = model(step, past_key_values=eager.past_key_values, use_cache=True).logits
            m = compiled(step, past_key_values=mine.past_key_values, use_cache=True).logits
            out["decode"] = (_rel(m, e), fusepass.last_report())
    return out


def moe_layers(name: str) -> int:
    return models._config(name, "tiny")[1].num_hidden_layers


@pytest.mark.parametrize("name,impl,dtype", list(CASES),
                         ids=[f"{n}-{i}-{str(d).split('.')[-1]}" for n, i, d in CASES])
def test_one_router_and_one_experts_call_per_moe_layer(name, impl, dtype):
    results = runs(name, impl, dtype)
    assert set(results) == set(CASES[name, impl, dtype])
    for step, (err, report) in results.items():
        assert err < REL_TOL[dtype], f"{step}: logits differ from eager by {err:.3g} relative"
        if not report.graphs:
            assert step == "prefill20"  # dynamic=True: the first prefill's graph serves it
            continue
        n = moe_layers(name)
        assert report.count("moe_router") == n and report.count("moe_experts") == n, f"{step}: {report}"
        forms = {h.form for h in report.hits if h.rule == "moe_experts"}
        want = {"eager": "pretrace", "grouped_mm": "grouped_mm" if dtype == torch.bfloat16 else
                "grouped_mm_fallback", "batched_mm": "batched_mm"}[impl]
        assert forms == {want}, f"{step}: {forms}"
        assert not [r for r in report.refusals if r.rule.startswith("moe")], f"{step}: {report}"
        assert len(report.graphs) == 1, f"{step}: {len(report.graphs)} graphs"


def test_dynamic_token_counts_share_one_graph():
    # The second prefill length reuses the first's graph: the ops take any T.
    assert len(runs("qwen3_moe", "grouped_mm", torch.bfloat16)["prefill20"][1].graphs) == 0


# -- bad input ----------------------------------------------------------------------------------------


def _compile_block(block: torch.nn.Module, x: torch.Tensor, **kw):
    torch._dynamo.reset()
    fusepass.reset_reports()
    out = torch.compile(block, backend="fusepass", options={"cpp.simdlen": 1}, **kw)(x)
    return out, fusepass.last_report()


def test_fp64_is_refused_with_its_reason():
    # (batched_mm: transformers' grouped_mm has no fp64 kernel on CPU, in eager either)
    block = _block("qwen3_moe", "batched_mm").double().eval()
    x = torch.randn(1, 5, 64, dtype=torch.float64)
    with torch.no_grad():
        out, report = _compile_block(block, x)
        expected = block(x)
    assert report.count("moe_router") == 0 and report.count("moe_experts") == 0
    reasons = report.reasons("moe_router") + report.reasons("moe_experts")
    assert any("float64" in r for r in report.reasons("moe_experts")), reasons
    assert any("float64" in r for r in report.reasons("moe_router")), reasons
    assert_close(out, expected, "fp64 block", dtype=torch.float32)  # its router's softmax runs in fp32


def test_zero_tokens():
    block = _block("qwen3_moe", "grouped_mm").eval()
    x = torch.randn(1, 0, 64)
    with torch.no_grad():
        out, report = _compile_block(block, x)
    assert out.shape == (1, 0, 64)
    # The ops take T = 0 (an empty output, no launch).
    assert report.count("moe_router") == 1 and report.count("moe_experts") == 1, str(report)


def test_top_k_larger_than_the_expert_count_fails_as_eager_does():
    block = _block("olmoe", "grouped_mm").eval()
    block.gate.top_k = 9  # of 8 experts
    x = torch.randn(1, 3, 64)
    with torch.no_grad(), pytest.raises(RuntimeError, match="selected index k out of range"):
        block(x)
    with torch.no_grad(), pytest.raises(Exception, match="k not in range"):  # Dynamo's words for it
        _compile_block(block, x)


def test_training_graph_is_refused_and_gradients_are_eagers():
    """With gradients wanted the forward graph keeps the routing and the experts'
    intermediates for the backward: both rules refuse, saying so."""
    block = _block("qwen3_moe", "grouped_mm").train()
    x = torch.randn(1, 5, 64, requires_grad=True)
    out, report = _compile_block(block, x)
    out.sum().backward()
    got = [p.grad.clone() for p in block.parameters()] + [x.grad.clone()]
    block.zero_grad()
    x.grad = None
    block(x).sum().backward()
    want = [p.grad for p in block.parameters()] + [x.grad]
    assert report.count("moe_router") == 0 and report.count("moe_experts") == 0
    assert any("backward" in r for r in report.reasons("moe_experts")), report.reasons("moe_experts")
    for g, w in zip(got, want):
        assert_close(g, w, "gradient")


def _deepseek_choice(x, weight, correction_bias, group_rank):
    """DeepSeek-V3's grouped choice (4 groups, the 2 best kept, top-4, unordered): the chosen
    experts' sigmoid scores and ids.  ``group_rank`` 0 ranks the groups by the sum of their top-2
    values, as the model does; 1 by the sum of their top-2 indices."""
    T, E = x.shape[0], weight.shape[0]
    logits = torch.nn.functional.linear(x.float(), weight.float())
    scores = logits.sigmoid()
    choice = scores + correction_bias
    group_scores = choice.view(T, 4, E // 4).topk(2, dim=-1)[group_rank].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=2, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores).scatter(1, group_idx, 1)
    mask = mask.unsqueeze(-1).expand(T, 4, E // 4).reshape(T, E)
    choice = choice.masked_fill(~mask.bool(), float("-inf"))
    ids = torch.topk(choice, k=4, dim=-1, sorted=False)[1]
    w = scores.gather(1, ids)
    return w, ids


def _router_group_score_of_indices(x, weight, correction_bias):
    """DeepSeek-V3's router with one change: the groups are ranked by the sum of their top-2
    *indices*, not values (the differential run's mutated constant)."""
    w, ids = _deepseek_choice(x, weight, correction_bias, 1)
    ids, order = ids.sort(dim=-1)  # (an order-free reader of the unordered top-k)
    return (w / (w.sum(dim=-1, keepdim=True) + 1e-20) * 2.5).gather(1, order), ids


def test_router_checked_on_more_rows_than_one_token():
    """At one token a wrong region can agree with the op on one random row by chance (here it
    did: the groups ranked by index sums picked the op's groups); the check draws about 64 rows."""
    gen = torch.Generator().manual_seed(0)
    x, w, cb = torch.randn(1, 33, generator=gen), torch.randn(16, 33, generator=gen), torch.randn(16, generator=gen)
    report = None
    with torch.no_grad():
        expected = _router_group_score_of_indices(x, w, cb)
        torch._dynamo.reset()
        fusepass.reset_reports()
        out = torch.compile(_router_group_score_of_indices, backend="fusepass", options={"rules": ["moe_router"]},
                            fullgraph=True, dynamic=False)(x, w, cb)
        report = fusepass.last_report()
    assert report.count("moe_router") == 0, str(report)
    assert any("does not compute fusepass::moe_router" in r for r in report.reasons("moe_router")), str(report)
    assert torch.equal(out[1], expected[1]) and torch.equal(out[0], expected[0])


def _experts_rounding_their_weights(x, ids, tw, w_gate_up, w_down):
    """transformers' grouped_mm experts given fp32 routing weights, which they round to x's dtype
    after the sort's gather (the differential run's mutation of the form)."""
    from fusepass.patterns.moe_experts import silu_halves

    T, H = x.shape
    k, E = ids.shape[1], w_gate_up.shape[0]
    sorted_ids, perm = torch.sort(ids.reshape(-1))
    offs = torch.cumsum(torch.histc(sorted_ids.float(), bins=E, min=0, max=E - 1), 0, dtype=torch.int32)
    gu = torch._grouped_mm(x[perm // k], w_gate_up.transpose(1, 2), offs=offs)
    y = torch._grouped_mm(silu_halves(gu), w_down.transpose(1, 2), offs=offs)
    y = y * tw.reshape(-1)[perm].to(x.dtype).unsqueeze(-1)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.shape[0])
    return y[inv].view(T, k, H).sum(dim=1)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm missing")
def test_experts_round_routing_weights_the_region_casts():
    """Routing weights cast to bf16 inside the region: the op is given them cast, so it rounds them
    and their products as the region does (given the fp32 weights it rounded neither: relative
    error about 1e-3, inside the verdict's tolerance, but 0.053 off eager on an output of -0.375)."""
    gen = torch.Generator().manual_seed(0)
    T, H, I, E, k = 64, 64, 32, 8, 2
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    tw = torch.rand(T, k, generator=gen)
    w1 = (torch.randn(E, 2 * I, H, generator=gen) * 0.2).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=gen) * 0.2).to(torch.bfloat16)
    with torch.no_grad():
        expected = _experts_rounding_their_weights(x, ids, tw, w1, w2)
        torch._dynamo.reset()
        fusepass.reset_reports()
        out = torch.compile(_experts_rounding_their_weights, backend="fusepass", options={"rules": ["moe_experts"]},
                            fullgraph=True, dynamic=False)(x, ids, tw, w1, w2)
        report = fusepass.last_report()
    assert report.count("moe_experts") == 1, str(report)
    assert torch.equal(out, expected), (out.double() - expected.double()).abs().max()


def _router_sort_order_read(x, weight, correction_bias):
    """DeepSeek-V3's router whose unordered top-k ids are sorted, the weights gathered by that
    order (order-free), and that order also read (the differential run's mutation: * 1.5)."""
    w, ids = _deepseek_choice(x, weight, correction_bias, 0)
    w = w / (w.sum(dim=-1, keepdim=True) + 1e-20) * 2.5
    ids, order = ids.sort(dim=-1)
    return w.gather(1, order), ids, order * 1.5


def test_unordered_router_whose_sort_order_is_read_is_refused():
    """The order that sorts an unordered top-k's ids is the permutation from the top-k's own
    order: read by anything but the gather of the weights it hands that order on, and the op's
    order (by descending score) is not eager's."""
    gen = torch.Generator().manual_seed(0)
    x, w, cb = torch.randn(3, 64, generator=gen), torch.randn(16, 64, generator=gen) / 8, torch.randn(16, generator=gen)
    with torch.no_grad():
        expected = _router_sort_order_read(x, w, cb)
        torch._dynamo.reset()
        fusepass.reset_reports()
        out = torch.compile(_router_sort_order_read, backend="fusepass", options={"rules": ["moe_router"]},
                            fullgraph=True, dynamic=False)(x, w, cb)
        report = fusepass.last_report()
    assert report.count("moe_router") == 0, str(report)
    assert any("reads the order of the chosen experts" in r for r in report.reasons("moe_router")), str(report)
    for o, e in zip(out, expected):
        assert torch.equal(o, e)


def test_unordered_router_reference_orders_its_choices_by_logits():
    """The sigmoid form's reference orders an unordered top-k's choices by their logits, not by
    their weights: weights one fp16 ulp apart (within the table) tie on one side only, and the
    chosen logits came out in another order, 12.4 apart (the differential run's fp16 weights)."""
    from fusepass.kernels._common import tolerance
    from fusepass.patterns.moe_router import _sorted

    logits = torch.zeros(1, 16)
    logits[0, [1, 4, 9, 12]] = torch.tensor([1.481555, 1.856410, 20.418720, 8.037155])
    inputs = (torch.zeros(1, 8), torch.zeros(16, 8), torch.zeros(16))
    eager = _sorted(torch.tensor([[0.553711, 0.587402, 0.679199, 0.679199]], dtype=torch.float16),
                    torch.tensor([[1, 4, 9, 12]]), logits, *inputs)
    fused = _sorted(torch.tensor([[0.679688, 0.679199, 0.587891, 0.553711]], dtype=torch.float16),
                    torch.tensor([[9, 12, 4, 1]]), logits, *inputs)  # by descending score, one ulp off
    assert torch.equal(fused[1], eager[1]), (fused[1], eager[1])
    tol = tolerance(torch.float16)
    torch.testing.assert_close(fused[0], eager[0], atol=tol.atol, rtol=tol.rtol)


def test_router_that_rounds_its_scores_before_choosing_is_refused():
    # Group scores rounded to bf16 before the group top-k: the op compares them
    # in fp32, so near-tied groups (rows of a router weight alike) go another
    # way.  Random probes seldom meet such ties; the rounding itself refuses.
    import torch.nn.functional as F

    def router(correction_bias, x, weight, k=4, n_group=4, topk_group=2):
        T, E = x.shape[0], weight.shape[0]
        scores = F.linear(x.float(), weight.float()).sigmoid()
        choice = scores + correction_bias
        group_scores = choice.view(T, n_group, E // n_group).topk(2, dim=-1)[0].sum(dim=-1)
        group_scores = group_scores.to(torch.bfloat16).float()  # the rounding
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores).scatter(1, group_idx, 1)
        mask = mask.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)
        ids = torch.topk(choice.masked_fill(~mask.bool(), float("-inf")), k=k, dim=-1, sorted=False)[1]
        w = scores.gather(1, ids)
        return w / (w.sum(dim=-1, keepdim=True) + 1e-20), ids

    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 33, generator=g).to(torch.bfloat16)
    weight = (torch.randn(1, 33, generator=g) + 1e-3 * torch.randn(16, 33, generator=g)).to(torch.bfloat16)
    bias = torch.zeros(16)
    torch._dynamo.reset()
    fusepass.reset_reports()
    torch.compile(router, backend="fusepass")(bias, x, weight)
    report = fusepass.last_report()
    assert report.count("moe_router") == 0
    assert any("rounds the router's scores" in r for r in report.reasons("moe_router")), str(report)


def test_differential_router_blocks_compare_one_answer_among_tied_choices():
    """A softmax saturated to [1, 0, ...] ties every expert but the first at weight 0, and
    which one a top-k takes is the implementation's (eager's CPU top-k and the op's lowest
    index chose experts with logits 330 apart in a long differential run).  The generator's
    router blocks report the chosen logits only where the weight is nonzero, in eager and
    compiled alike; a nonzero weight keeps its logit, and a NaN weight (a non-finite token)
    keeps its NaN."""
    from fusepass.patterns import moe_router as R
    from fusepass.testing import differential as diff

    w = torch.tensor([[1.0, 0.0], [0.6, 0.4], [float("nan")] * 2])
    chosen = torch.tensor([[459.0, 129.0], [1.0, 0.5], [float("nan")] * 2])
    ids, scores, weight_t = torch.tensor([[3, 1], [0, 2], [2, 3]]), torch.randn(3, 4), torch.randn(5, 4)
    _, c, i, sc, wt = R.canonical(w, chosen, ids, scores, weight_t)
    assert torch.equal(c[:2], torch.tensor([[459.0, 0.0], [1.0, 0.5]])) and c[2].isnan().all()
    # a token whose weights are NaN chose nothing in particular: its rows of what else is
    # read of the router are no answer; other tokens' rows, and tensors not per token, stay
    assert torch.equal(i, torch.tensor([[3, 1], [0, 2], [-1, -1]]))
    assert torch.equal(sc[:2], scores[:2]) and sc[2].isnan().all() and wt is weight_t

    block = diff.BlockSpec("moe_router", "form", "softmax", dtype=torch.float32, shape=(6, 16))
    program = diff.build(diff.ProgramSpec((block,), seed=3))
    step = next(s for s in program.steps if "moe_router/softmax" in s.text)
    x, weight = (program.args[i] for _, i in step.ins)
    w, c = step.fn(x * 1e4, weight)  # logits in the thousands: the softmax saturates
    assert (w == 0).any() and torch.equal(c[w == 0], torch.zeros_like(c[w == 0]))
    assert (c[w != 0] != 0).all()
    outcome = diff.run(program)
    assert not outcome.failures and outcome.report.count("moe_router") == 1, str(outcome.report)
