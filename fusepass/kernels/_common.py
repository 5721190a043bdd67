"""Plumbing shared by the op files: the tolerance table and the kernel fallback.

A kernel that fails to compile or launch (a Triton version that rejects it, a
shape that runs out of shared memory, an injected failure in a test) must not
take the user's model down: ``run_kernel`` catches the failure, logs it once per
op, remembers it for the report, and returns the plain-torch result instead.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
import logging
import math
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, TypeVar

import torch
import torch.fx
import triton
import triton.language as tl
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import statically_known_true

try:  # grid-dependency control (programmatic dependent launch); Triton 3.6 has it
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    _HAS_GDC = True
except ImportError:  # a Triton without it: no launch asks for PDL (pdl_supported), the calls stay no-ops
    _HAS_GDC = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass

log = logging.getLogger("fusepass")
T = TypeVar("T")


@dataclass(frozen=True)
class Tol:
    atol: float
    rtol: float


# One table for every comparison of a fused op against its reference computed
# from the same inputs.  Half-precision entries allow two units in the last
# place (bf16: 2 * 2**-8, fp16: 2 * 2**-11 rounded up): the fused kernel
# rounds once where the unfused graph may round twice.
TOLERANCES: dict[torch.dtype, Tol] = {
    torch.float64: Tol(1e-10, 1e-10),
    torch.float32: Tol(1e-5, 1e-5),
    torch.float16: Tol(2e-3, 2e-3),
    torch.bfloat16: Tol(1.6e-2, 1.6e-2),
}


def tolerance(dtype: torch.dtype) -> Tol:
    return TOLERANCES[dtype]


def loosest(dtypes, default: torch.dtype = torch.float32) -> torch.dtype:
    """The least precise of the table's dtypes among ``dtypes`` (``default`` if none is in the table)."""
    known = [d for d in dtypes if d in TOLERANCES]
    return max(known, key=lambda d: (TOLERANCES[d].rtol, TOLERANCES[d].atol), default=default)


def interpreting() -> bool:
    """Whether Triton kernels run under the interpreter (on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; 1 elsewhere (the interpreter: fewest programs, fastest tests)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def on_device(t: torch.Tensor):
    """Triton launches on the current device: a tensor on cuda:1 needs a guard."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def row_view(t: torch.Tensor, n: int) -> torch.Tensor | None:
    """``t`` as an [M, n] view with unit column stride (any row stride: slices
    of wider rows, broadcast rows), or None where only a copy gives one."""
    if t.dim() == 2 and (n == 1 or t.stride(1) == 1):
        return t  # the common case, without the ~2 µs of a view
    if n != 1 and t.dim() and t.stride(-1) != 1:
        return None
    try:
        return t.view(flat_rows(t, n), n)
    except RuntimeError:  # leading dims that do not flatten into one row stride
        return None


def flat_rows(t: torch.Tensor, n: int):
    """The M of ``t`` seen as [M, n]: -1 cannot stand for it where n is 0 (a
    zero-size row has no size to divide by)."""
    return t.numel() // n if n else math.prod(t.shape[:-1])


def cdiv(a: int, b: int) -> int:
    """Ceiling division for launch grids.  triton.cdiv and next_power_of_2 are
    ConstexprFunctions in Triton 3.9: ~17 µs per call from Python (measured on
    the CPU machine), several calls per launch.  Written so that a symbolic
    size (a launch traced into a graph) gives a plain expression."""
    return (a + b - 1) // b


def rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """:func:`row_view`, or a contiguous [M, n] copy where no view exists."""
    view = row_view(t, n)
    return view if view is not None else t.contiguous().view(flat_rows(t, n), n)


# -- a scalar read at run time ---------------------------------------------------
#
# With ``dynamic=True`` torch does not specialise Python floats
# (``specialize_float=False``): an RMSNorm's eps reaches the graph as a 0-dim
# fp64 CPU input, whose value Dynamo does not guard on.  The ops take such an
# eps as ``eps_tensor`` and read it when they run: a 0-dim tensor on the
# kernel's device goes to the kernel as a pointer (loaded there, no host
# sync), any other as its value (a CPU tensor: read on the host, no device
# sync), as Inductor passes a 0-dim CPU graph input to its own kernels.


def eps_args(eps: float | torch.Tensor) -> tuple[float, torch.Tensor | None]:
    """An op's ``(eps, eps_tensor)`` for an eps that is a number or a 0-dim tensor."""
    return (0.0, eps) if isinstance(eps, torch.Tensor) else (eps, None)


def op_eps(eps: float, eps_tensor: torch.Tensor | None) -> float | torch.Tensor:
    """The eps an op body uses: ``eps_tensor`` when given (0-dim: one number
    per call; a broadcasting eps would change the output's shape), else ``eps``."""
    torch._check(eps_tensor is None or eps_tensor.dim() == 0,
                 lambda: f"eps_tensor must be 0-dim, got shape {tuple(eps_tensor.shape)}")
    return eps if eps_tensor is None else eps_tensor


def scalar_arg(value: float | torch.Tensor, like: torch.Tensor) -> float | torch.Tensor:
    """A float kernel argument given as a number or a 0-dim tensor: a tensor on
    ``like``'s device goes as a pointer (:func:`scalar_fp32` loads it), anything
    else as a Python float."""
    if isinstance(value, torch.Tensor):
        return value if value.device == like.device else float(value)
    return float(value)


@triton.jit
def rne_bf16(x):
    """x rounded to the nearest bf16 (ties to even), as fp32."""
    b = x.to(tl.uint32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.to(tl.float32, bitcast=True)


@triton.jit
def round_to(x, DT: tl.constexpr, EMU: tl.constexpr):
    """x.to(DT) rounded to nearest.  EMU (bf16 under the interpreter only): the
    interpreter's bf16 conversion truncates (Triton 3.9: twice the error of the
    GPU's rounding, and always toward zero, so roundings in a row add up)."""
    if EMU:
        return rne_bf16(x).to(DT)
    else:
        return x.to(DT)


def emulate_rounding(dtype: torch.dtype) -> bool:
    """The EMU flag of :func:`round_to` for a kernel rounding to ``dtype``."""
    return dtype == torch.bfloat16 and interpreting()


@triton.jit
def scalar_fp32(v, IS_PTR: tl.constexpr):
    # A number, or with IS_PTR a pointer to one (scalar_arg), in fp32.
    # Inductor passes Python floats to kernels it launches as fp64: the row
    # math stays in fp32.  A constexpr flag rather than a test of v's type:
    # Triton 3.6 (the GPU machine's) has no tl.to_tensor, and the interpreter
    # passes a Python float as it is.
    if IS_PTR:
        return tl.load(v).to(tl.float32)
    else:
        return tl.cast(v, tl.float32)


# -- programmatic dependent launch -------------------------------------------
#
# A kernel launched with PDL (a ``Launch`` of a kernel whose ``PDL`` argument
# is true) may start while the kernel before it in the stream is still
# running, once every program of that one
# has passed ``pdl_release`` (or ended): its programs sit resident and do
# what needs nothing of the previous kernel, then ``pdl_wait`` until it has
# ended and its writes are visible.  Rules for the kernels here:
# - a PDL kernel reads nothing before its ``pdl_wait`` unless the previous
#   kernel is one of the same op's, known to ``pdl_release`` only after its
#   own ``pdl_wait``: then what kernels before that one wrote has ended and
#   may be read early (another library's kernel may release earlier);
# - ``pdl_release`` goes after the kernel's own ``pdl_wait``.
# Without the launch attribute (the graph's inlined launches, other GPUs) both
# are no-ops; the constexpr keeps them out of the interpreter, which has no
# inline asm.


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait until the previous kernel has ended and its writes are visible."""
    if PDL:
        gdc_wait()


@triton.jit
def pdl_release(PDL: tl.constexpr):
    """Let the next kernel's programs start (each program of this one calls it)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def pdl_begin(PDL: tl.constexpr):
    """The first statement of a decode-path kernel (the GEMVs, norms, gated
    activation, attention, GDN's decode step; launched with PDL where its
    ``PDL`` is true): wait for the kernel before it, since every operand but
    the weights may be its output, then let the next launch's programs start,
    so they are resident when this kernel ends (H200, replayed decode steps: Llama-3-8B
    int4 8 layers 888.0 -> 855.2 µs).  An L2 prefetch of the weights before
    the wait was slower (893.6)."""
    pdl_wait(PDL)
    pdl_release(PDL)


def pdl_supported(t: torch.Tensor) -> bool:
    """Whether a launch on ``t``'s device may carry the PDL attribute (sm_90+)."""
    return _HAS_GDC and t.is_cuda and not interpreting() and _hopper_or_later(t.device)


def pdl_on(t: torch.Tensor) -> bool:
    """Whether a launch of the decode path's kernels (those that start with
    :func:`pdl_begin`, and the MoE router's and experts') on ``t``'s device
    carries PDL: where supported, unless ``FUSEPASS_PDL=0`` (read at each
    launch, so one process can time both)."""
    return pdl_supported(t) and os.environ.get("FUSEPASS_PDL", "1") != "0"


@functools.cache
def _hopper_or_later(device: torch.device) -> bool:
    return torch.version.cuda is not None and torch.cuda.get_device_capability(device)[0] >= 9


def is_ptr(value: float | torch.Tensor) -> bool:
    """The ``IS_PTR`` flag for a :func:`scalar_arg` result."""
    return isinstance(value, torch.Tensor)


class InjectedKernelFailure(RuntimeError):
    """Raised in place of a kernel launch when a test asks for a failure."""


_lock = threading.Lock()
_fallbacks: dict[str, str] = {}  # op name -> first failure, for the report
_injected: set[str] = {
    name.strip()
    for name in os.environ.get("FUSEPASS_INJECT_KERNEL_FAILURE", "").split(",")
    if name.strip()
}


@contextlib.contextmanager
def inject_failure(*ops: str) -> Iterator[None]:
    """Make the named ops' kernels fail (for testing the fallback path)."""
    with _lock:
        added = set(ops) - _injected
        _injected.update(added)
    try:
        yield
    finally:
        with _lock:
            _injected.difference_update(added)


def run_kernel(op: str, launch: Callable[[], T], fallback: Callable[[], T]) -> T:
    """Run ``launch``; on any failure run ``fallback`` and record why, once."""
    try:
        if op in _injected:
            raise InjectedKernelFailure(f"injected failure for {op}")
        return launch()
    except Exception as exc:  # noqa: BLE001 - any kernel failure falls back
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        with _lock:
            first = op not in _fallbacks
            if first:
                _fallbacks[op] = reason
        if first:
            log.warning("fusepass: kernel for %s failed (%s); using the plain torch path", op, reason)
        return fallback()


def kernel_fallbacks() -> dict[str, str]:
    """Ops whose kernels failed at run time in this process, with the first reason."""
    with _lock:
        return dict(_fallbacks)


def clear_kernel_fallbacks() -> None:
    with _lock:
        _fallbacks.clear()


# -- launches: one builder per kernel, two ways to run it -----------------------
#
# Every kernel launch is built once, by one builder function per kernel, as a
# ``Launch`` naming every argument of the kernel.  The op's CUDA body runs it
# (``Launch.run``); for a CUDA graph the same launch goes into the graph
# (``Launch.traced``), as ``triton_kernel_wrapper_functional`` -- what
# AOTAutograd makes of ``torch.library.triton_op`` -- and Inductor emits it in
# its generated code like one of its own kernels.  That saves the trip through
# the dispatcher and the op's Python launcher on every call: about 40 µs per
# op on an H200 host, measured (fusepass-compiled RMSNorm 4096x4096: 61 µs
# against the kernel's 21 µs).  Two argument lists for one kernel once
# disagreed on the GPU (the graph's launch missed an argument the direct one
# passed): here there is one, checked against the kernel's signature when it
# is built.  ``inline_kernels`` (an option) turns the graph path off.

_arg_names: dict[int, frozenset] = {}
_configured: dict[tuple, object] = {}  # (kernel, num_warps, num_stages) -> its one-config autotuner


def kernel_arg_names(kernel) -> frozenset:
    names = _arg_names.get(id(kernel))
    if names is None:
        names = _arg_names[id(kernel)] = frozenset(kernel.arg_names)
    return names


@dataclass(eq=False)
class Launch:
    """One launch of a Triton kernel: the grid, every argument by name (tensors,
    scalars and constexprs, defaults included), the arguments it writes, and
    the launch configuration.

    Inductor sizes its launcher from the arguments in the graph node, so one
    left to its default fails at run time (``launcher() missing ...``): a
    Launch that does not name exactly the kernel's arguments is refused here,
    on the CPU, in both paths."""

    kernel: Any
    grid: tuple
    args: dict[str, Any]
    outputs: tuple[str, ...] = ()
    num_warps: int = 4
    num_stages: int | None = None
    # Launched with programmatic dependent launch (see pdl_wait; ``run`` only):
    # what the kernel's own ``PDL`` argument says, so that a kernel whose waits
    # are compiled out is never launched early.
    pdl: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        names = kernel_arg_names(self.kernel)
        if self.args.keys() != names:
            missing = [n for n in self.kernel.arg_names if n not in self.args]
            unknown = sorted(set(self.args) - names)
            raise TypeError(f"{getattr(self.kernel, '__name__', self.kernel)}: a launch names every argument "
                            f"of the kernel (defaults too); missing {missing}, unknown {unknown}")
        if not set(self.outputs) <= names:
            raise TypeError(f"outputs {self.outputs} are not arguments of the kernel")
        self.pdl = bool(self.args.get("PDL", False))

    def _meta(self) -> dict[str, int]:
        return {"num_warps": self.num_warps} if self.num_stages is None else \
            {"num_warps": self.num_warps, "num_stages": self.num_stages}

    def _launch_meta(self) -> dict[str, Any]:
        # The graph's inlined launch (``traced``) has no way to carry the PDL
        # attribute through Inductor's launcher: there the kernel's waits are no-ops.
        return {**self._meta(), "launch_pdl": True} if self.pdl and not interpreting() else self._meta()

    def run(self) -> None:
        """Launch now (the op's CUDA body, the tuner, tests under the interpreter)."""
        self.kernel[self.grid](**self.args, **self._launch_meta())

    def warmup(self) -> None:
        """Compile without running (the tuner compiles its candidates in parallel first)."""
        self.kernel.warmup(**self.args, grid=self.grid, **self._launch_meta())

    def traced(self) -> dict[str, Tensor]:
        """The launch as a functional graph node; returns fresh tensors for the
        ``outputs`` (Inductor's reinplacing turns that back into writes into
        the buffers when nothing else reads them).  Shapes may be symbolic:
        the grid and the non-constexpr scalars stay expressions.

        Builds the node as ``torch.library.wrap_triton`` does (Triton's launch
        configuration as a one-config autotuner, a 3-D grid, arguments that
        are not graph values in the kernel side table), but for interpreted
        kernels too, so that the CPU tests run the node as the GPU does."""
        from torch._higher_order_ops.triton_kernel_wrap import (
            kernel_side_table,
            triton_kernel_wrapper_functional,
        )

        for name in self.outputs:  # a functional node returns a copy of each output: never one aliased
            t = self.args[name]
            if any(v is t for k, v in self.args.items() if k != name):
                raise TypeError(f"{getattr(self.kernel, '__name__', self.kernel)}: output {name!r} is also "
                                "passed as another argument")
        _memoize_kernel_analysis()
        graphable = {k: v for k, v in self.args.items() if isinstance(v, torch.fx.node.base_types)}
        constants = {k: v for k, v in self.args.items() if k not in graphable}
        grid = tuple(self.grid) + (1,) * (3 - len(self.grid))
        return triton_kernel_wrapper_functional(
            kernel_idx=kernel_side_table.add_kernel(self._configured_kernel()),
            constant_args_idx=kernel_side_table.add_constant_args(constants),
            grid=[grid],
            tma_descriptor_metadata={},
            kwargs=graphable,
            tensors_to_clone=list(self.outputs),
        )

    def _configured_kernel(self):
        if interpreting():  # the interpreter has no launch configuration
            return self.kernel
        key = (self.kernel, self.num_warps, self.num_stages)
        kernel = _configured.get(key)
        if kernel is None:
            config = triton.Config({}, **self._meta())
            kernel = _configured[key] = triton.autotune(configs=[config], key=[])(self.kernel)
        return kernel


# Inductor analyses each user-defined Triton kernel call in a graph (which
# tensors it reads and writes) from the kernel's TTIR, generated afresh for
# every call: 224 analyses of the int4 GEMV (0.17-0.63 s each, sm_90 TTIR) in
# a 32-layer Llama-3-8B, most of its 192 s compile on an H200 (int8: 53 s).
# The result depends only on the kernel and its arguments' values and dtypes,
# so fusepass's kernels are analysed once per distinct call and the answer
# copied; other kernels go to Inductor's function untouched.
_ANALYSES = ("identify_accessed_tensors", "identify_mutated_tensors")  # (the second: older torch)
_analysis_lock = threading.Lock()


def _analysis_key(kernel, kwargs: dict, rest: tuple) -> tuple | None:
    """What an analysis of ``kernel`` depends on, or None where an argument is of a kind not keyed."""
    parts = []
    for name in sorted(kwargs):
        v = kwargs[name]
        if v is None or isinstance(v, (bool, int, float, str)):
            parts.append((name, v))
        elif isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)) or type(v).__module__.startswith("sympy"):
            parts.append((name, "symbolic", str(v)))
        else:
            dtype = getattr(v, "dtype", None)
            if dtype is None and hasattr(v, "get_dtype"):
                dtype = v.get_dtype()
            if not isinstance(dtype, torch.dtype):
                return None
            parts.append((name, "tensor", str(dtype)))
    return (id(kernel), tuple(parts), repr(rest))


def _memoized(real: Callable) -> Callable:
    cache: dict[tuple, Any] = {}

    def analysis(kernel, kwargs, *rest):
        fn = getattr(kernel, "fn", kernel)
        try:
            key = _analysis_key(kernel, kwargs, rest) if getattr(fn, "__module__", "").startswith("fusepass.") \
                else None
        except Exception:  # noqa: BLE001 - an argument this key does not know: Inductor's own analysis
            key = None
        if key is None:
            return real(kernel, kwargs, *rest)
        with _analysis_lock:
            hit = cache.get(key)
        if hit is None:
            hit = real(kernel, kwargs, *rest)
            with _analysis_lock:
                cache[key] = hit
        return copy.deepcopy(hit)

    analysis.fusepass_memo = True
    analysis.__wrapped__ = real
    return analysis


def _memoize_kernel_analysis() -> None:
    from torch._higher_order_ops import triton_kernel_wrap

    for name in _ANALYSES:
        real = getattr(triton_kernel_wrap, name, None)
        if real is not None and not getattr(real, "fusepass_memo", False):
            memo = _memoized(real)
            setattr(triton_kernel_wrap, name, memo)
            ir = sys.modules.get("torch._inductor.ir")  # (where a torch version imports it by name)
            if ir is not None and getattr(ir, name, None) is real:
                setattr(ir, name, memo)


def run_all(launches: list[Launch]) -> None:
    for launch in launches:
        launch.run()


def trace_all(launches: list[Launch]) -> dict[int, Tensor]:
    """Trace ``launches`` in order, each reading what the earlier ones wrote:
    an argument that an earlier launch wrote is given that launch's traced
    output.  Returns {id(tensor as built): its last traced value}."""
    latest: dict[int, Tensor] = {}
    for launch in launches:
        args = {k: latest.get(id(v), v) if isinstance(v, Tensor) else v for k, v in launch.args.items()}
        out = Launch(launch.kernel, launch.grid, args, launch.outputs, launch.num_warps, launch.num_stages).traced()
        for name in launch.outputs:
            latest[id(launch.args[name])] = out[name]
    return latest


# -- inlined forms of the ops ---------------------------------------------------
#
# An op's inlined form takes the op's arguments and puts the op's launches
# into the graph being traced (``Launch.traced``), or says it cannot
# (``ok``): a shape its launch choice needs as a number, a run-time eps, an
# input the kernels do not take.  Rules put it in place of the op when they
# replace a match (:func:`call`); the engine replaces op nodes already in the
# graph (the pre-trace path's) the same way.

_inline = contextvars.ContextVar("fusepass_inline_kernels", default=False)
# What the pass will do with the rules' op calls after every rule ran (the graph's options): a rule may
# choose a form by it (an op call that stays a call where launches would have been inlined costs host
# time a call).
_inline_planned = contextvars.ContextVar("fusepass_inline_planned", default=False)


@contextlib.contextmanager
def _setting(var: contextvars.ContextVar, value: bool) -> Iterator[None]:
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def inline_kernels(enabled: bool):
    """While on, a rule's op call traces as its inlined launches (where the form takes the arguments)."""
    return _setting(_inline, enabled)


def planning_inline(enabled: bool):
    """The pass's rules run knowing whether their op calls will be inlined afterwards (:func:`inline_planned`)."""
    return _setting(_inline_planned, enabled)


def inline_planned() -> bool:
    """Whether the op calls that rules put in the graph now will be inlined (on CUDA) after the rules ran."""
    return _inline_planned.get()


def inline_enabled(t: torch.Tensor) -> bool:
    """True while the engine traces a replacement for a CUDA graph with inlining
    on, for a non-empty ``t`` whose last dim (which picks a kernel's block) is a
    plain int."""
    return (_inline.get() and t.device.type == "cuda" and t.dim() > 0 and isinstance(t.shape[-1], int)
            and statically_known_true(t.numel() != 0))


@dataclass(frozen=True)
class InlineForm:
    """``ok(*op_args)``: whether ``traced(*op_args)`` can stand for the op here."""

    ok: Callable[..., bool]
    traced: Callable[..., Any]


_inline_forms: dict[Any, InlineForm] = {}


def register_inline(op, ok: Callable[..., bool], traced: Callable[..., Any]) -> None:
    """Make ``traced`` the inlined form of ``op`` (an OpOverload) where ``ok``."""
    _inline_forms[op] = InlineForm(ok, traced)


def inline_forms() -> dict[Any, InlineForm]:
    return dict(_inline_forms)


def call(op, *args):
    """What a rule puts in a graph for ``op(*args)``: the op's inlined launches
    when the engine inlines kernels for a CUDA graph and the inlined form takes
    these arguments, else the op."""
    form = _inline_forms.get(op)
    if form is not None and _inline.get() and form.ok(*args):
        return form.traced(*args)
    return op(*args)
