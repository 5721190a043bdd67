"""Compiling a program with fusepass and checking it: values against eager, inputs untouched, the report."""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ...backend import interpreting_after_pass
from ...options import Options
from ...kernels._common import clear_kernel_fallbacks, interpreting, kernel_fallbacks, loosest, tolerance
from ...report import RewriteReport, last_report, reset_reports
from ...rule import rules
from .build import Program, Step, _tstr
from .kernels import triton_on_cpu
from .spec import BlockSpec, Operand


@dataclass
class Outcome:
    program: Program
    report: RewriteReport | None
    failures: list[str]  # fusepass's: each one a mismatch or a broken report
    inductor: list[str]  # plain Inductor disagrees with eager the same way (not counted against fusepass)
    seconds: float


def _compare(actual: torch.Tensor, expected: torch.Tensor, precision: torch.dtype, scale: float = 1.0,
             floor: float = 0.0, nonfinite_in: bool = False, end_to_end: bool = False,
             slack: torch.Tensor | None = None) -> str | None:
    """``None`` if ``actual`` is ``expected`` within the table for ``precision``
    (atol scaled by ``scale``, see _mismatches, and at least ``floor``, see
    _Dtypes; with ``slack``, each element also within |slack - expected|), else
    what differs."""
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return f"{_tstr(actual)} vs {_tstr(expected)}"
    tol = tolerance(loosest([precision, expected.dtype], default=torch.float64))
    if slack is not None and slack.shape == expected.shape and expected.dtype.is_floating_point:
        # Elements within the replay's own distance from eager plus the table
        # (the step check holds them to the table of the replay): taken as eager's.
        e, a = expected.double(), actual.double()
        allowed = (slack.double() - e).abs() + max(tol.atol, floor) + tol.rtol * e.abs()
        actual = torch.where((a - e).abs() <= allowed, expected, actual)
    if expected.dtype.is_floating_point:
        # At the edge of the dtype's range one rounding more or less is the
        # difference between the largest finite value and an infinity (an fp16
        # product of K = 65537 terms: 65504 fused where eager's two roundings
        # gave inf).  An infinity against a finite value of the same sign
        # within the table of the largest finite one is that, not an error.
        edge = torch.finfo(expected.dtype).max * (1 - 2 * tol.rtol)
        both = torch.isinf(actual) ^ torch.isinf(expected)
        near = both & (torch.sign(actual) == torch.sign(expected)) & (torch.minimum(
            actual.double().abs(), expected.double().abs()) >= edge)
        if near.any():
            actual = torch.where(near, expected, actual)
        if nonfinite_in:
            # Fed infinities or NaNs, two orders of the same arithmetic give
            # NaN where the other gives an infinity: (x @ q) * s with s = inf
            # is inf, x @ (q * s) is NaN where q = 0.  Either is no number.
            both = ~torch.isfinite(actual) & ~torch.isfinite(expected)
            if end_to_end:
                # And a later op can turn one of the two into a number: relu
                # of that -inf is 0, of the NaN NaN (gelu(-inf) * u fused
                # against eager's 0.5 * x * (1 + erf(x)) = -inf * 0).  End to
                # end, a NaN on either side of a value computed from
                # non-finite inputs is no number to compare; each step was
                # checked on its own inputs without this allowance.
                both |= torch.isnan(actual) | torch.isnan(expected)
            if both.any():
                actual = torch.where(both, expected, actual)
    try:
        torch.testing.assert_close(actual, expected, atol=max(tol.atol * max(1.0, scale), floor), rtol=tol.rtol,
                                   equal_nan=True)
    except AssertionError as exc:
        finite = torch.isfinite(expected) & torch.isfinite(actual)
        err = (actual.double() - expected.double())[finite].abs().max().item() if finite.any() else float("nan")
        first = str(exc).strip().splitlines()
        return f"max abs error {err:.3g} ({'; '.join(first[:2])})"
    return None


# Inductor settings for the programs:
# - the FX graph cache off: random programs never hit it, the pass runs every
#   time and nothing piles up on disk;
# - emulate_precision_casts: by default Inductor keeps fused intermediates in
#   fp32 where eager rounds them to bf16/fp16; plain Inductor then disagreed
#   with eager beyond the table in 15 of 20 seeded programs (errors up to
#   0.047), and an output plain Inductor gets wrong cannot be charged to
#   fusepass.  With emulation: 0 of 20 (fp64 outputs of fp32 work aside, see
#   Step.precision);
# - scalar C++ kernels (simdlen 1): C++ compilation is most of a program's
#   time on CPU; vector kernels took 12% longer to build (61 s against 54 s
#   for 8 programs, cold cache, 2 cores).  fusepass's rewrites do not depend
#   on it.
INDUCTOR_CONFIG: dict[str, Any] = {"fx_graph_cache": False, "emulate_precision_casts": True, "cpp.simdlen": 1}


def _compile_run(program: Program, options: dict[str, Any]) -> tuple[tuple[torch.Tensor, ...], RewriteReport]:
    torch._dynamo.reset()
    reset_reports()
    compiled = torch.compile(program.fn(), backend="fusepass", options=options, fullgraph=True, dynamic=False)
    with torch._inductor.config.patch(INDUCTOR_CONFIG), interpreting_after_pass(not program.spec.inductor):
        out = compiled(*program.args)
    return out, last_report()


# -- options ---------------------------------------------------------------------------------


@functools.cache
def _ops_of(rule_name: str) -> frozenset[str]:
    """The fusepass ops a rule's replacements call (each form on its example inputs), and those its pre-trace
    route puts in graphs."""
    rule = next(r for r in rules() if r.name == rule_name)
    seen: set[str] = {op._schema.name.split("::")[-1] for op in rule.pretraced}

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "fusepass":
                seen.add(func._schema.name.split("::")[-1])
            return func(*args, **(kwargs or {}))

    for form in rule.forms:
        dtype = rule.dtypes[0]
        inputs = rule.inputs(form, dtype)
        params = list(inspect.signature(form.search).parameters)
        it = iter(inputs)
        args = [rule.scalars[p] if p in rule.scalars else next(it) for p in params]
        try:
            with Record():
                form.replace(*args)
        except Exception:  # noqa: BLE001 - a replacement that needs a graph: its ops stay unknown
            continue
    return frozenset(seen)


def _graph_ops(folder: str) -> set[str]:
    """The fusepass ops in the graphs fusepass handed on (``dump_graphs``' "after" files)."""
    found: set[str] = set()
    for path in Path(folder).glob("*.after.txt"):
        found.update(re.findall(r"fusepass\.([a-z0-9_]+)\.default", path.read_text()))
    return found


def _option_problems(program: Program, report: RewriteReport, folder: str) -> list[str]:
    """What the report and the compiled graphs did against the program's rule selection."""
    options = Options.parse(program.spec.options_dict())[0]
    problems = [f"{h.rule} rewrote though the options exclude it" for h in report.hits
                if not options.enabled(h.rule)]
    enabled = [r.name for r in rules() if options.enabled(r.name)]
    allowed = set().union(*(_ops_of(r) for r in enabled)) if enabled else set()
    reported = set().union(*(_ops_of(h.rule) for h in report.hits)) if report.hits else set()
    for op in sorted(_graph_ops(folder)):
        if op not in allowed:
            problems.append(f"fusepass::{op} is in the compiled graph though no rule the options select calls it")
        elif op not in reported:
            problems.append(f"fusepass::{op} is in the compiled graph but no hit in the report accounts for it")
    return problems


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype.is_floating_point and a.element_size() in (2, 4, 8):
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))
    return torch.equal(a, b)


def _mismatches(program: Program, out: Sequence[torch.Tensor]) -> list[str]:
    """Step by step (each step on the compiled values of its inputs), then end to end.

    End to end, a value computed in bf16/fp16 downstream of a rewrite may
    differ from eager by more than the table without anything being wrong: the
    fused op rounds once where eager rounds twice (one ulp of its output), and
    a later add that cancels (y + r with y ~ -r) keeps that absolute
    difference while the sum shrinks.  A 150-program run measured 0.0625 (one
    bf16 ulp at 8..16) on sums of magnitude ~0.1, against atol 0.016.  Such
    values get the table's atol scaled by the largest magnitude that flows
    into them (two ulps of it); the step-by-step check, which sees each
    rewrite on its own inputs, keeps the table as it is.

    A step whose eager run overflows in an intermediate (an fp16 matmul's
    result beyond 65504, scaled back into range after) gives an infinity
    where the fused op, which keeps the intermediate in fp32, gives the
    finite value: the step is then held to its own computation in fp64, and
    the values that depend on it are not compared end to end with eager.

    A value may also differ from eager by what its upstream values' allowed
    differences become through it: an fp32 quantized linear's output within
    its summation floor (3.6e-5 relative, K-term sums in another order), used
    as another linear's scale, moves that linear's output by the same relative
    amount, 4e-5 against the table's 1e-5 (four programs of a 415-program
    run); one bf16 ulp upstream of rsqrt(mean(x**3)) near zero moved it by 0.7
    (one program of 435).  Where the table fails, an element of a value whose
    step passed may differ by the table plus how far eager's own step moves
    when fed the compiled upstream values (the replay).  So end to end adds
    the drift of values no step checks; the step check holds every rewrite
    to the table on its own inputs.
    """
    found = []
    got = dict(zip(program.returned, out))
    env: dict[int, torch.Tensor] = {}
    replay: dict[int, torch.Tensor] = {}  # each checked value as eager computes it from the compiled inputs
    overflowed: set[int] = set()
    nonfinite: set[int] = set()  # values computed, at some step, from non-finite inputs
    for step in program.steps:
        ins = [program.args[i] if k == "a" else env[i] for k, i in step.ins]
        if any(k != "a" and i in overflowed for k, i in step.ins):
            overflowed.update(step.outs)
        fed = any(isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all())
                  for t in ins) or any(k != "a" and i in nonfinite for k, i in step.ins)
        if fed:
            nonfinite.update(step.outs)
        try:
            ref = step.fn(*ins)
        except Exception as exc:  # noqa: BLE001 - compiled values eager cannot take: say which differ
            differ = [f"v{i}: {_tstr(env[i])} (eager {_tstr(program.eager[i])})" for k, i in step.ins
                      if k != "a" and (env[i].shape != program.eager[i].shape or env[i].dtype != program.eager[i].dtype
                                       or env[i].stride() != program.eager[i].stride())]
            found.append(f"step ({step.text[:80]}) fails on the compiled values of its inputs "
                         f"({type(exc).__name__}: {str(exc)[:120]}); inputs unlike eager's: {differ or 'none'}")
            for j, r in zip(step.outs, step.outs):
                env[j] = got.get(j, program.eager[j])
            continue
        for j, r in zip(step.outs, ref):
            if step.checked:
                err = _compare(got[j], r, step.precision, floor=step.floor, nonfinite_in=fed)
                if err and _eager_overflowed(step, ins, got[j], r, list(step.outs).index(j)):
                    overflowed.add(j)
                    err = None
                if err and (tied := _eager_ties_lowest_first(step, ins, got[j], list(step.outs).index(j))) is not None:
                    err, r = None, tied
                if err and _closer_than_eager(step, ins, got[j], r, list(step.outs).index(j), step.floor):
                    err = None
                if err and fed and (chunked := _gdn_op_chunks(step, ins, got[j], list(step.outs).index(j))) is not None:
                    err, r = None, chunked
                if err and fed and (math := _sdpa_math(step, ins, got[j], list(step.outs).index(j))) is not None:
                    err, r = None, math
                if err:
                    found.append(f"v{j} step ({step.text.split(' = ', 1)[1][:80]}): {err}")
                elif isinstance(r, torch.Tensor):
                    replay[j] = r
                env[j] = got[j]
            else:
                env[j] = r
    for j in program.returned:
        if j in overflowed:
            continue
        half = program.precision[j] in (torch.float16, torch.bfloat16)
        err = _compare(got[j], program.eager[j], program.precision[j], program.scale[j] if half else 1.0,
                       program.floor[j], nonfinite_in=j in nonfinite, end_to_end=True)
        if err and j in replay:
            err = _compare(got[j], program.eager[j], program.precision[j], 1.0, program.floor[j],
                           nonfinite_in=j in nonfinite, end_to_end=True, slack=replay[j])
        if err:
            found.insert(0, f"v{j} end to end: {err}")
    return found


class _TopkTiesLowestFirst(TorchDispatchMode):
    """``aten.topk`` taking tied values in ascending index order, as the router op does
    (``fusepass.kernels.moe.router.topk_lowest_first``); eager's CPU top-k may take
    another of them (of [2, 0, 1, 2] it takes index 3)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.ops.aten.topk.default:
            return func(*args, **kwargs)
        x, k, dim, largest = (list(args) + [None] * 4)[:4]
        dim = kwargs.get("dim", -1 if dim is None else dim)
        largest = kwargs.get("largest", True if largest is None else largest)
        values, ids = torch.sort(x, dim=dim, descending=largest, stable=True)
        return values.narrow(dim, 0, k), ids.narrow(dim, 0, k)


def _if_agrees(step: Step, actual: torch.Tensor, answer: Callable[[], Any],
               nonfinite_in: bool = False) -> torch.Tensor | None:
    """``answer()`` (another right answer for the step's output) where ``actual`` matches it within
    the step's table, else None (also when it cannot be computed)."""
    try:
        alt = answer()
    except Exception:  # noqa: BLE001 - no alternative answer
        return None
    if not isinstance(alt, torch.Tensor) or _compare(actual, alt, step.precision, floor=step.floor,
                                                     nonfinite_in=nonfinite_in) is not None:
        return None
    return alt


def _eager_ties_lowest_first(step: Step, ins: list[torch.Tensor], actual: torch.Tensor,
                             index: int) -> torch.Tensor | None:
    """The step's output ``index`` run eagerly with top-k ties taken lowest index first,
    where ``actual`` matches that answer, else None (asked only where ``actual`` did
    not match eager's own).

    Which of two tied experts a top-k takes is the implementation's: a router
    rewritten inside a block the experts rule refused (relu between the
    projections, a long run) took expert 0 where eager took expert 3, their
    routing weights both 0.2899 (bf16 logits 1.125 and 1.125), and the block's
    output differed by 0.88.  Both are the block's answer.
    """
    def answer():
        with _TopkTiesLowestFirst():
            return step.fn(*ins)[index]

    return _if_agrees(step, actual, answer)


def _gdn_op_chunks(step: Step, ins: list[torch.Tensor], actual: torch.Tensor, index: int) -> torch.Tensor | None:
    """A ``gdn_chunk`` form's step output ``index`` recomputed at the op's chunk
    (``fusepass::gdn_chunk``'s 64 tokens, the forms' 16), where ``actual`` matches
    that answer (NaNs where it has them, the other values within the table), else
    None (asked only where ``actual`` did not match eager's own, on non-finite inputs).

    The chunked rule multiplies the triangular matrices' zeros by its values
    (0 * inf = NaN), so an infinity reaches every earlier token of its chunk:
    which tokens are NaN is the chunking's.  A long run (seed 20261156, program
    2031936244): a value fed from an earlier GDN block held inf at token 18 of
    heads 2 and 3; the form at chunks of 16 is NaN from token 16 of head 2, at
    64 and as the op from token 0 (the token-by-token recurrence from 18), the
    finite values the same; 512 outputs NaN in fusepass and finite in eager.
    Both are the block's answer.  Only this rule's forms (those the op
    replaces), and their mutations where the same node is mutated again.
    """
    block = step.block
    if block is None or block.rule != "gdn_chunk" or block.kind != "form" or step.remake is None:
        return None
    from ...kernels.gdn.reference import CHUNK
    from ...patterns import gdn_chunk

    def answer():
        with gdn_chunk.forms_chunk(CHUNK):
            fn = step.remake(ins)
            return fn(*ins)[index] if fn is not None else None

    return _if_agrees(step, actual, answer)


def _sdpa_math(step: Step, ins: list[torch.Tensor], actual: torch.Tensor, index: int) -> torch.Tensor | None:
    """The step's output ``index`` run eagerly with SDPA's math backend, where ``actual``
    matches that answer, else None (asked only where ``actual`` did not match eager's
    own, on non-finite inputs).

    SDPA's backends disagree on a row whose scores hold infinities of both signs (an
    inf in q): the math backend gives NaN (inf - inf), the CPU's fused kernel 0.  A
    ``decode_attention`` block (seed 1985101523 of the seeded run) gave NaN on the
    row holding q's -inf, as the math backend does, where eager's fused kernel gave
    0.  Both are SDPA's answer.
    """
    block = step.block
    if block is None or block.rule != "decode_attention":
        return None
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def answer():
        with sdpa_kernel(SDPBackend.MATH):
            return step.fn(*ins)[index]

    return _if_agrees(step, actual, answer, nonfinite_in=True)


def _fp64_truth(step: Step, ins: list[torch.Tensor], index: int) -> torch.Tensor | None:
    """The step's output ``index`` computed from its inputs in fp64 (explicit casts stay), or None
    where the step needs its dtypes."""
    try:
        truth = step.fn(*[t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                          for t in ins])[index]
    except Exception:  # noqa: BLE001 - a step that needs its dtypes has no fp64 truth
        return None
    return truth.double() if isinstance(truth, torch.Tensor) else None


def _eager_overflowed(step: Step, ins: list[torch.Tensor], actual: torch.Tensor, expected: torch.Tensor,
                      index: int) -> bool:
    """Whether ``expected`` (the step run eagerly) has infinities or NaNs where ``actual`` has other values
    because eager overflowed in an intermediate: the step run in fp64 agrees with ``actual`` within the table.

    An overflowed intermediate feeding a sum gives NaN where its infinities cancel, not only an infinity:
    fp16 int8 codes times an upstream fp16 linear's output as the scale (|code * scale| up to 5.3e6, over
    65504) made eager's dequantized weight inf, and x @ W.T with x of both signs inf - inf = NaN, where the
    fused op, the weight kept in fp32, gave the fp64 value to 4e-4 relative or the infinity it overflows to
    (two programs of a long run)."""
    if not (actual.dtype.is_floating_point and actual.shape == expected.shape):
        return False
    same = (actual == expected) | (torch.isnan(actual) & torch.isnan(expected))
    if not (~torch.isfinite(expected) & ~same).any():
        return False
    truth = _fp64_truth(step, ins, index)
    if truth is None:
        return False
    tol = tolerance(actual.dtype)
    a = actual.double()
    ok = (torch.isclose(a, truth, rtol=tol.rtol, atol=tol.atol, equal_nan=True)
          | (torch.isinf(a) & (truth.abs() > torch.finfo(actual.dtype).max) & (torch.sign(a) == torch.sign(truth))))
    return bool(ok.all())


def _closer_than_eager(step: Step, ins: list[torch.Tensor], actual: torch.Tensor, expected: torch.Tensor,
                       index: int, floor: float = 0.0) -> bool:
    """Whether ``actual`` is, element by element, within the table of the step's value in fp64 plus eager's
    own distance from it: where eager's roundings are amplified by what follows them, a fused op that
    keeps the intermediate in fp32 is off from eager by more than the table and nearer the true value.

    A quantized MLP's gate and up in one op (dequant_matmul_gated): eager rounds the dequantized weight
    and each product to bf16, then SiLU(gate) * up; gate and up near 100-300 (a random scale and zero
    point) are one bf16 ulp (0.5-1) from their fp32 value, and the product of two such values four ulps
    of a 12,800 (256 apart; one program of the seeded run).  A wrong value is off from fp64 by its own
    magnitude, not by eager's rounding: it still fails.  Explicit casts in the step stay casts in fp64."""
    if not (actual.dtype.is_floating_point and actual.shape == expected.shape and actual.dtype == expected.dtype):
        return False
    truth = _fp64_truth(step, ins, index)
    if truth is None or truth.shape != actual.shape:
        return False
    tol = tolerance(loosest([step.precision, expected.dtype], default=torch.float64))
    a, e, t = actual.double(), expected.double(), truth
    allowed = (e - t).abs() + max(tol.atol, floor) + tol.rtol * t.abs()
    ok = ((a - t).abs() <= allowed) | (a == e) | (torch.isnan(a) & torch.isnan(e))
    return bool(ok.all())


def run(program: Program, triton: bool | None = None) -> Outcome:
    """Compile ``program`` with fusepass, run it once, check it against eager and check the report."""
    t0 = time.perf_counter()
    triton = program.spec.triton if triton is None else triton
    on_cpu = all(a.device.type == "cpu" for a in program.args)
    # On a GPU the ops' CUDA implementations are the kernels; on CPU they need the interpreter.
    kernels = triton_on_cpu() if triton and on_cpu and interpreting() else contextlib.nullcontext()
    failures: list[str] = []
    inductor: list[str] = []
    report = None
    clear_kernel_fallbacks()
    pristine = [a.clone() for a in program.args]
    plain_options = {"disable_rules": [r.name for r in rules()]}
    options = program.spec.options_dict()
    dumps = tempfile.TemporaryDirectory(prefix="fusepass-diff-") if options else contextlib.nullcontext()
    with kernels, dumps as folder:
        if folder:
            options["dump_graphs"] = folder
        try:
            out, report = _compile_run(program, options)
        except Exception:  # noqa: BLE001 - fusepass must not take the program down
            failed = "compile or run failed:\n" + traceback.format_exc(limit=8)
            try:
                _compile_run(program, plain_options)
            except Exception as exc:  # noqa: BLE001
                inductor.append(f"plain Inductor fails too ({type(exc).__name__}): {failed}")
            else:
                failures.append(failed)
        else:
            changed = [f"a{i}" for i, (a, p) in enumerate(zip(program.args, pristine)) if not _same_bits(a, p)]
            if changed:
                failures.append(f"the compiled program wrote into its inputs {', '.join(changed)}")
                for a, p in zip(program.args, pristine):
                    a.copy_(p)
            found = _mismatches(program, out)
            if found:
                # Whose is it?  Plain Inductor on the same program.
                try:
                    plain, _ = _compile_run(program, plain_options)
                    plain_found = _mismatches(program, plain)
                except Exception:  # noqa: BLE001
                    plain_found = []
                same = {m.split(":")[0] for m in plain_found}
                # A value whose own step plain Inductor gets wrong the same way is
                # Inductor's end to end too: there its step's error compounds with
                # the upstream values' allowed differences (an fp32 bmm fed an
                # infinity, 2.75 off in both, times an upstream fp32 scale).
                wrong_steps = {m.split(" ")[0] for m in plain_found if m.split(" ")[1:2] == ["step"]}
                same |= {m.split(":")[0] for m in found if m.startswith(tuple(f"{v} end to end" for v in wrong_steps))}
                inductor += [m for m in found if m.split(":")[0] in same]
                failures += [m for m in found if m.split(":")[0] not in same]
            failures += _report_problems(program, report)
            if folder:
                failures += _option_problems(program, report, folder)
        fallbacks = kernel_fallbacks()
        if fallbacks:
            failures.append(f"kernels fell back: {fallbacks}")
        clear_kernel_fallbacks()
    return Outcome(program, report, failures, inductor, time.perf_counter() - t0)


def _report_problems(program: Program, report: RewriteReport) -> list[str]:
    problems = []
    for r in report.refusals:
        if not (r.reason or "").strip():
            problems.append(f"refusal without a reason: {r}")
    for g in report.graphs:
        problems += [f"note: {n}" for n in g.notes if "could not be traced" in n or "raised" in n]
    problems += [f"refusal from a crash: {r.rule}: {r.reason}" for r in report.refusals
                 if r.reason.startswith(("check raised", "explain raised", "replacement failed"))]
    options = Options.parse(program.spec.options_dict())[0]
    by_name = {r.name: r for r in rules()}
    # a block's rule, and the rules whose rewrites it starts from (Rule.builds_on), selected
    selected = [b for b in program.blocks
                if all(options.enabled(r) for r in (b.spec.rule, *by_name[b.spec.rule].builds_on))]
    must = sum(1 for b in selected if b.must_rewrite)
    if len(report.hits) < must:
        problems.append(f"{must} block(s) must be rewritten, {len(report.hits)} were; "
                        f"refusals: {sorted(set(report.reasons()))}")
    for b in selected:
        nm_reason = _near_miss_reason(b.spec)
        plain = not b.spec.mutation and all(o == Operand() for o in b.spec.operands)
        # (a near-miss drawn in a dtype its rule has no kernel for may be refused
        # for the dtype first: int4's group of 16 in fp64, three programs of a run)
        served = b.spec.dtype in next(r for r in rules() if r.name == b.spec.rule).dtypes
        if nm_reason and plain and served:
            if not any(nm_reason in r for r in report.reasons()):
                problems.append(f"{b.spec.label}: no refusal with {nm_reason!r}; got {sorted(set(report.reasons()))}")
    return problems


def _near_miss_reason(b: BlockSpec) -> str:
    if b.kind != "near-miss":
        return ""
    rule = next(r for r in rules() if r.name == b.rule)
    return next(n.reason for n in rule.near_misses if n.name == b.name)
