"""Plumbing shared by the op files: the tolerance table and the kernel fallback.

A kernel that fails to compile or launch (a Triton version that rejects it, a
shape that runs out of shared memory, an injected failure in a test) must not
take the user's model down: ``run_kernel`` catches the failure, logs it once per
op, remembers it for the report, and returns the plain-torch result instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, TypeVar

import torch

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
