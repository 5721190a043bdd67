"""The benchmark registry's record type and helpers shared by the op files.

Each ``fusepass/bench/registry/<op>.py`` defines ``cases(quick: bool = False, device: str =
"cuda") -> list[Case]`` (inputs made on ``device``; ``quick`` with device
"cpu" means small shapes for CI) and joins the registry by being in this
folder.  ``fusepass bench`` (:mod:`fusepass.bench.ops`) checks every provider
of every case against the case's fp32 reference and times them all in one run.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any, Callable

import torch


@dataclass
class Case:
    op: str  # registry name, shared with the rule and the kernel file: "rms_norm"
    shape: str  # readable id: "4096x4096", "M1-N4096"
    dtype: torch.dtype
    make_inputs: Callable[[], tuple[Any, ...]]  # fresh random CUDA inputs
    reference: Callable[..., Any]  # fp32 (or fp64) reference from the same inputs
    providers: dict[str, Callable[..., Any]]  # "eager", "inductor", "fusepass", peers
    bytes_moved: int  # each input read once, each output written once
    notes: dict[str, str] = field(default_factory=dict)
    # Optional, for compute-bound ops: floating-point operations per call (TFLOP/s shown).
    flops: int | None = None
    # Optional: the relative-error-norm limit when the dtype table's rtol does
    # not fit (a recurrence, a quantized weight); say why where it is set.
    tolerance: float | None = None


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def lazy(make: Callable[[], Callable[..., Any]]) -> Callable[..., Any]:
    """A provider built on its first call (compiles and repacking cost nothing for cases never run)."""
    box: list[Callable[..., Any]] = []

    def fn(*args: Any) -> Any:
        if not box:
            box.append(make())
        return box[0](*args)
    return fn


def compiled(fn: Callable[..., Any], **kwargs: Any) -> Callable[..., Any]:
    """torch.compile with a fresh cache entry per case (dynamic off: fixed shapes).

    Dynamo keeps its cache on the function's code object, shared by every
    ``torch.compile`` of that function, and stops compiling a code object after
    ``recompile_limit`` (8) entries: one eager function compiled by two
    backends at 7 shapes got 4 compiled shapes per backend and ran the rest
    eagerly (torch 2.13, measured).  A copy with its own code object gets its
    own cache.
    """
    fresh = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    fresh.__kwdefaults__ = fn.__kwdefaults__
    return torch.compile(fresh, dynamic=False, **kwargs)


def inductor_providers(fn: Callable[..., Any], device: str, autotune: bool = False) -> dict[str, Callable[..., Any]]:
    """Inductor's default compile of ``fn``, and with ``autotune`` on CUDA its max-autotune compile
    too (CUDA graphs left to the timer: ``max-autotune-no-cudagraphs``)."""
    providers = {"inductor": compiled(fn)}
    if autotune and device == "cuda":
        providers["inductor-max-autotune"] = compiled(fn, mode="max-autotune-no-cudagraphs")
    return providers
