"""fusepass's ops: one file per op, each a Triton kernel, its launcher, and a
``torch.library`` custom op with fake, CUDA (Triton) and CPU (plain torch)
implementations. Importing a module registers its ops."""

import importlib

OP_MODULES = ("fusepass.kernels.rms_norm", "fusepass.kernels.rms_norm_gated", "fusepass.kernels.gated_act",
              "fusepass.kernels.gdn", "fusepass.kernels.dequant_matmul", "fusepass.kernels.moe",
              "fusepass.kernels.all_reduce_rms_norm")


def _load() -> None:
    """Import every op module so that its ``fusepass::`` ops exist."""
    for module in OP_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:  # a missing dependency, not a missing op file
                raise
