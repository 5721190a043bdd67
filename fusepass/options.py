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
- ``inline_kernels`` (default on): on CUDA, put the Triton kernels themselves
  in the graph so Inductor launches them from its generated code; off, the
  graph calls the ``fusepass::`` ops through the dispatcher (as on CPU).

Every other key is an Inductor config option and is passed through.  The same
settings can come from the environment: ``FUSEPASS_RULES``,
``FUSEPASS_DISABLE_RULES`` (comma lists), ``FUSEPASS_VERIFY=1``, ``FUSEPASS_INLINE_KERNELS=0``,
``FUSEPASS_DUMP_GRAPHS=folder``, ``FUSEPASS_PRETRACE=0``; explicit options win.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

from .rule import rules

OWN_KEYS = ("rules", "disable_rules", "verify", "dump_graphs", "inline_kernels", "pretrace")


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
    inline_kernels: bool = True
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
            "inline_kernels": options.pop("inline_kernels", env.get("FUSEPASS_INLINE_KERNELS", "1") != "0"),
            "pretrace": options.pop("pretrace", env.get("FUSEPASS_PRETRACE", "1") != "0"),
        }
        for key in ("verify", "inline_kernels", "pretrace"):
            if not isinstance(own[key], bool):
                raise TypeError(f"fusepass option {key!r} takes a bool, got {own[key]!r}")
        known = {r.name for r in rules()}
        for key in ("rules", "disable_rules"):
            unknown = [n for n in (own[key] or ()) if n not in known]
            if unknown:
                raise ValueError(f"fusepass option {key!r}: unknown rule(s) {unknown}; known: {sorted(known)}")
        return cls(**own), options

