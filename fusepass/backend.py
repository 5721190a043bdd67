"""The ``torch.compile`` backend: Inductor with fusepass's pass installed.

Registered through the ``torch_dynamo_backends`` entry point, so
``torch.compile(model, backend="fusepass")`` works without importing fusepass.
``mode=`` maps through Inductor's own table (``reduce-overhead`` gives CUDA
graphs, ``max-autotune`` autotuning); ``options=`` carries fusepass's options
(see :mod:`fusepass.options`) and any Inductor option.

Resolving ``backend="fusepass"`` imports this module, which arms the pre-trace
substitutions (:func:`fusepass.pretrace.arm`): they must be registered before
Dynamo traces, and the backend itself is only called after.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from typing import Any, Mapping, Sequence

import torch

from . import pretrace as _pretrace
from . import report as _report
from .engine import FusePass
from .options import Options

log = logging.getLogger("fusepass")
_graph_ids = itertools.count()
_pretrace.arm()


def _graph_id() -> str:
    try:
        cid = torch._guards.CompileContext.current_compile_id()
        if cid is not None:
            return str(cid)
    except Exception:  # noqa: BLE001 - best effort label only
        pass
    return f"g{next(_graph_ids)}"


def fusepass_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], mode: str | None = None,
                     options: Mapping[str, Any] | None = None) -> Any:
    from torch._inductor import list_mode_options
    opts, inductor_options = Options.parse(options)
    # list_mode_options(None) lists every mode; only a named mode maps to options.
    patches: dict[str, Any] = {**(list_mode_options(mode) if mode else {}), **inductor_options}
    user_pass = patches.get("post_grad_custom_pre_pass", torch._inductor.config.post_grad_custom_pre_pass)

    graph_id = _graph_id()
    on_cuda = any(isinstance(x, torch.Tensor) and x.is_cuda for x in example_inputs)
    # Kernels inlined into Inductor's code are compiled with the rest of the
    # graph: if that fails, compile again with the ops called through the
    # dispatcher (their launch failures fall back per call), and say so.
    attempts = [opts]
    if opts.inline_kernels and on_cuda:
        attempts.append(dataclasses.replace(opts, inline_kernels=False))
    t0 = time.perf_counter()
    for i, attempt in enumerate(attempts):
        last = i == len(attempts) - 1
        try:
            # The same graph module for a retry: AOTAutograd traces it without
            # changing it, and a copy would lose Dynamo's record of which
            # inputs are parameters (CUDA graphs would then copy every
            # parameter on every replay: measured, 205 copies per call).
            compiled, graph = _compile(gm, example_inputs, attempt, patches, user_pass, graph_id)
            break
        except Exception as exc:  # noqa: BLE001
            if last:
                raise
            note = (f"compiling with inlined kernels failed ({type(exc).__name__}: "
                    f"{str(exc).splitlines()[0][:200]}); compiled again with inline_kernels=False")
            log.warning("fusepass: %s", note)
    if i > 0:
        graph.notes.append(note)
    graph.compile_seconds = time.perf_counter() - t0
    _report.record(graph)
    return compiled


def _compile(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], opts: Options, patches: dict[str, Any],
             user_pass: Any, graph_id: str) -> tuple[Any, _report.GraphReport]:
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    graph = _report.GraphReport(graph_id=graph_id)
    pending: list[_report.GraphReport] = []
    fp = FusePass(opts, chained=user_pass, sink=pending.append, graph_id=graph_id)
    patches = {**patches, "post_grad_custom_pre_pass": fp}
    if opts.dump_graphs:
        # A cache hit would skip the pass and write nothing: asking for dumps
        # means compiling afresh.
        patches["fx_graph_cache"] = False

    def inner_compile(gm_: torch.fx.GraphModule, inputs_: Sequence[Any], **kwargs: Any) -> Any:
        # Called once per graph AOTAutograd hands Inductor (forward, backward).
        # On a miss the pass runs inside; on an FX-graph-cache hit it does not,
        # and the record stored under the same cache key tells what the cached
        # code holds.
        pending.clear()
        out = compile_fx_inner(gm_, inputs_, **kwargs)
        key = getattr(out, "_fx_graph_cache_key", None)
        if pending:
            part = _report.GraphReport(graph_id=graph.graph_id)
            for r in pending:
                part.merge(r)
            if key:
                _report.store(key, part)
        else:
            part = _report.load(key) if key else None
            graph.cache = "hit"
            if part is None:
                graph.notes.append(
                    "a graph came from Inductor's cache and fusepass's record of it is missing; "
                    "its rewrites are not listed (clear Inductor's cache to recompile it)")
        if part is not None:
            graph.merge(part)
        pending.clear()
        return out

    # AOTAutograd's own cache would skip Inductor's entirely, and with it the
    # cache key the record is filed under; the FX graph cache stays on.
    with torch._functorch.config.patch(enable_autograd_cache=False):
        compiled = compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=patches)
    return compiled, graph
