"""The ops' Triton kernels on CPU tensors (``TRITON_INTERPRET=1``) and scoped implementations."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import torch

from ...kernels._common import interpreting
from ...patterns._moe import Verdicts


def op_names() -> list[str]:
    """Every op under ``torch.ops.fusepass``."""
    return sorted(name for name in dir(torch.ops.fusepass)
                  if isinstance(getattr(torch.ops.fusepass, name, None), torch._ops.OpOverloadPacket))


def cuda_impl(op: str) -> Callable[..., Any]:
    """The CUDA implementation (the Triton launcher) registered for ``fusepass::op``."""
    from torch._library.custom_ops import OPDEFS

    opdef = OPDEFS.get(f"fusepass::{op}")
    if opdef is None or "cuda" not in opdef._backend_fns:
        raise LookupError(f"fusepass::{op} has no CUDA implementation registered with torch.library.custom_op")
    return opdef._backend_fns["cuda"]


@contextlib.contextmanager
def triton_on_cpu(ops: Sequence[str] | None = None) -> Iterator[None]:
    """Serve the ops (default: all) on CPU tensors with their CUDA implementations.

    With ``TRITON_INTERPRET=1`` set before the kernels were decorated, that
    runs the Triton kernels under the interpreter, through the same launcher
    and fallback a GPU takes; compiled programs reach them through the
    dispatcher as they reach the CPU bodies.
    """
    if not interpreting():
        raise RuntimeError("triton_on_cpu needs TRITON_INTERPRET=1 set before fusepass is imported")
    with scoped_impls({op: cuda_impl(op) for op in ops or op_names()}, "CPU"):
        yield


def _uncache_dispatch(ops: Sequence[str]) -> None:
    for op in ops:
        packet = getattr(torch.ops.fusepass, op)
        for name in packet.overloads():
            cache = getattr(getattr(packet, name), "_dispatch_cache", None)
            if cache is not None:
                cache.clear()


@contextlib.contextmanager
def scoped_impls(impls: dict[str, Callable[..., Any]], key: str = "CPU") -> Iterator[None]:
    """Register ``impls`` (op name -> function) for fusepass ops under dispatch
    ``key`` for the duration.

    ``torch.library._scoped_library`` removes the kernels on exit, but not
    what the Python dispatcher (on in every Inductor compile) cached about
    them: each op overload keeps the key a call resolved to
    (``OpOverload._dispatch_cache``).  A call under the override caches
    ``CPU -> CPU``; after the override is gone, the next such call on CPU
    tensors jumps through the empty CPU slot and the process dies (a rule's
    verify in a later compile did, after tests/test_ops.py).  A call before the
    override caches ``CPU -> CompositeExplicitAutograd``, and that dispatcher
    then never sees the override.  The caches of the ops named are cleared
    once the override is in place and again once it is gone, and so are the
    MoE rules' verdicts, which hold for the implementation they ran (a verdict
    made on the torch body would otherwise admit a region the interpreted
    kernel, which truncates bf16, computes 0.047 off).
    """
    try:
        with torch.library._scoped_library("fusepass", "IMPL") as lib:
            for op, fn in impls.items():
                lib.impl(op, fn, key)
            _uncache_dispatch(list(impls))
            Verdicts.forget_all()
            yield
    finally:
        _uncache_dispatch(list(impls))
        Verdicts.forget_all()
