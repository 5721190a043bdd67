"""``fusepass::decode_attention``: a decode step's attention over its cache, and the rule that finds it."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import fusepass
from fusepass.kernels import decode_attention as da
from fusepass.patterns import decode_attention as rule
from fusepass.testing import assert_close
from fusepass.testing import differential

interpreted = pytest.mark.skipif(not differential.interpreting(), reason="the Triton kernel under the interpreter")
aten = torch.ops.aten


def _mask(B, T, L, written):
    """A static cache's boolean mask [B, 1, T, L]: slots up to ``written`` (per batch row), later rows one more."""
    w = torch.as_tensor(written).reshape(-1, 1, 1)
    m = torch.arange(L)[None, None, :] < (w + torch.arange(T)[None, :, None])
    return m.expand(B, T, L)[:, None]


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("B,H,HKV,T,L,D,DV,cfg", [
    (1, 8, 2, 1, 70, 16, 16, (16, 1, 4)),  # one split, a partial last block
    (2, 8, 2, 1, 200, 32, 32, (32, 3, 4)),  # three splits merged, blocks the mask hides
    (1, 6, 3, 3, 45, 24, 40, (16, 2, 4)),  # speculative rows, odd head dims, D_v != D
    (2, 4, 4, 2, 37, 16, 16, None),  # multi-head, the plan's choice
    (1, 64, 1, 1, 20, 16, 16, (16, 64, 4)),  # 64 rows a tile; more splits than blocks
    (1, 6, 3, 3, 45, 24, 40, (16, 1, 4, 4)),  # value columns in four programs, the last past D_v
    (2, 8, 2, 1, 200, 32, 32, (32, 3, 4, 2)),  # value columns in two programs, three splits merged
])
def test_kernel_matches_fp64_on_every_row(dtype, B, H, HKV, T, L, D, DV, cfg):
    """Every output element written (the output pool is NaN first) and within the dtype's
    tolerance of fp64, for q as a transposed view, a cache slice and a per-batch mask."""
    torch.manual_seed(L * H)
    q = torch.randn(B, T, H, D, dtype=dtype).transpose(1, 2)
    k = torch.randn(B, HKV, L + 3, D, dtype=dtype)[:, :, :L]
    v = torch.randn(B, HKV, L, DV, dtype=dtype)
    mask = _mask(B, T, L, torch.randint(1, L - T + 1, (B,)))
    da.decode_attention_fwd(torch.full_like(q, float("nan")), k, v, mask, 0.3, cfg)  # (NaN in the freed output)
    got = da.decode_attention_fwd(q, k, v, mask, 0.3, cfg)
    want = da.reference(q.double(), k.double(), v.double(), mask, 0.3)
    assert got.shape == (B, T, H, DV) and torch.isfinite(got).all()
    assert_close(got, want.to(dtype), "decode_attention", dtype=dtype)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,H,HKV,L,D,DV,cfg,slot", [
    (2, 8, 2, 200, 32, 32, (32, 3, 4), 150),  # three splits, the slot in the last; the merge
    (1, 6, 3, 45, 24, 40, (16, 1, 4, 4), 44),  # value columns in four programs, the last slot
    (1, 4, 4, 37, 16, 16, None, -5),  # a negative slot counts from the end (as index_put)
])
def test_kernel_writes_the_step_rows_then_reads_them(dtype, B, H, HKV, L, D, DV, cfg, slot):
    """The op with the write: the cache afterwards is the cache with the new rows in the slot (and
    nothing else changed), and attention reads the new rows, not the stale ones there before."""
    torch.manual_seed(L + H)
    q = torch.randn(B, 1, H, D, dtype=dtype).transpose(1, 2)
    k = torch.randn(B, HKV, L + 3, D, dtype=dtype)[:, :, :L]
    v = torch.randn(B, HKV, L, DV, dtype=dtype)
    k_new = torch.randn(B, 1, HKV, D, dtype=dtype).transpose(1, 2)  # (RoPE's output as a model permutes it)
    v_new = 4 * torch.randn(B, HKV, 1, DV, dtype=dtype)
    at = slot % L
    mask = _mask(B, 1, L, torch.full((B,), at + 1))
    want_k, want_v = k.clone(), v.clone()
    want_k[:, :, at], want_v[:, :, at] = k_new[:, :, 0], v_new[:, :, 0]
    want = da.reference(q.double(), want_k.double(), want_v.double(), mask, 0.3)
    stale = da.reference(q.double(), k.double(), v.double(), mask, 0.3)
    got = da.decode_attention_write_fwd(q, k, v, k_new, v_new, torch.tensor([slot]), mask, 0.3, cfg)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)
    assert_close(got, want.to(dtype), "decode_attention_write", dtype=dtype)
    assert (want - stale).abs().max() > 0.1  # (the stale rows would have failed)


@interpreted
def test_kernel_slot_outside_the_cache_writes_nothing_and_gives_nan():
    q, k, v = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 20, 16), torch.randn(1, 2, 20, 16)
    before = k.clone(), v.clone()
    got = da.decode_attention_write_fwd(q, k, v, torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16),
                                        torch.tensor([20]), None, 0.25)
    assert torch.isnan(got).all() and torch.equal(k, before[0]) and torch.equal(v, before[1])


def test_value_columns_cut_into_blocks_of_sixteen_or_more():
    q, kv = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 40, 32)
    for ncols in (3, 4):
        with pytest.raises(ValueError, match="value columns"):
            da.launches(q, kv[..., :16], kv, None, 0.25, torch.empty(1, 1, 4, 32), (16, 1, 4, ncols))


@interpreted
@pytest.mark.parametrize("scan_min", [1, 99])
def test_kernel_streams_or_scans_a_window_the_mask_lets_through(scan_min):
    """The mask's window [first, last) away from both ends of the splits (seven blocks: the scan's
    four-block steps end on a partial one), found by the scan or streamed whole: the same rows."""
    torch.manual_seed(scan_min)
    B, H, HKV, L, D = 2, 4, 2, 110, 16
    q, k, v = torch.randn(B, H, 1, D), torch.randn(B, HKV, L, D), torch.randn(B, HKV, L, D)
    pos = torch.arange(L)
    lo, hi = torch.tensor([37, 3]), torch.tensor([70, 109])
    mask = ((pos >= lo[:, None]) & (pos < hi[:, None]))[:, None, None, :]
    cfg = (16, 1, 4)
    da.decode_attention_fwd(torch.full_like(q, float("nan")), k, v, mask, 0.3, cfg, scan_min)
    got = da.decode_attention_fwd(q, k, v, mask, 0.3, cfg, scan_min)
    want = da.reference(q.double(), k.double(), v.double(), mask, 0.3)
    assert_close(got, want.float(), f"decode_attention scan_min {scan_min}", dtype=torch.float32)
    steps = da.launches(q, k, v, da._full_bias(q, k, mask), 0.3, torch.empty_like(got), cfg, scan_min)[0]
    assert steps[0].args["SCAN"] == (scan_min == 1)


@interpreted
def test_kernel_masks_float_per_head_and_rows_hidden_everywhere():
    """A float mask that differs per head and row (finite values added, -inf hiding), and a row the
    mask hides everywhere: 0, as PyTorch's math attention gives, never NaN."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 2, 16), torch.randn(1, 2, 50, 16), torch.randn(1, 2, 50, 16)
    bias = torch.randn(1, 4, 2, 50)
    bias[torch.rand(1, 4, 2, 50) < 0.5] = float("-inf")
    bias[0, 1, 0] = float("-inf")  # head 1, row 0: nothing to attend to
    got = da.decode_attention_fwd(q, k, v, bias, 0.25, (16, 2, 4))
    want = da.reference(q.double(), k.double(), v.double(), bias.double(), 0.25)
    assert_close(got, want.float(), "decode_attention float mask", dtype=torch.float32)
    assert torch.equal(got[0, 0, 1], torch.zeros(16))
    math = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=bias)
    finite = torch.isfinite(math.transpose(1, 2))
    assert_close(got[finite], math.transpose(1, 2)[finite], "against SDPA", dtype=torch.float32)


def test_reference_is_sdpa_with_repeated_heads():
    """The op's CPU body is SDPA on the repeated cache (bool and float masks, no mask)."""
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 8, 1, 16), torch.randn(2, 2, 30, 16), torch.randn(2, 2, 30, 16)
    for mask in (_mask(2, 1, 30, torch.tensor([5, 29])), torch.randn(2, 1, 1, 30), None):
        want = rule.search_gqa(q, k, v, mask)
        got = torch.ops.fusepass.decode_attention(q, k, v, mask, 0.25).transpose(1, 2)
        assert_close(got, want, "decode_attention reference", dtype=torch.float32)


# -- the rule, in models ---------------------------------------------------------------------------


def _llama(kv_heads, dtype, qk_norm=False):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=kv_heads, head_dim=16, max_position_embeddings=256)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**kw)) if qk_norm else LlamaForCausalLM(LlamaConfig(**kw))
    return model.to(dtype).eval()


def _decode_step(model, kernel=False, prompt=7, cache_len=40, caches_out=None):
    """(compiled logits, eager logits, report) of one cached decode step after a prompt, each on its own
    static cache filled by the same prefill (``caches_out``: a list that gets the two caches)."""
    from transformers import StaticCache

    ids = torch.randint(0, 128, (1, prompt + 1), generator=torch.Generator().manual_seed(5))
    caches = []
    for _ in range(2):
        cache = StaticCache(config=model.config, max_cache_len=cache_len)
        with torch.no_grad():
            model(input_ids=ids[:, :prompt], past_key_values=cache, use_cache=True)
        caches.append(cache)
    pos = torch.tensor([prompt])
    kw = dict(input_ids=ids[:, prompt:], position_ids=pos[None], cache_position=pos, use_cache=True)
    torch._dynamo.reset()
    fusepass.reset_reports()
    ctx = differential.triton_on_cpu(["decode_attention", "decode_attention_write"]) if kernel else torch.no_grad()
    with ctx, torch.no_grad():
        got = torch.compile(model, backend="fusepass")(past_key_values=caches[0], **kw).logits
    with torch.no_grad():
        want = model(past_key_values=caches[1], **kw).logits
    if caches_out is not None:
        caches_out += caches
    return got, want, fusepass.last_report()


def _assert_same_caches(caches, dtype, where):
    for i, (a, b) in enumerate(zip(caches[0].layers, caches[1].layers)):
        assert_close(a.keys, b.keys, f"{where}: layer {i} keys", dtype=dtype)
        assert_close(a.values, b.values, f"{where}: layer {i} values", dtype=dtype)
        assert int(a.cumulative_length) == int(b.cumulative_length)


@pytest.mark.parametrize("kv_heads,qk_norm", [(2, False), (4, False), (1, True)], ids=["gqa", "mha", "qwen3-mqa"])
def test_rule_takes_each_layers_attention_in_a_decode_step(kv_heads, qk_norm):
    """The step's cache writes go into the op ("+write"): the caches afterwards are eager's."""
    model = _llama(kv_heads, torch.float32, qk_norm)
    caches = []
    got, want, report = _decode_step(model, caches_out=caches)
    hits = [h.form for h in report.hits if h.rule == "decode_attention"]
    assert hits == [("gqa" if kv_heads < 4 else "mha") + "+write"] * 2, str(report)
    assert_close(got, want, "decode step", dtype=torch.float32)
    _assert_same_caches(caches, torch.float32, "decode step")


def _cached_attention(cache_read_elsewhere):
    class Step(torch.nn.Module):
        """A decode step's cache write and attention as transformers writes them, on buffers."""

        def __init__(self):
            super().__init__()
            self.register_buffer("k", torch.randn(1, 2, 24, 16))
            self.register_buffer("v", torch.randn(1, 2, 24, 16))

        def forward(self, q, k_new, v_new, pos, mask):
            self.k.index_copy_(2, pos, k_new)
            self.v.index_copy_(2, pos, v_new)
            o = F.scaled_dot_product_attention(q, rule.repeat_kv(self.k, 4), rule.repeat_kv(self.v, 4), attn_mask=mask)
            return o + self.k.mean() if cache_read_elsewhere else o

    return Step()


@pytest.mark.parametrize("elsewhere", [False, True], ids=["written-in-the-op", "cache-read-elsewhere"])
def test_rule_writes_the_cache_only_where_nothing_else_reads_it(elsewhere):
    step = _cached_attention(elsewhere)
    twin = copy.deepcopy(step)
    args = (torch.randn(1, 8, 1, 16), torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16), torch.tensor([6]),
            _mask(1, 1, 24, 7))
    torch._dynamo.reset()
    fusepass.reset_reports()
    with torch.no_grad():
        got = torch.compile(step, backend="fusepass")(*args)
        want = twin(*args)
    report = fusepass.last_report()
    assert [h.form for h in report.hits if h.rule == "decode_attention"] == ["gqa" if elsewhere else "gqa+write"]
    assert_close(got, want, "step", dtype=torch.float32)
    assert torch.equal(step.k, twin.k) and torch.equal(step.v, twin.v)


def test_rule_takes_grouped_sdpa_without_a_mask():
    """A first token without a cache: transformers passes SDPA no mask and the cache as stored, with
    enable_gqa (no repeat_kv in the graph): one call a layer, the replacement traced without a mask."""
    model = _llama(2, torch.float32)
    ids = torch.randint(0, 128, (1, 1))
    torch._dynamo.reset()
    fusepass.reset_reports()
    with torch.no_grad():
        got = torch.compile(model, backend="fusepass")(input_ids=ids).logits
        want = model(input_ids=ids).logits
    report = fusepass.last_report()
    assert [h.form for h in report.hits if h.rule == "decode_attention"] == ["gqa"] * 2, str(report)
    assert not report.reasons("decode_attention")
    assert_close(got, want, "first token", dtype=torch.float32)


@interpreted
def test_rule_through_the_kernel_matches_eager():
    """The compiled bf16 step with the op's CUDA body (the interpreted kernel) against the fp32 model."""
    model = _llama(2, torch.bfloat16)
    caches = []
    got, _, report = _decode_step(model, kernel=True, caches_out=caches)
    assert [h.form for h in report.hits if h.rule == "decode_attention"] == ["gqa+write"] * 2
    _, want, _ = _decode_step(copy.deepcopy(model).float())
    assert_close(got, want.bfloat16(), "decode step (Triton)", dtype=torch.bfloat16)
    _assert_same_caches(caches, torch.bfloat16, "decode step (Triton)")


def test_rule_leaves_a_prefill_to_sdpa():
    """A prompt's rows (more than a tile a key/value head) stay SDPA's, without a line."""
    from transformers import StaticCache

    model = _llama(2, torch.float32)
    cache = StaticCache(config=model.config, max_cache_len=80)
    torch._dynamo.reset()
    fusepass.reset_reports()
    ids = torch.randint(0, 128, (1, 40))
    with torch.no_grad():
        got = torch.compile(model, backend="fusepass")(input_ids=ids, past_key_values=cache, use_cache=True).logits
        want = model(input_ids=ids, use_cache=False).logits
    report = fusepass.last_report()
    assert report.count("decode_attention") == 0 and not report.reasons("decode_attention")
    assert_close(got, want, "prefill", dtype=torch.float32)


# -- the finder on SDPA's CUDA ops (traced here as CPU graphs, the op swapped in) -----------------


def _graph_with(target):
    """A traced decode attention whose SDPA node is ``target`` with its schema's arguments."""
    q, k, v = torch.randn(1, 8, 1, 16), torch.randn(1, 2, 30, 16), torch.randn(1, 2, 30, 16)
    mask = torch.zeros(1, 1, 1, 30)
    gm = torch.fx.experimental.proxy_tensor.make_fx(lambda *a: rule.search_gqa(*a))(q, k, v, mask)
    gm = torch.fx.experimental.proxy_tensor.make_fx(gm, decomposition_table={})(q, k, v, mask)
    node = next(n for n in gm.graph.nodes if n.op == "call_function" and "scaled_dot_product" in str(n.target))
    qn, kn, vn = node.args[:3]
    bias = node.kwargs.get("attn_mask")
    if target is aten._scaled_dot_product_flash_attention.default:
        node.args, node.kwargs = (qn, kn, vn), {"scale": 0.2}
    elif target is aten._scaled_dot_product_cudnn_attention.default:
        node.args, node.kwargs = (qn, kn, vn, bias, False, 0.0, False, False), {"scale": 0.2}
    else:
        node.args, node.kwargs = (qn, kn, vn, bias, True), {"scale": 0.2}
    node.target = target
    return gm, node


@pytest.mark.parametrize("target", [aten._scaled_dot_product_efficient_attention.default,
                                    aten._scaled_dot_product_cudnn_attention.default,
                                    aten._scaled_dot_product_flash_attention.default],
                         ids=["efficient", "cudnn", "flash"])
def test_finder_reads_each_sdpa_ops_arguments(target):
    gm, node = _graph_with(target)
    (region,) = list(rule.find(gm))
    assert region.reason is None and region.form == "gqa"
    q, k, v = region.args[:3]
    assert [tuple(rule.val(a).shape) for a in (q, k, v)] == [(1, 8, 1, 16), (1, 2, 30, 16), (1, 2, 30, 16)]
    has_mask = target is not aten._scaled_dot_product_flash_attention.default
    assert len(region.args) == 3 + has_mask
    if target is aten._scaled_dot_product_cudnn_attention.default:
        node.args = (*node.args[:6], True, *node.args[7:])
    else:
        node.kwargs = {**node.kwargs, "is_causal": True}
    assert not list(rule.find(gm))  # (a prompt's: no line)


def test_finder_refuses_dropout_and_a_read_log_sum_exp():
    gm, node = _graph_with(aten._scaled_dot_product_efficient_attention.default)
    node.args = (*node.args[:5], 0.1)
    (region,) = list(rule.find(gm))
    assert region.reason == "dropout"
    gm, node = _graph_with(aten._scaled_dot_product_efficient_attention.default)
    with gm.graph.inserting_after(node):
        lse = gm.graph.call_function(__import__("operator").getitem, (node, 1))
    with gm.graph.inserting_after(lse):
        gm.graph.call_function(aten.sum.default, (lse,))
    (region,) = list(rule.find(gm))
    assert "log-sum-exp" in region.reason


def _scaled(q, k, v, mask):
    return rule.search_gqa(q, k, v, mask) * 2


def test_training_graph_is_refused_and_backward_runs():
    """With inputs that need grad, the forward's log-sum-exp is saved for the backward: refused, the
    reason in the report, gradients as eager's."""
    torch.manual_seed(2)
    args = [torch.randn(1, 8, 1, 16), torch.randn(1, 2, 30, 16), torch.randn(1, 2, 30, 16)]
    mask = _mask(1, 1, 30, 21)
    torch._dynamo.reset()
    fusepass.reset_reports()
    leaves = [a.clone().requires_grad_() for a in args]
    torch.compile(_scaled, backend="fusepass")(*leaves, mask).sum().backward()
    report = fusepass.last_report()
    assert report.count("decode_attention") == 0
    assert any("log-sum-exp" in r for r in report.reasons("decode_attention"))
    eager = [a.clone().requires_grad_() for a in args]
    _scaled(*eager, mask).sum().backward()
    for got, want in zip(leaves, eager):
        assert_close(got.grad, want.grad, "gradient", dtype=torch.float32)


def test_symbolic_sizes_are_left_to_sdpa():
    """dynamic=True makes every size symbolic (a cache's too): the kernel's tile needs them as numbers,
    so SDPA keeps the call, without a line; the answer is eager's for two batch sizes."""
    for B in (2, 3):
        torch.manual_seed(B)
        args = [torch.randn(B, 8, 1, 16), torch.randn(B, 2, 30, 16), torch.randn(B, 2, 30, 16), _mask(B, 1, 30, 20)]
        torch._dynamo.reset()
        fusepass.reset_reports()
        got = torch.compile(_scaled, backend="fusepass", dynamic=True)(*args)
        report = fusepass.last_report()
        assert report.count("decode_attention") == 0 and not report.reasons("decode_attention")
        assert_close(got, _scaled(*args), "dynamic", dtype=torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("H,HKV,D,L", [(32, 8, 128, 4096), (32, 4, 128, 256), (16, 2, 256, 3000), (64, 8, 64, 777)])
def test_kernel_real_sizes_gpu(H, HKV, D, L):
    """Models' head shapes over static caches of real lengths, half written, batch 1 and 8."""
    for B in (1, 8):
        torch.manual_seed(B)
        q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k = torch.randn(B, HKV, L, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(B, HKV, L, D, device="cuda", dtype=torch.bfloat16)
        mask = _mask(B, 1, L, torch.randint(1, L, (B,))).cuda()
        got = torch.ops.fusepass.decode_attention(q, k, v, mask, D ** -0.5)
        want = da.reference(q.double(), k.double(), v.double(), mask, D ** -0.5)
        assert_close(got, want.bfloat16(), f"decode_attention B{B} H{H}/{HKV} L{L}", dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("H,HKV,D,L", [(32, 8, 128, 4096), (32, 4, 128, 256), (16, 2, 256, 3000), (64, 8, 64, 777)])
def test_kernel_writes_real_sizes_gpu(H, HKV, D, L):
    """The op with the step's cache write at models' head shapes: the slot half way (batch 1) and the last
    slot (batch 8); attention reads the new rows (the stale ones differ by far more than the tolerance)."""
    for B, slot in ((1, L // 2), (8, L - 1)):
        torch.manual_seed(B)
        q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k = torch.randn(B, HKV, L, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(B, HKV, L, D, device="cuda", dtype=torch.bfloat16)
        kn = 3 * torch.randn(B, 1, HKV, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        vn = 8 * torch.randn(B, HKV, 1, D, device="cuda", dtype=torch.bfloat16)
        mask = _mask(B, 1, L, torch.full((B,), slot + 1)).cuda()
        want_k, want_v = k.clone(), v.clone()
        want_k[:, :, slot], want_v[:, :, slot] = kn[:, :, 0], vn[:, :, 0]
        got = torch.ops.fusepass.decode_attention_write(q, k, v, kn, vn, torch.tensor([slot], device="cuda"), mask,
                                                        D ** -0.5)
        assert torch.equal(k, want_k) and torch.equal(v, want_v)
        want = da.reference(q.double(), want_k.double(), want_v.double(), mask, D ** -0.5)
        assert_close(got, want.bfloat16(), f"decode_attention_write B{B} H{H}/{HKV} L{L}", dtype=torch.bfloat16)
