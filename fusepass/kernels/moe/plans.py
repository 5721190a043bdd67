"""Measured plans for ``fusepass::moe_experts``: which path is fastest per
(GPU, dtype, format, E, H, I, k, token bucket), from ``python -m fusepass.bench.registry.moe``'s
sweep on that GPU.  A missing entry leaves the choice to the heuristic in
``experts.moe_experts_plan``."""

from __future__ import annotations

import torch

# Token counts are bucketed to the power of two at or above them.
# key: (gpu name, dtype name, fmt, E, H, I, k) -> {token bucket: plan}
PLANS: dict[tuple[str, str, str, int, int, int, int], dict[int, str]] = {}


def bucket(T: int) -> int:
    return 1 << max(0, (T - 1).bit_length())


def lookup(T: int, E: int, H: int, I: int, k: int, dtype: torch.dtype, fmt: str,
           device: torch.device | None) -> str | None:
    if not PLANS or device is None or device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    entry = PLANS.get((name, str(dtype).removeprefix("torch."), fmt, E, H, I, k))
    if not entry:
        return None
    b = bucket(T)
    known = [t for t in sorted(entry) if t <= b]
    return entry[known[-1]] if known else None
