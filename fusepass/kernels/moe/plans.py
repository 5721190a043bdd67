"""Measured plans for ``fusepass::moe_experts``: which path is fastest per
(GPU, dtype, format, E, H, I, k, token bucket), from ``python -m fusepass.bench.registry.moe``'s
sweep on that GPU.  A missing entry leaves the choice to the heuristic in
``experts.moe_experts_plan``."""

from __future__ import annotations

import torch

# Token counts are bucketed to the power of two at or above them.
# key: (gpu name, dtype name, fmt, E, H, I, k) -> {token bucket: plan}
# H100 entries: `python -m fusepass.bench.registry.moe` at 60833b8 (torch
# 2.11, Triton 3.6), the fastest path of its sweep per T; experts op alone,
# µs at T = 1 / 8 / 64 / 512 / 4096: Qwen3-30B-A3B decode 36.2, sorted 190.1 /
# 428.6 / 485.0, grouped_mm 1023.5 (sorted 1396.6); gpt-oss-20b decode 126.0,
# sorted 297.1.  grouped_mm from T = 2048, the heuristic's threshold (4096
# measured).
_H100 = "NVIDIA H100 80GB HBM3"
PLANS: dict[tuple[str, str, str, int, int, int, int], dict[int, str]] = {
    (_H100, "bfloat16", "none", 128, 2048, 768, 8): {1: "decode", 8: "sorted", 2048: "grouped_mm"},
    (_H100, "bfloat16", "int4", 128, 2048, 768, 8): {1: "decode"},
    (_H100, "bfloat16", "none", 32, 2880, 2880, 4): {1: "decode", 8: "sorted"},
}


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
