"""``fusepass bench``: the CPU quick runs CI makes, and what they write."""

import csv
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

try:
    import matplotlib  # noqa: F401

    HAS_MPL = True
except ImportError:
    HAS_MPL = False


def fusepass_cli(capsys, *args):
    """``fusepass <args>`` in this process: Inductor's one-time start-up (~10 s on
    2 cores) is paid once for the suite, not once per command."""
    import torch

    from fusepass.cli import main

    threads = torch.get_num_threads()
    try:
        code = main(list(args))
    finally:
        torch.set_num_threads(threads)  # CPU runs pin one thread
    out = capsys.readouterr()
    assert code == 0, f"exit {code}\n{out.out[-3000:]}\n{out.err[-3000:]}"
    return out


def is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_quick_checks_and_times_every_registry_entry(tmp_path, capsys):
    from fusepass.bench.ops import entry_names

    out = fusepass_cli(capsys, "bench", "--quick", "--out", str(tmp_path))
    data = json.loads((tmp_path / "results.json").read_text())
    rows = data["rows"]
    entries = entry_names()  # the package's registry: no checkout needed
    assert {"rms_norm", "add_rms_norm", "swiglu", "geglu"} <= set(entries)
    assert {r["op"] for r in rows} == set(entries), "an entry wrote no rows"
    assert data["copy_gbps"] > 0 and data["env"]["torch"] and data["env"]["commit"]
    for r in rows:
        assert r.get("ok") is True, f"{r['op']} {r['shape']} {r['provider']}: {r.get('error')}"
        assert r["plain_us"] > 0 and r["plain_p20_us"] <= r["plain_us"] <= r["plain_p80_us"]
        assert r["gbps"] > 0 and r["pct_copy"] > 0
        assert r["rel_err"] <= r["tolerance"]
        assert r["device"] == data["env"]["device"] and r["commit"] == data["env"]["commit"]
    for op in ("rms_norm", "swiglu"):
        providers = {r["provider"] for r in rows if r["op"] == op}
        assert {"eager", "inductor", "fusepass", "fusepass-compiled"} <= providers
    inductor = [r for r in rows if r["provider"] == "inductor"]
    assert inductor and all(r["vs_inductor"] == 1.0 for r in inductor)
    # A CPU run says what its figures are, and names no GPU library it did not run.
    assert not any("cublas" in r["provider"] or "cuda" in r["provider"] for r in rows)
    assert "not a speed claim" in out.out and "not a speed claim" in (tmp_path / "table.txt").read_text()

    with (tmp_path / "results.csv").open() as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    table = (tmp_path / "table.txt").read_text()
    assert "vs inductor" in table and all(op in table for op in entries)
    assert table.strip().splitlines()[-1] in out.out  # the table is printed last
    if HAS_MPL:
        plots = {p.name for p in tmp_path.glob("*.png")}
        assert {f"bandwidth_{op}.png" for op in entries} | {"speedup.png"} <= plots
        assert all(is_png(tmp_path / p) for p in plots)
        # A run made where matplotlib was missing gets its plots afterwards, from the JSON.
        for p in tmp_path.glob("*.png"):
            p.unlink()
        fusepass_cli(capsys, "bench", "plot", "--out", str(tmp_path))
        assert {p.name for p in tmp_path.glob("*.png")} == plots
    else:
        assert "plots skipped" in out.out


def test_bench_runs_a_registry_folder_of_ones_own(tmp_path, capsys):
    """--registry: entries outside the package, importing Case from it; outputs in the folder asked."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "double.py").write_text(textwrap.dedent("""
        import torch
        from fusepass.bench.registry.common import Case

        def cases(quick=False, device="cuda"):
            x = torch.randn(64, 64, device=device)
            return [Case(op="double", shape="64x64", dtype=torch.float32, make_inputs=lambda: (x,),
                         reference=lambda x: 2 * x, providers={"eager": lambda x: x + x},
                         bytes_moved=2 * x.nbytes)]
    """))
    fusepass_cli(capsys, "bench", "--quick", "--registry", str(folder), "--out", str(tmp_path / "out"))
    rows = json.loads((tmp_path / "out" / "results.json").read_text())["rows"]
    assert [(r["op"], r["provider"], r["ok"]) for r in rows] == [("double", "eager", True)]


def test_outputs_go_outside_the_checkout_by_default():
    import tempfile

    from fusepass.bench.output import default_out
    from fusepass.cli import parser

    for argv in (["bench", "ops"], ["bench", "e2e"]):
        assert parser().parse_args(argv).out is None  # then default_out(...)
    out = Path(default_out("e2e"))
    assert out.is_relative_to(Path(tempfile.gettempdir()) / "fusepass-bench")
    assert not out.is_relative_to(Path(__file__).resolve().parent.parent)


def test_every_command_says_what_it_does(capsys):
    from fusepass.cli import main

    for argv in ([], ["demo"], ["rules"], ["tune"], ["bench"], ["bench", "ops"], ["bench", "e2e"], ["bench", "plot"]):
        with pytest.raises(SystemExit) as info:
            main([*argv, "--help"])
        assert info.value.code == 0
        text = capsys.readouterr().out
        assert "The ``fusepass`` command" not in text and "``" not in text  # plain text, not markup
        described = text.split("\n\n")[1]  # argparse: usage, blank line, description
        assert len(described.split()) >= 8 and not described.lstrip().startswith(("positional", "options")), text


def test_commands_refuse_int4_group_sizes_the_kernels_lack(capsys):
    """Refused while parsing, naming the sizes there are: before a model is built or a layer converted."""
    from fusepass.cli import main
    from fusepass.formats import GROUP_SIZES

    for argv in (["demo", "--quantize", "int4", "--group-size", "48"], ["tune", "--group-size", "16"],
                 ["bench", "e2e", "--quantize", "int4", "--group-size", "16"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert "--group-size" in err and ", ".join(map(str, GROUP_SIZES)) in err, err


def test_readme_demo_at_tiny_size_checks_shows_steps_and_prints_no_library_noise(tmp_path):
    """README's demo command (the MoE hybrid, int8, one token a sequence) at tiny size, as a user runs it:
    a fresh process, so what reaches stdout and stderr is all there is.
    transformers imports torchao, which logs its C++ extensions' failures and
    makes torch log a pytree deprecation, and transformers advises kernel
    packages for its eager GDN code: fusepass drops exactly those."""
    pytest.importorskip("transformers")
    out = subprocess.run([sys.executable, "-m", "fusepass.cli", "demo", "--model", "qwen3_5_moe", "--quantize", "int8",
                          "--seq", "1", "--size", "tiny", "--json", str(tmp_path / "report.json")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "rewrite report" in out.stdout and ": OK" in out.stdout
    for rule in ("gdn_chunk", "dequant_matmul", "moe_router", "moe_experts", "rms_norm", "linear_siblings"):
        assert rule in out.stdout, rule
    # Then the next token over a static cache, its own graph: the recurrent GDN step, the cache write in
    # decode_attention's op, checked too.
    decode = out.stdout.split("one decode step over a static cache")[1]
    assert "gdn_recurrent" in decode and "+write" in decode and "decode logits vs the fp32 copy" in decode
    assert decode.count(": OK") == 1
    assert "model.layers.0" in out.stdout and "L['" not in out.stdout
    # Every "where" is the path of a module of the model (as named_modules() spells it), whole in the table.
    from fusepass import models

    names = {n for n, _ in models.build("qwen3_5_moe", size="tiny").named_modules()}
    wheres = {h["where"] for g in json.loads((tmp_path / "report.json").read_text())["graphs"] for h in g["hits"]}
    assert wheres and wheres <= names, wheres - names
    shown = set(re.findall(r"model\.[\w.]*\w", out.stdout))
    assert shown and shown <= names, shown - names
    assert "test path" in out.stdout
    assert "compiling with fusepass" in out.stderr  # progress, step by step
    for noise in ("Failed to load", "Enum subclass", "_C_mxfp8", "falling back to its reference"):
        assert noise not in out.stdout + out.stderr, out.stderr[-2000:]


def test_bench_refuses_an_unknown_op(tmp_path, capsys):
    with pytest.raises(SystemExit, match="unknown op.*no_such_op"):
        fusepass_cli(capsys, "bench", "--quick", "--ops", "no_such_op", "--out", str(tmp_path))


def test_a_wrong_provider_is_reported_not_timed():
    import torch

    from fusepass.bench.registry.common import Case
    from fusepass.bench import output
    from fusepass.bench.ops import run_case

    case = Case(op="scale", shape="8x8", dtype=torch.float32, make_inputs=lambda: (torch.randn(8, 8),),
                reference=lambda x: x * 2,
                providers={"right": lambda x: x * 2, "wrong": lambda x: x * 2.01, "raises": lambda x: x.no_such()},
                bytes_moved=512)
    rows = {r["provider"]: r for r in run_case(case, "cpu", 5.0, {}, 10.0, None, output.Progress(3, "t"))}
    assert rows["right"]["ok"] and rows["right"]["plain_us"] > 0
    assert rows["wrong"]["ok"] is False and "wrong result" in rows["wrong"]["error"]
    assert "plain_us" not in rows["wrong"]
    assert rows["raises"]["ok"] is False and "AttributeError" in rows["raises"]["error"]


def test_bench_e2e_quick(tmp_path, capsys):
    pytest.importorskip("transformers")
    # Inductor is left out to keep CI short (its C++ compiles cost ~25 s here);
    # the comparison with it is checked in test_startup_rows_compare_warm_with_cold.
    out = fusepass_cli(capsys, "bench", "e2e", "--quick", "--phases", "prefill,decode,replay", "--backends", "eager,fusepass",
                       "--out", str(tmp_path))
    data = json.loads((tmp_path / "e2e.json").read_text())
    rows = data["rows"]
    got = {(r["phase"], r["backend"]) for r in rows}
    assert got == {(p, b) for p in ("prefill", "decode", "replay") for b in ("eager", "fusepass")}
    for r in rows:
        if r["phase"] == "decode" and r.get("ok") is None:
            continue  # the CPU's noise exceeded the few decode steps of --quick: said so, not a failure
        assert r["ok"] is True, f"{r['workload']} {r['backend']}: {r.get('error')}"
        assert r["value"] > 0 and r["p20"] <= r["value"] <= r["p80"]
    for r in rows:  # each replayed step's logits checked first (against eager: the quick model is fp32)
        if r["phase"] == "replay":
            assert 0 <= r["rel_err"] <= r["check_limit"] <= 1e-3, r
    for r in rows:
        if r["backend"] == "fusepass" and r.get("ok"):
            assert "rms_norm" in r["rewrites"], r["rewrites"]
        if r["phase"] in ("decode", "replay") and r.get("ok"):
            assert r["floor_ms"] > 0 and r["pct_floor"] > 0
    for r in rows:  # decode and replay ran together: the step's time outside the graph
        if r["phase"] == "decode" and r.get("ok"):
            replay = next(x for x in rows if x["phase"] == "replay" and x["backend"] == r["backend"])
            if replay.get("value"):
                assert r["host_ms_per_step"] == pytest.approx(r["step_ms"] - replay["value"] / 1e3)
    with (tmp_path / "e2e.csv").open() as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    assert "fusepass rewrites" in (tmp_path / "e2e_table.txt").read_text()
    assert "wrote" in out.out


@pytest.mark.parametrize("fmt", ["bnb-nf4", "bnb-nf4-dq"])
def test_e2e_bitsandbytes_quantization(fmt):
    """--quantize bnb-nf4: every linear but lm_head becomes bitsandbytes' Linear4bit (NF4, blocks of 64,
    no double quantization; bnb-nf4-dq: with it), the model still answers close to its bf16 self, and
    the weight-read floor counts the codes and absmax (each Params4bit's quant_state, and the nested
    one's) rather than the bf16 weights."""
    pytest.importorskip("transformers")
    bnb = pytest.importorskip("bitsandbytes")
    import torch

    from fusepass.bench.e2e.models import build, quantize, weight_bytes

    model = build("tiny-llama", 2, torch.float32, "cpu")
    ids = torch.randint(0, 256, (1, 5))
    with torch.no_grad():
        expected = model(ids).logits
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear and m is not model.lm_head]
    before = weight_bytes(model)
    quantize(model, fmt, 128)
    q = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(q) == len(linears) == 14 and type(model.lm_head) is torch.nn.Linear
    assert {m.weight.quant_state.quant_type for m in q} == {"nf4"} and {m.weight.quant_state.blocksize for m in q} == {64}
    assert [m.weight.quant_state.nested for m in q] == [fmt.endswith("-dq")] * 14
    states = [m.weight.quant_state for m in q] + [m.weight.quant_state.state2 for m in q if fmt.endswith("-dq")]
    codes = sum(m.weight.numel() for m in q) + sum(st.absmax.numel() * st.absmax.element_size() for st in states)
    assert weight_bytes(model) == before - sum(m.weight.numel() * 4 for m in linears) + codes
    with torch.no_grad():
        got = model(ids).logits
    assert (got - expected).abs().max() < 0.25 * expected.abs().max()  # 4-bit weights: close, not equal


@pytest.mark.parametrize("fmt", ["gptq", "gptq-act-order", "hqq"])
def test_e2e_gptq_layout_through_the_loader(fmt):
    """--quantize gptq / gptq-act-order / hqq: every linear but lm_head written in GPTQ's (HQQ's) layout and loaded back
    by fusepass.load_quantized into fusepass's int4 layers (act-order: x's features permuted in each
    forward), the model still answering close to its float self; what --quantize int4 builds, but for
    the permutation."""
    pytest.importorskip("transformers")
    import torch

    from fusepass.bench.e2e.models import build, quantize
    from fusepass.checkpoints import PackedInt4Linear

    model = build("tiny-llama", 2, torch.float32, "cpu")
    ids = torch.randint(0, 256, (1, 5))
    with torch.no_grad():
        expected = model(ids).logits
    quantize(model, fmt, 32)
    q = [m for m in model.modules() if isinstance(m, PackedInt4Linear)]
    assert len(q) == 14 and type(model.lm_head) is torch.nn.Linear and {m.group_size for m in q} == {32}
    assert all((m.perm is not None) == (fmt == "gptq-act-order") for m in q)
    if fmt == "hqq":  # HQQ's float zero points kept as they are, not rounded to codes
        assert any((m.zero.float() - m.zero.float().round()).abs().max() > 0.01 for m in q)
    with torch.no_grad():
        got = model(ids).logits
    assert (got - expected).abs().max() < 0.25 * expected.abs().max()  # 4-bit weights: close, not equal


@pytest.mark.parametrize("quant", [None, "int4"])
def test_e2e_floor_counts_k_of_e_experts(quant):
    """The weight-read floor of a sparse MoE model counts k of each layer's E experts (a batch-1 step's
    reads), plain or quantized in place; everything else once."""
    pytest.importorskip("transformers")
    import torch

    from fusepass.bench.e2e.models import build, quantize, weight_bytes

    model = build("tiny-qwen3-moe", 2, torch.float32, "cpu")
    if quant:
        quantize(model, quant, 32)
    E, k = model.config.num_experts, model.config.num_experts_per_tok
    experts = [t for n, m in model.named_modules() if n.endswith(".experts")
               for t in list(m.parameters()) + list(m.buffers())]
    assert len(experts) >= 4 and all(t.shape[0] == E for t in experts)
    every = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    embed = model.get_input_embeddings().weight
    others = sum(t.numel() * t.element_size() for i, t in every.items() if t is not embed)
    stacks = sum(t.numel() * t.element_size() for t in experts)
    assert weight_bytes(model) == round(others - stacks + stacks * k / E)


def test_startup_rows_compare_warm_with_cold(monkeypatch, tmp_path):
    """The startup phase's verdicts, from children's results (the real children
    run in tests/test_backend.py's warm-start test and on the GPU)."""
    import argparse

    from fusepass.bench import e2e

    results = {
        "cold": {"first_call_s": 9.0, "first_call_cpu_s": 8.0, "cache": ["miss"], "hits": [["rms_norm", "model.norm"]]},
        "warm": {"first_call_s": 3.0, "first_call_cpu_s": 2.5, "cache": ["hit"], "hits": [["rms_norm", "model.norm"]]},
    }
    calls = []

    def fake_child(spec, folder, timeout):
        kind = "warm" if any(c[1] == folder and c[0] == spec["backend"] for c in calls) else "cold"
        calls.append((spec["backend"], folder))
        r = dict(results[kind], process_s=results[kind]["first_call_s"] + 1,
                 aot_autograd_cache_hits=int(kind == "warm"), fx_graph_cache_hits=0)
        if spec["backend"] != "fusepass":
            r = {k: v for k, v in r.items() if k not in ("cache", "hits")}
        return r

    monkeypatch.setattr(e2e.startup, "startup_child", fake_child)
    monkeypatch.setattr(e2e.run, "copy_bandwidth", lambda device: 1.0)
    args = argparse.Namespace(quick=True, device="cpu", model="tiny-llama", dtype=None, backends="inductor,fusepass",
                              out=str(tmp_path), layers="2", quantize=None, group_size=128, prompt=16, repeat=2,
                              child_timeout=10, threads=1, command_line="test", model_given=True,
                              max_seconds=None)
    run = e2e.Run(args)
    e2e.phase_startup(run)
    rows = {(r["backend"], r["workload"]): r for r in run.rows}
    warm = rows[("fusepass", "startup warm")]
    assert warm["ok"] and warm["value"] == 3.0 and warm["cpu_s"] == 2.5 and "rms_norm×1" in warm["rewrites"]
    assert rows[("inductor", "startup cold")]["runs"] == 2
    e2e.summary._vs_inductor(run.rows)
    assert warm["vs_inductor"] == 1.0  # both warm starts took 3.0 s
    assert rows[("inductor", "startup cold")]["vs_inductor"] == 1.0
    # A warm report that lost a rewrite is a failure.
    results["warm"] = {**results["warm"], "hits": []}
    run.rows.clear()
    e2e.phase_startup(run)
    assert not {(r["backend"], r["workload"]): r for r in run.rows}[("fusepass", "startup warm")]["ok"]


def test_profile_kinds_and_table():
    from fusepass.bench.timing import _kind, render_profile

    assert _kind("_dequant_gemv_kernel") == "fusepass quantized linear"
    assert _kind("_gdn_state_kernel") == "fusepass GDN"
    # Inductor's kernels quote the ops they fuse: still Inductor's, not attention.
    assert _kind("triton_poi_fused__scaled_dot_product_cudnn_attention__to_copy_0") == "Inductor-generated"
    assert _kind("cudnn_generated_fort_native_sdpa_sm80_flash_fprop_wmma_f16") == "attention"
    assert _kind("nvjet_sm90_tst_384x8_64x4_2x1_v_bz_TNT") == "cuBLAS/CUTLASS matmul"
    assert _kind("void at::native::vectorized_elementwise_kernel<FillFunctor>") == "copies and fills"
    assert _kind("something_else") == "other aten"
    assert _kind("_moe_decode_up_kernel") == "fusepass MoE"
    assert _kind("_decode_attention_kernel") == "fusepass attention"
    # (Inductor's kernels quote the ops they feed, fusepass's too)
    assert _kind("triton_per_fused__to_copy_add_arange_bmm_cat_cos_decode_attention_e_0") == "Inductor-generated"
    assert _kind("triton_poi_fused__unsafe_view_add_rms_norm_embedding_rms_norm_0") == "Inductor-generated"
    prof = {"kernels_per_call": 3.0, "kernel_ms_per_call": 0.5, "span_ms_per_call": 0.6,
            "kinds": {"attention": {"ms": 0.4, "kernels": 2.0}, "other aten": {"ms": 0.1, "kernels": 1.0}},
            "top": [{"kernel": "flash_fwd", "kind": "attention", "calls": 2.0, "ms": 0.4}]}
    text = render_profile("replay B1 fusepass", prof)
    assert text.startswith("replay B1 fusepass: 3 kernels per call, 0.500 ms")
    assert "flash_fwd" in text and "0.400" in text


@pytest.mark.gpu
def test_gpu_profile_counts_a_calls_kernels():
    import torch

    from fusepass.bench.timing import profile_kernels

    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    prof = profile_kernels(lambda: (a @ a).relu_(), calls=3)
    assert prof["kernels_per_call"] == 2, prof
    assert prof["kernel_ms_per_call"] > 0 and prof["span_ms_per_call"] >= prof["kernel_ms_per_call"] * 0.99
    assert "cuBLAS/CUTLASS matmul" in prof["kinds"], prof["kinds"]


def test_prefill_reference_is_fp32_in_half_precision(tmp_path):
    pytest.importorskip("transformers")
    import argparse

    import torch

    from fusepass.bench import e2e

    args = argparse.Namespace(quick=True, device="cpu", model="tiny-llama", dtype="bfloat16", backends="eager",
                              out=str(tmp_path), layers="2", quantize=None, group_size=128, prompt=16, repeat=1,
                              child_timeout=10, threads=1, command_line="test", model_given=True, max_seconds=None)
    run = e2e.Run(args)
    model = run.get_model()
    ref, eager_err, what = e2e.phases._prefill_references(run, model, [8])
    assert what == "an fp32 copy of the model"
    assert ref[8].dtype == torch.float32
    # bf16 eager differs from the fp32 model by its roundings: more than nothing, less than the table.
    assert 0 < eager_err[8] < 0.05
    assert next(model.parameters()).dtype == torch.bfloat16  # the model itself is untouched


def test_benchmarks_page_is_generated_from_the_runs_json(tmp_path):
    """python -m fusepass.bench.page: a table per op and per whole-model run, each with its provenance."""
    from fusepass.bench import output, page

    env = {"device": "NVIDIA H100 80GB HBM3", "device_type": "cuda", "torch": "2.11.0+cu130", "triton": "3.6.0",
           "transformers": "5.17.0", "commit": "abc1234", "date": "2026-11-25"}

    def op_row(shape, provider, us, **kw):
        return {"op": "rms_norm", "shape": shape, "provider": provider, "ok": True, "graph_us": us, "time_us": us,
                **kw}

    ops_rows = [op_row("4096x4096", "inductor", 24.9, vs_inductor=1.0),
                op_row("4096x4096", "fusepass", 23.9, vs_inductor=24.9 / 23.9, gbps=2800.0, pct_copy=115.0),
                {"op": "rms_norm", "shape": "4096x4096", "provider": "liger", "ok": False,
                 "error": "wrong result: relative error 1e-1 > 8e-3; not timed"}]
    (tmp_path / "ops").mkdir()
    output.write_json(tmp_path / "ops" / "results.json", env, ops_rows, command="fusepass bench --ops rms_norm",
                      copy_gbps=2437.0)
    e2e_rows = [{"model": "llama3-8b", "layers": 32, "dtype": "bfloat16", "quantize": "int4", "phase": "decode",
                 "workload": "decode B1", "backend": b, "ok": True, "value": v, "unit": "tok/s", "pct_floor": p,
                 **extra} for b, v, p, extra in (
                     ("inductor", 108.0, 60.0, {}),
                     ("fusepass", 182.0, 35.0, {"vs_inductor": 182 / 108, "rewrites": "dequant_matmul_int4×224"}))]
    (tmp_path / "e2e" / "llama").mkdir(parents=True)
    output.write_json(tmp_path / "e2e" / "llama" / "e2e.json", env, e2e_rows,
                      command="fusepass bench e2e --model llama3-8b --quantize int4")
    out = tmp_path / "BENCHMARKS.md"
    assert page.main([str(tmp_path), "--out", str(out)]) == 0
    text = out.read_text()
    assert "### rms_norm" in text and "### llama3-8b, 32 layer(s), bfloat16, int4" in text
    assert "| 4096x4096 | 24.9 | fails its check | 23.9 | 1.04x | 2800 (115%) |" in text
    assert ("| decode B1 | 108 tok/s, 60% of floor | 182 tok/s, 35% of floor | 1.69x | dequant_matmul_int4×224 |"
            in text)
    for needle in ("NVIDIA H100 80GB HBM3", "torch 2.11.0+cu130", "commit abc1234", "    fusepass bench --ops rms_norm",
                   "    fusepass bench e2e --model llama3-8b --quantize int4"):
        assert needle in text
    assert "not a speed claim" not in text  # a GPU run
    with pytest.raises(SystemExit, match="no results.json"):
        page.main([str(tmp_path / "ops" / "nothing")])


def test_tp_bench_dumps_each_ranks_stacks_on_a_timer(tmp_path):
    # --stacks: where a TP run that does not finish spends its time, rank by rank.
    import faulthandler
    import time

    from fusepass.bench import tp

    tp._dump_stacks_every(0.1, tmp_path / "out", 3)
    try:
        time.sleep(0.45)
    finally:
        faulthandler.cancel_dump_traceback_later()
    text = (tmp_path / "out" / "stacks-rank3.txt").read_text()
    assert text.count("most recent call first") >= 2 and "test_tp_bench_dumps" in text


def test_tp_bench_rank_that_fails_exits_with_its_traceback():
    # Under torchrun a rank that raised and then tore its group down waited on
    # its peers: the run sat silent to the command's limit.  Now it exits at
    # once, non-zero, having printed why; a rank that succeeds returns its rows.
    import subprocess
    import sys

    from fusepass.backend import fusepass_backend
    from fusepass.bench import tp

    assert tp._rank_or_exit(lambda a: [a], 7) == [7]
    assert tp._backend("fusepass") is fusepass_backend and tp._backend("inductor") == "inductor"
    code = "from fusepass.bench.tp import _rank_or_exit; _rank_or_exit(lambda: 1 / 0); print('after')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "ZeroDivisionError" in done.stderr and "after" not in done.stdout


def test_bench_e2e_rule_variant(tmp_path, capsys, monkeypatch):
    """A backend "fusepass-no:RULE+RULE" compiles without those rules (an A/B of
    rules in one process); unknown rules, an empty list and the startup phase are
    refused before anything runs."""
    pytest.importorskip("transformers")
    from fusepass.bench.e2e.run import compile_args
    from fusepass.bench.e2e.run import graphs_compile_args as graphs_compile_args_of

    assert compile_args("fusepass") == {"backend": "fusepass"}
    assert compile_args("inductor") == {"backend": "inductor"}
    assert compile_args("fusepass-no:rms_norm+swiglu") == {
        "backend": "fusepass", "options": {"disable_rules": ["rms_norm", "swiglu"]}}
    assert compile_args("fusepass-no:inline") == {
        "backend": "fusepass", "options": {"disable_rules": [], "inline_kernels": False}}
    # a step the bench captures itself: fusepass told so, unless the variant or the environment decides
    monkeypatch.delenv("FUSEPASS_INLINE_KERNELS", raising=False)
    assert compile_args("fusepass", captured=True) == {"backend": "fusepass", "options": {"inline_kernels": False}}
    assert compile_args("inductor", captured=True) == {"backend": "inductor"}
    monkeypatch.setenv("FUSEPASS_INLINE_KERNELS", "1")
    assert compile_args("fusepass", captured=True) == {"backend": "fusepass"}
    monkeypatch.delenv("FUSEPASS_INLINE_KERNELS")
    # "@KEY=VALUE": Inductor config patches on any compiled backend, values parsed
    assert compile_args("inductor@combo_kernels=1@combo_kernel_max_num_nodes=4") == {
        "backend": "inductor", "options": {"combo_kernels": True, "combo_kernel_max_num_nodes": 4}}
    assert compile_args("fusepass-no:swiglu@combo_kernels=false", captured=True) == {
        "backend": "fusepass", "options": {"disable_rules": ["swiglu"], "combo_kernels": False,
                                           "inline_kernels": False}}
    assert graphs_compile_args_of("inductor@combo_kernels=1") == {
        "backend": "inductor", "mode": None, "options": {"triton.cudagraphs": True, "combo_kernels": True}}
    for backends, phases, message in (("fusepass-no:nope", "replay", "name the rules"),
                                      ("fusepass@combo_kernels", "replay", "not KEY=VALUE"),
                                      ("eager@combo_kernels=1", "replay", "unknown"),
                                      ("fusepass@combo_kernels=1", "startup", "plain backends only"),
                                      ("fusepass-no:", "replay", "name the rules"),
                                      ("fusepass-no:swiglu", "startup", "plain backends only")):
        with pytest.raises(SystemExit, match=message):
            fusepass_cli(capsys, "bench", "e2e", "--quick", "--phases", phases, "--backends", backends,
                         "--out", str(tmp_path))
    # generate's CUDA graphs: torch.compile takes a mode or options, so a variant gets the mode's options
    from fusepass.bench.e2e.run import graphs_compile_args

    assert graphs_compile_args("inductor") == {"backend": "inductor", "mode": "reduce-overhead"}
    assert graphs_compile_args("fusepass") == {"backend": "fusepass", "mode": "reduce-overhead"}
    assert graphs_compile_args("fusepass-no:swiglu") == {
        "backend": "fusepass", "mode": None, "options": {"triton.cudagraphs": True, "disable_rules": ["swiglu"]}}
    fusepass_cli(capsys, "bench", "e2e", "--quick", "--phases", "replay,decode", "--backends",
                 "fusepass-no:rms_norm+add_rms_norm", "--out", str(tmp_path))
    rows = json.loads((tmp_path / "e2e.json").read_text())["rows"]
    assert {r["phase"] for r in rows} == {"replay", "decode"}, rows
    for row in rows:
        assert row["backend"] == "fusepass-no:rms_norm+add_rms_norm" and row["ok"] is not False, row
        assert "swiglu" in row["rewrites"] and "rms_norm" not in row["rewrites"], row["rewrites"]


def test_replay_rewinds_sliding_window_layers_python_counters():
    """The replayed step's cache is set back before every call, the sliding-window
    layers' Python-int counter too: left to grow it changed Dynamo's guards at
    every call, and the recompile inside the CUDA-graph capture failed
    (gpt-oss-20b's replay row, for every backend)."""
    from transformers import GptOssConfig, StaticCache

    from fusepass.bench.e2e.phases import _rewinder

    cfg = GptOssConfig(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=4,
                       hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                       num_local_experts=2, num_experts_per_tok=1, intermediate_size=16, vocab_size=64)
    cache = StaticCache(config=cfg, max_cache_len=16)
    sliding = [layer for layer in cache.layers if isinstance(getattr(layer, "cumulative_length_int", None), int)]
    assert sliding, "transformers' sliding-window static layer no longer counts in a Python int"
    rewind = _rewinder(cache, 6)
    for layer in cache.layers:
        layer.cumulative_length.fill_(9)
    for layer in sliding:
        layer.cumulative_length_int = 9
    rewind()
    assert all(int(layer.cumulative_length) == 6 for layer in cache.layers)
    assert all(layer.cumulative_length_int == 6 for layer in sliding)


def test_e2e_rewrites_say_when_a_graph_was_compiled_again():
    """A graph compiled again another way after a failure (without inlining) ran
    something other than the default: the row's rewrites column says so."""
    from fusepass.bench.e2e.run import rewrites
    from fusepass.report import GraphReport, Hit, RewriteReport

    report = RewriteReport([GraphReport("0/0", hits=[Hit("rms_norm", "one", "norm", "m.py:1", 0)])])
    assert rewrites(report) == "rms_norm×1 (1 graph(s))"
    report.graphs[0].notes.append("compiling failed (InductorError: ...); compiled again with inline_kernels=False")
    assert "1 compiled again after a failure" in rewrites(report)
