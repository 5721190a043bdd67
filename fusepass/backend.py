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

import contextlib
import contextvars
import dataclasses
import hashlib
import itertools
import logging
import time
from typing import Any, Iterator, Mapping, Sequence

import torch

from . import options as _options
from . import pretrace as _pretrace
from . import report as _report
from .engine import FusePass
from .matvec import quantized_matvec_stays_mm
from .options import Options
from .subclass import flatten_subclass_inputs

log = logging.getLogger("fusepass")
_graph_ids = itertools.count()
_pretrace.arm()

# Testing only (:mod:`fusepass.testing.differential`): after fusepass's pass,
# run the graph with the FX interpreter instead of Inductor's lowering and
# code generation, which are most of a CPU compile.  The graph run is the
# one Inductor would lower, fusepass's rewrites in it; only Inductor's own
# post-grad patterns (which turn nodes into lowering-only calls) are left out.
_interpret_after_pass = contextvars.ContextVar("fusepass_interpret_after_pass", default=False)


@contextlib.contextmanager
def interpreting_after_pass(enabled: bool = True) -> Iterator[None]:
    token = _interpret_after_pass.set(enabled)
    try:
        yield
    finally:
        _interpret_after_pass.reset(token)


def _interpreted(gm: torch.fx.GraphModule, inputs: Sequence[Any], fp: FusePass, is_inference: bool) -> Any:
    """The graph after fusepass's pass, run by the FX interpreter, in AOTAutograd's boxed calling
    convention.  The pass sees the graph Inductor would give it: views turned into reshapes, fake
    values propagated again, dead code eliminated, nodes reordered for locality (inference)."""
    from torch._inductor import config
    from torch._inductor.compile_fx import fake_tensor_prop
    from torch._inductor.fx_passes.post_grad import reorder_for_locality, view_to_reshape
    from torch._inductor.virtualized import V

    view_to_reshape(gm)
    with torch.no_grad():
        fake_mode = fake_tensor_prop(gm, inputs)
    gm.graph.eliminate_dead_code()
    if is_inference and config.reorder_for_locality:
        reorder_for_locality(gm.graph)
    with V.set_fake_mode(fake_mode):
        fp(gm.graph)
    gm.recompile()

    def run(args: list[Any]) -> Any:
        values = list(args)
        args.clear()
        return gm(*values)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _graph_id() -> str:
    try:
        cid = torch._guards.CompileContext.current_compile_id()
        if cid is not None:
            return str(cid)
    except Exception:  # noqa: BLE001 - best effort label only
        pass
    return f"g{next(_graph_ids)}"


# Inductor settings fusepass turns on for graphs of static shapes on CUDA
# unless the options set them (graphs with symbolic sizes keep Inductor's
# defaults: not measured there).  combo_kernels: Inductor's horizontal fusion
# of independent kernels into one launch.  In a decode step the kernels
# fusepass leaves to Inductor between its ops (q / k norms, RoPE, the cache
# writes) are independent of each other: H200, replayed decode steps at batch
# 1, 8 layers, int4 (00d17c8, one command each): Qwen3-30B-A3B 592.4 -> 555.8
# µs, Llama-3-8B 815.2 -> 783.9.
CUDA_INDUCTOR_DEFAULTS: dict[str, Any] = {"combo_kernels": True}


def fusepass_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], mode: str | None = None,
                     options: Mapping[str, Any] | None = None) -> Any:
    from torch._inductor import list_mode_options
    _options.arm(fusepass_backend)  # again after a torch._dynamo.reset()
    opts, inductor_options = Options.parse(options)
    # list_mode_options(None) lists every mode; only a named mode maps to options.
    patches: dict[str, Any] = {**(list_mode_options(mode) if mode else {}), **inductor_options}
    user_pass = patches.get("post_grad_custom_pre_pass", torch._inductor.config.post_grad_custom_pre_pass)

    graph_id = _graph_id()
    on_cuda = _on_cuda(example_inputs)
    notes: list[str] = []
    static = not _symbolic(example_inputs)
    defaults = {k: v for k, v in CUDA_INDUCTOR_DEFAULTS.items() if k not in patches} if on_cuda and static else {}
    patches = {**defaults, **patches}
    if opts.inline_kernels is None:  # the default: by whether Inductor replays the graph (fusepass.options)
        graphs = bool(patches.get("triton.cudagraphs", torch._inductor.config.triton.cudagraphs))
        opts = dataclasses.replace(opts, inline_kernels=not graphs)
        if graphs and on_cuda:
            notes.append("kernels called through the fusepass ops, not inlined: Inductor's CUDA graphs replay "
                         "them (option inline_kernels)")
    # Kernels inlined into Inductor's code are compiled with the rest of the
    # graph: if that fails, compile again with the ops called through the
    # dispatcher (their launch failures fall back per call), and say so.
    attempts = [(opts, patches, "")]
    if opts.inline_kernels and on_cuda:
        attempts.append((dataclasses.replace(opts, inline_kernels=False), patches, "with inline_kernels=False"))
    if defaults:  # fusepass's own Inductor settings are never what keeps a graph from compiling
        off = {k: v for k, v in patches.items() if k not in defaults}
        attempts.append((attempts[-1][0], off, f"without fusepass's Inductor settings {defaults}"))
    t0 = time.perf_counter()
    # Tensor-subclass parameters (torchao) are taken apart once, here, rather
    # than by AOTAutograd on every call; should that compile fail, the graph
    # is put back as Dynamo gave it and compiled once more.
    flat = flatten_subclass_inputs(gm, example_inputs)
    if flat is None:
        compiled, graph, used = _first_that_compiles(gm, example_inputs, attempts, notes, user_pass, graph_id)
    else:
        try:
            compiled, graph, used = _first_that_compiles(gm, flat.example_inputs, attempts, notes, user_pass,
                                                         graph_id)
            compiled = flat.wrap(compiled)
            notes.append(f"{flat.count} tensor-subclass parameter(s) taken apart once at compile time, "
                         "not by AOTAutograd on every call")
        except Exception as exc:  # noqa: BLE001
            flat.restore()
            fallback = [a for a in attempts if not (a[0].inline_kernels and on_cuda)] or attempts[-1:]
            notes.append(_failed(exc, "as Dynamo gave it (tensor-subclass parameters not taken apart)"))
            compiled, graph, used = _first_that_compiles(gm, example_inputs, fallback, notes, user_pass,
                                                         graph_id)
    if defaults and defaults.items() <= used.items():
        notes.append("Inductor settings fusepass chose on CUDA (static shapes): "
                     + ", ".join(f"{k}={v!r}" for k, v in defaults.items()) + " (the options override them)")
    graph.notes.extend(notes)
    graph.compile_seconds = time.perf_counter() - t0
    _report.record(graph)
    return compiled


_options.arm(fusepass_backend)  # options checked before Dynamo traces (see fusepass.options)


def _on_cuda(example_inputs: Sequence[Any]) -> bool:
    return any(isinstance(x, torch.Tensor) and x.is_cuda for x in example_inputs)


def _symbolic(example_inputs: Sequence[Any]) -> bool:
    """Whether Dynamo traced the graph with symbolic sizes (``dynamic=True``, or a dim marked
    dynamic after a recompile): Dynamo passes each free size as a SymInt input."""
    return any(isinstance(x, torch.SymInt) for x in example_inputs)


def _first_that_compiles(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                         attempts: list[tuple[Options, dict[str, Any], str]], notes: list[str],
                         *args: Any) -> tuple[Any, _report.GraphReport, dict[str, Any]]:
    """``_compile`` with each of ``attempts`` (options, Inductor patches, how the
    retry differs) in turn until one succeeds (the last one's error is raised);
    each failure is logged and noted.  Returns the compiled graph, its report and
    the Inductor patches it compiled with."""
    for i, (opts, patches, _) in enumerate(attempts):
        try:
            # The same graph module for a retry: AOTAutograd traces it without
            # changing it, and a copy would lose Dynamo's record of which
            # inputs are parameters (CUDA graphs would then copy every
            # parameter on every replay: measured, 205 copies per call).
            return (*_compile(gm, example_inputs, opts, patches, *args), patches)
        except Exception as exc:  # noqa: BLE001
            if i == len(attempts) - 1:
                raise
            notes.append(_failed(exc, attempts[i + 1][2]))
    raise AssertionError("no attempts")


def _failed(exc: Exception, redo: str) -> str:
    note = (f"compiling failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}); "
            f"compiled again {redo}")
    log.warning("fusepass: %s", note)
    log.debug("fusepass: the failed compile's exception", exc_info=exc)  # (a subprocess's traceback is in its text)
    return note

def _stable(value: Any) -> str:
    """A text for ``value`` that is the same in every process (no object addresses)."""
    if value is None or isinstance(value, (bool, int, float, str, bytes, torch.dtype, torch.device)):
        return repr(value)
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(map(_stable, value)) if isinstance(value, (set, frozenset)) else map(_stable, value)
        return f"{type(value).__name__}[{', '.join(items)}]"
    if isinstance(value, dict):
        items = sorted(value.items(), key=lambda kv: str(kv[0]))
        return "{" + ", ".join(f"{_stable(k)}: {_stable(v)}" for k, v in items) + "}"
    uuid = getattr(value, "uuid", None)
    if callable(uuid):
        try:
            return f"{type(value).__qualname__}(uuid={uuid()!r})"
        except Exception:  # noqa: BLE001 - fall through to the type name
            pass
    return type(value).__qualname__


def _tensor_meta(t: Any) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__ if isinstance(t, (torch.SymInt, torch.SymFloat, torch.SymBool)) else _stable(t)
    return (f"T({t.dtype}, {t.device.type}, {tuple(str(s) for s in t.shape)}, {tuple(str(s) for s in t.stride())}, "
            f"grad={t.requires_grad}, static={getattr(t, '_dynamo_static_input_type', None)})")


def record_key(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], pass_uuid: Any,
               patches: Mapping[str, Any]) -> str | None:
    """The key fusepass files a graph's report under: a warm start computes the same one.

    It covers what decides the post-grad graph the pass sees and what the pass
    does with it: the Dynamo graph's code (and its subgraphs'), the metadata
    of its inputs and attributes, grad mode, the pass's uuid (rule sources,
    fusepass options, torch version), the Inductor and functorch configs and
    the compile's own config patches.  Anything left out could only make two
    different compiles share a record; anything extra only costs a miss, so
    the key errs on the side of more.  ``None`` (no record kept) when the pass
    opted out of caching.
    """
    if pass_uuid is None:
        return None
    h = hashlib.sha256()

    def add(text: str) -> None:
        h.update(text.encode())
        h.update(b"\0")

    add(repr(pass_uuid))
    add(f"grad={torch.is_grad_enabled()}")
    for name, mod in gm.named_modules():
        add(name)
        add(mod.code if isinstance(mod, torch.fx.GraphModule) else type(mod).__qualname__)
    for name, t in itertools.chain(gm.named_parameters(), gm.named_buffers()):
        add(f"{name}: {_tensor_meta(t)}")
    for x in example_inputs:
        add(_tensor_meta(x))
    add(_stable(dict(patches)))
    for config in (torch._inductor.config, torch._functorch.config):
        try:
            add(_stable(config.save_config_portable()))
        except Exception:  # noqa: BLE001 - a torch without it: the patches and the uuid still count
            pass
    return h.hexdigest()


def _compile(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], opts: Options, patches: dict[str, Any],
             user_pass: Any, graph_id: str) -> tuple[Any, _report.GraphReport]:
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    graph = _report.GraphReport(graph_id=graph_id)
    pending: list[_report.GraphReport] = []
    fp = FusePass(opts, chained=user_pass, sink=pending.append, graph_id=graph_id)
    # The record of what the pass did is filed under a key computed here, from
    # what decides the pass's output (the Dynamo graph, its inputs' metadata,
    # the pass's uuid, the Inductor config): a warm start reaches it whichever
    # cache served the code (AOTAutograd's skips Inductor's compile entirely;
    # Inductor's FX graph cache skips only the post-grad passes).
    key = record_key(gm, example_inputs, fp.uuid(), patches)
    patches = {**patches, "post_grad_custom_pre_pass": fp}
    if opts.dump_graphs:
        # A cache hit would skip the pass and write nothing: asking for dumps
        # means compiling afresh.
        patches["fx_graph_cache"] = False
        key = None
    called: list[str] = []

    def inner_compile(gm_: torch.fx.GraphModule, inputs_: Sequence[Any], **kwargs: Any) -> Any:
        # Called once per graph AOTAutograd hands Inductor (forward, backward;
        # the backward possibly later, at the first backward call).
        part = "bw" if kwargs.get("is_backward") else "fw"
        called.append(part)
        pending.clear()
        if _interpret_after_pass.get() and not any(isinstance(x, torch.Tensor) and x.is_cuda for x in inputs_):
            out = _interpreted(gm_, inputs_, fp, bool(kwargs.get("is_inference", False)))
        else:
            out = compile_fx_inner(gm_, inputs_, **kwargs)
        # Inductor's FX graph cache keys the post-grad input graph: two Dynamo
        # graphs that differ only in no-ops (x.float() on fp32) share its
        # entry, so a hit there may come from another graph's compile; the
        # record is filed under that key too.
        fx_key = getattr(out, "_fx_graph_cache_key", None)
        keys = [k for k in (f"{key}-{part}" if key else None, fx_key) if k]
        if pending:
            _ran(graph, pending, keys)
        else:
            _restore(graph, keys)
        pending.clear()
        return out

    with quantized_matvec_stays_mm():
        compiled = compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=patches)
    if not called:
        # AOTAutograd's cache served every graph: nothing of Inductor ran.
        _restore(graph, [f"{key}-fw"] if key else [], also=[f"{key}-bw"] if key else [])
    return compiled, graph


def _ran(graph: _report.GraphReport, ran: list[_report.GraphReport], keys: list[str]) -> None:
    """Fold what the pass did now into ``graph`` and file it under ``keys``."""
    done = _report.GraphReport(graph_id=graph.graph_id)
    for r in ran:
        done.merge(r)
    for k in keys:
        _report.store(k, done)
    graph.merge(done)


def _restore(graph: _report.GraphReport, keys: list[str], also: list[str] = ()) -> None:
    """A cache hit ran no pass: fold in the first record found under ``keys`` (and any under ``also``).

    The record is also filed under the keys that lacked it: a graph served by
    Inductor's FX graph cache from another graph's compile (the two differ by a
    no-op) finds its record under that compile's FX key only, and the next
    process, served by AOTAutograd's cache, looks under this graph's own key.
    """
    graph.cache = "hit"
    records = [_report.load(k) for k in keys]
    found = next((r for r in records if r is not None), None)
    if found is None:
        graph.notes.append(
            "a graph came from the compile cache and fusepass's record of it is missing; "
            "its rewrites are not listed (clear Inductor's cache to recompile it)")
        return
    for k, r in zip(keys, records):
        if r is None:
            _report.store(k, found)
    graph.merge(found)
    for r in map(_report.load, also):
        if r is not None:
            graph.merge(r)
