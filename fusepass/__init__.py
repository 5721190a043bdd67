"""fusepass: a torch.compile backend that rewrites LLM subgraphs into fused Triton kernels.

    model = torch.compile(model, backend="fusepass")
    model(x)
    print(fusepass.last_report())

Public surface: :func:`last_report`, :func:`reset_reports`, :class:`Rule`,
:class:`Form`, :class:`NearMiss`, :func:`register_rule`, :func:`quantize`
(weight-only int8/int4/fp8 linears whose forward the rules fuse),
:func:`load_quantized` (GPTQ, AWQ, compressed-tensors and HQQ int4 checkpoints into them),
:func:`parallelize_module` (torch's, for a model quantized before it is sharded),
:mod:`fusepass.testing` and the ``fusepass`` command.  Importing fusepass registers its ops; rules
load lazily, on the first compile.
"""

from .checkpoints import load_quantized
from .kernels import _load as _load_ops
from .match import MatchInfo
from .quantize import parallelize_module, quantize
from .report import RewriteReport, last_report, reset_reports
from .rule import Form, NearMiss, Rule, get_rule, register_rule, rules, unregister_rule

_load_ops()

__version__ = "0.1.0"

__all__ = [
    "Form",
    "MatchInfo",
    "NearMiss",
    "RewriteReport",
    "Rule",
    "get_rule",
    "last_report",
    "load_quantized",
    "parallelize_module",
    "quantize",
    "register_rule",
    "reset_reports",
    "rules",
    "unregister_rule",
]
