"""What a run drew and found, summed over its programs."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field, fields

from .check import Outcome


def reason_key(reason: str) -> str:
    """A refusal reason without the node names, shapes and numbers of one program."""
    s = re.sub(r"\b[a-z][a-z0-9_]*?_\d+\b", "<node>", reason)
    s = re.sub(r"\((?:[a-z_]+|<node>)\)", "(<node>)", s)
    s = re.sub(r"\((?:-?\d+(?:, )?)*,?\)", "(<shape>)", s)
    s = re.sub(r"\[(?:-?\d+(?:, )?)*\]", "[<dims>]", s)
    s = re.sub(r"\b\d+(?:\.\d+)?(?:e[-+]?\d+)?\b", "<n>", s)
    s = re.sub(r"users: [^)]*", "users: ...", s)
    return s


@dataclass
class Stats:
    programs: int = 0
    blocks: int = 0
    triton_programs: int = 0
    inductor_programs: int = 0  # through Inductor's code generation (the others: the FX interpreter after the pass)
    kinds: Counter = field(default_factory=Counter)
    mutations: Counter = field(default_factory=Counter)
    features: Counter = field(default_factory=Counter)
    dtypes: Counter = field(default_factory=Counter)
    hidden: Counter = field(default_factory=Counter)
    options: Counter = field(default_factory=Counter)
    dropped: int = 0
    must_rewrite: int = 0
    rewrites: Counter = field(default_factory=Counter)
    refusals: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    inductor: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, o: Outcome) -> None:
        p = o.program
        self.programs += 1
        self.triton_programs += bool(p.spec.triton)
        self.inductor_programs += bool(p.spec.inductor)
        self.blocks += len(p.blocks)
        self.options[", ".join(k for k, _ in p.spec.options) or "default"] += 1
        self.dropped += len(p.dropped)
        for b in p.blocks:
            self.kinds[b.spec.label] += 1
            self.mutations[b.spec.mutation or "none"] += 1
            self.features.update(b.features)
            self.dtypes[str(b.spec.dtype).replace("torch.", "")] += 1
            self.hidden[b.shape[-1] if b.shape else 1] += 1
            self.must_rewrite += b.must_rewrite
        if o.report is not None:
            for h in o.report.hits:
                self.rewrites[f"{h.rule}/{h.form}"] += 1
            for r in o.report.refusals:
                self.refusals[(r.rule, reason_key(r.reason))] += 1
        if o.failures:
            self.failures.append(p.listing() + "\n" + "\n".join(f"  !! {f}" for f in o.failures))
        if o.inductor:
            self.inductor.append(p.listing() + "\n" + "\n".join(f"  ?? {f}" for f in o.inductor))
        self.seconds += o.seconds

    def merge(self, other: Stats) -> None:
        """Add another run's counts (a worker process's, see :func:`run_specs`)."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(mine, Counter):
                mine.update(theirs)
            elif isinstance(mine, list):
                mine.extend(theirs)
            else:
                setattr(self, f.name, mine + theirs)

    def summary(self) -> str:
        lines = [
            f"fusepass differential run: {self.programs} programs ({self.triton_programs} on the Triton kernels, "
            f"{self.inductor_programs} through Inductor's code generation), "
            f"{self.blocks} blocks, {sum(self.rewrites.values())} rewrites, {sum(self.refusals.values())} refusals, "
            f"{len(self.failures)} failing programs, {len(self.inductor)} with Inductor-only mismatches, "
            f"{self.seconds:.0f} s",
            f"  blocks that must be rewritten: {self.must_rewrite}; drawn variants eager rejected "
            f"(simplified): {self.dropped}",
            "  blocks: " + ", ".join(f"{k} {n}" for k, n in sorted(self.kinds.items())),
            "  mutations: " + ", ".join(f"{k} {n}" for k, n in sorted(self.mutations.items())),
            "  options: " + ", ".join(f"{k} {n}" for k, n in sorted(self.options.items())),
            "  operands and values: " + ", ".join(f"{k} {n}" for k, n in sorted(self.features.items())),
            "  dtypes: " + ", ".join(f"{k} {n}" for k, n in sorted(self.dtypes.items())),
            "  hidden sizes: " + ", ".join(f"{k} {n}" for k, n in sorted(self.hidden.items())),
            "  rewrites: " + ", ".join(f"{k} {n}" for k, n in sorted(self.rewrites.items())),
            "  refusals by reason:",
        ]
        lines += [f"    {n:5d}  {rule}: {reason}" for (rule, reason), n in self.refusals.most_common()]
        if self.inductor:
            lines.append("  Inductor-only mismatches (plain Inductor disagrees with eager the same way), by last line:")
            last = Counter(_last_line(text) for text in self.inductor)
            lines += [f"    {n:5d}  {line[:160]}" + (" (known: see KNOWN_INDUCTOR_BUGS)" if known_inductor_bug(line) else "")
                      for line, n in last.most_common()]
        return "\n".join(lines)

    def unexplained_inductor(self) -> list[str]:
        """Inductor-only mismatches that are not a known Inductor bug."""
        return [text for text in self.inductor if not known_inductor_bug(text)]


# Inductor failures with a known cause outside fusepass: a program plain
# Inductor cannot compile or run is not held against the threshold on
# Inductor-only mismatches (it is still listed in the summary).
KNOWN_INDUCTOR_BUGS = {
    # Inductor's CPU lowering of an int8 weight-only matmul (mm of x and
    # int8 -> float weights times a scale) calls _weight_int8pack_mm, which
    # requires a contiguous weight; the quantized-linear near-misses with a
    # transposed or strided int8 weight hit it (torch 2.13, CPU; 5 of 206
    # seeded programs).
    re.escape("_weight_int8pack_mm_cpu : expect B to be contiguous"):
        "Inductor CPU int8 weight-only mm on a strided weight",
    # F.linear(x, w, bias) with x fp16/bf16 and not contiguous, bias fp32: eager
    # computes matmul then add_(bias) in place, an fp16/bf16 result; Inductor's
    # decomposition adds out of place and returns fp32 (torch 2.13, CPU; plain
    # torch.compile(backend="inductor") does the same).  The quantized-linear
    # forms with a bias meet it when the bias operand is drawn in fp32 (19 of
    # 415 programs of a long run).
    r"(dequant_fp32_bias|scale_before_bias|scale_col_cast_bias|scale_col_bias)\[(float16|bfloat16)\]\(.*\): "
    r"float32\[[0-9, ]*\] vs (float16|bfloat16)\[":
        "Inductor's F.linear decomposition promotes a half result to an fp32 bias's dtype",
}


def known_inductor_bug(text: str) -> str | None:
    """Why plain Inductor gets ``text``'s mismatch wrong, if it is a known Inductor bug (keys: regexes)."""
    return next((why for sig, why in KNOWN_INDUCTOR_BUGS.items() if re.search(sig, text)), None)


# Lines Dynamo appends to every error it re-raises: not the error.
_BOILERPLATE = ("Set TORCHDYNAMO_VERBOSE", "For even more developer context", "You can suppress this exception")


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines()
             if ln.strip().strip("^~ ") and not ln.strip().startswith(_BOILERPLATE)]
    return lines[-1] if lines else ""
