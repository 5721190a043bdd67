"""The rewrite report: what was replaced, where, what the fused ops move, and
why each near-miss was refused.

One :class:`GraphReport` per graph fusepass compiled; :func:`last_report`
gathers every graph since the last :func:`reset_reports`.  Reports render as
tables (``str(report)``), export as JSON (``report.to_json()``), and are logged
on the ``fusepass`` logger at INFO level.

On a warm cache (AOTAutograd's or Inductor's FX graph cache) no pass runs, so
the backend stores each graph's report beside Inductor's cache, under a key it
computes from the Dynamo graph, its inputs and fusepass's uuid
(:func:`fusepass.backend.record_key`), and restores it on a hit: the report of
a cached graph says ``cache: hit`` and still lists what the cached code
contains.
"""

from __future__ import annotations

import json
import logging
import os
import re
import textwrap
import threading
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("fusepass")

# Dynamo names a module by the source it reached it through: ``L['self']``
# for a module compiled directly, ``L['args'][0]`` where a wrapper passed
# ``self`` on (transformers 5's forward decorators), ``L['fn']`` for a
# compiled function's closure, ``L__self___`` in older torch.
_SOURCE_PREFIX = re.compile(r"^(?:[LG]\[(?:'[^']*'|\"[^\"]*\")\](?:\[\d+\])*\.?|L__self___)")


def module_path(raw: str) -> str:
    """``L['args'][0].model.layers.0.input_layernorm`` -> ``model.layers.0.input_layernorm``."""
    return _SOURCE_PREFIX.sub("", raw or "", count=1)


@dataclass
class Hit:
    rule: str
    form: str
    where: str  # module path in the user's model
    source: str  # file:line of the user's code
    bytes_moved: int  # per call: the fused op's inputs read once and outputs written once
    dtype: str = ""

    def __post_init__(self) -> None:
        self.where = module_path(self.where)


@dataclass
class Refusal:
    rule: str
    reason: str
    where: str
    source: str

    def __post_init__(self) -> None:
        self.where = module_path(self.where)


@dataclass
class GraphReport:
    graph_id: str
    cache: str = "miss"  # "miss": passes ran now; "hit": restored from the cache record
    hits: list[Hit] = field(default_factory=list)
    refusals: list[Refusal] = field(default_factory=list)
    attempts: Counter = field(default_factory=Counter)  # rule -> places it was tried
    match_seconds: float = 0.0
    compile_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["attempts"] = dict(self.attempts)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GraphReport:
        return cls(
            graph_id=d["graph_id"],
            cache=d.get("cache", "miss"),
            hits=[Hit(**h) for h in d.get("hits", [])],
            refusals=[Refusal(**r) for r in d.get("refusals", [])],
            attempts=Counter(d.get("attempts", {})),
            match_seconds=d.get("match_seconds", 0.0),
            compile_seconds=d.get("compile_seconds", 0.0),
            notes=list(d.get("notes", [])),
        )

    def merge(self, other: GraphReport) -> None:
        """Fold another pass run over the same Dynamo graph (e.g. the backward graph) in."""
        self.hits += other.hits
        self.refusals += other.refusals
        self.attempts.update(other.attempts)
        self.match_seconds += other.match_seconds
        self.notes += other.notes


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def _places(items: list[Any], limit: int = 2) -> str:
    """Module paths where there are some (file:line otherwise); the JSON has both."""
    seen: list[str] = []
    for it in items:
        label = it.where or it.source or "?"
        if label not in seen:
            seen.append(label)
    more = f" +{len(seen) - limit} more" if len(seen) > limit else ""
    return "; ".join(seen[:limit]) + more


@dataclass
class RewriteReport:
    graphs: list[GraphReport] = field(default_factory=list)

    @property
    def hits(self) -> list[Hit]:
        return [h for g in self.graphs for h in g.hits]

    @property
    def refusals(self) -> list[Refusal]:
        return [r for g in self.graphs for r in g.refusals]

    def count(self, rule: str) -> int:
        """Number of rewrites ``rule`` made."""
        return sum(1 for h in self.hits if h.rule == rule)

    def reasons(self, rule: str | None = None) -> list[str]:
        return [r.reason for r in self.refusals if rule is None or r.rule == rule]

    def to_dict(self) -> dict[str, Any]:
        from .kernels._common import kernel_fallbacks

        # Run-time fallbacks are per process, not per graph: listed once.
        return {"graphs": [g.to_dict() for g in self.graphs], "kernel_fallbacks": kernel_fallbacks()}

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **{"indent": 2, **kwargs})

    def __str__(self) -> str:
        if not self.graphs:
            return "fusepass: no graph compiled yet"
        hits, refusals = self.hits, self.refusals
        match_s = sum(g.match_seconds for g in self.graphs)
        compile_s = sum(g.compile_seconds for g in self.graphs)
        cached = sum(1 for g in self.graphs if g.cache == "hit")
        head = (
            f"fusepass rewrite report: {len(self.graphs)} graph(s)"
            + (f" ({cached} restored from the compile cache: rewrites as recorded when compiled)" if cached else "")
            + f", {len(hits)} rewrite(s), {len(refusals)} refusal(s); "
            f"matching {match_s:.2f} s of {compile_s:.2f} s compile"
        )
        attempts: Counter = Counter()
        for g in self.graphs:
            attempts.update(g.attempts)
        by_rule: dict[str, list[Hit]] = defaultdict(list)
        for h in hits:
            by_rule[h.rule].append(h)
        rule_names = sorted(set(attempts) | set(by_rule), key=lambda r: (-len(by_rule.get(r, [])), r))
        rows = []
        for rule in rule_names:
            rh = by_rule.get(rule, [])
            forms = Counter(h.form for h in rh)
            rows.append([
                rule,
                len(rh),
                attempts.get(rule, len(rh)),
                ", ".join(f"{f}×{n}" for f, n in sorted(forms.items())) or "-",
                _fmt_bytes(sum(h.bytes_moved for h in rh)),
                _places(rh) or "-",
            ])
        from tabulate import tabulate  # here: importing fusepass (a warm start) need not load it

        out = [head, ""]
        if rows:
            out.append(tabulate(rows, headers=["rule", "hits", "attempts", "forms", "fused bytes/call", "where"]))
            out.append("(fused bytes/call: what the fused ops read and write per call, a traffic floor; "
                       "not a saving against Inductor, which fuses most of these too)")
        grouped: dict[tuple[str, str], list[Refusal]] = defaultdict(list)
        for r in refusals:
            grouped[(r.rule, r.reason)].append(r)
        if grouped:
            out += ["", "refused (left to Inductor):"]
            # Reasons wrap between words; module paths never (a path cut mid-name reads as two).
            out.append(tabulate(
                [[rule, len(rs), textwrap.fill(reason, 60, break_long_words=False, break_on_hyphens=False),
                  _places(rs)] for (rule, reason), rs in sorted(grouped.items())],
                headers=["rule", "count", "reason", "where"],
            ))
        from .kernels._common import kernel_fallbacks

        fallbacks = kernel_fallbacks()
        if fallbacks:
            out += ["", "kernels that failed at run time (plain torch used instead):"]
            out.append(tabulate(sorted(fallbacks.items()), headers=["op", "first failure"]))
        notes = [n for g in self.graphs for n in g.notes]
        if notes:
            out += [""] + [f"note: {n}" for n in dict.fromkeys(notes)]
        return "\n".join(out)


_lock = threading.Lock()
_history: list[GraphReport] = []


def record(graph: GraphReport) -> None:
    with _lock:
        _history.append(graph)
    log.info(
        "fusepass: graph %s (%s cache): %d rewrite(s), %d refusal(s), matching %.3f s",
        graph.graph_id, graph.cache, len(graph.hits), len(graph.refusals), graph.match_seconds,
    )
    if log.isEnabledFor(logging.DEBUG):
        log.debug("%s", RewriteReport([graph]))


def last_report() -> RewriteReport:
    """The report of every graph fusepass compiled since the last :func:`reset_reports`."""
    with _lock:
        return RewriteReport(list(_history))


def reset_reports() -> None:
    with _lock:
        _history.clear()


# -- the record kept beside Inductor's cache ---------------------------------

def _store_dir() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(os.environ.get("FUSEPASS_CACHE_DIR") or Path(cache_dir()) / "fusepass")


def store(key: str, graph: GraphReport) -> None:
    path = _store_dir() / f"{key}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(graph.to_dict()))
        os.replace(tmp, path)
    except OSError as exc:  # a read-only cache dir must not fail the compile
        log.warning("fusepass: could not store the report for %s: %s", key, exc)


def load(key: str) -> GraphReport | None:
    try:
        return GraphReport.from_dict(json.loads((_store_dir() / f"{key}.json").read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None
