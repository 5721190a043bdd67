"""Gated DeltaNet (GDN) linear attention: chunked prefill and recurrent decode.

Per batch and value head, with the state S in R^{d_k x d_v} kept in fp32, for
each token t (q scaled by ``scale``, q and k L2-normalised first when
``use_qk_l2norm``):

    S <- exp(g_t) S
    S <- S + beta_t k_t (v_t - S^T k_t)^T
    o_t = S^T q_t

Inputs as ``transformers``' ``torch_chunk_gated_delta_rule`` /
``torch_recurrent_gated_delta_rule`` receive them: q, k ``[B, T, H_k, d_k]``,
v ``[B, T, H_v, d_v]``, g (log decay) and beta ``[B, T, H_v]``, an optional
initial state ``[B, H_v, d_k, d_v]``.  H_v is a multiple of H_k: value head h
reads key head ``h // (H_v // H_k)`` (``repeat_interleave`` on the head dim).
Outputs: o ``[B, T, H_v, d_v]`` contiguous in q's dtype, and the final state
``[B, H_v, d_k, d_v]`` contiguous in fp32 (always returned; a caller that
does not want it drops it).

``gdn_chunk`` and ``gdn_recurrent`` compute the same function; they differ in
the algorithm their kernels use (chunked for prefill, a token loop for
decode and short T).  On CUDA, fp16/bf16/fp32 inputs with d_k <= 256:

- ``gdn_chunk``, T > 16: the within-chunk system's inverse (one warp a
  chunk), then w and u (and the output's causal matrix where the scan
  follows) with 64-row products; then, where the grid fills the GPU one and a
  half times over, one fused scan (state and output in one sequential loop,
  nothing per chunk stored but o), else the state pass and the output
  kernel (parallel over chunks); no copies of q, k, v (strided
  [B, T, H, D] views are read in place, grouped value heads index their key
  head); then the recurrent kernel for the heads with some g > 0, where
  the chunked form is ill conditioned (the others' programs return);
- ``gdn_chunk`` with T <= 16, and ``gdn_recurrent``: one launch of the
  recurrent kernel (state read once, written once);
- anything else (fp64, mixed q/k/v dtypes, d_k > 256) and a kernel that
  fails: the plain-torch bodies.

Numerics: gates and the state in fp32, the within-chunk inverse computed in
fp32 (tf32 block products) and stored in q's dtype; the dots on bf16/fp16
operands with fp32 accumulation for half-precision inputs, ieee fp32 for
fp32 inputs.  H200, bf16, B1-16, T 512-16384, H32 D128: relative error norm
4.07e-3 against the fp64 chunked form (FLA 0.6: 4.40e-3 on the same strided
inputs, 3.71e-3 on contiguous normalised ones).
"""

from fusepass.kernels.gdn.launch import RECURRENT_MAX_T, chunk_launches, gdn_chunk_fwd, gdn_recurrent_fwd, kernel_supported
from fusepass.kernels.gdn.op import gdn_chunk, gdn_recurrent
from fusepass.kernels.gdn.reference import CHUNK, L2NORM_EPS, gdn_chunk_torch, gdn_reference

__all__ = ["CHUNK", "L2NORM_EPS", "RECURRENT_MAX_T", "chunk_launches", "gdn_chunk", "gdn_chunk_fwd", "gdn_chunk_torch", "gdn_recurrent",
           "gdn_recurrent_fwd", "gdn_reference", "kernel_supported"]
