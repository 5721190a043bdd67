"""The backend: registration, options, modes, chaining, caching, the report."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

import fusepass
from fusepass.testing import assert_close, compile_and_run


def hf_norm(x, w):
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return w * h.to(x.dtype)


def inputs(dtype=torch.float32, rows=6, hidden=32):
    return torch.randn(rows, hidden, dtype=dtype), torch.randn(hidden, dtype=dtype)


def test_backend_resolves_by_name_without_import():
    code = textwrap.dedent("""
        import sys, torch
        def f(x, w):
            h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
            return w * h
        out = torch.compile(f, backend="fusepass")(torch.randn(4, 16), torch.randn(16))
        assert "fusepass" in sys.modules
        print(sys.modules["fusepass"].last_report().count("rms_norm"))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "1"


def test_options_select_rules():
    x, w = inputs()
    _, report = compile_and_run(hf_norm, (x, w), disable_rules=["rms_norm"])
    assert report.count("rms_norm") == 0
    _, report = compile_and_run(hf_norm, (x, w), rules=["rms_norm"])
    assert report.count("rms_norm") == 1


def test_unknown_option_values_fail_clearly():
    x, w = inputs()
    with pytest.raises(Exception, match="unknown rule"):
        compile_and_run(hf_norm, (x, w), rules=["no_such_rule"])
    with pytest.raises(Exception, match="unknown fusepass option 'not_an_inductor_option'.*Inductor config"):
        compile_and_run(hf_norm, (x, w), not_an_inductor_option=True)


@pytest.mark.parametrize("options,message", [
    ({"verfy": True}, "unknown fusepass option 'verfy'; did you mean 'verify'\\? fusepass options: rules, "
                      "disable_rules, verify, .*; other keys must be Inductor config options"),
    ({"epilogue_fusoin": False}, "unknown fusepass option 'epilogue_fusoin'; did you mean 'epilogue_fusion'"),
    ({"rules": ["rms_nrom"]}, "unknown rule\\(s\\) \\['rms_nrom'\\]; did you mean 'rms_norm'"),
    ({"verify": "yes"}, "'verify' takes a bool"),
])
def test_bad_options_fail_before_dynamo_traces(options, message):
    """torch.compile gives a string backend its options only with the first
    graph; fusepass checks them at Dynamo's start of compile instead, so the
    error is fusepass's own, raised before any tracing, never a silent eager run."""
    from fusepass.backend import fusepass_backend
    from fusepass.options import OptionError, arm

    torch._dynamo.reset()
    arm(fusepass_backend)  # as importing the backend does in a fresh process (reset removed it)
    traced = []
    with pytest.raises(OptionError, match=message) as info:
        torch.compile(lambda x: traced.append(1) or x * 2, backend="fusepass", options=options)(torch.randn(3))
    assert isinstance(info.value, ValueError)
    assert not traced  # the frame did not run eagerly either (the append would show)


@pytest.mark.parametrize("mode,key", [("max-autotune", "max_autotune"), ("reduce-overhead", "triton.cudagraphs")])
def test_mode_maps_to_inductor_options(monkeypatch, mode, key):
    import torch._inductor.compile_fx as cfx

    seen = {}
    real = cfx.compile_fx

    def spy(gm, example_inputs, **kwargs):
        seen.update(kwargs.get("config_patches") or {})
        return real(gm, example_inputs, **kwargs)

    monkeypatch.setattr(cfx, "compile_fx", spy)
    from fusepass.backend import fusepass_backend

    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    fusepass_backend(gm, [torch.randn(3)], mode=mode)
    assert seen.get(key) is True


@pytest.mark.parametrize("mode,options,env,inline", [
    (None, None, None, True),  # no CUDA graphs: kernels inlined
    ("reduce-overhead", None, None, False),  # CUDA graphs: ops called (their host time is paid at capture)
    (None, {"triton.cudagraphs": True}, None, False),
    (None, {"triton.cudagraphs": True, "inline_kernels": True}, None, True),  # an explicit choice wins
    (None, {"inline_kernels": False}, None, False),
    ("reduce-overhead", None, "1", True),
    (None, None, "0", False),
])
def test_inline_kernels_default_follows_cuda_graphs(monkeypatch, mode, options, env, inline):
    import fusepass.backend as backend

    seen = []
    real = backend._compile

    def spy(gm, example_inputs, opts, *args):
        seen.append(opts.inline_kernels)
        return real(gm, example_inputs, opts, *args)

    monkeypatch.setattr(backend, "_compile", spy)
    if env is None:
        monkeypatch.delenv("FUSEPASS_INLINE_KERNELS", raising=False)
    else:
        monkeypatch.setenv("FUSEPASS_INLINE_KERNELS", env)
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    x = torch.randn(3)
    assert_close(backend.fusepass_backend(gm, [x], mode=mode, options=options)(x), x + 1)
    assert seen == [inline]


@pytest.mark.parametrize("options,first", [
    (None, {"combo_kernels": True}),  # fusepass's default for graphs on CUDA
    ({"combo_kernels": False}, {"combo_kernels": False}),  # the user's setting wins, and is never retried without
])
def test_cuda_inductor_defaults_and_their_retry(monkeypatch, options, first):
    """On CUDA fusepass compiles with its Inductor defaults (combo kernels) unless
    the options set them; a compile that fails with them is compiled once more
    without them (after the retry without inlining), and the report says so.
    The compile itself is stubbed: this machine may have no GPU."""
    import fusepass.backend as backend

    seen = []

    def stub(gm, example_inputs, opts, patches, *args):
        seen.append((opts.inline_kernels, {k: patches[k] for k in patches if k == "combo_kernels"}))
        if patches.get("combo_kernels"):
            raise RuntimeError("injected: a combo kernel failed to compile")
        return gm, fusepass.report.GraphReport(graph_id="g")

    monkeypatch.setattr(backend, "_compile", stub)
    monkeypatch.setattr(backend, "_on_cuda", lambda inputs: True)
    monkeypatch.delenv("FUSEPASS_INLINE_KERNELS", raising=False)
    fusepass.reset_reports()
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    backend.fusepass_backend(gm, [torch.randn(3)], options=options)
    assert seen[0] == (True, first)
    if first["combo_kernels"]:
        assert seen == [(True, first), (False, first), (False, {})]
        notes = fusepass.last_report().graphs[0].notes
        assert any("without fusepass's Inductor settings" in n for n in notes), notes
    else:
        assert seen == [(True, first)]
    chose = [n for n in fusepass.last_report().graphs[0].notes if "Inductor settings fusepass chose" in n]
    assert not chose  # (compiled without them, or the user's own setting)
    seen.clear()
    monkeypatch.setattr(backend, "_compile", lambda gm, inputs, opts, patches, *a: (
        seen.append((opts.inline_kernels, {k: patches[k] for k in patches if k == "combo_kernels"})),
        (gm, fusepass.report.GraphReport(graph_id="g")))[1])
    fusepass.reset_reports()
    backend.fusepass_backend(gm, [torch.randn(3)], options=options)
    assert seen == [(True, first)]
    notes = fusepass.last_report().graphs[0].notes
    assert any("Inductor settings fusepass chose on CUDA (static shapes): combo_kernels=True" in n for n in notes) == \
        (options is None), notes  # the report says what fusepass set, not what the user did
    seen.clear()
    # symbolic sizes (dynamic=True): Inductor's own defaults, the settings were measured on static graphs
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        sym = mode.shape_env.create_unbacked_symint()
    assert backend._symbolic([sym, torch.randn(3)]) and not backend._symbolic([torch.randn(3)])
    backend.fusepass_backend(gm, [sym, torch.randn(3)])
    assert seen == [(True, {})]
    seen.clear()
    monkeypatch.setattr(backend, "_on_cuda", lambda inputs: False)  # on the CPU: Inductor's own defaults
    backend.fusepass_backend(gm, [torch.randn(3)])
    assert seen == [(True, {})]


@pytest.mark.parametrize("env,parsed", [(None, None), ("", None), ("0", False), ("1", True)])
def test_inline_kernels_option_parses_three_ways(monkeypatch, env, parsed):
    from fusepass.options import Options

    if env is None:
        monkeypatch.delenv("FUSEPASS_INLINE_KERNELS", raising=False)
    else:
        monkeypatch.setenv("FUSEPASS_INLINE_KERNELS", env)
    assert Options.parse({})[0].inline_kernels is parsed
    assert Options.parse({"inline_kernels": True})[0].inline_kernels is True
    with pytest.raises(TypeError, match="'inline_kernels' takes a bool"):
        Options.parse({"inline_kernels": "no"})


def test_chains_a_user_pass():
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class Count(CustomGraphPass):
        calls = 0

        def __call__(self, graph):
            Count.calls += 1

        def uuid(self):
            return "count-pass"

    x, w = inputs()
    with torch._inductor.config.patch(post_grad_custom_pre_pass=Count(), fx_graph_cache=False):
        _, report = compile_and_run(hf_norm, (x, w))
    assert Count.calls == 1
    assert report.count("rms_norm") == 1


@pytest.mark.parametrize("aot_cache", [True, False], ids=["aot-autograd-cache", "fx-graph-cache-only"])
def test_warm_cache_report_tells_the_truth(tmp_path, monkeypatch, aot_cache):
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    x, w = inputs(rows=5, hidden=24)
    with torch._inductor.config.patch(fx_graph_cache=True), \
            torch._functorch.config.patch(enable_autograd_cache=aot_cache):
        cold_out, cold = compile_and_run(hf_norm, (x, w))
        counters.clear()
        warm_out, warm = compile_and_run(hf_norm, (x, w))
        # The cache under test served the warm compile (AOTAutograd's skips
        # Inductor altogether; without it Inductor's FX graph cache does).
        if aot_cache:
            assert counters["aot_autograd"]["autograd_cache_hit"] == 1
        else:
            assert counters["inductor"]["fxgraph_cache_hit"] == 1
        assert cold.graphs[0].cache == "miss" and warm.graphs[0].cache == "hit"
        assert warm.count("rms_norm") == cold.count("rms_norm") == 1
        assert [h.where for h in warm.hits] == [h.where for h in cold.hits]
        assert "from the compile cache" in str(warm)
        # Other fusepass options give another cache key: the pass runs again.
        _, other = compile_and_run(hf_norm, (x, w), verify=True)
        assert other.graphs[0].cache == "miss"
    torch.testing.assert_close(warm_out, cold_out, rtol=0, atol=0)


def test_a_cache_hit_from_another_graph_still_lists_the_rewrite(tmp_path, monkeypatch):
    """Inductor's FX graph cache keys the graph after AOTAutograd: two Dynamo
    graphs that differ by a no-op (``.float()`` of an fp32 tensor) share an
    entry, so the second compile runs no pass on code the first one made."""
    from torch._dynamo.utils import counters

    def no_upcast(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    x, w = inputs(rows=3, hidden=40)
    with torch._inductor.config.patch(fx_graph_cache=True):
        _, first = compile_and_run(hf_norm, (x, w))
        counters.clear()
        _, second = compile_and_run(no_upcast, (x, w))
    assert counters["inductor"]["fxgraph_cache_hit"] == 1, "the two graphs no longer share a cache entry"
    assert second.graphs[0].cache == "hit" and second.count("rms_norm") == first.count("rms_norm") == 1
    # The next start of the second graph is served by AOTAutograd's cache,
    # which skips Inductor: the record must be under the second graph's own key.
    with torch._inductor.config.patch(fx_graph_cache=True), \
            torch._functorch.config.patch(enable_autograd_cache=True):
        counters.clear()
        _, third = compile_and_run(no_upcast, (x, w))
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1
    assert third.graphs[0].cache == "hit" and third.count("rms_norm") == 1, str(third)


def test_warm_cache_without_the_record_says_so(tmp_path, monkeypatch):
    import shutil

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    x, w = inputs(rows=7, hidden=24)
    with torch._inductor.config.patch(fx_graph_cache=True):
        compile_and_run(hf_norm, (x, w))
        shutil.rmtree(tmp_path / "fusepass")
        _, warm = compile_and_run(hf_norm, (x, w))
    assert warm.graphs[0].cache == "hit" and warm.count("rms_norm") == 0
    assert any("record of it is missing" in n for n in warm.graphs[0].notes)


_WARM_START_CHILD = textwrap.dedent("""
    import json, time, torch
    import torch.nn.functional as F
    from torch._dynamo.utils import counters

    class Block(torch.nn.Module):  # a decoder layer's norm and MLP, HF-style
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.Parameter(torch.randn(32))
            self.gate, self.up = torch.nn.Linear(32, 64), torch.nn.Linear(32, 64)

        def forward(self, x):
            h = x.float()
            h = self.norm * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
            return F.silu(self.gate(h)) * self.up(h)

    torch.manual_seed(0)
    model = Block()
    t0 = time.perf_counter()
    with torch.no_grad():
        torch.compile(model, backend="fusepass")(torch.randn(4, 32))
    import fusepass  # imported by the backend's entry point above, not before
    report = fusepass.last_report()
    print(json.dumps({
        "seconds": time.perf_counter() - t0,
        "cache": [g.cache for g in report.graphs],
        "hits": sorted((h.rule, h.where) for h in report.hits),
        "aot_hits": counters["aot_autograd"]["autograd_cache_hit"],
        "text": str(report),
    }))
""")


def test_warm_start_in_a_fresh_process_restores_the_report(tmp_path):
    """A second process with the same cache dir loads the compiled code from
    AOTAutograd's cache (no Inductor compile, no pass) and still lists every
    rewrite the cold compile made."""
    import os

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", _WARM_START_CHILD], capture_output=True, text=True,
                             timeout=300, env=env)
        assert out.returncode == 0, out.stderr[-2000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold["cache"] == ["miss"] and cold["aot_hits"] == 0
    assert warm["cache"] == ["hit"] and warm["aot_hits"] == 1
    # (four rows: gate and up also become one launch)
    assert {rule for rule, _ in cold["hits"]} == {"rms_norm", "swiglu", "linear_siblings"}
    assert warm["hits"] == cold["hits"]
    assert "from the compile cache" in warm["text"]


def test_report_renders_and_exports():
    x = torch.randn(8, 8)
    w = torch.randn(8)

    def two(x, w):
        h = x.float()
        var = h.pow(2).mean(-1, keepdim=True)
        return hf_norm(x, w), w * (h * torch.rsqrt(var + 1e-5)), var

    _, report = compile_and_run(two, (x, w))
    text = str(report)
    assert "rms_norm" in text and "refused" in text and "also used outside" in text
    data = json.loads(report.to_json())
    hits = [h for g in data["graphs"] for h in g["hits"]]
    assert len(hits) == 1 and hits[0]["rule"] == "rms_norm"
    assert hits[0]["bytes_moved"] == 2 * x.nbytes + w.nbytes  # x, w read; y written
    assert data["graphs"][0]["attempts"]["rms_norm"] == 2


def test_dump_graphs(tmp_path):
    x, w = inputs()
    compile_and_run(hf_norm, (x, w))  # warm Inductor's cache: dumping must still run the pass
    compile_and_run(hf_norm, (x, w), dump_graphs=str(tmp_path))
    before = list(tmp_path.glob("*.before.txt"))
    after = list(tmp_path.glob("*.after.txt"))
    assert before and after
    assert "rsqrt" in before[0].read_text()
    assert "fusepass.rms_norm" in after[0].read_text() and "rsqrt" not in after[0].read_text()


def test_verify_mode_accepts_correct_rewrites():
    x, w = inputs(torch.bfloat16)
    out, report = compile_and_run(hf_norm, (x, w), verify=True)
    assert report.count("rms_norm") == 1
    assert_close(out, hf_norm(x, w))


def test_dynamic_shapes_keep_the_rewrite_without_recompiling():
    torch._dynamo.reset()
    fusepass.reset_reports()
    f = torch.compile(hf_norm, backend="fusepass", dynamic=True)
    w = torch.randn(32)
    for rows in (3, 5, 9):
        x = torch.randn(2, rows, 32)
        assert_close(f(x, w), hf_norm(x, w))
    report = fusepass.last_report()
    assert len(report.graphs) == 1  # one graph for every length
    assert report.count("rms_norm") == 1


class _Norm(torch.nn.Module):
    """An HF-style RMSNorm with its eps in a module attribute."""

    def __init__(self, hidden):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(hidden))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(x.dtype)


def test_dynamic_eps_in_a_module_attribute_is_read_at_run_time():
    """With dynamic=True the eps attribute is a graph input, not a constant:
    still rewritten, one graph for every length, and a new eps is used
    without a recompile (Dynamo does not guard on it); verify mode accepts it."""
    torch._dynamo.reset()
    fusepass.reset_reports()
    norm = _Norm(32)
    f = torch.compile(norm, backend="fusepass", dynamic=True, options={"verify": True})
    with torch.no_grad():
        for rows, eps in ((3, 1e-6), (9, 1e-6), (5, 0.5)):
            norm.variance_epsilon = eps
            x = torch.randn(rows, 32)
            assert_close(f(x), norm(x), f"rows={rows} eps={eps}")
    report = fusepass.last_report()
    assert len(report.graphs) == 1, str(report)
    assert report.count("rms_norm") == 1 and not report.reasons("rms_norm"), str(report)


def test_training_graphs_are_left_to_inductor_with_the_reason():
    torch._dynamo.reset()
    fusepass.reset_reports()
    x = torch.randn(4, 16, requires_grad=True)
    w = torch.randn(16, requires_grad=True)
    out = torch.compile(hf_norm, backend="fusepass")(x, w)
    out.sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    hf_norm(x, w).sum().backward()
    assert_close(gx, x.grad)
    assert_close(gw, w.grad)
    report = fusepass.last_report()
    assert report.count("rms_norm") == 0
    assert any("saved for backward" in r for r in report.reasons("rms_norm"))
