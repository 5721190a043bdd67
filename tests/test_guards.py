"""Matches that hold something their pattern does not say are refused, with the reason.

The programs that returned wrong answers before the engine's guards: an
argument a matched node carries beyond its pattern (``add``'s ``alpha``,
``addmm``'s ``beta`` and ``alpha``), a rounding to a dtype other than the one
the replacement rounds to, and options the pre-trace path did not obey.
Each comes out right, refused with a reason naming what differs or fused
correctly.  The audit at the end walks every traced pattern of every rule.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.fx
import torch.nn.functional as F

import fusepass
from fusepass import engine
from fusepass.formats import dequantize_int4
from fusepass.guards import _default, nondefault_argument
from fusepass.testing import assert_close, compile_and_run

torch.manual_seed(0)


def _hf(h, w, eps=1e-6, to=None):
    hf = h.float()
    hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return w * hf.to(to or h.dtype)


def _reasons(report, rule):
    return " | ".join(report.reasons(rule))


# -- arguments the pattern does not write ----------------------------------------------------


def _add_alpha(x, r, w):
    h = torch.add(x, r, alpha=2)
    return _hf(h, w), h


def _add_alpha_in_place(x, r, w):
    x.add_(r, alpha=-1)
    return _hf(x, w), x


def _add_alpha_torch_norm(x, r, w):
    h = torch.add(x, r, alpha=0.5)
    return F.rms_norm(h, (h.shape[-1],), w, 1e-6), h


@pytest.mark.parametrize("fn,alpha", [(_add_alpha, 2), (_add_alpha_in_place, -1), (_add_alpha_torch_norm, 0.5)],
                         ids=["add-alpha2", "add_-alpha-1", "alpha0.5-F.rms_norm"])
def test_residual_add_with_alpha_is_not_fused_as_a_plain_add(fn, alpha):
    x, r, w = torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(4, 64, dtype=torch.bfloat16), \
        torch.randn(64, dtype=torch.bfloat16)
    x_eager, x_compiled = x.clone(), x.clone()
    expected = fn(x_eager, r, w)
    out, report = compile_and_run(fn, [x_compiled, r, w])
    assert_close(out, expected, fn.__name__)
    assert torch.equal(x_compiled, x_eager), "the caller's tensor written differently"
    assert report.count("add_rms_norm") == 0, str(report)
    assert f"alpha={alpha!r}" in _reasons(report, "add_rms_norm"), str(report)
    assert report.count("rms_norm") == 1, str(report)  # the norm alone is still fused


def _int8(x, q, s):
    return q.to(x.dtype) * s[:, None]


def _int4(x, packed, scale, zero):
    return dequantize_int4(packed, scale, zero, x.dtype)


def _addmm_int8(beta, alpha):
    def fn(x, q, s, b):
        return torch.addmm(b, x, _int8(x, q, s).t(), beta=beta, alpha=alpha)
    return fn


def _addmm_int4(beta, alpha):
    def fn(x, packed, scale, zero, b):
        return torch.addmm(b, x, _int4(x, packed, scale, zero).t(), beta=beta, alpha=alpha)
    return fn


def _in_fp64(fn, inputs):
    """``fn`` on the float inputs in fp64, rounded to the first input's dtype: a bf16 addmm of a
    dequantized weight rounds every weight before a 64-long sum (eager 0.027 from fp64 where the
    fused op, which scales after an fp32 sum, is 0.004)."""
    out = fn(*[t.double() if t.is_floating_point() else t for t in inputs])
    return out.to(inputs[0].dtype)


def _int8_inputs():
    torch.manual_seed(0)
    return [torch.randn(4, 64, dtype=torch.bfloat16), torch.randint(-128, 128, (32, 64), dtype=torch.int8),
            torch.rand(32, dtype=torch.bfloat16) / 50, torch.randn(32, dtype=torch.bfloat16)]


def _int4_inputs():
    torch.manual_seed(0)
    return [torch.randn(4, 64, dtype=torch.bfloat16), torch.randint(0, 256, (32, 32), dtype=torch.uint8),
            torch.rand(32, 2, dtype=torch.bfloat16) / 50, torch.randint(0, 16, (32, 2)).to(torch.bfloat16),
            torch.randn(32, dtype=torch.bfloat16)]


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("beta,alpha,named", [(0.5, 2, "beta=0.5"), (0, 1, "beta=0"), (1, 2, "alpha=2")])
def test_addmm_with_beta_or_alpha_on_a_dequantized_weight_is_refused(fmt, beta, alpha, named):
    fn, inputs = (_addmm_int8(beta, alpha), _int8_inputs()) if fmt == "int8" else \
        (_addmm_int4(beta, alpha), _int4_inputs())
    rule = "dequant_matmul" if fmt == "int8" else "dequant_matmul_int4"
    out, report = compile_and_run(fn, inputs)
    assert_close(out, fn(*inputs), f"{fmt} addmm beta={beta} alpha={alpha}")
    assert report.count(rule) == 0, str(report)
    assert named in _reasons(report, rule), str(report)


def test_addmm_with_default_beta_and_alpha_is_still_fused():
    fn, inputs = _addmm_int8(1, 1), _int8_inputs()
    out, report = compile_and_run(fn, inputs)
    assert_close(out, _in_fp64(fn, inputs), "int8 addmm")
    assert report.count("dequant_matmul") == 1, str(report)


# -- roundings ---------------------------------------------------------------------------------


def _norm_to_bf16(x, w):  # an HF-style norm that rounds to a fixed dtype, run on fp16
    return _hf(x, w, to=torch.bfloat16)


def _zero_centred_to_fp16(x, w):  # a (1 + w) norm rounding to fp16, run on bf16
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return (h * (1.0 + w.float())).to(torch.float16)


def _swiglu_to_bf16(g, u):  # SiLU rounded to bf16 on fp16 inputs
    return F.silu(g.float()).to(torch.bfloat16) * u


@pytest.mark.parametrize("fn,inputs,rule", [
    (_norm_to_bf16, lambda: [torch.randn(4, 64, dtype=torch.float16), torch.randn(64, dtype=torch.float16)],
     "rms_norm"),
    (_zero_centred_to_fp16, lambda: [torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)],
     "rms_norm"),
    (_swiglu_to_bf16, lambda: [torch.randn(4, 64, dtype=torch.float16), torch.randn(4, 64, dtype=torch.float16)],
     "swiglu"),
], ids=["hf-norm-to-bf16-on-fp16", "zero-centred-to-fp16-on-bf16", "swiglu-to-bf16-on-fp16"])
def test_rounding_to_another_dtype_is_right_or_refused(fn, inputs, rule):
    args = inputs()
    expected = fn(*args)
    out, report = compile_and_run(fn, args)
    # The dtype the graph rounds in decides the tolerance (bf16 for the first and the last).
    assert_close(out, expected, fn.__name__, dtype=torch.bfloat16)
    for hit in report.hits:  # whatever was fused computes at the graph's own dtypes
        assert hit.rule != rule or fn is _zero_centred_to_fp16, str(report)
    if fn is not _zero_centred_to_fp16:
        assert "rounds differently" in _reasons(report, rule), str(report)


# -- the engine's argument guard on its own ----------------------------------------------------


def test_nondefault_argument_names_the_argument():
    g = torch.fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    plain = g.call_function(torch.ops.aten.add.Tensor, (x, y))
    alpha = g.call_function(torch.ops.aten.add.Tensor, (x, y), {"alpha": 2})
    one = g.call_function(torch.ops.aten.add.Tensor, (x, y), {"alpha": 1.0})
    assert nondefault_argument(plain) is None
    assert nondefault_argument(one) is None  # the default, written out
    assert "alpha=2" in nondefault_argument(alpha)
    assert nondefault_argument(alpha, written={"alpha": 2}) is None  # a pattern that writes it: compared there
    empty = g.call_function(torch.ops.aten.empty.memory_format, ([2, 3],), {"dtype": torch.uint8})
    assert nondefault_argument(empty) is None  # a factory: its dtype is its value's


# -- options and the pre-trace path --------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen35():
    from fusepass import models

    model = models.build("qwen3_5", size="tiny")
    ids = models.input_ids(model, batch=1, seq=70)  # two chunks of the GDN loop
    with torch.no_grad():
        expected = model(ids).logits
    return model, ids, expected


@pytest.mark.parametrize("options,gdn", [
    ({}, True),
    ({"disable_rules": ["gdn_chunk", "gdn_recurrent"]}, False),
    ({"rules": ["rms_norm"]}, False),
], ids=["default", "gdn-disabled", "only-rms_norm"])
def test_options_decide_which_ops_run_and_the_report_says_so(qwen35, options, gdn, tmp_path):
    """The fusepass ops in the compiled graph (on CPU each runs) agree with the rule selection and with the
    report, the pre-trace path's GDN call included."""
    from fusepass.testing.differential.check import _graph_ops

    model, ids, expected = qwen35
    with torch.no_grad():
        out, report = compile_and_run(model, [ids], dump_graphs=str(tmp_path), **options)
    assert_close(out.logits, expected, str(options), dtype=torch.float32)
    ops = _graph_ops(str(tmp_path))
    assert ("gdn_chunk" in ops) == gdn == (report.count("gdn_chunk") > 0), (ops, str(report))
    selected = fusepass.options.Options.parse(options)[0]
    assert all(selected.enabled(h.rule) for h in report.hits), str(report)
    if "rules" in options:
        assert ops <= {"rms_norm"}, ops


# -- the audit ---------------------------------------------------------------------------------


def _patterns():
    from torch._inductor.pattern_matcher import MultiOutputPattern, _TargetArgsExpr

    for rule in fusepass.rules():
        if rule.find is not None:
            continue
        for cf in engine.compile_rule(rule):
            outputs = cf.pattern.outputs if isinstance(cf.pattern, MultiOutputPattern) else [cf.pattern]
            seen, stack = set(), list(outputs)
            while stack:
                p = stack.pop()
                if isinstance(p, (list, tuple)):
                    stack += list(p)
                    continue
                if not isinstance(p, _TargetArgsExpr) or id(p) in seen:
                    continue
                seen.add(id(p))
                yield rule.name, p
                stack += list(itertools.chain(p.args, p.kwargs.values()))


def test_audit_every_argument_of_every_matched_op_is_compared_or_held_to_its_default():
    """For every aten op any rule's patterns match: each schema argument is either compared by Inductor's
    matcher (written by the pattern, positionally or by keyword) or, when a graph node gives it by keyword,
    held to its default by the engine.  Printed with ``-s``: the table of ops and their arguments."""
    rows = {}
    for rule, p in _patterns():
        target = p.fns[0]
        schema = getattr(target, "_schema", None)
        if schema is None:
            continue  # operator.getitem and the like: positional only
        written = {a.name for a in schema.arguments[:len(p.args)]} | set(p.kwargs)
        row = rows.setdefault(str(target), {"rules": set(), "compared": set(), "held": set()})
        row["rules"].add(rule)
        for a in schema.arguments:
            if a.name in written:
                row["compared"].add(a.name)
                continue
            # A node that gives this argument by keyword at another value is refused:
            g = torch.fx.Graph()
            args = [g.placeholder(f"a{i}") for i in range(len(p.args))]
            if not a.has_default_value():
                continue  # required arguments are positional in every traced node: compared
            value = _other_value(a)
            if value is None:
                row["held"].add(f"{a.name} (default only)")
                continue
            node = g.call_function(target, tuple(args), {a.name: value})
            assert nondefault_argument(node, written=p.kwargs), (rule, str(target), a.name, value)
            assert _default(target, a.name) is not None or a.default_value is None
            row["held"].add(a.name)
    lines = [f"{op}: compared {sorted(r['compared'])}; held to default {sorted(r['held'])}; rules {sorted(r['rules'])}"
             for op, r in sorted(rows.items())]
    print("\n" + "\n".join(lines))
    assert not [line for line in lines if "default only" in line], "arguments without a probe value"
    assert any(line.startswith("aten.add.Tensor") and "'alpha'" in line for line in lines), lines
    assert any(line.startswith("aten.addmm") and "'beta'" in line and "'alpha'" in line for line in lines), lines


def _other_value(arg):
    """A value for schema argument ``arg`` other than its default (None where none is known)."""
    default, kind = arg.default_value, str(arg.type)
    if arg.name == "dtype":  # ScalarType reads as int in the schema
        return torch.float64
    if arg.name == "memory_format":
        return torch.channels_last
    if arg.name == "layout":
        return torch.sparse_coo
    if "bool" in kind:
        return not default
    if kind in ("number", "float", "int", "SymInt", "Optional[number]", "Optional[float]", "Optional[int]"):
        return 3 if default != 3 else 5
    if "str" in kind:
        return "floor" if default != "floor" else "trunc"
    return None


def test_a_graph_node_with_an_unwritten_argument_is_refused_through_the_engine():
    """End to end through match_form: the alpha of the add inside an RMSNorm's eps add."""
    def fn(x, w):
        h = x.float()
        return w * (h * torch.rsqrt(torch.add(h.pow(2).mean(-1, keepdim=True), 1e-6, alpha=3))).to(x.dtype)

    x, w = torch.randn(4, 64), torch.randn(64)
    out, report = compile_and_run(fn, [x, w])
    assert_close(out, fn(x, w), "eps add with alpha")
    assert report.count("rms_norm") == 0, str(report)
    assert "alpha=3" in _reasons(report, "rms_norm"), str(report)
