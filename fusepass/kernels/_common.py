"""Plumbing shared by the op files: the tolerance table and the kernel fallback.

A kernel that fails to compile or launch (a Triton version that rejects it, a
shape that runs out of shared memory, an injected failure in a test) must not
take the user's model down: ``run_kernel`` catches the failure, logs it once per
op, remembers it for the report, and returns the plain-torch result instead.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, TypeVar

import torch
import triton
import triton.language as tl

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
        return t.view(-1, n)
    except RuntimeError:  # leading dims that do not flatten into one row stride
        return None


def cdiv(a: int, b: int) -> int:
    """Ceiling division for launch grids.  triton.cdiv and next_power_of_2 are
    ConstexprFunctions in Triton 3.9: ~17 µs per call from Python (measured on
    the CPU machine), several calls per launch."""
    return -(-a // b)


def rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """:func:`row_view`, or a contiguous [M, n] copy where no view exists."""
    view = row_view(t, n)
    return view if view is not None else t.contiguous().view(-1, n)


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


# -- kernels launched by Inductor's own generated code -------------------------
#
# A rewrite that calls a custom op costs a trip through the dispatcher and a
# Python launcher on every call: about 40 µs per op on an H200 host, measured
# (fusepass-compiled RMSNorm 4096x4096: 61 µs against the kernel's 21 µs).
# When the graph runs on CUDA the rules instead put the Triton kernel itself
# into the graph, as ``triton_kernel_wrapper_functional`` -- what AOTAutograd
# makes of ``torch.library.triton_op`` -- and Inductor emits the launch in its
# generated code like one of its own kernels.  ``inline_kernels`` turns this
# off (the custom op is then called, as on CPU).

_inline = contextvars.ContextVar("fusepass_inline_kernels", default=False)


@contextlib.contextmanager
def inline_kernels(enabled: bool) -> Iterator[None]:
    token = _inline.set(enabled)
    try:
        yield
    finally:
        _inline.reset(token)


def inline_enabled(t: torch.Tensor) -> bool:
    """True while the engine traces a replacement for a CUDA graph with inlining
    on, for a non-empty ``t`` whose last dim (which picks a kernel's block) is a
    plain int."""
    return (_inline.get() and t.device.type == "cuda" and t.dim() > 0 and isinstance(t.shape[-1], int)
            and t.numel() != 0)


def missing_args(kernel, args: tuple, kwargs: dict) -> list[str]:
    """The kernel's parameters that neither ``args`` nor ``kwargs`` give."""
    return [name for name in kernel.arg_names[len(args):] if name not in kwargs]


def launch_traced(kernel, grid: tuple, outputs: list[str], *args, **kwargs) -> dict[str, torch.Tensor]:
    """Trace ``kernel[grid](*args, **kwargs)`` as a functional graph node.

    ``outputs`` names the kernel arguments it writes; the node returns fresh
    tensors for them (Inductor's reinplacing pass turns that back into a
    write into the buffer when nothing else reads it).

    Every argument of the kernel must be given, constexprs with defaults
    included: Inductor sizes its launcher from the arguments in the node, and
    one left to its default fails at run time (``launcher() missing ...``).
    """
    missing = missing_args(kernel, args, kwargs)
    if missing:
        raise TypeError(f"{kernel.__name__}: a launch in a graph passes every argument (defaults too); "
                        f"missing {missing}")
    from torch._higher_order_ops.triton_kernel_wrap import (
        TraceableTritonKernelWrapper,
        TracingTritonHOPifier,
        triton_kernel_wrapper_functional,
    )

    class Functional(TracingTritonHOPifier):
        def call_HOP(self, variable, grids, combined_args, tx):  # noqa: N802 - torch's name
            graphable, constant_args_idx = self.store_non_graphable_args(combined_args)
            return triton_kernel_wrapper_functional(
                kernel_idx=variable.kernel_idx,
                constant_args_idx=constant_args_idx,
                grid=grids,
                tma_descriptor_metadata={},
                kwargs=graphable,
                tensors_to_clone=list(outputs),
            )

    wrapper = TraceableTritonKernelWrapper(kernel, None, grid)
    return Functional().call_triton_kernel(wrapper, args, kwargs, None)
