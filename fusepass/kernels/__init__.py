"""fusepass's ops.  Every op has one structure, in one file (or, for a large
op, one package with a module per step):

1. **Triton kernels** (``@triton.jit``), plain functions of pointers, sizes
   and constexprs.
2. **One launch builder per kernel**: a function of the op's (checked)
   tensors returning a :class:`~fusepass.kernels._common.Launch` -- the grid,
   every kernel argument by name, the arguments it writes, warps and stages.
   It is the only place the argument list is written; a Launch naming
   anything but exactly the kernel's arguments is refused when built.
3. **The custom op** ``fusepass::<op>`` (``torch.library.custom_op``,
   functional) with a fake implementation, a CUDA implementation that runs
   the launches (``Launch.run``; a kernel that fails falls back to the
   reference through ``run_kernel``), and a CPU implementation in plain
   torch, which is also the reference the tests compare against.
4. **The inlined form**: the same launches put into the graph
   (``Launch.traced``, ``trace_all``), registered with ``register_inline``
   with the test of when it applies (CUDA, the shapes its launch choices
   need as numbers, inputs its kernels take).  On CUDA, rules put it in
   place of the op (``call``) and the engine replaces op nodes already in
   the graph by it (:func:`fusepass.regions.inline_op_nodes`): Inductor then
   launches the kernels from its generated code and no call pays the
   dispatcher.  Where the form does not apply, the op is called.

Launch choices that depend on measurements (dequant_matmul's plans) are
looked up when compiling, never measured there: ``fusepass tune`` measures.
Importing a module registers its ops.

Ops: ``rms_norm`` (rms_norm, add_rms_norm), ``rms_norm_gated``, ``gated_act``
(swiglu, geglu), ``gdn/`` (gdn_chunk, gdn_recurrent), ``causal_conv1d``
(causal_conv1d, causal_conv1d_update), ``dequant_matmul/``, ``moe/``, ``all_reduce_rms_norm``,
``linear_siblings``, ``decode_attention``.
"""

import importlib

OP_MODULES = ("fusepass.kernels.rms_norm", "fusepass.kernels.rms_norm_gated", "fusepass.kernels.gated_act",
              "fusepass.kernels.gdn", "fusepass.kernels.causal_conv1d", "fusepass.kernels.dequant_matmul",
              "fusepass.kernels.moe", "fusepass.kernels.all_reduce_rms_norm",
              "fusepass.kernels.linear_siblings", "fusepass.kernels.decode_attention")


def _load() -> None:
    """Import every op module so that its ``fusepass::`` ops exist."""
    for module in OP_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:  # a missing dependency, not a missing op file
                raise


def fingerprint() -> str:
    """A digest of the data, not code, that the ops' launch choices read while
    compiling (the dequant_matmul plans, the all-reduce's one-shot limit, which
    decides whether a boundary is inlined): part of the compile cache's key."""
    from fusepass.kernels import all_reduce_rms_norm
    from fusepass.kernels.dequant_matmul.plans import fingerprint as plans

    return f"{plans()}|one-shot {all_reduce_rms_norm.ONE_SHOT_MAX_BYTES}"
