"""Every registered rule, checked end to end from its own declaration.

A rule added later joins these checks by declaring its forms, example inputs
and near-misses: each form must be rewritten and match its search function
run eagerly (per dtype), each near-miss must be refused with its reason.
"""

import contextlib

import operator

import pytest
import torch

import fusepass
from fusepass.backend import interpreting_after_pass
from fusepass.testing import assert_close, check_rule, differential

RULES = [r.name for r in fusepass.rules()]
SCALAR_RULES = [r.name for r in fusepass.rules() if r.scalars]


def _assert_rule_checks(name: str) -> None:
    results = check_rule(fusepass.get_rule(name))
    rewritten = [r for r in results if "/near-miss/" not in r.case]
    assert len(rewritten) == len(fusepass.get_rule(name).forms) * len(fusepass.get_rule(name).dtypes)
    assert all(r.rewrites >= 1 for r in rewritten)


@pytest.mark.parametrize("name", RULES)
def test_rule(name):
    # The graphs after the pass run by the FX interpreter: the rewrites and the ops are the
    # same, and Inductor's C++ build of every form, dtype and near-miss was 3-6x the rest
    # (dequant_matmul 12.2 s against 3.5, moe_router 5.6 against 0.9).  rms_norm's
    # check goes through Inductor's code generation too (test_rule_through_inductor).
    with interpreting_after_pass():
        _assert_rule_checks(name)


def test_rule_through_inductor():
    _assert_rule_checks("rms_norm")


def test_builtin_rules_are_registered():
    assert {"rms_norm", "add_rms_norm"} <= set(RULES)
    # The residual fusion must see the add before the plain norm takes the norm alone.
    assert RULES.index("add_rms_norm") < RULES.index("rms_norm")


def test_register_rule_rejects_duplicates_and_non_rules():
    rule = fusepass.get_rule("rms_norm")
    with pytest.raises(ValueError, match="already registered"):
        fusepass.register_rule(fusepass.Rule(name="rms_norm", forms=rule.forms, example_inputs=rule.example_inputs))
    with pytest.raises(TypeError):
        fusepass.register_rule(object())


def test_patterns_cover_every_dtype_and_swapped_operands():
    from fusepass.engine import compile_rule

    forms = compile_rule(fusepass.get_rule("rms_norm"))
    assert {cf.dtype for cf in forms} == {torch.float32, torch.float16, torch.bfloat16}
    assert any(cf.variant == "swapped" for cf in forms)


def _longer(inputs, k):
    """The inputs with k times the rows: every tensor shaped like the main operand repeats."""
    main = inputs[0].shape
    return [t.repeat(k, *[1] * (t.dim() - 1)) if t.shape == main else t for t in inputs]


@pytest.mark.parametrize("name", SCALAR_RULES)
def test_runtime_scalars_are_read_at_run_time(name):
    """dynamic=True leaves a Python float unspecialised: eps reaches the graph
    as a 0-dim CPU input.  The rule still rewrites, one graph serves every
    length and every eps, and the op reads the eps of each call (0.5 against
    1e-6 moves the output by ~20%) -- through its CPU body and its Triton kernel."""
    rule = fusepass.get_rule(name)
    form = rule.forms[0]
    torch._dynamo.reset()
    fusepass.reset_reports()
    fn = torch.compile(form.search, backend="fusepass", dynamic=True)
    torch.manual_seed(0)
    inputs = rule.inputs(form, torch.float32)
    calls = [(_longer(inputs, k), dict.fromkeys(rule.scalars, eps)) for k, eps in ((1, 1e-6), (3, 0.5))]
    with torch.no_grad():
        kernels = differential.triton_on_cpu() if differential.interpreting() else contextlib.nullcontext()
        for path in (contextlib.nullcontext(), kernels):
            with path:
                for args, scalars in calls:
                    assert_close(fn(*args, **scalars), form.search(*args, **scalars), f"{name} eps={scalars}")
    report = fusepass.last_report()
    assert len(report.graphs) == 1, str(report)  # no recompile for another length or eps
    assert report.count(name) == 1 and not report.reasons(name), str(report)


def test_tensor_scalar_refusals():
    """What a rule's eps may be besides a number, decided from the matched node alone."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fusepass.match import scalar_input, tensor_scalar_refusal

    g = torch.fx.Graph()

    def node(val, op="placeholder", name="eps"):
        n = g.placeholder(name) if op == "placeholder" else g.call_function(torch.ops.aten.mul.Tensor, ())
        n.meta["val"] = val
        return n

    cpu = torch.empty(4, 8)
    eps = node(torch.tensor(1e-6, dtype=torch.float64))
    convert = g.call_function(torch.ops.prims.convert_element_type.default, (eps, torch.float32))
    assert scalar_input(convert) is eps  # dynamic=True's unspecialised float: the input itself
    assert tensor_scalar_refusal("eps", eps, cpu) is None
    assert tensor_scalar_refusal("eps", node(torch.tensor(1e-6), op="call"), cpu) is None  # computed: read all the same
    assert "not one number" in tensor_scalar_refusal("eps", node(torch.zeros(4, 1)), cpu)
    assert "not a float" in tensor_scalar_refusal("eps", node(torch.tensor(1)), cpu)
    assert "on meta" in tensor_scalar_refusal("eps", node(torch.empty((), device="meta")), cpu)
    # On CUDA a run-time eps stays with Inductor (the kernel is inlined only with a constant eps).
    with FakeTensorMode():
        cuda = torch.empty(4, 8, device="cuda")
        cuda_eps = torch.empty((), device="cuda")
    assert "run-time value" in tensor_scalar_refusal("eps", eps, cuda)
    assert "run-time value" in tensor_scalar_refusal("eps", node(cuda_eps, op="call"), cuda)


def test_head_norms_on_cuda_are_left_to_inductor():
    """A norm of attention heads (x a view of wider rows split into heads) on
    CUDA is left to Inductor with the reason; wide rows, CPU and a view that
    does not split a row into heads are the rule's."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fusepass.match import MatchInfo
    from fusepass.patterns import rms_norm

    aten = torch.ops.aten

    def norm_input(device, wide, shape, half=None):
        g = torch.fx.Graph()
        with FakeTensorMode():
            mm_val = torch.empty(1, wide, device=device, dtype=torch.bfloat16)
            w_val = torch.empty(shape[-1], device=device, dtype=torch.bfloat16)
            v_val = mm_val.view(*shape[:-1], shape[-1] * (2 if half else 1))
            x_val = torch.empty(*shape, device=device, dtype=torch.bfloat16) if half else v_val
        mm, w = g.placeholder("mm"), g.placeholder("w")
        mm.meta["val"], w.meta["val"] = mm_val, w_val
        x = g.call_function(aten.view.default, (mm, list(v_val.shape)))
        x.meta["val"] = v_val
        if half == "slice":  # Qwen3.5's query beside its gate: a half of each head's row
            x = g.call_function(aten.slice.Tensor, (x, -1, 0, shape[-1]))
        elif half == "split":
            x = g.call_function(operator.getitem, (g.call_function(aten.split.Tensor, (x, shape[-1], -1)), 0))
        x.meta["val"] = x_val
        return MatchInfo("rms_norm", "hf", torch.bfloat16, {"x": x, "weight": w, "eps": 1e-6}, [], [])

    reason = rms_norm.check(norm_input("cuda", 4096, (1, 1, 32, 128)))
    assert reason and "norm of attention heads (rows of 128" in reason and "left to Inductor" in reason, reason
    for half in ("slice", "split"):
        assert "attention heads" in rms_norm.check(norm_input("cuda", 8192, (1, 1, 16, 256), half))
    assert rms_norm.check(norm_input("cuda", 2048, (1, 1, 8, 256))) is not None  # the widest head rows
    assert rms_norm.check(norm_input("cpu", 4096, (1, 1, 32, 128))) is None
    assert rms_norm.check(norm_input("cuda", 4096, (1, 1, 4096))) is None  # a hidden row, not heads
    assert rms_norm.check(norm_input("cuda", 4096, (1, 1, 8, 512))) is None  # rows wider than a head
