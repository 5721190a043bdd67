"""Helpers for testing rules, built-in or your own.

    from fusepass.testing import check_rule
    check_rule(my_rule)             # raises AssertionError with what went wrong

``check_rule`` compiles every form of the rule (each dtype) with fusepass
restricted to that rule and checks that (1) the rule rewrote it, (2) the
result matches the search function run eagerly within the dtype table, and
(3) every declared near-miss is refused with its expected reason and still
gives eager's result.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils import _pytree as pytree

from ..kernels._common import loosest, tolerance
from ..report import RewriteReport, last_report, reset_reports
from ..rule import Rule
from .tp import single_rank_group

# A scalar the pattern was not traced with, so matching really is by wildcard.
CHECK_SCALAR = 3.0517578125e-05


@dataclass
class CheckResult:
    case: str
    rewrites: int
    max_error: float
    reasons: list[str]


def compile_and_run(fn: Callable[..., Any], inputs: Sequence[Any], rules: Sequence[str] | None = None,
                    **options: Any) -> tuple[Any, RewriteReport]:
    """Compile ``fn`` with fusepass (fresh Dynamo state), run it once, return (output, report)."""
    torch._dynamo.reset()
    reset_reports()
    opts = dict(options)
    if rules is not None:
        opts["rules"] = list(rules)
    compiled = torch.compile(fn, backend="fusepass", options=opts, dynamic=False)
    out = compiled(*inputs)
    return out, last_report()


def assert_close(actual: Any, expected: Any, what: str = "", dtype: torch.dtype | None = None) -> float:
    """Compare within the tolerance table, for each output's dtype or ``dtype``."""
    worst = 0.0
    for a, e in zip(pytree.tree_leaves(actual), pytree.tree_leaves(expected)):
        if not isinstance(e, torch.Tensor):
            continue
        assert a.shape == e.shape and a.dtype == e.dtype, f"{what}: {a.dtype}{tuple(a.shape)} vs {e.dtype}{tuple(e.shape)}"
        if not e.is_floating_point():  # indices (an MoE router's expert ids): exactly
            assert torch.equal(a, e), f"{what}: integer outputs differ"
            continue
        tol = tolerance(dtype or e.dtype)
        torch.testing.assert_close(a, e, atol=tol.atol, rtol=tol.rtol, equal_nan=True, msg=lambda m: f"{what}: {m}")
        if e.numel():
            worst = max(worst, (a.double() - e.double()).abs().max().item())
    return worst


def _bind_scalars(rule: Rule, fn: Callable[..., Any]) -> Callable[..., Any]:
    bound = {name: CHECK_SCALAR for name in rule.scalars}
    return functools.partial(fn, **bound) if bound else fn


@contextlib.contextmanager
def registered(rule: Rule) -> Iterator[None]:
    """Have ``rule`` registered for the duration (restoring what was there)."""
    from .. import rule as registry

    previous = next((r for r in registry.rules() if r.name == rule.name), None)
    registry.register_rule(rule, replace=True)
    try:
        yield
    finally:
        if previous is None:
            registry.unregister_rule(rule.name)
        elif previous is not rule:
            registry.register_rule(previous, replace=True)


def without_inductor_cpu_int8_woq() -> None:
    """Leave Inductor's CPU lowering of int8 weight-only linears unregistered in this process.

    That lowering (bf16 x, int8 w, bf16 scale -> ``aten._weight_int8pack_mm``)
    is wrong on torch 2.13 where K is not a multiple of 16 and kills the
    process where K < 8 (measured on the CPU: K = 8 off by 469 on values of
    ~100, K = 40 by 384, K = 2 and 4 a segfault).  Every quantized-linear
    program fusepass refuses goes to Inductor, so the test suite's and the
    differential run's programs would hit it.  Call before the process's
    first compile: Inductor registers its post-grad patterns once."""
    from torch._inductor.fx_passes import mkldnn_fusion, quantization

    for module in (mkldnn_fusion, quantization):
        if hasattr(module, "_register_woq_lowerings"):
            module._register_woq_lowerings = lambda: None


def check_rule(rule: Rule, dtypes: Sequence[torch.dtype] | None = None, device: str | torch.device | None = None,
               near_miss_dtype: torch.dtype = torch.float32) -> list[CheckResult]:
    """Check a rule end to end; returns one row per case, raises AssertionError on the first failure."""
    single_rank_group()
    with registered(rule):
        return _check_rule(rule, dtypes, device, near_miss_dtype)


def _check_rule(rule: Rule, dtypes: Sequence[torch.dtype] | None, device: str | torch.device | None,
                near_miss_dtype: torch.dtype) -> list[CheckResult]:
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    results: list[CheckResult] = []
    for form in rule.forms:
        for dtype in dtypes or rule.dtypes:
            case = f"{rule.name}/{form.name}/{str(dtype).replace('torch.', '')}"
            inputs = [x.to(device) if isinstance(x, torch.Tensor) else x for x in rule.inputs(form, dtype)]
            fn = _bind_scalars(rule, form.search)
            expected = fn(*inputs)
            out, report = compile_and_run(fn, inputs, rules=[rule.name, *rule.builds_on])
            n = report.count(rule.name)
            assert n >= 1, f"{case}: not rewritten; refusals: {report.reasons(rule.name) or 'none'}"
            err = assert_close(out, expected, case)
            results.append(CheckResult(case, n, err, report.reasons(rule.name)))
    for nm in rule.near_misses:
        case = f"{rule.name}/near-miss/{nm.name}"
        inputs = [x.to(device) if isinstance(x, torch.Tensor) else x for x in nm.inputs(near_miss_dtype)]
        expected = nm.fn(*inputs)
        out, report = compile_and_run(nm.fn, inputs, rules=[rule.name, *rule.builds_on])
        # A near-miss may mix dtypes: Inductor computes its fp32 parts to fp32
        # precision even when the output is fp64 (seen on CUDA: 1e-7 in fp64).
        in_dtypes = [x.dtype for x in inputs if isinstance(x, torch.Tensor)]
        assert report.count(rule.name) == 0, f"{case}: rewritten but must be refused"
        reasons = report.reasons(rule.name)
        # An empty expected reason: the program must simply not match.
        if nm.reason:
            assert any(nm.reason in r for r in reasons), f"{case}: expected a reason with {nm.reason!r}, got {reasons}"
        out_dtypes = [x.dtype for x in pytree.tree_leaves(expected) if isinstance(x, torch.Tensor)]
        err = assert_close(out, expected, case, dtype=loosest([*in_dtypes, *out_dtypes]))
        results.append(CheckResult(case, 0, err, reasons))
    return results
