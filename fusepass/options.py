"""fusepass's own options, split from the Inductor options passed through.

``torch.compile(m, backend="fusepass", options={...})`` takes:

- ``rules``: names of the only rules to run (default: all registered);
- ``disable_rules``: names of rules not to run;
- ``verify``: run each match and its replacement on random inputs at compile
  time and refuse any that disagree (the measured error goes in the report);
- ``dump_graphs``: a folder to write each graph to, before and after the pass
  (Inductor's FX graph cache is bypassed for such compiles, so the pass runs);
- ``pretrace`` (default on): route known GDN functions (``transformers``'
  ``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule``)
  to the ops before Dynamo traces them (:mod:`fusepass.pretrace`); off, every
  GDN call is traced and left to the graph-level rules;
- ``inline_kernels``: on CUDA, put the Triton kernels themselves in the graph
  so Inductor launches them from its generated code (the least host time a
  call); off, the graph calls the ``fusepass::`` ops through the dispatcher
  (as on CPU), whose launches may carry programmatic dependent launch and
  take split-K counters from a pool zeroed once, where an inlined launch can
  do neither (Inductor's launcher has no PDL for user kernels; its counters
  are zeroed in the graph).  Default: off when Inductor's CUDA graphs are on
  for the compile (``mode="reduce-overhead"``, ``triton.cudagraphs``), as
  the host time of an op call is then paid at capture only (H200, Qwen3-30B-A3B
  48 layers, one replayed decode step: 3613 µs through the ops, 3746 inlined);
  on otherwise.  A caller that captures the compiled step into a CUDA graph
  itself should pass ``False``.

Every other key must be an Inductor config option and is passed through.  The
same settings can come from the environment: ``FUSEPASS_RULES``,
``FUSEPASS_DISABLE_RULES`` (comma lists), ``FUSEPASS_VERIFY=1``, ``FUSEPASS_INLINE_KERNELS=0|1``,
``FUSEPASS_DUMP_GRAPHS=folder``, ``FUSEPASS_PRETRACE=0``; explicit options win.

**When options are checked.**  ``torch.compile`` gives a backend named by a
string no look at its options until it hands it the first graph: it keeps
them in a ``_TorchCompileWrapper`` and calls nothing of the backend's until
then.  The earliest point fusepass can reach is Dynamo's start-of-compile
callback, which runs before each frame is traced: :func:`arm` registers
:func:`_check_at_compile_start` there, and it finds the options of the
compile about to start (the backend is a local of Dynamo's ``_compile``) and
raises on a bad one, so a typo fails in a second, before tracing, not after
it inside ``BackendCompilerFailed``.  ``torch._dynamo.reset()`` removes
Dynamo's callbacks; the backend puts this one back at each graph, and checks
the options itself in any case (:meth:`Options.parse`).
"""

from __future__ import annotations

import difflib
import os
import sys
from dataclasses import dataclass
from typing import Any, Mapping

from .rule import rules

OWN_KEYS = ("rules", "disable_rules", "verify", "dump_graphs", "inline_kernels", "pretrace")


def _suggest(word: str, choices: Any) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _check_inductor_keys(options: Mapping[str, Any]) -> None:
    """Every key left once fusepass's own are taken must be an Inductor config option."""
    import torch._inductor.config as config

    known = getattr(config, "_config", None)  # what config.patch checks keys against
    if known is None:
        return  # a torch without it: Inductor's own patch reports the key
    for key in options:
        if key not in known:
            close = _suggest(key, OWN_KEYS)
            hint = close or _suggest(key, known)
            raise ValueError(
                f"unknown fusepass option {key!r}{hint} fusepass options: {', '.join(OWN_KEYS)}; "
                "other keys must be Inductor config options (torch._inductor.list_options())")


def _env_flag(value: str | None) -> bool | None:
    """An environment flag: unset or empty is None (the default decides), "0" False, anything else True."""
    return None if not value else value != "0"


def _names(value: Any, key: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = [v for v in value.split(",") if v.strip()]
    if not all(isinstance(v, str) for v in value):
        raise TypeError(f"fusepass option {key!r} takes rule names, got {value!r}")
    return tuple(v.strip() for v in value)


@dataclass(frozen=True)
class Options:
    rules: tuple[str, ...] | None = None
    disable_rules: tuple[str, ...] = ()
    verify: bool = False
    dump_graphs: str | None = None
    inline_kernels: bool | None = None  # None: by Inductor's CUDA graphs (resolved by the backend)
    pretrace: bool = True

    def enabled(self, rule: str) -> bool:
        return (self.rules is None or rule in self.rules) and rule not in self.disable_rules

    def cache_key(self) -> tuple[Any, ...]:
        # dump_graphs changes no output code, so it stays out of the cache key
        # (compiles that dump bypass the cache instead).
        return (self.rules, self.disable_rules, self.verify, self.inline_kernels, self.pretrace)

    @classmethod
    def parse(cls, options: Mapping[str, Any] | None) -> tuple[Options, dict[str, Any]]:
        """Split ``options`` into fusepass's Options and the Inductor config patches."""
        options = dict(options or {})
        env = os.environ
        own = {
            "rules": _names(options.pop("rules", env.get("FUSEPASS_RULES")), "rules"),
            "disable_rules": _names(options.pop("disable_rules", env.get("FUSEPASS_DISABLE_RULES")),
                                    "disable_rules") or (),
            "verify": options.pop("verify", env.get("FUSEPASS_VERIFY", "") not in ("", "0")),
            "dump_graphs": options.pop("dump_graphs", env.get("FUSEPASS_DUMP_GRAPHS") or None),
            "inline_kernels": options.pop("inline_kernels", _env_flag(env.get("FUSEPASS_INLINE_KERNELS"))),
            "pretrace": options.pop("pretrace", env.get("FUSEPASS_PRETRACE", "1") != "0"),
        }
        for key in ("verify", "inline_kernels", "pretrace"):
            if not isinstance(own[key], bool) and not (key == "inline_kernels" and own[key] is None):
                raise TypeError(f"fusepass option {key!r} takes a bool, got {own[key]!r}")
        known = {r.name for r in rules()}
        for key in ("rules", "disable_rules"):
            unknown = [n for n in (own[key] or ()) if n not in known]
            if unknown:
                hint = _suggest(unknown[0], known)
                raise ValueError(f"fusepass option {key!r}: unknown rule(s) {unknown}{hint} known: "
                                 f"{', '.join(sorted(known))}")
        _check_inductor_keys(options)
        return cls(**own), options


# -- checking the options before Dynamo traces ------------------------------------

try:  # an exception Dynamo raises as it is
    from torch._dynamo.exc import ShortenTraceback as _RaisedAsIs
except ImportError:  # a torch without it: the message still names the option
    _RaisedAsIs = Exception  # type: ignore[misc,assignment]


class OptionError(_RaisedAsIs, ValueError):  # type: ignore[misc]
    """A bad fusepass option, raised before Dynamo traces.  A plain ValueError raised there would reach
    the user wrapped in ``InternalTorchDynamoError``, and Dynamo's ``UserError`` is taken for a graph
    break (the frame then runs eagerly, the error swallowed)."""

    def __init__(self, message: str) -> None:
        if _RaisedAsIs is Exception:
            super().__init__(message)
        else:
            super().__init__(message, first_useful_frame=None)


_backend: Any = None  # the backend function whose compiles are checked (set by arm)


def arm(backend: Any) -> None:
    """Check the options of every compile with ``backend`` before Dynamo traces: registers
    :func:`_check_at_compile_start` with Dynamo (once; call again after ``torch._dynamo.reset()``)."""
    import torch._dynamo

    global _backend
    _backend = backend
    handler = torch._dynamo.callback_handler
    if _check_at_compile_start not in getattr(handler, "start_callbacks", ()):
        handler.register_start_callback(_check_at_compile_start)


def backend_options(fn: Any) -> tuple[bool, Any]:
    """(True, the raw ``options=``) when the compiler function ``fn`` is the fusepass backend, however
    Dynamo wrapped it (``WrapBackendDebug``, ``_TorchCompileWrapper``, ``functools.partial``);
    (False, None) otherwise.  :func:`arm` names the backend, so modules that ask (the pre-trace path)
    need not import it."""
    backend = _backend
    for _ in range(8):
        if fn is None or backend is None:
            return False, None
        if fn is backend:
            return True, None
        inner = getattr(fn, "compiler_fn", None)
        if inner is backend:
            return True, (getattr(fn, "kwargs", None) or {}).get("options")
        if getattr(fn, "func", None) is backend:  # functools.partial(backend, options=...)
            return True, fn.keywords.get("options")
        fn = getattr(fn, "_torchdynamo_orig_backend", None) or inner or getattr(fn, "__wrapped__", None)
    return False, None


def _compile_options() -> tuple[bool, Any]:
    """(True, options) when the compile Dynamo is starting uses the fusepass backend; (False, None) otherwise
    or when it cannot be told."""
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "_compile" and "compiler_fn" in frame.f_locals):
        frame = frame.f_back
    return backend_options(frame.f_locals["compiler_fn"] if frame is not None else None)


def _check_at_compile_start(args: Any) -> None:
    try:
        ours, options = _compile_options()
    except Exception:  # noqa: BLE001 - Dynamo's internals moved: the backend checks at the first graph
        return
    if ours:
        try:
            Options.parse(options)
        except (ValueError, TypeError) as exc:
            raise OptionError(str(exc)) from None

