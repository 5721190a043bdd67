"""Mixture-of-Experts: the router (``fusepass::moe_router``) and the experts
(``fusepass::moe_experts``) of a sparse MoE block, as transformers' MoE models
compute them, and the router with the norm before it (``fusepass::add_rms_norm_router``).
Importing the package registers the ops."""

from fusepass.kernels.moe import experts, router, router_norm  # noqa: F401 - registers the ops
from fusepass.kernels.moe.experts import moe_experts_plan, moe_experts_reference  # noqa: F401
from fusepass.kernels.moe.router import moe_router_reference  # noqa: F401

__all__ = ["experts", "router", "router_norm", "moe_experts_plan", "moe_experts_reference", "moe_router_reference"]
