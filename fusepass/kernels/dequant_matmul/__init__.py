"""Weight-only quantized linear: y = x @ dequant(W)^T (+ bias), in one op.

    x      [..., K]  fp32 / fp16 / bf16 activations
    weight            int8 [N, K]                    fmt "int8"
                      uint8 [N, K // 2]              fmt "int4": two 4-bit values per byte
                                                     along K, low nibble = even column,
                                                     high nibble = odd column
                      float8_e4m3fn [N, K]           fmt "fp8"
    scale             [N] (int8, fp8) or [N, K // group_size] (int4)
    zero              int4 only: [N, K // group_size] (asymmetric), or None for the
                      symmetric form with a fixed offset of 8
    W[n, k] = (q[n, k] - zero[n, k // G]) * scale[n, k // G]      (int4)
    W[n, k] = q[n, k] * scale[n]                                  (int8, fp8)
    y [..., N] in x's dtype

Other libraries' layouts, read where they lie (``fusepass.formats``,
``LIBRARY_FORMATS``): bitsandbytes' NF4 / FP4 ("nf4", "fp4": a 16-entry code
book times a per-block absmax, fp32 or double quantization's byte, which the
GEMV grids expand as they read and the other plans expand first), GPTQ's words packed along K on a [K, N]
weight with ``g_idx`` and the layer's shift table (``g_idx``, ``shifts``:
"gptq4", "gptq4_v1"), HQQ's halves packed along dim 0 ("hqq4").  At up to
eight rows HQQ's (even N), GPTQ's and the code books' layouts have GEMV
loops of their own, each stored byte read once with wide loads
(``gemv._hqq_gemv``, ``_gptq_gemv``, the int4 loop); from five rows (code
books) and nine (HQQ, even N) the ``mmt`` kernel reads them as words; the
rest (HQQ of odd N, GPTQ beyond eight rows, the ``mm`` kernel, dequantise +
cuBLAS) gathers each value from its layout (``tiles._library_tile``):
correct for any shape, not tuned for speed.  No shipped plans for them.

The product accumulates in fp32 with the scale applied to the fp32 result
(or to the dequantised tile), so it agrees within the dtype table with both
source forms the rules match: scale before the matmul (``x @ (q * s).T``) and
after (``(x @ q.T) * s``).

Four ways to run it on CUDA; a plan (``plans.lookup``) picks one per
``Problem`` (GPU, format, group, M bucket, N, K): measured on this machine by
``fusepass tune``, shipped for this GPU, or the heuristic.

- ``gemv``: one row (two for int4, a few on small weights).  A weight
  stream: each program owns BN output rows and a slice of K, loads the weight
  tile once, dequantises in registers and multiplies it into every row of x
  with fp32 FMAs.
- ``mmt``: from two rows to a few hundred.  Tensor cores on the product
  transposed, out^T = W x^T: the dequantised weight tile is the dot's A
  operand, x^T (rows padded to 16) the B operand, its K order the tile's
  (gathered, or copied into that order first: ``Config.xperm``); int4's, the
  code books' and HQQ's scales may be loaded one or two K steps ahead
  (``Config.ahead``).
- ``mm``: the same with x as the A operand, where it measured faster.
- ``cublas``: large M, where the product is compute-bound: one Triton pass
  writes the dequantised weight in x's dtype, then ``torch.mm``.  Fused
  tensor-core kernels measured slower there on an H100 (1.24-2.1x cuBLAS's
  time at M = 1024-4096, against 1.03-1.33x for this; Triton's own bf16 dot
  reached 1.16-1.39x): ``benchmarks/sweep_dequant_matmul_large_m.py``.

Where N alone gives too few programs to fill the SMs, K is split over
several (split-K); each tile's last program to arrive sums the slices, so a
split costs no second launch (``_finish`` and the counters in the launcher).

The op receives the user's weight on every call (a functional op cannot keep
a repacked copy), so every kernel reads the layouts above as they are.

Modules, in reading order: ``tiles`` (the Triton helpers the kernels share),
``gemv``, ``tensor_core`` (mm, mmt), ``dequant`` (the cuBLAS path's pass);
``config`` (Problem, Config, which configs run which problems), ``counters``
(split-K counters for eager launches), ``launch`` (one builder per kernel,
``_launch``), ``plans`` (lookup: user cache, shipped plans, heuristic),
``tuner`` (candidates timed on the GPU, only when asked), ``op`` (the op,
its reference and its inlined form), ``siblings`` (``dequant_matmul_siblings``:
two or three weights that read one x, in one GEMV launch), ``gated``
(``dequant_matmul_gated``: an MLP's gate and up with the activation, in one).
"""

from fusepass.kernels.dequant_matmul.config import BUCKETS, CUBLAS, GEMV_MAX_M, Config, Problem, m_bucket
from fusepass.kernels.dequant_matmul.gated import dequant_matmul_gated, dequant_matmul_gated_call
from fusepass.kernels.dequant_matmul.op import (
    dequant_matmul,
    dequant_matmul_call,
    dequant_matmul_fwd,
    dequant_matmul_reference,
    dequant_matmul_traced,
)
from fusepass.kernels.dequant_matmul.plans import dequant_matmul_plan, lookup
from fusepass.kernels.dequant_matmul.siblings import dequant_matmul_siblings, dequant_matmul_siblings_call
from fusepass.kernels.dequant_matmul.tuner import cold_copies, tune, tune_and_save

__all__ = [
    "BUCKETS", "CUBLAS", "Config", "GEMV_MAX_M", "Problem", "cold_copies", "dequant_matmul",
    "dequant_matmul_call", "dequant_matmul_gated", "dequant_matmul_gated_call", "dequant_matmul_fwd",
    "dequant_matmul_siblings", "dequant_matmul_siblings_call", "dequant_matmul_plan", "dequant_matmul_reference",
    "dequant_matmul_traced", "lookup", "m_bucket", "tune", "tune_and_save",
]
