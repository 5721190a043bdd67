"""Mixture-of-Experts: the router (``fusepass::moe_router``) and the experts
(``fusepass::moe_experts``) of a sparse MoE block, as transformers' MoE models
compute them.  Importing the package registers both ops."""

from fusepass.kernels.moe import experts, router  # noqa: F401 - registers the ops
from fusepass.kernels.moe.experts import moe_experts_plan, moe_experts_reference  # noqa: F401
from fusepass.kernels.moe.router import moe_router_reference  # noqa: F401

__all__ = ["experts", "router", "moe_experts_plan", "moe_experts_reference", "moe_router_reference"]
