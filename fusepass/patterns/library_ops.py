"""Quantization libraries' opaque ops that no fusepass rule takes: a report line each.

A quantized model made by a library fusepass does not read (its CUDA
kernels registered as custom ops: gptqmodel's Marlin / ExLlama kernels,
AutoAWQ's GEMM, gemlite, torchao's low-bit kernels) reaches the
graph as one opaque op per linear, which Inductor cannot look inside and
fusepass does not replace.  This rule replaces nothing: it names each such
op in the report, with what a user can do instead (fusepass.load_quantized
for GPTQ, AWQ and compressed-tensors checkpoints, the plain-torch forms the
dequant_matmul rules fuse).  bitsandbytes' ops are the dequant_matmul_bnb
rule's.
"""

from __future__ import annotations

import torch
import torch.fx

from fusepass.rule import Region, Rule

# namespace -> what fusepass offers instead
LIBRARIES = {
    "gptqmodel": "load the checkpoint with fusepass.load_quantized(model, state_dict, 'gptq') instead",
    "autogptq": "load the checkpoint with fusepass.load_quantized(model, state_dict, 'gptq') instead",
    "awq": "load the checkpoint with fusepass.load_quantized(model, state_dict, 'awq') instead",
    "autoawq": "load the checkpoint with fusepass.load_quantized(model, state_dict, 'awq') instead",
    "gemlite": "HQQ's PYTORCH backend gives the form fusepass fuses (dequant_matmul_hqq)",
    "hqq": "HQQ's PYTORCH backend gives the form fusepass fuses (dequant_matmul_hqq)",
    "torchao": "torchao's Int8WeightOnlyConfig is fused (dequant_matmul_torchao); its other kernels are not",
}


def find(gm: torch.fx.GraphModule):
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        advice = LIBRARIES.get(target.namespace)
        if advice is None:
            continue
        name = f"{target.namespace}::{target.overloadpacket.__name__}"
        yield Region(target.namespace, node, reason=f"{name}: an opaque quantization-library kernel fusepass "
                                                    f"has no form for; {advice}")


RULE = Rule(
    name="library_ops",
    forms=[],
    example_inputs=lambda dtype: [],
    find=find,
    doc=__doc__,
)
