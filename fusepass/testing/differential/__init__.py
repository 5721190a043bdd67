"""Differential testing: random programs made of the registered rules' own
building blocks, compiled with fusepass and compared with eager.

A *block* is one rule's ``search`` function (the rule's reference semantics,
plain torch) or one of its declared near-misses, applied to operands drawn at
random, sometimes mutated into a near-miss:

- operands: a plain input, a matmul's output, a sum, or an earlier block's
  output (a residual stream); contiguous, transposed, a slice of wider rows,
  every other row, broadcast rows (stride 0), a broadcasting shape; another
  float dtype than the block's (mixed dtypes);
- sizes: hidden 0, 1, 7, 33, 4097, 65537, ...; leading dims (), (0,), (3,), (2, 3), ...;
- dtypes fp32/fp16/bf16 and fp64 (which must be refused or be correct);
- values: NaN, +Inf or -Inf in the main operand;
- scalars (eps) as Python numbers or as 0-d tensors (inputs, or computed in
  the graph), which the ops read when they run;
- mutations of the traced ATen graph of ``search``: an intermediate returned
  or used by another op, a reduction over another dim or without keepdim, a
  constant changed, an extra rounding, the operands of a commutative op swapped.

A *program* chains 5-10 blocks (one Dynamo graph, one Inductor compile) with
the ops real models put around them: matmuls, adds, pointwise ops.  Blocks
come from :func:`fusepass.rules`, so a rule registered later joins without a
change here; a rule whose example inputs cannot be resized by the default
(see ``Rule.sized_inputs``) declares how: the GDN rules map the drawn
``(*leading, hidden)`` to a batch, a sequence of one to three chunks and a
head size, and their forms (with their near-misses: another decay, no beta,
the state not carried, the keys scaled) become GDN programs.

Every program is compiled with fusepass (``fullgraph=True``, after
``torch._dynamo.reset()``; one in sixteen (and half the catalogue's programs) then through Inductor's lowering and
C++ code generation, the others run by the FX interpreter right after
fusepass's pass, which rewrites the same graph either way) and checked against eager within the dtype table
(``TOLERANCES``, taken for the least precise dtype a value went through):

- *step by step*: each step re-run eagerly on the compiled program's own
  values for its inputs, so that one rewrite is judged on its own rounding;
- *end to end*: each value the program returns against the eager program on
  the same inputs (see :func:`_mismatches` for the one allowance, measured);
- its inputs are left as they were;

and its report: every refusal carries a reason, no rule failed to trace or
crashed in ``check``, no kernel fell back, and at least as many rewrites as
blocks that nothing prevents from being rewritten (a form, unmutated, its
scalars numbers, its operands in its own dtype and shapes, any layout, in one
of the rule's dtypes).  A mismatch or a failed compile is
re-run with every rule disabled: where plain Inductor disagrees with eager
the same way it is Inductor's, reported apart.  With ``triton=True`` (drawn
for some programs) the ops' CUDA implementations serve CPU tensors,
so their Triton kernels run under ``TRITON_INTERPRET=1``.

The package, by concern: :mod:`.spec` (what is drawn), :mod:`.build`
(programs and their eager run), :mod:`.mutate` (near-miss mutations of a
block), :mod:`.kernels` (the Triton kernels on CPU), :mod:`.check`
(compiling and checking one program), :mod:`.stats` (a run's summary).
"""

from ...kernels._common import interpreting
from .build import BuiltBlock, Program, Step, build, default_sized_inputs
from .check import INDUCTOR_CONFIG, Outcome, run
from .kernels import _uncache_dispatch, cuda_impl, op_names, scoped_impls, triton_on_cpu
from .spec import (
    AFTER,
    FLOATS,
    HIDDEN,
    LAYOUTS,
    MUTATIONS,
    SOURCES,
    SPECIALS,
    BlockSpec,
    Operand,
    ProgramSpec,
    catalogue,
    catalogue_programs,
    draw_programs,
    strategies,
)
from .stats import KNOWN_INDUCTOR_BUGS, Stats, known_inductor_bug, reason_key

__all__ = [
    "AFTER", "FLOATS", "HIDDEN", "INDUCTOR_CONFIG", "KNOWN_INDUCTOR_BUGS", "LAYOUTS", "MUTATIONS",
    "SOURCES", "SPECIALS", "BlockSpec", "BuiltBlock", "Operand", "Outcome", "Program", "ProgramSpec", "Stats", "Step",
    "build", "catalogue", "catalogue_programs", "cuda_impl", "default_sized_inputs", "draw_programs", "interpreting",
    "known_inductor_bug", "op_names", "reason_key", "run", "scoped_impls", "strategies", "triton_on_cpu",
    "_uncache_dispatch",
]
